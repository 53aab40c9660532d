"""Chat data in a family's own chat template (training.chat_template / prepare --chat-template;
issue 15): `ctitan prepare` on conversations for tiny Llama-3, Gemma-3 and Mistral tokenizers
(built as test_tokenizer_families builds them; Phi-3's template on the Mistral-style one,
OLMo-2's on the Llama-3-style one)
carrying the published templates of
tests/data/chat_templates. The oracle is transformers alone:

- ids: the HF tokenization (add_special_tokens=False, as apply_chat_template tokenizes) of
  apply_chat_template(conversation, tokenize=False);
- mask: the assistant spans computed here in Python from apply_chat_template renderings
  (the reply is what rendering the conversation up to it with the generation prompt, then
  with it, differ by; where the former is no prefix of the latter, where the rendering with
  the reply's content emptied departs from it; less what only the conversation's end gets,
  Phi-3's eos), every token whose HF offsets overlap a span;
- with a template that has {% generation %} markers: transformers' own
  return_assistant_tokens_mask.
Each conversation is followed by EOS (mask 0), as docs/data.md packs chat data."""
import json

import numpy as np
import pytest

from test_tokenizer_families import BUILDERS
from tokenizer_corpus import corpus

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "tests" / "data" / "chat_templates"
FAMILIES = {"llama3": "llama-3.1-instruct", "gemma3": "gemma-3-it", "mistral": "mistral-7b-instruct-v0.3",
            "phi3": "phi-3-mini-4k-instruct", "olmo2": "olmo-2-instruct"}
# Phi-3's tokenizer is a Llama-2-style SentencePiece BPE, as Mistral's; OLMo-2's a byte-level BPE
BUILT_BY = {"phi3": "mistral", "olmo2": "llama3"}
CONVS = [
    [{"role": "user", "content": "What is a shard?"}, {"role": "assistant", "content": "A piece of the dataset file."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."},
     {"role": "assistant", "content": "\n\nThe river Thames."}, {"role": "user", "content": "Another?"},
     {"role": "assistant", "content": "東京 🙂 café  done "}],
    [{"role": "user", "content": "Count"}, {"role": "assistant", "content": " one two"},
     {"role": "user", "content": "more"}, {"role": "assistant", "content": " one two"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello there."}],
]
# A Llama-3-style template with generation markers: transformers' own assistant mask applies.
LLAMA_GEN = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
             "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}"
             "{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def docs():
    return corpus(seed=1)[:120]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, docs, tmp_path_factory):
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp(request.param)
    built = BUILDERS[BUILT_BY.get(request.param, request.param)](docs)
    (built[0] if isinstance(built, tuple) else built).save(str(d / "tokenizer.json"))
    cfg = json.loads((DATA / FAMILIES[request.param] / "tokenizer_config.json").read_text())
    t = built[0] if isinstance(built, tuple) else built
    for k in [k for k, v in cfg.items() if k.endswith("_token") and t.token_to_id(v) is None]:
        del cfg[k]  # a special token this tiny tokenizer lacks (OLMo-2's <|pad|>): neither side reads it
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return request.param, d, AutoTokenizer.from_pretrained(str(d))


def prepare(run_ctitan, tokdir, convs, out, *extra, check=True):
    src = out.parent / (out.name + ".jsonl")
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out, "--overwrite", "--quiet",
                             *extra], check=check)
    if rc:
        return rc, err, None, None
    meta = json.loads((out / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(out / s["file"], dtype="<u4") for s in meta["shards"]])
    msk = np.concatenate([np.fromfile(out / s["mask"], dtype=np.uint8) for s in meta["shards"]])
    return rc, err, ids, msk


