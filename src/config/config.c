/* config/config.c: every option in one table, and the code that walks it.
 *
 * Defaults are written in the table as the text a user would type on the
 * command line and go through the same parser as CLI values, so the default,
 * its range check and its --help text can never disagree; a default that
 * fails its own range is a bug caught by cfg_defaults (and the tests).
 * TOML values are checked against their TOML type (an integer where a
 * string is expected is a mistake worth reporting), CLI values are parsed
 * from text strictly. Both then meet in one range/enum check, so the rules
 * live in exactly one place: the table. Errors name the file (and line) or
 * "command line", plus section.key, because that is what the user edits. */
#include "config/config.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "formats/toml.h"

typedef enum { CFG_STR, CFG_INT, CFG_I64, CFG_DBL, CFG_BOOL, CFG_ENUM } cfg_type;

/* Range flags. CFG_UNSET: -1 is also accepted and means "not set". */
enum { CFG_GE = 1, CFG_GT = 2, CFG_LE = 4, CFG_LT = 8, CFG_UNSET = 16 };

/* Options the ranks of one run may hold differently (cfg_option.own). CFG_OWN_PATH:
 * where each machine keeps its files (the model, data, run and trace folders:
 * each machine its own copy), but whether one is set must agree (an
 * initial_load_path on one machine alone loaded other weights there). CFG_OWN:
 * its threads, its peak and the run's description. Every other option changes
 * the maths or which collectives run when, so it must be alike on every rank:
 * [kernels] too (under tensor parallel some replicated tensors step from
 * gradients each rank computes itself, so other kernels' last bits would split
 * them), and the logits block (under tensor parallel each block of rows is a
 * collective). */
enum { CFG_SHARED, CFG_OWN_PATH, CFG_OWN };

typedef struct {
    const char *section, *key;
    cfg_type type;
    size_t off;
    const char *def; /* as typed on the command line */
    unsigned range;
    double lo, hi;
    const char *const *choices; /* CFG_ENUM, NULL-terminated */
    const char *help;
    int list; /* CFG_STR holding a list: a TOML array of strings, or "a,b,c" (or a TOML array
                 literal, ["a", "b"]) on the command line, kept comma-joined (cfg_list_next walks it);
                 2: a list of lists (["a", "b"], ["c"]]), or "a,b;c", kept as groups joined by ';' */
    const char *alias; /* "section.key": this is torchtitan's other name for that option (same field;
                          not dumped, not defaulted or freed twice) */
    int inert;         /* a torchtitan key ctitan reads and does not use (ct_config.tt): not dumped */
    const char *noop;  /* inert: the only value taken, as typed on the command line (cfg_validate);
                          NULL: any value */
    const char *instead; /* inert with noop: what ctitan does instead, for the refusal */
    int own;             /* CFG_OWN_PATH or CFG_OWN: may differ from machine to machine (cfg_shared_text) */
} cfg_option;

static const char *const cfg_specs[] = {"qwen3", "hf", NULL};
static const char *const cfg_optimizers[] = {"AdamW", "Adam", NULL};
static const char *const cfg_decay_types[] = {"linear", "sqrt", "cosine", NULL};
static const char *const cfg_export_dtypes[] = {"float32", "bfloat16", "float16", NULL};
static const char *const cfg_async_modes[] = {"disabled", "async", "async_with_pinned_mem", NULL};
static const char *const cfg_dataset_kinds[] = {"auto", "text", "jsonl", "chat", "tokens", NULL};
static const char *const cfg_pp_schedules[] = {"1F1B",          "GPipe",         "Interleaved1F1B", "LoopedBFS",
                                                "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", NULL};
static const char *const cfg_text_splits[] = {"line", "paragraph", "file", NULL};
static const char *const cfg_ac_modes[] = {"none", "selective", "full", NULL};
/* torchtitan's context_parallel_load_balancer: "headtail" or None (here "none"); its "ptrr"
 * balances FlexAttention's document masks, which ctitan does not have */
static const char *const cfg_cp_balancers[] = {"headtail", "none", NULL};
/* torchtitan's context_parallel_rotate_method (PyTorch's set_rotate_method): "allgather" gathers
 * every rank's k, v at once, "alltoall" passes them round the ring a chunk at a time */
static const char *const cfg_cp_rotates[] = {"allgather", "alltoall", NULL};
static const char *const cfg_reshard_modes[] = {"default", "always", "never", NULL};
static const char *const cfg_mp_dtypes[] = {"float32", "bfloat16", NULL};
static const char *const cfg_frozen_dtypes[] = {"float32", "bfloat16", NULL};
/* torchtitan 0.3's fused_opt_states_bf16 keeps AdamW's moments in bf16: a different
 * optimizer, refused by cfg_validate with its reason (the others are the same math) */
static const char *const cfg_opt_impls[] = {"for-loop", "foreach", "fused", "fused_opt_states_bf16", NULL};
/* torchtitan's dataset names: taken as "auto" when dataset_path says where the files are */
static const char *const cfg_tt_datasets[] = {"c4", "c4_test", "c4_validation", NULL};
/* torchtitan 0.3's Literal choices of keys ctitan takes at one value (or at any) */
static const char *const cfg_tt_spmd[] = {"partial_dtensor", "full_dtensor", "spmd_types", NULL};
static const char *const cfg_tt_comm_modes[] = {"default", "fake_backend", "local_tensor", "torchcomms", NULL};

#define TT_UNUSED(what) "torchtitan's key, read and not used: " what
#define TT03(what) "torchtitan 0.3's name of " what
#define F8_KEYS(sec, i)                                                                                         \
    OPT(sec, "enable_fsdp_float8_all_gather", CFG_BOOL, tt.f8_all_gather[i], "false", .inert = 1, .noop = "false", \
        .instead = "ctitan has no float8 training (model.converters is empty); it trains in fp32 or bf16 "        \
                   "(training.mixed_precision_param)",                                                          \
        .help = "torchtitan's float8 all-gather: ctitan has no float8 training, so only false is taken"),        \
    OPT(sec, "precompute_float8_dynamic_scale_for_fsdp", CFG_BOOL, tt.f8_precompute[i], "false", .inert = 1,     \
        .noop = "false",                                                                                        \
        .instead = "ctitan has no float8 training (model.converters is empty); it trains in fp32 or bf16 "        \
                   "(training.mixed_precision_param)",                                                          \
        .help = "torchtitan's float8 scale precompute: ctitan has no float8 training, so only false is taken"),  \
    OPT(sec, "emulate", CFG_BOOL, tt.f8_emulate[i], "false", .inert = 1, .noop = "false",                        \
        .instead = "ctitan has no float8 training (model.converters is empty)",                                 \
        .help = "torchtitan's float8 emulation: ctitan has no float8 training, so only false is taken"),         \
    OPT(sec, "filter_fqns", CFG_STR, tt.f8_filter[i], "", .list = 1, .inert = 1,                                 \
        .help = TT_UNUSED("the modules float8 skips (ctitan has no float8 training), any list"))

#define OPT(sec, k, ty, field, d, ...) \
    {.section = sec, .key = k, .type = ty, .off = offsetof(ct_config, field), .def = d, __VA_ARGS__}

