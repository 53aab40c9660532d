#!/usr/bin/env python3
"""Seed corpora for the fuzz targets (tests/fuzz/fuzz_*.c), from the repo's test
data and small files written here: python3's standard library only, so the
seeds need no venv. Usage: fuzz_seeds.py OUTDIR (writes OUTDIR/<target>/...)."""
import glob
import json
import os
import struct
import sys

SEP = b"\n#=#=\n"  # tests/fuzz/fuzz_util.h FZ_SEP: one input, several files
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def put(out, target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors(tensors, meta=None):
    """tensors: [(name, dtype, shape, raw bytes)] laid out in order."""
    hdr, off, blob = {}, 0, b""
    if meta is not None:
        hdr["__metadata__"] = meta
    for name, dt, shape, raw in tensors:
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        off += len(raw)
        blob += raw
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + blob


def npy(descr, shape, raw, version=1, fortran=False):
    d = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (
        descr, "True" if fortran else "False", "(%s)" % "".join("%d," % s for s in shape) if shape else "()")
    pre = 10 if version == 1 else 12
    d = d.encode() + b" " * (-(pre + len(d) + 1) % 64) + b"\n"
    ln = struct.pack("<H", len(d)) if version == 1 else struct.pack("<I", len(d))
    return b"\x93NUMPY" + bytes([version, 0]) + ln + d + raw


def byte_chars():
    """GPT-2's byte-to-character map (what ByteLevel BPE vocabularies use)."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizers():
    bc = byte_chars()
    vocab = {bc[b]: b for b in range(256)}
    conv = lambda s: "".join(bc[b] for b in s.encode())
    merges = [(conv(a), conv(b)) for a, b in [(" ", "t"), ("h", "e"), ("i", "n"), (" ", "a"), (" t", "he")]]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    qwen = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
            "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")
    bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    added = [{"id": len(vocab), "content": "<|endoftext|>", "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True},
             {"id": len(vocab) + 1, "content": "<|im_start|>", "special": True, "normalized": False}]
    qwen_tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
                "normalizer": {"type": "NFC"},
                "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": qwen}, "behavior": "Isolated", "invert": False}, bl]},
                "post_processor": bl, "decoder": bl,
                "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                          "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                          "ignore_merges": False, "vocab": vocab, "merges": [list(m) for m in merges]}}
    gpt2 = json.loads(json.dumps(qwen_tok))
    gpt2["normalizer"] = None
    gpt2["pre_tokenizer"] = dict(bl, use_regex=True)
    gpt2["model"]["merges"] = ["%s %s" % m for m in merges]
    spm = {"version": "1.0", "added_tokens": [
        {"id": 0, "content": "<unk>", "normalized": False, "special": True},
        {"id": 1, "content": "<s>", "normalized": False, "special": True},
        {"id": 2, "content": "</s>", "normalized": False, "special": True}],
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                           {"type": "Replace", "pattern": {"String": " "},
                                                            "content": "\u2581"}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}], "pair": [],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                  "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xC3>": 3, "<0xA9>": 4, "\u2581": 5, "a": 6,
                            "b": 7, "\u2581a": 8, "\u2581ab": 9, "ab": 10},
                  "merges": [["\u2581", "a"], ["\u2581a", "b"], ["a", "b"]]}}
    return {"qwen": qwen_tok, "gpt2": gpt2, "spm": spm}


def main():
    out = sys.argv[1]
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    # safetensors: the dtypes and layouts a checkpoint holds
    put(out, "fuzz_safetensors", "f32", safetensors([("a", "F32", [2, 2], f32)], {"format": "pt"}))
    put(out, "fuzz_safetensors", "mixed", safetensors(
        [("w.weight", "BF16", [2, 3], bytes(12)), ("n", "I64", [1], struct.pack("<q", 7)),
         ("e", "F16", [0], b""), ("b", "U8", [3], b"xyz")]))
    put(out, "fuzz_safetensors", "scalar", safetensors([("s", "F64", [], struct.pack("<d", 0.5))]))
    # the index over the three shards fuzz_st_index.c writes (16 bytes each)
    names = ["model-%05d-of-00003.safetensors" % i for i in (1, 2, 3)]
    put(out, "fuzz_st_index", "index", json.dumps(
        {"metadata": {"total_size": 48}, "weight_map": {"a": names[0], "b.weight": names[1], "c": names[2]}},
        indent=2))
    put(out, "fuzz_st_index", "missing", json.dumps({"weight_map": {"a": names[0], "b.weight": names[1]}}))
    # config.json of every family the repo has
    for p in sorted(glob.glob(os.path.join(ROOT, "tests/data/hf_configs/*.json"))):
        put(out, "fuzz_hf_config", os.path.basename(p), open(p, "rb").read())
    put(out, "fuzz_hf_config", "yarn.json", json.dumps(
        {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
         "max_position_embeddings": 4096, "rope_theta": 10000,
         "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}))
    put(out, "fuzz_hf_config", "longrope.json", json.dumps(
        {"model_type": "phi3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
         "max_position_embeddings": 8192, "original_max_position_embeddings": 1024,
         "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1], "long_factor": [2, 2, 2, 2]}}))
    # TOML: the shipped configs
    for p in sorted(glob.glob(os.path.join(ROOT, "configs/*.toml"))):
        put(out, "fuzz_toml", os.path.basename(p), open(p, "rb").read())
    put(out, "fuzz_toml", "types.toml",
        '[training]\nsteps = 10\nlr = 3e-4 # comment\nshuffle = true\n[parallelism]\n'
        'pipeline_parallel_split_points = ["layers.1", "layers.2"]\n[model]\nname = \'qwen3\'\n'
        'flavor = """debugmodel"""\n')
    put(out, "fuzz_toml", "nested.toml",  # arrays of arrays: module_fqns_per_model_part (a list of lists)
        '[parallelism]\npipeline_parallel_degree = 2\nmodule_fqns_per_model_part = [\n  ["tok_embeddings", '
        '"layers.0"],\n  ["layers.1", "norm", "output"], # last\n]\npipeline_parallel_layers_per_stage = 2\n')
    # tokenizers
    for name, t in tokenizers().items():
        put(out, "fuzz_tokenizer", name + ".json", json.dumps(t, indent=1))
    # tokenizer_config.json and chat templates of the published families
    for p in sorted(glob.glob(os.path.join(ROOT, "tests/data/chat_templates/*/tokenizer_config.json"))):
        fam = os.path.basename(os.path.dirname(p))
        raw = open(p, "rb").read()
        put(out, "fuzz_tokenizer_config", fam + ".json", raw)
        ct = json.loads(raw).get("chat_template")
        if isinstance(ct, list):
            ct = next((c["template"] for c in ct if c.get("name") == "default"), None)
        if isinstance(ct, str):
            put(out, "fuzz_chat_template", fam + ".jinja", ct)
    for p in sorted(glob.glob(os.path.join(ROOT, "tests/data/chat_templates/*/chat_template.jinja"))):
        put(out, "fuzz_chat_template", os.path.basename(os.path.dirname(p)) + "-file.jinja", open(p, "rb").read())
    put(out, "fuzz_tokenizer_config", "plain.json", json.dumps(
        {"bos_token": None, "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": "<|endoftext|>",
         "added_tokens_decoder": {"5": {"content": "<|im_end|>", "special": True}},
         "chat_template": "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}\n{% endfor %}"}))
    # .npy token files
    put(out, "fuzz_npy", "u4", npy("<u4", [4], struct.pack("<4I", 1, 2, 3, 4)))
    put(out, "fuzz_npy", "i8-2d", npy("<i8", [2, 2], struct.pack("<4q", 5, 6, 7, 8)))
    put(out, "fuzz_npy", "u1-v2", npy("|u1", [3], b"\x01\x02\x03", version=2))
    put(out, "fuzz_npy", "i2-0d", npy("<i2", [], struct.pack("<h", 9)))
    # prepared token shards: meta.json SEP shard-00000.bin SEP shard-00000.mask
    toks = struct.pack("<12I", *range(1, 13))
    meta = {"format": "ctitan-tokens", "version": 1, "kind": "text", "vocab_size": 300, "dtype": "uint32",
            "total_tokens": 12, "shards": [{"file": "shard-00000.bin", "tokens": 12}]}
    put(out, "fuzz_token_shards", "plain", json.dumps(meta, indent=2).encode() + SEP + toks + SEP)
    meta["shards"][0]["mask"] = "shard-00000.mask"
    meta["masked"] = True
    put(out, "fuzz_token_shards", "masked", json.dumps(meta).encode() + SEP + toks + SEP + b"\x01\x00" * 6)
    # checkpoint manifest bodies (the target appends the checksum line)
    h = "0123456789abcdef"
    files = {n: {"bytes": 10, "xxh3_64": h} for n in
             ("model.safetensors", "config.json", "optim.safetensors", "state.json")}
    for mo in (False, True):
        body = '{\n  "format": "ctitan-checkpoint",\n  "version": 1,\n  "step": 7,\n  "model_only": %s,\n' \
               '  "files": {' % ("true" if mo else "false")
        body += ",".join('\n    "%s": {"bytes": %d, "xxh3_64": "%s"}' % (n, v["bytes"], v["xxh3_64"])
                         for n, v in files.items()) + "\n  }"
        put(out, "fuzz_ckpt_manifest", "model_only" if mo else "full", body)
    # state.json as the trainer writes it (defaults: seq_len 2048, seed 0, no shuffle)
    put(out, "fuzz_train_state", "state", json.dumps(
        {"step": 7, "seed": 0, "lr_factor_next": 0.5, "seq_len": 2048, "global_batch": 8, "shuffle": False,
         "training_steps": 10, "data": {"epoch": 0, "pos": 3}, "moe_expert_bias": [0.5] * 8}, indent=2))
    # PEFT adapter configs
    put(out, "fuzz_adapter_config", "peft", json.dumps(
        {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0,
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "use_rslora": False, "bias": "none",
         "fan_in_fan_out": False, "use_dora": False, "base_model_name_or_path": "Qwen/Qwen3-0.6B"}, indent=2))
    put(out, "fuzz_adapter_config", "rslora", json.dumps(
        {"peft_type": "LORA", "r": 16, "lora_alpha": 32.5, "use_rslora": True,
         "target_modules": ["gate_proj", "up_proj", "down_proj"]}))
    # text for the byte-level BPE encoder
    for i, s in enumerate([b"the cat sat on the mat", "caf\u00e9 \u4e2d\u6587 \U0001f600 na\u00efve".encode(),
                           b"<|im_start|>user\nhi<|im_end|>\n<|endoftext|>", b"  \t\r\n  x  \n\n", b"123 4567 it's",
                           b"\xff\xfe\x00\xc3(\xe2\x82", b"in the theater"]):
        put(out, "fuzz_bpe", "text%d" % i, s)


if __name__ == "__main__":
    main()
