/* kernels/registry.c: the table of implementations and the per-run choice.
 *
 * Design: a const array, nothing registers itself at start-up and nothing is
 * mutable, so two runs in one process (the Python tests drive libctitan that
 * way) can choose differently without interfering. Within an op, entries are
 * listed in order of preference (fastest first, measured: docs/kernels.md);
 * the default is the first one the CPU can run, and "ref" (features 0) is
 * last, so there is always one. Adding an implementation is one entry here
 * plus its functions (docs/kernels.md, "Adding an implementation"). */
#include "kernels/registry.h"

#include <stdlib.h>
#include <string.h>
#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif

#include "core/cpu.h"
#include "kernels/cpu/kern_cpu.h"
#include "kernels/ops.h"

static const char *const op_names[KERN_N_OPS] = {
#define OP_NAME(ID, name, bwd, heavy, help) [KERN_OP_##ID] = #name,
    KERN_OP_LIST(OP_NAME)
#undef OP_NAME
};

static const kern_impl registry[] = {
    /* matmul: own packed GEMM first (AVX-512, then AVX2), OpenBLAS, then the reference */
#if defined(__x86_64__)
    {KERN_OP_MATMUL, "avx512", "cpu", KERN_FEAT_AVX512, 0, "packed GEMM, 14x32 zmm micro-kernel, OpenMP tiles",
     .fn.matmul = {kern_matmul_fwd_avx512, kern_matmul_bwd_avx512,
                   kern_matmul_fwd_wbf16_avx512, kern_matmul_dinp_wbf16_avx512}},
    {KERN_OP_MATMUL, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "packed GEMM, 6x16 ymm micro-kernel, OpenMP tiles", .fn.matmul = {kern_matmul_fwd_avx2, kern_matmul_bwd_avx2,
                   kern_matmul_fwd_wbf16_avx2, kern_matmul_dinp_wbf16_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_MATMUL, "neon", "cpu", KERN_FEAT_NEON, 0, "packed GEMM, 8x12 NEON micro-kernel (fmla by lane), OpenMP tiles",
     .fn.matmul = {kern_matmul_fwd_neon, kern_matmul_bwd_neon,
                   kern_matmul_fwd_wbf16_neon, kern_matmul_dinp_wbf16_neon}},
    /* after neon: tested under qemu only, never timed on SVE hardware (gemm_sve.c) */
    {KERN_OP_MATMUL, "sve", "cpu", KERN_FEAT_SVE, 0, "packed GEMM, 8 x 3VL SVE micro-kernel (any vector length)",
     .fn.matmul = {kern_matmul_fwd_sve, kern_matmul_bwd_sve, kern_matmul_fwd_wbf16_sve, kern_matmul_dinp_wbf16_sve}},
#endif
    {KERN_OP_MATMUL, "openblas", "cpu", 0, 0, "cblas_sgemm (core type as OPENBLAS_CORETYPE / the library picks)",
     .fn.matmul = {kern_matmul_fwd_openblas, kern_matmul_bwd_openblas,
                   kern_matmul_fwd_wbf16_openblas, kern_matmul_dinp_wbf16_openblas}},
    {KERN_OP_MATMUL, "ref", "cpu", 0, 0, "kernels/ref (op_matmul_*)", .fn.matmul = {op_matmul_fwd, op_matmul_bwd, op_matmul_fwd_wbf16, op_matmul_dinp_wbf16}},

    /* the memory-bound ops: AVX-512 one-pass kernels (kernels/cpu/elementwise_avx512.c), then the reference */
#if defined(__x86_64__)
    {KERN_OP_EMBEDDING, "avx512", "cpu", KERN_FEAT_AVX512, 0, "row memcpy; zmm bwd by column chunks, tokens in order",
     .fn.embedding = {kern_embedding_fwd_avx512, kern_embedding_bwd_avx512}},
    {KERN_OP_EMBEDDING, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "row memcpy; ymm bwd by column chunks, tokens in order",
     .fn.embedding = {kern_embedding_fwd_avx2, kern_embedding_bwd_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_EMBEDDING, "neon", "cpu", KERN_FEAT_NEON, 0, "row memcpy; NEON bwd by column chunks, tokens in order",
     .fn.embedding = {kern_embedding_fwd_neon, kern_embedding_bwd_neon}},
#endif
    {KERN_OP_EMBEDDING, "ref", "cpu", 0, 0, "kernels/ref", .fn.embedding = {op_embedding_fwd, op_embedding_bwd}},
#if defined(__x86_64__)
    {KERN_OP_RMSNORM, "avx512", "cpu", KERN_FEAT_AVX512, 0, "zmm rows; dw by column chunks",
     .fn.rmsnorm = {kern_rmsnorm_fwd_avx512, kern_rmsnorm_bwd_avx512, kern_rmsnorm_bwd_w_avx512}},
    {KERN_OP_RMSNORM, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0, "ymm rows; dw by column chunks",
     .fn.rmsnorm = {kern_rmsnorm_fwd_avx2, kern_rmsnorm_bwd_avx2, kern_rmsnorm_bwd_w_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_RMSNORM, "neon", "cpu", KERN_FEAT_NEON, 0, "NEON rows; dw by column chunks",
     .fn.rmsnorm = {kern_rmsnorm_fwd_neon, kern_rmsnorm_bwd_neon, kern_rmsnorm_bwd_w_neon}},
#endif
    {KERN_OP_RMSNORM, "ref", "cpu", 0, 0, "kernels/ref",
     .fn.rmsnorm = {op_rmsnorm_fwd, op_rmsnorm_bwd, op_rmsnorm_bwd_w}},
#if defined(__x86_64__)
    {KERN_OP_ROPE, "avx512", "cpu", KERN_FEAT_AVX512, 0, "zmm pairs; q/k norm + RoPE fused in one pass per head",
     .fn.rope = {kern_rope_fwd_avx512, kern_rope_bwd_avx512, kern_qknorm_rope_fwd_avx512,
                 kern_qknorm_rope_bwd_avx512, kern_qknorm_rope_bwd_w_avx512}},
    {KERN_OP_ROPE, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "ymm pairs; q/k norm + RoPE fused in one pass per head",
     .fn.rope = {kern_rope_fwd_avx2, kern_rope_bwd_avx2, kern_qknorm_rope_fwd_avx2, kern_qknorm_rope_bwd_avx2,
                 kern_qknorm_rope_bwd_w_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_ROPE, "neon", "cpu", KERN_FEAT_NEON, 0, "NEON pairs; q/k norm + RoPE fused in one pass per head",
     .fn.rope = {kern_rope_fwd_neon, kern_rope_bwd_neon, kern_qknorm_rope_fwd_neon, kern_qknorm_rope_bwd_neon,
                 kern_qknorm_rope_bwd_w_neon}},
#endif
    {KERN_OP_ROPE, "ref", "cpu", 0, 0, "kernels/ref; q/k norm + RoPE as rmsnorm then rope",
     .fn.rope = {op_rope_fwd, op_rope_bwd, op_qknorm_rope_fwd, op_qknorm_rope_bwd, op_qknorm_rope_bwd_w}},
#if defined(__x86_64__)
    {KERN_OP_ATTENTION, "blocked_avx512bf16", "cpu", KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16, 0,
     "blocked_avx512 with vdpbf16ps products under bf16 mixed precision (scores, and the whole backward)",
     .fn.attention = {kern_attention_fwd_avx512bf16, kern_attention_bwd_avx512bf16, kern_attention_fwd_q0_avx512bf16,
                      kern_attention_bwd_q0_avx512bf16, kern_attention_fwd_blk_avx512bf16,
                      kern_attention_bwd_blk_avx512bf16}},
    {KERN_OP_ATTENTION, "blocked_avx512", "cpu", KERN_FEAT_AVX512, 0,
     "tiles as \"tiled\", 4x64 zmm register blocks for every product (hd % 64 == 0; else tiled_avx512)",
     .fn.attention = {kern_attention_fwd_avx512, kern_attention_bwd_avx512, kern_attention_fwd_q0_avx512,
                      kern_attention_bwd_q0_avx512, kern_attention_fwd_blk_avx512, kern_attention_bwd_blk_avx512}},
    {KERN_OP_ATTENTION, "tiled_avx512", "cpu", KERN_FEAT_AVX512, 0, "\"tiled\" compiled for AVX-512 (same results)",
     .fn.attention = {op_attention_fwd_tiled_avx512, op_attention_bwd_tiled_avx512, op_attention_fwd_q0_tiled_avx512,
                      op_attention_bwd_q0_tiled_avx512, op_attention_fwd_blk_tiled_avx512,
                      op_attention_bwd_blk_tiled_avx512}},
    {KERN_OP_ATTENTION, "blocked_avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "tiles as \"tiled\", 6x16 ymm register blocks for every product (hd % 16 == 0; else tiled_avx2)",
     .fn.attention = {kern_attention_fwd_avx2, kern_attention_bwd_avx2, kern_attention_fwd_q0_avx2,
                      kern_attention_bwd_q0_avx2, kern_attention_fwd_blk_avx2, kern_attention_bwd_blk_avx2}},
    {KERN_OP_ATTENTION, "tiled_avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "\"tiled\" compiled for AVX2 + FMA (same results)",
     .fn.attention = {op_attention_fwd_tiled_avx2, op_attention_bwd_tiled_avx2, op_attention_fwd_q0_tiled_avx2,
                      op_attention_bwd_q0_tiled_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_ATTENTION, "blocked_neon", "cpu", KERN_FEAT_NEON, 0,
     "tiles as \"tiled\", 12x8 NEON register blocks, fmla by lane, rows in lanes (hd % 8 == 0; else tiled)",
     .fn.attention = {kern_attention_fwd_neon, kern_attention_bwd_neon, kern_attention_fwd_q0_neon,
                      kern_attention_bwd_q0_neon, kern_attention_fwd_blk_neon, kern_attention_bwd_blk_neon}},
    {KERN_OP_ATTENTION, "tiled_sve", "cpu", KERN_FEAT_SVE, 0, "\"tiled\" compiled for SVE (same results)",
     .fn.attention = {op_attention_fwd_tiled_sve, op_attention_bwd_tiled_sve, op_attention_fwd_q0_tiled_sve,
                      op_attention_bwd_q0_tiled_sve}},
#endif
    {KERN_OP_ATTENTION, "tiled", "cpu", 0, 0, "kernels/ref/attention.c: 32x64 tiles, online softmax, recompute in bwd",
     .fn.attention = {op_attention_fwd_tiled, op_attention_bwd_tiled, op_attention_fwd_q0_tiled,
                      op_attention_bwd_q0_tiled, op_attention_fwd_blk_tiled, op_attention_bwd_blk_tiled}},
    {KERN_OP_ATTENTION, "ref", "cpu", 0, 0, "kernels/ref: a row at a time, saves lse [B,nh,T], recompute in bwd",
     .fn.attention = {op_attention_fwd, op_attention_bwd, op_attention_fwd_q0, op_attention_bwd_q0,
                      op_attention_fwd_blk, op_attention_bwd_blk}},
#if defined(__x86_64__)
    {KERN_OP_SWIGLU, "avx512", "cpu", KERN_FEAT_AVX512, 0, "zmm, vector exp (2 ulp)",
     .fn.swiglu = {kern_swiglu_fwd_avx512, kern_swiglu_bwd_avx512}},
    {KERN_OP_SWIGLU, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0, "ymm, vector exp (2 ulp)",
     .fn.swiglu = {kern_swiglu_fwd_avx2, kern_swiglu_bwd_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_SWIGLU, "neon", "cpu", KERN_FEAT_NEON, 0, "NEON, vector exp (2 ulp)",
     .fn.swiglu = {kern_swiglu_fwd_neon, kern_swiglu_bwd_neon}},
#endif
    {KERN_OP_SWIGLU, "ref", "cpu", 0, 0, "kernels/ref", .fn.swiglu = {op_swiglu_fwd, op_swiglu_bwd}},
#if defined(__x86_64__)
    {KERN_OP_GEGLU, "avx512", "cpu", KERN_FEAT_AVX512, 0, "zmm, torch's gelu tanh formula with the vector tanh",
     .fn.geglu = {kern_geglu_fwd_avx512, kern_geglu_bwd_avx512}},
    {KERN_OP_GEGLU, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0, "ymm, torch's gelu tanh formula with the vector tanh",
     .fn.geglu = {kern_geglu_fwd_avx2, kern_geglu_bwd_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_GEGLU, "neon", "cpu", KERN_FEAT_NEON, 0, "NEON, torch's gelu tanh formula with the vector tanh",
     .fn.geglu = {kern_geglu_fwd_neon, kern_geglu_bwd_neon}},
#endif
    {KERN_OP_GEGLU, "ref", "cpu", 0, 0, "kernels/ref (torch's gelu tanh formula, tanhf)",
     .fn.geglu = {op_geglu_fwd, op_geglu_bwd}},
#if defined(__x86_64__)
    {KERN_OP_CROSSENTROPY, "avx512", "cpu", KERN_FEAT_AVX512, 0,
     "3 zmm passes per row, vector exp (2 ulp); vocabulary-parallel phases the same",
     .fn.crossentropy = {kern_crossentropy_fwdbwd_avx512, kern_crossentropy_fwd_avx512,
                         kern_crossentropy_vp_max_avx512, kern_crossentropy_vp_sums_avx512,
                         kern_crossentropy_vp_grad_avx512}},
    {KERN_OP_CROSSENTROPY, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "3 ymm passes per row, vector exp (2 ulp); vocabulary-parallel phases the same",
     .fn.crossentropy = {kern_crossentropy_fwdbwd_avx2, kern_crossentropy_fwd_avx2, kern_crossentropy_vp_max_avx2,
                         kern_crossentropy_vp_sums_avx2, kern_crossentropy_vp_grad_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_CROSSENTROPY, "neon", "cpu", KERN_FEAT_NEON, 0,
     "3 NEON passes per row, vector exp (2 ulp); vocabulary-parallel phases the same",
     .fn.crossentropy = {kern_crossentropy_fwdbwd_neon, kern_crossentropy_fwd_neon, kern_crossentropy_vp_max_neon,
                         kern_crossentropy_vp_sums_neon, kern_crossentropy_vp_grad_neon}},
#endif
    {KERN_OP_CROSSENTROPY, "ref", "cpu", 0, 0, "kernels/ref; vocabulary-parallel phases in ref/crossentropy_vp.c",
     .fn.crossentropy = {op_crossentropy_fwdbwd, op_crossentropy_fwd, op_crossentropy_vp_max,
                         op_crossentropy_vp_sums, op_crossentropy_vp_grad}},
#if defined(__x86_64__)
    {KERN_OP_ADD, "avx512", "cpu", KERN_FEAT_AVX512, 0, "zmm (same results as ref)", .fn.add = {kern_add_avx512}},
    {KERN_OP_ADD, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0, "ymm (same results as ref)",
     .fn.add = {kern_add_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_ADD, "neon", "cpu", KERN_FEAT_NEON, 0, "NEON (same results as ref)", .fn.add = {kern_add_neon}},
#endif
    {KERN_OP_ADD, "ref", "cpu", 0, 0, "kernels/ref", .fn.add = {op_add}},
#if defined(__x86_64__)
    {KERN_OP_ADAMW, "avx512", "cpu", KERN_FEAT_AVX512, 0, "one zmm pass per tensor (same results as ref)",
     .fn.adamw = {kern_adamw_step_avx512}},
    {KERN_OP_ADAMW, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "one ymm pass per tensor (same results as ref)",
     .fn.adamw = {kern_adamw_step_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_ADAMW, "neon", "cpu", KERN_FEAT_NEON, 0, "one NEON pass per tensor (same results as ref)",
     .fn.adamw = {kern_adamw_step_neon}},
#endif
    {KERN_OP_ADAMW, "ref", "cpu", 0, 0, "optim/optim.c adamw_step", .fn.adamw = {adamw_step}},

    /* matmul_bf16: AMX tiles, else vdpbf16ps where the CPU has it, else the fp32 micro-kernels on
     * bf16-rounded packed panels (the same products, exact in fp32), then the reference */
#if defined(__x86_64__)
    {KERN_OP_MATMUL_BF16, "amx", "cpu", KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16 | KERN_FEAT_AMXBF16, 0,
     "packed GEMM, bf16 pairs, 32x32 blocks of 2x2 AMX tiles (tdpbf16ps), fp32 sums",
     .fn.matmul = {kern_matmul_bf16_fwd_amx, kern_matmul_bf16_bwd_amx,
                   kern_matmul_fwd_wbf16_bf16_amx, kern_matmul_dinp_wbf16_bf16_amx}},
    {KERN_OP_MATMUL_BF16, "avx512bf16", "cpu", KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16, 0,
     "packed GEMM, bf16 pairs, 14x32 vdpbf16ps micro-kernel, fp32 sums",
     .fn.matmul = {kern_matmul_bf16_fwd_avx512bf16, kern_matmul_bf16_bwd_avx512bf16,
                   kern_matmul_fwd_wbf16_bf16_avx512bf16, kern_matmul_dinp_wbf16_bf16_avx512bf16}},
    {KERN_OP_MATMUL_BF16, "avx512", "cpu", KERN_FEAT_AVX512, 0, "matmul avx512 on panels rounded to bf16 when packed",
     .fn.matmul = {kern_matmul_bf16_fwd_avx512, kern_matmul_bf16_bwd_avx512,
                   kern_matmul_fwd_wbf16_bf16_avx512, kern_matmul_dinp_wbf16_bf16_avx512}},
    {KERN_OP_MATMUL_BF16, "avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "matmul avx2 on panels rounded to bf16 when packed",
     .fn.matmul = {kern_matmul_bf16_fwd_avx2, kern_matmul_bf16_bwd_avx2,
                   kern_matmul_fwd_wbf16_bf16_avx2, kern_matmul_dinp_wbf16_bf16_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_MATMUL_BF16, "bfmmla", "cpu", KERN_FEAT_NEON | KERN_FEAT_ARM_BF16, 0,
     "packed GEMM, bf16, 8x8 tile of 2x2 BFMMLA blocks, fp32 sums",
     .fn.matmul = {kern_matmul_bf16_fwd_bfmmla, kern_matmul_bf16_bwd_bfmmla,
                   kern_matmul_fwd_wbf16_bf16_bfmmla, kern_matmul_dinp_wbf16_bf16_bfmmla}},
    /* after bfmmla: tested under qemu only, never timed on SVE hardware (gemm_sve_bf16.c) */
    {KERN_OP_MATMUL_BF16, "sve_bfmmla", "cpu", KERN_FEAT_SVE | KERN_FEAT_ARM_BF16, 0,
     "packed GEMM, bf16, SVE BFMMLA (2x2 tile per 128-bit segment), 8 x 2VL/32 tile, fp32 sums",
     .fn.matmul = {kern_matmul_bf16_fwd_sve_bfmmla, kern_matmul_bf16_bwd_sve_bfmmla,
                   kern_matmul_fwd_wbf16_bf16_sve_bfmmla, kern_matmul_dinp_wbf16_bf16_sve_bfmmla}},
    {KERN_OP_MATMUL_BF16, "neon", "cpu", KERN_FEAT_NEON, 0, "matmul neon on panels rounded to bf16 when packed",
     .fn.matmul = {kern_matmul_bf16_fwd_neon, kern_matmul_bf16_bwd_neon,
                   kern_matmul_fwd_wbf16_bf16_neon, kern_matmul_dinp_wbf16_bf16_neon}},
#endif
    {KERN_OP_MATMUL_BF16, "ref", "cpu", 0, 0, "kernels/ref: inputs rounded to bf16, then the fp32 reference",
     .fn.matmul = {op_matmul_bf16_fwd, op_matmul_bf16_bwd, op_matmul_bf16_fwd_wbf16,
                   op_matmul_bf16_dinp_wbf16}},

    /* moe_experts: tokens permuted by expert, one grouped GEMM per projection on the packed GEMM */
#if defined(__x86_64__)
    {KERN_OP_MOE, "grouped_avx512", "cpu", KERN_FEAT_AVX512, 0,
     "permuted tokens, grouped GEMM per projection (14x32 zmm tiles)",
     .fn.moe = {kern_moe_fwd_avx512, kern_moe_bwd_avx512,
                kern_moe_fwd_wbf16_avx512, kern_moe_bwd_wbf16_avx512,
                kern_moe_bwd_w_avx512}},
    {KERN_OP_MOE, "grouped_avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, 0,
     "permuted tokens, grouped GEMM per projection (6x16 ymm tiles)",
     .fn.moe = {kern_moe_fwd_avx2, kern_moe_bwd_avx2,
                kern_moe_fwd_wbf16_avx2, kern_moe_bwd_wbf16_avx2,
                kern_moe_bwd_w_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_MOE, "grouped_neon", "cpu", KERN_FEAT_NEON, 0,
     "permuted tokens, grouped GEMM per projection (8x12 NEON tiles)", .fn.moe = {kern_moe_fwd_neon, kern_moe_bwd_neon,
                kern_moe_fwd_wbf16_neon, kern_moe_bwd_wbf16_neon,
                kern_moe_bwd_w_neon}},
#endif
    {KERN_OP_MOE, "ref", "cpu", 0, 0, "kernels/ref/moe.c: a loop over experts, one token row at a time",
     .fn.moe = {op_moe_experts_fwd, op_moe_experts_bwd, op_moe_experts_fwd_wbf16, op_moe_experts_bwd_wbf16,
                op_moe_experts_bwd_w}},

    /* moe_experts_bf16: the grouped experts on matmul_bf16's GEMMs (bf16 rounding when packed).
     * Their own tolerance: the forward rounds h and the backward d gate / d up, fp32 values
     * computed by GEMMs whose summation order differs from the reference's, so a last-bit
     * difference can flip an element to the neighbouring bf16 value (2^-8 relative, one term of
     * a sum). How many flip grows with N x I (the check's N = 1000, I = 160 case rounds 160 k
     * values of h alone), and where a flip lands decides its effect, so the max error is a tail
     * over input draws, not a constant: over 80 seeds of the check's shapes (2026-12-04, Zen 5)
     * out reached 8.8e-4 of max|ref| (grouped_avx2, grouped_avx512bf16), dx 5.2e-4 and dw 4.9e-4,
     * and 6 of the 240 (seed, implementation) runs exceeded the 5e-4 this bound was before;
     * grouped_amx, whose TDPBF16PS sums 32 products per tile row in its own order, measured out
     * 8.4e-4 over 41 seeds. One bound for all of them, 2e-3, keeps a lost += or a wrong index
     * (O(1)) failing. A skipped rounding, which 2e-3 alone would not always catch (the fp32
     * grouped kernel posing as a bf16 one measured 1.3e-3 to 4e-3 on the shapes with N >= 64), fails
     * the mean-error bound every bf16 MoE entry also meets (KERN_CHECK_MEAN_TOL 1e-5; the same
     * 80 seeds measured at most 1.4e-6), tested in test_kernels.c with the fp32 reference posing
     * as a bf16 kernel under this same 2e-3. */
#define KERN_MOE_BF16_TOL 2e-3
#if defined(__x86_64__)
    {KERN_OP_MOE_BF16, "grouped_amx", "cpu", KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16 | KERN_FEAT_AMXBF16,
     KERN_MOE_BF16_TOL,
     "grouped GEMMs on bf16 pairs (AMX tiles), fp32 sums",
     .fn.moe = {kern_moe_fwd_bf16_amx, kern_moe_bwd_bf16_amx,
                kern_moe_fwd_wbf16_bf16_amx, kern_moe_bwd_wbf16_bf16_amx,
                kern_moe_bwd_w_bf16_amx}},
    {KERN_OP_MOE_BF16, "grouped_avx512bf16", "cpu", KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16, KERN_MOE_BF16_TOL,
     "grouped GEMMs on bf16 pairs (vdpbf16ps), fp32 sums",
     .fn.moe = {kern_moe_fwd_bf16_avx512bf16, kern_moe_bwd_bf16_avx512bf16,
                kern_moe_fwd_wbf16_bf16_avx512bf16, kern_moe_bwd_wbf16_bf16_avx512bf16,
                kern_moe_bwd_w_bf16_avx512bf16}},
    {KERN_OP_MOE_BF16, "grouped_avx512", "cpu", KERN_FEAT_AVX512, KERN_MOE_BF16_TOL,
     "grouped GEMMs, zmm tiles on panels rounded to bf16",
     .fn.moe = {kern_moe_fwd_bf16_avx512, kern_moe_bwd_bf16_avx512,
                kern_moe_fwd_wbf16_bf16_avx512, kern_moe_bwd_wbf16_bf16_avx512,
                kern_moe_bwd_w_bf16_avx512}},
    {KERN_OP_MOE_BF16, "grouped_avx2", "cpu", KERN_FEAT_AVX2 | KERN_FEAT_FMA, KERN_MOE_BF16_TOL,
     "grouped GEMMs, ymm tiles on panels rounded to bf16",
     .fn.moe = {kern_moe_fwd_bf16_avx2, kern_moe_bwd_bf16_avx2,
                kern_moe_fwd_wbf16_bf16_avx2, kern_moe_bwd_wbf16_bf16_avx2,
                kern_moe_bwd_w_bf16_avx2}},
#elif defined(__aarch64__)
    {KERN_OP_MOE_BF16, "grouped_bfmmla", "cpu", KERN_FEAT_NEON | KERN_FEAT_ARM_BF16, KERN_MOE_BF16_TOL,
     "grouped GEMMs, bf16 BFMMLA tiles, fp32 sums", .fn.moe = {kern_moe_fwd_bf16_bfmmla, kern_moe_bwd_bf16_bfmmla,
                kern_moe_fwd_wbf16_bf16_bfmmla, kern_moe_bwd_wbf16_bf16_bfmmla,
                kern_moe_bwd_w_bf16_bfmmla}},
    {KERN_OP_MOE_BF16, "grouped_neon", "cpu", KERN_FEAT_NEON, KERN_MOE_BF16_TOL,
     "grouped GEMMs, NEON tiles on panels rounded to bf16",
     .fn.moe = {kern_moe_fwd_bf16_neon, kern_moe_bwd_bf16_neon,
                kern_moe_fwd_wbf16_bf16_neon, kern_moe_bwd_wbf16_bf16_neon,
                kern_moe_bwd_w_bf16_neon}},
#endif
    {KERN_OP_MOE_BF16, "ref", "cpu", 0, 0, "kernels/ref/moe.c with every projection factor rounded to bf16",
     .fn.moe = {op_moe_experts_bf16_fwd, op_moe_experts_bf16_bwd, op_moe_experts_bf16_fwd_wbf16,
                op_moe_experts_bf16_bwd_wbf16, op_moe_experts_bf16_bwd_w}},
};

const kern_impl *kern_registry(size_t *n) {
    if (n) *n = sizeof registry / sizeof registry[0];
    return registry;
}

const char *kern_op_name(kern_op op) { return op >= 0 && op < KERN_N_OPS ? op_names[op] : "?"; }

int kern_op_from_name(const char *name) {
    for (int i = 0; i < KERN_N_OPS; i++)
        if (!strcmp(op_names[i], name)) return i;
    return -1;
}

static const struct {
    unsigned bit;
    const char *name;
} feature_names[] = {
    {KERN_FEAT_AVX2, "avx2"},         {KERN_FEAT_FMA, "fma"},           {KERN_FEAT_AVX512F, "avx512f"},
    {KERN_FEAT_AVX512BW, "avx512bw"}, {KERN_FEAT_AVX512VL, "avx512vl"}, {KERN_FEAT_AVX512DQ, "avx512dq"},
    {KERN_FEAT_AVX512BF16, "avx512bf16"}, {KERN_FEAT_AMXBF16, "amx_bf16"},
    {KERN_FEAT_NEON, "neon"},         {KERN_FEAT_ARM_BF16, "bf16"},     {KERN_FEAT_SVE, "sve"},
};

/* What the hardware and OS offer, before CTITAN_ISA. */
static unsigned hw_features(void) {
#if defined(__aarch64__)
    /* The kernel reports in HWCAP only what it enables for user space (SVE
     * state included), so a bit here is one we may use. */
    unsigned long hw = getauxval(AT_HWCAP), hw2 = getauxval(AT_HWCAP2);
    unsigned f = 0;
    if (hw & HWCAP_ASIMD) f |= KERN_FEAT_NEON;
    if (hw2 & HWCAP2_BF16) f |= KERN_FEAT_ARM_BF16;
    if (hw & HWCAP_SVE) f |= KERN_FEAT_SVE;
    return f;
#elif defined(__x86_64__)
    /* __builtin_cpu_supports also checks that the OS saves the vector state
     * (XCR0), so a feature reported here is one we may use. */
    __builtin_cpu_init();
    unsigned f = 0;
    if (__builtin_cpu_supports("avx2")) f |= KERN_FEAT_AVX2;
    if (__builtin_cpu_supports("fma")) f |= KERN_FEAT_FMA;
    if (__builtin_cpu_supports("avx512f")) f |= KERN_FEAT_AVX512F;
    if (__builtin_cpu_supports("avx512bw")) f |= KERN_FEAT_AVX512BW;
    if (__builtin_cpu_supports("avx512vl")) f |= KERN_FEAT_AVX512VL;
    if (__builtin_cpu_supports("avx512dq")) f |= KERN_FEAT_AVX512DQ;
    if (__builtin_cpu_supports("avx512bf16")) f |= KERN_FEAT_AVX512BF16;
    /* AMX also needs Linux's per-process permission, requested here once */
    if (cpu_amx_bf16_ready(NULL)) f |= KERN_FEAT_AMXBF16;
    return f;
#else
    return 0;
#endif
}

/* CTITAN_ISA: the feature bits each level keeps. The x86 levels nest (avx2 <
 * avx512 < amx), as do the Arm ones (neon < bf16 < sve), so forcing a level
 * runs exactly the paths a CPU of that level would. */
static const struct {
    const char *name;
    unsigned keep;
} isa_levels[] = {
    {"ref", 0},
    {"avx2", KERN_FEAT_AVX2 | KERN_FEAT_FMA},
    {"avx512", KERN_FEAT_AVX2 | KERN_FEAT_FMA | KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16},
    {"amx", KERN_FEAT_AVX2 | KERN_FEAT_FMA | KERN_FEAT_AVX512 | KERN_FEAT_AVX512BF16 | KERN_FEAT_AMXBF16},
    {"neon", KERN_FEAT_NEON},
    {"bf16", KERN_FEAT_NEON | KERN_FEAT_ARM_BF16},
    {"sve", KERN_FEAT_NEON | KERN_FEAT_ARM_BF16 | KERN_FEAT_SVE},
};

/* The feature bits the level `isa` keeps (KERN_FEAT_ALL for NULL, "" or
 * "auto"); CT_ERR_CONFIG naming it if unknown. */
static int kern_isa_limit(const char *isa, unsigned *keep, ct_err *e) {
    *keep = KERN_FEAT_ALL;
    if (!isa || !*isa || !strcmp(isa, "auto")) return 0;
    for (size_t i = 0; i < sizeof isa_levels / sizeof isa_levels[0]; i++)
        if (!strcmp(isa, isa_levels[i].name)) {
            *keep = isa_levels[i].keep;
            return 0;
        }
    return ct_fail(e, CT_ERR_CONFIG,
                   "CTITAN_ISA=\"%s\": unknown instruction-set level (auto, ref, avx2, avx512, amx, neon, bf16, sve)",
                   isa);
}

const char *kern_features_level(unsigned f) {
    if (!f) return "portable";
    for (size_t i = 1; i < sizeof isa_levels / sizeof isa_levels[0]; i++)
        if (!(f & ~isa_levels[i].keep)) return isa_levels[i].name;
    return "other";
}

unsigned kern_cpu_features(void) {
    unsigned keep;
    /* an unknown CTITAN_ISA keeps everything here; kern_select reports it */
    if (kern_isa_limit(getenv("CTITAN_ISA"), &keep, NULL)) keep = KERN_FEAT_ALL;
    return hw_features() & keep;
}

unsigned kern_cpu_hw_features(void) { return hw_features(); }

int kern_sve_vector_bits(void) {
#if defined(__aarch64__)
    /* reading the length without SVE would be an undefined instruction */
    return (hw_features() & KERN_FEAT_SVE) ? gemm_sve_vector_bits() : 0;
#else
    return 0;
#endif
}

void kern_features_str(unsigned f, char *buf, size_t cap) {
    size_t len = 0;
    if (cap) buf[0] = 0;
    for (size_t i = 0; i < sizeof feature_names / sizeof feature_names[0]; i++) {
        if (!(f & feature_names[i].bit)) continue;
        int w = snprintf(buf + len, cap > len ? cap - len : 0, "%s%s", len ? " " : "", feature_names[i].name);
        if (w > 0) len += (size_t)w;
    }
    if (!len && cap) snprintf(buf, cap, "none");
}

kern_impl kern_impl_complete(const kern_impl *im) {
    kern_impl c = *im;
    int b16 = im->op == KERN_OP_MATMUL_BF16 || im->op == KERN_OP_MOE_BF16;
    switch (im->op) {
    case KERN_OP_MATMUL:
    case KERN_OP_MATMUL_BF16:
        if (!c.fn.matmul.fwd_wbf16) c.fn.matmul.fwd_wbf16 = b16 ? op_matmul_bf16_fwd_wbf16 : op_matmul_fwd_wbf16;
        if (!c.fn.matmul.dinp_wbf16) c.fn.matmul.dinp_wbf16 = b16 ? op_matmul_bf16_dinp_wbf16 : op_matmul_dinp_wbf16;
        break;
    case KERN_OP_ATTENTION:
        if (!c.fn.attention.fwd_q0) c.fn.attention.fwd_q0 = op_attention_fwd_q0;
        if (!c.fn.attention.bwd_q0) c.fn.attention.bwd_q0 = op_attention_bwd_q0;
        /* the entries without a block form of their own run "tiled"'s (checked there) */
        if (!c.fn.attention.fwd_blk) c.fn.attention.fwd_blk = op_attention_fwd_blk_tiled;
        if (!c.fn.attention.bwd_blk) c.fn.attention.bwd_blk = op_attention_bwd_blk_tiled;
        break;
    case KERN_OP_MOE:
    case KERN_OP_MOE_BF16:
        if (!c.fn.moe.fwd_wbf16) c.fn.moe.fwd_wbf16 = b16 ? op_moe_experts_bf16_fwd_wbf16 : op_moe_experts_fwd_wbf16;
        if (!c.fn.moe.bwd_wbf16) c.fn.moe.bwd_wbf16 = b16 ? op_moe_experts_bf16_bwd_wbf16 : op_moe_experts_bwd_wbf16;
        break;
    default: break;
    }
    return c;
}

/* Puts the functions of `entry` (an entry of op entry->op) into the ops table. */
static void install(kern_ops *k, const kern_impl *entry) {
    k->chosen[entry->op] = entry;
    const kern_impl full = kern_impl_complete(entry), *im = &full;
    switch (im->op) {
    case KERN_OP_MATMUL:
        k->matmul_fwd = im->fn.matmul.fwd;
        k->matmul_bwd = im->fn.matmul.bwd;
        k->matmul_fwd_wbf16 = im->fn.matmul.fwd_wbf16;
        k->matmul_dinp_wbf16 = im->fn.matmul.dinp_wbf16;
        break;
    case KERN_OP_EMBEDDING: k->embedding_fwd = im->fn.embedding.fwd; k->embedding_bwd = im->fn.embedding.bwd; break;
    case KERN_OP_RMSNORM:
        k->rmsnorm_fwd = im->fn.rmsnorm.fwd;
        k->rmsnorm_bwd = im->fn.rmsnorm.bwd;
        k->rmsnorm_bwd_w = im->fn.rmsnorm.bwd_w;
        break;
    case KERN_OP_ROPE:
        k->rope_fwd = im->fn.rope.fwd;
        k->rope_bwd = im->fn.rope.bwd;
        k->qknorm_rope_fwd = im->fn.rope.qknorm_fwd;
        k->qknorm_rope_bwd = im->fn.rope.qknorm_bwd;
        k->qknorm_rope_bwd_w = im->fn.rope.qknorm_bwd_w;
        break;
    case KERN_OP_ATTENTION:
        k->attention_fwd = im->fn.attention.fwd;
        k->attention_bwd = im->fn.attention.bwd;
        k->attention_fwd_q0 = im->fn.attention.fwd_q0;
        k->attention_bwd_q0 = im->fn.attention.bwd_q0;
        k->attention_fwd_blk = im->fn.attention.fwd_blk;
        k->attention_bwd_blk = im->fn.attention.bwd_blk;
        break;
    case KERN_OP_SWIGLU: k->swiglu_fwd = im->fn.swiglu.fwd; k->swiglu_bwd = im->fn.swiglu.bwd; break;
    case KERN_OP_GEGLU: k->geglu_fwd = im->fn.geglu.fwd; k->geglu_bwd = im->fn.geglu.bwd; break;
    case KERN_OP_CROSSENTROPY:
        k->crossentropy_fwdbwd = im->fn.crossentropy.fwdbwd;
        k->crossentropy_fwd = im->fn.crossentropy.fwd;
        k->crossentropy_vp_max = im->fn.crossentropy.vp_max;
        k->crossentropy_vp_sums = im->fn.crossentropy.vp_sums;
        k->crossentropy_vp_grad = im->fn.crossentropy.vp_grad;
        break;
    case KERN_OP_ADD: k->add = im->fn.add.fwd; break;
    case KERN_OP_ADAMW: k->adamw_step = im->fn.adamw.step; break;
    case KERN_OP_MATMUL_BF16:
        k->matmul_bf16_fwd = im->fn.matmul.fwd;
        k->matmul_bf16_bwd = im->fn.matmul.bwd;
        k->matmul_bf16_fwd_wbf16 = im->fn.matmul.fwd_wbf16;
        k->matmul_bf16_dinp_wbf16 = im->fn.matmul.dinp_wbf16;
        break;
    case KERN_OP_MOE:
        k->moe_fwd = im->fn.moe.fwd;
        k->moe_bwd = im->fn.moe.bwd;
        k->moe_fwd_wbf16 = im->fn.moe.fwd_wbf16;
        k->moe_bwd_wbf16 = im->fn.moe.bwd_wbf16;
        k->moe_bwd_w = im->fn.moe.bwd_w;
        break;
    case KERN_OP_MOE_BF16:
        k->moe_bf16_fwd = im->fn.moe.fwd;
        k->moe_bf16_bwd = im->fn.moe.bwd;
        k->moe_bf16_fwd_wbf16 = im->fn.moe.fwd_wbf16;
        k->moe_bf16_bwd_wbf16 = im->fn.moe.bwd_wbf16;
        k->moe_bf16_bwd_w = im->fn.moe.bwd_w;
        break;
    } /* no default: -Wswitch names an op of ops_list.h left out here */
}

/* Comma-separated names of op's entries, for error messages. */
static void list_impls(const kern_impl *t, size_t n, int op, char *buf, size_t cap) {
    size_t len = 0;
    buf[0] = 0;
    for (size_t i = 0; i < n; i++) {
        if ((int)t[i].op != op) continue;
        int w = snprintf(buf + len, cap > len ? cap - len : 0, "%s%s", len ? ", " : "", t[i].name);
        if (w > 0) len += (size_t)w;
    }
}

int kern_select_from(kern_ops *out, const kern_impl *t, size_t n, unsigned cpu, const char *const *overrides,
                     char *log, size_t logcap, ct_err *e) {
    kern_ops k;
    memset(&k, 0, sizeof k);
    /* defaults: the first runnable entry of each op */
    for (int op = 0; op < KERN_N_OPS; op++) {
        for (size_t i = 0; i < n && !k.chosen[op]; i++)
            if ((int)t[i].op == op && !strcmp(t[i].device, "cpu") && (t[i].features & ~cpu) == 0) install(&k, &t[i]);
        if (!k.chosen[op])
            return ct_fail(e, CT_ERR_CONFIG, "kernels: no implementation of %s runs on this CPU", op_names[op]);
    }
    for (size_t j = 0; overrides && overrides[j]; j++) {
        const char *s = overrides[j];
        const char *eq = strchr(s, '=');
        char opname[64], impl[64];
        if (!eq || eq == s || (size_t)(eq - s) >= sizeof opname || strlen(eq + 1) >= sizeof impl || !eq[1])
            return ct_fail(e, CT_ERR_CONFIG, "kernels: bad override \"%s\" (expected op=implementation)", s);
        memcpy(opname, s, (size_t)(eq - s));
        opname[eq - s] = 0;
        strcpy(impl, eq + 1);
        int op = kern_op_from_name(opname);
        if (op < 0) {
            char ops[512];
            size_t len = 0;
            for (int i = 0; i < KERN_N_OPS; i++) {
                int w = snprintf(ops + len, sizeof ops - len, "%s%s", i ? ", " : "", op_names[i]);
                if (w > 0 && (size_t)w < sizeof ops - len) len += (size_t)w;
            }
            return ct_fail(e, CT_ERR_CONFIG, "kernels: unknown op \"%s\" in \"%s\" (ops: %s)", opname, s, ops);
        }
        if (!strcmp(impl, "auto")) continue; /* keep the default */
        const kern_impl *found = NULL;
        for (size_t i = 0; i < n && !found; i++)
            if ((int)t[i].op == op && !strcmp(t[i].name, impl)) found = &t[i];
        char names[256];
        list_impls(t, n, op, names, sizeof names);
        if (!found)
            return ct_fail(e, CT_ERR_CONFIG, "kernels: no implementation \"%s\" of %s (registered: %s, or auto)", impl,
                           opname, names);
        if (found->features & ~cpu) {
            char need[128], have[128];
            kern_features_str(found->features & ~cpu, need, sizeof need);
            kern_features_str(cpu, have, sizeof have);
            return ct_fail(e, CT_ERR_CONFIG, "kernels: %s=%s needs CPU features this CPU lacks: %s (it has: %s)",
                           opname, impl, need, have);
        }
        if (strcmp(found->device, "cpu"))
            return ct_fail(e, CT_ERR_CONFIG, "kernels: %s=%s runs on device \"%s\", not this CPU", opname, impl,
                           found->device);
        install(&k, found);
    }
    if (log && logcap) {
        size_t len = 0;
        log[0] = 0;
        int w = snprintf(log, logcap, "kernels:");
        if (w > 0) len = (size_t)w;
        for (int op = 0; op < KERN_N_OPS; op++) {
            w = snprintf(log + len, logcap > len ? logcap - len : 0, " %s=%s", op_names[op], k.chosen[op]->name);
            if (w > 0) len += (size_t)w;
        }
    }
    *out = k;
    return 0;
}

int kern_select(kern_ops *out, const char *const *overrides, char *log, size_t logcap, ct_err *e) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned keep;
    int rc = kern_isa_limit(getenv("CTITAN_ISA"), &keep, e);
    if (rc) return rc;
    return kern_select_from(out, t, n, kern_cpu_features(), overrides, log, logcap, e);
}

void kern_select_ref(kern_ops *out) {
    static const char *const all_ref[] = {
#define OP_REF(ID, name, bwd, heavy, help) #name "=ref",
        KERN_OP_LIST(OP_REF)
#undef OP_REF
        NULL};
    size_t n;
    const kern_impl *t = kern_registry(&n);
    kern_select_from(out, t, n, 0, all_ref, NULL, 0, NULL);
}

void kern_use_bf16_matmuls(kern_ops *k) {
    k->matmul_fwd = k->matmul_bf16_fwd;
    k->matmul_bwd = k->matmul_bf16_bwd;
    k->matmul_fwd_wbf16 = k->matmul_bf16_fwd_wbf16;
    k->matmul_dinp_wbf16 = k->matmul_bf16_dinp_wbf16;
    k->moe_fwd = k->moe_bf16_fwd;
    k->moe_bwd = k->moe_bf16_bwd;
    k->moe_fwd_wbf16 = k->moe_bf16_fwd_wbf16;
    k->moe_bwd_wbf16 = k->moe_bf16_bwd_wbf16;
    k->moe_bwd_w = k->moe_bf16_bwd_w;
}
