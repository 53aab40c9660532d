"""ERNIE 4.5 (ernie4_5: baidu/ERNIE-4.5-0.3B-PT) and Seed-OSS (seed_oss: ByteDance-Seed/Seed-OSS-36B):
what sets them apart from Llama, each shown to matter in transformers itself, and the config keys
ctitan must read as Ernie4_5Config / SeedOssConfig do.

- ernie4_5: RoPE on the interleaved pairs (2i, 2i+1) of the whole head (modeling_ernie4_5's
  rotate_half and the repeat_interleave of cos / sin; its default RoPE reads no
  partial_rotary_factor); one use_bias switch (default false) for q, k, v, o_proj and the MLP's
  gate, up and down projections; tied embeddings by default.
- seed_oss: attention_bias (default true) for q, k and v only, attention_out_bias (default
  false) for o_proj, mlp_bias for the MLP; attention_dropout and residual_dropout default to 0.1,
  so a file without them trains with dropout in transformers and is refused, as a non-zero one is.

The logits, gradients, AdamW steps, export, generate, LoRA and layouts of the two families are
tested with every family (oracle_families' ernie4_5 / seed_oss cases); each feature here, left
out or misplaced, moves transformers' logits far past those tests' tolerance."""
import json

import pytest

import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families import B, TOL, _changed_moved as _moved, _rewrite

ERNIE, SEED = of.CASE["ernie4_5_bias_tied"], of.CASE["seed_oss_outbias_mlpbias"]


def test_oracle_ernie_rope_interleaved(monkeypatch):
    """Llama's rotate_half on the halves of the head instead of ERNIE's pairs moves
    transformers' logits by far more than the tests' tolerance."""
    from transformers.models.ernie4_5 import modeling_ernie4_5
    err = of.halves_rope_err(monkeypatch, ERNIE, "ernie4_5", modeling_ernie4_5, B)
    assert err > 100 * TOL, f"halves instead of pairs: moves the logits by only {err:.3g}"


_zero = of.zero_biases


@pytest.mark.parametrize("case,names", [
    (ERNIE, ("q_proj", "k_proj", "v_proj")), (ERNIE, ("o_proj",)), (ERNIE, ("gate_proj", "up_proj", "down_proj")),
    (SEED, ("q_proj", "k_proj", "v_proj")), (SEED, ("o_proj",)), (SEED, ("gate_proj", "up_proj", "down_proj"))],
    ids=["ernie_qkv", "ernie_o", "ernie_mlp", "seed_qkv", "seed_o", "seed_mlp"])
def test_oracle_each_bias_matters(case, names):
    """Each group of biases the cases switch on, dropped, moves transformers' logits by far
    more than the tolerance (so a bias ctitan dropped or left unread fails the family tests)."""
    err = _moved(case, _zero(*names))
    assert err > 100 * TOL, f"{names} biases dropped: moves the logits by only {err:.3g}"


def _count(d):
    from transformers import AutoConfig, AutoModelForCausalLM
    return sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d)).parameters())


def _biased(d):
    """The projections transformers gives a bias (q_proj, o_proj, gate_proj ...)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d))
    return sorted({n.split(".")[-2] for n, _ in m.named_parameters() if n.endswith(".bias")})


# each switch absent (None: the config class's default), true and false; the other switches as
# the case sets them. ctitan's parameter count (describe's, the dry run's) must be transformers':
# a bias put on another projection of another shape (o_proj's H against q_proj's nh x hd ...)
# or left off changes it, and so does reading a switch of another family (Llama's attention_bias
# on o_proj too, Seed-OSS's attention_bias for ERNIE's use_bias)
@pytest.mark.parametrize("case,key", [(ERNIE, "use_bias"), (SEED, "attention_bias"), (SEED, "attention_out_bias"),
                                      (SEED, "mlp_bias")], ids=["ernie_use_bias", "seed_attention_bias",
                                                                "seed_attention_out_bias", "seed_mlp_bias"])
def test_bias_switches_as_transformers_reads_them(case, key, tmp_path, run_ctitan):
    d = of.save(of.build(case), tmp_path / "hf")
    seen = set()
    for value in (None, True, False):
        conf = of.config_json(d)
        conf.pop(key, None)
        if value is not None:
            conf[key] = value
        (d / "config.json").write_text(json.dumps(conf))
        seen.add(tuple(_biased(d)))
        _, out, _ = run_ctitan(["describe", d, "--json"])
        assert json.loads(out)["num_parameters"] == _count(d), (key, value, out)
    assert len(seen) == 2, f"test setup: {key} changes no bias in transformers: {seen}"


def test_oracle_seed_oss_bias_switches_place():
    """SeedOssConfig's attention_bias gives q, k and v biases and never o_proj's;
    attention_out_bias gives o_proj's alone; Ernie's use_bias all seven."""
    from transformers import Ernie4_5ForCausalLM, SeedOssForCausalLM
    def biased(m):
        return sorted({n.split(".")[-2] for n, _ in m.named_parameters() if n.endswith(".bias")})
    kw = dict(of.BASE, head_dim=8, attention_dropout=0.0, residual_dropout=0.0)
    cfg = of.make_config(of.Case("x", "seed_oss", dict(kw, attention_bias=True, attention_out_bias=False)))
    assert biased(SeedOssForCausalLM(cfg)) == ["k_proj", "q_proj", "v_proj"]
    cfg = of.make_config(of.Case("x", "seed_oss", dict(kw, attention_bias=False, attention_out_bias=True)))
    assert biased(SeedOssForCausalLM(cfg)) == ["o_proj"]
    cfg = of.make_config(of.Case("x", "ernie4_5", dict(of.BASE, head_dim=8, use_bias=True)))
    assert biased(Ernie4_5ForCausalLM(cfg)) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]


@pytest.mark.parametrize("key,null", [("attention_dropout", False), ("residual_dropout", False),
                                      ("residual_dropout", True)])
def test_seed_oss_absent_dropout_refused(key, null, tmp_path, open_session):
    """SeedOssConfig reads an absent attention_dropout / residual_dropout as 0.1 (dropout in
    every training step) and refuses null; ctitan, which has no dropout, refuses both files
    naming the key and what to set; with both 0.0 it opens (oracle_families' case)."""
    from transformers import AutoConfig
    d = of.save(of.build(SEED), tmp_path / "hf")
    if null:
        _rewrite(d, **{key: None})
        with pytest.raises(Exception):
            AutoConfig.from_pretrained(d)
    else:
        _rewrite(d, drop=(key,))
        assert getattr(AutoConfig.from_pretrained(d), key) == 0.1, "test setup: another default"
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    msg = str(ei.value)
    assert key in msg and "0.0" in msg and "config.json" in msg, msg


@pytest.mark.parametrize("case,edit,key", [
    (ERNIE, dict(use_bias=False), "use_bias"),
    (SEED, dict(attention_out_bias=False), "attention_out_bias"),
    (SEED, dict(mlp_bias=False), "mlp_bias")], ids=["ernie_use_bias", "seed_out_bias", "seed_mlp_bias"])
def test_resume_refuses_another_bias_switch(case, edit, key, tmp_path):
    """A checkpoint whose config.json turns a bias switch off (the biases still in its
    tensors: another model) is refused on resume naming the key; the unedited one resumes."""
    from test_ckpt_rope_params_check import _refused_after, _train
    cfg = of.make_config(case)
    cfg.vocab_size = 256
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c.update(edit), key)
