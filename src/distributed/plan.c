/* distributed/plan.c: the parallel plan (see plan.h): the layouts built
 * in their order, the hooks composed, and everything the trainer asks of
 * the layout: the step's micro-batches, gradient reduction and clipping,
 * the optimizer's slices, and where checkpoint ranges are read and written. */
#define _XOPEN_SOURCE 700
#include "distributed/plan.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/cpu.h"
#include "core/timer.h"
#include "metrics/profile.h"
#include "model/moe.h"

/* ------------------------------------------------------------ the mesh */

int plan_init(ct_plan *p, ct_comm *world, const ct_config *c, const lm_config *mc, const char *where, ct_err *e) {
    memset(p, 0, sizeof *p);
    p->cfg = c;
    p->n_opt_ranges = -1;
    return mesh_init(&p->mesh, world, c, mc, where, e);
}

int plan_check_pipeline(const ct_config *c, int val_batch, const char *src, ct_err *e) {
    if (c->local_batch_size % c->pp_microbatch != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_microbatch_size = %d does not divide training.local_batch_size "
                       "= %d",
                       src, c->pp_microbatch, c->local_batch_size);
    if (c->val_enable && val_batch % c->pp_microbatch != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_microbatch_size = %d does not divide the validation batch %d "
                       "(validation.local_batch_size)",
                       src, c->pp_microbatch, val_batch);
    return 0;
}

/* 1. pipeline: this rank's stages; 2. tensor / expert parallel: its slice. */
int plan_local_model(ct_plan *p, lm_config *mc, int grad_accum, int val_batch, int *batch, const char *where,
                     ct_err *e) {
    const ct_config *c = p->cfg;
    int rc;
    p->grad_accum = grad_accum;
    p->whole = *mc;
    if (p->mesh.pp > 1) { /* its layers only, a micro-batch at a time */
        if ((rc = plan_check_pipeline(c, val_batch, where, e))) return rc;
        p->pp = ct_calloc(1, sizeof *p->pp);
        int M = grad_accum * (c->local_batch_size / c->pp_microbatch);
        rc = pp_plan(p->pp, c, mc, p->mesh.pp, p->mesh.pp_rank, M, where, e);
        /* each rank reads its own copy of pipeline_parallel_schedule_csv: one missing or refused
         * on one machine alone left the others waiting in comm_split below (rank 0 prints the
         * lowest failing rank's error), and copies read to other orders ran rows that their
         * neighbours did not expect (hung, or took one micro-batch's gradient for another's,
         * at exit 0): the ranks compare every rank's order (pp_sched.digest) */
        if (p->mesh.world && (rc = comm_agree(p->mesh.world, rc, "plan its pipeline", e))) return rc;
        if (rc) return rc;
        int64_t v = (int64_t)(p->pp->digest >> 2), lo, hi; /* 62 bits: its negation fits */
        if (p->mesh.world) comm_range_i64(p->mesh.world, &v, &lo, &hi, 1);
        else lo = hi = v;
        if (lo != hi) {
            ct_fail(e, CT_ERR_CONFIG, "%s: parallelism.pipeline_parallel_schedule_csv: the ranks read different "
                    "orders from their copies of the file (\"%s\" on this rank): every machine must hold the same "
                    "file", cfg_origin(c, "parallelism.pipeline_parallel_schedule_csv"), c->pp_csv);
            e->all_ranks = 1; /* every rank knows it from the all-reduce */
            return CT_ERR_CONFIG;
        }
        pp_hold(p->pp, mc);
        *batch = c->pp_microbatch;
        /* the ranks of the first and last stages: a tied embedding's two copies (one rank under the V) */
        int L = mc->n_layers, r = p->mesh.pp_rank;
        int ends = r == pp_unit_stage(p->pp, 0, L) || r == pp_unit_stage(p->pp, L + 1, L);
        if ((rc = comm_split(&p->mesh.ppg, ends ? 0 : 1 + p->mesh.pp_rank, p->mesh.pp_rank, &p->tie, e))) return rc;
    }
    if (p->mesh.tp > 1 || p->mesh.ep > 1) { /* fewer heads, a narrower MLP, its experts only */
        p->tp = ct_calloc(1, sizeof *p->tp);
        tp_init(p->tp, mc, &p->mesh.tpg, p->mesh.ep, p->mesh.ep_rank);
        /* sequence parallel: every B x T, cut in DTensor Shard's ceil chunks (model/lm.c) */
        p->tp->local.tp_seq = p->mesh.tp > 1 && c->sequence_parallel;
        *mc = p->tp->local;
    }
    return 0;
}

/* 3. FSDP: the shard buffers exist before the weights load, which fill them. */
int plan_attach(ct_plan *p, lm_model *m, adamw_state *opt, ct_err *e) {
    p->m = m;
    p->opt = opt;
    int rc = 0;
    if (p->pp) /* messages of a micro-batch's rows: under context parallel, of its chunk */
        pp_bind(p->pp, &p->mesh.ppg, p->cfg->pp_microbatch, plan_seq_len(p), m->cfg.hidden,
                m->moe.n_layers ? m->cfg.n_experts : 0);
    if (p->mesh.dp_shard > 1) {
        p->fsdp = ct_calloc(1, sizeof *p->fsdp);
        rc = fsdp_init(p->fsdp, m, &p->mesh.shard, p->mesh.ep > 1 ? &p->mesh.edp : NULL,
                       strcmp(p->cfg->fsdp_reshard, "never") != 0, e);
        if (!rc) { /* the moments: this rank's slices only */
            adamw_free(opt);
            adamw_init(opt, p->fsdp->shard_n);
            if (p->mesh.dp_replicate > 1) p->fsdp->rep = &p->mesh.rep;
        }
        if (p->pp) p->pp->fsdp = p->fsdp;
    }
    if (!rc && p->mesh.cp > 1) { /* 5. its chunk's RoPE positions and the attention over the whole sequence */
        const ct_config *c = p->cfg;
        p->cp = ct_calloc(1, sizeof *p->cp);
        /* the scratch for the model's planned rows at the longer of training's and
         * validation's lengths (plan_model_shape), chunked: m->act.T = Tmax / cp */
        int Tmax = m->act.T * p->mesh.cp, n_seq = m->act.B;
        if (p->pp) {
            /* a pipeline takes the step's sequences at once (its micro-batches, pp_step) and
             * validation's batch whole (pp_eval splits it): each chunked before */
            int val_b = c->val_local_batch_size > 0 ? c->val_local_batch_size : c->local_batch_size;
            long rows = (long)p->pp->M * p->pp->mb_size * c->seq_len, vrows = (long)val_b * cfg_val_seq_len(c);
            n_seq = (int)(((rows > vrows ? rows : vrows) + Tmax - 1) / Tmax);
        }
        if (p->pp) p->pp->cpg = &p->mesh.cpg, p->pp->cp_T = c->seq_len; /* the aux gradient's counts */
        cp_init(p->cp, m, &p->mesh.cpg, m->act.B, Tmax, n_seq, !strcmp(c->cp_balancer, "headtail"),
                !strcmp(c->cp_rotate, "alltoall"));
        cp_set_len(p->cp, c->seq_len); /* training's; plan_eval switches to validation's and back */
    }
    return rc;
}

/* Data parallel replicate without FSDP: a layer's gradients are final after
 * its backward in the step's last micro-batch, so their all-reduce starts
 * there (non-blocking, one in flight) and runs during the backward of the
 * layer below; plan_reduce_grads waits for it and all-reduces what is
 * outside the layers (embedding, final norm, lm_head). The collective sums
 * each element over ranks in rank order whatever range it is part of, so the
 * bits are those of one all-reduce of the whole buffer after the backward.
 * Without an MPI progress thread the all-reduce advances only inside MPI
 * calls, hence the comm_test before each layer's backward. */
