"""LoRA on every family (issue 15, item 3, with issue 13's PEFT files).

A PEFT adapter with random non-zero A and B on each family's tiny model: ctitan loads it
(lora.adapter_path) and gives PEFT's logits, loss and adapter gradients; the adapter
ctitan saves loads back into PEFT with the same logits. Phi3 fuses q/k/v and gate/up in
one Linear each (qkv_proj, gate_up_proj), which PEFT adapts as ordinary Linears (one A
[r, in], one B [out_fused, r]): ctitan adapts them so, trains them through AdamW steps as
PEFT + torch do, and refuses the unfused names there. MoE models adapt the attention and,
through PEFT's target_parameters, the stacked experts (Mixtral below; issue 13). Expected values come from peft and transformers only."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from peft import PeftModel

import oracle
import oracle_families as fam
import oracle_lora as OL
from conftest import CtitanError, hf_session_args

TOL = 1e-4
R, ALPHA = 4, 8
CASES = {  # case id: target modules
    "llama_rope3_attnbias_hd16": OL.ALL7,
    "mistral_swa5": OL.ALL7,
    "qwen2_swa6_layers": ["q_proj", "k_proj", "v_proj", "down_proj"],
    "olmo2": OL.ALL7,
    "gemma3_text": OL.ALL7,
    "gemma2": OL.ALL7,
    "gemma_gelu_attnbias": OL.ALL7,
    # o_proj's and down_proj's adapters feed the branch that residual_multiplier scales
    "granite": OL.ALL7,
    # q_proj's and k_proj's adapters on the NoPE layers reach the scores unrotated
    "smollm3_nope_swa5": OL.ALL7,
    "olmo3_swa5_yarn": OL.ALL7,
    "smollm3_kinds": OL.ALL7,
    "phi3_longrope_short_swa7": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "mixtral_e4k2": OL.ATTN,
    "qwen2_moe_mlponly_norm_nobias": OL.ATTN,  # (no aux loss: PEFT's reference loss is the CE)
    # olmoe maps to qwen2_moe's conversion: PEFT rewrites gate_proj + up_proj / down_proj into
    # target_parameters of the fused experts (gate_up_proj at 2 r, 2 alpha), as for qwen3_moe
    "olmoe_norm_topk_tied": OL.ALL7,
    # granitemoe: what PEFT's all-linear adapts there (its experts and router are no Linear)
    "granitemoe_k3_tied_bias": OL.ATTN,
    "granitemoeshared_narrow_tied": OL.ATTN,
    # GLM's fused gate_up_proj (as Phi3's); q_proj's and k_proj's adapters reach the scores
    # through the interleaved partial RoPE (their B rows in transformers' feature order)
    "glm_bias_partial05": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
    "glm4_partial075_tied": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
    # ERNIE's q_proj / k_proj adapters reach the scores through the whole-head interleaved RoPE;
    # every adapted projection has a bias (use_bias), Seed-OSS's o_proj one of its own switch
    "ernie4_5_bias_tied": OL.ALL7,
    "seed_oss_outbias_mlpbias": OL.ALL7,
    # Ministral: Mistral's seven projections under layer_types' mixed windows
    "ministral_types_swa5": OL.ALL7,
    # EXAONE 4: q_proj / k_proj adapters through the per-head q/k norms, with RoPE on the
    # sliding layers and none on the full one
    "exaone4_swa5_nope_tied": OL.ALL7,
    # Ministral 3: q_proj's adapter under q's position scale
    "ministral3_yarn_qscale": OL.ALL7,
    # Helium: q_proj / k_proj adapters through the interleaved RoPE; q/k/v and MLP biases
    "helium_bias_interleaved": OL.ALL7,
    # VaultGemma: the seven projections (o_proj with its bias) under both soft-caps
    "vaultgemma_caps_bias": OL.ALL7,
    # HunYuan: q_proj / k_proj adapters through RoPE, then the per-head norms
    "hunyuan_qknorm_after_rope_bias": OL.ALL7,
    # ERNIE 4.5 MoE: gate_proj / up_proj / down_proj on the ungated shared experts
    # (mlp.shared_experts) of every sparse layer, q/k adapters through the interleaved RoPE
    "ernie4_5_moe_shared3_untied": OL.ALL7,
    "ernie4_5_moe_noshared_end1": OL.ALL7,
    # FlexOlmo maps to qwen2_moe's conversion as olmoe: gate_proj + up_proj / down_proj rewritten
    # into the fused experts' target_parameters; o_proj's and the experts' adapters feed the
    # branches' post-norms, q_proj's / k_proj's the whole-projection q/k norms
    "flex_olmo_norm_topk_tied": OL.ALL7,
    # GLM-4.5: q_proj / k_proj adapters through the per-head q/k norms and the partial RoPE, with
    # the biased sigmoid group-limited router; and without q/k norms, tied
    "glm4_moe_groups_bias_qknorm": OL.ATTN,
    "glm4_moe_plain_tied": OL.ATTN,
    # dots1: q/k/v/o adapters beside their biases, q/k through the always-on per-head norms, a
    # sliding layer, the biased group-limited router; and the plain tied case
    "dots1_groups_bias_swa5": OL.ATTN,
    "dots1_plain_tied": OL.ATTN,
}


def lora_args(targets, adapter=None):
    tm = targets if isinstance(targets, str) else ",".join(targets)
    a = [f"--lora.rank={R}", f"--lora.alpha={ALPHA}", f"--lora.target_modules={tm}"]
    return a + ([f"--lora.adapter_path={adapter}"] if adapter else [])


@pytest.mark.parametrize("cid", list(CASES))
def test_peft_adapter_parity_and_round_trip(cid, tmp_path, open_session):
    case, targets = fam.CASE[cid], CASES[cid]
    base = fam.build(case)
    hf_dir, ad, out = tmp_path / "hf", tmp_path / "adapter", tmp_path / "saved"
    fam.save(base, hf_dir)
    pm = OL.make_peft(fam.prepare_loaded(fam.load(hf_dir, case.family), case.family), r=R, alpha=ALPHA,
                      targets=targets, seed=5)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert params and all(".lora_" in n for n in params), "test setup: PEFT trains other tensors"
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)

    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(targets, ad)))
    # and ctitan's adapter file, read by PEFT, gives ctitan's logits
    session_matches_peft(s, params, tokens, labels, (ref_loss, ref_logits, ref_grads),
                         lambda: fam.prepare_loaded(fam.load(hf_dir, case.family), case.family), out,
                         load=lambda base_model, d: PeftModel.from_pretrained(base_model, str(d)).eval())


def test_phi3_fused_adapter_adamw_steps(tmp_path, open_session):
    """A PEFT adapter on Phi3's fused qkv_proj and gate_up_proj (plus o_proj, down_proj)
    loaded by ctitan: three AdamW steps (accumulation, clipping, weight decay, warmup) equal
    PEFT + torch's loop over the adapters: loss, grad norm, every adapter tensor."""
    from test_lora import SCHED, compare_steps, opt_args, session_steps
    from test_train_loop import GLOBAL_BS, HP, LOCAL_BS, L
    case, targets = fam.CASE["phi3_longrope_short_swa7"], CASES["phi3_longrope_short_swa7"]
    base = fam.build(case)
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    fam.save(base, hf_dir)
    pm = OL.make_peft(fam.prepare_loaded(fam.load(hf_dir, case.family), case.family), r=R, alpha=ALPHA,
                      targets=targets, seed=7)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert any("qkv_proj.lora_B" in n for n in params) and any("gate_up_proj.lora_A" in n for n in params)
    stream = oracle.random_tokens(8 * (L + 1), base.config.vocab_size, seed=16)
    ref = OL.train(pm, params, stream, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=SCHED, run_steps=3,
                   **HP)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(targets, ad) + opt_args()))
    compare_steps(session_steps(s, stream, list(params), run=3), ref)


