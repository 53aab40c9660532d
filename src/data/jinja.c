/* data/jinja.c: a small Jinja2 interpreter for chat templates (see jinja.h).
 *
 * Three stages: a scanner cuts the source into text, {{ }} and {% %} pieces
 * applying jinja2's whitespace rules (trim_blocks, lstrip_blocks, `-`, `+`);
 * a recursive-descent parser, following jinja2's grammar and precedence,
 * builds statement and expression trees; an evaluator walks them. Every
 * allocation of a parse or a render goes to an arena freed in one go. */
#include "data/jinja.h"
#include "core/fs.h"
#include "formats/json.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

/* ---------------------------------------------------------------- arena */

typedef struct ablock {
    struct ablock *next;
    size_t used, cap;
    _Alignas(16) unsigned char data[];
} ablock;

typedef struct {
    ablock *head;
} arena;

static void *ar_alloc(arena *a, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (!a->head || a->head->used + n > a->head->cap) {
        size_t cap = n > 65536 ? n : 65536;
        ablock *b = ct_malloc(sizeof *b + cap);
        b->used = 0;
        b->cap = cap;
        b->next = a->head;
        a->head = b;
    }
    void *p = a->head->data + a->head->used;
    a->head->used += n;
    memset(p, 0, n);
    return p;
}

static void ar_free(arena *a) {
    for (ablock *b = a->head, *nx; b; b = nx) {
        nx = b->next;
        free(b);
    }
    a->head = NULL;
}

static char *ar_strndup(arena *a, const char *s, size_t n) {
    char *p = ar_alloc(a, n + 1);
    memcpy(p, s, n);
    p[n] = 0;
    return p;
}

/* ---------------------------------------------------------------- values */

/* The longest string one repetition ('x' * n) may build: a chat prompt is far shorter, and a
 * template that asks for more would only exhaust memory. */
#define JINJA_MAX_STR (64 << 20)

typedef enum { JV_UNDEF, JV_NONE, JV_BOOL, JV_INT, JV_FLOAT, JV_STR, JV_LIST, JV_DICT, JV_NS, JV_FUNC } jv_kind;

typedef struct jv jv;
struct jv {
    jv_kind k;
    long long i; /* bool, int, function id */
    double f;
    const char *s; /* string (NUL-terminated too) */
    size_t n;      /* string bytes */
    jv **items;    /* list items, dict values */
    jv **keys;     /* dict keys (strings) */
    int len, cap;
    const char *undef_name; /* what was undefined, for messages */
};

/* Shared by every template and thread, and never written: operations build
 * new values in the render's arena (undef_at makes a new undefined value to
 * name what was undefined). Not const only because values travel as jv *. */
static jv V_UNDEF = {.k = JV_UNDEF}, V_NONE = {.k = JV_NONE}, V_TRUE = {.k = JV_BOOL, .i = 1},
          V_FALSE = {.k = JV_BOOL, .i = 0};

enum { FN_RAISE, FN_NAMESPACE, FN_RANGE, FN_STRFTIME, FN_DICT };

/* ---------------------------------------------------------------- trees */

typedef enum {
    E_LIT, E_NAME, E_ATTR, E_ITEM, E_SLICE, E_CALL, E_FILTER, E_TEST, E_NOT, E_NEG, E_BIN, E_AND, E_OR,
    E_COND, E_LIST, E_DICT
} ekind;

typedef enum { B_ADD, B_SUB, B_MUL, B_DIV, B_FDIV, B_MOD, B_POW, B_CAT, B_EQ, B_NE, B_LT, B_GT, B_LE, B_GE, B_IN, B_NOTIN } bop;

typedef struct expr expr;
struct expr {
    ekind k;
    int line;
    bop op;
    jv *lit;
    const char *name; /* E_NAME, E_ATTR, E_FILTER, E_TEST, kwarg names */
    expr *a, *b, *c;  /* operands; E_SLICE: obj=a, start/stop/step in args[0..2] */
    expr **args;
    const char **kwnames; /* NULL entry: positional */
    int nargs;
    int negate; /* E_TEST: is not */
};

typedef enum { S_TEXT, S_OUT, S_IF, S_FOR, S_SET, S_SETBLOCK, S_GEN, S_BREAK, S_CONTINUE } skind;

typedef struct stmt stmt;
typedef struct {
    stmt **v;
    int n, cap;
} body;

struct stmt {
    skind k;
    int line;
    const char *text; /* S_TEXT */
    size_t n;
    expr *e;            /* S_OUT, S_SET value, S_FOR iterable */
    expr **conds;       /* S_IF: conditions (NULL for else) */
    body *bodies;       /* S_IF branches */
    int nbranch;
    const char *tgt[2]; /* S_FOR targets, S_SET name */
    int ntgt;
    const char *attr; /* S_SET ns.attr */
    expr *filter;     /* S_FOR if */
    body b, else_b;   /* S_FOR, S_GEN, S_SETBLOCK */
};

struct jinja_tmpl {
    arena ar;
    body root;
    int has_gen;
    char name[4400];
};

/* ---------------------------------------------------------------- errors */

typedef struct {
    jmp_buf jb;
    ct_err *e;
    const char *name;
} failer;

__attribute__((format(printf, 3, 4), noreturn)) static void jfail(failer *f, int line, const char *fmt, ...) {
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (line > 0)
        ct_fail(f->e, CT_ERR_FORMAT, "%s: line %d: %s", f->name, line, msg);
    else
        ct_fail(f->e, CT_ERR_FORMAT, "%s: %s", f->name, msg);
    longjmp(f->jb, 1);
}

/* ---------------------------------------------------------------- scanner */

typedef enum { P_TEXT, P_VAR, P_BLOCK } pkind;

typedef struct {
    pkind k;
    const char *s; /* text, or the inside of the tag */
    size_t n;
    int line;
} piece;

typedef struct {
    piece *v;
    int n, cap;
} pieces;

static void pieces_push(arena *a, pieces *p, piece x) {
    if (p->n == p->cap) {
        int cap = p->cap ? 2 * p->cap : 64;
        piece *nv = ar_alloc(a, (size_t)cap * sizeof *nv);
        if (p->n) memcpy(nv, p->v, (size_t)p->n * sizeof *nv);
        p->v = nv;
        p->cap = cap;
    }
    p->v[p->n++] = x;
}

static int is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

static int count_lines(const char *s, size_t n) {
    int k = 0;
    for (size_t i = 0; i < n; i++) k += s[i] == '\n';
    return k;
}

/* End of the tag body starting at p (just after the opener): the position of
 * `close` (e.g. "%}") outside string literals and brackets; -1 if none. */
static long find_tag_end(const char *s, size_t len, size_t p, char close) {
    int depth = 0;
    for (size_t i = p; i < len; i++) {
        char c = s[i];
        if (c == '\'' || c == '"') {
            for (i++; i < len && s[i] != c; i++)
                if (s[i] == '\\') i++;
            continue;
        }
        if (c == '(' || c == '[' || c == '{') depth++;
        else if ((c == ')' || c == ']' || c == '}') && depth > 0) depth--;
        else if (depth == 0 && c == close && i + 1 < len && s[i + 1] == '}') return (long)i;
    }
    return -1;
}

/* jinja2's lexer with trim_blocks=True, lstrip_blocks=True. src has its
 * newlines normalised and its trailing newline dropped. */
static void scan(failer *f, arena *a, const char *src, size_t len, pieces *out) {
    size_t pos = 0;
    int line = 1, line_starting = 1;
    while (pos < len) {
        /* next tag opener */
        size_t t = pos;
        while (t + 1 < len && !(src[t] == '{' && (src[t + 1] == '{' || src[t + 1] == '%' || src[t + 1] == '#')))
            t++;
        if (t + 1 >= len) { /* plain text to the end */
            pieces_push(a, out, (piece){P_TEXT, src + pos, len - pos, line});
            break;
        }
        char kind = src[t + 1];
        char sign = t + 2 < len ? src[t + 2] : 0;
        size_t tn = t - pos; /* text before the tag */
        if (sign == '-') {
            while (tn > 0 && is_ws(src[pos + tn - 1])) tn--;
        } else if (sign != '+' && kind != '{') {
            size_t l = tn;
            while (l > 0 && src[pos + l - 1] != '\n') l--;
            if (l > 0 || line_starting) {
                size_t k = l;
                while (k < tn && (src[pos + k] == ' ' || src[pos + k] == '\t' || src[pos + k] == '\r' ||
                                  src[pos + k] == '\v' || src[pos + k] == '\f'))
                    k++;
                if (k == tn && tn > l) tn = l;
            }
        }
        if (tn) pieces_push(a, out, (piece){P_TEXT, src + pos, tn, line});
        line += count_lines(src + pos, t - pos);
        int tag_line = line;
        size_t inner = t + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
        size_t end; /* just past the closer and what it eats */
        if (kind == '#') {
            size_t c = inner;
            while (c + 1 < len && !(src[c] == '#' && src[c + 1] == '}')) c++;
            if (c + 1 >= len) jfail(f, tag_line, "a comment {# is never closed");
            int minus = c > inner && src[c - 1] == '-', plus = c > inner && src[c - 1] == '+';
            end = c + 2;
            if (minus) {
                while (end < len && is_ws(src[end])) end++;
            } else if (!plus && end < len && src[end] == '\n') {
                end++;
            }
        } else {
            char close = kind == '{' ? '}' : '%';
            long c = find_tag_end(src, len, inner, close);
            if (c < 0) jfail(f, tag_line, "a %s tag is never closed", kind == '{' ? "{{" : "{%");
            size_t ce = (size_t)c, inner_end = ce;
            int minus = 0, plus = 0;
            if (ce > inner && src[ce - 1] == '-') minus = 1, inner_end--;
            else if (ce > inner && src[ce - 1] == '+' && kind == '%') plus = 1, inner_end--;
            end = ce + 2;
            if (minus) {
                while (end < len && is_ws(src[end])) end++;
            } else if (kind == '%' && !plus && end < len && src[end] == '\n') {
                end++;
            }
            pieces_push(a, out, (piece){kind == '{' ? P_VAR : P_BLOCK, src + inner, inner_end - inner, tag_line});
        }
        line += count_lines(src + t, end - t);
        line_starting = src[end - 1] == '\n';
        pos = end;
    }
}

/* ---------------------------------------------------------------- expression lexer */

typedef enum { T_END, T_NAME, T_STR, T_INT, T_FLOAT, T_OP } ttype;

typedef struct {
    ttype t;
    const char *s; /* name / op text (in source) ; decoded string */
    size_t n;
    long long iv;
    double fv;
} token;

typedef struct {
    failer *f;
    arena *a;
    token *tk;
    int n, pos;
    int line;
    /* template-level */
    pieces *ps;
    int pi;
    int has_gen; /* a {% generation %} block was parsed */
    int depth;   /* expression parsers now on the stack (see JINJA_MAX_DEPTH) */
    int bdepth;  /* blocks now open */
} parser;

