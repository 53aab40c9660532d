/* kernels/tune.c: the default implementation of each op, chosen by measurement.
 *
 * Why: the registry lists implementations in the order that was fastest on
 * the machines they were written on, and the order is wrong elsewhere (an
 * AVX2 GEMM that loses to OpenBLAS on one CPU, vdpbf16ps that loses to fp32
 * FMAs on rounded panels on another). So at the first run of a given size on
 * a given CPU, each op's candidates are timed on the run's own sizes and the
 * fastest one that passes kern_check here is kept; the choice is cached, so
 * later runs (a resume, the next rank, the next test) make the same choice
 * without timing, and so give the same bits.
 *
 * The cache is a text file of lines, appended with one write() each (a
 * concurrent reader sees whole lines; the last line for a key wins):
 *     pick <op> <shape key> <impl> <seconds> [-<impl that failed kern_check> ...]
 *     check <build id> <op> <impl> ok|fail
 * Keyed by the file name (CPU model, feature bits, threads): the same sizes
 * on another CPU kind, under CTITAN_ISA, or at another thread count are
 * measured again. Deleting the file re-measures everything. A pick names the
 * candidates that failed kern_check when it was timed: it stands only while
 * they still fail. The verdicts are per build, the picks are not, so a pick
 * that a broken build made around its broken kernel would otherwise hold the
 * op to a slower one in every later build (seen: a W3 run at 70% of its speed
 * on the tiled attention a test build had picked around a failing blocked one).
 *
 * Every pick is cached, including one timed while other processes used the
 * CPUs: the cache is what makes a resumed run, the other ranks and the next
 * run compute with the same kernels, bit for bit. Timings beside other work
 * are not trusted, though: on a shared 2-core machine an OpenMP kernel that
 * loses a thread for a time slice measures 10-100x slow (seen: cross-entropy's
 * reference "winning" at load 3.6), so then the registry's first candidate
 * is kept unless another beat it by TUNE_BUSY_MARGIN, and the log says the
 * timing was taken beside other work. */
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/cpu.h"
#include "core/fs.h"
#include "kernels/registry.h"

#define TUNE_ROUNDS 5
/* Share of the CPUs other processes may use while an op is timed for the
 * timings to be taken as they are (cpu_others_share); above it the registry's
 * first candidate is kept unless another was TUNE_BUSY_MARGIN times faster. */
#define TUNE_OTHERS 0.10
#define TUNE_BUSY_MARGIN 2.0
/* A candidate whose first call takes this many times the best one so far is
 * not timed further: it cannot win, and a reference may take seconds. It is
 * called once more before it is dropped, though: one call can lose a time
 * slice to another process (seen in CI under ASan: the winner's one call at
 * 3.77 ms against 0.67), and a second slow call is what says it is slow. */
#define TUNE_CUTOFF 3.0

/* Ops whose reference is compute-bound (O(MKN), O(T^2)): never a candidate
 * beside an optimised one (it cannot win and would take seconds to lose). */
static int compute_bound(kern_op op) {
    static const unsigned char heavy_ref[KERN_N_OPS] = {
#define OP_HEAVY(ID, name, bwd, heavy, help) [KERN_OP_##ID] = heavy,
        KERN_OP_LIST(OP_HEAVY)
#undef OP_HEAVY
    };
    return op >= 0 && op < KERN_N_OPS && heavy_ref[op];
}

/* The memory-bound ops are timed on at most this many elements per tensor
 * (4 MiB: twice this CPU kind's L2, so still a memory-bound pass): their speed
 * per element does not change beyond, and the timing buffers must not raise the
 * run's peak memory (they exist before the model's weights do; a small model's
 * whole state can be smaller than a full-size AdamW bench). */
#define TUNE_EW_MAX (1L << 20)

/* Rows of width C that fit TUNE_EW_MAX elements (at least 1, at most rows). */
static int cap_rows(int rows, int C) {
    long fit = C > 0 ? TUNE_EW_MAX / C : rows;
    if (fit < 1) fit = 1;
    return rows < fit ? rows : (int)fit;
}

/* The sizes op runs at in this run, and their cache key; 0 if the run does not
 * call op. Timing sizes are capped where only the memory held would grow (the
 * embedding table's unused rows, logits rows, experts beyond 8 with the rows
 * per expert kept). */
