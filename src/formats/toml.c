/* formats/toml.c: the TOML subset described in toml.h.
 *
 * One pass over the whole buffer with a cursor and a line counter (not line
 * by line) because arrays may span lines and every error must carry the line
 * where it was found. Values are classified from a delimited token, then the
 * token is checked against TOML's grammar exactly (underscores only between
 * digits, no leading zeros, no "1." or ".5"), so a file this reader accepts
 * means the same in any other TOML reader. Unsupported TOML features fail
 * with a message saying so instead of a generic syntax error, so a user who
 * copied a torchtitan file knows what to change. */
#include "formats/toml.h"
#include "core/fs.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *p, *end;
    int line;
    const char *name;
    ct_err *e;
} toml_parser;

typedef struct {
    char *s;
    size_t n, cap;
} toml_buf;

static int toml_fail(toml_parser *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

static int toml_fail(toml_parser *t, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ct_fail(t->e, CT_ERR_FORMAT, "%s:%d: %s", t->name, t->line, msg);
}

/* realloc that dies like ct_malloc: a config file never needs much memory,
 * so failing here means the machine is already lost. */
static void *toml_grow(void *p, size_t n) {
    void *q = realloc(p, n ? n : 1);
    if (!q) {
        fprintf(stderr, "ctitan: error: out of memory allocating %zu bytes\n", n);
        exit(1);
    }
    return q;
}

static void toml_buf_push(toml_buf *b, char c) {
    if (b->n + 2 > b->cap) {
        b->cap = b->cap ? 2 * b->cap : 32;
        b->s = toml_grow(b->s, b->cap);
    }
    b->s[b->n++] = c;
    b->s[b->n] = '\0';
}

static char *toml_buf_take(toml_buf *b) {
    if (!b->s) return ct_strdup("");
    char *s = b->s;
    b->s = NULL;
    b->n = b->cap = 0;
    return s;
}

static void toml_value_free(toml_value *v) {
    free(v->s);
    for (int i = 0; i < v->n_items; i++) toml_value_free(&v->items[i]);
    free(v->items);
    memset(v, 0, sizeof *v);
}

void toml_free(toml_doc *doc) {
    if (!doc) return;
    for (int i = 0; i < doc->n_sections; i++) {
        toml_section *s = &doc->sections[i];
        for (int j = 0; j < s->n_kvs; j++) {
            free(s->kvs[j].key);
            toml_value_free(&s->kvs[j].val);
        }
        free(s->kvs);
        free(s->name);
    }
    free(doc->sections);
    free(doc->path);
    memset(doc, 0, sizeof *doc);
}

const char *toml_kind_name(toml_kind k) {
    switch (k) {
    case TOML_STRING: return "string";
    case TOML_INT: return "integer";
    case TOML_FLOAT: return "float";
    case TOML_BOOL: return "boolean";
    case TOML_ARRAY: return "array";
    }
    return "?";
}

const toml_section *toml_find_section(const toml_doc *doc, const char *name) {
    for (int i = 0; i < doc->n_sections; i++)
        if (strcmp(doc->sections[i].name, name) == 0) return &doc->sections[i];
    return NULL;
}

static const toml_kv *toml_section_kv(const toml_section *s, const char *key) {
    for (int j = 0; j < s->n_kvs; j++)
        if (strcmp(s->kvs[j].key, key) == 0) return &s->kvs[j];
    return NULL;
}

const toml_kv *toml_find(const toml_doc *doc, const char *section, const char *key) {
    const toml_section *s = toml_find_section(doc, section);
    return s ? toml_section_kv(s, key) : NULL;
}

static toml_section *toml_add_section(toml_doc *doc, const char *name, int line) {
    if (doc->n_sections == doc->cap_sections) {
        doc->cap_sections = doc->cap_sections ? 2 * doc->cap_sections : 8;
        doc->sections = toml_grow(doc->sections, doc->cap_sections * sizeof *doc->sections);
    }
    toml_section *s = &doc->sections[doc->n_sections++];
    memset(s, 0, sizeof *s);
    s->name = ct_strdup(name);
    s->line = line;
    return s;
}

/* ---- character classes ---- */

static int toml_is_bare(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
           c == '_' || c == '-';
}

static int toml_is_dec(char c) { return c >= '0' && c <= '9'; }
static int toml_is_hex(char c) {
    return toml_is_dec(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}
static int toml_is_oct(char c) { return c >= '0' && c <= '7'; }
static int toml_is_bin(char c) { return c == '0' || c == '1'; }

static int toml_hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return c - 'A' + 10;
}

/* TOML forbids control characters other than tab in comments and strings. */
static int toml_is_ctrl(unsigned char c) { return (c < 0x20 && c != '\t') || c == 0x7f; }

static int toml_at_newline(const toml_parser *t) {
    return t->p < t->end &&
           (*t->p == '\n' || (*t->p == '\r' && t->p + 1 < t->end && t->p[1] == '\n'));
}

static void toml_eat_newline(toml_parser *t) {
    t->p += (*t->p == '\r') ? 2 : 1;
    t->line++;
}

static void toml_skip_ws(toml_parser *t) {
    while (t->p < t->end && (*t->p == ' ' || *t->p == '\t')) t->p++;
}

/* At '#': skips to the end of the line (not the newline itself). */
static int toml_skip_comment(toml_parser *t) {
    t->p++;
    while (t->p < t->end && !toml_at_newline(t)) {
        if (toml_is_ctrl((unsigned char)*t->p))
            return toml_fail(t, "control character 0x%02x in comment",
                             (unsigned)(unsigned char)*t->p);
        t->p++;
    }
    return 0;
}

/* After a header or a value only a comment may follow on the line. */
static int toml_expect_eol(toml_parser *t, const char *after) {
    toml_skip_ws(t);
    if (t->p < t->end && *t->p == '#') {
        int rc = toml_skip_comment(t);
        if (rc) return rc;
    }
    if (t->p >= t->end) return 0;
    if (toml_at_newline(t)) {
        toml_eat_newline(t);
        return 0;
    }
    if (toml_is_ctrl((unsigned char)*t->p))
        return toml_fail(t, "unexpected control character 0x%02x after %s",
                         (unsigned)(unsigned char)*t->p, after);
    return toml_fail(t, "unexpected '%c' after %s (expected end of line)", *t->p, after);
}

/* The whole input must be UTF-8 (TOML requires it); checking once up front
 * keeps string parsing simple. Returns 0 or the failing line via t. */
static int toml_check_utf8(toml_parser *t) {
    const unsigned char *p = (const unsigned char *)t->p, *end = (const unsigned char *)t->end;
    int line = 1;
    while (p < end) {
        unsigned char c = *p;
        if (c == '\n') line++;
        if (c < 0x80) {
            p++;
            continue;
        }
        int n;
        uint32_t cp, min;
        if ((c & 0xe0) == 0xc0) n = 1, cp = c & 0x1f, min = 0x80;
        else if ((c & 0xf0) == 0xe0) n = 2, cp = c & 0x0f, min = 0x800;
        else if ((c & 0xf8) == 0xf0) n = 3, cp = c & 0x07, min = 0x10000;
        else n = -1, cp = 0, min = 0;
        int ok = n > 0 && end - p > n;
        for (int k = 1; ok && k <= n; k++) {
            if ((p[k] & 0xc0) != 0x80) ok = 0;
            else cp = (cp << 6) | (p[k] & 0x3f);
        }
        if (!ok || cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
            t->line = line;
            return toml_fail(t, "invalid UTF-8 byte 0x%02x", c);
        }
        p += n + 1;
    }
    return 0;
}

static void toml_put_utf8(toml_buf *b, uint32_t cp) {
    if (cp < 0x80) {
        toml_buf_push(b, (char)cp);
    } else if (cp < 0x800) {
        toml_buf_push(b, (char)(0xc0 | (cp >> 6)));
        toml_buf_push(b, (char)(0x80 | (cp & 0x3f)));
    } else if (cp < 0x10000) {
        toml_buf_push(b, (char)(0xe0 | (cp >> 12)));
        toml_buf_push(b, (char)(0x80 | ((cp >> 6) & 0x3f)));
        toml_buf_push(b, (char)(0x80 | (cp & 0x3f)));
    } else {
        toml_buf_push(b, (char)(0xf0 | (cp >> 18)));
        toml_buf_push(b, (char)(0x80 | ((cp >> 12) & 0x3f)));
        toml_buf_push(b, (char)(0x80 | ((cp >> 6) & 0x3f)));
        toml_buf_push(b, (char)(0x80 | (cp & 0x3f)));
    }
}

/* ---- strings ---- */

static int toml_parse_basic_string(toml_parser *t, char **out) {
    toml_buf b = {0};
    t->p++; /* opening quote */
    for (;;) {
        if (t->p >= t->end || *t->p == '\n' || *t->p == '\r') {
            free(b.s);
            return toml_fail(t, "unterminated string (missing closing \")");
        }
        unsigned char c = (unsigned char)*t->p;
        if (c == '"') {
            t->p++;
            break;
        }
        if (toml_is_ctrl(c)) {
            free(b.s);
            return toml_fail(t, "control character 0x%02x in string (use an escape)", c);
        }
        if (c != '\\') {
            toml_buf_push(&b, (char)c);
            t->p++;
            continue;
        }
        t->p++;
        char esc = t->p < t->end ? *t->p : '\0';
        t->p++;
        switch (esc) {
        case 'b': toml_buf_push(&b, '\b'); break;
        case 't': toml_buf_push(&b, '\t'); break;
        case 'n': toml_buf_push(&b, '\n'); break;
        case 'f': toml_buf_push(&b, '\f'); break;
        case 'r': toml_buf_push(&b, '\r'); break;
        case '"': toml_buf_push(&b, '"'); break;
        case '\\': toml_buf_push(&b, '\\'); break;
        case 'u':
        case 'U': {
            int nd = esc == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (int k = 0; k < nd; k++) {
                if (t->p >= t->end || !toml_is_hex(*t->p)) {
                    free(b.s);
                    return toml_fail(t, "\\%c escape needs exactly %d hex digits", esc, nd);
                }
                cp = (cp << 4) | (uint32_t)toml_hexval(*t->p++);
            }
            if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
                free(b.s);
                return toml_fail(t, "\\%c%0*X is not a Unicode scalar value", esc, nd,
                                 (unsigned)cp);
            }
            if (cp == 0) {
                free(b.s);
                return toml_fail(t, "\\%c escape of NUL is not supported in strings", esc);
            }
            toml_put_utf8(&b, cp);
            break;
        }
        default:
            free(b.s);
            if (esc == '\0' || esc == '\n' || esc == '\r')
                return toml_fail(t, "backslash at end of line in a string");
            return toml_fail(t, "invalid escape '\\%c' in string", esc);
        }
    }
    *out = toml_buf_take(&b);
    return 0;
}

