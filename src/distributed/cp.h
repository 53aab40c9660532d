/* distributed/cp.h: context parallel (parallelism.context_parallel_degree).
 *
 * The cp ranks of a group read the same windows (they share a data-parallel
 * rank, distributed/mesh.h) and rank c keeps chunk c of each: the T/cp
 * consecutive positions c T/cp .. (c+1) T/cp - 1 of every sequence, tokens
 * and labels. The ranks of a group hold the same model (the whole one, or
 * under TP, EP and PP the same slice and stage: mesh.h builds the group from
 * ranks of one tp index, and EP groups from ranks of one cp index); the model
 * runs on its chunk as on a shorter sequence, except in two places:
 *   - RoPE: the model's cos/sin tables are rebuilt for the chunk's global
 *     positions (as transformers computes them for the whole forward);
 *   - attention, the one op that mixes positions (lm_attn_dispatch): rank c
 *     all-gathers k and v (its own heads' under TP), lays out a causal
 *     problem of T' = (c+1) T/cp rows whose first c T/cp query rows are zeros
 *     and whose last T/cp are its own queries, runs the model's own attention
 *     kernels on it and keeps its rows. Positions in that problem are the
 *     global ones, so the causal mask, sliding windows and soft caps come out
 *     as on one process. The backward rebuilds the problem (k and v gathered
 *     again) with d(out) zero on the dummy rows, which then contribute
 *     nothing; d k, d v of the prefix are reduce-scattered (summed) onto the
 *     chunks' owners.
 * The dummy rows are wasted work: the last rank runs a whole T attention, so
 * attention does not shrink with cp (the other activations do, by cp).
 * Gradients of the replicated model (under TP: of the slice, sliced and
 * replicated tensors alike) are summed over the group (plan.c), as over
 * data-parallel replicas (with frozen tensors: the trained runs, LoRA
 * adapters included), and so are the CE sums and the MoE counts. LoRA
 * dropout masks are drawn for the chunk's global rows (lm_model.cp_T). */
#ifndef CT_DISTRIBUTED_CP_H
#define CT_DISTRIBUTED_CP_H

#include <stdint.h>

#include "distributed/comm.h"
#include "model/lm.h"

typedef struct {
    lm_model *m;
    ct_comm *c;      /* the chunks of one sequence (mesh.cpg) */
    int n, rank;     /* degree and this rank's chunk */
    int B, T, Tl;    /* most sequences of a forward; whole sequence; chunk (T / n) */
    /* the padded problem and its gradients, for at most B x T rows */
    float *kg, *vg;  /* [n][B, Tl, kvd] what the all-gather brings; the backward's send buffers */
    float *kp, *vp;  /* [B, T', kvd] */
    float *qp, *op, *dqp, *dop; /* [B, T', qd] */
    float *dkp, *dvp; /* [B, T', kvd] */
    float *lp;       /* [B, nh, T'] */
    int32_t *tok, *lab; /* [n_seq, Tl] the chunks being run */
    double comm_s;   /* seconds in collectives since cp_take_comm_time */
    lm_attn_dispatch d;
} cp_layout;

/* Binds the model (planned for B x T / n, no other layout hooking its
 * attention): its RoPE tables for this chunk's positions, its attention
 * dispatch, the scratch. T: the whole sequence (n divides it). n_seq: the
 * most sequences cp_chunk takes at once (B, or a pipeline's whole step). */
void cp_init(cp_layout *cp, lm_model *m, ct_comm *c, int B, int T, int n_seq);
void cp_free(cp_layout *cp);
/* cp->tok, cp->lab [B, Tl] = this rank's chunk of tokens, labels [B, T]
 * (B <= n_seq). */
void cp_chunk(cp_layout *cp, const int32_t *tokens, const int32_t *labels, int B);
/* After a forward of B sequences: the MoE routing sums over the group, and
 * m->moe.aux_loss recomputed from them (HF's loss of the whole sequences;
 * logged only: cp refuses it in the gradient). */
void cp_moe_aux(cp_layout *cp, int B);
double cp_take_comm_time(cp_layout *cp);

#endif
