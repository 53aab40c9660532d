/* report/png.c: a report_chart as a PNG through cairo (report.h).
 *
 * The same description svg.c draws, with the same positions, colours, line
 * widths and dash patterns, so a PNG pasted into a README or an issue shows
 * what the page shows. Text uses cairo's toy font API with DejaVu Sans
 * (Debian's fonts-dejavu-core): no layout engine is needed for tick labels
 * and a legend. Rendered at twice the chart's size so it stays sharp on
 * high-density screens.
 *
 * Built without cairo (CT_NO_CAIRO: the aarch64 cross build, where Debian's
 * arm64 cairo is not installed, or a machine without libcairo2-dev), the
 * back end says so instead of failing to link. */
#include <stdlib.h>
#include <string.h>

#include "report/report.h"

#ifdef CT_NO_CAIRO

int report_png_available(void) { return 0; }

int report_png(const report_chart *c, unsigned char **data, size_t *len, ct_err *e) {
    (void)c, (void)data, (void)len;
    return ct_fail(e, CT_ERR_IO, "PNG output not built in (this ctitan was built without cairo: libcairo2-dev)");
}

#else

#include <cairo.h>

#define PNG_SCALE 2.0

int report_png_available(void) { return 1; }

static void set_rgb(cairo_t *cr, unsigned c, double alpha) {
    cairo_set_source_rgba(cr, ((c >> 16) & 255) / 255.0, ((c >> 8) & 255) / 255.0, (c & 255) / 255.0, alpha);
}

/* text with its anchor: 0 start, 1 middle, 2 end */
static void text_at(cairo_t *cr, double x, double y, const char *s, int anchor) {
    cairo_text_extents_t ext;
    cairo_text_extents(cr, s, &ext);
    cairo_move_to(cr, x - (anchor == 1 ? ext.x_advance / 2 : anchor == 2 ? ext.x_advance : 0), y);
    cairo_show_text(cr, s);
}

static void dash(cairo_t *cr, double on, double off) {
    double d[2] = {on, off};
    cairo_set_dash(cr, d, on > 0 ? 2 : 0, 0);
}

typedef struct {
    unsigned char *buf;
    size_t len, cap;
} png_sink;

static cairo_status_t sink_write(void *closure, const unsigned char *data, unsigned int n) {
    png_sink *s = closure;
    if (s->len + n > s->cap) {
        size_t cap = (s->cap ? s->cap * 2 : 65536) + n;
        unsigned char *p = realloc(s->buf, cap);
        if (!p) return CAIRO_STATUS_NO_MEMORY;
        s->buf = p, s->cap = cap;
    }
    memcpy(s->buf + s->len, data, n);
    s->len += n;
    return CAIRO_STATUS_SUCCESS;
}

