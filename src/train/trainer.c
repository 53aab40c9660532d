/* train/trainer.c: set-up, the optimizer step and the training loop, with
 * validation and metrics (checkpoints: trainer_ckpt.c; --dry-run:
 * trainer_plan.c).
 *
 * A step reads all of its micro-batches first so the number of valid
 * targets of the whole step is known before any backward: every
 * micro-batch's gradient is then scaled by 1 / (valid targets of the step),
 * which is what HF and torchtitan do under gradient accumulation. Metrics
 * follow torchtitan's console line and go, with lr and elapsed time, to a
 * JSONL file.
 *
 * Resume is exact by construction: a checkpoint holds the fp32 parameters,
 * both AdamW moments, the step (which fixes the LR schedule) and the data
 * loader's (epoch, position); every kernel is deterministic at a given
 * thread count, so the resumed run computes the same bits as an
 * uninterrupted one. */
#define _XOPEN_SOURCE 700
#include "train/trainer.h"
#include "train/trainer_priv.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/hf.h"
#include "core/cpu.h"
#include "core/fs.h"
#include "core/progress.h"
#include "core/rng.h"
#include "core/timer.h"
#include "hub/hub.h"
#include "metrics/profile.h"
#include "metrics/tb.h"
#include "model/lora.h"

/* Process-wide state (docs/design.md, "State outside a run context"): a
 * signal handler can reach nothing else. 0 = run, 1 = stop after this step. */
static volatile sig_atomic_t stop_requested;

static void on_signal(int sig) {
    if (stop_requested) _exit(128 + sig); /* second signal: leave now; saves are atomic */
    stop_requested = 1;
}

/* Installs the SIGTERM/SIGINT (and SIGUSR1, which mpirun forwards) handlers of trainer_run: the first signal asks
 * the loop to stop after the current step with a checkpoint; a second one
 * exits at once (checkpoint writes are atomic, so nothing is left half done). */
static void trainer_install_signals(void) {
    stop_requested = 0; /* a stop asked of an earlier run in this process does not stop this one */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sa.sa_flags = SA_RESTART; /* a write to a slow stdout pipe must not fail with EINTR */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    /* mpirun forwards SIGUSR1 to every rank, while its own SIGTERM kills them
     * a moment later: under MPI, SIGUSR1 to mpirun is the graceful stop */
    sigaction(SIGUSR1, &sa, NULL);
}


const char *trainer_layout_origin(const ct_config *c) {
    return cfg_origin_any(c, "parallelism.data_parallel_replicate_degree,parallelism.data_parallel_shard_degree,"
                             "parallelism.tensor_parallel_degree,parallelism.expert_parallel_degree,"
                             "parallelism.pipeline_parallel_degree,parallelism.pipeline_parallel_schedule,"
                             "parallelism.pipeline_parallel_microbatch_size,parallelism.pipeline_parallel_split_points,"
                             "parallelism.pipeline_parallel_layers_per_stage,parallelism.module_fqns_per_model_part,"
                             "parallelism.pipeline_parallel_first_stage_less_layers,"
                             "parallelism.pipeline_parallel_last_stage_less_layers,"
                             "training.local_batch_size,training.global_batch_size,training.seq_len,"
                             "validation.local_batch_size");
}

const char *trainer_frozen_origin(const ct_config *c) {
    return cfg_origin_any(c, "training.freeze,lora.modules_to_save,lora.rank");
}

/* dir/name, or name alone when it is absolute. Returns 0 if it fits. */
int trainer_join_path(char *out, size_t cap, const char *dir, const char *name) {
    int n = (name[0] == '/' || !dir[0]) ? snprintf(out, cap, "%s", name) : snprintf(out, cap, "%s/%s", dir, name);
    return n < 0 || (size_t)n >= cap;
}


/* One option's Hub id through hub_resolve, into *dir; the message names the option. A
 * directory, or a missing path that is no id, is left to the code that reads it (its errors). */
static int resolve_one(const ct_config *c, const char *key, const char *path, const char *rev, unsigned what,
                       char **dir, ct_err *e) {
    struct stat st;
    if (!hub_is_repo_id(path) || (stat(path, &st) == 0 && S_ISDIR(st.st_mode))) return 0;
    hub_local *loc = ct_malloc(sizeof *loc); /* 4 KB of path: not on the stack of every caller */
    int rc = hub_resolve(path, rev, what, loc, e);
    if (rc && e) {
        char msg[sizeof e->msg];
        snprintf(msg, sizeof msg, "%s", e->msg);
        ct_fail(e, rc, "%s: %s: %s", cfg_origin(c, key), key, msg);
    }
    if (!rc) {
        free(*dir);
        *dir = ct_strdup(loc->dir);
    }
    free(loc);
    return rc;
}

int trainer_resolve_hub(ct_config *c, int dry_run, ct_err *e) {
    int hf = !strcmp(c->model_spec, "hf"), init = c->initial_load_path[0] && c->initial_load_in_hf;
    int same = init && !strcmp(c->initial_load_path, c->hf_assets_path);
    unsigned what = (hf ? HUB_CONFIG : 0) | (dry_run ? 0 : HUB_TOKENIZER_IF_ANY | (same ? HUB_WEIGHTS : 0));
    int rc = 0;
    if (c->hf_assets_path[0] && what)
        rc = resolve_one(c, "model.hf_assets_path", c->hf_assets_path, c->hf_revision, what, &c->hf_assets_dir, e);
    if (!rc && init && !dry_run)
        rc = resolve_one(c, "checkpoint.initial_load_path", c->initial_load_path, c->hf_revision,
                         HUB_CONFIG | HUB_WEIGHTS, &c->initial_load_dir, e);
    /* a PEFT adapter published on the Hub, at its own revision (another repo than the base) */
    if (!rc && c->lora_adapter_path[0] && c->lora_rank > 0 && !dry_run)
        rc = resolve_one(c, "lora.adapter_path", c->lora_adapter_path, c->lora_adapter_revision, HUB_ADAPTER,
                         &c->lora_adapter_dir, e);
    return rc;
}

int trainer_model_config(const ct_config *cfg, lm_config *mc, ct_err *e) {
    if (strcmp(cfg->model_spec, "hf") == 0) {
        if (!cfg->hf_assets_path[0])
            return ct_fail(e, CT_ERR_CONFIG, "%s: model.hf_assets_path: required when model.spec = \"hf\"",
                           cfg_source(cfg));
        /* a directory without config.json is a missing file (exit 1), as generate,
         * import and describe say it; a PEFT adapter there is pointed where it goes */
        const char *dir = cfg_hf_dir(cfg);
        char p[4200];
        snprintf(p, sizeof p, "%s/config.json", dir);
        if (access(p, F_OK) != 0) {
            char hint[2 * 4096 + 200];
            ckpt_adapter_hint(dir, "model.hf_assets_path", "lora.adapter_path", hint, sizeof hint);
            return ct_fail(e, CT_ERR_IO, "%s: model.hf_assets_path: %s: not found (a Hugging Face model directory "
                           "has config.json)%s", cfg_origin(cfg, "model.hf_assets_path"), p, hint);
        }
        return lm_config_from_hf(mc, dir, e);
    }
    int rc = lm_config_from_flavor(mc, cfg->model_flavor, e);
    if (rc && e) {
        char msg[sizeof e->msg];
        snprintf(msg, sizeof msg, "%s", e->msg);
        ct_fail(e, rc, "%s: %s", cfg_origin(cfg, "model.flavor"), msg);
    }
    return rc;
}

/* A seq_len past the positions the model was trained for: torchtitan's model
 * args warn and train on, transformers' tokenizer warns ("Token indices sequence
 * length is longer than ...") and its model runs (RoPE extrapolates), so a run
 * does too; generate refuses such lengths by the same limit (lm_position_limit). */
void trainer_warn_positions(const ct_config *c, const lm_config *mc) {
    double limit = lm_position_limit(mc);
    int hf = strcmp(c->model_spec, "hf") == 0;
    /* training's windows, then validation's (validation.seq_len, when it is another length) */
    const struct { const char *key; int len; } lens[2] = {{"training.seq_len", c->seq_len},
                                                          {"validation.seq_len", cfg_val_seq_len(c)}};
    for (int i = 0; i < 2; i++) {
        if (limit <= 0 || lens[i].len <= limit || (i && lens[1].len == c->seq_len)) continue;
        fprintf(stderr,
                "ctitan: warning: %s: %s (%d) exceeds the %.0f positions the model was trained for "
                "(max_position_embeddings %d of %s%s%s): positions past them are extrapolated, and generate refuses "
                "lengths past them\n",
                cfg_origin(c, lens[i].key), lens[i].key, lens[i].len, limit, mc->max_pos,
                hf ? cfg_hf_dir(c) : "model.flavor ", hf ? "/config.json" : c->model_flavor,
                limit > mc->max_pos ? ", extended by its RoPE scaling factor" : "");
    }
}

/* Each [kernels] override alone, so the message names where that one was
 * set (the file or the command line); the dry run checks them too, or it
 * approved a config the run then refused. */
int trainer_check_kernels(const ct_config *c, ct_err *e) {
    for (int i = 0; i < KERN_N_OPS; i++) {
        char spec[96], key[64];
        snprintf(spec, sizeof spec, "%s=%s", kern_op_name((kern_op)i), c->kernels[i]);
        const char *ov[2] = {spec, NULL};
        kern_ops scratch;
        int rc = kern_select(&scratch, ov, NULL, 0, e);
        if (rc && e) {
            char msg[sizeof e->msg];
            snprintf(msg, sizeof msg, "%s", e->msg);
            snprintf(key, sizeof key, "kernels.%s", kern_op_name((kern_op)i));
            return ct_fail(e, rc, "%s: [kernels]: %s", cfg_origin(c, key), msg);
        }
        if (rc) return rc;
    }
    return 0;
}

_Static_assert(sizeof(((ct_config *)0)->kernels) / sizeof(char *) == KERN_N_OPS,
               "config.h's kernels[] must have one entry per kern_op");

/* [kernels]: the fastest implementation this CPU runs, unless the config names
 * one: measured on this run's sizes by rank 0 (kern_tune, cached per CPU and
 * threads), whose choice every rank then installs, so that the ranks of one
 * run compute with the same kernels (a rank whose CPU lacks one keeps its own
 * default and says so); or, with kernels.tune = false, the registry's order. */
