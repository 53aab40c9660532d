"""LoRA on embed_tokens with the frozen base stored in bf16 (training.frozen_dtype = bfloat16)
under TP 2 with sequence parallel, and under TP 2 without it, against one process with the same
storage: each rank's adapter rows are its own rows' (the lookup's and the adapter's token offsets
taken once). The one-process run is the reference; its own parity with PEFT is
test_lora_embed_tokens.py's."""
import numpy as np
import pytest
from safetensors.numpy import load_file

import oracle


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    from test_dist import run, train_args
    d = tmp_path_factory.mktemp("lora_embed_sp_bf16")
    oracle.save_random_hf(d / "model", oracle.tiny_config(vocab=251, hidden=30, inter=48, layers=2, heads=6,
                                                          kv_heads=6, head_dim=8), seed=21)
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))

    def args(out, *extra):
        return train_args(d / "model", d / "tokens.bin", out, f"--checkpoint.initial_load_path={d / 'model'}",
                          "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_model_only=false",
                          "--lora.rank=4", "--lora.alpha=12", "--lora.target_modules=embed_tokens",
                          "--optimizer.eps=1e-4", "--training.frozen_dtype=bfloat16", *extra)
    run(1, args(d / "one"))
    return d, args


@pytest.mark.parametrize("sp", ["true", "false"])
def test_tp2_bf16_embed_adapter_matches_one_process(dist, sp):
    from test_dist import assert_same_run, run
    from test_lora_tp import assert_same_adapter
    d, args = dist
    out = d / f"tp2_sp_{sp}"
    run(2, args(out, "--parallelism.tensor_parallel_degree=2", f"--parallelism.sequence_parallel={sp}"))
    ref = load_file(str(d / "one" / "checkpoint" / "step-10" / "adapter_model.safetensors"))
    assert np.abs(ref["base_model.model.model.embed_tokens.lora_embedding_A"]).max() > 0, "test setup: A did not train"
    assert_same_run(out, d / "one", f"tp2 sp={sp}")
    assert_same_adapter(out, d / "one", f"tp2 sp={sp}")