static int toml_parse_literal_string(toml_parser *t, char **out) {
    const char *start = ++t->p;
    while (t->p < t->end && *t->p != '\'') {
        if (*t->p == '\n' || *t->p == '\r') break;
        if (toml_is_ctrl((unsigned char)*t->p))
            return toml_fail(t, "control character 0x%02x in string",
                             (unsigned)(unsigned char)*t->p);
        t->p++;
    }
    if (t->p >= t->end || *t->p != '\'')
        return toml_fail(t, "unterminated literal string (missing closing ')");
    size_t n = (size_t)(t->p - start);
    char *s = ct_malloc(n + 1);
    memcpy(s, start, n);
    s[n] = '\0';
    t->p++;
    *out = s;
    return 0;
}

/* ---- numbers and other bare tokens ---- */

/* Scans digits of class `is` with single underscores between digits, from
 * tok[*i]. Returns the digit count, or -1 on a misplaced underscore. */
static int toml_scan_digits(const char *tok, size_t *i, int (*is)(char)) {
    int n = 0;
    int prev_digit = 0;
    for (;;) {
        char c = tok[*i];
        if (is(c)) {
            n++;
            prev_digit = 1;
        } else if (c == '_') {
            if (!prev_digit || !is(tok[*i + 1])) return -1;
            prev_digit = 0;
        } else {
            break;
        }
        (*i)++;
    }
    return n;
}

