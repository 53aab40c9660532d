/* tests/c/core/test_progress_format.c: the edges of core/progress.h's formats that the
 * seventh mutation audit found unchecked: the ETA's switch to hours at 3600 s (after
 * rounding to whole seconds), the bar's fill rounded to the nearest of its 24 cells, and a
 * count past the total shown as a full bar at 100%. */
#include <string.h>

#include "check.h"
#include "core/progress.h"

static void eta_is(double s, const char *want) {
    char got[32];
    prog_fmt_eta(got, sizeof got, s);
    CHECK(!strcmp(got, want), "eta %.2f s: %s, want %s", s, got, want);
}

/* the bar's cells of a known total at done/total, drawn on a terminal, and its percent */
static void bar_is(double done, double total, const char *want, const char *pct) {
    prog_bar b;
    char s[256];
    prog_begin(&b, "thing", total, "B", 0);
    b.mode = PROG_TTY;
    b.t0 = 100.0;
    b.done = done;
    prog_format(&b, 101.0, 0, s, sizeof s);
    const char *open = strchr(s, '[');
    CHECK(open && !strncmp(open + 1, want, strlen(want)) && open[1 + strlen(want)] == ']',
          "%g of %g: %s, want [%s]", done, total, s, want);
    CHECK(strstr(s, pct) != NULL, "%g of %g: %s, want %s", done, total, s, pct);
}

int main(void) {
    /* one hour is "1h00m", not "60m00s"; what rounds to it too */
    eta_is(3600, "1h00m");
    eta_is(3599.5, "1h00m");
    eta_is(3599.4, "59m59s");
    eta_is(3660, "1h01m");
    eta_is(60, "1m00s");
    eta_is(59.4, "59s");

    /* 24 cells: 1/48 is half a cell (rounds up to one), 1/49 less than half (none),
     * 47/48 23.5 cells (24), and a count past the total stays a full bar */
    bar_is(1, 48, "#.......................", "   2.1%");
    bar_is(1, 49, "........................", "   2.0%");
    bar_is(47, 48, "########################", "  97.9%");
    bar_is(23, 48, "############............", "  47.9%");
    bar_is(60, 48, "########################", " 100.0%");
    return CHECK_DONE();
}
