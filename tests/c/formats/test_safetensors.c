/* tests/c/formats/test_safetensors.c: safetensors round trips, sharded sets, and a
 * corpus of hand-made corrupt files that must each be refused with a message
 * naming the file.
 *
 * Expected bytes come from the format itself (8-byte LE length, JSON header,
 * raw little-endian data) and from IEEE facts (bf16/f16 encodings of chosen
 * values), not from running our own writer. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cjson/cJSON.h>
#include <dirent.h>
#include <ftw.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "formats/safetensors.h"

static char g_dir[256];

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", g_dir, name); }

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* Writes a safetensors file by hand: LE length `hlen` (or strlen(json) when
 * hlen is UINT64_MAX), the header text, then `dlen` data bytes. */
static void write_raw(const char *path, uint64_t hlen, const char *json, const void *data, size_t dlen) {
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        perror(path);
        exit(1);
    }
    uint64_t n = hlen == UINT64_MAX ? strlen(json) : hlen;
    unsigned char b[8];
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(n >> (8 * i));
    fwrite(b, 1, 8, fp);
    fwrite(json, 1, strlen(json), fp);
    if (dlen) fwrite(data, 1, dlen, fp);
    fclose(fp);
}

static unsigned char *read_all(const char *path, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    *len = fread(b, 1, (size_t)n, fp);
    b[*len] = 0;
    fclose(fp);
    return b;
}

