/* tokenizer/tok_regex.c: the split regex, made to agree with HF.
 *
 * HF compiles the pattern with Oniguruma (Unicode 16 tables); here it is
 * PCRE2 10.42 (Unicode 14) with PCRE2_UTF | PCRE2_UCP. An exhaustive
 * per-code-point comparison of the split with tokenizers 0.23 over the
 * real Qwen pre-tokenizer found exactly these differences:
 * - Oniguruma's \s is Unicode White_Space; PCRE2's also matches U+180E
 *   (dropped from White_Space in Unicode 6.3);
 * - letters and numbers assigned in Unicode 15 and 16 are \p{L} / \p{N} to
 *   HF and unassigned to PCRE2 (the tables below: HF's set minus PCRE2's).
 * So the pattern is compiled twice: as written, and rewritten with \s, \S,
 * \p{L} and \p{N} spelled out as classes that match HF. The rewritten one
 * is slower (a long class defeats PCRE2's property fast path), so it only
 * runs on pieces of text that contain one of those code points, which
 * tok_regex_needs_exact finds with a cheap scan. Inside a class only \s
 * can be spelled out (PCRE2 has no class subtraction): a \S inside a class
 * is left as written. A newer PCRE2 that knows the new code points makes
 * the extra ranges redundant, not wrong. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tokenizer/tok_internal.h"

typedef struct {
    uint32_t lo, hi;
} range;

static const range NEW_LETTERS[] = {
    {0x1C89, 0x1C8A},   {0xA7CB, 0xA7CD},   {0xA7DA, 0xA7DC},   {0x105C0, 0x105F3}, {0x10D4A, 0x10D65},
    {0x10D6F, 0x10D85}, {0x10EC2, 0x10EC4}, {0x1123F, 0x11240}, {0x11380, 0x11389}, {0x1138B, 0x1138B},
    {0x1138E, 0x1138E}, {0x11390, 0x113B5}, {0x113B7, 0x113B7}, {0x113D1, 0x113D1}, {0x113D3, 0x113D3},
    {0x11BC0, 0x11BE0}, {0x11F02, 0x11F02}, {0x11F04, 0x11F10}, {0x11F12, 0x11F33}, {0x1342F, 0x1342F},
    {0x13441, 0x13446}, {0x13460, 0x143FA}, {0x16100, 0x1611D}, {0x16D40, 0x16D6C}, {0x18CFF, 0x18CFF},
    {0x1B132, 0x1B132}, {0x1B155, 0x1B155}, {0x1DF25, 0x1DF2A}, {0x1E030, 0x1E06D}, {0x1E4D0, 0x1E4EB},
    {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0}, {0x2B739, 0x2B739}, {0x2EBF0, 0x2EE5D}, {0x31350, 0x323AF},
};
static const range NEW_NUMBERS[] = {
    {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x11F50, 0x11F59}, {0x16130, 0x16139},
    {0x16D70, 0x16D79}, {0x1CCF0, 0x1CCF9}, {0x1D2C0, 0x1D2D3}, {0x1E4F0, 0x1E4F9}, {0x1E5F1, 0x1E5FA},
};
/* Unicode White_Space, which is what Oniguruma's \s matches */
static const range WHITE_SPACE[] = {
    {0x09, 0x0D}, {0x20, 0x20},     {0x85, 0x85},     {0xA0, 0xA0},     {0x1680, 0x1680}, {0x2000, 0x200A},
    {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
};
#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

static int in_ranges(const range *r, size_t n, uint32_t c) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (c < r[mid].lo) hi = mid;
        else if (c > r[mid].hi) lo = mid + 1;
        else return 1;
    }
    return 0;
}

int tok_regex_needs_exact(const char *s, size_t n) {
    const uint8_t *u = (const uint8_t *)s;
    for (size_t i = 0; i < n; i++) {
        /* lead bytes of U+1000..1FFF, U+A000..AFFF and the 4-byte planes:
         * the only places the code points above live */
        if (u[i] != 0xE1 && u[i] != 0xEA && u[i] < 0xF0) continue;
        uint32_t c;
        size_t bad;
        if (!tok_utf8_next(u + i, n - i, &c, &bad)) continue;
        if (c == 0x180E || in_ranges(NEW_LETTERS, COUNT(NEW_LETTERS), c) ||
            in_ranges(NEW_NUMBERS, COUNT(NEW_NUMBERS), c))
            return 1;
    }
    return 0;
}

