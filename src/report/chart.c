/* report/chart.c: the chart descriptions of `ctitan report` (report.h).
 *
 * Everything a back end needs is decided here, once: which points each curve
 * has (finite values only, one per step, the later line winning where a
 * resume logged a step twice), the smoothed curves, the data range and its
 * ticks, the event markers and the pixel layout. svg.c and png.c only draw,
 * so the page and the PNG agree to the pixel. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "report/report.h"

/* Distinct on white and for the common colour-vision deficiencies (the
 * Okabe-Ito set, darkest first so one run reads well). */
static const unsigned palette[] = {0x0072B2, 0xD55E00, 0x009E73, 0xCC79A7, 0xE69F00, 0x56B4E9, 0x000000, 0xF0E442};

unsigned report_run_color(int run) { return palette[(unsigned)run % (sizeof palette / sizeof palette[0])]; }

int report_nice_ticks(double *lo, double *hi, int want, double *ticks, int cap) {
    double a = *lo, b = *hi;
    if (!isfinite(a) || !isfinite(b)) a = 0, b = 1;
    if (b < a) {
        double t = a;
        a = b, b = t;
    }
    if (b - a < 1e-12 * fmax(1.0, fabs(a))) { /* a flat curve still needs a range */
        double pad = a != 0 ? fabs(a) * 0.1 : 1.0;
        a -= pad, b += pad;
    }
    if (want < 2) want = 2;
    if (!isfinite(b - a) || cap < 2) { /* a range past DBL_MAX (a diverged run's 1e308): its ends only */
        int n = 0;
        if (cap > 0) ticks[n++] = a;
        if (cap > 1) ticks[n++] = b;
        *lo = a, *hi = b;
        return n;
    }
    double raw = (b - a) / (want - 1), mag = pow(10, floor(log10(raw))), f = raw / mag;
    /* the nearest of 1, 2, 5 (not the next above), so the count stays near `want` */
    double step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
    double first = floor(a / step + 1e-9), last = ceil(b / step - 1e-9);
    int n = 0;
    for (double k = first; k <= last + 0.5 && n < cap; k++) {
        double t = k * step;
        ticks[n++] = fabs(t) < step * 1e-9 ? 0 : t; /* no "-0" label */
    }
    *lo = first * step;
    *hi = last * step;
    return n;
}

void report_smooth(const double *y, int n, double w, double *out) {
    double last = 0, wk = 1;
    for (int i = 0; i < n; i++) {
        if (!isfinite(y[i])) {
            out[i] = y[i];
            continue;
        }
        last = last * w + (1 - w) * y[i];
        wk *= w;
        out[i] = w > 0 ? last / (1 - wk) : y[i];
    }
}

void report_tick_label(char *out, size_t cap, double v, double spacing) {
    /* as many decimals as the spacing needs, so neighbours differ and a column
     * of labels lines up (learning rates read 0.0005, 0.0010); exponents only
     * below a spacing of 1e-6 or above 1e7 */
    spacing = fabs(spacing);
    int d = spacing >= 1 || spacing <= 0 ? 0 : (int)ceil(-log10(spacing) - 1e-9);
    if (v == 0) {
        snprintf(out, cap, "0");
    } else if (fabs(v) < 1e7 && d <= 6) {
        snprintf(out, cap, "%.*f", d, v);
    } else {
        double mag = floor(log10(fabs(v)));
        int m = spacing > 0 ? (int)fmax(0, mag - floor(log10(spacing) + 1e-9)) : 2;
        snprintf(out, cap, "%.*e", m > 6 ? 6 : m, v);
    }
}

void report_html_escape(FILE *f, const char *s) {
    for (; *s; s++) switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default:
            /* control bytes are not allowed in HTML text */
            if ((unsigned char)*s < 0x20 && *s != '\n' && *s != '\t') fputc(' ', f);
            else fputc(*s, f);
        }
}

