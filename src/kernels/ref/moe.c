/* kernels/ref/moe.c: the reference experts of a MoE layer (op_moe_experts_*).
 *
 * The plain definition the grouped kernels are checked against: a loop over
 * experts, and inside it over the rows of that expert (the routing metadata
 * already lists them), each row a set of dot products. Nothing is gathered
 * or packed, so it is slow and obviously right. The output is accumulated
 * expert by expert, as transformers' Qwen3MoeExperts does (index_add_ in
 * ascending expert order). The work buffer holds one row's temporaries.
 *
 * The bf16 reference (op_moe_experts_bf16_*) is the same loops with every
 * factor of an expert projection's products rounded to bf16 (rb() below,
 * bf = 1): the semantics of matmul_bf16 applied to the three projections,
 * forward, d input and d weight, with fp32 sums. The routing weight, the
 * SwiGLU and d topw stay fp32, as they do around every other linear.
 *
 * The wbf16 entries (a weight read from a bf16 store) are the same loops
 * over each expert's matrices widened, one expert at a time, into a scratch
 * of one expert per projection: exact, so the definition (the op on the
 * widened weights) holds by construction, with no copy of a whole weight. */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/ops.h"

/* One projection's stacked weights [E, n]: fp32 f, or bf16 h when set. */
typedef struct {
    const float *f;
    const uint16_t *h;
} wsrc;

/* Expert e's n weights as fp32: in place, or widened into scratch[n]. */
static const float *expert_w(wsrc w, int e, size_t n, float *scratch) {
    if (!w.h) return w.f + (size_t)e * n;
    const uint16_t *src = w.h + (size_t)e * n;
    for (size_t i = 0; i < n; i++) scratch[i] = ct_bf16_to_f32(src[i]);
    return scratch;
}

/* Scratch for one expert of each projection read from bf16 (NULL: none is). */
static float *expert_scratch(wsrc g, wsrc u, wsrc d, size_t n) {
    return g.h || u.h || d.h ? ct_malloc(3 * (n ? n : 1) * sizeof(float)) : NULL;
}

/* v, or v rounded to bf16 (nearest even) when bf. */
static float rb(float v, int bf) { return bf ? ct_bf16_to_f32(ct_f32_to_bf16(v)) : v; }

static float dot(const float *a, const float *b, int n, int bf) {
    float s = 0;
    for (int i = 0; i < n; i++) s += rb(a[i], bf) * rb(b[i], bf);
    return s;
}

static void experts_fwd(float *out, float *gate, float *up, float *h, float *work, const float *x, wsrc wg, wsrc wu,
                        wsrc wd, const int32_t *perm, const int32_t *pos, const int32_t *offsets, const float *topw,
                        int N, int H, int I, int E, int k, int bf) {
    // out[N,H] (+=), gate/up/h [N*k, I], work [H], x[N,H], wg/wu [E,I,H], wd [E,H,I]
    (void)pos;
    (void)N;
    float *y = work; /* [H] one expert output row */
    size_t n = (size_t)I * H;
    float *sc = expert_scratch(wg, wu, wd, n);
    for (int e = 0; e < E; e++) {
        if (offsets[e + 1] == offsets[e]) continue; /* no rows: nothing reads its weights */
        const float *g_e = expert_w(wg, e, n, sc), *u_e = expert_w(wu, e, n, sc + n), *d_e = expert_w(wd, e, n, sc + 2 * n);
        for (int p = offsets[e]; p < offsets[e + 1]; p++) {
            int s = perm[p], t = s / k;
            const float *xt = x + (size_t)t * H;
            float *gp = gate + (size_t)p * I, *upp = up + (size_t)p * I, *hp = h + (size_t)p * I;
            for (int i = 0; i < I; i++) {
                gp[i] = dot(g_e + (size_t)i * H, xt, H, bf);
                upp[i] = dot(u_e + (size_t)i * H, xt, H, bf);
                hp[i] = gp[i] / (1.0f + expf(-gp[i])) * upp[i];
            }
            if (!out) continue;
            for (int c = 0; c < H; c++) y[c] = dot(d_e + (size_t)c * I, hp, I, bf);
            float w = topw[s];
            float *ot = out + (size_t)t * H;
            for (int c = 0; c < H; c++) ot[c] += w * y[c];
        }
    }
    free(sc);
}

/* The experts' weight gradients from d gate / d up [N*k, I] (experts_bwd's
 * work): experts_bwd calls it after its rows, a split backward's W
 * (op_moe_experts_bwd_w) on its own, so both give each element the same terms
 * in the same row order. */
