/* report/run.c: run directories read back (see run.h). The JSON lines go
 * through the strict reader (formats/json.h) like every file from outside;
 * config.toml through the TOML reader, flattened to "section.key" pairs.
 *
 * run_summarise cuts a run into sessions at its start events. A session
 * that exited ends at its exit; one that was killed ends at its last sign of
 * life: the latest of its checkpoint events and its metrics lines, and the
 * lines the next launch cut from metrics.jsonl when it resumed (its start
 * event keeps their furthest step and latest time, metrics_last_step/_time,
 * because the cut erases exactly the steps the restart redoes). Times are
 * the files' Unix seconds, so sessions on one machine line up; across
 * machines they are as good as the clocks' agreement. */
#include "report/run.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <sys/stat.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fs.h"
#include "formats/json.h"
#include "formats/toml.h"

static const char *const field_keys[RUN_N_FIELDS] = {
    "loss", "grad_norm", "lr", "memory_gib", "tps", "tflops", "mfu", "elapsed_s", "step_time_s", "tokens_seen",
    "time", "world"};

static double num(const cJSON *o, const char *k) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsNumber(x) ? x->valuedouble : NAN;
}

static void str(char *out, size_t cap, const cJSON *o, const char *k) {
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    snprintf(out, cap, "%s", cJSON_IsString(x) ? x->valuestring : "");
}

static int step_of(const cJSON *o) {
    double s = num(o, "step");
    return isfinite(s) && s >= 0 && s <= 2e9 ? (int)s : -1;
}

/* Grows *arr (element size sz) to hold n + 1. */
static void *grow(void *arr, int n, size_t sz) {
    if (n & (n - 1) && n) return arr; /* capacity is the next power of two */
    void *p = realloc(arr, (n ? 2 * (size_t)n : 8) * sz);
    if (!p) abort();
    return p;
}

typedef int (*line_fn)(run_data *r, const cJSON *o, const char *where, ct_err *e);

/* The keys a line may lack (NaN or "" then) but, when present, must have
 * the right type: a "loss": "x" read as absent would silently drop that
 * step from a comparison that then reports agreement. null counts as
 * absent, the way a missing key does. */
static int check_types(const cJSON *o, const char *where, const char *const *nums, const char *const *strs, ct_err *e) {
    for (int w = 0; w < 2; w++)
        for (const char *const *k = w ? strs : nums; *k; k++) {
            const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, *k);
            if (!x || cJSON_IsNull(x) || (w ? cJSON_IsString(x) : cJSON_IsNumber(x))) continue;
            char *v = cJSON_PrintUnformatted(x);
            int rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"%s\" is not a %s (%.40s%s)", where, *k, w ? "string" : "number",
                             v ? v : "?", v && strlen(v) > 40 ? "..." : "");
            free(v);
            return rc;
        }
    return 0;
}

static const char *const metrics_nums[] = {"step", "loss", "grad_norm", "lr", "memory_gib", "tps", "tflops", "mfu",
                                           "elapsed_s", "step_time_s", "tokens_seen", "time", "world", "val_loss",
                                           "val_perplexity", NULL};
static const char *const event_nums[] = {"time", "step", "world", "machines", "threads", "launch_time", "startup_s",
                                         "load_s", "metrics_last_step", "metrics_last_time", "save_s", "mib",
                                         "wall_s", "cpu_s", "energy_j", NULL};
static const char *const event_strs[] = {"event", "resumed_from", "cpu", "host", "kind", "path", "reason",
                                         "energy_unavailable", NULL};
static const char *const no_keys[] = {NULL};

static int add_metrics_line(run_data *r, const cJSON *o, const char *where, ct_err *e) {
    if (check_types(o, where, metrics_nums, no_keys, e)) return e->code;
    int step = step_of(o);
    if (step < 0) return ct_fail(e, CT_ERR_FORMAT, "%s: no valid \"step\"", where);
    if (cJSON_GetObjectItemCaseSensitive(o, "val_loss")) {
        r->vals = grow(r->vals, r->n_vals, sizeof *r->vals);
        r->vals[r->n_vals++] = (run_val){step, num(o, "val_loss"), num(o, "val_perplexity")};
        return 0;
    }
    r->points = grow(r->points, r->n_points, sizeof *r->points);
    run_point *p = &r->points[r->n_points++];
    p->step = step;
    for (int f = 0; f < RUN_N_FIELDS; f++) p->v[f] = num(o, field_keys[f]);
    return 0;
}

