/* config/config.h: the run's configuration, from TOML plus CLI overrides.
 *
 * ONE table in config.c lists every option (section, key, type, default, range,
 * help, and where it lives in ct_config). The TOML reader, the override
 * parser, validation, `--help` and the resolved-config dump all walk that
 * table, so adding an option is one line there plus one field here. Section
 * and key names are torchtitan's. */
#ifndef CT_CONFIG_CONFIG_H
#define CT_CONFIG_CONFIG_H

#include <stdint.h>
#include <stdio.h>

#include "core/err.h"
#include "kernels/ops_list.h" /* KERN_N_OPS */

/* Room for the option table (config.c checks that it fits). */
#define CFG_MAX_OPTIONS 320

typedef struct {
    /* [job] */
    char *dump_folder;        /* "./outputs" */
    char *description;        /* "" */
    /* [model] */
    char *model_spec;         /* "qwen3" | "hf" */
    char *model_flavor;       /* "debugmodel" */
    char *hf_assets_path;     /* "" : directory with config.json (spec "hf"), or a Hub id (hub/hub.h) */
    char *hf_revision;        /* "main": revision of the Hub ids (hf_assets_path, initial_load_path) */
    double load_balance_coeff; /* 0: off; MoE expert-bias step (torchtitan's aux-loss-free balancing) */
    /* [optimizer] */
    char *opt_name;           /* "AdamW" or "Adam" (optim/optim.h) */
    double lr;                /* 8e-4 */
    double eps;               /* 1e-8 */
    double weight_decay;      /* 0.1 */
    double beta1;             /* 0.9 */
    double beta2;             /* 0.95 */
    /* [lr_scheduler] */
    int warmup_steps;         /* 200 */
    double decay_ratio;       /* -1 = unset: decay over every step after warmup */
    char *decay_type;         /* "linear" | "sqrt" | "cosine" */
    double min_lr_factor;     /* 0.0 */
    /* [training] */
    int local_batch_size;     /* 8 */
    int global_batch_size;    /* -1 = local_batch_size (x data-parallel degree later) */
    int seq_len;              /* 2048 */
    double max_norm;          /* 1.0 ; 0 disables clipping */
    int steps;                /* 10000 */
    char *dataset;            /* "auto" | "text" | "jsonl" | "chat" | "tokens" */
    char *dataset_path;       /* "" */
    int64_t seed;             /* 0 */
    int shuffle;              /* false */
    char *text_split;         /* "line" | "paragraph" | "file" */
    char *text_field;         /* JSON Lines: the field holding the text ("text") */
    char *chat_template;      /* "auto" | "chatml" | "tokenizer" | a path (data/chat.h) */
    int assistant_only_loss;  /* true: conversations train on the assistant replies (TRL's default: false) */
    int completion_only_loss; /* true: prompt-completion data trains on the completion (TRL's default) */
    int stop_at_step;         /* 0 = never */
    int deterministic;        /* false */
    int threads;              /* 0 = OMP_NUM_THREADS or all cores */
    int logits_chunk_rows;    /* 0 = auto (lm_logit_rows): rows of logits held at once by the fused lm_head + loss */
    char *mixed_precision_param; /* "float32" | "bfloat16": dtype of the matmul inputs (fp32 sums, fp32 master weights) */
    char *freeze;             /* "": list (comma-joined) of HF tensor-name patterns with * not to train */
    char *frozen_dtype;       /* "float32" | "bfloat16" (not implemented yet) */
    /* [lora] (model/lora.h) */
    int lora_rank;            /* 0: off */
    double lora_alpha;        /* 8 */
    double lora_dropout;      /* 0 */
    char *lora_targets;       /* list: "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj" */
    int lora_rslora;          /* false */
    char *lora_modules_to_save; /* list: "" */
    char *lora_target_params; /* list: "" (PEFT's target_parameters) */
    char *lora_rank_pattern;  /* "": none; PEFT's rank_pattern as JSON text {"regex": rank} */
    char *lora_alpha_pattern; /* "": none; PEFT's alpha_pattern as JSON text {"regex": alpha} */
    char *lora_adapter_path;  /* "": fresh initialisation; a directory or a Hub id */
    char *lora_adapter_revision; /* "main": revision of a Hub id in lora_adapter_path */
    /* [checkpoint] */
    int ckpt_enable;          /* false */
    char *ckpt_folder;        /* "checkpoint" (relative to dump_folder) */
    int ckpt_interval;        /* 500 */
    int keep_latest_k;        /* 10 */
    int load_step;            /* -1 = newest */
    int ckpt_fallback;        /* true: a damaged newest checkpoint falls back to an older one */
    int last_save_model_only; /* true */
    int first_step_ckpt;      /* false: enable_first_step_checkpoint */
    char *initial_load_path;  /* "" */
    int initial_load_in_hf;   /* false */
    int last_save_in_hf;      /* false */
    char *export_dtype;       /* "float32" | "bfloat16" | "float16" */
    char *ckpt_async_mode;    /* checkpoint.async_mode: "disabled" | "async" | "async_with_pinned_mem" */
    /* [metrics] */
    int log_freq;             /* 10 */
    char *metrics_file;       /* "metrics.jsonl" (relative to dump_folder); "" disables */
    double peak_tflops;       /* 0 = measure once and cache */
    int enable_tensorboard;   /* false */
    char *save_tb_folder;     /* "tb" (relative to dump_folder) */
    /* [profiling] (metrics/profile.h) */
    int enable_profiling;              /* false */
    char *save_traces_folder;          /* "profile_trace" (relative to dump_folder) */
    int profile_freq;                  /* 10: steps that are multiples are traced */
    int enable_memory_snapshot;        /* false */
    char *save_memory_snapshot_folder; /* "memory_snapshot" (relative to dump_folder) */

    /* [validation] */
    int val_enable;           /* false */
    int val_freq;             /* 100 */
    int val_steps;            /* 10; -1 = one pass */
    int val_local_batch_size; /* 0 = training.local_batch_size */
    int val_seq_len;          /* -1 = training.seq_len (cfg_val_seq_len) */
    char *val_dataset;        /* "auto" (as training.dataset) */
    char *val_dataset_path;   /* "" */

    /* [activation_checkpoint] */
    char *ac_mode;            /* "none" | "selective" | "full" */
    char *ac_selective_option; /* "2": every 2nd layer fully recomputed; "op": norms/RoPE/SwiGLU rerun */

    /* [parallelism]: degrees of the device mesh (dp_replicate, dp_shard, tp) over the MPI world */
    int dp_replicate;         /* 1: data_parallel_replicate_degree */
    int dp_shard;             /* -1: data_parallel_shard_degree; -1 = what the other degrees leave */
    int tp;                   /* 1: tensor_parallel_degree */
    int sequence_parallel;    /* 1: parallelism.sequence_parallel (distributed/tp.h) */
    int ep;                   /* 1: expert_parallel_degree */
    char *fsdp_reshard;       /* "default" | "always" | "never": fsdp_reshard_after_forward */
    int cp;                   /* 1: context_parallel_degree (distributed/cp.h) */
    char *cp_balancer;        /* "headtail" | "none": context_parallel_load_balancer (distributed/cp.h) */
    char *cp_rotate;          /* "allgather" | "alltoall": context_parallel_rotate_method (distributed/cp.h) */
    int pp;                   /* 1: pipeline_parallel_degree */
    char *pp_schedule;        /* "1F1B" | "GPipe" | "Interleaved1F1B" */
    int pp_microbatch;        /* 1: pipeline_parallel_microbatch_size */
    char *pp_split;           /* "": pipeline_parallel_split_points, comma-joined ("layers.4,layers.8") */
    char *pp_fqns;            /* "": module_fqns_per_model_part, each stage's modules ("tok_embeddings,layers.0;layers.1") */
    char *pp_csv;             /* "": pipeline_parallel_schedule_csv, every rank's actions (distributed/pp.h) */
    int pp_layers_per_stage;  /* -1: pipeline_parallel_layers_per_stage (torchtitan's even split; else by cost) */
    int pp_first_less;        /* -1 (1 when used): pipeline_parallel_first_stage_less_layers */
    int pp_last_less;         /* -1 (1 when used): pipeline_parallel_last_stage_less_layers */

    /* [kernels]: implementation per op ("auto" = fastest this CPU runs); kernels[KERN_OP_x] is the key
     * of op x, one per op of kernels/ops_list.h */
    char *kernels[KERN_N_OPS];
    int kernels_tune;         /* [kernels] tune: "auto" ops chosen by timing them on the run's sizes (kernels/tune.c) */

    /* torchtitan keys ctitan reads but has no use for: each is taken only at the value that
     * changes nothing for ctitan (cfg_validate refuses the others, saying what ctitan does
     * instead), or at any value where none changes the run's results (--help says which) */
    struct {
        char *model_name;           /* model.name: "qwen3" (any with model.spec = "hf") */
        char *converters;           /* model.converters: list, only empty */
        char *opt_impl;             /* optimizer.implementation: any (one implementation of each optimizer) */
        int compile;                /* training.compile: false */
        char *mp_reduce;            /* training.mixed_precision_reduce: "float32" */
        int gc_freq;                /* training.gc_freq: any */
        int compile_enable;         /* compile.enable: false */
        char *compile_components;   /* compile.components: any list */
        int f8_all_gather[2];       /* [float8] / [quantize.linear.float8] enable_fsdp_float8_all_gather: false */
        int f8_precompute[2];       /* ... precompute_float8_dynamic_scale_for_fsdp: false */
        int f8_emulate[2];          /* ... emulate: false */
        char *f8_filter[2];         /* ... filter_fqns: any list */
        char *f8_grouped_fqns;      /* quantize.grouped_mm.float8.fqns: only empty */
        int comm_init_timeout;      /* comm.init_timeout_seconds: any */
        int comm_train_timeout;     /* comm.train_timeout_seconds: any */
        int initial_model_only;     /* checkpoint.initial_load_model_only: true */
        int async_tp;               /* parallelism.enable_async_tensor_parallel: false */
        int etp;                    /* parallelism.expert_tensor_parallel_degree: 1 (or tensor_parallel_degree) */
        int print_args;             /* job.print_args: any */
        int integration_test;       /* job.use_for_integration_test: any */
        int no_color;               /* metrics.disable_color_printing: any */
        int wandb;                  /* metrics.enable_wandb: false */
        /* torchtitan 0.3's keys (its dataclass config, docs/config.md) */
        char *prof_sched[4];        /* profiler.profiler_repeat, _skip_first, _skip_first_wait, memory_snapshot_freq:
                                       "None" */
        int prof_active;            /* profiler.profiler_active: 1 */
        int prof_warmup;            /* profiler.profiler_warmup: any */
        int prof_max_entries;       /* profiler.memory_snapshot_max_entries: any */
        int all_ranks_metrics;      /* metrics.save_for_all_ranks: false */
        char *param_groups;         /* optimizer.param_groups: only empty */
        char *factory_kwargs;       /* optimizer.optimizer_factory_kwargs_by_name: "{}" */
        char *total_steps;          /* lr_scheduler.total_steps: "None" */
        int cpu_offload;            /* training.enable_cpu_offload: any */
        int no_cuda_graphs;         /* training.disable_cuda_graphs: any */
        char *dtype;                /* training.dtype: "float32" */
        int gc_debug;               /* training.gc_debug: any */
        int symm_mem;               /* parallelism.enable_fsdp_symm_mem: any */
        char *spmd_backend;         /* parallelism.spmd_backend: any */
        char *ptrr_key;             /* parallelism.context_parallel_ptrr_mask_key: any */
        int quantized_load;         /* checkpoint.initial_load_in_hf_quantized: false */
        char *exclude_loading;      /* checkpoint.exclude_from_loading: only empty */
        int seed_ckpt;              /* checkpoint.create_seed_checkpoint: false */
        int load_only;              /* checkpoint.load_only: false */
        int ac_rng;                 /* activation_checkpoint.preserve_rng_state: true */
        char *ac_det_check;         /* activation_checkpoint.determinism_check: any */
        int ac_debug;               /* activation_checkpoint.debug: any */
        char *ac_mm_fqns;           /* activation_checkpoint.force_recompute_mm_shapes_by_fqns: any list */
        double ac_budget;           /* activation_checkpoint.memory_budget: any */
        int ac_pareto;              /* activation_checkpoint.visualize_memory_budget_pareto: any */
        char *compile_backend;      /* compile.backend: any */
        int comm_trace_buf;         /* comm.trace_buf_size: any */
        char *comm_traces[2];       /* comm.save_traces_folder, save_traces_file_prefix: any */
        char *comm_mode;            /* comm.mode: "default" */
        int spmd_check;             /* debug.spmd_typechecking: any */
        int det_warn_only;          /* debug.deterministic_warn_only: any */
        int moe_force_balance;      /* debug.moe_force_load_balance: false */
        int detect_anomaly;         /* debug.detect_anomaly: any */
        int batch_invariant;        /* debug.batch_invariant: false */
        char *save_config;          /* debug.save_config_file: any */
        int structured_log;         /* debug.enable_structured_logging: any */
        char *override_imports;     /* override.imports: only empty */
        int dl_workers, dl_persistent, dl_pin; /* dataloader.num_workers, persistent_workers, pin_memory: any */
        char *dl_prefetch;          /* dataloader.prefetch_factor: any */
        int dl_infinite;            /* dataloader.infinite: true */
        int loss_chunks;            /* loss.num_chunks: any */
        char *loss_vocab;           /* loss.loss_fn.global_vocab_size: "None" */
    } tt;
    /* training.dataset / validation.dataset given as one of torchtitan's dataset names (c4,
     * c4_test, c4_validation): stored as "auto" (the files at dataset_path say their kind),
     * the name kept here for the message when dataset_path is missing; "" otherwise */
    char dataset_tt[2][16];

    char *config_path;        /* the --config file, or "" */
    /* from_cli[i]: option i (the option table's order) was last set on the
     * command line, so a message about its value names the command line,
     * not the file (cfg_origin) */
    unsigned char from_cli[CFG_MAX_OPTIONS];

    /* Not options: the local directories hf_assets_path and initial_load_path name, their Hub ids
     * resolved in the Hugging Face cache (trainer_resolve_hub, hub/hub.h); NULL until then. The
     * options keep what the user wrote, so the run's config.toml records the id. */
    char *hf_assets_dir;
    char *initial_load_dir;
    char *lora_adapter_dir; /* lora.adapter_path's snapshot when it is a Hub id */
} ct_config;

