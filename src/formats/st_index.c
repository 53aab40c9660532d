/* formats/st_index.c: sharded model directories, read as one set and
 * written as model-0000i-of-0000N.safetensors shards plus
 * model.safetensors.index.json.
 *
 * Why a file of its own: only this part knows about directories, HF's shard
 * naming and the index; each shard is read by st_read.c and written by
 * st_write.c.
 *
 * Design notes.
 * - A set merges its shards' name-sorted arrays and bsearches them, which
 *   also finds a name present in two shards.
 * - The index is untrusted like a header: shard names must be plain file
 *   names, every weight_map entry must be in its shard and every shard
 *   tensor in the weight_map.
 * - Writing puts the new files in place first and then removes what is
 *   stale (the other layout's index or single file, shards of a previous
 *   write), as transformers' save_pretrained does: a reader sees the old
 *   model or the new one, each whole. */
#include "formats/safetensors.h"
#include "formats/st_priv.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/fs.h"
#include "formats/json.h"

#define ST_MAX_INDEX (100ull << 20) /* an index.json beyond 100 MiB is not an index */

/* ------------------------------------------------------------------ sets */

typedef struct {
    const st_tensor *t;
    int file;
} st_entry;

struct st_set {
    st_file **files;
    int nfiles;
    st_entry *order;  /* shard order, then file order */
    st_entry *sorted; /* by name */
    int n;
};

static int st_cmp_entry(const void *a, const void *b) {
    const st_entry *x = a, *y = b;
    int c = strcmp(x->t->name, y->t->name);
    return c ? c : x->file - y->file;
}

static int st_cmp_key_entry(const void *key, const void *elem) {
    return strcmp((const char *)key, ((const st_entry *)elem)->t->name);
}

void st_set_close(st_set *s) {
    if (!s) return;
    for (int i = 0; i < s->nfiles; i++) st_close(s->files[i]);
    free(s->files);
    free(s->order);
    free(s->sorted);
    free(s);
}

int st_set_count(const st_set *s) { return s->n; }
const st_tensor *st_set_get(const st_set *s, int i) { return (i >= 0 && i < s->n) ? s->order[i].t : NULL; }

const st_tensor *st_set_find(const st_set *s, const char *name, const char **file_out) {
    const st_entry *r = bsearch(name, s->sorted, (size_t)s->n, sizeof *s->sorted, st_cmp_key_entry);
    if (!r) return NULL;
    if (file_out) *file_out = st_path(s->files[r->file]);
    return r->t;
}

/* Builds order/sorted over all files; rejects a name present in two shards. */
static int st_set_index(st_set *s, ct_err *e) {
    size_t total = 0;
    for (int i = 0; i < s->nfiles; i++) total += (size_t)st_count(s->files[i]);
    s->order = ct_malloc((total + 1) * sizeof *s->order);
    s->sorted = ct_malloc((total + 1) * sizeof *s->sorted);
    s->n = 0;
    for (int i = 0; i < s->nfiles; i++)
        for (int j = 0; j < st_count(s->files[i]); j++) s->order[s->n++] = (st_entry){st_get(s->files[i], j), i};
    memcpy(s->sorted, s->order, (size_t)s->n * sizeof *s->sorted);
    qsort(s->sorted, (size_t)s->n, sizeof *s->sorted, st_cmp_entry);
    for (int i = 1; i < s->n; i++)
        if (strcmp(s->sorted[i - 1].t->name, s->sorted[i].t->name) == 0)
            return ct_fail(e, CT_ERR_FORMAT, "tensor '%s' appears in two shards: %s and %s", s->sorted[i].t->name,
                           st_path(s->files[s->sorted[i - 1].file]), st_path(s->files[s->sorted[i].file]));
    return 0;
}

typedef struct {
    const char *name;
    const char *file;
    int shard;
} st_wm;

static int st_cmp_wm(const void *a, const void *b) {
    return strcmp(((const st_wm *)a)->name, ((const st_wm *)b)->name);
}
static int st_cmp_key_wm(const void *key, const void *elem) {
    return strcmp((const char *)key, ((const st_wm *)elem)->name);
}

static int st_plain_name(const char *s) {
    return *s && !strchr(s, '/') && !strstr(s, "..");
}

