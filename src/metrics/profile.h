/* metrics/profile.h: the profiler trace ([profiling], torchtitan's keys).
 *
 * Design. A prof is an object the trainer owns and lends, by pointer, to the
 * model (lm_model.prof), the communicators (ct_comm.prof) and the plan: NULL
 * when profiling is off, so every hook costs one predictable branch on a
 * pointer the call site already has in hand. The trainer lends it only for
 * a traced step (plan_profile before prof_step_begin, NULL again after), so
 * the other steps of a profiled run cost the same; a hook that still holds
 * it outside a step (a test's) records nothing.
 *
 * A span is timed at its call site (PROF_T0 before, prof_* after) and
 * appended to an in-memory array; nothing is written during the step, so the
 * trace neither perturbs the step with I/O nor can be left half-written:
 * prof_step_end writes the whole step at once through a temporary file and a
 * rename (Trace Event Format, the JSON that Perfetto and chrome://tracing
 * open). Spans are "complete" events (ph "X": ts and dur in microseconds of
 * CLOCK_MONOTONIC, so ranks of one host share a time axis), pid = rank, tid =
 * the recording thread, with metadata events naming the process "rank R" and
 * the thread. Categories: "step", "phase" (forward_backward, reduce,
 * optimizer), "layer" (one per layer and direction, args.layer), "op" (one
 * per kernel call, args.op and args.impl: the registry's op and chosen
 * implementation, as `ctitan: kernels:` names them; the MoE router, which is
 * model code around a registry matmul, as op "moe_route", impl "matmul:<impl>"),
 * "collective" (args.bytes,
 * count, dtype, op, comm).
 *
 * Recording is single-threaded: spans come from the thread that runs the
 * step (the model's kernel calls and the layouts' collectives are all made
 * there). What the OpenMP threads do inside a kernel comes back through the
 * kern_trace the step arms on that thread (kernels/ops.h): each parallel
 * region stamps its thread's slot on entry and exit, and when an op span
 * closes, each thread that ran a region of it becomes a span "thread" (the
 * op's name and args) on a track of its own, tid = its OpenMP number, named
 * "omp worker N", lying in time within the op's span. Slots are cleared when
 * any span opens, so a thread's span is its first entry to last exit within
 * that one op call: one span per thread per op, not per region or loop.
 * Every step's op and collective time is also summed per (name, op, impl)
 * for the table prof_summary prints at the end of the run. */
#ifndef CT_METRICS_PROFILE_H
#define CT_METRICS_PROFILE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "core/err.h"
#include "kernels/registry.h"

typedef struct prof prof;

/* A profiler for rank `rank`, writing under `folder` (the traces folder:
 * iteration_{step}/rank{R}_trace.json). Never NULL. */
prof *prof_new(int rank, const char *folder);
void prof_free(prof *p);
/* The implementations the model's kernel calls resolve to (after
 * kern_select and kern_use_bf16_matmuls: a bf16 run's matmul spans name the
 * matmul_bf16 op). Call again if the model's kern_ops change. */
void prof_set_kernels(prof *p, const kern_ops *k);

/* Records the spans of step `step` until prof_step_end, which writes them
 * (atomically) and adds them to the summary. CT_ERR_IO naming the file. */
void prof_step_begin(prof *p, int step);
int prof_step_end(prof *p, ct_err *e);
/* 1 between prof_step_begin and prof_step_end. */
int prof_recording(const prof *p);
/* The path prof_step_end writes for `step` (for messages and tests). */
void prof_trace_path(const prof *p, int step, char *out, size_t cap);

/* Monotonic nanoseconds: the start of a span. */
int64_t prof_now_ns(void);
/* A span's start: now while recording, else 0 (the caller's span is dropped). */
#define PROF_T0(p) ((p) ? prof_t0(p) : 0)
int64_t prof_t0(const prof *p);

/* Spans ending now, from t0. Names, categories and keys are not copied:
 * they must outlive the step (string literals, kern_op names). */
void prof_span(prof *p, const char *cat, const char *name, int64_t t0);
/* kernel `op` (a kern_op) called through its kern_ops member `name` */
void prof_kern(prof *p, int op, const char *name, int64_t t0);
/* a model op outside the kernel registry, `name` (e.g. "moe_route_fwd") of op
 * `op`, whose matmul runs the registry's kernel `kern_op`: the span's impl says
 * so ("matmul:avx512"). The MoE router is one: its small [N, E] matmul goes
 * through the kernels, its softmax and top-k are plain code in model/moe.c. */
void prof_model_op(prof *p, const char *name, const char *op, int kern, int64_t t0);
/* kern_op of a model op that runs no registry kernel at all (the gradient
 * norm, zeroing a layer's gradient scratch): its impl reads "model", the
 * OpenMP loops of the model code, whose threads stamp their spans as the
 * kernels' do. */
#define PROF_NO_KERNEL (-1)
/* layer l's forward ("layer_fwd") or backward ("layer_bwd") */
void prof_layer(prof *p, const char *name, int l, int64_t t0);
/* a collective of `bytes` (what this rank's buffers hold of it: the whole
 * gathered or reduced extent), `count` elements of dtype on a group of size */
void prof_comm(prof *p, const char *name, int64_t t0, size_t bytes, size_t count, const char *dtype,
               const char *op, int comm_size);

/* Times a statement as a span of the profiler p (NULL: just runs it). */
#define PROF_SPAN(p, cat, name, stmt)                                                                            \
    do {                                                                                                         \
        prof *prof_p_ = (p);                                                                                     \
        int64_t prof_t0_ = PROF_T0(prof_p_);                                                                     \
        stmt;                                                                                                    \
        if (prof_p_) prof_span(prof_p_, cat, name, prof_t0_);                                                    \
    } while (0)

/* The table of op and collective time over every traced step: name, op,
 * implementation (or group size), calls, total ms, % of traced step time.
 * Nothing if no step was traced. */
void prof_summary(const prof *p, FILE *out);
/* The summary's raw figures, for tests: row i's total ns and calls (-1 past
 * the end). */
int64_t prof_summary_ns(const prof *p, int i, long *calls, const char **name);

/* ------------------------------------------------------- memory snapshot */

/* One category of memory: what the dry run plans and what this process holds. */
typedef struct {
    const char *name;
    double planned, measured; /* bytes; measured < 0: not measured */
} prof_mem;

/* {dir}/rank{R}_memory_snapshot.json (dir created): the categories, their
 * totals and the peak RSS, written atomically; and a short table on `log`
 * (NULL: none). */
int prof_memory_snapshot(const char *dir, int rank, int step, const prof_mem *cats, int n, double peak_rss,
                         FILE *log, ct_err *e);

#endif
