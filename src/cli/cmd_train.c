/* cli/cmd_train.c: `ctitan train --config FILE [--section.key=value ...]`.
 * Config errors are reported before any work (exit 2); everything else the
 * trainer reports with the file, key or tensor at fault (exit 1). */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"
#include "config/config.h"
#include "train/trainer.h"

void cli_train_help(void) {
    printf("usage: ctitan train --config FILE [--section.key=value | --section.key value | --flag] ... [--dry-run]\n\n"
           "--dry-run prints the memory the run would plan (parameters, gradients, AdamW moments,\n"
           "activations) and exits without allocating it.\n\n"
           "Trains a Qwen3 model. Options (TOML sections and keys as torchtitan's):\n\n");
    cfg_print_help(stdout);
}

int cli_train(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            cli_train_help();
            return 0;
        }
    /* --dry-run is a mode of the command, not a config option: take it out first */
    int dry = 0, n = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--dry-run")) dry = 1;
        else argv[n++] = argv[i];
    }
    argc = n;
    ct_err e = {0};
    ct_config cfg;
    cfg_defaults(&cfg);
    if (cfg_parse_args(&cfg, argc, argv, &e)) {
        cfg_free(&cfg);
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(e.code);
    }
    if (dry) {
        int rc = trainer_dry_run(&cfg, &e);
        cfg_free(&cfg);
        if (rc) fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(rc);
    }
    trainer t;
    int rc = trainer_init(&t, &cfg, &e);
    if (!rc) rc = trainer_run(&t, &e);
    trainer_free(&t);
    if (rc && rc != CT_STOPPED) fprintf(stderr, "ctitan: error: %s\n", e.msg);
    return ct_exit_code(rc);
}
