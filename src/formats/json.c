/* formats/json.c: the checks cJSON does not make, then cJSON.
 *
 * Design notes.
 * - One pass over the text (json_scan) finds control bytes and ill-formed
 *   UTF-8, notes the number tokens and checks each object's keys. It runs
 *   while the bytes stream through the cache: checking keys on the parsed
 *   tree instead meant chasing 151k cold list nodes for tokenizer.json's
 *   vocab, and cost as much as the rest of the checks together.
 * - Keys: a stack of the open containers gives each string followed by ':'
 *   its object's number; one hash set holds (object, key) for the whole
 *   text, its keys compared as decoded (so "a" and "\u0061" are one key,
 *   as Python sees them). The hash is seeded per call: keys made to
 *   collide cannot turn a reject into an O(n^2) stall.
 * - cJSON keeps every number as a double, so "32" and "32.0" come out
 *   alike. The scan notes, per number token in text order, whether it had a
 *   fraction or exponent; a pre-order walk of the tree meets the numbers in
 *   the same order and sets JSON_REAL on those that had, stopping after the
 *   last (tokenizer.json has none: no walk). The bit sits above cJSON's type
 *   byte (0xFF) and its two flags (256, 512): cJSON reads types through
 *   `type & 0xFF` and copies the rest (cJSON_Duplicate keeps it). */
#include "formats/json.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "core/fs.h"

#define JSON_REAL (1 << 14) /* a number written with a fraction or an exponent */

static int json_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static int json_digit(unsigned char c) { return c >= '0' && c <= '9'; }
/* what cJSON's parse_number hands strtod: one token to JSON's grammar or not */
static int json_numchar(unsigned char c) {
    return json_digit(c) || c == '-' || c == '+' || c == '.' || c == 'e' || c == 'E';
}

/* What json_scan notes beyond the first bad byte (json_parse's and
 * json_mark_numbers' scans; json_bad_byte's notes nothing). */
typedef struct {
    /* numbers */
    uint64_t *bits;  /* bit k: the k-th number token had a fraction or exponent */
    size_t n, words; /* tokens noted; words of bits */
    size_t n_real;   /* 1 + the index of the last token with one (0: none) */
    size_t bad_num;  /* the first number token JSON's grammar refuses, or SIZE_MAX */
    /* keys (when check_keys) */
    int check_keys;
    struct json_open { size_t id, at; } *stack; /* the open objects: number, offset of the '{' */
    size_t depth, stack_room, n_objects;
    uint64_t *slot; /* a set of hash(object, key), open addressing; 0 free */
    size_t cap, n_keys;
    uint64_t seed;
    char *tmp[2]; /* decoded keys, for a compare */
    size_t tmp_room[2];
    size_t dup_at; /* the opening quote of the first repeated key, or SIZE_MAX */
} json_notes;

static void json_notes_free(json_notes *t) {
    free(t->bits);
    free(t->stack);
    free(t->slot);
    free(t->tmp[0]);
    free(t->tmp[1]);
}

/* *p (room *room elements of size sz) with room for need: grown by doubling, copied. */
static void *json_grow(void *p, size_t *room, size_t need, size_t sz) {
    if (need <= *room) return p;
    size_t r = *room ? *room : 16;
    while (r < need) r *= 2;
    void *q = ct_malloc(r * sz);
    if (*room) memcpy(q, p, *room * sz);
    free(p);
    *room = r;
    return q;
}

/* ------------------------------------------------------------------ UTF-8 */

size_t json_utf8_len(const unsigned char *s, size_t avail) {
    unsigned c = s[0];
    if (c < 0xC2 || c > 0xF4) return 0; /* continuation, overlong C0/C1, past U+10FFFF */
    if (c < 0xE0) return avail >= 2 && (s[1] & 0xC0) == 0x80 ? 2 : 0;
    if (c < 0xF0) {
        unsigned lo = c == 0xE0 ? 0xA0 : 0x80, hi = c == 0xED ? 0x9F : 0xBF; /* overlong; surrogates */
        return avail >= 3 && s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80 ? 3 : 0;
    }
    unsigned lo = c == 0xF0 ? 0x90 : 0x80, hi = c == 0xF4 ? 0x8F : 0xBF; /* overlong; past U+10FFFF */
    return avail >= 4 && s[1] >= lo && s[1] <= hi && (s[2] & 0xC0) == 0x80 && (s[3] & 0xC0) == 0x80 ? 4 : 0;
}

