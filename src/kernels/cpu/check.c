/* kernels/cpu/check.c: kern_check, every implementation against "ref".
 *
 * For each op, a list of shapes chosen to hit the edges of fast kernels:
 * length 1 in every dimension, sizes just below/above the vector widths (8,
 * 16) and register tiles (6, 14, 16, 32), odd sizes, and sizes that cross the
 * GEMM's cache blocks (k blocks of 256, 1022-row A blocks, 2048-column B
 * blocks) so edge tiles, several k blocks and several blocks per call all
 * run. Every case feeds the same pseudo-random inputs to "ref" and to the
 * implementation and compares each output tensor:
 *     err = max |impl - ref| / max |ref|      must be <= tol
 * with tol = the entry's tol or KERN_CHECK_TOL (1e-5). A NaN or Inf where ref
 * is finite is an infinite error. Backward outputs are pre-filled with the
 * same random values on both sides, so a lost "+=" shows; forward outputs
 * that must be overwritten are pre-filled with NaN, so reading them shows.
 *
 * The checker runs on host memory ("cpu" device); a device backend would add
 * copies around the calls here. It takes the table as a parameter so a test
 * can check a table with a deliberately broken entry. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/err.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

/* ------------------------------------------------------------ helpers */

typedef struct {
    uint64_t s;
} chk_rng;

static uint64_t rng_next(chk_rng *r) {
    /* splitmix64: fixed sequence per seed, no global state */
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* uniform in [lo, hi) */
static float rng_uniform(chk_rng *r, float lo, float hi) {
    return lo + (hi - lo) * (float)((rng_next(r) >> 40) * (1.0 / 16777216.0));
}

static float *fbuf(size_t n) { return ct_malloc((n ? n : 1) * sizeof(float)); }

static void fill(float *p, size_t n, chk_rng *r, float lo, float hi) {
    for (size_t i = 0; i < n; i++) p[i] = rng_uniform(r, lo, hi);
}

static void fill_nan(float *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = NAN;
}

static float *dup(const float *src, size_t n) {
    float *p = fbuf(n);
    memcpy(p, src, (n ? n : 1) * sizeof(float));
    return p;
}

/* max |x - ref| / max |ref|; infinite if x is not finite where ref is. */
static double rel_err(const float *x, const float *ref, size_t n) {
    double emax = 0, rmax = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i]) && isfinite(ref[i])) return INFINITY;
        double d = fabs((double)x[i] - (double)ref[i]);
        if (d > emax) emax = d;
        if (fabs((double)ref[i]) > rmax) rmax = fabs((double)ref[i]);
    }
    if (emax == 0) return 0;
    return rmax > 0 ? emax / rmax : INFINITY;
}

/* mean |x - ref| / max |ref|: small when a few elements differ (a bf16
 * rounding flipped by a different summation order), about the rounding error
 * itself when every element does (a kernel that skipped a rounding). */
static double mean_err(const float *x, const float *ref, size_t n) {
    double esum = 0, rmax = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(x[i]) && isfinite(ref[i])) return INFINITY;
        esum += fabs((double)x[i] - (double)ref[i]);
        if (fabs((double)ref[i]) > rmax) rmax = fabs((double)ref[i]);
    }
    if (esum == 0) return 0;
    return rmax > 0 && n ? esum / (double)n / rmax : INFINITY;
}

/* The numbers of a case's shape (the ops' tables below; unused trailing ones 0):
 * attention's are the most, B T nh nkv hd, its options and the offset form's Tq. */
#define CHK_DIMS 7

/* Collects the parts of one case: "fwd 1.2e-07 dinp 3.0e-07 ..." and the worst;
 * worst_mean: the largest mean_err, for the ops that bound it (KERN_CHECK_MEAN_TOL). */
typedef struct {
    char detail[448]; /* the MoE cases print 20 parts */
    size_t len;
    double worst;
    double worst_mean;
    double tol; /* > 0: this case's bound on worst instead of the entry's (attention's bf16 variants) */
} chk_case;

static void part(chk_case *c, const char *name, double err) {
    int w = snprintf(c->detail + c->len, sizeof c->detail > c->len ? sizeof c->detail - c->len : 0, "%s%s %.1e",
                     c->len ? "  " : "", name, err);
    if (w > 0) c->len += (size_t)w;
    if (!(err <= c->worst)) c->worst = err; /* NaN counts as worst */
}

/* ------------------------------------- the reference, once per (op, shape) */

/* Every implementation of an op is checked on the same inputs: the driver
 * seeds the generator per (op, shape), so each implementation's case draws
 * the same values and the reference would compute the same outputs for each.
 * It computes them once: the case code calls the reference through the
 * wrappers below (a copy of the "ref" entry with the heavy ops' functions
 * replaced), which record the outputs of each reference call on the first
 * implementation and fill them in for the others. A call is filled in only
 * when everything it reads (its inputs, the prior contents of its outputs,
 * which the += forms read, and its scalars) hashes the same as the recorded
 * call at the same place in the case; otherwise the reference runs, so a
 * record can only save time, never change a result. Under qemu and the
 * sanitizers the serial reference was most of the check's time, once per
 * implementation. The wrapped ops are the ones whose reference costs more
 * than drawing its inputs (matmul, matmul_bf16, attention, moe_experts,
 * moe_experts_bf16); the others call their reference as before. One check
 * at a time per thread (the state is thread-local). */

enum { MEMO_MAX_OUT = 5 };

typedef struct {
    void *p; /* NULL: an absent optional output */
    size_t bytes;
} memo_buf;

typedef struct {
    uint64_t key;
    int nout;
    void *data[MEMO_MAX_OUT];
    size_t bytes[MEMO_MAX_OUT];
} memo_call;

typedef struct {
    memo_call *calls;
    int n, cap;
} memo_case;

static _Thread_local struct {
    const kern_impl *ref; /* the real reference */
    memo_case *cur;       /* the case now running; NULL: no recording */
    int cursor;           /* the next reference call of the case */
} memo;

static uint64_t memo_mix(uint64_t h, uint64_t w) {
    h = (h ^ w) * 0x9E3779B97F4A7C15ull;
    return h ^ (h >> 29);
}

static uint64_t memo_hash(uint64_t h, const void *p, size_t bytes) {
    if (!p) return memo_mix(h, 0x6E756C6Cull); /* "null" */
    h = memo_mix(h, bytes);
    const unsigned char *b = p;
    size_t i = 0;
    uint64_t w;
    for (; i + 8 <= bytes; i += 8) {
        memcpy(&w, b + i, 8);
        h = memo_mix(h, w);
    }
    if (i < bytes) {
        w = 0;
        memcpy(&w, b + i, bytes - i);
        h = memo_mix(h, w);
    }
    return h;
}

/* the key of a call: which function (fn), its scalars, inputs and outputs' prior contents */
static uint64_t memo_key(int fn, const int64_t *sc, int nsc, const memo_buf *in, int nin, const memo_buf *out,
                         int nout) {
    uint64_t h = memo_mix(0x636B6D656D6Full, (uint64_t)fn);
    for (int i = 0; i < nsc; i++) h = memo_mix(h, (uint64_t)sc[i]);
    for (int i = 0; i < nin; i++) h = memo_hash(h, in[i].p, in[i].bytes);
    for (int i = 0; i < nout; i++) h = memo_hash(h, out[i].p, out[i].bytes);
    return h;
}

/* 1: the outputs were filled in from the record of the same call; 0: the caller runs the reference, then memo_store */
static int memo_replay(uint64_t key, const memo_buf *out, int nout) {
    memo_case *mc = memo.cur;
    if (!mc || memo.cursor >= mc->n) return 0;
    const memo_call *c = &mc->calls[memo.cursor];
    if (c->key != key || c->nout != nout) return 0;
    for (int i = 0; i < nout; i++)
        if ((c->data[i] != NULL) != (out[i].p != NULL) || c->bytes[i] != out[i].bytes) return 0;
    for (int i = 0; i < nout; i++)
        if (out[i].p) memcpy(out[i].p, c->data[i], out[i].bytes);
    memo.cursor++;
    return 1;
}

static void memo_free_calls(memo_case *mc, int from) {
    for (int j = from; j < mc->n; j++)
        for (int i = 0; i < mc->calls[j].nout; i++) free(mc->calls[j].data[i]);
    mc->n = from;
}

/* records the outputs of the reference call just made, in place of whatever
 * the record held from here on (a case that took another path) */
static void memo_store(uint64_t key, const memo_buf *out, int nout) {
    memo_case *mc = memo.cur;
    if (!mc) return;
    memo_free_calls(mc, memo.cursor);
    if (mc->n == mc->cap) {
        mc->cap = mc->cap ? 2 * mc->cap : 8;
        memo_call *grown = ct_malloc((size_t)mc->cap * sizeof *grown);
        if (mc->n) memcpy(grown, mc->calls, (size_t)mc->n * sizeof *grown);
        free(mc->calls);
        mc->calls = grown;
    }
    memo_call *c = &mc->calls[mc->n++];
    c->key = key;
    c->nout = nout;
    for (int i = 0; i < nout; i++) {
        c->bytes[i] = out[i].bytes;
        c->data[i] = NULL;
        if (out[i].p) {
            c->data[i] = ct_malloc(out[i].bytes ? out[i].bytes : 1);
            memcpy(c->data[i], out[i].p, out[i].bytes);
        }
    }
    memo.cursor++;
}

#define MEMO_N(a) (int)(sizeof(a) / sizeof((a)[0]))
#define FB(p, n) {(void *)(p), (p) ? (size_t)(n) * sizeof(float) : 0}
#define IB(p, n) {(void *)(p), (p) ? (size_t)(n) * sizeof(int32_t) : 0}
/* the body of a wrapper: the reference's call when the record has no match */
#define MEMO_CALL(fn_id, call)                                                                                       \
    do {                                                                                                           \
        uint64_t key_ = memo_key(fn_id, sc, MEMO_N(sc), in, MEMO_N(in), out_, MEMO_N(out_));                      \
        if (memo_replay(key_, out_, MEMO_N(out_))) return;                                                         \
        call;                                                                                                      \
        memo_store(key_, out_, MEMO_N(out_));                                                                      \
    } while (0)

static void memo_matmul_fwd(float *out, const float *inp, const float *w, int M, int K, int N, int acc) {
    int64_t sc[] = {M, K, N, acc};
    memo_buf in[] = {FB(inp, (size_t)M * K), FB(w, (size_t)N * K)}, out_[] = {FB(out, (size_t)M * N)};
    MEMO_CALL(1, memo.ref->fn.matmul.fwd(out, inp, w, M, K, N, acc));
}

static void memo_matmul_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                            int N, int accumulate) {
    int64_t sc[] = {M, K, N, accumulate};
    memo_buf in[] = {FB(dout, (size_t)M * N), FB(inp, (size_t)M * K), FB(w, (size_t)N * K)},
             out_[] = {FB(dinp, (size_t)M * K), FB(dw, (size_t)N * K)};
    MEMO_CALL(2, memo.ref->fn.matmul.bwd(dinp, dw, dout, inp, w, M, K, N, accumulate));
}

static void memo_attention_fwd(float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                               int nh, int nkv, int hd, const kern_attn_opt *opt) {
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, np = (size_t)B * nh * T;
    int64_t sc[] = {B, T, nh, nkv, hd};
    memo_buf in[] = {FB(q, nq), FB(k, nk), FB(v, nk), {(void *)opt, opt ? sizeof *opt : 0}},
             out_[] = {FB(out, nq), FB(lse, np)};
    MEMO_CALL(3, memo.ref->fn.attention.fwd(out, lse, q, k, v, B, T, nh, nkv, hd, opt));
}

static void memo_attention_bwd(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                               const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                               const kern_attn_opt *opt, int acc) {
    size_t nq = (size_t)B * T * nh * hd, nk = (size_t)B * T * nkv * hd, np = (size_t)B * nh * T;
    int64_t sc[] = {B, T, nh, nkv, hd, acc};
    memo_buf in[] = {FB(dout, nq), FB(out, nq), FB(lse, np), FB(q, nq), FB(k, nk), FB(v, nk),
                     {(void *)opt, opt ? sizeof *opt : 0}},
             out_[] = {FB(dq, nq), FB(dk, nk), FB(dv, nk)};
    MEMO_CALL(4, memo.ref->fn.attention.bwd(dq, dk, dv, dout, out, lse, q, k, v, B, T, nh, nkv, hd, opt, acc));
}

static void memo_attention_fwd_q0(float *out, float *lse, const float *q, const float *k, const float *v, int B,
                                  int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    size_t nq = (size_t)B * Tq * nh * hd, nk = (size_t)B * Tk * nkv * hd, np = (size_t)B * nh * Tq;
    int64_t sc[] = {B, Tq, Tk, nh, nkv, hd};
    memo_buf in[] = {FB(q, nq), FB(k, nk), FB(v, nk), {(void *)opt, opt ? sizeof *opt : 0}},
             out_[] = {FB(out, nq), FB(lse, np)};
    MEMO_CALL(9, memo.ref->fn.attention.fwd_q0(out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt));
}

static void memo_attention_bwd_q0(float *dq, float *dk, float *dv, const float *dout, const float *out,
                                  const float *lse, const float *q, const float *k, const float *v, int B, int Tq,
                                  int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc) {
    size_t nq = (size_t)B * Tq * nh * hd, nk = (size_t)B * Tk * nkv * hd, np = (size_t)B * nh * Tq;
    int64_t sc[] = {B, Tq, Tk, nh, nkv, hd, acc};
    memo_buf in[] = {FB(dout, nq), FB(out, nq), FB(lse, np), FB(q, nq), FB(k, nk), FB(v, nk),
                     {(void *)opt, opt ? sizeof *opt : 0}},
             out_[] = {FB(dq, nq), FB(dk, nk), FB(dv, nk)};
    MEMO_CALL(10, memo.ref->fn.attention.bwd_q0(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt,
                                                acc));
}

