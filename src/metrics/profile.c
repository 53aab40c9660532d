/* metrics/profile.c: spans in memory during a traced step, the Chrome trace
 * written after it, the summary table and the memory snapshot
 * (metrics/profile.h has the design). The JSON is printed by hand rather
 * than through cJSON: a step of a large model has ~10^5 spans, and a tree of
 * that many nodes would cost more than the step's own allocations. */
#define _POSIX_C_SOURCE 200809L
#include "metrics/profile.h"

#include <inttypes.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "core/fs.h"

enum { ARG_NONE, ARG_KERN, ARG_LAYER, ARG_COMM, ARG_MODEL };

typedef struct {
    const char *cat, *name;
    int64_t t0, dur;
    int kind;
    int worker; /* -1: the recording thread's span; else an OpenMP thread's share of an op (its number) */
    union {
        int op;    /* ARG_KERN: kern_op */
        struct { const char *op; int kern; } m; /* ARG_MODEL: the op's name, the registry op it runs */
        int layer; /* ARG_LAYER */
        struct { size_t bytes, count; const char *dtype, *op; int size; } c;
    } a;
} span;

typedef struct { /* one row of the summary */
    const char *cat, *name, *op, *impl;
    int size;
    long calls;
    int64_t ns;
} sum_row;

struct prof {
    int rank, step, on;
    long tid;        /* the recording thread's track */
    kern_trace tr;   /* the OpenMP threads' stamps for the op now open (kernels/ops.h) */
    unsigned char *worker_seen; /* [tr.n]: the thread has spans this step (its thread_name is written) */
    char *folder;
    span *spans;
    size_t n, cap;
    const char *op_name[KERN_N_OPS], *impl[KERN_N_OPS]; /* what each kern_op's calls resolve to */
    char model_impl[KERN_N_OPS][48];                     /* "matmul:<impl>": a model op's kernel */
    sum_row *rows;
    int n_rows, cap_rows;
    int64_t step_ns; /* the traced steps' own time, for the summary's percentages */
    int steps;
};

/* A larger copy of old[had bytes]; dies as ct_malloc does when memory runs out. */
static void *grow(void *old, size_t had, size_t n) {
    void *q = ct_malloc(n);
    if (had) memcpy(q, old, had);
    free(old);
    return q;
}

int64_t prof_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

prof *prof_new(int rank, const char *folder) {
    prof *p = ct_calloc(1, sizeof *p);
    p->rank = rank;
    p->folder = ct_strdup(folder);
    for (int i = 0; i < KERN_N_OPS; i++) {
        p->op_name[i] = kern_op_name((kern_op)i);
        p->impl[i] = "?";
    }
    return p;
}

void prof_free(prof *p) {
    if (!p) return;
    /* a step that failed while traced never reached prof_step_end: the
     * kernels must not keep stamping slots about to be freed */
    if (kern_trace_armed() == &p->tr) kern_trace_arm(NULL);
    free(p->folder);
    free(p->spans);
    free(p->rows);
    free(p->tr.slot);
    free(p->worker_seen);
    free(p);
}

void prof_set_kernels(prof *p, const kern_ops *k) {
    for (int i = 0; i < KERN_N_OPS; i++) {
        p->op_name[i] = kern_op_name((kern_op)i);
        p->impl[i] = k->chosen[i] ? k->chosen[i]->name : "?";
    }
    /* bf16 mixed precision points the model's matmul and experts calls at
     * other ops' choices: their spans are those ops' */
    const kern_impl *b = k->chosen[KERN_OP_MATMUL_BF16];
    if (b && k->matmul_fwd == b->fn.matmul.fwd && k->chosen[KERN_OP_MATMUL] != b) {
        p->op_name[KERN_OP_MATMUL] = kern_op_name(KERN_OP_MATMUL_BF16);
        p->impl[KERN_OP_MATMUL] = b->name;
    }
    b = k->chosen[KERN_OP_MOE_BF16];
    if (b && k->moe_fwd == b->fn.moe.fwd && k->chosen[KERN_OP_MOE] != b) {
        p->op_name[KERN_OP_MOE] = kern_op_name(KERN_OP_MOE_BF16);
        p->impl[KERN_OP_MOE] = b->name;
    }
    for (int i = 0; i < KERN_N_OPS; i++) snprintf(p->model_impl[i], sizeof p->model_impl[i], "%s:%s", p->op_name[i], p->impl[i]);
}