static void experts_bwd_w(float *dwg, float *dwu, float *dwd, const float *dout, const float *x, const float *h,
                          const float *dga, const float *dua, const int32_t *perm, const int32_t *offsets,
                          const float *topw, int H, int I, int E, int k, int bf) {
    // dwg/dwu [E,I,H] +=, dwd [E,H,I] +=; dout, x [N,H]; h, dga, dua [N*k, I]
    for (int e = 0; e < E; e++) {
        float *dg_e = dwg ? dwg + (size_t)e * I * H : NULL, *du_e = dwu ? dwu + (size_t)e * I * H : NULL;
        float *dd_e = dwd ? dwd + (size_t)e * H * I : NULL;
        for (int p = offsets[e]; p < offsets[e + 1]; p++) {
            int s = perm[p], t = s / k;
            const float *xt = x + (size_t)t * H, *dot_ = dout + (size_t)t * H, *hp = h + (size_t)p * I;
            float w = topw[s];
            for (int c = 0; dd_e && c < H; c++) {
                float dy = rb(w * dot_[c], bf);
                for (int i = 0; i < I; i++) dd_e[(size_t)c * I + i] += dy * rb(hp[i], bf);
            }
            for (int i = 0; (dg_e || du_e) && i < I; i++) {
                float dgi = dg_e ? rb(dga[(size_t)p * I + i], bf) : 0, dui = du_e ? rb(dua[(size_t)p * I + i], bf) : 0;
                for (int c = 0; c < H; c++) {
                    float xc = rb(xt[c], bf);
                    if (dg_e) dg_e[(size_t)i * H + c] += dgi * xc;
                    if (du_e) du_e[(size_t)i * H + c] += dui * xc;
                }
            }
        }
    }
}

static void experts_bwd(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work, const float *dout,
                        const float *x, wsrc wg, wsrc wu, wsrc wd, const float *gate, const float *up, const float *h,
                        const int32_t *perm, const int32_t *pos, const int32_t *offsets, const float *topw, int N,
                        int H, int I, int E, int k, int bf) {
    // dx[N,H] +=, dwg/dwu [E,I,H] +=, dwd [E,H,I] +=, dtopw[N*k] =, work: d gate, d up [N*k, I]
    (void)pos;
    size_t n = (size_t)I * H, S = (size_t)N * k;
    float *dh = ct_malloc((size_t)(I ? I : 1) * sizeof(float)); /* [I] one row's wd_e^T dout */
    float *dga = KERN_MOE_DGATE(work, S, I), *dua = KERN_MOE_DUP(work, S, I); /* kept for op_moe_experts_bwd_w */
    float *sc = expert_scratch(wg, wu, wd, n);
    for (int e = 0; e < E; e++) {
        if (offsets[e + 1] == offsets[e]) continue; /* no rows: no gradient either */
        const float *g_e = expert_w(wg, e, n, sc), *u_e = expert_w(wu, e, n, sc + n), *d_e = expert_w(wd, e, n, sc + 2 * n);
        for (int p = offsets[e]; p < offsets[e + 1]; p++) {
            int s = perm[p], t = s / k;
            const float *dot_ = dout + (size_t)t * H;
            const float *gp = gate + (size_t)p * I, *upp = up + (size_t)p * I, *hp = h + (size_t)p * I;
            float *dg = dga + (size_t)p * I, *du = dua + (size_t)p * I;
            float w = topw[s];
            /* y = wd_e h; out += w y: dy = w dout, dw = dout . y = (wd_e^T dout) . h */
            for (int i = 0; i < I; i++) {
                float a = 0;
                for (int c = 0; c < H; c++) a += rb(dot_[c], bf) * rb(d_e[(size_t)c * I + i], bf);
                dh[i] = a;
            }
            dtopw[s] = dot(dh, hp, I, 0);
            for (int i = 0; i < I; i++) {
                float g = gp[i], sig = 1.0f / (1.0f + expf(-g)), d = w * dh[i];
                dg[i] = d * upp[i] * sig * (1.0f + g * (1.0f - sig));
                du[i] = d * g * sig;
            }
            float *dxt = dx + (size_t)t * H;
            for (int i = 0; i < I; i++) {
                float dgi = rb(dg[i], bf), dui = rb(du[i], bf);
                for (int c = 0; c < H; c++)
                    dxt[c] += dgi * rb(g_e[(size_t)i * H + c], bf) + dui * rb(u_e[(size_t)i * H + c], bf);
            }
        }
    }
    free(sc);
    free(dh);
    /* NULL weight gradients (frozen experts) are skipped there */
    experts_bwd_w(dwg, dwu, dwd, dout, x, h, dga, dua, perm, offsets, topw, H, I, E, k, bf);
}

