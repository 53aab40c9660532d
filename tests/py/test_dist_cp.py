"""Context parallel (parallelism.context_parallel_degree, docs/distributed.md): each
sequence split into chunks over cp ranks: by default (context_parallel_load_balancer =
"headtail", PyTorch's and torchtitan's) rank c holds pieces c and 2cp-1-c of 2cp, with "none"
the chunks of consecutive positions.

Every layout must train like one process with the same global batch (test_dist's
helpers and tolerances: losses and validation losses to 1e-5 relative, final weights
norm-wise per tensor to 1e-5), and here also the gradient norms to 1e-5. The one-process
runs are tied to PyTorch by test_train_loop.py and test_families.py (LoRA's and freeze's by
test_lora_runs.py). LoRA, training.freeze and the bf16 frozen base train like one process
too, dropout masks included. CP composed with TP, EP and PP (and FSDP under them) trains like
one process too. A checkpoint written under CP (and CP x TP) resumes on one process and back;
what CP cannot run with is refused."""
import numpy as np
import pytest
from safetensors.numpy import load_file

import oracle
import oracle_families as fam
from test_dist import STEPS, assert_same_run, run, train_args, weights

CP = "--parallelism.context_parallel_degree"
TPD = "--parallelism.tensor_parallel_degree"
EPD = "--parallelism.expert_parallel_degree"
REP = "--parallelism.data_parallel_replicate_degree"
SHARD = "--parallelism.data_parallel_shard_degree"
PPD = "--parallelism.pipeline_parallel_degree"
PPMB = "--parallelism.pipeline_parallel_microbatch_size"
LB1 = "--training.local_batch_size=1"
NONE = "--parallelism.context_parallel_load_balancer=none"  # consecutive chunks instead of headtail's pieces


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("cp")
    # sizes that no world size divides (test_dist's dense model)
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=3, heads=4, kv_heads=2, head_dim=8,
                       tied=False).save_pretrained(d / "model")
    from transformers import Qwen3MoeConfig
    Qwen3MoeConfig(vocab_size=251, hidden_size=30, intermediate_size=49, moe_intermediate_size=20, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=False,
                   ).save_pretrained(d / "model_moe")
    # Gemma3: sliding window 4 on layers 0 and 2 with their own RoPE base, per-head q/k norms,
    # a final soft cap, tied embeddings
    fam.make_config(fam.CASE["gemma3_text"]).save_pretrained(d / "fam_gemma3")
    # Phi3's longrope over T = 16 > original_max_position_embeddings 8: the long factors, which
    # a chunk of 8 positions would not pick; RoPE on 12 of each head's 16 features
    fam.make_config(fam.CASE["phi3_partial075_longrope"]).save_pretrained(d / "fam_phi3")
    # for CP x TP: heads 4, kv heads 2, intermediate 48, vocabulary 256 (an untied,
    # vocabulary-parallel lm_head), which TP 2 divides; the data's tokens are < 251
    oracle.tiny_config(vocab=256, hidden=30, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8,
                       tied=False).save_pretrained(d / "model_tp")
    Qwen3MoeConfig(vocab_size=256, hidden_size=30, intermediate_size=48, moe_intermediate_size=20, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=False,
                   ).save_pretrained(d / "model_moe_tp")
    # Mistral: a sliding window of 5 on every layer, over chunks of 8 positions (vocabulary 160,
    # intermediate 48: TP 2 divides both)
    fam.make_config(fam.CASE["mistral_swa5"]).save_pretrained(d / "fam_mistral")
    # for CP x Interleaved1F1B over 2 ranks (4 stages of a layer each)
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=4, heads=4, kv_heads=2, head_dim=8,
                       tied=False).save_pretrained(d / "model_4l")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    oracle.write_bin(d / "tokens128.bin", oracle.learnable_stream(600 * 17, 128, seed=7))  # the families' vocabulary
    return d, data


def data_for(d, data, model):
    return d / "tokens128.bin" if model.startswith("fam_") else data


_refs = {}


def single(setup, name, model, *extra):
    """The one-process run a layout is compared with (made once per module)."""
    d, data = setup
    if (d, name) not in _refs:
        out = d / f"single_{name}"
        run(1, train_args(d / model, data_for(d, data, model), out, *extra))
        _refs[(d, name)] = out
    return _refs[(d, name)]


