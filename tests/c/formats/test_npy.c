/* tests/c/formats/test_npy.c: .npy reader on files whose bytes are written here by
 * hand, following the published format (magic, version, LE header length,
 * Python-dict header padded to 64 bytes and ending in '\n', raw data), and on
 * corrupt variants that must fail with a message naming the file. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "formats/npy.h"

static char g_dir[256];
static int g_seq;

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* Writes an .npy file: version major.0, `dict` padded with spaces so the
 * preamble + header is a multiple of 64, then '\n', then `dlen` data bytes.
 * pad < 0 writes the dict exactly as given (no padding, no newline). */
static const char *make_npy(char *path, size_t cap, int major, const char *dict, const void *data, size_t dlen,
                            int pad) {
    snprintf(path, cap, "%s/f%03d.npy", g_dir, g_seq++);
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        perror(path);
        exit(1);
    }
    size_t pre = major == 1 ? 10 : 12;
    size_t hl = strlen(dict);
    size_t total = hl;
    if (pad >= 0) {
        total = hl + 1;
        while ((pre + total) % 64) total++;
    }
    unsigned char h[12] = {0x93, 'N', 'U', 'M', 'P', 'Y', (unsigned char)major, 0};
    for (size_t i = 0; i < pre - 8; i++) h[8 + i] = (unsigned char)(total >> (8 * i));
    fwrite(h, 1, pre, fp);
    fwrite(dict, 1, hl, fp);
    for (size_t i = hl; pad >= 0 && i + 1 < total; i++) fputc(' ', fp);
    if (pad >= 0) fputc('\n', fp);
    if (dlen) fwrite(data, 1, dlen, fp);
    fclose(fp);
    return path;
}

