/* distributed/fsdp.h: fully sharded data parallel (ZeRO-3) over the flat buffers.
 *
 * The flat parameter buffer splits into pieces: [0] everything before layer
 * 0 (the embedding), [1 + l] layer l, [L + 1] everything after the last
 * layer (final norm, lm_head). A layer is whatever contiguous range of the
 * tensor table carries its "model.layers.{l}." names, so a MoE layer is
 * sharded like a dense one without this file knowing its tensors. Each piece
 * of n floats is cut in N slices of ceil(n / N) (the last zero-padded);
 * rank r keeps slice r of every piece, concatenated, for the parameters,
 * the gradients and both AdamW moments: 1/N of the model state each.
 *
 * The model's full-size params/grads buffers stay allocated but are only
 * virtual memory: a piece is all-gathered into its place just before it is
 * used and released afterwards with madvise(MADV_DONTNEED), which gives the
 * pages back (they read as zeros when touched again). The model's pointers
 * never change, so its code runs unmodified; lm_hooks say when a layer
 * starts and ends:
 *   before layer l forward  : gather its parameters
 *   after layer l forward   : free them if reshard_after_forward (or forward only)
 *   before layer l backward : gather them again if freed; zero its gradient range
 *   after layer l backward  : start its gradients' reduce-scatter, free its parameters
 * and the next layer's all-gather (l+1 forward, l-1 backward) is started
 * non-blocking when layer l starts (prefetch). The reduce-scatter of layer l
 * is non-blocking too: it runs during layer l-1's backward and is completed
 * (+= into the shard, gradient pages freed) when layer l-1's starts, or at
 * the end of the micro-batch.
 * The root pieces follow the same rule at the edges of the layer loop: the
 * embedding is gathered for the lookup and freed at layer 0's forward (kept
 * for the whole micro-batch when tied to the lm_head), the head piece (final
 * norm, lm_head) is gathered after the last layer's forward and its
 * gradients reduce-scattered before the last layer's backward; the
 * embedding's gradients are reduce-scattered after the micro-batch. Every
 * gradient is reduce-scattered once per micro-batch and accumulated in the
 * shard.
 *
 * Frozen matrices stored in bf16 (training.frozen_dtype = "bfloat16",
 * lm_store_frozen_bf16) are sharded apart, in bf16: a piece's stored
 * matrices are one contiguous range of the model's m->fstore, cut in N
 * slices of ceil(sn / N) 16-bit words like the fp32 part, all-gathered as
 * bf16 (half the bytes) into m->fstore, where the model reads them as the
 * one-process path does (by the products' wbf16 entries, or row by row), and released
 * with the rest of the piece. They have no gradient, so nothing of them is
 * zeroed or reduce-scattered and they are not in the fp32 shard: a piece's
 * fp32 slices carry its other tensors only, packed in flat order (n32
 * floats), and a rank holds 2/N bytes per frozen matrix element instead of
 * 4/N. */
#ifndef CT_DISTRIBUTED_FSDP_H
#define CT_DISTRIBUTED_FSDP_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "distributed/comm.h"
#include "model/lm.h"

typedef struct {
    size_t off, n;      /* range of the flat buffer */
    size_t chunk;       /* floats per rank: ceil(n / N), N the size of comm */
    size_t shard_off;   /* where this rank's slice starts in the shard buffers */
    ct_comm *comm;      /* the ranks sharing it: the FSDP group, or for experts its expert sub-group */
    int experts;        /* a MoE layer's experts, split off under expert parallel (comm: the sub-group) */
    int t0, t1;         /* its tensors: tensors[t0 .. t1) of the model */
    size_t n32;         /* floats of the fp32 shard's slices: n less the bf16-stored matrices */
    size_t soff, sn;    /* its bf16-stored matrices: m->fstore[soff, soff + sn) (sn 0: none) */
    size_t schunk;      /* 16-bit words per rank: ceil(sn / N) */
    size_t sshard_off;  /* where this rank's bf16 slice starts in fsdp.sparams */
} fsdp_piece;

typedef struct {
    lm_model *m;
    ct_comm *comm;       /* the dp_shard group */
    int n_pieces;        /* L + 2, plus one per MoE layer under expert parallel */
    fsdp_piece *p;       /* [n_pieces] */
    int *lp;             /* [L + 1] layer l is pieces [lp[l], lp[l + 1]); lp[L] is the head */
    int *gathered;       /* [n_pieces] parameters present in m->params */
    size_t shard_n;      /* floats of this rank's shard */
    float *params;       /* [shard_n] */
    float *grads;        /* [shard_n] */
    size_t sshard_n;     /* 16-bit words of this rank's bf16 shard (bf16-stored frozen matrices) */
    uint16_t *sparams;   /* [sshard_n] */
    uint16_t *sstage;    /* [max_sstage] gather staging of a bf16 part that does not divide evenly */
    size_t max_sstage;
    comm_req pf_sreq;    /* the prefetch's bf16 all-gather */
    float *stage;        /* [max_stage] gather / reduce-scatter staging */
    size_t max_stage;    /* max over pieces of chunk x its comm's size */
    int pf_piece;        /* piece whose all-gather is in flight (-1: none) */
    int rs_piece;        /* piece whose gradient reduce-scatter is in flight (-1: none) */
    comm_req rs_req;
    float *rs_sum;       /* [chunk] where its sum lands (inside its input) */
    float *rs_stage;     /* [max_stage] its input when the piece is padded; allocated on first use */
    long rs_overlapped;  /* layer reductions started with another layer's backward still to run */
    comm_req pf_req;
    float *pf_stage;     /* [max_stage] its staging when the piece is padded; allocated on first use */
    uint16_t *pf_sstage; /* [max_sstage] the same for its bf16 part; allocated on first use */
    int reshard;         /* free a layer's parameters after its forward */
    int fwd_only;        /* forward without backward follows (evaluation): always free */
    int tied;            /* lm_head is the embedding: piece 0 stays for the whole micro-batch */
    int no_embed;        /* the micro-batch reaches neither the lookup nor a tied lm_head (a pipeline action of
                          * a later stage): piece 0 is neither gathered nor reduced */
    /* HSDP: the replicas of this shard sum their shard gradients. In the
     * step's last micro-batch (rep_armed) a layer's slice is all-reduced
     * non-blocking as soon as its reduce-scatter has landed, during the
     * backward of the layers below; fsdp_reduce_replicas does the rest. */
    ct_comm *rep;        /* NULL: no replicas (set by the caller after fsdp_init) */
    int rep_armed;
    char *rep_done;      /* [n_pieces] slice already all-reduced this step */
    int rep_piece;       /* piece whose all-reduce is in flight (-1: none) */
    comm_req rep_req;
    int in_layer;        /* the backward hook of a layer with layers below it is running */
    lm_hooks hooks;
    double comm_s;       /* seconds in collectives since the last fsdp_take_comm_time */
} fsdp;

