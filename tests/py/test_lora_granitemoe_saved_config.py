"""The adapter_config.json ctitan saves for GraniteMoeShared, whose shared MLP's gate and up
are one module (shared_mlp.input_linear): one entry for it in a per-layer target_modules list
and one rank_pattern key, as PEFT's own config holds (its target_modules a set, its patterns a
dict), and PEFT loads the file with ctitan's logits. Duplicate JSON keys are read as an error
here (json.loads would keep the last one silently)."""
import json

import torch
from peft import PeftModel

import oracle
from conftest import hf_session_args
from test_families_lora import lora_args
from test_lora_granitemoe import SHARED, granite_case


def _no_dup(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"duplicate keys {sorted(keys)}"
    return dict(pairs)


def test_one_entry_and_one_key_for_input_linear(tmp_path, open_session):
    case, base, hf_dir, loaded = granite_case(SHARED, tmp_path)
    targets = "q_proj,model.layers.1.shared_mlp.input_linear"  # layer 1 only: a per-layer list
    ranks = {"input_linear": 6}
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(targets) + [
        f"--lora.rank_pattern={json.dumps(ranks)}"]))
    assert s.shapes["model.layers.1.shared_mlp.input_linear.lora_A.weight"] == (6, base.config.hidden_size)
    out = tmp_path / "saved"
    s.save_adapter(out)
    conf = json.loads((out / "adapter_config.json").read_text(), object_pairs_hook=_no_dup)
    tm = conf["target_modules"]
    assert len(tm) == len(set(tm)), f"target_modules repeats an entry: {tm}"
    assert [t for t in tm if "shared_mlp" in t] == ["model.layers.1.shared_mlp.input_linear"], tm
    assert sorted(v for v in conf["rank_pattern"].values()) == [6], conf["rank_pattern"]
    tokens = oracle.random_tokens(2 * case.T, base.config.vocab_size, seed=4).reshape(2, case.T)
    back = PeftModel.from_pretrained(loaded(), str(out)).eval()
    with torch.no_grad():
        want = back(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    assert oracle.rel_err(s.logits(tokens), want) <= 1e-4
