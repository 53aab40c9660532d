"""review8: lora.modules_to_save over GraniteMoE's fused tensors (shared_mlp, block_sparse_moe):
the adapter file must load in PEFT (PeftModel.from_pretrained over transformers' model) or the
run must be refused naming the fused tensor; before, ctitan wrote shared_mlp.gate_proj.weight
and the like, and PEFT failed with KeyError shared_mlp.input_linear.weight."""
import pytest

import oracle
import oracle_families as of


@pytest.mark.parametrize("mts", ["shared_mlp", "block_sparse_moe"])
def test_modules_to_save_fused(mts, tmp_path, run_ctitan):
    from peft import PeftModel
    case = of.CASE["granitemoeshared_narrow_tied"]
    of.build(case).save_pretrained(tmp_path / "a")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    a = tmp_path / "a"
    rc, _, err = run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={a}",
                             f"--checkpoint.initial_load_path={a}", "--checkpoint.initial_load_in_hf",
                             f"--training.dataset_path={data}", "--training.seq_len=16",
                             "--training.local_batch_size=2", "--training.steps=1", f"--job.dump_folder={tmp_path / 'o'}",
                             "--lora.rank=4", "--lora.target_modules=q_proj", f"--lora.modules_to_save={mts}",
                             "--checkpoint.enable", "--checkpoint.last_save_in_hf=true"], check=False)
    if rc != 0:
        assert rc == 2 and "fused tensor" in err and "input_linear" in err, err[-1500:]
        return
    base = of.prepare_loaded(of.load(a, case.family), case.family)
    PeftModel.from_pretrained(base, str(tmp_path / "o" / "checkpoint" / "step-1"))