struct plan_dpo {
    ct_plan *p;
    lm_hooks hooks;
    int armed;       /* the step's last micro-batch is running */
    comm_req req;    /* the latest layer's all-reduce */
    size_t lo, hi;   /* [lo, hi) of model.grads started this step (lo == hi: none) */
    size_t *layer;   /* [n_layers + 1]: layer l is [layer[l], layer[l + 1]) */
};

static void dpo_nop(void *ctx, int l) { (void)ctx, (void)l; }
static void dpo_pre_backward(void *ctx, int l) {
    (void)l;
    comm_test(&((struct plan_dpo *)ctx)->req);
}
static void dpo_post_backward(void *ctx, int l) {
    struct plan_dpo *d = ctx;
    if (!d->armed) return;
    ct_plan *p = d->p;
    double t0 = ct_now();
    comm_wait(&d->req);
    size_t lo = d->layer[l], hi = d->layer[l + 1];
    comm_iallreduce(&p->mesh.rep, p->m->grads + lo, hi - lo, COMM_F32, &d->req);
    p->comm_s += ct_now() - t0;
    if (d->hi == d->lo) d->hi = hi;
    d->lo = lo;
    if (l > 0) p->overlapped++;
}

static int dp_overlap_init(ct_plan *p, ct_err *e) {
    const lm_model *m = p->m;
    int L = m->cfg.n_layers;
    if (L < 1) return 0;
    struct plan_dpo *d = ct_calloc(1, sizeof *d);
    d->p = p;
    d->layer = ct_calloc((size_t)L + 1, sizeof(size_t));
    for (int l = 0; l < L; l++) {
        size_t lo = 0, hi = 0;
        int rc = fsdp_layer_range(m, l, &lo, &hi, e);
        if (!rc && l > 0 && lo != d->layer[l])
            rc = ct_fail(e, CT_ERR_IO, "data parallel: tensors between layers %d and %d", l - 1, l);
        if (rc) {
            free(d->layer);
            free(d);
            return rc;
        }
        d->layer[l] = lo;
        d->layer[l + 1] = hi;
    }
    d->hooks = (lm_hooks){d, dpo_nop, dpo_nop, dpo_pre_backward, dpo_post_backward, NULL, NULL};
    p->dpo = d;
    return 0;
}

static void dp_overlap_free(ct_plan *p) {
    struct plan_dpo *d = p->dpo;
    if (!d) return;
    comm_wait(&d->req);
    free(d->layer);
    free(d);
    p->dpo = NULL;
}


/* The runs of trainable floats in the buffers AdamW steps: the model's flat
 * buffer, or under FSDP this rank's shard (each piece's held part, at its
 * shard offset), cut down to the tensors that are not frozen. */
typedef struct {
    ct_plan *p;
    size_t a, base; /* the flat range being cut starts at a; it lies at buffer offset base */
    int cap;
} opt_runs;

static void add_opt_run(void *ctx, size_t x, size_t y) {
    opt_runs *o = ctx;
    ct_plan *p = o->p;
    size_t off = o->base + (x - o->a);
    struct plan_range *r = p->opt_ranges;
    int n = p->n_opt_ranges;
    if (n && r[n - 1].off + r[n - 1].n == off) { /* continues in the buffer (FSDP: across pieces) */
        r[n - 1].n += y - x;
        return;
    }
    if (n == o->cap) { /* grow: a model has at most a few runs per layer */
        struct plan_range *g = ct_malloc((size_t)(o->cap *= 2) * sizeof *g);
        memcpy(g, r, (size_t)n * sizeof *r);
        free(r);
        p->opt_ranges = r = g;
    }
    r[p->n_opt_ranges++] = (struct plan_range){off, y - x};
}

/* A held run of an FSDP shard (fsdp_held_runs): flat [x, x + n) at shard position s. */
static void held_opt_runs(void *ctx, size_t x, size_t n, size_t s) {
    opt_runs *o = ctx;
    o->a = x;
    o->base = s;
    lm_trained_runs(o->p->m, x, x + n, add_opt_run, o);
}

static void build_opt_ranges(ct_plan *p) {
    const lm_model *m = p->m;
    p->n_opt_ranges = -1;
    if (!m->n_frozen) return;
    opt_runs o = {p, 0, 0, 16};
    p->opt_ranges = ct_malloc((size_t)o.cap * sizeof *p->opt_ranges);
    p->n_opt_ranges = 0;
    if (!p->fsdp) {
        lm_trained_runs(m, 0, m->n_params, add_opt_run, &o);
        return;
    }
    for (int pi = 0; pi < p->fsdp->n_pieces; pi++) /* each piece's held part, at its shard offset */
        fsdp_held_runs(p->fsdp, pi, held_opt_runs, &o);
}

struct dp_sum { float *g; ct_comm *group; };
static void sum_run(void *ctx, size_t x, size_t y) {
    struct dp_sum *d = ctx;
    comm_allreduce(d->group, d->g + x, y - x, COMM_F32, COMM_SUM);
}

/* Data parallel replicate under expert parallel: the replicas hold
 * different experts, so each run of expert tensors (their adapters too) is
 * summed over the replicas that hold the same ones (mesh.edp) and the rest
 * over all; frozen tensors not at all (sum_trained says why). */
static void reduce_dp_experts(ct_plan *p) {
    const lm_model *m = p->m;
    for (int i = 0; i < m->n_tensors;) {
        int ex = p->tp->expert[i], j = i;
        size_t lo = m->tensors[i].offset, hi = lo;
        for (; j < m->n_tensors && p->tp->expert[j] == ex; j++) hi = m->tensors[j].offset + m->tensors[j].numel;
        struct dp_sum d = {m->grads, ex ? &p->mesh.edp : &p->mesh.rep};
        if (hi > lo) lm_trained_runs(m, lo, hi, sum_run, &d);
        i = j;
    }
}

/* g[n] summed over group: with frozen tensors the trained runs alone (their
 * offsets are g's: the flat buffer's, or the shard's under FSDP), since the
 * frozen gradients' pages are never written and summing them would map them. */
static void sum_trained(ct_plan *p, ct_comm *group, float *g, size_t n) {
    if (p->n_opt_ranges < 0) {
        comm_allreduce(group, g, n, COMM_F32, COMM_SUM);
        return;
    }
    for (int i = 0; i < p->n_opt_ranges; i++)
        comm_allreduce(group, g + p->opt_ranges[i].off, p->opt_ranges[i].n, COMM_F32, COMM_SUM);
}

void plan_reduce_grads(ct_plan *p) {
    double t0 = ct_now();
    if (p->tp) p->comm_s += tp_take_comm_time(p->tp);
    if (p->fsdp) {
        p->comm_s += fsdp_take_comm_time(p->fsdp);
        p->overlapped += p->fsdp->rs_overlapped;
        p->fsdp->rs_overlapped = 0;
        t0 = ct_now();
        /* HSDP: the replicas of one shard sum their shard gradients (most layers' sums
         * were started during the backward) */
        if (p->fsdp->rep) fsdp_reduce_replicas(p->fsdp);
    } else if (p->mesh.dp_replicate > 1) {
        struct plan_dpo *d = p->dpo;
        if (d && d->hi > d->lo) { /* the layers were started during the backward: the rest */
            comm_wait(&d->req);
            size_t n = p->m->n_params;
            if (d->lo) comm_allreduce(&p->mesh.rep, p->m->grads, d->lo, COMM_F32, COMM_SUM);
            if (d->hi < n) comm_allreduce(&p->mesh.rep, p->m->grads + d->hi, n - d->hi, COMM_F32, COMM_SUM);
            d->lo = d->hi = 0;
        } else if (p->mesh.ep > 1) {
            reduce_dp_experts(p);
        } else {
            sum_trained(p, &p->mesh.rep, p->m->grads, p->m->n_params);
        }
    }
    if (p->cp) { /* the chunks' ranks hold replicas: their gradients summed, as the replicas' */
        p->comm_s += cp_take_comm_time(p->cp); /* the attention's, during the step */
        if (p->fsdp) sum_trained(p, &p->mesh.cpg, p->fsdp->grads, p->fsdp->shard_n);
        else sum_trained(p, &p->mesh.cpg, p->m->grads, p->m->n_params);
        lm_model *m = p->m; /* the aux-loss-free balancing's counts: every chunk's tokens */
        if (p->cfg->load_balance_coeff > 0 && m->moe.n_layers)
            comm_allreduce(&p->mesh.cpg, m->moe.tokens, (size_t)m->cfg.n_layers * m->cfg.n_experts, COMM_F64, COMM_SUM);
    }
    if (p->pp && p->m->cfg.tie_embeddings && p->tie.size > 1 && p->m->g.wte) { /* the embedding's two copies:
                                                                                        * one gradient */
        const lm_tensor *te = &p->m->tensors[0];
        if (p->fsdp) /* the same slice of it on both stages' ranks of this place */
            comm_allreduce(&p->tie, p->fsdp->grads + p->fsdp->p[0].shard_off, p->fsdp->p[0].chunk, COMM_F32, COMM_SUM);
        else
            comm_allreduce(&p->tie, p->m->grads + te->offset, te->numel, COMM_F32, COMM_SUM);
    }
    p->comm_s += ct_now() - t0;
}

