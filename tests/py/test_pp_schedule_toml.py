"""Pipeline schedules as a torchtitan TOML names them (journey3, stop 52).

torchtitan hands `parallelism.pipeline_parallel_schedule` to torch's `get_schedule_class`,
which matches the name in any case, so a torchtitan config may say "zbvzerobubble" or
"interleaved1f1b"; ctitan refused those (exit 2, "is not one of"). The expected schedule is
the one torch resolves the spelling to.

ZBVZeroBubble takes exactly two stages per rank (torch's ScheduleZBVZeroBubble raises
unless `n_local_stages == 2`). Split points giving 3 stages on PP 2 were refused with
the looped schedules' rule ("a multiple of the degree, at least twice it"), which 6 stages
would meet and ZBV still refuses: the message must state ZBV's own rule.
"""
import pytest

import oracle

torch_schedules = pytest.importorskip("torch.distributed.pipelining.schedules")


def _model(tmp_path, layers=4):
    path = tmp_path / "hf"
    oracle.save_random_hf(path, oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=layers, heads=4,
                                                   kv_heads=2, head_dim=8))
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(2000, 256, 0))
    return path, data


def _toml(tmp_path, path, data, schedule, extra=""):
    f = tmp_path / "pp.toml"
    f.write_text(f"""[model]
spec = "hf"
hf_assets_path = "{path}"
[training]
local_batch_size = 4
seq_len = 16
dataset_path = "{data}"
[parallelism]
pipeline_parallel_degree = 2
pipeline_parallel_schedule = "{schedule}"
pipeline_parallel_microbatch_size = 1
{extra}
""")
    return f


@pytest.mark.parametrize("spelling", ["zbvzerobubble", "INTERLEAVEDZEROBUBBLE", "interleaved1f1b", "gpipe",
                                      "loopedbfs"])
def test_schedule_name_in_any_case_as_torch(spelling, run_ctitan, tmp_path):
    cls = torch_schedules.get_schedule_class(spelling)
    canonical = next(k for k in ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                 "ZBVZeroBubble") if torch_schedules.get_schedule_class(k) is cls)
    path, data = _model(tmp_path)
    rc, out, err = run_ctitan(["train", "--dry-run", "--config", _toml(tmp_path, path, data, spelling)], check=False)
    assert rc == 0, f"torch takes {spelling!r} as {canonical}; ctitan exited {rc}:\n{err[-1500:]}"
    assert f"schedule {canonical}:" in out + err, out + err


def test_zbv_three_stages_names_its_own_rule(run_ctitan, tmp_path):
    path, data = _model(tmp_path)
    toml = _toml(tmp_path, path, data, "ZBVZeroBubble", 'pipeline_parallel_split_points = ["layers.1", "layers.2"]')
    rc, out, err = run_ctitan(["train", "--dry-run", "--config", toml], check=False)
    assert rc == 2, out + err
    assert "ZBVZeroBubble" in err and "exactly 2 stages per rank" in err and "gives 3" in err, err
    assert "at least twice it" not in err, err


# torchtitan's [parallelism] key for a CSV schedule (its JobConfig's Parallelism:
# pipeline_parallel_schedule_csv) was refused; it is read now (tests/py/test_pp_csv.py): a TOML
# naming a file that is not there is refused as torchtitan refuses it (FileNotFoundError), by name.
def test_torchtitan_schedule_csv_is_read(run_ctitan, tmp_path):
    path, data = _model(tmp_path)
    toml = _toml(tmp_path, path, data, "ZBVZeroBubble", 'pipeline_parallel_schedule_csv = "sched.csv"')
    rc, out, err = run_ctitan(["train", "--dry-run", "--config", toml], check=False)
    assert rc == 2, out + err
    assert 'pipeline_parallel_schedule_csv "sched.csv"' in err and "does not exist" in err, err
