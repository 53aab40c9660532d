"""LoRA beyond the training step: bf16 storage of the frozen base, `generate --adapter`,
`export --merge`, and the dry run's trained/frozen split.

Expected values come from PEFT / transformers (generation, merged logits), from Python
arithmetic on the config (the dry run's counts), or from ctitan's own fp32-storage run
where the claim is bit-identity (bf16 storage of weights that are bf16 already must not
change a single bit of the run)."""
import json
import re

import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model

import oracle
from conftest import hf_session_args

SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(tied, vocab=256):
    return oracle.tiny_config(vocab=vocab, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                              rope_theta=1e4, tied=tied)


def peft_adapter(tmp_path, tied=False, r=4, alpha=8):
    """A random base saved as HF, and a PEFT adapter with random non-zero A and B."""
    model = oracle.save_random_hf(tmp_path / "hf", tiny(tied), seed=11)
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0, target_modules=SEVEN))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    pm.save_pretrained(tmp_path / "adapter")
    pm.eval()
    return pm


ATTN = "--lora.target_modules=q_proj,k_proj,v_proj,o_proj"
# MoE runs: how the base is frozen, and the gradients compared besides the loss
MOE_RUNS = {
    # every target: the dense layer's MLP and both expert parameters get adapters, so the
    # experts run on adapted fp32 copies (W + s B A, W widened from the store into them)
    # and only the router reads its store
    "moe": (["--lora.modules_to_save=norm"], "model.layers.1.self_attn.o_proj.lora_A.weight"),
    # attention adapters only: the router and every expert are read from the bf16 store
    "moe_attn": ([ATTN, "--lora.modules_to_save=norm"], "model.layers.0.self_attn.o_proj.lora_A.weight"),
    # down_proj's experts adapted (fp32 copy), gate and up read from the store: a mixed call
    "moe_down": ([ATTN, "--lora.target_parameters=mlp.experts.down_proj", "--lora.modules_to_save=norm"],
                 "model.layers.0.self_attn.o_proj.lora_A.weight"),
    # no LoRA: every MLP frozen (router and experts from the store), the rest trained; full
    # activation checkpointing, so the experts' forward also runs as a recomputation (out NULL)
    "moe_freeze": (["--training.freeze=model.layers.*.mlp.*", "--activation_checkpoint.mode=full"],
                   "model.layers.0.self_attn.o_proj.weight"),
}


@pytest.mark.parametrize("tied,vocab,moe,mixed", [(False, 256, None, False), (True, 256, None, False),
                                                  (True, 9000, None, False), (False, 9000, None, False),
                                                  (False, 256, "moe", False), (False, 256, None, True),
                                                  (True, 9000, None, True), (False, 256, "moe_attn", False),
                                                  (False, 256, "moe_attn", True), (False, 256, "moe_down", False),
                                                  (False, 256, "moe_down", True), (False, 256, "moe_freeze", False),
                                                  (False, 256, "moe_freeze", True)],
                         ids=["untied", "tied", "tied_v9000", "untied_v9000", "moe_dense_layer", "untied_mixed_bf16",
                              "tied_v9000_mixed_bf16", "moe_attn_lora", "moe_attn_lora_mixed_bf16",
                              "moe_down_experts_lora", "moe_down_experts_lora_mixed_bf16", "moe_freeze_no_lora",
                              "moe_freeze_no_lora_mixed_bf16"])
