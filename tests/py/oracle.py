"""oracle.py: the independent PyTorch / Hugging Face reference for ctitan's tests.

Everything here computes EXPECTED values with transformers' Qwen3ForCausalLM
(eager attention, fp32) and torch.optim; nothing here ever reads a number that
ctitan produced. Also a few harness helpers (token files, TOML writer, raw
safetensors writer for corrupt files) that carry no expected values.
"""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

torch.set_num_threads(1)  # faster than 2 on this 2-core box when anything else runs

IGNORE = -100


# --------------------------------------------------------------------------- models

def tiny_config(vocab=256, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                rope_theta=1e6, tied=False, eps=1e-6) -> Qwen3Config:
    """A tiny Qwen3 config (HF v5: rope_theta lives in rope_parameters)."""
    cfg = Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, rms_norm_eps=eps, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=tied, use_cache=False, attn_implementation="eager",
    )
    return cfg


def build_model(cfg: Qwen3Config, seed: int = 0, std: float = 0.1, norm_jitter: float = 0.2
                ) -> Qwen3ForCausalLM:
    """Qwen3ForCausalLM in fp32 with seeded weights: matrices N(0, std), norm weights
    1 + U(-norm_jitter, norm_jitter) so that norm weights (and their gradients) matter."""
    cfg._attn_implementation = "eager"
    model = Qwen3ForCausalLM(cfg).to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + norm_jitter * (2 * torch.rand(p.shape, generator=g) - 1))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.eval()  # no dropout anywhere, but be explicit
    return model


def save_model(model: Qwen3ForCausalLM, path, dtype=torch.float32, max_shard_size=None) -> Path:
    path = Path(path)
    m = model if dtype == torch.float32 else _cast_copy(model, dtype)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    m.save_pretrained(str(path), **kw)
    return path


def _cast_copy(model, dtype):
    m = Qwen3ForCausalLM(model.config)
    m.load_state_dict(model.state_dict())
    return m.to(dtype)


def save_random_hf(path, cfg: Qwen3Config, seed: int = 0, **kw) -> Qwen3ForCausalLM:
    model = build_model(cfg, seed=seed)
    save_model(model, path, **kw)
    return model


def load_hf(path, dtype=torch.float32) -> Qwen3ForCausalLM:
    """from_pretrained in `dtype` (fp32 by default, also from a bf16 checkpoint) with eager
    attention; asserts that nothing was missing or unexpected."""
    model, info = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not bad, f"HF loading {path}: {bad}"
    model.eval()
    return model


def param_dict(model) -> dict[str, torch.Tensor]:
    """HF names -> parameters, as ctitan names them (tied: no lm_head.weight)."""
    return dict(model.named_parameters())


def expected_tensor_names(model) -> set[str]:
    names = set(param_dict(model))
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")
    else:
        names.add("lm_head.weight")
    return names


# --------------------------------------------------------------------------- loss / grads

def ce_sum(model, tokens, labels):
    """(sum of CE over labels != -100, logits). labels are already aligned with tokens
    (labels[b, t] is the target of position t): no shift here."""
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    logits = model(input_ids=tokens).logits.float()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss, logits


def n_valid(labels) -> int:
    return int((np.asarray(labels) != IGNORE).sum())


@torch.no_grad()
def hf_loss(model, tokens, labels) -> float:
    s, _ = ce_sum(model, tokens, labels)
    return float(s) / n_valid(labels)


@torch.no_grad()
def hf_logits(model, tokens) -> np.ndarray:
    tokens = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
    return model(input_ids=tokens).logits.float().numpy()


def hf_loss_and_grads(model, tokens, labels):
    """Mean CE over valid labels, logits, and {name: grad} for every parameter."""
    model.zero_grad(set_to_none=True)
    s, logits = ce_sum(model, tokens, labels)
    loss = s / n_valid(labels)
    loss.backward()
    grads = {n: p.grad.detach().clone().numpy() for n, p in param_dict(model).items()}
    model.zero_grad(set_to_none=True)
    return loss.item(), logits.detach().numpy(), grads


# --------------------------------------------------------------------------- lr schedule

def make_lr_lambda(training_steps, warmup_steps, decay_ratio=None, decay_type="linear",
                   min_lr_factor=0.0):
    """torchtitan's linear_warmup_stable_decay factor, verbatim from the spec."""
    warmup_steps = int(warmup_steps)
    if warmup_steps > training_steps:  # build_lr_schedulers' clamp (with its warning)
        warmup_steps = training_steps
    if decay_ratio is None:
        decay_steps = training_steps - warmup_steps
    else:
        decay_steps = round(training_steps * decay_ratio)
        if warmup_steps + decay_steps > training_steps:
            decay_steps = training_steps - warmup_steps
    stable_steps = training_steps + 1 - warmup_steps - decay_steps

    def f(current_step):
        warmup_stable_steps = warmup_steps + stable_steps
        if current_step < warmup_steps:
            current_step += 1
            return float(current_step / warmup_steps)
        elif current_step < warmup_stable_steps:
            return 1.0
        else:
            current_step += 1
            progress = float(current_step - warmup_stable_steps) / decay_steps
            if decay_type == "linear":
                adj = 1 - progress
            elif decay_type == "sqrt":
                adj = 1 - math.sqrt(progress)
            elif decay_type == "cosine":
                adj = 0.5 * (1.0 + math.cos(math.pi * progress))
            else:
                raise ValueError(decay_type)
            return min_lr_factor + (1 - min_lr_factor) * adj
    return f


