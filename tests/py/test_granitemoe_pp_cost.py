"""The pipeline's split by cost on GraniteMoeShared: its shared MLP is ungated (no [1, H]
shared_expert_gate as qwen2_moe has), so a sparse layer costs the shared MLP's 3 S H
multiply-adds and no more. Expected values: FLOPs per token counted from the transformers
model's own modules (the forward's multiply-adds x 2, as pp.c's layer_cost documents), and a
vocabulary chosen so that one more H per layer would move the split."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from test_dry_run_pp import parse
from test_qwen2_moe_dry_run import _dry, _write

T = 16
BASE = {"model_type": "granitemoeshared", "architectures": ["GraniteMoeSharedForCausalLM"], "hidden_size": 32,
        "intermediate_size": 16, "shared_intermediate_size": 24, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "vocab_size": 64}


def _layer_flops(tmp_path):
    """2 x the multiply-adds per token of one layer of the transformers model: every Linear /
    expert weight a token passes through (attention's projections, k of the experts, the router,
    the shared MLP's weights whatever they are) and the scores and values at T."""
    d = _write(tmp_path / "probe", BASE)
    cfg = AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        layer = AutoModelForCausalLM.from_config(cfg).model.layers[0]
    moe, H, E, k = layer.block_sparse_moe, cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok
    attn = sum(p.numel() for n, p in layer.self_attn.named_parameters() if n.endswith("weight"))
    qd = layer.self_attn.q_proj.weight.shape[0]
    experts = k * sum(p.numel() for p in moe.experts.parameters()) // E
    router = sum(p.numel() for p in moe.router.parameters())
    shared = sum(p.numel() for p in layer.shared_mlp.parameters())
    return 2 * (attn + 2 * qd * T + experts + router + shared), H


def test_granitemoeshared_split_counts_no_shared_gate(tmp_path, run_ctitan):
    """4 sparse layers of cost c over 2 stages, the head (2 V H) on the second: the split at 3
    wins iff c < 2 V H, else (a tie) the earlier cut at 2. V = c / (2 H) + 1 puts 2 V H one
    2H above c: the split is at 3, while a layer counted 2H dearer (a gate GraniteMoeShared does
    not have) ties and cuts at 2."""
    c, H = _layer_flops(tmp_path)
    assert c % (2 * H) == 0, "test setup"
    V = c // (2 * H) + 1
    head = 2 * V * H

    def best(cost):
        return min(range(1, 4), key=lambda k: max(k * cost, (4 - k) * cost + head))
    assert best(c) == 3 and best(c + 2 * H) == 2, "test setup: the 2H does not move the split"
    d = _write(tmp_path / "m", dict(BASE, vocab_size=V))
    _, out, _ = _dry(run_ctitan, d, f"--training.seq_len={T}", "--training.local_batch_size=2",
                     "--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1")
    got = parse(out.decode() if isinstance(out, bytes) else out)["stages"][0]["ranges"]
    assert got == [(0, 3)], f"first stage {got}: layers 0-2 cost 3c < 2c + 2 V H (c = {c}, V = {V})"
