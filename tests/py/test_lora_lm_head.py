"""LoRA on lm_head (PEFT's LoRA Linear on the output layer, target_modules = ["lm_head"]):
logits += scale B A drop(x), A [r, H], B [V, r], computed beside the fused lm_head +
cross-entropy (docs/lora.md). Against PEFT 0.21.2 + transformers (oracle_lora.py): logits,
loss, every adapter gradient and 3 AdamW steps on a tiny untied Qwen3 and a Llama, the
dropout with PEFT given ctitan's documented mask, the adapter file's keys and shapes
(loaded by PEFT: the same logits), `generate --adapter` and `export --merge` read back by
transformers; a tied model as PEFT adapts it (lm_head alone; the merge folds into the one
shared tensor, as PEFT's merge_and_unload); TP 2, TP 3 (an uneven vocabulary) and FSDP 2
against one process; a resumed run (embed_tokens as a target: test_lora_embed_tokens.py)."""
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import oracle
import oracle_lora as OL
from conftest import hf_session_args
from test_lora import OPT_ARGS, _FixedDropout, close, compare_steps, lora_dropout_keep, session_steps, train_ref
from test_parity import make_batch
from test_train_loop import LOCAL_BS, L

TOL = 1e-4
R, ALPHA = 4, 12.0  # scale 3: a missing scale shows
HEAD = ["lm_head.lora_A.weight", "lm_head.lora_B.weight"]


def cfg_qwen3(tied=False, vocab=256):
    return oracle.tiny_config(vocab=vocab, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                              rope_theta=1e4, tied=tied)


def lora_args(targets, adapter=None, r=R, alpha=ALPHA, extra=()):
    a = [f"--lora.rank={r}", f"--lora.alpha={alpha}", f"--lora.target_modules={','.join(targets)}"]
    if adapter is not None:
        a.append(f"--lora.adapter_path={adapter}")
    return a + list(extra)


def peft_setup(tmp_path, cfg, targets, seed=5):
    """A random HF model and a PEFT adapter with random non-zero A and B on `targets`
    (lm_head among them): (hf_dir, adapter_dir, PeftModel, trainable tensors)."""
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=targets, seed=seed)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert set(HEAD) <= set(params), f"test setup: PEFT trains {sorted(params)}"
    return hf_dir, ad, pm, params


def load_quietly(base, ad):
    """PeftModel.from_pretrained with any warning an error. ctitan does not save lm_head's
    base weight beside its adapter (PEFT's save_embedding_layers "auto" does: V x H floats,
    the base model's own), so OL.load_adapter_strict's every-key check does not apply."""
    import warnings
    from peft import PeftModel
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        pm = PeftModel.from_pretrained(base, str(ad))
    pm.eval()
    return pm


def assert_step(s, pm, params, tokens, labels):
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    err = oracle.rel_err(s.logits(tokens), ref_logits)
    assert err <= TOL, f"logits rel err {err:.3g}"
    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert close(loss, ref_loss, TOL), f"loss {loss} vs PEFT {ref_loss}"
    bad = [f"{n}: rel err {oracle.rel_err(s.get_grad(n), ref_grads[n]):.3g}" for n in params
           if not oracle.rel_err(s.get_grad(n), ref_grads[n]) <= TOL]
    assert not bad, "adapter gradients differ from torch autograd:\n" + "\n".join(bad)