static const char *base_of(const char *dir, char *buf, size_t cap, int parents) {
    snprintf(buf, cap, "%s", dir);
    size_t n = strlen(buf);
    while (n > 1 && buf[n - 1] == '/') buf[--n] = 0;
    char *p = buf + n;
    for (int k = 0; k <= parents && p > buf; k++) {
        p--;
        while (p > buf && p[-1] != '/') p--;
        if (k < parents && p > buf) p--; /* onto the slash: the parent's name comes next */
    }
    return p;
}

void report_run_names(const run_data *runs, int n, char **names) {
    char buf[4096], other[4096];
    for (int i = 0; i < n; i++) names[i] = strdup(base_of(runs[i].dir, buf, sizeof buf, 0));
    for (int i = 0; i < n; i++) {
        int dup = 0;
        for (int j = 0; j < n; j++) {
            const char *mine = base_of(runs[i].dir, buf, sizeof buf, 0);
            dup |= j != i && !strcmp(mine, base_of(runs[j].dir, other, sizeof other, 0));
        }
        if (!dup) continue;
        free(names[i]);
        names[i] = strdup(base_of(runs[i].dir, buf, sizeof buf, 1));
    }
    for (int i = 0; i < n; i++) /* the same directory twice, or parents alike too */
        for (int j = 0; j < i; j++)
            if (!strcmp(names[i], names[j])) {
                size_t len = strlen(names[i]) + 16;
                char *s = malloc(len);
                if (!s) abort();
                snprintf(s, len, "%s #%d", names[i], i + 1);
                free(names[i]);
                names[i] = s;
                break;
            }
    for (int i = 0; i < n; i++)
        if (!names[i]) abort();
}

/* in halves, so a range of +-1e308 does not overflow to inf and draw NaN */
double report_px_x(const report_chart *c, double x) {
    return c->left + (x / 2 - c->x0 / 2) / (c->x1 / 2 - c->x0 / 2) * c->plot_w;
}
double report_px_y(const report_chart *c, double y) {
    return c->top + (c->y1 / 2 - y / 2) / (c->y1 / 2 - c->y0 / 2) * c->plot_h;
}

double report_legend_x(const report_chart *c, int r) {
    double x = c->left;
    for (int i = 0; i < r; i++) x += 19 + 7.2 * (double)strlen(c->run_names[i]) + 18; /* DejaVu Sans 12 px averages ~7 px */
    return x;
}

static report_series *add_series(report_chart *c, int run, const char *name, report_line_style style, int cap) {
    c->series = realloc(c->series, (size_t)(c->n_series + 1) * sizeof *c->series);
    if (!c->series) abort();
    report_series *s = &c->series[c->n_series++];
    memset(s, 0, sizeof *s);
    s->run = run;
    snprintf(s->name, sizeof s->name, "%s", name);
    s->style = style;
    s->x = malloc((size_t)(cap ? cap : 1) * sizeof *s->x);
    s->y = malloc((size_t)(cap ? cap : 1) * sizeof *s->y);
    if (!s->x || !s->y) abort();
    return s;
}

/* Appends (step, v) keeping steps increasing: a resume that redid steps
 * already in the file replaces them, as the rerun's values are the run's. */
static void push(report_series *s, int step, double v) {
    if (!isfinite(v)) return;
    while (s->n && s->x[s->n - 1] >= step) s->n--;
    s->x[s->n] = step;
    s->y[s->n++] = v;
}

static void add_smoothed(report_chart *c, const report_series *raw, const char *name, double w) {
    report_series *s = add_series(c, raw->run, name, REPORT_LINE_SMOOTH, raw->n);
    raw = &c->series[c->n_series - 2]; /* add_series may have moved it */
    report_smooth(raw->y, raw->n, w, s->y);
    memcpy(s->x, raw->x, (size_t)raw->n * sizeof *s->x);
    s->n = raw->n;
}

/* Line looks: logged curves faint under their smoothed ones, which are what
 * one reads; validation dashed, its logged points as dots (it has few). */
