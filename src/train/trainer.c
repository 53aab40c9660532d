/* train/trainer.c: the training loop and its metrics.
 *
 * A step reads all of its micro-batches first so the number of valid
 * targets of the whole step is known before any backward: every
 * micro-batch's gradient is then scaled by 1 / (valid targets of the step),
 * which is what HF and torchtitan do under gradient accumulation. Metrics
 * follow torchtitan's console line and go, with lr and elapsed time, to a
 * JSONL file. */
#include "train/trainer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "checkpoint/hf.h"
#include "core/cpu.h"
#include "core/timer.h"
#include "data/tokens.h"

int trainer_model_config(const ct_config *cfg, qwen3_config *mc, ct_err *e) {
    if (strcmp(cfg->model_spec, "hf") == 0) {
        if (!cfg->hf_assets_path[0])
            return ct_fail(e, CT_ERR_CONFIG, "%s: model.hf_assets_path: required when model.spec = \"hf\"",
                           cfg->config_path[0] ? cfg->config_path : "command line");
        return qwen3_config_from_hf(mc, cfg->hf_assets_path, e);
    }
    int rc = qwen3_config_from_flavor(mc, cfg->model_flavor, e);
    if (rc && e) {
        char msg[sizeof e->msg];
        snprintf(msg, sizeof msg, "%s", e->msg);
        ct_fail(e, rc, "%s: %s", cfg->config_path[0] ? cfg->config_path : "command line", msg);
    }
    return rc;
}

int trainer_init(trainer *t, ct_config *cfg, ct_err *e) {
    memset(t, 0, sizeof *t);
    t->cfg = *cfg;
    memset(cfg, 0, sizeof *cfg);
    ct_config *c = &t->cfg;
    if (c->threads > 0) cpu_set_threads(c->threads);
    qwen3_config mc;
    int rc = trainer_model_config(c, &mc, e);
    if (rc) return rc;
    int global = c->global_batch_size > 0 ? c->global_batch_size : c->local_batch_size;
    t->grad_accum = global / c->local_batch_size;
    if ((rc = qwen3_create(&t->model, &mc, c->local_batch_size, c->seq_len, e))) return rc;
    if (c->initial_load_path[0]) {
        if (!c->initial_load_in_hf)
            return ct_fail(e, CT_ERR_CONFIG,
                           "checkpoint.initial_load_path = \"%s\": only Hugging Face safetensors directories can be "
                           "loaded for now; set checkpoint.initial_load_in_hf = true",
                           c->initial_load_path);
        if ((rc = hf_load(&t->model, c->initial_load_path, e))) return rc;
    } else {
        qwen3_init_random(&t->model, (uint64_t)c->seed);
    }
    adamw_init(&t->opt, t->model.n_params);
    t->hp = (adamw_hparams){c->lr, c->beta1, c->beta2, c->eps, c->weight_decay};
    int dt = lr_decay_type_from_name(c->decay_type);
    lr_schedule_init(&t->sched, c->steps, c->warmup_steps, c->decay_ratio, dt < 0 ? LR_DECAY_LINEAR : dt,
                     c->min_lr_factor);
    return 0;
}

void trainer_free(trainer *t) {
    qwen3_free(&t->model);
    adamw_free(&t->opt);
    cfg_free(&t->cfg);
    memset(t, 0, sizeof *t);
}

void trainer_optimizer_step(trainer *t, double *grad_norm, double *lr) {
    qwen3_model *m = &t->model;
    double cur_lr = t->cfg.lr * lr_schedule_factor(&t->sched, t->step);
    double norm = optim_clip_grad_norm(m->grads, m->n_params, t->cfg.max_norm);
    adamw_step(&t->opt, m->params, m->grads, cur_lr, &t->hp);
    memset(m->grads, 0, m->n_params * sizeof(float));
    t->step++;
    if (grad_norm) *grad_norm = norm;
    if (lr) *lr = cur_lr;
}

/* dir/name, or name alone when it is absolute. Returns 0 if it fits. */
static int join_path(char *out, size_t cap, const char *dir, const char *name) {
    int n = (name[0] == '/' || !dir[0]) ? snprintf(out, cap, "%s", name) : snprintf(out, cap, "%s/%s", dir, name);
    return n < 0 || (size_t)n >= cap;
}

