"""ctitan's datasets and `ctitan prepare` against Hugging Face.

Expected values come from HF only: `tokenizers.Tokenizer.encode(doc).ids`
plus the EOS id for text and JSONL documents, and for chat data
`transformers.AutoTokenizer.apply_chat_template` (the rendered text with the
ChatML template; the ids, and the assistant mask through
`return_assistant_tokens_mask` with the same template wrapped in
`{% generation %}`).

The tokenizer is a small byte-level BPE trained here by HF `tokenizers` with
Qwen's pipeline (NFC, Split(Qwen regex, Isolated) + ByteLevel, ByteLevel
decoder) and the special tokens <|endoftext|>, <|im_start|>, <|im_end|>.

The CLI under test is build/ctitan (or $CTITAN_BIN) when it has the `prepare`
command (after `make all`); otherwise a driver is compiled from the sources. The loader is driven through ctypes from a library compiled from the
sources in a tmp dir (as tests/py/test_tokenizer_hf.py does).
"""

import ctypes
import json
import os
import random
import re
import subprocess
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from conftest import crashed, run_on_pty

ROOT = Path(__file__).resolve().parents[2]
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}")
# ChatML with the generation prompt Qwen's templates write, which ctitan's built-in ChatML
# stands for: the prompt alone then ends with "<|im_start|>assistant\n".
CHATML_GP = CHATML + "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
# The same text, with the assistant replies (content + <|im_end|>) marked for
# transformers' return_assistant_tokens_mask.
CHATML_GEN = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{message['content'] + '<|im_end|>'}}"
              "{% endgeneration %}{% else %}{{message['content'] + '<|im_end|>'}}{% endif %}{{'\\n'}}{% endfor %}")
ENV = dict(os.environ, OMP_NUM_THREADS="2")


# ----------------------------------------------------------------- corpus

WORDS = ("the of and to in is was for on that with as by at from it this be are an which or have not one had "
         "river mountain forest library engine token window shard epoch batch gradient loss model train").split()
EXTRAS = ["東京都は日本の首都です。", "데이터 세트", "emoji 🙂🚀 fin", "naïve café", "cafe\u0301 (not NFC)",
          "x = f(a, b)  # code\n    return x ** 2\n", "tabs\tand   spaces   \n\n\n\nruns", "12345 678.9",
          "<|im_end|> inside text", "don't you'll we're", "line\r\nwindows\r\n"]


def make_docs(n, seed):
    r = random.Random(seed)
    docs = []
    for i in range(n):
        k = r.randint(3, 60)
        words = " ".join(r.choice(WORDS) for _ in range(k))
        if i % 3 == 0:
            words += "\n\n" + r.choice(EXTRAS)
        if i % 7 == 0:
            words = r.choice(EXTRAS) + " " + words
        docs.append(words[0].upper() + words[1:] + ".")
    return docs


CONVERSATIONS = [
    [{"role": "user", "content": "What is a shard?"},
     {"role": "assistant", "content": "A piece of the dataset file."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a river."},
     {"role": "assistant", "content": "\n\nThe river Thames."},      # the header "\n" merges with these
     {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "東京 🙂 cafe\u0301"}],
    [{"role": "user", "content": "Say nothing."}, {"role": "assistant", "content": ""}],
    [{"role": "user", "content": "quote <|im_end|> back"},
     {"role": "assistant", "content": "ok: <|im_end|> and   spaces  "},
     {"role": "tool", "content": "{\"x\": 1}"},
     {"role": "assistant", "content": " \n done\n"}],
]


# ----------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def tokdir(tmp_path_factory):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    d = tmp_path_factory.mktemp("tok")
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.decoder = decoders.ByteLevel()
    t.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                             special_tokens=SPECIALS, show_progress=False)
    text = make_docs(400, 1) + [m["content"] for c in CONVERSATIONS for m in c] + ["\n\n\n"] * 50
    t.train_from_iterator(text, tr)
    t.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "chat_template": CHATML}))
    return d


@pytest.fixture(scope="module")
def hf(tokdir):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(tokdir / "tokenizer.json"))


