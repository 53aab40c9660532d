/* cli/cmd_download.c: `ctitan download ID [--revision R]`, like `hf download ID`.
 *
 * Fetches what ctitan reads of a Hub model (config.json, generation_config.json,
 * the tokenizer files the repo has, the safetensors weights) into
 * huggingface_hub's cache (hub/hub.h) and prints the snapshot directory on
 * stdout, so a later run can go offline (HF_HUB_OFFLINE=1) or be given the
 * directory itself. Files already cached are not fetched again.
 *
 * Exit codes: 2 for bad usage, an unknown id or revision, or a repo the token
 * may not read; 1 for the rest (network, disk, a file the repo lacks). */
#include <stdio.h>
#include <string.h>

#include "cli/args.h"
#include "cli/cli.h"
#include "hub/hub.h"

enum { DL_REVISION, DL_HELP };
static const cli_opt dl_options[] = {
    [DL_REVISION] = {"--revision", "R", HUB_DEFAULT_REVISION, "branch, tag or commit of the repo", CLI_VALUE},
    [DL_HELP] = {"--help", "", "", "this text", CLI_FLAG},
};

static void cli_download_help(void) {
    printf("usage: ctitan download ID [--revision R]\n\n"
           "Downloads a Hugging Face Hub model (config, tokenizer, safetensors weights) into the Hugging Face\n"
           "cache (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) and prints its directory.\n"
           "Any ctitan option that takes a model directory takes the ID as well (docs/hub.md).\n");
    cli_print_options(stdout, dl_options, CLI_NOPTS(dl_options));
}

int cli_download(int argc, char **argv) {
    const char *id = NULL, *rev = HUB_DEFAULT_REVISION;
    for (int i = 0; i < argc; i++) {
        if (strncmp(argv[i], "--", 2) != 0 && strcmp(argv[i], "-h") != 0) {
            if (id) return cli_fail(2, "download: one ID only (got \"%s\" and \"%s\")", id, argv[i]);
            id = argv[i];
            continue;
        }
        int k;
        const char *val;
        int rc = cli_next_option("download", dl_options, CLI_NOPTS(dl_options), argc, argv, &i, &k, &val);
        if (rc == CLI_HELP) {
            cli_download_help();
            return 0;
        }
        if (rc) return rc;
        if (k == DL_REVISION) rev = val;
    }
    if (!id) return cli_fail(2, "download: give a Hub model id, e.g. ctitan download Qwen/Qwen3-0.6B");
    if (!hub_is_repo_id(id))
        return cli_fail(2, "download: \"%s\" is not a Hugging Face Hub model id (owner/name, e.g. Qwen/Qwen3-0.6B)", id);
    hub_local loc;
    ct_err e = {0};
    int rc = hub_resolve(id, rev, HUB_MODEL | HUB_NO_LOCAL, &loc, &e);
    if (rc) return cli_fail(ct_exit_code(rc), "%s", e.msg);
    printf("%s\n", loc.dir);
    return 0;
}