static int toml_parse_prefixed_int(toml_parser *t, const char *tok, toml_value *v) {
    int base = tok[1] == 'x' ? 16 : tok[1] == 'o' ? 8 : 2;
    int (*is)(char) = base == 16 ? toml_is_hex : base == 8 ? toml_is_oct : toml_is_bin;
    size_t i = 2;
    int n = toml_scan_digits(tok, &i, is);
    if (n <= 0 || tok[i] != '\0') return toml_fail(t, "invalid integer '%s'", tok);
    uint64_t acc = 0;
    for (size_t k = 2; tok[k]; k++) {
        if (tok[k] == '_') continue;
        uint64_t d = (uint64_t)toml_hexval(tok[k]);
        if (acc > ((uint64_t)INT64_MAX - d) / (uint64_t)base)
            return toml_fail(t, "integer '%s' does not fit in 64 bits", tok);
        acc = acc * (uint64_t)base + d;
    }
    v->kind = TOML_INT;
    v->i = (int64_t)acc;
    return 0;
}

static int toml_parse_number(toml_parser *t, const char *tok, toml_value *v) {
    size_t i = 0;
    int neg = 0;
    if (tok[i] == '+' || tok[i] == '-') neg = tok[i++] == '-';
    size_t int_start = i;
    int nint = toml_scan_digits(tok, &i, toml_is_dec);
    if (nint < 0) return toml_fail(t, "misplaced '_' in number '%s'", tok);
    if (nint == 0) {
        if (tok[i] == '.') return toml_fail(t, "invalid number '%s' (write 0.5, not .5)", tok);
        return toml_fail(t, "invalid value '%s' (strings must be quoted)", tok);
    }
    if (tok[int_start] == '0' && nint > 1)
        return toml_fail(t, "leading zeros are not allowed in '%s'", tok);
    int is_float = 0;
    if (tok[i] == '.') {
        i++;
        int nf = toml_scan_digits(tok, &i, toml_is_dec);
        if (nf <= 0) return toml_fail(t, "invalid float '%s' (digits must follow '.')", tok);
        is_float = 1;
    }
    if (tok[i] == 'e' || tok[i] == 'E') {
        i++;
        if (tok[i] == '+' || tok[i] == '-') i++;
        int ne = toml_scan_digits(tok, &i, toml_is_dec);
        if (ne <= 0) return toml_fail(t, "invalid exponent in '%s'", tok);
        is_float = 1;
    }
    if (tok[i] != '\0') return toml_fail(t, "invalid number '%s'", tok);

    if (!is_float) {
        uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
        uint64_t acc = 0;
        for (size_t k = int_start; tok[k]; k++) {
            if (tok[k] == '_') continue;
            uint64_t d = (uint64_t)(tok[k] - '0');
            if (acc > (limit - d) / 10)
                return toml_fail(t, "integer '%s' does not fit in 64 bits", tok);
            acc = acc * 10 + d;
        }
        v->kind = TOML_INT;
        v->i = neg ? (int64_t)(0 - acc) : (int64_t)acc;
        return 0;
    }
    /* strtod does not take underscores: copy without them. */
    size_t n = strlen(tok);
    char *clean = ct_malloc(n + 1);
    size_t m = 0;
    for (size_t k = 0; k < n; k++)
        if (tok[k] != '_') clean[m++] = tok[k];
    clean[m] = '\0';
    errno = 0;
    char *endp;
    double d = strtod(clean, &endp);
    int bad = *endp != '\0';
    int overflow = errno == ERANGE && isinf(d);
    free(clean);
    if (bad) return toml_fail(t, "invalid float '%s'", tok);
    if (overflow) return toml_fail(t, "float '%s' is out of range", tok);
    v->kind = TOML_FLOAT;
    v->f = d;
    return 0;
}

