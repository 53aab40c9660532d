/* distributed/cp.c: context parallel's attention over the whole prefix from
 * a chunk of a sequence (cp.h: each piece against the keys before it, the
 * attention op's offset form), and the chunking of the step's windows. */
#include "distributed/cp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "core/timer.h"
#include "metrics/profile.h"
#include "model/moe.h"

/* The first position of piece i of rank j's chunk: headtail gives rank j the
 * pieces j and 2n-1-j of 2n, contiguous the piece j of n. */
static int cp_piece_pos(const cp_layout *cp, int j, int i) {
    if (cp->np == 1) return j * cp->L;
    return (i ? 2 * cp->n - 1 - j : j) * cp->L;
}

/* The rank holding the piece that starts at position ci L, and which of its pieces it is. */
static void cp_owner(const cp_layout *cp, int ci, int *j, int *i) {
    if (cp->np == 1 || ci < cp->n) *j = ci, *i = 0;
    else *j = 2 * cp->n - 1 - ci, *i = 1;
}

/* dst [B, Tk, w] = the first Tk positions of each sequence, from src [n][B, Tl, w]
 * (block j: rank j's chunk, its pieces in order). */
static void cp_prefix(const cp_layout *cp, float *dst, const float *src, int B, int Tk, int w) {
    size_t blk = (size_t)B * cp->Tl * w, piece = (size_t)cp->L * w;
    for (int b = 0; b < B; b++)
        for (int ci = 0; ci < Tk / cp->L; ci++) {
            int j, i;
            cp_owner(cp, ci, &j, &i);
            memcpy(dst + ((size_t)b * Tk + (size_t)ci * cp->L) * w,
                   src + (size_t)j * blk + ((size_t)b * cp->Tl + (size_t)i * cp->L) * w, piece * sizeof(float));
        }
}

/* x [B, Tk, w] -> [B, Tk2, w] in place, Tk2 <= Tk: each sequence's first Tk2
 * rows (row blocks move down, to where no later one is read from). */
static void cp_shorten(float *x, int B, int Tk, int Tk2, int w) {
    for (int b = 1; b < B; b++)
        memmove(x + (size_t)b * Tk2 * w, x + (size_t)b * Tk * w, (size_t)Tk2 * w * sizeof(float));
}

/* send [n][B, Tl, w] += d [B, Tk, w]: each position's gradient into its owner's block */
static void cp_scatter_add(const cp_layout *cp, float *send, const float *d, int B, int Tk, int w) {
    size_t blk = (size_t)B * cp->Tl * w, piece = (size_t)cp->L * w;
    for (int b = 0; b < B; b++)
        for (int ci = 0; ci < Tk / cp->L; ci++) {
            int j, i;
            cp_owner(cp, ci, &j, &i);
            float *o = send + (size_t)j * blk + ((size_t)b * cp->Tl + (size_t)i * cp->L) * w;
            const float *s = d + ((size_t)b * Tk + (size_t)ci * cp->L) * w;
            for (size_t e = 0; e < piece; e++) o[e] += s[e];
        }
}

/* Rows of piece i: dst [B, L, w] = src [B, Tl, w]'s (w = 1, B = B nh: lse's), and back. */
static void cp_rows_out(const cp_layout *cp, float *dst, const float *src, int B, int i, int w) {
    size_t piece = (size_t)cp->L * w;
    for (int b = 0; b < B; b++)
        memcpy(dst + (size_t)b * piece, src + ((size_t)b * cp->Tl + (size_t)i * cp->L) * w, piece * sizeof(float));
}
static void cp_rows_in(const cp_layout *cp, float *dst, const float *src, int B, int i, int w) {
    size_t piece = (size_t)cp->L * w;
    for (int b = 0; b < B; b++)
        memcpy(dst + ((size_t)b * cp->Tl + (size_t)i * cp->L) * w, src + (size_t)b * piece, piece * sizeof(float));
}

