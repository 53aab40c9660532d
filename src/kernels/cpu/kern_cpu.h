/* kernels/cpu/kern_cpu.h: internal interface of the fast CPU kernels.
 *
 * Only registry.c and the files of kernels/cpu/ include this. The model never
 * calls these directly: it calls the function pointers that kern_select put in
 * its kern_ops (kernels/registry.h), which is how the [kernels] config and the
 * CPU's features choose between them.
 *
 * GEMM layering (docs/kernels.md has the whole design):
 *   gemm_f32()           the portable driver: cache blocking, packing calls,
 *                        OpenMP partition, edge tiles; knows nothing of SIMD.
 *   gemm_arch            what one instruction set provides to the driver: the
 *                        register tile MR x NR, its micro-kernel and the two
 *                        packing routines (one file per ISA, compiled with a
 *                        per-function target attribute so the build stays
 *                        generic x86-64).
 *   kern_matmul_*_<isa>  the three matmuls of ops.h expressed as gemm_f32
 *                        calls with the right strides (no copies/transposes of
 *                        whole matrices: packing reads the strided operand). */
#ifndef CT_KERNELS_CPU_KERN_CPU_H
#define CT_KERNELS_CPU_KERN_CPU_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kernels/ops.h" /* kern_attn_opt */
#include "optim/optim.h"

/* A strided view: element (i, j) lives at p[i * rs + j * cs], or, when h is
 * set, is the bf16 h[i * rs + j * cs] (p unused): a frozen weight read
 * straight from its bf16 store (model/lm.c) instead of a widened fp32 copy.
 * Only B may be bf16 (the weight of the forward and of dinp; a frozen weight
 * has no dw product). One of rs, cs is 1 for every operand the model passes;
 * the packers have a fast path for each. */
typedef struct {
    const float *p;
    long rs, cs;
    const uint16_t *h;
} gemm_view;

/* Micro-kernel: C[0:mr, 0:nr] (=, or += when add) Ap^T Bp over kc steps, where
 * Ap is a packed A micro-panel [kc][MRS] (MR used rows, MRS >= MR the row
 * stride, a whole vector so the packers store aligned vectors) and Bp a packed
 * B micro-panel [kc][NR]; both are zero-padded beyond mr / nr and 64-byte
 * aligned. The full MR x NR tile is computed in registers; only mr x nr
 * elements of C are read/written, so C needs no padding, and C is never read
 * when add == 0. */
typedef void (*gemm_ukernel_fn)(long kc, const float *Ap, const float *Bp, float *C, long ldc, int mr,
                                int nr, int add);
/* The micro-kernel with A read in place from a row-major view (k
 * contiguous): row i of the micro-panel at A + i * lda, its kc values
 * consecutive; rows >= mr are never read. Each element of C gets the same
 * FMA chain as from the packed panel, so the same bits. */
typedef void (*gemm_ukernel_rm_fn)(long kc, const float *A, long lda, const float *Bp, float *C, long ldc, int mr,
                                   int nr, int add);
/* Packs rows [0, m) and columns [0, kc) of `a` (already offset to the first
 * element) as ceil(m / MR) consecutive micro-panels of kc * MRS floats:
 * panel p holds a(p*MR + i, k) at [k * MRS + i], zeros for rows >= m. */
typedef void (*gemm_pack_a_fn)(float *dst, gemm_view a, long m, long kc);
/* Packs rows [0, kc) and columns [0, n) of `b` as ceil(n / NR) consecutive
 * micro-panels of kc * NR floats: panel p holds b(k, p*NR + j) at [k * NR + j],
 * zeros for columns >= n. Whole blocks, so strided operands are read row by
 * row (one page at a time) rather than panel by panel. */
typedef void (*gemm_pack_b_fn)(float *dst, gemm_view b, long kc, long n);

/* k per block when a packer deals source rows of k to many panels (a
 * transposed A, a row-major B): each panel receives this many consecutive k
 * (whole cache lines) while the block's source rows stay in L1, instead of
 * one piece per panel per k, panels MRS x kc floats apart in the same L1 set. */
#define GEMM_PACK_KB 8

/* The slab a transposing packer reads after the one at src (slab rows, ld
 * apart), for its prefetch: `left` rows of the operand remain past the
 * current slab; *rows gets how many the next slab has, and with none (0) the
 * result is NULL, so no address past the operand is formed. */
