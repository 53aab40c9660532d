/* report/html.c: the page of `ctitan report` (report.h).
 *
 * One file, readable with no network and no script: the charts are inline
 * SVG (svg.c), the tables plain HTML with a little CSS. Sections, in the
 * order a reader asks: which runs, how they ended (final figures), the
 * curves, what happened when (events), and how they were configured (the
 * resolved config.toml of each run side by side, the keys whose values
 * differ highlighted). Every string read from a run directory passes
 * through report_html_escape: a path or a config value may hold <, & or
 * quotes. The page is built in memory and written with fs_write_atomic, so
 * a reader never finds half a report. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fs.h"
#include "report/report.h"

static void esc(FILE *f, const char *s) { report_html_escape(f, s); }

/* a number cell: "-" when the run has no such figure */
static void num_cell(FILE *f, const char *fmt, double v) {
    fputs("<td>", f);
    if (isfinite(v)) fprintf(f, fmt, v);
    else fputs("&ndash;", f);
    fputs("</td>", f);
}

/* the last finite value of a field, and the mean and max over the run */
static void field_stats(const run_data *r, run_field fld, double *last, double *mean, double *max) {
    double s = 0;
    int n = 0;
    *last = *mean = *max = NAN;
    for (int i = 0; i < r->n_points; i++) {
        double v = r->points[i].v[fld];
        if (!isfinite(v)) continue;
        *last = v;
        s += v, n++;
        *max = isfinite(*max) ? fmax(*max, v) : v;
    }
    if (n) *mean = s / n;
}

static void figures(FILE *f, const run_data *runs, char **names, int n, double smoothing, const report_chart *loss) {
    fputs("<h2 id=\"figures\">Final figures</h2>\n<table class=\"figures\"><tr><th></th>", f);
    for (int r = 0; r < n; r++) {
        fprintf(f, "<th><span class=\"swatch\" style=\"background:#%06x\"></span>", report_run_color(r));
        esc(f, names[r]);
        fputs("</th>", f);
    }
    fputs("</tr>\n", f);
#define ROW(label) fputs("<tr><th>" label "</th>", f)
    ROW("last step");
    for (int r = 0; r < n; r++) fprintf(f, "<td>%d</td>", run_last_step(&runs[r]));
    fputs("</tr>\n", f);
    ROW("final loss");
    for (int r = 0; r < n; r++) {
        double last, mean, max;
        field_stats(&runs[r], RUN_LOSS, &last, &mean, &max);
        num_cell(f, "%.4f", last);
    }
    fputs("</tr>\n", f);
    if (smoothing > 0) { /* the end of the thick curve, from the chart itself */
        fprintf(f, "<tr><th>final smoothed loss (%.2g)</th>", smoothing);
        for (int r = 0; r < n; r++) {
            double last = NAN;
            for (int i = 0; i < loss->n_series; i++)
                if (loss->series[i].run == r && !strcmp(loss->series[i].name, "loss_smoothed") && loss->series[i].n)
                    last = loss->series[i].y[loss->series[i].n - 1];
            num_cell(f, "%.4f", last);
        }
        fputs("</tr>\n", f);
    }
    ROW("final validation loss");
    for (int r = 0; r < n; r++) num_cell(f, "%.4f", runs[r].n_vals ? runs[r].vals[runs[r].n_vals - 1].loss : NAN);
    fputs("</tr>\n", f);
    ROW("final validation perplexity");
    for (int r = 0; r < n; r++) num_cell(f, "%.2f", runs[r].n_vals ? runs[r].vals[runs[r].n_vals - 1].perplexity : NAN);
    fputs("</tr>\n", f);
    /* the figures of a run as a whole, from run_summarise: the accounting
     * `ctitan compare` prints, so the page and compare cannot disagree on a
     * run (a killed session counts to its last sign of life; the means leave
     * out step 1, whose time includes the warm-up) */
    run_summary *sum = ct_calloc((size_t)n, sizeof *sum);
    for (int r = 0; r < n; r++) run_summarise(&runs[r], &sum[r]);
    static const struct {
        const char *label, *fmt;
        run_field fld;
        int what; /* 0 last, 2 max */
    } rows[] = {
        {"tokens seen", "%.0f", RUN_TOKENS_SEEN, 0},
        {"peak memory (GiB)", "%.3f", RUN_MEMORY_GIB, 2},
        {"loop time, last launch (s)", "%.1f", RUN_ELAPSED_S, 0},
    };
    for (size_t k = 0; k < sizeof rows / sizeof rows[0]; k++) {
        fprintf(f, "<tr><th>%s</th>", rows[k].label);
        for (int r = 0; r < n; r++) {
            double v[3];
            field_stats(&runs[r], rows[k].fld, &v[0], &v[1], &v[2]);
            num_cell(f, rows[k].fmt, v[rows[k].what]);
        }
        fputs("</tr>\n", f);
    }
    static const struct {
        const char *label, *fmt;
        int fld; /* a run_field or RUN_JOB_TPS */
    } means[] = {
        {"mean tokens/s per rank (after step 1)", "%.1f", RUN_TPS},
        {"mean tokens/s of the job (after step 1)", "%.1f", RUN_JOB_TPS},
        {"mean MFU (%, after step 1)", "%.2f", RUN_MFU},
        {"mean TFLOP/s (after step 1)", "%.3f", RUN_TFLOPS},
    };
    for (size_t k = 0; k < sizeof means / sizeof means[0]; k++) {
        fprintf(f, "<tr><th>%s</th>", means[k].label);
        for (int r = 0; r < n; r++) num_cell(f, means[k].fmt, run_mean_after_first(&runs[r], means[k].fld));
        fputs("</tr>\n", f);
    }
    /* from events.jsonl: what the metrics cannot say (restarts, whole-process time) */
    static const char *const ev_rows[] = {"launches (restarts)",
                                          "checkpoints saved",
                                          "wall time, all launches (s)",
                                          "time lost to restarts (s)",
                                          "CPU time, rank 0 x world (s)",
                                          "energy, RAPL, rank 0's machine (kJ)",
                                          "last exit"};
    for (int k = 0; k < 7; k++) {
        fprintf(f, "<tr><th>%s</th>", ev_rows[k]);
        for (int r = 0; r < n; r++) {
            const run_data *d = &runs[r];
            const run_summary *c = &sum[r];
            if (!c->n_sessions) {
                fputs("<td>&ndash;</td>", f); /* an older run without events.jsonl */
                continue;
            }
            int ckpts = 0;
            for (int i = 0; i < d->n_events; i++) ckpts += d->events[i].kind == RUN_EV_CHECKPOINT;
            const run_session *last = &c->s[c->n_sessions - 1];
            if (k == 0) fprintf(f, "<td>%d (%d)</td>", c->n_sessions, c->restarts);
            else if (k == 1) fprintf(f, "<td>%d</td>", ckpts);
            else if (k == 2) num_cell(f, "%.1f", c->wall_s);
            else if (k == 3) num_cell(f, "%.1f", c->lost_s);
            else if (k == 4) {
                fputs("<td>", f);
                if (c->cpu_unknown < c->n_sessions) fprintf(f, "%.1f", c->cpu_est_s);
                else fputs("&ndash;", f);
                if (c->cpu_unknown) fprintf(f, " (%d session%s without an exit)", c->cpu_unknown, c->cpu_unknown == 1 ? "" : "s");
                fputs("</td>", f);
            } else if (k == 5) {
                num_cell(f, "%.3f", c->energy_n ? c->energy_j / 1000 : NAN);
            } else {
                fputs("<td>", f);
                esc(f, last->killed ? "none (running, or killed)" : last->reason);
                fputs("</td>", f);
            }
        }
        fputs("</tr>\n", f);
    }
    for (int r = 0; r < n; r++) run_summary_free(&sum[r]);
    free(sum);
#undef ROW
    fputs("</table>\n", f);
}