void prof_step_begin(prof *p, int step) {
    p->step = step;
    p->n = 0;
    p->on = 1;
    int nt = omp_get_max_threads(); /* [training] threads may have changed since the last step */
    if (nt > p->tr.n) {
        free(p->tr.slot);
        free(p->worker_seen);
        p->tr.slot = ct_calloc((size_t)nt, sizeof *p->tr.slot);
        p->worker_seen = ct_calloc((size_t)nt, 1);
        p->tr.n = nt;
    }
    memset(p->tr.slot, 0, (size_t)p->tr.n * sizeof *p->tr.slot);
    memset(p->worker_seen, 0, (size_t)p->tr.n);
    /* the workers' tracks are their OpenMP numbers 0..n-1; a thread id that
     * small (a process near pid 1, in a container) moves above Linux's
     * pid_max (2^22) instead of sharing a track with them */
    p->tid = (long)syscall(SYS_gettid);
    if (p->tid < p->tr.n) p->tid += 1L << 22;
    kern_trace_arm(&p->tr); /* this thread calls the step's kernels */
}

int prof_recording(const prof *p) { return p && p->on; }

int64_t prof_t0(const prof *p) {
    if (!p->on) return 0;
    /* stamps of kernels run outside an op span (none today) do not count as the next op's */
    if (p->tr.n) memset(p->tr.slot, 0, (size_t)p->tr.n * sizeof *p->tr.slot);
    return prof_now_ns();
}

/* A new slot at the end of p->spans (which may move: callers index, not point, across it). */
static span *next_span(prof *p) {
    if (p->n == p->cap) {
        size_t had = p->cap * sizeof *p->spans;
        p->cap = p->cap ? 2 * p->cap : 4096;
        p->spans = grow(p->spans, had, p->cap * sizeof *p->spans);
    }
    return &p->spans[p->n++];
}

static span *push(prof *p, const char *cat, const char *name, int64_t t0) {
    if (!p->on || !t0) return NULL; /* t0 = 0: the span began before the step did */
    span *s = next_span(p);
    s->cat = cat;
    s->name = name;
    s->t0 = t0;
    s->dur = prof_now_ns() - t0;
    s->kind = ARG_NONE;
    s->worker = -1;
    return s;
}

/* The op span s just closed: each OpenMP thread that ran a parallel region
 * of it gets a span of its own, from its first entry to its last exit, named
 * and argued as s (the stamps all lie between s's start and end, so each
 * nests in s in time). The slots are cleared for the next op. */
static void push_workers(prof *p, const span *s) {
    size_t at = (size_t)(s - p->spans);
    for (int i = 0; i < p->tr.n; i++) {
        kern_thread_span *w = &p->tr.slot[i];
        if (!w->first) continue;
        span *q = next_span(p);
        *q = p->spans[at];
        q->cat = "thread";
        q->t0 = w->first;
        q->dur = w->last > w->first ? w->last - w->first : 0;
        q->worker = i;
        p->worker_seen[i] = 1;
        *w = (kern_thread_span){0, 0};
    }
}

void prof_span(prof *p, const char *cat, const char *name, int64_t t0) { push(p, cat, name, t0); }

void prof_kern(prof *p, int op, const char *name, int64_t t0) {
    span *s = push(p, "op", name, t0);
    if (s) {
        s->kind = ARG_KERN;
        s->a.op = op;
        push_workers(p, s);
    }
}

static const char *model_impl(const prof *p, const span *s) {
    return s->a.m.kern == PROF_NO_KERNEL ? "model" : p->model_impl[s->a.m.kern];
}

void prof_model_op(prof *p, const char *name, const char *op, int kern, int64_t t0) {
    span *s = push(p, "op", name, t0);
    if (s) {
        s->kind = ARG_MODEL;
        s->a.m.op = op;
        s->a.m.kern = kern;
        push_workers(p, s);
    }
}

void prof_layer(prof *p, const char *name, int l, int64_t t0) {
    span *s = push(p, "layer", name, t0);
    if (s) {
        s->kind = ARG_LAYER;
        s->a.layer = l;
    }
}

void prof_comm(prof *p, const char *name, int64_t t0, size_t bytes, size_t count, const char *dtype,
               const char *op, int comm_size) {
    span *s = push(p, "collective", name, t0);
    if (s) {
        s->kind = ARG_COMM;
        s->a.c.bytes = bytes;
        s->a.c.count = count;
        s->a.c.dtype = dtype;
        s->a.c.op = op;
        s->a.c.size = comm_size;
    }
}

void prof_trace_path(const prof *p, int step, char *out, size_t cap) {
    snprintf(out, cap, "%s/iteration_%d/rank%d_trace.json", p->folder, step, p->rank);
}

/* A JSON string: quotes, backslashes and control characters escaped. */
static void put_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *c = (const unsigned char *)(s ? s : ""); *c; c++) {
        if (*c == '"' || *c == '\\') fprintf(f, "\\%c", *c);
        else if (*c == '\n') fputs("\\n", f);
        else if (*c == '\t') fputs("\\t", f);
        else if (*c < 0x20) fprintf(f, "\\u%04x", *c);
        else fputc(*c, f);
    }
    fputc('"', f);
}

