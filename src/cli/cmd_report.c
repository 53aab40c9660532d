/* cli/cmd_report.c: `ctitan report RUN_DIR [RUN_DIR...] [-o FILE] [--png[=FILE]]
 * [--smoothing W]`: the options and the run directories in, report_write out
 * (src/report). Its own loop rather than cli/args.c's table: the command
 * takes several positional directories and a flag whose value is optional.
 *
 * Exit codes: 2 for a bad option (an output that is one of the files read
 * included), 1 for a missing run directory, a missing
 * metrics.jsonl or an unwritable output, 3 for a malformed file in a run. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "core/fs.h"
#include "report/report.h"

static void cli_report_help(void) {
    printf("usage: ctitan report RUN_DIR [RUN_DIR...] [-o FILE] [--png[=FILE]] [--smoothing W]\n\n"
           "Writes one self-contained HTML page (inline SVG, no script, nothing fetched) about the runs:\n"
           "loss and validation loss (raw and smoothed, the runs overlaid), learning rate, gradient norm,\n"
           "tokens/s, MFU and memory by step, starts, resumes, checkpoints and exits on the step axis, the\n"
           "final figures, and each run's resolved config.toml side by side with differing keys highlighted.\n"
           "A run directory is a run's job.dump_folder (metrics.jsonl, events.jsonl, config.toml).\n\n"
           "  -o, --output FILE  the page (default RUN_DIR/report.html; required for several runs)\n"
           "  --png[=FILE]       also the loss chart as a PNG (default: the page's path with .png);\n"
           "                     `--png FILE` works too when FILE ends in .png\n"
           "  --smoothing W      TensorBoard's smoothing weight in [0, 1), default %.1f (0: raw curves only)\n",
           REPORT_DEFAULT_SMOOTHING);
}

#define HINT " (try ctitan report --help)"

static int ends_with(const char *s, const char *tail) {
    size_t n = strlen(s), m = strlen(tail);
    return n >= m && !strcmp(s + n - m, tail);
}

/* Where path would land: the file itself when it exists (a symbolic link
 * followed), else its existing directory's real path plus its name. 0 when
 * neither resolves (the write will fail and say so). */
static int report_resolve(const char *path, char *out) {
    if (realpath(path, out)) return 1;
    char *dup = strdup(path);
    if (!dup) abort();
    char *slash = strrchr(dup, '/');
    const char *name = slash ? slash + 1 : dup;
    char dir[PATH_MAX];
    int ok = 0;
    if (slash == dup) ok = snprintf(dir, sizeof dir, "/") > 0;
    else ok = realpath(slash ? (*slash = 0, dup) : ".", dir) != NULL;
    if (ok && name[0]) {
        int k = snprintf(out, PATH_MAX, "%s%s%s", dir, strcmp(dir, "/") ? "/" : "", name);
        ok = k > 0 && k < PATH_MAX;
    } else {
        ok = 0;
    }
    free(dup);
    return ok;
}

/* The page and the PNG are written over whatever their paths name; an
 * output that is one of the files the command reads would replace a run's
 * record with HTML and leave the run unreadable (report and compare then
 * exit 3 on it). 2 with the path named, like any other bad option. The
 * inputs exist, so an output is one of them when it is the same file
 * (fs_same_file); the page and the PNG may both be new, so they are told
 * apart by where they would land (report_resolve). */
static int report_check_output(const char *what, const char *path, char **dirs, int ndirs, const char *other) {
    static const char *const inputs[] = {"", "metrics.jsonl", "events.jsonl", "config.toml"};
    char out[PATH_MAX], in[PATH_MAX];
    if (other && report_resolve(path, out) && report_resolve(other, in) && !strcmp(in, out))
        return cli_fail(2, "report: the page and the PNG are one file: %s" HINT, path);
    for (int i = 0; i < ndirs; i++) {
        for (size_t k = 0; k < sizeof inputs / sizeof *inputs; k++) {
            char *input = fs_join(dirs[i], inputs[k]);
            int same = fs_same_file(input, path);
            free(input);
            if (same)
                return cli_fail(2, "report: %s %s is %s of run %s, which report reads; choose another path" HINT, what,
                                path, inputs[k][0] ? inputs[k] : "the directory", dirs[i]);
        }
    }
    return 0;
}

