"""Which tokens are targets, and what a record hands the chat template, as TRL 1.16.0's
SFTTrainer decides them (trl/trainer/sft_trainer.py, _prepare_dataset and its tokenize_fn;
trl/trainer/sft_config.py). TRL is not installed: its rule is restated here in this test's
words and computed with transformers' apply_chat_template / tokenizer alone.

- training.assistant_only_loss (TRL's name; ctitan's default true, TRL's false): with false a
  conversation's targets are its ids as apply_chat_template(messages, tokenize=True) gives
  them, every one (TRL's labels = input_ids); no EOS belongs to a conversation, so the EOS
  ctitan's stream puts after it is no target.
- training.completion_only_loss (TRL's default for prompt-completion data: on): with false
  TRL keeps no completion mask, so the targets of a string record are every id of
  tokenizer(prompt + completion + eos_token), and those of a conversational record the ids
  of apply_chat_template(prompt + completion): every one, or with assistant_only_loss the
  assistant mask's.
- A record's "tools" (a list of schemas, or that list as JSON text, json.loads'd) and its
  "chat_template_kwargs" reach every apply_chat_template call TRL makes for it, as
  tools=... and **kwargs.

`ctitan prepare` builds the masks and records the options in meta.json; training on such
data with other options is refused."""
import json
import shutil
import unicodedata

import numpy as np
import pytest

import oracle
from test_data_hf import CHATML, CHATML_GEN, CHATML_GP, CONVERSATIONS, auto_tok, tokdir  # noqa: F401  (fixtures)
from test_prompt_completion import (CONV_RECORDS, RECORDS, prepared, qwen3_dir,  # noqa: F401  (fixtures)
                                    trl_conversational_reference, trl_reference, write_jsonl)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city, in °C.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "its name"}},
                   "required": ["city"]}}}]

# a ChatML template that renders tools and a variable `persona` (a chat_template_kwargs
# key) before the turns; _GEN marks the assistant replies for return_assistant_tokens_mask
_HEAD = ("{% if tools %}{{'<|im_start|>system\\nTools:'}}{% for t in tools %}{{'\\n' + t | tojson}}{% endfor %}"
         "{{'<|im_end|>\\n'}}{% endif %}"
         "{% if persona is defined %}{{'<|im_start|>system\\n' + persona + '<|im_end|>\\n'}}{% endif %}")
_GP = "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n'}}{% endif %}"
TOOLS_TMPL = _HEAD + CHATML + _GP
TOOLS_TMPL_GEN = _HEAD + CHATML_GEN + _GP
# what ctitan's prefix rule takes as a reply on the unmarked TOOLS_TMPL: the text the reply adds
# to the conversation rendered with the generation prompt, the "\n" after <|im_end|> included
TOOLS_TMPL_PREFIX = _HEAD + (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{message['content'] + '<|im_end|>\\n'}}"
    "{% endgeneration %}{% else %}{{message['content'] + '<|im_end|>\\n'}}{% endif %}{% endfor %}") + _GP

TOOL_CONV = [{"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                                              "{\"city\": \"Paris\"}}\n</tool_call>"},
             {"role": "tool", "content": "18 °C, clear"},
             {"role": "assistant", "content": "It is 18 °C and clear in Paris."}]


def tok_of(d):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(d))


def prepare(run_ctitan, tokdir, src, out, *extra, check=True):  # noqa: F811
    return run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out, "--quiet", "--overwrite",
                       *extra], check=check)


def tools_of(rec):
    t = rec.get("tools")
    return json.loads(t) if isinstance(t, str) else t


def every_token_reference(tok, convs, template=None, kwargs_of=lambda r: {}):
    """TRL with assistant_only_loss=False: the rendered conversation's ids, each a target,
    then ctitan's EOS (no target)."""
    ids, mask = [], []
    for r in convs:
        kw = {"chat_template": template} if template else {}
        o = tok.apply_chat_template(r["messages"], tools=tools_of(r), tokenize=True, return_dict=True,
                                    **kw, **kwargs_of(r))
        ids += list(o["input_ids"]) + [tok.eos_token_id]
        mask += [1] * len(o["input_ids"]) + [0]
    return ids, mask


# -------------------------------------------------------------- assistant_only_loss

