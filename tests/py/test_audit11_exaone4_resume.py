"""Eleventh mutation audit (stop 53): EXAONE 4's resume refusal of a layer that changes its
RoPE names the keys EXAONE 4 has.

EXAONE 4 has no no_rope_layers key: its full layers go without RoPE while sliding_window is
set, so a checkpoint whose layer_types turn the last (full, NoPE) layer into a sliding one
(with RoPE) is another model on the same tensors. The refusal must name sliding_window and
layer_types; the mutant that named no_rope_layers for every family passed, since the suite's
edit (the window removed) is refused earlier by the sliding_window comparison."""
import oracle_families as of
from test_families_exaone4 import EX


def test_resume_refuses_a_full_layer_made_sliding(tmp_path):
    from test_ckpt_rope_params_check import _refused_after, _train
    cfg = of.make_config(EX)
    cfg.vocab_size = 256
    data, out = _train(tmp_path, cfg)
    types = list(cfg.layer_types)
    assert types[-1] == "full_attention", f"test setup: {types}"
    types[-1] = "sliding_attention"
    _refused_after(tmp_path, data, out, lambda c: c.update(layer_types=types), "layer 3",
                   "sliding_window and layer_types")
