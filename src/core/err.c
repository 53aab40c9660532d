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

void *ct_malloc(size_t n) {
    void *p = malloc(n ? n : 1);
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
