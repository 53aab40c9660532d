"""Hostile files end to end (issue 17, part 2 and the file bugs of part 5).

Real files written by transformers / safetensors / tokenizers are mutated one way each
(truncated, a bit flipped, a value out of range or of the wrong type, keys that disagree)
and the CLI is run on them. Every case checks the EXACT exit code of its kind
(docs/reliability.md, "Exit codes": 1 runtime, 2 config, 3 format) and that stderr names
the file and the key, tensor or line at fault; the run_ctitan fixture fails any case whose
process crashed (signal, abort, sanitizer report) whatever the code.

The expected codes are decided in docs/reliability.md, "Hostile files". Where transformers
or HF tokenizers has a say (a tied lm_head beside its tensor, a broken merges list or
regex) the test asks the installed library too, so the expectation is not ctitan's own.
"""
from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

import oracle

L = 16
V = 128
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


# --------------------------------------------------------------------------- files

def _cfg():
    return oracle.tiny_config(vocab=V, hidden=32, inter=64, layers=1, heads=4, kv_heads=2, head_dim=16)


def _tokenizer(d: Path):
    """A small Qwen-style byte-level BPE (a Split regex, then ByteLevel) saved to d."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["the quick brown fox jumps over the lazy dog, hello world"] * 20, trainer)
    d.mkdir(parents=True)
    tk.save(str(d / "tokenizer.json"))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """Unmutated files, written once: one-file and sharded HF dirs, a tokenizer, tokens."""
    root = tmp_path_factory.mktemp("pristine")
    cfg = _cfg()
    oracle.save_random_hf(root / "hf", cfg, seed=41)
    oracle.save_random_hf(root / "hf_sharded", cfg, seed=41, max_shard_size="20KB")
    assert (root / "hf_sharded" / "model.safetensors.index.json").exists()
    _tokenizer(root / "tok")
    oracle.write_bin(root / "d.bin", oracle.random_tokens(4 * (L + 1), V, seed=7))
    return root


class Case:
    """One run on mutated copies: hf (one file), shards (sharded dir), tok, data, conf."""

    def __init__(self, pristine, tmp: Path):
        self.tmp = tmp
        self.hf = tmp / "hf"
        self.shards = tmp / "hf_sharded"
        self.tok = tmp / "tok"
        for name in ("hf", "hf_sharded", "tok"):
            shutil.copytree(pristine / name, tmp / name)
        self.data = pristine / "d.bin"
        self.model = self.hf  # the dir the command is pointed at
        self.sections = oracle.train_sections(tmp / "out", self.data, self.hf, steps=1, seq_len=L)
        self.toml_text = None  # a TOML written verbatim instead of the sections
        self.gen_args = ["--prompt-ids", "1 2 3", "--max-tokens", "2"]

    @property
    def st(self) -> Path:
        return self.model / "model.safetensors"

    @property
    def config_json(self) -> Path:
        return self.model / "config.json"

    def use_shards(self):
        self.model = self.shards
        self.sections["model"]["hf_assets_path"] = str(self.shards)
        self.sections["checkpoint"]["initial_load_path"] = str(self.shards)

    def conf(self) -> Path:
        p = self.tmp / "run.toml"
        if self.toml_text is not None:
            p.write_bytes(self.toml_text if isinstance(self.toml_text, bytes) else self.toml_text.encode())
        else:
            oracle.write_toml(p, self.sections)
        return p

    def edit_config(self, **kv):
        c = json.loads(self.config_json.read_text())
        for k, v in kv.items():
            if v is DELETE:
                c.pop(k, None)
            else:
                c[k] = v
        self.config_json.write_text(json.dumps(c))

    def header(self):
        b = self.st.read_bytes()
        (n,) = struct.unpack("<Q", b[:8])
        return b, n, json.loads(b[8:8 + n])

    def rewrite_header(self, fn):
        """fn(header dict) edits the header; data unchanged (the header keeps its padding rule)."""
        b, n, h = self.header()
        fn(h)
        oracle.write_safetensors_raw(self.st, h, b[8 + n:])

    def tensor_offset(self, name):
        b, n, h = self.header()
        return 8 + n + h[name]["data_offsets"][0]

    def poke(self, pos, fn):
        b = bytearray(self.st.read_bytes())
        b[pos] = fn(b[pos])
        self.st.write_bytes(bytes(b))


DELETE = object()
DOWN = "model.layers.0.mlp.down_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"
NORM = "model.norm.weight"


def _set_f32(c: Case, name, index, value):
    """Writes one float32 element of a tensor in place (the rest of the file unchanged)."""
    pos = c.tensor_offset(name) + 4 * index
    b = bytearray(c.st.read_bytes())
    b[pos:pos + 4] = struct.pack("<f", value)
    c.st.write_bytes(bytes(b))


# ---- safetensors: truncated and bit-flipped

def st_truncated_data(c):
    b = c.st.read_bytes()
    c.st.write_bytes(b[:-1000])
    _, n, h = c.header()
    buf = len(b) - 1000 - 8 - n
    first = next(k for k, v in h.items() if k != "__metadata__" and v["data_offsets"][1] > buf)
    return [first, "truncated"]


def st_truncated_header(c):
    b, n, _ = c.header()
    c.st.write_bytes(b[:8 + n // 2])
    return ["runs past the end of the file"]


def st_truncated_length(c):
    c.st.write_bytes(c.st.read_bytes()[:5])
    return ["too short"]


def st_flip_length_high(c):
    c.poke(6, lambda x: x ^ 0x01)  # bit 48 of the header length
    return ["header length"]


def st_flip_length_low(c):
    c.poke(0, lambda x: x ^ 0x08)  # the length moves by 8: JSON cut short or data bytes read as JSON
    return ["header"]


def st_flip_json_brace(c):
    c.poke(8, lambda x: x ^ 0x01)  # '{' -> 'z'
    return ["not valid JSON"]


def st_flip_dtype(c):
    b, n, h = c.header()
    at = b.index(b'"F32"', 8)
    c.poke(at + 2, lambda x: x ^ 0x01)  # "F32" -> "F22"
    tensor = next(k for k, v in json.loads(c.st.read_bytes()[8:8 + n]).items()
                  if k != "__metadata__" and v["dtype"] == "F22")
    return [tensor, "F22"]


def st_flip_shape(c):
    c.rewrite_header(lambda h: h[NORM].update(shape=[33]))  # '2' -> '3'
    return [NORM, "data_offsets span"]


def st_flip_offset(c):
    def f(h):
        a, z = h[NORM]["data_offsets"]
        h[NORM]["data_offsets"] = [a, z + 1]
    c.rewrite_header(f)
    return [NORM]


def st_nan_weight(c):
    _set_f32(c, DOWN, 5, float("nan"))
    return [DOWN, "non-finite"]


def st_inf_weight(c):
    _set_f32(c, DOWN, 7, float("-inf"))
    return [DOWN, "non-finite"]


def st_exponent_flip_to_nan(c):
    """The bit flip that makes a weight non-finite: its exponent bits all set."""
    pos = c.tensor_offset(NORM) + 4 * 3
    b = bytearray(c.st.read_bytes())
    b[pos + 3] |= 0x7F
    b[pos + 2] |= 0x80
    c.st.write_bytes(bytes(b))
    return [NORM, "non-finite"]


def st_mantissa_flip(c):
    """A flipped low mantissa bit is a valid (slightly different) weight: trains."""
    pos = c.tensor_offset(DOWN) + 4 * 9
    c.poke(pos, lambda x: x ^ 0x01)
    return []


def st_float_offsets(c):
    """Offsets written as floats ("[212864.0, 212992.0]"): the safetensors library wants a usize."""
    def f(h):
        a, z = h[NORM]["data_offsets"]
        h[NORM]["data_offsets"] = [float(a), float(z)]
    c.rewrite_header(f)
    return [NORM, "data_offsets[0]", "float"]


def st_float_shape(c):
    c.rewrite_header(lambda h: h[NORM].update(shape=[float(x) for x in h[NORM]["shape"]]))
    return [NORM, "shape[0]", "float"]


# ---- safetensors: dtypes, shapes, tensors against config.json

def st_dtype_unreadable(c):
    c.rewrite_header(lambda h: h[GATE].update(dtype="I32"))  # same size: the file itself is valid
    return [GATE, "I32"]


def st_dtype_size_mismatch(c):
    c.rewrite_header(lambda h: h[GATE].update(dtype="BF16"))  # bytes are 2x what BF16 x shape needs
    return [GATE, "BF16"]


def st_shape_transposed(c):
    c.rewrite_header(lambda h: h[GATE].update(shape=h[GATE]["shape"][::-1]))
    return [GATE, "[32, 64]", "[64, 32]"]


def _resave(c, fn):
    from safetensors.torch import load_file, save_file
    t = load_file(str(c.st))
    fn(t)
    save_file(t, str(c.st), metadata={"format": "pt"})


def st_missing_tensor(c):
    _resave(c, lambda t: t.pop(GATE))
    return [GATE, "missing"]


def st_extra_tensor(c):
    import torch
    _resave(c, lambda t: t.__setitem__("model.layers.0.mlp.bogus.weight", torch.zeros(4)))
    return ["model.layers.0.mlp.bogus.weight", "unexpected"]


def cfg_head_dim_disagrees(c):
    c.edit_config(head_dim=8)  # the q/k/v tensors are for head_dim 16
    return ["q_proj", "shape"]


def cfg_intermediate_disagrees(c):
    c.edit_config(intermediate_size=48)
    return ["gate_proj", "[64, 32]", "[48, 32]"]


def cfg_vocab_disagrees(c):
    c.edit_config(vocab_size=V + 2)
    return ["embed_tokens", "shape"]


# ---- sharded index

def _index(c):
    p = c.model / "model.safetensors.index.json"
    return p, json.loads(p.read_text())


def idx_parent_dir(c):
    c.use_shards()
    p, idx = _index(c)
    idx["weight_map"][NORM] = "../x.safetensors"
    p.write_text(json.dumps(idx))
    return [str(p), NORM, "../x.safetensors"]


def idx_absolute(c):
    c.use_shards()
    p, idx = _index(c)
    idx["weight_map"][NORM] = str(c.st)  # a real safetensors file, outside the directory
    p.write_text(json.dumps(idx))
    return [str(p), NORM]


def idx_missing_shard(c):
    c.use_shards()
    p, idx = _index(c)
    idx["weight_map"][NORM] = "model-00099-of-00099.safetensors"
    p.write_text(json.dumps(idx))
    return ["model-00099-of-00099.safetensors"]


def idx_deleted_shard(c):
    c.use_shards()
    p, idx = _index(c)
    shard = idx["weight_map"][NORM]
    (c.model / shard).unlink()
    return [shard]


def idx_not_json(c):
    c.use_shards()
    p, _ = _index(c)
    p.write_text('{"weight_map": {')
    return [str(p)]


# ---- config.json values

def cfg(**kv):
    def f(c):
        c.edit_config(**kv)
        return []
    f.__name__ = "cfg_" + "_".join(kv)
    return f


def cfg_not_json(c):
    c.config_json.write_text('{"model_type": "qwen3", "hidden_size": 32,')
    return []


def cfg_not_object(c):
    c.config_json.write_text("[1, 2, 3]")
    return []


def cfg_duplicate_key(c):
    """vocab_size twice: Python keeps the last, cJSON would find the first; refused."""
    t = c.config_json.read_text()
    assert t.startswith("{")
    c.config_json.write_text('{"vocab_size": 64, ' + t[1:])
    return ['duplicate key "vocab_size"']


def cfg_bad_utf8(c):
    """A truncated UTF-8 sequence in a string (Python reading the file as UTF-8 refuses it)."""
    t = c.config_json.read_bytes()
    at = t.index(b'"qwen3"') + 1
    c.config_json.write_bytes(t[:at] + b"\xc3" + t[at:])
    return ["UTF-8", f"at byte {at}"]


def cfg_bad_utf8_surrogate(c):
    """A surrogate encoded in UTF-8 (ED A0 80): not UTF-8 for Python's file reading or serde_json."""
    t = c.config_json.read_bytes()
    at = t.index(b'"qwen3"') + 1
    c.config_json.write_bytes(t[:at] + b"\xed\xa0\x80" + t[at:])
    return ["UTF-8", f"at byte {at}"]


