/* kernels/ops.h: every op the model runs, forward and backward, declared once.
 *
 * Conventions (llm.c's): outputs first, inputs next, sizes last. Backward
 * functions ACCUMULATE into their gradient outputs (+=), so a tensor used
 * twice (tied embeddings, the residual stream) just receives two calls. The
 * ops that write a layer's activation gradients (the matmul's d(input),
 * attention, the q/k norm + RoPE, swiglu, geglu) may also overwrite: their
 * acc / accumulate flag 0 is their first product into the buffer, which then
 * needs no zeroing, nor a read of the zeros. The MoE experts' backward always
 * overwrites its dtopw (a per-slot value, not a gradient of a tensor). All
 * tensors are fp32, row-major, contiguous. Weights are [out, in] as in HF.
 * These are the plain reference implementations (kernels/ref/); faster ones
 * register beside them later and are checked against these. */
#ifndef CT_KERNELS_OPS_H
#define CT_KERNELS_OPS_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>

/* out[M,N] = inp[M,K] @ w[N,K]^T        (accumulate=0 overwrites, 1 adds) */
void op_matmul_fwd(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
/* dinp[M,K] (+)= dout[M,N] @ w[N,K];  dw[N,K] += dout[M,N]^T @ inp[M,K]
 * Either output may be NULL to skip it. accumulate is dinp's, as the
 * forward's: 1 adds, 0 overwrites without reading dinp (its first product,
 * so the caller need not zero it first: the zeroing and the kernel's read of
 * C were 2-4% of a W3 step at AVX2 and in bf16, docs/benchmarks.md). dw
 * always adds: weight gradients accumulate over micro-batches. */
void op_matmul_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                   int M, int K, int N, int accumulate);
/* The same products on inputs rounded to bf16 (nearest even, as torch's
 * .to(bfloat16)), summed in fp32, outputs fp32: the reference of the
 * matmul_bf16 op (bf16 mixed precision). Rounds copies of the inputs, then
 * calls op_matmul_*. */
void op_matmul_bf16_fwd(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate);
void op_matmul_bf16_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                        int M, int K, int N, int accumulate);
/* The forward and the dinp product with w[N,K] given in bf16 (a frozen weight
 * read from its bf16 store, model/lm.c): by definition the products of
 * op_matmul_* / op_matmul_bf16_* on w widened to fp32, which is exact, so an
 * implementation must give the bits its own fwd / bwd give on that widening.
 * There is no dw: a weight stored in bf16 is frozen. The dinp product reads
 * dout[M,N] with its rows ldd >= N floats apart: a stored lm_head's backward
 * passes the columns of one vocabulary block of the whole d(logits) in place
 * (model/lm.c, head_bwd); every other caller passes ldd = N. accumulate as
 * op_matmul_bwd's. */
void op_matmul_fwd_wbf16(float *out, const float *inp, const uint16_t *w, int M, int K, int N, int accumulate);
void op_matmul_dinp_wbf16(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N, int ldd,
                          int accumulate);
void op_matmul_bf16_fwd_wbf16(float *out, const float *inp, const uint16_t *w, int M, int K, int N, int accumulate);
void op_matmul_bf16_dinp_wbf16(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N, int ldd,
                               int accumulate);

/* out[N,C] = wte[tokens[n], :]  (tokens must be in [0,V)) */
void op_embedding_fwd(float *out, const int32_t *tokens, const float *wte, int N, int C);
/* dwte[tokens[n], :] += dout[n, :] ; sequential over n so the result is deterministic */
void op_embedding_bwd(float *dwte, const float *dout, const int32_t *tokens, int N, int C);