static uint16_t rd16(const void *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ------------------------------------------------------------ round trip */

static void test_roundtrip(void) {
    char path[512];
    path_of(path, sizeof path, "rt.safetensors");
    float a[6] = {1, -2, 3.5f, 0, 1e-3f, -7};
    int32_t b[4] = {-1, 0, 2147483647, 42};
    float scalar = 3.5f;
    /* bf16 of these is known from the IEEE layout: 1.0 -> 3f80; 1+2^-8 is a tie
     * that rounds to even 3f80; 1+3*2^-8 is a tie that rounds to even 3f82;
     * -2 -> c000. */
    float cbf[4] = {1.0f, 1.00390625f, 1.01171875f, -2.0f};
    uint16_t cbf_want[4] = {0x3f80, 0x3f80, 0x3f82, 0xc000};
    /* f16: 1 -> 3c00, 65504 (max) -> 7bff, 0.5 -> 3800, -2 -> c000 */
    float cf16[4] = {1.0f, 65504.0f, 0.5f, -2.0f};
    uint16_t cf16_want[4] = {0x3c00, 0x7bff, 0x3800, 0xc000};
    uint8_t d[8] = {0, 1, 2, 3, 250, 251, 252, 255};
    int64_t ev[2] = {5000000000LL, -3};
    double f64 = 0.1;
    uint8_t bools[3] = {1, 0, 1};
    st_wtensor ts[] = {
        {"a", CT_F32, CT_F32, 2, {2, 3}, a},
        {"model.layers.0.b", CT_I32, CT_I32, 1, {4}, b},
        {"scalar", CT_F32, CT_F32, 0, {0}, &scalar},
        {"empty", CT_F32, CT_F32, 2, {0, 4}, NULL},
        {"c_bf16", CT_BF16, CT_F32, 1, {4}, cbf},
        {"c_f16", CT_F16, CT_F32, 2, {2, 2}, cf16},
        {"d", CT_U8, CT_U8, 3, {2, 2, 2}, d},
        {"e", CT_I64, CT_I64, 1, {2}, ev},
        {"f", CT_F64, CT_F64, 1, {1}, &f64},
        {"g", CT_BOOL, CT_BOOL, 1, {3}, bools},
        {"quote\"name\\", CT_U8, CT_U8, 1, {1}, d},
    };
    int n = (int)(sizeof ts / sizeof ts[0]);
    const char *meta[] = {"format", "pt", "note", "x\ny", NULL};
    ct_err e = {0};
    CHECK(st_write(path, ts, n, meta, &e) == 0, "st_write: %s", e.msg);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK(!exists(tmp), "%s left behind", tmp);

    /* raw layout, checked against the format rather than our reader */
    size_t len;
    unsigned char *raw = read_all(path, &len);
    CHECK(raw && len > 8, "read back %s", path);
    if (raw && len > 8) {
        uint64_t N = 0;
        for (int i = 7; i >= 0; i--) N = (N << 8) | raw[i];
        CHECK(N % 8 == 0, "header length %llu not a multiple of 8", (unsigned long long)N);
        CHECK(8 + N <= len, "header inside file");
        /* the data buffer starts with the 8-byte types (e: I64, then f: F64),
         * so "a" comes after their 24 bytes */
        const char *want = "{\"__metadata__\":{\"format\":\"pt\",\"note\":\"x\\ny\"},\"a\":{\"dtype\":\"F32\","
                           "\"shape\":[2,3],\"data_offsets\":[24,48]}";
        CHECK(memcmp(raw + 8, want, strlen(want)) == 0, "header starts %.80s", (const char *)raw + 8);
        CHECK(raw[8 + N - 1] == '}' || raw[8 + N - 1] == ' ', "header padded with spaces");
        /* total data = 24+16+4+0+8+8+8+16+8+3+1 */
        CHECK(len == 8 + N + 96, "file length %zu, header %llu", len, (unsigned long long)N);
        int64_t e0;
        memcpy(&e0, raw + 8 + N, 8);
        CHECK(e0 == 5000000000LL, "first data item %lld", (long long)e0);
        float a0;
        memcpy(&a0, raw + 8 + N + 24, 4);
        CHECK(a0 == 1.0f, "a[0] %g", a0);
        cJSON *h = cJSON_ParseWithLength((const char *)raw + 8, (size_t)N);
        CHECK(h != NULL, "header parses as JSON");
        const cJSON *q = cJSON_GetObjectItemCaseSensitive(h, "quote\"name\\");
        CHECK(q != NULL, "escaped tensor name present in header");
        cJSON_Delete(h);
    }
    free(raw);

    st_file *f = st_open(path, &e);
    CHECK(f != NULL, "st_open: %s", e.msg);
    if (!f) return;
    CHECK(st_count(f) == n, "count %d", st_count(f));
    CHECK(strcmp(st_path(f), path) == 0, "path");
    CHECK(st_metadata(f, "format") && strcmp(st_metadata(f, "format"), "pt") == 0, "format meta");
    CHECK(st_metadata(f, "note") && strcmp(st_metadata(f, "note"), "x\ny") == 0, "note meta");
    CHECK(st_metadata(f, "missing") == NULL, "missing meta");
    for (int i = 0; i < n && i < st_count(f); i++) {
        const st_tensor *t = st_get(f, i);
        CHECK(strcmp(t->name, ts[i].name) == 0, "order: %s vs %s", t->name, ts[i].name);
        CHECK(t->dtype == ts[i].dtype, "%s dtype", t->name);
        CHECK(t->ndim == ts[i].ndim, "%s ndim", t->name);
        int64_t numel = 1;
        for (int k = 0; k < t->ndim; k++) {
            CHECK(t->shape[k] == ts[i].shape[k], "%s shape[%d]", t->name, k);
            numel *= ts[i].shape[k];
        }
        CHECK(t->numel == numel, "%s numel %lld", t->name, (long long)t->numel);
        CHECK(t->nbytes == (size_t)numel * ct_dtype_size(ts[i].dtype), "%s nbytes", t->name);
        CHECK(st_find(f, ts[i].name) == t, "find %s", ts[i].name);
        CHECK((uintptr_t)t->data % ct_dtype_size(t->dtype) == 0, "%s aligned", t->name);
        if (ts[i].dtype == ts[i].src_dtype && t->nbytes)
            CHECK(memcmp(t->data, ts[i].data, t->nbytes) == 0, "%s data", t->name);
    }
    const st_tensor *t = st_find(f, "c_bf16");
    for (int i = 0; t && i < 4; i++)
        CHECK(rd16((const char *)t->data + 2 * i) == cbf_want[i], "bf16[%d] = %04x", i,
              rd16((const char *)t->data + 2 * i));
    t = st_find(f, "c_f16");
    for (int i = 0; t && i < 4; i++)
        CHECK(rd16((const char *)t->data + 2 * i) == cf16_want[i], "f16[%d] = %04x", i,
              rd16((const char *)t->data + 2 * i));
    t = st_find(f, "scalar");
    CHECK(t && t->ndim == 0 && t->numel == 1 && t->nbytes == 4, "0-d scalar");
    t = st_find(f, "empty");
    CHECK(t && t->numel == 0 && t->nbytes == 0, "empty tensor");
    CHECK(st_find(f, "nope") == NULL, "absent name");
    CHECK(st_find(f, "") == NULL, "empty name");
    CHECK(st_get(f, -1) == NULL && st_get(f, n) == NULL, "st_get bounds");
    st_close(f);

    /* no metadata, no tensors */
    char p2[512];
    path_of(p2, sizeof p2, "empty.safetensors");
    CHECK(st_write(p2, NULL, 0, NULL, &e) == 0, "empty write: %s", e.msg);
    f = st_open(p2, &e);
    CHECK(f && st_count(f) == 0 && st_metadata(f, "format") == NULL, "empty file reads: %s", e.msg);
    st_close(f);
}

/* A file written by someone else's rules: tensors listed out of data order,
 * whitespace in the header, a zero-byte tensor between two others. */
static void test_handmade_valid(void) {
    char path[512];
    path_of(path, sizeof path, "hand.safetensors");
    const char *json = "{ \"b\" : {\"data_offsets\": [4, 8], \"dtype\": \"I32\", \"shape\": [1]},\n"
                       "  \"z\": {\"dtype\": \"F32\", \"shape\": [2, 0], \"data_offsets\": [4, 4]},\n"
                       "  \"a\": {\"dtype\": \"U16\", \"shape\": [2], \"data_offsets\": [0, 4]},"
                       "\"__metadata__\": {\"k\": \"v\"}}   ";
    unsigned char data[8] = {1, 0, 2, 0, 0xff, 0xff, 0xff, 0x7f};
    write_raw(path, UINT64_MAX, json, data, 8);
    ct_err e = {0};
    st_file *f = st_open(path, &e);
    CHECK(f != NULL, "hand-made file: %s", e.msg);
    if (!f) return;
    CHECK(st_count(f) == 3, "count");
    CHECK(strcmp(st_get(f, 0)->name, "b") == 0, "header order kept");
    const st_tensor *a = st_find(f, "a"), *b = st_find(f, "b"), *z = st_find(f, "z");
    CHECK(a && rd16(a->data) == 1 && rd16((const char *)a->data + 2) == 2, "a values");
    int32_t bv = 0;
    if (b) memcpy(&bv, b->data, 4);
    CHECK(bv == 2147483647, "b value %d", bv);
    CHECK(z && z->numel == 0 && z->ndim == 2, "zero-size tensor");
    CHECK(st_metadata(f, "k") && strcmp(st_metadata(f, "k"), "v") == 0, "metadata after tensors");
    st_close(f);
}

/* ------------------------------------------------------------- corruption */

typedef struct {
    const char *name;
    uint64_t hlen; /* UINT64_MAX: strlen(json) */
    const char *json;
    size_t dlen;
    const char *keyword; /* must also appear in the message */
} bad_case;

static void test_corrupt(void) {
    static const bad_case cases[] = {
        {"trunc_data", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8,
         "past the data buffer"},
        {"trunc_header", 100, "{\"a\":{\"dtype\":\"F32\",", 0, "past the end"},
        {"hlen_past_end", 1000, "{}      ", 0, "past the end"},
        {"hlen_huge", 0xffffffffffffff00ull, "{}      ", 0, "limit"},
        {"hlen_over_limit", 100000001ull, "{}      ", 0, "limit"},
        {"bad_json", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],", 4, "not valid JSON"},
        {"not_object", UINT64_MAX, "[1, 2]  ", 0, "not a JSON object"},
        {"trailing_junk", UINT64_MAX, "{}  x   ", 0, "trailing"},
        {"overlap", UINT64_MAX,
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, "overlap"},
        {"hole", UINT64_MAX,
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         12, "hole"},
        {"hole_at_start", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8,
         "hole"},
        {"trailing_data", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8,
         "after the last tensor"},
        {"data_no_tensors", UINT64_MAX, "{}      ", 4, "no tensors"},
        {"size_mismatch", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
         "need 12"},
        {"unknown_dtype", UINT64_MAX, "{\"a\":{\"dtype\":\"Q4\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
         "unknown dtype 'Q4'"},
        {"negative_shape", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
         "shape[0]"},
        {"fractional_shape", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4,
         "shape[0]"},
        {"string_shape", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]}}", 4,
         "'shape'"},
        {"too_many_dims", UINT64_MAX,
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, "9 dims"},
        {"numel_overflow", UINT64_MAX,
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,4]}}", 4, "overflow"},
        {"offset_beyond_2p53", UINT64_MAX,
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[18014398509481984,18014398509481984]}}", 0,
         "data_offsets"},
        {"begin_after_end", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,0]}}", 4,
         "begin 4 > end 0"},
        {"offsets_len3", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4,
         "data_offsets"},
        {"missing_dtype", UINT64_MAX, "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "'dtype'"},
        {"extra_field", UINT64_MAX,
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"x\":1}}", 4, "unknown field 'x'"},
        {"entry_not_object", UINT64_MAX, "{\"a\":7}", 0, "not a JSON object"},
        {"duplicate_name", UINT64_MAX,
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, "twice"},
        {"meta_not_string", UINT64_MAX, "{\"__metadata__\":{\"k\":1}}", 0, "'k'"},
        {"meta_not_object", UINT64_MAX, "{\"__metadata__\":[]}", 0, "__metadata__"},
        /* integers written as floats: the Rust reader's serde wants a usize ("expected usize") */
        {"float_shape", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.0],\"data_offsets\":[0,4]}}", 4,
         "shape[0] is written as a float (1.0)"},
        {"exponent_shape", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,1e0],\"data_offsets\":[0,8]}}", 8,
         "shape[1] is written as a float"},
        {"float_offset_end", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4.0]}}", 4,
         "data_offsets[1] is written as a float (4.0)"},
        {"float_offset_begin", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0.0,4]}}", 4,
         "data_offsets[0] is written as a float"},
        /* numbers outside JSON's grammar, which cJSON's strtod takes */
        {"leading_zero", UINT64_MAX, "{\"a\":{\"dtype\":\"F32\",\"shape\":[01],\"data_offsets\":[0,4]}}", 4,
         "invalid number at header byte 29"},
        /* ill-formed UTF-8 (the Rust reader's from_utf8 refuses the header) */
        {"bad_utf8_name", UINT64_MAX, "{\"a\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
         "invalid UTF-8: byte 0xff at header byte 3"},
        {"surrogate_name", UINT64_MAX, "{\"a\xed\xa0\x80\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
         "header byte 3"},
    };
    unsigned char data[64] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bad_case *c = &cases[i];
        char path[512];
        snprintf(path, sizeof path, "%s/bad_%s.safetensors", g_dir, c->name);
        write_raw(path, c->hlen, c->json, data, c->dlen);
        ct_err e = {0};
        st_file *f = st_open(path, &e);
        CHECK(f == NULL, "%s: corrupt file accepted", c->name);
        st_close(f);
        CHECK(e.code == CT_ERR_FORMAT, "%s: code %d", c->name, e.code);
        CHECK(strstr(e.msg, path) != NULL, "%s: message lacks the path: %s", c->name, e.msg);
        CHECK(strstr(e.msg, c->keyword) != NULL, "%s: message lacks '%s': %s", c->name, c->keyword, e.msg);
    }
    /* a file shorter than the length field */
    char path[512];
    path_of(path, sizeof path, "bad_short.safetensors");
    FILE *fp = fopen(path, "wb");
    fwrite("abcde", 1, 5, fp);
    fclose(fp);
    ct_err e = {0};
    CHECK(st_open(path, &e) == NULL, "5-byte file accepted");
    CHECK(strstr(e.msg, path) && strstr(e.msg, "too short"), "short: %s", e.msg);
    path_of(path, sizeof path, "does_not_exist.safetensors");
    CHECK(st_open(path, &e) == NULL && strstr(e.msg, path), "missing file: %s", e.msg);
    CHECK(st_open(g_dir, &e) == NULL && strstr(e.msg, g_dir), "directory as file: %s", e.msg);
}

