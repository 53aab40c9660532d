"""A model_type "mistral" file that has the key layer_types is read as ministral since
cd2f196 (as AutoConfig reads it). The builds before read it as mistral, and their
checkpoints' config.json says model_type "mistral" without layer_types (every layer
sliding over sliding_window: MistralConfig's rule). Resuming such a checkpoint of a file
whose layer_types make every layer sliding is the same model (MinistralForCausalLM with
those layer types computes MistralForCausalLM's layers, shown below in transformers), yet
HEAD refused it on the model_type name alone (review10: reproduced with the build of
72c1b1f~1's checkpoint). A file whose layer_types put a full layer among them is another
model than the checkpoint's and stays refused, naming layer_types."""
import json
import shutil

import pytest
import torch

import oracle
import oracle_families as of
from test_ckpt_integrity import edit_json, resign, resume, run, train_args


def _old_style(c):
    """config.json as the build before cd2f196 wrote it for this model."""
    c.update(model_type="mistral", architectures=["MistralForCausalLM"])
    c.pop("layer_types", None)


def _model(tmp_path, types):
    cfg = of.make_config(of.CASE["mistral_swa5"])
    cfg.vocab_size = 256
    cfg.save_pretrained(tmp_path / "model")
    edit_json(tmp_path / "model" / "config.json", lambda c: c.update(layer_types=types))
    return tmp_path / "model"


def test_oracle_all_sliding_ministral_is_mistral():
    from transformers import MinistralConfig, MinistralForCausalLM, MistralForCausalLM
    kw = dict(of.make_config(of.CASE["mistral_swa5"]).to_dict())
    for k in ("model_type", "architectures", "transformers_version"):
        kw.pop(k, None)
    n = kw["num_hidden_layers"]
    torch.manual_seed(0)
    a = MistralForCausalLM(of.make_config(of.CASE["mistral_swa5"])).eval()
    b = MinistralForCausalLM(MinistralConfig(**dict(kw, layer_types=["sliding_attention"] * n))).eval()
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, kw["vocab_size"], (2, 12))
    with torch.no_grad():
        la, lb = a(tokens).logits, b(tokens).logits
    err = (la - lb).abs().max().item()
    assert err < 1e-6, f"ministral with every layer sliding moves mistral's logits by {err:.3g}"
    # and one full layer among them is another model
    c = MinistralForCausalLM(MinistralConfig(**dict(kw, layer_types=["sliding_attention"] * (n - 1) + ["full_attention"])))
    c.load_state_dict(a.state_dict())
    long = torch.randint(0, kw["vocab_size"], (2, 3 * kw["sliding_window"]))
    with torch.no_grad():
        assert (a(long).logits - c.eval()(long).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("full_layer", [False, True], ids=["all_sliding", "one_full"])
def test_old_mistral_checkpoint_of_a_layer_types_file(tmp_path, full_layer):
    probe = of.make_config(of.CASE["mistral_swa5"])
    n = probe.num_hidden_layers
    types = ["sliding_attention"] * n
    if full_layer:
        types[-1] = "full_attention"
    m = _model(tmp_path, types)
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(40 * 17 + 5, 256, seed=5))
    out = tmp_path / "run"
    p = run(train_args(m, data, out))
    assert p.returncode == 0, p.stderr[-3000:]
    d = out / "checkpoint" / "step-4"
    assert json.loads((d / "config.json").read_text())["model_type"] == "ministral"
    shutil.rmtree(out / "checkpoint" / "step-5", ignore_errors=True)
    edit_json(d / "config.json", _old_style)
    resign(d)
    p = resume((m, data, out), "--training.steps=6")
    if full_layer:
        assert p.returncode == 2 and "layer_types" in p.stderr, p.stderr[-2000:]
    else:
        assert p.returncode == 0, p.stderr[-2000:]
