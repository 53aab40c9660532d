/* report/report.h: `ctitan report`, one self-contained HTML page (and
 * optionally a PNG of its main chart) from one or more run directories.
 *
 * Design: every chart is first described once (report_chart: series in data
 * units, axis ranges with "nice" ticks, event markers, the pixel layout),
 * then drawn by two back ends that only translate that description: inline
 * SVG for the page (svg.c) and cairo for the PNG (png.c). So the picture in
 * a README and the page it came from cannot disagree. The page carries no
 * script and fetches nothing: it is meant to be mailed, attached to an issue
 * or opened years later. Every string that comes from a run directory (paths,
 * config values, event messages) is escaped on its way into the page. */
#ifndef CT_REPORT_REPORT_H
#define CT_REPORT_REPORT_H

#include <stdio.h>

#include "core/err.h"
#include "report/run.h"

#define REPORT_DEFAULT_SMOOTHING 0.6 /* TensorBoard's default weight */

typedef struct {
    double smoothing; /* [0, 1): TensorBoard's debiased EMA weight; 0 draws no smoothed curve */
    const char *html; /* output page */
    const char *png;  /* NULL: no PNG */
} report_opts;

/* Writes the page of runs[0..n) (and the PNG), each atomically. CT_ERR_IO
 * when a file cannot be written or the PNG back end is not built in. */
int report_write(const run_data *runs, int n, const report_opts *o, ct_err *e);

/* 1 when this build can write PNGs (cairo was found at build time). */
int report_png_available(void);

/* ---- the chart description (chart.c), shared by the two back ends ---- */

/* also the drawing order: raw under smoothed under validation */
typedef enum { REPORT_LINE_RAW, REPORT_LINE_SMOOTH, REPORT_LINE_VAL } report_line_style;

typedef struct {
    int run;            /* index into the runs (its colour) */
    char name[32];      /* data-series: "loss", "loss_smoothed", "val_loss", ... */
    report_line_style style;
    int n;
    double *x, *y;      /* step and value, finite only, steps increasing */
    /* how it is drawn, decided once for both back ends */
    unsigned color;     /* 0xRRGGBB, the run's */
    double width, opacity;
    int dashed;         /* validation curves */
    int dots;           /* a dot at each point (validation: few points) */
} report_series;

typedef struct {
    int run;
    int step;
    run_ev_kind kind;
    char label[16];     /* "start", "resume", "ckpt", "stop", "done", "error" */
    char title[640];    /* the tooltip: what happened, unescaped */
    unsigned color;
    double dash_on, dash_off;
    int labelled;       /* checkpoints are many: a tooltip only */
    double label_y;     /* labels at one step stack so they do not overprint */
    int label_left;     /* label drawn left of the line (at the right edge) */
} report_marker;

typedef struct {
    char id[24], title[64], unit[24];
    char key[96];                      /* how to read the lines, right of the legend ("" none) */
    int width, height;                 /* pixels */
    double left, top, plot_w, plot_h;  /* the plot area inside */
    double x0, x1, y0, y1;             /* data range shown */
    double xticks[24], yticks[24];
    int n_xticks, n_yticks;
    report_series *series;
    int n_series;
    report_marker *markers;
    int n_markers;
    int n_runs;
    const char *const *run_names;      /* borrowed, n_runs of them */
} report_chart;

/* The charts of the page, in page order; chart 0 is the main (loss) chart. */
typedef enum {
    REPORT_CHART_LOSS,
    REPORT_CHART_LR,
    REPORT_CHART_GRAD_NORM,
    REPORT_CHART_TPS,
    REPORT_CHART_MFU,
    REPORT_CHART_MEMORY,
    REPORT_N_CHARTS
} report_chart_kind;

/* Describes chart `kind` of runs[0..n) named names[0..n). */
void report_chart_build(report_chart *c, report_chart_kind kind, const run_data *runs, const char *const *names,
                        int n, double smoothing);
void report_chart_free(report_chart *c);
/* Data to pixel coordinates of c. */
double report_px_x(const report_chart *c, double x);
double report_px_y(const report_chart *c, double y);
/* Where run r's legend swatch starts (the name follows 19 px on). */
double report_legend_x(const report_chart *c, int r);
/* The colour of run i as 0xRRGGBB. */
unsigned report_run_color(int run);

/* Ticks of [lo, hi] at a 1, 2 or 5 x 10^k spacing, about `want` of them; the
 * range is widened to whole ticks (*lo, *hi updated). Returns the count
 * (at most cap). */
int report_nice_ticks(double *lo, double *hi, int want, double *ticks, int cap);
/* TensorBoard's smoothing of y[0..n) into out: an exponential moving average
 * with weight w, divided by (1 - w^k) after k finite values so the first
 * points are not pulled toward 0. Non-finite values pass through. */
void report_smooth(const double *y, int n, double w, double *out);
/* A tick label: the shortest %g that tells the ticks apart. */
void report_tick_label(char *out, size_t cap, double v, double spacing);
/* s as HTML text or attribute value (& < > " ' escaped). */
void report_html_escape(FILE *f, const char *s);
/* Names for the runs: directory basenames, with the parent directory (then
 * a number) added where two would be the same. names[i] is malloc'd. */
void report_run_names(const run_data *runs, int n, char **names);

/* ---- the back ends ---- */
void report_svg(FILE *f, const report_chart *c);
/* The chart as a PNG in a malloc'd buffer. */
int report_png(const report_chart *c, unsigned char **data, size_t *len, ct_err *e);

#endif
