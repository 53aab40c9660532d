/* distributed/cp.c: context parallel's attention over the whole sequence from
 * a chunk of it (cp.h: the padded-prefix problem), and the chunking of the
 * step's windows. */
#include "distributed/cp.h"

#include <stdlib.h>
#include <string.h>

#include "core/timer.h"
#include "metrics/profile.h"
#include "model/moe.h"

/* k and v of chunks 0 .. rank of every sequence, from the group, into the
 * padded problem's [B, T', kvd] (T' = (rank + 1) Tl). */
static void cp_gather_kv(cp_layout *cp, const float *k, const float *v, int B, int Tl, int kvd) {
    size_t n = (size_t)B * Tl * kvd, row = (size_t)Tl * kvd;
    int Tp = (cp->rank + 1) * Tl;
    double t0 = ct_now();
    comm_all_gather(cp->c, cp->kg, k, n, COMM_F32);
    comm_all_gather(cp->c, cp->vg, v, n, COMM_F32);
    cp->comm_s += ct_now() - t0;
    for (int b = 0; b < B; b++)
        for (int j = 0; j <= cp->rank; j++) { /* chunk j of sequence b came from rank j */
            size_t dst = ((size_t)b * Tp + (size_t)j * Tl) * kvd, src = (size_t)j * n + (size_t)b * row;
            memcpy(cp->kp + dst, cp->kg + src, row * sizeof(float));
            memcpy(cp->vp + dst, cp->vg + src, row * sizeof(float));
        }
}

/* dst [B, T', w] = zero rows for the other chunks' positions, then src [B, Tl, w]. */
static void cp_pad(float *dst, const float *src, int B, int Tl, int Tp, int w) {
    size_t pre = (size_t)(Tp - Tl) * w, own = (size_t)Tl * w;
    for (int b = 0; b < B; b++) {
        float *d = dst + (size_t)b * Tp * w;
        memset(d, 0, pre * sizeof(float));
        memcpy(d + pre, src + (size_t)b * own, own * sizeof(float));
    }
}

/* dst [B, Tl, w] = the own rows (the last Tl) of src [B, T', w]. */
static void cp_own(float *dst, const float *src, int B, int Tl, int Tp, int w) {
    size_t pre = (size_t)(Tp - Tl) * w, own = (size_t)Tl * w;
    for (int b = 0; b < B; b++) memcpy(dst + (size_t)b * own, src + (size_t)b * Tp * w + pre, own * sizeof(float));
}

static void cp_fwd(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                   int nh, int nkv, int hd, const kern_attn_opt *o) {
    cp_layout *cp = ctx;
    lm_model *m = cp->m;
    int Tp = (cp->rank + 1) * T, qd = nh * hd, kvd = nkv * hd;
    cp_gather_kv(cp, k, v, B, T, kvd);
    cp_pad(cp->qp, q, B, T, Tp, qd);
    int64_t t0 = PROF_T0(m->prof);
    m->k.attention_fwd(cp->op, cp->lp, cp->qp, cp->kp, cp->vp, B, Tp, nh, nkv, hd, o);
    if (m->prof) prof_kern(m->prof, KERN_OP_ATTENTION, "attention_fwd", t0);
    cp_own(out, cp->op, B, T, Tp, qd);
    cp_own(lse, cp->lp, B * nh, T, Tp, 1); /* lse is [B, nh, T']: one row per (sequence, head) */
}

/* The dummy rows have q = 0, d(out) = 0 and out = 0, lse = 0: the softmax
 * backward's D and dP are 0 there, so dS = P (dP - D) = 0 and they add
 * nothing to dk, dv (P = exp(0) = 1 stays finite). */
static void cp_bwd(void *ctx, float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                   const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                   const kern_attn_opt *o) {
    cp_layout *cp = ctx;
    lm_model *m = cp->m;
    int Tp = (cp->rank + 1) * T, qd = nh * hd, kvd = nkv * hd;
    cp_gather_kv(cp, k, v, B, T, kvd);
    cp_pad(cp->qp, q, B, T, Tp, qd);
    cp_pad(cp->op, out, B, T, Tp, qd);
    cp_pad(cp->dop, dout, B, T, Tp, qd);
    cp_pad(cp->lp, lse, B * nh, T, Tp, 1);
    int64_t t0 = PROF_T0(m->prof);
    m->k.attention_bwd(cp->dqp, cp->dkp, cp->dvp, cp->dop, cp->op, cp->lp, cp->qp, cp->kp, cp->vp, B, Tp, nh, nkv,
                       hd, o, 0);
    if (m->prof) prof_kern(m->prof, KERN_OP_ATTENTION, "attention_bwd", t0);
    cp_own(dq, cp->dqp, B, T, Tp, qd);
    /* d k, d v of chunk j to rank j: block j of the send buffers (chunks past this rank's: zero) */
    size_t n = (size_t)B * T * kvd, row = (size_t)T * kvd;
    memset(cp->kg + (size_t)(cp->rank + 1) * n, 0, (size_t)(cp->n - cp->rank - 1) * n * sizeof(float));
    memset(cp->vg + (size_t)(cp->rank + 1) * n, 0, (size_t)(cp->n - cp->rank - 1) * n * sizeof(float));
    for (int b = 0; b < B; b++)
        for (int j = 0; j <= cp->rank; j++) {
            size_t src = ((size_t)b * Tp + (size_t)j * T) * kvd, dst = (size_t)j * n + (size_t)b * row;
            memcpy(cp->kg + dst, cp->dkp + src, row * sizeof(float));
            memcpy(cp->vg + dst, cp->dvp + src, row * sizeof(float));
        }
    double t1 = ct_now();
    comm_reduce_scatter(cp->c, dk, cp->kg, n, COMM_F32);
    comm_reduce_scatter(cp->c, dv, cp->vg, n, COMM_F32);
    cp->comm_s += ct_now() - t1;
}

