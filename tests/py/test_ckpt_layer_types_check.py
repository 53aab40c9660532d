"""a checkpoint whose config.json moves the sliding layers (layer_types) or changes the
sliding layers' RoPE (Olmo3's per-type rope_parameters) describes another model with tensors of
the same shapes: a resume must refuse it, naming the key, as it does for no_rope_layers."""
import shutil

import oracle
from test_ckpt_integrity import edit_json, resign, resume, run, train_args


def _run(tmp_path):
    from transformers import Olmo3Config
    Olmo3Config(vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, sliding_window=5).save_pretrained(tmp_path / "model")
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    p = run(train_args(tmp_path / "model", data, tmp_path / "run"))
    assert p.returncode == 0, p.stderr[-3000:]
    return tmp_path / "model", data, tmp_path / "run"


def test_moved_layer_types_or_sliding_rope(tmp_path):
    model_dir, data, out = _run(tmp_path)
    res = {}
    for what, key, fn in [("layer_types", "layer_types", lambda c: c.update(layer_types=["full_attention"] * 4)),
                          ("sliding theta", "rope_parameters", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_theta=1e4))]:
        dst = tmp_path / what.replace(" ", "_")
        shutil.copytree(out, dst)
        d = dst / "checkpoint" / "step-5"
        edit_json(d / "config.json", fn)
        resign(d)
        p = resume((model_dir, data, dst), "--training.steps=6")
        res[what] = (p.returncode, "step-5/config.json" in p.stderr and key in p.stderr, p.stderr[-300:])
    assert all(rc == 2 and named for rc, named, _ in res.values()), res
