/* distributed/fsdp.c: ZeRO-3 over the flat buffers (see fsdp.h for the scheme).
 *
 * Pages are given back with MADV_DONTNEED, which on private anonymous
 * memory (the CPU device's mapping of the model's buffers, on 2 MB pages
 * from 64 MB up) drops them and reads zeros next time; a huge page partly
 * inside a piece is split by the kernel. Huge pages measured much faster
 * here than 4 KB ones (W3 over 2 ranks: 875-887 against 620-690 tok/s), the
 * re-gathers taking a fault per 2 MB instead of per 4 KB. Only pages wholly inside a piece are released: a page
 * shared with the neighbouring piece keeps its bytes, so releasing one piece
 * never zeroes another that is in use. */
#define _DEFAULT_SOURCE
#include "distributed/fsdp.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/dtype.h"
#include "core/timer.h"
#include "model/lora.h"

static void release_range(float *base, size_t off, size_t n) { ct_drop_pages(base + off, n * sizeof(float)); }

/* Piece i's fp32 floats between the flat buffer and their packed order in
 * the shard: piece[n] is the flat buffer from p->off, packed[n32] the
 * piece less its bf16-stored matrices. Without stored matrices the two
 * are the same range. */
static void pack(const fsdp *f, int i, float *packed, const float *piece) {
    const fsdp_piece *p = &f->p[i];
    if (!p->sn) {
        memcpy(packed, piece, p->n * sizeof(float));
        return;
    }
    size_t k = 0;
    for (int t = p->t0; t < p->t1; t++) {
        const lm_tensor *q = &f->m->tensors[t];
        if (q->store != LM_NO_STORE) continue;
        memcpy(packed + k, piece + (q->offset - p->off), q->numel * sizeof(float));
        k += q->numel;
    }
}
static void unpack(const fsdp *f, int i, float *piece, const float *packed) {
    const fsdp_piece *p = &f->p[i];
    if (!p->sn) {
        memcpy(piece, packed, p->n * sizeof(float));
        return;
    }
    size_t k = 0;
    for (int t = p->t0; t < p->t1; t++) {
        const lm_tensor *q = &f->m->tensors[t];
        if (q->store != LM_NO_STORE) continue;
        memcpy(piece + (q->offset - p->off), packed + k, q->numel * sizeof(float));
        k += q->numel;
    }
}

/* The fp32 all-gather lands in place when the piece is its own packed
 * order and divides evenly; else in staging, unpacked after. */
static int direct(const fsdp_piece *p) { return !p->sn && p->chunk * (size_t)p->comm->size == p->n; }
static int sdirect(const fsdp_piece *p) { return p->schunk * (size_t)p->comm->size == p->sn; }

/* full[piece] = the piece gathered from every rank's slice in shard, and
 * its bf16-stored matrices into m->fstore from f->sparams. */
static void gather_piece(fsdp *f, int i, float *full, const float *shard) {
    const fsdp_piece *p = &f->p[i];
    if (!p->n) return;
    double t0 = ct_now();
    if (p->chunk && direct(p)) {
        comm_all_gather(p->comm, full + p->off, shard + p->shard_off, p->chunk, COMM_F32);
    } else if (p->chunk) {
        comm_all_gather(p->comm, f->stage, shard + p->shard_off, p->chunk, COMM_F32);
        unpack(f, i, full + p->off, f->stage);
    }
    if (p->sn) { /* in bf16: half the bytes of the fp32 gather */
        uint16_t *to = sdirect(p) ? f->m->fstore + p->soff : f->sstage;
        comm_all_gather(p->comm, to, f->sparams + p->sshard_off, p->schunk, COMM_BF16);
        if (to != f->m->fstore + p->soff) memcpy(f->m->fstore + p->soff, to, p->sn * sizeof(uint16_t));
    }
    f->comm_s += ct_now() - t0;
}

/* The piece's gradient as reduce-scatter input: in place when it divides
 * evenly, else packed (without the bf16-stored matrices, which have none)
 * and zero-padded into `stage`. */
static float *rs_input(fsdp *f, int i, float *stage) {
    const fsdp_piece *p = &f->p[i];
    float *in = f->m->grads + p->off;
    if (!direct(p)) {
        pack(f, i, stage, in);
        memset(stage + p->n32, 0, (p->chunk * (size_t)p->comm->size - p->n32) * sizeof(float));
        in = stage;
    }
    return in;
}

/* f->grads slice += the piece's gradient summed over ranks (rank order). */
static void reduce_piece(fsdp *f, int i) {
    const fsdp_piece *p = &f->p[i];
    if (!p->chunk) return; /* nothing but bf16-stored matrices: no gradient */
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
    if (!p->chunk) return;
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
    comm_wait(&f->pf_sreq);
    const fsdp_piece *p = &f->p[i];
    if (p->chunk && !direct(p)) unpack(f, i, f->m->params + p->off, f->pf_stage);
    if (p->sn && !sdirect(p)) memcpy(f->m->fstore + p->soff, f->pf_sstage, p->sn * sizeof(uint16_t));
    f->comm_s += ct_now() - t0;
    f->gathered[i] = 1;
    f->pf_piece = -1;
}

