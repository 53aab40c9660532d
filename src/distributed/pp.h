/* distributed/pp.h: pipeline parallelism: the layers split into stages,
 * each held by one rank of a pipeline group, and a schedule that runs a
 * step's micro-batches through them.
 *
 * A stage is a contiguous layer range [first[v], first[v + 1]); the first
 * also holds the embedding, the last the final norm and lm_head (tied
 * models: the embedding too, its gradient summed with the first stage's).
 * With S stages per rank (Interleaved1F1B, LoopedBFS and InterleavedZeroBubble,
 * S >= 2, 2 unless split points say otherwise, as torchtitan's multi-stage
 * schedules) there are V = P x S virtual stages and rank r holds v = r, r + P,
 * ..., torchtitan's "loop" placement, so activations always go to the next
 * rank. ZBVZeroBubble takes exactly 2 a rank in a V: rank r holds r and
 * 2P - 1 - r (rank 0 the embedding and the lm_head: a tied embedding has one
 * copy; rank P - 1 hands stage P - 1's output to its own stage P, a message
 * to itself in a step, a copy in evaluation). pp_vstage maps (rank, local
 * stage) to v.
 *
 * The split is torchtitan's pipeline_parallel_split_points when given,
 * otherwise the one that minimises the most expensive stage, each layer
 * costed by its forward+backward FLOPs per token (the lm_head counted on
 * the last stage).
 *
 * A schedule is, per rank, one order of actions F(stage, micro-batch) and
 * B(stage, micro-batch), built from a forward order, a backward order and
 * a number of warm-up forwards (after which forwards and backwards
 * alternate): GPipe runs every forward first; 1F1B warms up with P - r - 1
 * forwards; Interleaved1F1B (torch's, Megatron's order with flexible
 * rounds) takes micro-batches in rounds of R = M / max(1, M / P) (P when P
 * divides M), chunk by chunk, warming up with 2 (P - r - 1) + (S - 1) R;
 * LoopedBFS (torch's ScheduleLoopedBFS) runs every forward first, stage by
 * stage, then the backwards from its last stage down, each stage's
 * micro-batches last to first.
 * The zero-bubble schedules split a backward into I, d(input), sent upstream
 * when it ends, and W, the weight gradients of the decoder layers' dense
 * projections and MoE experts, replayed later from the copies I recorded (model/lm.h, lm_wstore:
 * an I takes a free store of its stage and its W gives it back, so a stage
 * keeps as many as its order ever holds pending at once (at most P for
 * InterleavedZeroBubble and 2P - 1 for ZBV across both stages, where S x M
 * would be one per micro-batch); pp_free prints their size). Their orders are torch's: InterleavedZeroBubble's ZB1P
 * (ScheduleInterleavedZeroBubble: 1F1B-like with rounds of M / max(1, M / P)
 * micro-batches, each I from the (r + 1)-th on followed by the oldest W
 * pending) and ZBVZeroBubble's (ScheduleZBVZeroBubble). DualPipeV (torch's
 * ScheduleDualPipeV, on ZBV's V) mixes whole backwards with split ones, and
 * runs each of its forward-backward pairs as the forward then the backward,
 * as torch's runtime does without an overlap function. Every W of a step
 * runs inside pp_step, so clipping, FSDP's replicas and the data-parallel
 * sum (after pp_step) see whole gradients.
 * torchtitan's pipeline_parallel_schedule_csv replaces the orders by a file's
 * (torch's _PipelineScheduleRuntime._load_csv, "compute_only"): row r is rank
 * r's actions as torch's _Action prints them ("2F0", "0B3", "1I2", "1W2"; an
 * empty cell a no-op; "(0F4;3B1)OVERLAP_F_B" its two in turn). The schedule
 * name still gives the stages and their ranks, as in torchtitan, and whether
 * backwards may split (I and W with the zero-bubble schedules only: their
 * stores). pp_plan refuses, naming the file and the cell, any other action,
 * a stage or micro-batch out of range or on a rank that does not hold it, a
 * (stage, micro-batch) without exactly one forward and one backward (B, or
 * I then W), and, from the simulation below, an order that would deadlock.
 * Every order is checked by simulating all ranks with each stage's cost
 * (a backward costs two forwards, I and W one each; W waits for its I),
 * which also gives the schedule's bubble: the share of rank-time spent
 * waiting.
 *
 * Under FSDP each action is one FSDP micro-batch of the stage's layers:
 * a forward gathers and frees them as evaluation does, a backward reduces
 * its gradients into the shard before the next action (the last stage's
 * head, whose forward runs inside its backward, is gathered again there);
 * I and W each reduce what they computed (W runs the layer hooks too: the
 * reduce-scatter of a layer happens once per action, the shard adds both).
 *
 * At run time a stage posts every receive of the step at its start (one
 * buffer per stage and micro-batch) and sends without blocking, so a rank
 * computes while its neighbours' messages travel; it waits only for an
 * input it needs now. MPI matches messages between a pair of ranks by tag
 * (2 v: activations into stage v, 2 v + 1: gradients into stage v) in
 * send order, so a stage posts its receives in the order its neighbour's
 * schedule sends (fseq, bseq: LoopedBFS sends gradients last micro-batch
 * first).
 *
 * HF's load-balancing loss in the gradient (lm_aux_in_grad) needs, in every
 * MoE layer's backward, the micro-batch's expert counts summed over ALL the
 * model's MoE layers. So a second, small message (E doubles) travels beside
 * each activation and each gradient, tags 2 V + 2 v and 2 V + 2 v + 1: a
 * forward adds its layers' counts to those stage v - 1 sent and passes the
 * sum on; the last stage then holds the micro-batch's totals, sets the aux
 * gradient from them (lm_stage_aux_grad) before its backward and sends them
 * back upstream with the gradient, each stage doing the same before its own.
 * The unit of the aux loss is the pipeline micro-batch, as for the logged
 * aux_loss: a run trains like one process with local_batch_size =
 * pipeline_parallel_microbatch_size and the same global batch.
 *
 * Gradient scaling is the one-rank run's: the trainer computes the step's
 * valid-target count before any backward and every micro-batch's loss is
 * scaled by its inverse, so the stages' gradients add up to the gradient
 * of the mean loss, whatever the number of micro-batches. */
