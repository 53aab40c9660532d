/* distributed/pp.c: stage split, schedules and their simulation, and the
 * run-time executor of pipeline parallelism (see pp.h for the design). */
#include "distributed/pp.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "core/timer.h"
#include "model/moe.h"

/* Parses pipeline_parallel_schedule (CT_ERR_CONFIG naming the key). */
static int pp_schedule_parse(const char *name, int *schedule, const char *where, ct_err *e) {
    static const char *const names[] = {"1F1B",          "GPipe",         "Interleaved1F1B", "LoopedBFS",
                                        "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"}; /* PP_* order */
    for (int i = 0; i < 7; i++)
        if (!strcmp(name, names[i])) {
            *schedule = i;
            return 0;
        }
    return ct_fail(e, CT_ERR_CONFIG,
                   "%s: parallelism.pipeline_parallel_schedule = \"%s\" is not one of 1F1B, GPipe, Interleaved1F1B, "
                   "LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV",
                   where, name);
}

/* Placement (pp.h): the virtual stage of rank r's local stage c, and the
 * rank and local index of virtual stage v. The loop: v = c P + r; the V
 * (ZBVZeroBubble and DualPipeV, 2 stages a rank): r and 2 P - 1 - r. */
static int v_placed(const pp_sched *p) { return p->schedule == PP_ZBV || p->schedule == PP_DUALPIPEV; }
static int vstage_of(const pp_sched *p, int r, int c) {
    return v_placed(p) ? (c ? 2 * p->P - 1 - r : r) : c * p->P + r;
}
static int owner(const pp_sched *p, int v) { return v_placed(p) && v >= p->P ? 2 * p->P - 1 - v : v % p->P; }
static int local_of(const pp_sched *p, int v) { return v_placed(p) ? v >= p->P : v / p->P; }
int pp_vstage(const pp_sched *p, int r, int c) { return vstage_of(p, r, c); }

/* ------------------------------------------------------------------ split */

/* Forward FLOPs per token of layer l (x 2: multiply-add), attention scores at T. */
static double layer_cost(const lm_config *c, int l, int T) {
    double H = c->hidden, hd = c->head_dim, qd = (double)c->n_heads * hd, kvd = (double)c->n_kv_heads * hd;
    double attn = H * (qd + 2 * kvd) + qd * H + 2.0 * qd * T; /* projections, then scores and values */
    double mlp = lm_layer_is_moe(c, l) ? (double)c->top_k * 3.0 * H * c->moe_intermediate + (double)c->n_experts * H
                                       : 3.0 * H * c->intermediate;
    if (lm_layer_is_moe(c, l) && c->shared_intermediate > 0) /* the shared expert, every token; qwen2_moe's gate */
        mlp += 3.0 * H * c->shared_intermediate + (c->moe_keys == LM_MOE_KEYS_GRANITE ? 0 : H);
    return 2.0 * (attn + mlp);
}

static double head_cost(const lm_config *c) { return 2.0 * (double)c->vocab_size * c->hidden; }

/* The contiguous split of L layers into V stages minimising the most
 * expensive stage (the last one carrying the head): dynamic programming
 * over (stages, layers), ties broken towards earlier cuts. */
static void split_by_cost(const lm_config *c, int V, int T, int *first) {
    int L = c->n_layers;
    double *pre = calloc((size_t)L + 1, sizeof *pre);
    for (int l = 0; l < L; l++) pre[l + 1] = pre[l] + layer_cost(c, l, T);
    /* best[v][l]: the least max cost of putting layers [0, l) into v stages */
    double *best = malloc(((size_t)V + 1) * ((size_t)L + 1) * sizeof *best);
    int *cut = calloc(((size_t)V + 1) * ((size_t)L + 1), sizeof *cut);
#define BEST(v, l) best[(size_t)(v) * (L + 1) + (l)]
#define CUT(v, l) cut[(size_t)(v) * (L + 1) + (l)]
    for (int v = 0; v <= V; v++)
        for (int l = 0; l <= L; l++) BEST(v, l) = INFINITY;
    BEST(0, 0) = 0;
    for (int v = 1; v <= V; v++)
        for (int l = v; l <= L - (V - v); l++)
            for (int k = v - 1; k < l; k++) {
                double s = pre[l] - pre[k] + (v == V ? head_cost(c) : 0);
                double m = BEST(v - 1, k) > s ? BEST(v - 1, k) : s;
                if (m < BEST(v, l)) {
                    BEST(v, l) = m;
                    CUT(v, l) = k;
                }
            }
    first[V] = L;
    for (int v = V, l = L; v > 0; v--) {
        first[v - 1] = CUT(v, l);
        l = CUT(v, l);
    }
#undef BEST
#undef CUT
    free(pre);
    free(best);
    free(cut);
}

/* torchtitan's even split (pipeline_parallel_layers_per_stage and the
 * *_stage_less_layers keys): the embedding counts as `in` layers and the
 * final norm + lm_head as `out`, the L + in + out "effective layers" are
 * dealt out evenly over V stages (the first (L + in + out) % V one more), and
 * each stage takes that many real layers less what it carries besides. torch-
 * titan's checks are kept (in or out above the smallest share is refused); a
 * stage left with no layer, which torchtitan would build around the embedding
 * or the head alone, is refused: a ctitan stage holds at least one layer.
 * Returns 0 with first[0 .. V] set, or CT_ERR_CONFIG naming the keys. */
static int split_even(int V, int L, int in, int out, int *first, const char *where, ct_err *e) {
    int eff = L + in + out, per = eff / V, extra = eff % V;
    if (V > eff || per == 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %d pipeline stages over %d layers + pipeline_parallel_first_stage_less_layers %d + "
                       "pipeline_parallel_last_stage_less_layers %d would leave a stage empty",
                       where, V, L, in, out);
    if (in > per || out > per)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_%s_stage_less_layers = %d exceeds the %d layers each of the "
                       "%d stages holds at least (as torchtitan refuses it)",
                       where, in > per ? "first" : "last", in > per ? in : out, per, V);
    int l = 0;
    for (int v = 0; v < V; v++) {
        int take = per + (v < extra) - (v == 0 ? in : 0) - (v == V - 1 ? out : 0);
        first[v] = l;
        l = l + take < L ? l + take : L;
        if (l == first[v])
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: torchtitan's even split of %d layers into %d stages (pipeline_parallel_first_stage_"
                           "less_layers %d, pipeline_parallel_last_stage_less_layers %d) leaves stage %d without a "
                           "layer; ctitan's stages hold at least one: lower those keys or use fewer stages",
                           where, L, V, in, out, v);
    }
    first[V] = L;
    return 0;
}

/* torchtitan names a split point by the module that starts the stage:
 * "layers.4" (or the bare number). Returns the stages, or -1 with *e set. */
static int parse_points(const char *list, int L, int *first, int max, const char *where, ct_err *e) {
    int n = 0;
    const char *s = list;
    while (*s) {
        while (*s == ' ' || *s == ',') s++;
        if (!*s) break;
        const char *t = s;
        while (*t && *t != ',') t++;
        char item[64];
        snprintf(item, sizeof item, "%.*s", (int)(t - s), s);
        const char *num = !strncmp(item, "layers.", 7) ? item + 7 : item;
        char *end;
        long l = strtol(num, &end, 10);
        if (end == num || *end || l <= 0 || l >= L)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: parallelism.pipeline_parallel_split_points: \"%s\" is not a layer \"layers.N\" with "
                           "0 < N < %d",
                           where, item, L), -1;
        if (n && l <= first[n])
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: parallelism.pipeline_parallel_split_points: \"%s\" does not come after layers.%d", where,
                           item, first[n]), -1;
        if (n + 1 >= max)
            return ct_fail(e, CT_ERR_CONFIG, "%s: parallelism.pipeline_parallel_split_points: too many (%d layers)",
                           where, L), -1;
        first[++n] = (int)l;
        s = t;
    }
    first[0] = 0;
    return n + 1; /* stages */
}

static int pp_name_in(const char *name, const char *const *set, int n) {
    for (int i = 0; i < n; i++)
        if (!strcmp(name, set[i])) return 1;
    return 0;
}

/* torchtitan's module_fqns_per_model_part: each stage's modules by name
 * (its own model's or Hugging Face's). ctitan's stages are contiguous runs of
 * layers with the embedding on the first and the final norm + head on the
 * last, so a list that places them otherwise is refused by name rather than
 * run in another order. Returns the stages with first[] set, or -1. */
