"""sliding_window 0 is a window SmolLM3Config slides the NoPE layers over (0 is not
None), and transformers' forward fails on it; ctitan must refuse it, naming the key and the
value, rather than train those layers without a window. Olmo3's message names the 0 too."""
import json

import pytest
import torch

import oracle_families as of
from conftest import CtitanError, hf_session_args

B = 2


def _config(tmp_path, cid, drop=(), **set_):
    d = tmp_path / "hf"
    of.make_config(of.CASE[cid]).save_pretrained(str(d))
    conf = json.loads((d / "config.json").read_text())
    for k in drop:
        conf.pop(k, None)
    conf.update(set_)
    (d / "config.json").write_text(json.dumps(conf))
    return d


def test_oracle_smollm3_window_zero_slides_and_fails():
    """transformers itself: the NoPE layers become sliding_attention and the forward fails."""
    import transformers as tf
    c = tf.SmolLM3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=3, use_sliding_window=True,
                         sliding_window=0)
    assert c.layer_types == ["full_attention"] * 3 + ["sliding_attention"], c.layer_types
    c._attn_implementation = "eager"
    with pytest.raises(RuntimeError):
        with torch.no_grad():
            tf.SmolLM3ForCausalLM(c)(torch.zeros(1, 8, dtype=torch.long))


@pytest.mark.parametrize("cid,drop,set_", [
    ("smollm3_nope_swa5", ("layer_types",), dict(use_sliding_window=True, sliding_window=0)),
    ("olmo3_swa5_yarn", (), dict(sliding_window=0)),
])
def test_sliding_window_zero_refused(cid, drop, set_, tmp_path, open_session):
    d = _config(tmp_path, cid, drop, **set_)
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    msg = str(ei.value)
    assert "config.json" in msg and '"sliding_window" is 0' in msg, msg