#ifndef CT_DISTRIBUTED_PP_H
#define CT_DISTRIBUTED_PP_H

#include <stdint.h>

#include "config/config.h"
#include "core/err.h"
#include "distributed/comm.h"
#include "distributed/fsdp.h"
#include "model/lm.h"

/* from PP_ZB_INTERLEAVED on, backwards split into I and W */
enum { PP_1F1B, PP_GPIPE, PP_INTERLEAVED, PP_LOOPED_BFS, PP_ZB_INTERLEAVED, PP_ZBV, PP_DUALPIPEV };

typedef struct {
    char kind;  /* 'F', 'B', or a zero-bubble schedule's halves of B: 'I' (input) and 'W' (weight) */
    int stage;  /* local stage index c: virtual stage pp_vstage(p, rank, c) */
    int mb;     /* micro-batch */
} pp_action;

typedef struct {
    int P, rank;         /* pipeline degree and this rank's place in it */
    int S, V;            /* stages per rank, virtual stages (P x S) */
    int *first;          /* [V + 1] first layer of each virtual stage; first[V] = L */
    double *cost;        /* [V] relative cost of a stage's forward (its layers, the lm_head on the last) */
    int schedule;        /* PP_* */
    int M;               /* micro-batches per optimizer step */
    int mb_size;         /* sequences per micro-batch */
    int n_act;           /* this rank's actions, 2 S M (zero bubble: 3 S M; DualPipeV between) */
    pp_action *act;
    int *fseq, *bseq;    /* [V][M] the micro-batches of each virtual stage's forwards, backwards, in its
                            rank's order: the order its messages leave in (a receiver posts in it) */
    double bubble;       /* simulated share of idle rank-time in a step */
    int max_banks;       /* most forwards of this rank in flight at once (activation banks) */
    uint64_t digest;     /* every rank's order hashed (the CSV's or the name's): the ranks compare it */
    /* run time (pp_bind) */
    ct_comm *comm;       /* one pipeline: rank v % P holds virtual stage v */
    fsdp *fsdp;          /* the stage's FSDP (NULL: none): each action is one of its micro-batches */
    ct_comm *cpg;        /* context parallel (NULL: none): the chunks of this stage's sequences, whose
                            expert counts the aux gradient and the logged loads sum (cp_T: the whole
                            sequence) */
    int cp_T;
    double *loads;       /* [L][E] under cpg: each held MoE layer's tokens per expert in its stage's
                            last forward (pp_step sums them over the chunks into moe.load_min/max) */
    int T;               /* positions of a training sequence a stage runs (the model may plan more:
                            validation's longer windows, pp_eval) */
    size_t n;            /* floats of one message: micro-batch rows x hidden */
    float *buf;          /* [S][M][4][n]: activation in, gradient in, activation out, gradient out */
    comm_req *req;       /* [S][M][4] */
    lm_bank **banks;     /* [S][M] the bank of a forward in flight (NULL: none) */
    lm_bank **pool;      /* [S][max_banks] free banks */
    int *n_pool;         /* [S] */
    double *moe_stats;   /* [M][2 E] this rank's routing sums of each micro-batch (E = 0: none) */
    int E;
    lm_wstore *wst;      /* [S][M] zero bubble: the weight-gradient stores (NULL: none), a stage's used in turn */
    lm_wstore **wcur;    /* [S][M] the store an I of (stage, micro-batch) filled, until its W replays it */
    lm_wstore **wfree;   /* [S][M] stores replayed, free for the next I of the stage */
    int *n_wfree, *n_wst; /* [S] how many free; how many of the stage's ever taken */
    double *cnt;         /* [S][M][4][E] expert counts (aux loss): in with the activation, in with the
                            gradient, out with the activation, out with the gradient */
    comm_req *cnt_req;   /* [S][M][4] */
    double wait_s, step_s; /* seconds waiting for inputs, and in pp_step, since pp_take_bubble */
    double wait_all, step_all; /* the same taken by pp_take_bubble before: pp_free prints the run's */
} pp_sched;

