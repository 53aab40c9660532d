/* tests/c/distributed/test_comm.c: the communicator interface. Run alone it checks the
 * single-process backend; under `mpirun -np N` (tests/py/test_dist.py) the
 * very same checks run on the MPI backend, where the expected values are
 * computed locally from what every rank is known to contribute. Float sums
 * are checked bit for bit against a left-to-right fold in rank order, with
 * contributions chosen so that any other order rounds differently. Rank 0
 * also checks distributed/mesh.c's degree checks for made-up world sizes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "config/config.h"
#include "distributed/comm.h"
#include "distributed/mesh.h"

/* What rank r contributes at index i: large values that cancel, so the order
 * of the additions shows in the result. */
static float contrib(int r, size_t i) {
    switch (r % 3) {
    case 0: return 1e8f + (float)(i % 7);
    case 1: return 1.0f + 0.25f * (float)(i % 5);
    default: return -1e8f;
    }
}

static float fold(int size, size_t i) {
    float acc = contrib(0, i);
    for (int r = 1; r < size; r++) acc += contrib(r, i);
    return acc;
}

static void test_allreduce(ct_comm *c, size_t n) {
    float *b = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) b[i] = contrib(c->rank, i);
    comm_allreduce(c, b, n, COMM_F32, COMM_SUM);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += memcmp(&b[i], &(float){fold(c->size, i)}, sizeof(float)) != 0;
    CHECK(bad == 0, "allreduce n=%zu: %zu elements differ from the rank-order sum", n, bad);
    /* every rank holds the same bits */
    float first = b[0], all = first;
    comm_broadcast(c, &all, 1, COMM_F32, 0);
    CHECK(memcmp(&first, &all, sizeof first) == 0, "ranks disagree after allreduce");
    free(b);
}

static void test_reduce_scatter(ct_comm *c, size_t n) {
    int N = c->size;
    float *in = calloc((size_t)N * n, sizeof(float)), *out = calloc(n, sizeof(float));
    for (size_t i = 0; i < (size_t)N * n; i++) in[i] = contrib(c->rank, i);
    comm_reduce_scatter(c, out, in, n, COMM_F32);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++) bad += out[i] != fold(N, (size_t)c->rank * n + i);
    CHECK(bad == 0, "reduce_scatter: %zu of %zu wrong", bad, n);
    /* non-blocking, same answer */
    float *out2 = malloc(n * sizeof(float));
    comm_req r;
    comm_ireduce_scatter(c, out2, in, n, COMM_F32, &r);
    comm_wait(&r);
    CHECK(memcmp(out, out2, n * sizeof(float)) == 0, "ireduce_scatter differs from reduce_scatter");
    /* in place: the result over this rank's own block of the input */
    float *mine = in + (size_t)c->rank * n;
    comm_reduce_scatter(c, mine, in, n, COMM_F32);
    CHECK(memcmp(out, mine, n * sizeof(float)) == 0, "in-place reduce_scatter differs");
    free(in);
    free(out);
    free(out2);
}

static void test_gathers(ct_comm *c) {
    int N = c->size;
    enum { n = 5 };
    double in[n], *out = malloc((size_t)N * n * sizeof(double)), *out2 = malloc((size_t)N * n * sizeof(double));
    for (int i = 0; i < n; i++) in[i] = c->rank * 10 + i;
    comm_all_gather(c, out, in, n, COMM_F64);
    int bad = 0;
    for (int r = 0; r < N; r++)
        for (int i = 0; i < n; i++) bad += out[r * n + i] != r * 10 + i;
    CHECK(bad == 0, "all_gather: %d wrong", bad);
    comm_req q;
    comm_iall_gather(c, out2, in, n, COMM_F64, &q);
    comm_wait(&q);
    CHECK(memcmp(out, out2, (size_t)N * n * sizeof(double)) == 0, "iall_gather differs");
    free(out);
    free(out2);

    int64_t v = c->rank == N - 1 ? 424242 : -1;
    comm_broadcast(c, &v, 1, COMM_I64, N - 1);
    CHECK(v == 424242, "broadcast from the last rank: got %lld", (long long)v);
}