def grad_norms(out):
    return {r["step"]: r["grad_norm"] for r in oracle.read_metrics(out / "metrics.jsonl") if "grad_norm" in r}


def aux_losses(out):
    return {r["step"]: r["aux_loss"] for r in oracle.read_metrics(out / "metrics.jsonl") if "aux_loss" in r}


def assert_same_cp(out, ref, what, steps=range(1, STEPS + 1), wtol=1e-5, gtol=1e-5, ltol=1e-5):
    """test_dist's checks (losses and validation losses to 1e-5) and the gradient norms to
    gtol, the final weights norm-wise to wtol (test_dist: 1e-5). Looser only where one
    process against itself with another micro-batch split (the same math) already
    differs by more than 1e-5, measured on these models after 10 steps:
    bf16 (1e-3 both): a last-bit fp32 difference (here the order of the chunks' partial
    sums of d k, d v) flips an element to its neighbouring bf16 value and AdamW spreads
    it: local_batch_size 1 instead of 2 moved the worst tensor by 1.7e-4 and a gradient
    norm by 3.1e-4 (DP 2: 1.0e-4, 1.7e-4; CP 2: 1.0e-4, 1.8e-4).
    load_balance_coeff (weights 1e-4): the bias makes top-k choices near ties, which a
    last-bit difference flips: local_batch_size 1 moved the embedding by 1.01e-5, FSDP 2
    by 6.3e-5 (CP 2: 1.01e-5).
    bf16 losses (ltol 1e-4): the same flips reach the loss. One process against itself with
    the reference attention kernel instead of the default (the same math) moved a step's
    loss by 2.0e-5 relative and the validation loss by 5.5e-6 (AMD Zen 5, avx512bf16
    kernels, 2026-12-07); on the Intel AMX guest the ring stayed under 1e-5 and on Zen 5
    it reached 1.04e-5."""
    assert_same_run(out, ref, what, steps=steps, weights_too=False, ltol=ltol)
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys(), f"{what}: tensor names differ"
    for k in b:
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= wtol, f"{what}: final {k} differs from one rank by {err:.3g} norm-wise"
    got, want = grad_norms(out), grad_norms(ref)
    for s in steps:
        assert abs(got[s] - want[s]) <= gtol * abs(want[s]), f"{what}: step {s} grad_norm {got[s]!r} vs {want[s]!r}"


