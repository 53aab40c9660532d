/* kernels/registry.h: every implementation of every op, and the choice among them.
 *
 * The registry is one const table (registry.c) of implementations: the op
 * ("matmul", "rmsnorm", ...), a name ("ref", "avx512", ...), the device, the
 * CPU features it needs, and its forward/backward functions with exactly the
 * signatures of kernels/ops.h. The plain reference of kernels/ref/ is
 * registered as "ref" for every op.
 *
 * A run does not call ops through globals: kern_select() fills a kern_ops, a
 * struct of function pointers owned by the caller's run context, with one
 * implementation per op: by default the first entry of the table (entries
 * are listed fastest first) whose features the CPU has, or the one named by
 * the [kernels] config section ("matmul=avx2"). The model then calls
 * k->matmul_fwd(...) where it called op_matmul_fwd(...).
 *
 * kern_check() runs every implementation against "ref" on random and edge
 * shapes (`ctitan kernels check`, part of `make test`). It takes the table as
 * a parameter, so a test can check a table of its own (say, with a broken
 * implementation it expects to be caught) without touching global state. */
#ifndef CT_KERNELS_REGISTRY_H
#define CT_KERNELS_REGISTRY_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "core/err.h"
#include "kernels/ops.h" /* kern_attn_opt */
#include "kernels/ops_list.h"
#include "optim/optim.h"

/* kern_op (KERN_OP_MATMUL, ...) and KERN_N_OPS: the list of ops is kernels/ops_list.h */

/* CPU features an implementation may require (a bit set). */
enum {
    KERN_FEAT_AVX2 = 1u << 0,
    KERN_FEAT_FMA = 1u << 1,
    KERN_FEAT_AVX512F = 1u << 2,
    KERN_FEAT_AVX512BW = 1u << 3,
    KERN_FEAT_AVX512VL = 1u << 4,
    KERN_FEAT_AVX512DQ = 1u << 5,
    KERN_FEAT_AVX512BF16 = 1u << 6,
    /* AMX-TILE + AMX-BF16 in CPUID, tile state enabled in XCR0, and Linux's
     * per-process tile permission granted (core/cpu.h: cpu_amx_bf16_ready) */
    KERN_FEAT_AMXBF16 = 1u << 7,
    /* aarch64 (getauxval HWCAP bits, so the kernel's support is included) */
    KERN_FEAT_NEON = 1u << 8,     /* ASIMD: every aarch64 Linux CPU */
    KERN_FEAT_ARM_BF16 = 1u << 9, /* BFMMLA / BFDOT (Armv8.6 BF16: Graviton 3/4, Neoverse V1/V2/N2) */
    KERN_FEAT_SVE = 1u << 10,
    KERN_FEAT_ALL = (1u << 11) - 1,
};
/* The AVX-512 subset the fp32 kernels use (Skylake-X and later, Zen 4 and later). */
#define KERN_FEAT_AVX512 (KERN_FEAT_AVX512F | KERN_FEAT_AVX512BW | KERN_FEAT_AVX512VL | KERN_FEAT_AVX512DQ)

/* One function type per entry point of kernels/ops.h (and optim.h's AdamW step). */
typedef void (*kern_matmul_fwd_fn)(float *out, const float *inp, const float *w, int M, int K, int N,
                                   int accumulate);
typedef void (*kern_matmul_bwd_fn)(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                   int M, int K, int N, int accumulate);
/* op_matmul_fwd_wbf16 / op_matmul_dinp_wbf16 (ops.h): w[N,K] stored in bf16 */
typedef void (*kern_matmul_fwd_wbf16_fn)(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                         int accumulate);
typedef void (*kern_matmul_dinp_wbf16_fn)(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                          int ldd, int accumulate);
typedef void (*kern_embedding_fwd_fn)(float *out, const int32_t *tokens, const float *wte, int N, int C);
typedef void (*kern_embedding_bwd_fn)(float *dwte, const float *dout, const int32_t *tokens, int N, int C);
typedef void (*kern_rmsnorm_fwd_fn)(float *out, float *rstd, const float *inp, const float *w, int N, int C,
                                    float eps);
