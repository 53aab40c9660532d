/* tests/c/kernels/test_tune.c: kernel choice by measurement (kernels/tune.c).
 *
 * A table of our own for the op "add" (the built-in entries of every other op
 * are kept and forced to "ref" so that only add is timed):
 *   "slow"    correct, 40x the reference's work, listed first (the registry's
 *             hand-picked default);
 *   "broken"  fast and wrong (out = a): must be dropped by kern_check;
 *   "fast"    correct and as fast as the reference;
 *   "ref"     the reference.
 * The tuner must pick a fast correct one (fast or ref: they are the same
 * code), never "broken"; cache the pick and reuse it ("cached") without
 * timing; keep an op forced by the overrides; and say all of it in the log.
 * Then the per-op sizes: a MoE model's experts and a bf16 run's matmul_bf16
 * are tuned only when the run uses them; and the entries: a run whose experts
 * are read from a bf16 store times the experts' wbf16 entries, one that is not
 * the fp32 ones (two correct implementations, each slow in the pair the other
 * is fast in), and likewise a run whose dense projections are read from a bf16
 * store times the matmul's fwd_wbf16 / dinp_wbf16. And a fast entry whose
 * first call was slowed once ("late") is not cut off on that one call. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "check.h"
#include "kern_test.h"
#include "core/timer.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

static void add_slow(float *out, const float *a, const float *b, long N) {
    /* 39 extra passes that read both inputs, then the sum (correct in place too) */
    volatile float sink = 0;
    for (int r = 0; r < 39; r++) {
        float s = 0;
        for (long i = 0; i < N; i++) s += a[i] * b[i];
        sink += s;
    }
    op_add(out, a, b, N);
}
static void add_broken(float *out, const float *a, const float *b, long N) {
    (void)b;
    memcpy(out, a, (size_t)N * sizeof(float));
}

/* The test's MoE entries wrap the registry's first optimised moe_experts
 * entry this CPU runs (the reference's where there is none): kern_check of a
 * reference-speed entry takes seconds. */
static const kern_impl *moe_base;
/* Busy for SPIN (4 ms): the slow half of each test MoE entry. Forward +
 * backward at the tuner's sizes here take ~0.03 ms even in the reference,
 * but one call of an OpenMP kernel beside other work (CI's lanes under ASan)
 * measured up to ~2 ms, waiting for its second thread; the slow half must
 * stay more than the tuner's 2x margin for timings beside other work above
 * that (stop 32's CI: 0.25 ms was not). */
#define SPIN 4e-3
static void spin_for(double secs) {
    double t0 = ct_now();
    while (ct_now() - t0 < secs) {
    }
}
static void spin(void) { spin_for(SPIN); }
static void moe_fwd_slow(float *out, float *gate, float *up, float *h, float *work, const float *x, const float *wg,
                         const float *wu, const float *wd, const int32_t *perm, const int32_t *pos,
                         const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k) {
    spin();
    moe_base->fn.moe.fwd(out, gate, up, h, work, x, wg, wu, wd, perm, pos, offsets, topw, N, H, Im, E, k);
}
static void moe_bwd_slow(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work, const float *dout,
                         const float *x, const float *wg, const float *wu, const float *wd, const float *gate,
                         const float *up, const float *h, const int32_t *perm, const int32_t *pos,
                         const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k) {
    spin();
    moe_base->fn.moe.bwd(dx, dwg, dwu, dwd, dtopw, work, dout, x, wg, wu, wd, gate, up, h, perm, pos, offsets, topw, N,
                       H, Im, E, k);
}
static void moe_fwd_h_slow(float *out, float *gate, float *up, float *h, float *work, const float *x,
                           const float *wg, const float *wu, const float *wd, const uint16_t *hg, const uint16_t *hu,
                           const uint16_t *hd, const int32_t *perm, const int32_t *pos, const int32_t *offsets,
                           const float *topw, int N, int H, int Im, int E, int k) {
    spin();
    moe_base->fn.moe.fwd_wbf16(out, gate, up, h, work, x, wg, wu, wd, hg, hu, hd, perm, pos, offsets, topw, N, H, Im,
                             E, k);
}
static void moe_bwd_h_slow(float *dx, float *dwg, float *dwu, float *dwd, float *dtopw, float *work,
                           const float *dout, const float *x, const float *wg, const float *wu, const float *wd,
                           const uint16_t *hg, const uint16_t *hu, const uint16_t *hd, const float *gate,
                           const float *up, const float *h, const int32_t *perm, const int32_t *pos,
                           const int32_t *offsets, const float *topw, int N, int H, int Im, int E, int k) {
    spin();
    moe_base->fn.moe.bwd_wbf16(dx, dwg, dwu, dwd, dtopw, work, dout, x, wg, wu, wd, hg, hu, hd, gate, up, h, perm, pos,
                             offsets, topw, N, H, Im, E, k);
}

/* The same for the matmul op: the registry's first optimised matmul entry
 * this CPU runs. Here the fp32 pair's slow halves take 2 SPIN, the wbf16
 * pair's 1 SPIN, so that a tuner timing a mixed pair (fwd_wbf16 with the
 * fp32 backward, or the fp32 forward with dinp_wbf16) also picks wrong. */
