/* core/device.h: where the memory that kernels touch lives, and how it is
 * allocated, copied and given back.
 *
 * The model allocates its flat parameter and gradient buffers, its
 * activation arena and its pipeline banks through a ct_device, never with
 * malloc directly, so a backend with memory of its own (a GPU) supplies
 * this table and a folder of kernels registered under the same name
 * (kern_impl.device; the registry picks only the run's device's), and the
 * model, the trainer and the layouts stay as they are. The CPU device is
 * host memory: zeroed allocations (from 64 MB up on huge pages:
 * ct_alloc_huge), lazily mapped buffers whose pages exist only where written
 * (frozen tensors' gradients and moments), and page dropping (FSDP frees a
 * gathered layer that way). */
#ifndef CT_CORE_DEVICE_H
#define CT_CORE_DEVICE_H

#include <stddef.h>

typedef struct ct_device {
    const char *name;                                   /* the kernels' device: "cpu" */
    void *(*alloc)(size_t bytes);                        /* zeroed; exits on failure, as ct_calloc (CPU: ct_alloc_huge) */
    void *(*alloc_lazy)(size_t bytes);                   /* zeroed, backed only where written */
    void (*free)(void *p, size_t bytes, int lazy);       /* lazy: it came from alloc_lazy */
    void (*copy)(void *dst, const void *src, size_t bytes);     /* within the device */
    void (*to_host)(void *host, const void *src, size_t bytes); /* for checkpoints and logs */
    void (*from_host)(void *dst, const void *host, size_t bytes);
    void (*drop)(void *p, size_t bytes);                 /* give the pages back; they read as zeros */
} ct_device;

extern const ct_device ct_device_cpu;

#endif
