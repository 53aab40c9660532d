"""LoRA and training.freeze under tensor parallelism (docs/lora.md, Layouts): a column-parallel
projection's B is sliced by rows with its base (a fused Phi3 qkv_proj / gate_up_proj by its row
blocks), its A replicated with a gradient summed over the group; a row-parallel one's (o_proj,
down_proj) A sliced by columns, A x summed over the group before the replicated B; dropout
masks index the whole input.

TP 2, TP 2 x FSDP 2 and PP 2 x TP 2 must train like one process with the same global batch
(test_dist.py's helpers and tolerances): the losses, validation losses and gradient norms to
1e-5 relative, the final checkpoint's trained tensors and adapter_model.safetensors (every
tensor, norm-wise 1e-5), for adapters on all seven projections (dropout 0 and 0.1),
rank_pattern / alpha_pattern, Phi3's fused projections, a Qwen3-MoE's attention and the bf16
frozen base; with training.freeze the final HF export holds the frozen tensors bit for bit
as one process does (no weight decay on them). A checkpoint written by TP 2 resumes on one
process and the reverse; PEFT loads the TP run's adapter (Phi3's fused one too) and gives the
one-process adapter's logits; --dry-run counts this rank's adapter slices (adapters on a
MoE model's experts and routers under TP: test_lora_ep.py). The expected values are one process's run (itself tied to PEFT and PyTorch
by test_lora.py, test_lora_runs.py and test_families_lora.py) and PEFT.

mpirun missing is a failure, not a skip: scripts/setup.sh installs openmpi-bin."""
import subprocess

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import oracle
import oracle_families as fam
import oracle_lora as OL
from conftest import BIN, crashed
from test_dist import ENV, STEPS, assert_same_run, run, train_args
from test_dist_tp import grad_norms

LORA = ["--lora.rank=4", "--lora.alpha=8",
        "--lora.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
PHI3_LORA = ["--lora.rank=4", "--lora.alpha=8", "--lora.target_modules=qkv_proj,o_proj,gate_up_proj,down_proj"]
FREEZE = ("model.embed_tokens.weight,model.layers.0.*,model.layers.1.self_attn.q_norm.weight,"
          "model.layers.1.mlp.down_proj.weight")

CASES = {  # name: (model, data, args)
    "lora": ("model", "tokens", LORA + ["--lora.dropout=0"]),
    # AdamW eps 1e-4 (test_lora_ep.py's reason): at 1e-8 one gradient element of ~1e-8 turns
    # the order of a sum into 1e-5 of its tensor; one process with local_batch_size 4 or 8
    # instead of 2 (the same dropout masks) moved it by 9e-6 after 10 steps, TP 2 by 1.07e-5
    "lora_dropout": ("model", "tokens", LORA + ["--lora.dropout=0.1", "--optimizer.eps=1e-4"]),
    # q_proj at r 2 (a column-parallel A all-reduced at its own width), layer 1's down_proj at r 8,
    # o_proj at alpha 16 (row-parallel: the summed u at another scale)
    "rank_pattern": ("model", "tokens", LORA + [
        "--lora.dropout=0.1", '--lora.rank_pattern={"q_proj": 2, "layers\\\\.1\\\\.mlp\\\\.down_proj": 8}',
        '--lora.alpha_pattern={"o_proj": 16}']),
    # no LoRA: the embedding, layer 0, one q_norm (not its k_norm) and a row-parallel weight frozen;
    # the final save is the HF model, frozen tensors included
    "freeze": ("model", "tokens", [f"--training.freeze={FREEZE}", "--checkpoint.last_save_in_hf=true",
                                   "--checkpoint.last_save_model_only=true"]),
    "bf16_base": ("model", "tokens", LORA + ["--lora.dropout=0", "--training.frozen_dtype=bfloat16"]),
    "phi3": ("phi3", "tokens160", PHI3_LORA + ["--lora.dropout=0.1"]),
    # Qwen3-MoE with adapters on the attention only (the experts' and routers' under TP: test_lora_ep.py)
    "moe_attention": ("moe", "tokens", ["--lora.rank=4", "--lora.alpha=8", "--lora.dropout=0.1",
                                        "--lora.target_modules=q_proj,k_proj,v_proj,o_proj"]),
}
LAYOUTS = {  # name: (ranks, data-parallel degree, args)
    "tp2": (2, 1, []), "tp2_fsdp2": (4, 2, ["--parallelism.data_parallel_shard_degree=2"]),
    "pp2_tp2": (4, 1, ["--parallelism.pipeline_parallel_degree=2",
                       "--parallelism.pipeline_parallel_microbatch_size=2"])}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora_tp")
    # heads 4, kv heads 2, intermediate 48, vocabulary 256: TP 2 divides them; hidden 30: FSDP pieces
    # that do not divide evenly
    oracle.save_random_hf(d / "model", oracle.tiny_config(vocab=256, hidden=30, inter=48, layers=2, heads=4,
                                                          kv_heads=2, head_dim=8), seed=21)
    phi3 = fam.build(fam.Case("phi3_tp", "phi3", dict(pad_token_id=3, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4})), seed=5)  # vocabulary 160, hidden 32, heads 4 / 2
    fam.save(phi3, d / "phi3")
    from transformers import Qwen3MoeConfig
    moe = Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=20,
                         num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
                         norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=256, tie_word_embeddings=False,
                         output_router_logits=False)
    from transformers import Qwen3MoeForCausalLM
    m = Qwen3MoeForCausalLM(moe).to(torch.float32)
    fam.init_weights(m, "qwen3_moe", 13)
    m.save_pretrained(d / "moe")
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    oracle.write_bin(d / "tokens160.bin", oracle.learnable_stream(600 * 17, 160, seed=7))
    return d


