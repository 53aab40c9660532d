/* distributed/plan_dry.c: what one rank of a layout plans, for
 * `ctitan train --dry-run` (train/trainer_plan.c prints the whole model
 * first): its TP/EP slice and FSDP shard, computed with the run's own code
 * (tp_local_config, lm_plan_memory, FSDP's cut of the tensor table), or with
 * pipeline stages what every stage's rank plans (pp_plan, pp_hold) and the
 * schedule's bubble. Nothing is allocated beyond tensor tables. */
#include "distributed/cp.h"
#include "distributed/plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/lora.h"

void plan_dry_line(FILE *out, const char *what, double bytes) {
    fprintf(out, "  %-34s %10.3f GiB  %15.0f bytes\n", what, bytes / (1024.0 * 1024.0 * 1024.0), bytes);
}

/* --dry-run per rank: what FSDP keeps of a rank's local model, cut into
 * pieces by fsdp_cut, as fsdp_init cuts them, from the same tensor table, with
 * no communicator: the embedding, each layer (its experts a piece of their
 * own under expert parallel, over n_exp ranks), the head; each piece in
 * slices of ceil(n / its group). */
typedef struct {
    size_t shard;     /* fp32 floats of a rank's slices of every piece (the bf16-stored matrices apart) */
    size_t sshard;    /* bf16 words of a rank's slices of the bf16-stored frozen matrices */
    size_t trained;   /* of shard, the floats of tensors not frozen (gradients, moments) on the rank that
                         holds the most of them (a layer's adapters come last, in its last ranks' slices) */
    /* bytes of a gathered piece: parameters (fp32, and bf16 for the stored matrices), gradients
     * (fp32, none for the stored matrices) */
    double layer_p, layer_g; /* the largest layer, its pieces together */
    double layers_p;         /* every layer's parameters */
    double embed_p, embed_g, head_p, head_g;
} dry_fsdp;