static int toml_parse_bare_value(toml_parser *t, toml_value *v) {
    const char *start = t->p;
    while (t->p < t->end) {
        char c = *t->p;
        if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == ',' || c == ']' ||
            c == '#')
            break;
        /* a NUL inside the token would end the C string that numbers are read from, so
         * `3<NUL>2` read as 3: TOML allows no control character in a value at all */
        if (toml_is_ctrl((unsigned char)c))
            return toml_fail(t, "control character 0x%02x in a value", (unsigned)(unsigned char)c);
        t->p++;
    }
    size_t n = (size_t)(t->p - start);
    if (n == 0) {
        if (t->p >= t->end || toml_at_newline(t) || *t->p == '#')
            return toml_fail(t, "expected a value");
        return toml_fail(t, "expected a value, got '%c'", *t->p);
    }
    char tok[128];
    if (n >= sizeof tok) return toml_fail(t, "value too long: '%.40s...'", start);
    memcpy(tok, start, n);
    tok[n] = '\0';

    if (strcmp(tok, "true") == 0 || strcmp(tok, "false") == 0) {
        v->kind = TOML_BOOL;
        v->i = tok[0] == 't';
        return 0;
    }
    const char *u = (tok[0] == '+' || tok[0] == '-') ? tok + 1 : tok;
    if (strcmp(u, "inf") == 0 || strcmp(u, "nan") == 0) {
        v->kind = TOML_FLOAT;
        v->f = u[0] == 'i' ? INFINITY : NAN;
        if (tok[0] == '-') v->f = -v->f;
        return 0;
    }
    if (strchr(tok, ':') ||
        (n >= 5 && toml_is_dec(tok[0]) && toml_is_dec(tok[1]) && toml_is_dec(tok[2]) &&
         toml_is_dec(tok[3]) && tok[4] == '-'))
        return toml_fail(t, "dates and times are not supported ('%s')", tok);
    if (tok[0] == '0' && (tok[1] == 'x' || tok[1] == 'o' || tok[1] == 'b'))
        return toml_parse_prefixed_int(t, tok, v);
    return toml_parse_number(t, tok, v);
}

