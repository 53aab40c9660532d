/* distributed/comm_mpi.c: the MPI backend (OpenMPI from Debian's packages).
 *
 * Float sums never use MPI_SUM: an all-to-all brings every rank's copy of
 * one chunk to the chunk's owner, which adds them in rank order (see
 * comm.h for why). Integer sums and maxima are exact whatever the order and
 * go through MPI_Allreduce. MPI counts are ints, so the all-reduce walks
 * big buffers in blocks; the other collectives refuse counts past INT_MAX
 * with a message (the layouts call them per layer, far below that).
 *
 * MPI is called only from the main thread (OpenMP threads do the math), so
 * MPI_THREAD_FUNNELED is all this asks for.
 *
 * Built with -DCT_NO_MPI (the aarch64 cross build: Debian's OpenMPI is not
 * co-installable for two architectures), the file is only a stub whose
 * comm_mpi_init_world fails with a message, so a run under mpirun stops
 * cleanly and a single-process run never notices. */
#ifdef CT_NO_MPI
#include "distributed/comm.h"

int comm_mpi_init_world(ct_comm *c, int *argc, char ***argv, ct_err *e) {
    (void)c, (void)argc, (void)argv;
    return ct_fail(e, CT_ERR_CONFIG,
                   "launched under an MPI launcher, but this ctitan was built without MPI (CT_NO_MPI); "
                   "run it as a single process or set CTITAN_COMM=single");
}
#else
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <mpi.h>

#include "distributed/comm.h"

/* Elements of the receive buffer of the blocking float sums: big buffers go
 * through in blocks of this many, so a 100M-parameter all-reduce does not
 * cost another 100M floats of memory per rank. */
#define SCRATCH_ELEMS ((size_t)1 << 22)

typedef struct {
    MPI_Comm comm;
    void *scratch;       /* grow-only receive buffer of the blocking sums */
    size_t scratch_bytes;
} mpi_impl;

typedef struct {
    int kind;            /* REQ_* */
    MPI_Request req;
    void *recv;          /* reduce-scatter / all-reduce: the gathered copies */
    void *out;
    size_t n;
    comm_dtype t;
    /* all-reduce second phase */
    int *cnt, *dis;
} mpi_req;

enum { REQ_GATHER, REQ_RS, REQ_AR, REQ_P2P };

static MPI_Comm mcomm(const ct_comm *c) { return ((const mpi_impl *)c->impl)->comm; }

static MPI_Datatype mtype(comm_dtype t) {
    switch (t) {
    case COMM_F32: return MPI_FLOAT;
    case COMM_F64: return MPI_DOUBLE;
    case COMM_I32: return MPI_INT32_T;
    case COMM_I64: return MPI_INT64_T;
    case COMM_BF16: return MPI_UINT16_T; /* moved, never reduced */
    }
    return MPI_BYTE;
}

static int mcount(ct_comm *c, size_t n, const char *what) {
    if (n > (size_t)INT_MAX) {
        fprintf(stderr, "ctitan: error: [rank %d] %s of %zu elements exceeds MPI's int count\n", c->rank, what, n);
        MPI_Abort(mcomm(c), 1);
    }
    return (int)n;
}

static void *scratch(ct_comm *c, size_t bytes) {
    mpi_impl *m = c->impl;
    if (bytes > m->scratch_bytes) {
        free(m->scratch);
        m->scratch = ct_malloc(bytes);
        m->scratch_bytes = bytes;
    }
    return m->scratch;
}

/* out[n] = recv block 0 + block 1 + ... in rank order; recv: [size * n]. */
static void sum_blocks(void *out, const void *recv, int size, size_t n, comm_dtype t) {
    size_t es = comm_dtype_size(t);
    memcpy(out, recv, n * es);
    for (int r = 1; r < size; r++) comm_sum_into(out, (const char *)recv + (size_t)r * n * es, n, t);
}

