"""Model families from config.json (issue 15): ctitan against transformers' own classes for
llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe, mixtral, olmo2, phi3, gemma, gemma2, gemma3_text and granite on
tiny random models with each family's distinctive options on (the cases: oracle_families.CASES).

Per case: tensor names / shapes / loaded weights as save_pretrained wrote them; logits, loss
(some labels -100), aux loss and every gradient against torch autograd; three AdamW steps
against torch.optim.AdamW; ctitan's HF export loaded by AutoModelForCausalLM (same class,
config, weights, logits); activation checkpointing bit-identical to none. Per family: a
config option ctitan cannot compute as transformers does is refused, naming config.json and
the key (oracle_families.REFUSALS). Where a config sets pad_token_id (the gemmas, olmo2, phi3
here) the inputs hold the pad token: transformers' nn.Embedding(padding_idx=...) gives that
row no gradient from the lookup."""
import ctypes

import numpy as np
import pytest

import oracle
import oracle_families as of
from conftest import CtitanError, hf_session_args

TOL = 1e-4
B = 2
MIN_GAP = 1e-4  # router top-k ties closer than this: the case's seed must change

# AdamW hyper-parameters (eps 1e-4: see test_train_loop.HP); 3 of 4 scheduled steps, two
# micro-batches each: lr factors 1 (warmup), 1 (stable), cosine decay
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-4, weight_decay=0.1, max_norm=1.5, warmup_steps=1,
          decay_type="cosine", min_lr_factor=0.1)
STEPS, RUN, LOCAL_BS, GLOBAL_BS = 4, 3, 2, 4

AC_MODES = [
    ("full", ["--activation_checkpoint.mode=full"]),
    ("selective_op", ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]),
]

IDS = [c.id for c in of.CASES]
# the cases plus partial_rotary_factor on every family's default RoPE (which ignores it outside
# phi3): names, logits / loss / gradients and the export; the AdamW and checkpointing tests
# exercise nothing a config key changes and stay on CASES
WITH_PARTIAL = of.CASES + of.PARTIAL_DEFAULT_CASES
WITH_PARTIAL_IDS = [c.id for c in WITH_PARTIAL]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """saved(case) -> (HF model, its save_pretrained directory), built once per module."""
    cache = {}

    def get(case):
        if case.id not in cache:
            model = of.build(case)
            d = of.save(model, tmp_path_factory.mktemp(case.id) / "hf")
            cache[case.id] = (model, d)
        return cache[case.id]

    return get


def _aux(s):
    fn = s.lib.ctitan_aux_loss
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_double)]
    v = ctypes.c_double(float("nan"))
    assert fn(s.s, ctypes.byref(v)) == 0
    return v.value


def _close(a, b, tol=TOL):
    return abs(a - b) <= tol * max(abs(b), 1e-30)


def _bad(got: dict, want: dict, tol=TOL):
    return [f"{n}: rel err {oracle.rel_err(got[n], want[n]):.3g}" for n in sorted(want)
            if not oracle.rel_err(got[n], want[n]) <= tol]


# --------------------------------------------------------------------------- 1. names, shapes, weights

@pytest.mark.parametrize("case", WITH_PARTIAL, ids=WITH_PARTIAL_IDS)
def test_names_shapes_weights(case, saved, open_session):
    model, hf_dir = saved(case)
    files = of.ctitan_view(case.family, oracle.read_hf_tensors(hf_dir))
    # the harness's own name mapping reproduces what save_pretrained wrote
    mapped = of.file_params(model, case.family)
    assert set(mapped) == set(files), f"oracle mapping vs file: {sorted(set(mapped) ^ set(files))}"
    assert all(np.array_equal(mapped[n], files[n]) for n in files)

    s = open_session(hf_session_args(hf_dir, batch=B, seq_len=case.T))
    assert s.vocab_size == model.config.vocab_size
    assert set(s.names()) == set(files), (f"ctitan lacks {sorted(set(files) - set(s.names()))}, "
                                          f"has extra {sorted(set(s.names()) - set(files))}")
    for n, a in files.items():
        assert s.shapes[n] == a.shape, f"{n}: shape {s.shapes[n]} vs file {a.shape}"
        assert np.array_equal(s.get_param(n), a), f"{n}: loaded != saved"