static int toml_parse_value(toml_parser *t, toml_value *v, int depth);

static int toml_skip_array_space(toml_parser *t) {
    for (;;) {
        toml_skip_ws(t);
        if (t->p >= t->end) return 0;
        if (toml_at_newline(t)) {
            toml_eat_newline(t);
        } else if (*t->p == '#') {
            int rc = toml_skip_comment(t);
            if (rc) return rc;
        } else {
            return 0;
        }
    }
}

static int toml_parse_array(toml_parser *t, toml_value *v, int depth) {
    int open_line = t->line, cap = 0, rc;
    v->kind = TOML_ARRAY;
    t->p++; /* '[' */
    for (;;) {
        if ((rc = toml_skip_array_space(t))) return rc;
        if (t->p >= t->end) goto unterminated;
        if (*t->p == ']') break;
        if (v->n_items == cap) {
            cap = cap ? 2 * cap : 4;
            v->items = toml_grow(v->items, (size_t)cap * sizeof *v->items);
        }
        toml_value *it = &v->items[v->n_items];
        memset(it, 0, sizeof *it);
        if ((rc = toml_parse_value(t, it, depth + 1))) {
            toml_value_free(it); /* an inner array that failed part way holds items v's n_items does not count */
            return rc;
        }
        v->n_items++;
        if ((rc = toml_skip_array_space(t))) return rc;
        if (t->p >= t->end) goto unterminated;
        if (*t->p == ',') {
            t->p++;
            continue;
        }
        if (*t->p == ']') break;
        return toml_fail(t, "expected ',' or ']' in array, got '%c'", *t->p);
    }
    t->p++; /* ']' */
    return 0;
unterminated:
    return toml_fail(t, "unterminated array (opened at line %d)", open_line);
}

