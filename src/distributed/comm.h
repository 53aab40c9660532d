/* distributed/comm.h: one communicator interface over several backends.
 *
 * A ct_comm is a group of ranks with the collectives the layouts need:
 * all-reduce (sum, max), reduce-scatter (sum), all-gather, broadcast,
 * all-to-all(v), barrier, point-to-point send/receive, and non-blocking all-gather / reduce-scatter /
 * all-reduce completed by comm_wait. Backends sit behind a table of
 * functions: "single" (one process, no MPI: every collective is a copy or
 * nothing) and "mpi" (OpenMPI); an NCCL backend for GPUs would be a third
 * table with the same entries.
 *
 * Sums are deterministic and in rank order. MPI_Allreduce and
 * MPI_Reduce_scatter may add the ranks' contributions in an order that
 * depends on the algorithm MPI picks (message size, world size, tuning), so
 * two layouts could round differently and ranks could even disagree. Here a
 * float sum is an all-to-all of the chunks followed by a local sum in rank
 * order 0, 1, ..., N-1 (then an all-gather for all-reduce): every rank gets
 * the same bits, the result is independent of the MPI algorithm, and it is
 * the same left-to-right order as a one-rank run accumulating N
 * micro-batches. The traffic is that of a ring (each element crosses the
 * network twice), so nothing is lost in bandwidth on CPU clusters.
 *
 * Failures inside a collective are fatal (MPI's default error handler): a
 * collective that cannot complete leaves no state worth recovering, and
 * comm_abort ends every rank of the job. */
#ifndef CT_DISTRIBUTED_COMM_H
#define CT_DISTRIBUTED_COMM_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

/* COMM_BF16: 16-bit bfloat16 words, only moved (gathers, all-to-all), never summed:
 * FSDP's bf16-stored frozen weights (distributed/fsdp.h). */
typedef enum { COMM_F32, COMM_F64, COMM_I32, COMM_I64, COMM_BF16 } comm_dtype;
typedef enum { COMM_SUM, COMM_MAX } comm_op;

typedef struct ct_comm ct_comm;
typedef struct comm_req comm_req;

/* One backend: every entry is required. Counts are elements of `t`. */
typedef struct {
    const char *name;
    void (*allreduce)(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_op op);
    void (*reduce_scatter)(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t);
    void (*all_gather)(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t);
    void (*broadcast)(ct_comm *c, void *buf, size_t n, comm_dtype t, int root);
    void (*all_to_allv)(ct_comm *c, void *out, const size_t *rcounts, const size_t *rdispls, const void *in,
                        const size_t *scounts, const size_t *sdispls, comm_dtype t);
    void (*barrier)(ct_comm *c);
    /* non-blocking: start fills *r, wait completes it */
    void (*iall_gather)(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r);
    void (*ireduce_scatter)(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r);
    void (*iallreduce)(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_req *r);
    /* point to point (pipeline stages): tag tells apart messages between one pair */
    void (*isend)(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag, comm_req *r);
    void (*irecv)(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag, comm_req *r);
    void (*wait)(comm_req *r);
    void (*test)(comm_req *r); /* progress only; the request stays pending until wait */
    int (*split)(ct_comm *c, int color, int key, ct_comm *out, ct_err *e);
    void (*free)(ct_comm *c);
    void (*abort)(ct_comm *c, int code);
} comm_backend;

struct ct_comm {
    const comm_backend *be;
    int rank, size;
    void *impl;       /* backend state (MPI: the MPI_Comm) */
    int owns_runtime; /* the world communicator that started MPI and finalises it */
    struct prof *prof; /* NULL: not profiled; else every call is a "collective" span (metrics/profile.h) */
};

/* A pending non-blocking collective; lives with the caller until comm_wait. */
struct comm_req {
    ct_comm *c;
    int active;
    void *impl;       /* backend state, freed by comm_wait */
};

