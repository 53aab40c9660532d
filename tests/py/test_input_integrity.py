"""Bad input that a second audit found accepted (stop 43, docs/reliability.md): PEFT adapter
directories, JSON Lines data, data with no training target, and a command-line value blamed
on the TOML file. Each case runs the CLI as a user would and checks the exit code of
docs/reliability.md's table and that the message names the file and key."""
import json
import math
import shutil
import subprocess

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import oracle
from conftest import BIN, CHILD_ENV, crashed
import oracle_lora as OL
from test_data_hf import tokdir  # noqa: F401  (fixture)

R = 4
KEY = OL.PREFIX + "model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    cfg = oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(d / "hf", cfg, seed=3)
    OL.make_peft(oracle.load_hf(d / "hf"), r=R, alpha=8, targets=["q_proj", "v_proj"],
                 seed=1).save_pretrained(str(d / "adapter"))
    return d


def nan_weight(ad):
    t = load_file(str(ad / "adapter_model.safetensors"))
    t[KEY] = t[KEY].clone()
    t[KEY][1, 2] = math.nan
    save_file(t, str(ad / "adapter_model.safetensors"), metadata={"format": "pt"})


def three_dims(ad):
    t = load_file(str(ad / "adapter_model.safetensors"))
    t[KEY] = t[KEY].reshape(1, *t[KEY].shape).contiguous()
    save_file(t, str(ad / "adapter_model.safetensors"), metadata={"format": "pt"})


def edit_config(**kv):
    def f(ad):
        c = json.loads((ad / "adapter_config.json").read_text())
        c.update(kv)
        (ad / "adapter_config.json").write_text(json.dumps(c))
    return f


ADAPTERS = [
    # (id, damage, exit, text the message must hold)
    ("nan_weight", nan_weight, 3, f'"{KEY}" holds a non-finite value (nan) at element {1 * R + 2}'),
    ("r_as_float", edit_config(r=float(R)), 3, "adapter_config.json: r: expected a positive integer"),
    ("saved_module_missing", edit_config(modules_to_save=["lm_head"]), 3,
     'modules_to_save lists "lm_head", but'),
    ("three_dims", three_dims, 3, f'"{OL.PREFIX}model.layers.0.self_attn.q_proj.lora_B.weight" has 3 dimensions'),
    # the file's value, a format error as its r and lora_alpha are (it exited 2, a config error)
    ("rank_pattern_negative", edit_config(rank_pattern={"q_proj": -2}), 3,
     'adapter_config.json: rank_pattern: "q_proj": expected a positive integer'),
]


@pytest.mark.parametrize("damage,code,want", [a[1:] for a in ADAPTERS], ids=[a[0] for a in ADAPTERS])
def test_a_bad_adapter_is_refused_where_it_is_read(model, tmp_path, run_ctitan, damage, code, want):
    """generate ran on a NaN adapter to "non-finite logits" and export --merge wrote the NaN
    out; an adapter listing a module to save that its file lacks, or "r": 4.0, loaded (PEFT
    refuses both)."""
    ad = tmp_path / "adapter"
    shutil.copytree(model / "adapter", ad)
    damage(ad)
    rc, _, err = run_ctitan(["generate", "--checkpoint", model / "hf", "--adapter", ad, "--prompt-ids", "1 2",
                             "--ids", "--max-tokens", "2"], check=False)
    assert rc == code and want in err, (rc, err)
    rc, _, err = run_ctitan(["export", "--checkpoint", model / "hf", "--adapter", ad, "--merge",
                             "--out", tmp_path / "merged"], check=False)
    assert rc == code and want in err, (rc, err)
    assert not (tmp_path / "merged" / "model.safetensors").exists()


def test_the_intact_adapter_loads(model, run_ctitan):
    run_ctitan(["generate", "--checkpoint", model / "hf", "--adapter", model / "adapter", "--prompt-ids", "1 2",
                "--ids", "--max-tokens", "2"])


