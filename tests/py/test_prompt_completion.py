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

The conversational variant (prompt and completion as lists of messages), ShareGPT turns and
content given as a list of parts are refused with a hint naming the shape and a conversion."""
import json
import shutil

import numpy as np
import pytest

from test_data_hf import auto_tok, tokdir  # noqa: F401  (fixtures)

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


def test_prompt_completion_in_training_is_masked(tokdir, auto_tok, run_ctitan, tmp_path):  # noqa: F811
    """Given to the trainer directly, the file is tokenized with the same mask: the
    start-up line counts the completion tokens (and EOS) as the trainable ones."""
    import oracle
    recs = RECORDS * 40
    _, mask = trl_reference(auto_tok, recs)
    m = tmp_path / "model"
    oracle.tiny_config(vocab=len(auto_tok), hidden=32, inter=48, layers=1, heads=4, kv_heads=2,
                       head_dim=8).save_pretrained(m)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, m / f)
    src = write_jsonl(tmp_path / "pc.jsonl", recs)
    _, _, err = run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={m}",
                            f"--training.dataset_path={src}", "--training.seq_len=16",
                            "--training.local_batch_size=2", "--training.steps=1", "--metrics.peak_tflops=1",
                            f"--job.dump_folder={tmp_path / 'out'}"])
    assert f"{len(recs)} documents, {mask.size} tokens ({int(mask.sum())} trainable)" in err, err
    assert "loss-masked" in err, err


def refused(run_ctitan, tokdir, path, *extra):  # noqa: F811
    rc, _, err = run_ctitan(["prepare", "--tokenizer", tokdir, "--input", path, "--out", path.parent / "o",
                             "--quiet", "--overwrite", *extra], check=False)
    assert rc == 3, (rc, err)
    return err


CONV_PC = {"prompt": [{"role": "user", "content": "Colour of the sky?"}],
           "completion": [{"role": "assistant", "content": "Blue."}]}
JOIN = "jq -c '{messages: (.prompt + .completion)}' IN.jsonl > OUT.jsonl"
SHAREGPT = "jq -c '{messages: [(.conversations // .messages)[] | {role: "


@pytest.mark.parametrize("kind", ["auto", "chat"])
def test_conversational_prompt_completion_is_refused_with_a_recipe(kind, tokdir, run_ctitan, tmp_path):  # noqa: F811
    """Before: `"text" field missing` (auto) / `no "messages" field` (chat), no hint."""
    src = write_jsonl(tmp_path / "conv.jsonl", [CONV_PC])
    err = refused(run_ctitan, tokdir, src, "--kind", kind)
    assert f"{src}:1: " in err and "conversational prompt-completion" in err and JOIN in err, err


def test_recipe_for_conversational_prompt_completion_trains_as_chat(tokdir, run_ctitan, tmp_path):  # noqa: F811
    """The recipe the error gives (its jq program, done here in Python) makes data ctitan reads."""
    src = write_jsonl(tmp_path / "joined.jsonl", [{"messages": CONV_PC["prompt"] + CONV_PC["completion"]}])
    run_ctitan(["prepare", "--tokenizer", tokdir, "--input", src, "--out", tmp_path / "o", "--quiet"])


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
    ([{"conversations": [{"from": "human", "value": "hi"}]}], 1, '"text" field missing ("conversations" is '
                                                                 "ShareGPT's layout"),
], ids=["no_completion", "completion_int", "text_after_pc", "pc_after_text", "sharegpt_conversations"])
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
    import oracle
    docs = [f"document {i}: the river runs to the sea past {i * 7} stones" for i in range(60)]
    want = sum(len(auto_tok(text=d)["input_ids"]) + 1 for d in docs)
    m = tmp_path / "model"
    oracle.tiny_config(vocab=len(auto_tok), hidden=32, inter=48, layers=1, heads=4, kv_heads=2,
                       head_dim=8).save_pretrained(m)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, m / f)
    src = write_jsonl(tmp_path / "docs.jsonl", [{"content": d, "id": i} for i, d in enumerate(docs)])
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={m}", f"--training.dataset_path={src}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.steps=1",
            "--metrics.peak_tflops=1", f"--job.dump_folder={tmp_path / 'out'}"]
    rc, _, err = run_ctitan(args, check=False)
    assert rc != 0 and '"text" field missing' in err, (rc, err[-2000:])
    _, _, err = run_ctitan(args + ["--training.text_field=content"])
    assert f"{len(docs)} documents, {want} tokens" in err, (want, err[-2000:])
    rc, _, err = run_ctitan(args + ["--training.text_field="], check=False)
    assert rc == 2 and "training.text_field: empty" in err, (rc, err[-2000:])