/* Appends a class body: `base` (may be "") then the ranges. */
static void put_body(tok_buf *b, const char *base, const range *r, size_t n) {
    tok_buf_put(b, base, strlen(base));
    for (size_t i = 0; i < n; i++) {
        char x[40];
        int k = r[i].lo == r[i].hi ? snprintf(x, sizeof x, "\\x{%X}", (unsigned)r[i].lo)
                                   : snprintf(x, sizeof x, "\\x{%X}-\\x{%X}", (unsigned)r[i].lo,
                                              (unsigned)r[i].hi);
        tok_buf_put(b, x, (size_t)k);
    }
}

static void put_class(tok_buf *b, const char *base, const range *r, size_t n, int in_class,
                      int negate) {
    if (!in_class) tok_buf_put(b, negate ? "[^" : "[", negate ? 2 : 1);
    put_body(b, base, r, n);
    if (!in_class) tok_buf_put(b, "]", 1);
}

static char *rewrite(const char *p) {
    tok_buf b = {0};
    int in_class = 0;
    for (size_t i = 0; p[i]; i++) {
        char c = p[i];
        if (c == '\\' && p[i + 1]) {
            char d = p[i + 1];
            if (!strncmp(p + i, "\\p{L}", 5)) {
                put_class(&b, "\\p{L}", NEW_LETTERS, COUNT(NEW_LETTERS), in_class, 0);
                i += 4;
            } else if (!strncmp(p + i, "\\p{N}", 5)) {
                put_class(&b, "\\p{N}", NEW_NUMBERS, COUNT(NEW_NUMBERS), in_class, 0);
                i += 4;
            } else if (d == 's' || (d == 'S' && !in_class)) {
                put_class(&b, "", WHITE_SPACE, COUNT(WHITE_SPACE), in_class, d == 'S');
                i++;
            } else {
                tok_buf_put(&b, p + i, 2);
                i++;
            }
            continue;
        }
        if (c == '[' && !in_class) {
            in_class = 1;
            tok_buf_put(&b, p + i, 1);
            /* a ']' right after '[' or '[^' is a literal member */
            if (p[i + 1] == '^') tok_buf_put(&b, p + ++i, 1);
            if (p[i + 1] == ']') tok_buf_put(&b, p + ++i, 1);
            continue;
        }
        if (c == '[' && in_class && p[i + 1] == ':') { /* POSIX [:name:] */
            const char *end = strstr(p + i + 2, ":]");
            size_t k = end ? (size_t)(end - (p + i)) + 2 : 1;
            tok_buf_put(&b, p + i, k);
            i += k - 1;
            continue;
        }
        if (c == ']' && in_class) in_class = 0;
        tok_buf_put(&b, p + i, 1);
    }
    if (!b.p) tok_buf_put(&b, "", 0);
    return b.p;
}

static pcre2_code *compile(const char *pat, uint32_t opts, int *jit, char *msg, size_t msg_size,
                           size_t *err_off) {
    int code;
    PCRE2_SIZE off;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED, opts, &code, &off, NULL);
    if (!re) {
        pcre2_get_error_message(code, (PCRE2_UCHAR *)msg, msg_size);
        *err_off = off;
        return NULL;
    }
    *jit = pcre2_jit_compile(re, PCRE2_JIT_COMPLETE) == 0;
    return re;
}

int tok_regex_compile(tok *t, const char *pattern, int literal, char *msg, size_t msg_size,
                      size_t *err_off) {
    uint32_t opts = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP); /* LITERAL refuses UCP */
    t->re = compile(pattern, opts, &t->re_jit, msg, msg_size, err_off);
    if (!t->re) return 1;
    if (literal) return 0;
    char *ex = rewrite(pattern);
    size_t off;
    t->re_exact = compile(ex, opts, &t->re_exact_jit, msg, msg_size, &off);
    free(ex);
    if (!t->re_exact) { /* the original compiled, so this is our bug */
        *err_off = 0;
        snprintf(msg, msg_size, "internal error: rewritten pattern does not compile");
        return 1;
    }
    return 0;
}
