"""Vocabulary-parallel embedding and lm_head where the TP degree does not divide the
vocabulary, tied or not: torchtitan's plan shards the vocabulary as a DTensor Shard(0), so
rank r holds rows [r C, min((r + 1) C, V)) with C = ceil(V / t), the last ranks' blocks
shorter or empty. Each run must train like one process (test_dist's 1e-5 on losses,
validation losses, gradient norms and final weights, a bf16-stored frozen base
included). Before, an untied model was refused (mesh.c) and a tied one kept
the whole table and loss on every rank: the dry-run cases show each rank's rows now."""
import subprocess

import numpy as np
import pytest

import oracle
from conftest import BIN
from test_dist import ENV, STEPS, assert_same_norms, assert_same_run, run, train_args, weights

ONE_ROW = ["--training.local_batch_size=1", "--validation.local_batch_size=1", "--training.seq_len=15"]
# name: (vocabulary, tied); heads 12, kv heads 12 and intermediate 48: TP 2, 3 and 4 divide them
MODELS = {"v250": (250, False), "v250t": (250, True), "v257": (257, False), "v257t": (257, True),
          "v21": (21, False), "v21t": (21, True), "v9": (9, False), "v9t": (9, True)}


@pytest.fixture(scope="module")
def vocab_setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_vocab")
    for name, (vocab, tied) in MODELS.items():
        oracle.tiny_config(vocab=vocab, hidden=24, inter=48, layers=2, heads=12, kv_heads=12, head_dim=4,
                           tied=tied).save_pretrained(d / name)
    for vocab in sorted({v for v, _ in MODELS.values()}):
        oracle.write_bin(d / f"tokens{vocab}.bin", oracle.learnable_stream(300 * 17, vocab, seed=7))
    refs = {}

    def single(model, *extra):
        key = (model, extra)
        if key not in refs:
            out = d / f"single_{model}_{len(refs)}"
            run(1, train_args(d / model, data_of(d, model), out, "--checkpoint.last_save_model_only=false", *extra))
            refs[key] = out
        return refs[key]
    return d, single


def data_of(d, model):
    return d / f"tokens{MODELS[model.replace('neg', '')][0]}.bin"


def tp_args(t, sp, *more):
    return [f"--parallelism.tensor_parallel_degree={t}", f"--parallelism.sequence_parallel={str(sp).lower()}",
            "--checkpoint.last_save_model_only=false", *more]


# name: (model, TP degree, ranks, args of both runs, sequence parallel variants)
CASES = {
    # 250 over 3: 84, 84, 82
    "tp3_v250": ("v250", 3, 3, ONE_ROW, (True, False)),
    "tp3_v250_tied": ("v250t", 3, 3, ONE_ROW, (True, False)),
    # 257 over 2: 129, 128; over 4: 65, 65, 65, 62
    "tp2_v257_tied": ("v257t", 2, 2, ONE_ROW, (True,)),
    "tp4_v257": ("v257", 4, 4, ONE_ROW, (True, False)),
    "tp4_v257_tied": ("v257t", 4, 4, ONE_ROW, (False,)),
    # 3 x 7 over 4: 6, 6, 6, 3; over 2: 11, 10
    "tp4_v21": ("v21", 4, 4, ONE_ROW, (True,)),
    "tp2_v21_tied": ("v21t", 2, 2, ONE_ROW, (False,)),
    # 9 over 4: 3, 3, 3 and a rank with none (its max is -inf, its sums 0, its lookup zeros)
    "tp4_v9_empty_rank": ("v9", 4, 4, ONE_ROW, (True, False)),
    "tp4_v9_tied_empty_rank": ("v9t", 4, 4, ONE_ROW, (True,)),
    "tp3_v250_ac_full": ("v250", 3, 3, ONE_ROW + ["--activation_checkpoint.mode=full"], (True,)),
    # two pipeline stages, the tied embedding's copy on the last one (each TP rank's block of it)
    "tp2_pp2_v257_tied": ("v257t", 2, 4, ["--training.seq_len=15"], (True, False),
                          ["--parallelism.pipeline_parallel_degree=2",
                           "--parallelism.pipeline_parallel_microbatch_size=1"]),
    "tp3_pp2_v250_tied": ("v250t", 3, 6, ["--training.seq_len=15"], (True,),
                          ["--parallelism.pipeline_parallel_degree=2",
                           "--parallelism.pipeline_parallel_microbatch_size=1"]),
}
PARAMS = [(n, sp) for n, c in CASES.items() for sp in c[4]]