static void test_valid(void) {
    char p[512];
    uint32_t *v = NULL;
    size_t n = 0;
    ct_err e = {0};

    /* <i4, 1-D, v1.0: 1, 2, 70000 as little-endian bytes */
    unsigned char i4[] = {1, 0, 0, 0, 2, 0, 0, 0, 0x70, 0x11, 0x01, 0x00};
    make_npy(p, sizeof p, 1, "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }", i4, sizeof i4, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0, "<i4: %s", e.msg);
    CHECK(n == 3 && v && v[0] == 1 && v[1] == 2 && v[2] == 70000, "<i4 values");
    free(v);

    /* <u2, 2-D (2, 3) */
    unsigned char u2[] = {1, 0, 2, 0, 3, 0, 0xff, 0xff, 0, 1, 6, 0};
    make_npy(p, sizeof p, 1, "{'descr': '<u2', 'fortran_order': False, 'shape': (2, 3), }", u2, sizeof u2, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0, "<u2: %s", e.msg);
    CHECK(n == 6 && v && v[3] == 65535 && v[4] == 256 && v[5] == 6, "<u2 values");
    free(v);

    /* |u1 0-d scalar */
    unsigned char u1 = 200;
    make_npy(p, sizeof p, 1, "{'descr': '|u1', 'fortran_order': False, 'shape': (), }", &u1, 1, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0, "|u1 scalar: %s", e.msg);
    CHECK(n == 1 && v && v[0] == 200, "|u1 scalar value");
    free(v);

    /* |i1 */
    unsigned char i1[] = {127, 0};
    make_npy(p, sizeof p, 1, "{'descr': '|i1', 'fortran_order': False, 'shape': (2,), }", i1, 2, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == 2 && v[0] == 127 && v[1] == 0, "|i1: %s", e.msg);
    free(v);

    /* <i8 with the largest uint32, version 2.0 (4-byte header length) */
    unsigned char i8[] = {5, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0};
    make_npy(p, sizeof p, 2, "{'descr': '<i8', 'fortran_order': False, 'shape': (2,), }", i8, sizeof i8, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == 2 && v[0] == 5 && v[1] == 4294967295u, "v2 <i8: %s", e.msg);
    free(v);

    /* =u4, version 3.0, double quotes, keys in another order, no trailing comma */
    unsigned char u4[] = {0x78, 0x56, 0x34, 0x12};
    make_npy(p, sizeof p, 3, "{\"shape\": (1,), \"fortran_order\": False, \"descr\": \"=u4\"}", u4, 4, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == 1 && v[0] == 0x12345678u, "v3 =u4: %s", e.msg);
    free(v);

    /* <u8 */
    unsigned char u8[] = {9, 0, 0, 0, 0, 0, 0, 0};
    make_npy(p, sizeof p, 1, "{'descr': '<u8', 'fortran_order': False, 'shape': (1, 1, 1), }", u8, 8, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == 1 && v[0] == 9, "<u8 3-D: %s", e.msg);
    free(v);

    /* <i2 with positive values past 127 */
    unsigned char i2[] = {0xff, 0x7f, 0x80, 0x00};
    make_npy(p, sizeof p, 1, "{'descr': '<i2', 'fortran_order': False, 'shape': (2,), }", i2, 4, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == 2 && v[0] == 32767 && v[1] == 128, "<i2: %s", e.msg);
    free(v);

    /* empty array */
    make_npy(p, sizeof p, 1, "{'descr': '<i4', 'fortran_order': False, 'shape': (0,), }", NULL, 0, 0);
    v = NULL;
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == 0 && v != NULL, "empty: %s", e.msg);
    free(v);

    /* a header of numpy's old 16-byte alignment, unpadded to 64 */
    make_npy(p, sizeof p, 1, "{'descr': '<u4', 'fortran_order': False, 'shape': (1,), }    \n", u4, 4, -1);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == 1 && v[0] == 0x12345678u, "unpadded: %s", e.msg);
    free(v);

    /* many elements, crossing the reader's chunk size */
    size_t big = 40000;
    uint16_t *bd = malloc(big * 2);
    for (size_t i = 0; i < big; i++) bd[i] = (uint16_t)(i * 7);
    make_npy(p, sizeof p, 1, "{'descr': '<u2', 'fortran_order': False, 'shape': (40000,), }", bd, big * 2, 0);
    CHECK(npy_read_u32(p, &v, &n, &e) == 0 && n == big, "big: %s", e.msg);
    int okv = 1;
    for (size_t i = 0; v && i < big; i++) okv &= v[i] == (uint16_t)(i * 7);
    CHECK(okv, "big values");
    free(v);
    free(bd);
}

typedef struct {
    int major;
    const char *dict;
    const unsigned char *data;
    size_t dlen;
    const char *keyword;
} bad_npy;

