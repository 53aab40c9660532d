/* distributed/tp.h: tensor parallelism (torchtitan's Qwen3 plan, dense and MoE).
 *
 * The model's math stays in model/lm.c, run on a LOCAL config: n_heads,
 * n_kv_heads, intermediate and the vocab_rows of the embedding and lm_head
 * divided by the degree t. This file decides
 * which slice of each whole tensor a rank holds and when a collective runs:
 *   - column-parallel q/k/v_proj and gate/up_proj: rank r holds rows
 *     [r * n / t, (r + 1) * n / t) (its heads, kv heads, intermediate slice);
 *     Phi3's fused qkv_proj and gate_up_proj are sliced block by block
 *     (tp_row_blocks), so the local one is [q_r; k_r; v_r] / [gate_r; up_r];
 *   - row-parallel o_proj and down_proj: the matching columns; their outputs
 *     are partial sums, all-reduced over the group (hooks.reduce_partial)
 *     before the residual is added once;
 *   - the backward of a column-parallel layer all-reduces d(its input), so
 *     the replicated RMSNorm weights get the same gradient on every rank,
 *     and every rank has the whole d(embedding output);
 *   - MoE layers: the router is replicated (every rank routes the same
 *     replicated ln2 identically); each expert is split like the dense MLP,
 *     gate/up rows and down columns of moe_intermediate, so the experts'
 *     output, d(ln2) and d(routing weights) are partial sums, all-reduced
 *     before the residual add and before the router's backward. Under EP
 *     too, a rank's tp slice of its experts serves its EP group's rows
 *     (etp = tp in torchtitan's terms);
 *   - the per-head q/k norm weights [hd] see only this rank's heads: their
 *     gradient of each layer's backward is all-reduced (post_backward);
 *   - LoRA adapters follow their base projection: a column-parallel one's
 *     B [out, r] is sliced by rows like W (a fused module's by its row
 *     blocks), its A [r, in] replicated, A's gradient a partial sum
 *     all-reduced like the q/k norms'; a row-parallel one's A by columns
 *     like W and its B replicated: u = scale A x is summed over the group
 *     before B (model/lm.c), so B's gradient is the same on every rank and
 *     A's and d(x)'s are local. Dropout masks index the whole input;
 *   - the fused experts' adapters (A [r E, in], B [out, r E]) are cut with
 *     their experts along moe_intermediate: gate_up_proj's B by rows (gate's
 *     then up's), its A replicated with a partial-sum gradient; down_proj's
 *     A by columns, its B replicated with a partial-sum gradient (both
 *     all-reduced like the q/k norms'). The router's adapter is replicated
 *     and gets the whole gradient on every rank, as the router does;
 *   - the embedding and lm_head (tied or not) are vocabulary-parallel: rank r
 *     holds rows [r C, min((r + 1) C, V)) of each, C = ceil(V / t)
 *     (torchtitan's RowwiseParallel embedding, a DTensor Shard(0): where t
 *     does not divide V the last ranks' blocks are shorter or empty,
 *     tp_chunk). The lookup gives this rank's tokens their rows and the
 *     others zeros, summed over the group (hooks.reduce_partial); its
 *     backward adds the whole d(output) rows of this rank's tokens to its
 *     rows. The head computes its logits only; the loss combines the row
 *     max, sum of exponentials and target logit over the group
 *     (hooks.reduce_max, reduce_partial) and d(final norm) is all-reduced.
 *     An empty block's row max is -inf and its sums 0, so it takes part in
 *     every collective without changing them; all ranks cut their logits
 *     into the same blocks of rows (lm_logit_rows, by the largest block);
 *   - sequence parallel (parallelism.sequence_parallel, local.tp_seq;
 *     torchtitan's SequenceParallel on the norms): rank r holds rows
 *     [r R, min((r + 1) R, B T)) of the B T rows (R = ceil(B T / t), DTensor
 *     Shard's chunks: the last ranks' shorter or empty, padded to R rows in
 *     the collectives) of the residual stream,
 *     the norms' inputs, outputs and saved statistics. Where the above
 *     all-reduces a row-parallel output (o_proj, down_proj, the experts', the
 *     embedding's partial lookup, d of the head's input) it reduce-scatters
 *     to those rows; a column-parallel block's input (q/k/v, gate/up, the
 *     router and experts, the head) is all-gathered first, and again in the
 *     backward, where d(output) of a row-parallel block is all-gathered and
 *     d(input) of a column-parallel one reduce-scattered. Each norm weight's
 *     gradient then comes from this rank's rows: a layer's norms' partial
 *     sums wait in one buffer (lm_norm_partials) and go through the group in
 *     the layer's post-backward all-reduce beside the q/k norms' and LoRA
 *     A's; the final norm's in one of its own. A pipeline stage's messages
 *     hold all rows (gathered at the boundary), so pp.c is unaware of it.
 * Which kind a tensor is follows from its shapes alone (local vs whole): a
 * smaller first dimension is a row slice, a smaller second one a column
 * slice, equal shapes replicated. The hooks wrap FSDP's (inner) when both
 * layouts run, so FSDP shards the local flat buffer within a TP index.
 *
 * Expert parallel storage uses the same slicing: under
 * expert_parallel_degree ep the local config also holds only experts
 * [ep_rank E/ep, (ep_rank + 1) E/ep) (lm_config.expert_rows); the other
 * experts' tensors have no elements. The experts' adapters hold those
 * experts' rows of A and columns of B: A [r El, in] and B [out, r El], B's
 * column j El + (e - expert0) being the whole one's j E + e. So this layout
 * exists whenever t > 1 or ep > 1; its hooks are installed only for t > 1. */
