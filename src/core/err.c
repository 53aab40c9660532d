/* core/err.c: error reporting and checked allocation. */
#include "core/err.h"

#include <sys/mman.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int ct_fail(ct_err *e, int code, const char *fmt, ...) {
    if (!e) return code;
    e->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
    return code;
}

int ct_exit_code(int code) {
    if (code == CT_STOPPED) return CT_EXIT_PREEMPTED;
    if (code == CT_ERR_CONFIG || code == CT_ERR_FORMAT) return code;
    return code ? 1 : 0;
}

static void oom(size_t n) {
    fprintf(stderr, "ctitan: error: out of memory allocating %zu bytes\n", n);
    exit(1);
}

/* Transparent huge pages for the large long-lived buffers (issue 14).
 *
 * The machines we run on are often VMs, where a TLB miss is a nested page
 * walk (guest tables, each step translated through the host's), so the
 * memory-bound passes over large buffers (AdamW over params, grads and
 * moments, element-wise ops, zeroing the gradient scratch, GEMM packing from
 * the activations, attention's head rows 4-8 KB apart) pay for 4 KB pages.
 * Distributions ship THP as "madvise" (huge pages only where asked) and
 * glibc never asks unless its glibc.malloc.hugetlb tunable is set, so ctitan
 * got none (AnonHugePages 0). With that tunable W3's steady steps measured
 * about 3% faster (page faults 465k -> 10k), but it advises every chunk.
 *
 * So ct_calloc advises the 2 MB-aligned interior of buffers of at least
 * CT_HUGE_MIN bytes (ct_advise_huge). Those are the long-lived ones: the
 * device's alloc (params, grads, the activation arena, pipeline banks) and
 * the AdamW moments. calloc maps such a chunk fresh and skips zeroing it, so
 * the advice comes before the first touch and the pages fault in as 2 MB
 * ones; at most 2 MB at either end stays on 4 KB pages. ct_malloc gives no
 * advice: its large callers are per-call scratch (attention's transposed
 * k/v, 4 MB on W3), which after the first call lives in malloc's heap on
 * pages already faulted in; advising it (2 MB-aligned) measured no different.
 * Lazily mapped buffers (ct_alloc_lazy) get none either: they are meant to
 * hold pages only where written. Placement only: no result changes. Off
 * Linux, or where the kernel has no THP, a no-op.
 *
 * The price is the first touch. On our Firecracker VM (free page reporting:
 * free 2 MB+ blocks are handed back to the host, which must back them again)
 * a fresh 2 MB page is zeroed at ~0.5 GB/s against ~3 GB/s for 4 KB pages,
 * which come from small free blocks the host still backs (1 GB touched:
 * 2.2 s against 0.35 s; a huge page freed a moment before: 0.05 s). So a W3
 * run pays ~1.5-4 s once, in step 1 (clear_page_erms under gemm_rect and
 * AdamW), for ~2% less CPU per steady step (docs/benchmarks.md, issue 14's
 * THP section). On bare metal huge pages fault faster than 4 KB ones. */
#define CT_HUGE_PAGE ((size_t)2 << 20)

void ct_advise_huge(void *p, size_t n) {
#ifdef MADV_HUGEPAGE
    if (!p || n < CT_HUGE_MIN) return;
    uintptr_t lo = ((uintptr_t)p + CT_HUGE_PAGE - 1) & ~(uintptr_t)(CT_HUGE_PAGE - 1);
    uintptr_t hi = ((uintptr_t)p + n) & ~(uintptr_t)(CT_HUGE_PAGE - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE); /* EINVAL without THP: nothing to do */
#else
    (void)p, (void)n;
#endif
}

void *ct_malloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) oom(n);
    return p;
}

void *ct_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) oom(n * size);
    if (size && n >= CT_HUGE_MIN / size) ct_advise_huge(p, n * size);
    return p;
}

char *ct_strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = ct_malloc(n);
    memcpy(p, s, n);
    return p;
}

void *ct_alloc_lazy(size_t n) {
    if (!n) n = 1;
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) oom(n);
    return p;
}

void ct_free_lazy(void *p, size_t n) {
    if (p) munmap(p, n ? n : 1);
}

void ct_drop_pages(void *p, size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)p, hi = lo + n;
    lo = (lo + page - 1) / page * page;
    hi = hi / page * page;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}