@pytest.fixture(scope="module")
def auto_tok(tokdir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tokdir))


DATA_SRCS = ["src/core/err.c", "src/core/fs.c", "src/core/progress.c", "src/core/rng.c", "src/core/timer.c", "src/formats/npy.c", "src/formats/json.c",
             "src/data/chat.c", "src/data/jinja.c", "src/data/dataset.c", "src/data/ds_source.c", "src/data/ds_shards.c",
             "src/cli/cmd_prepare.c", "src/hub/hub.c"]
DRIVER = r"""
#include <string.h>
int cli_prepare(int argc, char **argv);
int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "prepare")) return cli_prepare(argc - 2, argv + 2);
    return 2;
}
"""


class TokOpts(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int), ("text_split", ctypes.c_int), ("text_field", ctypes.c_char_p),
                ("eos_id", ctypes.c_int32), ("encode_special", ctypes.c_int), ("threads", ctypes.c_int),
                ("chunk_bytes", ctypes.c_size_t), ("chat_template", ctypes.c_char_p),
                ("tokenizer_dir", ctypes.c_char_p), ("template_seen", ctypes.c_void_p),
                ("assistant_only_loss", ctypes.c_int), ("completion_only_loss", ctypes.c_int)]


class DsConfig(ctypes.Structure):
    _fields_ = [("seq_len", ctypes.c_int), ("vocab_size", ctypes.c_int), ("shuffle", ctypes.c_int),
                ("seed", ctypes.c_uint64), ("rank", ctypes.c_int), ("world", ctypes.c_int), ("quiet", ctypes.c_int),
                ("tok", TokOpts), ("tokenizer_dir", ctypes.c_char_p), ("seq_key", ctypes.c_char_p)]


class Err(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * 1024), ("all_ranks", ctypes.c_int)]


