/* model/lora.h: LoRA adapters as PEFT defines them, and frozen tensors.
 *
 * The adapters live in the model's own tensor table (model/lm.h: each
 * layer's lora_A [r, in] and lora_B [out, r] after its base tensors, named
 * with PEFT's keys less "base_model.model."), so the optimizer, the
 * checkpoints, FSDP and data parallel treat them as any other tensor. This
 * module holds what is LoRA's own: which projections of which layers are
 * adapted and at which rank and scale (PEFT's target_modules, "all-linear",
 * rank_pattern / alpha_pattern, layers_to_transform, resolved as PEFT does
 * into lm_config.lora_lp), PEFT's initialisation, the PEFT adapter directory in and out
 * (adapter_config.json + adapter_model.safetensors, which
 * peft.PeftModel.from_pretrained reads as it is), and the choice of what is
 * frozen ([training] freeze patterns, or everything but the adapters and
 * lora.modules_to_save). */
#ifndef CT_MODEL_LORA_H
#define CT_MODEL_LORA_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "model/lm.h"

/* Bits of lm_config.lora_targets beyond the projections: the target named the
 * fused module of the files (Phi3's qkv_proj = q|k|v, gate_up_proj =
 * gate|up), which PEFT adapts as one Linear: one A [r, in] and one B
 * [out_fused, r], whose row blocks are the projections' B (model/lm.c binds
 * them so). */
#define LORA_FUSED_QKV (1u << 16)
#define LORA_FUSED_GATE_UP (1u << 17)
/* target_modules named lm_head (PEFT's LoRA Linear on the output layer):
 * logits += scale B A drop(x), A [r, H], B [V, r], at lora_rank / lora_scale.
 * On a tied model PEFT (without ensure_weight_tying) adapts lm_head alone, the
 * embedding lookup untouched: so does ctitan. */
#define LORA_HEAD (1u << 18)
/* target_modules named embed_tokens (PEFT's LoRA Embedding): the lookup of id
 * adds scale B A[:, id] (lora_embedding_A [r, V], _B [H, r]) before any
 * embed_scale, which scales both; no dropout; PEFT's init A zeros, B normal.
 * Tied, lm_head keeps the base weight (PEFT without ensure_weight_tying). */
#define LORA_EMBED (1u << 19)

/* Whether c's targets name its modules as its files hold them: a fused
 * model's q/k/v (gate/up) only as qkv_proj (gate_up_proj), and the fused
 * names only on such a model. CT_ERR_CONFIG naming `where`, `key` and the module. */
int lora_check_fused(const lm_config *c, const char *where, const char *key, ct_err *e);

/* Whether a target_modules list is PEFT's shorthand "all-linear" (any case). */
int lora_is_all_linear(const char *targets);
/* What "all-linear" adapts on c's model as PEFT resolves it
 * (_maybe_include_all_linear_layers: every nn.Linear but the output layer):
 * every projection of the layers (Phi3: qkv_proj, o_proj, gate_up_proj,
 * down_proj), as lora_targets bits. On a MoE model PEFT then rewrites the
 * MLP names into the experts' target_parameters (which drops the dense
 * mlp_only layers' MLPs) and adds every router, gate.weight
 * (_convert_peft_config_moe): the caller's part (trainer_finetune_config). */
unsigned lora_all_linear(const lm_config *c);

/* PEFT's rank_pattern / alpha_pattern (LoraConfig): JSON objects
 * {regex: value} as text ("" none), tried in order against each adapted
 * module's full name ("model.layers.1.mlp.down_proj") and expert parameter's
 * ("model.layers.1.mlp.experts.gate_up_proj") as
 * re.match(rf"(.*\.)?({key})$", name), the first match giving its rank
 * (alpha), else lora.rank (alpha). Sets c->lora_lp / lora_kind /
 * lora_exp_*; c's targets, lora_rank and lora_scale must be set. gate_up_fused:
 * PEFT's MoE rewrite of gate_proj + up_proj also sets
 * ".*\.gate_up_proj" to 2 r and 2 alpha (in place, or appended). A key
 * that is not a regex or selects nothing adapted, a rank that is not a
 * positive integer, or an expert parameter with other ranks in other
 * layers is CT_ERR_CONFIG naming `where` and the key. */
int lora_config_patterns(lm_config *c, const char *rank_pattern, const char *alpha_pattern, double alpha, int rslora,
                         int gate_up_fused, const char *where, ct_err *e);

