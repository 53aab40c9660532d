/* distributed/cp.h: context parallel (parallelism.context_parallel_degree).
 *
 * The cp ranks of a group read the same windows (they share a data-parallel
 * rank, distributed/mesh.h) and each keeps its chunk of every sequence, tokens
 * and labels: T/cp positions, laid out as parallelism.context_parallel_load_balancer
 * says (PyTorch's context parallel and torchtitan, whose default is headtail):
 *   - headtail (the default): the sequence cut into 2 cp pieces of T/(2 cp),
 *     rank c holding pieces c and 2cp-1-c (in that order): causal attention
 *     costs every rank the same (PyTorch's _HeadTailLoadBalancer);
 *   - none: rank c holds the T/cp consecutive positions c T/cp .. (c+1) T/cp - 1.
 * The ranks of a group hold the same model (the whole one, or under TP, EP and
 * PP the same slice and stage: mesh.h builds the group from ranks of one tp
 * index, and EP groups from ranks of one cp index); the model runs on its chunk
 * as on a shorter sequence, except in two places:
 *   - RoPE: the model's cos/sin tables are rebuilt for the chunk's global
 *     positions, piece by piece (as transformers computes them for the whole
 *     forward);
 *   - attention, the one op that mixes positions (lm_attn_dispatch): rank c
 *     all-gathers k and v (its own heads' under TP) and runs each of its
 *     pieces with the attention op's offset form (kernels/ops.h,
 *     op_attention_fwd_q0: the piece's query rows at their global positions
 *     against the keys of every position up to the piece's end), so the causal
 *     mask, sliding windows and soft caps come out as on one process. The
 *     backward gathers k and v again, and each piece's d k, d v (of its whole
 *     prefix) are summed into the owners' blocks and reduce-scattered onto the
 *     chunks' owners. That is parallelism.context_parallel_rotate_method =
 *     "allgather" (torchtitan's default). With "alltoall" (PyTorch's
 *     _AllToAllRotater) attention is a ring instead: each rank keeps its own
 *     k, v, and in step s of n it holds rank (c - s) mod n's chunk, adds each
 *     of its pieces into those of its own pieces it does not lie in the future
 *     of (the attention op's block form, kernels/ops.h op_attention_fwd_blk:
 *     online softmax, finished after the last step) and passes it on to rank
 *     c + 1 while the next arrives from c - 1. The backward sends the chunks
 *     round again with their dk, dv accumulators, which the last hop hands to
 *     their owner. No rank ever holds more than two chunks of k, v, dk, dv
 *     (8 B T/n kv-width floats of scratch, against the gather's 6 B T).
 * Attention work: a piece at position p of length L costs ~ L (p + L/2) key
 * rows; under headtail the two pieces of every rank add up to the same, T^2 /
 * (2 cp) each (a whole sequence's T^2 / 2 over cp ranks), under none rank
 * cp-1's chunk costs 2 - 1/cp times that mean. The other activations shrink by cp.
 * Gradients of the replicated model (under TP: of the slice, sliced and
 * replicated tensors alike) are summed over the group (plan.c), as over
 * data-parallel replicas (with frozen tensors: the trained runs, LoRA
 * adapters included), and so are the CE sums and the MoE counts: per token,
 * whichever positions a rank holds. LoRA dropout masks are drawn for the
 * chunk's global rows (lm_model.cp_T, cp_p0, cp_p1). */
#ifndef CT_DISTRIBUTED_CP_H
#define CT_DISTRIBUTED_CP_H

#include <stdint.h>
#include <stdio.h>

#include "distributed/comm.h"
#include "model/lm.h"

