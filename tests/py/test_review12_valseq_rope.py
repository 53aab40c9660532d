"""validation.seq_len past training's with a RoPE whose tables depend on the forward's length
(review12): dynamic NTK (transformers recomputes inv_freq once max(position_ids) + 1 outgrows
max_position_embeddings) and longrope (long_factor past original_max_position_embeddings),
and yarn (length-free, the control). Training runs at 16 tokens = max_position_embeddings,
validation at 32: the held-out loss must be transformers' on the same 32-token windows, with
the tables of the 32-token forward, not the training forward's, and the step's training loss
the 16-token forward's (a model sized for 32 must not keep 32's tables for training). Each case also checks that the
length-dependent tables move transformers' own loss (so a run on training's tables fails)."""
import copy

import pytest

import oracle
from test_dist import run

VOCAB, TRAIN_LEN, VAL_LEN, N_VAL, MAXPOS = 200, 16, 32, 4, 16

ROPES = {
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": MAXPOS,
                 "short_factor": [1.0 + 0.05 * i for i in range(4)],
                 "long_factor": [2.0 + 1.5 * i for i in range(4)]},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": MAXPOS},
}


def _model(tmp_path, kind):
    cfg = oracle.tiny_config(vocab=VOCAB, hidden=32, inter=48, layers=2, heads=4, kv_heads=2, head_dim=8,
                             rope_theta=100.0)
    cfg.max_position_embeddings = MAXPOS
    cfg.rope_parameters = {"rope_theta": 100.0, **ROPES[kind]}
    return oracle.save_random_hf(tmp_path / "model", cfg, seed=4)


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_val_loss_past_training_length_uses_its_own_tables(tmp_path, kind):
    model = _model(tmp_path, kind)
    train = oracle.learnable_stream(2 * (TRAIN_LEN + 1), VOCAB, seed=1)
    oracle.write_bin(tmp_path / "train.bin", train)
    val = oracle.learnable_stream(N_VAL * (VAL_LEN + 1), VOCAB, seed=3)
    oracle.write_bin(tmp_path / "val.bin", val)
    out = tmp_path / "out"
    run(1, ["train", "--model.spec=hf", f"--model.hf_assets_path={tmp_path / 'model'}",
            f"--checkpoint.initial_load_path={tmp_path / 'model'}", "--checkpoint.initial_load_in_hf",
            f"--training.dataset_path={tmp_path / 'train.bin'}", f"--training.seq_len={TRAIN_LEN}",
            "--training.local_batch_size=2", "--training.global_batch_size=2", "--training.steps=1",
            "--optimizer.lr=0", "--metrics.log_freq=1", f"--job.dump_folder={out}",
            "--validation.enable", f"--validation.dataset_path={tmp_path / 'val.bin'}", "--validation.freq=1",
            "--validation.steps=-1", "--validation.local_batch_size=2", f"--validation.seq_len={VAL_LEN}"])
    rows = oracle.read_metrics(out / "metrics.jsonl")
    # training's own loss (lr 0: the loaded model) at 16 tokens, with training's tables
    loss = [r["loss"] for r in rows if "loss" in r]
    t = oracle.windows(train, TRAIN_LEN)[:2]
    want_t = oracle.hf_loss(model, t[:, :-1], t[:, 1:])
    assert len(loss) == 1 and abs(loss[0] - want_t) <= 1e-4 * want_t, f"{kind}: training loss {loss} vs HF {want_t}"
    got = [r for r in rows if "val_loss" in r]
    w = oracle.windows(val, VAL_LEN)
    assert len(w) == N_VAL
    want = oracle.hf_loss(model, w[:, :-1], w[:, 1:])
    assert len(got) == 1 and got[0]["val_targets"] == N_VAL * VAL_LEN, got
    assert abs(got[0]["val_loss"] - want) <= 1e-4 * want, f"{kind}: val_loss {got[0]['val_loss']} vs HF {want}"
    # the bite: transformers' loss on the same windows with the plain (default) RoPE differs
    plain_cfg = copy.deepcopy(model.config)
    plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": 100.0}
    plain = oracle.build_model(plain_cfg, seed=0)
    plain.load_state_dict(model.state_dict())
    other = oracle.hf_loss(plain, w[:, :-1], w[:, 1:])
    assert abs(other - want) > 1e-3 * want, f"{kind}: the scaled RoPE does not move the loss ({other} vs {want})"