class ChatMsg(ctypes.Structure):
    _fields_ = [("role", ctypes.c_char_p), ("role_len", ctypes.c_size_t),
                ("content", ctypes.c_char_p), ("content_len", ctypes.c_size_t)]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(library for ctypes, argv prefix of the prepare command)."""
    d = tmp_path_factory.mktemp("ds_build")
    srcs = [str(ROOT / s) for s in DATA_SRCS] + sorted(str(p) for p in (ROOT / "src/tokenizer").glob("*.c"))
    so = d / "libds_test.so"
    flags = ["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-D_GNU_SOURCE", "-fPIC", "-fopenmp",
             "-I" + str(ROOT / "src")]
    libs = ["-lcjson", "-lpcre2-8", "-lutf8proc", "-lcurl", "-lm", "-fopenmp"]
    # the C side's sizes and offsets, so that the ctypes mirrors above are checked against
    # the structs they copy (test_ctypes_mirrors_match_the_c_structs)
    (d / "layout.c").write_text(
        '#include <stddef.h>\n#include "data/dataset.h"\n'
        "size_t layout_ds_config(int i) {\n"
        "    const size_t v[] = {sizeof(ds_config), offsetof(ds_config, tok), sizeof(ds_tok_opts),\n"
        "                        offsetof(ds_config, tokenizer_dir)};\n"
        "    return v[i];\n}\n")
    subprocess.run(["gcc", *flags, "-shared", *srcs, str(d / "layout.c"), "-o", str(so), *libs], check=True)
    lib = ctypes.CDLL(str(so))
    lib.layout_ds_config.restype = ctypes.c_size_t
    lib.layout_ds_config.argtypes = [ctypes.c_int]
    vp = ctypes.c_void_p
    lib.tok_load.argtypes = [ctypes.c_char_p, ctypes.POINTER(vp), ctypes.POINTER(Err)]
    lib.tok_free.argtypes = [vp]
    lib.ds_config_default.argtypes = [ctypes.POINTER(DsConfig)]
    lib.ds_open.argtypes = [ctypes.POINTER(vp), ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, vp,
                            ctypes.POINTER(DsConfig), ctypes.POINTER(Err)]
    lib.ds_close.argtypes = [vp]
    lib.ds_next.argtypes = [vp, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int32), ctypes.c_int]
    lib.ds_num_windows.restype = ctypes.c_uint64
    lib.ds_num_windows.argtypes = [vp]
    lib.chat_render.argtypes = [ctypes.POINTER(ChatMsg), ctypes.c_int, ctypes.POINTER(vp),
                                ctypes.POINTER(ctypes.c_size_t)]
    lib.free.argtypes = [vp]

    binary = Path(os.environ.get("CTITAN_BIN", ROOT / "build" / "ctitan"))
    if binary.exists() and subprocess.run([str(binary), "prepare", "--help"], capture_output=True).returncode == 0:
        cmd = [str(binary), "prepare"]
    else:
        (d / "main.c").write_text(DRIVER)
        exe = d / "ctitan_prepare"
        subprocess.run(["gcc", *flags, str(d / "main.c"), "-o", str(exe), f"-L{d}", "-lds_test",
                        f"-Wl,-rpath,{d}", *libs], check=True)
        cmd = [str(exe), "prepare"]
    return lib, cmd


def test_ctypes_mirrors_match_the_c_structs(built):
    """ds_config_default writes a whole ds_config into the Python buffer: a mirror that
    lacks a field (it lacked template_seen) is written past its end, and the fields after
    the gap are read at the wrong offsets."""
    lib = built[0]
    assert [lib.layout_ds_config(i) for i in range(4)] == [
        ctypes.sizeof(DsConfig), DsConfig.tok.offset, ctypes.sizeof(TokOpts), DsConfig.tokenizer_dir.offset]


def prepare(built, tokdir, inputs, out, *extra, check=True):
    cmd = built[1] + ["--tokenizer", str(tokdir), "--out", str(out)]
    for i in inputs:
        cmd += ["--input", str(i)]
    p = subprocess.run(cmd + [str(x) for x in extra], capture_output=True, text=True, env=ENV, timeout=120)
    crashed(p.returncode, p.stderr, cmd)
    if check and p.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stderr}", pytrace=False)
    return p


def read_shards(out):
    meta = json.loads((out / "meta.json").read_text())
    toks, masks = [], []
    for s in meta["shards"]:
        t = np.fromfile(out / s["file"], dtype="<u4")
        assert len(t) == s["tokens"]
        toks.append(t)
        if "mask" in s:
            masks.append(np.fromfile(out / s["mask"], dtype=np.uint8))
    tok = np.concatenate(toks) if toks else np.zeros(0, np.uint32)
    mask = np.concatenate(masks) if masks else None
    return meta, tok, mask


def first_diff(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def assert_stream(got, want, what):
    got, want = list(map(int, got)), list(map(int, want))
    if got != want:
        i = first_diff(got, want)
        pytest.fail(f"{what}: {len(got)} tokens vs HF {len(want)}; first difference at {i}: "
                    f"{got[max(0, i - 3):i + 5]} vs {want[max(0, i - 3):i + 5]}", pytrace=False)


def paragraphs(text):
    """Documents of --text-split paragraph, by the rule of docs/data.md."""
    out, cur = [], []
    for line in text.split("\n"):
        if line.strip(" \t\r\f\v") == "":
            if cur:
                out.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    if cur:
        out.append("\n".join(cur))
    return [p[:-1] if p.endswith("\r") else p for p in out]


def open_loader(lib, paths, seq_len, tok=None, **kw):
    cfg = DsConfig()
    lib.ds_config_default(ctypes.byref(cfg))
    cfg.seq_len = seq_len
    cfg.quiet = 1
    for k, v in kw.items():
        setattr(cfg, k, v)
    arr = (ctypes.c_char_p * len(paths))(*[str(p).encode() for p in paths])
    d, err = ctypes.c_void_p(), Err()
    rc = lib.ds_open(ctypes.byref(d), arr, len(paths), tok, ctypes.byref(cfg), ctypes.byref(err))
    assert rc == 0, err.msg.decode()
    return d


def load_tok(lib, tokdir):
    t, err = ctypes.c_void_p(), Err()
    assert lib.tok_load(str(tokdir).encode(), ctypes.byref(t), ctypes.byref(err)) == 0, err.msg.decode()
    return t


def next_batch(lib, d, B, T):
    inp = np.zeros((B, T), np.int32)
    lab = np.zeros((B, T), np.int32)
    lib.ds_next(d, inp.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)),
                lab.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), B)
    return inp, lab


def expected_windows(stream, mask, T):
    """torchtitan packing, labels -100 where the target's mask is 0."""
    n = len(stream) // (T + 1)
    w = np.asarray(stream[:n * (T + 1)], np.int64).reshape(n, T + 1)
    lab = w[:, 1:].copy()
    if mask is not None:
        m = np.asarray(mask[:n * (T + 1)]).reshape(n, T + 1)[:, 1:]
        lab[m == 0] = -100
    return w[:, :-1], lab