/* work: scratch, neither read before written nor compared */
static void memo_moe_fwd(float *out, float *gate, float *up, float *h, float *work, const float *x, const float *wg,
                         const float *wu, const float *wd, const int32_t *perm, const int32_t *pos,
                         const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    size_t S = (size_t)N * k, nx = (size_t)N * H, nw = (size_t)E * I * H, ns = S * I;
    int64_t sc[] = {N, H, I, E, k};
    memo_buf in[] = {FB(x, nx),   FB(wg, nw),  FB(wu, nw),          FB(wd, nw),
                     IB(perm, S), IB(pos, S), IB(offsets, E + 1), FB(topw, S)},
             out_[] = {FB(out, nx), FB(gate, ns), FB(up, ns), FB(h, ns)};
    MEMO_CALL(5, memo.ref->fn.moe.fwd(out, gate, up, h, work, x, wg, wu, wd, perm, pos, offsets, topw, N, H, I, E, k));
}

static void memo_moe_bwd(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work, const float *dout,
                         const float *x, const float *wg, const float *wu, const float *wd, const float *gate,
                         const float *up, const float *h, const int32_t *perm, const int32_t *pos,
                         const int32_t *offsets, const float *topw, int N, int H, int I, int E, int k) {
    size_t S = (size_t)N * k, nx = (size_t)N * H, nw = (size_t)E * I * H, ns = S * I;
    int64_t sc[] = {N, H, I, E, k};
    memo_buf in[] = {FB(dout, nx), FB(x, nx),   FB(wg, nw),   FB(wu, nw),   FB(wd, nw),          FB(gate, ns),
                     FB(up, ns),   FB(h, ns),   IB(perm, S), IB(pos, S), IB(offsets, E + 1), FB(topw, S)},
             out_[] = {FB(dx, nx), FB(dwg, nw), FB(dwu, nw), FB(dwd, nw), FB(dtopw, S)};
    MEMO_CALL(6, memo.ref->fn.moe.bwd(dx, dwg, dwu, dwd, dtopw, work, dout, x, wg, wu, wd, gate, up, h, perm, pos,
                                      offsets, topw, N, H, I, E, k));
}

#define HB(p, n) {(void *)(p), (p) ? (size_t)(n) * sizeof(uint16_t) : 0}
static void memo_moe_fwd_h(float *out, float *gate, float *up, float *h, float *work, const float *x, const float *wg,
                           const float *wu, const float *wd, const uint16_t *hg, const uint16_t *hu,
                           const uint16_t *hd, const int32_t *perm, const int32_t *pos, const int32_t *offsets,
                           const float *topw, int N, int H, int I, int E, int k) {
    size_t S = (size_t)N * k, nx = (size_t)N * H, nw = (size_t)E * I * H, ns = S * I;
    int64_t sc[] = {N, H, I, E, k};
    /* a weight given in bf16 is read from there only: its fp32 pointer is not hashed */
    memo_buf in[] = {FB(x, nx),          FB(hg ? NULL : wg, nw), FB(hu ? NULL : wu, nw), FB(hd ? NULL : wd, nw),
                     HB(hg, nw),         HB(hu, nw),             HB(hd, nw),             IB(perm, S),
                     IB(pos, S),         IB(offsets, E + 1),     FB(topw, S)},
             out_[] = {FB(out, nx), FB(gate, ns), FB(up, ns), FB(h, ns)};
    MEMO_CALL(7, memo.ref->fn.moe.fwd_wbf16(out, gate, up, h, work, x, wg, wu, wd, hg, hu, hd, perm, pos, offsets, topw,
                                            N, H, I, E, k));
}

static void memo_moe_bwd_h(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work, const float *dout,
                           const float *x, const float *wg, const float *wu, const float *wd, const uint16_t *hg,
                           const uint16_t *hu, const uint16_t *hd, const float *gate, const float *up, const float *h,
                           const int32_t *perm, const int32_t *pos, const int32_t *offsets, const float *topw, int N,
                           int H, int I, int E, int k) {
    size_t S = (size_t)N * k, nx = (size_t)N * H, nw = (size_t)E * I * H, ns = S * I;
    int64_t sc[] = {N, H, I, E, k};
    memo_buf in[] = {FB(dout, nx), FB(x, nx),   FB(hg ? NULL : wg, nw), FB(hu ? NULL : wu, nw), FB(hd ? NULL : wd, nw),
                     HB(hg, nw),   HB(hu, nw),  HB(hd, nw),             FB(gate, ns),           FB(up, ns),
                     FB(h, ns),    IB(perm, S), IB(pos, S),             IB(offsets, E + 1),     FB(topw, S)},
             out_[] = {FB(dx, nx), FB(dwg, nw), FB(dwu, nw), FB(dwd, nw), FB(dtopw, S)};
    MEMO_CALL(8, memo.ref->fn.moe.bwd_wbf16(dx, dwg, dwu, dwd, dtopw, work, dout, x, wg, wu, wd, hg, hu, hd, gate, up, h,
                                            perm, pos, offsets, topw, N, H, I, E, k));
}

#undef MEMO_CALL
#undef FB
#undef IB
#undef HB

/* The copy of the "ref" entry the cases call: the wrapped functions of the
 * ops above, the reference itself for the rest. */
static kern_impl memo_ref_entry(const kern_impl *ref) {
    kern_impl r = *ref;
    switch ((int)ref->op) {
    case KERN_OP_MATMUL:
    case KERN_OP_MATMUL_BF16:
        r.fn.matmul.fwd = memo_matmul_fwd;
        r.fn.matmul.bwd = memo_matmul_bwd;
        break;
    case KERN_OP_ATTENTION:
        r.fn.attention.fwd = memo_attention_fwd;
        r.fn.attention.bwd = memo_attention_bwd;
        if (ref->fn.attention.fwd_q0) r.fn.attention.fwd_q0 = memo_attention_fwd_q0;
        if (ref->fn.attention.bwd_q0) r.fn.attention.bwd_q0 = memo_attention_bwd_q0;
        break;
    case KERN_OP_MOE:
    case KERN_OP_MOE_BF16:
        r.fn.moe.fwd = memo_moe_fwd;
        r.fn.moe.bwd = memo_moe_bwd;
        if (ref->fn.moe.fwd_wbf16) r.fn.moe.fwd_wbf16 = memo_moe_fwd_h;
        if (ref->fn.moe.bwd_wbf16) r.fn.moe.bwd_wbf16 = memo_moe_bwd_h;
        break;
    default: break;
    }
    return r;
}

/* ------------------------------------------------------------- matmul */

/* 0 if x and y hold the same bits, else infinite. */
static double bits_err(const float *x, const float *y, size_t n) {
    return memcmp(x, y, (n ? n : 1) * sizeof(float)) ? INFINITY : 0;
}

/* The wbf16 pair (w read from a bf16 store): against the reference's, and
 * bit for bit against the implementation's own fwd / bwd on the fp32
 * widening of the same w, which is what the model's frozen bf16 store must
 * reproduce (the widening is exact, so a bf16 packer has no excuse). */
/* w[n] rounded to bf16 (a frozen weight's store, malloc'd) and *widened its
 * fp32 widening (fbuf): what the wbf16 entries read, and the weight their
 * own fp32 entries must give the same bits on. */
static uint16_t *bf16_store_of(const float *w, size_t n, float **widened) {
    uint16_t *h = ct_malloc((n ? n : 1) * sizeof(uint16_t));
    ct_convert_from_f32(h, CT_BF16, w, n);
    *widened = fbuf(n);
    ct_convert_to_f32(*widened, h, CT_BF16, n);
    return h;
}

static void case_matmul_wbf16(chk_case *c, const kern_impl *ref, const kern_impl *im, int M, int K, int N,
                              const float *inp, const float *w, const float *dout, chk_rng *r) {
    if (!im->fn.matmul.fwd_wbf16 || !im->fn.matmul.dinp_wbf16) {
        part(c, "wbf16 missing", INFINITY);
        return;
    }
    size_t nmk = (size_t)M * K, nnk = (size_t)N * K, nmn = (size_t)M * N;
    float *wr;
    uint16_t *wh = bf16_store_of(w, nnk, &wr);
    float *o1 = fbuf(nmn), *o2 = fbuf(nmn), *o3 = fbuf(nmn);
    fill_nan(o1, nmn);
    fill_nan(o2, nmn);
    fill_nan(o3, nmn);
    ref->fn.matmul.fwd_wbf16(o1, inp, wh, M, K, N, 0);
    im->fn.matmul.fwd_wbf16(o2, inp, wh, M, K, N, 0);
    im->fn.matmul.fwd(o3, inp, wr, M, K, N, 0);
    part(c, "fwd_h", rel_err(o2, o1, nmn));
    part(c, "fwd_h=fwd", bits_err(o2, o3, nmn));
    fill(o2, nmn, r, -1, 1);
    memcpy(o3, o2, nmn * sizeof(float));
    im->fn.matmul.fwd_wbf16(o2, inp, wh, M, K, N, 1);
    im->fn.matmul.fwd(o3, inp, wr, M, K, N, 1);
    part(c, "fwd_h+=fwd", bits_err(o2, o3, nmn));
    float *d1 = fbuf(nmk);
    fill(d1, nmk, r, -1, 1);
    float *d2 = dup(d1, nmk), *d3 = dup(d1, nmk);
    ref->fn.matmul.dinp_wbf16(d1, dout, wh, M, K, N, N, 1);
    im->fn.matmul.dinp_wbf16(d2, dout, wh, M, K, N, N, 1);
    im->fn.matmul.bwd(d3, NULL, dout, inp, wr, M, K, N, 1);
    part(c, "dinp_h+=", rel_err(d2, d1, nmk));
    part(c, "dinp_h=bwd", bits_err(d2, d3, nmk));
    /* overwritten: NaN must not leak through, and the same bits as bwd's overwrite */
    float *e1 = fbuf(nmk), *e2 = fbuf(nmk), *e3 = fbuf(nmk);
    fill_nan(e1, nmk);
    fill_nan(e2, nmk);
    fill_nan(e3, nmk);
    ref->fn.matmul.dinp_wbf16(e1, dout, wh, M, K, N, N, 0);
    im->fn.matmul.dinp_wbf16(e2, dout, wh, M, K, N, N, 0);
    im->fn.matmul.bwd(e3, NULL, dout, inp, wr, M, K, N, 0);
    part(c, "dinp_h=", rel_err(e2, e1, nmk));
    part(c, "dinp_h= bwd", bits_err(e2, e3, nmk));
    /* dout as columns [c0, c0 + N) of a wider [M, ld] matrix, NaN elsewhere
     * (a stored lm_head's vocabulary block of d(logits), read in place): the
     * bits of the contiguous dout, for the reference and the implementation */
    int c0 = 3, ld = N + 7;
    float *wide = fbuf((size_t)M * ld);
    fill_nan(wide, (size_t)M * ld);
    for (int i = 0; i < M; i++) memcpy(wide + (size_t)i * ld + c0, dout + (size_t)i * N, N * sizeof(float));
    float *d4 = dup(d3, nmk), *d5 = dup(d3, nmk);
    memcpy(d1, d4, nmk * sizeof(float));
    memcpy(d2, d4, nmk * sizeof(float));
    ref->fn.matmul.dinp_wbf16(d1, dout, wh, M, K, N, N, 1);
    ref->fn.matmul.dinp_wbf16(d4, wide + c0, wh, M, K, N, ld, 1);
    im->fn.matmul.dinp_wbf16(d2, dout, wh, M, K, N, N, 1);
    im->fn.matmul.dinp_wbf16(d5, wide + c0, wh, M, K, N, ld, 1);
    part(c, "dinp_h ld ref", bits_err(d4, d1, nmk));
    part(c, "dinp_h ld", bits_err(d5, d2, nmk));
    fill_nan(e3, nmk);
    im->fn.matmul.dinp_wbf16(e3, wide + c0, wh, M, K, N, ld, 0);
    part(c, "dinp_h= ld", bits_err(e3, e2, nmk));
    free(wh), free(wr), free(o1), free(o2), free(o3), free(d1), free(d2), free(d3), free(d4), free(d5), free(wide);
    free(e1), free(e2), free(e3);
}

