/* distributed/fsdp.c: ZeRO-3 over the flat buffers (see fsdp.h for the scheme).
 *
 * Pages are given back with MADV_DONTNEED, which on private anonymous
 * memory (what calloc returns for the model's buffers) drops them and reads
 * zeros next time. Only pages wholly inside a piece are released: a page
 * shared with the neighbouring piece keeps its bytes, so releasing one piece
 * never zeroes another that is in use. */
#define _DEFAULT_SOURCE
#include "distributed/fsdp.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/timer.h"

static void release_range(float *base, size_t off, size_t n) { ct_drop_pages(base + off, n * sizeof(float)); }

/* full[piece] = the piece gathered from every rank's slice in shard. */
static void gather_piece(fsdp *f, int i, float *full, const float *shard) {
    const fsdp_piece *p = &f->p[i];
    if (!p->n) return;
    size_t N = (size_t)p->comm->size;
    double t0 = ct_now();
    if (p->chunk * N == p->n) {
        comm_all_gather(p->comm, full + p->off, shard + p->shard_off, p->chunk, COMM_F32);
    } else {
        comm_all_gather(p->comm, f->stage, shard + p->shard_off, p->chunk, COMM_F32);
        memcpy(full + p->off, f->stage, p->n * sizeof(float));
    }
    f->comm_s += ct_now() - t0;
}

/* The piece's gradient as reduce-scatter input: in place when it divides
 * evenly, else copied zero-padded into `stage`. */
static float *rs_input(fsdp *f, int i, float *stage) {
    const fsdp_piece *p = &f->p[i];
    float *in = f->m->grads + p->off;
    if (p->chunk * (size_t)p->comm->size != p->n) {
        memcpy(stage, in, p->n * sizeof(float));
        memset(stage + p->n, 0, (p->chunk * (size_t)p->comm->size - p->n) * sizeof(float));
        in = stage;
    }
    return in;
}

/* f->grads slice += the piece's gradient summed over ranks (rank order). */
static void reduce_piece(fsdp *f, int i) {
    const fsdp_piece *p = &f->p[i];
    if (!p->n) return;
    float *in = rs_input(f, i, f->stage);
    /* in place (comm.h allows it): the sum lands on this rank's own block of the input */
    float *sum = in + (size_t)p->comm->rank * p->chunk;
    double t0 = ct_now();
    comm_reduce_scatter(p->comm, sum, in, p->chunk, COMM_F32);
    f->comm_s += ct_now() - t0;
    float *g = f->grads + p->shard_off;
    for (size_t k = 0; k < p->chunk; k++) g[k] += sum[k];
}

/* The non-blocking form of reduce_piece + releasing the gradient pages: a
 * layer's reduce-scatter starts after its backward and completes while the
 * layer below runs (one in flight). The same collective and the same
 * rank-order sum as the blocking one, so the bits are the same. Without an
 * MPI progress thread it advances only inside MPI calls (the blocking ones
 * of the backward, the prefetch, comm_test in the hooks) and at the wait. */
static void finish_replicas(fsdp *f) {
    if (f->rep_piece < 0) return;
    double t0 = ct_now();
    comm_wait(&f->rep_req);
    f->comm_s += ct_now() - t0;
    f->rep_piece = -1;
}

/* HSDP: piece i's shard slice is final; its replicas' sum starts (one in flight). */
static void start_replicas(fsdp *f, int i) {
    if (!f->rep || !f->rep_armed || f->rep_done[i]) return;
    finish_replicas(f);
    const fsdp_piece *p = &f->p[i];
    double t0 = ct_now();
    comm_iallreduce(f->rep, f->grads + p->shard_off, p->chunk, COMM_F32, &f->rep_req);
    f->comm_s += ct_now() - t0;
    f->rep_piece = i;
    f->rep_done[i] = 1;
    if (f->in_layer) f->rs_overlapped++;
}