# ----------------------------------------------------------------- tests

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    docs = make_docs(3000, 2)                       # about 1 MB: several tokenization chunks
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(docs)]
    lines.insert(5, "")                             # blank line: not a document
    lines.insert(9, json.dumps({"text": ""}))       # empty document: skipped
    (d / "c4.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    book = "\n\n".join(make_docs(40, 3)) + "\n \t\n\n" + EXTRAS[-1] + "last paragraph\n"
    (d / "book.txt").write_bytes(book.encode())
    return d, docs, book


def test_text_and_jsonl_match_hf(built, tokdir, hf, corpus, tmp_path):
    d, docs, book = corpus
    eos = hf.token_to_id("<|endoftext|>")
    out = tmp_path / "out"
    p = prepare(built, tokdir, [d / "c4.jsonl", d / "book.txt"], out, "--shard-tokens", 100003)
    want = []
    for t in docs + [book]:
        want += hf.encode(t).ids + [eos]
    meta, tok, mask = read_shards(out)
    assert_stream(tok, want, "c4.jsonl + book.txt")
    assert mask is None and not list(out.glob("*.mask")), "text data has no mask"
    assert len(meta["shards"]) == -(-len(want) // 100003) > 1
    assert meta["total_tokens"] == len(want) and meta["documents"] == len(docs) + 1
    assert meta["skipped_documents"] == 1 and meta["eos_id"] == eos and meta["kind"] == "mixed"
    assert meta["vocab_size"] == hf.get_vocab_size() and meta["masked"] is False
    assert "tok/s" in p.stderr and f"{len(docs) + 1} documents" in p.stderr

    # paragraphs and lines of a text file
    out2 = tmp_path / "para"
    prepare(built, tokdir, [d / "book.txt"], out2, "--text-split", "paragraph")
    paras = paragraphs(book)
    assert len(paras) > 42
    assert_stream(read_shards(out2)[1], [i for t in paras for i in hf.encode(t).ids + [eos]], "paragraphs")
    out3 = tmp_path / "lines"
    prepare(built, tokdir, [d / "book.txt"], out3, "--text-split=line", "--kind=text")
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in book.split("\n")]
    lines = [ln for ln in lines if ln.strip(" \t\r\f\v")]
    assert_stream(read_shards(out3)[1], [i for t in lines for i in hf.encode(t).ids + [eos]], "lines")


def test_threads_give_identical_output(built, tokdir, corpus, tmp_path):
    d, _, _ = corpus
    outs = []
    for n in (1, 2):
        out = tmp_path / f"t{n}"
        p = prepare(built, tokdir, [d / "c4.jsonl", d / "book.txt"], out, "--threads", n, "--shard-tokens", 50000)
        assert f"on {n} threads" in p.stderr
        outs.append(out)
    names = sorted(f.name for f in outs[0].iterdir())
    assert names == sorted(f.name for f in outs[1].iterdir()) and len(names) > 3
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), f"{name} differs between 1 and 2 threads"