/* kp, vp [B, Tk, kvd] = the keys of every position up to the end of this rank's
 * last piece (the longest prefix), from k, v [B, Tl, kvd] of every rank; returns Tk.
 * kg, vg are free afterwards (the backward's send buffers). */
static int cp_gather_keys(cp_layout *cp, const float *k, const float *v, int B, int kvd) {
    size_t n = (size_t)B * cp->Tl * kvd;
    double t0 = ct_now();
    comm_all_gather(cp->c, cp->kg, k, n, COMM_F32);
    comm_all_gather(cp->c, cp->vg, v, n, COMM_F32);
    cp->comm_s += ct_now() - t0;
    int Tk = cp_piece_pos(cp, cp->rank, cp->np - 1) + cp->L;
    cp_prefix(cp, cp->kp, cp->kg, B, Tk, kvd);
    cp_prefix(cp, cp->vp, cp->vg, B, Tk, kvd);
    return Tk;
}

/* kp, vp cut down in place from [B, Tk] to piece i's prefix; returns its length. */
static int cp_keys_of_piece(cp_layout *cp, int i, int Tk, int B, int kvd) {
    int Tk2 = cp_piece_pos(cp, cp->rank, i) + cp->L;
    if (Tk2 != Tk) {
        cp_shorten(cp->kp, B, Tk, Tk2, kvd);
        cp_shorten(cp->vp, B, Tk, Tk2, kvd);
    }
    return Tk2;
}

/* The pieces from the last (the longest prefix: its keys are gathered once into
 * kp, vp, and each earlier piece's are the start of them). */
static void cp_fwd(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                   int nh, int nkv, int hd, const kern_attn_opt *o) {
    cp_layout *cp = ctx;
    lm_model *m = cp->m;
    int qd = nh * hd, kvd = nkv * hd, L = cp->L;
    (void)T; /* the chunk: cp->Tl */
    int Tk = cp_gather_keys(cp, k, v, B, kvd);
    for (int i = cp->np - 1; i >= 0; i--) {
        Tk = cp_keys_of_piece(cp, i, Tk, B, kvd);
        int64_t t0 = PROF_T0(m->prof);
        if (cp->np == 1) { /* the chunk is the piece: q, out and lse as they are */
            m->k.attention_fwd_q0(out, lse, q, cp->kp, cp->vp, B, L, Tk, nh, nkv, hd, o);
        } else {
            cp_rows_out(cp, cp->qp, q, B, i, qd);
            m->k.attention_fwd_q0(cp->op, cp->lp, cp->qp, cp->kp, cp->vp, B, L, Tk, nh, nkv, hd, o);
        }
        if (m->prof) prof_kern(m->prof, KERN_OP_ATTENTION, "attention_fwd", t0);
        if (cp->np > 1) {
            cp_rows_in(cp, out, cp->op, B, i, qd);
            cp_rows_in(cp, lse, cp->lp, B * nh, i, 1); /* lse is [B, nh, Tl]: one row per (sequence, head) */
        }
    }
}

/* As the forward, the pieces from the last; each one's d k, d v (its whole
 * prefix's) are added into the owners' blocks of the send buffers (the gather's
 * receive buffers, free once kp, vp hold the keys), reduce-scattered at the end. */
