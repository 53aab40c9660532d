"""qwen2_moe (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): what the shared expert and the family's own
config rules add to the generic family tests (test_families*.py run its cases,
oracle_families' qwen2_moe_*, through logits, gradients, AdamW, export, checkpointing,
generation, LoRA and the parallel layouts).

Here: the shared expert and its sigmoid gate move transformers' own logits (so the family
tests can see a slip in either); Qwen2MoeConfig's sliding-layer rule without layer_types;
bf16 mixed precision against the PyTorch emulation of ctitan's bf16 semantics; a tensor
parallel degree that does not divide shared_expert_intermediate_size refused by name.
Expected values come from transformers, torch and the emulation only."""
from __future__ import annotations

import json

import pytest
import torch

import oracle
import oracle_families as of
from conftest import hf_session_args

TOL = 1e-4
B = 2


def _sparse_layers(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "shared_expert")]


@pytest.mark.parametrize("cid", ["qwen2_moe_step2_aux", "qwen2_moe_mlponly_norm_nobias"])
def test_oracle_shared_expert_and_gate_change_the_model(cid):
    """In transformers itself: zeroing the shared experts' down_proj (no shared expert),
    replacing the gate sigmoid(x W_g) by 1 (the gate not applied), or dropping only the
    sigmoid (the raw logit x W_g as the gate; both patched into the sparse block's F), each
    moves the logits by far more than the tolerance the family tests hold ctitan to: the
    shared expert, its gate and its sigmoid are all visible to them (measured: 0.19 to 0.36
    relative, against the family tests' 1e-4)."""
    case = of.CASE[cid]
    model = of.build(case)
    tokens, _ = of.batch(model, B, case.T, seed=5)
    base = of.logits(model, case.family, tokens)
    sparse = _sparse_layers(model)
    assert sparse and len(sparse) < len(model.model.layers), "test setup: want sparse and dense layers"

    def moved(patch, sigmoid=None):
        import types
        import transformers.models.qwen2_moe.modeling_qwen2_moe as mq
        m = of.build(case)
        patch(_sparse_layers(m))
        f = mq.F
        if sigmoid:  # the sparse block's F.sigmoid, in its own module only
            mq.F = types.SimpleNamespace(**{k: getattr(f, k) for k in dir(f) if not k.startswith("__")})
            mq.F.sigmoid = sigmoid
        try:
            return oracle.rel_err(of.logits(m, case.family, tokens), base)
        finally:
            mq.F = f

    def no_shared(mlps):
        with torch.no_grad():
            for mlp in mlps:
                mlp.shared_expert.down_proj.weight.zero_()

    for name, patch, sig in (("no shared expert", no_shared, None),
                             ("gate not applied (= 1)", lambda mlps: None, lambda t: torch.ones_like(t)),
                             ("no sigmoid (the raw logit)", lambda mlps: None, lambda t: t)):
        err = moved(patch, sig)
        assert err > 100 * TOL, f"{cid}: {name} moves the logits by only {err:.3g}"


def test_sliding_layers_without_layer_types(tmp_path, open_session, run_ctitan):
    """Qwen2MoeConfig's own rule (not Qwen2's): without layer_types, layer i slides when i is
    even, i < max_window_layers and use_sliding_window; ctitan's describe gives the same
    per-layer windows and its logits at T = 16 > sliding_window equal those of the model
    transformers loads from the file."""
    kw = dict(of.CASE["qwen2_moe_step2_aux"].kw, num_hidden_layers=4, use_sliding_window=True, sliding_window=6,
              max_window_layers=3)
    model = of.build(of.Case("qwen2_moe_swa6_no_layer_types", "qwen2_moe", kw, seed=13))
    d = of.save(model, tmp_path / "hf")
    conf = of.config_json(d)
    assert "layer_types" in conf  # written by save_pretrained: removed to reach the rule
    del conf["layer_types"]
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    from transformers import AutoConfig
    hf_types = AutoConfig.from_pretrained(d).layer_types
    want = [6 if t == "sliding_attention" else 0 for t in hf_types]
    assert want == [6, 0, 6, 0], hf_types  # even layers below max_window_layers 3
    _, out, _ = run_ctitan(["describe", d, "--json"])
    got = [layer["sliding_window"] for layer in json.loads(out)["layers"]]
    assert got == want, f"ctitan's per-layer windows {got}, transformers' {want}"
    ref = of.load(d, "qwen2_moe")
    tokens, _ = of.batch(ref, B, 16, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=16))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, "qwen2_moe", tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


def test_bf16_like_emulation(tmp_path, open_session):
    """training.mixed_precision_param = bfloat16 on the mixed sparse / dense model with shared
    experts (no q/k/v biases: the emulation patches F.linear, which takes none): against
    test_moe's emulation of ctitan's bf16 semantics (every linear, the experts', the router's,
    the shared experts' and their gates' alike, rounds x, w and d(out) to bf16; bf16
    attention), with test_bf16.assert_like_emulation's bounds."""
    of.assert_moe_bf16_like_emulation(tmp_path, open_session, of.CASE["qwen2_moe_mlponly_norm_nobias"], 2)


def test_tp_degree_must_divide_the_shared_expert(tmp_path, run_ctitan):
    """Tensor parallelism splits a shared expert as the dense MLP (its gate_proj / up_proj rows,
    down_proj columns): a degree that does not divide shared_expert_intermediate_size is refused
    naming the key and both numbers, before anything is allocated (the dry run)."""
    kw = dict(of.CASE["qwen2_moe_step2_aux"].kw, shared_expert_intermediate_size=41)
    of.make_config(of.Case("odd_shared", "qwen2_moe", kw)).save_pretrained(tmp_path / "m")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(8 * 17, 160, seed=1))
    args = ["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'm'}",
            "--training.seq_len=16", "--training.local_batch_size=2", f"--training.dataset_path={data}",
            "--training.steps=1", f"--job.dump_folder={tmp_path / 'o'}",
            "--parallelism.data_parallel_shard_degree=1", "--parallelism.tensor_parallel_degree=2"]
    rc, out, err = run_ctitan(args, check=False)
    assert rc != 0, out
    assert "shared_expert_intermediate_size" in err and "41" in err and "tensor_parallel_degree" in err, err