def reply_spans(tok, conv, text):
    """Character spans of the assistant replies in text, from apply_chat_template renderings."""
    spans, cur = [], 0
    for i, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(conv[:i], tokenize=False, add_generation_prompt=True)
        upto = tok.apply_chat_template(conv[:i + 1], tokenize=False)
        if upto.startswith(before) and len(upto) > len(before):
            at = len(before)
        else:
            empty = tok.apply_chat_template(conv[:i] + [dict(m, content="")], tokenize=False)
            at = 0
            while at < min(len(upto), len(empty)) and upto[at] == empty[at]:
                at += 1
        if i + 1 < len(conv):  # text only the conversation's end gets (Phi-3's eos) is no part of the reply
            after = tok.apply_chat_template(conv[:i + 2], tokenize=False)
            k = 0
            while k < min(len(upto), len(after)) and upto[k] == after[k]:
                k += 1
            if at < k < len(upto) and text.endswith(upto[k:]):
                upto = upto[:k]
        if text.startswith(upto) and at >= cur:
            s, e = at, len(upto)
        else:
            s = text.index(upto[at:], cur)
            e = s + len(upto) - at
        spans.append((s, e))
        cur = e
    return spans


def expected(tok, convs):
    ids, mask = [], []
    eos = tok.convert_tokens_to_ids(tok.eos_token)
    for conv in convs:
        text = tok.apply_chat_template(conv, tokenize=False)
        spans = reply_spans(tok, conv, text)
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids += enc["input_ids"] + [eos]
        mask += [int(any(a < e and b > s for s, e in spans)) for a, b in enc["offset_mapping"]] + [0]
    return np.asarray(ids), np.asarray(mask)


def test_family_template_tokens_and_mask(family, run_ctitan, tmp_path):
    name, tokdir, tok = family
    want_ids, want_mask = expected(tok, CONVS)
    assert 0 < want_mask.sum() < len(want_mask) // 2
    _, _, ids, msk = prepare(run_ctitan, tokdir, CONVS, tmp_path / "auto")  # chat_template "auto"
    assert len(ids) == len(want_ids) and (ids == want_ids).all(), f"{name}: ids differ from HF's"
    bad = np.nonzero(msk != want_mask)[0]
    assert not len(bad), f"{name}: mask differs at {bad[:10]} " + \
        str([tok.convert_ids_to_tokens(int(ids[b])) for b in bad[:10]])
    # "chatml" keeps the built-in format (refused where the tokenizer has no <|im_start|>)
    rc, err, ids, _ = prepare(run_ctitan, tokdir, CONVS, tmp_path / "chatml", "--chat-template", "chatml", check=False)
    assert ("<|im_start|>" in err) if rc else ids[0] == tok.convert_tokens_to_ids("<|im_start|>")


# the marker template is written in Llama-3's tokens
@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_generation_markers_match_transformers_mask(family, run_ctitan, tmp_path):
    name, tokdir, tok = family
    tmpl = tmp_path / "gen.jinja"
    tmpl.write_text(LLAMA_GEN)
    ids, mask = [], []
    for conv in CONVS:
        o = tok.apply_chat_template(conv, chat_template=LLAMA_GEN, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        ids += list(o["input_ids"]) + [tok.convert_tokens_to_ids(tok.eos_token)]
        mask += list(o["assistant_masks"]) + [0]
    assert 0 < sum(mask)
    _, _, got, msk = prepare(run_ctitan, tokdir, CONVS, tmp_path / "gen", "--chat-template", tmpl)
    assert (got == np.asarray(ids)).all() and (msk == np.asarray(mask)).all()


# A reply rendered with a different closer when the conversation is cut right after the next message
# (Llama 3.1 closes a turn that awaits a tool result with <|eom_id|>; here keyed on the conversation's
# last message being the tool result): the rendering through the next message (N) parts from the one
# through the reply (Q) inside the reply's closer, while the whole conversation (T) renders the reply
# as Q does. Only end-of-conversation text may be cut from Q there (T must end with it), so the reply
# keeps its whole closer (with the newline the assistant turns alone get, T does not end with Q's rest).
PENDING_GEN = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
               "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim }}"
               "{% if messages[-1]['role'] == 'ipython' %}<|eom_id|>{% else %}<|eot_id|>{% endif %}{{ '\\n' }}"
               "{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
PENDING_CONVS = [
    [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "get_weather(Oslo)"},
     {"role": "ipython", "content": "rain, 4C"}, {"role": "user", "content": "And tomorrow?"}],
    [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "get_weather(Oslo)"},
     {"role": "ipython", "content": "rain, 4C"}, {"role": "assistant", "content": "Rainy, 4 degrees."},
     {"role": "user", "content": "Thanks"}],
]


