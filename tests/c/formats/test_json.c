/* tests/c/formats/test_json.c: the strict JSON reader (formats/json.h) every reader of
 * outside JSON uses. The verdicts are the JSON grammar's (RFC 8259: only
 * space, tab, LF and CR between tokens, no raw byte below 0x20 inside a
 * string, one value per text, JSON's numbers, UTF-8 text), which Python's
 * json (reading a file as UTF-8) and serde_json follow; cJSON alone accepts
 * the rejected ones (it skips every byte <= 32, ignores what follows the
 * value, copies any bytes and reads numbers with strtod). Beyond RFC 8259's
 * "SHOULD": no object repeats a key, and json_is_integer tells 32 from 32.0. */
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
        /* UTF-8 (Unicode table 3-7): what Python reading the file and serde_json decode */
        {"[\"\xe2\x82\xac \xf0\x9f\x98\x80 \xc4\xa0 \xef\xbf\xbf \xf4\x8f\xbf\xbf\"]", 0, 1, 0},
        {"[\"a\x80\"]", 0, 0, 3},                  /* a continuation byte with no lead */
        {"[\"a\xc0\xaf\"]", 0, 0, 3},              /* overlong '/' */
        {"[\"a\xc1\xbf\"]", 0, 0, 3},              /* overlong, C1 */
        {"[\"a\xe0\x80\xaf\"]", 0, 0, 3},          /* overlong, 3 bytes */
        {"[\"a\xf0\x80\x80\xaf\"]", 0, 0, 3},      /* overlong, 4 bytes */
        {"[\"a\xed\xa0\x80\"]", 0, 0, 3},          /* U+D800, a surrogate */
        {"[\"a\xed\xbf\xbf\"]", 0, 0, 3},          /* U+DFFF */
        {"[\"a\xf4\x90\x80\x80\"]", 0, 0, 3},      /* U+110000 */
        {"[\"a\xf5\x80\x80\x80\"]", 0, 0, 3},      /* F5: no such lead */
        {"[\"a\xff\"]", 0, 0, 3},
        {"[\"ab\xe2\x82\"]", 0, 0, 4},             /* cut short by the quote */
        {"[\"ab\xc3", 0, 0, 4},                     /* cut short by the end */
        {"[\"\\\xc3\xa9\"]", 0, 0, 2},           /* an escape does not hide a lead byte... */
        {"[\"\\\x80\"]", 0, 0, 3},                /* ...nor a stray continuation byte */
        {"[1]\xc3\xa9", 0, 0, 3},                   /* well-formed UTF-8 outside a string: cJSON's verdict */
        {"[1]\xc3", 0, 0, 3},                        /* ill-formed outside a string */
        /* numbers: JSON's grammar, not strtod's (Python: "Expecting ',' delimiter") */
        {"[0, -0, 10, -1.5, 2e3, 2E+3, 2.5e-3, 0.0]", 0, 1, 0},
        {"[01]", 0, 0, 1},
        {"[-01]", 0, 0, 1},
        {"[1.]", 0, 0, 1},
        {"[1.e5]", 0, 0, 1},
        {"{\"a\": -}", 0, 0, 6},
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
    CHECK(json_bad_byte("[1] \xc3", 5) == 4 && json_bad_byte("[1] \xc3\xa9", 6) == 6,
          "UTF-8 outside strings: cut short / well-formed (cJSON refuses both: the byte check only the first)");
    CHECK(json_bad_byte("\"a\xed\x9f\xbf\xee\x80\x80\"", 9) == 9, "U+D7FF and U+E000 sit beside the surrogates");
    ct_err e = {0};
    cJSON *j = json_parse("[\"\xe0\x9f\xbf\"]", 6, "x.json", &e);
    CHECK(!j && strstr(e.msg, "x.json: invalid JSON: invalid UTF-8 (byte 0xe0) at byte 2"), "message: %s", e.msg);
    cJSON_Delete(j);
}