/* RMSNorm over rows of C: out[N,C] = inp * rstd * w, rstd[N] = 1/sqrt(mean(inp^2) + eps) */
void op_rmsnorm_fwd(float *out, float *rstd, const float *inp, const float *w, int N, int C, float eps);
/* dinp[N,C] += ..., dw[C] += ... (dw may be NULL) */
void op_rmsnorm_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                    const float *rstd, int N, int C);
/* Its weight-gradient half alone: dw[C] += sum_n dout (inp rstd). A zero-bubble
 * split backward (model/lm.h, lm_wstore) runs op_rmsnorm_bwd with dw NULL in I
 * and this in W; every implementation's bwd takes its dw from its own bwd_w, so
 * the two halves give the fused call's bits by construction. */
void op_rmsnorm_bwd_w(float *dw, const float *dout, const float *inp, const float *rstd, int N, int C);

/* RMSNorm whose rows are split over ranks (OLMo2's q/k norm over the whole
 * projection under tensor parallelism: each rank holds C of the row's Cw
 * features). The caller sums the per-row partials over the ranks between
 * the phases; nothing here communicates. Forward: ss[N] = sum_c inp^2, then
 * (after the sum) rstd = 1/sqrt(ss/Cw + eps) and out = inp * rstd * w. */
void op_rmsnorm_sumsq(float *ss, const float *inp, int N, int C);
void op_rmsnorm_scale(float *out, const float *inp, const float *w, const float *rstd, int N, int C);
/* Backward: dot[N] = sum_c dout * w * inp, then (after the sum)
 * dinp += r w dout - (r^3 / Cw) inp dot, dw[C] += sum_n dout inp r (dw may be NULL:
 * op_rmsnorm_bwd_w's sum, which it calls). */
void op_rmsnorm_bwd_dot(float *dot, const float *dout, const float *inp, const float *w, int N, int C);
void op_rmsnorm_bwd_given(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                          const float *rstd, const float *dot, int N, int C, int Cw);

/* Rotate-half RoPE over the first rd (even, <= hd) features of each head, in
 * place allowed (out may equal inp). x[B,T,nh,hd]; cos,sin [T, rd/2]
 * (positions 0..T-1; HF's emb = cat(f, f) so both halves share angle i).
 * With h = rd/2, for i < h: out[..., i] = x_i c - x_{i+h} s, out[..., i+h] = x_{i+h} c + x_i s;
 * features rd..hd-1 pass through unchanged (partial_rotary_factor: transformers'
 * Phi3 apply_rotary_pos_emb rotates q[..., :rotary_dim] and concatenates the rest). */
void op_rope_fwd(float *out, const float *inp, const float *cos, const float *sin, int B, int T, int nh, int hd,
                 int rd);
/* dinp += R^T dout (the pass-through features: dinp += dout). In place
 * (dinp == dout) it overwrites: dout = R^T dout. */
void op_rope_bwd(float *dinp, const float *dout, const float *cos, const float *sin, int B, int T, int nh, int hd,
                 int rd);
/* cos/sin tables [T, hd/2] with inv_freq[i] = 1/theta^(2i/hd) computed in fp32 as HF does. */
void op_rope_tables(float *cos, float *sin, int T, int hd, float theta);
/* Qwen3's per-head q/k RMSNorm followed by RoPE, fused (registered with the
 * rope op): out = rope(rmsnorm(x) * w), one norm per head row of hd.
 * x[B,T,nh,hd] -> out[B,T,nh,hd] (must not alias x: the backward needs x),
 * rstd[B*T*nh], w[hd], cos/sin [T,hd/2]. The reference is the composition
 * op_rmsnorm_fwd + op_rope_fwd. */
void op_qknorm_rope_fwd(float *out, float *rstd, const float *x, const float *w, const float *cos, const float *sin,
                        int B, int T, int nh, int hd, float eps);
/* dx[B,T,nh,hd] (+)= (acc 0: overwritten) and dw[hd] += (dw may be NULL), from
 * dout = d(the rotated output): op_rope_bwd into a scratch row, then
 * op_rmsnorm_bwd. */
void op_qknorm_rope_bwd(float *dx, float *dw, const float *dout, const float *x, const float *w, const float *rstd,
                        const float *cos, const float *sin, int B, int T, int nh, int hd, int acc);