static const cfg_option cfg_options[] = {
    OPT("job", "dump_folder", CFG_STR, dump_folder, "./outputs", .own = CFG_OWN_PATH,
        .help = "folder for checkpoints, metrics and logs"),
    OPT("job", "description", CFG_STR, description, "", .own = CFG_OWN, .help = "free text describing the run"),
    OPT("job", "print_args", CFG_BOOL, tt.print_args, "false", .inert = 1,
        .help = TT_UNUSED("any value (the resolved config is always written to job.dump_folder/config.toml)")),
    OPT("job", "use_for_integration_test", CFG_BOOL, tt.integration_test, "false", .inert = 1,
        .help = TT_UNUSED("torchtitan's test-suite marker, any value")),

    OPT("model", "spec", CFG_ENUM, model_spec, "qwen3", .choices = cfg_specs,
        .help = "qwen3: built-in flavor table; hf: read config.json from hf_assets_path"),
    OPT("model", "flavor", CFG_STR, model_flavor, "debugmodel",
        .help = "model size for spec qwen3 (debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B, debugmodel_moe, "
                "30B-A3B, 235B-A22B)"),
    OPT("model", "hf_assets_path", CFG_STR, hf_assets_path, "", .own = CFG_OWN_PATH,
        .help = "Hugging Face model directory (config.json, tokenizer, weights), or a Hub id such as "
                "Qwen/Qwen3-0.6B (cached under HF_HUB_CACHE, downloaded when missing)"),
    OPT("model", "hf_revision", CFG_STR, hf_revision, "main",
        .help = "branch, tag or commit of the Hub ids in hf_assets_path and checkpoint.initial_load_path"),
    OPT("model", "load_balance_coeff", CFG_DBL, load_balance_coeff, "0", .range = CFG_GE, .lo = 0,
        .help = "MoE: torchtitan's aux-loss-free balancing, a per-expert routing bias moved by this much "
                "per step towards even load (0: off, HF's routing; torchtitan uses 1e-3)"),
    OPT("model", "name", CFG_STR, tt.model_name, "qwen3", .inert = 1,
        .help = "torchtitan's model family: ctitan's built-in model (spec qwen3) is Qwen3, so only \"qwen3\" is "
                "taken; other families train from their config.json with model.spec = \"hf\" (where the name is "
                "not used)"),
    OPT("model", "tokenizer_path", CFG_STR, hf_assets_path, "", .alias = "model.hf_assets_path",
        .help = "torchtitan's older name of model.hf_assets_path (the tokenizer is read from there)"),
    OPT("model", "converters", CFG_STR, tt.converters, "", .list = 1, .inert = 1, .noop = "",
        .instead = "ctitan has no model converters (float8, mx): it trains in fp32 or bf16 "
                   "(training.mixed_precision_param)",
        .help = "torchtitan's model converters (float8, mx): ctitan has none, so only [] is taken"),

    OPT("optimizer", "name", CFG_ENUM, opt_name, "AdamW", .choices = cfg_optimizers,
        .help = "torchtitan's optimizers: AdamW (torch.optim.AdamW: decoupled weight decay) or Adam "
                "(torch.optim.Adam: weight_decay added to the gradient after clipping)"),
    OPT("optimizer", "lr", CFG_DBL, lr, "8e-4", .range = CFG_GE, .lo = 0,
        .help = "peak learning rate"),
    OPT("optimizer", "eps", CFG_DBL, eps, "1e-8", .range = CFG_GT, .lo = 0,
        .help = "AdamW epsilon"),
    OPT("optimizer", "weight_decay", CFG_DBL, weight_decay, "0.1", .range = CFG_GE, .lo = 0,
        .help = "weight decay: decoupled (AdamW), or added to the gradient (Adam)"),
    OPT("optimizer", "beta1", CFG_DBL, beta1, "0.9", .range = CFG_GE | CFG_LT, .lo = 0, .hi = 1,
        .help = "AdamW first-moment decay"),
    OPT("optimizer", "beta2", CFG_DBL, beta2, "0.95", .range = CFG_GE | CFG_LT, .lo = 0, .hi = 1,
        .help = "AdamW second-moment decay"),
    OPT("optimizer", "implementation", CFG_ENUM, tt.opt_impl, "fused", .choices = cfg_opt_impls, .inert = 1,
        .help = TT_UNUSED("torch's optimizer kernels (same math); ctitan has one implementation of each "
                          "optimizer, any value")),
    OPT("optimizer", "param_groups", CFG_STR, tt.param_groups, "", .list = 1, .inert = 1, .noop = "",
        .instead = "ctitan has one optimizer for every trained tensor, set by optimizer.name, lr, eps, weight_decay, "
                   "beta1 and beta2 (training.freeze leaves tensors out)",
        .help = "torchtitan 0.3's per-parameter-group optimizers: ctitan has one for all tensors (the [optimizer] "
                "keys), so only [] is taken"),
    OPT("optimizer", "optimizer_factory_kwargs_by_name", CFG_STR, tt.factory_kwargs, "{}", .inert = 1, .noop = "{}",
        .instead = "ctitan builds its one optimizer from the [optimizer] keys",
        .help = "torchtitan 0.3's extra arguments per optimizer factory: ctitan has none, so only {} is taken"),

    OPT("lr_scheduler", "warmup_steps", CFG_INT, warmup_steps, "200", .range = CFG_GE, .lo = 0,
        .help = "linear warmup steps"),
    OPT("lr_scheduler", "decay_ratio", CFG_DBL, decay_ratio, "-1",
        .range = CFG_GE | CFG_LE | CFG_UNSET, .lo = 0, .hi = 1,
        .help = "fraction of steps spent decaying, at the end; -1: all steps after warmup"),
    OPT("lr_scheduler", "decay_type", CFG_ENUM, decay_type, "linear", .choices = cfg_decay_types,
        .help = "shape of the decay"),
    OPT("lr_scheduler", "min_lr_factor", CFG_DBL, min_lr_factor, "0.0",
        .range = CFG_GE | CFG_LE, .lo = 0, .hi = 1, .help = "final lr as a fraction of lr"),
    OPT("lr_scheduler", "total_steps", CFG_STR, tt.total_steps, "None", .inert = 1, .noop = "None",
        .instead = "ctitan's schedule spans training.steps; set that",
        .help = "torchtitan 0.3's schedule length (None: training.steps): ctitan's spans training.steps, so only "
                "None is taken"),

    OPT("training", "local_batch_size", CFG_INT, local_batch_size, "8", .range = CFG_GE, .lo = 1,
        .help = "sequences per micro-batch per rank"),
    OPT("training", "global_batch_size", CFG_INT, global_batch_size, "-1",
        .range = CFG_GE | CFG_UNSET, .lo = 1,
        .help = "sequences per optimizer step, a multiple of local_batch_size (gradient "
                "accumulation); -1: local_batch_size"),
    OPT("training", "seq_len", CFG_INT, seq_len, "2048", .range = CFG_GE, .lo = 1,
        .help = "tokens per sequence"),
    OPT("training", "max_norm", CFG_DBL, max_norm, "1.0", .range = CFG_GE, .lo = 0,
        .help = "gradient clipping norm; 0 disables clipping"),
    OPT("training", "steps", CFG_INT, steps, "10000", .range = CFG_GE, .lo = 1,
        .help = "optimizer steps to train"),
    OPT("training", "dataset", CFG_ENUM, dataset, "auto", .choices = cfg_dataset_kinds,
        .help = "kind of training.dataset_path; auto: from the extension / first line"),
    OPT("training", "dataset_path", CFG_STR, dataset_path, "", .own = CFG_OWN_PATH,
        .help = "path to the dataset (e.g. a pre-tokenized .bin file)"),
    OPT("training", "seed", CFG_I64, seed, "0", .help = "random seed for init and data order"),
    OPT("training", "shuffle", CFG_BOOL, shuffle, "false",
        .help = "shuffle the windows of every epoch (deterministic from training.seed)"),
    OPT("training", "text_split", CFG_ENUM, text_split, "line", .choices = cfg_text_splits,
        .help = "plain text: one document per line (as HF's text loader), paragraph or file"),
    OPT("training", "text_field", CFG_STR, text_field, "text",
        .help = "JSON Lines data: the field holding each document's text (TRL's dataset_text_field; prepare's "
                "--text-field); validation data is read the same way"),
    OPT("training", "chat_template", CFG_STR, chat_template, "auto",
        .help = "chat data: auto (the tokenizer's own chat template unless it is ChatML or absent, then "
                "ChatML), chatml, tokenizer (its template, required), or a .jinja file / tokenizer directory"),
    OPT("training", "assistant_only_loss", CFG_BOOL, assistant_only_loss, "true",
        .help = "chat data (messages, ShareGPT): the loss on the assistant replies only; false: on every token "
                "of the rendered conversation, as TRL's SFTTrainer by default (its assistant_only_loss is false); "
                "prompt-completion lists follow it only with completion_only_loss = false (docs/data.md)"),
    OPT("training", "completion_only_loss", CFG_BOOL, completion_only_loss, "true",
        .help = "prompt-completion data (both layouts): the loss on the completion only, as TRL's default; "
                "false: on every token of prompt + completion (TRL's completion_only_loss)"),
    OPT("training", "stop_at_step", CFG_INT, stop_at_step, "0", .range = CFG_GE, .lo = 0,
        .help = "stop after this step with a checkpoint, as if preempted (job time limits, tests); 0: never"),
    OPT("training", "deterministic", CFG_BOOL, deterministic, "false",
        .help = "torchtitan's key, read and ignored: every ctitan run is bit-identical for the same config "
                "and thread count, whatever it says"),
    OPT("training", "threads", CFG_INT, threads, "0", .own = CFG_OWN, .range = CFG_GE, .lo = 0,
        .help = "CPU threads; 0: OMP_NUM_THREADS or all cores"),
    OPT("training", "logits_chunk_rows", CFG_INT, logits_chunk_rows, "0", .range = CFG_GE, .lo = 0,
        .help = "rows of logits the fused lm_head + loss holds at once (fewer: less memory, more passes over "
                "lm_head); 0: as few equal chunks as keep one within 512 MiB, at least 256 rows"),
    OPT("training", "mixed_precision_param", CFG_ENUM, mixed_precision_param, "float32",
        .choices = cfg_mp_dtypes,
        .help = "bfloat16: every linear rounds its inputs to bf16 and sums in fp32, and so do the attention's "
                "products (q, k, v, d(out), and the backward's P and dS); weights, AdamW moments, norms, "
                "softmax and loss stay fp32"),
    OPT("training", "freeze", CFG_STR, freeze, "", .list = 1,
        .help = "tensors not to train: HF names with * wildcards (e.g. [\"model.embed_tokens.weight\", "
                "\"model.layers.*.self_attn.*\"]); no gradient, no AdamW moments, no weight decay"),
    OPT("training", "frozen_dtype", CFG_ENUM, frozen_dtype, "float32", .choices = cfg_frozen_dtypes,
        .help = "storage of frozen matrices: bfloat16 halves them (the products read them from the bf16 "
                "store, never a whole fp32 copy; an fp32 base is rounded to bf16); sharded in bf16 under FSDP"),
    OPT("training", "compile", CFG_BOOL, tt.compile, "false", .inert = 1, .noop = "false",
        .instead = "ctitan has no torch.compile: its kernels are compiled C (see [kernels])",
        .help = "torchtitan's older torch.compile switch: ctitan has none, so only false is taken"),
    OPT("training", "mixed_precision_reduce", CFG_STR, tt.mp_reduce, "float32", .inert = 1, .noop = "float32",
        .instead = "ctitan reduces gradients in fp32",
        .help = "torchtitan's FSDP reduce dtype: ctitan reduces in fp32, so only \"float32\" is taken"),
    OPT("training", "gc_freq", CFG_INT, tt.gc_freq, "50", .inert = 1,
        .help = TT_UNUSED("Python's garbage-collection period (ctitan has no GC), any value")),
    OPT("training", "gc_debug", CFG_BOOL, tt.gc_debug, "false", .inert = 1,
        .help = TT_UNUSED("Python's garbage-collection debugging (ctitan has no GC), any value")),
    OPT("training", "enable_cpu_offload", CFG_BOOL, tt.cpu_offload, "false", .inert = 1,
        .help = TT_UNUSED("FSDP's offload to CPU memory, where ctitan keeps everything anyway; any value")),
    OPT("training", "disable_cuda_graphs", CFG_BOOL, tt.no_cuda_graphs, "false", .inert = 1,
        .help = TT_UNUSED("CUDA graph capture (the same math; ctitan runs on CPUs), any value")),
    OPT("training", "dtype", CFG_ENUM, tt.dtype, "float32", .choices = cfg_mp_dtypes, .inert = 1, .noop = "float32",
        .instead = "ctitan keeps weights, gradients and AdamW moments in fp32; training.mixed_precision_param = "
                   "\"bfloat16\" rounds the products' inputs to bf16 (and training.frozen_dtype stores frozen "
                   "matrices in bf16)",
        .help = "torchtitan 0.3's full-bf16 training (weights, gradients, optimizer states in bf16): ctitan keeps "
                "them in fp32, so only \"float32\" is taken"),

    OPT("training.data", "name", CFG_ENUM, dataset, "auto", .choices = cfg_dataset_kinds,
        .alias = "training.dataset", .help = "torchtitan's [training.data] name: the same as training.dataset"),

    OPT("lora", "rank", CFG_INT, lora_rank, "0", .range = CFG_GE, .lo = 0,
        .help = "LoRA rank r; 0: no LoRA. With r > 0 the base model is frozen and only the adapters "
                "(and lora.modules_to_save) train"),
    OPT("lora", "alpha", CFG_DBL, lora_alpha, "8", .range = CFG_GT, .lo = 0,
        .help = "LoRA alpha: the adapter's output is scaled by alpha / r (alpha / sqrt(r) with use_rslora)"),
    OPT("lora", "dropout", CFG_DBL, lora_dropout, "0", .range = CFG_GE | CFG_LT, .lo = 0, .hi = 1,
        .help = "dropout on the adapters' input (deterministic from training.seed, the step and the micro-batch)"),
    OPT("lora", "target_modules", CFG_STR, lora_targets, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        .list = 1, .help = "HF module names that get adapters (q_proj k_proj v_proj o_proj gate_proj up_proj "
                           "down_proj; on MoE models gate/up/down (Mixtral: w1 w3 w2) adapt the fused experts, "
                           "gate_up_proj at 2 r and 2 alpha, as PEFT rewrites them)"),
    OPT("lora", "target_parameters", CFG_STR, lora_target_params, "", .list = 1,
        .help = "PEFT's target_parameters: fused MoE expert parameters that get adapters (Qwen3-MoE, Mixtral: "
                "mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight; GraniteMoE: "
                "block_sparse_moe.experts.X, block_sparse_moe.router.weight; any suffix, as PEFT matches)"),
    OPT("lora", "rank_pattern", CFG_STR, lora_rank_pattern, "",
        .help = "PEFT's rank_pattern as JSON text, e.g. '{\"q_proj\": 2, \"layers.1.mlp.down_proj\": 8}': "
                "the first key (a regex) matching the end of a module's full name gives its rank"),
    OPT("lora", "alpha_pattern", CFG_STR, lora_alpha_pattern, "",
        .help = "PEFT's alpha_pattern as JSON text {\"regex\": alpha}, matched as rank_pattern"),
    OPT("lora", "use_rslora", CFG_BOOL, lora_rslora, "false",
        .help = "rank-stabilised LoRA: scale by alpha / sqrt(r) instead of alpha / r"),
    OPT("lora", "modules_to_save", CFG_STR, lora_modules_to_save, "", .list = 1,
        .help = "base modules trained in full beside the adapters and saved with them; PEFT's rule: every "
                "module whose path ends with the text (lm_head, embed_tokens; norm: every norm)"),
    OPT("lora", "adapter_path", CFG_STR, lora_adapter_path, "", .own = CFG_OWN_PATH,
        .help = "a PEFT adapter directory or Hub id to start from (adapter_config.json + "
                "adapter_model.safetensors) instead of the fresh initialisation"),
    OPT("lora", "adapter_revision", CFG_STR, lora_adapter_revision, "main",
        .help = "branch, tag or commit when lora.adapter_path is a Hub id"),

    OPT("checkpoint", "enable", CFG_BOOL, ckpt_enable, "false", .help = "save checkpoints"),
    OPT("checkpoint", "folder", CFG_STR, ckpt_folder, "checkpoint", .own = CFG_OWN_PATH,
        .help = "checkpoint folder, relative to job.dump_folder"),
    OPT("checkpoint", "interval", CFG_INT, ckpt_interval, "500", .range = CFG_GE, .lo = 1,
        .help = "steps between checkpoints"),
    OPT("checkpoint", "keep_latest_k", CFG_INT, keep_latest_k, "10", .range = CFG_GE, .lo = 0,
        .help = "checkpoints kept (older ones deleted); 0: keep all"),
    OPT("checkpoint", "load_step", CFG_INT, load_step, "-1", .range = CFG_GE, .lo = -1,
        .help = "step to resume from; -1: the newest complete checkpoint"),
    OPT("checkpoint", "fallback", CFG_BOOL, ckpt_fallback, "true",
        .help = "with load_step = -1, a damaged newest checkpoint is skipped (named on stderr) for the newest "
                "intact one; false: it stops the run (exit 3)"),
    OPT("checkpoint", "last_save_model_only", CFG_BOOL, last_save_model_only, "true",
        .help = "the checkpoint after the last step holds the model only (no optimizer state)"),
    OPT("checkpoint", "enable_first_step_checkpoint", CFG_BOOL, first_step_ckpt, "false",
        .help = "also save a checkpoint after step 1"),
    OPT("checkpoint", "initial_load_path", CFG_STR, initial_load_path, "", .own = CFG_OWN_PATH,
        .help = "Hugging Face model directory or Hub id (at model.hf_revision) whose weights start the run when "
                "checkpoint.folder holds no checkpoint; needs initial_load_in_hf = true (a training checkpoint "
                "resumes through checkpoint.folder)"),
    OPT("checkpoint", "initial_load_in_hf", CFG_BOOL, initial_load_in_hf, "false",
        .help = "initial_load_path is a Hugging Face model directory"),
    OPT("checkpoint", "last_save_in_hf", CFG_BOOL, last_save_in_hf, "false",
        .help = "write the final checkpoint as a Hugging Face model directory"),
    OPT("checkpoint", "export_dtype", CFG_ENUM, export_dtype, "float32",
        .choices = cfg_export_dtypes, .help = "dtype of exported weights"),
    OPT("checkpoint", "async_mode", CFG_ENUM, ckpt_async_mode, "disabled", .choices = cfg_async_modes,
        .help = "\"async\": a save between steps stages a copy of the checkpoint and a background thread writes it "
                "while training goes on (the next save, the end of the run and its exits wait for it); "
                "\"async_with_pinned_mem\" is the same on CPU; the run's last save stays synchronous"),
    OPT("checkpoint", "initial_load_model_only", CFG_BOOL, tt.initial_model_only, "true", .inert = 1,
        .noop = "true",
        .instead = "checkpoint.initial_load_path loads Hugging Face weights only (the model); a training "
                   "checkpoint with its optimizer state resumes through checkpoint.folder",
        .help = "torchtitan's model-only initial load: ctitan's initial_load_path loads the model only, so only "
                "true is taken"),
    OPT("checkpoint", "initial_load_in_hf_quantized", CFG_BOOL, tt.quantized_load, "false", .inert = 1,
        .noop = "false",
        .instead = "ctitan reads Hugging Face safetensors in float32, bfloat16 or float16; quantized checkpoints are "
                   "not read",
        .help = "torchtitan 0.3's quantized Hugging Face initial load: ctitan reads none, so only false is taken"),
    OPT("checkpoint", "exclude_from_loading", CFG_STR, tt.exclude_loading, "", .list = 1, .inert = 1, .noop = "",
        .instead = "ctitan resumes every part of its checkpoints (model, optimizer, schedule, data position); to "
                   "start from weights alone use checkpoint.initial_load_path",
        .help = "torchtitan's parts of a checkpoint not to resume: ctitan resumes all of them, so only [] is taken"),
    OPT("checkpoint", "create_seed_checkpoint", CFG_BOOL, tt.seed_ckpt, "false", .inert = 1, .noop = "false",
        .instead = "ctitan initialises the same weights from training.seed on any layout; it needs no seed checkpoint",
        .help = "torchtitan's seed-checkpoint mode: ctitan has none (and needs none), so only false is taken"),
    OPT("checkpoint", "load_only", CFG_BOOL, tt.load_only, "false", .inert = 1, .noop = "false",
        .instead = "ctitan has no load-only mode: checkpoint.enable both resumes and saves (checkpoint.initial_load_"
                   "path starts from Hugging Face weights without a checkpoint folder)",
        .help = "torchtitan 0.3's resume-without-saving: ctitan has no such mode, so only false is taken"),

    OPT("metrics", "log_freq", CFG_INT, log_freq, "10", .range = CFG_GE, .lo = 1,
        .help = "steps between metric lines"),
    OPT("metrics", "file", CFG_STR, metrics_file, "metrics.jsonl", .own = CFG_OWN_PATH,
        .help = "JSON-lines metrics file, relative to job.dump_folder; \"\" disables"),
    OPT("metrics", "peak_tflops", CFG_DBL, peak_tflops, "0.0", .own = CFG_OWN, .range = CFG_GE, .lo = 0,
        .help = "peak TFLOP/s for MFU; 0: measure once and cache"),
    OPT("metrics", "enable_tensorboard", CFG_BOOL, enable_tensorboard, "false",
        .help = "rank 0 also writes TensorBoard event files (the scalars of metrics.file)"),
    OPT("metrics", "save_tb_folder", CFG_STR, save_tb_folder, "tb", .own = CFG_OWN_PATH,
        .help = "TensorBoard folder, relative to job.dump_folder; a new events file per (re)start"),
    OPT("metrics", "disable_color_printing", CFG_BOOL, tt.no_color, "false", .inert = 1,
        .help = TT_UNUSED("ctitan's log lines have no colors, any value")),
    OPT("metrics", "enable_wandb", CFG_BOOL, tt.wandb, "false", .inert = 1, .noop = "false",
        .instead = "ctitan has no Weights & Biases logger: metrics go to metrics.file (JSON lines) and, with "
                   "metrics.enable_tensorboard, TensorBoard",
        .help = "torchtitan's Weights & Biases logging: ctitan has none, so only false is taken"),
    OPT("metrics", "save_for_all_ranks", CFG_BOOL, tt.all_ranks_metrics, "false", .inert = 1, .noop = "false",
        .instead = "rank 0 writes ctitan's metrics (metrics.file, TensorBoard) for the whole run",
        .help = "torchtitan 0.3's per-rank metric logs: ctitan's rank 0 writes them, so only false is taken"),

    OPT("profiling", "enable_profiling", CFG_BOOL, enable_profiling, "false",
        .help = "write a Chrome trace (Perfetto) of every profile_freq-th step: ops, layers, collectives"),
    OPT("profiling", "save_traces_folder", CFG_STR, save_traces_folder, "profile_trace", .own = CFG_OWN_PATH,
        .help = "trace folder, relative to job.dump_folder: iteration_N/rankR_trace.json"),
    OPT("profiling", "profile_freq", CFG_INT, profile_freq, "10", .range = CFG_GE, .lo = 1,
        .help = "the steps that are multiples of this are traced (and memory-snapshotted)"),
    OPT("profiling", "enable_memory_snapshot", CFG_BOOL, enable_memory_snapshot, "false",
        .help = "write planned versus measured memory by category at the traced steps"),
    OPT("profiling", "save_memory_snapshot_folder", CFG_STR, save_memory_snapshot_folder, "memory_snapshot",
        .own = CFG_OWN_PATH,
        .help = "snapshot folder, relative to job.dump_folder: iteration_N/rankR_memory_snapshot.json"),

    OPT("activation_checkpoint", "mode", CFG_ENUM, ac_mode, "none", .choices = cfg_ac_modes,
        .help = "recompute activations in backward to save memory: none; full: keep only each layer's "
                "input; selective: as selective_ac_option"),
    OPT("activation_checkpoint", "selective_ac_option", CFG_STR, ac_selective_option, "2",
        .help = "mode selective: a period N (every N-th layer recomputed in full, the others keep "
                "everything) or \"op\" (keep matmul/attention outputs, rerun norms, RoPE, SwiGLU)"),
    OPT("activation_checkpoint", "preserve_rng_state", CFG_BOOL, tt.ac_rng, "true", .inert = 1, .noop = "true",
        .instead = "ctitan's recomputation replays the same random numbers (its dropout is a function of "
                   "training.seed, the step and the micro-batch)",
        .help = "torch checkpoint's RNG replay: ctitan's recomputation always replays it, so only true is taken"),
    OPT("activation_checkpoint", "determinism_check", CFG_STR, tt.ac_det_check, "default", .inert = 1,
        .help = TT_UNUSED("torch checkpoint's check of recomputed shapes (a check), any value")),
    OPT("activation_checkpoint", "debug", CFG_BOOL, tt.ac_debug, "false", .inert = 1,
        .help = TT_UNUSED("torch checkpoint's debug log, any value")),
    OPT("activation_checkpoint", "force_recompute_mm_shapes_by_fqns", CFG_STR, tt.ac_mm_fqns, "moe.router.gate",
        .list = 1, .inert = 1,
        .help = TT_UNUSED("matmuls torchtitan 0.3's selective mode recomputes rather than keeps (memory, not "
                          "results), any list")),
    OPT("activation_checkpoint", "memory_budget", CFG_DBL, tt.ac_budget, "0.5", .inert = 1,
        .help = TT_UNUSED("the budget of torchtitan 0.3's compiled memory-budget mode (its subcommand "
                          "activation_checkpoint:memory-budget, which ctitan does not take), any value")),
    OPT("activation_checkpoint", "visualize_memory_budget_pareto", CFG_BOOL, tt.ac_pareto, "false", .inert = 1,
        .help = TT_UNUSED("the memory-budget mode's plot, any value")),

    OPT("parallelism", "data_parallel_replicate_degree", CFG_INT, dp_replicate, "1", .range = CFG_GE, .lo = 1,
        .help = "ranks holding whole replicas; gradients all-reduced across them"),
    OPT("parallelism", "data_parallel_shard_degree", CFG_INT, dp_shard, "-1", .range = CFG_GE | CFG_UNSET,
        .lo = 1, .help = "ranks sharing one replica's parameters, gradients and AdamW moments (FSDP); -1: the "
                         "world size divided by the other degrees"),
    OPT("parallelism", "tensor_parallel_degree", CFG_INT, tp, "1", .range = CFG_GE, .lo = 1,
        .help = "ranks splitting each layer's heads and MLP (dense and MoE models; must divide the heads, kv "
                "heads, intermediate size, moe_intermediate_size, and the vocabulary when lm_head is untied)"),
    OPT("parallelism", "sequence_parallel", CFG_BOOL, sequence_parallel, "true",
        .help = "under tensor parallel each rank holds the residual stream and the norms for 1/degree of a "
                "forward's rows (torchtitan's SequenceParallel, always on there): all-gathers before the "
                "column-parallel projections, reduce-scatters after the row-parallel ones; rows the degree "
                "does not divide are cut in chunks of ceil(rows / degree), as DTensor's Shard cuts them. "
                "false: every rank holds all rows and all-reduces"),
    OPT("parallelism", "expert_parallel_degree", CFG_INT, ep, "1", .range = CFG_GE, .lo = 1,
        .help = "data-parallel ranks splitting the MoE experts' work (docs/distributed.md)"),
    OPT("parallelism", "expert_tensor_parallel_degree", CFG_INT, tt.etp, "1", .inert = 1,
        .help = "torchtitan's tensor parallel degree of the routed experts: ctitan splits each expert like the "
                "MLP over tensor_parallel_degree ranks, so only 1 or tensor_parallel_degree is taken (the same "
                "math either way)"),
    OPT("parallelism", "enable_async_tensor_parallel", CFG_BOOL, tt.async_tp, "false", .inert = 1,
        .noop = "false", .instead = "ctitan has no asynchronous (compiled) tensor parallel",
        .help = "torchtitan's async tensor parallel (needs torch.compile): ctitan has none, so only false is taken"),
    OPT("parallelism", "enable_sequence_parallel", CFG_BOOL, sequence_parallel, "true",
        .alias = "parallelism.sequence_parallel", .help = TT03("parallelism.sequence_parallel")),
    OPT("parallelism", "enable_fsdp_symm_mem", CFG_BOOL, tt.symm_mem, "false", .inert = 1,
        .help = TT_UNUSED("FSDP's symmetric-memory collectives (the same sums; ctitan's are MPI's), any value")),
    OPT("parallelism", "spmd_backend", CFG_ENUM, tt.spmd_backend, "spmd_types", .choices = cfg_tt_spmd, .inert = 1,
        .help = TT_UNUSED("which DTensor code path torchtitan 0.3 shards with (the same math; ctitan shards in "
                          "its own C), any value")),
    OPT("parallelism", "context_parallel_ptrr_mask_key", CFG_STR, tt.ptrr_key, "None", .inert = 1,
        .help = TT_UNUSED("the FlexAttention mask the \"ptrr\" balancer shards by (ctitan has no \"ptrr\", and "
                          "torchtitan ignores the key without it), any value")),
    OPT("parallelism", "context_parallel_degree", CFG_INT, cp, "1", .range = CFG_GE, .lo = 1,
        .help = "ranks splitting each sequence into chunks of training.seq_len / degree positions (two pieces "
                "each, context_parallel_load_balancer; with it \"none\", chunks of consecutive positions); "
                "attention runs over the whole prefix; composes with data parallel, FSDP, tensor, pipeline and "
                "expert parallel, LoRA and training.freeze (docs/distributed.md)"),
    OPT("parallelism", "context_parallel_load_balancer", CFG_ENUM, cp_balancer, "headtail",
        .choices = cfg_cp_balancers,
        .help = "the positions each context-parallel rank holds: headtail (rank c holds pieces c and 2 degree - 1 - c "
                "of 2 degree, so causal attention costs every rank the same; training.seq_len must be a multiple "
                "of 2 degree) or none (consecutive chunks: the last rank's attention costs the most)"),
    OPT("parallelism", "context_parallel_rotate_method", CFG_ENUM, cp_rotate, "allgather",
        .choices = cfg_cp_rotates,
        .help = "how context-parallel attention meets the other ranks' keys: allgather (torchtitan's default: "
                "every rank gathers the whole sequence's k and v for each layer, 6 x batch x seq_len x kv width "
                "floats of scratch) or alltoall (ring attention: the chunks of k and v travel round the ranks one "
                "at a time, merged by online softmax, 8 x batch x seq_len / degree x kv width floats; the "
                "backward sends dk, dv round with them; the same results to rounding)"),
    OPT("parallelism", "pipeline_parallel_degree", CFG_INT, pp, "1", .range = CFG_GE, .lo = 1,
        .help = "pipeline stages: ranks each holding a range of layers, passing activations forward and "
                "gradients back (docs/distributed.md)"),
    OPT("parallelism", "pipeline_parallel_schedule", CFG_ENUM, pp_schedule, "1F1B", .choices = cfg_pp_schedules,
        .help = "order of the micro-batches' forwards and backwards: 1F1B, GPipe, or, with several stages per "
                "rank (2 by default), Interleaved1F1B or LoopedBFS (every micro-batch through a rank's first stage, "
                "then its next; the backwards in reverse), InterleavedZeroBubble, and ZBVZeroBubble or DualPipeV "
                "(exactly 2 stages a rank, in a V) whose backwards run as input and weight parts"),
    OPT("parallelism", "pipeline_parallel_schedule_csv", CFG_STR, pp_csv, "", .own = CFG_OWN_PATH,
        .help = "torchtitan's CSV schedule (torch's _load_csv, \"compute_only\"): row r is pipeline rank r's "
                "actions in order, [stage][F, B, I or W][micro-batch] (2F0, 0B3), an empty cell none; the stages "
                "and their ranks are pipeline_parallel_schedule's, I and W only where it splits the backward; "
                "\"\": the schedule's own order"),
    OPT("parallelism", "pipeline_parallel_microbatch_size", CFG_INT, pp_microbatch, "1", .range = CFG_GE, .lo = 1,
        .help = "sequences per pipeline micro-batch; must divide training.local_batch_size"),
    OPT("parallelism", "pipeline_parallel_split_points", CFG_STR, pp_split, "", .list = 1,
        .help = "first layer of each stage after the first, as torchtitan names them (layers.4); empty: "
                "split by each layer's cost"),
    OPT("parallelism", "module_fqns_per_model_part", CFG_STR, pp_fqns, "", .list = 2,
        .help = "each pipeline stage's modules in order, as torchtitan names them: [[\"tok_embeddings\", "
                "\"layers.0\"], [\"layers.1\", \"norm\", \"output\"]] (HF's embed_tokens / lm_head too); each "
                "stage holds consecutive layers, the embedding in the first, the final norm and head in the last"),
    OPT("parallelism", "pipeline_parallel_layers_per_stage", CFG_INT, pp_layers_per_stage, "-1",
        .range = CFG_GE | CFG_UNSET, .lo = 1,
        .help = "layers per pipeline stage, the embedding and the final norm + lm_head counted as "
                "first_stage_less_layers and last_stage_less_layers layers: ceil((layers + both) / this) stages, "
                "split as torchtitan splits them; unset: split by each layer's cost"),
    OPT("parallelism", "pipeline_parallel_first_stage_less_layers", CFG_INT, pp_first_less, "-1",
        .range = CFG_GE | CFG_UNSET, .lo = 0,
        .help = "layers the embedding counts as in torchtitan's even split (1 when unset); setting it (or "
                "pipeline_parallel_layers_per_stage) splits evenly as torchtitan does instead of by cost"),
    OPT("parallelism", "pipeline_parallel_last_stage_less_layers", CFG_INT, pp_last_less, "-1",
        .range = CFG_GE | CFG_UNSET, .lo = 0,
        .help = "layers the final norm + lm_head count as in torchtitan's even split (1 when unset); setting "
                "it (or pipeline_parallel_layers_per_stage) splits evenly as torchtitan does instead of by cost"),
    OPT("parallelism", "fsdp_reshard_after_forward", CFG_ENUM, fsdp_reshard, "default",
        .choices = cfg_reshard_modes,
        .help = "free a layer's gathered parameters after its forward and gather them again for its backward; "
                "default: always"),

    OPT("kernels", "tune", CFG_BOOL, kernels_tune, "true",
        .help = "choose each \"auto\" op's implementation by timing the candidates on this run's sizes at first "
                "use (cached per CPU and threads in ~/.cache/ctitan); false: the registry's order"),
    /* one key per op, named as the op (kernels/ops_list.h) */
#define KERN_OPT(ID, name, bwd, heavy, help_) \
    OPT("kernels", #name, CFG_STR, kernels[KERN_OP_##ID], "auto", .help = help_),
    KERN_OP_LIST(KERN_OPT)
#undef KERN_OPT

    OPT("validation", "enable", CFG_BOOL, val_enable, "false",
        .help = "evaluate held-out loss and perplexity during training"),
    OPT("validation", "freq", CFG_INT, val_freq, "100", .range = CFG_GE, .lo = 1,
        .help = "optimizer steps between evaluations (and after the last step)"),
    OPT("validation", "steps", CFG_INT, val_steps, "10", .range = CFG_GE, .lo = -1,
        .help = "batches per evaluation; -1: one pass over the validation set"),
    OPT("validation", "local_batch_size", CFG_INT, val_local_batch_size, "0", .range = CFG_GE, .lo = 0,
        .help = "sequences per validation batch; 0: training.local_batch_size"),
    OPT("validation", "dataset", CFG_ENUM, val_dataset, "auto", .choices = cfg_dataset_kinds,
        .help = "validation data kind (as training.dataset)"),
    OPT("validation", "dataset_path", CFG_STR, val_dataset_path, "", .own = CFG_OWN_PATH,
        .help = "held-out data (same formats as training.dataset_path)"),
    OPT("validation", "seq_len", CFG_INT, val_seq_len, "-1", .range = CFG_GE | CFG_UNSET, .lo = 1,
        .help = "tokens per validation window (torchtitan's): shorter or longer than training.seq_len; -1: "
                "training.seq_len"),

    /* torchtitan sections that only matter when they switch something on */
    OPT("compile", "enable", CFG_BOOL, tt.compile_enable, "false", .inert = 1, .noop = "false",
        .instead = "ctitan has no torch.compile: its kernels are compiled C (see [kernels])",
        .help = "torchtitan's torch.compile: ctitan has none, so only false is taken"),
    OPT("compile", "components", CFG_STR, tt.compile_components, "model,loss", .list = 1, .inert = 1,
        .help = TT_UNUSED("what torch.compile compiles (nothing, with enable = false), any list")),
    OPT("compile", "backend", CFG_STR, tt.compile_backend, "inductor", .inert = 1,
        .help = TT_UNUSED("torch.compile's backend (nothing is compiled, with enable = false), any value")),
    OPT("compile", "enable_async_tensor_parallel", CFG_BOOL, tt.async_tp, "false",
        .alias = "parallelism.enable_async_tensor_parallel",
        .help = TT03("parallelism.enable_async_tensor_parallel (only false is taken)")),
    F8_KEYS("float8", 0),
    F8_KEYS("quantize.linear.float8", 1),
    OPT("quantize.grouped_mm.float8", "fqns", CFG_STR, tt.f8_grouped_fqns, "", .list = 1, .inert = 1, .noop = "",
        .instead = "ctitan has no float8 training; its MoE experts run in fp32 or bf16 "
                   "(training.mixed_precision_param)",
        .help = "torchtitan's float8 MoE layers: ctitan has no float8 training, so only [] is taken"),
    OPT("comm", "init_timeout_seconds", CFG_INT, tt.comm_init_timeout, "300", .inert = 1,
        .help = TT_UNUSED("NCCL's timeout at start (ctitan's collectives are MPI's, which have none), any "
                          "value")),
    OPT("comm", "train_timeout_seconds", CFG_INT, tt.comm_train_timeout, "100", .inert = 1,
        .help = TT_UNUSED("NCCL's timeout during training (ctitan's collectives are MPI's, which have none), any "
                          "value")),
    OPT("comm", "trace_buf_size", CFG_INT, tt.comm_trace_buf, "20000", .inert = 1,
        .help = TT_UNUSED("NCCL's flight-recorder ring size (ctitan's collectives are MPI's), any value")),
    OPT("comm", "save_traces_folder", CFG_STR, tt.comm_traces[0], "comm_traces", .inert = 1,
        .help = TT_UNUSED("NCCL's flight-recorder folder, any value")),
    OPT("comm", "save_traces_file_prefix", CFG_STR, tt.comm_traces[1], "rank_", .inert = 1,
        .help = TT_UNUSED("NCCL's flight-recorder file prefix, any value")),
    OPT("comm", "mode", CFG_ENUM, tt.comm_mode, "default", .choices = cfg_tt_comm_modes, .inert = 1,
        .noop = "default",
        .instead = "ctitan's collectives are real (MPI, or one process alone); a layout is checked without running "
                   "it by train --dry-run, and there is no fake or simulated backend",
        .help = "torchtitan 0.3's communication mode (fake, simulated, torchcomms): ctitan's collectives are MPI's, "
                "so only \"default\" is taken"),

    /* torchtitan 0.3's sections: its dataclass config renamed [profiling] to [profiler], [validation] to
     * [validator], [training] dataset keys to [dataloader], and added [debug], [loss], [override] */
    OPT("profiler", "enable_profiling", CFG_BOOL, enable_profiling, "false", .alias = "profiling.enable_profiling",
        .help = TT03("profiling.enable_profiling")),
    OPT("profiler", "save_traces_folder", CFG_STR, save_traces_folder, "profile_trace",
        .alias = "profiling.save_traces_folder", .help = TT03("profiling.save_traces_folder")),
    OPT("profiler", "profile_freq", CFG_INT, profile_freq, "10", .range = CFG_GE, .lo = 1,
        .alias = "profiling.profile_freq", .help = TT03("profiling.profile_freq")),
    OPT("profiler", "profiler_active", CFG_INT, tt.prof_active, "1", .inert = 1, .noop = "1",
        .instead = "ctitan traces one step, each multiple of profiler.profile_freq",
        .help = "torchtitan 0.3's steps traced per period: ctitan traces one, so only 1 is taken"),
    OPT("profiler", "profiler_warmup", CFG_INT, tt.prof_warmup, "3", .inert = 1,
        .help = TT_UNUSED("torch.profiler's untraced warm-up steps (ctitan's tracer needs none), any value")),
    OPT("profiler", "profiler_repeat", CFG_STR, tt.prof_sched[0], "None", .inert = 1, .noop = "None",
        .instead = "ctitan traces every multiple of profiler.profile_freq until the run ends",
        .help = "torchtitan 0.3's number of trace periods: ctitan traces every period, so only None is taken"),
    OPT("profiler", "profiler_skip_first", CFG_STR, tt.prof_sched[1], "None", .inert = 1, .noop = "None",
        .instead = "ctitan traces every multiple of profiler.profile_freq from the first",
        .help = "torchtitan 0.3's steps skipped before tracing: ctitan skips none, so only None is taken"),
    OPT("profiler", "profiler_skip_first_wait", CFG_STR, tt.prof_sched[2], "None", .inert = 1, .noop = "None",
        .instead = "ctitan traces every multiple of profiler.profile_freq from the first",
        .help = "torchtitan 0.3's wait-skipping switch: ctitan skips nothing, so only None is taken"),
    OPT("profiler", "enable_memory_snapshot", CFG_BOOL, enable_memory_snapshot, "false",
        .alias = "profiling.enable_memory_snapshot", .help = TT03("profiling.enable_memory_snapshot")),
    OPT("profiler", "memory_snapshot_freq", CFG_STR, tt.prof_sched[3], "None", .inert = 1, .noop = "None",
        .instead = "ctitan snapshots memory at the traced steps (profiler.profile_freq)",
        .help = "torchtitan 0.3's memory-snapshot period: ctitan snapshots at the traced steps, so only None is "
                "taken"),
    OPT("profiler", "save_memory_snapshot_folder", CFG_STR, save_memory_snapshot_folder, "memory_snapshot",
        .alias = "profiling.save_memory_snapshot_folder", .help = TT03("profiling.save_memory_snapshot_folder")),
    OPT("profiler", "memory_snapshot_max_entries", CFG_INT, tt.prof_max_entries, "1000000", .inert = 1,
        .help = TT_UNUSED("the CUDA allocator history's length (ctitan's snapshot is by category), any value")),

    OPT("dataloader", "dataset", CFG_ENUM, dataset, "auto", .choices = cfg_dataset_kinds,
        .alias = "training.dataset", .help = TT03("training.dataset")),
    OPT("dataloader", "dataset_path", CFG_STR, dataset_path, "", .alias = "training.dataset_path",
        .help = TT03("training.dataset_path")),
    OPT("dataloader", "infinite", CFG_BOOL, tt.dl_infinite, "true", .inert = 1, .noop = "true",
        .instead = "ctitan starts another epoch when the data runs out",
        .help = "torchtitan 0.3's looping over the data: ctitan always starts another epoch, so only true is taken"),
    OPT("dataloader", "num_workers", CFG_INT, tt.dl_workers, "0", .inert = 1,
        .help = TT_UNUSED("torch DataLoader's worker processes (the same batches), any value")),
    OPT("dataloader", "persistent_workers", CFG_BOOL, tt.dl_persistent, "false", .inert = 1,
        .help = TT_UNUSED("torch DataLoader's worker lifetime, any value")),
    OPT("dataloader", "pin_memory", CFG_BOOL, tt.dl_pin, "false", .inert = 1,
        .help = TT_UNUSED("torch DataLoader's pinned host memory, any value")),
    OPT("dataloader", "prefetch_factor", CFG_STR, tt.dl_prefetch, "None", .inert = 1,
        .help = TT_UNUSED("torch DataLoader's batches loaded ahead, any value")),

    OPT("validator", "enable", CFG_BOOL, val_enable, "false", .alias = "validation.enable",
        .help = TT03("validation.enable")),
    OPT("validator", "freq", CFG_INT, val_freq, "100", .range = CFG_GE, .lo = 1, .alias = "validation.freq",
        .help = TT03("validation.freq")),
    OPT("validator", "steps", CFG_INT, val_steps, "10", .range = CFG_GE, .lo = -1, .alias = "validation.steps",
        .help = TT03("validation.steps")),
    OPT("validator.dataloader", "dataset", CFG_ENUM, val_dataset, "auto", .choices = cfg_dataset_kinds,
        .alias = "validation.dataset", .help = TT03("validation.dataset")),
    OPT("validator.dataloader", "dataset_path", CFG_STR, val_dataset_path, "", .alias = "validation.dataset_path",
        .help = TT03("validation.dataset_path")),

    OPT("debug", "seed", CFG_I64, seed, "0", .alias = "training.seed", .help = TT03("training.seed")),
    OPT("debug", "deterministic", CFG_BOOL, deterministic, "false", .alias = "training.deterministic",
        .help = TT03("training.deterministic (read and ignored: every ctitan run is bit-identical)")),
    OPT("debug", "deterministic_warn_only", CFG_BOOL, tt.det_warn_only, "false", .inert = 1,
        .help = TT_UNUSED("torch's warn-only deterministic mode (every ctitan run is bit-identical), any value")),
    OPT("debug", "print_config", CFG_BOOL, tt.print_args, "false", .alias = "job.print_args",
        .help = TT03("job.print_args (any value: the resolved config is always written to "
                     "job.dump_folder/config.toml)")),
    OPT("debug", "save_config_file", CFG_STR, tt.save_config, "None", .inert = 1,
        .help = TT_UNUSED("a JSON copy of the config (ctitan always writes job.dump_folder/config.toml), any value")),
    OPT("debug", "spmd_typechecking", CFG_BOOL, tt.spmd_check, "false", .inert = 1,
        .help = TT_UNUSED("torchtitan 0.3's check of its DTensor types (a check; ctitan has no DTensor), any value")),
    OPT("debug", "detect_anomaly", CFG_BOOL, tt.detect_anomaly, "false", .inert = 1,
        .help = TT_UNUSED("torch autograd's anomaly detection (a check; ctitan's backward is its own C), any "
                          "value")),
    OPT("debug", "enable_structured_logging", CFG_BOOL, tt.structured_log, "true", .inert = 1,
        .help = TT_UNUSED("torchtitan 0.3's per-rank trace log (ctitan's is profiling.enable_profiling), any value")),
    OPT("debug", "moe_force_load_balance", CFG_BOOL, tt.moe_force_balance, "false", .inert = 1, .noop = "false",
        .instead = "ctitan routes each token to its router's top-k experts, as the model does (model."
                   "load_balance_coeff is torchtitan's bias balancing)",
        .help = "torchtitan's round-robin expert routing for debugging: ctitan routes as the model does, so only "
                "false is taken"),
    OPT("debug", "batch_invariant", CFG_BOOL, tt.batch_invariant, "false", .inert = 1, .noop = "false",
        .instead = "ctitan has no batch-invariant mode (torchtitan 0.3 refuses it in pre-training too)",
        .help = "torchtitan 0.3's batch-invariant kernels: ctitan has none, so only false is taken"),

    OPT("loss", "num_chunks", CFG_INT, tt.loss_chunks, "8", .inert = 1,
        .help = TT_UNUSED("chunks of the chunked cross-entropy (the same loss; ctitan's chunking is "
                          "training.logits_chunk_rows), any value")),
    OPT("loss.loss_fn", "global_vocab_size", CFG_STR, tt.loss_vocab, "None", .inert = 1, .noop = "None",
        .instead = "ctitan's loss spans the model's vocabulary (model.flavor or its config.json)",
        .help = "torchtitan 0.3's loss vocabulary, set by its model registry: ctitan's is the model's, so only "
                "None is taken"),

    OPT("override", "imports", CFG_STR, tt.override_imports, "", .list = 1, .inert = 1, .noop = "",
        .instead = "ctitan swaps no model code; each op's implementation is chosen in [kernels] (kernels.<op>)",
        .help = "torchtitan 0.3's component overrides (fused kernels and the like): ctitan has none, so only [] "
                "is taken"),
};

#define CFG_N_OPTIONS ((int)(sizeof cfg_options / sizeof cfg_options[0]))
_Static_assert(sizeof cfg_options / sizeof cfg_options[0] <= CFG_MAX_OPTIONS, "raise CFG_MAX_OPTIONS (config.h)");

/* ---- small helpers ---- */

static void *cfg_field(ct_config *c, const cfg_option *o) { return (char *)c + o->off; }
static const void *cfg_cfield(const ct_config *c, const cfg_option *o) {
    return (const char *)c + o->off;
}

static const cfg_option *cfg_lookup(const char *section, const char *key) {
    for (int i = 0; i < CFG_N_OPTIONS; i++)
        if (strcmp(cfg_options[i].section, section) == 0 && strcmp(cfg_options[i].key, key) == 0)
            return &cfg_options[i];
    return NULL;
}

/* A section with options, or a parent of one ([quantize] of [quantize.linear.float8]). */
static int cfg_section_known(const char *section) {
    size_t n = strlen(section);
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        const char *s = cfg_options[i].section;
        if (strcmp(s, section) == 0 || (strncmp(s, section, n) == 0 && s[n] == '.')) return 1;
    }
    return 0;
}

