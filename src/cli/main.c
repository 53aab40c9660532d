/* cli/main.c: `ctitan <command> ...`, dispatch only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/cpu.h"

/* How long an idle OpenMP thread spins before it sleeps (libgomp's
 * GOMP_SPINCOUNT, iterations of a pause loop). libgomp's default, 300000, is
 * ~7 ms on the 2-core SPR guest (a pause is 23 ns there): at a barrier of one
 * of a W3 step's several hundred parallel regions, a thread whose partner
 * another process has preempted burns its share of the core spinning, and
 * the partner waits longer for it. 10000 (~0.25 ms) still spans nearly all
 * the gaps between a step's regions (the serial code between kernel calls:
 * 16 of a W3 step's ~230 exceed 0.2 ms, at one thread and load 4). Measured
 * at load 4-9, W3's model, 6 steps, settings alternating (tok/s, user CPU s):
 * default 202 / 117 (31-33 s), 100000 370 / 125 (25-30 s), 30000 159 / 159
 * (25 s; default 164 / 146 beside it), 10000 285 / 194 (22-24 s), 1000
 * 177 / 167 (21-22 s), passive (0) 175 / 173 (21-22 s). */
#define CT_GOMP_SPINCOUNT "10000"

/* Libraries that read the environment when they load, before main: OpenBLAS
 * picks its kernels (choose for this CPU), libgomp its wait policy (above).
 * Where the user has not chosen, set them and start again once with them in
 * the environment. CTITAN_NO_REEXEC=1 keeps the libraries' own choices. */
static void reexec_with_library_env(char **argv) {
    if (getenv("CTITAN_NO_REEXEC")) return;
    int set = 0;
    const char *core = getenv("OPENBLAS_CORETYPE") ? NULL : cpu_openblas_coretype();
    if (core) setenv("OPENBLAS_CORETYPE", core, 1), set = 1;
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT")) setenv("GOMP_SPINCOUNT", CT_GOMP_SPINCOUNT, 1), set = 1;
    if (set) execv("/proc/self/exe", argv);
    /* exec failed: carry on with the libraries' defaults */
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
    reexec_with_library_env(argv);
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
