"""Nothing half-right is taken for a good checkpoint, and a setting is never mistaken for
damage: the gaps a bad-input audit found (stop 43, docs/reliability.md).

Each case starts from one small run's checkpoints (step-2 and step-4, full; step-5, the
final model-only save), copies them, changes one thing, and runs the command a user would.
Where the change is to a file the manifest lists, the manifest is rewritten with the right
checksums (`resign`), so that only the new check can catch it: the manifest's own check
would report any unsigned edit as damage. Exit codes are docs/reliability.md's table:
1 runtime, 2 config, 3 format."""
import ctypes
import json
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest

import oracle
from conftest import BIN, CHILD_ENV, ROOT, crashed
from test_faults import intact, tree, verify
from test_resume import args_for

STEPS = 5

_xxh = ctypes.CDLL("libxxhash.so.0")
_xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
_xxh.XXH3_64bits.restype = ctypes.c_uint64


def xxh3(b: bytes) -> str:
    return "%016x" % _xxh.XXH3_64bits(b, len(b))


def resign(d: Path):
    """Rewrites d/manifest.json for the files as they now are, in ckpt.c's layout."""
    man = json.loads((d / "manifest.json").read_text())
    files = ",".join('\n    "%s": {"bytes": %d, "xxh3_64": "%s"}' % (n, len((d / n).read_bytes()), xxh3((d / n).read_bytes()))
                     for n in man["files"])
    body = ('{\n  "format": "%s",\n  "version": %d,\n  "step": %d,\n  "model_only": %s,\n  "files": {%s\n  }'
            ',\n  "manifest_xxh3_64": "' % (man["format"], man["version"], man["step"],
                                          "true" if man["model_only"] else "false", files))
    (d / "manifest.json").write_text(body + xxh3(body.encode()) + '"\n}\n')
    assert not verify(d), verify(d)