/* torchtitan keys renamed since (its older configs still hold them): the current name. */
static const struct {
    const char *section, *old_key, *key;
} cfg_renamed[] = {
    {"lr_scheduler", "lr_min", "min_lr_factor"},
    {"checkpoint", "enable_checkpoint", "enable"},
    {"checkpoint", "last_save_model_weights_only", "last_save_model_only"},
    {"checkpoint", "initial_load_model_weights_only", "initial_load_model_only"},
    {"validation", "enabled", "enable"},
    {"training", "batch_size", "local_batch_size"},
};

/* The first option of each section starts a new section (the table is
 * grouped by section). */
static int cfg_first_of_section(int i) {
    return i == 0 || strcmp(cfg_options[i - 1].section, cfg_options[i].section) != 0;
}

static int cfg_edit_distance(const char *a, const char *b) {
    size_t na = strlen(a), nb = strlen(b);
    if (na > 63 || nb > 63) return 99;
    int row[64], prev[64];
    for (size_t j = 0; j <= nb; j++) prev[j] = (int)j;
    for (size_t i = 1; i <= na; i++) {
        row[0] = (int)i;
        for (size_t j = 1; j <= nb; j++) {
            int sub = prev[j - 1] + (a[i - 1] != b[j - 1]);
            int del = prev[j] + 1, ins = row[j - 1] + 1;
            row[j] = sub < del ? (sub < ins ? sub : ins) : (del < ins ? del : ins);
        }
        memcpy(prev, row, (nb + 1) * sizeof *row);
    }
    return prev[nb];
}

