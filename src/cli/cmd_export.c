/* cli/cmd_export.c: `ctitan export --checkpoint DIR --out HF_DIR ...`.
 *
 * Turns a training checkpoint (checkpoint/ckpt.h) into a Hugging Face model
 * directory that transformers loads as it is: config.json, the weights in the
 * chosen dtype (sharded with model.safetensors.index.json above
 * --max-shard-size), and the tokenizer files, copied from --tokenizer or from
 * the model.hf_assets_path recorded in the checkpoint's config.toml. Those,
 * and the base model of --merge, may be Hugging Face Hub ids (at --revision,
 * or the recorded model.hf_revision), resolved in the Hub cache (hub/hub.h).
 *
 * --checkpoint may name one step-N directory or a checkpoint folder; a folder
 * means its newest model: a training checkpoint that verifies, or the run's
 * final Hugging Face export (last_save_in_hf), which is what a user exporting
 * a finished run wants (damaged newer checkpoints are reported and skipped, as
 * on resume). A Hugging Face directory (that export, or the base of --merge)
 * is read as one and is its own default tokenizer source. The written
 * config.json keeps the source model's bos/eos token ids (hf_keep_token_ids),
 * so generate in transformers stops where the model was trained to. The checkpoint is verified (sizes, checksums)
 * before a byte is exported, and the weights go through the model's tensor
 * table, so the HF directory holds exactly the model's tensors (a tied model
 * writes no lm_head.weight, as transformers does).
 *
 * Exit codes as everywhere in ctitan: a bad option or value names the option
 * and exits 2 before any work; a missing, damaged or unwritable file exits 1. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "checkpoint/hf.h"
#include "cli/args.h"
#include "cli/cli.h"
#include "core/fs.h"
#include "core/timer.h"
#include "formats/toml.h"
#include "hub/hub.h"
#include "model/lora.h"
#include "model/lm.h"

#define EXP_DEFAULT_SHARD 5000000000ull /* "5GB" as transformers reads it */

typedef struct {
    const char *checkpoint, *out, *tokenizer, *dtype, *adapter, *revision, *adapter_revision;
    unsigned long long max_shard;
    int merge;
} exp_args;

/* Every option once: the parser and --help both read this table. */
enum { EXP_CHECKPOINT, EXP_OUT, EXP_DTYPE, EXP_MAX_SHARD, EXP_TOKENIZER, EXP_ADAPTER, EXP_MERGE, EXP_REVISION,
       EXP_ADAPTER_REVISION, EXP_HELP };
static const cli_opt exp_options[] = {
    [EXP_CHECKPOINT] = {"--checkpoint", "DIR", "(required)",
                        "a checkpoint step-N directory, or a folder of them (newest valid one)", CLI_VALUE},
    [EXP_OUT] = {"--out", "HF_DIR", "(required)", "Hugging Face model directory to write (created if missing)",
                 CLI_VALUE},
    [EXP_DTYPE] = {"--dtype", "T", "float32", "float32 | bfloat16 | float16 (rounded to nearest even)", CLI_VALUE},
    [EXP_MAX_SHARD] = {"--max-shard-size", "BYTES", "5GB",
                       "shard above this size; a number with optional KB/MB/GB or KiB/MiB/GiB", CLI_VALUE},
    [EXP_TOKENIZER] = {"--tokenizer", "DIR", "model.hf_assets_path of the checkpoint's config.toml",
                       "where to copy tokenizer files from (a directory or a Hub id)", CLI_VALUE},
    [EXP_ADAPTER] = {"--adapter", "DIR", "(none)",
                     "a PEFT LoRA adapter directory or Hub id (with --merge; --checkpoint is then the base HF model "
                     "directory)",
                     CLI_VALUE},
    [EXP_MERGE] = {"--merge", "", "off",
                   "fold the --adapter into the base weights of --checkpoint (W + scale B A)", CLI_FLAG},
    [EXP_REVISION] = {"--revision", "R", HUB_DEFAULT_REVISION,
                      "branch, tag or commit of a Hub id given as --tokenizer or (with --merge) --checkpoint",
                      CLI_VALUE},
    [EXP_ADAPTER_REVISION] = {"--adapter-revision", "R", HUB_DEFAULT_REVISION,
                              "branch, tag or commit of a Hub id given to --adapter", CLI_VALUE},
    [EXP_HELP] = {"--help", "", "", "this text", CLI_FLAG},
};

