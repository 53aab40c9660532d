/* data/dataset.c: the loader: sources -> one token stream -> windows.
 *
 * The stream is a list of segments, one per tokens file (mapped `.bin`,
 * read `.npy`) or per run of consecutive text sources (tokenized into
 * memory). A window is found by its global token offset with a binary
 * search over the segments, so windows may straddle shard boundaries just
 * as documents do. Nothing is allocated per batch. */
#include "data/dataset.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "core/fs.h"
#include "formats/json.h"
#include "core/rng.h"
#include "core/timer.h"
#include "formats/npy.h"

typedef struct {
    char *name;            /* file, or "tokenized <source>" for text */
    const uint32_t *tok;   /* [n] */
    const uint8_t *mask;   /* [n] or NULL (all trainable) */
    uint64_t n, start;     /* start: offset of tok[0] in the stream */
    void *maps[2];         /* mappings to undo */
    size_t map_len[2];
    void *owned[2];        /* allocations to free */
    int tokenized;         /* produced here from text with the given tokenizer */
} ds_seg;

struct ds {
    ds_config cfg;
    ds_seg *segs;
    int n_segs, cap_segs;
    uint64_t n_tokens, n_windows;
    int has_mask;
    int rank, world;
    uint64_t *order; /* this epoch's permutation, NULL without shuffling */
    int64_t epoch, pos;
    char name[512];
    tok *own_tok;   /* loaded from cfg.tokenizer_dir during open */
    uint32_t *wtok; /* one window, gathered */
    uint8_t *wmask;
};

void ds_config_default(ds_config *c) {
    memset(c, 0, sizeof *c);
    c->seq_len = 2048;
    c->world = 1;
    ds_tok_opts_default(&c->tok);
}

/* ------------------------------------------------------------ segments */

static ds_seg *new_seg(ds *d, const char *name) {
    if (d->n_segs == d->cap_segs) {
        d->cap_segs = d->cap_segs ? d->cap_segs * 2 : 8;
        ds_seg *p = realloc(d->segs, (size_t)d->cap_segs * sizeof *p);
        if (!p) {
            fprintf(stderr, "ctitan: error: out of memory listing data segments\n");
            exit(1);
        }
        d->segs = p;
    }
    ds_seg *s = &d->segs[d->n_segs++];
    memset(s, 0, sizeof *s);
    s->name = ct_strdup(name);
    return s;
}

static void free_seg(ds_seg *s) {
    for (int i = 0; i < 2; i++) {
        if (s->maps[i]) munmap(s->maps[i], s->map_len[i]);
        free(s->owned[i]);
    }
    free(s->name);
}

/* Maps `path` (read-only) and checks its size is `elem` * count (count
 * returned); an empty file maps to nothing. */
static int map_exact(const char *path, size_t elem, void **map, size_t *len, uint64_t *count, ct_err *e) {
    *map = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY);
    if (fd < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot open (%s)", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return ct_fail(e, CT_ERR_IO, "%s: not a regular file", path);
    }
    if (st.st_size % (off_t)elem) {
        close(fd);
        return ct_fail(e, CT_ERR_FORMAT, "%s: size %lld is not a multiple of %zu (expected raw little-endian %s)", path,
                       (long long)st.st_size, elem, elem == 4 ? "uint32 tokens" : "uint8 mask bytes");
    }
    *count = (uint64_t)st.st_size / elem;
    if (st.st_size) {
        void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return ct_fail(e, CT_ERR_IO, "%s: cannot map (%s)", path, strerror(errno));
        }
        *map = p;
        *len = (size_t)st.st_size;
    }
    close(fd);
    return 0;
}

static int has_ext(const char *path, const char *ext) {
    size_t a = strlen(path), b = strlen(ext);
    return a >= b && !strcasecmp(path + a - b, ext);
}

/* One token file (and its mask file, or NULL). */
static int add_token_file(ds *d, const char *path, const char *mask_path, ct_err *e) {
    ds_seg *s = new_seg(d, path);
    int rc;
    if (has_ext(path, ".npy")) {
        uint32_t *v;
        size_t n;
        if ((rc = npy_read_u32(path, &v, &n, e))) return rc;
        s->owned[0] = v;
        s->tok = v;
        s->n = n;
    } else {
        if ((rc = map_exact(path, 4, &s->maps[0], &s->map_len[0], &s->n, e))) return rc;
        s->tok = s->maps[0];
    }
    if (mask_path) {
        uint64_t m;
        if ((rc = map_exact(mask_path, 1, &s->maps[1], &s->map_len[1], &m, e))) return rc;
        if (m != s->n)
            return ct_fail(e, CT_ERR_FORMAT, "%s: %llu mask bytes for %llu tokens in %s", mask_path,
                           (unsigned long long)m, (unsigned long long)s->n, path);
        s->mask = s->maps[1];
        d->has_mask = 1;
    }
    return 0;
}