static void push_utf8(char *buf, size_t *n, uint32_t cp) {
    if (cp < 0x80) buf[(*n)++] = (char)cp;
    else if (cp < 0x800) {
        buf[(*n)++] = (char)(0xC0 | (cp >> 6));
        buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        buf[(*n)++] = (char)(0xE0 | (cp >> 12));
        buf[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        buf[(*n)++] = (char)(0xF0 | (cp >> 18));
        buf[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        buf[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        buf[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static void lex(parser *P, const char *s, size_t n, int line) {
    int cap = 16;
    P->tk = ar_alloc(P->a, (size_t)cap * sizeof *P->tk);
    P->n = 0;
    P->pos = 0;
    P->line = line;
    size_t i = 0;
    for (;;) {
        while (i < n && is_ws(s[i])) {
            if (s[i] == '\n') line++;
            i++;
        }
        if (P->n + 1 >= cap) {
            token *nt = ar_alloc(P->a, (size_t)cap * 2 * sizeof *nt);
            memcpy(nt, P->tk, (size_t)cap * sizeof *nt);
            P->tk = nt;
            cap *= 2;
        }
        token *t = &P->tk[P->n];
        if (i >= n) {
            t->t = T_END;
            break;
        }
        char c = s[i];
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_') {
            size_t j = i;
            while (j < n && ((s[j] >= 'a' && s[j] <= 'z') || (s[j] >= 'A' && s[j] <= 'Z') || s[j] == '_' ||
                             (s[j] >= '0' && s[j] <= '9')))
                j++;
            *t = (token){T_NAME, ar_strndup(P->a, s + i, j - i), j - i, 0, 0};
            i = j;
        } else if (c >= '0' && c <= '9') {
            size_t j = i;
            while (j < n && ((s[j] >= '0' && s[j] <= '9') || s[j] == '_')) j++;
            int isf = 0;
            if (j + 1 < n && s[j] == '.' && s[j + 1] >= '0' && s[j + 1] <= '9') {
                isf = 1;
                j++;
                while (j < n && s[j] >= '0' && s[j] <= '9') j++;
            }
            char *txt = ar_strndup(P->a, s + i, j - i);
            if (isf) *t = (token){T_FLOAT, txt, j - i, 0, strtod(txt, NULL)};
            else {
                long long v = 0;
                for (const char *q = txt; *q; q++)
                    if (*q != '_' && (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, *q - '0', &v)))
                        jfail(P->f, line, "integer literal %s is out of range", txt);
                *t = (token){T_INT, txt, j - i, v, 0};
            }
            i = j;
        } else if (c == '\'' || c == '"') {
            /* sized by the literal, not by the rest of the tag: a tag of many literals
             * must not take memory quadratic in its length (no escape decodes longer) */
            size_t j = i + 1;
            while (j < n && s[j] != c) j += s[j] == '\\' && j + 1 < n ? 2 : 1;
            char *buf = ar_alloc(P->a, j - i);
            size_t bn = 0;
            j = i + 1;
            for (;;) {
                if (j >= n) jfail(P->f, line, "a string literal is never closed");
                char d = s[j];
                if (d == c) break;
                if (d == '\\' && j + 1 < n) {
                    char x = s[j + 1];
                    j += 2;
                    switch (x) {
                    case 'n': buf[bn++] = '\n'; break;
                    case 't': buf[bn++] = '\t'; break;
                    case 'r': buf[bn++] = '\r'; break;
                    case '\\': buf[bn++] = '\\'; break;
                    case '\'': buf[bn++] = '\''; break;
                    case '"': buf[bn++] = '"'; break;
                    case '0': buf[bn++] = 0; break;
                    case 'a': buf[bn++] = '\a'; break;
                    case 'b': buf[bn++] = '\b'; break;
                    case 'f': buf[bn++] = '\f'; break;
                    case 'v': buf[bn++] = '\v'; break;
                    case '\n': break;
                    case 'x':
                    case 'u':
                    case 'U': {
                        int digits = x == 'x' ? 2 : x == 'u' ? 4 : 8;
                        uint32_t cp = 0;
                        for (int k = 0; k < digits; k++) {
                            int h = j < n ? hexval(s[j]) : -1;
                            if (h < 0) jfail(P->f, line, "a bad \\%c escape in a string literal", x);
                            cp = cp * 16 + (uint32_t)h;
                            j++;
                        }
                        push_utf8(buf, &bn, cp);
                        break;
                    }
                    default: /* Python keeps an unknown escape as written */
                        buf[bn++] = '\\';
                        buf[bn++] = x;
                    }
                    continue;
                }
                if (d == '\n') line++;
                buf[bn++] = d;
                j++;
            }
            buf[bn] = 0;
            *t = (token){T_STR, buf, bn, 0, 0};
            i = j + 1;
        } else {
            static const char *ops[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">",
                                        "=", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|"};
            size_t k;
            for (k = 0; k < sizeof ops / sizeof *ops; k++) {
                size_t l = strlen(ops[k]);
                if (i + l <= n && !memcmp(s + i, ops[k], l)) break;
            }
            if (k == sizeof ops / sizeof *ops) jfail(P->f, line, "unexpected character '%c'", c);
            *t = (token){T_OP, ops[k], strlen(ops[k]), 0, 0};
            i += strlen(ops[k]);
        }
        P->n++;
    }
    P->n++; /* the T_END */
}

static token *cur(parser *P) { return &P->tk[P->pos]; }
static int is_op(parser *P, const char *op) { return cur(P)->t == T_OP && !strcmp(cur(P)->s, op); }
static int is_name(parser *P, const char *nm) { return cur(P)->t == T_NAME && !strcmp(cur(P)->s, nm); }
static void advance(parser *P) {
    if (cur(P)->t != T_END) P->pos++;
}
static const char *tok_desc(token *t) {
    switch (t->t) {
    case T_END: return "the end of the tag";
    case T_STR: return "a string";
    case T_INT:
    case T_FLOAT: return "a number";
    default: return t->s;
    }
}
static void expect_op(parser *P, const char *op) {
    if (!is_op(P, op)) jfail(P->f, P->line, "expected '%s', found '%s'", op, tok_desc(cur(P)));
    advance(P);
}
static const char *expect_name(parser *P) {
    if (cur(P)->t != T_NAME) jfail(P->f, P->line, "expected a name, found '%s'", tok_desc(cur(P)));
    const char *s = cur(P)->s;
    advance(P);
    return s;
}

/* Every recursion of the parser goes through here (a nested expression, a
 * unary operator, a nested block), so the C stack it uses stays bounded
 * whatever the template. */
static void nest_in(parser *P, int *depth, int line) {
    if (++*depth > JINJA_MAX_DEPTH) jfail(P->f, line, "nesting deeper than %d levels", JINJA_MAX_DEPTH);
}

static expr *mk(parser *P, ekind k) {
    expr *e = ar_alloc(P->a, sizeof *e);
    e->k = k;
    e->line = P->line;
    return e;
}

static jv *mk_val(arena *a, jv_kind k) {
    jv *v = ar_alloc(a, sizeof *v);
    v->k = k;
    return v;
}

static jv *mk_str(arena *a, const char *s, size_t n) {
    jv *v = mk_val(a, JV_STR);
    v->s = ar_strndup(a, s, n);
    v->n = n;
    return v;
}

static jv *mk_int(arena *a, long long i) {
    jv *v = mk_val(a, JV_INT);
    v->i = i;
    return v;
}

static void list_push(arena *a, jv *l, jv *x) {
    if (l->len == l->cap) {
        int cap = l->cap ? 2 * l->cap : 8;
        jv **ni = ar_alloc(a, (size_t)cap * sizeof *ni);
        if (l->len) memcpy(ni, l->items, (size_t)l->len * sizeof *ni);
        l->items = ni;
        if (l->k == JV_DICT || l->k == JV_NS) {
            jv **nk = ar_alloc(a, (size_t)cap * sizeof *nk);
            if (l->len) memcpy(nk, l->keys, (size_t)l->len * sizeof *nk);
            l->keys = nk;
        }
        l->cap = cap;
    }
    l->items[l->len++] = x;
}

static int dict_find(const jv *d, const char *k, size_t n) {
    for (int i = 0; i < d->len; i++)
        if (d->keys[i]->n == n && !memcmp(d->keys[i]->s, k, n)) return i;
    return -1;
}

static void dict_set(arena *a, jv *d, jv *key, jv *val) {
    int i = dict_find(d, key->s, key->n);
    if (i >= 0) {
        d->items[i] = val;
        return;
    }
    list_push(a, d, val);
    d->keys[d->len - 1] = key;
}

static void add_arg(parser *P, expr *e, const char *kw, expr *x) {
    expr **na = ar_alloc(P->a, (size_t)(e->nargs + 1) * sizeof *na);
    const char **nk = ar_alloc(P->a, (size_t)(e->nargs + 1) * sizeof *nk);
    if (e->nargs) {
        memcpy(na, e->args, (size_t)e->nargs * sizeof *na);
        memcpy(nk, e->kwnames, (size_t)e->nargs * sizeof *nk);
    }
    na[e->nargs] = x;
    nk[e->nargs] = kw;
    e->args = na;
    e->kwnames = nk;
    e->nargs++;
}

static expr *parse_expr(parser *P, int with_cond);
static expr *parse_or(parser *P);
static expr *parse_unary(parser *P, int with_filter);
static expr *parse_primary(parser *P);
static expr *parse_postfix(parser *P, expr *e);

/* ( args ) after the '(' has been seen */
static void parse_call_args(parser *P, expr *e) {
    expect_op(P, "(");
    while (!is_op(P, ")")) {
        if (e->nargs) expect_op(P, ",");
        if (is_op(P, ")")) break;
        if (is_op(P, "*") || is_op(P, "**")) jfail(P->f, P->line, "*args / **kwargs are outside the supported Jinja subset");
        const char *kw = NULL;
        if (cur(P)->t == T_NAME && P->tk[P->pos + 1].t == T_OP && !strcmp(P->tk[P->pos + 1].s, "=")) {
            kw = cur(P)->s;
            advance(P);
            advance(P);
        }
        add_arg(P, e, kw, parse_expr(P, 1));
    }
    expect_op(P, ")");
}

static expr *parse_primary(parser *P) {
    token *t = cur(P);
    expr *e;
    if (t->t == T_NAME) {
        const char *s = t->s;
        advance(P);
        if (!strcmp(s, "true") || !strcmp(s, "True")) (e = mk(P, E_LIT))->lit = &V_TRUE;
        else if (!strcmp(s, "false") || !strcmp(s, "False")) (e = mk(P, E_LIT))->lit = &V_FALSE;
        else if (!strcmp(s, "none") || !strcmp(s, "None")) (e = mk(P, E_LIT))->lit = &V_NONE;
        else (e = mk(P, E_NAME))->name = s;
        return e;
    }
    if (t->t == T_STR) {
        /* adjacent literals concatenate */
        size_t total = 0;
        int k = P->pos;
        while (P->tk[k].t == T_STR) total += P->tk[k++].n;
        char *buf = ar_alloc(P->a, total + 1);
        size_t o = 0;
        while (cur(P)->t == T_STR) {
            memcpy(buf + o, cur(P)->s, cur(P)->n);
            o += cur(P)->n;
            advance(P);
        }
        e = mk(P, E_LIT);
        e->lit = mk_val(P->a, JV_STR);
        e->lit->s = buf;
        e->lit->n = total;
        return e;
    }
    if (t->t == T_INT) {
        e = mk(P, E_LIT);
        e->lit = mk_int(P->a, t->iv);
        advance(P);
        return e;
    }
    if (t->t == T_FLOAT) {
        e = mk(P, E_LIT);
        e->lit = mk_val(P->a, JV_FLOAT);
        e->lit->f = t->fv;
        advance(P);
        return e;
    }
    if (is_op(P, "(")) {
        advance(P);
        if (is_op(P, ")")) jfail(P->f, P->line, "tuples are outside the supported Jinja subset");
        e = parse_expr(P, 1);
        if (is_op(P, ",")) jfail(P->f, P->line, "tuples are outside the supported Jinja subset");
        expect_op(P, ")");
        return e;
    }
    if (is_op(P, "[")) {
        advance(P);
        e = mk(P, E_LIST);
        while (!is_op(P, "]")) {
            if (e->nargs) expect_op(P, ",");
            if (is_op(P, "]")) break;
            add_arg(P, e, NULL, parse_expr(P, 1));
        }
        expect_op(P, "]");
        return e;
    }
    if (is_op(P, "{")) {
        advance(P);
        e = mk(P, E_DICT);
        int first = 1;
        while (!is_op(P, "}")) {
            if (!first) expect_op(P, ",");
            first = 0;
            if (is_op(P, "}")) break;
            expr *k = parse_expr(P, 1);
            expect_op(P, ":");
            add_arg(P, e, NULL, k);
            add_arg(P, e, NULL, parse_expr(P, 1));
        }
        expect_op(P, "}");
        return e;
    }
    jfail(P->f, P->line, "unexpected '%s' in an expression", tok_desc(t));
}

static expr *parse_postfix(parser *P, expr *e) {
    for (;;) {
        if (is_op(P, ".")) {
            advance(P);
            expr *x = mk(P, E_ATTR);
            x->a = e;
            if (cur(P)->t == T_INT) { /* foo.0 is foo[0] */
                x->k = E_ITEM;
                x->b = mk(P, E_LIT);
                x->b->lit = mk_int(P->a, cur(P)->iv);
                advance(P);
            } else {
                x->name = expect_name(P);
            }
            e = x;
        } else if (is_op(P, "[")) {
            advance(P);
            expr *parts[3] = {NULL, NULL, NULL};
            int slice = 0, k = 0;
            for (;;) {
                if (is_op(P, ":")) {
                    slice = 1;
                    if (++k > 2) jfail(P->f, P->line, "a slice takes at most three parts");
                    advance(P);
                    continue;
                }
                if (is_op(P, "]")) break;
                if (is_op(P, ",")) jfail(P->f, P->line, "tuple subscripts are outside the supported Jinja subset");
                parts[k] = parse_expr(P, 1);
                if (!is_op(P, ":") && !is_op(P, "]"))
                    jfail(P->f, P->line, "expected ':' or ']', found '%s'", tok_desc(cur(P)));
            }
            expect_op(P, "]");
            expr *x;
            if (slice) {
                x = mk(P, E_SLICE);
                x->a = e;
                for (int j = 0; j < 3; j++) add_arg(P, x, NULL, parts[j]);
            } else {
                if (!parts[0]) jfail(P->f, P->line, "an empty subscript []");
                x = mk(P, E_ITEM);
                x->a = e;
                x->b = parts[0];
            }
            e = x;
        } else if (is_op(P, "(")) {
            expr *x = mk(P, E_CALL);
            x->a = e;
            parse_call_args(P, x);
            e = x;
        } else {
            return e;
        }
    }
}

static expr *parse_filter_expr(parser *P, expr *e) {
    for (;;) {
        if (is_op(P, "|")) {
            advance(P);
            expr *x = mk(P, E_FILTER);
            x->a = e;
            x->name = expect_name(P);
            while (is_op(P, ".")) jfail(P->f, P->line, "dotted filter names are outside the supported Jinja subset");
            if (is_op(P, "(")) parse_call_args(P, x);
            e = x;
        } else if (is_name(P, "is")) {
            advance(P);
            expr *x = mk(P, E_TEST);
            x->a = e;
            if (is_name(P, "not")) {
                x->negate = 1;
                advance(P);
            }
            x->name = expect_name(P);
            token *t = cur(P);
            if (is_op(P, "(")) {
                parse_call_args(P, x);
            } else if ((t->t == T_NAME || t->t == T_STR || t->t == T_INT || t->t == T_FLOAT || is_op(P, "[") ||
                        is_op(P, "{")) &&
                       !is_name(P, "else") && !is_name(P, "or") && !is_name(P, "and")) {
                if (is_name(P, "is")) jfail(P->f, P->line, "tests cannot be chained with is");
                add_arg(P, x, NULL, parse_postfix(P, parse_primary(P)));
            }
            e = x;
        } else if (is_op(P, "(")) {
            expr *x = mk(P, E_CALL);
            x->a = e;
            parse_call_args(P, x);
            e = x;
        } else {
            return e;
        }
    }
}

static expr *parse_unary(parser *P, int with_filter) {
    expr *e;
    if (is_op(P, "-")) {
        advance(P);
        e = mk(P, E_NEG);
        nest_in(P, &P->depth, P->line);
        e->a = parse_unary(P, 0);
        P->depth--;
    } else if (is_op(P, "+")) {
        advance(P);
        nest_in(P, &P->depth, P->line);
        e = parse_unary(P, 0);
        P->depth--;
    } else {
        e = parse_primary(P);
    }
    e = parse_postfix(P, e);
    if (with_filter) e = parse_filter_expr(P, e);
    return e;
}

static expr *bin(parser *P, bop op, expr *l, expr *r) {
    expr *e = mk(P, E_BIN);
    e->op = op;
    e->a = l;
    e->b = r;
    return e;
}

static expr *parse_pow(parser *P) {
    expr *l = parse_unary(P, 1);
    while (is_op(P, "**")) {
        advance(P);
        l = bin(P, B_POW, l, parse_unary(P, 1));
    }
    return l;
}

static expr *parse_math2(parser *P) {
    expr *l = parse_pow(P);
    for (;;) {
        bop op;
        if (is_op(P, "*")) op = B_MUL;
        else if (is_op(P, "/")) op = B_DIV;
        else if (is_op(P, "//")) op = B_FDIV;
        else if (is_op(P, "%")) op = B_MOD;
        else return l;
        advance(P);
        l = bin(P, op, l, parse_pow(P));
    }
}

static expr *parse_concat(parser *P) {
    expr *l = parse_math2(P);
    while (is_op(P, "~")) {
        advance(P);
        l = bin(P, B_CAT, l, parse_math2(P));
    }
    return l;
}

static expr *parse_math1(parser *P) {
    expr *l = parse_concat(P);
    for (;;) {
        bop op;
        if (is_op(P, "+")) op = B_ADD;
        else if (is_op(P, "-")) op = B_SUB;
        else return l;
        advance(P);
        l = bin(P, op, l, parse_concat(P));
    }
}

static expr *parse_compare(parser *P) {
    expr *l = parse_math1(P), *last = NULL;
    for (;;) {
        bop op;
        if (is_op(P, "==")) op = B_EQ;
        else if (is_op(P, "!=")) op = B_NE;
        else if (is_op(P, "<")) op = B_LT;
        else if (is_op(P, ">")) op = B_GT;
        else if (is_op(P, "<=")) op = B_LE;
        else if (is_op(P, ">=")) op = B_GE;
        else if (is_name(P, "in")) op = B_IN;
        else if (is_name(P, "not") && P->tk[P->pos + 1].t == T_NAME && !strcmp(P->tk[P->pos + 1].s, "in")) {
            advance(P);
            op = B_NOTIN;
        } else return l;
        advance(P);
        expr *r = parse_math1(P);
        if (!last) {
            l = bin(P, op, l, r);
        } else { /* a < b < c is (a < b) and (b < c) */
            expr *e = mk(P, E_AND);
            e->a = l;
            e->b = bin(P, op, last, r);
            l = e;
        }
        last = r;
    }
}

static expr *parse_not(parser *P) {
    if (is_name(P, "not")) {
        advance(P);
        expr *e = mk(P, E_NOT);
        nest_in(P, &P->depth, P->line);
        e->a = parse_not(P);
        P->depth--;
        return e;
    }
    return parse_compare(P);
}

static expr *parse_and(parser *P) {
    expr *l = parse_not(P);
    while (is_name(P, "and")) {
        advance(P);
        expr *e = mk(P, E_AND);
        e->a = l;
        e->b = parse_not(P);
        l = e;
    }
    return l;
}

static expr *parse_or(parser *P) {
    expr *l = parse_and(P);
    while (is_name(P, "or")) {
        advance(P);
        expr *e = mk(P, E_OR);
        e->a = l;
        e->b = parse_and(P);
        l = e;
    }
    return l;
}

/* The depth of the tree under e, which the evaluator recurses along: chains
 * the parser builds in loops (a + b + c ..., x.a.b.c ..., x|f|g ...) nest
 * without parser recursion. Itself recursive, but never past the limit. */
static void check_tree(parser *P, const expr *e, int depth) {
    if (!e) return;
    if (depth > JINJA_MAX_DEPTH) jfail(P->f, e->line, "nesting deeper than %d levels", JINJA_MAX_DEPTH);
    check_tree(P, e->a, depth + 1);
    check_tree(P, e->b, depth + 1);
    check_tree(P, e->c, depth + 1);
    for (int i = 0; i < e->nargs; i++) check_tree(P, e->args[i], depth + 1);
}

static expr *parse_expr(parser *P, int with_cond) {
    nest_in(P, &P->depth, P->line);
    expr *e = parse_or(P);
    if (with_cond) {
        while (is_name(P, "if")) {
            advance(P);
            expr *c = mk(P, E_COND);
            c->a = e;
            c->b = parse_or(P);
            if (is_name(P, "else")) {
                advance(P);
                c->c = parse_expr(P, 1);
            }
            e = c;
        }
    }
    if (--P->depth == 0) check_tree(P, e, 1);
    return e;
}

static void expect_end(parser *P) {
    if (cur(P)->t != T_END) jfail(P->f, P->line, "unexpected '%s' (expected the end of the tag)", tok_desc(cur(P)));
}

static void body_push(arena *a, body *b, stmt *s) {
    if (b->n == b->cap) {
        int cap = b->cap ? 2 * b->cap : 8;
        stmt **nv = ar_alloc(a, (size_t)cap * sizeof *nv);
        if (b->n) memcpy(nv, b->v, (size_t)b->n * sizeof *nv);
        b->v = nv;
        b->cap = cap;
    }
    b->v[b->n++] = s;
}

/* Parses pieces into b until a block tag whose first word is one of `ends`
 * (space-separated); returns that word ("" at the end of the template, which
 * is an error unless ends is NULL). The parser is left on the tag's tokens
 * after the word. */
static const char *parse_body(parser *P, body *b, const char *ends, const char *opener, int open_line);

static int word_in(const char *w, const char *list) {
    size_t n = strlen(w);
    for (const char *p = list; *p;) {
        const char *q = strchr(p, ' ');
        size_t l = q ? (size_t)(q - p) : strlen(p);
        if (l == n && !memcmp(p, w, n)) return 1;
        if (!q) break;
        p = q + 1;
    }
    return 0;
}

static stmt *mk_stmt(parser *P, skind k) {
    stmt *s = ar_alloc(P->a, sizeof *s);
    s->k = k;
    s->line = P->line;
    return s;
}

static stmt *parse_block(parser *P, const char *w) {
    int line = P->line;
    if (!strcmp(w, "if")) {
        stmt *s = mk_stmt(P, S_IF);
        int cap = 4;
        s->conds = ar_alloc(P->a, (size_t)cap * sizeof *s->conds);
        s->bodies = ar_alloc(P->a, (size_t)cap * sizeof *s->bodies);
        expr *c = parse_expr(P, 1);
        for (;;) {
            expect_end(P);
            if (s->nbranch == cap) {
                expr **nc = ar_alloc(P->a, (size_t)cap * 2 * sizeof *nc);
                body *nb = ar_alloc(P->a, (size_t)cap * 2 * sizeof *nb);
                memcpy(nc, s->conds, (size_t)cap * sizeof *nc);
                memcpy(nb, s->bodies, (size_t)cap * sizeof *nb);
                s->conds = nc;
                s->bodies = nb;
                cap *= 2;
            }
            s->conds[s->nbranch] = c;
            const char *end = parse_body(P, &s->bodies[s->nbranch], c ? "elif else endif" : "endif", "if", line);
            s->nbranch++;
            if (!strcmp(end, "endif")) {
                expect_end(P);
                return s;
            }
            c = !strcmp(end, "elif") ? parse_expr(P, 1) : NULL;
        }
    }
    if (!strcmp(w, "for")) {
        stmt *s = mk_stmt(P, S_FOR);
        s->tgt[s->ntgt++] = expect_name(P);
        while (is_op(P, ",")) {
            advance(P);
            if (s->ntgt == 2) jfail(P->f, P->line, "for with more than two targets is outside the supported Jinja subset");
            s->tgt[s->ntgt++] = expect_name(P);
        }
        if (!is_name(P, "in")) jfail(P->f, P->line, "expected 'in' in a for tag");
        advance(P);
        s->e = parse_expr(P, 0);
        if (is_name(P, "if")) {
            advance(P);
            s->filter = parse_expr(P, 1);
        }
        if (is_name(P, "recursive")) jfail(P->f, P->line, "recursive loops are outside the supported Jinja subset");
        expect_end(P);
        const char *end = parse_body(P, &s->b, "else endfor", "for", line);
        if (!strcmp(end, "else")) {
            expect_end(P);
            parse_body(P, &s->else_b, "endfor", "for", line);
        }
        expect_end(P);
        return s;
    }
    if (!strcmp(w, "set")) {
        stmt *s = mk_stmt(P, S_SET);
        s->tgt[0] = expect_name(P);
        if (is_op(P, ".")) {
            advance(P);
            s->attr = expect_name(P);
        }
        if (is_op(P, ",")) jfail(P->f, P->line, "set with several targets is outside the supported Jinja subset");
        if (is_op(P, "=")) {
            advance(P);
            s->e = parse_expr(P, 1);
            if (is_op(P, ",")) jfail(P->f, P->line, "tuples are outside the supported Jinja subset");
            expect_end(P);
            return s;
        }
        if (s->attr) jfail(P->f, P->line, "a block set of a namespace attribute is outside the supported Jinja subset");
        s->k = S_SETBLOCK;
        if (is_op(P, "|")) jfail(P->f, P->line, "a filtered block set is outside the supported Jinja subset");
        expect_end(P);
        parse_body(P, &s->b, "endset", "set", line);
        expect_end(P);
        return s;
    }
    if (!strcmp(w, "generation")) {
        stmt *s = mk_stmt(P, S_GEN);
        P->has_gen = 1;
        expect_end(P);
        parse_body(P, &s->b, "endgeneration", "generation", line);
        expect_end(P);
        return s;
    }
    if (!strcmp(w, "break") || !strcmp(w, "continue")) {
        stmt *s = mk_stmt(P, w[0] == 'b' ? S_BREAK : S_CONTINUE);
        expect_end(P);
        return s;
    }
    jfail(P->f, P->line, "{%% %s %%} is outside the supported Jinja subset", w);
}

static const char *parse_body(parser *P, body *b, const char *ends, const char *opener, int open_line) {
    /* the executor recurses along nested blocks as the parser does */
    if (ends) nest_in(P, &P->bdepth, open_line);
    while (P->pi < P->ps->n) {
        piece *p = &P->ps->v[P->pi++];
        if (p->k == P_TEXT) {
            stmt *s = mk_stmt(P, S_TEXT);
            s->line = p->line;
            s->text = p->s;
            s->n = p->n;
            body_push(P->a, b, s);
            continue;
        }
        lex(P, p->s, p->n, p->line);
        if (p->k == P_VAR) {
            stmt *s = mk_stmt(P, S_OUT);
            s->e = parse_expr(P, 1);
            if (is_op(P, ",")) jfail(P->f, P->line, "tuples are outside the supported Jinja subset");
            expect_end(P);
            body_push(P->a, b, s);
            continue;
        }
        const char *w = expect_name(P);
        if (ends && word_in(w, ends)) {
            P->bdepth--;
            return w;
        }
        if (word_in(w, "elif else endif endfor endset endgeneration"))
            jfail(P->f, P->line, "unexpected {%% %s %%}%s", w, ends ? "" : " (no block is open)");
        body_push(P->a, b, parse_block(P, w));
    }
    if (ends) jfail(P->f, open_line, "{%% %s %%} is never closed (expected {%% %s %%})", opener, ends);
    return "";
}

int jinja_parse(const char *src, size_t len, const char *name, jinja_tmpl **out, ct_err *e) {
    *out = NULL;
    jinja_tmpl *t = ct_calloc(1, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name ? name : "chat template");
    failer f = {.e = e, .name = t->name};
    if (setjmp(f.jb)) {
        ar_free(&t->ar);
        free(t);
        return CT_ERR_FORMAT;
    }
    /* newlines normalised to \n, one trailing newline dropped (keep_trailing_newline=False) */
    char *s = ar_alloc(&t->ar, len + 1);
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n') i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n && s[n - 1] == '\n') n--;
    s[n] = 0;
    pieces ps = {0};
    scan(&f, &t->ar, s, n, &ps);
    parser P = {.f = &f, .a = &t->ar, .ps = &ps};
    parse_body(&P, &t->root, NULL, NULL, 0);
    t->has_gen = P.has_gen;
    *out = t;
    return 0;
}

void jinja_free(jinja_tmpl *t) {
    if (!t) return;
    ar_free(&t->ar);
    free(t);
}

/* ---------------------------------------------------------------- evaluation */

typedef struct scope {
    struct scope *up;
    jv *vars; /* a dict */
} scope;

typedef struct {
    failer *f;
    arena *a;
    scope *sc;
    jv *ctx; /* the caller's variables (dict) */
    char *out;
    size_t n, cap;
    jinja_spans *spans;
    int brk; /* 1 break, 2 continue */
} rctx;

static void out_put(rctx *R, const char *s, size_t n) {
    if (R->n + n + 1 > R->cap) {
        size_t cap = R->cap ? R->cap : 1024;
        while (cap < R->n + n + 1) cap *= 2;
        char *p = realloc(R->out, cap);
        if (!p) {
            fprintf(stderr, "ctitan: error: out of memory rendering a chat template\n");
            exit(1);
        }
        R->out = p;
        R->cap = cap;
    }
    memcpy(R->out + R->n, s, n);
    R->n += n;
}

static const char *kind_name(const jv *v) {
    switch (v->k) {
    case JV_UNDEF: return "undefined";
    case JV_NONE: return "none";
    case JV_BOOL: return "bool";
    case JV_INT: return "int";
    case JV_FLOAT: return "float";
    case JV_STR: return "string";
    case JV_LIST: return "list";
    case JV_DICT: return "dict";
    case JV_NS: return "namespace";
    case JV_FUNC: return "function";
    }
    return "?";
}

static jv *from_json(arena *a, const cJSON *j) {
    if (!j || cJSON_IsNull(j)) return &V_NONE;
    if (cJSON_IsBool(j)) return cJSON_IsTrue(j) ? &V_TRUE : &V_FALSE;
    if (cJSON_IsNumber(j)) {
        double d = j->valuedouble;
        if (d == (double)(long long)d && d > -9e15 && d < 9e15) return mk_int(a, (long long)d);
        jv *v = mk_val(a, JV_FLOAT);
        v->f = d;
        return v;
    }
    if (cJSON_IsString(j)) return mk_str(a, j->valuestring, strlen(j->valuestring));
    if (cJSON_IsArray(j)) {
        jv *l = mk_val(a, JV_LIST);
        for (const cJSON *c = j->child; c; c = c->next) list_push(a, l, from_json(a, c));
        return l;
    }
    jv *d = mk_val(a, JV_DICT);
    for (const cJSON *c = j->child; c; c = c->next) dict_set(a, d, mk_str(a, c->string, strlen(c->string)), from_json(a, c));
    return d;
}

static int truthy(const jv *v) {
    switch (v->k) {
    case JV_UNDEF:
    case JV_NONE: return 0;
    case JV_BOOL:
    case JV_INT: return v->i != 0;
    case JV_FLOAT: return v->f != 0;
    case JV_STR: return v->n != 0;
    case JV_LIST:
    case JV_DICT: return v->len != 0;
    default: return 1;
    }
}

/* str(v) as Python prints it; lists and dicts are outside the subset */
static jv *to_str(rctx *R, int line, jv *v) {
    char buf[64];
    switch (v->k) {
    case JV_STR: return v;
    case JV_UNDEF: return mk_str(R->a, "", 0);
    case JV_NONE: return mk_str(R->a, "None", 4);
    case JV_BOOL: return v->i ? mk_str(R->a, "True", 4) : mk_str(R->a, "False", 5);
    case JV_INT: snprintf(buf, sizeof buf, "%lld", v->i); return mk_str(R->a, buf, strlen(buf));
    default:
        jfail(R->f, line, "printing a %s as text is outside the supported Jinja subset (use |tojson)", kind_name(v));
    }
}

/* a == b; depth bounds the recursion into values a template can nest without
 * limit ({% set ns.x = [ns.x] %} in a loop) */
static int jv_eq(rctx *R, int line, const jv *a, const jv *b, int depth) {
    if (depth >= JINJA_MAX_DEPTH) jfail(R->f, line, "==: values nested deeper than %d levels", JINJA_MAX_DEPTH);
    int an = a->k == JV_INT || a->k == JV_BOOL, bn = b->k == JV_INT || b->k == JV_BOOL;
    if (an && bn) return a->i == b->i;
    if ((an || a->k == JV_FLOAT) && (bn || b->k == JV_FLOAT))
        return (a->k == JV_FLOAT ? a->f : (double)a->i) == (b->k == JV_FLOAT ? b->f : (double)b->i);
    if (a->k != b->k) return 0;
    switch (a->k) {
    case JV_UNDEF:
    case JV_NONE: return 1;
    case JV_STR: return a->n == b->n && !memcmp(a->s, b->s, a->n);
    case JV_LIST:
        if (a->len != b->len) return 0;
        for (int i = 0; i < a->len; i++)
            if (!jv_eq(R, line, a->items[i], b->items[i], depth + 1)) return 0;
        return 1;
    case JV_DICT:
        if (a->len != b->len) return 0;
        for (int i = 0; i < a->len; i++) {
            int j = dict_find(b, a->keys[i]->s, a->keys[i]->n);
            if (j < 0 || !jv_eq(R, line, a->items[i], b->items[j], depth + 1)) return 0;
        }
        return 1;
    default: return a == b;
    }
}

/* UTF-8 helpers: Python indexes strings by code point */
static size_t u8_len(const char *s, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n; i++) k += ((unsigned char)s[i] & 0xC0) != 0x80;
    return k;
}

/* byte offsets of every code point start (plus n at the end) */
static size_t *u8_offsets(rctx *R, const char *s, size_t n, size_t *count) {
    size_t c = u8_len(s, n);
    size_t *o = ar_alloc(R->a, (c + 1) * sizeof *o);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80) o[k++] = i;
    o[c] = n;
    *count = c;
    return o;
}

static uint32_t u8_dec(const char *s, size_t n, size_t *len) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t l = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &cp);
    if (l <= 0) {
        *len = 1;
        return (unsigned char)s[0];
    }
    *len = (size_t)l;
    return (uint32_t)cp;
}

/* str.isspace() */
static int py_space(uint32_t c) {
    return (c >= 9 && c <= 13) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

static int in_chars(uint32_t c, const jv *chars) {
    for (size_t i = 0; i < chars->n;) {
        size_t l;
        if (u8_dec(chars->s + i, chars->n - i, &l) == c) return 1;
        i += l;
    }
    return 0;
}

/* str.strip / lstrip / rstrip (chars: NULL = whitespace) */
static jv *py_strip(rctx *R, const jv *s, const jv *chars, int left, int right) {
    size_t b = 0, e = s->n;
    if (left)
        while (b < e) {
            size_t l;
            uint32_t c = u8_dec(s->s + b, e - b, &l);
            if (chars ? !in_chars(c, chars) : !py_space(c)) break;
            b += l;
        }
    if (right)
        while (e > b) {
            size_t st = e - 1;
            while (st > b && ((unsigned char)s->s[st] & 0xC0) == 0x80) st--;
            size_t l;
            uint32_t c = u8_dec(s->s + st, e - st, &l);
            if (chars ? !in_chars(c, chars) : !py_space(c)) break;
            e = st;
        }
    return mk_str(R->a, s->s + b, e - b);
}

static jv *str_case(rctx *R, const jv *s, int mode /* 0 lower 1 upper 2 capitalize */) {
    char *buf = ar_alloc(R->a, s->n * 2 + 8);
    size_t o = 0;
    int first = 1;
    for (size_t i = 0; i < s->n;) {
        size_t l;
        uint32_t c = u8_dec(s->s + i, s->n - i, &l);
        int up = mode == 1 || (mode == 2 && first);
        uint32_t d = (uint32_t)(up ? utf8proc_toupper((utf8proc_int32_t)c) : utf8proc_tolower((utf8proc_int32_t)c));
        if (o + 8 > s->n * 2 + 8) { /* cannot happen for BMP mappings; be safe */
            char *nb = ar_alloc(R->a, (o + 8) * 2);
            memcpy(nb, buf, o);
            buf = nb;
        }
        push_utf8(buf, &o, d);
        first = 0;
        i += l;
    }
    return mk_str(R->a, buf, o);
}

/* Python's ints do not overflow; an integer past 64 bits is an error here, never a wrapped value. */
__attribute__((noreturn)) static void int_overflow(rctx *R, int line) {
    jfail(R->f, line, "integer overflow: the result does not fit in 64 bits");
}

static jv *cat2(rctx *R, const jv *a, const jv *b) {
    char *buf = ar_alloc(R->a, a->n + b->n + 1);
    memcpy(buf, a->s, a->n);
    memcpy(buf + a->n, b->s, b->n);
    jv *v = mk_val(R->a, JV_STR);
    v->s = buf;
    v->n = a->n + b->n;
    return v;
}

/* ---------------------------------------------------------------- tojson */

typedef struct {
    char *b;
    size_t n, cap;
} sbuf;

static void sb_put(sbuf *s, const char *p, size_t n) {
    if (s->n + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 256;
        while (cap < s->n + n + 1) cap *= 2;
        s->b = realloc(s->b, cap);
        if (!s->b) {
            fprintf(stderr, "ctitan: error: out of memory in tojson\n");
            exit(1);
        }
        s->cap = cap;
    }
    memcpy(s->b + s->n, p, n);
    s->n += n;
}
static void sb_str(sbuf *s, const char *p) { sb_put(s, p, strlen(p)); }

static void json_string(sbuf *s, const char *p, size_t n) {
    sb_put(s, "\"", 1);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)p[i];
        char esc[8];
        switch (c) {
        case '"': sb_put(s, "\\\"", 2); break;
        case '\\': sb_put(s, "\\\\", 2); break;
        case '\n': sb_put(s, "\\n", 2); break;
        case '\r': sb_put(s, "\\r", 2); break;
        case '\t': sb_put(s, "\\t", 2); break;
        case '\b': sb_put(s, "\\b", 2); break;
        case '\f': sb_put(s, "\\f", 2); break;
        default:
            if (c < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
                sb_put(s, esc, 6);
            } else {
                sb_put(s, (const char *)&c, 1);
            }
        }
    }
    sb_put(s, "\"", 1);
}

