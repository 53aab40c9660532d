/* distributed/tp.c: tensor-parallel slicing, gathering and hooks (see tp.h).
 *
 * The group's float sums go through comm_allreduce, whose fixed rank order
 * gives every rank the same bits: the replicated weights then take the same
 * AdamW step everywhere and never drift apart. */
#include "distributed/tp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timer.h"
#include "model/lora.h"

size_t tp_chunk(size_t n, int t, int r, size_t *start) {
    size_t c = (n + (size_t)t - 1) / (size_t)t, a = (size_t)r * c < n ? (size_t)r * c : n;
    *start = a;
    return n - a < c ? n - a : c;
}

void tp_local_config(lm_config *local, const lm_config *full, int t, int rank, int ep, int ep_rank) {
    *local = *full;
    if (ep > 1) {
        local->expert_rows = full->n_experts / ep;
        local->expert0 = ep_rank * local->expert_rows;
    }
    local->tp_degree = t;
    local->tp_rank = rank;
    local->n_heads = full->n_heads / t;
    local->n_kv_heads = full->n_kv_heads / t;
    local->intermediate = full->intermediate / t;
    local->moe_intermediate = full->moe_intermediate / t; /* every expert's gate/up rows, down columns */
    local->shared_intermediate = full->shared_intermediate / t; /* a shared expert: split as the dense MLP */
    /* the embedding and lm_head (tied: the same tensor) by vocabulary rows,
     * in DTensor Shard(0)'s ceil chunks whatever t and V: the last ranks'
     * blocks shorter or empty (vocab_rows 0 with tp_degree > 1 is an empty
     * block, not the whole vocabulary) */
    if (t > 1) {
        size_t r0, n = tp_chunk((size_t)full->vocab_size, t, rank, &r0);
        local->vocab_rows = (int)n;
        local->vocab_row0 = (int)r0;
    }
}

static void reduce(tp_layout *p, float *x, size_t n) {
    double t0 = ct_now();
    comm_allreduce(p->comm, x, n, COMM_F32, COMM_SUM);
    p->comm_s += ct_now() - t0;
}

static void hook_reduce_partial(void *ctx, float *x, size_t n) { reduce(ctx, x, n); }
static void hook_reduce_max(void *ctx, float *x, size_t n) {
    tp_layout *p = ctx;
    double t0 = ct_now();
    comm_allreduce(p->comm, x, n, COMM_F32, COMM_MAX);
    p->comm_s += ct_now() - t0;
}

/* Sequence parallel (lm_seq_dispatch): a rank's rows are block `rank` of
 * the group's; the reduce-scatter sums in rank order, as the all-reduce. */
static void sp_gather(void *ctx, float *full, const float *local, size_t n) {
    tp_layout *p = ctx;
    double t0 = ct_now();
    comm_all_gather(p->comm, full, local, n, COMM_F32);
    p->comm_s += ct_now() - t0;
}
static void sp_scatter(void *ctx, float *local, const float *full, size_t n) {
    tp_layout *p = ctx;
    double t0 = ct_now();
    comm_reduce_scatter(p->comm, local, full, n, COMM_F32);
    p->comm_s += ct_now() - t0;
}

static void hook_pre_forward(void *ctx, int l) {
    tp_layout *p = ctx;
    if (p->inner) p->inner->pre_forward(p->inner->ctx, l);
}
static void hook_post_forward(void *ctx, int l) {
    tp_layout *p = ctx;
    if (p->inner) p->inner->post_forward(p->inner->ctx, l);
}
/* The column-parallel projections, whose LoRA A is replicated. */
static const int col_lora[] = {LM_LORA_Q, LM_LORA_K, LM_LORA_V, LM_LORA_GATE, LM_LORA_UP};
#define N_COL_LORA ((int)(sizeof col_lora / sizeof col_lora[0]))

