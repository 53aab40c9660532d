/* kernels/cpu/gemm_bf16.c: the matmul_bf16 op's implementations on gemm_f32.
 *
 * The three products of ops.h (forward, dinp, dw) are the same strided GEMM
 * calls as matmul_cpu.c's, on an architecture whose packers round to bf16:
 *   avx512bf16  gemm_arch_avx512bf16: bf16 pairs, vdpbf16ps (gemm_bf16_avx512.c)
 *   avx512      gemm_arch_avx512 whose packed panels are rounded in place
 *   avx2        gemm_arch_avx2 likewise
 * The last two serve CPUs without AVX512_BF16: a product of two bf16 values
 * is exact in fp32, so fp32 FMAs on rounded panels compute what vdpbf16ps
 * does, at fp32 speed. Rounding the packed block after packing costs one
 * more pass over it (~1% of a GEMM on the model's shapes).
 *
 * Unlike the fp32 matmul, the forward has no few-rows (decode) path: bf16
 * is a training setting, where M is batch x sequence; every M goes through
 * the packed GEMM, which handles any M correctly. */
#if defined(__x86_64__) /* x86-64 only, the whole file (aarch64: the _neon files) */
#include <immintrin.h>

#include "core/dtype.h"
#include "kernels/cpu/kern_cpu.h"

static long ceil_div(long a, long b) { return (a + b - 1) / b; }

/* ------------------------------------------- rounding after fp32 packing */

#define TAVX2 __attribute__((target("avx2,fma")))

/* As gemm_round_bf16_avx512, with AVX2. */
TAVX2 static void round_bf16_avx2(float *p, size_t n) {
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff),
                  keep = _mm256_set1_epi32((int)0xffff0000u), quiet = _mm256_set1_epi32(0x00400000);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(p + i);
        __m256i u = _mm256_castps_si256(x);
        __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(u, 16), one), half));
        __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
        r = _mm256_blendv_epi8(r, _mm256_or_si256(u, quiet), nan);
        _mm256_storeu_si256((__m256i *)(p + i), _mm256_and_si256(r, keep));
    }
    for (; i < n; i++) p[i] = ct_bf16_to_f32(ct_f32_to_bf16(p[i]));
}

static void pack_a_r512(float *dst, gemm_view a, long m, long kc) {
    gemm_arch_avx512.pack_a(dst, a, m, kc);
    gemm_round_bf16_avx512(dst, (size_t)(ceil_div(m, gemm_arch_avx512.mr) * gemm_arch_avx512.mrs * kc));
}
static void pack_b_r512(float *dst, gemm_view b, long kc, long n) {
    gemm_arch_avx512.pack_b(dst, b, kc, n);
    gemm_round_bf16_avx512(dst, (size_t)(ceil_div(n, gemm_arch_avx512.nr) * gemm_arch_avx512.nr * kc));
}
static void pack_a_r2(float *dst, gemm_view a, long m, long kc) {
    gemm_arch_avx2.pack_a(dst, a, m, kc);
    round_bf16_avx2(dst, (size_t)(ceil_div(m, gemm_arch_avx2.mr) * gemm_arch_avx2.mrs * kc));
}
static void pack_b_r2(float *dst, gemm_view b, long kc, long n) {
    gemm_arch_avx2.pack_b(dst, b, kc, n);
    round_bf16_avx2(dst, (size_t)(ceil_div(n, gemm_arch_avx2.nr) * gemm_arch_avx2.nr * kc));
}

/* `base` with rounding packers (a function-pointer member of another const
 * object is not a constant expression in C, so this is built per call). */
static gemm_arch rounding_arch(const gemm_arch *base, gemm_pack_a_fn pa, gemm_pack_b_fn pb) {
    gemm_arch ar = *base;
    ar.pack_a = pa;
    ar.pack_b = pb;
    ar.ukernel_rm = NULL; /* A must go through the rounding packer */
    ar.nt_small = NULL;
    return ar;
}

gemm_arch gemm_arch_rounding_bf16(const gemm_arch *base) {
    return base == &gemm_arch_avx2 ? rounding_arch(&gemm_arch_avx2, pack_a_r2, pack_b_r2)
                                   : rounding_arch(&gemm_arch_avx512, pack_a_r512, pack_b_r512);
}

/* --------------------------------------------------- the three products */

static void mm_fwd(const gemm_arch *ar, float *out, const float *inp, const float *w, int M, int K, int N,
                   int accumulate) {
    gemm_view a = {inp, K, 1, NULL}, b = {w, 1, K, NULL};
    gemm_f32(ar, M, N, K, a, b, out, N, accumulate);
}

void kern_matmul_bf16_fwd_avx512bf16(float *out, const float *inp, const float *w, int M, int K, int N,
                                     int accumulate) {
    mm_fwd(&gemm_arch_avx512bf16, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_bwd_avx512bf16(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                     int M, int K, int N, int accumulate) {
    gemm_matmul_bwd(&gemm_arch_avx512bf16, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_fwd_avx512(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx512, pack_a_r512, pack_b_r512);
    mm_fwd(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                                 int K, int N, int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx512, pack_a_r512, pack_b_r512);
    gemm_matmul_bwd(&ar, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_fwd_avx2(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx2, pack_a_r2, pack_b_r2);
    mm_fwd(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bf16_bwd_avx2(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                               int K, int N, int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx2, pack_a_r2, pack_b_r2);
    gemm_matmul_bwd(&ar, dinp, dw, dout, inp, w, M, K, N, accumulate);
}

/* A bf16 w: the pair arch copies its bits (pack_b_h); the rounding archs keep
 * their base's pack_b_h (rounding_arch replaces pack_a / pack_b only), which
 * widens while packing: a widened bf16 value is what rounding would leave,
 * so the panels hold the bits the rounding packer makes from its widening. */
void kern_matmul_fwd_wbf16_bf16_avx512bf16(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                           int accumulate) {
    gemm_matmul_fwd_wbf16(&gemm_arch_avx512bf16, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_bf16_avx512bf16(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                            int ldd, int accumulate) {
    gemm_matmul_dinp_wbf16(&gemm_arch_avx512bf16, dinp, dout, w, M, K, N, ldd, accumulate);
}
void kern_matmul_fwd_wbf16_bf16_avx512(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                       int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx512, pack_a_r512, pack_b_r512);
    gemm_matmul_fwd_wbf16(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_bf16_avx512(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                        int ldd, int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx512, pack_a_r512, pack_b_r512);
    gemm_matmul_dinp_wbf16(&ar, dinp, dout, w, M, K, N, ldd, accumulate);
}
void kern_matmul_fwd_wbf16_bf16_avx2(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                     int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx2, pack_a_r2, pack_b_r2);
    gemm_matmul_fwd_wbf16(&ar, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_dinp_wbf16_bf16_avx2(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                      int ldd, int accumulate) {
    gemm_arch ar = rounding_arch(&gemm_arch_avx2, pack_a_r2, pack_b_r2);
    gemm_matmul_dinp_wbf16(&ar, dinp, dout, w, M, K, N, ldd, accumulate);
}
#endif /* __x86_64__ */
