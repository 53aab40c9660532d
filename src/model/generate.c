/* model/generate.c: KV-cache generation and sampling for every family of
 * model/lm.h (see generate.h).
 *
 * What this file owns: the cache's allocation (gen_init / gen_free; its
 * layout is lm_kv_layout's), splitting a prompt into chunks of rows and
 * checking what is fed, sampling, the prompt / decode loop of gen_generate,
 * and the inference-only model of the CLI and bindings (gen_model_*).
 *
 * The layer math is model/lm.c's: lm_kv_forward runs the training forward's
 * own layer (layer_forward) over the rows fed, with each layer's K and V
 * written into the cache at their absolute positions and attention read
 * from the cache, then the final norm and lm_head on the last row only. One
 * forward serves training, validation and generation. */
#include "model/generate.h"
#include "model/lora.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "core/device.h"
#include "kernels/ops.h"

/* Rows prefilled at once: large enough for GEMM efficiency, small enough that
 * the scratch stays a few MB for published sizes (I = 3072..25600). */
#define GEN_CHUNK 64

int gen_init(gen_state *g, const lm_model *m, int max_len, ct_err *e) {
    memset(g, 0, sizeof *g);
    if (max_len < 1) return ct_fail(e, CT_ERR_CONFIG, "generate: the KV cache needs at least 1 position, got %d", max_len);
    g->m = m;
    g->max_len = max_len;
    g->chunk = max_len < GEN_CHUNK ? max_len : GEN_CHUNK;
    int n_threads = omp_get_max_threads();
    if (n_threads < 1) n_threads = 1;
    size_t n = lm_kv_layout(&g->kv, &m->cfg, max_len, g->chunk, n_threads, NULL);
    g->mem = ct_malloc(n * sizeof(float));
    lm_kv_layout(&g->kv, &m->cfg, max_len, g->chunk, n_threads, g->mem);
    return 0;
}

void gen_free(gen_state *g) {
    free(g->mem);
    memset(g, 0, sizeof *g);
}

void gen_reset(gen_state *g) { g->pos = 0; }

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
    /* The forward writes the model's small scratch (a Gemma norm's 1 + w, a
     * bf16-stored lm_head's block of logits), never its weights: the state
     * borrows the model read-only in every other sense. */
    lm_model *m = (lm_model *)g->m;
    for (int done = 0; done < n;) {
        int k = n - done < g->chunk ? n - done : g->chunk;
        lm_kv_forward(m, &g->kv, tokens + done, g->pos, k, done + k == n ? logits : NULL);
        g->pos += k;
        done += k;
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
        /* NaN logits make every comparison false, so sampling would pick token 0 forever
         * and exit 0: stop instead, saying where */
        for (int i = 0; i < V && !rc; i++)
            if (!isfinite(logits[i]))
                rc = ct_fail(e, CT_ERR_IO,
                             "generate: non-finite logits (%g for token %d) at position %d: the weights overflow fp32",
                             (double)logits[i], i, n_prompt + t - 1);
        if (rc) break;
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
        gm->m.dev->free(gm->m.grads, gm->m.n_params * sizeof(float), gm->m.cfg.lazy_buffers); /* the device's */
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
