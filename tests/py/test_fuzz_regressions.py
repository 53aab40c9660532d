"""Bugs the fuzz targets (tests/fuzz, docs/reliability.md "Fuzzing") and the hostile-input
probe of issue 17 found in the readers of outside files, each fed to the CLI as a file.

JSON from outside (tokenizer.json here; config.json, the safetensors index, the manifest,
adapter_config.json and state.json share the reader, src/formats/json.c) is held to the JSON
grammar: outside strings only space, tab, CR and LF; no raw byte below 0x20 inside a string;
nothing after the value. cJSON skipped every byte <= 32 as whitespace, so ctitan loaded
files that Python's json and Hugging Face's tokenizers (serde_json) refuse. The verdicts are
compared with json.loads and with tokenizers itself, never with ctitan's own output."""
import json

import pytest
from tokenizers import Tokenizer

# A tiny BPE tokenizer.json: "ab" encodes to [2] through the one merge.
BL = '{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}'
GOOD = ('{"version": "1.0", "added_tokens": [], "normalizer": null,'
        ' "pre_tokenizer": ' + BL.replace('"use_regex": false', '"use_regex": true') + ','
        ' "post_processor": null, "decoder": ' + BL + ','
        ' "model": {"type": "BPE", "dropout": null, "unk_token": null, "fuse_unk": false,'
        ' "byte_fallback": false, "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}}\n')
# where a byte goes: between two tokens (after the "model" key's colon), inside a string
# value, after the whole value
AT_TOKENS = GOOD.index('"model":') + len('"model":')
AT_STRING = GOOD.index('"BPE"') + 2
AT_END = len(GOOD) - 1


def tokenize(run_ctitan, d):
    return run_ctitan(["tokenize", "--tokenizer", d, "--text", "ab"], check=False)


def write(tmp_path, text: bytes):
    d = tmp_path / "tok"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.json").write_bytes(text)
    return d


def test_good_file_is_the_baseline(run_ctitan, tmp_path):
    d = write(tmp_path, GOOD.encode())
    want = Tokenizer.from_str(GOOD).encode("ab").ids
    rc, out, err = tokenize(run_ctitan, d)
    assert rc == 0 and [int(x) for x in out.split()] == want == [2], err


def test_control_byte_between_tokens_exits_3(run_ctitan, tmp_path):
    bad = GOOD[:AT_TOKENS] + "\x0b" + GOOD[AT_TOKENS:]
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad)
    with pytest.raises(Exception):
        Tokenizer.from_str(bad)
    d = write(tmp_path, bad.encode())
    rc, out, err = tokenize(run_ctitan, d)
    assert rc == 3, (rc, err)
    assert f"{d / 'tokenizer.json'}" in err and f"byte {AT_TOKENS}" in err and "0x0b" in err, err


CASES = [(AT_TOKENS, b) for b in (0x00, 0x01, 0x0b, 0x0c, 0x1c, 0x1f, 0x09, 0x0a, 0x0d, 0x20)] + \
        [(AT_STRING, b) for b in (0x00, 0x01, 0x09, 0x0a)] + \
        [(AT_END, b) for b in (0x00, 0x0c, 0x0a, 0x7b)]


@pytest.mark.parametrize("at,byte", CASES, ids=[f"{a}-{b:#04x}" for a, b in CASES])
def test_verdict_matches_python_json(run_ctitan, tmp_path, at, byte):
    text = GOOD[:at] + chr(byte) + GOOD[at:]
    try:
        json.loads(text)
        python_ok = True
    except json.JSONDecodeError:
        python_ok = False
    d = write(tmp_path, text.encode())
    rc, out, err = tokenize(run_ctitan, d)
    assert rc in (0, 3), (rc, err)
    assert (rc == 0) == python_ok, f"json.loads {'accepts' if python_ok else 'rejects'}, ctitan exit {rc}: {err}"
    if rc:
        assert str(d / "tokenizer.json") in err, err
