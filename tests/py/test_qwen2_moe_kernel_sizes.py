"""Kernel tuning times a qwen2_moe model's shared-expert products.

A run measures its kernels at its own sizes (kernels/tune.c): the matmul at the MLP's
gate / up projection (tokens x hidden -> width) and the gated activation over tokens x
width. With every layer sparse a qwen2_moe model has no dense MLP, but every sparse layer
runs its shared expert, a SwiGLU MLP of shared_expert_intermediate_size, through those
kernels: the timed sizes are that width (not the routed experts' moe_intermediate_size,
which run in the MoE kernels). Expected values: the config's own numbers."""
import re
import subprocess

import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import oracle
from conftest import BIN, CHILD_ENV, ROOT, crashed

B, T = 2, 16
H, IS, IM = 40, 72, 24


def test_all_sparse_model_times_the_shared_expert_widths(tmp_path):
    cfg = Qwen2MoeConfig(vocab_size=160, hidden_size=H, intermediate_size=56, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=10, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=IM, shared_expert_intermediate_size=IS,
                         decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    Qwen2MoeForCausalLM(cfg).save_pretrained(str(hf))
    oracle.write_bin(tmp_path / "tokens.bin", oracle.random_tokens(4000, 150, 0))
    out = tmp_path / "out"
    conf = oracle.write_toml(tmp_path / "run.toml", oracle.train_sections(
        out, tmp_path / "tokens.bin", hf, steps=1, local_bs=B, seq_len=T))
    # the suite runs with CTITAN_KERNEL_TUNE=0 (conftest); one HOME of its own: nothing cached
    env = dict(CHILD_ENV, HOME=str(tmp_path / "home"), CTITAN_KERNEL_TUNE="1")
    env.pop("CTITAN_ISA", None)
    # only the two ops under test are timed: the others forced (a forced op times nothing), which keeps
    # the tuning to seconds on a loaded machine
    forced = [f"--kernels.{op}=ref" for op in ("embedding", "rmsnorm", "rope", "attention", "crossentropy", "add",
                                               "adamw", "matmul_bf16", "moe_experts", "moe_experts_bf16", "geglu")]
    p = subprocess.run([str(BIN), "train", "--config", str(conf), *forced], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    crashed(p.returncode, p.stderr, [BIN, "train", conf])
    assert p.returncode == 0, p.stderr
    line = next(l for l in p.stderr.splitlines() if l.startswith("ctitan: kernels:"))
    cache = list((tmp_path / "home").rglob("kernels-v2-*.txt"))
    keys = {l.split()[1]: l.split()[2] for c in cache for l in open(c) if l.startswith("pick ")}
    timed = keys or dict(re.findall(r"\b(\w+)=\w+ \(measured (\S+?)[:;)]", line))
    assert timed.get("matmul") == f"M{B * T}K{H}N{IS}", (timed, line)
    assert timed.get("swiglu", f"n{B * T * IS}") == f"n{B * T * IS}", (timed, line)
