"""The zero-bubble weight-gradient stores (model/lm.h lm_wstore, pp.c take_wstore) beyond
test_pp_zero_bubble's dense Qwen3: the dry run's `weight-gradient stores B (N of them)` per
pipeline rank against a count made here from transformers' config and torch's order, for the
layouts and tensor tables lm_wstore_floats reads (review9):

- qwen2_moe: dense layers and sparse ones whose shared expert records gate / up / down and
  whose shared_expert_gate [1, H] shares the shared expert's input copy;
- phi3's fused qkv_proj / gate_up_proj and glm's fused gate_up_proj (one input each, as
  the split projections);
- tensor parallel 2 (each rank's local shapes: column-parallel N / 2, row-parallel K / 2, the
  replicated shared gate whole), with and without sequence parallel (whole rows either way);
- context parallel 2 (each rank's half of the rows);
- frozen subsets (training.freeze): k_proj alone of q/k/v, and the shared gate alone trained,
  where a stage with nothing recorded keeps no store.

Per trained projection [N, K] a store holds d(output) [rows, N], plus its input [rows, K] for
o_proj / down_proj and one input [rows, H] per layer for q/k/v and one for gate/up (with the
shared gate); a sparse layer's routed experts their input and d(output) [rows, H], h, d gate and
d up [rows top_k, Im], and the routing (topw, perm [rows top_k], offsets [E + 1]).
The RMSNorms' weight gradients are W's too: per trained norm its input and d(output) [rows, H]
and rstd [rows] (these families' input and post-attention norms, and the final norm on the stage
ending the model), over the rows this rank holds: under sequence parallel its block (ceil(rows /
tp) on rank 0), else all of them.
Each local stage keeps the most I's its order has waiting for their W. A run
checks that the dry run's bytes are what a run allocates (its `their N buffers take B bytes`)."""
import re

import pytest

import oracle
import oracle_families as of
from test_dist import run, train_args
from test_dry_run import launch, ok
from test_pp import MB, PP, SCHED
from test_pp_zero_bubble import torch_order

SEQ = 16  # test_dist.train_args's seq_len
M = 8     # micro-batches of 1: train_args's global batch 8
TP2 = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
FREEZE_Q_V = "--training.freeze=model.layers.*.self_attn.q_proj.weight,model.layers.*.self_attn.v_proj.weight"
# everything but the sparse layers' shared_expert_gate (and the final norm): layer 0 (rank 0's first
# stage) records nothing
FREEZE_BUT_GATE = ("--training.freeze=model.layers.*.self_attn.*,model.layers.*.mlp.shared_expert.*,"
                   "model.layers.*.mlp.gate_proj.weight,model.layers.*.mlp.up_proj.weight,"
                   "model.layers.*.mlp.down_proj.weight,model.layers.*.input_layernorm.weight,"
                   "model.layers.*.post_attention_layernorm.weight")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("zb_stores")
    for name, cid in (("qwen2_moe", "qwen2_moe_step2_aux"), ("phi3", "phi3_longrope_short_swa7"),
                      ("glm", "glm_bias_partial05")):
        case = of.CASE[cid]  # 4 layers: one a stage on PP 2's 4 stages (qwen2_moe: layers 1 and 3 sparse)
        kw = {**case.kw, "num_hidden_layers": 4, "output_router_logits": False}
        of.save(of.build(of.Case(cid, case.family, kw, seed=case.seed)), d / name)
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 160, seed=7))
    return d, data


