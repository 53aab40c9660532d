/* kernels/ref/attention_bwd_elem.h: one (query row, key) element of the reference
 * attention backward, shared by the offset form (ops_ref.c) and the block form
 * (attention_blk.c) so the two references cannot drift apart: both must round alike
 * (kernels check and the CP tests compare them with each other's results). */
#ifndef CT_KERNELS_REF_ATTENTION_BWD_ELEM_H
#define CT_KERNELS_REF_ATTENTION_BWD_ELEM_H

#include <math.h>

#include "core/dtype.h"

/* For query row qt (its dout row gt, dq row dqt, lse L and D = dout . out) and key kt
 * (value vt; dk, dv rows dkt, dvt), each of hd floats: p = exp(s - L) recomputed from
 * the scaled (and, cap > 0, soft-capped) score, dv += p dout, dq += ds k and dk += ds q
 * with ds = p (dout . v - D) scale (times 1 - tanh^2 under the cap); b16 rounds p and
 * ds to bf16 before the products (kern_attn_opt.bf16). Sums run over i in order. */
static inline void op_attention_bwd_elem(float *dqt, float *dkt, float *dvt, const float *qt, const float *kt,
                                         const float *vt, const float *gt, float L, float D, int hd, float scale,
                                         float cap, int b16) {
    float dot = 0.0f;
    for (int i = 0; i < hd; i++) dot += qt[i] * kt[i];
    float th = 0.0f, p;
    if (cap > 0.0f) {
        th = tanhf(dot * scale / cap);
        p = expf(cap * th - L);
    } else {
        p = expf(dot * scale - L);
    }
    float dp = 0.0f, pw = b16 ? ct_bf16_to_f32(ct_f32_to_bf16(p)) : p;
    for (int i = 0; i < hd; i++) {
        dp += gt[i] * vt[i];
        dvt[i] += pw * gt[i];
    }
    float gs = cap > 0.0f ? p * (dp - D) * (1.0f - th * th) * scale : p * (dp - D) * scale;
    if (b16) gs = ct_bf16_to_f32(ct_f32_to_bf16(gs));
    for (int i = 0; i < hd; i++) {
        dqt[i] += gs * kt[i];
        dkt[i] += gs * qt[i];
    }
}

#endif