static void finish_reduce(fsdp *f) {
    int i = f->rs_piece;
    if (i < 0) return;
    const fsdp_piece *p = &f->p[i];
    double t0 = ct_now();
    comm_wait(&f->rs_req);
    f->comm_s += ct_now() - t0;
    float *g = f->grads + p->shard_off;
    for (size_t k = 0; k < p->chunk; k++) g[k] += f->rs_sum[k];
    release_range(f->m->grads, p->off, p->n);
    f->rs_piece = -1;
    start_replicas(f, i);
}

static void start_reduce(fsdp *f, int i) {
    finish_reduce(f);
    const fsdp_piece *p = &f->p[i];
    if (!p->n) return;
    if (!f->rs_stage) f->rs_stage = ct_malloc(f->max_stage * sizeof(float));
    float *in = rs_input(f, i, f->rs_stage);
    f->rs_sum = in + (size_t)p->comm->rank * p->chunk;
    double t0 = ct_now();
    comm_ireduce_scatter(p->comm, f->rs_sum, in, p->chunk, COMM_F32, &f->rs_req);
    f->comm_s += ct_now() - t0;
    f->rs_piece = i;
}

/* Prefetch: piece i's all-gather starts before it is needed (layer l+1's
 * during layer l's forward, l-1's during l's backward) and is waited for
 * when it is. One at a time; MPI matches the collectives of one
 * communicator in the order they are issued, the same on every rank, so
 * the blocking ones may run while it is pending. */
static void finish_prefetch(fsdp *f) {
    int i = f->pf_piece;
    if (i < 0) return;
    double t0 = ct_now();
    comm_wait(&f->pf_req);
    const fsdp_piece *p = &f->p[i];
    if (p->chunk * (size_t)p->comm->size != p->n) memcpy(f->m->params + p->off, f->pf_stage, p->n * sizeof(float));
    f->comm_s += ct_now() - t0;
    f->gathered[i] = 1;
    f->pf_piece = -1;
}

static void start_prefetch(fsdp *f, int i) {
    if (i < 0 || i >= f->n_pieces || f->gathered[i] || f->pf_piece == i || !f->p[i].n) return;
    finish_prefetch(f);
    const fsdp_piece *p = &f->p[i];
    int direct = p->chunk * (size_t)p->comm->size == p->n;
    if (!direct && !f->pf_stage) f->pf_stage = ct_malloc(f->max_stage * sizeof(float));
    double t0 = ct_now();
    comm_iall_gather(p->comm, direct ? f->m->params + p->off : f->pf_stage, f->params + p->shard_off, p->chunk,
                     COMM_F32, &f->pf_req);
    f->comm_s += ct_now() - t0;
    f->pf_piece = i;
}

static void gather_params(fsdp *f, int i) {
    if (f->pf_piece == i) finish_prefetch(f);
    if (f->gathered[i]) return;
    finish_prefetch(f); /* keep a single piece in flight */
    gather_piece(f, i, f->m->params, f->params);
    f->gathered[i] = 1;
}

static void release_params(fsdp *f, int i) {
    if (f->pf_piece == i) finish_prefetch(f); /* never free pages an all-gather is writing */
    release_range(f->m->params, f->p[i].off, f->p[i].n);
    f->gathered[i] = 0;
}

static void zero_grads(fsdp *f, int i) { memset(f->m->grads + f->p[i].off, 0, f->p[i].n * sizeof(float)); }

/* A layer is one piece, or two under expert parallel (its experts last). */
static void gather_layer(fsdp *f, int l) {
    for (int i = f->lp[l]; i < f->lp[l + 1]; i++) gather_params(f, i);
}
static void release_layer(fsdp *f, int l) {
    for (int i = f->lp[l]; i < f->lp[l + 1]; i++) release_params(f, i);
}

/* Piece 0 (the embedding) is needed by the embedding lookup before layer 0,
 * and, when tied, again as the lm_head after the last layer; the head piece
 * (final norm, untied lm_head) only from after the last layer's forward to
 * the start of its backward. The edges of the layer loop are where they
 * come and go, so an untied model never holds both whole at once. The
 * prefetch covers a layer's first piece; an experts piece is gathered and
 * reduced when needed (its group is the FSDP group's 1/ep). */