def norm_floats(cfg, layer, rows, tp, sp, frozen):
    """The floats a store holds for layer's RMSNorms (input_layernorm, post_attention_layernorm: these
    families have no q/k norms) and, on the last layer, the final norm's: input and d(output) [n, H],
    rstd [n], n the rows this rank holds (sequence parallel: rank 0's block)."""
    n = -(-rows // tp) if sp else rows
    count = sum(name not in frozen for name in ("input_layernorm", "post_attention_layernorm"))
    count += layer == cfg.num_hidden_layers - 1 and "norm" not in frozen
    return count * n * (2 * cfg.hidden_size + 1)


def layer_floats(cfg, layer, rows, tp, frozen):
    """The floats one store holds for one layer's projections, from transformers' config."""
    H = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd // tp, cfg.num_key_value_heads * hd // tp
    sparse = cfg.model_type == "qwen2_moe" and (layer + 1) % cfg.decoder_sparse_step == 0
    attn = [("q_proj", "qkv", q, H), ("k_proj", "qkv", kv, H), ("v_proj", "qkv", kv, H), ("o_proj", None, H, q)]
    if sparse:
        Is = cfg.shared_expert_intermediate_size // tp
        mlp = [("shared_expert.gate_proj", "gu", Is, H), ("shared_expert.up_proj", "gu", Is, H),
               ("shared_expert.down_proj", None, H, Is), ("shared_expert_gate", "gu", 1, H)]
    else:
        I = cfg.intermediate_size // tp
        mlp = [("gate_proj", "gu", I, H), ("up_proj", "gu", I, H), ("down_proj", None, H, I)]
    total, groups = 0, set()
    for name, group, N, K in attn + mlp:
        if name in frozen:
            continue
        total += N + (K if group is None else 0)
        if group:
            groups.add(group)
    experts = 0
    if sparse and "experts" not in frozen:
        # the routed experts (op_moe_experts_bwd_w's operands): x and dout [rows, H], h, d gate, d up
        # [rows k, Im], topw and perm [rows k], offsets [E + 1]; every token takes exactly k experts
        S, Im = rows * cfg.num_experts_per_tok, cfg.moe_intermediate_size // tp
        experts = 2 * rows * H + 3 * S * Im + 2 * S + cfg.num_experts + 1
    return rows * (total + H * len(groups)) + experts


def most_pending(P, r):
    pending, most = {}, {}
    for a in torch_order("ZBVZeroBubble", P, 2, M, r):
        v, kind, _ = re.fullmatch(r"(\d+)([FIW])(\d+)", a).groups()
        pending[int(v)] = pending.get(int(v), 0) + {"I": 1, "W": -1}.get(kind, 0)
        most[int(v)] = max(most.get(int(v), 0), pending[int(v)])
    return most


STORES = re.compile(r"^  pipeline rank (\d+): .*?weight-gradient stores (\d+) \((\d+) of them\)", re.M)
CASES = {  # name: (model, ranks of the run (0: dry run only), tp, cp, extra args, frozen projections)
    "qwen2_moe": ("qwen2_moe", 2, 1, 1, [], set()),
    "qwen2_moe_k_only": ("qwen2_moe", 0, 1, 1, [FREEZE_Q_V], {"q_proj", "v_proj"}),
    "qwen2_moe_shared_gate_only": ("qwen2_moe", 2, 1, 1, [FREEZE_BUT_GATE],
                                   {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                                    "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                                    "input_layernorm", "post_attention_layernorm"}),
    "qwen2_moe_tp2": ("qwen2_moe", 4, 2, 1, TP2, set()),
    "phi3": ("phi3", 0, 1, 1, [], set()),
    "glm": ("glm", 0, 1, 1, [], set()),
    "glm_tp2_sp": ("glm", 0, 2, 1, TP2, set()),
    "glm_tp2_no_sp": ("glm", 0, 2, 1, TP2 + ["--parallelism.sequence_parallel=false"], set()),
    "glm_cp2": ("glm", 4, 1, 2, ["--parallelism.context_parallel_degree=2",
                                 "--parallelism.data_parallel_shard_degree=1"], set()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_store_sizes(models, name):
    from transformers import AutoConfig
    d, data = models
    model, n, tp, cp, extra, frozen = CASES[name]
    cfg = AutoConfig.from_pretrained(d / model)
    args = train_args(d / model, data, d / f"out_{name}", *extra, f"{PP}=2", f"{SCHED}=ZBVZeroBubble", f"{MB}=1",
                      "--training.steps=2")
    dry = ok(launch(0, args + ["--dry-run"])).stdout
    got = {int(r): (int(b), int(k)) for r, b, k in STORES.findall(dry)}
    rows = SEQ // cp
    for r in (0, 1):
        most = most_pending(2, r)
        # under the V rank r holds stages r and 3 - r, one layer each (layer = stage)
        sp = tp > 1 and "--parallelism.sequence_parallel=false" not in extra
        per = {v: 4 * (layer_floats(cfg, v, rows, tp, frozen) + norm_floats(cfg, v, rows, tp, sp, frozen))
               for v in (r, 3 - r)}
        want = (sum(most[v] * per[v] for v in per), sum(most[v] for v in per if per[v]))
        assert got.get(r) == want, f"{name}: pipeline rank {r}: dry run {got.get(r)} vs {want} ({per}, {most})"
    if n:  # the run allocates what the dry run counts
        p = run(n, args, timeout=300)
        m = re.search(r"pipeline rank 0 of 2: the weight-gradient stores held at most \d+ bytes per \(stage, "
                      r"micro-batch\); their (\d+) buffers take (\d+) bytes", p.stderr)
        assert m and (int(m.group(2)), int(m.group(1))) == got[0], (m and m.groups(), got[0], p.stderr[-2000:])
