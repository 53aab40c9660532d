/* train/trainer_plan.c: `ctitan train --dry-run`, the memory a run would
 * plan, before anything is allocated: the whole model on one process, and,
 * for a world of several ranks (mpirun's, or every [parallelism] degree
 * fixed), what rank 0 of the layout plans (distributed/plan_dry.c: its
 * slice and shard; with pipeline stages, every stage's rank and the
 * schedule's bubble). */
#include "train/trainer.h"
#include "train/trainer_priv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/cpu.h"
#include "distributed/plan.h"
#include "metrics/profile.h"
#include "model/lora.h"

int trainer_dry_run(const ct_config *c0, int world, FILE *out, ct_err *e) {
    /* config.json of a Hub id, into a shallow copy (its resolved directory is the copy's own) */
    ct_config cc = *c0, *c = &cc;
    cc.hf_assets_dir = cc.initial_load_dir = NULL;
    lm_config mc;
    int rc = trainer_resolve_hub(&cc, 1, e);
    if (!rc) rc = trainer_model_config(c, &mc, e);
    free(cc.hf_assets_dir);
    cc.hf_assets_dir = NULL;
    if (rc) return rc;
    trainer_warn_positions(c, &mc);
    /* the world: mpirun's, else what fixed degrees multiply to, else one process */
    int pp = c->pp > 1 ? c->pp : 1, cp = c->cp > 1 ? c->cp : 1;
    if (world <= 0) world = (c->dp_shard > 0 ? c->dp_replicate * c->dp_shard * c->tp : 1) * pp * cp;
    int rep, shard, tp;
    if ((rc = mesh_resolve(c, world, &mc, trainer_layout_origin(c), &rep, &shard, &tp, e))) return rc;
    if ((rc = trainer_check_global_batch(c, rep * shard, e))) return rc;
    if ((rc = trainer_check_kernels(c, e))) return rc;
    /* the larger of training's and validation's forwards (batch, validation.seq_len): what the model plans */
    int B, T;
    plan_model_shape(c, 0, 1, &B, &T);
    if ((rc = trainer_finetune_config(c, &mc, e))) return rc;
    /* the run checks its pipeline before it builds the model: an error comes alone, before anything prints */
    if (pp > 1 && (rc = plan_dry_pipeline(NULL, c, &mc, world, rep, shard, tp, trainer_layout_origin(c), e))) return rc;
    size_t n = 0, act = 0;
    if ((rc = lm_plan_memory(&mc, B, T, c->ac_mode, c->ac_selective_option, &n, &act, e))) return rc;
    /* frozen tensors (LoRA's base, training.freeze): no gradient, no moments */
    size_t trained = n, in_bf16 = 0, widened = 0, saved = 0;
    {
        lm_model lm;
        lm_layout(&lm, &mc);
        rc = lora_apply_frozen(&lm, c->freeze, c->lora_modules_to_save, trainer_frozen_origin(c), e);
        if (!rc) trained = lm_trained_runs(&lm, 0, lm.n_params, NULL, NULL);
        if (!rc) saved = trainer_saved_params(&lm);
        if (!rc && lm.n_frozen && !strcmp(c->frozen_dtype, "bfloat16")) {
            in_bf16 = lm_store_frozen_bf16(&lm);
            widened = lm_frozen_widened_floats(&lm);
        }
        lm_free(&lm);
        if (rc) return rc;
    }
    /* context parallel: a rank's model runs seq_len / cp positions (distributed/cp.h) */
    int Br, Tr;
    plan_model_shape(c, 0, cp, &Br, &Tr);
    if (world > 1 && pp == 1) { /* checked before anything prints, so an error comes alone */
        if ((rc = plan_dry_rank(NULL, c, &mc, world, rep, shard, tp, Br, Tr, trainer_layout_origin(c), e))) return rc;
    }
    if (!out) return 0;
    /* bf16-stored frozen matrices: 2 bytes each, and a stored lm_head's fp32 block of logits */
    double p = 4.0 * (double)(n - in_bf16) + 2.0 * (double)in_bf16, g = 4.0 * trained, o = 8.0 * trained, a = (double)act;
    double w = 4.0 * (double)widened, x = 4.0 * (double)lm_expert_lora_scratch_floats(&mc);
    fprintf(out, "dry run: model %s, %zu parameters (%.2f B), batch %d x %d, activation_checkpoint %s\n", mc.name, n,
            n / 1e9, B, T, c->ac_mode);
    if (cfg_val_seq_len(c) != c->seq_len) /* the batch above is the larger forward's rows */
        fprintf(out, "  validation.seq_len %d (training.seq_len %d): the buffers hold the larger forward, %d x %d "
                     "rows of training or %d x %d of validation\n",
                cfg_val_seq_len(c), c->seq_len, c->local_batch_size, c->seq_len,
                c->val_local_batch_size > 0 ? c->val_local_batch_size : c->local_batch_size, cfg_val_seq_len(c));
    if (trained != n) trainer_print_trained(out, "  ", trained, n, saved, c->lora_rank > 0);
    plan_dry_line(out, in_bf16 ? "parameters (fp32; frozen matrices bf16)" : "parameters (fp32)", p);
    plan_dry_line(out, trained < n ? "gradients (fp32, trained only)" : "gradients (fp32)", g);
    plan_dry_line(out, trained < n ? "AdamW moments (2 x fp32, trained only)" : "AdamW moments (2 x fp32)", o);
    plan_dry_line(out, "activations + workspace (planned)", a);
    if (w > 0) plan_dry_line(out, "frozen bf16 lm_head logits block", w);
    if (x > 0) plan_dry_line(out, "expert LoRA fold + weight gradient", x);
    /* checkpoint.async_mode: a save between steps is staged whole on rank 0 (the trained tensors and their two
     * moments, fp32) while a thread writes it */
    double st = c->ckpt_async_mode && strcmp(c->ckpt_async_mode, "disabled") ? 12.0 * (double)trained : 0;
    if (st > 0) plan_dry_line(out, "checkpoint staging (async_mode)", st);
    plan_dry_line(out, "total planned", p + g + o + a + w + x + st);
    fprintf(out, "(plus the token data and, on resume, one checkpoint file mapped at a time)\n");
    /* a pipeline plans each stage's chunk itself: the split is costed at the whole seq_len, as the run's */
    if (pp > 1) rc = plan_dry_pipeline(out, c, &mc, world, rep, shard, tp, trainer_layout_origin(c), e);
    else if (world > 1) rc = plan_dry_rank(out, c, &mc, world, rep, shard, tp, Br, Tr, trainer_layout_origin(c), e);
    if (rc) return rc;
    if (st > 0 && world > 1)
        fprintf(out, "(checkpoint.async_mode: rank 0 also holds the %.3f GiB staging copy of a checkpoint: the save "
                     "is gathered to it and its thread writes it)\n", st / (1024.0 * 1024.0 * 1024.0));
    if (cp > 1)
        fprintf(out, "(context_parallel %d: the per-rank figures are a rank's running %d of the %d positions of each "
                     "sequence, with its attention's whole-sequence scratch: distributed/cp.h)\n",
                cp, c->seq_len / cp, c->seq_len);
    return 0;
}

