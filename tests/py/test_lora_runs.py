"""LoRA and frozen tensors through `ctitan train` (the CLI, one process and under mpirun):
an interrupted LoRA run resumes bit for bit (dropout masks replayed, gradient accumulation),
also under FSDP 2; the frozen base never moves; FSDP 2 and DP 2 train the adapters like one
process with the same global batch; the final last_save_in_hf save is a PEFT adapter
directory that peft.PeftModel.from_pretrained loads and that gives ctitan's own logits
(on a tied model with modules_to_save embed_tokens or lm_head too: PEFT's
ensure_weight_tying layout, read back both ways; what the tied tensor cannot compute refused);
config errors exit 2 naming the key (an unknown target or module, a freeze
pattern matching nothing, an adapter without a rank); training.freeze without LoRA keeps the
frozen tensors bit for bit while the others train; a bf16-stored frozen base under FSDP 2
(frozen_dtype bfloat16) trains like one process with bf16 storage, resumes bit for bit,
exports the rounded base, and the dry run's per-rank parameter bytes count it at 2 bytes.

Expected values are ctitan against itself (an uninterrupted run, one process), the initial
HF files, and PEFT / transformers (the adapter directory test).

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import json
import logging
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import oracle
import oracle_lora as OL
from conftest import BIN, CHILD_ENV, ROOT, hf_session_args, crashed

R, ALPHA = 4, 8.0
STEPS = 6
MICRO = 2      # sequences per micro-batch per rank
SEQ = 16
VOCAB = 251

# one OpenMP thread per rank under mpirun: 2 ranks share 2 cores
from test_dist import ENV as MPI_ENV, mpirun  # noqa: E402  (mpirun as the layout tests launch it)
from test_resume import losses  # noqa: E402  (each step once, in order: step -> loss)


def run(np_, args, timeout=120, check=True):
    """`ctitan` on np_ processes (mpirun for np_ > 1) -> CompletedProcess."""
    if np_ == 1:
        cmd, env = [str(BIN)], CHILD_ENV
    else:
        cmd, env = mpirun() + ["-np", str(np_), str(BIN)], MPI_ENV
    cmd += [str(a) for a in args]
    if not BIN.exists():
        pytest.fail(f"{BIN} is missing: run `make all` first", pytrace=False)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    if check and p.returncode != 0:
        pytest.fail(f"exit {p.returncode}: {' '.join(cmd)}\n--- stderr\n{p.stderr[-4000:]}", pytrace=False)
    return p


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny HF Qwen3 (random fp32 weights; hidden 30 so that no FSDP piece divides evenly
    by 2) and a token file."""
    d = tmp_path_factory.mktemp("lora_runs")
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=30, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(d / "model", cfg, seed=21)
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(300 * (SEQ + 1), VOCAB, seed=7))
    return d, d / "model", data


def train_args(model_dir, data, out, *extra, ranks=1, accum=2, lora=True, dropout=0.0, steps=STEPS):
    """A training run from the HF weights: global batch = accum micro-batches per rank, full
    checkpoints (model + AdamW moments) only at the end or at stop_at_step."""
    a = ["train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}",
         f"--checkpoint.initial_load_path={model_dir}", "--checkpoint.initial_load_in_hf",
         f"--training.dataset_path={data}", f"--training.seq_len={SEQ}", f"--training.local_batch_size={MICRO}",
         f"--training.global_batch_size={MICRO * accum * ranks}", f"--training.steps={steps}",
         "--training.shuffle", "--training.seed=11", "--optimizer.lr=1e-2", "--optimizer.weight_decay=0.1",
         "--lr_scheduler.warmup_steps=2", "--lr_scheduler.decay_type=cosine", "--lr_scheduler.decay_ratio=0.5",
         "--metrics.log_freq=1", "--metrics.peak_tflops=1", f"--job.dump_folder={out}", "--checkpoint.enable",
         "--checkpoint.interval=1000", "--checkpoint.last_save_model_only=false",
         "--checkpoint.last_save_in_hf=false", "--checkpoint.keep_latest_k=0"]
    if ranks > 1:
        a.append(f"--parallelism.data_parallel_shard_degree={ranks}")
    if lora:
        a += [f"--lora.rank={R}", f"--lora.alpha={ALPHA}", f"--lora.dropout={dropout}"]
    return a + list(extra)


def ckpt(out, step=STEPS):
    return Path(out) / "checkpoint" / f"step-{step}"


def tensors(out, step=STEPS, files=("model.safetensors", "optim.safetensors", "adapter_model.safetensors")):
    """{file:name: ndarray} of a training checkpoint step-N."""
    res = {}
    for f in files:
        path = ckpt(out, step) / f
        assert path.exists(), f"{path} is missing: {sorted(p.name for p in path.parent.iterdir())}"
        for k, v in load_file(str(path)).items():
            res[f"{f}:{k}"] = v
    return res


def lora_names(t):
    return sorted(k for k in t if ".lora_A." in k or ".lora_B." in k)


# --------------------------------------------------------------------------- runs shared by several tests