static const kern_impl *mm_base;
static void mm_fwd_slow(float *out, const float *inp, const float *w, int M, int K, int N, int accumulate) {
    spin_for(2 * SPIN);
    mm_base->fn.matmul.fwd(out, inp, w, M, K, N, accumulate);
}
static void mm_bwd_slow(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                        int N, int accumulate) {
    spin_for(2 * SPIN);
    mm_base->fn.matmul.bwd(dinp, dw, dout, inp, w, M, K, N, accumulate);
}
static void mm_fwd_h_slow(float *out, const float *inp, const uint16_t *w, int M, int K, int N, int accumulate) {
    spin();
    mm_base->fn.matmul.fwd_wbf16(out, inp, w, M, K, N, accumulate);
}
static void mm_dinp_h_slow(float *dinp, const float *dout, const uint16_t *w, int M, int K, int N, int ldd,
                           int accumulate) {
    spin();
    mm_base->fn.matmul.dinp_wbf16(dinp, dout, w, M, K, N, ldd, accumulate);
}

/* "late": the reference add, except that its first call at the run's size
 * (kern_check's sizes are others) spins 50 SPIN, as a call that lost its time
 * slice to another process does; "spun": the reference add after 5 SPIN, so
 * that late, called again, beats it by more than the 2x margin for timings
 * beside other work, and late's first call is more than the 3x cutoff. */
#define LATE_N 8192
static int late_calls;
static void add_late(float *out, const float *a, const float *b, long N) {
    if (N == LATE_N && late_calls++ == 0) spin_for(50 * SPIN);
    op_add(out, a, b, N);
}
static void add_spun(float *out, const float *a, const float *b, long N) {
    spin_for(5 * SPIN);
    op_add(out, a, b, N);
}

static const char *const force_others[] = {
    "matmul=ref", "embedding=ref", "rmsnorm=ref", "rope=ref", "attention=ref", "swiglu=ref", "crossentropy=ref",
    "adamw=ref", "matmul_bf16=ref", "moe_experts=ref", "moe_experts_bf16=ref", "geglu=ref", NULL};

/* The registry without op's entries, with room for `extra` more; *base is
 * op's first entry this CPU runs other than the reference (the reference
 * where there is none), which the test entries wrap. */
static kern_impl *registry_without(kern_op op, size_t extra, const kern_impl **base, size_t *m) {
    size_t n;
    const kern_impl *reg = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    kern_impl *t = calloc(n + extra, sizeof *t);
    *m = 0, *base = NULL;
    for (size_t i = 0; i < n; i++) {
        if (reg[i].op != op) t[(*m)++] = reg[i];
        else if (!(reg[i].features & ~cpu) && (!*base || !strcmp((*base)->name, "ref"))) *base = &reg[i];
    }
    return t;
}

/* The registry without its add entries, plus ours. */
static kern_impl *make_table(size_t *n_out) {
    const kern_impl *base;
    size_t m;
    kern_impl *t = registry_without(KERN_OP_ADD, 4, &base, &m);
    t[m++] = (kern_impl){KERN_OP_ADD, "slow", "cpu", 0, 0, "test: 40x the work", .fn.add = {add_slow}};
    t[m++] = (kern_impl){KERN_OP_ADD, "broken", "cpu", 0, 0, "test: wrong", .fn.add = {add_broken}};
    t[m++] = (kern_impl){KERN_OP_ADD, "fast", "cpu", 0, 0, "test: the reference", .fn.add = {op_add}};
    t[m++] = (kern_impl){KERN_OP_ADD, "ref", "cpu", 0, 0, "reference", .fn.add = {op_add}};
    *n_out = m;
    return t;
}

static int count_lines(const char *path, const char *prefix) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[512];
    int c = 0;
    while (fgets(line, sizeof line, f)) c += !strncmp(line, prefix, strlen(prefix));
    fclose(f);
    return c;
}

/* An empty file of a fresh name for a tune cache, named into path
 * ("/tmp/ctitan-tune-XXXXXX", rewritten in place). */
static void temp_cache(char *path) {
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd >= 0) close(fd);
}