def test_fused_names_follow_the_files(tmp_path, open_session):
    """Phi3's files fuse q/k/v and gate/up: the unfused names are refused there (naming the
    fused module); the fused names are refused on a family whose files do not fuse them."""
    case = fam.CASE["phi3_longrope_short_swa7"]
    fam.save(fam.build(case), tmp_path / "hf")
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=case.T, extra=lora_args(OL.ALL7)))
    msg = str(ei.value)
    assert "lora.target_modules" in msg and "qkv_proj" in msg and "phi3" in msg, msg
    case = fam.CASE["llama_rope3_attnbias_hd16"]
    fam.save(fam.build(case), tmp_path / "llama")
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(tmp_path / "llama", batch=2, seq_len=case.T,
                                     extra=lora_args(["qkv_proj", "o_proj"])))
    msg = str(ei.value)
    assert "lora.target_modules" in msg and "has no qkv_proj" in msg, msg


@pytest.mark.parametrize("cid", ["phi3_longrope_short_swa7", "glm4_partial075_tied"])
def test_fused_adapter_generate_and_merge(tmp_path, run_ctitan, cid):
    """A PEFT adapter outside training, on Phi3's fused qkv_proj / gate_up_proj and on GLM-4's
    q, k, v, o, fused gate_up and down projections (the KV cache's interleaved RoPE over
    adapted q and k): `generate --adapter` continues as greedy decoding with PEFT's model
    does, and `export --merge` writes PEFT's merge_and_unload (loaded by transformers: the
    adapted model's logits)."""
    case, targets = fam.CASE[cid], CASES[cid]
    base = fam.build(case)
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    fam.save(base, hf_dir)
    pm = OL.make_peft(fam.prepare_loaded(fam.load(hf_dir, case.family), case.family), r=R, alpha=ALPHA,
                      targets=targets, seed=9, std=0.3)
    pm.save_pretrained(str(ad))
    check_generate_and_merge(run_ctitan, tmp_path, case, base, base, pm, hf_dir, ad)


