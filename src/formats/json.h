/* formats/json.h: strict JSON for the files ctitan reads from outside.
 *
 * cJSON skips every byte <= 32 as whitespace and accepts raw control bytes
 * inside strings, so a tokenizer.json or config.json that Python's json and
 * Hugging Face's serde_json reject would load here and silently mean
 * something else (a NUL cuts a string short). These readers check the bytes
 * first, as the JSON grammar (RFC 8259) has them: outside strings only space,
 * tab, CR and LF separate tokens; inside strings no byte below 0x20 appears
 * raw; nothing but whitespace follows the value. The text is UTF-8 (RFC
 * 8259 section 8.1), as Python reading a file as UTF-8 and serde_json demand:
 * cJSON copies any bytes, so a truncated or overlong sequence or an encoded
 * surrogate would reach the tokenizer as a token no HF tool has. Numbers are
 * JSON's (no "01", "1." or "1.e5", which cJSON's strtod takes), and no object
 * repeats a key: Python keeps the last "vocab_size" of two, cJSON finds the
 * first, so the same file would mean two models. Every error is
 * CT_ERR_FORMAT and names the file and the byte offset or the key. */
#ifndef CT_FORMATS_JSON_H
#define CT_FORMATS_JSON_H

#include <stddef.h>

#include "core/err.h"

struct cJSON;

/* Offset of the first byte of text[0, len) the JSON grammar does not allow
 * where it stands (a control byte, a NUL), or of the first byte of an
 * ill-formed UTF-8 sequence (a stray continuation byte, C0, C1 or F5..FF, a
 * sequence cut short, an overlong form, a surrogate ED A0..BF, a code point
 * past U+10FFFF), or len when there is none. A byte below 0x80 at the offset
 * is a control byte, one above starts the bad sequence. Only the byte level:
 * cJSON checks the syntax. */
size_t json_bad_byte(const char *text, size_t len);

/* Length of the well-formed UTF-8 sequence at s (s[0] >= 0x80, avail bytes
 * readable), 0 if it is ill-formed: the Unicode standard's table 3-7, which
 * Python's and Rust's decoders follow. Text sources (data/) check with it too. */
size_t json_utf8_len(const unsigned char *s, size_t avail);

/* text[0, len) as one JSON value; what names the file in messages. NULL on
 * error with e set (CT_ERR_FORMAT, "WHAT: ... at byte N", or "WHAT: duplicate
 * key \"K\"" for an object, at any depth, that repeats a key). Its numbers
 * carry json_is_integer's mark. The caller deletes the result. */
struct cJSON *json_parse(const char *text, size_t len, const char *what, ct_err *e);

/* Whether ITEM is a number written as an integer, as Python's json tells an
 * int from a float: "32", not "32.0" or "3.2e1", which cJSON stores as the
 * same double. A number json_parse (or json_mark_numbers) did not mark, one
 * built in code, counts by its value: integral and finite. Config fields that
 * transformers declares int refuse 32.0 by it. */
int json_is_integer(const struct cJSON *item);

/* Whether ITEM is a number whose value is an integer in [lo, hi], however it
 * was written: the range check before a count or index read from JSON is
 * cast to an integer type (a cast of 1e20 or NaN is undefined). */
int json_int_in(const struct cJSON *item, double lo, double hi);
/* json_int_in and written as an integer too (json_is_integer: 5, not 5.0 or
 * 5e0): a count or id of a file whose writer (ctitan, PEFT, HF tokenizers)
 * writes integers and whose reader refuses a float there. */
int json_integer_in(const struct cJSON *item, double lo, double hi);

/* Marks the numbers of ROOT, the tree cJSON parsed from text[0, len) (that
 * json_bad_byte passed), for json_is_integer: for a reader that calls cJSON
 * itself and words its own messages (the safetensors header). 0, or -1 with
 * *at the offset of a number JSON's grammar refuses ("01", "1.", "-"), or len
 * when ROOT lacks numbers the text has (it is not the text's tree; the walk
 * stops at the last float-written number, so a longer tree passes).
 * json_parse does this itself. */
int json_mark_numbers(struct cJSON *root, const char *text, size_t len, size_t *at);

/* The file at PATH through json_parse; cap as fs_read_file's (0: none). A
 * file that cannot be read is fs_read_file's error (CT_ERR_IO). */
struct cJSON *json_parse_file(const char *path, size_t cap, ct_err *e);

#endif