static int op_shape(kern_op op, const kern_run_sizes *r, kern_shape *s, char *key, size_t cap) {
    memset(s, 0, sizeof *s);
    int tokens = r->B * r->T;
    switch (op) {
    case KERN_OP_MATMUL:
    case KERN_OP_MATMUL_BF16:
        if ((op == KERN_OP_MATMUL_BF16) != (r->bf16 != 0)) return 0;
        /* the MLP's up/gate projection: the most FLOPs of a layer */
        s->M = tokens, s->K = r->hidden, s->N = r->inter > 0 ? r->inter : r->moe_inter > 0 ? r->moe_inter : r->hidden;
        /* "wbf16": the wbf16 pair is timed, so another pick (an implementation's widening of the
         * store can rank it otherwise); an fp32 run's key is the one it always had */
        snprintf(key, cap, "M%dK%dN%d%s", s->M, s->K, s->N, r->mm_wbf16 ? "wbf16" : "");
        return 1;
    case KERN_OP_EMBEDDING:
        s->rows = cap_rows(tokens, r->hidden), s->C = r->hidden, s->V = r->vocab < 65536 ? r->vocab : 65536;
        snprintf(key, cap, "N%dC%d", s->rows, s->C);
        return 1;
    case KERN_OP_RMSNORM:
        s->rows = cap_rows(tokens, r->hidden), s->C = r->hidden;
        snprintf(key, cap, "N%dC%d", s->rows, s->C);
        return 1;
    case KERN_OP_ROPE:
        s->B = r->B, s->T = r->T, s->nh = r->n_heads, s->hd = r->head_dim;
        snprintf(key, cap, "B%dT%dnh%dhd%d", s->B, s->T, s->nh, s->hd);
        return 1;
    case KERN_OP_ATTENTION: /* a bf16 run times its attention's bf16 products (kern_attn_opt.bf16) */
        s->B = r->B, s->T = r->T, s->nh = r->n_heads, s->nkv = r->n_kv_heads, s->hd = r->head_dim, s->bf16 = r->bf16;
        snprintf(key, cap, "B%dT%dnh%dnkv%dhd%d%s", s->B, s->T, s->nh, s->nkv, s->hd, r->bf16 ? "bf16" : "");
        return 1;
    case KERN_OP_SWIGLU:
    case KERN_OP_GEGLU:
        /* the dense MLP's activation: one of the two (MoE experts call op_swiglu_fwd themselves) */
        if ((op == KERN_OP_GEGLU) != (r->geglu != 0)) return 0;
        s->n = (long)tokens * (r->inter > 0 ? r->inter : r->moe_inter);
        if (s->n > TUNE_EW_MAX) s->n = TUNE_EW_MAX;
        if (s->n <= 0) return 0;
        snprintf(key, cap, "n%ld", s->n);
        return 1;
    case KERN_OP_CROSSENTROPY: {
        int rows = r->ce_rows > 0 && r->ce_rows < tokens ? r->ce_rows : tokens;
        s->rows = cap_rows(rows < 64 ? rows : 64, r->vocab), s->V = r->vocab;
        snprintf(key, cap, "N%dV%d", s->rows, s->V);
        return 1;
    }
    case KERN_OP_ADD:
        s->n = (long)tokens * r->hidden;
        if (s->n > TUNE_EW_MAX) s->n = TUNE_EW_MAX;
        snprintf(key, cap, "n%ld", s->n);
        return 1;
    case KERN_OP_ADAMW:
        s->n = r->n_params < TUNE_EW_MAX ? r->n_params : TUNE_EW_MAX;
        if (s->n <= 0) return 0;
        snprintf(key, cap, "n%ld", s->n);
        return 1;
    case KERN_OP_MOE:
    case KERN_OP_MOE_BF16:
        if (r->n_experts <= 0 || (op == KERN_OP_MOE_BF16) != (r->bf16 != 0)) return 0;
        s->E = r->n_experts < 8 ? r->n_experts : 8;
        s->rows = (int)((long)tokens * s->E / r->n_experts);
        if (s->rows < 1) s->rows = 1;
        s->C = r->hidden, s->I = r->moe_inter, s->k = r->top_k < s->E ? r->top_k : s->E;
        /* "wbf16": the entries timed are another pair, so another pick (the store's widening can rank
         * the implementations otherwise) */
        snprintf(key, cap, "N%dH%dI%dE%dk%d%s", tokens, s->C, s->I, r->n_experts, r->top_k,
                 r->moe_wbf16 ? "wbf16" : "");
        return 1;
    } /* no default: -Wswitch names an op of ops_list.h left out here */
    return 0;
}

