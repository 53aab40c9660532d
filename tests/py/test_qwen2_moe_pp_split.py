"""Pipeline stages of a qwen2_moe model balance the shared experts' work.

`ctitan train --dry-run` with pipeline_parallel_degree P splits the layers into contiguous
stages minimising the most expensive one (pp.c, the last stage carrying the lm_head). A
qwen2_moe sparse layer runs, on every token, its shared expert (gate / up / down of width
shared_expert_intermediate_size) and its gate besides the top_k routed experts: with a
wide shared expert the sparse layers cost several dense ones, and a split that counts only
the routed experts puts too many of them on one stage.

Expected: each layer's forward multiply-adds per token counted from transformers' own
modules (every nn.Linear's weight once, the routed experts' top_k / num_experts of theirs,
the attention's scores and values at T), the head's likewise, and the best contiguous split
by brute force; the printed stages must reach its cost."""
from itertools import combinations

import pytest
import torch
from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

import oracle
from test_dry_run import launch, ok
from test_dry_run_pp import T, parse, pp_args

L = 8
CFG = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=L, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=512, mlp_only_layers=[0, 1, 2, 3, 4], decoder_sparse_step=1,
           tie_word_embeddings=False)


def layer_costs(cfg):
    """Forward FLOPs per token of each decoder layer and of the lm_head, from the modules."""
    with torch.device("meta"):
        model = Qwen2MoeForCausalLM(cfg)
    qd = cfg.num_attention_heads * cfg.head_dim
    out = []
    for layer in model.model.layers:
        macs = 2.0 * qd * T  # scores and values over T keys (pp.c's convention, as test_dry_run_pp's)
        for name, mod in layer.named_modules():
            if isinstance(mod, torch.nn.Linear):
                macs += mod.weight.numel()
            elif name.endswith("mlp.gate"):  # the router: one logit per expert
                macs += mod.weight.numel()
        experts = getattr(layer.mlp, "experts", None)
        if experts is not None:
            whole = sum(p.numel() for p in experts.parameters())
            macs += whole * cfg.num_experts_per_tok / cfg.num_experts
        out.append(2.0 * macs)
    return out, 2.0 * model.lm_head.weight.numel()


def best_split(costs, head, P):
    """The least cost of the most expensive stage over every contiguous split into P stages."""
    best = None
    for cuts in combinations(range(1, len(costs)), P - 1):
        bounds = (0, *cuts, len(costs))
        stage = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        stage[-1] += head
        best = max(stage) if best is None else min(best, max(stage))
    return best


@pytest.mark.parametrize("P", [2, 3])
def test_pp_split_counts_the_shared_expert(tmp_path, P):
    cfg = Qwen2MoeConfig(**CFG)
    cfg.save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(64 * (T + 1), 150, seed=3))
    costs, head = layer_costs(cfg)
    routed_only = [c - (2.0 * (3 * cfg.hidden_size * cfg.shared_expert_intermediate_size + cfg.hidden_size)
                        if i not in cfg.mlp_only_layers else 0) for i, c in enumerate(costs)]
    want = best_split(costs, head, P)
    out = ok(launch(0, pp_args(tmp_path / "model", data, tmp_path / "out", P) + ["--dry-run"])).stdout
    stages = parse(out)["stages"]
    got = []
    for s in stages:
        (a, b), = s["ranges"]
        got.append(sum(costs[a:b]) + (head if b == L else 0))
    assert max(got) == pytest.approx(want, rel=1e-12), (out, got, want)
    # guard: the best split by the routed experts alone costs more than the best one here
    bounds = [0]
    for cuts in combinations(range(1, L), P - 1):
        b = (0, *cuts, L)
        if max(sum(routed_only[x:y]) + (head if y == L else 0) for x, y in zip(b, b[1:])) == \
                best_split(routed_only, head, P):
            bounds = b
            break
    blind = max(sum(costs[x:y]) + (head if y == L else 0) for x, y in zip(bounds, bounds[1:]))
    assert blind > want * 1.05, "test setup: the shared experts do not move the split"
