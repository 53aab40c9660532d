/* tokenizer/tok_bytes.c: byte-level helpers shared by loading and encoding,
 * and the decoder.
 *
 * - The GPT-2 byte<->unicode table is computed from its definition (the
 *   188 printable Latin-1 bytes stand for themselves, the other 68 bytes
 *   take code points 256.. in byte order), so there is no pasted table.
 * - UTF-8 reading follows CPython's decoder with errors="replace": a
 *   maximal prefix of a valid sequence that breaks off counts as ONE bad
 *   unit. That is the only way an invalid byte string reaches HF (the
 *   Python binding takes str), so it is the behaviour to match.
 * - NFC only runs on the parts of the text that can change: ASCII and CJK
 *   unified ideographs are starters that never decompose and never compose
 *   with what precedes them, so the text splits there; a run of other
 *   characters is handed to utf8proc together with the one inert character
 *   before it (an 'e' may compose with a following U+0301). A few marks
 *   newer than HF's NFC tables are kept out of utf8proc's hands (below). */
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer/tok_internal.h"

static int printable_byte(unsigned b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t tok_byte_char(uint8_t b) {
    if (printable_byte(b)) return b;
    uint32_t k = 0; /* rank of b among the non-printable bytes */
    for (unsigned i = 0; i < b; i++) k += !printable_byte(i);
    return 256 + k;
}

int tok_char_byte(uint32_t cp) {
    if (cp < 256) return printable_byte(cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    uint32_t k = cp - 256;
    for (unsigned b = 0; b < 256; b++)
        if (!printable_byte(b) && k-- == 0) return (int)b;
    return -1;
}

uint64_t tok_hash_bytes(const void *p, size_t n) {
    const uint8_t *s = p;
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xff51afd7ed558ccdull);
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, s, 8);
        h = (h ^ v) * 0xbf58476d1ce4e5b9ull;
        h ^= h >> 29;
        s += 8;
        n -= 8;
    }
    uint64_t v = 0;
    memcpy(&v, s, n);
    h = (h ^ v) * 0x94d049bb133111ebull;
    h ^= h >> 32;
    h *= 0xbf58476d1ce4e5b9ull;
    h ^= h >> 29;
    return h ? h : 1;
}

