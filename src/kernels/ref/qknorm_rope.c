/* kernels/ref/qknorm_rope.c: the reference of the fused q/k-norm + RoPE op.
 *
 * Design: literally the composition the model ran before the fusion, the
 * per-head op_rmsnorm_fwd into out and then op_rope_fwd in place; the
 * backward rotates dout back (op_rope_bwd) into a scratch tensor and runs
 * op_rmsnorm_bwd from it. So "rope=ref" gives exactly the unfused model,
 * and the fused AVX-512 kernel (kernels/cpu/elementwise_avx512.c) is checked
 * against it by `ctitan kernels check`. */
#include <stdlib.h>
#include <string.h>

#include "core/err.h"
#include "kernels/ops.h"

void op_qknorm_rope_fwd(float *out, float *rstd, const float *x, const float *w, const float *cos, const float *sin,
                        int B, int T, int nh, int hd, float eps) {
    // out[B,T,nh,hd], rstd[B*T*nh], x[B,T,nh,hd], w[hd], cos/sin [T,hd/2]
    op_rmsnorm_fwd(out, rstd, x, w, B * T * nh, hd, eps);
    op_rope_fwd(out, out, cos, sin, B, T, nh, hd, hd);
}

void op_qknorm_rope_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                        const float *cos, const float *sin, int B, int T, int nh, int hd, int acc) {
    // dx[B,T,nh,hd] (+)=, dw[hd] +=, dout[B,T,nh,hd], x[B,T,nh,hd], w[hd], rstd[B*T*nh], cos/sin [T,hd/2]
    size_t n = (size_t)B * T * nh * hd;
    float *g = ct_calloc(n ? n : 1, sizeof(float)); // [B,T,nh,hd] gradient w.r.t. the norm's output
    op_rope_bwd(g, dout, cos, sin, B, T, nh, hd, hd);
    if (!acc) memset(dx, 0, n * sizeof(float)); /* rmsnorm_bwd adds */
    op_rmsnorm_bwd(dx, dw, g, x, w, rstd, B * T * nh, hd);
    free(g);
}

void op_qknorm_rope_bwd_w(float *dw, const float *dout, const float *x, const float *rstd, const float *cos,
                          const float *sin, int B, int T, int nh, int hd) {
    // dw[hd] +=, dout[B,T,nh,hd] (w.r.t. the rotated output), x[B,T,nh,hd], rstd[B*T*nh], cos/sin [T,hd/2]
    size_t n = (size_t)B * T * nh * hd;
    float *g = ct_calloc(n ? n : 1, sizeof(float)); // [B,T,nh,hd] R^T dout, as op_qknorm_rope_bwd's
    op_rope_bwd(g, dout, cos, sin, B, T, nh, hd, hd);
    op_rmsnorm_bwd_w(dw, g, x, rstd, B * T * nh, hd);
    free(g);
}