static int st_set_open_index(st_set *s, const char *dir, const char *ipath, ct_err *e) {
    size_t len;
    char *txt = fs_read_file(ipath, ST_MAX_INDEX, &len, e);
    if (!txt) return e ? e->code : CT_ERR_IO;
    int rc = 0;
    st_wm *wm = NULL;
    const char **shards = NULL;
    cJSON *root = json_parse(txt, len, ipath, e);
    if (!root) {
        rc = CT_ERR_FORMAT;
        goto out;
    }
    if (!cJSON_IsObject(root)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: not a valid JSON object", ipath);
        goto out;
    }
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(map)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: 'weight_map' is missing or not an object", ipath);
        goto out;
    }
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "metadata");
    if (meta && !cJSON_IsObject(meta) && !cJSON_IsNull(meta)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: 'metadata' is not an object", ipath);
        goto out;
    }
    int cnt = cJSON_GetArraySize(map), n = 0;
    wm = ct_malloc(((size_t)cnt + 1) * sizeof *wm);
    shards = ct_malloc(((size_t)cnt + 1) * sizeof *shards);
    int nshards = 0;
    for (const cJSON *it = map->child; it; it = it->next) {
        if (!cJSON_IsString(it)) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: weight_map entry '%s' is not a string", ipath, it->string);
            goto out;
        }
        if (!st_plain_name(it->valuestring)) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: weight_map entry '%s' names shard '%s', not a plain file name",
                         ipath, it->string, it->valuestring);
            goto out;
        }
        wm[n++] = (st_wm){it->string, it->valuestring, -1};
        shards[nshards++] = it->valuestring;
    }
    qsort(wm, (size_t)n, sizeof *wm, st_cmp_wm);
    for (int i = 1; i < n; i++)
        if (strcmp(wm[i - 1].name, wm[i].name) == 0) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: weight_map lists tensor '%s' twice", ipath, wm[i].name);
            goto out;
        }
    /* distinct shard names, in sorted order (= numeric order for HF names) */
    qsort(shards, (size_t)nshards, sizeof *shards, st_cmp_str);
    int u = 0;
    for (int i = 0; i < nshards; i++)
        if (u == 0 || strcmp(shards[u - 1], shards[i]) != 0) shards[u++] = shards[i];
    nshards = u;
    for (int i = 0; i < n; i++) {
        const char **r = bsearch(&wm[i].file, shards, (size_t)nshards, sizeof *shards, st_cmp_str);
        wm[i].shard = (int)(r - shards);
    }
    s->files = ct_calloc((size_t)nshards + 1, sizeof *s->files);
    for (int i = 0; i < nshards; i++) {
        char *sp = fs_join(dir, shards[i]);
        s->files[i] = st_open(sp, e);
        free(sp);
        if (!s->files[i]) {
            rc = e ? e->code : CT_ERR_FORMAT;
            if (e) {
                size_t l = strlen(e->msg);
                snprintf(e->msg + l, sizeof e->msg - l, " (shard listed in %s)", ipath);
            }
            goto out;
        }
        s->nfiles++;
    }
    if ((rc = st_set_index(s, e))) goto out;
    for (int i = 0; i < n; i++)
        if (!st_find(s->files[wm[i].shard], wm[i].name)) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: weight_map tensor '%s' is missing from its shard %s", ipath,
                         wm[i].name, st_path(s->files[wm[i].shard]));
            goto out;
        }
    for (int i = 0; i < s->n; i++) {
        const st_entry *en = &s->order[i];
        const st_wm *w = bsearch(en->t->name, wm, (size_t)n, sizeof *wm, st_cmp_key_wm);
        if (!w) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s' of shard %s is not in the weight_map", ipath,
                         en->t->name, st_path(s->files[en->file]));
            goto out;
        }
        if (w->shard != en->file) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s' is in shard %s but the weight_map places it in %s",
                         ipath, en->t->name, st_path(s->files[en->file]), w->file);
            goto out;
        }
    }
out:
    free(wm);
    free(shards);
    cJSON_Delete(root);
    free(txt);
    return rc;
}

