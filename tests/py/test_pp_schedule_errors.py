"""A looped pipeline schedule on a model too shallow for it says why, in the model's terms.

Interleaved1F1B and LoopedBFS run two stages per rank by default (torchtitan's default,
docs/distributed.md), so pipeline_parallel_degree 2 needs 4 stages of at least one layer.
On a 2-layer model the message said "needs a multiple of the degree, at least twice it,
stages, but the model's layers gives 2": 2 is the stage count it fell back to, not anything
the user set, and nothing said what to change. It must name the stages needed (4), the
model's layer count (2) and a way out (1F1B or GPipe), exit 2, in the dry run and the run.
The layer count comes from transformers' config (num_hidden_layers).
"""
import json

import pytest

import oracle


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS"])
def test_looped_schedule_on_too_few_layers(schedule, run_ctitan, tmp_path):
    path = tmp_path / "hf"
    oracle.save_random_hf(path, oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2,
                                                   head_dim=8))
    layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(2000, 256, 0))
    rc, out, err = run_ctitan(["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={path}",
                               f"--training.dataset_path={data}", "--training.seq_len=16",
                               "--training.local_batch_size=2", "--parallelism.pipeline_parallel_degree=2",
                               f"--parallelism.pipeline_parallel_schedule={schedule}"], check=False)
    assert rc == 2, out + err
    assert schedule in err and "needs 4 stages" in err, err
    assert f"the model has {layers} layers" in err, err
    assert "1F1B or GPipe" in err, err
    assert "gives 2" not in err, err