void cp_init(cp_layout *cp, lm_model *m, ct_comm *c, int B, int T, int n_seq) {
    memset(cp, 0, sizeof *cp);
    cp->m = m;
    cp->c = c;
    cp->n = c->size;
    cp->rank = c->rank;
    cp->B = B;
    cp->T = T;
    cp->Tl = T / cp->n;
    const lm_config *mc = &m->cfg;
    size_t q = (size_t)B * T * mc->n_heads * mc->head_dim, kv = (size_t)B * T * mc->n_kv_heads * mc->head_dim;
    cp->kg = ct_malloc(kv * sizeof(float));
    cp->vg = ct_malloc(kv * sizeof(float));
    cp->kp = ct_malloc(kv * sizeof(float));
    cp->vp = ct_malloc(kv * sizeof(float));
    cp->dkp = ct_malloc(kv * sizeof(float));
    cp->dvp = ct_malloc(kv * sizeof(float));
    cp->qp = ct_malloc(q * sizeof(float));
    cp->op = ct_malloc(q * sizeof(float));
    cp->dqp = ct_malloc(q * sizeof(float));
    cp->dop = ct_malloc(q * sizeof(float));
    cp->lp = ct_malloc((size_t)B * mc->n_heads * T * sizeof(float));
    if (n_seq < B) n_seq = B;
    cp->tok = ct_malloc((size_t)n_seq * cp->Tl * sizeof(int32_t));
    cp->lab = ct_malloc((size_t)n_seq * cp->Tl * sizeof(int32_t));
    /* RoPE of the chunk's global positions, for a forward over the whole
     * sequence (dynamic RoPE depends on its length); rope_T = Tl keeps the
     * model from rebuilding them for positions 0 .. Tl-1 */
    int p0 = cp->rank * cp->Tl;
    lm_rope_tables(mc, 0, T, p0, cp->Tl, m->ws.rope_cos, m->ws.rope_sin);
    if (m->ws.rope_cos_l != m->ws.rope_cos) lm_rope_tables(mc, 1, T, p0, cp->Tl, m->ws.rope_cos_l, m->ws.rope_sin_l);
    m->ws.rope_T = cp->Tl;
    m->cp_T = T, m->cp_Tl = cp->Tl, m->cp_p0 = p0;
    cp->d = (lm_attn_dispatch){cp, cp_fwd, cp_bwd};
    m->attn_cp = &cp->d;
}

void cp_free(cp_layout *cp) {
    if (cp->m && cp->m->attn_cp == &cp->d) cp->m->attn_cp = NULL, cp->m->cp_T = 0;
    float *f[] = {cp->kg, cp->vg, cp->kp, cp->vp, cp->dkp, cp->dvp, cp->qp, cp->op, cp->dqp, cp->dop, cp->lp};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) free(f[i]);
    free(cp->tok);
    free(cp->lab);
    memset(cp, 0, sizeof *cp);
}

void cp_chunk(cp_layout *cp, const int32_t *tokens, const int32_t *labels, int B) {
    size_t Tl = (size_t)cp->Tl, off = (size_t)cp->rank * Tl;
    for (int b = 0; b < B; b++) {
        memcpy(cp->tok + b * Tl, tokens + (size_t)b * cp->T + off, Tl * sizeof(int32_t));
        memcpy(cp->lab + b * Tl, labels + (size_t)b * cp->T + off, Tl * sizeof(int32_t));
    }
}

void cp_moe_aux(cp_layout *cp, int B) {
    lm_model *m = cp->m;
    if (!m->moe.n_layers) return;
    int E = m->cfg.n_experts;
    double t0 = ct_now();
    comm_allreduce(cp->c, m->moe.count, (size_t)E, COMM_F64, COMM_SUM);
    comm_allreduce(cp->c, m->moe.psum, (size_t)E, COMM_F64, COMM_SUM);
    cp->comm_s += ct_now() - t0;
    m->moe.aux_loss = moe_aux_loss(NULL, m->moe.count, m->moe.psum, B * cp->T, m->moe.n_layers, E, 0.0);
}

double cp_take_comm_time(cp_layout *cp) {
    double s = cp->comm_s;
    cp->comm_s = 0;
    return s;
}
