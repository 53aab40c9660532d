/* tests/c/metrics/test_profile.c: the trace writer of metrics/profile.c read back
 * with cJSON, as a trace viewer would: names escaped into valid JSON, spans
 * that nest in time, nothing recorded outside a traced step, the summary's
 * totals equal to the trace's durations, collective spans with their bytes,
 * and the file written whole or not at all. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"
#include "distributed/comm.h"
#include "metrics/profile.h"

static cJSON *load(const char *path) {
    ct_err e = {0};
    size_t n = 0;
    char *txt = fs_read_file(path, 1 << 24, &n, &e);
    cJSON *j = txt ? cJSON_Parse(txt) : NULL;
    free(txt);
    return j;
}

static const cJSON *find(const cJSON *events, const char *name) {
    const cJSON *ev;
    cJSON_ArrayForEach(ev, events) {
        const cJSON *n = cJSON_GetObjectItem(ev, "name");
        if (cJSON_IsString(n) && !strcmp(n->valuestring, name)) return ev;
    }
    return NULL;
}

static double num(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItem(o, k);
    return cJSON_IsNumber(v) ? v->valuedouble : -1;
}

static void spin(void) { /* a span with a duration the clock sees */
    int64_t t = prof_now_ns();
    while (prof_now_ns() - t < 20000) {
    }
}

static int has_tmp(const char *dir) {
    DIR *d = opendir(dir);
    int found = 0;
    struct dirent *de;
    while (d && (de = readdir(d)))
        if (strstr(de->d_name, ".tmp")) found = 1;
    if (d) closedir(d);
    return found;
}