def test_chat_render_tokens_and_mask(built, tokdir, hf, auto_tok, tmp_path):
    lib, _ = built
    # the template renders byte for byte what transformers renders
    for conv in CONVERSATIONS:
        want = auto_tok.apply_chat_template(conv, tokenize=False)
        assert auto_tok.apply_chat_template(conv, tokenize=False, chat_template=CHATML_GEN) == want
        enc = [(m["role"].encode(), m["content"].encode()) for m in conv]
        msgs = (ChatMsg * len(conv))(*[ChatMsg(r, len(r), c, len(c)) for r, c in enc])
        out, n = ctypes.c_void_p(), ctypes.c_size_t()
        lib.chat_render(msgs, len(conv), ctypes.byref(out), ctypes.byref(n))
        got = ctypes.string_at(out, n.value)
        lib.free(out)
        assert got == want.encode(), f"render differs:\n{got!r}\n{want!r}"

    # tokens and mask: HF ids + EOS; assistant_masks + 0 for the EOS
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "chat_out"
    prepare(built, tokdir, [path], out, "--shard-tokens", 61)
    meta, tok, mask = read_shards(out)
    eos = hf.token_to_id("<|endoftext|>")
    want_ids, want_mask, straddle = [], [], False
    for conv in CONVERSATIONS:
        o = auto_tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                         chat_template=CHATML_GEN)
        assert o["input_ids"] == hf.encode(auto_tok.apply_chat_template(conv, tokenize=False)).ids
        want_ids += o["input_ids"] + [eos]
        want_mask += o["assistant_masks"] + [0]
        straddle |= any(o["assistant_masks"][i] and hf.decode([t]).startswith("\n\n")
                        for i, t in enumerate(o["input_ids"]))
    assert straddle, "the corpus must exercise a token crossing the assistant header/content boundary"
    assert meta["kind"] == "chat" and meta["masked"] is True and len(meta["shards"]) > 1
    assert_stream(tok, want_ids, "chat tokens")
    assert_stream(mask, want_mask, "chat mask")
    assert meta["trainable_tokens"] == sum(want_mask)

    # the loader turns the mask into -100 labels, windows across shards
    T = 13
    d = open_loader(lib, [out], T)
    n = lib.ds_num_windows(d)
    inp, lab = next_batch(lib, d, n, T)
    lib.ds_close(d)
    wi, wl = expected_windows(want_ids, want_mask, T)
    assert n == len(wi) and (inp == wi).all() and (lab == wl).all()


def test_loader_tokenizes_text_like_hf(built, tokdir, hf, corpus):
    lib, _ = built
    d, docs, book = corpus
    eos = hf.token_to_id("<|endoftext|>")
    stream = [i for t in docs for i in hf.encode(t).ids + [eos]]
    t = load_tok(lib, tokdir)
    T = 64
    ds = open_loader(lib, [d / "c4.jsonl"], T, t, vocab_size=hf.get_vocab_size())
    n = lib.ds_num_windows(ds)
    inp, lab = next_batch(lib, ds, n, T)
    lib.ds_close(ds)
    lib.tok_free(t)
    wi, wl = expected_windows(stream, None, T)
    assert n == len(wi) and (inp == wi).all() and (lab == wl).all()


