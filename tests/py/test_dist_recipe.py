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
losses equal to 1e-5). The ranks' copies of the data must hold the same windows (their
counts, and a digest of their tokens and loss masks: a copy of the same size with other
tokens trained each replica on other data at exit 0), and kernel tuning follows rank 0's
setting (a review of the check found a hang, a crash and a silent split for options it
first let differ; each has a test here).

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import json
import re
import shutil
import subprocess
import tomllib

import numpy as np
import pytest

import oracle
from test_dist import ENV, losses, mpmd, run, run_once_reported, tokdir, train_args  # noqa: F401


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


def masked_copy(dst, tokens, zero_at=()):
    """A directory of one token file and its loss mask (1: a target), as a plain shard folder
    reads them (a.bin pairs with a.mask)."""
    dst.mkdir()
    oracle.write_bin(dst / "a.bin", tokens)
    mask = np.ones(len(tokens), np.uint8)
    mask[list(zero_at)] = 0
    mask.tofile(dst / "a.mask")
    return dst


@pytest.mark.parametrize("what", ["tokens", "mask"])
@pytest.mark.parametrize("key", ["training.dataset_path", "validation.dataset_path"])
def test_data_of_the_same_size_with_other_tokens_on_one_rank_is_refused(setup, tmp_path, key, what):
    """One machine's copy of the data is as long as the others' but holds other tokens (or the
    same tokens with one other loss-mask byte): the window counts agree, and the job trained
    each replica on other data at exit 0. The ranks now compare a digest of what their
    windows hold; rank 1 names its file."""
    d, data = setup
    tokens = np.fromfile(data, "<u4")
    if what == "tokens":
        other = oracle.write_bin(tmp_path / "other.bin", oracle.learnable_stream(len(tokens), 251, seed=8))
        assert np.fromfile(other, "<u4").size == tokens.size and (np.fromfile(other, "<u4") != tokens).any()
    else:  # a mask byte inside the first window: a target there becomes -100
        other = masked_copy(tmp_path / "other", tokens, zero_at=[5])
    args = args_dp2(d, data, tmp_path / "out")
    p = run_once_reported(mpmd(args, [f"--{key}={other}"]), 2,
                          ("rank 1 of 2 failed to hold rank 0's data", f'{key} = "{other}"',
                           "the ranks' copies hold different data", "the same 300 windows of 17 tokens",
                           "other tokens"))
    assert "step: 1 " not in p.stdout


def test_the_same_data_under_other_paths_and_forms_may_differ(setup, tmp_path):
    """Rank 1 reads the same tokens from other paths and in other forms: the training data as
    a folder of two token files cut mid-window, with a mask file of all ones (every token a
    target, as without one), the validation data as an .npy of int64. The digest is of what
    the windows hold, so the run trains as the uniform one."""
    d, data = setup
    tokens = np.fromfile(data, "<u4")
    shards = tmp_path / "shards"
    shards.mkdir()
    oracle.write_bin(shards / "part0.bin", tokens[:1000])
    oracle.write_bin(shards / "part1.bin", tokens[1000:])
    np.ones(len(tokens) - 1000, np.uint8).tofile(shards / "part1.mask")
    npy = oracle.write_npy(tmp_path / "val.npy", tokens)
    ref = tmp_path / "uniform"
    run(2, args_dp2(d, data, ref))
    out = tmp_path / "mixed"
    cmd = mpmd(args_dp2(d, data, out), [f"--training.dataset_path={shards}", f"--validation.dataset_path={npy}"])
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    got, want = losses(out), losses(ref)
    assert sorted(got) == sorted(want) == [1, 2, 3], (got, want)
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * abs(want[s]), f"step {s}: {got[s]!r} vs uniform {want[s]!r}"


def test_text_data_tokenized_to_other_tokens_on_one_rank_is_refused(tmp_path, tokdir):  # noqa: F811
    """JSONL tokenized at start: rank 1's file differs from rank 0's in one digit, which the
    tokenizer (HF tokenizers, the oracle here) turns into another id of the same count."""
    from tokenizers import Tokenizer
    model = tmp_path / "model"
    oracle.tiny_config(vocab=704, hidden=30, inter=49, layers=2, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(model)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, model / f)
    docs = [f"the quick brown fox number {i % 10} jumps over the lazy dog" for i in range(400)]
    mine, theirs = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    mine.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    docs[7] = docs[7].replace("number 7", "number 8")
    theirs.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    hf = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    eos = hf.token_to_id("<|endoftext|>")
    ids = [[t for line in f.read_text().splitlines() for t in hf.encode(json.loads(line)["text"]).ids + [eos]]
           for f in (mine, theirs)]
    assert len(ids[0]) == len(ids[1]) and ids[0] != ids[1], "the copies must differ in ids, not in count"
    windows = len(ids[0]) // 17
    args = train_args(model, mine, tmp_path / "out", "--parallelism.data_parallel_replicate_degree=2",
                      "--training.steps=3", dp=2)
    p = run_once_reported(mpmd(args, [f"--training.dataset_path={theirs}"]), 2,
                          ("rank 1 of 2 failed to hold rank 0's data", f'training.dataset_path = "{theirs}"',
                           f"the same {windows} windows of 17 tokens", "other tokens"))
    assert "step: 1 " not in p.stdout