static void start_prefetch(fsdp *f, int i) {
    if (i < 0 || i >= f->n_pieces || f->gathered[i] || f->pf_piece == i || !f->p[i].n) return;
    finish_prefetch(f);
    const fsdp_piece *p = &f->p[i];
    if (!direct(p) && !f->pf_stage) f->pf_stage = ct_malloc(f->max_stage * sizeof(float));
    if (p->sn && !sdirect(p) && !f->pf_sstage) f->pf_sstage = ct_malloc(f->max_sstage * sizeof(uint16_t));
    double t0 = ct_now();
    if (p->chunk)
        comm_iall_gather(p->comm, direct(p) ? f->m->params + p->off : f->pf_stage, f->params + p->shard_off,
                         p->chunk, COMM_F32, &f->pf_req);
    if (p->sn) /* the bf16-stored matrices beside it, in bf16 */
        comm_iall_gather(p->comm, sdirect(p) ? f->m->fstore + p->soff : f->pf_sstage, f->sparams + p->sshard_off,
                         p->schunk, COMM_BF16, &f->pf_sreq);
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
    if (f->p[i].sn) ct_drop_pages(f->m->fstore + f->p[i].soff, f->p[i].sn * sizeof(uint16_t));
    f->gathered[i] = 0;
}

/* The bf16-stored matrices have no gradient: their pages are never touched. */
static void zero_grads(fsdp *f, int i) {
    const fsdp_piece *p = &f->p[i];
    if (!p->sn) {
        memset(f->m->grads + p->off, 0, p->n * sizeof(float));
        return;
    }
    for (int t = p->t0; t < p->t1; t++) {
        const lm_tensor *q = &f->m->tensors[t];
        if (q->store == LM_NO_STORE) memset(f->m->grads + q->offset, 0, q->numel * sizeof(float));
    }
}

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
    /* the lookup is done, unless LoRA on embed_tokens reads A and B again in the embedding's backward */
    int embed_lora = f->m->cfg.lora_rank > 0 && (f->m->cfg.lora_targets & LORA_EMBED);
    if (l == 0 && !f->tied && !embed_lora) release_params(f, 0);
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

/* [a, b) of layer l's experts' tensors (every expert's name, held or not) and
 * their LoRA adapters, which are held with them (not the router's); a == b: none. */
static void fsdp_expert_range(const lm_model *m, int l, size_t *a, size_t *b) {
    *a = SIZE_MAX, *b = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        int adapter = (t->slot == LM_S_LORA_EA || t->slot == LM_S_LORA_EB) && t->expert != LM_LORA_EXP_R;
        if (t->layer != l || ((t->slot < LM_S_EXP_G || t->slot > LM_S_EXP_D) && !adapter)) continue;
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
    /* each piece's tensors (the table is in flat order) and its bf16-stored
     * matrices: consecutive in m->fstore too, since stores are given in
     * table order */
    int t = 0;
    for (int i = 0; i < np; i++) {
        p[i].t0 = t;
        while (t < m->n_tensors && (i == np - 1 || m->tensors[t].offset < p[i].off + p[i].n)) t++;
        p[i].t1 = t;
        p[i].sn = 0;
        for (int k = p[i].t0; k < p[i].t1; k++) {
            const lm_tensor *q = &m->tensors[k];
            if (q->store == LM_NO_STORE || !q->numel) continue;
            if (!p[i].sn) p[i].soff = q->store;
            if (q->store != p[i].soff + p[i].sn)
                return ct_fail(e, CT_ERR_IO, "fsdp: the bf16-stored tensors of %s are not contiguous", q->name), -1;
            p[i].sn += q->numel;
        }
        p[i].n32 = p[i].n - p[i].sn;
    }
    return np;
}

/* Gives back the pages of full[n_params] (model params or grads). */
static void fsdp_release_full(fsdp *f, float *full) {
    finish_prefetch(f);
    release_range(full, 0, f->m->n_params);
    if (full != f->m->params) return;
    if (f->m->n_store) ct_drop_pages(f->m->fstore, f->m->n_store * sizeof(uint16_t)); /* the bf16 store likewise */
    for (int i = 0; i < f->n_pieces; i++) f->gathered[i] = 0;
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
    size_t maxs = 1, maxss = 1;
    for (int i = 0; i < f->n_pieces; i++) {
        fsdp_piece *p = &f->p[i];
        p->comm = p->experts ? expert_comm : comm;
        size_t N = (size_t)p->comm->size;
        p->chunk = (p->n32 + N - 1) / N;
        p->shard_off = f->shard_n;
        f->shard_n += p->chunk;
        if (p->chunk * N > maxs) maxs = p->chunk * N;
        p->schunk = (p->sn + N - 1) / N;
        p->sshard_off = f->sshard_n;
        f->sshard_n += p->schunk;
        if (p->schunk * N > maxss) maxss = p->schunk * N;
    }
    f->sparams = ct_calloc(f->sshard_n ? f->sshard_n : 1, sizeof(uint16_t));
    f->sstage = f->sshard_n ? ct_malloc(maxss * sizeof(uint16_t)) : NULL;
    f->max_sstage = maxss;
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
    *cnt = *lo < p->n32 ? (p->n32 - *lo < p->chunk ? p->n32 - *lo : p->chunk) : 0;
}

