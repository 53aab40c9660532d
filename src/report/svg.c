/* report/svg.c: a report_chart as inline SVG (report.h).
 *
 * A translation of the description only: positions come from report_px_x/y
 * and colours from report_run_color, as in png.c. Each curve is one polyline
 * that says which run and series it is and how many points it has
 * (data-run, data-series, data-points), and the <svg> carries its data range
 * and plot box, so a reader (the tests, a user's script) can take the numbers
 * back off the page without guessing. Tooltips are plain <title> elements:
 * the page has no script. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "report/report.h"

static void color(FILE *f, unsigned c) { fprintf(f, "#%06x", c & 0xffffff); }

void report_svg(FILE *f, const report_chart *c) {
    double bottom = c->top + c->plot_h, right = c->left + c->plot_w;
    fprintf(f,
            "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" id=\"chart-%s\" width=\"%d\" height=\"%d\" "
            "viewBox=\"0 0 %d %d\" data-x0=\"%.17g\" data-x1=\"%.17g\" data-y0=\"%.17g\" data-y1=\"%.17g\" "
            "data-plot=\"%g %g %g %g\" font-family=\"DejaVu Sans, sans-serif\" font-size=\"12\">\n",
            c->id, c->width, c->height, c->width, c->height, c->x0, c->x1, c->y0, c->y1, c->left, c->top, c->plot_w,
            c->plot_h);
    fprintf(f, "<rect width=\"%d\" height=\"%d\" fill=\"#ffffff\"/>\n", c->width, c->height);
    fprintf(f, "<text x=\"%g\" y=\"20\" font-size=\"15\" font-weight=\"bold\">", c->left);
    report_html_escape(f, c->title);
    if (c->unit[0]) {
        fputs(" (", f);
        report_html_escape(f, c->unit);
        fputc(')', f);
    }
    fputs("</text>\n", f);
    /* legend: one swatch per run */
    for (int r = 0; r < c->n_runs; r++) {
        double lx = report_legend_x(c, r);
        fprintf(f, "<g class=\"legend\" data-run=\"");
        report_html_escape(f, c->run_names[r]);
        fprintf(f, "\"><rect x=\"%g\" y=\"30\" width=\"14\" height=\"10\" fill=\"", lx);
        color(f, report_run_color(r));
        fprintf(f, "\"/><text x=\"%g\" y=\"40\">", lx + 19);
        report_html_escape(f, c->run_names[r]);
        fputs("</text></g>\n", f);
    }
    if (c->key[0]) {
        fprintf(f, "<text x=\"%g\" y=\"40\" text-anchor=\"end\" font-size=\"11\" fill=\"#555555\">", c->left + c->plot_w);
        report_html_escape(f, c->key);
        fputs("</text>\n", f);
    }
    fprintf(f, "<rect x=\"%g\" y=\"%g\" width=\"%g\" height=\"%g\" fill=\"none\" stroke=\"#bbbbbb\"/>\n", c->left, c->top,
            c->plot_w, c->plot_h);
    double ys = c->n_yticks > 1 ? c->yticks[1] - c->yticks[0] : 1, xs = c->n_xticks > 1 ? c->xticks[1] - c->xticks[0] : 1;
    char lab[64];
    for (int i = 0; i < c->n_yticks; i++) {
        double y = report_px_y(c, c->yticks[i]);
        report_tick_label(lab, sizeof lab, c->yticks[i], ys);
        fprintf(f, "<line x1=\"%g\" y1=\"%.2f\" x2=\"%g\" y2=\"%.2f\" stroke=\"#e6e6e6\"/>"
                   "<text x=\"%g\" y=\"%.2f\" text-anchor=\"end\" fill=\"#444444\">%s</text>\n",
                c->left, y, right, y, c->left - 6, y + 4, lab);
    }
    for (int i = 0; i < c->n_xticks; i++) {
        double x = report_px_x(c, c->xticks[i]);
        report_tick_label(lab, sizeof lab, c->xticks[i], xs);
        fprintf(f, "<line x1=\"%.2f\" y1=\"%g\" x2=\"%.2f\" y2=\"%g\" stroke=\"#e6e6e6\"/>"
                   "<text x=\"%.2f\" y=\"%g\" text-anchor=\"middle\" fill=\"#444444\">%s</text>\n",
                x, c->top, x, bottom, x, bottom + 16, lab);
    }
    fprintf(f, "<text x=\"%g\" y=\"%g\" text-anchor=\"middle\" fill=\"#444444\">step</text>\n", c->left + c->plot_w / 2,
            bottom + 34);
    for (int i = 0; i < c->n_markers; i++) {
        const report_marker *m = &c->markers[i];
        double x = report_px_x(c, m->step);
        fprintf(f, "<g class=\"event\" data-run=\"");
        report_html_escape(f, c->run_names[m->run]);
        fprintf(f, "\" data-kind=\"%s\" data-step=\"%d\"><title>", m->label, m->step);
        report_html_escape(f, m->title);
        fprintf(f, "</title><line x1=\"%.2f\" y1=\"%g\" x2=\"%.2f\" y2=\"%g\" stroke=\"", x, c->top, x, bottom);
        color(f, m->color);
        fprintf(f, "\" stroke-width=\"1.2\" stroke-dasharray=\"%g %g\"/>", m->dash_on, m->dash_off);
        if (m->labelled) {
            fprintf(f, "<text x=\"%.2f\" y=\"%g\" font-size=\"10\"%s fill=\"", m->label_left ? x - 3 : x + 3, m->label_y,
                    m->label_left ? " text-anchor=\"end\"" : "");
            color(f, m->color);
            fprintf(f, "\">%s</text>", m->label);
        }
        fputs("</g>\n", f);
    }
    /* raw under smoothed under validation: the smoothed curve is what one reads */
    for (int pass = 0; pass < 3; pass++)
        for (int i = 0; i < c->n_series; i++) {
            const report_series *s = &c->series[i];
            if ((int)s->style != pass) continue;
            fprintf(f, "<polyline class=\"series\" data-run=\"");
            report_html_escape(f, c->run_names[s->run]);
            fprintf(f, "\" data-series=\"%s\" data-points=\"%d\" fill=\"none\" stroke=\"", s->name, s->n);
            color(f, s->color);
            fprintf(f, "\" stroke-width=\"%g\" stroke-opacity=\"%g\" stroke-linejoin=\"round\"%s points=\"", s->width,
                    s->opacity, s->dashed ? " stroke-dasharray=\"6 3\"" : "");
            for (int k = 0; k < s->n; k++)
                fprintf(f, "%s%.2f,%.2f", k ? " " : "", report_px_x(c, s->x[k]), report_px_y(c, s->y[k]));
            fputs("\"/>\n", f);
            for (int k = 0; s->dots && k < s->n; k++) {
                fprintf(f, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"3\" fill=\"", report_px_x(c, s->x[k]),
                        report_px_y(c, s->y[k]));
                color(f, s->color);
                fprintf(f, "\"><title>step %g: %s %.6g</title></circle>\n", s->x[k], s->name, s->y[k]);
            }
        }
    fputs("</svg>\n", f);
}