/* The adapters of a MoE layer's experts whose gradient is a partial sum
 * under TP (exp_slice): gate_up_proj's A, dA_e = scale B_e^T dW_e over the
 * 2 Im rows of which a rank holds its slice's, and down_proj's B,
 * dB_e = scale dW_e A_e^T over the Im columns likewise. The other two are
 * sliced with the weights and complete; the router's adapter, like the
 * router, gets the same whole gradient on every rank (from the summed
 * d(routing weights)) and stays out of the sums. */
#define N_EXP_PARTIAL 2
static size_t exp_partial_floats(const lm_config *c, int l, int which) {
    int p = which ? LM_LORA_EXP_D : LM_LORA_EXP_GU;
    if (!lm_lora_expert_on(c, l, p)) return 0;
    size_t El = (size_t)(c->expert_rows ? c->expert_rows : c->n_experts);
    return (size_t)lm_lora_exp_rank(c, p) * El * (size_t)c->hidden;
}

/* Layer l's replicated tensors whose gradient each rank computes from its
 * slice only (a partial sum): the per-head q/k norms (this rank's heads),
 * the LoRA A of a column-parallel projection (du = scale dy B is summed over
 * this rank's output rows only) and two of the experts' adapters
 * (exp_partial_floats). Not frozen ones, nor OLMo2's q/k norm over the
 * projection (sliced with the heads). g[k], n[k]: gradient and floats;
 * returns how many. A fused module's projections share one A: listed once. */
static int partial_grads(const tp_layout *p, int l, float **g, size_t *n) {
    const lm_layer_w *gl = &p->m->g.layer[l];
    int k = 0;
    if (p->local.qk_norm == LM_QK_HEAD) {
        const float *qk[2] = {gl->qn, gl->kn};
        for (int j = 0; j < 2; j++)
            if (qk[j]) g[k] = (float *)qk[j], n[k++] = (size_t)p->local.head_dim;
    }
    for (int j = 0; j < N_COL_LORA; j++) {
        float *a = gl->lora_a[col_lora[j]];
        int seen = 0;
        for (int h = 0; h < k; h++) seen |= g[h] == a;
        if (!a || seen) continue;
        g[k] = a;
        n[k++] = (size_t)lm_lora_rank(&p->local, l, col_lora[j]) * (size_t)p->local.hidden;
    }
    float *ex[N_EXP_PARTIAL] = {gl->lora_ea[LM_LORA_EXP_GU], gl->lora_eb[LM_LORA_EXP_D]};
    for (int j = 0; j < N_EXP_PARTIAL; j++)
        if (ex[j]) g[k] = ex[j], n[k++] = exp_partial_floats(&p->local, l, j);
    return k;
}

/* After FSDP's (which gathers and zeroes the layer's gradients): what those
 * gradients hold before this micro-batch's backward of the layer, so that
 * only its own contribution is summed over the group. */
static void hook_pre_backward(void *ctx, int l) {
    tp_layout *p = ctx;
    if (p->inner) p->inner->pre_backward(p->inner->ctx, l);
    float *g[2 + N_COL_LORA + N_EXP_PARTIAL];
    size_t n[2 + N_COL_LORA + N_EXP_PARTIAL], off = 0;
    int k = partial_grads(p, l, g, n);
    for (int j = 0; j < k; off += n[j], j++) memcpy(p->before + off, g[j], n[j] * sizeof(float));
}
/* Before FSDP's reduce-scatter: g = before + (sum over ranks of g - before);
 * in the same all-reduce, after those, the norm weights' partial gradients
 * of sequence parallel (lm_norm_partials): one collective for the layer. An
 * all-reduce sums each element over the ranks in rank order wherever it
 * sits in the buffer, so each norm's sums are the bits of its own. */
