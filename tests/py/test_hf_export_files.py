"""A run's Hugging Face outputs as a transformers user takes them (the user-journey audit):
the final save of `checkpoint.last_save_in_hf` and `ctitan export` must both leave a directory
that save_pretrained would have left after fine-tuning: the source model's bos/eos token ids
in config.json, its tokenizer and generation_config.json beside the weights. A run folder
whose newest step is that final save exports it (it is the run's model, not a damaged
checkpoint); a run extended past it keeps it (hf-step-N); `export --merge` takes the
tokenizer from its base directory. Checked with transformers itself (AutoConfig,
AutoTokenizer, GenerationConfig, AutoModelForCausalLM), not with ctitan's own numbers."""
import json
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file

import oracle
import oracle_lora as OL
from conftest import BIN, CHILD_ENV, ROOT
from test_data_hf import tokdir  # noqa: F401  (fixture: a BPE tokenizer with ChatML specials)

V = 768  # above the fixture tokenizer's 700 ids
STEPS = 8


@pytest.fixture(scope="module")
def src(tmp_path_factory, tokdir):  # noqa: F811
    """A source model directory as the Hub has them: config.json with Qwen3's token ids
    (bos <|endoftext|>, eos <|im_end|>), generation_config.json, the tokenizer files."""
    from tokenizers import Tokenizer
    d = tmp_path_factory.mktemp("src")
    tk = Tokenizer.from_file(str(tokdir / "tokenizer.json"))
    bos, eos = tk.token_to_id("<|endoftext|>"), tk.token_to_id("<|im_end|>")
    assert bos is not None and eos is not None and bos != eos
    cfg = oracle.tiny_config(vocab=V, hidden=32, inter=48, layers=1, heads=4, kv_heads=2, head_dim=8)
    cfg.bos_token_id, cfg.eos_token_id = bos, eos
    cfg.save_pretrained(d)  # config.json only: the runs initialise from training.seed
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokdir / f, d / f)
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos, "eos_token_id": [eos, bos], "do_sample": False}))
    assert json.loads((d / "config.json").read_text())["eos_token_id"] == eos
    return d


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return oracle.write_bin(tmp_path_factory.mktemp("data") / "d.bin", oracle.learnable_stream(40 * 17 + 5, V, seed=4))


def train_args(src, data, out, *extra, steps=STEPS):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={src}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", f"--training.steps={steps}",
            "--training.seed=5", "--metrics.log_freq=4", f"--job.dump_folder={out}", "--checkpoint.enable",
            "--checkpoint.interval=4", "--checkpoint.keep_latest_k=0", "--checkpoint.last_save_in_hf", *extra]


