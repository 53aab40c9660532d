/* model/lm.h: the decoder-only language model: config, parameters, forward, backward.
 *
 * Two specs meet here and nowhere else: a native flavor table
 * (`model.spec = "qwen3"`, `model.flavor`) and a Hugging Face config.json
 * (`model.spec = "hf"`). Both produce a lm_config; everything after that
 * is the same code.
 *
 * Parameters live in ONE flat fp32 buffer ordered by layer (embedding, layer
 * 0 .. L-1, final norm, lm_head), with the same layout for gradients and the
 * optimizer moments. Each tensor is named by its HF key, so checkpoint I/O
 * is a loop over the tensor table. Activations are planned once for
 * B x T and reused every step. Forward and backward are plain calls to the
 * ops of kernels/ops.h in llm.c style: no autograd; parameters, gradients,
 * moments and activations are allocated once (kernels and the gradient norm
 * take small per-call scratch). */
#ifndef CT_MODEL_LM_H
#define CT_MODEL_LM_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "kernels/registry.h"
#include "model/moe.h"
#include "model/rope.h"

#define LM_MAX_MLP_ONLY 256
#define LM_MAX_LAYERS 1024
/* Parameters (or activation floats of one micro-batch) a model may plan: sizes are
 * summed in size_t and allocated at 4 bytes or more each, so a config.json or batch
 * whose product nears 2^64 must be refused before it wraps; 2^50 (4 PiB of fp32) is
 * far beyond any machine and far below the wrap. */
#define LM_MAX_PARAMS 1125899906842624.0

/* The family descriptor's choices (issue 15). The zero of each is Qwen3's,
 * so a config built field by field (tests, flavors) stays a Qwen3 model. */
enum { LM_NORM_PRE = 0,      /* input_layernorm before attention, post_attention_layernorm before the MLP */
       LM_NORM_POST = 1,     /* OLMo2: norms on the attention and MLP outputs, before the residual add */
       LM_NORM_SANDWICH = 2  /* Gemma3: both, four norms a layer */ };
enum { LM_QK_HEAD = 0,       /* q_norm/k_norm over each head's hd (Qwen3, Gemma3) */
       LM_QK_NONE = 1,       /* none (Llama, Mistral, Qwen2, Mixtral, Phi3) */
       LM_QK_PROJ = 2        /* over the whole projection, nH*hd and nKV*hd (OLMo2) */ };
enum { LM_ACT_SILU = 0, LM_ACT_GELU_TANH = 1 /* gelu_pytorch_tanh */ };
enum { LM_MOE_KEYS_QWEN = 0, /* mlp.gate, mlp.experts.N.{gate,up,down}_proj */
       LM_MOE_KEYS_MIXTRAL = 1, /* block_sparse_moe.gate, block_sparse_moe.experts.N.{w1,w3,w2} */
       /* GraniteMoE: block_sparse_moe.router.layer; the files fuse every expert into
        * block_sparse_moe.input_linear [E, 2 Im, H] (each expert's gate rows, then its up
        * rows) and output_linear [E, H, Im], which the table holds per expert as
        * block_sparse_moe.experts.N.{gate,up,down}_proj (checkpoint/hf.c maps them) */
       LM_MOE_KEYS_GRANITE = 2 };

/* The projections LoRA can adapt, in the tensor table's order within a layer. */
enum { LM_LORA_Q, LM_LORA_K, LM_LORA_V, LM_LORA_O, LM_LORA_GATE, LM_LORA_UP, LM_LORA_DOWN,
       LM_LORA_SHGATE /* a sparse layer's mlp.shared_expert_gate [1, H] (qwen2_moe; PEFT's all-linear) */,
       LM_LORA_N };
/* The fused expert parameters LoRA can adapt (target_parameters), in table order. */
enum { LM_LORA_EXP_GU, LM_LORA_EXP_D, LM_LORA_EXP_N };
/* The MoE router's weight (PEFT's target_parameters gate.weight), a 2-D
 * parameter adapted as the experts are (one "expert"): after them. */
enum { LM_LORA_EXP_R = LM_LORA_EXP_N, LM_LORA_PARAM_N };
/* lm_config.lora_lp: no adapter on that projection of that layer */
#define LM_LORA_LP_OFF 255
/* distinct (rank, alpha) pairs a rank_pattern / alpha_pattern may give */
#define LM_LORA_MAX_KINDS 64