/* The world: MPI when this process was started by an MPI launcher (mpirun
 * sets OMPI_COMM_WORLD_SIZE or PMIX_RANK), else the single-process backend.
 * MPI_Init is skipped without a launcher on purpose: as a singleton it costs
 * ~0.35 s per start and ~0.05 s at exit for nothing. CTITAN_COMM=single
 * forces the single backend. */
int comm_init_world(ct_comm *c, int *argc, char ***argv, ct_err *e);
/* The single-process backend (rank 0 of 1). */
void comm_init_single(ct_comm *c);
/* Ranks with the same color form a new communicator, ordered by key. */
int comm_split(ct_comm *c, int color, int key, ct_comm *out, ct_err *e);
/* Frees a communicator; the world one also finalises MPI. */
void comm_free(ct_comm *c);
/* Ends every rank of the job with exit status `code` (never returns). */
void comm_abort(ct_comm *c, int code) __attribute__((noreturn));

/* buf[n] (in place) = the sum (rank order) or max over ranks. */
void comm_allreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_op op);
/* out[n] = sum over ranks r (in rank order) of in_r[rank * n .. rank * n + n). in: [size * n].
 * out may be in + rank * n (in place, as NCCL allows); no other overlap. */
void comm_reduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t);
/* out[size * n]: rank r's in[n] at out + r * n. */
void comm_all_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t);
void comm_broadcast(ct_comm *c, void *buf, size_t n, comm_dtype t, int root);
/* in[size * n]: block r goes to rank r; out[size * n]: block r came from rank r. */
void comm_all_to_all(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t);
/* lo[n], hi[n] = the least and the greatest of each x[i] over the ranks, in one
 * all-reduce (the MAX of x and of -x): every rank holds the same x[i] iff
 * lo[i] == hi[i]. For the ranks to check they agree on what each read for
 * itself (a config, a checkpoint, a data file); no x[i] may be INT64_MIN. */
void comm_range_i64(ct_comm *c, const int64_t *x, int64_t *lo, int64_t *hi, size_t n);
/* Every rank learns whether any failed (rc != 0) at a point every rank reaches
 * (what: "open its data", "plan its pipeline"), so that none waits in the next
 * collective; every rank calls it, a failed one too. The lowest failing rank's
 * error reaches rank 0, whose message is the one printed; the failure becomes
 * a verdict every rank has (e->all_ranks). Returns the code to end with: this
 * rank's own, or the relayed error's (train/trainer.h trainer_agree). */
int comm_agree(ct_comm *w, int rc, const char *what, ct_err *e);
/* Counts and displacements in elements, [size] each. */
void comm_all_to_allv(ct_comm *c, void *out, const size_t *rcounts, const size_t *rdispls, const void *in,
                      const size_t *scounts, const size_t *sdispls, comm_dtype t);
void comm_barrier(ct_comm *c);
/* Non-blocking forms; the buffers must stay untouched until comm_wait(r). */
void comm_iall_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r);
void comm_ireduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r);
void comm_iallreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_req *r);
void comm_wait(comm_req *r);
/* Point to point: n elements to / from one rank of c. A message is matched
 * by (source, tag) in the order it was sent, so a pipeline stage may post
 * every receive of a step up front. Blocking forms are isend/irecv + wait. */
void comm_isend(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag, comm_req *r);
void comm_irecv(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag, comm_req *r);
void comm_send(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag);
void comm_recv(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag);
/* Lets a pending request progress without waiting for it; comm_wait must
 * still complete it. OpenMPI (without a progress thread) moves a
 * non-blocking collective forward only inside MPI calls, so code that
 * overlaps one with computation calls this between pieces of work. */
void comm_test(comm_req *r);

size_t comm_dtype_size(comm_dtype t);
/* Sums src[n] into dst[n] (dst += src) in dtype t; the one place the
 * rank-order sums of every backend are done. */
void comm_sum_into(void *dst, const void *src, size_t n, comm_dtype t);

/* Backends. comm_mpi_init_world is defined in comm_mpi.c. */
extern const comm_backend comm_single_backend;
int comm_mpi_init_world(ct_comm *c, int *argc, char ***argv, ct_err *e);

#endif