/* A prepared dataset's tokens and masks follow the chat template `ctitan
 * prepare` rendered it with (meta.json's "chat_template"); a template named
 * at train time is not applied to them. So when the trainer names one
 * explicitly (anything but "auto", the default) and it is not the recorded
 * one (compared by what each resolves to: the built-in ChatML, or the
 * template text's sha256), refuse rather than train on data the user
 * believes rendered otherwise. Data without the record (no chat source, or
 * prepared before it existed) has nothing to compare. */
static int check_chat_template(const ds *d, const cJSON *rec, const char *meta, ct_err *e) {
    const char *spec = d->cfg.tok.chat_template;
    if (!rec || !spec || !spec[0] || !strcmp(spec, "auto")) return 0;
    const cJSON *mode = cJSON_GetObjectItemCaseSensitive(rec, "mode");
    const cJSON *tmpl = cJSON_GetObjectItemCaseSensitive(rec, "template");
    const cJSON *sha = cJSON_GetObjectItemCaseSensitive(rec, "sha256");
    const cJSON *path = cJSON_GetObjectItemCaseSensitive(rec, "path");
    if (!cJSON_IsObject(rec) || !cJSON_IsString(mode) || !cJSON_IsString(tmpl) ||
        !(cJSON_IsString(sha) || cJSON_IsNull(sha)))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: chat_template: expected {\"mode\": ..., \"template\": ..., \"sha256\": hex or null}", meta);
    chat_tmpl_id *id = ct_calloc(2, sizeof *id), *rid = id + 1; /* the run's, the record's */
    rid->builtin = cJSON_IsNull(sha);
    if (!rid->builtin) {
        snprintf(rid->file, sizeof rid->file, "%s", tmpl->valuestring);
        snprintf(rid->sha256, sizeof rid->sha256, "%s", sha->valuestring);
    }
    int rc = chat_tmpl_identify(spec, d->cfg.tok.tokenizer_dir, id, e);
    int same = !rc && (rid->builtin ? id->builtin : !id->builtin && !strcmp(id->sha256, sha->valuestring));
    if (!rc && !same) {
        char want[4600], had[4600];
        chat_tmpl_id_describe(id, want, sizeof want);
        chat_tmpl_id_describe(rid, had, sizeof had);
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "training.chat_template = \"%s\" renders with %s, but %s was prepared with chat template "
                     "\"%s\", which rendered with %s: prepared tokens and masks keep the template they were made "
                     "with; prepare the data again with --chat-template %s, or leave training.chat_template unset",
                     spec, want, meta, cJSON_IsString(path) ? path->valuestring : mode->valuestring, had, spec);
    }
    free(id);
    return rc;
}

/* A prepared dataset's masks follow the loss options `ctitan prepare` built them with
 * (meta.json's "assistant_only_loss" and "completion_only_loss"; null where an option
 * shaped no mask). A training config that asks otherwise is refused, as a different
 * chat template is: the masks would silently not follow it. Data prepared before the
 * record existed was masked as both options' defaults (true) mask: its conversations
 * (a chat_template record) on the assistant replies, its string prompt-completion data
 * (masked without a chat template) on the completion. */
static int check_loss_options(const ds *d, const cJSON *j, const char *meta, ct_err *e) {
    const cJSON *masked = cJSON_GetObjectItemCaseSensitive(j, "masked");
    int chat = cJSON_GetObjectItemCaseSensitive(j, "chat_template") != NULL;
    for (int k = 0; k < 2; k++) {
        const char *key = k ? "completion_only_loss" : "assistant_only_loss";
        const char *flag = k ? "--completion-only-loss" : "--assistant-only-loss";
        int want = k ? d->cfg.tok.completion_only_loss : d->cfg.tok.assistant_only_loss;
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
        int had, old = !v;
        if (!v) {
            if (!cJSON_IsTrue(masked) || (k ? chat : !chat)) continue;
            had = 1;
        } else if (cJSON_IsNull(v)) {
            continue;
        } else if (cJSON_IsBool(v)) {
            had = cJSON_IsTrue(v);
        } else {
            return ct_fail(e, CT_ERR_FORMAT, "%s: %s: expected true, false or null", meta, key);
        }
        if (!want == !had) continue;
        return ct_fail(e, CT_ERR_CONFIG,
                       "training.%s = %s, but %s was prepared with %s = %s%s: prepared masks keep the targets "
                       "they were made with; prepare the data again with %s %s, or set training.%s = %s",
                       key, want ? "true" : "false", meta, key, had ? "true" : "false",
                       old ? " (prepared before the option was recorded, when it always was)" : "", flag,
                       want ? "true" : "false", key, had ? "true" : "false");
    }
    return 0;
}

/* A chat template named (not "auto") for data that turned out to hold no chat
 * data: no token masked out of the loss, so the template shaped nothing. The
 * tokenizer's pass (ds_source.c) already says so of text it tokenized; this
 * covers token files and prepared text shards, and shares its note
 * (ds_tok_opts.template_seen), so a run says it once and not of its text
 * validation data beside chat training data. */
