/* kernels/ref/matmul_bf16.c: the reference of the matmul_bf16 op.
 *
 * Design: bf16 mixed precision means "matmul inputs in bf16, sums in fp32".
 * The product of two bf16 values is exact in fp32 (8 + 8 significant bits),
 * so the whole numerical difference from the fp32 matmul is the rounding of
 * the inputs; this reference therefore rounds copies of its inputs (nearest
 * even, core/dtype's ct_f32_to_bf16, the rounding of torch's .to(bfloat16))
 * and calls the fp32 reference. Fast implementations round while packing and
 * differ from this only in summation order, so `kernels check` holds them to
 * the fp32 tolerance. Slow (copies every operand each call) by design. */
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/ops.h"

/* A bf16-rounded copy of x[n] (fp32 values), or NULL for NULL. */
static float *rounded_copy(const float *x, size_t n) {
    if (!x) return NULL;
    float *r = ct_malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) r[i] = ct_bf16_to_f32(ct_f32_to_bf16(x[i]));
    return r;
}

void op_matmul_bf16_fwd(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    // out[M,N], inp[M,K], w[N,K]
    if (M <= 0 || N <= 0) return;
    float *ri = rounded_copy(inp, (size_t)M * (K > 0 ? K : 0)), *rw = rounded_copy(w, (size_t)N * (K > 0 ? K : 0));
    op_matmul_fwd(out, ri, rw, M, K, N, accumulate);
    free(ri);
    free(rw);
}

void op_matmul_bf16_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                        int N, int accumulate) {
    // dinp[M,K] (+)= bf16(dout) @ bf16(w);  dw[N,K] += bf16(dout)^T @ bf16(inp)
    if (M <= 0 || K <= 0) return;
    if (N <= 0) { /* an empty sum: nothing to round */
        op_matmul_bwd(dinp, NULL, NULL, NULL, NULL, M, K, N, accumulate);
        return;
    }
    float *rd = rounded_copy(dout, (size_t)M * N);
    float *ri = dw ? rounded_copy(inp, (size_t)M * K) : NULL, *rw = dinp ? rounded_copy(w, (size_t)N * K) : NULL;
    op_matmul_bwd(dinp, dw, rd, ri, rw, M, K, N, accumulate);
    free(rd);
    free(ri);
    free(rw);
}

/* w[n] bf16 widened into an fp32 copy (exact). */
static float *widened_copy(const uint16_t *w, size_t n) {
    float *x = ct_malloc((n ? n : 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) x[i] = ct_bf16_to_f32(w[i]);
    return x;
}

void op_matmul_fwd_wbf16(float *out, const float *inp, const uint16_t *w, int M, int K, int N, int accumulate) {
    if (M <= 0 || N <= 0) return;
    float *x = widened_copy(w, (size_t)N * (K > 0 ? K : 0));
    op_matmul_fwd(out, inp, x, M, K, N, accumulate);
    free(x);
}

/* dout[M, N] with rows ldd apart, as a contiguous copy (malloc'd) when ldd != N,
 * else dout itself: the reference keeps the contiguous products above. */
static const float *packed_rows(const float *dout, int M, int N, int ldd) {
    if (ldd == N) return dout;
    float *d = ct_malloc((size_t)M * N * sizeof(float));
    for (int i = 0; i < M; i++) memcpy(d + (size_t)i * N, dout + (size_t)i * ldd, (size_t)N * sizeof(float));
    return d;
}

/* The dinp product through `bwd` (op_matmul_bwd or op_matmul_bf16_bwd) on w
 * widened and dout made contiguous: both references' wbf16 entries. */
static void dinp_widened(void (*bwd)(float *, float *, const float *, const float *, const float *, int, int, int, int),
                         float *dinp, const float *dout, const uint16_t *w, int M, int K, int N, int ldd,
                         int accumulate) {
    if (M <= 0 || K <= 0) return;
    if (N <= 0) { /* an empty sum: nothing to widen */
        bwd(dinp, NULL, NULL, NULL, NULL, M, K, N, accumulate);
        return;
    }
    float *x = widened_copy(w, (size_t)N * K);
    const float *d = packed_rows(dout, M, N, ldd);
    bwd(dinp, NULL, d, NULL, x, M, K, N, accumulate);
    if (d != dout) free((void *)d);
    free(x);
}

void op_matmul_dinp_wbf16(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N, int ldd,
                          int accumulate) {
    dinp_widened(op_matmul_bwd, dinp, dout, w, M, K, N, ldd, accumulate);
}

void op_matmul_bf16_fwd_wbf16(float *out, const float *inp, const uint16_t *w, int M, int K, int N, int accumulate) {
    if (M <= 0 || N <= 0) return;
    float *x = widened_copy(w, (size_t)N * (K > 0 ? K : 0));
    op_matmul_bf16_fwd(out, inp, x, M, K, N, accumulate);
    free(x);
}

void op_matmul_bf16_dinp_wbf16(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N, int ldd,
                               int accumulate) {
    dinp_widened(op_matmul_bf16_bwd, dinp, dout, w, M, K, N, ldd, accumulate);
}