/* ------------------------------------------------------------------ cache */

/* The value field of the last whole line of the cache text (NULL: no cache)
 * starting "<a> <b> <c> " (c may be NULL), copied to out; 0 if none. With
 * rest, *rest is that line after the value (up to its newline): a pick's
 * -<name> fields. */
static int cache_find(const char *text, const char *a, const char *b, const char *cc, char *out, size_t cap,
                      const char **rest) {
    if (!text) return 0;
    char prefix[256];
    snprintf(prefix, sizeof prefix, "%s %s %s%s", a, b, cc ? cc : "", cc ? " " : "");
    size_t pl = strlen(prefix);
    int found = 0;
    for (const char *line = text; *line;) {
        const char *nl = strchr(line, '\n');
        if (!nl) break; /* a line still being written: ignore */
        if ((size_t)(nl - line) > pl && !strncmp(line, prefix, pl)) {
            size_t vl = strcspn(line + pl, " \n");
            if (vl < cap) {
                memcpy(out, line + pl, vl);
                out[vl] = 0;
                found = 1;
                if (rest) *rest = line + pl + vl;
            }
        }
        line = nl + 1;
    }
    return found;
}

/* Appends one line with a single write (O_APPEND): concurrent runs interleave
 * whole lines. Failing to write the cache only costs a later re-measurement. */
static void cache_append(const char *path, const char *line) {
    if (!path) return;
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd < 0) return;
    ssize_t w = write(fd, line, strlen(line));
    (void)w;
    close(fd);
}

void kern_tune_cache_path(char *out, size_t cap, unsigned cpu, int threads) {
    char model[256], name[512];
    cpu_model_name(model, sizeof model);
    /* v2: picks name the candidates that failed their check (v1's could not be told stale) */
    snprintf(name, sizeof name, "kernels-v2-%s-f%x-t%d.txt", model, cpu, threads);
    cpu_cache_path(out, cap, name);
}

/* ------------------------------------------------------------------ tuning */

/* Whether the overrides force op to an implementation (anything but "auto"). */
static int forced(const char *const *ov, kern_op op) {
    const char *name = kern_op_name(op);
    size_t nl = strlen(name);
    int f = 0;
    for (size_t j = 0; ov && ov[j]; j++)
        if (!strncmp(ov[j], name, nl) && ov[j][nl] == '=') f = strcmp(ov[j] + nl + 1, "auto") != 0;
    return f;
}

__attribute__((format(printf, 4, 5))) static void logf_append(char *log, size_t cap, size_t *len, const char *fmt, ...) {
    if (!log || *len >= cap) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(log + *len, cap - *len, fmt, ap);
    va_end(ap);
    if (w > 0) *len += (size_t)w < cap - *len ? (size_t)w : cap - *len - 1;
}

/* The GNU build ID of the binary or library this code was linked into (hex),
 * "nobuildid" if it has none: a kern_check verdict holds for one build only. */
typedef struct {
    const void *addr;
    char *out;
    size_t cap;
} build_id_query;

static int build_id_cb(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    build_id_query *q = data;
    int mine = 0;
    for (int i = 0; i < info->dlpi_phnum && !mine; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + ph->p_vaddr;
        mine = ph->p_type == PT_LOAD && (uintptr_t)q->addr >= lo && (uintptr_t)q->addr < lo + ph->p_memsz;
    }
    if (!mine) return 0;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_NOTE) continue;
        const unsigned char *p = (const unsigned char *)(info->dlpi_addr + ph->p_vaddr), *end = p + ph->p_memsz;
        while (p + sizeof(ElfW(Nhdr)) <= end) {
            const ElfW(Nhdr) *nh = (const ElfW(Nhdr) *)p;
            const unsigned char *name = p + sizeof *nh, *desc = name + ((nh->n_namesz + 3) & ~3u);
            if (nh->n_type == NT_GNU_BUILD_ID && nh->n_namesz == 4 && !memcmp(name, "GNU", 4)) {
                size_t len = 0;
                for (unsigned j = 0; j < nh->n_descsz && len + 3 < q->cap; j++)
                    len += (size_t)snprintf(q->out + len, q->cap - len, "%02x", desc[j]);
                return 1;
            }
            p = desc + ((nh->n_descsz + 3) & ~3u);
        }
    }
    return 1;
}

