/* tests/c/test_json.c: the strict JSON reader (formats/json.h) every reader of
 * outside JSON uses. The verdicts are the JSON grammar's (RFC 8259: only
 * space, tab, LF and CR between tokens, no raw byte below 0x20 inside a
 * string, one value per text), which Python's json.loads and serde_json
 * follow; cJSON alone accepts the rejected ones (it skips every byte <= 32
 * and ignores what follows the value). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "check.h"
#include "core/fs.h"
#include "formats/json.h"

typedef struct {
    const char *text;
    size_t len; /* 0: strlen */
    int ok;
    size_t bad; /* the offset the error names, for a byte-level reject */
} json_case;

static void test_verdicts(void) {
    static const json_case cases[] = {
        {"{\"a\": 1}", 0, 1, 0},
        {" \t\r\n{\"a\": [1, 2]}\n ", 0, 1, 0},
        {"\"x\"", 0, 1, 0},
        {"{\"a\": \"\\u0001\\n\\t\"}", 0, 1, 0}, /* escaped control characters are fine */
        {"{\"a\": \"caf\xc3\xa9\"}", 0, 1, 0},
        {"{\"a\":\x0b" "1}", 0, 0, 5},            /* vertical tab between tokens */
        {"\x1c{\"a\": 1}", 0, 0, 0},              /* file separator before the value */
        {"{\"a\": 1}\x0c", 0, 0, 8},              /* form feed after it */
        {"{\"a\": 1}\0", 9, 0, 8},                /* a NUL before the end of the file */
        {"{\"a\": \"x\x01y\"}", 0, 0, 8},         /* a raw control byte inside a string */
        {"{\"a\": \"x\0y\"}", 12, 0, 8},          /* a NUL inside a string would cut it short */
        {"{\"a\": \"\\\"\x02\"}", 0, 0, 9},       /* after an escaped quote, still inside the string */
        {"{\"a\": 1} x", 0, 0, 9},                /* extra data */
        {"{\"a\": 1}{}", 0, 0, 8},                /* a second value */
        {"", 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        const json_case *c = &cases[i];
        size_t len = c->len ? c->len : strlen(c->text);
        ct_err e = {0};
        cJSON *j = json_parse(c->text, len, "x.json", &e);
        CHECK((j != NULL) == c->ok, "case %zu: expected %s, got %s (%s)", i, c->ok ? "accept" : "reject",
              j ? "accept" : "reject", e.msg);
        if (!c->ok) {
            char at[64];
            snprintf(at, sizeof at, "byte %zu", c->bad);
            CHECK(e.code == CT_ERR_FORMAT && strstr(e.msg, "x.json") && strstr(e.msg, at),
                  "case %zu: the error names the file and %s: %s", i, at, e.msg);
        }
        cJSON_Delete(j);
    }
    /* the byte check alone, on what cJSON would take */
    CHECK(json_bad_byte("[1,\x7f" "2]", 6) == 6, "DEL is not a control byte the grammar forbids");
    CHECK(json_bad_byte("[1,\x1f" "2]", 6) == 3, "0x1f between tokens");
    CHECK(json_bad_byte("[\"\\\\\"\x01]", 7) == 5, "an escaped backslash ends the escape: 0x01 is outside the string");
}

static void test_file(void) {
    char dir[] = "/tmp/ctitan-test-json-XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    char *p = fs_join(dir, "tokenizer.json");
    ct_err e = {0};
    CHECK(fs_write_atomic(p, "{\"model\":\x01{}}", 12, &e) == 0, "write: %s", e.msg);
    cJSON *j = json_parse_file(p, 0, &e);
    CHECK(!j && e.code == CT_ERR_FORMAT && strstr(e.msg, p) && strstr(e.msg, "byte 9"),
          "control byte in a file: %s", e.msg);
    cJSON_Delete(j);
    CHECK(fs_write_atomic(p, "{\"model\": {}}\n", 14, &e) == 0, "write: %s", e.msg);
    j = json_parse_file(p, 0, &e);
    CHECK(cJSON_IsObject(j), "a good file parses");
    cJSON_Delete(j);
    unlink(p);
    e = (ct_err){0};
    j = json_parse_file(p, 0, &e);
    CHECK(!j && e.code == CT_ERR_IO && strstr(e.msg, p), "a missing file is a read error: %s", e.msg);
    free(p);
    ct_rm_tree(dir, NULL);
}

int main(void) {
    test_verdicts();
    test_file();
    return CHECK_DONE();
}