/* Duplicate keys: Python's json keeps the last, cJSON finds the first, so a
 * config.json with "vocab_size" twice meant two models; both readers must see
 * one. Keys compare as decoded strings, per object. */
static void test_duplicate_keys(void) {
    static const struct {
        const char *text;
        const char *key; /* NULL: accepted */
    } cases[] = {
        {"{\"vocab_size\": 1, \"hidden_size\": 2, \"vocab_size\": 3}", "vocab_size"},
        {"{\"a\": {\"b\": 1, \"b\": 1}}", "b"},                       /* nested */
        {"[{\"x\": 1}, {\"y\": 2, \"y\": 3}]", "y"},                  /* in an array's object */
        {"{\"a\": 1, \"\\u0061\": 2}", "a"},                         /* the same key, escaped */
        {"{\"\\ud83d\\ude00\": 1, \"\xf0\x9f\x98\x80\": 2}", "\xf0\x9f\x98\x80"}, /* a surrogate pair */
        /* the first and last pairs (U+10000, U+10FFFF): Python's json.loads makes one key of each two */
        {"{\"\\ud800\\udc00\": 1, \"\xf0\x90\x80\x80\": 2}", "\xf0\x90\x80\x80"},
        {"{\"\\udbff\\udfff\": 1, \"\xf4\x8f\xbf\xbf\": 2}", "\xf4\x8f\xbf\xbf"},
        {"{\"a\": 1, \"b\": {\"a\": 2}, \"c\": [{\"a\": 3}, {\"a\": 4}]}", NULL}, /* other objects */
        {"{\"a\": {\"a\": {\"a\": 1}}, \"b\": \"a\", \"c\": [\"a\", \"a\"]}", NULL},
        {"{\"a\": 1, \"A\": 2, \"a \": 3, \"\": 4}", NULL},
        {"{\"a\\u0000b\": 1, \"a\\u0000c\": 2}", NULL}, /* Python's keys differ after the NUL */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        ct_err e = {0};
        cJSON *j = json_parse(cases[i].text, strlen(cases[i].text), "config.json", &e);
        if (!cases[i].key) {
            CHECK(j != NULL, "dup case %zu: rejected: %s", i, e.msg);
        } else {
            char want[128];
            snprintf(want, sizeof want, "config.json: duplicate key \"%s\"", cases[i].key);
            CHECK(!j && e.code == CT_ERR_FORMAT && strstr(e.msg, want), "dup case %zu: want '%s': %s", i, want,
                  e.msg);
        }
        cJSON_Delete(j);
    }
    /* tokenizer.json's size: 151k keys in one object, no duplicate, then one */
    enum { N = 151643 };
    size_t cap = (size_t)N * 24 + 64, n = 0;
    char *t = malloc(cap);
    n += (size_t)snprintf(t + n, cap - n, "{\"model\": {\"vocab\": {");
    for (int k = 0; k < N; k++) n += (size_t)snprintf(t + n, cap - n, "%s\"tok%d\": %d", k ? ", " : "", k, k);
    n += (size_t)snprintf(t + n, cap - n, "}}}");
    ct_err e = {0};
    cJSON *j = json_parse(t, n, "tokenizer.json", &e);
    CHECK(j && cJSON_GetArraySize(cJSON_GetObjectItem(cJSON_GetObjectItem(j, "model"), "vocab")) == N, "big vocab: %s",
          e.msg);
    cJSON_Delete(j);
    n -= 3;
    n += (size_t)snprintf(t + n, cap - n, ", \"tok77777\": 1}}}");
    j = json_parse(t, n, "tokenizer.json", &e);
    CHECK(!j && strstr(e.msg, "tokenizer.json: duplicate key \"tok77777\""), "big vocab, one key twice: %s", e.msg);
    cJSON_Delete(j);
    free(t);
}

/* json_is_integer: cJSON stores 32 and 32.0 as one double; the text tells
 * them apart, in document order at any depth. */
