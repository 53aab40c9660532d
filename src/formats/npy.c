/* formats/npy.c: .npy integer arrays -> uint32.
 *
 * Design notes.
 * - The header is a Python dict literal. It is parsed with a tiny recursive
 *   descent over exactly what np.save writes (quoted keys, a quoted descr,
 *   True/False, a tuple of ints, optional trailing commas) and nothing else:
 *   no evaluation, no escapes, each of the three keys exactly once.
 * - The data size must equal what the shape and dtype promise: a file cut
 *   short or with trailing bytes is corrupt, not "probably fine".
 * - Data is streamed through a fixed buffer and converted element by element,
 *   so the only large allocation is the uint32 result itself; every value is
 *   range-checked because a silent wrap of a token id trains on garbage.
 * - Little-endian host assumed ('<' and '=' read the same way). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* fileno under -std=c11 */
#endif
#include "formats/npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define NPY_MAX_HEADER (1u << 20)
#define NPY_MAX_DIMS 64 /* numpy's own limit */

typedef struct {
    const char *p, *end;
} npy_cur;

static void npy_ws(npy_cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r')) c->p++;
}

static int npy_lit(npy_cur *c, char ch) {
    npy_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A quoted string without escapes; copied into out (cap bytes). */
static int npy_str(npy_cur *c, char *out, size_t cap) {
    npy_ws(c);
    if (c->p >= c->end || (*c->p != '\'' && *c->p != '"')) return -1;
    char q = *c->p++;
    size_t k = 0;
    while (c->p < c->end && *c->p != q) {
        if (*c->p == '\\' || k + 1 >= cap) return -1;
        out[k++] = *c->p++;
    }
    if (c->p >= c->end) return -1;
    c->p++;
    out[k] = 0;
    return 0;
}

static int npy_word(npy_cur *c, const char *w) {
    npy_ws(c);
    size_t n = strlen(w);
    if ((size_t)(c->end - c->p) < n || memcmp(c->p, w, n) != 0) return 0;
    c->p += n;
    return 1;
}

/* '(' [int (',' int)* [',']] ')'; a single element needs its comma, as in Python. */
static int npy_shape(npy_cur *c, uint64_t *shape, int *ndim) {
    if (!npy_lit(c, '(')) return -1;
    int nd = 0, trailing_comma = 0;
    for (;;) {
        if (npy_lit(c, ')')) break;
        if (nd && !trailing_comma) return -1;
        npy_ws(c);
        if (c->p >= c->end || *c->p < '0' || *c->p > '9') return -1;
        uint64_t v = 0;
        while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
            if (v > (UINT64_MAX - 9) / 10) return -1;
            v = v * 10 + (uint64_t)(*c->p++ - '0');
        }
        if (c->p < c->end && *c->p == 'L') c->p++; /* Python 2 longs */
        if (nd >= NPY_MAX_DIMS) return -1;
        shape[nd++] = v;
        trailing_comma = npy_lit(c, ',');
    }
    if (nd == 1 && !trailing_comma) return -1;
    *ndim = nd;
    return 0;
}

typedef struct {
    int size;     /* bytes per element */
    int is_signed;
} npy_dtype;

static int npy_parse_descr(const char *path, const char *d, npy_dtype *t, ct_err *e) {
    char bo = d[0];
    if (bo == 0 || !strchr("<>=|", bo))
        return ct_fail(e, CT_ERR_FORMAT, "%s: dtype '%s' has no byte-order character", path, d);
    char kind = d[1];
    if (kind != 'i' && kind != 'u')
        return ct_fail(e, CT_ERR_FORMAT, "%s: dtype '%s' is not an integer type (i1/u1/i2/u2/i4/u4/i8/u8)", path,
                       d);
    int sz = (d[2] && !d[3]) ? d[2] - '0' : -1;
    if (sz != 1 && sz != 2 && sz != 4 && sz != 8)
        return ct_fail(e, CT_ERR_FORMAT, "%s: dtype '%s' has an unsupported size", path, d);
    if (bo == '>' && sz > 1)
        return ct_fail(e, CT_ERR_FORMAT, "%s: dtype '%s' is big-endian; resave it little-endian", path, d);
    t->size = sz;
    t->is_signed = kind == 'i';
    return 0;
}