def test_bf16_frozen_storage_is_bit_identical(tied, vocab, moe, mixed, tmp_path, open_session):
    """A base whose weights are bf16 already: frozen_dtype bfloat16 (stored in bf16, read from the
    store by every product) and float32 give the same bits for losses, gradients, steps and
    logits. The stored lm_head runs in blocks of 8192 vocabulary rows: at vocab 9000 (two blocks)
    the first forward is still bit-identical (each logit is the same dot product), while d(final
    norm output) sums the two blocks' products one after the other instead of in one GEMM: the
    step-1 gradients then agree to float32 rounding (1e-5 of each tensor's largest value), and
    the later steps are not compared (AdamW turns a last-bit difference of a near-zero
    gradient element into a step of up to lr, as docs/distributed.md measures for the parallel
    layouts). mixed: under training.mixed_precision_param = bfloat16, where the products read a
    stored matrix straight from its bf16 store (AMX / vdpbf16ps copy the bf16 pairs, the other
    kernels widen while packing) instead of rounding its fp32 copy: the same bits too.
    moe: a Qwen3-MoE base (2 MoE layers and a dense one) frozen as MOE_RUNS says; its router
    and frozen experts go through the matmul and experts ops' wbf16 entries."""
    extra, grad = MOE_RUNS[moe] if moe else (["--lora.modules_to_save=norm"],
                                             "model.layers.1.self_attn.o_proj.lora_A.weight")
    lora = [] if moe == "moe_freeze" else ["--lora.rank=4", "--lora.alpha=8"]
    if moe:
        import oracle_moe
        model = oracle_moe.build_moe_model(oracle_moe.tiny_moe_config(vocab=vocab, layers=3, mlp_only=(1,)), seed=11)
    else:
        model = oracle.save_random_hf(tmp_path / "hf32", tiny(tied, vocab), seed=11)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    rng = np.random.default_rng(0)
    tok = rng.integers(0, vocab, (2, 16)).astype(np.int32)
    lab = rng.integers(0, vocab, (2, 16)).astype(np.int32)
    runs = []
    for fd in ("float32", "bfloat16"):
        s = open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=16,
                                         extra=lora + extra + [f"--training.frozen_dtype={fd}"]
                                         + (["--training.mixed_precision_param=bfloat16"] if mixed else [])))
        out = []
        for _ in range(3):
            out.append(s.forward_backward(tok, lab, 32))
            out.append(s.get_grad(grad))
            out.append(s.get_grad("model.norm.weight"))
            s.optimizer_step()
        out.append(s.logits(tok))
        out += [s.get_param(n) for n in s.names()]
        runs.append(out)
        s.close()
    for i, (a, b) in enumerate(zip(*runs)):
        a, b = np.asarray(a), np.asarray(b)
        if vocab <= 8192 or i == 0:
            assert np.array_equal(a, b), f"item {i} differs between fp32 and bf16 storage"
        elif i < 3:  # step 1's adapter and norm gradients
            assert np.abs(a - b).max() <= 1e-5 * np.abs(a).max(), f"item {i}"
    # and the frozen weights are the file's bf16 values, unchanged by training
    sd = model.to(torch.bfloat16).float().state_dict()
    s = open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=16,
                                     extra=["--lora.rank=4", "--training.frozen_dtype=bfloat16"]))
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        assert np.array_equal(s.get_param(n), sd[n].numpy()), n


def test_generate_with_adapter_matches_peft(tmp_path, run_ctitan):
    pm = peft_adapter(tmp_path)
    prompt = [5, 17, 200, 3, 99]
    with torch.no_grad():
        ref = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    _, out, _ = run_ctitan(["generate", "--checkpoint", tmp_path / "hf", "--adapter", tmp_path / "adapter",
                            "--prompt-ids", " ".join(map(str, prompt)), "--max-tokens", "8", "--ids"])
    got = [int(x) for x in out.split()]
    assert got == ref
    # without the adapter the base model generates something else (the adapter is not ignored)
    _, base_out, _ = run_ctitan(["generate", "--checkpoint", tmp_path / "hf", "--prompt-ids",
                                 " ".join(map(str, prompt)), "--max-tokens", "8", "--ids"])
    with torch.no_grad(), pm.disable_adapter():
        base_ids = pm.generate(input_ids=torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, 5:].tolist()
    assert [int(x) for x in base_out.split()] == base_ids
    assert base_ids != ref, "the test adapter must change the greedy continuation"


def test_export_merge_matches_peft_merge(tmp_path, run_ctitan):
    from transformers import AutoModelForCausalLM
    pm = peft_adapter(tmp_path, tied=True)
    tok = torch.tensor(np.random.default_rng(1).integers(0, 256, (2, 12)))
    with torch.no_grad():
        want = pm(input_ids=tok).logits.numpy()
    run_ctitan(["export", "--checkpoint", tmp_path / "hf", "--adapter", tmp_path / "adapter", "--merge",
                "--out", tmp_path / "merged"])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        got = merged(input_ids=tok).logits.numpy()
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    # the merged weights are PEFT's merge_and_unload
    ref = pm.merge_and_unload().state_dict()
    sd = merged.state_dict()
    for n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        assert np.abs(sd[n].numpy() - ref[n].numpy()).max() <= 1e-5 * np.abs(ref[n].numpy()).max(), n
    # --adapter without --merge is a usage error
    rc, _, err = run_ctitan(["export", "--checkpoint", tmp_path / "hf", "--adapter", tmp_path / "adapter",
                             "--out", tmp_path / "x"], check=False)
    assert rc == 2 and "--adapter" in err


