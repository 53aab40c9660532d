/* kernels/ops_list.h: the kernel ops, listed once.
 *
 * KERN_OP_LIST(X) expands X(ID, name, bwd, heavy, help) once per op, in
 * kern_op order. From it come:
 *   - the kern_op enum (KERN_OP_<ID>) and KERN_N_OPS, below;
 *   - the op names ("matmul", ...: kern_op_name, kern_op_from_name, the
 *     "unknown op" message and kern_select_ref's all-"ref" list, registry.c);
 *   - the [kernels] config keys, one per op named `name`, with `help` as its
 *     --help text (config/config.c; ct_config.kernels[] has KERN_N_OPS slots);
 *   - bwd: 1 if the op has a backward entry point, 0 for the single-call ones
 *     (kern_bench_has_bwd: `kernels bench` and the tuner time fwd + bwd);
 *   - heavy: 1 if its reference is compute-bound (O(MKN), O(T^2)), so the
 *     tuner never times it beside an optimised one (kernels/tune.c);
 *   - Makefile's REF_KERNELS (every op on "ref", the parity pass), read from
 *     the X( lines of this file by sed: keep one op per line.
 *
 * Written by hand, next to the list, because they differ per op in kind and
 * not only in name (an X-macro would hide the signatures one needs to read):
 * the function types, kern_impl's `fn` union and kern_ops' members
 * (registry.h), install() (registry.c), the check cases (cpu/check.c), the
 * timing harness (timing.c), the tuner's sizes (tune.c) and `kernels bench`'s
 * shapes (cli/cmd_kernels.c). Their switches over kern_op have no `default`,
 * so -Wswitch (in -Wall) names every one a new op must add a case to; the
 * check cases are a table, and kern_check fails an op it has no case for.
 * docs/kernels.md, "Adding an op".
 *
 * No includes: config/config.h includes this for KERN_N_OPS. */
#ifndef CT_KERNELS_OPS_LIST_H
#define CT_KERNELS_OPS_LIST_H

/* matmul_bf16: C = round_bf16(A) round_bf16(B) with fp32 sums, the linears of
 * a run with training.mixed_precision_param = "bfloat16" (kern_use_bf16_matmuls).
 * Same signatures as matmul (fn.matmul); kept a separate op so that its
 * implementations are checked against a reference with the same rounding.
 * moe_experts: the experts of a MoE layer (model/moe.h). moe_experts_bf16: the
 * same with matmul_bf16's rounding in every projection (op_moe_experts_bf16_*),
 * installed over moe_experts by kern_use_bf16_matmuls. geglu: gelu_tanh(gate) * up,
 * the MLP of the Gemma families (op_geglu_*). add: the residual stream's adds
 * (out = a + b; the model's forward and backward, and generate). */
#define KERN_OP_LIST(X)                                                                                          \
    X(MATMUL, matmul, 1, 1, "matmul implementation (ctitan kernels list)")                                       \
    X(EMBEDDING, embedding, 1, 0, "embedding implementation")                                                    \
    X(RMSNORM, rmsnorm, 1, 0, "rmsnorm implementation")                                                          \
    X(ROPE, rope, 1, 0, "rope implementation")                                                                   \
    X(ATTENTION, attention, 1, 1, "attention implementation")                                                    \
    X(SWIGLU, swiglu, 1, 0, "swiglu implementation")                                                             \
    X(CROSSENTROPY, crossentropy, 1, 0, "cross-entropy implementation")                                          \
    X(ADD, add, 0, 0, "residual add implementation")                                                             \
    X(ADAMW, adamw, 0, 0, "AdamW implementation")                                                                \
    X(MATMUL_BF16, matmul_bf16, 1, 1, "bf16 matmul implementation (training.mixed_precision_param = \"bfloat16\")") \
    X(MOE, moe_experts, 1, 1, "MoE experts implementation (MoE models)")                                         \
    X(MOE_BF16, moe_experts_bf16, 1, 1, "MoE experts implementation under bf16 mixed precision")                  \
    X(GEGLU, geglu, 1, 0, "GELU(tanh)-gated MLP activation implementation (Gemma families)")

typedef enum {
#define KERN_OP_ENUM_(ID, name, bwd, heavy, help) KERN_OP_##ID,
    KERN_OP_LIST(KERN_OP_ENUM_)
#undef KERN_OP_ENUM_
} kern_op;

/* The number of ops: a plain int constant, not a kern_op value, so that a
 * switch over kern_op without a default must name every op (-Wswitch) and
 * nothing else, and `op < KERN_N_OPS` compares ints. */
#define KERN_OP_ONE_(ID, name, bwd, heavy, help) +1
#define KERN_N_OPS (0 KERN_OP_LIST(KERN_OP_ONE_))

#endif