static void cp_bwd(void *ctx, float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                   const float *q, const float *k, const float *v, int B, int T, int nh, int nkv, int hd,
                   const kern_attn_opt *o) {
    cp_layout *cp = ctx;
    lm_model *m = cp->m;
    int qd = nh * hd, kvd = nkv * hd, L = cp->L;
    size_t n = (size_t)B * T * kvd;
    int Tk = cp_gather_keys(cp, k, v, B, kvd);
    memset(cp->kg, 0, (size_t)cp->n * n * sizeof(float));
    memset(cp->vg, 0, (size_t)cp->n * n * sizeof(float));
    for (int i = cp->np - 1; i >= 0; i--) {
        Tk = cp_keys_of_piece(cp, i, Tk, B, kvd);
        int64_t t0 = PROF_T0(m->prof);
        if (cp->np == 1) {
            m->k.attention_bwd_q0(dq, cp->dkp, cp->dvp, dout, out, lse, q, cp->kp, cp->vp, B, L, Tk, nh, nkv, hd, o,
                                  0);
        } else {
            cp_rows_out(cp, cp->qp, q, B, i, qd);
            cp_rows_out(cp, cp->op, out, B, i, qd);
            cp_rows_out(cp, cp->dop, dout, B, i, qd);
            cp_rows_out(cp, cp->lp, lse, B * nh, i, 1);
            m->k.attention_bwd_q0(cp->dqp, cp->dkp, cp->dvp, cp->dop, cp->op, cp->lp, cp->qp, cp->kp, cp->vp, B, L,
                                  Tk, nh, nkv, hd, o, 0);
        }
        if (m->prof) prof_kern(m->prof, KERN_OP_ATTENTION, "attention_bwd", t0);
        if (cp->np > 1) cp_rows_in(cp, dq, cp->dqp, B, i, qd);
        cp_scatter_add(cp, cp->kg, cp->dkp, B, Tk, kvd);
        cp_scatter_add(cp, cp->vg, cp->dvp, B, Tk, kvd);
    }
    double t1 = ct_now();
    comm_reduce_scatter(cp->c, dk, cp->kg, n, COMM_F32);
    comm_reduce_scatter(cp->c, dv, cp->vg, n, COMM_F32);
    cp->comm_s += ct_now() - t1;
}

/* ------------------------------------------------------------------ the ring
 * (context_parallel_rotate_method = "alltoall", PyTorch's _AllToAllRotater): each
 * rank keeps its own k, v; in step s it holds the chunk of rank (rank - s) mod n,
 * merges each of that chunk's pieces into those of its own pieces whose causal
 * prefix (and window) reach it, and passes the chunk on to rank + 1 while the
 * next one arrives from rank - 1. Pieces line up (every piece is L positions at
 * a multiple of L), so a block is a piece's diagonal, wholly in its past, or
 * wholly in its future (skipped). The backward sends the chunk round again with
 * its dk, dv accumulators, which the last step hands back to their owner. */

#define CP_TAG_K 0x4350
#define CP_TAG_DK (CP_TAG_K + 2)

/* Whether piece (position pq) needs the keys of the piece at pk: not in its future,
 * and, with a window, some key inside the first row's window (later rows see further). */
static int cp_ring_reaches(const cp_layout *cp, int pq, int pk, int window) {
    return pk <= pq && !(window > 0 && pk + cp->L - 1 <= pq - window);
}

static kern_attn_blk cp_ring_geo(const cp_layout *cp, int B, int nh, int nkv, int hd, int pq, int pk) {
    return (kern_attn_blk){B, nh, nkv, hd, cp->L, pq, cp->Tl, cp->L, pk, cp->Tl};
}

/* The blocks of rank src's chunk (kb, vb [B, Tl, kvd]) into this rank's pieces. */
static void cp_ring_fwd_step(cp_layout *cp, float *out, float *lse, const float *q, const float *kb, const float *vb,
                             int src, int B, int nh, int nkv, int hd, const kern_attn_opt *o) {
    int qd = nh * hd, kvd = nkv * hd, L = cp->L, window = kern_attn_window(o);
    for (int i = 0; i < cp->np; i++)
        for (int j = 0; j < cp->np; j++) {
            int pq = cp_piece_pos(cp, cp->rank, i), pk = cp_piece_pos(cp, src, j);
            if (!cp_ring_reaches(cp, pq, pk, window)) continue;
            kern_attn_blk g = cp_ring_geo(cp, B, nh, nkv, hd, pq, pk);
            size_t qo = (size_t)i * L, ko = (size_t)j * L * kvd;
            cp->m->k.attention_fwd_blk(out + qo * qd, lse + qo, cp->rl + qo, q + qo * qd, kb + ko, vb + ko, &g, o);
        }
}

