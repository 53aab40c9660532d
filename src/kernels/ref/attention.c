/* kernels/ref/attention.c: tiled causal attention that never holds [T x T].
 *
 * Same contract as op_attention_fwd/bwd of ops.h (registered as "tiled",
 * ahead of the row-at-a-time "ref"). Flash-attention's algorithm, in plain C:
 *
 * forward, per (b, head, block of ATT_BQ queries): walk the key blocks of
 * ATT_BK keys up to the diagonal (blocks above it are never touched), keep a
 * running row max m and sum l of exp(s - m), rescale the output accumulator
 * whenever m grows (online softmax), and finish with out = acc / l and
 * lse = m + log l. Memory: the [B,nh,T] lse instead of [B,nh,T,T] probs.
 *
 * backward, per (b, kv head): for each query head of the group, query block
 * and key block up to the diagonal, recompute P = exp(S - lse) for the tile,
 * then dv += P^T dO, dP = dO V^T, dS = P * (dP - D) with
 * D = rowsum(dO * O), dk += scale dS^T Q, dq += scale dS K. One thread owns
 * the (b, kv head): every dk/dv row it adds to, and every dq row of the
 * group's query heads, are its own, so there are no atomics and each sum runs
 * in a fixed order (bit-identical at any thread count).
 *
 * Options (kern_attn_opt): a window starts the key loop at the block holding
 * the query block's first visible key (blocks left of the window are never
 * touched) and each row's dots at its first visible column; a soft cap
 * s = cap tanh(x / cap) is applied to the scaled scores, and its derivative
 * 1 - tanh^2 to dS. The expressions are the reference's, so the backward
 * stays bit-identical to it with options too.
 *
 * The K and V tiles are transposed into [hd][ATT_BK] scratch so that the
 * score dot products run as row updates over contiguous keys, which the
 * compiler vectorises; the score of (t, j) still sums over i in order, as the
 * reference's dot does. `omp simd` marks the element-wise loops (no
 * reductions among them, so vectorising changes no rounding): -O2's cheap
 * cost model would otherwise leave these variable-length loops scalar. */
#include <math.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/ops.h"

#define ATT_BQ 32 /* query rows per tile */
#define ATT_BK 64 /* keys per tile */

/* The same code twice (attention_tiled.inc): generic x86-64, and compiled for
 * AVX-512 (registered as "tiled_avx512", chosen where the CPU has it). The
 * vectorised loops are element-wise and nothing is contracted into FMAs
 * (-std=c11), so both copies round identically; only the width differs. */
#define ATT_TARGET
#define ATT_NAME(x) x
#include "kernels/ref/attention_tiled.inc"
#undef ATT_TARGET
#undef ATT_NAME

#if defined(__x86_64__)
#define ATT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define ATT_NAME(x) x##_avx512
#include "kernels/ref/attention_tiled.inc"
#undef ATT_TARGET
#undef ATT_NAME
/* And for AVX2 + FMA ("tiled_avx2", the fallback of blocked_avx2 for head dims
 * that are not multiples of 16): FMA is enabled but -std=c11 still forbids
 * contraction, so this copy too rounds exactly as the generic one. */
#define ATT_TARGET __attribute__((target("avx2,fma")))
#define ATT_NAME(x) x##_avx2
#include "kernels/ref/attention_tiled.inc"
#elif defined(__aarch64__)
/* On aarch64 the generic copy above is already NEON (ASIMD is part of the
 * base architecture, and `omp simd` vectorises it); the second copy is for
 * SVE's wider vectors where the CPU has them (Graviton 3: 256-bit). */
#define ATT_TARGET __attribute__((target("+sve")))
#define ATT_NAME(x) x##_sve
#include "kernels/ref/attention_tiled.inc"
#endif