static void case_matmul(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    int M = s[0], K = s[1], N = s[2];
    size_t nmk = (size_t)M * K, nnk = (size_t)N * K, nmn = (size_t)M * N;
    float *inp = fbuf(nmk), *w = fbuf(nnk), *dout = fbuf(nmn);
    fill(inp, nmk, r, -1, 1);
    fill(w, nnk, r, -1, 1);
    fill(dout, nmn, r, -1, 1);
    /* forward, overwrite: outputs start as NaN, which must not leak through */
    float *o1 = fbuf(nmn), *o2 = fbuf(nmn);
    fill_nan(o1, nmn);
    fill_nan(o2, nmn);
    ref->fn.matmul.fwd(o1, inp, w, M, K, N, 0);
    im->fn.matmul.fwd(o2, inp, w, M, K, N, 0);
    part(c, "fwd", rel_err(o2, o1, nmn));
    /* forward, accumulate */
    fill(o1, nmn, r, -1, 1);
    memcpy(o2, o1, nmn * sizeof(float));
    ref->fn.matmul.fwd(o1, inp, w, M, K, N, 1);
    im->fn.matmul.fwd(o2, inp, w, M, K, N, 1);
    part(c, "fwd+=", rel_err(o2, o1, nmn));
    /* backward, both outputs accumulated */
    float *di1 = fbuf(nmk), *dw1 = fbuf(nnk);
    fill(di1, nmk, r, -1, 1);
    fill(dw1, nnk, r, -1, 1);
    float *di2 = dup(di1, nmk), *dw2 = dup(dw1, nnk);
    ref->fn.matmul.bwd(di1, dw1, dout, inp, w, M, K, N, 1);
    im->fn.matmul.bwd(di2, dw2, dout, inp, w, M, K, N, 1);
    part(c, "dinp+=", rel_err(di2, di1, nmk));
    part(c, "dw+=", rel_err(dw2, dw1, nnk));
    /* each output alone (the other NULL) */
    ref->fn.matmul.bwd(di1, NULL, dout, inp, w, M, K, N, 1);
    im->fn.matmul.bwd(di2, NULL, dout, inp, w, M, K, N, 1);
    ref->fn.matmul.bwd(NULL, dw1, dout, inp, w, M, K, N, 1);
    im->fn.matmul.bwd(NULL, dw2, dout, inp, w, M, K, N, 1);
    double e1 = rel_err(di2, di1, nmk), e2 = rel_err(dw2, dw1, nnk);
    part(c, "null", e1 > e2 ? e1 : e2);
    /* d(input) overwritten: it starts as NaN, which must not leak through;
     * dw is still added to */
    fill_nan(di1, nmk);
    fill_nan(di2, nmk);
    memcpy(dw2, dw1, nnk * sizeof(float));
    ref->fn.matmul.bwd(di1, dw1, dout, inp, w, M, K, N, 0);
    im->fn.matmul.bwd(di2, dw2, dout, inp, w, M, K, N, 0);
    part(c, "dinp=", rel_err(di2, di1, nmk));
    part(c, "dw+= (dinp=)", rel_err(dw2, dw1, nnk));
    if (ref->fn.matmul.fwd_wbf16) /* last: the generator is seeded per (op, shape), so nothing later reads r */
        case_matmul_wbf16(c, ref, im, M, K, N, inp, w, dout, r);
    free(inp), free(w), free(dout), free(o1), free(o2), free(di1), free(dw1), free(di2), free(dw2);
}

static const int shapes_matmul[][CHK_DIMS] = {
    {1, 1, 1},      {1, 17, 33},    {3, 1, 5},      {7, 5, 1},     {1, 1024, 3},  {4, 40, 7},
    {2, 33, 100},   {5, 16, 9},     {6, 8, 16},
    {14, 32, 32},   {15, 33, 31},   {13, 16, 17},   {29, 64, 47},  {77, 131, 45}, {64, 256, 96},
    {33, 600, 65},  {20, 800, 40},  {130, 257, 70}, {5, 300, 2049}, {1030, 20, 2050},
    /* a LoRA adapter's rank side: C 16 wide over several 28-row panels and k blocks (the
     * forward's N, the backward's K; avx512 runs them on its 28 x 16 tile) */
    {300, 700, 16}, {300, 16, 700},
};

/* matmul_bf16 runs case_matmul too: its reference rounds the inputs to bf16 and
 * sums in fp32, so implementations differ from it only in summation order (fp32
 * tolerance), while one that skipped the rounding is off by ~1e-3. K odd and
 * K = 1 leave half a bf16 pair (vdpbf16ps multiplies pairs along k); 769 and
 * 1537 cross the bf16 kernel's 768-deep k blocks with an odd remainder; M <= 4
 * runs only the 1-, 2- and 4-row variants of the micro-kernel. For the AMX
 * kernel (32 x 32 blocks of 16 x 16 tiles, k in steps of 32, 1024-deep k
 * blocks): 48 x 33 and 17 x 48 leave edge blocks of <= 16 and > 16 rows /
 * columns, K = 513 one k past whole steps, 1025 two k blocks (544 + 481). */
static const int shapes_matmul_bf16[][CHK_DIMS] = {
    {1, 1, 1},     {1, 17, 33},    {3, 1, 5},      {7, 5, 1},      {1, 1023, 3},    {4, 41, 7},   {2, 33, 100},
    {5, 15, 9},    {6, 9, 16},     {14, 31, 32},   {15, 33, 31},   {13, 3, 17},     {29, 65, 47}, {77, 131, 45},
    {64, 256, 96}, {33, 769, 65},  {20, 1537, 40}, {130, 257, 70}, {5, 301, 2049},  {1030, 21, 2050},
    {100, 800, 64}, {48, 513, 33}, {17, 1025, 48},
};

/* ---------------------------------------------------------- embedding */

static void case_embedding(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    int N = s[0], C = s[1], V = s[2];
    size_t nc = (size_t)N * C, vc = (size_t)V * C;
    int32_t *tok = ct_malloc((size_t)N * sizeof(int32_t));
    for (int i = 0; i < N; i++) tok[i] = (int32_t)(rng_next(r) % (uint64_t)V); /* V small: repeats */
    float *wte = fbuf(vc), *o1 = fbuf(nc), *o2 = fbuf(nc), *dout = fbuf(nc);
    fill(wte, vc, r, -1, 1);
    fill(dout, nc, r, -1, 1);
    fill_nan(o1, nc);
    fill_nan(o2, nc);
    ref->fn.embedding.fwd(o1, tok, wte, N, C);
    im->fn.embedding.fwd(o2, tok, wte, N, C);
    part(c, "fwd", rel_err(o2, o1, nc));
    float *d1 = fbuf(vc);
    fill(d1, vc, r, -1, 1);
    float *d2 = dup(d1, vc);
    ref->fn.embedding.bwd(d1, dout, tok, N, C);
    im->fn.embedding.bwd(d2, dout, tok, N, C);
    part(c, "dwte+=", rel_err(d2, d1, vc));
    free(tok), free(wte), free(o1), free(o2), free(dout), free(d1), free(d2);
}

static const int shapes_embedding[][CHK_DIMS] = {{1, 1, 1}, {5, 7, 3}, {17, 16, 4}, {64, 33, 10}, {33, 256, 100},
                                          {9, 130, 6}};

/* ------------------------------------------------------------ rmsnorm */

static void case_rmsnorm(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    int N = s[0], C = s[1];
    size_t nc = (size_t)N * C;
    float eps = 1e-6f;
    float *x = fbuf(nc), *w = fbuf((size_t)C), *dout = fbuf(nc);
    fill(x, nc, r, -2, 2);
    fill(w, (size_t)C, r, 0.5f, 1.5f);
    fill(dout, nc, r, -1, 1);
    float *o1 = fbuf(nc), *o2 = fbuf(nc), *rs1 = fbuf((size_t)N), *rs2 = fbuf((size_t)N);
    fill_nan(o1, nc);
    fill_nan(o2, nc);
    ref->fn.rmsnorm.fwd(o1, rs1, x, w, N, C, eps);
    im->fn.rmsnorm.fwd(o2, rs2, x, w, N, C, eps);
    part(c, "fwd", rel_err(o2, o1, nc));
    part(c, "rstd", rel_err(rs2, rs1, (size_t)N));
    float *di1 = fbuf(nc), *dw1 = fbuf((size_t)C);
    fill(di1, nc, r, -1, 1);
    fill(dw1, (size_t)C, r, -1, 1);
    float *di2 = dup(di1, nc), *dw2 = dup(dw1, (size_t)C);
    ref->fn.rmsnorm.bwd(di1, dw1, dout, x, w, rs1, N, C);
    im->fn.rmsnorm.bwd(di2, dw2, dout, x, w, rs1, N, C);
    part(c, "dinp+=", rel_err(di2, di1, nc));
    part(c, "dw+=", rel_err(dw2, dw1, (size_t)C));
    ref->fn.rmsnorm.bwd(di1, NULL, dout, x, w, rs1, N, C);
    im->fn.rmsnorm.bwd(di2, NULL, dout, x, w, rs1, N, C);
    part(c, "dw=NULL", rel_err(di2, di1, nc));
    /* a zero-bubble pipeline's split backward: I (bwd with dw NULL) then W (bwd_w) gives
     * the fused bwd's bits, from the same starting dw (model/lm.h, lm_wstore) */
    float *fw = fbuf((size_t)C), *sw = fbuf((size_t)C);
    fill(fw, (size_t)C, r, -1, 1);
    memcpy(sw, fw, (size_t)C * sizeof(float));
    memcpy(di1, di2, nc * sizeof(float));
    im->fn.rmsnorm.bwd(di1, fw, dout, x, w, rs1, N, C);
    im->fn.rmsnorm.bwd(di2, NULL, dout, x, w, rs1, N, C);
    if (im->fn.rmsnorm.bwd_w) im->fn.rmsnorm.bwd_w(sw, dout, x, rs1, N, C);
    part(c, "I then W dinp", bits_err(di2, di1, nc));
    part(c, "I then W dw", im->fn.rmsnorm.bwd_w ? bits_err(sw, fw, (size_t)C) : INFINITY); /* none: a split fails */
    free(fw), free(sw);
    free(x), free(w), free(dout), free(o1), free(o2), free(rs1), free(rs2), free(di1), free(dw1), free(di2),
        free(dw2);
}

static const int shapes_rmsnorm[][CHK_DIMS] = {{1, 1}, {3, 7}, {5, 17}, {2, 15}, {16, 256}, {7, 1000}, {40, 128}};

/* --------------------------------------------------------------- rope */

static void case_rope(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    /* s[4]: the rotated features rd (partial_rotary_factor); 0 is the whole head */
    int B = s[0], T = s[1], nh = s[2], hd = s[3], rd = s[4] ? s[4] : s[3];
    size_t n = (size_t)B * T * nh * hd, nt = (size_t)T * (hd / 2);
    float *cs = fbuf(nt), *sn = fbuf(nt);
    op_rope_tables(cs, sn, T, rd, 1e6f); /* [T, rd/2] */
    float *x = fbuf(n), *dout = fbuf(n);
    fill(x, n, r, -1, 1);
    fill(dout, n, r, -1, 1);
    float *o1 = fbuf(n), *o2 = fbuf(n);
    fill_nan(o1, n);
    fill_nan(o2, n);
    ref->fn.rope.fwd(o1, x, cs, sn, B, T, nh, hd, rd);
    im->fn.rope.fwd(o2, x, cs, sn, B, T, nh, hd, rd);
    part(c, "fwd", rel_err(o2, o1, n));
    float *ip = dup(x, n);
    im->fn.rope.fwd(ip, ip, cs, sn, B, T, nh, hd, rd);
    part(c, "fwd-inplace", rel_err(ip, o1, n));
    float *d1 = fbuf(n);
    fill(d1, n, r, -1, 1);
    float *d2 = dup(d1, n);
    ref->fn.rope.bwd(d1, dout, cs, sn, B, T, nh, hd, rd);
    im->fn.rope.bwd(d2, dout, cs, sn, B, T, nh, hd, rd);
    part(c, "dinp+=", rel_err(d2, d1, n));
    memcpy(d1, dout, n * sizeof(float));
    memcpy(d2, dout, n * sizeof(float));
    ref->fn.rope.bwd(d1, d1, cs, sn, B, T, nh, hd, rd);
    im->fn.rope.bwd(d2, d2, cs, sn, B, T, nh, hd, rd);
    part(c, "bwd-inplace", rel_err(d2, d1, n));
    /* the fused per-head q/k RMSNorm + RoPE of the same entry: whole heads only
     * (no family with a per-head q/k norm honours partial_rotary_factor) */
    op_rope_tables(cs, sn, T, hd, 1e6f);
    size_t rows = (size_t)B * T * nh;
    float eps = 1e-6f;
    float *w = fbuf((size_t)hd), *rs1 = fbuf(rows), *rs2 = fbuf(rows);
    fill(w, (size_t)hd, r, 0.5f, 1.5f);
    fill(x, n, r, -2, 2);
    fill_nan(o1, n);
    fill_nan(o2, n);
    fill_nan(rs1, rows);
    fill_nan(rs2, rows);
    ref->fn.rope.qknorm_fwd(o1, rs1, x, w, cs, sn, B, T, nh, hd, eps);
    im->fn.rope.qknorm_fwd(o2, rs2, x, w, cs, sn, B, T, nh, hd, eps);
    part(c, "qkn", rel_err(o2, o1, n));
    part(c, "qkn-rstd", rel_err(rs2, rs1, rows));
    float *dw1 = fbuf((size_t)hd);
    fill(d1, n, r, -1, 1);
    fill(dw1, (size_t)hd, r, -1, 1);
    memcpy(d2, d1, n * sizeof(float));
    float *dw2 = dup(dw1, (size_t)hd);
    ref->fn.rope.qknorm_bwd(d1, dw1, dout, x, w, rs1, cs, sn, B, T, nh, hd, 1);
    im->fn.rope.qknorm_bwd(d2, dw2, dout, x, w, rs1, cs, sn, B, T, nh, hd, 1);
    part(c, "qkn-dx+=", rel_err(d2, d1, n));
    part(c, "qkn-dw+=", rel_err(dw2, dw1, (size_t)hd));
    ref->fn.rope.qknorm_bwd(d1, NULL, dout, x, w, rs1, cs, sn, B, T, nh, hd, 1);
    im->fn.rope.qknorm_bwd(d2, NULL, dout, x, w, rs1, cs, sn, B, T, nh, hd, 1);
    part(c, "qkn-dw=NULL", rel_err(d2, d1, n));
    /* acc 0 overwrites dx: into NaN, the bits of acc 1 onto zeros; dw still adds */
    memset(d1, 0, n * sizeof(float));
    fill_nan(d2, n);
    memcpy(dw1, dw2, (size_t)hd * sizeof(float));
    im->fn.rope.qknorm_bwd(d1, dw1, dout, x, w, rs1, cs, sn, B, T, nh, hd, 1);
    im->fn.rope.qknorm_bwd(d2, dw2, dout, x, w, rs1, cs, sn, B, T, nh, hd, 0);
    part(c, "qkn-dx=", bits_err(d2, d1, n));
    part(c, "qkn-dw", bits_err(dw2, dw1, (size_t)hd));
    /* the split backward, as rmsnorm's: I (dw NULL) then W (qknorm_bwd_w) is the fused call */
    memcpy(dw1, dw2, (size_t)hd * sizeof(float));
    memcpy(d1, d2, n * sizeof(float));
    im->fn.rope.qknorm_bwd(d1, dw1, dout, x, w, rs1, cs, sn, B, T, nh, hd, 1);
    im->fn.rope.qknorm_bwd(d2, NULL, dout, x, w, rs1, cs, sn, B, T, nh, hd, 1);
    if (im->fn.rope.qknorm_bwd_w) im->fn.rope.qknorm_bwd_w(dw2, dout, x, rs1, cs, sn, B, T, nh, hd);
    part(c, "qkn I then W dx", bits_err(d2, d1, n));
    part(c, "qkn I then W dw", im->fn.rope.qknorm_bwd_w ? bits_err(dw2, dw1, (size_t)hd) : INFINITY);
    free(cs), free(sn), free(x), free(dout), free(o1), free(o2), free(ip), free(d1), free(d2);
    free(w), free(rs1), free(rs2), free(dw1), free(dw2);
}