# --------------------------------------------------------------------------- 2. logits, loss, gradients

@pytest.mark.parametrize("case", WITH_PARTIAL, ids=WITH_PARTIAL_IDS)
def test_logits_loss_grads(case, saved, open_session):
    model, hf_dir = saved(case)
    tokens, labels = of.batch(model, B, case.T, seed=5)
    ref = of.loss_and_grads(model, case.family, tokens, labels)
    assert ref["min_gap"] > MIN_GAP, f"near-tie in a router's top-k ({ref['min_gap']:.2g}): change the seed"

    s = open_session(hf_session_args(hf_dir, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), ref["logits"])
    assert err <= TOL, f"logits rel err {err:.3g}"

    s.zero_grad()
    nv = oracle.n_valid(labels)
    ce = s.forward_backward(tokens, labels, nv) / nv
    assert _close(ce, ref["ce"]), f"CE {ce} vs HF {ref['ce']}"
    loss = ce
    if ref["aux"] is not None:
        a = _aux(s)
        assert _close(a, ref["aux"]), f"aux loss {a} vs HF {ref['aux']}"
        loss = ce + model.config.router_aux_loss_coef * a
    assert _close(loss, ref["loss"]), f"loss {loss} vs HF {ref['loss']}"

    assert set(s.names()) == set(ref["grads"])
    bad = _bad({n: s.get_grad(n) for n in s.names()}, ref["grads"])
    assert not bad, "gradients differ from torch autograd:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- 3. optimizer steps

@pytest.mark.parametrize("case", of.CASES, ids=IDS)
def test_three_adamw_steps(case, saved, open_session):
    model, hf_dir = saved(case)
    accum = GLOBAL_BS // LOCAL_BS
    tokens = oracle.random_tokens(RUN * GLOBAL_BS * (case.T + 1), model.config.vocab_size, seed=13)
    mbs = oracle.micro_batches(tokens, case.T, LOCAL_BS, RUN * accum)
    rng = np.random.default_rng(2)
    for inp, lab in mbs:  # a few ignored labels and the pad token (if any) in every micro-batch
        lab.reshape(-1)[rng.choice(lab.size, size=3, replace=False)] = oracle.IGNORE
        of.add_pad(model, inp, rng)
    ref = of.reference_steps(of.load(hf_dir, case.family), case.family, mbs, accum=accum, steps=STEPS,
                             run_steps=RUN, **HP)
    assert ref["min_gap"] > MIN_GAP, f"near-tie in a router's top-k ({ref['min_gap']:.2g}): change the seed"

    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=case.T, extra=[
        f"--training.global_batch_size={GLOBAL_BS}", f"--training.steps={STEPS}",
        f"--training.max_norm={HP['max_norm']}", f"--optimizer.lr={HP['lr']}", f"--optimizer.eps={HP['eps']}",
        f"--optimizer.weight_decay={HP['weight_decay']}", f"--optimizer.beta1={HP['betas'][0]}",
        f"--optimizer.beta2={HP['betas'][1]}", f"--lr_scheduler.warmup_steps={HP['warmup_steps']}",
        f"--lr_scheduler.decay_type={HP['decay_type']}", f"--lr_scheduler.min_lr_factor={HP['min_lr_factor']}"]))
    for step in range(RUN):
        group = mbs[step * accum:(step + 1) * accum]
        total = sum(oracle.n_valid(lab) for _, lab in group)
        s.zero_grad()
        loss = sum(s.forward_backward(inp, lab, total) for inp, lab in group) / total
        gn, lr = s.optimizer_step()
        assert _close(loss, ref["losses"][step]), f"step {step + 1}: loss {loss} vs {ref['losses'][step]}"
        assert _close(gn, ref["grad_norms"][step]), f"step {step + 1}: grad norm {gn} vs {ref['grad_norms'][step]}"
        assert _close(lr, ref["lrs"][step], 1e-9), f"step {step + 1}: lr {lr} vs {ref['lrs'][step]}"
    assert set(s.names()) == set(ref["params"])
    bad = _bad({n: s.get_param(n) for n in s.names()}, ref["params"])
    assert not bad, f"weights after {RUN} steps differ from torch.optim.AdamW:\n" + "\n".join(bad)


