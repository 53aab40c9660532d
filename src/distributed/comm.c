/* distributed/comm.c: the backend-independent half of the communicator: choosing
 * the world's backend, dispatch, and the rank-order sum every backend uses.
 * comm_single.c and comm_mpi.c hold the backends. */
#include "distributed/comm.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

size_t comm_dtype_size(comm_dtype t) {
    switch (t) {
    case COMM_F32: return sizeof(float);
    case COMM_F64: return sizeof(double);
    case COMM_I32: return sizeof(int32_t);
    case COMM_I64: return sizeof(int64_t);
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

int comm_split(ct_comm *c, int color, int key, ct_comm *out, ct_err *e) { return c->be->split(c, color, key, out, e); }

void comm_free(ct_comm *c) {
    if (c->be) c->be->free(c);
    memset(c, 0, sizeof *c);
}

void comm_abort(ct_comm *c, int code) {
    if (c && c->be) c->be->abort(c, code);
    exit(code); /* the backend's abort does not return; this keeps noreturn honest */
}

void comm_allreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_op op) {
    if (n) c->be->allreduce(c, buf, n, t, op);
}
void comm_reduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    c->be->reduce_scatter(c, out, in, n, t);
}
void comm_all_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    c->be->all_gather(c, out, in, n, t);
}
void comm_broadcast(ct_comm *c, void *buf, size_t n, comm_dtype t, int root) { c->be->broadcast(c, buf, n, t, root); }

void comm_all_to_all(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    size_t *v = ct_malloc(4 * (size_t)c->size * sizeof(size_t));
    size_t *cnt = v, *dis = v + c->size;
    for (int r = 0; r < c->size; r++) {
        cnt[r] = n;
        dis[r] = (size_t)r * n;
    }
    c->be->all_to_allv(c, out, cnt, dis, in, cnt, dis, t);
    free(v);
}

void comm_all_to_allv(ct_comm *c, void *out, const size_t *rcounts, const size_t *rdispls, const void *in,
                      const size_t *scounts, const size_t *sdispls, comm_dtype t) {
    c->be->all_to_allv(c, out, rcounts, rdispls, in, scounts, sdispls, t);
}

void comm_barrier(ct_comm *c) { c->be->barrier(c); }

void comm_iall_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    c->be->iall_gather(c, out, in, n, t, r);
}
void comm_ireduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    c->be->ireduce_scatter(c, out, in, n, t, r);
}
void comm_iallreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    c->be->iallreduce(c, buf, n, t, r);
}
void comm_isend(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    c->be->isend(c, buf, n, t, dst, tag, r);
}
void comm_irecv(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag, comm_req *r) {
    memset(r, 0, sizeof *r);
    r->c = c;
    r->active = 1;
    c->be->irecv(c, buf, n, t, src, tag, r);
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
    r->c->be->wait(r);
    r->active = 0;
}