/* ------------------------------------------------------------ sharded sets */

static void fill(float *x, int n, float base) {
    for (int i = 0; i < n; i++) x[i] = base + (float)i;
}

static void test_sharded(void) {
    char dir[512];
    path_of(dir, sizeof dir, "model/sub"); /* mkdir -p of two levels */
    float w0[10], w1[10], w2[10], w3[2];
    fill(w0, 10, 0), fill(w1, 10, 100), fill(w2, 10, 200), fill(w3, 2, 300);
    st_wtensor ts[] = {
        {"w0", CT_F32, CT_F32, 1, {10}, w0},
        {"w1", CT_F32, CT_F32, 2, {2, 5}, w1},
        {"w2", CT_F32, CT_F32, 1, {10}, w2},
        {"w3", CT_BF16, CT_F32, 1, {2}, w3},
    };
    const char *meta[] = {"format", "pt", NULL};
    ct_err e = {0};
    /* 40+40 fit in 80; 40+4 in the second shard */
    CHECK(st_write_dir(dir, ts, 4, 80, meta, &e) == 0, "sharded write: %s", e.msg);
    char p[700], s1[700], s2[700], single[700], idx[700];
    snprintf(s1, sizeof s1, "%s/model-00001-of-00002.safetensors", dir);
    snprintf(s2, sizeof s2, "%s/model-00002-of-00002.safetensors", dir);
    snprintf(single, sizeof single, "%s/model.safetensors", dir);
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", dir);
    CHECK(exists(s1) && exists(s2) && exists(idx) && !exists(single), "shard files");
    size_t len;
    char *txt = (char *)read_all(idx, &len);
    cJSON *j = txt ? cJSON_Parse(txt) : NULL;
    CHECK(j != NULL, "index is JSON");
    if (j) {
        const cJSON *tsz = cJSON_GetObjectItem(cJSON_GetObjectItem(j, "metadata"), "total_size");
        CHECK(cJSON_IsNumber(tsz) && tsz->valuedouble == 124, "total_size");
        const cJSON *wm = cJSON_GetObjectItem(j, "weight_map");
        CHECK(cJSON_GetArraySize(wm) == 4, "weight_map size");
        const cJSON *x = cJSON_GetObjectItem(wm, "w1"), *y = cJSON_GetObjectItem(wm, "w2");
        CHECK(cJSON_IsString(x) && strcmp(x->valuestring, "model-00001-of-00002.safetensors") == 0, "w1 shard");
        CHECK(cJSON_IsString(y) && strcmp(y->valuestring, "model-00002-of-00002.safetensors") == 0, "w2 shard");
    }
    cJSON_Delete(j);
    free(txt);

    st_set *s = st_set_open(dir, &e);
    CHECK(s != NULL, "st_set_open: %s", e.msg);
    if (s) {
        CHECK(st_set_count(s) == 4, "set count");
        for (int i = 0; i < 4; i++)
            CHECK(st_set_get(s, i) && strcmp(st_set_get(s, i)->name, ts[i].name) == 0, "set order %d", i);
        const char *file = NULL;
        const st_tensor *t = st_set_find(s, "w2", &file);
        CHECK(t && file && strcmp(file, s2) == 0, "w2 in shard 2: %s", file ? file : "(null)");
        float v = 0;
        if (t) memcpy(&v, (const char *)t->data + 4 * 9, 4);
        CHECK(v == 209.0f, "w2[9] = %g", v);
        t = st_set_find(s, "w3", NULL);
        CHECK(t && t->dtype == CT_BF16 && rd16((const char *)t->data + 2) == 0x4396, "w3 bf16 (301 is a tie -> even 4396 = 300)");
        CHECK(st_set_find(s, "w9", NULL) == NULL, "absent");
        st_close(NULL);
        st_set_close(s);
    }

    /* a tensor larger than the limit gets a shard of its own: 4 shards */
    CHECK(st_write_dir(dir, ts, 4, 30, meta, &e) == 0, "4-shard write: %s", e.msg);
    snprintf(p, sizeof p, "%s/model-00004-of-00004.safetensors", dir);
    CHECK(exists(p) && !exists(s1) && !exists(s2), "old 2-shard files replaced by 4 shards");
    s = st_set_open(dir, &e);
    CHECK(s && st_set_count(s) == 4, "4-shard set: %s", e.msg);
    st_set_close(s);

    /* unsharded over the sharded dir: index and shards go away */
    CHECK(st_write_dir(dir, ts, 4, 0, meta, &e) == 0, "single write: %s", e.msg);
    CHECK(exists(single) && !exists(idx) && !exists(p), "single file replaces shards");
    s = st_set_open(dir, &e);
    CHECK(s && st_set_count(s) == 4, "single set: %s", e.msg);
    if (s) {
        const char *file = NULL;
        CHECK(st_set_find(s, "w0", &file) && file && strcmp(file, single) == 0, "w0 in model.safetensors");
    }
    st_set_close(s);

    /* and back: sharded again removes model.safetensors */
    CHECK(st_write_dir(dir, ts, 4, 80, meta, &e) == 0, "sharded again: %s", e.msg);
    CHECK(!exists(single) && exists(idx), "stale model.safetensors removed");

    /* an empty directory names itself */
    char empty[512];
    path_of(empty, sizeof empty, "emptydir");
    mkdir(empty, 0755);
    CHECK(st_set_open(empty, &e) == NULL && strstr(e.msg, empty), "empty dir: %s", e.msg);
}