@pytest.mark.parametrize("targets", [["lm_head"], ["q_proj", "v_proj", "lm_head"]], ids=["head", "head_qv"])
def test_parity_with_peft(targets, tmp_path, open_session):
    """A PEFT adapter on lm_head (alone, and beside q_proj, v_proj) with random A and B,
    loaded through lora.adapter_path: ctitan's table holds lm_head.lora_A [r, H] and lora_B
    [V, r], trains exactly PEFT's tensors, and gives PEFT's logits, loss and every gradient;
    then 3 AdamW steps equal torch's."""
    cfg = cfg_qwen3()
    hf_dir, ad, pm, params = peft_setup(tmp_path, cfg, targets)
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=5)
    base = oracle.hf_logits(oracle.load_hf(hf_dir), tokens)
    with torch.no_grad():
        assert oracle.rel_err(oracle.hf_logits(pm, tokens), base) > 100 * TOL, "test setup: adapter changes nothing"
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(targets, ad)))
    assert s.names()[-2:] == HEAD, f"lm_head's adapter is not last in the table: {s.names()[-4:]}"
    for n in HEAD:
        assert s.get_param(n).shape == tuple(params[n].shape), n
    assert tuple(params["lm_head.lora_A.weight"].shape) == (R, cfg.hidden_size)
    assert tuple(params["lm_head.lora_B.weight"].shape) == (cfg.vocab_size, R)
    # PEFT saves the adapted lm_head's base weight too (save_embedding_layers "auto"), which its
    # loader puts into the base layer
    saved = {n.replace(".base_layer.", "."): v for n, v in OL.saved_state(pm).items()}
    assert set(saved) == set(params) | {"lm_head.weight"}, sorted(saved)
    bad = [n for n in saved if not np.array_equal(s.get_param(n), saved[n])]
    assert not bad, f"adapter tensors not loaded exactly: {bad}"
    assert_step(s, pm, params, tokens, labels)
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=11)
    compare_steps(session_steps(s, stream, list(params)), train_ref(pm, params, stream))


def test_tied_gemma2_parity_with_peft(tmp_path, open_session):
    """A tied Gemma2 (final logit soft cap 2): PEFT adapts lm_head alone, the embedding lookup
    untouched (no ensure_weight_tying; it warns). ctitan loads that adapter and gives PEFT's
    logits (the adapter before the soft cap), loss and gradients, then 3 AdamW steps."""
    import oracle_families as fam
    case = next(c for c in fam.CASES if c.id == "gemma2")
    fam.save(fam.build(case), tmp_path / "hf")
    with pytest.warns(UserWarning, match="tie_word_embeddings=True"):
        pm = OL.make_peft(fam.load(tmp_path / "hf", "gemma2"), r=R, alpha=ALPHA, targets=["lm_head"], seed=5)
    pm.save_pretrained(str(tmp_path / "adapter"))
    params = OL.trainable(pm)
    assert set(params) == set(HEAD), sorted(params)
    emb = pm.get_input_embeddings()
    assert not hasattr(emb, "lora_embedding_A"), "test setup: PEFT put an adapter on the tied embedding"
    tokens, labels = make_batch(160, 2, L, seed=5)
    s = open_session(hf_session_args(tmp_path / "hf", batch=LOCAL_BS, seq_len=L,
                                     extra=OPT_ARGS + lora_args(["lm_head"], tmp_path / "adapter")))
    assert "lm_head.weight" not in s.names()
    assert_step(s, pm, params, tokens, labels)
    stream = oracle.random_tokens(8 * (L + 1), 160, seed=11)
    compare_steps(session_steps(s, stream, list(params)), train_ref(pm, params, stream))


def test_dropout_matches_peft_with_the_same_mask(tmp_path, open_session):
    """lora.dropout 0.3 on lm_head's adapter: PEFT with its lora_dropout replaced by ctitan's
    documented mask (test_lora.lora_dropout_keep, with the head's key: layer index n_layers,
    projection 0) gives the same training loss and gradients."""
    p, seed = 0.3, 5
    cfg = cfg_qwen3()
    hf_dir, ad, pm, params = peft_setup(tmp_path, cfg, ["lm_head"])
    tokens, labels = make_batch(cfg.vocab_size, LOCAL_BS, L, seed=6)
    loss0, _, grads0 = OL.loss_logits_grads(pm, params, tokens, labels)
    keep = lora_dropout_keep(seed, step=1, layer=cfg.num_hidden_layers, proj=0, n=LOCAL_BS * L * cfg.hidden_size, p=p)
    assert abs(keep.mean() - (1 - p)) < 0.05
    pm.base_model.model.lm_head.lora_dropout["default"] = _FixedDropout(keep.reshape(LOCAL_BS, L, -1), p)
    ref_loss, _, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    assert abs(ref_loss - loss0) > 10 * TOL * ref_loss, "test setup: the dropout hardly changes the loss"
    assert all(oracle.rel_err(ref_grads[n], grads0[n]) > 100 * TOL for n in HEAD)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, seed=seed,
                                     extra=lora_args(["lm_head"], ad, extra=[f"--lora.dropout={p}"])))
    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert close(loss, ref_loss, TOL), f"loss {loss} vs PEFT with the same mask {ref_loss} (no dropout {loss0})"
    bad = [f"{n}: rel err {oracle.rel_err(s.get_grad(n), ref_grads[n]):.3g}" for n in HEAD
           if not oracle.rel_err(s.get_grad(n), ref_grads[n]) <= TOL]
    assert not bad, "\n".join(bad)


