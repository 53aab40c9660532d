/* distributed/ep.c: expert parallel dispatch (ep.h).
 *
 * Rows travel in the sender's expert order (the routing's perm), so the rows
 * for rank p are one contiguous run, already sorted by expert, and come back
 * in the same places. The receiver runs the experts kernel once per source
 * rank, on that rank's block as it arrived (one choice per row, identity
 * perm, the row's routing weight sent along, so w y and d topw are the
 * kernel's own numbers), in source-rank order. So each expert's weight
 * gradient from one source is the very sum that rank's own kernel computes
 * without EP (same rows, same order, same GEMM), and the partial sums of the
 * ranks meet in the gradient as they do in a reduce-scatter of 2; a single
 * kernel call over all sources would sum other ranks' rows into the same
 * GEMM accumulator and round differently. The token's rank adds its k
 * weighted rows in choice order, as the grouped kernel (moe_cpu.c) does:
 * another order made every activation after the first MoE layer differ from
 * one process in the last bit (measured: 5.2e-5 on the final embedding).
 *
 * Activation checkpointing (model/lm.h LM_AC_*): the layers under
 * LM_AC_FULL share one set of dispatch buffers, refilled by the forward
 * that the model reruns before the layer's backward (the rerun passes out =
 * NULL: no down projection, nothing sent back); under LM_AC_OP a layer
 * keeps its received rows and gate/up and h is rebuilt from them before the
 * backward, as the model does with its own h. Buffers are sized for the worst
 * case (every rank sends all its rows here): ep x the local rows.
 *
 * Pipeline stages (distributed/pp.h) keep several micro-batches in flight,
 * each in its own bank of activations (lm_bank): a layer's dispatch state
 * belongs to the micro-batch as much as its saved activations do, so the
 * non-rerun layers keep one set per bank, made the first time a bank is
 * seen (the model's act.bank; NULL outside a pipeline). With one set per
 * layer, 1F1B's second forward overwrote the first's received rows before
 * its backward (measured: the loss of step 2 off by 1.5e-5 of one process's,
 * growing after). The LM_AC_FULL set stays shared: the rerun refills it
 * right before each backward. */
#include "distributed/ep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"
#include "metrics/profile.h"

struct ep_layer {
    size_t *scnt, *sdsp, *rcnt, *rdsp; /* [ep] rows sent to / received from each rank */
    int32_t *off;                      /* [ep, El+1] each source's rows per local expert, as offsets in its block */
    int R;                             /* rows received */
    int held;                          /* the layer whose rows these are (shared under LM_AC_FULL) */
    float *xr;                         /* [Rmax, H] received inputs */
    float *gate, *up, *h;              /* [Rmax, Im] the experts' activations */
    float *wr;                         /* [Rmax] routing weight of each received row */
};

struct ep_scratch {
    float *xs, *yr, *ys, *dxs, *dtopw1, *ws; /* [S or Rmax, H or 1] */
    int64_t *sc, *rc;                        /* [ep, El] rows per expert sent / received */
    int32_t *iota;                           /* [Rmax] 0, 1, ...: a source block's perm and pos */
    size_t *a, *b, *c, *d;                   /* [ep] counts and displacements in elements */
};

/* rows -> elements for a transfer in the direction (scnt -> rcnt) or back */
static void ep_move(ep_layout *p, ep_scratch *s, float *out, const float *in, const ep_layer *L, int back,
                    size_t per) {
    int P = p->c->size;
    for (int i = 0; i < P; i++) {
        s->a[i] = (back ? L->scnt[i] : L->rcnt[i]) * per;
        s->b[i] = (back ? L->sdsp[i] : L->rdsp[i]) * per;
        s->c[i] = (back ? L->rcnt[i] : L->scnt[i]) * per;
        s->d[i] = (back ? L->rdsp[i] : L->sdsp[i]) * per;
    }
    comm_all_to_allv(p->c, out, s->a, s->b, in, s->c, s->d, COMM_F32);
}

/* One layer's buffers for R rows: the received inputs and weights, the
 * experts' gate and up, and h unless given (a shared one). */
static void layer_alloc(ep_layer *y, int P, int El, size_t R, int H, int Im, float *h) {
    y->scnt = ct_calloc(4 * (size_t)P, sizeof(size_t));
    y->sdsp = y->scnt + P, y->rcnt = y->sdsp + P, y->rdsp = y->rcnt + P;
    y->off = ct_calloc((size_t)P * (El + 1), sizeof(int32_t));
    y->xr = ct_calloc(R * H + 1, sizeof(float));
    y->gate = ct_calloc((h ? 2 : 3) * R * Im + 1, sizeof(float));
    y->up = y->gate + R * Im;
    y->h = h ? h : y->up + R * Im;
    y->wr = ct_calloc(R + 1, sizeof(float));
    y->held = -1;
}