/* Fills every field with its default. */
void cfg_defaults(ct_config *c);
void cfg_free(ct_config *c);

/* Parses `args` (argv after the subcommand) on top of `c`, which must hold
 * defaults (cfg_defaults) or an earlier parse: `--config FILE` first applies the
 * TOML file, then every `--section.key=value`, `--section.key value` or bare
 * `--section.key` (booleans: true) overrides it. Unknown section or key, wrong
 * type, out-of-range value: returns CT_ERR_CONFIG with a message naming the key
 * and the file (or "command line"). Any other argument is an error too. */
int cfg_parse_args(ct_config *c, int argc, char **argv, ct_err *e);
/* Warns on stderr of settings that do nothing (a [lora] key other than its
 * default while lora.rank = 0, a [validation] key other than its default while
 * validation.enable is false), naming where each was set. For the user's own
 * config (cmd_train), not for a checkpoint's config.toml read back. */
void cfg_warn_unused(const ct_config *c);
/* The config file's path for error messages, or "command line". */
const char *cfg_source(const ct_config *c);
/* Where option NAME ("section.key") got its value, for a message about
 * that value: "command line" when an override set it, else cfg_source. */
const char *cfg_origin(const ct_config *c, const char *name);
/* The same for a message about several options together ("a,b,c"): "command
 * line" when an override set any of them, else cfg_source. */