static void events_table(FILE *f, const report_chart *loss) {
    fputs("<h2 id=\"events\">Events</h2>\n", f);
    if (!loss->n_markers) {
        fputs("<p>No events.jsonl in the run director", f);
        fputs(loss->n_runs > 1 ? "ies.</p>\n" : "y.</p>\n", f);
        return;
    }
    fputs("<table class=\"events\"><tr><th>run</th><th>step</th><th>event</th><th>detail</th></tr>\n", f);
    for (int i = 0; i < loss->n_markers; i++) {
        const report_marker *m = &loss->markers[i];
        fputs("<tr><td>", f);
        esc(f, loss->run_names[m->run]);
        fprintf(f, "</td><td>%d</td><td>%s</td><td>", m->step, m->label);
        esc(f, m->title);
        fputs("</td></tr>\n", f);
    }
    fputs("</table>\n", f);
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void config_table(FILE *f, const run_data *runs, char **names, int n) {
    fputs("<h2 id=\"config\">Resolved config</h2>\n", f);
    int total = 0;
    for (int r = 0; r < n; r++) total += runs[r].n_config;
    if (!total) {
        fputs("<p>No config.toml in the run directories.</p>\n", f);
        return;
    }
    /* the union of the keys, sorted, once each */
    char **keys = malloc((size_t)total * sizeof *keys);
    if (!keys) abort();
    int nk = 0;
    for (int r = 0; r < n; r++)
        for (int i = 0; i < runs[r].n_config; i++) keys[nk++] = runs[r].config[i].key;
    qsort(keys, (size_t)nk, sizeof *keys, cmp_str);
    int u = 0;
    for (int i = 0; i < nk; i++)
        if (!u || strcmp(keys[u - 1], keys[i])) keys[u++] = keys[i];
    int ndiff = 0;
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            if (n > 1)
                fprintf(f, "<p>%d of %d keys differ between the runs (highlighted); a run without a key shows "
                           "&ndash;.</p>\n",
                        ndiff, u);
            fputs("<table class=\"config\"><tr><th>key</th>", f);
            for (int r = 0; r < n; r++) {
                fputs("<th>", f);
                esc(f, names[r]);
                fputs("</th>", f);
            }
            fputs("</tr>\n", f);
        }
        for (int i = 0; i < u; i++) {
            const char *first = run_setting_get(&runs[0], keys[i]);
            int diff = 0;
            for (int r = 1; r < n; r++) {
                const char *v = run_setting_get(&runs[r], keys[i]);
                diff |= !first != !v || (v && strcmp(first, v));
            }
            ndiff += pass == 0 && diff;
            if (pass == 0) continue;
            fprintf(f, "<tr%s data-key=\"", diff ? " class=\"diff\"" : "");
            esc(f, keys[i]);
            fputs("\"><th>", f);
            esc(f, keys[i]);
            fputs("</th>", f);
            for (int r = 0; r < n; r++) {
                const char *v = run_setting_get(&runs[r], keys[i]);
                fputs("<td>", f);
                if (v) esc(f, v);
                else fputs("&ndash;", f);
                fputs("</td>", f);
            }
            fputs("</tr>\n", f);
        }
    }
    fputs("</table>\n", f);
    free(keys);
}

