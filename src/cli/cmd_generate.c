/* cli/cmd_generate.c: `ctitan generate --checkpoint DIR --prompt TEXT ...`.
 *
 * Loads a Hugging Face model directory (config.json + safetensors) for
 * inference only, encodes the prompt with the tokenizer found beside it (or
 * in --tokenizer), and samples a continuation with model/generate.h, printing
 * each piece as soon as it is chosen. `--prompt-ids` and `--ids` bypass the
 * tokenizer on the way in and out, so tests and tokenizer-less checkpoints
 * work too.
 *
 * --checkpoint and --tokenizer may also be Hugging Face Hub ids
 * ("Qwen/Qwen3-0.6B", at --revision): hub/hub.h resolves them to the
 * snapshot directory of huggingface_hub's cache, downloading what is missing.
 *
 * --chat renders the prompt as one user turn with the tokenizer's own chat
 * template (data/jinja.h; ChatML when tokenizer_config.json has none).
 *
 * Generation stops at --max-tokens or after a stop id: the tokenizer's EOS,
 * <|im_end|> when the vocabulary has it, and every eos_token_id of the
 * checkpoint's generation_config.json (config.json's when there is none, as
 * transformers falls back to it).
 *
 * Exit codes as everywhere in ctitan: a bad option or value names the option
 * and exits 2 before any work; a missing or malformed file exits 1. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdint.h>
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
#include "formats/json.h"
#include "core/timer.h"
#include "data/jinja.h"
#include "hub/hub.h"
#include "model/generate.h"
#include "model/lm.h"
#include "tokenizer/tokenizer.h"

typedef struct {
    const char *checkpoint; /* HF model directory */
    const char *adapter;    /* PEFT LoRA adapter directory, or NULL */
    const char *tokenizer;  /* tokenizer directory; NULL: the checkpoint's */
    const char *prompt;     /* text */
    const char *prompt_ids; /* "1 2 3" */
    const char *revision;   /* of Hub ids */
    const char *adapter_revision; /* of a Hub id in adapter */
    const char *chat_kwargs;      /* JSON object: more chat template variables, or NULL */
    cJSON *chat_kw;               /* chat_kwargs parsed (once: checked here, rendered later); cli_generate frees it */
    int max_tokens;
    double temperature;
    int top_k;
    double top_p;
    unsigned long long seed;
    int chat, ids;
} gen_cli_args;