static void m_reduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    int cnt = mcount(c, n, "reduce-scatter");
    mcount(c, n * (size_t)c->size, "reduce-scatter"); /* the displacements below are ints */
    size_t es = comm_dtype_size(t);
    if (t == COMM_I32 || t == COMM_I64) {
        int *counts = ct_malloc((size_t)c->size * sizeof(int));
        for (int r = 0; r < c->size; r++) counts[r] = cnt;
        void *res = scratch(c, n * es); /* MPI forbids out inside in; comm.h allows it */
        MPI_Reduce_scatter(in, res, counts, mtype(t), MPI_SUM, mcomm(c));
        memcpy(out, res, n * es);
        free(counts);
        return;
    }
    /* in column blocks, so the receive buffer stays SCRATCH_ELEMS whatever n is */
    int size = c->size;
    size_t kb_max = SCRATCH_ELEMS / (size_t)size;
    if (kb_max < 1) kb_max = 1;
    void *recv = scratch(c, (size_t)size * (n < kb_max ? n : kb_max) * es);
    int *v = ct_malloc(4 * (size_t)size * sizeof(int));
    for (size_t k0 = 0; k0 < n; k0 += kb_max) {
        int kb = (int)(n - k0 < kb_max ? n - k0 : kb_max);
        for (int r = 0; r < size; r++) {
            v[r] = kb;
            v[size + r] = (int)((size_t)r * n + k0);
            v[2 * size + r] = kb;
            v[3 * size + r] = r * kb;
        }
        MPI_Alltoallv(in, v, v + size, mtype(t), recv, v + 2 * size, v + 3 * size, mtype(t), mcomm(c));
        sum_blocks((char *)out + k0 * es, recv, size, (size_t)kb, t);
    }
    (void)cnt;
    free(v);
}

/* Chunk r of an n-element buffer split in `size` pieces of ceil(n / size). */
static void chunks(int size, size_t n, int *cnt, int *dis) {
    size_t chunk = (n + (size_t)size - 1) / (size_t)size;
    for (int r = 0; r < size; r++) {
        size_t lo = (size_t)r * chunk, hi = lo + chunk < n ? lo + chunk : n;
        cnt[r] = lo < n ? (int)(hi - lo) : 0;
        dis[r] = lo < n ? (int)lo : (int)n;
    }
}

/* Phase 1 of the float all-reduce: my chunk's copies from every rank into recv. */
static void ar_exchange_args(int size, int me, const int *cnt, int *rcnt, int *rdis) {
    for (int r = 0; r < size; r++) {
        rcnt[r] = cnt[me];
        rdis[r] = r * cnt[me];
    }
}

static void m_allreduce_block(ct_comm *c, void *buf, size_t n, comm_dtype t) {
    int size = c->size, me = c->rank;
    size_t es = comm_dtype_size(t);
    int *v = ct_malloc(4 * (size_t)size * sizeof(int));
    int *cnt = v, *dis = v + size, *rcnt = v + 2 * size, *rdis = v + 3 * size;
    chunks(size, n, cnt, dis);
    ar_exchange_args(size, me, cnt, rcnt, rdis);
    void *recv = scratch(c, (size_t)size * (size_t)cnt[me] * es + es);
    MPI_Alltoallv(buf, cnt, dis, mtype(t), recv, rcnt, rdis, mtype(t), mcomm(c));
    sum_blocks((char *)buf + (size_t)dis[me] * es, recv, size, (size_t)cnt[me], t);
    MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, cnt, dis, mtype(t), mcomm(c));
    free(v);
}

static void m_allreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_op op) {
    if (op == COMM_MAX || t == COMM_I32 || t == COMM_I64) {
        MPI_Allreduce(MPI_IN_PLACE, buf, mcount(c, n, "all-reduce"), mtype(t), op == COMM_MAX ? MPI_MAX : MPI_SUM,
                      mcomm(c));
        return;
    }
    /* blocks of SCRATCH_ELEMS bound the receive buffer (and keep every count an int) */
    size_t block = SCRATCH_ELEMS > (size_t)c->size ? SCRATCH_ELEMS : (size_t)c->size, es = comm_dtype_size(t);
    for (size_t o = 0; o < n; o += block)
        m_allreduce_block(c, (char *)buf + o * es, n - o < block ? n - o : block, t);
}

