/* model/generate.c: KV-cache inference and sampling for every family of
 * model/lm.h (see generate.h).
 *
 * The layer math is the training forward's (model/lm.c) restricted to the
 * rows being fed, with two differences: K and V of each row go straight into
 * the cache at their absolute positions, and attention reads every cached
 * position up to the query's own instead of a T x T causal block. Only the
 * last row goes through the final norm and the lm_head, since generation
 * needs one distribution per step. Everything runs through kernels/ops.h
 * except the attention against the cache, which lives here: a prefill chunk
 * still does its two attention products with op_matmul_fwd, a decode step
 * (one query row) uses a direct loop over the cache. */
#include "model/generate.h"
#include "model/lora.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"

/* Rows prefilled at once: large enough for GEMM efficiency, small enough that
 * the scratch stays a few MB for published sizes (I = 3072..25600). */
#define GEN_CHUNK 64
/* Chunks of at least this many rows take the GEMM attention; decode steps
 * (one row) read the cache directly, which moves each cached value once. */
#define GEN_GEMM_ROWS 4

/* Float offsets of the state's buffers inside one allocation (64-byte
 * aligned); with base == NULL it only counts. */
static float *gen_carve(float *base, size_t *used, size_t n) {
    float *p = base ? base + *used : NULL;
    *used += (n + 15) & ~(size_t)15;
    return p;
}

static size_t gen_layout(gen_state *g, float *base) {
    const lm_config *c = &g->m->cfg;
    size_t L = (size_t)c->n_layers, H = (size_t)c->hidden, I = (size_t)c->intermediate, hd = (size_t)c->head_dim;
    size_t qd = (size_t)c->n_heads * hd, kvd = (size_t)c->n_kv_heads * hd, T = (size_t)g->max_len;
    size_t C = (size_t)g->chunk, used = 0;
    int moe = c->n_experts > 0;
    size_t Ik = (size_t)c->top_k * c->moe_intermediate; /* a MoE layer's gate/up/h per token */
    if (moe && Ik > I) I = Ik;
    g->k_cache = gen_carve(base, &used, L * T * kvd);
    g->v_cache = gen_carve(base, &used, L * T * kvd);
    g->rope_cos = gen_carve(base, &used, T * hd / 2);
    g->rope_sin = gen_carve(base, &used, T * hd / 2);
    g->rope_cos_l = g->rope_cos, g->rope_sin_l = g->rope_sin;
    if (lm_rope_local_differs(c)) {
        g->rope_cos_l = gen_carve(base, &used, T * hd / 2);
        g->rope_sin_l = gen_carve(base, &used, T * hd / 2);
    }
    g->y = gen_carve(base, &used, C * H);
    g->norm_w = gen_carve(base, &used, H > qd ? H : qd);
    g->x = gen_carve(base, &used, C * H);
    g->xn = gen_carve(base, &used, C * H);
    g->qraw = gen_carve(base, &used, C * qd);
    g->q = gen_carve(base, &used, C * qd);
    g->kraw = gen_carve(base, &used, C * kvd);
    g->att = gen_carve(base, &used, C * qd);
    g->gate = gen_carve(base, &used, C * I);
    g->up = gen_carve(base, &used, C * I);
    g->h = gen_carve(base, &used, C * I);
    g->rstd = gen_carve(base, &used, C * (size_t)c->n_heads + C);
    g->scores = gen_carve(base, &used, (size_t)g->n_threads * T);
    g->kh = gen_carve(base, &used, T * hd);
    g->vht = gen_carve(base, &used, hd * T);
    g->qh = gen_carve(base, &used, C * hd);
    g->oh = gen_carve(base, &used, C * hd);
    g->probs = gen_carve(base, &used, C * T);
    if (moe) {
        float *r = gen_carve(base, &used, moe_route_floats(g->chunk, c->n_experts, c->top_k));
        if (r) moe_route_bind(&g->route, r, g->chunk, c->n_experts, c->top_k);
        g->moe_work = gen_carve(base, &used, KERN_MOE_WORK(C * c->top_k, H, c->moe_intermediate));
    }
    if (c->lora_rank > 0) g->lora_u = gen_carve(base, &used, C * (size_t)c->lora_rank);
    return used;
}