/* depth: the arrays the value is inside of (0 for a key's own value). */
static int toml_parse_value(toml_parser *t, toml_value *v, int depth) {
    if (t->p >= t->end) return toml_fail(t, "expected a value");
    char c = *t->p;
    if ((c == '"' || c == '\'') && t->end - t->p >= 3 && t->p[1] == c && t->p[2] == c)
        return toml_fail(t, "multi-line strings (%c%c%c) are not supported", c, c, c);
    if (c == '"') {
        v->kind = TOML_STRING;
        return toml_parse_basic_string(t, &v->s);
    }
    if (c == '\'') {
        v->kind = TOML_STRING;
        return toml_parse_literal_string(t, &v->s);
    }
    if (c == '[') {
        if (depth > 1) return toml_fail(t, "arrays nested more than two deep are not supported");
        return toml_parse_array(t, v, depth);
    }
    if (c == '{') return toml_fail(t, "inline tables ({...}) are not supported");
    return toml_parse_bare_value(t, v);
}

/* ---- keys and tables ---- */

/* A dotted name as read: its parts, unquoted ("a"."b" and a.b are the same). */
typedef struct {
    char part[TOML_MAX_DEPTH][128];
    int n;
} toml_key;

/* One part of a key or table name: a bare key, or a quoted one whose text
 * could have been written bare. Other quoted keys (spaces, dots, "") would
 * need a name that is not a dotted path; no config key needs one. */
static int toml_parse_key_part(toml_parser *t, char *out, size_t cap, const char *what) {
    if (t->p < t->end && (*t->p == '"' || *t->p == '\'')) {
        char q = *t->p, *s = NULL;
        if (t->end - t->p >= 3 && t->p[1] == q && t->p[2] == q)
            return toml_fail(t, "multi-line strings (%c%c%c) cannot be %ss", q, q, q, what);
        int rc = q == '"' ? toml_parse_basic_string(t, &s) : toml_parse_literal_string(t, &s);
        if (rc) return rc;
        size_t n = strlen(s);
        int bare = n > 0;
        for (size_t i = 0; i < n; i++) bare &= toml_is_bare(s[i]);
        if (!bare || n >= cap) {
            rc = toml_fail(t, "quoted %s %c%.40s%c is not supported: only quoted names made of A-Z a-z 0-9 _ - "
                           "(at most %zu), which mean the same unquoted", what, q, s, q, cap - 1);
            free(s);
            return rc;
        }
        memcpy(out, s, n + 1);
        free(s);
        return 0;
    }
    const char *start = t->p;
    while (t->p < t->end && toml_is_bare(*t->p)) t->p++;
    size_t n = (size_t)(t->p - start);
    if (n == 0) {
        if (t->p >= t->end || toml_at_newline(t)) return toml_fail(t, "expected a %s", what);
        return toml_fail(t, "expected a %s, got '%c'", what, *t->p);
    }
    if (n >= cap) return toml_fail(t, "%s too long: '%.40s...'", what, start);
    memcpy(out, start, n);
    out[n] = '\0';
    return 0;
}

/* A dotted key or table name: parts separated by '.', with optional blanks
 * around each (TOML allows `a . b`). A loop, not recursion, bounded by
 * TOML_MAX_DEPTH. */
static int toml_parse_key(toml_parser *t, toml_key *k, const char *what) {
    k->n = 0;
    for (;;) {
        toml_skip_ws(t);
        if (k->n == TOML_MAX_DEPTH)
            return toml_fail(t, "%s nested deeper than %d levels is not supported", what, TOML_MAX_DEPTH);
        int rc = toml_parse_key_part(t, k->part[k->n], sizeof k->part[k->n], what);
        if (rc) return rc;
        k->n++;
        toml_skip_ws(t);
        if (t->p >= t->end || *t->p != '.') return 0;
        t->p++;
    }
}

/* base + "." + parts[0..n) into out (TOML_MAX_NAME); base "" is the root. */
static int toml_join(toml_parser *t, const char *base, const toml_key *k, int n, char *out) {
    size_t len = (size_t)snprintf(out, TOML_MAX_NAME, "%s", base);
    for (int i = 0; i < n && len < TOML_MAX_NAME; i++)
        len += (size_t)snprintf(out + len, TOML_MAX_NAME - len, "%s%s", len ? "." : "", k->part[i]);
    if (len >= TOML_MAX_NAME) return toml_fail(t, "name too long: '%.60s...'", out);
    return 0;
}