/* PEFT puts no adapter inside a module of modules_to_save (comma list; its
 * rule re.match(rf"(^|.*\.){m}($|\..*)", module)): an adapted module of c
 * there is CT_ERR_CONFIG naming `where`, the entry and the module. */
int lora_check_saved_targets(const lm_config *c, const char *modules_to_save, const char *where, ct_err *e);

/* "q_proj,k_proj,..." (PEFT's target_modules: HF module names, or a module's
 * full name or a suffix of it, "model.layers.1.mlp.down_proj", PEFT's rule)
 * -> c->lora_targets (1 << LM_LORA_* bits) and per-layer lora_lp
 * LM_LORA_LP_OFF where a layer lacks one. A name selecting no projection is
 * CT_ERR_CONFIG naming `where` and the name. */
int lora_parse_targets(const char *list, lm_config *c, const char *where, ct_err *e);
/* alpha / r, or alpha / sqrt(r) with rslora (PEFT's LoraLayer.scaling). */
float lora_scaling(double alpha, int r, int rslora);

/* PEFT's target_parameters (comma list) -> c->lora_experts[]: a name
 * selects layer l's fused experts parameter "model.layers.l.mlp.experts.X"
 * (X gate_up_proj or down_proj), or its router "model.layers.l.mlp.gate.weight"
 * (bit LM_LORA_EXP_R; GraniteMoE's "model.layers.l.block_sparse_moe.experts.X"
 * and "model.layers.l.block_sparse_moe.router.weight", its module tree's
 * names), when it equals it or ends with "." + it,
 * PEFT's rule, so "mlp.experts.down_proj" is every MoE layer's and
 * "layers.3.mlp.experts.down_proj" layer 3's. A name that selects no expert
 * parameter of this model (or any name on a model without Qwen3-MoE
 * experts) is CT_ERR_CONFIG naming `where`, `key` and the name. */
int lora_parse_target_params(const char *list, lm_config *c, const char *where, const char *key, ct_err *e);

/* PEFT's ParamWrapper on E stacked experts (lora/layer.py,
 * get_delta_weight): expert e's A_e is rows [e r, e r + r) of A [E r, K] and
 * B_e column j is B[:, j E + e] of B [N, r E]; W_e[N, K] += scale B_e A_e.
 * The N rows of an expert are split over two stacked blocks as ctitan
 * stores gate_up_proj: rows [0, n0) in w0 [E, n0, K], the rest in w1
 * [E, N - n0, K] (down_proj: n0 = N, w1 NULL). Products in fp32 with the
 * run's fp32 matmul, as PEFT folds in W's dtype with autocast off. */
void lora_experts_delta(const kern_ops *k, float *w0, float *w1, const float *A, const float *B, int E, int r, int K,
                        int N, int n0, float scale);
/* Its backward from dW (dw0, dw1 as w0, w1): dA += scale B_e^T dW_e,
 * dB_e += scale dW_e A_e^T per expert. */
void lora_experts_grad(const kern_ops *k, float *dA, float *dB, const float *dw0, const float *dw1, const float *A,
                       const float *B, int E, int r, int K, int N, int n0, float scale);

/* Sets tensors[i].frozen of m: with LoRA (cfg.lora_rank > 0) every base
 * tensor except those of modules_to_save (PEFT's rule: every module whose
 * path ends with the text, so "norm" is every norm; on a tied model
 * "embed_tokens" and "lm_head" are the one embedding tensor, and another name
 * selecting it is refused: PEFT would train a copy of one module alone); then also every tensor matching one
 * of the freeze patterns (HF names, * matches any run of characters).
 * Lists are comma-joined. A pattern that matches nothing, or a module name
 * that is nowhere in the model, is CT_ERR_CONFIG naming `where`: a typo must
 * not leave a tensor silently trained. Rebinds the gradient views. With no
 * LoRA, freeze or modules_to_save nothing is frozen: callers need not check. */
int lora_apply_frozen(lm_model *m, const char *freeze, const char *modules_to_save, const char *where, ct_err *e);

/* y[n, N] += B (scale A x[n, K]): the adapter branch beside a linear, with
 * A [r, K], B [N, r]; u[n, r] receives scale A x (the backward's input for
 * B). lora_fwd_group with one adapter. B NULL: u alone (a row-parallel
 * adapter sums it over the tensor-parallel group before B). */