/* Every option once: the parser and --help both read this table. */
enum {
    GEN_CHECKPOINT, GEN_PROMPT, GEN_PROMPT_IDS, GEN_MAX_TOKENS, GEN_TEMPERATURE, GEN_TOP_K,
    GEN_TOP_P, GEN_SEED, GEN_CHAT, GEN_CHAT_KWARGS, GEN_TOKENIZER, GEN_IDS, GEN_ADAPTER, GEN_REVISION, GEN_ADAPTER_REVISION,
    GEN_HELP
};
static const cli_opt gen_cli_options[] = {
    [GEN_CHECKPOINT] = {"--checkpoint", "DIR", "(required)",
                        "Hugging Face model directory (config.json + *.safetensors), or a Hub id (Qwen/Qwen3-0.6B)",
                        CLI_VALUE},
    /* may be empty: with --chat, "" is a real (empty) user turn */
    [GEN_PROMPT] = {"--prompt", "TEXT", "(none)",
                    "prompt text, encoded with the tokenizer (one of --prompt, --prompt-ids)", CLI_TEXT},
    [GEN_PROMPT_IDS] = {"--prompt-ids", "\"ID ID ...\"", "(none)",
                        "prompt as token ids separated by spaces or one comma; no tokenizer needed", CLI_VALUE},
    [GEN_MAX_TOKENS] = {"--max-tokens", "N", "64", "new tokens at most (>= 1)", CLI_VALUE},
    [GEN_TEMPERATURE] = {"--temperature", "T", "0", "0: greedy; > 0: sample from softmax(logits / T)", CLI_VALUE},
    [GEN_TOP_K] = {"--top-k", "K", "0", "sample among the K most likely tokens only (0: off)", CLI_VALUE},
    [GEN_TOP_P] = {"--top-p", "P", "1.0",
                   "nucleus sampling: smallest set with probability >= P, in (0, 1] (1: off)", CLI_VALUE},
    [GEN_SEED] = {"--seed", "S", "0", "random seed of the sampler (same seed, same text)", CLI_VALUE},
    [GEN_CHAT] = {"--chat", "", "off",
                  "render the prompt as a user turn with the tokenizer's chat template (ChatML if it has none)",
                  CLI_FLAG},
    [GEN_CHAT_KWARGS] = {"--chat-template-kwargs", "JSON", "(none)",
                         "with --chat: a JSON object of more template variables, as apply_chat_template(**kwargs) "
                         "takes them (Qwen3: '{\"enable_thinking\": false}')",
                         CLI_VALUE},
    [GEN_TOKENIZER] = {"--tokenizer", "DIR", "--checkpoint",
                       "directory with tokenizer.json (or vocab.json + merges.txt), or a Hub id", CLI_VALUE},
    [GEN_IDS] = {"--ids", "", "off", "print the generated token ids (one line) instead of text", CLI_FLAG},
    [GEN_ADAPTER] = {"--adapter", "DIR", "(none)",
                     "a PEFT LoRA adapter directory, or its Hub id, applied beside the weights (not merged)",
                     CLI_VALUE},
    [GEN_REVISION] = {"--revision", "R", HUB_DEFAULT_REVISION,
                      "branch, tag or commit of the Hub ids given to --checkpoint / --tokenizer", CLI_VALUE},
    [GEN_ADAPTER_REVISION] = {"--adapter-revision", "R", HUB_DEFAULT_REVISION,
                              "branch, tag or commit of a Hub id given to --adapter", CLI_VALUE},
    [GEN_HELP] = {"--help", "", "", "this text", CLI_FLAG},
};

static void cli_generate_help(void) {
    printf("usage: ctitan generate --checkpoint DIR (--prompt TEXT | --prompt-ids IDS) [options]\n\n"
           "Continues a prompt with a model of any supported family (docs/families.md), using a KV\n"
           "cache. Stops at --max-tokens or at an end token (the tokenizer's EOS, <|im_end|>,\n"
           "eos_token_id of generation_config.json).\n");
    cli_print_options(stdout, gen_cli_options, CLI_NOPTS(gen_cli_options));
}

static int gen_parse_int(const char *opt, const char *s, long lo, long hi, int *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi)
        return cli_fail(2, "%s: \"%s\" is not an integer in [%ld, %ld]", opt, s, lo, hi);
    *out = (int)v;
    return 0;
}

static int gen_parse_double(const char *opt, const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !isfinite(v)) return cli_fail(2, "%s: \"%s\" is not a number", opt, s);
    *out = v;
    return 0;
}

