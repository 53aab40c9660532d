/* tests/c/kernels/test_bf16.c: the matmul_bf16 op (bf16 mixed precision).
 *
 * - every implementation rounds to bf16 with ties to even, checked on
 *   inputs whose rounding is known by hand (not through the reference);
 * - kern_check tells a bf16 matmul from an fp32 one: an fp32 matmul
 *   registered as matmul_bf16 fails against the bf16 reference;
 * - the implementations are bit-identical at 1 and 2 threads, with K odd and
 *   several k blocks;
 * - [kernels] matmul_bf16 = ... overrides and kern_use_bf16_matmuls;
 * - AMX (matmul_bf16=amx, moe_experts_bf16=grouped_amx) is chosen only with
 *   KERN_FEAT_AMXBF16, and asking for it without the bit is a config error. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/cpu.h"
#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

#if defined(__aarch64__)
static const char *const bf16_impls[] = {"bfmmla", "sve_bfmmla", "neon", "ref"};
#else
static const char *const bf16_impls[] = {"amx", "avx512bf16", "avx512", "avx2", "ref"};
#endif
#define N_IMPLS (int)(sizeof bf16_impls / sizeof bf16_impls[0])

static const kern_impl *find(const kern_impl *t, size_t n, kern_op op, const char *name) {
    for (size_t i = 0; i < n; i++)
        if (t[i].op == op && !strcmp(t[i].name, name)) return &t[i];
    return NULL;
}

/* Inputs on bf16 rounding boundaries (bf16 keeps 8 significant bits, so the
 * spacing above 1 is 2^-7): 1 + 2^-8 is a tie and goes to even 1; 1 + 3*2^-8
 * a tie that goes to even 1 + 2^-6; 1 + 2^-8 + 2^-20 is just above the tie,
 * 1 + 2^-7; 1 - 2^-10 goes to 1. Products of the rounded values and their sums
 * are exact in fp32 here, so every implementation must give these sums exactly. */
static void test_rounding(void) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    enum { M = 20, K = 7, N = 33 }; /* K odd: a half-empty bf16 pair; M, N over a register tile */
    const float vals[4] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, 1.0f - 0x1p-10f};
    const double rounded[4] = {1.0, 1.0 + 0x1p-6, 1.0 + 0x1p-7, 1.0};
    static float inp[M * K], w[N * K], out[M * N], dout[M * N], dinp[M * K], dw[N * K];
    for (int i = 0; i < M * K; i++) inp[i] = vals[i % 4];
    for (int i = 0; i < N * K; i++) w[i] = vals[(i / 3) % 4] * (i % 2 ? -1.0f : 1.0f);
    for (int i = 0; i < M * N; i++) dout[i] = vals[(i * 7) % 4];
    for (int v = 0; v < N_IMPLS; v++) {
        const kern_impl *im = find(t, n, KERN_OP_MATMUL_BF16, bf16_impls[v]);
        CHECK(im != NULL, "matmul_bf16 %s is not registered", bf16_impls[v]);
        if (!im || (im->features & ~cpu)) continue;
        for (int i = 0; i < M * K; i++) dinp[i] = NAN; /* overwritten (accumulate 0): never read */
        memset(dw, 0, sizeof dw);
        im->fn.matmul.fwd(out, inp, w, M, K, N, 0);
        im->fn.matmul.bwd(dinp, dw, dout, inp, w, M, K, N, 0);
        int bad_f = 0, bad_i = 0, bad_w = 0;
        for (int m = 0; m < M; m++)
            for (int j = 0; j < N; j++) {
                double s = 0;
                for (int k = 0; k < K; k++)
                    s += rounded[(m * K + k) % 4] * rounded[((j * K + k) / 3) % 4] * ((j * K + k) % 2 ? -1 : 1);
                bad_f += out[m * N + j] != (float)s;
            }
        for (int m = 0; m < M; m++)
            for (int k = 0; k < K; k++) {
                double s = 0;
                for (int j = 0; j < N; j++)
                    s += rounded[((m * N + j) * 7) % 4] * rounded[((j * K + k) / 3) % 4] * ((j * K + k) % 2 ? -1 : 1);
                bad_i += dinp[m * K + k] != (float)s;
            }
        for (int j = 0; j < N; j++)
            for (int k = 0; k < K; k++) {
                double s = 0;
                for (int m = 0; m < M; m++) s += rounded[((m * N + j) * 7) % 4] * rounded[(m * K + k) % 4];
                bad_w += dw[j * K + k] != (float)s;
            }
        CHECK(!bad_f && !bad_i && !bad_w, "%s: %d fwd, %d dinp, %d dw elements not the exact bf16 sums",
              im->name, bad_f, bad_i, bad_w);
    }
}