@pytest.mark.parametrize("line,want", [
    (b'{"text": "a b", "text": "c d"}\n', 'duplicate key "text"'),
    (b'{"text": "a \xff b"}\n', "invalid UTF-8"),
], ids=["duplicate_key", "bad_utf8"])
def test_json_lines_are_read_as_strictly_as_json_files(tokdir, tmp_path, run_ctitan, line, want):  # noqa: F811
    """{"text": "a", "text": "b"} kept the first value (Python keeps the last), and a byte
    0xff inside a string was taken: now exit 3 naming file:line, as for every JSON file."""
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"text": "fine words here"}\n' + line)
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", tmp_path / "p"],
                            check=False)
    assert rc == 3 and f"{src}:2" in err and want in err, (rc, err)


def test_data_without_a_training_target_is_refused(model, tmp_path, run_ctitan):
    """Chat data without an assistant reply masks every token out: it trained to loss 0.0000,
    grad_norm 0 at exit 0. A token file whose .mask is all zeros is the same data."""
    data = tmp_path / "data"  # a directory of token files, each with its .mask beside it (docs/data.md)
    data.mkdir()
    oracle.write_bin(data / "part-0.bin", oracle.random_tokens(400, 128, seed=7))
    (data / "part-0.mask").write_bytes(np.zeros(400, np.uint8).tobytes())
    conf = oracle.write_toml(tmp_path / "t.toml", oracle.train_sections(tmp_path / "out", data, model / "hf",
                                                                         steps=1, seq_len=16))
    rc, _, err = run_ctitan(["train", "--config", conf], check=False)
    assert rc == 3 and f"{data}: no token is a training target" in err, (rc, err)
    (data / "part-0.mask").write_bytes(np.eye(1, 400, 399, dtype=np.uint8).tobytes())  # one target: trains
    run_ctitan(["train", "--config", conf])


def test_a_lora_value_from_the_command_line_is_named_as_such(model, tmp_path, run_ctitan):
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(400, 128, seed=7))
    conf = oracle.write_toml(tmp_path / "t.toml", oracle.train_sections(tmp_path / "out", data, model / "hf",
                                                                         steps=1, seq_len=16))
    rc, _, err = run_ctitan(["train", "--config", conf, "--lora.rank=4", "--lora.target_modules=nosuch"],
                            check=False)
    assert rc == 2 and "command line: lora.target_modules" in err and "t.toml" not in err, (rc, err)


@pytest.mark.parametrize("cmd", [
    ["generate", "--checkpoint", "hf/config.json", "--prompt-ids", "1 2", "--ids"],
    ["describe", "hf/config.json"],
], ids=["generate", "describe"])
def test_an_existing_file_is_not_taken_for_a_hub_id(model, cmd):
    """A relative "hf/config.json" has the form of a Hub id (owner/name): it was downloaded for
    (several seconds of retries, then "not in cache") instead of being named as the file it is."""
    p = subprocess.run([str(BIN)] + cmd, cwd=model, env=dict(CHILD_ENV, HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 2 and "hf/config.json" in p.stderr and "cache" not in p.stderr, (p.returncode, p.stderr)


@pytest.mark.parametrize("args", [
    ["check", "--seed", "abc"], ["check", "--seed", "-1"], ["bench", "--peak", "nan"], ["bench", "--peak", "inf"],
    ["bench", "--threads", "3x"], ["check", "--threads", "1.5"], ["bench", "--reps", "0"],
], ids=lambda a: " ".join(a))
def test_kernels_numbers_are_read_whole(run_ctitan, args):
    """atoi read "3x" as 3 and "abc" as 0, and atof took "nan" (a peak of nan GFLOP/s, exit 0)."""
    rc, _, err = run_ctitan(["kernels"] + args, check=False)
    assert rc == 2 and f"kernels: {args[1]}:" in err and args[2] in err, (rc, err)


def test_prepare_names_a_directory_as_one(tokdir, tmp_path, run_ctitan):  # noqa: F811
    """An empty directory as --input was "already tokenized"."""
    (tmp_path / "d").mkdir()
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", tmp_path / "d", "--out", tmp_path / "p"],
                            check=False)
    assert rc == 2 and f"{tmp_path / 'd'}: a directory" in err, (rc, err)