int gen_init(gen_state *g, const lm_model *m, int max_len, ct_err *e) {
    memset(g, 0, sizeof *g);
    if (max_len < 1) return ct_fail(e, CT_ERR_CONFIG, "generate: the KV cache needs at least 1 position, got %d", max_len);
    g->m = m;
    g->max_len = max_len;
    g->chunk = max_len < GEN_CHUNK ? max_len : GEN_CHUNK;
    g->n_threads = omp_get_max_threads();
    if (g->n_threads < 1) g->n_threads = 1;
    size_t n = gen_layout(g, NULL);
    g->mem = ct_malloc(n * sizeof(float));
    gen_layout(g, g->mem);
    /* absolute positions 0 .. max_len-1, the same fp32 recipe as training */
    /* absolute positions 0 .. max_len-1 (length-dependent RoPE: per chunk, gen_forward_chunk) */
    lm_rope_tables(&m->cfg, 0, max_len, 0, max_len, g->rope_cos, g->rope_sin);
    if (g->rope_cos_l != g->rope_cos) lm_rope_tables(&m->cfg, 1, max_len, 0, max_len, g->rope_cos_l, g->rope_sin_l);
    return 0;
}

void gen_free(gen_state *g) {
    free(g->mem);
    memset(g, 0, sizeof *g);
}

void gen_reset(gen_state *g) { g->pos = 0; }

/* The family's attention variant of layer l (model/lm.h): the scores' scale,
 * the first key a query at position `last` sees, and the soft cap. */
typedef struct {
    float scale, cap;
    int window;
} gen_attn;
static gen_attn gen_attn_of(const lm_config *c, int l) {
    gen_attn a = {c->attn_scale > 0 ? (float)c->attn_scale : 1.0f / sqrtf((float)c->head_dim), (float)c->attn_softcap,
                  c->layer_sliding[l] ? c->sliding_window : 0};
    return a;
}
static int gen_first_key(const gen_attn *a, int last) {
    return a->window > 0 && last - a->window + 1 > 0 ? last - a->window + 1 : 0;
}
/* a score as HF eager forms it: (q . k) * scale, then cap tanh(s / cap) */
static float gen_score(const gen_attn *a, float dot) {
    float s = dot * a->scale;
    return a->cap > 0 ? a->cap * tanhf(s / a->cap) : s;
}

/* Causal GQA attention of n new queries against the cache.
 * out[n, nH, hd], q[n, nH, hd] (after q_norm + RoPE); kc, vc [max_len, nKV, hd]
 * hold positions 0 .. p0+n-1; query i sits at absolute position p0+i and sees
 * keys first .. p0+i (first > 0 only in a sliding window). scores
 * [n_threads, max_len] is per-thread scratch. The order of operations is HF
 * eager's: (q . k) * scale, soft cap, softmax with the row max subtracted,
 * then probs @ v. */
static void gen_attention(float *out, const float *q, const float *kc, const float *vc, float *scores, int n_threads,
                          int p0, int n, int nH, int nKV, int hd, int max_len, const gen_attn *at) {
    int group = nH / nKV;
    size_t kvd = (size_t)nKV * hd;
#pragma omp parallel for collapse(2) num_threads(n_threads) schedule(static)
    for (int i = 0; i < n; i++) {
        for (int h = 0; h < nH; h++) {
            float *s = scores + (size_t)omp_get_thread_num() * max_len;
            int kh = h / group, last = p0 + i, t0 = gen_first_key(at, last);
            const float *qi = q + ((size_t)i * nH + h) * hd;
            float maxv = -INFINITY;
            for (int t = t0; t <= last; t++) {
                const float *kt = kc + (size_t)t * kvd + (size_t)kh * hd;
                float dot = 0.0f;
                /* simd: lets the compiler split the sum into vector lanes (a
                 * different fp32 rounding order, as BLAS has in HF's matmul) */
#pragma omp simd reduction(+ : dot)
                for (int d = 0; d < hd; d++) dot += qi[d] * kt[d];
                s[t] = gen_score(at, dot);
                if (s[t] > maxv) maxv = s[t];
            }
            float sum = 0.0f;
            for (int t = t0; t <= last; t++) {
                s[t] = expf(s[t] - maxv);
                sum += s[t];
            }
            float inv = 1.0f / sum;
            float *o = out + ((size_t)i * nH + h) * hd;
            for (int d = 0; d < hd; d++) o[d] = 0.0f;
            for (int t = t0; t <= last; t++) {
                const float *vt = vc + (size_t)t * kvd + (size_t)kh * hd;
                float p = s[t] * inv;
#pragma omp simd /* o and vt never overlap (output vs cache) */
                for (int d = 0; d < hd; d++) o[d] += p * vt[d];
            }
        }
    }
}