def test_dry_run_counts_trained_tensors(run_ctitan):
    """The dry run's trained count, gradient and moment bytes against the LoRA sizes computed
    here from the flavor's shape: r (in + out) per adapted projection per layer."""
    r = 16
    _, out, _ = run_ctitan(["train", "--dry-run", "--model.flavor=4B", "--training.seq_len=2048",
                            "--training.local_batch_size=1", "--activation_checkpoint.mode=full", f"--lora.rank={r}",
                            "--training.frozen_dtype=bfloat16"])
    H, I, L, nH, nKV, hd, V = 2560, 9728, 36, 32, 8, 128, 151936  # Qwen3-4B (shared/REFERENCE.md)
    qd, kvd = nH * hd, nKV * hd
    dims = [(H, qd), (H, kvd), (H, kvd), (qd, H), (H, I), (H, I), (I, H)]
    lora = L * sum(r * (i + o) for i, o in dims)
    base = V * H + L * (2 * H + H * qd + 2 * H * kvd + qd * H + 2 * hd + 3 * H * I) + H
    m = re.search(r"trained: (\d+) parameters .* frozen: (\d+)", out)
    assert m, out
    assert int(m.group(1)) == lora and int(m.group(2)) == base
    grads = int(re.search(r"gradients \(fp32, trained only\)\s+[\d.]+ GiB\s+(\d+) bytes", out).group(1))
    moments = int(re.search(r"AdamW moments \(2 x fp32, trained only\)\s+[\d.]+ GiB\s+(\d+) bytes", out).group(1))
    params = int(re.search(r"parameters \(fp32; frozen matrices bf16\)\s+[\d.]+ GiB\s+(\d+) bytes", out).group(1))
    norms = L * (2 * H + 2 * hd) + H  # frozen but kept fp32
    assert grads == 4 * lora and moments == 8 * lora
    assert params == 4 * lora + 4 * norms + 2 * (base - norms)


def test_lora_bf16_matches_emulated_peft(tmp_path, open_session):
    """LoRA under training.mixed_precision_param = bfloat16 against PEFT with every nn.Linear
    (base and lora_A / lora_B) replaced by test_bf16's emulation of ctitan's bf16 linears,
    with the same criteria and tolerances as test_bf16.test_vs_emulation (measured there):
    loss to 1e-4, logits at >= 75% of positions, and the bf16 effect on every adapter
    gradient in the emulation's direction and size. alpha / r = 2, a power of two, so
    scaling before or after lora_B rounds alike."""
    import copy

    from test_bf16 import BF16, assert_like_emulation, emulate_ctitan_bf16, with_float64_twin

    pm = peft_adapter(tmp_path)
    pm.train()
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, 256, (2, 16))
    labels = rng.integers(0, 256, (2, 16))
    labels[0, :3] = oracle.IGNORE

    def peft_run(model):
        model.zero_grad()
        out = model(input_ids=torch.tensor(tokens))
        logits = out.logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.tensor(labels).reshape(-1),
                                                 ignore_index=oracle.IGNORE)
        loss.backward()
        grads = {n.replace("base_model.model.", "").replace(".default", ""): p.grad.numpy().copy()
                 for n, p in model.named_parameters() if p.requires_grad}
        return loss.item(), logits.detach().numpy(), grads

    l32, lg32, g32 = peft_run(pm)
    emus = [peft_run(emulate_ctitan_bf16(m)) for m in with_float64_twin(lambda: copy.deepcopy(pm))]
    runs = {}
    for mode, extra in (("fp32", []), ("bf16", [BF16])):
        s = open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=16,
                                         extra=["--lora.rank=4", "--lora.alpha=8",
                                                f"--lora.adapter_path={tmp_path / 'adapter'}"] + extra))
        logits = s.logits(tokens)
        nv = oracle.n_valid(labels)
        loss = s.forward_backward(tokens, labels, nv) / nv
        runs[mode] = (loss, logits, {n: s.get_grad(n) for n in g32})
    assert set(g32) and all(".lora_" in n for n in g32)
    assert abs(runs["fp32"][0] - l32) <= 1e-4 * l32, "fp32 LoRA loss vs PEFT"
    loss, logits, grads = runs["bf16"]
    assert_like_emulation(loss, logits, grads, runs["fp32"][2], l32, emus, g32)