int tok_utf8_put(uint32_t cp, char *o) {
    uint8_t *u = (uint8_t *)o;
    if (cp < 0x80) { u[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { u[0] = 0xC0 | (cp >> 6); u[1] = 0x80 | (cp & 63); return 2; }
    if (cp < 0x10000) {
        u[0] = 0xE0 | (cp >> 12); u[1] = 0x80 | ((cp >> 6) & 63); u[2] = 0x80 | (cp & 63);
        return 3;
    }
    u[0] = 0xF0 | (cp >> 18); u[1] = 0x80 | ((cp >> 12) & 63);
    u[2] = 0x80 | ((cp >> 6) & 63); u[3] = 0x80 | (cp & 63);
    return 4;
}

size_t tok_utf8_next(const uint8_t *s, size_t n, uint32_t *cp, size_t *bad) {
    uint8_t b = s[0];
    if (b < 0x80) { *cp = b; return 1; }
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (b >= 0xC2 && b <= 0xDF) need = 1;
    else if (b >= 0xE0 && b <= 0xEF) {
        need = 2;
        if (b == 0xE0) lo = 0xA0;      /* no overlongs */
        else if (b == 0xED) hi = 0x9F; /* no surrogates */
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 3;
        if (b == 0xF0) lo = 0x90;
        else if (b == 0xF4) hi = 0x8F; /* nothing above U+10FFFF */
    } else {
        *bad = 1;
        return 0;
    }
    uint32_t c = b & (0x3F >> need);
    for (size_t k = 1; k <= need; k++) {
        uint8_t x = k < n ? s[k] : 0;
        uint8_t l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
        if (k >= n || x < l || x > h) {
            *bad = k;
            return 0;
        }
        c = (c << 6) | (x & 63);
    }
    *cp = c;
    return need + 1;
}

void tok_buf_put(tok_buf *b, const void *p, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = ct_malloc(cap);
        if (b->n) memcpy(q, b->p, b->n);
        free(b->p);
        b->p = q;
        b->cap = cap;
    }
    if (n) memcpy(b->p + b->n, p, n);
    b->n += n;
    b->p[b->n] = 0;
}

/* Inert for NFC: a starter with no decomposition that never composes with
 * a preceding character (see the note at the top). */
static int nfc_inert(uint32_t c) { return c < 0x80 || (c >= 0x4E00 && c <= 0x9FFF); }

/* Characters HF's NFC does not know (its tables predate Unicode 11) but
 * utf8proc 2.8 does: combining marks with a nonzero combining class, and
 * U+11930, which composes after U+11935 since Unicode 13. HF leaves them
 * where they are, as unassigned starters, so they are copied unchanged and
 * cut the text into separately normalized parts, which is what treating
 * them as starters means. Found by comparing HF's NFC with utf8proc over
 * every code point next to marks of several combining classes. */
static const uint32_t NFC_UNKNOWN_TO_HF[][2] = {
    {0x7FD, 0x7FD}, {0x898, 0x89F}, {0x8CA, 0x8D3}, {0x9FE, 0x9FE}, {0xC3C, 0xC3C},
    {0xD3B, 0xD3C}, {0xEBA, 0xEBA}, {0x1715, 0x1715}, {0x1ABF, 0x1ACE}, {0x1DF6, 0x1DFA},
    {0xA82C, 0xA82C}, {0x10D24, 0x10D27}, {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF},
    {0x10F46, 0x10F50}, {0x10F82, 0x10F85}, {0x11070, 0x11070}, {0x1133B, 0x1133B},
    {0x1145E, 0x1145E}, {0x11839, 0x1183A}, {0x11930, 0x11930}, {0x1193D, 0x1193E},
    {0x11943, 0x11943}, {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47},
    {0x11A99, 0x11A99}, {0x11D42, 0x11D42}, {0x11D44, 0x11D45}, {0x11D97, 0x11D97},
    {0x11F41, 0x11F42}, {0x16FF0, 0x16FF1}, {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136},
    {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1E4EC, 0x1E4EF},
};

static int nfc_unknown_to_hf(uint32_t c) {
    size_t lo = 0, hi = sizeof NFC_UNKNOWN_TO_HF / sizeof NFC_UNKNOWN_TO_HF[0];
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c < NFC_UNKNOWN_TO_HF[mid][0]) hi = mid;
        else if (c > NFC_UNKNOWN_TO_HF[mid][1]) lo = mid + 1;
        else return 1;
    }
    return 0;
}

