"""training.freeze by the names transformers' named_parameters() gives (journey3, stop 52).

docs/lora.md: `freeze = []  # HF tensor names with * wildcards`. A transformers (5.x) or
PEFT user reads those names off `model.named_parameters()`, which holds a MoE layer's
experts fused (`mlp.experts.gate_up_proj`, `down_proj`; GraniteMoE's under
`block_sparse_moe`, its router `block_sparse_moe.router.weight`) where the safetensors
files keep per-expert tensors (OLMoE) or `input_linear` / `router.layer.weight`
(GraniteMoE). ctitan took the file names only: the names PEFT's `target_parameters` and
torch print were "matches no tensor of this model" (exit 2), with no hint of the spelling
it wanted. The frozen count must be torch's numel of the parameters the pattern matches.
"""
import fnmatch
import re

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import oracle


def _save(kind, path):
    kw = dict(vocab_size=160, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    if kind == "olmoe":
        kw.update(num_experts=4, num_experts_per_tok=2)
    else:
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **kw))
    model.save_pretrained(path)
    return dict(model.named_parameters())


@pytest.mark.parametrize("kind,pat", [
    ("olmoe", "model.layers.*.mlp.experts.gate_up_proj"),
    ("olmoe", "model.layers.1.mlp.experts.down_proj"),
    ("granitemoe", "model.layers.*.block_sparse_moe.experts.gate_up_proj"),
    ("granitemoe", "model.layers.0.block_sparse_moe.router.weight"),
])
def test_freeze_by_named_parameters(kind, pat, run_ctitan, tmp_path):
    params = _save(kind, tmp_path / "hf")
    want = sum(p.numel() for n, p in params.items() if fnmatch.fnmatchcase(n, pat))
    assert want > 0, f"test setup: {pat} names no parameter: {sorted(params)}"
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    rc, out, err = run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'hf'}",
                               f"--training.dataset_path={data}", "--training.seq_len=16",
                               "--training.local_batch_size=2", "--training.steps=1",
                               f"--job.dump_folder={tmp_path / 'o'}", f"--training.freeze={pat}"], check=False)
    assert rc == 0, err[-1500:]
    got = int(re.search(r"frozen: (\d+)", err).group(1))
    assert got == want, (got, want)


def test_freeze_miss_names_the_spelling(run_ctitan, tmp_path):
    _save("granitemoe", tmp_path / "hf")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    rc, out, err = run_ctitan(["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'hf'}",
                               f"--training.dataset_path={data}", "--training.seq_len=16",
                               "--training.local_batch_size=2", "--training.freeze=*.experts.gate_proj"], check=False)
    assert rc == 2, out + err
    assert "training.freeze" in err and "*.experts.gate_proj" in err and "named_parameters" in err, err