/* Fills a from argv; returns 0, 2 on a bad option, or -1 after --help. */
static int gen_parse_args(gen_cli_args *a, int argc, char **argv) {
    memset(a, 0, sizeof *a);
    a->max_tokens = 64;
    a->top_p = 1.0;
    for (int i = 0; i < argc; i++) {
        int k;
        const char *val;
        int rc = cli_next_option("generate", gen_cli_options, CLI_NOPTS(gen_cli_options), argc, argv, &i, &k, &val);
        if (rc == CLI_HELP) cli_generate_help();
        if (rc) return rc;
        const char *name = gen_cli_options[k].name;
        switch (k) {
        case GEN_CHECKPOINT: a->checkpoint = val; break;
        case GEN_TOKENIZER: a->tokenizer = val; break;
        case GEN_ADAPTER: a->adapter = val; break;
        case GEN_REVISION: a->revision = val; break;
        case GEN_ADAPTER_REVISION: a->adapter_revision = val; break;
        case GEN_PROMPT: a->prompt = val; break;
        case GEN_PROMPT_IDS: a->prompt_ids = val; break;
        case GEN_CHAT: a->chat = 1; break;
        case GEN_CHAT_KWARGS: a->chat_kwargs = val; break;
        case GEN_IDS: a->ids = 1; break;
        case GEN_MAX_TOKENS: rc = gen_parse_int(name, val, 1, 1 << 24, &a->max_tokens); break;
        case GEN_TOP_K: rc = gen_parse_int(name, val, 0, 1 << 30, &a->top_k); break;
        case GEN_TEMPERATURE:
            rc = gen_parse_double(name, val, &a->temperature);
            if (!rc && a->temperature < 0) rc = cli_fail(2, "%s: \"%s\" must be >= 0", name, val);
            break;
        case GEN_TOP_P:
            rc = gen_parse_double(name, val, &a->top_p);
            if (!rc && !(a->top_p > 0 && a->top_p <= 1)) rc = cli_fail(2, "%s: \"%s\" must be in (0, 1]", name, val);
            break;
        case GEN_SEED: {
            char *end;
            errno = 0;
            a->seed = strtoull(val, &end, 10);
            if (*end || errno || val[0] == '-') rc = cli_fail(2, "%s: \"%s\" is not a non-negative integer", name, val);
            break;
        }
        }
        if (rc) return rc;
    }
    if (!a->checkpoint) return cli_fail(2, "generate: --checkpoint DIR is required");
    if (!a->prompt == !a->prompt_ids)
        return cli_fail(2, "generate: give exactly one of --prompt TEXT and --prompt-ids IDS");
    if (a->chat && !a->prompt) return cli_fail(2, "--chat: needs --prompt TEXT (not --prompt-ids)");
    if (a->chat_kwargs && !a->chat) return cli_fail(2, "--chat-template-kwargs: needs --chat");
    if (a->chat_kwargs) { /* checked before any file is read, as the other options */
        ct_err e = {0};
        cJSON *o = json_parse(a->chat_kwargs, strlen(a->chat_kwargs), "--chat-template-kwargs", &e);
        if (!o) return cli_fail(2, "%s", e.msg);
        if (!cJSON_IsObject(o)) {
            cJSON_Delete(o);
            return cli_fail(2, "--chat-template-kwargs: \"%s\" is not a JSON object", a->chat_kwargs);
        }
        a->chat_kw = o;
    }
    return 0;
}

static int gen_is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int gen_file_exists(const char *dir, const char *name) {
    char *p = fs_join(dir, name);
    int ok = access(p, R_OK) == 0;
    free(p);
    return ok;
}

/* --checkpoint naming a PEFT adapter: an adapter folder, or a LoRA run's
 * training checkpoint, whose model.safetensors holds only what was trained.
 * Its weights alone are no model, so the error says where the adapter goes;
 * out gets "" when dir holds no adapter_config.json. */
static void gen_adapter_hint(const char *dir, char *out, size_t cap) {
    ckpt_adapter_hint(dir, "--checkpoint", "--adapter", out, cap);
}

static int gen_id_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

/* "1 2, 3" -> ids; 2 on anything else. The grammar: non-negative decimal
 * integers separated by whitespace, a comma, or a comma with whitespace
 * around it; at most one comma between two ids, none before the first or
 * after the last ("1,,2" was read as "1 2", an id the user may have left out). */