static int select_kernels(trainer *t, ct_err *e) {
    int rc0 = trainer_check_kernels(&t->cfg, e);
    if (rc0) return rc0;
    char spec[KERN_N_OPS][96];
    const char *ov[KERN_N_OPS + 1];
    int n = 0;
    for (int i = 0; i < KERN_N_OPS; i++) {
        snprintf(spec[i], sizeof spec[i], "%s=%s", kern_op_name((kern_op)i), t->cfg.kernels[i]);
        ov[n++] = spec[i];
    }
    ov[n] = NULL;
    char log[4096];
    int rc = kern_select(&t->model.k, ov, log, sizeof log, e); /* validates the overrides on every rank */
    if (rc) {
        char msg[sizeof e->msg];
        snprintf(msg, sizeof msg, "%s", e->msg);
        return ct_fail(e, rc, "%s: [kernels]: %s", cfg_source(&t->cfg), msg);
    }
    int bf16 = !strcmp(t->cfg.mixed_precision_param, "bfloat16");
    /* CTITAN_KERNEL_TUNE=0|1 overrides kernels.tune (a test suite, or a user who wants the same
     * kernels at every thread count: the timed choice is per thread count and run sizes) */
    int tune = t->cfg.kernels_tune;
    const char *tune_env = getenv("CTITAN_KERNEL_TUNE");
    if (tune_env && *tune_env) tune = strcmp(tune_env, "0") != 0;
    if (t->world->size > 1) { /* rank 0's: tuning ends in a broadcast every rank must enter (another
                               * machine's kernels.tune or CTITAN_KERNEL_TUNE hung the job) */
        int32_t tn = tune;
        comm_broadcast(t->world, &tn, 1, COMM_I32, 0);
        tune = tn;
    }
    if (tune) {
        size_t nt;
        const kern_impl *tab = kern_registry(&nt);
        unsigned cpu = kern_cpu_features();
        const lm_config *mc = &t->model.cfg;
        int32_t pick[KERN_N_OPS];
        if (t->world->rank == 0) {
            /* the dense MLP's width; with every layer sparse none runs, but a shared expert
             * (qwen2_moe) runs the same products and activation at its own width */
            int all_sparse = mc->n_experts > 0 && mc->n_mlp_only == 0 && mc->decoder_sparse_step == 1;
            kern_run_sizes rs = {.B = t->cfg.local_batch_size, .T = t->cfg.seq_len, .hidden = mc->hidden,
                                 .inter = all_sparse ? mc->shared_intermediate : mc->intermediate,
                                 .vocab = mc->vocab_size, .n_heads = mc->n_heads, .n_kv_heads = mc->n_kv_heads,
                                 .head_dim = mc->head_dim, .n_experts = mc->n_experts,
                                 .moe_inter = mc->moe_intermediate, .top_k = mc->top_k,
                                 .ce_rows = t->model.ws.logit_rows, .n_params = (long)t->model.n_params, .bf16 = bf16,
                                 .geglu = mc->act == LM_ACT_GELU_TANH,
                                 /* expert parallelism runs the fp32 entries on its own buffers (distributed/ep.c) */
                                 .moe_wbf16 = t->plan.mesh.ep <= 1 && lm_experts_read_bf16(&t->model),
                                 .mm_wbf16 = lm_projections_read_bf16(&t->model)};
            char path[1024];
            kern_tune_cache_path(path, sizeof path, cpu, cpu_threads());
            if ((rc = kern_tune(&t->model.k, tab, nt, cpu, ov, &rs, path, log, sizeof log, e))) return rc;
            for (int op = 0; op < KERN_N_OPS; op++) pick[op] = (int32_t)(t->model.k.chosen[op] - tab);
        }
        if (t->world->size > 1) {
            comm_broadcast(t->world, pick, KERN_N_OPS, COMM_I32, 0);
            if (t->world->rank != 0) {
                for (int op = 0; op < KERN_N_OPS; op++) {
                    const kern_impl *im = pick[op] >= 0 && (size_t)pick[op] < nt ? &tab[pick[op]] : NULL;
                    if (im && !(im->features & ~cpu)) snprintf(spec[op], sizeof spec[op], "%s=%s", kern_op_name((kern_op)op), im->name);
                    else fprintf(stderr, "ctitan: rank %d: kernels: %s=%s of rank 0 does not run on this CPU; keeping %s\n",
                                 t->world->rank, kern_op_name((kern_op)op), im ? im->name : "?", t->model.k.chosen[op]->name);
                }
                if ((rc = kern_select(&t->model.k, ov, log, sizeof log, e))) return rc;
            }
        }
    }
    /* bf16 mixed precision changes which matmul every linear runs, nothing else */
    if (bf16) kern_use_bf16_matmuls(&t->model.k);
    t->model.attn_bf16 = bf16; /* and the attention's products (kern_attn_opt.bf16) */
    const char *isa = getenv("CTITAN_ISA");
    if (isa && *isa && strcmp(isa, "auto")) {
        char have[256];
        kern_features_str(kern_cpu_features(), have, sizeof have);
        fprintf(stderr, "ctitan: CTITAN_ISA=%s: kernels limited to CPU features: %s; OpenBLAS kernels %s\n", isa, have,
                cpu_openblas_corename());
    }
    fprintf(stderr, "ctitan: %s; precision: %s\n", log,
            bf16 ? "bfloat16 matmul inputs (linears: matmul_bf16; attention: bf16 q, k, v, d(out), P, dS), fp32 "
                   "sums, weights, optimizer, norms, softmax, loss"
                 : "float32");
    return 0;
}

/* Threads per rank: several ranks on one machine share its cores. Without an
 * explicit choice (training.threads or OMP_NUM_THREADS) each of the
 * launcher's local ranks takes cores / local ranks, at least 1, so an
 * oversubscribed run does not crawl with every rank spinning on every core. */
static void pick_threads(const ct_config *c) {
    if (c->threads > 0) {
        cpu_set_threads(c->threads);
        return;
    }
    const char *ls = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
    int local = ls ? atoi(ls) : 1;
    if (getenv("OMP_NUM_THREADS") || local <= 1) return;
    int n = cpu_threads() / local;
    cpu_set_threads(n < 1 ? 1 : n);
}

static int init_run(trainer *t, ct_config *cfg, ct_comm *world, int claim, ct_err *e);

/* the library's sessions: they write nothing into job.dump_folder, so they claim nothing */
int trainer_init(trainer *t, ct_config *cfg, ct_err *e) { return init_run(t, cfg, NULL, 0, e); }

int trainer_init_dist(trainer *t, ct_config *cfg, ct_comm *world, ct_err *e) { return init_run(t, cfg, world, 1, e); }

/* [lora] and training.freeze into the model config: which projections get
 * adapters, their scale and dropout. Every layout runs them: tensor and
 * expert parallel slice the adapters with their base projections and
 * experts later (distributed/tp.h). */