static void json_dump(rctx *R, int line, sbuf *s, const jv *v, int indent, int depth) {
    char buf[64];
    if (depth >= JINJA_MAX_DEPTH) {
        free(s->b);
        jfail(R->f, line, "tojson: values nested deeper than %d levels", JINJA_MAX_DEPTH);
    }
    switch (v->k) {
    case JV_NONE: sb_str(s, "null"); return;
    case JV_BOOL: sb_str(s, v->i ? "true" : "false"); return;
    case JV_INT: snprintf(buf, sizeof buf, "%lld", v->i); sb_str(s, buf); return;
    case JV_STR: json_string(s, v->s, v->n); return;
    case JV_FLOAT: {
        /* Python's repr: the shortest string that round-trips */
        for (int p = 1; p <= 17; p++) {
            snprintf(buf, sizeof buf, "%.*g", p, v->f);
            if (strtod(buf, NULL) == v->f) break;
        }
        if (!strpbrk(buf, ".eEn")) strcat(buf, ".0");
        sb_str(s, buf);
        return;
    }
    case JV_LIST:
    case JV_DICT:
    case JV_NS: {
        int is_list = v->k == JV_LIST;
        if (v->len == 0) {
            sb_str(s, is_list ? "[]" : "{}");
            return;
        }
        sb_str(s, is_list ? "[" : "{");
        for (int i = 0; i < v->len; i++) {
            if (i) sb_str(s, indent >= 0 ? "," : ", ");
            if (indent >= 0) {
                sb_str(s, "\n");
                for (int k = 0; k < indent * (depth + 1); k++) sb_str(s, " ");
            }
            if (!is_list) {
                json_string(s, v->keys[i]->s, v->keys[i]->n);
                sb_str(s, ": ");
            }
            json_dump(R, line, s, v->items[i], indent, depth + 1);
        }
        if (indent >= 0) {
            sb_str(s, "\n");
            for (int k = 0; k < indent * depth; k++) sb_str(s, " ");
        }
        sb_str(s, is_list ? "]" : "}");
        return;
    }
    default:
        free(s->b);
        jfail(R->f, line, "tojson: a %s is not JSON serializable", kind_name(v));
    }
}

