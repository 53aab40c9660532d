/* tests/c/hub/test_hub.c: the pure parts of hub/hub.c: which strings are Hub ids,
 * revisions and file names; the cache, endpoint, offline and token rules of
 * huggingface_hub's constants.py under chosen environments; URLs, etags, the
 * snapshot links, the shard list of an index; SHA-256 and git's blob SHA-1
 * against known digests. Then hub_resolve without a network: a local
 * directory as it is, and an id answered from a cache built here by hand in
 * huggingface_hub's layout (offline), or refused naming the id and the file.
 * (The network half is tests/py/test_hub.py, against a fake Hub.) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"
#include "hub/hub.h"

static void test_ids(void) {
    const char *good[] = {"Qwen/Qwen3-0.6B", "org/tiny", "a/b", "user_1/model.v2", "A-b/c_D.e-f", "x/y.gitx"};
    const char *bad[] = {"Qwen3-0.6B",   "/abs/path",  "./rel/dir", "../up/x", "a/b/c", "a//b",  "a--b/c",
                         "a/b..c",       "-a/b",       "a/b-",      "a/.b",    "a/b.git", "a/b c", "a/",
                         "/b",           "",           "a/caf\xc3\xa9", "~/x", "a\\b/c",
                         "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/b"};
    for (size_t i = 0; i < sizeof good / sizeof *good; i++) CHECK(hub_is_repo_id(good[i]), "%s", good[i]);
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) CHECK(!hub_is_repo_id(bad[i]), "%s", bad[i]);
    CHECK(!hub_is_repo_id(NULL), "NULL");
    char id96[200];
    memset(id96, 'a', 96);
    strcpy(id96 + 96, "/b");
    CHECK(hub_is_repo_id(id96), "96-character owner");

    CHECK(hub_is_commit("0123456789abcdef0123456789abcdef01234567"), "40 hex");
    CHECK(!hub_is_commit("0123456789ABCDEF0123456789abcdef01234567"), "upper case");
    CHECK(!hub_is_commit("0123456789abcdef0123456789abcdef0123456"), "39 hex");
    CHECK(!hub_is_commit("main"), "main");

    const char *revs_ok[] = {"main", "v1.0", "refs/pr/1", "feature/x", "0123456789abcdef0123456789abcdef01234567"};
    const char *revs_bad[] = {"", "/main", "../x", "a/../b", "a//b", ".", "a/", "a\\b", "a\nb"};
    for (size_t i = 0; i < sizeof revs_ok / sizeof *revs_ok; i++) CHECK(hub_revision_ok(revs_ok[i]), "%s", revs_ok[i]);
    for (size_t i = 0; i < sizeof revs_bad / sizeof *revs_bad; i++)
        CHECK(!hub_revision_ok(revs_bad[i]), "%s", revs_bad[i]);
    CHECK(hub_filename_ok("model-00001-of-00002.safetensors") && hub_filename_ok("sub/dir/f.bin"), "file names");
    CHECK(!hub_filename_ok("../etc/passwd") && !hub_filename_ok("/etc/passwd") && !hub_filename_ok("a/./b"),
          "unsafe file names");

    char f[256];
    CHECK(hub_repo_folder("Qwen/Qwen3-0.6B", f, sizeof f) == 0 && !strcmp(f, "models--Qwen--Qwen3-0.6B"), "%s", f);
    CHECK(hub_repo_folder("Qwen/Qwen3-0.6B", f, 10) == -1, "too small");
}

static void clear_env(void) {
    const char *vars[] = {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME", "HF_ENDPOINT",
                          "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                          "HF_TOKEN_PATH", "HF_HUB_DISABLE_IMPLICIT_TOKEN"};
    for (size_t i = 0; i < sizeof vars / sizeof *vars; i++) unsetenv(vars[i]);
}

static void check_cache(const char *want, const char *what) {
    char got[4096];
    CHECK(hub_cache_dir(got, sizeof got) == 0 && !strcmp(got, want), "%s: %s, want %s", what, got, want);
}

static void test_cache_rules(void) {
    clear_env();
    setenv("HOME", "/home/u", 1);
    check_cache("/home/u/.cache/huggingface/hub", "defaults");
    setenv("XDG_CACHE_HOME", "/xdg", 1);
    check_cache("/xdg/huggingface/hub", "XDG_CACHE_HOME");
    setenv("HF_HOME", "~/hfh", 1);
    check_cache("/home/u/hfh/hub", "HF_HOME beats XDG, ~ expanded");
    setenv("HUGGINGFACE_HUB_CACHE", "/legacy", 1);
    check_cache("/legacy", "HUGGINGFACE_HUB_CACHE beats HF_HOME");
    setenv("HF_HUB_CACHE", "$HOME/c/${HOME}/$NOT_SET_VAR_X", 1);
    unsetenv("NOT_SET_VAR_X");
    check_cache("/home/u/c//home/u/$NOT_SET_VAR_X", "HF_HUB_CACHE beats all; $VARS expanded, unset ones kept");
    char h[4096];
    CHECK(hub_home_dir(h, sizeof h) == 0 && !strcmp(h, "/home/u/hfh"), "%s", h);
    clear_env();
    setenv("XDG_CACHE_HOME", "/xdg/", 1);
    check_cache("/xdg/huggingface/hub", "os.path.join with a trailing slash");

    char ex[4096];
    CHECK(hub_expand_path("~", ex, sizeof ex) == 0 && !strcmp(ex, "/home/u"), "%s", ex);
    CHECK(hub_expand_path("a/~b", ex, sizeof ex) == 0 && !strcmp(ex, "a/~b"), "%s", ex);
    CHECK(hub_expand_path("$", ex, sizeof ex) == 0 && !strcmp(ex, "$"), "%s", ex);
    CHECK(hub_expand_path("${}x", ex, sizeof ex) == 0 && !strcmp(ex, "${}x"), "%s", ex);

    char ep[4096];
    clear_env();
    CHECK(hub_endpoint(ep, sizeof ep) == 0 && !strcmp(ep, "https://huggingface.co"), "%s", ep);
    setenv("HF_ENDPOINT", "http://127.0.0.1:8080//", 1);
    CHECK(hub_endpoint(ep, sizeof ep) == 0 && !strcmp(ep, "http://127.0.0.1:8080"), "%s", ep);

    clear_env();
    CHECK(!hub_offline(), "online by default");
    const char *yes[] = {"1", "ON", "yes", "True"}, *no[] = {"0", "off", "no", "2", ""};
    for (size_t i = 0; i < 4; i++) {
        setenv("HF_HUB_OFFLINE", yes[i], 1);
        CHECK(hub_offline(), "HF_HUB_OFFLINE=%s", yes[i]);
    }
    for (size_t i = 0; i < 5; i++) {
        setenv("HF_HUB_OFFLINE", no[i], 1);
        CHECK(!hub_offline(), "HF_HUB_OFFLINE=%s", no[i]);
    }
    setenv("TRANSFORMERS_OFFLINE", "1", 1);
    setenv("HF_HUB_OFFLINE", "", 1);
    CHECK(hub_offline(), "empty HF_HUB_OFFLINE: TRANSFORMERS_OFFLINE counts");
    setenv("HF_HUB_OFFLINE", "0", 1);
    CHECK(!hub_offline(), "HF_HUB_OFFLINE=0 hides TRANSFORMERS_OFFLINE (`a or b`)");
}

static void test_token(const char *tmp) {
    clear_env();
    char t[256], path[4096];
    const char *from;
    snprintf(path, sizeof path, "%s/hfhome", tmp);
    setenv("HF_HOME", path, 1);
    CHECK(hub_token(t, sizeof t, &from) == 0 && !from, "no token anywhere");
    setenv("HF_TOKEN", " \thf_abc\r\n ", 1);
    CHECK(hub_token(t, sizeof t, &from) == 1 && !strcmp(t, "hf_abc") && !strcmp(from, "HF_TOKEN"), "%s", t);
    setenv("HF_TOKEN", "", 1);
    setenv("HUGGING_FACE_HUB_TOKEN", "hf_old", 1);
    CHECK(hub_token(t, sizeof t, NULL) == 1 && !strcmp(t, "hf_old"), "legacy variable: %s", t);
    unsetenv("HF_TOKEN");
    unsetenv("HUGGING_FACE_HUB_TOKEN");
    ct_mkdirs(path, NULL);
    char tf[4200];
    snprintf(tf, sizeof tf, "%s/token", path);
    FILE *f = fopen(tf, "w");
    fputs("hf_from_file\n", f);
    fclose(f);
    CHECK(hub_token(t, sizeof t, NULL) == 1 && !strcmp(t, "hf_from_file"), "HF_HOME/token: %s", t);
    setenv("HF_TOKEN_PATH", "/nonexistent/token", 1);
    CHECK(hub_token(t, sizeof t, NULL) == 0, "HF_TOKEN_PATH elsewhere");
    unsetenv("HF_TOKEN_PATH");
    setenv("HF_TOKEN", "hf_env", 1);
    setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1", 1);
    CHECK(hub_token(t, sizeof t, NULL) == 0, "HF_HUB_DISABLE_IMPLICIT_TOKEN");
    clear_env();
}

static void test_urls_and_links(void) {
    char u[1024];
    CHECK(hub_file_url(u, sizeof u, "https://huggingface.co", "Qwen/Qwen3-0.6B", "main", "config.json") == 0 &&
              !strcmp(u, "https://huggingface.co/Qwen/Qwen3-0.6B/resolve/main/config.json"),
          "%s", u);
    CHECK(hub_file_url(u, sizeof u, "http://h", "o/n", "refs/pr/1", "sub dir/a+b.json") == 0 &&
              !strcmp(u, "http://h/o/n/resolve/refs%2Fpr%2F1/sub%20dir/a%2Bb.json"),
          "quote(revision, safe=''), quote(file): %s", u);
    char t[256];
    CHECK(hub_normalize_etag("W/\"abc\"", t, sizeof t) == 0 && !strcmp(t, "abc"), "%s", t);
    CHECK(hub_normalize_etag("\"0123\"", t, sizeof t) == 0 && !strcmp(t, "0123"), "%s", t);
    CHECK(hub_normalize_etag("plain", t, sizeof t) == 0 && !strcmp(t, "plain"), "%s", t);
    CHECK(hub_blob_link("config.json", "e1", t, sizeof t) == 0 && !strcmp(t, "../../blobs/e1"), "%s", t);
    CHECK(hub_blob_link("a/b/c.bin", "e1", t, sizeof t) == 0 && !strcmp(t, "../../../../blobs/e1"), "%s", t);

    const char *idx = "{\"metadata\": {\"total_size\": 10}, \"weight_map\": {\"a\": \"model-1.safetensors\", "
                      "\"b\": \"model-2.safetensors\", \"c\": \"model-1.safetensors\"}}";
    char **names;
    int n;
    ct_err e = {0};
    CHECK(hub_index_shards(idx, strlen(idx), "idx", &names, &n, &e) == 0 && n == 2 &&
              !strcmp(names[0], "model-1.safetensors") && !strcmp(names[1], "model-2.safetensors"),
          "%d shards", n);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    const char *evil = "{\"weight_map\": {\"a\": \"../../../x.safetensors\"}}";
    CHECK(hub_index_shards(evil, strlen(evil), "idx", &names, &n, &e) == CT_ERR_FORMAT && strstr(e.msg, "idx"),
          "%s", e.msg);
    CHECK(hub_index_shards("{}", 2, "idx", &names, &n, &e) == CT_ERR_FORMAT, "no weight_map");
}

static void hex256(const void *d, size_t n, char *out) {
    hub_sha256_ctx c;
    uint8_t b[32];
    hub_sha256_init(&c);
    /* in uneven pieces: the block framing must not care */
    for (size_t i = 0; i < n;) {
        size_t k = (i % 7) + 1 < n - i ? (i % 7) + 1 : n - i;
        hub_sha256_update(&c, (const char *)d + i, k);
        i += k;
    }
    hub_sha256_final(&c, b);
    hub_hex(b, 32, out);
}

