/* tests/c/checkpoint/test_ckpt.c: training checkpoints: round trip, damage detection,
 * selection, pruning, and write failures that must leave earlier checkpoints
 * intact.
 *
 * The manifest is checked against values computed here (file sizes from
 * stat, XXH3-64 from the library), not against ckpt.c's own reading, and
 * forged manifests are built by hand to probe the reader. Damage is done with
 * plain file operations: one flipped bit, one byte cut. Disk full is
 * simulated with RLIMIT_FSIZE (SIGXFSZ ignored, so writes fail with EFBIG),
 * which works for root too, unlike a read-only directory. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "check.h"
#include "checkpoint/ckpt.h"
#include "checkpoint/hf.h"
#include "core/fs.h"
#include "formats/safetensors.h"

static char g_root[256];

/* ------------------------------------------------------------ helpers */

/* out holds 4096 bytes; every path of this test is far shorter (noinline:
 * keeps gcc from guessing truncation at each call site). */
__attribute__((noinline)) static void pathf(char *out, const char *fmt, const char *a, const char *b) {
    if (snprintf(out, 4096, fmt, a, b) >= 4096) {
        fprintf(stderr, "path too long\n");
        exit(1);
    }
}

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

static void rm_rf(const char *p) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
    if (system(cmd) != 0) fprintf(stderr, "warning: %s failed\n", cmd);
}

static void fresh(char *out, const char *name) {
    snprintf(out, 4096, "%s/%s", g_root, name);
    rm_rf(out);
}

static unsigned char *read_file(const char *path, size_t *len) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long n = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    if (fread(b, 1, (size_t)n, fp) != (size_t)n) n = 0;
    fclose(fp);
    b[n] = 0;
    *len = (size_t)n;
    return b;
}

static void write_file(const char *path, const void *data, size_t len) {
    FILE *fp = fopen(path, "wb");
    if (!fp || fwrite(data, 1, len, fp) != len) {
        perror(path);
        exit(1);
    }
    fclose(fp);
}

static void flip_bit(const char *path, size_t at) {
    size_t n;
    unsigned char *b = read_file(path, &n);
    if (!b || n == 0) {
        fprintf(stderr, "flip_bit: %s unreadable\n", path);
        exit(1);
    }
    b[at % n] ^= 0x10;
    write_file(path, b, n);
    free(b);
}

static void cut_byte(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0 || truncate(path, st.st_size - 1) != 0) {
        perror(path);
        exit(1);
    }
}

static uint32_t g_lcg;
static float rnd(void) {
    g_lcg = g_lcg * 1664525u + 1013904223u;
    return (float)((g_lcg >> 8) * (1.0 / 16777216.0)) * 2.0f - 1.0f;
}

static lm_config tiny_cfg(int tied) {
    lm_config c = {.vocab_size = 64, .hidden = 16, .intermediate = 32, .n_layers = 2, .n_heads = 2,
                      .n_kv_heads = 1, .head_dim = 8, .max_pos = 64, .tie_embeddings = tied,
                      .rope_theta = 1e6, .rms_eps = 1e-6};
    snprintf(c.name, sizeof c.name, "hf");
    return c;
}

typedef struct {
    lm_model m;
    float *m1, *m2;
} tiny;

static void tiny_make(tiny *t, int tied, uint32_t seed) {
    lm_config c = tiny_cfg(tied);
    ct_err e = {0};
    if (lm_create(&t->m, &c, 1, 4, &e)) {
        fprintf(stderr, "lm_create: %s\n", e.msg);
        exit(1);
    }
    g_lcg = seed;
    t->m1 = malloc(t->m.n_params * sizeof(float));
    t->m2 = malloc(t->m.n_params * sizeof(float));
    for (size_t i = 0; i < t->m.n_params; i++) {
        t->m.params[i] = rnd();
        t->m1[i] = rnd() * 1e-3f;
        t->m2[i] = fabsf(rnd() * rnd()) * 1e-6f; /* a second moment: never negative (ckpt_load checks) */
    }
}

static void tiny_free(tiny *t) {
    lm_free(&t->m);
    free(t->m1);
    free(t->m2);
}

static const char *STATE = "{\"step\": 10, \"loader\": {\"pos\": 12345}, \"rng\": [1, 2, 3]}";
static const char *TOML = "[model]\nhf_assets_path = \"/nowhere\"\n";

static int save(const char *folder, int step, tiny *t, int full, ct_err *e) {
    return ckpt_save(folder, step, &t->m, full ? t->m1 : NULL, full ? t->m2 : NULL, full ? STATE : NULL, TOML,
                     NULL, e);
}