int trainer_finetune_config(const ct_config *c, lm_config *mc, ct_err *e) {
    /* each message names where its key was set: the file, or the command line */
    const char *tm_src = cfg_origin(c, "lora.target_modules");
    int rp = c->lora_rank_pattern && c->lora_rank_pattern[0]; /* rank_pattern is set (else only alpha_pattern) */
    int partial = c->lora_rank > 0 || c->freeze[0];
    mc->lazy_buffers = partial; /* the frozen tensors' gradients are never written: no pages for them */
    mc->logit_rows = c->logits_chunk_rows;
    if (c->lora_rank <= 0) {
        if (c->lora_adapter_path[0])
            return ct_fail(e, CT_ERR_CONFIG, "%s: lora.adapter_path: needs lora.rank > 0",
                           cfg_origin(c, "lora.adapter_path"));
        if (c->lora_target_params && c->lora_target_params[0])
            return ct_fail(e, CT_ERR_CONFIG, "%s: lora.target_parameters: needs lora.rank > 0",
                           cfg_origin(c, "lora.target_parameters"));
        if (rp || (c->lora_alpha_pattern && c->lora_alpha_pattern[0]))
            return ct_fail(e, CT_ERR_CONFIG, "%s: lora.%s: needs lora.rank > 0",
                           cfg_origin(c, rp ? "lora.rank_pattern" : "lora.alpha_pattern"),
                           rp ? "rank_pattern" : "alpha_pattern");
        return 0;
    }
    int experts = c->lora_target_params && c->lora_target_params[0];
    /* Mixtral: PEFT's rewrite knows its v4 expert names, w1 + w3 -> gate_up_proj
     * and w2 -> down_proj; gate_proj / up_proj / down_proj name no Mixtral
     * module, which PEFT skips as long as another target matches */
    int mx = mc->n_experts > 0 && mc->moe_keys == LM_MOE_KEYS_MIXTRAL;
    unsigned mx_named = 0;
    /* "gate", PEFT's v4 name of the router module (or any name ending in
     * ".gate", a whole layer's too: PEFT maps it by suffix): its rewrite
     * turns it into target_parameters gate.weight, every MoE layer's router */
    int router_named = 0;
    /* GraniteMoE: gate_proj, up_proj, down_proj and gate name no module (its experts
     * and router are no Linear, and PEFT rewrites nothing for this family): PEFT
     * skips a name that matches nothing while another matches, and raises "Target
     * modules {...} not found in the base model" when none does */
    int granite = mc->n_experts > 0 && mc->moe_keys == LM_MOE_KEYS_GRANITE, kept = 0;
    char *rest = ct_malloc(strlen(c->lora_targets) + 1), item[128];
    char *unmatched = ct_malloc(2 * strlen(c->lora_targets) + 1); /* ", " between names */
    rest[0] = unmatched[0] = 0;
    for (const char *p = c->lora_targets; (p = cfg_list_next(p, item, sizeof item));) {
        if (granite && (!strcmp(item, "gate_proj") || !strcmp(item, "up_proj") || !strcmp(item, "down_proj") ||
                        !strcmp(item, "gate"))) {
            strcat(strcat(unmatched, unmatched[0] ? ", " : ""), item);
            continue;
        }
        kept++;
        int w = !mx ? -1 : !strcmp(item, "w1") ? LM_LORA_GATE : !strcmp(item, "w3") ? LM_LORA_UP
                         : !strcmp(item, "w2") ? LM_LORA_DOWN : -1;
        size_t ni = strlen(item);
        int router = mc->n_experts > 0 && (!strcmp(item, "gate") || (ni > 5 && !strcmp(item + ni - 5, ".gate")));
        if (w >= 0) mx_named |= 1u << w;
        else if (router) router_named = 1;
        else strcat(strcat(rest, rest[0] ? "," : ""), item);
    }
    /* PEFT's "all-linear": every projection, as PEFT resolves it on the model */
    int all_linear = lora_is_all_linear(rest);
    int rc = 0;
    if (granite && unmatched[0] && !kept && !experts)
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "%s: lora.target_modules: %s: no module of model_type \"%s\" has these names (PEFT: \"Target "
                     "modules not found in the base model\"; its experts and router are no Linear); name q_proj, "
                     "k_proj, v_proj, o_proj%s",
                     tm_src, unmatched, mc->model_type,
                     mc->shared_intermediate > 0 ? ", input_linear or output_linear (the shared MLP)" : "");
    free(unmatched);
    if (rc) {
        free(rest);
        return rc;
    }
    /* qwen2_moe: PEFT rewrites nothing into target_parameters for this model (all-linear
     * adapts its Linears, mlp.shared_expert_gate among them, and not the router), and
     * refuses "gate": its router (Qwen2MoeTopKRouter) is no Linear. ERNIE 4.5 MoE's shared
     * experts do not count: PEFT maps ernie4_5_moe to qwen3_moe's rewrite (gate_proj, up_proj,
     * down_proj into the experts' target_parameters, the shared experts' and the dense layers'
     * MLPs left without adapters, "gate" to gate.weight) */
    int shared = mc->shared_intermediate > 0 && !lm_shared_experts_ungated(mc);
    if (shared && router_named && !granite) {
        free(rest);
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: lora.target_modules: \"gate\" on model_type \"%s\" names the router, which PEFT "
                       "refuses there (\"Target module Qwen2MoeTopKRouter() is not supported\": it is no "
                       "Linear); adapt the experts through lora.target_parameters",
                       tm_src, mc->model_type);
    }
    if (all_linear) mc->lora_targets = lora_all_linear(mc);
    else if (!((experts || mx_named || router_named) && !rest[0])) rc = lora_parse_targets(rest, mc, tm_src, e);
    free(rest);
    /* fused projections in the files (Phi3's qkv_proj, gate_up_proj) are named
     * and adapted as PEFT does: one adapter over the fused Linear */
    if (!rc) rc = lora_check_fused(mc, tm_src, "lora.target_modules", e);
    if (rc) return rc;
    if (experts && (rc = lora_parse_target_params(c->lora_target_params, mc, cfg_origin(c, "lora.target_parameters"),
                                               "lora.target_parameters", e)))
        return rc;
    /* MoE models: PEFT 0.21 on transformers v5 rewrites target_modules
     * gate_proj / up_proj / down_proj of a qwen3_moe model into
     * target_parameters of the fused experts (_convert_peft_config_moe):
     * gate_proj + up_proj -> mlp.experts.gate_up_proj at rank 2 r and alpha
     * 2 alpha (rank_pattern / alpha_pattern; one alone is refused),
     * down_proj -> mlp.experts.down_proj, and removes the names from
     * target_modules, so the dense mlp_only_layers' MLPs (plain nn.Linear)
     * get no adapter either. The attention projections stay Linear adapters.
     * Mixtral the same with w1 + w3 and w2 (above). */
    unsigned mlp = (1u << LM_LORA_GATE) | (1u << LM_LORA_UP) | (1u << LM_LORA_DOWN);
    int gate_up_fused = 0;
    /* qwen2_moe: the names stay Linear targets, the dense layers' MLPs and every sparse
     * layer's shared expert (mlp.shared_expert.gate_proj, ...), as PEFT adapts them */
    if (mc->n_experts > 0 && !shared && !granite && ((mc->lora_targets & mlp) || mx_named)) {
        unsigned named = mx && !all_linear ? mx_named : mc->lora_targets;
        mc->lora_targets &= ~mlp;
        int gate = named >> LM_LORA_GATE & 1, up = named >> LM_LORA_UP & 1, down = named >> LM_LORA_DOWN & 1;
        const char *gn = mx ? "w1" : "gate_proj", *un = mx ? "w3" : "up_proj";
        if (gate != up)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: lora.target_modules: %s without %s on a MoE model: PEFT fuses both into "
                           "mlp.experts.gate_up_proj and refuses one alone; name both or neither",
                           tm_src, gate ? gn : un, gate ? un : gn);
        for (int l = 0; l < mc->n_layers; l++)
            if (lm_layer_is_moe(mc, l))
                mc->lora_experts[l] |=
                    (unsigned char)((gate ? 1u << LM_LORA_EXP_GU : 0) | (down ? 1u << LM_LORA_EXP_D : 0));
        gate_up_fused = gate; /* rank_pattern / alpha_pattern below */
        experts |= gate || down;
        if (!mc->lora_targets && !experts)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: lora.target_modules: model_type \"%s\" names its expert projections w1, w3, w2 "
                           "(PEFT adapts them as mlp.experts parameters); name those or some of q_proj, k_proj, "
                           "v_proj, o_proj",
                           tm_src, mc->model_type);
    }
    /* all-linear on a MoE model, or "gate" named: PEFT's rewrite adds
     * target_parameters gate.weight, an adapter on every MoE layer's router
     * (the dense mlp_only layers' MLPs have no "gate" and get none) */
    if ((all_linear || router_named) && mc->n_experts > 0 && !shared && !granite) {
        for (int l = 0; l < mc->n_layers; l++)
            if (lm_layer_is_moe(mc, l)) mc->lora_experts[l] |= (unsigned char)(1u << LM_LORA_EXP_R);
        experts = 1;
    }
    /* PEFT's ParamWrapper refuses dropout: B A drop(x) has no W' x form */
    if (experts && c->lora_dropout > 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: lora.dropout = %g with adapters on the fused experts or the router "
                       "(lora.target_parameters, gate_proj / up_proj / down_proj in lora.target_modules of a MoE "
                       "model, or all-linear there): PEFT's adapters on "
                       "parameters do not work with dropout (lora_dropout != 0 is refused there); set lora.dropout = 0",
                       cfg_origin(c, "lora.dropout"), c->lora_dropout);
    mc->lora_rank = c->lora_rank;
    mc->lora_scale = lora_scaling(c->lora_alpha, c->lora_rank, c->lora_rslora);
    mc->lora_dropout = (float)c->lora_dropout;
    /* per-module ranks and alphas, PEFT's rank_pattern / alpha_pattern (with
     * the MoE rewrite's gate_up_proj at 2 r and 2 alpha) */
    if ((rc = lora_check_saved_targets(mc, c->lora_modules_to_save, cfg_origin(c, "lora.modules_to_save"), e)))
        return rc;
    /* one origin for both patterns' messages: rank_pattern's when it is set */
    return lora_config_patterns(mc, c->lora_rank_pattern, c->lora_alpha_pattern, c->lora_alpha, c->lora_rslora,
                                gate_up_fused, cfg_origin(c, rp ? "lora.rank_pattern" : "lora.alpha_pattern"), e);
}

uint64_t trainer_lora_seed(const trainer *t, int step) {
    return ((uint64_t)t->cfg.seed * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)step << 20);
}

/* A batch the data-parallel ranks cannot split evenly is a layout error:
 * the run and the dry run reject it alike. */
int trainer_check_global_batch(const ct_config *c, int dp, ct_err *e) {
    int per_step = c->local_batch_size * dp;
    if (c->global_batch_size > 0 && c->global_batch_size % per_step != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: training.global_batch_size (%d) must be a multiple of training.local_batch_size (%d) x "
                       "the data-parallel degree (%d = data_parallel_replicate_degree x data_parallel_shard_degree)",
                       cfg_origin_any(c, "training.global_batch_size,training.local_batch_size,"
                                         "parallelism.data_parallel_replicate_degree,"
                                         "parallelism.data_parallel_shard_degree"),
                       c->global_batch_size, c->local_batch_size, dp);
    return 0;
}

/* The gradients and AdamW's moments start zeroed and untouched (ct_alloc_huge's
 * mapping, calloc), and the first step reads each float before writing it
 * (the backward's +=, AdamW), so
 * every page took two faults there, a copy and a TLB shoot-down to the other
 * threads (ct_fill's note): W3's first step ran at half the speed of the next
 * ones (AVX2, 2 threads: 471-547 tok/s against ~1000; 802-875 with this,
 * which itself takes 0.09 s; 1.5 s less system time). Only the trained
 * runs (plan_ready's opt_ranges): the lazy buffers' frozen tensors' pages
 * must stay unmapped. Not FSDP's whole-model gradient buffer, of which only
 * the pieces being reduced are ever resident. After the load, so that its
 * buffers and these are never resident together (and "peak after loading"
 * is the load's); moments a resume restored are written already. */
static void prefault_accumulators(trainer *t) {
    const ct_plan *p = &t->plan;
    int all = p->n_opt_ranges < 0; /* no frozen tensor: one run, the whole buffer */
    for (int i = 0; i < (all ? 1 : p->n_opt_ranges); i++) {
        size_t off = all ? 0 : p->opt_ranges[i].off, n = (all ? t->opt.n : p->opt_ranges[i].n) * sizeof(float);
        if (t->opt.step == 0) {
            ct_fill(t->opt.m + off, 0, n);
            ct_fill(t->opt.v + off, 0, n);
        }
        /* without FSDP the stepped buffer is the model's own, at the same offsets */
        if (!p->fsdp) ct_fill(t->model.grads + off, 0, n);
    }
}

/* 1 when the relative path P may lead out of the folder it is relative to:
 * absolute, or a ".." component. */
static int path_leaves(const char *p) {
    if (p[0] == '/') return 1;
    for (const char *q = p; *q;) {
        size_t n = strcspn(q, "/");
        if (n == 2 && q[0] == '.' && q[1] == '.') return 1;
        q += n;
        q += *q == '/';
    }
    return 0;
}

/* Every file of the run under job.dump_folder (the lock, config.toml, the
 * logs and traces) has a path that fits, or an error naming the key whose
 * value made it too long: checked before anything is created, so a run never
 * trains with a file it cannot write. */
#define RUN_PATH 4096
static int check_run_paths(const ct_config *c, ct_err *e) {
    char path[RUN_PATH];
    const struct { const char *name, *key; } files[] = {
        {"config.toml", "job.dump_folder"},           {"events.jsonl", "job.dump_folder"},
        {".ctitan.lock", "job.dump_folder"},          {c->metrics_file, "metrics.file"},
        {c->save_tb_folder, "metrics.save_tb_folder"}, {c->save_traces_folder, "profiling.save_traces_folder"},
    };
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
        const char *key = files[i].key, *name = files[i].name;
        if (trainer_join_path(path, sizeof path, c->dump_folder, name)) {
            size_t n = name[0] == '/' || !c->dump_folder[0] ? strlen(name) : strlen(c->dump_folder) + 1 + strlen(name);
            char both[96]; /* the path joins two options' values */
            snprintf(both, sizeof both, "job.dump_folder,%s", key);
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s: too long for %s beneath it (%zu bytes, at most %zu)",
                           cfg_origin_any(c, both), key, name, n, sizeof path - 1);
        }
    }
    return 0;
}