/* ---------------------------------------------------------------- names */

static jv *lookup(rctx *R, const char *name) {
    size_t n = strlen(name);
    for (scope *s = R->sc; s; s = s->up) {
        int i = dict_find(s->vars, name, n);
        if (i >= 0) return s->vars->items[i];
    }
    int i = dict_find(R->ctx, name, n);
    if (i >= 0) return R->ctx->items[i];
    static const char *fns[] = {"raise_exception", "namespace", "range", "strftime_now", "dict"};
    for (int k = 0; k < 5; k++)
        if (!strcmp(name, fns[k])) {
            jv *v = mk_val(R->a, JV_FUNC);
            v->i = k;
            v->s = fns[k];
            return v;
        }
    jv *u = mk_val(R->a, JV_UNDEF);
    u->undef_name = name;
    return u;
}

static void assign(rctx *R, const char *name, jv *v) {
    dict_set(R->a, R->sc->vars, mk_str(R->a, name, strlen(name)), v);
}

static jv *eval(rctx *R, expr *e);

static void need_str(rctx *R, int line, const jv *v, const char *what) {
    if (v->k != JV_STR) jfail(R->f, line, "%s: expected a string, got %s", what, kind_name(v));
}

static long long need_int(rctx *R, int line, const jv *v, const char *what) {
    if (v->k != JV_INT && v->k != JV_BOOL) jfail(R->f, line, "%s: expected an integer, got %s", what, kind_name(v));
    return v->i;
}