/* Every dot-entry (temp dir) left in folder. */
static int count_temp(const char *folder) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | grep -c '^\\.' > %s/count.txt", folder, g_root);
    if (system(cmd) < 0) return -1;
    char p[4096];
    pathf(p, "%s/%s", g_root, "count.txt");
    size_t n;
    unsigned char *b = read_file(p, &n);
    int c = b ? atoi((char *)b) : -1;
    free(b);
    return c;
}

/* Runs ckpt_select with stderr captured into *err_text (malloc'd). */
static int select_capture(const char *folder, int load_step, char *dir, int *step, ct_err *e, char **err_text) {
    char p[4096];
    pathf(p, "%s/%s", g_root, "stderr.txt");
    fflush(stderr);
    int saved = dup(2);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    close(fd);
    int rc = ckpt_select(folder, load_step, dir, 4096, step, e);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    size_t n;
    *err_text = (char *)read_file(p, &n);
    return rc;
}

/* Writes a manifest by hand in the documented format (self checksum last). */
static void forge_manifest(const char *dir, const char *body_files, int step, const char *model_only,
                           int version) {
    char buf[8192], p[4096];
    int k = snprintf(buf, sizeof buf,
                     "{\n  \"format\": \"ctitan-checkpoint\",\n  \"version\": %d,\n  \"step\": %d,\n"
                     "  \"model_only\": %s,\n  \"files\": {%s\n  },\n  \"manifest_xxh3_64\": \"",
                     version, step, model_only, body_files);
    k += snprintf(buf + k, sizeof buf - (size_t)k, "%016llx\"\n}\n",
                  (unsigned long long)XXH3_64bits(buf, (size_t)k));
    pathf(p, "%s/%s", dir, "manifest.json");
    write_file(p, buf, (size_t)k);
}

/* The "files" entries of the real files of dir, as the manifest lists them. */
static void files_body(const char *dir, const char *const *names, int n, char *out, size_t cap) {
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        char p[4096];
        pathf(p, "%s/%s", dir, names[i]);
        size_t len;
        unsigned char *b = read_file(p, &len);
        k += (size_t)snprintf(out + k, cap - k, "%s\n    \"%s\": {\"bytes\": %zu, \"xxh3_64\": \"%016llx\"}",
                              i ? "," : "", names[i], len, (unsigned long long)XXH3_64bits(b, len));
        free(b);
    }
}

/* ------------------------------------------------------------- tests */