def check_generate_and_merge(run_ctitan, tmp_path, case, base, plain, pm, hf_dir, ad):
    """`generate --adapter` continues a prompt as greedy decoding with PEFT's model pm does
    (plain: the model without the adapter, whose continuation must differ), and `export
    --merge` writes PEFT's merge_and_unload (loaded by transformers: pm's logits)."""
    prompt = [5, 17, 20, 3, 9]

    def greedy(model, n=6):  # full forwards (HF's cached generate has its own window/longrope quirks)
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        return seq[len(prompt):]
    ref = greedy(pm)
    assert greedy(plain) != ref, "the test adapter must change the greedy continuation"
    _, out, _ = run_ctitan(["generate", "--checkpoint", hf_dir, "--adapter", ad, "--prompt-ids",
                            " ".join(map(str, prompt)), "--max-tokens", "6", "--ids"])
    assert [int(x) for x in out.split()] == ref
    check_merge(run_ctitan, tmp_path, case, base, pm, hf_dir, ad)


def check_merge(run_ctitan, tmp_path, case, base, pm, hf_dir, ad):
    """`export --merge` of the adapter in ad writes PEFT's merge_and_unload: transformers
    reading the merged files gives pm's logits."""
    from transformers import AutoModelForCausalLM
    tokens, _ = fam.batch(base, 2, case.T, seed=6)
    with torch.no_grad():
        want = pm(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    run_ctitan(["export", "--checkpoint", hf_dir, "--adapter", ad, "--merge", "--out", tmp_path / "merged"])
    merged = fam.prepare_loaded(AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32),
                                case.family)
    with torch.no_grad():
        got = merged(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    assert oracle.rel_err(got, want) <= TOL


def saved_case(cid, tmp_path):
    """Family case cid's random model saved in tmp_path / "hf": (case, the torch model, the
    folder, a loader of the saved model prepared as transformers runs it for the tests)."""
    case = fam.CASE[cid]
    base = fam.build(case)
    hf_dir = tmp_path / "hf"
    fam.save(base, hf_dir)
    return case, base, hf_dir, lambda: fam.prepare_loaded(fam.load(hf_dir, case.family), case.family)


def experts_rewrite_matches_peft(tmp_path, open_session, case, base, hf_dir, loaded, targets, dense_mlp, B):
    """PEFT's MoE conversion of MLP targets (ernie4_5_moe, glm4_moe, dots1): gate_proj + up_proj /
    down_proj become the sparse layers' mlp.experts target_parameters (all-linear adds the
    router, gate.weight), and neither the shared experts nor the dense layers' MLPs (dense_mlp:
    a regex of their names) get an adapter; ctitan given PEFT's adapter (at targets) then has
    its logits, loss and adapter gradients, and its saved adapter loads in PEFT."""
    import re
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=targets, seed=5)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert any(".mlp.experts." in n for n in params), f"test setup: PEFT trains {sorted(params)}"
    assert not any("shared_experts" in n or re.search(dense_mlp, n) for n in params), sorted(params)
    assert any(".mlp.gate." in n for n in params) == (targets == "all-linear"), sorted(params)
    tokens, labels = fam.batch(base, B, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=B, seq_len=case.T, extra=lora_args(targets, ad)))
    session_matches_peft(s, params, tokens, labels, ref, loaded, out)