# --------------------------------------------------------------------------- data

def windows(tokens, seq_len) -> np.ndarray:
    """Disjoint windows of seq_len+1 tokens: window i = tokens[i*(L+1):(i+1)*(L+1)]."""
    tokens = np.asarray(tokens).astype(np.int64)
    n = len(tokens) // (seq_len + 1)
    return tokens[: n * (seq_len + 1)].reshape(n, seq_len + 1)


def micro_batches(tokens, seq_len, local_bs, count):
    """The first `count` micro-batches: micro-batch k takes windows k*B .. k*B+B-1, wrapping
    to the start of the file. Returns a list of (inputs[B,L], labels[B,L]) int64 arrays."""
    w = windows(tokens, seq_len)
    assert len(w) >= 1
    out = []
    for k in range(count):
        idx = [(k * local_bs + j) % len(w) for j in range(local_bs)]
        win = w[idx]
        out.append((win[:, :-1].copy(), win[:, 1:].copy()))
    return out


def write_bin(path, tokens) -> Path:
    path = Path(path)
    np.asarray(tokens, dtype="<u4").tofile(path)
    return path


def write_npy(path, tokens, dtype=np.int64) -> Path:
    path = Path(path)
    np.save(path, np.asarray(tokens, dtype=dtype))
    return path


def random_tokens(n, vocab, seed) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, size=n, dtype=np.int64)


