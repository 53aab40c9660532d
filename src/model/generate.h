/* model/generate.h: text generation with a KV cache over a loaded model
 * (any family of model/lm.h).
 *
 * Training plans activations for B x T and saves everything backward needs;
 * generation needs none of that. A gen_state borrows the weights of a
 * lm_model (read-only, fp32) and owns only what inference needs: the
 * per-layer K/V cache for max_len positions, RoPE tables for those absolute
 * positions, and scratch for one chunk of rows. The prompt is prefilled a
 * chunk of rows at a time through the same matmuls as training (so a long
 * prompt costs GEMMs, not GEMVs); each new token is then one more row.
 *
 * Cached K is stored AFTER k_norm and RoPE at its absolute position, so a
 * decode step never touches old rows again; V is stored as projected.
 *
 * Sampling follows transformers' generate(): temperature, then top-k (ties
 * at the k-th value kept), then top-p (a token goes when the probability
 * mass of the tokens less likely than or as likely as it is <= 1 - top_p,
 * the most likely one always stays), then a draw from the renormalised
 * distribution. temperature 0 is greedy (first index of the maximum, as
 * torch.argmax). Draws come from core/rng.h, so a seed reproduces a run on
 * every machine; they are not torch's draws. */
#ifndef CT_MODEL_GENERATE_H
#define CT_MODEL_GENERATE_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "core/rng.h"
#include "model/lm.h"

typedef struct {
    const lm_model *m; /* weights only; m->acts/grads are never used */
    int max_len;          /* positions the cache holds */
    int pos;              /* positions filled so far */
    int chunk;            /* rows processed at once by gen_forward */
    int n_threads;        /* attention scratch rows */
    float *mem;           /* one allocation for everything below */
    float *k_cache;       /* [L, max_len, nKV, hd] after k_norm + RoPE */
    float *v_cache;       /* [L, max_len, nKV, hd] */
    float *rope_cos;      /* [max_len, hd/2] */
    float *rope_sin;      /* [max_len, hd/2] */
    float *rope_cos_l, *rope_sin_l; /* [max_len, hd/2] sliding layers' (== the above when they share) */
    float *y;             /* [chunk, H]   o_proj / down_proj output before a post-norm */
    float *norm_w;        /* [max(H, nH*hd)] 1 + w of a Gemma norm */
    float *x;             /* [chunk, H]   residual stream */
    float *xn;            /* [chunk, H]   normed input of a block */
    float *qraw;          /* [chunk, nH*hd] q_proj output */
    float *q;             /* [chunk, nH*hd] after q_norm + RoPE */
    float *kraw;          /* [chunk, nKV*hd] k_proj output (normed into the cache) */
    float *att;           /* [chunk, nH*hd] attention output */
    float *gate;          /* [chunk, I] */
    float *up;            /* [chunk, I] */
    float *h;             /* [chunk, I] act(gate) * up */
    float *rstd;          /* [chunk * max(nH, 1)] rmsnorm scratch */
    float *scores;        /* [n_threads, max_len] attention row per thread (decode) */
    float *kh;            /* [max_len, hd] one kv head's cached K (prefill) */
    float *vht;           /* [hd, max_len] its cached V, transposed (prefill) */
    float *qh;            /* [chunk, hd] one query head (prefill) */
    float *oh;            /* [chunk, hd] its attention output (prefill) */
    float *probs;         /* [chunk, max_len] its attention probabilities (prefill) */
    /* MoE layers: gate/up/h above hold [chunk * k, Im] rows in expert order */
    moe_route route;      /* the chunk's routing (one layer at a time) */
    float *moe_work;      /* [KERN_MOE_WORK(chunk * k, H, Im)] */
    float *lora_u;        /* [chunk, r] LoRA: scale A x of one projection (adapters unmerged) */
} gen_state;

/* Sizes the cache for max_len positions (prompt + new tokens). The model must
 * outlive the state. Fails (CT_ERR_CONFIG) on max_len < 1. */
int gen_init(gen_state *g, const lm_model *m, int max_len, ct_err *e);
void gen_free(gen_state *g);
/* Forgets the cached positions (a new sequence). */
void gen_reset(gen_state *g);

/* Runs tokens[n] at positions g->pos .. g->pos+n-1, appending their K/V to
 * the cache, and writes the logits of the LAST of them to logits[V] (may be
 * NULL). Fails on a token outside [0, V) or when the cache would overflow. */
int gen_forward(gen_state *g, const int32_t *tokens, int n, float *logits, ct_err *e);

typedef struct {
    float temperature; /* 0: greedy */
    int top_k;         /* 0: off */
    float top_p;       /* 1: off; in (0, 1] */
} gen_sampler;

/* A sampling candidate: scaled logit and id. */
typedef struct {
    float v;
    int32_t id;
} gen_cand;

/* Scratch for gen_sample over a vocabulary of V ids (no allocation per token). */
typedef struct {
    int V;
    gen_cand *cand; /* [V] candidates, most likely first once sorted */
    float *prob;    /* [V] their unnormalised probabilities; also top-k scratch */
} gen_sample_buf;

void gen_sample_buf_init(gen_sample_buf *b, int V);
void gen_sample_buf_free(gen_sample_buf *b);
/* Picks the next id from logits[V] (not modified). Greedy uses no draw. */
int32_t gen_sample(const float *logits, const gen_sampler *s, ct_rng *rng, gen_sample_buf *b);

typedef struct {
    int max_tokens;          /* new tokens at most */
    gen_sampler sampler;
    uint64_t seed;
    const int32_t *stop_ids; /* [n_stop]: generation ends after emitting one */
    int n_stop;
} gen_opts;

/* Called with every generated id as soon as it is chosen (streaming). */
typedef void (*gen_token_fn)(int32_t id, void *ctx);

/* Resets the state, prefills prompt[n_prompt], then samples up to
 * o->max_tokens ids into out[] (room for o->max_tokens). A stop id is
 * emitted and ends the run, as in transformers (its output keeps the EOS).
 * *n_out gets the number of ids written. The state must hold
 * n_prompt + max_tokens - 1 positions (the last token is never fed back). */
int gen_generate(gen_state *g, const int32_t *prompt, int n_prompt, const gen_opts *o, int32_t *out, int *n_out,
                 gen_token_fn on_token, void *ctx, ct_err *e);

/* A model loaded for inference only, with its state: what the CLI and
 * bindings (the tests drive it through ctypes) use. The weights stay fp32 and
 * no gradient or training activation memory is kept. Generation reads no
 * file: gen_model_new builds the model for cfg and has load fill its weights
 * (the checkpoint side supplies it: checkpoint/hf.h hf_gen_open reads a
 * Hugging Face directory, with a PEFT adapter or without). */
typedef struct gen_model gen_model;

/* Fills m's weights (m->params; its gradients are NULL); 0 or the error's code. */
typedef int (*gen_load_fn)(lm_model *m, void *ctx, ct_err *e);
int gen_model_new(gen_model **out, const lm_config *cfg, int max_len, gen_load_fn load, void *ctx, ct_err *e);
void gen_model_close(gen_model *gm);
const lm_config *gen_model_config(const gen_model *gm);
int gen_model_vocab(const gen_model *gm);
gen_state *gen_model_state(gen_model *gm);

#endif
