/* tests/c/report/test_report.c: the chart maths of `ctitan report` (src/report):
 *
 * - nice ticks: 1/2/5 x 10^k spacing, the range widened to whole ticks, a
 *   flat series still given a range, the cap respected;
 * - TensorBoard's debiased EMA against values worked out by hand, with a
 *   gap (NaN) passed through and not counted;
 * - tick labels without exponents where decimals do, with them for lr-sized
 *   numbers;
 * - HTML escaping of the five special characters and of control bytes;
 * - run names from directories, disambiguated;
 * - a chart built from a run whose resume logged steps twice (the later
 *   value wins, steps stay increasing), NaN values left out, markers for the
 *   events, and the pixel mapping at the plot's corners;
 * - the PNG back end: a PNG signature where cairo is built in, the
 *   "not built in" error where it is not (the aarch64 cross build);
 * - event labels at one step (a stop and its resume) stacked, not overprinted;
 * - the config table of two runs: a key one run lacks is a difference. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/fs.h"
#include "report/report.h"

static void check_ticks(double lo, double hi, int want, double wlo, double whi, double wstep, int wn) {
    double t[24];
    int n = report_nice_ticks(&lo, &hi, want, t, 24);
    CHECK(n == wn, "ticks of [%g, %g]: %d, want %d", lo, hi, n, wn);
    CHECK_CLOSE(lo, wlo, 1e-12);
    CHECK_CLOSE(hi, whi, 1e-12);
    for (int i = 0; i < n; i++) CHECK_CLOSE(t[i], wlo + i * wstep, 1e-12);
}

static char *escaped(const char *s) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    report_html_escape(f, s);
    fclose(f);
    return buf;
}

static void check_label(double v, double spacing, const char *want) {
    char got[64];
    report_tick_label(got, sizeof got, v, spacing);
    CHECK(!strcmp(got, want), "label of %g (spacing %g): \"%s\", want \"%s\"", v, spacing, got, want);
}

static void check_names(const char *const *dirs, int n, const char *const *want) {
    run_data runs[4];
    char *names[4];
    memset(runs, 0, sizeof runs);
    for (int i = 0; i < n; i++) snprintf(runs[i].dir, sizeof runs[i].dir, "%s", dirs[i]);
    report_run_names(runs, n, names);
    for (int i = 0; i < n; i++) {
        CHECK(!strcmp(names[i], want[i]), "name of %s: \"%s\", want \"%s\"", dirs[i], names[i], want[i]);
        free(names[i]);
    }
}

static void test_chart(void) {
    run_data r;
    memset(&r, 0, sizeof r);
    snprintf(r.dir, sizeof r.dir, "runs/a");
    /* steps 1..5 logged, then a resume from step 3 logs 4..6 again: 4 and 5 twice */
    static const int steps[] = {1, 2, 3, 4, 5, 4, 5, 6};
    static const double loss[] = {5, 4, 3.5, 3.4, 3.3, 3.0, 2.9, 2.8};
    r.n_points = 8;
    r.points = calloc(8, sizeof *r.points);
    for (int i = 0; i < 8; i++) {
        r.points[i].step = steps[i];
        for (int f = 0; f < RUN_N_FIELDS; f++) r.points[i].v[f] = NAN;
        r.points[i].v[RUN_LOSS] = loss[i];
        r.points[i].v[RUN_MFU] = i == 2 ? NAN : 10 + i; /* one line without mfu */
    }
    r.n_vals = 2;
    r.vals = calloc(2, sizeof *r.vals);
    r.vals[0] = (run_val){3, 3.6, exp(3.6)};
    r.vals[1] = (run_val){6, 3.1, exp(3.1)};
    r.n_events = 3;
    r.events = calloc(3, sizeof *r.events);
    r.events[0] = (run_event){.kind = RUN_EV_START, .step = 0};
    r.events[1] = (run_event){.kind = RUN_EV_CHECKPOINT, .step = 3};
    r.events[2] = (run_event){.kind = RUN_EV_START, .step = 3};
    snprintf(r.events[2].resumed_from, sizeof r.events[2].resumed_from, "runs/a/checkpoint/step-3");
    const char *names[] = {"a"};
    report_chart c;
    report_chart_build(&c, REPORT_CHART_LOSS, &r, names, 1, 0.6);
    CHECK(c.n_series == 4, "loss chart: %d series, want loss, loss_smoothed, val_loss, val_loss_smoothed", c.n_series);
    const report_series *s = &c.series[0];
    CHECK(!strcmp(s->name, "loss") && s->n == 6, "%s: %d points, want 6", s->name, s->n);
    for (int i = 0; i < s->n; i++) CHECK(s->x[i] == i + 1, "point %d at step %g", i, s->x[i]);
    CHECK(s->y[3] == 3.0 && s->y[4] == 2.9, "the resumed run's values win: %g %g", s->y[3], s->y[4]);
    CHECK(c.series[1].n == 6 && c.series[1].style == REPORT_LINE_SMOOTH, "smoothed: %d points", c.series[1].n);
    CHECK_CLOSE(c.series[1].y[1], (0.4 * 0.6 * 5 + 0.4 * 4) / (1 - 0.36), 1e-12);
    CHECK(c.series[2].n == 2 && c.series[2].dashed && c.series[2].dots, "val_loss: %d points", c.series[2].n);
    CHECK(c.series[0].opacity < 1 && c.series[1].opacity == 1, "raw faint under smoothed");
    CHECK(c.n_markers == 3, "%d markers", c.n_markers);
    CHECK(!strcmp(c.markers[0].label, "start") && !strcmp(c.markers[1].label, "ckpt") &&
              !strcmp(c.markers[2].label, "resume"),
          "marker labels %s %s %s", c.markers[0].label, c.markers[1].label, c.markers[2].label);
    CHECK(c.markers[2].label_y > c.markers[1].label_y || !c.markers[1].labelled, "labels at one step stack");
    CHECK(c.x0 <= 0 && c.x1 >= 6 && c.y0 <= 2.8 && c.y1 >= 5, "range [%g, %g] x [%g, %g]", c.x0, c.x1, c.y0, c.y1);
    CHECK_CLOSE(report_px_x(&c, c.x0), c.left, 1e-12);
    CHECK_CLOSE(report_px_x(&c, c.x1), c.left + c.plot_w, 1e-12);
    CHECK_CLOSE(report_px_y(&c, c.y1), c.top, 1e-12);
    CHECK_CLOSE(report_px_y(&c, c.y0), c.top + c.plot_h, 1e-12);

    unsigned char *png = NULL;
    size_t len = 0;
    ct_err e = {0};
    int rc = report_png(&c, &png, &len, &e);
    if (report_png_available())
        CHECK(!rc && len > 8 && !memcmp(png, "\x89PNG\r\n\x1a\n", 8), "PNG: rc %d, %zu bytes", rc, len);
    else
        CHECK(rc == CT_ERR_IO && strstr(e.msg, "not built in"), "PNG stub: rc %d \"%s\"", rc, e.msg);
    free(png);
    report_chart_free(&c);

    report_chart_build(&c, REPORT_CHART_MFU, &r, names, 1, 0.6);
    CHECK(c.n_series == 1 && c.series[0].n == 5, "mfu: %d series, %d points (the NaN line and the redone steps out)",
          c.n_series, c.series[0].n);
    report_chart_free(&c);
    report_chart_build(&c, REPORT_CHART_LOSS, &r, names, 1, 0);
    CHECK(c.n_series == 2 && c.series[0].opacity == 1, "smoothing 0: raw curves only, opaque (%d series)", c.n_series);
    report_chart_free(&c);

    /* the whole page, so the sanitized build (make sanitize) runs html.c and svg.c too */
    char dir[] = "/tmp/ct-test-report-XXXXXX", page[64], png_path[64];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(page, sizeof page, "%s/r.html", dir);
    snprintf(png_path, sizeof png_path, "%s/r.png", dir);
    report_opts o = {0.6, page, report_png_available() ? png_path : NULL};
    rc = report_write(&r, 1, &o, &e);
    CHECK(rc == 0, "report_write: %s", e.msg);
    size_t n = 0;
    char *text = fs_read_file(page, 0, &n, &e);
    CHECK(text && !strncmp(text, "<!DOCTYPE html>", 15) && strstr(text, "data-series=\"loss\" data-points=\"6\"") &&
              strstr(text, "data-kind=\"resume\" data-step=\"3\"") && strstr(text, "</html>"),
          "the page lacks its loss curve or resume marker");
    free(text);
    remove(page);
    remove(png_path);
    remove(dir);
    run_free(&r);
}