def learnable_stream(n, vocab, seed, strides=(1, 2, 3), seg=(8, 24)) -> np.ndarray:
    """Segments of arithmetic sequences mod vocab, each with a random start, a stride from
    `strides` and a random length: after two tokens of a segment the next one is certain."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        start = int(rng.integers(0, vocab))
        d = int(rng.choice(strides))
        length = int(rng.integers(seg[0], seg[1] + 1))
        out.extend((start + d * i) % vocab for i in range(length))
    return np.asarray(out[:n], dtype=np.int64)


# --------------------------------------------------------------------------- training loop

def reference_train(model, tokens, *, seq_len, local_bs, global_bs, steps, lr, betas=(0.9, 0.95),
                    eps=1e-8, weight_decay=0.1, max_norm=1.0, warmup_steps=0, decay_ratio=None,
                    decay_type="linear", min_lr_factor=0.0, run_steps=None, after_step=None, optimizer="AdamW"):
    """torchtitan's loop in PyTorch: per step, global_bs/local_bs micro-batches, each adding
    the gradient of (its CE sum)/(valid targets of the whole step); clip_grad_norm_; AdamW
    (weight decay on every parameter; `optimizer` "Adam": torch.optim.Adam, the decay added to
    the gradient); LambdaLR stepped after every optimizer step.
    Trains `run_steps` (default `steps`) steps; the schedule is laid out for `steps`.
    after_step(step, model), if given, runs after each optimizer step (step counts from 1),
    with the model in eval mode (a validation pass).
    Returns losses, pre-clip grad norms and lrs per step, and the final {name: ndarray}."""
    assert global_bs % local_bs == 0
    accum = global_bs // local_bs
    run_steps = steps if run_steps is None else run_steps
    params = list(model.parameters())
    opt = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam}[optimizer](
        params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, make_lr_lambda(steps, warmup_steps, decay_ratio, decay_type, min_lr_factor))
    mbs = micro_batches(tokens, seq_len, local_bs, run_steps * accum)
    losses, norms, lrs = [], [], []
    model.train()
    for s in range(run_steps):
        step_mbs = mbs[s * accum:(s + 1) * accum]
        total = sum(n_valid(lab) for _, lab in step_mbs)
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for inp, lab in step_mbs:
            ls, _ = ce_sum(model, inp, lab)
            (ls / total).backward()
            loss_sum += ls.item()
        if max_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(params, max_norm)
        else:
            gn = torch.nn.utils.get_total_norm([p.grad for p in params])
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        losses.append(loss_sum / total)
        norms.append(float(gn))
        if after_step is not None:
            model.eval()
            after_step(s + 1, model)
            model.train()
    model.eval()
    final = {n: p.detach().clone().numpy() for n, p in param_dict(model).items()}
    return {"losses": losses, "grad_norms": norms, "lrs": lrs, "params": final}


def pretrain(model, tokens, *, seq_len, batch, steps, lr=3e-3, seed=0):
    """Plain AdamW pre-training on random windows of `tokens` (for the fine-tune check)."""
    w = torch.as_tensor(windows(tokens, seq_len))
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    loss = None
    for _ in range(steps):
        idx = torch.randint(0, len(w), (batch,), generator=g)
        win = w[idx]
        opt.zero_grad(set_to_none=True)
        s, _ = ce_sum(model, win[:, :-1], win[:, 1:])
        loss = s / win[:, 1:].numel()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


# --------------------------------------------------------------------------- comparisons

def rel_err(a, ref) -> float:
    """max |a - ref| / max |ref| (max |ref| floored at a tiny value)."""
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert a.shape == ref.shape, f"shape {a.shape} != {ref.shape}"
    return float(np.max(np.abs(a - ref)) / max(float(np.max(np.abs(ref))), 1e-30))


def bf16_round(x) -> np.ndarray:
    """fp32 -> bf16 (round to nearest even, as torch does) -> fp32."""
    return torch.as_tensor(np.asarray(x, dtype=np.float32)).to(torch.bfloat16).float().numpy()


# --------------------------------------------------------------------------- files

def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        r = repr(v)
        return r if ("." in r or "e" in r or "inf" in r or "nan" in r) else r + ".0"
    if isinstance(v, str):
        return json.dumps(v)
    raise TypeError(type(v))


def write_toml(path, sections: dict) -> Path:
    """{section: {key: value}} -> TOML file. A value that is a `Raw` is written verbatim."""
    lines = []
    for sec, kv in sections.items():
        lines.append(f"[{sec}]")
        for k, v in kv.items():
            lines.append(f"{k} = {v.text if isinstance(v, Raw) else toml_value(v)}")
        lines.append("")
    path = Path(path)
    path.write_text("\n".join(lines))
    return path


class Raw:
    def __init__(self, text):
        self.text = text


def read_metrics(path) -> list[dict]:
    path = Path(path)
    assert path.exists(), f"metrics file {path} was not written"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return rows


def read_safetensors_raw(path):
    """(header dict, data bytes) of a safetensors file, without validation."""
    b = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8:8 + n]), b[8 + n:]


def write_safetensors_raw(path, header: dict, data: bytes, header_len_override=None) -> Path:
    """Writes exactly what it is given (so it can write corrupt files)."""
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    n = len(h) if header_len_override is None else header_len_override
    Path(path).write_bytes(struct.pack("<Q", n) + h + data)
    return Path(path)


def hf_files(path) -> list[Path]:
    """The safetensors files of an HF directory (through the index when there is one)."""
    path = Path(path)
    idx = path / "model.safetensors.index.json"
    if idx.exists():
        wm = json.loads(idx.read_text())["weight_map"]
        return [path / f for f in sorted(set(wm.values()))]
    assert (path / "model.safetensors").exists(), f"no model.safetensors(.index.json) in {path}"
    return [path / "model.safetensors"]


def read_hf_tensors(path) -> dict[str, np.ndarray]:
    """{name: fp32 ndarray} of every tensor stored in an HF directory."""
    from safetensors.torch import load_file
    out = {}
    for f in hf_files(path):
        for k, v in load_file(str(f)).items():
            assert k not in out, f"{k} stored twice"
            out[k] = v.float().numpy()
    return out


def hf_dtypes(path) -> set[str]:
    """The safetensors dtype strings used in an HF directory."""
    return {v["dtype"] for f in hf_files(path) for k, v in read_safetensors_raw(f)[0].items()
            if k != "__metadata__"}


def train_sections(out, data, hf_dir, *, load=True, steps=2, seq_len=16, local_bs=2, global_bs=None,
                   lr=1e-3, warmup_steps=1, seed=0, options=None) -> dict:
    """A valid `ctitan train` config for a model spec'd by the HF directory `hf_dir`
    (weights loaded from it iff `load`). `options` {"section.key": value} overrides."""
    s = {
        "job": {"dump_folder": str(out)},
        "model": {"spec": "hf", "hf_assets_path": str(hf_dir)},
        "optimizer": {"lr": lr},
        "lr_scheduler": {"warmup_steps": warmup_steps},
        "training": {"local_batch_size": local_bs, "global_batch_size": global_bs or local_bs,
                     "seq_len": seq_len, "steps": steps, "dataset_path": str(data), "seed": seed},
        "checkpoint": {},
        "metrics": {"log_freq": 1},
    }
    if load:
        s["checkpoint"].update({"initial_load_path": str(hf_dir), "initial_load_in_hf": True})
    for k, v in (options or {}).items():
        sec, key = k.split(".", 1)
        s.setdefault(sec, {})[key] = v
    return {k: v for k, v in s.items() if v}