static void m_all_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    int cnt = mcount(c, n, "all-gather");
    mcount(c, n * (size_t)c->size, "all-gather");
    MPI_Allgather(in, cnt, mtype(t), out, cnt, mtype(t), mcomm(c));
}

static void m_broadcast(ct_comm *c, void *buf, size_t n, comm_dtype t, int root) {
    MPI_Bcast(buf, mcount(c, n, "broadcast"), mtype(t), root, mcomm(c));
}

static void m_all_to_allv(ct_comm *c, void *out, const size_t *rcounts, const size_t *rdispls, const void *in,
                          const size_t *scounts, const size_t *sdispls, comm_dtype t) {
    int size = c->size;
    int *v = ct_malloc(4 * (size_t)size * sizeof(int));
    for (int r = 0; r < size; r++) {
        v[r] = mcount(c, scounts[r], "all-to-all");
        v[size + r] = mcount(c, sdispls[r], "all-to-all");
        v[2 * size + r] = mcount(c, rcounts[r], "all-to-all");
        v[3 * size + r] = mcount(c, rdispls[r], "all-to-all");
    }
    MPI_Alltoallv(in, v, v + size, mtype(t), out, v + 2 * size, v + 3 * size, mtype(t), mcomm(c));
    free(v);
}

static void m_barrier(ct_comm *c) { MPI_Barrier(mcomm(c)); }

static mpi_req *new_req(comm_req *r, int kind, void *out, size_t n, comm_dtype t) {
    mpi_req *q = ct_calloc(1, sizeof *q);
    q->kind = kind;
    q->out = out;
    q->n = n;
    q->t = t;
    r->impl = q;
    return q;
}

static void m_iall_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    int cnt = mcount(c, n, "all-gather");
    mcount(c, n * (size_t)c->size, "all-gather");
    mpi_req *q = new_req(r, REQ_GATHER, out, n, t);
    MPI_Iallgather(in, cnt, mtype(t), out, cnt, mtype(t), mcomm(c), &q->req);
}

static void m_ireduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    int cnt = mcount(c, n, "reduce-scatter");
    mcount(c, n * (size_t)c->size, "reduce-scatter");
    mpi_req *q = new_req(r, REQ_RS, out, n, t);
    if (t == COMM_I32 || t == COMM_I64) { /* exact: no ordering to keep */
        MPI_Ireduce_scatter_block(in, out, cnt, mtype(t), MPI_SUM, mcomm(c), &q->req);
        return;
    }
    q->recv = ct_malloc((size_t)c->size * n * comm_dtype_size(t));
    MPI_Ialltoall(in, cnt, mtype(t), q->recv, cnt, mtype(t), mcomm(c), &q->req);
}

static void m_iallreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_req *r) {
    mpi_req *q = new_req(r, REQ_AR, buf, n, t);
    if (t == COMM_I32 || t == COMM_I64) {
        MPI_Iallreduce(MPI_IN_PLACE, buf, mcount(c, n, "all-reduce"), mtype(t), MPI_SUM, mcomm(c), &q->req);
        return;
    }
    int size = c->size, me = c->rank;
    mcount(c, (n + (size_t)size - 1) / (size_t)size * (size_t)size, "all-reduce");
    q->cnt = ct_malloc(4 * (size_t)size * sizeof(int));
    q->dis = q->cnt + size;
    int *rcnt = q->cnt + 2 * size, *rdis = q->cnt + 3 * size;
    chunks(size, n, q->cnt, q->dis);
    ar_exchange_args(size, me, q->cnt, rcnt, rdis);
    q->recv = ct_malloc((size_t)size * (size_t)q->cnt[me] * comm_dtype_size(t) + comm_dtype_size(t));
    MPI_Ialltoallv(buf, q->cnt, q->dis, mtype(t), q->recv, rcnt, rdis, mtype(t), mcomm(c), &q->req);
}

static void m_isend(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag, comm_req *r) {
    mpi_req *q = new_req(r, REQ_P2P, NULL, n, t);
    MPI_Isend(buf, mcount(c, n, "send"), mtype(t), dst, tag, mcomm(c), &q->req);
}

