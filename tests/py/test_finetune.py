"""The fine-tuning check in small: a model pre-trained in PyTorch on a learnable stream,
then fine-tuned by `ctitan train`, starts where PyTorch left it (step-1 loss equals HF's,
far below the random-init loss), while random init starts near ln(vocab)."""
import math


import oracle

V = 64
L = 16
STREAM = dict(strides=(1, 2), seg=(12, 40))
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_norm=1.0,
          warmup_steps=1, decay_ratio=None, decay_type="linear", min_lr_factor=0.0)


def test_finetune_starts_from_pretrained(tmp_path, run_ctitan):
    cfg = oracle.tiny_config(vocab=V, hidden=32, inter=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                             rope_theta=1e4, tied=True)
    model = oracle.build_model(cfg, seed=0, std=0.02, norm_jitter=0.0)
    oracle.pretrain(model, oracle.learnable_stream(20000, V, seed=1, **STREAM), seq_len=L, batch=8, steps=100,
                    lr=1e-2)
    hf_dir = tmp_path / "pretrained"
    oracle.save_model(model, hf_dir)

    fresh = oracle.learnable_stream(8 * (L + 1), V, seed=2, **STREAM)
    data = oracle.write_bin(tmp_path / "fresh.bin", fresh)
    steps = 2
    ref = oracle.reference_train(oracle.load_hf(hf_dir), fresh, seq_len=L, local_bs=2, global_bs=2,
                                 steps=steps, **HP)
    lnv = math.log(V)
    assert ref["losses"][0] < 0.4 * lnv, f"pre-training did not learn the stream: {ref['losses'][0]}"

    options = {"optimizer.eps": HP["eps"], "optimizer.weight_decay": HP["weight_decay"],
               "training.max_norm": HP["max_norm"], "lr_scheduler.decay_type": HP["decay_type"]}
    ft_out = tmp_path / "ft"
    conf = oracle.write_toml(tmp_path / "ft.toml", oracle.train_sections(
        ft_out, data, hf_dir, steps=steps, lr=HP["lr"], warmup_steps=HP["warmup_steps"], options=options))
    run_ctitan(["train", "--config", conf])
    ft = oracle.read_metrics(ft_out / "metrics.jsonl")
    assert [r["step"] for r in ft] == [1, 2]
    for r, want in zip(ft, ref["losses"]):
        assert abs(r["loss"] - want) <= 1e-4 * want, f"step {r['step']}: ctitan {r['loss']} vs PyTorch {want}"

    rnd_out = tmp_path / "rnd"
    conf = oracle.write_toml(tmp_path / "rnd.toml", oracle.train_sections(
        rnd_out, data, hf_dir, load=False, steps=1, lr=HP["lr"], warmup_steps=HP["warmup_steps"], seed=5,
        options=options))
    run_ctitan(["train", "--config", conf])
    rnd = oracle.read_metrics(rnd_out / "metrics.jsonl")
    assert rnd[0]["step"] == 1
    assert abs(rnd[0]["loss"] - lnv) < 0.05 * lnv, f"random-init loss {rnd[0]['loss']} vs ln(V) {lnv}"
    assert ft[0]["loss"] < 0.5 * rnd[0]["loss"], \
        f"fine-tune step-1 loss {ft[0]['loss']} is not far below random init {rnd[0]['loss']}: weights not loaded?"