# --------------------------------------------------------------------------- 4. export

@pytest.mark.parametrize("case", WITH_PARTIAL, ids=WITH_PARTIAL_IDS)
def test_export_loads_in_transformers(case, saved, open_session, tmp_path):
    """Every weight moved (x 1.5), save_hf, from_pretrained: the family's class, its
    distinctive config values, the weights and the logits of the moved model."""
    model, hf_dir = saved(case)
    want = of.scaled_copy(model, 1.5)
    s = open_session(hf_session_args(hf_dir, batch=B, seq_len=case.T))
    for n in s.names():
        s.set_param(n, s.get_param(n) * np.float32(1.5))
    out = tmp_path / "export"
    s.save_hf(out)

    conf = of.config_json(out)
    assert conf["model_type"] == case.family, conf.get("model_type")
    assert conf["architectures"] == [type(model).__name__], conf.get("architectures")
    back = of.load(out, case.family)
    assert type(back) is type(model), f"{type(back).__name__} vs {type(model).__name__}"
    diff = [f"{k}: {getattr(back.config, k, '<absent>')!r} vs {getattr(model.config, k)!r}" for k in case.keys
            if getattr(back.config, k, None) != getattr(model.config, k)]
    assert not diff, "exported config differs:\n" + "\n".join(diff)

    assert set(oracle.read_hf_tensors(out)) == set(oracle.read_hf_tensors(hf_dir))
    got, exp = of.file_params(back, case.family), of.file_params(want, case.family)
    assert set(got) == set(exp)
    bad = [n for n in exp if not np.array_equal(got[n], exp[n])]
    assert not bad, f"exported weights differ: {bad}"

    tokens, _ = of.batch(model, B, case.T, seed=8)
    err = oracle.rel_err(of.logits(back, case.family, tokens), of.logits(want, case.family, tokens))
    assert err <= TOL, f"logits of the reloaded export: rel err {err:.3g}"


# --------------------------------------------------------------------------- 5. activation checkpointing

@pytest.mark.parametrize("case", of.CASES, ids=IDS)
def test_activation_checkpointing_bitwise(case, saved, open_session):
    """full and selective op recompute the same deterministic forward: loss (and aux loss) and
    every gradient bit-identical to no checkpointing, over two micro-batches."""
    model, hf_dir = saved(case)
    tokens, labels = of.batch(model, 2 * B, case.T, seed=6, n_ignore=9)
    nv = oracle.n_valid(labels)

    def run(extra):
        s = open_session(hf_session_args(hf_dir, batch=B, seq_len=case.T, extra=extra))
        s.zero_grad()
        loss = s.forward_backward(tokens[:B], labels[:B], nv) + s.forward_backward(tokens[B:], labels[B:], nv)
        return loss, (_aux(s) if case.moe else None), {n: s.get_grad(n) for n in s.names()}

    base = run([])
    ref = of.loss_and_grads(model, case.family, tokens, labels)  # the no-AC run is right to begin with
    assert _close(base[0] / nv, ref["ce"]), f"mode none: CE {base[0] / nv} vs HF {ref['ce']}"
    for name, extra in AC_MODES:
        loss, aux, grads = run(extra)
        assert loss == base[0], f"{name}: loss {loss!r} vs {base[0]!r}"
        assert aux == base[1], f"{name}: aux loss {aux!r} vs {base[1]!r}"
        bad = [n for n in base[2] if not np.array_equal(grads[n], base[2][n])]
        assert not bad, f"{name}: gradients not bit-identical to mode none: {bad}"


# --------------------------------------------------------------------------- 6. refusals