/* The same attention for a prefill chunk, through op_matmul_fwd so that the
 * n x (p0+n) scores of a long prompt cost GEMMs: per kv head, its cached K
 * [p0+n, hd] and V^T [hd, p0+n] are gathered once, then for each query head
 * of its group S = Q K^T, the causal softmax of each row, and O = S V. */
static void gen_attention_prefill(gen_state *g, float *out, const float *q, const float *kc, const float *vc, int p0,
                                  int n, int nH, int nKV, int hd, const gen_attn *at) {
    int group = nH / nKV, T = p0 + n;
    size_t kvd = (size_t)nKV * hd;
    float *kh = g->kh, *vht = g->vht, *qh = g->qh, *oh = g->oh, *S = g->probs; /* [T,hd] [hd,T] [n,hd] [n,hd] [n,T] */
    for (int k = 0; k < nKV; k++) {
        for (int t = 0; t < T; t++) {
            memcpy(kh + (size_t)t * hd, kc + (size_t)t * kvd + (size_t)k * hd, (size_t)hd * sizeof(float));
            for (int d = 0; d < hd; d++) vht[(size_t)d * T + t] = vc[(size_t)t * kvd + (size_t)k * hd + d];
        }
        for (int h = k * group; h < (k + 1) * group; h++) {
            for (int i = 0; i < n; i++)
                memcpy(qh + (size_t)i * hd, q + ((size_t)i * nH + h) * hd, (size_t)hd * sizeof(float));
            g->m->k.matmul_fwd(S, qh, kh, n, hd, T, 0); /* S[n, T] = Q K^T */
#pragma omp parallel for num_threads(g->n_threads) schedule(static)
            for (int i = 0; i < n; i++) {
                float *row = S + (size_t)i * T;
                /* keys after the query's own position, and before its window, are masked */
                int last = p0 + i, t0 = gen_first_key(at, last);
                float maxv = -INFINITY, sum = 0.0f;
                for (int t = t0; t <= last; t++) {
                    row[t] = gen_score(at, row[t]);
                    if (row[t] > maxv) maxv = row[t];
                }
                for (int t = t0; t <= last; t++) {
                    row[t] = expf(row[t] - maxv);
                    sum += row[t];
                }
                float inv = 1.0f / sum;
                for (int t = 0; t < t0; t++) row[t] = 0.0f;
                for (int t = t0; t <= last; t++) row[t] *= inv;
                for (int t = last + 1; t < T; t++) row[t] = 0.0f;
            }
            g->m->k.matmul_fwd(oh, S, vht, n, T, hd, 0); /* O[n, hd] = P V */
            for (int i = 0; i < n; i++)
                memcpy(out + ((size_t)i * nH + h) * hd, oh + (size_t)i * hd, (size_t)hd * sizeof(float));
        }
    }
}

/* y[n, N] += B (scale A x[n, K]): a LoRA adapter of projection p beside its
 * base linear, unmerged as PEFT runs it (nothing when p has none). */
static void gen_lora(const gen_state *g, const lm_layer_w *w, int p, float *y, const float *x, int n, int K, int N) {
    if (w->lora_a[p])
        lora_apply(&g->m->k, y, g->lora_u, x, w->lora_a[p], w->lora_b[p], n, K, N, g->m->cfg.lora_rank,
                   g->m->cfg.lora_scale);
}

/* A norm's weight as the kernels read it: w, or Gemma's 1 + w. */
static const float *gen_nw(gen_state *g, const float *w, int n) {
    return lm_norm_weight(&g->m->cfg, g->norm_w, w, n);
}