static void cli_export_help(void) {
    printf("usage: ctitan export --checkpoint DIR --out HF_DIR [options]\n\n"
           "Writes a training checkpoint as a Hugging Face model directory (config.json, safetensors,\n"
           "tokenizer files). The checkpoint is verified first; a damaged one is refused by name.\n");
    cli_print_options(stdout, exp_options, CLI_NOPTS(exp_options));
}

/* "123", "20KB", "1.5GB", "64MiB" -> bytes; -1 if malformed. */
static int exp_parse_size(const char *s, unsigned long long *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || errno || !(v > 0)) return -1;
    static const struct {
        const char *sfx;
        double mul;
    } units[] = {{"", 1},         {"B", 1},         {"KB", 1e3},          {"MB", 1e6},         {"GB", 1e9},
                 {"TB", 1e12},    {"KiB", 1024.0},  {"MiB", 1048576.0},   {"GiB", 1073741824.0}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++)
        if (!strcmp(end, units[i].sfx)) {
            double b = v * units[i].mul;
            if (b < 1 || b > 1e18) return -1;
            *out = (unsigned long long)b;
            return 0;
        }
    return -1;
}

/* Fills a from argv; returns 0, 2 on a bad option, or -1 after --help. */
static int exp_parse_args(exp_args *a, int argc, char **argv) {
    memset(a, 0, sizeof *a);
    a->dtype = "float32";
    a->max_shard = EXP_DEFAULT_SHARD;
    for (int i = 0; i < argc; i++) {
        int k;
        const char *val;
        int rc = cli_next_option("export", exp_options, CLI_NOPTS(exp_options), argc, argv, &i, &k, &val);
        if (rc == CLI_HELP) cli_export_help();
        if (rc) return rc;
        switch (k) {
        case EXP_CHECKPOINT: a->checkpoint = val; break;
        case EXP_OUT: a->out = val; break;
        case EXP_TOKENIZER: a->tokenizer = val; break;
        case EXP_ADAPTER: a->adapter = val; break;
        case EXP_MERGE: a->merge = 1; break;
        case EXP_REVISION: a->revision = val; break;
        case EXP_ADAPTER_REVISION: a->adapter_revision = val; break;
        case EXP_DTYPE:
            if (hf_dtype_from_name(val) < 0)
                return cli_fail(2, "--dtype: \"%s\" is not one of float32, bfloat16, float16", val);
            a->dtype = val;
            break;
        case EXP_MAX_SHARD:
            if (exp_parse_size(val, &a->max_shard))
                return cli_fail(2, "--max-shard-size: \"%s\" is not a positive size (e.g. 5GB, 500MB, 1000000)", val);
            break;
        }
    }
    if (!a->checkpoint) return cli_fail(2, "export: --checkpoint DIR is required");
    if (!a->out) return cli_fail(2, "export: --out HF_DIR is required");
    if (a->adapter && !a->merge) return cli_fail(2, "export: --adapter DIR is for --merge");
    return 0;
}

