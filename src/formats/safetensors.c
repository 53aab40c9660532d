/* formats/safetensors.c: safetensors reader (mmap) and writer (tmp + rename).
 *
 * Design notes.
 * - Reading: the whole file is mapped read-only and the fd closed at once; a
 *   tensor's `data` points into the mapping, so opening a 60 GB checkpoint
 *   costs no copies and pages come in only when a tensor is converted.
 * - The header is untrusted. It is copied into a NUL-terminated buffer before
 *   cJSON sees it (cJSON never reads near the mapping's end), and every field
 *   is checked before a single tensor is exposed: known dtype, integral
 *   non-negative shape and offsets below 2^53 (cJSON stores numbers as
 *   doubles, beyond that they are not exact), numel without overflow, offsets
 *   inside the buffer, end - begin matching the shape, and the tensors tiling
 *   the buffer exactly (what the Hugging Face reader requires). Tensor entries
 *   with unknown or repeated fields are rejected rather than guessed at.
 * - Names and metadata are copied out and the JSON tree freed: the tree of a
 *   big header is many times its size, and the names must outlive parsing.
 * - Lookup is bsearch over an array sorted by name; sorting also finds
 *   duplicate names. A set (sharded directory) merges its shards' sorted
 *   arrays the same way, which also finds names present in two shards.
 * - Writing builds the header by hand rather than with cJSON: cJSON prints
 *   large integers in exponent form ("1e+15"), which the Rust reader rejects.
 *   Data is streamed tensor by tensor; F32 -> BF16/F16 conversion goes through
 *   a small fixed buffer so no model-sized temporary ever exists. PATH.tmp is
 *   written, fsynced, renamed, and the directory fsynced, so the final name
 *   only ever holds a complete file.
 * - Data is little-endian on disk and is read and written as host order: the
 *   machines ctitan targets are little-endian. The writer lays data out by
 *   falling element size, so its tensors are aligned; files from elsewhere
 *   are only as aligned as their writer made them (HF's are), so readers of
 *   foreign files should not assume more than byte alignment. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mmap, fsync, O_DIRECTORY under -std=c11 */
#endif
#include "formats/safetensors.h"
#include "core/fs.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER 100000000ull
#define ST_MAX_INDEX (100ull << 20) /* an index.json beyond 100 MiB is not an index */
#define ST_EXACT_LIMIT 9007199254740992.0 /* 2^53: doubles above are not exact integers */

struct st_file {
    char *path;
    void *map;
    size_t map_size;
    st_tensor *ts;
    int n;
    const st_tensor **by_name; /* sorted by name, for bsearch */
    char **meta;               /* key, value, key, value, ... */
    int n_meta;
};

/* ---------------------------------------------------------------- helpers */

static int st_cmp_tensor_name(const void *a, const void *b) {
    const st_tensor *x = *(const st_tensor *const *)a, *y = *(const st_tensor *const *)b;
    return strcmp(x->name, y->name);
}

static int st_cmp_key_tensor(const void *key, const void *elem) {
    return strcmp((const char *)key, (*(const st_tensor *const *)elem)->name);
}

/* A JSON number that is an exact non-negative integer below 2^53. */
static int st_json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return -1;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d >= ST_EXACT_LIMIT || d != floor(d)) return -1;
    *out = (uint64_t)d;
    return 0;
}

/* --------------------------------------------------------------- reading */

typedef struct {
    uint64_t begin, end;
    int idx;
} st_span;

static int st_cmp_span(const void *a, const void *b) {
    const st_span *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->idx - y->idx;
}

static void st_free_partial(st_file *f) {
    if (!f) return;
    if (f->ts)
        for (int i = 0; i < f->n; i++) free((char *)f->ts[i].name);
    free(f->ts);
    free(f->by_name);
    for (int i = 0; i < 2 * f->n_meta; i++) free(f->meta[i]);
    free(f->meta);
    if (f->map) munmap(f->map, f->map_size);
    free(f->path);
    free(f);
}

