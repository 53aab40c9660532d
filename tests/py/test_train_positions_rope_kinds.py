"""The positions limit train warns past (and generate refuses past), for the RoPE scalings
that set it otherwise than max_position_embeddings (the ninth mutation audit: the limit's
dynamic and yarn rules were untested, test_train_positions covering linear alone).

docs/generate.md, after vLLM's derivation: yarn and llama3 stretch
original_max_position_embeddings by `factor` (not max_position_embeddings), and dynamic NTK
rescales with the length, so it sets no limit. Dropping either rule passed every test."""
import json

from conftest import tiny_run


def _with_positions(d, max_pos, rope):
    cfg, out, args = tiny_run(d, steps=1)
    path = d / "model" / "config.json"
    j = json.loads(path.read_text())
    j["max_position_embeddings"] = max_pos
    j["rope_parameters"] = {**j["rope_parameters"], **rope}
    path.write_text(json.dumps(j))
    return j, args


def _seq_len(args, T=None):
    if T is None:
        return int(next(a for a in args if a.startswith("--training.seq_len=")).split("=")[1])
    return [f"--training.seq_len={T}" if a.startswith("--training.seq_len=") else a for a in args]


def _warning(err):
    return [ln for ln in err.splitlines() if "warning" in ln and "training.seq_len" in ln]


def test_dynamic_rope_sets_no_limit(tmp_path, run_ctitan):
    j, args = _with_positions(tmp_path, 8, {"rope_type": "dynamic", "factor": 2.0})
    T = _seq_len(args)
    assert T > j["max_position_embeddings"]  # a limit of max_position_embeddings would warn
    rc, _, err = run_ctitan(args + ["--dry-run"])
    assert rc == 0 and not _warning(err), err


def test_yarn_stretches_the_original_positions(tmp_path, run_ctitan):
    # yarn: factor 2 x original_max_position_embeddings 4 = 8 positions (the file's
    # max_position_embeddings, as a stretched model's config.json says, transformers' factor
    # max_position_embeddings / original), not 8 x 2 = 16: seq_len 16 is past it, 8 within it
    rope = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4}
    j, args = _with_positions(tmp_path, 8, rope)
    limit = int(rope["factor"] * rope["original_max_position_embeddings"])
    assert _seq_len(args) == 16 > limit
    rc, _, err = run_ctitan(args + ["--dry-run"])
    w = _warning(err)
    assert rc == 0 and len(w) == 1 and f"the {limit} positions" in w[0], err
    rc, _, err = run_ctitan(_seq_len(args, limit) + ["--dry-run"])
    assert rc == 0 and not _warning(err), err