static inline const float *gemm_next_slab(const float *src, long ld, int slab, long left, int *rows) {
    *rows = (int)(left > slab ? slab : left > 0 ? left : 0);
    return *rows ? src + slab * ld : NULL;
}

/* The first and last line of each of a C tile's mr rows (ldc apart, the tile
 * nr floats wide), prefetched by a micro-kernel that adds to C before its k
 * loop, so the lines arrive while it runs. In a training step C is usually
 * cold (a weight gradient last touched a step ago, a zeroed scratch) and its
 * rows are ldc apart, which no hardware prefetcher follows; kernels bench
 * keeps C hot unless --cold. Prefetches change no result. */
static inline void gemm_prefetch_c(const float *C, long ldc, int mr, int nr) {
    for (int i = 0; i < mr; i++) {
        __builtin_prefetch(C + i * ldc, 0, 3);
        __builtin_prefetch(C + i * ldc + nr - 1, 0, 3);
    }
}

/* One attention head's rows between the model's layout and a contiguous copy
 * (attention_avx2.c, attention_avx512.c). The layout puts a head's
 * consecutive rows nkv * hd or nh * hd floats apart (4 or 8 KB for Qwen3's hd
 * 128): the 32-64 rows a tile walks fall into a few L1 sets and thrash their
 * ways, each row its own page, which no hardware prefetcher follows from one
 * row to the next; read from a contiguous copy they stay in L1. The loops
 * over rows in the model's layout prefetch KERN_ROWS_PF rows ahead. */
#define KERN_ROWS_PF 8
/* Every line of a row of hd floats (write: for a store). */
static inline void kern_prefetch_row(const float *x, int hd, int write) {
    for (int i = 0; i < hd; i += 16) {
        if (write)
            __builtin_prefetch(x + i, 1, 3);
        else
            __builtin_prefetch(x + i, 0, 3);
    }
}
/* dst[t * ds + i] = x[t * xs + i] for t < T, i < hd. */
static inline void kern_rows_in(float *dst, long ds, const float *x, long xs, int T, int hd) {
    for (int t = 0; t < T; t++) {
        if (t + KERN_ROWS_PF < T) kern_prefetch_row(x + (size_t)(t + KERN_ROWS_PF) * xs, hd, 0);
        memcpy(dst + (size_t)t * ds, x + (size_t)t * xs, (size_t)hd * sizeof(float));
    }
}
/* The contiguous rows [T, hd] a backward sums one head's gradient in: x's rows
 * (acc 1, adding to what x holds) or zeros (acc 0, x is not read). */
static inline void kern_rows_sum_in(float *dst, const float *x, long xs, int T, int hd, int acc) {
    if (acc) kern_rows_in(dst, hd, x, xs, T, hd);
    else memset(dst, 0, (size_t)T * hd * sizeof(float));
}
/* x[t * xs + i] = src[t * hd + i] for t < T: kern_rows_in's inverse (gradient rows summed in a copy, back). */
static inline void kern_rows_out(float *x, long xs, const float *src, int T, int hd) {
    for (int t = 0; t < T; t++) {
        if (t + KERN_ROWS_PF < T) kern_prefetch_row(x + (size_t)(t + KERN_ROWS_PF) * xs, hd, 1);
        memcpy(x + (size_t)t * xs, src + (size_t)t * hd, (size_t)hd * sizeof(float));
    }
}

/* Rows up to which the forward (out = inp . w^T) skips the GEMM for plain dot
 * products: decode steps of generation (M = 1) are bound by reading w, and
 * packing would read and write it twice more. */
#define GEMM_SMALL_M 4
/* out[m, n] (=, or += when accumulate) dot(inp[m, 0:K], w[n, 0:K]) for m < M
 * (<= GEMM_SMALL_M) and n in [n0, n1); row strides K for inp and w, ldo for out. */
typedef void (*gemm_nt_small_fn)(float *out, long ldo, const float *inp, const float *w, int M, long K, long n0,
                                 long n1, int accumulate);