static void hook_pre_forward(void *ctx, int l) {
    fsdp *f = ctx;
    if (l == 0 && !f->tied) release_params(f, 0); /* the lookup is done */
    gather_layer(f, l);
    start_prefetch(f, f->lp[l + 1]); /* the next layer, or the head after the last one */
}
static void hook_post_forward(void *ctx, int l) {
    fsdp *f = ctx;
    if (f->reshard || f->fwd_only) release_layer(f, l);
    if (l == f->m->cfg.n_layers - 1) { /* the last layer: the head runs next */
        gather_params(f, f->n_pieces - 1);
        if (!f->fwd_only) zero_grads(f, f->n_pieces - 1);
    }
}
static void hook_pre_backward(void *ctx, int l) {
    fsdp *f = ctx;
    if (l == f->m->cfg.n_layers - 1) { /* the head's backward is complete */
        int last = f->n_pieces - 1;
        reduce_piece(f, last);
        release_range(f->m->grads, f->p[last].off, f->p[last].n);
        release_params(f, last);
    }
    comm_test(&f->rs_req); /* drives layer l+1's reduce-scatter (no MPI progress thread) */
    if (f->rep_piece >= 0) comm_test(&f->rep_req);
    gather_layer(f, l);
    if (l > 0) start_prefetch(f, f->lp[l - 1]); /* layer l-1's parameters, unless still held */
    for (int i = f->lp[l]; i < f->lp[l + 1]; i++) zero_grads(f, i);
}
static void hook_post_backward(void *ctx, int l) {
    fsdp *f = ctx;
    for (int i = f->lp[l] + 1; i < f->lp[l + 1]; i++) { /* the experts: over their own group, now */
        reduce_piece(f, i);
        release_range(f->m->grads, f->p[i].off, f->p[i].n);
    }
    f->in_layer = l > 0;
    start_reduce(f, f->lp[l]); /* completes layer l+1's first (and starts its replicas' sum) */
    f->in_layer = 0;
    if (l > 0 && f->rs_piece == f->lp[l]) f->rs_overlapped++;
    release_layer(f, l);
    if (l == 0 && !f->tied) zero_grads(f, 0); /* the embedding's backward comes next */
}

int fsdp_layer_range(const lm_model *m, int l, size_t *lo, size_t *hi, ct_err *e) {
    size_t a = SIZE_MAX, b = 0, total = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        if (t->layer != l) continue;
        if (t->offset < a) a = t->offset;
        if (t->offset + t->numel > b) b = t->offset + t->numel;
        total += t->numel;
    }
    if (!total && m->cfg.pp_stage && !lm_holds_layer(&m->cfg, l) && a != SIZE_MAX) { /* another stage's: empty */
        *lo = *hi = a;
        return 0;
    }
    if (!total || b - a != total)
        return ct_fail(e, CT_ERR_IO, "fsdp: the tensors of layer %d are %s in the flat buffer", l,
                       total ? "not contiguous" : "missing");
    *lo = a;
    *hi = b;
    return 0;
}

void fsdp_expert_range(const lm_model *m, int l, size_t *a, size_t *b) {
    *a = SIZE_MAX, *b = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        if (t->layer != l || t->slot < LM_S_EXP_G || t->slot > LM_S_EXP_D) continue;
        if (t->offset < *a) *a = t->offset;
        if (t->offset + t->numel > *b) *b = t->offset + t->numel;
    }
    if (*a >= *b) *a = *b = 0;
}