/* Its weight-gradient half alone (a split backward's W, as op_rmsnorm_bwd_w):
 * dw[hd] += sum over rows of (R^T dout) (x rstd). An implementation's bwd must
 * give its own bwd_w's bits for dw: the reference calls it, the fused kernels
 * repeat its arithmetic inside their one pass over the rows (a second pass for
 * dw re-read dout and x: 1.4 ms where 0.7-1.0 ms, avx512 at Qwen3's q), and
 * `kernels check` compares I then W with the fused call bit for bit. */
void op_qknorm_rope_bwd_w(float *dw, const float *dout, const float *x, const float *rstd, const float *cos,
                          const float *sin, int B, int T, int nh, int hd);

/* What a model family changes in attention (model/lm.h). Passed as the last
 * argument of every attention implementation; NULL (or all fields 0) is
 * Qwen3's attention: scale 1/sqrt(hd), causal, no cap, and then results are
 * bit-identical to those before the options existed. */
typedef struct {
    float scale;   /* multiplies q.k; 0: 1/sqrt(hd) */
    int window;    /* > 0: query t sees keys j with t - window < j <= t (transformers'
                      sliding_window_overlay: kv_idx > q_idx - sliding_window); 0: all j <= t */
    float softcap; /* > 0: s = softcap * tanh(scale * q.k / softcap) before the mask and softmax
                      (gemma's eager_attention_forward); 0: none */
    int bf16;      /* 1: bf16 products (training.mixed_precision_param = "bfloat16"): q, k, v and dout
                      are bf16 values (the caller rounds them), and the backward rounds P and dS to
                      bf16 before dv += P^T dout, dk += dS^T q and dq += dS k, as autocast's bf16
                      attention multiplies bf16 operands. Sums, the softmax, lse and the forward's
                      P V weights stay fp32 (P relative to a running max would round differently
                      per tiling), so an implementation may take q k^T, dout v^T and the three
                      sums above as bf16 dot products (vdpbf16ps): the same exact products.
                      0: every operand fp32. */
} kern_attn_opt;
/* The first key query t sees under a window (0 without one: window <= 0). */
static inline int kern_attn_first_key(int t, int window) { return window > 0 && t >= window ? t - window + 1 : 0; }
/* The options with their defaults (opt may be NULL), read here by every
 * implementation so they agree: scale 0 means 1/sqrt(hd), a window <= 0 none,
 * a soft cap <= 0 none. */
static inline float kern_attn_scale(const kern_attn_opt *opt, int hd) {
    return opt && opt->scale != 0.0f ? opt->scale : 1.0f / sqrtf((float)hd);
}
static inline int kern_attn_window(const kern_attn_opt *opt) { return opt && opt->window > 0 ? opt->window : 0; }
static inline float kern_attn_softcap(const kern_attn_opt *opt) { return opt && opt->softcap > 0.0f ? opt->softcap : 0.0f; }
static inline int kern_attn_bf16(const kern_attn_opt *opt) { return opt && opt->bf16; }
/* The backward's acc 0 for an implementation that sums into dq, dk, dv in
 * place: they are zeroed first, as its caller did before the flag. */
static inline void kern_attn_zero_grads_q0(float *dq, float *dk, float *dv, int B, int Tq, int Tk, int nh, int nkv,
                                           int hd) {
    size_t nq = (size_t)B * Tq * nh * hd, nk = (size_t)B * Tk * nkv * hd;
    for (size_t i = 0; i < nq; i++) dq[i] = 0.0f;
    for (size_t i = 0; i < nk; i++) dk[i] = dv[i] = 0.0f;
}
static inline void kern_attn_zero_grads(float *dq, float *dk, float *dv, int B, int T, int nh, int nkv, int hd) {
    kern_attn_zero_grads_q0(dq, dk, dv, B, T, T, nh, nkv, hd);
}