CASES = {  # (tokenizer, --chat-template, the template TRL renders with: None = the tokenizer's own)
    "tiny_auto": ("tiny", "auto", None),             # the built-in ChatML
    "tiny_tokenizer": ("tiny", "tokenizer", None),   # the tokenizer's ChatML template, through the Jinja renderer
    "qwen3_tokenizer": ("qwen3", "tokenizer", None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", ["messages", "sharegpt"])
def test_assistant_only_loss_false_trains_every_token(case, layout, tokdir, qwen3_dir, run_ctitan,  # noqa: F811
                                                      tmp_path):
    """Before: `--assistant-only-loss` was an unknown option (exit 2); the mask was the
    assistant replies' whatever was asked."""
    which, spec, _ = CASES[case]
    d = tokdir if which == "tiny" else qwen3_dir
    tok = tok_of(d)
    convs = [{"messages": c} for c in CONVERSATIONS + [TOOL_CONV]]
    ids, mask = every_token_reference(tok, convs)
    recs = convs if layout == "messages" else [
        {"conversations": [{"from": t["role"], "value": t["content"]} for t in c["messages"]]} for c in convs]
    src = write_jsonl(tmp_path / "c.jsonl", recs)
    prepare(run_ctitan, d, src, tmp_path / "p", "--chat-template", spec, "--assistant-only-loss", "false")
    meta, got, msk = prepared(tmp_path / "p")
    assert got.tolist() == ids
    assert msk.tolist() == mask
    assert meta["assistant_only_loss"] is False and meta["completion_only_loss"] is None, meta
    assert meta["trainable_tokens"] == sum(mask)
    # the default keeps ctitan's mask, the replies only, and says so in meta.json (on text the
    # normalizer keeps: the template's replies are located by bytes, docs/data.md; Qwen3's
    # template renders an earlier reply differently once later turns follow, so its replies
    # cannot be located there: that data trains with assistant_only_loss = false only)
    if which != "tiny":
        return
    stable = [r for r in recs if unicodedata.normalize("NFC", json.dumps(r, ensure_ascii=False))
              == json.dumps(r, ensure_ascii=False)]
    prepare(run_ctitan, d, write_jsonl(tmp_path / "s.jsonl", stable), tmp_path / "q", "--chat-template", spec)
    meta, got, msk = prepared(tmp_path / "q")
    assert 0 < msk.sum() < len(msk) - len(stable)
    assert meta["assistant_only_loss"] is True


# -------------------------------------------------------------- completion_only_loss

def test_completion_only_loss_false_string_records(tokdir, run_ctitan, tmp_path):  # noqa: F811
    """TRL's string prompt-completion data without completion_only_loss: every id of
    tokenizer(prompt + completion + eos) is a target, the prompt's and the EOS included.
    Before: unknown option (exit 2)."""
    tok = tok_of(tokdir)
    ids = []
    for r in RECORDS:
        c = r["completion"] if r["completion"].endswith(tok.eos_token) else r["completion"] + tok.eos_token
        ids += tok(text=r["prompt"] + c)["input_ids"]
    src = write_jsonl(tmp_path / "pc.jsonl", RECORDS)
    prepare(run_ctitan, tokdir, src, tmp_path / "p", "--completion-only-loss", "false")
    meta, got, msk = prepared(tmp_path / "p")
    assert got.tolist() == ids
    assert msk.tolist() == [1] * len(ids)
    assert meta["completion_only_loss"] is False and meta["assistant_only_loss"] is None, meta


# the assistant mask's reference is the marked ChatML, which the built-in ChatML equals (the
# tiny tokenizer's own template writes no generation prompt, so there ctitan's prefix rule
# counts a reply's header in)
@pytest.mark.parametrize("case, assistant_only", [("tiny_auto", False), ("tiny_tokenizer", False),
                                                  ("qwen3_tokenizer", False), ("tiny_auto", True)])
def test_completion_only_loss_false_conversational_records(case, assistant_only, tokdir, qwen3_dir,  # noqa: F811
                                                           run_ctitan, tmp_path):
    """Conversational prompt-completion without completion_only_loss: the ids of
    apply_chat_template(prompt + completion), every one a target (assistant_only_loss false),
    or the assistant mask's (true; its reference is return_assistant_tokens_mask on ChatML with
    {% generation %}, the tiny tokenizer only). Before: unknown option (exit 2)."""
    which, spec, _ = CASES[case]
    d = tokdir if which == "tiny" else qwen3_dir
    tok = tok_of(d)
    ids, mask = [], []
    for r in CONV_RECORDS:
        if assistant_only:
            o = tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True, chat_template=CHATML_GEN)
            m = list(o["assistant_masks"])
        else:
            o = tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)
            m = [1] * len(o["input_ids"])
        ids += list(o["input_ids"]) + [tok.eos_token_id]
        mask += m + [0]
    src = write_jsonl(tmp_path / "conv.jsonl", CONV_RECORDS)
    prepare(run_ctitan, d, src, tmp_path / "p", "--chat-template", spec, "--completion-only-loss", "false",
            "--assistant-only-loss", str(assistant_only).lower())
    meta, got, msk = prepared(tmp_path / "p")
    assert got.tolist() == ids
    assert msk.tolist() == mask
    assert meta["completion_only_loss"] is False and meta["assistant_only_loss"] is assistant_only, meta