static void undefined_use(rctx *R, int line, const jv *v, const char *what) {
    if (v->k == JV_UNDEF)
        jfail(R->f, line, "'%s' is undefined (%s)", v->undef_name ? v->undef_name : "value", what);
}

/* obj.name / obj[name] for a string key */
static jv *get_key(rctx *R, int line, jv *obj, const char *k, size_t n) {
    undefined_use(R, line, obj, "attribute access");
    if (obj->k == JV_DICT || obj->k == JV_NS) {
        int i = dict_find(obj, k, n);
        if (i >= 0) return obj->items[i];
    }
    jv *u = mk_val(R->a, JV_UNDEF);
    u->undef_name = ar_strndup(R->a, k, n);
    return u;
}

static jv *get_index(rctx *R, int line, jv *obj, jv *idx) {
    undefined_use(R, line, obj, "subscript");
    if (idx->k == JV_STR) return get_key(R, line, obj, idx->s, idx->n);
    if (idx->k == JV_INT || idx->k == JV_BOOL) {
        long long i = idx->i;
        if (obj->k == JV_LIST) {
            if (i < 0) i += obj->len;
            if (i >= 0 && i < obj->len) return obj->items[i];
        } else if (obj->k == JV_STR) {
            size_t c, *o = u8_offsets(R, obj->s, obj->n, &c);
            if (i < 0) i += (long long)c;
            if (i >= 0 && i < (long long)c) return mk_str(R->a, obj->s + o[i], o[i + 1] - o[i]);
        }
        return &V_UNDEF;
    }
    return &V_UNDEF;
}

/* Python slice indices */
static void slice_idx(long long len, long long step, jv *a, jv *b, long long *start, long long *stop) {
    if (step > 0) {
        *start = 0;
        *stop = len;
    } else {
        *start = len - 1;
        *stop = -1;
    }
    if (a && a->k != JV_NONE) {
        long long v = a->i;
        if (v < 0) v += len;
        if (step > 0) *start = v < 0 ? 0 : v > len ? len : v;
        else *start = v < 0 ? -1 : v >= len ? len - 1 : v;
    }
    if (b && b->k != JV_NONE) {
        long long v = b->i;
        if (v < 0) v += len;
        if (step > 0) *stop = v < 0 ? 0 : v > len ? len : v;
        else *stop = v < -1 ? -1 : v >= len ? len - 1 : v;
    }
}

static jv *do_slice(rctx *R, expr *e) {
    jv *obj = eval(R, e->a);
    undefined_use(R, e->line, obj, "slice");
    jv *p[3];
    for (int i = 0; i < 3; i++) {
        p[i] = e->args[i] ? eval(R, e->args[i]) : NULL;
        if (p[i] && p[i]->k != JV_NONE) need_int(R, e->line, p[i], "slice index");
    }
    long long step = p[2] && p[2]->k != JV_NONE ? p[2]->i : 1;
    if (step == 0) jfail(R->f, e->line, "slice step cannot be zero");
    if (obj->k == JV_LIST) {
        long long s, t;
        slice_idx(obj->len, step, p[0], p[1], &s, &t);
        jv *l = mk_val(R->a, JV_LIST);
        for (long long i = s; step > 0 ? i < t : i > t; i += step) list_push(R->a, l, obj->items[i]);
        return l;
    }
    if (obj->k == JV_STR) {
        size_t c, *o = u8_offsets(R, obj->s, obj->n, &c);
        long long s, t;
        slice_idx((long long)c, step, p[0], p[1], &s, &t);
        char *buf = ar_alloc(R->a, obj->n + 1);
        size_t bn = 0;
        for (long long i = s; step > 0 ? i < t : i > t; i += step) {
            memcpy(buf + bn, obj->s + o[i], o[i + 1] - o[i]);
            bn += o[i + 1] - o[i];
        }
        jv *v = mk_val(R->a, JV_STR);
        v->s = buf;
        v->n = bn;
        return v;
    }
    jfail(R->f, e->line, "cannot slice a %s", kind_name(obj));
}

static int contains(rctx *R, int line, jv *hay, jv *needle) {
    undefined_use(R, line, hay, "'in'");
    if (hay->k == JV_STR) {
        need_str(R, line, needle, "'in <string>'");
        if (needle->n == 0) return 1;
        return memmem(hay->s, hay->n, needle->s, needle->n) != NULL;
    }
    if (hay->k == JV_LIST) {
        for (int i = 0; i < hay->len; i++)
            if (jv_eq(R, line, hay->items[i], needle, 0)) return 1;
        return 0;
    }
    if (hay->k == JV_DICT || hay->k == JV_NS) return needle->k == JV_STR && dict_find(hay, needle->s, needle->n) >= 0;
    jfail(R->f, line, "'in' a %s", kind_name(hay));
}

static int cmp_order(rctx *R, int line, jv *a, jv *b) {
    int an = a->k == JV_INT || a->k == JV_BOOL, bn = b->k == JV_INT || b->k == JV_BOOL;
    if (an && bn) return a->i < b->i ? -1 : a->i > b->i;
    if ((an || a->k == JV_FLOAT) && (bn || b->k == JV_FLOAT)) {
        double x = a->k == JV_FLOAT ? a->f : (double)a->i, y = b->k == JV_FLOAT ? b->f : (double)b->i;
        return x < y ? -1 : x > y;
    }
    if (a->k == JV_STR && b->k == JV_STR) {
        size_t n = a->n < b->n ? a->n : b->n;
        int c = memcmp(a->s, b->s, n);
        if (c) return c < 0 ? -1 : 1;
        return a->n < b->n ? -1 : a->n > b->n;
    }
    jfail(R->f, line, "cannot order a %s and a %s", kind_name(a), kind_name(b));
}

static long long floordiv(long long a, long long b) {
    long long q = a / b;
    if ((a % b != 0) && ((a < 0) != (b < 0))) q--;
    return q;
}

static jv *binop(rctx *R, expr *e) {
    jv *a = eval(R, e->a), *b = eval(R, e->b);
    int line = e->line;
    switch (e->op) {
    case B_EQ: return jv_eq(R, e->line, a, b, 0) ? &V_TRUE : &V_FALSE;
    case B_NE: return jv_eq(R, e->line, a, b, 0) ? &V_FALSE : &V_TRUE;
    case B_LT: return cmp_order(R, line, a, b) < 0 ? &V_TRUE : &V_FALSE;
    case B_GT: return cmp_order(R, line, a, b) > 0 ? &V_TRUE : &V_FALSE;
    case B_LE: return cmp_order(R, line, a, b) <= 0 ? &V_TRUE : &V_FALSE;
    case B_GE: return cmp_order(R, line, a, b) >= 0 ? &V_TRUE : &V_FALSE;
    case B_IN: return contains(R, line, b, a) ? &V_TRUE : &V_FALSE;
    case B_NOTIN: return contains(R, line, b, a) ? &V_FALSE : &V_TRUE;
    case B_CAT: return cat2(R, to_str(R, line, a), to_str(R, line, b));
    default: break;
    }
    undefined_use(R, line, a, "arithmetic");
    undefined_use(R, line, b, "arithmetic");
    int ai = a->k == JV_INT || a->k == JV_BOOL, bi = b->k == JV_INT || b->k == JV_BOOL;
    long long r;
    if (e->op == B_ADD) {
        if (ai && bi) {
            if (__builtin_add_overflow(a->i, b->i, &r)) int_overflow(R, line);
            return mk_int(R->a, r);
        }
        if (a->k == JV_STR && b->k == JV_STR) return cat2(R, a, b);
        if (a->k == JV_LIST && b->k == JV_LIST) {
            jv *l = mk_val(R->a, JV_LIST);
            for (int i = 0; i < a->len; i++) list_push(R->a, l, a->items[i]);
            for (int i = 0; i < b->len; i++) list_push(R->a, l, b->items[i]);
            return l;
        }
        jfail(R->f, line, "cannot add a %s and a %s", kind_name(a), kind_name(b));
    }
    if (ai && bi) {
        switch (e->op) {
        case B_SUB:
            if (__builtin_sub_overflow(a->i, b->i, &r)) int_overflow(R, line);
            return mk_int(R->a, r);
        case B_MUL:
            if (__builtin_mul_overflow(a->i, b->i, &r)) int_overflow(R, line);
            return mk_int(R->a, r);
        case B_FDIV:
        case B_MOD:
            if (b->i == 0) jfail(R->f, line, "integer division or modulo by zero");
            if (b->i == -1) { /* LLONG_MIN // -1 does not fit; x % -1 is 0 */
                if (e->op == B_MOD) return mk_int(R->a, 0);
                if (__builtin_sub_overflow(0, a->i, &r)) int_overflow(R, line);
                return mk_int(R->a, r);
            }
            if (e->op == B_FDIV) return mk_int(R->a, floordiv(a->i, b->i));
            return mk_int(R->a, a->i - floordiv(a->i, b->i) * b->i);
        case B_POW:
            if (b->i >= 0) { /* by squaring: a loop of b->i steps would not end for 1 ** 10**18 */
                long long base = a->i, k = b->i;
                r = 1;
                while (k) {
                    if ((k & 1) && __builtin_mul_overflow(r, base, &r)) int_overflow(R, line);
                    k >>= 1;
                    if (k && __builtin_mul_overflow(base, base, &base)) int_overflow(R, line);
                }
                return mk_int(R->a, r);
            }
            break;
        default: break;
        }
    }
    if (e->op == B_MUL && ((a->k == JV_STR && bi) || (ai && b->k == JV_STR))) {
        const jv *s = a->k == JV_STR ? a : b;
        long long k = a->k == JV_STR ? b->i : a->i;
        if (k <= 0 || s->n == 0) return mk_str(R->a, "", 0);
        /* built at once: k concatenations would keep k growing copies in the arena */
        if ((unsigned long long)k > JINJA_MAX_STR / s->n)
            jfail(R->f, line, "string repetition: %lld copies of %zu bytes is beyond %d MiB", k, s->n,
                  JINJA_MAX_STR >> 20);
        size_t total = (size_t)k * s->n;
        char *buf = ar_alloc(R->a, total + 1);
        for (long long i = 0; i < k; i++) memcpy(buf + (size_t)i * s->n, s->s, s->n);
        buf[total] = 0;
        jv *out = mk_val(R->a, JV_STR);
        out->s = buf;
        out->n = total;
        return out;
    }
    jfail(R->f, line, "this arithmetic on a %s and a %s is outside the supported Jinja subset", kind_name(a),
          kind_name(b));
}

/* positional or keyword argument i / name of a call */
static jv *arg(rctx *R, expr *e, int pos, const char *kw, jv **vals) {
    (void)R;
    int npos = 0;
    for (int i = 0; i < e->nargs; i++) {
        if (!e->kwnames[i]) {
            if (npos++ == pos) return vals[i];
        } else if (kw && !strcmp(e->kwnames[i], kw)) {
            return vals[i];
        }
    }
    return NULL;
}

static jv **eval_args(rctx *R, expr *e) {
    jv **v = ar_alloc(R->a, (size_t)(e->nargs + 1) * sizeof *v);
    for (int i = 0; i < e->nargs; i++) v[i] = eval(R, e->args[i]);
    return v;
}

static void check_args(rctx *R, expr *e, const char *what, int max_pos, const char *kws) {
    int npos = 0;
    for (int i = 0; i < e->nargs; i++) {
        if (!e->kwnames[i]) npos++;
        else if (!kws || !word_in(e->kwnames[i], kws))
            jfail(R->f, e->line, "%s: the argument '%s' is outside the supported Jinja subset", what, e->kwnames[i]);
    }
    if (npos > max_pos) jfail(R->f, e->line, "%s: too many arguments (%d)", what, npos);
}

static jv *py_split(rctx *R, int line, const jv *s, const jv *sep, long long maxsplit) {
    jv *l = mk_val(R->a, JV_LIST);
    if (!sep || sep->k == JV_NONE) {
        size_t i = 0;
        for (;;) {
            while (i < s->n) {
                size_t cl;
                if (!py_space(u8_dec(s->s + i, s->n - i, &cl))) break;
                i += cl;
            }
            if (i >= s->n) break;
            if (maxsplit >= 0 && l->len == maxsplit) {
                size_t e = s->n;
                list_push(R->a, l, mk_str(R->a, s->s + i, e - i));
                /* Python strips trailing whitespace of the rest only when splitting it */
                jv *last = l->items[l->len - 1];
                l->items[l->len - 1] = py_strip(R, last, NULL, 0, 1);
                break;
            }
            size_t j = i;
            while (j < s->n) {
                size_t cl;
                if (py_space(u8_dec(s->s + j, s->n - j, &cl))) break;
                j += cl;
            }
            list_push(R->a, l, mk_str(R->a, s->s + i, j - i));
            i = j;
        }
        return l;
    }
    need_str(R, line, sep, "split");
    if (sep->n == 0) jfail(R->f, line, "split: empty separator");
    size_t i = 0;
    for (;;) {
        const char *p = (maxsplit < 0 || l->len < maxsplit) ? memmem(s->s + i, s->n - i, sep->s, sep->n) : NULL;
        if (!p) {
            list_push(R->a, l, mk_str(R->a, s->s + i, s->n - i));
            return l;
        }
        list_push(R->a, l, mk_str(R->a, s->s + i, (size_t)(p - (s->s + i))));
        i = (size_t)(p - s->s) + sep->n;
    }
}