static void build_id(char *out, size_t cap) {
    snprintf(out, cap, "nobuildid");
    build_id_query q = {(const void *)&build_id, out, cap};
    dl_iterate_phdr(build_id_cb, &q);
}

/* A build under AddressSanitizer (make sanitize) checks the candidates at
 * kern_check's --quick sizes: ASan runs the references ~10x slower, and the
 * capped cases still cross every tile and block edge (check.c, quick_cap),
 * which is what the sanitizer is there to watch. Any other build checks in full. */
#if defined(__SANITIZE_ADDRESS__)
#define TUNE_CHECK_QUICK 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TUNE_CHECK_QUICK 1
#endif
#endif
#ifndef TUNE_CHECK_QUICK
#define TUNE_CHECK_QUICK 0
#endif

static void check_record(const char *path, const char *bid, const kern_impl *im, int ok) {
    char line[256];
    snprintf(line, sizeof line, "check %s %s %s %s\n", bid, kern_op_name(im->op), im->name, ok ? "ok" : "fail");
    cache_append(path, line);
}

/* kern_check of one implementation on this CPU, through the cache (verdicts
 * keyed by the build: a rebuilt kernel is checked again). */
static int passes_check(const kern_impl *t, size_t n, unsigned cpu, const kern_impl *im, const char *cache,
                        const char *path) {
    if (!strcmp(im->name, "ref")) return 1; /* the reference is what the others are checked against */
    char v[16], bid[64], what[160];
    build_id(bid, sizeof bid);
    snprintf(what, sizeof what, "%s %s", kern_op_name(im->op), im->name);
    if (cache_find(cache, "check", bid, what, v, sizeof v, NULL)) return !strcmp(v, "ok");
    kern_check_opts o = {.out = NULL, .op = kern_op_name(im->op), .impl = im->name, .features = cpu, .seed = 1,
                         .quick = TUNE_CHECK_QUICK};
    int ok = kern_check(t, n, &o) == 0;
    check_record(path, bid, im, ok);
    return ok;
}

/* The verdicts of one op's candidates (ok[i]: passes_check of cand[i]). Those
 * without a cached verdict are first checked together, in one kern_check over
 * the reference and them: it computes each case's reference outputs once for
 * all of them (check.c's memo) instead of once per candidate, and the
 * reference is most of a check's time (the MoE experts' and the matmuls'
 * loops). Only where that finds a failure is each checked on its own, to
 * know which one failed: the same cases, inputs and bounds either way. */
static void check_candidates(const kern_impl *t, size_t n, unsigned cpu, const kern_impl *const *cand, int nc,
                             const char *cache, const char *path, int *ok) {
    char v[16], bid[64], what[160];
    build_id(bid, sizeof bid);
    const kern_impl *ref = NULL;
    kern_impl *sub = malloc(((size_t)nc + 1) * sizeof *sub);
    int ns = 0, pending[32];
    for (size_t i = 0; i < n && !ref; i++)
        if (t[i].op == cand[0]->op && !strcmp(t[i].name, "ref")) ref = &t[i];
    for (int i = 0; i < nc; i++) {
        snprintf(what, sizeof what, "%s %s", kern_op_name(cand[i]->op), cand[i]->name);
        pending[i] = 0;
        if (!strcmp(cand[i]->name, "ref")) ok[i] = 1;
        else if (cache_find(cache, "check", bid, what, v, sizeof v, NULL)) ok[i] = !strcmp(v, "ok");
        else pending[i] = 1, ok[i] = -1;
        if (pending[i] && sub) sub[ns++] = *cand[i];
    }
    if (ns > 1 && ref && sub) {
        sub[ns++] = *ref;
        kern_check_opts o = {.out = NULL, .op = kern_op_name(cand[0]->op), .impl = NULL, .features = cpu, .seed = 1,
                             .quick = TUNE_CHECK_QUICK};
        if (kern_check(sub, (size_t)ns, &o) == 0)
            for (int i = 0; i < nc; i++)
                if (pending[i]) {
                    ok[i] = 1;
                    check_record(path, bid, cand[i], 1);
                }
    }
    free(sub);
    for (int i = 0; i < nc; i++)
        if (ok[i] < 0) ok[i] = passes_check(t, n, cpu, cand[i], cache, path);
}

