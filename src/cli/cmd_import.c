/* cli/cmd_import.c: `ctitan import --hf HF_DIR --out FOLDER [--step N]`.
 *
 * The other way from export: a Hugging Face model directory of any family
 * lm_config_from_hf reads (docs/families.md; single file or
 * sharded, F32/BF16/F16, tied with or without lm_head.weight) becomes the
 * model-only training checkpoint FOLDER/step-N (checkpoint/ckpt.h), written
 * atomically with a manifest like every checkpoint. A run can then start
 * from it, and `ctitan export` can turn it back into an HF directory.
 *
 * HF_DIR may also be a Hugging Face Hub id ("Qwen/Qwen3-0.6B", at --revision),
 * resolved in huggingface_hub's cache and downloaded when missing (hub/hub.h).
 *
 * The checkpoint's config.toml records only `[model] spec = "hf"` and
 * hf_assets_path = the absolute HF_DIR (for a Hub id: the id, and
 * hf_revision = the commit it resolved to), so a later export finds the
 * tokenizer files there. It has no state.json: it is weights, not a run.
 * An existing FOLDER/step-N is never overwritten: that could be a run's
 * checkpoint.
 *
 * Exit codes: a bad option or value names the option and exits 2 before any
 * work; a missing, malformed or unwritable file exits 1. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/hf.h"
#include "cli/args.h"
#include "cli/cli.h"
#include "hub/hub.h"
#include "model/lm.h"

typedef struct {
    const char *hf, *out, *revision;
    int step;
} imp_args;

/* Every option once: the parser and --help both read this table. */
enum { IMP_HF, IMP_OUT, IMP_STEP, IMP_REVISION, IMP_HELP };
static const cli_opt imp_options[] = {
    [IMP_HF] = {"--hf", "HF_DIR", "(required)",
                "Hugging Face model directory (config.json + *.safetensors) of any family ctitan reads (qwen3, "
                "qwen3_moe, qwen2_moe, olmoe, llama, mistral, ministral, qwen2, mixtral, olmo2, phi3, gemma, gemma2, "
                "gemma3_text, granite, granitemoe, granitemoeshared, smollm3, olmo3, glm, glm4, ernie4_5, seed_oss, "
                "exaone4, ministral3, helium, vaultgemma, hunyuan_v1_dense, ernie4_5_moe, flex_olmo, glm4_moe, "
                "dots1: "
                "docs/families.md), or a Hub id (Qwen/Qwen3-0.6B)",
                CLI_VALUE},
    [IMP_OUT] = {"--out", "FOLDER", "(required)", "checkpoint folder; the checkpoint is FOLDER/step-N", CLI_VALUE},
    [IMP_STEP] = {"--step", "N", "0", "step number of the checkpoint (>= 0)", CLI_VALUE},
    [IMP_REVISION] = {"--revision", "R", HUB_DEFAULT_REVISION, "branch, tag or commit when --hf is a Hub id", CLI_VALUE},
    [IMP_HELP] = {"--help", "", "", "this text", CLI_FLAG},
};

static void cli_import_help(void) {
    printf("usage: ctitan import --hf HF_DIR --out FOLDER [--step N]\n\n"
           "Writes a Hugging Face model directory as the model-only checkpoint FOLDER/step-N, which a\n"
           "run can start from (checkpoint.folder) and `ctitan export` turns back into HF files.\n");
    cli_print_options(stdout, imp_options, CLI_NOPTS(imp_options));
}

static int imp_parse_args(imp_args *a, int argc, char **argv) {
    memset(a, 0, sizeof *a);
    for (int i = 0; i < argc; i++) {
        int k;
        const char *val;
        int rc = cli_next_option("import", imp_options, CLI_NOPTS(imp_options), argc, argv, &i, &k, &val);
        if (rc == CLI_HELP) cli_import_help();
        if (rc) return rc;
        switch (k) {
        case IMP_HF: a->hf = val; break;
        case IMP_OUT: a->out = val; break;
        case IMP_REVISION: a->revision = val; break;
        case IMP_STEP: {
            char *end;
            errno = 0;
            long v = strtol(val, &end, 10);
            if (*end || errno || v < 0 || v > INT_MAX)
                return cli_fail(2, "--step: \"%s\" is not a non-negative integer", val);
            a->step = (int)v;
            break;
        }
        }
    }
    if (!a->hf) return cli_fail(2, "import: --hf HF_DIR is required");
    if (!a->out) return cli_fail(2, "import: --out FOLDER is required");
    return 0;
}