static jv *str_replace(rctx *R, const jv *s, const jv *old, const jv *nw, long long count) {
    jv *r = mk_str(R->a, "", 0);
    size_t i = 0;
    long long done = 0;
    if (old->n == 0) return (jv *)s; /* Python inserts between characters; templates do not do this */
    for (;;) {
        const char *p = (count < 0 || done < count) ? memmem(s->s + i, s->n - i, old->s, old->n) : NULL;
        if (!p) return cat2(R, r, mk_str(R->a, s->s + i, s->n - i));
        r = cat2(R, r, mk_str(R->a, s->s + i, (size_t)(p - (s->s + i))));
        r = cat2(R, r, nw);
        i = (size_t)(p - s->s) + old->n;
        done++;
    }
}

static jv *items_of(rctx *R, jv *d) {
    jv *l = mk_val(R->a, JV_LIST);
    for (int i = 0; i < d->len; i++) {
        jv *pair = mk_val(R->a, JV_LIST);
        list_push(R->a, pair, d->keys[i]);
        list_push(R->a, pair, d->items[i]);
        list_push(R->a, l, pair);
    }
    return l;
}

static int starts_or_ends(rctx *R, int line, const jv *s, jv *x, int end, const char *what) {
    undefined_use(R, line, x, what);
    if (x->k == JV_LIST) {
        for (int i = 0; i < x->len; i++)
            if (starts_or_ends(R, line, s, x->items[i], end, what)) return 1;
        return 0;
    }
    need_str(R, line, x, what);
    if (x->n > s->n) return 0;
    return !memcmp(end ? s->s + s->n - x->n : s->s, x->s, x->n);
}

static jv *call_method(rctx *R, expr *e, jv *obj, const char *m) {
    int line = e->line;
    jv **v = eval_args(R, e);
    jv *a0 = arg(R, e, 0, NULL, v), *a1 = arg(R, e, 1, NULL, v);
    if (obj->k == JV_STR) {
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
            check_args(R, e, m, 1, NULL);
            if (!a0) jfail(R->f, line, "%s: needs an argument", m);
            return starts_or_ends(R, line, obj, a0, m[0] == 'e', m) ? &V_TRUE : &V_FALSE;
        }
        if (!strcmp(m, "strip") || !strcmp(m, "lstrip") || !strcmp(m, "rstrip")) {
            check_args(R, e, m, 1, NULL);
            if (a0 && a0->k != JV_NONE) need_str(R, line, a0, m);
            return py_strip(R, obj, a0 && a0->k != JV_NONE ? a0 : NULL, m[0] != 'r', m[0] != 'l');
        }
        if (!strcmp(m, "split")) {
            check_args(R, e, m, 2, "sep maxsplit");
            jv *sep = arg(R, e, 0, "sep", v), *mx = arg(R, e, 1, "maxsplit", v);
            return py_split(R, line, obj, sep, mx ? need_int(R, line, mx, "split maxsplit") : -1);
        }
        if (!strcmp(m, "upper") || !strcmp(m, "lower") || !strcmp(m, "capitalize")) {
            check_args(R, e, m, 0, NULL);
            return str_case(R, obj, m[0] == 'l' ? 0 : m[0] == 'u' ? 1 : 2);
        }
        if (!strcmp(m, "replace")) {
            check_args(R, e, m, 3, NULL);
            jv *a2 = arg(R, e, 2, NULL, v);
            if (!a0 || !a1) jfail(R->f, line, "replace: needs two arguments");
            need_str(R, line, a0, m);
            need_str(R, line, a1, m);
            return str_replace(R, obj, a0, a1, a2 ? need_int(R, line, a2, m) : -1);
        }
        if (!strcmp(m, "join")) {
            check_args(R, e, m, 1, NULL);
            if (!a0 || a0->k != JV_LIST) jfail(R->f, line, "join: expected a list");
            jv *r = mk_str(R->a, "", 0);
            for (int i = 0; i < a0->len; i++) {
                if (i) r = cat2(R, r, obj);
                need_str(R, line, a0->items[i], "join");
                r = cat2(R, r, a0->items[i]);
            }
            return r;
        }
    }
    if (obj->k == JV_DICT) {
        if (!strcmp(m, "items")) {
            check_args(R, e, m, 0, NULL);
            return items_of(R, obj);
        }
        if (!strcmp(m, "keys") || !strcmp(m, "values")) {
            check_args(R, e, m, 0, NULL);
            jv *l = mk_val(R->a, JV_LIST);
            for (int i = 0; i < obj->len; i++) list_push(R->a, l, m[0] == 'k' ? obj->keys[i] : obj->items[i]);
            return l;
        }
        if (!strcmp(m, "get")) {
            check_args(R, e, m, 2, NULL);
            if (!a0) jfail(R->f, line, "get: needs a key");
            if (a0->k == JV_STR) {
                int i = dict_find(obj, a0->s, a0->n);
                if (i >= 0) return obj->items[i];
            }
            return a1 ? a1 : &V_NONE;
        }
    }
    undefined_use(R, line, obj, m);
    jfail(R->f, line, "the method %s.%s() is outside the supported Jinja subset", kind_name(obj), m);
}

static jv *call_func(rctx *R, expr *e, jv *fn) {
    int line = e->line;
    jv **v = eval_args(R, e);
    switch (fn->i) {
    case FN_RAISE: {
        jv *m = arg(R, e, 0, NULL, v);
        jv *s = m ? to_str(R, line, m) : mk_str(R->a, "", 0);
        jfail(R->f, line, "raise_exception: %s", s->s);
    }
    case FN_NAMESPACE:
    case FN_DICT: {
        jv *d = mk_val(R->a, fn->i == FN_NAMESPACE ? JV_NS : JV_DICT);
        for (int i = 0; i < e->nargs; i++) {
            if (!e->kwnames[i]) {
                if (v[i]->k != JV_DICT) jfail(R->f, line, "%s(): positional arguments must be dicts", fn->s);
                for (int k = 0; k < v[i]->len; k++) dict_set(R->a, d, v[i]->keys[k], v[i]->items[k]);
            } else {
                dict_set(R->a, d, mk_str(R->a, e->kwnames[i], strlen(e->kwnames[i])), v[i]);
            }
        }
        return d;
    }
    case FN_RANGE: {
        check_args(R, e, "range", 3, NULL);
        long long a = 0, b, st = 1;
        if (e->nargs == 1) b = need_int(R, line, v[0], "range");
        else if (e->nargs >= 2) {
            a = need_int(R, line, v[0], "range");
            b = need_int(R, line, v[1], "range");
            if (e->nargs == 3) st = need_int(R, line, v[2], "range");
        } else jfail(R->f, line, "range: needs an argument");
        if (st == 0) jfail(R->f, line, "range: step must not be zero");
        jv *l = mk_val(R->a, JV_LIST);
        for (long long i = a; st > 0 ? i < b : i > b;) {
            if (l->len > 10000000) jfail(R->f, line, "range: too long");
            list_push(R->a, l, mk_int(R->a, i));
            if (__builtin_add_overflow(i, st, &i)) break; /* past LLONG_MAX/MIN is past b too */
        }
        return l;
    }
    case FN_STRFTIME: {
        check_args(R, e, "strftime_now", 1, NULL);
        jv *fmt = arg(R, e, 0, NULL, v);
        if (!fmt) jfail(R->f, line, "strftime_now: needs a format");
        need_str(R, line, fmt, "strftime_now");
        time_t now = time(NULL);
        struct tm tmv;
        localtime_r(&now, &tmv);
        char buf[512];
        size_t n = strftime(buf, sizeof buf, fmt->s, &tmv);
        return mk_str(R->a, buf, n);
    }
    }
    jfail(R->f, line, "unknown function");
}

static jv *call(rctx *R, expr *e) {
    if (e->a->k == E_ATTR) {
        jv *obj = eval(R, e->a->a);
        if (obj->k == JV_STR || obj->k == JV_DICT || obj->k == JV_LIST || obj->k == JV_UNDEF || obj->k == JV_NONE ||
            obj->k == JV_INT || obj->k == JV_BOOL) {
            if (obj->k == JV_DICT && dict_find(obj, e->a->name, strlen(e->a->name)) >= 0 &&
                !word_in(e->a->name, "items keys values get"))
                jfail(R->f, e->line, "calling the value of '%s' is outside the supported Jinja subset", e->a->name);
            return call_method(R, e, obj, e->a->name);
        }
    }
    jv *fn = eval(R, e->a);
    if (fn->k != JV_FUNC) {
        if (fn->k == JV_UNDEF)
            jfail(R->f, e->line, "'%s' is undefined (called as a function)", fn->undef_name ? fn->undef_name : "value");
        jfail(R->f, e->line, "a %s is not callable", kind_name(fn));
    }
    return call_func(R, e, fn);
}

static long long length_of(rctx *R, int line, jv *v) {
    switch (v->k) {
    case JV_UNDEF: return 0;
    case JV_STR: return (long long)u8_len(v->s, v->n);
    case JV_LIST:
    case JV_DICT: return v->len;
    default: jfail(R->f, line, "length of a %s", kind_name(v));
    }
}

static int apply_test(rctx *R, int line, const char *t, jv *x, jv **v, int nargs);
static jv *iter_list(rctx *R, int line, jv *x);

/* The byte length of the whitespace code point at s as int() and float() strip it (str.isspace()
 * less U+001C-U+001F), 0 when none. */
static size_t int_space(const char *s, size_t n) {
    if (!n) return 0;
    size_t l;
    uint32_t c = u8_dec(s, n, &l);
    return py_space(c) && !(c >= 0x1c && c <= 0x1f) ? l : 0;
}

/* Digits with single underscores between them (Python's digitpart), copied without the
 * underscores into *o; the count of bytes read, 0 when none match. */
static size_t py_digits(const char *s, size_t n, char **o) {
    size_t i = 0;
    while (i < n && s[i] >= '0' && s[i] <= '9') {
        *(*o)++ = s[i++];
        if (i + 1 < n && s[i] == '_' && s[i + 1] >= '0' && s[i + 1] <= '9') i++;
    }
    return i;
}

/* jinja2's |int on a string: int(s, 10), else int(float(s)), else 0 (nan, inf and
 * overflowing floats included, as OverflowError is caught too). Digits outside ASCII
 * (which Python also reads) are not. */
static long long py_str_int(rctx *R, int line, const char *s) {
    size_t n = strlen(s), k;
    while ((k = int_space(s, n))) s += k, n -= k;
    while (n > 0) { /* trailing space: the last code point */
        size_t b = n - 1;
        while (b > 0 && ((uint8_t)s[b] & 0xC0) == 0x80) b--;
        if (int_space(s + b, n - b) != n - b) break;
        n = b;
    }
    char *buf = ar_alloc(R->a, n + 2), *o = buf;
    size_t i = 0;
    if (i < n && (s[i] == '+' || s[i] == '-')) *o++ = s[i++];
    size_t d = py_digits(s + i, n - i, &o);
    i += d;
    if (d && i == n) { /* an integer */
        *o = 0;
        errno = 0;
        long long v = strtoll(buf, NULL, 10);
        if (errno == ERANGE) jfail(R->f, line, "'%s' | int: the value is outside the 64-bit integer range", s);
        return v;
    }
    /* a float: digitpart ['.' [digitpart]] | '.' digitpart, then [e [sign] digitpart] */
    size_t f = 0;
    if (i < n && s[i] == '.') {
        *o++ = s[i++];
        f = py_digits(s + i, n - i, &o);
        i += f;
    }
    if (!d && !f) return 0; /* inf, infinity, nan: float() reads them, int() of that fails (caught) */
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        *o++ = s[i++];
        if (i < n && (s[i] == '+' || s[i] == '-')) *o++ = s[i++];
        size_t x = py_digits(s + i, n - i, &o);
        if (!x) return 0;
        i += x;
    }
    if (i != n) return 0;
    *o = 0;
    double v = strtod(buf, NULL);
    if (isinf(v)) return 0; /* '1e400': float() gives inf, int() an OverflowError, caught */
    if (!(v > -9223372036854775808.0 && v < 9223372036854775808.0))
        jfail(R->f, line, "'%s' | int: the value is outside the 64-bit integer range", s);
    return (long long)v;
}