/* Bytes of [p, p + n) resident in this process now (mincore): a buffer's
 * measured size, which for the lazily mapped and FSDP-gathered buffers is
 * less than its length. */
static double resident(const void *p, size_t n) {
    if (!p || !n) return 0;
    long pg = sysconf(_SC_PAGESIZE);
    uintptr_t a = (uintptr_t)p & ~(uintptr_t)(pg - 1), b = (uintptr_t)p + n;
    size_t pages = (b - a + pg - 1) / pg;
    unsigned char *v = ct_malloc(pages);
    double bytes = -1;
    if (!mincore((void *)a, b - a, v)) {
        size_t in = 0;
        for (size_t i = 0; i < pages; i++) in += v[i] & 1;
        bytes = (double)in * pg;
        if (bytes > (double)n) bytes = (double)n; /* the partial pages at the ends */
    }
    free(v);
    return bytes;
}

/* The snapshot's file under save_memory_snapshot_folder/iteration_N, and its table on log. */
static int snapshot_write(trainer *t, int step, const prof_mem *cats, int n, FILE *log, ct_err *e) {
    const ct_config *c = &t->cfg;
    char dir[4096], sub[64];
    snprintf(sub, sizeof sub, "/iteration_%d", step);
    if (trainer_join_path(dir, sizeof dir, c->dump_folder, c->save_memory_snapshot_folder) ||
        strlen(dir) + strlen(sub) >= sizeof dir)
        return ct_fail(e, CT_ERR_CONFIG, "profiling.save_memory_snapshot_folder: path too long");
    strcat(dir, sub);
    return prof_memory_snapshot(dir, t->world->rank, step, cats, n, cpu_peak_rss_bytes(), log, e);
}