def test_completion_only_default_ignores_assistant_only(tokdir, run_ctitan, tmp_path):  # noqa: F811
    """With completion_only_loss on (the default) a conversational record's targets are the
    completion's whatever assistant_only_loss says (docs/data.md), and meta.json records
    assistant_only_loss as shaping nothing (null)."""
    tok = tok_of(tokdir)
    # the built-in ChatML (auto on tokdir) writes the generation prompt (test_prompt_completion.py)
    ids, mask, _ = trl_conversational_reference(tok, CONV_RECORDS, CHATML_GP)
    src = write_jsonl(tmp_path / "conv.jsonl", CONV_RECORDS)
    for flag in ("true", "false"):
        prepare(run_ctitan, tokdir, src, tmp_path / flag, "--assistant-only-loss", flag)
        meta, got, msk = prepared(tmp_path / flag)
        assert got.tolist() == ids.tolist() and msk.tolist() == mask.tolist()
        assert meta["assistant_only_loss"] is None and meta["completion_only_loss"] is True, meta


# -------------------------------------------------------------- tools and chat_template_kwargs

TOOL_RECORDS = [
    {"messages": TOOL_CONV, "tools": TOOLS, "chat_template_kwargs": {"persona": "You are a weather bot."}},
    {"messages": CONVERSATIONS[0], "tools": json.dumps(TOOLS)},  # tools as JSON text: TRL json.loads it
    {"messages": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Sky?"},
                  {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Grass?"},
                  {"role": "assistant", "content": "Green."}],
     "tools": None, "chat_template_kwargs": {"persona": "Terse."}},
    {"messages": CONVERSATIONS[0]},
]


@pytest.mark.parametrize("marked", [True, False])
def test_record_tools_and_kwargs_reach_the_template(marked, tokdir, run_ctitan, tmp_path):  # noqa: F811
    """ids and the assistant mask of records with tools and chat_template_kwargs, against
    apply_chat_template(messages, tools=..., return_assistant_tokens_mask=True, **kwargs) on the
    marked template; on the unmarked one ctitan locates the replies (prefix rule) with the same
    variables, its reference the same template marked as that rule reads a reply. Before: the tools block and the persona were not
    rendered (tools were None and persona undefined in every call)."""
    tok = tok_of(tokdir)
    ids, mask = [], []
    for r in TOOL_RECORDS:
        o = tok.apply_chat_template(r["messages"], tools=tools_of(r), tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True,
                                    chat_template=TOOLS_TMPL_GEN if marked else TOOLS_TMPL_PREFIX,
                                    **(r.get("chat_template_kwargs") or {}))
        ids += list(o["input_ids"]) + [tok.eos_token_id]
        mask += list(o["assistant_masks"]) + [0]
    assert "get_weather" in tok.decode(ids) and "weather bot" in tok.decode(ids)
    (tmp_path / "t.jinja").write_text(TOOLS_TMPL_GEN if marked else TOOLS_TMPL)
    src = write_jsonl(tmp_path / "c.jsonl", TOOL_RECORDS)
    prepare(run_ctitan, tokdir, src, tmp_path / "p", "--chat-template", tmp_path / "t.jinja")
    _, got, msk = prepared(tmp_path / "p")
    assert got.tolist() == ids
    assert msk.tolist() == mask