static void note_unused_template(const ds *d, const ds_tok_opts *o) {
    const char *spec = o->chat_template;
    int *seen = o->template_seen;
    if (!spec || !spec[0] || !strcmp(spec, "auto") || (seen && *seen)) return;
    if (seen) *seen = 1;
    if (!d->has_mask)
        fprintf(stderr,
                "ctitan: warning: chat template \"%s\" is not applied to %s: it holds no chat data (no token is "
                "masked out of the loss), and only chat data is rendered with a template\n",
                spec, d->name);
}

/* meta.json's count KEY, when present: a non-negative integer (*has = 1), else
 * a format error naming the key. Absent (a hand-written meta.json) is *has = 0. */
static int meta_count(const cJSON *j, const char *key, const char *meta, uint64_t *out, int *has, ct_err *e) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    *has = 0;
    *out = 0;
    if (!v || cJSON_IsNull(v)) return 0;
    /* 2^53: the largest count a JSON number holds exactly; written as prepare
     * writes it (5, not 5.0), as a manifest's counts must be */
    if (!json_integer_in(v, 0, 9007199254740992.0))
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s: expected a non-negative integer", meta, key);
    *out = (uint64_t)v->valuedouble;
    *has = 1;
    return 0;
}

/* The tokenizer meta.json records (its vocab_size) must fit the model
 * (c->vocab_size, when the caller knows it), and the token ids it records
 * (eos_id, and bos_id / pad_id if a writer adds them) must be ids of both:
 * an id outside them means the file was edited or belongs to other data.
 * The tokens themselves are checked by check_vocab. */
static int check_meta_ids(const ds *d, const cJSON *j, const char *meta, ct_err *e) {
    uint64_t vocab;
    int has_vocab, rc = meta_count(j, "vocab_size", meta, &vocab, &has_vocab, e);
    /* the trainer refuses a tokenizer larger than the model for text data
     * (trainer.c); data prepared with one is the same mistake */
    if (!rc && has_vocab && d->cfg.vocab_size > 0 && vocab > (uint64_t)d->cfg.vocab_size)
        rc = ct_fail(e, CT_ERR_FORMAT,
                     "%s: vocab_size is %llu, larger than the model's vocabulary (size %d): prepared with another "
                     "tokenizer?",
                     meta, (unsigned long long)vocab, d->cfg.vocab_size);
    static const char *const keys[] = {"eos_id", "bos_id", "pad_id"};
    for (size_t i = 0; i < sizeof keys / sizeof *keys && !rc; i++) {
        uint64_t id;
        int has;
        if ((rc = meta_count(j, keys[i], meta, &id, &has, e)) || !has) continue;
        if (has_vocab && id >= vocab)
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: %s is %llu, outside its own vocab_size %llu", meta, keys[i],
                         (unsigned long long)id, (unsigned long long)vocab);
        else if (d->cfg.vocab_size > 0 && id >= (uint64_t)d->cfg.vocab_size)
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: %s is %llu, outside the model's vocabulary (size %d)", meta, keys[i],
                         (unsigned long long)id, d->cfg.vocab_size);
    }
    return rc;
}

/* After the shards are mapped (each already equal to its own count): the
 * totals meta.json records must agree with them. total_tokens is what
 * prepare's summary and anyone sizing a run reads; a disagreement means the
 * shard list or the files were edited or mixed with another prepare's, so
 * the directory is not the data it claims to be. "masked" must agree with
 * the shards listing masks, or the loss mask of chat data could silently
 * vanish. */
