"""Review of flex_olmo (7efbd71) beyond test_families_*: FlexOlmo's post-normed sparse branch
(post_feedforward_layernorm on the experts' sum before the residual add) under the layouts
its tests leave out, each against one process (test_families_dist's tolerances):
context parallel 2 (ring; all-to-all with the aux loss), HSDP (replicate 2 x shard 2), EP 2
with TP 2 (sequence parallel: the branch's rows reduce-scattered before its norm) and FSDP 2,
ZBVZeroBubble's split backward with EP 2 (the experts' gradients whole in I), and frozen
experts (training.freeze: the branch's norm and the router still trained through them)."""
import pytest

from test_dist import assert_same_norms, run, train_args
from test_families_dist import EPS, assert_same, data, model_dir  # noqa: F401 (fixture)

CP2 = ["--parallelism.context_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
A2A = "--parallelism.context_parallel_rotate_method=alltoall"
PP2_MB1 = ["--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_parallel_microbatch_size=1",
           "--training.local_batch_size=1"]
FREEZE = "--training.freeze=model.layers.*.mlp.experts.*"
TOPK, AUX = "flex_olmo_norm_topk_tied", "flex_olmo_aux_hd16"
LAYOUTS = {  # name: (case, ranks, data-parallel ranks, args, args of the one-process run too)
    "cp2_ring": (TOPK, 2, 1, CP2, []),
    "cp2_alltoall_aux": (AUX, 2, 1, CP2 + [A2A], []),
    "hsdp": (TOPK, 4, 4, ["--parallelism.data_parallel_replicate_degree=2",
                          "--parallelism.data_parallel_shard_degree=2"], []),
    "ep2_tp2_sp_fsdp2": (TOPK, 4, 2, ["--parallelism.tensor_parallel_degree=2",
                                      "--parallelism.data_parallel_shard_degree=2",
                                      "--parallelism.expert_parallel_degree=2"], []),
    "zbv_ep2": (TOPK, 4, 2, PP2_MB1 + ["--parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
                                       "--parallelism.data_parallel_shard_degree=2",
                                       "--parallelism.expert_parallel_degree=2"], ["--training.local_batch_size=1"]),
    "frozen_experts_fsdp2": (TOPK, 2, 2, ["--parallelism.data_parallel_shard_degree=2"], [FREEZE]),
    "frozen_experts_ep2": (TOPK, 2, 2, ["--parallelism.data_parallel_shard_degree=2",
                                        "--parallelism.expert_parallel_degree=2"], [FREEZE]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_flex_olmo_layouts_match_one_process(data, name):
    d, tokens = data
    cid, n, dp, extra, both = LAYOUTS[name]
    m = model_dir(d, cid)
    eps = EPS.get(cid, [])
    ref = d / f"r13_{cid}_single_{'_'.join(a.split('=')[-1].replace('*', 'x') for a in both)}"
    if not (ref / "metrics.jsonl").exists():
        run(1, train_args(m, tokens, ref, *eps, *both), timeout=300)
    out = d / f"r13_{name}"
    run(n, train_args(m, tokens, out, *extra, *eps, *both, dp=dp), timeout=300)
    assert_same(out, ref, name)
    assert_same_norms(out, ref, name)


def test_flex_olmo_ep2_final_save_export_import_round_trip(tmp_path, run_ctitan):
    """Under EP 2 x FSDP 2 (4 ranks) the final HF save (rank 0 gathers each layer's experts)
    equals `ctitan export` of the run's own checkpoint of that step, transformers'
    FlexOlmoForCausalLM loads it with the same values, and `ctitan import` of it gives back
    the checkpoint's weights bit for bit."""
    import numpy as np
    from safetensors.numpy import load_file

    import oracle
    import oracle_families as of
    import test_dist as TD
    of.make_config(of.CASE[TOPK]).save_pretrained(tmp_path / "a")
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 128, seed=1))
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'a'}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.steps=2", "--checkpoint.enable",
            "--checkpoint.interval=1", f"--job.dump_folder={tmp_path / 'o'}", "--checkpoint.last_save_in_hf=true",
            "--parallelism.data_parallel_shard_degree=4", "--parallelism.expert_parallel_degree=2"]
    TD.run(4, args, timeout=300)
    ck = tmp_path / "o" / "checkpoint"
    saved = sorted(d for d in ck.iterdir() if d.name.startswith("hf-step-2") or
                   (d.name == "step-2" and (d / "config.json").exists()))
    assert len(saved) == 1, sorted(p.name for p in ck.iterdir())
    hf = saved[0]
    run_ctitan(["export", "--checkpoint", ck / "step-2", "--out", tmp_path / "x"])
    load = lambda d: {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    mine, want = load(hf), load(tmp_path / "x")
    assert set(mine) == set(want) and not [k for k in want if not np.array_equal(mine[k], want[k])]
    assert any(".mlp.experts.3.down_proj." in k for k in mine), sorted(mine)[:12]
    back = of.load(hf, "flex_olmo")
    assert type(back).__name__ == "FlexOlmoForCausalLM"
    files = of.to_file_names("flex_olmo", {k: v.detach() for k, v in back.state_dict().items()})
    bad = [k for k, v in mine.items() if k in files and not np.array_equal(files[k], v)]
    assert not bad and set(mine) <= set(files) | {"lm_head.weight"}, bad
    run_ctitan(["import", "--hf", hf, "--out", tmp_path / "imp", "--step", "2"])
    imp = oracle.read_safetensors_raw(tmp_path / "imp" / "step-2" / "model.safetensors")
    own = oracle.read_safetensors_raw(ck / "step-2" / "model.safetensors")
    strip = lambda hd: {k: (v["dtype"], v["shape"]) for k, v in hd.items() if k != "__metadata__"}
    assert strip(imp[0]) == strip(own[0])
    tensor = lambda raw, k: raw[1][raw[0][k]["data_offsets"][0]:raw[0][k]["data_offsets"][1]]
    bad = [k for k in strip(own[0]) if tensor(imp, k) != tensor(own, k)]
    assert not bad, f"import of the final save differs from the run's checkpoint: {bad[:6]}"


@pytest.mark.parametrize("name,extra", [
    ("fsdp2", ["--parallelism.data_parallel_shard_degree=2"]),
    ("ep2", ["--parallelism.data_parallel_shard_degree=2", "--parallelism.expert_parallel_degree=2"]),
])
def test_flex_olmo_expert_lora_layouts_match_one_process(tmp_path_factory, name, extra):
    """LoRA on the attention and, through lora.target_parameters, the experts (their adapters
    feed the post-normed branch) on FlexOlmo's HF weights: FSDP 2 and EP 2 (2 micro-batches a
    rank) train the adapters like one process with 4 (test_lora_experts_runs' tolerances).
    optimizer.eps 1e-4 (EPS): with 1e-8 the experts' lora_A end 2.4e-4 (FSDP 2) and 4.3e-4 (EP 2)
    of their largest element from one process's, and one process against itself with 2
    micro-batches of 4 in place of 4 of 2 already 4.5e-4 (AdamW's steps on rounding noise); with
    1e-4 all three are within 1e-5."""
    import oracle
    import oracle_families as of
    from test_lora_experts_runs import ATTN, EXP, assert_adapters_match, expert_names
    from test_lora_runs import ckpt, run, train_args as lora_train_args
    d = tmp_path_factory.getbasetemp() / "r13_flex_lora"
    model, data = d / "hf", d / "tokens.bin"
    if not model.exists():
        d.mkdir(parents=True, exist_ok=True)
        of.save(of.build(of.CASE[TOPK]), model)
        oracle.write_bin(data, oracle.learnable_stream(600 * 17, 128, seed=7))
    ref = d / "single"
    if not (ckpt(ref) / "adapter_model.safetensors").exists():
        run(1, lora_train_args(model, data, ref, ATTN, EXP, *EPS[TOPK], accum=4))
    out = d / name
    run(2, lora_train_args(model, data, out, ATTN, EXP, *EPS[TOPK], *extra, ranks=2))
    _, y = assert_adapters_match(out, ref, f"flex_olmo expert LoRA {name}")
    assert expert_names(y)