/* optim_grad_norm, an "op" span of the model's profiler when it has one: a
 * pass over every gradient, so a step's trace shows it beside AdamW. */
static double grad_norm(const lm_model *m, const float *g, size_t n) {
    int64_t t0 = PROF_T0(m->prof);
    double norm = optim_grad_norm(g, n);
    if (m->prof) prof_model_op(m->prof, "grad_norm", "grad_norm", PROF_NO_KERNEL, t0);
    return norm;
}

/* Pipeline stages: the squares of every stage's gradients, the tied
 * embedding's second copy (on the last stage) counted once. sq: this rank's
 * place's (summed over its FSDP and TP groups, so the copy's squares are
 * taken over those groups too). */
static double pp_sq(ct_plan *p, const float *g, double sq) {
    if (!p->pp) return sq;
    const lm_model *m = p->m;
    if (m->cfg.tie_embeddings && p->tie.size > 1 && p->mesh.pp_rank != 0 && m->g.wte) {
        size_t off = m->tensors[0].offset, n = m->tensors[0].numel;
        if (p->fsdp) fsdp_piece_held(p->fsdp, 0, &off, &n), off = p->fsdp->p[0].shard_off; /* this rank's slice */
        double d = grad_norm(m, g + off, n), dq = d * d;
        if (p->fsdp) comm_allreduce(&p->mesh.shard, &dq, 1, COMM_F64, COMM_SUM);
        if (m->cfg.tp_degree > 1) comm_allreduce(p->tp->comm, &dq, 1, COMM_F64, COMM_SUM); /* its TP slices */
        sq -= dq;
    }
    comm_allreduce(&p->mesh.ppg, &sq, 1, COMM_F64, COMM_SUM);
    return sq;
}

/* clip_grad_norm_ over gradients sharded across `group`: the squares are
 * summed per rank in double and all-reduced, so every rank scales by the
 * global norm, as one process does. The clipping functions only find the
 * coefficient (*scale); AdamW applies it as it reads each gradient. */
static double clip_by(double sq, double max_norm, float *scale);
static double clip_sharded(ct_plan *p, const float *g, size_t n, double max_norm, ct_comm *group, float *scale) {
    double local = grad_norm(p->m, g, n), sq = local * local;
    comm_allreduce(group, &sq, 1, COMM_F64, COMM_SUM);
    return clip_by(pp_sq(p, g, sq), max_norm, scale);
}

/* A held fp32 run of the shard (fsdp_held_runs): flat [x, x + n) at shard
 * position s, its squares added as tp_sq_range counts them. */
struct held_sq { ct_plan *p; const float *g; double sq; };
static void held_run_sq(void *ctx, size_t x, size_t n, size_t s) {
    struct held_sq *r = ctx;
    r->sq += tp_sq_range(r->p->tp, r->g + s, x, n, TP_SQ_ALL);
}

/* The same under tensor or expert parallelism: replicated tensors count
 * once (tp.h), summed over the shard group (FSDP: per held run of this
 * rank's slice; an EP group lies inside the shard group, so every expert is
 * counted once) and then over the TP group. Without FSDP the experts'
 * squares are summed over the EP group. */
static double clip_tp(ct_plan *p, const float *g, size_t n, double max_norm, float *scale) {
    double sq = 0;
    fsdp *f = p->fsdp;
    if (!f) {
        double se = tp_sq_range(p->tp, g, 0, n, TP_SQ_EXPERTS);
        if (p->mesh.ep > 1) comm_allreduce(&p->mesh.epg, &se, 1, COMM_F64, COMM_SUM);
        sq = tp_sq_range(p->tp, g, 0, n, TP_SQ_DENSE) + se;
    } else {
        /* by held runs: a piece with bf16-stored frozen matrices keeps its fp32 tensors
         * apart from their flat positions */
        struct held_sq r = {p, g, 0};
        for (int i = 0; i < f->n_pieces; i++) fsdp_held_runs(f, i, held_run_sq, &r);
        sq = r.sq;
        comm_allreduce(f->comm, &sq, 1, COMM_F64, COMM_SUM);
    }
    comm_allreduce(p->tp->comm, &sq, 1, COMM_F64, COMM_SUM);
    return clip_by(pp_sq(p, g, sq), max_norm, scale);
}

/* The norm sqrt(sq) (the whole model's) and, in *scale, the coefficient that
 * brings it to at most max_norm. */
static double clip_by(double sq, double max_norm, float *scale) {
    double norm = sqrt(sq);
    *scale = optim_clip_scale(norm, max_norm);
    return norm;
}

/* The AdamW kernel, an "op" span of the model's profiler when it has one;
 * Adam's (hp->l2) after its weight decay is added to the gradient. */
static void opt_step(lm_model *m, adamw_state *s, float *P, float *G, float scale, double lr,
                     const adamw_hparams *hp) {
    int64_t t0 = PROF_T0(m->prof);
    adamw_hparams h = *hp;
    if (hp->l2) {
        adam_l2_grad(G, P, scale, hp->weight_decay, s->n);
        scale = 1.0f;
        h.weight_decay = 0;
    }
    m->k.adamw_step(s, P, G, scale, lr, &h);
    if (m->prof) prof_kern(m->prof, KERN_OP_ADAMW, "adamw_step", t0);
}

/* With frozen tensors, AdamW over the trainable runs only (clipped by scale),
 * so the frozen ones keep their weights bit for bit (no weight decay either)
 * and their untouched gradient and moment pages are never written. Every
 * run steps with the same step count, as one AdamW over them all. */
static void step_runs(ct_plan *p, float *P, float *G, float scale, double lr, const adamw_hparams *hp) {
    long step0 = p->opt->step;
    for (int i = 0; i < p->n_opt_ranges; i++) { /* AdamW also zeroes the run's gradients */
        const struct plan_range *r = &p->opt_ranges[i];
        adamw_state s = {r->n, p->opt->m + r->off, p->opt->v + r->off, step0, 0};
        opt_step(p->m, &s, P + r->off, G + r->off, scale, lr, hp);
    }
    p->opt->step = step0 + 1;
}

/* Clipping by the trainable runs' norm, then step_runs. */
static double step_ranges(ct_plan *p, float *P, float *G, double lr, const adamw_hparams *hp, double max_norm) {
    lm_model *m = p->m;
    double sq = 0;
    for (int i = 0; i < p->n_opt_ranges; i++) {
        double nrm = grad_norm(m, G + p->opt_ranges[i].off, p->opt_ranges[i].n);
        sq += nrm * nrm;
    }
    if (p->fsdp) comm_allreduce(&p->mesh.shard, &sq, 1, COMM_F64, COMM_SUM);
    sq = pp_sq(p, G, sq);
    float scale;
    double norm = clip_by(sq, max_norm, &scale);
    step_runs(p, P, G, scale, lr, hp);
    return norm;
}

