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

/* A strided view: element (i, j) lives at p[i * rs + j * cs]. One of rs, cs is
 * 1 for every operand the model passes; the packers have a fast path for each. */
typedef struct {
    const float *p;
    long rs, cs;
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
/* Packs rows [0, m) and columns [0, kc) of `a` (already offset to the first
 * element) as ceil(m / MR) consecutive micro-panels of kc * MRS floats:
 * panel p holds a(p*MR + i, k) at [k * MRS + i], zeros for rows >= m. */
typedef void (*gemm_pack_a_fn)(float *dst, gemm_view a, long m, long kc);
/* Packs rows [0, kc) and columns [0, n) of `b` as ceil(n / NR) consecutive
 * micro-panels of kc * NR floats: panel p holds b(k, p*NR + j) at [k * NR + j],
 * zeros for columns >= n. Whole blocks, so strided operands are read row by
 * row (one page at a time) rather than panel by panel. */
typedef void (*gemm_pack_b_fn)(float *dst, gemm_view b, long kc, long n);

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
    gemm_ukernel_fn ukernel;
    gemm_pack_a_fn pack_a;
    gemm_pack_b_fn pack_b;
    gemm_nt_small_fn nt_small;
} gemm_arch;

extern const gemm_arch gemm_arch_avx512; /* 14 x 32 zmm tile; needs AVX-512 F/BW/VL/DQ */
extern const gemm_arch gemm_arch_avx2;   /* 6 x 16 ymm tile; needs AVX2 + FMA */

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

/* The ops.h matmul signatures on top of gemm_f32 for each ISA. */
void kern_matmul_fwd_avx512(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_avx512(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                            int K, int N);
void kern_matmul_fwd_avx2(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_avx2(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                          int K, int N);
/* OpenBLAS's sgemm (whatever core type the library picked when it loaded). */
void kern_matmul_fwd_openblas(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void kern_matmul_bwd_openblas(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M,
                              int K, int N);

#endif