typedef void (*kern_rmsnorm_bwd_fn)(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                                    const float *rstd, int N, int C);
/* op_rmsnorm_bwd_w (ops.h): the weight-gradient half a backward with dw NULL left (zero-bubble W) */
typedef void (*kern_rmsnorm_bwd_w_fn)(float *dw, const float *dout, const float *inp, const float *rstd, int N, int C);
typedef void (*kern_rope_fn)(float *out, const float *inp, const float *cos, const float *sin, int B, int T, int nh,
                             int hd, int rd);
typedef void (*kern_qknorm_rope_fwd_fn)(float *out, float *rstd, const float *x, const float *w, const float *cos,
                                        const float *sin, int B, int T, int nh, int hd, float eps);
typedef void (*kern_qknorm_rope_bwd_fn)(float *dx, float *dw, const float *dout, const float *x, const float *w,
                                        const float *rstd, const float *cos, const float *sin, int B, int T, int nh,
                                        int hd, int acc);
/* op_qknorm_rope_bwd_w (ops.h): its weight-gradient half alone */
typedef void (*kern_qknorm_rope_bwd_w_fn)(float *dw, const float *dout, const float *x, const float *rstd,
                                          const float *cos, const float *sin, int B, int T, int nh, int hd);
/* opt: the family's attention variant (kernels/ops.h, kern_attn_opt); NULL: Qwen3's */
typedef void (*kern_attention_fwd_fn)(float *out, float *lse, const float *q, const float *k, const float *v,
                                      int B, int T, int nh, int nkv, int hd, const kern_attn_opt *opt);
