/* core/device.c: the CPU device (see device.h): host memory through the
 * allocators of core/err.h. */
#include "core/device.h"

#include <stdlib.h>
#include <string.h>

#include "core/err.h"

static void *cpu_alloc(size_t bytes) { return ct_alloc_huge(bytes); }
static void *cpu_alloc_lazy(size_t bytes) { return ct_alloc_lazy(bytes); }
static void cpu_free(void *p, size_t bytes, int lazy) {
    if (lazy) ct_free_lazy(p, bytes);
    else ct_free_huge(p, bytes);
}
static void cpu_copy(void *dst, const void *src, size_t bytes) { memcpy(dst, src, bytes); }
static void cpu_drop(void *p, size_t bytes) { ct_drop_pages(p, bytes); }

const ct_device ct_device_cpu = {"cpu", cpu_alloc, cpu_alloc_lazy, cpu_free, cpu_copy, cpu_copy, cpu_copy, cpu_drop};