static jv *filter(rctx *R, expr *e) {
    jv *x = eval(R, e->a);
    jv **v = eval_args(R, e);
    const char *f = e->name;
    int line = e->line;
    jv *a0 = arg(R, e, 0, NULL, v);
    if (!strcmp(f, "length") || !strcmp(f, "count")) {
        check_args(R, e, f, 0, NULL);
        return mk_int(R->a, length_of(R, line, x));
    }
    if (!strcmp(f, "trim")) {
        check_args(R, e, f, 1, "chars");
        jv *chars = arg(R, e, 0, "chars", v);
        jv *s = to_str(R, line, x);
        if (chars && chars->k != JV_NONE) need_str(R, line, chars, "trim");
        return py_strip(R, s, chars && chars->k != JV_NONE ? chars : NULL, 1, 1);
    }
    if (!strcmp(f, "upper") || !strcmp(f, "lower") || !strcmp(f, "capitalize")) {
        check_args(R, e, f, 0, NULL);
        return str_case(R, to_str(R, line, x), f[0] == 'l' ? 0 : f[0] == 'u' ? 1 : 2);
    }
    if (!strcmp(f, "string")) {
        check_args(R, e, f, 0, NULL);
        return to_str(R, line, x);
    }
    if (!strcmp(f, "safe")) {
        check_args(R, e, f, 0, NULL);
        return x;
    }
    if (!strcmp(f, "tojson")) {
        check_args(R, e, f, 1, "indent ensure_ascii sort_keys");
        jv *ind = arg(R, e, 0, "indent", v), *ea = arg(R, e, -1, "ensure_ascii", v), *sk = arg(R, e, -1, "sort_keys", v);
        if ((ea && truthy(ea)) || (sk && truthy(sk)))
            jfail(R->f, line, "tojson: ensure_ascii / sort_keys are outside the supported Jinja subset");
        int indent = ind && ind->k != JV_NONE ? (int)need_int(R, line, ind, "tojson indent") : -1;
        sbuf s = {0};
        json_dump(R, line, &s, x, indent, 0);
        jv *r = mk_str(R->a, s.b ? s.b : "", s.n);
        free(s.b);
        return r;
    }
    if (!strcmp(f, "first") || !strcmp(f, "last")) {
        check_args(R, e, f, 0, NULL);
        if (x->k == JV_LIST) return x->len ? x->items[f[0] == 'f' ? 0 : x->len - 1] : &V_UNDEF;
        if (x->k == JV_STR) {
            jv idx = {.k = JV_INT, .i = f[0] == 'f' ? 0 : -1};
            return get_index(R, line, x, &idx);
        }
        jfail(R->f, line, "%s of a %s", f, kind_name(x));
    }
    if (!strcmp(f, "join")) {
        check_args(R, e, f, 1, "d");
        jv *sep = a0 ? a0 : arg(R, e, -1, "d", v);
        jv *r = mk_str(R->a, "", 0);
        if (sep) need_str(R, line, sep, "join");
        if (x->k != JV_LIST) jfail(R->f, line, "join of a %s", kind_name(x));
        for (int i = 0; i < x->len; i++) {
            if (i && sep) r = cat2(R, r, sep);
            r = cat2(R, r, to_str(R, line, x->items[i]));
        }
        return r;
    }
    if (!strcmp(f, "default") || !strcmp(f, "d")) {
        check_args(R, e, f, 2, "default_value boolean");
        jv *dv = arg(R, e, 0, "default_value", v), *bo = arg(R, e, 1, "boolean", v);
        if (x->k == JV_UNDEF || (bo && truthy(bo) && !truthy(x))) return dv ? dv : mk_str(R->a, "", 0);
        return x;
    }
    if (!strcmp(f, "items")) {
        check_args(R, e, f, 0, NULL);
        if (x->k == JV_UNDEF) return mk_val(R->a, JV_LIST);
        if (x->k != JV_DICT) jfail(R->f, line, "items of a %s", kind_name(x));
        return items_of(R, x);
    }
    if (!strcmp(f, "list") || !strcmp(f, "reverse")) {
        check_args(R, e, f, 0, NULL);
        jv *l = mk_val(R->a, JV_LIST);
        if (x->k == JV_LIST) for (int i = 0; i < x->len; i++) list_push(R->a, l, x->items[i]);
        else if (x->k == JV_DICT) for (int i = 0; i < x->len; i++) list_push(R->a, l, x->keys[i]);
        else if (x->k == JV_STR) {
            size_t c, *o = u8_offsets(R, x->s, x->n, &c);
            for (size_t i = 0; i < c; i++) list_push(R->a, l, mk_str(R->a, x->s + o[i], o[i + 1] - o[i]));
        } else jfail(R->f, line, "%s of a %s", f, kind_name(x));
        if (f[0] == 'r') {
            for (int i = 0, j = l->len - 1; i < j; i++, j--) {
                jv *t = l->items[i];
                l->items[i] = l->items[j];
                l->items[j] = t;
            }
            if (x->k == JV_STR) {
                jv *r = mk_str(R->a, "", 0);
                for (int i = 0; i < l->len; i++) r = cat2(R, r, l->items[i]);
                return r;
            }
        }
        return l;
    }
    if (!strcmp(f, "select") || !strcmp(f, "reject") || !strcmp(f, "selectattr") || !strcmp(f, "rejectattr")) {
        /* select(test, args...), selectattr(attr, test, args...); no test: truthiness */
        int by_attr = strstr(f, "attr") != NULL, rej = f[0] == 'r';
        check_args(R, e, f, 8, NULL);
        jv *attr = NULL;
        int k = 0;
        if (by_attr) {
            attr = arg(R, e, k++, NULL, v);
            if (!attr) jfail(R->f, line, "%s: needs an attribute name", f);
            need_str(R, line, attr, f);
        }
        jv *tname = arg(R, e, k++, NULL, v);
        if (tname) need_str(R, line, tname, f);
        int nrest = e->nargs > k ? e->nargs - k : 0;
        jv *lst = iter_list(R, line, x), *out = mk_val(R->a, JV_LIST);
        for (int i = 0; i < lst->len; i++) {
            jv *val = by_attr ? get_key(R, line, lst->items[i], attr->s, attr->n) : lst->items[i];
            int ok = tname ? apply_test(R, line, tname->s, val, v + k, nrest) : truthy(val);
            if (ok != rej) list_push(R->a, out, lst->items[i]);
        }
        return out;
    }
    if (!strcmp(f, "int")) {
        check_args(R, e, f, 0, NULL);
        if (x->k == JV_INT || x->k == JV_BOOL) return mk_int(R->a, x->i);
        if (x->k == JV_FLOAT) {
            if (isnan(x->f)) return mk_int(R->a, 0);
            if (!(x->f > -9223372036854775808.0 && x->f < 9223372036854775808.0))
                jfail(R->f, line, "%g | int: the value is outside the 64-bit integer range", x->f);
            return mk_int(R->a, (long long)x->f);
        }
        if (x->k == JV_STR) return mk_int(R->a, py_str_int(R, line, x->s));
        return mk_int(R->a, 0);
    }
    jfail(R->f, line, "the filter '%s' is outside the supported Jinja subset", f);
}

static int apply_test(rctx *R, int line, const char *t, jv *x, jv **v, int nargs) {
    if (!strcmp(t, "defined")) return x->k != JV_UNDEF;
    if (!strcmp(t, "undefined")) return x->k == JV_UNDEF;
    if (!strcmp(t, "none")) return x->k == JV_NONE;
    if (!strcmp(t, "string")) return x->k == JV_STR;
    if (!strcmp(t, "number")) return x->k == JV_INT || x->k == JV_BOOL || x->k == JV_FLOAT;
    if (!strcmp(t, "integer")) return x->k == JV_INT;
    if (!strcmp(t, "float")) return x->k == JV_FLOAT;
    if (!strcmp(t, "boolean")) return x->k == JV_BOOL;
    if (!strcmp(t, "true")) return x->k == JV_BOOL && x->i;
    if (!strcmp(t, "false")) return x->k == JV_BOOL && !x->i;
    if (!strcmp(t, "mapping")) return x->k == JV_DICT;
    if (!strcmp(t, "iterable")) return x->k == JV_STR || x->k == JV_LIST || x->k == JV_DICT || x->k == JV_UNDEF;
    if (!strcmp(t, "sequence")) return x->k == JV_STR || x->k == JV_LIST || x->k == JV_DICT;
    if (!strcmp(t, "callable")) return x->k == JV_FUNC;
    if (!strcmp(t, "odd") || !strcmp(t, "even")) {
        long long i = need_int(R, line, x, t);
        return (i % 2 != 0) == (t[0] == 'o');
    }
    if (!strcmp(t, "eq") || !strcmp(t, "equalto") || !strcmp(t, "ne")) {
        if (nargs != 1) jfail(R->f, line, "is %s: needs one argument", t);
        return jv_eq(R, line, x, v[0], 0) == (t[0] != 'n');
    }
    jfail(R->f, line, "the test '%s' is outside the supported Jinja subset", t);
}

static int test(rctx *R, expr *e) {
    jv *x = eval(R, e->a);
    jv **v = eval_args(R, e);
    for (int i = 0; i < e->nargs; i++)
        if (e->kwnames[i]) jfail(R->f, e->line, "is %s: keyword arguments are outside the supported Jinja subset", e->name);
    return apply_test(R, e->line, e->name, x, v, e->nargs);
}

/* Appends the source form of a name / attribute / literal subscript chain
 * (messages[5].content) to s; 0 when e is something else. */
static int describe(sbuf *s, const expr *e) {
    char buf[32];
    switch (e->k) {
    case E_NAME: sb_str(s, e->name); return 1;
    case E_ATTR:
        if (!describe(s, e->a)) return 0;
        sb_str(s, ".");
        sb_str(s, e->name);
        return 1;
    case E_ITEM:
        if (e->b->k != E_LIT || (e->b->lit->k != JV_INT && e->b->lit->k != JV_STR) || !describe(s, e->a)) return 0;
        sb_str(s, "[");
        if (e->b->lit->k == JV_INT) {
            snprintf(buf, sizeof buf, "%lld", e->b->lit->i);
            sb_str(s, buf);
        } else {
            json_string(s, e->b->lit->s, e->b->lit->n);
        }
        sb_str(s, "]");
        return 1;
    default: return 0;
    }
}

/* An undefined attribute or item named by the whole chain that reached it,
 * so that a message says "'messages[5]' is undefined", not "'value'". */
static jv *undef_at(rctx *R, expr *e, jv *v) {
    if (v->k != JV_UNDEF) return v;
    sbuf s = {0};
    if (describe(&s, e)) {
        v = mk_val(R->a, JV_UNDEF);
        v->undef_name = ar_strndup(R->a, s.b, s.n);
    }
    free(s.b);
    return v;
}

static jv *eval(rctx *R, expr *e) {
    switch (e->k) {
    case E_LIT: return e->lit;
    case E_NAME: return lookup(R, e->name);
    case E_ATTR: {
        jv *o = eval(R, e->a);
        if (o->k == JV_DICT && word_in(e->name, "items keys values get"))
            jfail(R->f, e->line, "'.%s' without a call is outside the supported Jinja subset", e->name);
        return undef_at(R, e, get_key(R, e->line, o, e->name, strlen(e->name)));
    }
    case E_ITEM: return undef_at(R, e, get_index(R, e->line, eval(R, e->a), eval(R, e->b)));
    case E_SLICE: return do_slice(R, e);
    case E_CALL: return call(R, e);
    case E_FILTER: return filter(R, e);
    case E_TEST: return test(R, e) != e->negate ? &V_TRUE : &V_FALSE;
    case E_NOT: return truthy(eval(R, e->a)) ? &V_FALSE : &V_TRUE;
    case E_NEG: {
        jv *x = eval(R, e->a);
        if (x->k == JV_FLOAT) {
            jv *r = mk_val(R->a, JV_FLOAT);
            r->f = -x->f;
            return r;
        }
        long long r;
        if (__builtin_sub_overflow(0, need_int(R, e->line, x, "unary minus"), &r)) int_overflow(R, e->line);
        return mk_int(R->a, r);
    }
    case E_BIN: return binop(R, e);
    case E_AND: {
        jv *a = eval(R, e->a);
        return truthy(a) ? eval(R, e->b) : a;
    }
    case E_OR: {
        jv *a = eval(R, e->a);
        return truthy(a) ? a : eval(R, e->b);
    }
    case E_COND:
        if (truthy(eval(R, e->b))) return eval(R, e->a);
        return e->c ? eval(R, e->c) : &V_UNDEF;
    case E_LIST: {
        jv *l = mk_val(R->a, JV_LIST);
        for (int i = 0; i < e->nargs; i++) list_push(R->a, l, eval(R, e->args[i]));
        return l;
    }
    case E_DICT: {
        jv *d = mk_val(R->a, JV_DICT);
        for (int i = 0; i + 1 < e->nargs; i += 2) {
            jv *k = eval(R, e->args[i]);
            need_str(R, e->line, k, "dict literal key");
            dict_set(R->a, d, k, eval(R, e->args[i + 1]));
        }
        return d;
    }
    }
    jfail(R->f, e->line, "internal error: bad expression");
}

/* ---------------------------------------------------------------- statements */

static void exec_body(rctx *R, const body *b);

static jv *iter_list(rctx *R, int line, jv *x) {
    switch (x->k) {
    case JV_UNDEF: return mk_val(R->a, JV_LIST);
    case JV_LIST: return x;
    case JV_DICT: {
        jv *l = mk_val(R->a, JV_LIST);
        for (int i = 0; i < x->len; i++) list_push(R->a, l, x->keys[i]);
        return l;
    }
    case JV_STR: {
        jv *l = mk_val(R->a, JV_LIST);
        size_t c, *o = u8_offsets(R, x->s, x->n, &c);
        for (size_t i = 0; i < c; i++) list_push(R->a, l, mk_str(R->a, x->s + o[i], o[i + 1] - o[i]));
        return l;
    }
    default: jfail(R->f, line, "cannot loop over a %s", kind_name(x));
    }
}

