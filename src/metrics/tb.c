/* metrics/tb.c: see tb.h. The protobuf encoding is the wire format's
 * smallest subset: varint keys, varints, fixed 32/64-bit and length-delimited
 * fields, enough for Event, Summary, Summary.Value and SessionLog. Field
 * numbers are those of tensorboard/compat/proto/event.proto and summary.proto
 * (checked against the descriptors of tensorboard 2.21's Python package). */
#include "metrics/tb.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/fs.h"

struct tb_writer {
    FILE *f;
    int failed;
    char path[4096];
};

/* Table-less bitwise CRC: the bytes here are a few hundred per logged step. */
uint32_t tb_crc32c(const void *data, size_t n) {
    const uint8_t *p = data;
    uint32_t crc = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        crc ^= p[i];
        for (int b = 0; b < 8; b++) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

uint32_t tb_mask_crc(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

static void put_le(uint8_t *out, uint64_t v, int bytes) {
    for (int i = 0; i < bytes; i++) out[i] = (uint8_t)(v >> (8 * i));
}

void tb_frame(const void *data, size_t n, uint8_t *out) {
    put_le(out, n, 8);
    put_le(out + 8, tb_mask_crc(tb_crc32c(out, 8)), 4);
    memcpy(out + 12, data, n);
    put_le(out + 12 + n, tb_mask_crc(tb_crc32c(data, n)), 4);
}

/* A bounded output buffer: the messages here are a tag and a few numbers,
 * so a fixed size with an overflow flag is simpler than growing. */
typedef struct {
    uint8_t b[1024];
    size_t n;
    int over;
} pb_buf;

static void pb_bytes(pb_buf *o, const void *p, size_t n) {
    if (o->n + n > sizeof o->b) {
        o->over = 1;
        return;
    }
    memcpy(o->b + o->n, p, n);
    o->n += n;
}

static void pb_varint(pb_buf *o, uint64_t v) {
    uint8_t t[10];
    size_t k = 0;
    do {
        t[k++] = (uint8_t)((v & 0x7F) | (v > 0x7F ? 0x80 : 0));
        v >>= 7;
    } while (v);
    pb_bytes(o, t, k);
}

static void pb_key(pb_buf *o, int field, int wire) { pb_varint(o, (uint64_t)field << 3 | (uint64_t)wire); }

static void pb_len(pb_buf *o, int field, const void *p, size_t n) {
    pb_key(o, field, 2);
    pb_varint(o, n);
    pb_bytes(o, p, n);
}

static void pb_double(pb_buf *o, int field, double v) {
    uint64_t u;
    uint8_t t[8];
    memcpy(&u, &v, 8);
    put_le(t, u, 8);
    pb_key(o, field, 1);
    pb_bytes(o, t, 8);
}

static void pb_float(pb_buf *o, int field, float v) {
    uint32_t u;
    uint8_t t[4];
    memcpy(&u, &v, 4);
    put_le(t, u, 4);
    pb_key(o, field, 5);
    pb_bytes(o, t, 4);
}

static double wall_time(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Event{wall_time = 1, step = 2} + the caller's body fields. */
static void event_head(pb_buf *o, int64_t step) {
    pb_double(o, 1, wall_time());
    pb_key(o, 2, 0);
    pb_varint(o, (uint64_t)step); /* int64: negative steps take 10 bytes, as protobuf's own */
}

static void write_event(tb_writer *w, const pb_buf *ev) {
    if (!w->f || w->failed) return;
    if (ev->over) { /* a tag too long to encode: drop the event, not the file */
        fprintf(stderr, "ctitan: tensorboard: event too large, skipped\n");
        return;
    }
    uint8_t rec[sizeof ev->b + 16];
    tb_frame(ev->b, ev->n, rec);
    if (fwrite(rec, 1, ev->n + 16, w->f) != ev->n + 16) w->failed = 1;
}

/* The largest unix-seconds field among DIR's events files, so a restart in
 * the same second (or after a clock step back) still sorts after them. */
static long long newest_stamp(const char *dir) {
    long long best = 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    const char *pre = "events.out.tfevents.";
    struct dirent *de;
    while ((de = readdir(d))) {
        if (strncmp(de->d_name, pre, strlen(pre))) continue;
        long long s = strtoll(de->d_name + strlen(pre), NULL, 10);
        if (s > best) best = s;
    }
    closedir(d);
    return best;
}

tb_writer *tb_open(const char *dir, int64_t first_step, ct_err *e) {
    if (ct_mkdirs(dir, e)) return NULL;
    long long stamp = (long long)time(NULL), prev = newest_stamp(dir);
    if (stamp <= prev) stamp = prev + 1;
    char host[256] = "localhost";
    gethostname(host, sizeof host - 1);
    host[sizeof host - 1] = 0;
    tb_writer *w = calloc(1, sizeof *w);
    if (!w) {
        ct_fail(e, CT_ERR_IO, "out of memory");
        return NULL;
    }
    /* TensorBoard only looks for "tfevents" in the name; the rest is TensorFlow's
     * convention (the trailing counter is TF's per-process writer number) */
    int len = snprintf(w->path, sizeof w->path, "%s/events.out.tfevents.%010lld.%s.%d.0", dir, stamp, host,
                       (int)getpid());
    if (len < 0 || (size_t)len >= sizeof w->path) {
        free(w);
        ct_fail(e, CT_ERR_IO, "%s: path too long for a tensorboard file", dir);
        return NULL;
    }
    w->f = fopen(w->path, "wbx"); /* x: never append to another writer's file */
    if (!w->f) {
        ct_fail(e, CT_ERR_IO, "%s: cannot create (%s) (metrics.save_tb_folder)", w->path, strerror(errno));
        free(w);
        return NULL;
    }
    pb_buf ev = {.n = 0};
    event_head(&ev, 0);
    pb_len(&ev, 3, "brain.Event:2", 13);
    write_event(w, &ev);
    /* SessionLog{status = START (1)} as Event field 7 */
    pb_buf sl = {.n = 0};
    pb_key(&sl, 1, 0);
    pb_varint(&sl, 1);
    ev.n = 0;
    event_head(&ev, first_step);
    pb_len(&ev, 7, sl.b, sl.n);
    write_event(w, &ev);
    if (tb_flush(w)) {
        ct_fail(e, CT_ERR_IO, "%s: write failed", w->path);
        tb_close(w);
        return NULL;
    }
    return w;
}

void tb_scalar(tb_writer *w, int64_t step, const char *tag, double value) {
    if (!w) return;
    pb_buf val = {.n = 0}, sum = {.n = 0}, ev = {.n = 0};
    pb_len(&val, 1, tag, strlen(tag));
    pb_float(&val, 2, (float)value);
    pb_len(&sum, 1, val.b, val.n);
    event_head(&ev, step);
    pb_len(&ev, 5, sum.b, sum.n);
    ev.over |= val.over | sum.over;
    write_event(w, &ev);
}

int tb_flush(tb_writer *w) {
    if (!w || !w->f) return 0;
    if (fflush(w->f)) w->failed = 1;
    return w->failed ? -1 : 0;
}

int tb_close(tb_writer *w) {
    if (!w) return 0;
    int rc = tb_flush(w);
    if (w->f && fclose(w->f)) rc = -1;
    free(w);
    return rc;
}

const char *tb_path(const tb_writer *w) { return w ? w->path : ""; }
