"""oracle_families.py: the transformers reference for ctitan's model families (issue 15).

One tiny random model per case, built with transformers' OWN config and model classes
(llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, olmo2, phi3, gemma, gemma2,
gemma3_text, granite, smollm3, olmo3, olmoe, granitemoe, granitemoeshared, glm, glm4, ernie4_5,
seed_oss, ministral, exaone4, ministral3, helium, vaultgemma,
hunyuan_v1_dense, ernie4_5_moe, flex_olmo)
with the family's distinctive options on, eager attention (and eager experts), fp32, seeded
weights: matrices and biases N(0, 0.1), norm weights 1 + U(-0.2, 0.2) (the Gemma families,
whose RMSNorm scales by 1 + w: U(-0.2, 0.2)). Expected values come from transformers and torch autograd /
torch.optim only; nothing here reads a number ctitan produced.

Names: ctitan names its tensors as the safetensors files that save_pretrained writes.
transformers 5 keeps some tensors differently in memory; `to_file_names` maps the in-memory
parameters (and their gradients) to the file names:
  qwen3_moe  mlp.experts.gate_up_proj [E, 2I, H] -> mlp.experts.e.{gate,up}_proj.weight
  qwen2_moe  mlp.experts.down_proj [E, H, I]     -> mlp.experts.e.down_proj.weight
  olmoe, flex_olmo
             (qwen2_moe's shared expert and its gate keep their names)
  mixtral    mlp.gate.weight                      -> block_sparse_moe.gate.weight
             mlp.experts.gate_up_proj [E, 2I, H]  -> block_sparse_moe.experts.e.{w1,w3}.weight
             mlp.experts.down_proj [E, H, I]      -> block_sparse_moe.experts.e.w2.weight
  (conversion_mapping.py: mixtral renames .block_sparse_moe. -> .mlp. and merges w1|w3 on load;
  save_pretrained reverses both). Every other family: the same names in memory and in the file
  (phi3's fused qkv_proj / gate_up_proj and glm's gate_up_proj are fused in the file too). Tied models have no
  lm_head.weight in memory (named_parameters de-duplicates) nor in the file.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import transformers as tf

import oracle
import oracle_moe

IGNORE = oracle.IGNORE

FAMILIES = {
    # model_type: (config class, causal-LM class)
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM),
    "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
    "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
    "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM),
    "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM),
    "olmo3": (tf.Olmo3Config, tf.Olmo3ForCausalLM),
    "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM),
    "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM),
    "granitemoeshared": (tf.GraniteMoeSharedConfig, tf.GraniteMoeSharedForCausalLM),
    "glm": (tf.GlmConfig, tf.GlmForCausalLM),
    "glm4": (tf.Glm4Config, tf.Glm4ForCausalLM),
    "ernie4_5": (tf.Ernie4_5Config, tf.Ernie4_5ForCausalLM),
    "seed_oss": (tf.SeedOssConfig, tf.SeedOssForCausalLM),
    "ministral": (tf.MinistralConfig, tf.MinistralForCausalLM),
    "exaone4": (tf.Exaone4Config, tf.Exaone4ForCausalLM),
    "ministral3": (tf.Ministral3Config, tf.Ministral3ForCausalLM),
    "helium": (tf.HeliumConfig, tf.HeliumForCausalLM),
    "vaultgemma": (tf.VaultGemmaConfig, tf.VaultGemmaForCausalLM),
    "hunyuan_v1_dense": (tf.HunYuanDenseV1Config, tf.HunYuanDenseV1ForCausalLM),
    "ernie4_5_moe": (tf.Ernie4_5_MoeConfig, tf.Ernie4_5_MoeForCausalLM),
    "flex_olmo": (tf.FlexOlmoConfig, tf.FlexOlmoForCausalLM),
    "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
    "dots1": (tf.Dots1Config, tf.Dots1ForCausalLM),
}
MOE = {"qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "granitemoeshared", "ernie4_5_moe", "flex_olmo",
       "glm4_moe", "dots1"}
# DeepSeek-V3's sigmoid, group-limited router with e_score_correction_bias under mlp.gate
SIGMOID_ROUTER = ("glm4_moe", "dots1")
# ERNIE 4.5 MoE's router selection bias: a frozen parameter in memory, its own name in the file
ERNIE_BIAS_MEM = "mlp.gate.moe_statics.e_score_correction_bias"
# GLM-4.5's (glm4_moe): a buffer of Glm4MoeTopkRouter, under the same name in the file
GLM_BIAS_MEM = "mlp.gate.e_score_correction_bias"
BIAS_MEM = (ERNIE_BIAS_MEM, GLM_BIAS_MEM)
GEMMA = {"gemma", "gemma2", "gemma3_text", "vaultgemma"}  # RMSNorm by (1 + w)

# sizes every case shares unless it overrides them
BASE = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, use_cache=False, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2)
# pad_token_id stays each family's default where that is inside the tiny vocabulary (gemmas 0,
# olmo2 1; None for the others) and phi3 sets one (its default 32000 is outside): transformers
# builds nn.Embedding(padding_idx=pad_token_id), whose backward gives the pad row no gradient from
# the embedding lookup. `batch` puts the pad token into the inputs so that this shows.


def _factors(n, seed, lo, hi):
    rng = np.random.default_rng(seed)
    return [round(float(x), 4) for x in rng.uniform(lo, hi, n)]


@dataclass
class Case:
    id: str
    family: str
    kw: dict                       # config kwargs on top of BASE
    T: int = 16
    seed: int = 11                 # weights
    # config attributes that the export must carry back (compared on the reloaded config)
    keys: tuple = ()
    # ERNIE 4.5 MoE, GLM-4.5: std of a random e_score_correction_bias per sparse layer (0: zero, as built)
    score_bias: float = 0.0

    @property
    def moe(self) -> bool:
        return self.family in MOE


CASES = [
    # ------------------------------------------------------------------ llama
    Case("llama_rope3_attnbias_hd16", "llama", dict(
        vocab_size=192, hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        attention_bias=True, mlp_bias=False,
        # head_dim 16, theta 1e4: wavelengths 6.3 (< 32/4: kept), 19.9 (between: smoothed), >= 63 (/ 8)
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
        keys=("attention_bias", "mlp_bias", "head_dim", "rope_parameters", "tie_word_embeddings")),
    Case("llama_mlpbias_tied", "llama", dict(
        num_hidden_layers=3, mlp_bias=True, attention_bias=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        keys=("attention_bias", "mlp_bias", "head_dim", "rope_parameters", "tie_word_embeddings")),
    # ------------------------------------------------------------------ mistral
    Case("mistral_swa5", "mistral", dict(
        head_dim=16, sliding_window=5, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        keys=("sliding_window", "head_dim", "rope_parameters")),
    # ------------------------------------------------------------------ qwen2 (q/k/v biases always)
    Case("qwen2_bias_tied", "qwen2", dict(
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        keys=("tie_word_embeddings", "rope_parameters", "layer_types")),
    # v5 still honours use_sliding_window: layers i >= max_window_layers slide (layer_types)
    Case("qwen2_swa6_layers", "qwen2", dict(
        num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        keys=("sliding_window", "layer_types", "use_sliding_window")),
    # ------------------------------------------------------------------ qwen3 (supported before issue 15)
    Case("qwen3_base", "qwen3", dict(
        head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        keys=("head_dim", "rope_parameters")),
    Case("qwen3_yarn", "qwen3", dict(
        head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 32}),
        keys=("head_dim", "rope_parameters", "tie_word_embeddings")),
    Case("qwen3_moe_aux", "qwen3_moe", dict(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
        output_router_logits=True, router_aux_loss_coef=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=13,  # MoE seeds: every router top-k gap of the tests' batches and steps >= 1e-4
        keys=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "output_router_logits", "router_aux_loss_coef")),
    # ------------------------------------------------------------------ qwen2_moe
    # Qwen2's q/k/v biases (qkv_bias, on by default) with sparse layers that add a shared
    # expert (shared_expert_intermediate_size 40, the experts' 24) gated by sigmoid(x W_g).
    # decoder_sparse_step 2: layer 1 sparse, layers 0 and 2 dense MLPs of intermediate_size;
    # softmax top-k not renormalised (Qwen2MoeConfig's default), the aux loss in the loss.
    Case("qwen2_moe_step2_aux", "qwen2_moe", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, decoder_sparse_step=2, norm_topk_prob=False,
        output_router_logits=True, router_aux_loss_coef=0.05,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=13,
        keys=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "decoder_sparse_step", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef",
              "qkv_bias", "mlp_only_layers")),
    # mlp_only_layers [0]: layer 0 dense, 1 and 2 sparse; renormalised top-k; no q/k/v biases
    Case("qwen2_moe_mlponly_norm_nobias", "qwen2_moe", dict(
        num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=40, mlp_only_layers=[0], norm_topk_prob=True, qkv_bias=False,
        output_router_logits=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        seed=13,
        keys=("num_experts", "moe_intermediate_size", "shared_expert_intermediate_size", "mlp_only_layers",
              "norm_topk_prob", "qkv_bias", "rope_parameters")),
    # ------------------------------------------------------------------ olmoe
    # Llama's pre-norm layer with q_norm / k_norm over the whole projections (32 and 16 wide)
    # and every layer sparse: experts intermediate_size (24) wide, softmax top-k not
    # renormalised (OlmoeConfig's default), attention biases, the aux loss in the loss; pad 1
    Case("olmoe_aux_bias", "olmoe", dict(
        intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, attention_bias=True,
        output_router_logits=True, router_aux_loss_coef=0.05, rope_parameters={"rope_type": "default",
                                                                               "rope_theta": 1e4}),
        seed=13,
        keys=("num_experts", "num_experts_per_tok", "intermediate_size", "norm_topk_prob", "attention_bias",
              "output_router_logits", "router_aux_loss_coef", "clip_qkv", "pad_token_id")),
    # renormalised top-k, 3 layers, tied embeddings, no aux loss
    Case("olmoe_norm_topk_tied", "olmoe", dict(
        num_hidden_layers=3, intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        tie_word_embeddings=True, output_router_logits=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        seed=14,
        keys=("num_experts", "intermediate_size", "norm_topk_prob", "tie_word_embeddings", "rope_parameters")),
    # ------------------------------------------------------------------ flex_olmo
    # OLMo2's post-norm layer (post_attention_layernorm / post_feedforward_layernorm on each
    # branch's output before its residual add, no pre-norms) around OLMoE's sparse block in
    # every layer: experts intermediate_size (24) wide, softmax top-k not renormalised
    # (FlexOlmoConfig's default), attention biases, the aux loss in the loss; head_dim 16 of
    # hidden 32 / 4 heads (q_norm spans 4 x 16 = 64, k_norm 2 x 16 = 32); pad 1 (the default
    # 100277 is outside the tiny vocabulary)
    Case("flex_olmo_aux_hd16", "flex_olmo", dict(
        head_dim=16, intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
        attention_bias=True, output_router_logits=True, router_aux_loss_coef=0.05, pad_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=21,
        keys=("num_experts", "num_experts_per_tok", "intermediate_size", "norm_topk_prob", "attention_bias",
              "output_router_logits", "router_aux_loss_coef", "head_dim", "pad_token_id", "rms_norm_eps")),
    # renormalised top-k, 4 layers (ZBVZeroBubble's four stages), tied embeddings, no aux
    # loss: the layouts (FSDP, EP, TP, PP) and LoRA run on this one. The renormalisation divides a token's branch by one
    # number, which post_feedforward_layernorm cancels up to its eps: rms_norm_eps 1e-3 (the
    # branch's mean square is about 2e-3 here) makes norm_topk_prob move the logits by 0.7
    # (test_families_flex_olmo), where FlexOlmoConfig's 1e-6 leaves 1e-3
    Case("flex_olmo_norm_topk_tied", "flex_olmo", dict(
        num_hidden_layers=4, intermediate_size=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        rms_norm_eps=1e-3, tie_word_embeddings=True, output_router_logits=False, pad_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        seed=31,
        keys=("num_experts", "intermediate_size", "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings",
              "rope_parameters")),
    # ------------------------------------------------------------------ granitemoe
    # Granite's four scalars around every-layer-sparse experts (intermediate_size 24), stored
    # fused (input_linear [E, 2I, H]: each expert's gate rows, then up); the softmax of the
    # top-k router logits; the aux loss in the loss
    Case("granitemoe_aux", "granitemoe", dict(
        intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.05, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
        logits_scaling=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=15,
        keys=("num_local_experts", "num_experts_per_tok", "intermediate_size", "output_router_logits",
              "router_aux_loss_coef", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
              "logits_scaling")),
    # 3 of 4 experts per token, tied embeddings, attention biases, no aux loss
    Case("granitemoe_k3_tied_bias", "granitemoe", dict(
        num_hidden_layers=3, intermediate_size=16, num_local_experts=4, num_experts_per_tok=3,
        attention_bias=True, tie_word_embeddings=True, output_router_logits=False, embedding_multiplier=2.0,
        residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        seed=14,
        keys=("num_local_experts", "num_experts_per_tok", "attention_bias", "tie_word_embeddings",
              "embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")),
    # ------------------------------------------------------------------ ernie4_5_moe
    # 4 layers: layer 0 dense (moe_layer_start_index 1), layers 1 and 3 sparse
    # (moe_layer_interval 2: (l + 1) % 2 == 0), layer 2 dense; 2 shared experts (width 2 x 12),
    # softmax top-2 of 4 renormalised, aux loss on, GLM's interleaved RoPE, tied
    Case("ernie4_5_moe_interval2_aux", "ernie4_5_moe", dict(
        num_hidden_layers=4, moe_num_experts=4, moe_k=2, moe_intermediate_size=12, moe_num_shared_experts=2,
        moe_layer_start_index=1, moe_layer_interval=2, output_router_logits=True, router_aux_loss_coef=0.05,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=23,
        keys=("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts",
              "moe_layer_start_index", "moe_layer_end_index", "moe_layer_interval", "output_router_logits",
              "router_aux_loss_coef", "tie_word_embeddings")),
    # no shared experts, every layer up to moe_layer_end_index 1 sparse from 0, untied, no aux
    Case("ernie4_5_moe_noshared_end1", "ernie4_5_moe", dict(
        num_hidden_layers=3, moe_num_experts=4, moe_k=3, moe_intermediate_size=16, moe_num_shared_experts=0,
        moe_layer_start_index=0, moe_layer_end_index=1, output_router_logits=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        seed=24,
        keys=("moe_num_shared_experts", "moe_layer_start_index", "moe_layer_end_index", "tie_word_embeddings")),
    # 3 shared experts (width 3 x 8), every layer sparse (the defaults' start 1 moved to 0), no
    # aux loss, untied: the layouts with data parallelism (FSDP, EP) and LoRA run on this one
    Case("ernie4_5_moe_shared3_untied", "ernie4_5_moe", dict(
        num_hidden_layers=2, moe_num_experts=4, moe_k=2, moe_intermediate_size=8, moe_num_shared_experts=3,
        moe_layer_start_index=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=26,
        keys=("moe_num_shared_experts", "moe_intermediate_size", "moe_layer_start_index", "tie_word_embeddings")),
    # a random e_score_correction_bias (std 0.3 against probabilities of 4 experts) that moves
    # the top 2 of many tokens; the aux loss on, every layer sparse, 3 shared experts
    Case("ernie4_5_moe_score_bias", "ernie4_5_moe", dict(
        num_hidden_layers=2, moe_num_experts=4, moe_k=2, moe_intermediate_size=8, moe_num_shared_experts=3,
        moe_layer_start_index=0, output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=27, score_bias=0.3,
        keys=("moe_num_experts", "moe_k", "moe_layer_start_index", "router_aux_loss_coef")),
    # the same with moe_norm_min 0.6 (above k / E = 0.5): Ernie4_5_MoeTopKRouter divides the
    # chosen probabilities by max(sum, 0.6), which binds on many tokens (their top 2, or the
    # biased choice, sum under 0.6) and not on others (test_families_ernie4_5_moe counts them)
    Case("ernie4_5_moe_norm_min_binds", "ernie4_5_moe", dict(
        num_hidden_layers=2, moe_num_experts=4, moe_k=2, moe_intermediate_size=8, moe_num_shared_experts=3,
        moe_layer_start_index=0, output_router_logits=True, router_aux_loss_coef=0.05, tie_word_embeddings=False,
        moe_norm_min=0.6, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=27, score_bias=0.3,
        keys=("moe_norm_min", "moe_num_experts", "moe_k")),
    # ------------------------------------------------------------------ glm4_moe
    # every GLM-4.5 feature on: layer 0 dense (first_k_dense_replace 1), layers 1-2 sparse with
    # a sigmoid router over 8 experts in 4 groups (topk_group 2: half the experts taken out per
    # token), top 2 renormalised then x 2.5 (routed_scaling_factor), a random
    # e_score_correction_bias that moves the choice, 2 shared experts (width 2 x 8), q/k/v
    # biases, per-head q/k norms, partial RoPE (the default factor 0.5 of head_dim 16)
    Case("glm4_moe_groups_bias_qknorm", "glm4_moe", dict(
        num_hidden_layers=3, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=54, score_bias=0.1,
        keys=("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
              "topk_group", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob", "use_qk_norm",
              "attention_bias", "head_dim")),
    # the first case's router, q/k norms and biases under a yarn RoPE on the rotated half of each
    # head (Glm4MoeRotaryEmbedding's yarn init reads partial_rotary_factor 0.5: 8 of head_dim 16,
    # 4 frequencies; theta 1e3 and original_max_position_embeddings 64 put them across yarn's
    # ramp: the fastest kept, the next half interpolated, the two slowest / 4) and yarn's
    # attention factor (0.1 ln 4 + 1) on cos / sin, the 8 passed features unscaled
    Case("glm4_moe_yarn_groups_qknorm", "glm4_moe", dict(
        num_hidden_layers=3, head_dim=16, max_position_embeddings=256, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=8,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e3, "factor": 4.0,
                         "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5}),
        seed=55, score_bias=0.1,
        keys=("rope_parameters", "use_qk_norm", "head_dim", "n_group", "topk_group")),
    # the other settings: no groups, weights not renormalised (x 0.5), every layer sparse, no q/k
    # norms nor biases, partial_rotary_factor 0.75, tied, no selection bias: the layouts with
    # data parallelism (FSDP, EP, TP) and LoRA run on this one and the first
    Case("glm4_moe_plain_tied", "glm4_moe", dict(
        num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        n_shared_experts=1, routed_scaling_factor=0.5, first_k_dense_replace=0, norm_topk_prob=False,
        use_qk_norm=False, attention_bias=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}),
        seed=50,
        keys=("n_routed_experts", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob",
              "tie_word_embeddings", "use_qk_norm")),
    # ------------------------------------------------------------------ dots1
    # every dots.llm1 feature on: layer 0 dense (first_k_dense_replace 1), layers 1-2 sparse with
    # GLM-4.5's router (8 experts in 4 groups, topk_group 2, top 2 renormalised, x 2.5, a random
    # e_score_correction_bias), 2 ungated shared experts, q/k/v and o biases, the always-on
    # per-head q/k norms before whole-head RoPE, layer 2 sliding over 5 keys (max_window_layers 2:
    # Dots1Config derives layer_types itself, with no use_sliding_window gate)
    Case("dots1_groups_bias_swa5", "dots1", dict(
        num_hidden_layers=3, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5, first_k_dense_replace=1,
        norm_topk_prob=True, attention_bias=True, sliding_window=5, max_window_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=69, score_bias=0.1,
        keys=("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "n_group",
              "topk_group", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob", "attention_bias",
              "head_dim", "sliding_window", "layer_types")),
    # Dots1Config's other defaults: every layer sparse, no renormalisation (x 0.5), no groups, no
    # biases, no window, tied, no selection bias
    Case("dots1_plain_tied", "dots1", dict(
        num_hidden_layers=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
        n_shared_experts=1, routed_scaling_factor=0.5, attention_bias=False, tie_word_embeddings=True,
        sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=62,
        keys=("n_routed_experts", "routed_scaling_factor", "first_k_dense_replace", "norm_topk_prob",
              "tie_word_embeddings", "layer_types")),
    # ------------------------------------------------------------------ granitemoeshared
    # granitemoe plus an ungated shared MLP (shared_intermediate_size 40, wider than the
    # experts' 24) in every layer, its gate and up rows fused in shared_mlp.input_linear
    Case("granitemoeshared_aux", "granitemoeshared", dict(
        intermediate_size=24, shared_intermediate_size=40, num_local_experts=4, num_experts_per_tok=2,
        output_router_logits=True, router_aux_loss_coef=0.05, embedding_multiplier=3.0, residual_multiplier=0.4,
        attention_multiplier=0.2, logits_scaling=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=19,
        keys=("num_local_experts", "intermediate_size", "shared_intermediate_size", "output_router_logits",
              "router_aux_loss_coef", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
              "logits_scaling")),
    # a shared MLP narrower than the experts (8 < 16), 3 layers, tied, no aux loss
    Case("granitemoeshared_narrow_tied", "granitemoeshared", dict(
        num_hidden_layers=3, intermediate_size=16, shared_intermediate_size=8, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=True, output_router_logits=False, embedding_multiplier=2.0,
        residual_multiplier=0.7, attention_multiplier=0.3, logits_scaling=1.5,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        seed=19,
        keys=("num_local_experts", "shared_intermediate_size", "tie_word_embeddings", "residual_multiplier",
              "logits_scaling")),
    # ------------------------------------------------------------------ mixtral
    Case("mixtral_e4k2", "mixtral", dict(
        num_local_experts=4, num_experts_per_tok=2, output_router_logits=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        keys=("num_local_experts", "num_experts_per_tok", "output_router_logits", "rope_parameters")),
    Case("mixtral_e4k2_aux_hd16", "mixtral", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.05, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        seed=22,
        keys=("num_local_experts", "num_experts_per_tok", "output_router_logits", "router_aux_loss_coef",
              "head_dim")),
    # ------------------------------------------------------------------ olmo2
    Case("olmo2", "olmo2", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        keys=("rms_norm_eps", "rope_parameters")),
    # ------------------------------------------------------------------ phi3 (head_dim = 32 / 4 = 8)
    # T = 16 <= original_max_position_embeddings 32: short_factor; attention factor
    # sqrt(1 + ln(128 / 32) / ln 32) from max_position_embeddings / original
    Case("phi3_longrope_short_swa7", "phi3", dict(
        pad_token_id=3, sliding_window=7, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 32,
                         "short_factor": _factors(4, 1, 1.0, 3.0), "long_factor": _factors(4, 2, 2.0, 9.0)}),
        keys=("sliding_window", "original_max_position_embeddings", "rope_parameters")),
    # T = 16 > original_max_position_embeddings 8: long_factor
    Case("phi3_longrope_long", "phi3", dict(
        pad_token_id=3, max_position_embeddings=64, original_max_position_embeddings=8, tie_word_embeddings=True,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 8,
                         "short_factor": _factors(4, 3, 1.0, 3.0), "long_factor": _factors(4, 4, 2.0, 9.0)}),
        keys=("original_max_position_embeddings", "rope_parameters", "tie_word_embeddings")),
    # partial_rotary_factor (Phi-4-mini: 0.75 with longrope): head_dim 64 / 4 = 16, RoPE on the
    # first int(16 * 0.75) = 12 features (pairs (i, i + 6)), the last 4 passed through; the
    # longrope factors have 12 / 2 entries. T = 16 > 8: long_factor
    Case("phi3_partial075_longrope", "phi3", dict(
        hidden_size=64, pad_token_id=3, max_position_embeddings=64, original_max_position_embeddings=8,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 8,
                         "partial_rotary_factor": 0.75,
                         "short_factor": _factors(6, 5, 1.0, 3.0), "long_factor": _factors(6, 6, 2.0, 9.0)}),
        keys=("original_max_position_embeddings", "rope_parameters")),
    # default RoPE on half of each head of 8 (int(8 * 0.5) = 4), a sliding window on top
    Case("phi3_partial05_swa5", "phi3", dict(
        pad_token_id=3, sliding_window=5, original_max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
        keys=("sliding_window", "rope_parameters")),
    # ------------------------------------------------------------------ gemma3_text
    # attn_logit_softcapping: transformers 5.24's Gemma3Attention keeps it but never passes
    # softcap= to the attention function, so it changes nothing (test_families pins this); ctitan
    # must compute as transformers does. final_logit_softcapping is applied (tanh on the logits).
    Case("gemma3_text", "gemma3_text", dict(
        hidden_size=48, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=4,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
        final_logit_softcapping=2.0, attn_logit_softcapping=5.0, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1),
        keys=("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar",
              "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "tie_word_embeddings",
              "head_dim")),
    # ------------------------------------------------------------------ gemma2
    # Gemma3's sandwich layer without q/k norms, one RoPE, and attn_logit_softcapping applied by
    # the eager attention (Gemma2's attention passes softcap=): a cap of 1.0 on scores of about
    # 0.4 moves them by several percent, final_logit_softcapping 2.0 the logits likewise.
    # layer_types left to Gemma2Config's default (sliding, full, sliding), head_dim 16 of
    # hidden 48 / 4 heads = 12 (head_dim is its own key), query_pre_attn_scalar 24 != head_dim.
    Case("gemma2", "gemma2", dict(
        hidden_size=48, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        final_logit_softcapping=2.0, attn_logit_softcapping=1.0, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1),
        keys=("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar",
              "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "tie_word_embeddings",
              "head_dim")),
    # ------------------------------------------------------------------ gemma
    # Llama's pre-norm layer with Gemma's (1 + w) RMSNorm, sqrt(H)-scaled embeddings and
    # hidden_act "gelu", which GemmaConfig reads as gelu_pytorch_tanh (the published files say
    # "gelu"); attention_bias on; scores scaled by head_dim^-0.5 (no query_pre_attn_scalar)
    Case("gemma_gelu_attnbias", "gemma", dict(
        hidden_size=48, head_dim=16, hidden_act="gelu", attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1),
        keys=("hidden_act", "attention_bias", "rope_parameters", "tie_word_embeddings", "head_dim")),
    # ------------------------------------------------------------------ granite
    # Llama's layer with Granite 3.x's four scalars at the published granite-3.0-2b values:
    # embeddings x 12, each branch x 0.22 before its residual add, scores x 1/64 instead of
    # head_dim^-0.5 (= 1/4 here), logits / 8; head_dim 16 of hidden 48 / 4 heads = 12;
    # tied embeddings as the published files; attention and MLP biases on.
    Case("granite", "granite", dict(
        hidden_size=48, head_dim=16, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.015625, logits_scaling=8.0, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, tie_word_embeddings=True),
        keys=("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling",
              "attention_bias", "mlp_bias", "head_dim", "rope_parameters", "tie_word_embeddings")),
    # ------------------------------------------------------------------ smollm3
    # Llama's layer where no_rope_layers' 0 entries (layers 1 and 3) apply no RoPE; with
    # use_sliding_window and a window, SmolLM3Config makes exactly those NoPE layers slide
    # (layer_types derived, window 5 < T = 16); pad_token_id set (the default 128004 is outside
    # the tiny vocabulary); MLP biases on, embeddings tied (the default). attention_bias stays
    # off: without RoPE a key bias adds one vector to every key, which the softmax cancels, so
    # its gradient is zero up to rounding and no relative tolerance can compare it
    Case("smollm3_nope_swa5", "smollm3", dict(
        num_hidden_layers=4, hidden_size=48, head_dim=16, no_rope_layers=[1, 0, 1, 0], use_sliding_window=True,
        sliding_window=5, attention_bias=False, mlp_bias=True, pad_token_id=3, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        keys=("no_rope_layers", "layer_types", "use_sliding_window", "sliding_window", "attention_bias", "mlp_bias",
              "head_dim", "rope_parameters", "tie_word_embeddings")),
    # review4: every layer kind: 0 full NoPE, 1 sliding RoPE, 2 sliding NoPE, 3 full RoPE
    Case("smollm3_kinds", "smollm3", dict(
        num_hidden_layers=4, hidden_size=48, head_dim=16, no_rope_layers=[0, 1, 0, 1], use_sliding_window=True,
        sliding_window=5, attention_bias=False, mlp_bias=False, pad_token_id=3, tie_word_embeddings=False,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        keys=("no_rope_layers", "layer_types", "use_sliding_window", "sliding_window", "head_dim",
              "rope_parameters", "tie_word_embeddings")),
    # ------------------------------------------------------------------ olmo3
    # OLMo2's post-norm layer and whole-projection q/k norms; layer_types left to Olmo3Config's
    # default (sliding, sliding, sliding, full) over a window of 5 < T = 16; the full layer's
    # RoPE is yarn, the sliding layers' default with another theta (one RoPE per layer type)
    Case("olmo3_swa5_yarn", "olmo3", dict(
        num_hidden_layers=4, head_dim=16, hidden_size=48, sliding_window=5,
        rope_parameters={"full_attention": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                            "original_max_position_embeddings": 32},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
        # seed 11's bf16 logits sit where AMX's summation order flips bf16 roundings at 41% of
        # positions (bit-equal to the emulation with matmul_bf16=ref); seeds 12-15 do not
        seed=12,
        keys=("layer_types", "sliding_window", "rope_parameters", "head_dim", "rms_norm_eps")),
    # ------------------------------------------------------------------ glm, glm4
    # GLM's RoPE: the pairs (2i, 2i+1) of the first int(head_dim x partial_rotary_factor)
    # features of each head (GlmConfig's default factor 0.5: 8 of 16 here), the rest passed
    # through; q/k/v biases (attention_bias, default on; o_proj never has one); the file's
    # mlp.gate_up_proj (gate rows first); eps 1.5625e-7 (the config class's default); pad 3
    # (the default 151329 is outside the tiny vocabulary)
    Case("glm_bias_partial05", "glm", dict(
        hidden_size=48, head_dim=16, pad_token_id=3, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        keys=("attention_bias", "head_dim", "rope_parameters", "rms_norm_eps", "pad_token_id")),
    # glm4: GLM's layer with post_self_attn_layernorm / post_mlp_layernorm on each branch's
    # output before its residual add; 12 of 16 features rotated, no biases, tied, 3 layers
    Case("glm4_partial075_tied", "glm4", dict(
        hidden_size=48, num_hidden_layers=3, head_dim=16, pad_token_id=3, attention_bias=False,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.75}),
        seed=12,
        keys=("attention_bias", "head_dim", "rope_parameters", "tie_word_embeddings", "pad_token_id")),
    # ------------------------------------------------------------------ ernie4_5, seed_oss
    # ERNIE 4.5: GLM's interleaved pairs over the whole head (its default RoPE reads no
    # partial_rotary_factor), use_bias on all seven projections (q, k, v, o, gate, up, down),
    # tied (the config class's default), pad 0 (its default)
    Case("ernie4_5_bias_tied", "ernie4_5", dict(
        hidden_size=48, head_dim=16, use_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        keys=("use_bias", "head_dim", "rope_parameters", "tie_word_embeddings", "pad_token_id")),
    # Seed-OSS: q/k/v biases (attention_bias, default true), o_proj's by attention_out_bias,
    # the MLP's by mlp_bias; the dropouts (default 0.1 in SeedOssConfig) written as 0.0
    Case("seed_oss_outbias_mlpbias", "seed_oss", dict(
        hidden_size=48, head_dim=16, attention_out_bias=True, mlp_bias=True, attention_dropout=0.0,
        residual_dropout=0.0, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        keys=("attention_bias", "attention_out_bias", "mlp_bias", "head_dim", "rope_parameters",
              "attention_dropout", "residual_dropout")),
    # ------------------------------------------------------------------ ministral
    # Ministral: Mistral's layer with full layers among the sliding ones (layer_types: the
    # first and third slide over 5 keys, the second attends to all); head_dim given, as
    # MinistralConfig derives none
    Case("ministral_types_swa5", "ministral", dict(
        num_hidden_layers=3, head_dim=16, sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        keys=("sliding_window", "layer_types", "head_dim", "rope_parameters")),
    # ------------------------------------------------------------------ exaone4
    # EXAONE 4.0: OLMo2's post-norms, per-head q/k norms; sliding_window_pattern's default 4
    # makes layers 0-2 slide over 5 keys with RoPE and layer 3 full without RoPE; tied.
    # seed 12: at 11 one bf16 rounding flip at row 1's 7th position moved every later logit
    # of the row (test_families_bf16: 69% of positions agreeing; the same with RoPE on all four
    # layers, so not the NoPE path)
    Case("exaone4_swa5_nope_tied", "exaone4", dict(
        num_hidden_layers=4, head_dim=8, sliding_window=5, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}), seed=12,
        keys=("sliding_window", "layer_types", "head_dim", "rope_parameters", "tie_word_embeddings")),
    # ------------------------------------------------------------------ ministral3
    # Ministral 3: Mistral's layer with q times 1 + beta log(1 + floor(pos / 4)) after RoPE
    # (positions 0-15 cross floors 0-3: scales 1 .. 1.42); yarn as the published files
    # (mscale = mscale_all_dim = 1), its original length the same 4
    Case("ministral3_yarn_qscale", "ministral3", dict(
        num_hidden_layers=2, head_dim=16, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 4,
            "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3}),
        keys=("head_dim", "rope_parameters", "sliding_window")),
    # ------------------------------------------------------------------ helium
    # Helium: Llama's layer with RoPE on the interleaved pairs (2i, 2i+1) of the whole head,
    # q/k/v biases (attention_bias; o_proj never has one), MLP biases, HeliumConfig's
    # pad 3, eps 1e-8 and theta 1e5 (its defaults: not given); heads x head_dim = hidden_size
    # (o_proj is Linear(hidden_size, hidden_size))
    Case("helium_bias_interleaved", "helium", dict(
        hidden_size=48, head_dim=12, attention_bias=True, mlp_bias=True),
        keys=("attention_bias", "mlp_bias", "head_dim", "rope_parameters", "rms_norm_eps", "pad_token_id")),
    # ------------------------------------------------------------------ vaultgemma
    # VaultGemma: Gemma 2's pre-norm layer without its post-norms (input_layernorm,
    # pre_feedforward_layernorm), (1 + w) RMSNorm, sqrt(H) embeddings, both soft-caps,
    # query_pre_attn_scalar 24 != head_dim 16, layer_types left to the default (sliding, full,
    # sliding) over a window of 4; attention biases on q, k, v and o; tied
    Case("vaultgemma_caps_bias", "vaultgemma", dict(
        hidden_size=48, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}, final_logit_softcapping=2.0,
        attn_logit_softcapping=1.0, hidden_activation="gelu_pytorch_tanh", attention_bias=True,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1),
        keys=("layer_types", "sliding_window", "rope_parameters", "query_pre_attn_scalar",
              "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "tie_word_embeddings",
              "head_dim", "attention_bias")),
    # ------------------------------------------------------------------ hunyuan_v1_dense
    # HunYuan dense: Llama's layer with per-head RMSNorms (query_layernorm / key_layernorm, norm
    # weights 1 + U(-0.2, 0.2): not symmetric in a RoPE pair, so the order shows) applied AFTER
    # RoPE; attention biases on q, k, v and o; head_dim 16 != hidden 32 / 4 heads; pad 0 (default)
    Case("hunyuan_qknorm_after_rope_bias", "hunyuan_v1_dense", dict(
        head_dim=16, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        keys=("attention_bias", "head_dim", "rope_parameters", "pad_token_id", "num_key_value_heads")),
]
CASE = {c.id: c for c in CASES}

# partial_rotary_factor outside phi3 (transformers 5.24): every other family's default RoPE
# (<Family>RotaryEmbedding.compute_default_rope_parameters) never reads it and rotates whole
# heads, so the model is the one without the factor (test_families pins that on transformers
# itself). One case per family, on top of the family's first case, with the factor in
# rope_parameters or at the top level (convert_rope_params_to_dict moves it into the dict):
# ctitan must compute the same model and carry the key to its export. The scaled types do read
# it and then fail in transformers' forward: REFUSALS below.
def _partial_default(family, cid, factor, top_level):
    def default_rope(c):
        rp = c.kw["rope_parameters"]
        return all(d["rope_type"] == "default" for d in (rp.values() if family == "gemma3_text" else [rp]))
    base = next(c for c in CASES if c.family == family and default_rope(c))
    kw = copy.deepcopy(base.kw)
    if family == "gemma3_text":
        for d in kw["rope_parameters"].values():
            if not top_level:
                d["partial_rotary_factor"] = factor
    elif not top_level:
        kw["rope_parameters"]["partial_rotary_factor"] = factor
    if top_level:
        kw["partial_rotary_factor"] = factor
    return Case(cid, family, kw, seed=base.seed, keys=tuple(dict.fromkeys(base.keys + ("rope_parameters",))))


PARTIAL_DEFAULT_CASES = [
    _partial_default("llama", "llama_default_partial05_ignored", 0.5, top_level=True),
    _partial_default("mistral", "mistral_default_partial075_ignored", 0.75, top_level=False),
    _partial_default("qwen2", "qwen2_default_partial05_ignored", 0.5, top_level=False),
    _partial_default("qwen3", "qwen3_default_partial05_ignored", 0.5, top_level=True),
    _partial_default("qwen3_moe", "qwen3_moe_default_partial05_ignored", 0.5, top_level=False),
    _partial_default("qwen2_moe", "qwen2_moe_default_partial05_ignored", 0.5, top_level=True),
    _partial_default("mixtral", "mixtral_default_partial025_ignored", 0.25, top_level=True),
    _partial_default("olmo2", "olmo2_default_partial05_ignored", 0.5, top_level=False),
    _partial_default("gemma3_text", "gemma3_default_partial05_ignored", 0.5, top_level=False),
    _partial_default("gemma2", "gemma2_default_partial05_ignored", 0.5, top_level=True),
    _partial_default("gemma", "gemma_default_partial075_ignored", 0.75, top_level=False),
    _partial_default("granite", "granite_default_partial05_ignored", 0.5, top_level=True),
    _partial_default("smollm3", "smollm3_default_partial05_ignored", 0.5, top_level=False),
    _partial_default("ministral", "ministral_default_partial05_ignored", 0.5, top_level=True),
    _partial_default("flex_olmo", "flex_olmo_default_partial05_ignored", 0.5, top_level=False),
    _partial_default("dots1", "dots1_default_partial05_ignored", 0.5, top_level=True),
]
CASE.update({c.id: c for c in PARTIAL_DEFAULT_CASES})


# --------------------------------------------------------------------------- refusals

@dataclass
class Refusal:
    """A transformers-valid config that ctitan must refuse (it would compute something
    else): ctitan_open fails and the message names config.json and `key`. `kw` goes on top of
    the family's first case's config."""
    id: str
    family: str
    kw: dict
    key: str
    also: tuple = ()  # further text the message must hold (the value, the family)


_SMOL_TYPES = ["full_attention", "sliding_attention"] * 2  # the smollm3 case's, given explicitly

REFUSALS = [
    Refusal("llama_attention_dropout", "llama", dict(attention_dropout=0.1), "attention_dropout"),
    # exact (erf) GELU, not the tanh approximation gemma3 uses
    Refusal("mistral_hidden_act_gelu", "mistral", dict(hidden_act="gelu"), "hidden_act"),
    Refusal("qwen2_attention_dropout", "qwen2", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("qwen3_attention_dropout", "qwen3", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("qwen3_moe_hidden_act_relu2", "qwen3_moe", dict(hidden_act="relu2"), "hidden_act"),
    Refusal("mixtral_router_jitter", "mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
    Refusal("qwen2_moe_attention_dropout", "qwen2_moe", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("qwen2_moe_hidden_act_relu2", "qwen2_moe", dict(hidden_act="relu2"), "hidden_act"),
    Refusal("olmo2_attention_dropout", "olmo2", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("granitemoe_attention_dropout", "granitemoe", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("granitemoe_logits_scaling_zero", "granitemoe", dict(logits_scaling=0.0), "logits_scaling"),
    # clip_qkv clamps q, k and v (test_families_olmoe shows it moves transformers' output)
    Refusal("olmoe_clip_qkv", "olmoe", dict(clip_qkv=0.05), "clip_qkv", ("0.05",)),
    # ERNIE 4.5 MoE: biases on every Linear (its shared experts' and lm_head's too), and a
    # negative renormalisation floor (torch.clamp's min below any sum: no floor a file means)
    Refusal("ernie4_5_moe_use_bias", "ernie4_5_moe", dict(use_bias=True), "use_bias", ("ernie4_5_moe",)),
    Refusal("ernie4_5_moe_norm_min_negative", "ernie4_5_moe", dict(moe_norm_min=-0.5), "moe_norm_min", ("-0.5",)),
    # GLM-4.5's group limit: groups that do not split the experts evenly (Glm4MoeTopkRouter's view
    # fails), and kept groups holding fewer experts than num_experts_per_tok (its top k would
    # take masked ones)
    Refusal("glm4_moe_n_group_uneven", "glm4_moe", dict(n_group=3), "n_group", ("3",)),
    Refusal("glm4_moe_topk_group_small", "glm4_moe", dict(num_experts_per_tok=5), "topk_group", ("5",)),
    Refusal("dots1_n_group_uneven", "dots1", dict(n_group=3), "n_group", ("3",)),
    # a scaled RoPE type reads the factor and Dots1Attention then fails (whole heads rotate)
    Refusal("dots1_yarn_partial_rotary", "dots1", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "dots1", "yarn")),
    # q_norm spans hidden_size: a head_dim with heads x head_dim != hidden fails in transformers
    Refusal("olmoe_head_dim", "olmoe", dict(head_dim=16), "head_dim", ("olmoe",)),
    Refusal("flex_olmo_attention_dropout", "flex_olmo", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("flex_olmo_yarn_partial_rotary", "flex_olmo", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "flex_olmo", "yarn")),
    Refusal("phi3_resid_pdrop", "phi3", dict(resid_pdrop=0.1), "resid_pdrop"),
    # partial_rotary_factor with a scaled RoPE type outside phi3: the type's init function
    # (modeling_rope_utils) reads the factor and returns inv_freq for int(head_dim * factor)
    # features, but the family's apply_rotary_pos_emb multiplies whole heads by those cos/sin:
    # transformers' forward fails (test_oracle_partial_rotary_scaled_fails pins it), ctitan
    # refuses naming the key, the value and the family. One per family, every scaled type once.
    Refusal("llama_yarn_partial_rotary", "llama", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "llama", "yarn")),
    Refusal("mistral_linear_partial_rotary", "mistral", dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.75}),
        "partial_rotary_factor", ("0.75", "mistral", "linear")),
    Refusal("qwen2_dynamic_partial_rotary", "qwen2", dict(
        partial_rotary_factor=0.5, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
        "partial_rotary_factor", ("0.5", "qwen2", "dynamic")),
    Refusal("qwen3_yarn_partial_rotary", "qwen3", dict(
        partial_rotary_factor=0.5, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                     "original_max_position_embeddings": 32}),
        "partial_rotary_factor", ("0.5", "qwen3", "yarn")),
    Refusal("qwen3_moe_llama3_partial_rotary", "qwen3_moe", dict(
        rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
                         "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "qwen3_moe", "llama3")),
    Refusal("mixtral_longrope_partial_rotary", "mixtral", dict(
        head_dim=8,  # longrope reads config.head_dim, which MixtralConfig leaves None
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 32,
                         "short_factor": [1.0] * 2, "long_factor": [2.0] * 2, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "mixtral", "longrope")),
    Refusal("olmo2_linear_partial_rotary", "olmo2", dict(
        partial_rotary_factor=0.25, rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}),
        "partial_rotary_factor", ("0.25", "olmo2", "linear")),
    Refusal("gemma3_yarn_partial_rotary", "gemma3_text", dict(
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                            "original_max_position_embeddings": 32,
                                            "partial_rotary_factor": 0.5}}),
        "partial_rotary_factor", ("0.5", "gemma3_text", "yarn")),
    # phi3 rotates int(head_dim * factor) features; an odd count (8 * 0.625 = 5) gives
    # transformers an inv_freq of ceil(5 / 2) = 3 and frequencies over 5: no published model
    Refusal("phi3_partial_rotary_odd", "phi3", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.625}),
        "partial_rotary_factor", ("0.625", "phi3")),
    # bidirectional attention (Gemma3 embedding models): the mask is not causal
    Refusal("gemma3_bidirectional", "gemma3_text", dict(use_bidirectional_attention=True),
            "use_bidirectional_attention"),
    Refusal("gemma2_bidirectional", "gemma2", dict(use_bidirectional_attention=True),
            "use_bidirectional_attention"),
    Refusal("gemma_bidirectional", "gemma", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    Refusal("gemma2_yarn_partial_rotary", "gemma2", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "gemma2", "yarn")),
    # a cap of 0: transformers divides the scores by it (flat or NaN attention), not a model
    Refusal("gemma2_attn_softcap_zero", "gemma2", dict(attn_logit_softcapping=0.0), "attn_logit_softcapping"),
    # exact (erf) GELU: Gemma2 reads hidden_activation as it is (only GemmaConfig maps "gelu")
    Refusal("gemma2_hidden_activation_gelu", "gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
    # transformers 4.x's GemmaMLP computed hidden_activation, 5.x computes hidden_act: a file
    # whose two keys disagree is a different model under each
    Refusal("gemma_hidden_activation_disagrees", "gemma", dict(hidden_activation="silu"), "hidden_activation",
            ("hidden_act", "silu")),
    Refusal("gemma_final_softcap", "gemma", dict(final_logit_softcapping=30.0), "final_logit_softcapping"),
    # logits / 0 (inf, nan) and a zero scale (ctitan reads 0 as head_dim^-0.5): not models
    Refusal("granite_logits_scaling_zero", "granite", dict(logits_scaling=0.0), "logits_scaling"),
    Refusal("granite_attention_multiplier_zero", "granite", dict(attention_multiplier=0.0), "attention_multiplier"),
    Refusal("granite_attention_dropout", "granite", dict(attention_dropout=0.1), "attention_dropout"),
    # SmolLM3Attention indexes no_rope_layers by layer: a shorter list fails there
    Refusal("smollm3_no_rope_layers_short", "smollm3", dict(no_rope_layers=[1, 0, 1], layer_types=_SMOL_TYPES),
            "no_rope_layers"),
    Refusal("smollm3_no_rope_layers_two", "smollm3", dict(no_rope_layers=[1, 0, 2, 1]), "no_rope_layers"),
    # layer_types slides a layer while use_sliding_window is off: the eager mask slides, the
    # flash path (sliding_window=None) does not; ctitan refuses rather than pick one
    Refusal("smollm3_sliding_without_use_sliding_window", "smollm3", dict(use_sliding_window=False,
                                                                          layer_types=_SMOL_TYPES),
            "use_sliding_window"),
    Refusal("olmo3_attention_dropout", "olmo3", dict(attention_dropout=0.1), "attention_dropout"),
    # SeedOssConfig's defaults (0.1 each, set here explicitly; absent: test_families_ernie_seed)
    Refusal("seed_oss_attention_dropout", "seed_oss", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("seed_oss_residual_dropout", "seed_oss", dict(residual_dropout=0.1), "residual_dropout"),
    # a flat rope_parameters: Olmo3Config keeps its keys beside the per-type entries it
    # fills with default_theta, so the flat rope_theta is ignored
    # Helium's o_proj maps hidden_size features: heads x head_dim != hidden_size fails in transformers
    Refusal("helium_head_dim_not_hidden", "helium", dict(head_dim=16), "head_dim", ("helium", "hidden_size")),
    Refusal("helium_attention_dropout", "helium", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("helium_linear_partial_rotary", "helium", dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "helium", "linear")),
    Refusal("vaultgemma_yarn_partial_rotary", "vaultgemma", dict(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                         "original_max_position_embeddings": 32, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "vaultgemma", "yarn")),
    Refusal("vaultgemma_attn_softcap_zero", "vaultgemma", dict(attn_logit_softcapping=0.0), "attn_logit_softcapping"),
    Refusal("vaultgemma_attention_dropout", "vaultgemma", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("hunyuan_attention_dropout", "hunyuan_v1_dense", dict(attention_dropout=0.1), "attention_dropout"),
    Refusal("hunyuan_linear_partial_rotary", "hunyuan_v1_dense", dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0, "partial_rotary_factor": 0.5}),
        "partial_rotary_factor", ("0.5", "hunyuan_v1_dense", "linear")),
    Refusal("olmo3_flat_rope_parameters", "olmo3", dict(
        rope_parameters={"rope_type": "default", "rope_theta": 1e4}), "rope_parameters"),
]


def refusal_config(r: Refusal):
    base = next(c for c in CASES if c.family == r.family)
    return make_config(Case(r.id, r.family, {**base.kw, **r.kw}))


# --------------------------------------------------------------------------- models

def make_config(case: Case):
    C, _ = FAMILIES[case.family]
    kw = {**BASE, **case.kw}
    cfg = C(**kw, attn_implementation="eager")
    cfg._attn_implementation = "eager"
    if case.moe:
        cfg._experts_implementation = "eager"
    assert cfg.model_type == case.family, (cfg.model_type, case.family)
    return cfg


def init_weights(model, family: str, seed: int, std: float = 0.1, norm_jitter: float = 0.2):
    """Matrices (and 3-D expert stacks) and biases N(0, std); norm weights 1 + U(-j, j),
    the Gemma families' (which scale by 1 + w) U(-j, j)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 or name.endswith(".bias"):
                p.copy_(std * torch.randn(p.shape, generator=g))
            else:
                u = norm_jitter * (2 * torch.rand(p.shape, generator=g) - 1)
                p.copy_(u if family in GEMMA else 1.0 + u)
        for name, p in model.named_parameters():
            if name.endswith(ERNIE_BIAS_MEM):  # ctitan routes by a zero bias (it refuses others)
                p.zero_()


