"""Twelfth mutation audit (docs/reliability.md): parallelism.module_fqns_per_model_part.

The list of lists as the config reader keeps it (groups joined by ';', items by ','): two
planted misses passed the suite, an empty inner array taken (a [] vanished from the joined
text, so [[], [...], [...]] placed two stages where the file lists three) and an item holding
';' taken (it cut one stage's list in two). Both are refused, naming the key.

The placement's names: reading "model.layers.N" one character off (every Hugging Face layer
name then refused) passed, the suite giving only torchtitan's own "layers.N"; and a list
without tok_embeddings / embed_tokens anywhere was taken with the first-stage check dropped
(the suite's case puts it on the second stage)."""
import pytest

from test_pp_layers_per_stage import ctitan_split, dry_fqns, models  # noqa: F401 (fixture)

REST = ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "layers.6", "layers.7", "norm", "output"]


@pytest.mark.parametrize("parts,words", [
    ([[], ["tok_embeddings", "layers.0"], REST], "non-empty array"),
    ([["tok_embeddings", "layers.0"], [], REST], "non-empty array"),
    ([["tok_embeddings", "layers.0;layers.1"], REST[1:]], "without commas"),
    ([["layers.0"], REST], "the first stage must hold tok_embeddings"),
])
def test_module_fqns_malformed_lists_refused(models, parts, words):
    rc, out = dry_fqns(models, 8, 2, "1F1B", parts)
    assert rc == 2 and "module_fqns_per_model_part" in out and words in out, out[-2000:]


def test_module_fqns_hugging_face_names_place_the_layers(models):
    """Hugging Face's module names (model.embed_tokens, model.layers.N, model.norm, lm_head)
    place the layers as the same list in torchtitan's names does."""
    hf = [["model.embed_tokens"] + [f"model.layers.{i}" for i in range(3)],
          [f"model.layers.{i}" for i in range(3, 8)] + ["model.norm", "lm_head"]]
    rc, out = dry_fqns(models, 8, 2, "1F1B", hf)
    assert rc == 0, out[-2000:]
    assert ctitan_split(out, 2, 2, False) == [[0, 1, 2], [3, 4, 5, 6, 7]], out
