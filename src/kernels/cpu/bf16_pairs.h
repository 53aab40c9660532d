/* kernels/cpu/bf16_pairs.h: fp32 -> bf16 rounding and bf16 k-pairs, shared by
 * the bf16 GEMM packers (gemm_bf16_avx512.c: vdpbf16ps; gemm_bf16_amx.c: AMX).
 *
 * Both kernels multiply bf16 PAIRS along k: one 32-bit lane = (x[k], x[k+1]),
 * k even, element k in the low half (what vdpbf16ps and tdpbf16ps multiply).
 * Keeping one rounding routine for both means every bf16 implementation
 * multiplies exactly the bf16 values of the reference (core/dtype's
 * ct_f32_to_bf16, torch's .to(bfloat16)): nearest, ties to even, NaN kept as
 * a quiet NaN with its sign and payload.
 *
 * Static inline with the AVX-512 target attribute of their callers (T512 of
 * avx512_util.h), so including this costs nothing in the generic build.
 * Include <immintrin.h> and kernels/cpu/avx512_util.h first. */
#ifndef CT_KERNELS_CPU_BF16_PAIRS_H
#define CT_KERNELS_CPU_BF16_PAIRS_H

#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "kernels/cpu/kern_cpu.h"

/* x rounded to the nearest bf16 (ties to even), as fp32 bits: the bf16 is the
 * high half, the low half is garbage. NaN: a quiet NaN with the same sign and
 * payload (ct_f32_to_bf16's rule). */
T512 static inline __m512i bf16_rne_hi(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                    _mm512_set1_epi32(0x7fff));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_or_epi32(_mm512_add_epi32(u, bias), nan, u, _mm512_set1_epi32(0x00400000));
}

/* Lanes (bf16(lo[j]), bf16(hi[j])): the k pair of two rows of k. */
T512 static inline __m512i bf16_pair_rows(__m512 lo, __m512 hi) {
    return _mm512_mask_blend_epi16(0xAAAAAAAAu, _mm512_srli_epi32(bf16_rne_hi(lo), 16), bf16_rne_hi(hi));
}

/* 32 consecutive k of one row (x0 = k 0..15, x1 = k 16..31) as 16 lanes of
 * pairs: lane j = (bf16(x[2j]), bf16(x[2j+1])), i.e. the high halves of the
 * rounded values in order. */
T512 static inline __m512i bf16_pair_along(__m512 x0, __m512 x1) {
    const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29,
                                         27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(bf16_rne_hi(x0), idx, bf16_rne_hi(x1));
}

/* Lane of a bf16 pair (lo = element k, hi = element k+1) from scalars. */
static inline float bf16_pair_scalar(float lo, float hi) {
    uint32_t u = (uint32_t)ct_f32_to_bf16(lo) | (uint32_t)ct_f32_to_bf16(hi) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* B packed as bf16 pairs (gemm_bf16_avx512.c): rows [0, kc) and columns [0, n)
 * of b as ceil(n / 32) micro-panels [kd][32 lanes], lane (k2, j) = (b(2 k2, j),
 * b(2 k2 + 1, j)); kd >= ceil(kc / 2) is the panel depth, pairs past kc and
 * columns past n are zeros. vdpbf16ps reads one 32-lane row per k pair; AMX
 * reads 16 rows x 16 lanes (its VNNI B tile) with a 128-byte stride. */
void gemm_pack_b_bf16(float *dst, gemm_view b, long kc, long n, long kd);

#endif
