/* kernels/cpu/elementwise_neon.c: NEON versions of the memory-bound ops
 * (embedding, rmsnorm, rope, the fused q/k-norm + RoPE, swiglu, geglu, add,
 * cross-entropy and its vocabulary-parallel phases, AdamW), registered as
 * "neon" before "ref" on aarch64.
 *
 * Design. The op bodies are elementwise_vec.inc's (the algorithms, thread
 * split and determinism rules of elementwise_avx512.c, written once against
 * a small vector API); this file defines that API for 4-lane q registers and
 * includes it once. NEON has no masked loads or stores, so a tail of fewer
 * than 4 floats goes through a stack copy (neon_loadn / neon_storen), which
 * never touches memory past the tensor: no buffer needs padding. The exp is
 * neon_util.h's neon_exp4 (exp16's polynomial; 2^n applied as two normal
 * factors, as avx2_util.h's exp8). ASIMD is part of the base architecture,
 * so nothing here needs a target attribute.
 *
 * AdamW, add and the embedding are bit-identical to "ref": vaddq/vmulq/...
 * are plain C operators to GCC, which -std=c11 does not contract into FMAs
 * (the reference is built the same way); FMAs appear only where the
 * algorithm asks for one (the sums of rmsnorm, the q/k-norm and the dw
 * reductions, judged at kern_check's 1e-5). aarch64 only. */
#if defined(__aarch64__)
#include <arm_neon.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/err.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/cpu/neon_util.h"
#include "kernels/ops.h"

/* ------------------------------------------- the vector API for 4-lane NEON */

#define EWV_FN
#define EWV_INLINE NEON_INLINE
#define EWV_NAME(x) x##_neon
#define EWV_W 4
typedef float32x4_t ewv_t;

NEON_INLINE ewv_t ewv_zero(void) { return vdupq_n_f32(0.0f); }
NEON_INLINE ewv_t ewv_set1(float f) { return vdupq_n_f32(f); }
NEON_INLINE ewv_t ewv_load(const float *p) { return vld1q_f32(p); }
NEON_INLINE void ewv_store(float *p, ewv_t v) { vst1q_f32(p, v); }
NEON_INLINE ewv_t ewv_loadn(const float *p, long n) { return neon_loadn(p, n); }
NEON_INLINE void ewv_storen(float *p, ewv_t v, long n) { neon_storen(p, v, n); }
NEON_INLINE ewv_t ewv_fill_tail(ewv_t v, long n, float f) {
    if (n >= 4) return v;
    const uint32_t idx[4] = {0, 1, 2, 3};
    uint32x4_t keep = vcltq_u32(vld1q_u32(idx), vdupq_n_u32(n <= 0 ? 0u : (uint32_t)n));
    return vbslq_f32(keep, v, vdupq_n_f32(f));
}
NEON_INLINE ewv_t ewv_add(ewv_t a, ewv_t b) { return vaddq_f32(a, b); }
NEON_INLINE ewv_t ewv_sub(ewv_t a, ewv_t b) { return vsubq_f32(a, b); }
NEON_INLINE ewv_t ewv_mul(ewv_t a, ewv_t b) { return vmulq_f32(a, b); }
NEON_INLINE ewv_t ewv_div(ewv_t a, ewv_t b) { return vdivq_f32(a, b); }
NEON_INLINE ewv_t ewv_max(ewv_t a, ewv_t b) { return vmaxq_f32(a, b); }
NEON_INLINE ewv_t ewv_sqrt(ewv_t a) { return vsqrtq_f32(a); }
NEON_INLINE ewv_t ewv_fma(ewv_t a, ewv_t b, ewv_t c) { return vfmaq_f32(c, a, b); }
NEON_INLINE ewv_t ewv_exp(ewv_t x) { return neon_exp4(x); }
NEON_INLINE ewv_t ewv_tanh(ewv_t x) { return neon_tanh4(x); }
NEON_INLINE float ewv_hsum(ewv_t v) { return vaddvq_f32(v); }
NEON_INLINE float ewv_hmax(ewv_t v) { return vmaxvq_f32(v); }

#include "kernels/cpu/elementwise_vec.inc"

/* Exposed for the accuracy test of the vector exp (tests/c/kernels/test_elementwise.c):
 * out[i] = e^x[i] through neon_exp4. */
void kern_exp_neon(float *out, const float *x, long n) {
    for (long i = 0; i < n; i += 4) neon_storen(out + i, neon_exp4(neon_loadn(x + i, n - i)), n - i);
}

/* The same for the vector tanh (neon_util.h's neon_tanh4). */
void kern_tanh_neon(float *out, const float *x, long n) {
    for (long i = 0; i < n; i += 4) neon_storen(out + i, neon_tanh4(neon_loadn(x + i, n - i)), n - i);
}

#endif /* __aarch64__ */
