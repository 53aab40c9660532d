"""Eleventh mutation audit (stop 53): training.freeze by transformers' fused expert names
freezes the tensors that name holds, not others of the same size.

test_freeze_hf_param_names checks the frozen count only, and an expert's gate, up and down
pieces have the same numel (I x H each): lm_module_param_name naming the gate piece down_proj
(and the down piece gate_up_proj) froze as many numbers and passed. Here OLMoE trains one step
with each name frozen, saved in HF form: exactly the file tensors that make up the frozen
named_parameters() entry (its per-expert gate_proj / up_proj or down_proj) keep their bits."""
import glob

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import oracle


@pytest.mark.parametrize("param,held", [("down_proj", ("down_proj",)), ("gate_up_proj", ("gate_proj", "up_proj"))])
def test_freeze_fused_expert_name_holds_its_pieces(param, held, run_ctitan, tmp_path):
    kw = dict(vocab_size=160, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, num_experts=4,
              num_experts_per_tok=2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("olmoe", **kw)).save_pretrained(tmp_path / "hf")
    before = oracle.read_hf_tensors(tmp_path / "hf")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    rc, out, err = run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'hf'}",
                               f"--checkpoint.initial_load_path={tmp_path / 'hf'}", "--checkpoint.initial_load_in_hf",
                               f"--training.dataset_path={data}", "--training.seq_len=16",
                               "--training.local_batch_size=2", "--training.steps=1", "--optimizer.lr=1e-2",
                               "--lr_scheduler.warmup_steps=0", f"--job.dump_folder={tmp_path / 'o'}",
                               "--checkpoint.enable", "--checkpoint.last_save_in_hf",
                               f"--checkpoint.folder={tmp_path / 'ck'}",
                               f"--training.freeze=model.layers.0.mlp.experts.{param}"], check=False)
    assert rc == 0, err[-1500:]
    saved = glob.glob(str(tmp_path / "ck" / "**" / "model.safetensors"), recursive=True)
    assert len(saved) == 1, saved
    import pathlib
    after = oracle.read_hf_tensors(pathlib.Path(saved[0]).parent)
    experts = [n for n in before if ".mlp.experts." in n]
    assert experts, sorted(before)
    same = sorted(n for n in experts if np.array_equal(np.asarray(before[n]), np.asarray(after[n])))
    want = sorted(n for n in experts if any(f".{h}." in n for h in held))
    assert same == want, (same, want)
