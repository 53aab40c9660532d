/* cli/cli.h: one function per subcommand; main.c only dispatches.
 * Each returns the process exit status (0 ok, 2 bad config, 1 other). */
#ifndef CT_CLI_CLI_H
#define CT_CLI_CLI_H

int cli_train(int argc, char **argv);
/* Public, unlike the other subcommands' help: `ctitan --help` prints train's options. */
void cli_train_help(void);
int cli_tokenize(int argc, char **argv);
int cli_prepare(int argc, char **argv);
int cli_generate(int argc, char **argv);
int cli_kernels(int argc, char **argv);
int cli_export(int argc, char **argv);
int cli_import(int argc, char **argv);
int cli_describe(int argc, char **argv);
int cli_download(int argc, char **argv);
int cli_compare(int argc, char **argv);
int cli_report(int argc, char **argv);

#endif