static int check_meta_totals(const ds *d, int first_seg, int n_masks, const cJSON *j, const char *meta, ct_err *e) {
    uint64_t held = 0, total, trainable;
    int has_total, has_trainable, n = d->n_segs - first_seg;
    for (int i = first_seg; i < d->n_segs; i++) held += d->segs[i].n;
    const cJSON *masked = cJSON_GetObjectItemCaseSensitive(j, "masked");
    int rc = 0;
    if (masked && !cJSON_IsBool(masked))
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: masked: expected true or false", meta);
    else if (cJSON_IsTrue(masked) && n_masks != n)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: masked is true, but %d of its %d shard(s) list no \"mask\" file", meta,
                     n - n_masks, n);
    else if (cJSON_IsFalse(masked) && n_masks)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: masked is false, but %d of its %d shard(s) list a \"mask\" file", meta,
                     n_masks, n);
    if (!rc) rc = meta_count(j, "total_tokens", meta, &total, &has_total, e);
    if (!rc && has_total && total != held)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: total_tokens is %llu, but its %d shard(s) hold %llu tokens", meta,
                     (unsigned long long)total, n, (unsigned long long)held);
    if (!rc) rc = meta_count(j, "trainable_tokens", meta, &trainable, &has_trainable, e);
    if (!rc && has_trainable && trainable > held)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: trainable_tokens is %llu, more than the %llu tokens its shards hold", meta,
                     (unsigned long long)trainable, (unsigned long long)held);
    return rc;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* A token or mask file in a meta.json directory that meta.json does not
 * list would be skipped without a word: a shard copied in by hand, or one
 * left from another dataset, is data the user believes is trained on.
 * Refused, naming the first such file (by name, so the message does not
 * depend on readdir's order). listed holds the n names meta.json gives. */
static int check_unlisted(const char *dir, const char *meta, char **listed, int n, ct_err *e) {
    if (n) qsort(listed, (size_t)n, sizeof *listed, cmp_str);
    DIR *dh = opendir(dir);
    if (!dh) return ct_fail(e, CT_ERR_IO, "%s: cannot list (%s)", dir, strerror(errno));
    char first[256] = "";
    struct dirent *de;
    while ((de = readdir(dh))) {
        const char *nm = de->d_name;
        if (!has_ext(nm, ".bin") && !has_ext(nm, ".npy") && !has_ext(nm, ".mask")) continue;
        int found = n && bsearch(&nm, listed, (size_t)n, sizeof *listed, cmp_str);
        if (!found && (!first[0] || strcmp(nm, first) < 0)) snprintf(first, sizeof first, "%s", nm);
    }
    closedir(dh);
    if (!first[0]) return 0;
    return ct_fail(e, CT_ERR_FORMAT,
                   "%s: %s is not listed in %s, so it would not be read; remove it, or run `ctitan "
                   "prepare` again to make a dataset that includes it",
                   dir, first, meta);
}

/* The shards of a meta.json, in its order, each checked against its count. */
static int add_meta_dir(ds *d, const char *dir, const char *meta, ct_err *e) {
    size_t got;
    char *text = fs_read_file(meta, (size_t)1 << 30, &got, e);
    if (!text) return e ? e->code : CT_ERR_IO;
    cJSON *j = json_parse(text, got, meta, e);
    free(text);
    if (!j) return CT_ERR_FORMAT;
    int rc = 0;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(j, "format");
    const cJSON *shards = cJSON_GetObjectItemCaseSensitive(j, "shards"), *it;
    if (!cJSON_IsObject(j))
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: not a JSON object", meta);
    else if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "ctitan-tokens"))
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: format: expected \"ctitan-tokens\"", meta);
    else if (!cJSON_IsArray(shards))
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: shards: expected a list", meta);
    else if (!(rc = check_meta_ids(d, j, meta, e)))
        rc = check_chat_template(d, cJSON_GetObjectItemCaseSensitive(j, "chat_template"), meta, e);
    if (!rc) rc = check_loss_options(d, j, meta, e);
    int k = 0, n_masks = 0, first_seg = d->n_segs, n_listed = 0;
    const cJSON *list = rc ? NULL : shards;
    char **listed = list ? ct_malloc(2 * (size_t)(cJSON_GetArraySize(list) + 1) * sizeof *listed) : NULL;
    cJSON_ArrayForEach(it, list) {
        const cJSON *file = cJSON_GetObjectItemCaseSensitive(it, "file");
        const cJSON *mask = cJSON_GetObjectItemCaseSensitive(it, "mask");
        const cJSON *n = cJSON_GetObjectItemCaseSensitive(it, "tokens");
        if (!cJSON_IsString(file) || strchr(file->valuestring, '/') || (mask && !cJSON_IsString(mask)) ||
            (mask && strchr(mask->valuestring, '/')) || !json_is_integer(n) || n->valuedouble < 0) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: shards[%d]: expected {\"file\": name, \"tokens\": count[, \"mask\": name]}",
                         meta, k);
            break;
        }
        char *fp = fs_join(dir, file->valuestring), *mp = mask ? fs_join(dir, mask->valuestring) : NULL;
        rc = add_token_file(d, fp, mp, e);
        if (!rc && (double)d->segs[d->n_segs - 1].n != n->valuedouble)
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: holds %llu tokens, %s says %.0f (truncated or replaced?)", fp,
                         (unsigned long long)d->segs[d->n_segs - 1].n, meta, n->valuedouble);
        free(fp);
        free(mp);
        if (rc) break;
        listed[n_listed++] = file->valuestring;
        if (mask) listed[n_listed++] = mask->valuestring;
        n_masks += mask != NULL;
        k++;
    }
    if (!rc) rc = check_meta_totals(d, first_seg, n_masks, j, meta, e);
    if (!rc) rc = check_unlisted(dir, meta, listed, n_listed, e);
    free(listed);
    cJSON_Delete(j);
    return rc;
}

/* A name `ctitan prepare` writes besides meta.json (ds_shards.c):
 * shard-<digits>.bin / .mask, the same with .tmp (not yet renamed into
 * place), or meta.json.tmp. */
static int is_prepare_name(const char *name) {
    if (!strcmp(name, "meta.json.tmp")) return 1;
    if (strncmp(name, "shard-", 6)) return 0;
    const char *p = name + 6, *q = p;
    while (*q >= '0' && *q <= '9') q++;
    if (q == p) return 0;
    return !strcmp(q, ".bin") || !strcmp(q, ".mask") || !strcmp(q, ".bin.tmp") || !strcmp(q, ".mask.tmp");
}