static const char css[] =
    "body{font-family:'DejaVu Sans',sans-serif;margin:24px;color:#222;max-width:1000px}"
    "h1{font-size:22px}h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}"
    "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;"
    "vertical-align:top}th{background:#f5f5f5}td{font-family:'DejaVu Sans Mono',monospace;word-break:break-all}"
    "tr.diff td,tr.diff th{background:#ffe58a}.swatch{display:inline-block;width:12px;height:12px;"
    "margin-right:6px;vertical-align:-1px}figure{margin:12px 0}svg.chart{display:block}"
    ".note{color:#555;font-size:13px}";

int report_write(const run_data *runs, int n, const report_opts *o, ct_err *e) {
    char **names = calloc((size_t)n, sizeof *names);
    if (!names) abort();
    report_run_names(runs, n, names);
    report_chart charts[REPORT_N_CHARTS];
    for (int k = 0; k < REPORT_N_CHARTS; k++)
        report_chart_build(&charts[k], (report_chart_kind)k, runs, (const char *const *)names, n, o->smoothing);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) abort();
    fprintf(f, "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\n<title>ctitan report: ");
    for (int r = 0; r < n; r++) {
        if (r) fputs(", ", f);
        esc(f, names[r]);
    }
    fprintf(f, "</title>\n<style>%s</style></head><body>\n<h1>ctitan report</h1>\n", css);
    fputs("<table class=\"runs\"><tr><th>run</th><th>directory</th><th>logged steps</th><th>validations</th></tr>\n", f);
    for (int r = 0; r < n; r++) {
        fprintf(f, "<tr><th><span class=\"swatch\" style=\"background:#%06x\"></span>", report_run_color(r));
        esc(f, names[r]);
        fputs("</th><td>", f);
        esc(f, runs[r].dir);
        fprintf(f, "</td><td>%d</td><td>%d</td></tr>\n", runs[r].n_points, runs[r].n_vals);
    }
    fputs("</table>\n", f);
    figures(f, runs, names, n, o->smoothing, &charts[REPORT_CHART_LOSS]);
    fputs("<h2 id=\"charts\">Curves</h2>\n<p class=\"note\">", f);
    if (o->smoothing > 0)
        fprintf(f, "Thick lines: loss smoothed as TensorBoard does (debiased exponential moving average, weight %.2g); "
                   "faint lines: the logged values. ",
                o->smoothing);
    fputs("Dashed: validation loss, its logged values as dots. Vertical lines: starts and resumes (green), checkpoints (grey), "
          "exits (red); hover one for details.</p>\n",
          f);
    for (int k = 0; k < REPORT_N_CHARTS; k++) {
        int pts = 0;
        for (int i = 0; i < charts[k].n_series; i++) pts += charts[k].series[i].n;
        fprintf(f, "<figure id=\"fig-%s\">\n", charts[k].id);
        report_svg(f, &charts[k]);
        if (!pts) fputs("<figcaption class=\"note\">not in metrics.jsonl (not logged by these runs)</figcaption>\n", f);
        fputs("</figure>\n", f);
    }
    events_table(f, &charts[REPORT_CHART_LOSS]);
    config_table(f, runs, names, n);
    fputs("<p class=\"note\">Written by <code>ctitan report</code>.</p>\n</body></html>\n", f);
    int rc = fclose(f) ? ct_fail(e, CT_ERR_IO, "report: out of memory building the page") : 0;
    if (!rc) rc = fs_write_atomic(o->html, buf, len, e);
    free(buf);
    if (!rc && o->png) {
        unsigned char *png = NULL;
        size_t plen = 0;
        rc = report_png(&charts[REPORT_CHART_LOSS], &png, &plen, e);
        if (!rc) rc = fs_write_atomic(o->png, png, plen, e);
        free(png);
    }
    for (int k = 0; k < REPORT_N_CHARTS; k++) report_chart_free(&charts[k]);
    for (int r = 0; r < n; r++) free(names[r]);
    free(names);
    return rc;
}