static int npy_parse_header(const char *path, const char *h, size_t len, npy_dtype *dt, uint64_t *numel,
                            ct_err *e) {
    npy_cur c = {h, h + len};
    char key[32], descr[32] = {0};
    int have_descr = 0, have_fo = 0, have_shape = 0, fortran = 0, ndim = 0;
    uint64_t shape[NPY_MAX_DIMS];
    if (memchr(h, 0, len)) return ct_fail(e, CT_ERR_FORMAT, "%s: header contains a NUL byte", path);
    if (!npy_lit(&c, '{')) return ct_fail(e, CT_ERR_FORMAT, "%s: header is not a dict literal", path);
    for (;;) {
        if (npy_lit(&c, '}')) break;
        if (npy_str(&c, key, sizeof key))
            return ct_fail(e, CT_ERR_FORMAT, "%s: header: expected a quoted key at byte %ld", path,
                           (long)(c.p - h));
        if (!npy_lit(&c, ':'))
            return ct_fail(e, CT_ERR_FORMAT, "%s: header: expected ':' after key '%s'", path, key);
        if (strcmp(key, "descr") == 0) {
            if (have_descr++) return ct_fail(e, CT_ERR_FORMAT, "%s: header: key 'descr' appears twice", path);
            if (npy_str(&c, descr, sizeof descr))
                return ct_fail(e, CT_ERR_FORMAT, "%s: header: 'descr' is not a simple dtype string", path);
        } else if (strcmp(key, "fortran_order") == 0) {
            if (have_fo++) return ct_fail(e, CT_ERR_FORMAT, "%s: header: key 'fortran_order' appears twice", path);
            if (npy_word(&c, "True")) fortran = 1;
            else if (!npy_word(&c, "False"))
                return ct_fail(e, CT_ERR_FORMAT, "%s: header: 'fortran_order' is not True or False", path);
        } else if (strcmp(key, "shape") == 0) {
            if (have_shape++) return ct_fail(e, CT_ERR_FORMAT, "%s: header: key 'shape' appears twice", path);
            if (npy_shape(&c, shape, &ndim))
                return ct_fail(e, CT_ERR_FORMAT, "%s: header: 'shape' is not a tuple of non-negative integers",
                               path);
        } else {
            return ct_fail(e, CT_ERR_FORMAT, "%s: header: unexpected key '%s'", path, key);
        }
        if (npy_lit(&c, ',')) continue;
        if (npy_lit(&c, '}')) break;
        return ct_fail(e, CT_ERR_FORMAT, "%s: header: expected ',' or '}' at byte %ld", path, (long)(c.p - h));
    }
    npy_ws(&c);
    if (c.p != c.end)
        return ct_fail(e, CT_ERR_FORMAT, "%s: header: unexpected bytes after the dict at byte %ld", path,
                       (long)(c.p - h));
    if (!have_descr || !have_fo || !have_shape)
        return ct_fail(e, CT_ERR_FORMAT, "%s: header lacks key '%s'", path,
                       !have_descr ? "descr" : !have_fo ? "fortran_order" : "shape");
    int rc = npy_parse_descr(path, descr, dt, e);
    if (rc) return rc;
    if (fortran)
        return ct_fail(e, CT_ERR_FORMAT, "%s: fortran_order arrays are not supported; save a C-order array",
                       path);
    uint64_t ne = 1;
    for (int i = 0; i < ndim; i++)
        if (__builtin_mul_overflow(ne, shape[i], &ne))
            return ct_fail(e, CT_ERR_FORMAT, "%s: shape element count overflows", path);
    *numel = ne;
    return 0;
}

static uint64_t npy_le(const unsigned char *b, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | b[i];
    return v;
}

/* Converts k elements; *bad_at receives the index (within the chunk) of the
 * first value outside uint32, or -1. */
static void npy_convert(const unsigned char *src, npy_dtype t, size_t k, uint32_t *dst, long long *bad_at,
                        int64_t *bad_val, int *bad_neg) {
    *bad_at = -1;
    for (size_t i = 0; i < k; i++) {
        uint64_t u = npy_le(src + i * (size_t)t.size, t.size);
        if (t.is_signed && t.size < 8 && (u >> (t.size * 8 - 1)) & 1) u |= ~0ull << (t.size * 8); /* sign-extend */
        int neg = t.is_signed && (int64_t)u < 0;
        if (neg || u > UINT32_MAX) {
            *bad_at = (long long)i;
            *bad_val = (int64_t)u;
            *bad_neg = neg;
            return;
        }
        dst[i] = (uint32_t)u;
    }
}

