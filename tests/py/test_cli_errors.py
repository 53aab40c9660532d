"""`ctitan` on bad input: config errors (exit 2, key and file named), corrupt
safetensors (non-zero, file named), too little data (file named); and --help."""
import os
import re
import struct
import subprocess

import pytest

import oracle
from conftest import CHILD_ENV, crashed

L = 16

ALL_OPTIONS = [
    "job.dump_folder", "job.description",
    "model.spec", "model.flavor", "model.hf_assets_path", "model.hf_revision",
    "optimizer.name", "optimizer.lr", "optimizer.eps", "optimizer.weight_decay", "optimizer.beta1",
    "optimizer.beta2",
    "lr_scheduler.warmup_steps", "lr_scheduler.decay_ratio", "lr_scheduler.decay_type",
    "lr_scheduler.min_lr_factor",
    "training.local_batch_size", "training.global_batch_size", "training.seq_len", "training.max_norm",
    "training.steps", "training.dataset", "training.dataset_path", "training.seed", "training.deterministic",
    "training.threads",
    "checkpoint.enable", "checkpoint.folder", "checkpoint.interval", "checkpoint.initial_load_path",
    "checkpoint.initial_load_in_hf", "checkpoint.last_save_in_hf", "checkpoint.export_dtype",
    "metrics.log_freq", "metrics.file", "metrics.peak_tflops", "metrics.enable_tensorboard",
    "metrics.save_tb_folder",
    "profiling.enable_profiling", "profiling.save_traces_folder", "profiling.profile_freq",
    "profiling.enable_memory_snapshot", "profiling.save_memory_snapshot_folder",
]


@pytest.fixture
def base(tmp_path):
    """A valid setup: tiny HF model, data, and the sections of a config that trains."""
    cfg = oracle.tiny_config(vocab=128, hidden=32, inter=64, layers=1, heads=4, kv_heads=2, head_dim=16)
    hf_dir = tmp_path / "hf"
    oracle.save_random_hf(hf_dir, cfg, seed=41)
    data = oracle.write_bin(tmp_path / "d.bin", oracle.random_tokens(4 * (L + 1), 128, seed=7))
    return {"hf": hf_dir, "data": data, "out": tmp_path / "out", "tmp": tmp_path,
            "sections": oracle.train_sections(tmp_path / "out", data, hf_dir, steps=1)}


def test_base_config_trains(base, run_ctitan):
    conf = oracle.write_toml(base["tmp"] / "ok.toml", base["sections"])
    run_ctitan(["train", "--config", conf])
    assert oracle.read_metrics(base["out"] / "metrics.jsonl")[0]["step"] == 1


CONFIG_ERRORS = [
    # (id, {"section": {"key": value}} merged into the valid config, text stderr must contain)
    ("unknown_section", {"bogus_section": {"x": 1}}, "bogus_section"),
    ("unknown_key", {"training": {"bogus_key": 1}}, "training.bogus_key"),
    ("wrong_type_string_for_int", {"training": {"seq_len": "sixteen"}}, "training.seq_len"),
    ("wrong_type_float_for_int", {"training": {"steps": 1.5}}, "training.steps"),
    ("wrong_type_int_for_bool", {"checkpoint": {"initial_load_in_hf": 3}}, "checkpoint.initial_load_in_hf"),
    ("out_of_range_seq_len", {"training": {"seq_len": 0}}, "training.seq_len"),
    ("out_of_range_beta1", {"optimizer": {"beta1": 1.5}}, "optimizer.beta1"),
    ("out_of_range_profile_freq", {"profiling": {"profile_freq": 0}}, "profiling.profile_freq"),
    ("bad_enum_decay_type", {"lr_scheduler": {"decay_type": "exp"}}, "lr_scheduler.decay_type"),
    ("bad_enum_export_dtype", {"checkpoint": {"export_dtype": "float8"}}, "checkpoint.export_dtype"),
    ("global_not_multiple_of_local", {"training": {"local_batch_size": 2, "global_batch_size": 3}},
     "training.global_batch_size"),
]


@pytest.mark.parametrize("cid,change,key", CONFIG_ERRORS, ids=[c[0] for c in CONFIG_ERRORS])
def test_config_error(cid, change, key, base, run_ctitan):
    sections = {k: dict(v) for k, v in base["sections"].items()}
    for sec, kv in change.items():
        sections.setdefault(sec, {}).update(kv)
    conf = oracle.write_toml(base["tmp"] / f"{cid}.toml", sections)
    rc, out, err = run_ctitan(["train", "--config", conf], check=False)
    assert rc == 2, f"exit {rc}, want 2; stderr:\n{err}"
    assert key in err, f"stderr does not name {key}:\n{err}"
    assert str(conf) in err, f"stderr does not name the config file {conf}:\n{err}"


