/* tests/c/kernels/test_gemm.c: the GEMM driver's packers (and in-place A) on every arch this CPU runs.
 *
 * The model passes every operand with one stride 1, and the packers have a
 * fast path for each of the two; `kernels check` covers those through the
 * matmul entries. Here gemm_f32 is called directly with B as a view that the
 * model never makes (neither stride 1), fp32 and bf16 (a frozen weight's
 * store), beside the same values given row-major and transposed: packing
 * only moves values, so all of them must give the same bits. The strided
 * forms go through each arch's general fallback (gemm_pack_b_h_strided for
 * the fp32 archs' bf16 packer), which nothing else reaches. A too, given
 * row-major (read in place where an arch has ukernel_rm: avx2), transposed
 * and strided (packed), must give the same bits. The 28 x 16 tile for narrow
 * C (avx512_n16, LoRA's rank side) must also give the bits of the 14 x 32 one
 * on every C at most 16 wide, with and without accumulation. */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/cpu.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/registry.h"

typedef struct {
    const char *name;
    gemm_arch arch;
} arch_case;

static int n_archs(arch_case *out) {
    unsigned f = kern_cpu_hw_features(); /* every arch the hardware runs, whatever CTITAN_ISA masks */
    int n = 0;
#if defined(__x86_64__)
    if ((f & KERN_FEAT_AVX512) == KERN_FEAT_AVX512) out[n++] = (arch_case){"avx512", gemm_arch_avx512};
    if ((f & KERN_FEAT_AVX512) == KERN_FEAT_AVX512) out[n++] = (arch_case){"avx512_n16", gemm_arch_avx512_n16};
    if ((f & (KERN_FEAT_AVX2 | KERN_FEAT_FMA)) == (KERN_FEAT_AVX2 | KERN_FEAT_FMA))
        out[n++] = (arch_case){"avx2", gemm_arch_avx2};
    if ((f & (KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16)) == (KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16))
        out[n++] = (arch_case){"avx512bf16", gemm_arch_avx512bf16};
    /* the AMX packers round with AVX512_BF16's conversion (bf16_pairs.h) */
    if ((f & KERN_FEAT_AMXBF16) && (f & KERN_FEAT_AVX512BF16) && cpu_amx_bf16_ready(NULL))
        out[n++] = (arch_case){"amx", gemm_arch_amx};
#elif defined(__aarch64__)
    out[n++] = (arch_case){"neon", gemm_arch_neon};
    if (f & KERN_FEAT_ARM_BF16) out[n++] = (arch_case){"bfmmla", gemm_arch_bfmmla};
    if (f & KERN_FEAT_SVE) out[n++] = (arch_case){"sve", gemm_arch_sve()};
#endif
    (void)f;
    return n;
}

