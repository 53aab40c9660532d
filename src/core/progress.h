/* core/progress.h: a progress display for long non-training work (tokenizing,
 * import/export, downloads, checkpoint save and load).
 *
 * Design note. The caller owns a prog_bar (no global state, so two bars in one
 * process, or one per thread, never interfere) and feeds it absolute counts;
 * the bar decides when to draw. On a terminal (stderr a TTY) it is one line
 * redrawn with \r at most ~10 times a second: label, bar, percent, done/total,
 * rate, ETA; the end draws 100% and the total time, then a newline. Elsewhere
 * (CI logs, pipes) it prints a plain line at most every `period` seconds and
 * always a final one, and never a \r, so a log stays greppable. A bar that may
 * finish quickly (a small checkpoint) sets min_s: nothing is shown unless the
 * work is still running after that long, so tiny test runs stay quiet.
 *
 * Environment (tests force modes with it):
 *   CTITAN_PROGRESS        0 (off) | 1 / unset (tty if stderr is a terminal, else plain) | tty | plain
 *   CTITAN_PROGRESS_PERIOD seconds between plain lines (default 10)
 *   CTITAN_PROGRESS_MIN_S  overrides every bar's min_s (0: show even instant work)
 * Another value warns once (naming the variable and what it takes) and the default is
 * used: never an error, as a bar may begin hours into a run (progress.c).
 * Units: "B" counts bytes (shown in KiB/MiB/GiB), any other unit is a count
 * shown with k/M/G and the unit's name ("tokens", "tensors"). */
#ifndef CT_CORE_PROGRESS_H
#define CT_CORE_PROGRESS_H

#include <stddef.h>

typedef enum { PROG_OFF = 0, PROG_TTY = 1, PROG_PLAIN = 2 } prog_mode;

typedef struct {
    char label[96];
    char unit[16];
    char extra[96];   /* caller's fields appended to each line (e.g. prepare's tok/s) */
    double total;     /* <= 0: unknown (rate only, no percent or ETA) */
    double done;      /* absolute count; `start` is what was done before this run (a resumed download) */
    double start;
    double t0, last;  /* begin time, last draw */
    double min_s;     /* show nothing unless still running after this many seconds */
    double period;    /* seconds between plain lines */
    prog_mode mode;
    int shown;        /* something was printed */
    int drawn;        /* a TTY line is open (no newline yet) */
} prog_bar;

/* Starts a bar: total <= 0 when unknown; min_s as above (0: show at once). */
void prog_begin(prog_bar *b, const char *label, double total, const char *unit, double min_s);
void prog_update(prog_bar *b, double done);
void prog_add(prog_bar *b, double delta);
/* The final line (if anything was or should be shown); the bar is then closed. */
void prog_end(prog_bar *b);
/* Ends an open TTY line before another message is printed on stderr. */
void prog_break(prog_bar *b);

/* The mode from CTITAN_PROGRESS and isatty(2). */
prog_mode prog_mode_env(void);

/* Formatting, public for the unit test. */
void prog_fmt_eta(char *out, size_t cap, double s);                       /* 12s, 3m04s, 1h02m; "?" if < 0 */
void prog_fmt_amount(char *out, size_t cap, double x, const char *unit);   /* 1.5 MiB, 12.3k tokens */
/* The line as drawn at time `now` (no \r, no newline). */
void prog_format(const prog_bar *b, double now, int final, char *out, size_t cap);

#endif