def assert_like_save_pretrained(d, src):
    """transformers reads d as it read src: the token ids in config.json and
    generation_config.json, the tokenizer, and the model with every tensor."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    want, got = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(d)
    assert got.eos_token_id is not None and got.eos_token_id == want.eos_token_id, (got.eos_token_id, want.eos_token_id)
    assert got.bos_token_id == want.bos_token_id, (got.bos_token_id, want.bos_token_id)
    gen_want, gen_got = GenerationConfig.from_pretrained(src), GenerationConfig.from_pretrained(d)
    assert gen_got.eos_token_id == gen_want.eos_token_id, (gen_got.eos_token_id, gen_want.eos_token_id)
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.convert_tokens_to_ids("<|im_end|>") == want.eos_token_id
    assert tok("hello world")["input_ids"] == AutoTokenizer.from_pretrained(src)("hello world")["input_ids"]
    oracle.load_hf(d, dtype=torch.float32)  # asserts no missing or unexpected tensor


def weights(d):
    return {k: v.float() for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def finished(src, data, tmp_path_factory):
    """A finished run: full checkpoint step-4, final save step-8 (last_save_in_hf)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    p = subprocess.run([str(BIN)] + [str(x) for x in train_args(src, data, out)], cwd=ROOT, env=CHILD_ENV,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ck = out / "checkpoint"
    assert not (ck / f"step-{STEPS}" / "manifest.json").exists() and (ck / "step-4" / "manifest.json").exists()
    return ck


def test_load_step_of_a_final_save_says_what_it_is(finished, src, data, tmp_path, run_ctitan):
    """checkpoint.load_step naming the final save called it "damaged" (exit 3); it is a model
    with nothing to resume from: exit 2, saying so and what it can do (a review)."""
    out = tmp_path / "run"
    shutil.copytree(finished.parent, out)
    rc, _, err = run_ctitan(train_args(src, data, out, f"--checkpoint.load_step={STEPS}", steps=STEPS + 4),
                            check=False)
    assert rc == 2 and "a finished run's final save" in err and "damaged" not in err, (rc, err[-2000:])


def test_export_of_a_run_folder_takes_its_final_save(finished, tmp_path, run_ctitan):
    """Issue 1: the newest step-N is the run's final model, not a damaged checkpoint."""
    fin = finished / f"step-{STEPS}"
    _, stdout, err = run_ctitan(["export", "--checkpoint", finished, "--out", tmp_path / "exp"])
    assert "damaged" not in err and "manifest.json" not in err, err
    assert f"step-{STEPS}" in stdout, stdout
    a, b = weights(fin), weights(tmp_path / "exp")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the export is not the final model"
    oracle.load_hf(tmp_path / "exp", dtype=torch.float32)
    # named directly, as a step-N: exported as well (here in bfloat16)
    _, _, err = run_ctitan(["export", "--checkpoint", fin, "--out", tmp_path / "exp2", "--dtype", "bfloat16"])
    assert "damaged" not in err, err
    assert oracle.hf_dtypes(tmp_path / "exp2") == {"BF16"}


def test_final_hf_save_is_what_save_pretrained_leaves(finished, src):
    """Issue 3, the trainer's side: tokenizer, generation_config.json, token ids."""
    assert_like_save_pretrained(finished / f"step-{STEPS}", src)


def test_export_keeps_the_token_ids(finished, src, tmp_path, run_ctitan):
    """Issue 3, export's side: a mid-run checkpoint's export has its tokenizer (copied from
    model.hf_assets_path) and the ids of the model the run started from."""
    run_ctitan(["export", "--checkpoint", finished / "step-4", "--out", tmp_path / "exp4"])
    assert_like_save_pretrained(tmp_path / "exp4", src)


def test_mid_run_checkpoint_keeps_the_token_ids(finished, src):
    """A mid-run checkpoint's step-N is also a Hugging Face directory (config.json and
    model.safetensors, docs/checkpoints.md) that transformers loads as it is; its config.json
    lacked the source's bos/eos ids (the final save and export have them), so with no
    generation_config.json beside it transformers' generate never stopped at <|im_end|>.
    Checked with transformers: the config's ids, the model's generation config, and a
    greedy generate whose first token is forced to be the end token stops there."""
    from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
    ck = finished / "step-4"
    assert (ck / "manifest.json").exists() and not (ck / "generation_config.json").exists()
    want, got = AutoConfig.from_pretrained(src), AutoConfig.from_pretrained(ck)
    assert (got.bos_token_id, got.eos_token_id) == (want.bos_token_id, want.eos_token_id), \
        ((got.bos_token_id, got.eos_token_id), (want.bos_token_id, want.eos_token_id))
    model = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    assert model.generation_config.eos_token_id == want.eos_token_id, model.generation_config.eos_token_id
    eos = want.eos_token_id

    class Eos(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = torch.full_like(scores, -float("inf"))
            scores[:, eos] = 0
            return scores

    prompt = torch.tensor([[1, 2, 3]])
    out = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0,
                         logits_processor=LogitsProcessorList([Eos()]))
    assert out[0, 3:].tolist() == [eos], out.tolist()


def test_final_hf_save_generates_and_trains_on(finished, src, tmp_path, run_ctitan):
    """The final save is a model directory to use as it is: ctitan generate reads its
    tokenizer, and a next run takes it as model.hf_assets_path (tokenizing text with it)."""
    fin = finished / f"step-{STEPS}"
    _, stdout, _ = run_ctitan(["generate", "--checkpoint", fin, "--prompt", "hello world", "--max-tokens", "3",
                                "--ids"])  # a random model: ids, its text may cut a UTF-8 sequence
    assert stdout.strip(), "generate printed nothing"
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"hello world number {i} and some more words"}) + "\n"
                            for i in range(60)))
    nxt = tmp_path / "next"
    run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={fin}", f"--checkpoint.initial_load_path={fin}",
                "--checkpoint.initial_load_in_hf", f"--training.dataset_path={docs}", "--training.seq_len=16",
                "--training.local_batch_size=2", "--training.steps=2", f"--job.dump_folder={nxt}",
                "--checkpoint.enable", "--checkpoint.last_save_in_hf"])
    assert_like_save_pretrained(nxt / "checkpoint" / "step-2", src)


