"""A mistyped local model path that has the shape of a Hub id says it is no local directory.

`models/qwen3-tiny` (a folder `models/` next to the command) is an `owner/name` string, so a
typo in the model's own name is looked up on the Hub (docs/hub.md, "Resolution": a local
directory wins, else an id). The error then spoke only of the Hub cache and the network
("config.json (revision main) is not in the Hugging Face cache ..., and HF_HUB_OFFLINE is
set"), never that no such local directory exists: the user looked for a network fault.
transformers' from_pretrained says "... is not a local folder and is not a valid model
identifier". Offline (HF_HUB_OFFLINE=1, an empty cache) the message must say both, and the
exit stays 1 (a missing file, docs/reliability.md).
"""
import os
import subprocess

import pytest

import oracle


@pytest.mark.parametrize("cmd", ["generate", "train", "describe", "import"])
def test_mistyped_owner_name_path_says_no_local_directory(cmd, ctitan_bin, tmp_path):
    models = tmp_path / "models"
    oracle.save_random_hf(models / "qwen3-tiny", oracle.tiny_config(vocab=256, hidden=32, inter=64, layers=1,
                                                                    heads=4, kv_heads=2, head_dim=8))
    oracle.write_bin(tmp_path / "x.bin", oracle.random_tokens(1000, 256, 0))
    typo = "models/qwen3-tinny"
    assert (tmp_path / "models").is_dir() and not (tmp_path / typo).exists()
    args = {"generate": ["generate", "--checkpoint", typo, "--prompt-ids", "1 2"],
            "train": ["train", "--model.spec=hf", f"--model.hf_assets_path={typo}", "--training.dataset_path=x.bin"],
            "describe": ["describe", typo],
            "import": ["import", "--hf", typo, "--out", "ckpt"]}[cmd]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub-cache"), OMP_NUM_THREADS="2")
    p = subprocess.run([str(ctitan_bin)] + args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert typo in p.stderr and "no such local directory" in p.stderr, p.stderr
