/* cli/main.c: `ctitan <command> ...`, dispatch only. */
#include <stdio.h>
#include <string.h>

#include "cli/cli.h"

static void usage(FILE *out) {
    fprintf(out,
            "ctitan: train Qwen3 language models in C\n\n"
            "usage: ctitan <command> [options]\n\n"
            "commands:\n"
            "  train     train or fine-tune a model (ctitan train --help lists every option)\n"
            "  help      this text\n\n");
}

int main(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        if (argc >= 2) {
            printf("options of `ctitan train`:\n\n");
            cli_train_help();
        }
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "train")) return cli_train(argc - 2, argv + 2);
    fprintf(stderr, "ctitan: error: unknown command \"%s\" (try ctitan --help)\n", argv[1]);
    return 2;
}