/* ----------------------------------------------------------------- numbers */

static void json_push(json_notes *t, int real) {
    if (t->n == t->words * 64) {
        size_t w = t->words;
        t->bits = json_grow(t->bits, &t->words, w + 1, sizeof *t->bits);
        memset(t->bits + w, 0, (t->words - w) * sizeof *t->bits);
    }
    if (real) {
        t->bits[t->n / 64] |= 1ull << (t->n % 64);
        t->n_real = t->n + 1;
    }
    t->n++;
}

/* The number token at s[i] ('-' or a digit, outside strings): notes it and
 * returns the offset after it. */
static size_t json_number(const unsigned char *s, size_t i, size_t len, json_notes *t) {
    size_t start = i;
    int real = 0, ok = 1;
    if (s[i] == '-') i++;
    if (i < len && s[i] == '0') i++;
    else if (i < len && json_digit(s[i]))
        while (i < len && json_digit(s[i])) i++;
    else ok = 0;
    if (ok && i < len && s[i] == '.') {
        real = 1;
        if (++i >= len || !json_digit(s[i])) ok = 0;
        while (i < len && json_digit(s[i])) i++;
    }
    if (ok && i < len && (s[i] == 'e' || s[i] == 'E')) {
        real = 1;
        if (++i < len && (s[i] == '+' || s[i] == '-')) i++;
        if (i >= len || !json_digit(s[i])) ok = 0;
        while (i < len && json_digit(s[i])) i++;
    }
    /* "01", "1.2.3": cJSON reads more than JSON's number, or stops inside it */
    if (i < len && json_numchar(s[i])) ok = 0;
    while (i < len && json_numchar(s[i])) i++;
    if (!ok && t->bad_num == SIZE_MAX) t->bad_num = start;
    json_push(t, real);
    return i;
}

/* -------------------------------------------------------------------- keys */

static int json_hex(unsigned char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
}

/* The \uXXXX at s[0, n) (s[0] is the 'u'), or -1. */
static long json_u4(const unsigned char *s, size_t n) {
    if (n < 5) return -1;
    long v = 0;
    for (int k = 1; k <= 4; k++) {
        int h = json_hex(s[k]);
        if (h < 0) return -1;
        v = v * 16 + h;
    }
    return v;
}

/* The string body s[0, n) with its escapes decoded into out (n bytes are
 * enough: no escape grows); its length. A bad escape is copied as it stands
 * (cJSON refuses the text anyway); a lone surrogate is kept as its 3-byte
 * form, as Python keeps it, so two keys compare as Python compares them. */
static size_t json_unescape(const unsigned char *s, size_t n, unsigned char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n;) {
        if (s[i] != '\\' || i + 1 >= n) {
            out[o++] = s[i++];
            continue;
        }
        unsigned char c = s[i + 1];
        const char *from = "\"\\/bfnrt", *to = "\"\\/\b\f\n\r\t", *p = c ? strchr(from, c) : NULL;
        if (p) {
            out[o++] = (unsigned char)to[p - from];
            i += 2;
            continue;
        }
        long u = c == 'u' ? json_u4(s + i + 1, n - i - 1) : -1;
        if (u < 0) {
            out[o++] = s[i++];
            continue;
        }
        i += 6;
        if (u >= 0xD800 && u < 0xDC00 && i + 1 < n && s[i] == '\\' && s[i + 1] == 'u') {
            long lo = json_u4(s + i + 1, n - i - 1);
            if (lo >= 0xDC00 && lo < 0xE000) {
                u = 0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00);
                i += 6;
            }
        }
        if (u < 0x80) {
            out[o++] = (unsigned char)u;
        } else if (u < 0x800) {
            out[o++] = (unsigned char)(0xC0 | u >> 6);
            out[o++] = (unsigned char)(0x80 | (u & 0x3F));
        } else if (u < 0x10000) {
            out[o++] = (unsigned char)(0xE0 | u >> 12);
            out[o++] = (unsigned char)(0x80 | (u >> 6 & 0x3F));
            out[o++] = (unsigned char)(0x80 | (u & 0x3F));
        } else {
            out[o++] = (unsigned char)(0xF0 | u >> 18);
            out[o++] = (unsigned char)(0x80 | (u >> 12 & 0x3F));
            out[o++] = (unsigned char)(0x80 | (u >> 6 & 0x3F));
            out[o++] = (unsigned char)(0x80 | (u & 0x3F));
        }
    }
    return o;
}