static int gen_parse_ids(const char *s, tok_ids *out) {
    const char *p = s;
    while (gen_id_space(*p)) p++;
    while (*p) {
        if (*p == ',')
            return cli_fail(2, "--prompt-ids: \"%s\": the comma at character %zu has no token id before it "
                            "(ids are separated by spaces or one comma)", s, (size_t)(p - s) + 1);
        char *end = (char *)p;
        errno = 0;
        long v = *p >= '0' && *p <= '9' ? strtol(p, &end, 10) : -1;
        if (v < 0 || errno || v > INT32_MAX || (*end && !gen_id_space(*end) && *end != ','))
            return cli_fail(2, "--prompt-ids: \"%s\" is not a list of token ids", s);
        tok_ids_push(out, (int32_t)v);
        p = end;
        while (gen_id_space(*p)) p++;
        if (*p != ',') continue;
        const char *comma = p++;
        while (gen_id_space(*p)) p++;
        if (!*p)
            return cli_fail(2, "--prompt-ids: \"%s\": the comma at character %zu has no token id after it "
                            "(ids are separated by spaces or one comma)", s, (size_t)(comma - s) + 1);
    }
    if (out->n == 0) return cli_fail(2, "--prompt-ids: no token ids in \"%s\"", s);
    return 0;
}

static void gen_add_stop(tok_ids *stops, int32_t id) {
    if (id < 0) return;
    for (size_t i = 0; i < stops->n; i++)
        if (stops->v[i] == id) return;
    tok_ids_push(stops, id);
}

/* eos_token_id (an int or a list of ints) of DIR/generation_config.json, or
 * of DIR/config.json when the former does not exist. */
static int gen_read_eos(const char *dir, tok_ids *stops, ct_err *e) {
    const char *file = gen_file_exists(dir, "generation_config.json") ? "generation_config.json" : "config.json";
    char *path = fs_join(dir, file);
    size_t len = 0;
    char *text = fs_read_file(path, 0, &len, e);
    if (!text) {
        free(path);
        return e->code;
    }
    cJSON *root = json_parse(text, len, path, e);
    free(text);
    int rc = root ? 0 : CT_ERR_FORMAT;
    if (root && !cJSON_IsObject(root)) rc = ct_fail(e, CT_ERR_FORMAT, "%s: not a valid JSON object", path);
    const cJSON *it = rc ? NULL : cJSON_GetObjectItemCaseSensitive(root, "eos_token_id");
    if (it && !cJSON_IsNull(it)) {
        const cJSON *one = NULL;
        int is_list = cJSON_IsArray(it);
        for (one = is_list ? it->child : it; one && !rc; one = is_list ? one->next : NULL) {
            if (!json_int_in(one, 0, INT32_MAX))
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"eos_token_id\" must be a token id or a list of them", path);
            else gen_add_stop(stops, (int32_t)one->valuedouble);
        }
    }
    cJSON_Delete(root);
    free(path);
    return rc;
}

typedef struct {
    const tok *t; /* NULL: print ids */
    int ids;
    tok_ids seen;   /* generated ids */
    size_t printed; /* ids [0, printed) are on stdout */
} gen_printer;

/* Prints the text of the ids not printed yet, as the difference between the
 * decode of a few earlier ids with and without them: a decoder is not always
 * a per-token concatenation (SentencePiece files strip the first space and
 * join <0xNN> byte tokens into characters), and this keeps the output equal
 * to decoding all ids at once. A character still being spelt in byte tokens
 * (the text ends in U+FFFD) waits for the next token unless `final`. */
static void gen_print_flush(gen_printer *p, int final) {
    size_t n = p->seen.n, lo = p->printed > 8 ? p->printed - 8 : 0;
    if (n == p->printed) return;
    char *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    tok_decode(p->t, p->seen.v + lo, p->printed - lo, 1, &a, &na);
    tok_decode(p->t, p->seen.v + lo, n - lo, 1, &b, &nb);
    int held = !final && nb >= 3 && !memcmp(b + nb - 3, "\xEF\xBF\xBD", 3);
    if (!held) {
        size_t k = 0; /* the common prefix: normally all of a */
        while (k < na && k < nb && a[k] == b[k]) k++;
        fwrite(b + k, 1, nb - k, stdout);
        fflush(stdout);
        p->printed = n;
    }
    free(a);
    free(b);
}