/* " (did you mean section.key?)" for a mistyped name, or "" if nothing is
 * close. The same key in another section counts as close too: a user who
 * writes training.lr means optimizer.lr. */
static void cfg_suggest(const char *section, const char *key, char *out, size_t cap) {
    for (size_t i = 0; i < sizeof cfg_renamed / sizeof cfg_renamed[0]; i++)
        if (!strcmp(cfg_renamed[i].section, section) && !strcmp(cfg_renamed[i].old_key, key)) {
            snprintf(out, cap, " (did you mean %s.%s? it is torchtitan's current name for %s)", section,
                     cfg_renamed[i].key, key);
            return;
        }
    char given[160], cand[160];
    snprintf(given, sizeof given, "%s.%s", section, key);
    int best = 3;
    const cfg_option *bo = NULL;
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        const cfg_option *o = &cfg_options[i];
        snprintf(cand, sizeof cand, "%s.%s", o->section, o->key);
        int d = cfg_edit_distance(given, cand);
        if (strcmp(o->key, key) == 0 && d > 2) d = 2;
        if (d < best) best = d, bo = o;
    }
    if (bo) snprintf(out, cap, " (did you mean %s.%s?)", bo->section, bo->key);
    else out[0] = '\0';
}

static void cfg_section_hint(const char *section, char *out, size_t cap) {
    /* Short names are all within 2 edits of each other ("foo" vs "job"),
     * so the allowed distance also scales with the length. */
    int len = (int)strlen(section);
    int best = (len / 3 < 2 ? len / 3 : 2) + 1;
    const char *bs = NULL;
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        if (!cfg_first_of_section(i)) continue;
        int d = cfg_edit_distance(section, cfg_options[i].section);
        if (d < best) best = d, bs = cfg_options[i].section;
    }
    if (bs) {
        snprintf(out, cap, " (did you mean [%s]?)", bs);
        return;
    }
    size_t n = (size_t)snprintf(out, cap, " (known sections:");
    for (int i = 0; i < CFG_N_OPTIONS && n < cap; i++)
        if (cfg_first_of_section(i))
            n += (size_t)snprintf(out + n, cap - n, "%s %s", i ? "," : "", cfg_options[i].section);
    if (n < cap) snprintf(out + n, cap - n, ")");
}

