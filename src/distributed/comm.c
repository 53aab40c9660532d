/* distributed/comm.c: the backend-independent half of the communicator: choosing
 * the world's backend, dispatch, and the rank-order sum every backend uses.
 * comm_single.c and comm_mpi.c hold the backends. */
#include "distributed/comm.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "metrics/profile.h"

/* A collective as a span of c's profiler, if it has one: name, the bytes of
 * this rank's buffers it covers, elements, dtype, reduction. The figures are
 * computed only when a profiler is attached. */
#define COMM_SPAN(c, name, bytes, count, t, op, stmt)                                                            \
    do {                                                                                                         \
        int64_t cs_t0_ = PROF_T0((c)->prof);                                                                     \
        stmt;                                                                                                    \
        if ((c)->prof) prof_comm((c)->prof, name, cs_t0_, bytes, count, dtype_name(t), op, (c)->size);         \
    } while (0)

static const char *dtype_name(comm_dtype t) {
    switch (t) {
    case COMM_F32: return "f32";
    case COMM_F64: return "f64";
    case COMM_I32: return "i32";
    case COMM_I64: return "i64";
    case COMM_BF16: return "bf16";
    }
    return "?";
}

size_t comm_dtype_size(comm_dtype t) {
    switch (t) {
    case COMM_F32: return sizeof(float);
    case COMM_F64: return sizeof(double);
    case COMM_I32: return sizeof(int32_t);
    case COMM_I64: return sizeof(int64_t);
    case COMM_BF16: return sizeof(uint16_t);
    }
    return 0;
}

void comm_sum_into(void *dst, const void *src, size_t n, comm_dtype t) {
    switch (t) {
    case COMM_F32: {
        float *d = dst;
        const float *s = src;
        for (size_t i = 0; i < n; i++) d[i] += s[i];
        break;
    }
    case COMM_F64: {
        double *d = dst;
        const double *s = src;
        for (size_t i = 0; i < n; i++) d[i] += s[i];
        break;
    }
    case COMM_I32: {
        int32_t *d = dst;
        const int32_t *s = src;
        for (size_t i = 0; i < n; i++) d[i] += s[i];
        break;
    }
    case COMM_I64: {
        int64_t *d = dst;
        const int64_t *s = src;
        for (size_t i = 0; i < n; i++) d[i] += s[i];
        break;
    }
    case COMM_BF16: break; /* moved only, never summed */
    }
}

int comm_init_world(ct_comm *c, int *argc, char ***argv, ct_err *e) {
    const char *force = getenv("CTITAN_COMM");
    int launched = getenv("OMPI_COMM_WORLD_SIZE") || getenv("PMIX_RANK");
    if ((force && strcmp(force, "single") == 0) || !launched) {
        comm_init_single(c);
        return 0;
    }
    return comm_mpi_init_world(c, argc, argv, e);
}

void comm_init_single(ct_comm *c) {
    memset(c, 0, sizeof *c);
    c->be = &comm_single_backend;
    c->rank = 0;
    c->size = 1;
}

int comm_split(ct_comm *c, int color, int key, ct_comm *out, ct_err *e) {
    int rc = c->be->split(c, color, key, out, e);
    if (!rc) out->prof = c->prof; /* a group of a profiled world is profiled */
    return rc;
}

void comm_free(ct_comm *c) {
    if (c->be) c->be->free(c);
    memset(c, 0, sizeof *c);
}

void comm_abort(ct_comm *c, int code) {
    if (c && c->be) c->be->abort(c, code);
    exit(code); /* the backend's abort does not return; this keeps noreturn honest */
}

void comm_allreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_op op) {
    if (n)
        COMM_SPAN(c, "all_reduce", n * comm_dtype_size(t), n, t, op == COMM_MAX ? "max" : "sum",
                  c->be->allreduce(c, buf, n, t, op));
}
void comm_reduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    COMM_SPAN(c, "reduce_scatter", (size_t)c->size * n * comm_dtype_size(t), n, t, "sum",
              c->be->reduce_scatter(c, out, in, n, t));
}
void comm_all_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    COMM_SPAN(c, "all_gather", (size_t)c->size * n * comm_dtype_size(t), n, t, "",
              c->be->all_gather(c, out, in, n, t));
}
void comm_broadcast(ct_comm *c, void *buf, size_t n, comm_dtype t, int root) {
    COMM_SPAN(c, "broadcast", n * comm_dtype_size(t), n, t, "", c->be->broadcast(c, buf, n, t, root));
}