/* Whether a pick's -<name> fields (rest: the line after its value,
 * cache_find) name a candidate that passes kern_check in this build: the
 * pick was timed without it. */
static int pick_stale(const char *rest, const kern_impl *t, size_t n, unsigned cpu, const kern_impl *const *cand,
                      int nc, const char *cache, const char *path) {
    for (const char *p = rest; p && *p && *p != '\n';) {
        p += strspn(p, " ");
        size_t tl = strcspn(p, " \n");
        if (*p == '-' && tl > 1)
            for (int i = 0; i < nc; i++)
                if (strlen(cand[i]->name) == tl - 1 && !strncmp(cand[i]->name, p + 1, tl - 1) &&
                    passes_check(t, n, cpu, cand[i], cache, path))
                    return 1;
        p += tl;
    }
    return 0;
}

/* One timed call of the forward and, where the op has one, the backward:
 * the entries the run calls (wbf16, for a run whose weights are read from a
 * bf16 store: the MoE experts' fwd_wbf16 / bwd_wbf16, the matmuls' fwd_wbf16
 * / dinp_wbf16, the frozen weight having no gradient). */
static double one_round(kern_bench *b, const kern_impl *im, int bwd, int wbf16) {
    int mm = im->op == KERN_OP_MATMUL || im->op == KERN_OP_MATMUL_BF16;
    kern_bench_part f = wbf16 ? KERN_BENCH_FWD_WBF16 : KERN_BENCH_FWD;
    kern_bench_part g = !wbf16 ? KERN_BENCH_BWD : mm ? KERN_BENCH_DINP_WBF16 : KERN_BENCH_BWD_WBF16;
    return kern_bench_time(b, im, f, 0, 0) + (bwd ? kern_bench_time(b, im, g, 0, 0) : 0);
}

