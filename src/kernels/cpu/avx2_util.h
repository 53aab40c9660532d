/* kernels/cpu/avx2_util.h: small AVX2 + FMA helpers shared by the AVX2
 * element-wise kernels (elementwise_avx2.c) and the register-blocked AVX2
 * attention (attention_avx2.c): tail masks, fixed-order horizontal reductions,
 * the 8-lane vector exp and an 8 x 8 transpose. The AVX2 counterpart of
 * avx512_util.h.
 *
 * Static inline with the target attribute of their callers (T256), so
 * including this costs nothing in the generic x86-64 build. Include
 * <immintrin.h> first. x86-64 only: the includers guard it. */
#ifndef CT_KERNELS_CPU_AVX2_UTIL_H
#define CT_KERNELS_CPU_AVX2_UTIL_H

#include <immintrin.h>

#define T256 __attribute__((target("avx2,fma")))
#define T256_INLINE T256 __attribute__((always_inline)) static inline

/* Integer mask (all ones / zero per 32-bit lane) of the lanes i < n, n any long
 * (<= 0: none, >= 8: all); the form _mm256_maskload_ps / maskstore take. */
T256_INLINE __m256i avx2_lanes(long n) {
    int k = n <= 0 ? 0 : n >= 8 ? 8 : (int)n;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(k), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* min(n, 8) floats from p, zeros in the other lanes; never reads p[n] or beyond
 * (masked-off lanes of vmaskmovps do not fault). */
T256_INLINE __m256 avx2_loadn(const float *p, long n) {
    return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, avx2_lanes(n));
}
T256_INLINE void avx2_storen(float *p, __m256 v, long n) {
    if (n >= 8)
        _mm256_storeu_ps(p, v);
    else
        _mm256_maskstore_ps(p, avx2_lanes(n), v);
}
/* Lanes i >= n replaced by `fill` (e.g. -inf before a max). */
T256_INLINE __m256 avx2_fill_tail(__m256 v, long n, float fill) {
    return n >= 8 ? v : _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(avx2_lanes(n)));
}

/* Horizontal sum in a fixed order: (lo128 + hi128), then lanes (0+2, 1+3), then
 * (0 + 1). The same order for every call, so sums are reproducible. */
T256_INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* Horizontal max (exact in any order). */
T256_INLINE float avx2_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* e^x for 8 lanes: exp16's algorithm (avx512_util.h) without vscalefps.
 * x = n ln2 + r, n = round(x / ln2), |r| <= ln2/2 (Cody-Waite split of ln2,
 * each product exact inside the FMA), e^r by its Taylor polynomial to r^7,
 * then the scaling by 2^n built by integer shifts into the exponent field.
 * After the clamp to [-104, 89], n is in [-150, 129], outside the normal
 * exponents [-126, 127] at both ends (e^88.7 = 0.98 x 2^128 is finite; results
 * below 2^-126 are denormal), so 2^n is applied as two normal factors,
 * 2^(n >> 1) then 2^(n - (n >> 1)), each in [-75, 65]: p 2^(n >> 1) is exact
 * (p is in [0.7, 1.42], the product stays normal), and the second product
 * rounds once, so overflow gives +inf exactly as vscalefps. Results that
 * would be denormal are 0, as in exp16 (avx512_util.h: an
 * underflowing product takes a microcode assist on Intel cores): the second
 * factor is zeroed for x < -86.5 before the product, which is then an exact
 * 0. The results are bit-identical to exp16's (the polynomial and its order
 * are the same). Measured error: avx512_util.h; tests/c/kernels/test_elementwise.c
 * holds both to 1.2e-7 relative. A NaN input passes the clamp (minps/maxps
 * return their second operand on NaN) and the polynomial stays NaN; -inf
 * gives 0. */
T256_INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-104.0f), _mm256_min_ps(_mm256_set1_ps(89.0f), x)); /* NaN passes */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147182464599609375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-1.904654299957768e-09f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i ni = _mm256_cvtps_epi32(n); /* NaN: 0x80000000, harmless: p is NaN */
    __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
    s2 = _mm256_and_ps(s2, _mm256_cmp_ps(x, _mm256_set1_ps(-86.5f), _CMP_NLT_UQ)); /* NaN kept */
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}

/* tanh(x) for 8 lanes: avx512_util.h's tanh16 (the same polynomial below
 * 0.625, (1 - e)/(1 + e) with e = e^-2a above it, the sign of x put back). */
T256_INLINE __m256 tanh8(__m256 x) {
    const __m256 signbit = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    __m256 a = _mm256_andnot_ps(signbit, x), z = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(0.002148957457393408f);
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-0.00818463321775198f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.021703990176320076f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-0.05394745245575905f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(0.13333211839199066f));
    p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(-0.3333333134651184f));
    __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, z), p, a);
    __m256 e = exp8(_mm256_mul_ps(a, _mm256_set1_ps(-2.0f)));
    __m256 big = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ));
    return _mm256_or_ps(t, _mm256_and_ps(signbit, x));
}

/* In-register 8 x 8 transpose: lane j of r[i] becomes lane i of r[j] (the
 * transposes of attention_avx2.c's K and V and of gemm_avx2.c's packing;
 * moves values, rounds nothing). */
T256_INLINE void avx2_transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
#pragma GCC unroll 4
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
#pragma GCC unroll 2
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    /* u[s] (rows 0..3) and u[4 + s] (rows 4..7) hold columns s and 4 + s in their 128-bit halves */
#pragma GCC unroll 4
    for (int s = 0; s < 4; s++) {
        r[s] = _mm256_permute2f128_ps(u[s], u[4 + s], 0x20);
        r[4 + s] = _mm256_permute2f128_ps(u[s], u[4 + s], 0x31);
    }
}

#endif