typedef struct {
    int vocab_size;    /* V */
    int hidden;        /* H */
    int intermediate;  /* I */
    int n_layers;      /* L */
    int n_heads;       /* nH */
    int n_kv_heads;    /* nKV */
    int head_dim;      /* hd (NOT H / nH in general) */
    int max_pos;       /* max_position_embeddings, written back to config.json */
    int tie_embeddings;
    double rope_theta;
    double rms_eps;
    char name[64];     /* flavor name, or "hf" */
    /* ---- the family descriptor: what a layer computes and how its files
     * name it. Read from config.json by lm_config_from_hf (model/lm_config.c
     * holds the family table); native flavors are Qwen3 presets. */
    char model_type[32];   /* config.json's model_type; "" is "qwen3" (or "qwen3_moe" with experts) */
    int norm_place;        /* LM_NORM_* */
    int norm_plus_one;     /* RMSNorms scale by (1 + w) (Gemma) */
    int qk_norm;           /* LM_QK_* */
    int qkv_bias, o_bias, mlp_bias; /* q/k/v_proj, o_proj, gate/up/down_proj have biases */
    int act;               /* LM_ACT_*: the gated MLP's activation */
    int fused_qkv;         /* the files hold self_attn.qkv_proj [(nH + 2 nKV) hd, H] (Phi3) */
    int fused_gate_up;     /* the files hold mlp.gate_up_proj [2 I, H], gate rows first (Phi3) */
    int moe_keys;          /* LM_MOE_KEYS_* */
    int embed_scaled;      /* the embedding output is multiplied by sqrt(H) (Gemma) */
    double attn_scale;     /* scores scale; 0: head_dim^-0.5 */
    double attn_softcap;   /* > 0: scores = cap tanh(scores / cap) */
    double attn_softcap_unused; /* Gemma3's attn_logit_softcapping, which transformers reads and never
                                   applies: only written back to config.json */
    double final_softcap;  /* > 0: logits = cap tanh(logits / cap) */
    /* Granite's scalars (0: the family has none, as 1 would be) */
    double embed_mult;     /* embedding_multiplier: the embedding output times it */
    double residual_mult;  /* residual_multiplier: each branch's output times it before the residual add */
    double logits_div;     /* logits_scaling: the logits divided by it (before the loss and generation) */
    int sliding_window;    /* keys a sliding layer's query sees, itself included */
    unsigned char layer_sliding[LM_MAX_LAYERS]; /* 1: layer l uses the window and the local RoPE */
    unsigned char layer_nope[LM_MAX_LAYERS];    /* 1: layer l applies no RoPE (SmolLM3's NoPE layers) */
    int has_rope;          /* rope / rope_local hold config.json's resolved RoPE (model/rope.h);
                              0: default RoPE with rope_theta (flavors, configs built field by field) */
    rope_params rope;      /* full-attention layers */
    rope_params rope_local; /* sliding layers (Gemma3's own base; a copy of rope elsewhere) */
    int rope_interleaved;  /* RoPE rotates the pairs (2i, 2i+1) of the rotary part, not its halves (GLM) */
    int qk_norm_after_rope; /* LM_QK_HEAD applied to the rotated q and k (HunYuan: query_layernorm /
                               key_layernorm), not before RoPE (Qwen3) */
    /* Ministral 3 (Llama 4's attention scaling): q after RoPE times
     * 1 + q_scale_beta * log(1 + floor(pos / q_scale_len)); q_scale_len 0: off */
    double q_scale_beta;
    int q_scale_len;
    int has_pad, pad_token; /* pad_token_id: nn.Embedding's padding_idx, whose row gets no gradient
                               from the lookup (OLMo2, Phi3 and Gemma3 set one by default) */
    /* Mixture of experts (HF model_type qwen3_moe; model/moe.h). n_experts == 0:
     * the dense model. A layer l is sparse when it is not in mlp_only_layers and
     * (l + 1) % decoder_sparse_step == 0, as Qwen3MoeDecoderLayer decides; the
     * other layers keep the dense MLP of size `intermediate`. */
    int n_experts;            /* E: num_experts */
    int top_k;                /* k: num_experts_per_tok */
    int moe_intermediate;     /* Im: moe_intermediate_size */
    int norm_topk_prob;       /* renormalise the k chosen probabilities to sum 1 */
    int decoder_sparse_step;  /* >= 1 */
    int n_mlp_only;           /* entries of mlp_only_layers */
    int mlp_only_layers[LM_MAX_MLP_ONLY];
    int moe_layer_start, moe_layer_end; /* ernie4_5_moe's moe_layer_{start,end}_index (the export's keys;
                                           the rule itself is in mlp_only_layers) */
    /* GLM-4.5's router (glm4_moe, Glm4MoeTopkRouter; zeros elsewhere): sigmoid scores, not a
     * softmax; the choice limited to the experts of the topk_group of n_group equal groups whose
     * two best biased scores sum highest; the chosen weights times routed_scaling (0: 1) */
    int router_sigmoid;
    int n_group, topk_group;  /* 0 or 1, 1: no groups */
    double routed_scaling;    /* routed_scaling_factor */
    double moe_norm_min;      /* ernie4_5_moe's moe_norm_min: the renormalising sum clamped to at least
                                 this (0 elsewhere: divided by the sum itself) */
    int first_k_dense;        /* first_k_dense_replace (the export's key; the rule is in mlp_only_layers) */
    int mtp_layers;           /* num_nextn_predict_layers: the files' layers n_layers .. n_layers + this - 1
                                 are GLM-4.5's multi-token-prediction modules, skipped on load as
                                 transformers skips them (not built, not exported) */
    int output_router_logits; /* add router_aux_loss_coef * HF's load-balancing loss to the loss */
    double router_aux_loss_coef;
    /* qwen2_moe's shared expert (shared_expert_intermediate_size; 0: none): every
     * sparse layer also runs a dense gated MLP this wide on every token, its
     * output times sigmoid(shared_expert_gate(x)) added to the experts' */
    int shared_intermediate;
    /* Vocabulary-parallel embedding and lm_head (distributed/tp.c; tied or not):
     * this model holds rows [vocab_row0, vocab_row0 + vocab_rows) of each. The
     * lookup gives other rows' tokens zeros and sums over ranks by hooks; the
     * head computes only those logits, the loss's max, sum of exponentials and
     * target logit being combined over ranks by hooks. Rows come in DTensor
     * Shard(0)'s ceil chunks, so a rank may hold none: under TP (tp_degree > 1)
     * vocab_rows == 0 is that empty block; without TP it means the whole
     * vocabulary. */
    int vocab_rows, vocab_row0;
    /* Tensor-parallel degree this local config's heads were divided by
     * (distributed/tp.c; 0 or 1: whole). A q/k norm over the whole projection
     * (LM_QK_PROJ) then spans tp_degree ranks: its row sums go through hooks.
     * tp_rank: this slice's index, which places a row-parallel input's
     * columns in the whole tensor (LoRA dropout masks of o_proj, down_proj). */
    int tp_degree, tp_rank;
    /* Sequence parallel under tensor parallel (distributed/tp.h): the residual
     * stream, the norms and what they keep hold rows [tp_rank R, (tp_rank + 1) R)
     * of the B x T rows only (R = ceil(B T / tp_degree), the last ranks' rows
     * fewer or none, their buffers R rows; lm_model.sp runs the collectives).
     * 0: every rank holds all rows. */
    int tp_seq;
    /* Expert parallel storage (distributed/ep.h): this model holds experts
     * [expert0, expert0 + expert_rows) of every MoE layer; the others' tensors
     * keep their names in the table with no elements, so tables of every
     * rank line up by index. The router stays whole. 0: every expert. */
    int expert_rows, expert0;
    /* Pipeline stage (distributed/pp.h): this model holds and runs only the
     * layers with layer_held[l] set, the embedding where it holds layer 0
     * (or, tied, the last layer: the lm_head), and the final norm and
     * lm_head where it holds the last layer. The others' tensors keep their
     * names in the table with no elements, as expert parallel does, so every
     * stage's table lines up by index with the whole model's. 0: every layer. */
    int pp_stage;
    unsigned char layer_held[LM_MAX_LAYERS];
    /* LoRA adapters (model/lora.h; PEFT's LoraLayer): the linears whose bit
     * is set in lora_targets (1 << LM_LORA_*) get y += scale B(A(drop(x))).
     * lora_rank 0: none. Not written to config.json. */
    int lora_rank;
    unsigned lora_targets;
    float lora_scale;   /* alpha / r, or alpha / sqrt(r) (use_rslora) */
    float lora_dropout; /* probability; training forwards only */
    /* Per (layer, projection) exceptions to lora_rank, lora_scale and
     * lora_targets: PEFT's rank_pattern / alpha_pattern, and target_modules
     * naming single modules (PEFT saves "all-linear" of a small model as
     * every module's full name). lora_lp[l][p]: 0 lora_rank and lora_scale,
     * LM_LORA_LP_OFF no adapter, k lora_kind[k - 1]. All zero (the default)
     * is every layer alike. Read through lm_lora_on / _rank / _scale. */
    unsigned char lora_lp[LM_MAX_LAYERS][LM_LORA_N];
    int n_lora_kinds;
    struct {
        int rank;
        float scale;
        double alpha; /* for adapter_config.json's alpha_pattern */
    } lora_kind[LM_LORA_MAX_KINDS];
    /* PEFT's target_parameters on a MoE layer's fused experts (ParamWrapper):
     * bit 1 << LM_LORA_EXP_* of lora_experts[l] adapts layer l's
     * mlp.experts.gate_up_proj [E, 2 Im, H] / down_proj [E, H, Im] with
     * A [r E, in] and B [out, r E] (lora.h: lora_experts_delta; E the held
     * experts under expert parallel, distributed/tp.h); bit LM_LORA_EXP_R
     * its router mlp.gate.weight [E, H], A [r, H], B [E, r]. */
    unsigned char lora_experts[LM_MAX_LAYERS];
    /* Per expert parameter (LM_LORA_EXP_*), PEFT's rank_pattern /
     * alpha_pattern: its rewrite of target_modules gate_proj + up_proj on a
     * MoE model gives gate_up_proj rank 2 r and alpha 2 alpha. 0: lora_rank
     * and lora_scale apply (read through lm_lora_exp_rank / _scale). */
    int lora_exp_rank[LM_LORA_PARAM_N];
    float lora_exp_scale[LM_LORA_PARAM_N];
    double lora_exp_alpha[LM_LORA_PARAM_N]; /* the pattern's alpha, for adapter_config.json */
    /* params and grads are addressed over the whole model but get pages only
     * where written (ct_alloc_lazy): runs with frozen tensors, whose
     * gradients are never written and whose weights may live in bf16 */
    int lazy_buffers;
    /* Rows of logits the fused lm_head + loss holds at once
     * (training.logits_chunk_rows); 0: lm_logit_rows picks. */
    int logit_rows;
} lm_config;

/* Whether layer l has adapters on projection p. */
int lm_lora_on(const lm_config *c, int l, int p);
/* The rank and scale of layer l's adapter on projection p (lora_lp). */
int lm_lora_rank(const lm_config *c, int l, int p);
float lm_lora_scale(const lm_config *c, int l, int p);
/* Whether layer l (a MoE layer) has adapters on its fused experts p (LM_LORA_EXP_*). */
int lm_lora_expert_on(const lm_config *c, int l, int p);
/* Floats of the two transient buffers expert LoRA keeps (lm.c:
 * experts_adapted and experts_adapted_dw, 3 E Im H each: the adapted experts
 * and their weight gradient) when a layer c holds has expert adapters, else 0. */
size_t lm_expert_lora_scratch_floats(const lm_config *c);
/* The rank and scale of expert parameter p's adapters (lora_exp_rank). */
int lm_lora_exp_rank(const lm_config *c, int p);
float lm_lora_exp_scale(const lm_config *c, int p);