typedef struct {
    const char *name; /* "avx512", "avx2" */
    int mr, mrs, nr;  /* register tile MR x NR; MRS = row stride of a packed A panel */
    int kc, mc, nc;   /* cache blocks: depth, rows of the A block, columns of the B block */
    int ncb;          /* columns of B walked per A micro-panel: keeps kc x ncb of B in L2 */
    int mcb;          /* > 0: a row-major A read in place (ukernel_rm) and more than ncb columns
                         run B-stationary instead, in blocks of mcb rows (gemm_rect) */
    gemm_ukernel_fn ukernel;
    /* NULL, or ukernel reading a row-major A (cs == 1) in place: the driver
     * then packs no A for such calls (the forward's inp, dinp's dout) */
    gemm_ukernel_rm_fn ukernel_rm;
    gemm_pack_a_fn pack_a;
    gemm_pack_b_fn pack_b;
    /* pack_b for a bf16 view (b.h), with the same output as pack_b on its
     * exact fp32 widening; NULL: the driver widens each block into a
     * per-thread fp32 buffer and calls pack_b (exact, so the same bits). The
     * bf16-pair archs copy the bits, which skips their rounding too. */
    gemm_pack_b_fn pack_b_h;
    gemm_nt_small_fn nt_small;
    /* k values per 32-bit lane of a packed panel: 0 or 1 for fp32; 2 for bf16
     * pairs (vdpbf16ps), whose panels are then ceil(kc / 2) lanes deep, so
     * panel p of a packed block starts at p * MRS * ceil(kc / 2) (resp. NR). */
    int kpack;
    /* 0 or 1: none. Else panel depths (ceil(kc / kpack) lanes) are rounded up
     * to a multiple of kalign, the packers zero-fill the padding, and k blocks
     * are multiples of kalign * kpack where K allows: AMX's tiles take 16 k
     * pairs per row (gemm_bf16_amx.c). */
    int kalign;
    /* NULL, or called by each thread before / after its share of one gemm_f32
     * call: per-thread state of the micro-kernel (AMX loads its tile
     * configuration, then releases the tiles). */
    void (*thread_begin)(void);
    void (*thread_end)(void);
} gemm_arch;

#if defined(__x86_64__)
extern const gemm_arch gemm_arch_avx512; /* 14 x 32 zmm tile; needs AVX-512 F/BW/VL/DQ */
/* 28 x 16 tile for C at most 16 columns wide (LoRA's rank side); the same bits as
 * gemm_arch_avx512 (same kc, same FMA chain per element); fp32 only, no bf16 B */
extern const gemm_arch gemm_arch_avx512_n16;
extern const gemm_arch gemm_arch_avx2;   /* 6 x 16 ymm tile; needs AVX2 + FMA */
extern const gemm_arch gemm_arch_avx512bf16; /* 14 x 32 tile of bf16 pairs; needs AVX-512 + AVX512_BF16 */
/* 32 x 32 block of 2 x 2 AMX tiles of bf16 pairs (gemm_bf16_amx.c); needs AVX-512 +
 * KERN_FEAT_AMXBF16, i.e. cpu_amx_bf16_ready() (Linux's tile permission) */
extern const gemm_arch gemm_arch_amx;
/* Rounds n floats in place to the nearest bf16 (ties to even, as torch's
 * .to(bfloat16); NaN stays NaN), kept as fp32: the packed panels of the
 * fp32 micro-kernels become those of bf16 inputs. Needs AVX-512 F/BW. */
void gemm_round_bf16_avx512(float *p, size_t n);
#endif

/* C[M,N] = (accumulate ? C : 0) + A[M,K] B[K,N], C row-major with leading
 * dimension ldc. Deterministic: each element of C is summed by one thread in
 * a fixed order (k blocks of a size that depends on K only, ascending, each
 * summed in k order), so results are bit-identical for any thread count.
 * Uses the OpenMP thread count (one thread below a size threshold where
 * threading costs more than it gains). */
void gemm_f32(const gemm_arch *arch, int M, int N, int K, gemm_view A, gemm_view B, float *C, long ldc,
              int accumulate);

/* out[M,N] (+)= inp[M,K] . w[N,K]^T for M <= GEMM_SMALL_M through arch->nt_small,
 * threads splitting N (deterministic: each element is one fixed dot product). */
void gemm_nt_small(const gemm_arch *arch, float *out, const float *inp, const float *w, int M, int K, int N,
                   int accumulate);

/* op_matmul_bwd's two products (dinp (+)= dout w, dw += dout^T inp) as gemm_f32
 * calls on `ar`: shared by the fp32 matmuls and the bf16 ones (whose arch
 * rounds while packing). */