static void test_round_trip(void) {
    char folder[4096], dir[4096], p[4096];
    fresh(folder, "rt");
    tiny a, b;
    tiny_make(&a, 0, 1);
    tiny_make(&b, 0, 2);
    ct_err e = {0};
    ckpt_info info = {0};
    int rc = ckpt_save(folder, 10, &a.m, a.m1, a.m2, STATE, TOML, &info, &e);
    CHECK(rc == 0, "save: %s", e.msg);
    pathf(dir, "%s/%s", folder, "step-10");
    CHECK(!strcmp(info.dir, dir) && info.step == 10, "info.dir %s step %d", info.dir, info.step);
    CHECK(count_temp(folder) == 0, "temp dirs left after a successful save");

    /* manifest: our own reading of it, against stat and XXH3 */
    pathf(p, "%s/%s", dir, "manifest.json");
    size_t n;
    char *text = (char *)read_file(p, &n);
    cJSON *root = text ? cJSON_Parse(text) : NULL;
    CHECK(root != NULL, "manifest.json does not parse");
    uint64_t sum = n;
    if (root) {
        CHECK(!strcmp(cJSON_GetObjectItem(root, "format")->valuestring, "ctitan-checkpoint"), "format");
        CHECK(cJSON_GetObjectItem(root, "version")->valueint == 1, "version");
        CHECK(cJSON_GetObjectItem(root, "step")->valueint == 10, "step");
        CHECK(cJSON_IsFalse(cJSON_GetObjectItem(root, "model_only")), "model_only");
        const char *want[] = {"model.safetensors", "optim.safetensors", "state.json", "config.toml", "config.json"};
        cJSON *files = cJSON_GetObjectItem(root, "files");
        CHECK(cJSON_GetArraySize(files) == 5, "manifest lists %d files", cJSON_GetArraySize(files));
        for (int i = 0; i < 5; i++) {
            cJSON *f = cJSON_GetObjectItem(files, want[i]);
            CHECK(f != NULL, "manifest does not list %s", want[i]);
            if (!f) continue;
            char fp[4096];
            pathf(fp, "%s/%s", dir, want[i]);
            size_t len;
            unsigned char *fb = read_file(fp, &len);
            char hex[17];
            snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits(fb, len));
            CHECK((size_t)cJSON_GetObjectItem(f, "bytes")->valuedouble == len, "%s bytes", want[i]);
            CHECK(!strcmp(cJSON_GetObjectItem(f, "xxh3_64")->valuestring, hex), "%s checksum", want[i]);
            sum += len;
            free(fb);
        }
        cJSON_Delete(root);
    }
    free(text);
    CHECK(info.bytes == sum, "info.bytes %llu, files sum to %llu", (unsigned long long)info.bytes,
          (unsigned long long)sum);
    pathf(p, "%s/%s", dir, "state.json");
    text = (char *)read_file(p, &n);
    CHECK(text && !strcmp(text, STATE), "state.json is not the text given");
    free(text);
    pathf(p, "%s/%s", dir, "config.toml");
    text = (char *)read_file(p, &n);
    CHECK(text && !strcmp(text, TOML), "config.toml is not the text given");
    free(text);

    /* moments are stored under NAME.exp_avg / NAME.exp_avg_sq in fp32 */
    pathf(p, "%s/%s", dir, "optim.safetensors");
    st_file *f = st_open(p, &e);
    CHECK(f && st_count(f) == 2 * a.m.n_tensors, "optim.safetensors: %d tensors", f ? st_count(f) : -1);
    if (f) {
        const st_tensor *t = st_find(f, "model.layers.1.mlp.down_proj.weight.exp_avg_sq");
        const lm_tensor *q = lm_find(&a.m, "model.layers.1.mlp.down_proj.weight");
        CHECK(t && q && t->dtype == CT_F32 && !memcmp(t->data, a.m2 + q->offset, q->numel * 4),
              "exp_avg_sq of down_proj differs");
        st_close(f);
    }

    int steps[8];
    CHECK(ckpt_list(folder, steps, 8) == 1 && steps[0] == 10, "list");
    CHECK(ckpt_verify(dir, &e) == 0, "verify: %s", e.msg);

    char *state = NULL;
    ckpt_info li = {0};
    rc = ckpt_load(dir, &b.m, b.m1, b.m2, &state, &li, &e);
    CHECK(rc == 0, "load: %s", e.msg);
    CHECK(!memcmp(a.m.params, b.m.params, a.m.n_params * 4), "params differ after the round trip");
    CHECK(!memcmp(a.m1, b.m1, a.m.n_params * 4), "exp_avg differs after the round trip");
    CHECK(!memcmp(a.m2, b.m2, a.m.n_params * 4), "exp_avg_sq differs after the round trip");
    CHECK(state && !strcmp(state, STATE), "state.json text differs: %s", state ? state : "(null)");
    CHECK(li.step == 10 && li.bytes + 0 > 0 && li.seconds >= 0, "load info");
    free(state);
    CHECK(ckpt_is_model_only(dir, &e) == 0, "full checkpoint reported model-only");

    /* a model of another architecture is refused, naming config.json and the key */
    tiny c;
    lm_config cc = tiny_cfg(0);
    cc.rope_theta = 5e6;
    ct_err ce = {0};
    lm_create(&c.m, &cc, 1, 4, &ce);
    rc = ckpt_load(dir, &c.m, NULL, NULL, NULL, NULL, &ce);
    CHECK(rc != 0 && strstr(ce.msg, "config.json") && strstr(ce.msg, "rope_theta"), "theta mismatch: %s", ce.msg);
    lm_free(&c.m);

    /* saving the same step again replaces it with the new contents */
    for (size_t i = 0; i < b.m.n_params; i++) b.m.params[i] = -a.m.params[i];
    rc = ckpt_save(folder, 10, &b.m, b.m1, b.m2, "{\"step\": 10, \"again\": true}", TOML, NULL, &e);
    CHECK(rc == 0, "re-save: %s", e.msg);
    CHECK(count_temp(folder) == 0, "temp dirs left after replacing a checkpoint");
    rc = ckpt_load(dir, &a.m, NULL, NULL, &state, NULL, &e);
    CHECK(rc == 0 && !memcmp(a.m.params, b.m.params, a.m.n_params * 4), "replaced checkpoint: %s", e.msg);
    CHECK(state && strstr(state, "again"), "replaced state.json");
    free(state);

    /* mismatched moment pointers and a missing state are refused */
    rc = ckpt_save(folder, 11, &a.m, a.m1, NULL, STATE, NULL, NULL, &e);
    CHECK(rc != 0, "one moment only was accepted");
    rc = ckpt_save(folder, 12, &a.m, a.m1, a.m2, NULL, NULL, NULL, &e);
    CHECK(rc != 0 && strstr(e.msg, "state.json"), "full checkpoint without state: %s", e.msg);
    CHECK(ckpt_list(folder, steps, 8) == 1 && count_temp(folder) == 0, "failed saves left something");
    tiny_free(&a);
    tiny_free(&b);
}