int npy_read_u32(const char *path, uint32_t **out, size_t *n, ct_err *e) {
    *out = NULL;
    *n = 0;
    FILE *fp = fopen(path, "rb");
    if (!fp) return ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    int rc = 0;
    char *hdr = NULL;
    uint32_t *res = NULL;
    unsigned char *buf = NULL;
    struct stat st;
    if (fstat(fileno(fp), &st) != 0 || !S_ISREG(st.st_mode)) {
        rc = ct_fail(e, CT_ERR_IO, "%s: not a regular file", path);
        goto out;
    }
    uint64_t fsize = (uint64_t)st.st_size;
    unsigned char pre[12];
    if (fsize < 10 || fread(pre, 1, 10, fp) != 10) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: too short for a .npy file", path);
        goto out;
    }
    if (memcmp(pre, "\x93NUMPY", 6) != 0) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: not a .npy file (bad magic)", path);
        goto out;
    }
    int major = pre[6], minor = pre[7];
    if (major < 1 || major > 3 || minor != 0) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: unsupported .npy format version %d.%d", path, major, minor);
        goto out;
    }
    uint64_t hlen, hstart;
    if (major == 1) {
        hlen = npy_le(pre + 8, 2);
        hstart = 10;
    } else {
        if (fsize < 12 || fread(pre + 10, 1, 2, fp) != 2) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: too short for a .npy file", path);
            goto out;
        }
        hlen = npy_le(pre + 8, 4);
        hstart = 12;
    }
    if (hlen > NPY_MAX_HEADER || hlen > fsize - hstart) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: header length %llu is past the end of the file or too large", path,
                     (unsigned long long)hlen);
        goto out;
    }
    hdr = malloc(hlen + 1);
    if (!hdr || fread(hdr, 1, hlen, fp) != hlen) {
        rc = ct_fail(e, CT_ERR_IO, "%s: cannot read header", path);
        goto out;
    }
    hdr[hlen] = 0;
    npy_dtype dt = {0, 0};
    uint64_t numel = 0;
    if ((rc = npy_parse_header(path, hdr, hlen, &dt, &numel, e))) goto out;
    uint64_t nbytes, have = fsize - hstart - hlen;
    if (__builtin_mul_overflow(numel, (uint64_t)dt.size, &nbytes)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: shape's byte size overflows", path);
        goto out;
    }
    if (nbytes != have) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: file holds %llu data bytes but shape and dtype need %llu%s", path,
                     (unsigned long long)have, (unsigned long long)nbytes,
                     have < nbytes ? " (truncated?)" : " (trailing bytes)");
        goto out;
    }
    if (numel > SIZE_MAX / sizeof(uint32_t)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: %llu elements do not fit in memory", path, (unsigned long long)numel);
        goto out;
    }
    res = malloc(numel ? (size_t)numel * sizeof *res : 1);
    enum { CHUNK = 16384 };
    buf = malloc(CHUNK * 8);
    if (!res || !buf) {
        rc = ct_fail(e, CT_ERR_IO, "%s: out of memory for %llu elements", path, (unsigned long long)numel);
        goto out;
    }
    for (uint64_t off = 0; off < numel; off += CHUNK) {
        size_t k = numel - off < CHUNK ? (size_t)(numel - off) : CHUNK;
        if (fread(buf, (size_t)dt.size, k, fp) != k) {
            rc = ct_fail(e, CT_ERR_IO, "%s: read error in the data", path);
            goto out;
        }
        long long bad;
        int64_t bv = 0;
        int neg = 0;
        npy_convert(buf, dt, k, res + off, &bad, &bv, &neg);
        if (bad >= 0) {
            if (neg)
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: element %llu is %lld, outside the uint32 range", path,
                             (unsigned long long)(off + (uint64_t)bad), (long long)bv);
            else
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: element %llu is %llu, outside the uint32 range", path,
                             (unsigned long long)(off + (uint64_t)bad), (unsigned long long)bv);
            goto out;
        }
    }
    *out = res;
    *n = (size_t)numel;
    res = NULL;
out:
    free(res);
    free(buf);
    free(hdr);
    fclose(fp);
    return rc;
}