static int parse_fqns(const char *fqns, int L, int *first, const char *where, ct_err *e) {
    static const char *const embed[] = {"tok_embeddings", "embed_tokens", "model.embed_tokens"};
    static const char *const norm[] = {"norm", "model.norm"}, *const head[] = {"output", "lm_head"};
#define PP_IS(name, set) pp_name_in(name, set, (int)(sizeof set / sizeof set[0]))
    char group[4096], item[128];
    int V = 0, next = 0, has_embed = 0, has_norm = 0, has_head = 0;
    const char *key = "parallelism.module_fqns_per_model_part";
    for (const char *g = fqns; (g = cfg_group_next(g, group, sizeof group)); V++) {
        if (V >= L) return ct_fail(e, CT_ERR_CONFIG, "%s: %s: more stages than the model's %d layers", where, key, L), -1;
        first[V] = next;
        for (const char *q = group; (q = cfg_list_next(q, item, sizeof item));) {
            const char *num = !strncmp(item, "layers.", 7) ? item + 7 : !strncmp(item, "model.layers.", 13) ? item + 13
                                                                                                           : NULL;
            if (num) {
                char *end;
                long l = strtol(num, &end, 10);
                if (end == num || *end || l < 0 || l >= L)
                    return ct_fail(e, CT_ERR_CONFIG, "%s: %s: stage %d: \"%s\" is not a layer of the model's %d",
                                   where, key, V, item, L), -1;
                if (l != next)
                    return ct_fail(e, CT_ERR_CONFIG,
                                   "%s: %s: stage %d: \"%s\" where layers.%d comes next: ctitan's stages hold "
                                   "consecutive layers, each once, in order",
                                   where, key, V, item, next), -1;
                next++;
            } else if (PP_IS(item, embed) || PP_IS(item, norm) || PP_IS(item, head)) {
                int is_embed = PP_IS(item, embed);
                if (is_embed ? V != 0 : g[0] != '\0')
                    return ct_fail(e, CT_ERR_CONFIG, "%s: %s: stage %d holds \"%s\", which ctitan runs on the %s stage",
                                   where, key, V, item, is_embed ? "first" : "last"), -1;
                *(is_embed ? &has_embed : PP_IS(item, norm) ? &has_norm : &has_head) = 1;
            } else {
                return ct_fail(e, CT_ERR_CONFIG,
                               "%s: %s: stage %d: \"%s\" is not a module ctitan places (tok_embeddings, layers.N, "
                               "norm, output; or embed_tokens, lm_head)",
                               where, key, V, item), -1;
            }
        }
        if (next == first[V])
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s: stage %d holds no layer; ctitan's stages hold at least one",
                           where, key, V), -1;
    }
#undef PP_IS
    if (next != L || !has_embed || !has_norm || !has_head)
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s: %s", where, key,
                       next != L   ? "the stages do not hold every layer"
                       : !has_embed ? "the first stage must hold tok_embeddings"
                                    : "the last stage must hold norm and output"), -1;
    first[V] = L;
    return V;
}

/* -------------------------------------------------------------- schedules */

/* This rank's forward order, backward order and warm-up count. */
static void build_orders(pp_sched *p, pp_action *fwd, pp_action *bwd, int *warmup) {
    int P = p->P, S = p->S, M = p->M, r = p->rank, nf = 0, nb = 0;
    if (p->schedule == PP_INTERLEAVED) {
        /* torch's ScheduleInterleaved1F1B (Megatron's order, made flexible): rounds of
         * per = M / max(1, M / P) micro-batches (P when P divides M), chunk by chunk
         * forwards (0 .. S-1) and backwards (S-1 .. 0) */
        int per = M / (M / P > 1 ? M / P : 1);
        for (int g = 0; g < M; g += per)
            for (int c = 0; c < S; c++)
                for (int i = g; i < g + per && i < M; i++) fwd[nf++] = (pp_action){'F', c, i};
        for (int g = 0; g < M; g += per)
            for (int c = S - 1; c >= 0; c--)
                for (int i = g; i < g + per && i < M; i++) bwd[nb++] = (pp_action){'B', c, i};
        *warmup = 2 * (P - r - 1) + (S - 1) * per;
    } else if (p->schedule == PP_LOOPED_BFS) {
        /* torch's ScheduleLoopedBFS: every micro-batch through local stage 0,
         * then stage 1, ...; the backwards from the last local stage down,
         * each stage's micro-batches last to first */
        for (int c = 0; c < S; c++)
            for (int i = 0; i < M; i++) fwd[nf++] = (pp_action){'F', c, i};
        for (int c = S - 1; c >= 0; c--)
            for (int i = M - 1; i >= 0; i--) bwd[nb++] = (pp_action){'B', c, i};
        *warmup = S * M;
    } else {
        for (int i = 0; i < M; i++) {
            fwd[nf++] = (pp_action){'F', 0, i};
            bwd[nb++] = (pp_action){'B', 0, i};
        }
        *warmup = p->schedule == PP_GPIPE ? M : P - r - 1;
    }
    if (*warmup > S * M) *warmup = S * M;
}

static void interleave(pp_action *out, const pp_action *fwd, const pp_action *bwd, int n, int warmup) {
    int k = 0, f = 0, b = 0;
    while (f < warmup) out[k++] = fwd[f++];
    while (f < n || b < n) {
        if (f < n) out[k++] = fwd[f++];
        if (b < n) out[k++] = bwd[b++];
    }
}

/* torch's ScheduleInterleavedZeroBubble (ZB1P) for rank r, its no-op
 * padding left out: ops 0 .. S M + warm-up - 1, forwards alone during the
 * warm-up, then a forward and an input backward (I) each, then input
 * backwards alone; from the (r + 1)-th I on, each is followed by the weight
 * backward (W) of the oldest I still without one, and the W's left over end
 * the step. Local stages go round in blocks of micro-batches of a round
 * (M / max(1, M / P)): forwards 0 .. S-1, input backwards S-1 .. 0. */
static void zb_order(const pp_sched *p, int r, pp_action *out) {
    int P = p->P, S = p->S, M = p->M, rounds = M / P > 1 ? M / P : 1, per = M / rounds;
    int warm = (S - 1) * per + (P - 1 - r), n_mb = S * M, k = 0, nw = 0;
    if (warm > n_mb) warm = n_mb;
    int *fmb = calloc((size_t)3 * S, sizeof *fmb), *bmb = fmb + S, *wmb = fmb + 2 * S;
#define ZB_BSTAGE(op) (S - 1 - (((op) - warm) / per) % S)
    for (int op = 0; op < n_mb + warm; op++) {
        if (op < n_mb) {
            int c = (op / per) % S;
            out[k++] = (pp_action){'F', c, fmb[c]++};
        }
        if (op < warm) continue;
        int c = ZB_BSTAGE(op);
        out[k++] = (pp_action){'I', c, bmb[c]++};
        if (op - warm >= r) { /* the W of the nw-th I: op ids of the I's are warm, warm + 1, ... */
            int cw = ZB_BSTAGE(warm + nw);
            out[k++] = (pp_action){'W', cw, wmb[cw]++};
            nw++;
        }
    }
    while (nw < n_mb) {
        int cw = ZB_BSTAGE(warm + nw);
        out[k++] = (pp_action){'W', cw, wmb[cw]++};
        nw++;
    }
#undef ZB_BSTAGE
    free(fmb);
}

/* Actions of a rank in a step: a forward and a backward of each (local stage,
 * micro-batch), the zero-bubble schedules' backward as two, I and W (at most:
 * DualPipeV splits some backwards only). */
static int n_actions(const pp_sched *p) { return (p->schedule >= PP_ZB_INTERLEAVED ? 3 : 2) * p->S * p->M; }

/* torch's ScheduleZBVZeroBubble for rank r (local stage 0: v = r, 1: v = 2 P - 1 - r), its
 * no-op padding left out: the order of max(2 P - 1, M) micro-batches, those past M dropped. */
