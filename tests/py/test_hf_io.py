"""Hugging Face checkpoints in and out of ctitan: sharded bf16 input, float32/bfloat16
export that transformers loads, tied models with and without lm_head.weight, and bad
tensor sets."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
from conftest import hf_session_args

TOL = 1e-4
L = 16


def batch(vocab, seed, B=2, T=L):
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(B, T)), rng.integers(0, vocab, size=(B, T))


def session_loss(s, tokens, labels):
    s.zero_grad()
    n = oracle.n_valid(labels)
    return s.forward_backward(tokens, labels, n) / n


# ---------------------------------------------------------------------------- (a)

def test_sharded_bf16_load(tmp_path, open_session, run_ctitan):
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=5e6, tied=False)
    hf_dir = tmp_path / "hf_bf16"
    oracle.save_random_hf(hf_dir, cfg, seed=31, dtype=torch.bfloat16, max_shard_size="20KB")
    files = oracle.hf_files(hf_dir)
    assert (hf_dir / "model.safetensors.index.json").exists() and len(files) >= 2, files
    assert oracle.hf_dtypes(hf_dir) == {"BF16"}
    ref_model = oracle.load_hf(hf_dir, dtype=torch.float32)  # HF upcasts the bf16 weights

    # Session: weights, logits and loss equal HF's fp32 view of the bf16 checkpoint.
    tokens, labels = batch(cfg.vocab_size, seed=1)
    s = open_session(hf_session_args(hf_dir))
    for n, p in oracle.param_dict(ref_model).items():
        assert np.array_equal(s.get_param(n), p.detach().numpy()), f"{n}: bf16 -> fp32 load differs"
    assert oracle.rel_err(s.logits(tokens), oracle.hf_logits(ref_model, tokens)) <= TOL
    ref = oracle.hf_loss(ref_model, tokens, labels)
    loss = session_loss(s, tokens, labels)
    assert abs(loss - ref) <= TOL * ref, f"{loss} vs HF {ref}"

    # CLI: 2 steps; step 1 loss is HF's loss on the first micro-batch (windows 0 and 1).
    toks = oracle.random_tokens(8 * (L + 1), cfg.vocab_size, seed=2)
    data = oracle.write_bin(tmp_path / "d.bin", toks)
    out = tmp_path / "out"
    conf = oracle.write_toml(tmp_path / "t.toml", oracle.train_sections(out, data, hf_dir, steps=2, options={
        "checkpoint.enable": True, "checkpoint.last_save_in_hf": True, "checkpoint.export_dtype": "bfloat16"}))
    run_ctitan(["train", "--config", conf])
    rows = oracle.read_metrics(out / "metrics.jsonl")
    inp, lab = oracle.micro_batches(toks, L, 2, 1)[0]
    ref1 = oracle.hf_loss(ref_model, inp, lab)
    assert rows[0]["step"] == 1
    assert abs(rows[0]["loss"] - ref1) <= TOL * ref1, f"step 1 loss {rows[0]['loss']} vs HF {ref1}"
    # Its bfloat16 export loads in transformers with every tensor present.
    exp = out / "checkpoint" / "step-2"
    assert oracle.hf_dtypes(exp) == {"BF16"}
    oracle.load_hf(exp, dtype=torch.float32)


# ---------------------------------------------------------------------------- (b)

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_loads_in_transformers(tied, tmp_path, open_session):
    theta = 5e6  # not the default: catches a hard-coded theta in the written config.json
    cfg = oracle.tiny_config(vocab=192, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=theta, tied=tied)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=32)
    s = open_session(hf_session_args(hf_dir, extra=["--optimizer.lr=0.01", "--lr_scheduler.warmup_steps=0"]))
    # One optimizer step first, so the export must carry ctitan's current weights.
    tokens, labels = batch(cfg.vocab_size, seed=3)
    s.zero_grad()
    s.forward_backward(tokens, labels, oracle.n_valid(labels))
    s.optimizer_step()
    cur = s.params()
    orig = oracle.read_hf_tensors(hf_dir)
    assert any(not np.array_equal(cur[n], orig[n]) for n in cur), "optimizer step changed nothing"

    names = oracle.expected_tensor_names(oracle.build_model(cfg))
    eval_tokens, eval_labels = batch(cfg.vocab_size, seed=4)
    for dtype, st_dtype in (("float32", "F32"), ("bfloat16", "BF16")):
        d = tmp_path / f"export_{dtype}"
        s.save_hf(d, dtype)
        conf = json.loads((d / "config.json").read_text())
        assert conf["model_type"] == "qwen3"
        assert bool(conf.get("tie_word_embeddings", False)) == tied
        got = oracle.read_hf_tensors(d)
        assert set(got) == names, f"{dtype}: extra {set(got) - names}, missing {names - set(got)}"
        assert oracle.hf_dtypes(d) == {st_dtype}
        for n in names:
            want = cur[n] if dtype == "float32" else oracle.bf16_round(cur[n])
            assert np.array_equal(got[n], want), f"{dtype} export of {n} is not the {dtype} of the weights"

        hf = oracle.load_hf(d, dtype=torch.float32)  # asserts no missing/unexpected keys
        assert hf.config.rope_parameters["rope_theta"] == theta
        assert hf.config.tie_word_embeddings == tied
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps"):
            assert getattr(hf.config, k) == getattr(cfg, k), k
        ref = oracle.hf_loss(hf, eval_tokens, eval_labels)
        s2 = open_session(hf_session_args(d))
        loss = session_loss(s2, eval_tokens, eval_labels)
        assert abs(loss - ref) <= TOL * ref, f"{dtype}: ctitan {loss} vs HF {ref}"


# ---------------------------------------------------------------------------- (c)

def test_tied_with_and_without_lm_head(tmp_path, open_session):
    cfg = oracle.tiny_config(vocab=160, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=1e4, tied=True)
    without = tmp_path / "without"
    model = oracle.save_random_hf(without, cfg, seed=33)
    assert "lm_head.weight" not in load_file(str(without / "model.safetensors"))
    with_ = tmp_path / "with"
    shutil.copytree(without, with_)
    sd = load_file(str(with_ / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(with_ / "model.safetensors"), metadata={"format": "pt"})

    tokens, labels = batch(cfg.vocab_size, seed=5)
    ref_logits = oracle.hf_logits(model, tokens)
    ref = oracle.hf_loss(model, tokens, labels)
    for d in (without, with_):
        s = open_session(hf_session_args(d))
        assert "lm_head.weight" not in s.names()
        assert oracle.rel_err(s.logits(tokens), ref_logits) <= TOL, d.name
        loss = session_loss(s, tokens, labels)
        assert abs(loss - ref) <= TOL * ref, f"{d.name}: {loss} vs HF {ref}"


# ---------------------------------------------------------------------------- (d)

def _bad_checkpoint(tmp_path, name, tied, mutate):
    cfg = oracle.tiny_config(vocab=128, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             tied=tied)
    d = tmp_path / name
    oracle.save_random_hf(d, cfg, seed=34)
    f = d / "model.safetensors"
    sd = load_file(str(f))
    mutate(sd)
    save_file(sd, str(f), metadata={"format": "pt"})
    return d


def _drop(key):
    return lambda sd: sd.pop(key)


def _add(key):
    return lambda sd: sd.__setitem__(key, torch.zeros(4, 32))


def _transpose(key):
    return lambda sd: sd.__setitem__(key, sd[key].t().contiguous())


BAD = [
    ("missing", False, "model.layers.1.mlp.up_proj.weight", _drop("model.layers.1.mlp.up_proj.weight")),
    ("missing_lm_head_untied", False, "lm_head.weight", _drop("lm_head.weight")),
    ("missing_embed_tied", True, "model.embed_tokens.weight", _drop("model.embed_tokens.weight")),
    ("extra", False, "model.layers.0.mlp.bogus_proj.weight", _add("model.layers.0.mlp.bogus_proj.weight")),
    # [64,32] stored as [32,64]: same element count, wrong shape.
    ("misshaped", False, "model.layers.0.self_attn.q_proj.weight", _transpose("model.layers.0.self_attn.q_proj.weight")),
    ("misshaped_norm", True, "model.layers.1.self_attn.k_norm.weight",
     lambda sd: sd.__setitem__("model.layers.1.self_attn.k_norm.weight", torch.ones(8))),
]


@pytest.mark.parametrize("name,tied,key,mutate", BAD, ids=[b[0] for b in BAD])
def test_bad_tensor_set_fails(name, tied, key, mutate, tmp_path, run_ctitan):
    d = _bad_checkpoint(tmp_path, name, tied, mutate)
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(4 * (L + 1), 128, seed=6))
    conf = oracle.write_toml(tmp_path / "t.toml", oracle.train_sections(tmp_path / "out", data, d))
    rc, out, err = run_ctitan(["train", "--config", conf], check=False)
    assert rc != 0, f"ctitan accepted a checkpoint with a {name} tensor"
    assert key in err, f"stderr does not name {key}:\n{err}"
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not oracle.read_metrics(
        tmp_path / "out" / "metrics.jsonl"), "ctitan trained on a bad checkpoint"


def test_good_checkpoint_control(tmp_path, run_ctitan):
    """The same harness with an unmodified checkpoint trains (so the failures above come
    from the tensor set, nothing else)."""
    d = _bad_checkpoint(tmp_path, "good", False, lambda sd: None)
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(4 * (L + 1), 128, seed=6))
    conf = oracle.write_toml(tmp_path / "t.toml", oracle.train_sections(tmp_path / "out", data, d))
    run_ctitan(["train", "--config", conf])
    assert [r["step"] for r in oracle.read_metrics(tmp_path / "out" / "metrics.jsonl")] == [1, 2]