int cli_report(int argc, char **argv) {
    const char *out = NULL, *png = NULL;
    int want_png = 0, ndirs = 0;
    double smoothing = REPORT_DEFAULT_SMOOTHING;
    char **dirs = calloc((size_t)argc + 1, sizeof *dirs);
    if (!dirs) abort();
    int rc = 0;
    for (int i = 0; i < argc && !rc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            cli_report_help();
            free(dirs);
            return 0;
        } else if (!strcmp(a, "-o") || !strcmp(a, "--output")) {
            if (i + 1 >= argc || !argv[i + 1][0]) rc = cli_fail(2, "report: %s needs a file name" HINT, a);
            else out = argv[++i];
        } else if (!strncmp(a, "--output=", 9)) {
            out = a + 9;
            if (!out[0]) rc = cli_fail(2, "report: --output= needs a file name" HINT);
        } else if (!strcmp(a, "--png")) {
            want_png = 1;
            if (i + 1 < argc && ends_with(argv[i + 1], ".png")) png = argv[++i];
        } else if (!strncmp(a, "--png=", 6)) {
            want_png = 1;
            png = a + 6;
            if (!png[0]) rc = cli_fail(2, "report: --png= needs a file name" HINT);
        } else if (!strcmp(a, "--smoothing") || !strncmp(a, "--smoothing=", 12)) {
            const char *v = a[11] == '=' ? a + 12 : i + 1 < argc ? argv[++i] : "";
            char *end;
            smoothing = strtod(v, &end);
            if (!v[0] || *end || !(smoothing >= 0 && smoothing < 1))
                rc = cli_fail(2, "report: --smoothing must be a number in [0, 1), got \"%s\"" HINT, v);
        } else if (a[0] == '-' && a[1]) {
            rc = cli_fail(2, "report: unknown option \"%s\"" HINT, a);
        } else {
            dirs[ndirs++] = argv[i];
        }
    }
    if (!rc && !ndirs) rc = cli_fail(2, "report: give at least one run directory" HINT);
    if (!rc && ndirs > 1 && !out) rc = cli_fail(2, "report: -o FILE is required with several run directories" HINT);
    if (!rc && want_png && !report_png_available())
        rc = cli_fail(1, "report: PNG output not built in (this ctitan was built without cairo: libcairo2-dev)");
    if (rc) {
        free(dirs);
        return rc;
    }
    char *html = out ? strdup(out) : NULL, *png_path = png ? strdup(png) : NULL;
    if (!html) {
        size_t n = strlen(dirs[0]) + 16;
        html = malloc(n);
        if (html) snprintf(html, n, "%s/report.html", dirs[0]);
    }
    if (!html) abort();
    if (want_png && !png_path) {
        size_t n = strlen(html) + 8;
        png_path = malloc(n);
        if (!png_path) abort();
        snprintf(png_path, n, "%s", html);
        if (ends_with(png_path, ".html")) png_path[strlen(png_path) - 5] = 0;
        strcat(png_path, ".png");
    }
    rc = report_check_output("-o", html, dirs, ndirs, NULL);
    if (!rc && png_path) rc = report_check_output("--png", png_path, dirs, ndirs, html);
    if (rc) {
        free(html);
        free(png_path);
        free(dirs);
        return rc;
    }
    run_data *runs = calloc((size_t)ndirs, sizeof *runs);
    if (!runs) abort();
    ct_err e = {0};
    int loaded = 0;
    for (; loaded < ndirs && !rc; loaded++) rc = run_load(&runs[loaded], dirs[loaded], &e);
    if (!rc) {
        report_opts o = {smoothing, html, png_path};
        rc = report_write(runs, ndirs, &o, &e);
    }
    if (rc) {
        fprintf(stderr, "ctitan: error: report: %s\n", e.msg);
    } else {
        printf("report: %s", html);
        if (png_path) printf(" and %s", png_path);
        printf(" (%d run%s)\n", ndirs, ndirs > 1 ? "s" : "");
    }
    for (int i = 0; i < loaded; i++) run_free(&runs[i]);
    free(runs);
    free(html);
    free(png_path);
    free(dirs);
    return rc;
}