static void bind_targets(rctx *R, const stmt *s, jv *item) {
    if (s->ntgt == 1) {
        assign(R, s->tgt[0], item);
        return;
    }
    if (item->k != JV_LIST || item->len != 2)
        jfail(R->f, s->line, "cannot unpack a %s into %s, %s", kind_name(item), s->tgt[0], s->tgt[1]);
    assign(R, s->tgt[0], item->items[0]);
    assign(R, s->tgt[1], item->items[1]);
}

static void exec_for(rctx *R, const stmt *s) {
    jv *src = iter_list(R, s->line, eval(R, s->e));
    scope sc = {.up = R->sc, .vars = mk_val(R->a, JV_DICT)};
    R->sc = &sc;
    jv *items = src;
    if (s->filter) {
        items = mk_val(R->a, JV_LIST);
        for (int i = 0; i < src->len; i++) {
            bind_targets(R, s, src->items[i]);
            if (truthy(eval(R, s->filter))) list_push(R->a, items, src->items[i]);
        }
    }
    int n = items->len;
    for (int i = 0; i < n; i++) {
        jv *loop = mk_val(R->a, JV_DICT);
#define LOOPSET(k, v) dict_set(R->a, loop, mk_str(R->a, k, strlen(k)), v)
        LOOPSET("index0", mk_int(R->a, i));
        LOOPSET("index", mk_int(R->a, i + 1));
        LOOPSET("revindex", mk_int(R->a, n - i));
        LOOPSET("revindex0", mk_int(R->a, n - i - 1));
        LOOPSET("first", i == 0 ? &V_TRUE : &V_FALSE);
        LOOPSET("last", i == n - 1 ? &V_TRUE : &V_FALSE);
        LOOPSET("length", mk_int(R->a, n));
        LOOPSET("previtem", i > 0 ? items->items[i - 1] : &V_UNDEF);
        LOOPSET("nextitem", i + 1 < n ? items->items[i + 1] : &V_UNDEF);
#undef LOOPSET
        assign(R, "loop", loop);
        bind_targets(R, s, items->items[i]);
        exec_body(R, &s->b);
        if (R->brk == 1) {
            R->brk = 0;
            break;
        }
        R->brk = 0;
    }
    if (n == 0) exec_body(R, &s->else_b);
    R->sc = sc.up;
}

static void exec_body(rctx *R, const body *b) {
    for (int i = 0; i < b->n && !R->brk; i++) {
        const stmt *s = b->v[i];
        switch (s->k) {
        case S_TEXT: out_put(R, s->text, s->n); break;
        case S_OUT: {
            jv *v = to_str(R, s->line, eval(R, s->e));
            out_put(R, v->s, v->n);
            break;
        }
        case S_IF:
            for (int k = 0; k < s->nbranch; k++)
                if (!s->conds[k] || truthy(eval(R, s->conds[k]))) {
                    exec_body(R, &s->bodies[k]);
                    break;
                }
            break;
        case S_FOR: exec_for(R, s); break;
        case S_SET: {
            jv *v = eval(R, s->e);
            if (s->attr) {
                jv *ns = lookup(R, s->tgt[0]);
                if (ns->k != JV_NS)
                    jfail(R->f, s->line, "cannot assign the attribute '%s' of '%s', a %s and not a namespace",
                          s->attr, s->tgt[0], kind_name(ns));
                if (s->attr[0] == '_') jfail(R->f, s->line, "namespace attributes cannot start with '_'");
                dict_set(R->a, ns, mk_str(R->a, s->attr, strlen(s->attr)), v);
            } else {
                assign(R, s->tgt[0], v);
            }
            break;
        }
        case S_SETBLOCK: {
            size_t start = R->n;
            exec_body(R, &s->b);
            jv *v = mk_str(R->a, R->out ? R->out + start : "", R->n - start);
            R->n = start;
            assign(R, s->tgt[0], v);
            break;
        }
        case S_GEN: {
            size_t start = R->n;
            exec_body(R, &s->b);
            if (R->spans) {
                jinja_spans *sp = R->spans;
                if (sp->n == sp->cap) {
                    sp->cap = sp->cap ? 2 * sp->cap : 16;
                    sp->start = realloc(sp->start, (size_t)sp->cap * sizeof *sp->start);
                    sp->end = realloc(sp->end, (size_t)sp->cap * sizeof *sp->end);
                    if (!sp->start || !sp->end) {
                        fprintf(stderr, "ctitan: error: out of memory\n");
                        exit(1);
                    }
                }
                sp->start[sp->n] = start;
                sp->end[sp->n++] = R->n;
            }
            break;
        }
        case S_BREAK: R->brk = 1; break;
        case S_CONTINUE: R->brk = 2; break;
        }
    }
}

void jinja_spans_free(jinja_spans *s) {
    free(s->start);
    free(s->end);
    memset(s, 0, sizeof *s);
}

int jinja_render(const jinja_tmpl *t, const void *vars_json, char **out, size_t *len, jinja_spans *spans,
                 ct_err *e) {
    *out = NULL;
    *len = 0;
    if (spans) spans->n = 0;
    /* everything a longjmp back here reads lives on the heap: locals changed
     * after setjmp would be indeterminate */
    struct {
        arena a;
        failer f;
        rctx R;
        scope top;
    } *st = ct_calloc(1, sizeof *st);
    st->f = (failer){.e = e, .name = t->name};
    st->R = (rctx){.f = &st->f, .a = &st->a, .spans = spans};
    if (setjmp(st->f.jb)) {
        free(st->R.out);
        ar_free(&st->a);
        free(st);
        return CT_ERR_FORMAT;
    }
    rctx *R = &st->R;
    const cJSON *vars = vars_json;
    R->ctx = vars && cJSON_IsObject(vars) ? from_json(&st->a, vars) : mk_val(&st->a, JV_DICT);
    st->top.vars = mk_val(&st->a, JV_DICT);
    R->sc = &st->top;
    exec_body(R, &t->root);
    out_put(R, "", 0);
    R->out[R->n] = 0;
    *out = R->out;
    *len = R->n;
    ar_free(&st->a);
    free(st);
    return 0;
}

/* ---------------------------------------------------------------- chat templates */

struct jinja_chat {
    jinja_tmpl *t;
    cJSON *vars; /* special tokens */
    char file[4400];
    char *src; /* the template text as read (what a record of the template hashes) */
    size_t srcn;
};

static int chat_open(const char *dir, const char *tmpl_file, jinja_chat **out, ct_err *e) {
    *out = NULL;
    char path[4200];
    size_t n = 0;
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir ? dir : ".");
    char *cfg_text = dir ? fs_read_file(path, 0, &n, NULL) : NULL;
    int have_cfg = cfg_text != NULL;
    cJSON *cfg = have_cfg ? json_parse(cfg_text, n, path, e) : NULL;
    free(cfg_text);
    if (have_cfg && !cfg) return CT_ERR_FORMAT;
    if (have_cfg && !cJSON_IsObject(cfg)) {
        cJSON_Delete(cfg);
        return ct_fail(e, CT_ERR_FORMAT, "%s: not a valid JSON object", path);
    }
    char *src = NULL;
    size_t srcn = 0;
    char file[4400];
    if (tmpl_file) {
        snprintf(file, sizeof file, "%s", tmpl_file);
        src = fs_read_file(file, 0, &srcn, NULL);
        if (!src) {
            cJSON_Delete(cfg);
            return ct_fail(e, CT_ERR_IO, "%s: cannot read the chat template", file);
        }
    } else {
        snprintf(file, sizeof file, "%s/chat_template.jinja", dir);
        src = fs_read_file(file, 0, &srcn, e);
        /* only a missing file means "none here": one that is there but unreadable (a
         * directory, no permission) must not fall back to another template */
        if (!src && errno != ENOENT && errno != ENOTDIR) {
            cJSON_Delete(cfg);
            return ct_fail(e, CT_ERR_IO, "%s: cannot read the chat template (%s)", file, strerror(errno));
        }
    }
    if (!src && cfg) {
        const cJSON *ct = cJSON_GetObjectItemCaseSensitive(cfg, "chat_template");
        const char *s = NULL;
        if (cJSON_IsString(ct)) s = ct->valuestring;
        else if (cJSON_IsArray(ct)) {
            const cJSON *it;
            cJSON_ArrayForEach(it, ct) {
                const cJSON *nm = cJSON_GetObjectItemCaseSensitive(it, "name");
                const cJSON *tp = cJSON_GetObjectItemCaseSensitive(it, "template");
                if (cJSON_IsString(nm) && !strcmp(nm->valuestring, "default") && cJSON_IsString(tp)) s = tp->valuestring;
            }
            if (!s) {
                cJSON_Delete(cfg);
                return ct_fail(e, CT_ERR_FORMAT, "%s: \"chat_template\" is a list without a \"default\" template", path);
            }
        } else if (ct && !cJSON_IsNull(ct)) {
            cJSON_Delete(cfg);
            return ct_fail(e, CT_ERR_FORMAT, "%s: \"chat_template\" must be a string", path);
        }
        if (s) {
            src = ct_strdup(s);
            srcn = strlen(s);
            snprintf(file, sizeof file, "%s (chat_template)", path);
        }
    }
    if (!src) {
        cJSON_Delete(cfg);
        return 0;
    }
    jinja_chat *c = ct_calloc(1, sizeof *c);
    snprintf(c->file, sizeof c->file, "%s", file);
    int rc = jinja_parse(src, srcn, file, &c->t, e);
    if (rc) {
        free(src);
        cJSON_Delete(cfg);
        free(c);
        return rc;
    }
    c->src = src, c->srcn = srcn;
    c->vars = cJSON_CreateObject();
    static const char *special[] = {"bos_token", "eos_token", "unk_token", "sep_token",
                                    "pad_token", "cls_token", "mask_token"};
    for (size_t i = 0; cfg && i < sizeof special / sizeof *special; i++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, special[i]);
        if (cJSON_IsObject(v)) v = cJSON_GetObjectItemCaseSensitive(v, "content");
        if (cJSON_IsString(v)) cJSON_AddStringToObject(c->vars, special[i], v->valuestring);
    }
    cJSON_Delete(cfg);
    *out = c;
    return 0;
}

int jinja_chat_open(const char *dir, jinja_chat **out, ct_err *e) { return chat_open(dir, NULL, out, e); }

int jinja_chat_open_file(const char *file, const char *dir, jinja_chat **out, ct_err *e) {
    return chat_open(dir, file, out, e);
}

int jinja_chat_has_generation(const jinja_chat *c) { return c->t->has_gen; }

void jinja_chat_close(jinja_chat *c) {
    if (!c) return;
    jinja_free(c->t);
    cJSON_Delete(c->vars);
    free(c->src);
    free(c);
}

const char *jinja_chat_file(const jinja_chat *c) { return c->file; }

const char *jinja_chat_source(const jinja_chat *c, size_t *n) {
    *n = c->srcn;
    return c->src;
}

int jinja_chat_apply_tools(const jinja_chat *c, const void *messages_json, int add_generation_prompt,
                           const void *tools_json, const void *kwargs_json, char **out, size_t *len,
                           jinja_spans *spans, ct_err *e) {
    static const char *const own[] = {"messages", "tools", "documents", "add_generation_prompt"};
    const cJSON *kw = kwargs_json, *it;
    cJSON_ArrayForEach(it, kw) {
        for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
            if (!strcmp(it->string, own[i]))
                return ct_fail(e, CT_ERR_CONFIG,
                               "chat template keyword \"%s\": apply_chat_template sets it itself", it->string);
    }
    cJSON *vars = cJSON_Duplicate(c->vars, 1);
    /* tools and documents are None when not given, as transformers passes them */
    cJSON_AddItemToObject(vars, "messages", cJSON_Duplicate(messages_json, 1));
    cJSON_AddItemToObject(vars, "tools", tools_json ? cJSON_Duplicate(tools_json, 1) : cJSON_CreateNull());
    cJSON_AddNullToObject(vars, "documents");
    cJSON_AddBoolToObject(vars, "add_generation_prompt", add_generation_prompt);
    cJSON_ArrayForEach(it, kw) {
        cJSON_DeleteItemFromObjectCaseSensitive(vars, it->string);
        cJSON_AddItemToObject(vars, it->string, cJSON_Duplicate(it, 1));
    }
    int rc = jinja_render(c->t, vars, out, len, spans, e);
    cJSON_Delete(vars);
    return rc;
}

int jinja_chat_apply_kw(const jinja_chat *c, const void *messages_json, int add_generation_prompt,
                        const void *kwargs_json, char **out, size_t *len, jinja_spans *spans, ct_err *e) {
    return jinja_chat_apply_tools(c, messages_json, add_generation_prompt, NULL, kwargs_json, out, len, spans, e);
}

int jinja_chat_apply(const jinja_chat *c, const void *messages_json, int add_generation_prompt, char **out,
                     size_t *len, jinja_spans *spans, ct_err *e) {
    return jinja_chat_apply_kw(c, messages_json, add_generation_prompt, NULL, out, len, spans, e);
}