@pytest.mark.parametrize("family", ["llama3"], indirect=True)
def test_closer_cut_only_at_the_conversation_end(family, run_ctitan, tmp_path):
    """The template without markers (ctitan locates the replies) gives transformers' mask of the same
    template with {% generation %} markers (return_assistant_tokens_mask)."""
    name, tokdir, tok = family
    plain = PENDING_GEN.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    ids, mask = [], []
    for conv in PENDING_CONVS:
        assert tok.apply_chat_template(conv, chat_template=plain, tokenize=False) == \
            tok.apply_chat_template(conv, chat_template=PENDING_GEN, tokenize=False)
        # the case: Q and N part inside the first reply's closer, T renders it as Q
        q = tok.apply_chat_template(conv[:2], chat_template=plain, tokenize=False)
        n = tok.apply_chat_template(conv[:3], chat_template=plain, tokenize=False)
        t = tok.apply_chat_template(conv, chat_template=plain, tokenize=False)
        k = next(j for j, (a, b) in enumerate(zip(q, n)) if a != b)
        assert t.startswith(q) and "<|eom_id|>" in n and q.rindex("get_weather") < k < len(q)
        assert "\n" in q[k:] and not t.endswith(q[k:])  # cutting Q at k would drop the closer's newline
        o = tok.apply_chat_template(conv, chat_template=PENDING_GEN, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True)
        ids += list(o["input_ids"]) + [tok.convert_tokens_to_ids(tok.eos_token)]
        mask += list(o["assistant_masks"]) + [0]
    tmpl = tmp_path / "pending.jinja"
    tmpl.write_text(plain)
    _, _, got, msk = prepare(run_ctitan, tokdir, PENDING_CONVS, tmp_path / "pending", "--chat-template", tmpl)
    assert len(got) == len(ids) and (got == np.asarray(ids)).all(), "ids differ from HF's"
    bad = np.nonzero(msk != np.asarray(mask))[0]
    assert not len(bad), f"mask differs from transformers' at {bad[:10]}: " + \
        str([(tok.convert_ids_to_tokens(int(got[b])), int(msk[b]), mask[b]) for b in bad[:10]])


