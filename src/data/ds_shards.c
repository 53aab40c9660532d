/* data/ds_shards.c: writing a `ctitan prepare` shard directory.
 *
 * Layout (docs/data.md): shard-NNNNN.bin, raw little-endian uint32 tokens
 * (the host's order; every platform ctitan targets is little-endian), and
 * for chat data shard-NNNNN.mask, one byte per token (1 = trainable target).
 * Shards are cut every shard_tokens tokens regardless of document
 * boundaries: the loader concatenates them, so a document may straddle two.
 * Every file is written as NAME.tmp and renamed into place once complete and
 * synced (core/fs.h fs_atomic), meta.json last: a killed run leaves only
 * whole shards under their final names and no meta.json, which the loader
 * refuses as an interrupted prepare (dataset.c) instead of training on a
 * prefix of the data. */
#include "core/fs.h"
#include "data/dataset.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

struct ds_writer {
    char *dir;
    uint64_t shard_tokens;
    fs_atomic tf, mf;    /* the open shard's token and mask files (NAME.tmp until committed) */
    uint64_t cur_n;      /* tokens in the open shard */
    uint64_t *shard_n;   /* tokens per finished or open shard */
    int n_shards, cap;
    int masked;          /* -1 until the first chunk says */
    uint64_t total;
    int has_chat;        /* chat: the template the chat sources were rendered with */
    chat_tmpl_id chat;
    int loss_set;        /* ds_writer_loss was called: the two below go into meta.json */
    int assistant_only;  /* -1: it shaped no mask (null), else the option's value */
    int completion_only; /* the same */
};

static int is_ours(const char *name) {
    return !strcmp(name, "meta.json") || !strcmp(name, "meta.json.tmp") || !strncmp(name, "shard-", 6);
}

int ds_writer_open(ds_writer **out, const char *dir, uint64_t shard_tokens, int overwrite, ct_err *e) {
    *out = NULL;
    if (!dir || !*dir) return ct_fail(e, CT_ERR_CONFIG, "--out: no output directory given");
    if (!shard_tokens) return ct_fail(e, CT_ERR_CONFIG, "--shard-tokens: must be positive");
    if (ct_mkdirs(dir, e)) return e->code;
    DIR *d = opendir(dir);
    if (!d) return ct_fail(e, CT_ERR_IO, "%s: cannot list (%s)", dir, strerror(errno));
    struct dirent *de;
    int rc = 0;
    while ((de = readdir(d)) && !rc) {
        if (!is_ours(de->d_name)) continue;
        if (!overwrite) {
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "%s: already holds a prepared dataset (%s); pass --overwrite or choose another --out", dir,
                         de->d_name);
            break;
        }
        char *p = fs_join(dir, de->d_name);
        if (unlink(p) != 0) rc = ct_fail(e, CT_ERR_IO, "%s: cannot remove (%s)", p, strerror(errno));
        free(p);
    }
    closedir(d);
    if (rc) return rc;
    ds_writer *w = ct_calloc(1, sizeof *w);
    w->dir = ct_strdup(dir);
    w->shard_tokens = shard_tokens;
    w->masked = -1;
    w->assistant_only = w->completion_only = -1;
    *out = w;
    return 0;
}

/* Renames the open shard's files into place (the mask first, so a shard-NNNNN.bin
 * under its final name always has its mask beside it). */
static int close_shard(ds_writer *w, ct_err *e) {
    int rc = 0;
    if (w->mf.fp) rc = fs_atomic_commit(&w->mf, e);
    if (w->tf.fp) {
        if (rc) fs_atomic_abort(&w->tf);
        else rc = fs_atomic_commit(&w->tf, e);
    }
    return rc;
}

static int open_shard(ds_writer *w, ct_err *e) {
    if (w->n_shards == w->cap) {
        w->cap = w->cap ? w->cap * 2 : 16;
        uint64_t *p = realloc(w->shard_n, (size_t)w->cap * sizeof *p);
        if (!p) return ct_fail(e, CT_ERR_IO, "out of memory");
        w->shard_n = p;
    }
    int k = w->n_shards;
    char name[64];
    snprintf(name, sizeof name, "shard-%05d.bin", k);
    char *p = fs_join(w->dir, name);
    int rc = fs_atomic_open(&w->tf, p, e);
    free(p);
    if (!rc && w->masked == 1) {
        snprintf(name, sizeof name, "shard-%05d.mask", k);
        p = fs_join(w->dir, name);
        rc = fs_atomic_open(&w->mf, p, e);
        free(p);
    }
    if (rc) {
        fs_atomic_abort(&w->tf);
        return rc;
    }
    w->shard_n[w->n_shards++] = 0;
    w->cur_n = 0;
    return 0;
}

int ds_writer_sink(void *ctx, const uint32_t *ids, const uint8_t *mask, size_t n, ct_err *e) {
    ds_writer *w = ctx;
    if (w->masked < 0) w->masked = mask != NULL;
    if (w->masked != (mask != NULL)) return ct_fail(e, CT_ERR_IO, "%s: mask present in some chunks only", w->dir);
    while (n) {
        if (!w->tf.fp || w->cur_n == w->shard_tokens) {
            if (close_shard(w, e) || open_shard(w, e)) return e->code;
        }
        uint64_t room = w->shard_tokens - w->cur_n;
        size_t take = n < room ? n : (size_t)room;
        if (fwrite(ids, sizeof *ids, take, w->tf.fp) != take || (mask && fwrite(mask, 1, take, w->mf.fp) != take))
            return ct_fail(e, CT_ERR_IO, "%s: shard-%05d: write failed (%s)", w->dir, w->n_shards - 1,
                           strerror(errno));
        ids += take;
        if (mask) mask += take;
        n -= take;
        w->cur_n += take;
        w->shard_n[w->n_shards - 1] += take;
        w->total += take;
    }
    return 0;
}