static void cfg_choices_text(const cfg_option *o, const char *sep, char *out, size_t cap) {
    size_t n = 0;
    out[0] = '\0';
    for (int k = 0; o->choices[k] && n < cap; k++)
        n += (size_t)snprintf(out + n, cap - n, "%s%s", k ? sep : "", o->choices[k]);
}

static void cfg_range_text(const cfg_option *o, int with_unset, char *out, size_t cap) {
    const char *pre = with_unset && (o->range & CFG_UNSET) ? "-1 (unset) or " : "";
    int lo = o->range & (CFG_GE | CFG_GT), hi = o->range & (CFG_LE | CFG_LT);
    if (lo && hi)
        snprintf(out, cap, "%sin %c%g, %g%c", pre, (o->range & CFG_GE) ? '[' : '(', o->lo, o->hi,
                 (o->range & CFG_LE) ? ']' : ')');
    else if (lo)
        snprintf(out, cap, "%s%s %g", pre, (o->range & CFG_GE) ? ">=" : ">", o->lo);
    else if (hi)
        snprintf(out, cap, "%s%s %g", pre, (o->range & CFG_LE) ? "<=" : "<", o->hi);
    else
        out[0] = '\0';
}

static int cfg_in_range(const cfg_option *o, double v) {
    if ((o->range & CFG_UNSET) && v == -1) return 1;
    if ((o->range & CFG_GE) && !(v >= o->lo)) return 0;
    if ((o->range & CFG_GT) && !(v > o->lo)) return 0;
    if ((o->range & CFG_LE) && !(v <= o->hi)) return 0;
    if ((o->range & CFG_LT) && !(v < o->hi)) return 0;
    return 1;
}

/* "FILE:LINE" for a TOML value, "FILE" or "command line" otherwise. */
static void cfg_where(char *out, size_t cap, const char *src, int line) {
    if (line > 0) snprintf(out, cap, "%s:%d", src, line);
    else snprintf(out, cap, "%s", src);
}

/* ---- checking and storing one value ---- */

/* Range check of a numeric value (dv for doubles, iv otherwise). */
static int cfg_check_num(const cfg_option *o, double dv, int64_t iv, const char *where,
                         ct_err *e) {
    if (o->type == CFG_DBL && !isfinite(dv))
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: must be a finite number (got %g)", where,
                       o->section, o->key, dv);
    /* the trainer computes in fp32: optimizer.lr = 1e39 passed as a double
     * and became inf in the first update, every weight with it */
    if (o->type == CFG_DBL && fabs(dv) > FLT_MAX)
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: %g is beyond fp32's range (|x| <= %g), which the run computes in",
                       where, o->section, o->key, dv, (double)FLT_MAX);
    if (o->type == CFG_INT && (iv < INT_MIN || iv > INT_MAX))
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: %" PRId64 " does not fit in a 32-bit int",
                       where, o->section, o->key, iv);
    double v = o->type == CFG_DBL ? dv : (double)iv;
    if (cfg_in_range(o, v)) return 0;
    char r[96];
    cfg_range_text(o, 1, r, sizeof r);
    if (o->type == CFG_DBL)
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: must be %s (got %g)", where, o->section,
                       o->key, r, dv);
    return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: must be %s (got %" PRId64 ")", where,
                   o->section, o->key, r, iv);
}

static int cfg_store_num(ct_config *c, const cfg_option *o, double dv, int64_t iv,
                         const char *where, ct_err *e) {
    int rc = cfg_check_num(o, dv, iv, where, e);
    if (rc) return rc;
    void *f = cfg_field(c, o);
    if (o->type == CFG_DBL) *(double *)f = dv;
    else if (o->type == CFG_I64) *(int64_t *)f = iv;
    else *(int *)f = (int)iv;
    return 0;
}

static int cfg_tt_dataset(const char *s) {
    for (int k = 0; cfg_tt_datasets[k]; k++)
        if (!strcmp(cfg_tt_datasets[k], s)) return 1;
    return 0;
}

static int cfg_check_str(const cfg_option *o, const char *s, const char *where, ct_err *e) {
    if (o->type != CFG_ENUM) return 0;
    for (int k = 0; o->choices[k]; k++)
        if (strcmp(o->choices[k], s) == 0) return 0;
    int dataset = o->choices == cfg_dataset_kinds;
    if (dataset && cfg_tt_dataset(s)) return 0;
    char ch[160], more[400] = "";
    cfg_choices_text(o, ", ", ch, sizeof ch);
    if (dataset) {
        const char *sec = strcmp(o->section, "validation") ? "training" : "validation";
        snprintf(more, sizeof more,
                 " (the kind of the files %s.dataset_path names; auto: from their extension and first line. ctitan "
                 "has no built-in datasets: point %s.dataset_path at local files; torchtitan's names c4, c4_test "
                 "and c4_validation are taken as auto)", sec, sec);
    }
    return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: '%s' is not one of: %s%s", where, o->section,
                   o->key, s, ch, more);
}

static int cfg_store_str(ct_config *c, const cfg_option *o, const char *s, const char *where,
                         ct_err *e) {
    /* torch's get_schedule_class matches a schedule name in any case, so a torchtitan
     * config may spell it "interleaved1f1b": keep the canonical spelling */
    for (int k = 0; o->choices == cfg_pp_schedules && o->choices[k]; k++)
        if (!strcasecmp(o->choices[k], s)) s = o->choices[k];
    int rc = cfg_check_str(o, s, where, e);
    if (rc) return rc;
    char **f = cfg_field(c, o);
    if (o->choices == cfg_dataset_kinds) {
        /* torchtitan's dataset name: the files at dataset_path say their kind */
        char *name = c->dataset_tt[o->off == offsetof(ct_config, val_dataset)];
        if (cfg_tt_dataset(s)) {
            snprintf(name, sizeof c->dataset_tt[0], "%s", s);
            s = "auto";
        } else {
            name[0] = '\0';
        }
    }
    char *old = *f;
    *f = ct_strdup(s); /* copy before freeing: s may alias the old value */
    free(old);
    return 0;
}

/* A TOML array of strings into a list option, comma-joined (a list of lists:
 * each inner array so, the groups joined by ';'); a comma or ';' inside an
 * item could not be told from the separators, so it is refused. */
static int cfg_store_list(ct_config *c, const cfg_option *o, const toml_value *v, const char *where, ct_err *e) {
    size_t len = 1;
    for (int i = 0; i < v->n_items; i++) {
        const toml_value *g = &v->items[i];
        int nested = o->list == 2, n = nested ? g->n_items : 1;
        if (nested && (g->kind != TOML_ARRAY || !g->n_items))
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: item %d: expected a non-empty array of strings", where,
                           o->section, o->key, i + 1);
        for (int j = 0; j < n; j++) {
            const toml_value *it = nested ? &g->items[j] : g;
            if (it->kind != TOML_STRING || !it->s[0] || strpbrk(it->s, ",;"))
                return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: item %d%s: expected a non-empty string without commas",
                               where, o->section, o->key, i + 1, nested ? "'s items" : "");
            len += strlen(it->s) + 1;
        }
    }
    char *joined = ct_malloc(len), *p = joined;
    *p = '\0';
    for (int i = 0; i < v->n_items; i++) {
        const toml_value *g = &v->items[i];
        if (o->list != 2) {
            p += sprintf(p, "%s%s", i ? "," : "", g->s);
            continue;
        }
        for (int j = 0; j < g->n_items; j++) p += sprintf(p, "%s%s", j ? "," : i ? ";" : "", g->items[j].s);
    }
    int rc = cfg_store_str(c, o, joined, where, e);
    free(joined);
    return rc;
}