CLI_ERRORS = [
    ("unknown_key", "--training.bogus_key=1", "training.bogus_key"),
    ("unknown_section", "--bogus_section.x=1", "bogus_section"),
    ("wrong_type", "--training.steps=abc", "training.steps"),
    ("out_of_range", "--optimizer.beta2=-0.5", "optimizer.beta2"),
]


@pytest.mark.parametrize("cid,arg,key", CLI_ERRORS, ids=[c[0] for c in CLI_ERRORS])
def test_cli_override_error(cid, arg, key, base, run_ctitan):
    conf = oracle.write_toml(base["tmp"] / "ok.toml", base["sections"])
    rc, out, err = run_ctitan(["train", "--config", conf, arg], check=False)
    assert rc == 2, f"exit {rc}, want 2; stderr:\n{err}"
    assert key in err, f"stderr does not name {key}:\n{err}"


# ---------------------------------------------------------------------------- safetensors

def _corrupt(kind, header, data):
    """Returns (header, data, header_len_override) for one kind of corruption."""
    tensors = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    if kind == "truncated":
        return header, data[: len(data) // 2], None
    if kind == "overlapping_offsets":
        # The second tensor starts inside the first one (a hole is left behind it).
        a, b = tensors[0], tensors[1]
        a0, a1 = header[a]["data_offsets"]
        b0, b1 = header[b]["data_offsets"]
        start = a0 + (a1 - a0) // 2
        start -= start % 4
        header[b]["data_offsets"] = [start, start + (b1 - b0)]
        return header, data, None
    if kind == "header_len_past_end":
        return header, data, 8 + len(data) + 10 ** 6
    if kind == "unknown_dtype":
        header[tensors[2]]["dtype"] = "Q7"
        return header, data, None
    if kind == "header_not_json":
        return None, data, None
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["truncated", "overlapping_offsets", "header_len_past_end", "unknown_dtype",
                                  "header_not_json"])
def test_corrupt_safetensors(kind, base, run_ctitan):
    f = base["hf"] / "model.safetensors"
    header, data = oracle.read_safetensors_raw(f)
    header, data, n = _corrupt(kind, header, data)
    if header is None:
        body = b'{"model.norm.weight": {"dtype": "F32", "shape": [32], "data_offsets": [0, 128]'  # no closing
        body += b" " * ((8 - len(body) % 8) % 8)
        f.write_bytes(struct.pack("<Q", len(body)) + body + data)
    else:
        oracle.write_safetensors_raw(f, header, data, header_len_override=n)
    conf = oracle.write_toml(base["tmp"] / "t.toml", base["sections"])
    rc, out, err = run_ctitan(["train", "--config", conf], check=False)
    assert rc != 0, f"ctitan accepted a safetensors file with {kind}"
    assert str(f) in err.replace("//", "/"), f"stderr does not name {f}:\n{err}"


def test_data_too_short(base, run_ctitan):
    short = oracle.write_bin(base["tmp"] / "short.bin", oracle.random_tokens(L, 128, seed=1))  # < L+1 tokens
    sections = base["sections"]
    sections["training"]["dataset_path"] = str(short)
    conf = oracle.write_toml(base["tmp"] / "t.toml", sections)
    rc, out, err = run_ctitan(["train", "--config", conf], check=False)
    assert rc != 0, "ctitan trained on a data file shorter than one window"
    assert str(short) in err, f"stderr does not name {short}:\n{err}"


def test_missing_data_is_reported_before_the_model_and_kernels(base, run_ctitan):
    """A mistyped dataset path was reported only after the model was built and the kernels
    timed (a minute or more with kernels.tune on a new machine): now before either, naming
    the key, the path and where the value was set."""
    missing = base["tmp"] / "no-such.bin"
    conf = oracle.write_toml(base["tmp"] / "t.toml", base["sections"])
    for where, extra in (("t.toml", []), ("command line", [f"--training.dataset_path={missing}"])):
        if not extra:
            sections = base["sections"]
            sections["training"]["dataset_path"] = str(missing)
            conf = oracle.write_toml(base["tmp"] / "t.toml", sections)
        rc, out, err = run_ctitan(["train", "--config", conf, "--kernels.tune=true", *extra], check=False)
        assert rc == 1, err
        assert f"training.dataset_path: {missing}: No such file or directory" in err and where in err, err
        assert "kernels:" not in err and "step:" not in err, f"the model or kernels came first:\n{err}"


# ---------------------------------------------------------------------------- help