static void zbv_put(pp_action *out, int *k, int M, char kind, int c, int i) {
    if (i < M) out[(*k)++] = (pp_action){kind, c, i};
}
static void zbv_order(const pp_sched *p, int r, pp_action *out) {
    int P = p->P, M = p->M, n = M > 2 * P - 1 ? M : 2 * P - 1, k = 0;
    int f0 = 0, f1 = 0, b0 = 0, b1 = 0;
    for (int j = 0; j < 2 * (P - r) - 1; j++) zbv_put(out, &k, M, 'F', 0, f0++);
    for (int j = 0; j < r; j++) {
        zbv_put(out, &k, M, 'F', 1, f1++);
        zbv_put(out, &k, M, 'F', 0, f0++);
    }
    for (int j = 0; j < P - r; j++) {
        zbv_put(out, &k, M, 'F', 1, f1++);
        zbv_put(out, &k, M, 'I', 1, b1);
        zbv_put(out, &k, M, 'W', 1, b1++);
    }
    while (f1 < f0 || f0 < n) {
        if (f0 < n) zbv_put(out, &k, M, 'F', 0, f0++);
        zbv_put(out, &k, M, 'I', 0, b0);
        zbv_put(out, &k, M, 'W', 0, b0++);
        zbv_put(out, &k, M, 'F', 1, f1++);
        zbv_put(out, &k, M, 'I', 1, b1);
        zbv_put(out, &k, M, 'W', 1, b1++);
    }
    int w0 = b0, w1 = b1; /* the cooldown: input backwards first, the weights' after */
    for (int j = 0; j < r; j++) {
        zbv_put(out, &k, M, 'I', 0, b0++);
        zbv_put(out, &k, M, 'I', 1, b1++);
    }
    for (int j = 0; j < P - r; j++) {
        zbv_put(out, &k, M, 'I', 0, b0++);
        zbv_put(out, &k, M, 'W', 0, w0++);
    }
    while (w1 < b1) zbv_put(out, &k, M, 'W', 1, w1++);
    while (w0 < b0) zbv_put(out, &k, M, 'W', 0, w0++);
}

/* torch's ScheduleDualPipeV for rank r (the V placement, as ZBV; M >= 2 P),
 * its steps 1-8 as torch builds them: forwards, whole backwards (B), input
 * backwards (I) whose W torch queues and emits oldest first, and its
 * OVERLAP_F_B pairs (a forward of one local stage beside a whole backward of
 * the other) as the forward then the backward: torch's runtime runs a pair's
 * two sub-actions one after the other unless a model registers a function
 * that overlaps them, and on a CPU both would share the same cores. Returns
 * the action count (B counts once where I and W count twice). */
typedef struct {
    pp_action *out;
    int k, f[2], b[2]; /* actions so far; next forward / backward micro-batch per local stage */
    pp_action *wq;     /* the I's waiting for their W, oldest first */
    int wq0, wqn;
} dpv_state;
static void dpv_add(dpv_state *d, char kind, int c) {
    int mb = kind == 'F' ? d->f[c]++ : d->b[c]++;
    d->out[d->k++] = (pp_action){kind, c, mb};
    if (kind == 'I') d->wq[d->wqn++] = (pp_action){'W', c, mb};
}
static void dpv_w(dpv_state *d) {
    if (d->wq0 < d->wqn) d->out[d->k++] = d->wq[d->wq0++];
}
static int dualpipev_order(const pp_sched *p, int r, pp_action *out) {
    int P = p->P, M = p->M, zb = 0;
    dpv_state d = {.out = out, .wq = malloc((size_t)2 * M * sizeof(pp_action))};
    for (int j = 0; j < 2 * (P - r - 1); j++) dpv_add(&d, 'F', 0);
    for (int j = 0; j < r + 1; j++) dpv_add(&d, 'F', 0), dpv_add(&d, 'F', 1);
    for (int j = 0; j < P - r - 1; j++) dpv_add(&d, 'I', 1), dpv_w(&d), dpv_add(&d, 'F', 1);
    for (int j = 0; j < M - 2 * P + r + 1; j++) { /* F0 B1, F1 B0: torch's overlapped pairs */
        dpv_add(&d, 'F', 0), dpv_add(&d, 'B', 1);
        dpv_add(&d, 'F', 1), dpv_add(&d, 'B', 0);
    }
    for (int j = 0; j < P - r - 1; j++) dpv_add(&d, 'B', 1), dpv_add(&d, 'F', 1), dpv_add(&d, 'B', 0);
    for (int j = 0; j < r + 1; j++) { /* the second half of the backwards split, from the middle on */
        if (j == (r + 1) / 2 && r % 2 == 1) zb = 1;
        dpv_add(&d, zb ? 'I' : 'B', 1);
        if (j == (r + 1) / 2 && r % 2 == 0) zb = 1;
        dpv_add(&d, zb ? 'I' : 'B', 0);
    }
    for (int j = 0; j < P - r - 1; j++) dpv_w(&d), dpv_add(&d, zb ? 'I' : 'B', 0);
    for (int j = 0; j < r + 1; j++) dpv_w(&d);
    free(d.wq);
    return d.k;
}

/* Every rank's order of actions, [P][n_actions at most] (malloc'd rows; len[r]
 * gets rank r's count): the schedule its rank runs, which the simulation and
 * the receives' order both read. */
static pp_action **rank_orders(const pp_sched *p, int *len) {
    int n = 2 * p->S * p->M, warm;
    pp_action **ord = calloc((size_t)p->P, sizeof *ord);
    pp_action *fw = malloc((size_t)n * sizeof *fw), *bw = malloc((size_t)n * sizeof *bw);
    for (int r = 0; r < p->P; r++) {
        ord[r] = malloc((size_t)n_actions(p) * sizeof **ord);
        len[r] = p->schedule >= PP_ZB_INTERLEAVED ? 3 * n / 2 : n;
        if (p->schedule == PP_DUALPIPEV) {
            len[r] = dualpipev_order(p, r, ord[r]);
            continue;
        }
        if (p->schedule == PP_ZB_INTERLEAVED || p->schedule == PP_ZBV) {
            (p->schedule == PP_ZBV ? zbv_order : zb_order)(p, r, ord[r]);
            continue;
        }
        pp_sched q = *p;
        q.rank = r;
        build_orders(&q, fw, bw, &warm);
        interleave(ord[r], fw, bw, n / 2, warm);
    }
    free(fw);
    free(bw);
    return ord;
}

/* ------------------------------------------------------------ CSV orders */

/* torchtitan's pipeline_parallel_schedule_csv: torch's _PipelineScheduleRuntime
 * reads it (_load_csv, format "compute_only"): one row per pipeline rank, one
 * cell per action as torch's _Action prints it, [virtual stage][kind][micro-
 * batch] ("2F0", "0B3", "1I2", "1W2"), an empty cell a no-op; an OVERLAP_F_B
 * cell "(0F4;3B1)OVERLAP_F_B" (DualPipeV's pairs) runs its sub-actions one
 * after the other, as torch's runtime does without an overlap function. The
 * stages and their ranks are the schedule name's (torchtitan builds the stages
 * from it: one a rank for 1F1B and GPipe, else 2 or the split's, the loop or
 * the V), so a cell of a stage another rank holds is refused, where torch
 * would move the stage. A cell's text, for the errors. */
typedef struct {
    const char *path, *where, *text;
    int row, cell;
} csv_at;

static int csv_fail(ct_err *e, const csv_at *at, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int csv_fail(ct_err *e, const csv_at *at, const char *fmt, ...) {
    char why[640];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, sizeof why, fmt, ap);
    va_end(ap);
    if (at->cell > 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_schedule_csv \"%s\": row %d (pipeline rank %d), cell %d "
                       "\"%s\": %s",
                       at->where, at->path, at->row + 1, at->row, at->cell, at->text, why);
    if (at->row >= 0)
        return ct_fail(e, CT_ERR_CONFIG, "%s: parallelism.pipeline_parallel_schedule_csv \"%s\": row %d (pipeline "
                       "rank %d): %s", at->where, at->path, at->row + 1, at->row, why);
    return ct_fail(e, CT_ERR_CONFIG, "%s: parallelism.pipeline_parallel_schedule_csv \"%s\": %s", at->where,
                   at->path, why);
}

/* One action "[stage][kind][micro-batch]" of s (length n), F B I W only. */
static int csv_action(const char *s, size_t n, pp_action *a, int *v, const csv_at *at, ct_err *e) {
    /* torch's other kinds: the compute_comms format's, which a compute_only schedule may not hold */
    static const char *const comms[] = {"WAIT_REDUCE_GRAD", "WAIT_SEND_F", "WAIT_SEND_B", "REDUCE_GRAD", "UNSHARD",
                                        "RESHARD", "SEND_F", "RECV_F", "SEND_B", "RECV_B"};
    size_t k = 0;
    long stage = 0, mb = 0;
    while (k < n && s[k] >= '0' && s[k] <= '9' && stage < 1000000) stage = stage * 10 + (s[k++] - '0');
    if (k == 0 || k == n)
        return csv_fail(e, at, "not an action [stage][F, B, I or W][micro-batch] as torch's _Action prints it "
                        "(e.g. 2F0)");
    for (size_t j = 0; j < sizeof comms / sizeof *comms; j++)
        if (n - k >= strlen(comms[j]) && !strncmp(s + k, comms[j], strlen(comms[j])))
            return csv_fail(e, at, "%s is a communication action, of torch's \"compute_comms\" format; torchtitan "
                            "loads the \"compute_only\" format (F, B, I, W; the sends and receives derived), as "
                            "ctitan does", comms[j]);
    if (!strchr("FBIW", s[k]))
        return csv_fail(e, at, "not an action [stage][F, B, I or W][micro-batch] as torch's _Action prints it "
                        "(e.g. 2F0)");
    char kind = s[k++];
    size_t m0 = k;
    while (k < n && s[k] >= '0' && s[k] <= '9' && mb < 1000000) mb = mb * 10 + (s[k++] - '0');
    if (k == m0)
        return csv_fail(e, at, "%c has no micro-batch (e.g. %ld%c0)", kind, stage, kind);
    if (k != n)
        return csv_fail(e, at, "not an action [stage][F, B, I or W][micro-batch] as torch's _Action prints it "
                        "(e.g. 2F0)");
    *a = (pp_action){kind, 0, (int)mb};
    *v = (int)stage;
    return 0;
}

