"""A data file that is not UTF-8 text must not be trained on as text.

`training.dataset = "auto"` reads any file whose first line is not a JSON object as plain
text (docs/data.md, "Sources": "plain UTF-8 text files"). The files a Hugging Face or
torchtitan user has at hand are often not text: c4 ships as `.json.gz`, the Hub's datasets
as Parquet, `datasets.save_to_disk` writes Arrow. The byte-level tokenizer encodes any
bytes, so such a file used to train (and prepare) on its compressed bytes, exit 0.

The oracle is Python's own reading of a text file, as HF's text loader does it
(`open(path, encoding="utf-8")`): bytes that `bytes.decode("utf-8")` refuses are an error,
at the line where the first ill-formed byte is. So ctitan must exit 3 (a malformed input
file, docs/reliability.md) naming the file and that line; for the compressed and columnar
formats the message also says what the file looks like.
"""
import gzip
import json
import shutil

import pytest

import oracle
from test_data_hf import make_docs, tokdir  # noqa: F401  (fixture)


def docs_jsonl():
    return "".join(json.dumps({"text": t}) + "\n" for t in make_docs(60, 4)).encode()


def python_utf8_error_line(raw: bytes) -> int:
    """The 1-based line of the first byte Python's UTF-8 decoder refuses."""
    with pytest.raises(UnicodeDecodeError) as exc:
        raw.decode("utf-8")
    return raw[:exc.value.start].count(b"\n") + 1


BINARIES = {
    # name: (file name, bytes, what the message must call it)
    "gzip_jsonl": ("c4-train.00000-of-01024.json.gz", lambda: gzip.compress(docs_jsonl(), mtime=0), "gzip"),
    "parquet": ("train-00000-of-00001.parquet",
                lambda: b"PAR1" + bytes(range(0x80, 0x100)) * 8 + b"\x15\x04PAR1", "Parquet"),
    "arrow_stream": ("data-00000-of-00001.arrow", lambda: b"\xff\xff\xff\xff" + bytes(range(256)) * 4, "Arrow"),
}


@pytest.mark.parametrize("name", list(BINARIES))
def test_prepare_refuses_a_binary_file_read_as_text(name, tokdir, run_ctitan, tmp_path):  # noqa: F811
    fname, make, called = BINARIES[name]
    raw = make()
    line = python_utf8_error_line(raw)
    src = tmp_path / fname
    src.write_bytes(raw)
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", tmp_path / "out",
                             "--quiet"], check=False)
    assert rc == 3, err
    assert f"{src}:{line}:" in err and called in err, err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_text_with_ill_formed_utf8_names_the_line(tokdir, run_ctitan, tmp_path):  # noqa: F811
    """Valid lines first (2- and 4-byte characters, CRLF), then a lone lead byte: Python
    refuses it on line 3, and so must ctitan, with every split of the file."""
    raw = "naïve café\r\n🙂 emoji line\n".encode() + b"broken \xc3( here\nlast\n"
    line = python_utf8_error_line(raw)
    assert line == 3
    src = tmp_path / "book.txt"
    src.write_bytes(raw)
    for split in ("file", "paragraph", "line"):
        rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", tmp_path / split,
                                 "--text-split", split, "--quiet"], check=False)
        assert rc == 3 and f"{src}:{line}:" in err, (split, err)


def test_well_formed_text_still_prepares(tokdir, run_ctitan, tmp_path):  # noqa: F811
    """The check refuses nothing Python reads: surrogate-free 4-byte characters, the
    largest code point, a BOM, CRLF."""
    text = "\ufeffBOM first\r\n\U0010FFFF max\n𝄞 clef\n東京\n"
    text.encode().decode("utf-8")
    src = tmp_path / "ok.txt"
    src.write_text(text, encoding="utf-8")
    run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", tmp_path / "out", "--quiet"])
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["total_tokens"] > 0


def test_train_refuses_a_gzipped_jsonl(tokdir, run_ctitan, tmp_path):  # noqa: F811
    """torchtitan's c4 layout, still compressed, given to `train` (auto): exit 3 naming the
    file, before any step is taken or any metrics line written."""
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(tokdir)))
    model = tmp_path / "model"
    oracle.save_random_hf(model, oracle.tiny_config(vocab=vocab, hidden=32, inter=64, layers=1, heads=4,
                                                     kv_heads=2, head_dim=8))
    for f in tokdir.iterdir():
        shutil.copy(f, model / f.name)
    src = tmp_path / "c4-train.00000-of-01024.json.gz"
    src.write_bytes(gzip.compress(docs_jsonl(), mtime=0))
    line = python_utf8_error_line(src.read_bytes())
    rc, out, err = run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={model}",
                               f"--training.dataset_path={src}", "--training.steps=1", "--training.seq_len=16",
                               "--training.local_batch_size=1", "--metrics.peak_tflops=1", "--kernels.tune=false",
                               f"--job.dump_folder={tmp_path / 'run'}"], check=False)
    assert rc == 3, err
    assert f"{src}:{line}:" in err and "gzip" in err, err
    assert "step:" not in out + err