/* Builds DIR with shard files and an index written by hand. */
static void write_tensor_file(const char *path, const char *const *names, int n) {
    char json[1024] = "{";
    for (int i = 0; i < n; i++) {
        char ent[200];
        snprintf(ent, sizeof ent, "%s\"%s\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[%d,%d]}",
                 i ? "," : "", names[i], 4 * i, 4 * i + 4);
        strcat(json, ent);
    }
    strcat(json, "}");
    unsigned char data[64] = {0};
    write_raw(path, UINT64_MAX, json, data, (size_t)n * 4);
}

static void bad_set(const char *name, const char *index, const char *keyword) {
    char dir[512], p[700];
    snprintf(dir, sizeof dir, "%s/set_%s", g_dir, name);
    mkdir(dir, 0755);
    const char *s1[] = {"x", "y"}, *s2[] = {"z"};
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    write_tensor_file(p, s1, 2);
    snprintf(p, sizeof p, "%s/b.safetensors", dir);
    write_tensor_file(p, s2, 1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *fp = fopen(p, "w");
    fputs(index, fp);
    fclose(fp);
    ct_err e = {0};
    st_set *s = st_set_open(dir, &e);
    CHECK(s == NULL, "%s: bad set accepted", name);
    st_set_close(s);
    CHECK(strstr(e.msg, keyword) != NULL, "%s: message lacks '%s': %s", name, keyword, e.msg);
    CHECK(strstr(e.msg, dir) != NULL, "%s: message lacks the directory: %s", name, e.msg);
}

static void test_bad_sets(void) {
    /* the good one first, so the failures below are about what they change */
    char dir[512], p[700];
    snprintf(dir, sizeof dir, "%s/set_good", g_dir);
    mkdir(dir, 0755);
    const char *s1[] = {"x", "y"}, *s2[] = {"z"};
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    write_tensor_file(p, s1, 2);
    snprintf(p, sizeof p, "%s/b.safetensors", dir);
    write_tensor_file(p, s2, 1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    FILE *fp = fopen(p, "w");
    fputs("{\"weight_map\": {\"x\": \"a.safetensors\", \"z\": \"b.safetensors\", \"y\": \"a.safetensors\"}}", fp);
    fclose(fp);
    ct_err e = {0};
    st_set *s = st_set_open(dir, &e);
    CHECK(s && st_set_count(s) == 3, "hand-made index: %s", e.msg);
    st_set_close(s);

    bad_set("missing_shard", "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\", "
                             "\"z\": \"c.safetensors\"}}",
            "c.safetensors");
    bad_set("missing_tensor", "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\", "
                              "\"z\": \"b.safetensors\", \"w\": \"b.safetensors\"}}",
            "'w'");
    bad_set("unlisted_tensor", "{\"weight_map\": {\"x\": \"a.safetensors\", \"z\": \"b.safetensors\"}}", "'y'");
    bad_set("wrong_shard", "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"b.safetensors\", "
                           "\"z\": \"b.safetensors\"}}",
            "'y'");
    bad_set("path_escape", "{\"weight_map\": {\"x\": \"../a.safetensors\"}}", "plain file name");
    bad_set("slash", "{\"weight_map\": {\"x\": \"sub/a.safetensors\"}}", "plain file name");
    bad_set("no_weight_map", "{\"metadata\": {}}", "weight_map");
    bad_set("bad_json", "{\"weight_map\": {", "JSON");
    bad_set("dup_key", "{\"weight_map\": {\"x\": \"a.safetensors\", \"x\": \"a.safetensors\", "
                       "\"y\": \"a.safetensors\", \"z\": \"b.safetensors\"}}",
            "duplicate key \"x\""); /* json_parse's check, before weight_map's own ("twice") */

    /* the same tensor in two shards */
    snprintf(dir, sizeof dir, "%s/set_dup", g_dir);
    mkdir(dir, 0755);
    const char *d1[] = {"x", "y"}, *d2[] = {"y"};
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    write_tensor_file(p, d1, 2);
    snprintf(p, sizeof p, "%s/b.safetensors", dir);
    write_tensor_file(p, d2, 1);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    fp = fopen(p, "w");
    fputs("{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"b.safetensors\"}}", fp);
    fclose(fp);
    s = st_set_open(dir, &e);
    CHECK(s == NULL, "tensor in two shards accepted");
    st_set_close(s);
    CHECK(strstr(e.msg, "'y'") && strstr(e.msg, "two shards"), "two shards: %s", e.msg);

    /* a corrupt shard names the shard file */
    snprintf(dir, sizeof dir, "%s/set_corrupt_shard", g_dir);
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/a.safetensors", dir);
    write_raw(p, 500, "{}", NULL, 0);
    char shard[700];
    snprintf(shard, sizeof shard, "%s", p);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    fp = fopen(p, "w");
    fputs("{\"weight_map\": {\"x\": \"a.safetensors\"}}", fp);
    fclose(fp);
    s = st_set_open(dir, &e);
    CHECK(s == NULL && strstr(e.msg, shard), "corrupt shard: %s", e.msg);
    st_set_close(s);
}

/* ----------------------------------------------------------- write errors */

static void test_write_errors(void) {
    float x[4] = {0};
    int32_t iv[2] = {0};
    ct_err e = {0};
    char path[512];
    path_of(path, sizeof path, "werr.safetensors");
    st_wtensor dup[] = {{"a", CT_F32, CT_F32, 1, {4}, x}, {"a", CT_F32, CT_F32, 1, {4}, x}};
    CHECK(st_write(path, dup, 2, NULL, &e) != 0 && strstr(e.msg, "'a'") && strstr(e.msg, path),
          "duplicate: %s", e.msg);
    st_wtensor conv[] = {{"i", CT_BF16, CT_I32, 1, {2}, iv}};
    CHECK(st_write(path, conv, 1, NULL, &e) != 0 && strstr(e.msg, "'i'"), "I32->BF16: %s", e.msg);
    st_wtensor neg[] = {{"n", CT_F32, CT_F32, 1, {-1}, x}};
    CHECK(st_write(path, neg, 1, NULL, &e) != 0 && strstr(e.msg, "'n'"), "negative shape: %s", e.msg);
    st_wtensor reserved[] = {{"__metadata__", CT_F32, CT_F32, 1, {1}, x}};
    CHECK(st_write(path, reserved, 1, NULL, &e) != 0, "reserved name accepted");
    CHECK(!exists(path), "nothing written on validation errors");

    char nodir[512];
    path_of(nodir, sizeof nodir, "no/such/dir/x.safetensors");
    st_wtensor ok[] = {{"a", CT_F32, CT_F32, 1, {4}, x}};
    CHECK(st_write(nodir, ok, 1, NULL, &e) != 0 && strstr(e.msg, nodir), "missing dir: %s", e.msg);

    /* A full disk, simulated with a file size limit: the write must fail,
     * name the path, and leave neither the file nor its .tmp. */
    size_t big_n = 1 << 20;
    float *big = calloc(big_n, sizeof *big);
    st_wtensor bt[] = {{"big", CT_BF16, CT_F32, 1, {(int64_t)big_n}, big}};
    struct rlimit old;
    getrlimit(RLIMIT_FSIZE, &old);
    struct rlimit lim = {64 * 1024, old.rlim_max};
    signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &lim);
    path_of(path, sizeof path, "full.safetensors");
    int rc = st_write(path, bt, 1, NULL, &e);
    setrlimit(RLIMIT_FSIZE, &old);
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    CHECK(rc != 0 && strstr(e.msg, path), "disk full not reported: %s", e.msg);
    CHECK(!exists(path) && !exists(tmp), "partial files left after a failed write");
    char dir[512];
    path_of(dir, sizeof dir, "fulldir");
    setrlimit(RLIMIT_FSIZE, &lim);
    rc = st_write_dir(dir, bt, 1, 0, NULL, &e);
    setrlimit(RLIMIT_FSIZE, &old);
    CHECK(rc != 0 && strstr(e.msg, dir), "dir write on full disk: %s", e.msg);
    free(big);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ctitan_st_XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_roundtrip();
    test_handmade_valid();
    test_corrupt();
    test_sharded();
    test_bad_sets();
    test_write_errors();
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return CHECK_DONE();
}
