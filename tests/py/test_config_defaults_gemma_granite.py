"""What ctitan reads from a gemma, gemma2 or granite config.json that leaves keys out (the
eighth mutation audit): each config class's defaults, as transformers reads the same file.

test_families' gemma2 case checks Gemma2Config's defaults, and its granite case Granite's
four scalars; the other defaults of the gemma and granite rows were untested, since every
file the tests wrote (save_pretrained) or read (the published configs) names them. Changing
Gemma's default kv heads (16), Granite's rms_norm_eps (1e-6) or its max_position_embeddings
(2048), or reading Gemma's absent hidden_act as SiLU, passed every test.

- A file of the sizes alone: every key ctitan's export (describe --config-out) writes that
  transformers' config also has equals what AutoConfig read from the original file.
- Gemma without hidden_act (GemmaConfig's default: gelu_pytorch_tanh), and with
  hidden_act "gelu" beside a null hidden_activation (refusing that null passed every test):
  ctitan opens the file and its logits equal those of the model transformers loads from it."""
import json

import pytest

import oracle
import oracle_families as of
from conftest import hf_session_args

TOL = 1e-4
B = 2
SIZES = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 16}
# written by ctitan's export but not config attributes transformers reads back as they are
NOT_COMPARED = {"architectures", "dtype"}
# the defaults each family's case must reach
MUST = {"gemma": ["num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                  "pad_token_id", "tie_word_embeddings", "rope_parameters"],
        "gemma2": ["num_key_value_heads", "head_dim", "hidden_activation", "rms_norm_eps",
                   "max_position_embeddings", "pad_token_id", "query_pre_attn_scalar", "sliding_window"],
        "granite": ["num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "pad_token_id",
                    "attention_bias", "mlp_bias", "hidden_act", "tie_word_embeddings", "rope_parameters"]}


@pytest.mark.parametrize("model_type", sorted(MUST))
def test_absent_keys_take_the_config_class_defaults(tmp_path, run_ctitan, model_type):
    from transformers import AutoConfig
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **SIZES}))
    hf = AutoConfig.from_pretrained(d)
    run_ctitan(["describe", d, "--config-out", d / "out.json"])
    out = json.loads((d / "out.json").read_text())
    missing = object()
    compared = []
    for k, v in out.items():
        h = getattr(hf, k, missing)
        if k in NOT_COMPARED or h is missing:
            continue
        assert v == h, f"{model_type}: {k} = {v!r}, transformers reads {h!r}"
        compared.append(k)
    left = set(MUST[model_type]) - set(compared)
    assert not left, f"{model_type}: not compared {left}"


def drop_act(conf):
    conf.pop("hidden_act", None)
    conf.pop("hidden_activation", None)


def null_activation(conf):  # transformers 4.x's key left null: 5.x reads hidden_act alone, 4.x fell back to it
    conf["hidden_act"] = "gelu"
    conf["hidden_activation"] = None


@pytest.mark.parametrize("edit", [drop_act, null_activation], ids=["no_hidden_act", "hidden_activation_null"])
def test_gemma_activation_keys_as_transformers_reads_them(tmp_path, open_session, edit):
    case = of.CASE["gemma_gelu_attnbias"]
    d = of.save(of.build(case), tmp_path / "hf")
    conf = of.config_json(d)
    edit(conf)
    (d / "config.json").write_text(json.dumps(conf, indent=2))
    ref = of.load(d, case.family)
    assert ref.config.hidden_act == "gelu_pytorch_tanh"
    tokens, _ = of.batch(ref, B, case.T, seed=5)
    want = of.logits(ref, case.family, tokens)
    s = open_session(hf_session_args(d, batch=B, seq_len=case.T))
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"logits rel err {err:.3g}"
