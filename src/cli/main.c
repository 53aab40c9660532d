/* cli/main.c: `ctitan <command> ...`, dispatch only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/cpu.h"

/* OpenBLAS picks its kernels when it loads, before main: if the user has not
 * chosen, choose for this CPU (or the level CTITAN_ISA holds it to) and start
 * again with it in the environment. CTITAN_NO_REEXEC=1 keeps the library's own
 * choice. */
static void pick_blas_kernels(char **argv) {
    if (getenv("OPENBLAS_CORETYPE") || getenv("CTITAN_NO_REEXEC")) return;
    const char *core = cpu_openblas_coretype(getenv("CTITAN_ISA"));
    if (!core) return;
    setenv("OPENBLAS_CORETYPE", core, 1);
    execv("/proc/self/exe", argv);
    /* exec failed: carry on with the generic kernels */
}

static void usage(FILE *out) {
    fprintf(out,
            "ctitan: train Qwen3 and other Hugging Face decoder models in C\n\n"
            "usage: ctitan <command> [options]\n\n"
            "commands:\n"
            "  train     train or fine-tune a model (ctitan train --help lists every option)\n"
            "  tokenize  encode text to token ids, or decode ids to text\n"
            "  prepare   tokenize a corpus into shards with every core\n"
            "  generate  sample text from a model directory (KV cache)\n"
            "  kernels   list, check (against the reference) or benchmark the kernel implementations\n"
            "  export    write a training checkpoint as a Hugging Face model directory\n"
            "  import    turn a Hugging Face model directory into a checkpoint (FOLDER/step-N)\n"
            "  describe  what ctitan derives from a model's config.json (family, sizes, attention, RoPE)\n"
            "  download  fetch a Hugging Face Hub model into the Hugging Face cache (ctitan download Qwen/Qwen3-0.6B)\n"
            "  compare   two runs of one recipe: loss curves, restore across layouts, speed, restarts, cost\n"
            "  report    an HTML page (and PNG) of runs' curves, events and configs (ctitan report RUN_DIR)\n"
            "  help      this text\n\n"
            "Where a command takes a model or tokenizer directory, a Hugging Face Hub id such as\n"
            "Qwen/Qwen3-0.6B works too (cached in HF_HUB_CACHE, downloaded when missing; docs/hub.md).\n\n");
}

int main(int argc, char **argv) {
    pick_blas_kernels(argv);
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        if (argc >= 2) {
            printf("options of `ctitan train`:\n\n");
            cli_train_help();
        }
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "train")) return cli_train(argc - 2, argv + 2);
    if (!strcmp(argv[1], "tokenize")) return cli_tokenize(argc - 2, argv + 2);
    if (!strcmp(argv[1], "prepare")) return cli_prepare(argc - 2, argv + 2);
    if (!strcmp(argv[1], "generate")) return cli_generate(argc - 2, argv + 2);
    if (!strcmp(argv[1], "kernels")) return cli_kernels(argc - 2, argv + 2);
    if (!strcmp(argv[1], "export")) return cli_export(argc - 2, argv + 2);
    if (!strcmp(argv[1], "import")) return cli_import(argc - 2, argv + 2);
    if (!strcmp(argv[1], "describe")) return cli_describe(argc - 2, argv + 2);
    if (!strcmp(argv[1], "download")) return cli_download(argc - 2, argv + 2);
    if (!strcmp(argv[1], "compare")) return cli_compare(argc - 2, argv + 2);
    if (!strcmp(argv[1], "report")) return cli_report(argc - 2, argv + 2);
    fprintf(stderr, "ctitan: error: unknown command \"%s\" (try ctitan --help)\n", argv[1]);
    return 2;
}