/* [lo, hi) of layer l's tensors in the flat buffer; an error unless contiguous. */
int fsdp_layer_range(const lm_model *m, int l, size_t *lo, size_t *hi, ct_err *e);
/* The pieces fsdp_init cuts m's flat buffer into, from its tensor table
 * alone (no communicators; --dry-run plans with it): p[2 L + 2] gets off,
 * n, experts (with split_experts, a MoE layer's experts are a piece of
 * their own), t0, t1, n32, soff and sn (m after lm_store_frozen_bf16, if
 * any), lp[L + 1] each layer's first piece (lp[L]: the head).
 * Returns the number of pieces, or -1 with *e set (tensors of a layer not
 * contiguous, or its experts not last). */
int fsdp_cut(const lm_model *m, int split_experts, fsdp_piece *p, int *lp, ct_err *e);
/* Builds the pieces (an error names a layer whose tensors are not
 * contiguous), allocates the shard buffers (zeros: the caller fills
 * f->params with fsdp_take_range), gives back the pages of the full buffers
 * and installs the hooks on m. expert_comm (NULL: none) is given under
 * expert parallel: the ranks of the FSDP group that hold the same experts. A MoE layer's experts
 * (the end of its range) are then a piece of their own, sharded over
 * expert_comm only, since the other ranks' ranges hold other experts. */
int fsdp_init(fsdp *f, lm_model *m, ct_comm *shard_comm, ct_comm *expert_comm, int reshard_after_forward,
              ct_err *e);
/* Of piece i, this rank's fp32 slice holds *cnt real (unpadded) floats from
 * position *lo of the piece's fp32 floats (its floats, less the bf16-stored
 * matrices, in flat order). */
void fsdp_piece_held(const fsdp *f, int i, size_t *lo, size_t *cnt);
/* This rank's fp32 slice of piece i as runs of the flat buffer: run(ctx, x,
 * n, s) for flat floats [x, x + n) held at shard position s, in order. One
 * run unless the piece has bf16-stored matrices. */
void fsdp_held_runs(const fsdp *f, int i, void (*run)(void *ctx, size_t x, size_t n, size_t s), void *ctx);
void fsdp_free(fsdp *f);
/* Part of the whole flat buffer into this rank's shard (parameters or an
 * AdamW moment): src[n] is positions [off, off + n) (e.g. one tensor); what
 * of it this rank keeps goes to shard[shard_n]. */
void fsdp_take_range(const fsdp *f, float *shard, size_t off, const float *src, size_t n);
/* The same for bf16-stored matrices: src[n] fp32 is m->fstore positions
 * [soff, soff + n); what this rank keeps goes to f->sparams, rounded to
 * bf16 as lm_put_rows rounds. */
void fsdp_take_store(fsdp *f, size_t soff, const float *src, size_t n);
/* Piece i alone, to rank `root` of the piece's group (collective over it):
 * dst[p[i].n] there = the piece gathered from the slices in shard; elsewhere
 * dst is not touched (may be NULL). A streamed checkpoint save gathers one
 * piece at a time so that no rank holds more than a piece. The
 * bf16-stored matrices' places in dst stay as they are unless stored is set
 * (a save of the parameters that wants them): then they are gathered in
 * bf16 too and widened into dst. */
void fsdp_gather_piece(fsdp *f, int i, float *dst, const float *shard, int root, int stored);
/* Around each micro-batch's forward + backward (or forward only, with
 * fwd_only set): begin gathers the embedding piece; end reduce-scatters its
 * gradients into f->grads and frees whatever of the root is still held. */
void fsdp_microbatch_begin(fsdp *f);
void fsdp_microbatch_end(fsdp *f);
/* The head piece (final norm, lm_head) gathered now and its gradient
 * zeroed: a pipeline's last
 * stage runs the head's forward inside a backward action (distributed/pp.c),
 * after the forward that gathered it was closed by fsdp_microbatch_end. */
void fsdp_gather_head(fsdp *f);
/* HSDP, after the step's last micro-batch: completes the replicas' sum of
 * every shard gradient (the pieces not started during the backward, then
 * waits). The sums are the blocking all-reduce's, bit for bit. */
void fsdp_reduce_replicas(fsdp *f);
/* Seconds spent in collectives since the last call. */
double fsdp_take_comm_time(fsdp *f);

#endif