void fsdp_held_runs(const fsdp *f, int i, void (*run)(void *ctx, size_t x, size_t n, size_t s), void *ctx) {
    const fsdp_piece *p = &f->p[i];
    size_t lo, cnt;
    fsdp_piece_held(f, i, &lo, &cnt);
    if (!cnt) return;
    if (!p->sn) {
        run(ctx, p->off + lo, cnt, p->shard_off);
        return;
    }
    size_t k = 0; /* packed position of tensor t */
    for (int t = p->t0; t < p->t1; t++) {
        const lm_tensor *q = &f->m->tensors[t];
        if (q->store != LM_NO_STORE) continue;
        size_t a = k > lo ? k : lo, b = k + q->numel < lo + cnt ? k + q->numel : lo + cnt;
        if (a < b) run(ctx, q->offset + (a - k), b - a, p->shard_off + (a - lo));
        k += q->numel;
    }
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
    free(f->sparams);
    free(f->sstage);
    free(f->pf_sstage);
    memset(f, 0, sizeof *f);
}

typedef struct {
    float *shard;
    size_t off, n;
    const float *src;
} take_ctx;

/* A held run [a, a + cnt) at shard position s: what of src it covers. */
static void take_run(void *ctx, size_t a, size_t cnt, size_t s) {
    take_ctx *c = ctx;
    size_t b = a + cnt, x = a > c->off ? a : c->off, y = b < c->off + c->n ? b : c->off + c->n;
    if (x < y) memcpy(c->shard + s + (x - a), c->src + (x - c->off), (y - x) * sizeof(float));
}

void fsdp_take_range(const fsdp *f, float *shard, size_t off, const float *src, size_t n) {
    take_ctx c = {shard, off, n, src};
    for (int i = 0; i < f->n_pieces; i++) {
        const fsdp_piece *p = &f->p[i];
        if (p->off >= off + n || p->off + p->n <= off) continue;
        fsdp_held_runs(f, i, take_run, &c);
    }
}

void fsdp_take_store(fsdp *f, size_t soff, const float *src, size_t n) {
    for (int i = 0; i < f->n_pieces; i++) {
        const fsdp_piece *p = &f->p[i];
        if (!p->sn) continue;
        size_t a = p->soff + (size_t)p->comm->rank * p->schunk, b = a + p->schunk;
        if (b > p->soff + p->sn) b = p->soff + p->sn;
        size_t x = a > soff ? a : soff, y = b < soff + n ? b : soff + n;
        if (x < y) ct_convert_from_f32(f->sparams + p->sshard_off + (x - a), CT_BF16, src + (x - soff), y - x);
    }
}

/* Piece i to `root` only: an all-to-all in which every rank sends its slice
 * to root and only root receives, so the other ranks touch no full-size
 * memory. */
void fsdp_gather_piece(fsdp *f, int i, float *dst, const float *shard, int root, int stored) {
    const fsdp_piece *p = &f->p[i];
    finish_prefetch(f);
    if (!p->n) return;
    int N = p->comm->size, me = p->comm->rank;
    size_t *v = ct_calloc(4 * (size_t)N, sizeof(size_t));
    size_t *sc = v, *sd = v + N, *rc = v + 2 * N, *rd = v + 3 * N;
    double t0 = ct_now();
    if (p->chunk) {
        sc[root] = p->chunk;
        for (int r = 0; r < N; r++) {
            rc[r] = me == root ? p->chunk : 0;
            rd[r] = (size_t)r * p->chunk;
        }
        float *to = me == root && direct(p) ? dst : f->stage;
        comm_all_to_allv(p->comm, to, rc, rd, shard + p->shard_off, sc, sd, COMM_F32);
        if (me == root && !direct(p)) unpack(f, i, dst, f->stage);
    }
    if (stored && p->sn) { /* the bf16 slices to root, widened there into their places */
        sc[root] = p->schunk;
        for (int r = 0; r < N; r++) {
            rc[r] = me == root ? p->schunk : 0;
            rd[r] = (size_t)r * p->schunk;
        }
        comm_all_to_allv(p->comm, f->sstage, rc, rd, f->sparams + p->sshard_off, sc, sd, COMM_BF16);
        for (int t = p->t0; me == root && t < p->t1; t++) {
            const lm_tensor *q = &f->m->tensors[t];
            if (q->store != LM_NO_STORE)
                ct_convert_to_f32(dst + (q->offset - p->off), f->sstage + (q->store - p->soff), CT_BF16, q->numel);
        }
    }
    f->comm_s += ct_now() - t0;
    free(v);
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