static void test_pick_and_cache(void) {
    size_t n;
    kern_impl *t = make_table(&n);
    char path[] = "/tmp/ctitan-tune-XXXXXX";
    temp_cache(path);
    unlink(path); /* the tuner creates it */
    kern_run_sizes rs = {.B = 2, .T = 64, .hidden = 4096, .inter = 64, .vocab = 256, .n_heads = 2,
                         .n_kv_heads = 1, .head_dim = 16, .ce_rows = 16, .n_params = 1000};
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    int rc = kern_tune(&k, t, n, 0, force_others, &rs, path, log, sizeof log, &e);
    CHECK(rc == 0, "kern_tune: %s", e.msg);
    const char *pick = k.chosen[KERN_OP_ADD]->name;
    CHECK(!strcmp(pick, "fast") || !strcmp(pick, "ref"), "picked add=%s (log: %s)", pick, log);
    CHECK(k.add == op_add, "the ops table calls the picked function");
    CHECK(strstr(log, "add=") && strstr(log, "measured n524288"), "log says what was measured: %s", log);
    CHECK(strstr(log, "broken failed kern_check"), "log says why broken was dropped: %s", log);
    CHECK(strstr(log, "matmul=ref (forced)"), "forced ops stay forced and say so: %s", log);
    CHECK(count_lines(path, "pick add n524288 ") == 1, "one pick line cached");
    CHECK(count_lines(path, "check ") == 3, "the three checks run are cached (ref is not checked)");
    FILE *cf = fopen(path, "r");
    char all[4096] = {0};
    size_t got = cf ? fread(all, 1, sizeof all - 1, cf) : 0;
    if (cf) fclose(cf);
    all[got] = 0;
    CHECK(strstr(all, " add broken fail\n") && strstr(all, " add slow ok\n"), "verdicts cached: %s", all);
    CHECK(!strstr(all, "check nobuildid "), "verdicts are keyed by the build id: %s", all);
    const char *pl = strstr(all, "pick add n524288 ");
    const char *pe = pl ? strchr(pl, '\n') : NULL;
    CHECK(pe && pe - pl > 8 && !strncmp(pe - 8, " -broken", 8), "the pick line names the candidate that failed kern_check: %s",
          all);

    /* second run: from the cache, nothing timed again */
    kern_ops k2;
    rc = kern_tune(&k2, t, n, 0, force_others, &rs, path, log, sizeof log, &e);
    CHECK(rc == 0, "kern_tune again: %s", e.msg);
    CHECK(k2.chosen[KERN_OP_ADD] == k.chosen[KERN_OP_ADD], "the cached pick is reused");
    CHECK(strstr(log, "(cached)"), "log says cached: %s", log);
    CHECK(count_lines(path, "pick ") == 1, "nothing appended on a cache hit");

    /* a forced add is not tuned, even when the cache says otherwise */
    const char *force_add[] = {"add=slow", NULL};
    rc = kern_tune(&k2, t, n, 0, force_add, &rs, NULL, log, sizeof log, &e);
    CHECK(rc == 0 && !strcmp(k2.chosen[KERN_OP_ADD]->name, "slow"), "add=slow forced");

    /* A pick made while a candidate failed kern_check (another build, where "fast" was
     * broken) stands only while that candidate fails: here fast passes, so add is measured
     * again rather than left on "slow". One that names a candidate still failing stands. */
    FILE *f = fopen(path, "w");
    fprintf(f, "pick add n524288 slow 1e-9 -fast\n");
    fclose(f);
    rc = kern_tune(&k2, t, n, 0, force_others, &rs, path, log, sizeof log, &e);
    pick = k2.chosen[KERN_OP_ADD]->name;
    CHECK(rc == 0 && (!strcmp(pick, "fast") || !strcmp(pick, "ref")) && !strstr(log, "(cached)"),
          "a pick made without fast, which passes here, is re-measured: add=%s (log: %s)", pick, log);
    CHECK(count_lines(path, "check ") == 3, "fast, slow and broken checked once each (%d check lines)",
          count_lines(path, "check "));
    /* the last line for the sizes is the one that counts: a later pick naming nothing stands */
    f = fopen(path, "w");
    fprintf(f, "pick add n524288 slow 1e-9 -fast\npick add n524288 slow 1e-9\n");
    fclose(f);
    rc = kern_tune(&k2, t, n, 0, force_others, &rs, path, log, sizeof log, &e);
    CHECK(rc == 0 && !strcmp(k2.chosen[KERN_OP_ADD]->name, "slow"), "the last pick line stands: add=%s (log: %s)",
          k2.chosen[KERN_OP_ADD]->name, log);
    f = fopen(path, "w");
    fprintf(f, "pick add n524288 slow 1e-9 -broken\n");
    fclose(f);
    rc = kern_tune(&k2, t, n, 0, force_others, &rs, path, log, sizeof log, &e);
    CHECK(rc == 0 && !strcmp(k2.chosen[KERN_OP_ADD]->name, "slow") && strstr(log, "add=slow (cached)"),
          "a pick made without broken, which still fails, stands: add=%s (log: %s)", k2.chosen[KERN_OP_ADD]->name,
          log);

    /* a cache naming an implementation this table lacks is ignored, the op re-measured */
    f = fopen(path, "w");
    fprintf(f, "pick add n524288 vanished 1e-9\nhalf a line without newline");
    fclose(f);
    rc = kern_tune(&k2, t, n, 0, force_others, &rs, path, log, sizeof log, &e);
    pick = k2.chosen[KERN_OP_ADD]->name;
    CHECK(rc == 0 && (!strcmp(pick, "fast") || !strcmp(pick, "ref")), "re-measured: add=%s", pick);
    unlink(path);
    free(t);
}

