/* kernels/cpu/avx512_util.h: small AVX-512 helpers shared by the packers of
 * gemm_avx512.c (fp32) and gemm_bf16_avx512.c (bf16 pairs). Static inline with
 * the target attribute of their callers, so including this costs nothing in
 * the generic x86-64 build. Include <immintrin.h> first. */
#ifndef CT_KERNELS_CPU_AVX512_UTIL_H
#define CT_KERNELS_CPU_AVX512_UTIL_H

#include <immintrin.h>

#define T512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))

/* Mask of the low n (0..16) lanes. */
T512 static inline __mmask16 lanes(int n) {
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u);
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

#endif