/* The RoPE of full (sliding = 0) or sliding layers: config.json's, or for a
 * flavor default RoPE with rope_theta. */
rope_params lm_rope_params(const lm_config *c, int sliding);
/* RoPE cos/sin tables [T, lm_rotary_dim/2] of full (sliding = 0) or sliding layers for
 * a forward over positions 0 .. seq_len-1, rows p0 .. p0+T-1 (T <= seq_len - p0),
 * as transformers' rotary embedding computes them for that forward
 * (dynamic and longrope depend on seq_len). */
void lm_rope_tables(const lm_config *c, int sliding, int seq_len, int p0, int T, float *cos, float *sin);
/* q's tables of positions p0 .. p0+T-1 from the plain ones: each row times
 * Ministral 3's scale of its position (q_scale_len > 0 only). RoPE is linear,
 * so rotating by them gives s(pos) R(pos) q, and rope_bwd by them its gradient. */
void lm_rope_q_tables(const lm_config *c, int p0, int T, const float *cos, const float *sin, float *qcos,
                      float *qsin);
/* The features of each head RoPE rotates (int(head_dim * partial_rotary_factor),
 * Phi3 only; the rest pass through): the width of the cos/sin tables is half of it. */
int lm_rotary_dim(const lm_config *c);
/* Whether sliding layers have RoPE tables of their own. */
int lm_rope_local_differs(const lm_config *c);

/* What a pipeline stage holds (every piece when !c->pp_stage). */
int lm_holds_layer(const lm_config *c, int l);
int lm_holds_embed(const lm_config *c);
int lm_holds_head(const lm_config *c); /* the final norm and lm_head */

/* Whether layer l has the sparse MoE block (0 for every layer of a dense model). */
int lm_layer_is_moe(const lm_config *c, int l);

/* Native flavors: debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B and the MoE
 * debugmodel_moe, 30B-A3B, 235B-A22B. Unknown flavor:
 * CT_ERR_CONFIG listing the known ones. */
int lm_config_from_flavor(lm_config *c, const char *flavor, ct_err *e);
/* Reads DIR/config.json (model_type "qwen3" or "qwen3_moe"; for qwen3_moe an
 * absent head_dim is hidden_size / num_attention_heads, as transformers'
 * Qwen3MoeAttention takes it). Missing required fields, wrong
 * types, or unsupported features (attention bias, sliding window, rope
 * scaling) are errors naming the file and the key. */
int lm_config_from_hf(lm_config *c, const char *dir, ct_err *e);
/* Writes an HF config.json that transformers loads as Qwen3ForCausalLM
 * (Qwen3MoeForCausalLM when n_experts > 0). */
int lm_config_write_hf(const lm_config *c, const char *path, const char *dtype_name, ct_err *e);
/* The text lm_config_write_hf writes (malloc'd; free it; NULL when out of
 * memory): also the model's fingerprint, which the ranks of a run compare. */
char *lm_config_hf_json(const lm_config *c, const char *dtype_name);
/* The positions the model was trained for (max_position_embeddings, extended by
 * a RoPE scaling factor); 0 when it has no such limit (dynamic NTK). */
double lm_position_limit(const lm_config *c);
/* Checks a config for sizes the model cannot run (e.g. nH % nKV != 0). */
int lm_config_check(const lm_config *c, const char *where, ct_err *e);

#define LM_NAME_MAX 96

/* What a tensor is to the model (bind_weights points the views by it). */
enum { LM_S_EMBED, LM_S_LN_IN, LM_S_WQ, LM_S_WK, LM_S_WV, LM_S_WQKV, LM_S_BQ, LM_S_BK, LM_S_BV, LM_S_WO, LM_S_BO,
       LM_S_QN, LM_S_KN, LM_S_LN_ATTN_OUT, LM_S_LN_PRE_MLP, LM_S_WG, LM_S_WU, LM_S_WGU, LM_S_WD, LM_S_BG, LM_S_BU,
       LM_S_BD, LM_S_ROUTER, LM_S_EXP_G, LM_S_EXP_U, LM_S_EXP_D, LM_S_LN_MLP_OUT, LM_S_LORA_A, LM_S_LORA_B, LM_S_LNF,
       LM_S_HEAD, LM_S_LORA_EA, LM_S_LORA_EB /* an expert adapter (lm_tensor.expert: its LM_LORA_EXP_*) */,
       LM_S_SHARED_GATE /* [1, H] a sparse layer's mlp.shared_expert_gate (its shared expert: LM_S_WG, _WU, _WD) */,
       LM_S_HEAD_LA, LM_S_HEAD_LB /* lm_head's adapter (model/lora.h LORA_HEAD): A [r, H], B [vocab rows, r] */,
       LM_S_EMB_LA, LM_S_EMB_LB /* embed_tokens' adapter (LORA_EMBED): lora_embedding_A [r, V], _B [H, r] */ };

typedef struct {
    char name[LM_NAME_MAX]; /* HF key */
    int slot;                  /* LM_S_* */
    int layer;                 /* -1 outside the layers */
    int expert;                /* expert index of an LM_S_EXP_* tensor; the projection of a LoRA one; else -1 */
    int ndim;
    int64_t shape[2];
    size_t offset;             /* in floats, into the flat buffers */
    size_t numel;
    int is_matrix;             /* init with normal(0, 0.02) rather than ones */
    int lora;                  /* a LoRA adapter (lora_A / lora_B): not in HF model files, no random init */
    int frozen;                /* no gradient, no optimizer update (lm_bind_frozen) */
    size_t store;              /* frozen bf16 storage: offset into m->fstore, or LM_NO_STORE (fp32 in params) */
} lm_tensor;
#define LM_NO_STORE ((size_t)-1)

/* The name of the HF file tensor that holds t as one piece of it (GraniteMoE's
 * block_sparse_moe.input_linear / output_linear, GraniteMoeShared's
 * shared_mlp.input_linear) into name[n]: 1, or 0 for a tensor the files hold
 * under its own name. checkpoint/hf.c places the piece; training.freeze
 * matches either name. */
int lm_fused_file_name(const lm_config *c, const lm_tensor *t, char *name, size_t n);
/* ERNIE 4.5 MoE and the sigmoid routers' families (router_sigmoid: glm4_moe, dots1): a sparse
 * layer's shared experts are one ungated MLP under mlp.shared_experts. */
int lm_shared_experts_ungated(const lm_config *c);
/* The router of c's sparse layers (model/moe.h): softmax or GLM-4.5's sigmoid, its groups and scale. */
moe_router_opt lm_router_opt(const lm_config *c);
/* The HF name of layer l's router selection bias (ERNIE 4.5 MoE's
 * mlp.moe_statics.e_score_correction_bias [1, E], a frozen buffer; GLM-4.5's and
 * dots.llm1's mlp.gate.e_score_correction_bias [E]) into name[n]: the file tensor's rank (2 or 1), or 0
 * where the layer's files hold none. The loader puts it in lm_moe_state.bias (selection
 * only, as transformers routes), the HF writers write it back from there. */
int lm_router_bias_name(const lm_config *c, int l, char *name, size_t n);
/* The name transformers' named_parameters() gives the parameter t is (part of) where it
 * differs from the file's: the fused experts (mlp.experts.gate_up_proj, down_proj; GraniteMoE
 * under block_sparse_moe) and the routers Mixtral and GraniteMoE keep under another path.
 * 1 and the name in name[n], or 0. */
int lm_module_param_name(const lm_config *c, const lm_tensor *t, char *name, size_t n);