/* out[n, nh*hd] = the family's q/k norm of x (per head, over the projection,
 * or none); RoPE follows in place. */
static void gen_qk_norm(gen_state *g, float *out, const float *x, const float *w, int n, int nh, int hd) {
    const lm_config *c = &g->m->cfg;
    float eps = (float)c->rms_eps;
    if (c->qk_norm == LM_QK_HEAD) g->m->k.rmsnorm_fwd(out, g->rstd, x, gen_nw(g, w, hd), n * nh, hd, eps);
    else if (c->qk_norm == LM_QK_PROJ) g->m->k.rmsnorm_fwd(out, g->rstd, x, gen_nw(g, w, nh * hd), n, nh * hd, eps);
    else memcpy(out, x, (size_t)n * nh * hd * sizeof(float));
}

/* x[n, H] += [norm](in[n, K] @ w^T + b): o_proj and down_proj with their
 * bias, LoRA adapter p and the family's output norm (OLMo2, Gemma3). */
static void gen_out_proj(gen_state *g, const lm_layer_w *w, int p, const float *wt, const float *b, const float *ln,
                         const float *in, int n, int K) {
    const lm_config *c = &g->m->cfg;
    int H = c->hidden;
    if (!ln && !b) {
        g->m->k.matmul_fwd(g->x, in, wt, n, K, H, 1);
        gen_lora(g, w, p, g->x, in, n, K, H);
        return;
    }
    g->m->k.matmul_fwd(g->y, in, wt, n, K, H, 0);
    if (b) op_bias_add(g->y, b, n, H);
    gen_lora(g, w, p, g->y, in, n, K, H);
    const float *y = g->y;
    if (ln) { /* xn (the block's input) is no longer read */
        g->m->k.rmsnorm_fwd(g->xn, g->rstd, g->y, gen_nw(g, ln, H), n, H, (float)c->rms_eps);
        y = g->xn;
    }
    g->m->k.add(g->x, g->x, y, (long)n * H);
}

/* One chunk of n <= g->chunk rows at positions g->pos .. g->pos+n-1. Leaves
 * the residual stream after the last layer in g->x [n, H]. */
