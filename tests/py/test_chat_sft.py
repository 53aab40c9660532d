"""Chat SFT end to end (issue 17, part 4): conversations in JSONL, tokenized by `ctitan prepare`
(or by the trainer at start-up), trained one step from a small HF model through the CLI; the
step-1 loss and grad norm equal what transformers computes on the same batch, built here from
transformers' own apply_chat_template with return_assistant_tokens_mask (the ChatML template
with {% generation %} around each assistant reply) as the reference for which tokens are
targets, packed as docs/data.md says (windows of seq_len + 1, the mask of the target token).

The same conversations in the other layouts TRL 1.16.0's SFTTrainer reads: ShareGPT's
{"conversations": [{"from", "value"}]} (TRL renames the keys, trl/data_utils.py
maybe_convert_to_chatml: the same batch), and the conversational prompt-completion layout
(each conversation's last reply as the completion, the turns before it as the prompt), whose
targets are TRL's completion_mask: the ids after the common prefix of the prompt rendered with
the generation prompt and the whole (trl/trainer/sft_trainer.py, tokenize_fn)."""
import json
import shutil

import numpy as np
import pytest
import torch

import oracle
from test_data_hf import CHATML_GEN, CHATML_GP, CONVERSATIONS, auto_tok, tokdir  # noqa: F401  (fixtures)

L, MICRO, GLOBAL = 16, 2, 4
MORE = [
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Colour of the sky?"},
     {"role": "assistant", "content": "Blue."},
     {"role": "user", "content": "And of grass, in the forest by the river?"},
     {"role": "assistant", "content": "Green, mostly: the gradient of the loss says so."}],
    [{"role": "user", "content": "Count: one two three"},
     {"role": "assistant", "content": "four five six seven eight nine ten"}],
]
CONVS = CONVERSATIONS + MORE


def as_record(conv, layout):
    if layout == "sharegpt":
        return {"conversations": [{"from": t["role"], "value": t["content"]} for t in conv]}
    if layout == "prompt_completion":
        return {"prompt": conv[:-1], "completion": conv[-1:]}
    return {"messages": conv}