def test_phi3_next_header_is_no_target(docs, run_ctitan, tmp_path):
    """Phi-3's template writes <|endoftext|> at the conversation's end only; the rendering through
    a reply and the one through the next user turn share "<|" of <|endoftext|> and <|user|>, and
    the reply's derived span ran 2 characters into the next header. With Phi-3's specials as
    special tokens (as its tokenizer has them), <|user|> after every reply but the last was a
    target. The mask of every reply that others follow now equals transformers' mask of the
    template with {% generation %} markers around content + '<|end|>\\n' (the last reply keeps
    the template's closing <|endoftext|>, ctitan's documented rule, so it is left out here)."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer
    d = tmp_path / "tok"
    d.mkdir()
    tk = BUILDERS["mistral"](docs)
    tk.add_special_tokens([AddedToken(s, special=True, normalized=False)
                           for s in ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|system|>"]])
    tk.save(str(d / "tokenizer.json"))
    cfg = json.loads((DATA / FAMILIES["phi3"] / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = AutoTokenizer.from_pretrained(str(d))
    plain = cfg["chat_template"]
    marked = plain.replace("{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
                           "{{'<|assistant|>\n'}}{% generation %}{{ message['content'] + '<|end|>\n' }}"
                           "{% endgeneration %}")
    assert marked != plain
    conv = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": " one two"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": " three"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": " four five"}]
    o = tok.apply_chat_template(conv, chat_template=marked, tokenize=True, return_dict=True,
                                return_assistant_tokens_mask=True)
    want_ids, want = list(o["input_ids"]), list(o["assistant_masks"])
    _, _, got, msk = prepare(run_ctitan, d, [conv], tmp_path / "phi3")
    assert list(got[:len(want_ids)]) == want_ids, "ids differ from HF's"
    last = max(i for i, t in enumerate(want_ids) if t == tok.convert_tokens_to_ids("<|assistant|>"))
    user = tok.convert_tokens_to_ids("<|user|>")
    assert sum(1 for t in want_ids[:last] if t == user) == 3 and want[:last].count(1) > 0
    bad = [i for i in range(last) if int(msk[i]) != want[i]]
    assert not bad, "mask differs from transformers' at " + \
        str([(tok.convert_ids_to_tokens(int(got[b])), int(msk[b]), want[b]) for b in bad])


# one tokenizer is enough for the error paths
@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_template_errors(family, run_ctitan, tmp_path):
    name, tokdir, _ = family
    # the template itself refuses (raise_exception): its message, with the file and line of the data
    bad = [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]]
    rc, err, _, _ = prepare(run_ctitan, tokdir, CONVS[:1] + bad, tmp_path / "alt", check=False)
    assert rc != 0 and "alt.jsonl:2" in err and "roles must alternate" in err, err
    # a reply the template renders differently once later turns follow cannot be located
    odd = tmp_path / "odd.jinja"
    odd.write_text("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}[earlier]"
                   "{% else %}{{ m.role + ': ' + m.content + '\\n' }}{% endif %}{% endfor %}")
    two = [[{"role": "user", "content": "Count"}, {"role": "assistant", "content": "first"},
            {"role": "user", "content": "more"}, {"role": "assistant", "content": "second"}]]
    rc, err, _, _ = prepare(run_ctitan, tokdir, two, tmp_path / "odd", "--chat-template", odd, check=False)
    assert rc != 0 and "messages[1]" in err and "cannot be located" in err, err
    rc, err, _, _ = prepare(run_ctitan, tokdir, CONVS[:1], tmp_path / "none", "--chat-template",
                            tmp_path / "missing.jinja", check=False)
    assert rc != 0 and "missing.jinja" in err, err


# one family through the trainer is enough; prepare covers the rest
@pytest.mark.parametrize("family", ["gemma3"], indirect=True)
def test_train_step_with_family_template(family, run_ctitan, tmp_path):
    """training.chat_template (default auto) through the trainer: the step-1 loss equals
    transformers' on windows of the HF-built stream above (seq_len + 1 tokens, the mask of the
    target token)."""
    name, tokdir, tok = family
    import shutil

    import oracle
    L, B = 16, 4
    ids, mask = expected(tok, CONVS)
    n = B * (L + 1)
    w = ids[:n].reshape(B, L + 1)
    m = mask[:n].reshape(B, L + 1)
    y = np.where(m[:, 1:] == 1, w[:, 1:], oracle.IGNORE)
    assert 0 < oracle.n_valid(y) < y.size
    model_dir = tmp_path / "model"
    cfg = oracle.tiny_config(vocab=len(tok), hidden=32, inter=48, layers=1, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(model_dir, cfg, seed=5)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, model_dir / f)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVS))
    out = tmp_path / "out"
    sec = oracle.train_sections(out, data, model_dir, steps=1, seq_len=L, local_bs=B, global_bs=B, lr=1e-3)
    run_ctitan(["train", "--config", oracle.write_toml(tmp_path / "t.toml", sec)])
    row = next(r for r in oracle.read_metrics(out / "metrics.jsonl") if r.get("step") == 1 and "loss" in r)
    loss, _, _ = oracle.hf_loss_and_grads(oracle.load_hf(model_dir), w[:, :-1], y)
    assert row["valid_targets"] == oracle.n_valid(y)
    assert abs(row["loss"] - loss) <= 1e-5 * loss, f"ctitan loss {row['loss']!r} vs transformers {loss!r}"


# --------------------------------------------------------------------------- the template's record

def _sha(text: str | bytes) -> str:
    import hashlib
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_prepare_records_chat_template(family, run_ctitan, tmp_path):
    """meta.json's "chat_template": the spec's mode (auto, chatml, tokenizer, path), where the
    text came from and its sha256 (hashlib over the text as tokenizer_config.json / the .jinja
    file hold it); the built-in ChatML has no text (null); data without chat has no record."""
    name, tokdir, _ = family
    text = json.loads((tokdir / "tokenizer_config.json").read_text())["chat_template"]
    assert isinstance(text, str) and "[INST]" in text

    def meta(out, *extra):
        prepare(run_ctitan, tokdir, CONVS, tmp_path / out, *extra)
        return json.loads((tmp_path / out / "meta.json").read_text())["chat_template"]

    src = f"{tokdir}/tokenizer_config.json (chat_template)"
    assert meta("auto") == {"mode": "auto", "template": src, "sha256": _sha(text)}
    assert meta("tok", "--chat-template", "tokenizer") == {"mode": "tokenizer", "template": src, "sha256": _sha(text)}
    assert meta("chatml", "--chat-template", "chatml") == {"mode": "chatml", "template": "built-in ChatML",
                                                           "sha256": None}
    own = tmp_path / "own.jinja"
    own.write_bytes(LLAMA_GEN.replace("<|start_header_id|>", "[H]").replace("<|end_header_id|>", "[/H]")
                    .replace("<|eot_id|>", "</s>").encode())
    assert meta("path", "--chat-template", own) == {"mode": "path", "path": str(own), "template": str(own),
                                                    "sha256": _sha(own.read_bytes())}
    # no chat source: nothing rendered, nothing recorded
    txt = tmp_path / "plain.txt"
    txt.write_text("Some text.\n\nMore text.\n")
    run_ctitan(["prepare", "--tokenizer", tokdir, "--input", txt, "--out", tmp_path / "plain", "--quiet"])
    assert "chat_template" not in json.loads((tmp_path / "plain" / "meta.json").read_text())


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_trainer_refuses_another_template_for_prepared_data(family, run_ctitan, tmp_path):
    """Prepared data keeps the template it was prepared with. training.chat_template left at auto,
    or naming the same template (tokenizer, which auto resolved to), trains; naming another one
    (the built-in ChatML, a .jinja file) is refused before any step, the message naming both the
    setting with what it resolves to and meta.json's record."""
    import shutil

    import oracle
    name, tokdir, tok = family
    data = tmp_path / "data"
    prepare(run_ctitan, tokdir, CONVS * 4, data)
    rec = json.loads((data / "meta.json").read_text())["chat_template"]
    model_dir = tmp_path / "model"
    oracle.save_random_hf(model_dir, oracle.tiny_config(vocab=len(tok), hidden=32, inter=48, layers=1, heads=4,
                                                       kv_heads=2, head_dim=8), seed=5)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, model_dir / f)

    def train(tag, template):
        opts = {} if template is None else {"training.chat_template": str(template)}
        sec = oracle.train_sections(tmp_path / tag, data, model_dir, steps=1, seq_len=8, local_bs=2, options=opts)
        return run_ctitan(["train", "--config", oracle.write_toml(tmp_path / f"{tag}.toml", sec)], check=False)

    for tag, template in (("default", None), ("same", "tokenizer")):
        rc, _, err = train(tag, template)
        assert rc == 0, f"{tag}: {err}"
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}")
    for tag, template, resolved in (("chatml", "chatml", "the built-in ChatML"),
                                    ("file", own, f"{own} (sha256 {_sha(own.read_bytes())})")):
        rc, _, err = train(tag, template)
        assert rc != 0, f"{tag}: trained on data prepared with another template"
        for want in (f'training.chat_template = "{template}"', resolved, str(data / "meta.json"),
                     f'"{rec["mode"]}"', rec["template"], rec["sha256"]):
            assert want in err, f"{tag}: the message must name {want!r}: {err}"
        assert not (tmp_path / tag / "metrics.jsonl").exists() or "loss" not in (tmp_path / tag / "metrics.jsonl").read_text()