/* Splits a CSV line into cells (commas; a cell in double quotes may hold
 * them, "" is a quote), trimmed of blanks as torch's _Action.from_str. */
static int csv_cells(char *line, char ***cells) {
    int n = 0, cap = 16;
    char **out = malloc((size_t)cap * sizeof *out);
    char *w = line;
    for (const char *r = line;;) {
        if (n == cap) out = realloc(out, (size_t)(cap *= 2) * sizeof *out);
        char *start = w;
        int quoted = 0;
        while (*r && (quoted || *r != ',')) {
            if (*r == '"' && quoted && r[1] == '"') *w++ = '"', r += 2;
            else if (*r == '"') quoted = !quoted, r++;
            else *w++ = *r++;
        }
        int end = !*r;
        r += !end;
        *w++ = '\0';
        while (*start == ' ' || *start == '\t') start++;
        for (size_t l = strlen(start); l && (start[l - 1] == ' ' || start[l - 1] == '\t');) start[--l] = '\0';
        out[n++] = start;
        if (end) break;
    }
    *cells = out;
    return n;
}

/* Every rank's order from the CSV at path, [P][...] (len[r]: rank r's count),
 * checked: one row per rank; each (stage, micro-batch) forward once on the
 * rank holding the stage and its backward once, as B or as I then W (I and W
 * with a schedule that splits the backward only); stages and micro-batches in
 * range. NULL with *e set, naming the file and the cell. cell[r][k]: the cell
 * of action k (for the deadlock's error). */
static pp_action **csv_orders(const pp_sched *p, const char *path, const char *sched, int *len, int ***cellp,
                              const char *where, ct_err *e) {
    int P = p->P, V = p->V, M = p->M, split = p->schedule >= PP_ZB_INTERLEAVED, rows = 0, rc = 0;
    csv_at at = {path, where, "", -1, 0};
    struct stat st;
    FILE *f = stat(path, &st) == 0 && S_ISREG(st.st_mode) ? fopen(path, "r") : NULL;
    if (!f) {
        csv_fail(e, &at, "does not exist or is not a file (torchtitan's FileNotFoundError)");
        return NULL;
    }
    char **lines = NULL, *line = NULL;
    size_t cap = 0;
    for (ssize_t got; (got = getline(&line, &cap, f)) >= 0; rows++) {
        while (got > 0 && (line[got - 1] == '\n' || line[got - 1] == '\r')) line[--got] = '\0';
        lines = realloc(lines, (size_t)(rows + 1) * sizeof *lines);
        lines[rows] = strdup(line);
    }
    free(line);
    fclose(f);
    pp_action **ord = calloc((size_t)P, sizeof *ord);
    int **cell = calloc((size_t)P, sizeof *cell);
    /* per (stage, micro-batch): the cell of its F, B, I, W (0: none yet) */
    size_t vm = (size_t)V * M;
    int *fcell = calloc(4 * vm, sizeof *fcell), *bcell = fcell + vm, *icell = bcell + vm, *wcell = icell + vm;
    if (rows != P)
        rc = csv_fail(e, &at, "%d rows, but parallelism.pipeline_parallel_degree is %d: one row per pipeline rank",
                      rows, P);
    for (int r = 0; !rc && r < P; r++) {
        char **cells;
        int n = csv_cells(lines[r], &cells), most = 0;
        for (int k = 0; k < n; k++) /* a cell's actions: 1, a group's one more a ';' */
            for (const char *q = cells[k]; *q; q++) most += q == cells[k] || *q == ';';
        ord[r] = malloc((size_t)(most + 1) * sizeof **ord);
        cell[r] = malloc((size_t)(most + 1) * sizeof **cell);
        len[r] = 0;
        for (int k = 0; !rc && k < n; k++) {
            at = (csv_at){path, where, cells[k], r, k + 1};
            const char *s = cells[k], *close = strchr(s, ')');
            if (!*s) continue; /* torch's no-op (None) */
            int pair = s[0] == '(' && close;
            if (pair && strcmp(close + 1, "OVERLAP_F_B")) {
                rc = csv_fail(e, &at, "a group of actions is taken as OVERLAP_F_B only (torch's compute kinds: F, "
                              "B, I, W, OVERLAP_F_B)");
                break;
            }
            /* the group's sub-actions in order, or the cell's one action */
            for (const char *a0 = pair ? s + 1 : s; !rc;) {
                const char *a1 = pair ? a0 + strcspn(a0, ";)") : s + strlen(s);
                while (a0 < a1 && *a0 == ' ') a0++;
                size_t an = (size_t)(a1 - a0);
                while (an && a0[an - 1] == ' ') an--;
                pp_action a = {0, 0, 0};
                int v = 0;
                if ((rc = csv_action(a0, an, &a, &v, &at, e))) break;
                if (v >= V) {
                    rc = csv_fail(e, &at, "stage %d: schedule %s gives %d stages (0 .. %d)", v, sched, V, V - 1);
                    break;
                }
                if (a.mb >= M) {
                    rc = csv_fail(e, &at, "micro-batch %d: a step has %d (0 .. %d)", a.mb, M, M - 1);
                    break;
                }
                if (owner(p, v) != r) {
                    rc = csv_fail(e, &at, "stage %d is held by pipeline rank %d (schedule %s's placement: %s), not "
                                  "by rank %d", v, owner(p, v), sched,
                                  v_placed(p) ? "the V, rank r holds r and 2P-1-r" : "the loop, rank r holds r, "
                                  "r+P, ...", r);
                    break;
                }
                if ((a.kind == 'I' || a.kind == 'W') && !split) {
                    rc = csv_fail(e, &at, "%c: a split backward (I then W) is taken only with a schedule that "
                                  "splits it (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV); schedule %s runs "
                                  "whole backwards (B)", a.kind, sched);
                    break;
                }
                size_t x = (size_t)v * M + a.mb;
                int *seen = a.kind == 'F' ? fcell : a.kind == 'W' ? wcell : a.kind == 'B' ? bcell : icell;
                int back = bcell[x] ? bcell[x] : icell[x]; /* its backward's cell, B or I */
                if (seen[x] || ((a.kind == 'B' || a.kind == 'I') && back)) {
                    rc = csv_fail(e, &at, "a second %s of stage %d micro-batch %d (the first: cell %d)",
                                  a.kind == 'F' ? "forward" : a.kind == 'W' ? "W" : "backward", v, a.mb,
                                  seen[x] ? seen[x] : back);
                    break;
                }
                if (a.kind != 'F' && a.kind != 'W' && !fcell[x]) {
                    rc = csv_fail(e, &at, "the backward of stage %d micro-batch %d comes before its forward (%dF%d)",
                                  v, a.mb, v, a.mb);
                    break;
                }
                if (a.kind == 'W' && !icell[x]) {
                    rc = bcell[x] ? csv_fail(e, &at, "W of stage %d micro-batch %d, whose backward ran whole (B, cell "
                                             "%d): a W follows its I", v, a.mb, bcell[x])
                                  : csv_fail(e, &at, "W of stage %d micro-batch %d comes before its I (%dI%d): the "
                                             "weight gradients need what I records", v, a.mb, v, a.mb);
                    break;
                }
                seen[x] = k + 1;
                a.stage = local_of(p, v);
                cell[r][len[r]] = k + 1;
                ord[r][len[r]++] = a;
                if (!pair || !*a1 || *a1 == ')') break;
                a0 = a1 + 1;
            }
        }
        free(cells);
    }
    for (int v = 0; !rc && v < V; v++)
        for (int i = 0; !rc && i < M; i++) {
            size_t x = (size_t)v * M + i;
            at = (csv_at){path, where, "", owner(p, v), 0};
            if (!fcell[x]) rc = csv_fail(e, &at, "stage %d micro-batch %d has no forward (%dF%d)", v, i, v, i);
            else if (!bcell[x] && !icell[x])
                rc = csv_fail(e, &at, "stage %d micro-batch %d has no backward (%dB%d%s)", v, i, v, i,
                              split ? ", or I then W" : "");
            else if (icell[x] && !wcell[x])
                rc = csv_fail(e, &at, "stage %d micro-batch %d has its I (cell %d) but no W (%dW%d)", v, i, icell[x],
                              v, i);
        }
    free(fcell);
    for (int r = 0; r < rows; r++) free(lines[r]);
    free(lines);
    if (rc) {
        for (int r = 0; r < P; r++) free(ord[r]), free(cell[r]);
        free(ord);
        free(cell);
        return NULL;
    }
    *cellp = cell;
    return ord;
}