static int add_event_line(run_data *r, const cJSON *o, const char *where, ct_err *e) {
    if (check_types(o, where, event_nums, event_strs, e)) return e->code;
    char name[32];
    str(name, sizeof name, o, "event");
    if (!name[0]) return ct_fail(e, CT_ERR_FORMAT, "%s: no \"event\"", where);
    r->events = grow(r->events, r->n_events, sizeof *r->events);
    run_event *v = &r->events[r->n_events++];
    memset(v, 0, sizeof *v);
    v->kind = !strcmp(name, "start")        ? RUN_EV_START
              : !strcmp(name, "checkpoint") ? RUN_EV_CHECKPOINT
              : !strcmp(name, "exit")       ? RUN_EV_EXIT
                                            : RUN_EV_OTHER;
    v->time = num(o, "time");
    v->step = step_of(o);
    double w = num(o, "world"), m = num(o, "machines"), th = num(o, "threads");
    v->world = isfinite(w) && w >= 1 && w < 1e6 ? (int)w : 1;
    v->machines = isfinite(m) && m >= 1 && m < 1e6 ? (int)m : 1;
    v->threads = isfinite(th) && th >= 1 && th < 1e6 ? (int)th : 1;
    v->launch_time = num(o, "launch_time");
    v->startup_s = num(o, "startup_s");
    v->load_s = num(o, "load_s");
    double ls = num(o, "metrics_last_step");
    v->metrics_last_step = isfinite(ls) && ls >= 0 && ls <= 2e9 ? (int)ls : -1;
    v->metrics_last_time = num(o, "metrics_last_time");
    str(v->resumed_from, sizeof v->resumed_from, o, "resumed_from");
    str(v->cpu, sizeof v->cpu, o, "cpu");
    str(v->host, sizeof v->host, o, "host");
    str(v->ckpt_kind, sizeof v->ckpt_kind, o, "kind");
    str(v->path, sizeof v->path, o, "path");
    v->save_s = num(o, "save_s");
    v->mib = num(o, "mib");
    str(v->reason, sizeof v->reason, o, "reason");
    v->wall_s = num(o, "wall_s");
    v->cpu_s = num(o, "cpu_s");
    v->energy_j = num(o, "energy_j");
    str(v->energy_note, sizeof v->energy_note, o, "energy_unavailable");
    return 0;
}

/* Whether p[0..n), a last line without its newline, looks like what a
 * writer killed mid-line leaves: the start of an object, printable text.
 * NUL bytes or other binary at the end of a file are damage (a crash of
 * the filesystem, a bad copy), not a torn line, and stay an error. */
static int torn_line(const char *p, size_t n) {
    size_t i = 0;
    while (i < n && (p[i] == ' ' || p[i] == '\t' || p[i] == '\r')) i++;
    if (i == n || p[i] != '{') return 0;
    for (; i < n; i++)
        if ((unsigned char)p[i] < 0x20 && p[i] != '\t' && p[i] != '\r') return 0;
    return 1;
}

/* Every line of a JSONL file through fn. missing_ok: an absent file is an
 * empty one. */
static int read_jsonl(run_data *r, const char *dir, const char *name, int missing_ok, line_fn fn, ct_err *e) {
    char path[4200];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    size_t len;
    struct stat st;
    if (missing_ok && stat(path, &st) && errno == ENOENT) return 0;
    char *text = fs_read_file(path, 0, &len, e);
    if (!text) return e->code;
    int rc = 0, lineno = 0;
    for (char *p = text, *end = text + len; p < end && !rc; lineno++) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = nl ? (size_t)(nl - p) : (size_t)(end - p);
        char where[4300];
        snprintf(where, sizeof where, "%s:%d", path, lineno + 1);
        if (n) {
            cJSON *o = json_parse(p, n, where, e);
            if (!o) {
                rc = !nl && torn_line(p, n) ? 0 : e->code;
                if (!rc) { /* kept readable, but said: the reader should know a step may be missing */
                    fprintf(stderr, "ctitan: warning: %s: the last line is cut short (a run killed while writing it, "
                                    "or still running): ignored\n", where);
                    *e = (ct_err){0};
                }
            } else {
                rc = cJSON_IsObject(o) ? fn(r, o, where, e) : ct_fail(e, CT_ERR_FORMAT, "%s: not a JSON object", where);
                cJSON_Delete(o);
            }
        }
        p += n + 1;
    }
    free(text);
    return rc;
}

static char *value_str(const toml_value *v) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) abort();
    switch (v->kind) {
    case TOML_STRING: fprintf(f, "\"%s\"", v->s); break;
    case TOML_INT: fprintf(f, "%lld", (long long)v->i); break;
    case TOML_FLOAT: fprintf(f, "%.9g", v->f); break;
    case TOML_BOOL: fprintf(f, "%s", v->i ? "true" : "false"); break;
    case TOML_ARRAY:
        fputc('[', f);
        for (int i = 0; i < v->n_items; i++) {
            char *s = value_str(&v->items[i]);
            fprintf(f, "%s%s", i ? ", " : "", s);
            free(s);
        }
        fputc(']', f);
        break;
    }
    fclose(f);
    return buf;
}