double plan_optimizer_step(ct_plan *p, double lr, const adamw_hparams *hp, double max_norm) {
    lm_model *m = p->m;
    double norm;
    float scale;
    if (p->n_opt_ranges >= 0 && !p->tp) {
        norm = step_ranges(p, p->fsdp ? p->fsdp->params : m->params, p->fsdp ? p->fsdp->grads : m->grads, lr, hp,
                           max_norm);
    } else if (p->fsdp) { /* AdamW is elementwise: stepping the slices is stepping the model */
        fsdp *f = p->fsdp;
        norm = p->tp ? clip_tp(p, f->grads, f->shard_n, max_norm, &scale)
                     : clip_sharded(p, f->grads, f->shard_n, max_norm, &p->mesh.shard, &scale);
        /* under TP with frozen tensors: the norm over all (frozen gradients read as zeros), AdamW over
         * the trained runs only, as step_ranges */
        if (p->n_opt_ranges >= 0) step_runs(p, f->params, f->grads, scale, lr, hp);
        else opt_step(m, p->opt, f->params, f->grads, scale, lr, hp); /* and zeroes the gradients */
    } else {
        if (p->tp) {
            norm = clip_tp(p, m->grads, m->n_params, max_norm, &scale);
        } else if (p->pp) {
            double local = grad_norm(m, m->grads, m->n_params);
            norm = clip_by(pp_sq(p, m->grads, local * local), max_norm, &scale);
        } else {
            norm = grad_norm(m, m->grads, m->n_params);
            scale = optim_clip_scale(norm, max_norm);
        }
        if (p->n_opt_ranges >= 0) step_runs(p, m->params, m->grads, scale, lr, hp);
        else opt_step(m, p->opt, m->params, m->grads, scale, lr, hp);
    }
    return norm;
}

/* Where a loader's rows go (lm_sink): this rank's stages and TP/EP part of them
 * (tp_take_rows), then, under FSDP, only what its shard keeps
 * (fsdp_take_range), else the local model's buffers. The moments likewise. */
static void load_put(void *ctx, int kind, int i, size_t r0, size_t r1, const float *rows) {
    ct_plan *p = ctx;
    const lm_tensor *lt = &p->m->tensors[i];
    size_t fb[3];
    /* a fused tensor's TP slice is one run of rows per block (tp_row_blocks) */
    int nb = p->tp ? tp_row_blocks(p->tp, &p->load.whole->tensors[i], fb) : 1;
    for (int k = 0; k < nb; k++) {
        const float *src = rows;
        size_t la = r0, n = lt->numel ? r1 - r0 : 0;
        if (p->tp) n = tp_take_rows(p->tp, lt, &p->load.whole->tensors[i], k, r0, r1, rows, p->load.tmp, &src, &la);
        if (!n) continue;
        size_t cols = lm_tensor_cols(lt);
        if (kind == LM_PARAMS && lt->store != LM_NO_STORE) { /* a frozen tensor kept in bf16: FSDP's bf16 shard */
            if (p->fsdp) fsdp_take_store(p->fsdp, lt->store + la * cols, src, n * cols);
            else lm_put_rows(p->m, i, la, la + n, src);
            continue;
        }
        size_t off = lt->offset + la * cols;
        if (p->fsdp) {
            float *shard = kind == LM_PARAMS ? p->fsdp->params : kind == LM_EXP_AVG ? p->opt->m : p->opt->v;
            fsdp_take_range(p->fsdp, shard, off, src, n * cols);
        } else {
            float *dst = kind == LM_PARAMS ? p->m->params : kind == LM_EXP_AVG ? p->opt->m : p->opt->v;
            memcpy(dst + off, src, n * cols * sizeof(float));
        }
    }
}

/* A held run of an FSDP shard (fsdp_held_runs): flat [x, x + n) of the
 * local buffer; marks the local rows of tensor lt it touches. */
typedef struct {
    const lm_tensor *lt;
    size_t cols;
    unsigned char *need;
} held_rows_ctx;

static void held_rows(void *ctx, size_t x, size_t n, size_t s) {
    (void)s;
    held_rows_ctx *c = ctx;
    size_t a = c->lt->offset, b = a + c->lt->numel, lo = x > a ? x : a, hi = x + n < b ? x + n : b;
    if (lo < hi) memset(c->need + (lo - a) / c->cols, 1, (hi - a + c->cols - 1) / c->cols - (lo - a) / c->cols);
}

void plan_load_rows(const ct_plan *p, int kind, int i, void (*add)(void *acc, size_t r0, size_t r1), void *acc) {
    const lm_tensor *lt = &p->m->tensors[i], *ft = &p->load.whole->tensors[i];
    size_t fc = lm_tensor_cols(ft), fr = fc ? ft->numel / fc : 0;
    if (!lt->numel || !fr) return; /* another stage's layer, another EP rank's expert */
    size_t lc = lm_tensor_cols(lt), lr = lt->numel / lc;
    unsigned char *need = ct_calloc(lr + 1, 1); /* the local rows kept */
    if (p->fsdp && !(kind == LM_PARAMS && lt->store != LM_NO_STORE)) {
        held_rows_ctx c = {lt, lc, need};
        for (int k = 0; k < p->fsdp->n_pieces; k++) {
            const fsdp_piece *q = &p->fsdp->p[k];
            if (q->off < lt->offset + lt->numel && q->off + q->n > lt->offset) fsdp_held_runs(p->fsdp, k, held_rows, &c);
        }
    } else {
        memset(need, 1, lr); /* a bf16-stored frozen tensor's shard is cut otherwise: all of its rows */
    }
    float *row = p->tp ? ct_calloc(fc, sizeof(float)) : NULL;
    size_t fb[3], start = 0;
    int nb = p->tp ? tp_row_blocks(p->tp, ft, fb) : 1, open = 0;
    for (size_t r = 0; r < fr; r++) {
        int keep = 0;
        if (!p->tp) {
            keep = r < lr && need[r]; /* no slice: local rows are the whole tensor's */
        } else {
            /* which local row (if any) whole row r becomes: tp_take_rows on that one row, as load_put calls it */
            for (int k = 0; k < nb && !keep; k++) {
                const float *src;
                size_t la = 0, n = tp_take_rows(p->tp, lt, ft, k, r, r + 1, row, p->load.tmp, &src, &la);
                keep = n && la < lr && need[la];
            }
        }
        if (keep && !open) start = r, open = 1;
        if (!keep && open) add(acc, start, r), open = 0;
    }
    if (open) add(acc, start, fr);
    free(row);
    free(need);
}

/* ------------------------------------------------------------ the hooks */

/* The composed per-layer hooks (plan.h): p->hk[0] the outer layout (FSDP, or
 * the replicas' overlapped all-reduce), p->hk[1] the inner (tensor parallel).
 * pre hooks outer first, post hooks inner first. */
static void h_pre_forward(void *ctx, int l) {
    ct_plan *p = ctx;
    for (int i = 0; i < p->n_hk; i++) p->hk[i]->pre_forward(p->hk[i]->ctx, l);
}
static void h_post_forward(void *ctx, int l) {
    ct_plan *p = ctx;
    for (int i = p->n_hk - 1; i >= 0; i--) p->hk[i]->post_forward(p->hk[i]->ctx, l);
}
static void h_pre_backward(void *ctx, int l) {
    ct_plan *p = ctx;
    for (int i = 0; i < p->n_hk; i++) p->hk[i]->pre_backward(p->hk[i]->ctx, l);
}
static void h_post_backward(void *ctx, int l) {
    ct_plan *p = ctx;
    for (int i = p->n_hk - 1; i >= 0; i--) p->hk[i]->post_backward(p->hk[i]->ctx, l);
}
static void h_reduce_partial(void *ctx, float *x, size_t n) {
    ct_plan *p = ctx;
    p->hk[p->n_hk - 1]->reduce_partial(p->hk[p->n_hk - 1]->ctx, x, n);
}
static void h_reduce_max(void *ctx, float *x, size_t n) {
    ct_plan *p = ctx;
    p->hk[p->n_hk - 1]->reduce_max(p->hk[p->n_hk - 1]->ctx, x, n);
}