def _option_text(text, name):
    """The line naming `name` (as a whole dotted option) and the line after it."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.search(r"(?<![\w.])" + re.escape(name) + r"(?![\w.])", line):
            return line + "\n" + (lines[i + 1] if i + 1 < len(lines) else "")
    return None


def _numbers(s):
    return [float(x) for x in re.findall(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?", s)]


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"]], ids=["ctitan", "train"])
def test_help(args, run_ctitan):
    rc, out, err = run_ctitan(args, check=False)
    assert rc == 0, f"{args}: exit {rc}\n{err}"
    missing = [o for o in ALL_OPTIONS if _option_text(out, o) is None]
    assert not missing, f"--help does not list {missing}"
    t = _option_text(out, "training.seq_len")
    assert 2048 in _numbers(t.replace("training.seq_len", "")), f"default 2048 not shown: {t}"
    t = _option_text(out, "optimizer.lr")
    assert any(abs(x - 8e-4) < 1e-12 for x in _numbers(t.replace("optimizer.lr", ""))), f"default 8e-4 not shown: {t}"
    t = _option_text(out, "checkpoint.export_dtype")
    assert "float32" in t, f"default float32 not shown: {t}"
    t = _option_text(out, "optimizer.beta2")
    assert 0.95 in _numbers(t.replace("optimizer.beta2", "")), f"default 0.95 not shown: {t}"


def test_describe_a_folder_without_config_json(tmp_path, run_ctitan):
    """`ctitan describe RUN_FOLDER` said "config.json: cannot read (model.hf_assets_path = ...)",
    a key a user of describe never set. A run folder (it holds checkpoint/) is pointed at its
    checkpoints; any other folder is told describe wants a Hugging Face model directory."""
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    rc, _, err = run_ctitan(["describe", run], check=False)
    # a missing file: 1, as generate and import give it (docs/reliability.md, "Exit codes")
    assert rc == 1 and f"{run}/config.json: not found" in err and f"{run}/checkpoint/step-N" in err, (rc, err)
    assert "hf_assets_path" not in err, err
    other = tmp_path / "other"
    other.mkdir()
    rc, _, err = run_ctitan(["describe", other], check=False)
    assert rc == 1 and "Hugging Face model directory" in err and "hf_assets_path" not in err, (rc, err)


def test_hf_weights_into_the_native_flavor_point_at_model_spec_hf(base, run_ctitan):
    """Published weights loaded into the native model (model.spec = "qwen3", the default
    debugmodel flavor) failed on the first tensor's shape (exit 3) with no word of the usual
    cause: model.spec = "hf" forgotten. The message now says which model was built and the key
    that builds it from the checkpoint's config.json."""
    conf = oracle.write_toml(base["tmp"] / "t.toml", base["sections"])
    rc, _, err = run_ctitan(["train", "--config", conf, "--model.spec=qwen3"], check=False)
    assert rc == 3 and "the model expects" in err, (rc, err)
    assert 'model.flavor = "debugmodel" of model.spec = "qwen3"' in err and 'set model.spec = "hf"' in err, err
    rc, _, err = run_ctitan(["train", "--config", conf], check=False)  # spec hf: no hint where it trains
    assert rc == 0 and 'set model.spec = "hf"' not in err, (rc, err)


def test_generate_on_an_adapter_folder_says_where_it_goes(base, run_ctitan):
    """`generate --checkpoint` on a PEFT adapter folder said only "config.json: not found", and on a
    LoRA run's training checkpoint (config.json of the base, model.safetensors of the adapter)
    "missing tensor model.embed_tokens.weight". Both now say to give the base as --checkpoint
    and the folder as --adapter, naming the base the adapter records."""
    import json
    ad = base["tmp"] / "adapter"
    ad.mkdir()
    (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "org/base"}))
    rc, _, err = run_ctitan(["generate", "--checkpoint", ad, "--prompt-ids", "1 2", "--ids"], check=False)
    assert rc == 1 and "config.json: not found" in err, (rc, err)
    assert "give the base model (org/base) as --checkpoint and" in err and f"{ad} as --adapter" in err, err
    ck = base["tmp"] / "step-4"  # as a LoRA run saves one: the base's config.json, a manifest, the adapter
    ck.mkdir()
    (ck / "config.json").write_text((base["hf"] / "config.json").read_text())
    (ck / "manifest.json").write_text("{}")
    (ck / "adapter_config.json").write_text((ad / "adapter_config.json").read_text())
    rc, _, err = run_ctitan(["generate", "--checkpoint", ck, "--prompt-ids", "1 2", "--ids"], check=False)
    assert rc == 1 and "training checkpoint holds no base weights" in err and f"{ck} as --adapter" in err, (rc, err)


# Every command that takes a model or tokenizer directory, with that directory missing (DIR).
MISSING_DIR_CMDS = {
    "generate": lambda d, t: ["generate", "--checkpoint", d, "--prompt-ids", "1 2", "--ids"],
    "describe": lambda d, t: ["describe", d],
    "import": lambda d, t: ["import", "--hf", d, "--out", t / "ck"],
    "export": lambda d, t: ["export", "--checkpoint", d, "--out", t / "o"],
    "prepare": lambda d, t: ["prepare", "--tokenizer", d, "--input", t / "in.txt", "--out", t / "p"],
    "tokenize": lambda d, t: ["tokenize", "--tokenizer", d, "--text", "hello"],
}


