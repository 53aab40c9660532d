"""Twelfth mutation audit (docs/reliability.md): HunYuan's ntk_alpha is switched on by a truthy
alpha (HunYuanDenseV1RotaryEmbedding: `rope_type == "dynamic" and rope_parameters.get("alpha")`);
alpha = 0 is transformers' plain dynamic RoPE. Planted: ctitan refusing alpha 0 as not positive
passed (the suite gives alpha 3 or none). A file with alpha 0.0 loads, and its logits are
transformers' on the same file."""
import dataclasses

import oracle
import oracle_families as of
from conftest import hf_session_args
from test_families import B, TOL

HY = of.CASE["hunyuan_qknorm_after_rope_bias"]


def test_zero_alpha_is_plain_dynamic(tmp_path, open_session):
    kw = {**HY.kw, "max_position_embeddings": 32,
          "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0, "alpha": 0.0}}
    model = of.build(dataclasses.replace(HY, kw=kw))
    d = of.save(model, tmp_path / "hf")
    loaded = of.load(d, "hunyuan_v1_dense")
    tokens, _ = of.batch(loaded, B, 16, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=16))
    err = oracle.rel_err(s.logits(tokens), of.logits(loaded, "hunyuan_v1_dense", tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


def test_other_families_dynamic_ignores_alpha(tmp_path, open_session):
    """Only HunYuan's rotary embedding reads alpha; Qwen3's dynamic RoPE (transformers'
    _compute_dynamic_ntk_parameters) never does. Planted: alpha read for every family passed.
    A Qwen3 file whose dynamic rope_parameters carry alpha 3: ctitan's logits are transformers'."""
    cfg = oracle.tiny_config(vocab=128, layers=2)
    cfg.max_position_embeddings = 32
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0, "alpha": 3.0}
    model = oracle.save_random_hf(tmp_path / "hf", cfg, seed=3)
    tokens = oracle.random_tokens(2 * 16, 128, seed=5).reshape(2, 16)
    s = open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=16))
    err = oracle.rel_err(s.logits(tokens), oracle.hf_logits(model, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


def test_ntk_alpha_keeps_the_position_limit(tmp_path, run_ctitan):
    """ntk_alpha's base is fixed, so max_position_embeddings stays the model's limit (plain
    dynamic has none: it stretches with the length): training.seq_len past it warns naming the
    key. Planted: the alpha type counted as dynamic (no limit) passed."""
    kw = {**HY.kw, "max_position_embeddings": 32,
          "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0, "alpha": 3.0}}
    d = of.save(of.build(dataclasses.replace(HY, kw=kw)), tmp_path / "hf")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(20 * 65, 64, seed=1))
    _, out, err = run_ctitan(["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={d}",
                              f"--training.dataset_path={data}", "--training.seq_len=64"])
    assert "training.seq_len (64) exceeds the 32 positions" in out + err, out + err