static void nfc_segment(const char *s, size_t n, tok_buf *out) {
    utf8proc_uint8_t *dst = NULL;
    utf8proc_ssize_t m = utf8proc_map((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &dst,
                                      UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    if (m < 0) tok_buf_put(out, s, n); /* only on invalid UTF-8, which callers exclude */
    else tok_buf_put(out, dst, (size_t)m);
    free(dst);
}

enum { NFC_RUN, NFC_INERT, NFC_KEEP };

static int nfc_kind(const uint8_t *u, size_t n, size_t *len) {
    uint32_t c;
    size_t bad;
    *len = tok_utf8_next(u, n, &c, &bad);
    if (!*len) { *len = bad; return NFC_KEEP; } /* not reached for repaired input */
    if (nfc_inert(c)) return NFC_INERT;
    return nfc_unknown_to_hf(c) ? NFC_KEEP : NFC_RUN;
}

/* Appends NFC(s[0..n)) to out; s must be valid UTF-8. */
static void tok_nfc(const char *s, size_t n, tok_buf *out) {
    const uint8_t *u = (const uint8_t *)s;
    size_t copied = 0, i = 0, prev = 0;
    int prev_kind = NFC_KEEP; /* kind of the char that starts at prev */
    while (i < n) {
        size_t l;
        int kind = u[i] < 0x80 ? (l = 1, NFC_INERT) : nfc_kind(u + i, n - i, &l);
        if (kind != NFC_RUN) {
            prev = i;
            prev_kind = kind;
            i += l;
            continue;
        }
        /* An inert char just before the run joins it ('e' + U+0301). */
        size_t start = i > 0 && prev_kind == NFC_INERT ? prev : i, end = i + l;
        while (end < n) {
            size_t k;
            if ((u[end] < 0x80 ? (k = 1, NFC_INERT) : nfc_kind(u + end, n - end, &k)) != NFC_RUN) break;
            end += k;
        }
        tok_buf_put(out, s + copied, start - copied);
        nfc_segment(s + start, end - start, out);
        copied = i = end;
        prev_kind = NFC_KEEP; /* the char before i now belongs to a segment */
    }
    tok_buf_put(out, s + copied, n - copied);
}

/* Appends s[0..n) to out with every non-overlapping occurrence of pat
 * (leftmost first) replaced by rep. */
static void replace_all(const char *s, size_t n, const char *pat, size_t np, const char *rep,
                        size_t nr, tok_buf *out) {
    size_t i = 0, done = 0;
    while (np && i + np <= n) {
        if (!memcmp(s + i, pat, np)) {
            tok_buf_put(out, s + done, i - done);
            tok_buf_put(out, rep, nr);
            i += np;
            done = i;
        } else {
            i++;
        }
    }
    tok_buf_put(out, s + done, n - done);
}

void tok_normalize(const tok *t, const char *s, size_t n, tok_buf *out, tok_buf *tmp) {
    out->n = 0;
    if (t->nfc) { /* the common case: one NFC step */
        tok_nfc(s, n, out);
        return;
    }
    tok_buf_put(out, s, n);
    for (int k = 0; k < t->n_norm; k++) {
        const tok_norm *st = &t->norm[k];
        tmp->n = 0;
        if (st->kind == TOK_NORM_NFC) tok_nfc(out->p, out->n, tmp);
        else if (st->kind == TOK_NORM_PREPEND) {
            if (!out->n) continue; /* HF prepends to non-empty text only */
            tok_buf_put(tmp, st->rep, st->nrep);
            tok_buf_put(tmp, out->p, out->n);
        } else {
            replace_all(out->p, out->n, st->pat, st->npat, st->rep, st->nrep, tmp);
        }
        tok_buf t2 = *out;
        *out = *tmp;
        *tmp = t2;
    }
    if (!out->p) tok_buf_put(out, "", 0);
}

/* ------------------------------------------------------------ decoder chain */

/* A list of token strings: token i is b.p[off[i] .. off[i+1]). */
typedef struct {
    tok_buf b;
    size_t *off, n, cap;
} strlist;

/* Ends the token whose bytes were appended to l->b since `start`. */
static void sl_close(strlist *l, size_t start) {
    if (l->n + 2 > l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        size_t *o = ct_malloc(cap * sizeof *o);
        if (l->n) memcpy(o, l->off, (l->n + 1) * sizeof *o);
        free(l->off);
        l->off = o;
        l->cap = cap;
    }
    l->off[l->n] = start;
    l->off[++l->n] = l->b.n;
}

static void sl_push(strlist *l, const char *s, size_t n) {
    size_t start = l->b.n;
    tok_buf_put(&l->b, s, n);
    sl_close(l, start);
}

static void sl_free(strlist *l) {
    free(l->b.p);
    free(l->off);
}

/* "<0xNN>" as HF's ByteFallback reads it (Rust u8::from_str_radix, which
 * takes a leading '+'); -1 for any other token. */
static int fallback_byte(const char *s, size_t n) {
    if (n != 6 || memcmp(s, "<0x", 3) || s[5] != '>') return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
              : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) {
            if (i == 3 && c == '+') continue;
            return -1;
        }
        v = v * 16 + d;
    }
    return s[3] == '+' && s[4] == '+' ? -1 : v;
}