/* A directory: meta.json when present, else every .bin/.npy by name.
 * prepare writes meta.json last, so its shard files without one are an
 * interrupted run: some of the shards only (and from a writer older than
 * the rename into place, a last one cut mid-write), refused rather than
 * trained on as a silent prefix of the data. Token files under other names
 * are a plain collection and are read in name order. */
static int add_dir(ds *d, const char *dir, ct_err *e) {
    char *meta = fs_join(dir, "meta.json");
    struct stat st;
    if (stat(meta, &st) == 0) {
        int rc = add_meta_dir(d, dir, meta, e);
        free(meta);
        return rc;
    }
    free(meta);
    DIR *dh = opendir(dir);
    if (!dh) return ct_fail(e, CT_ERR_IO, "%s: cannot list (%s)", dir, strerror(errno));
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    char prep[256] = "";
    while ((de = readdir(dh))) {
        /* the smallest such name, so the message does not depend on readdir's order */
        if (is_prepare_name(de->d_name) && (!prep[0] || strcmp(de->d_name, prep) < 0))
            snprintf(prep, sizeof prep, "%s", de->d_name);
        if (!has_ext(de->d_name, ".bin") && !has_ext(de->d_name, ".npy")) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            char **p = realloc(names, cap * sizeof *p);
            if (!p) {
                fprintf(stderr, "ctitan: error: out of memory listing %s\n", dir);
                exit(1);
            }
            names = p;
        }
        names[n++] = ct_strdup(de->d_name);
    }
    closedir(dh);
    int rc = 0;
    if (prep[0])
        rc = ct_fail(e, CT_ERR_FORMAT,
                     "%s: holds `ctitan prepare` shards (%s) but no meta.json, which prepare writes last: this looks "
                     "like an interrupted `ctitan prepare`; run it again (--overwrite) to finish the dataset",
                     dir, prep);
    else if (!n)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: no meta.json and no .bin/.npy token shards in it", dir);
    if (n) qsort(names, n, sizeof *names, cmp_str); /* names is NULL when n == 0: qsort's pointer is nonnull */
    for (size_t i = 0; i < n; i++) {
        if (!rc) {
            char *fp = fs_join(dir, names[i]);
            /* shard-00000.bin pairs with shard-00000.mask */
            char *mp = ct_malloc(strlen(fp) + 6);
            strcpy(mp, fp);
            strcpy(strrchr(mp, '.'), ".mask");
            int has_mask = stat(mp, &st) == 0;
            rc = add_token_file(d, fp, has_mask ? mp : NULL, e);
            free(fp);
            free(mp);
        }
        free(names[i]);
    }
    free(names);
    return rc;
}

/* Growable in-memory segment fed by ds_tokenize. */
typedef struct {
    uint32_t *tok;
    uint8_t *mask;
    size_t n, cap;
} mem_sink;

static int mem_sink_fn(void *ctx, const uint32_t *ids, const uint8_t *mask, size_t n, ct_err *e) {
    (void)e;
    mem_sink *m = ctx;
    if (m->n + n > m->cap) {
        size_t cap = m->cap ? m->cap : 1 << 16;
        while (cap < m->n + n) cap *= 2;
        uint32_t *t = realloc(m->tok, cap * sizeof *t);
        if (!t) return ct_fail(e, CT_ERR_IO, "out of memory holding %zu tokens", cap);
        m->tok = t;
        if (mask || m->mask) {
            uint8_t *k = realloc(m->mask, cap);
            if (!k) return ct_fail(e, CT_ERR_IO, "out of memory holding %zu mask bytes", cap);
            m->mask = k;
        }
        m->cap = cap;
    }
    memcpy(m->tok + m->n, ids, n * sizeof *ids);
    if (mask) memcpy(m->mask + m->n, mask, n);
    m->n += n;
    return 0;
}

static int add_text_run(ds *d, const char *const *paths, int n, const tok *t, ct_err *e) {
    char name[600];
    snprintf(name, sizeof name, "%s%s (tokenized)", paths[0], n > 1 ? " and following text sources" : "");
    if (!t && !d->own_tok && d->cfg.tokenizer_dir && d->cfg.tokenizer_dir[0]) {
        int rc = tok_load(d->cfg.tokenizer_dir, &d->own_tok, e);
        if (rc) return rc;
    }
    if (!t) t = d->own_tok;
    if (!t)
        return ct_fail(e, CT_ERR_CONFIG,
                       "%s: text data needs a tokenizer (a directory with tokenizer.json), and none was given",
                       paths[0]);
    mem_sink m = {0};
    ds_progress st;
    double t0 = ct_now();
    ds_tok_opts o = d->cfg.tok;
    if (!o.tokenizer_dir) o.tokenizer_dir = d->cfg.tokenizer_dir; /* where "auto" finds the chat template */
    int rc = ds_tokenize(paths, n, t, &o, mem_sink_fn, &m, NULL, NULL, &st, e);
    ds_seg *s = new_seg(d, name);
    s->owned[0] = m.tok;
    s->owned[1] = m.mask;
    s->tok = m.tok;
    s->mask = m.mask;
    s->n = m.n;
    s->tokenized = 1;
    if (m.mask) d->has_mask = 1;
    if (!rc && !d->cfg.quiet)
        fprintf(stderr, "ctitan: data: tokenized %s: %llu documents, %llu tokens (%llu trainable) in %.1f s on %d threads\n",
                paths[0], (unsigned long long)st.docs, (unsigned long long)st.tokens,
                (unsigned long long)st.trainable, ct_now() - t0, st.threads);
    return rc;
}

