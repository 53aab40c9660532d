"""The formats a binary text source is recognised as, beyond test_data_binary_sources'
gzip, Parquet and Arrow stream (the ninth mutation audit: a wrong xz magic passed every
test). Each file is made by Python's own compressor (lzma, bz2, zipfile) or, where the
standard library has none, laid out by its published spec (zstd: RFC 8878's frame magic
0xFD2FB528, little-endian; Arrow's IPC file format: "ARROW1" and two padding bytes). ctitan
must exit 3 at the line Python's UTF-8 decoder refuses and say what the file looks like."""
import bz2
import io
import json
import lzma
import zipfile

import pytest

from test_data_hf import make_docs, tokdir  # noqa: F401  (fixture)


def _docs():
    return "".join(json.dumps({"text": t}) + "\n" for t in make_docs(60, 4)).encode()


def _zip():
    b = io.BytesIO()
    with zipfile.ZipFile(b, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("train.jsonl", _docs())
    return b.getvalue()


FORMATS = {
    "xz": ("train.jsonl.xz", lambda: lzma.compress(_docs(), format=lzma.FORMAT_XZ), "xz-compressed"),
    "bzip2": ("train.jsonl.bz2", lambda: bz2.compress(_docs()), "bzip2-compressed"),
    "zip": ("train.zip", _zip, "a zip archive"),
    "zstd": ("train.jsonl.zst", lambda: (0xFD2FB528).to_bytes(4, "little") + bytes(range(0x80, 0x100)) * 4,
             "zstd-compressed"),
    "arrow_file": ("data.arrow", lambda: b"ARROW1\x00\x00" + bytes(range(0x80, 0x100)) * 4, "Arrow"),
}


@pytest.mark.parametrize("name", list(FORMATS))
def test_binary_format_named(name, tokdir, run_ctitan, tmp_path):  # noqa: F811
    fname, make, called = FORMATS[name]
    raw = make()
    with pytest.raises(UnicodeDecodeError) as exc:
        raw.decode("utf-8")
    line = raw[:exc.value.start].count(b"\n") + 1
    src = tmp_path / fname
    src.write_bytes(raw)
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", tmp_path / "out",
                             "--quiet"], check=False)
    assert rc == 3 and f"{src}:{line}:" in err and f"it looks like {called}" in err, err
