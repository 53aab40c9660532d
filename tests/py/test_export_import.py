"""`ctitan import` / `ctitan export` against transformers: an HF model saved by
transformers becomes a training checkpoint and comes back as an HF directory that
`AutoModelForCausalLM.from_pretrained` loads with exactly the original weights (float32:
bit for bit; bfloat16: equal to torch's own bf16 rounding), sharded above
--max-shard-size, with the tokenizer files copied. Damaged checkpoints are refused by
name or skipped with a warning; bad usage exits 2.

The binary is build/ctitan (CTITAN_BUILD=DIR picks another build directory). While
main.c does not dispatch export/import yet, a tiny driver calling cli_export/cli_import
is linked against that build's libctitan.a instead."""
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import oracle
from conftest import CHILD_ENV, ROOT, crashed

BUILD = Path(os.environ.get("CTITAN_BUILD", ROOT / "build"))
SHARD = "20KB"  # below the embedding's 32 KB: forces several shards


def _driver(tmp_dir: Path) -> Path:
    lib = BUILD / "libctitan.a"
    if not lib.exists():
        pytest.fail(f"{lib} is missing: run `make all` first", pytrace=False)
    src = tmp_dir / "driver.c"
    src.write_text(
        "#include <string.h>\n#include <stdio.h>\n"
        "int cli_export(int, char **); int cli_import(int, char **);\n"
        "int main(int argc, char **argv) {\n"
        "  if (argc >= 2 && !strcmp(argv[1], \"export\")) return cli_export(argc - 2, argv + 2);\n"
        "  if (argc >= 2 && !strcmp(argv[1], \"import\")) return cli_import(argc - 2, argv + 2);\n"
        "  fprintf(stderr, \"driver: export | import\\n\"); return 2;\n}\n")
    exe = tmp_dir / "ctitan_ei"
    blas = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
    cmd = ["gcc", "-o", str(exe), str(src), str(lib), f"-L{blas}", f"-Wl,-rpath,{blas}", "-lopenblas", "-lcjson",
           "-lpcre2-8", "-lutf8proc", "-lm", "-fopenmp"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"linking the export/import driver failed:\n{p.stderr[-3000:]}", pytrace=False)
    return exe


@pytest.fixture(scope="module")
def ei_bin(tmp_path_factory) -> Path:
    exe = BUILD / "ctitan"
    if exe.exists():
        p = subprocess.run([str(exe), "export", "--help"], capture_output=True, text=True, env=CHILD_ENV)
        if p.returncode == 0 and "--checkpoint" in p.stdout:
            return exe
    return _driver(tmp_path_factory.mktemp("driver"))


