/* kernels/cpu/avx512_util.h: small AVX-512 helpers shared by the packers of
 * gemm_avx512.c (fp32) and gemm_bf16_avx512.c (bf16 pairs), and the one vector
 * exp of the element-wise, attention and MoE kernels. Static inline with
 * the target attribute of their callers, so including this costs nothing in
 * the generic x86-64 build. Include <immintrin.h> first. */
#ifndef CT_KERNELS_CPU_AVX512_UTIL_H
#define CT_KERNELS_CPU_AVX512_UTIL_H
#if defined(__x86_64__)

#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

/* Mask of the low n lanes (n <= 0: none, n >= 16: all). */
T512 static inline __mmask16 lanes(long n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
}

/* The first n lanes at p (n >= 16: all 16), the rest zero / left as they
 * are: a whole vector is moved unmasked, only a tail through the mask. On
 * this project's AMD Zen 5 a masked store cost several times a plain one even
 * with every lane set: with masked stores throughout, the element-wise
 * SwiGLU forward ran at 34-39 GB/s against 86-93 with these, the q/k norm +
 * RoPE backward at 37-52 against 54-76 (docs/benchmarks.md). */
T512 static inline __m512 avx512_loadn(const float *p, long n) {
    return n >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(lanes(n), p);
}
T512 static inline void avx512_storen(float *p, __m512 v, long n) {
    if (n >= 16) _mm512_storeu_ps(p, v);
    else _mm512_mask_storeu_ps(p, lanes(n), v);
}

/* a / b and sqrt(a) as two 256-bit halves. On Zen 5 a zmm division or root
 * cost more than the two ymm ones: AdamW (two divisions and a root per
 * element) ran at 64 GB/s with plain stores and zmm divisions, 68-71 with
 * these, level with the AVX2 kernel. Correctly rounded either way, so the
 * same bits. */
T512 static inline __m512 avx512_div(__m512 a, __m512 b) {
    __m256 lo = _mm256_div_ps(_mm512_castps512_ps256(a), _mm512_castps512_ps256(b));
    __m256 hi = _mm256_div_ps(_mm512_extractf32x8_ps(a, 1), _mm512_extractf32x8_ps(b, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}
T512 static inline __m512 avx512_sqrt(__m512 a) {
    __m256 lo = _mm256_sqrt_ps(_mm512_castps512_ps256(a)), hi = _mm256_sqrt_ps(_mm512_extractf32x8_ps(a, 1));
    return _mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1);
}

/* In-register transpose of a 16 x 16 block: lane j of r[i] becomes lane i of
 * r[j]. Four rounds of shuffles: pairs, quads, then 128-bit lanes twice. */
T512 __attribute__((always_inline)) static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
#pragma GCC unroll 8
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    /* r[4q + s] now holds, in 128-bit lane L, rows 4q..4q+3 of column 4L + s */
#pragma GCC unroll 2
    for (int q = 0; q < 2; q++)
#pragma GCC unroll 4
        for (int s = 0; s < 4; s++) {
            t[8 * q + s] = _mm512_shuffle_f32x4(r[8 * q + s], r[8 * q + 4 + s], 0x88);
            t[8 * q + 4 + s] = _mm512_shuffle_f32x4(r[8 * q + s], r[8 * q + 4 + s], 0xDD);
        }
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        r[s] = _mm512_shuffle_f32x4(t[s], t[8 + s], 0x88);
        r[8 + s] = _mm512_shuffle_f32x4(t[s], t[8 + s], 0xDD);
    }
}

/* e^x for 16 lanes.
 * x = n ln2 + r with n = round(x / ln2), |r| <= ln2/2 = 0.347 (Cody-Waite: ln2
 * split into the float nearest ln2 and the remainder, each product exact inside
 * the FMA), e^r by its Taylor polynomial to r^7 (truncation error
 * 0.347^8 / 8! = 5e-9 relative, below half an ulp of 2^-24 = 6e-8), then
 * scaled by 2^n with vscalefps, which handles overflow to +inf. Measured
 * against double exp on 2^24 points of [-103, 88.7]: max relative error
 * 7.8e-8 (about 1.3 ulp; the same bound as libm's expf on those points), over
 * 100x inside kern_check's 1e-5 (tests/c/kernels/test_elementwise.c holds it to
 * 1.2e-7). The clamp keeps n finite (e^89 overflows anyway) and is written
 * so that a NaN input stays NaN, as with expf.
 *
 * Results that would be denormal are 0: x < -86.5 (e^-86.5 = 2.6e-38,
 * just above the smallest normal float) is masked out of the scaling, where
 * expf underflows gradually. On Intel cores an FP result below the normal
 * range, rounded to a denormal or to 0, takes a microcode assist of ~100+
 * cycles unless MXCSR's flush-to-zero is set (not ours to set for a library);
 * every masked key of the causal attention is such a lane (e^-inf): the
 * AVX-512 attention's forward ran 25% faster on a Xeon without them
 * (docs/benchmarks.md). A sum of probabilities or a sigmoid cannot see the
 * 2.6e-38 difference; -inf still gives 0. avx2_util.h's exp8 and
 * neon_util.h's neon_exp4 flush at the same -86.5 (tests/c/kernels/test_elementwise.c
 * holds all three to that boundary), so the three stay bit-identical. */
T512 __attribute__((always_inline)) static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x)); /* NaN passes */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147182464599609375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-1.904654299957768e-09f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-86.5f), _CMP_NLT_UQ); /* NaN kept */
    return _mm512_maskz_scalef_ps(normal, p, n);
}

/* tanh(x) for 16 lanes (attention's soft cap, geglu). tanh is odd: computed on
 * a = |x|, the sign of x put back (so -0 stays -0). For a < 0.625 the odd
 * polynomial a + a^3 P(a^2), P of degree 5 fitted to (tanh(a)/a - 1)/a^2 on
 * [0, 0.625] for relative error (no cancellation near 0, where 1 - e^-2a
 * would lose the low bits); above, (1 - e)/(1 + e) with e = e^-2a through
 * exp16, which underflows to 0 for large a and gives exactly 1. Measured
 * against double tanh (tests/c/kernels/test_elementwise.c): <= 2.5e-7 relative over
 * [-12, 12]; NaN stays NaN. avx2_util.h's tanh8 is the same algorithm. */
#define TANH_SMALL 0.625f
#define TANH_P0 -0.3333333134651184f
#define TANH_P1 0.13333211839199066f
#define TANH_P2 -0.05394745245575905f
#define TANH_P3 0.021703990176320076f
#define TANH_P4 -0.00818463321775198f
#define TANH_P5 0.002148957457393408f
T512 __attribute__((always_inline)) static inline __m512 tanh16(__m512 x) {
    __m512 a = _mm512_abs_ps(x), z = _mm512_mul_ps(a, a), one = _mm512_set1_ps(1.0f);
    __m512 p = _mm512_set1_ps(TANH_P5);
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P4));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P3));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P2));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P1));
    p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(TANH_P0));
    __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, z), p, a);
    __m512 e = exp16(_mm512_mul_ps(a, _mm512_set1_ps(-2.0f)));
    __m512 big = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    __m512 t = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, _mm512_set1_ps(TANH_SMALL), _CMP_LT_OQ), big, small);
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

#endif /* __x86_64__ */
#endif /* CT_KERNELS_CPU_AVX512_UTIL_H */
