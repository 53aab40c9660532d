"""torchtitan 0.3's command-line keys, each taken by ctitan train (tests/py/tt03_walk.py reads them
from torchtitan 0.3.0's installed source with `ast`: its Trainer.Config, each section's dataclass,
nested sections as tyro names them). A torchtitan 0.3 user brings `--section.key=value` overrides;
none may meet "unknown key" / "unknown section". Each key is listed by `train --help`, and at its
torchtitan default it is taken, or refused by a message about its value that names the key (never
"unknown"); the keys refused at their default are the few listed below, each with why."""
import re

from tt03_walk import torchtitan_keys

# torchtitan 0.3 defaults ctitan refuses, and why (the message must name the key)
REFUSED_AT_DEFAULT = {
    # Python's None for "no seed" (torch's own default seed): ctitan always seeds from an integer,
    # and its RNG is not torch's, so no value reproduces torch's None; an explicit integer is asked for
    "debug.seed": "expected an integer",
    # BaseDataLoader.Config's "" (the validator's dataloader names no dataset): ctitan's kinds are listed
    "validator.dataloader.dataset": "is not one of",
}


def cli_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "None"
    if isinstance(v, list):
        return ",".join(v) if v else "[]"
    if isinstance(v, dict):
        return "{}" if not v else repr(v)
    return str(v)


def test_walk_finds_torchtitan03_sections():
    """The oracle itself: keys torchtitan 0.3's source holds (a walk that found nothing would pass)."""
    keys, skipped = torchtitan_keys()
    for k in ("debug.seed", "debug.deterministic", "training.dtype", "parallelism.enable_sequence_parallel",
              "compile.backend", "comm.mode", "parallelism.spmd_backend", "activation_checkpoint.memory_budget",
              "validator.dataloader.dataset_path", "loss.loss_fn.global_vocab_size", "profiler.profile_freq"):
        assert k in keys, k
    assert keys["comm.mode"][1] == "default" and keys["profiler.save_traces_folder"][1] == "profiling/traces"
    assert len(keys) > 100
    assert ("model_spec", "tyro.conf.Suppress") in skipped


def test_torchtitan03_keys_taken(run_ctitan, tmp_path):
    keys, _ = torchtitan_keys()
    _, help_text, _ = run_ctitan(["train", "--help"])
    missing = [k for k in keys if f"--{k}=" not in help_text]
    assert not missing, f"train --help does not list torchtitan 0.3's keys: {missing}"

    # the run needs local data (torchtitan's c4_test dataloader default is refused without it), after the keys
    base = [f"--training.dataset_path={tmp_path / 'x.bin'}", f"--job.dump_folder={tmp_path / 'o'}",
            "--training.steps=1", "--metrics.peak_tflops=1"]
    args = {k: f"--{k}={cli_value(v[1])}" for k, v in keys.items() if v[0]}
    assert len(args) == len(keys), [k for k, v in keys.items() if not v[0]]

    def run(names):
        rc, out, err = run_ctitan(["train", "--dry-run"] + [args[k] for k in names] + base, check=False)
        return rc, out + err

    refused = {}

    def bisect(names):  # one process for all keys while they pass; halves only where one fails
        rc, text = run(names)
        if rc == 0:
            return
        if len(names) == 1:
            refused[names[0]] = text
            return
        bisect(names[:len(names) // 2])
        bisect(names[len(names) // 2:])

    bisect(list(args))
    unknown = {k: t for k, t in refused.items() if re.search(r"unknown (key|section|option)", t)}
    assert not unknown, f"torchtitan 0.3's keys refused as unknown: {unknown}"
    assert set(refused) == set(REFUSED_AT_DEFAULT), refused
    for k, why in REFUSED_AT_DEFAULT.items():
        assert k in refused[k] and why in refused[k], refused[k]


def test_torchtitan03_alias_takes_value_and_inert_refuses(run_ctitan, tmp_path):
    """An alias sets ctitan's option (a bad value is refused under its range); a key torchtitan
    reads for a feature ctitan lacks refuses every value but the one that changes nothing."""
    base = [f"--training.dataset_path={tmp_path / 'x.bin'}", "--training.steps=1", "--metrics.peak_tflops=1"]
    rc, out, err = run_ctitan(["train", "--dry-run", "--validator.freq=0"] + base, check=False)
    assert rc == 2 and "validator.freq" in err and ">= 1" in err, out + err
    for kv, says in (("--training.dtype=bfloat16", "fp32"), ("--comm.mode=fake_backend", "MPI"),
                     ("--debug.moe_force_load_balance", "top-k"), ("--override.imports=a.b", "[kernels]")):
        rc, out, err = run_ctitan(["train", "--dry-run", kv] + base, check=False)
        key = kv[2:].split("=")[0]
        assert rc == 2 and key in err and "only" in err and says in err, (kv, out + err)
    # a CSV schedule is read (tests/py/test_pp_csv.py); without a pipeline, as in torchtitan, it has no effect
    rc, out, err = run_ctitan(["train", "--dry-run", "--parallelism.pipeline_parallel_schedule_csv=s.csv"] + base,
                              check=False)
    assert rc == 0 and "pipeline_parallel_schedule_csv has no effect" in err, out + err
    # tyro's None means ctitan's unset: -1 for pipeline_parallel_layers_per_stage, "none" balancer
    rc, out, err = run_ctitan(["train", "--dry-run", "--parallelism.pipeline_parallel_layers_per_stage=None",
                               "--parallelism.context_parallel_load_balancer=None",
                               "--lr_scheduler.decay_ratio=None", "--checkpoint.initial_load_path=None"] + base,
                              check=False)
    assert rc == 0, out + err
