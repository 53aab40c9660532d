"""LoRA on qwen2_moe's shared experts under the parallel layouts, with dropout.

all-linear on qwen2_moe adapts the attention, the dense layers' MLP, every sparse layer's
shared expert and its gate (mlp.shared_expert_gate), as PEFT adapts them (test_families_lora.py ties
them to PEFT on one process). Under TP 2 the shared expert's adapters are split as the
dense MLP's (gate / up B by rows, down A by columns, its A x summed over the ranks before
B; the gate's adapter replicated, whole on every rank as the gate) and under FSDP 2 sharded as any tensor; with lora.dropout > 0 (every layout draws one
process's masks, docs/lora.md) a run of each trains like one process with 2 micro-batches
of 2: every step's loss and pre-clip gradient norm, and the final adapters, to 1e-5.

The reference is one process's run, itself tied to PEFT by test_families_lora.py; a
dropout-free run shows the masks move what is compared by far more than the tolerance.

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import pytest

import oracle
import oracle_families as fam
from test_lora_dropout_layouts import differences, train_args
from test_lora_runs import run

P = "--parallelism."
ONE = [P + "data_parallel_shard_degree=1"]
DROPOUT = 0.2
TARGETS = "all-linear"  # the shared experts, their gates and the dense MLP (and the attention)
LAYOUTS = {  # name: (ranks, local_batch_size, args); the reference: 1 process, 2 micro-batches of 2
    "fsdp2": (2, 2, [P + "data_parallel_shard_degree=2"]),
    "tp2": (2, 2, [P + "tensor_parallel_degree=2"] + ONE),
    "tp2_nosp": (2, 2, [P + "tensor_parallel_degree=2", P + "sequence_parallel=false"] + ONE),
    # every EP rank holds the shared experts and their adapters whole, as the attention's
    "fsdp2_ep2": (2, 2, [P + "data_parallel_shard_degree=2", P + "expert_parallel_degree=2"]),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """qwen2_moe_mlponly_norm_nobias (layer 0 dense, 1 and 2 sparse with shared experts;
    widths TP 2 divides), its aux loss off (not linear in the batch), and a token file."""
    d = tmp_path_factory.mktemp("qwen2_moe_lora_layouts")
    case = fam.CASE["qwen2_moe_mlponly_norm_nobias"]
    base = fam.build(case)
    base.config.output_router_logits = False
    fam.save(base, d / "model")
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(200 * 17, 155, seed=7))
    return d


def one_run(d, name, ranks, local, extra, dropout):
    out = d / f"{name}_{dropout}"
    if not (out / "metrics.jsonl").exists():
        run(ranks, train_args(d / "model", d / "tokens.bin", out, local, *extra, dropout=dropout, targets=TARGETS),
            timeout=240)
    return out


@pytest.fixture(scope="module")
def reference(setup):
    return one_run(setup, "ref", 1, 2, [], DROPOUT)


def test_dropout_matters(setup, reference):
    """Guard: the masks move the compared quantities by far more than the tolerance."""
    plain = one_run(setup, "ref", 1, 2, [], 0.0)
    assert len(differences(reference, plain)) >= 3, "dropout hardly changes the run"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_like_one_process(setup, reference, name):
    ranks, local, extra = LAYOUTS[name]
    out = one_run(setup, name, ranks, local, extra, DROPOUT)
    bad = differences(reference, out)
    assert not bad, f"{name} differs from one process:\n" + "\n".join(bad[:12])