/* Pointers to one layer's tensors inside a flat buffer (params or grads). */
typedef struct {
    float *ln1;   /* [H] input_layernorm (NULL: LM_NORM_POST) */
    float *wq;    /* [nH*hd, H] (Phi3: rows of qkv_proj) */
    float *wk;    /* [nKV*hd, H] */
    float *wv;    /* [nKV*hd, H] */
    float *bq, *bk, *bv; /* [nH*hd], [nKV*hd], [nKV*hd] biases (NULL: none) */
    float *wo;    /* [H, nH*hd] */
    float *bo;    /* [H] (NULL: none) */
    float *qn;    /* [hd] q_norm ([nH*hd] under LM_QK_PROJ; NULL: LM_QK_NONE) */
    float *kn;    /* [hd] k_norm ([nKV*hd]) */
    float *ln_ao; /* [H] the norm of the attention output (OLMo2, Gemma3: post_attention_layernorm) */
    float *ln2;   /* [H] the norm before the MLP (post_attention_layernorm; Gemma3 pre_feedforward_layernorm) */
    float *wg;    /* [I, H] gate_proj (Phi3: rows of gate_up_proj) */
    float *wu;    /* [I, H] up_proj */
    float *wd;    /* [H, I] down_proj */
    float *bg, *bu, *bd; /* [I], [I], [H] (NULL: none) */
    float *ln_mo; /* [H] the norm of the MLP output (post_feedforward_layernorm) */
    /* MoE layers instead of wg, wu, wd (NULL otherwise): */
    float *router; /* [E, H] mlp.gate */
    float *ewg;    /* [E, Im, H] mlp.experts.{0..E-1}.gate_proj, stacked (E: expert_rows if set) */
    float *ewu;    /* [E, Im, H] up_proj */
    float *ewd;    /* [E, H, Im] down_proj */
    /* a MoE layer's shared expert (qwen2_moe) is wg, wu, wd [Is, H], [Is, H], [H, Is]; its gate: */
    float *shgate; /* [1, H] mlp.shared_expert_gate (NULL: no shared expert) */
    /* LoRA (NULL where a projection has none): A [r, in], B [out, r] per LM_LORA_* */
    float *lora_a[LM_LORA_N], *lora_b[LM_LORA_N];
    /* expert LoRA (NULL where none): A [r E, in], B [out, r E] per LM_LORA_EXP_* */
    float *lora_ea[LM_LORA_PARAM_N], *lora_eb[LM_LORA_PARAM_N]; /* [LM_LORA_EXP_R]: the router's */
} lm_layer_w;

typedef struct {
    float *wte;        /* [V, H] */
    lm_layer_w *layer; /* [L] */
    float *lnf;        /* [H] */
    float *lm_head;    /* [V, H]; == wte when tied */
    float *head_a, *head_b; /* lm_head's LoRA A [r, H], B [V, r] (NULL: none; tied or not, never the embedding's) */
    float *emb_a, *emb_b;   /* embed_tokens' LoRA A [r, V], B [H, r] (NULL: none; the lookup only, never lm_head) */
} lm_weights;

/* Activation checkpointing ([activation_checkpoint]): what one layer keeps
 * between its forward and its backward. Recomputation reruns the same
 * deterministic kernels on the same inputs, so gradients are bit-identical
 * to LM_AC_NONE. */
enum {
    LM_AC_NONE = 0, /* everything the backward reads */
    LM_AC_FULL = 1, /* only the input residual `res`; the layer's forward reruns before its backward */
    LM_AC_OP = 2,   /* res and the matmul/attention outputs (q, k, v, lse, att, res_mid, gate, up; a
                          shared expert's sgate, sup, so and its gate sg); the norms, RoPE and SwiGLU
                          rerun (ln1, qr, kr, ln2, h, sh and the rstds) */
};

/* Activations saved by forward for backward, one set per layer. Under
 * checkpointing, the pointers of what a layer does not keep point into the
 * model's one shared checkpointing scratch set (act.scratch) instead. */
typedef struct {
    int ac;          /* LM_AC_* of this layer */
    float *res;      /* [BT, H]   residual stream entering the layer */
    float *ln1;      /* [BT, H]   */
    float *ln1_rstd; /* [BT]      */
    float *q;        /* [BT, nH*hd] q_proj output, before q_norm */
    float *q_rstd;   /* [BT*nH]   */
    float *qr;       /* [BT, nH*hd] after q_norm and RoPE */
    float *k;        /* [BT, nKV*hd] */
    float *k_rstd;   /* [BT*nKV]  */
    float *kr;       /* [BT, nKV*hd] */
    float *v;        /* [BT, nKV*hd] */
    float *lse;      /* [B, nH, T]  log-sum-exp of each score row (backward recomputes probs) */
    float *att;      /* [BT, nH*hd] attention output, o_proj input */
    float *ao;       /* [BT, H]   o_proj output before its norm (LM_NORM_POST/SANDWICH; else NULL) */
    float *ao_rstd;  /* [BT]      */
    float *res_mid;  /* [BT, H]   residual after attention */
    float *ln2;      /* [BT, H]   */
    float *ln2_rstd; /* [BT]      */
    float *gate;     /* [BT, I]   */
    float *up;       /* [BT, I]   */
    float *h;        /* [BT, I]   act(gate) * up */
    float *mo;       /* [BT, H]   down_proj output before its norm (LM_NORM_POST/SANDWICH; else NULL) */
    float *mo_rstd;  /* [BT]      */
    /* MoE layers: gate, up, h are [BT*k, Im] in expert order, and the routing: */
    int moe;         /* 1: this layer is sparse */
    moe_route route; /* kept under LM_AC_NONE and _OP; rerun under _FULL */
    /* a MoE layer's shared expert (cfg.shared_intermediate = Is; NULL otherwise): */
    float *sgate;    /* [BT, Is]  its gate_proj output */
    float *sup;      /* [BT, Is]  up_proj */
    float *sh;       /* [BT, Is]  act(sgate) * sup */
    float *so;       /* [BT, H]   down_proj output, before the gate */
    float *sg;       /* [BT]      sigmoid(shared_expert_gate(ln2)) */
    float *lora_u[LM_LORA_N]; /* [BT, r] scale * A drop(x) per adapted projection; always kept (small) */
} lm_layer_acts;

/* The activation plan: what a forward saves for its backward, planned once
 * for at most B x T. Owner: the model's forward/backward; a pipeline stage
 * points layer[l0 .. l1) and the final norm's buffers at the bank of the
 * micro-batch in flight (lm_bank_use). */
typedef struct {
    int B, T;               /* the planned batch */
    float *mem;             /* the arena: every saved activation and the workspace */
    size_t floats;
    lm_layer_acts *layer;   /* [L] each layer's saved activations */
    int *pol;               /* [L] LM_AC_* of each layer */
    lm_layer_acts scratch;  /* shared by checkpointed layers (res unused); NULLs if none */
    int scratch_layer;      /* layer whose activations scratch holds now; -1: none */
    const void *bank;       /* the lm_bank in use (a pipeline stage's micro-batch); NULL: this plan's own */
    float *res_out;         /* [BT, H] residual after the last layer */
    float *lnf;             /* [BT, H] */
    float *lnf_rstd;        /* [BT] */
    const int32_t *tokens;  /* of the last forward, for the embedding backward */
    int fwd_B, fwd_T;
} lm_act_plan;

/* The per-step workspace: what one range of layers uses while it runs and
 * leaves for the next (no micro-batch keeps anything here). Carved from
 * the activation arena with the plan; owner: the model's forward/backward. */