/* The order each virtual stage's forwards and backwards run in, from its
 * rank's schedule (LoopedBFS runs backwards last micro-batch first). */
static void send_orders(pp_sched *p, pp_action *const *ord, const int *len) {
    int P = p->P, M = p->M;
    p->fseq = malloc((size_t)p->V * M * sizeof *p->fseq);
    p->bseq = malloc((size_t)p->V * M * sizeof *p->bseq);
    int *nf = calloc((size_t)p->V, sizeof *nf), *nb = calloc((size_t)p->V, sizeof *nb);
    for (int r = 0; r < P; r++)
        for (int k = 0; k < len[r]; k++) {
            int v = vstage_of(p, r, ord[r][k].stage);
            if (ord[r][k].kind == 'F') p->fseq[(size_t)v * M + nf[v]++] = ord[r][k].mb;
            else if (ord[r][k].kind != 'W') p->bseq[(size_t)v * M + nb[v]++] = ord[r][k].mb;
        }
    free(nf);
    free(nb);
}

/* Runs every rank's order with stage costs (B = 2 F, its halves I = W = F),
 * dependencies F(v, i) after F(v-1, i), B or I(v, i) after B or I(v+1, i)
 * and F(v, i), W(v, i) after I(v, i). Returns the bubble (idle share of P x
 * makespan), or -1 when no rank can go on (an order that would deadlock:
 * also a W before its I). max_inflight: this rank's most forwards whose
 * backward (B or I: W reads copies, not the bank) has not run. stuck (NULL:
 * not wanted): [P] where each rank's order stopped (len[r]: it ended). */
static double simulate(const pp_sched *p0, pp_action *const *ord, const int *len, int *max_inflight, int *stuck) {
    int P = p0->P, V = p0->V, M = p0->M;
    size_t nr = P > 0 ? (size_t)P : 1;
    int *pos = calloc(nr, sizeof *pos);
    double *clock = calloc(nr, sizeof *clock), busy = 0;
    double *fdone = malloc((size_t)V * M * sizeof *fdone), *bdone = malloc((size_t)V * M * sizeof *bdone);
    for (size_t i = 0; i < (size_t)V * M; i++) fdone[i] = bdone[i] = -1;
    int left = 0, inflight = 0, most = 0;
    for (int r = 0; r < P; r++) left += len[r];
    while (left) {
        int moved = 0;
        for (int r = 0; r < P; r++) {
            while (pos[r] < len[r]) {
                pp_action a = ord[r][pos[r]];
                int v = vstage_of(p0, r, a.stage);
                double ready;
                if (a.kind == 'F') ready = v == 0 ? 0 : fdone[(size_t)(v - 1) * M + a.mb];
                else if (a.kind == 'W') ready = bdone[(size_t)v * M + a.mb];
                else {
                    double x = fdone[(size_t)v * M + a.mb], y = v == V - 1 ? 0 : bdone[(size_t)(v + 1) * M + a.mb];
                    ready = x < 0 || y < 0 ? -1 : (x > y ? x : y);
                }
                if (ready < 0) break;
                double cost = p0->cost[v] * (a.kind == 'B' ? 2.0 : 1.0);
                double start = clock[r] > ready ? clock[r] : ready;
                clock[r] = start + cost;
                busy += cost;
                if (a.kind != 'W') (a.kind == 'F' ? fdone : bdone)[(size_t)v * M + a.mb] = clock[r];
                if (r == p0->rank && a.kind != 'W') {
                    inflight += a.kind == 'F' ? 1 : -1;
                    if (inflight > most) most = inflight;
                }
                pos[r]++;
                left--;
                moved = 1;
            }
        }
        if (!moved) break;
    }
    double span = 0;
    for (int r = 0; r < P; r++) span = clock[r] > span ? clock[r] : span;
    if (stuck) memcpy(stuck, pos, (size_t)P * sizeof *pos);
    free(pos);
    free(clock);
    free(fdone);
    free(bdone);
    *max_inflight = most;
    if (left) return -1;
    return span > 0 ? 1.0 - busy / (P * span) : 0;
}