static void layer_release(ep_layer *y) {
    free(y->scnt);
    free(y->off);
    free(y->xr);
    free(y->gate);
    free(y->wr);
}

/* Layer l's dispatch state for the micro-batch in flight: the shared
 * LM_AC_FULL set, or the set of the bank in use, made on first sight. A
 * pipeline keeps its banks for the whole run (pp.c's pool holds its peak + 1),
 * so the table stops growing after the first step; a bank freed and another
 * made at its address would take over its set, which every forward refills. */
static ep_layer *layer_state(ep_layout *p, int l) {
    const lm_config *c = &p->m->cfg;
    int L = c->n_layers;
    if (p->m->act.layer[l].ac == LM_AC_FULL) return p->full;
    const void *key = p->m->act.bank;
    int b = 0;
    while (b < p->n_banks && p->bank_key[b] != key) b++;
    if (b == p->n_banks) { /* a bank not seen before: one more entry (a pipeline's pool is small and lasts) */
        const void **keys = ct_calloc((size_t)b + 1, sizeof *keys);
        ep_layer **sets = ct_calloc((size_t)b + 1, sizeof *sets);
        if (b) {
            memcpy(keys, p->bank_key, (size_t)b * sizeof *keys);
            memcpy(sets, p->bank_sets, (size_t)b * sizeof *sets);
        }
        free(p->bank_key);
        free(p->bank_sets);
        p->bank_key = keys;
        p->bank_sets = sets;
        p->bank_key[b] = key;
        p->bank_sets[b] = ct_calloc((size_t)L, sizeof(ep_layer));
        p->n_banks++;
    }
    ep_layer *y = &p->bank_sets[b][l];
    if (!y->scnt)
        layer_alloc(y, p->c->size, p->El, p->Rmax, c->hidden, c->moe_intermediate,
                    p->m->act.layer[l].ac == LM_AC_OP ? p->h_op : NULL);
    return y;
}

/* ew's projections from this rank's experts on (o floats in; bf16 ones: o words in) */
static void ep_weights(const lm_experts_w *ew, size_t o, const float *w[3], const uint16_t *h[3]) {
    for (int j = 0; j < 3; j++) {
        w[j] = ew->w[j] + o;
        h[j] = ew->h[j] ? ew->h[j] + o : NULL;
    }
}

static void ep_fwd(void *ctx, int l, float *out, const float *x, const moe_route *r, const lm_experts_w *ew,
                   int N) {
    ep_layout *p = ctx;
    ep_scratch s = *p->s;
    ep_layer *L = layer_state(p, l);
    const lm_config *c = &p->m->cfg;
    int H = c->hidden, Im = c->moe_intermediate, k = c->top_k, El = p->El, P = p->c->size, me = p->c->rank;
    long S = (long)N * k;
    for (long row = 0; row < S; row++) {
        int32_t slot = r->perm[row];
        memcpy(s.xs + (size_t)row * H, x + (size_t)(slot / k) * H, (size_t)H * sizeof(float));
        s.ws[row] = r->topw[slot];
    }
    for (int e = 0; e < P * El; e++) s.sc[e] = r->offsets[e + 1] - r->offsets[e];
    comm_all_to_all(p->c, s.rc, s.sc, (size_t)El, COMM_I64);
    size_t R = 0;
    for (int q = 0; q < P; q++) {
        L->sdsp[q] = (size_t)r->offsets[q * El];
        L->scnt[q] = (size_t)(r->offsets[(q + 1) * El] - r->offsets[q * El]);
        int32_t *off = L->off + (size_t)q * (El + 1);
        off[0] = 0;
        for (int e = 0; e < El; e++) off[e + 1] = off[e] + (int32_t)s.rc[q * El + e];
        L->rcnt[q] = (size_t)off[El];
        L->rdsp[q] = R;
        R += L->rcnt[q];
    }
    L->R = (int)R;
    L->held = l;
    ep_move(p, &s, L->xr, s.xs, L, 0, (size_t)H);
    ep_move(p, &s, L->wr, s.ws, L, 0, 1);
    /* this rank's experts in the stacked tensors (which start at expert0 when they hold only some) */
    const float *w[3];
    const uint16_t *hw[3];
    ep_weights(ew, (size_t)(me * El - c->expert0) * Im * H, w, hw);
    int bf = hw[0] || hw[1] || hw[2]; /* a frozen base read from its bf16 store, as the model does */
    if (out) memset(s.yr, 0, R * H * sizeof(float));
    for (int q = 0; q < P; q++) {
        size_t n = L->rcnt[q], o = L->rdsp[q];
        if (!n) continue;
        int64_t t0 = PROF_T0(p->m->prof); /* the experts kernel on the rows from rank q: an op span */
        float *yo = out ? s.yr + o * H : NULL;
        const int32_t *off = L->off + (size_t)q * (El + 1);
        if (bf)
            p->m->k.moe_fwd_wbf16(yo, L->gate + o * Im, L->up + o * Im, L->h + o * Im, p->work, L->xr + o * H, w[0],
                                  w[1], w[2], hw[0], hw[1], hw[2], s.iota, s.iota, off, L->wr + o, (int)n, H, Im, El,
                                  1);
        else
            p->m->k.moe_fwd(yo, L->gate + o * Im, L->up + o * Im, L->h + o * Im, p->work, L->xr + o * H, w[0], w[1],
                            w[2], s.iota, s.iota, off, L->wr + o, (int)n, H, Im, El, 1);
        if (p->m->prof) prof_kern(p->m->prof, KERN_OP_MOE, bf ? "moe_fwd_wbf16" : "moe_fwd", t0);
    }
    if (!out) return; /* recomputation before the backward: the owner's activations are all it needs */
    ep_move(p, &s, s.ys, s.yr, L, 1, (size_t)H);
    /* each token's k rows (w y came back already weighted) in choice order */
    for (int t = 0; t < N; t++) {
        float *o = out + (size_t)t * H;
        for (int j = 0; j < k; j++) {
            const float *y = s.ys + (size_t)r->pos[(long)t * k + j] * H;
            for (int i = 0; i < H; i++) o[i] += y[i];
        }
    }
}