static int read_config(run_data *r, const char *dir, ct_err *e) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.toml", dir);
    struct stat st;
    if (stat(path, &st) && errno == ENOENT) return 0;
    toml_doc d;
    int rc = toml_parse_file(path, &d, e);
    if (rc) return rc;
    for (int s = 0; s < d.n_sections; s++)
        for (int k = 0; k < d.sections[s].n_kvs; k++) {
            const toml_kv *kv = &d.sections[s].kvs[k];
            r->config = grow(r->config, r->n_config, sizeof *r->config);
            run_setting *set = &r->config[r->n_config++];
            size_t n = strlen(d.sections[s].name) + strlen(kv->key) + 2;
            set->key = malloc(n);
            if (!set->key) abort();
            snprintf(set->key, n, "%s%s%s", d.sections[s].name, d.sections[s].name[0] ? "." : "", kv->key);
            set->value = value_str(&kv->val);
        }
    toml_free(&d);
    return 0;
}

int run_load(run_data *r, const char *dir, ct_err *e) {
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    struct stat st;
    if (stat(dir, &st) || !S_ISDIR(st.st_mode)) return ct_fail(e, CT_ERR_IO, "%s: not a run directory (no such directory)", dir);
    int rc = read_jsonl(r, dir, "metrics.jsonl", 0, add_metrics_line, e);
    /* an empty file says nothing about the run: as good as a missing one
     * (a comparison of it would find no difference and report agreement) */
    if (!rc && !r->n_points && !r->n_vals)
        rc = ct_fail(e, CT_ERR_IO, "%s/metrics.jsonl: no step logged", dir);
    if (!rc) rc = read_jsonl(r, dir, "events.jsonl", 1, add_event_line, e);
    if (!rc) rc = read_config(r, dir, e);
    return rc;
}

void run_free(run_data *r) {
    for (int i = 0; i < r->n_config; i++) {
        free(r->config[i].key);
        free(r->config[i].value);
    }
    free(r->config);
    free(r->points);
    free(r->vals);
    free(r->events);
    memset(r, 0, sizeof *r);
}

const char *run_setting_get(const run_data *r, const char *key) {
    for (int i = 0; i < r->n_config; i++)
        if (!strcmp(r->config[i].key, key)) return r->config[i].value;
    return NULL;
}

int run_last_step(const run_data *r) { return r->n_points ? r->points[r->n_points - 1].step : 0; }

/* ---- the accounting of a run (run_summarise) */

/* A logged step's value: one of metrics.jsonl's fields, or (RUN_JOB_TPS) the
 * job's tokens/s. "tps" is per rank (torchtitan's), which under data
 * parallel understates a layout's throughput by the rank count and under
 * tensor parallel counts shared tokens once per rank; tokens_seen / step is
 * the global batch's tokens whatever the layout. */
static double point_value(const run_point *p, int f) {
    if (f != RUN_JOB_TPS) return p->v[f];
    return p->step > 0 ? p->v[RUN_TOKENS_SEEN] / p->step / p->v[RUN_STEP_TIME_S] : NAN;
}

/* Mean of point_value(f) over the logged steps after step 1 (its time
 * includes the warm-up: first-touch of the buffers, kernel choice), or over
 * all when the run logged step 1 alone. */
double run_mean_after_first(const run_data *r, int f) {
    double s = 0, s1 = 0;
    int n = 0, n1 = 0;
    for (int i = 0; i < r->n_points; i++) {
        double v = point_value(&r->points[i], f);
        if (!isfinite(v)) continue;
        if (r->points[i].step > 1) s += v, n++;
        else s1 += v, n1++;
    }
    return n ? s / n : n1 ? s1 / n1 : NAN;
}