typedef void (*kern_attention_bwd_fn)(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                      const float *lse, const float *q, const float *k, const float *v, int B,
                                      int T, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
/* The offset form (op_attention_fwd_q0 / _bwd_q0): Tq query rows at positions Tk - Tq .. Tk - 1 */
typedef void (*kern_attention_fwd_q0_fn)(float *out, float *lse, const float *q, const float *k, const float *v,
                                         int B, int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
typedef void (*kern_attention_bwd_q0_fn)(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                         const float *lse, const float *q, const float *k, const float *v, int B,
                                         int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
/* The block form (op_attention_fwd_blk / _bwd_blk: ring attention's blocks, distributed/cp.c) */
typedef void (*kern_attention_fwd_blk_fn)(float *acc, float *m, float *l, const float *q, const float *k,
                                          const float *v, const kern_attn_blk *g, const kern_attn_opt *opt);
typedef void (*kern_attention_bwd_blk_fn)(float *dq, float *dk, float *dv, const float *dout, const float *lse,
                                          const float *D, const float *q, const float *k, const float *v,
                                          const kern_attn_blk *g, const kern_attn_opt *opt);
typedef void (*kern_swiglu_fwd_fn)(float *out, const float *gate, const float *up, int N);
typedef void (*kern_swiglu_bwd_fn)(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                                   int N, int acc);
typedef void (*kern_geglu_fwd_fn)(float *out, const float *gate, const float *up, int N);
typedef void (*kern_geglu_bwd_fn)(float *dgate, float *dup, const float *dout, const float *gate, const float *up,
                                  int N, int acc);
typedef double (*kern_crossentropy_fwdbwd_fn)(float *logits, const int32_t *targets, int N, int V,
                                              float grad_scale, long *n_valid);
typedef double (*kern_crossentropy_fwd_fn)(float *losses, const float *logits, const int32_t *targets, int N,
                                           int V);
/* The vocabulary-parallel phases (op_crossentropy_vp_* in ops.h). */
typedef void (*kern_crossentropy_vp_max_fn)(float *maxv, const float *logits, int N, int V);
typedef void (*kern_crossentropy_vp_sums_fn)(float *sumexp, float *tlogit, const float *logits, const float *maxv,
                                             const int32_t *targets, int N, int V, int v0);
typedef double (*kern_crossentropy_vp_grad_fn)(float *logits, const float *maxv, const float *sumexp,
                                               const float *tlogit, const int32_t *targets, int N, int V, int v0,
                                               float grad_scale, long *n_valid);
typedef void (*kern_add_fn)(float *out, const float *a, const float *b, long N);
/* AdamW on grads[i] * gscale, then grads[i] = 0 (contract: optim/optim.h, adamw_step) */
typedef void (*kern_adamw_step_fn)(adamw_state *s, float *params, float *grads, float gscale, double lr,
                                   const adamw_hparams *h);
/* The experts of a MoE layer (contract in kernels/ops.h, op_moe_experts_*). */
typedef void (*kern_moe_fwd_fn)(float *out, float *gate, float *up, float *h, float *work, const float *x,
                                const float *wg, const float *wu, const float *wd, const int32_t *perm,
                                const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int Im,
                                int E, int k);
typedef void (*kern_moe_bwd_fn)(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                                const float *dout, const float *x, const float *wg, const float *wu, const float *wd,
                                const float *gate, const float *up, const float *h, const int32_t *perm,
                                const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int Im,
                                int E, int k);
/* op_moe_experts_bwd_w (ops.h): the weight gradients a backward with them NULL left to do */
typedef void (*kern_moe_bwd_w_fn)(float *dwg, float *dwu, float *dwd, float *work, const float *dout, const float *x,
                                  const float *h, const float *dgate, const float *dup, const int32_t *perm,
                                  const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
/* op_moe_experts_fwd_wbf16 / _bwd_wbf16 (ops.h): any expert weight read from a bf16 store */
typedef void (*kern_moe_fwd_wbf16_fn)(float *out, float *gate, float *up, float *h, float *work, const float *x,
                                      const float *wg, const float *wu, const float *wd, const uint16_t *hg,
                                      const uint16_t *hu, const uint16_t *hd, const int32_t *perm,
                                      const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H,
                                      int Im, int E, int k);
typedef void (*kern_moe_bwd_wbf16_fn)(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                                      const float *dout, const float *x, const float *wg, const float *wu,
                                      const float *wd, const uint16_t *hg, const uint16_t *hu, const uint16_t *hd,
                                      const float *gate, const float *up, const float *h, const int32_t *perm,
                                      const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H,
                                      int Im, int E, int k);

/* One registered implementation. The member of `fn` that is used is the one
 * of `op`; an op's entry must fill every function of its member. */
typedef struct {
    kern_op op;
    const char *name;   /* unique per op: "ref", "avx512", "avx2", "openblas", ... */
    const char *device; /* "cpu" (later "cuda", ...) */
    unsigned features;  /* KERN_FEAT_* it needs; 0 runs anywhere */
    double tol;         /* kern_check tolerance vs ref (relative to max |ref|); 0: KERN_CHECK_TOL */
    const char *about;  /* one line for `ctitan kernels list` */
    union {
        struct { /* matmul and matmul_bf16; the wbf16 pair reads w from a bf16 store */
            kern_matmul_fwd_fn fwd; kern_matmul_bwd_fn bwd;
            kern_matmul_fwd_wbf16_fn fwd_wbf16; kern_matmul_dinp_wbf16_fn dinp_wbf16;
        } matmul;
        struct { kern_embedding_fwd_fn fwd; kern_embedding_bwd_fn bwd; } embedding;
        struct { /* bwd_w: bwd's dw alone (a split backward's W), which bwd's dw must be */
            kern_rmsnorm_fwd_fn fwd; kern_rmsnorm_bwd_fn bwd; kern_rmsnorm_bwd_w_fn bwd_w;
        } rmsnorm;
        struct { /* rope, and the fused per-head q/k RMSNorm + RoPE (op_qknorm_rope_*) */
            kern_rope_fn fwd; kern_rope_fn bwd;
            kern_qknorm_rope_fwd_fn qknorm_fwd; kern_qknorm_rope_bwd_fn qknorm_bwd;
            kern_qknorm_rope_bwd_w_fn qknorm_bwd_w; /* qknorm_bwd's dw alone, as rmsnorm's bwd_w */
        } rope;
        struct { /* and the offset form (context parallel's chunks); NULL: kern_impl_complete's */
            kern_attention_fwd_fn fwd; kern_attention_bwd_fn bwd;
            kern_attention_fwd_q0_fn fwd_q0; kern_attention_bwd_q0_fn bwd_q0;
            kern_attention_fwd_blk_fn fwd_blk; kern_attention_bwd_blk_fn bwd_blk; /* NULL: the generic tiled pair */
        } attention;
        struct { kern_swiglu_fwd_fn fwd; kern_swiglu_bwd_fn bwd; } swiglu;
        struct { kern_geglu_fwd_fn fwd; kern_geglu_bwd_fn bwd; } geglu;
        struct { /* whole rows, and the vocabulary-parallel phases (op_crossentropy_vp_*) */
            kern_crossentropy_fwdbwd_fn fwdbwd; kern_crossentropy_fwd_fn fwd;
            kern_crossentropy_vp_max_fn vp_max; kern_crossentropy_vp_sums_fn vp_sums;
            kern_crossentropy_vp_grad_fn vp_grad;
        } crossentropy;
        struct { kern_add_fn fwd; } add;
        struct { kern_adamw_step_fn step; } adamw;
        struct { /* moe_experts and moe_experts_bf16; the wbf16 pair reads weights from a bf16 store */
            kern_moe_fwd_fn fwd; kern_moe_bwd_fn bwd;
            kern_moe_fwd_wbf16_fn fwd_wbf16; kern_moe_bwd_wbf16_fn bwd_wbf16;
            kern_moe_bwd_w_fn bwd_w; /* a split backward's weight gradients (zero-bubble W) */
        } moe;
    } fn;
} kern_impl;

/* The implementation chosen for each op of a run. Owned by the caller (the
 * run context); read-only after kern_select. */
typedef struct {
    kern_matmul_fwd_fn matmul_fwd;
    kern_matmul_bwd_fn matmul_bwd;
    kern_matmul_fwd_wbf16_fn matmul_fwd_wbf16; /* a frozen weight read from its bf16 store */
    kern_matmul_dinp_wbf16_fn matmul_dinp_wbf16;
    kern_embedding_fwd_fn embedding_fwd;
    kern_embedding_bwd_fn embedding_bwd;
    kern_rmsnorm_fwd_fn rmsnorm_fwd;
    kern_rmsnorm_bwd_fn rmsnorm_bwd;
    kern_rmsnorm_bwd_w_fn rmsnorm_bwd_w; /* a split backward's norm weight gradients (model/lm.h, lm_wstore) */
    kern_rope_fn rope_fwd;
    kern_rope_fn rope_bwd;
    kern_qknorm_rope_fwd_fn qknorm_rope_fwd; /* from the rope op's entry */
    kern_qknorm_rope_bwd_fn qknorm_rope_bwd;
    kern_qknorm_rope_bwd_w_fn qknorm_rope_bwd_w;
    kern_attention_fwd_fn attention_fwd;
    kern_attention_bwd_fn attention_bwd;
    kern_attention_fwd_q0_fn attention_fwd_q0; /* from the attention op's entry (distributed/cp.c) */
    kern_attention_bwd_q0_fn attention_bwd_q0;
    kern_attention_fwd_blk_fn attention_fwd_blk; /* the block form, from the attention op's entry (cp.c's ring) */
    kern_attention_bwd_blk_fn attention_bwd_blk;
    kern_swiglu_fwd_fn swiglu_fwd;
    kern_swiglu_bwd_fn swiglu_bwd;
    kern_geglu_fwd_fn geglu_fwd;
    kern_geglu_bwd_fn geglu_bwd;
    kern_crossentropy_fwdbwd_fn crossentropy_fwdbwd;
    kern_crossentropy_fwd_fn crossentropy_fwd;
    kern_crossentropy_vp_max_fn crossentropy_vp_max; /* from the crossentropy op's entry */
    kern_crossentropy_vp_sums_fn crossentropy_vp_sums;
    kern_crossentropy_vp_grad_fn crossentropy_vp_grad;
    kern_add_fn add;
    kern_adamw_step_fn adamw_step;
    kern_matmul_fwd_fn matmul_bf16_fwd; /* not called by the model directly: see kern_use_bf16_matmuls */
    kern_matmul_bwd_fn matmul_bf16_bwd;
    kern_matmul_fwd_wbf16_fn matmul_bf16_fwd_wbf16;
    kern_matmul_dinp_wbf16_fn matmul_bf16_dinp_wbf16;
    kern_moe_fwd_fn moe_fwd;
    kern_moe_bwd_fn moe_bwd;
    kern_moe_fwd_wbf16_fn moe_fwd_wbf16; /* frozen experts read from their bf16 store */
    kern_moe_bwd_wbf16_fn moe_bwd_wbf16;
    kern_moe_bwd_w_fn moe_bwd_w; /* a split backward's expert weight gradients (model/lm.h, lm_wstore) */
    kern_moe_fwd_fn moe_bf16_fwd; /* not called by the model directly: see kern_use_bf16_matmuls */
    kern_moe_bwd_fn moe_bf16_bwd;
    kern_moe_fwd_wbf16_fn moe_bf16_fwd_wbf16;
    kern_moe_bwd_wbf16_fn moe_bf16_bwd_wbf16;
    kern_moe_bwd_w_fn moe_bf16_bwd_w;
    const kern_impl *chosen[KERN_N_OPS]; /* the entries behind the pointers above */
} kern_ops;

/* The built-in table (fastest first within each op); *n receives its length. */
const kern_impl *kern_registry(size_t *n);

/* "matmul" for KERN_OP_MATMUL; kern_op_from_name returns -1 if unknown. */
const char *kern_op_name(kern_op op);
int kern_op_from_name(const char *name);

/* Features of the CPU this process runs on (KERN_FEAT_* bits, OS support
 * included), limited by the environment variable CTITAN_ISA when set: "ref"
 * (none: every op on its reference), "avx2", "avx512" (no AMX), "amx", "neon",
 * "bf16", "sve", or "auto". It forces a lower path on a higher CPU, so every
 * path is tested and benchmarked on whatever machine runs the suite. */
unsigned kern_cpu_features(void);
/* Without CTITAN_ISA's limit. */
unsigned kern_cpu_hw_features(void);
/* The SVE vector length in bits where the hardware has SVE (whatever
 * CTITAN_ISA says), else 0. `kernels list` / `check` print it: the SVE GEMM's
 * tile width follows it, and under qemu it is whatever -cpu max,sveN=on set. */
int kern_sve_vector_bits(void);
/* "avx2 fma avx512f ..." for the bits of f ("none" if empty). */
void kern_features_str(unsigned f, char *buf, size_t cap);
/* The lowest CTITAN_ISA level whose bits include f ("portable" for 0): how
 * a summary names the instruction set an implementation needs. */
const char *kern_features_level(unsigned f);

/* Fills *out with the built-in table's defaults for this CPU, then applies
 * `overrides`, a NULL-terminated list of "op=impl" strings (the [kernels]
 * config section; NULL for none; impl "auto" keeps the default). An unknown
 * op, an unknown impl name, or an impl this CPU cannot run is CT_ERR_CONFIG
 * with a message naming it. On success `log` (if non-NULL) receives one line
 * "kernels: matmul=avx512 embedding=ref ...". */
int kern_select(kern_ops *out, const char *const *overrides, char *log, size_t logcap, ct_err *e);
/* The same over any table and feature set (tests, `kernels list`). */
int kern_select_from(kern_ops *out, const kern_impl *table, size_t n, unsigned cpu_features,
                     const char *const *overrides, char *log, size_t logcap, ct_err *e);
/* An ops table of the reference implementations only (never fails). */
void kern_select_ref(kern_ops *out);
/* bf16 mixed precision: points matmul_fwd/bwd (every linear the model runs,
 * forward and both backward products) and the wbf16 pair at the matmul_bf16 op's choice, and
 * moe_fwd/bwd (the MoE experts' projections) at moe_experts_bf16's, so the
 * model itself needs no other change. Call after kern_select. */
void kern_use_bf16_matmuls(kern_ops *k);

/* ---------------------------------------------------------------- checking */

/* Default tolerance of kern_check: max |impl - ref| <= tol * max |ref| over
 * each output tensor (fp32 implementations; reduced-precision ones set their
 * entry's tol). 1e-5 is ~100 fp32 ulps of the largest element: different
 * summation orders and FMA contraction stay far below it (measured ~1e-6 at
 * K = 1024), while a wrong index, a missed edge or a lost += is O(1). */
#define KERN_CHECK_TOL 1e-5
/* A second bound for the ops whose implementations round intermediates to
 * bf16 (moe_experts_bf16): mean |impl - ref| / max |ref| over each output.
 * A different summation order flips a few roundings to the neighbouring bf16
 * value, which moves the max error (their own tol) but hardly the mean; a
 * kernel that skipped a rounding errs on every element. Measured over the
 * check's shapes: <= 3.9e-7 for every registered bf16 MoE kernel (AMX
 * included), 3.9e-4 to 4.2e-3 for the fp32 reference posing as one. */
#define KERN_CHECK_MEAN_TOL 1e-5
/* attention's bf16 variants (kern_attn_opt.bf16): P and dS are rounded to bf16,
 * from fp32 values whose last bits depend on the implementation's exp and
 * summation order, so a few elements round to the neighbouring bf16 value
 * (2^-8 relative, one term of a sum of a few): their bound on the max error.
 * Over 120 seeds of the check's bf16 cases and the six implementations a Zen 5
 * runs (2026-12-05) the max error reached 8.6e-4 and the mean 1.2e-6; a kernel
 * that skips the rounding errs ~1e-3 at most, under this bound, but 7e-5 to
 * 2e-4 on average, so the mean bound (KERN_CHECK_MEAN_TOL) catches it
 * (tests/c/kernels/test_kernels.c). A window of a few keys puts one flip in a sum of
 * a few terms, so the bf16 cases keep their windows wide (37). */
#define KERN_ATTN_BF16_TOL 4e-3

typedef struct {
    FILE *out;           /* one line per (op, impl, shape) and a summary; NULL: silent */
    const char *op;      /* only this op (NULL: all) */
    const char *impl;    /* only this implementation name (NULL: all) */
    unsigned features;   /* implementations needing more than this are skipped and said so */
    uint64_t seed;       /* inputs are pseudo-random from this seed */
    int quick;           /* cap the long dimension of the largest cases (kern_check's quick_cap) */
} kern_check_opts;

/* Runs every implementation of `table` other than "ref" against the "ref"
 * entry of the same op, forward and backward (including the += accumulation,
 * NULL optional outputs, in-place forms), on random and edge shapes. Returns
 * the number of failed (op, impl, shape) cases; 0 means all passed. */
int kern_check(const kern_impl *table, size_t n, const kern_check_opts *opts);

/* ---------------------------------------------------------------- timing */

/* The sizes one op is timed at; each op reads its own fields. */
typedef struct {
    int M, K, N;           /* matmul, matmul_bf16: out[M,N] = inp[M,K] w[N,K]^T */
    int rows, C, V;        /* embedding [rows,C] from [V,C]; rmsnorm [rows,C]; crossentropy [rows,V];
                            * moe_experts: rows tokens of width C */
    int B, T, nh, nkv, hd; /* rope (the fused q/k norm + RoPE), attention */
    int bf16;              /* attention: timed with kern_attn_opt.bf16 (a bf16 run's attention) */
    long n;                /* swiglu, geglu, add, adamw: elements */
    int I, E, k;           /* moe_experts: expert width, experts, top-k */
} kern_shape;

/* im with the bf16-weight entries and the attention's offset form it leaves
 * out (a test's own table) filled with its op's reference ones: what a run
 * calls for it, so kern_select installs this and the timings time it. */
kern_impl kern_impl_complete(const kern_impl *im);

/* Every input of one op at one shape (kernels/timing.c), allocated once so
 * that the implementations compared run on the same bytes. */
typedef struct kern_bench kern_bench;
kern_bench *kern_bench_new(kern_op op, const kern_shape *s);
void kern_bench_free(kern_bench *b);
/* 0 for the ops with a single entry point (add, adamw) */
int kern_bench_has_bwd(kern_op op);
/* What one timed call runs: the forward, the whole backward, or (matmul and
 * matmul_bf16 only) one of the backward's two products, or the forward / dinp
 * with w read from a bf16 store (fwd_wbf16 / dinp_wbf16: a frozen weight);
 * for the MoE experts ops FWD_WBF16 / BWD_WBF16 are fwd_wbf16 / bwd_wbf16 with
 * all three projections in the store and no weight gradient (frozen). An
 * entry without its wbf16 functions (a test's table) is timed with the
 * reference's, which kern_select installs in their place. */
typedef enum {
    KERN_BENCH_FWD,
    KERN_BENCH_BWD,
    KERN_BENCH_DINP,
    KERN_BENCH_DW,
    KERN_BENCH_FWD_WBF16,
    KERN_BENCH_DINP_WBF16,
    KERN_BENCH_BWD_WBF16
} kern_bench_part;
/* Best seconds of `reps` calls (after one warm-up call) of `part` of im;
 * stops after 2 s of calls, or after the warm-up when that alone took more
 * than cutoff seconds (cutoff > 0): the caller already has a faster candidate. */
double kern_bench_time(kern_bench *b, const kern_impl *im, kern_bench_part part, int reps, double cutoff);
/* Cold operands (`kernels bench --cold`): before every call kern_bench_time
 * makes, each thread writes its share of the caller's `bytes` of scratch (not
 * timed; every byte set to the pass's number, 1, 2, ... modulo 256, 0 skipped),
 * which pushes the operands out of the caches, as the other layers between
 * two uses of a tensor do in a training step; without it every call after the
 * first finds its operands where the previous one left them. NULL turns it off. */
void kern_bench_set_cold(kern_bench *b, unsigned char *scratch, size_t bytes);
/* The scratch size --cold uses: 4 x the last-level cache (sysfs), 64 MB to 1 GB. */
size_t kern_bench_cold_bytes(void);

/* ---------------------------------------------------------------- tuning */

/* What the tuner needs to know of a run: the sizes its ops will see. */
typedef struct {
    int B, T;                         /* micro-batch: B sequences of T tokens */
    int hidden, inter, vocab;         /* inter: the dense MLP width (0: none) */
    int n_heads, n_kv_heads, head_dim;
    int n_experts, moe_inter, top_k;  /* MoE layers (0: dense model) */
    int ce_rows;                      /* logits rows per cross-entropy block */
    long n_params;                    /* AdamW's elements (timed on at most 1M) */
    int bf16;                         /* bf16 mixed precision: tune matmul_bf16 / moe_experts_bf16 and the
                                       * attention's bf16 products too */
    int moe_wbf16;                    /* the experts are read from a bf16 store (a frozen base): time the
                                       * experts op's fwd_wbf16 / bwd_wbf16, the entries such a run calls */
    int mm_wbf16;                     /* most dense projections' weights (by size) are read from a bf16 store
                                       * (a frozen base, LoRA-adapted or not): time the matmul op's fwd_wbf16
                                       * and dinp_wbf16 (no weight gradient), the entries such a run calls */
    int geglu;                        /* the dense MLP is GELU(tanh)-gated (Gemma): tune geglu, not swiglu */
} kern_run_sizes;

/* Chooses by measurement: for each op the run uses whose implementation the
 * overrides leave at "auto" and that has more than one candidate on this CPU,
 * the fastest candidate (forward + backward on the run's sizes, best of a few
 * calls) among those that pass kern_check on this CPU. Candidates are the
 * entries `cpu` can run; "ref" only where it is the sole one or the op is
 * memory-bound (a reference matmul on a model's sizes would take seconds to
 * lose). Results are cached in `cache_path` (one line per op and shape, and
 * one per checked implementation; NULL: no cache), keyed by the caller (CPU
 * model, features, threads: kern_tune_cache_path), so a later run of the same
 * sizes makes the same choice without timing. Starts from kern_select_from's
 * choice, so forced ops stay forced. `log` receives one line per op: what
 * was picked, and the timings or "cached". */
int kern_tune(kern_ops *k, const kern_impl *table, size_t n, unsigned cpu, const char *const *overrides,
              const kern_run_sizes *sizes, const char *cache_path, char *log, size_t logcap, ct_err *e);
/* ~/.cache/ctitan/kernels-v2-<cpu model>-f<features>-t<threads>.txt */
void kern_tune_cache_path(char *out, size_t cap, unsigned cpu, int threads);

#endif
