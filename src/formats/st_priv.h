/* formats/st_priv.h: what the safetensors reader (st_read.c), writer
 * (st_write.c) and sharded index (st_index.c) share; safetensors.h stays the
 * one public face, this header is for those three files only. */
#ifndef CT_FORMATS_ST_PRIV_H
#define CT_FORMATS_ST_PRIV_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "formats/safetensors.h"

#define ST_MAX_HEADER 100000000ull
#define ST_EXACT_LIMIT 9007199254740992.0 /* 2^53: doubles above are not exact integers */

/* strcmp for qsort and bsearch over arrays of const char *. */
int st_cmp_str(const void *a, const void *b);

/* Text built by hand (a header, an index.json): cJSON prints large integers
 * in exponent form ("1e+15"), which the Rust reader rejects. */
typedef struct {
    char *p;
    size_t n, cap;
} st_buf;

void st_sb_puts(st_buf *b, const char *s);
void st_sb_printf(st_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* JSON string literal; UTF-8 passes through, control bytes are escaped. */
void st_sb_json_str(st_buf *b, const char *s);

/* Checks every tensor before any byte is written; sizes[i] gets stored bytes.
 * need_data: a tensor with elements must have data (not for streams). */
int st_wvalidate(const char *path, const st_wtensor *ts, int n, const char *const *meta, uint64_t *sizes,
                 int need_data, ct_err *e);
/* st_write of tensors st_wvalidate passed (sizes from it). */
int st_write_checked(const char *path, const st_wtensor *ts, int n, const char *const *meta, const uint64_t *sizes,
                     ct_err *e);

#endif