typedef struct {
    float *rope_cos, *rope_sin; /* [T, hd/2] */
    float *rope_cos_l, *rope_sin_l; /* [T, hd/2] the sliding layers' (== rope_cos/sin when they share) */
    float *rope_cos_q, *rope_sin_q; /* [T, hd/2] q's, times its position scale (== rope_cos/sin without one) */
    int rope_T;             /* the forward length the tables were built for (lm_rope_by_length) */
    float *norm_w;          /* [max(H, nH*hd)] 1 + w of a Gemma norm while a kernel reads it */
    float *cap_t;           /* [logit_rows, V] tanh(logits / final_softcap) of the block in flight */
    float *branch;          /* [BS, H] Granite: the attention or MLP output in flight, before it is scaled
                               and added (read once, in the forward: every layer's ao and mo) */
    int logit_rows;         /* rows of logits materialised at once (lm_logit_rows) */
    float *logits;          /* [logit_rows, V] (V: vocab_rows when vocabulary-parallel) */
    float *ce_stats;        /* [3, logit_rows] vocabulary-parallel loss: row max, sum of exp, target logit */
    int32_t *embed_ids;     /* [BT] vocabulary-parallel embedding backward: its tokens' local rows */
    /* backward scratch */
    float *d_res, *d_ln, *d_att, *d_q, *d_q2, *d_k, *d_k2, *d_v, *d_h, *d_gate, *d_up; /* see lm.c */
    /* sequence parallel (cfg.tp_seq): [t C, H] (C = ceil(BT / t)) the gathered chunks of a norm's
     * output (sp_x) and of a d(output) (sp_dy); [k, H] a layer's k norm weights' partial gradients
     * before they are summed over the group (lm_norm_partials) */
    float *sp_x, *sp_dy, *sp_dw;
    /* MoE layers (NULL for a dense model) */
    float *moe_work;        /* [KERN_MOE_WORK(BT*k, H, Im)] experts kernel scratch */
    float *moe_dtopw;       /* [BT*k] */
    float *moe_dprobs;      /* [BT, E] */
    float *moe_dprob_all;   /* [E] d(aux term)/d probs, the same for every layer and token */
    float *d_so;            /* [BT, H] d of the shared expert's output before its gate (qwen2_moe) */
    float *d_moe;           /* [BT, H] d(sparse branch): rm x d(res) (GraniteMoE), through its norm (FlexOlmo) */
    float *d_sg;            /* [BT] d of the shared expert gate's logit */
    /* LoRA (cfg.lora_rank > 0) */
    float *lora_du;         /* [BT, r] d of an adapter's A output */
    float *lora_x, *lora_dx; /* [BT, max in] drop(x) and its gradient; only with dropout */
    float *lora_ew, *lora_dew; /* [3 E Im H] each: a layer's adapted expert weights W + scale B A and their
                                  gradient, with expert LoRA (allocated at first use) */
    float *lora_rw, *lora_drw; /* [E H] each: a router adapter's W + scale B A and its gradient (first use) */
    float *head_u, *head_du; /* [logit rows, r] lm_head's adapter: scale A drop(x) and d of it */
    float *head_da;          /* [r, H] its dA of one backward, summed over the vocabulary-parallel group */
    float *emb_du;           /* [rows, r] embed_tokens' adapter: d of each row's A[:, id] (first use) */
    int emb_du_rows;         /* the rows emb_du holds */
    float *head_tmp; /* a bf16-stored lm_head: [<= 16, block] logits of one block of its rows for a
                        forward of few rows (allocated at first use) */
} lm_work;

/* MoE routing state (0 / NULL for a dense model): what the last forward's
 * routing measured and what the next one routes by. Owner: the model's MoE
 * layers; the trainer reads the statistics and moves the bias. */
typedef struct {
    int n_layers;           /* MoE layers of the whole model (every pipeline stage's) */
    double *count, *psum;   /* [E] load-balancing sums of the last forward */
    int *load_min, *load_max; /* [L] tokens on the least / most loaded expert (-1: dense layer) */
    double aux_loss;        /* HF's load_balancing_loss_func of the last forward (0 if dense) */
    /* torchtitan's aux-loss-free balancing (model.load_balance_coeff > 0): experts
     * are CHOSEN by probs + bias, weighted by the probs alone; the trainer
     * moves the bias after each step (moe_update_bias) and checkpoints it */
    float *bias;            /* [L, E] zeros: HF's routing; ERNIE 4.5 MoE: the files' frozen
                               e_score_correction_bias (lm_router_bias_name) */
    double *tokens;         /* [L, E] tokens per expert since the last update (training forwards) */
    int count_tokens;       /* set by forward_backward around its forward */
    float aux_scale;        /* weight of router_aux_loss_coef * aux in the gradient (1 per optimizer
                               step: a trainer with n micro-batches sets 1/n; under a pipeline
                               the unit is its micro-batch); used when cfg.output_router_logits */
} lm_moe_state;

/* Calls around each layer for layouts that move parameters (FSDP gathers a
 * layer's parameters before it runs and frees them after; distributed/fsdp.c). The
 * model stays unaware of ranks: it only says when a layer starts and ends. */
typedef struct {
    void *ctx;
    void (*pre_forward)(void *ctx, int layer);
    void (*post_forward)(void *ctx, int layer);
    void (*pre_backward)(void *ctx, int layer);  /* before its recomputation and backward */
    void (*post_backward)(void *ctx, int layer); /* its gradients are complete */
    /* Tensor parallel (distributed/tp.c; NULL otherwise): x[n] is a partial sum over
     * this rank's heads or intermediate slice; make it the sum over ranks.
     * Called on the o_proj and down_proj outputs before the residual is added,
     * and on d(ln1), d(ln2) after the q/k/v and gate/up backward matmuls. */
    void (*reduce_partial)(void *ctx, float *x, size_t n);
    /* x[n] = the elementwise max over ranks (vocabulary-parallel loss). */
    void (*reduce_max)(void *ctx, float *x, size_t n);
} lm_hooks;

/* The held experts' weights a MoE layer runs on, each projection [held, ., .]:
 * the base experts, or their copy with the LoRA delta folded in (model/lora.h);
 * h[p] the bf16 store w[p] is read from (a frozen base stored in bf16), else NULL. */
typedef struct {
    const float *w[3]; /* gate, up, down */
    const uint16_t *h[3];
} lm_experts_w;

/* Expert parallel (distributed/ep.c; NULL otherwise): runs a MoE layer's experts
 * on the ranks that hold them. fwd adds sum_j topw_j expert_j(x) onto out
 * (NULL: keep the state only, for a recomputation), as the experts kernel
 * does; bwd accumulates dx and the held experts' gradients into dw[3] (gate,
 * up, down like ew; NULL: not wanted, a frozen projection) and overwrites
 * dtopw, as the kernel's backward. Every rank of the group must call them for
 * the same layers in the same order (collectives). */
typedef struct {
    void *ctx;
    void (*fwd)(void *ctx, int layer, float *out, const float *x, const moe_route *r, const lm_experts_w *ew,
                int N);
    void (*bwd)(void *ctx, int layer, float *dx, float *const dw[3], float *dtopw, const float *dout,
                const moe_route *r, const lm_experts_w *ew, int N);
} lm_moe_dispatch;

/* Context parallel (distributed/cp.c; NULL otherwise): each rank holds a chunk
 * of consecutive positions of every sequence. fwd and bwd take the place of
 * the attention kernels (ops.h's contract, on this rank's rows: q, k, v, out,
 * lse, dq, dk, dv are [B, T] of its chunk) and attend over the whole
 * sequence's keys up to each row: the other chunks' k and v travel, and bwd
 * sends d k, d v of their positions back to their owners. Every rank of the
 * group calls them for the same layers in the same order (collectives). */
typedef struct {
    void *ctx;
    void (*fwd)(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                int nh, int nkv, int hd, const kern_attn_opt *o);
    void (*bwd)(void *ctx, float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                const kern_attn_opt *o);
} lm_attn_dispatch;

/* Sequence parallel (distributed/tp.c; NULL otherwise, cfg.tp_seq set): the
 * t ranks of the tensor-parallel group hold consecutive blocks of the rows.
 * gather: full[t n] = every rank's local[n], in rank order; scatter:
 * local[n] = the sum over ranks of their full[t n]'s block `rank` (full may
 * hold it in place: local == full + rank n). */
typedef struct {
    void *ctx;
    int t, rank;
    void (*gather)(void *ctx, float *full, const float *local, size_t n);
    void (*scatter)(void *ctx, float *local, const float *full, size_t n);
} lm_seq_dispatch;

