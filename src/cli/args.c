/* cli/args.c: option parsing shared by `ctitan export`, `import` and `generate`.
 *
 * Design: each command keeps a static table of cli_opt (name, metavar,
 * default text, help, kind) and an enum naming its rows; it loops over argv
 * calling cli_next_option, which handles the syntax (the two value
 * spellings, flags, --help) and every way the syntax can be wrong, and it
 * switches on the row index to store and check the value. So the rules and
 * messages below are the same in every command, and --help prints the very
 * table the parser accepts, so the two cannot drift apart.
 *
 * It is an iterator rather than a callback-driven parser because each
 * command's value checks differ (ranges, units, dtypes) and read best inline
 * in the command's own switch; value checks stay there.
 *
 * `ctitan train` is not parsed here: its options are the TOML keys
 * (src/config). `ctitan prepare` keeps its own loop: it takes repeated
 * --input, scans for --help before anything else and adds a
 * "(ctitan prepare --help)" hint to its messages, and tests compile
 * cmd_prepare.c alone, with a fixed source list. */
#include "cli/args.h"

#include <stdarg.h>
#include <string.h>

int cli_fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ctitan: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    return code;
}

/* Width of "--name METAVAR" (no trailing space for a flag). */
static int cli_left_width(const cli_opt *o) {
    return (int)(strlen(o->name) + (o->metavar[0] ? 1 + strlen(o->metavar) : 0));
}

void cli_print_options(FILE *f, const cli_opt *opts, int n) {
    /* one column wide enough for the longest left side, so a long metavar
     * never pushes its help text out of line */
    int w = 0;
    for (int k = 0; k < n; k++)
        if (cli_left_width(&opts[k]) > w) w = cli_left_width(&opts[k]);
    fprintf(f, "Options (--name VALUE or --name=VALUE):\n\n"); /* the syntax cli_next_option takes */
    for (int k = 0; k < n; k++) {
        const cli_opt *o = &opts[k];
        fprintf(f, "  %s%s%s%*s  %s", o->name, o->metavar[0] ? " " : "", o->metavar, w - cli_left_width(o), "",
                o->help);
        if (o->def[0]) fprintf(f, " [default: %s]", o->def);
        fprintf(f, "\n");
    }
}

int cli_next_option(const char *cmd, const cli_opt *opts, int n, int argc, char **argv, int *i, int *which,
                    const char **value) {
    const char *arg = argv[*i];
    /* only the exact words: "--help=x" reaches the table, where --help is a flag */
    if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) return CLI_HELP;
    if (strncmp(arg, "--", 2) != 0) return cli_fail(2, "%s: unexpected argument \"%s\"", cmd, arg);
    const char *eq = strchr(arg, '=');
    size_t nl = eq ? (size_t)(eq - arg) : strlen(arg);
    int k = 0;
    while (k < n && !(strlen(opts[k].name) == nl && !strncmp(opts[k].name, arg, nl))) k++;
    if (k == n) return cli_fail(2, "%s: unknown option \"%.*s\" (see --help)", cmd, (int)nl, arg);
    const cli_opt *o = &opts[k];
    const char *val = eq ? eq + 1 : NULL;
    if (o->kind == CLI_FLAG) {
        if (val) return cli_fail(2, "%s: takes no value (got \"%s\")", o->name, val);
    } else {
        /* `--name VALUE`: the next word is the value whatever it looks like,
         * so `--prompt --help` prompts with "--help" */
        if (!val) {
            if (*i + 1 >= argc) return cli_fail(2, "%s: missing value", o->name);
            val = argv[++*i];
        }
        if (!*val && o->kind != CLI_TEXT) return cli_fail(2, "%s: empty value", o->name);
    }
    *which = k;
    *value = val;
    return 0;
}