int kern_tune(kern_ops *k, const kern_impl *t, size_t n, unsigned cpu, const char *const *ov,
              const kern_run_sizes *r, const char *path, char *log, size_t logcap, ct_err *e) {
    kern_ops sel;
    int rc = kern_select_from(&sel, t, n, cpu, ov, NULL, 0, e);
    if (rc) return rc;
    char *cache = path ? fs_read_file(path, 0, NULL, NULL) : NULL; /* none yet: NULL */
    size_t len = 0;
    if (log && logcap) log[0] = 0;
    logf_append(log, logcap, &len, "kernels:");
    for (int op = 0; op < KERN_N_OPS; op++) {
        kern_shape s;
        char key[96];
        const char *why = "default";
        if (forced(ov, (kern_op)op)) why = "forced";
        else if (op_shape((kern_op)op, r, &s, key, sizeof key)) {
            /* candidates: what this CPU runs, in the table's order */
            const kern_impl *cand[32];
            int nc = 0, n_opt = 0;
            for (size_t i = 0; i < n && nc < 32; i++)
                if ((int)t[i].op == op && !strcmp(t[i].device, "cpu") && !(t[i].features & ~cpu)) {
                    cand[nc++] = &t[i];
                    n_opt += strcmp(t[i].name, "ref") != 0;
                }
            if (n_opt > 0 && compute_bound((kern_op)op)) { /* drop ref */
                int m = 0;
                for (int i = 0; i < nc; i++)
                    if (strcmp(cand[i]->name, "ref")) cand[m++] = cand[i];
                nc = m;
            }
            char cached[64];
            const char *rest = NULL;
            int hit =
                nc > 1 && cache_find(cache, "pick", kern_op_name((kern_op)op), key, cached, sizeof cached, &rest);
            if (hit && pick_stale(rest, t, n, cpu, cand, nc, cache, path)) {
                /* the verdicts it just appended, read back: the timing below does not check again */
                free(cache);
                cache = fs_read_file(path, 0, NULL, NULL);
                hit = 0;
            }
            if (hit) {
                for (int i = 0; i < nc; i++)
                    if (!strcmp(cand[i]->name, cached) && passes_check(t, n, cpu, cand[i], cache, path)) {
                        sel.chosen[op] = cand[i];
                        why = "cached";
                    }
            }
            if (nc > 1 && strcmp(why, "cached")) {
                kern_bench *b = kern_bench_new((kern_op)op, &s);
                cpu_usage_mark mark;
                cpu_usage_mark_now(&mark);
                int bwd = kern_bench_has_bwd((kern_op)op);
                int wbf16 = (op == KERN_OP_MOE || op == KERN_OP_MOE_BF16)           ? r->moe_wbf16
                            : (op == KERN_OP_MATMUL || op == KERN_OP_MATMUL_BF16) ? r->mm_wbf16
                                                                                  : 0;
                double secs[32], first = INFINITY, best = INFINITY;
                int alive[32];
                const kern_impl *win = NULL;
                check_candidates(t, n, cpu, cand, nc, cache, path, alive);
                /* one call each (pages faulted in, workspaces grown); hopeless ones stop here */
                for (int i = 0; i < nc; i++) {
                    secs[i] = NAN;
                    if (!alive[i]) continue;
                    double t1 = one_round(b, cand[i], bwd, wbf16);
                    if (t1 > TUNE_CUTOFF * first) t1 = fmin(t1, one_round(b, cand[i], bwd, wbf16));
                    secs[i] = t1;
                    if (t1 > TUNE_CUTOFF * first) alive[i] = 0;
                    if (t1 < first) first = t1;
                }
                /* then rounds that time every survivor once each, keeping each one's best:
                 * a burst of other work then slows one round of every candidate rather
                 * than every call of one */
                for (int round = 0; round < TUNE_ROUNDS; round++)
                    for (int i = 0; i < nc; i++) {
                        if (!alive[i]) continue;
                        double t1 = one_round(b, cand[i], bwd, wbf16);
                        if (round == 0 || t1 < secs[i]) secs[i] = t1;
                    }
                for (int i = 0; i < nc; i++)
                    if (alive[i] && secs[i] < best) best = secs[i], win = cand[i];
                double others = cpu_others_share(&mark);
                if (others > TUNE_OTHERS) /* keep the registry's first unless another clearly beat it */
                    for (int i = 0; i < nc; i++)
                        if (alive[i]) {
                            if (secs[i] <= TUNE_BUSY_MARGIN * best) best = secs[i], win = cand[i];
                            break;
                        }
                kern_bench_free(b);
                if (win) {
                    sel.chosen[op] = win;
                    char line[512];
                    int ll = snprintf(line, sizeof line, "pick %s %s %s %.6g", kern_op_name((kern_op)op), key,
                                      win->name, best);
                    for (int i = 0; i < nc && ll > 0 && (size_t)ll < sizeof line; i++)
                        if (isnan(secs[i])) /* failed kern_check: the pick holds while it fails */
                            ll += snprintf(line + ll, sizeof line - (size_t)ll, " -%s", cand[i]->name);
                    if (ll > 0 && (size_t)ll + 2 <= sizeof line) {
                        memcpy(line + ll, "\n", 2);
                        cache_append(path, line);
                    }
                    logf_append(log, logcap, &len, " %s=%s (measured %s%s: %.3g ms", kern_op_name((kern_op)op),
                                win->name, key, others > TUNE_OTHERS ? " beside other work" : "", 1e3 * best);
                    for (int i = 0; i < nc; i++)
                        if (cand[i] != win)
                            logf_append(log, logcap, &len, isnan(secs[i]) ? "; %s failed kern_check" : alive[i] ? "; %s %.3g" : "; %s %.3g (cut off)",
                                        cand[i]->name, 1e3 * secs[i]);
                    logf_append(log, logcap, &len, ")");
                    continue;
                }
                why = "default: no candidate passed";
            }
        }
        logf_append(log, logcap, &len, " %s=%s%s%s%s", kern_op_name((kern_op)op), sel.chosen[op]->name,
                    strcmp(why, "default") ? " (" : "", strcmp(why, "default") ? why : "",
                    strcmp(why, "default") ? ")" : "");
    }
    free(cache);
    /* rebuild the table from the chosen entries (install's single source of truth) */
    const char *names[KERN_N_OPS + 1];
    char spec[KERN_N_OPS][96];
    for (int op = 0; op < KERN_N_OPS; op++) {
        snprintf(spec[op], sizeof spec[op], "%s=%s", kern_op_name((kern_op)op), sel.chosen[op]->name);
        names[op] = spec[op];
    }
    names[KERN_N_OPS] = NULL;
    return kern_select_from(k, t, n, cpu, names, NULL, 0, e);
}