static void cp_ring_bwd_step(cp_layout *cp, float *dq, float *dkb, float *dvb, const float *dout, const float *lse,
                             const float *q, const float *kb, const float *vb, int src, int B, int nh, int nkv, int hd,
                             const kern_attn_opt *o) {
    int qd = nh * hd, kvd = nkv * hd, L = cp->L, window = kern_attn_window(o);
    for (int i = 0; i < cp->np; i++)
        for (int j = 0; j < cp->np; j++) {
            int pq = cp_piece_pos(cp, cp->rank, i), pk = cp_piece_pos(cp, src, j);
            if (!cp_ring_reaches(cp, pq, pk, window)) continue;
            kern_attn_blk g = cp_ring_geo(cp, B, nh, nkv, hd, pq, pk);
            size_t qo = (size_t)i * L, ko = (size_t)j * L * kvd;
            cp->m->k.attention_bwd_blk(dq + qo * qd, dkb + ko, dvb + ko, dout + qo * qd, lse + qo, cp->rl + qo,
                                       q + qo * qd, kb + ko, vb + ko, &g, o);
        }
}

static void cp_ring_wait(cp_layout *cp, comm_req *r, int n) {
    double t0 = ct_now();
    for (int i = 0; i < n; i++) comm_wait(&r[i]);
    cp->comm_s += ct_now() - t0;
}

static void cp_ring_fwd(void *ctx, float *out, float *lse, const float *q, const float *k, const float *v, int B, int T,
                        int nh, int nkv, int hd, const kern_attn_opt *o) {
    cp_layout *cp = ctx;
    lm_model *m = cp->m;
    int n = cp->n, next = (cp->rank + 1) % n, prev = (cp->rank + n - 1) % n;
    size_t kn = (size_t)B * T * nkv * hd, rows = (size_t)B * nh * T; /* T: the chunk, cp->Tl */
    memset(out, 0, (size_t)B * T * nh * hd * sizeof(float));
    for (size_t i = 0; i < rows; i++) lse[i] = -INFINITY, cp->rl[i] = 0.0f;
    const float *kb = k, *vb = v;
    for (int s = 0; s < n; s++) {
        comm_req r[4];
        int nr = 0;
        float *nb = cp->rb[s & 1];
        if (s < n - 1) { /* the next chunk arrives during this step's blocks */
            comm_irecv(cp->c, nb, kn, COMM_F32, prev, CP_TAG_K, &r[nr++]);
            comm_irecv(cp->c, nb + kn, kn, COMM_F32, prev, CP_TAG_K + 1, &r[nr++]);
            comm_isend(cp->c, kb, kn, COMM_F32, next, CP_TAG_K, &r[nr++]);
            comm_isend(cp->c, vb, kn, COMM_F32, next, CP_TAG_K + 1, &r[nr++]);
        }
        int64_t t0 = PROF_T0(m->prof);
        cp_ring_fwd_step(cp, out, lse, q, kb, vb, (cp->rank - s + n) % n, B, nh, nkv, hd, o);
        if (m->prof) prof_kern(m->prof, KERN_OP_ATTENTION, "attention_fwd", t0);
        cp_ring_wait(cp, r, nr);
        kb = nb, vb = nb + kn;
    }
    kern_attn_blk g = {B, nh, nkv, hd, T, 0, T, 0, 0, T};
    op_attention_blk_finish(out, lse, cp->rl, &g);
}