/* ct_round_bf16 (core/dtype: the attention's operands under bf16 products) on the
 * same boundaries, known from the IEEE layout rather than from ct_f32_to_bf16: the
 * ties and the values beside them, signs, the largest float (rounds to inf), inf,
 * a subnormal kept as one (2^-130 is a bf16 subnormal), and a NaN whose payload
 * is only in the low half (made quiet, not inf). 13 values: a vector's tail too. */
static void test_round_in_place(void) {
    float x[13] = {1.0f + 0x1p-8f, 1.0f + 3 * 0x1p-8f, 1.0f + 0x1p-8f + 0x1p-20f, 1.0f - 0x1p-10f,
                   -(1.0f + 0x1p-8f), -(1.0f + 3 * 0x1p-8f), 0x1.fffffep127f, INFINITY, -0.0f,
                   0x1p-130f, 3.0f, 0, 0};
    uint32_t nan = 0x7f800001u; /* a signalling NaN, payload in the low bits only */
    memcpy(&x[11], &nan, 4);
    x[12] = 1.0f + 0x1p-7f + 0x1p-8f; /* a tie between 1 + 2^-7 (odd) and 1 + 2^-6: even */
    const uint32_t want[13] = {0x3f800000u, 0x3f820000u, 0x3f810000u, 0x3f800000u, 0xbf800000u, 0xbf820000u,
                               0x7f800000u, 0x7f800000u, 0x80000000u, 0x00080000u, 0x40400000u, 0x7fc00000u,
                               0x3f820000u};
    ct_round_bf16(x, 13);
    for (int i = 0; i < 13; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        CHECK(u == want[i], "ct_round_bf16 value %d: %08x, want %08x", i, u, want[i]);
    }
}

/* An fp32 matmul registered as matmul_bf16 must fail the check. */
static void test_check_catches_fp32(void) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    const kern_impl *ref = find(t, n, KERN_OP_MATMUL_BF16, "ref");
    const char *fp32[] = {"ref", "avx512", "avx2", "neon", "sve"};
    for (int v = 0; v < (int)(sizeof fp32 / sizeof fp32[0]); v++) {
        const kern_impl *f = find(t, n, KERN_OP_MATMUL, fp32[v]);
        if (!f || !ref || (f->features & ~cpu)) continue;
        kern_impl table[2] = {*ref, *f};
        table[1].op = KERN_OP_MATMUL_BF16;
        table[1].name = "fp32";
        kern_check_opts o = {.out = NULL, .op = "matmul_bf16", .features = cpu, .seed = 5};
        CHECK(kern_check(table, 2, &o) > 0, "fp32 matmul %s passed as matmul_bf16", fp32[v]);
    }
}

static void fill_lcg(float *p, size_t n, uint32_t *s) {
    for (size_t i = 0; i < n; i++) {
        *s = *s * 1664525u + 1013904223u;
        p[i] = (float)(*s >> 8) / 16777216.0f - 0.5f;
    }
}

/* Bit-identical at 1 and 2 threads; K = 1601 is odd and spans three of the
 * avx512bf16 kernel's 768-deep k blocks (two of amx's 1024-deep ones); M and
 * N leave edge blocks in both. Under emulation (qemu, where this was 40 s)
 * M and N shrink to 43 x 37: still edges, still split between the threads. */
static void test_determinism(void) {
    unsigned cpu = kern_cpu_features();
    const int emulated = getenv("CTITAN_EMULATED") != NULL;
    const int M = emulated ? 43 : 203, K = 1601, N = emulated ? 37 : 301;
    float *inp = malloc((size_t)M * K * 4), *w = malloc((size_t)N * K * 4), *dout = malloc((size_t)M * N * 4);
    uint32_t s = 3;
    fill_lcg(inp, (size_t)M * K, &s);
    fill_lcg(w, (size_t)N * K, &s);
    fill_lcg(dout, (size_t)M * N, &s);
    size_t n;
    const kern_impl *t = kern_registry(&n);
    int saved = omp_get_max_threads();
    for (int v = 0; v < N_IMPLS - 1; v++) {
        const kern_impl *im = find(t, n, KERN_OP_MATMUL_BF16, bf16_impls[v]);
        if (!im || (im->features & ~cpu)) continue;
        float *o[2], *di[2], *dw[2];
        for (int th = 0; th < 2; th++) {
            omp_set_num_threads(th + 1);
            o[th] = calloc((size_t)M * N, 4);
            di[th] = calloc((size_t)M * K, 4);
            dw[th] = calloc((size_t)N * K, 4);
            im->fn.matmul.fwd(o[th], inp, w, M, K, N, 0);
            im->fn.matmul.bwd(di[th], dw[th], dout, inp, w, M, K, N, 1);
        }
        CHECK(!memcmp(o[0], o[1], (size_t)M * N * 4), "%s fwd differs between 1 and 2 threads", im->name);
        CHECK(!memcmp(di[0], di[1], (size_t)M * K * 4), "%s dinp differs between 1 and 2 threads", im->name);
        CHECK(!memcmp(dw[0], dw[1], (size_t)N * K * 4), "%s dw differs between 1 and 2 threads", im->name);
        for (int th = 0; th < 2; th++) free(o[th]), free(di[th]), free(dw[th]);
    }
    omp_set_num_threads(saved);
    free(inp), free(w), free(dout);
}