static void test_all_to_all(ct_comm *c) {
    int N = c->size;
    int32_t *in = malloc((size_t)N * 2 * sizeof(int32_t)), *out = malloc((size_t)N * 2 * sizeof(int32_t));
    for (int d = 0; d < N; d++) in[2 * d] = c->rank * 100 + d, in[2 * d + 1] = -(c->rank * 100 + d);
    comm_all_to_all(c, out, in, 2, COMM_I32);
    int bad = 0;
    for (int s = 0; s < N; s++) bad += out[2 * s] != s * 100 + c->rank || out[2 * s + 1] != -(s * 100 + c->rank);
    CHECK(bad == 0, "all_to_all: %d blocks wrong", bad);
    /* v: rank s sends s + 1 values to each rank, all equal to s */
    size_t *sc = calloc((size_t)N * 4, sizeof(size_t)), *sd = sc + N, *rc = sc + 2 * N, *rd = sc + 3 * N;
    float *vin = malloc((size_t)N * (c->rank + 1) * sizeof(float)), *vout = malloc((size_t)N * (N + 1) * sizeof(float));
    size_t off = 0;
    for (int r = 0; r < N; r++) {
        sc[r] = (size_t)c->rank + 1;
        sd[r] = (size_t)r * (c->rank + 1);
        rc[r] = (size_t)r + 1;
        rd[r] = off;
        off += (size_t)r + 1;
    }
    for (size_t i = 0; i < (size_t)N * (c->rank + 1); i++) vin[i] = (float)c->rank;
    comm_all_to_allv(c, vout, rc, rd, vin, sc, sd, COMM_F32);
    bad = 0;
    for (int r = 0; r < N; r++)
        for (size_t i = 0; i < rc[r]; i++) bad += vout[rd[r] + i] != (float)r;
    CHECK(bad == 0, "all_to_allv: %d values wrong", bad);
    free(in);
    free(out);
    free(sc);
    free(vin);
    free(vout);
}

static void test_misc(ct_comm *c) {
    int N = c->size;
    int64_t s = c->rank + 1;
    comm_allreduce(c, &s, 1, COMM_I64, COMM_SUM);
    CHECK(s == (int64_t)N * (N + 1) / 2, "int64 sum: %lld", (long long)s);
    double mx = c->rank == N / 2 ? 7.5 : -1.0;
    comm_allreduce(c, &mx, 1, COMM_F64, COMM_MAX);
    CHECK(mx == 7.5, "max: %g", mx);
    float fb[3] = {contrib(c->rank, 0), contrib(c->rank, 1), contrib(c->rank, 2)};
    comm_req q;
    comm_iallreduce(c, fb, 3, COMM_F32, &q);
    comm_wait(&q);
    CHECK(fb[0] == fold(N, 0) && fb[1] == fold(N, 1) && fb[2] == fold(N, 2), "iallreduce: %g %g %g", fb[0], fb[1],
          fb[2]);
    comm_barrier(c);
    /* sub-communicators: even and odd ranks */
    ct_comm sub;
    ct_err e = {0};
    CHECK(comm_split(c, c->rank % 2, c->rank, &sub, &e) == 0, "split: %s", e.msg);
    CHECK(sub.size == (N + 1 - c->rank % 2) / 2, "split size %d for rank %d of %d", sub.size, c->rank, N);
    CHECK(sub.rank == c->rank / 2, "split rank %d for rank %d", sub.rank, c->rank);
    int64_t one = 1;
    comm_allreduce(&sub, &one, 1, COMM_I64, COMM_SUM);
    CHECK(one == sub.size, "sum over the sub-communicator: %lld", (long long)one);
    comm_free(&sub);
}

/* comm_range_i64: element 0 alike on every rank, element 1 the rank's own
 * (rank - 2: negatives too), element 2 alike but negative. */