static void hook_post_backward(void *ctx, int l) {
    tp_layout *p = ctx;
    float *g[2 + N_COL_LORA + N_EXP_PARTIAL], *norms;
    size_t n[2 + N_COL_LORA + N_EXP_PARTIAL], off = 0, nn = lm_norm_partials(p->m, &norms);
    int k = partial_grads(p, l, g, n);
    float *delta = p->before + p->n_before;
    for (int j = 0; j < k; off += n[j], j++)
        for (size_t i = 0; i < n[j]; i++) delta[off + i] = g[j][i] - p->before[off + i];
    if (nn) memcpy(delta + off, norms, nn * sizeof(float));
    if (off + nn) reduce(p, delta, off + nn);
    if (nn) {
        memcpy(norms, delta + off, nn * sizeof(float));
        lm_norm_partials_add(p->m);
    }
    off = 0;
    for (int j = 0; j < k; off += n[j], j++)
        for (size_t i = 0; i < n[j]; i++) g[j][i] = p->before[off + i] + delta[off + i];
    if (p->inner) p->inner->post_backward(p->inner->ctx, l);
}

void tp_init(tp_layout *p, const lm_config *full, ct_comm *group, int ep, int ep_rank) {
    memset(p, 0, sizeof *p);
    p->t = group->size;
    p->rank = group->rank;
    p->ep = ep;
    p->ep_rank = ep_rank;
    p->comm = group;
    p->full = *full;
    tp_local_config(&p->local, full, p->t, p->rank, ep, ep_rank);
    /* the most floats partial_grads gives for one layer (fused A counted per projection) */
    for (int l = 0; l < full->n_layers; l++) {
        size_t n = 2 * (size_t)full->head_dim;
        for (int j = 0; j < N_COL_LORA; j++)
            if (lm_lora_on(full, l, col_lora[j]))
                n += (size_t)lm_lora_rank(full, l, col_lora[j]) * (size_t)full->hidden;
        for (int j = 0; j < N_EXP_PARTIAL; j++) n += exp_partial_floats(&p->local, l, j);
        if (n > p->n_before) p->n_before = n;
    }
    /* before, then the deltas and a layer's (at most 4) norm partials of sequence parallel */
    p->before = ct_calloc(2 * p->n_before + 4 * (size_t)full->hidden, sizeof(float));
}

void tp_free(tp_layout *p) {
    if (p->m && p->m->hooks == &p->hooks) p->m->hooks = p->inner;
    if (p->m && p->m->sp == &p->sp) p->m->sp = NULL;
    free(p->before);
    free(p->sharded);
    free(p->expert);
    for (int i = 0; p->ep_tables && i < p->n_tables; i++) lm_free(&p->ep_tables[i]);
    free(p->ep_tables);
    memset(p, 0, sizeof *p);
}

void tp_attach(tp_layout *p, lm_model *m) {
    p->m = m;
    if (p->t == 1) return; /* expert parallel storage only: no collectives inside the model */
    p->inner = m->hooks;
    p->hooks = (lm_hooks){p, hook_pre_forward, hook_post_forward, hook_pre_backward, hook_post_backward,
                             hook_reduce_partial, hook_reduce_max};
    m->hooks = &p->hooks;
    if (p->local.tp_seq) {
        p->sp = (lm_seq_dispatch){p, p->t, p->rank, sp_gather, sp_scatter};
        m->sp = &p->sp;
    }
}

/* Rows and columns of a tensor (a vector is rows x 1). */
static void dims(const lm_tensor *t, size_t *rows, size_t *cols) {
    *rows = (size_t)t->shape[0];
    *cols = t->ndim == 2 ? (size_t)t->shape[1] : 1;
}

/* An adapter on the fused experts (not the router's): held with its experts. */
static int exp_adapter(const lm_tensor *t) {
    return (t->slot == LM_S_LORA_EA || t->slot == LM_S_LORA_EB) && t->expert != LM_LORA_EXP_R;
}

/* The part of a whole expert adapter that TP index tr of EP index x holds:
 * whole rows {k rs + r0 + i : k < rn, i < rw} and columns
 * {j cs + c0 + i : j < cn, i < cw}, in that order in the local tensor. */
typedef struct {
    size_t r0, rw, rs, rn, c0, cw, cs, cn;
} exp_sel;

/* Expert e's A_e is rows [e r, e r + r) of A [r E, in] and its B_e column j
 * is column j E + e of B [out, r E] (lora_experts_delta), so EP index x's
 * experts [x El, x El + El) are one run of A's rows and r runs of El of B's
 * columns. Under TP each expert is cut along moe_intermediate (Im) as its
 * weights are: gate_up_proj's B [2 Im, .] by rows, gate's Im then up's Im
 * (rows of each, like the experts' gate and up); down_proj's A [., Im] by
 * columns (like its weight's); the other two, over the hidden size, whole. */