static void test_select(void) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    kern_ops k;
    ct_err e = {0};
    char log[512];
    CHECK(kern_select(&k, NULL, log, sizeof log, &e) == 0, "kern_select: %s", e.msg);
    CHECK(k.chosen[KERN_OP_MATMUL_BF16] && k.matmul_bf16_fwd && k.matmul_bf16_bwd, "no matmul_bf16 default");
    CHECK(strstr(log, " matmul_bf16=") != NULL, "log lacks matmul_bf16: %s", log);
    if ((cpu & KERN_FEAT_AVX512) == KERN_FEAT_AVX512)
        CHECK(!strcmp(k.chosen[KERN_OP_MATMUL_BF16]->name, (cpu & KERN_FEAT_AMXBF16)      ? "amx"
                                                           : (cpu & KERN_FEAT_AVX512BF16) ? "avx512bf16"
                                                                                          : "avx512"),
              "default %s on a CPU with features %#x", k.chosen[KERN_OP_MATMUL_BF16]->name, cpu);
#if defined(__aarch64__)
    /* simulated CPUs: BF16 (Graviton 3/4) gets bfmmla, plain NEON the rounding neon, nothing the ref */
    const struct {
        unsigned feats;
        const char *want;
    } sims[] = {{KERN_FEAT_ALL, "bfmmla"}, {KERN_FEAT_NEON | KERN_FEAT_ARM_BF16, "bfmmla"},
                {KERN_FEAT_NEON | KERN_FEAT_SVE, "neon"}, {0, "ref"}};
    if (cpu & KERN_FEAT_ARM_BF16)
        CHECK(!strcmp(k.chosen[KERN_OP_MATMUL_BF16]->name, "bfmmla"), "default %s on a CPU with bf16",
              k.chosen[KERN_OP_MATMUL_BF16]->name);
#else
    /* simulated CPUs: AMX gets amx; AVX512_BF16 without AMX (Zen 4, or Linux refusing the tile
     * permission) avx512bf16; AVX-512 without BF16 the rounding avx512; AVX2 only avx2; none ref */
    const struct {
        unsigned feats;
        const char *want;
    } sims[] = {{KERN_FEAT_ALL, "amx"},
                {KERN_FEAT_ALL & ~KERN_FEAT_AMXBF16, "avx512bf16"},
                /* the AMX packers round with vcvtne2ps2bf16 (bf16_pairs.h): no AVX512_BF16, no amx */
                {KERN_FEAT_ALL & ~KERN_FEAT_AVX512BF16, "avx512"},
                {KERN_FEAT_ALL & ~(KERN_FEAT_AVX512BF16 | KERN_FEAT_AMXBF16), "avx512"},
                {KERN_FEAT_AVX2 | KERN_FEAT_FMA, "avx2"},
                {0, "ref"}};