int ds_writer_num_shards(const ds_writer *w) { return w->n_shards; }

void ds_writer_loss(ds_writer *w, const ds_tok_opts *o, const ds_progress *stats) {
    /* conversational prompt-completion data follows assistant_only_loss only
     * without completion_only_loss (chat_encode_pc) */
    int conv = stats->conversations || (stats->completions == 2 && !o->completion_only_loss);
    w->loss_set = 1;
    w->assistant_only = conv ? o->assistant_only_loss != 0 : -1;
    w->completion_only = stats->completions ? o->completion_only_loss != 0 : -1;
}

void ds_writer_chat_template(ds_writer *w, const chat_tmpl_id *id) {
    w->chat = *id;
    w->has_chat = 1;
}

int ds_writer_finish(ds_writer *w, const char *kind, const char *tokenizer_dir, int32_t eos_id, int32_t vocab_size,
                     const char *const *inputs, int n_inputs, const ds_progress *stats, ct_err *e) {
    if (close_shard(w, e)) return e->code;
    cJSON *m = cJSON_CreateObject();
    cJSON_AddStringToObject(m, "format", "ctitan-tokens");
    cJSON_AddNumberToObject(m, "version", 1);
    cJSON_AddStringToObject(m, "kind", kind ? kind : "");
    cJSON_AddStringToObject(m, "tokenizer", tokenizer_dir ? tokenizer_dir : "");
    cJSON_AddNumberToObject(m, "eos_id", eos_id);
    cJSON_AddNumberToObject(m, "vocab_size", vocab_size);
    cJSON_AddStringToObject(m, "dtype", "uint32");
    cJSON_AddNumberToObject(m, "total_tokens", (double)w->total);
    if (stats) {
        cJSON_AddNumberToObject(m, "trainable_tokens", (double)stats->trainable);
        cJSON_AddNumberToObject(m, "documents", (double)stats->docs);
        cJSON_AddNumberToObject(m, "skipped_documents", (double)stats->skipped);
        cJSON_AddNumberToObject(m, "input_bytes", (double)stats->bytes_total);
    }
    cJSON_AddBoolToObject(m, "masked", w->masked == 1);
    cJSON_AddNumberToObject(m, "shard_tokens", (double)w->shard_tokens);
    cJSON *sh = cJSON_AddArrayToObject(m, "shards");
    for (int k = 0; k < w->n_shards; k++) {
        char name[64];
        cJSON *o = cJSON_CreateObject();
        snprintf(name, sizeof name, "shard-%05d.bin", k);
        cJSON_AddStringToObject(o, "file", name);
        if (w->masked == 1) {
            snprintf(name, sizeof name, "shard-%05d.mask", k);
            cJSON_AddStringToObject(o, "mask", name);
        }
        cJSON_AddNumberToObject(o, "tokens", (double)w->shard_n[k]);
        cJSON_AddItemToArray(sh, o);
    }
    if (w->has_chat) {
        /* the trainer compares it with an explicit training.chat_template (dataset.c) */
        cJSON *ct = cJSON_AddObjectToObject(m, "chat_template");
        cJSON_AddStringToObject(ct, "mode", w->chat.mode);
        if (w->chat.path[0]) cJSON_AddStringToObject(ct, "path", w->chat.path);
        cJSON_AddStringToObject(ct, "template", w->chat.builtin ? "built-in ChatML" : w->chat.file);
        if (w->chat.builtin) cJSON_AddNullToObject(ct, "sha256");
        else cJSON_AddStringToObject(ct, "sha256", w->chat.sha256);
    }
    /* the trainer refuses another setting of these for this data (dataset.c); null:
     * the option shaped no mask here, so any setting trains it */
    for (int k = 0; w->loss_set && k < 2; k++) {
        int v = k ? w->completion_only : w->assistant_only;
        const char *key = k ? "completion_only_loss" : "assistant_only_loss";
        if (v < 0) cJSON_AddNullToObject(m, key);
        else cJSON_AddBoolToObject(m, key, v);
    }
    cJSON *in = cJSON_AddArrayToObject(m, "inputs");
    for (int i = 0; i < n_inputs; i++) cJSON_AddItemToArray(in, cJSON_CreateString(inputs[i]));
    char *text = cJSON_Print(m);
    cJSON_Delete(m);
    char *fin = fs_join(w->dir, "meta.json");
    int rc = fs_write_text(fin, text, e); /* meta.json.tmp, then the rename */
    free(text);
    free(fin);
    return rc;
}

void ds_writer_free(ds_writer *w) {
    if (!w) return;
    /* an unfinished shard is removed: only whole shards keep a final name */
    fs_atomic_abort(&w->tf);
    fs_atomic_abort(&w->mf);
    free(w->shard_n);
    free(w->dir);
    free(w);
}