static int st_parse_metadata(st_file *f, const cJSON *m, ct_err *e) {
    if (!cJSON_IsObject(m))
        return ct_fail(e, CT_ERR_FORMAT, "%s: __metadata__ is not a JSON object", f->path);
    int cnt = cJSON_GetArraySize(m);
    f->meta = ct_calloc((size_t)cnt * 2 + 1, sizeof(char *));
    for (const cJSON *kv = m->child; kv; kv = kv->next) {
        if (!cJSON_IsString(kv))
            return ct_fail(e, CT_ERR_FORMAT, "%s: __metadata__ value of '%s' is not a string", f->path,
                           kv->string);
        for (int i = 0; i < f->n_meta; i++)
            if (strcmp(f->meta[2 * i], kv->string) == 0)
                return ct_fail(e, CT_ERR_FORMAT, "%s: __metadata__ key '%s' appears twice", f->path,
                               kv->string);
        f->meta[2 * f->n_meta] = ct_strdup(kv->string);
        f->meta[2 * f->n_meta + 1] = ct_strdup(kv->valuestring);
        f->n_meta++;
    }
    return 0;
}

/* Fills t from one header entry; begin/end receive the data offsets. */
static int st_parse_entry(const st_file *f, const cJSON *ent, size_t bufsize, st_tensor *t, uint64_t *begin,
                          uint64_t *end, ct_err *e) {
    const char *p = f->path, *nm = t->name;
    if (!cJSON_IsObject(ent))
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': header entry is not a JSON object", p, nm);
    const cJSON *dt = NULL, *sh = NULL, *off = NULL;
    for (const cJSON *c = ent->child; c; c = c->next) {
        const cJSON **slot = strcmp(c->string, "dtype") == 0          ? &dt
                             : strcmp(c->string, "shape") == 0        ? &sh
                             : strcmp(c->string, "data_offsets") == 0 ? &off
                                                                      : NULL;
        if (!slot)
            return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': unknown field '%s'", p, nm, c->string);
        if (*slot)
            return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': field '%s' appears twice", p, nm, c->string);
        *slot = c;
    }
    if (!dt) return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': missing field 'dtype'", p, nm);
    if (!sh) return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': missing field 'shape'", p, nm);
    if (!off) return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': missing field 'data_offsets'", p, nm);

    if (!cJSON_IsString(dt))
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': 'dtype' is not a string", p, nm);
    int d = ct_dtype_from_name(dt->valuestring);
    if (d < 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': unknown dtype '%s'", p, nm, dt->valuestring);
    t->dtype = (ct_dtype)d;

    if (!cJSON_IsArray(sh))
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': 'shape' is not an array", p, nm);
    int nd = cJSON_GetArraySize(sh);
    if (nd > ST_MAX_DIMS)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': shape has %d dims, at most %d supported", p, nm, nd,
                       ST_MAX_DIMS);
    t->ndim = nd;
    uint64_t numel = 1;
    int k = 0;
    for (const cJSON *v = sh->child; v; v = v->next, k++) {
        uint64_t dim;
        if (st_json_uint(v, &dim))
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: tensor '%s': shape[%d] is not a non-negative integer below 2^53", p, nm, k);
        t->shape[k] = (int64_t)dim;
        if (__builtin_mul_overflow(numel, dim, &numel) || numel >= (uint64_t)ST_EXACT_LIMIT)
            return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': element count overflows", p, nm);
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, (uint64_t)ct_dtype_size(t->dtype), &nbytes))
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': byte size overflows", p, nm);

    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': 'data_offsets' is not an array [begin, end]", p, nm);
    if (st_json_uint(off->child, begin) || st_json_uint(off->child->next, end))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: tensor '%s': data_offsets are not non-negative integers below 2^53", p, nm);
    if (*begin > *end)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': data_offsets begin %llu > end %llu", p, nm,
                       (unsigned long long)*begin, (unsigned long long)*end);
    if (*end > bufsize)
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: tensor '%s': data_offsets end %llu is past the data buffer (%zu bytes; file truncated?)",
                       p, nm, (unsigned long long)*end, bufsize);
    if (*end - *begin != nbytes)
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: tensor '%s': data_offsets span %llu bytes but dtype %s and shape need %llu", p, nm,
                       (unsigned long long)(*end - *begin), ct_dtype_name(t->dtype), (unsigned long long)nbytes);
    t->numel = (int64_t)numel;
    t->nbytes = (size_t)nbytes;
    return 0;
}

