"""What ctitan reads from a qwen2_moe, smollm3 or olmo3 config.json that leaves keys out (the
ninth mutation audit): each config class's defaults, as transformers reads the same file.

Every file the family tests wrote (save_pretrained) names the sizes ctitan would otherwise
default, so changing Qwen2MoeConfig's default num_experts (60), num_experts_per_tok (4),
moe_intermediate_size (1408) or shared_expert_intermediate_size (5632), or SmolLM3's
no_rope_layer_interval (4), passed every test. A file of the sizes alone (and one that turns
the window on) must export, through describe --config-out, what AutoConfig read from it, key
by key; the layers that slide and those without RoPE included (Qwen2MoeConfig's
max_window_layers bound read as `<=` passed too)."""
import json

import pytest

SIZES = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 8, "num_attention_heads": 16}
# written by ctitan's export but not config attributes transformers reads back as they are;
# max_window_layers: ctitan writes the bound its sliding layers need (Qwen2MoeConfig's rule
# gives the same layer_types, compared instead); qwen2_moe's sliding_window without
# use_sliding_window: ctitan writes null, transformers keeps the number it ignores
NOT_COMPARED = {"architectures", "dtype", "max_window_layers"}
CASES = {
    "qwen2_moe": ({"vocab_size": 64}, ["num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                                       "rope_parameters", "num_experts", "num_experts_per_tok",
                                       "moe_intermediate_size", "shared_expert_intermediate_size", "qkv_bias",
                                       "decoder_sparse_step", "norm_topk_prob", "layer_types"]),
    "qwen2_moe_window": ({"vocab_size": 64, "use_sliding_window": True},
                         ["sliding_window", "layer_types", "num_experts", "shared_expert_intermediate_size"]),
    # Qwen2MoeConfig: the even-numbered layers below max_window_layers slide (layer 4 does not)
    "qwen2_moe_window_mw": ({"vocab_size": 64, "use_sliding_window": True, "max_window_layers": 4},
                            ["sliding_window", "layer_types"]),
    # SmolLM3Config's pad_token_id 128004 must lie in the vocabulary ctitan reads
    "smollm3": ({"vocab_size": 128256}, ["num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                                         "rope_parameters", "pad_token_id", "tie_word_embeddings",
                                         "no_rope_layers", "layer_types", "attention_bias", "mlp_bias"]),
    "smollm3_window": ({"vocab_size": 128256, "use_sliding_window": True, "sliding_window": 16},
                       ["no_rope_layers", "layer_types", "sliding_window"]),
    "olmo3": ({"vocab_size": 64}, ["num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                                   "rope_parameters", "pad_token_id", "tie_word_embeddings", "layer_types",
                                   "sliding_window"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_absent_keys_take_the_config_class_defaults(tmp_path, run_ctitan, case):
    from transformers import AutoConfig
    extra, must = CASES[case]
    model_type = case.split("_window")[0]
    d = tmp_path / case
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **SIZES, **extra}))
    hf = AutoConfig.from_pretrained(d)
    run_ctitan(["describe", d, "--config-out", d / "out.json"])
    out = json.loads((d / "out.json").read_text())
    missing = object()
    compared = []
    for k, v in out.items():
        h = getattr(hf, k, missing)
        if k in NOT_COMPARED or h is missing:
            continue
        if k == "sliding_window" and model_type == "qwen2_moe" and not hf.use_sliding_window:
            continue
        assert v == h, f"{case}: {k} = {v!r}, transformers reads {h!r}"
        compared.append(k)
    left = set(must) - set(compared)
    assert not left, f"{case}: not compared {left}"
    if "_window" in case:  # the window reaches some layers, not none or all
        assert 0 < hf.layer_types.count("sliding_attention") < len(hf.layer_types), hf.layer_types