@pytest.mark.parametrize("r", of.REFUSALS, ids=[r.id for r in of.REFUSALS])
def test_unsupported_option_refused(r, tmp_path, open_session):
    """The family itself opens (the same config without the option); with the option,
    ctitan_open fails with a message naming config.json and the key."""
    base = next(c for c in of.CASES if c.family == r.family)
    ok = tmp_path / "ok"
    of.make_config(base).save_pretrained(str(ok))
    open_session(hf_session_args(ok, load=False, batch=B, seq_len=16)).close()

    bad = tmp_path / "bad"
    cfg = of.refusal_config(r)
    cfg.save_pretrained(str(bad))
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(bad, load=False, batch=B, seq_len=16))
    msg = str(ei.value).split("failed: ", 1)[-1]
    path = str(bad / "config.json")
    assert path in msg and r.key in msg.replace(path, ""), f"message must name {path} and {r.key!r}: {msg}"
    rest = msg.replace(path, "")
    missing = [t for t in r.also if t not in rest]
    assert not missing, f"message must also name {missing}: {msg}"


# --------------------------------------------------------------------------- the oracle's own assumptions

def test_oracle_gemma3_attn_softcap_is_inert():
    """transformers 5.24 ignores gemma3's attn_logit_softcapping (Gemma3Attention never passes
    softcap= to the attention function), so the gemma3 case expects ctitan to ignore it too; if a
    transformers update starts applying it, this fails and the case's expectation must follow."""
    import dataclasses
    case = of.CASE["gemma3_text"]
    assert case.kw["attn_logit_softcapping"] is not None
    a = of.build(case)
    b = of.build(dataclasses.replace(case, kw={**case.kw, "attn_logit_softcapping": 0.5}))
    c = of.build(dataclasses.replace(case, kw={**case.kw, "attn_logit_softcapping": None}))
    tokens, _ = of.batch(a, B, case.T, seed=5)
    la = of.logits(a, case.family, tokens)
    assert np.array_equal(la, of.logits(b, case.family, tokens))
    assert np.array_equal(la, of.logits(c, case.family, tokens))


def test_oracle_gemma2_caps_change_the_model():
    """The gemma2 case's soft-caps are not inert in transformers (Gemma2Attention passes
    softcap= to the eager attention; Gemma2ForCausalLM caps the logits): without either the
    logits move by far more than the tests' tolerance, so a ctitan that drops one fails them."""
    import dataclasses
    case = of.CASE["gemma2"]
    a = of.build(case)
    tokens, _ = of.batch(a, B, case.T, seed=5)
    la = of.logits(a, case.family, tokens)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        b = of.build(dataclasses.replace(case, kw={**case.kw, key: None}))
        err = oracle.rel_err(of.logits(b, case.family, tokens), la)
        assert err > 100 * TOL, f"{key}: dropping it moves the logits by only {err:.3g}"


PARTIAL_SCALED = [r for r in of.REFUSALS if r.key == "partial_rotary_factor" and r.family != "phi3"]


@pytest.mark.parametrize("case", of.PARTIAL_DEFAULT_CASES, ids=[c.id for c in of.PARTIAL_DEFAULT_CASES])
def test_oracle_default_rope_ignores_partial_rotary(case):
    """Outside phi3, transformers 5.24's default RoPE never reads partial_rotary_factor: the model
    with the factor gives the logits of the same model without it, bit for bit (so the cases
    expect ctitan to ignore it too, and a transformers that starts honouring it fails here)."""
    import dataclasses
    kw = {k: v for k, v in case.kw.items() if k != "partial_rotary_factor"}
    kw["rope_parameters"] = of.copy.deepcopy(kw["rope_parameters"])
    for d in (kw["rope_parameters"].values() if case.family == "gemma3_text" else [kw["rope_parameters"]]):
        d.pop("partial_rotary_factor", None)
    a = of.build(case)
    b = of.build(dataclasses.replace(case, kw=kw))
    rp = a.config.rope_parameters
    assert any(d.get("partial_rotary_factor", 1.0) < 1.0
               for d in (rp.values() if case.family == "gemma3_text" else [rp])), "the factor must reach the config"
    tokens, _ = of.batch(a, B, case.T, seed=5)
    assert np.array_equal(of.logits(a, case.family, tokens), of.logits(b, case.family, tokens))


