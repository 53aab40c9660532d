"""Streamed checkpoint saves (issue 7): rank 0 writes a distributed checkpoint one unit (the
embedding, a layer, the head) at a time as it is gathered, so its memory during a save no
longer grows with the whole state (12 bytes a parameter: the weights and both AdamW moments
gathered before writing, as ctitan did before), and the files stay the one-process format.

- Memory: a model whose fp32 state (params + moments) is ~60x one layer, FSDP 4 and
  TP 2 x FSDP 2: rank 0's `peak memory` (CTITAN_LOG_RANKS=all) with a full save at the last
  step minus the same run without saving must stay under a quarter of 12 bytes x params.
  The new path needs about 3 units (its gathered part, the received TP parts, the assembled
  unit: a few MiB here) plus the checksum's 1 MiB read buffer; gathering the whole state
  needs all 12 bytes x params (measured: docs/distributed.md), so the bound fails then.
- Format: with lr 0 the weights stay the HF initial weights bit for bit in every layout, so
  model.safetensors of FSDP 4 and TP 2 x FSDP 2 must equal one process's byte for byte;
  optim.safetensors' header (names, order, dtypes, shapes, offsets) too, and its values the
  one-process moments to 1e-4 (they come from gradients summed in another order).
- A write that fails midway on rank 0 (file size limit) ends every rank with an error
  instead of a hang, and leaves no step-N directory."""
import hashlib
import json
import re
import shutil
import struct
import subprocess

import numpy as np
import pytest

import oracle
from test_dist import ENV, mpirun, weights
from conftest import BIN, crashed

LAYOUTS = {  # name: (ranks, args)
    "fsdp4": (4, ["--parallelism.data_parallel_shard_degree=4"]),
    "tp2_fsdp2": (4, ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=2"]),
}


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """24 layers of ~197 K parameters (0.75 MiB fp32 each), embedding and lm_head 32 K each:
    4.8 M parameters, 55 MiB of params + moments."""
    d = tmp_path_factory.mktemp("ckpt_stream")
    cfg = oracle.tiny_config(vocab=256, hidden=128, inter=384, layers=24, heads=4, kv_heads=2, head_dim=32)
    cfg.save_pretrained(d / "model")
    data = oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(4000, 251, seed=3))
    return d, data


def args(d, data, out, *extra):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={d / 'model'}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=1", "--training.global_batch_size=4",
            "--training.steps=2", "--metrics.peak_tflops=1", f"--job.dump_folder={out}", *extra]


def n_params(model_dir):
    with open(model_dir / "model.safetensors", "rb") as f:
        hdr = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    return sum(int(np.prod(v["shape"])) for k, v in hdr.items() if k != "__metadata__")


def rank0_peak(stderr):
    m = re.search(r"rank 0 of \d+: peak memory ([0-9.]+) GiB", stderr)
    assert m, stderr[-3000:]
    return float(m.group(1)) * 2**30


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_save_memory_on_rank0_is_not_the_whole_state(big, tmp_path, name):
    d, data = big
    ranks, extra = LAYOUTS[name]
    env = dict(ENV, CTITAN_LOG_RANKS="all")
    save = ["--checkpoint.enable", "--checkpoint.interval=1000", "--checkpoint.last_save_model_only=false"]
    peak = {}
    for kind, more in (("save", save), ("nosave", [])):
        p = run_env(ranks, args(d, data, tmp_path / kind, *extra, *more), env)
        peak[kind] = rank0_peak(p.stderr)
    assert (tmp_path / "save" / "checkpoint" / "step-2" / "optim.safetensors").exists()
    state = 12 * n_params(tmp_path / "save" / "checkpoint" / "step-2")
    extra_bytes = peak["save"] - peak["nosave"]
    print(f"{name}: rank 0 peak {peak['nosave'] / 2**20:.1f} MiB without saving, {peak['save'] / 2**20:.1f} MiB "
          f"with a save: +{extra_bytes / 2**20:.1f} MiB (whole state {state / 2**20:.1f} MiB)")
    assert extra_bytes < state / 4, (f"{name}: a save adds {extra_bytes / 2**20:.1f} MiB on rank 0, more than a "
                                     f"quarter of the whole state ({state / 2**20:.1f} MiB)")


def run_env(ranks, a, env, check=True, **kw):
    cmd = ([str(BIN)] if ranks == 1 else mpirun() + ["-np", str(ranks), str(BIN)]) + [str(x) for x in a]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, **kw)
    crashed(p.returncode, p.stderr, cmd)
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)}\nexit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    return p


