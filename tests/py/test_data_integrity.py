"""Prepared data that is not what it claims to be is refused before the first step (exit 3,
docs/reliability.md), through the CLI:

- a `ctitan prepare` that stops half-way leaves only whole shards under their final names and
  no meta.json, and `train` refuses that directory as an interrupted prepare (it used to
  train on a prefix of the data, its last shard cut mid-write);
- a meta.json whose total_tokens disagrees with its shards, or whose eos_id / vocab_size do
  not fit the model, is a format error naming the file, the key and both values;
- a token file beside meta.json that it does not list is refused, not skipped;
- a directory of token files under other names, without meta.json, still trains.

The tokenizer is test_data_hf's (a small byte-level BPE trained by HF `tokenizers`)."""
import json
import random

import pytest

import oracle
from test_data_hf import tokdir  # noqa: F401  (fixture)

L = 16


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokdir):  # noqa: F811
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("integrity")
    vocab = Tokenizer.from_file(str(tokdir / "tokenizer.json")).get_vocab_size()
    cfg = oracle.tiny_config(vocab=vocab, hidden=32, inter=64, layers=1, heads=4, kv_heads=2, head_dim=16)
    oracle.save_random_hf(d / "hf", cfg, seed=5)
    return d, d / "hf", vocab


def words(r, n):
    w = "the of and to in is was for on that with river mountain forest library engine token window".split()
    return " ".join(r.choice(w) for _ in range(n))


def train(setup, data, run_ctitan, name):
    d, hf, _ = setup
    conf = oracle.write_toml(d / f"{name}.toml",
                             oracle.train_sections(d / f"out_{name}", data, hf, steps=1, seq_len=L))
    return run_ctitan(["train", "--config", conf], check=False)


def test_interrupted_prepare_is_refused(setup, tokdir, tmp_path, run_ctitan):  # noqa: F811
    # More than two of the reader's ~1 MiB chunks before a malformed line: the first chunk is
    # written (to many small shards) before the reader reaches the bad line, so prepare fails
    # half-way, as a killed one would.
    r = random.Random(3)
    src = tmp_path / "big.jsonl"
    with src.open("w") as f:
        n = 0
        while n < 2_600_000:
            line = json.dumps({"text": words(r, 150)}) + "\n"
            f.write(line)
            n += len(line)
        f.write('{"text": "cut"\n')
    out = tmp_path / "prepared"
    shard = 4096
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out,
                             "--shard-tokens", shard, "--quiet"], check=False)
    assert rc == 3 and "invalid JSON" in err, err
    names = sorted(p.name for p in out.iterdir())
    assert "meta.json" not in names and names, names
    assert not [n for n in names if n.endswith(".tmp")], f"temporary files left: {names}"
    sizes = {n: (out / n).stat().st_size for n in names}
    assert all(s == 4 * shard for s in sizes.values()), f"a shard under its final name is not whole: {sizes}"

    rc, _, err = train(setup, out, run_ctitan, "interrupted")
    assert rc == 3, f"exit {rc}, want 3:\n{err}"
    assert str(out) in err and "no meta.json" in err and "interrupted `ctitan prepare`" in err, err


@pytest.fixture
def prepared(setup, tokdir, tmp_path, run_ctitan):  # noqa: F811
    r = random.Random(4)
    src = tmp_path / "small.jsonl"
    src.write_text("".join(json.dumps({"text": words(r, 40)}) + "\n" for _ in range(60)))
    out = tmp_path / "prepared"
    run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out, "--quiet"])
    return out


def test_prepared_trains(setup, prepared, run_ctitan):
    rc, _, err = train(setup, prepared, run_ctitan, "prepared_ok")
    assert rc == 0, err


# (key, value written into meta.json or a function of the setup's vocabulary, text of the error)
META_ERRORS = [
    ("total_tokens", lambda v, n: 5, lambda v, n: f"total_tokens is 5, but its 1 shard(s) hold {n} tokens"),
    ("eos_id", lambda v, n: 99999, lambda v, n: f"eos_id is 99999, outside its own vocab_size {v}"),
    ("vocab_size", lambda v, n: v + 1000,
     lambda v, n: f"vocab_size is {v + 1000}, larger than the model's vocabulary (size {v})"),
    # prepare writes counts as integers; 5.0 is a hand edit (a manifest refuses it alike)
    ("total_tokens", lambda v, n: float(n), lambda v, n: "total_tokens: expected a non-negative integer"),
]


@pytest.mark.parametrize("key,value,want", META_ERRORS, ids=["total_tokens", "eos_id", "vocab_size", "float_count"])
def test_meta_json_that_disagrees_is_refused(key, value, want, setup, prepared, tmp_path, run_ctitan):
    vocab = setup[2]
    data = prepared
    meta = json.loads((data / "meta.json").read_text())
    n = meta["total_tokens"]
    meta[key] = value(vocab, n)
    (data / "meta.json").write_text(json.dumps(meta))
    rc, _, err = train(setup, data, run_ctitan, f"meta_{key}")
    assert rc == 3, f"exit {rc}, want 3:\n{err}"
    assert str(data / "meta.json") in err and want(vocab, n) in err, err


@pytest.mark.parametrize("name", ["shard-00001.bin", "extra.npy", "shard-00000.mask"])
def test_token_file_meta_json_does_not_list_is_refused(name, setup, prepared, run_ctitan):
    """A token file beside meta.json that it does not list would be skipped without a word
    (a shard copied in by hand, or left from another dataset)."""
    vocab = setup[2]
    listed = {s["file"] for s in json.loads((prepared / "meta.json").read_text())["shards"]}
    assert name not in listed, listed
    if name.endswith(".npy"):
        oracle.write_npy(prepared / name, oracle.random_tokens(3 * (L + 1), vocab, seed=6))
    elif name.endswith(".mask"):
        (prepared / name).write_bytes(b"\x01" * 8)
    else:
        oracle.write_bin(prepared / name, oracle.random_tokens(3 * (L + 1), vocab, seed=6))
    rc, _, err = train(setup, prepared, run_ctitan, "unlisted")
    assert rc == 3, f"exit {rc}, want 3:\n{err}"
    assert f"{prepared}: {name} is not listed in {prepared / 'meta.json'}" in err, err


def test_plain_token_directory_still_trains(setup, tmp_path, run_ctitan):
    """Token files that are not prepare's shard-NNNNN.bin need no meta.json."""
    vocab = setup[2]
    data = tmp_path / "tokens"
    data.mkdir()
    oracle.write_bin(data / "a.bin", oracle.random_tokens(3 * (L + 1), vocab, seed=1))
    oracle.write_npy(data / "b.npy", oracle.random_tokens(3 * (L + 1), vocab, seed=2))
    rc, _, err = train(setup, data, run_ctitan, "plain")
    assert rc == 0, err