void comm_all_to_all(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    size_t *v = ct_malloc(4 * (size_t)c->size * sizeof(size_t));
    size_t *cnt = v, *dis = v + c->size;
    for (int r = 0; r < c->size; r++) {
        cnt[r] = n;
        dis[r] = (size_t)r * n;
    }
    COMM_SPAN(c, "all_to_all", (size_t)c->size * n * comm_dtype_size(t), (size_t)c->size * n, t, "",
              c->be->all_to_allv(c, out, cnt, dis, in, cnt, dis, t));
    free(v);
}

void comm_range_i64(ct_comm *c, const int64_t *x, int64_t *lo, int64_t *hi, size_t n) {
    int64_t *r = ct_malloc(2 * n * sizeof *r + 1);
    for (size_t i = 0; i < n; i++) r[2 * i] = x[i], r[2 * i + 1] = -x[i];
    comm_allreduce(c, r, 2 * n, COMM_I64, COMM_MAX);
    for (size_t i = 0; i < n; i++) hi[i] = r[2 * i], lo[i] = -r[2 * i + 1];
    free(r);
}

int comm_agree(ct_comm *w, int rc, const char *what, ct_err *e) {
    if (w->size <= 1) return rc;
    int32_t r[2] = {rc, rc ? -w->rank : INT32_MIN}; /* MAX: any failure, and the lowest failing rank */
    comm_allreduce(w, r, 2, COMM_I32, COMM_MAX);
    if (!r[0]) return 0;
    int first = -r[1];
    int32_t why[1 + sizeof e->msg / sizeof(int32_t)] = {0}; /* its code and message */
    _Static_assert(sizeof e->msg % sizeof(int32_t) == 0, "the message travels as whole int32s");
    if (w->rank == first) {
        why[0] = rc;
        memcpy(why + 1, e->msg, sizeof e->msg);
    }
    comm_broadcast(w, why, sizeof why / sizeof why[0], COMM_I32, first);
    char msg[sizeof e->msg];
    memcpy(msg, why + 1, sizeof msg);
    msg[sizeof msg - 1] = 0;
    if (w->rank == 0 && first != 0)
        rc = ct_fail(e, why[0], "rank %d of %d failed to %s: %s", first, w->size, what, msg);
    else if (!rc)
        rc = ct_fail(e, why[0], "rank %d failed to %s (rank 0 prints its error)", first, what);
    e->all_ranks = 1;
    return rc;
}

static size_t sum_counts(const ct_comm *c, const size_t *counts) {
    size_t n = 0;
    for (int r = 0; r < c->size; r++) n += counts[r];
    return n;
}

void comm_all_to_allv(ct_comm *c, void *out, const size_t *rcounts, const size_t *rdispls, const void *in,
                      const size_t *scounts, const size_t *sdispls, comm_dtype t) {
    COMM_SPAN(c, "all_to_allv", sum_counts(c, scounts) * comm_dtype_size(t), sum_counts(c, scounts), t, "",
              c->be->all_to_allv(c, out, rcounts, rdispls, in, scounts, sdispls, t));
}

void comm_barrier(ct_comm *c) { COMM_SPAN(c, "barrier", 0, 0, COMM_I32, "", c->be->barrier(c)); }

void comm_iall_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    COMM_SPAN(c, "iall_gather", (size_t)c->size * n * comm_dtype_size(t), n, t, "",
              c->be->iall_gather(c, out, in, n, t, r));
}
void comm_ireduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    COMM_SPAN(c, "ireduce_scatter", (size_t)c->size * n * comm_dtype_size(t), n, t, "sum",
              c->be->ireduce_scatter(c, out, in, n, t, r));
}
void comm_iallreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    COMM_SPAN(c, "iall_reduce", n * comm_dtype_size(t), n, t, "sum", c->be->iallreduce(c, buf, n, t, r));
}
void comm_isend(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    COMM_SPAN(c, "isend", n * comm_dtype_size(t), n, t, "", c->be->isend(c, buf, n, t, dst, tag, r));
}
void comm_irecv(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    COMM_SPAN(c, "irecv", n * comm_dtype_size(t), n, t, "", c->be->irecv(c, buf, n, t, src, tag, r));
}
void comm_send(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag) {
    comm_req r;
    comm_isend(c, buf, n, t, dst, tag, &r);
    comm_wait(&r);
}
void comm_recv(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag) {
    comm_req r;
    comm_irecv(c, buf, n, t, src, tag, &r);
    comm_wait(&r);
}
void comm_test(comm_req *r) {
    if (r->active) r->c->be->test(r);
}
void comm_wait(comm_req *r) {
    if (!r->active) return;
    ct_comm *c = r->c;
    COMM_SPAN(c, "wait", 0, 0, COMM_I32, "", c->be->wait(r));
    r->active = 0;
}
