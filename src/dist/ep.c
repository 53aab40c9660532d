/* dist/ep.c: expert parallel dispatch (ep.h). Rows travel in the sender's
 * expert order (the routing's perm), so the rows for rank p are one
 * contiguous run and come back in the same places; the receiver sorts what
 * it got by local expert (stable: source rank, then the sender's order) and
 * runs the experts kernel with one choice per row and the row's routing
 * weight sent along, so w y and d topw are the kernel's own numbers; the
 * token's rank adds the weighted rows in expert order, as the kernel does. Buffers are sized for the worst
 * case (every rank sends all its rows here): ep x the local rows. */
#include "dist/ep.h"

#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"

struct ep_layer {
    size_t *scnt, *sdsp, *rcnt, *rdsp; /* [ep] rows sent to / received from each rank */
    int R;                             /* rows received */
    float *xr;                         /* [Rmax, H] received inputs */
    float *gate, *up, *h;              /* [Rmax, Im] the experts' activations */
    float *wr;                         /* [Rmax] routing weight of each received row */
    float *ys;                         /* [S, H] weighted outputs of this rank's rows, in its expert order */
    int32_t *er, *perm, *pos, *off;    /* [Rmax] expert of each received row; its sort; [El+1] */
};

typedef struct {
    float *xs, *yr, *dxs, *dtopw1, *ws; /* scratch */
    int32_t *es;
    size_t *a, *b, *c, *d;                /* [ep] counts and displacements in elements */
} ep_scratch;

static ep_scratch sc_of(ep_layout *p) { return *(ep_scratch *)(void *)(p->layers + p->m->cfg.n_layers); }

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

static void ep_fwd(void *ctx, int l, float *out, const float *x, const moe_route *r, const qwen3_layer_w *w, int N) {
    ep_layout *p = ctx;
    ep_scratch s = sc_of(p);
    ep_layer *L = &p->layers[l];
    const qwen3_config *c = &p->m->cfg;
    int H = c->hidden, Im = c->moe_intermediate, k = c->top_k, El = p->El, P = p->c->size, me = p->c->rank;
    long S = (long)N * k;
    for (long row = 0; row < S; row++) {
        int32_t slot = r->perm[row];
        memcpy(s.xs + (size_t)row * H, x + (size_t)(slot / k) * H, (size_t)H * sizeof(float));
        s.es[row] = r->topi[slot];
        s.ws[row] = r->topw[slot];
    }
    int64_t sc64[P], rc64[P];
    for (int q = 0; q < P; q++) {
        L->sdsp[q] = (size_t)r->offsets[q * El];
        L->scnt[q] = (size_t)(r->offsets[(q + 1) * El] - r->offsets[q * El]);
        sc64[q] = (int64_t)L->scnt[q];
    }
    comm_all_to_all(p->c, rc64, sc64, 1, COMM_I64);
    size_t R = 0;
    for (int q = 0; q < P; q++) {
        L->rcnt[q] = (size_t)rc64[q];
        L->rdsp[q] = R;
        R += L->rcnt[q];
    }
    L->R = (int)R;
    ep_move(p, &s, L->xr, s.xs, L, 0, (size_t)H);
    ep_move(p, &s, L->wr, s.ws, L, 0, 1);
    for (int q = 0; q < P; q++) { /* the expert ids, as int32 */
        s.a[q] = L->rcnt[q], s.b[q] = L->rdsp[q], s.c[q] = L->scnt[q], s.d[q] = L->sdsp[q];
    }
    comm_all_to_allv(p->c, L->er, s.a, s.b, s.es, s.c, s.d, COMM_I32);
    /* stable counting sort of the received rows by local expert */
    memset(L->off, 0, ((size_t)El + 1) * sizeof(int32_t));
    for (size_t i = 0; i < R; i++) L->off[L->er[i] - me * El + 1]++;
    for (int e = 0; e < El; e++) L->off[e + 1] += L->off[e];
    for (size_t i = 0; i < R; i++) {
        int32_t at = L->off[L->er[i] - me * El]++;
        L->perm[at] = (int32_t)i;
        L->pos[i] = at;
    }
    for (int e = El - 1; e > 0; e--) L->off[e] = L->off[e - 1];
    L->off[0] = 0;
    size_t eo = (size_t)(me * El - c->expert0) * Im * H; /* its experts in the stacked tensors (0: stored alone) */
    memset(s.yr, 0, R * H * sizeof(float));
    if (R)
        p->m->k.moe_fwd(s.yr, L->gate, L->up, L->h, p->work, L->xr, w->ewg + eo, w->ewu + eo, w->ewd + eo, L->perm,
                        L->pos, L->off, L->wr, (int)R, H, Im, El, 1);
    ep_move(p, &s, L->ys, s.yr, L, 1, (size_t)H);
    if (!out) return;
    /* in expert order, as the experts kernel adds them (w y came back already weighted) */
    for (long row = 0; row < S; row++) {
        float *o = out + (size_t)(r->perm[row] / k) * H;
        const float *y = L->ys + (size_t)row * H;
        for (int i = 0; i < H; i++) o[i] += y[i];
    }
}