static void m_irecv(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag, comm_req *r) {
    mpi_req *q = new_req(r, REQ_P2P, buf, n, t);
    MPI_Irecv(buf, mcount(c, n, "receive"), mtype(t), src, tag, mcomm(c), &q->req);
}

static void m_wait(comm_req *r) {
    mpi_req *q = r->impl;
    ct_comm *c = r->c;
    MPI_Wait(&q->req, MPI_STATUS_IGNORE);
    if (q->kind == REQ_RS && q->recv) sum_blocks(q->out, q->recv, c->size, q->n, q->t);
    if (q->kind == REQ_AR && q->recv) {
        /* the gather half runs here, blocking: the sum must be done first */
        size_t es = comm_dtype_size(q->t);
        sum_blocks((char *)q->out + (size_t)q->dis[c->rank] * es, q->recv, c->size, (size_t)q->cnt[c->rank], q->t);
        MPI_Allgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, q->out, q->cnt, q->dis, mtype(q->t), mcomm(c));
    }
    free(q->recv);
    free(q->cnt);
    free(q);
    r->impl = NULL;
}

/* MPI_Test on a finished request sets it to MPI_REQUEST_NULL, which the
 * later MPI_Wait accepts; the sums are left to m_wait. */
static void m_test(comm_req *r) {
    mpi_req *q = r->impl;
    int done = 0;
    MPI_Test(&q->req, &done, MPI_STATUS_IGNORE);
}

static int wrap(ct_comm *out, MPI_Comm comm, int owns) {
    memset(out, 0, sizeof *out);
    mpi_impl *m = ct_calloc(1, sizeof *m);
    m->comm = comm;
    out->impl = m;
    out->owns_runtime = owns;
    MPI_Comm_rank(comm, &out->rank);
    MPI_Comm_size(comm, &out->size);
    return 0;
}

static const comm_backend mpi_backend;

static int m_split(ct_comm *c, int color, int key, ct_comm *out, ct_err *e) {
    MPI_Comm sub;
    if (MPI_Comm_split(mcomm(c), color, key, &sub) != MPI_SUCCESS)
        return ct_fail(e, CT_ERR_IO, "MPI_Comm_split failed (color %d)", color);
    wrap(out, sub, 0);
    out->be = &mpi_backend;
    return 0;
}

static void m_free(ct_comm *c) {
    mpi_impl *m = c->impl;
    if (!m) return;
    free(m->scratch);
    if (c->owns_runtime) {
        MPI_Finalize();
    } else if (m->comm != MPI_COMM_WORLD && m->comm != MPI_COMM_NULL) {
        MPI_Comm_free(&m->comm);
    }
    free(m);
    c->impl = NULL;
}

static void m_abort(ct_comm *c, int code) {
    fflush(stdout);
    fflush(stderr);
    MPI_Abort(c->impl ? mcomm(c) : MPI_COMM_WORLD, code);
    exit(code);
}

static const comm_backend mpi_backend = {
    .name = "mpi",
    .allreduce = m_allreduce,
    .reduce_scatter = m_reduce_scatter,
    .all_gather = m_all_gather,
    .broadcast = m_broadcast,
    .all_to_allv = m_all_to_allv,
    .barrier = m_barrier,
    .iall_gather = m_iall_gather,
    .ireduce_scatter = m_ireduce_scatter,
    .iallreduce = m_iallreduce,
    .isend = m_isend,
    .irecv = m_irecv,
    .wait = m_wait,
    .test = m_test,
    .split = m_split,
    .free = m_free,
    .abort = m_abort,
};

int comm_mpi_init_world(ct_comm *c, int *argc, char ***argv, ct_err *e) {
    int provided = 0, inited = 0;
    MPI_Initialized(&inited);
    if (!inited && MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return ct_fail(e, CT_ERR_IO, "MPI_Init failed (started by mpirun?)");
    wrap(c, MPI_COMM_WORLD, !inited);
    c->be = &mpi_backend;
    return 0;
}
#endif /* CT_NO_MPI */