/* ------------------------------------------------------------ order */

/* Uniform in [0, bound): rejection removes the modulo bias, so the
 * permutation is exactly uniform and still a pure function of the seed. */
static uint64_t below(ct_rng *r, uint64_t bound) {
    uint64_t threshold = (0 - bound) % bound;
    for (;;) {
        uint64_t x = ct_rng_u64(r);
        if (x >= threshold) return x % bound;
    }
}

static void make_order(ds *d) {
    if (!d->order) return;
    for (uint64_t i = 0; i < d->n_windows; i++) d->order[i] = i;
    ct_rng r;
    ct_rng_seed(&r, d->cfg.seed + (uint64_t)d->epoch);
    for (uint64_t i = d->n_windows; i > 1; i--) {
        uint64_t j = below(&r, i);
        uint64_t tmp = d->order[i - 1];
        d->order[i - 1] = d->order[j];
        d->order[j] = tmp;
    }
}

/* ------------------------------------------------------------ API */

static int check_vocab(const ds *d, ct_err *e) {
    uint32_t v = (uint32_t)d->cfg.vocab_size;
    for (int i = 0; i < d->n_segs; i++) {
        const ds_seg *s = &d->segs[i];
        for (uint64_t k = 0; k < s->n; k++)
            if (s->tok[k] >= v)
                return ct_fail(e, CT_ERR_FORMAT,
                               "%s: token %u at position %llu is outside the model's vocabulary (size %d)%s", s->name,
                               s->tok[k], (unsigned long long)k, d->cfg.vocab_size,
                               s->tokenized ? ": the tokenizer does not match the model" : "");
    }
    return 0;
}

/* Some token must be a target: chat data without an assistant reply masks
 * every token out, and trained to a loss of 0 with a gradient of 0 (and a
 * validation perplexity of 1) at exit 0. Stops at the first target, so a
 * normal dataset costs a few bytes of its first mask. */
static int check_trainable(const ds *d, ct_err *e) {
    for (int i = 0; i < d->n_segs; i++) {
        const ds_seg *s = &d->segs[i];
        if (!s->mask && s->n) return 0;
        for (uint64_t k = 0; s->mask && k < s->n; k++)
            if (s->mask[k]) return 0;
    }
    return ct_fail(e, CT_ERR_FORMAT,
                   "%s: no token is a training target (every loss-mask byte is 0: chat data without an assistant "
                   "reply?)", d->name);
}