@pytest.mark.parametrize("name, sp", PARAMS, ids=[f"{n}_{'sp' if sp else 'no_sp'}" for n, sp in PARAMS])
def test_uneven_vocab_matches_one_rank(vocab_setup, name, sp):
    d, single = vocab_setup
    model, t, n, both, _, *more = CASES[name]
    out = d / f"{name}_{sp}"
    p = run(n, train_args(d / model, data_of(d, model), out,
                          *tp_args(t, sp, "--parallelism.data_parallel_shard_degree=1", *(more[0] if more else [])),
                          *both))
    ref = single(model, *both)
    assert_same_run(out, ref, name)
    assert_same_norms(out, ref, name)
    if not more:  # a pipeline stage holds part of the layers: the count is a whole model's
        assert_rank0_split(p, d / model, t)


def assert_rank0_split(p, model_dir, t):
    """Rank 0 runs its ceil(V / t) rows of each vocabulary table (the tied model's one), not
    all V: the count the trainer logs against transformers' shapes (rank0_params)."""
    want = rank0_params(model_dir, t)
    assert f"model hf: {want} parameters on rank 0 of " in p.stderr, (want, p.stderr[-3000:])


def rank0_params(model_dir, t):
    """TP rank 0's parameters from transformers' own tensors: the projections' 1/t (heads,
    intermediate), the vocabulary tables' first Shard(0) chunk, the norms whole."""
    from transformers import AutoConfig, AutoModelForCausalLM
    m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))  # the test models: config only
    n = 0
    for name, w in m.named_parameters():  # a tied lm_head is the embedding: listed once
        if name.endswith("proj.weight"):
            n += w.numel() // t
        elif "embed_tokens" in name or name.startswith("lm_head"):
            n += split_rows(w.shape[0], t)[0][0] * w.shape[1]
        else:
            n += w.numel()
    return n