/* The key whose opening quote is at s[at], decoded: a pointer into s when it
 * has no escape, else into t->tmp[which]. */
static const unsigned char *json_key(json_notes *t, const unsigned char *s, size_t len, size_t at, int which,
                                     size_t *n) {
    size_t i = at + 1, esc = 0;
    while (i < len && s[i] != '"') {
        if (s[i] == '\\') {
            esc = 1;
            i++;
        }
        i++;
    }
    if (i > len) i = len;
    *n = i - at - 1;
    if (!esc) return s + at + 1;
    t->tmp[which] = json_grow(t->tmp[which], &t->tmp_room[which], *n + 1, 1);
    *n = json_unescape(s + at + 1, *n, (unsigned char *)t->tmp[which]);
    return (const unsigned char *)t->tmp[which];
}

static uint64_t json_mix(uint64_t h) { /* MurmurHash3's finalizer: every bit moves every other */
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    return h ^ h >> 33;
}

static void json_slot_put(json_notes *t, uint64_t h) {
    size_t i = (size_t)h & (t->cap - 1);
    while (t->slot[i]) i = (i + 1) & (t->cap - 1);
    t->slot[i] = h;
}

/* Whether the object whose '{' is at s[open] has a key of its own before
 * s[at] that decodes to k[0, n): the check behind a hash match. */
static int json_has_key(json_notes *t, const unsigned char *s, size_t len, size_t open, size_t at,
                        const unsigned char *k, size_t n) {
    int depth = 0;
    for (size_t i = open + 1; i < at; i++) {
        if (s[i] == '{' || s[i] == '[') {
            depth++;
        } else if (s[i] == '}' || s[i] == ']') {
            depth--;
        } else if (s[i] == '"') {
            size_t q = i, m;
            for (i++; i < at && s[i] != '"'; i++)
                if (s[i] == '\\') i++;
            size_t j = i + 1;
            while (j < at && json_ws(s[j])) j++;
            if (depth || j >= at || s[j] != ':') continue;
            const unsigned char *o = json_key(t, s, len, q, 1, &m);
            if (m == n && memcmp(o, k, n) == 0) return 1;
        }
    }
    return 0;
}

/* The key with its opening quote at s[at] and closing one at s[end], in the
 * innermost open object: noted, or t->dup_at set when the object has it. The
 * set holds only hashes (8 bytes a key: its pages are most of what the check
 * costs), and a match is confirmed on the text. */
static void json_note_key(json_notes *t, const unsigned char *s, size_t len, size_t at, size_t end, int esc) {
    const struct json_open *obj = &t->stack[t->depth - 1];
    size_t n = end - at - 1;
    const unsigned char *k = s + at + 1;
    if (esc) k = json_key(t, s, len, at, 0, &n);
    uint64_t h = t->seed ^ obj->id * 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < n; i++) h = (h ^ k[i]) * 0x100000001b3ull; /* FNV-1a */
    h = json_mix(h) | 1;
    if (4 * (t->n_keys + 1) > 3 * t->cap) { /* load at most 3/4 */
        uint64_t *old = t->slot;
        size_t ocap = t->cap;
        t->cap = t->cap ? 2 * t->cap : 64;
        if (!ocap) /* sized for tokenizer.json's share of keys, ~1 per 75 bytes: no regrowth there */
            while (t->cap < len / 48) t->cap *= 2;
        t->slot = ct_calloc(t->cap, sizeof *t->slot);
        for (size_t j = 0; j < ocap; j++)
            if (old[j]) json_slot_put(t, old[j]);
        free(old);
    }
    size_t i = (size_t)h & (t->cap - 1);
    for (; t->slot[i]; i = (i + 1) & (t->cap - 1))
        if (t->slot[i] == h && json_has_key(t, s, len, obj->at, at, k, n)) {
            if (t->dup_at == SIZE_MAX) t->dup_at = at;
            return;
        }
    t->slot[i] = h;
    t->n_keys++;
}