LAYOUTS = {  # name: (ranks, data-parallel ranks, model, reference, extra)
    "cp2": (2, 1, "model", "dense", [f"{CP}=2"]),
    "cp2_dp2": (4, 2, "model", "dense", [f"{CP}=2", "--parallelism.data_parallel_replicate_degree=2",
                                         "--parallelism.data_parallel_shard_degree=1"]),
    "cp2_fsdp2": (4, 2, "model", "dense", [f"{CP}=2", "--parallelism.data_parallel_shard_degree=2"]),
    "cp2_hsdp2x2_ac_op": (8, 4, "model", "dense", [f"{CP}=2", "--parallelism.data_parallel_replicate_degree=2",
                                                   "--parallelism.data_parallel_shard_degree=2",
                                                   "--activation_checkpoint.mode=selective",
                                                   "--activation_checkpoint.selective_ac_option=op"]),
    "cp4": (4, 1, "model", "dense", [f"{CP}=4"]),
    "cp2_ac_full": (2, 1, "model", "dense", [f"{CP}=2", "--activation_checkpoint.mode=full"]),
    "cp2_bf16": (2, 1, "model", "bf16", [f"{CP}=2", "--training.mixed_precision_param=bfloat16"]),
    "cp2_moe": (2, 1, "model_moe", "moe", [f"{CP}=2"]),
    # torchtitan's aux-loss-free balancing: the bias moves by every chunk's expert counts
    "cp2_moe_bias": (2, 1, "model_moe", "moe_bias", [f"{CP}=2", "--model.load_balance_coeff=1e-3"]),
    "cp4_gemma3": (4, 1, "fam_gemma3", "gemma3", [f"{CP}=4"]),
    "cp2_phi3_longrope": (2, 1, "fam_phi3", "phi3", [f"{CP}=2"]),
    # CP x TP: the CP group is the ranks of one TP index (mesh.h); each runs the padded
    # attention on its own heads, and its TP slice's gradients are summed over the chunks
    "cp2_tp2": (4, 1, "model_tp", "dense_tp", [f"{CP}=2", f"{TPD}=2", f"{SHARD}=1"]),
    "cp2_tp2_fsdp2": (8, 2, "model_tp", "dense_tp", [f"{CP}=2", f"{TPD}=2", f"{SHARD}=2"]),
    "cp2_tp2_mistral_swa5": (4, 1, "fam_mistral", "mistral", [f"{CP}=2", f"{TPD}=2", f"{SHARD}=1"]),
    # CP x EP: the EP group exchanges one chunk's tokens (the ranks of one cp index); one
    # sequence per micro-batch, so the logged load-balancing loss (per micro-batch, of the
    # whole sequences: cp_moe_aux) averages the same sequences' losses however the
    # data-parallel ranks split them
    "cp2_ep2_fsdp2": (4, 2, "model_moe", "moe_lb1", [f"{CP}=2", f"{EPD}=2", f"{SHARD}=2", LB1]),
    "cp2_ep2_dp2_bias": (4, 2, "model_moe", "moe_lb1_bias", [f"{CP}=2", f"{EPD}=2", f"{REP}=2", f"{SHARD}=1", LB1,
                                                            "--model.load_balance_coeff=1e-3"]),
    "cp2_tp2_ep2_fsdp2": (8, 2, "model_moe_tp", "moe_tp_lb1", [f"{CP}=2", f"{TPD}=2", f"{EPD}=2", f"{SHARD}=2",
                                                               LB1]),
    # CP x PP: each stage runs the chunks of the step's micro-batches (pipeline micro-batches of 1
    # sequence: the unit of the logged load-balancing loss, whose routing sums are summed over
    # the stages and then over the chunks)
    "cp2_pp2": (4, 1, "model", "dense", [f"{CP}=2", f"{PPD}=2"]),
    "cp2_pp2_interleaved": (4, 1, "model_4l", "dense_4l", [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1",
                                                          "--parallelism.pipeline_parallel_schedule=Interleaved1F1B"]),
    "cp2_pp2_tp2": (8, 1, "model_tp", "dense_tp", [f"{CP}=2", f"{PPD}=2", f"{TPD}=2", f"{SHARD}=1"]),
    "cp2_pp2_moe_gpipe": (4, 1, "model_moe", "moe_lb1", [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1",
                                                         "--parallelism.pipeline_parallel_schedule=GPipe"]),
    "cp2_pp2_fsdp2_ep2": (8, 2, "model_moe", "moe_lb1", [f"{CP}=2", f"{PPD}=2", f"{PPMB}=1", f"{SHARD}=2",
                                                         f"{EPD}=2", LB1]),
    # the contiguous layout (context_parallel_load_balancer = "none"): consecutive chunks, 2 and 4
    # of them, with Gemma3's windows and per-layer RoPE, and Mistral's window across TP
    "cp2_none": (2, 1, "model", "dense", [f"{CP}=2", NONE]),
    "cp4_none": (4, 1, "model", "dense", [f"{CP}=4", NONE]),
    "cp4_gemma3_none": (4, 1, "fam_gemma3", "gemma3", [f"{CP}=4", NONE]),
    "cp2_tp2_mistral_swa5_none": (4, 1, "fam_mistral", "mistral", [f"{CP}=2", f"{TPD}=2", f"{SHARD}=1", NONE]),
}
REF_EXTRA = {"bf16": ["--training.mixed_precision_param=bfloat16"], "moe_bias": ["--model.load_balance_coeff=1e-3"],
             "moe_lb1": [LB1], "moe_tp_lb1": [LB1], "moe_lb1_bias": [LB1, "--model.load_balance_coeff=1e-3"]}
TOL = {"bf16": dict(wtol=1e-3, gtol=1e-3, ltol=1e-4), "moe_bias": dict(wtol=1e-4),  # assert_same_cp says why
       "moe_lb1_bias": dict(wtol=1e-4)}