int ds_open(ds **out, const char *const *paths, int n_paths, const tok *t, const ds_config *c, ct_err *e) {
    *out = NULL;
    if (n_paths < 1 || !paths[0] || !paths[0][0])
        return ct_fail(e, CT_ERR_CONFIG, "training.dataset_path: no dataset given");
    if (c->seq_len < 1)
        return ct_fail(e, CT_ERR_CONFIG, "%s: must be positive (got %d)", c->seq_key ? c->seq_key : "training.seq_len",
                       c->seq_len);
    ds *d = ct_calloc(1, sizeof *d);
    d->cfg = *c;
    int seen = 0; /* the template note of a caller that keeps none: the tokenizer's and ours, once */
    if (!d->cfg.tok.template_seen) d->cfg.tok.template_seen = &seen;
    d->rank = 0;
    d->world = 1;
    snprintf(d->name, sizeof d->name, "%s%s", paths[0], n_paths > 1 ? " (+ more)" : "");
    int rc = 0;
    for (int i = 0; i < n_paths && !rc;) {
        ds_kind k = c->tok.kind;
        if (k == DS_KIND_AUTO && (rc = ds_detect_kind(paths[i], &k, e))) break;
        if (k == DS_KIND_TOKENS) {
            struct stat st;
            if (stat(paths[i], &st) != 0)
                rc = ct_fail(e, CT_ERR_IO, "%s: cannot open (%s)", paths[i], strerror(errno));
            else
                rc = S_ISDIR(st.st_mode) ? add_dir(d, paths[i], e) : add_token_file(d, paths[i], NULL, e);
            i++;
            continue;
        }
        /* consecutive text sources are tokenized together (one parallel run) */
        int j = i + 1;
        while (j < n_paths) {
            ds_kind kj = c->tok.kind;
            if (kj == DS_KIND_AUTO && (rc = ds_detect_kind(paths[j], &kj, e))) break;
            if (kj == DS_KIND_TOKENS) break;
            j++;
        }
        if (!rc) rc = add_text_run(d, paths + i, j - i, t, e);
        i = j;
    }
    uint64_t start = 0;
    for (int i = 0; i < d->n_segs; i++) {
        d->segs[i].start = start;
        start += d->segs[i].n;
    }
    d->n_tokens = start;
    if (d->own_tok) { /* only needed while tokenizing */
        tok_free(d->own_tok);
        d->own_tok = NULL;
    }
    /* the caller's strings are not ours to keep */
    d->cfg.tokenizer_dir = NULL;
    d->cfg.tok.text_field = NULL;
    if (!rc && c->vocab_size > 0) rc = check_vocab(d, e);
    if (!rc && d->n_segs) rc = check_trainable(d, e);
    d->n_windows = d->n_tokens / ((uint64_t)c->seq_len + 1);
    if (!rc && d->n_windows == 0)
        rc = ct_fail(e, CT_ERR_FORMAT,
                     "%s: %llu tokens is too short for one window of %s + 1 = %d tokens", d->name,
                     (unsigned long long)d->n_tokens, c->seq_key ? c->seq_key : "training.seq_len", c->seq_len + 1);
    if (!rc) {
        d->wtok = ct_malloc(((size_t)c->seq_len + 1) * sizeof *d->wtok);
        d->wmask = ct_malloc((size_t)c->seq_len + 1);
        if (c->shuffle) d->order = ct_malloc(d->n_windows * sizeof *d->order);
        make_order(d);
        rc = ds_set_shard(d, c->world > 0 ? c->rank : 0, c->world > 0 ? c->world : 1, e);
    }
    if (rc) {
        ds_close(d);
        return rc;
    }
    if (!c->quiet)
        fprintf(stderr,
                "ctitan: data: %s: %llu tokens, %llu windows of %d%s%s; rank %d of %d takes %llu per epoch\n",
                d->name, (unsigned long long)d->n_tokens, (unsigned long long)d->n_windows, c->seq_len + 1,
                d->has_mask ? ", loss-masked" : "", c->shuffle ? ", shuffled" : "", d->rank, d->world,
                (unsigned long long)ds_windows_per_rank(d));
    note_unused_template(d, &d->cfg.tok);
    d->cfg.tok.template_seen = NULL; /* the caller's, or our stack's: not ours to keep */
    *out = d;
    return 0;
}

int ds_open_list(ds **out, const char *path_list, const tok *t, const ds_config *c, ct_err *e) {
    *out = NULL;
    char *copy = ct_strdup(path_list ? path_list : "");
    size_t cap = 1;
    for (const char *p = copy; *p; p++) cap += *p == ',';
    const char **paths = ct_calloc(cap, sizeof *paths);
    int n = 0;
    for (char *save = NULL, *tokn = strtok_r(copy, ",", &save); tokn; tokn = strtok_r(NULL, ",", &save))
        if (*tokn) paths[n++] = tokn;
    int rc = n ? ds_open(out, paths, n, t, c, e) : ct_fail(e, CT_ERR_CONFIG, "training.dataset_path: no dataset given");
    free(paths);
    free(copy);
    return rc;
}

void ds_close(ds *d) {
    if (!d) return;
    if (d->own_tok) tok_free(d->own_tok);
    for (int i = 0; i < d->n_segs; i++) free_seg(&d->segs[i]);
    free(d->segs);
    free(d->order);
    free(d->wtok);
    free(d->wmask);
    free(d);
}

int ds_set_shard(ds *d, int rank, int world, ct_err *e) {
    if (world < 1 || rank < 0 || rank >= world)
        return ct_fail(e, CT_ERR_CONFIG, "data shard: rank %d of %d is not valid", rank, world);
    if ((uint64_t)world > d->n_windows)
        return ct_fail(e, CT_ERR_FORMAT, "%s: %llu windows of %d tokens cannot give each of %d ranks one", d->name,
                       (unsigned long long)d->n_windows, d->cfg.seq_len + 1, world);
    d->rank = rank;
    d->world = world;
    return 0;
}

/* Copies tokens [off, off + n) of the stream (and their mask). */
static void gather(const ds *d, uint64_t off, size_t n, uint32_t *dst, uint8_t *mask) {
    int lo = 0, hi = d->n_segs - 1;
    while (lo < hi) { /* last segment with start <= off */
        int mid = (lo + hi + 1) / 2;
        if (d->segs[mid].start <= off) lo = mid;
        else hi = mid - 1;
    }
    for (int i = lo; n; i++) {
        const ds_seg *s = &d->segs[i];
        uint64_t at = off - s->start;
        if (at >= s->n) continue; /* empty segment */
        size_t take = s->n - at < n ? (size_t)(s->n - at) : n;
        memcpy(dst, s->tok + at, take * sizeof *dst);
        if (s->mask) memcpy(mask, s->mask + at, take);
        else memset(mask, 1, take);
        dst += take;
        mask += take;
        off += take;
        n -= take;
    }
}

