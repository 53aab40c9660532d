"""LoRA on embed_tokens (PEFT's LoRA Embedding, target_modules = ["embed_tokens"]): the lookup
of id adds scale B A[:, id], lora_embedding_A [r, V], lora_embedding_B [H, r], before any
embed_scale (docs/lora.md). Against PEFT 0.21.2 + transformers (oracle_lora.py): logits, loss,
every adapter gradient and 3 AdamW steps on a tiny untied Qwen3 (the adapter alone and beside
q_proj and lm_head's) and a tied Gemma3 (embed_scale sqrt(H), padding_idx 0 in the batch); the
adapter file's keys and shapes both ways; `generate --adapter` and `export --merge` read back by
transformers (tied: the merge folds into the one shared tensor, lm_head changing too, as PEFT's
merge_and_unload); TP 2, TP 3 (uneven vocabulary), FSDP 2 and PP 2 against one process; a resumed
run; the refusals."""
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import oracle
import oracle_lora as OL
from conftest import hf_session_args
from test_lora import OPT_ARGS, close, compare_steps, session_steps, train_ref
from test_lora_lm_head import cfg_qwen3, check_generate_and_merge_as_peft, load_quietly, lora_args
from test_parity import make_batch
from test_train_loop import LOCAL_BS, L

TOL = 1e-4
R, ALPHA = 4, 12.0  # scale 3: a missing scale shows
EMB = ["model.embed_tokens.lora_embedding_A", "model.embed_tokens.lora_embedding_B"]


