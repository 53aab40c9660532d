/* model/generate.h: text generation with a KV cache over a loaded model
 * (any family of model/lm.h).
 *
 * Training plans activations for B x T and saves everything backward needs;
 * generation needs none of that. A gen_state borrows the weights of a
 * lm_model and owns only what inference needs: the per-layer K/V cache for
 * max_len positions and scratch for one chunk of rows (lm_kv, model/lm.h).
 * The layers run through the training forward itself (lm_kv_forward), so a
 * long prompt is prefilled a chunk of rows at a time with GEMMs, not GEMVs;
 * each new token is then one more row.
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
    const lm_model *m; /* weights only; m->act.layer/grads are never used */
    int max_len;          /* positions the cache holds */
    int pos;              /* positions filled so far */
    int chunk;            /* rows processed at once by gen_forward */
    float *mem;           /* one allocation for the cache and its scratch */
    lm_kv kv;             /* the K/V cache and one chunk's scratch, laid out by model/lm.c */
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