/* A stop at step 6 and its resume at step 6: two labelled markers at one step, whose
 * labels (10 px text) must stack instead of overprinting each other. */
static void test_labels_stack(void) {
    run_data r;
    memset(&r, 0, sizeof r);
    snprintf(r.dir, sizeof r.dir, "runs/s");
    r.n_points = 10;
    r.points = calloc(10, sizeof *r.points);
    for (int i = 0; i < 10; i++) {
        r.points[i].step = i + 1;
        for (int f = 0; f < RUN_N_FIELDS; f++) r.points[i].v[f] = NAN;
        r.points[i].v[RUN_LOSS] = 5 - 0.1 * i;
    }
    r.n_events = 3;
    r.events = calloc(3, sizeof *r.events);
    r.events[0] = (run_event){.kind = RUN_EV_START, .step = 0};
    r.events[1] = (run_event){.kind = RUN_EV_EXIT, .step = 6};
    snprintf(r.events[1].reason, sizeof r.events[1].reason, "stopped");
    r.events[2] = (run_event){.kind = RUN_EV_START, .step = 6};
    snprintf(r.events[2].resumed_from, sizeof r.events[2].resumed_from, "runs/s/checkpoint/step-6");
    const char *names[] = {"s"};
    report_chart c;
    report_chart_build(&c, REPORT_CHART_LOSS, &r, names, 1, 0);
    CHECK(c.n_markers == 3 && c.markers[1].labelled && c.markers[2].labelled, "%d markers", c.n_markers);
    if (c.n_markers == 3)
        CHECK(fabs(c.markers[2].label_y - c.markers[1].label_y) >= 10,
              "the stop's and the resume's labels at step 6 overprint: y %g and %g", c.markers[1].label_y,
              c.markers[2].label_y);
    report_chart_free(&c);
    run_free(&r);
}