static const int shapes_rope[][CHK_DIMS] = {{1, 1, 1, 2}, {2, 3, 2, 4},    {1, 5, 3, 34},
                                     {2, 7, 4, 128}, {1, 17, 1, 30}, {3, 9, 5, 66},
                                     /* several 64-row blocks of the fused backward's dw, the last partial */
                                     {2, 40, 3, 16},
                                     /* partial rotation (s[4] = rd < hd): Phi-4-mini's 96 of 128, a
                                      * pass-through tail shorter and longer than a vector, rd/2 not
                                      * a multiple of the vector width, rd = 2 */
                                     {2, 7, 4, 128, 96}, {1, 5, 3, 34, 24}, {1, 17, 1, 30, 16},
                                     {2, 3, 2, 40, 20}, {3, 9, 5, 66, 2}, {1, 4, 2, 64, 32}};

/* ---------------------------------------------------------- attention */

/* The attention variants of the model families (kern_attn_opt), s[5] of a
 * shape: 0 is NULL (Qwen3: 1/sqrt(hd), causal, no cap). Windows of 1 (only the
 * diagonal), smaller than a key tile (64) and than a query block, not a
 * multiple of either, about a tile, larger than the sequence; a scale other
 * than 1/sqrt(hd) (Gemma's query_pre_attn_scalar); soft caps that bite
 * (scores are up to ~|q||k| / sqrt(hd) ~ 10 on these inputs, so a cap of 2 or 5
 * saturates tanh on many, and one of 50, Gemma 2's, hardly); and their
 * combinations. */
static const struct {
    const char *name;
    kern_attn_opt opt;
} attn_opts[] = {
    {"default", {0, 0, 0, 0}},        {"w1", {0, 1, 0, 0}},         {"w5", {0, 5, 0, 0}},
    {"w37", {0, 37, 0, 0}},           {"w64", {0, 64, 0, 0}},       {"w100", {0, 100, 0, 0}},
    {"w4096", {0, 4096, 0, 0}},       {"sc0.3", {0.3f, 0, 0, 0}},   {"cap2", {0, 0, 2.0f, 0}},
    {"cap50", {0, 0, 50.0f, 0}},      {"w7+cap5", {0, 7, 5.0f, 0}}, {"w70+sc0.2+cap3", {0.2f, 70, 3.0f, 0}},
    {"w3+sc1", {1.0f, 3, 0, 0}},      {"allzero", {0, 0, 0, 0}},
    /* bf16 products (kern_attn_opt.bf16): inputs drawn as bf16 values, P and dS rounded */
    {"bf16", {0, 0, 0, 1}},        {"bf16+w37+cap5", {0, 37, 5.0f, 1}}, {"bf16+sc0.3", {0.3f, 0, 0, 1}},
};
#define ATT_OPT_NULL 0    /* index of the NULL pointer case */

/* The whole-sequence pair (q0form 0, Tq = Tk) or the offset form's (ops.h: the
 * last Tq of Tk positions) of an entry. */
static void att_fwd_of(const kern_impl *im, int q0form, float *out, float *lse, const float *q, const float *k,
                       const float *v, int B, int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt) {
    if (q0form) im->fn.attention.fwd_q0(out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt);
    else im->fn.attention.fwd(out, lse, q, k, v, B, Tk, nh, nkv, hd, opt);
}
static void att_bwd_of(const kern_impl *im, int q0form, float *dq, float *dk, float *dv, const float *dout,
                       const float *out, const float *lse, const float *q, const float *k, const float *v, int B,
                       int Tq, int Tk, int nh, int nkv, int hd, const kern_attn_opt *opt, int acc) {
    if (q0form) im->fn.attention.bwd_q0(dq, dk, dv, dout, out, lse, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, acc);
    else im->fn.attention.bwd(dq, dk, dv, dout, out, lse, q, k, v, B, Tk, nh, nkv, hd, opt, acc);
}

/* The block form (ring attention): the sequence of T cut into P = -s[6] pieces, the rows
 * of the last piece and of a middle one against every piece as a block (the ring's order:
 * its own first; pieces in a row's future add nothing), each implementation's forward
 * merging them into acc, m, l from the same start, then its backward of every block from
 * the reference's finished out, lse and D. Strided as the ring's buffers are not: the
 * query side's rows ldq = L + 3 apart per sequence (the padding rows hold values an
 * implementation must leave alone), the blocks' keys read in place in the whole
 * sequence's k, v, dk, dv (ldk = T). */
static void case_attention_blk(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    int B = s[0], T = s[1], nh = s[2], nkv = s[3], hd = s[4], P = -s[6];
    int L = T / P, ldq = L + 3;
    const kern_attn_opt *opt = s[5] == ATT_OPT_NULL ? NULL : &attn_opts[s[5]].opt;
    int w = snprintf(c->detail + c->len, sizeof c->detail - c->len, "[blocks of %d]", L);
    if (w > 0) c->len += (size_t)w;
    if (!im->fn.attention.fwd_blk || !im->fn.attention.bwd_blk) { /* a test's table: kern_impl_complete's */
        w = snprintf(c->detail + c->len, sizeof c->detail - c->len, " no block form of its own");
        if (w > 0) c->len += (size_t)w;
        return;
    }
    if (s[5] != ATT_OPT_NULL) {
        w = snprintf(c->detail + c->len, sizeof c->detail - c->len, "[%s]", attn_opts[s[5]].name);
        if (w > 0) c->len += (size_t)w;
    }
    size_t nq = (size_t)B * ldq * nh * hd, nk = (size_t)B * T * nkv * hd, nl = (size_t)B * nh * ldq;
    float *q = fbuf(nq), *k = fbuf(nk), *v = fbuf(nk), *dout = fbuf(nq);
    fill(q, nq, r, -2, 2);
    fill(k, nk, r, -2, 2);
    fill(v, nk, r, -1, 1);
    fill(dout, nq, r, -1, 1);
    if (kern_attn_bf16(opt)) ct_round_bf16(q, nq), ct_round_bf16(k, nk), ct_round_bf16(v, nk), ct_round_bf16(dout, nq);
    float *a1 = fbuf(nq), *m1 = fbuf(nl), *l1 = fbuf(nl), *D = fbuf(nl);
    float *dq1 = fbuf(nq), *dk1 = fbuf(nk), *dv1 = fbuf(nk);
    int pieces[2] = {P - 1, (P - 1) / 2};
    double mean = 0; /* bf16: the backward's mean error (case_attention's bound) */
    for (int pi = 0; pi < (P > 2 ? 2 : 1); pi++) {
        int qi = pieces[pi], q0 = qi * L;
        fill(a1, nq, r, -1, 1); /* the padding rows' values; the rows start from acc 0, m -inf, l 0 */
        fill(m1, nl, r, 1, 2);
        fill(l1, nl, r, 1, 2);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < nh; h++)
                for (int t = 0; t < L; t++) {
                    size_t row = ((size_t)b * nh + h) * ldq + t;
                    m1[row] = -INFINITY, l1[row] = 0.0f;
                    memset(a1 + (((size_t)b * ldq + t) * nh + h) * hd, 0, (size_t)hd * sizeof(float));
                }
        float *a2 = dup(a1, nq), *m2 = dup(m1, nl), *l2 = dup(l1, nl);
        for (int i = 0; i < P; i++) {
            int bk = (qi + i) % P;
            kern_attn_blk g = {B, nh, nkv, hd, L, q0, ldq, L, bk * L, T};
            size_t ko = (size_t)bk * L * nkv * hd;
            ref->fn.attention.fwd_blk(a1, m1, l1, q, k + ko, v + ko, &g, opt);
            im->fn.attention.fwd_blk(a2, m2, l2, q, k + ko, v + ko, &g, opt);
        }
        part(c, pi ? "acc'" : "acc", rel_err(a2, a1, nq));
        part(c, pi ? "m'" : "m", rel_err(m2, m1, nl));
        part(c, pi ? "l'" : "l", rel_err(l2, l1, nl));
        kern_attn_blk gq = {B, nh, nkv, hd, L, q0, ldq, 0, 0, T};
        op_attention_blk_finish(a1, m1, l1, &gq); /* the reference's out and lse */
        fill(D, nl, r, -1, 1);
        op_attention_blk_rowdot(D, dout, a1, &gq);
        fill(dq1, nq, r, -1, 1);
        fill(dk1, nk, r, -1, 1);
        fill(dv1, nk, r, -1, 1);
        float *dq2 = dup(dq1, nq), *dk2 = dup(dk1, nk), *dv2 = dup(dv1, nk);
        for (int i = 0; i < P; i++) {
            int bk = (qi + i) % P;
            kern_attn_blk g = {B, nh, nkv, hd, L, q0, ldq, L, bk * L, T};
            size_t ko = (size_t)bk * L * nkv * hd;
            ref->fn.attention.bwd_blk(dq1, dk1 + ko, dv1 + ko, dout, m1, D, q, k + ko, v + ko, &g, opt);
            im->fn.attention.bwd_blk(dq2, dk2 + ko, dv2 + ko, dout, m1, D, q, k + ko, v + ko, &g, opt);
        }
        part(c, pi ? "dq+='" : "dq+=", rel_err(dq2, dq1, nq));
        part(c, pi ? "dk+='" : "dk+=", rel_err(dk2, dk1, nk));
        part(c, pi ? "dv+='" : "dv+=", rel_err(dv2, dv1, nk));
        const float *got[] = {dq2, dk2, dv2}, *want[] = {dq1, dk1, dv1};
        size_t len[] = {nq, nk, nk};
        for (int i = 0; i < 3; i++) {
            double e = mean_err(got[i], want[i], len[i]);
            if (!(e <= mean)) mean = e;
        }
        free(a2), free(m2), free(l2), free(dq2), free(dk2), free(dv2);
    }
    if (kern_attn_bf16(opt)) { /* the rounding of P and dS: dense errors, as in case_attention */
        c->worst_mean = mean;
        c->tol = KERN_ATTN_BF16_TOL;
        w = snprintf(c->detail + c->len, sizeof c->detail > c->len ? sizeof c->detail - c->len : 0, "  mean %.1e",
                     mean);
        if (w > 0) c->len += (size_t)w;
    }
    free(q), free(k), free(v), free(dout), free(a1), free(m1), free(l1), free(D);
    free(dq1), free(dk1), free(dv1);
}

/* s: B T nh nkv hd, the options (attn_opts[]), and Tq: 0 for the whole-sequence
 * pair, else the offset form's query rows (the last Tq of the T positions; at
 * most T, which --quick may have capped). */