/* One run per job.dump_folder (docs/checkpoints.md, "One run per folder"):
 * two runs in one folder overwrote each other's checkpoints, metrics.jsonl
 * and events.jsonl without a word. Rank 0 takes an exclusive flock on
 * {dump_folder}/.ctitan.lock, never waiting, and keeps it until trainer_free
 * or its end (the kernel drops it however the process ends, so a killed run
 * leaves nothing stale to clear by hand; the file itself stays). Held by
 * another process: CT_ERR_CONFIG naming the folder and what the holder wrote
 * in the file (its pid and host). A file system without flock (some NFS
 * mounts): a warning, and the run goes on unguarded. With the lock held no
 * other run writes in the folder, so every temporary directory of a save cut
 * short in the checkpoint folder beneath it is stale, whatever pid it names
 * (ckpt_prune spares live pids' ones and ran only after a save): removed, with
 * a note. Collective: the other ranks learn of rank 0's failure and fail too
 * (quietly, with CT_ERR_CONFIG: the error is rank 0's to tell). */
static int claim_dump_folder(trainer *t, ct_err *e) {
    const ct_config *c = &t->cfg;
    int32_t code = check_run_paths(c, e); /* the same on every rank: no collective needed for it */
    if (code) return code;
    if (t->world->rank == 0) {
        const char *dump = c->dump_folder[0] ? c->dump_folder : ".";
        char path[RUN_PATH], note[400], host[256] = "", holder[400];
        gethostname(host, sizeof host - 1);
        snprintf(note, sizeof note, "pid %ld on host %s\n", (long)getpid(), host[0] ? host : "?");
        int fd = -1, rc = 0;
        ct_err le = {0};
        trainer_join_path(path, sizeof path, c->dump_folder, ".ctitan.lock"); /* fits: check_run_paths */
        if (!(code = ct_mkdirs(dump, e)) && (rc = fs_lock(path, note, &fd, holder, sizeof holder, &le))) {
            if (rc == FS_LOCK_HELD)
                code = ct_fail(e, CT_ERR_CONFIG,
                               "job.dump_folder = %s is in use by another run (%s holds %s): one run per folder; "
                               "wait for it to end or stop it, or give this run another job.dump_folder",
                               dump, holder[0] ? holder : "a process starting up", path);
            else if (rc == FS_LOCK_NONE)
                fprintf(stderr, "ctitan: warning: %s; this file system cannot lock, so a second run started in "
                        "this folder would not be detected (one run per folder)\n", le.msg);
            else code = ct_fail(e, rc, "%s", le.msg);
        }
        if (!code && !rc) t->dump_lock = fd + 1;
        /* the checkpoint folder is the lock's when it lies beneath job.dump_folder */
        int n = 0;
        char first[256];
        if (t->dump_lock && !path_leaves(c->ckpt_folder) &&
            ckpt_clean_temps(t->ckpt_folder, 1, &n, first, sizeof first, &le))
            fprintf(stderr, "ctitan: warning: %s (a leftover of a save cut short)\n", le.msg);
        else if (n == 1)
            fprintf(stderr, "ctitan: note: removed %s from %s, the leftover of a save cut short (this run holds the "
                    "folder: no other run is writing there)\n", first, t->ckpt_folder);
        else if (n > 1)
            fprintf(stderr, "ctitan: note: removed %s and %d more from %s, leftovers of saves cut short (this run "
                    "holds the folder: no other run is writing there)\n", first, n - 1, t->ckpt_folder);
    }
    if (t->world->size > 1) {
        comm_allreduce(t->world, &code, 1, COMM_I32, COMM_MAX);
        if (code && t->world->rank != 0)
            return ct_fail(e, CT_ERR_CONFIG, "rank 0 could not claim job.dump_folder (its error says why)");
    }
    return code;
}

/* Every rank builds the model from its own machine's copy of the model's files:
 * one that is another model's, valid but different (a rope_theta, a size), would
 * train other maths on that rank without a word, or fail deep inside a collective.
 * The ranks compare a fingerprint of the model as its config.json would be written
 * (ct_hash_text of lm_config_hf_json's text), before anything is built. */
static int agree_on_model(trainer *t, const lm_config *mc, ct_err *e) {
    if (t->world->size <= 1) return 0;
    char *text = lm_config_hf_json(mc, "float32");
    int64_t v = (int64_t)(ct_hash_text(text) >> 2), lo, hi; /* 62 bits: its negation fits */
    free(text);
    comm_range_i64(t->world, &v, &lo, &hi, 1);
    if (lo == hi) return 0;
    const ct_config *c = &t->cfg;
    ct_fail(e, CT_ERR_CONFIG,
            "the ranks built different models from their model config (model.hf_assets_path = \"%s\", "
            "model.spec = \"%s\"; this rank's differs from another's): every machine must hold the same model "
            "files",
            c->hf_assets_path, c->model_spec);
    e->all_ranks = 1; /* every rank knows it from the all-reduce */
    return CT_ERR_CONFIG;
}

static int open_data(trainer *t, ds **out, const char *kind_name, const char *path, const char *key, int seq_len,
                     int shuffle, int *template_seen, tok **tk, ct_err *e);

/* The run's training and validation data, checked by every rank together. */
static int open_run_data(trainer *t, ct_err *e) {
    const ct_config *c = &t->cfg;
    int template_seen = t->world->rank != 0; /* only rank 0 warns of an unused chat template */
    int rc = open_data(t, &t->data, c->dataset, c->dataset_path, "training.dataset_path", c->seq_len, c->shuffle,
                       &template_seen, &t->tk, e);
    if (!rc && c->val_enable) /* windows of validation.seq_len + 1 tokens */
        rc = open_data(t, &t->val, c->val_dataset, c->val_dataset_path, "validation.dataset_path",
                       cfg_val_seq_len(c), 0, &template_seen, &t->tk, e);
    if ((rc = trainer_agree(t, rc, "open its data", e))) return rc; /* a data file one machine alone lacks */
    return trainer_agree_data(t, t->data, t->val, e);
}

static int init_run(trainer *t, ct_config *cfg, ct_comm *world, int claim, ct_err *e) {
    memset(t, 0, sizeof *t);
    t->t_launch = ev_wall_time();
    t->cfg = *cfg;
    memset(cfg, 0, sizeof *cfg);
    ct_config *c = &t->cfg;
    if (!world) {
        comm_init_single(&t->single);
        world = &t->single;
    }
    t->world = world;
    if (world->rank == 0) ev_energy_start(&t->energy);
    pick_threads(c);
    lm_config mc;
    int rc = trainer_agree_config(t, e);
    if (rc) return rc;
    rc = trainer_resolve_hub(c, 0, e);
    if (!rc) rc = trainer_model_config(c, &mc, e);
    /* each rank reads its own machine's copy of the model's config.json (or its
     * own Hub cache): one may fail alone, where the others went on into plan_init */
    if ((rc = trainer_agree(t, rc, "read the model's config", e))) return rc;
    if ((rc = agree_on_model(t, &mc, e))) return rc;
    if (world->rank == 0) trainer_warn_positions(c, &mc);
    /* the layout is checked before anything big is built */
    if ((rc = plan_init(&t->plan, world, c, &mc, trainer_layout_origin(c), e))) return rc;
    int dp = t->plan.mesh.dp_size, per_step = c->local_batch_size * dp;
    if ((rc = trainer_check_global_batch(c, dp, e))) return rc;
    t->global_batch = c->global_batch_size > 0 ? c->global_batch_size : per_step;
    t->grad_accum = t->global_batch / per_step;
    t->val_batch = c->val_local_batch_size > 0 ? c->val_local_batch_size : c->local_batch_size;
    int plan_b = t->val_batch > c->local_batch_size ? t->val_batch : c->local_batch_size;
    if (trainer_join_path(t->ckpt_folder, sizeof t->ckpt_folder, c->dump_folder, c->ckpt_folder))
        return ct_fail(e, CT_ERR_CONFIG, "%s: checkpoint.folder: path too long",
                       cfg_origin_any(c, "job.dump_folder,checkpoint.folder"));
    const ct_mesh *ms = &t->plan.mesh;
    if ((rc = trainer_finetune_config(c, &mc, e))) return rc;
    /* this rank's part of the model: its pipeline stages, its slice */
    if ((rc = plan_local_model(&t->plan, &mc, t->grad_accum, t->val_batch, &plan_b, trainer_layout_origin(c), e)))
        return rc;
    /* context parallel: the model runs on a chunk of each sequence (plan_seq_len); its buffers
     * hold the larger of training's and validation's forwards (validation.seq_len) */
    int plan_T;
    plan_model_shape(c, t->plan.pp != NULL, ms->cp > 1 ? ms->cp : 1, &plan_b, &plan_T);
    if ((rc = lm_create_ac(&t->model, &mc, plan_b, plan_T, c->ac_mode, c->ac_selective_option, e)))
        return rc;
    if ((rc = lora_apply_frozen(&t->model, c->freeze, c->lora_modules_to_save, trainer_frozen_origin(c), e)))
        return rc;
    if (t->model.n_frozen && !strcmp(c->frozen_dtype, "bfloat16")) { /* before the weights load into it */
        size_t n = lm_store_frozen_bf16(&t->model);
        int N = ms->dp_shard > 1 ? ms->dp_shard : 1; /* FSDP shards them in bf16 too (distributed/fsdp.h) */
        if (t->world->rank == 0 && N > 1)
            fprintf(stderr,
                    "ctitan: frozen weights in bfloat16: %.3f GiB (fp32 would be %.3f GiB), FSDP-sharded over %d "
                    "ranks: about %.3f GiB per rank\n",
                    n * 2.0 / (1 << 30), n * 4.0 / (1 << 30), N, n * 2.0 / N / (1 << 30));
        else if (t->world->rank == 0)
            fprintf(stderr, "ctitan: frozen weights in bfloat16: %.3f GiB (fp32 would be %.3f GiB)\n",
                    n * 2.0 / (1 << 30), n * 4.0 / (1 << 30));
    }
    /* the layout and the settings are checked; before the minutes that tuning and
     * the weights may take, and before the checkpoint folder is looked at */
    if (claim && (rc = claim_dump_folder(t, e))) return rc;
    /* the CLI's run: its data before tuning and the weights, which may take minutes, so that
     * a missing tokenizer, a malformed file or one too short for seq_len is said at once
     * (torchtitan builds its dataloader before the model) */
    if (claim && (rc = open_run_data(t, e))) return rc;
    /* after the bf16 store: tuning times the experts entries the run will call */
    if ((rc = select_kernels(t, e))) return rc;
    /* MoE load-balancing loss: HF adds it per forward; a step is the mean of its micro-batches'
     * (a pipeline's forward is one of its micro-batches: distributed/pp.h) */
    int fwd_batch = t->plan.pp ? c->pp_microbatch : c->local_batch_size;
    t->model.moe.aux_scale = (float)fwd_batch / (float)t->global_batch;
    if (t->model.cfg.lazy_buffers) adamw_init_lazy(&t->opt, t->model.n_params);
    else adamw_init(&t->opt, t->model.n_params);
    t->hp = (adamw_hparams){c->lr, c->beta1, c->beta2, c->eps, c->weight_decay, !strcmp(c->opt_name, "Adam")};
    int dt = lr_decay_type_from_name(c->decay_type);
    /* torchtitan's build_lr_schedulers: a warmup longer than the run is cut
     * to the run, with a warning (uncut, the lr never got near its peak) */
    int warmup = c->warmup_steps;
    if (warmup > c->steps) {
        if (t->world->rank == 0)
            fprintf(stderr, "ctitan: warning: lr_scheduler.warmup_steps (%d) exceeds training.steps (%d): warming up "
                    "over %d steps\n", warmup, c->steps, c->steps);
        warmup = c->steps;
    }
    lr_schedule_init(&t->sched, c->steps, warmup, c->decay_ratio, dt < 0 ? LR_DECAY_LINEAR : dt, c->min_lr_factor);

    rc = trainer_init_weights(t, e);
    if (!rc) rc = plan_ready(&t->plan, e); /* the layouts' hooks on the model, the trained runs */
    if (!rc && !t->complete) prefault_accumulators(t);
    return rc;
}

