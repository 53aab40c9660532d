"""The dry run and the planner on qwen2_moe's shared expert: the pipeline's split by cost
counts the shared expert's FLOPs, and the activation-size guard (refuse far below a size_t
wrap) counts its width. Expected values: FLOPs per token from the config by Python arithmetic
(the forward's multiply-adds x 2, as pp.c's layer_cost documents)."""
from __future__ import annotations

import json

from test_dry_run_pp import parse

CFG = {"model_type": "qwen2_moe", "architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 256, "hidden_size": 64,
       "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
       "max_position_embeddings": 512, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
       "shared_expert_intermediate_size": 2048, "mlp_only_layers": [1, 2, 3], "tie_word_embeddings": False}
T = 64


def _flops(c, sparse):
    H, hd = c["hidden_size"], c["hidden_size"] // c["num_attention_heads"]
    qd, kvd = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attn = H * (qd + 2 * kvd) + qd * H + 2 * qd * T
    if sparse:  # k experts, the router, the shared expert and its [1, H] gate
        mlp = (c["num_experts_per_tok"] * 3 * H * c["moe_intermediate_size"] + c["num_experts"] * H
               + 3 * H * c["shared_expert_intermediate_size"] + H)
    else:
        mlp = 3 * H * c["intermediate_size"]
    return 2 * (attn + mlp)


def _write(d, cfg):
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "t.bin").write_bytes(b"\x01\x00" * 40960)
    return d


def _dry(run_ctitan, d, *extra, check=True):
    return run_ctitan(["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={d}",
                       f"--training.dataset_path={d / 't.bin'}", "--training.steps=1", f"--job.dump_folder={d / 'o'}",
                       *extra], check=check)


def test_pp_split_counts_the_shared_expert(tmp_path, run_ctitan):
    """Layer 0 sparse with a shared expert 32x the dense MLP's width, layers 1-3 dense: the
    split minimising the costliest stage puts layer 0 alone on the first rank."""
    d = _write(tmp_path / "m", CFG)
    L, V, H = CFG["num_hidden_layers"], CFG["vocab_size"], CFG["hidden_size"]
    cost = [_flops(CFG, l not in CFG["mlp_only_layers"]) for l in range(L)]
    head = 2.0 * V * H
    best = min(range(1, L), key=lambda k: max(sum(cost[:k]), sum(cost[k:]) + head))
    _, out, _ = _dry(run_ctitan, d, f"--training.seq_len={T}", "--training.local_batch_size=2",
                     "--parallelism.pipeline_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1")
    got = parse(out.decode() if isinstance(out, bytes) else out)["stages"][0]["ranges"]
    assert got == [(0, best)], f"first stage {got}, the least costliest-stage split ends it at layer {best}"


def test_activation_guard_counts_the_shared_expert(tmp_path, run_ctitan):
    """shared_expert_intermediate_size 2^31 - 1 on 8 x 2^20 rows: some 10^17 bytes of shared
    expert activations, far past the guard's 2^50 floats (and at 512 x 2^20 rows the planned
    bytes wrap size_t): refused naming the key, as intermediate_size is."""
    d = _write(tmp_path / "huge", dict(CFG, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                       num_attention_heads=1, num_key_value_heads=1, moe_intermediate_size=8,
                                       num_experts=2, num_experts_per_tok=1, mlp_only_layers=[],
                                       max_position_embeddings=1 << 21,
                                       shared_expert_intermediate_size=2 ** 31 - 1))
    rc, out, err = _dry(run_ctitan, d, "--training.seq_len=1048576", "--training.local_batch_size=8", check=False)
    err = err.decode() if isinstance(err, bytes) else err
    assert rc != 0, out
    assert "shared_expert_intermediate_size" in err, err


def test_describe_shows_the_shared_expert(run_ctitan):
    """describe on the published Qwen2-57B-A14B config: the shared expert's width (transformers'
    shared_expert_intermediate_size, as big as the 8 routed experts together) is in the text
    and the JSON."""
    from pathlib import Path
    from transformers import AutoConfig
    from conftest import ROOT
    pub = Path(ROOT) / "tests" / "data" / "hf_configs" / "Qwen2-57B-A14B.json"
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory() as t:
        shutil.copy(pub, Path(t) / "config.json")
        want = AutoConfig.from_pretrained(t).shared_expert_intermediate_size
        _, text, _ = run_ctitan(["describe", t])
        _, js, _ = run_ctitan(["describe", t, "--json"])
    line = [x for x in text.splitlines() if x.startswith("experts:")]
    assert line and f"shared expert {want} wide" in line[0], text
    assert json.loads(js).get("shared_expert_intermediate_size") == want, js


def test_tp_ignores_the_shared_width_without_sparse_layers(tmp_path, run_ctitan):
    """Every layer in mlp_only_layers: transformers builds no shared expert (Qwen2MoeDecoderLayer
    makes each layer a Qwen2MoeMLP), so shared_expert_intermediate_size 41 splits nothing and TP 2
    is accepted, as moe_intermediate_size is ignored there (mesh_resolve's rule); an odd width
    with a sparse layer is still refused naming the key."""
    import oracle
    import oracle_families as fam
    from transformers import AutoModelForCausalLM
    base = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=41)
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(8 * 17, 160, seed=1))
    for name, mlp_only, ok in (("dense", [0, 1], True), ("sparse", [0], False)):
        cfg = fam.make_config(fam.Case(name, "qwen2_moe", dict(base, mlp_only_layers=mlp_only)))
        cfg.save_pretrained(tmp_path / name)
        has_shared = any("shared_expert" in n for n, _ in AutoModelForCausalLM.from_config(cfg).named_parameters())
        assert has_shared != ok, "test setup"
        rc, out, err = run_ctitan(["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / name}",
                                   "--training.seq_len=16", "--training.local_batch_size=2",
                                   f"--training.dataset_path={data}", "--training.steps=1",
                                   f"--job.dump_folder={tmp_path / 'o'}", "--parallelism.data_parallel_shard_degree=1",
                                   "--parallelism.tensor_parallel_degree=2"], check=False)
        if ok:
            assert rc == 0, err
        else:
            assert rc != 0 and "shared_expert_intermediate_size (41)" in err, err
