"""review8: training.freeze takes the HF names of GraniteMoE's fused tensors (the names
save_pretrained writes): block_sparse_moe.input_linear / output_linear freeze every
expert's gate+up / down, shared_mlp.input_linear the shared MLP's gate and up. The frozen
count is transformers' parameter count of those tensors."""
import re

import pytest

import oracle
import oracle_families as of


@pytest.mark.parametrize("pat", ["model.layers.*.block_sparse_moe.input_linear.weight",
                                 "model.layers.0.block_sparse_moe.output_linear.weight",
                                 "model.layers.1.shared_mlp.input_linear.weight"])
def test_freeze_by_file_name(pat, tmp_path, run_ctitan):
    import fnmatch
    case = of.CASE["granitemoeshared_narrow_tied"]
    model = of.build(case)
    model.save_pretrained(tmp_path / "a")
    from safetensors.numpy import load_file
    saved = load_file(str(tmp_path / "a" / "model.safetensors"))  # the names save_pretrained writes
    want = sum(v.size for n, v in saved.items() if fnmatch.fnmatchcase(n, pat))
    assert want > 0, f"test setup: the pattern names no tensor of the file: {sorted(saved)}"
    data = oracle.write_bin(tmp_path / "t.bin", oracle.random_tokens(40 * 17, 160, seed=1))
    rc, out, err = run_ctitan(["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'a'}",
                               f"--training.dataset_path={data}", "--training.seq_len=16",
                               "--training.local_batch_size=2", "--training.steps=1",
                               f"--job.dump_folder={tmp_path / 'o'}", f"--training.freeze={pat}"], check=False)
    assert rc == 0, err[-1500:]
    got = int(re.search(r"frozen: (\d+)", err).group(1))
    assert got == want, (got, want)