int trainer_run(trainer *t, ct_err *e) {
    ct_config *c = &t->cfg;
    qwen3_model *m = &t->model;
    int B = c->local_batch_size, T = c->seq_len;
    data_loader dl;
    int rc = data_open(&dl, c->dataset_path, T, m->cfg.vocab_size, e);
    if (rc) return rc;
    if ((rc = hf_mkdirs(c->dump_folder, e))) goto out;

    /* the resolved config, so a run can be reproduced from its folder */
    char path[4096];
    join_path(path, sizeof path, c->dump_folder, "config.toml");
    FILE *cf = fopen(path, "w");
    if (cf) {
        cfg_write_toml(c, cf);
        fclose(cf);
    }
    FILE *mf = NULL;
    if (c->metrics_file[0]) {
        join_path(path, sizeof path, c->dump_folder, c->metrics_file);
        mf = fopen(path, "w");
        if (!mf) {
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot open metrics file (metrics.file)", path);
            goto out;
        }
    }

    cpu_peak peak;
    if (c->peak_tflops > 0) {
        peak = (cpu_peak){c->peak_tflops * 1e12, cpu_threads(), "config", "-"};
    } else {
        cpu_peak_flops(&peak, cpu_threads());
    }
    double fpt = qwen3_flops_per_token(m, T);
    fprintf(stderr,
            "ctitan: model %s: %zu parameters, %d layers, hidden %d, heads %d/%d x %d, vocab %d%s\n"
            "ctitan: batch %d x %d tokens, %d micro-batch(es) per step, %d steps; activations %.1f MiB\n"
            "ctitan: %.3g FLOPs/token (6 x matmul params incl. lm_head + attention); peak %.1f GFLOP/s fp32 on %d "
            "threads (%s, %s)\n",
            m->cfg.name, m->n_params, m->cfg.n_layers, m->cfg.hidden, m->cfg.n_heads, m->cfg.n_kv_heads,
            m->cfg.head_dim, m->cfg.vocab_size, m->cfg.tie_embeddings ? ", tied" : "", B, T, t->grad_accum,
            c->steps, qwen3_activation_bytes(m) / 1048576.0, fpt, peak.flops / 1e9, peak.threads, peak.source,
            peak.isa);

    size_t mb = (size_t)B * T;
    int32_t *tokens = ct_malloc(mb * t->grad_accum * sizeof(int32_t));
    int32_t *labels = ct_malloc(mb * t->grad_accum * sizeof(int32_t));
    double t_start = ct_now(), t_log = t_start;
    long tokens_since_log = 0;
    for (int step = t->step + 1; step <= c->steps; step++) {
        long n_valid = 0;
        for (int a = 0; a < t->grad_accum; a++) {
            data_next(&dl, tokens + a * mb, labels + a * mb, B);
            for (size_t i = 0; i < mb; i++) n_valid += labels[a * mb + i] != -100;
        }
        float scale = n_valid ? 1.0f / (float)n_valid : 0.0f;
        double loss_sum = 0;
        for (int a = 0; a < t->grad_accum; a++)
            loss_sum += qwen3_forward_backward(m, tokens + a * mb, labels + a * mb, B, T, scale, NULL);
        double loss = n_valid ? loss_sum / n_valid : 0.0;
        double gnorm, lr;
        trainer_optimizer_step(t, &gnorm, &lr);
        tokens_since_log += (long)(mb * t->grad_accum);
        if (step == 1 || step % c->log_freq == 0) { /* torchtitan's rule */
            double now = ct_now();
            double tps = tokens_since_log / (now - t_log);
            double tflops = fpt * tps / 1e12;
            double mfu = 100.0 * fpt * tps / peak.flops;
            double mem = cpu_peak_rss_bytes() / (1024.0 * 1024.0 * 1024.0);
            printf("step: %d  loss: %.4f  grad_norm: %.4f  memory: %.2f GiB  tps: %.0f  tflops: %.3f  mfu: %.2f%%\n",
                   step, loss, gnorm, mem, tps, tflops, mfu);
            fflush(stdout);
            if (mf) {
                fprintf(mf,
                        "{\"step\": %d, \"loss\": %.9g, \"grad_norm\": %.9g, \"lr\": %.9g, \"memory_gib\": %.4f, "
                        "\"tps\": %.2f, \"tflops\": %.6f, \"mfu\": %.4f, \"elapsed_s\": %.3f, \"valid_targets\": %ld}\n",
                        step, loss, gnorm, lr, mem, tps, tflops, mfu, now - t_start, n_valid);
                fflush(mf);
            }
            t_log = now;
            tokens_since_log = 0;
        }
        if (!isfinite(loss)) {
            rc = ct_fail(e, CT_ERR_IO, "training diverged: loss is %g at step %d", loss, step);
            break;
        }
    }
    free(tokens);
    free(labels);
    if (mf) fclose(mf);
    if (!rc && c->last_save_in_hf) {
        char dir[4096], sub[64];
        snprintf(sub, sizeof sub, "step-%d", t->step);
        if (join_path(path, sizeof path, c->dump_folder, c->ckpt_folder) || join_path(dir, sizeof dir, path, sub)) {
            rc = ct_fail(e, CT_ERR_CONFIG, "checkpoint.folder: path too long");
            goto out;
        }
        int dtype = hf_dtype_from_name(c->export_dtype);
        double t0 = ct_now();
        rc = hf_save(m, dir, dtype < 0 ? CT_F32 : (ct_dtype)dtype, 0, e);
        if (!rc) fprintf(stderr, "ctitan: saved Hugging Face model (%s) to %s in %.2f s\n", c->export_dtype, dir,
                         ct_now() - t0);
    }
out:
    data_close(&dl);
    return rc;
}