/* -------------------------------------------------------------------- scan */

/* Byte classes outside and inside strings; 0 is the common byte the tight
 * loops skip (most of tokenizer.json is indentation and short strings). */
enum { OUT_QUOTE = 1, OUT_OPEN, OUT_CLOSE, OUT_NUMBER, OUT_CTRL, OUT_HIGH };
enum { IN_QUOTE = 1, IN_ESCAPE, IN_CTRL, IN_HIGH };

/* 1 '"', 2 '{', 3 '}' (keys belong to the innermost open object; arrays
 * hold none), 4 a number's first byte, 5 a control byte JSON forbids, 6 a
 * non-ASCII byte */
static const unsigned char json_out[256] = {
    5, 5, 5, 5, 5, 5, 5, 5, 5, 0, 0, 5, 5, 0, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5,
    0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 3, 0, 0,
    6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6,
    6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6,
    6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6,
    6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6, 6,
};

/* 1 '"', 2 '\\', 3 a control byte, 4 a non-ASCII byte */
static const unsigned char json_in[256] = {
    3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3,
    0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0,
    0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
    4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4,
};

/* json_bad_byte, noting numbers and keys in t when it is not NULL. */
static size_t json_scan(const char *text, size_t len, json_notes *t) {
    const unsigned char *s = (const unsigned char *)text;
    size_t i = 0, n;
    for (;;) {
        while (i < len && !json_out[s[i]]) i++;
        if (i >= len) return len;
        switch (json_out[s[i]]) {
        case OUT_QUOTE: {
            size_t at = i;
            int esc = 0;
            for (i++;;) {
                while (i < len && !json_in[s[i]]) i++;
                if (i >= len) return len; /* an unterminated string: cJSON says so */
                switch (json_in[s[i]]) {
                case IN_QUOTE:
                    goto closed;
                case IN_ESCAPE:
                    /* the escaped byte does not end the string; a control or
                     * non-ASCII one is looked at as any other (cJSON refuses
                     * the escape, but this check names it first) */
                    esc = 1;
                    if (++i < len && json_in[s[i]] < IN_CTRL) i++;
                    break;
                case IN_CTRL:
                    return i;
                default: /* two-byte sequences inline: byte-level BPE's vocab is full of them */
                    if (s[i] >= 0xC2 && s[i] < 0xE0 && i + 1 < len && (s[i + 1] & 0xC0) == 0x80) n = 2;
                    else if (!(n = json_utf8_len(s + i, len - i))) return i;
                    i += n;
                }
            }
        closed:
            if (t && t->depth) { /* only a key is followed by ':' */
                size_t j = i + 1;
                while (j < len && json_ws(s[j])) j++;
                if (j < len && s[j] == ':') json_note_key(t, s, len, at, i, esc);
            }
            i++;
            break;
        }
        case OUT_OPEN:
            if (t && t->check_keys) {
                t->stack = json_grow(t->stack, &t->stack_room, t->depth + 1, sizeof *t->stack);
                t->stack[t->depth++] = (struct json_open){t->n_objects++, i};
            }
            i++;
            break;
        case OUT_CLOSE:
            if (t && t->depth) t->depth--; /* a mismatched one: cJSON refuses the text */
            i++;
            break;
        case OUT_NUMBER:
            if (t) i = json_number(s, i, len, t);
            else i++;
            break;
        case OUT_CTRL:
            return i;
        default:
            if (!(n = json_utf8_len(s + i, len - i))) return i;
            i += n;
        }
    }
}

size_t json_bad_byte(const char *text, size_t len) { return json_scan(text, len, NULL); }

/* -------------------------------------------------------------------- walk */

/* Pre-order over the siblings from IT: each number takes the mark of the
 * next token (*k). 0: go on; 1: the tree has more numbers than the text;
 * 2: no float-written token is left (the walk stops). */