static void style_series(report_chart *c) {
    for (int i = 0; i < c->n_series; i++) {
        report_series *s = &c->series[i];
        int has_smooth = 0;
        for (int k = 0; k < c->n_series; k++)
            has_smooth |= c->series[k].run == s->run && c->series[k].style == REPORT_LINE_SMOOTH &&
                          !strncmp(c->series[k].name, s->name, strlen(s->name)) && k != i;
        s->color = report_run_color(s->run);
        s->dashed = !strncmp(s->name, "val_", 4);
        s->dots = s->style == REPORT_LINE_VAL;
        s->width = s->style == REPORT_LINE_SMOOTH ? 2.2 : s->dashed ? 1.6 : 1.2;
        s->opacity = s->style != REPORT_LINE_SMOOTH && has_smooth ? 0.35 : 1; /* its dots stay opaque */
    }
}

static void add_markers(report_chart *c, const run_data *r, int run, const char *name) {
    for (int i = 0; i < r->n_events; i++) {
        const run_event *v = &r->events[i];
        if (v->step < 0 || v->kind == RUN_EV_OTHER) continue;
        c->markers = realloc(c->markers, (size_t)(c->n_markers + 1) * sizeof *c->markers);
        if (!c->markers) abort();
        report_marker *m = &c->markers[c->n_markers++];
        memset(m, 0, sizeof *m);
        char mib[48] = "";
        m->run = run, m->step = v->step, m->kind = v->kind;
        m->color = v->kind == RUN_EV_CHECKPOINT ? 0x999999 : v->kind == RUN_EV_START ? 0x2e7d32 : 0xc62828;
        m->dash_on = v->kind == RUN_EV_CHECKPOINT ? 2 : 5;
        m->dash_off = 3;
        m->labelled = v->kind != RUN_EV_CHECKPOINT;
        switch (v->kind) {
        case RUN_EV_START:
            snprintf(m->label, sizeof m->label, "%s", v->resumed_from[0] ? "resume" : "start");
            if (v->resumed_from[0])
                snprintf(m->title, sizeof m->title, "%s: resumed at step %d from %.300s (load %.2f s, startup %.2f s)",
                         name, v->step, v->resumed_from, v->load_s, v->startup_s);
            else
                snprintf(m->title, sizeof m->title, "%s: started on %.100s (%.100s), %d rank(s) on %d machine(s), startup %.2f s",
                         name, v->host, v->cpu, v->world, v->machines, v->startup_s);
            break;
        case RUN_EV_CHECKPOINT:
            snprintf(m->label, sizeof m->label, "ckpt");
            if (isfinite(v->mib)) snprintf(mib, sizeof mib, "%.1f MiB, ", v->mib);
            /* an HF or adapter save has no mib */
            snprintf(m->title, sizeof m->title, "%s: %.15s checkpoint at step %d, %.300s (%s%.2f s to save)", name,
                     v->ckpt_kind, v->step, v->path, mib, isfinite(v->save_s) ? v->save_s : 0.0);
            break;
        default:
            snprintf(m->label, sizeof m->label, "%s", !strcmp(v->reason, "stopped") ? "stop" : v->reason[0] ? v->reason : "exit");
            snprintf(m->title, sizeof m->title, "%s: exit (%.15s) at step %d after %.1f s wall, %.1f s CPU", name, v->reason,
                     v->step, v->wall_s, v->cpu_s);
        }
    }
}

static const struct {
    const char *id, *title, *unit, *series;
    run_field field;
    double scale;
} kinds[REPORT_N_CHARTS] = {
    {"loss", "Loss", "", "loss", RUN_LOSS, 1},
    {"lr", "Learning rate", "", "lr", RUN_LR, 1},
    {"grad_norm", "Gradient norm (before clipping)", "", "grad_norm", RUN_GRAD_NORM, 1},
    {"tps", "Throughput", "tokens/s", "tps", RUN_TPS, 1},
    {"mfu", "Model FLOPs utilisation", "%", "mfu", RUN_MFU, 1},
    {"memory", "Memory (peak RSS)", "GiB", "memory_gib", RUN_MEMORY_GIB, 1},
};