typedef struct {
    lm_config cfg;
    kern_ops k;             /* the kernels this model runs (reference until the run chooses) */
    const struct ct_device *dev; /* where params, grads and the activation arena live (core/device.h) */
    int n_tensors;
    lm_tensor *tensors;
    size_t n_params;        /* floats in the flat buffer */
    float *params;          /* [n_params] */
    float *grads;           /* [n_params] */
    lm_weights w, g;     /* views into params and grads */

    lm_act_plan act;        /* saved activations for at most B x T (a pipeline stage's: the bank in use) */
    lm_work ws;             /* the per-step workspace: scratch every range of layers reuses */
    lm_moe_state moe;       /* MoE routing state: the last forward's sums, the balancing bias */
    const lm_hooks *hooks; /* NULL: none; set by a parallel layout (distributed/fsdp.h) */
    struct lm_wstore *wdefer; /* NULL: a backward computes every gradient; else the input-gradient half of a
                               zero-bubble pipeline's split backward (lm_stage_backward_weight) */
    const lm_moe_dispatch *moe_ep; /* NULL: every expert runs here; set by distributed/ep.h */
    const lm_attn_dispatch *attn_cp; /* NULL: the whole sequence is here; set by distributed/cp.h */
    const lm_seq_dispatch *sp; /* NULL: every rank holds all rows; set by distributed/tp.h under cfg.tp_seq */
    float *sp_norm_dw[4];   /* sequence parallel: the gradients ws.sp_dw's pending blocks add into */
    int sp_norm_n;          /* how many blocks are pending */
    struct prof *prof;      /* NULL: not profiled; else spans of ops and layers (metrics/profile.h, the trainer's) */
    /* LoRA dropout (cfg.lora_rank > 0) */
    uint64_t lora_seed;     /* dropout masks: a hash of (this, layer, projection, element); the trainer
                               sets it per step from training.seed and the step alone */
    /* Row b of a training forward holds sequence lora_seq0 + b lora_seq_stride of the step's
     * global batch (stride 0 acts as 1): the element of a mask counts that sequence's rows,
     * so every data-parallel rank, micro-batch split and pipeline draws one process's masks */
    long lora_seq0;
    int lora_seq_stride;
    int lora_train;         /* set by forward_backward: dropout applies to training forwards only */
    /* Context parallel (distributed/cp.h): the model runs positions [cp_p0, cp_p0 + cp_Tl)
     * of sequences of cp_T, so its row t of sequence b is row b cp_T + cp_p0 + t of one
     * process's (LoRA dropout masks). cp_T 0: the whole sequence is here. cp_p1 > 0
     * (the headtail layout): rows cp_Tl/2 .. cp_Tl-1 are positions cp_p1 .. instead. */
    int cp_T, cp_Tl, cp_p0, cp_p1;
    /* bf16 mixed precision (the trainer sets it with kern_use_bf16_matmuls): the
     * attention takes bf16 q, k, v and d(out) (rounded in place, as autocast's
     * projections hand them over) and multiplies P and dS as bf16 (kern_attn_opt.bf16) */
    int attn_bf16;
    int n_frozen;           /* tensors with frozen set */
    /* training.frozen_dtype = "bfloat16": the frozen matrices live here and
     * the products read them from here (the kernels' wbf16 entries); their
     * fp32 pages in params stay untouched (lm_frozen_widen fills them for an
     * export) */
    uint16_t *fstore;       /* [n_store] */
    size_t n_store;
    /* floats the loaders convert or draw at once (lm_block_rows): LM_BLOCK_ELEMS,
     * which tests/c/checkpoint/test_load_rows.c lowers under emulation so that a small
     * embedding spans three blocks */
    size_t block_elems;
} lm_model;
#define LM_BLOCK_ELEMS ((size_t)4 << 20) /* 16 MiB of fp32 */

/* A pipeline stage keeps one micro-batch's saved activations of a layer
 * range [l0, l1) per forward in flight (1F1B keeps up to the number of
 * stages, GPipe every micro-batch): a bank. lm_bank_use points the model's
 * act.layer[l0 .. l1) (and, with the last layer, res_out and the final norm's
 * buffers) at the bank, so the forward and backward below run on that
 * micro-batch. A model with cfg.pp_stage plans no per-layer activations
 * of its own; everything else (checkpointing scratch, backward scratch,
 * logits) stays shared, since one range runs at a time. */
typedef struct {
    int l0, l1;
    const struct ct_device *dev; /* where mem lives */
    lm_layer_acts *acts;  /* [l1 - l0] */
    float *res_out, *lnf, *lnf_rstd; /* [BT, H], [BT, H], [BT] with the last layer; else NULL */
    float *mem;
    size_t floats;
} lm_bank;
size_t lm_bank_floats(const lm_model *m, int l0, int l1);
lm_bank *lm_bank_new(const lm_model *m, int l0, int l1);
void lm_bank_use(lm_model *m, const lm_bank *b);
void lm_bank_free(lm_bank *b);

/* Builds the tensor table, allocates params/grads and the activation plan for
 * B x T. Weights are NOT initialised. Kernels start as the references; a run
 * replaces m->k with its kern_select choice. No activation checkpointing. */
int lm_create(lm_model *m, const lm_config *c, int B, int T, ct_err *e);
/* The same with activation checkpointing, as torchtitan's [activation_checkpoint]:
 * ac_mode "none" | "full" | "selective" (NULL: "none"); for "selective",
 * ac_option "op" (LM_AC_OP on every layer) or a period N >= 1 as text
 * (LM_AC_FULL on layers N-1, 2N-1, ...: every N-th, as torchtitan counts).
 * Anything else is CT_ERR_CONFIG naming the key. */
int lm_create_ac(lm_model *m, const lm_config *c, int B, int T, const char *ac_mode,
                    const char *ac_option, ct_err *e);
/* Rows of logits the fused lm_head + loss holds at once for BT rows: c->logit_rows
 * (at most BT) when set, else as few equal blocks as keep one within 512 MiB of fp32
 * logits, never under min(BT, 256) rows. */
int lm_logit_rows(const lm_config *c, int BT);
/* Only the policy: the LM_AC_* of layer l (0 <= l < n_layers), or -1 with *e set. */
int lm_ac_layer(const char *ac_mode, const char *ac_option, int l, ct_err *e);
void lm_free(lm_model *m);
/* What lm_create_ac would allocate, without allocating it (--dry-run):
 * parameter count and bytes of the activation + workspace plan. */
int lm_plan_memory(const lm_config *c, int B, int T, const char *ac_mode, const char *ac_option,
                      size_t *n_params, size_t *act_bytes, ct_err *e);
/* Only the tensor table (m->tensors, m->n_params) of config c, nothing
 * allocated for a model to run: how another rank lays out its buffers.
 * lm_free releases it. */
int lm_layout(lm_model *m, const lm_config *c);
/* normal(0, 0.02) for matrices, 1 for norms (0 for Gemma's 1 + w norms), 0 for biases; deterministic from seed. */
void lm_init_random(lm_model *m, uint64_t seed);

/* Where a loader puts a whole model's tensors a block of rows at a time, so
 * that no one holds the whole model, nor a whole large tensor when it can
 * be avoided: a rank keeps its slice of each (distributed/tp.h, distributed/fsdp.h). put
 * gets rows [r0, r1) of tensor i of the loader's table (the whole model) as
 * rows[(r1 - r0) x cols] fp32, valid only during the call (cols: shape[1],
 * or 1 for a vector), with kind saying which buffer it belongs to. Every
 * tensor's rows come in order. */
enum { LM_PARAMS, LM_EXP_AVG, LM_EXP_AVG_SQ };
typedef struct {
    void (*put)(void *ctx, int kind, int i, size_t r0, size_t r1, const float *rows);
    void *ctx;
} lm_sink;
/* Rows a loader converting or generating values hands over at once: about
 * m->block_elems floats (at least one row). */
size_t lm_block_rows(const lm_model *m, const lm_tensor *t);
/* Floats per row: shape[1], or 1 for a vector. */
size_t lm_tensor_cols(const lm_tensor *t);
/* The sink that copies into m's params and the given moments (NULL: none)
 * at each tensor's offset; ctx must outlive its use. */
typedef struct {
    lm_model *m;
    float *dst[3];
} lm_copy_ctx;
lm_sink lm_copy_sink(lm_copy_ctx *ctx, lm_model *m, float *exp_avg, float *exp_avg_sq);
/* lm_init_random's values, tensor by tensor into s (table: any model
 * with the whole model's tensor table, e.g. from lm_layout). */