def reference_batch(tok, layout="messages", every_token=False):
    """The first GLOBAL windows and their labels, from transformers alone. every_token: TRL's
    assistant_only_loss=False (and completion_only_loss=False): every id apply_chat_template
    gives for the conversation is a target, the EOS after it none (TRL adds no EOS to
    conversational data)."""
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    ids, mask = [], []
    for conv in CONVS:
        if every_token:
            full = list(tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"])
            ids += full + [eos]
            mask += [1] * len(full) + [0]
            continue
        if layout == "prompt_completion":  # TRL's rule, on the ChatML auto renders (with its generation prompt)
            assert conv[-1]["role"] == "assistant"
            prompt = list(tok.apply_chat_template(conv[:-1], add_generation_prompt=True, tokenize=True,
                                                  return_dict=True, chat_template=CHATML_GP)["input_ids"])
            full = list(tok.apply_chat_template(conv, tokenize=True, return_dict=True,
                                                chat_template=CHATML_GP)["input_ids"])
            k = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
            ids += full + [eos]
            mask += [0] * k + [1] * (len(full) - k) + [0]
            continue
        o = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                                    chat_template=CHATML_GEN)
        ids += list(o["input_ids"]) + [eos]  # each conversation ends with one EOS, never a target
        mask += list(o["assistant_masks"]) + [0]
    n = GLOBAL * (L + 1)
    assert len(ids) >= n, f"{len(ids)} tokens: too few for {GLOBAL} windows"
    w = np.asarray(ids[:n], np.int64).reshape(GLOBAL, L + 1)
    m = np.asarray(mask[:n]).reshape(GLOBAL, L + 1)
    labels = np.where(m[:, 1:] == 1, w[:, 1:], oracle.IGNORE)
    return np.asarray(ids), np.asarray(mask), w[:, :-1], labels


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokdir, auto_tok):  # noqa: F811
    d = tmp_path_factory.mktemp("sft")
    cfg = oracle.tiny_config(vocab=len(auto_tok), hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    model_dir = d / "model"
    oracle.save_random_hf(model_dir, cfg, seed=17)
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the trainer tokenizes jsonl with hf_assets_path's
        shutil.copy(tokdir / f, model_dir / f)
    return d, model_dir


def step_matches_transformers(setup, run_ctitan, layout, source, ref, name, prepare_flags=(), options=None):
    """Writes CONVS in `layout`, trains one step on it (the JSON Lines file, or what `ctitan
    prepare` made of it, whose tokens and mask must equal ref's first) and checks the step's
    loss, grad norm and target count against transformers' on ref = reference_batch(...)."""
    d, model_dir = setup
    ids, mask, x, y = ref
    chat = d / f"{name}_{layout}.jsonl"
    chat.write_text("".join(json.dumps(as_record(c, layout)) + "\n" for c in CONVS))
    data = chat
    if source == "prepared":
        data = d / f"{name}_prepared_{layout}"
        run_ctitan(["prepare", "--tokenizer", model_dir, "--input", chat, "--out", data, "--overwrite", "--quiet",
                    *prepare_flags])
        meta = json.loads((data / "meta.json").read_text())
        tok = np.concatenate([np.fromfile(data / s["file"], dtype="<u4") for s in meta["shards"]])
        msk = np.concatenate([np.fromfile(data / s["mask"], dtype=np.uint8) for s in meta["shards"]])
        # where a difference would come from, if the losses differ
        assert (tok.astype(np.int64) == ids).all() and (msk == mask).all(), "prepared tokens/mask differ from HF"
    source = f"{layout}_{source}"
    out = d / f"{name}_out_{source}"
    sec = oracle.train_sections(out, data, model_dir, steps=1, seq_len=L, local_bs=MICRO, global_bs=GLOBAL,
                                lr=1e-3, options=options)
    run_ctitan(["train", "--config", oracle.write_toml(d / f"{name}_{source}.toml", sec)])
    row = next(r for r in oracle.read_metrics(out / "metrics.jsonl") if r.get("step") == 1 and "loss" in r)
    model = oracle.load_hf(model_dir)
    loss, _, grads = oracle.hf_loss_and_grads(model, x, y)
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(torch.as_tensor(g))
                                                       for g in grads.values()])))
    assert abs(row["loss"] - loss) <= 1e-5 * loss, f"{source}: ctitan loss {row['loss']!r} vs transformers {loss!r}"
    assert abs(row["grad_norm"] - norm) <= 1e-4 * norm, f"{source}: grad_norm {row['grad_norm']!r} vs {norm!r}"
    assert row["valid_targets"] == oracle.n_valid(y)


@pytest.mark.parametrize("layout, source", [("messages", "prepared"), ("messages", "jsonl"), ("sharegpt", "jsonl"),
                                            ("prompt_completion", "prepared"), ("prompt_completion", "jsonl")])
def test_chat_sft_step_matches_transformers(setup, auto_tok, run_ctitan, layout, source):  # noqa: F811
    """Before (sharegpt, prompt_completion): the data was refused with a conversion recipe (exit 3)."""
    ref = reference_batch(auto_tok, layout)
    assert 0 < oracle.n_valid(ref[3]) < ref[3].size, "the batch must hold both targets and masked tokens"
    step_matches_transformers(setup, run_ctitan, layout, source, ref, "default")


EVERY_TOKEN = {"training.assistant_only_loss": False, "training.completion_only_loss": False}


@pytest.mark.parametrize("layout, source", [("messages", "prepared"), ("messages", "jsonl"), ("sharegpt", "jsonl"),
                                            ("prompt_completion", "prepared"), ("prompt_completion", "jsonl")])
def test_chat_sft_every_token_step_matches_transformers(setup, auto_tok, run_ctitan, layout, source):  # noqa: F811
    """TRL's defaults for conversations (assistant_only_loss=False), and completion_only_loss=False
    for the prompt-completion layout: the step's loss is transformers' mean over every token of
    the conversations (none of the EOS between them). Before: the keys were unknown (exit 2),
    and the loss was the assistant replies' alone."""
    ref = reference_batch(auto_tok, layout, every_token=True)
    y = ref[3]
    assert 0 < oracle.n_valid(y) < y.size
    assert oracle.n_valid(y) > oracle.n_valid(reference_batch(auto_tok, layout)[3]), "more targets than the default"
    step_matches_transformers(setup, run_ctitan, layout, source, ref, "every",
                              ("--assistant-only-loss", "false", "--completion-only-loss", "false"), EVERY_TOKEN)