static void case_attention(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    if (s[6] < 0) { /* the block form's case */
        case_attention_blk(c, ref, im, s, r);
        return;
    }
    int B = s[0], Tk = s[1], nh = s[2], nkv = s[3], hd = s[4], q0form = s[6] > 0;
    int Tq = q0form ? (s[6] < Tk ? s[6] : Tk) : Tk;
    const kern_attn_opt *opt = s[5] == ATT_OPT_NULL ? NULL : &attn_opts[s[5]].opt;
    if (q0form) { /* the offset form's rows, before the options and the errors */
        int w = snprintf(c->detail + c->len, sizeof c->detail - c->len, "[Tq=%d q0=%d]", Tq, Tk - Tq);
        if (w > 0) c->len += (size_t)w;
        if (!im->fn.attention.fwd_q0 || !im->fn.attention.bwd_q0) { /* a test's table: kern_impl_complete's */
            w = snprintf(c->detail + c->len, sizeof c->detail - c->len, " no offset form of its own");
            if (w > 0) c->len += (size_t)w;
            return;
        }
    }
    if (s[5] != ATT_OPT_NULL) { /* the options of the case, before the errors */
        int w = snprintf(c->detail + c->len, sizeof c->detail - c->len, "[%s]", attn_opts[s[5]].name);
        if (w > 0) c->len += (size_t)w;
    }
    size_t nq = (size_t)B * Tq * nh * hd, nk = (size_t)B * Tk * nkv * hd, np = (size_t)B * nh * Tq; // np: lse
    float *q = fbuf(nq), *k = fbuf(nk), *v = fbuf(nk), *dout = fbuf(nq);
    fill(q, nq, r, -2, 2);
    fill(k, nk, r, -2, 2);
    fill(v, nk, r, -1, 1);
    fill(dout, nq, r, -1, 1);
    if (kern_attn_bf16(opt)) { /* the contract: bf16 values in */
        ct_round_bf16(q, nq), ct_round_bf16(k, nk);
        ct_round_bf16(v, nk), ct_round_bf16(dout, nq);
    }
    float *o1 = fbuf(nq), *o2 = fbuf(nq), *p1 = fbuf(np), *p2 = fbuf(np);
    fill_nan(o1, nq);
    fill_nan(o2, nq);
    fill_nan(p1, np);
    fill_nan(p2, np);
    att_fwd_of(ref, q0form, o1, p1, q, k, v, B, Tq, Tk, nh, nkv, hd, opt);
    att_fwd_of(im, q0form, o2, p2, q, k, v, B, Tq, Tk, nh, nkv, hd, opt);
    part(c, "fwd", rel_err(o2, o1, nq));
    part(c, "lse", rel_err(p2, p1, np));
    float *dq1 = fbuf(nq), *dk1 = fbuf(nk), *dv1 = fbuf(nk);
    fill(dq1, nq, r, -1, 1);
    fill(dk1, nk, r, -1, 1);
    fill(dv1, nk, r, -1, 1);
    float *dq2 = dup(dq1, nq), *dk2 = dup(dk1, nk), *dv2 = dup(dv1, nk);
    /* both backwards read the reference's out and lse, so only the backward is compared */
    att_bwd_of(ref, q0form, dq1, dk1, dv1, dout, o1, p1, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, 1);
    att_bwd_of(im, q0form, dq2, dk2, dv2, dout, o1, p1, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, 1);
    part(c, "dq+=", rel_err(dq2, dq1, nq));
    part(c, "dk+=", rel_err(dk2, dk1, nk));
    part(c, "dv+=", rel_err(dv2, dv1, nk));
    /* acc 0 overwrites: into NaN (a read of it shows), the bits of acc 1 onto zeros (the
     * offset form: every dk, dv row, those of the first q0 positions too) */
    float *dq3 = fbuf(nq), *dk3 = fbuf(nk), *dv3 = fbuf(nk), *dq4 = fbuf(nq), *dk4 = fbuf(nk), *dv4 = fbuf(nk);
    memset(dq3, 0, nq * sizeof(float)), memset(dk3, 0, nk * sizeof(float)), memset(dv3, 0, nk * sizeof(float));
    fill_nan(dq4, nq), fill_nan(dk4, nk), fill_nan(dv4, nk);
    att_bwd_of(im, q0form, dq3, dk3, dv3, dout, o1, p1, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, 1);
    att_bwd_of(im, q0form, dq4, dk4, dv4, dout, o1, p1, q, k, v, B, Tq, Tk, nh, nkv, hd, opt, 0);
    part(c, "dq=", bits_err(dq4, dq3, nq));
    part(c, "dk=", bits_err(dk4, dk3, nk));
    part(c, "dv=", bits_err(dv4, dv3, nk));
    if (kern_attn_bf16(opt)) { /* the rounding of P and dS: dense errors (KERN_CHECK_MEAN_TOL) */
        double m = 0;
        const float *got[] = {dq2, dk2, dv2}, *want[] = {dq1, dk1, dv1};
        size_t len[] = {nq, nk, nk};
        for (int i = 0; i < 3; i++) {
            double e = mean_err(got[i], want[i], len[i]);
            if (!(e <= m)) m = e;
        }
        c->worst_mean = m;
        c->tol = KERN_ATTN_BF16_TOL;
        int w = snprintf(c->detail + c->len, sizeof c->detail > c->len ? sizeof c->detail - c->len : 0,
                         "  mean %.1e", m);
        if (w > 0) c->len += (size_t)w;
    }
    free(q), free(k), free(v), free(dout), free(o1), free(o2), free(p1), free(p2);
    free(dq1), free(dk1), free(dv1), free(dq2), free(dk2), free(dv2);
    free(dq3), free(dk3), free(dv3), free(dq4), free(dk4), free(dv4);
}

/* B T nh nkv hd opt Tq (opt: attn_opts[]; Tq: case_attention, < 0: case_attention_blk) */
static const int shapes_attention[][CHK_DIMS] = {
    {1, 1, 1, 1, 1}, {1, 3, 2, 1, 4}, {2, 5, 4, 2, 17}, {1, 33, 4, 4, 16}, {1, 64, 16, 8, 128}, {2, 17, 3, 1, 8},
    /* across the 32 x 64 tiles: partial blocks, several key blocks per row, diagonal inside a block */
    {1, 65, 2, 1, 8}, {1, 97, 2, 2, 5}, {2, 130, 4, 2, 16}, {1, 200, 1, 1, 3},
    /* head dims of the register-blocked kernel (multiples of 64): partial 4-row micro-blocks, partial
     * key tiles with fewer than 4 keys left, several query and key tiles */
    {1, 97, 4, 2, 64}, {2, 70, 2, 1, 128}, {1, 130, 2, 2, 64}, {1, 5, 2, 1, 64}, {1, 66, 1, 1, 192},
    /* the options, with GQA and T past whole tiles: hd 64/128 (blocked_avx512 and blocked_avx2),
     * 16/48 (blocked_avx2, and the tiled fallback of blocked_avx512), 24/5 (the tiled fallbacks of both;
     * blocked_neon runs every multiple of 8, so 24 too, and falls back for 5 and 7) */
    {1, 200, 4, 2, 64, 1},   {2, 150, 4, 2, 16, 1},  {1, 9, 2, 1, 5, 1},
    {1, 200, 4, 2, 64, 2},   {1, 97, 2, 1, 128, 2},  {2, 150, 4, 2, 48, 2},  {1, 70, 3, 1, 24, 2},
    {1, 260, 2, 1, 64, 3},   {2, 150, 4, 2, 16, 3},  {1, 97, 2, 2, 5, 3},
    {1, 200, 2, 1, 64, 4},   {1, 150, 4, 2, 32, 4},
    {1, 260, 4, 2, 64, 5},   {2, 150, 4, 2, 16, 5},  {1, 150, 2, 1, 24, 5},  {1, 70, 2, 1, 128, 5},
    {1, 97, 4, 2, 64, 6},    {1, 33, 2, 1, 16, 6},   {1, 3, 2, 1, 5, 6},
    {1, 130, 4, 2, 64, 7},   {2, 97, 4, 2, 16, 7},   {1, 65, 2, 1, 24, 7},
    {1, 130, 4, 2, 64, 8},   {2, 97, 4, 2, 16, 8},   {1, 65, 2, 1, 24, 8},   {1, 70, 2, 1, 128, 8},
    {1, 130, 4, 2, 64, 9},   {2, 97, 4, 2, 16, 9},
    {1, 200, 4, 2, 64, 10},  {2, 150, 4, 2, 16, 10}, {1, 97, 2, 1, 24, 10},  {1, 70, 2, 1, 128, 10},
    {1, 260, 4, 2, 64, 11},  {2, 150, 4, 2, 16, 11}, {1, 150, 2, 1, 5, 11},  {1, 97, 2, 1, 128, 11},
    {1, 97, 4, 2, 64, 12},   {2, 70, 4, 2, 16, 12},  {1, 40, 2, 1, 7, 12},
    {1, 97, 4, 2, 64, 13},   {2, 70, 4, 2, 16, 13},  {1, 40, 2, 1, 7, 13},
    /* blocked_neon (12-row micro-blocks, 48-row blocks, 8-key chunks, hd % 8 == 0; the cases above
     * give it hd 8 to 192 and its tiled fallback hd 1 to 17): hd 40 and 80 (multiples of 8, not of
     * 16), T one past a block (49), one micro-block and one past it (12, 13), a group of 3 query
     * heads; hd 12 (a multiple of 4 only: the fallback) */
    {2, 49, 6, 2, 40},       {1, 12, 2, 1, 40, 8},   {1, 13, 3, 1, 40, 9},   {1, 61, 3, 1, 8, 2},
    {1, 130, 6, 2, 80, 11},  {1, 100, 2, 1, 12, 3},
    /* bf16 products: W3's head (hd 128, T 256), odd T and rows (pairs of rows and keys past the
     * end), partial micro-blocks, GQA groups; every kernel's fallback head dims (16, 24, 40, 5) */
    {2, 256, 4, 2, 128, 14}, {1, 97, 4, 2, 64, 14},  {1, 5, 2, 1, 64, 14},   {2, 70, 3, 1, 128, 14},
    {1, 130, 2, 2, 192, 14}, {2, 150, 4, 2, 16, 14}, {1, 49, 6, 2, 40, 14},  {1, 33, 2, 1, 5, 14},
    {1, 200, 4, 2, 64, 15},  {1, 97, 2, 1, 128, 15}, {2, 70, 4, 2, 24, 15},
    {1, 1, 1, 1, 64, 14},    {1, 2, 2, 1, 128, 15},  {1, 70, 2, 1, 256, 14}, /* one and two rows; hd 256 */
    {1, 130, 4, 2, 64, 16},  {2, 130, 4, 2, 128, 16}, {1, 40, 4, 2, 16, 16},
    /* the offset form, s[6] = Tq (the last Tq of T positions; q0 = T - Tq): q0 0 (the whole
     * sequence, one row), the last row alone, context parallel's chunks (half, a quarter, the
     * second and fourth of four) with q0 and Tq inside tiles and on their edges, windows that
     * reach back past q0 and ones that do not, scale, soft caps, GQA groups of 1-3, bf16 */
    {1, 1, 1, 1, 1, 0, 1},       {1, 5, 2, 1, 4, 0, 1},       {1, 130, 2, 1, 8, 0, 130},
    {2, 64, 4, 2, 16, 0, 32},    {2, 96, 4, 2, 16, 0, 24},    {1, 128, 2, 2, 64, 0, 64},
    {1, 200, 4, 2, 64, 0, 50},   {3, 33, 6, 2, 8, 0, 11},     {1, 70, 2, 1, 128, 1, 3},
    {2, 150, 4, 2, 16, 2, 37},   {1, 260, 4, 2, 64, 3, 100},  {1, 200, 2, 1, 64, 4, 33},
    {2, 97, 4, 2, 16, 5, 60},    {1, 130, 4, 2, 64, 7, 65},   {2, 97, 4, 2, 16, 8, 40},
    {1, 150, 2, 1, 24, 10, 75},  {1, 260, 4, 2, 64, 11, 130}, {1, 40, 2, 1, 7, 12, 13},
    {1, 128, 4, 2, 128, 14, 32}, {2, 150, 4, 2, 16, 15, 50},  {1, 97, 2, 1, 64, 16, 31},
    /* the block form, s[6] = -P (case_attention_blk: the last of P pieces against each): pieces
     * inside a tile and across several, windows that skip whole blocks, caps, bf16 */
    {1, 12, 2, 1, 5, 0, -4},     {1, 128, 4, 2, 64, 0, -4},   {2, 150, 4, 2, 16, 3, -2},
    {1, 200, 2, 1, 128, 11, -4}, {1, 260, 4, 2, 64, 7, -2},   {2, 66, 3, 1, 24, 10, -3},
    {1, 97, 4, 2, 64, 14, -3},   {1, 130, 4, 2, 64, 16, -2},
    /* blocks past one key tile (64) and two query tiles, crossing tile edges (q0, k0 not
     * multiples of 64), GQA groups of 3, windows crossing block edges, caps, bf16; the
     * register-blocked kernels' head dims (64, 128) */
    {2, 280, 6, 2, 64, 0, -2},   {1, 390, 3, 1, 128, 3, -3},  {1, 400, 6, 2, 64, 5, -4},
    {2, 210, 3, 1, 64, 10, -3},  {1, 300, 6, 2, 128, 11, -2}, {1, 276, 6, 2, 64, 8, -3},
    {2, 280, 6, 2, 64, 14, -2},  {1, 390, 3, 1, 128, 15, -3}, {1, 200, 6, 2, 64, 16, -4},
};

/* ------------------------------------------------------------- swiglu */

/* A gated activation's backward with acc 0 (swiglu, geglu: one signature):
 * into NaN (a read of it shows), the bits of the same backward's acc 1 onto
 * zeros. dg1, du1, dg2, du2 [N] are scratch. */
static void glu_bwd_overwrite(chk_case *c, kern_swiglu_bwd_fn bwd, float *dg1, float *du1, float *dg2, float *du2,
                              const float *dout, const float *g, const float *u, int N) {
    size_t n = (size_t)N;
    memset(dg1, 0, n * sizeof(float)), memset(du1, 0, n * sizeof(float));
    fill_nan(dg2, n), fill_nan(du2, n);
    bwd(dg1, du1, dout, g, u, N, 1);
    bwd(dg2, du2, dout, g, u, N, 0);
    part(c, "dgate=", bits_err(dg2, dg1, n));
    part(c, "dup=", bits_err(du2, du1, n));
}

static void case_swiglu(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    int N = s[0];
    size_t n = (size_t)N;
    float *g = fbuf(n), *u = fbuf(n), *dout = fbuf(n);
    fill(g, n, r, -6, 6);
    fill(u, n, r, -2, 2);
    fill(dout, n, r, -1, 1);
    float *o1 = fbuf(n), *o2 = fbuf(n);
    fill_nan(o1, n);
    fill_nan(o2, n);
    ref->fn.swiglu.fwd(o1, g, u, N);
    im->fn.swiglu.fwd(o2, g, u, N);
    part(c, "fwd", rel_err(o2, o1, n));
    float *dg1 = fbuf(n), *du1 = fbuf(n);
    fill(dg1, n, r, -1, 1);
    fill(du1, n, r, -1, 1);
    float *dg2 = dup(dg1, n), *du2 = dup(du1, n);
    ref->fn.swiglu.bwd(dg1, du1, dout, g, u, N, 1);
    im->fn.swiglu.bwd(dg2, du2, dout, g, u, N, 1);
    part(c, "dgate+=", rel_err(dg2, dg1, n));
    part(c, "dup+=", rel_err(du2, du1, n));
    glu_bwd_overwrite(c, im->fn.swiglu.bwd, dg1, du1, dg2, du2, dout, g, u, N);
    free(g), free(u), free(dout), free(o1), free(o2), free(dg1), free(du1), free(dg2), free(du2);
}

