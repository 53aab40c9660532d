"""A config.json that writes num_key_value_heads or head_dim as null: the config classes that
take None there (Ernie4_5Config, SeedOssConfig, Qwen2Config, LlamaConfig ...) derive
num_attention_heads and hidden_size // num_attention_heads in __post_init__, whatever their
default for an absent key (ERNIE's 2 kv heads and head_dim 128, Seed-OSS's 8 and 128,
Qwen2's 32 kv heads). ctitan kept the absent key's default for null, so describe (and the
model trained, its export) had other projection shapes than transformers builds from the
same file (review10). The oracle: transformers' parameter count of the model from that file."""
import json

import pytest

import oracle_families as of


def _count(d):
    from transformers import AutoConfig, AutoModelForCausalLM
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).parameters())


# (case, key, heads): heads set so that the absent key's default still divides them, so that
# only the count (not a refusal) can tell the two readings apart
@pytest.mark.parametrize("cid,key,heads", [
    ("ernie4_5_bias_tied", "num_key_value_heads", 4), ("ernie4_5_bias_tied", "head_dim", 4),
    ("seed_oss_outbias_mlpbias", "num_key_value_heads", 16), ("seed_oss_outbias_mlpbias", "head_dim", 8),
    ("qwen2_bias_tied", "num_key_value_heads", 64)])
def test_null_size_derived_as_transformers(cid, key, heads, tmp_path, run_ctitan):
    d = of.save(of.build(of.CASE[cid]), tmp_path / "hf")
    conf = of.config_json(d)
    absent_default = {"num_key_value_heads": {"ernie4_5": 2, "seed_oss": 8, "qwen2": 32},
                      "head_dim": {"ernie4_5": 128, "seed_oss": 128}}[key][conf["model_type"]]
    conf["num_attention_heads"] = heads
    conf["hidden_size"] = 8 * heads
    conf.pop("num_key_value_heads", None)
    conf["head_dim"] = 8
    conf[key] = None
    (d / "config.json").write_text(json.dumps(conf))
    from transformers import AutoConfig
    got = getattr(AutoConfig.from_pretrained(d), key)
    want_size = heads if key == "num_key_value_heads" else 8
    assert got == want_size != absent_default, f"test setup: transformers reads null {key} as {got}"
    _, out, _ = run_ctitan(["describe", d, "--json"])
    assert json.loads(out)["num_parameters"] == _count(d), (cid, key, out)