void ds_next(ds *d, int32_t *inputs, int32_t *labels, int B) {
    int T = d->cfg.seq_len;
    for (int b = 0; b < B; b++) {
        if (d->pos + d->world > (int64_t)d->n_windows) { /* no full round left */
            d->epoch++;
            d->pos = 0;
            make_order(d);
            if (!d->cfg.quiet)
                fprintf(stderr, "ctitan: data: %s: epoch %lld done (%llu windows per rank); starting epoch %lld%s\n",
                        d->name, (long long)d->epoch - 1, (unsigned long long)ds_windows_per_rank(d),
                        (long long)d->epoch, d->order ? ", reshuffled" : "");
        }
        uint64_t k = (uint64_t)d->pos + (uint64_t)d->rank;
        uint64_t w = d->order ? d->order[k] : k;
        d->pos += d->world;
        gather(d, w * ((uint64_t)T + 1), (size_t)T + 1, d->wtok, d->wmask);
        int32_t *in = inputs + (size_t)b * T, *lab = labels + (size_t)b * T;
        for (int t = 0; t < T; t++) {
            in[t] = (int32_t)d->wtok[t];
            lab[t] = d->wmask[t + 1] ? (int32_t)d->wtok[t + 1] : -100;
        }
    }
}

void ds_get_state(const ds *d, ds_state *s) {
    s->epoch = d->epoch;
    s->pos = d->pos;
}

int ds_set_state(ds *d, const ds_state *s, ct_err *e) {
    if (s->epoch < 0 || s->pos < 0 || (uint64_t)s->pos > d->n_windows)
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: data loader state (epoch %lld, position %lld) does not fit this dataset (%llu windows): "
                       "different data or seq_len?",
                       d->name, (long long)s->epoch, (long long)s->pos, (unsigned long long)d->n_windows);
    d->epoch = s->epoch;
    d->pos = s->pos;
    make_order(d);
    return 0;
}

/* FNV-1a's 64-bit offset basis and prime, applied to whole words rather than
 * bytes: xor and multiplication by an odd number are each one-to-one, so a
 * sequence that differs from another in one word always ends in another state. */
#define DS_FNV_BASIS 0xcbf29ce484222325ULL
#define DS_FNV_PRIME 0x100000001b3ULL
#define DS_DIGEST_BLOCK ((uint64_t)1 << 20) /* tokens per block: the blocks are hashed in parallel */

/* The digest of tokens [off, off + n) of the stream, each with its mask bit. */
static uint64_t digest_range(const ds *d, uint64_t off, uint64_t n) {
    int lo = 0, hi = d->n_segs - 1;
    while (lo < hi) { /* last segment with start <= off, as gather */
        int mid = (lo + hi + 1) / 2;
        if (d->segs[mid].start <= off) lo = mid;
        else hi = mid - 1;
    }
    uint64_t h = DS_FNV_BASIS, W = (uint64_t)d->cfg.seq_len + 1;
    for (int i = lo; n; i++) {
        const ds_seg *s = &d->segs[i];
        uint64_t at = off - s->start;
        if (at >= s->n) continue; /* empty segment */
        uint64_t take = s->n - at < n ? s->n - at : n;
        for (uint64_t k = at; k < at + take; k++) {
            /* a window's first token is never a target: its mask bit trains nothing */
            int bit = !s->mask || s->mask[k] || (s->start + k) % W == 0;
            h = (h ^ ((uint64_t)s->tok[k] | (uint64_t)bit << 32)) * DS_FNV_PRIME;
        }
        off += take;
        n -= take;
    }
    return h;
}

uint64_t ds_digest(const ds *d) {
    uint64_t n = d->n_windows * ((uint64_t)d->cfg.seq_len + 1);
    int64_t nb = (int64_t)((n + DS_DIGEST_BLOCK - 1) / DS_DIGEST_BLOCK);
    uint64_t *part = ct_malloc(((size_t)nb + 1) * sizeof *part);
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t b = 0; b < nb; b++) {
        uint64_t off = (uint64_t)b * DS_DIGEST_BLOCK;
        part[b] = digest_range(d, off, n - off < DS_DIGEST_BLOCK ? n - off : DS_DIGEST_BLOCK);
    }
    uint64_t h = (DS_FNV_BASIS ^ n) * DS_FNV_PRIME; /* the length first: equal prefixes differ */
    for (int64_t b = 0; b < nb; b++) h = (h ^ part[b]) * DS_FNV_PRIME;
    free(part);
    return h;
}

uint64_t ds_num_tokens(const ds *d) { return d->n_tokens; }
uint64_t ds_num_windows(const ds *d) { return d->n_windows; }
uint64_t ds_windows_per_rank(const ds *d) { return d->n_windows / (uint64_t)d->world; }
int ds_has_mask(const ds *d) { return d->has_mask; }
const char *ds_name(const ds *d) { return d->name; }
