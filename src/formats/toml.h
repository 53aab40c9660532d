/* formats/toml.h: a small, strict TOML reader for config files.
 *
 * The document is kept flat: a list of tables, each named by its full dotted
 * path ("training", "quantize.linear.float8"), each a list of (key, value,
 * line) holding scalars and arrays (of scalars, or of arrays of scalars: torch-
 * titan's module_fqns_per_model_part is a list of lists). Keeping the line of every key
 * lets the caller report "FILE:LINE: section.key: ..." for type and range
 * errors that only it can judge.
 *
 * Supported: comments, [table] headers, dotted headers ([a.b.c]: nested
 * tables, the parents created implicitly), bare keys, quoted keys whose text
 * is a bare key ("a" is a), dotted keys (a.b = 1 inside [t] sets b in table
 * t.a), basic strings with escapes, literal strings, integers (decimal with
 * underscores, 0x/0o/0b), floats (incl. inf/nan), booleans, arrays of scalars
 * and arrays of such arrays (multi-line, trailing comma). The errors TOML 1.0 requires of these are
 * raised: a table defined twice (by two headers, or by a header after dotted
 * keys made it), a key defined twice (whatever its spelling: b, "b", 'b'), a
 * key that is both a value and a table, dotted keys adding to a table that a
 * [header] defined. Rejected with a "not supported" error: quoted keys with
 * other characters (spaces, dots, ...), [[arrays of tables]], inline tables,
 * multi-line strings, dates, arrays nested more than two deep, names nested deeper than
 * TOML_MAX_DEPTH. Anything malformed fails with "FILE:LINE: message";
 * nothing is guessed. */
#ifndef CT_FORMATS_TOML_H
#define CT_FORMATS_TOML_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

typedef enum {
    TOML_STRING = 0,
    TOML_INT,
    TOML_FLOAT,
    TOML_BOOL,
    TOML_ARRAY,
} toml_kind;

typedef struct toml_value {
    toml_kind kind;
    char *s;                  /* TOML_STRING: UTF-8, NUL-terminated, no NUL inside */
    int64_t i;                /* TOML_INT; TOML_BOOL (0 or 1) */
    double f;                 /* TOML_FLOAT */
    struct toml_value *items; /* TOML_ARRAY: scalars, or arrays of scalars (one level) */
    int n_items;
} toml_value;

typedef struct {
    char *key;
    toml_value val;
    int line; /* 1-based line of the key */
} toml_kv;

/* Levels of a dotted name ([a.b.c] has 3), and the longest full name. */
#define TOML_MAX_DEPTH 8
#define TOML_MAX_NAME 256

typedef struct {
    char *name; /* full dotted path; "" for keys before the first [table] header */
    int line;   /* line of the header, or of the first key or header that created it
                   (0 for the root section) */
    int implicit; /* created only as the parent of a [header] ([a] for [a.b]), never
                     defined itself: may still get its own [a] header, once */
    int dotted;   /* defined by dotted keys (a.b = 1 defines table a): no [a] header may
                     follow (TOML 1.0) */
    int dotted_ctx; /* the section whose dotted keys defined it (they alone may add to it) */
    toml_kv *kvs;
    int n_kvs, cap_kvs;
} toml_section;

typedef struct {
    char *path; /* the name used in error messages */
    toml_section *sections; /* sections[0] is always the root section ""; every table,
                               implicit ones (no keys) included, in order of creation */
    int n_sections, cap_sections;
} toml_doc;

/* Reads and parses a whole file. On failure the doc is left empty (safe to
 * toml_free) and e holds "PATH:LINE: message" (CT_ERR_FORMAT) or
 * "PATH: cannot read: reason" (CT_ERR_IO). */
int toml_parse_file(const char *path, toml_doc *doc, ct_err *e);

/* Parses `len` bytes of `text`; `name` stands in for the file name in
 * messages. */
int toml_parse_string(const char *text, size_t len, const char *name, toml_doc *doc,
                      ct_err *e);

void toml_free(toml_doc *doc);

/* The section called `name`, or NULL. */
const toml_section *toml_find_section(const toml_doc *doc, const char *name);
/* The value of section.key, or NULL. */
const toml_kv *toml_find(const toml_doc *doc, const char *section, const char *key);

/* "string", "integer", "float", "boolean", "array". */
const char *toml_kind_name(toml_kind k);

#endif