static exp_sel exp_slice(const tp_layout *p, const lm_tensor *ft, int tr, int x) {
    size_t E = (size_t)p->full.n_experts, El = E / (size_t)p->ep, fr, fc;
    size_t Im = (size_t)p->full.moe_intermediate, It = Im / (size_t)p->t;
    dims(ft, &fr, &fc);
    int gu = ft->expert == LM_LORA_EXP_GU;
    if (ft->slot == LM_S_LORA_EA) {
        size_t r = fr / E;
        return (exp_sel){(size_t)x * El * r, El * r, 0, 1, gu ? 0 : (size_t)tr * It, gu ? fc : It, 0, 1};
    }
    return (exp_sel){gu ? (size_t)tr * It : 0, gu ? It : fr, Im, gu ? 2 : 1, (size_t)x * El, El, E, fc / E};
}

/* Copies an expert adapter's part between whole (w) and local (s) forms as move_slice. */
static void move_exp(const exp_sel *q, float *s, float *w, size_t fc, int to_local) {
    size_t lc = q->cw * q->cn;
    for (size_t k = 0; k < q->rn; k++)
        for (size_t i = 0; i < q->rw; i++) {
            float *a = s + (k * q->rw + i) * lc, *b = w + (k * q->rs + q->r0 + i) * fc + q->c0;
            for (size_t j = 0; j < q->cn; j++)
                memcpy(to_local ? a + j * q->cw : b + j * q->cs, to_local ? b + j * q->cs : a + j * q->cw,
                       q->cw * sizeof(float));
        }
}

/* The row blocks of a whole tensor that are column-parallel each on their
 * own: Phi3's fused qkv_proj is q, k and v stacked (rank r holds its heads'
 * rows of each: [q_r; k_r; v_r] is its local qkv_proj, the layout the local
 * model reads), gate_up_proj gate and up; any other tensor is one block.
 * Fills fb[] with the whole blocks' row counts; returns how many. */
int tp_row_blocks(const tp_layout *p, const lm_tensor *ft, size_t fb[3]) {
    size_t fr, fc;
    dims(ft, &fr, &fc);
    /* a fused module's LoRA B follows its base's row blocks */
    unsigned lt = p->full.lora_targets;
    int b = ft->slot == LM_S_LORA_B;
    if (exp_adapter(ft)) { /* its row runs (exp_slice): gate_up's B has two */
        int n = (int)exp_slice(p, ft, 0, 0).rn;
        fb[0] = fb[1] = fr / (size_t)n;
        return n;
    }
    if (ft->slot == LM_S_WQKV || (b && ft->expert == LM_LORA_Q && (lt & LORA_FUSED_QKV))) {
        size_t hd = (size_t)p->full.head_dim;
        fb[0] = (size_t)p->full.n_heads * hd;
        fb[1] = fb[2] = (size_t)p->full.n_kv_heads * hd;
        return 3;
    }
    if (ft->slot == LM_S_WGU || (b && ft->expert == LM_LORA_GATE && (lt & LORA_FUSED_GATE_UP))) {
        fb[0] = fb[1] = fr / 2;
        return 2;
    }
    fb[0] = fr;
    return 1;
}

/* Copies the slice of TP index r, EP index x of one tensor between its
 * whole form (w) and its local form (s): to_local 1 reads w, 0 writes it.
 * An expert another EP rank holds has no rows here: nothing moves. */
