"""LoRA on lm_head beyond Qwen3 (test_lora_lm_head.py): untied and tied families against
PEFT (granite's logits_scaling and gemma3's final soft cap after the adapter, olmo2's post-norm,
Mixtral's experts), greedy generation with the KV cache past the training length, export
--merge read back by transformers (tied: PEFT's merge_and_unload, the shared tensor), and a
Qwen3-MoE under EP 2 and ZBVZeroBubble against one process."""
import warnings

import numpy as np
import pytest
import torch

import oracle
import oracle_families as fam
import oracle_lora as OL
from conftest import hf_session_args
from test_lora import OPT_ARGS, compare_steps, session_steps, train_ref
from test_lora_lm_head import ALPHA, R, assert_step, lora_args
from test_parity import make_batch
from test_train_loop import LOCAL_BS, L


def peft_family(tmp_path, cid, targets, std=0.1):
    case = fam.CASE[cid]
    fam.save(fam.build(case), tmp_path / "hf")
    with warnings.catch_warnings():  # tied models: PEFT warns that lm_head shares the embedding
        warnings.simplefilter("ignore")
        pm = OL.make_peft(fam.load(tmp_path / "hf", case.family), r=R, alpha=ALPHA, targets=targets, seed=5, std=std)
    pm.save_pretrained(str(tmp_path / "adapter"))
    return case, pm


@pytest.mark.parametrize("cid", ["granite", "gemma3_text", "olmo2", "mixtral_e4k2"])
def test_family_parity_with_peft(cid, tmp_path, open_session):
    targets = ["q_proj", "v_proj", "lm_head"]
    _, pm = peft_family(tmp_path, cid, targets)
    params = OL.trainable(pm)
    V = pm.config.vocab_size
    tokens, labels = make_batch(V, 2, L, seed=5)
    s = open_session(hf_session_args(tmp_path / "hf", batch=LOCAL_BS, seq_len=L,
                                     extra=OPT_ARGS + lora_args(targets, tmp_path / "adapter")))
    assert_step(s, pm, params, tokens, labels)
    stream = oracle.random_tokens(8 * (L + 1), V, seed=11)
    compare_steps(session_steps(s, stream, list(params)), train_ref(pm, params, stream))


@pytest.mark.parametrize("cid", ["olmo2", "granite"])
def test_family_generate_long_prompt_and_merge(cid, tmp_path, run_ctitan):
    """A 45-token prompt (past seq_len 16; no bos / eos / pad id, which HF's generate would
    mask) and 10 greedy tokens with the adapter as PEFT's generate; the merged export's logits
    as PEFT's (tied granite: merge_and_unload's)."""
    case, pm = peft_family(tmp_path, cid, ["lm_head"], std=0.5)
    V = pm.config.vocab_size
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, V, 45)]
    with torch.no_grad():
        ref = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 45:].tolist()
        with pm.disable_adapter():
            base = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, 45:].tolist()
    assert ref != base, "test setup: the adapter does not change the continuation"
    _, out, _ = run_ctitan(["generate", "--checkpoint", tmp_path / "hf", "--adapter", tmp_path / "adapter",
                            "--prompt-ids", " ".join(map(str, prompt)), "--max-tokens", "10", "--ids"])
    assert [int(x) for x in out.split()] == ref
    run_ctitan(["export", "--checkpoint", tmp_path / "hf", "--adapter", tmp_path / "adapter", "--merge", "--out",
                tmp_path / "merged"])
    tokens = np.array([prompt[:16], prompt[16:32]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = oracle.hf_logits(pm.merge_and_unload() if pm.config.tie_word_embeddings else pm, tokens)
    err = oracle.rel_err(oracle.hf_logits(fam.load(tmp_path / "merged", case.family), tokens), want)
    assert err <= 1e-5, f"merged export vs PEFT: {err:.3g}"


@pytest.fixture(scope="module")
def moedist(tmp_path_factory):
    import oracle_moe
    from test_dist import run, train_args
    d = tmp_path_factory.mktemp("lora_head_moe")
    cfg = oracle_moe.tiny_moe_config(vocab=251, hidden=32, layers=4, heads=4, kv_heads=2, head_dim=8, experts=4,
                                     top_k=2, mlp_only=(0,))
    oracle_moe.build_moe_model(cfg, seed=21).save_pretrained(str(d / "model"))
    oracle.write_bin(d / "tokens.bin", oracle.learnable_stream(600 * 17, 251, seed=7))
    lora = ["--lora.rank=4", "--lora.alpha=12", "--lora.target_modules=q_proj,v_proj,lm_head", "--lora.dropout=0.1",
            "--optimizer.eps=1e-4"]

    def args(out, *extra, dp=1):
        return train_args(d / "model", d / "tokens.bin", out, f"--checkpoint.initial_load_path={d / 'model'}",
                          "--checkpoint.initial_load_in_hf", *lora, *extra, dp=dp)
    run(1, args(d / "one"))
    return d, args


@pytest.mark.parametrize("layout", ["ep2", "pp2_zbv"])
def test_moe_layouts_match_one_process(moedist, layout):
    from test_dist import assert_same_run, run
    from test_lora_tp import assert_same_adapter
    d, args = moedist
    n, extra, dp = {"ep2": (2, ["--parallelism.data_parallel_shard_degree=2",
                                "--parallelism.expert_parallel_degree=2"], 2),
                    "pp2_zbv": (2, ["--parallelism.pipeline_parallel_degree=2",
                                    "--parallelism.pipeline_parallel_schedule=ZBVZeroBubble",
                                    "--parallelism.pipeline_parallel_microbatch_size=2"], 1)}[layout]
    run(n, args(d / layout, *extra, dp=dp))
    assert_same_run(d / layout, d / "one", layout, weights_too=False)
    assert_same_adapter(d / layout, d / "one", layout)
