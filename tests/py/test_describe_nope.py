"""`ctitan describe` (text) names the layers without RoPE, as SmolLM3Config derives them;
otherwise its "rope:" line reads as every layer's."""
import json


def test_describe_text_names_nope_layers(tmp_path, run_ctitan):
    from transformers import AutoConfig
    d = tmp_path / "hf"
    d.mkdir()
    conf = {"model_type": "smollm3", "vocab_size": 160, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 8, "num_attention_heads": 2, "num_key_value_heads": 1, "pad_token_id": 3, "no_rope_layer_interval": 3}
    (d / "config.json").write_text(json.dumps(conf))
    hf = AutoConfig.from_pretrained(d)
    want = [i for i, u in enumerate(hf.no_rope_layers) if not u]
    assert want == [2, 5]
    _, out, _ = run_ctitan(["describe", d])
    line = next((x for x in out.splitlines() if x.startswith("rope: none")), None)
    assert line is not None, out
    assert line.split(":")[-1].split() == [str(i) for i in want] and f"{len(want)} of 8" in line, line