static void test_model_only(void) {
    char folder[4096], dir[4096];
    fresh(folder, "mo");
    tiny a, b;
    tiny_make(&a, 1, 3);
    tiny_make(&b, 1, 4);
    ct_err e = {0};
    CHECK(lm_find(&a.m, "lm_head.weight") == NULL, "tied model has an lm_head tensor");
    int rc = save(folder, 0, &a, 0, &e);
    CHECK(rc == 0, "model-only save: %s", e.msg);
    pathf(dir, "%s/%s", folder, "step-0");
    char p[4096];
    pathf(p, "%s/%s", dir, "optim.safetensors");
    CHECK(!exists(p), "model-only checkpoint has optim.safetensors");
    pathf(p, "%s/%s", dir, "state.json");
    CHECK(!exists(p), "model-only checkpoint without state has state.json");
    CHECK(ckpt_verify(dir, &e) == 0, "verify model-only: %s", e.msg);
    CHECK(ckpt_is_model_only(dir, &e) == 1, "not reported model-only");
    rc = ckpt_load(dir, &b.m, b.m1, b.m2, NULL, NULL, &e);
    CHECK(rc != 0 && strstr(e.msg, "model-only"), "moments from a model-only checkpoint: %s", e.msg);
    char *state = (char *)1;
    rc = ckpt_load(dir, &b.m, NULL, NULL, &state, NULL, &e);
    CHECK(rc == 0, "model-only load: %s", e.msg);
    CHECK(state == NULL, "state of a checkpoint without state.json is not NULL");
    CHECK(!memcmp(a.m.params, b.m.params, a.m.n_params * 4), "model-only params differ");
    tiny_free(&a);
    tiny_free(&b);
}

/* Each file, truncated by one byte or with one flipped bit, is caught and named. */
static void test_damage(void) {
    const char *files[] = {"model.safetensors", "optim.safetensors", "state.json",
                           "config.toml",       "config.json",       "manifest.json"};
    tiny a;
    tiny_make(&a, 0, 5);
    for (int i = 0; i < 6; i++)
        for (int mode = 0; mode < 3; mode++) {
            char folder[4096], dir[4096], p[4096];
            fresh(folder, "dmg");
            ct_err e = {0};
            CHECK(save(folder, 20, &a, 1, &e) == 0, "save: %s", e.msg);
            pathf(dir, "%s/%s", folder, "step-20");
            pathf(p, "%s/%s", dir, files[i]);
            struct stat st;
            stat(p, &st);
            if (mode == 0) cut_byte(p);
            else if (mode == 1) flip_bit(p, (size_t)st.st_size / 2); /* middle */
            else flip_bit(p, (size_t)st.st_size - 3);               /* near the end */
            int rc = ckpt_verify(dir, &e);
            CHECK(rc != 0 && strstr(e.msg, p), "%s (%s): not named: rc %d, %s", files[i],
                  mode ? "bit flip" : "truncated", rc, e.msg);
            if (i < 2 && mode == 1)
                CHECK(strstr(e.msg, "checksum mismatch (truncated or corrupted)"), "message: %s", e.msg);
            /* load verifies first: the damaged file is named and nothing is loaded */
            tiny b;
            tiny_make(&b, 0, 6);
            rc = ckpt_load(dir, &b.m, b.m1, b.m2, NULL, NULL, &e);
            CHECK(rc != 0 && strstr(e.msg, files[i]), "load of damaged %s: %s", files[i], e.msg);
            tiny_free(&b);
        }
    /* a missing file listed in the manifest */
    char folder[4096], p[4096];
    fresh(folder, "dmg");
    ct_err e = {0};
    save(folder, 20, &a, 1, &e);
    pathf(p, "%s/%s", folder, "step-20/optim.safetensors");
    unlink(p);
    CHECK(ckpt_verify(p, &e) != 0, "verify of a file path passed");
    pathf(p, "%s/%s", folder, "step-20");
    CHECK(ckpt_verify(p, &e) != 0 && strstr(e.msg, "optim.safetensors: missing"), "missing file: %s", e.msg);
    tiny_free(&a);
}

