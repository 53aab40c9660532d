/* core/err.h: one error type for the whole program.
 *
 * Functions that can fail take a `ct_err *` and return 0 on success or the
 * error's code. The message names the file, key, or tensor at fault, so the
 * CLI only has to print it and exit with the code. No global "last error":
 * the caller owns the struct (it usually lives in the run context). */
#ifndef CT_CORE_ERR_H
#define CT_CORE_ERR_H

#include <stddef.h>

enum {
    CT_OK = 0,
    CT_ERR_IO = 1,      /* runtime failure: a file missing or unwritable, memory, a diverged run: exit 1 */
    CT_ERR_CONFIG = 2,  /* a bad value of the run's config (TOML, flags) or the model's config.json: exit 2 */
    CT_ERR_FORMAT = 3,  /* a malformed input file (safetensors, JSON, npy, tokenizer, checkpoint): exit 3 */
    CT_STOPPED = 4,     /* not an error: stopped by a signal after saving a checkpoint */
};

/* Exit status after SIGTERM/SIGINT: the step finished and a checkpoint was
 * written (EX_TEMPFAIL: a scheduler may requeue the job and it resumes). */
#define CT_EXIT_PREEMPTED 75

typedef struct {
    int code;
    char msg[1024];
    int all_ranks; /* every rank of a job reached this error together (a collective verdict):
                    * each can end on its own, no rank need abort the others. Last, so that
                    * code and msg keep their offsets (the tests' ctypes mirrors) */
} ct_err;

/* Sets e->code and e->msg (printf-style), clears e->all_ranks, and returns
 * code. e may be NULL. */
int ct_fail(ct_err *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Exit status for an error code: 0 ok, 1 runtime, 2 config, 3 format, 75 stopped
 * by a signal after saving (docs/reliability.md, "Exit codes"). */
int ct_exit_code(int code);

/* Allocation that dies with a clear message instead of returning NULL:
 * running out of memory mid-step leaves nothing to recover. */
void *ct_malloc(size_t n);
/* As ct_malloc, 64-byte aligned (freed with free()): scratch that kernels
 * walk with 64-byte vectors. malloc's 16-byte alignment (mmap'd blocks start
 * 16 bytes into a page) makes every such load and store span two cache
 * lines, which Intel cores pay for: the AVX-512 attention's backward ran
 * 15-17% faster on a Xeon with its scratch aligned (docs/benchmarks.md). */
void *ct_malloc64(size_t n);
/* Zeroed memory whose pages exist only once written (mmap, MAP_NORESERVE):
 * for buffers laid out over a whole model of which a run touches a part
 * (the gradients and moments of frozen tensors), so a model larger than
 * memory can still be addressed. Freed with ct_free_lazy and the same n. */
void *ct_alloc_lazy(size_t n);
void ct_free_lazy(void *p, size_t n);
/* Zeroed memory, as ct_calloc, for the large buffers a step walks with
 * strides of pages: activation rows 4-12 KB apart, weight and gradient rows
 * a GEMM tile reads 6 at a time. From 64 MB up it is its own mapping, 2 MB
 * aligned and advised for transparent huge pages (MADV_HUGEPAGE; nothing
 * changes where THP is off), so each 2 MB faults in as one page and one TLB
 * entry instead of 512: W3 steps ran 2-5% faster (docs/benchmarks.md). Pages
 * still exist only once touched, as calloc's. Freed with ct_free_huge and
 * the same n. */
void *ct_alloc_huge(size_t n);
void ct_free_huge(void *p, size_t n);
/* Gives back the whole pages inside [p, p + n bytes) (MADV_DONTNEED: they
 * read as zeros until written again); the partial pages at either end,
 * which neighbouring data may share, are kept. A huge page partly inside
 * the range is split by the kernel, its memory freed at the split. */
void ct_drop_pages(void *p, size_t n);
/* Sets the n bytes at p to `byte` on every thread, each writing its share in
 * 2 MB chunks. Uses: bringing in the pages of zeroed memory not yet touched
 * (byte 0), each on one write fault, for buffers a step reads before it
 * writes (gradients summed with +=, AdamW's moments): a calloc page read
 * first maps the shared zero page, and the write after it takes a second
 * fault, a copy and a TLB shoot-down sent to every other thread (the
 * trainer's prefault_accumulators); and pushing every core's caches out
 * (`kernels bench --cold`, kernels/timing.c). */
void ct_fill(void *p, int byte, size_t n);
void *ct_calloc(size_t n, size_t size);
char *ct_strdup(const char *s);

#endif