def header_bytes(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return f.read(n)


def sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_streamed_checkpoint_is_the_one_process_format(big, tmp_path):
    d, data = big
    lr0 = ["--optimizer.lr=0", "--checkpoint.enable", "--checkpoint.interval=1000",
           "--checkpoint.last_save_model_only=false"]
    ref = tmp_path / "one"
    run_env(1, args(d, data, ref, *lr0), ENV)
    rck = ref / "checkpoint" / "step-2"
    moments = weights(ref, step=2, file="optim.safetensors")
    for name, (ranks, extra) in LAYOUTS.items():
        out = tmp_path / name
        run_env(ranks, args(d, data, out, *extra, *lr0), ENV)
        ck = out / "checkpoint" / "step-2"
        assert sha(ck / "model.safetensors") == sha(rck / "model.safetensors"), f"{name}: model.safetensors differs"
        for f in ("config.json", "state.json"):
            assert (ck / f).read_bytes() == (rck / f).read_bytes(), f"{name}: {f} differs"
        assert header_bytes(ck / "optim.safetensors") == header_bytes(rck / "optim.safetensors"), name
        assert (ck / "optim.safetensors").stat().st_size == (rck / "optim.safetensors").stat().st_size, name
        got = weights(out, step=2, file="optim.safetensors")
        assert list(got) == list(moments)
        for k, b in moments.items():
            err = np.max(np.abs(got[k] - b)) / max(np.max(np.abs(b)), 1e-12)
            assert err <= 1e-4, f"{name}: {k} differs by {err:.3g}"
        man = json.loads((ck / "manifest.json").read_text())
        assert sorted(man["files"]) == sorted(json.loads((rck / "manifest.json").read_text())["files"])


def test_failed_write_on_rank0_ends_every_rank(big, tmp_path):
    """Rank 0 alone runs under a 12 MiB file size limit with SIGXFSZ ignored, so its
    model.safetensors (19 MiB) fails midway with EFBIG while the other ranks are still sending
    it layers: rank 0 goes on taking part to the end of the save, every rank learns of the
    failure, and the job ends (no rank left waiting in a collective: the run has a timeout)
    with rank 0's error naming the file; no step-N and no temp dir may be left."""
    d, data = big
    ranks, extra = LAYOUTS["tp2_fsdp2"]
    out = tmp_path / "full"
    a = " ".join(str(x) for x in args(d, data, out, *extra, "--checkpoint.enable", "--checkpoint.interval=1"))
    script = (f'if [ "$OMPI_COMM_WORLD_RANK" = 0 ]; then trap "" XFSZ; ulimit -f {12 * 1024}; fi; '
              f'exec {BIN} {a}')
    cmd = mpirun() + ["-np", str(ranks), shutil.which("sh"), "-c", script]
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode != 0, p.stderr[-3000:]
    assert re.search(r"error: \[rank 0\] .*model.safetensors.*File too large", p.stderr), p.stderr[-3000:]
    ck = out / "checkpoint"
    assert not ck.exists() or not any(x.name.startswith((".step-", "step-")) for x in ck.iterdir()), \
        sorted(x.name for x in ck.iterdir())


def test_tp_checkpoint_keeps_the_routing_bias(tmp_path):
    """state.json's moe_expert_bias (load_balance_coeff > 0) under TP 2 x EP 2 equals one
    process's: the save reads the rank's own (replicated) bias, where building the whole model
    on rank 0 for the write used to store that new model's zeros."""
    from transformers import Qwen3MoeConfig
    Qwen3MoeConfig(vocab_size=256, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   max_position_embeddings=256, tie_word_embeddings=False, output_router_logits=False,
                   ).save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(2000, 251, seed=3))
    extra = ["--model.load_balance_coeff=0.001", "--checkpoint.enable", "--checkpoint.last_save_model_only=false"]
    layouts = {"one": (1, []), "tp2_ep2": (4, ["--parallelism.tensor_parallel_degree=2",
                                               "--parallelism.data_parallel_shard_degree=2",
                                               "--parallelism.expert_parallel_degree=2"])}
    bias = {}
    for name, (ranks, more) in layouts.items():
        run_env(ranks, args(tmp_path, data, tmp_path / name, *extra, *more), ENV)
        bias[name] = np.array(json.loads((tmp_path / name / "checkpoint" / "step-2" / "state.json").read_text())
                              ["moe_expert_bias"])
    assert np.any(bias["one"] != 0), bias["one"]
    assert np.max(np.abs(bias["tp2_ep2"] - bias["one"])) <= 1e-6, (bias["tp2_ep2"], bias["one"])