static const int shapes_swiglu[][CHK_DIMS] = {{1}, {7}, {15}, {16}, {17}, {33}, {1000}, {4099}};

/* -------------------------------------------------------------- geglu */

static void case_geglu(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    int N = s[0];
    size_t n = (size_t)N;
    float *g = fbuf(n), *u = fbuf(n), *dout = fbuf(n);
    /* gelu's knee and both tails: x^3 makes u = 0.8 (x + 0.045 x^3) large by |x| = 6; the first
     * element keeps max |ref| away from 0 (the far negative tail is 0 in torch's formula, and a
     * last-ulp difference of tanh there is no error worth an infinite relative one) */
    fill(g, n, r, -7, 7);
    fill(u, n, r, -2, 2);
    g[0] = 1.5f, u[0] = 1.0f;
    if (n > 4) g[1] = 12.0f, g[2] = -12.0f, g[3] = -30.0f, g[4] = 0.0f;
    fill(dout, n, r, -1, 1);
    float *o1 = fbuf(n), *o2 = fbuf(n);
    fill_nan(o1, n);
    fill_nan(o2, n);
    ref->fn.geglu.fwd(o1, g, u, N);
    im->fn.geglu.fwd(o2, g, u, N);
    part(c, "fwd", rel_err(o2, o1, n));
    float *dg1 = fbuf(n), *du1 = fbuf(n);
    fill(dg1, n, r, -1, 1);
    fill(du1, n, r, -1, 1);
    float *dg2 = dup(dg1, n), *du2 = dup(du1, n);
    ref->fn.geglu.bwd(dg1, du1, dout, g, u, N, 1);
    im->fn.geglu.bwd(dg2, du2, dout, g, u, N, 1);
    part(c, "dgate+=", rel_err(dg2, dg1, n));
    part(c, "dup+=", rel_err(du2, du1, n));
    glu_bwd_overwrite(c, im->fn.geglu.bwd, dg1, du1, dg2, du2, dout, g, u, N);
    free(g), free(u), free(dout), free(o1), free(o2), free(dg1), free(du1), free(dg2), free(du2);
}

static const int shapes_geglu[][CHK_DIMS] = {{1}, {5}, {7}, {15}, {16}, {17}, {33}, {1000}, {4099}};

/* ------------------------------------------------------- crossentropy */

/* The vocabulary-parallel phases on this rank's columns [v0, v0 + V): each
 * phase gets the same inputs on both sides (the reference's outputs of the
 * phase before, made "global" as other ranks would: a larger max on odd
 * rows, more exponentials in the sums, the target logit from another rank
 * where this one does not hold the target). Targets cycle through this
 * rank's columns, another rank's, -100, and anywhere in [v0 - V, v0 + 2V). */
static void case_crossentropy_vp(chk_case *c, const kern_impl *ref, const kern_impl *im, const float *logits, int N,
                                 int V, int v0, chk_rng *r) {
    size_t nv = (size_t)N * V, n = (size_t)N;
    int32_t *tgt = ct_malloc((n ? n : 1) * sizeof(int32_t));
    int lo = v0 > V ? v0 - V : 0;
    for (int i = 0; i < N; i++) {
        uint64_t u = rng_next(r);
        switch (i % 4) {
        case 0: tgt[i] = v0 + (int32_t)(u % (uint64_t)V); break;
        case 1: tgt[i] = v0 > 0 ? (int32_t)(u % (uint64_t)v0) : v0 + V + (int32_t)(u % (uint64_t)V); break;
        case 2: tgt[i] = -100; break;
        default: tgt[i] = lo + (int32_t)(u % (uint64_t)(v0 + 2 * V - lo)); break;
        }
    }
    float *mx1 = fbuf(n), *mx2 = fbuf(n), *se1 = fbuf(n), *se2 = fbuf(n), *tl1 = fbuf(n), *tl2 = fbuf(n);
    fill_nan(mx1, n), fill_nan(mx2, n), fill_nan(se1, n), fill_nan(se2, n), fill_nan(tl1, n), fill_nan(tl2, n);
    ref->fn.crossentropy.vp_max(mx1, logits, N, V);
    im->fn.crossentropy.vp_max(mx2, logits, N, V);
    part(c, "vp-max", rel_err(mx2, mx1, n));
    for (int i = 0; i < N; i++) mx1[i] += i % 2 ? 0.5f : 0.0f;
    ref->fn.crossentropy.vp_sums(se1, tl1, logits, mx1, tgt, N, V, v0);
    im->fn.crossentropy.vp_sums(se2, tl2, logits, mx1, tgt, N, V, v0);
    /* The sum is judged by its distance from the exact sum of the reference's
     * terms (summed in double), not from the reference's own fp32 sum: that
     * one runs in column order with one accumulator and drifts from the exact
     * value like sqrt(V) ulps (measured 4.3e-5 of it at V = 151936, 1.6e-5 at
     * 75968), which would hide under any tolerance wide enough to pass it.
     * Error: how much further from exact the implementation is than the
     * reference, per row (0 when at least as accurate), relative to the
     * largest sum; the default 1e-5 applies. The avx512 lane sums measured
     * <= 1.6e-7 from exact over these shapes; 3 lost columns per row fail
     * every shape but V = 151936, where the reference's own drift covers them. */
    double emax = 0, rmax = 0;
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * V;
        double exact = 0;
        for (int j = 0; j < V; j++) exact += (double)expf(x[j] - mx1[i]);
        double excess = fabs(se2[i] - exact) - fabs(se1[i] - exact);
        if (!isfinite(se2[i])) emax = INFINITY;
        else if (excess > emax) emax = excess;
        if (exact > rmax) rmax = exact;
    }
    part(c, "vp-sumexp", emax == 0 ? 0 : emax / rmax);
    part(c, "vp-tlogit", rel_err(tl2, tl1, n));
    for (int i = 0; i < N; i++) {
        se1[i] += i % 2 ? rng_uniform(r, 0.5f, 2.0f) : 0.0f;
        int y = tgt[i] - v0;
        if (tgt[i] != -100 && (y < 0 || y >= V)) tl1[i] = rng_uniform(r, -3.0f, 0.0f);
    }
    float *l1 = dup(logits, nv), *l2 = dup(logits, nv);
    long c1 = 0, c2 = 0;
    float scale = 1.0f / (float)(N > 0 ? N : 1);
    double s1 = ref->fn.crossentropy.vp_grad(l1, mx1, se1, tl1, tgt, N, V, v0, scale, &c1);
    double s2 = im->fn.crossentropy.vp_grad(l2, mx1, se1, tl1, tgt, N, V, v0, scale, &c2);
    part(c, "vp-dlogits", rel_err(l2, l1, nv));
    part(c, "vp-loss", fabs(s2 - s1) / (fabs(s1) > 1 ? fabs(s1) : 1));
    part(c, "vp-n_valid", c1 == c2 ? 0.0 : INFINITY);
    free(tgt), free(mx1), free(mx2), free(se1), free(se2), free(tl1), free(tl2), free(l1), free(l2);
}

static void case_crossentropy(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    int N = s[0], V = s[1], v0 = s[2];
    size_t nv = (size_t)N * V;
    int32_t *tgt = ct_malloc((size_t)N * sizeof(int32_t));
    for (int i = 0; i < N; i++) tgt[i] = (i % 3 == 2) ? -100 : (int32_t)(rng_next(r) % (uint64_t)V);
    float *logits = fbuf(nv);
    fill(logits, nv, r, -4, 4);
    float *l1 = dup(logits, nv), *l2 = dup(logits, nv);
    long c1 = 0, c2 = 0;
    float scale = 1.0f / (float)(N > 0 ? N : 1);
    double s1 = ref->fn.crossentropy.fwdbwd(l1, tgt, N, V, scale, &c1);
    double s2 = im->fn.crossentropy.fwdbwd(l2, tgt, N, V, scale, &c2);
    part(c, "dlogits", rel_err(l2, l1, nv));
    part(c, "loss", fabs(s2 - s1) / (fabs(s1) > 1 ? fabs(s1) : 1));
    part(c, "n_valid", c1 == c2 ? 0.0 : INFINITY);
    float *ls1 = fbuf((size_t)N), *ls2 = fbuf((size_t)N);
    fill_nan(ls1, (size_t)N);
    fill_nan(ls2, (size_t)N);
    s1 = ref->fn.crossentropy.fwd(ls1, logits, tgt, N, V);
    s2 = im->fn.crossentropy.fwd(ls2, logits, tgt, N, V);
    part(c, "fwd-losses", rel_err(ls2, ls1, (size_t)N));
    part(c, "fwd-sum", fabs(s2 - s1) / (fabs(s1) > 1 ? fabs(s1) : 1));
    case_crossentropy_vp(c, ref, im, logits, N, V, v0, r);
    free(tgt), free(logits), free(l1), free(l2), free(ls1), free(ls2);
}

/* v0: the first column of the vocabulary-parallel case (the rank's offset);
 * 75968 is Qwen3's 151936 over two ranks, the second rank's half. */
static const int shapes_crossentropy[][CHK_DIMS] = {{1, 1, 0},     {3, 5, 5},       {4, 17, 17},   {7, 16, 3},
                                             {5, 100, 200}, {8, 2048, 1000}, {3, 151936, 0}, {1, 37, 74},
                                             {9, 75968, 75968}};

/* ---------------------------------------------------------------- add */

static void case_add(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    long N = s[0];
    size_t n = (size_t)N;
    float *a = fbuf(n), *b = fbuf(n), *o1 = fbuf(n), *o2 = fbuf(n);
    fill(a, n, r, -1, 1);
    fill(b, n, r, -1, 1);
    fill_nan(o1, n);
    fill_nan(o2, n);
    ref->fn.add.fwd(o1, a, b, N);
    im->fn.add.fwd(o2, a, b, N);
    part(c, "fwd", rel_err(o2, o1, n));
    float *a2 = dup(a, n);
    im->fn.add.fwd(a2, a2, b, N);
    part(c, "inplace", rel_err(a2, o1, n));
    free(a), free(b), free(o1), free(o2), free(a2);
}

static const int shapes_add[][CHK_DIMS] = {{1}, {15}, {16}, {17}, {1000}, {65537}};

/* -------------------------------------------------------------- adamw */