static run_setting setting(const char *k, const char *v) { return (run_setting){strdup(k), strdup(v)}; }

/* The config table of two runs: a key that one run lacks differs (that run shows a dash),
 * one with equal values does not. */
static void test_config_diff(void) {
    run_data r[2];
    memset(r, 0, sizeof r);
    for (int i = 0; i < 2; i++) {
        snprintf(r[i].dir, sizeof r[i].dir, "runs/%c", 'a' + i);
        r[i].n_points = 1;
        r[i].points = calloc(1, sizeof *r[i].points);
        r[i].points[0].step = 1;
        for (int f = 0; f < RUN_N_FIELDS; f++) r[i].points[0].v[f] = NAN;
        r[i].points[0].v[RUN_LOSS] = 3;
    }
    r[0].n_config = 3;
    r[0].config = calloc(3, sizeof *r[0].config);
    r[0].config[0] = setting("training.steps", "10");
    r[0].config[1] = setting("lora.rank", "8");
    r[0].config[2] = setting("optimizer.lr", "0.001");
    r[1].n_config = 2;
    r[1].config = calloc(2, sizeof *r[1].config);
    r[1].config[0] = setting("training.steps", "10");
    r[1].config[1] = setting("optimizer.lr", "0.002");
    char dir[] = "/tmp/ct-test-report-XXXXXX", page[64];
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    snprintf(page, sizeof page, "%s/r.html", dir);
    report_opts o = {0, page, NULL};
    ct_err e = {0};
    CHECK(report_write(r, 2, &o, &e) == 0, "report_write: %s", e.msg);
    char *text = fs_read_file(page, 0, NULL, &e);
    CHECK(text && strstr(text, "<tr class=\"diff\" data-key=\"lora.rank\">"), "a key only run a has is not highlighted");
    CHECK(text && strstr(text, "<tr class=\"diff\" data-key=\"optimizer.lr\">"), "differing values not highlighted");
    CHECK(text && strstr(text, "<tr data-key=\"training.steps\">"), "equal values highlighted");
    CHECK(text && strstr(text, "<p>2 of 3 keys differ"), "the count of differing keys");
    free(text);
    remove(page);
    remove(dir);
    for (int i = 0; i < 2; i++) run_free(&r[i]);
}

