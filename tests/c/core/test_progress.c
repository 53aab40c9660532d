/* tests/c/core/test_progress.c: core/progress.h formatting: ETA and human units,
 * the fields of a known and an unknown total, in both modes, at fixed times
 * (prog_format takes `now`, so nothing here depends on the machine's speed). */
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/progress.h"

static prog_bar bar(prog_mode mode, double total, const char *unit) {
    prog_bar b;
    prog_begin(&b, "thing", total, unit, 0);
    b.mode = mode;
    b.t0 = 100.0;
    return b;
}

int main(void) {
    char s[256];
    prog_fmt_eta(s, sizeof s, 12);
    CHECK(!strcmp(s, "12s"), "eta 12: %s", s);
    prog_fmt_eta(s, sizeof s, 0.2);
    CHECK(!strcmp(s, "0s"), "eta 0.2: %s", s);
    prog_fmt_eta(s, sizeof s, 184);
    CHECK(!strcmp(s, "3m04s"), "eta 184: %s", s);
    prog_fmt_eta(s, sizeof s, 59.6);
    CHECK(!strcmp(s, "1m00s"), "eta 59.6 rounds up to a minute: %s", s);
    prog_fmt_eta(s, sizeof s, 3720);
    CHECK(!strcmp(s, "1h02m"), "eta 3720: %s", s);
    prog_fmt_eta(s, sizeof s, -1);
    CHECK(!strcmp(s, "?"), "eta unknown: %s", s);

    prog_fmt_amount(s, sizeof s, 512, "B");
    CHECK(!strcmp(s, "512 B"), "512 B: %s", s);
    prog_fmt_amount(s, sizeof s, 1.5 * 1024 * 1024, "B");
    CHECK(!strcmp(s, "1.5 MiB"), "1.5 MiB: %s", s);
    prog_fmt_amount(s, sizeof s, 3.0 * 1024 * 1024 * 1024, "B");
    CHECK(!strcmp(s, "3.0 GiB"), "3 GiB: %s", s);
    prog_fmt_amount(s, sizeof s, 12345, "tokens");
    CHECK(!strcmp(s, "12.3k tokens"), "12.3k tokens: %s", s);
    prog_fmt_amount(s, sizeof s, 7, "tensors");
    CHECK(!strcmp(s, "7 tensors"), "7 tensors: %s", s);

    /* 25 of 100 MiB after 5 s: 5 MiB/s, 75 MiB left: ETA 15s */
    prog_bar b = bar(PROG_TTY, 100.0 * 1048576, "B");
    b.done = 25.0 * 1048576;
    prog_format(&b, 105.0, 0, s, sizeof s);
    CHECK(strstr(s, "ctitan: thing [######..................]  25.0%") == s, "tty bar: %s", s);
    CHECK(strstr(s, "25.0 MiB / 100.0 MiB") && strstr(s, "5.0 MiB/s") && strstr(s, "ETA 15s"), "tty fields: %s", s);
    CHECK(!strchr(s, '\r') && !strchr(s, '\n'), "the line itself has no control characters: %s", s);
    b.done = b.total;
    prog_format(&b, 120.0, 1, s, sizeof s);
    CHECK(strstr(s, "100.0%") && strstr(s, "done in 20.0s") && !strstr(s, "ETA"), "tty final: %s", s);

    /* a resumed count: the rate counts only what moved in this run */
    b = bar(PROG_PLAIN, 1000, "tensors");
    b.start = 400;
    b.done = 500;
    prog_format(&b, 110.0, 0, s, sizeof s);
    CHECK(!strcmp(s, "ctitan: thing: 50.0% 500 tensors / 1.0k tensors, 10 tensors/s, ETA 50s"), "plain: %s", s);

    /* unknown total: rate, no percent, no ETA */
    b = bar(PROG_PLAIN, 0, "B");
    b.done = 2048;
    prog_format(&b, 102.0, 0, s, sizeof s);
    CHECK(!strcmp(s, "ctitan: thing: 2.0 KiB, 1.0 KiB/s"), "plain unknown: %s", s);
    b.mode = PROG_TTY;
    prog_format(&b, 102.0, 0, s, sizeof s);
    CHECK(!strstr(s, "%") && !strstr(s, "ETA") && strstr(s, "1.0 KiB/s"), "tty unknown: %s", s);

    /* no progress yet: the ETA is unknown, not infinite or negative */
    b = bar(PROG_PLAIN, 10, "tokens");
    prog_format(&b, 100.0, 0, s, sizeof s);
    CHECK(strstr(s, "ETA ?") != NULL, "no rate yet: %s", s);

    /* the environment picks the mode */
    setenv("CTITAN_PROGRESS", "plain", 1);
    CHECK(prog_mode_env() == PROG_PLAIN, "CTITAN_PROGRESS=plain");
    setenv("CTITAN_PROGRESS", "tty", 1);
    CHECK(prog_mode_env() == PROG_TTY, "CTITAN_PROGRESS=tty");
    setenv("CTITAN_PROGRESS", "0", 1);
    CHECK(prog_mode_env() == PROG_OFF, "CTITAN_PROGRESS=0");
    return CHECK_DONE();
}