void lm_init_random_each(const lm_model *table, uint64_t seed, const lm_sink *s);
const lm_tensor *lm_find(const lm_model *m, const char *name);
/* After setting tensors[i].frozen: checks the choice and rebinds the
 * gradient views. A frozen tensor's gradient pointer is NULL, so the
 * backward skips its weight-gradient product and never touches its part of
 * m->grads. A MoE layer's experts of one projection freeze together (the
 * grouped kernels take them as one block): a mix is CT_ERR_CONFIG. */
int lm_bind_frozen(lm_model *m, ct_err *e);
/* The floats of tensors not frozen inside the flat range [a, b), as maximal
 * runs [x, y) handed to run(ctx, x, y) (run NULL: count only). Returns
 * their total. What AdamW steps, data parallel sums and the dry run counts. */
size_t lm_trained_runs(const lm_model *m, size_t a, size_t b, void (*run)(void *ctx, size_t x, size_t y),
                          void *ctx);
/* Moves every frozen matrix to bf16 storage (m->fstore; tensors[i].store):
 * call before the weights load, which then writes them rounded to bf16
 * (lm_put_rows). Every product reads them from the store (the matmul and
 * moe_experts ops' wbf16 entries, the dense linears, lm_head, MoE router and
 * experts alike). Returns the bf16 floats stored. */
size_t lm_store_frozen_bf16(lm_model *m);
/* The fp32 floats bf16 storage needs beside the store: a stored lm_head's
 * block of logits (nothing is widened whole any more; the GEMMs widen one
 * packed block per thread, workspace): for the dry run. m: a layout after
 * lm_store_frozen_bf16. */
size_t lm_frozen_widened_floats(const lm_model *m);
/* 1 if most of this part's MoE layers run their experts through the experts
 * op's wbf16 entries (a bf16-stored projection not replaced by an adapted
 * copy), so kernel tuning should time those (kern_run_sizes.moe_wbf16); 0
 * without MoE layers. m: after lm_store_frozen_bf16. */
int lm_experts_read_bf16(const lm_model *m);
/* 1 if most of this part's dense products (attention and MLP projections and
 * the lm_head, weighed by weight size) read their weight from the bf16 store
 * through the matmul op's wbf16 entries (a LoRA-adapted projection's base
 * included), so kernel tuning should time those (kern_run_sizes.mm_wbf16).
 * m: after lm_store_frozen_bf16. */
int lm_projections_read_bf16(const lm_model *m);
/* on = 1: widens the bf16-stored tensors that overlap params[off, off + n)
 * into params (whole tensors); on = 0: drops their pages again. A no-op
 * without bf16 storage. */
void lm_frozen_widen(lm_model *m, size_t off, size_t n, int on);
/* rows[r0, r1) of tensor i (cols floats each) into the model: params, or
 * the bf16 store for a stored tensor. */
void lm_put_rows(lm_model *m, int i, size_t r0, size_t r1, const float *rows);
/* Bytes of the activation plan (saved activations, checkpointing scratch,
 * backward scratch, logits block), for the log; params/grads not included. */
size_t lm_activation_bytes(const lm_model *m);
/* Parameters, and FLOPs per token for one forward+backward at sequence T
 * (6 * matmul params + 12 * L * nH * hd * T; the lm_head counted, the
 * embedding lookup not). */
size_t lm_num_params(const lm_model *m);
double lm_flops_per_token(const lm_model *m, int T);

/* The KV-cache forward that generation runs (model/generate.h): the SAME
 * layer forward as training (layer_forward in lm.c), over n new rows of one
 * sequence at absolute positions p0 .. p0+n-1. Each layer's K (after k_norm
 * and RoPE) and V go into the cache at those positions, attention reads
 * cache positions 0 .. p0+n-1 (query p0+i sees keys up to p0+i, within its
 * window), RoPE uses the tables of those rows, and nothing is kept for a
 * backward: one layer's activations for `rows` rows serve every layer in
 * turn. The model's weights and its small scratch (norm_w, bf16 widening)
 * are used; its training activation plan is not. */
typedef struct {
    int max_len;      /* positions the cache holds */
    int rows;         /* most rows per lm_kv_forward */
    int n_threads;    /* rows of the decode attention scratch */
    int p0;           /* position of the first row in flight (set by lm_kv_forward) */
    float *k, *v;     /* [L, max_len, nKV*hd] K after k_norm + RoPE, V as projected */
    lm_layer_acts a;  /* one layer's activations for `rows` rows; a.kr and a.v point into the cache */
    float *x[2];      /* [rows, H] residual stream entering / leaving a layer */
    float *rope_cos, *rope_sin;     /* [rows, hd/2] tables of the rows in flight */
    float *rope_cos_l, *rope_sin_l; /* the sliding layers' (== the above when they share) */
    float *rope_cos_q, *rope_sin_q; /* q's (lm_rope_q_tables; == rope_cos/sin without a q scale) */
    float *scores;    /* [n_threads, max_len] decode attention: one score row per thread */
    float *kh, *vht;  /* [max_len, hd], [hd, max_len] prefill attention: one kv head's K and V^T */
    float *qh, *oh;   /* [rows, hd] one query head and its output */
    float *probs;     /* [rows, max_len] its probabilities */
    float *moe_work;  /* [KERN_MOE_WORK(rows * k, H, Im)] (MoE models) */
} lm_kv;
/* Points kv's buffers into base (NULL: only counts) for max_len positions
 * and at most `rows` rows a call; returns the floats needed. */
size_t lm_kv_layout(lm_kv *kv, const lm_config *c, int max_len, int rows, int n_threads, float *base);
/* Runs tokens[n] (1 <= n <= kv->rows, p0 + n <= kv->max_len, ids checked
 * by the caller) at positions p0 .. p0+n-1 and, unless logits is NULL,
 * writes the logits [V] of the last of them (final norm and lm_head on that
 * row only). Positions >= p0 of the cache are overwritten. */
void lm_kv_forward(lm_model *m, lm_kv *kv, const int32_t *tokens, int p0, int n, float *logits);

/* Forward + fused lm_head/cross-entropy + backward for one micro-batch.
 * tokens, labels [B, T]; labels == -100 are ignored. Gradients of
 * (sum of CE) * grad_scale are ADDED to m->grads (grad_scale = 1 / number of
 * valid labels in the whole optimizer step). Returns the CE sum, and the
 * count of valid labels in *n_valid. MoE: m->aux_loss receives HF's
 * load-balancing loss of this forward and, when cfg.output_router_logits,
 * the gradient of router_aux_loss_coef * aux_scale * aux_loss is added too. */
double lm_forward_backward(lm_model *m, const int32_t *tokens, const int32_t *labels, int B, int T,
                              float grad_scale, long *n_valid);
/* Forward only; writes logits[B, T, V] (vocabulary-parallel: this rank's
 * columns only, [B, T, vocab_rows]). */
void lm_logits(lm_model *m, const int32_t *tokens, int B, int T, float *logits);
/* Forward only; returns the CE sum over valid labels (for evaluation). */
double lm_loss(lm_model *m, const int32_t *tokens, const int32_t *labels, int B, int T, long *n_valid);

/* A pipeline stage's share of a micro-batch (distributed/pp.h), on the bank
 * in use. Forward of layers [l0, l1): from tokens (l0 == 0: the embedding)
 * or x_in[B*T, H] (the previous stage's output); x_out[B*T, H] gets the
 * last layer's output unless l1 is the model's end, where the final norm
 * runs and the bank keeps it for the loss. train: a training forward
 * (LoRA dropout, load-balancing counts). */
void lm_stage_forward(lm_model *m, int l0, int l1, const int32_t *tokens, const float *x_in, float *x_out, int B,
                      int T, int train);
/* Its backward: with the model's end, the fused lm_head + loss (as
 * lm_forward_backward; returns the CE sum and *n_valid), else from
 * d_out[B*T, H] = d(x_out); gradients ADDED to m->grads; d_in[B*T, H] gets
 * d(x_in), or with l0 == 0 the embedding's gradient is added instead. */