static void ep_bwd(void *ctx, int l, float *dx, qwen3_layer_w *g, float *dtopw, const float *dout,
                   const moe_route *r, const qwen3_layer_w *w, int N) {
    ep_layout *p = ctx;
    ep_scratch s = sc_of(p);
    ep_layer *L = &p->layers[l];
    const qwen3_config *c = &p->m->cfg;
    int H = c->hidden, Im = c->moe_intermediate, k = c->top_k, El = p->El, me = p->c->rank;
    long S = (long)N * k;
    for (long row = 0; row < S; row++) /* each row's token's d output; the owner weights it */
        memcpy(s.xs + (size_t)row * H, dout + (size_t)(r->perm[row] / k) * H, (size_t)H * sizeof(float));
    size_t R = (size_t)L->R;
    float *dxr = s.yr;
    ep_move(p, &s, s.dxs, s.xs, L, 0, (size_t)H); /* dxs: [R, H] d outputs received */
    memset(dxr, 0, R * H * sizeof(float));
    size_t eo = (size_t)(me * El - c->expert0) * Im * H;
    if (R)
        p->m->k.moe_bwd(dxr, g->ewg + eo, g->ewu + eo, g->ewd + eo, s.dtopw1, p->work, s.dxs, L->xr, w->ewg + eo,
                        w->ewu + eo, w->ewd + eo, L->gate, L->up, L->h, L->perm, L->pos, L->off, L->wr, (int)R, H,
                        Im, El, 1);
    ep_move(p, &s, s.xs, dxr, L, 1, (size_t)H); /* d inputs back, in this rank's expert order */
    ep_move(p, &s, s.ws, s.dtopw1, L, 1, 1);
    for (long row = 0; row < S; row++) dtopw[r->perm[row]] = s.ws[row];
    for (int t = 0; t < N; t++) {
        float *o = dx + (size_t)t * H;
        for (int j = 0; j < k; j++) {
            const float *d = s.xs + (size_t)r->pos[(long)t * k + j] * H;
            for (int i = 0; i < H; i++) o[i] += d[i];
        }
    }
}

int ep_init(ep_layout *p, qwen3_model *m, ct_comm *c, ct_err *e) {
    (void)e;
    memset(p, 0, sizeof *p);
    const qwen3_config *cf = &m->cfg;
    int P = c->size, L = cf->n_layers, H = cf->hidden, Im = cf->moe_intermediate;
    p->m = m;
    p->c = c;
    p->El = cf->n_experts / P;
    p->Nmax = m->B * m->T;
    size_t S = (size_t)p->Nmax * cf->top_k, R = S * P;
    /* the layers, then the scratch struct right after them */
    p->layers = ct_calloc(1, (size_t)L * sizeof(ep_layer) + sizeof(ep_scratch));
    for (int l = 0; l < L; l++) {
        if (!qwen3_layer_is_moe(cf, l)) continue;
        ep_layer *y = &p->layers[l];
        y->scnt = ct_calloc(4 * (size_t)P, sizeof(size_t));
        y->sdsp = y->scnt + P, y->rcnt = y->sdsp + P, y->rdsp = y->rcnt + P;
        y->xr = ct_calloc(R * H + 1, sizeof(float));
        y->gate = ct_calloc(3 * R * Im + 1, sizeof(float));
        y->up = y->gate + R * Im, y->h = y->up + R * Im;
        y->ys = ct_calloc(S * H + 1, sizeof(float));
        y->wr = ct_calloc(R + 1, sizeof(float));
        y->er = ct_calloc(3 * R + cf->n_experts + 2, sizeof(int32_t));
        y->perm = y->er + R, y->pos = y->perm + R, y->off = y->pos + R;
    }
    ep_scratch *s = (ep_scratch *)(void *)(p->layers + L);
    s->xs = ct_calloc(S * H + 1, sizeof(float));
    s->yr = ct_calloc(R * H + 1, sizeof(float));
    s->dxs = ct_calloc((R > S ? R : S) * H + 1, sizeof(float));
    s->dtopw1 = ct_calloc(R + 1, sizeof(float));
    s->ws = ct_calloc(S + 1, sizeof(float));
    s->es = ct_calloc(S + 1, sizeof(int32_t));
    s->a = ct_calloc(4 * (size_t)P, sizeof(size_t));
    s->b = s->a + P, s->c = s->b + P, s->d = s->c + P;
    p->work = ct_calloc(KERN_MOE_WORK(R, H, Im), sizeof(float));
    p->d = (qwen3_moe_dispatch){p, ep_fwd, ep_bwd};
    m->moe_ep = &p->d;
    return 0;
}

void ep_free(ep_layout *p) {
    if (!p->layers) return;
    if (p->m && p->m->moe_ep == &p->d) p->m->moe_ep = NULL;
    int L = p->m->cfg.n_layers;
    for (int l = 0; l < L; l++) {
        ep_layer *y = &p->layers[l];
        free(y->scnt);
        free(y->xr);
        free(y->gate);
        free(y->ys);
        free(y->wr);
        free(y->er);
    }
    ep_scratch *s = (ep_scratch *)(void *)(p->layers + L);
    free(s->xs);
    free(s->yr);
    free(s->dxs);
    free(s->dtopw1);
    free(s->ws);
    free(s->es);
    free(s->a);
    free(p->work);
    free(p->layers);
    memset(p, 0, sizeof *p);
}
