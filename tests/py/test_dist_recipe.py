"""Every rank of a run must be given the same recipe. Each rank reads its own copy of
--config and its own command line (mpirun's MPMD form gives each machine its own), and a
rank given another value of an option that shapes the maths or the collectives trained on
without a word: with another training.local_batch_size the job exited 0, each rank
believing another gradient accumulation; with another optimizer.lr each replica stepped
its own way; with another checkpoint.interval one rank saved alone and the job hung (this
file's test ran into its 120 s timeout). Now every rank exits 2 before anything is loaded
and rank 0 names the first option that differs, with its own value, once.

Options that say where a machine keeps its files (paths, folders: whether one is set must
still agree), its threads and its peak may differ: such a run trains as a uniform one (its
losses equal to 1e-5). The ranks' copies of the data must hold the same number of windows,
and kernel tuning follows rank 0's setting (a review of the check found a hang, a crash and a
silent split for options it first let differ; each has a test here).

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import re
import shutil
import subprocess
import tomllib

import pytest

import oracle
from test_dist import ENV, losses, mpmd, run, run_once_reported, train_args


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("dist_recipe")
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=2, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(d / "model")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(300 * 17, 251, seed=7))
    return d, data


DEFAULTS = {"checkpoint.interval": 1000, "training.mixed_precision_param": "float32",  # ctitan's --help
            "training.logits_chunk_rows": 0, "kernels.matmul": "auto"}


def args_dp2(d, data, out):
    return train_args(d / "model", data, out, "--parallelism.data_parallel_replicate_degree=2",
                      "--training.steps=3", dp=2)


@pytest.mark.parametrize("option,rank1", [
    ("training.local_batch_size", "--training.local_batch_size=4"),
    ("optimizer.lr", "--optimizer.lr=1e-3"),
    ("checkpoint.interval", "--checkpoint.interval=2"),
    ("training.mixed_precision_param", "--training.mixed_precision_param=bfloat16"),
    # under tensor parallel every block of logit rows is a collective: another block size on one
    # rank ended the job in MPI_ERR_TRUNCATE (the review); [kernels] too must agree
    ("training.logits_chunk_rows", "--training.logits_chunk_rows=8"),
    ("kernels.matmul", "--kernels.matmul=ref"),
])
def test_another_recipe_on_one_rank_is_refused(setup, tmp_path, option, rank1):
    d, data = setup
    args = args_dp2(d, data, tmp_path / "out")
    p = run_once_reported(mpmd(args, [rank1]), 2, (f"{option} differs between the ranks", "rank 0 has"))
    # rank 0's own value, as config.toml writes it: tomllib reads it back as what rank 0 was given
    shown = re.search(rf"rank 0 has {re.escape(option)} = (.*?)\): every rank", p.stderr).group(1)
    given = [a.split("=", 1)[1] for a in args if a.startswith(f"--{option}=")]
    want = given[-1] if given else DEFAULTS[option]
    try:
        want = tomllib.loads(f"v = {want}")["v"]
    except tomllib.TOMLDecodeError:
        pass  # a bare string, as the command line takes it
    assert tomllib.loads(f"v = {shown}")["v"] == want, f"{shown} vs rank 0's {want!r}"
    assert "step: 1 " not in p.stdout, "a step ran before the check"


def test_initial_weights_on_one_rank_alone_are_refused(setup, tmp_path):
    """checkpoint.initial_load_path names a folder of each machine's own, so where it points may
    differ; but given on one machine alone, that rank loaded the weights and the other started
    from the seed, and the job trained on (exit 0, each replica from other weights). Whether it
    is set must agree."""
    d, data = setup
    weights = tmp_path / "weights"
    oracle.save_random_hf(weights, oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=2, heads=4, kv_heads=2,
                                                      head_dim=8))
    args = args_dp2(d, data, tmp_path / "out")
    run_once_reported(mpmd(args, [f"--checkpoint.initial_load_path={weights}", "--checkpoint.initial_load_in_hf"]),
                      2, ("checkpoint.initial_load_path differs between the ranks", "(unset)"))


@pytest.mark.parametrize("key", ["training.dataset_path", "validation.dataset_path"])
def test_data_of_another_size_on_one_rank_is_refused(setup, tmp_path, key):
    """Each machine reads its own copy of the data; one of another size gave the ranks other
    numbers of windows: with validation.steps = -1 (the whole set) rank 1 ran more evaluation
    batches than rank 0 and the job hung in their collectives (the review's reproduction)."""
    d, data = setup
    longer = oracle.write_bin(tmp_path / "longer.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    args = [a for a in args_dp2(d, data, tmp_path / "out") if not a.startswith("--validation.steps=")]
    args += ["--validation.steps=-1"]
    p = run_once_reported(mpmd(args, [f"--{key}={longer}"]), 2,
                          (f"{key} = ", "the ranks' copies hold different data", "300 windows", "600"))
    assert "step: 1 " not in p.stdout


@pytest.mark.parametrize("tune0,tune1", [("0", "1"), ("1", "0")], ids=["rank0_off", "rank0_on"])
def test_kernel_tuning_is_rank_0s(setup, tmp_path, tune0, tune1):
    """CTITAN_KERNEL_TUNE set otherwise on one machine (kernels.tune itself is a shared
    option, compared like the others): rank 0 tunes and broadcasts its picks, a collective the
    other rank entered or not by its own setting, so with tuning off on rank 0 alone the job
    hung (the review's reproduction). Now every rank follows rank 0's setting, and the run
    trains as a uniform one."""
    d, data = setup
    ref = tmp_path / "uniform"
    run(2, args_dp2(d, data, ref))
    out = tmp_path / "mixed"
    env = dict(ENV, CTITAN_KERNEL_TUNE=tune0, XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = mpmd(args_dp2(d, data, out), [], [f"CTITAN_KERNEL_TUNE={tune1}"])
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = losses(out), losses(ref)
    assert sorted(got) == [1, 2, 3], got
    for s_ in want:
        assert abs(got[s_] - want[s_]) <= 1e-5 * abs(want[s_]), f"step {s_}: {got[s_]!r} vs uniform {want[s_]!r}"


def test_per_machine_options_may_differ(setup, tmp_path):
    """Rank 1 with its own thread count, its own peak, its own description and its own model
    folder (a copy): the run trains as the uniform one."""
    d, data = setup
    ref = tmp_path / "uniform"
    run(2, args_dp2(d, data, ref))
    other = tmp_path / "model_copy"
    shutil.copytree(d / "model", other)
    out = tmp_path / "mixed"
    cmd = mpmd(args_dp2(d, data, out), ["--training.threads=1", "--metrics.peak_tflops=2", "--job.description=b",
                                        f"--model.hf_assets_path={other}"])
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = losses(out), losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3], (got, want)
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), f"step {s}: {got[s]!r} vs uniform {want[s]!r}"
