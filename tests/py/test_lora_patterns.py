"""PEFT's target_modules = "all-linear", per-layer targets, rank_pattern / alpha_pattern and
the adapter_config.json keys ctitan refuses (issue 13 leftovers), against peft 0.21.2 +
transformers on tiny random Qwen3 / Qwen3-MoE models.

Every expected number, every set of adapted modules and every rank comes from PEFT
(get_peft_model / PeftModel.from_pretrained) or torch; ctitan's own numbers are only
compared with them. Facts this relies on (read in the installed peft):

* "all-linear" (tuners_utils._maybe_include_all_linear_layers) adapts every nn.Linear but
  the model's output embedding (lm_head); PEFT then saves target_modules as the full module
  names when there are fewer than 20 of them (a tiny model).
* On qwen3_moe, transformers v5's router (mlp.gate) is a Qwen3MoeTopKRouter, not an
  nn.Linear, but PEFT's MoE conversion (_resolve_string_target_modules,
  _convert_peft_config_moe) adds the v4 names gate / gate_proj / up_proj / down_proj: the
  router becomes target_parameters "gate.weight" and gets an adapter.
* rank_pattern / alpha_pattern keys are tried in dict order against each module's full name
  as re.match(rf"(.*\\.)?({key})$", name); the first match gives r (alpha)
  (utils/other.py get_pattern_key, lora/model.py _create_and_replace).
"""
import json

import numpy as np
import pytest

import oracle
import oracle_lora as OL
from test_lora import (ALPHA, OPT_ARGS, R, TOL, assert_step_matches, compare_steps, dense_cfg, lora_args,
                       moe_dense_layer0, open_error, random_adapters_load_in_peft, session_steps, train_ref,
                       trained_in_session)
from test_parity import make_batch
from test_train_loop import L, LOCAL_BS
from conftest import hf_session_args


def peft_adapter(tmp_path, cfg, *, seed, **kw):
    """A tiny random HF model and a PEFT adapter on it (random non-zero A and B), saved."""
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=seed)
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, seed=seed + 1, **kw)
    pm.save_pretrained(str(ad))
    return hf_dir, ad, pm


def session_logits_match(s, tokens, want):
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"ctitan logits vs PEFT's: rel err {err:.3g}"


def rewrite_config(ad, **changes):
    f = ad / "adapter_config.json"
    c = json.loads(f.read_text())
    c.update(changes)
    f.write_text(json.dumps(c))


# --------------------------------------------------------------------------- 1. all-linear

def test_all_linear_dense_as_peft(tmp_path, open_session):
    """PEFT's all-linear on a dense Qwen3 adapts the seven projections of every layer (not
    lm_head); ctitan's lora.target_modules = all-linear adapts the same set, loads PEFT's
    adapter (saved with every module's full name) and gives its logits, loss and adapter
    gradients; ctitan's save loads in PEFT strictly; an adapter_config.json that says
    "all-linear" itself reads the same."""
    cfg = dense_cfg()
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=41, targets="all-linear")
    params = OL.trainable(pm)
    assert sorted(params) == sorted(OL.lora_names(range(cfg.num_hidden_layers), OL.ALL7)), \
        f"PEFT's all-linear adapts {sorted(params)}"
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert "model.layers.1.mlp.down_proj" in conf["target_modules"], f"test setup: PEFT saved {conf['target_modules']}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=3)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=["all-linear"], adapter=ad)))
    assert trained_in_session(s) == set(params)
    assert {n: s.shapes[n] for n in params} == {n: tuple(p.shape) for n, p in params.items()}
    assert_step_matches(s, tokens, labels, *ref, params)
    random_adapters_load_in_peft(s, cfg, lambda: oracle.load_hf(hf_dir), tmp_path / "saved", ".lora_")
    s.close()

    rewrite_config(ad, target_modules="all-linear")
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(
        targets=["all-linear"], adapter=ad)))
    session_logits_match(s, tokens, ref[1])