const char *cfg_origin_any(const ct_config *c, const char *names);
/* model.hf_assets_path and checkpoint.initial_load_path as local directories: the Hub
 * snapshot they resolved to (hf_assets_dir / initial_load_dir), else the option as written. */
const char *cfg_hf_dir(const ct_config *c);
/* Tokens per validation window: validation.seq_len, or training.seq_len where it is -1 or
 * validation.enable is false (nothing is evaluated: training's shapes alone size the model). */
int cfg_val_seq_len(const ct_config *c);
const char *cfg_initial_dir(const ct_config *c);
/* lora.adapter_path as a local directory, the same way. */
const char *cfg_adapter_dir(const ct_config *c);

/* Sets one option from text as if given on the command line, e.g.
 * cfg_set(c, "training.steps", "20", e). For the library API and tests. */
int cfg_set(ct_config *c, const char *name, const char *value, ct_err *e);

/* Cross-field checks (global batch a multiple of local, ...). Called by
 * cfg_parse_args too. */
int cfg_validate(const ct_config *c, ct_err *e);

/* Walks a list option ("a,b,c"): copies the next item into item[cap] and
 * returns where to continue, or NULL after the last one. */
const char *cfg_list_next(const char *list, char *item, size_t cap);
/* Walks a list of lists ("a,b;c"): copies the next group ("a,b") into
 * group[cap] and returns where to continue, or NULL after the last one. */
const char *cfg_group_next(const char *list, char *group, size_t cap);

/* Every option with its type, default and help, grouped by section. */
void cfg_print_help(FILE *out);

/* The resolved config as TOML (parseable back by cfg_parse_args). */
void cfg_write_toml(const ct_config *c, FILE *out);

/* For the ranks of one run to compare their recipes: options are numbered
 * 0 .. cfg_n_options() - 1; cfg_shared_text gives option i as
 * "section.key = value" (the value as config.toml writes it; the caller
 * frees it); for a path each machine holds its own of, "section.key = (set)"
 * or "(unset)"; NULL for an option that may differ from machine to machine
 * (threads, the peak, the description: config.c's cfg_option.own) or that is
 * only another name or an unused torchtitan key. */
int cfg_n_options(void);
char *cfg_shared_text(const ct_config *c, int i);

#endif