void trainer_free(trainer *t) {
    ct_err we = {0};
    if (trainer_save_wait(t, 0, &we)) /* trainer_run waits; this is for a caller that did not run it out */
        fprintf(stderr, "ctitan: error: the checkpoint in the background failed: %s\n", we.msg);
    trainer_stage_free(t);
    ds_close(t->val);
    ds_close(t->data);
    tok_free(t->tk);
    if (t->dump_lock) close(t->dump_lock - 1); /* releases job.dump_folder */
    plan_free(&t->plan);
    lm_free(&t->model);
    adamw_free(&t->opt);
    cfg_free(&t->cfg);
    memset(t, 0, sizeof *t);
}

void trainer_optimizer_step(trainer *t, double *grad_norm, double *lr) {
    lm_model *m = &t->model;
    double cur_lr = t->cfg.lr * lr_schedule_factor(&t->sched, t->step);
    double norm = plan_optimizer_step(&t->plan, cur_lr, &t->hp, t->cfg.max_norm);
    if (t->cfg.load_balance_coeff > 0 && m->moe.n_layers) { /* torchtitan's step pre-hook; the step's counts */
        int E = m->cfg.n_experts;
        plan_sum_dp(&t->plan, m->moe.tokens, (size_t)m->cfg.n_layers * E, COMM_F64);
        for (int l = 0; l < m->cfg.n_layers; l++)
            if (lm_layer_is_moe(&m->cfg, l) && lm_holds_layer(&m->cfg, l)) /* a pipeline stage: its layers' */
                moe_update_bias(m->moe.bias + (size_t)l * E, m->moe.tokens + (size_t)l * E, E, t->cfg.load_balance_coeff);
    }
    t->step++;
    if (grad_norm) *grad_norm = norm;
    if (lr) *lr = cur_lr;
}

/* The tokenizer, loaded only when a source needs one (text, jsonl, chat). */
static int needs_tokenizer(const char *kind_name, const char *path, int *needs, ct_err *e) {
    ds_kind k;
    if (ds_kind_parse(kind_name, &k) != 0) k = DS_KIND_AUTO;
    if (k == DS_KIND_AUTO) {
        int rc = ds_detect_kind(path, &k, e);
        if (rc) return rc;
    }
    *needs = k != DS_KIND_TOKENS;
    return 0;
}

/* template_seen: the run's note on training.chat_template (ds_tok_opts), shared
 * by its training and validation data. */
static int open_data(trainer *t, ds **out, const char *kind_name, const char *path, const char *key, int seq_len,
                     int shuffle, int *template_seen, tok **tk, ct_err *e) {
    const ct_config *c = &t->cfg;
    if (!path[0]) return ct_fail(e, CT_ERR_CONFIG, "%s: %s: no data given", cfg_origin(c, key), key);
    int need = 0, rc = needs_tokenizer(kind_name, path, &need, e);
    if (rc) return rc;
    if (need && !*tk) {
        if (!c->hf_assets_path[0])
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: model.hf_assets_path: needed to tokenize %s (%s); point it at a directory with "
                           "tokenizer.json",
                           cfg_origin_any(c, "model.hf_assets_path,training.dataset_path,validation.dataset_path"),
                           path, key);
        if ((rc = tok_load(cfg_hf_dir(c), tk, e))) return rc;
        if (tok_vocab_size(*tk) > t->model.cfg.vocab_size)
            return ct_fail(e, CT_ERR_CONFIG, "%s: the tokenizer has %d ids but the model's vocabulary is %d",
                           c->hf_assets_path, tok_vocab_size(*tk), t->model.cfg.vocab_size);
    }
    ds_config dc;
    ds_config_default(&dc);
    dc.seq_len = seq_len;
    dc.seq_key = seq_len != c->seq_len ? "validation.seq_len" : "training.seq_len";
    dc.vocab_size = t->model.cfg.vocab_size;
    dc.shuffle = shuffle;
    dc.seed = (uint64_t)c->seed;
    dc.rank = t->plan.mesh.dp_rank; /* data-parallel ranks read disjoint windows */
    dc.world = t->plan.mesh.dp_size;
    dc.quiet = t->world->rank != 0;
    ds_kind k;
    if (ds_kind_parse(kind_name, &k) == 0) dc.tok.kind = k;
    ds_text_split sp;
    if (ds_split_parse(c->text_split, &sp) == 0) dc.tok.text_split = sp;
    dc.tok.chat_template = c->chat_template;
    /* "text" as prepare without --text-field: a record with "prompt" is then prompt-completion data */
    dc.tok.text_field = strcmp(c->text_field, "text") ? c->text_field : NULL;
    /* which tokens are targets (TRL's options of the same names; ctitan's defaults: true) */
    dc.tok.assistant_only_loss = c->assistant_only_loss;
    dc.tok.completion_only_loss = c->completion_only_loss;
    dc.tok.template_seen = template_seen;
    dc.tok.tokenizer_dir = c->hf_assets_path[0] ? cfg_hf_dir(c) : NULL;
    const char *paths[1] = {path};
    int rc2 = ds_open(out, paths, 1, *tk, &dc, e);
    /* data/chat.c names the spec as prepare's --chat-template and this key share it: say which key */
    if (rc2 && !strncmp(e->msg, "chat_template = ", 16)) {
        char msg[sizeof e->msg];
        snprintf(msg, sizeof msg, "%s", e->msg);
        return ct_fail(e, rc2, "%s: training.%s", cfg_origin(c, "training.chat_template"), msg);
    }
    return rc2;
}

/* MoE: the step's load-balancing loss and, per MoE layer, the tokens of its least
 * and most loaded expert (last micro-batch; the extremes over the data-parallel
 * ranks' last ones, log_step; under context parallel the whole sequences' loads,
 * summed over the chunks by cp_moe_forward_backward, or by pp_step under a
 * pipeline): console fields, or JSON members. */
static void print_moe_load(FILE *f, const lm_model *m, double aux, int json) {
    fprintf(f, json ? ", \"aux_loss\": %.9g, \"moe_load_min\": [" : "  aux_loss: %.4f  load(min/max):", aux);
    for (int pass = 0; pass < (json ? 2 : 1); pass++) {
        if (pass) fprintf(f, "], \"moe_load_max\": [");
        int first = 1;
        for (int l = 0; l < m->cfg.n_layers; l++) {
            if (m->moe.load_min[l] < 0) continue;
            if (json) fprintf(f, "%s%d", first ? "" : ", ", pass ? m->moe.load_max[l] : m->moe.load_min[l]);
            else fprintf(f, " %d/%d", m->moe.load_min[l], m->moe.load_max[l]);
            first = 0;
        }
    }
    if (json) fprintf(f, "]");
}

/* Keeps the metrics lines of steps <= last_step (every line starts with {"step": N).
 * *seen_step and *seen_time get the furthest step and latest "time" of the
 * lines before the cut: a killed session's last sign of life, which the cut
 * would otherwise erase (ctitan compare counts the work it redoes from them). */
static void truncate_metrics(const char *path, int last_step, int *seen_step, double *seen_time) {
    FILE *f = fopen(path, "r");
    if (!f) return;
    char *keep = NULL, *line = NULL;
    size_t keep_len = 0, cap = 0;
    FILE *out = open_memstream(&keep, &keep_len);
    ssize_t got;
    while (out && (got = getline(&line, &cap, f)) > 0) {
        int step;
        if (line[got - 1] != '\n') continue; /* torn by a kill mid-write */
        int has_step = sscanf(line, "{\"step\": %d", &step) == 1;
        const char *tm = strstr(line, "\"time\": ");
        if (has_step && step > *seen_step) *seen_step = step;
        if (tm && !(strtod(tm + 8, NULL) <= *seen_time)) *seen_time = strtod(tm + 8, NULL);
        if (has_step && step > last_step) continue;
        fputs(line, out);
    }
    fclose(f);
    free(line);
    if (!out) return;
    fclose(out);
    fs_write_atomic(path, keep, keep_len, NULL); /* a kill leaves the old file or the new one, never none */
    free(keep);
}

/* A failed TensorBoard write costs the curves, not the run (as metrics.file):
 * said once, then the writer is dropped. */
static void tb_flush_or_drop(tb_writer **tb) {
    if (*tb && tb_flush(*tb)) {
        fprintf(stderr, "ctitan: warning: %s: write failed; no more TensorBoard events\n", tb_path(*tb));
        tb_close(*tb);
        *tb = NULL;
    }
}

/* V as metrics.file prints it with FMT, so both files hold the same numbers
 * (TensorBoard's float32 aside) rather than the file's rounding of them. */
static double as_logged(const char *fmt, double v) {
    char buf[64];
    snprintf(buf, sizeof buf, fmt, v);
    return strtod(buf, NULL);
}

/* Held-out loss over validation.steps batches from the start of the set. */
static int validate(trainer *t, ds *val, int step, FILE *mf, tb_writer **tb) {
    const ct_config *c = &t->cfg;
    int B = t->val_batch, T = cfg_val_seq_len(c); /* validation.seq_len's windows */
    ds_state zero = {0, 0};
    ds_set_state(val, &zero, NULL);
    long batches = c->val_steps;
    if (batches < 0) batches = (long)((ds_windows_per_rank(val) + B - 1) / B);
    long full = (long)(ds_windows_per_rank(val) / B);
    if (c->val_steps < 0 && full > 0) batches = full; /* one pass without wrapping around */
    int32_t *x = ct_malloc((size_t)B * T * sizeof(int32_t)), *y = ct_malloc((size_t)B * T * sizeof(int32_t));
    double sum = 0, t0 = ct_now();
    long n = 0;
    for (long i = 0; i < batches; i++) {
        long nv = 0;
        ds_next(val, x, y, B);
        sum += plan_eval(&t->plan, x, y, B, T, &nv);
        n += nv;
    }
    plan_sum_eval(&t->plan, &sum, &n);
    free(x);
    free(y);
    double loss = n ? sum / n : 0, ppl = exp(loss);
    printf("validate step: %d  loss: %.4f  perplexity: %.3f  (%ld batches, %ld targets, %.1f s)\n", step, loss, ppl,
           batches, n, ct_now() - t0);
    fflush(stdout);
    if (mf) {
        fprintf(mf, "{\"step\": %d, \"val_loss\": %.9g, \"val_perplexity\": %.9g, \"val_targets\": %ld}\n", step, loss,
                ppl, n);
        fflush(mf);
    }
    if (*tb) {
        tb_scalar(*tb, step, "val_loss", as_logged("%.9g", loss));
        tb_scalar(*tb, step, "val_perplexity", as_logged("%.9g", ppl));
        tb_flush_or_drop(tb);
    }
    return 0;
}

