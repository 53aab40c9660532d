/* kernels/cpu/bf16_pairs.h: fp32 -> bf16 rounding and bf16 k-pairs, shared by
 * the bf16 GEMM packers (gemm_bf16_avx512.c: vdpbf16ps; gemm_bf16_amx.c: AMX).
 *
 * Both kernels multiply bf16 PAIRS along k: one 32-bit lane = (x[k], x[k+1]),
 * k even, element k in the low half (what vdpbf16ps and tdpbf16ps multiply).
 * Keeping one pairing routine for both means every bf16 implementation
 * multiplies the bf16 values of the reference (core/dtype's ct_f32_to_bf16,
 * torch's .to(bfloat16)): nearest, ties to even, NaN kept as a quiet NaN with
 * its sign and the payload's high bits.
 *
 * The pairs round with the CPU's own instruction (vcvtne2ps2bf16), which
 * every CPU with either kernel has: one instruction per 32 values where the
 * integer rounding (bf16_rne_hi) took six per 16 plus the pairing, and the
 * packers were ~20% of a bf16 W3 step on Zen 5 (docs/benchmarks.md). It
 * differs from the reference in one place: an fp32 subnormal (below 1.2e-38)
 * becomes a signed zero where the reference keeps a bf16 subnormal, which
 * vdpbf16ps and tdpbf16ps treat as zero anyway; the products differ only for
 * inputs within 2^-134 of the smallest normal float, which the reference
 * rounds up to it. bf16_rne_hi, the integer rounding, stays for the CPUs
 * without AVX512_BF16 (gemm_round_bf16_avx512).
 *
 * Static inline with the AVX-512 target attributes of their callers (T512 of
 * avx512_util.h, T512BF16 below), so including this costs nothing in the
 * generic build. Include <immintrin.h> and kernels/cpu/avx512_util.h first. */
#ifndef CT_KERNELS_CPU_BF16_PAIRS_H
#define CT_KERNELS_CPU_BF16_PAIRS_H

#include <stdint.h>
#include <string.h>

#include "core/dtype.h"
#include "kernels/cpu/kern_cpu.h"

/* AVX-512 with the BF16 conversions and dot products (vcvtne2ps2bf16, vdpbf16ps). */
#define T512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

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
T512BF16 static inline __m512i bf16_pair_rows(__m512 lo, __m512 hi) {
    /* 16-bit elements 0..15 = bf16(lo), 16..31 = bf16(hi), then interleaved */
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* 32 consecutive k of one row (x0 = k 0..15, x1 = k 16..31) as 16 lanes of
 * pairs: lane j = (bf16(x[2j]), bf16(x[2j+1])), which is the conversion's own
 * order (16-bit element i = bf16 of value i). */
T512BF16 static inline __m512i bf16_pair_along(__m512 x0, __m512 x1) {
    return (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
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