/* Hand-made manifests: each malformed field is refused, naming manifest.json. */
static void test_hostile_manifest(void) {
    char folder[4096], dir[4096];
    fresh(folder, "hm");
    tiny a;
    tiny_make(&a, 0, 7);
    ct_err e = {0};
    save(folder, 3, &a, 1, &e);
    pathf(dir, "%s/%s", folder, "step-3");
    const char *all[] = {"model.safetensors", "optim.safetensors", "state.json", "config.toml", "config.json"};
    char body[4096];
    files_body(dir, all, 5, body, sizeof body);

    forge_manifest(dir, body, 3, "false", 1);
    CHECK(ckpt_verify(dir, &e) == 0, "a faithful hand-made manifest is refused: %s", e.msg);
    forge_manifest(dir, body, 4, "false", 1);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "step-3"), "step mismatch: %s", e.msg);
    forge_manifest(dir, body, 3, "false", 2);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "version"), "version 2: %s", e.msg);
    forge_manifest(dir, body, 3, "0", 1);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "model_only"), "model_only not bool: %s", e.msg);
    const char *no_state[] = {"model.safetensors", "optim.safetensors", "config.json"};
    files_body(dir, no_state, 3, body, sizeof body);
    forge_manifest(dir, body, 3, "false", 1);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "state.json"), "full without state.json: %s", e.msg);
    const char *model_only[] = {"model.safetensors", "config.json"};
    files_body(dir, model_only, 2, body, sizeof body);
    forge_manifest(dir, body, 3, "true", 1);
    CHECK(ckpt_verify(dir, &e) == 0, "model-only listing fewer files: %s", e.msg);
    files_body(dir, model_only, 1, body, sizeof body);
    forge_manifest(dir, body, 3, "true", 1);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "config.json"), "without config.json: %s", e.msg);
    files_body(dir, all, 5, body, sizeof body);
    forge_manifest(dir, body, 3, "true", 1);
    CHECK(ckpt_verify(dir, &e) == 0, "model-only listing every file: %s", e.msg);
    forge_manifest(dir, "\n    \"../step-3/config.json\": {\"bytes\": 1, \"xxh3_64\": \"0000000000000000\"}", 3, "true",
                   1);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "plain name"), "path escape: %s", e.msg);
    forge_manifest(dir, "\n    \"model.safetensors\": {\"bytes\": -1, \"xxh3_64\": \"0000000000000000\"}", 3, "true", 1);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "manifest.json"), "negative bytes: %s", e.msg);
    forge_manifest(dir, "\n    \"model.safetensors\": {\"bytes\": 1, \"xxh3_64\": \"XYZ\"}", 3, "true", 1);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "manifest.json"), "bad hex: %s", e.msg);
    char p[4096];
    pathf(p, "%s/%s", dir, "manifest.json");
    write_file(p, "{}", 2);
    CHECK(ckpt_verify(dir, &e) != 0 && strstr(e.msg, "manifest.json"), "no self checksum: %s", e.msg);
    /* step-0 (an import's name) is a step like the others: a manifest that says 3
     * under it is refused too (the check once skipped the name's 0) */
    char dir0[4096];
    pathf(dir0, "%s/%s", folder, "step-0");
    CHECK(rename(dir, dir0) == 0, "rename to step-0");
    files_body(dir0, all, 5, body, sizeof body);
    forge_manifest(dir0, body, 3, "false", 1);
    CHECK(ckpt_verify(dir0, &e) != 0 && strstr(e.msg, "says step 3") && strstr(e.msg, "step-0"),
          "step 3 under step-0: %s", e.msg);
    forge_manifest(dir0, body, 0, "false", 1);
    CHECK(ckpt_verify(dir0, &e) == 0, "step 0 under step-0 is refused: %s", e.msg);
    tiny_free(&a);
}

