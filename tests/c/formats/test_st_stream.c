/* tests/c/formats/test_st_stream.c: the streamed writers (st_stream, st_dir_stream,
 * ckpt_stream) against the whole-buffer ones they stand in for.
 *
 * A distributed save hands its data over one layer at a time; the files must
 * not show it. So every case writes the same tensors twice, once whole
 * (st_write, st_write_dir, ckpt_save) and once in pieces of awkward sizes
 * that cross tensor and shard boundaries, and compares the files byte for
 * byte; the errors (too much data, too little, mixed element sizes) must be
 * reported and leave no file under the final name. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dirent.h>
#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "checkpoint/ckpt.h"
#include "formats/safetensors.h"
#include "model/lm.h"

static char g_dir[256];

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static unsigned char *read_all(const char *p, size_t *len) {
    FILE *f = fopen(p, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    *len = fread(b, 1, (size_t)n, f);
    fclose(f);
    return b;
}

/* 1 when files a and b hold the same bytes. */
static int same_file(const char *a, const char *b) {
    size_t la = 0, lb = 0;
    unsigned char *x = read_all(a, &la), *y = read_all(b, &lb);
    int same = x && y && la == lb && memcmp(x, y, la) == 0;
    free(x);
    free(y);
    return same;
}

/* Every entry of dir a is in dir b with the same bytes, and both hold as many. */
static int same_dir(const char *a, const char *b) {
    int na = 0, nb = 0, ok = 1;
    DIR *d = opendir(a);
    struct dirent *de;
    char pa[1024], pb[1024];
    while (d && (de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        na++;
        snprintf(pa, sizeof pa, "%s/%s", a, de->d_name);
        snprintf(pb, sizeof pb, "%s/%s", b, de->d_name);
        if (!same_file(pa, pb)) {
            fprintf(stderr, "differs: %s vs %s\n", pa, pb);
            ok = 0;
        }
    }
    if (d) closedir(d);
    d = opendir(b);
    while (d && (de = readdir(d))) nb += de->d_name[0] != '.';
    if (d) closedir(d);
    return ok && na == nb && na > 0;
}

static void fill(float *x, int n, float base) {
    for (int i = 0; i < n; i++) x[i] = base + 0.37f * (float)i;
}

/* Mixed element sizes in one file: data order is the 4-byte tensors, then the
 * 2-byte one (st_write's rule), whatever the header order. */
static void test_stream_file(void) {
    float a[10], b[3], c[5];
    fill(a, 10, 1), fill(b, 3, 300), fill(c, 5, -7);
    st_wtensor ts[] = {
        {"a", CT_F32, CT_F32, 2, {2, 5}, a},
        {"b", CT_BF16, CT_F32, 1, {3}, b},
        {"c", CT_F32, CT_F32, 1, {5}, c},
        {"empty", CT_F32, CT_F32, 1, {0}, NULL},
    };
    const char *meta[] = {"format", "pt", NULL};
    char whole[400], streamed[400];
    snprintf(whole, sizeof whole, "%s/whole.safetensors", g_dir);
    snprintf(streamed, sizeof streamed, "%s/streamed.safetensors", g_dir);
    ct_err e = {0};
    CHECK(st_write(whole, ts, 4, meta, &e) == 0, "st_write: %s", e.msg);
    float ac[15];
    memcpy(ac, a, sizeof a);
    memcpy(ac + 10, c, sizeof c);
    st_stream *s = NULL;
    CHECK(st_stream_open(&s, streamed, ts, 4, meta, &e) == 0, "open: %s", e.msg);
    if (!s) return;
    CHECK(st_stream_write(s, ac, 7, &e) == 0, "write 7: %s", e.msg);
    CHECK(st_stream_write(s, ac + 7, 8, &e) == 0, "write 8 across a and c: %s", e.msg);
    CHECK(st_stream_write(s, b, 1, &e) == 0, "write 1: %s", e.msg);
    CHECK(st_stream_write(s, b + 1, 2, &e) == 0, "write 2: %s", e.msg);
    char tmp[420];
    snprintf(tmp, sizeof tmp, "%s.tmp", streamed);
    CHECK(exists(tmp) && !exists(streamed), "written under PATH.tmp until closed");
    CHECK(st_stream_close(s, &e) == 0, "close: %s", e.msg);
    CHECK(same_file(whole, streamed), "streamed file == st_write's");
    CHECK(!exists(tmp), "no PATH.tmp after close");

    /* too much data: an error naming the file; abort leaves nothing */
    char over[400];
    snprintf(over, sizeof over, "%s/over.safetensors", g_dir);
    CHECK(st_stream_open(&s, over, ts, 4, meta, &e) == 0, "open: %s", e.msg);
    float big[19] = {0};
    e.msg[0] = 0;
    CHECK(st_stream_write(s, big, 19, &e) != 0 && strstr(e.msg, "over.safetensors"), "19 > 18 elements: %s", e.msg);
    st_stream_abort(s);
    snprintf(tmp, sizeof tmp, "%s.tmp", over);
    CHECK(!exists(over) && !exists(tmp), "nothing left after abort");

    /* too little: close refuses, nothing under the final name */
    CHECK(st_stream_open(&s, over, ts, 4, meta, &e) == 0, "open: %s", e.msg);
    CHECK(st_stream_write(s, ac, 15, &e) == 0, "write 15: %s", e.msg);
    e.msg[0] = 0;
    CHECK(st_stream_close(s, &e) != 0 && strstr(e.msg, "over.safetensors"), "short close: %s", e.msg);
    CHECK(!exists(over) && !exists(tmp), "nothing left after a short close");
}

/* Shards: the same files as st_write_dir, for a limit that makes 4 shards
 * (a tensor larger than the limit gets its own) and for none. */
static void test_stream_dir(void) {
    float w[4][10];
    for (int i = 0; i < 4; i++) fill(w[i], 10, 100.0f * (float)i);
    st_wtensor ts[] = {
        {"w0", CT_BF16, CT_F32, 1, {6}, w[0]},
        {"w1", CT_BF16, CT_F32, 2, {2, 5}, w[1]},
        {"w2", CT_BF16, CT_F32, 1, {4}, w[2]},
        {"w3", CT_BF16, CT_F32, 1, {8}, w[3]},
    };
    int numel[4] = {6, 10, 4, 8};
    float all[28];
    for (int i = 0, k = 0; i < 4; k += numel[i], i++) memcpy(all + k, w[i], (size_t)numel[i] * sizeof(float));
    const char *meta[] = {"format", "pt", NULL};
    size_t limits[] = {16, 0};
    for (int li = 0; li < 2; li++) {
        char a[400], b[400];
        snprintf(a, sizeof a, "%s/dir_whole_%d", g_dir, li);
        snprintf(b, sizeof b, "%s/dir_stream_%d", g_dir, li);
        ct_err e = {0};
        CHECK(st_write_dir(a, ts, 4, limits[li], meta, &e) == 0, "st_write_dir: %s", e.msg);
        st_dir_stream *d = NULL;
        CHECK(st_dir_stream_open(&d, b, ts, 4, limits[li], meta, &e) == 0, "open: %s", e.msg);
        if (!d) continue;
        int cuts[] = {5, 9, 1, 13}; /* crosses every tensor and shard boundary */
        for (int i = 0, k = 0; i < 4; k += cuts[i], i++)
            CHECK(st_dir_stream_write(d, all + k, (size_t)cuts[i], &e) == 0, "write %d: %s", cuts[i], e.msg);
        CHECK(st_dir_stream_close(d, &e) == 0, "close: %s", e.msg);
        CHECK(same_dir(a, b), "limit %zu: streamed directory == st_write_dir's", limits[li]);
    }
    char p[400];
    snprintf(p, sizeof p, "%s/dir_whole_0/model-00004-of-00004.safetensors", g_dir);
    CHECK(exists(p), "the limit made 4 shards");

    /* mixed element sizes cannot stream in the given order: refused */
    st_wtensor mixed[] = {{"x", CT_F32, CT_F32, 1, {2}, w[0]}, {"y", CT_BF16, CT_F32, 1, {2}, w[1]}};
    st_dir_stream *d = NULL;
    ct_err e = {0};
    snprintf(p, sizeof p, "%s/dir_mixed", g_dir);
    CHECK(st_dir_stream_open(&d, p, mixed, 2, 0, meta, &e) != 0 && d == NULL && strstr(e.msg, "'y'"),
          "mixed sizes: %s", e.msg);
}

/* ckpt_stream in uneven pieces == ckpt_save; too much or too little data is
 * an error that publishes nothing. */
static void test_ckpt_stream(void) {
    lm_config c = {.vocab_size = 13, .hidden = 8, .intermediate = 12, .n_layers = 2, .n_heads = 2,
                      .n_kv_heads = 1, .head_dim = 4, .max_pos = 16, .rope_theta = 1e6, .rms_eps = 1e-6};
    snprintf(c.name, sizeof c.name, "hf");
    lm_model m;
    ct_err e = {0};
    if (lm_create(&m, &c, 1, 4, &e)) {
        CHECK(0, "lm_create: %s", e.msg);
        return;
    }
    lm_init_random(&m, 3);
    size_t n = m.n_params;
    float *ea = malloc(n * sizeof(float)), *eq = malloc(n * sizeof(float));
    fill(ea, (int)n, 0.5f), fill(eq, (int)n, 2.0f);
    char fa[400], fb[400], pa[500], pb[500];
    snprintf(fa, sizeof fa, "%s/ck_whole", g_dir);
    snprintf(fb, sizeof fb, "%s/ck_stream", g_dir);
    CHECK(ckpt_save(fa, 5, &m, ea, eq, "{}", "x = 1\n", NULL, &e) == 0, "ckpt_save: %s", e.msg);
    ckpt_stream *s = NULL;
    CHECK(ckpt_stream_begin(&s, fb, 5, &m, 0, &e) == 0, "begin: %s", e.msg);
    if (s) {
        /* pieces of 97 floats: they cross tensors, and the model/optim file boundary */
        float *cat = malloc(3 * n * sizeof(float));
        memcpy(cat, m.params, n * sizeof(float));
        memcpy(cat + n, ea, n * sizeof(float));
        memcpy(cat + 2 * n, eq, n * sizeof(float));
        for (size_t k = 0; k < 3 * n; k += 97)
            CHECK(ckpt_stream_put(s, cat + k, 3 * n - k < 97 ? 3 * n - k : 97, &e) == 0, "put: %s", e.msg);
        free(cat);
        CHECK(ckpt_stream_end(s, "{}", "x = 1\n", NULL, &e) == 0, "end: %s", e.msg);
        const char *files[] = {"model.safetensors", "optim.safetensors", "state.json", "config.json", "manifest.json"};
        for (int i = 0; i < 5; i++) {
            snprintf(pa, sizeof pa, "%s/step-5/%s", fa, files[i]);
            snprintf(pb, sizeof pb, "%s/step-5/%s", fb, files[i]);
            CHECK(same_file(pa, pb), "%s: streamed == ckpt_save's", files[i]);
        }
        snprintf(pb, sizeof pb, "%s/step-5", fb);
        CHECK(ckpt_verify(pb, &e) == 0, "verify: %s", e.msg);
    }
    /* too little: end fails, no step-6 */
    CHECK(ckpt_stream_begin(&s, fb, 6, &m, 0, &e) == 0, "begin: %s", e.msg);
    if (s) {
        CHECK(ckpt_stream_put(s, m.params, n, &e) == 0, "put params: %s", e.msg);
        e.msg[0] = 0;
        CHECK(ckpt_stream_end(s, "{}", NULL, NULL, &e) != 0 && strstr(e.msg, "optim.safetensors"), "short: %s", e.msg);
        snprintf(pb, sizeof pb, "%s/step-6", fb);
        CHECK(!exists(pb), "no step-6 after a short stream");
    }
    /* too much for a model-only checkpoint: put fails, abort leaves nothing */
    CHECK(ckpt_stream_begin(&s, fb, 7, &m, 1, &e) == 0, "begin: %s", e.msg);
    if (s) {
        CHECK(ckpt_stream_put(s, m.params, n, &e) == 0, "put params: %s", e.msg);
        e.msg[0] = 0;
        CHECK(ckpt_stream_put(s, ea, 1, &e) != 0 && strstr(e.msg, "more than"), "extra float: %s", e.msg);
        ckpt_stream_abort(s);
        int steps[8];
        CHECK(ckpt_list(fb, steps, 8) == 1 && steps[0] == 5, "only step-5 exists");
        DIR *d = opendir(fb);
        struct dirent *de;
        int temps = 0;
        while (d && (de = readdir(d))) temps += strncmp(de->d_name, ".step-", 6) == 0;
        if (d) closedir(d);
        CHECK(temps == 0, "no temp dir left");
    }
    free(ea);
    free(eq);
    lm_free(&m);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ctitan_sts_XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 1;
    }
    test_stream_file();
    test_stream_dir();
    test_ckpt_stream();
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return CHECK_DONE();
}