st_set *st_set_open(const char *dir, ct_err *e) {
    st_set *s = ct_calloc(1, sizeof *s);
    char *ipath = fs_join(dir, "model.safetensors.index.json");
    char *fpath = fs_join(dir, "model.safetensors");
    int rc;
    struct stat st;
    if (stat(ipath, &st) == 0) {
        rc = st_set_open_index(s, dir, ipath, e);
    } else if (stat(fpath, &st) == 0) {
        s->files = ct_calloc(1, sizeof *s->files);
        s->files[0] = st_open(fpath, e);
        rc = s->files[0] ? 0 : (e ? e->code : CT_ERR_FORMAT);
        if (!rc) {
            s->nfiles = 1;
            rc = st_set_index(s, e);
        }
    } else {
        rc = ct_fail(e, CT_ERR_IO, "%s: no model.safetensors or model.safetensors.index.json in this directory",
                     dir);
    }
    free(ipath);
    free(fpath);
    if (rc) {
        st_set_close(s);
        return NULL;
    }
    return s;
}

/* ------------------------------------------------------- writing a directory */


/* Is `name` an HF shard name model-AAAAA-of-BBBBB.safetensors? */
static int st_shard_name(const char *name, unsigned *a, unsigned *b) {
    if (strlen(name) != strlen("model-00000-of-00000.safetensors")) return 0;
    if (strncmp(name, "model-", 6) || strncmp(name + 11, "-of-", 4) || strcmp(name + 20, ".safetensors")) return 0;
    unsigned x = 0, y = 0;
    for (int i = 0; i < 5; i++) {
        if (name[6 + i] < '0' || name[6 + i] > '9' || name[15 + i] < '0' || name[15 + i] > '9') return 0;
        x = x * 10 + (unsigned)(name[6 + i] - '0');
        y = y * 10 + (unsigned)(name[15 + i] - '0');
    }
    *a = x;
    *b = y;
    return 1;
}

/* Removes shards of a previous write that the new one does not use, as
 * transformers' save_pretrained does, so the directory holds one model. */
static int st_remove_stale(const char *dir, unsigned nshards, ct_err *e) {
    DIR *d = opendir(dir);
    if (!d) return ct_fail(e, CT_ERR_IO, "%s: cannot list directory: %s", dir, strerror(errno));
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        unsigned a, b;
        if (!st_shard_name(de->d_name, &a, &b)) continue;
        if (nshards && b == nshards && a >= 1 && a <= nshards) continue;
        char *p = fs_join(dir, de->d_name);
        if (unlink(p) != 0 && errno != ENOENT)
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot remove stale shard: %s", p, strerror(errno));
        free(p);
    }
    closedir(d);
    return rc;
}

static int st_unlink_if(const char *path, ct_err *e) {
    if (unlink(path) != 0 && errno != ENOENT)
        return ct_fail(e, CT_ERR_IO, "%s: cannot remove stale file: %s", path, strerror(errno));
    return 0;
}

/* Greedy: a shard takes tensors while they fit; a tensor larger than the
 * limit gets a shard of its own. Shard s is tensors [first[s], first[s + 1]),
 * first[n + 2]; *ns shards. */
static int st_plan_shards(const char *dir, const uint64_t *sizes, int n, size_t max_shard_bytes, int *first, int *ns,
                          ct_err *e) {
    int k = 0;
    uint64_t cur = 0;
    for (int i = 0; i < n; i++) {
        if (k == 0 || (cur > 0 && cur + sizes[i] > max_shard_bytes)) {
            first[k++] = i;
            cur = 0;
        }
        cur += sizes[i];
    }
    first[k] = n;
    *ns = k;
    if (k > 99999) return ct_fail(e, CT_ERR_IO, "%s: %d shards exceed HF's 5-digit shard naming", dir, k);
    return 0;
}

/* model.safetensors.index.json of the shards planned in first[ns + 1]. */
static int st_write_index(const char *ipath, const st_wtensor *ts, const int *first, int ns, uint64_t total,
                          ct_err *e) {
    st_buf idx = {0};
    st_sb_printf(&idx, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {",
              (unsigned long long)total);
    for (int s = 0; s < ns; s++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, ns);
        for (int i = first[s]; i < first[s + 1]; i++) {
            st_sb_puts(&idx, i ? ",\n    " : "\n    ");
            st_sb_json_str(&idx, ts[i].name);
            st_sb_puts(&idx, ": ");
            st_sb_json_str(&idx, name);
        }
    }
    st_sb_puts(&idx, "\n  }\n}\n");
    int rc = fs_write_atomic(ipath, idx.p, idx.n, e);
    free(idx.p);
    return rc;
}

