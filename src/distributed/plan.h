/* distributed/plan.h: the parallel plan: the one object the trainer asks
 * for everything that depends on the layout.
 *
 * torchtitan applies `parallelize_<model>(model, mesh, config)` once and a
 * pipeline schedule owns the step; here a plan built from the mesh and the
 * model does both. It answers where each tensor's bytes live (which layers
 * this rank holds, its slice of each, its shard), runs a step's micro-batches
 * (the accumulation loop, or the pipeline schedule), reduces and clips the
 * gradients, steps AdamW on the local slices, says which buffer a checkpoint
 * range is read into and gathers what a save writes. The trainer and the
 * model name no layout: they call plan_* only.
 *
 * The layouts compose in one stated order, outermost first:
 *   1. pipeline (distributed/pp.h): the layers split into stages, one per
 *      rank of a pipeline group;
 *   2. tensor and expert parallel (tp.h, ep.h): each stage's heads, MLP
 *      columns, vocabulary rows and experts sliced over its TP / EP group;
 *   3. FSDP (fsdp.h): the slice's flat buffers sharded over the shard group;
 *   4. data parallel replicas: gradients summed over the replicate group
 *      (HSDP with 3, or an overlapped per-layer all-reduce without it);
 *   5. context parallel (cp.h, alone or with any of 1-4): the model runs on a
 *      chunk of each sequence; gradients, CE sums and counts are summed over
 *      the chunks' ranks after the others' reductions.
 * The model sees one set of per-layer hooks, composed here: a layer's
 * pre-forward and pre-backward run the outer layout's hook before the
 * inner's (FSDP gathers the parameters and zeroes the gradients before TP
 * records what its q/k norms hold), the post hooks the inner's first (TP
 * sums its partial gradients before FSDP reduce-scatters them). */
#ifndef CT_DISTRIBUTED_PLAN_H
#define CT_DISTRIBUTED_PLAN_H

#include <stdint.h>
#include <stdio.h>

#include "config/config.h"
#include "core/err.h"
#include "distributed/comm.h"
#include "distributed/cp.h"
#include "distributed/ep.h"
#include "distributed/fsdp.h"
#include "distributed/mesh.h"
#include "distributed/pp.h"
#include "distributed/tp.h"
#include "model/lm.h"
#include "optim/optim.h"

struct plan_dpo;

typedef struct {
    ct_mesh mesh;
    const ct_config *cfg;
    lm_config whole;     /* the whole model: no stage, slice or expert subset (loading, checkpoints) */
    pp_sched *pp;        /* NULL unless pipeline_parallel_degree > 1 */
    tp_layout *tp;       /* NULL unless tensor or expert parallel: the model is this rank's slice */
    ep_layout *ep;       /* NULL unless expert_parallel_degree > 1 */
    fsdp *fsdp;          /* NULL unless data_parallel_shard_degree > 1 */
    cp_layout *cp;       /* NULL unless context_parallel_degree > 1: the model runs on a chunk of each sequence */
    struct plan_dpo *dpo; /* NULL unless replicas without FSDP: per-layer all-reduce during the backward */
    ct_comm tie;         /* pipeline with tied embeddings: the first and last stages of this place */
    int grad_accum;      /* micro-batches of local_batch_size per step (without a pipeline) */
    lm_model *m;         /* this rank's model (plan_attach) */
    adamw_state *opt;    /* its AdamW state: the whole local buffer or the FSDP shard's */
    lm_hooks hooks;      /* the composed per-layer hooks the model calls */
    const lm_hooks *hk[2]; /* outer (FSDP or the replicas'), inner (tensor parallel) */
    int n_hk;
    double comm_s;       /* seconds in collectives since plan_take_comm_time */
    long overlapped;     /* gradient reductions started before the backward ended, since the last take */
    struct plan_range { size_t off, n; } *opt_ranges; /* trained runs of the stepped buffer; n_opt_ranges -1: all */
    int n_opt_ranges;
    struct {             /* while the weights load (plan_load_begin .. plan_load_end) */
        lm_model table;  /* the whole model's tensor table, when this rank holds part of it */
        const lm_model *whole;
        float *tmp;      /* [largest column-sliced local tensor] a slice being taken */
        lm_sink sink;
    } load;
} ct_plan;

/* The mesh over the world ([parallelism] checked against the model before
 * anything is built: CT_ERR_CONFIG naming the key). */
int plan_init(ct_plan *p, ct_comm *world, const ct_config *c, const lm_config *mc, const char *where, ct_err *e);
/* The batch sizes a pipeline's micro-batches must divide (the run and the
 * dry run check alike). */
int plan_check_pipeline(const ct_config *c, int val_batch, const char *where, ct_err *e);
/* This rank's model config: mc in, the whole model; out, its stages' layers
 * and its slice. grad_accum: micro-batches of local_batch_size per step;
 * *batch in, the sequences the model plans for; out, a pipeline's micro-batch. */