int plan_ready(ct_plan *p, ct_err *e) {
    lm_model *m = p->m;
    int rc = 0;
    build_opt_ranges(p);
    /* 4. replicas without FSDP: each layer's all-reduce during the backward (under expert parallel the
     * replicas hold different experts, and with frozen tensors only the trained runs are summed: both
     * after the backward, in plan_reduce_grads) */
    if (!p->fsdp && !p->pp && p->mesh.dp_replicate > 1 && p->mesh.ep == 1 && !m->n_frozen) rc = dp_overlap_init(p, e);
    m->hooks = NULL; /* composed below, not wrapped */
    p->n_hk = 0;
    if (p->fsdp) p->hk[p->n_hk++] = &p->fsdp->hooks;
    else if (p->dpo) p->hk[p->n_hk++] = &p->dpo->hooks;
    if (!rc && p->tp) {
        tp_attach(p->tp, m); /* with no inner hooks: only its own */
        if (m->hooks) p->hk[p->n_hk++] = m->hooks;
    }
    if (!rc && p->mesh.ep > 1) {
        p->ep = ct_calloc(1, sizeof *p->ep);
        rc = ep_init(p->ep, m, &p->mesh.epg, e);
    }
    p->hooks = (lm_hooks){p, h_pre_forward, h_post_forward, h_pre_backward, h_post_backward,
                          p->tp && p->tp->t > 1 ? h_reduce_partial : NULL, p->tp && p->tp->t > 1 ? h_reduce_max : NULL};
    m->hooks = p->n_hk ? &p->hooks : NULL;
    return rc;
}

void plan_profile(ct_plan *p, struct prof *pf) {
    ct_mesh *ms = &p->mesh;
    ct_comm *all[] = {ms->world, &ms->ppg, &ms->rep, &ms->shard, &ms->dp, &ms->tpg, &ms->epg, &ms->edp, &ms->slices,
                      &p->tie, &ms->cpg};
    for (size_t i = 0; i < sizeof all / sizeof *all; i++)
        if (all[i]) all[i]->prof = pf;
    if (p->m) p->m->prof = pf;
}

void plan_free(ct_plan *p) {
    if (p->m) p->m->hooks = NULL;
    if (p->pp) pp_free(p->pp);
    free(p->pp);
    if (p->ep) ep_free(p->ep);
    free(p->ep);
    if (p->cp) cp_free(p->cp);
    free(p->cp);
    if (p->tp) tp_free(p->tp);
    free(p->tp);
    dp_overlap_free(p);
    if (p->fsdp) fsdp_free(p->fsdp);
    free(p->fsdp);
    if (p->tie.be) comm_free(&p->tie);
    mesh_free(&p->mesh);
    free(p->opt_ranges);
    memset(p, 0, sizeof *p);
}

/* ------------------------------------------------------------ loading */

lm_sink plan_load_begin(ct_plan *p, const lm_model **whole) {
    lm_model *m = p->m;
    p->load.whole = m;
    if (p->tp || p->pp) { /* this rank holds part of the model: the loaders walk the whole one */
        lm_layout(&p->load.table, &p->whole);
        p->load.whole = &p->load.table;
    }
    if (p->tp) {
        tp_classify(p->tp, m, &p->load.table);
        size_t most = 1; /* tp_take_rows copies only the column slices (row-parallel tensors) */
        for (int i = 0; i < m->n_tensors; i++) {
            const lm_tensor *lt = &m->tensors[i], *ft = &p->load.table.tensors[i];
            if (lm_tensor_cols(lt) < lm_tensor_cols(ft) && lt->numel > most) most = lt->numel;
        }
        p->load.tmp = ct_malloc(most * sizeof(float));
    }
    p->load.sink = (lm_sink){load_put, p};
    *whole = p->load.whole;
    return p->load.sink;
}

void plan_load_end(ct_plan *p) {
    free(p->load.tmp);
    if (p->load.whole == &p->load.table) lm_free(&p->load.table);
    memset(&p->load, 0, sizeof p->load);
}

/* ------------------------------------------------------------ the step */

int plan_microbatches(const ct_plan *p) { return p->pp ? p->pp->M : p->grad_accum; }

int plan_seq_len(const ct_plan *p) { return p->cfg->seq_len / (p->mesh.cp > 1 ? p->mesh.cp : 1); }

void plan_model_shape(const ct_config *c, int pipeline, int cp, int *B, int *T) {
    int val_b = c->val_local_batch_size > 0 ? c->val_local_batch_size : c->local_batch_size;
    int tb = pipeline ? c->pp_microbatch : c->local_batch_size, vb = pipeline ? c->pp_microbatch : val_b;
    int Tt = c->seq_len / cp, Tv = cfg_val_seq_len(c) / cp;
    long rows = (long)tb * Tt, vrows = (long)vb * Tv;
    if (vrows > rows) rows = vrows;
    *T = Tt > Tv ? Tt : Tv;
    *B = (int)((rows + *T - 1) / *T);
}

double plan_forward_backward(ct_plan *p, const int32_t *tokens, const int32_t *labels, int B, int T, float scale,
                             uint64_t seed, double *aux_sum) {
    lm_model *m = p->m;
    *aux_sum = 0;
    /* LoRA dropout: row j of tokens is sequence j D + r of the step's global batch
     * (ds_set_shard's rank r of D), whatever the micro-batch split */
    int D = p->mesh.dp_size > 0 ? p->mesh.dp_size : 1;
    long r = p->mesh.dp_rank;
    m->lora_seed = seed;
    if (p->cp) cp_set_len(p->cp, p->cfg->seq_len); /* after a validation at another length */
    if (p->pp && p->cp) { /* the schedule owns the step, on this rank's chunk of every sequence */
        cp_chunk(p->cp, tokens, labels, p->pp->M * p->pp->mb_size);
        return pp_step(p->pp, m, p->cp->tok, p->cp->lab, r, D, scale);
    }
    if (p->pp) return pp_step(p->pp, m, tokens, labels, r, D, scale); /* the schedule owns the step */
    size_t mb = (size_t)B * T;
    double loss = 0;
    for (int a = 0; a < p->grad_accum; a++) {
        if (p->fsdp) fsdp_microbatch_begin(p->fsdp);
        if (p->dpo) p->dpo->armed = a == p->grad_accum - 1; /* the gradients are final in the last one */
        if (p->fsdp) p->fsdp->rep_armed = a == p->grad_accum - 1;
        m->lora_seq0 = r + (long)a * B * D, m->lora_seq_stride = D;
        if (p->cp && m->moe.n_layers) { /* the routing sums of the whole sequences before the backward */
            loss += cp_moe_forward_backward(p->cp, tokens + a * mb, labels + a * mb, B, scale);
        } else if (p->cp) { /* this rank's chunk of the micro-batch's sequences */
            cp_chunk(p->cp, tokens + a * mb, labels + a * mb, B);
            loss += lm_forward_backward(m, p->cp->tok, p->cp->lab, B, p->cp->Tl, scale, NULL);
        } else {
            loss += lm_forward_backward(m, tokens + a * mb, labels + a * mb, B, T, scale, NULL);
        }
        if (p->dpo) p->dpo->armed = 0;
        if (p->fsdp) fsdp_microbatch_end(p->fsdp);
        *aux_sum += m->moe.aux_loss;
    }
    return loss;
}

/* Pipeline: HF's load-balancing loss of each micro-batch from the sums of
 * every stage's MoE layers (the loss is a function of their totals). */
static double pp_aux_sum(ct_plan *p) {
    pp_sched *s = p->pp;
    int E = s->E;
    comm_allreduce(&p->mesh.ppg, s->moe_stats, (size_t)s->M * 2 * E, COMM_F64, COMM_SUM);
    if (p->cp) /* every chunk's tokens: the loss of the whole sequences (as cp_moe_aux) */
        comm_allreduce(&p->mesh.cpg, s->moe_stats, (size_t)s->M * 2 * E, COMM_F64, COMM_SUM);
    double sum = 0;
    for (int i = 0; i < s->M; i++)
        sum += moe_aux_loss(NULL, s->moe_stats + (size_t)i * 2 * E, s->moe_stats + (size_t)i * 2 * E + E,
                            s->mb_size * p->cfg->seq_len, p->m->moe.n_layers, E, 0.0);
    return sum;
}

