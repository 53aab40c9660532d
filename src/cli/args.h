/* cli/args.h: the option syntax the subcommands share (export, import,
 * generate): `--name VALUE`, `--name=VALUE`, bare `--flag`, `--help`/`-h`,
 * each command's options in one cli_opt table that both the parser and
 * --help read. Design notes in args.c. */
#ifndef CT_CLI_ARGS_H
#define CT_CLI_ARGS_H

#include <stdio.h>

/* What an option takes. */
enum {
    CLI_VALUE = 0, /* a value, not empty */
    CLI_FLAG = 1,  /* no value: `--name=x` is an error */
    CLI_TEXT = 2,  /* a value that may be empty (free text such as a prompt) */
};

typedef struct {
    const char *name;    /* "--checkpoint" */
    const char *metavar; /* "DIR" in the help line; "" for a flag */
    const char *def;     /* the default as --help shows it; "" prints none */
    const char *help;
    int kind;            /* CLI_VALUE, CLI_FLAG or CLI_TEXT */
} cli_opt;

#define CLI_NOPTS(table) ((int)(sizeof(table) / sizeof((table)[0])))

/* cli_next_option's answer to --help / -h: the caller prints its help and exits 0. */
#define CLI_HELP (-1)

/* Prints "ctitan: error: <message>" to stderr; returns code (the exit status). */
int cli_fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* The "Options (...):" heading, then one "  --name METAVAR  help [default: def]"
 * line per option, aligned. */
void cli_print_options(FILE *f, const cli_opt *opts, int n);

/* Parses argv[*i] (and argv[*i + 1] for `--name VALUE`, advancing *i past
 * it) against opts. Returns 0 with *which = the option's index in opts and
 * *value = its value (NULL for a flag); CLI_HELP for --help / -h; or 2 after
 * printing an error that names the argument (unknown option, stray
 * argument, missing, empty or unwanted value). cmd ("export") prefixes the
 * messages about arguments that name no option. */
int cli_next_option(const char *cmd, const cli_opt *opts, int n, int argc, char **argv, int *i, int *which,
                    const char **value);

#endif