def session_matches_peft(s, params, tokens, labels, ref, loaded, out, load=OL.load_adapter_strict):
    """Session s holds PEFT's adapter: its adapter tensors are PEFT's trainable ones, and its
    logits, loss and every adapter gradient are PEFT's (ref = loss, logits, grads); the
    adapter it saves to `out` loads in PEFT (`load`, strictly by default, over loaded(), a
    fresh base) with s's logits, which are returned."""
    ref_loss, ref_logits, ref_grads = ref
    assert set(n for n in s.names() if ".lora_" in n) == set(params)
    err = oracle.rel_err(s.logits(tokens), ref_logits)
    assert err <= TOL, f"logits rel err {err:.3g}"
    s.zero_grad()
    nv = oracle.n_valid(labels)
    loss = s.forward_backward(tokens, labels, nv) / nv
    assert abs(loss - ref_loss) <= TOL * abs(ref_loss), f"loss {loss} vs PEFT {ref_loss}"
    bad = [f"{n}: rel err {oracle.rel_err(s.get_grad(n), ref_grads[n]):.3g}" for n in params
           if not oracle.rel_err(s.get_grad(n), ref_grads[n]) <= TOL]
    assert not bad, "adapter gradients differ from PEFT's:\n" + "\n".join(bad)
    s.save_adapter(out)
    back = load(loaded(), out)
    with torch.no_grad():
        want = back(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"PEFT with ctitan's adapter: logits rel err {err:.3g}"
    return want


def test_mixtral_expert_adapters_parity_and_round_trip(tmp_path, open_session):
    """transformers v5 stacks Mixtral's experts (w1|w3, w2) into mlp.experts.gate_up_proj /
    down_proj as Qwen3-MoE's, and PEFT's target_parameters adapts them the same way: a
    PEFT adapter on q_proj and both expert parameters (random A, B) gives ctitan PEFT's
    logits, loss and every adapter gradient; the adapter ctitan saves loads in PEFT
    strictly with ctitan's logits, and `merge` (PEFT's merge_and_unload) keeps them."""
    case, base, hf_dir, loaded = saved_case("mixtral_e4k2", tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    exp = "--lora.target_parameters=" + ",".join(OL.EXPERTS)
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=OL.EXPERTS, seed=5)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert any(".mlp.experts." in n for n in params), f"test setup: PEFT trains {sorted(params)}"
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    with torch.no_grad():
        plain = loaded()(input_ids=torch.as_tensor(tokens)).logits.float().numpy()
    assert oracle.rel_err(ref_logits, plain) > 100 * TOL, "test setup: the adapter hardly changes the logits"

    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(["q_proj"], ad) + [exp]))
    want = session_matches_peft(s, params, tokens, labels, (ref_loss, ref_logits, ref_grads), loaded, out)
    s.merge_adapter()
    err = oracle.rel_err(s.logits(tokens), want)
    assert err <= TOL, f"after merge: logits rel err {err:.3g}"