def build(case: Case, seed: int | None = None):
    cfg = make_config(case)
    _, M = FAMILIES[case.family]
    model = M(cfg).to(torch.float32)
    init_weights(model, case.family, case.seed if seed is None else seed)
    if case.score_bias:
        g = torch.Generator().manual_seed(1000 + case.seed)
        with torch.no_grad():
            for name, p in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(BIAS_MEM):
                    p.copy_(case.score_bias * torch.randn(p.shape, generator=g))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.eval()
    return model


def prepare_loaded(model, family):
    """A model from from_pretrained, in the oracle's eager, fp32, eval settings."""
    model.config._attn_implementation = "eager"
    if family in MOE:
        model.config._experts_implementation = "eager"
    model.eval()
    return model


# --------------------------------------------------------------------------- names

def _np(t):
    return t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def _mixtral_files(named: dict) -> dict[str, np.ndarray]:
    out = {}
    for n, t in named.items():
        a = _np(t)
        if n.endswith(".mlp.gate.weight"):
            out[n.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")] = a
        elif n.endswith(".mlp.experts.gate_up_proj"):
            base = n[: -len("mlp.experts.gate_up_proj")] + "block_sparse_moe.experts."
            im = a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{base}{e}.w1.weight"] = a[e, :im]   # gate: the first half (chunk order)
                out[f"{base}{e}.w3.weight"] = a[e, im:]   # up
        elif n.endswith(".mlp.experts.down_proj"):
            base = n[: -len("mlp.experts.down_proj")] + "block_sparse_moe.experts."
            for e in range(a.shape[0]):
                out[f"{base}{e}.w2.weight"] = a[e]
        else:
            assert ".mlp." not in n or "experts" not in n, n
            out[n] = a
    return out


GRANITE_MOE = {"granitemoe", "granitemoeshared"}


def _granite_split(named: dict, fused_names: dict) -> dict[str, np.ndarray]:
    """GraniteMoE's fused expert tensors [E, 2I, H] / [E, H, I] (and the shared MLP's
    input_linear [2S, H]) split as ctitan's table holds them: expert e's gate rows are the
    first I of its slice (GraniteMoeExperts chunks gate_up_proj's output as gate, up), its up
    rows the rest; GraniteMoeSharedMLP chunks input_linear's output the same way."""
    out = {}
    for n, t in named.items():
        a = _np(t)
        kind = next((k for k in fused_names if n.endswith(k)), None)
        if kind is None:
            out[n] = a
            continue
        base = n[: -len(kind)]
        what = fused_names[kind]
        if what == "gate_up":
            im = a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{base}block_sparse_moe.experts.{e}.gate_proj.weight"] = a[e, :im]
                out[f"{base}block_sparse_moe.experts.{e}.up_proj.weight"] = a[e, im:]
        elif what == "down":
            for e in range(a.shape[0]):
                out[f"{base}block_sparse_moe.experts.{e}.down_proj.weight"] = a[e]
        elif what == "router":
            out[f"{base}block_sparse_moe.router.layer.weight"] = a
        else:  # the shared MLP's input_linear
            s = a.shape[0] // 2
            out[f"{base}shared_mlp.gate_proj.weight"] = a[:s]
            out[f"{base}shared_mlp.up_proj.weight"] = a[s:]
    return out


# in-memory names (transformers 5 renames the files' on load) and the files' own
_GRANITE_MEM = {"block_sparse_moe.experts.gate_up_proj": "gate_up", "block_sparse_moe.experts.down_proj": "down",
                "block_sparse_moe.router.weight": "router", "shared_mlp.input_linear.weight": "shared"}
_GRANITE_FILE = {"block_sparse_moe.input_linear.weight": "gate_up", "block_sparse_moe.output_linear.weight": "down",
                 "block_sparse_moe.router.layer.weight": "router", "shared_mlp.input_linear.weight": "shared"}


def ctitan_view(family: str, files: dict) -> dict[str, np.ndarray]:
    """{safetensors file name: ndarray} -> {ctitan tensor name: ndarray}: the same but for
    GraniteMoE, whose files fuse what ctitan holds per expert."""
    if family in ("ernie4_5_moe", *SIGMOID_ROUTER):  # the file's router bias is no ctitan tensor (router_biases)
        bias = {n for n in files if n.endswith(("mlp.moe_statics.e_score_correction_bias", GLM_BIAS_MEM))}
        assert bias, sorted(files)
        return {n: a for n, a in files.items() if n not in bias}
    return _granite_split(files, _GRANITE_FILE) if family in GRANITE_MOE else files


def to_file_names(family: str, named: dict) -> dict[str, np.ndarray]:
    """{transformers in-memory name: tensor} -> {safetensors file (= ctitan) name: ndarray}
    (GraniteMoE: ctitan's names, ctitan_view of the file's)."""
    if family in ("qwen3_moe", "qwen2_moe", "olmoe", "flex_olmo"):
        return oracle_moe.per_expert(named)
    if family in ("ernie4_5_moe", *SIGMOID_ROUTER):  # the frozen router bias is no parameter of ctitan's
        return oracle_moe.per_expert({n: t for n, t in named.items() if not n.endswith(BIAS_MEM)})
    if family == "mixtral":
        return _mixtral_files(named)
    if family in GRANITE_MOE:
        return _granite_split(named, _GRANITE_MEM)
    return {n: _np(t) for n, t in named.items()}


def file_params(model, family) -> dict[str, np.ndarray]:
    return {n: a.copy() for n, a in to_file_names(family, dict(model.named_parameters())).items()}


# --------------------------------------------------------------------------- data

def batch(model, B, T, seed, n_ignore=5):
    """(tokens, labels) [B, T] int64: random tokens, random labels with n_ignore of them -100
    (as test_parity.make_batch), and the config's pad_token_id (if any) at two positions of
    every row."""
    rng = np.random.default_rng(seed)
    V = model.config.vocab_size
    tokens = rng.integers(0, V, size=(B, T)).astype(np.int64)
    labels = rng.integers(0, V, size=(B, T)).astype(np.int64)
    labels.reshape(-1)[rng.choice(B * T, size=n_ignore, replace=False)] = IGNORE
    add_pad(model, tokens, rng)
    return tokens, labels


def add_pad(model, tokens, rng):
    """The pad token at two random positions of every row (in place); no-op without one."""
    pad = model.config.pad_token_id
    if pad is not None:
        for row in tokens.reshape(-1, tokens.shape[-1]):
            row[rng.choice(row.size, size=2, replace=False)] = pad
    return tokens


# --------------------------------------------------------------------------- loss / grads

def forward(model, family, tokens, labels):
    """(CE sum over valid labels, aux loss or None, logits, router logits or ())."""
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    if family in MOE:
        out = model(input_ids=tokens, output_router_logits=True)
        router = out.router_logits
        aux = out.aux_loss if model.config.output_router_logits else None
    else:
        out = model(input_ids=tokens)
        router, aux = (), None
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE,
                         reduction="sum")
    return ce, aux, logits, router