void report_chart_build(report_chart *c, report_chart_kind kind, const run_data *runs, const char *const *names,
                        int n, double smoothing) {
    memset(c, 0, sizeof *c);
    snprintf(c->id, sizeof c->id, "%s", kinds[kind].id);
    snprintf(c->title, sizeof c->title, "%s", kinds[kind].title);
    snprintf(c->unit, sizeof c->unit, "%s", kinds[kind].unit);
    c->n_runs = n;
    c->run_names = names;
    if (kind == REPORT_CHART_LOSS)
        snprintf(c->key, sizeof c->key, smoothing > 0 ? "thick: smoothed (%.2g), faint: logged, dashed: validation"
                                                      : "dashed: validation", smoothing);
    c->width = 960;
    c->height = kind == REPORT_CHART_LOSS ? 420 : 260;
    c->left = 72, c->top = 52;
    c->plot_w = c->width - c->left - 24;
    c->plot_h = c->height - c->top - 44;
    for (int r = 0; r < n; r++) {
        const run_data *d = &runs[r];
        report_series *s = add_series(c, r, kinds[kind].series, REPORT_LINE_RAW, d->n_points);
        for (int i = 0; i < d->n_points; i++) push(s, d->points[i].step, d->points[i].v[kinds[kind].field] * kinds[kind].scale);
        if (kind == REPORT_CHART_LOSS) {
            if (smoothing > 0) add_smoothed(c, s, "loss_smoothed", smoothing);
            report_series *v = add_series(c, r, "val_loss", REPORT_LINE_VAL, d->n_vals);
            for (int i = 0; i < d->n_vals; i++) push(v, d->vals[i].step, d->vals[i].loss);
            if (smoothing > 0 && v->n) add_smoothed(c, v, "val_loss_smoothed", smoothing);
        }
        add_markers(c, d, r, names[r]);
    }
    style_series(c);
    double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
    for (int i = 0; i < c->n_series; i++)
        for (int k = 0; k < c->series[i].n; k++) {
            x0 = fmin(x0, c->series[i].x[k]), x1 = fmax(x1, c->series[i].x[k]);
            y0 = fmin(y0, c->series[i].y[k]), y1 = fmax(y1, c->series[i].y[k]);
        }
    for (int i = 0; i < c->n_markers; i++) x0 = fmin(x0, c->markers[i].step), x1 = fmax(x1, c->markers[i].step);
    if (!isfinite(x0)) x0 = 0, x1 = 1;
    if (!isfinite(y0)) y0 = 0, y1 = 1;
    if (x1 <= x0) x1 = x0 + 1;
    c->n_xticks = report_nice_ticks(&x0, &x1, 8, c->xticks, 24);
    c->n_yticks = report_nice_ticks(&y0, &y1, kind == REPORT_CHART_LOSS ? 7 : 5, c->yticks, 24);
    c->x0 = x0, c->x1 = x1, c->y0 = y0, c->y1 = y1;
    /* labels of events at (nearly) one step stack instead of overprinting; near
     * the right edge they go left of their line */
    for (int i = 0; i < c->n_markers; i++) {
        report_marker *m = &c->markers[i];
        double x = report_px_x(c, m->step);
        int below = 0;
        for (int k = 0; k < i; k++)
            below += c->markers[k].labelled && fabs(report_px_x(c, c->markers[k].step) - x) < 44;
        m->label_y = c->top + 11 + 11 * below;
        m->label_left = x > c->left + c->plot_w - 44;
    }
}

void report_chart_free(report_chart *c) {
    for (int i = 0; i < c->n_series; i++) {
        free(c->series[i].x);
        free(c->series[i].y);
    }
    free(c->series);
    free(c->markers);
    memset(c, 0, sizeof *c);
}