static void test_select(void) {
    char folder[4096], dir[4096], p[4096];
    fresh(folder, "sel");
    tiny a;
    tiny_make(&a, 0, 8);
    ct_err e = {0};
    char *err = NULL;
    int step = -7;

    /* no folder, an empty folder, a folder with only temp dirs: "none found" */
    CHECK(ckpt_select(folder, -1, dir, sizeof dir, &step, &e) == CKPT_NONE, "missing folder is not NONE");
    mkdir(folder, 0755);
    pathf(p, "%s/%s", folder, ".step-30.tmp-1");
    mkdir(p, 0755);
    CHECK(ckpt_select(folder, -1, dir, sizeof dir, &step, &e) == CKPT_NONE, "temp-only folder is not NONE");
    CHECK(ckpt_list(folder, NULL, 0) == 0, "a temp dir is listed");

    save(folder, 10, &a, 1, &e);
    save(folder, 20, &a, 1, &e);
    save(folder, 5, &a, 1, &e);
    int steps[2];
    CHECK(ckpt_list(folder, steps, 2) == 3 && steps[0] == 5 && steps[1] == 10, "list ascending, capped");
    CHECK(ckpt_select(folder, -1, dir, sizeof dir, &step, &e) == 0 && step == 20, "newest: %d", step);

    /* newest without a manifest (a half-written dir someone renamed): skipped with a warning */
    pathf(p, "%s/%s", folder, "step-20/manifest.json");
    unlink(p);
    int rc = select_capture(folder, -1, dir, &step, &e, &err);
    CHECK(rc == 0 && step == 10, "select -1 with step-20 missing its manifest: rc %d step %d", rc, step);
    CHECK(err && strstr(err, "warning") && strstr(err, "step-20"), "no warning naming step-20: %s",
          err ? err : "");
    pathf(p, "%s/%s", folder, "step-10");
    CHECK(!strcmp(dir, p), "dir %s", dir);
    free(err);

    /* step-10 damaged too: falls back to 5 with two warnings */
    pathf(p, "%s/%s", folder, "step-10/model.safetensors");
    flip_bit(p, 100);
    rc = select_capture(folder, -1, dir, &step, &e, &err);
    CHECK(rc == 0 && step == 5, "fallback to 5: rc %d step %d", rc, step);
    CHECK(err && strstr(err, "step-20") && strstr(err, "step-10/model.safetensors: checksum mismatch"),
          "warnings: %s", err ? err : "");
    free(err);

    /* an explicit damaged step is an error, never a fallback */
    step = -7;
    rc = select_capture(folder, 10, dir, &step, &e, &err);
    CHECK(rc != 0 && rc != CKPT_NONE && strstr(e.msg, "step-10/model.safetensors") && step == -7,
          "select 10 damaged: rc %d %s", rc, e.msg);
    free(err);
    rc = ckpt_select(folder, 20, dir, sizeof dir, &step, &e);
    CHECK(rc != 0 && strstr(e.msg, "step-20/manifest.json"), "select 20 without manifest: %s", e.msg);
    rc = ckpt_select(folder, 30, dir, sizeof dir, &step, &e);
    CHECK(rc != 0 && rc != CKPT_NONE && strstr(e.msg, "step-30"), "select missing 30: %s", e.msg);
    CHECK(ckpt_select(folder, 5, dir, sizeof dir, &step, &e) == 0 && step == 5, "select 5: %s", e.msg);

    /* all damaged: an error, not "none found" (that would silently start over) */
    pathf(p, "%s/%s", folder, "step-5/state.json");
    cut_byte(p);
    rc = select_capture(folder, -1, dir, &step, &e, &err);
    CHECK(rc != 0 && rc != CKPT_NONE, "all damaged: rc %d", rc);
    free(err);
    tiny_free(&a);
}

/* A pid no process has: temp dirs named after it are a crashed writer's. */
static long dead_pid(void) {
    for (long pid = 4000000; pid > 1000; pid -= 7919)
        if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return pid;
    return 999999;
}

static void test_prune(void) {
    char folder[4096], p[4096], name[128];
    fresh(folder, "prune");
    tiny a;
    tiny_make(&a, 0, 9);
    ct_err e = {0};
    for (int s = 1; s <= 5; s++) save(folder, s, &a, 1, &e);
    long dp = dead_pid();
    snprintf(name, sizeof name, ".step-6.tmp-%ld", dp);
    pathf(p, "%s/%s", folder, name);
    mkdir(p, 0755);
    char q[4096];
    pathf(q, "%s/%s", p, "model.safetensors");
    write_file(q, "partial", 7);
    snprintf(name, sizeof name, ".step-7.tmp-%ld", (long)getpid());
    pathf(p, "%s/%s", folder, name);
    mkdir(p, 0755);
    snprintf(name, sizeof name, ".step-8.tmp-%d", 1); /* pid 1 is alive: a live writer's dir stays */
    pathf(p, "%s/%s", folder, name);
    mkdir(p, 0755);

    CHECK(ckpt_prune(folder, 0, &e) == 0, "prune k=0: %s", e.msg);
    CHECK(ckpt_list(folder, NULL, 0) == 5, "k=0 removed checkpoints");
    CHECK(count_temp(folder) == 1 && exists(p), "stale temp dirs not removed or live one removed: %d",
          count_temp(folder));

    int steps[8];
    CHECK(ckpt_prune(folder, 2, &e) == 0, "prune k=2: %s", e.msg);
    int n = ckpt_list(folder, steps, 8);
    CHECK(n == 2 && steps[0] == 4 && steps[1] == 5, "kept %d: %d %d", n, steps[0], steps[1]);
    rm_rf(p);

    /* a damaged newest does not count: k=1 keeps step-4, leaves step-5 for inspection */
    pathf(p, "%s/%s", folder, "step-5/manifest.json");
    unlink(p);
    save(folder, 3, &a, 1, &e);
    CHECK(ckpt_prune(folder, 1, &e) == 0, "prune k=1: %s", e.msg);
    n = ckpt_list(folder, steps, 8);
    CHECK(n == 2 && steps[0] == 4 && steps[1] == 5, "k=1 with damaged newest kept %d: %d %d", n, steps[0], steps[1]);
    pathf(p, "%s/%s", folder, "step-4");
    CHECK(ckpt_verify(p, &e) == 0, "kept step-4 does not verify: %s", e.msg);

    /* the copy moved aside by a replace that crashed between its two renames
     * is the only one: prune puts it back */
    char aside[4096];
    snprintf(name, sizeof name, ".step-4.old-%ld", dp);
    pathf(aside, "%s/%s", folder, name);
    CHECK(rename(p, aside) == 0, "rename aside");
    CHECK(ckpt_prune(folder, 0, &e) == 0, "prune restore: %s", e.msg);
    CHECK(ckpt_verify(p, &e) == 0 && !exists(aside), "step-4 not restored: %s", e.msg);
    tiny_free(&a);
}