def assert_layout(stderr, extra):
    """The start-up line names the layout the run asked for: headtail unless NONE is given."""
    cp = next(a.split("=")[1] for a in extra if a.startswith(CP + "="))
    want = f"context_parallel {cp} ({'contiguous' if NONE in extra else 'headtail'}):"
    assert want in stderr, stderr[-2000:]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_matches_one_rank(setup, name):
    d, data = setup
    n, dp, model, ref, extra = LAYOUTS[name]
    want = single(setup, ref, model, *REF_EXTRA.get(ref, []))
    out = d / name
    p = run(n, train_args(d / model, data_for(d, data, model), out, *extra, dp=dp), timeout=300)
    assert_layout(p.stderr, extra)
    said = {TPD: "x tensor_parallel {} (", EPD: "expert_parallel {}:", PPD: "= pipeline_parallel {} x"}
    for k, words in said.items():  # the layout ran as asked (the start-up log)
        for a in extra:
            if a.startswith(k + "="):
                assert words.format(a.split("=")[1]) in p.stderr, p.stderr[-2000:]
    assert_same_cp(out, want, name, **TOL.get(ref, {}))
    if model.startswith("model_moe"):  # HF's load-balancing loss (logged): of the whole sequences, not a chunk's
        assert any(".mlp.experts." in k for k in weights(out)), "the MoE model has no expert tensors"
        got, exp = aux_losses(out), aux_losses(want)
        assert got.keys() == exp.keys() and all(abs(got[s] - exp[s]) <= 1e-5 * exp[s] for s in exp), (got, exp)