def test_saved_adapter_generate_and_merge(tmp_path, open_session, run_ctitan):
    """ctitan's saved adapter (fresh init, one step trained, B then moved at random): PEFT's keys and shapes,
    target_modules ["lm_head"]; PeftModel.from_pretrained loads it without a warning and gives
    the session's logits; `generate --adapter` continues greedily as PEFT does (and not as the
    base); `export --merge` read back by transformers gives PEFT's logits."""
    cfg = cfg_qwen3()
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        ["lm_head"], extra=["--optimizer.lr=0.05"])))
    stream = oracle.random_tokens(4 * (L + 1), cfg.vocab_size, seed=3)
    session_steps(s, stream, HEAD, run=1)
    # a B that moves the greedy continuation (one step from B = 0 hardly does)
    s.set_param(HEAD[1], s.get_param(HEAD[1]) + np.random.default_rng(2).normal(0, 2.0, (cfg.vocab_size, R)))
    ad = tmp_path / "adapter"
    s.save_adapter(ad)
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["lm_head"], conf
    sd = load_file(str(ad / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in sd.items()} == {
        "base_model.model.lm_head.lora_A.weight": (R, cfg.hidden_size),
        "base_model.model.lm_head.lora_B.weight": (cfg.vocab_size, R)}
    assert np.abs(sd["base_model.model.lm_head.lora_B.weight"]).max() > 0
    pm = load_quietly(oracle.load_hf(hf_dir), ad)
    got = OL.saved_state(pm)
    assert all(np.array_equal(got[k[len(OL.PREFIX):]], v) for k, v in sd.items()), "PEFT loaded other values"
    tokens = oracle.random_tokens(2 * L, cfg.vocab_size, seed=4).reshape(2, L)
    with torch.no_grad():
        want = oracle.hf_logits(pm, tokens)
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"session vs PEFT with its saved adapter: {err:.3g}"
    base = oracle.hf_logits(oracle.load_hf(hf_dir), tokens)
    assert oracle.rel_err(want, base) > 1e-3, "test setup: the adapter hardly changes the logits"

    check_generate_and_merge_as_peft(run_ctitan, tmp_path, pm, hf_dir, ad, tokens, want)


def check_generate_and_merge_as_peft(run_ctitan, tmp_path, pm, hf_dir, ad, tokens, want):
    """`generate --adapter` continues a prompt as PEFT's model pm greedily does (and the adapter
    changes that continuation), and `export --merge` read back by transformers gives want, pm's
    logits of tokens."""
    prompt = [5, 17, 200, 3, 99]
    with torch.no_grad():
        ref = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
        with pm.disable_adapter():
            base_ids = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    assert ref != base_ids, "test setup: the adapter does not change the greedy continuation"
    _, out, _ = run_ctitan(["generate", "--checkpoint", hf_dir, "--adapter", ad, "--prompt-ids",
                            " ".join(map(str, prompt)), "--max-tokens", "8", "--ids"])
    assert [int(x) for x in out.split()] == ref

    run_ctitan(["export", "--checkpoint", hf_dir, "--adapter", ad, "--merge", "--out", tmp_path / "merged"])
    err = oracle.rel_err(oracle.hf_logits(oracle.load_hf(tmp_path / "merged"), tokens), want)
    assert err <= 1e-5, f"merged export vs PEFT: {err:.3g}"


def test_tied_merge_folds_into_the_shared_tensor_as_peft(tmp_path, run_ctitan):
    """Tied: PEFT's merge_and_unload adds scale B A to the one shared tensor (warning that the
    input embeddings change too); ctitan's export --merge does the same and says so."""
    cfg = cfg_qwen3(tied=True)
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    with pytest.warns(UserWarning):
        pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=["lm_head"], seed=5)
    pm.save_pretrained(str(ad))
    with pytest.warns(UserWarning, match="tie_word_embeddings=True"):
        merged = pm.merge_and_unload()
    want = merged.model.embed_tokens.weight.detach().numpy()
    _, _, err = run_ctitan(["export", "--checkpoint", hf_dir, "--adapter", ad, "--merge", "--out", tmp_path / "m"])
    assert "tied embedding" in err, err
    got = oracle.load_hf(tmp_path / "m")
    e = oracle.rel_err(got.model.embed_tokens.weight.detach().numpy(), want)
    assert e <= 1e-6, f"merged tied tensor vs PEFT's: {e:.3g}"
    # the same adapter claiming ensure_weight_tying (PEFT would then adapt the embedding instead)
    conf = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps(dict(conf, ensure_weight_tying=True)))
    rc, _, err = run_ctitan(["export", "--checkpoint", hf_dir, "--adapter", ad, "--merge", "--out", tmp_path / "m2"],
                            check=False)
    assert rc == 3 and "ensure_weight_tying: true with target_modules lm_head" in err, (rc, err[-2000:])