typedef struct {
    lm_model *m;
    ct_comm *c;      /* the chunks of one sequence (mesh.cpg) */
    int n, rank;     /* degree and this rank's chunk */
    int B, T, Tl;    /* most sequences of a forward; whole sequence now (cp_set_len); chunk (T / n) */
    int np, L;       /* pieces per chunk (headtail 2, none 1) and positions per piece (Tl / np) */
    /* a piece's attention problem, for at most B sequences of T keys */
    float *kg, *vg;  /* [n][B, Tl, kvd] what the all-gather brings; the backward's send buffers */
    float *kp, *vp;  /* [B, Tk, kvd] the keys of the positions up to the piece's end (Tk <= T) */
    float *dkp, *dvp; /* [B, Tk, kvd] */
    float *qp, *op, *dqp, *dop; /* [B, L, qd] the piece's query rows (headtail; none runs the chunk's own) */
    float *lp;       /* [B, nh, L] */
    /* the ring (parallelism.context_parallel_rotate_method = "alltoall"): no kg .. lp above */
    int ring;
    float *rb[2];    /* [4][B, Tl, kvd] each: k, v, dk, dv of the block arriving from the previous rank */
    float *rl;       /* [B, nh, Tl] the forward's running sums l, the backward's D = rowsum(dout * out) */
    double *loads;   /* [L, E] MoE models: moe.tokens before a forward (cp_moe_forward_backward) */
    int32_t *tok, *lab; /* [n_seq, Tl] the chunks being run */
    double comm_s;   /* seconds in collectives since cp_take_comm_time */
    lm_attn_dispatch d;
} cp_layout;

/* Binds the model (planned for B x T / n, no other layout hooking its
 * attention): its RoPE tables for this chunk's positions, its attention
 * dispatch, the scratch. T: the whole sequence (n divides it; 2 n with
 * headtail, which config.c checks), the longest the run has (training's or
 * validation's windows: the scratch holds B x T rows); the layout starts at
 * that length. n_seq: the most sequences of T cp_chunk takes at once (B, or a
 * pipeline's whole step). headtail: 1 for the load-balanced layout, 0 for
 * consecutive chunks (parallelism.context_parallel_load_balancer). */
void cp_init(cp_layout *cp, lm_model *m, ct_comm *c, int B, int T, int n_seq, int headtail, int ring);
/* The whole sequences' length from now on (training's or validation's windows,
 * at most cp_init's T and its rows): the chunk, the pieces and their RoPE
 * tables. Nothing is done when T is the current length. */
void cp_set_len(cp_layout *cp, int T);
/* The floats of attention scratch cp_init allocates for B sequences of T positions on n
 * ranks, nh query and nkv kv heads of hd (a TP slice's heads): the gather path's
 * 6 B T kvd (+ a piece's q rows under headtail, 4 B T/(2n) q-width, and its lse) or the
 * ring's 8 B T/n kvd + B nh T/n. The dry run reports it (plan_dry.c). */
double cp_scratch_floats(int B, int T, int n, int headtail, int ring, int nh, int nkv, int hd);
void cp_free(cp_layout *cp);
/* cp->tok, cp->lab [B, Tl] = this rank's chunk of tokens, labels [B, T]
 * (B <= n_seq). */
void cp_chunk(cp_layout *cp, const int32_t *tokens, const int32_t *labels, int B);
/* One training forward and backward of a MoE model on this rank's chunk of
 * B sequences (tokens, labels [B, T]); returns the chunk's CE sum. Between the
 * two, the routing sums of every MoE layer are summed over the group, so that
 * m->moe.aux_loss is HF's loss of the whole sequences and, with
 * output_router_logits, every rank's routers get that loss's gradient for
 * their own tokens (lm_stage_aux_grad with all B T tokens: counted once, as
 * the group's gradients are summed); and moe.load_min/max are the whole
 * sequences' loads. */
double cp_moe_forward_backward(cp_layout *cp, const int32_t *tokens, const int32_t *labels, int B, float scale);
double cp_take_comm_time(cp_layout *cp);
/* The start-up log line: the layout and what each rank runs. */
void cp_describe(const cp_layout *cp, FILE *f);

#endif
