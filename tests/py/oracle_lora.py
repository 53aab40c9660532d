"""oracle_lora.py: the PEFT (LoRA) reference for ctitan's LoRA and freeze tests.

Expected values only come from peft + transformers (eager, fp32) and torch autograd /
torch.optim; nothing here reads a number ctitan produced. Facts this relies on (peft
0.21.2, transformers 5.24):

* A LoRA PeftModel names its trainable tensors
  `base_model.model.<hf module>.lora_A.default.weight` (lora_A [r, in], lora_B [out, r]);
  save_pretrained writes them as `base_model.model.<hf module>.lora_A.weight` (fp32,
  metadata {"format": "pt"}). ctitan's names are the saved keys minus `base_model.model.`.
* modules_to_save wraps the module in a ModulesToSaveWrapper: the trained copy is
  `<module>.modules_to_save.default.weight`, saved as `base_model.model.<module>.weight`,
  i.e. ctitan's name is the base tensor's own HF name. A modules_to_save entry matches
  every module whose full name ENDS with it (peft/utils/other.py, _set_trainable:
  key.endswith(target_key)): "norm" is model.norm and every input_layernorm,
  post_attention_layernorm, q_norm and k_norm.
* On Qwen3-MoE (model_type qwen3_moe, transformers' conversion pattern "qwen2_moe"),
  peft rewrites target_modules gate_proj / up_proj / down_proj into
  target_parameters gate_up_proj / down_proj of the fused experts
  (peft/utils/transformers_weight_conversion.py, _convert_peft_config_moe): those names
  then adapt no Linear at all, not even the dense MLP of an mlp_only_layers layer.
"""
from __future__ import annotations

import math

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict

import oracle

PREFIX = "base_model.model."
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
ALL7 = ATTN + MLP


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # PEFT's target_parameters on Qwen3-MoE


def expert_lora_names(layer: int, params) -> list[str]:
    """The keys (less PREFIX) PEFT's ParamWrapper gives the adapters of `params` (subset of
    "gate_up_proj", "down_proj") on one MoE layer, in ctitan's table order (gate_up, down;
    A then B): one wrapper per parameter, nested in the experts' declaration order, so with
    both the gate_up_proj wrapper is the inner one, under base_layer."""
    both = "gate_up_proj" in params and "down_proj" in params
    out = []
    for p in ("gate_up_proj", "down_proj"):
        if p in params:
            nest = "base_layer." if both and p == "gate_up_proj" else ""
            out += [f"model.layers.{layer}.mlp.experts.{nest}lora_{x}.weight" for x in "AB"]
    return out


def module_path(layer: int, mod: str) -> str:
    sub = "self_attn" if mod in ATTN else "mlp"
    return f"model.layers.{layer}.{sub}.{mod}"


def lora_names(layers, targets) -> list[str]:
    """ctitan's LoRA tensor names in table order for `layers` and `targets` (any order)."""
    out = []
    for l in layers:
        for mod in ALL7:
            if mod in targets:
                out += [f"{module_path(l, mod)}.lora_A.weight", f"{module_path(l, mod)}.lora_B.weight"]
    return out


def ctitan_name(peft_name: str) -> str:
    """A PeftModel parameter name -> ctitan's (and the saved adapter's, minus PREFIX) name."""
    n = peft_name
    assert n.startswith(PREFIX), n
    n = n[len(PREFIX):]
    n = n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
    for emb in (".lora_embedding_A.default", ".lora_embedding_B.default"):  # an Embedding's: parameters, no .weight
        if n.endswith(emb):
            n = n[: -len(".default")]
    n = n.replace(".modules_to_save.default.", ".")
    for wrapped in (".base_layer.weight", ".original_module.weight"):  # the wrapped base tensor itself
        if n.endswith(wrapped):
            n = n[: -len(wrapped)] + ".weight"
    return n