@pytest.fixture(scope="module")
def straight(setup):
    """Uninterrupted LoRA runs with dropout 0.1: {ranks: out} for 1 process and FSDP 2."""
    d, model, data = setup
    outs = {}
    for n in (1, 2):
        out = d / f"straight_{n}"
        run(n, train_args(model, data, out, ranks=n, dropout=0.1))
        outs[n] = out
    return outs


@pytest.fixture(scope="module")
def no_dropout(setup):
    """LoRA with dropout 0 on one process (the reference for the layouts)."""
    d, model, data = setup
    out = d / "single_nodrop"
    run(1, train_args(model, data, out, dropout=0.0))
    return out


@pytest.fixture(scope="module")
def no_dropout_gb8(setup):
    """The reference of the 2-rank layouts: one process, 4 micro-batches of 2 per step
    (2 ranks x 2 micro-batches of 2), dropout 0."""
    d, model, data = setup
    out = d / "single_nodrop_gb8"
    run(1, train_args(model, data, out, accum=4))
    return out


# --------------------------------------------------------------------------- 1. resume

@pytest.mark.parametrize("ranks", [1, 2], ids=["1proc", "fsdp2"])
def test_lora_resume_is_bit_identical(setup, straight, ranks):
    """Stopped at step 3 and resumed to 6: the losses of every step and the final adapters,
    base weights and AdamW moments equal the uninterrupted run's bit for bit. Dropout 0.1
    and 2 micro-batches per rank per step: the resumed steps must draw the same masks."""
    d, model, data = setup
    out = d / f"resumed_{ranks}"
    args = train_args(model, data, out, ranks=ranks, dropout=0.1)
    p = run(ranks, args + ["--training.stop_at_step=3"], check=False)
    assert p.returncode == 75, f"stop_at_step must exit 75 after saving, got {p.returncode}\n{p.stderr[-3000:]}"
    assert (ckpt(out, 3) / "manifest.json").exists()
    assert (ckpt(out, 3) / "adapter_model.safetensors").exists(), sorted(q.name for q in ckpt(out, 3).iterdir())
    p = run(ranks, args)
    assert "resuming from" in p.stderr and "step-3" in p.stderr, p.stderr[-3000:]

    ref, got = losses(straight[ranks]), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), f"steps logged: {sorted(got)}"
    diff = [(s, ref[s], got[s]) for s in ref if ref[s] != got[s]]
    assert not diff, f"losses differ (step, uninterrupted, resumed): {diff}"

    a, b = tensors(straight[ranks]), tensors(out)
    assert a.keys() == b.keys(), f"tensor names differ: {sorted(a.keys() ^ b.keys())[:6]}"
    assert lora_names(a), f"no lora tensors in the checkpoint: {sorted(a)[:6]}"
    bad = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not bad, f"resumed run not bit-identical to the uninterrupted one: {bad[:6]}"


def test_lora_dropout_changes_the_run(straight, no_dropout):
    """Guard for the resume test: dropout 0.1 is really applied (otherwise replaying the
    masks would be tested with no masks at all)."""
    a, b = losses(straight[1]), losses(no_dropout)
    # lora_B starts at zero, so step 1's forward (its loss) is the base model's either way
    assert a[1] == b[1], f"step 1 loss {a[1]!r} with dropout vs {b[1]!r} without: B = 0 at step 1"
    same = [s for s in range(2, STEPS + 1) if a[s] == b[s]]
    assert not same, f"steps with dropout 0.1 have dropout 0's loss: {same}"


# --------------------------------------------------------------------------- 2. frozen base

@pytest.mark.parametrize("ranks", [1, 2], ids=["1proc", "fsdp2"])
def test_lora_checkpoint_holds_the_trained_tensors_only(setup, straight, ranks):
    """A LoRA run's full checkpoint holds the adapters and their AdamW moments and nothing of
    the frozen base (resume takes the base from checkpoint.initial_load_path again; the
    session tests in test_lora.py check that training leaves the base bit-unchanged), every
    lora_B trained away from its zero start, and the checkpoint's adapter_model.safetensors
    holds its lora tensors exactly."""
    d, model, data = setup
    init = oracle.read_hf_tensors(model)
    t = tensors(straight[ranks], files=("model.safetensors", "optim.safetensors"))
    params = {k.split(":", 1)[1] for k in t if k.startswith("model.safetensors:")}
    assert params and all(".lora_" in n for n in params), f"base tensors in the checkpoint: {sorted(params)[:4]}"
    assert not params & set(init)
    moments = {k.split(":", 1)[1] for k in t if k.startswith("optim.safetensors:")}
    assert moments == {f"{n}.{m}" for n in params for m in ("exp_avg", "exp_avg_sq")}, sorted(moments)[:4]
    lora_b = [k for k in t if k.startswith("model.safetensors:") and ".lora_B." in k]
    assert len(lora_b) == 2 * 7, f"lora_B tensors: {lora_b}"  # 2 layers x 7 projections
    zero = [k for k in lora_b if not np.any(t[k])]
    assert not zero, f"lora_B still zero after {STEPS} steps: {zero}"
    # the checkpoint's adapter_model.safetensors holds the same adapters under PEFT's keys
    ad = tensors(straight[ranks], files=("adapter_model.safetensors",))
    pre = "adapter_model.safetensors:base_model.model."
    assert all(k.startswith(pre) for k in ad), sorted(ad)[:4]
    mine = {k.split(":", 1)[1]: v for k, v in t.items() if k.startswith("model.safetensors:") and ".lora_" in k}
    assert {k[len(pre):] for k in ad} == set(mine), f"adapter file keys {sorted(ad)[:4]} vs {sorted(mine)[:4]}"
    bad = [k for k in ad if not np.array_equal(ad[k], mine[k[len(pre):]])]
    assert not bad, f"adapter_model.safetensors differs from the checkpoint's own lora tensors: {bad[:4]}"