/* events.jsonl (metrics/events.h): the start of this process's part of the
 * run. Collective (the machine count). */
static void write_start_event(trainer *t, int seen_step, double seen_time) {
    /* machines: distinct host names over the ranks, by a hash of each */
    char host[256] = "";
    gethostname(host, sizeof host - 1);
    uint64_t h = ct_hash_text(host), *all = ct_malloc(sizeof(uint64_t) * t->world->size);
    comm_all_gather(t->world, all, &h, 1, COMM_I64);
    int machines = 0;
    for (int i = 0; i < t->world->size; i++) {
        int seen = 0;
        for (int j = 0; j < i; j++) seen |= all[j] == all[i];
        machines += !seen;
    }
    free(all);
    if (!t->events) return;
    char cpu[256];
    cpu_model_name(cpu, sizeof cpu);
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", t->step);
    cJSON_AddNumberToObject(o, "steps", t->cfg.steps);
    cJSON_AddNumberToObject(o, "launch_time", t->t_launch);
    cJSON_AddNumberToObject(o, "startup_s", ev_wall_time() - t->t_launch);
    cJSON_AddNumberToObject(o, "world", t->world->size);
    cJSON_AddNumberToObject(o, "machines", machines);
    cJSON_AddNumberToObject(o, "threads", cpu_threads());
    cJSON_AddStringToObject(o, "host", host);
    cJSON_AddStringToObject(o, "cpu", cpu);
    if (t->loaded.dir[0]) {
        cJSON_AddStringToObject(o, t->loaded.resumed ? "resumed_from" : "initial_load", t->loaded.dir);
        cJSON_AddNumberToObject(o, "load_s", t->loaded.seconds);
        cJSON_AddNumberToObject(o, "load_mib", t->loaded.mib);
    }
    if (seen_step >= 0) cJSON_AddNumberToObject(o, "metrics_last_step", seen_step);
    if (isfinite(seen_time)) cJSON_AddNumberToObject(o, "metrics_last_time", seen_time);
    ev_write(t->events, "start", o);
}

void trainer_checkpoint_event(trainer *t, const char *kind, const char *dir, double mib, double seconds) {
    if (!t->events) return;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", t->step);
    cJSON_AddStringToObject(o, "kind", kind);
    cJSON_AddStringToObject(o, "path", dir);
    if (mib >= 0) cJSON_AddNumberToObject(o, "mib", mib);
    cJSON_AddNumberToObject(o, "save_s", seconds);
    ev_write(t->events, "checkpoint", o);
}

/* The end of this process's part of the run: why, and what it cost (rank 0's
 * wall and CPU time; the energy of rank 0's machine when RAPL is readable). */
static void write_exit_event(trainer *t, int rc, const ct_err *e) {
    if (!t->events) return;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "reason", !rc ? "done" : rc == CT_STOPPED ? "stopped" : "error");
    cJSON_AddNumberToObject(o, "step", t->step);
    if (rc && rc != CT_STOPPED) {
        cJSON_AddNumberToObject(o, "code", rc);
        cJSON_AddStringToObject(o, "message", e->msg);
    }
    cJSON_AddNumberToObject(o, "wall_s", ev_wall_time() - t->t_launch);
    cJSON_AddNumberToObject(o, "cpu_s", ev_cpu_seconds());
    /* what the checkpoints held the step loop up (async_mode: the stage, then the waits) */
    cJSON_AddNumberToObject(o, "ckpt_save_s", t->ckpt_save_s);
    cJSON_AddNumberToObject(o, "ckpt_wait_s", t->ckpt_wait_s);
    double j = ev_energy_since(&t->energy);
    if (j >= 0) cJSON_AddNumberToObject(o, "energy_j", j);
    else cJSON_AddStringToObject(o, "energy_unavailable", t->energy.why);
    ev_write(t->events, "exit", o);
}

/* The files a run writes as it goes (rank 0's; the profiler's on every rank);
 * NULL where the config turns one off. */
typedef struct {
    FILE *metrics;  /* metrics.file */
    tb_writer *tb;  /* metrics.enable_tensorboard */
    prof *pf;       /* [profiling]: lent to the plan (model, communicators) for each traced step */
} run_files;

/* The run's folder: config.toml (the resolved config, so a run can be
 * reproduced from its folder), metrics.jsonl, TensorBoard, the profiler, and
 * events.jsonl with its start event. What it opened before an error is in f,
 * for close_run_files. */
static int open_run_files(trainer *t, run_files *f, ct_err *e) {
    const ct_config *c = &t->cfg;
    char path[RUN_PATH];
    int rank0 = t->world->rank == 0; /* files of the run are written once */
    int seen_step = -1;              /* what a resume cuts from metrics.jsonl (truncate_metrics) */
    double seen_time = NAN;
    int rc = check_run_paths(c, e); /* done already where claim_dump_folder ran; not for library sessions */
    if (rc) return rc;
    if (rank0) {
        trainer_join_path(path, sizeof path, c->dump_folder, "config.toml");
        FILE *cf = fopen(path, "w");
        if (cf) {
            cfg_write_toml(c, cf);
            fclose(cf);
        }
    }
    if (c->metrics_file[0] && rank0) {
        trainer_join_path(path, sizeof path, c->dump_folder, c->metrics_file);
        /* a resumed run continues the file of the run it resumes, minus the lines
         * of steps after the checkpoint (they are about to be redone) */
        if (t->step > 0) truncate_metrics(path, t->step, &seen_step, &seen_time);
        f->metrics = fopen(path, t->step > 0 ? "a" : "w");
        if (!f->metrics) return ct_fail(e, CT_ERR_IO, "%s: cannot open metrics file (metrics.file)", path);
    }
    if (c->enable_tensorboard && rank0) {
        trainer_join_path(path, sizeof path, c->dump_folder, c->save_tb_folder);
        /* a new file per (re)start; its SessionLog START at the first step
         * redone makes TensorBoard drop the earlier files' events from there */
        if (!(f->tb = tb_open(path, t->step + 1, e))) return e->code;
    }
    if (c->enable_profiling) {
        trainer_join_path(path, sizeof path, c->dump_folder, c->save_traces_folder);
        f->pf = prof_new(t->world->rank, path);
        prof_set_kernels(f->pf, &t->model.k);
    }
    if (rank0) {
        trainer_join_path(path, sizeof path, c->dump_folder, "events.jsonl");
        t->events = ev_open(path, e);
    }
    write_start_event(t, seen_step, seen_time); /* collective: before rank 0 may leave */
    return rank0 && !t->events ? e->code : 0;
}

static void close_run_files(trainer *t, run_files *f) {
    if (f->metrics) fclose(f->metrics);
    if (f->tb && tb_close(f->tb)) fprintf(stderr, "ctitan: warning: %s: write failed\n", tb_path(f->tb));
    if (f->pf) plan_profile(&t->plan, NULL); /* a step that failed while traced */
    prof_free(f->pf);
}

/* What the console line and metrics.jsonl measure a step against. */
typedef struct {
    double fpt;              /* FLOPs per token (6 x matmul params incl. lm_head + attention) */
    double peak;             /* the FMA peak of the arithmetic the matmuls run in */
    double t_start, t_log;   /* the run's start; the last logged line */
    /* ETA: the mean wall time per step of this session after its first step (which
     * pays for first touches and, on a resume, the page cache), validation and saves included */
    int first_step;
    double t_first_end;
    long tokens_since_log;
    int steps_since_log;
} run_clock;

/* PEFT's get_nb_trainable_parameters counts a modules_to_save module twice: the
 * original it wraps (frozen) and the trained copy. ctitan trains the one tensor, so
 * PEFT's total is the model's plus these tensors once more (a tied pair is one
 * tensor, as ensure_weight_tying shares one copy). */
size_t trainer_saved_params(const lm_model *m) {
    size_t n = 0;
    if (m->cfg.lora_rank <= 0) return 0;
    for (int i = 0; i < m->n_tensors; i++)
        if (!m->tensors[i].frozen && !m->tensors[i].lora) n += m->tensors[i].numel;
    return n;
}

void trainer_print_trained(FILE *out, const char *prefix, size_t trained, size_t total, size_t saved, int lora) {
    size_t all = total + saved; /* PEFT's "all params" */
    fprintf(out, "%strained: %zu parameters (%.3f%%%s) of %zu, frozen: %zu (no gradient, no moments)\n", prefix,
            trained, all ? 100.0 * (double)trained / (double)all : 0.0,
            lora ? ", LoRA adapters and modules_to_save" : "", all, total - trained);
}

/* The run's summary on stderr (model, batch, layout, FLOPs and peak), and
 * k's fpt and peak. The data is not in it: ds_open has just logged its
 * line ("data: NAME: tokens, windows, masking, each rank's share"), a
 * superset of what a line here said a second time. */