int pp_plan(pp_sched *p, const ct_config *c, const lm_config *mc, int P, int rank, int M, const char *where,
            ct_err *e) {
    memset(p, 0, sizeof *p);
    int rc = pp_schedule_parse(c->pp_schedule, &p->schedule, where, e);
    if (rc) return rc;
    /* torchtitan's looped schedules: 2 stages a rank by default, at least 2 with split points */
    int L = mc->n_layers, multi = p->schedule == PP_INTERLEAVED || p->schedule == PP_LOOPED_BFS ||
                                  p->schedule >= PP_ZB_INTERLEAVED;
    p->P = P;
    p->rank = rank;
    p->M = M;
    p->mb_size = c->pp_microbatch;
    p->first = calloc((size_t)L + 2, sizeof *p->first);
    int V, even = c->pp_layers_per_stage > 0 || c->pp_first_less >= 0 || c->pp_last_less >= 0;
    int in = c->pp_first_less >= 0 ? c->pp_first_less : 1, out = c->pp_last_less >= 0 ? c->pp_last_less : 1;
    /* what places the layers, if anything but the split by cost does */
    const char *placer = c->pp_split[0] ? "pipeline_parallel_split_points"
                         : c->pp_fqns[0] ? "module_fqns_per_model_part"
                                         : "the model's layers";
    const char *even_key = c->pp_layers_per_stage > 0 ? "pipeline_parallel_layers_per_stage"
                           : c->pp_first_less >= 0    ? "pipeline_parallel_first_stage_less_layers"
                                                      : "pipeline_parallel_last_stage_less_layers";
    if ((even || c->pp_split[0]) && c->pp_fqns[0])
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.module_fqns_per_model_part and %s both place the layers: give one of them",
                       where, even ? even_key : "pipeline_parallel_split_points");
    if (even && c->pp_split[0])
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_split_points and %s both place the layers: give one of them",
                       where, even_key);
    if (c->pp_split[0]) {
        V = parse_points(c->pp_split, L, p->first, L + 1, where, e);
        if (V < 0) return CT_ERR_CONFIG;
        p->first[V] = L;
    } else if (c->pp_fqns[0]) {
        if ((V = parse_fqns(c->pp_fqns, L, p->first, where, e)) < 0) return CT_ERR_CONFIG;
    } else if (c->pp_layers_per_stage > 0) { /* torchtitan's count: ceil of the effective layers */
        int k = c->pp_layers_per_stage;
        V = (L + in + out + k - 1) / k;
        const char *fix = V % P ? "to a value giving a multiple of the degree"
                          : !multi && V != P ? "so that each rank holds one stage"
                          : multi && V < 2 * P ? "so that each rank holds at least 2 stages"
                          : v_placed(p) && V != 2 * P ? "so that each rank holds exactly 2 stages"
                                                      : NULL;
        if (fix)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: parallelism.pipeline_parallel_layers_per_stage = %d gives ceil((%d layers + %d + %d) / "
                           "%d) = %d stages over pipeline_parallel_degree %d, which schedule \"%s\" cannot take: "
                           "change it %s",
                           where, k, L, in, out, k, V, P, c->pp_schedule, fix);
    } else {
        V = multi ? 2 * P : P;
        if (V > L) /* the default needs a layer per stage: say so, not the stage count it fell back to */
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: parallelism.pipeline_parallel_schedule = \"%s\" with pipeline_parallel_degree %d "
                           "needs %d stages (%s), each of at least one layer, but the model has %d layer%s: use "
                           "%sa smaller pipeline_parallel_degree",
                           where, c->pp_schedule, P, V, multi ? "two per rank" : "one per rank", L, L == 1 ? "" : "s",
                           multi ? "1F1B or GPipe, or " : "");
    }
    /* torch's ZBV and DualPipeV: exactly two a rank; said before the looped schedules'
     * rule, which 3 P stages would meet */
    if (v_placed(p) && V != 2 * P)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_schedule = \"%s\" needs exactly 2 stages per rank (%d "
                       "with pipeline_parallel_degree %d), but %s gives %d",
                       where, c->pp_schedule, 2 * P, P, placer, V);
    if (V % P != 0 || (!multi && V != P) || (multi && V < 2 * P))
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: parallelism.pipeline_parallel_schedule = \"%s\" with pipeline_parallel_degree %d needs %s "
                       "stages, but %s gives %d",
                       where, c->pp_schedule, P,
                       multi ? "a multiple of the degree, at least twice it," : "one per rank, P",
                       placer, V);
    if (even && (rc = split_even(V, L, in, out, p->first, where, e))) return rc; /* its own words first */
    if (V > L)
        return ct_fail(e, CT_ERR_CONFIG, "%s: %d pipeline stages need at least %d layers; the model has %d", where, V,
                       V, L);
    const char *csv = c->pp_csv; /* a CSV order (torch's _PipelineScheduleRuntime): the name's own rules go */
    if (!csv[0] && p->schedule == PP_DUALPIPEV && M < V) /* torch's rule: its warm-up fills both stages of every rank */
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: DualPipeV needs at least as many micro-batches as stages (%d), but a step has %d "
                       "(local_batch_size / pipeline_parallel_microbatch_size x gradient accumulation)",
                       where, V, M);
    p->V = V;
    p->S = V / P;
    if (!even && !c->pp_split[0] && !c->pp_fqns[0]) split_by_cost(mc, V, c->seq_len, p->first);
    /* torch's interleaved schedules: max(1, M / P) rounds of equal size */
    if (!csv[0] && (p->schedule == PP_INTERLEAVED || p->schedule == PP_ZB_INTERLEAVED) &&
        M % (M / P > 1 ? M / P : 1) != 0)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: %s takes micro-batches in %d rounds (micro-batches / pipeline_parallel_degree %d), which "
                       "must divide them, but a step has %d (local_batch_size / pipeline_parallel_microbatch_size x "
                       "gradient accumulation)",
                       where, c->pp_schedule, M / P, P, M);
    p->cost = calloc((size_t)V, sizeof *p->cost);
    for (int v = 0; v < V; v++) {
        for (int l = p->first[v]; l < p->first[v + 1]; l++) p->cost[v] += layer_cost(mc, l, c->seq_len);
        if (v == V - 1) p->cost[v] += head_cost(mc);
    }
    int *len = calloc((size_t)P, sizeof *len), *stuck = calloc((size_t)P, sizeof *stuck), **cell = NULL;
    pp_action **ord = csv[0] ? csv_orders(p, csv, c->pp_schedule, len, &cell, where, e) : rank_orders(p, len);
    if (!ord) {
        free(len);
        free(stuck);
        return CT_ERR_CONFIG;
    }
    /* every rank's order, hashed: each reads its own copy of a CSV, and one read other orders
     * (its rows misrouted the gradients or hung the pipeline); plan_local_model compares it */
    p->digest = 14695981039346656037ull;
    for (int r = 0; r < P; r++)
        for (int k = -1; k < len[r]; k++) {
            int w[3] = {len[r], r, 0};
            if (k >= 0) w[0] = ord[r][k].kind, w[1] = ord[r][k].stage, w[2] = ord[r][k].mb;
            for (int j = 0; j < 3; j++) p->digest = (p->digest ^ (uint32_t)w[j]) * 1099511628211ull;
        }
    p->n_act = len[rank];
    p->act = ord[rank]; /* this rank's, kept */
    send_orders(p, ord, len);
    p->bubble = simulate(p, ord, len, &p->max_banks, stuck);
    if (p->bubble < 0 && csv[0]) { /* each rank's first action that waits for what never comes */
        char ranks[320] = "";
        int r0 = -1;
        for (int r = 0, k = 0; r < P; r++)
            if (stuck[r] < len[r]) {
                pp_action a = ord[r][stuck[r]];
                if (r0 < 0) r0 = r;
                else if (k < (int)sizeof ranks - 64)
                    k += snprintf(ranks + k, sizeof ranks - (size_t)k, "; row %d waits at cell %d (%d%c%d)", r + 1,
                                  cell[r][stuck[r]], vstage_of(p, r, a.stage), a.kind, a.mb);
            }
        pp_action a = ord[r0][stuck[r0]];
        char text[32];
        snprintf(text, sizeof text, "%d%c%d", vstage_of(p, r0, a.stage), a.kind, a.mb);
        csv_at at = {csv, where, text, r0, cell[r0][stuck[r0]]};
        csv_fail(e, &at, "the order would deadlock: this action waits for one that never runs, every rank being "
                 "stuck on an action that waits too%s", ranks);
    } else if (p->bubble < 0) {
        ct_fail(e, CT_ERR_CONFIG, "%s: pipeline schedule %s with %d ranks and %d micro-batches would deadlock",
                where, c->pp_schedule, P, M);
    }
    free(len);
    free(stuck);
    for (int r = 0; r < P; r++) {
        if (r != rank) free(ord[r]);
        if (cell) free(cell[r]);
    }
    free(ord);
    free(cell);
    return p->bubble < 0 ? CT_ERR_CONFIG : 0;
}

void pp_hold(const pp_sched *p, lm_config *mc) {
    mc->pp_stage = 1;
    memset(mc->layer_held, 0, sizeof mc->layer_held);
    for (int c = 0; c < p->S; c++) {
        int v = vstage_of(p, p->rank, c);
        for (int l = p->first[v]; l < p->first[v + 1]; l++) mc->layer_held[l] = 1;
    }
}

/* ---------------------------------------------------------------- run time */

enum { BUF_AIN, BUF_GIN, BUF_AOUT, BUF_GOUT };

static float *buf(pp_sched *p, int c, int i, int k) { return p->buf + (((size_t)c * p->M + i) * 4 + k) * p->n; }
static comm_req *req(pp_sched *p, int c, int i, int k) { return &p->req[((size_t)c * p->M + i) * 4 + k]; }
static double *cnt(pp_sched *p, int c, int i, int k) { return p->cnt + (((size_t)c * p->M + i) * 4 + k) * p->E; }
static comm_req *cnt_req(pp_sched *p, int c, int i, int k) { return &p->cnt_req[((size_t)c * p->M + i) * 4 + k]; }

void pp_bind(pp_sched *p, ct_comm *comm, int B, int T, int H, int n_experts) {
    p->comm = comm;
    p->T = T;
    p->n = (size_t)B * T * H;
    size_t slots = (size_t)p->S * p->M * 4;
    p->buf = ct_calloc(slots * p->n + 1, sizeof(float));
    p->req = ct_calloc(slots, sizeof *p->req);
    p->banks = ct_calloc((size_t)p->S * p->M, sizeof *p->banks);
    p->pool = ct_calloc((size_t)p->S * (p->max_banks + 1), sizeof *p->pool);
    p->n_pool = ct_calloc((size_t)p->S, sizeof *p->n_pool);
    p->E = n_experts;
    p->moe_stats = ct_calloc((size_t)p->M * 2 * (n_experts ? n_experts : 1), sizeof(double));
    p->cnt = ct_calloc(slots * (n_experts ? n_experts : 1), sizeof(double));
    p->cnt_req = ct_calloc(slots, sizeof *p->cnt_req);
    p->loads = ct_calloc((size_t)p->first[p->V] * (n_experts ? n_experts : 1), sizeof(double));
    if (p->schedule >= PP_ZB_INTERLEAVED) {
        p->wst = ct_calloc((size_t)p->S * p->M, sizeof *p->wst);
        p->wcur = ct_calloc((size_t)p->S * p->M, sizeof *p->wcur);
        p->wfree = ct_calloc((size_t)p->S * p->M, sizeof *p->wfree);
        p->n_wfree = ct_calloc((size_t)p->S, sizeof *p->n_wfree);
        p->n_wst = ct_calloc((size_t)p->S, sizeof *p->n_wst);
    }
}

/* The store an I of local stage c (layers l0 .. l1-1, rows a micro-batch's)
 * fills: a replayed one, or one not used yet, sized to what it will hold
 * (the first steps reach the order's most pending, then none is added). */
static lm_wstore *take_wstore(pp_sched *p, int c, const lm_model *m, int l0, int l1, size_t rows) {
    if (p->n_wfree[c]) return p->wfree[(size_t)c * p->M + --p->n_wfree[c]];
    lm_wstore *s = &p->wst[(size_t)c * p->M + p->n_wst[c]++];
    lm_wstore_reserve(s, lm_wstore_floats(m, l0, l1, rows), 12 * (l1 - l0));
    return s;
}
static void give_wstore(pp_sched *p, int c, lm_wstore *st) { p->wfree[(size_t)c * p->M + p->n_wfree[c]++] = st; }