static void session_from_events(const run_data *r, int i, run_session *s) {
    const run_event *st = &r->events[i];
    memset(s, 0, sizeof *s);
    s->launch = isfinite(st->launch_time)                        ? st->launch_time
                : isfinite(st->startup_s) && isfinite(st->time) ? st->time - st->startup_s
                                                                 : st->time;
    s->end = st->time;
    s->killed = 1;
    snprintf(s->reason, sizeof s->reason, "killed");
    s->world = st->world;
    s->machines = st->machines;
    s->threads = st->threads;
    s->start_step = s->end_step = st->step > 0 ? st->step : 0;
    s->startup_s = isfinite(st->startup_s) ? st->startup_s : 0;
    s->load_s = isfinite(st->load_s) ? st->load_s : 0;
    s->cpu_s = s->energy_j = NAN;
    for (int k = i + 1; k < r->n_events && r->events[k].kind != RUN_EV_START; k++) {
        const run_event *v = &r->events[k];
        if (v->kind == RUN_EV_CHECKPOINT) {
            if (isfinite(v->time) && v->time > s->end) s->end = v->time;
            if (v->step > s->end_step) s->end_step = v->step;
        } else if (v->kind == RUN_EV_EXIT && s->killed) {
            s->killed = 0;
            snprintf(s->reason, sizeof s->reason, "%s", v->reason[0] ? v->reason : "?");
            if (isfinite(v->time)) s->end = v->time;
            if (v->step >= 0) s->end_step = v->step;
            s->cpu_s = v->cpu_s;
            s->energy_j = v->energy_j;
        }
    }
}

void run_summarise(const run_data *r, run_summary *c) {
    memset(c, 0, sizeof *c);
    c->tps_mean = run_mean_after_first(r, RUN_TPS);
    c->job_tps_mean = run_mean_after_first(r, RUN_JOB_TPS);
    c->step_time_mean = run_mean_after_first(r, RUN_STEP_TIME_S);
    int n = 0;
    for (int i = 0; i < r->n_events; i++) n += r->events[i].kind == RUN_EV_START;
    c->s = ct_calloc((size_t)n + 1, sizeof *c->s);
    int *at = ct_malloc(((size_t)n + 1) * sizeof *at); /* event index of each session's start */
    for (int i = 0; i < r->n_events; i++)
        if (r->events[i].kind == RUN_EV_START) {
            at[c->n_sessions] = i;
            session_from_events(r, i, &c->s[c->n_sessions++]);
        }
    for (int k = 0; k < n; k++) {
        run_session *s = &c->s[k];
        if (!s->killed) continue;
        double next = k + 1 < n ? c->s[k + 1].launch : INFINITY;
        for (int i = 0; i < r->n_points; i++) { /* its metrics lines that survived */
            double t = r->points[i].v[RUN_TIME];
            if (!(t >= s->launch && t < next)) continue;
            if (t > s->end) s->end = t;
            if (r->points[i].step > s->end_step) s->end_step = r->points[i].step;
        }
        if (k + 1 < n) { /* and those the next launch cut */
            const run_event *nx = &r->events[at[k + 1]];
            if (nx->metrics_last_time >= s->launch && nx->metrics_last_time < next) {
                if (nx->metrics_last_time > s->end) s->end = nx->metrics_last_time;
                if (nx->metrics_last_step > s->end_step) s->end_step = nx->metrics_last_step;
            }
        }
    }
    free(at);
    c->restarts = n > 0 ? n - 1 : 0;
    c->energy_note[0] = 0;
    for (int k = 0; k < n; k++) {
        run_session *s = &c->s[k];
        if (!(s->end >= s->launch)) s->end = s->launch;
        double wall = s->end - s->launch;
        c->wall_s += wall;
        c->machine_s += s->machines * wall;
        c->core_s += (double)s->world * s->threads * wall;
        if (isfinite(s->cpu_s)) c->cpu_est_s += s->cpu_s * s->world;
        else c->cpu_unknown++;
        if (isfinite(s->energy_j)) {
            c->energy_j += s->energy_j;
            c->energy_est_j += s->energy_j * s->machines;
            c->energy_n++;
        } else {
            c->energy_unknown++;
        }
        if (k == 0) continue;
        const run_session *p = &c->s[k - 1];
        s->downtime_s = fmax(0, s->launch - p->end);
        s->redone_steps = p->end_step > s->start_step ? p->end_step - s->start_step : 0;
        c->downtime_s += s->downtime_s;
        c->downtime_machine_s += s->machines * s->downtime_s;
        c->startup_s += s->startup_s;
        c->load_s += s->load_s;
        c->redone_steps += s->redone_steps;
    }
    /* the reason RAPL was not read, from the exits that said one */
    for (int i = 0; i < r->n_events; i++)
        if (r->events[i].kind == RUN_EV_EXIT && r->events[i].energy_note[0])
            snprintf(c->energy_note, sizeof c->energy_note, "%s", r->events[i].energy_note);
    c->redone_s = c->redone_steps * (isfinite(c->step_time_mean) ? c->step_time_mean : 0);
    c->lost_s = c->downtime_s + c->startup_s + c->redone_s;
}

void run_summary_free(run_summary *c) {
    free(c->s);
    memset(c, 0, sizeof *c);
}
