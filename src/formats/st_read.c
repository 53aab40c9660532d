/* formats/st_read.c: the safetensors reader (mmap) and a file's lookups.
 *
 * Why a file of its own: the format is split three ways (this reader,
 * st_write.c for one file written, st_index.c for sharded directories) so
 * the checks of untrusted input are read, and changed, on their own.
 *
 * Design notes.
 * - The whole file is mapped read-only and the fd closed at once; a
 *   tensor's `data` points into the mapping, so opening a 60 GB checkpoint
 *   costs no copies and pages come in only when a tensor is converted.
 * - The header is untrusted. It is copied into a NUL-terminated buffer before
 *   cJSON sees it (cJSON never reads near the mapping's end), and every field
 *   is checked before a single tensor is exposed: well-formed UTF-8 (as the
 *   Rust reader's from_utf8), known dtype, non-negative shape and offsets
 *   written as integers (not 32.0: json_is_integer) and below 2^53 (cJSON
 *   stores numbers as doubles, beyond that they are not exact), numel without overflow, offsets
 *   inside the buffer, end - begin matching the shape, and the tensors tiling
 *   the buffer exactly (what the Hugging Face reader requires). Tensor entries
 *   with unknown or repeated fields are rejected rather than guessed at.
 * - Names and metadata are copied out and the JSON tree freed: the tree of a
 *   big header is many times its size, and the names must outlive parsing.
 * - Lookup is bsearch over an array sorted by name; sorting also finds
 *   duplicate names.
 * - Data is little-endian on disk and is read as host order: the machines
 *   ctitan targets are little-endian. Files from elsewhere are only as
 *   aligned as their writer made them (HF's are, as st_write.c's are), so
 *   readers of foreign files should not assume more than byte alignment. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* mmap, madvise under -std=c11 */
#endif
#include "formats/safetensors.h"
#include "formats/st_priv.h"
#include "formats/json.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

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

/* A JSON number that is an exact non-negative integer below 2^53: -1 when
 * not, -2 for one written as a float ("32.0", "3.2e1"), which the Rust
 * reader refuses as it refuses 32.5 (serde: "expected usize"). */
static int st_json_uint(const cJSON *v, uint64_t *out) {
    if (!json_int_in(v, 0.0, ST_EXACT_LIMIT - 1)) return -1;
    if (!json_is_integer(v)) return -2;
    *out = (uint64_t)v->valuedouble;
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
        int bad = st_json_uint(v, &dim);
        if (bad == -2)
            return ct_fail(e, CT_ERR_FORMAT, "%s: tensor '%s': shape[%d] is written as a float (%.1f), not an integer",
                           p, nm, k, v->valuedouble);
        if (bad)
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
    for (int i = 0; i < 2; i++) {
        const cJSON *v = i ? off->child->next : off->child;
        int bad = st_json_uint(v, i ? end : begin);
        if (bad == -2)
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: tensor '%s': data_offsets[%d] is written as a float (%.1f), not an integer", p, nm, i,
                           v->valuedouble);
        if (bad)
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: tensor '%s': data_offsets are not non-negative integers below 2^53", p, nm);
    }
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
    size_t bad = json_bad_byte(buf, hlen);
    cJSON *root = bad < hlen ? NULL : cJSON_ParseWithLengthOpts(buf, hlen, &endp, 0);
    int rc = 0;
    uint64_t *begins = NULL, *ends = NULL;
    if (bad < hlen) {
        unsigned char b = (unsigned char)buf[bad];
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: header is not valid JSON (%s 0x%02x at header byte %zu)", f->path,
                     b < 0x80 ? "control byte" : "invalid UTF-8: byte", b, bad);
        goto out;
    }
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
    size_t at;
    if (json_mark_numbers(root, buf, hlen, &at)) { /* for json_is_integer; refuses "01" and "1." */
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: header is not valid JSON (invalid number at header byte %zu)", f->path, at);
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
uint64_t st_data_offset(const st_file *f, const st_tensor *t) {
    return t->data ? (uint64_t)((const char *)t->data - (const char *)f->map) : f->map_size;
}

const st_tensor *st_find(const st_file *f, const char *name) {
    const st_tensor *const *r = bsearch(name, f->by_name, (size_t)f->n, sizeof *f->by_name, st_cmp_key_tensor);
    return r ? *r : NULL;
}

const char *st_metadata(const st_file *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}