def test_extending_a_finished_run_keeps_its_final_export(src, data, tmp_path, run_ctitan):
    out = tmp_path / "run"
    run_ctitan(train_args(src, data, out))
    ck = out / "checkpoint"
    fin = ck / f"step-{STEPS}"
    before = {f.name: f.read_bytes() for f in fin.iterdir()}
    _, _, err = run_ctitan(train_args(src, data, out, steps=STEPS + 4))
    assert "damaged" not in err, err
    assert "resuming from" in err and "step-4" in err, err
    # the export moved aside whole, with a note; step-8 is now a training checkpoint
    kept = ck / f"hf-step-{STEPS}"
    assert f"hf-step-{STEPS}" in err, err
    assert kept.is_dir() and {f.name: f.read_bytes() for f in kept.iterdir()} == before
    assert (fin / "manifest.json").exists()
    assert_like_save_pretrained(ck / f"step-{STEPS + 4}", src)
    # a later run ending at that step again (from step-4) puts its final save beside the kept
    # one: the moved-aside model was deleted to make room for it (a review)
    _, _, err = run_ctitan(train_args(src, data, out, "--checkpoint.load_step=4", steps=STEPS))
    again = ck / f"hf-step-{STEPS}.2"
    assert again.is_dir() and f"goes to {again}" in err, (sorted(p.name for p in ck.iterdir()), err[-2000:])
    assert {f.name: f.read_bytes() for f in kept.iterdir()} == before
    assert_like_save_pretrained(again, src)


def test_export_carries_chat_template_jinja(finished, src, tmp_path, run_ctitan):
    """transformers >= 4.43 saves a tokenizer's chat template as chat_template.jinja beside
    tokenizer_config.json, and that file wins over tokenizer_config.json's "chat_template"
    when it loads: an export from a model directory holding one must carry it, or the
    exported tokenizer renders chats with another template. The template here differs from
    the fixture's ChatML in tokenizer_config.json, so a missing copy shows."""
    from transformers import AutoTokenizer
    tok_src = tmp_path / "tok"
    shutil.copytree(src, tok_src)
    template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}: {{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant: {% endif %}")
    (tok_src / "chat_template.jinja").write_text(template)
    want = AutoTokenizer.from_pretrained(tok_src).chat_template
    assert want == template  # the file is what transformers takes, not tokenizer_config.json's
    run_ctitan(["export", "--checkpoint", finished / "step-4", "--tokenizer", tok_src, "--out", tmp_path / "exp"])
    assert AutoTokenizer.from_pretrained(tmp_path / "exp").chat_template == want
    assert (tmp_path / "exp" / "chat_template.jinja").read_text() == template


def test_merge_takes_the_tokenizer_from_its_base(src, tmp_path, run_ctitan):
    """Issue 4: with --merge, the base HF directory is the default tokenizer source."""
    from transformers import AutoConfig
    base = tmp_path / "base"
    oracle.save_random_hf(base, AutoConfig.from_pretrained(src), seed=3)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, base / f)
    OL.make_peft(oracle.load_hf(base), r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1).save_pretrained(
        str(tmp_path / "adapter"))
    _, stdout, err = run_ctitan(["export", "--checkpoint", base, "--adapter", tmp_path / "adapter", "--merge",
                                 "--out", tmp_path / "merged"])
    assert "warning" not in err, err
    assert "0 tokenizer files" not in stdout, stdout
    assert_like_save_pretrained(tmp_path / "merged", src)


def test_start_up_log_names_the_trained_parameters_and_the_data_once(src, data, tmp_path, run_ctitan):
    """Issue 5: a LoRA run logs what PEFT's print_trainable_parameters prints (the counts
    equal PEFT's own for the same adapter settings), and the data line comes once."""
    import re
    _, _, err = run_ctitan(train_args(src, data, tmp_path / "lora", "--lora.rank=4", "--lora.alpha=8",
                                      "--lora.target_modules=q_proj,v_proj", steps=1))
    m = re.search(r"^ctitan: trained: (\d+) parameters \(([\d.]+)%.*\) of (\d+)", err, re.M)
    assert m, err
    pm = OL.make_peft(oracle.build_model(oracle.tiny_config(vocab=V, hidden=32, inter=48, layers=1, heads=4,
                                                            kv_heads=2, head_dim=8)),
                      r=4, alpha=8, targets=["q_proj", "v_proj"])
    trainable, total = pm.get_nb_trainable_parameters()
    assert (int(m.group(1)), int(m.group(3))) == (trainable, total), (m.group(0), trainable, total)
    data_lines = [ln for ln in err.splitlines() if re.match(r"ctitan: data:? \S+: \d+ tokens", ln)]
    assert len(data_lines) == 1, data_lines
