"""Gemma 1 and Gemma 2's published chat template (tests/data/chat_templates/gemma-it, gemma-2-it;
SOURCES.md) beyond the rendering every template gets in test_chat_template.py: the template refuses
a system turn (where Gemma 3's folds it into the first user turn) and turns that do not alternate,
and ctitan must surface that refusal as the template's own message; chat SFT data in it gets
transformers' tokens and assistant mask; `generate --chat` on a tiny gemma2 model renders it as
apply_chat_template does and decodes as model.generate does. Expected values come from
transformers (apply_chat_template, jinja2, model.generate) only."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

import oracle_families as fam
from test_chat_template import CONVERSATIONS, DATA, driver, hf_tokenizer, run_driver  # noqa: F401
from test_chat_sft_template import expected, prepare
from test_generate import MIN_MARGIN, NEW, gen, gen_cmd, hf_greedy, ids_of  # noqa: F401
from test_tokenizer_families import BUILDERS
from tokenizer_corpus import corpus

GEMMA_NOSYS = ["gemma-it", "gemma-2-it"]
SYSTEM_MSG = "System role not supported"
ALTERNATE_MSG = "Conversation roles must alternate user/assistant/user/assistant/..."


def _cfg(name):
    return json.loads((DATA / name / "tokenizer_config.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", GEMMA_NOSYS)
def test_refusals_are_the_templates_own(name, driver, tmp_path):  # noqa: F811
    """transformers raises on exactly the conversations with a system turn (System role not
    supported) or two user turns in a row; ctitan exits 1 with the same message and the file,
    on the same conversations, and renders the others (test_chat_template compares the text)."""
    import jinja2
    tok = hf_tokenizer(_cfg(name))
    refused = {}
    for conv_name, msgs in CONVERSATIONS.items():
        try:
            tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            want = None
        except jinja2.exceptions.TemplateError as ex:
            want = str(ex)
        m = tmp_path / f"{conv_name}.json"
        m.write_text(json.dumps(msgs, ensure_ascii=False), encoding="utf-8")
        rc, out, err = run_driver(driver, ["chat", DATA / name, m, 1])
        if want is None:
            assert rc == 0, f"{conv_name}: {err}"
        else:
            assert rc == 1 and out == b"", f"{conv_name}: transformers raised {want!r}, ctitan exited {rc}"
            assert f"raise_exception: {want}" in err and str(DATA / name / "tokenizer_config.json") in err, err
            refused[conv_name] = want
    assert refused == {"system_user": SYSTEM_MSG, "multi_turn": SYSTEM_MSG, "not_alternating": ALTERNATE_MSG}


def test_gemma3_takes_the_system_turn_gemma2_refuses(driver, tmp_path):  # noqa: F811
    """The same system turn: Gemma 3's template puts it before the first user message, as
    transformers renders it, where Gemma 2's refuses it."""
    m = tmp_path / "m.json"
    m.write_text(json.dumps(CONVERSATIONS["system_user"]))
    want = hf_tokenizer(_cfg("gemma-3-it")).apply_chat_template(CONVERSATIONS["system_user"], tokenize=False,
                                                                  add_generation_prompt=True)
    rc, out, err = run_driver(driver, ["chat", DATA / "gemma-3-it", m, 1])
    assert rc == 0 and out.decode() == want, err
    assert "You are a terse assistant.\n\nName three primes." in want
    rc, _, err = run_driver(driver, ["chat", DATA / "gemma-2-it", m, 1])
    assert rc == 1 and f"raise_exception: {SYSTEM_MSG}" in err, err


def test_template_text_is_the_published_one():
    """SOURCES.md: the sha256 of Gemma 2's text is the Git LFS oid (591 bytes) under which a
    llama.cpp fork stores google-gemma-2-2b-it.jinja; Gemma 1's current template is the same
    text (both directories are kept so that each line's provenance stays recorded)."""
    import hashlib
    text = _cfg("gemma-2-it")["chat_template"].encode()
    assert len(text) == 591
    assert hashlib.sha256(text).hexdigest() == "ecd6ae513fe103f0eb62e8ab5bfa8d0fe45c1074fa398b089c93a7e70c15cfd6"
    assert _cfg("gemma-it")["chat_template"] == _cfg("gemma-2-it")["chat_template"]


# ------------------------------------------------------------------------------ chat SFT data

# Gemma 2 takes no system turn; user / assistant alternating, replies with surrounding white
# space (the template trims the content) and non-ASCII text
CONVS = [
    [{"role": "user", "content": "What is a shard?"}, {"role": "assistant", "content": "A piece of the dataset file."}],
    [{"role": "user", "content": "Name a river."}, {"role": "assistant", "content": "\n\nThe river Thames."},
     {"role": "user", "content": "  Another?  "}, {"role": "assistant", "content": "東京 🙂 café  done "}],
    [{"role": "user", "content": "Count"}, {"role": "assistant", "content": " one two"},
     {"role": "user", "content": "more"}, {"role": "assistant", "content": " one two"}],
]