void op_moe_experts_bwd_w(float *dwg, float *dwu, float *dwd, float *work, const float *dout, const float *x,
                          const float *h, const float *dgate, const float *dup, const int32_t *perm,
                          const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    (void)work;
    (void)N;
    experts_bwd_w(dwg, dwu, dwd, dout, x, h, dgate, dup, perm, offsets, topw, H, I, E, k, 0);
}
void op_moe_experts_bf16_bwd_w(float *dwg, float *dwu, float *dwd, float *work, const float *dout, const float *x,
                               const float *h, const float *dgate, const float *dup, const int32_t *perm,
                               const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    (void)work;
    (void)N;
    experts_bwd_w(dwg, dwu, dwd, dout, x, h, dgate, dup, perm, offsets, topw, H, I, E, k, 1);
}

#define W3H(g, u, d, a, b, c) (wsrc){g, a}, (wsrc){u, b}, (wsrc){d, c}
#define W3(g, u, d) W3H(g, u, d, NULL, NULL, NULL)

void op_moe_experts_fwd(float *out, float *gate, float *up, float *h, float *work, const float *x, const float *wg,
                        const float *wu, const float *wd, const int32_t *perm, const int32_t *pos,
                        const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    experts_fwd(out, gate, up, h, work, x, W3(wg, wu, wd), perm, pos, offsets, topw, N, H, I, E, k, 0);
}
void op_moe_experts_bwd(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work, const float *dout,
                        const float *x, const float *wg, const float *wu, const float *wd, const float *gate,
                        const float *up, const float *h, const int32_t *perm, const int32_t *pos,
                        const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    experts_bwd(dx, dwg, dwu, dwd, dtopw, work, dout, x, W3(wg, wu, wd), gate, up, h, perm, pos, offsets, topw, N, H, I,
                E, k, 0);
}
void op_moe_experts_bf16_fwd(float *out, float *gate, float *up, float *h, float *work, const float *x,
                             const float *wg, const float *wu, const float *wd, const int32_t *perm,
                             const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int I,
                             int E, int k) {
    experts_fwd(out, gate, up, h, work, x, W3(wg, wu, wd), perm, pos, offsets, topw, N, H, I, E, k, 1);
}
void op_moe_experts_bf16_bwd(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                             const float *dout, const float *x, const float *wg, const float *wu, const float *wd,
                             const float *gate, const float *up, const float *h, const int32_t *perm,
                             const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int I,
                             int E, int k) {
    experts_bwd(dx, dwg, dwu, dwd, dtopw, work, dout, x, W3(wg, wu, wd), gate, up, h, perm, pos, offsets, topw, N, H, I,
                E, k, 1);
}
void op_moe_experts_fwd_wbf16(float *out, float *gate, float *up, float *h, float *work, const float *x,
                              const float *wg, const float *wu, const float *wd, const uint16_t *hg,
                              const uint16_t *hu, const uint16_t *hd, const int32_t *perm, const int32_t *pos,
                              const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    experts_fwd(out, gate, up, h, work, x, W3H(wg, wu, wd, hg, hu, hd), perm, pos, offsets, topw, N, H, I, E, k, 0);
}
void op_moe_experts_bwd_wbf16(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                              const float *dout, const float *x, const float *wg, const float *wu, const float *wd,
                              const uint16_t *hg, const uint16_t *hu, const uint16_t *hd, const float *gate,
                              const float *up, const float *h, const int32_t *perm, const int32_t *pos,
                              const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    experts_bwd(dx, dwg, dwu, dwd, dtopw, work, dout, x, W3H(wg, wu, wd, hg, hu, hd), gate, up, h, perm, pos, offsets,
                topw, N, H, I, E, k, 0);
}
void op_moe_experts_bf16_fwd_wbf16(float *out, float *gate, float *up, float *h, float *work, const float *x,
                                   const float *wg, const float *wu, const float *wd, const uint16_t *hg,
                                   const uint16_t *hu, const uint16_t *hd, const int32_t *perm, const int32_t *pos,
                                   const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    experts_fwd(out, gate, up, h, work, x, W3H(wg, wu, wd, hg, hu, hd), perm, pos, offsets, topw, N, H, I, E, k, 1);
}
void op_moe_experts_bf16_bwd_wbf16(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                                   const float *dout, const float *x, const float *wg, const float *wu,
                                   const float *wd, const uint16_t *hg, const uint16_t *hu, const uint16_t *hd,
                                   const float *gate, const float *up, const float *h, const int32_t *perm,
                                   const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H,
                                   int I, int E, int k) {
    experts_bwd(dx, dwg, dwu, dwd, dtopw, work, dout, x, W3H(wg, wu, wd, hg, hu, hd), gate, up, h, perm, pos, offsets,
                topw, N, H, I, E, k, 1);
}