/* Streams one id, flushed right away so a user sees the text grow (special
 * tokens skipped); with --ids it is collected and printed at the end. */
static void gen_print_token(int32_t id, void *ctx) {
    gen_printer *p = ctx;
    if (p->ids) return;
    tok_ids_push(&p->seen, id);
    gen_print_flush(p, 0);
}

/* --chat: the prompt as one user turn, rendered with the tokenizer's own chat
 * template (tokenizer_config.json's chat_template or chat_template.jinja, as
 * apply_chat_template(add_generation_prompt=True) renders it); Qwen's ChatML
 * when the tokenizer has no template. */
static int gen_chat_text(const char *tdir, const char *prompt, const cJSON *kwargs, char **text, size_t *len,
                         ct_err *e) {
    jinja_chat *c = NULL;
    int rc = jinja_chat_open(tdir, &c, e);
    if (rc) return rc;
    if (!c && kwargs)
        return ct_fail(e, CT_ERR_CONFIG, "--chat-template-kwargs: %s has no chat template to pass them to", tdir);
    if (!c) {
        static const char pre[] = "<|im_start|>user\n", post[] = "<|im_end|>\n<|im_start|>assistant\n";
        *len = strlen(pre) + strlen(prompt) + strlen(post);
        *text = ct_malloc(*len + 1);
        snprintf(*text, *len + 1, "%s%s%s", pre, prompt, post);
        return 0;
    }
    cJSON *msgs = cJSON_CreateArray(), *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "role", "user");
    cJSON_AddStringToObject(m, "content", prompt);
    cJSON_AddItemToArray(msgs, m);
    rc = jinja_chat_apply_kw(c, msgs, 1, kwargs, text, len, NULL, e);
    cJSON_Delete(msgs);
    jinja_chat_close(c);
    return rc;
}

static int gen_run(gen_cli_args a);

int cli_generate(int argc, char **argv) {
    gen_cli_args a;
    int rc = gen_parse_args(&a, argc, argv);
    if (rc) return rc < 0 ? 0 : rc;
    rc = gen_run(a); /* its many early returns leave chat_kw to be freed here, once */
    cJSON_Delete(a.chat_kw);
    return rc;
}