def make_peft(base, *, r, alpha, targets, rslora=False, modules_to_save=None, seed=None, std=0.1,
              target_parameters=None, rank_pattern=None, alpha_pattern=None, **lora_kw):
    """A LoRA PeftModel on `base` (fp32, eval mode, dropout 0; targets a list of names or
    PEFT's string form, e.g. "all-linear"; lora_kw: more LoraConfig fields). With `seed`, every lora_A
    and lora_B gets N(0, std) values (non-zero B: the adapter changes the logits and
    every gradient is non-trivial) and every modules_to_save copy gets N(0, std) added
    (so that it differs from the base tensor it copies)."""
    cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                     target_modules=targets if isinstance(targets, str) else list(targets),  # "all-linear" stays
                     rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
                     use_rslora=rslora, modules_to_save=list(modules_to_save) if modules_to_save else None,
                     target_parameters=list(target_parameters) if target_parameters else None,
                     task_type="CAUSAL_LM", **lora_kw)
    pm = get_peft_model(base, cfg)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if ".lora_A." in n or ".lora_B." in n:
                    p.copy_(std * torch.randn(p.shape, generator=g))
                elif ".modules_to_save." in n:
                    p.add_(std * torch.randn(p.shape, generator=g))
    pm.eval()
    return pm


def random_all7_adapter(d, cfg, *, hf_seed, r, alpha, seed):
    """A random HF model of cfg in d/hf and a PEFT adapter with random non-zero A and B
    (make_peft's seed) on all seven projections in d/adapter. Returns (hf_dir,
    adapter_dir, the PeftModel, its trainable tensors, the adapters' names in layer
    order); the trainable tensors must be exactly those adapters (the tests' setup)."""
    hf_dir, ad = d / "hf", d / "adapter"
    oracle.save_random_hf(hf_dir, cfg, seed=hf_seed)
    pm = make_peft(oracle.load_hf(hf_dir), r=r, alpha=alpha, targets=ALL7, seed=seed)
    pm.save_pretrained(str(ad))
    params = trainable(pm)
    lora = lora_names(range(cfg.num_hidden_layers), ALL7)
    assert sorted(params) == sorted(lora), f"test setup: PEFT trains {sorted(params)}"
    return hf_dir, ad, pm, params, lora


def trainable(pm) -> dict[str, torch.nn.Parameter]:
    """{ctitan name: parameter} of every parameter that trains (requires_grad)."""
    out = {}
    for n, p in pm.named_parameters():
        if p.requires_grad:
            k = ctitan_name(n) if n.startswith(PREFIX) else n
            assert k not in out, k
            out[k] = p
    return out


def frozen_base(pm) -> dict[str, np.ndarray]:
    """{HF name: value} of the base model's frozen weights (ModulesToSaveWrapper: the
    original module's copy, which never trains)."""
    out = {}
    for n, p in pm.named_parameters():
        if p.requires_grad or ".lora_" in n or ".modules_to_save." in n or ".original_module." in n:
            continue
        out[ctitan_name(n)] = p.detach().clone().numpy()
    return out


def saved_state(pm) -> dict[str, np.ndarray]:
    """{ctitan name: value} of what save_pretrained writes (get_peft_model_state_dict)."""
    sd = get_peft_model_state_dict(pm)
    out = {}
    for k, v in sd.items():
        assert k.startswith(PREFIX), k
        out[k[len(PREFIX):]] = v.detach().float().numpy().copy()
    return out