int fsdp_cut(const lm_model *m, int split_experts, fsdp_piece *p, int *lp, ct_err *e) {
    int L = m->cfg.n_layers, np = 1;
    size_t prev = 0;
    p[0] = (fsdp_piece){.off = 0, .n = 0};
    for (int l = 0; l < L; l++) {
        size_t lo = 0, hi = 0, ea = 0, eb = 0;
        if (fsdp_layer_range(m, l, &lo, &hi, e)) return -1;
        if (lo < prev) return ct_fail(e, CT_ERR_IO, "fsdp: layer %d overlaps the tensors before it", l), -1;
        if (l == 0) p[0].n = lo;
        else if (lo != prev) return ct_fail(e, CT_ERR_IO, "fsdp: tensors between layers %d and %d", l - 1, l), -1;
        if (split_experts) fsdp_expert_range(m, l, &ea, &eb);
        if (eb > ea && eb != hi)
            return ct_fail(e, CT_ERR_IO, "fsdp: layer %d's experts are not its last tensors", l), -1;
        lp[l] = np;
        if (eb > ea) {
            p[np++] = (fsdp_piece){.off = lo, .n = ea - lo};
            p[np++] = (fsdp_piece){.off = ea, .n = eb - ea, .experts = 1};
        } else {
            p[np++] = (fsdp_piece){.off = lo, .n = hi - lo};
        }
        prev = hi;
    }
    lp[L] = np;
    p[np++] = (fsdp_piece){.off = prev, .n = m->n_params - prev};
    return np;
}

int fsdp_init(fsdp *f, lm_model *m, ct_comm *comm, ct_comm *expert_comm, int reshard, ct_err *e) {
    memset(f, 0, sizeof *f);
    int L = m->cfg.n_layers;
    f->m = m;
    f->comm = comm;
    f->reshard = reshard;
    f->tied = m->cfg.tie_embeddings;
    f->p = ct_calloc(2 * (size_t)L + 2, sizeof *f->p);
    f->lp = ct_calloc((size_t)L + 1, sizeof(int));
    f->n_pieces = fsdp_cut(m, expert_comm != NULL, f->p, f->lp, e);
    if (f->n_pieces < 0) return e ? e->code : CT_ERR_IO;
    size_t maxs = 1;
    for (int i = 0; i < f->n_pieces; i++) {
        fsdp_piece *p = &f->p[i];
        p->comm = p->experts ? expert_comm : comm;
        size_t N = (size_t)p->comm->size;
        p->chunk = (p->n + N - 1) / N;
        p->shard_off = f->shard_n;
        f->shard_n += p->chunk;
        if (p->chunk * N > maxs) maxs = p->chunk * N;
    }
    f->params = ct_calloc(f->shard_n ? f->shard_n : 1, sizeof(float));
    f->grads = ct_calloc(f->shard_n ? f->shard_n : 1, sizeof(float));
    f->stage = ct_malloc(maxs * sizeof(float));
    f->max_stage = maxs;
    f->gathered = ct_calloc((size_t)f->n_pieces, sizeof(int));
    f->rep_done = ct_calloc((size_t)f->n_pieces, 1);
    f->pf_piece = -1;
    f->rs_piece = -1;
    f->rep_piece = -1;
    fsdp_release_full(f, m->params);
    fsdp_release_full(f, m->grads);
    f->hooks = (lm_hooks){f, hook_pre_forward, hook_post_forward, hook_pre_backward, hook_post_backward, NULL, NULL};
    m->hooks = &f->hooks;
    return 0;
}

void fsdp_piece_held(const fsdp *f, int i, size_t *lo, size_t *cnt) {
    const fsdp_piece *p = &f->p[i];
    *lo = (size_t)p->comm->rank * p->chunk;
    *cnt = *lo < p->n ? (p->n - *lo < p->chunk ? p->n - *lo : p->chunk) : 0;
}

void fsdp_free(fsdp *f) {
    if (f->m && f->m->hooks == &f->hooks) f->m->hooks = NULL;
    if (f->p) { /* what is in flight reads the pieces and the shard buffers */
        finish_reduce(f);
        finish_prefetch(f);
        finish_replicas(f);
    }
    free(f->rep_done);
    free(f->p);
    free(f->lp);
    free(f->gathered);
    free(f->params);
    free(f->grads);
    free(f->rs_stage);
    free(f->stage);
    free(f->pf_stage);
    memset(f, 0, sizeof *f);
}

void fsdp_take_range(const fsdp *f, float *shard, size_t off, const float *src, size_t n) {
    for (int i = 0; i < f->n_pieces; i++) {
        const fsdp_piece *p = &f->p[i];
        size_t lo, cnt;
        fsdp_piece_held(f, i, &lo, &cnt);
        size_t a = p->off + lo, b = a + cnt; /* this rank's part of the flat buffer, in piece i */
        size_t x = a > off ? a : off, y = b < off + n ? b : off + n;
        if (x < y) memcpy(shard + p->shard_off + (x - a), src + (x - off), (y - x) * sizeof(float));
    }
}

