"""Twelfth mutation audit (docs/reliability.md): context parallel switches its chunk length to
validation.seq_len for an evaluation (plan_eval) and back to training's for the next step
(plan_forward_backward). With the switch back dropped the suite passed: its CP runs evaluate
after their only step. Here CP 2 (headtail) trains 3 steps at lr > 0 with an evaluation of
32-token windows after each step: its training losses are the same CP 2 run's without
validation, bit for bit, and (the oracle) transformers' first-step loss."""
import oracle
from test_dist import run
from test_validation_seq_len_layouts import _args, setup  # noqa: F401 (fixture)


def _train_losses(out):
    return [r["loss"] for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r]


def test_cp_trains_on_after_a_longer_validation(setup):
    d, train_tokens, _ = setup
    cp = ["--parallelism.context_parallel_degree=2", "--training.steps=3", "--optimizer.lr=1e-2"]
    with_val = _args(d, d / "a12_cp_val", 32, extra=cp)
    without = [a for a in with_val if not a.startswith("--validation")] + cp
    without[without.index(f"--job.dump_folder={d / 'a12_cp_val'}")] = f"--job.dump_folder={d / 'a12_cp_noval'}"
    run(2, with_val, timeout=300)
    run(2, without, timeout=300)
    got, want = _train_losses(d / "a12_cp_val"), _train_losses(d / "a12_cp_noval")
    assert len(got) == 3 and got == want, (got, want)
    vals = [r for r in oracle.read_metrics(d / "a12_cp_val" / "metrics.jsonl") if "val_loss" in r]
    assert len(vals) == 3, vals
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(d / "model")
    w = oracle.windows(train_tokens, 16)[:2]
    ref = oracle.hf_loss(model, w[:, :-1], w[:, 1:])
    assert abs(got[0] - ref) <= 1e-4 * ref, (got[0], ref)