#endif
    for (size_t i = 0; i < sizeof sims / sizeof sims[0]; i++) {
        CHECK(kern_select_from(&k, t, n, sims[i].feats, NULL, NULL, 0, &e) == 0, "select: %s", e.msg);
        CHECK(!strcmp(k.chosen[KERN_OP_MATMUL_BF16]->name, sims[i].want), "features %#x: %s, expected %s",
              sims[i].feats, k.chosen[KERN_OP_MATMUL_BF16]->name, sims[i].want);
    }
    /* the override, and kern_use_bf16_matmuls pointing the model's matmul at it */
    const char *ov[] = {"matmul_bf16=ref", NULL};
    CHECK(kern_select(&k, ov, NULL, 0, &e) == 0, "matmul_bf16=ref: %s", e.msg);
    CHECK(k.matmul_bf16_fwd == op_matmul_bf16_fwd && k.matmul_fwd != op_matmul_bf16_fwd, "override not installed");
    kern_use_bf16_matmuls(&k);
    CHECK(k.matmul_fwd == op_matmul_bf16_fwd && k.matmul_bwd == op_matmul_bf16_bwd,
          "kern_use_bf16_matmuls did not install the bf16 matmul");
    const char *bad[] = {"matmul_bf16=nonesuch", NULL};
    e.msg[0] = 0;
    CHECK(kern_select(&k, bad, NULL, 0, &e) == CT_ERR_CONFIG && strstr(e.msg, "nonesuch") &&
              strstr(e.msg, bf16_impls[0]),
          "bad override: %s", e.msg);
#if defined(__aarch64__)
    const char *need_bf16[] = {"matmul_bf16=bfmmla", NULL}, *need_moe_bf16[] = {"moe_experts_bf16=grouped_bfmmla", NULL};
    e.msg[0] = 0;
    CHECK(kern_select_from(&k, t, n, KERN_FEAT_ALL & ~KERN_FEAT_ARM_BF16, need_bf16, NULL, 0, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "bfmmla") && strstr(e.msg, "lacks: bf16"),
          "bfmmla on a CPU without BF16: %s", e.msg);
    e.msg[0] = 0;
    CHECK(kern_select_from(&k, t, n, KERN_FEAT_ALL & ~KERN_FEAT_ARM_BF16, need_moe_bf16, NULL, 0, &e) ==
                  CT_ERR_CONFIG && strstr(e.msg, "lacks: bf16"),
          "grouped_bfmmla on a CPU without BF16: %s", e.msg);
#else
    const char *need[] = {"matmul_bf16=avx512bf16", NULL};
    CHECK(kern_select_from(&k, t, n, KERN_FEAT_ALL & ~KERN_FEAT_AVX512BF16, need, NULL, 0, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "avx512bf16"),
          "avx512bf16 on a CPU without it: %s", e.msg);
    /* AMX where the tiles are missing (or Linux refused them): a config error naming the feature,
     * never a selected kernel that would die of SIGILL */
    const char *need_amx[][2] = {{"matmul_bf16=amx", NULL}, {"moe_experts_bf16=grouped_amx", NULL}};
    for (int i = 0; i < 2; i++) {
        e.msg[0] = 0;
        CHECK(kern_select_from(&k, t, n, KERN_FEAT_ALL & ~KERN_FEAT_AMXBF16, need_amx[i], NULL, 0, &e) ==
                      CT_ERR_CONFIG &&
                  strstr(e.msg, need_amx[i][0]) && strstr(e.msg, "amx_bf16"),
              "%s on a CPU without AMX: %s", need_amx[i][0], e.msg);
    }
    /* without the AMX bit, no default uses it (the moe op included) */
    CHECK(kern_select_from(&k, t, n, KERN_FEAT_ALL & ~KERN_FEAT_AMXBF16, NULL, NULL, 0, &e) == 0 &&
              !(k.chosen[KERN_OP_MATMUL_BF16]->features & KERN_FEAT_AMXBF16) &&
              !(k.chosen[KERN_OP_MOE_BF16]->features & KERN_FEAT_AMXBF16),
          "a default needs AMX on a CPU without it: %s / %s", k.chosen[KERN_OP_MATMUL_BF16]->name,
          k.chosen[KERN_OP_MOE_BF16]->name);
#endif
    /* the hardware's feature bit (before CTITAN_ISA, which may mask it) agrees
     * with the probe, whose reason is always set */
    const char *why = NULL;
    int ready = cpu_amx_bf16_ready(&why);
    unsigned hw = kern_cpu_hw_features();
    CHECK(why && *why && !!(hw & KERN_FEAT_AMXBF16) == !!ready && (!ready || !strcmp(why, "usable")),
          "cpu_amx_bf16_ready %d (%s) vs feature bit %d", ready, why ? why : "NULL", !!(hw & KERN_FEAT_AMXBF16));
}

int main(void) {
    test_rounding();
    test_round_in_place();
    if (getenv("CTITAN_EMULATED")) /* under qemu (scripts/test_aarch64.sh): the checker's logic, covered natively */
        printf("skip under emulation: fp32 matmuls caught by the matmul_bf16 check\n");
    else
        test_check_catches_fp32();
    test_determinism();
    test_select();
    return CHECK_DONE();
}
