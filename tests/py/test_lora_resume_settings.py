"""Resuming a LoRA checkpoint under another adapter scale. PEFT keeps lora_alpha,
use_rslora and alpha_pattern in adapter_config.json beside the weights: the scale
(alpha / r, alpha / sqrt(r) with rsLoRA) is part of the trained model, as the rank and
the target list are. A different rank or target list was refused on resume, a
different alpha or use_rslora silently changed the model; now each is refused naming
the key and both values. lora.dropout only adds noise to training, and may change."""
import pytest

from conftest import tiny_run

LORA = ["--lora.rank=2", "--lora.alpha=4", "--checkpoint.enable", "--checkpoint.interval=2",
        "--checkpoint.last_save_model_only=false"]


@pytest.fixture
def stopped(tmp_path, run_ctitan):
    """A LoRA run stopped at step 2 with a full checkpoint: (its train arguments)."""
    _, _, args = tiny_run(tmp_path, *LORA, steps=4)
    rc, _, err = run_ctitan(args + ["--training.stop_at_step=2"], check=False)
    assert rc == 75, err
    return args


@pytest.mark.parametrize("flag,key,then,now", [
    ("--lora.alpha=8", "lora.alpha", "4", "8"),
    ("--lora.use_rslora=true", "lora.use_rslora", "false", "true"),
    ('--lora.alpha_pattern={"q_proj": 16}', "lora.alpha_pattern", '""', '"{"q_proj": 16}"'),
])
def test_another_adapter_scale_is_refused_on_resume(stopped, run_ctitan, flag, key, then, now):
    rc, _, err = run_ctitan(stopped + [flag], check=False)
    assert rc == 2, err
    assert f"{key} = {then}" in err and f"this run has {now}" in err and "config.toml" in err, err


def test_another_dropout_resumes(stopped, run_ctitan):
    rc, _, err = run_ctitan(stopped + ["--lora.dropout=0.1"], check=False)
    assert rc == 0 and "resuming from" in err and "(step 2)" in err, err


def test_the_same_settings_resume(stopped, run_ctitan):
    rc, _, err = run_ctitan(stopped, check=False)
    assert rc == 0 and "resuming from" in err and "(step 2)" in err, err
