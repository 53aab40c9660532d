"""torchtitan 0.3's command line is tyro's, and three of its forms are not `--section.key=value`:

- a policy picked by a subcommand word: `activation_checkpoint:full` (torchtitan's
  ActivationCheckpointingConfig, a union of tyro subcommands `selective`, `full`,
  `memory-budget`, `none`; the words are read here from torchtitan 0.3.0's installed source);
- names written with '-' for '_' (`--training.local-batch-size=2`);
- a boolean's false as `--section.no-flag`.

Each is checked against the `--section.key=value` form that means the same here: the dry
run's whole output must be the same, or the written config.toml (read by Python's tomllib)
must hold the value.
"""
import ast
import importlib.util
import tomllib
from pathlib import Path

import pytest

import oracle

BASE = ["--config", "configs/debug.toml", "--training.dataset_path=", "--dry-run"]


def _ac_subcommands():
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None, "torchtitan is not installed: run scripts/setup.sh"
    src = Path(spec.submodule_search_locations[0]) / "distributed" / "activation_checkpoint.py"
    words = [n.args[0].value for n in ast.walk(ast.parse(src.read_text()))
             if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "subcommand" and n.args
             and isinstance(n.args[0], ast.Constant)]
    assert set(words) >= {"none", "full", "selective"}, words
    return words


# the `--section.key=value` form each torchtitan policy means here (None: refused)
SAME_AS = {"none": ["--activation_checkpoint.mode=none"],
           "full": ["--activation_checkpoint.mode=full"],
           # torchtitan's per-op SAC: ctitan's "op" (docs say what differs in memory)
           "selective": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"],
           "memory-budget": None}


def _dry(run_ctitan, *args):
    rc, out, err = run_ctitan(["train", *BASE, *args], check=False)
    return rc, out + err


def test_every_activation_checkpoint_subcommand(run_ctitan):
    words = _ac_subcommands()
    assert set(words) <= set(SAME_AS), f"torchtitan has policies this test does not know: {words}"
    for w in words:
        rc, got = _dry(run_ctitan, f"activation_checkpoint:{w}")
        if SAME_AS[w] is None:
            assert rc == 2 and f"activation_checkpoint:{w}" in got, got[-1500:]
            continue
        rc2, want = _dry(run_ctitan, *SAME_AS[w])
        assert rc == 0 and rc2 == 0, got[-1500:] + want[-1500:]
        assert got == want, f"activation_checkpoint:{w}:\n{got}\nvs\n{want}"
    # the subcommand's choice shows in the plan (selective op keeps more than full)
    assert _dry(run_ctitan, "activation_checkpoint:full")[1] != _dry(run_ctitan, "activation_checkpoint:selective")[1]
    rc, got = _dry(run_ctitan, "activation_checkpoint:sometimes")
    assert rc == 2 and "activation_checkpoint:sometimes" in got, got


def test_hyphens_for_underscores(run_ctitan):
    rc, got = _dry(run_ctitan, "--training.local-batch-size=2", "--activation-checkpoint.mode=full")
    rc2, want = _dry(run_ctitan, "--training.local_batch_size=2", "--activation_checkpoint.mode=full")
    assert rc == 0 and got == want, got[-1500:]
    assert "batch 2 x" in got and "activation_checkpoint full" in got, got


def test_no_flag_is_false(run_ctitan, tmp_path):
    model = tmp_path / "hf"
    oracle.save_random_hf(model, oracle.tiny_config(vocab=64, hidden=16, inter=32, layers=1, heads=2, kv_heads=1,
                                                    head_dim=8))
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(400, 64, 0))
    common = ["train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={data}",
              "--training.seq_len=8", "--training.local_batch_size=2", "--training.steps=1"]
    for args, want in ((["--training.shuffle"], True), (["--training.shuffle", "--training.no-shuffle"], False),
                       (["--training.shuffle", "--training.no_shuffle"], False)):
        out = tmp_path / f"run{len(args)}{args[-1][-8:]}"
        run_ctitan(common + [f"--job.dump_folder={out}", *args])
        conf = tomllib.loads((out / "config.toml").read_text())
        assert conf["training"]["shuffle"] is want, (args, conf["training"])
    rc, out, err = run_ctitan(common + ["--training.no-shuffle=true"], check=False)
    assert rc == 2 and "--training.no-shuffle=true" in err and "takes no value" in err, err
    rc, out, err = run_ctitan(common + ["--training.no-seq-len"], check=False)
    assert rc == 2 and "only a boolean" in err, err


def test_optimizer_implementations(run_ctitan):
    """Every optimizer.implementation torchtitan 0.3 offers (its Literal, read from its
    source): the same math is taken, bf16 moments are refused saying so."""
    spec = importlib.util.find_spec("torchtitan")
    src = Path(spec.submodule_search_locations[0]) / "components" / "optimizer" / "optimizer.py"
    lit = next(n for n in ast.walk(ast.parse(src.read_text()))
               if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "implementation")
    choices = [e.value for e in ast.walk(lit.annotation) if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    assert "fused" in choices and "fused_opt_states_bf16" in choices, choices
    for ch in choices:
        rc, got = _dry(run_ctitan, f"--optimizer.implementation={ch}")
        if "bf16" in ch:
            assert rc == 2 and "optimizer.implementation" in got and "bfloat16" in got, got[-1500:]
        else:
            assert rc == 0, got[-1500:]