@pytest.mark.parametrize("r", PARTIAL_SCALED, ids=[r.id for r in PARTIAL_SCALED])
def test_oracle_partial_rotary_scaled_fails(r):
    """The refused partial_rotary_factor configs: transformers builds the model, and its forward
    fails (whole heads times cos/sin of int(head_dim * factor) features), so ctitan has nothing to
    reproduce. If a transformers update makes them compute, this fails and the refusal must go."""
    import torch
    cfg = of.refusal_config(r)
    _, M = of.FAMILIES[r.family]
    model = M(cfg).to(torch.float32)
    tokens = torch.tensor(oracle.random_tokens(16, cfg.vocab_size, seed=1).reshape(1, 16))
    with pytest.raises(RuntimeError, match="must match the size"):
        with torch.no_grad():
            model(input_ids=tokens)


# --------------------------------------------------------------------------- 6. Qwen's sliding layers from max_window_layers

@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_sliding_layers_without_layer_types(family, tmp_path, open_session, run_ctitan):
    """A Qwen config.json without "layer_types" (save_pretrained always writes it, so every
    other case reads the list; older published files lack it): transformers derives the
    sliding layers from use_sliding_window and max_window_layers (layers i >=
    max_window_layers slide), and so must ctitan: describe's per-layer windows and the
    logits at T = 16 > sliding_window against the model transformers loads from the file."""
    import json
    from transformers import AutoConfig

    kw = dict(num_hidden_layers=3, use_sliding_window=True, sliding_window=6, max_window_layers=1,
              rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    if family == "qwen3":
        kw["head_dim"] = 16
    model = of.build(of.Case(f"{family}_swa6_no_layer_types", family, kw))
    d = of.save(model, tmp_path / "hf")
    conf = of.config_json(d)
    assert "layer_types" in conf  # written by save_pretrained: removed to reach the legacy rule
    del conf["layer_types"]
    (d / "config.json").write_text(json.dumps(conf, indent=2))

    hf_types = AutoConfig.from_pretrained(d).layer_types
    want = [6 if t == "sliding_attention" else 0 for t in hf_types]
    assert want == [0, 6, 6], hf_types  # transformers' rule: i >= max_window_layers
    _, out, _ = run_ctitan(["describe", d, "--json"])
    got = [layer["sliding_window"] for layer in json.loads(out)["layers"]]
    assert got == want, f"ctitan's per-layer windows {got}, transformers' {want} ({hf_types})"

    ref = of.load(d, family)
    assert list(ref.config.layer_types) == list(hf_types)
    T = 16
    tokens, _ = of.batch(ref, B, T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, family, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


def tiny_gemma3_multimodal(path):
    """A tiny Gemma3ForConditionalGeneration saved as the published gemma-3-4b-it folder is
    laid out: config.json with model_type "gemma3" and a nested text_config."""
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration
    cfg = Gemma3Config(
        text_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, vocab_size=300, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(cfg).save_pretrained(path)
    return path


def test_gemma3_multimodal_folder_refused_with_what_to_do(tmp_path, run_ctitan, open_session):
    """The published gemma-3-4b-it folder (model_type "gemma3") was refused as an unknown
    model_type beside a list holding gemma3_text. The refusal now says it is the multimodal
    wrapper, that its text_config is a gemma3_text model ctitan trains, and what to do; the
    recipe docs/families.md gives (run here) makes a folder ctitan loads, with transformers'
    logits."""
    import json

    import torch
    from transformers import AutoModelForImageTextToText, Gemma3ForCausalLM
    mm_dir = tiny_gemma3_multimodal(tmp_path / "mm")
    rc, _, err = run_ctitan(["describe", mm_dir], check=False)
    assert rc == 2, (rc, err)
    assert 'model_type "gemma3" is Gemma 3\'s multimodal wrapper' in err, err
    assert 'its "text_config" is a gemma3_text model, which ctitan trains' in err, err
    assert "docs/families.md" in err, err

    # docs/families.md's recipe
    mm = AutoModelForImageTextToText.from_pretrained(mm_dir)
    lm = Gemma3ForCausalLM(mm.config.text_config)
    lm.model.load_state_dict(mm.model.language_model.state_dict())
    lm.tie_weights()
    lm.save_pretrained(tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "gemma3_text"

    tokens = np.array([[1, 5, 9, 200, 17, 3, 250, 4], [7, 7, 8, 100, 2, 64, 11, 0]], dtype=np.int32)
    s = open_session(hf_session_args(tmp_path / "text", batch=2, seq_len=8))
    with torch.no_grad():
        want = mm(input_ids=torch.from_numpy(tokens).long()).logits.float().numpy()
    err_rel = oracle.rel_err(s.logits(tokens), want)
    assert err_rel <= TOL, f"logits rel err {err_rel:.3g}"


# --------------------------------------------------------------------------- 7. the Gemma 1 and 2 files as published

def test_gemma2_sliding_layers_without_layer_types(tmp_path, open_session, run_ctitan):
    """A Gemma 2 config.json without "layer_types" (the published gemma-2 files have none):
    Gemma2Config makes layers 0, 2, 4, ... sliding and 1, 3, ... global; ctitan's describe
    gives those windows, and its logits at T = 16 > sliding_window equal transformers' on
    the model loaded from the file."""
    import json
    from transformers import AutoConfig
    case = of.CASE["gemma2"]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    conf = of.config_json(d)
    del conf["layer_types"]
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    hf_types = AutoConfig.from_pretrained(d).layer_types
    want = [4 if t == "sliding_attention" else 0 for t in hf_types]
    assert want == [4, 0, 4], hf_types
    _, out, _ = run_ctitan(["describe", d, "--json"])
    got = [layer["sliding_window"] for layer in json.loads(out)["layers"]]
    assert got == want, f"ctitan's per-layer windows {got}, transformers' {want}"
    ref = of.load(d, case.family)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, case.family, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


def test_gemma2_caps_and_scalar_defaults(tmp_path, run_ctitan):
    """Keys a Gemma 2 file leaves out take Gemma2Config's defaults (attn cap 50, final cap 30,
    query_pre_attn_scalar 256, head_dim 256, 4 kv heads, pad 0, tied); null caps are None.
    ctitan's export of each file says what transformers read from it."""
    import json
    from transformers import AutoConfig
    base = {"model_type": "gemma2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 8}
    for extra in ({}, {"attn_logit_softcapping": None, "final_logit_softcapping": None}):
        d = tmp_path / f"m{len(extra)}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, **extra}))
        hf = AutoConfig.from_pretrained(d)
        run_ctitan(["describe", d, "--config-out", d / "out.json"])
        out = json.loads((d / "out.json").read_text())
        for k in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "head_dim",
                  "num_key_value_heads", "pad_token_id", "tie_word_embeddings", "layer_types", "sliding_window",
                  "hidden_activation", "max_position_embeddings", "rms_norm_eps"):
            assert out.get(k) == getattr(hf, k), f"{extra}: {k} = {out.get(k)!r}, transformers {getattr(hf, k)!r}"
        assert out["rope_parameters"]["rope_theta"] == hf.rope_parameters["rope_theta"]


def test_gemma_hidden_act_gelu_is_tanh(tmp_path, open_session):
    """The published Gemma files say hidden_act "gelu", which GemmaConfig reads as
    gelu_pytorch_tanh (save_pretrained writes the mapped name, so the case's file lacks the
    legacy spelling): a file with "gelu" opens in ctitan with transformers' logits."""
    import json
    case = of.CASE["gemma_gelu_attnbias"]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    conf = of.config_json(d)
    conf["hidden_act"] = "gelu"
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    ref = of.load(d, case.family)
    assert ref.config.hidden_act == "gelu_pytorch_tanh"
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, case.family, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"


# --------------------------------------------------------------------------- 8. Granite's four scalars

GRANITE_SCALARS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


def test_oracle_granite_scalars_change_the_model():
    """Each of the granite case's scalars matters in transformers itself: set back to
    GraniteConfig's default 1.0 it moves the logits by far more than the tests' tolerance,
    so a ctitan that drops one fails them."""
    import dataclasses
    case = of.CASE["granite"]
    a = of.build(case)
    tokens, _ = of.batch(a, B, case.T, seed=5)
    la = of.logits(a, case.family, tokens)
    for key in GRANITE_SCALARS:
        b = of.build(dataclasses.replace(case, kw={**case.kw, key: 1.0}))
        err = oracle.rel_err(of.logits(b, case.family, tokens), la)
        assert err > 100 * TOL, f"{key}: dropping it moves the logits by only {err:.3g}"


def test_granite_scalar_defaults(tmp_path, open_session, run_ctitan):
    """A Granite file without the four scalars: GraniteConfig reads each as 1.0 (the attention
    scale too, not head_dim^-0.5). ctitan's logits equal transformers' on the model loaded
    from that file, and its export writes back what transformers read."""
    import json
    from transformers import AutoConfig
    case = of.CASE["granite"]
    model = of.build(case)
    d = of.save(model, tmp_path / "hf")
    conf = of.config_json(d)
    for k in GRANITE_SCALARS:
        del conf[k]
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    hf = AutoConfig.from_pretrained(d)
    assert all(getattr(hf, k) == 1.0 for k in GRANITE_SCALARS)
    ref = of.load(d, case.family)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, case.family, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    run_ctitan(["describe", d, "--config-out", d / "out.json"])
    out = json.loads((d / "out.json").read_text())
    for k in GRANITE_SCALARS + ("num_key_value_heads", "head_dim", "tie_word_embeddings", "pad_token_id"):
        assert out.get(k) == getattr(hf, k), f"{k} = {out.get(k)!r}, transformers {getattr(hf, k)!r}"


# --------------------------------------------------------------------------- 9. SmolLM3's NoPE layers, Olmo3's windows

def _changed_moved(case, change):
    """rel err of the case's logits after change(model) against the model as built."""
    a, b = of.build(case), of.build(case)
    import torch
    change(b)
    tokens, _ = of.batch(a, B, case.T, seed=5)
    with torch.no_grad():
        return oracle.rel_err(of.logits(b, case.family, tokens), of.logits(a, case.family, tokens))


def _logits_moved(case, kw, tokens=None):
    import dataclasses
    a = of.build(case)
    if tokens is None:
        tokens, _ = of.batch(a, B, case.T, seed=5)
    b = of.build(dataclasses.replace(case, kw={**case.kw, **kw}))
    return oracle.rel_err(of.logits(b, case.family, tokens), of.logits(a, case.family, tokens))


def test_oracle_smollm3_nope_and_windows_change_the_model():
    """In transformers itself the smollm3 case's NoPE layers and its sliding layers matter:
    RoPE on every layer, the list read inverted, or no window each move the logits by far more
    than the tests' tolerance (layer_types kept where only the RoPE changes)."""
    case = of.CASE["smollm3_nope_swa5"]
    types = ["full_attention", "sliding_attention"] * 2
    for what, kw in [("NoPE ignored", dict(no_rope_layers=[1, 1, 1, 1], layer_types=types)),
                     ("list inverted", dict(no_rope_layers=[0, 1, 0, 1], layer_types=types)),
                     ("interval off by one", dict(no_rope_layers=[1, 1, 0, 1], layer_types=types)),
                     ("no window", dict(use_sliding_window=False))]:
        err = _logits_moved(case, kw)
        assert err > 100 * TOL, f"{what}: moves the logits by only {err:.3g}"


def test_oracle_olmo3_windows_and_rope_change_the_model():
    """In transformers itself the olmo3 case's layer pattern and its per-type RoPE matter: the
    full layer one place earlier, or the sliding layers on the full layers' RoPE, move the
    logits by far more than the tests' tolerance."""
    case = of.CASE["olmo3_swa5_yarn"]
    rp = case.kw["rope_parameters"]
    for what, kw in [("pattern off by one", dict(layer_types=["sliding_attention"] * 2 + ["full_attention",
                                                                                          "sliding_attention"])),
                     ("one RoPE", dict(rope_parameters={"full_attention": rp["full_attention"],
                                                         "sliding_attention": rp["full_attention"]}))]:
        err = _logits_moved(case, kw)
        assert err > 100 * TOL, f"{what}: moves the logits by only {err:.3g}"


def _rewrite(d, drop=(), **set_):
    import json
    conf = of.config_json(d)
    for k in drop:
        conf.pop(k, None)
    conf.update(set_)
    (d / "config.json").write_text(json.dumps(conf, indent=2))


@pytest.mark.parametrize("interval", [2, 3])
def test_smollm3_nope_from_interval(interval, tmp_path, open_session, run_ctitan):
    """A SmolLM3 config.json without no_rope_layers and layer_types: SmolLM3Config makes every
    no_rope_layer_interval-th layer NoPE and (use_sliding_window, sliding_window set) those
    layers slide. ctitan's describe gives the same layers; its logits equal transformers' on the
    model loaded from the file; its export writes the list back."""
    import json
    from transformers import AutoConfig
    case = of.CASE["smollm3_nope_swa5"]
    d = of.save(of.build(case), tmp_path / "hf")
    _rewrite(d, drop=("no_rope_layers", "layer_types"), no_rope_layer_interval=interval)
    hf = AutoConfig.from_pretrained(d)
    want_nope = [1 - u for u in hf.no_rope_layers]
    assert want_nope == [int((i + 1) % interval == 0) for i in range(4)], hf.no_rope_layers
    _, out, _ = run_ctitan(["describe", d, "--json"])
    layers = json.loads(out)["layers"]
    assert [int(x["rope"] == "none") for x in layers] == want_nope, layers
    assert [x["sliding_window"] for x in layers] == [5 if t == "sliding_attention" else 0 for t in hf.layer_types]
    ref = of.load(d, case.family)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, case.family, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    run_ctitan(["describe", d, "--config-out", d / "out.json"])
    back = json.loads((d / "out.json").read_text())
    assert back["no_rope_layers"] == hf.no_rope_layers and back["layer_types"] == hf.layer_types


def test_smollm3_defaults(tmp_path, open_session, run_ctitan):
    """A SmolLM3 config.json that leaves out what SmolLM3Config defaults (num_key_value_heads 4,
    tied embeddings, rope_theta 2e6, interval 4, no window): ctitan reads the same model."""
    import json
    from transformers import AutoConfig
    case = of.CASE["smollm3_nope_swa5"]
    d = of.save(of.build(case), tmp_path / "hf")
    conf = {"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "vocab_size": 160, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 4, "num_attention_heads": 8, "pad_token_id": 3}
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    assert (hf.num_key_value_heads, hf.tie_word_embeddings, hf.rope_parameters["rope_theta"],
            hf.no_rope_layers, set(hf.layer_types)) == (4, True, 2e6, [1, 1, 1, 0], {"full_attention"})
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_config(hf)
    of.init_weights(ref, "smollm3", 3)
    ref = of.prepare_loaded(ref, "smollm3")
    ref.save_pretrained(str(d))
    (d / "config.json").write_text(json.dumps(conf))
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, "smollm3", tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    run_ctitan(["describe", d, "--config-out", d / "out.json"])
    out = json.loads((d / "out.json").read_text())
    for k in ("num_key_value_heads", "tie_word_embeddings", "no_rope_layers", "layer_types", "use_sliding_window"):
        assert out.get(k) == getattr(hf, k), f"{k} = {out.get(k)!r}, transformers {getattr(hf, k)!r}"
    assert out["rope_parameters"]["rope_theta"] == 2e6


def test_olmo3_published_keys(tmp_path, open_session, run_ctitan):
    """An Olmo 3 config.json as the published files write it: no layer_types (Olmo3Config: every
    4th layer full), a top-level rope_theta and a legacy rope_scaling (yarn), which Olmo3Config
    gives to the full layers only; the sliding layers keep the default RoPE with default_theta
    5e5 (the top-level rope_theta is popped for the full layers). ctitan reads the same model."""
    import json
    from transformers import AutoConfig
    case = of.CASE["olmo3_swa5_yarn"]
    d = of.save(of.build(case), tmp_path / "hf")
    _rewrite(d, drop=("layer_types", "rope_parameters"), rope_theta=1e4,
             rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    hf = AutoConfig.from_pretrained(d)
    assert hf.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert hf.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 5e5}
    assert hf.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert hf.rope_parameters["full_attention"]["rope_theta"] == 1e4
    ref = of.load(d, case.family)
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(ref, case.family, tokens))
    assert err <= TOL, f"logits rel err {err:.3g}"
    _, out, _ = run_ctitan(["describe", d, "--json"])
    assert [x["sliding_window"] for x in json.loads(out)["layers"]] == [5, 5, 5, 0]
