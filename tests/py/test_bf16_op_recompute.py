"""Activation checkpointing under training.mixed_precision_param = bfloat16: recomputation
reruns the same forward, so loss, aux loss and every gradient must be bit-identical to no
checkpointing (test_moe / test_families assert it in fp32 only). Run on qwen2_moe (shared
expert), and on qwen3_moe and a dense qwen3 to tell a shared-expert slip from a general one."""
from __future__ import annotations

import numpy as np
import pytest

import oracle
import oracle_families as fam
from conftest import hf_session_args
from test_families import _aux

BF16 = ["--training.mixed_precision_param=bfloat16"]
AC = {"full": ["--activation_checkpoint.mode=full"],
      "op": ["--activation_checkpoint.mode=selective", "--activation_checkpoint.selective_ac_option=op"]}
WIDE = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=96, decoder_sparse_step=2, output_router_logits=True,
            router_aux_loss_coef=0.05, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
CASES = {"qwen2_moe_wide": ("qwen2_moe", WIDE), "qwen2_moe_step2_aux": None, "qwen3_moe_aux": None, "qwen3_": None}


def _case(cid):
    if CASES[cid]:
        fam_, kw = CASES[cid]
        return fam.Case(cid, fam_, kw, seed=13)
    if cid == "qwen3_":
        return next(c for c in fam.CASES if c.family == "qwen3")
    return fam.CASE[cid]


@pytest.mark.parametrize("ac", list(AC))
@pytest.mark.parametrize("cid", list(CASES))
def test_bf16_recompute_is_bitwise(cid, ac, tmp_path, open_session):
    case = _case(cid)
    model = fam.build(case)
    d = fam.save(model, tmp_path / "hf")
    tokens, labels = fam.batch(model, 4, case.T, seed=6, n_ignore=9)
    nv = oracle.n_valid(labels)

    def run(extra):
        s = open_session(hf_session_args(d, batch=2, seq_len=case.T, extra=BF16 + extra))
        s.zero_grad()
        loss = s.forward_backward(tokens[:2], labels[:2], nv) + s.forward_backward(tokens[2:], labels[2:], nv)
        return loss, (_aux(s) if case.moe else None), {n: s.get_grad(n) for n in s.names()}

    base, got = run([]), run(AC[ac])
    assert got[0] == base[0], f"{ac}: loss {got[0]!r} vs {base[0]!r}"
    assert got[1] == base[1], f"{ac}: aux {got[1]!r} vs {base[1]!r}"
    bad = [n for n in base[2] if not np.array_equal(got[2][n], base[2][n])]
    assert not bad, f"{ac}: gradients not bit-identical to no checkpointing: {bad}"
