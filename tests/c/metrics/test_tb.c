/* tests/c/metrics/test_tb.c: the tfevents pieces against numbers from outside ctitan:
 * CRC-32C's published check value (0xE3069283 for "123456789", RFC 3720's
 * iSCSI test vectors for 32 zero bytes), the record framing read back byte by
 * byte as the format describes it, and a file from tb_open whose records all
 * verify. What TensorBoard makes of a whole run is tests/py/test_tensorboard.py. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"
#include "metrics/tb.h"

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static uint32_t mask(uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

static void test_crc(void) {
    CHECK(tb_crc32c("123456789", 9) == 0xE3069283u, "crc32c check value: %08x", tb_crc32c("123456789", 9));
    uint8_t z[32] = {0}, ff[32];
    memset(ff, 0xff, sizeof ff);
    CHECK(tb_crc32c(z, 32) == 0x8A9136AAu, "32 zeros: %08x", tb_crc32c(z, 32));
    CHECK(tb_crc32c(ff, 32) == 0x62A8AB43u, "32 0xff: %08x", tb_crc32c(ff, 32));
    CHECK(tb_crc32c("", 0) == 0, "empty");
    CHECK(tb_mask_crc(0xE3069283u) == mask(0xE3069283u), "mask");
}

static void test_frame(void) {
    const char *msg = "hello tfevents";
    size_t n = strlen(msg);
    uint8_t rec[64];
    tb_frame(msg, n, rec);
    CHECK(le(rec, 8) == n, "length field");
    CHECK(le(rec + 8, 4) == mask(tb_crc32c(rec, 8)), "length crc");
    CHECK(memcmp(rec + 12, msg, n) == 0, "data");
    CHECK(le(rec + 12 + n, 4) == mask(tb_crc32c(msg, n)), "data crc");
    rec[12] ^= 1; /* a flipped data byte no longer matches its stored CRC */
    CHECK(le(rec + 12 + n, 4) != mask(tb_crc32c(rec + 12, n)), "corruption detected");
}

/* Walks a written file record by record: every CRC verifies, nothing trails. */
static void test_file(void) {
    char dir[] = "/tmp/ct_tb_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    ct_err e = {0};
    tb_writer *w = tb_open(dir, 4, &e);
    CHECK(w != NULL, "tb_open: %s", e.msg);
    if (!w) return;
    char path[4200];
    snprintf(path, sizeof path, "%s", tb_path(w));
    CHECK(strstr(path, "/events.out.tfevents.") != NULL, "name: %s", path);
    tb_scalar(w, 4, "loss", 2.5);
    tb_scalar(w, 5, "loss", 2.25);
    CHECK(tb_close(w) == 0, "close");
    /* a second writer in the same second must sort after the first */
    tb_writer *w2 = tb_open(dir, 6, &e);
    CHECK(w2 && strcmp(tb_path(w2), path) > 0, "second file sorts later: %s", w2 ? tb_path(w2) : e.msg);
    tb_close(w2);

    FILE *f = fopen(path, "rb");
    CHECK(f != NULL, "reopen");
    if (!f) return;
    uint8_t buf[4096];
    size_t got = fread(buf, 1, sizeof buf, f), off = 0;
    fclose(f);
    int records = 0;
    while (off + 12 <= got) {
        uint64_t n = le(buf + off, 8);
        CHECK(le(buf + off + 8, 4) == mask(tb_crc32c(buf + off, 8)), "record %d length crc", records);
        if (off + 16 + n > got) break;
        CHECK(le(buf + off + 12 + n, 4) == mask(tb_crc32c(buf + off + 12, n)), "record %d data crc", records);
        off += 16 + n;
        records++;
    }
    CHECK(off == got, "no trailing bytes: %zu of %zu", off, got);
    CHECK(records == 4, "version, START, 2 scalars: %d records", records);
    /* the first event carries file_version: field 3, wire type 2 (0x1a), "brain.Event:2" */
    CHECK(got > 12 && memmem(buf + 12, le(buf, 8), "\x1a\x0d" "brain.Event:2", 15) != NULL, "file_version");
    ct_rm_tree(dir, NULL);
}

int main(void) {
    test_crc();
    test_frame();
    test_file();
    return CHECK_DONE();
}