static void ep_bwd(void *ctx, int l, float *dx, float *const dw[3], float *dtopw, const float *dout,
                   const moe_route *r, const lm_experts_w *ew, int N) {
    ep_layout *p = ctx;
    ep_scratch s = *p->s;
    ep_layer *L = layer_state(p, l);
    const lm_config *c = &p->m->cfg;
    int H = c->hidden, Im = c->moe_intermediate, k = c->top_k, El = p->El, P = p->c->size, me = p->c->rank;
    if (L->held != l) {
        /* a checkpointed layer's backward without its rerun forward: a bug, not an input */
        fprintf(stderr, "ctitan: error: expert parallel: layer %d's backward found layer %d's dispatch\n", l,
                L->held);
        exit(1);
    }
    long S = (long)N * k;
    size_t R = (size_t)L->R;
    if (p->m->act.layer[l].ac == LM_AC_OP) /* h was not kept: silu(gate) up, as the kernels compute it */
        op_swiglu_fwd(L->h, L->gate, L->up, (int)(R * Im));
    for (long row = 0; row < S; row++) /* each row's token's d output; the owner weights it */
        memcpy(s.xs + (size_t)row * H, dout + (size_t)(r->perm[row] / k) * H, (size_t)H * sizeof(float));
    float *dxr = s.yr;
    ep_move(p, &s, s.dxs, s.xs, L, 0, (size_t)H); /* dxs: [R, H] d outputs received */
    memset(dxr, 0, R * H * sizeof(float));
    size_t eo = (size_t)(me * El - c->expert0) * Im * H;
    const float *w[3];
    const uint16_t *hw[3];
    ep_weights(ew, eo, w, hw);
    int bf = hw[0] || hw[1] || hw[2];
    float *dwl[3]; /* NULL stays NULL: a frozen projection's gradient is not wanted */
    for (int j = 0; j < 3; j++) dwl[j] = dw[j] ? dw[j] + eo : NULL;
    for (int q = 0; q < P; q++) { /* in source order: see the top of the file */
        size_t n = L->rcnt[q], o = L->rdsp[q];
        if (!n) continue;
        int64_t t0 = PROF_T0(p->m->prof);
        const int32_t *off = L->off + (size_t)q * (El + 1);
        if (bf)
            p->m->k.moe_bwd_wbf16(dxr + o * H, dwl[0], dwl[1], dwl[2], s.dtopw1 + o, p->work, s.dxs + o * H,
                                  L->xr + o * H, w[0], w[1], w[2], hw[0], hw[1], hw[2], L->gate + o * Im,
                                  L->up + o * Im, L->h + o * Im, s.iota, s.iota, off, L->wr + o, (int)n, H, Im, El, 1);
        else
            p->m->k.moe_bwd(dxr + o * H, dwl[0], dwl[1], dwl[2], s.dtopw1 + o, p->work, s.dxs + o * H, L->xr + o * H,
                            w[0], w[1], w[2], L->gate + o * Im, L->up + o * Im, L->h + o * Im, s.iota, s.iota, off,
                            L->wr + o, (int)n, H, Im, El, 1);
        if (p->m->prof) prof_kern(p->m->prof, KERN_OP_MOE, bf ? "moe_bwd_wbf16" : "moe_bwd", t0);
    }
    ep_move(p, &s, s.xs, dxr, L, 1, (size_t)H); /* d inputs back, in this rank's expert order */
    ep_move(p, &s, s.ws, s.dtopw1, L, 1, 1);
    for (long row = 0; row < S; row++) dtopw[r->perm[row]] = s.ws[row];
    /* each token's k rows in choice order, as the grouped kernel adds them */
    for (int t = 0; t < N; t++) {
        float *o = dx + (size_t)t * H;
        for (int j = 0; j < k; j++) {
            const float *d = s.xs + (size_t)r->pos[(long)t * k + j] * H;
            for (int i = 0; i < H; i++) o[i] += d[i];
        }
    }
}