/* The split and this rank's schedule for P ranks and a step of M
 * micro-batches (no communication: the dry run plans every rank's with it).
 * Errors (CT_ERR_CONFIG, naming the key): split points out of order or out
 * of range, a stage without layers, a count of stages the schedule cannot
 * use, micro-batches the schedule cannot group. */
int pp_plan(pp_sched *p, const ct_config *c, const lm_config *mc, int P, int rank, int M, const char *where,
            ct_err *e);
/* What this rank holds: mc->pp_stage and layer_held. */
void pp_hold(const pp_sched *p, lm_config *mc);
/* Run-time buffers for micro-batches of B x T tokens of width H. */
void pp_bind(pp_sched *p, ct_comm *comm, int B, int T, int H, int n_experts);
void pp_free(pp_sched *p);
/* One optimizer step's forwards and backwards: tokens, labels
 * [M][mb_size x T], row j of them sequence seq0 + j seq_stride of the
 * step's global batch (LoRA's dropout masks, m->lora_seed the step's).
 * Gradients of (CE sum) x grad_scale are added to m->grads, and with
 * lm_aux_in_grad those of router_aux_loss_coef x m->moe.aux_scale x each
 * micro-batch's load-balancing loss. Returns this
 * rank's CE sum (the last stage's: 0 elsewhere); p->moe_stats holds its
 * routing sums per micro-batch, and m->moe.load_min/max of its MoE layers
 * their stage's last forward's loads (under context parallel the whole
 * sequences': summed over p->cpg). Collective over the pipeline (and cpg). */
double pp_step(pp_sched *p, lm_model *m, const int32_t *tokens, const int32_t *labels, long seq0, int seq_stride,
               float grad_scale);
/* Forward only of one batch of B x T (B = mb_size x any): the CE sum of
 * labels on the last stage (0 elsewhere) and its valid labels in *n_valid. */
double pp_eval(pp_sched *p, lm_model *m, const int32_t *tokens, const int32_t *labels, int B, int T, long *n_valid);
/* The pipeline rank holding unit x of a streamed save (0: the embedding,
 * 1 + l: layer l, L + 1: the final norm and lm_head). */
int pp_unit_stage(const pp_sched *p, int x, int L);
/* Floats of the activation banks this rank holds at most (each local
 * stage's peak of forwards in flight x its bank), and their count in
 * *n_banks. table: the stage's model (plan or layout, with act.B, act.T
 * and act.pol set), for the dry run. */
size_t pp_bank_floats(const pp_sched *p, const lm_model *table, int *n_banks);
/* A zero-bubble schedule's weight-gradient stores (model/lm.h, lm_wstore) on
 * this rank, in floats, for micro-batches of rows: per local stage the most
 * I's its order has waiting for their W, each lm_wstore_floats of the
 * stage's layers; *n_stores gets how many. 0 for the other schedules. */
size_t pp_wstore_floats(const pp_sched *p, const lm_model *table, size_t rows, int *n_stores);
/* The measured share of pp_step's time spent waiting for inputs since the last call (-1: no step).
 * The trainer logs the pipeline ranks' mean; each rank's own share over the whole run is the
 * line pp_free prints on stderr ("ctitan: pipeline rank R of P waited ..."), so the mean can be
 * checked against its parts. */
double pp_take_bubble(pp_sched *p);
/* The virtual stage of rank r's local stage c: c P + r (the loop), or under
 * ZBVZeroBubble's V r (c = 0) and 2 P - 1 - r (c = 1). */
int pp_vstage(const pp_sched *p, int r, int c);
/* Zero bubble: the most floats one (stage, micro-batch)'s weight-gradient
 * store has held (0: none yet, or another schedule). */
size_t pp_wstore_peak(const pp_sched *p);

#endif