static void cp_ring_bwd(void *ctx, float *dq, float *dk, float *dv, const float *dout, const float *out,
                        const float *lse, const float *q, const float *k, const float *v, int B, int T, int nh,
                        int nkv, int hd, const kern_attn_opt *o) {
    cp_layout *cp = ctx;
    lm_model *m = cp->m;
    int n = cp->n, next = (cp->rank + 1) % n, prev = (cp->rank + n - 1) % n;
    size_t kn = (size_t)B * T * nkv * hd;
    kern_attn_blk g = {B, nh, nkv, hd, T, 0, T, 0, 0, T};
    op_attention_blk_rowdot(cp->rl, dout, out, &g);
    memset(dq, 0, (size_t)B * T * nh * hd * sizeof(float));
    memset(dk, 0, kn * sizeof(float)); /* this rank's own chunk's accumulators, sent on after step 0 */
    memset(dv, 0, kn * sizeof(float));
    const float *kb = k, *vb = v;
    float *dkb = dk, *dvb = dv;
    for (int s = 0; s < n; s++) {
        comm_req r[8];
        int nr = 0;
        float *nb = cp->rb[s & 1];
        /* the last step's arrivals are this rank's own dk, dv, complete */
        float *ndk = s < n - 1 ? nb + 2 * kn : dk, *ndv = s < n - 1 ? nb + 3 * kn : dv;
        if (s < n - 1) {
            comm_irecv(cp->c, nb, kn, COMM_F32, prev, CP_TAG_K, &r[nr++]);
            comm_irecv(cp->c, nb + kn, kn, COMM_F32, prev, CP_TAG_K + 1, &r[nr++]);
            comm_isend(cp->c, kb, kn, COMM_F32, next, CP_TAG_K, &r[nr++]);
            comm_isend(cp->c, vb, kn, COMM_F32, next, CP_TAG_K + 1, &r[nr++]);
        }
        comm_irecv(cp->c, ndk, kn, COMM_F32, prev, CP_TAG_DK, &r[nr++]);
        comm_irecv(cp->c, ndv, kn, COMM_F32, prev, CP_TAG_DK + 1, &r[nr++]);
        int64_t t0 = PROF_T0(m->prof);
        cp_ring_bwd_step(cp, dq, dkb, dvb, dout, lse, q, kb, vb, (cp->rank - s + n) % n, B, nh, nkv, hd, o);
        if (m->prof) prof_kern(m->prof, KERN_OP_ATTENTION, "attention_bwd", t0);
        comm_isend(cp->c, dkb, kn, COMM_F32, next, CP_TAG_DK, &r[nr++]);
        comm_isend(cp->c, dvb, kn, COMM_F32, next, CP_TAG_DK + 1, &r[nr++]);
        cp_ring_wait(cp, r, nr);
        kb = nb, vb = nb + kn, dkb = ndk, dvb = ndv;
    }
}

double cp_scratch_floats(int B, int T, int n, int headtail, int ring, int nh, int nkv, int hd) {
    double Tl = (double)T / n, kv = (double)B * nkv * hd, qw = (double)B * nh * hd;
    if (ring) return 8 * kv * Tl + (double)B * nh * Tl;
    if (!headtail) return 6 * kv * T;
    double L = Tl / 2;
    return 6 * kv * T + 4 * qw * L + (double)B * nh * L;
}