def test_mixtral_rewritten_expert_targets(tmp_path, open_session):
    """LoraConfig(target_modules=[q_proj, w1, w3, w2], use_rslora) on Mixtral: PEFT rewrites
    w1 + w3 into mlp.experts.gate_up_proj at rank 2r, alpha 2 alpha (rank_pattern /
    alpha_pattern: scale 2 alpha / sqrt(2 r) under rsLoRA) and w2 into down_proj. ctitan
    with the same target_modules loads PEFT's adapter and gives its logits, loss and
    adapter gradients; its saved adapter loads in PEFT strictly with its logits. w1
    without w3 is refused by both."""
    case, base, hf_dir, loaded = saved_case("mixtral_e4k2", tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    targets = ["q_proj", "w1", "w3", "w2"]
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=targets, rslora=True, seed=5)
    pm.save_pretrained(str(ad))
    conf = json.loads((ad / "adapter_config.json").read_text())
    assert conf["rank_pattern"] == {r".*\.gate_up_proj": 2 * R}, f"test setup: {conf['rank_pattern']}"
    params = OL.trainable(pm)
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)

    args = [f"--lora.rank={R}", f"--lora.alpha={ALPHA}", "--lora.use_rslora=true",
            f"--lora.target_modules={','.join(targets)}"]
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=args + [f"--lora.adapter_path={ad}"]))
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    session_matches_peft(s, params, tokens, labels, (ref_loss, ref_logits, ref_grads), loaded, out)
    s.close()

    with pytest.raises(ValueError, match="w3"):
        OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=["q_proj", "w1"])
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(hf_dir, extra=[f"--lora.rank={R}", "--lora.target_modules=q_proj,w1"]))
    assert "lora.target_modules" in str(ei.value) and "w3" in str(ei.value), str(ei.value)


@pytest.mark.parametrize("cid", ["phi3_longrope_short_swa7", "glm4_partial075_tied", "ernie4_5_bias_tied"])
def test_phi3_all_linear_as_peft(cid, tmp_path, open_session):
    """PEFT's target_modules "all-linear" on Phi3 adapts its four Linears per layer, the fused
    qkv_proj and gate_up_proj among them (not lm_head; on GLM-4 q, k, v, o_proj, the fused
    gate_up_proj and down_proj, not the tied lm_head); ctitan's lora.target_modules =
    all-linear adapts the same and, from PEFT's adapter, gives PEFT's logits, loss and
    gradients; its save loads back in PEFT with its logits."""
    case, fused = fam.CASE[cid], CASES[cid]
    base = fam.build(case)
    hf_dir, ad, out = tmp_path / "hf", tmp_path / "adapter", tmp_path / "saved"
    fam.save(base, hf_dir)
    pm = OL.make_peft(fam.prepare_loaded(fam.load(hf_dir, case.family), case.family), r=R, alpha=ALPHA,
                      targets="all-linear", seed=12)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    mods = {n.split(".lora_")[0].rsplit(".", 1)[1] for n in params}
    assert mods == set(fused), f"PEFT's all-linear on {case.family} adapts {sorted(mods)}"
    tokens, labels = fam.batch(base, 2, case.T, seed=12)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(["all-linear"], ad)))
    session_matches_peft(s, params, tokens, labels, ref,
                         lambda: fam.prepare_loaded(fam.load(hf_dir, case.family), case.family), out,
                         load=lambda base_model, d: PeftModel.from_pretrained(base_model, str(d)).eval())


def test_qwen2_moe_expert_adapters_parity_and_round_trip(tmp_path, open_session):
    """qwen2_moe's routed experts are Qwen3-MoE's stacked mlp.experts.gate_up_proj /
    down_proj: PEFT's target_parameters on them (with q_proj) on the mixed sparse / dense
    model with shared experts gives ctitan PEFT's logits, loss and adapter gradients, and
    ctitan's saved adapter loads in PEFT strictly with its logits."""
    case, base, hf_dir, loaded = saved_case("qwen2_moe_mlponly_norm_nobias", tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    exp = "--lora.target_parameters=" + ",".join(OL.EXPERTS)
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=["q_proj"], target_parameters=OL.EXPERTS, seed=5)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert any(".mlp.experts." in n for n in params), f"test setup: PEFT trains {sorted(params)}"
    assert not any("shared_expert" in n for n in params), f"test setup: PEFT trains {sorted(params)}"
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref_loss, ref_logits, ref_grads = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(["q_proj"], ad) + [exp]))
    session_matches_peft(s, params, tokens, labels, (ref_loss, ref_logits, ref_grads), loaded, out)