/* Piece i to `root` only: an all-to-all in which every rank sends its slice
 * to root and only root receives, so the other ranks touch no full-size
 * memory. */
void fsdp_gather_piece(fsdp *f, int i, float *dst, const float *shard, int root) {
    const fsdp_piece *p = &f->p[i];
    finish_prefetch(f);
    if (!p->n) return;
    int N = p->comm->size, me = p->comm->rank;
    int direct = p->chunk * (size_t)N == p->n;
    size_t *v = ct_calloc(4 * (size_t)N, sizeof(size_t));
    size_t *sc = v, *sd = v + N, *rc = v + 2 * N, *rd = v + 3 * N;
    sc[root] = p->chunk;
    for (int r = 0; r < N; r++) {
        rc[r] = me == root ? p->chunk : 0;
        rd[r] = (size_t)r * p->chunk;
    }
    float *to = me == root && direct ? dst : f->stage;
    double t0 = ct_now();
    comm_all_to_allv(p->comm, to, rc, rd, shard + p->shard_off, sc, sd, COMM_F32);
    f->comm_s += ct_now() - t0;
    if (me == root && !direct) memcpy(dst, f->stage, p->n * sizeof(float));
    free(v);
}

void fsdp_release_full(fsdp *f, float *full) {
    finish_prefetch(f);
    release_range(full, 0, f->m->n_params);
    if (full == f->m->params)
        for (int i = 0; i < f->n_pieces; i++) f->gathered[i] = 0;
}

void fsdp_microbatch_begin(fsdp *f) {
    int last = f->n_pieces - 1, no_layers = f->m->cfg.n_layers == 0;
    if (f->no_embed) { /* a pipeline action that reaches neither the lookup nor a tied lm_head */
        start_prefetch(f, 1);
        return;
    }
    gather_params(f, 0);
    start_prefetch(f, 1);
    /* tied: the lm_head's backward adds to piece 0 long before the embedding's */
    if (!f->fwd_only && (f->tied || no_layers)) zero_grads(f, 0);
    if (no_layers) { /* no layer hooks will run: the head is needed now */
        gather_params(f, last);
        if (!f->fwd_only) zero_grads(f, last);
    }
}

void fsdp_microbatch_end(fsdp *f) {
    int last = f->n_pieces - 1;
    finish_reduce(f);
    if (!f->fwd_only && !f->no_embed) {
        reduce_piece(f, 0);
        release_range(f->m->grads, f->p[0].off, f->p[0].n);
        if (f->m->cfg.n_layers == 0) {
            reduce_piece(f, last);
            release_range(f->m->grads, f->p[last].off, f->p[last].n);
        }
    }
    release_params(f, 0);
    release_params(f, last);
}

void fsdp_gather_head(fsdp *f) {
    gather_params(f, f->n_pieces - 1);
    zero_grads(f, f->n_pieces - 1); /* dropped pages read as zeros, but a piece's edge pages are shared */
}

void fsdp_reduce_replicas(fsdp *f) {
    finish_reduce(f);
    double t0 = ct_now();
    for (int i = 0; i < f->n_pieces;) { /* the pieces left, as runs of adjacent slices */
        if (f->rep_done[i]) {
            i++;
            continue;
        }
        int j = i;
        size_t n = 0;
        for (; j < f->n_pieces && !f->rep_done[j]; j++) n += f->p[j].chunk;
        comm_allreduce(f->rep, f->grads + f->p[i].shard_off, n, COMM_F32, COMM_SUM);
        i = j;
    }
    f->comm_s += ct_now() - t0;
    finish_replicas(f);
    memset(f->rep_done, 0, (size_t)f->n_pieces);
    f->rep_armed = 0;
}

double fsdp_take_comm_time(fsdp *f) {
    double s = f->comm_s;
    f->comm_s = 0;
    return s;
}
