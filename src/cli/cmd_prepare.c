/* cli/cmd_prepare.c: `ctitan prepare`: tokenize a corpus into shards.
 *
 * Thin: arguments -> ds_tokenize (every core, deterministic order) ->
 * ds_writer (shard-NNNNN.bin / .mask + meta.json). Progress is core/progress.h's
 * (bytes of input read); one summary line follows at the end either way. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "core/err.h"
#include "core/progress.h"
#include "core/timer.h"
#include "data/dataset.h"
#include "hub/hub.h"
#include "tokenizer/tokenizer.h"

#define MAX_INPUTS 4096

static void cli_prepare_help(void) {
    printf("usage: ctitan prepare --tokenizer DIR --input PATH [--input PATH ...] --out DIR [options]\n\n"
           "Tokenizes text, JSONL or chat data into uint32 token shards that `ctitan train` reads\n"
           "as training.dataset_path = DIR. Every document is followed by EOS. Output is identical\n"
           "for any number of threads.\n\n"
           "  --tokenizer DIR          Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json),\n"
           "                           or a Hub id such as Qwen/Qwen3-0.6B (docs/hub.md)\n"
           "  --revision R             branch, tag or commit when --tokenizer is a Hub id (default main)\n"
           "  --input PATH             a source file, in order; repeat for more\n"
           "  --out DIR                output directory (created); meta.json is written last\n"
           "  --kind KIND              auto | text | jsonl | chat (default auto: by extension and first line)\n"
           "  --text-split HOW         text files: file | paragraph | line (default file: one document per file)\n"
           "  --text-field NAME        jsonl: field holding the text (default text; training reads it as\n"
           "                           training.text_field, TRL's dataset_text_field). A jsonl file\n"
           "                           whose first record has \"prompt\" is TRL's prompt-completion data\n"
           "                           (loss on the completion; docs/data.md)\n"
           "  --chat-template T        chat: auto | chatml | tokenizer | FILE.jinja | DIR (default auto: the\n"
           "                           tokenizer's own template unless it is ChatML or absent; docs/data.md)\n"
           "  --assistant-only-loss B  chat: true (default) the loss on the assistant replies only; false on\n"
           "                           every token of the conversation (TRL's default; training's\n"
           "                           training.assistant_only_loss must then agree; docs/data.md)\n"
           "  --completion-only-loss B prompt-completion: true (default, as TRL) the loss on the completion\n"
           "                           only; false on every token (training.completion_only_loss must agree)\n"
           "  --eos TOKEN              document separator (default: eos_token of tokenizer_config.json,\n"
           "                           else <|endoftext|>)\n"
           "  --encode-special-tokens  special tokens written in the data are tokenized as plain text\n"
           "  --threads N              threads (default: every core / OMP_NUM_THREADS)\n"
           "  --shard-tokens N         tokens per shard file (default 134217728 = 512 MiB)\n"
           "  --overwrite              replace a prepared dataset already in --out\n"
           "  --quiet                  no progress display, only the summary\n");
}

/* ------------------------------------------------------------ progress */

static void human(char *buf, size_t cap, double x) {
    const char *u[] = {"", "k", "M", "G", "T"};
    int i = 0;
    while (x >= 1000 && i < 4) x /= 1000, i++;
    snprintf(buf, cap, i ? "%.1f%s" : "%.0f%s", x, u[i]);
}

/* ds_progress_fn: bytes of input read drive the bar (core/progress.h); the
 * document and token rates ride along, as they are what a user sizes a run by. */
static void on_progress(void *ctx, const ds_progress *p, int final) {
    prog_bar *b = ctx;
    double dt = ct_now() - b->t0;
    char docs[32], toks[32];
    human(docs, sizeof docs, dt > 0 ? p->docs / dt : 0);
    human(toks, sizeof toks, dt > 0 ? p->tokens / dt : 0);
    snprintf(b->extra, sizeof b->extra, "%s%s docs/s, %s tok/s", b->mode == PROG_TTY ? "  " : ", ", docs, toks);
    b->total = (double)p->bytes_total;
    if (final) {
        b->done = (double)p->bytes_done;
        prog_end(b);
    } else {
        prog_update(b, (double)p->bytes_done);
    }
}

/* ------------------------------------------------------------ arguments */

typedef struct {
    const char *tokenizer, *out, *kind, *split, *field, *eos, *revision, *chat_template;
    int assistant_only, completion_only; /* the loss options (ds_tok_opts) */
    const char *inputs[MAX_INPUTS];
    int n_inputs, threads, overwrite, quiet, encode_special;
    long long shard_tokens;
} prep_args;

/* A usage error: message, hint, exit status 2. */
__attribute__((format(printf, 1, 2))) static int fail_usage(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ctitan: error: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (ctitan prepare --help)\n");
    va_end(ap);
    return 2;
}