# qwen2_moe's two cases: layer 0 dense, 1 and 2 sparse; layers 0 and 2 dense, 1 sparse (its aux
# loss off here: PEFT's reference loss is the CE). Targets: the MLP names alone, with attention,
# and all-linear (which adds every sparse layer's mlp.shared_expert_gate, a [1, H] Linear).
QWEN2_MOE = [("qwen2_moe_mlponly_norm_nobias", OL.MLP), ("qwen2_moe_step2_aux", OL.ALL7),
             ("qwen2_moe_mlponly_norm_nobias", "all-linear"), ("qwen2_moe_step2_aux", "all-linear")]


def qwen2_moe_case(cid, tmp_path):
    """saved_case with the aux loss off (the layers as the case has them)."""
    case = fam.CASE[cid]
    base = fam.build(case)
    base.config.output_router_logits = False
    hf_dir = tmp_path / "hf"
    fam.save(base, hf_dir)
    return case, base, hf_dir, lambda: fam.prepare_loaded(fam.load(hf_dir, case.family), case.family)


def qwen2_moe_peft(loaded, targets, ad, seed):
    """PEFT's adapter on targets, saved in ad; asserts it adapts the dense layers' MLP at
    intermediate_size and every sparse layer's shared expert at its own width (and, under
    all-linear only, the shared expert's gate, B [1, r])."""
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=targets, seed=seed)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    cfg = pm.base_model.model.config
    for i, layer in enumerate(pm.base_model.model.model.layers):
        shared = hasattr(layer.mlp, "shared_expert")
        pre, width = (f"layers.{i}.mlp.shared_expert.", cfg.shared_expert_intermediate_size) if shared else \
            (f"layers.{i}.mlp.", cfg.intermediate_size)
        for mod in ("gate_proj", "up_proj", "down_proj"):
            b = next(n for n in params if pre + mod + ".lora_B" in n)
            a = next(n for n in params if pre + mod + ".lora_A" in n)
            assert params[a if mod == "down_proj" else b].shape[1 if mod == "down_proj" else 0] == width, \
                f"test setup: {a} / {b}"
        gate = [n for n in params if f"layers.{i}.mlp.shared_expert_gate.lora_B" in n]
        want = [(1, R)] if shared and targets == "all-linear" else []
        assert [tuple(params[n].shape) for n in gate] == want, f"test setup: layer {i}: {gate}"
    assert not any(".experts." in n for n in params), sorted(params)
    return pm, params


@pytest.mark.parametrize("cid,targets", QWEN2_MOE)
def test_qwen2_moe_shared_expert_adapters(cid, targets, tmp_path, open_session):
    """PEFT's gate_proj / up_proj / down_proj on qwen2_moe adapt the dense layers' MLP and
    every sparse layer's shared expert (mlp.shared_expert.X, Is wide; no rewrite into the
    experts' target_parameters): ctitan, given PEFT's adapter, has PEFT's keys and shapes,
    logits, loss and every adapter gradient; the adapter it saves loads in PEFT strictly
    with its logits."""
    case, base, hf_dir, loaded = qwen2_moe_case(cid, tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm, params = qwen2_moe_peft(loaded, targets, ad, seed=5)
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=lora_args(targets, ad)))
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    session_matches_peft(s, params, tokens, labels, ref, loaded, out)


@pytest.mark.parametrize("ranks,alphas", [({"shared_expert.down_proj": 6, "gate_proj": 2}, {"up_proj": 3}),
                                          ({"mlp.up_proj": 6}, {"mlp.up_proj": 12})])