@pytest.mark.parametrize("form", ["bare", "dot", "absolute"])
@pytest.mark.parametrize("cmd", sorted(MISSING_DIR_CMDS))
def test_missing_directory_exits_1_naming_it(ctitan_bin, tmp_path, cmd, form):
    """A model or tokenizer directory that does not exist is a missing file: exit 1 by
    docs/reliability.md's table (import and export gave 1, describe 2), and prepare and
    tokenize said "no tokenizer.json, and no vocab.json + merges.txt" as if it existed. A
    string that is no Hub id (owner/name) is a path, whatever its form."""
    (tmp_path / "in.txt").write_text("hello\n")
    d = {"bare": "nodir", "dot": "./nodir", "absolute": str(tmp_path / "nodir")}[form]
    args = [str(a) for a in MISSING_DIR_CMDS[cmd](d, tmp_path)]
    env = dict(CHILD_ENV, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([str(ctitan_bin)] + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    crashed(p.returncode, p.stderr, args)
    assert p.returncode == 1, (args, p.returncode, p.stderr)
    assert f"{d}: no such directory" in p.stderr, p.stderr
    assert "no tokenizer.json" not in p.stderr and not os.path.exists(tmp_path / "ck"), p.stderr


@pytest.mark.parametrize("cmd", ["describe", "import", "prepare", "tokenize"])
def test_missing_hub_id_offline_exits_1(ctitan_bin, tmp_path, cmd):
    """A Hub-id-shaped name that is no directory here is an id: offline and not cached it is
    a missing file too (docs/hub.md's table), the same 1 for every command that takes ids."""
    (tmp_path / "in.txt").write_text("hello\n")
    args = [str(a) for a in MISSING_DIR_CMDS[cmd]("no-such-owner/no-such-model", tmp_path)]
    env = dict(CHILD_ENV, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([str(ctitan_bin)] + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    crashed(p.returncode, p.stderr, args)
    assert p.returncode == 1 and "HF_HUB_OFFLINE" in p.stderr and "no-such-owner/no-such-model" in p.stderr, \
        (args, p.returncode, p.stderr)


@pytest.mark.parametrize("cmd, arg", [("export", "--dtyp=float32"), ("export", "--ch"), ("import", "--ste=3"),
                                      ("generate", "--temp=0.5"), ("generate", "--max=3")])
def test_an_option_is_its_whole_name(cmd, arg, run_ctitan):
    """export, import and generate take an option by its whole name: a prefix of one (--dtyp for
    --dtype) is unknown, exit 2 naming it, as argparse with allow_abbrev=False reads it (an
    abbreviation would change meaning when an option is added: --max could mean --max-tokens
    today and something else tomorrow)."""
    rc, _, err = run_ctitan([cmd, arg], check=False)
    name = arg.split("=")[0]
    assert rc == 2 and f'{cmd}: unknown option "{name}" (see --help)' in err, (rc, err)


@pytest.mark.parametrize("cmd, arg", [("export", "--out="), ("export", "--dtype="), ("import", "--hf="),
                                      ("generate", "--checkpoint=")])
def test_an_empty_option_value_is_refused_by_name(cmd, arg, run_ctitan):
    """`--out=` (an empty value; only free text such as --prompt may be empty) is refused naming the
    option, before the command looks at the other options or reads anything."""
    rc, _, err = run_ctitan([cmd, arg], check=False)
    assert rc == 2 and f"ctitan: error: {arg[:-1]}: empty value" in err, (rc, err)


@pytest.mark.parametrize("cmd, arg", [("export", "--merge=yes"), ("generate", "--ids=1"), ("generate", "--chat=")])
def test_a_flag_takes_no_value(cmd, arg, run_ctitan):
    """A flag (--merge, --ids, --chat) given a value is refused naming it, not taken as set."""
    rc, _, err = run_ctitan([cmd, arg], check=False)
    name, value = arg.split("=", 1)
    assert rc == 2 and f'ctitan: error: {name}: takes no value (got "{value}")' in err, (rc, err)


@pytest.mark.parametrize("cmd", ["export", "import", "generate"])
def test_dash_h_is_help(cmd, run_ctitan):
    """-h is --help, as in argparse: the command's options on stdout, exit 0."""
    rc, out, err = run_ctitan([cmd, "-h"], check=False)
    rc2, out2, _ = run_ctitan([cmd, "--help"], check=False)
    assert rc == 0 and rc2 == 0 and out == out2 and "--help" in out, (rc, out, err)