# --------------------------------------------------------------------------- 3. layouts

@pytest.mark.parametrize("name,rep,shard", [("fsdp2", 1, 2), ("dp2", 2, 1)])
def test_lora_layout_matches_one_process(setup, no_dropout_gb8, name, rep, shard):
    """LoRA (dropout 0) under FSDP 2 and DP 2 with the same global batch as one process
    (2 micro-batches per rank vs 4): the same losses to 1e-5 relative, the same final
    adapters to 1e-5 of each tensor's largest element, the base still the HF file's."""
    d, model, data = setup
    out = d / f"layout_{name}"
    args = [a for a in train_args(model, data, out, ranks=2) if not a.startswith("--parallelism.")]
    run(2, args + [f"--parallelism.data_parallel_replicate_degree={rep}",
                   f"--parallelism.data_parallel_shard_degree={shard}"])
    ref_out = no_dropout_gb8

    want, got = losses(ref_out), losses(out)
    assert sorted(got) == list(range(1, STEPS + 1)), f"{name}: steps logged {sorted(got)}"
    bad = [(s, got[s], want[s]) for s in want if not abs(got[s] - want[s]) <= 1e-5 * abs(want[s])]
    assert not bad, f"{name}: (step, loss, one process's loss) beyond 1e-5 relative: {bad}"

    a = tensors(out, files=("adapter_model.safetensors", "model.safetensors"))
    b = tensors(ref_out, files=("adapter_model.safetensors", "model.safetensors"))
    assert a.keys() == b.keys(), f"{name}: tensor names differ"
    names = lora_names(b)
    assert names, "no lora tensors"
    for k in names:
        err = np.max(np.abs(a[k] - b[k])) / max(float(np.max(np.abs(b[k]))), 1e-30)
        assert err <= 1e-5, f"{name}: final {k} differs from one process by {err:.3g} of its largest element"
    assert not [k for k in a if k.startswith("model.safetensors:") and ".lora_" not in k], \
        f"{name}: base tensors in a LoRA checkpoint"


# --------------------------------------------------------------------------- 4. PEFT adapter directory

class _Grab(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record.getMessage())