void plan_sum_loss(ct_plan *p, double *loss_sum, double *aux_sum, double *aux_mean) {
    double t0 = ct_now();
    int moe = p->m->moe.n_layers > 0;
    if (p->pp) { /* the loss is the last stage's; the routing sums every stage's */
        comm_allreduce(&p->mesh.ppg, loss_sum, 1, COMM_F64, COMM_SUM);
        if (moe) *aux_sum = pp_aux_sum(p);
    }
    if (p->pp && moe) { /* each stage measured the load of its own MoE layers (-1 elsewhere) */
        for (int l = 0; l < p->m->cfg.n_layers; l++)
            if (!lm_holds_layer(&p->m->cfg, l)) p->m->moe.load_min[l] = p->m->moe.load_max[l] = -1;
        comm_allreduce(&p->mesh.ppg, p->m->moe.load_min, (size_t)p->m->cfg.n_layers, COMM_I32, COMM_MAX);
        comm_allreduce(&p->mesh.ppg, p->m->moe.load_max, (size_t)p->m->cfg.n_layers, COMM_I32, COMM_MAX);
    }
    comm_allreduce(&p->mesh.dp, loss_sum, 1, COMM_F64, COMM_SUM);
    /* every chunk's targets (the load-balancing loss is already the whole sequences', cp_moe_aux) */
    if (p->cp) comm_allreduce(&p->mesh.cpg, loss_sum, 1, COMM_F64, COMM_SUM);
    if (moe) comm_allreduce(&p->mesh.dp, aux_sum, 1, COMM_F64, COMM_SUM);
    *aux_mean = *aux_sum / ((double)plan_microbatches(p) * p->mesh.dp_size);
    p->comm_s += ct_now() - t0;
}

void plan_sum_dp(ct_plan *p, void *x, size_t n, comm_dtype t) {
    double t0 = ct_now();
    comm_allreduce(&p->mesh.dp, x, n, t, COMM_SUM);
    p->comm_s += ct_now() - t0;
}

double plan_eval(ct_plan *p, const int32_t *tokens, const int32_t *labels, int B, int T, long *n_valid) {
    fsdp *f = p->pp ? NULL : p->fsdp; /* a pipeline's stages open their own FSDP micro-batches */
    if (f) {
        f->fwd_only = 1; /* forward only: every layer is freed right after its forward */
        fsdp_microbatch_begin(f);
    }
    double sum;
    if (p->cp) { /* validation runs under context parallel too: this rank's chunk of its windows' length */
        cp_set_len(p->cp, T);
        cp_chunk(p->cp, tokens, labels, B);
        sum = p->pp ? pp_eval(p->pp, p->m, p->cp->tok, p->cp->lab, B, p->cp->Tl, n_valid)
                    : lm_loss(p->m, p->cp->tok, p->cp->lab, B, p->cp->Tl, n_valid);
    } else {
        sum = p->pp ? pp_eval(p->pp, p->m, tokens, labels, B, T, n_valid)
                    : lm_loss(p->m, tokens, labels, B, T, n_valid);
    }
    if (f) {
        fsdp_microbatch_end(f);
        f->fwd_only = 0;
    }
    return sum;
}

void plan_sum_eval(ct_plan *p, double *sum, long *n) {
    int64_t nn = *n;
    if (p->pp) { /* a pipeline's last stage scored them */
        comm_allreduce(&p->mesh.ppg, sum, 1, COMM_F64, COMM_SUM);
        comm_allreduce(&p->mesh.ppg, &nn, 1, COMM_I64, COMM_SUM);
    }
    comm_allreduce(&p->mesh.dp, sum, 1, COMM_F64, COMM_SUM); /* every data-parallel rank its own windows */
    comm_allreduce(&p->mesh.dp, &nn, 1, COMM_I64, COMM_SUM);
    if (p->cp) { /* and every chunk of them */
        comm_allreduce(&p->mesh.cpg, sum, 1, COMM_F64, COMM_SUM);
        comm_allreduce(&p->mesh.cpg, &nn, 1, COMM_I64, COMM_SUM);
    }
    *n = (long)nn;
}

/* Flat offset of tensor i of m's table; n_params for i == n_tensors. */
static size_t save_offset(const lm_model *m, int i) {
    return i < m->n_tensors ? m->tensors[i].offset : m->n_params;
}

static int layer_of(const char *name) { return strncmp(name, "model.layers.", 13) ? -1 : atoi(name + 13); }

/* The units of a streamed save, as tensor index ranges [u[k], u[k + 1]):
 * k = 0 what comes before layer 0 (the embedding), 1 + l layer l, L + 1 the
 * rest (final norm, lm_head): FSDP's pieces, grouped by layer. The same
 * indices in every rank's table and the whole model's. */
static void save_units(const lm_model *m, int *u) {
    int L = m->cfg.n_layers, i = 0;
    u[0] = 0;
    while (i < m->n_tensors && layer_of(m->tensors[i].name) < 0) i++;
    for (int l = 0; l < L; l++) {
        u[1 + l] = i;
        while (i < m->n_tensors && layer_of(m->tensors[i].name) == l) i++;
    }
    u[L + 1] = i;
    u[L + 2] = m->n_tensors;
}

/* Saves hold every tensor whole whatever the layout. Rank 0 writes them as
 * a stream, one unit (the embedding, a layer, the head) at a time: FSDP
 * brings each piece of the unit to its group's root (replica 0, and under
 * EP the first ep shard ranks for their experts), tensor/expert parallelism
 * brings those roots' parts to rank 0 (tp_gather_range over mesh.slices),
 * rank 0 hands the whole tensors to put and frees them. Beyond its own
 * state a rank holds about one unit (three with TP: its part, the received
 * parts, the assembled unit), where gathering the whole model and both
 * moments first needed 12 bytes a parameter on rank 0. Every rank runs the
 * same loop, so the collectives match; once put fails (*rc set on rank 0)
 * rank 0 stops writing but not the loop. kinds: 1 the parameters, 3 also
 * exp_avg then exp_avg_sq. fm: the whole model's table (rank 0). frozen_too: bf16-stored
 * frozen weights are widened for the read (0: the put takes trained tensors only). */