int plan_local_model(ct_plan *p, lm_config *mc, int grad_accum, int val_batch, int *batch, const char *where,
                     ct_err *e);
/* Positions of a sequence the model runs at once: training.seq_len, or its
 * chunk under context parallel (the length to plan the model for). */
int plan_seq_len(const ct_plan *p);
/* The forward the model is planned for (lm_create_ac, the dry run, the memory snapshot):
 * *T the longer of training's and validation's sequences (training.seq_len,
 * cfg_val_seq_len; their chunks under context parallel of degree cp), *B enough of
 * them for the larger of training's and validation's rows (local_batch_size and
 * validation's batch, or a pipeline's micro-batch for both), so a validation shorter
 * than training's adds no memory. */
void plan_model_shape(const ct_config *c, int pipeline, int cp, int *B, int *T);
/* The model and its optimizer state, before any weight loads: FSDP's shard
 * buffers (opt is re-made for the shard) and the pipeline's buffers. */
int plan_attach(ct_plan *p, lm_model *m, adamw_state *opt, ct_err *e);
/* Where the loaders put the whole model's tensors (lm_sink): this rank's
 * stages, slice and shard of each, parameters or moments. *whole: the whole
 * model's table they walk. plan_load_end frees what loading needed. */
lm_sink plan_load_begin(ct_plan *p, const lm_model **whole);
void plan_load_end(ct_plan *p);
/* Between plan_load_begin and plan_load_end: the rows of the whole model's
 * tensor i (its loaders' table) whose values this rank keeps as `kind`
 * (its stages, TP/EP part, FSDP shard), as ascending runs add(acc, r0, r1):
 * a loader that can seek reads only these (checkpoint/ckpt.h,
 * ckpt_load_part). Whole rows: a run may hold values the sink then drops,
 * never lack one it keeps. */
void plan_load_rows(const ct_plan *p, int kind, int i, void (*add)(void *acc, size_t r0, size_t r1), void *acc);
/* Between plan_load_begin and plan_load_end: the columns [c0, c1) of every
 * row plan_load_rows names that this rank keeps of tensor i, ascending, or
 * no call when it keeps whole rows: a row-parallel weight's TP slice is a
 * block of columns (an expert adapter's, a few), so a loader that can seek
 * reads those pieces of each row only. */
void plan_load_cols(const ct_plan *p, int kind, int i, void (*add)(void *acc, size_t c0, size_t c1), void *acc);
/* After the weights are in: the trained runs AdamW steps, the hooks. */
int plan_ready(ct_plan *p, ct_err *e);
void plan_free(ct_plan *p);
/* Lends the run's profiler (metrics/profile.h; NULL: none) to the model and
 * to every communicator of the layout, so their kernels and collectives are
 * spans of it. Call after plan_ready. */
void plan_profile(ct_plan *p, struct prof *pf);

/* Micro-batches of a step (the accumulation count, or the pipeline's). */
int plan_microbatches(const ct_plan *p);
/* One step's forwards and backwards over tokens, labels [grad_accum][B x T]
 * (the whole step's sequences of this data-parallel rank: rank r of D holds
 * sequences r, r + D, ... of the step's global batch, the data set's order);
 * seed: LoRA's dropout seed of the step. Gradients of
 * (CE sum) x scale are added. Returns this rank's CE sum; *aux_sum gets the
 * sum of the micro-batches' load-balancing losses (MoE). */
double plan_forward_backward(ct_plan *p, const int32_t *tokens, const int32_t *labels, int B, int T, float scale,
                             uint64_t seed, double *aux_sum);
/* Gradients summed over the data-parallel ranks (and the tied embedding's two copies). */
void plan_reduce_grads(ct_plan *p);
/* The step's CE sum and load-balancing sum over every rank that has a part
 * (stages, data-parallel ranks); *aux_mean gets the mean per micro-batch. */
void plan_sum_loss(ct_plan *p, double *loss_sum, double *aux_sum, double *aux_mean);
/* clip_grad_norm_ over the whole model's gradient, then AdamW at lr on this
 * rank's slices (the trained runs only), gradients zeroed. Returns the norm. */
double plan_optimizer_step(ct_plan *p, double lr, const adamw_hparams *hp, double max_norm);
/* Forward only: the CE sum over labels of this rank's batch (every stage's
 * part run), summed with *n_valid over the data-parallel ranks. */
double plan_eval(ct_plan *p, const int32_t *tokens, const int32_t *labels, int B, int T, long *n_valid);
/* plan_eval's sums over the ranks: *sum and *n over the stages and data-parallel ranks. */
void plan_sum_eval(ct_plan *p, double *sum, long *n);
/* x[n] summed over the data-parallel ranks (a statistic of the step). */
void plan_sum_dp(ct_plan *p, void *x, size_t n, comm_dtype t);

