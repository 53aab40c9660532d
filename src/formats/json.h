/* formats/json.h: strict JSON for the files ctitan reads from outside.
 *
 * cJSON skips every byte <= 32 as whitespace and accepts raw control bytes
 * inside strings, so a tokenizer.json or config.json that Python's json and
 * Hugging Face's serde_json reject would load here and silently mean
 * something else (a NUL cuts a string short). These readers check the bytes
 * first, as the JSON grammar (RFC 8259) has them: outside strings only space,
 * tab, CR and LF separate tokens; inside strings no byte below 0x20 appears
 * raw; nothing but whitespace follows the value. Every error is
 * CT_ERR_FORMAT and names the file and the byte offset. */
#ifndef CT_FORMATS_JSON_H
#define CT_FORMATS_JSON_H

#include <stddef.h>

#include "core/err.h"

struct cJSON;

/* Offset of the first byte of text[0, len) the JSON grammar does not allow
 * where it stands (a control byte, a NUL), or len when there is none. Only
 * the byte level: cJSON checks the syntax. */
size_t json_bad_byte(const char *text, size_t len);

/* text[0, len) as one JSON value; what names the file in messages. NULL on
 * error with e set (CT_ERR_FORMAT, "WHAT: ... at byte N"). The caller
 * deletes the result. */
struct cJSON *json_parse(const char *text, size_t len, const char *what, ct_err *e);

/* The file at PATH through json_parse; cap as fs_read_file's (0: none). A
 * file that cannot be read is fs_read_file's error (CT_ERR_IO). */
struct cJSON *json_parse_file(const char *path, size_t cap, ct_err *e);

#endif
