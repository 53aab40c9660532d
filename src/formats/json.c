/* formats/json.c: the byte-level check cJSON does not make, then cJSON. */
#include "formats/json.h"

#include <stdlib.h>

#include <cjson/cJSON.h>

#include "core/fs.h"

static int json_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

size_t json_bad_byte(const char *text, size_t len) {
    int in_str = 0, esc = 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)text[i];
        if (in_str) {
            if (c < 0x20) return i;
            if (esc) esc = 0;
            else if (c == '\\') esc = 1;
            else if (c == '"') in_str = 0;
        } else if (c == '"') {
            in_str = 1;
        } else if (c < 0x20 && !json_ws(c)) {
            return i;
        }
    }
    return len;
}

cJSON *json_parse(const char *text, size_t len, const char *what, ct_err *e) {
    size_t bad = json_bad_byte(text, len);
    if (bad < len) {
        ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON: control byte 0x%02x at byte %zu", what,
                (unsigned)(unsigned char)text[bad], bad);
        return NULL;
    }
    const char *end = NULL;
    cJSON *j = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    if (!j) {
        /* cJSON leaves the end pointer at the byte it stopped on */
        size_t at = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON near byte %zu", what, at);
        return NULL;
    }
    for (const char *q = end; q < text + len; q++)
        if (!json_ws((unsigned char)*q)) {
            ct_fail(e, CT_ERR_FORMAT, "%s: invalid JSON: extra data after the value at byte %zu", what,
                    (size_t)(q - text));
            cJSON_Delete(j);
            return NULL;
        }
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