static void test_sha(void) {
    char h[80];
    hex256("", 0, h);
    CHECK(!strcmp(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"), "%s", h);
    hex256("abc", 3, h);
    CHECK(!strcmp(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"), "%s", h);
    char x[64];
    memset(x, 'x', sizeof x);
    const char *want[] = {"d5e285683cd4efc02d021a5c62014694958901005d6f71e89e0989fac77e4072",
                          "04c26261370ee7541549d16dee320c723e3fd14671e66a099afe0a377c16888e",
                          "7ce100971f64e7001e8fe5a51973ecdfe1ced42befe7ee8d5fd6219506b5393c"};
    size_t lens[] = {55, 56, 64}; /* the padding edge cases */
    for (int i = 0; i < 3; i++) {
        hex256(x, lens[i], h);
        CHECK(!strcmp(h, want[i]), "sha256('x' * %zu) = %s", lens[i], h);
    }
    char *m = malloc(1000000);
    memset(m, 'a', 1000000);
    hex256(m, 1000000, h);
    CHECK(!strcmp(h, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"), "%s", h);
    hub_sha1_ctx s;
    uint8_t d[20];
    hub_sha1_init(&s);
    hub_sha1_update(&s, m, 1000000);
    hub_sha1_final(&s, d);
    hub_hex(d, 20, h);
    CHECK(!strcmp(h, "34aa973cd4c4daa4f61eeb2bdbad27316534016f"), "%s", h);
    free(m);
    /* git's blob id, as the Hub's ETag of a regular file: sha1("blob 6\0hello\n") */
    hub_sha1_init(&s);
    hub_sha1_update(&s, "blob 6", 7);
    hub_sha1_update(&s, "hello\n", 6);
    hub_sha1_final(&s, d);
    hub_hex(d, 20, h);
    CHECK(!strcmp(h, "ce013625030ba8dba906f756967f9e9ca394464a"), "%s", h);
}

static void test_resolve_offline(const char *tmp) {
    clear_env();
    char cache[4096], p[4300], q[4300];
    snprintf(cache, sizeof cache, "%s/cache", tmp);
    setenv("HF_HUB_CACHE", cache, 1);
    setenv("HF_HUB_OFFLINE", "1", 1);
    ct_err e = {0};
    hub_local loc;
    /* a local directory is returned as it is, whatever its name */
    CHECK(hub_resolve(tmp, NULL, HUB_MODEL, &loc, &e) == 0 && !strcmp(loc.dir, tmp) && !loc.commit[0], "%s", e.msg);
    /* neither a directory nor an id: a missing directory (exit 1, as import and export give
     * it); to `ctitan download`, which takes ids alone, a bad value */
    CHECK(hub_resolve("./no/such", NULL, HUB_CONFIG, &loc, &e) == CT_ERR_IO && strstr(e.msg, "./no/such") &&
              strstr(e.msg, "no such directory"),
          "%s", e.msg);
    CHECK(hub_resolve("./no/such", NULL, HUB_MODEL | HUB_NO_LOCAL, &loc, &e) == CT_ERR_CONFIG &&
              strstr(e.msg, "./no/such: not a Hugging Face Hub model id"),
          "%s", e.msg);
    /* an id, nothing cached, offline: names the id, the file and the variable */
    CHECK(hub_resolve("org/tiny", NULL, HUB_CONFIG, &loc, &e) == CT_ERR_IO && strstr(e.msg, "org/tiny") &&
              strstr(e.msg, "config.json") && strstr(e.msg, "HF_HUB_OFFLINE"),
          "%s", e.msg);
    /* huggingface_hub's layout by hand: refs/main -> commit -> snapshots/commit/config.json -> blob */
    const char *commit = "0123456789abcdef0123456789abcdef01234567";
    char root[4200];
    snprintf(root, sizeof root, "%s/models--org--tiny", cache);
    snprintf(p, sizeof p, "%s/blobs", root);
    ct_mkdirs(p, NULL);
    snprintf(p, sizeof p, "%s/snapshots/%s", root, commit);
    ct_mkdirs(p, NULL);
    snprintf(p, sizeof p, "%s/refs", root);
    ct_mkdirs(p, NULL);
    snprintf(p, sizeof p, "%s/refs/main", root);
    check_put(NULL, p, commit);
    snprintf(p, sizeof p, "%s/blobs/aaaa", root);
    check_put(NULL, p, "{}");
    snprintf(p, sizeof p, "%s/snapshots/%s/config.json", root, commit);
    CHECK(symlink("../../blobs/aaaa", p) == 0, "symlink");
    CHECK(hub_resolve("org/tiny", NULL, HUB_CONFIG, &loc, &e) == 0, "%s", e.msg);
    snprintf(q, sizeof q, "%s/snapshots/%s", root, commit);
    CHECK(!strcmp(loc.dir, q) && !strcmp(loc.commit, commit) && !strcmp(loc.repo, "org/tiny"), "%s", loc.dir);
    /* a commit revision needs no ref */
    CHECK(hub_resolve("org/tiny", commit, HUB_CONFIG, &loc, &e) == 0 && !strcmp(loc.dir, q), "%s", e.msg);
    /* the weights are not cached: named */
    CHECK(hub_resolve("org/tiny", "main", HUB_CONFIG | HUB_WEIGHTS, &loc, &e) == CT_ERR_IO &&
              strstr(e.msg, "model.safetensors"),
          "%s", e.msg);
    /* a revision with no ref */
    CHECK(hub_resolve("org/tiny", "v2", HUB_CONFIG, &loc, &e) == CT_ERR_IO && strstr(e.msg, "v2"), "%s", e.msg);
    /* a link to a missing blob is not a cached file */
    snprintf(p, sizeof p, "%s/blobs/aaaa", root);
    unlink(p);
    CHECK(hub_resolve("org/tiny", NULL, HUB_CONFIG, &loc, &e) == CT_ERR_IO, "broken link accepted");
    CHECK(hub_resolve("org/tiny", "../x", HUB_CONFIG, &loc, &e) == CT_ERR_CONFIG, "bad revision accepted");
    clear_env();
}

int main(void) {
    char tmp[] = "/tmp/ct_test_hub_XXXXXX";
    if (!mkdtemp(tmp)) return 1;
    test_ids();
    test_cache_rules();
    test_token(tmp);
    test_urls_and_links();
    test_sha();
    test_resolve_offline(tmp);
    ct_rm_tree(tmp, NULL);
    return CHECK_DONE();
}