def test_peft_all_linear_adapter_needs_the_router(tmp_path, open_session):
    """On Qwen3-MoE PEFT's all-linear also adapts every MoE layer's router (mlp.gate, through
    target_parameters gate.weight; ctitan does the same: test_lora_experts.py). PEFT's adapter
    given to a run whose [lora] names the seven projections only (no router) is refused,
    naming the router's parameter and the adapter's config."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets="all-linear")
    assert any(".mlp.gate.lora_A." in n for n in OL.trainable(pm)), "test setup: PEFT adapts no router"
    ad = tmp_path / "adapter"
    pm.save_pretrained(str(ad))
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=OL.ALL7, adapter=ad)), tmp_path)
    assert "gate.weight" in msg and "router" in msg and "adapter_config.json" in msg, msg


def test_per_layer_targets_as_peft(tmp_path, open_session):
    """target_modules naming one layer's module (PEFT's rule: the full name ends with it) beside
    a name of every layer's: the same adapters as PEFT, its logits and gradients; ctitan's save
    (every module by its full name) loads in PEFT strictly."""
    cfg = dense_cfg()
    targets = ["q_proj", "layers.1.mlp.down_proj"]
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=43, targets=targets)
    params = OL.trainable(pm)
    assert sorted(params) == sorted(OL.lora_names([0, 1], ["q_proj"]) + OL.lora_names([1], ["down_proj"])), \
        f"test setup: PEFT adapts {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=4)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=targets, adapter=ad)))
    assert trained_in_session(s) == set(params)
    assert_step_matches(s, tokens, labels, *ref, params)
    random_adapters_load_in_peft(s, cfg, lambda: oracle.load_hf(hf_dir), tmp_path / "saved", ".lora_")
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=["q_proj", "down_proj"],
                                                                           adapter=ad)), tmp_path)
    assert "model.layers.0.mlp.down_proj" in msg, msg


# --------------------------------------------------------------------------- 2. rank_pattern / alpha_pattern

# two keys select layer 1's down_proj: the first (8) counts, layer 0's gets the second (6).
# PEFT writes adapter_config.json with sorted keys (config.py: json.dumps(sort_keys=True)),
# so its own adapter keeps the first-match meaning only where the order is sorted already.
RANKS = {r"layers\.1\.mlp\.down_proj": 8, r"mlp\.down_proj": 6, "q_proj": 2}
ALPHAS = {"k_proj": 3.0, "layers.0.mlp.up_proj": 20.0}
PATTERN_CASES = [("alpha_over_r", False), ("rslora", True)]


def pattern_args(ranks, alphas):
    return [f"--lora.rank_pattern={json.dumps(ranks)}", f"--lora.alpha_pattern={json.dumps(alphas)}"]


@pytest.mark.parametrize("rslora", [c[1] for c in PATTERN_CASES], ids=[c[0] for c in PATTERN_CASES])
def test_patterns_parity_from_peft_adapter(rslora, tmp_path, open_session):
    """A PEFT adapter made with rank_pattern / alpha_pattern on all seven projections: ctitan
    given the same patterns (lora.rank_pattern / lora.alpha_pattern, JSON text) has PEFT's
    ranks, loads the adapter, gives PEFT's logits, loss and adapter gradients, then 3 AdamW
    steps equal torch's; the adapter it saves loads in PEFT strictly with its logits."""
    cfg = dense_cfg()
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=51, targets=OL.ALL7, rslora=rslora, rank_pattern=RANKS,
                                  alpha_pattern=ALPHAS)
    params = OL.trainable(pm)
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    assert shapes["model.layers.1.mlp.down_proj.lora_A.weight"][0] == 8, "test setup: PEFT's first match"
    assert shapes["model.layers.0.mlp.down_proj.lora_A.weight"][0] == 6
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=6)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        targets=OL.ALL7, rslora=rslora, adapter=ad) + pattern_args(RANKS, ALPHAS)))
    assert trained_in_session(s) == set(params)
    assert {n: s.shapes[n] for n in params} == shapes, "ranks differ from PEFT's"
    assert_step_matches(s, tokens, labels, *ref, params)
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=52)
    compare_steps(session_steps(s, stream, list(params)), train_ref(pm, params, stream))
    random_adapters_load_in_peft(s, cfg, lambda: oracle.load_hf(hf_dir), tmp_path / "saved", ".lora_")