/* The tensors must cover [0, bufsize) exactly once, as the HF reader demands. */
static int st_check_tiling(const st_file *f, const uint64_t *begins, const uint64_t *ends, size_t bufsize,
                           ct_err *e) {
    if (f->n == 0) {
        if (bufsize)
            return ct_fail(e, CT_ERR_FORMAT, "%s: data buffer holds %zu bytes but the header lists no tensors",
                           f->path, bufsize);
        return 0;
    }
    st_span *sp = ct_malloc((size_t)f->n * sizeof *sp);
    for (int i = 0; i < f->n; i++) sp[i] = (st_span){begins[i], ends[i], i};
    qsort(sp, (size_t)f->n, sizeof *sp, st_cmp_span);
    uint64_t expect = 0;
    int rc = 0;
    for (int i = 0; i < f->n && !rc; i++) {
        const char *nm = f->ts[sp[i].idx].name;
        if (sp[i].begin > expect) {
            if (i == 0)
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: hole in data buffer: bytes [0, %llu) before tensor '%s'",
                             f->path, (unsigned long long)sp[i].begin, nm);
            else
                rc = ct_fail(e, CT_ERR_FORMAT,
                             "%s: hole in data buffer: bytes [%llu, %llu) between tensors '%s' and '%s'", f->path,
                             (unsigned long long)expect, (unsigned long long)sp[i].begin,
                             f->ts[sp[i - 1].idx].name, nm);
        } else if (sp[i].begin < expect) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensors '%s' and '%s' overlap in the data buffer (at byte %llu)",
                         f->path, f->ts[sp[i - 1].idx].name, nm, (unsigned long long)sp[i].begin);
        }
        expect = sp[i].end;
    }
    if (!rc && expect != bufsize)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: data buffer has %llu bytes after the last tensor '%s'", f->path,
                     (unsigned long long)(bufsize - expect), f->ts[sp[f->n - 1].idx].name);
    free(sp);
    return rc;
}

static int st_parse_header(st_file *f, const char *hdr, size_t hlen, size_t bufsize, ct_err *e) {
    char *buf = ct_malloc(hlen + 1);
    memcpy(buf, hdr, hlen);
    buf[hlen] = 0;
    const char *endp = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(buf, hlen, &endp, 0);
    int rc = 0;
    uint64_t *begins = NULL, *ends = NULL;
    if (!root) {
        const char *ep = cJSON_GetErrorPtr();
        long at = (ep && ep >= buf && ep <= buf + hlen) ? (long)(ep - buf) : -1;
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: header is not valid JSON (error near header byte %ld)", f->path, at);
        goto out;
    }
    for (const char *q = endp; q && q < buf + hlen; q++)
        if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r') {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: header has trailing bytes after the JSON object (at byte %ld)",
                         f->path, (long)(q - buf));
            goto out;
        }
    if (!cJSON_IsObject(root)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: header is not a JSON object", f->path);
        goto out;
    }
    int cnt = cJSON_GetArraySize(root);
    f->ts = ct_calloc((size_t)cnt + 1, sizeof *f->ts);
    begins = ct_malloc(((size_t)cnt + 1) * sizeof *begins);
    ends = ct_malloc(((size_t)cnt + 1) * sizeof *ends);
    int seen_meta = 0;
    for (const cJSON *it = root->child; it; it = it->next) {
        if (strcmp(it->string, "__metadata__") == 0) {
            if (seen_meta++) {
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: __metadata__ appears twice", f->path);
                goto out;
            }
            if ((rc = st_parse_metadata(f, it, e))) goto out;
            continue;
        }
        st_tensor *t = &f->ts[f->n];
        t->name = ct_strdup(it->string);
        f->n++; /* counted now so cleanup frees the name */
        if ((rc = st_parse_entry(f, it, bufsize, t, &begins[f->n - 1], &ends[f->n - 1], e))) goto out;
        t->data = (const char *)f->map + 8 + hlen + begins[f->n - 1];
    }
    f->by_name = ct_malloc(((size_t)f->n + 1) * sizeof *f->by_name);
    for (int i = 0; i < f->n; i++) f->by_name[i] = &f->ts[i];
    qsort(f->by_name, (size_t)f->n, sizeof *f->by_name, st_cmp_tensor_name);
    for (int i = 1; i < f->n; i++)
        if (strcmp(f->by_name[i - 1]->name, f->by_name[i]->name) == 0) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", f->path,
                         f->by_name[i]->name);
            goto out;
        }
    rc = st_check_tiling(f, begins, ends, bufsize, e);
out:
    free(begins);
    free(ends);
    cJSON_Delete(root);
    free(buf);
    return rc;
}