def args(d, case, out, *extra, dp=1):
    model, data, a = CASES[case]
    return train_args(d / model, d / f"{data}.bin", out, f"--checkpoint.initial_load_path={d / model}",
                      "--checkpoint.initial_load_in_hf", "--optimizer.weight_decay=0.1",
                      "--checkpoint.last_save_model_only=false", *a, *extra, dp=dp)


@pytest.fixture(scope="module")
def one(setup):
    """One process's run of a case, made once: {case: out}."""
    done = {}

    def get(case):
        if case not in done:
            done[case] = setup / f"one_{case}"
            p = run(1, args(setup, case, done[case]))
            (done[case] / "stderr.txt").write_text(p.stderr)
        return done[case]
    return get


def tp_run(d, case, layout, out, *extra):
    n, dp, a = LAYOUTS[layout]
    return run(n, args(d, case, out, "--parallelism.tensor_parallel_degree=2", *a, *extra, dp=dp))


def adapter(out, step=STEPS):
    return load_file(str(out / "checkpoint" / f"step-{step}" / "adapter_model.safetensors"))


def assert_same_adapter(out, ref, what, step=STEPS):
    a, b = adapter(out, step), adapter(ref, step)
    assert a.keys() == b.keys(), f"{what}: adapter keys {sorted(a.keys() ^ b.keys())}"
    for k in b:
        assert a[k].shape == b[k].shape, f"{what}: {k} shape {a[k].shape} vs {b[k].shape}"
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= 1e-5, f"{what}: adapter {k} differs from one process's by {err:.3g} norm-wise"


def trained_line(stderr):
    lines = [l for l in stderr.splitlines() if l.startswith("ctitan: trained:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("case,layout", [
    ("lora", "tp2"), ("lora", "tp2_fsdp2"), ("lora", "pp2_tp2"), ("lora_dropout", "tp2"), ("rank_pattern", "tp2"),
    ("freeze", "tp2"), ("bf16_base", "tp2"), ("bf16_base", "tp2_fsdp2"), ("phi3", "tp2"), ("moe_attention", "tp2")])
def test_tp_matches_one_process(setup, one, case, layout):
    ref = one(case)
    out = setup / f"{case}_{layout}"
    p = tp_run(setup, case, layout, out)
    what = f"{case} under {layout}"
    if case == "freeze":  # the HF export: every tensor, the frozen ones bit for bit
        assert_same_run(out, ref, what, weights_too=False)
        a = oracle.read_hf_tensors(out / "checkpoint" / f"step-{STEPS}")
        b = oracle.read_hf_tensors(ref / "checkpoint" / f"step-{STEPS}")
        assert a.keys() == b.keys()
        init = oracle.read_hf_tensors(setup / "model")
        for k in b:
            if k in ("model.embed_tokens.weight", "model.layers.1.self_attn.q_norm.weight") or ".layers.0." in k:
                assert np.array_equal(b[k], init[k]), f"one process moved frozen {k}"
                assert np.array_equal(a[k], b[k]), f"{what}: frozen {k} moved"
            else:
                err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
                assert err <= 1e-5, f"{what}: {k} differs from one process's by {err:.3g} norm-wise"
    else:
        assert_same_run(out, ref, what)
        assert_same_adapter(out, ref, what)
    got, want = grad_norms(out), grad_norms(ref)
    assert set(got) == set(want) == set(range(1, STEPS + 1))
    for s in want:
        assert abs(got[s] - want[s]) <= 1e-5 * want[s], f"{what}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"
    # the trained-parameter count is the whole model's, as one process prints it
    assert trained_line(p.stderr) == trained_line((ref / "stderr.txt").read_text())


