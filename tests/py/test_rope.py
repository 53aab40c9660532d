"""model/rope.h against transformers: for a config.json, a layer type and a sequence
length, ctitan's inv_freq and attention scaling must equal those of the family's
RotaryEmbedding module after a forward over positions 0..seq_len-1 (so dynamic and
longrope's length dependence, dynamic_rope_update, is included), to 1e-6 relative; the
cos/sin rows of rope_tables must equal the module's output. Configs are built the way
transformers loads them (AutoConfig.from_pretrained on a directory), so every
config-time rule (legacy keys, precedence, family defaults) is the installed
transformers' own.

Covered: every rope type, legacy and v5 spellings, the rope_scaling-beside-rope_parameters
precedence, Gemma3's two layer types, Phi3's legacy names, and the published config.json
files in tests/data/hf_configs (SOURCES.md there). Configs transformers cannot use, and
those ctitan refuses on purpose, must exit 2 naming the key.

tests/py/rope_driver.c is linked against build/libctitan.a (CTITAN_BUILD=DIR for another
build tree)."""
import importlib
import json
import math
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT

BUILD = Path(os.environ.get("CTITAN_BUILD", ROOT / "build"))
DATA = ROOT / "tests" / "data" / "hf_configs"
RTOL = 1e-6

ROTARY = {
    "llama": ("llama", "LlamaRotaryEmbedding"),
    "mistral": ("mistral", "MistralRotaryEmbedding"),
    "qwen2": ("qwen2", "Qwen2RotaryEmbedding"),
    "qwen3": ("qwen3", "Qwen3RotaryEmbedding"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeRotaryEmbedding"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeRotaryEmbedding"),
    "mixtral": ("mixtral", "MixtralRotaryEmbedding"),
    "olmo2": ("olmo2", "Olmo2RotaryEmbedding"),
    "phi3": ("phi3", "Phi3RotaryEmbedding"),
    "gemma3_text": ("gemma3", "Gemma3RotaryEmbedding"),
    "gemma2": ("gemma2", "Gemma2RotaryEmbedding"),
    "gemma": ("gemma", "GemmaRotaryEmbedding"),
    "granite": ("granite", "GraniteRotaryEmbedding"),
    "smollm3": ("smollm3", "SmolLM3RotaryEmbedding"),
    "olmo3": ("olmo3", "Olmo3RotaryEmbedding"),
    "olmoe": ("olmoe", "OlmoeRotaryEmbedding"),
    "granitemoe": ("granitemoe", "GraniteMoeRotaryEmbedding"),
    "glm": ("glm", "GlmRotaryEmbedding"),
    "glm4": ("glm4", "Glm4RotaryEmbedding"),
    "ernie4_5": ("ernie4_5", "Ernie4_5RotaryEmbedding"),
    "seed_oss": ("seed_oss", "SeedOssRotaryEmbedding"),
    "ministral": ("ministral", "MinistralRotaryEmbedding"),
    "exaone4": ("exaone4", "Exaone4RotaryEmbedding"),
    "ministral3": ("ministral3", "Ministral3RotaryEmbedding"),
    "helium": ("helium", "HeliumRotaryEmbedding"),
    "vaultgemma": ("vaultgemma", "VaultGemmaRotaryEmbedding"),
    "hunyuan_v1_dense": ("hunyuan_v1_dense", "HunYuanDenseV1RotaryEmbedding"),
    "flex_olmo": ("flex_olmo", "FlexOlmoRotaryEmbedding"),
}


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    lib = BUILD / "libctitan.a"
    if not lib.exists():
        pytest.fail(f"{lib} is missing: run `make all` first", pytrace=False)
    exe = tmp_path_factory.mktemp("rope") / "rope_driver"
    blas = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
    cmd = ["gcc", "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(ROOT / "src"), "-o", str(exe),
           str(ROOT / "tests" / "py" / "rope_driver.c"), str(lib), f"-L{blas}", f"-Wl,-rpath,{blas}", "-lopenblas",
           "-lcjson", "-lpcre2-8", "-lutf8proc", "-lm", "-fopenmp"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"building the rope driver failed:\n{p.stderr[-3000:]}", pytrace=False)
    return exe


def write_config(tmp: Path, cfg: dict) -> Path:
    d = tmp / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d