static float frand(uint32_t *s) {
    *s = *s * 1664525u + 1013904223u;
    return (float)((*s >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* bf16 bits whose widening is exact: the high half of an fp32 value */
static uint16_t to_bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)(u >> 16);
}

static float widen(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Elements of c that differ bitwise from c0 (n of them); *first gets the first one. */
static size_t bit_diffs(const float *c0, const float *c, size_t n, size_t *first) {
    size_t bad = 0;
    *first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(&c0[i], &c[i], sizeof(float)) && !bad++) *first = i;
    return bad;
}

/* C[M,N] = A[M,K] B[K,N] with B as five views of the same values, and A as
 * two more; every C must equal the one of row-major fp32 A and B bit for
 * bit. K spans several k blocks and N a partial panel, so the packers' edges
 * are crossed. */
static void check_arch(const arch_case *ac, int M, int K, int N) {
    const gemm_arch *ar = &ac->arch;
    size_t nb = (size_t)K * N;
    uint32_t seed = 12345u + (uint32_t)(M * 31 + K * 7 + N);
    float *A = malloc((size_t)M * K * sizeof *A);
    float *Brm = malloc(nb * sizeof *Brm), *Bt = malloc(nb * sizeof *Bt), *Bs = malloc(3 * nb * sizeof *Bs);
    uint16_t *Hrm = malloc(nb * sizeof *Hrm), *Ht = malloc(nb * sizeof *Ht), *Hs = malloc(3 * nb * sizeof *Hs);
    for (size_t i = 0; i < (size_t)M * K; i++) A[i] = frand(&seed);
    memset(Bs, 0xff, 3 * nb * sizeof *Bs); /* NaN bits between the strided elements: read one, and C shows it */
    memset(Hs, 0xff, 3 * nb * sizeof *Hs);
    for (int k = 0; k < K; k++)
        for (int j = 0; j < N; j++) {
            uint16_t h = to_bf16_bits(frand(&seed));
            float v = widen(h); /* bf16 values, so the fp32 and bf16 views hold the same numbers */
            Brm[(size_t)k * N + j] = v, Bt[(size_t)j * K + k] = v, Bs[(size_t)k * 3 * N + 3 * j + 1] = v;
            Hrm[(size_t)k * N + j] = h, Ht[(size_t)j * K + k] = h, Hs[(size_t)k * 3 * N + 3 * j + 1] = h;
        }
    const char *what[] = {"fp32 transposed", "fp32 strided (rs 3N, cs 3)", "bf16 row-major", "bf16 transposed",
                          "bf16 strided (rs 3N, cs 3)"};
    gemm_view views[] = {
        {.p = Bt, .rs = 1, .cs = K},
        {.p = Bs + 1, .rs = 3L * N, .cs = 3},
        {.h = Hrm, .rs = N, .cs = 1},
        {.h = Ht, .rs = 1, .cs = K},
        {.h = Hs + 1, .rs = 3L * N, .cs = 3},
    };
    gemm_view a = {.p = A, .rs = K, .cs = 1};
    float *C0 = malloc((size_t)M * N * sizeof *C0), *C1 = malloc((size_t)M * N * sizeof *C1);
    gemm_f32(ar, M, N, K, a, (gemm_view){.p = Brm, .rs = N, .cs = 1}, C0, N, 0);
    /* A the same way: a row-major A is read in place by an arch's ukernel_rm
     * (avx2), the transposed and strided ones packed for its ukernel; both
     * must sum each element in the same order */
    float *At = malloc((size_t)M * K * sizeof *At), *As = malloc(3 * (size_t)M * K * sizeof *As);
    memset(As, 0xff, 3 * (size_t)M * K * sizeof *As);
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) {
            float v = A[(size_t)i * K + k];
            At[(size_t)k * M + i] = v, As[(size_t)i * 3 * K + 3 * k + 1] = v;
        }
    const char *awhat[] = {"transposed", "strided (rs 3K, cs 3)"};
    gemm_view aviews[] = {{.p = At, .rs = 1, .cs = M}, {.p = As + 1, .rs = 3L * K, .cs = 3}};
    for (int v = 0; v < 2; v++) {
        memset(C1, 0, (size_t)M * N * sizeof *C1);
        gemm_f32(ar, M, N, K, aviews[v], (gemm_view){.p = Brm, .rs = N, .cs = 1}, C1, N, 0);
        size_t first, bad = bit_diffs(C0, C1, (size_t)M * N, &first);
        CHECK(bad == 0, "%s, M %d K %d N %d, A %s: %zu of %d elements differ from row-major A (first [%zu]: %.9g "
                        "against %.9g)",
              ac->name, M, K, N, awhat[v], bad, M * N, first, bad ? C1[first] : 0.0, bad ? C0[first] : 0.0);
    }
    free(At), free(As);
    for (int v = 0; v < 5; v++) {
        memset(C1, 0, (size_t)M * N * sizeof *C1);
        gemm_f32(ar, M, N, K, a, views[v], C1, N, 0);
        size_t first, bad = bit_diffs(C0, C1, (size_t)M * N, &first);
        CHECK(bad == 0, "%s, M %d K %d N %d, B %s: %zu of %d elements differ from row-major fp32 B (first [%zu]: %.9g "
                        "against %.9g)",
              ac->name, M, K, N, what[v], bad, M * N, first, bad ? C1[first] : 0.0, bad ? C0[first] : 0.0);
    }
    free(A), free(Brm), free(Bt), free(Bs), free(Hrm), free(Ht), free(Hs), free(C0), free(C1);
}

#if defined(__x86_64__)
/* C[M,N] (+)= A B with N <= 16 on gemm_arch_avx512_n16 and gemm_arch_avx512:
 * the same FMA chain per element in k blocks of the same kc, so the same bits,
 * for A row-major and transposed (dB's dy^T) and B row-major and transposed
 * (the forward's A[r, K]). M crosses the 28-row panel's edge variants; K 800
 * is three k blocks. */
