/* kernels/cpu/matmul_cpu.c: the three matmuls of kernels/ops.h on gemm_f32.
 *
 * Each matmul is one GEMM call whose operands are strided views of the
 * model's row-major tensors; the packers read the transposed operand where
 * it lies, so no matrix is ever copied or transposed whole:
 *   forward  out[M,N]  (+)= inp[M,K] . w[N,K]^T    A = inp,    B = w viewed [K,N]
 *   dinp     dinp[M,K] (+)= dout[M,N] . w[N,K]      A = dout,   B = w
 *   dw       dw[N,K]    += dout[M,N]^T . inp[M,K]  A = dout viewed [N,M], B = inp
 * A forward with at most GEMM_SMALL_M rows (generation's decode steps) is a
 * set of dot products instead (gemm_nt_small): no packing of w.
 * The "openblas" implementation makes the same three products through CBLAS
 * (the reference's calls) so the registry can offer it (and benchmarks can
 * compare against it). */
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/cpu/kern_cpu.h"

/* w[n] bf16 widened into a fresh fp32 copy (exact): the few-rows forward and
 * OpenBLAS, which read fp32 only. */
static float *widened(const uint16_t *w, size_t n) {
    float *x = ct_malloc64((n ? n : 1) * sizeof(float));
    ct_convert_to_f32(x, w, CT_BF16, n);
    return x;
}

static void matmul_fwd(const gemm_arch *ar, float *out, const float *inp, const float *w, int M, int K, int N,
                       int accumulate) {
    if (M <= GEMM_SMALL_M) {
        gemm_nt_small(ar, out, inp, w, M, K, N, accumulate);
        return;
    }
    gemm_view a = {inp, K, 1, NULL}, b = {w, 1, K, NULL};
    gemm_f32(ar, M, N, K, a, b, out, N, accumulate);
}

void gemm_matmul_bwd(const gemm_arch *ar, float *dinp, float *dw, const float *dout, const float *inp,
                     const float *w, int M, int K, int N, int accumulate) {
    if (M <= 0 || K <= 0) return;
    if (dinp) { /* N == 0: gemm_f32's empty sum, dinp = 0 or unchanged */
        gemm_view a = {dout, N, 1, NULL}, b = {w, K, 1, NULL};
        gemm_f32(ar, M, K, N, a, b, dinp, K, accumulate);
    }
    if (dw) {
        gemm_view a = {dout, 1, N, NULL}, b = {inp, K, 1, NULL};
        gemm_f32(ar, N, K, M, a, b, dw, K, 1);
    }
}

void gemm_matmul_fwd_wbf16(const gemm_arch *ar, float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                           int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (M <= GEMM_SMALL_M && ar->nt_small) {
        /* decode steps (generation): the dot products of matmul_fwd, on the same fp32 values */
        float *x = widened(w, (size_t)N * (K > 0 ? K : 0));
        gemm_nt_small(ar, out, inp, x, M, K, N, accumulate);
        free(x);
        return;
    }
    gemm_view a = {inp, K, 1, NULL}, b = {NULL, 1, K, w};
    gemm_f32(ar, M, N, K, a, b, out, N, accumulate);
}

void gemm_matmul_dinp_wbf16(const gemm_arch *ar, float *dinp, const float *dout, const uint16_t *w, int M, int K,
                            int N, int ldd, int accumulate) {
    if (M <= 0 || K <= 0) return;
    /* A = dout with rows ldd apart: the packers read A through its row stride
     * whatever it is, and the blocking is a function of M, N, K alone, so a
     * strided dout gives the bits of its contiguous copy */
    gemm_view a = {dout, ldd, 1, NULL}, b = {NULL, K, 1, w};
    gemm_f32(ar, M, K, N, a, b, dinp, K, accumulate);
}

/* The wbf16 pair of an implementation whose products are gemm_f32 calls on `arch`. */
#define KERN_MM_H_DEF(SUF, arch)                                                                                     \
    void kern_matmul_fwd_wbf16_##SUF(float *out, const float *inp, const uint16_t *w, int M, int K, int N,          \
                                     int accumulate) {                                                               \
        gemm_matmul_fwd_wbf16(arch, out, inp, w, M, K, N, accumulate);                                               \
    }                                                                                                                \
    void kern_matmul_dinp_wbf16_##SUF(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,      \
                                      int ldd, int accumulate) {                                                     \
        gemm_matmul_dinp_wbf16(arch, dinp, dout, w, M, K, N, ldd, accumulate);                                       \
    }