def run_c(driver: Path, cfg_dir: Path, layer_type, seq_len: int):
    p = subprocess.run([str(driver), str(cfg_dir / "config.json"), layer_type or "-", str(seq_len)],
                       capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def hf_rope(cfg_dir: Path, layer_type, seq_len: int):
    """transformers' inv_freq, attention scaling and cos/sin after one forward over 0..seq_len-1."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(cfg_dir)
    mod, cls = ROTARY[config.model_type]
    rotary = getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), cls)(config)
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.arange(seq_len)[None]
    with torch.no_grad():
        if config.model_type in NESTED:
            cos, sin = rotary(x, pos, layer_type)
            inv = getattr(rotary, f"{layer_type}_inv_freq")
            scale = getattr(rotary, f"{layer_type}_attention_scaling")
        else:
            cos, sin = rotary(x, pos)
            inv, scale = rotary.inv_freq, rotary.attention_scaling
    return inv.double().numpy(), float(scale), cos[0].double().numpy(), sin[0].double().numpy()


def compare(driver, tmp: Path, cfg: dict, layer_type, seq_len: int, expect_type=None):
    d = write_config(tmp, cfg)
    rc, out, err = run_c(driver, d, layer_type, seq_len)
    assert rc == 0, f"rope_driver exit {rc}: {err}"
    c = json.loads(out)
    inv, scale, cos, sin = hf_rope(d, layer_type, seq_len)
    if expect_type:
        assert c["type"] == expect_type
    ci = np.array(c["inv_freq"])
    assert ci.shape == inv.shape, f"{ci.shape} frequencies, transformers has {inv.shape}"
    rel = np.max(np.abs(ci - inv) / np.abs(inv))
    assert rel <= RTOL, f"inv_freq off by {rel:.3g} relative:\nctitan {ci}\nhf     {inv}"
    assert abs(c["attn_scale"] - scale) <= RTOL * abs(scale), (c["attn_scale"], scale)
    half = ci.size
    # cos/sin rows: the angle t * inv_freq is the same fp32 product on both sides, up to the
    # frequencies' last-ulp differences (pow kernels), which the tolerance carries along
    for t, row in c["rows"].items():
        t = int(t)
        tol = 3e-6 * abs(scale) + t * np.abs(ci - inv) * abs(scale)
        for name, ref in (("cos", cos), ("sin", sin)):
            got = np.array(row[name])
            assert np.all(np.abs(got - ref[t, :half]) <= tol), f"{name} row {t}: {got} vs {ref[t, :half]}"
            assert np.allclose(ref[t, half:2 * half], ref[t, :half])  # HF's cat(freqs, freqs)
    return c


# --------------------------------------------------------------------------- synthetic configs

LLAMA = dict(model_type="llama", hidden_size=512, num_attention_heads=8, num_hidden_layers=2,
             max_position_embeddings=4096)  # head_dim 64
L31 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192,
           rope_type="llama3")
SF = [1.0 + 0.05 * i for i in range(32)]
LF = [1.5 + 0.4 * i for i in range(32)]
GEMMA = dict(model_type="gemma3_text", hidden_size=640, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
             num_hidden_layers=6, max_position_embeddings=2048)
OLMO3 = dict(model_type="olmo3", hidden_size=512, num_attention_heads=4, num_hidden_layers=4,
             max_position_embeddings=65536)
NESTED = ("gemma3_text", "olmo3")  # one RoPE per layer type
PHI3 = dict(model_type="phi3", hidden_size=512, num_attention_heads=8, num_hidden_layers=2,
            max_position_embeddings=8192, original_max_position_embeddings=1024)
GLM = dict(model_type="glm", hidden_size=512, num_attention_heads=4, num_hidden_layers=2, head_dim=64,
           max_position_embeddings=4096, pad_token_id=0)

# (id, config, layer_type, seq_lens, expected ctitan type)
CASES = [
    ("default-legacy-theta", {**LLAMA, "rope_theta": 5e5}, None, [16], "default"),
    ("default-nulls", {**LLAMA, "rope_theta": 5e5, "rope_scaling": None, "rope_parameters": None}, None, [16], "default"),
    ("default-v5", {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 123456.0}}, None, [16], "default"),
    ("default-family-theta-mixtral", {**LLAMA, "model_type": "mixtral"}, None, [16], "default"),
    ("default-family-theta-llama", {**LLAMA}, None, [16], "default"),
    ("default-int-theta", {**LLAMA, "model_type": "qwen3", "head_dim": 128, "rope_theta": 1000000}, None, [16], "default"),
    ("default-ignores-partial", {**LLAMA, "partial_rotary_factor": 0.5, "rope_theta": 1e4}, None, [16], "default"),
    ("linear-legacy", {**LLAMA, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 4.0}}, None, [16], "linear"),
    ("linear-v5", {**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 2.5, "rope_theta": 3e4}}, None, [16], "linear"),
    ("linear-partial", {**LLAMA, "partial_rotary_factor": 0.5,
                        "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, None, [16], "linear"),
    ("linear-both-spellings", {**LLAMA, "rope_scaling": {"type": "linear", "rope_type": "linear", "factor": 3}}, None,
     [16], "linear"),
    ("dynamic-legacy", {**LLAMA, "max_position_embeddings": 256, "rope_theta": 1e4,
                        "rope_scaling": {"type": "dynamic", "factor": 2.0}}, None, [16, 256, 257, 512], "dynamic"),
    ("dynamic-v5-int-factor", {**LLAMA, "max_position_embeddings": 128,
                               "rope_parameters": {"rope_type": "dynamic", "factor": 3, "rope_theta": 5e5}}, None,
     [16, 300], "dynamic"),
    ("yarn-qwen2.5-legacy", {**LLAMA, "model_type": "qwen2", "hidden_size": 3584, "num_attention_heads": 28,
                             "max_position_embeddings": 131072, "rope_theta": 1e6,
                             "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     None, [16], "yarn"),
    ("yarn-qwen3-legacy", {**LLAMA, "model_type": "qwen3", "head_dim": 128, "max_position_embeddings": 40960,
                           "rope_theta": 1000000, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                                    "original_max_position_embeddings": 32768}},
     None, [16], "yarn"),
    ("yarn-attention-factor", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4,
                                                            "attention_factor": 1.5,
                                                            "original_max_position_embeddings": 512}}, None, [16], "yarn"),
    ("yarn-mscale", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 40.0, "rope_theta": 1e4, "mscale": 1.0,
                                                  "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                                                  "original_max_position_embeddings": 4096}}, None, [16], "yarn"),
    ("yarn-mscale-only", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                                       "original_max_position_embeddings": 1024}}, None, [16], "yarn"),
    ("yarn-no-truncate", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "truncate": False,
                                                       "original_max_position_embeddings": 512}}, None, [16], "yarn"),
    ("yarn-truncate-null", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "truncate": None,
                                                         "original_max_position_embeddings": 512}}, None, [16], "yarn"),
    ("yarn-betas", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "beta_fast": 64.0,
                                                 "beta_slow": 2.0, "original_max_position_embeddings": 256}}, None, [16],
     "yarn"),
    # a correction range of one point: beta_fast 200 and beta_slow 90 turns fit in 512 positions
    # at dimensions -3.1 and -0.35 of 64, clamped and rounded to [0, 0]; transformers'
    # linear_ramp_factor widens it by 0.001 rather than divide 0 by 0 at dimension 0
    ("yarn-one-point-ramp", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 200.0,
                                                          "beta_slow": 90.0, "original_max_position_embeddings": 512}},
     None, [16], "yarn"),
    ("yarn-beta-zero-is-default", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "beta_fast": 0,
                                                                "original_max_position_embeddings": 256}}, None, [16],
     "yarn"),
    ("yarn-factor-null", {**LLAMA, "max_position_embeddings": 8192,
                          "rope_parameters": {"rope_type": "yarn", "factor": None,
                                              "original_max_position_embeddings": 2048}}, None, [16], "yarn"),
    ("yarn-orig-defaults-to-max", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, None, [16], "yarn"),
    ("yarn-top-level-orig-wins", {**LLAMA, "original_max_position_embeddings": 1000,
                                  "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 2048}}, None, [16], "yarn"),
    # head_dim 16, theta 10, original 1024: the high correction dim is 16 ln(1024 / 2 pi) / (2 ln 10)
    # = 17.7, past dim - 1 = 15, where transformers clamps it (ceil 18 truncated, 17.7 not)
    ("yarn-high-clamped", {**LLAMA, "hidden_size": 128, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10.0, "original_max_position_embeddings": 1024}},
     None, [16], "yarn"),
    ("yarn-high-clamped-no-truncate", {**LLAMA, "hidden_size": 128, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10.0, "truncate": False,
        "original_max_position_embeddings": 1024}}, None, [16], "yarn"),
    ("yarn-partial", {**LLAMA, "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.75,
                                                   "original_max_position_embeddings": 1024}}, None, [16], "yarn"),
    ("llama3-legacy-3.1-8b", {**LLAMA, "hidden_size": 4096, "num_attention_heads": 32, "max_position_embeddings": 131072,
                              "rope_theta": 500000.0, "rope_scaling": L31}, None, [16], "llama3"),
    ("llama3-v5", {**LLAMA, "hidden_size": 2048, "num_attention_heads": 32, "head_dim": 64,
                   "max_position_embeddings": 131072,
                   "rope_parameters": {**L31, "factor": 32.0, "rope_theta": 500000.0}}, None, [16], "llama3"),
    ("llama3-theta-from-top", {**LLAMA, "rope_theta": 5e5, "rope_parameters": {**L31}}, None, [16], "llama3"),
    ("longrope-v5", {**LLAMA, "rope_parameters": {"rope_type": "longrope", "short_factor": SF, "long_factor": LF,
                                                  "original_max_position_embeddings": 1024, "rope_theta": 1e4}},
     None, [16, 1024, 1025, 2048], "longrope"),
    ("longrope-attention-factor", {**LLAMA, "rope_parameters": {"rope_type": "longrope", "short_factor": SF,
                                                                "long_factor": LF, "attention_factor": 1.25,
                                                                "factor": 4.0,
                                                                "original_max_position_embeddings": 1024}},
     None, [16, 2048], "longrope"),
    ("longrope-factor", {**LLAMA, "rope_parameters": {"rope_type": "longrope", "short_factor": SF, "long_factor": LF,
                                                      "factor": 16.0, "original_max_position_embeddings": 1024}},
     None, [2048], "longrope"),
    ("phi3-longrope-legacy", {**PHI3, "rope_scaling": {"type": "longrope", "short_factor": SF, "long_factor": LF}},
     None, [16, 2048], "longrope"),
    ("phi3-su", {**PHI3, "rope_scaling": {"type": "su", "short_factor": SF, "long_factor": LF,
                                          "original_max_position_embeddings": 4096}}, None, [16, 2048], "longrope"),
    ("phi3-yarn-means-longrope", {**PHI3, "rope_scaling": {"type": "yarn", "short_factor": SF, "long_factor": LF}},
     None, [16, 2048], "longrope"),
    ("phi3-attribute-orig-wins", {**PHI3, "rope_parameters": {"rope_type": "longrope", "short_factor": SF,
                                                              "long_factor": LF,
                                                              "original_max_position_embeddings": 4000}},
     None, [1500, 4096], "longrope"),
    ("phi3-orig-default-4096", {k: v for k, v in PHI3.items() if k != "original_max_position_embeddings"}
     | {"rope_scaling": {"type": "longrope", "short_factor": SF, "long_factor": LF}}, None, [16, 8192], "longrope"),
    ("phi3-partial-default", {**PHI3, "partial_rotary_factor": 0.5}, None, [16], "default"),
    ("phi3-partial-longrope", {**PHI3, "partial_rotary_factor": 0.75,
                               "rope_scaling": {"type": "longrope", "short_factor": SF[:24], "long_factor": LF[:24]}},
     None, [16, 2048], "longrope"),
    # GlmConfig / Glm4Config: partial_rotary_factor 0.5 when absent, read by the default RoPE
    # and by the scaled types (their apply_rotary_pos_emb rotates the first rotary_dim features)
    ("glm-partial-absent", {**GLM, "rope_theta": 1e4}, None, [16], "default"),
    ("glm4-partial-top", {**GLM, "model_type": "glm4", "partial_rotary_factor": 0.75}, None, [16], "default"),
    ("glm-partial-yarn", {**GLM, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                                                     "original_max_position_embeddings": 1024}}, None, [16], "yarn"),
    # Ernie4_5Config: default_theta 5e5 when absent; its default RoPE rotates whole heads
    # whatever partial_rotary_factor says (the remote-code files' flat rope_theta read too)
    ("ernie-theta-absent-partial-ignored", {**GLM, "model_type": "ernie4_5", "partial_rotary_factor": 0.5}, None,
     [16], "default"),
    ("ernie-legacy-theta", {**GLM, "model_type": "ernie4_5", "rope_theta": 500000}, None, [16], "default"),
    # SeedOssConfig: default_theta 1e4 when absent; Seed-OSS-36B's files name rope_theta 1e7
    # beside a legacy rope_scaling {"rope_type": "default"}
    ("seed-oss-theta-absent", {**GLM, "model_type": "seed_oss", "attention_dropout": 0.0, "residual_dropout": 0.0},
     None, [16], "default"),
    ("seed-oss-legacy-theta", {**GLM, "model_type": "seed_oss", "rope_theta": 1e7,
                               "rope_scaling": {"rope_type": "default"}, "attention_dropout": 0.0,
                               "residual_dropout": 0.0}, None, [16], "default"),
    # MinistralConfig: default_theta 1e4 when absent; Ministral-8B-Instruct-2410's files name a
    # flat rope_theta 1e8 (a sliding layer's RoPE is the full layers')
    ("ministral-theta-absent", {**GLM, "model_type": "ministral"}, None, [16], "default"),
    ("ministral-legacy-theta-sliding", {**GLM, "model_type": "ministral", "rope_theta": 1e8, "sliding_window": 8},
     "sliding_attention", [16], "default"),
    # Exaone4Config: default_theta 1e4 when absent; EXAONE-4.0's files name a flat rope_theta
    # (1e6) and a legacy llama3 rope_scaling; one RoPE for the layers that rotate
    ("exaone4-theta-absent", {**GLM, "model_type": "exaone4", "sliding_window": 8}, "sliding_attention", [16],
     "default"),
    ("exaone4-legacy-llama3", {**GLM, "model_type": "exaone4", "rope_theta": 1e6, "sliding_window": None,
                               "layer_types": ["full_attention"] * 2,
                               "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     None, [16], "llama3"),
    # Ministral3Config's own default dict (the published files' text model): the legacy key
    # "type" yarn, mscale = mscale_all_dim = 1 (attention factor 1), and the q scale's keys,
    # which the rotary embedding does not read
    ("ministral3-default-dict-yarn", {**GLM, "model_type": "ministral3", "rope_parameters": {
        "type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 256,
        "max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
        "mscale": 1.0, "llama_4_scaling_beta": 0.1}}, None, [16, 4096], "yarn"),
    # the conflict: a legacy rope_scaling replaces rope_parameters wholesale
    ("precedence-yarn-over-default", {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                                      "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 1024}}, None, [16], "yarn"),
    ("precedence-theta-lost", {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 777.0},
                               "rope_scaling": {"type": "linear", "factor": 2.0}}, None, [16], "linear"),
    ("precedence-top-theta", {**LLAMA, "rope_theta": 5e5, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 777.0},
                              "rope_scaling": {"type": "linear", "factor": 2.0}}, None, [16], "linear"),
    ("precedence-empty-scaling", {**LLAMA, "rope_scaling": {},
                                  "rope_parameters": {"rope_type": "linear", "factor": 2.0}}, None, [16], "linear"),
    ("precedence-v5-theta-wins", {**LLAMA, "rope_theta": 5e5,
                                  "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 7e3}}, None,
     [16], "linear"),
    ("olmo2-default", {**LLAMA, "model_type": "olmo2", "rope_theta": 5e5}, None, [16], "default"),
    ("qwen3-moe-default", {**LLAMA, "model_type": "qwen3_moe", "head_dim": 128, "rope_theta": 1e6}, None, [16], "default"),
    ("mistral-dynamic", {**LLAMA, "model_type": "mistral", "max_position_embeddings": 512,
                         "rope_scaling": {"type": "dynamic", "factor": 4.0}}, None, [16, 1024], "dynamic"),
    ("sliding-layer-type-single-rope", {**LLAMA, "model_type": "qwen3", "rope_theta": 1e6}, "sliding_attention", [16],
     "default"),
    ("gemma3-defaults-full", {**GEMMA}, "full_attention", [16], "default"),
    ("gemma3-defaults-sliding", {**GEMMA}, "sliding_attention", [16], "default"),
    ("gemma3-legacy-full", {**GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "full_attention", [16], "linear"),
    ("gemma3-legacy-sliding", {**GEMMA, "rope_theta": 1e6, "rope_local_base_freq": 5e3,
                               "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "sliding_attention", [16],
     "default"),
    ("gemma3-v5-full", {**GEMMA, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                        "rope_theta": 2e6},
                                                     "sliding_attention": {"rope_type": "default",
                                                                           "rope_theta": 2e4}}},
     "full_attention", [16], "linear"),
    ("gemma3-v5-sliding", {**GEMMA, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0},
                                                        "sliding_attention": {"rope_type": "default",
                                                                              "rope_theta": 2e4}}},
     "sliding_attention", [16], "default"),
    ("gemma3-v5-partial-entry", {**GEMMA, "rope_theta": 3e5, "rope_parameters": {"full_attention": {
        "rope_type": "linear", "factor": 4.0}}}, "full_attention", [16], "linear"),
    ("gemma3-merge-scaling", {**GEMMA, "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                              "rope_theta": 5e5}},
                              "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "full_attention", [16], "yarn"),
    ("gemma3-yarn-truncate-ignored", {**GEMMA, "rope_parameters": {"full_attention": {
        "rope_type": "yarn", "factor": 8.0, "truncate": False, "original_max_position_embeddings": 512}}},
     "full_attention", [16], "yarn"),
    ("gemma3-dynamic-sliding", {**GEMMA, "max_position_embeddings": 256, "rope_parameters": {"sliding_attention": {
        "rope_type": "dynamic", "factor": 2.0}}}, "sliding_attention", [16, 512], "dynamic"),
    ("gemma3-longrope-full", {**GEMMA, "rope_parameters": {"full_attention": {
        "rope_type": "longrope", "short_factor": SF, "long_factor": LF, "original_max_position_embeddings": 1024}}},
     "full_attention", [16, 2048], "longrope"),
    # Olmo3: default_theta 5e5; the published files' top-level rope_theta and rope_scaling (yarn)
    # reach the full layers only (Olmo3Config pops rope_theta into full_attention's entry, so the
    # sliding entry's setdefault falls back to default_theta)
    ("olmo3-defaults-full", {**OLMO3}, "full_attention", [16], "default"),
    ("olmo3-defaults-sliding", {**OLMO3}, "sliding_attention", [16], "default"),
    ("olmo3-legacy-yarn-full", {**OLMO3, "rope_theta": 1e4, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192,
        "attention_factor": 1.2079441541679836, "beta_fast": 32.0, "beta_slow": 1.0}}, "full_attention", [16], "yarn"),
    ("olmo3-legacy-yarn-sliding", {**OLMO3, "rope_theta": 1e4, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192}}, "sliding_attention", [16],
     "default"),
    ("olmo3-v5-sliding", {**OLMO3, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                       "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                             "rope_theta": 3e4}}},
     "sliding_attention", [16], "linear"),
    # review4
    ("r4-olmo3-fullonly-toptheta-sliding", {**OLMO3, "rope_theta": 1e4, "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "sliding_attention", [16], "default"),
    ("r4-olmo3-fullonly-toptheta-full", {**OLMO3, "rope_theta": 1e4, "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "full_attention", [16], "default"),
    ("r4-olmo3-both-toptheta-full", {**OLMO3, "rope_theta": 1e4, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 3e4}, "sliding_attention": {"rope_type": "default"}}}, "full_attention", [16], "default"),
    ("r4-olmo3-both-toptheta-sliding", {**OLMO3, "rope_theta": 1e4, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 3e4}, "sliding_attention": {"rope_type": "default"}}}, "sliding_attention", [16], "default"),
    ("r4-olmo3-scaling-theta-full", {**OLMO3, "rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 7e4}}, "full_attention", [16], "linear"),
    ("r4-olmo3-scaling-theta-sliding", {**OLMO3, "rope_theta": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 2.0, "rope_theta": 7e4}}, "sliding_attention", [16], "default"),
    ("r4-olmo3-dynamic-full", {**OLMO3, "max_position_embeddings": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "full_attention", [16, 200], "dynamic"),
    ("r4-olmo3-partial-top-yarn-sliding", {**OLMO3, "partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16}}, "sliding_attention", [16], "default"),
    # SmolLM3: one RoPE (its NoPE layers apply none), default_theta 2e6
    ("smollm3-defaults", {**LLAMA, "model_type": "smollm3"}, None, [16], "default"),
    ("smollm3-legacy-theta", {**LLAMA, "model_type": "smollm3", "rope_theta": 5e6}, None, [16], "default"),
    # OLMoE: default_theta 1e4 when config.json gives none
    ("olmoe-defaults", {**LLAMA, "model_type": "olmoe"}, None, [16], "default"),
    ("olmoe-legacy-yarn", {**LLAMA, "model_type": "olmoe", "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024}}, None, [16], "yarn"),
    ("granitemoe-defaults", {**LLAMA, "model_type": "granitemoe"}, None, [16], "default"),
    # FlexOlmoConfig: default_theta 5e5 when config.json gives none; a legacy theta read as Llama's
    ("flex_olmo-defaults", {**LLAMA, "model_type": "flex_olmo"}, None, [16], "default"),
    ("flex_olmo-legacy-theta", {**LLAMA, "model_type": "flex_olmo", "rope_theta": 2e4}, None, [16], "default"),
    # HeliumConfig: default_theta 1e5 when absent; a legacy theta and yarn read as for Llama
    ("helium-theta-absent", {**GLM, "model_type": "helium", "head_dim": 128}, None, [16], "default"),
    ("helium-legacy-yarn", {**GLM, "model_type": "helium", "head_dim": 128, "rope_theta": 2e4, "rope_scaling": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}}, None, [16], "yarn"),
    # VaultGemmaConfig: default_theta 1e4, one RoPE for the sliding and the full layers
    ("vaultgemma-theta-absent", {**GLM, "model_type": "vaultgemma"}, "sliding_attention", [16], "default"),
    ("vaultgemma-legacy-theta", {**GLM, "model_type": "vaultgemma", "rope_theta": 5e4}, "full_attention", [16],
     "default"),
    # HunYuanDenseV1Config: default_theta 1e4; a dynamic rope_scaling without alpha is dynamic
    ("hunyuan-theta-absent", {**GLM, "model_type": "hunyuan_v1_dense"}, None, [16], "default"),
    ("hunyuan-legacy-dynamic", {**GLM, "model_type": "hunyuan_v1_dense", "max_position_embeddings": 256,
                                "rope_theta": 3e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, None,
     [16, 512], "dynamic"),
    # HunYuan's ntk_alpha (dynamic with alpha): a fixed base theta * alpha^(d / (d - 2)), also
    # past max_position_embeddings; the published files' legacy rope_scaling
    ("hunyuan-ntk-alpha", {**GLM, "model_type": "hunyuan_v1_dense", "max_position_embeddings": 256,
                           "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 1.0, "alpha": 1000.0,
                                                               "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                               "mscale_all_dim": 1.0}}, None, [16, 512], "dynamic"),
]


@pytest.mark.parametrize("name,cfg,layer_type,seq_lens,want", CASES, ids=[c[0] for c in CASES])
def test_matches_transformers(driver, tmp_path, name, cfg, layer_type, seq_lens, want):
    for n in seq_lens:
        compare(driver, tmp_path, cfg, layer_type, n, expect_type=want)


def test_dynamic_and_longrope_depend_on_length(driver, tmp_path):
    """The cases above would pass with a length-blind implementation only if these did not differ."""
    dyn = {**LLAMA, "max_position_embeddings": 256, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    a, b = compare(driver, tmp_path, dyn, None, 256), compare(driver, tmp_path, dyn, None, 257)
    assert a["inv_freq"][1] != b["inv_freq"][1]
    lr = {**LLAMA, "rope_parameters": {"rope_type": "longrope", "short_factor": SF, "long_factor": LF,
                                       "original_max_position_embeddings": 1024}}
    a, b = compare(driver, tmp_path, lr, None, 1024), compare(driver, tmp_path, lr, None, 1025)
    assert a["inv_freq"][1] != b["inv_freq"][1]


# --------------------------------------------------------------------------- refused configs

def hf_fails(cfg_dir: Path, layer_type) -> bool:
    try:
        hf_rope(cfg_dir, layer_type, 16)
    except Exception:
        return True
    return False


# (id, config, layer_type, substrings of the message, whether transformers fails on it too)
ERRORS = [
    ("unknown-type", {**LLAMA, "rope_parameters": {"rope_type": "foo", "rope_theta": 1e4}}, None,
     ['rope_parameters.rope_type "foo" is not supported',
      "(supported: default, linear, dynamic, yarn, llama3, longrope)"], True),
    ("unknown-legacy-type", {**LLAMA, "rope_scaling": {"type": "ntk", "factor": 2.0}}, None,
     ['rope_scaling.type "ntk"', "supported: default, linear"], True),
    ("linear-missing-factor", {**LLAMA, "rope_parameters": {"rope_type": "linear"}}, None,
     ['rope_parameters is missing "factor"'], True),
    ("llama3-missing-low", {**LLAMA, "rope_scaling": {k: v for k, v in L31.items() if k != "low_freq_factor"}}, None,
     ['rope_scaling is missing "low_freq_factor"'], True),
    ("longrope-missing-long", {**LLAMA, "rope_parameters": {"rope_type": "longrope", "short_factor": SF}}, None,
     ['"long_factor"'], True),
    ("factor-string", {**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": "8"}}, None,
     ["rope_parameters.factor must be a number"], True),
    ("factor-null", {**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": None}}, None,
     ["rope_parameters.factor must be a number"], True),
    ("theta-null", {**LLAMA, "rope_theta": None}, None, ['"rope_theta" must be a number'], True),
    ("longrope-length", {**LLAMA, "rope_parameters": {"rope_type": "longrope", "short_factor": SF[:31],
                                                      "long_factor": LF, "original_max_position_embeddings": 64}},
     None, ["rope_parameters.short_factor must have rotary_dim / 2 = 32 entries, got 31"], True),
    ("odd-head", {**LLAMA, "hidden_size": 504, "head_dim": 63}, None, ["must be even"], True),
    ("qwen3-nested", {**LLAMA, "model_type": "qwen3", "rope_parameters": {"full_attention": {"rope_type": "default"}}},
     None, ["nested per layer type", "qwen3 has one RoPE"], True),
    ("phi3-linear", {**PHI3, "rope_scaling": {"type": "linear", "factor": 2.0}}, None,
     ['rope_scaling.type "linear" is not supported for phi3'], True),
    ("phi3-su-without-orig", {**PHI3, "rope_scaling": {"type": "su", "short_factor": SF, "long_factor": LF}}, None,
     ['missing "original_max_position_embeddings"'], True),
    ("phi3-longrope-length", {**PHI3, "rope_scaling": {"type": "longrope", "short_factor": SF[:3],
                                                       "long_factor": LF}}, None, ["short_factor must have"], True),
    ("mixtral-yarn-no-head-dim", {**LLAMA, "model_type": "mixtral", "rope_scaling": {"type": "yarn", "factor": 2.0}},
     None, ["head_dim"], True),
    ("gemma3-rope-scaling-without-full", {**GEMMA, "rope_parameters": {"sliding_attention": {"rope_type": "default"}},
                                          "rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "full_attention",
     ["without a full_attention entry"], True),
    # refused by ctitan on purpose though transformers takes them (see model/rope.c)
    ("type-conflict", {**LLAMA, "rope_scaling": {"type": "linear", "rope_type": "dynamic", "factor": 2.0}}, None,
     ['rope_type "dynamic" and rope_scaling.type "linear" disagree'], False),
    ("gemma3-legacy-type-dropped", {**GEMMA, "rope_scaling": {"type": "linear", "factor": 8.0}}, "full_attention",
     ['rope_scaling.type "linear" is ignored by transformers 5.24 for gemma3_text'], False),
    ("gemma3-flat", {**GEMMA, "rope_parameters": {"rope_type": "linear", "factor": 8.0}}, "full_attention",
     ["gemma3_text reads rope_parameters nested per layer type", 'key "rope_type"'], False),
    ("proportional", {**LLAMA, "rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, None,
     ['rope_parameters.rope_type "proportional" is not supported'], False),
    ("factor-zero", {**LLAMA, "rope_parameters": {"rope_type": "linear", "factor": 0}}, None,
     ["rope_parameters.factor must be positive"], False),
    ("llama3-equal-freq-factors", {**LLAMA, "rope_scaling": {**L31, "high_freq_factor": 1.0}}, None,
     ["high_freq_factor equals low_freq_factor"], False),
    # driver-level misuse
    ("gemma3-needs-layer-type", {**GEMMA}, None, ["one RoPE per layer type"], None),
    ("olmo3-needs-layer-type", {**OLMO3}, None, ["olmo3 has one RoPE per layer type"], None),
    ("olmo3-flat", {**OLMO3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "full_attention",
     ["olmo3 reads rope_parameters nested per layer type", 'key "rope_type"'], False),
    ("olmo3-legacy-type-dropped", {**OLMO3, "rope_scaling": {"type": "linear", "factor": 8.0}}, "full_attention",
     ['rope_scaling.type "linear" is ignored by transformers 5.24 for olmo3'], False),
    ("unknown-model-type", {**LLAMA, "model_type": "gpt2"}, None, ['model_type "gpt2": no RoPE rules'], None),
]


@pytest.mark.parametrize("name,cfg,layer_type,needles,hf_too", ERRORS, ids=[c[0] for c in ERRORS])
def test_refused(driver, tmp_path, name, cfg, layer_type, needles, hf_too):
    d = write_config(tmp_path, cfg)
    rc, out, err = run_c(driver, d, layer_type, 16)
    assert rc == 2, f"exit {rc}, expected 2 (a config error)\n{out}\n{err}"
    assert err.startswith(str(d / "config.json") + ": "), f"the message must name the file: {err}"
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"
    if hf_too is not None:
        assert hf_fails(d, layer_type) == hf_too, (
            "transformers " + ("accepts" if hf_too else "refuses") + " this config; the case list says otherwise")


# --------------------------------------------------------------------------- published configs

def published():
    files = sorted(DATA.glob("*.json"))
    return files


def layer_types(cfg: dict):
    if cfg.get("model_type") not in NESTED:
        return [None]
    lt = cfg.get("layer_types")
    if lt is None:
        pattern = cfg.get("sliding_window_pattern", 6) if cfg["model_type"] == "gemma3_text" else 4  # Olmo3Config
        lt = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return sorted(set(lt))


def test_published_configs_present():
    names = {p.stem for p in published()}
    assert len(names) >= 10, f"tests/data/hf_configs holds only {sorted(names)}"
    assert (DATA / "SOURCES.md").exists()


@pytest.mark.parametrize("path", published(), ids=[p.stem for p in published()])
def test_published(driver, tmp_path, path):
    cfg = json.loads(path.read_text())
    for lt in layer_types(cfg):
        c = compare(driver, tmp_path, cfg, lt, 16)
        if c["type"] in ("dynamic", "longrope"):  # and past the length where the frequencies change
            n = c["max_pos"] if c["type"] == "dynamic" else c["original_max_pos"]
            compare(driver, tmp_path, cfg, lt, 2 * n)


def test_known_values(driver, tmp_path):
    """Numbers stated independently of transformers' code: Llama 3.1's RoPE keeps the
    highest frequency (1) and divides the lowest by 8; a Phi-3-mini-128k-shaped longrope
    (131072 over 4096) scales cos/sin by sqrt(1 + ln 32 / ln 4096)."""
    c = compare(driver, tmp_path, json.loads((DATA / "Llama-3.1-8B.json").read_text()), None, 16,
                expect_type="llama3")
    assert c["inv_freq"][0] == 1.0
    lowest = 1.0 / np.float32(500000.0) ** np.float32(126 / 128)
    assert math.isclose(c["inv_freq"][63], float(lowest) / 8, rel_tol=1e-6)
    phi = {**PHI3, "hidden_size": 3072, "num_attention_heads": 32, "max_position_embeddings": 131072,
           "original_max_position_embeddings": 4096,
           "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [4.0] * 48}}
    c = compare(driver, tmp_path, phi, None, 16, expect_type="longrope")
    assert math.isclose(c["attn_scale"], math.sqrt(1 + math.log(32) / math.log(4096)), rel_tol=1e-12)


# --------------------------------------------------------------------------- the export keeps the RoPE

# a small llama (head_dim 16) whose yarn keys are each needed to reproduce transformers' frequencies
YARN_EXPORT = {
    # truncate false: the correction range unrounded (0.81 .. 3.82, truncated 0 .. 4)
    "no-truncate": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e4, "truncate": False,
                    "original_max_position_embeddings": 512},
    "no-truncate-high-clamped": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10.0, "truncate": False,
                                 "original_max_position_embeddings": 1024},
    "mscale-betas": {"rope_type": "yarn", "factor": 16.0, "rope_theta": 1e4, "beta_fast": 16.0, "beta_slow": 2.0,
                     "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 256},
}


@pytest.mark.parametrize("rp", list(YARN_EXPORT.values()), ids=list(YARN_EXPORT))
def test_yarn_export_keeps_frequencies(rp, tmp_path, open_session):
    """ctitan's HF export (save_hf) of a model with yarn RoPE writes a config.json from which
    transformers computes the inv_freq and attention scaling it computes from the original
    config.json, bit for bit: a yarn key left out of the export (truncate false, the betas,
    the mscales) changes transformers' frequencies of the exported model."""
    cfg = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
               num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=4096, rope_parameters=rp)
    src = write_config(tmp_path, cfg)
    s = open_session(["--model.spec=hf", f"--model.hf_assets_path={src}", "--training.local_batch_size=1",
                      "--training.seq_len=16", "--training.seed=3"])
    out = tmp_path / "export"
    s.save_hf(out)
    inv, scale, _, _ = hf_rope(src, None, 16)
    inv2, scale2, _, _ = hf_rope(out, None, 16)
    exported = json.loads((out / "config.json").read_text())
    assert np.array_equal(inv2, inv), (f"transformers' inv_freq from the exported config.json differs:\n"
                                       f"export   {inv2}\noriginal {inv}\nexported rope: "
                                       f"{exported.get('rope_parameters', exported.get('rope_scaling'))}")
    assert scale2 == scale, (scale2, scale)