LORA = ["--lora.rank=4", "--lora.alpha=8",
        "--lora.target_modules=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
FROZEN = ("model.embed_tokens.weight", "model.layers.0.")
KEEP = ["--checkpoint.last_save_model_only=false"]
TRAINED = {  # reference: what the one-process run and the CP run both take
    "lora": KEEP + LORA + ["--lora.dropout=0"],
    # AdamW eps 1e-4 (test_lora_ep.py's reason): at 1e-8 a gradient element of ~1e-8 turns the
    # order of a sum into 1e-5 of its tensor; one process with local_batch_size 1 or 8 instead
    # of 2 (the same dropout masks) moved layer 0's up_proj B by 1.7e-5 / 1.1e-5, CP 2 by 1.4e-5
    "lora_dropout": KEEP + LORA + ["--lora.dropout=0.1", "--optimizer.eps=1e-4"],
    "bf16_base": KEEP + LORA + ["--lora.dropout=0", "--training.frozen_dtype=bfloat16"],
    # the final save is the HF model, frozen tensors included
    "freeze": [f"--training.freeze={FROZEN[0]},{FROZEN[1]}*", "--checkpoint.last_save_in_hf=true",
               "--checkpoint.last_save_model_only=true"],
}
ADAPTED = {  # name: (ranks, data-parallel ranks, reference, extra)
    "cp2_lora": (2, 1, "lora", [f"{CP}=2"]),
    # a rank's row t of sequence b is row b T + c T/cp + t of the mask one process draws
    "cp2_lora_dropout": (2, 1, "lora_dropout", [f"{CP}=2"]),
    "cp2_lora_dropout_none": (2, 1, "lora_dropout", [f"{CP}=2", NONE]),
    "cp2_fsdp2_lora": (4, 2, "lora", [f"{CP}=2", "--parallelism.data_parallel_shard_degree=2"]),
    "cp2_freeze": (2, 1, "freeze", [f"{CP}=2"]),
    # the frozen base stored in bf16 (FSDP: its own bf16 shard, no gradient)
    "cp2_bf16_base": (2, 1, "bf16_base", [f"{CP}=2"]),
    "cp2_fsdp2_bf16_base": (4, 2, "bf16_base", [f"{CP}=2", "--parallelism.data_parallel_shard_degree=2"]),
}


def trained_line(stderr):
    lines = [l for l in stderr.splitlines() if l.startswith("ctitan: trained:")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("name", list(ADAPTED))
def test_cp_trains_adapters_and_frozen_models_like_one_rank(setup, name):
    """LoRA (r 4 on all seven projections) and training.freeze under CP: the adapters and the
    trained tensors are replicas whose gradients are summed over the chunks, the frozen ones
    neither summed nor stepped, and dropout masks are drawn for the chunk's global rows. The
    losses, validation losses, gradient norms (1e-5), the final adapter_model.safetensors or
    trained weights (norm-wise 1e-5; frozen ones bit for bit) and the trained-parameter line
    are the one-process run's."""
    d, data = setup
    n, dp, ref, extra = ADAPTED[name]
    key = (d, "trained_" + ref)
    if key not in _refs:
        out = d / f"single_trained_{ref}"
        p = run(1, train_args(d / "model", data, out, *TRAINED[ref]))
        (out / "stderr.txt").write_text(p.stderr)
        _refs[key] = out
    want = _refs[key]
    out = d / name
    p = run(n, train_args(d / "model", data, out, *TRAINED[ref], *extra, dp=dp), timeout=300)
    assert_layout(p.stderr, extra)
    assert_same_run(out, want, name, weights_too=False)
    got, exp = grad_norms(out), grad_norms(want)
    assert set(got) == set(exp) == set(range(1, STEPS + 1)), (got, exp)
    for s in exp:
        assert abs(got[s] - exp[s]) <= 1e-5 * exp[s], f"{name}: step {s} grad_norm {got[s]!r} vs {exp[s]!r}"
    if ref == "freeze":
        a, b = (oracle.read_hf_tensors(o / "checkpoint" / f"step-{STEPS}") for o in (out, want))
        assert any(k.startswith(FROZEN) for k in b), sorted(b)
    else:
        f = f"checkpoint/step-{STEPS}/adapter_model.safetensors"
        a, b = load_file(str(out / f)), load_file(str(want / f))
    assert a.keys() == b.keys() and b, f"{name}: tensor names differ: {sorted(a.keys() ^ b.keys())}"
    for k in b:
        if ref == "freeze" and k.startswith(FROZEN):
            assert np.array_equal(a[k], b[k]), f"{name}: frozen {k} differs from one rank's"
            continue
        err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
        assert err <= 1e-5, f"{name}: final {k} differs from one rank by {err:.3g} norm-wise"
    assert trained_line(p.stderr) == trained_line((want / "stderr.txt").read_text())


@pytest.mark.parametrize("first,then", [(2, 1), (1, 2)])
def test_checkpoint_moves_between_cp_and_one_rank(setup, first, then):
    """Stopped at step 4 under CP 2 and resumed on one process (and back): the steps after
    the checkpoint and the final weights are the uninterrupted one-process run's."""
    d, data = setup
    ref = single(setup, "dense", "model")
    out = d / f"move_cp{first}_to_cp{then}"
    cp = lambda k: [f"{CP}={k}"] if k > 1 else []  # noqa: E731
    stop = ["--training.stop_at_step=4", "--checkpoint.last_save_model_only=false"]
    p = run(first, train_args(d / "model", data, out, *stop, *cp(first)), check=False)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    run(then, train_args(d / "model", data, out, "--checkpoint.last_save_model_only=false", *cp(then)))
    assert_same_cp(out, ref, f"cp {first} -> {then}", steps=range(5, STEPS + 1))


CP_TP = {"one": (1, 1, []), "cp2_tp2": (4, 1, [f"{CP}=2", f"{TPD}=2", f"{SHARD}=1"]),  # ranks, dp, args
         "cp2_tp2_fsdp2": (8, 2, [f"{CP}=2", f"{TPD}=2", f"{SHARD}=2"])}


@pytest.mark.parametrize("first,then", [("cp2_tp2", "one"), ("one", "cp2_tp2"), ("cp2_tp2_fsdp2", "cp2_tp2")])
def test_checkpoint_moves_between_cp_tp_and_one_rank(setup, first, then):
    """A checkpoint (weights and AdamW moments, whole tensors) saved at step 4 under CP 2 x TP 2
    (gathered from chunk 0's TP slices) resumes on one process, and one process's under CP x TP
    (each rank taking its heads' slices); the steps after it and the final weights are the
    uninterrupted one-process run's."""
    d, data = setup
    ref = single(setup, "dense_tp", "model_tp")
    out = d / f"move_{first}_to_{then}"
    stop = ["--training.stop_at_step=4", "--checkpoint.last_save_model_only=false"]
    n, dp, args = CP_TP[first]
    p = run(n, train_args(d / "model_tp", data, out, *stop, *args, dp=dp), check=False, timeout=300)
    assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
    n, dp, args = CP_TP[then]
    run(n, train_args(d / "model_tp", data, out, "--checkpoint.last_save_model_only=false", *args, dp=dp), timeout=300)
    assert_same_cp(out, ref, f"{first} -> {then}", steps=range(5, STEPS + 1))


@pytest.mark.parametrize("ranks,model,args,keys", [
    (1, "model", ["--training.seq_len=15"], ["training.seq_len", "does not divide"]),
    (2, "model", [f"{CP}=4"], ["world size 2"]),
    # headtail's 2 cp pieces must divide seq_len (PyTorch's balancer asks the same); "none" runs it
    (2, "model", ["--training.seq_len=18"], ["parallelism.context_parallel_load_balancer", "headtail",
                                             "training.seq_len = 18", "= 4 pieces"]),
])
def test_cp_refusals_exit_2(setup, tmp_path, ranks, model, args, keys):
    d, data = setup
    cp = [] if any(a.startswith(CP) for a in args) else [f"{CP}=2"]
    p = run(ranks, train_args(d / model, data, tmp_path / "bad", *cp, *args), check=False, timeout=60)
    assert p.returncode == 2, f"exit {p.returncode}\n{p.stderr[-2000:]}"
    err = [l for l in p.stderr.splitlines() if "ctitan: error" in l]
    assert len(err) == 1, f"expected the error once (rank 0):\n{p.stderr[-2000:]}"
    for k in ["parallelism.context_parallel_degree", *keys]:
        assert k in err[0], err[0]


def test_cp_load_balancer_option(setup, tmp_path):
    """parallelism.context_parallel_load_balancer: torchtitan's key, whose default is "headtail"
    (--help says so); its other value None is "none" here (TOML has no None), and "ptrr"
    (FlexAttention's per-document balancing, which ctitan has no use for) is refused, naming
    the values taken."""
    import subprocess
    from conftest import BIN
    p = subprocess.run([str(BIN), "train", "--help"], capture_output=True, text=True, timeout=60)
    entry = p.stdout.split("--parallelism.context_parallel_load_balancer=", 1)[1].split("\n  --", 1)[0]
    assert entry.startswith("<headtail|none>") and '(default: "headtail")' in entry, entry
    d, data = setup
    p = subprocess.run([str(BIN), *train_args(d / "model", data, tmp_path / "bad", f"{CP}=2",
                                              "--parallelism.context_parallel_load_balancer=ptrr"), "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "parallelism.context_parallel_load_balancer: 'ptrr' is not one of: headtail, none" in p.stderr, p.stderr


def test_cp_dry_run_plans_the_chunk_and_the_scratch(setup, tmp_path):
    """--dry-run under CP 2 x FSDP 2: the per-rank world line multiplies out with the cp factor
    (it named replicate x shard x tp alone, 2 for a world of 4), and the attention's
    whole-sequence scratch is one of the lines that make up the total and the planned peak
    (it came after the peak, outside it). Its size is what cp.c's all-gather (the default
    rotate method) allocates, counted here from the model's shapes: k and v gathered, the
    prefix's k, v and their gradients (6 x B T nkv hd), and one headtail piece's q, out, dq,
    d(out) (4 x B L nh hd, L = T / 2cp) and lse (B nh L), in fp32."""
    import re
    import subprocess
    from conftest import BIN
    d, data = setup
    args = [a for a in train_args(d / "model", data, tmp_path / "out", dp=2)
            if not a.startswith("--parallelism.")]
    p = subprocess.run([str(BIN), *args, "--parallelism.data_parallel_shard_degree=2", f"{CP}=2", "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"^per rank: world (\d+) = data_parallel_replicate (\d+) x data_parallel_shard (\d+) x "
                  r"context_parallel (\d+) x tensor_parallel (\d+),", p.stdout, re.M)
    assert m, p.stdout
    world, rep, shard, cp, tp = map(int, m.groups())
    assert (world, cp) == (4, 2) and rep * shard * cp * tp == world, m.group(0)
    section = p.stdout[m.end():]
    lines = dict((k.strip(), int(v)) for k, v in re.findall(r"^  (\S.*?)\s+[0-9.]+ GiB\s+(\d+) bytes$", section, re.M))
    B, T, nh, nkv, hd = 2, 16, 4, 2, 8  # train_args' local batch and seq_len; the model's heads
    bl = B * T // (2 * cp)
    assert lines["context parallel attention scratch"] == 4 * (4 * bl * nh * hd + 6 * B * T * nkv * hd + bl * nh), lines
    parts = [v for k, v in lines.items() if k not in ("total planned per rank", "loading (row block + a slice)",
                                                      "planned peak per rank")]
    assert lines["total planned per rank"] == sum(parts), lines
    assert lines["planned peak per rank"] >= lines["total planned per rank"], lines


def test_cp_tp_dry_run_plans_the_local_heads(setup, tmp_path):
    """--dry-run under CP 2 x TP 2 x FSDP 2 (a world of 8): the per-rank line names all four
    degrees, the model line rank 0's heads (2 of 4 query, 1 of 2 kv), and the attention
    scratch is cp.c's all-gather scratch on those local heads (counted as in
    test_cp_dry_run_plans_the_chunk_and_the_scratch, with nh / tp and nkv / tp)."""
    import re
    import subprocess
    from conftest import BIN
    d, data = setup
    args = [a for a in train_args(d / "model_tp", data, tmp_path / "out", dp=2)
            if not a.startswith("--parallelism.")]
    p = subprocess.run([str(BIN), *args, f"{SHARD}=2", f"{CP}=2", f"{TPD}=2", "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"^per rank: world (\d+) = data_parallel_replicate (\d+) x data_parallel_shard (\d+) x "
                  r"context_parallel (\d+) x tensor_parallel (\d+),", p.stdout, re.M)
    assert m, p.stdout
    assert tuple(map(int, m.groups())) == (8, 1, 2, 2, 2), m.group(0)
    assert "(heads 2/1, intermediate 24, lm_head rows 128 of 256)" in p.stdout, p.stdout
    section = p.stdout[m.end():]
    lines = dict((k.strip(), int(v)) for k, v in re.findall(r"^  (\S.*?)\s+[0-9.]+ GiB\s+(\d+) bytes$", section, re.M))
    B, T, nh, nkv, hd, tp, cp = 2, 16, 4, 2, 8, 2, 2
    bl = B * T // (2 * cp)
    want = 4 * (4 * bl * nh // tp * hd + 6 * B * T * nkv // tp * hd + bl * nh // tp)
    assert lines["context parallel attention scratch"] == want, lines


def test_cp_pp_dry_run_plans_each_stage_on_its_chunk(setup, tmp_path):
    """--dry-run under CP 2 x PP 2 x TP 2 (a world of 8): the pipeline line names the cp degree,
    and each pipeline rank's plan is for micro-batches of the chunk: its point-to-point buffers
    hold 4 messages per micro-batch of 1 x seq_len / cp rows of the hidden size (pp_bind, here
    8 micro-batches: accumulation 4 x local batch 2 / micro-batch 1), and its attention scratch
    is cp.c's all-gather scratch (test_cp_dry_run_plans_the_chunk_and_the_scratch) on TP rank
    0's heads for a micro-batch."""
    import re
    import subprocess
    from conftest import BIN
    d, data = setup
    args = [a for a in train_args(d / "model_tp", data, tmp_path / "out") if not a.startswith("--parallelism.")]
    p = subprocess.run([str(BIN), *args, f"{SHARD}=1", f"{CP}=2", f"{TPD}=2", f"{PPD}=2", "--dry-run"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    assert re.search(r"^pipeline: world 8 = pipeline_parallel 2 x data_parallel_replicate 1 x data_parallel_shard 1 "
                     r"x context_parallel 2 x tensor_parallel 2,", p.stdout, re.M), p.stdout
    stages = re.findall(r"^  pipeline rank (\d+):.*point-to-point (\d+), context parallel attention scratch (\d+);",
                        p.stdout, re.M)
    assert [s[0] for s in stages] == ["0", "1"], p.stdout
    M, mb, T, cp, H, nh, nkv, hd, tp = 8, 1, 16, 2, 30, 4, 2, 8, 2
    bl = mb * T // (2 * cp)
    for _, p2p, scratch in stages:
        assert int(p2p) == 4 * M * 4 * mb * (T // cp) * H, p.stdout
        assert int(scratch) == 4 * (4 * bl * nh // tp * hd + 6 * mb * T * nkv // tp * hd + bl * nh // tp), p.stdout
