/* kernels/cpu/matmul_cpu.c: the three matmuls of kernels/ops.h on gemm_f32.
 *
 * Each matmul is one GEMM call whose operands are strided views of the
 * model's row-major tensors; the packers read the transposed operand where
 * it lies, so no matrix is ever copied or transposed whole:
 *   forward  out[M,N]  (+)= inp[M,K] . w[N,K]^T    A = inp,    B = w viewed [K,N]
 *   dinp     dinp[M,K]  += dout[M,N] . w[N,K]      A = dout,   B = w
 *   dw       dw[N,K]    += dout[M,N]^T . inp[M,K]  A = dout viewed [N,M], B = inp
 * A forward with at most GEMM_SMALL_M rows (generation's decode steps) is a
 * set of dot products instead (gemm_nt_small): no packing of w.
 * The "openblas" implementation makes the same three calls through CBLAS so
 * the registry can offer it (and benchmarks can compare against it). */
#include <cblas.h>
#include <string.h>

#include "kernels/cpu/kern_cpu.h"

static void matmul_fwd(const gemm_arch *ar, float *out, const float *inp, const float *w, int M, int K, int N,
                       int accumulate) {
    if (M <= GEMM_SMALL_M) {
        gemm_nt_small(ar, out, inp, w, M, K, N, accumulate);
        return;
    }
    gemm_view a = {inp, K, 1}, b = {w, 1, K};
    gemm_f32(ar, M, N, K, a, b, out, N, accumulate);
}

void gemm_matmul_bwd(const gemm_arch *ar, float *dinp, float *dw, const float *dout, const float *inp,
                     const float *w, int M, int K, int N) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    if (dinp) {
        gemm_view a = {dout, N, 1}, b = {w, K, 1};
        gemm_f32(ar, M, K, N, a, b, dinp, K, 1);
    }
    if (dw) {
        gemm_view a = {dout, 1, N}, b = {inp, K, 1};
        gemm_f32(ar, N, K, M, a, b, dw, K, 1);
    }
}

#if defined(__x86_64__)
void kern_matmul_fwd_avx512(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    matmul_fwd(&gemm_arch_avx512, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                            int K, int N) {
    gemm_matmul_bwd(&gemm_arch_avx512, dinp, dw, dout, inp, w, M, K, N);
}
void kern_matmul_fwd_avx2(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    matmul_fwd(&gemm_arch_avx2, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bwd_avx2(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                          int K, int N) {
    gemm_matmul_bwd(&gemm_arch_avx2, dinp, dw, dout, inp, w, M, K, N);
}
#elif defined(__aarch64__)
void kern_matmul_fwd_neon(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    matmul_fwd(&gemm_arch_neon, out, inp, w, M, K, N, accumulate);
}
void kern_matmul_bwd_neon(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                          int N) {
    gemm_matmul_bwd(&gemm_arch_neon, dinp, dw, dout, inp, w, M, K, N);
}
#endif

void kern_matmul_fwd_openblas(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        /* BLAS implementations disagree on K == 0; the answer is an empty sum */
        if (!accumulate) memset(out, 0, (size_t)M * N * sizeof(float));
        return;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, inp, K, w, K, accumulate ? 1.0f : 0.0f,
                out, N);
}

void kern_matmul_bwd_openblas(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                              int K, int N) {
    if (M <= 0 || N <= 0 || K <= 0) return;
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, K, N, 1.0f, dout, N, w, K, 1.0f, dinp, K);
    if (dw)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, N, K, M, 1.0f, dout, N, inp, K, 1.0f, dw, K);
}
