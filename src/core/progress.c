/* core/progress.c: see progress.h for the design. Everything goes to stderr
 * so stdout stays the command's data (generate's text, tokenize's ids). */
#include "core/progress.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "core/timer.h"

#define PROG_BAR_W 24
#define PROG_TTY_GAP 0.1 /* seconds between redraws: faster only costs terminal time */

/* A bad value warns, once per process and variable, and the default is used; it never
 * fails: a bar begins deep inside work (a checkpoint save hours into a run) through an API
 * with no error path, and the display is cosmetic. CTITAN_ISA is refused instead: it
 * changes what is computed. */
static void env_warn_once(atomic_flag *said, const char *name, const char *v, const char *accepted) {
    if (!atomic_flag_test_and_set(said))
        fprintf(stderr, "ctitan: warning: %s=\"%s\": not %s; using the default\n", name, v, accepted);
}

prog_mode prog_mode_env(void) {
    static atomic_flag said = ATOMIC_FLAG_INIT;
    const char *v = getenv("CTITAN_PROGRESS");
    if (v && !strcmp(v, "0")) return PROG_OFF;
    if (v && !strcmp(v, "tty")) return PROG_TTY;
    if (v && !strcmp(v, "plain")) return PROG_PLAIN;
    if (v && *v && strcmp(v, "1"))
        env_warn_once(&said, "CTITAN_PROGRESS", v,
                      "one of 0 (off), 1 (the default: tty when stderr is a terminal, else plain), tty, plain");
    return isatty(2) ? PROG_TTY : PROG_PLAIN;
}

static double env_seconds(const char *name, double dflt, atomic_flag *said) {
    const char *v = getenv(name);
    if (!v || !*v) return dflt;
    char *end;
    double x = strtod(v, &end);
    if (*end || !(x >= 0) || x > 1e9) {
        env_warn_once(said, name, v, "a number of seconds >= 0");
        return dflt;
    }
    return x;
}

void prog_fmt_eta(char *out, size_t cap, double s) {
    if (s < 0 || s > 1e8) {
        snprintf(out, cap, "?");
        return;
    }
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(out, cap, "%ldh%02ldm", t / 3600, t / 60 % 60);
    else if (t >= 60) snprintf(out, cap, "%ldm%02lds", t / 60, t % 60);
    else snprintf(out, cap, "%lds", t);
}

void prog_fmt_amount(char *out, size_t cap, double x, const char *unit) {
    int bytes = !strcmp(unit, "B");
    /* binary steps for bytes (what ls -h and file sizes on disk show), decimal for counts */
    const char *bu[] = {"B", "KiB", "MiB", "GiB", "TiB"}, *cu[] = {"", "k", "M", "G", "T"};
    double step = bytes ? 1024 : 1000;
    int i = 0;
    while (x >= step && i < 4) x /= step, i++;
    if (bytes) snprintf(out, cap, i ? "%.1f %s" : "%.0f %s", x, bu[i]);
    else snprintf(out, cap, i ? "%.1f%s %s" : "%.0f%s %s", x, cu[i], unit);
}

/* The elapsed time of a finished bar: tenths under a minute, where they still mean something. */
static void fmt_took(char *out, size_t cap, double s) {
    if (s < 60) snprintf(out, cap, "%.1fs", s);
    else prog_fmt_eta(out, cap, s);
}