static int valid_utf8_str(const uint8_t *s, size_t n) {
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t bad, k = tok_utf8_next(s + i, n - i, &cp, &bad);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

static void flush_bytes(strlist *o, tok_buf *bytes) {
    if (!bytes->n) return;
    if (valid_utf8_str((const uint8_t *)bytes->p, bytes->n)) sl_push(o, bytes->p, bytes->n);
    else
        for (size_t k = 0; k < bytes->n; k++) sl_push(o, "\xEF\xBF\xBD", 3);
    bytes->n = 0;
}

/* HF's decoders.Sequence over token strings: Replace, ByteFallback, Fuse,
 * Strip, Metaspace, each applied to the whole list in turn. */
static void decode_chain(const tok *t, const int32_t *ids, size_t n, int skip_special, char **out,
                         size_t *len) {
    strlist a = {0}, b = {0};
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || t->id_str[id] < 0 || (skip_special && t->is_special[id]))
            continue;
        const char *s = t->pool + t->id_str[id];
        sl_push(&a, s, strlen(s));
    }
    for (int k = 0; k < t->n_dsteps; k++) {
        const tok_dec *d = &t->dsteps[k];
        b.n = 0;
        b.b.n = 0;
        tok_buf bytes = {0};
        for (size_t i = 0; i < a.n; i++) {
            const char *s = a.b.p + a.off[i];
            size_t sn = a.off[i + 1] - a.off[i];
            if (d->kind == TOK_DEC_REPLACE) {
                size_t start = b.b.n;
                replace_all(s, sn, d->pat, d->npat, d->rep, d->nrep, &b.b);
                sl_close(&b, start);
            } else if (d->kind == TOK_DEC_METASPACE) {
                /* HF (0.23): every replacement char becomes a space, except in the
                 * first token, where they are all dropped unless prepend_scheme
                 * is never */
                size_t start = b.b.n;
                int drop = i == 0 && d->start;
                replace_all(s, sn, d->pat, d->npat, " ", drop ? 0 : 1, &b.b);
                sl_close(&b, start);
            } else if (d->kind == TOK_DEC_BYTEFALLBACK) {
                int v = fallback_byte(s, sn);
                if (v >= 0) {
                    uint8_t c = (uint8_t)v;
                    tok_buf_put(&bytes, &c, 1);
                } else {
                    flush_bytes(&b, &bytes);
                    sl_push(&b, s, sn);
                }
            } else if (d->kind == TOK_DEC_FUSE) {
                if (i == 0) sl_push(&b, "", 0);
                tok_buf_put(&b.b, s, sn);
                b.off[1] = b.b.n;
            } else { /* Strip: up to `start` leading and `stop` trailing chars */
                size_t lo = 0, hi = sn;
                for (int c = 0; c < d->start && lo + d->npat <= hi && !memcmp(s + lo, d->pat, d->npat); c++)
                    lo += d->npat;
                for (int c = 0; c < d->stop && hi >= lo + d->npat && !memcmp(s + hi - d->npat, d->pat, d->npat); c++)
                    hi -= d->npat;
                sl_push(&b, s + lo, hi - lo);
            }
        }
        if (d->kind == TOK_DEC_BYTEFALLBACK) flush_bytes(&b, &bytes);
        free(bytes.p);
        strlist tmp = a;
        a = b;
        b = tmp;
    }
    size_t total = a.n ? a.off[a.n] - a.off[0] : 0;
    char *p = ct_malloc(total + 1);
    if (total) memcpy(p, a.b.p + a.off[0], total);
    p[total] = 0;
    *out = p;
    *len = total;
    sl_free(&a);
    sl_free(&b);
}

void tok_decode(const tok *t, const int32_t *ids, size_t n, int skip_special, char **out,
                size_t *len) {
    if (!t->byte_level) {
        decode_chain(t, ids, n, skip_special, out, len);
        return;
    }
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || (skip_special && t->is_special[id])) continue;
        total += t->dec_off[id + 1] - t->dec_off[id];
    }
    char *p = ct_malloc(total + 1), *q = p;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || (skip_special && t->is_special[id])) continue;
        size_t k = t->dec_off[id + 1] - t->dec_off[id];
        memcpy(q, t->dec + t->dec_off[id], k);
        q += k;
    }
    *q = 0;
    *out = p;
    *len = total;
}

void tok_ids_push(tok_ids *ids, int32_t id) {
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? ids->cap * 2 : 1024;
        int32_t *v = ct_malloc(cap * sizeof *v);
        if (ids->n) memcpy(v, ids->v, ids->n * sizeof *v);
        free(ids->v);
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
}

void tok_ids_free(tok_ids *ids) {
    free(ids->v);
    ids->v = NULL;
    ids->n = ids->cap = 0;
}