double lm_stage_backward(lm_model *m, int l0, int l1, const int32_t *tokens, const int32_t *labels,
                         const float *d_out, float *d_in, int B, int T, float grad_scale, long *n_valid);
/* Zero-bubble pipelines (distributed/pp.h) split a stage's backward into I,
 * d(input), which the stage upstream waits for, and W, the weight
 * gradients, which fill the schedule's idle slots. I is lm_stage_backward
 * with m->wdefer set: each dense projection's matmul backward then
 * computes d(input) only and records here a copy of its input (one for q,
 * k and v, one for gate and up), a copy of its d(output) and where its dW
 * goes: per micro-batch and stage B T floats x the layers' 4 H + 2 (q + kv
 * widths) + 3 intermediate (each its rank's share under TP). The lm_head's
 * dW stays in I: deferring it would keep d(logits) [B T, V] whole, which
 * the fused head + loss never holds (1.2 GB a 2048-token micro-batch at
 * Qwen3's vocabulary). A MoE layer's routed experts are deferred too: the
 * experts kernel runs with its weight gradients NULL and I records copies
 * of the operands of its weight-gradient half (op_moe_experts_bwd_w): x and
 * dout [B T, H], h, d gate, d up [B T k, Im], and the routing (perm, topw
 * [B T k], offsets [E + 1]); copies, as h and the routing sit in the bank
 * or checkpointing scratch and d gate / d up in the experts' scratch, all
 * refilled before W. Not under expert parallel (ep.c runs the kernel per
 * source rank) nor with expert adapters (their dA, dB follow the kernel in
 * I). W (lm_stage_backward_weight) replays those records, dW += dy^T x with
 * the same GEMM call (the experts: op_moe_experts_bwd_w, the same grouped
 * GEMMs), layer by layer inside the hooks' pre/post_backward (FSDP
 * reduces each layer's gradients there), and empties the store. The
 * RMSNorms' weight gradients are W's too, as torch's stage_backward_weight
 * defers every parameter's: each trained norm (a layer's input, post-
 * attention, pre- and post-feedforward norm, the q/k norms per head, fused
 * with RoPE or not, or over the whole projection, and the final norm) runs
 * its d(input) alone in I and records copies of its input and d(output)
 * [rows, C] and rstd [rows] (wdefer_norm); W adds dw with the op's bwd_w,
 * the function every implementation's fused backward takes its dw from
 * (op_rmsnorm_bwd_w, op_qknorm_rope_bwd_w), the final norm's before the
 * last layer's hooks, where the fused backward ran it. A projection's bias
 * rides on its record: W sums it from the d(output) copy (no store). The
 * rest stays in I: the lm_head, the router, LoRA's adapters and the
 * embedding (they are small, or read state that the next backward
 * overwrites), and a bias whose weight is frozen. I then W gives the fused
 * backward's bits: the same products on the same values, each dW's sum in
 * the same order. */
/* What a W record replays: a dense projection's dW += dy^T x (the matmul op),
 * a MoE layer's experts (op_moe_experts_bwd_w), or an RMSNorm's weight
 * gradient: the rmsnorm op's bwd_w (the layers' norms, the final norm, the
 * per-head q/k norm without RoPE or after it, the whole-projection one),
 * op_rmsnorm_bwd_w itself (the whole-projection q/k norm split over tensor
 * parallel ranks: op_rmsnorm_bwd_given's sum) or the rope op's qknorm_bwd_w
 * (the per-head q/k norm fused with RoPE). */
enum { LM_W_PROJ, LM_W_EXPERTS, LM_W_NORM, LM_W_NORM_REF, LM_W_QKNORM_ROPE };
typedef struct {
    int layer;         /* the layer whose backward recorded it; n_layers: the final norm */
    int kind;          /* LM_W_* */
    size_t x, dy;      /* offsets into data of the input [M, K] and d(output) [M, N] copies (experts: x and
                          dout [M, K], M tokens, K = H; norms below) */
    float *dw;         /* [N, K], added to (experts: d gate_proj [E, N, K], NULL: frozen) */
    float *db;         /* a projection's bias gradient [N], added to from the d(output) copy (NULL: none) */
    const float *w;    /* the weight: the kernel's argument, unread without d(input) (experts: NULL) */
    int M, K, N;       /* experts: tokens, hidden, moe_intermediate */
    /* experts only: d up_proj [E, N, K] and d down_proj [E, K, N] (NULL: frozen); offsets of the
     * copies of h, d gate, d up [M k, N] and of the routing (perm [M k], offsets [E + 1], topw [M k]) */
    float *dwu, *dwd;
    size_t h, dg, du, route;
    int E, k;
    /* norms: x and dy are the norm's input and d(output) [M, K] (M rows of K features:
     * the q/k norm + RoPE's dy is d of the rotated output), rstd [M] its offset; dw [K];
     * sp: a layer's or the final norm's rows under sequence parallel, whose dw is a
     * partial summed over the group as norm_bwd's (lm_norm_partials); the q/k norm +
     * RoPE: cs, sn its [T, K/2] tables (the model's, a function of T), B T N heads */
    size_t rstd;
    int sp, B, T;
    const float *cs, *sn;
} lm_wrec;
typedef struct lm_wstore {
    lm_wrec *rec;
    int n, cap, cur;   /* records, their room, the layer the backward is in */
    int n_experts;     /* of the records, the MoE experts' (emptied by W) */
    float *data;
    size_t used, size; /* floats */
    size_t peak;       /* most floats held at once since created */
    const float *xsrc; /* the input the last record copied */
} lm_wstore;
void lm_stage_backward_weight(lm_model *m, lm_wstore *s, int l0, int l1);
void lm_wstore_free(lm_wstore *s);
/* The floats a store holds after I of layers l0 .. l1-1 on a micro-batch of
 * rows (B T, whole under sequence parallel: the products read gathered rows),
 * read from m's table as the recording does: each trained dense projection
 * [N, K] copies d(output) [rows, N] and its input [rows, K], one input for a
 * layer's q/k/v, one for its gate/up (and a shared expert's gate beside
 * them), and a deferred experts record's copies (above): each token takes
 * exactly top_k experts, so its B T k permuted rows are known before the
 * forward and the figure is exact whatever the routing. Each trained norm of
 * C features copies 2 C + 1 floats a row it normalises: rows for a layer's
 * and the final norm (l1 the model's end) over the rows this rank holds
 * (sequence parallel: its block; a table without m->sp, the dry run's, rank
 * 0's, the largest), rows x heads for a per-head q/k norm. pp.c sizes each
 * store with it; the dry run prints it. */
size_t lm_wstore_floats(const lm_model *m, int l0, int l1, size_t rows);
/* Room for floats (and the records of layers l0 .. l1-1) before the first I,
 * so a store takes what it holds rather than a doubled buffer. */
void lm_wstore_reserve(lm_wstore *s, size_t floats, int records);

/* After the forward of a range ending the model: the CE sum of labels (evaluation). */
double lm_stage_loss(lm_model *m, const int32_t *labels, int B, int T, long *n_valid);
/* Whether HF's load-balancing loss is in the gradient (a MoE model with
 * output_router_logits and router_aux_loss_coef > 0). */
int lm_aux_in_grad(const lm_config *c);
/* Before a stage's backward of a micro-batch of B x T tokens: the
 * load-balancing gradient its MoE layers add to every router probability,
 * from count[E], the micro-batch's expert choices summed over EVERY MoE
 * layer of the model (all stages'); R counts the whole model's MoE layers,
 * as the one-process forward does. No-op unless lm_aux_in_grad. */
void lm_stage_aux_grad(lm_model *m, const double *count, int B, int T);
/* Sequence parallel: the norm weights' gradients from this rank's rows
 * that a backward left pending (a layer's, between its backward and the
 * hooks' post_backward), k blocks of [H] in one buffer: returns their floats
 * (0: none) and *buf. A hook sums buf over the group in place (in one
 * collective with its own partial sums) and calls lm_norm_partials_add,
 * which adds each block into its gradient and clears them; what no hook
 * takes the backward sums itself. */
size_t lm_norm_partials(lm_model *m, float **buf);
void lm_norm_partials_add(lm_model *m);

#endif