def test_qwen3_tools_and_enable_thinking(qwen3_dir, run_ctitan, tmp_path):
    """Qwen3's own template renders the tools into its system turn, and enable_thinking=false
    puts the empty think block into the generation prompt. Conversational prompt-completion
    records with TRL's default options: the prompt (with the generation prompt) and the whole
    rendered with the record's tools and kwargs, the targets after their common prefix, so with
    enable_thinking=false the think block is context, no target. A messages record with
    assistant_only_loss=false: every id of apply_chat_template(..., tools=...)."""
    tok = tok_of(qwen3_dir)
    pc = [{"prompt": TOOL_CONV[:3], "completion": TOOL_CONV[3:], "tools": TOOLS,
           "chat_template_kwargs": {"enable_thinking": False}},
          {"prompt": TOOL_CONV[:1], "completion": TOOL_CONV[1:2], "tools": json.dumps(TOOLS)},
          {"prompt": CONVERSATIONS[0][:1], "completion": CONVERSATIONS[0][1:],
           "chat_template_kwargs": {"enable_thinking": False}}]
    ids, mask = [], []
    for r in pc:
        kw = dict(tools=tools_of(r), tokenize=True, return_dict=True, **(r.get("chat_template_kwargs") or {}))
        p = list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, **kw)["input_ids"])
        f = list(tok.apply_chat_template(r["prompt"] + r["completion"], **kw)["input_ids"])
        k = 0
        while k < min(len(p), len(f)) and p[k] == f[k]:
            k += 1
        ids += f + [tok.eos_token_id]
        mask += [0] * k + [1] * (len(f) - k) + [0]
    text = tok.decode(ids)
    assert "get_weather" in text and "<tools>" in text
    first = mask.index(1)
    assert "<think>\n\n</think>" not in tok.decode(ids[first:first + 8]), "the think block must be context"
    src = write_jsonl(tmp_path / "pc.jsonl", pc)
    prepare(run_ctitan, qwen3_dir, src, tmp_path / "p", "--chat-template", "tokenizer")
    _, got, msk = prepared(tmp_path / "p")
    assert got.tolist() == ids
    assert msk.tolist() == mask

    msgs = [{"messages": TOOL_CONV, "tools": TOOLS}, {"messages": CONVERSATIONS[0]}]
    ids, mask = every_token_reference(tok, msgs)
    assert "get_weather" in tok.decode(ids)
    src = write_jsonl(tmp_path / "m.jsonl", msgs)
    prepare(run_ctitan, qwen3_dir, src, tmp_path / "m", "--chat-template", "tokenizer",
            "--assistant-only-loss", "false")
    _, got, msk = prepared(tmp_path / "m")
    assert got.tolist() == ids
    assert msk.tolist() == mask


@pytest.mark.parametrize("rec, want", [
    ({"tools": TOOLS}, "tools: the built-in ChatML renders none"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs: the built-in ChatML renders none"),
], ids=["tools", "kwargs"])
def test_builtin_chatml_refuses_tools_and_kwargs(rec, want, tokdir, run_ctitan, tmp_path):  # noqa: F811
    """The built-in ChatML (chat_template auto on a ChatML tokenizer, or chatml) has no
    template to hand them to: refused, naming chat_template = "tokenizer", which renders them.
    An empty list / object is nothing to render and trains. Before: silently ignored."""
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[0]}, dict({"messages": TOOL_CONV}, **rec)])
    rc, _, err = prepare(run_ctitan, tokdir, src, tmp_path / "p", check=False)
    assert rc != 0 and f"{src}:2: {want}" in err and 'chat_template = "tokenizer"' in err, (rc, err)
    prepare(run_ctitan, tokdir, src, tmp_path / "p", "--chat-template", "tokenizer")
    src = write_jsonl(tmp_path / "e.jsonl", [{"messages": CONVERSATIONS[0], "tools": [], "chat_template_kwargs": {}}])
    prepare(run_ctitan, tokdir, src, tmp_path / "e")


@pytest.mark.parametrize("extra, want", [
    ({"tools": {"type": "function"}}, "tools: expected a list of tool schemas"),
    ({"tools": ["get_weather"]}, "tools[0]: expected a JSON schema (an object)"),
    ({"tools": "[{\"type\": "}, "tools: a string that is not JSON"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs: expected an object"),
    ({"chat_template_kwargs": {"add_generation_prompt": True}},
     "chat_template_kwargs.add_generation_prompt: an argument of apply_chat_template itself"),
    ({"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs.tools: an argument of apply_chat_template "
                                                 'itself, not a template variable: give the tools as the record\'s "tools"'),
], ids=["tools_object", "tools_strings", "tools_bad_json", "kwargs_list", "kwargs_own_arg", "kwargs_tools"])
def test_bad_tools_and_kwargs_name_the_field(extra, want, tokdir, run_ctitan, tmp_path):  # noqa: F811
    src = write_jsonl(tmp_path / "c.jsonl", [dict({"messages": CONVERSATIONS[0]}, **extra)])
    rc, _, err = prepare(run_ctitan, tokdir, src, tmp_path / "p", "--chat-template", "tokenizer", check=False)
    assert rc == 3 and f"{src}:1: {want}" in err, (rc, err)


# -------------------------------------------------------------- config and prepared data

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokdir, auto_tok):  # noqa: F811
    m = tmp_path_factory.mktemp("loss_model")
    oracle.tiny_config(vocab=len(auto_tok), hidden=32, inter=48, layers=1, heads=4, kv_heads=2,
                       head_dim=8).save_pretrained(m)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, m / f)
    return m