/* ns as microseconds with all nine digits kept: the trace's sums equal the summary's */
static void put_us(FILE *f, int64_t ns) { fprintf(f, "%" PRId64 ".%03d", ns / 1000, (int)(ns % 1000)); }

static void put_span(FILE *f, const prof *p, const span *s) {
    fputs("{\"name\":", f);
    put_str(f, s->name);
    fputs(",\"cat\":", f);
    put_str(f, s->cat);
    fputs(",\"ph\":\"X\",\"ts\":", f);
    put_us(f, s->t0);
    fputs(",\"dur\":", f);
    put_us(f, s->dur);
    fprintf(f, ",\"pid\":%d,\"tid\":%ld,\"args\":{", p->rank, s->worker < 0 ? p->tid : (long)s->worker);
    switch (s->kind) {
    case ARG_KERN:
        fputs("\"op\":", f);
        put_str(f, p->op_name[s->a.op]);
        fputs(",\"impl\":", f);
        put_str(f, p->impl[s->a.op]);
        break;
    case ARG_MODEL:
        fputs("\"op\":", f);
        put_str(f, s->a.m.op);
        fputs(",\"impl\":", f);
        put_str(f, model_impl(p, s));
        break;
    case ARG_LAYER: fprintf(f, "\"layer\":%d", s->a.layer); break;
    case ARG_COMM:
        fprintf(f, "\"bytes\":%zu,\"count\":%zu,\"dtype\":", s->a.c.bytes, s->a.c.count);
        put_str(f, s->a.c.dtype);
        fputs(",\"op\":", f);
        put_str(f, s->a.c.op);
        fprintf(f, ",\"comm_size\":%d", s->a.c.size);
        break;
    default: fprintf(f, "\"step\":%d", p->step);
    }
    fputs("}}", f);
}

static void summarize(prof *p, const span *s) {
    if (s->worker >= 0) return; /* a share of an op the op's own span already counts */
    int is_op = s->kind == ARG_KERN, is_model = s->kind == ARG_MODEL;
    const char *op = is_op ? p->op_name[s->a.op] : is_model ? s->a.m.op : s->kind == ARG_COMM ? s->a.c.op : "";
    const char *impl = is_op      ? p->impl[s->a.op]
                       : is_model ? model_impl(p, s)
                       : s->kind == ARG_COMM ? s->a.c.dtype : "";
    int size = s->kind == ARG_COMM ? s->a.c.size : 0;
    sum_row *r = NULL;
    for (int i = 0; i < p->n_rows && !r; i++) {
        sum_row *q = &p->rows[i];
        if (!strcmp(q->cat, s->cat) && !strcmp(q->name, s->name) && !strcmp(q->op, op) && !strcmp(q->impl, impl) &&
            q->size == size)
            r = q;
    }
    if (!r) {
        if (p->n_rows == p->cap_rows) {
            size_t had = (size_t)p->cap_rows * sizeof *p->rows;
            p->cap_rows = p->cap_rows ? 2 * p->cap_rows : 32;
            p->rows = grow(p->rows, had, (size_t)p->cap_rows * sizeof *p->rows);
        }
        r = &p->rows[p->n_rows++];
        *r = (sum_row){.cat = s->cat, .name = s->name, .op = op, .impl = impl, .size = size};
    }
    r->calls++;
    r->ns += s->dur;
}

int prof_step_end(prof *p, ct_err *e) {
    p->on = 0;
    kern_trace_arm(NULL);
    for (size_t i = 0; i < p->n; i++) {
        const span *s = &p->spans[i];
        if (s->kind == ARG_KERN || s->kind == ARG_MODEL || s->kind == ARG_COMM) summarize(p, s);
        else if (!strcmp(s->cat, "step")) p->step_ns += s->dur;
    }
    p->steps++;
    char dir[4096], path[4096];
    snprintf(dir, sizeof dir, "%s/iteration_%d", p->folder, p->step);
    prof_trace_path(p, p->step, path, sizeof path);
    int rc = ct_mkdirs(dir, e);
    fs_atomic a = {0};
    if (rc || (rc = fs_atomic_open(&a, path, e))) return rc;
    FILE *f = a.fp;
    fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"tool\":\"ctitan\",\"step\":%d,\"rank\":%d},"
               "\"traceEvents\":[\n",
            p->step, p->rank);
    fprintf(f, "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%ld,\"args\":{\"name\":\"rank %d\"}},\n",
            p->rank, p->tid, p->rank);
    fprintf(f, "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%ld,\"args\":{\"sort_index\":%d}},\n",
            p->rank, p->tid, p->rank);
    fprintf(f, "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%ld,\"args\":{\"name\":\"step\"}}", p->rank,
            p->tid);
    for (int i = 0; i < p->tr.n; i++) {
        if (!p->worker_seen[i]) continue;
        fprintf(f, ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"name\":\"omp worker %d\"}}",
                p->rank, i, i);
        fprintf(f, ",\n{\"name\":\"thread_sort_index\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"args\":{\"sort_index\":%d}}",
                p->rank, i, i + 1);
    }
    for (size_t i = 0; i < p->n; i++) {
        fputs(",\n", f);
        put_span(f, p, &p->spans[i]);
    }
    fputs("\n]}\n", f);
    p->n = 0;
    return fs_atomic_commit(&a, e);
}

