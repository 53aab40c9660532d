"""Eleventh mutation audit (stop 53): Seed-OSS's residual_dropout given as 0.1 is refused.

SeedOssConfig trains with residual_dropout (and attention_dropout) where the file gives one;
ctitan has no dropout. test_families_ernie_seed refuses the absent and null keys (0.1 and an
error in transformers); the refusal of a stated nonzero residual_dropout was dropped by a
mutant and the suite passed: the model trained without the file's dropout, silently."""
import pytest

import oracle_families as of
from conftest import CtitanError, hf_session_args
from test_families import B


def test_seed_oss_residual_dropout_refused(tmp_path, open_session):
    import json
    from transformers import AutoConfig
    case = of.CASE["seed_oss_outbias_mlpbias"]
    d = of.save(of.build(case), tmp_path / "hf")
    conf = of.config_json(d)
    conf["residual_dropout"] = 0.1
    (d / "config.json").write_text(json.dumps(conf))
    assert AutoConfig.from_pretrained(d).residual_dropout == 0.1, "test setup"
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(d, load=False, batch=B, seq_len=16))
    assert "residual_dropout" in str(ei.value), str(ei.value)