static int parse_int(const char *s, long long lo, long long hi, long long *out) {
    char *end;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int parse_args(prep_args *a, int argc, char **argv) {
    memset(a, 0, sizeof *a);
    a->shard_tokens = 1LL << 27;
    a->assistant_only = a->completion_only = 1;
    for (int i = 0; i < argc; i++) {
        const char *arg = argv[i], *val = NULL;
        char name[64];
        if (strncmp(arg, "--", 2)) return fail_usage("unexpected argument \"%s\"", arg);
        const char *eq = strchr(arg, '=');
        size_t n = eq ? (size_t)(eq - arg) : strlen(arg);
        if (n >= sizeof name) return fail_usage("unknown option \"%s\"", arg);
        memcpy(name, arg, n);
        name[n] = 0;
        int flag = !strcmp(name, "--overwrite") || !strcmp(name, "--quiet") || !strcmp(name, "--encode-special-tokens");
        if (flag) {
            if (eq) return fail_usage("%s takes no value", name);
            if (!strcmp(name, "--overwrite")) a->overwrite = 1;
            else if (!strcmp(name, "--quiet")) a->quiet = 1;
            else a->encode_special = 1;
            continue;
        }
        if (eq) val = eq + 1;
        else if (i + 1 < argc) val = argv[++i];
        else return fail_usage("%s needs a value", name);
        long long v;
        if (!strcmp(name, "--tokenizer")) a->tokenizer = val;
        else if (!strcmp(name, "--out")) a->out = val;
        else if (!strcmp(name, "--kind")) a->kind = val;
        else if (!strcmp(name, "--text-split")) a->split = val;
        else if (!strcmp(name, "--text-field")) a->field = val;
        else if (!strcmp(name, "--eos")) a->eos = val;
        else if (!strcmp(name, "--revision")) a->revision = val;
        else if (!strcmp(name, "--chat-template")) a->chat_template = val;
        else if (!strcmp(name, "--assistant-only-loss") || !strcmp(name, "--completion-only-loss")) {
            int b = !strcmp(val, "true") ? 1 : !strcmp(val, "false") ? 0 : -1;
            if (b < 0) return fail_usage("%s: expected true or false, got \"%s\"", name, val);
            if (name[2] == 'a') a->assistant_only = b;
            else a->completion_only = b;
        } else if (!strcmp(name, "--input")) {
            if (a->n_inputs == MAX_INPUTS) return fail_usage("more than %d inputs", MAX_INPUTS);
            a->inputs[a->n_inputs++] = val;
        } else if (!strcmp(name, "--threads")) {
            if (parse_int(val, 1, 4096, &v)) return fail_usage("--threads: expected an integer in [1, 4096], got \"%s\"", val);
            a->threads = (int)v;
        } else if (!strcmp(name, "--shard-tokens")) {
            if (parse_int(val, 1, 1LL << 40, &v))
                return fail_usage("--shard-tokens: expected a positive integer, got \"%s\"", val);
            a->shard_tokens = v;
        } else {
            return fail_usage("unknown option \"%s\"", name);
        }
    }
    if (!a->tokenizer) return fail_usage("%s is required", "--tokenizer DIR");
    if (!a->n_inputs) return fail_usage("%s is required", "--input PATH");
    if (!a->out) return fail_usage("%s is required", "--out DIR");
    return 0;
}

/* The length of the shortest prefix of dir (at a '/') that does not exist:
 * the directories from there down are the ones ds_writer_open will create;
 * 0 when dir exists (nothing to create). */
static size_t prep_first_new(const char *dir) {
    struct stat st;
    if (stat(dir, &st) == 0) return 0;
    size_t n = strlen(dir);
    for (size_t i = 1; i < n; i++) {
        if (dir[i] != '/' || dir[i - 1] == '/') continue;
        char *p = strndup(dir, i);
        int there = p && stat(p, &st) == 0;
        free(p);
        if (!there) return i;
    }
    return n;
}

/* A failed prepare takes back the directories it created, where they are
 * still empty (whole shards it wrote stay: an interrupted prepare's, which
 * the loader refuses; docs/data.md), deepest first; a folder that was there
 * before is never touched. */
static void prep_remove_created(const char *dir, size_t first_new) {
    if (!first_new) return;
    char *p = strdup(dir);
    if (!p) return;
    size_t n = strlen(p);
    while (n > 1 && p[n - 1] == '/') p[--n] = 0;
    while (n >= first_new && n > 0) {
        if (rmdir(p) != 0) break; /* not empty, or not ours to remove */
        while (n > 0 && p[n - 1] != '/') n--;
        while (n > 1 && p[n - 1] == '/') n--;
        p[n] = 0;
    }
    free(p);
}

int cli_prepare(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            cli_prepare_help();
            return 0;
        }
    prep_args a;
    int rc = parse_args(&a, argc, argv);
    if (rc) return rc;
    ds_tok_opts o;
    ds_tok_opts_default(&o);
    if (a.kind && (ds_kind_parse(a.kind, &o.kind) || o.kind == DS_KIND_TOKENS))
        return fail_usage("--kind: expected auto, text, jsonl or chat, got \"%s\"", a.kind);
    if (a.split && ds_split_parse(a.split, &o.text_split))
        return fail_usage("--text-split: expected file, paragraph or line, got \"%s\"", a.split);
    o.text_field = a.field;
    o.threads = a.threads;
    o.encode_special = a.encode_special;
    o.assistant_only_loss = a.assistant_only;
    o.completion_only_loss = a.completion_only;

    ct_err e = {0};
    tok *t = NULL;
    ds_writer *w = NULL;
    /* the kind recorded in meta.json: the one shared by every input, else "mixed" */
    const char *kind = NULL;
    int has_chat = 0;
    for (int i = 0; i < a.n_inputs && !rc; i++) {
        ds_kind k = o.kind;
        if (k == DS_KIND_AUTO) rc = ds_detect_kind(a.inputs[i], &k, &e);
        struct stat st; /* an empty directory read "already tokenized": say what it is */
        if (!rc && k == DS_KIND_TOKENS)
            rc = ct_fail(&e, CT_ERR_CONFIG, "%s: %s (--input takes text, JSONL or chat files)", a.inputs[i],
                         stat(a.inputs[i], &st) == 0 && S_ISDIR(st.st_mode) ? "a directory" : "already tokenized");
        if (!rc) kind = !kind || !strcmp(kind, ds_kind_name(k)) ? ds_kind_name(k) : "mixed";
        if (!rc && k == DS_KIND_CHAT) has_chat = 1;
    }
    /* a Hub id -> its snapshot in the cache (meta.json records the id) */
    hub_local loc;
    const char *tok_src = a.tokenizer;
    if (!rc && hub_is_repo_id(a.tokenizer) && access(a.tokenizer, F_OK) != 0 &&
        !(rc = hub_resolve(a.tokenizer, a.revision, HUB_TOKENIZER, &loc, &e)))
        a.tokenizer = loc.dir;
    if (!rc) rc = tok_load(a.tokenizer, &t, &e);
    o.chat_template = a.chat_template;
    o.tokenizer_dir = a.tokenizer;
    if (!rc && a.eos) {
        o.eos_id = tok_token_id(t, a.eos);
        if (o.eos_id < 0) rc = ct_fail(&e, CT_ERR_CONFIG, "--eos: %s is not a token of %s", a.eos, a.tokenizer);
    }
    size_t first_new = rc ? 0 : prep_first_new(a.out);
    if (!rc) rc = ds_writer_open(&w, a.out, (uint64_t)a.shard_tokens, a.overwrite, &e);
    /* meta.json records the template the chat sources are rendered with (the
     * same resolution ds_tokenize makes), so that a trainer naming another
     * one for this data is told rather than silently ignored */
    if (!rc && has_chat) {
        chat_tmpl_id *chat_id = ct_calloc(1, sizeof *chat_id);
        if (!(rc = chat_tmpl_identify(o.chat_template, o.tokenizer_dir, chat_id, &e))) ds_writer_chat_template(w, chat_id);
        free(chat_id);
    }
    ds_progress st = {0};
    double t0 = ct_now();
    if (!rc) {
        prog_bar v;
        prog_begin(&v, "prepare", 0, "B", 0);
        if (a.quiet) v.mode = PROG_OFF;
        rc = ds_tokenize(a.inputs, a.n_inputs, t, &o, ds_writer_sink, w, on_progress, &v, &st, &e);
        prog_break(&v);
    }
    if (!rc) ds_writer_loss(w, &o, &st);
    int32_t eos = o.eos_id;
    if (!rc && eos < 0) eos = tok_eos_id(t);
    if (!rc && eos < 0) eos = tok_token_id(t, "<|endoftext|>");
    /* meta.json records where the tokenizer was, absolute so it still
     * means something when read from another directory */
    char *tokdir = rc || tok_src != a.tokenizer ? NULL : realpath(a.tokenizer, NULL);
    if (!rc) rc = ds_writer_finish(w, kind, tokdir ? tokdir : tok_src, eos, tok_vocab_size(t), a.inputs, a.n_inputs, &st, &e);
    if (!rc) {
        double dt = ct_now() - t0;
        char docs[32], toks[32];
        human(docs, sizeof docs, dt > 0 ? st.docs / dt : 0);
        human(toks, sizeof toks, dt > 0 ? st.tokens / dt : 0);
        fprintf(stderr,
                "ctitan: prepare: %llu documents (%llu empty skipped), %llu tokens (%llu trainable) from %.2f MB in "
                "%.1f s: %s docs/s, %s tok/s, %.2f MB/s on %d threads -> %d shard(s) in %s\n",
                (unsigned long long)st.docs, (unsigned long long)st.skipped, (unsigned long long)st.tokens,
                (unsigned long long)st.trainable, st.bytes_total / 1e6, dt, docs, toks,
                dt > 0 ? st.bytes_total / dt / 1e6 : 0.0, st.threads, ds_writer_num_shards(w), a.out);
    }
    free(tokdir);
    ds_writer_free(w);
    if (t) tok_free(t);
    if (rc) {
        prep_remove_created(a.out, first_new);
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(rc);
    }
    return 0;
}