int st_write_dir(const char *dir, const st_wtensor *ts, int n, size_t max_shard_bytes, const char *const *meta,
                 ct_err *e) {
    uint64_t *sizes = ct_malloc(((size_t)(n > 0 ? n : 0) + 1) * sizeof *sizes);
    int *first = NULL;
    char *ipath = fs_join(dir, "model.safetensors.index.json");
    char *fpath = fs_join(dir, "model.safetensors");
    int rc = st_wvalidate(dir, ts, n, meta, sizes, 1, e);
    if (!rc) rc = ct_mkdirs(dir, e);
    if (rc) goto out;
    uint64_t total = 0;
    for (int i = 0; i < n; i++) total += sizes[i];

    if (max_shard_bytes == 0 || total <= max_shard_bytes) {
        /* new file first, then drop the index: a reader sees old or new, whole */
        if ((rc = st_write_checked(fpath, ts, n, meta, sizes, e))) goto out;
        if ((rc = st_unlink_if(ipath, e))) goto out;
        rc = st_remove_stale(dir, 0, e);
        goto out;
    }
    first = ct_malloc(((size_t)n + 2) * sizeof *first);
    int ns = 0;
    if ((rc = st_plan_shards(dir, sizes, n, max_shard_bytes, first, &ns, e))) goto out;
    for (int s = 0; s < ns && !rc; s++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, ns);
        char *sp = fs_join(dir, name);
        rc = st_write_checked(sp, ts + first[s], first[s + 1] - first[s], meta, sizes + first[s], e);
        free(sp);
    }
    if (!rc) rc = st_write_index(ipath, ts, first, ns, total, e);
    if (!rc) rc = st_unlink_if(fpath, e);
    if (!rc) rc = st_remove_stale(dir, (unsigned)ns, e);
out:
    free(first);
    free(sizes);
    free(ipath);
    free(fpath);
    return rc;
}


/* st_write_dir streamed: the shards are planned as st_write_dir plans them
 * and written one after the other, each an st_stream. */
struct st_dir_stream {
    char *dir;
    const char *const *meta;
    st_wtensor *ts;   /* [n] names, dtypes, shapes (names copied into `names`) */
    char *names;
    uint64_t *sizes;  /* [n] stored bytes */
    int n, ns, s;     /* tensors; shards (1 and !sharded: model.safetensors); the one being written */
    int sharded;
    int *first;       /* [ns + 1] first tensor of each shard */
    uint64_t total;
    size_t left;      /* elements of shard s still to come */
    size_t src_es;    /* bytes per source element */
    st_stream *cur;
};

static void st_dir_stream_free(st_dir_stream *d) {
    st_stream_abort(d->cur);
    free(d->dir);
    free(d->ts);
    free(d->names);
    free(d->sizes);
    free(d->first);
    free(d);
}

/* Opens shard d->s, then closes and moves past shards that need no data. */
static int st_dir_stream_next(st_dir_stream *d, ct_err *e) {
    while (d->s < d->ns) {
        if (!d->cur) {
            int a = d->first[d->s], b = d->first[d->s + 1], rc;
            char name[64];
            if (d->sharded) snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", d->s + 1, d->ns);
            else snprintf(name, sizeof name, "model.safetensors");
            char *sp = fs_join(d->dir, name);
            rc = st_stream_open(&d->cur, sp, d->ts + a, b - a, d->meta, e);
            free(sp);
            if (rc) return rc;
            d->left = 0;
            for (int i = a; i < b; i++) d->left += (size_t)(d->sizes[i] / ct_dtype_size(d->ts[i].dtype));
        }
        if (d->left) return 0;
        int rc = st_stream_close(d->cur, e);
        d->cur = NULL;
        d->s++;
        if (rc) return rc;
    }
    return 0;
}

