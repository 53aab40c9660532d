/* kernels/cpu/elementwise_avx2.c: AVX2 + FMA versions of the memory-bound ops
 * (embedding, rmsnorm, rope, the fused q/k-norm + RoPE, swiglu, geglu, add,
 * cross-entropy and its vocabulary-parallel phases, AdamW), registered as
 * "avx2" after "avx512" and before "ref": CPUs without AVX-512 (Zen 3, older
 * Intel cores) run these instead of the scalar references.
 *
 * Design. The op bodies live in elementwise_vec.inc, written against a small
 * vector API (its header states the contract); this file defines that API for
 * 8-lane ymm vectors and includes it once. So the algorithms, thread split and
 * determinism rules are exactly those of elementwise_avx512.c (whose header
 * note explains them); only the width and the tail mechanics differ: AVX2 has
 * no mask registers, so tails use vmaskmovps with an integer lane mask
 * (masked-off lanes never fault, so no buffer needs padding), and full vectors
 * take plain loads. The exp is avx2_util.h's exp8 (bit-identical to the
 * AVX-512 exp16).
 *
 * AdamW, add and the embedding are bit-identical to "ref": the API's
 * add/mul/sub/div are the intrinsics, which GCC does not contract into FMAs
 * under -std=c11 (-ffp-contract=off), and FMAs appear only where the
 * algorithm asks for one (the sums of rmsnorm, the q/k-norm and the dw
 * reductions, which kern_check judges at 1e-5 like the AVX-512 ones).
 *
 * Functions carry a target attribute ("avx2,fma") instead of per-file -m
 * flags, so the build stays generic x86-64; the registry installs them only
 * where the CPU has AVX2 and FMA. The whole file is x86-64 only. */
#if defined(__x86_64__)
#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/err.h"
#include "kernels/cpu/avx2_util.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"

/* ------------------------------------------- the vector API for 8-lane ymm */

#define EWV_FN T256
#define EWV_INLINE T256_INLINE
#define EWV_NAME(x) x##_avx2
#define EWV_W 8
typedef __m256 ewv_t;

T256_INLINE ewv_t ewv_zero(void) { return _mm256_setzero_ps(); }
T256_INLINE ewv_t ewv_set1(float f) { return _mm256_set1_ps(f); }
T256_INLINE ewv_t ewv_load(const float *p) { return _mm256_loadu_ps(p); }
T256_INLINE void ewv_store(float *p, ewv_t v) { _mm256_storeu_ps(p, v); }
T256_INLINE ewv_t ewv_loadn(const float *p, long n) { return avx2_loadn(p, n); }
T256_INLINE void ewv_storen(float *p, ewv_t v, long n) { avx2_storen(p, v, n); }
T256_INLINE ewv_t ewv_fill_tail(ewv_t v, long n, float f) { return avx2_fill_tail(v, n, f); }
T256_INLINE ewv_t ewv_add(ewv_t a, ewv_t b) { return _mm256_add_ps(a, b); }
T256_INLINE ewv_t ewv_sub(ewv_t a, ewv_t b) { return _mm256_sub_ps(a, b); }
T256_INLINE ewv_t ewv_mul(ewv_t a, ewv_t b) { return _mm256_mul_ps(a, b); }
T256_INLINE ewv_t ewv_div(ewv_t a, ewv_t b) { return _mm256_div_ps(a, b); }
T256_INLINE ewv_t ewv_max(ewv_t a, ewv_t b) { return _mm256_max_ps(a, b); }
T256_INLINE ewv_t ewv_sqrt(ewv_t a) { return _mm256_sqrt_ps(a); }
T256_INLINE ewv_t ewv_fma(ewv_t a, ewv_t b, ewv_t c) { return _mm256_fmadd_ps(a, b, c); }
T256_INLINE ewv_t ewv_exp(ewv_t x) { return exp8(x); }
T256_INLINE ewv_t ewv_tanh(ewv_t x) { return tanh8(x); }
T256_INLINE float ewv_hsum(ewv_t v) { return avx2_hsum(v); }
T256_INLINE float ewv_hmax(ewv_t v) { return avx2_hmax(v); }

#include "kernels/cpu/elementwise_vec.inc"

/* Exposed for the accuracy test of the vector exp (tests/c/kernels/test_elementwise.c):
 * out[i] = e^x[i] through exp8 (avx2_util.h). */
T256 void kern_exp_avx2(float *out, const float *x, long n) {
    for (long i = 0; i < n; i += 8) avx2_storen(out + i, exp8(avx2_loadn(x + i, n - i)), n - i);
}

/* The same for the vector tanh (avx2_util.h's tanh8: attention's soft cap). */
T256 void kern_tanh_avx2(float *out, const float *x, long n) {
    for (long i = 0; i < n; i += 8) avx2_storen(out + i, tanh8(avx2_loadn(x + i, n - i)), n - i);
}

#endif /* __x86_64__ */