void cp_init(cp_layout *cp, lm_model *m, ct_comm *c, int B, int T, int n_seq, int headtail, int ring) {
    memset(cp, 0, sizeof *cp);
    cp->m = m;
    cp->c = c;
    cp->n = c->size;
    cp->rank = c->rank;
    cp->B = B;
    cp->T = T;
    cp->Tl = T / cp->n;
    cp->np = headtail ? 2 : 1;
    cp->L = cp->Tl / cp->np;
    const lm_config *mc = &m->cfg;
    cp->ring = ring;
    if (ring) {
        size_t kvl = (size_t)B * cp->Tl * mc->n_kv_heads * mc->head_dim;
        cp->rb[0] = ct_malloc(4 * kvl * sizeof(float));
        cp->rb[1] = ct_malloc(4 * kvl * sizeof(float));
        cp->rl = ct_malloc((size_t)B * mc->n_heads * cp->Tl * sizeof(float));
    } else { /* the gather path: every rank's keys */
        size_t kv = (size_t)B * T * mc->n_kv_heads * mc->head_dim;
        cp->kg = ct_malloc(kv * sizeof(float));
        cp->vg = ct_malloc(kv * sizeof(float));
        cp->kp = ct_malloc(kv * sizeof(float));
        cp->vp = ct_malloc(kv * sizeof(float));
        cp->dkp = ct_malloc(kv * sizeof(float));
        cp->dvp = ct_malloc(kv * sizeof(float));
    }
    if (cp->np > 1 && !ring) { /* a piece's query rows, out of the chunk's two */
        size_t q = (size_t)B * cp->L * mc->n_heads * mc->head_dim;
        cp->qp = ct_malloc(q * sizeof(float));
        cp->op = ct_malloc(q * sizeof(float));
        cp->dqp = ct_malloc(q * sizeof(float));
        cp->dop = ct_malloc(q * sizeof(float));
        cp->lp = ct_malloc((size_t)B * mc->n_heads * cp->L * sizeof(float));
    }
    if (m->moe.n_layers) cp->loads = ct_malloc((size_t)mc->n_layers * mc->n_experts * sizeof(double));
    if (n_seq < B) n_seq = B;
    cp->tok = ct_malloc((size_t)n_seq * cp->Tl * sizeof(int32_t));
    cp->lab = ct_malloc((size_t)n_seq * cp->Tl * sizeof(int32_t));
    cp->T = 0;
    cp_set_len(cp, T);
    cp->d = ring ? (lm_attn_dispatch){cp, cp_ring_fwd, cp_ring_bwd} : (lm_attn_dispatch){cp, cp_fwd, cp_bwd};
    m->attn_cp = &cp->d;
}

void cp_set_len(cp_layout *cp, int T) {
    if (cp->T == T) return;
    lm_model *m = cp->m;
    const lm_config *mc = &m->cfg;
    cp->T = T;
    cp->Tl = T / cp->n;
    cp->L = cp->Tl / cp->np;
    /* RoPE of the pieces' global positions, for a forward over the whole
     * sequence (dynamic RoPE depends on its length): each piece's rows of the
     * tables; rope_T = Tl keeps the model from rebuilding them for 0 .. Tl-1 */
    size_t half = (size_t)lm_rotary_dim(mc) / 2;
    for (int i = 0; i < cp->np; i++) {
        int p = cp_piece_pos(cp, cp->rank, i);
        size_t at = (size_t)i * cp->L * half;
        lm_rope_tables(mc, 0, T, p, cp->L, m->ws.rope_cos + at, m->ws.rope_sin + at);
        if (m->ws.rope_cos_l != m->ws.rope_cos)
            lm_rope_tables(mc, 1, T, p, cp->L, m->ws.rope_cos_l + at, m->ws.rope_sin_l + at);
        if (m->ws.rope_cos_q != m->ws.rope_cos) /* Ministral 3: q's scale by global position */
            lm_rope_q_tables(mc, p, cp->L, m->ws.rope_cos + at, m->ws.rope_sin + at, m->ws.rope_cos_q + at,
                             m->ws.rope_sin_q + at);
    }
    m->ws.rope_T = cp->Tl;
    m->cp_T = T, m->cp_Tl = cp->Tl, m->cp_p0 = cp_piece_pos(cp, cp->rank, 0);
    m->cp_p1 = cp->np > 1 ? cp_piece_pos(cp, cp->rank, 1) : 0;
}

void cp_free(cp_layout *cp) {
    if (cp->m && cp->m->attn_cp == &cp->d) cp->m->attn_cp = NULL, cp->m->cp_T = 0;
    float *f[] = {cp->kg,  cp->vg,  cp->kp,    cp->vp,    cp->dkp,   cp->dvp, cp->qp,
                  cp->op,  cp->dqp, cp->dop,   cp->lp,    cp->rb[0], cp->rb[1], cp->rl};
    for (size_t i = 0; i < sizeof f / sizeof *f; i++) free(f[i]);
    free(cp->tok);
    free(cp->lab);
    free(cp->loads);
    memset(cp, 0, sizeof *cp);
}