const char *cfg_group_next(const char *list, char *group, size_t cap) {
    if (!list || !*list) return NULL;
    if (*list == ';') list++;
    size_t n = strcspn(list, ";");
    size_t k = n < cap - 1 ? n : cap - 1;
    memcpy(group, list, k);
    group[k] = '\0';
    return list + n;
}

const char *cfg_list_next(const char *list, char *item, size_t cap) {
    if (!list) return NULL;
    while (*list == ',' || *list == ' ') list++;
    if (!*list) return NULL;
    size_t n = strcspn(list, ",");
    size_t k = n < cap - 1 ? n : cap - 1;
    memcpy(item, list, k);
    while (k > 0 && item[k - 1] == ' ') k--;
    item[k] = '\0';
    return list + n;
}

static const char *cfg_type_name(cfg_type t) {
    switch (t) {
    case CFG_STR: return "string";
    case CFG_INT: return "int";
    case CFG_I64: return "int64";
    case CFG_DBL: return "float";
    case CFG_BOOL: return "bool";
    case CFG_ENUM: return "enum";
    }
    return "?";
}

/* Parses a command-line value by the option's type. Strict: the whole text
 * must be the value. */
static int cfg_set_text(ct_config *c, const cfg_option *o, const char *text, const char *where,
                        ct_err *e) {
    /* torchtitan 0.3's command line (tyro) writes Python's None for "not set": ctitan's own unset
     * value where it has one (-1, "", an empty list, the choice "none"); other options keep the
     * text and refuse it as any other bad value (an inert key defaulting to "None" takes it) */
    if (!strcmp(text, "None") && strcmp(where, "built-in default")) {
        int unset_str = o->type == CFG_STR && (o->list || !strcmp(o->def, ""));
        int unset_num = o->type != CFG_STR && o->type != CFG_ENUM && o->type != CFG_BOOL && (o->range & CFG_UNSET);
        int none_choice = 0;
        for (int k = 0; o->type == CFG_ENUM && o->choices[k]; k++) none_choice |= !strcmp(o->choices[k], "none");
        if (unset_str) text = "";
        else if (unset_num) text = "-1";
        else if (none_choice) text = "none";
    }
    if (o->list && text[0] == '[') {
        /* a TOML array, as torchtitan users write lists: read by the TOML reader itself */
        size_t n = strlen(text);
        char *doc_text = ct_malloc(n + 8);
        memcpy(doc_text, "v = ", 4);
        memcpy(doc_text + 4, text, n + 1);
        toml_doc d;
        ct_err te = {0};
        int rc = toml_parse_string(doc_text, n + 4, "list", &d, &te);
        free(doc_text);
        if (rc) {
            const char *msg = strncmp(te.msg, "list:1: ", 8) == 0 ? te.msg + 8 : te.msg;
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: '%s' is not a TOML array of strings: %s", where, o->section,
                           o->key, text, msg);
        }
        const toml_kv *kv = toml_find(&d, "", "v");
        if (!kv || kv->val.kind != TOML_ARRAY || d.n_sections != 1 || d.sections[0].n_kvs != 1)
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: '%s' is not a TOML array of strings", where, o->section,
                         o->key, text);
        else
            rc = cfg_store_list(c, o, &kv->val, where, e);
        toml_free(&d);
        return rc;
    }
    switch (o->type) {
    case CFG_STR:
    case CFG_ENUM: return cfg_store_str(c, o, text, where, e);
    case CFG_BOOL:
        if (strcmp(text, "true") == 0 || strcmp(text, "false") == 0) {
            *(int *)cfg_field(c, o) = text[0] == 't';
            return 0;
        }
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: expected true or false, got '%s'", where,
                       o->section, o->key, text);
    case CFG_INT:
    case CFG_I64: {
        char *end;
        int sign_ok = text[0] == '-' || text[0] == '+' || (text[0] >= '0' && text[0] <= '9');
        errno = 0;
        long long v = sign_ok ? strtoll(text, &end, 10) : 0;
        if (!sign_ok || end == text || *end != '\0')
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: expected an integer, got '%s'", where,
                           o->section, o->key, text);
        if (errno == ERANGE)
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: '%s' does not fit in 64 bits", where,
                           o->section, o->key, text);
        return cfg_store_num(c, o, 0, (int64_t)v, where, e);
    }
    case CFG_DBL: {
        char *end;
        int start_ok = text[0] && text[0] != ' ' && text[0] != '\t';
        errno = 0;
        double v = start_ok ? strtod(text, &end) : 0;
        if (!start_ok || end == text || *end != '\0')
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: expected a number, got '%s'", where,
                           o->section, o->key, text);
        if (errno == ERANGE && isinf(v))
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: '%s' is out of range", where,
                           o->section, o->key, text);
        return cfg_store_num(c, o, v, 0, where, e);
    }
    }
    return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: bad option type", where, o->section, o->key);
}

static void cfg_describe_toml(const toml_value *v, char *out, size_t cap) {
    switch (v->kind) {
    case TOML_STRING: snprintf(out, cap, "a string (\"%.60s\")", v->s); break;
    case TOML_INT: snprintf(out, cap, "an integer (%" PRId64 ")", v->i); break;
    case TOML_FLOAT: snprintf(out, cap, "a float (%g)", v->f); break;
    case TOML_BOOL: snprintf(out, cap, "a boolean (%s)", v->i ? "true" : "false"); break;
    case TOML_ARRAY: snprintf(out, cap, "an array"); break;
    }
}

static int cfg_set_toml(ct_config *c, const cfg_option *o, const toml_value *v,
                        const char *where, ct_err *e) {
    const char *want = NULL;
    switch (o->type) {
    case CFG_STR:
    case CFG_ENUM:
        if (v->kind == TOML_STRING) return cfg_store_str(c, o, v->s, where, e);
        if (o->list && v->kind == TOML_ARRAY) return cfg_store_list(c, o, v, where, e);
        want = o->type == CFG_ENUM ? "a string" : "a string (in quotes)";
        break;
    case CFG_BOOL:
        if (v->kind == TOML_BOOL) {
            *(int *)cfg_field(c, o) = (int)v->i;
            return 0;
        }
        want = "a boolean (true or false)";
        break;
    case CFG_INT:
    case CFG_I64:
        if (v->kind == TOML_INT) return cfg_store_num(c, o, 0, v->i, where, e);
        want = "an integer";
        break;
    case CFG_DBL:
        if (v->kind == TOML_FLOAT) return cfg_store_num(c, o, v->f, 0, where, e);
        if (v->kind == TOML_INT) return cfg_store_num(c, o, (double)v->i, 0, where, e);
        want = "a number";
        break;
    }
    char got[96];
    cfg_describe_toml(v, got, sizeof got);
    return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: expected %s, got %s", where, o->section, o->key,
                   want, got);
}

/* ---- defaults and lifetime ---- */

void cfg_defaults(ct_config *c) {
    memset(c, 0, sizeof *c);
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        ct_err e;
        if (cfg_options[i].alias) continue; /* its option sets the field */
        if (cfg_set_text(c, &cfg_options[i], cfg_options[i].def, "built-in default", &e)) {
            /* A broken table entry: nothing sensible can run. */
            fprintf(stderr, "ctitan: internal error: %s\n", e.msg);
            abort();
        }
    }
    c->config_path = ct_strdup("");
}

void cfg_free(ct_config *c) {
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        const cfg_option *o = &cfg_options[i];
        if ((o->type != CFG_STR && o->type != CFG_ENUM) || o->alias) continue;
        char **f = cfg_field(c, o);
        free(*f);
        *f = NULL;
    }
    free(c->config_path);
    c->config_path = NULL;
    free(c->hf_assets_dir);
    free(c->initial_load_dir);
    free(c->lora_adapter_dir);
    c->hf_assets_dir = c->initial_load_dir = c->lora_adapter_dir = NULL;
}

int cfg_set(ct_config *c, const char *name, const char *value, ct_err *e) {
    const char *dot = strrchr(name, '.'); /* sections may have dots ([training.data]), keys not */
    char section[64];
    size_t n = dot ? (size_t)(dot - name) : 0;
    if (!dot || n >= sizeof section)
        return ct_fail(e, CT_ERR_CONFIG, "command line: unknown option '%s'", name);
    memcpy(section, name, n);
    section[n] = '\0';
    const cfg_option *o = cfg_lookup(section, dot + 1);
    if (!o) {
        char hint[256];
        if (!cfg_section_known(section)) {
            cfg_suggest(section, dot + 1, hint, sizeof hint);
            if (!hint[0]) cfg_section_hint(section, hint, sizeof hint);
            return ct_fail(e, CT_ERR_CONFIG, "command line: %s: unknown section [%s]%s", name,
                           section, hint);
        }
        cfg_suggest(section, dot + 1, hint, sizeof hint);
        return ct_fail(e, CT_ERR_CONFIG, "command line: %s: unknown key%s", name, hint);
    }
    int rc = cfg_set_text(c, o, value, "command line", e);
    if (!rc) c->from_cli[o - cfg_options] = 1;
    return rc;
}

/* ---- the TOML file ---- */

static int cfg_apply_doc(ct_config *c, const toml_doc *doc, ct_err *e) {
    const char *path = doc->path;
    char where[600], hint[256];
    for (int s = 0; s < doc->n_sections; s++) {
        const toml_section *sec = &doc->sections[s];
        if (s == 0) {
            /* Keys before any [section]. */
            if (sec->n_kvs == 0) continue;
            const toml_kv *kv = &sec->kvs[0];
            cfg_suggest("", kv->key, hint, sizeof hint);
            return ct_fail(e, CT_ERR_CONFIG, "%s:%d: %s: key outside any [section]%s", path,
                           kv->line, kv->key, hint);
        }
        /* [a] made only as the parent of [a.b]: [a.b] itself is checked */
        if (sec->implicit && sec->n_kvs == 0) continue;
        if (!cfg_section_known(sec->name)) {
            cfg_section_hint(sec->name, hint, sizeof hint);
            if (sec->n_kvs > 0)
                return ct_fail(e, CT_ERR_CONFIG, "%s:%d: %s.%s: unknown section [%s]%s", path, sec->kvs[0].line,
                               sec->name, sec->kvs[0].key, sec->name, hint);
            return ct_fail(e, CT_ERR_CONFIG, "%s:%d: unknown section [%s]%s", path, sec->line,
                           sec->name, hint);
        }
        for (int k = 0; k < sec->n_kvs; k++) {
            const toml_kv *kv = &sec->kvs[k];
            const cfg_option *o = cfg_lookup(sec->name, kv->key);
            if (!o) {
                cfg_suggest(sec->name, kv->key, hint, sizeof hint);
                return ct_fail(e, CT_ERR_CONFIG, "%s:%d: %s.%s: unknown key%s", path, kv->line,
                               sec->name, kv->key, hint);
            }
            if (o->alias) {
                /* torchtitan's older name beside the current one: the same value, or a choice to make */
                char tsec[64];
                const char *tdot = strrchr(o->alias, '.');
                snprintf(tsec, sizeof tsec, "%.*s", (int)(tdot - o->alias), o->alias);
                const toml_kv *other = toml_find(doc, tsec, tdot + 1);
                int same = other && other->val.kind == TOML_STRING && kv->val.kind == TOML_STRING &&
                           !strcmp(other->val.s, kv->val.s);
                if (other && !same)
                    return ct_fail(e, CT_ERR_CONFIG,
                                   "%s:%d: %s.%s: the same setting as %s (line %d), with another value: keep one",
                                   path, kv->line, sec->name, kv->key, o->alias, other->line);
            }
            cfg_where(where, sizeof where, path, kv->line);
            int rc = cfg_set_toml(c, o, &kv->val, where, e);
            if (rc) return rc;
        }
    }
    return 0;
}

static int cfg_load_file(ct_config *c, const char *path, ct_err *e) {
    toml_doc doc;
    int rc = toml_parse_file(path, &doc, e);
    if (rc) {
        /* A missing or malformed --config is the user's config, not a
         * runtime failure: exit 2 before any work. */
        if (e) e->code = CT_ERR_CONFIG;
        return CT_ERR_CONFIG;
    }
    char *p = ct_strdup(path);
    free(c->config_path);
    c->config_path = p;
    rc = cfg_apply_doc(c, &doc, e);
    toml_free(&doc);
    return rc;
}

/* ---- settings that do nothing ---- */

static int cfg_same_value(const ct_config *a, const ct_config *b, const cfg_option *o) {
    const void *x = cfg_cfield(a, o), *y = cfg_cfield(b, o);
    switch (o->type) {
    case CFG_STR:
    case CFG_ENUM: {
        const char *s = *(char *const *)x, *t = *(char *const *)y;
        return s && t ? !strcmp(s, t) : s == t;
    }
    case CFG_INT:
    case CFG_BOOL: return *(const int *)x == *(const int *)y;
    case CFG_I64: return *(const int64_t *)x == *(const int64_t *)y;
    case CFG_DBL: return *(const double *)x == *(const double *)y;
    }
    return 1;
}

/* With lora.rank = 0 there is no LoRA, and a run loads no adapter (lora.adapter_path
 * needs rank > 0): a [lora] key given another value than its default changes
 * nothing, which a warning says instead of silence. "Another value than the
 * default" is what set in the file or on the command line means here: the run's
 * own config.toml (cfg_write_toml) lists every key, and read back as a --config it
 * must not warn about the defaults. The keys a rank-0 run refuses (an error naming
 * them: trainer_finetune_config, lora_apply_frozen) are left to that error, and
 * lora.adapter_revision to lora.adapter_path's. */
/* Likewise [validation] with validation.enable false: nothing is evaluated, so
 * validation.dataset_path (or dataset, freq, steps) given without validation.enable was
 * ignored in silence. Left out: the torchtitan keys ctitan does not use (inert), and
 * validation.local_batch_size, which is checked and sizes the model's buffers (the
 * trainer plans for the larger of the two batches) even with validation off. */
