/* tests/c/test_err.c: core/err.h's ct_calloc gives the large buffers
 * transparent huge pages (ct_advise_huge: MADV_HUGEPAGE, which the kernel
 * shows as the "hg" VmFlag of the mapping in /proc/self/smaps) and leaves
 * the small ones alone; ct_malloc (per-call scratch: the attention kernels'
 * transposed k/v) and the lazily mapped buffers get no advice. The model's
 * buffers (params, grads, activations) come from ct_device_cpu.alloc, the
 * AdamW moments from ct_calloc: both are checked. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "check.h"
#include "core/device.h"
#include "core/err.h"

#define MB ((size_t)1 << 20)

/* The mapping of /proc/self/smaps that holds addr: its VmFlags line into
 * flags and its AnonHugePages (kB) into *huge_kb. 0 when found. */
static int mapping_of(const void *addr, char *flags, size_t cap, long *huge_kb) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int in = 0, found = -1;
    uintptr_t a = (uintptr_t)addr;
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi;
        char dash;
        if (sscanf(line, "%lx%c%lx ", &lo, &dash, &hi) == 3 && dash == '-') {
            if (in) break; /* past the mapping's block */
            in = a >= lo && a < hi;
            continue;
        }
        if (!in) continue;
        if (!strncmp(line, "AnonHugePages:", 14)) *huge_kb = atol(line + 14);
        if (!strncmp(line, "VmFlags:", 8)) {
            size_t n = strlen(line + 8);
            if (n >= cap) n = cap - 1;
            memcpy(flags, line + 8, n);
            flags[n] = 0;
            found = 0;
        }
    }
    fclose(f);
    return found;
}

/* 1 when the mapping holding addr is advised for huge pages, 0 when not,
 * -1 when it cannot be found. */
static int advised(const void *addr, long *huge_kb) {
    char flags[256];
    *huge_kb = 0;
    if (mapping_of(addr, flags, sizeof flags, huge_kb)) return -1;
    return strstr(flags, " hg") != NULL;
}

/* The THP mode in brackets of /sys/kernel/mm/transparent_hugepage/enabled,
 * or "" when the kernel has no THP (not Linux, or built without it). */
static void thp_mode(char *mode, size_t cap) {
    mode[0] = 0;
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    if (!f) return;
    char line[128];
    if (fgets(line, sizeof line, f)) {
        char *l = strchr(line, '['), *r = l ? strchr(l, ']') : NULL;
        if (l && r) snprintf(mode, cap, "%.*s", (int)(r - l - 1), l + 1);
    }
    fclose(f);
}

int main(void) {
    char mode[32];
    thp_mode(mode, sizeof mode);
    long kb;

    /* small, lazy and ct_malloc buffers: no advice (first, so no advised
     * range of the heap can hold them) */
    char *small = ct_calloc(64, 1024);
    memset(small, 1, 64 * 1024);
    CHECK(advised(small, &kb) == 0, "a 64 KB ct_calloc buffer is advised for huge pages");
    size_t nl = 64 * MB;
    char *lazy = ct_alloc_lazy(nl);
    lazy[nl / 2] = 1;
    CHECK(advised(lazy + nl / 2, &kb) == 0, "a lazily mapped buffer is advised for huge pages");

    size_t nm = 64 * MB;
    char *m = ct_malloc(nm);
    memset(m, 2, nm);
    CHECK(advised(m + nm / 2, &kb) == 0, "a ct_malloc buffer is advised for huge pages");

    /* ct_calloc (the AdamW moments) and the device's alloc (params, grads,
     * activations): still zeroed, then written (faulted in) */
    size_t nc = 48 * MB;
    float *c = ct_calloc(nc / sizeof(float), sizeof(float));
    int zero = 1;
    for (size_t i = 0; i < nc / sizeof(float); i += 4099) zero &= c[i] == 0.0f;
    CHECK(zero, "ct_calloc's buffer is not zeroed");
    unsigned char *d = ct_device_cpu.alloc(nc);
    zero = 1;
    for (size_t i = 0; i < nc; i += 4099) zero &= d[i] == 0;
    memset(c, 3, nc);
    CHECK(zero, "the device's buffer is not zeroed");
    memset(d, 3, nc);

    if (!mode[0] || !strcmp(mode, "never")) {
        /* not a pass: the huge-page checks did not run */
        printf("skip: the huge-page advice checks: this kernel has no transparent huge pages (%s)\n",
               mode[0] ? "THP mode \"never\"" : "no /sys/kernel/mm/transparent_hugepage/enabled");
    } else {
        int a = advised((char *)c + nc / 2, &kb);
        CHECK(a == 1, "ct_calloc(%zu): its mapping is %s", nc, a < 0 ? "not in smaps" : "not advised (no hg VmFlag)");
        a = advised(d + nc / 2, &kb);
        CHECK(a == 1, "ct_device_cpu.alloc(%zu): its mapping is %s", nc, a < 0 ? "not in smaps" : "not advised (no hg VmFlag)");
        /* whether the kernel found free 2 MB pages depends on the machine's
         * memory (fragmentation), so it is reported, not checked */
        printf("THP mode %s: AnonHugePages %ld kB of the device buffer's mapping (%zu kB)\n", mode, kb, nc >> 10);
    }

    free(small);
    ct_free_lazy(lazy, nl);
    free(m);
    free(c);
    ct_device_cpu.free(d, nc, 0);
    return CHECK_DONE();
}
