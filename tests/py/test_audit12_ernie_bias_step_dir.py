"""Twelfth mutation audit (docs/reliability.md): a training checkpoint's step-N of ERNIE 4.5 MoE
opened as a Hugging Face directory (checkpoint.initial_load_path, the ctypes session). Its
model.safetensors holds the table's tensors; the frozen e_score_correction_bias lives in its
state.json, which hf_load_each reads beside it. With that read dropped the suite passed (it
exports step-N through `ctitan export`, which reads state.json itself). The oracle:
transformers' logits on the export of the same step-N must be ctitan's on the step-N itself."""
import subprocess

import torch

import oracle
import oracle_families as of
from conftest import hf_session_args

BIASED = "ernie4_5_moe_score_bias"


def test_step_dir_routes_by_its_saved_bias(tmp_path, open_session):
    from test_dist import BIN, ENV, run, train_args
    case = of.CASE[BIASED]
    m = of.build(case)
    m.config.output_router_logits = False
    hf = of.save(m, tmp_path / "hf")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(200 * 17, 128, seed=7))
    out = tmp_path / "run"
    run(1, train_args(hf, data, out, f"--checkpoint.initial_load_path={hf}", "--checkpoint.initial_load_in_hf",
                      "--training.steps=2", "--checkpoint.last_save_model_only=false"), timeout=300)
    step = out / "checkpoint" / "step-2"
    p = subprocess.run([str(BIN), "export", "--checkpoint", str(step), "--out", str(tmp_path / "exported"),
                        "--tokenizer", str(hf)], env=ENV, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    back = of.load(tmp_path / "exported", "ernie4_5_moe")
    assert all(torch.equal(a, b) for a, b in zip(of.router_biases(back), of.router_biases(of.build(case))))
    tokens, _ = of.batch(back, 2, case.T, seed=5)
    s = open_session(hf_session_args(step, batch=2, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), of.logits(back, "ernie4_5_moe", tokens))
    assert err <= 1e-4, f"logits of step-2 opened as an HF directory: rel err {err:.3g}"