size_t pp_wstore_peak(const pp_sched *p) {
    size_t most = 0;
    for (size_t i = 0; p->wst && i < (size_t)p->S * p->M; i++) most = p->wst[i].peak > most ? p->wst[i].peak : most;
    return most;
}

void pp_free(pp_sched *p) {
    double waited = p->wait_all + p->wait_s, took = p->step_all + p->step_s;
    if (took > 0) /* this stage's part of the logged bubble (pp.h), on the ranks CTITAN_LOG_RANKS shows */
        fprintf(stderr, "ctitan: pipeline rank %d of %d waited for its inputs %.6f s of the %.6f s its steps took "
                "(%.6f)\n", p->rank, p->P, waited, took, waited / took);
    if (p->wst) { /* the split backward's deferred products: what they cost in memory */
        size_t sum = 0;
        int n = 0;
        for (size_t i = 0; i < (size_t)p->S * p->M; i++) sum += p->wst[i].size, n += p->wst[i].size > 0;
        if (sum)
            fprintf(stderr, "ctitan: pipeline rank %d of %d: the weight-gradient stores held at most %.0f bytes per "
                    "(stage, micro-batch); their %d buffers take %.0f bytes\n", p->rank, p->P,
                    4.0 * (double)pp_wstore_peak(p), n, 4.0 * (double)sum);
        for (size_t i = 0; i < (size_t)p->S * p->M; i++) lm_wstore_free(&p->wst[i]);
        free(p->wst);
        free(p->wcur);
        free(p->wfree);
        free(p->n_wfree);
        free(p->n_wst);
    }
    if (p->req)
        for (size_t i = 0; i < (size_t)p->S * p->M * 4; i++) comm_wait(&p->req[i]);
    if (p->cnt_req)
        for (size_t i = 0; i < (size_t)p->S * p->M * 4; i++) comm_wait(&p->cnt_req[i]);
    if (p->pool)
        for (int c = 0; c < p->S; c++)
            for (int k = 0; k < p->n_pool[c]; k++) lm_bank_free(p->pool[(size_t)c * (p->max_banks + 1) + k]);
    if (p->banks)
        for (size_t i = 0; i < (size_t)p->S * p->M; i++) lm_bank_free(p->banks[i]);
    free(p->banks);
    free(p->pool);
    free(p->n_pool);
    free(p->buf);
    free(p->req);
    free(p->moe_stats);
    free(p->cnt);
    free(p->cnt_req);
    free(p->loads);
    free(p->first);
    free(p->cost);
    free(p->act);
    free(p->fseq);
    free(p->bseq);
    memset(p, 0, sizeof *p);
}

static int vstage(const pp_sched *p, int c) { return vstage_of(p, p->rank, c); }

/* A bank for a forward of local stage c: a free one, or a new one (the
 * first steps grow the pool to the schedule's peak, then nothing is allocated). */
static lm_bank *take_bank(pp_sched *p, const lm_model *m, int c) {
    int v = vstage(p, c);
    if (p->n_pool[c]) return p->pool[(size_t)c * (p->max_banks + 1) + --p->n_pool[c]];
    return lm_bank_new(m, p->first[v], p->first[v + 1]);
}
static void give_bank(pp_sched *p, int c, lm_bank *b) {
    if (p->n_pool[c] <= p->max_banks) p->pool[(size_t)c * (p->max_banks + 1) + p->n_pool[c]++] = b;
    else lm_bank_free(b);
}

/* FSDP around an action (pp.h): fwd 1 for a forward, and whether the head runs in it. */
static void fsdp_open(pp_sched *p, int fwd, int head, int l0) {
    if (!p->fsdp) return;
    p->fsdp->fwd_only = fwd;
    p->fsdp->no_embed = l0 > 0 && !(head && p->fsdp->tied);
    fsdp_microbatch_begin(p->fsdp);
    if (head && !fwd) fsdp_gather_head(p->fsdp); /* the last layer's forward gathers it otherwise */
}
static void fsdp_close(pp_sched *p) {
    if (!p->fsdp) return;
    fsdp_microbatch_end(p->fsdp);
    p->fsdp->fwd_only = p->fsdp->no_embed = 0;
}

static void wait_input(pp_sched *p, comm_req *r) {
    double t0 = ct_now();
    comm_wait(r);
    p->wait_s += ct_now() - t0;
}

/* Context parallel: a forward's moe_layer_stats saw a chunk, so the logged
 * loads are rebuilt from the tokens per expert the last forward of each
 * stage added to moe.tokens (what one rank's forward logs), summed over the
 * chunks. Every rank of cpg runs the same schedule: the sum pairs the same
 * micro-batch. */
static void loads_before(pp_sched *p, const lm_model *m, int l0, int l1) {
    size_t E = (size_t)p->E;
    memcpy(p->loads + l0 * E, m->moe.tokens + l0 * E, (size_t)(l1 - l0) * E * sizeof(double));
}
static void loads_after(pp_sched *p, const lm_model *m, int l0, int l1) {
    size_t E = (size_t)p->E;
    for (size_t x = l0 * E; x < l1 * E; x++) p->loads[x] = m->moe.tokens[x] - p->loads[x];
}
static void loads_sum(pp_sched *p, lm_model *m) {
    int L = p->first[p->V], E = p->E;
    comm_allreduce(p->cpg, p->loads, (size_t)L * E, COMM_F64, COMM_SUM);
    for (int l = 0; l < L; l++)
        if (lm_holds_layer(&m->cfg, l) && lm_layer_is_moe(&m->cfg, l))
            moe_load_range(p->loads + (size_t)l * E, E, &m->moe.load_min[l], &m->moe.load_max[l]);
}

