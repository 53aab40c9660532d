"""validation.seq_len under every layout the trainer evaluates in: mpirun FSDP 2, TP 2 (with
sequence parallel), CP 2 (headtail, and the ring of rotate_method alltoall), PP 2
(plan_eval's pipeline path), and LoRA: the held-out loss over windows of 8 and of 32
tokens (training's are 16) equals transformers' (PEFT's) on the same windows, and the
training loss of the step is transformers' too (lr 0 keeps the saved weights, so both
are the loaded model's). The validation sets hold 8 windows exactly and validation.steps
is -1: every layout scores all of them, whatever its data-parallel split. The CP length
rules refuse a validation.seq_len by name.

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import pytest

import oracle
import oracle_lora
from test_dist import mpirun, run

VOCAB, TRAIN_LEN, N_VAL = 200, 16, 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("valseq")
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(d / "model", cfg, seed=4)
    train_tokens = oracle.learnable_stream(8 * (TRAIN_LEN + 1), VOCAB, seed=1)
    oracle.write_bin(d / "train.bin", train_tokens)
    val = {}
    for L in (8, 32):
        val[L] = oracle.learnable_stream(N_VAL * (L + 1), VOCAB, seed=2 + L)
        oracle.write_bin(d / f"val{L}.bin", val[L])
    return d, train_tokens, val


def _args(d, out, L, dp=1, extra=()):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={d / 'model'}",
            f"--checkpoint.initial_load_path={d / 'model'}", "--checkpoint.initial_load_in_hf",
            f"--training.dataset_path={d / 'train.bin'}", f"--training.seq_len={TRAIN_LEN}",
            "--training.local_batch_size=2", f"--training.global_batch_size={2 * dp}", "--training.steps=1",
            "--optimizer.lr=0", "--metrics.log_freq=1", f"--job.dump_folder={out}",
            "--validation.enable", f"--validation.dataset_path={d / f'val{L}.bin'}", "--validation.freq=1",
            "--validation.steps=-1", "--validation.local_batch_size=2", f"--validation.seq_len={L}", *extra]


def _losses(out):
    rows = oracle.read_metrics(out / "metrics.jsonl")
    return [r["loss"] for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def _check(model, train_tokens, val_tokens, out, L, dp):
    loss, val = _losses(out)
    w = oracle.windows(train_tokens, TRAIN_LEN)[:2 * dp]
    want = oracle.hf_loss(model, w[:, :-1], w[:, 1:])
    assert len(loss) == 1 and abs(loss[0] - want) <= 1e-4 * want, f"training loss {loss} vs HF {want}"
    v = oracle.windows(val_tokens, L)
    assert len(v) == N_VAL
    want = oracle.hf_loss(model, v[:, :-1], v[:, 1:])
    assert len(val) == 1 and val[0]["val_targets"] == N_VAL * L, val
    assert abs(val[0]["val_loss"] - want) <= 1e-4 * want, f"val_loss {val[0]['val_loss']} vs HF {want}"


LAYOUTS = {
    "fsdp2": (2, ["--parallelism.data_parallel_shard_degree=2"]),
    "tp2_sp": (1, ["--parallelism.tensor_parallel_degree=2", "--parallelism.sequence_parallel"]),
    "cp2": (1, ["--parallelism.context_parallel_degree=2"]),
    "cp2_ring": (1, ["--parallelism.context_parallel_degree=2",
                     "--parallelism.context_parallel_rotate_method=alltoall"]),
    "pp2": (1, ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=1"]),
}


@pytest.mark.parametrize("L", [8, 32])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_val_loss_under_layout_matches_hf(setup, layout, L):
    mpirun()  # fails, rather than skips, without it
    d, train_tokens, val = setup
    dp, extra = LAYOUTS[layout]
    out = d / f"{layout}_{L}"
    run(2, _args(d, out, L, dp, extra))
    _check(oracle.load_hf(d / "model"), train_tokens, val[L], out, L, dp)


@pytest.mark.parametrize("L", [8, 32])
def test_val_loss_with_lora_matches_peft(setup, tmp_path, run_ctitan, L):
    """A PEFT adapter with non-zero A and B on all seven projections, loaded through
    lora.adapter_path: the held-out loss is the PeftModel's on the windows of L."""
    d, train_tokens, val = setup
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    hf_dir, ad, pm, _, _ = oracle_lora.random_all7_adapter(tmp_path, cfg, hf_seed=4, r=4, alpha=8, seed=3)
    args = _args(d, tmp_path / "out", L, 1, ["--lora.rank=4", "--lora.alpha=8", f"--lora.adapter_path={ad}"])
    args = [a.replace(str(d / "model"), str(hf_dir)) for a in args]
    run_ctitan(args)
    _check(pm, train_tokens, val[L], tmp_path / "out", L, 1)


@pytest.mark.parametrize("opts,words", [
    (["--validation.seq_len=6"], ["validation.seq_len = 6", "headtail"]),
    (["--validation.seq_len=7", "--parallelism.context_parallel_load_balancer=none"],
     ["does not divide validation.seq_len = 7"]),
])
def test_cp_refuses_a_validation_length_by_name(setup, run_ctitan, tmp_path, opts, words):
    d, _, _ = setup
    args = _args(d, tmp_path / "out", 8, 1, ["--parallelism.context_parallel_degree=2", *opts])
    rc, _, err = run_ctitan(args, check=False)
    assert rc == 2 and all(w in err for w in words), err
