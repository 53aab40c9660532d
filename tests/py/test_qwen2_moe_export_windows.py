"""qwen2_moe's exported config.json: its max_window_layers agrees with its layer_types under
Qwen2MoeConfig's own rule (even layers BELOW max_window_layers slide, the opposite of Qwen2's),
so a reader that derives the windows from max_window_layers (transformers without layer_types)
gets the layers ctitan trained. Expected: transformers' AutoConfig on the source config."""
from __future__ import annotations

import json

import oracle_families as fam


def test_export_max_window_layers_matches_layer_types(tmp_path, run_ctitan):
    from transformers import AutoConfig
    kw = dict(fam.CASE["qwen2_moe_step2_aux"].kw, num_hidden_layers=4, use_sliding_window=True, sliding_window=6,
              max_window_layers=3)
    src = tmp_path / "m"
    fam.make_config(fam.Case("q2m_swa", "qwen2_moe", kw)).save_pretrained(src)
    c = json.loads((src / "config.json").read_text())
    del c["layer_types"]  # Qwen2MoeConfig's rule decides them
    (src / "config.json").write_text(json.dumps(c))
    want = AutoConfig.from_pretrained(src).layer_types
    assert want == ["sliding_attention", "full_attention", "sliding_attention", "full_attention"], want
    out = tmp_path / "out"
    out.mkdir()
    run_ctitan(["describe", src, "--config-out", out / "config.json"])
    e = json.loads((out / "config.json").read_text())
    assert e["layer_types"] == want, e["layer_types"]
    del e["layer_types"]
    (out / "config.json").write_text(json.dumps(e))
    got = AutoConfig.from_pretrained(out).layer_types
    assert got == want, f"max_window_layers {e['max_window_layers']} gives {got}, layer_types said {want}"