@pytest.fixture
def run(ei_bin):
    """run(args, expect=0) -> (stdout, stderr); fails the test on another exit code."""

    def _run(args, expect=0):
        cmd = [str(ei_bin)] + [str(a) for a in args]
        p = subprocess.run(cmd, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=120)
        crashed(p.returncode, p.stderr, cmd)
        assert p.returncode == expect, (f"exit {p.returncode}, expected {expect}: {' '.join(cmd)}\n"
                                        f"--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
        return p.stdout, p.stderr

    return _run


def write_tokenizer(d: Path) -> dict:
    """tokenizer.json written by HF `tokenizers`, plus two JSON side files; returns their bytes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    d.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, "<|endoftext|>": 1, "hello": 2, "world": 3}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "model_max_length": 64}))
    (d / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return {n: (d / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")}


def make_hf(d: Path, seed: int, tied: bool):
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=5e6, tied=tied)
    model = oracle.save_random_hf(d, cfg, seed=seed)  # float32, one file
    return model, write_tokenizer(d)


def state_of(model) -> dict:
    return {k: v.detach().clone() for k, v in oracle.param_dict(model).items()}


def assert_same_weights(loaded, want: dict, what: str):
    got = oracle.param_dict(loaded)
    assert set(got) == set(want), f"{what}: names differ: {set(got) ^ set(want)}"
    for k, v in want.items():
        assert got[k].dtype == v.dtype, f"{what}: {k} is {got[k].dtype}, expected {v.dtype}"
        assert torch.equal(got[k], v), f"{what}: {k} differs (max |d| {(got[k].float() - v.float()).abs().max()})"


@pytest.mark.parametrize("tied", [False, True])
def test_import_export_round_trip(tmp_path, run, tied):
    src = tmp_path / "hf_src"
    model, tok = make_hf(src, seed=11, tied=tied)
    orig = state_of(model)
    ck = tmp_path / "ckpt"
    run(["import", "--hf", src, "--out", ck])

    step = ck / "step-0"
    man = json.loads((step / "manifest.json").read_text())
    assert man["format"] == "ctitan-checkpoint" and man["step"] == 0 and man["model_only"] is True, man
    assert {"model.safetensors", "config.json"} <= set(man["files"]), man["files"]
    assert not (step / "optim.safetensors").exists()
    for n, f in man["files"].items():
        assert (step / n).stat().st_size == f["bytes"], n
    # the checkpoint itself holds every parameter by HF name in fp32, untouched
    stored = load_file(str(step / "model.safetensors"))
    expect_names = oracle.expected_tensor_names(model)
    assert set(stored) == expect_names, set(stored) ^ expect_names
    for k, v in stored.items():
        assert v.dtype == torch.float32 and torch.equal(v, orig[k]), k

    # float32, forced into shards; tokenizer found through the checkpoint's config.toml
    out32 = tmp_path / "hf32"
    stdout, _ = run(["export", "--checkpoint", step, "--out", out32, "--max-shard-size", SHARD])
    idx = out32 / "model.safetensors.index.json"
    assert idx.exists(), f"no index: {sorted(p.name for p in out32.iterdir())}"
    shards = oracle.hf_files(out32)
    assert len(shards) >= 2, shards
    assert all(s.stat().st_size <= 20000 + 33000 for s in shards)  # a shard overflows only by one tensor
    assert oracle.hf_dtypes(out32) == {"F32"}
    assert_same_weights(oracle.load_hf(out32, dtype=torch.float32), orig, "float32 export")
    for n, b in tok.items():
        assert (out32 / n).read_bytes() == b, f"{n} not copied verbatim"
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(out32 / "tokenizer.json")).encode("hello world").ids == [2, 3]

    # bfloat16: the same rounding as torch's .to(torch.bfloat16)
    out16 = tmp_path / "hf16"
    run(["export", "--checkpoint", step, "--out", out16, "--dtype", "bfloat16", "--max-shard-size=20000"])
    assert oracle.hf_dtypes(out16) == {"BF16"}
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert len(oracle.hf_files(out16)) >= 2
    want16 = {k: v.to(torch.bfloat16) for k, v in orig.items()}
    assert_same_weights(oracle.load_hf(out16, dtype=torch.bfloat16), want16, "bfloat16 export")

    # without a size limit in reach: one file, no index
    out1 = tmp_path / "hf_one"
    run(["export", "--checkpoint", step, "--out", out1])
    assert (out1 / "model.safetensors").exists() and not (out1 / "model.safetensors.index.json").exists()
    assert_same_weights(oracle.load_hf(out1), orig, "single-file export")


def test_folder_selection_and_damage(tmp_path, run):
    a, _ = make_hf(tmp_path / "hf_a", seed=21, tied=False)
    b, _ = make_hf(tmp_path / "hf_b", seed=22, tied=False)
    ck = tmp_path / "ckpt"
    run(["import", "--hf", tmp_path / "hf_a", "--out", ck])
    run(["import", "--hf", tmp_path / "hf_b", "--out", ck, "--step", "7"])
    tok = tmp_path / "tok_only"
    tok_bytes = write_tokenizer(tok)

    # a folder means its newest valid step; --tokenizer overrides config.toml
    out = tmp_path / "out_b"
    run(["export", "--checkpoint", ck, "--out", out, "--tokenizer", tok])
    assert_same_weights(oracle.load_hf(out), state_of(b), "newest step of the folder")
    assert (out / "tokenizer.json").read_bytes() == tok_bytes["tokenizer.json"]

    # damage step-7: the folder falls back to step-0 with a warning naming the file
    f = ck / "step-7" / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    out = tmp_path / "out_a"
    _, err = run(["export", "--checkpoint", ck, "--out", out])
    assert "warning" in err and "step-7/model.safetensors" in err and "checksum mismatch" in err, err
    assert_same_weights(oracle.load_hf(out), state_of(a), "fallback to step-0")

    # the damaged step named directly is an error, never a fallback: a format error, exit 3
    # as train gives (docs/reliability.md's table)
    _, err = run(["export", "--checkpoint", ck / "step-7", "--out", tmp_path / "never"], expect=3)
    assert "step-7/model.safetensors" in err and "checksum mismatch" in err, err
    assert not (tmp_path / "never" / "config.json").exists()

    # truncation likewise
    f = ck / "step-0" / "config.json"
    f.write_bytes(f.read_bytes()[:-1])
    _, err = run(["export", "--checkpoint", ck / "step-0", "--out", tmp_path / "never"], expect=3)
    assert "step-0/config.json" in err, err

    # no manifest: not a checkpoint
    (ck / "step-0" / "manifest.json").unlink()
    _, err = run(["export", "--checkpoint", ck / "step-0", "--out", tmp_path / "never"], expect=1)
    assert "manifest.json" in err, err


def test_usage_errors(tmp_path, run):
    make_hf(tmp_path / "hf", seed=31, tied=True)
    ck = tmp_path / "ckpt"
    run(["import", "--hf", tmp_path / "hf", "--out", ck])
    step = ck / "step-0"
    cases = [
        (["export", "--checkpoint", step], 2, "--out"),
        (["export", "--out", tmp_path / "o"], 2, "--checkpoint"),
        (["export", "--checkpoint", step, "--out", tmp_path / "o", "--dtype", "fp8"], 2, "--dtype"),
        (["export", "--checkpoint", step, "--out", tmp_path / "o", "--max-shard-size", "lots"], 2,
         "--max-shard-size"),
        (["export", "--checkpoint", step, "--out", tmp_path / "o", "--bogus", "1"], 2, "--bogus"),
        (["export", "--checkpoint", step, "--out", step], 2, "--out"),
        (["export", "--checkpoint", tmp_path / "nope", "--out", tmp_path / "o"], 1, "nope"),
        (["export", "--checkpoint", step, "--out", tmp_path / "o", "--tokenizer", tmp_path / "nope"], 1,
         "--tokenizer"),
        (["import", "--hf", tmp_path / "hf"], 2, "--out"),
        (["import", "--hf", tmp_path / "hf", "--out", ck, "--step", "-1"], 2, "--step"),
        (["import", "--hf", tmp_path / "hf", "--out", ck], 1, "step-0: already exists"),
        (["import", "--hf", tmp_path / "nope", "--out", ck, "--step", "1"], 1, "nope"),
        (["import", "--hf", tmp_path, "--out", ck, "--step", "1"], 1, "config.json"),
    ]
    for args, code, needle in cases:
        _, err = run(args, expect=code)
        assert needle in err, f"{args}: stderr does not name {needle!r}: {err}"
    assert not (ck / "step-1").exists()
    assert sorted(p.name for p in ck.iterdir()) == ["step-0"], "a failed import left files behind"
    out, _ = run(["export", "--help"])
    assert "--max-shard-size" in out and "--tokenizer" in out
    out, _ = run(["import", "--help"])
    assert "--hf" in out and "--step" in out


def test_import_help_names_every_family(run):
    """import --help said "Hugging Face Qwen3 model directory"; it imports every family
    docs/families.md lists (model_type in its first table's first column), and Hub ids."""
    text = (ROOT / "docs" / "families.md").read_text()
    table = text[text.index("| model_type |"):]
    table = table[:table.index("\n\n")]
    types = re.findall(r"^\| `([a-z0-9_]+)` \|", table, re.M)
    assert len(types) >= 9 and "qwen3" in types and "gemma3_text" in types, types
    out, _ = run(["import", "--help"])
    hf = next(ln for ln in out.splitlines() if ln.lstrip().startswith("--hf"))
    assert "Qwen3 model directory" not in hf and "Hub id" in hf, hf
    missing = [t for t in types if not re.search(rf"\b{t}\b", hf)]
    assert not missing, (missing, hf)