static int json_walk(cJSON *it, const json_notes *t, size_t *k) {
    for (; it; it = it->next) {
        int ty = it->type & 0xFF, rc;
        if (ty == cJSON_Number) {
            if (*k >= t->n) return 1;
            if (t->bits[*k / 64] >> (*k % 64) & 1) it->type |= JSON_REAL;
            if (++*k >= t->n_real) return 2;
        } else if ((ty == cJSON_Object || ty == cJSON_Array) && (rc = json_walk(it->child, t, k))) {
            return rc; /* depth: cJSON's nesting limit (1000) */
        }
    }
    return 0;
}

/* The marks of t on ROOT; *at as json_mark_numbers'. */
static int json_apply(cJSON *root, const json_notes *t, size_t len, size_t *at) {
    size_t k = 0;
    if (t->bad_num != SIZE_MAX) {
        *at = t->bad_num;
        return -1;
    }
    if (t->n_real && json_walk(root, t, &k) != 2) {
        *at = len;
        return -1;
    }
    return 0;
}

int json_mark_numbers(cJSON *root, const char *text, size_t len, size_t *at) {
    json_notes t = {.bad_num = SIZE_MAX, .dup_at = SIZE_MAX};
    int rc = -1;
    *at = len;
    if (json_scan(text, len, &t) == len) rc = json_apply(root, &t, len, at);
    json_notes_free(&t);
    return rc;
}

int json_is_integer(const cJSON *item) {
    if (!cJSON_IsNumber(item) || (item->type & JSON_REAL)) return 0;
    double d = item->valuedouble;
    return isfinite(d) && d == floor(d);
}

int json_int_in(const cJSON *item, double lo, double hi) {
    return cJSON_IsNumber(item) && item->valuedouble >= lo && item->valuedouble <= hi &&
           item->valuedouble == floor(item->valuedouble);
}

int json_integer_in(const cJSON *item, double lo, double hi) {
    return json_int_in(item, lo, hi) && json_is_integer(item);
}

/* ------------------------------------------------------------------- parse */

cJSON *json_parse(const char *text, size_t len, const char *what, ct_err *e) {
    struct timespec ts; /* the hash's seed: the clock and where the stack is (ASLR) */
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t seed = json_mix((uint64_t)(uintptr_t)&ts ^ (uint64_t)ts.tv_nsec << 20 ^ (uint64_t)ts.tv_sec);
    json_notes t = {.bad_num = SIZE_MAX, .dup_at = SIZE_MAX, .check_keys = 1, .seed = seed};
    cJSON *j = NULL;
    size_t bad = json_scan(text, len, &t), at = 0;
    if (bad < len) {
        unsigned char b = (unsigned char)text[bad];
        if (b < 0x80)
            ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON: control byte 0x%02x at byte %zu", what, b, bad);
        else
            ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON: invalid UTF-8 (byte 0x%02x) at byte %zu", what, b, bad);
        goto out;
    }
    const char *end = NULL;
    j = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!j) {
        /* cJSON leaves the end pointer at the byte it stopped on */
        at = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON near byte %zu", what, at);
        goto out;
    }
    for (const char *q = end; q < text + len; q++)
        if (!json_ws((unsigned char)*q)) {
            ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON: extra data after the value at byte %zu", what,
                    (size_t)(q - text));
            goto fail;
        }
    if (t.dup_at != SIZE_MAX) {
        size_t n;
        const unsigned char *k = json_key(&t, (const unsigned char *)text, len, t.dup_at, 0, &n);
        ct_fail(e, CT_ERR_FORMAT, "%s: duplicate key \"%.*s\" at byte %zu", what, n > 200 ? 200 : (int)n,
                (const char *)k, t.dup_at);
        goto fail;
    }
    if (json_apply(j, &t, len, &at)) {
        if (at < len) ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON: invalid number at byte %zu", what, at);
        else ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON: its numbers do not match the parsed value", what);
        goto fail;
    }
    goto out;
fail:
    cJSON_Delete(j);
    j = NULL;
out:
    json_notes_free(&t);
    return j;
}

cJSON *json_parse_file(const char *path, size_t cap, ct_err *e) {
    size_t len = 0;
    char *text = fs_read_file(path, cap, &len, e);
    if (!text) return NULL;
    cJSON *j = json_parse(text, len, path, e);
    free(text);
    return j;
}