static int exp_is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* model.hf_assets_path from DIR/config.toml, or "" (malloc'd); *rev: its model.hf_revision
 * (malloc'd, NULL when not recorded). */
static char *exp_assets_path(const char *ckdir, char **rev) {
    *rev = NULL;
    char p[4200];
    snprintf(p, sizeof p, "%s/config.toml", ckdir);
    if (access(p, R_OK) != 0) return ct_strdup("");
    toml_doc doc = {0};
    ct_err e = {0};
    char *out;
    if (toml_parse_file(p, &doc, &e) != 0) {
        fprintf(stderr, "ctitan: warning: %s (tokenizer source unknown)\n", e.msg);
        out = ct_strdup("");
    } else {
        const toml_kv *kv = toml_find(&doc, "model", "hf_assets_path");
        out = ct_strdup(kv && kv->val.kind == TOML_STRING ? kv->val.s : "");
        kv = toml_find(&doc, "model", "hf_revision");
        if (kv && kv->val.kind == TOML_STRING) *rev = ct_strdup(kv->val.s);
    }
    toml_free(&doc);
    return out;
}

int cli_export(int argc, char **argv) {
    exp_args a;
    int rc = exp_parse_args(&a, argc, argv);
    if (rc) return rc < 0 ? 0 : rc;
    /* a Hub id is a model, so only the base of --merge may be one (a checkpoint is local) */
    if (!exp_is_dir(a.checkpoint) && !(a.adapter && hub_is_repo_id(a.checkpoint)))
        return cli_fail(1, "--checkpoint %s: no such directory", a.checkpoint);
    if (a.tokenizer && !exp_is_dir(a.tokenizer) && !hub_is_repo_id(a.tokenizer))
        return cli_fail(1, "--tokenizer %s: no such directory", a.tokenizer);
    double t0 = ct_now();
    ct_err e = {0};
    hub_local base_loc, tok_loc, ad_loc;
    if (a.adapter && (rc = hub_resolve(a.checkpoint, a.revision, HUB_MODEL, &base_loc, &e)))
        return cli_fail(ct_exit_code(rc), "%s", e.msg);
    if (a.adapter) a.checkpoint = base_loc.dir;
    if (a.adapter && !exp_is_dir(a.adapter) && hub_is_repo_id(a.adapter)) {
        if ((rc = hub_resolve(a.adapter, a.adapter_revision, HUB_ADAPTER, &ad_loc, &e)))
            return cli_fail(ct_exit_code(rc), "--adapter: %s", e.msg);
        a.adapter = ad_loc.dir;
    }
    if (a.tokenizer && (rc = hub_resolve(a.tokenizer, a.revision, HUB_TOKENIZER, &tok_loc, &e)))
        return cli_fail(ct_exit_code(rc), "%s", e.msg);
    if (a.tokenizer) a.tokenizer = tok_loc.dir;

    /* a step-N directory, or a folder of them; with --adapter also a base HF model directory */
    char ckdir[4096], mpath[4200], cpath[4200];
    snprintf(mpath, sizeof mpath, "%s/manifest.json", a.checkpoint);
    snprintf(cpath, sizeof cpath, "%s/config.json", a.checkpoint);
    int hf_base = a.adapter && access(mpath, F_OK) != 0 && access(cpath, F_OK) == 0;
    int kind = CKPT_DIR_CHECKPOINT, step = -1, from_folder = 0;
    if (hf_base) {
        snprintf(ckdir, sizeof ckdir, "%s", a.checkpoint);
        kind = CKPT_DIR_HF_MODEL;
    } else if (access(mpath, F_OK) != 0 && ckpt_list(a.checkpoint, NULL, 0) > 0) {
        /* a folder: its newest model, a run's final export included (what a user exporting the run wants) */
        rc = ckpt_select_model(a.checkpoint, ckdir, sizeof ckdir, &step, &kind, &e);
        /* the error's kind is the exit code (docs/reliability.md) */
        if (rc) return cli_fail(rc > 0 ? rc : 1, "%s", e.msg);
        from_folder = 1;
    } else {
        if (snprintf(ckdir, sizeof ckdir, "%s", a.checkpoint) >= (int)sizeof ckdir)
            return cli_fail(1, "--checkpoint: path too long");
        kind = ckpt_dir_kind(ckdir); /* a final export named directly is a model too */
        if (kind == CKPT_DIR_CHECKPOINT && access(mpath, F_OK) != 0)
            return cli_fail(1, "--checkpoint %s: not a checkpoint (no manifest.json) and holds no step-N checkpoints",
                            a.checkpoint);
    }
    if (fs_same_file(ckdir, a.out)) return cli_fail(2, "--out %s: is the checkpoint directory itself", a.out);
    /* a Hugging Face directory (a merge's base, a run's final export) is its own tokenizer source */
    int hf_src = kind == CKPT_DIR_HF_MODEL;

    lm_config c;
    lm_model m = {0};
    /* a LoRA run's checkpoint holds the trained tensors (its adapter), not the frozen base: merging
     * takes the base from its HF directory (hf_base) and the adapter from --adapter */
    char apath[4200];
    snprintf(apath, sizeof apath, "%s/adapter_config.json", ckdir);
    if (kind == CKPT_DIR_PEFT_ADAPTER)
        return cli_fail(2,
                        "export: %s is a LoRA run's final save, a PEFT adapter: it holds the adapter, not the base "
                        "model; give the base model: --checkpoint BASE_HF_DIR --adapter %s --merge",
                        ckdir, ckdir);
    if (!hf_src && access(apath, F_OK) == 0)
        return cli_fail(2,
                        "export: %s is a LoRA run's checkpoint: it holds the trained tensors (the adapter), not the "
                        "frozen base; give the base model: --checkpoint BASE_HF_DIR --adapter %s --merge",
                        ckdir, ckdir);
    if (a.merge && !hf_base)
        return cli_fail(2, "export --merge: give the base model's Hugging Face directory as --checkpoint and the PEFT "
                           "adapter as --adapter DIR");
    double alpha;
    int rslora;
    if ((rc = lm_config_from_hf(&c, ckdir, &e)) || (hf_base && (rc = lora_read_config(a.adapter, &c, &alpha, &rslora, &e))) ||
        (rc = lm_create(&m, &c, 1, 1, &e)))
        return cli_fail(rc, "%s", e.msg);
    ckpt_info info = {0};
    if (hf_src) { /* the weights from HF files (a merge's base: the adapter comes from its PEFT directory) */
        rc = hf_load(&m, ckdir, &e);
    } else {
        rc = ckpt_load(ckdir, &m, NULL, NULL, NULL, &info, &e); /* verifies sizes and checksums first */
        if (!rc) rc = hf_ckpt_router_bias(&m, ckdir, m.moe.bias, &e); /* ERNIE 4.5 MoE's, in state.json */
        step = info.step;
    }
    if (!rc && hf_base) {
        lm_copy_ctx cc;
        lm_sink sink = lm_copy_sink(&cc, &m, NULL, NULL);
        if (!(rc = lora_load_peft_each(&m, a.adapter, &sink, &e))) lora_merge(&m);
    }
    if (!rc) rc = hf_save(&m, a.out, (ct_dtype)hf_dtype_from_name(a.dtype), (size_t)a.max_shard, &e);
    size_t n_params = lm_num_params(&m);
    lm_free(&m);
    if (rc) return cli_fail(rc, "%s", e.msg); /* a damaged checkpoint exits 3, as train does */
    char what[64] = "";
    if (step >= 0) snprintf(what, sizeof what, "step %d, ", step);
    printf("ctitan export: %s (%s%zu parameters%s) -> %s as %s\n", ckdir, what, n_params,
           hf_base ? ", LoRA adapter merged" : from_folder && hf_src ? ", the run's final Hugging Face save" : "",
           a.out, a.dtype);

    char *assets_rev = NULL;
    char *assets = a.tokenizer ? ct_strdup(a.tokenizer)
                   : hf_src    ? ct_strdup(ckdir)
                               : exp_assets_path(ckdir, &assets_rev);
    int copied = 0;
    if (assets[0] && !a.tokenizer && !exp_is_dir(assets) && hub_is_repo_id(assets)) {
        /* the Hub id the checkpoint came from: its tokenizer files, from the cache or the Hub */
        ct_err he = {0};
        if (hub_resolve(assets, assets_rev, HUB_TOKENIZER_IF_ANY, &tok_loc, &he)) {
            fprintf(stderr, "ctitan: warning: no tokenizer files copied: %s (give --tokenizer DIR)\n", he.msg);
            assets[0] = 0;
            copied = -1;
        } else {
            free(assets);
            assets = ct_strdup(tok_loc.dir);
        }
    }
    free(assets_rev);
    if (copied < 0) {
        copied = 0;
    } else if (!assets[0]) {
        fprintf(stderr, "ctitan: warning: no tokenizer files copied: the checkpoint records no "
                        "model.hf_assets_path (give --tokenizer DIR)\n");
    } else if (!exp_is_dir(assets)) {
        fprintf(stderr, "ctitan: warning: no tokenizer files copied: %s (model.hf_assets_path of %s/config.toml) "
                        "is not a directory (give --tokenizer DIR)\n", assets, ckdir);
    } else {
        copied = hf_copy_assets(assets, a.out, stdout, &e);
        if (copied < 0) {
            free(assets);
            return cli_fail(1, "%s", e.msg);
        }
        if (copied == 0 && a.tokenizer) {
            free(assets);
            return cli_fail(1, "--tokenizer %s: holds none of tokenizer.json, vocab.json, merges.txt, ...", a.tokenizer);
        }
        if (copied == 0)
            fprintf(stderr, "ctitan: warning: no tokenizer files found in %s (give --tokenizer DIR)\n", assets);
    }
    /* the end-of-text ids generate stops on: the source's own config.json (an HF
     * directory's), else that of the model the run started from */
    char *rev2 = NULL, *recorded = a.tokenizer && !hf_src ? exp_assets_path(ckdir, &rev2) : ct_strdup("");
    const char *id_src[] = {ckdir, assets, recorded};
    char out_cfg[4200];
    snprintf(out_cfg, sizeof out_cfg, "%s/config.json", a.out);
    rc = hf_keep_token_ids(out_cfg, id_src, 3, &e);
    free(recorded);
    free(rev2);
    if (rc) {
        free(assets);
        return cli_fail(ct_exit_code(rc), "%s", e.msg);
    }
    free(assets);
    printf("ctitan export: done in %.2f s (%d tokenizer files)\n", ct_now() - t0, copied);
    return 0;
}