/* TOML basic string body: quotes, backslashes and control bytes escaped. */
static void imp_toml_escape(char *out, size_t cap, const char *s) {
    size_t k = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p && k + 7 < cap; p++) {
        if (*p == '"' || *p == '\\') {
            out[k++] = '\\';
            out[k++] = (char)*p;
        } else if (*p < 0x20 || *p == 0x7f) {
            k += (size_t)snprintf(out + k, cap - k, "\\u%04x", *p);
        } else {
            out[k++] = (char)*p;
        }
    }
    out[k] = 0;
}

int cli_import(int argc, char **argv) {
    imp_args a;
    int rc = imp_parse_args(&a, argc, argv);
    if (rc) return rc < 0 ? 0 : rc;
    struct stat st;
    if ((stat(a.hf, &st) != 0 || !S_ISDIR(st.st_mode)) && !hub_is_repo_id(a.hf))
        return cli_fail(1, "--hf %s: no such directory", a.hf);
    char final[4200];
    snprintf(final, sizeof final, "%s/step-%d", a.out, a.step);
    if (stat(final, &st) == 0)
        return cli_fail(1, "%s: already exists; not overwriting it (remove it or choose --step)", final);

    ct_err e = {0};
    hub_local loc; /* a Hub id -> its snapshot in the cache */
    if ((rc = hub_resolve(a.hf, a.revision, HUB_MODEL, &loc, &e))) return cli_fail(ct_exit_code(rc), "%s", e.msg);
    const char *id = a.hf;
    a.hf = loc.dir;
    lm_config c;
    lm_model m = {0};
    char cfg_path[4200];
    snprintf(cfg_path, sizeof cfg_path, "%s/config.json", a.hf);
    if (access(cfg_path, R_OK) != 0) {
        char hint[2 * 4096 + 400];
        ckpt_adapter_hint(a.hf, "--hf", "train's lora.adapter_path (or generate's --adapter)", hint, sizeof hint);
        return cli_fail(1, "--hf %s: no readable config.json (not a Hugging Face model directory)%s", a.hf, hint);
    }
    /* the codes of train and generate: a config.json value 2, a malformed file 3, a
     * missing one 1 (docs/reliability.md, "Exit codes") */
    if ((rc = lm_config_from_hf(&c, a.hf, &e))) return cli_fail(ct_exit_code(rc), "%s", e.msg);
    if ((rc = lm_create(&m, &c, 1, 1, &e))) return cli_fail(ct_exit_code(rc), "%s", e.msg);
    if ((rc = hf_load(&m, a.hf, &e))) {
        lm_free(&m);
        return cli_fail(ct_exit_code(rc), "%s", e.msg);
    }
    char abs[PATH_MAX], esc[3 * PATH_MAX], toml[4 * PATH_MAX], rev[128] = "";
    if (loc.commit[0]) { /* the id, pinned to the commit it resolved to */
        snprintf(abs, sizeof abs, "%s", id);
        snprintf(rev, sizeof rev, "hf_revision = \"%s\"\n", loc.commit);
    } else if (!realpath(a.hf, abs)) {
        snprintf(abs, sizeof abs, "%s", a.hf);
    }
    imp_toml_escape(esc, sizeof esc, abs);
    snprintf(toml, sizeof toml,
             "# written by `ctitan import`: the model's source, not a run's resolved config\n"
             "[model]\nspec = \"hf\"\nhf_assets_path = \"%s\"\n%s",
             esc, rev);
    ckpt_info info = {0};
    rc = ckpt_save(a.out, a.step, &m, NULL, NULL, NULL, toml, &info, &e);
    size_t n_params = lm_num_params(&m);
    lm_free(&m);
    if (rc) return cli_fail(1, "%s", e.msg);
    printf("ctitan import: %s%s%s (%zu parameters) -> %s (model only, %.1f MB, %.2f s)\n", id, loc.commit[0] ? " @ " : "",
           loc.commit, n_params, info.dir,
           (double)info.bytes / 1e6, info.seconds);
    return 0;
}