static void test_range(ct_comm *c) {
    int N = c->size;
    int64_t x[3] = {42, (int64_t)c->rank - 2, -7}, lo[3], hi[3];
    comm_range_i64(c, x, lo, hi, 3);
    CHECK(lo[0] == 42 && hi[0] == 42, "range of one value: %lld..%lld", (long long)lo[0], (long long)hi[0]);
    CHECK(lo[1] == -2 && hi[1] == N - 3, "range of the ranks' values: %lld..%lld", (long long)lo[1],
          (long long)hi[1]);
    CHECK(lo[2] == -7 && hi[2] == -7, "range of one negative value: %lld..%lld", (long long)lo[2], (long long)hi[2]);
}

/* Point to point around a ring, as pipeline stages pass activations: every
 * rank posts its receives first, two messages per neighbour pair told apart
 * by tag and, within a tag, by order. */
static void test_p2p(ct_comm *c) {
    int N = c->size;
    if (N < 2) return;
    int next = (c->rank + 1) % N, prev = (c->rank + N - 1) % N;
    float got[3][5], out[3][5];
    comm_req rq[3], sq[3];
    for (int m = 0; m < 3; m++) comm_irecv(c, got[m], 5, COMM_F32, prev, m == 2 ? 7 : 3, &rq[m]);
    for (int m = 0; m < 3; m++) {
        for (int i = 0; i < 5; i++) out[m][i] = (float)(c->rank * 100 + m * 10 + i);
        comm_isend(c, out[m], 5, COMM_F32, next, m == 2 ? 7 : 3, &sq[m]);
    }
    for (int m = 0; m < 3; m++) comm_wait(&rq[m]);
    for (int m = 0; m < 3; m++) comm_wait(&sq[m]);
    int bad = 0;
    for (int m = 0; m < 3; m++)
        for (int i = 0; i < 5; i++) bad += got[m][i] != (float)(prev * 100 + m * 10 + i);
    CHECK(bad == 0, "p2p: %d values differ from the ring neighbour's", bad);
    int64_t x = c->rank;
    if (c->rank == 0) comm_send(c, &x, 1, COMM_I64, 1, 9);
    if (c->rank == 1) comm_recv(c, &x, 1, COMM_I64, 0, 9);
    CHECK(c->rank != 1 || x == 0, "blocking recv: %lld", (long long)x);
}