/* Causal GQA attention, never holding [T x T] scores: the forward saves only
 * the log-sum-exp of each score row, lse = log sum_j exp(s_j), and the
 * backward recomputes the probabilities p_j = exp(s_j - lse) from q, k, lse.
 * q[B,T,nh,hd], k,v [B,T,nkv,hd] -> out[B,T,nh,hd], lse[B,nh,T] with
 * s_j = scale * q . k_j (softcapped if opt says so) over the keys j the row
 * sees: j <= t, and j > t - window with a window. Query head h reads kv head
 * h / (nh/nkv). lse is over the final (scaled, capped) scores of the row; the
 * backward differentiates the cap (d tanh = 1 - tanh^2). A window skips whole
 * key blocks left of it, so the cost grows with the window, not with T.
 * Implementations share this contract: op_attention_* (one row at a time, the
 * reference) and op_attention_*_tiled (query x key blocks, online softmax,
 * blocks above the diagonal and left of the window skipped), and the CPU
 * kernels of the registry. */
void op_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v,
                      int B, int T, int nh, int nkv, int hd, const kern_attn_opt *opt);
/* dq, dk, dv (+)= ... (acc 0: overwritten); out and lse are the forward's (out gives the softmax
 * backward's D = rowsum(dout * out) without the probabilities). */
void op_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                      const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                      const kern_attn_opt *opt, int acc);
/* The same attention for the last Tq of Tk positions (the query offset q0 = Tk - Tq,
 * 0 <= q0): query row r is position q0 + r and sees keys j <= q0 + r of the Tk (and
 * j > q0 + r - window), the mask and window by position as above. q, out, dout, dq
 * [B,Tq,nh,hd], lse [B,nh,Tq]; k, v, dk, dv [B,Tk,nkv,hd], every dk/dv row written
 * (acc 0) or added to. No query rows for the first q0 positions: context parallel
 * (distributed/cp.h) runs a chunk of a sequence against its whole prefix's keys. Tq = Tk
 * is op_attention_fwd/bwd, bit for bit (the whole-sequence forms call these); every
 * implementation of the attention op has the pair (kern_impl's fn.attention.fwd_q0). */