def router_biases(model) -> list:
    """ERNIE 4.5 MoE's (GLM-4.5's) e_score_correction_bias [E] of each sparse layer in order (the
    routers' order in router_logits); [] for a family without one."""
    named = [*model.named_parameters(), *model.named_buffers()]
    return [p.detach().reshape(-1).float() for n, p in named if n.endswith(BIAS_MEM)]


def glm_router_gap(router, biases, cfg):
    """GLM-4.5's router (Glm4MoeTopkRouter): the smallest gap, over its tokens, between the
    topk_group-th and the next group score (the sum of a group's two best biased sigmoid scores)
    and between the k-th and (k+1)-th biased score among the kept groups' experts."""
    gaps = []
    G, kg, k = cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    for rl, b in zip(router, biases):
        sc = torch.sigmoid(rl.detach().float()) + b
        gs = sc.view(sc.shape[0], G, -1).topk(2, dim=-1).values.sum(-1)
        top = gs.sort(dim=-1, descending=True).values
        if kg < G:
            gaps.append(float((top[:, kg - 1] - top[:, kg]).min()))
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(kg, dim=-1).indices, 1.0)
        masked = sc.masked_fill(~keep.repeat_interleave(sc.shape[1] // G, dim=1).bool(), float("-inf"))
        t = masked.sort(dim=-1, descending=True).values
        if torch.isfinite(t[:, k]).all():
            gaps.append(float((t[:, k - 1] - t[:, k]).min()))
    return min(gaps) if gaps else 1.0


def _router_stats(router, k, biases=()):
    """The smallest gap between a router's k-th and (k+1)-th probability, and (a selection bias)
    between its k-th and (k+1)-th biased score: a near-tie in either would let float rounding
    change the chosen experts or the aux loss's own top k."""
    gaps = []
    for i, rl in enumerate(router):
        p = torch.softmax(rl.detach().float(), dim=-1)
        for score in (p, p + biases[i]) if i < len(biases) else (p,):
            top = torch.topk(score, min(k + 1, p.shape[-1]), dim=-1).values
            if top.shape[-1] > k:
                gaps.append(float((top[:, k - 1] - top[:, k]).min()))
    return min(gaps) if gaps else 1.0


def _gap(model, family, router):
    if family in SIGMOID_ROUTER:
        return glm_router_gap(router, router_biases(model), model.config)
    return _router_stats(router, model.config.num_experts_per_tok, router_biases(model)) if family in MOE else 1.0


def loss_and_grads(model, family, tokens, labels):
    """As the family's ForCausalLM.forward adds it: mean CE (+ router_aux_loss_coef * aux when
    output_router_logits is on), its gradient for every parameter in file names, the CE alone,
    the aux loss alone, the logits and the smallest top-k gap of the routers (MoE)."""
    model.zero_grad(set_to_none=True)
    ce, aux, logits, router = forward(model, family, tokens, labels)
    ce_mean = ce / oracle.n_valid(labels)
    loss = ce_mean if aux is None else ce_mean + model.config.router_aux_loss_coef * aux
    loss.backward()
    grads = to_file_names(family, {n: p.grad for n, p in model.named_parameters()})
    grads = {n: g.copy() for n, g in grads.items()}
    model.zero_grad(set_to_none=True)
    gap = _gap(model, family, router)
    return {"loss": loss.item(), "ce": ce_mean.item(), "aux": None if aux is None else float(aux.detach()),
            "logits": logits.detach().numpy(), "grads": grads, "min_gap": gap}


@torch.no_grad()
def logits(model, family, tokens):
    t = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    return model(input_ids=t).logits.float().numpy()


# --------------------------------------------------------------------------- optimizer steps

def reference_steps(model, family, mbs, *, accum, steps, run_steps, lr, betas, eps, weight_decay, max_norm,
                    warmup_steps, decay_ratio=None, decay_type="linear", min_lr_factor=0.0):
    """oracle.reference_train's loop over the given micro-batches (accum per step) with the
    MoE aux term as ctitan's trainer weighs it: each micro-batch adds the gradient of
    CE_sum / (step's valid labels) + coef * aux / accum. Returns per-step CE losses, pre-clip
    grad norms, lrs, the smallest router gap seen, and the final weights in file names."""
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, oracle.make_lr_lambda(steps, warmup_steps, decay_ratio, decay_type, min_lr_factor))
    losses, norms, lrs, gaps = [], [], [], []
    model.train()
    for s in range(run_steps):
        step_mbs = mbs[s * accum:(s + 1) * accum]
        total = sum(oracle.n_valid(lab) for _, lab in step_mbs)
        opt.zero_grad(set_to_none=True)
        ce_sum = 0.0
        for inp, lab in step_mbs:
            ce, aux, _, router = forward(model, family, inp, lab)
            loss = ce / total
            if aux is not None:
                loss = loss + model.config.router_aux_loss_coef * aux / accum
            loss.backward()
            ce_sum += ce.item()
            if family in MOE:
                gaps.append(_gap(model, family, router))
        gn = torch.nn.utils.clip_grad_norm_(params, max_norm)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(ce_sum / total)
        norms.append(float(gn))
    model.eval()
    return {"losses": losses, "grad_norms": norms, "lrs": lrs, "min_gap": min(gaps) if gaps else 1.0,
            "params": file_params(model, family)}


# --------------------------------------------------------------------------- files

def save(model, path) -> Path:
    path = Path(path)
    model.save_pretrained(str(path))
    return path


def config_json(path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def load(path, family):
    """from_pretrained (fp32, eager) asserting nothing missing / unexpected / mismatched."""
    return prepare_loaded(oracle.load_hf(path), family)


def scaled_copy(model, factor):
    """A deep copy with every parameter multiplied by `factor` (exact in fp32 for 1.5), but for
    ERNIE 4.5 MoE's frozen router bias (no ctitan parameter: a session moves the others)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if not n.endswith(BIAS_MEM):
                p.mul_(factor)
    return m


def zero_biases(*names):
    """A model edit: the biases of the named projections set to 0 (the tests that show a
    family's bias switch moves transformers' own output)."""
    def f(m):
        with torch.no_grad():
            for n, p in m.named_parameters():
                if any(n.endswith(x + ".bias") for x in names):
                    p.zero_()
    return f


def halves_rope_err(monkeypatch, case, family, modeling, B, seed=5):
    """How far transformers' logits move when a family's RoPE on interleaved pairs is
    replaced by Llama's rotate_half on the halves of the head (its modeling module's
    apply_rotary_pos_emb patched): what a halves-for-pairs mistake in ctitan would cost."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as halves
    a = build(case)
    tokens, _ = batch(a, B, case.T, seed=seed)
    with torch.no_grad():
        want = logits(a, family, tokens)
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", halves)
        return oracle.rel_err(logits(a, family, tokens), want)


def resume_with_other_config(tmp_path, run_ctitan, family, kw, **change):
    """A 4-step run of family's config kw stopped at step 2 (exit 75, its checkpoint kept),
    then resumed with config.json kw + change: asserts the resume is refused and returns
    its stderr, for the caller to check the key it names."""
    make_config(Case("a", family, kw)).save_pretrained(tmp_path / "a")
    make_config(Case("b", family, dict(kw, **change))).save_pretrained(tmp_path / "b")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    args = ["train", "--model.spec=hf", f"--training.dataset_path={data}", "--training.seq_len=16",
            "--training.local_batch_size=2", "--training.steps=4", "--checkpoint.enable", "--checkpoint.interval=2",
            "--checkpoint.last_save_model_only=false", f"--job.dump_folder={tmp_path / 'o'}"]
    rc, _, err = run_ctitan(args + [f"--model.hf_assets_path={tmp_path / 'a'}", "--training.stop_at_step=2"],
                            check=False)
    assert rc == 75, err
    rc, _, err = run_ctitan(args + [f"--model.hf_assets_path={tmp_path / 'b'}"], check=False)
    assert rc != 0, f"resumed with {change}"
    return err


def assert_moe_bf16_like_emulation(tmp_path, open_session, case: Case, B: int, seed: int | None = None,
                                   drop_idle: bool = False):
    """training.mixed_precision_param = bfloat16 on a MoE case, against test_moe's emulation of
    ctitan's bf16 semantics (every linear, the experts', the router's and the shared experts'
    alike, rounds x, w and d(out) to bf16; bf16 attention), with test_bf16.assert_like_emulation's
    bounds: the weights of `seed` (None: the case's) saved, one batch of B, ctitan's bf16 and fp32
    runs against transformers' fp32 and its bf16 emulation (float32 and float64 twins). The
    emulation patches F.linear, which takes no bias: cases without attention biases.
    drop_idle: leave out the tensors transformers' fp32 gives no gradient (an expert no token of
    the batch chose, under a group-limited router), after checking ctitan's runs give none too:
    there is no bf16 effect to point anywhere."""
    from conftest import hf_session_args
    from test_bf16 import BF16, assert_like_emulation, with_float64_twin
    from test_moe import _Bf16Emulation

    model = build(case, seed=seed)
    save(model, tmp_path / "hf")
    tokens, labels = batch(model, B, case.T, seed=5)
    r32 = loss_and_grads(build(case, seed=seed), case.family, tokens, labels)
    emus = []
    for m in with_float64_twin(lambda: build(case, seed=seed)):
        with _Bf16Emulation(m, experts=True):
            r = loss_and_grads(m, case.family, tokens, labels)
        emus.append((r["ce"], r["logits"], r["grads"]))

    def run(extra):
        s = open_session(hf_session_args(tmp_path / "hf", batch=B, seq_len=case.T, extra=extra))
        logits = s.logits(tokens)
        s.zero_grad()
        nv = oracle.n_valid(labels)
        loss = s.forward_backward(tokens, labels, nv) / nv
        return loss, logits, {n: s.get_grad(n) for n in s.names()}

    loss, logits, grads = run([BF16])
    c32 = run([])[2]
    idle = [n for n, g in r32["grads"].items() if not g.any()] if drop_idle else []
    assert all(not grads[n].any() and not c32[n].any() for n in idle), idle
    keep = lambda d: {n: g for n, g in d.items() if n not in idle}  # noqa: E731
    emus = [(le, lg, keep(ge)) for le, lg, ge in emus]
    assert_like_emulation(loss, logits, keep(grads), keep(c32), r32["ce"], emus, keep(r32["grads"]))