void prog_format(const prog_bar *b, double now, int final, char *out, size_t cap) {
    double dt = now - b->t0, moved = b->done - b->start;
    double rate = dt > 0 ? moved / dt : 0;
    int known = b->total > 0;
    char d[32], t[32], r[40], tail[48];
    prog_fmt_amount(d, sizeof d, b->done, b->unit);
    prog_fmt_amount(t, sizeof t, b->total, b->unit);
    prog_fmt_amount(r, sizeof r, rate, b->unit);
    if (final) {
        char took[24];
        fmt_took(took, sizeof took, dt);
        snprintf(tail, sizeof tail, "done in %s", took);
    } else if (known) {
        char eta[24];
        prog_fmt_eta(eta, sizeof eta, rate > 0 ? (b->total - b->done) / rate : -1);
        snprintf(tail, sizeof tail, "ETA %s", eta);
    } else {
        tail[0] = 0;
    }
    double frac = known ? b->done / b->total : 0;
    if (frac > 1) frac = 1;
    if (b->mode == PROG_TTY) {
        if (known) {
            char bar[PROG_BAR_W + 1];
            int fill = (int)(frac * PROG_BAR_W + 0.5);
            for (int i = 0; i < PROG_BAR_W; i++) bar[i] = i < fill ? '#' : '.';
            bar[PROG_BAR_W] = 0;
            snprintf(out, cap, "ctitan: %.40s [%s] %5.1f%%  %s / %s  %s/s  %s%s", b->label, bar, 100 * frac, d, t, r,
                     tail, b->extra);
        } else {
            snprintf(out, cap, "ctitan: %.40s  %s  %s/s%s%s%s", b->label, d, r, tail[0] ? "  " : "", tail, b->extra);
        }
    } else if (known) {
        snprintf(out, cap, "ctitan: %s: %.1f%% %s / %s, %s/s, %s%s", b->label, 100 * frac, d, t, r, tail, b->extra);
    } else {
        snprintf(out, cap, "ctitan: %s: %s, %s/s%s%s%s", b->label, d, r, tail[0] ? ", " : "", tail, b->extra);
    }
}

static void draw(prog_bar *b, double now, int final) {
    char line[512];
    prog_format(b, now, final, line, sizeof line);
    if (b->mode == PROG_TTY) {
        /* a line wider than the terminal wraps, and \r then redraws only its last row;
         * the final one may wrap (a newline follows), so it keeps its time */
        struct winsize ws;
        if (!final && ioctl(2, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 20 && strlen(line) >= ws.ws_col)
            line[ws.ws_col - 1] = 0;
        fprintf(stderr, "\r%s\033[K", line);
        if (final) fputc('\n', stderr);
        b->drawn = !final;
    } else {
        fprintf(stderr, "%s\n", line);
    }
    fflush(stderr);
    b->shown = 1;
    b->last = now;
}

void prog_begin(prog_bar *b, const char *label, double total, const char *unit, double min_s) {
    memset(b, 0, sizeof *b);
    snprintf(b->label, sizeof b->label, "%s", label);
    snprintf(b->unit, sizeof b->unit, "%s", unit);
    b->total = total;
    b->mode = prog_mode_env();
    static atomic_flag said_min = ATOMIC_FLAG_INIT, said_period = ATOMIC_FLAG_INIT;
    b->min_s = env_seconds("CTITAN_PROGRESS_MIN_S", min_s, &said_min);
    b->period = env_seconds("CTITAN_PROGRESS_PERIOD", 10.0, &said_period);
    b->t0 = b->last = ct_now();
}

void prog_update(prog_bar *b, double done) {
    b->done = done;
    if (b->mode == PROG_OFF) return;
    double now = ct_now();
    if (now - b->t0 < b->min_s) return;
    /* plain mode: the first line once min_s has passed, then one per period */
    double gap = b->mode == PROG_TTY ? PROG_TTY_GAP : b->period;
    if (b->shown && now - b->last < gap) return;
    if (!b->shown && b->mode == PROG_PLAIN && b->min_s == 0 && now - b->t0 < gap) return;
    draw(b, now, 0);
}

void prog_add(prog_bar *b, double delta) {
    prog_update(b, b->done + delta);
}

void prog_end(prog_bar *b) {
    if (b->mode == PROG_OFF) return;
    double now = ct_now();
    if (b->shown || now - b->t0 >= b->min_s) draw(b, now, 1);
    b->mode = PROG_OFF; /* closed: later calls print nothing */
}

void prog_break(prog_bar *b) {
    if (b->mode == PROG_TTY && b->drawn) {
        fputc('\n', stderr);
        fflush(stderr);
        b->drawn = 0;
    }
}