static void test_corrupt(void) {
    static const unsigned char d4[8] = {1, 0, 0, 0, 2, 0, 0, 0};
    static const unsigned char neg2[6] = {1, 0, 2, 0, 0xfd, 0xff};         /* <i2: 1, 2, -3 */
    static const unsigned char big8[16] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0}; /* 0, 2^32 */
    static const unsigned char negi1[2] = {0, 0xff};
    static const bad_npy cases[] = {
        {1, "{'descr': '>i4', 'fortran_order': False, 'shape': (2,), }", d4, 8, "big-endian"},
        {1, "{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", d4, 8, "not an integer"},
        {1, "{'descr': '<i3', 'fortran_order': False, 'shape': (2,), }", d4, 8, "size"},
        {1, "{'descr': 'i4', 'fortran_order': False, 'shape': (2,), }", d4, 8, "byte-order"},
        {1, "{'descr': '<i4', 'fortran_order': True, 'shape': (2,), }", d4, 8, "fortran"},
        {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (3,), }", d4, 8, "truncated"},
        {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (1,), }", d4, 8, "trailing"},
        {1, "{'descr': '<i4', 'fortran_order': False, }", d4, 8, "'shape'"},
        {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,), 'x': 1}", d4, 8, "'x'"},
        {1, "{'descr': '<i4', 'descr': '<i4', 'fortran_order': False, 'shape': (2,)}", d4, 8, "twice"},
        {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2)}", d4, 8, "'shape'"},
        {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (-2,)}", d4, 8, "'shape'"},
        {1, "{'descr': '<i4', 'fortran_order': 0, 'shape': (2,)}", d4, 8, "fortran_order"},
        {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (2,)} junk", d4, 8, "after the dict"},
        {1, "['descr', '<i4']", d4, 8, "dict"},
        {1, "{'descr': '<i4' 'fortran_order': False, 'shape': (2,)}", d4, 8, "expected"},
        {1, "{'descr': '<i4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 4294967296)}", d4, 8,
         "overflow"},
        {1, "{'descr': '<i2', 'fortran_order': False, 'shape': (3,), }", neg2, 6, "element 2 is -3"},
        {1, "{'descr': '<u8', 'fortran_order': False, 'shape': (2,), }", big8, 16, "element 1 is 4294967296"},
        {1, "{'descr': '|i1', 'fortran_order': False, 'shape': (2,), }", negi1, 2, "element 1 is -1"},
    };
    char p[512];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const bad_npy *c = &cases[i];
        make_npy(p, sizeof p, c->major, c->dict, c->data, c->dlen, 0);
        uint32_t *v = (uint32_t *)&g_seq; /* must come back NULL */
        size_t n = 99;
        ct_err e = {0};
        int rc = npy_read_u32(p, &v, &n, &e);
        CHECK(rc != 0 && v == NULL && n == 0, "case %zu accepted: %s", i, c->dict);
        CHECK(strstr(e.msg, p) != NULL, "case %zu: message lacks the path: %s", i, e.msg);
        CHECK(strstr(e.msg, c->keyword) != NULL, "case %zu: message lacks '%s': %s", i, c->keyword, e.msg);
    }

    /* byte-level damage to the preamble */
    struct {
        const char *bytes;
        size_t len;
        const char *keyword;
    } raw[] = {
#define RAW(s, kw) {s, sizeof(s) - 1, kw}
        RAW("\x93NUMPZ\x01\x00\x10\x00{}", "magic"),
        RAW("\x93NUMPY\x04\x00\x10\x00{}", "version"),
        RAW("\x93NUMPY\x01\x01\x10\x00{}", "version"),
        RAW("\x93NUMPY\x01\x00\xff\x00{}", "header length"),
        RAW("\x93NUMPY\x02\x00\xff\xff\xff\xff{}", "header length"),
        RAW("\x93NUMPY\x01", "too short"),
        RAW("\x93NUMPY\x02\x00\x01\x00", "too short"),
        RAW("\x93NUMPY\x01\x00\x04\x00{\0}\n", "NUL"),
#undef RAW
    };
    for (size_t i = 0; i < sizeof raw / sizeof raw[0]; i++) {
        snprintf(p, sizeof p, "%s/raw%zu.npy", g_dir, i);
        FILE *fp = fopen(p, "wb");
        fwrite(raw[i].bytes, 1, raw[i].len, fp);
        fclose(fp);
        uint32_t *v = NULL;
        size_t n = 0;
        ct_err e = {0};
        CHECK(npy_read_u32(p, &v, &n, &e) != 0 && v == NULL, "raw case %zu accepted", i);
        CHECK(strstr(e.msg, p) && strstr(e.msg, raw[i].keyword), "raw case %zu: %s", i, e.msg);
    }
    uint32_t *v = NULL;
    size_t n = 0;
    ct_err e = {0};
    snprintf(p, sizeof p, "%s/missing.npy", g_dir);
    CHECK(npy_read_u32(p, &v, &n, &e) != 0 && strstr(e.msg, p), "missing file: %s", e.msg);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ctitan_npy_XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_valid();
    test_corrupt();
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return CHECK_DONE();
}
