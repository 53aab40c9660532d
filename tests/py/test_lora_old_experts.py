"""Per-expert LoRA adapters of PEFT on transformers v4 (Qwen3-MoE's experts a ModuleList of
Linears, so PEFT saved `...mlp.experts.3.gate_proj.lora_A.weight`, one per expert and
projection) are not a form ctitan reads: transformers v5 fuses the experts and PEFT 0.21
adapts the fused parameters (docs/lora.md). `generate --adapter`, `export --merge` and
training from such an adapter must fail naming a per-expert key of the file and the form
ctitan reads, not with a missing-tensor error about a key the file never had.

PEFT 0.21 on transformers v5 cannot write that form, so the file is written by hand with
PEFT v4's key names (base_model.model. + the module path + .lora_A/.lora_B.weight, A [r, in],
B [out, r]), with the dense layer's MLP and q_proj adapted too as PEFT then did."""
import json
import re

import pytest
import torch
from safetensors.torch import save_file

import oracle_moe
from conftest import hf_session_args
from test_lora import open_error

R, ALPHA = 4, 8
PRE = "base_model.model.model.layers"


class AdapterFile:
    """A hand-written PEFT LoRA adapter: put() adds a module's A [r, in] and B [out, r] under
    PEFT's key names, save() writes the directory as PEFT would."""

    def __init__(self):
        self.g = torch.Generator().manual_seed(1)
        self.sd = {}

    def put(self, path, out, inp):
        self.sd[f"{PRE}.{path}.lora_A.weight"] = 0.1 * torch.randn(R, inp, generator=self.g)
        self.sd[f"{PRE}.{path}.lora_B.weight"] = 0.1 * torch.randn(out, R, generator=self.g)

    def save(self, ad, targets, base):
        ad.mkdir()
        save_file(self.sd, str(ad / "adapter_model.safetensors"))
        (ad / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": R, "lora_alpha": ALPHA, "lora_dropout": 0.0,
            "target_modules": targets, "bias": "none", "use_rslora": False, "base_model_name_or_path": str(base)}))
        return ad


def old_style_adapter(tmp_path):
    cfg = oracle_moe.tiny_moe_config(vocab=256, layers=2, experts=4, top_k=2, mlp_only=(0,))
    oracle_moe.build_moe_model(cfg, seed=3).save_pretrained(str(tmp_path / "hf"))
    H, I, Im, q = cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size, \
        cfg.num_attention_heads * cfg.head_dim
    f = AdapterFile()
    for l in range(2):
        f.put(f"{l}.self_attn.q_proj", q, H)
    for name, (o, i) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
        f.put(f"0.mlp.{name}", o, i)  # layer 0 is dense (mlp_only_layers)
    for e in range(cfg.num_experts):
        for name, (o, i) in {"gate_proj": (Im, H), "up_proj": (Im, H), "down_proj": (H, Im)}.items():
            f.put(f"1.mlp.experts.{e}.{name}", o, i)
    return cfg, f.save(tmp_path / "adapter", ["q_proj", "gate_proj", "up_proj", "down_proj"], tmp_path / "hf")


def assert_names_per_expert_key(err):
    assert re.search(r'"base_model\.model\.model\.layers\.1\.mlp\.experts\.\d\.(gate|up|down)_proj\.lora_[AB]\.weight"',
                     err), err
    assert "per-expert" in err and "mlp.experts.gate_up_proj" in err, err


@pytest.mark.parametrize("cmd", ["generate", "export"])
def test_per_expert_adapter_refused_naming_key(cmd, tmp_path, run_ctitan):
    _, ad = old_style_adapter(tmp_path)
    if cmd == "generate":
        args = ["generate", "--checkpoint", tmp_path / "hf", "--adapter", ad, "--prompt-ids", "5 17 200",
                "--max-tokens", "4", "--ids"]
    else:
        args = ["export", "--checkpoint", tmp_path / "hf", "--adapter", ad, "--merge", "--out", tmp_path / "merged"]
    rc, _, err = run_ctitan(args, check=False)
    assert rc != 0, "a per-expert adapter was accepted"
    assert_names_per_expert_key(err)
    assert not (tmp_path / "merged").exists() or not any((tmp_path / "merged").iterdir()), \
        "export wrote a model from an adapter it cannot read"


def test_per_expert_adapter_refused_in_training(tmp_path, open_session):
    """lora.adapter_path reads the same files: the same refusal."""
    _, ad = old_style_adapter(tmp_path)
    msg = open_error(open_session, hf_session_args(tmp_path / "hf", extra=[
        f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.target_modules=q_proj,gate_proj,up_proj,down_proj",
        f"--lora.adapter_path={ad}"]), tmp_path)
    assert_names_per_expert_key(msg)


def test_mixtral_per_expert_adapter_refused_naming_key(tmp_path, run_ctitan):
    """Mixtral under transformers v4 held its experts as block_sparse_moe.experts.N.w1/w2/w3
    (transformers v5: mlp.experts, fused), so PEFT saved one adapter per expert and weight
    there: refused the same way, naming such a key, not as a missing tensor."""
    import oracle_families as fam
    case = fam.CASE["mixtral_e4k2"]
    cfg = fam.make_config(case)
    fam.save(fam.build(case), tmp_path / "hf")
    H, I = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * (cfg.head_dim or H // cfg.num_attention_heads)  # head_dim None: H / heads
    f = AdapterFile()
    for l in range(cfg.num_hidden_layers):
        f.put(f"{l}.self_attn.q_proj", q, H)
        for e in range(cfg.num_local_experts):
            for name, (o, i) in {"w1": (I, H), "w3": (I, H), "w2": (H, I)}.items():
                f.put(f"{l}.block_sparse_moe.experts.{e}.{name}", o, i)
    ad = f.save(tmp_path / "adapter", ["q_proj", "w1", "w2", "w3"], tmp_path / "hf")
    rc, _, err = run_ctitan(["generate", "--checkpoint", tmp_path / "hf", "--adapter", ad, "--prompt-ids", "5 17 2",
                             "--max-tokens", "4", "--ids"], check=False)
    assert rc != 0, "a per-expert Mixtral adapter was accepted"
    assert re.search(r'"base_model\.model\.model\.layers\.\d\.block_sparse_moe\.experts\.\d\.w[123]\.lora_[AB]\.weight"',
                     err), err
    assert "per-expert" in err and "mlp.experts.gate_up_proj" in err, err
