"""training.seq_len past the positions the model was trained for.

torchtitan's model args (update_from_config) warn when the sequence length exceeds the
model's maximum and train on; transformers' tokenizer warns ("Token indices sequence length
is longer than the specified maximum", tokenization_utils_base.py) and its model runs
there: RoPE extrapolates. ctitan
warns the same way, by the limit generate refuses lengths with (max_position_embeddings,
stretched by a linear RoPE factor), where it used to train silently."""
import json

from conftest import tiny_run


def _with_positions(d, max_pos, rope=None):
    """tiny_run's model with max_position_embeddings (and rope_parameters) changed."""
    cfg, out, args = tiny_run(d, steps=1)
    path = d / "model" / "config.json"
    j = json.loads(path.read_text())
    j["max_position_embeddings"] = max_pos
    if rope is not None:
        j["rope_parameters"] = {**j["rope_parameters"], **rope}
    path.write_text(json.dumps(j))
    return j, args


def _seq_len(args):
    return int(next(a for a in args if a.startswith("--training.seq_len=")).split("=")[1])


def test_seq_len_past_max_positions_warns_and_trains(tmp_path, run_ctitan):
    j, args = _with_positions(tmp_path, 8)
    T = _seq_len(args)
    assert T > j["max_position_embeddings"]
    rc, _, err = run_ctitan(args)  # a warning, not a refusal: the run trains
    assert rc == 0
    w = [ln for ln in err.splitlines() if "warning" in ln and "training.seq_len" in ln]
    assert len(w) == 1, err
    assert f"({T})" in w[0] and f"the {j['max_position_embeddings']} positions" in w[0], w[0]
    assert "max_position_embeddings" in w[0] and "config.json" in w[0], w[0]
    # the dry run says the same before anything is built
    rc, _, err = run_ctitan(args + ["--dry-run"])
    assert rc == 0 and "training.seq_len" in err and f"the {j['max_position_embeddings']} positions" in err, err


def test_seq_len_within_positions_is_quiet(tmp_path, run_ctitan):
    j, args = _with_positions(tmp_path, _seq_len(tiny_run(tmp_path, steps=1)[2]))
    rc, _, err = run_ctitan(args)
    assert rc == 0 and "training.seq_len" not in err, err


def test_linear_rope_factor_extends_the_limit(tmp_path, run_ctitan):
    # linear scaling by 2 stretches 8 positions over 16: seq_len 16 is within them
    j, args = _with_positions(tmp_path, 8, {"rope_type": "linear", "factor": 2.0})
    T = _seq_len(args)
    limit = j["rope_parameters"]["factor"] * j["max_position_embeddings"]
    assert j["max_position_embeddings"] < T <= limit
    rc, _, err = run_ctitan(args)
    assert rc == 0 and "training.seq_len" not in err, err
    # and past the stretched limit it warns, naming the stretched count
    longer = [f"--training.seq_len={int(limit) * 2}" if a.startswith("--training.seq_len=") else a for a in args]
    rc, _, err = run_ctitan(longer)
    assert "training.seq_len" in err and f"the {int(limit)} positions" in err, err