def test_patterns_adapter_generate_and_merge(tmp_path, run_ctitan):
    """Outside training the patterns come from the adapter alone: `export --merge` folds each
    module at its own rank and scale (transformers loads the result with PEFT's logits), and
    `generate --adapter` continues as PEFT's model does."""
    from transformers import AutoModelForCausalLM
    import torch
    cfg = dense_cfg()
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=53, targets=OL.ALL7, rank_pattern=RANKS,
                                  alpha_pattern=ALPHAS)
    tokens, _ = make_batch(cfg.vocab_size, 2, L, seed=7)
    want = oracle.hf_logits(pm, tokens)
    assert oracle.rel_err(want, oracle.hf_logits(oracle.load_hf(hf_dir), tokens)) > 100 * TOL, \
        "test setup: the adapter hardly changes the logits"
    run_ctitan(["export", "--checkpoint", hf_dir, "--adapter", ad, "--merge", "--out", tmp_path / "merged"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                  attn_implementation="eager").eval()
    err = oracle.rel_err(oracle.hf_logits(merged, tokens), want)
    assert err <= TOL, f"merged model vs PEFT: rel err {err:.3g}"
    prompt = [int(t) for t in tokens[0, :5]]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(pm(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    _, out, _ = run_ctitan(["generate", "--checkpoint", hf_dir, "--adapter", ad, "--prompt-ids",
                            " ".join(map(str, prompt)), "--max-tokens", "6", "--ids"])
    assert [int(x) for x in out.split()] == seq[len(prompt):]


def test_moe_user_pattern_before_rewrite(tmp_path, open_session):
    """On Qwen3-MoE PEFT's rewrite of gate_proj + up_proj sets ".*\\.gate_up_proj" to 2 r
    after the user's keys, so a user key that also matches the experts (".*proj") wins: the
    experts' gate_up_proj gets rank 2 with the rewrite's alpha. ctitan's fresh adapters have
    PEFT's shapes, and its saved adapter (random values) loads in PEFT strictly with its
    logits."""
    cfg, hf_dir, base = moe_dense_layer0(tmp_path)
    ranks = {".*proj": 2}
    pm = OL.make_peft(base(), r=R, alpha=ALPHA, targets=OL.ALL7, rank_pattern=ranks)
    shapes = {n: tuple(p.shape) for n, p in OL.trainable(pm).items()}
    gu = "model.layers.1.mlp.experts.base_layer.lora_A.weight"
    assert shapes[gu][0] == 2 * cfg.num_experts, f"test setup: PEFT's gate_up_proj A is {shapes[gu]}"
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=[
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}", f"--lora.rank_pattern={json.dumps(ranks)}"]))
    assert {n: v for n, v in s.shapes.items() if ".lora_" in n} == shapes
    random_adapters_load_in_peft(s, cfg, base, tmp_path / "saved", ".lora_")


PATTERN_ERRORS = [
    ("not_json", ["--lora.rank_pattern=q_proj: 2"], "lora.rank_pattern"),
    ("selects_nothing", ['--lora.rank_pattern={"c_attn": 2}'], "c_attn"),
    ("not_a_regex", ['--lora.alpha_pattern={"q_proj(": 2}'], "q_proj("),
    ("rank_not_integer", ['--lora.rank_pattern={"q_proj": 2.5}'], "q_proj"),
]


@pytest.mark.parametrize("extra,needle", [c[1:] for c in PATTERN_ERRORS], ids=[c[0] for c in PATTERN_ERRORS])
def test_pattern_config_errors(extra, needle, tmp_path, open_session):
    cfg = dense_cfg()
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=2)
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args() + extra), tmp_path)
    assert needle in msg, msg


# --------------------------------------------------------------------------- 3. layers and other keys

LAYER_CASES = [
    ("list", dict(layers_to_transform=[1])),
    ("int_and_pattern", dict(layers_to_transform=1, layers_pattern="layers")),
]


@pytest.mark.parametrize("kw", [c[1] for c in LAYER_CASES], ids=[c[0] for c in LAYER_CASES])
def test_layers_to_transform_as_peft(kw, tmp_path, open_session):
    """PEFT's layers_to_transform (and layers_pattern) adapt the named modules of the listed
    layers only: ctitan reads them so (the run names the same modules per layer), gives
    PEFT's logits and gradients, and saves the adapters by their full names, which PEFT
    loads strictly; a run adapting every layer's is refused, naming layer 0's module."""
    cfg = dense_cfg()
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=61, targets=["q_proj", "down_proj"], **kw)
    params = OL.trainable(pm)
    assert sorted(params) == sorted(OL.lora_names([1], ["q_proj", "down_proj"])), \
        f"test setup: PEFT adapts {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=8)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(
        targets=["layers.1.self_attn.q_proj", "layers.1.mlp.down_proj"], adapter=ad)))
    assert trained_in_session(s) == set(params)
    assert_step_matches(s, tokens, labels, *ref, params)
    random_adapters_load_in_peft(s, cfg, lambda: oracle.load_hf(hf_dir), tmp_path / "saved", ".lora_")
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(targets=["q_proj", "down_proj"],
                                                                           adapter=ad)), tmp_path)
    assert "model.layers.0.self_attn.q_proj" in msg, msg


