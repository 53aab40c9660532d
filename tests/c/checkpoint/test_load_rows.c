/* tests/c/checkpoint/test_load_rows.c: loading in blocks of rows gives what loading
 * whole tensors gave.
 *
 * The loaders hand a tensor over a block of rows at a time (lm_sink) and
 * a rank keeps its part of each block (tp_take_rows), so no one holds a whole
 * large tensor. The test models of the Python suite are too small to need a
 * second block, so here:
 *   - tp_take_rows against the slice taken from the whole tensor, for a row
 *     slice, a column slice, a replicated tensor, an expert another rank
 *     holds and Phi3's fused qkv_proj (a row slice of each of q, k, v), at
 *     every rank and with blocks of 1, 3, 4 and all rows;
 *   - the seeded init of a model whose embedding spans three blocks, against
 *     the same values drawn one tensor at a time (they must be bit-identical:
 *     every layout starts from one process's weights);
 *   - hf_load of a bf16 file of that model against rounding the weights. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "checkpoint/hf.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "distributed/tp.h"
#include "model/lm.h"

static lm_tensor tensor(int64_t rows, int64_t cols) {
    lm_tensor t = {0};
    t.ndim = 2;
    t.shape[0] = rows;
    t.shape[1] = cols;
    t.numel = (size_t)rows * (size_t)cols;
    return t;
}

/* Feeds whole[R x C] to tp_take_rows in blocks of `step` rows and checks the
 * assembled local tensor against want[lt->numel]. */
static void take_case(const char *what, const tp_layout *p, const lm_tensor *lt, const lm_tensor *ft,
                      const float *whole, const float *want, size_t step) {
    size_t R = (size_t)ft->shape[0], C = (size_t)ft->shape[1], lc = lt->numel ? (size_t)lt->shape[1] : 0;
    float *got = calloc(lt->numel + 1, sizeof(float)), *tmp = calloc(R * C + 1, sizeof(float));
    size_t rows_got = 0;
    size_t fb[3];
    int nb = tp_row_blocks(p, ft, fb);
    for (size_t r0 = 0; r0 < R; r0 += step) {
        size_t r1 = r0 + step < R ? r0 + step : R;
        for (int k = 0; k < nb; k++) { /* as plan.c's load_put */
            size_t la = 0;
            const float *out = NULL;
            size_t n = tp_take_rows(p, lt, ft, k, r0, r1, whole + r0 * C, tmp, &out, &la);
            if (n) memcpy(got + la * lc, out, n * lc * sizeof(float));
            rows_got += n;
        }
    }
    CHECK(rows_got == (lt->numel ? (size_t)lt->shape[0] : 0), "%s, rank %d, blocks of %zu: %zu rows", what, p->rank,
          step, rows_got);
    CHECK(!lt->numel || !memcmp(got, want, lt->numel * sizeof(float)), "%s, rank %d, blocks of %zu: values differ",
          what, p->rank, step);
    free(got);
    free(tmp);
}

static void test_take_rows(void) {
    enum { R = 10, C = 6, T = 2 };
    float whole[R * C], want[R * C];
    for (int i = 0; i < R * C; i++) whole[i] = (float)i;
    lm_tensor ft = tensor(R, C);
    size_t steps[] = {1, 3, 4, R};
    for (int rank = 0; rank < T; rank++) {
        tp_layout p = {0};
        p.t = T;
        p.rank = rank;
        for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
            lm_tensor rows = tensor(R / T, C); /* column-parallel: a block of whole rows */
            memcpy(want, whole + (size_t)rank * (R / T) * C, sizeof(float) * (R / T) * C);
            take_case("row slice", &p, &rows, &ft, whole, want, steps[s]);
            lm_tensor cols = tensor(R, C / T); /* row-parallel: a block of columns in every row */
            for (int r = 0; r < R; r++)
                for (int c = 0; c < C / T; c++) want[r * (C / T) + c] = whole[r * C + rank * (C / T) + c];
            take_case("column slice", &p, &cols, &ft, whole, want, steps[s]);
            take_case("replicated", &p, &ft, &ft, whole, whole, steps[s]);
            lm_tensor none = tensor(0, C); /* an expert another EP rank holds */
            take_case("not held", &p, &none, &ft, whole, want, steps[s]);
        }
    }
    /* fused qkv_proj of 4 heads and 2 kv heads of 1 feature: rows q0 q1 q2 q3 k0 k1 v0 v1;
     * rank r holds [q_2r q_2r+1 k_r v_r] */
    enum { QR = 8 };
    float qkv[QR * C], wq[QR * C];
    for (int i = 0; i < QR * C; i++) qkv[i] = (float)i;
    lm_tensor fq = tensor(QR, C), lq = tensor(QR / T, C);
    fq.slot = lq.slot = LM_S_WQKV;
    for (int rank = 0; rank < T; rank++) {
        tp_layout p = {0};
        p.t = T;
        p.rank = rank;
        p.full.n_heads = 4, p.full.n_kv_heads = 2, p.full.head_dim = 1;
        static const int rows_of[T][4] = {{0, 1, 4, 6}, {2, 3, 5, 7}};
        for (int k = 0; k < 4; k++) memcpy(wq + k * C, qkv + rows_of[rank][k] * C, sizeof(float) * C);
        for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++)
            take_case("fused qkv", &p, &lq, &fq, qkv, wq, steps[s]);
    }
}