def test_refusals(tmp_path, open_session):
    """On a tied model an lm_head adapter beside modules_to_save embed_tokens (one tensor) is refused; lm_head both
    adapted and saved is refused (PEFT puts no adapter inside a module to save)."""
    from conftest import CtitanError
    oracle.save_random_hf(tmp_path / "untied", cfg_qwen3(), seed=11)
    with pytest.raises(CtitanError, match="holds the adapted module lm_head"):
        open_session(hf_session_args(tmp_path / "untied", extra=lora_args(["lm_head"]) + [
            "--lora.modules_to_save=lm_head"]))
    # an adapter on lm_head for a run that does not name it (and the reverse)
    pm = OL.make_peft(oracle.load_hf(tmp_path / "untied"), r=R, alpha=ALPHA, targets=["q_proj", "lm_head"], seed=5)
    pm.save_pretrained(str(tmp_path / "ad"))
    for targets, verb in ((["q_proj"], "adapts"), (["q_proj", "lm_head", "v_proj"], None)):
        with pytest.raises(CtitanError, match=f"the adapter {verb} lm_head" if verb else "v_proj"):
            open_session(hf_session_args(tmp_path / "untied", extra=lora_args(targets, tmp_path / "ad")))
    # PEFT's rank_pattern / alpha_pattern match lm_head too ((.*\.)?(KEY)$): ctitan holds it at r, alpha
    for pat in ('--lora.rank_pattern={".*": 2}', '--lora.alpha_pattern={"lm_head": 3}'):
        with pytest.raises(CtitanError, match="a key selects lm_head"):
            open_session(hf_session_args(tmp_path / "untied", extra=lora_args(["q_proj", "lm_head"]) + [pat]))
    cfg = cfg_qwen3(tied=True)
    oracle.save_random_hf(tmp_path / "hf", cfg, seed=11)
    with pytest.raises(CtitanError, match="choose one"):
        open_session(hf_session_args(tmp_path / "hf", extra=lora_args(["lm_head"]) + [
            "--lora.modules_to_save=embed_tokens"]))


# ---------------------------------------------------------------- layouts against one process

DIST_LORA = ["--lora.rank=4", "--lora.alpha=12", "--lora.target_modules=q_proj,v_proj,lm_head", "--lora.dropout=0.1",
             "--optimizer.eps=1e-4"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """A tiny Qwen3 (vocabulary 251: TP 2 and TP 3 hold uneven blocks, 126 / 125 and 84 / 84 / 83;
    6 heads and kv heads, intermediate 48: TP 2 and TP 3 divide them) and one process's run."""
    from test_dist import run, train_args
    d = tmp_path_factory.mktemp("lora_head_dist")
    oracle.save_random_hf(d / "model", oracle.tiny_config(vocab=251, hidden=30, inter=48, layers=2, heads=6,
                                                          kv_heads=6, head_dim=8), seed=21)
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))

    def args(out, *extra, dp=1):
        return train_args(d / "model", d / "tokens.bin", out, f"--checkpoint.initial_load_path={d / 'model'}",
                          "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_model_only=false",
                          *DIST_LORA, *extra, dp=dp)
    run(1, args(d / "one"))
    return d, args