def test_errors_name_file_and_line(built, tokdir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "fine"\n')
    p = prepare(built, tokdir, [bad], tmp_path / "o1", check=False)
    assert p.returncode == 3 and f"{bad}:2: invalid JSON" in p.stderr, p.stderr
    chat = tmp_path / "c.jsonl"
    chat.write_text('{"messages": [{"role": "user", "content": "a"}]}\n{"messages": [{"role": "user"}]}\n')
    p = prepare(built, tokdir, [chat], tmp_path / "o2", check=False)
    assert p.returncode == 3 and f"{chat}:2: messages[0].content: missing" in p.stderr, p.stderr
    p = prepare(built, tokdir, [chat], tmp_path / "o3", "--kind", "jsonl", check=False)
    assert p.returncode == 3 and f'{chat}:1: "text" field missing' in p.stderr, p.stderr
    p = prepare(built, tokdir, [tmp_path / "nope.txt"], tmp_path / "o4", check=False)
    assert p.returncode == 1 and "nope.txt" in p.stderr
    p = prepare(built, tokdir, [bad], tmp_path / "o5", "--bogus", "1", check=False)
    assert p.returncode == 2 and "--bogus" in p.stderr
    p = prepare(built, tokdir, [bad], tmp_path / "o6", "--kind", "tokens", check=False)
    assert p.returncode == 2 and "--kind" in p.stderr
    good = tmp_path / "good.txt"
    good.write_text("hello")
    prepare(built, tokdir, [good], tmp_path / "o7")
    p = prepare(built, tokdir, [good], tmp_path / "o7", check=False)
    assert p.returncode == 2 and "--overwrite" in p.stderr
    prepare(built, tokdir, [good], tmp_path / "o7", "--overwrite")


def test_progress_bar_on_a_terminal(built, tokdir, corpus, tmp_path):
    d, _, _ = corpus
    cmd = built[1] + ["--tokenizer", str(tokdir), "--input", str(d / "c4.jsonl"), "--out", str(tmp_path / "o")]
    rc, text = run_on_pty(cmd, env=ENV, timeout=60)
    assert rc == 0, text
    # core/progress.h's bar: bytes of input, then prepare's document and token rates
    assert re.search(r"\rctitan: prepare \[#{24}\] 100\.0%\s+[\d.]+ \S*B / [\d.]+ \S*B\s+[\d.]+ \S*B/s\s+done in "
                     r"[\d.]+s\s+\S+ docs/s, \S+ tok/s", text), text
    assert "documents" in text.splitlines()[-1]
    # and plain lines without a terminal: no carriage returns
    p = prepare(built, tokdir, [d / "c4.jsonl"], tmp_path / "o2")
    assert "\r" not in p.stderr and "ctitan: prepare:" in p.stderr


def test_nfc_expectation_is_real(hf):
    """Guard for the corpus: the non-NFC text really changes under NFC (so the
    equality above covers normalization)."""
    s = "cafe\u0301"
    assert unicodedata.normalize("NFC", s) != s
    assert hf.encode(s).ids == hf.encode(unicodedata.normalize("NFC", s)).ids


def test_template_tokenizer_documents_match_hf(built, corpus, tmp_path):
    """A tokenizer whose template adds <s> (Mistral 7B / Llama 2 / Phi-3 pipeline): each
    document is HF's encode(doc).ids (the <s> included), then EOS, for text and JSONL."""
    from test_tokenizer_families import build_mistral
    from tokenizer_corpus import corpus as tok_corpus
    d, docs, _ = corpus
    tok = tmp_path / "tok"
    tok.mkdir()
    hf = build_mistral(tok_corpus(seed=2, target_bytes=150_000))
    hf.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    sub = docs[:400]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in sub) + "\n", encoding="utf-8")
    out = tmp_path / "out"
    prepare(built, tok, [tmp_path / "c.jsonl"], out)
    eos = hf.token_to_id("</s>")
    want = [i for t in sub for i in hf.encode(t).ids + [eos]]
    assert want[0] == hf.token_to_id("<s>")
    assert_stream(read_shards(out)[1], want, "c.jsonl with a <s> template")


def test_chat_with_template_tokenizer_has_no_bos_per_turn(built, tmp_path):
    """A ChatML conversation with a Llama 3-style tokenizer (template "<|begin_of_text|> $A"):
    the rendered text is tokenized as apply_chat_template does it, add_special_tokens=False,
    so no <|begin_of_text|> before each turn."""
    from test_tokenizer_families import build_llama3
    from tokenizer_corpus import corpus as tok_corpus
    tok = tmp_path / "tok"
    tok.mkdir()
    hf, _ = build_llama3(tok_corpus(seed=3, target_bytes=150_000))
    hf.save(str(tok / "tokenizer.json"))
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    out = tmp_path / "out"
    prepare(built, tok, [path], out)
    eos = hf.token_to_id("<|endoftext|>")
    want = []
    for conv in CONVERSATIONS:
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)
        want += hf.encode(text, add_special_tokens=False).ids + [eos]
    assert hf.token_to_id("<|begin_of_text|>") not in want
    assert_stream(read_shards(out)[1], want, "chat tokens with a template tokenizer")
