/* formats/toml.h: a small, strict TOML reader for config files.
 *
 * The config layer only needs one level of tables holding scalars (and, for
 * model options like mlp_only_layers, arrays of scalars), so the document is
 * flat: a list of sections, each a list of (key, value, line). Keeping the
 * line of every key lets the caller report "FILE:LINE: section.key: ..." for
 * type and range errors that only it can judge.
 *
 * Supported: comments, [table] headers, bare keys, basic strings with escapes,
 * literal strings, integers (decimal with underscores, 0x/0o/0b), floats
 * (incl. inf/nan), booleans, arrays of scalars (multi-line, trailing comma).
 * Rejected with a "not supported" error: dotted or quoted keys, dotted table
 * names, [[arrays of tables]], inline tables, multi-line strings, dates,
 * nested arrays. Anything malformed fails with "FILE:LINE: message"; nothing
 * is guessed. */
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
    struct toml_value *items; /* TOML_ARRAY: scalars only */
    int n_items;
} toml_value;

typedef struct {
    char *key;
    toml_value val;
    int line; /* 1-based line of the key */
} toml_kv;

typedef struct {
    char *name; /* "" for keys before the first [table] header */
    int line;   /* line of the header (0 for the root section) */
    toml_kv *kvs;
    int n_kvs, cap_kvs;
} toml_section;

typedef struct {
    char *path; /* the name used in error messages */
    toml_section *sections; /* sections[0] is always the root section "" */
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