static void print_run_banner(trainer *t, run_clock *k) {
    const ct_config *c = &t->cfg;
    const lm_model *m = &t->model;
    int B = c->local_batch_size, T = c->seq_len;
    cpu_peak peak;
    if (c->peak_tflops > 0)
        peak = (cpu_peak){.flops = c->peak_tflops * 1e12, .bf16_flops = c->peak_tflops * 1e12,
                          .threads = cpu_threads(), .source = "config", .isa = "-", .bf16_isa = "-"};
    else cpu_peak_flops(&peak, cpu_threads(), getenv("CTITAN_ISA")); /* the level the kernels are held to */
    /* MFU against the peak of the arithmetic the matmuls run in (torchtitan: the
     * device's bf16 peak for bf16 training), so a bf16 run is not credited with
     * fp32-unit utilisation it did not need */
    int bf16_mm = !strcmp(c->mixed_precision_param, "bfloat16");
    k->peak = bf16_mm ? peak.bf16_flops : peak.flops;
    /* MFU is this rank's: the FLOPs it runs per token of its data-parallel
     * share (its slice under TP, its stage under PP: the whole model's count
     * shared by the ranks that run those tokens) over its own peak, which is
     * torchtitan's whole-model FLOPs x tokens / (non-data-parallel ranks) */
    k->fpt = lm_flops_per_token(m, T);
    /* the model as a whole, in every layout, as the dry run and PEFT's line count it */
    lm_model whole;
    lm_layout(&whole, &t->plan.whole);
    const lm_config *wc = &t->plan.whole;
    double fpt_whole = lm_flops_per_token(&whole, T);
    char layout[256], part[224] = "", fpt_note[96] = "";
    plan_layout_str(&t->plan, layout, sizeof layout);
    /* "model NAME: N parameters": where this rank runs a part of the model (TP,
     * PP, EP; not FSDP, whose ranks run all of it), that part first, as the dry
     * run's "parameters run by this rank", said to be a part, then the whole */
    int held = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) held += lm_holds_layer(&m->cfg, l);
    if (m->n_params != whole.n_params) {
        char what[96] = "";
        size_t w = 0;
        if (m->cfg.n_heads != wc->n_heads || m->cfg.n_kv_heads != wc->n_kv_heads)
            w += (size_t)snprintf(what + w, sizeof what - w, ", heads %d/%d", m->cfg.n_heads, m->cfg.n_kv_heads);
        if (held != wc->n_layers && w < sizeof what)
            w += (size_t)snprintf(what + w, sizeof what - w, ", %d of the layers", held);
        if (m->cfg.expert_rows && m->cfg.expert_rows != wc->n_experts && w < sizeof what)
            snprintf(what + w, sizeof what - w, ", experts %d..%d", m->cfg.expert0,
                     m->cfg.expert0 + m->cfg.expert_rows - 1);
        snprintf(part, sizeof part, "%zu parameters on rank %d of %d (its part%s) of ", m->n_params, t->world->rank,
                 t->world->size, what);
    }
    if (k->fpt != fpt_whole) /* MFU's and tflops' figure: this rank's */
        snprintf(fpt_note, sizeof fpt_note, "its part of the model; the whole model: %.3g; ", fpt_whole);
    /* a pipeline stage keeps each forward in flight in a bank beside the shared arena: the
     * total is what the dry run plans (its pool's peak, pp_bank_floats) */
    double act_mib = lm_activation_bytes(m) / 1048576.0;
    char banks[96] = "";
    if (t->plan.pp) {
        int nb = 0;
        double bank_mib = 4.0 * (double)pp_bank_floats(t->plan.pp, m, &nb) / 1048576.0;
        snprintf(banks, sizeof banks, " (shared %.1f MiB + %d bank%s %.1f MiB)", act_mib, nb, nb == 1 ? "" : "s",
                 bank_mib);
        act_mib += bank_mib;
    }
    fprintf(stderr,
            "ctitan: model %s: %s%zu parameters%s, %d layers, hidden %d, heads %d/%d x %d, vocab %d%s\n"
            "ctitan: batch %d x %d tokens, %d micro-batch(es) per step, steps %d..%d; activations %.1f MiB%s\n"
            "ctitan: parallelism: %s; global batch %d sequences; %d thread(s) per rank\n"
            "ctitan: %.3g FLOPs/token%s (%s6 x matmul params incl. lm_head + attention); peak %.1f GFLOP/s %s on %d "
            "threads (%s, %s%s%s)\n",
            wc->name, part, whole.n_params, part[0] ? " in the whole model" : "", wc->n_layers, wc->hidden,
            wc->n_heads, wc->n_kv_heads, wc->head_dim, wc->vocab_size, wc->tie_embeddings ? ", tied" : "", B, T,
            t->grad_accum, t->step + 1, c->steps,
            act_mib, banks, layout, t->global_batch, cpu_threads(), k->fpt, fpt_note[0] ? " per rank" : "", fpt_note,
            k->peak / 1e9, bf16_mm ? "bf16" : "fp32", peak.threads, bf16_mm ? peak.bf16_isa : peak.isa, peak.source,
            peak.note[0] ? ": " : "", peak.note);
    if (m->n_frozen && t->world->rank == 0) {
        /* PEFT's print_trainable_parameters, counted as the dry run counts: on
         * the whole model's table, whatever part of it this rank holds */
        ct_err ignore = {0}; /* the run applied the same settings already */
        if (!lora_apply_frozen(&whole, c->freeze, c->lora_modules_to_save, trainer_frozen_origin(c), &ignore))
            trainer_print_trained(stderr, "ctitan: ", lm_trained_runs(&whole, 0, whole.n_params, NULL, NULL),
                                  whole.n_params, trainer_saved_params(&whole), c->lora_rank > 0);
    }
    lm_free(&whole);
    if (t->world->rank == 0) plan_describe(&t->plan, stderr);
}

/* Step `step` done: on torchtitan's rule (step 1 and every log_freq), the
 * console line, a metrics.jsonl line and the TensorBoard scalars. Collective
 * (the memory figure is the largest rank's). */
static void log_step(trainer *t, run_files *f, run_clock *k, int step, double loss, double gnorm, double lr,
                     double aux, long n_valid) {
    const ct_config *c = &t->cfg;
    const lm_model *m = &t->model;
    /* this rank's tokens: under context parallel its chunk of each sequence (torchtitan's tps
     * divides by the degree likewise) */
    k->tokens_since_log += (long)c->local_batch_size * plan_seq_len(&t->plan) * t->grad_accum;
    k->steps_since_log++;
    if (!(step == 1 || step % c->log_freq == 0)) return;
    double now = ct_now();
    double tps = k->tokens_since_log / (now - k->t_log);
    double tflops = k->fpt * tps / 1e12;
    double mfu = 100.0 * k->fpt * tps / k->peak;
    double mem = cpu_peak_rss_bytes() / (1024.0 * 1024.0 * 1024.0);
    double step_time = (now - k->t_log) / k->steps_since_log;
    double tokens_seen = (double)step * t->global_batch * c->seq_len; /* all ranks, as the global batch */
    /* distributed: memory is the largest rank's peak, comm the share of the
     * wall time rank 0 spent in collectives since the last line */
    double comm_pct = 100.0 * plan_take_comm_time(&t->plan) / (now - k->t_log);
    comm_allreduce(t->world, &mem, 1, COMM_F64, COMM_MAX);
    if (m->moe.n_layers && t->plan.mesh.dp_size > 1) {
        /* the expert loads over every data-parallel rank's last micro-batch (the
         * fewest and the most tokens an expert got in any of them), not rank 0's
         * alone; aux_loss is their mean already (plan_sum_loss). Logged steps only. */
        int L = m->cfg.n_layers, *lo = t->model.moe.load_min, *hi = t->model.moe.load_max;
        for (int l = 0; l < L; l++) lo[l] = -lo[l]; /* a min as the max of the negations */
        comm_allreduce(&t->plan.mesh.dp, lo, (size_t)L, COMM_I32, COMM_MAX);
        comm_allreduce(&t->plan.mesh.dp, hi, (size_t)L, COMM_I32, COMM_MAX);
        for (int l = 0; l < L; l++) lo[l] = -lo[l];
    }
    long overlapped = plan_take_overlapped(&t->plan);
    printf("step: %d  loss: %.4f  grad_norm: %.4f  memory: %.2f GiB  tps: %.0f  tflops: %.3f  mfu: %.2f%%", step,
           loss, gnorm, mem, tps, tflops, mfu);
    if (t->world->size > 1) printf("  comm: %.1f%%", comm_pct);
    /* the share of the step the stages spent waiting for an input (their mean) */
    double bubble = plan_take_bubble(&t->plan); /* -1: no pipeline */
    if (bubble >= 0) printf("  bubble: %.1f%%", 100.0 * bubble);
    if (m->moe.n_layers) print_moe_load(stdout, m, aux, 0);
    double per_step = step > k->first_step ? (now - k->t_first_end) / (step - k->first_step)
                                           : k->t_first_end - k->t_start;
    double eta = (c->steps - step) * per_step;
    char eta_s[24];
    prog_fmt_eta(eta_s, sizeof eta_s, eta);
    printf("  eta: %s\n", eta_s);
    fflush(stdout);
    if (f->metrics) {
        fprintf(f->metrics,
                "{\"step\": %d, \"loss\": %.9g, \"grad_norm\": %.9g, \"lr\": %.9g, \"memory_gib\": %.4f, "
                "\"tps\": %.2f, \"tflops\": %.6f, \"mfu\": %.4f, \"elapsed_s\": %.3f, \"valid_targets\": %ld, "
                "\"world\": %d, \"comm_pct\": %.3f, \"reductions_overlapped\": %ld, \"step_time_s\": %.6f, "
                "\"tokens_seen\": %.0f, \"time\": %.3f",
                step, loss, gnorm, lr, mem, tps, tflops, mfu, now - k->t_start, n_valid, t->world->size, comm_pct,
                overlapped, step_time, tokens_seen, ev_wall_time());
        if (bubble >= 0) fprintf(f->metrics, ", \"pp_bubble\": %.4f", bubble);
        if (m->moe.n_layers) print_moe_load(f->metrics, m, aux, 1);
        fprintf(f->metrics, ", \"eta_s\": %.3f}\n", eta);
        fflush(f->metrics);
    }
    if (f->tb) { /* tags are the metrics.jsonl keys (docs/formats.md, "TensorBoard") */
        /* each with its format in the line above; the per-layer expert loads stay in the file */
        const char *tags[] = {"loss", "grad_norm", "lr", "memory_gib", "tps", "tflops", "mfu",
                              "step_time_s", "tokens_seen", "comm_pct", "pp_bubble", "aux_loss"};
        const char *fmts[] = {"%.9g", "%.9g", "%.9g", "%.4f", "%.2f", "%.6f", "%.4f", "%.6f", "%.0f", "%.3f", "%.4f",
                              "%.9g"};
        double vals[] = {loss, gnorm, lr, mem, tps, tflops, mfu, step_time, tokens_seen, comm_pct, bubble, aux};
        int has[] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, bubble >= 0, m->moe.n_layers > 0};
        for (size_t i = 0; i < sizeof vals / sizeof *vals; i++)
            if (has[i]) tb_scalar(f->tb, step, tags[i], as_logged(fmts[i], vals[i]));
        tb_flush_or_drop(&f->tb);
    }
    k->t_log = now;
    k->tokens_since_log = 0;
    k->steps_since_log = 0;
}

/* After the last step, with checkpoint.last_save_in_hf: a LoRA run's PEFT
 * adapter, or the model as a Hugging Face directory, as step-N. */