/* The degrees as mesh_resolve sees them for a given world size (no MPI needed). */
static void test_mesh_resolve(void) {
    ct_config c;
    cfg_defaults(&c);
    lm_config mc = {0};
    mc.n_heads = 8;
    mc.n_kv_heads = 2;
    mc.n_layers = 2;
    mc.decoder_sparse_step = 1;
    snprintf(mc.name, sizeof mc.name, "test");
    int rep = 0, shard = 0, tp = 0;
    ct_err e = {0};
    c.dp_replicate = 2;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == 0 && rep == 2 && shard == 4 && tp == 1,
          "8 ranks, replicate 2, shard -1: %d x %d x %d (%s)", rep, shard, tp, e.msg);
    c.dp_shard = 3;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "data_parallel_shard_degree") && strstr(e.msg, "world size is 8"),
          "2 x 3 on 8 ranks: %s", e.msg);
    c.dp_replicate = 3;
    c.dp_shard = -1;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "data_parallel_replicate_degree (3)"),
          "replicate 3 on 8 ranks: %s", e.msg);
    c.dp_replicate = 1;
    c.tp = 4;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "tensor_parallel_degree = 4") && strstr(e.msg, "kv heads (2)"),
          "tp 4 with 2 kv heads: %s", e.msg);
    c.tp = 2;
    mc.intermediate = 9;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "tensor_parallel_degree = 2") && strstr(e.msg, "intermediate size (9)"),
          "tp 2 with intermediate 9: %s", e.msg);
    mc.intermediate = 8;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == 0 && rep == 1 && shard == 4 && tp == 2,
          "8 ranks, tp 2, shard -1: %d x %d x %d (%s)", rep, shard, tp, e.msg);
    /* MoE: each expert is split like the MLP; the dense intermediate only matters with a dense layer */
    mc.n_experts = 4;
    mc.top_k = 2;
    mc.moe_intermediate = 5;
    mc.intermediate = 9;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "tensor_parallel_degree = 2 does not divide the model's moe_intermediate_size (5)"),
          "tp 2 with moe_intermediate 5: %s", e.msg);
    mc.moe_intermediate = 6;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == 0 && tp == 2, "tp 2, every layer sparse: %s",
          e.msg);
    mc.n_mlp_only = 1; /* layer 0 dense: its intermediate 9 must divide */
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "intermediate size (9)"),
          "tp 2 with a dense layer of intermediate 9: %s", e.msg);
    mc.n_mlp_only = 0;
    /* EP inside the FSDP group, or among the replicas */
    c.tp = 1;
    c.ep = 4;
    c.dp_shard = 2;
    c.dp_replicate = 4;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "expert_parallel_degree = 4 does not divide parallelism.data_parallel_shard_degree = 2"),
          "ep 4 over shard 2: %s", e.msg);
    c.ep = 2;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == 0 && rep == 4 && shard == 2, "ep 2 in HSDP 4x2: %s",
          e.msg);
    c.dp_shard = 1;
    c.dp_replicate = 8;
    c.ep = 4;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == 0 && rep == 8, "ep 4 over 8 replicas: %s", e.msg);
    c.dp_replicate = 4;
    c.dp_shard = 1;
    c.tp = 2;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == 0 && rep == 4 && tp == 2,
          "ep 4 over 4 replicas x tp 2: %s", e.msg);
    c.dp_replicate = 2;
    c.tp = 4;
    mc.n_kv_heads = 4;
    mc.moe_intermediate = 8;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "expert_parallel_degree = 4 needs at least 4 data-parallel ranks, but there are 2 "
                            "(data_parallel_replicate_degree 2 x data_parallel_shard_degree 1: 8 ranks started by "
                            "mpirun -np, over tensor_parallel_degree)"),
          "ep 4 over 2 replicas x tp 4: %s", e.msg);
    c.dp_replicate = 6; /* enough replicas, but not a multiple of the degree */
    c.tp = 1;
    CHECK(mesh_resolve(&c, 6, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "does not divide the data-parallel ranks (data_parallel_replicate_degree = 6)"),
          "ep 4 over 6 replicas: %s", e.msg);
    c.dp_replicate = 2;
    c.tp = 4;
    mc.n_kv_heads = 2;
    mc.n_experts = 0;
    c.tp = 1;
    c.dp_replicate = 1;
    c.dp_shard = -1;
    c.ep = 2;
    CHECK(mesh_resolve(&c, 8, &mc, "t", &rep, &shard, &tp, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "expert_parallel_degree") && strstr(e.msg, "no experts"),
          "ep 2, dense: %s", e.msg);
    cfg_free(&c);
}

int main(int argc, char **argv) {
    ct_comm c;
    ct_err e = {0};
    if (comm_init_world(&c, &argc, &argv, &e)) {
        fprintf(stderr, "%s\n", e.msg);
        return 1;
    }
    test_allreduce(&c, 1);
    test_allreduce(&c, 7);
    test_allreduce(&c, 1000003); /* uneven chunks */
    test_reduce_scatter(&c, 1);
    test_reduce_scatter(&c, 4099);
    /* past the MPI backend's 4M-element receive buffer: several blocks */
    test_allreduce(&c, 9000001);
    test_reduce_scatter(&c, 3000001);
    test_gathers(&c);
    test_all_to_all(&c);
    test_misc(&c);
    test_range(&c);
    test_p2p(&c);
    if (c.rank == 0) test_mesh_resolve();
    /* every rank must pass: rank 0 reports the failures of all, every rank exits with the verdict */
    int64_t fails = check_fail_;
    comm_allreduce(&c, &fails, 1, COMM_I64, COMM_SUM);
    int rc = fails ? 1 : 0;
    if (c.rank == 0) {
        printf("test_comm: backend %s, %d rank(s)\n", c.be->name, c.size);
        check_fail_ = (int)fails;
        rc = CHECK_DONE();
    }
    comm_free(&c);
    return rc;
}