static void test_ops_of_the_run(void) {
    /* a dense fp32 run tunes matmul, not matmul_bf16 nor the MoE experts; a bf16 run the reverse */
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    int runnable[KERN_N_OPS] = {0};
    for (size_t i = 0; i < n; i++)
        if (!(t[i].features & ~cpu) && strcmp(t[i].name, "ref")) runnable[t[i].op]++;
    kern_run_sizes rs = {.B = 1, .T = 8, .hidden = 32, .inter = 64, .vocab = 64, .n_heads = 2,
                         .n_kv_heads = 1, .head_dim = 16, .ce_rows = 8, .n_params = 100};
    const char *only_matmuls[] = {"embedding=ref", "rmsnorm=ref", "rope=ref", "attention=ref", "swiglu=ref",
                                  "crossentropy=ref", "add=ref", "adamw=ref", NULL};
    char path[] = "/tmp/ctitan-tune-XXXXXX";
    temp_cache(path);
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    CHECK(kern_tune(&k, t, n, cpu, only_matmuls, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    CHECK(count_lines(path, "pick matmul_bf16 ") == 0 && count_lines(path, "pick moe_experts") == 0,
          "a dense fp32 run times neither matmul_bf16 nor the experts");
    if (runnable[KERN_OP_MATMUL] > 1)
        CHECK(count_lines(path, "pick matmul M8K32N64 ") == 1, "it times matmul on its sizes (M = B T, K = H, N = I)");
    rs.bf16 = 1;
    CHECK(kern_tune(&k, t, n, cpu, only_matmuls, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    if (runnable[KERN_OP_MATMUL_BF16] > 1)
        CHECK(count_lines(path, "pick matmul_bf16 M8K32N64 ") == 1, "a bf16 run times matmul_bf16");
    CHECK(count_lines(path, "pick matmul ") == (runnable[KERN_OP_MATMUL] > 1), "and not the fp32 matmul again");
    rs.bf16 = 0, rs.inter = 0, rs.n_experts = 4, rs.moe_inter = 16, rs.top_k = 2;
    CHECK(kern_tune(&k, t, n, cpu, only_matmuls, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    if (runnable[KERN_OP_MOE] > 1)
        CHECK(count_lines(path, "pick moe_experts N8H32I16E4k2 ") == 1, "a MoE run times its experts");
    /* the dense MLP's activation: swiglu, or geglu for a GELU-gated family, never both */
    const char *only_acts[] = {"matmul=ref", "embedding=ref", "rmsnorm=ref", "rope=ref", "attention=ref",
                               "crossentropy=ref", "add=ref", "adamw=ref", NULL};
    unlink(path);
    rs.inter = 64, rs.n_experts = 0, rs.moe_inter = 0, rs.top_k = 0;
    CHECK(kern_tune(&k, t, n, cpu, only_acts, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    CHECK(count_lines(path, "pick geglu ") == 0, "a SwiGLU run does not time geglu");
    if (runnable[KERN_OP_SWIGLU] > 0) CHECK(count_lines(path, "pick swiglu n512 ") == 1, "it times swiglu");
    rs.geglu = 1;
    CHECK(kern_tune(&k, t, n, cpu, only_acts, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    if (runnable[KERN_OP_GEGLU] > 0) CHECK(count_lines(path, "pick geglu n512 ") == 1, "a GeGLU run times geglu");
    CHECK(count_lines(path, "pick swiglu ") == (runnable[KERN_OP_SWIGLU] > 0), "and not swiglu again");
    unlink(path);
}

/* Overrides forcing every op but op to its reference, so that kern_tune times op alone. */
static void all_ref_but(kern_op op, char buf[KERN_N_OPS][64], const char *ov[KERN_N_OPS + 1]) {
    int j = 0;
    for (int o = 0; o < KERN_N_OPS; o++)
        if (o != (int)op) {
            snprintf(buf[j], sizeof buf[j], "%s=ref", kern_op_name((kern_op)o));
            ov[j] = buf[j];
            j++;
        }
    ov[j] = NULL;
}

static void test_moe_entries_of_the_run(void) {
    /* the registry without its moe_experts entries, plus: "fp32_fast" (fwd / bwd moe_base's, the
     * wbf16 pair slow) listed first, "wbf16_fast" (the reverse) and the reference */
    size_t m;
    kern_impl *t = registry_without(KERN_OP_MOE, 3, &moe_base, &m);
    const kern_moe_fwd_fn f = moe_base->fn.moe.fwd;
    const kern_moe_bwd_fn b = moe_base->fn.moe.bwd;
    const kern_moe_fwd_wbf16_fn fh = moe_base->fn.moe.fwd_wbf16;
    const kern_moe_bwd_wbf16_fn bh = moe_base->fn.moe.bwd_wbf16;
    t[m++] = (kern_impl){KERN_OP_MOE, "fp32_fast", "cpu", 0, 0, "test: the wbf16 pair slow",
                         .fn.moe = {f, b, moe_fwd_h_slow, moe_bwd_h_slow}};
    t[m++] = (kern_impl){KERN_OP_MOE, "wbf16_fast", "cpu", 0, 0, "test: the fp32 pair slow",
                         .fn.moe = {moe_fwd_slow, moe_bwd_slow, fh, bh}};
    t[m++] = (kern_impl){KERN_OP_MOE, "ref", "cpu", 0, 0, "reference",
                         .fn.moe = {op_moe_experts_fwd, op_moe_experts_bwd, op_moe_experts_fwd_wbf16,
                                    op_moe_experts_bwd_wbf16}};
    char ovb[KERN_N_OPS][64];
    const char *only_moe[KERN_N_OPS + 1];
    all_ref_but(KERN_OP_MOE, ovb, only_moe);
    kern_run_sizes rs = {.B = 1, .T = 8, .hidden = 32, .inter = 0, .vocab = 64, .n_heads = 2, .n_kv_heads = 1,
                         .head_dim = 16, .ce_rows = 8, .n_params = 100, .n_experts = 4, .moe_inter = 16, .top_k = 2};
    char path[] = "/tmp/ctitan-tune-XXXXXX"; /* the check verdicts are cached: each entry is checked once */
    temp_cache(path);
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    for (int h = 0; h <= 1; h++) {
        rs.moe_wbf16 = h;
        CHECK(kern_tune(&k, t, m, 0, only_moe, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
        const char *want = h ? "wbf16_fast" : "fp32_fast", *pick = k.chosen[KERN_OP_MOE]->name;
        CHECK(!strcmp(pick, want), "experts %s: picked %s, not %s (log: %s)", h ? "in a bf16 store" : "fp32", pick,
              want, log);
        CHECK(strstr(log, "measured N8H32I16E4k2") && !strstr(log, "k2wbf16") == !h,
              "the cache key says which entries were timed: %s", log);
    }
    unlink(path);
    free(t);
}

static void test_matmul_entries_of_the_run(void) {
    /* as test_moe_entries_of_the_run for the dense matmuls: "fp32_fast" (fwd / bwd mm_base's, fwd_wbf16 /
     * dinp_wbf16 slow) listed first, "wbf16_fast" the reverse; the reference is no candidate (compute-bound) */
    size_t m;
    kern_impl *t = registry_without(KERN_OP_MATMUL, 3, &mm_base, &m);
    const kern_matmul_fwd_fn f = mm_base->fn.matmul.fwd;
    const kern_matmul_bwd_fn b = mm_base->fn.matmul.bwd;
    const kern_matmul_fwd_wbf16_fn fh = mm_base->fn.matmul.fwd_wbf16;
    const kern_matmul_dinp_wbf16_fn dh = mm_base->fn.matmul.dinp_wbf16;
    t[m++] = (kern_impl){KERN_OP_MATMUL, "fp32_fast", "cpu", 0, 0, "test: the wbf16 pair slow",
                         .fn.matmul = {f, b, mm_fwd_h_slow, mm_dinp_h_slow}};
    t[m++] = (kern_impl){KERN_OP_MATMUL, "wbf16_fast", "cpu", 0, 0, "test: the fp32 pair slow",
                         .fn.matmul = {mm_fwd_slow, mm_bwd_slow, fh, dh}};
    t[m++] = (kern_impl){KERN_OP_MATMUL, "ref", "cpu", 0, 0, "reference",
                         .fn.matmul = {op_matmul_fwd, op_matmul_bwd, op_matmul_fwd_wbf16, op_matmul_dinp_wbf16}};
    char ovb[KERN_N_OPS][64];
    const char *only_matmul[KERN_N_OPS + 1];
    all_ref_but(KERN_OP_MATMUL, ovb, only_matmul);
    kern_run_sizes rs = {.B = 1, .T = 8, .hidden = 32, .inter = 64, .vocab = 64, .n_heads = 2, .n_kv_heads = 1,
                         .head_dim = 16, .ce_rows = 8, .n_params = 100};
    char path[] = "/tmp/ctitan-tune-XXXXXX";
    temp_cache(path);
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    for (int h = 0; h <= 1; h++) {
        rs.mm_wbf16 = h;
        CHECK(kern_tune(&k, t, m, 0, only_matmul, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
        const char *want = h ? "wbf16_fast" : "fp32_fast", *pick = k.chosen[KERN_OP_MATMUL]->name;
        CHECK(!strcmp(pick, want), "projections %s: picked %s, not %s (log: %s)", h ? "in a bf16 store" : "fp32",
              pick, want, log);
        CHECK(k.matmul_fwd_wbf16 == (h ? fh : mm_fwd_h_slow), "the ops table calls the pick's wbf16 forward");
        /* an fp32 run's key is the one it always had */
        CHECK(count_lines(path, h ? "pick matmul M8K32N64wbf16 " : "pick matmul M8K32N64 ") == 1,
              "the cache key says which entries were timed: %s", log);
    }
    unlink(path);
    free(t);
}

/* A fast entry whose first timed call was slowed once (preempted) is called
 * again before it is cut, and wins over the registry's slow first entry. */
static void test_preempted_first_call(void) {
    const kern_impl *base;
    size_t m;
    kern_impl *t = registry_without(KERN_OP_ADD, 3, &base, &m);
    /* the reference slow too (kern_check needs one to compare with), so that only late is fast */
    t[m++] = (kern_impl){KERN_OP_ADD, "spun", "cpu", 0, 0, "test: 5 SPIN first", .fn.add = {add_spun}};
    t[m++] = (kern_impl){KERN_OP_ADD, "late", "cpu", 0, 0, "test: the first call slow", .fn.add = {add_late}};
    t[m++] = (kern_impl){KERN_OP_ADD, "ref", "cpu", 0, 0, "test: 5 SPIN first", .fn.add = {add_spun}};
    kern_run_sizes rs = {.B = 1, .T = 8, .hidden = LATE_N / 8, .inter = 64, .vocab = 256, .n_heads = 2,
                         .n_kv_heads = 1, .head_dim = 16, .ce_rows = 8, .n_params = 1000};
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    late_calls = 0;
    CHECK(kern_tune(&k, t, m, 0, force_others, &rs, NULL, log, sizeof log, &e) == 0, "kern_tune: %s", e.msg);
    CHECK(late_calls > 2, "late was timed after its slow call (%d calls)", late_calls);
    CHECK(!strcmp(k.chosen[KERN_OP_ADD]->name, "late"), "picked add=%s, not late (log: %s)",
          k.chosen[KERN_OP_ADD]->name, log);
    free(t);
}

/* kernels bench --cold: the warm-up call and every timed one are each preceded
 * by one pass over the whole scratch, every thread writing its share (an odd
 * size, so the shares differ); without a scratch nothing is written. */
static void test_cold_passes(void) {
    size_t cb = kern_bench_cold_bytes();
    CHECK(cb >= ((size_t)64 << 20) && cb <= ((size_t)1 << 30), "cold scratch of %zu bytes", cb);
    size_t bytes = ((size_t)3 << 20) + 4097;
    const kern_impl *ref = impl_of(KERN_OP_ADD, "ref");
    unsigned char *buf = calloc(bytes, 1);
    kern_shape sh = {.n = 4096};
    kern_bench *x = kern_bench_new(KERN_OP_ADD, &sh);
    kern_bench_set_cold(x, buf, bytes);
    CHECK(ref && buf && kern_bench_time(x, ref, KERN_BENCH_FWD, 3, 0) > 0, "timed add");
    size_t other = 0; /* a warm-up and 3 timed calls: pass 4 wrote every byte last */
    for (size_t i = 0; i < bytes; i++) other += buf[i] != 4;
    CHECK(other == 0, "%zu of %zu scratch bytes not written by the 4th pass (first byte %d)", other, bytes, buf[0]);
    kern_bench_set_cold(x, NULL, 0);
    memset(buf, 0, bytes);
    kern_bench_time(x, ref, KERN_BENCH_FWD, 3, 0);
    other = 0;
    for (size_t i = 0; i < bytes; i++) other += buf[i] != 0;
    CHECK(other == 0, "%zu scratch bytes written with cold off", other);
    kern_bench_free(x);
    free(buf);
}

/* The cache keys of the run's sizes (tune.c's op_shape): attention's names the kv heads
 * (a GQA layout runs other kernels' loops than MHA at the same B, T, heads and head_dim),
 * the memory-bound ops are timed on at most 1 M elements per tensor (TUNE_EW_MAX: the rows
 * of a [tokens, hidden] tensor capped at 1 M / hidden, docs/kernels.md), and cross-entropy
 * on the run's logits block (ce_rows, at most 64 rows). Each op is timed alone (the others
 * forced to ref); attention's candidates are two copies of the tiled kernel, so kern_check
 * runs on two entries only. */
static void test_keys_of_the_run(void) {
    size_t m;
    const kern_impl *base;
    /* t1 and t2 are the registry's "tiled", which `kernels check` checks (and under the
     * sanitizers, again): their verdicts are written into the cache beforehand, with the
     * build id of a verdict the tuner writes for the test's add entries, so that this test
     * times attention without two more kern_checks of it (under ASan test_tune: 26 -> 18 CPU s) */
    char bid[128] = "";
    {
        size_t na;
        kern_impl *ta = make_table(&na);
        char apath[] = "/tmp/ctitan-tune-XXXXXX";
        temp_cache(apath);
        kern_ops ka;
        char alog[4096];
        ct_err ae = {0};
        kern_run_sizes ars = {.B = 1, .T = 8, .hidden = 32, .inter = 64, .vocab = 64, .n_heads = 2,
                              .n_kv_heads = 1, .head_dim = 16, .ce_rows = 8, .n_params = 100};
        CHECK(kern_tune(&ka, ta, na, 0, force_others, &ars, apath, alog, sizeof alog, &ae) == 0, "%s", ae.msg);
        FILE *f = fopen(apath, "r");
        char line[512];
        while (f && fgets(line, sizeof line, f) && !bid[0])
            if (sscanf(line, "check %127s ", bid) != 1 || !strstr(line, " add ")) bid[0] = 0;
        if (f) fclose(f);
        CHECK(bid[0], "the tuner wrote no check verdict for add into %s", apath);
        unlink(apath);
        free(ta);
    }
    kern_impl *t = registry_without(KERN_OP_ATTENTION, 3, &base, &m);
    t[m++] = (kern_impl){KERN_OP_ATTENTION, "t1", "cpu", 0, 0, "test: tiled",
                         .fn.attention = {op_attention_fwd_tiled, op_attention_bwd_tiled}};
    t[m++] = (kern_impl){KERN_OP_ATTENTION, "t2", "cpu", 0, 0, "test: tiled",
                         .fn.attention = {op_attention_fwd_tiled, op_attention_bwd_tiled}};
    t[m++] = (kern_impl){KERN_OP_ATTENTION, "ref", "cpu", 0, 0, "reference",
                         .fn.attention = {op_attention_fwd, op_attention_bwd}};
    char ovb[KERN_N_OPS][64];
    const char *ov[KERN_N_OPS + 1];
    char path[] = "/tmp/ctitan-tune-XXXXXX";
    temp_cache(path);
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    kern_run_sizes rs = {.B = 1, .T = 8, .hidden = 32, .inter = 64, .vocab = 64, .n_heads = 2, .n_kv_heads = 1,
                         .head_dim = 16, .ce_rows = 8, .n_params = 100};
    FILE *cf = fopen(path, "w");
    if (cf) {
        fprintf(cf, "check %s attention t1 ok\ncheck %s attention t2 ok\n", bid, bid);
        fclose(cf);
    }
    all_ref_but(KERN_OP_ATTENTION, ovb, ov);
    CHECK(kern_tune(&k, t, m, 0, ov, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    CHECK(count_lines(path, "pick attention B1T8nh2nkv1hd16 ") == 1, "attention timed on its sizes: %s", log);
    rs.n_kv_heads = 2; /* MHA at the same B, T, heads and head_dim: another key, timed again */
    CHECK(kern_tune(&k, t, m, 0, ov, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    CHECK(!strstr(log, "attention=t1 (cached)") && !strstr(log, "attention=t2 (cached)") &&
              count_lines(path, "pick attention B1T8nh2nkv2hd16 ") == 1,
          "2 kv heads do not reuse the pick of 1: %s", log);
    free(t);

    const kern_impl *reg = kern_registry(&m);
    unsigned cpu = kern_cpu_features();
    int runnable[KERN_N_OPS] = {0};
    for (size_t i = 0; i < m; i++)
        if (!(reg[i].features & ~cpu)) runnable[reg[i].op]++;
    /* 2048 tokens of 1024: 2 M elements, timed on 1 M / 1024 = 1024 rows */
    rs = (kern_run_sizes){.B = 2, .T = 1024, .hidden = 1024, .inter = 64, .vocab = 256, .n_heads = 2,
                          .n_kv_heads = 1, .head_dim = 16, .ce_rows = 16, .n_params = 100};
    all_ref_but(KERN_OP_RMSNORM, ovb, ov);
    CHECK(kern_tune(&k, reg, m, cpu, ov, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    if (runnable[KERN_OP_RMSNORM] > 1)
        CHECK(count_lines(path, "pick rmsnorm N1024C1024 ") == 1, "rmsnorm timed on 1 M elements: %s", log);
    /* cross-entropy: the run's block of 16 logits rows, not 64 of its 2048 tokens */
    all_ref_but(KERN_OP_CROSSENTROPY, ovb, ov);
    CHECK(kern_tune(&k, reg, m, cpu, ov, &rs, path, log, sizeof log, &e) == 0, "%s", e.msg);
    if (runnable[KERN_OP_CROSSENTROPY] > 1)
        CHECK(count_lines(path, "pick crossentropy N16V256 ") == 1, "cross-entropy timed on ce_rows: %s", log);
    unlink(path);
}

/* "hopeless": the reference add, except that at the run's size (kern_check's sizes are
 * others) each call spins 50 SPIN; counted. Listed after "fast", whose first call sets
 * the best so far, so its first call takes far more than 3x (TUNE_CUTOFF) that. */
static int hopeless_calls;
static void add_hopeless(float *out, const float *a, const float *b, long N) {
    if (N == LATE_N) {
        hopeless_calls++;
        spin_for(50 * SPIN);
    }
    op_add(out, a, b, N);
}

/* A candidate whose first call takes 3x the best so far is called once more and, that
 * call as slow, dropped: two calls, no rounds, "(cut off)" in the log (docs/kernels.md). */
static void test_hopeless_cut_off(void) {
    const kern_impl *base;
    size_t m;
    kern_impl *t = registry_without(KERN_OP_ADD, 3, &base, &m);
    t[m++] = (kern_impl){KERN_OP_ADD, "fast", "cpu", 0, 0, "test: the reference", .fn.add = {op_add}};
    t[m++] = (kern_impl){KERN_OP_ADD, "hopeless", "cpu", 0, 0, "test: 50 SPIN a call", .fn.add = {add_hopeless}};
    t[m++] = (kern_impl){KERN_OP_ADD, "ref", "cpu", 0, 0, "reference", .fn.add = {op_add}};
    kern_run_sizes rs = {.B = 1, .T = 8, .hidden = LATE_N / 8, .inter = 64, .vocab = 256, .n_heads = 2,
                         .n_kv_heads = 1, .head_dim = 16, .ce_rows = 8, .n_params = 1000};
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    hopeless_calls = 0;
    CHECK(kern_tune(&k, t, m, 0, force_others, &rs, NULL, log, sizeof log, &e) == 0, "kern_tune: %s", e.msg);
    CHECK(hopeless_calls == 2, "the hopeless candidate was called %d times at the run's size, not 2", hopeless_calls);
    CHECK(strstr(log, "hopeless") && strstr(log, "(cut off)"), "the log says it was cut off: %s", log);
    CHECK(strcmp(k.chosen[KERN_OP_ADD]->name, "hopeless"), "picked the hopeless candidate");
    free(t);
}

/* "first": the reference add after 1.2 BUSY_UNIT at the run's size; "quick" after 1; the
 * reference after 3. The waits are wall-clock spins, so their ratios hold beside any load,
 * up to the time slice a call can lose at its end (a few ms beside the spinners below):
 * BUSY_UNIT is long next to it, so "first" stays within 2x of "quick" (1.2x, plus a lost
 * slice), and the quiet rule would pick "quick". */
#define BUSY_UNIT 25e-3
static void add_first(float *out, const float *a, const float *b, long N) {
    if (N == LATE_N) spin_for(1.2 * BUSY_UNIT);
    op_add(out, a, b, N);
}
static void add_quick(float *out, const float *a, const float *b, long N) {
    if (N == LATE_N) spin_for(BUSY_UNIT);
    op_add(out, a, b, N);
}
static void add_slow3(float *out, const float *a, const float *b, long N) {
    if (N == LATE_N) spin_for(3 * BUSY_UNIT);
    op_add(out, a, b, N);
}

/* Timings taken while other processes use more than 10% of the CPUs are not trusted: the
 * registry's first candidate stays unless another beat it by 2x (docs/kernels.md). One
 * spinning process per CPU makes the machine busy while add is tuned; "first" (1.2x the
 * quickest) must stay. (The quiet case cannot be arranged on a shared machine.) */
static void test_busy_machine_keeps_the_first(void) {
    const kern_impl *base;
    size_t m;
    kern_impl *t = registry_without(KERN_OP_ADD, 3, &base, &m);
    t[m++] = (kern_impl){KERN_OP_ADD, "first", "cpu", 0, 0, "test: 1.2 BUSY_UNIT", .fn.add = {add_first}};
    t[m++] = (kern_impl){KERN_OP_ADD, "quick", "cpu", 0, 0, "test: 1 BUSY_UNIT", .fn.add = {add_quick}};
    t[m++] = (kern_impl){KERN_OP_ADD, "ref", "cpu", 0, 0, "test: 3 BUSY_UNIT", .fn.add = {add_slow3}};
    kern_run_sizes rs = {.B = 1, .T = 8, .hidden = LATE_N / 8, .inter = 64, .vocab = 256, .n_heads = 2,
                         .n_kv_heads = 1, .head_dim = 16, .ce_rows = 8, .n_params = 1000};
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    if (ncpu < 1) ncpu = 1;
    if (ncpu > 512) ncpu = 512;
    pid_t kids[512];
    int nk = 0;
    for (long i = 0; i < ncpu; i++) {
        pid_t p = fork();
        if (p == 0) {
            alarm(20); /* never outlives a test that died before killing it */
            for (volatile unsigned long x = 0;; x++) {
            }
        }
        if (p > 0) kids[nk++] = p;
    }
    spin_for(0.05); /* the spinners running before the timing starts */
    kern_ops k;
    char log[4096];
    ct_err e = {0};
    int rc = kern_tune(&k, t, m, 0, force_others, &rs, NULL, log, sizeof log, &e);
    for (int i = 0; i < nk; i++) kill(kids[i], SIGKILL);
    for (int i = 0; i < nk; i++) waitpid(kids[i], NULL, 0);
    CHECK(rc == 0, "kern_tune: %s", e.msg);
    if (!strstr(log, "beside other work")) /* a CPU quota below the CPUs online (a container) holds them back */
        printf("test_tune: not checked: %d spinning processes did not make the machine busy (%s)\n", nk, log);
    else
        CHECK(!strcmp(k.chosen[KERN_OP_ADD]->name, "first"),
              "busy machine: picked add=%s, not the registry's first (log: %s)", k.chosen[KERN_OP_ADD]->name, log);
    free(t);
}

/* kernels bench: the best of the timed calls, the warm-up included (the slow first call
 * of "late" is not what is reported); and each product of the matmul backward timed
 * alone: KERN_BENCH_DW passes d(input) NULL, KERN_BENCH_DINP d(weight) NULL (ops.h: a NULL
 * output's product is skipped). */
static int spy_dinp, spy_dw;
static void mm_bwd_spy(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int M, int K,
                       int N, int accumulate) {
    spy_dinp = dinp != NULL, spy_dw = dw != NULL;
    op_matmul_bwd(dinp, dw, dout, inp, w, M, K, N, accumulate);
}

static void test_bench_time_and_parts(void) {
    kern_impl late = {KERN_OP_ADD, "late", "cpu", 0, 0, "test: the first call slow", .fn.add = {add_late}};
    kern_shape sh = {.n = LATE_N};
    kern_bench *x = kern_bench_new(KERN_OP_ADD, &sh);
    late_calls = 0;
    double best = kern_bench_time(x, &late, KERN_BENCH_FWD, 3, 0);
    CHECK(late_calls == 4 && best < 10 * SPIN, "bench of late: %d calls, best %.3g s (its first call spins %.3g s)",
          late_calls, best, 50 * SPIN);
    kern_bench_free(x);

    kern_impl spy = {KERN_OP_MATMUL, "spy", "cpu", 0, 0, "test: records the outputs asked for",
                     .fn.matmul = {op_matmul_fwd, mm_bwd_spy, op_matmul_fwd_wbf16, op_matmul_dinp_wbf16}};
    kern_shape ms = {.M = 8, .K = 16, .N = 24};
    x = kern_bench_new(KERN_OP_MATMUL, &ms);
    kern_bench_time(x, &spy, KERN_BENCH_DW, 0, 0);
    CHECK(!spy_dinp && spy_dw, "KERN_BENCH_DW: d(input) %s, d(weight) %s", spy_dinp ? "computed" : "NULL",
          spy_dw ? "computed" : "NULL");
    kern_bench_time(x, &spy, KERN_BENCH_DINP, 0, 0);
    CHECK(spy_dinp && !spy_dw, "KERN_BENCH_DINP: d(input) %s, d(weight) %s", spy_dinp ? "computed" : "NULL",
          spy_dw ? "computed" : "NULL");
    kern_bench_time(x, &spy, KERN_BENCH_BWD, 0, 0);
    CHECK(spy_dinp && spy_dw, "KERN_BENCH_BWD: both products");
    kern_bench_free(x);

    /* --cold's scratch: 4x the last-level cache as sysfs gives it (index3, else index2), kept
     * within 64 MB and 1 GB (docs/kernels.md) */
    size_t llc = 0;
    const char *files[] = {"/sys/devices/system/cpu/cpu0/cache/index3/size",
                           "/sys/devices/system/cpu/cpu0/cache/index2/size"};
    for (int i = 0; i < 2 && !llc; i++) {
        FILE *f = fopen(files[i], "r");
        unsigned long v = 0;
        char unit = 0;
        if (f && fscanf(f, "%lu%c", &v, &unit) >= 1)
            llc = (size_t)v << (unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0);
        if (f) fclose(f);
    }
    if (llc) {
        size_t want = 4 * llc, lo = (size_t)64 << 20, hi = (size_t)1 << 30;
        want = want < lo ? lo : want > hi ? hi : want;
        CHECK(kern_bench_cold_bytes() == want, "cold scratch %zu bytes, want 4 x %zu within [64 MB, 1 GB] = %zu",
              kern_bench_cold_bytes(), llc, want);
    }
}

int main(void) {
    test_cold_passes();
    test_bench_time_and_parts();
    test_hopeless_cut_off();
    test_busy_machine_keeps_the_first();
    test_pick_and_cache();
    test_preempted_first_call();
    if (getenv("CTITAN_EMULATED")) /* under qemu (scripts/test_aarch64.sh): ~30 s of emulated GEMM timing */
        printf("test_tune: skipped under emulation: test_ops_of_the_run (the same code is run natively)\n");
    else {
        test_ops_of_the_run();
        test_moe_entries_of_the_run();
        test_matmul_entries_of_the_run();
        test_keys_of_the_run();
    }
    return CHECK_DONE();
}