int ep_init(ep_layout *p, lm_model *m, ct_comm *c, ct_err *e) {
    (void)e;
    memset(p, 0, sizeof *p);
    const lm_config *cf = &m->cfg;
    int P = c->size, L = cf->n_layers, H = cf->hidden, Im = cf->moe_intermediate;
    p->m = m;
    p->c = c;
    p->El = cf->n_experts / P;
    p->Nmax = m->act.B * m->act.T;
    size_t S = (size_t)p->Nmax * cf->top_k, R = S * P;
    p->Rmax = R;
    int any_op = 0, any_full = 0;
    for (int l = 0; l < L; l++) {
        /* the policy, not act.layer[l].ac: a pipeline stage's layers get theirs from its banks */
        any_op |= lm_layer_is_moe(cf, l) && m->act.pol[l] == LM_AC_OP;
        any_full |= lm_layer_is_moe(cf, l) && m->act.pol[l] == LM_AC_FULL;
    }
    if (any_op) p->h_op = ct_calloc(R * Im + 1, sizeof(float));
    /* LM_AC_FULL: all rerun before their backward, so one set serves them in turn */
    if (any_full) layer_alloc(p->full = ct_calloc(1, sizeof(ep_layer)), P, p->El, R, H, Im, NULL);
    ep_scratch *s = p->s = ct_calloc(1, sizeof(ep_scratch));
    s->xs = ct_calloc(S * H + 1, sizeof(float));
    s->yr = ct_calloc(R * H + 1, sizeof(float));
    s->ys = ct_calloc(S * H + 1, sizeof(float));
    s->dxs = ct_calloc(R * H + 1, sizeof(float));
    s->dtopw1 = ct_calloc(R + 1, sizeof(float));
    s->ws = ct_calloc(S + 1, sizeof(float));
    s->sc = ct_calloc(2 * (size_t)P * p->El, sizeof(int64_t));
    s->rc = s->sc + (size_t)P * p->El;
    s->iota = ct_calloc(R + 1, sizeof(int32_t));
    for (size_t i = 0; i < R; i++) s->iota[i] = (int32_t)i;
    s->a = ct_calloc(4 * (size_t)P, sizeof(size_t));
    s->b = s->a + P, s->c = s->b + P, s->d = s->c + P;
    p->work = ct_calloc(KERN_MOE_WORK(R, H, Im), sizeof(float));
    p->d = (lm_moe_dispatch){p, ep_fwd, ep_bwd};
    m->moe_ep = &p->d;
    return 0;
}

void ep_free(ep_layout *p) {
    if (!p->s) return;
    if (p->m && p->m->moe_ep == &p->d) p->m->moe_ep = NULL;
    int L = p->m->cfg.n_layers;
    for (int b = 0; b < p->n_banks; b++) {
        for (int l = 0; l < L; l++)
            if (p->bank_sets[b][l].scnt) layer_release(&p->bank_sets[b][l]);
        free(p->bank_sets[b]);
    }
    if (p->full) layer_release(p->full);
    free(p->full);
    free(p->h_op);
    ep_scratch *s = p->s;
    free(s->xs);
    free(s->yr);
    free(s->ys);
    free(s->dxs);
    free(s->dtopw1);
    free(s->ws);
    free(s->sc);
    free(s->iota);
    free(s->a);
    free(s);
    free(p->work);
    free(p->bank_key);
    free(p->bank_sets);
    memset(p, 0, sizeof *p);
}