static void gen_forward_chunk(gen_state *g, const int32_t *tokens, int n) {
    const lm_model *m = g->m;
    const lm_config *c = &m->cfg;
    int H = c->hidden, I = c->intermediate, hd = c->head_dim, half = hd / 2;
    int nH = c->n_heads, nKV = c->n_kv_heads, qd = nH * hd, kvd = nKV * hd;
    float eps = (float)c->rms_eps;
    int p0 = g->pos;
    if (lm_rope_by_length(c)) { /* as transformers' forward of positions 0 .. p0+n-1 resolves them */
        lm_rope_tables(c, 0, p0 + n, p0, n, g->rope_cos + (size_t)p0 * half, g->rope_sin + (size_t)p0 * half);
        if (g->rope_cos_l != g->rope_cos)
            lm_rope_tables(c, 1, p0 + n, p0, n, g->rope_cos_l + (size_t)p0 * half, g->rope_sin_l + (size_t)p0 * half);
    }

    g->m->k.embedding_fwd(g->x, tokens, m->w.wte, n, H);
    lm_embed_scale(c, g->x, (size_t)n * H);
    for (int l = 0; l < c->n_layers; l++) {
        const lm_layer_w *w = &m->w.layer[l];
        float *kc = g->k_cache + (size_t)l * g->max_len * kvd; /* [max_len, nKV, hd] */
        float *vc = g->v_cache + (size_t)l * g->max_len * kvd;
        float *k = kc + (size_t)p0 * kvd, *v = vc + (size_t)p0 * kvd; /* [n, nKV*hd] rows being added */
        int loc = c->layer_sliding[l];
        const float *cs = (loc ? g->rope_cos_l : g->rope_cos) + (size_t)p0 * half;
        const float *sn = (loc ? g->rope_sin_l : g->rope_sin) + (size_t)p0 * half;
        gen_attn at = gen_attn_of(c, l);
        /* attention block: the normed, rotated K and the V of the new rows go
         * straight into the cache (ops.h promises in-place only for RoPE, so
         * the projections land in scratch first) */
        const float *xa = g->x; /* OLMo2: no input norm */
        if (w->ln1) {
            g->m->k.rmsnorm_fwd(g->xn, g->rstd, g->x, gen_nw(g, w->ln1, H), n, H, eps);
            xa = g->xn;
        }
        g->m->k.matmul_fwd(g->qraw, xa, w->wq, n, H, qd, 0);
        g->m->k.matmul_fwd(g->kraw, xa, w->wk, n, H, kvd, 0);
        g->m->k.matmul_fwd(v, xa, w->wv, n, H, kvd, 0);
        if (w->bq) {
            op_bias_add(g->qraw, w->bq, n, qd);
            op_bias_add(g->kraw, w->bk, n, kvd);
            op_bias_add(v, w->bv, n, kvd);
        }
        gen_lora(g, w, LM_LORA_Q, g->qraw, xa, n, H, qd);
        gen_lora(g, w, LM_LORA_K, g->kraw, xa, n, H, kvd);
        gen_lora(g, w, LM_LORA_V, v, xa, n, H, kvd);
        gen_qk_norm(g, g->q, g->qraw, w->qn, n, nH, hd);
        gen_qk_norm(g, k, g->kraw, w->kn, n, nKV, hd);
        /* rope tables offset to p0: row t of the chunk is absolute position p0+t */
        g->m->k.rope_fwd(g->q, g->q, cs, sn, 1, n, nH, hd);
        g->m->k.rope_fwd(k, k, cs, sn, 1, n, nKV, hd);
        if (n >= GEN_GEMM_ROWS) gen_attention_prefill(g, g->att, g->q, kc, vc, p0, n, nH, nKV, hd, &at);
        else gen_attention(g->att, g->q, kc, vc, g->scores, g->n_threads, p0, n, nH, nKV, hd, g->max_len, &at);
        gen_out_proj(g, w, LM_LORA_O, w->wo, w->bo, w->ln_ao, g->att, n, qd); /* x += [norm](o_proj(att)) */
        /* MLP block */
        const float *xm = g->x;
        if (w->ln2) {
            g->m->k.rmsnorm_fwd(g->xn, g->rstd, g->x, gen_nw(g, w->ln2, H), n, H, eps);
            xm = g->xn;
        }
        if (w->router) { /* sparse: x += sum_j w_j expert_j(xn), model/moe.h */
            int E = c->n_experts, k = c->top_k;
            moe_route_fwd(&g->m->k, &g->route, g->xn, w->router, m->moe_bias + (size_t)l * E, n, H, E, k,
                          c->norm_topk_prob);
            g->m->k.moe_fwd(g->x, g->gate, g->up, g->h, g->moe_work, g->xn, w->ewg, w->ewu, w->ewd, g->route.perm,
                            g->route.pos, g->route.offsets, g->route.topw, n, H, c->moe_intermediate, E, k);
            continue;
        }
        g->m->k.matmul_fwd(g->gate, xm, w->wg, n, H, I, 0);
        g->m->k.matmul_fwd(g->up, xm, w->wu, n, H, I, 0);
        if (w->bg) {
            op_bias_add(g->gate, w->bg, n, I);
            op_bias_add(g->up, w->bu, n, I);
        }
        gen_lora(g, w, LM_LORA_GATE, g->gate, xm, n, H, I);
        gen_lora(g, w, LM_LORA_UP, g->up, xm, n, H, I);
        if (c->act == LM_ACT_GELU_TANH) g->m->k.geglu_fwd(g->h, g->gate, g->up, n * I);
        else g->m->k.swiglu_fwd(g->h, g->gate, g->up, n * I);
        gen_out_proj(g, w, LM_LORA_DOWN, w->wd, w->bd, w->ln_mo, g->h, n, I); /* x += [norm](down(h)) */
    }
    g->pos += n;
}