def test_final_save_is_a_peft_adapter_dir(setup, tmp_path, run_ctitan, open_session):
    """A TOML-configured LoRA run (target_modules an array, rsLoRA) with last_save_in_hf:
    the final save is adapter_config.json + adapter_model.safetensors and nothing else;
    PeftModel.from_pretrained loads it on the fp32 transformers base without a warning, no
    key missing or unexpected; PEFT's logits equal those of a ctitan session started from
    that directory (lora.adapter_path) to 1e-4 relative, and differ from the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    d, model, data = setup
    out = tmp_path / "run"
    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    sec = oracle.train_sections(out, data, model, steps=4, seq_len=SEQ, local_bs=MICRO, global_bs=2 * MICRO,
                                lr=2e-2, warmup_steps=1, seed=3)
    sec["checkpoint"].update({"enable": True, "interval": 1000, "last_save_in_hf": True, "keep_latest_k": 0})
    sec["lora"] = {"rank": R, "alpha": 16.0, "dropout": 0.05, "use_rslora": True,
                   "target_modules": oracle.Raw(json.dumps(targets))}
    run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "lora.toml", sec)])
    ad = out / "checkpoint" / "step-4"
    assert ad.is_dir(), f"no final save at {ad}"
    assert sorted(p.name for p in ad.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"], \
        f"the final save is not a bare PEFT adapter directory: {sorted(p.name for p in ad.iterdir())}"
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == R and conf["lora_alpha"] == 16 and conf["use_rslora"], conf
    assert sorted(conf["target_modules"]) == sorted(targets), conf
    saved = load_file(str(ad / "adapter_model.safetensors"))
    want_keys = {f"base_model.model.model.layers.{i}.{blk}.{p}.lora_{ab}.weight"
                 for i in range(2) for p in targets for ab in "AB"
                 for blk in (["self_attn"] if p in ("q_proj", "k_proj", "v_proj", "o_proj") else ["mlp"])}
    assert set(saved) == want_keys, f"adapter keys: {sorted(set(saved) ^ want_keys)}"

    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32, attn_implementation="eager")
    base.eval()
    tokens = oracle.random_tokens(2 * SEQ, VOCAB, seed=4).reshape(2, SEQ)
    base_logits = oracle.hf_logits(base, tokens)
    grab = _Grab()
    loggers = [logging.getLogger(n) for n in ("peft", "transformers", "")]
    for lg in loggers:
        lg.addHandler(grab)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pm = PeftModel.from_pretrained(base, str(ad))
            again = pm.load_adapter(str(ad), adapter_name="again")
    finally:
        for lg in loggers:
            lg.removeHandler(grab)
    msgs = [str(w.message) for w in caught if "is_gradient_checkpointing" not in str(w.message)] + grab.records
    bad = [m for m in msgs if "missing" in m.lower() or "unexpected" in m.lower() or "adapter" in m.lower()]
    assert not bad, f"PEFT warned loading {ad}: {bad}"
    assert not again.missing_keys and not again.unexpected_keys, \
        f"missing {again.missing_keys[:4]}, unexpected {again.unexpected_keys[:4]}"
    pm.set_adapter("default")
    pm.eval()
    # every stored tensor reached the model with its value
    sd = pm.state_dict()
    for k, v in saved.items():
        mk = k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
        assert mk in sd, f"{k} was not loaded into the PEFT model"
        assert np.array_equal(sd[mk].numpy(), v), f"{k} loaded with another value"
    assert any(np.any(v) for k, v in saved.items() if ".lora_B." in k), "lora_B all zero: nothing trained"
    with torch.no_grad():
        want = pm(input_ids=torch.as_tensor(tokens)).logits.float().numpy()

    s = open_session(hf_session_args(model, batch=2, seq_len=SEQ, extra=[
        f"--lora.rank={R}", "--lora.alpha=16", "--lora.use_rslora", f"--lora.target_modules={','.join(targets)}",
        f"--lora.adapter_path={ad}"]))
    got = s.logits(tokens)
    err = oracle.rel_err(got, want)
    assert err <= 1e-4, f"ctitan logits from the adapter vs PEFT's: rel err {err:.3g}"
    moved = oracle.rel_err(want, base_logits)
    assert moved > 1e-3, f"the adapter hardly changes the logits ({moved:.3g}): the comparison proves nothing"


# --------------------------------------------------------------------------- 4b. tied embeddings

@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """A tiny HF Qwen3 with tie_word_embeddings (lm_head is the embedding) and a token file."""
    d = tmp_path_factory.mktemp("lora_tied")
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8, tied=True)
    oracle.save_random_hf(d / "model", cfg, seed=23)
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(300 * (SEQ + 1), VOCAB, seed=9))
    return d / "model", data


def merged_logits(run_ctitan, model, ad, out, tokens):
    """`ctitan export --checkpoint model --adapter ad --merge`, read back by transformers: its logits."""
    run_ctitan(["export", "--checkpoint", model, "--adapter", ad, "--merge", "--out", out])
    return oracle.hf_logits(oracle.load_hf(out), tokens)


@pytest.mark.parametrize("name", ["embed_tokens", "lm_head"])
def test_tied_modules_to_save_adapter_loads_in_peft(tied, tmp_path, run_ctitan, open_session, name):
    """lora.modules_to_save = embed_tokens (or lm_head: the same tensor) on a tied model
    trains the one embedding, which is also the lm_head. The adapter directory says so as
    PEFT does (ensure_weight_tying true, the tensor under both keys): PeftModel.from_pretrained
    loads it without a warning (no "tie_word_embeddings=True ... ensure_weight_tying is not
    set"), every file tensor lands in the model, PEFT's lm_head is its trained embedding, and
    PEFT's logits equal those of ctitan's merged export and of a ctitan session that reads
    the adapter back."""
    model, data = tied
    out = tmp_path / "run"
    run(1, train_args(model, data, out, f"--lora.modules_to_save={name}", "--checkpoint.last_save_in_hf=true",
                      steps=3))
    ad = ckpt(out, 3)
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf.get("ensure_weight_tying") is True, f"a tied embedding saved without ensure_weight_tying: {conf}"
    assert conf.get("modules_to_save") == [name], conf
    saved = load_file(str(ad / "adapter_model.safetensors"))
    emb, head = "base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight"
    assert emb in saved and head in saved, f"PEFT's tied layout has both keys: {sorted(saved)}"
    assert np.array_equal(saved[emb], saved[head]), "the tied pair saved with two values"
    base_emb = load_file(str(model / "model.safetensors"))["model.embed_tokens.weight"]
    assert not np.array_equal(saved[emb], base_emb), "the embedding did not train"

    pm = OL.load_adapter_strict(oracle.load_hf(model), ad)
    assert pm.get_output_embeddings().weight.data_ptr() == pm.get_input_embeddings().weight.data_ptr(), \
        "PEFT's lm_head is not its trained embedding"
    tokens = oracle.random_tokens(2 * SEQ, VOCAB, seed=4).reshape(2, SEQ)
    with torch.no_grad():
        want = oracle.hf_logits(pm, tokens)
    got = merged_logits(run_ctitan, model, ad, tmp_path / "merged", tokens)
    err = oracle.rel_err(got, want)
    assert err <= 1e-5, f"ctitan's merged export vs PEFT with ctitan's adapter: rel err {err:.3g}"
    base_logits = oracle.hf_logits(oracle.load_hf(model), tokens)
    assert oracle.rel_err(want, base_logits) > 1e-3, "test setup: the adapter hardly changes the logits"
    s = open_session(hf_session_args(model, batch=2, seq_len=SEQ, extra=[
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}", f"--lora.modules_to_save={name}", f"--lora.adapter_path={ad}"]))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= 1e-5, f"a ctitan session from the adapter vs PEFT: rel err {err:.3g}"


def peft_tied_adapter(model, ad, ensure_weight_tying, modules_to_save=("embed_tokens",)):
    """PEFT's own adapter on the tied model: random A and B on q_proj and v_proj, the
    embedding's trained copy moved by noise; saved to ad. Returns the PeftModel."""
    pm = OL.make_peft(oracle.load_hf(model), r=R, alpha=ALPHA, targets=["q_proj", "v_proj"],
                      modules_to_save=list(modules_to_save), seed=3, ensure_weight_tying=ensure_weight_tying)
    pm.save_pretrained(str(ad))
    return pm


def test_peft_tied_adapter_reads_in_ctitan(tied, tmp_path, run_ctitan, open_session):
    """PEFT's own ensure_weight_tying adapter (modules_to_save grown to [embed_tokens,
    model.embed_tokens], the tensor under both keys): ctitan's merged export, and a training
    session started from it, give PEFT's logits."""
    model, _ = tied
    ad = tmp_path / "peft_adapter"
    pm = peft_tied_adapter(model, ad, True)
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["ensure_weight_tying"] is True and "embed_tokens" in conf["modules_to_save"], conf
    tokens = oracle.random_tokens(2 * SEQ, VOCAB, seed=5).reshape(2, SEQ)
    with torch.no_grad():
        want = oracle.hf_logits(pm, tokens)
    err = oracle.rel_err(merged_logits(run_ctitan, model, ad, tmp_path / "merged", tokens), want)
    assert err <= 1e-5, f"ctitan's merge of PEFT's tied adapter vs PEFT: rel err {err:.3g}"
    s = open_session(hf_session_args(model, batch=2, seq_len=SEQ, extra=[
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.target_modules=q_proj,v_proj",
        "--lora.modules_to_save=embed_tokens", f"--lora.adapter_path={ad}"]))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= 1e-5, f"a ctitan session from PEFT's tied adapter vs PEFT: rel err {err:.3g}"


def test_tied_adapter_ctitan_cannot_compute_is_refused(tied, tmp_path, run_ctitan):
    """What ctitan's one tied tensor cannot compute is refused, naming the key: a PEFT
    adapter that trains the tied embedding without ensure_weight_tying (PEFT then copies
    embed_tokens and keeps lm_head at the base weights), and lora.modules_to_save naming
    the pair by a suffix that PEFT does not tie ("tokens" trains a copy of embed_tokens
    alone there)."""
    model, data = tied
    ad = tmp_path / "untied_adapter"
    peft_tied_adapter(model, ad, False)
    rc, _, err = run_ctitan(["export", "--checkpoint", model, "--adapter", ad, "--merge", "--out", tmp_path / "m"],
                            check=False)
    assert rc != 0 and "ensure_weight_tying" in err and "embed_tokens" in err, f"exit {rc}: {err[-2000:]}"
    assert not (tmp_path / "m").exists(), "a refused merge wrote a model"
    p = run(1, train_args(model, data, tmp_path / "bad", "--lora.modules_to_save=tokens"), check=False, timeout=60)
    assert_config_error(p, "lora.modules_to_save", '"tokens"', "embed_tokens")


# --------------------------------------------------------------------------- 5. config errors

def assert_config_error(p, *words):
    assert p.returncode == 2, f"exit {p.returncode}, want 2 (config error)\n{p.stderr[-3000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once (rank 0):\n{p.stderr[-3000:]}"
    missing = [w for w in words if w not in err[0]]
    assert not missing, f"the error does not name {missing}: {err[0]}"


@pytest.mark.parametrize("extra,words", [
    (["--lora.target_modules=c_attn"], ["lora.target_modules", "c_attn"]),
    (["--training.freeze=model.nothing.*"], ["training.freeze", "model.nothing.*"]),
    (["--lora.modules_to_save=c_proj"], ["lora.modules_to_save", "c_proj"]),
], ids=["unknown_target", "freeze_matches_nothing", "unknown_module_to_save"])
def test_lora_config_errors_exit_2(setup, tmp_path, extra, words):
    d, model, data = setup
    p = run(1, train_args(model, data, tmp_path / "bad", *extra), check=False, timeout=60)
    assert_config_error(p, *words)
    assert "step:" not in p.stdout, f"a config error must stop before training:\n{p.stdout[-2000:]}"


def test_freeze_matching_nothing_without_lora_exits_2(setup, tmp_path):
    d, model, data = setup
    p = run(1, train_args(model, data, tmp_path / "bad", "--training.freeze=model.nothing.*", lora=False),
            check=False, timeout=60)
    assert_config_error(p, "training.freeze", "model.nothing.*")


def test_adapter_path_without_rank_exits_2(setup, tmp_path):
    d, model, data = setup
    p = run(1, train_args(model, data, tmp_path / "bad", f"--lora.adapter_path={tmp_path / 'X'}", lora=False),
            check=False, timeout=60)
    assert_config_error(p, "lora.adapter_path")


# --------------------------------------------------------------------------- 6. freeze without LoRA

def test_freeze_without_lora(setup, tmp_path):
    """3 steps with the embedding and all of layer 0 frozen, weight decay 0.1: in the final
    HF export the frozen tensors equal the initial HF ones bit for bit and every other tensor
    moved; the step-2 training checkpoint holds the trained tensors only, with their moments."""
    d, model, data = setup
    out = tmp_path / "freeze"
    run(1, train_args(model, data, out, "--training.freeze=model.embed_tokens.weight,model.layers.0.*",
                      "--checkpoint.last_save_in_hf=true", "--checkpoint.interval=2", lora=False, steps=3))
    init = oracle.read_hf_tensors(model)
    t = tensors(out, step=3, files=("model.safetensors",))
    got = {k.split(":", 1)[1]: v for k, v in t.items() if k.startswith("model.safetensors:")}
    assert set(got) == set(init), f"tensor names {sorted(set(got) ^ set(init))}"
    assert not lora_names(got), "lora tensors without lora.rank"
    frozen = {n for n in init if n == "model.embed_tokens.weight" or n.startswith("model.layers.0.")}
    assert len(frozen) == 1 + 11, sorted(frozen)  # embedding + 11 tensors of layer 0
    moved = sorted(n for n in frozen if not np.array_equal(got[n], init[n]))
    assert not moved, f"frozen tensors changed: {moved}"
    still = sorted(n for n in set(init) - frozen if np.array_equal(got[n], init[n]))
    assert not still, f"trainable tensors did not change in 3 steps: {still}"
    c = tensors(out, step=2, files=("model.safetensors", "optim.safetensors"))
    held = {k.split(":", 1)[1] for k in c if k.startswith("model.safetensors:")}
    assert held == set(init) - frozen, f"checkpoint tensors {sorted(held ^ (set(init) - frozen))}"
    moments = {k.split(":", 1)[1] for k in c if k.startswith("optim.safetensors:")}
    assert moments == {f"{n}.{m}" for n in held for m in ("exp_avg", "exp_avg_sq")}


# --------------------------------------------------------------------------- 7. bf16 frozen base under FSDP

BF16 = "--training.frozen_dtype=bfloat16"
FREEZE = "--training.freeze=model.embed_tokens.weight,model.layers.0.*"


@pytest.fixture(scope="module")
def bf16_fsdp(setup):
    """LoRA (dropout 0) with frozen_dtype bfloat16 under FSDP 2 from the fp32 base: the frozen
    matrices rounded to bf16 and sharded in bf16."""
    d, model, data = setup
    out = d / "bf16_fsdp2"
    p = run(2, train_args(model, data, out, BF16, ranks=2))
    assert "FSDP-sharded over 2 ranks" in p.stderr, p.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def bf16_base(setup):
    """A model with bf16 weights (a bf16 file, as published Qwen3 weights are): frozen_dtype
    bfloat16 then rounds nothing, and fp32 storage holds the same values. Hidden 31: the
    embedding and lm_head (251 x 31) are bf16 pieces that 2 ranks do not divide evenly, so
    their gathers go through staging, the head's as a prefetch."""
    d, model, data = setup
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=31, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(d / "model_h31", cfg, seed=22).to(torch.bfloat16).save_pretrained(d / "model_bf16")
    return d / "model_bf16"


def test_bf16_frozen_under_fsdp_matches_one_process(setup, bf16_base):
    """On the bf16 base, FSDP 2 with frozen_dtype bfloat16 (each rank holds half of each
    frozen matrix in bf16, all-gathered in bf16):
    - against one process with frozen_dtype bfloat16 and the same global batch: the same
      losses to 1e-5 relative and the same final adapters to 1e-5 of each tensor's largest
      element (test_lora_layout_matches_one_process's tolerances), with AdamW's eps 1e-4.
      At the default 1e-8 one lora_A element whose first gradient nearly cancels takes a
      step of lr g / (|g| + eps) that turns the 2-rank sum's last bits into 2e-5 of the
      tensor (docs/distributed.md), with fp32 storage as with bf16 (and with data parallel
      replicate 2, 8e-6 on the fp32 base); eps 1e-4 keeps such steps proportional to g;
    - against FSDP 2 with frozen_dtype float32 (the same values in fp32 shards): the same
      losses, adapters and AdamW moments bit for bit: the storage only changes where the
      frozen bytes live."""
    d, model, data = setup
    runs = {}
    for name, n, fd, accum in (("one_bf16", 1, "bfloat16", 4), ("fsdp_bf16", 2, "bfloat16", 2),
                               ("fsdp_fp32", 2, "float32", 2)):
        runs[name] = d / f"bf16base_{name}"
        p = run(n, train_args(bf16_base, data, runs[name], f"--training.frozen_dtype={fd}", "--optimizer.eps=1e-4",
                              ranks=n, accum=accum))
        if name == "fsdp_bf16":
            assert "FSDP-sharded over 2 ranks" in p.stderr, p.stderr[-2000:]
    want, got = losses(runs["one_bf16"]), losses(runs["fsdp_bf16"])
    assert sorted(got) == list(range(1, STEPS + 1)), f"steps logged {sorted(got)}"
    bad = [(s, got[s], want[s]) for s in want if not abs(got[s] - want[s]) <= 1e-5 * abs(want[s])]
    assert not bad, f"(step, FSDP 2 loss, one process's loss) beyond 1e-5 relative: {bad}"
    a = tensors(runs["fsdp_bf16"], files=("adapter_model.safetensors", "model.safetensors"))
    b = tensors(runs["one_bf16"], files=("adapter_model.safetensors", "model.safetensors"))
    assert a.keys() == b.keys(), f"tensor names differ: {sorted(a.keys() ^ b.keys())[:6]}"
    assert lora_names(b), "no lora tensors"
    for k in lora_names(b):
        err = np.max(np.abs(a[k] - b[k])) / max(float(np.max(np.abs(b[k]))), 1e-30)
        assert err <= 1e-5, f"final {k} differs from one process by {err:.3g} of its largest element"

    assert losses(runs["fsdp_fp32"]) == got, "FSDP 2 losses: fp32 and bf16 storage of a bf16 base differ"
    a, c = tensors(runs["fsdp_bf16"]), tensors(runs["fsdp_fp32"])
    assert a.keys() == c.keys(), f"tensor names differ: {sorted(a.keys() ^ c.keys())[:6]}"
    bad = [k for k in a if not np.array_equal(a[k], c[k])]
    assert not bad, f"FSDP 2, bf16 vs fp32 storage of a bf16 base: not bit-identical: {bad[:6]}"


def test_bf16_frozen_moe_under_fsdp_is_bit_identical(setup):
    """A bf16 Qwen3-MoE base under FSDP 2 with attention-only LoRA: its routers and experts
    are frozen, stored and gathered in bf16 and read by the products straight from the store
    (the matmul and moe_experts wbf16 entries); against frozen_dtype float32 on the same
    layout: the same losses, adapters and AdamW moments bit for bit."""
    import oracle_moe
    d, _, data = setup
    base = d / "moe_bf16"
    cfg = oracle_moe.tiny_moe_config(vocab=VOCAB, hidden=30, layers=2, mlp_only=(1,))
    oracle_moe.build_moe_model(cfg, seed=23).to(torch.bfloat16).save_pretrained(base)
    runs = {}
    for fd in ("bfloat16", "float32"):
        runs[fd] = d / f"moe_fsdp_{fd}"
        p = run(2, train_args(base, data, runs[fd], f"--training.frozen_dtype={fd}",
                              "--lora.target_modules=q_proj,k_proj,v_proj,o_proj", ranks=2))
        if fd == "bfloat16":
            assert "FSDP-sharded over 2 ranks" in p.stderr, p.stderr[-2000:]
    got = losses(runs["bfloat16"])
    assert sorted(got) == list(range(1, STEPS + 1)) and got == losses(runs["float32"])
    a, c = tensors(runs["bfloat16"]), tensors(runs["float32"])
    assert a.keys() == c.keys() and lora_names(a), sorted(a.keys() ^ c.keys())[:6]
    bad = [k for k in a if not np.array_equal(a[k], c[k])]
    assert not bad, f"FSDP 2 MoE, bf16 vs fp32 storage of a bf16 base: not bit-identical: {bad[:6]}"


def test_bf16_frozen_under_fsdp_resume_is_bit_identical(setup, bf16_fsdp):
    """Stopped at step 3 and resumed to 6 under FSDP 2 with the fp32 base rounded to bf16
    (taken again from the HF files, which checkpoints do not hold): losses, adapters and
    moments bit for bit."""
    d, model, data = setup
    out = d / "bf16_fsdp2_resumed"
    args = train_args(model, data, out, BF16, ranks=2)
    p = run(2, args + ["--training.stop_at_step=3"], check=False)
    assert p.returncode == 75, f"stop_at_step must exit 75 after saving, got {p.returncode}\n{p.stderr[-3000:]}"
    p = run(2, args)
    assert "resuming from" in p.stderr and "step-3" in p.stderr, p.stderr[-3000:]
    ref, got = losses(bf16_fsdp), losses(out)
    diff = [(s, ref[s], got[s]) for s in ref if ref.get(s) != got.get(s)]
    assert not diff, f"losses differ (step, uninterrupted, resumed): {diff}"
    a, b = tensors(bf16_fsdp), tensors(out)
    assert a.keys() == b.keys() and lora_names(a), sorted(a.keys() ^ b.keys())[:6]
    bad = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not bad, f"resumed run not bit-identical to the uninterrupted one: {bad[:6]}"


def test_bf16_frozen_freeze_under_fsdp_exports_the_rounded_base(setup, tmp_path):
    """training.freeze (the embedding, all of layer 0; no LoRA) with frozen_dtype bfloat16, 3
    steps, final HF export, under FSDP 2 and on one process (same global batch): the frozen
    matrices of both exports are the initial ones rounded to bf16 (FSDP gathers them in bf16
    for the save) and the frozen norms the initial ones, the trained ones agree to 1e-5 of their largest element. The embedding is
    a piece with nothing in fp32 and layer 0 one with only its norms."""
    d, model, data = setup
    init = oracle.read_hf_tensors(model)
    frozen = {n for n in init if n == "model.embed_tokens.weight" or n.startswith("model.layers.0.")}
    got = {}
    for n, accum in ((1, 4), (2, 2)):
        out = tmp_path / f"freeze_bf16_{n}"
        run(n, train_args(model, data, out, FREEZE, BF16, "--checkpoint.last_save_in_hf=true", ranks=n,
                          accum=accum, lora=False, steps=3))
        t = tensors(out, step=3, files=("model.safetensors",))
        got[n] = {k.split(":", 1)[1]: v for k, v in t.items()}
        assert set(got[n]) == set(init), f"{n} ranks: tensor names {sorted(set(got[n]) ^ set(init))}"
        for k in sorted(frozen):  # the matrices in bf16; the norms (small) stay fp32
            want = torch.from_numpy(init[k]).to(torch.bfloat16).float().numpy() if init[k].ndim == 2 else init[k]
            assert np.array_equal(got[n][k], want), f"{n} ranks: frozen {k} is not the initial one, as stored"
    for k in sorted(set(init) - frozen):
        assert not np.array_equal(got[2][k], init[k]), f"trainable {k} did not move"
        err = np.max(np.abs(got[2][k] - got[1][k])) / max(float(np.max(np.abs(got[1][k]))), 1e-30)
        assert err <= 1e-5, f"final {k} under FSDP 2 differs from one process by {err:.3g} of its largest element"


def fsdp_param_bytes(cfg, r, bf16, n=2):
    """Bytes of one rank's FSDP shard of parameters (the largest rank's, padding included),
    from the parameter counts: fsdp.h's pieces (the embedding, each layer, the final norm +
    lm_head), each cut in n slices of ceil(size / n). With frozen_dtype bfloat16 a piece's
    frozen matrices (the LoRA base: embedding, lm_head, the seven projections) are sliced
    apart in bf16 and its other tensors (norms, adapters) in fp32."""
    H, I, V, hd, L = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim, cfg.num_hidden_layers
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    mats = [(q, H), (kv, H), (kv, H), (H, q), (I, H), (I, H), (H, I)]  # [out, in] of q k v o gate up down
    base = sum(o * i for o, i in mats)
    lora = sum(r * i + o * r for o, i in mats)  # A [r, in], B [out, r]
    norms = 2 * H + 2 * hd  # input_layernorm, post_attention_layernorm, q_norm, k_norm
    pieces = [(0, V * H)] + [(norms + lora, base)] * L + [(H, V * H)]  # (fp32 floats, frozen matrix floats)
    ceil = lambda x: -(-x // n)  # noqa: E731
    if bf16:
        return sum(4 * ceil(a) + 2 * ceil(b) for a, b in pieces)
    return sum(4 * ceil(a + b) for a, b in pieces)


def test_dry_run_bf16_frozen_under_fsdp(setup, run_ctitan):
    """--dry-run of the LoRA run with data_parallel_shard_degree 2: the per-rank parameter
    bytes are the fsdp_param_bytes of the parameter counts, fp32 frozen storage and bf16,
    and with bf16 the frozen matrices' share is half (2 bytes for every 4)."""
    d, model, data = setup
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=30, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    got = {}
    for fd in ("float32", "bfloat16"):
        _, out, _ = run_ctitan(train_args(model, data, d / "dry", f"--training.frozen_dtype={fd}", "--dry-run",
                                          ranks=2))
        rank = out[out.index("per rank:"):]
        line = next(x for x in rank.splitlines() if x.strip().startswith("parameters ("))
        got[fd] = int(line.split()[-2])
    want = {fd: fsdp_param_bytes(cfg, R, fd == "bfloat16") for fd in got}
    assert got == want, f"per-rank parameter bytes {got}, from the parameter counts {want}"
    # the frozen matrices (embedding, lm_head, 7 projections a layer): 4 / 2 bytes each in fp32,
    # 2 / 2 in bf16, so the rank saves one byte per matrix element (up to the slices' padding)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    frozen = 2 * V * H + cfg.num_hidden_layers * (2 * q * H + 2 * kv * H + 3 * I * H)
    saved = got["float32"] - got["bfloat16"]
    assert abs(saved - frozen) <= 8 * (cfg.num_hidden_layers + 2), f"saved {saved} bytes per rank, want ~{frozen}"
