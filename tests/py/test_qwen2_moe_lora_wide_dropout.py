"""LoRA dropout on a qwen2_moe shared expert wider than the hidden size, the heads and the
dense MLP (the ninth mutation audit). The dropout's scratch (drop(x) and its gradient) holds
the widest adapter input, here the shared expert's down_proj (Is 96 > intermediate 48 >
hidden 32); sized without Is it overflowed into the buffers carved after it, and no test had
an Is above the others with dropout on (test_qwen2_moe_lora_layouts' is 40 < 48).

The oracle is PEFT with dropout off: at lora.dropout 1e-7 ctitan's hashed masks keep every
element of these runs (keep 1 / (1 - p) differs from 1 by 1e-7), so three AdamW steps on
all-linear must equal PEFT + torch's loop, as test_families_lora's dropout-free steps do."""
import oracle
import oracle_families as fam
import oracle_lora as OL
from conftest import hf_session_args
from test_families_lora import lora_args, qwen2_moe_peft
from test_qwen2_moe_widths import CASES

TARGETS = "all-linear"


def test_wide_shared_expert_with_dropout_matches_peft(tmp_path, open_session):
    from test_lora import SCHED, compare_steps, opt_args, session_steps
    from test_train_loop import GLOBAL_BS, HP, LOCAL_BS, L
    case = fam.Case("qwen2_moe_wide_all_sparse", "qwen2_moe", CASES["wide_all_sparse"], seed=13)
    base = fam.build(case)
    base.config.output_router_logits = False  # PEFT's reference loss is the CE
    c = base.config
    assert c.shared_expert_intermediate_size > max(c.hidden_size, c.intermediate_size,
                                                   c.num_attention_heads * (c.hidden_size // c.num_attention_heads))
    hf_dir, ad = tmp_path / "hf", tmp_path / "adapter"
    fam.save(base, hf_dir)
    pm, params = qwen2_moe_peft(lambda: fam.prepare_loaded(fam.load(hf_dir, case.family), case.family), TARGETS, ad,
                                seed=7)
    stream = oracle.random_tokens(8 * (L + 1), c.vocab_size, seed=16)
    ref = OL.train(pm, params, stream, seq_len=L, local_bs=LOCAL_BS, global_bs=GLOBAL_BS, steps=SCHED, run_steps=3,
                   **HP)
    s = open_session(hf_session_args(hf_dir, batch=LOCAL_BS, seq_len=L,
                                     extra=lora_args(TARGETS, ad) + opt_args() + ["--lora.dropout=1e-7"]))
    compare_steps(session_steps(s, stream, list(params), run=3), ref)