static void test_integer_marks(void) {
    const char *text = "{\"a\": 32, \"b\": 32.0, \"c\": [1, 2e0, {\"d\": -0, \"e\": 3.2e1, \"f\": \"7.0\"}], "
                       "\"g\": 1E2, \"h\": 0.5, \"i\": 100000000000000000000, \"j\": 7}";
    ct_err e = {0};
    cJSON *j = json_parse(text, strlen(text), "x.json", &e);
    CHECK(j != NULL, "%s", e.msg);
    if (!j) return;
    const cJSON *c = cJSON_GetObjectItem(j, "c"), *o = cJSON_GetArrayItem(c, 2);
    CHECK(json_is_integer(cJSON_GetObjectItem(j, "a")), "32 is an integer");
    CHECK(!json_is_integer(cJSON_GetObjectItem(j, "b")), "32.0 is not");
    CHECK(json_is_integer(cJSON_GetArrayItem(c, 0)), "1 in an array is");
    CHECK(!json_is_integer(cJSON_GetArrayItem(c, 1)), "2e0 is not");
    CHECK(json_is_integer(cJSON_GetObjectItem(o, "d")), "-0 is");
    CHECK(!json_is_integer(cJSON_GetObjectItem(o, "e")), "3.2e1 is not");
    CHECK(!json_is_integer(cJSON_GetObjectItem(o, "f")), "a string is not");
    CHECK(!json_is_integer(cJSON_GetObjectItem(j, "g")), "1E2 is not");
    CHECK(!json_is_integer(cJSON_GetObjectItem(j, "h")), "0.5 is not");
    CHECK(json_is_integer(cJSON_GetObjectItem(j, "i")), "10^20 written as digits is (a caller checks its range)");
    CHECK(json_is_integer(cJSON_GetObjectItem(j, "j")), "7 after the floats is");
    /* the mark survives cJSON's copies and prints as before */
    cJSON *dup = cJSON_Duplicate(j, 1);
    CHECK(!json_is_integer(cJSON_GetObjectItem(dup, "b")) && json_is_integer(cJSON_GetObjectItem(dup, "a")),
          "cJSON_Duplicate keeps the marks");
    char *p = cJSON_PrintUnformatted(dup);
    CHECK(p && strstr(p, "\"b\":32,"), "a marked number prints as cJSON prints it: %s", p ? p : "(null)");
    free(p);
    cJSON_Delete(dup);
    cJSON_Delete(j);
    /* numbers json_parse did not mark count by their value */
    cJSON *n = cJSON_CreateNumber(5);
    CHECK(json_is_integer(n), "a built 5 is an integer");
    cJSON_SetNumberValue(n, 5.5);
    CHECK(!json_is_integer(n), "a built 5.5 is not");
    cJSON_Delete(n);
    /* json_mark_numbers, for a reader that calls cJSON itself */
    const char *h = "{\"s\": [4, 4.0], \"t\": {\"u\": 1e3}}";
    cJSON *r = cJSON_Parse(h);
    size_t at = 99;
    CHECK(r && json_mark_numbers(r, h, strlen(h), &at) == 0, "mark: %zu", at);
    CHECK(json_is_integer(cJSON_GetArrayItem(cJSON_GetObjectItem(r, "s"), 0)) &&
              !json_is_integer(cJSON_GetArrayItem(cJSON_GetObjectItem(r, "s"), 1)) &&
              !json_is_integer(cJSON_GetObjectItem(cJSON_GetObjectItem(r, "t"), "u")),
          "json_mark_numbers marks as json_parse");
    cJSON_Delete(r);
    const char *z = "[1, 01]";
    r = cJSON_Parse(z);
    CHECK(r && json_mark_numbers(r, z, strlen(z), &at) == -1 && at == 4, "01 refused at byte 4: %zu", at);
    cJSON_Delete(r);
    r = cJSON_Parse("[1]");
    CHECK(r && json_mark_numbers(r, "[1, 2.5]", 8, &at) == -1 && at == 8, "a text that is not the tree's: %zu", at);
    cJSON_Delete(r);
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
    test_duplicate_keys();
    test_integer_marks();
    test_file();
    return CHECK_DONE();
}