void plan_save_gather(ct_plan *p, const lm_model *fm, int kinds, int frozen_too, plan_put_fn put, void *ctx,
                      int *rc, ct_err *e) {
    lm_model *lm = p->m; /* not changed: bf16-stored weights are only widened for the read */
    int rank0 = p->mesh.world->rank == 0, L = lm->cfg.n_layers;
    /* each pipeline stage gathers the units it holds to its own root, which
     * passes them on to rank 0 (the root of stage 0) */
    int sroot = plan_save_root(p);
    int fsdp_part = p->fsdp && p->mesh.rep_rank == 0 && p->mesh.cp_rank == 0; /* chunk 0's ranks: the others
                                                                                 * hold the same shards */
    int fsdp_root = fsdp_part && p->mesh.shard_rank < p->mesh.ep;
    int in_slices = p->tp && p->mesh.dp_rank < p->mesh.ep && p->mesh.cp_rank == 0; /* mesh.slices: chunk 0's */
    int *u = ct_malloc(((size_t)L + 3) * sizeof *u);
    save_units(lm, u);
    for (int k = 0; k < kinds; k++) {
        const float *src = k == 0 ? (p->fsdp ? p->fsdp->params : lm->params) : k == 1 ? p->opt->m : p->opt->v;
        for (int x = 0; x < L + 2; x++) {
            int holder = p->pp ? pp_unit_stage(p->pp, x, L) : 0, mine = holder == p->mesh.pp_rank;
            size_t n = sroot || rank0 ? save_offset(fm, u[x + 1]) - save_offset(fm, u[x]) : 0;
            if (!mine) { /* another stage's unit: rank 0 receives it from that stage's root */
                if (rank0) {
                    float *got = ct_malloc((n + 1) * sizeof(float));
                    comm_recv(&p->mesh.ppg, got, n, COMM_F32, holder, 0);
                    if (!*rc) *rc = put(ctx, fm, u[x], u[x + 1], got, n, e);
                    free(got);
                }
                continue;
            }
            size_t lo = save_offset(lm, u[x]), hi = save_offset(lm, u[x + 1]);
            /* bf16-stored frozen weights: the unit widened into params while it is read, when
             * the put wants them (an HF export; not a checkpoint or an adapter of trained ones);
             * under FSDP the gather widens them from the bf16 shard */
            int widen = k == 0 && !p->fsdp && frozen_too;
            if (widen) lm_frozen_widen(lm, lo, hi - lo, 1);
            const float *part = src + lo; /* this rank's floats of the unit */
            float *got = NULL, *whole = NULL;
            if (p->fsdp) { /* under FSDP src is the shard: gather the unit's pieces */
                part = got = fsdp_root ? ct_calloc(hi - lo + 1, sizeof(float)) : NULL;
                int a = x == 0 ? 0 : p->fsdp->lp[x - 1], b = x <= L ? p->fsdp->lp[x] : p->fsdp->n_pieces;
                for (int i = a; fsdp_part && i < b; i++)
                    fsdp_gather_piece(p->fsdp, i, got ? got + (p->fsdp->p[i].off - lo) : NULL, src, 0,
                                      k == 0 && frozen_too);
            }
            if (in_slices) {
                if (sroot) whole = ct_malloc((n + 1) * sizeof(float));
                tp_gather_range(p->tp, &p->mesh.slices, u[x], u[x + 1], fm, whole, lm, part);
                part = whole;
            }
            if (rank0 && !*rc) *rc = put(ctx, fm, u[x], u[x + 1], part, n, e);
            else if (sroot && !rank0) comm_send(&p->mesh.ppg, part, n, COMM_F32, 0, 0);
            if (widen) lm_frozen_widen(lm, lo, hi - lo, 0);
            free(whole);
            free(got);
        }
    }
    free(u);
}


/* Where a TP/EP rank's local tensor lt lies in the whole tensor ft: local
 * row k is whole row row[k], and in every local row the local columns
 * [cr[j][0], + cr[j][2]) are whole columns [cr[j][1], + cr[j][2]) (a
 * row-parallel weight's block, an expert adapter's picks; one run of every
 * column otherwise). Probed through tp_take_rows, the load's own slicing,
 * on a row holding its column indices, so a save in parts and a load agree
 * with the gather (tp_gather_range) by construction rather than by a second
 * copy of the rules. */
typedef struct {
    size_t *row; /* [local rows]; NULL: lt is the whole tensor, not a slice */
    size_t (*cr)[3];
    int ncr;
    int mixed;   /* some row's columns are not the first's (never, by tp.c's slicing; a save refuses it) */
    size_t lc, fc;
} slice_map;

/* first_only: the column runs only (stops at the first row this rank keeps) */
static void slice_map_build(const tp_layout *tp, const lm_tensor *lt, const lm_tensor *ft, int first_only,
                            slice_map *s) {
    memset(s, 0, sizeof *s);
    size_t fc = lm_tensor_cols(ft), fr = fc ? ft->numel / fc : 0, lc = lm_tensor_cols(lt);
    s->lc = lc, s->fc = fc;
    if (!lt->numel || !fr) return;
    size_t lr = lt->numel / lc, fb[3];
    float *idx = ct_malloc((fc + 1) * sizeof(float)), *tmp = ct_malloc((lc + 1) * sizeof(float));
    for (size_t c = 0; c < fc; c++) idx[c] = (float)c; /* exact: a row has far fewer than 2^24 columns */
    if (!first_only) s->row = ct_calloc(lr + 1, sizeof *s->row);
    int nb = tp_row_blocks(tp, ft, fb), got = 0;
    for (size_t r = 0; r < fr && !(first_only && got); r++)
        for (int k = 0; k < nb; k++) {
            const float *src;
            size_t la = 0;
            if (!tp_take_rows(tp, lt, ft, k, r, r + 1, idx, tmp, &src, &la) || la >= lr) continue;
            if (s->row) s->row[la] = r;
            if (got++) { /* the columns are the first row's in every row: checked where a save relies on it */
                for (int q = 0; q < s->ncr && !first_only && !s->mixed; q++)
                    for (size_t w = 0; w < s->cr[q][2] && !s->mixed; w++)
                        s->mixed = (size_t)src[s->cr[q][0] + w] != s->cr[q][1] + w;
                continue;
            }
            s->cr = ct_malloc((lc + 1) * sizeof *s->cr);
            for (size_t j = 0; j < lc;) {
                size_t c = (size_t)src[j], w = 1;
                while (j + w < lc && (size_t)src[j + w] == c + w) w++;
                s->cr[s->ncr][0] = j, s->cr[s->ncr][1] = c, s->cr[s->ncr][2] = w;
                s->ncr++;
                j += w;
            }
        }
    free(idx);
    free(tmp);
}

static void slice_map_free(slice_map *s) {
    free(s->row);
    free(s->cr);
    memset(s, 0, sizeof *s);
}

void plan_load_cols(const ct_plan *p, int kind, int i, void (*add)(void *acc, size_t c0, size_t c1), void *acc) {
    (void)kind; /* a tensor's moments are sliced as its parameters */
    if (!p->tp) return;
    slice_map s;
    slice_map_build(p->tp, &p->m->tensors[i], &p->load.whole->tensors[i], 1, &s);
    int whole = s.ncr == 1 && s.cr[0][2] == s.fc;
    for (int j = 0; j < s.ncr && !whole; j++) add(acc, s.cr[j][1], s.cr[j][1] + s.cr[j][2]);
    slice_map_free(&s);
}

/* A held FSDP run (fsdp_held_runs) cut at the local tensors' boundaries,
 * then (TP/EP: maps[j].row) into runs of the whole tensor; consecutive
 * pieces that are contiguous both in the whole tensor and in x go to put
 * as one (a column-parallel slice's rows, a row-parallel one's rows never). */
typedef struct {
    const lm_model *m;
    const float *src; /* the shard buffer of this kind */
    const unsigned char *mine; /* [tensor] this rank writes it (a tied embedding's other copy, another TP or
                                * EP rank's replica and frozen tensors not) */
    const slice_map *maps;     /* [tensor] under TP/EP; NULL: local tensors are the whole ones */
    int kind, rc;
    int pj;                    /* the pending run: whole tensor pj's [pat, pat + pn) from px */
    size_t pat, pn;
    const float *px;
    plan_part_fn put;
    void *ctx;
    ct_err *e;
} parts_ctx;

static void parts_flush(parts_ctx *c) {
    if (c->pn && !c->rc) c->rc = c->put(c->ctx, c->kind, c->pj, c->pat, c->px, c->pn, c->e);
    c->pn = 0;
}

static void parts_put(parts_ctx *c, int j, size_t at, const float *x, size_t n) {
    if (c->pn && c->pj == j && c->pat + c->pn == at && c->px + c->pn == x) {
        c->pn += n;
        return;
    }
    parts_flush(c);
    c->pj = j, c->pat = at, c->px = x, c->pn = n;
}

/* Elements [a, a + n) of local tensor j, x their values, to their places in the whole tensor. */
static void parts_local(parts_ctx *c, int j, size_t a, const float *x, size_t n) {
    const slice_map *s = c->maps ? &c->maps[j] : NULL;
    if (!s || !s->row) {
        parts_put(c, j, a, x, n);
        return;
    }
    for (size_t k = a; k < a + n && !c->rc;) {
        size_t lrow = k / s->lc, base = lrow * s->lc, end = base + s->lc < a + n ? base + s->lc : a + n;
        for (int q = 0; q < s->ncr; q++) { /* this row's part [k, end) of each column run */
            size_t l0 = base + s->cr[q][0], l1 = l0 + s->cr[q][2];
            size_t u = k > l0 ? k : l0, v = end < l1 ? end : l1;
            if (u < v) parts_put(c, j, s->row[lrow] * s->fc + s->cr[q][1] + (u - l0), x + (u - a), v - u);
        }
        k = end;
    }
}