@pytest.fixture(scope="module")
def gemma_tok(tmp_path_factory):
    """A tiny Gemma-style tokenizer (test_tokenizer_families' gemma3 builder: <pad> <eos> <bos>
    <unk>, <start_of_turn> / <end_of_turn> special) carrying Gemma 2's tokenizer_config.json."""
    from transformers import AutoTokenizer
    d = tmp_path_factory.mktemp("gemma2tok")
    BUILDERS["gemma3"](corpus(seed=1)[:120]).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(_cfg("gemma-2-it")))
    return d, AutoTokenizer.from_pretrained(str(d))


def test_sft_tokens_and_assistant_mask(gemma_tok, run_ctitan, tmp_path):
    """`ctitan prepare` renders each conversation in Gemma 2's template: ids are HF's tokenization
    of apply_chat_template's text, the mask covers each reply (trimmed content, <end_of_turn> and
    its newline) as test_chat_sft_template derives it from apply_chat_template renderings."""
    tokdir, tok = gemma_tok
    want_ids, want_mask = expected(tok, CONVS)
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    # every reply ends in <end_of_turn>, a target; the user turns' are not
    assert 0 < want_mask.sum() < len(want_mask) // 2
    assert sorted(int(want_mask[i]) for i in np.nonzero(want_ids == eot)[0]) == [0] * 5 + [1] * 5
    _, _, ids, msk = prepare(run_ctitan, tokdir, CONVS, tmp_path / "g2")
    assert len(ids) == len(want_ids) and (ids == want_ids).all(), "ids differ from HF's"
    bad = np.nonzero(msk != want_mask)[0]
    assert not len(bad), f"mask differs at {bad[:10]}: " + \
        str([tok.convert_ids_to_tokens(int(ids[b])) for b in bad[:10]])


def test_sft_system_turn_is_refused(gemma_tok, run_ctitan, tmp_path):
    """A conversation with a system turn stops prepare with the template's message and the data
    line, as every raise_exception does (test_chat_sft_template.test_template_errors)."""
    tokdir, _ = gemma_tok
    sys_conv = [{"role": "system", "content": "Be brief."}] + CONVS[0]
    rc, err, _, _ = prepare(run_ctitan, tokdir, CONVS[:2] + [sys_conv], tmp_path / "sys", check=False)
    # exit 3: a format error of the template's file (docs/generate.md), as generate --chat exits
    assert rc == 3 and "sys.jsonl:3" in err and f"raise_exception: {SYSTEM_MSG}" in err, err
    assert "tokenizer_config.json (chat_template)" in err, err


# ------------------------------------------------------------------------------ generate --chat

def test_generate_chat_on_tiny_gemma2(gemma_tok, gen, tmp_path):  # noqa: F811
    """`generate --chat` on a tiny gemma2 model (oracle_families' gemma2 case over this
    tokenizer's vocabulary) with Gemma 2's template: the prompt is apply_chat_template(
    add_generation_prompt=True) tokenized without added specials (the template writes <bos>),
    and the greedy ids equal model.generate's, stopping on <eos> / <end_of_turn> (the ids
    generation_config.json lists, as gemma-2-it's does) on both sides."""
    tokdir, tok = gemma_tok
    V = len(tok)
    case = fam.CASE["gemma2"]
    case = replace(case, kw={**case.kw, "vocab_size": V, "pad_token_id": 0})
    model = fam.build(case, seed=7)
    d = fam.save(model, tmp_path / "m")
    stops = [tok.convert_tokens_to_ids(s) for s in ("<eos>", "<end_of_turn>")]
    gc = json.loads((d / "generation_config.json").read_text())
    gc["eos_token_id"] = stops
    (d / "generation_config.json").write_text(json.dumps(gc))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, d / f)
    text = "The quick brown fox said: hello world 42!"
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)
    assert rendered == f"<bos><start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"
    prompt = tok(rendered, add_special_tokens=False)["input_ids"]
    assert prompt.count(tok.convert_tokens_to_ids("<bos>")) == 1
    want, margin = hf_greedy(model, prompt, eos=stops)
    assert margin > MIN_MARGIN, f"test setup: near-tie in HF logits (margin {margin}): change the seed"
    _, out, _ = gen(["--checkpoint", d, "--prompt", text, "--chat", "--ids", "--max-tokens", NEW])
    assert ids_of(out) == want