int trainer_memory_snapshot(trainer *t, int step, FILE *log, ct_err *e) {
    const ct_config *c = &t->cfg;
    lm_model *m = &t->model;
    /* planned: trainer_dry_run's figures, for this rank's model */
    int B, T; /* the model's planned forward (as trainer_dry_run, one process's batch) */
    plan_model_shape(c, 0, t->plan.mesh.cp > 1 ? t->plan.mesh.cp : 1, &B, &T);
    size_t n = 0, act = 0;
    int rc = lm_plan_memory(&m->cfg, B, T, c->ac_mode, c->ac_selective_option, &n, &act, e);
    if (rc) return rc;
    const fsdp *f = t->plan.fsdp;
    const adamw_state *o = t->plan.opt;
    double moments = o ? resident(o->m, o->n * sizeof(float)) + resident(o->v, o->n * sizeof(float)) : 0;
    double act_res = resident(m->act.mem, m->act.floats * sizeof(float));
    if (f) {
        /* the dry run's per-rank table: this rank's shard of the parameters,
         * gradients and moments, and beside them the whole pieces FSDP
         * gathers into the model's flat buffers (released after use, so only
         * what is held at the moment is resident) */
        plan_fsdp_mem d;
        int ep = t->plan.mesh.ep > 1 ? t->plan.mesh.ep : 1;
        if ((rc = plan_fsdp_memory(m, f->comm->size, ep > 1 ? f->comm->size / ep : 0, f->reshard, &d, e))) return rc;
        prof_mem cats[] = {
            {"parameters", 4.0 * d.stored + 2.0 * d.in_bf16,
             resident(f->params, f->shard_n * sizeof(float)) + resident(f->sparams, f->sshard_n * sizeof(uint16_t))},
            {"gradients", 4.0 * d.trained, resident(f->grads, f->shard_n * sizeof(float))},
            {"adamw_moments", 8.0 * d.trained, moments},
            {"fsdp_gathered", d.gathered_bytes,
             resident(m->params, m->n_params * sizeof(float)) + resident(m->fstore, m->n_store * sizeof(uint16_t)) +
                 resident(m->grads, m->n_params * sizeof(float))},
            {"activations_workspace", (double)act, act_res},
        };
        return snapshot_write(t, step, cats, (int)(sizeof cats / sizeof *cats), log, e);
    }
    size_t trained = lm_trained_runs(m, 0, m->n_params, NULL, NULL), in_bf16 = m->n_store;
    prof_mem cats[] = {
        {"parameters", 4.0 * (double)(n - in_bf16) + 2.0 * (double)in_bf16,
         resident(m->params, m->n_params * sizeof(float)) + resident(m->fstore, m->n_store * sizeof(uint16_t))},
        {"gradients", 4.0 * (double)trained, resident(m->grads, m->n_params * sizeof(float))},
        {"adamw_moments", 8.0 * (double)trained, moments},
        {"activations_workspace", (double)act, act_res},
    };
    return snapshot_write(t, step, cats, (int)(sizeof cats / sizeof *cats), log, e);
}
