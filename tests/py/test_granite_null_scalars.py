"""A Granite config.json with one of its four scalars null (the eighth mutation audit).

transformers' GraniteConfig types embedding_multiplier, residual_multiplier,
attention_multiplier and logits_scaling as float | int, and its strict validation refuses a
null for any of them: such a file is not a model transformers builds. ctitan read null as
1.0, so it trained a model no oracle computes (and reading attention_multiplier's null as 0,
i.e. head_dim^-0.5, passed every test as well). It must refuse the file, naming
config.json and the key, as it refuses a 0."""
import json

import pytest

import oracle_families as of
from conftest import CtitanError, hf_session_args

KEYS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")


@pytest.mark.parametrize("key", KEYS)
def test_granite_null_scalar_is_refused_as_transformers_refuses_it(tmp_path, open_session, key):
    from transformers import AutoConfig
    case = of.CASE["granite"]
    d = tmp_path / "hf"
    of.make_config(case).save_pretrained(str(d))
    conf = json.loads((d / "config.json").read_text())
    conf[key] = None
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    with pytest.raises(Exception) as hf:
        AutoConfig.from_pretrained(d)
    assert key in str(hf.value), hf.value
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=2, seq_len=16))
    msg = str(ei.value).split("failed: ", 1)[-1]
    path = str(d / "config.json")
    assert path in msg and key in msg.replace(path, ""), msg