int main(void) {
    check_ticks(0.13, 0.97, 5, 0, 1, 0.2, 6);
    /* a raw spacing of 6 rounds to 5, not 10: Heckbert's nice numbers ("Nice numbers for graph
     * labels", Graphics Gems, 1990) round a fraction below 1.5 to 1, below 3 to 2, below 7 to 5 */
    check_ticks(0, 24, 5, 0, 25, 5, 6);
    check_ticks(0, 11.6, 5, 0, 12, 2, 7); /* 2.9 rounds to 2 */
    check_ticks(1, 10, 8, 1, 10, 1, 10);
    check_ticks(5, 5, 5, 4.4, 5.6, 0.2, 7);  /* flat: widened by 10% each way */
    check_ticks(-3.2, 7.9, 5, -4, 8, 2, 7);
    check_ticks(0, 1e-4, 5, 0, 1e-4, 2e-5, 6);
    check_ticks(7.9, -3.2, 5, -4, 8, 2, 7);  /* given backwards */
    double t[3], lo = 0, hi = 100;
    CHECK(report_nice_ticks(&lo, &hi, 20, t, 3) == 3, "the cap holds");
    lo = -1e308, hi = 1e308;
    CHECK(report_nice_ticks(&lo, &hi, 5, t, 3) == 2 && lo == -1e308 && hi == 1e308, "a range past DBL_MAX: its ends");

    /* by hand, w = 0.5: EMA 0.5, 1.25, 2.125 over debias 0.5, 0.75, 0.875 */
    double y[] = {1, 2, 3}, out[3];
    report_smooth(y, 3, 0.5, out);
    CHECK_CLOSE(out[0], 1.0, 1e-15);
    CHECK_CLOSE(out[1], 1.25 / 0.75, 1e-15);
    CHECK_CLOSE(out[2], 2.125 / 0.875, 1e-15);
    double g[] = {1, NAN, 3};
    report_smooth(g, 3, 0.5, out);
    CHECK(out[0] == 1 && isnan(out[1]), "a gap passes through: %g %g", out[0], out[1]);
    CHECK_CLOSE(out[2], 1.75 / 0.75, 1e-15); /* the gap is not a step of the average */
    report_smooth(y, 3, 0, out);
    CHECK(out[0] == 1 && out[1] == 2 && out[2] == 3, "weight 0 is the raw curve");

    check_label(4.86, 0.02, "4.86");
    check_label(10, 2, "10");
    check_label(60000, 20000, "60000");
    check_label(0.5, 0.1, "0.5");
    check_label(-0.0, 0.2, "0");
    check_label(0.90024, 2e-5, "0.90024");
    check_label(1e-4, 2e-5, "0.00010");
    check_label(5e-4, 5e-4, "0.0005");
    check_label(3e7, 1e7, "3e+07");
    check_label(2.5e-8, 5e-9, "2.5e-08");

    char *s = escaped("<a href=\"x\">&'ok\x01");
    CHECK(!strcmp(s, "&lt;a href=&quot;x&quot;&gt;&amp;&#39;ok "), "escaped: %s", s);
    free(s);

    check_names((const char *[]){"/r/x/run", "/r/y/run/", "/r/z"}, 3, (const char *[]){"x/run", "y/run", "z"});
    check_names((const char *[]){"out", "out"}, 2, (const char *[]){"out", "out #2"});
    check_names((const char *[]){"/r/z", "/r/z"}, 2, (const char *[]){"r/z", "r/z #2"});

    test_chart();
    test_labels_stack();
    test_config_diff();
    return CHECK_DONE();
}
