"""A model directory without config.json, as every command that reads one meets it.

docs/reliability.md's table: a missing file exits 1. generate and import gave 1, describe
and train 2. A PEFT adapter folder given where the base model goes (its
adapter_config.json, as PEFT's save_pretrained writes it) was pointed at --adapter by
generate alone; import said only "no readable config.json", describe and train not even
that. Each now names the base the adapter was trained on (its base_model_name_or_path)
and where the base and the adapter go."""
import json

import pytest

import oracle

# cmd -> (arguments with the model directory D, the option the base goes to, the adapter's)
CMDS = {
    "describe": (lambda D, t: ["describe", D], "the directory to describe", "lora.adapter_path"),
    "generate": (lambda D, t: ["generate", "--checkpoint", D, "--prompt-ids", "1 2", "--ids"], "--checkpoint",
                 "--adapter"),
    "import": (lambda D, t: ["import", "--hf", D, "--out", t / "ck"], "--hf", "lora.adapter_path"),
    "train": (lambda D, t: ["train", "--model.spec=hf", f"--model.hf_assets_path={D}", "--training.steps=1",
                            f"--training.dataset_path={t / 'd.bin'}", f"--job.dump_folder={t / 'run'}"],
              "model.hf_assets_path", "lora.adapter_path"),
    "train --dry-run": (lambda D, t: ["train", "--model.spec=hf", f"--model.hf_assets_path={D}",
                                      f"--training.dataset_path={t / 'd.bin'}", "--dry-run"],
                        "model.hf_assets_path", "lora.adapter_path"),
}


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A PEFT adapter folder saved by PEFT, over a tiny Qwen3 saved by transformers."""
    from peft import LoraConfig, get_peft_model
    d = tmp_path_factory.mktemp("adapter")
    cfg = oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=1, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(d / "base", cfg, seed=1)
    model = oracle.load_hf(d / "base")
    get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"])).save_pretrained(d / "lora")
    oracle.write_bin(d / "d.bin", oracle.random_tokens(200, 128, seed=2))
    return d


def _run(run_ctitan, args):
    rc, _, err = run_ctitan(args, check=False)
    return rc, err


@pytest.mark.parametrize("cmd", sorted(CMDS))
def test_a_folder_without_config_json_exits_1(tmp_path, run_ctitan, cmd, adapter):
    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "d.bin").write_bytes((adapter / "d.bin").read_bytes())
    rc, err = _run(run_ctitan, CMDS[cmd][0](empty, tmp_path))
    assert rc == 1, (rc, err)
    assert f"{empty}" in err and "config.json" in err and "LoRA adapter" not in err, err
    assert not (tmp_path / "ck").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("cmd", sorted(CMDS))
def test_an_adapter_folder_is_pointed_where_it_goes(tmp_path, run_ctitan, cmd, adapter):
    lora = adapter / "lora"
    base_name = json.loads((lora / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert base_name  # PEFT records the base it was made on
    (tmp_path / "d.bin").write_bytes((adapter / "d.bin").read_bytes())
    _, base_as, adapter_as = CMDS[cmd]
    rc, err = _run(run_ctitan, CMDS[cmd][0](lora, tmp_path))
    assert rc == 1, (rc, err)
    assert f"{lora} holds a LoRA adapter, adapter_config.json" in err, err
    assert f"give the base model ({base_name}) as {base_as} and {lora} as " in err and adapter_as in err, err


def test_a_missing_config_file_is_a_config_error(tmp_path, run_ctitan):
    """--config names the run's own config: missing, it exits 2 before any work (the table's
    row for it), not 1 as a missing input file."""
    rc, err = _run(run_ctitan, ["train", "--config", tmp_path / "no-such.toml"])
    assert rc == 2 and f"{tmp_path / 'no-such.toml'}: cannot read" in err, (rc, err)