static void move_slice(const tp_layout *p, const lm_tensor *lt, float *s, const lm_tensor *ft, float *w, int r, int x,
                       int to_local) {
    size_t lr, lc, fr, fc, fb[3];
    dims(lt, &lr, &lc);
    dims(ft, &fr, &fc);
    if (!lt->numel) return; /* an expert another EP rank holds (fewer rows, but not a TP slice) */
    if (exp_adapter(ft)) {
        exp_sel q = exp_slice(p, ft, r, x);
        move_exp(&q, s, w, fc, to_local);
        return;
    }
    if (lr < fr) { /* column-parallel: a block of rows of each row block */
        int nb = tp_row_blocks(p, ft, fb);
        size_t f0 = 0, l0 = 0;
        for (int k = 0; k < nb; k++) {
            size_t c0, n = tp_chunk(fb[k], p->t, r, &c0); /* this rank's rows of block k */
            float *a = s + l0 * lc, *b = w + (f0 + c0) * lc;
            memcpy(to_local ? a : b, to_local ? b : a, n * lc * sizeof(float));
            f0 += fb[k];
            l0 += n;
        }
    } else if (lc < fc) { /* row-parallel: a block of columns in every row */
        for (size_t i = 0; i < lr; i++) {
            float *a = s + i * lc, *b = w + i * fc + (size_t)r * lc;
            memcpy(to_local ? a : b, to_local ? b : a, lc * sizeof(float));
        }
    } else {
        memcpy(to_local ? s : w, to_local ? w : s, lr * lc * sizeof(float));
    }
}

void tp_classify(tp_layout *p, const lm_model *lm, const lm_model *fm) {
    if (!p->sharded) p->sharded = ct_calloc((size_t)lm->n_tensors + 1, 1);
    if (!p->expert) p->expert = ct_calloc((size_t)lm->n_tensors + 1, 1);
    for (int i = 0; i < lm->n_tensors; i++) {
        const lm_tensor *t = &lm->tensors[i];
        p->sharded[i] = t->numel != fm->tensors[i].numel;
        /* an expert adapter is cut by EP too: sliced over the TP group only where exp_slice cuts Im */
        if (exp_adapter(t)) /* gate_up's B and down's A (exp_slice) */
            p->sharded[i] = p->t > 1 && (t->slot == LM_S_LORA_EA) != (t->expert == LM_LORA_EXP_GU);
        p->expert[i] = (t->slot >= LM_S_EXP_G && t->slot <= LM_S_EXP_D) || exp_adapter(t);
    }
}

size_t tp_take_rows(const tp_layout *p, const lm_tensor *lt, const lm_tensor *ft, int blk, size_t r0, size_t r1,
                    const float *rows, float *tmp, const float **out, size_t *la) {
    size_t lr, lc, fr, fc, fb[3];
    dims(lt, &lr, &lc);
    dims(ft, &fr, &fc);
    if (!lt->numel) return 0; /* an expert another EP rank holds */
    if (exp_adapter(ft)) { /* row run blk of exp_slice, its columns picked into tmp unless whole */
        exp_sel q = exp_slice(p, ft, p->rank, p->ep_rank);
        size_t R = (size_t)blk * q.rs + q.r0, a = r0 > R ? r0 : R, b = r1 < R + q.rw ? r1 : R + q.rw;
        if ((size_t)blk >= q.rn || a >= b) return 0;
        *la = (size_t)blk * q.rw + (a - R);
        if (q.cn * q.cw == fc) { /* whole rows (an expert B without EP: r runs of E columns): no pick */
            *out = rows + (a - r0) * fc;
            return b - a;
        }
        for (size_t k = a; k < b; k++)
            for (size_t j = 0; j < q.cn; j++)
                memcpy(tmp + (k - a) * lc + j * q.cw, rows + (k - r0) * fc + j * q.cs + q.c0, q.cw * sizeof(float));
        *out = tmp;
        return b - a;
    }
    if (lr < fr) { /* column-parallel: whole rows [R, R + n) of row block blk are this rank's */
        int nb = tp_row_blocks(p, ft, fb);
        if (blk >= nb) return 0;
        size_t f0 = 0, l0 = 0, c0;
        for (int k = 0; k < blk; k++) {
            f0 += fb[k];
            l0 += tp_chunk(fb[k], p->t, p->rank, &c0);
        }
        size_t n = tp_chunk(fb[blk], p->t, p->rank, &c0), R = f0 + c0;
        size_t a = r0 > R ? r0 : R, b = r1 < R + n ? r1 : R + n;
        if (a >= b) return 0;
        *out = rows + (a - r0) * fc;
        *la = l0 + (a - R);
        return b - a;
    }
    if (blk > 0) return 0; /* one block */
    if (lc < fc) { /* row-parallel: columns [rank lc, (rank + 1) lc) of every row */
        for (size_t k = 0; k < r1 - r0; k++)
            memcpy(tmp + k * lc, rows + k * fc + (size_t)p->rank * lc, lc * sizeof(float));
        *out = tmp;
    } else {
        *out = rows;
    }
    *la = r0;
    return r1 - r0;
}

