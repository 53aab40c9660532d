"""`ctitan train` says what is wrong with its data before the slow part of the start-up.

The config, the layout and the checkpoint folder are checked before anything big is built
(trainer.c, init_run); the data used to be opened only after the kernels were timed on the
run's sizes and the weights were loaded. Timing alone took 34 s on a 62-token file given with
`training.seq_len = 3000` (2 cores; minutes at longer lengths, and a large model's weights
add their own minutes) before the error "too short for one window". torchtitan builds its
tokenizer and dataloader before the model, so its users expect a data error at once.

Checked by what the run printed before the error: no kernel choice ("ctitan: kernels:") and
no weights loaded from `checkpoint.initial_load_path`, and the expected error itself (exit 3
naming the file and training.seq_len; exit 1 for a model directory without a tokenizer).
"""
import json
import shutil

import pytest

import oracle

V = 300


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "hf"
    oracle.save_random_hf(path, oracle.tiny_config(vocab=V, hidden=32, inter=64, layers=1, heads=4, kv_heads=2,
                                                   head_dim=8))
    return path


def run_args(model, data, out, *extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model}",
            f"--checkpoint.initial_load_path={model}", "--checkpoint.initial_load_in_hf",
            f"--training.dataset_path={data}", "--training.steps=1", "--training.local_batch_size=1",
            "--metrics.peak_tflops=1", "--kernels.tune=true", f"--job.dump_folder={out}", *extra]


def assert_nothing_slow_before(err):
    assert "ctitan: kernels:" not in err, err
    assert "initial weights" not in err and "loaded" not in err, err


def test_too_short_token_file_fails_before_tuning_and_weights(model_dir, run_ctitan, tmp_path):
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(100, V, 0))
    rc, _, err = run_ctitan(run_args(model_dir, data, tmp_path / "run", "--training.seq_len=128"), check=False)
    assert rc == 3, err
    assert "tokens.bin" in err and "training.seq_len" in err, err
    assert_nothing_slow_before(err)


def test_missing_tokenizer_fails_before_tuning_and_weights(model_dir, run_ctitan, tmp_path):
    """JSON Lines text needs the model directory's tokenizer; this one has none (save_pretrained
    of a model alone writes no tokenizer files)."""
    assert not (model_dir / "tokenizer.json").exists()
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(50)))
    rc, _, err = run_ctitan(run_args(model_dir, data, tmp_path / "run", "--training.seq_len=16"), check=False)
    assert rc == 1, err
    assert str(model_dir) in err and "tokenizer.json" in err, err
    assert_nothing_slow_before(err)


def test_good_data_still_trains_and_resumes(model_dir, run_ctitan, tmp_path):
    """The same run with enough tokens trains, stops at step 1 with a checkpoint, and resumes
    to the uninterrupted run's step-2 loss (the loader position is restored after the weights)."""
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(4000, V, 1))
    common = ["--training.seq_len=16", "--training.steps=2", "--checkpoint.enable", "--metrics.log_freq=1",
              "--training.shuffle"]
    run_ctitan(run_args(model_dir, data, tmp_path / "whole", *common))
    rc, _, _ = run_ctitan(run_args(model_dir, data, tmp_path / "cut", *common, "--training.stop_at_step=1"),
                          check=False)
    assert rc == 75
    run_ctitan(run_args(model_dir, data, tmp_path / "cut", *common))
    whole = {r["step"]: r["loss"] for r in oracle.read_metrics(tmp_path / "whole" / "metrics.jsonl")}
    cut = {r["step"]: r["loss"] for r in oracle.read_metrics(tmp_path / "cut" / "metrics.jsonl")}
    assert cut[2] == whole[2], (cut, whole)
    shutil.rmtree(tmp_path / "cut")
