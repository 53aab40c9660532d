/* kernels/ref/trace.c: the per-thread stamps of the profiler (kernels/ops.h,
 * "per-thread spans"), which every kernel's parallel regions call.
 *
 * Design. Kernels take no context, so the profiler reaches their threads
 * through the thread that calls them: the armed trace is a _Thread_local
 * pointer (docs/design.md, "State outside a run context"), thread-local so that a
 * run sees only what its own recording thread armed (two runs in one
 * process do not meet). It lives beside the reference kernels, not in
 * registry.c, because they are built on their own too (tests/py/
 * test_ops_torch.py compiles src/kernels/ref and src/core alone). */
#include <omp.h>
#include <time.h>

#include "kernels/ops.h"

static _Thread_local kern_trace *armed_trace;

void kern_trace_arm(kern_trace *t) { armed_trace = t; }

kern_trace *kern_trace_armed(void) { return armed_trace && omp_get_level() == 0 ? armed_trace : NULL; }

static int64_t trace_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the profiler's clock: spans share its axis */
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void kern_trace_enter(kern_trace *t) {
    int i = omp_get_thread_num();
    if (i < t->n && !t->slot[i].first) t->slot[i].first = trace_now();
}

void kern_trace_exit(kern_trace *t) {
    int i = omp_get_thread_num();
    if (i < t->n) t->slot[i].last = trace_now();
}