/* docs/checkpoints.md, "Pruning": keep_latest_k keeps the newest k *full*
 * checkpoints (a final model-only save never pushes out the last resumable
 * one) and never removes a final export (a finished run's model, extended
 * since). Folder: full step-2 and step-4, a final HF export at step-3 (an
 * extended run trained past it), a model-only step-6; k = 1 keeps step-4 (the
 * newest full one), so only step-2 goes: step-3, step-4 and step-6 stay. */
static void test_prune_counts_full_only(void) {
    char folder[4096], p[4096];
    fresh(folder, "prune_kinds");
    tiny a;
    tiny_make(&a, 0, 11);
    ct_err e = {0};
    CHECK(save(folder, 2, &a, 1, &e) == 0, "save step-2: %s", e.msg);
    CHECK(save(folder, 4, &a, 1, &e) == 0, "save step-4: %s", e.msg);
    CHECK(save(folder, 6, &a, 0, &e) == 0, "model-only save step-6: %s", e.msg);
    pathf(p, "%s/%s", folder, "step-3");
    mkdir(p, 0755);
    char q[4096];
    pathf(q, "%s/%s", p, "config.json");
    write_file(q, "{}", 2);
    pathf(q, "%s/%s", p, "model.safetensors");
    write_file(q, "export", 6);
    CHECK(ckpt_dir_kind(p) == CKPT_DIR_HF_MODEL, "step-3 is not seen as an HF export");

    CHECK(ckpt_prune(folder, 1, &e) == 0, "prune k=1: %s", e.msg);
    pathf(p, "%s/%s", folder, "step-4");
    CHECK(ckpt_verify(p, &e) == 0, "k=1 removed step-4, the newest full checkpoint (model-only step-6 counted): %s",
          e.msg);
    pathf(p, "%s/%s", folder, "step-3/config.json");
    CHECK(exists(p), "k=1 removed the final HF export step-3");
    pathf(p, "%s/%s", folder, "step-6");
    CHECK(exists(p), "k=1 removed the model-only step-6");
    pathf(p, "%s/%s", folder, "step-2");
    CHECK(!exists(p), "k=1 kept step-2, older than the kept step-4");
    tiny_free(&a);
}

/* Disk full (RLIMIT_FSIZE): the save fails naming the path, the temp dir is
 * gone, and the earlier checkpoints (including the one being replaced) stay
 * intact and loadable. */
static void test_write_failure(void) {
    char folder[4096], p[4096];
    fresh(folder, "full");
    tiny a, b;
    tiny_make(&a, 0, 10);
    tiny_make(&b, 0, 11);
    ct_err e = {0};
    CHECK(save(folder, 10, &a, 1, &e) == 0, "save: %s", e.msg);
    pathf(p, "%s/%s", folder, "step-10/model.safetensors");
    struct stat st;
    stat(p, &st);
    long model_bytes = (long)st.st_size;

    signal(SIGXFSZ, SIG_IGN);
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    /* below the model file; then between the model and optim files */
    long limits[2] = {model_bytes / 2, model_bytes + 64};
    for (int i = 0; i < 2; i++)
        for (int step = 20; step >= 10; step -= 10) {
            lim.rlim_cur = (rlim_t)limits[i];
            lim.rlim_max = old.rlim_max;
            setrlimit(RLIMIT_FSIZE, &lim);
            e = (ct_err){0};
            int rc = ckpt_save(folder, step, &b.m, b.m1, b.m2, STATE, TOML, NULL, &e);
            setrlimit(RLIMIT_FSIZE, &old);
            CHECK(rc != 0, "save under a %ld-byte limit succeeded", limits[i]);
            CHECK(strstr(e.msg, folder) && strstr(e.msg, i ? "optim.safetensors" : "model.safetensors"),
                  "error does not name the file: %s", e.msg);
            int steps[4];
            CHECK(ckpt_list(folder, steps, 4) == 1 && steps[0] == 10, "failed save left a step dir");
            CHECK(count_temp(folder) == 0, "failed save left a temp dir");
            pathf(p, "%s/%s", folder, "step-10");
            char *state = NULL;
            rc = ckpt_load(p, &b.m, b.m1, b.m2, &state, NULL, &e);
            CHECK(rc == 0 && !memcmp(a.m.params, b.m.params, a.m.n_params * 4) && state && !strcmp(state, STATE),
                  "earlier checkpoint damaged by a failed save: %s", e.msg);
            free(state);
            for (size_t k = 0; k < b.m.n_params; k++) b.m.params[k] += 1.0f;
        }
    signal(SIGXFSZ, SIG_DFL);

    /* an unwritable folder (a file in the way) is an error naming it */
    pathf(p, "%s/%s", g_root, "not_a_dir");
    write_file(p, "x", 1);
    CHECK(ckpt_save(p, 1, &a.m, NULL, NULL, NULL, NULL, NULL, &e) != 0 && strstr(e.msg, "not_a_dir"),
          "save into a file: %s", e.msg);
    tiny_free(&a);
    tiny_free(&b);
}