double pp_step(pp_sched *p, lm_model *m, const int32_t *tokens, const int32_t *labels, long seq0, int seq_stride,
               float grad_scale) {
    double t_step = ct_now();
    int B = p->mb_size, T = p->T, V = p->V, E = p->E; /* training's length: the model may plan validation's */
    int aux = E && lm_aux_in_grad(&m->cfg); /* the expert counts travel too (pp.h) */
    size_t mbt = (size_t)B * T;
    /* every receive of the step, up front, in the order the neighbour sends: MPI
     * matches a pair's messages of one tag in posting order */
    for (int c = 0; c < p->S; c++) {
        int v = vstage(p, c);
        for (int k = 0; k < p->M; k++) {
            int i = v > 0 ? p->fseq[(size_t)(v - 1) * p->M + k] : 0;
            if (v > 0) comm_irecv(p->comm, buf(p, c, i, BUF_AIN), p->n, COMM_F32, owner(p, v - 1), 2 * v, req(p, c, i, BUF_AIN));
            if (aux && v > 0)
                comm_irecv(p->comm, cnt(p, c, i, BUF_AIN), (size_t)E, COMM_F64, owner(p, v - 1), 2 * V + 2 * v,
                           cnt_req(p, c, i, BUF_AIN));
            i = v < V - 1 ? p->bseq[(size_t)(v + 1) * p->M + k] : 0;
            if (v < V - 1)
                comm_irecv(p->comm, buf(p, c, i, BUF_GIN), p->n, COMM_F32, owner(p, v + 1), 2 * v + 1, req(p, c, i, BUF_GIN));
            if (aux && v < V - 1)
                comm_irecv(p->comm, cnt(p, c, i, BUF_GIN), (size_t)E, COMM_F64, owner(p, v + 1), 2 * V + 2 * v + 1,
                           cnt_req(p, c, i, BUF_GIN));
        }
    }
    if (E) memset(p->moe_stats, 0, (size_t)p->M * 2 * E * sizeof(double));
    double loss = 0;
    for (int k = 0; k < p->n_act; k++) {
        pp_action a = p->act[k];
        int c = a.stage, i = a.mb, v = vstage(p, c), l0 = p->first[v], l1 = p->first[v + 1];
        const int32_t *tk = tokens + (size_t)i * mbt, *lb = labels + (size_t)i * mbt;
        m->lora_seq0 = seq0 + (long)i * B * seq_stride, m->lora_seq_stride = seq_stride;
        if (a.kind == 'F') {
            lm_bank *b = p->banks[(size_t)c * p->M + i] = take_bank(p, m, c);
            lm_bank_use(m, b);
            if (v > 0) wait_input(p, req(p, c, i, BUF_AIN));
            fsdp_open(p, 1, 0, l0);
            if (E && p->cpg) loads_before(p, m, l0, l1);
            lm_stage_forward(m, l0, l1, tk, buf(p, c, i, BUF_AIN), buf(p, c, i, BUF_AOUT), B, T, 1);
            if (E && p->cpg) loads_after(p, m, l0, l1);
            fsdp_close(p);
            if (v < V - 1)
                comm_isend(p->comm, buf(p, c, i, BUF_AOUT), p->n, COMM_F32, owner(p, v + 1), 2 * (v + 1),
                           req(p, c, i, BUF_AOUT));
            if (E) /* the routing sums of this stage's MoE layers: the trainer adds the stages' */
                for (int x = 0; x < E; x++) {
                    p->moe_stats[(size_t)i * 2 * E + x] += m->moe.count[x];
                    p->moe_stats[(size_t)i * 2 * E + E + x] += m->moe.psum[x];
                }
            if (aux) { /* the counts of the stages so far, this one's added; on the last stage the totals */
                double *in = cnt(p, c, i, BUF_AIN), *out = cnt(p, c, i, BUF_AOUT);
                if (v > 0) wait_input(p, cnt_req(p, c, i, BUF_AIN));
                for (int x = 0; x < E; x++) out[x] = (v > 0 ? in[x] : 0.0) + m->moe.count[x];
                if (v < V - 1)
                    comm_isend(p->comm, out, (size_t)E, COMM_F64, owner(p, v + 1), 2 * V + 2 * (v + 1),
                               cnt_req(p, c, i, BUF_AOUT));
            }
        } else if (a.kind == 'W') { /* the weight gradients I left (pp.h): they reduce into FSDP's shard here */
            lm_wstore *st = p->wcur[(size_t)c * p->M + i];
            p->wcur[(size_t)c * p->M + i] = NULL;
            if (st->n) { /* none: nothing trained is a projection (LoRA), alike on every rank of a group */
                fsdp_open(p, 0, v == V - 1, l0);
                lm_stage_backward_weight(m, st, l0, l1);
                fsdp_close(p);
            }
            give_wstore(p, c, st); /* emptied: the stage's next I fills it */
        } else {
            lm_bank *b = p->banks[(size_t)c * p->M + i];
            lm_bank_use(m, b);
            if (v < V - 1) wait_input(p, req(p, c, i, BUF_GIN));
            if (aux) { /* the micro-batch's totals: the last stage's own, or those it sent back */
                double *tot = cnt(p, c, i, v == V - 1 ? BUF_AOUT : BUF_GIN);
                if (v < V - 1) wait_input(p, cnt_req(p, c, i, BUF_GIN));
                /* context parallel: the last stage's totals are a chunk's; summed over the chunks
                 * they are the whole sequences', which it sends back to the earlier stages */
                if (v == V - 1 && p->cpg) comm_allreduce(p->cpg, tot, (size_t)E, COMM_F64, COMM_SUM);
                lm_stage_aux_grad(m, tot, B, p->cpg ? p->cp_T : T);
                if (v > 0)
                    comm_isend(p->comm, tot, (size_t)E, COMM_F64, owner(p, v - 1), 2 * V + 2 * (v - 1) + 1,
                               cnt_req(p, c, i, BUF_GOUT));
            }
            fsdp_open(p, 0, v == V - 1, l0);
            if (a.kind == 'I')
                m->wdefer = p->wcur[(size_t)c * p->M + i] = take_wstore(p, c, m, l0, l1, (size_t)B * T);
            loss += lm_stage_backward(m, l0, l1, tk, lb, buf(p, c, i, BUF_GIN), buf(p, c, i, BUF_GOUT), B, T,
                                      grad_scale, NULL);
            m->wdefer = NULL;
            fsdp_close(p);
            if (v > 0)
                comm_isend(p->comm, buf(p, c, i, BUF_GOUT), p->n, COMM_F32, owner(p, v - 1), 2 * (v - 1) + 1,
                           req(p, c, i, BUF_GOUT));
            give_bank(p, c, b);
            p->banks[(size_t)c * p->M + i] = NULL;
        }
        /* OpenMPI moves a message along only inside MPI calls: let the sends in flight progress */
        for (int x = 0; x < p->S; x++) {
            if (vstage(p, x) < V - 1) comm_test(req(p, x, i, BUF_AOUT));
            if (vstage(p, x) > 0) comm_test(req(p, x, i, BUF_GOUT));
            comm_test(cnt_req(p, x, i, BUF_AOUT)); /* unposted (no aux loss): nothing to do */
            comm_test(cnt_req(p, x, i, BUF_GOUT));
        }
    }
    for (size_t x = 0; x < (size_t)p->S * p->M * 4; x++) {
        comm_wait(&p->req[x]);
        comm_wait(&p->cnt_req[x]);
    }
    if (E && p->cpg) loads_sum(p, m);
    p->step_s += ct_now() - t_step;
    return loss;
}

double pp_eval(pp_sched *p, lm_model *m, const int32_t *tokens, const int32_t *labels, int B, int T, long *n_valid) {
    int V = p->V, mb = p->mb_size;
    size_t n = (size_t)mb * T * m->cfg.hidden;
    float *in = ct_malloc(n * sizeof(float)), *out = ct_malloc(n * sizeof(float));
    double sum = 0;
    long count = 0;
    /* one chunk of mb sequences at a time, stage after stage: evaluation is
     * not the step, so no schedule, only the order the data flows in */
    for (int s0 = 0; s0 < B; s0 += mb) {
        const int32_t *tk = tokens + (size_t)s0 * T, *lb = labels + (size_t)s0 * T;
        for (int v = 0; v < V; v++) {
            if (owner(p, v) != p->rank) continue;
            int c = local_of(p, v);
            lm_bank *b = take_bank(p, m, c);
            lm_bank_use(m, b);
            /* the V's turn (stages P-1 and P on one rank): the output is the next input, no message */
            if (v > 0 && owner(p, v - 1) == p->rank) memcpy(in, out, n * sizeof(float));
            else if (v > 0) comm_recv(p->comm, in, n, COMM_F32, owner(p, v - 1), 2 * v);
            fsdp_open(p, 1, v == V - 1, p->first[v]);
            lm_stage_forward(m, p->first[v], p->first[v + 1], tk, in, out, mb, T, 0);
            if (v < V - 1 && owner(p, v + 1) != p->rank)
                comm_send(p->comm, out, n, COMM_F32, owner(p, v + 1), 2 * (v + 1));
            else if (v == V - 1) {
                long nv = 0;
                sum += lm_stage_loss(m, lb, mb, T, &nv); /* the head: still gathered after the last layer */
                count += nv;
            }
            fsdp_close(p);
            give_bank(p, c, b);
        }
    }
    free(in);
    free(out);
    if (n_valid) *n_valid = count;
    return sum;
}

int pp_unit_stage(const pp_sched *p, int x, int L) {
    int l = x == 0 ? 0 : x > L ? L - 1 : x - 1, v = 0;
    while (v + 1 < p->V && p->first[v + 1] <= l) v++;
    return owner(p, v);
}

/* The most of local stage c's actions of a kind in opens that this rank's
 * order has running before one of a kind in closes ends them (its pool's
 * size: banks, F then B or I; stores, I then W). */
static int most_pending(const pp_sched *p, int c, const char *opens, const char *closes) {
    int live = 0, most = 0;
    for (int k = 0; k < p->n_act; k++) {
        if (p->act[k].stage != c) continue;
        live += strchr(opens, p->act[k].kind) ? 1 : strchr(closes, p->act[k].kind) ? -1 : 0;
        most = live > most ? live : most;
    }
    return most;
}

size_t pp_bank_floats(const pp_sched *p, const lm_model *table, int *n_banks) {
    /* each local stage keeps a pool of its own banks: its peak of forwards in flight */
    size_t total = 0;
    *n_banks = 0;
    for (int c = 0; c < p->S; c++) {
        int v = vstage(p, c), most = most_pending(p, c, "F", "BI");
        total += (size_t)most * lm_bank_floats(table, p->first[v], p->first[v + 1]);
        *n_banks += most;
    }
    return total;
}

size_t pp_wstore_floats(const pp_sched *p, const lm_model *table, size_t rows, int *n_stores) {
    /* each local stage keeps a pool of stores: its peak of I's whose W is still to run */
    size_t total = 0;
    *n_stores = 0;
    for (int c = 0; p->schedule >= PP_ZB_INTERLEAVED && c < p->S; c++) {
        int v = vstage(p, c), most = most_pending(p, c, "I", "W");
        size_t f = lm_wstore_floats(table, p->first[v], p->first[v + 1], rows);
        total += (size_t)most * f;
        /* a stage that records nothing (all frozen, or LoRA's) keeps no buffer: the run counts none */
        if (f) *n_stores += most;
    }
    return total;
}

double pp_take_bubble(pp_sched *p) {
    double b = p->step_s > 0 ? p->wait_s / p->step_s : -1;
    p->wait_all += p->wait_s;
    p->step_all += p->step_s;
    p->wait_s = p->step_s = 0;
    return b;
}
