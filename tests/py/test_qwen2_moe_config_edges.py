"""qwen2_moe's shared expert width at its edges (the ninth mutation audit).

- lm_config_check's parameter guard counts the shared expert: its 3 x hidden x shared_expert_intermediate_size weights a sparse layer are the
largest term of a config whose other sizes are small, and without them the guard let a model
of some 1.6 x 2^50 parameters through to allocation. Expected count: Qwen2MoeSparseMoeBlock's
  shared_expert (gate, up: Is x H; down: H x Is) per sparse layer, summed by hand below.
- shared_expert_intermediate_size 0 is refused naming the key (exit 2, a config error), as
  every other size of 0 is: read as 0 the model had no shared expert and no gate, where
  transformers builds a [1, H] gate over an empty expert. Reading 0 as valid passed every
  test."""
import json

SHARED = 2 ** 31 - 1
CONF = {"model_type": "qwen2_moe", "vocab_size": 64, "hidden_size": 65536, "intermediate_size": 8,
        "num_hidden_layers": 4, "num_attention_heads": 8192, "num_key_value_heads": 8192,
        "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
        "shared_expert_intermediate_size": SHARED}


def test_shared_expert_counts_toward_the_parameter_limit(tmp_path, run_ctitan):
    c = CONF
    H, L = c["hidden_size"], c["num_hidden_layers"]
    hd = H // c["num_attention_heads"]
    attn = H * (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd * 2
    routed = c["num_experts"] * (3 * H * c["moe_intermediate_size"] + H)
    shared = 3 * H * SHARED + H
    assert 2 * c["vocab_size"] * H + L * (attn + routed) < 2 ** 50  # the rest alone is in range
    assert 2 * c["vocab_size"] * H + L * (attn + routed + shared) > 2 ** 50
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(c))
    rc, _, err = run_ctitan(["describe", d], check=False)
    assert rc == 2 and "config.json" in err and "out of range (at most 2^50)" in err, (rc, err[-2000:])
    # the message names the width that pushed the count out of range, not only the dense sizes
    assert f"shared_expert_intermediate_size {SHARED}" in err, err[-2000:]


def test_shared_width_zero_refused(tmp_path, run_ctitan):
    c = dict(CONF, hidden_size=32, num_attention_heads=4, num_key_value_heads=4, shared_expert_intermediate_size=0)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(c))
    rc, _, err = run_ctitan(["describe", d], check=False)
    assert rc == 2 and "config.json" in err and "shared_expert_intermediate_size" in err, (rc, err[-2000:])