static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* Bytes of context parallel's attention scratch, B sequences of the whole length
 * T on the heads of lc (a TP slice's): what cp_init allocates for the
 * configured load balancer and rotate method (cp_scratch_floats, in fp32). */
static double dry_cp_scratch(const lm_config *lc, int B, int T, const ct_config *c) {
    return 4.0 * cp_scratch_floats(B, T, c->cp, !strcmp(c->cp_balancer, "headtail"),
                                   !strcmp(c->cp_rotate, "alltoall"), lc->n_heads, lc->n_kv_heads, lc->head_dim);
}

static int dry_fsdp_plan(const lm_model *m, int n, int n_exp, dry_fsdp *d, ct_err *e) {
    memset(d, 0, sizeof *d);
    int L = m->cfg.n_layers;
    fsdp_piece *p = ct_calloc(2 * (size_t)L + 2, sizeof *p);
    int *lp = ct_calloc((size_t)L + 1, sizeof(int));
    int np = fsdp_cut(m, n_exp > 0, p, lp, e); /* fsdp_init's own cut */
    size_t *per = ct_calloc((size_t)n, sizeof *per); /* trained floats of each rank's slices */
    size_t *slice = ct_calloc((size_t)n, sizeof *slice); /* of one piece's slices */
    for (int i = 0; i < np; i++) {
        int g = p[i].experts ? n_exp : n;
        size_t chunk = ceil_div(p[i].n32, (size_t)g);
        d->shard += chunk;
        d->sshard += ceil_div(p[i].sn, (size_t)g);
        /* slice r holds packed positions [r chunk, (r + 1) chunk) of the piece's fp32 tensors */
        memset(slice, 0, (size_t)n * sizeof *slice);
        size_t k = 0;
        for (int t = p[i].t0; t < p[i].t1; t++) {
            const lm_tensor *q = &m->tensors[t];
            if (q->store != LM_NO_STORE) continue;
            for (int r = 0; !q->frozen && r < g; r++) {
                size_t a = (size_t)r * chunk, b = a + chunk;
                a = a > k ? a : k;
                b = b < k + q->numel ? b : k + q->numel;
                if (a < b) slice[r] += b - a;
            }
            k += q->numel;
        }
        /* an experts piece is sharded over the ranks holding the same experts
         * (mesh.edp: shard ranks s with one s % ep, ordered by s), so shard rank s
         * holds its slice s / ep; every other piece's slice s */
        for (int s = 0; s < n; s++) per[s] += slice[p[i].experts ? s / (n / n_exp) : s];
    }
    for (int r = 0; r < n; r++) d->trained = per[r] > d->trained ? per[r] : d->trained;
    free(slice);
    free(per);
    for (int l = 0; l < L; l++) {
        double lpb = 0, lgb = 0;
        for (int i = lp[l]; i < lp[l + 1]; i++) lpb += 4.0 * p[i].n32 + 2.0 * p[i].sn, lgb += 4.0 * p[i].n32;
        if (lpb + lgb > d->layer_p + d->layer_g) d->layer_p = lpb, d->layer_g = lgb;
        d->layers_p += lpb;
    }
    if (np > 0) {
        d->embed_p = 4.0 * p[0].n32 + 2.0 * p[0].sn, d->embed_g = 4.0 * p[0].n32;
        d->head_p = 4.0 * p[np - 1].n32 + 2.0 * p[np - 1].sn, d->head_g = 4.0 * p[np - 1].n32;
    }
    free(p);
    free(lp);
    return np < 0 ? (e ? e->code : CT_ERR_IO) : 0;
}

/* Bytes of whole pieces FSDP holds at once (fsdp.c's hooks), the most of:
 * in a layer's backward its parameters and gradients, the next one's
 * parameters being prefetched and the previous one's gradients being
 * reduce-scattered (two layers' parameters and gradients); the head alone
 * around the loss; an untied embedding with layer 0 prefetched. A tied
 * embedding is held for the whole micro-batch; with reshard_after_forward
 * "never" every layer's parameters from its forward to its backward.
 * bf16-stored matrices count 2 bytes gathered and no gradient. */
static double dry_fsdp_gathered(const dry_fsdp *d, int tied, int reshard) {
    double lpg = d->layer_p + d->layer_g, head = d->head_p + d->head_g, g;
    if (reshard) {
        g = 2 * lpg;
        if (head > g) g = head;
        if (!tied && d->embed_p + d->layer_p > g) g = d->embed_p + d->layer_p; /* the lookup, layer 0 prefetched */
    } else {
        /* a layer's backward holds the parameters of it and every layer below, the gradients of
         * it and the one above; the head's parameters and gradients come after every layer's */
        g = d->layers_p + (head > d->layer_g ? head : d->layer_g);
    }
    return tied ? g + d->embed_p + d->embed_g : g;
}


int plan_fsdp_memory(const lm_model *m, int shard, int n_exp, int reshard, plan_fsdp_mem *out, ct_err *e) {
    dry_fsdp d;
    int rc = dry_fsdp_plan(m, shard, n_exp, &d, e);
    *out = (plan_fsdp_mem){(double)d.shard, (double)d.sshard, (double)d.trained,
                           dry_fsdp_gathered(&d, m->cfg.tie_embeddings, reshard)};
    return rc;
}

/* Sequence parallel's cut of a forward's B x T rows over the TP ranks: rank
 * 0's chunk, and each rank's rows where DTensor Shard's chunks are uneven. */
static void dry_sp_rows(FILE *out, int B, int T, int tp) {
    int BT = B * T, C = (BT + tp - 1) / tp;
    fprintf(out, "  sequence parallel: the residual stream and norms of %d of the %d rows (batch %d x %d)", C, BT, B,
            T);
    if (BT % tp) { /* the last ranks' chunks shorter or empty */
        fprintf(out, "; rows per rank");
        for (int r = 0; r < tp; r++) {
            int rows = BT - r * C < C ? BT - r * C : C;
            fprintf(out, "%s %d", r ? "," : "", rows > 0 ? rows : 0);
        }
        fprintf(out, ", padded to %d in the collectives", C);
    }
    fprintf(out, "\n");
}

/* What rank 0 of the layout plans; the others' slices are the same size
 * (equal heads, columns, experts per rank) up to FSDP's padding, or smaller
 * (the last ranks' vocabulary blocks where t does not divide it). */
int plan_dry_rank(FILE *out, const ct_config *c, const lm_config *mc, int world, int rep, int shard, int tp, int B,
                  int T, const char *where, ct_err *e) {
    int ep = c->ep > 1 ? c->ep : 1;
    lm_config lc;
    tp_local_config(&lc, mc, tp, 0, ep, 0);
    size_t n = 0, act = 0;
    /* sequence parallel: the residual stream and the norms for a chunk of ceil(rows / tp) rows
     * (rank 0's, the largest: DTensor Shard's last chunks are shorter) */
    lc.tp_seq = tp > 1 && c->sequence_parallel;
    int rc = lm_plan_memory(&lc, B, T, c->ac_mode, c->ac_selective_option, &n, &act, e);
    if (rc) return rc;
    double stored = (double)n, in_bf16 = 0, trained = (double)n, gathered = 0, widened = 0;
    lm_model lm;
    lm_layout(&lm, &lc);
    /* frozen tensors: no gradient, no moments; frozen_dtype bfloat16 stores their matrices in bf16 */
    rc = lora_apply_frozen(&lm, c->freeze, c->lora_modules_to_save, where, e);
    if (!rc) trained = (double)lm_trained_runs(&lm, 0, lm.n_params, NULL, NULL);
    if (!rc && lm.n_frozen && !strcmp(c->frozen_dtype, "bfloat16")) {
        in_bf16 = (double)lm_store_frozen_bf16(&lm);
        stored -= in_bf16;
        widened = (double)lm_frozen_widened_floats(&lm);
    }
    if (!rc && shard > 1) {
        plan_fsdp_mem d;
        rc = plan_fsdp_memory(&lm, shard, ep > 1 ? shard / ep : 0, strcmp(c->fsdp_reshard, "never") != 0, &d, e);
        stored = d.stored;
        in_bf16 = d.in_bf16;
        trained = d.trained;
        gathered = d.gathered_bytes;
    }
    lm_free(&lm);
    if (rc) return rc;
    if (!out) return 0; /* checked only */
    int cp = c->cp > 1 ? c->cp : 1;
    char cps[40] = "";
    if (cp > 1) snprintf(cps, sizeof cps, "context_parallel %d x ", cp);
    fprintf(out,
            "per rank: world %d = data_parallel_replicate %d x data_parallel_shard %d x %stensor_parallel %d, "
            "expert_parallel %d (rank 0's slice: TP rank 0, EP rank 0)\n",
            world, rep, shard, cps, tp, ep);
    fprintf(out, "  model %s: %zu parameters run by this rank (heads %d/%d, intermediate %d", lc.name, n, lc.n_heads,
            lc.n_kv_heads, lc.intermediate);
    if (lc.n_experts) fprintf(out, ", experts %d of %d x moe_intermediate %d", lc.expert_rows ? lc.expert_rows : lc.n_experts,
                              lc.n_experts, lc.moe_intermediate);
    if (lc.vocab_rows) fprintf(out, ", lm_head rows %d of %d", lc.vocab_rows, lc.vocab_size);
    fprintf(out, ")\n");
    if (lc.tp_seq) dry_sp_rows(out, B, T, tp);
    if (lc.vocab_rows) /* what the parameter count above holds of the largest tensor */
        fprintf(out, "  embedding: rows %d..%d of %d here (%zu parameters%s)\n", lc.vocab_row0,
                lc.vocab_row0 + lc.vocab_rows - 1, lc.vocab_size, (size_t)lc.vocab_rows * (size_t)lc.hidden,
                lc.tie_embeddings ? ", also the tied lm_head" : "");
    if (tp > 1 && lc.vocab_size % tp) { /* rank 0's block is the largest; the last ones shorter or empty */
        fprintf(out, "  vocabulary rows per TP rank");
        for (int r = 0; r < tp; r++) {
            size_t r0;
            fprintf(out, "%s %zu", r ? "," : "", tp_chunk((size_t)lc.vocab_size, tp, r, &r0));
        }
        fprintf(out, " (chunks of %d, as DTensor Shard(0) cuts them)\n", lc.vocab_rows);
    }
    if (shard > 1 && ep > 1)
        fprintf(out, "  FSDP over %d ranks, the experts over the %d holding the same ones: %.0f parameters stored\n",
                shard, shard / ep, stored);
    else if (shard > 1 && in_bf16 > 0)
        fprintf(out, "  FSDP over %d ranks: %.0f parameters stored (%.0f fp32, %.0f frozen in bf16)\n", shard,
                stored + in_bf16, stored, in_bf16);
    else if (shard > 1)
        fprintf(out, "  FSDP over %d ranks: %.0f parameters stored\n", shard, stored);
    double p = 4 * stored + 2 * in_bf16, g = 4 * trained, o = 8 * trained, a = (double)act, w = 4 * widened;
    double x = 4.0 * (double)lm_expert_lora_scratch_floats(&lc);
    /* context parallel (T is then a rank's chunk) */
    double cps_bytes = cp > 1 ? dry_cp_scratch(&lc, B, T * cp, c) : 0;
    double total = p + g + o + gathered + a + w + x + cps_bytes;
    plan_dry_line(out, in_bf16 > 0 ? "parameters (fp32; frozen matrices bf16)" : "parameters (fp32)", p);
    plan_dry_line(out, trained < stored + in_bf16 ? "gradients (fp32, trained only)" : "gradients (fp32)", g);
    plan_dry_line(out,
                  trained < stored + in_bf16 ? "AdamW moments (2 x fp32, trained only)" : "AdamW moments (2 x fp32)", o);
    if (shard > 1) plan_dry_line(out, "FSDP gathered (params + grads)", gathered);
    plan_dry_line(out, "activations + workspace (planned)", a);
    if (w > 0) plan_dry_line(out, "frozen bf16 lm_head logits block", w);
    if (x > 0) plan_dry_line(out, "expert LoRA fold + weight gradient", x);
    if (cp > 1) plan_dry_line(out, "context parallel attention scratch", cps_bytes);
    plan_dry_line(out, "total planned per rank", total);
    /* trainer_init_weights: the loaders hand over a block of rows at a time
     * and the rank keeps its part, so loading adds one block (lm_block_rows)
     * and, under TP, one tensor's column slice to what the run holds anyway */
    lm_model wt, lt;
    lm_layout(&wt, mc);
    lm_layout(&lt, &lc);
    size_t block = 0, slice = 0;
    for (int i = 0; i < wt.n_tensors; i++) {
        const lm_tensor *tw = &wt.tensors[i], *l = &lt.tensors[i];
        size_t b = lm_block_rows(&wt, tw) * lm_tensor_cols(tw);
        b = b < tw->numel ? b : tw->numel;
        block = b > block ? b : block;
        if (lm_tensor_cols(l) < lm_tensor_cols(tw) && l->numel > slice) slice = l->numel;
    }
    lm_free(&wt);
    lm_free(&lt);
    double load = 4.0 * (double)(block + slice);
    plan_dry_line(out, "loading (row block + a slice)", load);
    plan_dry_line(out, "planned peak per rank", p + o + load > total ? p + o + load : total);
    fprintf(out,
            "(not planned: the runtime (MPI, libraries), FSDP staging for pieces that do not divide evenly, "
            "expert-parallel dispatch buffers, the token data; on resume a checkpoint's tensor is read from the "
            "mapped file, one at a time)\n");
    return 0;
}

/* ------------------------------------------------------------- pipeline */

/* The layers of pipeline rank p->rank, its virtual stages' ranges in order: "0-3, 8-11" (a single layer: "5"). */
static void dry_pp_layers(const pp_sched *p, char *out, size_t cap) {
    size_t k = 0;
    out[0] = 0;
    for (int s = 0; s < p->S && k < cap; s++) {
        int v = pp_vstage(p, p->rank, s), a = p->first[v], b = p->first[v + 1] - 1;
        int w = a == b ? snprintf(out + k, cap - k, "%s%d", s ? ", " : "", a)
                       : snprintf(out + k, cap - k, "%s%d-%d", s ? ", " : "", a, b);
        if (w < 0) break;
        k += (size_t)w;
    }
}

/* One pipeline rank's plan (the rank of the plan p): what trainer_init_dist builds for it, the stage's model
 * (pp_hold) cut to TP rank 0's and EP rank 0's slice (plan_local_model's order) and, under FSDP, its shard, for a
 * micro-batch; its activation banks and the point-to-point buffers of pp_bind. Prints its line when out. */
static int dry_pp_stage(FILE *out, const ct_config *c, const lm_config *mc, const pp_sched *p, int shard, int tp,
                        const char *where, ct_err *e) {
    /* context parallel: the stage runs a chunk of each sequence (plan_seq_len) */
    int cp = c->cp > 1 ? c->cp : 1;
    int mb = c->pp_microbatch, T = c->seq_len / cp, L = mc->n_layers, ep = c->ep > 1 ? c->ep : 1;
    int Bm, Tm; /* the model's planned forward: a micro-batch of the longer of training's and validation's */
    plan_model_shape(c, 1, cp, &Bm, &Tm);
    lm_config stage = *mc, sc;
    pp_hold(p, &stage);
    tp_local_config(&sc, &stage, tp, 0, ep, 0);
    size_t n = 0, act = 0;
    sc.tp_seq = tp > 1 && c->sequence_parallel; /* a micro-batch's rows, a ceil(rows / tp) chunk of them */
    int rc = lm_plan_memory(&sc, Bm, Tm, c->ac_mode, c->ac_selective_option, &n, &act, e);
    if (rc) return rc;
    lm_model lm;
    lm_layout(&lm, &sc);
    size_t trained = n, in_bf16 = 0, widened = 0;
    rc = lora_apply_frozen(&lm, c->freeze, c->lora_modules_to_save, where, e);
    if (!rc) trained = lm_trained_runs(&lm, 0, lm.n_params, NULL, NULL);
    int frozen = lm.n_frozen > 0;
    if (!rc && lm.n_frozen && !strcmp(c->frozen_dtype, "bfloat16")) {
        in_bf16 = lm_store_frozen_bf16(&lm);
        widened = lm_frozen_widened_floats(&lm);
    }
    double stored = (double)(n - in_bf16), gathered = 0; /* fp32 parameters this rank keeps */
    if (!rc && shard > 1) {
        plan_fsdp_mem d;
        rc = plan_fsdp_memory(&lm, shard, ep > 1 ? shard / ep : 0, strcmp(c->fsdp_reshard, "never") != 0, &d, e);
        stored = d.stored;
        in_bf16 = (size_t)d.in_bf16;
        trained = (size_t)d.trained;
        gathered = d.gathered_bytes;
    }
    /* the banks are planned on the run's model: a micro-batch of mb x T, each layer's checkpointing policy */
    lm.act.B = Bm;
    lm.act.T = Tm;
    lm.act.pol = ct_calloc((size_t)L + 1, sizeof(int));
    for (int l = 0; !rc && l < L; l++)
        if ((lm.act.pol[l] = lm_ac_layer(c->ac_mode, c->ac_selective_option, l, e)) < 0) rc = CT_ERR_CONFIG;
    int n_banks = 0;
    size_t bank_f = rc ? 0 : pp_bank_floats(p, &lm, &n_banks);
    int n_stores = 0; /* zero bubble: the weight-gradient stores I fills and W empties */
    size_t store_f = rc ? 0 : pp_wstore_floats(p, &lm, (size_t)mb * T, &n_stores);
    lm_free(&lm);
    if (rc || !out) return rc;
    /* pp_bind: per local stage and micro-batch, 4 messages (activation in and out, gradient in and out), and
     * a MoE model's 4 of expert counts beside them (E doubles each: the load-balancing loss) */
    int E = 0;
    for (int l = 0; l < L; l++)
        if (lm_layer_is_moe(mc, l)) E = mc->n_experts;
    double p2p = 4.0 * p->S * p->M * 4 * ((double)mb * T * mc->hidden) + 8.0 * p->S * p->M * 4 * E;
    double w = 4.0 * stored + 2.0 * (double)in_bf16, go = 12.0 * (double)trained;
    double banks = 4.0 * (double)bank_f, a = (double)act + banks, wide = 4.0 * (double)widened;
    double x = 4.0 * (double)lm_expert_lora_scratch_floats(&sc);
    double cps = cp > 1 ? dry_cp_scratch(&sc, Bm, Tm * cp, c) : 0;
    double stores = 4.0 * (double)store_f;
    double total = w + go + gathered + a + p2p + wide + x + cps + stores;
    char layers[512], slice[160] = "", sharded[96] = "";
    dry_pp_layers(p, layers, sizeof layers);
    int embed = lm_holds_layer(&sc, 0), head = lm_holds_head(&sc);
    const char *holds = embed && head ? ", embedding, final norm + lm_head"
                        : embed       ? ", embedding"
                        : head        ? (sc.tie_embeddings ? ", final norm + lm_head (the tied embedding's copy)"
                                                           : ", final norm + lm_head")
                                      : "";
    if (tp > 1 || ep > 1)
        snprintf(slice, sizeof slice, " (its slice: TP rank 0 of %d, EP rank 0 of %d)", tp, ep);
    if (shard > 1) snprintf(sharded, sizeof sharded, ", FSDP over %d ranks: %.0f stored", shard, stored + in_bf16);
    fprintf(out,
            "  pipeline rank %d: layers %s%s: %zu parameters%s%s; bytes: parameters %.0f, gradients + AdamW %.0f%s, ",
            p->rank, layers, holds, n, slice, sharded, w, go, frozen ? " (trained only)" : "");
    if (shard > 1) fprintf(out, "FSDP gathered %.0f, ", gathered);
    fprintf(out, "activations %.0f (shared %zu + %d bank%s %.0f), point-to-point %.0f", a, act, n_banks,
            n_banks == 1 ? "" : "s", banks, p2p);
    if (wide > 0) fprintf(out, ", frozen bf16 lm_head logits block %.0f", wide);
    if (x > 0) fprintf(out, ", expert LoRA fold + weight gradient %.0f", x);
    if (cps > 0) fprintf(out, ", context parallel attention scratch %.0f", cps);
    if (n_stores > 0)
        fprintf(out, ", weight-gradient stores %.0f (%d of them)", stores, n_stores);
    fprintf(out, "; total %.0f (%.3f GiB)\n", total, total / (1024.0 * 1024.0 * 1024.0));
    return 0;
}

/* Pipeline parallel: the checks a run makes (plan_check_pipeline, then pp_plan's on every pipeline rank, in the
 * run's order), and with out the schedule and every pipeline rank's plan (its replicas plan the same).
 * mc: the whole model after [lora] (trainer_finetune_config). */
enum { DRY_PP_ORDER_MAX = 256 }; /* actions a rank's order line lists: 2 (zero bubble 3) x stages x micro-batches */

int plan_dry_pipeline(FILE *out, const ct_config *c, const lm_config *mc, int world, int rep, int shard, int tp,
                      const char *where, ct_err *e) {
    int P = c->pp, dp = rep * shard;
    int val_b = c->val_local_batch_size > 0 ? c->val_local_batch_size : c->local_batch_size;
    int rc = plan_check_pipeline(c, val_b, where, e);
    if (rc) return rc;
    /* trainer_init_dist's micro-batches of a step */
    int per_step = c->local_batch_size * dp, global = c->global_batch_size > 0 ? c->global_batch_size : per_step;
    int accum = global / per_step, mb = c->pp_microbatch, M = accum * (c->local_batch_size / mb);
    char cps[40] = "";
    if (c->cp > 1) snprintf(cps, sizeof cps, "context_parallel %d x ", c->cp);
    for (int r = 0; r < P; r++) {
        pp_sched p;
        rc = pp_plan(&p, c, mc, P, r, M, where, e);
        if (!rc && out && r == 0) {
            /* the simulation runs every rank: its bubble is the schedule's, the same in every plan */
            int S = p.S,
                inter = p.schedule == PP_INTERLEAVED || p.schedule == PP_LOOPED_BFS || p.schedule >= PP_ZB_INTERLEAVED;
            double book = (double)(P - 1) / ((inter ? (double)S * M : (double)M) + P - 1);
            fprintf(out,
                    "pipeline: world %d = pipeline_parallel %d x data_parallel_replicate %d x data_parallel_shard "
                    "%d x %stensor_parallel %d, expert_parallel %d (each pipeline rank's plan; its replicas plan the "
                    "same)\n",
                    world, P, rep, shard, cps, tp, c->ep > 1 ? c->ep : 1);
            fprintf(out,
                    "  schedule %s: %d stage%s per rank, %d micro-batches of %d sequence%s per step (gradient "
                    "accumulation %d x local_batch_size %d / pipeline_parallel_microbatch_size %d)\n",
                    c->pp_schedule, S, S == 1 ? "" : "s", M, mb, mb == 1 ? "" : "s", accum, c->local_batch_size, mb);
            if (c->pp_csv[0]) /* the name gave the stages and their ranks, the file the order */
                fprintf(out, "  order: pipeline_parallel_schedule_csv \"%s\" (each rank's order below)\n", c->pp_csv);
            fprintf(out,
                    "  bubble: simulated %.4f (stages costed by their FLOPs, the lm_head on the last), textbook "
                    "%.4f = (P-1)/(%sM+P-1)\n",
                    p.bubble, book, inter ? "S*" : "");
            /* a stage's forward is one micro-batch of a CP rank's positions */
            if (tp > 1 && c->sequence_parallel) dry_sp_rows(out, mb, c->seq_len / (c->cp > 1 ? c->cp : 1), tp);
        }
        if (!rc) rc = dry_pp_stage(out, c, mc, &p, shard, tp, where, e);
        if (!rc && out) { /* the order as torch's _Action prints it: virtual stage, F, B, I or W, micro-batch */
            fprintf(out, "    rank %d order:", r);
            if (p.n_act <= DRY_PP_ORDER_MAX)
                for (int k = 0; k < p.n_act; k++)
                    fprintf(out, " %d%c%d", pp_vstage(&p, r, p.act[k].stage), p.act[k].kind, p.act[k].mb);
            else fprintf(out, " %d actions (listed up to %d)", p.n_act, DRY_PP_ORDER_MAX);
            fputc('\n', out);
        }
        pp_free(&p);
        if (rc) return rc;
    }
    if (out)
        fprintf(out,
                "(per pipeline rank: the stage's model for one micro-batch, plus a bank of saved activations per "
                "forward in flight; not planned: the runtime (MPI, libraries), validation's two messages, the "
                "token data, loading's row block)\n");
    return 0;
}