@pytest.mark.parametrize("layout", ["tp2", "tp3", "fsdp2", "pp2", "cp2"])
def test_layouts_match_one_process(dist, layout):
    """TP 2, TP 3 (B sliced by the uneven vocabulary blocks, A whole, dA summed over the group),
    FSDP 2, PP 2 (the adapter on the last stage) and CP 2 (each rank's chunk of positions, the
    dropout mask indexed by the whole sequence's): losses, validation losses, gradient norms and the final adapter as one process's."""
    from test_dist import assert_same_run, grad_norms, run
    from test_lora_tp import assert_same_adapter
    d, args = dist
    out = d / layout
    n, extra, dp = {"tp2": (2, ["--parallelism.tensor_parallel_degree=2"], 1),
                    "tp3": (3, ["--parallelism.tensor_parallel_degree=3"], 1),
                    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"], 2),
                    "pp2": (2, ["--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.pipeline_parallel_microbatch_size=2"], 1),
                    "cp2": (2, ["--parallelism.context_parallel_degree=2"], 1)}[layout]
    run(n, args(out, *extra, dp=dp))
    ref = load_file(str(d / "one" / "checkpoint" / "step-10" / "adapter_model.safetensors"))
    assert np.abs(ref["base_model.model.lm_head.lora_B.weight"]).max() > 0, "test setup: lm_head's B did not train"
    assert_same_run(out, d / "one", layout)
    assert_same_adapter(out, d / "one", layout)
    got, want = grad_norms(out), grad_norms(d / "one")
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{layout}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"


def test_resume_matches_the_uninterrupted_run(dist):
    """Stopped at step 4 and resumed (under TP 3, then on one process): the later steps and the
    final adapter equal the uninterrupted one-process run's."""
    from test_dist import assert_same_run, run
    from test_lora_tp import assert_same_adapter
    d, args = dist
    out = d / "resume"
    p = run(3, args(out, "--training.stop_at_step=4", "--parallelism.tensor_parallel_degree=3"), check=False)
    assert p.returncode == 75, p.stderr[-3000:]
    p = run(1, args(out))
    assert "resuming from" in p.stderr, p.stderr[-2000:]
    assert_same_run(out, d / "one", "resumed", steps=range(5, 11))
    assert_same_adapter(out, d / "one", "resumed")


def test_bf16_frozen_base(tmp_path, open_session):
    """training.frozen_dtype = bfloat16 on a model whose weights are bf16 values: the frozen
    lm_head is read from its bf16 store beside its fp32 adapter, and the logits, the loss and
    the adapter's gradients equal the fp32-stored run's bit for bit."""
    cfg = cfg_qwen3()
    model = oracle.build_model(cfg, seed=11)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    oracle.save_model(model, tmp_path / "hf")
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=5)
    out = []
    for dt in ("float32", "bfloat16"):
        s = open_session(hf_session_args(tmp_path / "hf", batch=LOCAL_BS, seq_len=L, extra=lora_args(
            ["lm_head"], extra=[f"--training.frozen_dtype={dt}"])))
        s.set_param(HEAD[1], np.random.default_rng(2).normal(0, 0.5, (cfg.vocab_size, R)).astype(np.float32))
        s.zero_grad()
        loss = s.forward_backward(tokens, labels, oracle.n_valid(labels))
        out.append([s.logits(tokens), np.float64(loss)] + [s.get_grad(n) for n in HEAD])
        s.close()
    for i, (a, b) in enumerate(zip(*out)):
        assert np.array_equal(a, b), f"item {i} differs between fp32 and bf16 storage"


def test_peft_tied_adapter_with_ensure_weight_tying_is_refused(tmp_path, open_session):
    """PEFT with ensure_weight_tying = true moves a tied model's lm_head target onto the embedding
    (lora_embedding_A / B, lm_head sharing them), which ctitan does not compute: loading that
    adapter is refused by name, not run as lm_head's or embed_tokens' plain adapter."""
    from conftest import CtitanError
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    oracle.save_random_hf(hf_dir, cfg_qwen3(tied=True), seed=11)
    pm = OL.make_peft(oracle.load_hf(hf_dir), r=R, alpha=ALPHA, targets=["lm_head"], seed=5, ensure_weight_tying=True)
    assert any("lora_embedding_A" in n for n, _ in pm.named_parameters()), "test setup: PEFT did not tie"
    pm.save_pretrained(str(ad))
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["model.embed_tokens"] and conf["ensure_weight_tying"] is True, conf
    for targets in (["lm_head"], ["embed_tokens"]):
        with pytest.raises(CtitanError, match="ensure_weight_tying: true with target_modules embed_tokens"):
            open_session(hf_session_args(hf_dir, extra=lora_args(targets, ad)))