/* Saves hold every tensor whole whatever the layout (see plan_save_gather). */
typedef int (*plan_put_fn)(void *ctx, const lm_model *fm, int i0, int i1, const float *x, size_t n, ct_err *e);
/* Whether this rank holds only part of the model (stages or a slice): a
 * save then names tensors by the whole model's table (p->whole). */
int plan_holds_part(const ct_plan *p);
/* Whether this rank assembles units of a save (rank 0, and a pipeline
 * stage's root): it needs the whole table fm. */
int plan_save_root(const ct_plan *p);
/* Rank 0 writes a save as a stream, one unit (the embedding, a layer, the
 * head) at a time: FSDP brings each piece of the unit to its group's root,
 * tensor/expert parallelism brings those roots' parts to the stage's root,
 * and a pipeline stage's root sends its units to rank 0, which hands the
 * whole tensors to put. Every rank runs the same loop, so the collectives
 * match; once put fails (*rc set on rank 0) rank 0 stops writing but not
 * the loop. kinds: 1 the parameters, 3 also exp_avg then exp_avg_sq.
 * frozen_too: bf16-stored frozen weights widened for the read. */
void plan_save_gather(ct_plan *p, const lm_model *fm, int kinds, int frozen_too, plan_put_fn put, void *ctx, int *rc,
                      ct_err *e);
/* A save without the gather: every rank hands put(ctx, kind, i, at, x, n)
 * the elements [at, at + n) of the whole model's tensor i it holds, x their
 * values, in runs contiguous in the whole tensor: its FSDP shard's runs
 * (replica 0's, context-parallel chunk 0's), or without FSDP the local
 * tensors of the first data-parallel rank of each stage (under expert
 * parallel the first ep, each its experts); a TP slice is cut into its
 * rows' pieces (a row-parallel weight's block of columns: one run per row),
 * a tensor replicated over the TP group is put by TP index 0 only, one
 * replicated over the EP group by EP index 0 only: every element by one
 * rank. Frozen tensors are skipped (a checkpoint holds the trained ones).
 * kinds as plan_save_gather's. Collective-free. Returns put's first failure
 * (the loop stops). */
typedef int (*plan_part_fn)(void *ctx, int kind, int i, size_t at, const float *x, size_t n, ct_err *e);
int plan_save_parts(ct_plan *p, int kinds, plan_part_fn put, void *ctx, ct_err *e);
/* Aux-loss-free MoE balancing under a pipeline: every stage's rows of the
 * routing bias onto every rank before a save (collective; a no-op elsewhere). */
void plan_gather_bias(ct_plan *p);

/* For the console line: seconds in collectives, reductions overlapped with
 * the backward, and (pipeline; -1 otherwise) the share of the step spent
 * waiting, since the last call. */
double plan_take_comm_time(ct_plan *p);
long plan_take_overlapped(ct_plan *p);
double plan_take_bubble(ct_plan *p);
/* --dry-run (distributed/plan_dry.c): what rank 0 of the layout plans
 * (world of rep x shard x tp ranks, its TP/EP slice and FSDP shard, for
 * forwards of B x T: plan_model_shape's, T a rank's chunk under context parallel), or with
 * pipeline stages every stage's rank and the schedule. mc: the whole model after [lora].
 * out NULL: check only. */
int plan_dry_rank(FILE *out, const ct_config *c, const lm_config *mc, int world, int rep, int shard, int tp, int B,
                  int T, const char *where, ct_err *e);
int plan_dry_pipeline(FILE *out, const ct_config *c, const lm_config *mc, int world, int rep, int shard, int tp,
                      const char *where, ct_err *e);
/* What FSDP plans for one rank of a shard group of `shard` (its experts over
 * n_exp ranks, 0: with the rest) of the local model m (its TP/EP slice, frozen
 * and bf16-stored tensors marked): the per-rank figures of the dry run, which
 * the memory snapshot plans too. Counts, not bytes: stored fp32 floats,
 * bf16-stored words, trained floats (gradients, moments; the most any rank
 * of the group holds), and bytes of whole pieces gathered at once
 * (parameters and gradients; reshard: fsdp.reshard_after_forward). */
typedef struct {
    double stored, in_bf16, trained, gathered_bytes;
} plan_fsdp_mem;
int plan_fsdp_memory(const lm_model *m, int shard, int n_exp, int reshard, plan_fsdp_mem *out, ct_err *e);
/* One "  what   x GiB   n bytes" line of the dry run. */
void plan_dry_line(FILE *out, const char *what, double bytes);
/* "world N = [pipeline_parallel P x ]data_parallel_replicate R x ... (backend)" for the start-up line. */
void plan_layout_str(const ct_plan *p, char *buf, size_t cap);
/* The run's layout in words (rank 0's log). */
void plan_describe(const ct_plan *p, FILE *f);

#endif