# adapter_config.json values with which PEFT computes something else than plain LoRA
REFUSED_KEYS = [
    ("use_dora", True), ("fan_in_fan_out", True), ("lora_bias", True), ("bias", "all"), ("bias", "lora_only"),
    ("init_lora_weights", "pissa"), ("exclude_modules", ["q_proj"]), ("layer_replication", [[0, 2]]),
    ("trainable_token_indices", [1, 2]), ("alora_invocation_tokens", [5]), ("use_qalora", True),
    ("layers_pattern", "layers"),  # without layers_to_transform
    ("layers_to_transform", [7]),  # no such layer: nothing adapted
    ("target_modules", ".*q_proj"),  # a regex
]


@pytest.mark.parametrize("key,value", REFUSED_KEYS, ids=[f"{k}={v}" for k, v in REFUSED_KEYS])
def test_adapter_keys_refused(key, value, tmp_path, open_session):
    """Each key that changes what PEFT computes, at a value ctitan does not compute, is
    refused naming the key (a training session with lora.adapter_path)."""
    cfg = dense_cfg()
    hf_dir, ad, _ = peft_adapter(tmp_path, cfg, seed=71, targets=OL.ALL7)
    args = hf_session_args(hf_dir, extra=lora_args(adapter=ad))
    open_session(args).close()
    rewrite_config(ad, **{key: value})
    msg = open_error(open_session, args, tmp_path)
    assert key in msg and "adapter_config.json" in msg, msg


def test_generate_refuses_dora(tmp_path, run_ctitan):
    """generate --adapter reads the adapter on its own path: a DoRA adapter is refused there
    too (it used to run as plain LoRA)."""
    cfg = dense_cfg()
    hf_dir, ad, _ = peft_adapter(tmp_path, cfg, seed=72, targets=OL.ALL7)
    args = ["generate", "--checkpoint", hf_dir, "--adapter", ad, "--prompt-ids", "1 2 3", "--max-tokens", "2",
            "--ids"]
    run_ctitan(args)
    rewrite_config(ad, use_dora=True)
    rc, _, err = run_ctitan(args, check=False)
    assert rc != 0 and "use_dora" in err, err


def test_modules_to_save_holding_a_target_refused(tmp_path, open_session):
    """PEFT puts no adapter inside a module to save (modules_to_save ["mlp"] leaves down_proj
    without one and trains the whole MLP): ctitan refuses the overlap, naming both."""
    cfg = dense_cfg()
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=73)
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=["q_proj", "down_proj"],
                      modules_to_save=["mlp"])
    assert not any(".down_proj.lora_" in n for n in OL.trainable(pm)), "test setup: PEFT adapts down_proj"
    msg = open_error(open_session, hf_session_args(hf_dir, extra=lora_args(
        targets=["q_proj", "down_proj"], modules_to_save=["mlp"])), tmp_path)
    assert "lora.modules_to_save" in msg and "mlp.down_proj" in msg, msg


def test_layers_pattern_matching_nothing_refused(tmp_path, open_session):
    """A layers_pattern that names no segment of the module names ("h": GPT-2's) leaves PEFT
    nothing to adapt (it raises); ctitan refuses such an adapter naming layers_to_transform."""
    cfg = dense_cfg()
    hf_dir, ad, _ = peft_adapter(tmp_path, cfg, seed=74, targets=["q_proj"], layers_to_transform=[1],
                                 layers_pattern="layers")
    with pytest.raises(ValueError):
        OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=["q_proj"], layers_to_transform=[1],
                     layers_pattern="h")
    args = hf_session_args(hf_dir, extra=lora_args(targets=["layers.1.self_attn.q_proj"], adapter=ad))
    open_session(args).close()
    rewrite_config(ad, layers_pattern="h")
    msg = open_error(open_session, args, tmp_path)
    assert "layers_to_transform" in msg and "adapter_config.json" in msg, msg


def test_layers_to_transform_spares_exact_names(tmp_path, open_session):
    """PEFT applies layers_to_transform only to modules a target_modules entry selects by
    suffix: an entry that is a module's full name keeps it whatever its layer."""
    cfg = dense_cfg()
    hf_dir, ad, pm = peft_adapter(tmp_path, cfg, seed=75, targets=["q_proj", "model.layers.0.mlp.down_proj"],
                                  layers_to_transform=[1])
    params = OL.trainable(pm)
    assert sorted(params) == sorted(OL.lora_names([1], ["q_proj"]) + OL.lora_names([0], ["down_proj"])), \
        f"test setup: PEFT adapts {sorted(params)}"
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=9)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(
        targets=["layers.1.self_attn.q_proj", "layers.0.mlp.down_proj"], adapter=ad)))
    assert_step_matches(s, tokens, labels, *ref, params)
