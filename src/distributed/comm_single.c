/* distributed/comm_single.c: the backend of a run without MPI: one rank, so every
 * reduction is the identity and every gather or exchange a copy. The
 * trainer calls the same collectives whatever the world size; this keeps
 * the one-process path free of `if (size > 1)`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "distributed/comm.h"

static void copy(void *out, const void *in, size_t n, comm_dtype t) {
    if (out != in && n) memmove(out, in, n * comm_dtype_size(t));
}

static void s_allreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_op op) {
    (void)c, (void)buf, (void)n, (void)t, (void)op;
}
static void s_reduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    (void)c;
    copy(out, in, n, t);
}
static void s_all_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t) {
    (void)c;
    copy(out, in, n, t);
}
static void s_broadcast(ct_comm *c, void *buf, size_t n, comm_dtype t, int root) {
    (void)c, (void)buf, (void)n, (void)t, (void)root;
}
static void s_all_to_allv(ct_comm *c, void *out, const size_t *rcounts, const size_t *rdispls, const void *in,
                          const size_t *scounts, const size_t *sdispls, comm_dtype t) {
    (void)c, (void)rcounts;
    size_t es = comm_dtype_size(t);
    copy((char *)out + rdispls[0] * es, (const char *)in + sdispls[0] * es, scounts[0], t);
}
static void s_barrier(ct_comm *c) { (void)c; }
static void s_iall_gather(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    (void)r;
    s_all_gather(c, out, in, n, t);
}
static void s_ireduce_scatter(ct_comm *c, void *out, const void *in, size_t n, comm_dtype t, comm_req *r) {
    (void)r;
    s_reduce_scatter(c, out, in, n, t);
}
static void s_iallreduce(ct_comm *c, void *buf, size_t n, comm_dtype t, comm_req *r) {
    (void)c, (void)buf, (void)n, (void)t, (void)r;
}
/* one rank has no peer: a send to itself is a layout bug, not a message */
static void s_p2p(ct_comm *c, int peer) {
    fprintf(stderr, "ctitan: error: point-to-point message to rank %d of a single-process run\n", peer);
    (void)c;
    exit(1);
}
static void s_isend(ct_comm *c, const void *buf, size_t n, comm_dtype t, int dst, int tag, comm_req *r) {
    (void)buf, (void)n, (void)t, (void)tag, (void)r;
    s_p2p(c, dst);
}
static void s_irecv(ct_comm *c, void *buf, size_t n, comm_dtype t, int src, int tag, comm_req *r) {
    (void)buf, (void)n, (void)t, (void)tag, (void)r;
    s_p2p(c, src);
}
static void s_wait(comm_req *r) { (void)r; }
static void s_test(comm_req *r) { (void)r; }
static int s_split(ct_comm *c, int color, int key, ct_comm *out, ct_err *e) {
    (void)c, (void)color, (void)key, (void)e;
    comm_init_single(out);
    return 0;
}
static void s_free(ct_comm *c) { (void)c; }
static void s_abort(ct_comm *c, int code) {
    (void)c;
    exit(code);
}

const comm_backend comm_single_backend = {
    .name = "single",
    .allreduce = s_allreduce,
    .reduce_scatter = s_reduce_scatter,
    .all_gather = s_all_gather,
    .broadcast = s_broadcast,
    .all_to_allv = s_all_to_allv,
    .barrier = s_barrier,
    .iall_gather = s_iall_gather,
    .ireduce_scatter = s_ireduce_scatter,
    .iallreduce = s_iallreduce,
    .isend = s_isend,
    .irecv = s_irecv,
    .wait = s_wait,
    .test = s_test,
    .split = s_split,
    .free = s_free,
    .abort = s_abort,
};
