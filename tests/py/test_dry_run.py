"""`ctitan train --dry-run`: the planned memory, before anything is allocated."""
import re

import oracle


def test_dry_run_counts(tmp_path, run_ctitan):
    cfg = oracle.tiny_config(vocab=300, hidden=32, inter=48, layers=3, heads=4, kv_heads=2, head_dim=8)
    model = oracle.save_random_hf(tmp_path / "m", cfg, seed=1)
    n_hf = sum(p.numel() for p in model.parameters())
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(8 * 33, 300, seed=1))
    common = ["--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'm'}", "--training.seq_len=32",
              "--training.local_batch_size=4", f"--training.dataset_path={data}", "--training.steps=1",
              f"--job.dump_folder={tmp_path / 'o'}", "--metrics.peak_tflops=1"]
    plans = {}
    for mode in ("none", "full"):
        _, out, _ = run_ctitan(["train", "--dry-run", f"--activation_checkpoint.mode={mode}"] + common)
        n = int(re.search(r"(\d+) parameters", out).group(1))
        assert n == n_hf, f"dry run counts {n} parameters, transformers {n_hf}"
        plans[mode] = int(re.search(r"activations \+ workspace \(planned\)\s+[0-9.]+ GiB\s+(\d+) bytes", out).group(1))
        assert int(re.search(r"parameters \(fp32\)\s+[0-9.]+ GiB\s+(\d+) bytes", out).group(1)) == 4 * n_hf
        # the run itself plans the same activations (its log says MiB)
        _, _, err = run_ctitan(["train", f"--activation_checkpoint.mode={mode}"] + common)
        mib = float(re.search(r"activations ([0-9.]+) MiB", err).group(1))
        assert abs(mib - plans[mode] / 2**20) < 0.05, (mib, plans[mode])
    assert plans["full"] < plans["none"]
