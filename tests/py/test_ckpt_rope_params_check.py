"""A checkpoint whose config.json changes the RoPE in a way only some lengths or only the
scale show describes another model with tensors of the same shapes: a resume must refuse
it, naming rope_parameters (the ninth mutation audit; each passed every test):

- yarn's attention_factor alone (the same frequencies, cos and sin multiplied by another
  factor): comparing the frequencies without the scale resumed it with exit 0;
- dynamic NTK with another max_position_embeddings (the same frequencies up to the shorter
  one, rescaled past it): comparing them at the checkpoint's length instead of the longer of
  the two resumed it, when the checkpoint's was the shorter.

The oracle that each change makes another model is transformers' own RoPE init function."""
import shutil

import oracle
from test_ckpt_integrity import edit_json, resign, resume, run, train_args

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64}


def _train(tmp_path, cfg):
    cfg.save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    out = tmp_path / "run"
    p = run(train_args(tmp_path / "model", data, out))
    assert p.returncode == 0, p.stderr[-3000:]
    return data, out


def _refused_after(tmp_path, data, out, edit, *words):
    """The step-5 checkpoint of out with edit(config.json) applied (re-signed) is refused on
    resume naming its config.json and each of words (default: rope_parameters); the unedited
    one resumes."""
    dst = tmp_path / "edited"
    shutil.copytree(out, dst)
    d = dst / "checkpoint" / "step-5"
    edit_json(d / "config.json", edit)
    resign(d)
    p = resume((tmp_path / "model", data, dst), "--training.steps=6")
    assert p.returncode == 2 and "step-5/config.json" in p.stderr, p.stderr[-2000:]
    assert all(w in p.stderr for w in words or ("rope_parameters",)), (words, p.stderr[-2000:])
    # the unedited checkpoint resumes: the refusal is the edit's
    p = resume((tmp_path / "model", data, out), "--training.steps=6")
    assert p.returncode == 0, p.stderr[-2000:]


def test_dynamic_rope_with_a_shorter_max_position_is_refused(tmp_path):
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    dyn = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    cfg.rope_parameters, cfg.max_position_embeddings = dict(dyn), 256
    short = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    short.rope_parameters, short.max_position_embeddings = dict(dyn), 128
    f_short, _ = ROPE_INIT_FUNCTIONS["dynamic"](short, "cpu", seq_len=128)
    f_long, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=128)
    assert torch.allclose(f_short, f_long)  # alike up to the shorter length
    f_short, _ = ROPE_INIT_FUNCTIONS["dynamic"](short, "cpu", seq_len=256)
    f_long, _ = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=256)
    assert not torch.allclose(f_short, f_long)  # and not at the longer one
    data, out = _train(tmp_path, cfg)
    _refused_after(tmp_path, data, out, lambda c: c.update(max_position_embeddings=128))


def test_other_yarn_attention_factor_is_refused(tmp_path):
    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    cfg.rope_parameters = dict(YARN)
    cfg.save_pretrained(tmp_path / "model")
    other = oracle.tiny_config(vocab=256, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    other.rope_parameters = dict(YARN, attention_factor=1.0)
    # the oracle: transformers' yarn gives the same inverse frequencies and another scale
    f0, s0 = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    f1, s1 = ROPE_INIT_FUNCTIONS["yarn"](other, "cpu")
    assert torch.equal(f0, f1) and s0 != s1, (s0, s1)
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    out = tmp_path / "run"
    p = run(train_args(tmp_path / "model", data, out))
    assert p.returncode == 0, p.stderr[-3000:]
    dst = tmp_path / "edited"
    shutil.copytree(out, dst)
    d = dst / "checkpoint" / "step-5"
    edit_json(d / "config.json", lambda c: c["rope_parameters"].update(attention_factor=1.0))
    resign(d)
    p = resume((tmp_path / "model", data, dst), "--training.steps=6")
    assert p.returncode == 2 and "step-5/config.json" in p.stderr and "rope_parameters" in p.stderr, p.stderr[-2000:]
    # the unedited checkpoint resumes: the refusal is the scale's
    p = resume((tmp_path / "model", data, out), "--training.steps=6")
    assert p.returncode == 0, p.stderr[-2000:]