static int save_final_hf(trainer *t, ct_err *e) {
    const ct_config *c = &t->cfg;
    int rank0 = t->world->rank == 0;
    char dir[4096], sub[64], path[4096];
    snprintf(sub, sizeof sub, "step-%d", t->step);
    double t0 = ct_now();
    int rc;
    if (c->lora_rank > 0) { /* a LoRA run's final output: its PEFT adapter */
        if (trainer_join_path(dir, sizeof dir, t->ckpt_folder, sub))
            return ct_fail(e, CT_ERR_CONFIG, "checkpoint.folder: path too long");
        rc = trainer_save_adapter(t, dir, e);
        if (!rc && rank0) fprintf(stderr, "ctitan: saved PEFT adapter to %s\n", dir);
        if (!rc) trainer_checkpoint_event(t, "adapter", dir, -1, ct_now() - t0);
        return rc;
    }
    if (trainer_join_path(path, sizeof path, c->dump_folder, c->ckpt_folder) ||
        trainer_join_path(dir, sizeof dir, path, sub))
        return ct_fail(e, CT_ERR_CONFIG, "checkpoint.folder: path too long");
    int dtype = hf_dtype_from_name(c->export_dtype);
    rc = trainer_save_hf(t, path, dir, dtype < 0 ? CT_F32 : (ct_dtype)dtype, dtype < 0 ? "float32" : c->export_dtype,
                         e);
    if (!rc && rank0)
        fprintf(stderr, "ctitan: saved Hugging Face model (%s) to %s in %.2f s\n", c->export_dtype, dir,
                ct_now() - t0);
    if (!rc) trainer_checkpoint_event(t, "hf", dir, -1, ct_now() - t0);
    return rc;
}

/* The stop's message (a stop asked by `why`, after `step`, its checkpoint
 * saved); CT_STOPPED. */
static int stopped(int step, const char *why, int ckpt_enable) {
    fprintf(stderr, "ctitan: stopped after step %d (%s); resume with the same command%s\n", step, why,
            ckpt_enable ? "" : " and --checkpoint.enable=true");
    return CT_STOPPED;
}

int trainer_run(trainer *t, ct_err *e) {
    ct_config *c = &t->cfg;
    int B = c->local_batch_size, T = c->seq_len;
    /* opened by trainer_init_dist before the kernels were timed and the weights loaded */
    ds *data = t->data, *val = t->val;
    tok *tk = t->tk;
    run_files files = {0};
    int32_t *tokens = NULL, *labels = NULL;
    if (t->complete) return 0; /* the same on every rank: agree_on_pick compared the picks */
    if (!data) /* trainer_init (the session API) opens none: it feeds its own batches */
        return ct_fail(e, CT_ERR_CONFIG, "trainer_run: a run started by trainer_init_dist has its data; this one none");
    t->data = t->val = NULL; /* closed at out: below */
    t->tk = NULL;
    /* no early return before trainer_agree: the other ranks wait there */
    int rc = t->seed_step > 0
                 ? ct_fail(e, CT_ERR_CONFIG,
                           "checkpoint.load_step = %d: %s/step-%d is a model-only save (no optimizer state): it can "
                           "seed a new run, not resume this one, and a run started from it here would overwrite this "
                           "folder's checkpoints (export it with `ctitan export` and start a new checkpoint.folder "
                           "from it with checkpoint.initial_load_path)",
                           c->load_step, t->ckpt_folder, t->seed_step)
                 : 0;
    if (!rc && t->have_resume_data) rc = ds_set_state(data, &t->resume_data, e);
    if ((rc = trainer_agree(t, rc, "open its data", e))) goto out; /* a data position one rank alone fails to set */
    if ((rc = ct_mkdirs(c->dump_folder, e)) || (rc = open_run_files(t, &files, e))) goto out;
    prof *pf = files.pf;
    run_clock clock = {0};
    print_run_banner(t, &clock);

    trainer_install_signals();
    size_t mb = (size_t)B * T;
    tokens = ct_malloc(mb * t->grad_accum * sizeof(int32_t));
    labels = ct_malloc(mb * t->grad_accum * sizeof(int32_t));
    clock.t_start = clock.t_log = clock.t_first_end = ct_now();
    clock.first_step = t->step + 1;
    /* the stop that wrote the checkpoint skipped this step's validation: done now,
     * so that the curve has the point an uninterrupted run has */
    if (t->val_pending && val && t->step > 0) validate(t, val, t->step, files.metrics, &files.tb);
    t->val_pending = 0;
    while (t->step < c->steps) {
        int step = t->step + 1;
        int traced = pf && step % c->profile_freq == 0;
        if (traced) { /* lent for this step only: the hooks of other steps see NULL */
            plan_profile(&t->plan, pf);
            prof_step_begin(pf, step);
        }
        prof *sp = traced ? pf : NULL;
        int64_t t_step = PROF_T0(sp), t_data = t_step;
        long n_valid = 0;
        for (int a = 0; a < t->grad_accum; a++) {
            ds_next(data, tokens + a * mb, labels + a * mb, B);
            for (size_t i = 0; i < mb; i++) n_valid += labels[a * mb + i] != -100;
        }
        /* the scale is 1 / valid targets of the whole step on every rank, so the
         * sum over ranks is the gradient of the one-process run's mean loss */
        int64_t nv = n_valid;
        plan_sum_dp(&t->plan, &nv, 1, COMM_I64);
        n_valid = (long)nv;
        float scale = n_valid ? 1.0f / (float)n_valid : 0.0f;
        if (sp) prof_span(sp, "phase", "data", t_data);
        double aux_sum = 0, aux; /* MoE: HF's load-balancing loss, summed over micro-batches; their mean */
        double loss_sum, gnorm, lr;
        PROF_SPAN(sp, "phase", "forward_backward",
                  loss_sum = plan_forward_backward(&t->plan, tokens, labels, B, T, scale,
                                                   trainer_lora_seed(t, step), &aux_sum));
        PROF_SPAN(sp, "phase", "reduce", plan_reduce_grads(&t->plan);
                  plan_sum_loss(&t->plan, &loss_sum, &aux_sum, &aux));
        double loss = n_valid ? loss_sum / n_valid : 0.0;
        PROF_SPAN(sp, "phase", "optimizer", trainer_optimizer_step(t, &gnorm, &lr));
        if (step == clock.first_step) clock.t_first_end = ct_now();
        if (traced) {
            prof_span(pf, "step", "step", t_step);
            plan_profile(&t->plan, NULL);
            if ((rc = prof_step_end(pf, e))) goto out;
        }
        if (c->enable_memory_snapshot && step % c->profile_freq == 0 &&
            (rc = trainer_memory_snapshot(t, step, stderr, e)))
            goto out;
        log_step(t, &files, &clock, step, loss, gnorm, lr, aux, n_valid);
        int last = step == c->steps;
        /* a stop on the last step is just the end of the run */
        /* every rank must stop after the same step (a signal may reach them apart),
         * and a loss that is not finite ends every rank together: each met it alone,
         * and each aborted the others at once (MPI_Abort on every rank, which crashed
         * mpirun in a CI run: agree_on_pick) */
        int32_t flags[2] = {stop_requested, !isfinite(loss)};
        comm_allreduce(t->world, flags, 2, COMM_I32, COMM_MAX);
        if (flags[1]) {
            rc = isfinite(loss) ? ct_fail(e, CT_ERR_IO, "training diverged: another rank's loss is not finite at "
                                          "step %d", step)
                                : ct_fail(e, CT_ERR_IO, "training diverged: loss is %g at step %d", loss, step);
            e->all_ranks = 1; /* every rank knows it from the all-reduce */
            goto out;
        }
        int32_t sig = flags[0];
        int stop = !last && (sig || (c->stop_at_step > 0 && step == c->stop_at_step));
        if (stop) {
            /* preemption: save first (validation could outlast the grace period), and
             * always a full checkpoint, whatever checkpoint.enable says; a validation
             * due at this step is left to the resumed run (val_pending) */
            t->val_pending = val && step % c->val_freq == 0;
            if ((rc = trainer_save(t, data, 0, e))) goto out;
            rc = stopped(step, sig ? "signal" : "training.stop_at_step", c->ckpt_enable);
            goto out;
        }
        int validated = val && (step % c->val_freq == 0 || last), saved_full = 0;
        if (validated) validate(t, val, step, files.metrics, &files.tb);
        if (c->ckpt_enable) {
            /* as torchtitan: with last_save_in_hf the final save is the HF directory below */
            int due = (last && !c->last_save_in_hf) || (!last && step % c->ckpt_interval == 0) ||
                      (step == 1 && c->first_step_ckpt);
            int model_only = last && c->last_save_model_only;
            /* checkpoint.async_mode: a save between steps is written in the background; the last one is not
             * (the run ends at it: nothing to overlap) */
            if (due && (rc = last ? trainer_save(t, data, model_only, e) : trainer_save_async(t, data, e))) goto out;
            saved_full = due && !model_only;
        }
        /* A signal that came during this step's validation or save (seconds, where
         * the step took milliseconds) asks for the same stop after this step: the
         * step is done, so stop now, with the checkpoint just written when there
         * is one, rather than run one more step and save again. Asked only after
         * these (every rank knows when they ran): no collective in other steps. */
        if (!last && (validated || saved_full)) {
            sig = stop_requested;
            comm_allreduce(t->world, &sig, 1, COMM_I32, COMM_MAX);
            if (sig) {
                if (!saved_full && (rc = trainer_save(t, data, 0, e))) goto out;
                if ((rc = trainer_save_wait(t, 1, e))) goto out; /* the stop's checkpoint, written in full */
                rc = stopped(step, "signal", c->ckpt_enable);
                goto out;
            }
        }
    }
    if ((rc = trainer_save_wait(t, 1, e))) goto out; /* a save still in the background ends with the run */
    trainer_stage_free(t); /* before the HF save: its peak is the synchronous run's */
    if (pf) prof_summary(pf, stderr); /* on the ranks CTITAN_LOG_RANKS shows */
    if (t->world->size > 1) /* on the ranks CTITAN_LOG_RANKS shows: what each one needed */
        fprintf(stderr, "ctitan: rank %d of %d: peak memory %.3f GiB\n", t->world->rank, t->world->size,
                cpu_peak_rss_bytes() / (1024.0 * 1024.0 * 1024.0));
    if (c->last_save_in_hf) rc = save_final_hf(t, e);
out:
    if (t->async_save.pending) { /* an error on the way: this rank alone waits (no collective), so that no
                                  * thread writes past the run; a save it completes is as good as any */
        ct_err we = {0};
        int wrc = trainer_save_wait(t, 0, &we);
        if (wrc && !rc) rc = wrc, *e = we;
        else if (wrc) fprintf(stderr, "ctitan: error: the checkpoint in the background failed too: %s\n", we.msg);
    }
    trainer_stage_free(t);
    write_exit_event(t, rc, e);
    if (ev_close(t->events)) fprintf(stderr, "ctitan: warning: %s/events.jsonl: write failed\n", c->dump_folder);
    t->events = NULL;
    free(tokens);
    free(labels);
    close_run_files(t, &files);
    ds_close(val);
    ds_close(data);
    tok_free(tk);
    return rc;
}