def loss_logits_grads(model, params: dict, tokens, labels):
    """Mean CE over valid labels, logits, {name: grad} for the tensors in `params`."""
    model.zero_grad(set_to_none=True)
    s, logits = oracle.ce_sum(model, tokens, labels)
    loss = s / oracle.n_valid(labels)
    loss.backward()
    grads = {n: p.grad.detach().clone().numpy() for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    return loss.item(), logits.detach().numpy(), grads


def train(model, params: dict, tokens, *, seq_len, local_bs, global_bs, steps, run_steps, lr, betas, eps,
          weight_decay, max_norm, warmup_steps, decay_ratio=None, decay_type="linear", min_lr_factor=0.0):
    """oracle.reference_train's loop restricted to `params` {name: parameter} (everything
    else has requires_grad False and is neither clipped, decayed nor updated): AdamW with
    weight decay on every trained tensor, clip_grad_norm_ over them, LambdaLR. Returns per
    step the loss, the pre-clip grad norm, the lr and a snapshot {name: ndarray}."""
    accum = global_bs // local_bs
    plist = list(params.values())
    assert all(p.requires_grad for p in plist)
    opt = torch.optim.AdamW(plist, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, oracle.make_lr_lambda(steps, warmup_steps, decay_ratio, decay_type, min_lr_factor))
    mbs = oracle.micro_batches(tokens, seq_len, local_bs, run_steps * accum)
    out = []
    model.train()
    for s in range(run_steps):
        step_mbs = mbs[s * accum:(s + 1) * accum]
        total = sum(oracle.n_valid(lab) for _, lab in step_mbs)
        model.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for inp, lab in step_mbs:
            ls, _ = oracle.ce_sum(model, inp, lab)
            (ls / total).backward()
            loss_sum += ls.item()
        for n, p in model.named_parameters():
            assert (p.grad is None) != p.requires_grad, f"{n}: gradient on a frozen tensor or none on a trained one"
        gn = torch.nn.utils.clip_grad_norm_(plist, max_norm) if max_norm > 0 else \
            torch.nn.utils.get_total_norm([p.grad for p in plist])
        lr_used = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        out.append({"loss": loss_sum / total, "grad_norm": float(gn), "lr": lr_used,
                    "params": {n: p.detach().clone().numpy() for n, p in params.items()}})
    model.eval()
    return out


def load_adapter_strict(base, adapter_dir):
    """PeftModel.from_pretrained with every warning an error (peft warns on missing adapter
    keys); also asserts that every tensor of the file was loaded into the model (peft does
    not warn on unexpected keys) with its exact value."""
    import logging
    import warnings
    from safetensors.torch import load_file

    class Grab(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.records = []

        def emit(self, record):
            self.records.append(record.getMessage())

    grab = Grab()
    loggers = [logging.getLogger(n) for n in ("peft", "transformers", "")]
    for lg in loggers:
        lg.addHandler(grab)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            # transformers 5.24 deprecates the attribute that PeftModel.__init__ reads: not about the adapter
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            # PEFT 0.21.2 says this on its own adapters for target_modules gate_proj + up_proj on a MoE model:
            # the check looks at the Linear targets only, while the ParamWrapper does take gate_up_proj's rank
            # and alpha from the pattern (its tensors are 2 r wide: loading them at r would fail)
            # (and so on ctitan's expert patterns, gate_up_proj's and down_proj's, which the ParamWrapper takes)
            warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match any "
                                    r"targeted module and were ignored: "
                                    r"\[('\.\*\\\\\.(gate_up_proj|down_proj)'(, )?){1,2}\]\.$",
                                    category=RuntimeWarning)
            pm = PeftModel.from_pretrained(base, str(adapter_dir))
    finally:
        for lg in loggers:
            lg.removeHandler(grab)
    assert not grab.records, f"loading the adapter {adapter_dir} logged warnings: {grab.records}"
    pm.eval()
    file = {k: v.float().numpy() for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}
    got = {PREFIX + k: v for k, v in saved_state(pm).items()}
    assert set(file) == set(got), \
        f"adapter keys not loaded: {sorted(set(file) - set(got))}; not in file: {sorted(set(got) - set(file))}"
    bad = [k for k in file if not np.array_equal(file[k], got[k])]
    assert not bad, f"tensors loaded with other values: {bad}"
    return pm


def scaling(alpha, r, rslora) -> float:
    return alpha / math.sqrt(r) if rslora else alpha / r