def train_args(model_dir, data, out, *extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model_dir}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.steps=1",
            "--metrics.peak_tflops=1", f"--job.dump_folder={out}", *extra]


@pytest.mark.parametrize("key", ["assistant_only_loss", "completion_only_loss"])
def test_bad_values_name_the_key(key, model_dir, run_ctitan, tokdir, tmp_path):  # noqa: F811
    """Before: `training.assistant_only_loss`: unknown key."""
    src = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS] * 8)
    sec = oracle.train_sections(tmp_path / "o", src, model_dir, load=False, steps=1,
                                options={f"training.{key}": "yes"})
    cfg = oracle.write_toml(tmp_path / "bad.toml", sec)
    rc, _, err = run_ctitan(["train", "--config", cfg], check=False)
    assert rc == 2 and f"training.{key}" in err and "expected" in err, (rc, err[-2000:])
    rc, _, err = run_ctitan(train_args(model_dir, src, tmp_path / "o", f"--training.{key}=yes"), check=False)
    assert rc == 2 and f"training.{key}: expected true or false, got 'yes'" in err, (rc, err[-2000:])
    flag = "--" + key.replace("_", "-")
    rc, _, err = prepare(run_ctitan, tokdir, src, tmp_path / "p", flag, "yes", check=False)
    assert rc == 2 and f'{flag}: expected true or false, got "yes"' in err, (rc, err)


def test_training_counts_follow_the_options(model_dir, auto_tok, run_ctitan, tmp_path):  # noqa: F811
    """Given to the trainer directly: the start-up line counts every token of the
    conversations as trainable with training.assistant_only_loss = false, and every token of
    the string prompt-completion records (EOS included) with completion_only_loss = false."""
    convs = [{"messages": c} for c in CONVERSATIONS] * 8
    ids, mask = every_token_reference(auto_tok, convs)
    src = write_jsonl(tmp_path / "c.jsonl", convs)
    _, _, err = run_ctitan(train_args(model_dir, src, tmp_path / "o1", "--training.assistant_only_loss=false"))
    assert f"{len(convs)} documents, {len(ids)} tokens ({sum(mask)} trainable)" in err, err[-2000:]
    recs = RECORDS * 20
    n = len(trl_reference(auto_tok, recs)[0])
    src = write_jsonl(tmp_path / "pc.jsonl", recs)
    _, _, err = run_ctitan(train_args(model_dir, src, tmp_path / "o2", "--training.completion_only_loss=false"))
    assert f"{len(recs)} documents, {n} tokens ({n} trainable)" in err, err[-2000:]


@pytest.mark.parametrize("key", ["assistant_only_loss", "completion_only_loss"])
def test_prepared_data_refuses_other_loss_options(key, model_dir, tokdir, run_ctitan, tmp_path):  # noqa: F811
    """Prepared masks follow the options prepare was given (meta.json): training with the
    other setting is refused, naming the key, meta.json and both ways out; the same setting
    trains. Data prepared before the record existed counts as prepared with the defaults.
    Before: training.X was an unknown key."""
    data = [{"messages": c} for c in CONVERSATIONS] if key == "assistant_only_loss" else RECORDS
    src = write_jsonl(tmp_path / "d.jsonl", data * 8)
    flag = "--" + key.replace("_", "-")
    out = tmp_path / "p"
    prepare(run_ctitan, tokdir, src, out, flag, "false")
    rc, _, err = run_ctitan(train_args(model_dir, out, tmp_path / "o1"), check=False)
    assert rc == 2, (rc, err[-2000:])
    assert (f"training.{key} = true, but {out / 'meta.json'} was prepared with {key} = false" in err
            and f"prepare the data again with {flag} true, or set training.{key} = false" in err), err[-2000:]
    run_ctitan(train_args(model_dir, out, tmp_path / "o2", f"--training.{key}=false"))
    # made before the record: the key absent, the data masked as the defaults mask
    prepare(run_ctitan, tokdir, src, out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta[key] is True
    del meta["assistant_only_loss"], meta["completion_only_loss"]
    (out / "meta.json").write_text(json.dumps(meta))
    rc, _, err = run_ctitan(train_args(model_dir, out, tmp_path / "o3", f"--training.{key}=false"), check=False)
    assert rc == 2 and f"was prepared with {key} = true (prepared before the option was recorded" in err, err[-2000:]
    run_ctitan(train_args(model_dir, out, tmp_path / "o4"))