def test_adapter_of_another_model_family_is_refused(tmp_path, open_session, run_ctitan):
    """A PEFT adapter trained on a Llama model of another width (its config.json says llama)
    given to a Qwen3 base: refused at open, by the adapter file and the first key that does not
    fit, never applied; and a base directory of a family ctitan does not build is refused by
    generate --adapter naming config.json's model_type."""
    from transformers import LlamaConfig, LlamaForCausalLM
    oracle.save_random_hf(tmp_path / "hf", tiny(False), seed=11)
    lcfg = LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=12)
    llama = LlamaForCausalLM(lcfg)
    llama.save_pretrained(tmp_path / "llama")
    get_peft_model(llama, LoraConfig(r=4, lora_alpha=8, target_modules=SEVEN)).save_pretrained(tmp_path / "ad")
    with pytest.raises(Exception) as ei:
        open_session(hf_session_args(tmp_path / "hf", batch=2, seq_len=16,
                                     extra=["--lora.rank=4", "--lora.alpha=8", f"--lora.adapter_path={tmp_path / 'ad'}"]))
    msg = str(ei.value)
    assert "adapter_model.safetensors" in msg and "has shape" in msg and "lora_A.weight" in msg, msg
    # a base of a family ctitan does not build (Llama is one it does since issue 15)
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (tmp_path / "llama" / "config.json").write_text(json.dumps(cfg))
    rc, _, err = run_ctitan(["generate", "--checkpoint", tmp_path / "llama", "--adapter", tmp_path / "ad",
                             "--prompt-ids", "1 2 3", "--max-tokens", "2"], check=False)
    assert rc != 0 and "config.json" in err and 'model_type "falcon"' in err, err


def test_bf16_frozen_resume_and_export(tmp_path):
    """Runs with frozen_dtype bfloat16 through the CLI, from an fp32 base (rounded on load):
    a LoRA run stopped at step 2 and resumed to 4 equals the uninterrupted one bit for bit
    (the checkpoint holds the adapters; the bf16 base is read again from the HF files), and a
    run freezing layer 0 without LoRA exports, at its end, the frozen tensors as the base's
    bf16-rounded values and the trained ones moved."""
    from test_lora_runs import SEQ, VOCAB, run, tensors, train_args
    from test_resume import losses
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8)
    oracle.save_random_hf(tmp_path / "model", cfg, seed=21)
    data = oracle.write_bin(tmp_path / "tokens.bin", oracle.learnable_stream(200 * (SEQ + 1), VOCAB, seed=7))
    bf = ["--training.frozen_dtype=bfloat16"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run(1, train_args(tmp_path / "model", data, straight, *bf, dropout=0.1, steps=4))
    args = train_args(tmp_path / "model", data, resumed, *bf, dropout=0.1, steps=4)
    assert run(1, args + ["--training.stop_at_step=2"], check=False).returncode == 75
    p = run(1, args)
    assert "resuming from" in p.stderr and "frozen weights in bfloat16" in p.stderr, p.stderr[-2000:]
    assert losses(straight) == losses(resumed)
    a, b = tensors(straight, step=4), tensors(resumed, step=4)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)

    out = tmp_path / "freeze"
    run(1, train_args(tmp_path / "model", data, out, "--training.freeze=model.layers.0.*",
                      "--checkpoint.last_save_in_hf=true", *bf, lora=False, steps=2))
    init = oracle.read_hf_tensors(tmp_path / "model")
    got = {k.split(":", 1)[1]: v for k, v in tensors(out, step=2, files=("model.safetensors",)).items()}
    for n, v in init.items():
        if n.startswith("model.layers.0.") and v.ndim == 2:  # stored in bf16: the rounded base
            want = torch.from_numpy(v).to(torch.bfloat16).float().numpy()
            assert np.array_equal(got[n], want), n
        elif n.startswith("model.layers.0."):  # frozen norms stay fp32
            assert np.array_equal(got[n], v), n
        else:
            assert not np.array_equal(got[n], v), f"{n} did not train"
