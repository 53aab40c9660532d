/* formats/st_write.c: the safetensors writer, one file, given whole
 * (st_write) or streamed piece by piece (st_stream).
 *
 * Why a file of its own: writing shares nothing with reading but the format
 * (st_read.c), and directories of shards are planned in st_index.c, which
 * calls in here for each file.
 *
 * Design notes.
 * - The header is built by hand rather than with cJSON: cJSON prints large
 *   integers in exponent form ("1e+15"), which the Rust reader rejects.
 * - Data is streamed tensor by tensor; F32 -> BF16/F16 conversion goes
 *   through a small fixed buffer so no model-sized temporary ever exists.
 * - PATH.tmp is written, fsynced, renamed, and the directory fsynced
 *   (core/fs.h fs_atomic), so the final name only ever holds a complete file.
 * - Data is written in host order (little-endian: the machines ctitan
 *   targets) by falling element size, so every tensor is aligned to its
 *   element size in the file and in a reader's mapping. */
#include "formats/safetensors.h"
#include "formats/st_priv.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/fs.h"

/* --------------------------------------------------------------- writing */

static void st_sb_put(st_buf *b, const char *s, size_t n) {
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

void st_sb_puts(st_buf *b, const char *s) { st_sb_put(b, s, strlen(s)); }

void st_sb_printf(st_buf *b, const char *fmt, ...) {
    char tmp[128];
    va_list ap;
    va_start(ap, fmt);
    int k = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    st_sb_put(b, tmp, (size_t)k < sizeof tmp ? (size_t)k : sizeof tmp - 1);
}

void st_sb_json_str(st_buf *b, const char *s) {
    st_sb_put(b, "\"", 1);
    for (const unsigned char *q = (const unsigned char *)s; *q; q++) {
        if (*q == '"' || *q == '\\') {
            char esc[2] = {'\\', (char)*q};
            st_sb_put(b, esc, 2);
        } else if (*q == '\n' || *q == '\t' || *q == '\r') {
            char esc[2] = {'\\', *q == '\n' ? 'n' : *q == '\t' ? 't' : 'r'};
            st_sb_put(b, esc, 2);
        } else if (*q < 0x20) {
            st_sb_printf(b, "\\u%04x", *q);
        } else {
            st_sb_put(b, (const char *)q, 1);
        }
    }
    st_sb_put(b, "\"", 1);
}


int st_cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int st_wvalidate(const char *path, const st_wtensor *ts, int n, const char *const *meta, uint64_t *sizes,
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
    qsort(names, (size_t)n, sizeof *names, st_cmp_str);
    int rc = 0;
    for (int i = 1; i < n && !rc; i++)
        if (strcmp(names[i - 1], names[i]) == 0)
            rc = ct_fail(e, CT_ERR_IO, "%s: tensor '%s' given twice", path, names[i]);
    free(names);
    return rc;
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

/* The header, then the data, as PATH (through PATH.tmp: core/fs.h). */
static int st_atomic_write(const char *path, const char *head, size_t head_len, const st_body *body, ct_err *e) {
    fs_atomic a;
    int rc = fs_atomic_open(&a, path, e);
    if (rc) return rc;
    if (fwrite(head, 1, head_len, a.fp) != head_len || st_write_tensors(a.fp, body) != 0) {
        rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", path, strerror(errno ? errno : EIO));
        fs_atomic_abort(&a);
        return rc;
    }
    return fs_atomic_commit(&a, e);
}

/* The file's first bytes (8-byte length, then the header padded to 8) in
 * *all (malloc'd, *all_len bytes); order[n] gets the data order. */
static int st_header(const char *path, const st_wtensor *ts, int n, const char *const *meta, const uint64_t *sizes,
                     int *order, char **all, size_t *all_len, uint64_t *offs_out, ct_err *e) {
    st_buf h = {0};
    st_sb_puts(&h, "{");
    int first = 1;
    if (meta && meta[0]) {
        st_sb_puts(&h, "\"__metadata__\":{");
        for (int i = 0; meta[i]; i += 2) {
            if (i) st_sb_puts(&h, ",");
            st_sb_json_str(&h, meta[i]);
            st_sb_puts(&h, ":");
            st_sb_json_str(&h, meta[i + 1]);
        }
        st_sb_puts(&h, "}");
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
        if (!first) st_sb_puts(&h, ",");
        first = 0;
        st_sb_json_str(&h, ts[i].name);
        st_sb_printf(&h, ":{\"dtype\":\"%s\",\"shape\":[", ct_dtype_name(ts[i].dtype));
        for (int d = 0; d < ts[i].ndim; d++) st_sb_printf(&h, d ? ",%lld" : "%lld", (long long)ts[i].shape[d]);
        st_sb_printf(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offs[i],
                  (unsigned long long)(offs[i] + sizes[i]));
    }
    if (offs_out) memcpy(offs_out, offs, (size_t)n * sizeof *offs);
    free(offs);
    st_sb_puts(&h, "}");
    while (h.n % 8) st_sb_puts(&h, " ");
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

int st_write_checked(const char *path, const st_wtensor *ts, int n, const char *const *meta, const uint64_t *sizes,
                     ct_err *e) {
    int *order = ct_malloc(((size_t)n + 1) * sizeof *order);
    char *all = NULL;
    size_t all_len = 0;
    int rc = st_header(path, ts, n, meta, sizes, order, &all, &all_len, NULL, e);
    st_body body = {ts, n, sizes, order};
    if (!rc) rc = st_atomic_write(path, all, all_len, &body, e);
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

/* ------------------------------------------------------- streamed writing */

/* The header is known up front, so it is written first and the data follows
 * as the caller produces it: no buffer the size of the file. The stream
 * tracks which tensor (in data order) the next element belongs to, so a
 * caller may hand over any run of elements, across tensor boundaries. */
struct st_stream {
    fs_atomic out;    /* PATH.tmp, renamed to PATH at close */
    int n, j;         /* tensors; the one (in data order) being written */
    int *order;       /* [n] data order */
    uint64_t *sizes;  /* [n] stored bytes */
    ct_dtype *dtype;  /* [2 n] stored, then source dtype of each tensor */
    uint64_t done;    /* bytes of tensor order[j] written */
    void *conv;       /* [ST_CHUNK] conversion scratch */
};

static void st_stream_free(st_stream *s) {
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
    if ((rc = st_header(path, ts, n, meta, sizes, s->order, &all, &all_len, NULL, e))) {
        st_stream_free(s);
        return rc;
    }
    rc = fs_atomic_open(&s->out, path, e);
    if (!rc && fwrite(all, 1, all_len, s->out.fp) != all_len)
        rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", path, strerror(errno ? errno : EIO));
    free(all);
    if (rc) st_stream_abort(s);
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
            return ct_fail(e, CT_ERR_IO, "%s: %zu elements more than its header declares", s->out.path, numel);
        int i = s->order[s->j];
        ct_dtype dt = s->dtype[i], sdt = s->dtype[s->n + i];
        size_t es = ct_dtype_size(dt), ses = ct_dtype_size(sdt);
        size_t left = (size_t)((s->sizes[i] - s->done) / es), k = numel < left ? numel : left;
        int ok = 1;
        if (dt == sdt) {
            ok = fwrite(p, es, k, s->out.fp) == k;
        } else {
            if (!s->conv) s->conv = ct_malloc(ST_CHUNK * 4);
            for (size_t off = 0; off < k && ok; off += ST_CHUNK) {
                size_t c = k - off < ST_CHUNK ? k - off : ST_CHUNK;
                ct_convert_from_f32(s->conv, dt, (const float *)p + off, c);
                ok = fwrite(s->conv, es, c, s->out.fp) == c;
            }
        }
        if (!ok) return ct_fail(e, CT_ERR_IO, "%s: write failed: %s", s->out.tmp, strerror(errno ? errno : EIO));
        s->done += (uint64_t)k * es;
        p += k * ses;
        numel -= k;
    }
    return 0;
}

int st_stream_close(st_stream *s, ct_err *e) {
    st_stream_skip(s);
    if (s->j < s->n) {
        int rc = ct_fail(e, CT_ERR_IO, "%s: closed before tensor %d of %d had all its data", s->out.path, s->j + 1,
                         s->n);
        st_stream_abort(s);
        return rc;
    }
    int rc = fs_atomic_commit(&s->out, e);
    st_stream_free(s);
    return rc;
}

void st_stream_abort(st_stream *s) {
    if (!s) return;
    fs_atomic_abort(&s->out);
    st_stream_free(s);
}

int st_layout(const char *path, const st_wtensor *ts, int n, const char *const *meta, char **head, size_t *head_len,
              uint64_t *offs, uint64_t *total, ct_err *e) {
    *head = NULL;
    uint64_t *sizes = ct_malloc(((size_t)(n > 0 ? n : 0) + 1) * sizeof *sizes);
    int *order = ct_malloc(((size_t)(n > 0 ? n : 0) + 1) * sizeof *order);
    int rc = st_wvalidate(path, ts, n, meta, sizes, 0, e);
    if (!rc) rc = st_header(path, ts, n, meta, sizes, order, head, head_len, offs, e);
    if (!rc) {
        *total = *head_len;
        for (int i = 0; i < n; i++) {
            offs[i] += *head_len; /* from the data's start to the file's */
            *total += sizes[i];
        }
    }
    free(order);
    free(sizes);
    return rc;
}