def cfg_tied_with_lm_head(c):
    """tie_word_embeddings true, and the file's lm_head.weight (an untied model's) differs from
    the embedding: transformers then loads them untied (test_transformers_unties_a_different_head)."""
    c.edit_config(tie_word_embeddings=True)
    return ["lm_head.weight", "tie_word_embeddings"]


def cfg_tied_with_equal_lm_head(c):
    """The same, but lm_head.weight is a copy of the embedding: one tied matrix either way."""
    c.edit_config(tie_word_embeddings=True)
    _resave(c, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    return []


# ---- tokenizer.json

def _edit_tok(c, fn):
    p = c.tok / "tokenizer.json"
    j = json.loads(p.read_text())
    fn(j)
    p.write_text(json.dumps(j))


def tok_merge_unknown_token(c):
    def f(j):
        m = j["model"]["merges"]
        m[0] = ["zq", "qz"] if isinstance(m[0], list) else "zq qz"
    _edit_tok(c, f)
    return ["merges", "zq"]


def tok_merge_wrong_type(c):
    _edit_tok(c, lambda j: j["model"]["merges"].__setitem__(0, 5))
    return ["merges"]


def tok_merge_one_element(c):
    _edit_tok(c, lambda j: j["model"]["merges"].__setitem__(0, ["t"]))
    return ["merges"]


def tok_regex_broken(c):
    def f(j):
        j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(?i:'s|'t"
    _edit_tok(c, f)
    return ["pre_tokenizer pattern", "missing closing parenthesis"]


def tok_bad_utf8(c):
    """An overlong sequence (C0 AF, a '/') inside a vocab key."""
    p = c.tok / "tokenizer.json"
    t = p.read_bytes()
    at = t.index(b'"', t.index(b"{", t.index(b'"vocab"'))) + 1
    p.write_bytes(t[:at] + b"\xc0\xaf" + t[at:])
    return ["UTF-8", f"at byte {at}"]


def tok_not_json(c):
    (c.tok / "tokenizer.json").write_text('{"model": {"type": "BPE", ')
    return []


def tok_vocab_id_float(c):
    """A vocab id written as a float ("5.0"): cJSON reads 5, HF tokenizers refuses it
    ("invalid type: floating point `5.0`, expected u32")."""
    key = [None]

    def f(j):
        v = j["model"]["vocab"]
        key[0] = next(k for k, i in v.items() if i == 5)
        v[key[0]] = 5.0
    _edit_tok(c, f)
    return [f'model.vocab[{json.dumps(key[0])}]', "integer id", "5.0"]


def tok_added_id_float(c):
    """added_tokens[0].id written in exponent form: a float for serde as for Python."""
    def f(j):
        j["added_tokens"] = [{"id": V, "content": "<|x|>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True}]
    _edit_tok(c, f)
    p = c.tok / "tokenizer.json"
    t = p.read_text()
    assert t.count(f'"id": {V},') == 1
    p.write_text(t.replace(f'"id": {V},', f'"id": {V / 100}e2,'))
    return ["added_tokens[0].id", "integer id", f"{float(V)}"]


# ---- TOML

def _line_of(text: bytes, needle: bytes) -> int:
    return text[:text.index(needle)].count(b"\n") + 1


def _toml_text(c, old: bytes, new: bytes) -> bytes:
    """The run's valid TOML with one exact piece replaced; it becomes the file the run reads."""
    base = c.tmp / "base.toml"
    oracle.write_toml(base, c.sections)
    t = base.read_bytes()
    assert t.count(old) == 1, f"test setup: {old!r} is not once in the TOML"
    c.toml_text = t.replace(old, new)
    return c.toml_text


def toml_nul_in_value(c):
    t = _toml_text(c, b"\nseq_len = 16\n", b"\nseq_len = 3\x00 2\n")
    return [f"run.toml:{_line_of(t, b'seq_len')}", "0x00"]


def toml_nul_ends_value(c):
    """`seq_len = 16<NUL>`: the NUL once ended the C string the number was read from, so
    the line read as 16 and the run went on."""
    t = _toml_text(c, b"\nseq_len = 16\n", b"\nseq_len = 16\x00\n")
    return [f"run.toml:{_line_of(t, b'seq_len')}", "0x00"]


def toml_ctrl_in_value(c):
    t = _toml_text(c, b"\nsteps = 1\n", b"\nsteps = 1\x01\n")
    line = _line_of(t, b"\nsteps = ") + 1
    return [f"run.toml:{line}", "0x01"]


def toml_ctrl_in_string(c):
    t = _toml_text(c, b'\ndump_folder = "', b'\ndump_folder = "\x07')
    return [f"run.toml:{_line_of(t, b'dump_folder')}", "0x07"]


def toml_duplicate_key(c):
    t = _toml_text(c, b"\nsteps = 1\n", b"\nsteps = 1\nsteps = 2\n")
    line = _line_of(t, b"\nsteps = 2") + 1
    return [f"run.toml:{line}", "duplicate key 'steps'"]


def toml_duplicate_table(c):
    t = _toml_text(c, b"\nsteps = 1\n", b"\nsteps = 1\n\n[training]\nsteps = 2\n")
    return [f"run.toml:{_line_of(t, b'steps = 2') - 1}", "table [training] defined twice"]


# ---- checkpoint manifest

def _xxh3(b: bytes) -> str:
    import ctypes
    x = ctypes.CDLL("libxxhash.so.0")
    x.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    x.XXH3_64bits.restype = ctypes.c_uint64
    return "%016x" % x.XXH3_64bits(b, len(b))


def ckpt_step_float(c):
    """A checkpoint (ctitan import of the model) whose manifest says "step": 0.0, re-signed so
    that only the number's form is wrong: ckpt.c writes "%d", so 0.0 is no manifest it wrote."""
    from conftest import BIN, CHILD_ENV, ROOT
    import subprocess
    p = subprocess.run([str(BIN), "import", "--hf", str(c.hf), "--out", str(c.tmp / "ck")], cwd=ROOT,
                       env=CHILD_ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    m = c.tmp / "ck" / "step-0" / "manifest.json"
    t = m.read_text()
    body = t[:t.index('"manifest_xxh3_64": "') + len('"manifest_xxh3_64": "')]
    assert body.count('"step": 0,') == 1
    body = body.replace('"step": 0,', '"step": 0.0,')
    m.write_text(body + _xxh3(body.encode()) + '"\n}\n')
    c.model = c.tmp / "ck" / "step-0"
    return [str(m), '"step"']


def opts(**kv):
    """Sets [section] key = value in the run's TOML ("section__key" names)."""
    def f(c):
        for k, v in kv.items():
            sec, key = k.split("__")
            c.sections.setdefault(sec, {})[key] = v
        return []
    f.__name__ = "opts_" + "_".join(kv)
    return f


def batch_by_width(c):
    """B x T fits an int, but times the layers' widths the activations would pass 2^50 floats."""
    c.edit_config(intermediate_size=2 ** 22)
    c.sections["training"].update(local_batch_size=2 ** 15, global_batch_size=2 ** 15, seq_len=2 ** 15)
    c.sections["checkpoint"] = {}  # the weights no longer fit the config; a dry run reads none
    return []


def data_dir_empty(c):
    d = c.tmp / "empty_data"
    d.mkdir()
    c.sections["training"]["dataset_path"] = str(d)
    return [str(d)]


# ---- generate

def gen_max_tokens_past_positions(c):
    c.gen_args = ["--prompt-ids", "1 2 3", "--max-tokens", "300"]  # 303 > max_position_embeddings 256
    return ["--max-tokens", "256"]


def gen_max_tokens_yarn_extends(c):
    # yarn factor 4 over 256 original positions: 1024 positions (transformers' and vLLM's reading)
    c.edit_config(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                   "original_max_position_embeddings": 256})
    c.gen_args = ["--prompt-ids", "1 2 3", "--max-tokens", "300"]
    return []


def gen_max_tokens_yarn_past_extension(c):
    gen_max_tokens_yarn_extends(c)
    c.gen_args = ["--prompt-ids", "1 2 3", "--max-tokens", "1100"]
    return ["--max-tokens", "1024"]


def gen_logits_overflow(c):
    """Finite weights whose logits overflow fp32: lm_head rows of 3e38."""
    _resave(c, lambda t: t["lm_head.weight"].fill_(3e38))
    return ["non-finite", "logits"]


# --------------------------------------------------------------------------- the table

HF = "{hf}/model.safetensors"
CFG = "{hf}/config.json"
TOK = "{tok}/tokenizer.json"
RUN = "{tmp}/run.toml"
BIG = 2 ** 31

CASES = [
    # (id, mutation, command, exit code, texts stderr must contain beside the mutation's own)
    # safetensors, truncated and bit-flipped: header length, JSON header, data
    ("st-truncated-data", st_truncated_data, "train", 3, [HF]),
    ("st-truncated-data-gen", st_truncated_data, "generate", 3, [HF]),
    ("st-truncated-data-import", st_truncated_data, "import", 3, [HF]),
    ("st-truncated-header", st_truncated_header, "train", 3, [HF]),
    ("st-truncated-length", st_truncated_length, "generate", 3, [HF]),
    ("st-flip-length-high", st_flip_length_high, "train", 3, [HF]),
    ("st-flip-length-low", st_flip_length_low, "train", 3, [HF]),
    ("st-flip-json-brace", st_flip_json_brace, "train", 3, [HF]),
    ("st-flip-dtype", st_flip_dtype, "train", 3, [HF]),
    ("st-flip-shape", st_flip_shape, "generate", 3, [HF]),
    ("st-flip-offset", st_flip_offset, "train", 3, [HF]),
    ("st-data-nan", st_nan_weight, "train", 3, [HF]),
    ("st-data-nan-gen", st_nan_weight, "generate", 3, [HF]),
    ("st-data-nan-import", st_nan_weight, "import", 3, [HF]),
    ("st-data-inf", st_inf_weight, "generate", 3, [HF]),
    ("st-data-exponent-flip", st_exponent_flip_to_nan, "train", 3, [HF]),
    ("st-data-mantissa-flip", st_mantissa_flip, "train", 0, []),
    ("st-float-offsets", st_float_offsets, "train", 3, [HF]),
    ("st-float-shape", st_float_shape, "generate", 3, [HF]),
    # dtypes and shapes against config.json
    ("st-dtype-unreadable", st_dtype_unreadable, "train", 3, [HF]),
    ("st-dtype-size-mismatch", st_dtype_size_mismatch, "train", 3, [HF]),
    ("st-shape-transposed", st_shape_transposed, "generate", 3, [HF]),
    ("st-missing-tensor", st_missing_tensor, "train", 3, []),
    ("st-extra-tensor", st_extra_tensor, "train", 3, [HF]),
    ("cfg-head-dim-vs-tensors", cfg_head_dim_disagrees, "train", 3, [HF]),
    ("cfg-intermediate-vs-tensors", cfg_intermediate_disagrees, "generate", 3, [HF]),
    ("cfg-vocab-vs-tensors", cfg_vocab_disagrees, "import", 3, [HF]),
    ("cfg-tied-with-different-lm-head", cfg_tied_with_lm_head, "train", 3, [HF]),
    ("cfg-tied-with-different-lm-head-gen", cfg_tied_with_lm_head, "generate", 3, [HF]),
    ("cfg-tied-with-equal-lm-head", cfg_tied_with_equal_lm_head, "generate", 0, []),
    # sharded index
    ("idx-parent-dir", idx_parent_dir, "train", 3, []),
    ("idx-absolute-path", idx_absolute, "generate", 3, []),
    ("idx-missing-shard", idx_missing_shard, "train", 1, []),
    ("idx-deleted-shard", idx_deleted_shard, "import", 1, []),
    ("idx-not-json", idx_not_json, "train", 3, []),
    # config.json: negative, zero and huge sizes
    ("cfg-hidden-negative", cfg(hidden_size=-32), "train", 2, [CFG, "hidden_size"]),
    ("cfg-layers-zero", cfg(num_hidden_layers=0), "train", 2, [CFG, "num_hidden_layers"]),
    ("cfg-heads-zero", cfg(num_attention_heads=0), "generate", 2, [CFG, "num_attention_heads"]),
    ("cfg-kv-heads-negative", cfg(num_key_value_heads=-2), "train", 2, [CFG, "num_key_value_heads"]),
    ("cfg-vocab-zero", cfg(vocab_size=0), "import", 2, [CFG, "vocab_size"]),
    ("cfg-intermediate-negative", cfg(intermediate_size=-1), "train", 2, [CFG, "intermediate_size"]),
    ("cfg-head-dim-zero", cfg(head_dim=0), "train", 2, [CFG, "head_dim"]),
    ("cfg-head-dim-odd", cfg(head_dim=15), "train", 2, [CFG, "head_dim"]),
    ("cfg-hidden-beyond-int", cfg(hidden_size=BIG), "train", 2, [CFG, "hidden_size", "out of range"]),
    ("cfg-vocab-beyond-int", cfg(vocab_size=10 ** 20), "generate", 2, [CFG, "vocab_size", "out of range"]),
    ("cfg-layers-negative-beyond-int", cfg(num_hidden_layers=-BIG - 1), "train", 2,
     [CFG, "num_hidden_layers", "out of range"]),
    ("cfg-layers-huge", cfg(num_hidden_layers=100000), "train", 2, [CFG, "num_hidden_layers"]),
    ("cfg-heads-x-head-dim-overflow", cfg(num_attention_heads=2 ** 27, num_key_value_heads=2 ** 27,
                                          head_dim=32), "train", 2,
     [CFG, "num_attention_heads", "num_key_value_heads", "head_dim", "out of range"]),
    ("cfg-intermediate-fused-overflow", cfg(intermediate_size=2 ** 30 + 2), "generate", 2,
     [CFG, "intermediate_size", "out of range"]),
    ("cfg-intermediate-x-hidden-huge", cfg(intermediate_size=2 ** 29, hidden_size=2 ** 22), "train", 2,
     [CFG, "intermediate_size", "hidden_size", "out of range"]),
    ("cfg-vocab-x-hidden-huge", cfg(vocab_size=2 ** 30, hidden_size=2 ** 21), "import", 2,
     [CFG, "vocab_size", "hidden_size", "out of range"]),
    # config.json: wrong types
    ("cfg-string-for-int", cfg(hidden_size="32"), "train", 2, [CFG, "hidden_size", "integer"]),
    ("cfg-float-for-int", cfg(num_hidden_layers=1.5), "train", 2, [CFG, "num_hidden_layers", "integer"]),
    ("cfg-list-for-int", cfg(vocab_size=[V]), "generate", 2, [CFG, "vocab_size", "integer"]),
    ("cfg-bool-for-int", cfg(num_attention_heads=True), "train", 2, [CFG, "num_attention_heads", "integer"]),
    ("cfg-string-for-bool", cfg(tie_word_embeddings="yes"), "train", 2, [CFG, "tie_word_embeddings"]),
    ("cfg-string-for-float", cfg(rms_norm_eps="small"), "train", 2, [CFG, "rms_norm_eps"]),
    ("cfg-model-type-int", cfg(model_type=3), "train", 2, [CFG, "model_type"]),
    # an integer written as a float: transformers' config classes refuse 32.0 where they declare int
    ("cfg-float-integral-for-int", cfg(hidden_size=32.0), "train", 2, [CFG, '"hidden_size"', "integer", "32.0"]),
    ("cfg-float-integral-for-int-gen", cfg(num_attention_heads=4.0), "generate", 2,
     [CFG, '"num_attention_heads"', "integer", "4.0"]),
    ("cfg-exponent-for-int", cfg(vocab_size=float(V)), "import", 2, [CFG, '"vocab_size"', "integer"]),
    ("cfg-int-for-float-ok", cfg(rms_norm_eps=1), "train", 0, []),  # an int where a float goes: fine, as in Python
    # Gemma3TextConfig declares query_pre_attn_scalar int: transformers refuses 256.0 and 256.5
    ("cfg-gemma-query-scalar-float", cfg(model_type="gemma3_text", rope_parameters=DELETE, query_pre_attn_scalar=256.0), "describe", 2,
     [CFG, '"query_pre_attn_scalar"', "integer", "256.0"]),
    ("cfg-gemma-query-scalar-fraction", cfg(model_type="gemma3_text", rope_parameters=DELETE, query_pre_attn_scalar=256.5), "describe", 2,
     [CFG, '"query_pre_attn_scalar"', "integer"]),
    ("cfg-gemma-query-scalar-int-ok", cfg(model_type="gemma3_text", rope_parameters=DELETE, query_pre_attn_scalar=256), "describe", 0, []),
    # RoPE lengths: an int at the top level, as transformers' config classes declare them;
    # inside the RoPE dict transformers takes 256.0, and so does ctitan
    ("cfg-max-pos-float", cfg(max_position_embeddings=256.0), "describe", 2,
     [CFG, '"max_position_embeddings"', "integer", "256.0"]),
    ("cfg-phi3-orig-max-pos-float", cfg(model_type="phi3", rope_parameters=DELETE,
                                        original_max_position_embeddings=256.0), "describe", 2,
     [CFG, '"original_max_position_embeddings"', "not as a float"]),
    ("cfg-phi3-orig-max-pos-int-ok", cfg(model_type="phi3", rope_parameters=DELETE,
                                         original_max_position_embeddings=256), "describe", 0, []),
    ("cfg-yarn-nested-orig-float-ok", cfg(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                                           "original_max_position_embeddings": 256.0}),
     "describe", 0, []),
    # a layer index past an int: (int) of 1e20 was undefined
    ("cfg-moe-mlp-only-beyond-int", cfg(model_type="qwen3_moe", mlp_only_layers=[0, 10 ** 20]), "describe", 2,
     [CFG, '"mlp_only_layers"', "out of range"]),
    # config.json: conflicting keys, syntax
    ("cfg-kv-not-dividing-heads", cfg(num_key_value_heads=3), "train", 2,
     [CFG, "num_key_value_heads", "num_attention_heads"]),
    ("cfg-not-json", cfg_not_json, "train", 3, [CFG]),
    ("cfg-not-json-gen", cfg_not_json, "generate", 3, [CFG]),
    ("cfg-not-object", cfg_not_object, "train", 3, [CFG]),
    ("cfg-duplicate-key", cfg_duplicate_key, "train", 3, [CFG]),
    ("cfg-duplicate-key-describe", cfg_duplicate_key, "describe", 3, [CFG]),
    ("cfg-bad-utf8", cfg_bad_utf8, "train", 3, [CFG]),
    ("cfg-bad-utf8-surrogate", cfg_bad_utf8_surrogate, "generate", 3, [CFG]),
    ("cfg-not-json-describe", cfg_not_json, "describe", 3, [CFG]),
    ("cfg-hidden-beyond-int-describe", cfg(hidden_size=BIG), "describe", 2, [CFG, "hidden_size", "out of range"]),
    # tokenizer.json
    ("tok-merge-unknown-token", tok_merge_unknown_token, "tokenize", 3, [TOK]),
    ("tok-merge-wrong-type", tok_merge_wrong_type, "tokenize", 3, [TOK]),
    ("tok-merge-one-element", tok_merge_one_element, "tokenize", 3, [TOK]),
    ("tok-regex-broken", tok_regex_broken, "tokenize", 3, [TOK]),
    ("tok-not-json", tok_not_json, "tokenize", 3, [TOK]),
    ("tok-bad-utf8", tok_bad_utf8, "tokenize", 3, [TOK]),
    ("tok-merge-unknown-token-prepare", tok_merge_unknown_token, "prepare", 3, [TOK]),
    ("tok-regex-broken-prepare", tok_regex_broken, "prepare", 3, [TOK]),
    ("tok-merge-wrong-type-gen", tok_merge_wrong_type, "generate-text", 3, [TOK]),
    ("tok-vocab-id-float", tok_vocab_id_float, "tokenize", 3, [TOK]),
    ("tok-added-id-float", tok_added_id_float, "prepare", 3, [TOK]),
    # checkpoint manifest
    ("ckpt-step-float", ckpt_step_float, "export", 3, []),
    # TOML: duplicates, control characters, out-of-range values
    ("toml-duplicate-key", toml_duplicate_key, "train", 2, [RUN]),
    ("toml-duplicate-table", toml_duplicate_table, "train", 2, [RUN]),
    ("toml-nul-in-value", toml_nul_in_value, "train", 2, [RUN]),
    ("toml-nul-in-value-dry", toml_nul_in_value, "dry", 2, [RUN]),
    ("toml-nul-ends-value", toml_nul_ends_value, "train", 2, [RUN]),
    ("toml-ctrl-in-value", toml_ctrl_in_value, "train", 2, [RUN]),
    ("toml-ctrl-in-string", toml_ctrl_in_string, "train", 2, [RUN]),
    ("toml-steps-negative", opts(training__steps=-5), "train", 2, [RUN, "training.steps"]),
    ("toml-seq-len-beyond-int", opts(training__seq_len=2 ** 40), "train", 2, [RUN, "training.seq_len"]),
    ("toml-lr-nan", opts(optimizer__lr=float("nan")), "train", 2, [RUN, "optimizer.lr"]),
    ("toml-batch-x-seq-overflow", opts(training__local_batch_size=65536, training__global_batch_size=65536,
                                       training__seq_len=65536), "train", 2,
     [RUN, "training.local_batch_size", "training.seq_len", "out of range"]),
    ("toml-batch-x-seq-overflow-dry", opts(training__local_batch_size=65536, training__global_batch_size=65536,
                                           training__seq_len=65536), "dry", 2,
     [RUN, "training.local_batch_size", "training.seq_len", "out of range"]),
    ("toml-val-batch-x-seq-overflow", opts(validation__local_batch_size=2 ** 20, training__seq_len=2 ** 12),
     "dry", 2, [RUN, "validation.local_batch_size", "training.seq_len", "out of range"]),
    ("toml-batch-x-seq-x-hidden-dry", opts(training__local_batch_size=2 ** 15, training__global_batch_size=2 ** 15,
                                           training__seq_len=2 ** 15), "dry", 0, []),
    ("toml-batch-x-seq-x-width-dry", batch_by_width, "dry", 2,
     ["training.local_batch_size", "training.seq_len", "intermediate_size", "out of range"]),
    # data
    ("data-dir-without-shards", data_dir_empty, "train", 3, []),
    # generate
    ("gen-max-tokens-past-positions", gen_max_tokens_past_positions, "generate", 2, []),
    ("gen-max-tokens-yarn-extends", gen_max_tokens_yarn_extends, "generate", 0, []),
    ("gen-max-tokens-past-yarn", gen_max_tokens_yarn_past_extension, "generate", 2, []),
    ("gen-logits-overflow", gen_logits_overflow, "generate", 1, []),
]


def _command(c: Case, cmd: str):
    if cmd == "train":
        return ["train", "--config", c.conf()]
    if cmd == "dry":
        return ["train", "--config", c.conf(), "--dry-run"]
    if cmd == "generate":
        return ["generate", "--checkpoint", c.model, "--ids"] + c.gen_args
    if cmd == "import":
        return ["import", "--hf", c.model, "--out", c.tmp / "imported"]
    if cmd == "describe":
        return ["describe", c.model]
    if cmd == "export":
        return ["export", "--checkpoint", c.model, "--out", c.tmp / "exported"]
    if cmd == "tokenize":
        return ["tokenize", "--tokenizer", c.tok, "--text", "hello world, the quick fox"]
    if cmd == "prepare":
        src = c.tmp / "corpus.txt"
        src.write_text("hello world, the quick fox\n")
        return ["prepare", "--tokenizer", c.tok, "--input", src, "--out", c.tmp / "prepared", "--threads", "1"]
    if cmd == "generate-text":
        return ["generate", "--checkpoint", c.model, "--tokenizer", c.tok, "--prompt", "hello", "--max-tokens", "2"]
    raise ValueError(cmd)


@pytest.mark.parametrize("cid,mutate,cmd,code,needles", CASES, ids=[x[0] for x in CASES])
def test_hostile(cid, mutate, cmd, code, needles, pristine, tmp_path, run_ctitan):
    c = Case(pristine, tmp_path)
    own = mutate(c)
    args = _command(c, cmd)
    rc, out, err = run_ctitan(args, check=False)
    assert rc == code, f"{cid}: exit {rc}, want {code}\n--- stderr\n{err[-3000:]}"
    subst = {"hf": str(c.model), "tok": str(c.tok), "tmp": str(tmp_path)}
    flat = err.replace("//", "/")
    for n in [x.format(**subst) for x in needles] + own:
        assert n in flat, f"{cid}: stderr does not name {n!r}\n--- stderr\n{err[-3000:]}"


# --------------------------------------------------------------------------- the libraries' say

TOKENIZER_MUTATIONS = [tok_merge_unknown_token, tok_merge_wrong_type, tok_merge_one_element, tok_regex_broken,
                       tok_not_json, tok_bad_utf8, tok_vocab_id_float, tok_added_id_float]


@pytest.mark.parametrize("mutate", TOKENIZER_MUTATIONS, ids=[f.__name__ for f in TOKENIZER_MUTATIONS])
def test_hf_tokenizers_refuses_too(mutate, pristine, tmp_path):
    """ctitan refuses these tokenizer.json files (exit 3 above); so does HF tokenizers, so a
    refusal is the reference behaviour, not a ctitan choice."""
    from tokenizers import Tokenizer
    c = Case(pristine, tmp_path)
    Tokenizer.from_file(str(c.tok / "tokenizer.json"))  # the unmutated file loads
    mutate(c)
    with pytest.raises(Exception):
        Tokenizer.from_file(str(c.tok / "tokenizer.json"))


def test_transformers_unties_a_different_head(pristine, tmp_path):
    """Why ctitan refuses tie_word_embeddings = true beside a different lm_head.weight: the
    installed transformers then keeps the two apart (an untied model), while with an equal
    copy it ties them. ctitan builds one tied matrix, so it accepts only the equal copy."""
    import torch
    from transformers import AutoModelForCausalLM
    c = Case(pristine, tmp_path)
    cfg_tied_with_lm_head(c)
    m = AutoModelForCausalLM.from_pretrained(str(c.hf), dtype=torch.float32)
    assert not torch.equal(m.lm_head.weight, m.model.embed_tokens.weight), \
        "transformers tied a different lm_head to the embedding: ctitan's refusal no longer matches it"
    cfg_tied_with_equal_lm_head(c)
    m = AutoModelForCausalLM.from_pretrained(str(c.hf), dtype=torch.float32)
    assert torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)


def test_tied_head_differing_only_in_its_last_row(tmp_path, run_ctitan):
    """tie_word_embeddings true beside an lm_head.weight equal to the embedding except one
    element of its last row (element 6117 of 192 x 32, past any first block a check might
    stop at): transformers loads the two untied, as for the wholly different head above (the
    model the files describe is not the tied one config.json names), so ctitan must refuse it
    (exit 3, naming both) like cfg-tied-with-different-lm-head; the equal copy loads."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    cfg = oracle.tiny_config(vocab=192, hidden=32, inter=64, layers=1, heads=4, kv_heads=2, head_dim=16)
    d = tmp_path / "hf"
    oracle.save_random_hf(d, cfg, seed=41)
    conf = json.loads((d / "config.json").read_text())
    conf["tie_word_embeddings"] = True
    (d / "config.json").write_text(json.dumps(conf))
    st = d / "model.safetensors"
    t = load_file(str(st))
    emb = t["model.embed_tokens.weight"]
    assert emb.numel() == 192 * 32 > 4096 + 32
    args = ["generate", "--checkpoint", d, "--ids", "--prompt-ids", "1 2 3", "--max-tokens", "2"]

    t["lm_head.weight"] = emb.clone()
    save_file(t, str(st), metadata={"format": "pt"})
    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    assert torch.equal(m.lm_head.weight, m.model.embed_tokens.weight)
    rc, _, err = run_ctitan(args, check=False)
    assert rc == 0, f"the equal copy: exit {rc}\n{err[-2000:]}"

    head = emb.clone()
    head[-1, 5] += 0.25
    t["lm_head.weight"] = head
    save_file(t, str(st), metadata={"format": "pt"})
    m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    assert not torch.equal(m.lm_head.weight, m.model.embed_tokens.weight), \
        "transformers tied a different lm_head to the embedding: ctitan's refusal no longer matches it"
    assert torch.equal(m.lm_head.weight, head)
    rc, _, err = run_ctitan(args, check=False)
    assert rc == 3, f"exit {rc}, want 3\n--- stderr\n{err[-3000:]}"
    assert "lm_head.weight" in err and "tie_word_embeddings" in err, err[-3000:]


@pytest.mark.parametrize("mutate", [st_float_offsets, st_float_shape], ids=["offsets", "shape"])
def test_safetensors_refuses_float_numbers_too(mutate, pristine, tmp_path):
    """ctitan refuses a header whose offsets or shape are written as floats (exit 3 above); so
    does the safetensors library ("expected usize"): the refusal is the reference's."""
    from safetensors import safe_open
    c = Case(pristine, tmp_path)
    mutate(c)
    with pytest.raises(Exception):
        with safe_open(str(c.st), "np") as f:
            [f.get_tensor(k) for k in f.keys()]


@pytest.mark.parametrize("mutate", [cfg(hidden_size=32.0), cfg_duplicate_key, cfg_bad_utf8,
                                    cfg(model_type="gemma3_text", rope_parameters=DELETE, query_pre_attn_scalar=256.0),
                                    cfg(model_type="gemma3_text", rope_parameters=DELETE, query_pre_attn_scalar=256.5),
                                    cfg(max_position_embeddings=256.0),
                                    cfg(model_type="phi3", rope_parameters=DELETE, original_max_position_embeddings=256.0)],
                         ids=["float-for-int", "duplicate-key", "bad-utf8", "gemma-query-scalar-float",
                              "gemma-query-scalar-fraction", "max-pos-float", "phi3-orig-max-pos-float"])
def test_transformers_refuses_or_rereads_config(mutate, pristine, tmp_path):
    """What transformers makes of ctitan's refused config.json files: 32.0 for an int and bad
    UTF-8 fail to load; a repeated key loads, with the LAST value (cJSON took the first)."""
    from transformers import AutoConfig
    c = Case(pristine, tmp_path)
    mutate(c)
    if mutate is cfg_duplicate_key:
        assert AutoConfig.from_pretrained(str(c.hf)).vocab_size == V  # not 64: the two readers disagreed
    else:
        with pytest.raises(Exception):
            AutoConfig.from_pretrained(str(c.hf))