void cfg_warn_unused(const ct_config *c) {
    static const char *const refused[] = {"adapter_path", "target_parameters", "rank_pattern", "alpha_pattern",
                                          "modules_to_save"};
    ct_config d;
    cfg_defaults(&d);
    for (int i = 0; i < CFG_N_OPTIONS && !c->val_enable; i++) {
        const cfg_option *o = &cfg_options[i];
        if (strcmp(o->section, "validation") || !strcmp(o->key, "enable") || !strcmp(o->key, "local_batch_size") ||
            o->inert || cfg_same_value(c, &d, o))
            continue;
        char name[96];
        snprintf(name, sizeof name, "validation.%s", o->key);
        fprintf(stderr,
                "ctitan: warning: %s: %s has no effect: validation.enable is false (no validation; set "
                "--validation.enable to evaluate)\n",
                cfg_origin(c, name), name);
    }
    for (int i = 0; i < CFG_N_OPTIONS && c->lora_rank == 0; i++) {
        const cfg_option *o = &cfg_options[i];
        if (strcmp(o->section, "lora") || !strcmp(o->key, "rank") || cfg_same_value(c, &d, o)) continue;
        int skip = !strcmp(o->key, "adapter_revision") && c->lora_adapter_path[0];
        for (size_t k = 0; k < sizeof refused / sizeof refused[0]; k++) skip |= !strcmp(o->key, refused[k]);
        if (skip) continue;
        char name[96];
        snprintf(name, sizeof name, "lora.%s", o->key);
        fprintf(stderr, "ctitan: warning: %s: %s has no effect: lora.rank is 0 (no LoRA)\n", cfg_origin(c, name),
                name);
    }
    if (c->pp <= 1 && c->pp_csv[0]) /* as torchtitan, which reads it only to build a pipeline schedule */
        fprintf(stderr, "ctitan: warning: %s: parallelism.pipeline_parallel_schedule_csv has no effect: "
                "pipeline_parallel_degree is 1 (no pipeline)\n",
                cfg_origin(c, "parallelism.pipeline_parallel_schedule_csv"));
    cfg_free(&d);
}

/* ---- the command line ---- */

static int cfg_is_config_flag(const char *name, size_t n) {
    return (n == 6 && strncmp(name, "config", 6) == 0) ||
           (n == 15 && strncmp(name, "job.config_file", 15) == 0);
}

/* torchtitan 0.3 picks its activation checkpointing policy by a tyro
 * subcommand word; each is a mode here. Its "selective" is per-op (it keeps
 * the outputs of compute ops and also recomputes every second matmul): the
 * nearest is ctitan's selective_ac_option = "op", which keeps every matmul
 * output (the same numbers, more memory, less recomputation). */
static int cfg_ac_subcommand(ct_config *c, const char *word, ct_err *e) {
    static const struct {
        const char *word, *mode, *option;
    } map[] = {{"none", "none", NULL}, {"full", "full", NULL}, {"selective", "selective", "op"}};
    for (size_t k = 0; k < sizeof map / sizeof map[0]; k++) {
        if (strcmp(word, map[k].word) != 0) continue;
        const cfg_option *o = cfg_lookup("activation_checkpoint", "mode");
        int rc = cfg_set_text(c, o, map[k].mode, "command line", e);
        if (rc) return rc;
        c->from_cli[o - cfg_options] = 1;
        if (map[k].option) {
            o = cfg_lookup("activation_checkpoint", "selective_ac_option");
            if ((rc = cfg_set_text(c, o, map[k].option, "command line", e))) return rc;
            c->from_cli[o - cfg_options] = 1;
        }
        return 0;
    }
    if (!strcmp(word, "memory-budget"))
        return ct_fail(e, CT_ERR_CONFIG,
                       "command line: activation_checkpoint:memory-budget: torchtitan's compiler-chosen recomputation "
                       "(it needs torch.compile) is not built; use activation_checkpoint.mode = \"selective\" or "
                       "\"full\"");
    return ct_fail(e, CT_ERR_CONFIG,
                   "command line: activation_checkpoint:%s: not one of torchtitan's policies none, full, selective, "
                   "memory-budget", word);
}

int cfg_parse_args(ct_config *c, int argc, char **argv, ct_err *e) {
    /* Pass 1: the config file, wherever it appears, so that every override
     * on the line wins over it regardless of order. */
    const char *config = NULL;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (strncmp(a, "--", 2) != 0) continue;
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t n = eq ? (size_t)(eq - name) : strlen(name);
        if (!cfg_is_config_flag(name, n)) continue;
        const char *val;
        if (eq) {
            val = eq + 1;
        } else {
            if (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)
                return ct_fail(e, CT_ERR_CONFIG, "command line: --%.*s: missing value (a TOML file)",
                               (int)n, name);
            val = argv[++i];
        }
        if (!val[0])
            return ct_fail(e, CT_ERR_CONFIG, "command line: --%.*s: empty file name", (int)n, name);
        if (config)
            return ct_fail(e, CT_ERR_CONFIG,
                           "command line: --config given twice ('%s' and '%s')", config, val);
        config = val;
    }
    if (config) {
        int rc = cfg_load_file(c, config, e);
        if (rc) return rc;
    }

    /* Pass 2: overrides, in order. torchtitan 0.3's command line is tyro's: a
     * policy picked by a subcommand word (activation_checkpoint:full), names
     * written with '-' for '_' (ctitan's names have no '-'), and --x.no-flag
     * for a boolean's false. */
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strncmp(a, "activation_checkpoint:", 22)) {
            int rc = cfg_ac_subcommand(c, a + 22, e);
            if (rc) return rc;
            continue;
        }
        if (strncmp(a, "--", 2) != 0 || !a[2])
            return ct_fail(e, CT_ERR_CONFIG,
                           "command line: unexpected argument '%s' (options look like "
                           "--section.key=value)", a);
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t n = eq ? (size_t)(eq - name) : strlen(name);
        if (cfg_is_config_flag(name, n)) {
            if (!eq) i++;
            continue;
        }
        char full[160];
        if (n >= sizeof full)
            return ct_fail(e, CT_ERR_CONFIG, "command line: option name too long: '%.40s...'", a);
        memcpy(full, name, n);
        full[n] = '\0';
        for (char *p = full; *p; p++)
            if (*p == '-') *p = '_';
        const char *dot = strrchr(full, '.'); /* sections may have dots, keys not */
        const cfg_option *o = NULL;
        int negated = 0;
        if (dot) {
            char section[160];
            memcpy(section, full, (size_t)(dot - full));
            section[dot - full] = '\0';
            o = cfg_lookup(section, dot + 1);
            if (!o && !strncmp(dot + 1, "no_", 3)) { /* tyro's --section.no-flag */
                o = cfg_lookup(section, dot + 4);
                if (o && (o->type != CFG_BOOL || eq))
                    return ct_fail(e, CT_ERR_CONFIG, "command line: %s: %s", a,
                                   o->type != CFG_BOOL ? "only a boolean takes the no- form"
                                                       : "the no- form takes no value (it means false)");
                negated = o != NULL;
            }
        }
        if (!o) {
            if (!dot) {
                char hint[256];
                cfg_suggest("", full, hint, sizeof hint);
                return ct_fail(e, CT_ERR_CONFIG, "command line: unknown option --%s%s", full,
                               hint);
            }
            return cfg_set(c, full, "", e); /* reports the unknown section or key */
        }
        const char *val;
        if (negated) {
            val = "false";
        } else if (eq) {
            val = eq + 1;
        } else if (o->type == CFG_BOOL) {
            /* A bare flag means true; the next argument is taken only if it
             * is unmistakably a boolean, so `--x.flag --y.z=1` works. */
            if (i + 1 < argc && (strcmp(argv[i + 1], "true") == 0 ||
                                 strcmp(argv[i + 1], "false") == 0))
                val = argv[++i];
            else
                val = "true";
        } else {
            if (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)
                return ct_fail(e, CT_ERR_CONFIG,
                               "command line: %s: missing value (--%s=<%s>)", full, full,
                               cfg_type_name(o->type));
            val = argv[++i];
        }
        int rc = cfg_set_text(c, o, val, "command line", e);
        if (rc) return rc;
        c->from_cli[o - cfg_options] = 1;
    }
    return cfg_validate(c, e);
}

/* ---- validation ---- */

/* An option's value as the command line would take it (lists comma-joined). */
static void cfg_value_text(const ct_config *c, const cfg_option *o, char *out, size_t cap) {
    const void *f = cfg_cfield(c, o);
    switch (o->type) {
    case CFG_STR:
    case CFG_ENUM: snprintf(out, cap, "%s", *(char *const *)f ? *(char *const *)f : ""); break;
    case CFG_BOOL: snprintf(out, cap, "%s", *(const int *)f ? "true" : "false"); break;
    case CFG_INT: snprintf(out, cap, "%d", *(const int *)f); break;
    case CFG_I64: snprintf(out, cap, "%" PRId64, *(const int64_t *)f); break;
    case CFG_DBL: snprintf(out, cap, "%g", *(const double *)f); break;
    }
}

/* The same as a TOML value, for a message: "x", ["a", "b"], 3, true. */
static void cfg_value_shown(const ct_config *c, const cfg_option *o, char *out, size_t cap) {
    char text[256];
    cfg_value_text(c, o, text, sizeof text);
    if (o->list) {
        char item[128], group[256];
        size_t n = (size_t)snprintf(out, cap, "[");
        int g = 0;
        for (const char *q = text; (q = o->list == 2 ? cfg_group_next(q, group, sizeof group) : q) && n < cap; g++) {
            const char *p = o->list == 2 ? group : text;
            if (o->list == 2) n += (size_t)snprintf(out + n, cap - n, "%s[", g ? ", " : "");
            for (int first = 1; n < cap && (p = cfg_list_next(p, item, sizeof item)); first = 0)
                n += (size_t)snprintf(out + n, cap - n, "%s\"%s\"", first ? "" : ", ", item);
            if (o->list != 2) break;
            if (n < cap) n += (size_t)snprintf(out + n, cap - n, "]");
        }
        if (n < cap) snprintf(out + n, cap - n, "]");
    } else if (o->type == CFG_STR || o->type == CFG_ENUM) {
        snprintf(out, cap, "\"%.200s\"", text);
    } else {
        snprintf(out, cap, "%s", text);
    }
}

/* torchtitan's keys that ctitan reads only at the value that changes nothing for it. */
static int cfg_validate_inert(const ct_config *c, ct_err *e) {
    char name[160], shown[300];
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        const cfg_option *o = &cfg_options[i];
        if (!o->inert || !o->noop) continue;
        char text[256];
        cfg_value_text(c, o, text, sizeof text);
        if (!strcmp(text, o->noop)) continue;
        snprintf(name, sizeof name, "%s.%s", o->section, o->key);
        cfg_value_shown(c, o, shown, sizeof shown);
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s = %s: torchtitan's key is read, but only %s%s%s is taken: %s",
                       cfg_origin(c, name), name, shown, o->list ? "[]" : o->type == CFG_STR ? "\"" : "",
                       o->list ? "" : o->noop, o->type == CFG_STR && !o->list ? "\"" : "", o->instead);
    }
    if (strcmp(c->tt.model_name, "qwen3") && strcmp(c->model_spec, "hf"))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: model.name = \"%s\": ctitan's native model (model.spec = \"qwen3\", the flavors of "
                       "model.flavor) is Qwen3, so only \"qwen3\" is taken; other families (Llama, Mistral, Qwen2, "
                       "...) come through model.spec = \"hf\" with model.hf_assets_path holding their config.json",
                       cfg_origin_any(c, "model.name,model.spec"), c->tt.model_name);
    if (c->tt.etp != 1 && c->tt.etp != c->tp)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.expert_tensor_parallel_degree = %d: ctitan splits the routed experts over "
                       "the tensor_parallel_degree (%d) ranks, as the MLP, so only 1%s%.0d is taken",
                       cfg_origin_any(c, "parallelism.expert_tensor_parallel_degree,parallelism.tensor_parallel_degree"),
                       c->tt.etp, c->tp, c->tp > 1 ? " or " : "", c->tp > 1 ? c->tp : 0);
    if (c->dataset_tt[0][0] && !c->dataset_path[0])
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: training.dataset = \"%s\": torchtitan downloads its %s dataset; ctitan reads local "
                       "files only: set training.dataset_path to them (JSON lines with a \"text\" field, c4's "
                       "layout, are read as kind jsonl; docs/data.md)",
                       cfg_origin_any(c, "training.dataset,training.data.name,training.dataset_path"), c->dataset_tt[0],
                       c->dataset_tt[0]);
    return 0;
}

/* Each message names where the value it is about was set (cfg_origin): the
 * file, or the command line when an override set it. */