def test_empty_ranks_max_is_minus_infinity(vocab_setup):
    """Vocabulary 9 over TP 4: rank 3 holds no rows. Every logit near -300 (the embedding's
    rows share a large direction u, lm_head's rows point against it): the row max must come
    from the ranks that hold rows, the empty one's -inf; taking the empty rank's max as 0
    underflows every e^(x - max) to 0 and the loss to infinity."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    d, single = vocab_setup
    if not (d / "v9neg").exists():
        torch.manual_seed(3)
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d / "v9"), dtype=torch.float32)
        u = torch.randn(24)
        u /= u.norm()
        with torch.no_grad():
            m.model.embed_tokens.weight.mul_(0.5).add_(30 * u)
            m.lm_head.weight.mul_(0.5).sub_(60 * u)
        m.save_pretrained(d / "v9neg")
    load = [f"--checkpoint.initial_load_path={d / 'v9neg'}", "--checkpoint.initial_load_in_hf"]
    for sp in (True, False):
        out = d / f"v9neg_{sp}"
        run(4, train_args(d / "v9neg", d / "tokens9.bin", out,
                          *tp_args(4, sp, "--parallelism.data_parallel_shard_degree=1"), *ONE_ROW, *load))
        ref = single("v9neg", *ONE_ROW, *load)
        # losses only: the weights' updates under a residual stream this lopsided round apart
        # (q_proj 2.9e-5 norm-wise), and what is tested here is whether the loss stays finite
        assert_same_run(out, ref, f"v9neg sp={sp}", weights_too=False)


# under FSDP (TP 2 x FSDP 2: each TP index's uneven flat buffer sharded over its FSDP pair)
# and HSDP; the replicas validate one sequence each: one process two at a time
DP = {
    "tp2_fsdp2_v257": ("v257", 2, 4, 2, ["--parallelism.data_parallel_shard_degree=2"]),
    "tp2_fsdp2_v21_tied": ("v21t", 2, 4, 2, ["--parallelism.data_parallel_shard_degree=2"]),
    # FSDP pieces of an empty embedding block (TP rank 3 of 4 holds none of the 9 rows)
    "tp4_fsdp2_v9_empty_rank": ("v9", 4, 8, 2, ["--parallelism.data_parallel_shard_degree=2"]),
    "tp2_dp2_v257_tied": ("v257t", 2, 4, 2, ["--parallelism.data_parallel_replicate_degree=2",
                                             "--parallelism.data_parallel_shard_degree=1"]),
}


@pytest.mark.parametrize("name", list(DP))
def test_uneven_vocab_with_data_parallel(vocab_setup, name):
    d, single = vocab_setup
    model, t, n, dp, args = DP[name]
    out = d / name
    both = ["--training.local_batch_size=1", "--training.seq_len=15"]
    p = run(n, train_args(d / model, data_of(d, model), out, *tp_args(t, True, *args), *both,
                          "--validation.local_batch_size=1", dp=dp))
    assert_rank0_split(p, d / model, t)
    ref = single(model, *both, "--validation.local_batch_size=2")
    assert_same_run(out, ref, name)
    assert_same_norms(out, ref, name)


# a frozen base stored in bf16 (the head's blocks read from the store, the lookup widened from
# it), and LoRA with lm_head / embed_tokens trained whole beside the adapters
FROZEN = {
    "tp3_v250_frozen_bf16_head_embed": ("v250", 3, ["--training.freeze=model.embed_tokens.weight,lm_head.weight",
                                                    "--training.frozen_dtype=bfloat16"]),
    "tp4_v9t_frozen_bf16_embed": ("v9t", 4, ["--training.freeze=model.embed_tokens.weight",
                                             "--training.frozen_dtype=bfloat16"]),
    "tp3_v250_lora_bf16_base": ("v250", 3, ["--lora.rank=4", "--lora.alpha=8",
                                            "--lora.target_modules=q_proj,o_proj,down_proj,up_proj",
                                            "--training.frozen_dtype=bfloat16"]),
    "tp3_v250_lora_save_head_embed": ("v250", 3, ["--lora.rank=4", "--lora.alpha=8",
                                                  "--lora.target_modules=q_proj,o_proj",
                                                  "--lora.modules_to_save=lm_head,embed_tokens"]),
    "tp4_v257t_lora_save_embed": ("v257t", 4, ["--lora.rank=4", "--lora.alpha=8",
                                               "--lora.target_modules=q_proj,down_proj",
                                               "--lora.modules_to_save=embed_tokens"]),
}


@pytest.mark.parametrize("name", list(FROZEN))
def test_uneven_vocab_frozen_and_lora(vocab_setup, name):
    d, single = vocab_setup
    model, t, args = FROZEN[name]
    out = d / name
    both = ONE_ROW + args
    p = run(t, train_args(d / model, data_of(d, model), out,
                          *tp_args(t, True, "--parallelism.data_parallel_shard_degree=1"), *both))
    ref = single(model, *both)
    if "lora" not in name:  # (with LoRA the count includes the adapters)
        assert_rank0_split(p, d / model, t)
    # one process reads the same bf16 store: the same 1e-5 as fp32 (test_tp_sp's tp2_frozen_bf16_embed)
    assert_same_run(out, ref, name)
    assert_same_norms(out, ref, name)
    if "lora" in name:  # the adapter file, gathered to rank 0 (tp_gather_range): modules_to_save whole
        a = weights(out, file="adapter_model.safetensors")
        b = weights(ref, file="adapter_model.safetensors")
        assert a.keys() == b.keys() and b
        if "save_head" in name or "save_embed" in name:
            assert any("embed_tokens" in k for k in b), sorted(b)
        for k in b:
            err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
            assert err <= 1e-5, f"{name}: adapter {k} differs by {err:.3g}"


@pytest.mark.parametrize("gather", [False, True], ids=["parts", "gather"])
@pytest.mark.parametrize("model, t, fsdp", [("v250", 3, 1), ("v250t", 3, 1), ("v9", 4, 1), ("v257", 2, 2)])
def test_uneven_vocab_checkpoint_moves_between_tp_and_one_process(vocab_setup, model, t, fsdp, gather, monkeypatch):
    """Written under TP 3 (blocks 84, 84, 82; TP 4 of 9: 3, 3, 3 and none; TP 2 x FSDP 2 of 257:
    129, 128), resumed on one process, and the reverse: the
    steps after the checkpoint, the final weights and the AdamW moments equal the
    uninterrupted one-process run's (a checkpoint holds whole tensors). Both ways a save
    runs: every rank writing its rows (slice maps from tp_take_rows), and rank 0 writing what
    tp_gather_range brought it (CTITAN_CKPT_GATHER=1, the path of adapter and HF saves)."""
    import test_dist
    if gather:
        monkeypatch.setitem(test_dist.ENV, "CTITAN_CKPT_GATHER", "1")
    d, single = vocab_setup
    # the replicas validate a sequence each: one process validates their two at a time
    common = ["--training.local_batch_size=1", "--training.seq_len=15"]
    val = {"tp": ["--validation.local_batch_size=1"], "one": [f"--validation.local_batch_size={fsdp}"]}
    ref = single(model, *common, *val["one"])
    stop = ["--training.stop_at_step=4", "--checkpoint.last_save_model_only=false"]
    # under TP 2 x FSDP 2 each TP index's flat buffer (its vocabulary block) is sharded over its pair,
    # one sequence per replica per micro-batch: 2 x 2 x 1 = 4 of the global 8, as one process's 2 x 1
    layouts = {"tp": (t * fsdp, tp_args(t, True, f"--parallelism.data_parallel_shard_degree={fsdp}", *val["tp"])),
               "one": (1, val["one"])}
    for first, then in (("tp", "one"), ("one", "tp")):
        (n1, a1), (n2, a2) = layouts[first], layouts[then]
        out = d / f"move_{model}_{t}x{fsdp}_{first}_to_{then}_{gather}"
        p = run(n1, train_args(d / model, data_of(d, model), out, *stop, *common, *a1), check=False)
        assert p.returncode == 75, f"stop_at_step should exit 75 after saving\n{p.stderr[-3000:]}"
        if first == "tp":
            assert_rank0_split(p, d / model, t)
        p = run(n2, train_args(d / model, data_of(d, model), out, "--checkpoint.last_save_model_only=false",
                               *common, *a2))
        assert "resuming from" in p.stderr, p.stderr[-2000:]
        assert_same_run(out, ref, f"{first} -> {then}", steps=range(5, STEPS + 1))
        a, b = weights(out, file="optim.safetensors"), weights(ref, file="optim.safetensors")
        assert a.keys() == b.keys() and a
        for k in b:
            err = np.linalg.norm(a[k] - b[k]) / max(np.linalg.norm(b[k]), 1e-30)
            assert err <= 1e-5, f"{first} -> {then}: moment {k} differs by {err:.3g}"


def split_rows(vocab, t):
    import torch
    from torch.distributed.tensor.placement_types import Shard
    shards, pads = Shard(0)._split_tensor(torch.empty(vocab), t, with_padding=True)
    sizes = [int(x.numel()) - pad for x, pad in zip(shards, pads)]
    return sizes + [0] * (t - len(sizes)), int(shards[0].numel())


@pytest.mark.parametrize("model, t", [("v250", 3), ("v250t", 3), ("v257", 4), ("v257t", 2), ("v21", 4),
                                      ("v9t", 4), ("v250", 4)])
def test_dry_run_names_each_ranks_vocabulary_rows(vocab_setup, model, t):
    d, _ = vocab_setup
    vocab, tied = MODELS[model]
    args = train_args(d / model, data_of(d, model), d / "dry", *tp_args(t, True), "--dry-run",
                      "--parallelism.data_parallel_shard_degree=1")
    p = subprocess.run([str(BIN), *map(str, args)], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    sizes, chunk = split_rows(vocab, t)
    line = (f"  vocabulary rows per TP rank {', '.join(map(str, sizes))} (chunks of {chunk}, as DTensor Shard(0) "
            f"cuts them)\n")
    assert line in p.stdout, (line, p.stdout[-3000:])
    # rank 0's block (the largest) is what the memory figures count
    here = f"  embedding: rows 0..{chunk - 1} of {vocab} here ({chunk * 24} parameters"
    assert here in p.stdout, (here, p.stdout[-3000:])
    assert f"lm_head rows {chunk} of {vocab})" in p.stdout, p.stdout[-3000:]