def test_qwen2_moe_shared_expert_rank_pattern(ranks, alphas, tmp_path, open_session):
    """rank_pattern / alpha_pattern over the dense MLP and the shared experts, whose full names
    differ (mlp.X / mlp.shared_expert.X): ctitan, given the patterns, has PEFT's shapes, logits,
    loss and gradients; its saved adapter (its patterns per layer where the names differ)
    loads in PEFT strictly with its logits."""
    case, base, hf_dir, loaded = qwen2_moe_case("qwen2_moe_mlponly_norm_nobias", tmp_path)
    ad, out = tmp_path / "adapter", tmp_path / "saved"
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=OL.MLP, seed=5, rank_pattern=ranks, alpha_pattern=alphas)
    pm.save_pretrained(str(ad))
    params = OL.trainable(pm)
    assert len({tuple(p.shape) for n, p in params.items() if ".lora_A" in n}) > 2, "test setup: one rank"
    tokens, labels = fam.batch(base, 2, case.T, seed=5)
    ref = OL.loss_logits_grads(pm, params, tokens, labels)
    extra = lora_args(OL.MLP, ad) + [f"--lora.rank_pattern={json.dumps(ranks)}",
                                     f"--lora.alpha_pattern={json.dumps(alphas)}"]
    s = open_session(hf_session_args(hf_dir, batch=2, seq_len=case.T, extra=extra))
    assert all(s.shapes[n] == tuple(params[n].shape) for n in params)
    session_matches_peft(s, params, tokens, labels, ref, loaded, out)


@pytest.mark.parametrize("cid,targets", QWEN2_MOE)
def test_qwen2_moe_shared_expert_adamw_steps(cid, targets, tmp_path, open_session):
    """PEFT's adapter on the dense MLPs and shared experts loaded by ctitan: three AdamW
    steps (accumulation, clipping, weight decay, warmup) equal PEFT + torch's loop over the
    adapters: loss, grad norm, every adapter tensor."""
    from test_lora import SCHED, compare_steps, opt_args, session_steps
    from test_train_loop import GLOBAL_BS, HP, LOCAL_BS, L
    case, base, hf_dir, loaded = qwen2_moe_case(cid, tmp_path)
    ad = tmp_path / "adapter"
    pm, params = qwen2_moe_peft(loaded, targets, ad, seed=7)
    stream = oracle.random_tokens(8 * (L + 1), base.config.vocab_size, seed=16)
    ref = OL.train(pm, params, stream, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=SCHED, run_steps=3,
                   **HP)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L, extra=lora_args(targets, ad) + opt_args()))
    compare_steps(session_steps(s, stream, list(params), run=3), ref)


@pytest.mark.parametrize("targets", [OL.MLP, "all-linear"])
def test_qwen2_moe_shared_expert_generate_and_merge(targets, tmp_path, run_ctitan):
    """The shared experts' adapters outside training: `generate --adapter` continues as
    greedy decoding with PEFT's model does, and `export --merge` writes PEFT's
    merge_and_unload (loaded by transformers: the adapted model's logits)."""
    case, base, hf_dir, loaded = qwen2_moe_case("qwen2_moe_mlponly_norm_nobias", tmp_path)
    ad = tmp_path / "adapter"
    pm = OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=targets, seed=9, std=0.3)
    pm.save_pretrained(str(ad))
    check_generate_and_merge(run_ctitan, tmp_path, case, base, loaded(), pm, hf_dir, ad)


@pytest.mark.parametrize("targets", [["q_proj", "gate"], ["mlp.gate"]])
def test_qwen2_moe_router_refused(targets, tmp_path, open_session):
    """"gate" names qwen2_moe's router, which PEFT refuses (no Linear, and no rewrite into
    target_parameters for this model, unlike qwen3_moe): refused naming PEFT's refusal.
    shared_expert_gate on a model without one is refused by name."""
    case, base, hf_dir, loaded = qwen2_moe_case("qwen2_moe_mlponly_norm_nobias", tmp_path)
    with pytest.raises(ValueError, match="Qwen2MoeTopKRouter"):
        OL.make_peft(loaded(), r=R, alpha=ALPHA, targets=targets)
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(hf_dir, extra=lora_args(targets)))
    msg = str(ei.value)
    assert "lora.target_modules" in msg and "qwen2_moe" in msg and "Qwen2MoeTopKRouter" in msg, msg
    case = fam.CASE["llama_rope3_attnbias_hd16"]
    fam.save(fam.build(case), tmp_path / "llama")
    with pytest.raises(CtitanError) as ei:
        open_session(hf_session_args(tmp_path / "llama", extra=lora_args(["q_proj", "shared_expert_gate"])))
    assert "has no shared_expert_gate" in str(ei.value), str(ei.value)
