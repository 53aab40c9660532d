"""oracle_moe.py: the transformers Qwen3MoeForCausalLM reference for ctitan's MoE tests.

Expected values only come from transformers (eager experts, eager attention, fp32)
and torch autograd; nothing here reads a number ctitan produced. transformers 5
keeps each layer's experts fused in memory (mlp.experts.gate_up_proj [E, 2*Im, H],
mlp.experts.down_proj [E, H, Im]) but save_pretrained writes HF's per-expert keys
(mlp.experts.E.{gate,up,down}_proj.weight), which is what ctitan names its tensors:
`per_expert` maps the former to the latter (gate rows first, as the experts'
forward chunks the fused output).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import oracle


def tiny_moe_config(vocab=128, hidden=32, inter=40, layers=2, heads=4, kv_heads=2, head_dim=16,
                    experts=4, top_k=2, moe_inter=24, norm_topk_prob=True, sparse_step=1,
                    mlp_only=(), aux=False, aux_coef=0.01, tied=False, rope_theta=1e4) -> Qwen3MoeConfig:
    """head_dim=None leaves it out of config.json (Qwen3MoeConfig then uses hidden // heads)."""
    kw = dict(head_dim=head_dim) if head_dim is not None else {}
    cfg = Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=1e-6,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=moe_inter,
        norm_topk_prob=norm_topk_prob, decoder_sparse_step=sparse_step, mlp_only_layers=list(mlp_only),
        output_router_logits=aux, router_aux_loss_coef=aux_coef, tie_word_embeddings=tied, use_cache=False,
        attn_implementation="eager", **kw)
    cfg._experts_implementation = "eager"
    return cfg


def build_moe_model(cfg, seed=0, std=0.1, norm_jitter=0.2) -> Qwen3MoeForCausalLM:
    """fp32 model with seeded weights (matrices N(0, std), norm weights 1 + U(-j, j))."""
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    model = Qwen3MoeForCausalLM(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + norm_jitter * (2 * torch.rand(p.shape, generator=g) - 1))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    model.eval()
    return model


def per_expert(named: dict) -> dict[str, np.ndarray]:
    """{HF in-memory name: tensor} -> {saved / ctitan name: ndarray}, experts split."""
    out = {}
    for n, t in named.items():
        a = t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
        if n.endswith("mlp.experts.gate_up_proj"):
            base = n[: -len("gate_up_proj")]
            im = a.shape[1] // 2
            for e in range(a.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = a[e, :im]
                out[f"{base}{e}.up_proj.weight"] = a[e, im:]
        elif n.endswith("mlp.experts.down_proj"):
            base = n[: -len("down_proj")]
            for e in range(a.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = a[e]
        else:
            out[n] = a
    return out


def expected_names(model) -> set[str]:
    names = set(per_expert(dict(model.named_parameters())))
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")
    else:
        names.add("lm_head.weight")
    return names


def forward(model, tokens, labels, aux: bool):
    """(CE sum over valid labels, aux loss or None, logits, router logits per MoE layer)."""
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    out = model(input_ids=tokens, output_router_logits=True)
    logits = out.logits.float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                         ignore_index=oracle.IGNORE, reduction="sum")
    return ce, (out.aux_loss if aux else None), logits, out.router_logits


def loss_and_grads(model, tokens, labels, aux: bool):
    """As Qwen3MoeForCausalLM.forward adds it: mean CE + router_aux_loss_coef * aux_loss
    (aux on) and d(that)/d every parameter in ctitan's names. Also the aux loss alone
    (HF's load_balancing_loss_func), the logits and the smallest gap between the k-th and
    (k+1)-th router probability over every token and MoE layer (ties make top-k ambiguous)."""
    model.zero_grad(set_to_none=True)
    ce, aux_loss, logits, router = forward(model, tokens, labels, aux)
    loss = ce / oracle.n_valid(labels)
    if aux:
        loss = loss + model.config.router_aux_loss_coef * aux_loss
    loss.backward()
    grads = per_expert({n: p.grad for n, p in model.named_parameters()})
    model.zero_grad(set_to_none=True)
    k = model.config.num_experts_per_tok
    gaps, loads = [], []
    for rl in router:
        p = torch.softmax(rl.detach().float(), dim=-1)
        top = torch.topk(p, min(k + 1, p.shape[-1]), dim=-1).values
        if top.shape[-1] > k:
            gaps.append(float((top[:, k - 1] - top[:, k]).min()))
        idx = torch.topk(p, k, dim=-1).indices.reshape(-1)
        loads.append(np.bincount(idx.numpy(), minlength=p.shape[-1]))
    return {"loss": loss.item(), "aux": None if aux_loss is None else float(aux_loss.detach()),
            "logits": logits.detach().numpy(), "grads": grads, "min_gap": min(gaps) if gaps else 1.0,
            "loads": loads}


# --------------------------------------------------------------------------- torchtitan's expert bias

def patch_expert_bias(model) -> dict:
    """torchtitan's aux-loss-free balancing on an HF model: every sparse layer's router
    chooses its experts by probs + expert_bias but weights them by the probs alone, and
    counts the tokens each expert receives. Returns {layer: (bias, counts)} (fp32)."""
    state = {}
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or type(gate).__name__ != "Qwen3MoeTopKRouter":
            continue
        bias = torch.zeros(gate.num_experts)
        counts = torch.zeros(gate.num_experts)

        def fwd(hidden_states, gate=gate, bias=bias, counts=counts):
            h = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(h, gate.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            idx = torch.topk(probs + bias, gate.top_k, dim=-1).indices
            val = probs.gather(1, idx)
            if gate.norm_topk_prob:
                val = val / val.sum(dim=-1, keepdim=True)
            counts += torch.bincount(idx.reshape(-1), minlength=gate.num_experts).float()
            return logits, val.to(logits.dtype), idx

        gate.forward = fwd
        state[i] = (bias, counts)
    return state


def update_expert_bias(state, coeff):
    """torchtitan's optimizer step pre-hook: bias += coeff * sign(mean - count), re-centred."""
    with torch.no_grad():
        for bias, counts in state.values():
            d = coeff * torch.sign(counts.mean() - counts)
            bias += d - d.mean()
            counts.zero_()
