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
    e->all_ranks = 0;
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

void *ct_malloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) oom(n);
    return p;
}

void *ct_malloc64(size_t n) {
    if (n > SIZE_MAX - 63) oom(n); /* its rounding up would wrap */
    void *p = aligned_alloc(64, n ? (n + 63) & ~(size_t)63 : 64); /* aligned_alloc wants a multiple */
    if (!p) oom(n);
    return p;
}

void *ct_calloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) oom(n * size);
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

enum { HUGE_PAGE = 1 << 21 };
/* From 64 MB up: a huge page that is touched is resident whole, so a buffer
 * may hold up to 2 MB more than it writes (its last page, or one only partly
 * used); at 32 pages or more that is at most 1/32 of it. A smaller buffer,
 * with few rows per page anyway, stays in 4 KB pages. */
#define HUGE_MIN (32 * (size_t)HUGE_PAGE)

static size_t huge_bytes(size_t n) { return (n + HUGE_PAGE - 1) / HUGE_PAGE * HUGE_PAGE; }

void *ct_alloc_huge(size_t n) {
    if (n < HUGE_MIN) return ct_calloc(n ? n : 1, 1);
    if (n > SIZE_MAX - 3 * (size_t)HUGE_PAGE) oom(n); /* the rounding and span below would wrap */
    /* one huge page more than needed, then the unaligned head and the tail
     * unmapped: mmap aligns to 4 KB only, and a 2 MB page needs a 2 MB-aligned
     * range inside the mapping */
    size_t bytes = huge_bytes(n), span = bytes + HUGE_PAGE;
    char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) oom(n);
    char *p = (char *)(((uintptr_t)raw + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    size_t head = (size_t)(p - raw), tail = span - head - bytes;
    if (head) munmap(raw, head);
    if (tail) munmap(p + bytes, tail);
    madvise(p, bytes, MADV_HUGEPAGE); /* advice: where THP is off or no huge page is free, 4 KB pages as before */
    return p;
}

void ct_free_huge(void *p, size_t n) {
    if (!p) return;
    if (n < HUGE_MIN) free(p);
    else munmap(p, huge_bytes(n));
}

void ct_drop_pages(void *p, size_t n) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)p, hi = lo + n;
    lo = (lo + page - 1) / page * page;
    hi = hi / page * page;
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

void ct_fill(void *p, int byte, size_t n) {
    enum { CHUNK = 1 << 21 }; /* 2 MB: 512 pages a chunk, the faults shared between threads */
    char *b = p;
    long nc = (long)((n + CHUNK - 1) / CHUNK);
#ifdef _OPENMP /* core/ also builds without OpenMP (the tokenizer's test library) */
#pragma omp parallel for schedule(static) if (nc > 1)
#endif
    for (long i = 0; i < nc; i++) {
        size_t lo = (size_t)i * CHUNK, len = n - lo < CHUNK ? n - lo : CHUNK;
        memset(b + lo, byte, len);
    }
}