def test_tp_checkpoint_moves_to_and_from_one_process(setup, one):
    """LoRA with dropout 0.1: stopped at step 4 under TP 2 and resumed on one process, and the
    reverse: the steps after it, the final trained tensors, adapter and AdamW moments equal the
    uninterrupted one-process run's."""
    ref = one("lora_dropout")
    for first, then in (("tp2", "one"), ("one", "tp2")):
        out = setup / f"move_{first}_{then}"
        tp = ["--parallelism.tensor_parallel_degree=2"] if first == "tp2" else []
        p = run(len(tp) + 1, args(setup, "lora_dropout", out, "--training.stop_at_step=4", *tp), check=False)
        assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
        assert (out / "checkpoint" / "step-4" / "adapter_model.safetensors").exists()
        if then == "one":
            p = run(1, args(setup, "lora_dropout", out))
        else:
            p = tp_run(setup, "lora_dropout", "tp2", out)
        assert "resuming from" in p.stderr, p.stderr[-2000:]
        what = f"{first} -> {then}"
        assert_same_run(out, ref, what, steps=range(5, STEPS + 1))
        assert_same_adapter(out, ref, what)
        a = load_file(str(out / "checkpoint" / f"step-{STEPS}" / "optim.safetensors"))
        b = load_file(str(ref / "checkpoint" / f"step-{STEPS}" / "optim.safetensors"))
        assert a.keys() == b.keys()
        for k in b:
            err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
            assert err <= 1e-5, f"{what}: {k} differs by {err:.3g} norm-wise"


@pytest.mark.parametrize("case", ["lora_dropout", "phi3"])
def test_peft_loads_the_tp_adapter(setup, one, case):
    """The adapter of the TP 2 run's final checkpoint (adapter_config.json + adapter_model.safetensors)
    loads into PEFT without a warning, every tensor with its value, and gives the logits of the
    one-process run's adapter; the adapter moves the logits away from the base's."""
    ref = one(case)
    out = setup / f"{case}_tp2"
    if not (out / "checkpoint" / f"step-{STEPS}").exists():
        tp_run(setup, case, "tp2", out)
    model = setup / CASES[case][0]
    vocab = 160 if case == "phi3" else 251
    tokens = oracle.random_tokens(2 * 16, vocab, seed=4).reshape(2, 16)
    with torch.no_grad():
        base_logits = oracle.hf_logits(oracle.load_hf(model), tokens)
    logits = {}
    for name, o in (("tp2", out), ("one", ref)):
        pm = OL.load_adapter_strict(oracle.load_hf(model), o / "checkpoint" / f"step-{STEPS}")
        with torch.no_grad():
            logits[name] = pm(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    err = oracle.rel_err(logits["tp2"], logits["one"])
    assert err <= 1e-5, f"PEFT's logits with the TP 2 adapter vs the one-process adapter: rel err {err:.3g}"
    moved = oracle.rel_err(logits["one"], base_logits)
    assert moved > 1e-3, f"the adapter hardly changes the logits ({moved:.3g}): the comparison proves nothing"


def dry(d, case, *extra):
    model, data, a = CASES[case]
    cmd = [str(BIN), "train", "--model.spec=hf", f"--model.hf_assets_path={d / model}", "--training.seq_len=16",
           "--training.local_batch_size=2", "--dry-run", *a, *extra]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=60)
    crashed(p.returncode, p.stderr, cmd)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout + p.stderr


def test_dry_run_counts_the_adapter_slices(setup, one):
    """--dry-run under TP 2: the trained line is the whole model's (as the one-process dry run
    says), and the per-rank gradient bytes are 4 x this rank's adapter floats, counted here from
    the one-process adapter's shapes: o_proj's and down_proj's A and the other projections' B
    halved, the rest whole."""
    ref = one("rank_pattern")
    half = 0
    for k, v in adapter(ref).items():
        row = ".o_proj." in k or ".down_proj." in k
        half += v.size // 2 if (".lora_A." in k) == row else v.size
    whole = dry(setup, "rank_pattern")
    tp = dry(setup, "rank_pattern", "--parallelism.tensor_parallel_degree=2",
             "--parallelism.data_parallel_shard_degree=1")
    trained = [l.strip() for l in whole.splitlines() if l.strip().startswith("trained:")]
    assert len(trained) == 1 and trained[0] in tp, tp
    rank = tp[tp.index("per rank:"):]
    grads = [l for l in rank.splitlines() if l.strip().startswith("gradients (fp32, trained only)")]
    assert len(grads) == 1, rank
    assert int(grads[0].split()[-2]) == 4 * half, f"per-rank gradient bytes: {grads[0]!r}, want {4 * half}"
