/* model/moe.h: the sparse MoE block of Qwen3-MoE: router, routing metadata,
 * load-balancing loss; the experts themselves are the "moe_experts" kernel op.
 *
 * As transformers' Qwen3MoeSparseMoeBlock computes it: router logits
 * x Wr^T (no bias), softmax in fp32 over all E experts, the k largest
 * probabilities (ties: lower expert index first), renormalised to sum 1
 * when norm_topk_prob, and out = sum_j w_j expert_{i_j}(x). No shared
 * experts. The forward records the routing in a moe_route (probabilities,
 * choices, weights, and the expert-order permutation with per-expert
 * offsets); the backward reuses it and never routes again, and recomputation
 * under activation checkpointing reruns the same deterministic routing.
 * Gradients reach the router through the weights w_j (and, with the
 * auxiliary loss on, through the probabilities of every expert). */
#ifndef CT_MODEL_MOE_H
#define CT_MODEL_MOE_H

#include <stdint.h>

#include "kernels/registry.h"

/* One MoE layer's routing for N tokens (slot s = t * k + j is token t's j-th choice). */
typedef struct {
    float *probs;     /* [N, E] softmax of the router logits */
    float *topw;      /* [N*k] weight of each slot (renormalised if norm_topk_prob) */
    int32_t *topi;    /* [N*k] expert of each slot, by descending probability */
    int32_t *perm;    /* [N*k] slots in expert order, tokens ascending within an expert */
    int32_t *pos;     /* [N*k] inverse of perm: the row of slot s in expert order */
    int32_t *offsets; /* [E+1] expert e owns rows offsets[e] .. offsets[e+1] */
} moe_route;

/* Floats of the moe_route arrays for N tokens (int32 arrays counted as floats). */
size_t moe_route_floats(int N, int E, int k);
/* Points r's arrays into mem (moe_route_floats(N, E, k) floats). */
void moe_route_bind(moe_route *r, float *mem, int N, int E, int k);

/* How a router turns its logits into choices and weights. moe_route_fwd and
 * moe_route_bwd are {norm_topk_prob, 0, 1, 1, 1, 0}: a softmax, no groups, no scale, no floor.
 * GLM-4.5 (Glm4MoeTopkRouter): sigmoid scores s (fp32); the choice by s + bias,
 * limited to the experts of the topk_group groups (of n_group equal groups of
 * consecutive experts) whose two largest s + bias sum highest; the weights the
 * unbiased s of the chosen, renormalised to sum 1 (norm: over sum + 1e-20) and
 * times scale (routed_scaling_factor). */
#define MOE_MAX_GROUPS 64
typedef struct {
    int norm;              /* norm_topk_prob */
    int sigmoid;           /* scores sigmoid(logits), not softmax(logits) */
    int n_group, topk_group; /* 1 <= topk_group <= n_group <= MOE_MAX_GROUPS, n_group | E */
    float scale;           /* the weights' multiplier */
    float norm_min;        /* softmax with norm: weights / max(sum, norm_min) (ERNIE 4.5 MoE's moe_norm_min) */
} moe_router_opt;

/* Router forward: probs from x[N,H] and wr[E,H] (through k->matmul_fwd, or
 * k->matmul_fwd_wbf16 on wrh, wr's bf16 store when it is a frozen one: the
 * same bits; NULL: wr is fp32), top-k, weights, and the metadata (a stable
 * counting sort by expert). bias [E] (NULL: none) shifts only the choice of
 * experts (torchtitan's expert_bias): the weights stay the chosen experts'
 * probabilities. */
void moe_route_fwd(const kern_ops *kops, moe_route *r, const float *x, const float *wr, const uint16_t *wrh,
                   const float *bias, int N, int H, int E, int k, int norm_topk_prob);
/* The same with any router of moe_router_opt (r->probs then holds its scores: sigmoid or softmax). */
void moe_route_fwd_opt(const kern_ops *kops, moe_route *r, const float *x, const float *wr, const uint16_t *wrh,
                       const float *bias, int N, int H, int E, int k, const moe_router_opt *o);

/* Router backward: from dtopw[N*k] (d loss / d topw, the experts kernel's
 * output) and an optional per-expert term dprob_all[E] added to d probs of
 * every token (the load-balancing loss; NULL: none), accumulates dx[N,H]
 * and dwr[E,H]. dprobs [N, E] is scratch. wrh: as in moe_route_fwd; a
 * stored router is frozen, so dwr is then NULL and dx comes from
 * k->matmul_dinp_wbf16. */
void moe_route_bwd(const kern_ops *kops, float *dx, float *dwr, float *dprobs, const float *dtopw,
                   const float *dprob_all, const float *x, const float *wr, const uint16_t *wrh, const moe_route *r,
                   int N, int H, int E, int k, int norm_topk_prob);
/* The same with any router of moe_router_opt (dprob_all: d of its scores). */
void moe_route_bwd_opt(const kern_ops *kops, float *dx, float *dwr, float *dprobs, const float *dtopw,
                       const float *dprob_all, const float *x, const float *wr, const uint16_t *wrh,
                       const moe_route *r, int N, int H, int E, int k, const moe_router_opt *o);

/* Load-balancing statistics of one layer, accumulated over the MoE layers of
 * a forward: count[e] += tokens routed to e, psum[e] += sum over tokens of
 * probs[:, e]. k_probs > 0: count[e] counts the tokens whose k_probs largest
 * probabilities hold e instead (ERNIE 4.5 MoE: transformers' loss takes its own
 * top-k of the router logits, blind to the selection bias that chose the experts). */
void moe_route_stats(double *count, double *psum, const moe_route *r, int N, int E, int k_probs);

/* The fewest and the most tokens any of E experts got, from count[E] (the
 * logged per-layer load; counts summed over ranks stay whole numbers). */
void moe_load_range(const double *count, int E, int *lo, int *hi);

/* transformers' load_balancing_loss_func (no attention mask) from the sums of
 * moe_route_stats over n_layers layers of N tokens:
 *   aux = E * sum_e (count[e] / R) (psum[e] / R),  R = N * n_layers.
 * If dprob_all is non-NULL it receives d(scale * aux) / d probs[t, e] for every
 * layer and token: scale * E * count[e] / R^2 (the counts carry no gradient).
 * psum NULL: the gradient only (it needs the counts alone), returning 0. */
double moe_aux_loss(float *dprob_all, const double *count, const double *psum, int N, int n_layers, int E,
                    double scale);

/* torchtitan's aux-loss-free update of one layer's bias from its token counts
 * since the last update (then zeroed): bias += coeff * sign(mean - count),
 * re-centred to mean zero. */
void moe_update_bias(float *bias, double *tokens, int E, double coeff);

#endif