void op_attention_fwd_q0(float *out, float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                         int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_q0(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                         const float *q, const float *k, const float *v, int B, int Tq, int Tk, int nh, int nkv,
                         int hd, const kern_attn_opt *opt, int acc);
/* The block form (ring attention, distributed/cp.h): the Tq query rows at positions q0 ..
 * q0 + Tq - 1 against one block of Tk keys at positions k0 .. k0 + Tk - 1, each row seeing
 * the keys its causal prefix and window allow (as above, by position; a block wholly in a
 * row's future adds nothing). Rows and keys are strided so a chunk's pieces are used in
 * place: q, acc, dq, dout row (b, r) at ((b * ldq + r) * nh + h) * hd, m, l, lse, D row at
 * (b * nh + h) * ldq + r; k, v, dk, dv row (b, j) at ((b * ldk + j) * nkv + kh) * hd. */
typedef struct {
    int B, nh, nkv, hd;
    int Tq, q0, ldq; /* query rows, the first one's position, rows per sequence in q's buffer */
    int Tk, k0, ldk;
} kern_attn_blk;
/* Online softmax over blocks: acc (unnormalised sum of exp(s - m) v), m (the row's running
 * max, -INFINITY before any key) and l (sum of exp(s - m)) absorb one block, rescaled when the
 * max grows, so blocks merge exactly in any order; start from acc 0, m -inf, l 0. Rows that
 * see no key of the block are untouched. */
void op_attention_fwd_blk(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                          const kern_attn_blk *g, const kern_attn_opt *opt);
/* After the last block: out = acc / l (in place in acc) and lse = m + log l (in place in m). */
void op_attention_blk_finish(float *acc, float *m, const float *l, const kern_attn_blk *g);
/* The backward of one block, given the whole row's lse (the finished forward's) and
 * D = rowsum(dout * out) (op_attention_blk_rowdot): dq += the block's share, dk, dv += the
 * block's keys' gradients from these rows; always adds. */
void op_attention_bwd_blk(float *dq, float *dk, float *dv, const float *dout, const float *lse, const float *D,
                          const float *q, const float *k, const float *v, const kern_attn_blk *g,
                          const kern_attn_opt *opt);
/* D [B, nh, ldq] rows = rowsum(dout * out) of the Tq query rows (the layout of lse). */
void op_attention_blk_rowdot(float *D, const float *dout, const float *out, const kern_attn_blk *g);
/* The pair a tile of keys at a time (kernels/ref/attention_blk.c: attention.c's tiling, the
 * results of the above to rounding); _avx512 compiled for AVX-512 (call only where the CPU has it). */
void op_attention_fwd_blk_tiled(float *acc, float *m, float *l, const float *q, const float *k, const float *v,
                                const kern_attn_blk *g, const kern_attn_opt *opt);
void op_attention_bwd_blk_tiled(float *dq, float *dk, float *dv, const float *dout, const float *lse, const float *D,
                                const float *q, const float *k, const float *v, const kern_attn_blk *g,
                                const kern_attn_opt *opt);
#if defined(__x86_64__)
void op_attention_fwd_blk_tiled_avx512(float *acc, float *m, float *l, const float *q, const float *k,
                                       const float *v, const kern_attn_blk *g, const kern_attn_opt *opt);
void op_attention_bwd_blk_tiled_avx512(float *dq, float *dk, float *dv, const float *dout, const float *lse,
                                       const float *D, const float *q, const float *k, const float *v,
                                       const kern_attn_blk *g, const kern_attn_opt *opt);
#endif
void op_attention_fwd_tiled(float *out, float *lse, const float *q, const float *k, const float *v,
                            int B, int T, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_tiled(float *dq, float *dk, float *dv, const float *dout, const float *out,
                            const float *lse, const float *q, const float *k, const float *v, int B, int T,
                            int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
void op_attention_fwd_q0_tiled(float *out, float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                               int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_q0_tiled(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                               const float *q, const float *k, const float *v, int B, int Tq, int Tk, int nh, int nkv,
                               int hd, const kern_attn_opt *opt, int acc);
#if defined(__x86_64__)
/* The tiled pair compiled for AVX-512 (call only where the CPU has it;
 * the registry checks). Bit-identical to the generic tiled pair. */
void op_attention_fwd_tiled_avx512(float *out, float *lse, const float *q, const float *k, const float *v,
                                   int B, int T, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_tiled_avx512(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                   const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                   int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
void op_attention_fwd_q0_tiled_avx512(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                      int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_q0_tiled_avx512(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                      const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                      int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
/* The same for AVX2 + FMA ("tiled_avx2"; bit-identical to the generic pair too). */
void op_attention_fwd_tiled_avx2(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                 int T, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_tiled_avx2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                 const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                 int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
void op_attention_fwd_q0_tiled_avx2(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                    int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_q0_tiled_avx2(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                    const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                    int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
#elif defined(__aarch64__)
/* The tiled pair compiled for SVE (call only where the CPU has it). Bit-identical
 * to the generic tiled pair, which on aarch64 is the NEON build. */
void op_attention_fwd_tiled_sve(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                int T, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_tiled_sve(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                const float *lse, const float *q, const float *k, const float *v, int B, int T,
                                int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
void op_attention_fwd_q0_tiled_sve(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                   int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt);
void op_attention_bwd_q0_tiled_sve(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                   const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                   int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc);
#endif

/* out[N] = silu(gate) * up */
void op_swiglu_fwd(float *out, const float *gate, const float *up, int N);
/* dgate, dup (+)= ... (acc 0: overwritten) */
void op_swiglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N, int acc);

/* out[N] = gelu_tanh(gate) * up, gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))):
 * torch's gelu(approximate="tanh"), transformers' gelu_pytorch_tanh (Gemma's MLP). */
void op_geglu_fwd(float *out, const float *gate, const float *up, int N);
/* dgate, dup (+)= ... (acc 0: overwritten) */
void op_geglu_bwd(float *dgate, float *dup, const float *dout, const float *gate, const float *up, int N, int acc);

/* Cross-entropy on a block of logits, fused with its backward.
 * logits[N,V] is overwritten with dlogits = (softmax - onehot(target)) * grad_scale
 * for rows whose target != -100, and zeros for ignored rows.
 * A target outside [0,V) other than -100 is a caller bug and aborts (check data first).
 * Returns the SUM over valid rows of -log softmax[target] (as double), and
 * adds the count of valid rows to *n_valid if non-NULL. */
double op_crossentropy_fwdbwd(float *logits, const int32_t *targets, int N, int V, float grad_scale,
                              long *n_valid);
/* Forward only: per-row losses (0 for ignored rows), logits untouched. Returns the sum. */
double op_crossentropy_fwd(float *losses, const float *logits, const int32_t *targets, int N, int V);

/* Vocabulary-parallel cross-entropy (tensor parallelism; registered with the
 * crossentropy op): logits[N,V] hold only this rank's columns [v0, v0 + V) of
 * each row. Three local phases; the caller combines each one's outputs over
 * the ranks before the next (max, then sums):
 *   1. maxv[N]   = the row max over the local columns;
 *   2. given the global maxv: sumexp[N] = sum_i exp(x_i - maxv) over the local
 *      columns, and tlogit[N] = x[target - v0] - maxv where the target is a
 *      local column, else 0 (also 0 for target -100). Sums over the ranks give
 *      the global sum and the target's shifted logit from the rank holding it.
 *   3. given the global maxv, sumexp, tlogit: logits[N,V] is overwritten with
 *      (exp(x - maxv) / sumexp - onehot(target - v0)) * grad_scale, zeros for
 *      rows whose target is -100. Returns the sum over the other rows of
 *      -(tlogit - log sumexp) (as double, rows in order) and adds their count
 *      to *n_valid if non-NULL; identical on every rank.
 * Targets outside [v0, v0 + V) are other ranks' columns, not errors. */
void op_crossentropy_vp_max(float *maxv, const float *logits, int N, int V);
void op_crossentropy_vp_sums(float *sumexp, float *tlogit, const float *logits, const float *maxv,
                             const int32_t *targets, int N, int V, int v0);
double op_crossentropy_vp_grad(float *logits, const float *maxv, const float *sumexp, const float *tlogit,
                               const int32_t *targets, int N, int V, int v0, float grad_scale, long *n_valid);
/* The loss part of op_crossentropy_vp_grad, shared by its implementations:
 * sum over rows not ignored of log(sumexp) - tlogit, serially in row order;
 * *n_valid += those rows. */
double op_crossentropy_vp_loss(const float *sumexp, const float *tlogit, const int32_t *targets, int N,
                               long *n_valid);

/* Residual add: out[N] = a + b (out may alias a). */
void op_add(float *out, const float *a, const float *b, long N);
/* Linear biases (Qwen2's q/k/v, Llama's optional ones): out[N,C] += b[C];
 * db[C] += column sums of dout[N,C]. Small next to the matmuls they follow:
 * a reference only. */
void op_bias_add(float *out, const float *b, int N, int C);
void op_bias_bwd(float *db, const float *dout, int N, int C);

/* The experts of a MoE layer (model/moe.h routes, this computes). Token t of
 * x[N,H] chose k experts: slot s = t*k + j, with weight topw[s]. Routing
 * metadata from the forward's router: offsets[E+1], perm[N*k] the slots in
 * expert order (expert e's are perm[offsets[e] .. offsets[e+1]), tokens
 * ascending), pos[N*k] its inverse (slot s sits at row pos[s]). Experts are
 * stacked: wg, wu [E, Im, H] (gate_proj, up_proj), wd [E, H, Im] (down_proj).
 * Forward: gate, up, h [N*k, Im] in expert order (row p is slot perm[p]):
 *   gate[p] = wg_e x[t], up[p] = wu_e x[t], h[p] = silu(gate[p]) * up[p]
 *   out[t,:] += sum_j topw[t*k+j] * wd_e h[pos[t*k+j]]
 * out NULL: gate, up, h only (recomputation before the backward).
 * h is silu(gate) * up exactly as op_swiglu_fwd computes it (recomputation
 * under activation checkpointing rebuilds h with op_swiglu_fwd).
 * work: KERN_MOE_WORK(N*k, H, Im) floats of scratch, contents undefined after. */
#define KERN_MOE_WORK(S, H, Im) ((size_t)(S) * (2 * (size_t)(H) + 2 * (size_t)(Im)) + 64)
void op_moe_experts_fwd(float *out, float *gate, float *up, float *h, float *work, const float *x, const float *wg,
                        const float *wu, const float *wd, const int32_t *perm, const int32_t *pos,
                        const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
/* Backward from the forward's gate, up, h and metadata (no re-routing):
 * dx[N,H], dwg, dwu, dwd += ...; dtopw[N*k] = d/d topw (overwritten). A NULL
 * weight gradient (frozen experts) is skipped, with its product. Whatever
 * the weight gradients, it leaves in work d gate [N*k, Im] (KERN_MOE_DGATE)
 * and d up [N*k, Im] (KERN_MOE_DUP), rows in expert order: the operands of
 * op_moe_experts_bwd_w, which a split backward (a zero-bubble pipeline's I
 * with the weight gradients NULL, then its W) hands on. */
#define KERN_MOE_DGATE(work, S, Im) (work)
#define KERN_MOE_DUP(work, S, Im) ((work) + (size_t)(S) * (size_t)(Im))
void op_moe_experts_bwd(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work, const float *dout,
                        const float *x, const float *wg, const float *wu, const float *wd, const float *gate,
                        const float *up, const float *h, const int32_t *perm, const int32_t *pos,
                        const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
/* The weight gradients alone, the rest of a backward that ran with them
 * NULL: dwg, dwu, dwd (NULL: skipped) += exactly what op_moe_experts_bwd
 * would have added, the same products summed in the same order (the same
 * bits), from its dout [N,H] and x [N,H], the forward's h [N*k, Im] and the
 * d gate / d up [N*k, Im] the backward left in its work (read only for dwg /
 * dwu), and the routing metadata. work: KERN_MOE_WORK(N*k, H, Im) floats of
 * scratch, not overlapping dgate / dup. The weights are not read. */
void op_moe_experts_bwd_w(float *dwg, float *dwu, float *dwd, float *work, const float *dout, const float *x,
                          const float *h, const float *dgate, const float *dup, const int32_t *perm,
                          const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
/* The same under bf16 mixed precision (the moe_experts_bf16 op): each expert
 * projection's products (forward, d input, d weight) take both factors
 * rounded to bf16 and sum in fp32, as op_matmul_bf16_*; routing weights,
 * SwiGLU and d topw stay fp32. */
void op_moe_experts_bf16_fwd(float *out, float *gate, float *up, float *h, float *work, const float *x,
                             const float *wg, const float *wu, const float *wd, const int32_t *perm,
                             const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int Im,
                             int E, int k);
void op_moe_experts_bf16_bwd(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                             const float *dout, const float *x, const float *wg, const float *wu, const float *wd,
                             const float *gate, const float *up, const float *h, const int32_t *perm,
                             const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H, int Im,
                             int E, int k);
void op_moe_experts_bf16_bwd_w(float *dwg, float *dwu, float *dwd, float *work, const float *dout, const float *x,
                               const float *h, const float *dgate, const float *dup, const int32_t *perm,
                               const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);

/* The same two with any of the three expert weights given in bf16 (a frozen
 * projection read from its bf16 store, model/lm.c): hg, hu, hd [E, Im, H] /
 * [E, H, Im] as wg, wu, wd; where one is set its fp32 pointer is not read
 * (may be NULL), where it is NULL the fp32 one is. By definition the results
 * of op_moe_experts_fwd / _bwd (resp. the bf16 op's) on the weights widened
 * to fp32, which is exact, so an implementation must give the bits its own
 * fwd / bwd give on that widening, never a whole fp32 copy of a weight. The
 * backward's weight gradients do not read the weights: dwg, dwu, dwd work as
 * in op_moe_experts_bwd (a stored weight is frozen, so the model passes NULL
 * for its gradient). */
void op_moe_experts_fwd_wbf16(float *out, float *gate, float *up, float *h, float *work, const float *x,
                              const float *wg, const float *wu, const float *wd, const uint16_t *hg,
                              const uint16_t *hu, const uint16_t *hd, const int32_t *perm, const int32_t *pos,
                              const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
void op_moe_experts_bwd_wbf16(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                              const float *dout, const float *x, const float *wg, const float *wu, const float *wd,
                              const uint16_t *hg, const uint16_t *hu, const uint16_t *hd, const float *gate,
                              const float *up, const float *h, const int32_t *perm, const int32_t *pos,
                              const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
void op_moe_experts_bf16_fwd_wbf16(float *out, float *gate, float *up, float *h, float *work, const float *x,
                                   const float *wg, const float *wu, const float *wd, const uint16_t *hg,
                                   const uint16_t *hu, const uint16_t *hd, const int32_t *perm, const int32_t *pos,
                                   const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k);
void op_moe_experts_bf16_bwd_wbf16(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                                   const float *dout, const float *x, const float *wg, const float *wu,
                                   const float *wd, const uint16_t *hg, const uint16_t *hu, const uint16_t *hd,
                                   const float *gate, const float *up, const float *h, const int32_t *perm,
                                   const int32_t *pos, const int32_t *offsets, const float *topw, int N, int H,
                                   int Im, int E, int k);

/* ------------------------------------- per-thread spans (the profiler's view)
 *
 * Kernels take no context, so the profiler (metrics/profile.h) reaches their
 * OpenMP threads through the thread that calls them: while a step is traced
 * it arms a kern_trace on its own thread (kern_trace_arm), and a kernel reads
 * it once per parallel region, on the calling thread, before the region
 * (kern_trace_armed); each thread of the region then stamps its slot on
 * entry and exit. The slots hold, per OpenMP thread number, the first entry
 * and last exit since the profiler last cleared them: one span per thread
 * per op call, however many regions and iterations the op runs. The pointer
 * is _Thread_local in kernels/ref/trace.c (docs/design.md lists the state
 * outside a run context): one run's recording thread never sees another's. Unprofiled: one
 * call returning NULL per region and one NULL test per thread. */
typedef struct {
    int64_t first, last; /* ns of CLOCK_MONOTONIC; first == 0: the thread ran no region */
} kern_thread_span;
typedef struct {
    kern_thread_span *slot; /* [n], indexed by omp_get_thread_num() */
    int n;
} kern_trace;
/* t (NULL: none) for the calling thread's kernel calls from now on. */
void kern_trace_arm(kern_trace *t);
/* What the calling thread armed; NULL inside a parallel region (a nested
 * region's thread numbers are not the slots', and the outer region's stamps
 * cover it). */
kern_trace *kern_trace_armed(void);
/* In the region, on each thread: now as its first entry (if none) / last exit. */
void kern_trace_enter(kern_trace *t);
void kern_trace_exit(kern_trace *t);
/* Around a region's body, with t = kern_trace_armed() read before it. */
#define KERN_TRACE_ENTER(t)                                                                                        \
    do {                                                                                                           \
        if (t) kern_trace_enter(t);                                                                                \
    } while (0)
#define KERN_TRACE_EXIT(t)                                                                                         \
    do {                                                                                                           \
        if (t) kern_trace_exit(t);                                                                                 \
    } while (0)

#endif