int st_dir_stream_open(st_dir_stream **out, const char *dir, const st_wtensor *ts, int n, size_t max_shard_bytes,
                       const char *const *meta, ct_err *e) {
    *out = NULL;
    st_dir_stream *d = ct_calloc(1, sizeof *d);
    d->sizes = ct_malloc(((size_t)(n > 0 ? n : 0) + 1) * sizeof *d->sizes);
    d->first = ct_malloc(((size_t)(n > 0 ? n : 0) + 2) * sizeof *d->first);
    size_t dl = strlen(dir);
    d->dir = ct_malloc(dl + 1);
    memcpy(d->dir, dir, dl + 1);
    d->meta = meta;
    d->n = n;
    int rc = st_wvalidate(dir, ts, n, meta, d->sizes, 0, e);
    for (int i = 1; i < n && !rc; i++)
        if (ct_dtype_size(ts[i].dtype) != ct_dtype_size(ts[0].dtype) || ts[i].src_dtype != ts[0].src_dtype)
            rc = ct_fail(e, CT_ERR_IO, "%s: a streamed write needs tensors of one element size and source dtype ('%s')",
                         dir, ts[i].name);
    if (!rc) rc = ct_mkdirs(dir, e);
    if (rc) {
        st_dir_stream_free(d);
        return rc;
    }
    size_t nl = 0;
    for (int i = 0; i < n; i++) nl += strlen(ts[i].name) + 1;
    d->ts = ct_malloc(((size_t)n + 1) * sizeof *d->ts);
    d->names = ct_malloc(nl + 1);
    d->src_es = n ? ct_dtype_size(ts[0].src_dtype) : 4;
    nl = 0;
    for (int i = 0; i < n; i++) {
        size_t l = strlen(ts[i].name) + 1;
        memcpy(d->names + nl, ts[i].name, l);
        d->ts[i] = ts[i];
        d->ts[i].name = d->names + nl;
        d->ts[i].data = NULL;
        d->total += d->sizes[i];
        nl += l;
    }
    if (max_shard_bytes == 0 || d->total <= max_shard_bytes) {
        d->ns = 1;
        d->first[0] = 0;
        d->first[1] = n;
    } else {
        d->sharded = 1;
        rc = st_plan_shards(dir, d->sizes, n, max_shard_bytes, d->first, &d->ns, e);
    }
    if (!rc) rc = st_dir_stream_next(d, e);
    if (rc) {
        st_dir_stream_free(d);
        return rc;
    }
    *out = d;
    return 0;
}

int st_dir_stream_write(st_dir_stream *d, const void *src, size_t numel, ct_err *e) {
    const char *p = src;
    while (numel) {
        if (!d->cur) return ct_fail(e, CT_ERR_IO, "%s: %zu elements more than its tensors hold", d->dir, numel);
        size_t k = numel < d->left ? numel : d->left;
        int rc = st_stream_write(d->cur, p, k, e);
        if (rc) return rc;
        p += k * d->src_es;
        numel -= k;
        d->left -= k;
        if ((rc = st_dir_stream_next(d, e))) return rc;
    }
    return 0;
}

int st_dir_stream_close(st_dir_stream *d, ct_err *e) {
    int rc = 0;
    if (d->s < d->ns) rc = ct_fail(e, CT_ERR_IO, "%s: closed before every tensor had its data", d->dir);
    char *ipath = fs_join(d->dir, "model.safetensors.index.json");
    char *fpath = fs_join(d->dir, "model.safetensors");
    if (!rc && d->sharded) { /* as st_write_dir: the new files, then drop what is stale */
        rc = st_write_index(ipath, d->ts, d->first, d->ns, d->total, e);
        if (!rc) rc = st_unlink_if(fpath, e);
        if (!rc) rc = st_remove_stale(d->dir, (unsigned)d->ns, e);
    } else if (!rc) {
        rc = st_unlink_if(ipath, e);
        if (!rc) rc = st_remove_stale(d->dir, 0, e);
    }
    free(ipath);
    free(fpath);
    st_dir_stream_free(d);
    return rc;
}

void st_dir_stream_abort(st_dir_stream *d) {
    if (d) st_dir_stream_free(d);
}
