/* cli/cli.h: one function per subcommand; main.c only dispatches.
 * Each returns the process exit status (0 ok, 2 bad config, 1 other). */
#ifndef CT_CLI_CLI_H
#define CT_CLI_CLI_H

int cli_train(int argc, char **argv);
void cli_train_help(void);
int cli_tokenize(int argc, char **argv);
void cli_tokenize_help(void);
int cli_prepare(int argc, char **argv);
void cli_prepare_help(void);
int cli_generate(int argc, char **argv);
void cli_generate_help(void);
int cli_kernels(int argc, char **argv);
int cli_export(int argc, char **argv);
void cli_export_help(void);
int cli_import(int argc, char **argv);
void cli_import_help(void);
int cli_describe(int argc, char **argv);
void cli_describe_help(void);
int cli_download(int argc, char **argv);
void cli_download_help(void);
int cli_compare(int argc, char **argv);
void cli_compare_help(void);
int cli_report(int argc, char **argv);
void cli_report_help(void);

#endif