void gemm_matmul_bwd(const gemm_arch *ar, float *dinp, float *dw, const float *dout, const float *inp,
                     const float *w, int M, int K, int N, int accumulate);

/* ops.h's op_matmul_fwd_wbf16 / op_matmul_dinp_wbf16 (w stored in bf16) as
 * gemm_f32 calls on `ar` with a bf16 B view; a forward of at most
 * GEMM_SMALL_M rows on an arch with nt_small widens w and takes that path,
 * as matmul_fwd does with an fp32 w. */
void gemm_matmul_fwd_wbf16(const gemm_arch *ar, float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                           int accumulate);
void gemm_matmul_dinp_wbf16(const gemm_arch *ar, float *dinp, const float *dout, const uint16_t *w, int M, int K,
                            int N, int ldd, int accumulate);
/* pack_b of a bf16 view with neither stride 1 (not used by the model), for
 * the fp32 archs' pack_b_h: panels of nr columns, [kc][nr] each, widened,
 * zeros past n. Plain C, shared by every arch whose panels are laid out so. */
void gemm_pack_b_h_strided(float *dst, gemm_view b, long kc, long n, int nr);
/* B packed as bf16 pairs from a bf16 view (b.h): gemm_pack_b_bf16's layout
 * and bits, the pairs copied rather than rounded (gemm_bf16_avx512.c). */
void gemm_pack_b_bf16_h(float *dst, gemm_view b, long kc, long n, long kd);

/* The wbf16 entries of every registered matmul / matmul_bf16 implementation. */
#define KERN_MM_H_DECL(SUF)                                                                                          \
    void kern_matmul_fwd_wbf16_##SUF(float *out, const float *inp, const uint16_t *w, int M, int K, int N,          \
                                     int accumulate);                                                                \
    void kern_matmul_dinp_wbf16_##SUF(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,      \
                                      int ldd, int accumulate);
KERN_MM_H_DECL(openblas)
#if defined(__x86_64__)
KERN_MM_H_DECL(avx512)
KERN_MM_H_DECL(avx2)
KERN_MM_H_DECL(bf16_amx)
KERN_MM_H_DECL(bf16_avx512bf16)
KERN_MM_H_DECL(bf16_avx512)
KERN_MM_H_DECL(bf16_avx2)
#endif
#if defined(__aarch64__)
KERN_MM_H_DECL(neon)
KERN_MM_H_DECL(sve)
KERN_MM_H_DECL(bf16_bfmmla)
KERN_MM_H_DECL(bf16_sve_bfmmla)
KERN_MM_H_DECL(bf16_neon)
#endif
#undef KERN_MM_H_DECL