int report_png(const report_chart *c, unsigned char **data, size_t *len, ct_err *e) {
    cairo_surface_t *surf =
        cairo_image_surface_create(CAIRO_FORMAT_RGB24, (int)(c->width * PNG_SCALE), (int)(c->height * PNG_SCALE));
    cairo_t *cr = cairo_create(surf);
    cairo_scale(cr, PNG_SCALE, PNG_SCALE);
    double bottom = c->top + c->plot_h, right = c->left + c->plot_w;
    set_rgb(cr, 0xffffff, 1);
    cairo_paint(cr);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_BOLD);
    cairo_set_font_size(cr, 15);
    set_rgb(cr, 0x000000, 1);
    char title[128];
    snprintf(title, sizeof title, c->unit[0] ? "%s (%s)" : "%s", c->title, c->unit);
    text_at(cr, c->left, 20, title, 0);
    cairo_select_font_face(cr, "DejaVu Sans", CAIRO_FONT_SLANT_NORMAL, CAIRO_FONT_WEIGHT_NORMAL);
    cairo_set_font_size(cr, 12);
    for (int r = 0; r < c->n_runs; r++) {
        double lx = report_legend_x(c, r);
        set_rgb(cr, report_run_color(r), 1);
        cairo_rectangle(cr, lx, 30, 14, 10);
        cairo_fill(cr);
        set_rgb(cr, 0x000000, 1);
        text_at(cr, lx + 19, 40, c->run_names[r], 0);
    }
    if (c->key[0]) {
        cairo_set_font_size(cr, 11);
        set_rgb(cr, 0x555555, 1);
        text_at(cr, c->left + c->plot_w, 40, c->key, 2);
        cairo_set_font_size(cr, 12);
    }
    cairo_set_line_width(cr, 1);
    set_rgb(cr, 0xbbbbbb, 1);
    cairo_rectangle(cr, c->left, c->top, c->plot_w, c->plot_h);
    cairo_stroke(cr);
    double ys = c->n_yticks > 1 ? c->yticks[1] - c->yticks[0] : 1, xs = c->n_xticks > 1 ? c->xticks[1] - c->xticks[0] : 1;
    char lab[64];
    for (int i = 0; i < c->n_yticks; i++) {
        double y = report_px_y(c, c->yticks[i]);
        set_rgb(cr, 0xe6e6e6, 1);
        cairo_move_to(cr, c->left, y);
        cairo_line_to(cr, right, y);
        cairo_stroke(cr);
        set_rgb(cr, 0x444444, 1);
        report_tick_label(lab, sizeof lab, c->yticks[i], ys);
        text_at(cr, c->left - 6, y + 4, lab, 2);
    }
    for (int i = 0; i < c->n_xticks; i++) {
        double x = report_px_x(c, c->xticks[i]);
        set_rgb(cr, 0xe6e6e6, 1);
        cairo_move_to(cr, x, c->top);
        cairo_line_to(cr, x, bottom);
        cairo_stroke(cr);
        set_rgb(cr, 0x444444, 1);
        report_tick_label(lab, sizeof lab, c->xticks[i], xs);
        text_at(cr, x, bottom + 16, lab, 1);
    }
    text_at(cr, c->left + c->plot_w / 2, bottom + 34, "step", 1);
    cairo_set_font_size(cr, 10);
    for (int i = 0; i < c->n_markers; i++) {
        const report_marker *m = &c->markers[i];
        double x = report_px_x(c, m->step);
        set_rgb(cr, m->color, 1);
        cairo_set_line_width(cr, 1.2);
        dash(cr, m->dash_on, m->dash_off);
        cairo_move_to(cr, x, c->top);
        cairo_line_to(cr, x, bottom);
        cairo_stroke(cr);
        dash(cr, 0, 0);
        if (m->labelled) text_at(cr, m->label_left ? x - 3 : x + 3, m->label_y, m->label, m->label_left ? 2 : 0);
    }
    cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
    for (int pass = 0; pass < 3; pass++) /* the order svg.c draws in */
        for (int i = 0; i < c->n_series; i++) {
            const report_series *s = &c->series[i];
            if ((int)s->style != pass) continue;
            cairo_set_line_width(cr, s->width);
            set_rgb(cr, s->color, s->opacity);
            dash(cr, s->dashed ? 6 : 0, 3);
            for (int k = 0; k < s->n; k++)
                (k ? cairo_line_to : cairo_move_to)(cr, report_px_x(c, s->x[k]), report_px_y(c, s->y[k]));
            cairo_stroke(cr);
            dash(cr, 0, 0);
            set_rgb(cr, s->color, 1);
            for (int k = 0; s->dots && k < s->n; k++) {
                cairo_arc(cr, report_px_x(c, s->x[k]), report_px_y(c, s->y[k]), 3, 0, 6.283185307179586);
                cairo_fill(cr);
            }
        }
    cairo_destroy(cr);
    png_sink sink = {0};
    cairo_status_t st = cairo_surface_write_to_png_stream(surf, sink_write, &sink);
    cairo_surface_destroy(surf);
    if (st != CAIRO_STATUS_SUCCESS) {
        free(sink.buf);
        return ct_fail(e, CT_ERR_IO, "PNG encoding failed: %s", cairo_status_to_string(st));
    }
    *data = sink.buf;
    *len = sink.len;
    return 0;
}

#endif
