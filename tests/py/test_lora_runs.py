"""LoRA and frozen tensors through `ctitan train` (the CLI, one process and under mpirun):
an interrupted LoRA run resumes bit for bit (dropout masks replayed, gradient accumulation),
also under FSDP 2; the frozen base never moves; FSDP 2 and DP 2 train the adapters like one
process with the same global batch; the final last_save_in_hf save is a PEFT adapter
directory that peft.PeftModel.from_pretrained loads and that gives ctitan's own logits;
config errors exit 2 naming the key (LoRA with TP or EP, bf16 frozen storage under FSDP,
unknown target or module, a freeze pattern matching nothing, an adapter without a rank);
training.freeze without LoRA keeps the frozen tensors bit for bit while the others train.

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


def test_bf16_frozen_storage_under_fsdp_exits_2(setup, tmp_path):
    """training.frozen_dtype = "bfloat16" is refused under FSDP (mpirun -np 2, shard 2)."""
    d, model, data = setup
    p = run(2, train_args(model, data, tmp_path / "bad", "--training.frozen_dtype=bfloat16", ranks=2),
            check=False, timeout=60)
    assert_config_error(p, "training.frozen_dtype", "data_parallel_shard_degree")


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


@pytest.mark.parametrize("key,extra", [
    ("tensor_parallel_degree", ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]),
    ("expert_parallel_degree", ["--parallelism.expert_parallel_degree=2"]),
], ids=["tp2", "ep2"])
def test_lora_with_tp_or_ep_exits_2(setup, tmp_path, key, extra):
    """Under mpirun -np 2: LoRA with tensor or expert parallelism is refused, once, naming
    the degree and lora. The models (config.json only: initialised from training.seed)
    are ones the degree divides, a MoE one for EP, so that the layout without LoRA runs."""
    d, model, data = setup
    model = tmp_path / "model"
    if key == "expert_parallel_degree":
        from transformers import Qwen3MoeConfig
        Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                       norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
                       output_router_logits=False).save_pretrained(model)
    else:
        oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2,
                           head_dim=8).save_pretrained(model)
    args = [a for a in train_args(model, data, tmp_path / "bad", ranks=2)
            if not a.startswith(("--parallelism.", "--checkpoint.initial_load"))]
    args += ["--parallelism.data_parallel_shard_degree=2"] if key == "expert_parallel_degree" else []
    args += extra
    # the same layout without LoRA is valid: the refusal is LoRA's
    ok = [a for a in args if not a.startswith("--lora.")] + ["--training.steps=1",
                                                             f"--job.dump_folder={tmp_path / 'ok'}"]
    run(2, ok, timeout=60)
    p = run(2, args, check=False, timeout=60)
    assert_config_error(p, key, "lora")


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