def run(args, timeout=120):
    cmd = [str(BIN)] + [str(a) for a in args]
    p = subprocess.run(cmd, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    return p


def train_args(model_dir, data, out, *extra):
    base = [a for a in args_for(model_dir, data, out) if not a.startswith("--training.steps=")]
    return base + [f"--training.steps={STEPS}", "--checkpoint.interval=2", "--checkpoint.fallback=false", *extra]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("integrity")
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    cfg.save_pretrained(tmp / "model")
    data = oracle.write_bin(tmp / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    out = tmp / "run"
    p = run(train_args(tmp / "model", data, out, "--checkpoint.last_save_model_only=true"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(d.name for d in (out / "checkpoint").iterdir()) == ["step-2", "step-4", "step-5"]
    return tmp, tmp / "model", data, out


@pytest.fixture
def copy(base, tmp_path):
    """(model_dir, data, a copy of the run's folder with its checkpoints)."""
    tmp, model_dir, data, out = base
    dst = tmp_path / "run"
    shutil.copytree(out, dst)
    return model_dir, data, dst


def resume(copy, *extra):
    model_dir, data, out = copy
    return run(train_args(model_dir, data, out, *extra))


def edit_json(path: Path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d, indent=2))


def set_float(path: Path, name: str, index: int, value: float):
    """Element `index` of tensor `name` in a safetensors file set to value (F32)."""
    hdr, _ = oracle.read_safetensors_raw(path)
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    at = 8 + n + hdr[name]["data_offsets"][0] + 4 * index
    b = bytearray(path.read_bytes())
    b[at:at + 4] = struct.pack("<f", value)
    path.write_bytes(bytes(b))


def test_load_step_of_a_model_only_save_is_refused(copy):
    """load_step = 5 named the final model-only save: it seeded a run from step 0 whose saves
    replaced step-2 and step-4. Now a config error, and the folder is untouched."""
    ck = copy[2] / "checkpoint"
    before = tree(ck)
    p = resume(copy, "--training.steps=8", "--checkpoint.load_step=5")
    assert p.returncode == 2, p.stderr[-2000:]
    assert "load_step = 5" in p.stderr and "model-only" in p.stderr and "step-5" in p.stderr, p.stderr[-2000:]
    assert tree(ck) == before, "the checkpoint folder changed"


def test_a_diverged_run_saves_no_checkpoint(base, tmp_path):
    """An lr that overflows the weights in the first update: the save of step 2 is refused
    naming the tensor, and no step-N holding inf is left behind."""
    tmp, model_dir, data, _ = base
    out = tmp_path / "run"
    p = run(train_args(model_dir, data, out, "--optimizer.lr=1e30", "--lr_scheduler.warmup_steps=0"))
    assert p.returncode == 1, p.stderr[-2000:]
    assert "not saved" in p.stderr and "non-finite" in p.stderr and ".weight" in p.stderr, p.stderr[-2000:]
    ck = out / "checkpoint"
    assert not ck.exists() or not [d for d in ck.iterdir() if d.name.startswith("step-")], list(ck.iterdir())


def test_an_lr_beyond_fp32_is_a_config_error(copy):
    p = resume(copy, "--optimizer.lr=1e39")
    assert p.returncode == 2 and "optimizer.lr" in p.stderr and "fp32" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("file,name,suffix,value,why", [
    ("model.safetensors", "model.layers.0.mlp.up_proj.weight", "", float("nan"), "non-finite"),
    ("optim.safetensors", "model.norm.weight", ".exp_avg", float("inf"), "non-finite"),
    ("optim.safetensors", "model.layers.1.self_attn.q_proj.weight", ".exp_avg_sq", -1e-3, "never negative"),
])
def test_non_finite_state_in_a_checkpoint_is_named(copy, file, name, suffix, value, why):
    d = copy[2] / "checkpoint" / "step-4"
    set_float(d / file, name + suffix, 7, value)
    resign(d)
    p = resume(copy, "--training.steps=6")
    assert p.returncode == 3, p.stderr[-2000:]
    assert f"{file}: tensor \"{name}{suffix}\"" in p.stderr and "element 7" in p.stderr and why in p.stderr, \
        p.stderr[-2000:]
    if file == "model.safetensors":  # export read it as it was, and wrote the NaN out
        p = run(["export", "--checkpoint", d, "--out", d.parent / "exported"])
        assert p.returncode == 3 and f"tensor \"{name}\"" in p.stderr, p.stderr[-2000:]
        assert not (d.parent / "exported" / "model.safetensors").exists()


@pytest.mark.parametrize("edit,want", [
    (lambda s: s.update(step=7), "step 7, but the checkpoint's manifest.json says step 4"),
    (lambda s: s.pop("data"), 'missing "data"'),
])
def test_state_json_must_agree(copy, edit, want):
    d = copy[2] / "checkpoint" / "step-4"
    edit_json(d / "state.json", edit)
    resign(d)
    p = resume(copy, "--training.steps=6")
    assert p.returncode == 3 and "step-4/state.json" in p.stderr and want in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("key,value,want", [
    ("model_type", "llama", 'model_type is "llama"'),
    ("hidden_act", "gelu_pytorch_tanh", "activation is gelu_pytorch_tanh"),
])
def test_config_json_must_describe_the_same_model(copy, key, value, want):
    d = copy[2] / "checkpoint" / "step-4"
    edit_json(d / "config.json", lambda c: c.update({key: value}))
    resign(d)
    p = resume(copy, "--training.steps=6")
    assert p.returncode == 2 and "step-4/config.json" in p.stderr and want in p.stderr, p.stderr[-2000:]


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    """A run of a tiny Granite model (its four scalars away from 1) with its checkpoints."""
    from transformers import GraniteConfig
    tmp = tmp_path_factory.mktemp("granite")
    GraniteConfig(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, embedding_multiplier=12.0, residual_multiplier=0.22,
                  attention_multiplier=0.015625, logits_scaling=8.0).save_pretrained(tmp / "model")
    data = oracle.write_bin(tmp / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    p = run(train_args(tmp / "model", data, tmp / "run"))
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "model", data, tmp / "run"


@pytest.mark.parametrize("key,value", [("residual_multiplier", 0.5), ("embedding_multiplier", 1.0),
                                       ("attention_multiplier", 0.25), ("logits_scaling", 1.0)])
def test_a_checkpoint_of_other_granite_scalars_is_refused(granite, tmp_path, key, value):
    """Granite's scalars change what every layer computes without changing a tensor's shape:
    a checkpoint whose config.json has another value must not load into the model as if it
    were the same one (transformers' GraniteConfig reads each of them)."""
    model_dir, data, out = granite
    dst = tmp_path / "run"
    shutil.copytree(out, dst)
    d = dst / "checkpoint" / "step-5"  # the newest, the one a resume takes
    edit_json(d / "config.json", lambda c: c.update({key: value}))
    resign(d)
    p = resume((model_dir, data, dst), "--training.steps=6")
    assert p.returncode == 2 and "step-5/config.json" in p.stderr and key in p.stderr, p.stderr[-2000:]


@pytest.fixture(scope="module")
def smollm3(tmp_path_factory):
    """A run of a tiny SmolLM3 model (layers 1 and 3 without RoPE) with its checkpoints."""
    from transformers import SmolLM3Config
    tmp = tmp_path_factory.mktemp("smollm3")
    SmolLM3Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=3, no_rope_layers=[1, 0, 1, 0]).save_pretrained(tmp / "model")
    data = oracle.write_bin(tmp / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    p = run(train_args(tmp / "model", data, tmp / "run"))
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp / "model", data, tmp / "run"


def test_a_checkpoint_of_other_nope_layers_is_refused(smollm3, tmp_path):
    """SmolLM3's no_rope_layers change what a layer computes without changing a tensor's shape:
    a checkpoint whose config.json moves a NoPE layer must not load into the model."""
    model_dir, data, out = smollm3
    dst = tmp_path / "run"
    shutil.copytree(out, dst)
    d = dst / "checkpoint" / "step-5"
    edit_json(d / "config.json", lambda c: c.update({"no_rope_layers": [1, 1, 0, 0]}))
    resign(d)
    p = resume((model_dir, data, dst), "--training.steps=6")
    assert p.returncode == 2 and "step-5/config.json" in p.stderr and "no_rope_layers" in p.stderr, p.stderr[-2000:]


@pytest.mark.parametrize("flag,key", [
    ("--training.freeze=model.embed_tokens.weight", "training.freeze"),
    ("--lora.rank=2", "lora.rank"),
])
def test_a_changed_trained_set_is_named_not_called_damage(copy, flag, key):
    p = resume(copy, "--training.steps=6", flag)
    assert p.returncode == 2, p.stderr[-2000:]
    assert key in p.stderr and "config.toml" in p.stderr and "unexpected tensor" not in p.stderr, p.stderr[-2000:]


def flip_byte(path: Path):
    b = bytearray(path.read_bytes())
    b[-9] ^= 0x10
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("how", ["generate", "import", "initial_load", "export"])
def test_every_reader_of_a_checkpoint_checks_its_manifest(copy, tmp_path, how):
    """generate, import and initial_load_path read a step-N as an HF directory: they took a
    damaged one as intact (import even wrote it out freshly checksummed)."""
    model_dir, data, out = copy
    d = out / "checkpoint" / "step-4"
    flip_byte(d / "model.safetensors")
    if how == "generate":
        p = run(["generate", "--checkpoint", d, "--prompt-ids", "1 2", "--ids"])
    elif how == "import":
        p = run(["import", "--hf", d, "--out", tmp_path / "imp"])
        assert not (tmp_path / "imp" / "step-0").exists()
    elif how == "export":
        p = run(["export", "--checkpoint", d, "--out", tmp_path / "exp"])
    else:
        p = run(train_args(model_dir, data, tmp_path / "new", f"--checkpoint.initial_load_path={d}",
                           "--checkpoint.initial_load_in_hf=true", "--training.steps=1"))
    assert p.returncode == 3, p.stderr[-2000:]
    assert "step-4/model.safetensors: checksum mismatch" in p.stderr, p.stderr[-2000:]


def test_a_step_name_ctitan_does_not_write_is_not_a_checkpoint(copy):
    """step-04 was listed as step 4 and then looked for as step-4 ("missing")."""
    ck = copy[2] / "checkpoint"
    (ck / "step-4").rename(ck / "step-04")
    shutil.rmtree(ck / "step-5")
    p = resume(copy, "--training.steps=3")
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"resuming from {ck}/step-2 (step 2)" in p.stderr, p.stderr[-2000:]
    assert "step-04" not in p.stderr
    assert (ck / "step-04").is_dir() and not verify(ck / "step-04")


def test_warmup_longer_than_the_run_is_cut_to_it(base, tmp_path):
    """torchtitan's build_lr_schedulers: warmup_steps > steps warns and warms up over the
    run; uncut, 3 steps of a 100-step warmup never came near the peak lr."""
    tmp, model_dir, data, _ = base
    out = tmp_path / "run"
    args = [a for a in train_args(model_dir, data, out) if not a.startswith(("--lr_scheduler", "--training.steps"))]
    p = run(args + ["--training.steps=3", "--lr_scheduler.warmup_steps=100", "--checkpoint.enable=false"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "warmup_steps (100) exceeds training.steps (3)" in p.stderr, p.stderr[-2000:]
    lrs = [r["lr"] for r in oracle.read_metrics(out / "metrics.jsonl") if "lr" in r]
    want = [3e-3 * f for f in (1 / 3, 2 / 3, 1.0)]
    assert np.allclose(lrs, want, rtol=1e-6), (lrs, want)


def test_dry_run_checks_the_kernels_and_names_the_command_line(copy):
    model_dir, data, out = copy
    for dry in ([], ["--dry-run"]):
        p = run(train_args(model_dir, data, out, "--kernels.matmul=nosuch") + dry)
        assert p.returncode == 2, (dry, p.stderr[-2000:])
        assert "command line: [kernels]" in p.stderr and "nosuch" in p.stderr, (dry, p.stderr[-2000:])