/* The index of table `name` (an index: the array moves as tables are added), or -1. */
static int toml_section_index(const toml_doc *doc, const char *name) {
    const toml_section *s = toml_find_section(doc, name);
    return s ? (int)(s - doc->sections) : -1;
}

/* The name of table `name` as the user sees it in a message: [name]. */
static const char *toml_shown(const char *name) { return name[0] ? name : "(top level)"; }

static int toml_parse_header(toml_parser *t, toml_doc *doc, int *cur) {
    toml_key k;
    char name[TOML_MAX_NAME];
    int rc;
    t->p++; /* '[' */
    if (t->p < t->end && *t->p == '[')
        return toml_fail(t, "arrays of tables ([[...]]) are not supported");
    if ((rc = toml_parse_key(t, &k, "table name"))) return rc;
    if ((rc = toml_join(t, "", &k, k.n, name))) return rc;
    if (t->p >= t->end || *t->p != ']')
        return toml_fail(t, "expected ']' to close table [%s", name);
    t->p++;
    /* each level from the top: a value there cannot become a table; a missing
     * parent is created implicitly; the last level is defined here, once */
    int idx = 0;
    for (int i = 0; i < k.n; i++) {
        char here[TOML_MAX_NAME];
        if ((rc = toml_join(t, "", &k, i + 1, here))) return rc;
        const toml_kv *kv = toml_section_kv(&doc->sections[idx], k.part[i]);
        if (kv)
            return toml_fail(t, "table [%s]: %s is already a value (line %d), not a table", name, here, kv->line);
        idx = toml_section_index(doc, here);
        if (i < k.n - 1) {
            if (idx < 0) {
                idx = doc->n_sections;
                toml_section *s = toml_add_section(doc, here, t->line);
                s->implicit = 1;
            }
        } else if (idx >= 0) {
            toml_section *s = &doc->sections[idx];
            if (s->dotted)
                return toml_fail(t, "table [%s] defined twice: dotted keys at line %d defined it", name, s->line);
            if (!s->implicit)
                return toml_fail(t, "table [%s] defined twice (first at line %d)", name, s->line);
            s->implicit = 0;
            s->line = t->line;
        } else {
            idx = doc->n_sections;
            toml_add_section(doc, here, t->line);
        }
    }
    *cur = idx;
    return toml_expect_eol(t, "table header");
}