/* hf_keep_token_ids adds the source's ids to a config.json, the rest of it
 * byte for byte; an object with no member before them takes no comma (the
 * comma was copied before it was dropped, and the closing brace cut off). */
static void test_keep_token_ids(void) {
    char src[4096], dst[4096], p[4096];
    pathf(src, "%s/%s", g_root, "ids_src");
    pathf(dst, "%s/%s", g_root, "ids_dst");
    mkdir(src, 0755);
    mkdir(dst, 0755);
    pathf(p, "%s/%s", src, "config.json");
    const char *from = "{\"bos_token_id\": 1, \"eos_token_id\": [2, 3], \"hidden_size\": 8}";
    write_file(p, from, strlen(from));
    const char *cases[] = {"{}", "{\n}\n", "{\n\t\"hidden_size\":\t1.0\n}", "{\"eos_token_id\": 7}"};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pathf(p, "%s/%s", dst, "config.json");
        write_file(p, cases[i], strlen(cases[i]));
        const char *srcs[] = {src};
        ct_err e = {0};
        CHECK(hf_keep_token_ids(p, srcs, 1, &e) == 0, "case %zu: %s", i, e.msg);
        size_t n = 0;
        char *text = fs_read_file(p, 1 << 20, &n, &e);
        cJSON *o = text ? cJSON_Parse(text) : NULL;
        CHECK(o != NULL, "case %zu: not JSON after the insertion: %s", i, text ? text : "(unread)");
        const cJSON *bos = cJSON_GetObjectItemCaseSensitive(o, "bos_token_id");
        const cJSON *eos = cJSON_GetObjectItemCaseSensitive(o, "eos_token_id");
        CHECK(cJSON_IsNumber(bos) && bos->valueint == 1, "case %zu: bos_token_id", i);
        if (i == 3) CHECK(cJSON_IsNumber(eos) && eos->valueint == 7, "the file's own eos_token_id stays");
        else CHECK(cJSON_IsArray(eos) && cJSON_GetArraySize(eos) == 2, "case %zu: eos_token_id", i);
        if (i == 2) CHECK(text && strstr(text, "\"hidden_size\":\t1.0") != NULL, "the other bytes stay: %s", text);
        cJSON_Delete(o);
        free(text);
    }
    /* a model whose vocabulary lacks the source's eos (another model's config): not written */
    pathf(p, "%s/%s", dst, "config.json");
    const char *small = "{\"vocab_size\": 3}";
    write_file(p, small, strlen(small));
    const char *srcs[] = {src};
    ct_err e = {0};
    CHECK(hf_keep_token_ids(p, srcs, 1, &e) == 0, "vocab 3: %s", e.msg);
    size_t n = 0;
    char *text = fs_read_file(p, 1 << 20, &n, &e);
    cJSON *o = text ? cJSON_Parse(text) : NULL;
    const cJSON *bos = cJSON_GetObjectItemCaseSensitive(o, "bos_token_id");
    CHECK(cJSON_IsNumber(bos) && bos->valueint == 1, "vocab 3: bos 1 is in it");
    CHECK(!cJSON_GetObjectItemCaseSensitive(o, "eos_token_id"), "vocab 3: eos [2, 3] has 3, outside: %s", text);
    cJSON_Delete(o);
    free(text);
}

int main(void) {
    snprintf(g_root, sizeof g_root, "/tmp/ctitan_test_ckpt_%ld", (long)getpid());
    rm_rf(g_root);
    mkdir(g_root, 0755);
    test_round_trip();
    test_model_only();
    test_damage();
    test_hostile_manifest();
    test_select();
    test_prune();
    test_prune_counts_full_only();
    test_write_failure();
    test_keep_token_ids();
    rm_rf(g_root);
    return CHECK_DONE();
}
