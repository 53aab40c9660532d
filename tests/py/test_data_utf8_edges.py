"""A text source's UTF-8 check at the edges of the encoding (the ninth mutation audit).

test_data_binary_sources tries compressed files and one lone lead byte; reading a lone
continuation byte 0x80 as ASCII passed all of it. The oracle is Python's decoder
(`bytes.decode("utf-8")`, as HF's text loader reads a file): each ill-formed sequence below
must be refused (exit 3) at the line and byte offset where Python's error starts, and each
well-formed boundary character must prepare."""
import pytest

from test_data_hf import tokdir  # noqa: F401  (fixture)

BAD = {  # the Unicode standard's table 3-7, from each side of its ranges
    "lone_80": b"\x80", "lone_bf": b"\xbf", "overlong_c0": b"\xc0\x80", "overlong_c1": b"\xc1\xbf",
    "overlong_e0": b"\xe0\x9f\xbf", "surrogate_ed": b"\xed\xa0\x80", "overlong_f0": b"\xf0\x8f\xbf\xbf",
    "past_10ffff": b"\xf4\x90\x80\x80", "lead_f5": b"\xf5\x80\x80\x80", "lead_ff": b"\xff",
    "cut_3byte": b"\xe2\x82 x", "cut_at_end": b"\xe2\x82",
}
GOOD = "\u0080 \u07ff \u0800 \ud7ff \ue000 \uffff \U00010000 \U0010ffff"


def _prepare(run_ctitan, tokdir, src, out):  # noqa: F811
    return run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out, "--quiet"], check=False)


@pytest.mark.parametrize("name", list(BAD))
def test_ill_formed_sequences_refused_where_python_refuses(name, tokdir, run_ctitan, tmp_path):  # noqa: F811
    raw = b"first line\nsecond \xc3\xa9 line\nthird " + BAD[name] + (b"" if name == "cut_at_end" else b" end\n")
    with pytest.raises(UnicodeDecodeError) as exc:
        raw.decode("utf-8")
    line, at = raw[:exc.value.start].count(b"\n") + 1, exc.value.start
    assert line == 3
    src = tmp_path / "t.txt"
    src.write_bytes(raw)
    rc, _, err = _prepare(run_ctitan, tokdir, src, tmp_path / "out")
    assert rc == 3 and f"{src}:{line}:" in err and f"byte 0x{raw[at]:02x} at offset {at})" in err, err


def test_boundary_characters_prepare(tokdir, run_ctitan, tmp_path):  # noqa: F811
    src = tmp_path / "ok.txt"
    src.write_bytes(("a\n" + GOOD + "\n").encode("utf-8"))
    rc, _, err = _prepare(run_ctitan, tokdir, src, tmp_path / "out")
    assert rc == 0, err