int gen_forward(gen_state *g, const int32_t *tokens, int n, float *logits, ct_err *e) {
    const lm_config *c = &g->m->cfg;
    if (n < 1) return ct_fail(e, CT_ERR_CONFIG, "generate: nothing to run (0 tokens)");
    if (n > g->max_len - g->pos)
        return ct_fail(e, CT_ERR_CONFIG, "generate: %d more tokens overflow the KV cache (%d of %d positions used)", n,
                       g->pos, g->max_len);
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= c->vocab_size)
            return ct_fail(e, CT_ERR_CONFIG, "generate: token id %d is outside the vocabulary [0, %d)", (int)tokens[i],
                           c->vocab_size);
    int done = 0;
    while (done < n) {
        int k = n - done < g->chunk ? n - done : g->chunk;
        gen_forward_chunk(g, tokens + done, k);
        done += k;
    }
    if (logits) {
        /* final norm and lm_head on the last row only */
        int H = c->hidden;
        int last = (n - 1) % g->chunk; /* row of the last token in the last chunk */
        g->m->k.rmsnorm_fwd(g->xn, g->rstd, g->x + (size_t)last * H, gen_nw(g, g->m->w.lnf, H), 1, H,
                            (float)c->rms_eps);
        g->m->k.matmul_fwd(logits, g->xn, g->m->w.lm_head, 1, H, c->vocab_size, 0);
        lm_final_softcap(c, logits, (size_t)c->vocab_size, NULL);
    }
    return 0;
}

/* --------------------------------------------------------------- sampling */

void gen_sample_buf_init(gen_sample_buf *b, int V) {
    b->V = V;
    b->cand = ct_malloc((size_t)V * sizeof *b->cand);
    b->prob = ct_malloc((size_t)V * sizeof *b->prob);
}

void gen_sample_buf_free(gen_sample_buf *b) {
    free(b->cand);
    free(b->prob);
    memset(b, 0, sizeof *b);
}