#if defined(__x86_64__)
/* The ops.h matmul signatures on top of gemm_f32 for each ISA. */
void kern_matmul_fwd_avx512(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                            int K, int N, int accumulate);
void kern_matmul_fwd_avx2(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_avx2(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                          int K, int N, int accumulate);
/* matmul_bf16 (kernels/cpu/gemm_bf16*.c): inputs rounded to bf16 as they are
 * packed, fp32 sums; avx512bf16 multiplies bf16 pairs with vdpbf16ps, the
 * others run the fp32 micro-kernels on the rounded panels. */
void kern_matmul_bf16_fwd_avx512bf16(float *out, const float *inp, const float *w, int M, int K, int N,
                                     int accumulate);
void kern_matmul_bf16_bwd_avx512bf16(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                     int M, int K, int N, int accumulate);
void kern_matmul_bf16_fwd_amx(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bf16_bwd_amx(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                              int K, int N, int accumulate);
void kern_matmul_bf16_fwd_avx512(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bf16_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                                 int K, int N, int accumulate);
void kern_matmul_bf16_fwd_avx2(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bf16_bwd_avx2(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                               int K, int N, int accumulate);
#endif
/* gemm_arch_avx512 or gemm_arch_avx2 (base) with packers that round the
 * packed panels to bf16: matmul_bf16's avx512/avx2 arch, for other callers
 * of gemm_f32 (the grouped MoE experts). */
gemm_arch gemm_arch_rounding_bf16(const gemm_arch *base);
/* OpenBLAS's sgemm (whatever core type the library picked when it loaded). */
void kern_matmul_fwd_openblas(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_openblas(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                              int K, int N, int accumulate);

/* moe_experts, grouped (moe_cpu.c): the op_moe_experts_* contract of ops.h on
 * gemm_f32, and moe_experts_bf16 (the bf16_* suffixes) the same on bf16-rounded
 * GEMM inputs (matmul_bf16's archs); each with its wbf16 pair (weights read
 * from a bf16 store, op_moe_experts_*_wbf16). */
#define KERN_MOE_DECL(SUF)                                                                                           \
    void kern_moe_fwd_##SUF(float *out, float *gate, float *up, float *h, float *work, const float *x,             \
                            const float *wg, const float *wu, const float *wd, const int32_t *perm,                  \
                            const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int Im,     \
                            int E, int k);                                                                           \
    void kern_moe_bwd_##SUF(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,              \
                            const float *dout, const float *x, const float *wg, const float *wu, const float *wd,    \
                            const float *gate, const float *up, const float *h, const int32_t *perm,                 \
                            const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int Im,     \
                            int E, int k);                                                                           \
    void kern_moe_fwd_wbf16_##SUF(float *out, float *gate, float *up, float *h, float *work, const float *x,       \
                                  const float *wg, const float *wu, const float *wd, const uint16_t *hg,             \
                                  const uint16_t *hu, const uint16_t *hd, const int32_t *perm, const int32_t *pos,   \
                                  const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);    \
    void kern_moe_bwd_wbf16_##SUF(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,        \
                                  const float *dout, const float *x, const float *wg, const float *wu,               \
                                  const float *wd, const uint16_t *hg, const uint16_t *hu, const uint16_t *hd,       \
                                  const float *gate, const float *up, const float *h, const int32_t *perm,           \
                                  const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H,       \
                                  int Im, int E, int k);                                                             \
    void kern_moe_bwd_w_##SUF(float *dwg, float *dwu, float *dwd, float *work, const float *dout, const float *x,  \
                              const float *h, const float *dgate, const float *dup, const int32_t *perm,             \
                              const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
#if defined(__x86_64__)
KERN_MOE_DECL(avx512) /* moe_experts "grouped_avx512" (fp32) */
KERN_MOE_DECL(avx2)   /* moe_experts "grouped_avx2" (fp32) */
KERN_MOE_DECL(bf16_amx)
KERN_MOE_DECL(bf16_avx512bf16)
KERN_MOE_DECL(bf16_avx512)
KERN_MOE_DECL(bf16_avx2)
#endif
#if defined(__aarch64__)
KERN_MOE_DECL(neon) /* moe_experts "grouped_neon" (fp32) */
KERN_MOE_DECL(bf16_bfmmla)
KERN_MOE_DECL(bf16_neon)
#endif
#undef KERN_MOE_DECL

#if defined(__x86_64__)
/* The memory-bound ops for AVX-512 (elementwise_avx512.c), ops.h signatures. */
void kern_embedding_fwd_avx512(float *out, const int32_t *tokens, const float *wte, int N, int C);
void kern_embedding_bwd_avx512(float *dwte, const float *dout, const int32_t *tokens, int N, int C);
void kern_rmsnorm_fwd_avx512(float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps);
void kern_rmsnorm_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                             const float *rstd, int N, int C);
void kern_rmsnorm_bwd_w_avx512(float *dw, const float *dout, const float *inp, const float *rstd, int N, int C);
void kern_rope_fwd_avx512(float *out, const float *inp, const float *cos, const float *sin, int B, int T, int nh,
                          int hd, int rd);
void kern_rope_bwd_avx512(float *dinp, const float *dout, const float *cos, const float *sin, int B, int T, int nh,
                          int hd, int rd);
void kern_qknorm_rope_fwd_avx512(float *out, float *rstd, const float *x, const float *w, const float *cos,
                                 const float *sin, int B, int T, int nh, int hd, float eps);
void kern_qknorm_rope_bwd_avx512(float *dx, float *dw, const float *dout, const float *x, const float *w,
                                 const float *rstd, const float *cos, const float *sin, int B, int T, int nh, int hd,
                                 int acc);
void kern_qknorm_rope_bwd_w_avx512(float *dw, const float *dout, const float *x, const float *rstd, const float *cos,
                                   const float *sin, int B, int T, int nh, int hd);