/* The command after its options parsed. */
static int gen_run(gen_cli_args a) {
    int rc;
    /* the ids' syntax is the command line's: checked before a Hub id is downloaded */
    tok_ids prompt = {0}, stops = {0};
    if (a.prompt_ids) {
        rc = gen_parse_ids(a.prompt_ids, &prompt);
        tok_ids_free(&prompt);
        if (rc) return rc;
    }
    /* both names checked before either is downloaded: a missing path is a missing file
     * (1), a file where a directory belongs a bad value (2), as hub_resolve says */
    ct_err ne = {0};
    if ((rc = hub_check_name(a.checkpoint, HUB_CONFIG, &ne)))
        return cli_fail(ct_exit_code(rc), "--checkpoint: %s", ne.msg);
    if (a.tokenizer && (rc = hub_check_name(a.tokenizer, HUB_TOKENIZER, &ne)))
        return cli_fail(ct_exit_code(rc), "--tokenizer: %s", ne.msg);
    /* Hub ids -> the cache's snapshot directories (downloading what is missing) */
    hub_local ck_loc, tok_loc, ad_loc;
    ct_err he = {0};
    unsigned what = HUB_CONFIG | HUB_WEIGHTS | (a.tokenizer ? 0 : HUB_TOKENIZER_IF_ANY);
    if ((rc = hub_resolve(a.checkpoint, a.revision, what, &ck_loc, &he)) ||
        (a.tokenizer && (rc = hub_resolve(a.tokenizer, a.revision, HUB_TOKENIZER, &tok_loc, &he))))
        return cli_fail(ct_exit_code(rc), "%s", he.msg);
    if (a.adapter && !gen_is_dir(a.adapter) && hub_is_repo_id(a.adapter)) {
        if ((rc = hub_resolve(a.adapter, a.adapter_revision, HUB_ADAPTER, &ad_loc, &he)))
            return cli_fail(ct_exit_code(rc), "--adapter: %s", he.msg);
        a.adapter = ad_loc.dir;
    }
    a.checkpoint = ck_loc.dir;
    if (a.tokenizer) a.tokenizer = tok_loc.dir;
    if (a.prompt_ids) (void)gen_parse_ids(a.prompt_ids, &prompt); /* checked above */
    char adapter_hint[2 * 4096 + 1400];
    gen_adapter_hint(a.checkpoint, adapter_hint, sizeof adapter_hint);
    if (!gen_file_exists(a.checkpoint, "config.json")) {
        tok_ids_free(&prompt);
        return cli_fail(1, "%s/config.json: not found (--checkpoint must be a Hugging Face model directory)%s",
                        a.checkpoint, adapter_hint);
    }
    if (adapter_hint[0] && ckpt_dir_kind(a.checkpoint) == CKPT_DIR_CHECKPOINT) {
        /* a LoRA run's training checkpoint: config.json is the base's, the weights are the adapter's.
         * ckpt_dir_kind's rule: also one that lost its manifest (config.toml is a checkpoint's alone) */
        tok_ids_free(&prompt);
        return cli_fail(1, "%s: a LoRA run's training checkpoint holds no base weights%s", a.checkpoint,
                        adapter_hint);
    }

    ct_err e = {0};
    lm_config cfg;
    gen_model *gm = NULL;
    tok *t = NULL;
    int32_t *out = NULL;
    int n_out = 0;
    double t0 = ct_now();

    /* as in train: a value of config.json ctitan cannot build a model from exits 2, a
     * malformed file 3 (docs/reliability.md, "Exit codes") */
    rc = lm_config_from_hf(&cfg, a.checkpoint, &e);
    /* the tokenizer is needed to encode --prompt or to print text; with
     * --prompt-ids --ids it is only read, when present, for its end tokens */
    const char *tdir = a.tokenizer ? a.tokenizer : a.checkpoint;
    int have_tok = gen_file_exists(tdir, "tokenizer.json") || gen_file_exists(tdir, "vocab.json");
    int need_tok = a.prompt || !a.ids || a.tokenizer;
    if (!rc && need_tok && !have_tok) {
        rc = ct_fail(&e, CT_ERR_IO, "%s: no tokenizer.json (or vocab.json + merges.txt)%s", tdir,
                     a.prompt ? "; pass --tokenizer DIR, or --prompt-ids" : "; pass --tokenizer DIR, or --ids");
    }
    if (!rc && have_tok) rc = tok_load(tdir, &t, &e);
    if (!rc && t) {
        gen_add_stop(&stops, tok_eos_id(t));
        gen_add_stop(&stops, tok_token_id(t, "<|im_end|>"));
    }
    if (!rc) rc = gen_read_eos(a.checkpoint, &stops, &e);
    if (!rc && a.prompt) {
        char *text = NULL;
        size_t len = 0;
        if (a.chat) {
            rc = gen_chat_text(tdir, a.prompt, a.chat_kw, &text, &len, &e);
        } else {
            text = ct_strdup(a.prompt);
            len = strlen(text);
        }
        tok_enc *enc = rc ? NULL : tok_enc_new(t);
        /* a rendered template carries its own BOS: apply_chat_template tokenizes it with
         * add_special_tokens=False; a plain prompt gets the post-processor's tokens, as
         * tokenizer(prompt) gives them */
        if (enc && a.chat) tok_enc_set_add_special(enc, 0);
        if (!rc) rc = tok_encode(enc, text, len, &prompt, &e);
        if (enc) tok_enc_free(enc);
        free(text);
        if (!rc && prompt.n == 0) rc = ct_fail(&e, CT_ERR_CONFIG, "--prompt: the text encodes to no tokens");
    }
    /* a text prompt's ids come from the tokenizer: one past the vocabulary means it is
     * another model's tokenizer, which is what the user has to change */
    for (size_t i = 0; !rc && i < prompt.n; i++)
        if (prompt.v[i] >= cfg.vocab_size)
            rc = ct_fail(&e, CT_ERR_CONFIG, "%s: token id %d is outside the model's vocabulary [0, %d)%s%s%s",
                         a.prompt_ids ? "--prompt-ids" : "--prompt", (int)prompt.v[i], cfg.vocab_size,
                         a.prompt_ids ? "" : ": the tokenizer in ", a.prompt_ids ? "" : tdir,
                         a.prompt_ids ? "" : " is not this model's (give the model's own with --tokenizer DIR)");
    if (!rc && prompt.n + (size_t)a.max_tokens > (size_t)INT32_MAX)
        rc = ct_fail(&e, CT_ERR_CONFIG, "--max-tokens: %zu prompt tokens + %d new ones are too many positions",
                     prompt.n, a.max_tokens);
    /* transformers generates past the model's positions with at most a warning, but what
     * comes out there is what the model never saw, so ctitan stops (docs/generate.md);
     * train only warns past the same limit (trainer_warn_positions) */
    double limit = rc ? 0 : lm_position_limit(&cfg);
    if (!rc && limit > 0 && (double)(prompt.n + (size_t)a.max_tokens) > limit)
        rc = ct_fail(&e, CT_ERR_CONFIG,
                     "--max-tokens: %zu prompt tokens + %d new ones need %zu positions, more than the %.0f the model "
                     "was trained for (max_position_embeddings of %s/config.json%s)",
                     prompt.n, a.max_tokens, prompt.n + (size_t)a.max_tokens, limit, a.checkpoint,
                     limit > cfg.max_pos ? ", extended by its RoPE scaling factor" : "");
    if (!rc) rc = hf_gen_open(&gm, a.checkpoint, a.adapter, (int)prompt.n + a.max_tokens, &e);
    double t_load = ct_now();
    if (!rc) {
        gen_printer pr = {t, a.ids, {0}, 0};
        if (!a.ids) {
            fputs(a.prompt ? a.prompt : "", stdout);
            if (!a.prompt) { /* --prompt-ids with a tokenizer: show the prompt's text */
                char *s = NULL;
                size_t n = 0;
                tok_decode(t, prompt.v, prompt.n, 0, &s, &n);
                fwrite(s, 1, n, stdout);
                free(s);
            }
            if (a.chat) fputc('\n', stdout);
            fflush(stdout);
        }
        gen_opts o = {.max_tokens = a.max_tokens,
                      .sampler = {(float)a.temperature, a.top_k, (float)a.top_p},
                      .seed = a.seed,
                      .stop_ids = stops.v,
                      .n_stop = (int)stops.n};
        out = ct_malloc((size_t)a.max_tokens * sizeof *out);
        rc = gen_generate(gen_model_state(gm), prompt.v, (int)prompt.n, &o, out, &n_out, gen_print_token, &pr, &e);
        if (!a.ids) gen_print_flush(&pr, 1);
        tok_ids_free(&pr.seen);
        if (!rc && a.ids)
            for (int i = 0; i < n_out; i++) printf("%d%s", (int)out[i], i + 1 < n_out ? " " : "");
        if (!rc) printf("\n");
        fflush(stdout);
    }
    if (!rc) {
        double dt = ct_now() - t_load;
        fprintf(stderr, "generate: %zu prompt tokens, %d new tokens in %.2f s (%.1f tok/s), load %.2f s\n", prompt.n,
                n_out, dt, dt > 0 ? n_out / dt : 0.0, t_load - t0);
    }
    free(out);
    gen_model_close(gm);
    tok_free(t);
    tok_ids_free(&prompt);
    tok_ids_free(&stops);
    if (rc) {
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(rc);
    }
    return 0;
}