def randomize_embedding_adapter(pm, seed=7, std=0.1):
    """make_peft's seed fills lora_A / lora_B only: the embedding's A (PEFT inits it to zeros)
    gets N(0, std) values too, B N(0, std) (its own init is N(0, 1))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_embedding_" in n:
                p.copy_(std * torch.randn(p.shape, generator=g))


def peft_setup(tmp_path, hf_dir, base, targets, seed=5):
    ad = tmp_path / "adapter"
    pm = OL.make_peft(base, r=R, alpha=ALPHA, targets=targets, seed=seed)
    randomize_embedding_adapter(pm)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert set(EMB) <= set(params), f"test setup: PEFT trains {sorted(params)}"
    return ad, pm, params


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
    return ref_grads


@pytest.mark.parametrize("targets", [["embed_tokens"], ["q_proj", "embed_tokens", "lm_head"]],
                         ids=["emb", "emb_q_head"])
def test_parity_with_peft(targets, tmp_path, open_session):
    """A PEFT adapter on embed_tokens (alone, and beside q_proj and lm_head) with random A and
    B, loaded through lora.adapter_path: ctitan's table holds lora_embedding_A [r, V] and _B
    [H, r] under PEFT's keys, trains exactly PEFT's tensors, and gives PEFT's logits, loss and
    every gradient (dA zero outside the batch's ids); then 3 AdamW steps equal torch's."""
    cfg = cfg_qwen3()
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    ad, pm, params = peft_setup(tmp_path, hf_dir, oracle.load_hf(hf_dir), targets)
    tokens, labels = make_batch(cfg.vocab_size, 2, L, seed=5)
    base = oracle.hf_logits(oracle.load_hf(hf_dir), tokens)
    with torch.no_grad():
        assert oracle.rel_err(oracle.hf_logits(pm, tokens), base) > 100 * TOL, "test setup: adapter changes nothing"
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(targets, ad)))
    assert set(s.names()) >= set(params) and set(EMB) <= set(s.names())
    assert tuple(params[EMB[0]].shape) == (R, cfg.vocab_size)
    assert tuple(params[EMB[1]].shape) == (cfg.hidden_size, R)
    for n in params:
        assert s.get_param(n).shape == tuple(params[n].shape), n
    # PEFT saves the adapted embedding's base weight too (save_embedding_layers "auto")
    saved = {n.replace(".base_layer.", "."): v for n, v in OL.saved_state(pm).items()}
    extra = {"model.embed_tokens.weight"} | ({"lm_head.weight"} if "lm_head" in targets else set())
    assert set(saved) == set(params) | extra, sorted(saved)
    bad = [n for n in saved if not np.array_equal(s.get_param(n), saved[n])]
    assert not bad, f"adapter tensors not loaded exactly: {bad}"
    grads = assert_step(s, pm, params, tokens, labels)
    unseen = np.setdiff1d(np.arange(cfg.vocab_size), tokens)
    assert unseen.size and not np.any(grads[EMB[0]][:, unseen]), "test setup: torch's dA has unseen ids"
    assert not np.any(s.get_grad(EMB[0])[:, unseen]), "dA has columns of ids outside the batch"
    stream = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=11)
    compare_steps(session_steps(s, stream, list(params)), train_ref(pm, params, stream))


def test_tied_gemma3_parity_with_peft(tmp_path, open_session):
    """A tied Gemma3 (embed_scale sqrt(H) in its embedding module, pad_token_id 0: padding_idx):
    PEFT adapts the lookup alone, lm_head keeping the base weight, and multiplies the adapter's
    rows by embed_scale. ctitan loads that adapter and gives PEFT's logits, loss and gradients
    (dA's pad column zero, B's gradient with the pad rows), then 3 AdamW steps."""
    import oracle_families as fam
    case = next(c for c in fam.CASES if c.id == "gemma3_text")
    fam.save(fam.build(case), tmp_path / "hf")
    base = fam.load(tmp_path / "hf", "gemma3_text")
    assert base.model.embed_tokens.padding_idx == 0 and float(base.model.embed_tokens.embed_scale) > 6
    ad, pm, params = peft_setup(tmp_path, tmp_path / "hf", base, ["q_proj", "embed_tokens"])
    assert not hasattr(pm.base_model.model.lm_head, "lora_A"), "test setup: PEFT adapted lm_head"
    tokens, labels = make_batch(160, 2, L, seed=5)
    tokens[0, 3] = tokens[1, 5] = 0  # the pad id: A's column 0 gets no gradient, B's does from these rows
    s = open_session(hf_session_args(tmp_path / "hf", batch=LOCAL_BS, seq_len=L,
                                     extra=OPT_ARGS + lora_args(["q_proj", "embed_tokens"], ad)))
    assert "lm_head.weight" not in s.names()
    grads = assert_step(s, pm, params, tokens, labels)
    assert not np.any(grads[EMB[0]][:, 0]) and not np.any(s.get_grad(EMB[0])[:, 0])
    stream = oracle.random_tokens(8 * (L + 1), 160, seed=11)
    compare_steps(session_steps(s, stream, list(params)), train_ref(pm, params, stream))


def test_saved_adapter_generate_and_merge(tmp_path, open_session, run_ctitan):
    """ctitan's saved adapter (fresh init: A zeros, B N(0, 1), as PEFT; one step trained, then A
    moved at random): PEFT's keys and shapes, target_modules ["embed_tokens"]; PEFT loads it
    without a warning and gives the session's logits; `generate --adapter` continues greedily
    as PEFT does (not as the base); `export --merge` read back by transformers gives PEFT's
    logits."""
    cfg = cfg_qwen3()
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=OPT_ARGS + lora_args(
        ["embed_tokens"], extra=["--optimizer.lr=0.05"])))
    a0, b0 = s.get_param(EMB[0]), s.get_param(EMB[1])
    assert not np.any(a0), "fresh lora_embedding_A is not zeros (PEFT's init)"
    assert 0.6 < b0.std() < 1.4 and abs(b0.mean()) < 0.5, f"fresh lora_embedding_B not N(0, 1): {b0.std()}"
    stream = oracle.random_tokens(4 * (L + 1), cfg.vocab_size, seed=3)
    session_steps(s, stream, EMB, run=1)
    s.set_param(EMB[0], s.get_param(EMB[0]) + np.random.default_rng(2).normal(0, 0.5, (R, cfg.vocab_size)))
    ad = tmp_path / "adapter"
    s.save_adapter(ad)
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["target_modules"] == ["embed_tokens"], conf
    sd = load_file(str(ad / "adapter_model.safetensors"))
    assert {k: v.shape for k, v in sd.items()} == {
        "base_model.model.model.embed_tokens.lora_embedding_A": (R, cfg.vocab_size),
        "base_model.model.model.embed_tokens.lora_embedding_B": (cfg.hidden_size, R)}
    pm = load_quietly(oracle.load_hf(hf_dir), ad)
    got = OL.saved_state(pm)
    assert all(np.array_equal(got[k[len(OL.PREFIX):]], v) for k, v in sd.items()), "PEFT loaded other values"
    tokens = oracle.random_tokens(2 * L, cfg.vocab_size, seed=4).reshape(2, L)
    with torch.no_grad():
        want = oracle.hf_logits(pm, tokens)
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"session vs PEFT with its saved adapter: {err:.3g}"
    assert oracle.rel_err(want, oracle.hf_logits(oracle.load_hf(hf_dir), tokens)) > 1e-3, "test setup"

    check_generate_and_merge_as_peft(run_ctitan, tmp_path, pm, hf_dir, ad, tokens, want)


def test_tied_merge_folds_into_the_shared_tensor_as_peft(tmp_path, run_ctitan):
    """Tied: PEFT's merge_and_unload adds scale (B A)^T to the one shared tensor, so lm_head
    changes too; ctitan's export --merge does the same and warns. The same adapter claiming
    ensure_weight_tying (PEFT would then adapt lm_head with it too) is refused."""
    cfg = cfg_qwen3(tied=True)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=11)
    ad, pm, _ = peft_setup(tmp_path, hf_dir, oracle.load_hf(hf_dir), ["embed_tokens"])
    merged = pm.merge_and_unload()
    want = merged.model.embed_tokens.weight.detach().numpy()
    assert merged.lm_head.weight.data_ptr() == merged.model.embed_tokens.weight.data_ptr()
    _, _, err = run_ctitan(["export", "--checkpoint", hf_dir, "--adapter", ad, "--merge", "--out", tmp_path / "m"])
    assert "tied embedding" in err and "lm_head changes too" in err, err
    e = oracle.rel_err(oracle.load_hf(tmp_path / "m").model.embed_tokens.weight.detach().numpy(), want)
    assert e <= 1e-6, f"merged tied tensor vs PEFT's: {e:.3g}"
    conf = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps(dict(conf, ensure_weight_tying=True)))
    rc, _, err = run_ctitan(["export", "--checkpoint", hf_dir, "--adapter", ad, "--merge", "--out", tmp_path / "m2"],
                            check=False)
    assert rc == 3 and "ensure_weight_tying: true with target_modules embed_tokens" in err, (rc, err[-2000:])


def test_refusals(tmp_path, open_session):
    """embed_tokens both adapted and saved (PEFT puts no adapter inside a module to save); on a
    tied model beside modules_to_save embed_tokens (one tensor); an adapter on embed_tokens for
    a run that does not name it; rank_pattern / alpha_pattern selecting it (held at r, alpha)."""
    from conftest import CtitanError
    oracle.save_random_hf(tmp_path / "untied", cfg_qwen3(), seed=11)
    with pytest.raises(CtitanError, match="holds the adapted module embed_tokens"):
        open_session(hf_session_args(tmp_path / "untied", extra=lora_args(["embed_tokens"]) + [
            "--lora.modules_to_save=embed_tokens"]))
    pm = OL.make_peft(oracle.load_hf(tmp_path / "untied"), r=R, alpha=ALPHA, targets=["q_proj", "embed_tokens"])
    pm.save_pretrained(str(tmp_path / "ad"))
    with pytest.raises(CtitanError, match="the adapter adapts embed_tokens"):
        open_session(hf_session_args(tmp_path / "untied", extra=lora_args(["q_proj"], tmp_path / "ad")))
    for pat in ('--lora.rank_pattern={"embed_tokens": 2}', '--lora.alpha_pattern={".*": 3}'):
        with pytest.raises(CtitanError, match="a key selects embed_tokens"):
            open_session(hf_session_args(tmp_path / "untied", extra=lora_args(["q_proj", "embed_tokens"]) + [pat]))
    oracle.save_random_hf(tmp_path / "tied", cfg_qwen3(tied=True), seed=11)
    with pytest.raises(CtitanError, match="adapts embed_tokens, the same tied tensor.*choose one"):
        open_session(hf_session_args(tmp_path / "tied", extra=lora_args(["embed_tokens"]) + [
            "--lora.modules_to_save=lm_head"]))


def test_bf16_frozen_base(tmp_path, open_session):
    """training.frozen_dtype = bfloat16 on a model whose weights are bf16 values: the frozen
    embedding is looked up from its bf16 store and the fp32 adapter added to it; the logits, the
    loss and the adapter's gradients equal the fp32-stored run's bit for bit."""
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
            ["embed_tokens"], extra=[f"--training.frozen_dtype={dt}"])))
        s.set_param(EMB[0], np.random.default_rng(2).normal(0, 0.5, (R, cfg.vocab_size)).astype(np.float32))
        s.zero_grad()
        loss = s.forward_backward(tokens, labels, oracle.n_valid(labels))
        out.append([s.logits(tokens), np.float64(loss)] + [s.get_grad(n) for n in EMB])
        s.close()
    assert np.abs(out[0][2]).max() > 0 and np.abs(out[0][3]).max() > 0, "test setup: no adapter gradient"
    for i, (a, b) in enumerate(zip(*out)):
        assert np.array_equal(a, b), f"item {i} differs between fp32 and bf16 storage"


# ---------------------------------------------------------------- layouts against one process

DIST_LORA = ["--lora.rank=4", "--lora.alpha=12", "--lora.target_modules=q_proj,embed_tokens", "--optimizer.eps=1e-4"]


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    """A tiny Qwen3 (vocabulary 251: TP 2 and TP 3 hold uneven blocks) and one process's run."""
    from test_dist import run, train_args
    d = tmp_path_factory.mktemp("lora_embed_dist")
    oracle.save_random_hf(d / "model", oracle.tiny_config(vocab=251, hidden=30, inter=48, layers=2, heads=6,
                                                          kv_heads=6, head_dim=8), seed=21)
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))

    def args(out, *extra, dp=1):
        return train_args(d / "model", d / "tokens.bin", out, f"--checkpoint.initial_load_path={d / 'model'}",
                          "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_model_only=false",
                          *DIST_LORA, *extra, dp=dp)
    run(1, args(d / "one"))
    return d, args