st_file *st_open(const char *path, ct_err *e) {
    st_file *f = ct_calloc(1, sizeof *f);
    f->path = ct_strdup(path);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        goto fail;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        ct_fail(e, CT_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        goto fail;
    }
    if (!S_ISREG(st.st_mode)) {
        ct_fail(e, CT_ERR_IO, "%s: not a regular file", path);
        close(fd);
        goto fail;
    }
    if (st.st_size < 8) {
        ct_fail(e, CT_ERR_FORMAT, "%s: file is %lld bytes, too short for the 8-byte header length", path,
                (long long)st.st_size);
        close(fd);
        goto fail;
    }
    f->map_size = (size_t)st.st_size;
    void *m = mmap(NULL, f->map_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int merr = errno;
    close(fd);
    if (m == MAP_FAILED) {
        ct_fail(e, CT_ERR_IO, "%s: cannot mmap: %s", path, strerror(merr));
        goto fail;
    }
    f->map = m;
    const unsigned char *b = m;
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | b[i];
    if (hlen > ST_MAX_HEADER) {
        ct_fail(e, CT_ERR_FORMAT, "%s: header length %llu exceeds the 100000000-byte limit", path,
                (unsigned long long)hlen);
        goto fail;
    }
    if (hlen > f->map_size - 8) {
        ct_fail(e, CT_ERR_FORMAT, "%s: header length %llu runs past the end of the file (%zu bytes; truncated?)",
                path, (unsigned long long)hlen, f->map_size);
        goto fail;
    }
    if (st_parse_header(f, (const char *)b + 8, (size_t)hlen, f->map_size - 8 - (size_t)hlen, e)) goto fail;
    return f;
fail:
    st_free_partial(f);
    return NULL;
}

void st_close(st_file *f) { st_free_partial(f); }
int st_count(const st_file *f) { return f->n; }
const st_tensor *st_get(const st_file *f, int i) { return (i >= 0 && i < f->n) ? &f->ts[i] : NULL; }
void st_drop(const st_tensor *t) {
    if (!t->nbytes) return;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    uintptr_t lo = (uintptr_t)t->data / page * page, hi = (uintptr_t)t->data + t->nbytes;
    /* a read-only file mapping: dropping a page shared with a neighbour only costs a re-read */
    madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

const char *st_path(const st_file *f) { return f->path; }

const st_tensor *st_find(const st_file *f, const char *name) {
    const st_tensor *const *r = bsearch(name, f->by_name, (size_t)f->n, sizeof *f->by_name, st_cmp_key_tensor);
    return r ? *r : NULL;
}

const char *st_metadata(const st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

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

static char *st_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = ct_malloc(a + b + 2);
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
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

static char *st_read_small_file(const char *path, size_t limit, size_t *len, ct_err *e) {
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fileno(fp), &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size > limit) {
        ct_fail(e, CT_ERR_FORMAT, "%s: not a regular file of at most %zu bytes", path, limit);
        fclose(fp);
        return NULL;
    }
    size_t n = (size_t)st.st_size;
    char *buf = ct_malloc(n + 1);
    size_t got = fread(buf, 1, n, fp);
    int bad = ferror(fp);
    fclose(fp);
    if (got != n || bad) {
        free(buf);
        ct_fail(e, CT_ERR_IO, "%s: read error", path);
        return NULL;
    }
    buf[n] = 0;
    *len = n;
    return buf;
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
static int st_cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int st_plain_name(const char *s) {
    return *s && !strchr(s, '/') && !strstr(s, "..");
}

static int st_set_open_index(st_set *s, const char *dir, const char *ipath, ct_err *e) {
    size_t len;
    char *txt = st_read_small_file(ipath, ST_MAX_INDEX, &len, e);
    if (!txt) return e ? e->code : CT_ERR_IO;
    int rc = 0;
    st_wm *wm = NULL;
    const char **shards = NULL;
    cJSON *root = cJSON_ParseWithLength(txt, len);
    if (!root || !cJSON_IsObject(root)) {
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
        char *sp = st_join(dir, shards[i]);
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
    char *ipath = st_join(dir, "model.safetensors.index.json");
    char *fpath = st_join(dir, "model.safetensors");
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

/* --------------------------------------------------------------- writing */

typedef struct {
    char *p;
    size_t n, cap;
} st_buf;

static void sb_put(st_buf *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) {
            fprintf(stderr, "ctitan: error: out of memory allocating %zu bytes\n", cap);
            exit(1);
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_puts(st_buf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_printf(st_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(st_buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    sb_put(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

/* JSON string literal; UTF-8 passes through, control bytes are escaped. */
static void sb_json_str(st_buf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (const unsigned char *q = (const unsigned char *)s; *q; q++) {
        if (*q == '"' || *q == '\\') {
            char esc[2] = {'\\', (char)*q};
            sb_put(b, esc, 2);
        } else if (*q == '\n' || *q == '\t' || *q == '\r') {
            char esc[2] = {'\\', *q == '\n' ? 'n' : *q == '\t' ? 't' : 'r'};
            sb_put(b, esc, 2);
        } else if (*q < 0x20) {
            sb_printf(b, "\\u%04x", *q);
        } else {
            sb_put(b, (const char *)q, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static int st_cmp_cstr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Checks every tensor before any byte is written; sizes[i] gets stored bytes. */
static int st_wvalidate(const char *path, const st_wtensor *ts, int n, const char *const *meta, uint64_t *sizes,
                        int need_data, ct_err *e) {
    if (n < 0) return ct_fail(e, CT_ERR_IO, "%s: negative tensor count", path);
    if (meta)
        for (int i = 0; meta[i]; i += 2)
            if (!meta[i + 1]) return ct_fail(e, CT_ERR_IO, "%s: metadata key '%s' has no value", path, meta[i]);
    for (int i = 0; i < n; i++) {
        const st_wtensor *t = &ts[i];
        if (!t->name || !*t->name || strcmp(t->name, "__metadata__") == 0)
            return ct_fail(e, CT_ERR_IO, "%s: tensor %d has an empty or reserved name", path, i);
        if ((unsigned)t->dtype >= CT_DTYPE_COUNT || (unsigned)t->src_dtype >= CT_DTYPE_COUNT)
            return ct_fail(e, CT_ERR_IO, "%s: tensor '%s': invalid dtype", path, t->name);
        if (t->dtype != t->src_dtype &&
            !(t->src_dtype == CT_F32 && (t->dtype == CT_BF16 || t->dtype == CT_F16)))
            return ct_fail(e, CT_ERR_IO, "%s: tensor '%s': cannot store %s data as %s", path, t->name,
                           ct_dtype_name(t->src_dtype), ct_dtype_name(t->dtype));
        if (t->ndim < 0 || t->ndim > ST_MAX_DIMS)
            return ct_fail(e, CT_ERR_IO, "%s: tensor '%s': %d dims, at most %d supported", path, t->name, t->ndim,
                           ST_MAX_DIMS);
        uint64_t numel = 1;
        for (int k = 0; k < t->ndim; k++) {
            if (t->shape[k] < 0)
                return ct_fail(e, CT_ERR_IO, "%s: tensor '%s': negative shape[%d]", path, t->name, k);
            if (__builtin_mul_overflow(numel, (uint64_t)t->shape[k], &numel))
                return ct_fail(e, CT_ERR_IO, "%s: tensor '%s': element count overflows", path, t->name);
        }
        if (__builtin_mul_overflow(numel, (uint64_t)ct_dtype_size(t->dtype), &sizes[i]) ||
            sizes[i] >= (uint64_t)ST_EXACT_LIMIT)
            return ct_fail(e, CT_ERR_IO, "%s: tensor '%s': byte size overflows", path, t->name);
        if (numel && need_data && !t->data) return ct_fail(e, CT_ERR_IO, "%s: tensor '%s': no data", path, t->name);
    }
    const char **names = ct_malloc(((size_t)n + 1) * sizeof *names);
    for (int i = 0; i < n; i++) names[i] = ts[i].name;
    qsort(names, (size_t)n, sizeof *names, st_cmp_cstr);
    int rc = 0;
    for (int i = 1; i < n && !rc; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            rc = ct_fail(e, CT_ERR_IO, "%s: tensor '%s' given twice", path, names[i]);
    free(names);
    return rc;
}

static void st_dirname(const char *path, char *out, size_t cap) {
    const char *sl = strrchr(path, '/');
    if (!sl) {
        snprintf(out, cap, ".");
    } else if (sl == path) {
        snprintf(out, cap, "/");
    } else {
        snprintf(out, cap, "%.*s", (int)(sl - path), path);
    }
}

/* Makes a rename durable. Filesystems that cannot fsync a directory say EINVAL. */
static int st_fsync_dir(const char *path, ct_err *e) {
    char d[4096];
    st_dirname(path, d, sizeof d);
    int fd = open(d, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot open its directory to sync: %s", path, strerror(errno));
    int rc = 0;
    if (fsync(fd) != 0 && errno != EINVAL)
        rc = ct_fail(e, CT_ERR_IO, "%s: cannot sync its directory: %s", path, strerror(errno));
    close(fd);
    return rc;
}

/* Writes `len` bytes produced by `body` to PATH.tmp, syncs and renames it. */
typedef int (*st_body_fn)(FILE *fp, const void *ctx);

static int st_atomic_write(const char *path, const char *head, size_t head_len, st_body_fn body, const void *ctx,
                           ct_err *e) {
    size_t pl = strlen(path);
    char *tmp = ct_malloc(pl + 5);
    memcpy(tmp, path, pl);
    memcpy(tmp + pl, ".tmp", 5);
    FILE *fp = fopen(tmp, "wb");
    if (!fp) {
        int rc = ct_fail(e, CT_ERR_IO, "%s: cannot create %s: %s", path, tmp, strerror(errno));
        free(tmp);
        return rc;
    }
    int ok = fwrite(head, 1, head_len, fp) == head_len;
    if (ok && body) ok = body(fp, ctx) == 0;
    if (ok) ok = fflush(fp) == 0;
    if (ok) ok = fsync(fileno(fp)) == 0;
    int err = errno;
    if (fclose(fp) != 0 && ok) {
        ok = 0;
        err = errno;
    }
    if (ok && rename(tmp, path) != 0) {
        ok = 0;
        err = errno;
    }
    if (!ok) {
        unlink(tmp);
        free(tmp);
        return ct_fail(e, CT_ERR_IO, "%s: write failed: %s", path, strerror(err ? err : EIO));
    }
    free(tmp);
    return st_fsync_dir(path, e);
}

typedef struct {
    const st_wtensor *ts;
    int n;
    const uint64_t *sizes;
    const int *order; /* data order */
} st_body;

#define ST_CHUNK 16384 /* elements converted per fwrite */

static int st_write_tensors(FILE *fp, const void *ctx) {
    const st_body *b = ctx;
    void *conv = NULL;
    int rc = 0;
    for (int j = 0; j < b->n && !rc; j++) {
        int i = b->order[j];
        const st_wtensor *t = &b->ts[i];
        size_t nb = (size_t)b->sizes[i];
        if (nb == 0) continue;
        if (t->dtype == t->src_dtype) {
            if (fwrite(t->data, 1, nb, fp) != nb) rc = -1;
            continue;
        }
        if (!conv) conv = ct_malloc(ST_CHUNK * 4);
        size_t numel = nb / ct_dtype_size(t->dtype), es = ct_dtype_size(t->dtype);
        const float *src = t->data;
        for (size_t off = 0; off < numel && !rc; off += ST_CHUNK) {
            size_t k = numel - off < ST_CHUNK ? numel - off : ST_CHUNK;
            ct_convert_from_f32(conv, t->dtype, src + off, k);
            if (fwrite(conv, es, k, fp) != k) rc = -1;
        }
    }
    free(conv);
    return rc;
}

/* The file's first bytes (8-byte length, then the header padded to 8) in
 * *all (malloc'd, *all_len bytes); order[n] gets the data order. */
static int st_header(const char *path, const st_wtensor *ts, int n, const char *const *meta, const uint64_t *sizes,
                     int *order, char **all, size_t *all_len, ct_err *e) {
    st_buf h = {0};
    sb_puts(&h, "{");
    int first = 1;
    if (meta && meta[0]) {
        sb_puts(&h, "\"__metadata__\":{");
        for (int i = 0; meta[i]; i += 2) {
            if (i) sb_puts(&h, ",");
            sb_json_str(&h, meta[i]);
            sb_puts(&h, ":");
            sb_json_str(&h, meta[i + 1]);
        }
        sb_puts(&h, "}");
        first = 0;
    }
    /* Data goes in order of falling element size (stable), as the HF writer
     * does: with the header padded to 8 every tensor is then aligned to its
     * element size in the file and in the mapping. The header keeps the
     * caller's order. */
    uint64_t *offs = ct_malloc(((size_t)n + 1) * sizeof *offs);
    int k = 0;
    for (size_t es = 8; es >= 1; es /= 2)
        for (int i = 0; i < n; i++)
            if (ct_dtype_size(ts[i].dtype) == es) order[k++] = i;
    uint64_t off = 0;
    for (int j = 0; j < n; j++) {
        offs[order[j]] = off;
        off += sizes[order[j]];
    }
    for (int i = 0; i < n; i++) {
        if (!first) sb_puts(&h, ",");
        first = 0;
        sb_json_str(&h, ts[i].name);
        sb_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", ct_dtype_name(ts[i].dtype));
        for (int k = 0; k < ts[i].ndim; k++) sb_printf(&h, k ? ",%lld" : "%lld", (long long)ts[i].shape[k]);
        sb_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offs[i],
                  (unsigned long long)(offs[i] + sizes[i]));
    }
    free(offs);
    sb_puts(&h, "}");
    while (h.n % 8) sb_puts(&h, " ");
    if (h.n > ST_MAX_HEADER) {
        free(h.p);
        return ct_fail(e, CT_ERR_IO, "%s: header of %zu bytes exceeds the safetensors limit", path, h.n);
    }
    /* prefix the 8-byte little-endian length */
    *all = ct_malloc(h.n + 8);
    for (int i = 0; i < 8; i++) (*all)[i] = (char)((uint64_t)h.n >> (8 * i));
    memcpy(*all + 8, h.p, h.n);
    *all_len = h.n + 8;
    free(h.p);
    return 0;
}

static int st_write_checked(const char *path, const st_wtensor *ts, int n, const char *const *meta,
                            const uint64_t *sizes, ct_err *e) {
    int *order = ct_malloc(((size_t)n + 1) * sizeof *order);
    char *all = NULL;
    size_t all_len = 0;
    int rc = st_header(path, ts, n, meta, sizes, order, &all, &all_len, e);
    st_body body = {ts, n, sizes, order};
    if (!rc) rc = st_atomic_write(path, all, all_len, st_write_tensors, &body, e);
    free(order);
    free(all);
    return rc;
}

int st_write(const char *path, const st_wtensor *ts, int n, const char *const *meta, ct_err *e) {
    uint64_t *sizes = ct_malloc(((size_t)(n > 0 ? n : 0) + 1) * sizeof *sizes);
    int rc = st_wvalidate(path, ts, n, meta, sizes, 1, e);
    if (!rc) rc = st_write_checked(path, ts, n, meta, sizes, e);
    free(sizes);
    return rc;
}

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
        char *p = st_join(dir, de->d_name);
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
    sb_printf(&idx, "{\n  \"metadata\": {\n    \"total_size\": %llu\n  },\n  \"weight_map\": {",
              (unsigned long long)total);
    for (int s = 0; s < ns; s++) {
        char name[64];
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", s + 1, ns);
        for (int i = first[s]; i < first[s + 1]; i++) {
            sb_puts(&idx, i ? ",\n    " : "\n    ");
            sb_json_str(&idx, ts[i].name);
            sb_puts(&idx, ": ");
            sb_json_str(&idx, name);
        }
    }
    sb_puts(&idx, "\n  }\n}\n");
    int rc = st_atomic_write(ipath, idx.p, idx.n, NULL, NULL, e);
    free(idx.p);
    return rc;
}

int st_write_dir(const char *dir, const st_wtensor *ts, int n, size_t max_shard_bytes, const char *const *meta,
                 ct_err *e) {
    uint64_t *sizes = ct_malloc(((size_t)(n > 0 ? n : 0) + 1) * sizeof *sizes);
    int *first = NULL;
    char *ipath = st_join(dir, "model.safetensors.index.json");
    char *fpath = st_join(dir, "model.safetensors");
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
        char *sp = st_join(dir, name);
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

/* ------------------------------------------------------- streamed writing */

/* The header is known up front, so it is written first and the data follows
 * as the caller produces it: no buffer the size of the file. The stream
 * tracks which tensor (in data order) the next element belongs to, so a
 * caller may hand over any run of elements, across tensor boundaries. */
struct st_stream {
    char *path, *tmp;
    FILE *fp;
    int n, j;         /* tensors; the one (in data order) being written */
    int *order;       /* [n] data order */
    uint64_t *sizes;  /* [n] stored bytes */
    ct_dtype *dtype;  /* [2 n] stored, then source dtype of each tensor */
    uint64_t done;    /* bytes of tensor order[j] written */
    void *conv;       /* [ST_CHUNK] conversion scratch */
};

static void st_stream_free(st_stream *s) {
    free(s->path);
    free(s->tmp);
    free(s->order);
    free(s->sizes);
    free(s->dtype);
    free(s->conv);
    free(s);
}

int st_stream_open(st_stream **out, const char *path, const st_wtensor *ts, int n, const char *const *meta,
                   ct_err *e) {
    *out = NULL;
    uint64_t *sizes = ct_malloc(((size_t)(n > 0 ? n : 0) + 1) * sizeof *sizes);
    int rc = st_wvalidate(path, ts, n, meta, sizes, 0, e);
    if (rc) {
        free(sizes);
        return rc;
    }
    st_stream *s = ct_calloc(1, sizeof *s);
    s->n = n;
    s->sizes = sizes;
    s->order = ct_malloc(((size_t)n + 1) * sizeof *s->order);
    s->dtype = ct_malloc(((size_t)2 * n + 1) * sizeof *s->dtype);
    for (int i = 0; i < n; i++) {
        s->dtype[i] = ts[i].dtype;
        s->dtype[n + i] = ts[i].src_dtype;
    }
    char *all = NULL;
    size_t all_len = 0;
    if ((rc = st_header(path, ts, n, meta, sizes, s->order, &all, &all_len, e))) {
        st_stream_free(s);
        return rc;
    }
    size_t pl = strlen(path);
    s->path = ct_malloc(pl + 1);
    memcpy(s->path, path, pl + 1);
    s->tmp = ct_malloc(pl + 5);
    memcpy(s->tmp, path, pl);
    memcpy(s->tmp + pl, ".tmp", 5);
    s->fp = fopen(s->tmp, "wb");
    if (!s->fp) {
        rc = ct_fail(e, CT_ERR_IO, "%s: cannot create %s: %s", path, s->tmp, strerror(errno));
    } else if (fwrite(all, 1, all_len, s->fp) != all_len) {
        rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", path, strerror(errno ? errno : EIO));
        st_stream_abort(s);
        s = NULL;
    }
    free(all);
    if (rc && s) st_stream_free(s);
    else *out = s;
    return rc;
}

/* Moves past finished (or empty) tensors. */
static void st_stream_skip(st_stream *s) {
    while (s->j < s->n && s->done == s->sizes[s->order[s->j]]) {
        s->j++;
        s->done = 0;
    }
}

int st_stream_write(st_stream *s, const void *src, size_t numel, ct_err *e) {
    const char *p = src;
    while (numel) {
        st_stream_skip(s);
        if (s->j == s->n)
            return ct_fail(e, CT_ERR_IO, "%s: %zu elements more than its header declares", s->path, numel);
        int i = s->order[s->j];
        ct_dtype dt = s->dtype[i], sdt = s->dtype[s->n + i];
        size_t es = ct_dtype_size(dt), ses = ct_dtype_size(sdt);
        size_t left = (size_t)((s->sizes[i] - s->done) / es), k = numel < left ? numel : left;
        int ok = 1;
        if (dt == sdt) {
            ok = fwrite(p, es, k, s->fp) == k;
        } else {
            if (!s->conv) s->conv = ct_malloc(ST_CHUNK * 4);
            for (size_t off = 0; off < k && ok; off += ST_CHUNK) {
                size_t c = k - off < ST_CHUNK ? k - off : ST_CHUNK;
                ct_convert_from_f32(s->conv, dt, (const float *)p + off, c);
                ok = fwrite(s->conv, es, c, s->fp) == c;
            }
        }
        if (!ok) return ct_fail(e, CT_ERR_IO, "%s: write failed: %s", s->tmp, strerror(errno ? errno : EIO));
        s->done += (uint64_t)k * es;
        p += k * ses;
        numel -= k;
    }
    return 0;
}

int st_stream_close(st_stream *s, ct_err *e) {
    st_stream_skip(s);
    if (s->j < s->n) {
        int rc = ct_fail(e, CT_ERR_IO, "%s: closed before tensor %d of %d had all its data", s->path, s->j + 1, s->n);
        st_stream_abort(s);
        return rc;
    }
    int ok = fflush(s->fp) == 0 && fsync(fileno(s->fp)) == 0;
    int err = errno;
    if (fclose(s->fp) != 0 && ok) {
        ok = 0;
        err = errno;
    }
    if (ok && rename(s->tmp, s->path) != 0) {
        ok = 0;
        err = errno;
    }
    int rc = 0;
    if (!ok) {
        unlink(s->tmp);
        rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", s->path, strerror(err ? err : EIO));
    } else {
        rc = st_fsync_dir(s->path, e);
    }
    st_stream_free(s);
    return rc;
}

void st_stream_abort(st_stream *s) {
    if (!s) return;
    if (s->fp) fclose(s->fp);
    unlink(s->tmp);
    st_stream_free(s);
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
            char *sp = st_join(d->dir, name);
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
    char *ipath = st_join(d->dir, "model.safetensors.index.json");
    char *fpath = st_join(d->dir, "model.safetensors");
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
