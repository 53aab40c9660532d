"""A bad `training.chat_template` is refused naming the key and where it was set.

The template spec is resolved by data/chat.c, shared with `ctitan prepare --chat-template`,
whose message began `chat_template = "nope.jinja": ...`: in a train run it named neither
the key (training.chat_template) nor its source (the TOML file or the command line), which
every config error does (README, "Config walk-through"; docs/reliability.md). Exit 2, as
before.
"""
import json
import shutil

import pytest

import oracle
from test_data_hf import CONVERSATIONS, tokdir  # noqa: F401  (fixture)


@pytest.fixture
def model(tokdir, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer
    path = tmp_path / "hf"
    vocab = len(AutoTokenizer.from_pretrained(str(tokdir)))
    oracle.save_random_hf(path, oracle.tiny_config(vocab=vocab, hidden=32, inter=64, layers=1, heads=4, kv_heads=2,
                                                   head_dim=8))
    for f in tokdir.iterdir():
        shutil.copy(f, path / f.name)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)  # a tokenizer without a template of its own
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return path


def chat_file(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS * 20))
    return p


def args(model, data, out, *extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={data}",
            "--training.steps=1", "--training.seq_len=16", "--training.local_batch_size=1", "--kernels.tune=false",
            "--metrics.peak_tflops=1", f"--job.dump_folder={out}", *extra]


def test_missing_template_file_names_the_key_on_the_command_line(model, run_ctitan, tmp_path):
    missing = tmp_path / "nope.jinja"
    rc, _, err = run_ctitan(args(model, chat_file(tmp_path), tmp_path / "run",
                                 f"--training.chat_template={missing}"), check=False)
    assert rc == 2, err
    assert f'command line: training.chat_template = "{missing}"' in err, err


def test_tokenizer_template_absent_names_the_key_in_the_toml(model, run_ctitan, tmp_path):
    conf = oracle.write_toml(tmp_path / "run.toml", {"training": {"chat_template": "tokenizer"}})
    rc, _, err = run_ctitan(["train", "--config", conf] + args(model, chat_file(tmp_path), tmp_path / "run")[1:],
                            check=False)
    assert rc == 2, err
    assert f'{conf}: training.chat_template = "tokenizer"' in err and "has no chat template" in err, err