static void held_parts(void *ctx, size_t x, size_t n, size_t s) {
    parts_ctx *c = ctx;
    for (int j = 0; j < c->m->n_tensors && !c->rc; j++) {
        const lm_tensor *t = &c->m->tensors[j];
        size_t a = x > t->offset ? x : t->offset, b = x + n < t->offset + t->numel ? x + n : t->offset + t->numel;
        if (a < b && c->mine[j]) parts_local(c, j, a - t->offset, c->src + s + (a - x), b - a);
    }
}

int plan_save_parts(ct_plan *p, int kinds, plan_part_fn put, void *ctx, ct_err *e) {
    lm_model *lm = p->m;
    /* the other replicas and chunks hold the same values; without FSDP the first data-parallel rank
     * writes (under expert parallel, which runs among the replicas then, the first ep: their experts) */
    if (p->mesh.cp_rank != 0 || (p->fsdp ? p->mesh.rep_rank != 0 : p->mesh.dp_rank >= p->mesh.ep)) return 0;
    int rc = 0, L = lm->cfg.n_layers, *u = ct_malloc(((size_t)L + 3) * sizeof *u);
    unsigned char *mine = ct_calloc((size_t)lm->n_tensors + 1, 1);
    save_units(lm, u);
    for (int x = 0; x < L + 2; x++) /* the stage plan_save_gather takes each unit from */
        for (int j = u[x]; j < u[x + 1]; j++)
            mine[j] = !lm->tensors[j].frozen && (!p->pp || pp_unit_stage(p->pp, x, L) == p->mesh.pp_rank);
    free(u);
    slice_map *maps = NULL;
    if (p->tp) {
        lm_model fm;
        lm_layout(&fm, &p->whole);
        tp_classify(p->tp, lm, &fm); /* which tensors are sliced, which are experts' */
        maps = ct_calloc((size_t)lm->n_tensors + 1, sizeof *maps);
        for (int j = 0; j < lm->n_tensors; j++) {
            /* replicated over the TP group: TP index 0's; a non-expert tensor without FSDP is on every EP
             * rank whole (under FSDP the shard group, EP ranks included, holds one copy between them) */
            if ((!p->tp->sharded[j] && p->tp->rank != 0) || (!p->fsdp && !p->tp->expert[j] && p->tp->ep_rank != 0))
                mine[j] = 0;
            if (mine[j]) slice_map_build(p->tp, &lm->tensors[j], &fm.tensors[j], 0, &maps[j]);
            if (maps[j].mixed && !rc)
                rc = ct_fail(e, CT_ERR_IO, "%s: this rank's slice takes other columns in different rows; a save "
                             "in parts cannot place it (CTITAN_CKPT_GATHER=1 gathers it)", lm->tensors[j].name);
            if (maps[j].row && lm->tensors[j].numel == fm.tensors[j].numel && maps[j].ncr == 1 && !maps[j].cr[0][1]) {
                free(maps[j].row); /* whole: written as it is */
                maps[j].row = NULL;
            }
        }
        lm_free(&fm);
    }
    parts_ctx c = {.m = lm, .mine = mine, .maps = maps, .rc = rc, .put = put, .ctx = ctx, .e = e};
    for (int k = 0; k < kinds && !c.rc; k++) {
        c.kind = k == 0 ? LM_PARAMS : k == 1 ? LM_EXP_AVG : LM_EXP_AVG_SQ;
        c.src = k == 0 ? (p->fsdp ? p->fsdp->params : lm->params) : k == 1 ? p->opt->m : p->opt->v;
        if (p->fsdp) {
            for (int i = 0; i < p->fsdp->n_pieces && !c.rc; i++) fsdp_held_runs(p->fsdp, i, held_parts, &c);
        } else {
            for (int j = 0; j < lm->n_tensors && !c.rc; j++) { /* under a pipeline, another stage's tensors are empty */
                const lm_tensor *t = &lm->tensors[j];
                if (t->numel && mine[j]) parts_local(&c, j, 0, c.src + t->offset, t->numel);
            }
        }
        parts_flush(&c);
    }
    for (int j = 0; maps && j < lm->n_tensors; j++) slice_map_free(&maps[j]);
    free(maps);
    free(mine);
    return c.rc;
}

/* ------------------------------------------------------------ saving */

int plan_holds_part(const ct_plan *p) { return p->pp || p->tp; }

int plan_save_root(const ct_plan *p) {
    return p->pp ? p->mesh.world->rank % p->mesh.stage == 0 : p->mesh.world->rank == 0;
}

void plan_gather_bias(ct_plan *p) {
    lm_model *m = p->m;
    if (!p->pp || !m->moe.n_layers || p->cfg->load_balance_coeff <= 0) return;
    int E = m->cfg.n_experts;
    for (int l = 0; l < m->cfg.n_layers; l++) /* others' rows: theirs win the sum */
        if (!lm_holds_layer(&m->cfg, l)) memset(m->moe.bias + (size_t)l * E, 0, (size_t)E * sizeof(float));
    comm_allreduce(&p->mesh.ppg, m->moe.bias, (size_t)m->cfg.n_layers * E, COMM_F32, COMM_SUM);
}

/* ------------------------------------------------------------ the log */

double plan_take_comm_time(ct_plan *p) {
    double s = p->comm_s;
    p->comm_s = 0;
    return s;
}

long plan_take_overlapped(ct_plan *p) {
    long n = p->overlapped;
    p->overlapped = 0;
    return n;
}

double plan_take_bubble(ct_plan *p) {
    if (!p->pp) return -1;
    /* the mean over the stages of the share each spent waiting: the idle share of
     * P x the step, as the schedule's simulated bubble counts it */
    double b = pp_take_bubble(p->pp);
    comm_allreduce(&p->mesh.ppg, &b, 1, COMM_F64, COMM_SUM);
    return b / p->mesh.pp;
}

void plan_layout_str(const ct_plan *p, char *buf, size_t cap) {
    const ct_mesh *ms = &p->mesh;
    char pp[48] = "";
    char cp[40] = "";
    if (ms->pp > 1) snprintf(pp, sizeof pp, "pipeline_parallel %d x ", ms->pp);
    if (ms->cp > 1) snprintf(cp, sizeof cp, "context_parallel %d x ", ms->cp);
    snprintf(buf, cap, "world %d = %sdata_parallel_replicate %d x data_parallel_shard %d x %stensor_parallel %d (%s)",
             ms->world->size, pp, ms->dp_replicate, ms->dp_shard, cp, ms->tp, ms->world->be->name);
}

void plan_describe(const ct_plan *p, FILE *f) {
    const ct_mesh *ms = &p->mesh;
    const ct_config *c = p->cfg;
    if (ms->pp > 1) {
        const pp_sched *s = p->pp;
        fprintf(f, "ctitan: pipeline_parallel %d (%s%s%s): %d stage(s) per rank, %d micro-batches of %d per step, "
                   "simulated bubble %.1f%%; stages' first layers:",
                ms->pp, c->pp_schedule, c->pp_csv[0] ? ", the order of " : "", c->pp_csv, s->S, s->M, s->mb_size,
                100.0 * s->bubble);
        for (int v = 0; v < s->V; v++) fprintf(f, " %d", s->first[v]);
        fprintf(f, "\n");
    }
    if (p->cp) cp_describe(p->cp, f);
    if (p->ep)
        fprintf(f, "ctitan: expert_parallel %d: rank 0 runs experts 0..%d of %d and stores only those, the others "
                   "theirs, on every rank's tokens\n",
                ms->ep, p->ep->El - 1, p->whole.n_experts);
}