#if defined(__x86_64__)
KERN_MM_H_DEF(avx512, &gemm_arch_avx512)
KERN_MM_H_DEF(avx2, &gemm_arch_avx2)
#elif defined(__aarch64__)
KERN_MM_H_DEF(neon, &gemm_arch_neon)
#endif

#if defined(__x86_64__)
/* The AVX-512 tile for a C `width` columns wide (the forward's N, the
 * backward's K: both of its products are K wide): at most 16 the 28 x 16
 * one, with the same bits. */
static const gemm_arch *avx512_for(int width) {
    return width <= gemm_arch_avx512_n16.nr ? &gemm_arch_avx512_n16 : &gemm_arch_avx512;
}
void kern_matmul_fwd_avx512(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    matmul_fwd(avx512_for(N), out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                            int K, int N, int accumulate) {
    gemm_matmul_bwd(avx512_for(K), dinp, dw, dout, inp, w, M, K, N, accumulate);
}
void kern_matmul_fwd_avx2(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    matmul_fwd(&gemm_arch_avx2, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bwd_avx2(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                          int K, int N, int accumulate) {
    gemm_matmul_bwd(&gemm_arch_avx2, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
#elif defined(__aarch64__)
void kern_matmul_fwd_neon(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    matmul_fwd(&gemm_arch_neon, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bwd_neon(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                          int N, int accumulate) {
    gemm_matmul_bwd(&gemm_arch_neon, dinp, dw, dout, inp, w, M, K, N, accumulate);
}
#endif

/* The reference's products are these CBLAS calls already (kernels/ref/ops_ref.c,
 * empty sums included): the "openblas" entry is them under its own name, a
 * candidate the tuner times (it never times the reference of a compute-bound op). */
void kern_matmul_fwd_openblas(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    op_matmul_fwd(out, inp, w, M, K, N, accumulate);
}

void kern_matmul_bwd_openblas(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                              int K, int N, int accumulate) {
    op_matmul_bwd(dinp, dw, dout, inp, w, M, K, N, accumulate);
}

/* Rows of w widened at a time by the OpenBLAS forward: a caller may pass a
 * whole bf16-stored lm_head (model/lm.c, head_fwd), whose fp32 copy (0.6 GB
 * at Qwen3's vocabulary) would undo the store's saving; 8192 rows are the
 * blocks the model used to pass one at a time, so its sgemm calls are the
 * same. Beyond 8192 rows the bits are those of these column blocks, not of
 * one sgemm over all N: OpenBLAS's sums depend on N (with 7-row blocks
 * `kernels check` sees fwd_h differ from fwd in the last bits). */
#define OPENBLAS_WBF16_ROWS 8192

void kern_matmul_fwd_wbf16_openblas(float *out, const float *inp, const uint16_t *w, int M, int K, int N,
                                    int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        kern_matmul_fwd_openblas(out, inp, NULL, M, K, N, accumulate);
        return;
    }
    int nb = N < OPENBLAS_WBF16_ROWS ? N : OPENBLAS_WBF16_ROWS;
    float *x = ct_malloc64((size_t)nb * K * sizeof(float));
    for (int n0 = 0; n0 < N; n0 += nb) {
        int nv = N - n0 < nb ? N - n0 : nb;
        ct_convert_to_f32(x, w + (size_t)n0 * K, CT_BF16, (size_t)nv * K);
        /* columns n0 .. n0 + nv of out, row stride N */
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, nv, K, 1.0f, inp, K, x, K,
                    accumulate ? 1.0f : 0.0f, out + n0, N);
    }
    free(x);
}

void kern_matmul_dinp_wbf16_openblas(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N,
                                     int ldd, int accumulate) {
    if (M <= 0 || K <= 0) return;
    if (N <= 0) {
        kern_matmul_bwd_openblas(dinp, NULL, NULL, NULL, NULL, M, K, N, accumulate);
        return;
    }
    float *x = widened(w, (size_t)N * K);
    /* kern_matmul_bwd_openblas's dinp product, with dout's row stride ldd */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, dout, ldd, x, K,
                accumulate ? 1.0f : 0.0f, dinp, K);
    free(x);
}