void cp_chunk(cp_layout *cp, const int32_t *tokens, const int32_t *labels, int B) {
    size_t Tl = (size_t)cp->Tl, L = (size_t)cp->L;
    for (int b = 0; b < B; b++)
        for (int i = 0; i < cp->np; i++) {
            size_t src = (size_t)b * cp->T + (size_t)cp_piece_pos(cp, cp->rank, i), dst = b * Tl + i * L;
            memcpy(cp->tok + dst, tokens + src, L * sizeof(int32_t));
            memcpy(cp->lab + dst, labels + src, L * sizeof(int32_t));
        }
}

/* cp_moe_forward_backward's middle: loads [L, E] holds moe.tokens before the
 * forward, and then the forward's tokens per expert of each layer over the group. */
static void cp_moe_aux(cp_layout *cp, int B, double *loads) {
    lm_model *m = cp->m;
    int E = m->cfg.n_experts, L = m->cfg.n_layers;
    /* this forward's tokens per expert of each layer: what it added to moe.tokens */
    for (size_t i = 0; i < (size_t)L * E; i++) loads[i] = m->moe.tokens[i] - loads[i];
    double t0 = ct_now();
    comm_allreduce(cp->c, m->moe.count, (size_t)E, COMM_F64, COMM_SUM);
    comm_allreduce(cp->c, m->moe.psum, (size_t)E, COMM_F64, COMM_SUM);
    comm_allreduce(cp->c, loads, (size_t)L * E, COMM_F64, COMM_SUM);
    cp->comm_s += ct_now() - t0;
    for (int l = 0; l < L; l++) {
        if (m->moe.load_min[l] < 0) continue; /* a dense layer */
        moe_load_range(loads + (size_t)l * E, E, &m->moe.load_min[l], &m->moe.load_max[l]);
    }
    m->moe.aux_loss = moe_aux_loss(NULL, m->moe.count, m->moe.psum, B * cp->T, m->moe.n_layers, E, 0.0);
    /* the gradient of the whole sequences' loss: R counts all B T tokens, not the chunk's */
    lm_stage_aux_grad(m, m->moe.count, B, cp->T);
}

double cp_moe_forward_backward(cp_layout *cp, const int32_t *tokens, const int32_t *labels, int B, float scale) {
    lm_model *m = cp->m;
    int L = m->cfg.n_layers;
    cp_chunk(cp, tokens, labels, B);
    memcpy(cp->loads, m->moe.tokens, (size_t)L * m->cfg.n_experts * sizeof(double));
    lm_stage_forward(m, 0, L, cp->tok, NULL, NULL, B, cp->Tl, 1);
    cp_moe_aux(cp, B, cp->loads);
    return lm_stage_backward(m, 0, L, cp->tok, cp->lab, NULL, NULL, B, cp->Tl, scale, NULL);
}

double cp_take_comm_time(cp_layout *cp) {
    double s = cp->comm_s;
    cp->comm_s = 0;
    return s;
}

void cp_describe(const cp_layout *cp, FILE *f) {
    if (cp->np > 1)
        fprintf(f, "ctitan: context_parallel %d (headtail): rank c runs pieces c and %d - c of the %d pieces of %d "
                   "positions of every sequence (seq_len %d), each attending over the whole prefix before it: the "
                   "same causal attention work on every rank",
                cp->n, 2 * cp->n - 1, 2 * cp->n, cp->L, cp->T);
    else
        fprintf(f, "ctitan: context_parallel %d (contiguous): each rank runs %d consecutive positions of every "
                   "sequence, attending over the whole prefix (rank %d, the last chunk, over all %d)",
                cp->n, cp->Tl, cp->n - 1, cp->T);
    if (cp->ring)
        fprintf(f, "; ring attention (context_parallel_rotate_method alltoall): the chunks of k and v pass round the "
                   "%d ranks, one at a time\n", cp->n);
    else
        fprintf(f, "; every rank all-gathers k and v (context_parallel_rotate_method allgather)\n");
}
