"""The start-up line "trained: N parameters (P%) of TOTAL" of a LoRA run is PEFT's
print_trainable_parameters (docs/reliability.md, stop 45: checked against
get_nb_trainable_parameters), also when lora.modules_to_save is set.

PEFT wraps each modules_to_save module in a ModulesToSaveWrapper that holds the frozen
original and a trained copy, so its "all params" counts that module twice: once frozen, once
trained (a tied embedding under ensure_weight_tying: one shared copy). ctitan trains the one
tensor; its line must still give PEFT's total and percentage, in the run and in --dry-run.
The oracle is PEFT 0.21's get_nb_trainable_parameters on the same tiny model and settings.
"""
import re

import pytest

import oracle

V = 384
TARGETS = ["q_proj", "v_proj", "o_proj"]
LINE = re.compile(r"trained: (\d+) parameters \(([\d.]+)%.*?\) of (\d+), frozen: (\d+)")


def peft_counts(path, modules_to_save, tied):
    import peft
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(path))
    base = model.num_parameters()  # a tied pair once
    extra = {"ensure_weight_tying": True} if tied else {}
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, modules_to_save=modules_to_save, **extra)
    pm = peft.get_peft_model(model, cfg)
    trainable, total = pm.get_nb_trainable_parameters()
    adapters = sum(p.numel() for n, p in pm.named_parameters() if "lora_" in n)
    return trainable, total, base - (trainable - adapters)  # frozen: the base less the trained modules


@pytest.mark.parametrize("tied,module", [(True, "embed_tokens"), (False, "lm_head"), (False, "norm"),
                                         (False, None)],
                         ids=["tied-embed_tokens", "lm_head", "norm", "none"])
def test_trained_line_is_peft_s_count(tied, module, run_ctitan, tmp_path):
    path = tmp_path / "hf"
    oracle.save_random_hf(path, oracle.tiny_config(vocab=V, hidden=32, inter=64, layers=2, heads=4, kv_heads=2,
                                                   head_dim=8, tied=tied))
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(2000, V, 0))
    trainable, total, frozen = peft_counts(path, [module] if module else None, tied)
    args = ["--model.spec=hf", f"--model.hf_assets_path={path}", f"--training.dataset_path={data}",
            "--training.steps=1", "--training.seq_len=16", "--training.local_batch_size=1", "--lora.rank=4",
            "--lora.alpha=8", "--lora.target_modules=" + ",".join(TARGETS)]
    if module:
        args.append(f"--lora.modules_to_save={module}")
    _, dry, _ = run_ctitan(["train", "--dry-run"] + args)
    _, _, err = run_ctitan(["train"] + args + ["--metrics.peak_tflops=1", "--kernels.tune=false",
                                               f"--job.dump_folder={tmp_path / 'run'}"])
    for where, text in (("run", err), ("dry run", dry)):
        m = LINE.search(text)
        assert m, (where, text)
        got_trained, got_pct, got_total = int(m.group(1)), float(m.group(2)), int(m.group(3))
        assert (got_trained, got_total) == (trainable, total), (where, m.group(0), trainable, total)
        assert got_pct == pytest.approx(100.0 * trainable / total, abs=6e-4), (where, m.group(0))
        assert int(m.group(4)) == frozen, (where, m.group(0), frozen)