void lora_apply(const kern_ops *k, float *y, float *u, const float *x, const float *A, const float *B, int n, int K,
                int N, int r, float scale);

/* One adapter of a group that reads the same input x[n, K] (q, k, v; gate,
 * up; or one projection alone). */
typedef struct {
    const float *A, *B; /* A [r, K], B [N, r] */
    float *y;           /* forward: y[n, N] += B u (B NULL: u alone) */
    float *u;           /* [n, r]: scale A x; written by the forward, read by the backward */
    const float *dy;    /* backward: d y [n, N] */
    float *du;          /* backward scratch [n, r], one per adapter of the group */
    float *gA, *gB;     /* backward: dA, dB accumulated (NULL: frozen) */
    int N, r;
    float scale;
} lora_proj;

/* The forwards of np adapters on x, in one parallel region (threads split
 * the rows; see lora.c for why). Adapters may share u (each thread writes
 * and reads back its own rows in turn). Per element the same sums as
 * lora_apply on each, in order, for any thread count. */
void lora_fwd_group(const kern_ops *k, const float *x, int n, int K, const lora_proj *p, int np);
/* Their backward: du = scale dy B, dx[n, K] += du A (dx NULL: nothing below
 * wants it; adapters in order, so dx sums as one adapter after the other),
 * then dB += dy^T u and dA += du^T x, each by one thread (gradients that share
 * a buffer by the same one, in order). One parallel region, one barrier. */
void lora_bwd_group(const kern_ops *k, float *dx, const float *x, int n, int K, const lora_proj *p, int np);

/* PEFT's fresh adapters, tensor by tensor into s (LM_PARAMS): A as
 * nn.Linear's default kaiming_uniform(a = sqrt(5)), i.e. uniform in
 * +-1/sqrt(in), drawn from ct_rng seeded by `seed` (not torch's generator);
 * B zero, so the adapted model starts equal to the base. table: the whole
 * model's tensor table; only its lora tensors are put. */
void lora_init_each(const lm_model *table, uint64_t seed, const lm_sink *s);

/* A PEFT adapter directory into s: the adapters and any modules_to_save
 * tensors it holds. adapter_config.json must say LORA with the configured
 * rank, alpha and rslora, adapt the same modules and expert parameters as
 * the run, each at the run's rank and scale (rank_pattern / alpha_pattern
 * read as PEFT reads them), and name only known target modules (a list of
 * names or full module names, or "all-linear"); every lora
 * tensor of the table must be in adapter_model.safetensors with its shape,
 * and every key of the file must be one of the table's (on a tied model
 * with ensure_weight_tying, lm_head's key is the embedding again, and must
 * hold its values; a tied pair trained without it is refused). Errors name the file
 * and the key (CT_ERR_FORMAT; a disagreement with the run's config
 * CT_ERR_CONFIG). */
int lora_load_peft_each(const lm_model *table, const char *dir, const lm_sink *s, ct_err *e);

/* Reads DIR/adapter_config.json into c's LoRA fields (rank, targets, scale,
 * per-module and per-layer targets, rank_pattern / alpha_pattern; no dropout: for
 * evaluation and generation) and *alpha, *rslora. */
int lora_read_config(const char *dir, lm_config *c, double *alpha, int *rslora, ct_err *e);

/* What an adapter directory saves: the lora tensors and the trainable base
 * tensors (modules_to_save) of the table. */
int lora_saved(const lm_tensor *t);

/* Writes dir/adapter_model.safetensors (fp32) then dir/adapter_config.json
 * for the saved tensors of table, whose values are data[i] (NULL for the
 * others), each through a temporary file and a rename (dir is created if
 * needed; other files in it stay, so a training checkpoint can carry an
 * adapter). base: the base
 * model's path for base_model_name_or_path. targets/modules_to_save as in
 * the config (comma lists). A trained tied embedding is saved as PEFT's
 * ensure_weight_tying saves it: true in the config, the tensor under
 * embed_tokens' and lm_head's keys. */
int lora_save_peft(const lm_model *table, const float *const *data, const char *dir, const char *base,
                   double alpha, int rslora, double dropout, const char *modules_to_save, ct_err *e);

/* Folds every adapter into its base weight, W += scale B A (PEFT's
 * merge_and_unload), and zeroes B so the model computes the same. m: one
 * process's whole model. */
void lora_merge(lm_model *m);

#endif