/* The k-th largest (k >= 1) of a[n], by quickselect; a is reordered. */
static float gen_kth_largest(float *a, int n, int k) {
    int lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float pivot = a[lo + (hi - lo) / 2];
        int i = lo, j = hi;
        while (i <= j) { /* descending: big values to the left */
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float t = a[i];
                a[i] = a[j];
                a[j] = t;
                i++;
                j--;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* Total order on candidates so qsort (not stable) gives one answer. */
static int gen_cand_cmp(const void *pa, const void *pb) {
    const gen_cand *a = pa, *b = pb;
    if (a->v != b->v) return a->v > b->v ? -1 : 1; /* most likely first */
    return (a->id > b->id) - (a->id < b->id);      /* then lower id, so the order is total */
}

int32_t gen_sample(const float *logits, const gen_sampler *s, ct_rng *rng, gen_sample_buf *b) {
    int V = b->V;
    if (s->temperature <= 0.0f) {
        int32_t best = 0; /* first index of the maximum, as torch.argmax */
        for (int i = 1; i < V; i++)
            if (logits[i] > logits[best]) best = i;
        return best;
    }
    /* HF divides the logits by the temperature (not multiplies by 1/T) */
    float thresh = -INFINITY;
    if (s->top_k > 0 && s->top_k < V) {
        for (int i = 0; i < V; i++) b->prob[i] = logits[i] / s->temperature;
        thresh = gen_kth_largest(b->prob, V, s->top_k); /* ties at the k-th value stay, as in HF */
    }
    int n = 0;
    gen_cand *cand = b->cand;
    for (int i = 0; i < V; i++) {
        float v = logits[i] / s->temperature;
        if (v >= thresh) cand[n++] = (gen_cand){v, i};
    }
    if (n == 0) cand[n++] = (gen_cand){logits[0], 0}; /* all -inf or NaN: nothing sane to do */
    int sorted = s->top_p < 1.0f; /* only top-p needs the order; a draw works in any */
    if (sorted) qsort(cand, (size_t)n, sizeof *cand, gen_cand_cmp);
    float maxv = cand[0].v;
    if (!sorted)
        for (int i = 1; i < n; i++)
            if (cand[i].v > maxv) maxv = cand[i].v;
    double sum = 0.0;
    for (int i = 0; i < n; i++) {
        b->prob[i] = expf(cand[i].v - maxv);
        sum += b->prob[i];
    }
    int keep = n;
    if (s->top_p < 1.0f) {
        /* HF: sort ascending, cumulative softmax, drop tokens whose cumulative
         * mass (their own and every less likely one's) is <= 1 - top_p; the
         * most likely token always stays. Here: tail sums from the end. */
        double tail = 0.0, limit = 1.0 - (double)s->top_p;
        for (int i = n - 1; i >= 1; i--) {
            tail += b->prob[i] / sum;
            if (tail <= limit) keep = i;
            else break;
        }
    }
    double kept = 0.0;
    for (int i = 0; i < keep; i++) kept += b->prob[i];
    double u = ct_rng_uniform(rng) * kept, acc = 0.0;
    int32_t pick = cand[keep - 1].id;
    for (int i = 0; i < keep; i++) {
        acc += b->prob[i];
        if (u < acc) {
            pick = cand[i].id;
            break;
        }
    }
    return pick;
}

/* -------------------------------------------------------------- generate */

static int gen_is_stop(const gen_opts *o, int32_t id) {
    for (int i = 0; i < o->n_stop; i++)
        if (o->stop_ids[i] == id) return 1;
    return 0;
}

int gen_generate(gen_state *g, const int32_t *prompt, int n_prompt, const gen_opts *o, int32_t *out, int *n_out,
                 gen_token_fn on_token, void *ctx, ct_err *e) {
    *n_out = 0;
    if (n_prompt < 1) return ct_fail(e, CT_ERR_CONFIG, "generate: the prompt has no tokens");
    if (o->max_tokens < 1) return 0;
    if ((long)n_prompt + o->max_tokens - 1 > g->max_len)
        return ct_fail(e, CT_ERR_CONFIG, "generate: prompt (%d) + max tokens (%d) exceed the KV cache (%d positions)",
                       n_prompt, o->max_tokens, g->max_len);
    int V = g->m->cfg.vocab_size;
    float *logits = ct_malloc((size_t)V * sizeof *logits); /* [V] of the newest position */
    gen_sample_buf sb;
    gen_sample_buf_init(&sb, V);
    ct_rng rng;
    ct_rng_seed(&rng, o->seed);
    gen_reset(g);
    int rc = gen_forward(g, prompt, n_prompt, logits, e);
    for (int t = 0; !rc && t < o->max_tokens; t++) {
        int32_t id = gen_sample(logits, &o->sampler, &rng, &sb);
        out[(*n_out)++] = id;
        if (on_token) on_token(id, ctx);
        if (gen_is_stop(o, id) || t + 1 == o->max_tokens) break;
        rc = gen_forward(g, &id, 1, logits, e);
    }
    gen_sample_buf_free(&sb);
    free(logits);
    return rc;
}

/* ------------------------------------------------------ inference model */

struct gen_model {
    lm_model m;
    gen_state g;
};

int gen_model_new(gen_model **out, const lm_config *cfg, int max_len, gen_load_fn load, void *ctx, ct_err *e) {
    *out = NULL;
    gen_model *gm = ct_calloc(1, sizeof *gm);
    /* B = T = 1 keeps the training activation plan tiny */
    int rc = lm_create(&gm->m, cfg, 1, 1, e);
    if (!rc) rc = kern_select(&gm->m.k, NULL, NULL, 0, e); /* the fastest kernels this CPU runs */
    if (!rc) {
        /* the gradient buffer is as large as the weights and inference never
         * touches it: release it and leave the gradient views NULL */
        free(gm->m.grads);
        gm->m.grads = NULL;
        gm->m.g.wte = gm->m.g.lnf = gm->m.g.lm_head = NULL;
        memset(gm->m.g.layer, 0, (size_t)cfg->n_layers * sizeof *gm->m.g.layer);
        rc = load(&gm->m, ctx, e);
    }
    if (!rc) rc = gen_init(&gm->g, &gm->m, max_len, e);
    if (rc) {
        gen_model_close(gm);
        return rc;
    }
    *out = gm;
    return 0;
}

void gen_model_close(gen_model *gm) {
    if (!gm) return;
    gen_free(&gm->g);
    lm_free(&gm->m);
    free(gm);
}

const lm_config *gen_model_config(const gen_model *gm) { return &gm->m.cfg; }
int gen_model_vocab(const gen_model *gm) { return gm->m.cfg.vocab_size; }
gen_state *gen_model_state(gen_model *gm) { return &gm->g; }