#ifndef CT_DISTRIBUTED_TP_H
#define CT_DISTRIBUTED_TP_H

#include <stddef.h>

#include "config/config.h"
#include "core/err.h"
#include "distributed/comm.h"
#include "model/lm.h"

typedef struct {
    int t, rank;              /* degree, and this rank's index in the group */
    int ep, ep_rank;          /* expert parallel degree and index (1, 0: every expert here) */
    ct_comm *comm;            /* the tensor-parallel group */
    lm_config full;        /* the whole model */
    lm_config local;       /* the slice this rank runs */
    lm_model *m;           /* the local model, once attached */
    const lm_hooks *inner; /* hooks installed before (FSDP's), called inside ours; NULL: none */
    lm_hooks hooks;
    lm_seq_dispatch sp;       /* sequence parallel's collectives (local.tp_seq) */
    char *sharded;            /* [n_tensors] 1: sliced over the group, 0: replicated (set by tp_classify) */
    char *expert;             /* [n_tensors] 1: an expert's tensor or its adapter (held by one EP rank) */
    lm_model *ep_tables;   /* [n_tables] tensor table of each member of tp_gather_range's group (its
                               * TP index's vocabulary block, its EP index's experts), built on
                               * the first call that needs them */
    int n_tables;
    size_t n_before;          /* the most floats of one layer's partial-sum replicated gradients */
    float *before;            /* [2 n_before] those gradients before a layer's backward; their deltas */
    double comm_s;            /* seconds in collectives since the last tp_take_comm_time */
} tp_layout;

/* local = full with n_heads, n_kv_heads, intermediate, moe_intermediate
 * divided by t and rank's block of the vocabulary rows (the embedding's and
 * lm_head's: tp_chunk's, for any t > 1); with ep > 1, only EP index ep_rank's
 * experts (the caller checked divisibility: mesh_resolve). */
void tp_local_config(lm_config *local, const lm_config *full, int t, int rank, int ep, int ep_rank);
/* DTensor Shard(0)'s chunk r of n rows over t ranks (torch.chunk): rows
 * [*start, *start + returned) with chunks of ceil(n / t), the last ranks'
 * shorter or empty. */
size_t tp_chunk(size_t n, int t, int r, size_t *start);
void tp_init(tp_layout *p, const lm_config *full, ct_comm *group, int ep, int ep_rank);
void tp_free(tp_layout *p);
/* Binds the local model m; for t > 1 installs the hooks on m (wrapping
 * whatever m->hooks holds now). */
void tp_attach(tp_layout *p, lm_model *m);
/* Learns, once, which tensors of the local table lm are sliced (against the
 * whole table fm) and which are experts' (for tp_sq_range). */
void tp_classify(tp_layout *p, const lm_model *lm, const lm_model *fm);
/* Row blocks of whole tensor ft that are sliced each on their own (Phi3's
 * fused qkv_proj: q, k, v; gate_up_proj: gate, up; else the whole tensor):
 * fb[] their row counts; returns how many (1..3). */
int tp_row_blocks(const tp_layout *p, const lm_tensor *ft, size_t fb[3]);
/* Rows [r0, r1) of whole tensor ft (rows[(r1 - r0) x its columns]) -> this
 * rank's part of them inside row block blk (0 .. tp_row_blocks - 1; a fused
 * tensor's slice is one run of rows per block): returns how many rows of the
 * local tensor lt they give (0: none, e.g. another EP rank's expert), from
 * local row *la, at *out (inside rows, or in tmp[(r1 - r0) x lt's columns]
 * for a column slice). */
size_t tp_take_rows(const tp_layout *p, const lm_tensor *lt, const lm_tensor *ft, int blk, size_t r0, size_t r1,
                    const float *rows, float *tmp, const float **out, size_t *la);
/* Collective over `g`, the ranks whose slices make up the whole model:
 * g's rank r is TP index r % t and EP index r / t (the TP group of the
 * first data-parallel rank, times the first EP group). Tensors [ta, tb) of
 * the table (the same indices in every member's table and fm's): local
 * holds this member's floats of those tensors (from its tensor ta's
 * offset); full on g's rank 0 receives the whole tensors (from fm's tensor
 * ta's offset; fm and full NULL elsewhere). A streamed checkpoint save
 * moves one layer at a time this way. */
void tp_gather_range(tp_layout *p, ct_comm *g, int ta, int tb, const lm_model *fm, float *full,
                     const lm_model *lm, const float *local);
enum { TP_SQ_ALL, TP_SQ_DENSE, TP_SQ_EXPERTS };
/* Sum of x[k]^2 over flat positions [lo, lo + n) of the local buffer, of
 * every tensor, or only the non-expert or the expert ones (`which`),
 * counting replicated tensors on group rank 0 only, so the sum over the
 * TP group is the whole model's (over the EP group too, for the experts). */
double tp_sq_range(const tp_layout *p, const float *x, size_t lo, size_t n, int which);
double tp_take_comm_time(tp_layout *p);

#endif