void kern_swiglu_fwd_avx512(float *out, const float *gate, const float *up, int N);
void kern_swiglu_bwd_avx512(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                            int acc);
void kern_geglu_fwd_avx512(float *out, const float *gate, const float *up, int N);
void kern_geglu_bwd_avx512(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                           int acc);
void kern_add_avx512(float *out, const float *a, const float *b, long N);
double kern_crossentropy_fwdbwd_avx512(float *logits, const int32_t *targets, int N, int V, float grad_scale,
                                       long *n_valid);
double kern_crossentropy_fwd_avx512(float *losses, const float *logits, const int32_t *targets, int N, int V);
void kern_crossentropy_vp_max_avx512(float *maxv, const float *logits, int N, int V);
void kern_crossentropy_vp_sums_avx512(float *sumexp, float *tlogit, const float *logits, const float *maxv,
                                      const int32_t *targets, int N, int V, int v0);
double kern_crossentropy_vp_grad_avx512(float *logits, const float *maxv, const float *sumexp, const float *tlogit,
                                        const int32_t *targets, int N, int V, int v0, float grad_scale,
                                        long *n_valid);
void kern_adamw_step_avx512(adamw_state *s, float *params, float *grads, float gscale, double lr,
                          const adamw_hparams *h);
/* Attention with register-blocked tiles (attention_avx512.c), ops.h's attention contract. */
void kern_attention_fwd_avx512(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                               int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_avx512(float *dq, float *dk, float *dv, const float *dout, const float *out,
                               const float *lse, const float *q, const float *k, const float *v, int B, int T, int nh,
                               int nkv, int hd, const kern_attn_opt *opt, int acc);
/* And their offset forms (ops.h, op_attention_fwd_q0: the last Tq of Tk positions). */
void kern_attention_fwd_q0_avx512(float *out, float *lse, const float *q, const float *k, const float *v,
                                  int B, int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_q0_avx512(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                  const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                  int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
/* The same with vdpbf16ps products under kern_attn_opt.bf16 (AVX512_BF16; without the
 * option, or hd % 64 != 0, the kernels above). */
void kern_attention_fwd_avx512bf16(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                   int T, int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_avx512bf16(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                   const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                   int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
void kern_attention_fwd_q0_avx512bf16(float *out, float *lse, const float *q, const float *k, const float *v,
                                      int B, int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_q0_avx512bf16(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                      const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                      int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
/* The block forms of both (ops.h, op_attention_fwd_blk: ring attention). */
void kern_attention_fwd_blk_avx512(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                                   const kern_attn_blk *g, const kern_attn_opt *opt);
void kern_attention_bwd_blk_avx512(float *dq, float *dk, float *dv, const float *dout, const float *lse,
                                   const float *D, const float *q, const float *k, const float *v,
                                   const kern_attn_blk *g, const kern_attn_opt *opt);
void kern_attention_fwd_blk_avx512bf16(float *acc, float *m, float *l, const float *q, const float *k,
                                       const float *v, const kern_attn_blk *g, const kern_attn_opt *opt);
void kern_attention_bwd_blk_avx512bf16(float *dq, float *dk, float *dv, const float *dout, const float *lse,
                                       const float *D, const float *q, const float *k, const float *v,
                                       const kern_attn_blk *g, const kern_attn_opt *opt);
/* out[i] = e^x[i] with the vector exp of the kernels above (for its accuracy test). */
void kern_exp_avx512(float *out, const float *x, long n);
/* out[i] = tanh(x[i]) with avx512_util.h's tanh16 (attention's soft cap; for its accuracy test). */
void kern_tanh_avx512(float *out, const float *x, long n);

/* The memory-bound ops for AVX2 + FMA (elementwise_avx2.c instantiating elementwise_vec.inc), ops.h signatures. */
void kern_embedding_fwd_avx2(float *out, const int32_t *tokens, const float *wte, int N, int C);
void kern_embedding_bwd_avx2(float *dwte, const float *dout, const int32_t *tokens, int N, int C);
void kern_rmsnorm_fwd_avx2(float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps);
void kern_rmsnorm_bwd_avx2(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                           const float *rstd, int N, int C);
void kern_rmsnorm_bwd_w_avx2(float *dw, const float *dout, const float *inp, const float *rstd, int N, int C);
void kern_rope_fwd_avx2(float *out, const float *inp, const float *cos, const float *sin, int B, int T, int nh,
                        int hd, int rd);
void kern_rope_bwd_avx2(float *dinp, const float *dout, const float *cos, const float *sin, int B, int T, int nh,
                        int hd, int rd);
void kern_qknorm_rope_fwd_avx2(float *out, float *rstd, const float *x, const float *w, const float *cos,
                               const float *sin, int B, int T, int nh, int hd, float eps);
void kern_qknorm_rope_bwd_avx2(float *dx, float *dw, const float *dout, const float *x, const float *w,
                               const float *rstd, const float *cos, const float *sin, int B, int T, int nh, int hd,
                               int acc);
void kern_qknorm_rope_bwd_w_avx2(float *dw, const float *dout, const float *x, const float *rstd, const float *cos,
                                   const float *sin, int B, int T, int nh, int hd);
void kern_swiglu_fwd_avx2(float *out, const float *gate, const float *up, int N);
void kern_swiglu_bwd_avx2(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                          int acc);
void kern_geglu_fwd_avx2(float *out, const float *gate, const float *up, int N);
void kern_geglu_bwd_avx2(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                         int acc);
void kern_add_avx2(float *out, const float *a, const float *b, long N);
double kern_crossentropy_fwdbwd_avx2(float *logits, const int32_t *targets, int N, int V, float grad_scale,
                                     long *n_valid);
double kern_crossentropy_fwd_avx2(float *losses, const float *logits, const int32_t *targets, int N, int V);
void kern_crossentropy_vp_max_avx2(float *maxv, const float *logits, int N, int V);
void kern_crossentropy_vp_sums_avx2(float *sumexp, float *tlogit, const float *logits, const float *maxv,
                                    const int32_t *targets, int N, int V, int v0);
double kern_crossentropy_vp_grad_avx2(float *logits, const float *maxv, const float *sumexp, const float *tlogit,
                                      const int32_t *targets, int N, int V, int v0, float grad_scale,
                                      long *n_valid);
void kern_adamw_step_avx2(adamw_state *s, float *params, float *grads, float gscale, double lr,
                          const adamw_hparams *h);
/* Attention with 6 x 16 ymm register tiles (attention_avx2.c), ops.h's attention contract. */
void kern_attention_fwd_avx2(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                             int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_avx2(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                             const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                             const kern_attn_opt *opt, int acc);
/* And their offset forms (ops.h, op_attention_fwd_q0). */
void kern_attention_fwd_q0_avx2(float *out, float *lse, const float *q, const float *k, const float *v,
                                int B, int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_q0_avx2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
/* And their block form (ops.h, op_attention_fwd_blk: ring attention). */
void kern_attention_fwd_blk_avx2(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                                 const kern_attn_blk *g, const kern_attn_opt *opt);
void kern_attention_bwd_blk_avx2(float *dq, float *dk, float *dv, const float *dout, const float *lse, const float *D,
                                 const float *q, const float *k, const float *v, const kern_attn_blk *g,
                                 const kern_attn_opt *opt);
/* out[i] = e^x[i] with the AVX2 vector exp (avx2_util.h's exp8; for its accuracy test). */
void kern_exp_avx2(float *out, const float *x, long n);
/* out[i] = tanh(x[i]) with avx2_util.h's tanh8 (for its accuracy test). */
void kern_tanh_avx2(float *out, const float *x, long n);
#endif


#if defined(__aarch64__)
/* aarch64 (gemm_neon.c, elementwise_neon.c, moe_cpu.c): NEON everywhere, BFMMLA where the CPU has BF16. */
extern const gemm_arch gemm_arch_neon;   /* 8 x 12 fp32 tile, vfmaq_laneq_f32 */
extern const gemm_arch gemm_arch_bfmmla; /* 8 x 8 tile of 2 x 2 BFMMLA blocks, bf16 pairs; needs BF16 */
void kern_matmul_fwd_neon(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_neon(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                          int N, int accumulate);
/* gemm_sve.c: 8 x 3VL fp32 tile (VL = svcntw(), read at run time, hence a
 * function returning the arch rather than a const object); needs SVE. */
gemm_arch gemm_arch_sve(void);
/* 8 * svcntb(); only where the CPU has SVE (registry.c: kern_sve_vector_bits). */
int gemm_sve_vector_bits(void);
void kern_matmul_fwd_sve(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_sve(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                         int N, int accumulate);
void kern_matmul_bf16_fwd_bfmmla(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bf16_bwd_bfmmla(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                                 int K, int N, int accumulate);
/* gemm_sve_bf16.c: BFMMLA on SVE vectors, 8 x 2VL/32 tile; needs SVE and BF16. */
void kern_matmul_bf16_fwd_sve_bfmmla(float *out, const float *inp, const float *w, int M, int K, int N,
                                     int accumulate);
void kern_matmul_bf16_bwd_sve_bfmmla(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                     int M, int K, int N, int accumulate);
void kern_matmul_bf16_fwd_neon(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bf16_bwd_neon(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                               int K, int N, int accumulate);
void kern_embedding_fwd_neon(float *out, const int32_t *tokens, const float *wte, int N, int C);
void kern_embedding_bwd_neon(float *dwte, const float *dout, const int32_t *tokens, int N, int C);
void kern_rmsnorm_fwd_neon(float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps);
void kern_rmsnorm_bwd_neon(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                           const float *rstd, int N, int C);
void kern_rmsnorm_bwd_w_neon(float *dw, const float *dout, const float *inp, const float *rstd, int N, int C);
void kern_rope_fwd_neon(float *out, const float *inp, const float *cos, const float *sin, int B, int T, int nh,
                        int hd, int rd);
void kern_rope_bwd_neon(float *dinp, const float *dout, const float *cos, const float *sin, int B, int T, int nh,
                        int hd, int rd);
void kern_qknorm_rope_fwd_neon(float *out, float *rstd, const float *x, const float *w, const float *cos,
                               const float *sin, int B, int T, int nh, int hd, float eps);
void kern_qknorm_rope_bwd_neon(float *dx, float *dw, const float *dout, const float *x, const float *w,
                               const float *rstd, const float *cos, const float *sin, int B, int T, int nh, int hd,
                               int acc);
void kern_qknorm_rope_bwd_w_neon(float *dw, const float *dout, const float *x, const float *rstd, const float *cos,
                                   const float *sin, int B, int T, int nh, int hd);
void kern_swiglu_fwd_neon(float *out, const float *gate, const float *up, int N);
void kern_swiglu_bwd_neon(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                          int acc);
void kern_geglu_fwd_neon(float *out, const float *gate, const float *up, int N);
void kern_geglu_bwd_neon(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N,
                         int acc);
void kern_add_neon(float *out, const float *a, const float *b, long N);
double kern_crossentropy_fwdbwd_neon(float *logits, const int32_t *targets, int N, int V, float grad_scale,
                                     long *n_valid);
double kern_crossentropy_fwd_neon(float *losses, const float *logits, const int32_t *targets, int N, int V);
void kern_crossentropy_vp_max_neon(float *maxv, const float *logits, int N, int V);
void kern_crossentropy_vp_sums_neon(float *sumexp, float *tlogit, const float *logits, const float *maxv,
                                    const int32_t *targets, int N, int V, int v0);
double kern_crossentropy_vp_grad_neon(float *logits, const float *maxv, const float *sumexp, const float *tlogit,
                                      const int32_t *targets, int N, int V, int v0, float grad_scale, long *n_valid);
void kern_adamw_step_neon(adamw_state *s, float *params, float *grads, float gscale, double lr,
                          const adamw_hparams *h);
/* Attention with 12 x 8 register tiles, rows in lanes (attention_neon.c), ops.h's attention contract. */
void kern_attention_fwd_neon(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                             int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_neon(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                             const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                             const kern_attn_opt *opt, int acc);
/* And their offset forms (ops.h, op_attention_fwd_q0). */
void kern_attention_fwd_q0_neon(float *out, float *lse, const float *q, const float *k, const float *v,
                                int B, int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void kern_attention_bwd_q0_neon(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
/* And their block form (ops.h, op_attention_fwd_blk: ring attention). */
void kern_attention_fwd_blk_neon(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                                 const kern_attn_blk *g, const kern_attn_opt *opt);
void kern_attention_bwd_blk_neon(float *dq, float *dk, float *dv, const float *dout, const float *lse, const float *D,
                                 const float *q, const float *k, const float *v, const kern_attn_blk *g,
                                 const kern_attn_opt *opt);
/* out[i] = e^x[i] with neon_util.h's neon_exp4 (for its accuracy test). */
void kern_exp_neon(float *out, const float *x, long n);
/* out[i] = tanh(x[i]) with neon_util.h's neon_tanh4 (geglu; for its accuracy test). */
void kern_tanh_neon(float *out, const float *x, long n);
#endif

#endif