/* Flat offset of tensor i of m's table; n_params for i == n_tensors. */
static size_t tensor_start(const lm_model *m, int i) {
    return i < m->n_tensors ? m->tensors[i].offset : m->n_params;
}

void tp_gather_range(tp_layout *p, ct_comm *g, int ta, int tb, const lm_model *fm, float *full,
                     const lm_model *lm, const float *local) {
    int t = g->size, root = g->rank == 0;
    if (root && !p->ep_tables) { /* member r's own table says where its tensors are: TP index r % t's
                                  * vocabulary block (uneven: ceil chunks), EP index r / t's experts */
        p->ep_tables = ct_calloc((size_t)t, sizeof *p->ep_tables);
        for (int r = 0; r < t; r++) {
            lm_config rcfg;
            tp_local_config(&rcfg, &p->full, p->t, r % p->t, p->ep, r / p->t);
            lm_layout(&p->ep_tables[r], &rcfg);
        }
        p->n_tables = t;
    }
    /* a member's floats of [ta, tb): the vocabulary's blocks may differ in size */
    size_t n = tensor_start(lm, tb) - tensor_start(lm, ta), total = 0;
    size_t *v = ct_calloc(4 * (size_t)t, sizeof(size_t));
    size_t *sc = v, *sd = v + t, *rc = v + 2 * t, *rd = v + 3 * t;
    sc[0] = n;
    for (int r = 0; root && r < t; r++) {
        rc[r] = tensor_start(&p->ep_tables[r], tb) - tensor_start(&p->ep_tables[r], ta);
        rd[r] = total;
        total += rc[r];
    }
    float *all = root ? ct_malloc((total + 1) * sizeof(float)) : NULL;
    double t0 = ct_now();
    comm_all_to_allv(g, all, rc, rd, local, sc, sd, COMM_F32);
    p->comm_s += ct_now() - t0;
    if (root) {
        size_t fbase = tensor_start(fm, ta);
        for (int r = 0; r < t; r++) {
            const lm_model *rm = &p->ep_tables[r];
            size_t rbase = tensor_start(rm, ta);
            for (int i = ta; i < tb; i++) {
                const lm_tensor *lt = &rm->tensors[i], *ft = &fm->tensors[i];
                /* the rest is the same on every EP rank, and under FSDP gathered on EP index 0 only */
                if (r >= p->t && !p->expert[i]) continue;
                move_slice(p, lt, all + rd[r] + (lt->offset - rbase), ft, full + (ft->offset - fbase),
                           r % p->t, r / p->t, 0);
            }
        }
    }
    free(all);
    free(v);
}

double tp_sq_range(const tp_layout *p, const float *x, size_t lo, size_t n, int which) {
    const lm_model *m = p->m;
    double sq = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        if ((which == TP_SQ_DENSE && p->expert[i]) || (which == TP_SQ_EXPERTS && !p->expert[i])) continue;
        size_t a = t->offset > lo ? t->offset : lo, b = t->offset + t->numel < lo + n ? t->offset + t->numel : lo + n;
        if (a >= b) continue;
        if (!p->sharded[i] && p->rank != 0) continue; /* replicated: counted once */
        for (size_t k = a; k < b; k++) sq += (double)x[k - lo] * x[k - lo];
    }
    return sq;
}

double tp_take_comm_time(tp_layout *p) {
    double s = p->comm_s;
    p->comm_s = 0;
    return s;
}