@pytest.mark.parametrize("layout", ["tp2", "tp3", "tp2nosp", "fsdp2", "pp2", "cp2"])
def test_layouts_match_one_process(dist, layout):
    """TP 2, TP 3 (A and B whole on every rank, the adapter added once after the vocabulary
    blocks' lookup is summed), TP 2 without sequence parallel, FSDP 2 (the embedding's piece
    kept for the backward, which reads A and B), PP 2 (the adapter on the first stage) and CP 2: losses,
    gradient norms and the final adapter as one process's."""
    from test_dist import assert_same_run, grad_norms, run
    from test_lora_tp import assert_same_adapter
    d, args = dist
    out = d / layout
    n, extra, dp = {"tp2": (2, ["--parallelism.tensor_parallel_degree=2"], 1),
                    "tp3": (3, ["--parallelism.tensor_parallel_degree=3"], 1),
                    "tp2nosp": (2, ["--parallelism.tensor_parallel_degree=2",
                                    "--parallelism.sequence_parallel=false"], 1),
                    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"], 2),
                    "pp2": (2, ["--parallelism.pipeline_parallel_degree=2",
                                "--parallelism.pipeline_parallel_microbatch_size=2"], 1),
                    "cp2": (2, ["--parallelism.context_parallel_degree=2"], 1)}[layout]
    run(n, args(out, *extra, dp=dp))
    ref = load_file(str(d / "one" / "checkpoint" / "step-10" / "adapter_model.safetensors"))
    assert np.abs(ref["base_model.model.model.embed_tokens.lora_embedding_A"]).max() > 0, "test setup: A did not train"
    assert_same_run(out, d / "one", layout)
    assert_same_adapter(out, d / "one", layout)
    got, want = grad_norms(out), grad_norms(d / "one")
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{layout}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"


def test_resume_matches_the_uninterrupted_run(dist):
    """Stopped at step 4 under TP 3 and resumed on one process: the later steps and the final
    adapter equal the uninterrupted one-process run's."""
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