int main(void) {
    char dir[] = "/tmp/ct_profile_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    char folder[512], path[700];
    snprintf(folder, sizeof folder, "%s/traces", dir);
    prof *p = prof_new(3, folder);
    kern_ops k;
    kern_select_ref(&k);
    prof_set_kernels(p, &k);

    /* before the step: not recorded, and a span begun before the step is dropped */
    int64_t early = PROF_T0(p);
    prof_span(p, "phase", "before", prof_now_ns());
    CHECK(!prof_recording(p), "not recording before prof_step_begin");

    prof_step_begin(p, 7);
    CHECK(prof_recording(p), "recording");
    prof_span(p, "phase", "late", early);
    int64_t t_step = PROF_T0(p);
    static const char odd[] = "q\"uote\\back\nnl\ttab\x01" "ctl";
    int64_t t_outer = PROF_T0(p);
    for (int i = 0; i < 3; i++) {
        int64_t t = PROF_T0(p);
        spin();
        prof_kern(p, KERN_OP_MATMUL, "matmul_fwd", t);
    }
    int64_t t_odd = PROF_T0(p);
    spin();
    prof_span(p, "phase", odd, t_odd);
    ct_comm c;
    comm_init_single(&c);
    c.prof = p;
    float in[5] = {1, 2, 3, 4, 5}, out[5];
    comm_all_gather(&c, out, in, 5, COMM_F32);
    comm_allreduce(&c, in, 5, COMM_F32, COMM_MAX);
    prof_layer(p, "layer_fwd", 2, t_outer);
    prof_span(p, "step", "step", t_step);
    ct_err e = {0};
    CHECK(prof_step_end(p, &e) == 0, "prof_step_end: %s", e.msg);
    CHECK(!prof_recording(p), "stopped after prof_step_end");
    prof_trace_path(p, 7, path, sizeof path);
    CHECK(strstr(path, "traces/iteration_7/rank3_trace.json") != NULL, "path %s", path);

    cJSON *j = load(path);
    CHECK(j != NULL, "%s parses as JSON", path);
    const cJSON *evs = cJSON_GetObjectItem(j, "traceEvents");
    CHECK(cJSON_IsArray(evs), "traceEvents is an array");
    CHECK(!find(evs, "before") && !find(evs, "late"), "spans outside the step are not recorded");
    const cJSON *o = find(evs, odd);
    CHECK(o != NULL, "the name with quotes, backslash, newline, tab and a control character round-trips");
    const cJSON *pn = find(evs, "process_name");
    CHECK(pn && !strcmp(cJSON_GetObjectItem(pn, "ph")->valuestring, "M") &&
              !strcmp(cJSON_GetObjectItem(cJSON_GetObjectItem(pn, "args"), "name")->valuestring, "rank 3"),
          "process_name metadata names rank 3");
    const cJSON *outer = find(evs, "layer_fwd");
    CHECK(outer && num(cJSON_GetObjectItem(outer, "args"), "layer") == 2, "the layer span carries its index");
    double o0 = num(outer, "ts"), o1 = o0 + num(outer, "dur");
    int n_mm = 0;
    double mm_us = 0;
    const cJSON *ev;
    cJSON_ArrayForEach(ev, evs) {
        if (strcmp(cJSON_GetObjectItem(ev, "ph")->valuestring, "X")) continue;
        CHECK(num(ev, "pid") == 3, "pid is the rank");
        CHECK(num(ev, "ts") >= 0 && num(ev, "dur") >= 0, "ts and dur non-negative");
        const char *name = cJSON_GetObjectItem(ev, "name")->valuestring;
        if (!strcmp(name, "matmul_fwd")) {
            n_mm++;
            mm_us += num(ev, "dur");
            const cJSON *a = cJSON_GetObjectItem(ev, "args");
            CHECK(!strcmp(cJSON_GetObjectItem(a, "impl")->valuestring, "ref") &&
                      !strcmp(cJSON_GetObjectItem(a, "op")->valuestring, "matmul"),
                  "an op span names its op and implementation");
        }
        if (strcmp(name, "layer_fwd") && strcmp(name, "step")) /* nested inside the layer span */
            CHECK(num(ev, "ts") >= o0 && num(ev, "ts") + num(ev, "dur") <= o1 + 1e-3, "%s inside layer_fwd", name);
    }
    CHECK(n_mm == 3, "3 matmul spans, got %d", n_mm);
    const cJSON *ag = find(evs, "all_gather");
    CHECK(ag && num(cJSON_GetObjectItem(ag, "args"), "bytes") == 20 &&
              !strcmp(cJSON_GetObjectItem(cJSON_GetObjectItem(ag, "args"), "dtype")->valuestring, "f32"),
          "all_gather of 5 floats on 1 rank: 20 bytes");
    const cJSON *ar = find(evs, "all_reduce");
    CHECK(ar && !strcmp(cJSON_GetObjectItem(cJSON_GetObjectItem(ar, "args"), "op")->valuestring, "max"),
          "all_reduce records its reduction");
    /* the summary's total for matmul_fwd is the sum of the trace's durations (ns kept exactly) */
    long calls = 0;
    const char *nm = NULL;
    int64_t ns = -1;
    for (int i = 0; (ns = prof_summary_ns(p, i, &calls, &nm)) >= 0; i++)
        if (!strcmp(nm, "matmul_fwd")) break;
    CHECK(ns >= 0 && calls == 3, "summary row for matmul_fwd, %ld calls", calls);
    CHECK(ns >= 0 && fabs(ns / 1e3 - mm_us) < 1e-6, "summary %.3f us == trace %.3f us", ns / 1e3, mm_us);
    char *sum = NULL;
    size_t sumlen = 0;
    FILE *sf = open_memstream(&sum, &sumlen);
    prof_summary(p, sf);
    fclose(sf);
    CHECK(strstr(sum, "matmul_fwd") && strstr(sum, "1 traced step"), "summary table:\n%s", sum);
    free(sum);
    cJSON_Delete(j);
    char idir[600];
    snprintf(idir, sizeof idir, "%s/iteration_7", folder);
    CHECK(!has_tmp(idir), "no temporary file left beside the trace");

    /* a step whose directory cannot be made: an I/O error naming it, no partial file */
    char blocker[600];
    snprintf(blocker, sizeof blocker, "%s/iteration_8", folder);
    FILE *bf = fopen(blocker, "w");
    if (bf) fclose(bf);
    prof_step_begin(p, 8);
    prof_span(p, "step", "step", PROF_T0(p));
    e = (ct_err){0};
    CHECK(prof_step_end(p, &e) == CT_ERR_IO && strstr(e.msg, "iteration_8"), "unwritable step: %s", e.msg);
    prof_free(p);
    prof_free(NULL);

    /* a step that fails while traced is never ended: freeing the profiler
     * disarms the kernels' per-thread stamps it lent this thread */
    p = prof_new(0, folder);
    prof_step_begin(p, 9);
    CHECK(kern_trace_armed() != NULL, "a traced step arms the kernels' per-thread stamps");
    prof_free(p);
    CHECK(kern_trace_armed() == NULL, "prof_free of a profiler still recording disarms them");

    /* the memory snapshot: categories, totals, peak RSS */
    prof_mem cats[] = {{"parameters", 100, 100}, {"activations", 50, -1}};
    char mdir[600];
    snprintf(mdir, sizeof mdir, "%s/mem", dir);
    e = (ct_err){0};
    CHECK(prof_memory_snapshot(mdir, 1, 4, cats, 2, 4096, NULL, &e) == 0, "snapshot: %s", e.msg);
    snprintf(path, sizeof path, "%s/rank1_memory_snapshot.json", mdir);
    j = load(path);
    CHECK(j && num(j, "total_planned") == 150 && num(j, "peak_rss") == 4096 && num(j, "step") == 4,
          "snapshot totals");
    /* the measured total sums the categories measured; an unmeasured one (null) adds nothing */
    CHECK(j && num(j, "total_measured") == 100, "total_measured %g, want 100 (the null category left out)",
          j ? num(j, "total_measured") : -1);
    const cJSON *mc = j ? cJSON_GetArrayItem(cJSON_GetObjectItem(j, "categories"), 1) : NULL;
    CHECK(mc && cJSON_IsNull(cJSON_GetObjectItem(mc, "measured")), "unmeasured is null");
    cJSON_Delete(j);
    ct_rm_tree(dir, NULL);
    return CHECK_DONE();
}