int cfg_validate(const ct_config *c, ct_err *e) {
    const char *file = c->config_path && c->config_path[0] ? c->config_path : "command line";
    if (c->tt.opt_impl && !strcmp(c->tt.opt_impl, "fused_opt_states_bf16"))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: optimizer.implementation = \"fused_opt_states_bf16\" keeps AdamW's moments in bfloat16; "
                       "ctitan keeps them in float32 (torch's default): use fused, foreach or for-loop",
                       cfg_origin(c, "optimizer.implementation"));
    /* Per-option checks again: the library API may have set fields directly. */
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        const cfg_option *o = &cfg_options[i];
        const void *f = cfg_cfield(c, o);
        const char *src = c->from_cli[i] ? "command line" : file;
        int rc = 0;
        switch (o->type) {
        case CFG_STR:
        case CFG_ENUM: {
            const char *s = *(char *const *)f;
            if (!s)
                return ct_fail(e, CT_ERR_CONFIG, "%s: %s.%s: not set", src, o->section, o->key);
            rc = cfg_check_str(o, s, src, e);
            break;
        }
        case CFG_BOOL: break;
        case CFG_INT: rc = cfg_check_num(o, 0, *(const int *)f, src, e); break;
        case CFG_I64: rc = cfg_check_num(o, 0, *(const int64_t *)f, src, e); break;
        case CFG_DBL: rc = cfg_check_num(o, *(const double *)f, 0, src, e); break;
        }
        if (rc) return rc;
    }
    /* a micro-batch's rows (batch x sequence) are counted in an int by the model: a
     * product past INT_MAX would wrap, and a --dry-run would plan from the wrapped value */
    const struct { const char *key, *len; int batch, T; } rows[] = {
        {"training", "training.seq_len", c->local_batch_size, c->seq_len},
        {"validation", cfg_val_seq_len(c) != c->seq_len ? "validation.seq_len" : "training.seq_len",
         c->val_local_batch_size,
         cfg_val_seq_len(c)}};
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
        if ((long long)rows[i].batch * rows[i].T > INT_MAX) {
            char keys[96];
            snprintf(keys, sizeof keys, "%s.local_batch_size,%s", rows[i].key, rows[i].len);
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s.local_batch_size (%d) x %s (%d) = %lld, out of range (at most %d)",
                           cfg_origin_any(c, keys), rows[i].key, rows[i].batch, rows[i].len, rows[i].T,
                           (long long)rows[i].batch * rows[i].T, INT_MAX);
        }
    if (c->global_batch_size != -1 && c->global_batch_size % c->local_batch_size != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: training.global_batch_size (%d) must be -1 or a positive multiple "
                       "of training.local_batch_size (%d)",
                       cfg_origin_any(c, "training.global_batch_size,training.local_batch_size"), c->global_batch_size, c->local_batch_size);
    {
        /* "op" or a whole number >= 1 (checked again by lm_create_ac) */
        const char *o = c->ac_selective_option;
        int ok = strcmp(o, "op") == 0 || (o[0] >= '1' && o[0] <= '9');
        for (const char *p = o; ok && strcmp(o, "op") != 0 && *p; p++) ok = *p >= '0' && *p <= '9';
        if (!ok || (strcmp(o, "op") != 0 && strlen(o) > 6))
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: activation_checkpoint.selective_ac_option: \"%s\" is neither \"op\" nor a "
                           "layer period (1 to 999999)",
                           cfg_origin(c, "activation_checkpoint.selective_ac_option"), o);
    }
    if (strcmp(c->model_spec, "hf") == 0 && !c->hf_assets_path[0])
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: model.hf_assets_path: required when model.spec is \"hf\" "
                       "(the directory holding config.json)", cfg_origin_any(c, "model.spec,model.hf_assets_path"));
    if (!c->hf_revision[0])
        return ct_fail(e, CT_ERR_CONFIG, "%s: model.hf_revision: must name a branch, tag or commit (default \"main\")",
                       cfg_origin(c, "model.hf_revision"));
    if (c->initial_load_path[0] && !c->initial_load_in_hf)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: checkpoint.initial_load_path: only Hugging Face safetensors directories can be loaded "
                       "as initial weights; set checkpoint.initial_load_in_hf = true (training checkpoints "
                       "resume through checkpoint.folder)",
                       cfg_origin_any(c, "checkpoint.initial_load_path,checkpoint.initial_load_in_hf"));
    if (c->val_steps == 0)
        return ct_fail(e, CT_ERR_CONFIG, "%s: validation.steps: must be positive or -1 (one pass)",
                       cfg_origin(c, "validation.steps"));
    if (c->val_enable && !c->val_dataset_path[0])
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: validation.dataset_path: required when validation.enable is true",
                       cfg_origin_any(c, "validation.enable,validation.dataset_path"));
    if (!c->text_field[0])
        return ct_fail(e, CT_ERR_CONFIG, "%s: training.text_field: empty (the JSON Lines field holding the text)",
                       cfg_origin(c, "training.text_field"));
    /* context parallel composes with every other layout (docs/distributed.md); what it needs
     * of the model (no load-balancing loss in the gradient) mesh_resolve checks */
    if (c->cp > 1 && c->seq_len % c->cp != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.context_parallel_degree = %d does not divide training.seq_len = %d "
                       "(each rank runs seq_len / degree positions)",
                       cfg_origin_any(c, "parallelism.context_parallel_degree,training.seq_len"), c->cp, c->seq_len);
    if (c->cp > 1 && !strcmp(c->cp_balancer, "headtail") && c->seq_len % (2 * c->cp) != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.context_parallel_load_balancer = \"headtail\" cuts training.seq_len = %d into "
                       "2 x parallelism.context_parallel_degree = %d pieces, which do not divide it (a multiple of "
                       "%d, or context_parallel_load_balancer = \"none\")",
                       cfg_origin_any(c, "parallelism.context_parallel_load_balancer,parallelism.context_parallel_degree,"
                                         "training.seq_len"),
                       c->seq_len, 2 * c->cp, 2 * c->cp);
    /* validation's windows are chunked as training's (distributed/cp.h): the same rules for their length */
    if (c->cp > 1 && c->val_enable && c->val_seq_len > 0 && c->val_seq_len % c->cp != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.context_parallel_degree = %d does not divide validation.seq_len = %d "
                       "(each rank runs seq_len / degree positions of a validation window too)",
                       cfg_origin_any(c, "validation.seq_len,parallelism.context_parallel_degree"), c->cp,
                       c->val_seq_len);
    if (c->cp > 1 && c->val_enable && c->val_seq_len > 0 && !strcmp(c->cp_balancer, "headtail") &&
        c->val_seq_len % (2 * c->cp) != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.context_parallel_load_balancer = \"headtail\" cuts validation.seq_len = %d "
                       "into 2 x parallelism.context_parallel_degree = %d pieces, which do not divide it (a multiple of "
                       "%d, or context_parallel_load_balancer = \"none\")",
                       cfg_origin_any(c, "validation.seq_len,parallelism.context_parallel_load_balancer,"
                                         "parallelism.context_parallel_degree"),
                       c->val_seq_len, 2 * c->cp, 2 * c->cp);
    return cfg_validate_inert(c, e);
}

int cfg_val_seq_len(const ct_config *c) { return c->val_enable && c->val_seq_len > 0 ? c->val_seq_len : c->seq_len; }

/* ---- help and dump ---- */

static void cfg_flag_text(const cfg_option *o, char *out, size_t cap) {
    if (o->type == CFG_ENUM) {
        char ch[160];
        cfg_choices_text(o, "|", ch, sizeof ch);
        snprintf(out, cap, "--%s.%s=<%s>", o->section, o->key, ch);
    } else {
        snprintf(out, cap, "--%s.%s=<%s>", o->section, o->key, o->list ? "list" : cfg_type_name(o->type));
    }
}

void cfg_print_help(FILE *out) {
    char flag[256], r[96];
    /* Align help texts, but let a few long enum flags wrap instead of
     * pushing every line to the right. */
    int width = 0;
    const int max_width = 40;
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        cfg_flag_text(&cfg_options[i], flag, sizeof flag);
        int n = (int)strlen(flag);
        if (n > width && n <= max_width) width = n;
    }
    fprintf(out, "Options. `--config FILE` reads a TOML file first (sections as below), then\n"
                 "each --section.key=value, --section.key value, or bare --section.key (booleans)\n"
                 "overrides it, left to right. A <list> is a,b,c or a TOML array [\"a\", \"b\"].\n"
                 "Sections and keys are torchtitan's; [a.b] sections are its nested tables.\n");
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        const cfg_option *o = &cfg_options[i];
        if (cfg_first_of_section(i)) fprintf(out, "\n[%s]\n", o->section);
        cfg_flag_text(o, flag, sizeof flag);
        if ((int)strlen(flag) > width)
            fprintf(out, "  %s\n  %-*s  %s", flag, width, "", o->help);
        else
            fprintf(out, "  %-*s  %s", width, flag, o->help);
        cfg_range_text(o, 1, r, sizeof r);
        if (r[0]) fprintf(out, "; %s", r);
        if (o->type == CFG_STR || o->type == CFG_ENUM)
            fprintf(out, " (default: \"%s\")\n", o->def);
        else
            fprintf(out, " (default: %s)\n", o->def);
    }
}

/* A TOML basic string: escapes what TOML requires (and nothing else, so
 * UTF-8 text stays readable). */
static void cfg_write_string(const char *s, FILE *out) {
    fputc('"', out);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(out, "\\%c", *p);
        else if (*p == '\n') fputs("\\n", out);
        else if (*p == '\t') fputs("\\t", out);
        else if (*p < 0x20 || *p == 0x7f) fprintf(out, "\\u%04X", *p);
        else fputc(*p, out);
    }
    fputc('"', out);
}

/* The shortest %g text that reads back to the same double, written so TOML
 * sees a float (1.0, not 1). */
static void cfg_write_double(double v, FILE *out) {
    char buf[40];
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, v);
        if (strtod(buf, NULL) == v) break;
    }
    if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
    fputs(buf, out);
}

/* One option's value as TOML writes it. */
static void cfg_write_value(const ct_config *c, const cfg_option *o, FILE *out) {
    const void *f = cfg_cfield(c, o);
    switch (o->type) {
    case CFG_STR:
        if (o->list) {
            char item[512], group[4096];
            const char *text = *(char *const *)f;
            fputc('[', out);
            for (int g = 0; (text = o->list == 2 ? cfg_group_next(text, group, sizeof group) : text); g++) {
                const char *p = o->list == 2 ? group : text;
                if (o->list == 2) fputs(g ? ", [" : "[", out);
                for (int first = 1; (p = cfg_list_next(p, item, sizeof item)); first = 0) {
                    if (!first) fputs(", ", out);
                    cfg_write_string(item, out);
                }
                if (o->list != 2) break;
                fputc(']', out);
            }
            fputc(']', out);
            break;
        }
        /* fall through */
    case CFG_ENUM: cfg_write_string(*(char *const *)f ? *(char *const *)f : "", out); break;
    case CFG_INT: fprintf(out, "%d", *(const int *)f); break;
    case CFG_I64: fprintf(out, "%" PRId64, *(const int64_t *)f); break;
    case CFG_DBL: cfg_write_double(*(const double *)f, out); break;
    case CFG_BOOL: fputs(*(const int *)f ? "true" : "false", out); break;
    }
}

void cfg_write_toml(const ct_config *c, FILE *out) {
    fprintf(out, "# ctitan resolved configuration");
    if (c->config_path && c->config_path[0]) {
        fprintf(out, " (from ");
        cfg_write_string(c->config_path, out);
        fprintf(out, " and the command line)");
    }
    fprintf(out, "\n");
    const char *last = NULL;
    for (int i = 0; i < CFG_N_OPTIONS; i++) {
        const cfg_option *o = &cfg_options[i];
        if (o->alias || o->inert) continue; /* torchtitan's other names and unused keys */
        if (!last || strcmp(last, o->section)) fprintf(out, "%s[%s]\n", last ? "\n" : "", o->section);
        last = o->section;
        fprintf(out, "%s = ", o->key);
        cfg_write_value(c, o, out);
        fputc('\n', out);
    }
}

int cfg_n_options(void) { return CFG_N_OPTIONS; }

char *cfg_shared_text(const ct_config *c, int i) {
    if (i < 0 || i >= CFG_N_OPTIONS) return NULL;
    const cfg_option *o = &cfg_options[i];
    if (o->alias || o->inert || o->own == CFG_OWN) return NULL;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) { /* no memory for a few bytes: nothing later would have any either */
        fprintf(stderr, "ctitan: error: out of memory\n");
        exit(1);
    }
    fprintf(f, "%s.%s = ", o->section, o->key);
    if (o->own == CFG_OWN_PATH) /* a machine's own path: only whether it is set */
        fputs(*(char *const *)cfg_cfield(c, o) && **(char *const *)cfg_cfield(c, o) ? "(set)" : "(unset)", f);
    else
        cfg_write_value(c, o, f);
    fclose(f);
    return text;
}

const char *cfg_source(const ct_config *c) { return c->config_path[0] ? c->config_path : "command line"; }
/* Whether option "section.key", the n bytes at name, was last set on the command line. */
static int cfg_from_cli(const ct_config *c, const char *name, size_t n) {
    char one[128];
    if (n >= sizeof one) return 0;
    memcpy(one, name, n);
    one[n] = '\0';
    char *dot = strrchr(one, '.');
    if (!dot) return 0;
    *dot = '\0';
    const cfg_option *o = cfg_lookup(one, dot + 1);
    return o && c->from_cli[o - cfg_options];
}
const char *cfg_origin(const ct_config *c, const char *name) {
    return cfg_from_cli(c, name, strlen(name)) ? "command line" : cfg_source(c);
}
const char *cfg_origin_any(const ct_config *c, const char *names) {
    for (const char *p = names; *p;) {
        size_t n = strcspn(p, ",");
        if (cfg_from_cli(c, p, n)) return "command line";
        p += n + (p[n] == ',');
    }
    return cfg_source(c);
}
const char *cfg_adapter_dir(const ct_config *c) {
    return c->lora_adapter_dir ? c->lora_adapter_dir : c->lora_adapter_path;
}
const char *cfg_hf_dir(const ct_config *c) { return c->hf_assets_dir ? c->hf_assets_dir : c->hf_assets_path; }
const char *cfg_initial_dir(const ct_config *c) {
    return c->initial_load_dir ? c->initial_load_dir : c->initial_load_path;
}