static void check_narrow(int M, int K, int N, int accumulate) {
    uint32_t seed = 777u + (uint32_t)(M * 131 + K * 17 + N * 3 + accumulate);
    float *A = malloc((size_t)M * K * sizeof *A), *At = malloc((size_t)M * K * sizeof *At);
    float *B = malloc((size_t)K * N * sizeof *B), *Bt = malloc((size_t)K * N * sizeof *Bt);
    float *C0 = malloc((size_t)M * N * sizeof *C0), *C1 = malloc((size_t)M * N * sizeof *C1);
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) At[(size_t)k * M + i] = A[(size_t)i * K + k] = frand(&seed);
    for (int k = 0; k < K; k++)
        for (int j = 0; j < N; j++) Bt[(size_t)j * K + k] = B[(size_t)k * N + j] = frand(&seed);
    float *Cinit = malloc((size_t)M * N * sizeof *Cinit);
    for (size_t i = 0; i < (size_t)M * N; i++) Cinit[i] = frand(&seed);
    gemm_view av[] = {{.p = A, .rs = K, .cs = 1}, {.p = At, .rs = 1, .cs = M}};
    gemm_view bv[] = {{.p = B, .rs = N, .cs = 1}, {.p = Bt, .rs = 1, .cs = K}};
    for (int va = 0; va < 2; va++)
        for (int vb = 0; vb < 2; vb++) {
            memcpy(C0, Cinit, (size_t)M * N * sizeof *C0);
            memcpy(C1, Cinit, (size_t)M * N * sizeof *C1);
            gemm_f32(&gemm_arch_avx512, M, N, K, av[va], bv[vb], C0, N, accumulate);
            gemm_f32(&gemm_arch_avx512_n16, M, N, K, av[va], bv[vb], C1, N, accumulate);
            size_t first, bad = bit_diffs(C0, C1, (size_t)M * N, &first);
            CHECK(bad == 0, "avx512_n16 against avx512, M %d K %d N %d, A %s, B %s%s: %zu of %d elements differ "
                            "(first [%zu]: %.9g against %.9g)",
                  M, K, N, va ? "transposed" : "row-major", vb ? "transposed" : "row-major",
                  accumulate ? ", accumulating" : "", bad, M * N, first, bad ? C1[first] : 0.0, bad ? C0[first] : 0.0);
        }
    free(A), free(At), free(B), free(Bt), free(C0), free(C1), free(Cinit);
}
#endif

int main(void) {
    arch_case archs[8];
    int n = n_archs(archs);
    if (n == 0) printf("gemm packers: skipped: no SIMD GEMM arch runs on this CPU\n");
    /* M, K, N. M mod 6 (avx2's rows) of 5, 1, 4, 2: every edge-row kernel; the fifth
     * shape is large enough for two threads (gemm_f32's serial threshold); the
     * last runs avx2's in-place A B-stationary (a thread's columns > ncb: N is
     * split in 4 units per thread) over row blocks of mcb (192, 192, 16) with a
     * 2-column edge */
    static const int shapes[][3] = {{5, 7, 3}, {37, 1100, 45}, {64, 300, 100}, {20, 40, 17}, {134, 600, 70},
                                    {400, 37, 2210}};
    /* Under qemu (scripts/test_aarch64.sh) the last shape was ~3/4 of this test's 54 s. Its 400
     * rows are for avx2's row blocks (mcb, x86 only: the native run covers them); 40 rows keep
     * what the Arm archs' packers get from it, N over several column blocks with an edge. */
    int emu = getenv("CTITAN_EMULATED") != NULL;
    if (emu) printf("skip under emulation: 400 rows of the 400 x 37 x 2210 case (avx2's row blocks): 40 here\n");
    for (int i = 0; i < n; i++) {
        printf("gemm packers: %s\n", archs[i].name);
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int M = shapes[s][0] == 400 && emu ? 40 : shapes[s][0];
            check_arch(&archs[i], M, shapes[s][1], shapes[s][2]);
        }
    }
#if defined(__x86_64__)
    if ((kern_cpu_hw_features() & KERN_FEAT_AVX512) == KERN_FEAT_AVX512) {
        printf("gemm packers: avx512_n16 against avx512\n");
        static const int narrow[][3] = {{1, 5, 1},   {3, 64, 16},  {17, 800, 16}, {28, 384, 8},
                                        {29, 385, 16}, {57, 100, 13}, {300, 800, 16}, {512, 1024, 16}};
        for (size_t s = 0; s < sizeof narrow / sizeof narrow[0]; s++)
            for (int acc = 0; acc < 2; acc++) check_narrow(narrow[s][0], narrow[s][1], narrow[s][2], acc);
    }
#endif
    return CHECK_DONE();
}