static void case_adamw(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *s, chk_rng *r) {
    size_t n = (size_t)s[0];
    adamw_hparams h = {.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    float *p1 = fbuf(n), *g1 = fbuf(n);
    fill(p1, n, r, -1, 1);
    float *p2 = dup(p1, n);
    adamw_state s1, s2;
    adamw_init(&s1, n);
    adamw_init(&s2, n);
    /* a clipping coefficient on the middle step (1 = none, as unclipped steps pass) */
    const float gscale[3] = {1.0f, 0.37f, 1.0f};
    double zeroed = 0.0;
    for (int step = 0; step < 3; step++) {
        fill(g1, n, r, -1, 1);
        float *g2 = dup(g1, n); /* each step zeroes its gradients */
        ref->fn.adamw.step(&s1, p1, g1, gscale[step], h.lr, &h);
        im->fn.adamw.step(&s2, p2, g2, gscale[step], h.lr, &h);
        for (size_t i = 0; i < n; i++)
            if (g2[i] != 0.0f) zeroed = INFINITY;
        free(g2);
    }
    part(c, "params", rel_err(p2, p1, n));
    part(c, "m", rel_err(s2.m, s1.m, n));
    part(c, "v", rel_err(s2.v, s1.v, n));
    part(c, "step", s1.step == s2.step ? 0.0 : INFINITY);
    part(c, "grads zeroed", zeroed);
    adamw_free(&s1);
    adamw_free(&s2);
    free(p1), free(g1), free(p2);
}

/* the last at and above ADAMW_PARALLEL_MIN (optim.h): the only one that runs the
 * implementations' parallel path, the others step on one thread */
static const int shapes_adamw[][CHK_DIMS] = {{1}, {15}, {17}, {1000}, {65537}, {ADAMW_PARALLEL_MIN + 37}};

/* -------------------------------------------------------- moe_experts */

/* Routing for the check: token t's k distinct experts drawn from the first
 * `span` experts (mode 0: span E; 1: span k, so every token picks the same
 * k experts and the rest are empty; 2: span max(k, E/2), the upper half
 * empty), then the metadata as model/moe.c builds it (stable counting sort). */
static void moe_check_route(int32_t *perm, int32_t *pos, int32_t *offsets, float *topw, int N, int E, int k, int mode,
                            chk_rng *r) {
    int span = mode == 1 ? k : mode == 2 ? (E / 2 > k ? E / 2 : k) : E;
    int32_t *topi = ct_malloc(((size_t)N * k + 1) * sizeof(int32_t));
    for (int t = 0; t < N; t++)
        for (int j = 0; j < k; j++) {
            int e, dup_;
            do {
                e = (int)(rng_next(r) % (uint64_t)span);
                dup_ = 0;
                for (int i = 0; i < j; i++) dup_ |= topi[t * k + i] == e;
            } while (dup_);
            topi[t * k + j] = e;
            topw[t * k + j] = rng_uniform(r, 0.05f, 1);
        }
    memset(offsets, 0, ((size_t)E + 1) * sizeof(int32_t));
    for (long s = 0; s < (long)N * k; s++) offsets[topi[s] + 1]++;
    for (int e = 0; e < E; e++) offsets[e + 1] += offsets[e];
    int32_t *cur = ct_malloc(((size_t)E + 1) * sizeof(int32_t));
    memcpy(cur, offsets, (size_t)E * sizeof(int32_t));
    for (long s = 0; s < (long)N * k; s++) {
        perm[cur[topi[s]]] = (int32_t)s;
        pos[s] = cur[topi[s]]++;
    }
    free(topi), free(cur);
}

/* The wbf16 pair (expert weights read from a bf16 store), as case_matmul_wbf16
 * does for the matmuls: against the reference's wbf16 pair, and bit for bit
 * against the implementation's own fwd / bwd on the fp32 widening of the same
 * weights, with every weight in bf16 (their fp32 pointers NULL: not read) and
 * with a mix (gate and down in bf16, up in fp32; the weight gradients wanted,
 * as expert LoRA on one projection has them). */
static void case_moe_wbf16(chk_case *c, const kern_impl *ref, const kern_impl *im, int N, int H, int I, int E, int k,
                           const int32_t *perm, const int32_t *pos, const int32_t *off, const float *topw,
                           const float *x, const float *wg, const float *wu, const float *wd, const float *dout,
                           chk_rng *r) {
    if (!im->fn.moe.fwd_wbf16 || !im->fn.moe.bwd_wbf16) {
        part(c, "wbf16 missing", INFINITY);
        return;
    }
    size_t S = (size_t)N * k, nx = (size_t)N * H, nw = (size_t)E * I * H, ns = S * I;
    uint16_t *hw[3];
    float *wr[3];
    const float *w3[3] = {wg, wu, wd};
    for (int j = 0; j < 3; j++) hw[j] = bf16_store_of(w3[j], nw, &wr[j]);
    float *work = fbuf(KERN_MOE_WORK(S, H, I));
    /* forward, every weight in bf16: [0] the reference, [1] the implementation, [2] its fp32 entry on the widening */
    float *o[3], *g[3], *u[3], *hh[3];
    o[0] = fbuf(nx);
    fill(o[0], nx, r, -1, 1);
    o[1] = dup(o[0], nx), o[2] = dup(o[0], nx);
    for (int j = 0; j < 3; j++) {
        g[j] = fbuf(ns), u[j] = fbuf(ns), hh[j] = fbuf(ns);
        fill_nan(g[j], ns), fill_nan(u[j], ns), fill_nan(hh[j], ns);
    }
    ref->fn.moe.fwd_wbf16(o[0], g[0], u[0], hh[0], work, x, NULL, NULL, NULL, hw[0], hw[1], hw[2], perm, pos, off, topw,
                          N, H, I, E, k);
    im->fn.moe.fwd_wbf16(o[1], g[1], u[1], hh[1], work, x, NULL, NULL, NULL, hw[0], hw[1], hw[2], perm, pos, off, topw,
                         N, H, I, E, k);
    im->fn.moe.fwd(o[2], g[2], u[2], hh[2], work, x, wr[0], wr[1], wr[2], perm, pos, off, topw, N, H, I, E, k);
    double e1 = rel_err(o[1], o[0], nx), e2 = rel_err(hh[1], hh[0], ns);
    part(c, "fwd_h", e1 > e2 ? e1 : e2);
    double b = bits_err(o[1], o[2], nx) + bits_err(g[1], g[2], ns) + bits_err(u[1], u[2], ns) +
               bits_err(hh[1], hh[2], ns);
    part(c, "fwd_h=fwd", b);
    /* the mix, out NULL (recomputation) */
    fill_nan(g[1], ns), fill_nan(u[1], ns), fill_nan(hh[1], ns);
    im->fn.moe.fwd_wbf16(NULL, g[1], u[1], hh[1], work, x, NULL, wr[1], NULL, hw[0], NULL, hw[2], perm, pos, off, topw,
                         N, H, I, E, k);
    part(c, "fwd_mix=fwd", bits_err(g[1], g[2], ns) + bits_err(u[1], u[2], ns) + bits_err(hh[1], hh[2], ns));
    /* backward from the fp32 run's activations, every weight in bf16, frozen: dx +=, dtopw = */
    float *dx[3], *dt[3];
    dx[0] = fbuf(nx);
    fill(dx[0], nx, r, -1, 1);
    dx[1] = dup(dx[0], nx), dx[2] = dup(dx[0], nx);
    for (int j = 0; j < 3; j++) dt[j] = fbuf(S), fill_nan(dt[j], S);
    ref->fn.moe.bwd_wbf16(dx[0], NULL, NULL, NULL, dt[0], work, dout, x, NULL, NULL, NULL, hw[0], hw[1], hw[2], g[2],
                          u[2], hh[2], perm, pos, off, topw, N, H, I, E, k);
    im->fn.moe.bwd_wbf16(dx[1], NULL, NULL, NULL, dt[1], work, dout, x, NULL, NULL, NULL, hw[0], hw[1], hw[2], g[2], u[2],
                         hh[2], perm, pos, off, topw, N, H, I, E, k);
    im->fn.moe.bwd(dx[2], NULL, NULL, NULL, dt[2], work, dout, x, wr[0], wr[1], wr[2], g[2], u[2], hh[2], perm, pos, off,
                   topw, N, H, I, E, k);
    e1 = rel_err(dx[1], dx[0], nx), e2 = rel_err(dt[1], dt[0], S);
    part(c, "dx_h+=", e1 > e2 ? e1 : e2);
    part(c, "dx_h=bwd", bits_err(dx[1], dx[2], nx) + bits_err(dt[1], dt[2], S));
    /* the mix with the weight gradients wanted (+=) */
    float *dw1 = fbuf(3 * nw);
    fill(dw1, 3 * nw, r, -1, 1);
    float *dw2 = dup(dw1, 3 * nw);
    memcpy(dx[1], dx[0], nx * sizeof(float)), memcpy(dx[2], dx[0], nx * sizeof(float));
    fill_nan(dt[1], S), fill_nan(dt[2], S);
    im->fn.moe.bwd_wbf16(dx[1], dw1, dw1 + nw, dw1 + 2 * nw, dt[1], work, dout, x, NULL, wr[1], NULL, hw[0], NULL, hw[2],
                         g[2], u[2], hh[2], perm, pos, off, topw, N, H, I, E, k);
    im->fn.moe.bwd(dx[2], dw2, dw2 + nw, dw2 + 2 * nw, dt[2], work, dout, x, wr[0], wr[1], wr[2], g[2], u[2], hh[2], perm,
                   pos, off, topw, N, H, I, E, k);
    part(c, "bwd_mix=bwd",
         bits_err(dx[1], dx[2], nx) + bits_err(dt[1], dt[2], S) + bits_err(dw1, dw2, 3 * nw));
    for (int j = 0; j < 3; j++) free(hw[j]), free(wr[j]), free(o[j]), free(g[j]), free(u[j]), free(hh[j]), free(dx[j]),
        free(dt[j]);
    free(work), free(dw1), free(dw2);
}

static void case_moe(chk_case *c, const kern_impl *ref, const kern_impl *im, const int *sh, chk_rng *r) {
    int N = sh[0], H = sh[1], I = sh[2], E = sh[3], k = sh[4], mode = sh[5];
    size_t S = (size_t)N * k, nx = (size_t)N * H, nw = (size_t)E * I * H, ns = S * I;
    int32_t *perm = ct_malloc((S + 1) * sizeof(int32_t)), *pos = ct_malloc((S + 1) * sizeof(int32_t));
    int32_t *off = ct_malloc(((size_t)E + 1) * sizeof(int32_t));
    float *topw = fbuf(S);
    moe_check_route(perm, pos, off, topw, N, E, k, mode, r);
    float *x = fbuf(nx), *wg = fbuf(nw), *wu = fbuf(nw), *wd = fbuf(nw), *dout = fbuf(nx);
    fill(x, nx, r, -1, 1);
    fill(wg, nw, r, -0.2f, 0.2f);
    fill(wu, nw, r, -0.2f, 0.2f);
    fill(wd, nw, r, -0.2f, 0.2f);
    fill(dout, nx, r, -1, 1);
    float *work = fbuf(KERN_MOE_WORK(S, H, I));
    float *o1 = fbuf(nx), *g1 = fbuf(ns), *u1 = fbuf(ns), *h1 = fbuf(ns);
    float *g2 = fbuf(ns), *u2 = fbuf(ns), *h2 = fbuf(ns);
    fill(o1, nx, r, -1, 1);
    float *o2 = dup(o1, nx);
    fill_nan(g1, ns), fill_nan(u1, ns), fill_nan(h1, ns), fill_nan(g2, ns), fill_nan(u2, ns), fill_nan(h2, ns);
    ref->fn.moe.fwd(o1, g1, u1, h1, work, x, wg, wu, wd, perm, pos, off, topw, N, H, I, E, k);
    im->fn.moe.fwd(o2, g2, u2, h2, work, x, wg, wu, wd, perm, pos, off, topw, N, H, I, E, k);
    part(c, "out+=", rel_err(o2, o1, nx));
    part(c, "gate", rel_err(g2, g1, ns));
    part(c, "up", rel_err(u2, u1, ns));
    part(c, "h", rel_err(h2, h1, ns));
    /* out NULL (recomputation): the same saved activations */
    fill_nan(g2, ns), fill_nan(u2, ns), fill_nan(h2, ns);
    im->fn.moe.fwd(NULL, g2, u2, h2, work, x, wg, wu, wd, perm, pos, off, topw, N, H, I, E, k);
    double e1 = rel_err(g2, g1, ns), e2 = rel_err(h2, h1, ns);
    part(c, "out=NULL", e1 > e2 ? e1 : e2);
    /* backward from the reference's saved activations: += into dx and the weights, = into dtopw */
    float *dx1 = fbuf(nx), *dg1 = fbuf(nw), *du1 = fbuf(nw), *dd1 = fbuf(nw), *dt1 = fbuf(S), *dt2 = fbuf(S);
    fill(dx1, nx, r, -1, 1), fill(dg1, nw, r, -1, 1), fill(du1, nw, r, -1, 1), fill(dd1, nw, r, -1, 1);
    float *dx2 = dup(dx1, nx), *dg2 = dup(dg1, nw), *du2 = dup(du1, nw), *dd2 = dup(dd1, nw);
    fill_nan(dt1, S), fill_nan(dt2, S);
    ref->fn.moe.bwd(dx1, dg1, du1, dd1, dt1, work, dout, x, wg, wu, wd, g1, u1, h1, perm, pos, off, topw, N, H, I, E,
                    k);
    im->fn.moe.bwd(dx2, dg2, du2, dd2, dt2, work, dout, x, wg, wu, wd, g1, u1, h1, perm, pos, off, topw, N, H, I, E,
                   k);
    part(c, "dx+=", rel_err(dx2, dx1, nx));
    part(c, "dwg+=", rel_err(dg2, dg1, nw));
    part(c, "dwu+=", rel_err(du2, du1, nw));
    part(c, "dwd+=", rel_err(dd2, dd1, nw));
    part(c, "dtopw", rel_err(dt2, dt1, S));
    if (im->op == KERN_OP_MOE_BF16) { /* the rounding itself: dense errors (KERN_CHECK_MEAN_TOL) */
        const float *got[] = {o2, g2, u2, h2, dx2, dg2, du2, dd2}, *want[] = {o1, g1, u1, h1, dx1, dg1, du1, dd1};
        size_t len[] = {nx, ns, ns, ns, nx, nw, nw, nw};
        double worst = 0;
        for (int i = 0; i < 8; i++) {
            double m = mean_err(got[i], want[i], len[i]);
            if (!(m <= worst)) worst = m;
        }
        c->worst_mean = worst;
        int w = snprintf(c->detail + c->len, sizeof c->detail > c->len ? sizeof c->detail - c->len : 0,
                         "  mean %.1e", worst);
        if (w > 0) c->len += (size_t)w;
    }
    /* frozen experts: no weight gradients, the same dx and dtopw as with them */
    float *dx3 = dup(dx2, nx), *dx0 = dup(dx2, nx), *dt3 = fbuf(S);
    fill_nan(dt3, S);
    im->fn.moe.bwd(dx3, NULL, NULL, NULL, dt3, work, dout, x, wg, wu, wd, g1, u1, h1, perm, pos, off, topw, N, H, I,
                   E, k);
    fill_nan(dt2, S);
    im->fn.moe.bwd(dx0, dg2, du2, dd2, dt2, work, dout, x, wg, wu, wd, g1, u1, h1, perm, pos, off, topw, N, H, I, E,
                   k);
    part(c, "dw=NULL dx", rel_err(dx3, dx0, nx));
    part(c, "dw=NULL dtopw", rel_err(dt3, dt2, S));
    /* a zero-bubble pipeline's split backward: I (the weight gradients NULL) leaves d gate
     * and d up in work, W (bwd_w) adds the weight gradients from them; both from the same
     * starting gradients as the fused backward above, which they must give */
    if (im->fn.moe.bwd_w) {
        float *sg = fbuf(nw), *su = fbuf(nw), *sd = fbuf(nw), *fg = fbuf(nw), *fu = fbuf(nw), *fd = fbuf(nw);
        fill(fg, nw, r, -1, 1), fill(fu, nw, r, -1, 1), fill(fd, nw, r, -1, 1);
        memcpy(sg, fg, nw * sizeof *sg), memcpy(su, fu, nw * sizeof *su), memcpy(sd, fd, nw * sizeof *sd);
        im->fn.moe.bwd(dx3, fg, fu, fd, dt3, work, dout, x, wg, wu, wd, g1, u1, h1, perm, pos, off, topw, N, H, I,
                       E, k);
        im->fn.moe.bwd(dx3, NULL, NULL, NULL, dt3, work, dout, x, wg, wu, wd, g1, u1, h1, perm, pos, off, topw, N, H,
                       I, E, k);
        float *dgt = dup(KERN_MOE_DGATE(work, S, I), ns), *dup_ = dup(KERN_MOE_DUP(work, S, I), ns);
        fill_nan(work, KERN_MOE_WORK(S, H, I)); /* W reads nothing else I left there */
        im->fn.moe.bwd_w(sg, su, sd, work, dout, x, h1, dgt, dup_, perm, off, topw, N, H, I, E, k);
        double eg = rel_err(sg, fg, nw), eu = rel_err(su, fu, nw), ed = rel_err(sd, fd, nw);
        part(c, "I then W", eg > eu ? (eg > ed ? eg : ed) : (eu > ed ? eu : ed));
        free(sg), free(su), free(sd), free(fg), free(fu), free(fd), free(dgt), free(dup_);
    }
    free(dx3), free(dt3), free(dx0);
    if (ref->fn.moe.fwd_wbf16) /* last, as case_matmul's wbf16 part */
        case_moe_wbf16(c, ref, im, N, H, I, E, k, perm, pos, off, topw, x, wg, wu, wd, dout, r);
    free(perm), free(pos), free(off), free(topw), free(x), free(wg), free(wu), free(wd), free(dout), free(work);
    free(o1), free(o2), free(g1), free(u1), free(h1), free(g2), free(u2), free(h2);
    free(dx1), free(dg1), free(du1), free(dd1), free(dt1), free(dt2), free(dx2), free(dg2), free(du2), free(dd2);
}

/* mode 0 random, 1 all tokens on the same k experts (k = 1: one expert, the
 * rest empty), 2 the upper half of the experts empty; small segments (experts
 * spread over threads) and large ones (each GEMM split over threads, several
 * k blocks) */
static const int shapes_moe[][CHK_DIMS] = {
    {1, 1, 1, 1, 1, 0},    {5, 7, 3, 4, 2, 0},      {17, 16, 9, 8, 2, 2},  {33, 20, 14, 8, 1, 1},
    {40, 33, 17, 4, 4, 0}, {64, 48, 32, 16, 2, 2},  {300, 64, 48, 4, 2, 0}, {300, 64, 48, 8, 3, 1},
    {700, 300, 96, 2, 1, 1}, {1000, 256, 160, 2, 2, 0},
};

/* ------------------------------------------------------------- driver */

typedef void (*case_fn)(chk_case *, const kern_impl *, const kern_impl *, const int *, chk_rng *);

static const struct {
    case_fn run;
    const int (*shapes)[CHK_DIMS];
    int nshapes;
    int ndims;
    const char *dims; /* names of the shape fields */
} op_cases[KERN_N_OPS] = {
#define SHAPES(a) a, (int)(sizeof a / sizeof a[0])
    [KERN_OP_MATMUL] = {case_matmul, SHAPES(shapes_matmul), 3, "M K N"},
    [KERN_OP_EMBEDDING] = {case_embedding, SHAPES(shapes_embedding), 3, "N C V"},
    [KERN_OP_RMSNORM] = {case_rmsnorm, SHAPES(shapes_rmsnorm), 2, "N C"},
    [KERN_OP_ROPE] = {case_rope, SHAPES(shapes_rope), 5, "B T nh hd rd"},
    [KERN_OP_ATTENTION] = {case_attention, SHAPES(shapes_attention), 5, "B T nh nkv hd"}, /* + [Tq], [options] */
    [KERN_OP_SWIGLU] = {case_swiglu, SHAPES(shapes_swiglu), 1, "N"},
    [KERN_OP_CROSSENTROPY] = {case_crossentropy, SHAPES(shapes_crossentropy), 3, "N V v0"},
    [KERN_OP_ADD] = {case_add, SHAPES(shapes_add), 1, "N"},
    [KERN_OP_ADAMW] = {case_adamw, SHAPES(shapes_adamw), 1, "n"},
    [KERN_OP_MATMUL_BF16] = {case_matmul, SHAPES(shapes_matmul_bf16), 3, "M K N"},
    [KERN_OP_MOE] = {case_moe, SHAPES(shapes_moe), 6, "N H I E k mode"},
    [KERN_OP_MOE_BF16] = {case_moe, SHAPES(shapes_moe), 6, "N H I E k mode"},
    [KERN_OP_GEGLU] = {case_geglu, SHAPES(shapes_geglu), 1, "N"},
#undef SHAPES
};

/* --quick (qemu-user, sanitizers: 10-50x slower than native) caps one dimension
 * of each op's largest cases: the cost of the check is a few cases that are
 * long in M, T or N (under qemu the MoE ones with N 700-1000 and attention's
 * T 150-260 were ~80% of its time). The caps keep what those cases are there
 * for: several 32-row and 64-key tiles with partial edges, MoE segments large
 * enough that a GEMM is split over threads (MOE_PIECE_MIN_FLOPS) over several
 * k blocks. The other dimensions stay as they are.
 * quick > 1 (`kernels check --quick-cap N`) lowers those caps to N, for a
 * re-check that needs fewer of that dimension's tiles: scripts/test_aarch64.sh
 * re-runs the SVE GEMMs at other vector lengths with M capped at 20, since the
 * length changes only their tiles' width (N) and k blocks, while M's tiles
 * (8 rows; 20 = two and a 4-row edge) are the same at every length; and the
 * emulated attention check at 80 (three 32-row query tiles, two 64-key ones,
 * two of blocked_neon's 48-row blocks, each with a partial edge), but for the
 * block form's cases, which keep 130. */
static const struct {
    int dim, cap;
} quick_cap[KERN_N_OPS] = {
    [KERN_OP_MATMUL] = {0, 130},    [KERN_OP_MATMUL_BF16] = {0, 130}, [KERN_OP_ATTENTION] = {1, 130},
    [KERN_OP_MOE] = {0, 300},       [KERN_OP_MOE_BF16] = {0, 300},
};

/* "M=77 K=131 N=45" */
static void shape_str(char *buf, size_t cap, const char *dims, const int *s, int nd) {
    char names[64];
    snprintf(names, sizeof names, "%s", dims);
    size_t len = 0;
    char *save = NULL, *tok = strtok_r(names, " ", &save);
    for (int d = 0; d < nd && tok; d++, tok = strtok_r(NULL, " ", &save)) {
        int w = snprintf(buf + len, cap > len ? cap - len : 0, "%s%s=%d", d ? " " : "", tok, s[d]);
        if (w > 0) len += (size_t)w;
    }
}

int kern_check(const kern_impl *t, size_t n, const kern_check_opts *o) {
    FILE *out = o ? o->out : NULL;
    unsigned feats = o ? o->features : 0;
    uint64_t seed = o ? o->seed : 0;
    int cases = 0, failed = 0, skipped = 0;
    /* Per instruction-set level: implementations run, and the names of those
     * skipped, so the summary (the one line CI logs show) says what this CPU
     * did not test instead of a bare count that reads like success. */
    enum { MAX_LEVELS = 8 };
    struct {
        const char *name;
        int ran, skipped;
        char skipped_names[1024];
    } lv[MAX_LEVELS];
    int n_lv = 0;
    for (int op = 0; op < KERN_N_OPS; op++) {
        if (o && o->op && strcmp(o->op, kern_op_name(op))) continue;
        const kern_impl *ref = NULL;
        int others = 0;
        for (size_t i = 0; i < n; i++)
            if ((int)t[i].op == op) {
                if (!strcmp(t[i].name, "ref")) ref = &t[i];
                else others++;
            }
        if (!ref) {
            if (others) {
                if (out) fprintf(out, "%-12s %-9s no \"ref\" entry to compare with  FAIL\n", kern_op_name(op), "-");
                failed++;
                cases++;
            }
            continue;
        }
        if (others && !op_cases[op].run) { /* an op of kernels/ops_list.h without its case above */
            if (out) fprintf(out, "%-12s %-9s no check case for this op  FAIL\n", kern_op_name(op), "-");
            failed++;
            cases++;
            continue;
        }
        if (!others) {
            if (out) fprintf(out, "%-12s %-9s the reference; nothing else registered\n", kern_op_name(op), "ref");
            continue;
        }
        /* each shape's reference calls, recorded on the first implementation (above: memo) */
        int nshapes = op_cases[op].nshapes;
        memo_case *memo_cases = ct_malloc((size_t)nshapes * sizeof *memo_cases);
        memset(memo_cases, 0, (size_t)nshapes * sizeof *memo_cases);
        const kern_impl ref_memo = memo_ref_entry(ref);
        memo.ref = ref;
        for (size_t i = 0; i < n; i++) {
            const kern_impl *im = &t[i];
            if ((int)im->op != op || im == ref) continue;
            if (o && o->impl && strcmp(o->impl, im->name)) continue;
            const char *level = kern_features_level(im->features);
            int li = 0;
            while (li < n_lv && strcmp(lv[li].name, level)) li++;
            if (li == n_lv && n_lv < MAX_LEVELS) {
                lv[n_lv].name = level;
                lv[n_lv].ran = lv[n_lv].skipped = 0;
                lv[n_lv].skipped_names[0] = 0;
                n_lv++;
            }
            if (im->features & ~feats) {
                if (li < n_lv) {
                    size_t len = strlen(lv[li].skipped_names);
                    snprintf(lv[li].skipped_names + len, sizeof lv[li].skipped_names - len, "%s%s:%s",
                             lv[li].skipped ? ", " : "", kern_op_name(op), im->name);
                    lv[li].skipped++;
                }
                char need[128];
                kern_features_str(im->features & ~feats, need, sizeof need);
                if (out)
                    fprintf(out, "%-12s %-9s skipped: this CPU lacks %s\n", kern_op_name(op), im->name, need);
                skipped++;
                continue;
            }
            if (li < n_lv) lv[li].ran++;
            double tol = im->tol > 0 ? im->tol : KERN_CHECK_TOL;
            for (int sh = 0; sh < op_cases[op].nshapes; sh++) {
                int s[CHK_DIMS];
                memcpy(s, op_cases[op].shapes[sh], sizeof s);
                int cap = quick_cap[op].cap;
                /* --quick-cap: lower only; not attention's block form, whose two-piece cases need
                 * pieces past one 64-key tile (130 / 2) */
                if (o && o->quick > 1 && cap && o->quick < cap && !(op == KERN_OP_ATTENTION && s[6] < 0))
                    cap = o->quick;
                if (o && o->quick && cap && s[quick_cap[op].dim] > cap) s[quick_cap[op].dim] = cap;
                chk_case c = {.len = 0, .worst = 0, .worst_mean = 0, .tol = 0};
                c.detail[0] = 0;
                /* the same inputs for every implementation: the generator seeded per (op, shape) */
                chk_rng seeder = {seed ^ ((uint64_t)op << 32 | (uint64_t)sh)};
                chk_rng rng = {rng_next(&seeder)};
                memo.cur = &memo_cases[sh];
                memo.cursor = 0;
                op_cases[op].run(&c, &ref_memo, im, s, &rng);
                memo.cur = NULL;
                int ok = c.worst <= (c.tol > 0 ? c.tol : tol) && c.worst_mean <= KERN_CHECK_MEAN_TOL;
                cases++;
                if (!ok) failed++;
                if (out) {
                    char shape[96];
                    shape_str(shape, sizeof shape, op_cases[op].dims, s, op_cases[op].ndims);
                    fprintf(out, "%-12s %-9s %-22s %s  %s\n", kern_op_name(op), im->name, shape, c.detail,
                            ok ? "ok" : "FAIL");
                }
            }
        }
        for (int sh = 0; sh < nshapes; sh++) {
            memo_free_calls(&memo_cases[sh], 0);
            free(memo_cases[sh].calls);
        }
        free(memo_cases);
        memo.ref = NULL;
    }
    if (out) {
        fprintf(out,
                "pass: max|impl-ref| <= tol * max|ref| per output, tol %.0e unless the entry sets its own; "
                "bf16 MoE also mean|impl-ref| <= %.0e * max|ref|\n",
                KERN_CHECK_TOL, KERN_CHECK_MEAN_TOL);
        /* One line, last: the Makefile and scripts/test_aarch64.sh tail it and
         * read its first numbers (cases, failed, skipped) by position. */
        int ran = 0;
        for (int i = 0; i < n_lv; i++) ran += lv[i].ran;
        fprintf(out, "kernels check: %d cases, %d failed, %d implementations skipped; %d implementations run against ref "
                "(every one this CPU can execute, lower instruction sets included):", cases, failed, skipped, ran);
        for (int i = 0, first = 1; i < n_lv; i++)
            if (lv[i].ran) {
                fprintf(out, "%s %s %d", first ? "" : ",", lv[i].name, lv[i].ran);
                first = 0;
            }
        if (skipped) {
            const char *isa = getenv("CTITAN_ISA");
            fprintf(out, "; %d implementations NOT RUN on this CPU%s%s%s:", skipped, isa && *isa ? " (CTITAN_ISA=" : "",
                    isa && *isa ? isa : "", isa && *isa ? ")" : "");
            for (int i = 0, first = 1; i < n_lv; i++)
                if (lv[i].skipped) {
                    fprintf(out, "%s %s %d (%s)", first ? "" : ",", lv[i].name, lv[i].skipped, lv[i].skipped_names);
                    first = 0;
                }
        }
        fprintf(out, "\n");
    }
    return failed;
}