typedef struct {
    const lm_model *m;
    float *dst;
    int calls, blocks_after_first;
} rec_ctx;

static void rec_put(void *ctx, int kind, int i, size_t r0, size_t r1, const float *rows) {
    rec_ctx *c = ctx;
    const lm_tensor *t = &c->m->tensors[i];
    size_t cols = lm_tensor_cols(t);
    (void)kind;
    memcpy(c->dst + t->offset + r0 * cols, rows, (r1 - r0) * cols * sizeof(float));
    c->calls++;
    c->blocks_after_first += r0 > 0;
}

/* The embedding [V, H] is 3 blocks of 4096 rows (lm_block_rows: 16 MiB of fp32). Under qemu
 * (CTITAN_EMULATED, scripts/test_aarch64.sh) blocks of 64 Ki floats and an embedding of
 * 2100 x 64, 3 blocks of 1024 rows again: the same loops and the same three blocks, without
 * the ~25 s of emulated CPU that drawing, saving and loading 9.2 M values took there
 * (hf_save's 4 Mi-element writes then take each tensor whole; the native run keeps them). */
static void test_init_and_hf_in_blocks(void) {
    const int small = getenv("CTITAN_EMULATED") != NULL;
    lm_config c = {0};
    snprintf(c.name, sizeof c.name, "rows");
    c.vocab_size = small ? 2100 : 9000, c.hidden = small ? 64 : 1024;
    c.intermediate = 64, c.n_layers = 1, c.n_heads = 2, c.n_kv_heads = 1;
    c.head_dim = 32, c.max_pos = 16, c.rope_theta = 1e6, c.rms_eps = 1e-6, c.tie_embeddings = 1;
    lm_model m;
    ct_err e = {0};
    if (lm_create(&m, &c, 1, 1, &e)) {
        CHECK(0, "lm_create: %s", e.msg);
        return;
    }
    if (small) m.block_elems = (size_t)1 << 16;
    CHECK(lm_block_rows(&m, &m.tensors[0]) * 2 < (size_t)c.vocab_size, "the embedding should span 3 blocks");
    /* the values one tensor at a time, as the init drew them before it streamed */
    float *want = malloc(m.n_params * sizeof(float));
    ct_rng r;
    ct_rng_seed(&r, 7);
    for (int i = 0; i < m.n_tensors; i++) {
        const lm_tensor *t = &m.tensors[i];
        for (size_t j = 0; j < t->numel; j++)
            want[t->offset + j] = t->is_matrix ? (float)(0.02 * ct_rng_normal(&r)) : 1.0f;
    }
    float *got = calloc(m.n_params, sizeof(float));
    rec_ctx rc = {&m, got, 0, 0};
    lm_sink s = {rec_put, &rc};
    lm_init_random_each(&m, 7, &s);
    CHECK(rc.blocks_after_first == 2, "%d blocks after a tensor's first", rc.blocks_after_first);
    CHECK(!memcmp(got, want, m.n_params * sizeof(float)), "the seeded init in blocks differs from whole tensors");

    /* bf16 on disk, read back in blocks: each weight rounded to bf16 */
    char dir[] = "/tmp/ctitan_rows_XXXXXX";
    if (!mkdtemp(dir)) {
        CHECK(0, "mkdtemp");
    } else {
        memcpy(m.params, want, m.n_params * sizeof(float));
        CHECK(hf_save(&m, dir, CT_BF16, 0, &e) == 0, "hf_save: %s", e.msg);
        memset(m.params, 0, m.n_params * sizeof(float));
        CHECK(hf_load(&m, dir, &e) == 0, "hf_load: %s", e.msg);
        size_t bad = 0;
        for (size_t j = 0; j < m.n_params; j++) bad += m.params[j] != ct_bf16_to_f32(ct_f32_to_bf16(want[j]));
        CHECK(bad == 0, "%zu of %zu weights differ from their bf16 rounding after a blocked load", bad, m.n_params);
        char p[512];
        snprintf(p, sizeof p, "rm -rf '%s'", dir);
        if (system(p) != 0) fprintf(stderr, "warning: could not remove %s\n", dir);
    }
    free(want);
    free(got);
    lm_free(&m);
}

int main(void) {
    test_take_rows();
    test_init_and_hf_in_blocks();
    return CHECK_DONE();
}