static int toml_parse_keyval(toml_parser *t, toml_doc *doc, int cur) {
    toml_key k;
    char spelled[TOML_MAX_NAME];
    int rc, line = t->line;
    if ((rc = toml_parse_key(t, &k, "key"))) return rc;
    if ((rc = toml_join(t, "", &k, k.n, spelled))) return rc;
    if (t->p >= t->end || *t->p != '=') return toml_fail(t, "expected '=' after key '%s'", spelled);
    t->p++;
    toml_skip_ws(t);
    if (t->p >= t->end || toml_at_newline(t) || *t->p == '#')
        return toml_fail(t, "missing value for key '%s'", spelled);
    /* a.b.c = v in [t]: tables t.a and t.a.b, defined by these dotted keys
     * (or already by earlier ones of the same [t]), then key c in t.a.b */
    int idx = cur;
    for (int i = 0; i < k.n - 1; i++) {
        char here[TOML_MAX_NAME];
        if ((rc = toml_join(t, doc->sections[cur].name, &k, i + 1, here))) return rc;
        const toml_kv *kv = toml_section_kv(&doc->sections[idx], k.part[i]);
        if (kv)
            return toml_fail(t, "key '%s': %s is already a value (line %d), not a table", spelled, here, kv->line);
        int next = toml_section_index(doc, here);
        if (next < 0) {
            next = doc->n_sections;
            toml_section *s = toml_add_section(doc, here, line);
            s->dotted = 1;
            s->dotted_ctx = cur;
        } else {
            toml_section *s = &doc->sections[next];
            if (!s->implicit && !s->dotted)
                return toml_fail(t, "key '%s': table [%s] was defined by its header at line %d; dotted keys "
                                 "cannot add to it", spelled, here, s->line);
            if (s->dotted && s->dotted_ctx != cur)
                return toml_fail(t, "key '%s': table [%s] was defined by dotted keys under [%s] (line %d); "
                                 "it cannot be extended from [%s]", spelled, here,
                                 toml_shown(doc->sections[s->dotted_ctx].name), s->line,
                                 toml_shown(doc->sections[cur].name));
            if (s->implicit) { /* [t.a.x] created t.a; these keys now define it */
                s->implicit = 0;
                s->dotted = 1;
                s->dotted_ctx = cur;
                s->line = line;
            }
        }
        idx = next;
    }
    const char *key = k.part[k.n - 1];
    char full[TOML_MAX_NAME];
    if ((rc = toml_join(t, doc->sections[cur].name, &k, k.n, full))) return rc;
    int tab = toml_section_index(doc, full);
    if (tab >= 0)
        return toml_fail(t, "key '%s': %s is already a table (line %d)", spelled, full, doc->sections[tab].line);
    toml_section *sec = &doc->sections[cur];
    const toml_kv *dup = toml_section_kv(&doc->sections[idx], key);
    if (dup) {
        if (sec->name[0])
            return toml_fail(t, "duplicate key '%s' in [%s] (first at line %d)", spelled, sec->name, dup->line);
        return toml_fail(t, "duplicate key '%s' (first at line %d)", spelled, dup->line);
    }
    toml_value v;
    memset(&v, 0, sizeof v);
    if ((rc = toml_parse_value(t, &v, 0))) {
        toml_value_free(&v);
        return rc;
    }
    sec = &doc->sections[idx];
    if (sec->n_kvs == sec->cap_kvs) {
        sec->cap_kvs = sec->cap_kvs ? 2 * sec->cap_kvs : 8;
        sec->kvs = toml_grow(sec->kvs, (size_t)sec->cap_kvs * sizeof *sec->kvs);
    }
    toml_kv *kv = &sec->kvs[sec->n_kvs++];
    kv->key = ct_strdup(key);
    kv->val = v;
    kv->line = line;
    return toml_expect_eol(t, "value");
}

int toml_parse_string(const char *text, size_t len, const char *name, toml_doc *doc,
                      ct_err *e) {
    memset(doc, 0, sizeof *doc);
    doc->path = ct_strdup(name);
    toml_parser t = {.p = text, .end = text + len, .line = 1, .name = name, .e = e};
    int rc = toml_check_utf8(&t);
    if (t.end - t.p >= 3 && memcmp(t.p, "\xef\xbb\xbf", 3) == 0) t.p += 3; /* BOM */
    toml_add_section(doc, "", 0);
    int cur = 0; /* index: sections move when the array grows */
    while (!rc && t.p < t.end) {
        toml_skip_ws(&t);
        if (t.p >= t.end) break;
        char c = *t.p;
        if (toml_at_newline(&t)) {
            toml_eat_newline(&t);
        } else if (c == '#') {
            rc = toml_skip_comment(&t);
        } else if (c == '[') {
            rc = toml_parse_header(&t, doc, &cur);
        } else if (toml_is_bare(c) || c == '"' || c == '\'') {
            rc = toml_parse_keyval(&t, doc, cur);
        } else if (toml_is_ctrl((unsigned char)c)) {
            rc = toml_fail(&t, "unexpected control character 0x%02x", (unsigned)(unsigned char)c);
        } else {
            rc = toml_fail(&t, "expected a key or [table], got '%c'", c);
        }
    }
    if (rc) {
        toml_free(doc);
        return rc;
    }
    return 0;
}

int toml_parse_file(const char *path, toml_doc *doc, ct_err *e) {
    memset(doc, 0, sizeof *doc);
    size_t n;
    char *buf = fs_read_file(path, 0, &n, NULL);
    if (!buf) return ct_fail(e, CT_ERR_IO, "%s: cannot read: %s", path, strerror(errno));
    int rc = toml_parse_string(buf, n, path, doc, e);
    free(buf);
    return rc;
}