int64_t prof_summary_ns(const prof *p, int i, long *calls, const char **name) {
    if (i < 0 || i >= p->n_rows) return -1;
    if (calls) *calls = p->rows[i].calls;
    if (name) *name = p->rows[i].name;
    return p->rows[i].ns;
}

static int by_time(const void *a, const void *b) {
    int64_t x = ((const sum_row *)a)->ns, y = ((const sum_row *)b)->ns;
    return x < y ? 1 : x > y ? -1 : 0;
}

void prof_summary(const prof *p, FILE *out) {
    if (!p->steps) return;
    sum_row *r = ct_malloc((size_t)(p->n_rows ? p->n_rows : 1) * sizeof *r);
    if (p->n_rows) memcpy(r, p->rows, (size_t)p->n_rows * sizeof *r);
    qsort(r, (size_t)p->n_rows, sizeof *r, by_time);
    fprintf(out, "ctitan: profile of rank %d, %d traced step(s), %.3f ms of steps:\n", p->rank, p->steps,
            p->step_ns / 1e6);
    fprintf(out, "ctitan: profile: %-11s %-22s %-17s %-16s %8s %12s %7s\n", "category", "name", "op", "impl", "calls",
            "total_ms", "%step");
    for (int i = 0; i < p->n_rows; i++) {
        char impl[32];
        if (!strcmp(r[i].cat, "collective")) snprintf(impl, sizeof impl, "%s/%d", r[i].impl, r[i].size);
        else snprintf(impl, sizeof impl, "%s", r[i].impl);
        double pct = p->step_ns ? 100.0 * r[i].ns / p->step_ns : 0.0;
        fprintf(out, "ctitan: profile: %-11s %-22s %-17s %-16s %8ld %12.6f %7.2f\n", r[i].cat, r[i].name,
                r[i].op[0] ? r[i].op : "-", impl, r[i].calls, r[i].ns / 1e6, pct);
    }
    free(r);
}

/* ------------------------------------------------------- memory snapshot */

int prof_memory_snapshot(const char *dir, int rank, int step, const prof_mem *cats, int n, double peak_rss,
                         FILE *log, ct_err *e) {
    char path[4096];
    snprintf(path, sizeof path, "%s/rank%d_memory_snapshot.json", dir, rank);
    int rc = ct_mkdirs(dir, e);
    fs_atomic a = {0};
    if (rc || (rc = fs_atomic_open(&a, path, e))) return rc;
    double tp = 0, tm = 0;
    fprintf(a.fp, "{\"step\": %d, \"rank\": %d, \"unit\": \"bytes\", \"categories\": [", step, rank);
    for (int i = 0; i < n; i++) {
        fprintf(a.fp, "%s\n  {\"name\": ", i ? "," : "");
        put_str(a.fp, cats[i].name);
        fprintf(a.fp, ", \"planned\": %.0f, \"measured\": ", cats[i].planned);
        if (cats[i].measured >= 0) fprintf(a.fp, "%.0f}", cats[i].measured);
        else fputs("null}", a.fp);
        tp += cats[i].planned;
        tm += cats[i].measured > 0 ? cats[i].measured : 0;
    }
    fprintf(a.fp, "],\n \"total_planned\": %.0f, \"total_measured\": %.0f, \"peak_rss\": %.0f}\n", tp, tm, peak_rss);
    if ((rc = fs_atomic_commit(&a, e))) return rc;
    if (log) {
        fprintf(log, "ctitan: memory at step %d, rank %d: planned (dry run) and measured (resident):\n", step, rank);
        fprintf(log, "ctitan: memory: %-34s %12s %12s\n", "category", "planned MiB", "measured MiB");
        for (int i = 0; i < n; i++)
            fprintf(log, "ctitan: memory: %-34s %12.1f %12.1f\n", cats[i].name, cats[i].planned / 1048576.0,
                    cats[i].measured / 1048576.0);
        fprintf(log, "ctitan: memory: %-34s %12.1f %12.1f (peak RSS %.1f MiB)\n", "total", tp / 1048576.0,
                tm / 1048576.0, peak_rss / 1048576.0);
    }
    return 0;
}
