/* hub/hub.c: Hub ids resolved in huggingface_hub's cache, downloaded with
 * libcurl when missing.
 *
 * Design note. ctitan reads models from directories, so a Hub id is turned
 * into one directory before anything else looks at it: the cache's
 * snapshots/<commit>/ of the revision, holding the files the caller asked for
 * (config, tokenizer, weights). Nothing downstream knows about the Hub.
 *
 * The cache is huggingface_hub's own (file_download.py, constants.py), not a
 * look-alike, so that one download serves ctitan, `hf` and transformers:
 *
 *   {HF_HUB_CACHE}/models--{owner}--{name}/
 *     refs/{revision}                 the commit, no newline (tmp file + rename)
 *     blobs/{etag}                    the content; LFS files: etag = sha256
 *     blobs/{etag}.incomplete         a download in progress (resumable)
 *     snapshots/{commit}/{file}    -> ../../blobs/{etag} (relative symlink)
 *     .no_exist/{commit}/{file}       the repo has no such file (optional ones)
 *   {HF_HUB_CACHE}/.locks/models--{owner}--{name}/{etag}.lock   flock(2), as filelock takes it
 *
 * Per file, as hf_hub_download does: a commit revision whose snapshot has the
 * file needs no network. Otherwise a HEAD of
 * {HF_ENDPOINT}/{repo}/resolve/{revision}/{file} (Accept-Encoding: identity,
 * the token as Bearer) following only redirects that stay on the Hub's origin
 * gives X-Repo-Commit, the etag (X-Linked-Etag, else ETag), the size
 * (X-Linked-Size, else Content-Length) and, for LFS files, the CDN Location
 * the GET then fetches without the token. The first HEAD fixes the commit;
 * the other files are asked for at that commit, so one snapshot never mixes
 * two commits even if the branch moves meanwhile. X-Error-Code tells
 * RepoNotFound, GatedRepo, RevisionNotFound and EntryNotFound apart. When the
 * Hub cannot be reached (or refuses: private, gated) a cached copy of the
 * revision is used, as huggingface_hub does; offline mode (HF_HUB_OFFLINE,
 * TRANSFORMERS_OFFLINE) reads the cache only.
 *
 * A download holds the blob's lock, appends to blobs/{etag}.incomplete
 * (resuming with Range after a dropped connection: up to 5 retries without
 * progress, 1 s apart, as http_get; a leftover .incomplete of a killed run
 * is resumed too), checks the size and the checksum the etag is (sha256 for
 * a 64-hex LFS etag, git's blob sha1 for a 40-hex one; other etags: size
 * only), fsyncs and only then renames it to blobs/{etag} and links it into
 * the snapshot. A file that is not complete and verified never has a name
 * that looks complete; a wrong checksum deletes the partial file.
 *
 * Error kinds (core/err.h): CT_ERR_CONFIG (exit 2) when the name given
 * cannot be used (neither a directory nor an id, an unknown repo or
 * revision, a private or gated repo without a token that can read it);
 * CT_ERR_IO (exit 1) for the rest (a file the repo lacks, the network lost,
 * a corrupt download, a full disk, offline and not cached).
 *
 * Built with CT_NO_CURL (make NO_CURL=1) there is no network: ids resolve
 * from the cache alone and a missing file says how to fetch it. */
#include "hub/hub.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <pwd.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#ifndef CT_NO_CURL
#include <curl/curl.h>
#endif

#include "core/fs.h"
#include "formats/json.h"
#include "core/progress.h"
#include "core/timer.h"

#define HUB_PATH 4096

/* ------------------------------------------------------------ SHA-256, SHA-1 */

static uint32_t ror32(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
static uint32_t rol32(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }
static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static const uint32_t sha256_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

static void sha256_block(uint32_t h[8], const uint8_t *p) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) w[i] = be32(p + 4 * i);
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ror32(w[i - 15], 7) ^ ror32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ror32(w[i - 2], 17) ^ ror32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ror32(e, 6) ^ ror32(e, 11) ^ ror32(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[i] + w[i];
        uint32_t t2 = (ror32(a, 2) ^ ror32(a, 13) ^ ror32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += k;
}

static void sha1_block(uint32_t h[5], const uint8_t *p) {
    uint32_t w[80];
    for (int i = 0; i < 16; i++) w[i] = be32(p + 4 * i);
    for (int i = 16; i < 80; i++) w[i] = rol32(w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16], 1);
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
    for (int i = 0; i < 80; i++) {
        uint32_t f, k;
        if (i < 20) f = (b & c) | (~b & d), k = 0x5a827999;
        else if (i < 40) f = b ^ c ^ d, k = 0x6ed9eba1;
        else if (i < 60) f = (b & c) | (b & d) | (c & d), k = 0x8f1bbcdc;
        else f = b ^ c ^ d, k = 0xca62c1d6;
        uint32_t t = rol32(a, 5) + f + e + k + w[i];
        e = d, d = c, c = rol32(b, 30), b = a, a = t;
    }
    h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e;
}

/* The Merkle-Damgard framing both share: 64-byte blocks, a 0x80 byte, zeros and the bit length. */
static void md_update(uint32_t *h, uint64_t *n, uint8_t *buf, const void *data, size_t len,
                      void (*block)(uint32_t *, const uint8_t *)) {
    const uint8_t *p = data;
    size_t have = (size_t)(*n % 64);
    *n += len;
    if (have) {
        size_t take = 64 - have < len ? 64 - have : len;
        memcpy(buf + have, p, take);
        p += take, len -= take, have += take;
        if (have < 64) return;
        block(h, buf);
    }
    for (; len >= 64; p += 64, len -= 64) block(h, p);
    memcpy(buf, p, len);
}

static void md_final(uint32_t *h, uint64_t n, uint8_t *buf, void (*block)(uint32_t *, const uint8_t *)) {
    size_t have = (size_t)(n % 64);
    buf[have++] = 0x80;
    if (have > 56) {
        memset(buf + have, 0, 64 - have);
        block(h, buf);
        have = 0;
    }
    memset(buf + have, 0, 56 - have);
    uint64_t bits = n * 8;
    for (int i = 0; i < 8; i++) buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    block(h, buf);
}

void hub_sha256_init(hub_sha256_ctx *c) {
    static const uint32_t h0[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(c->h, h0, sizeof h0);
    c->n = 0;
}
void hub_sha256_update(hub_sha256_ctx *c, const void *data, size_t len) {
    md_update(c->h, &c->n, c->buf, data, len, sha256_block);
}
void hub_sha256_final(hub_sha256_ctx *c, uint8_t out[32]) {
    md_final(c->h, c->n, c->buf, sha256_block);
    for (int i = 0; i < 32; i++) out[i] = (uint8_t)(c->h[i / 4] >> (24 - 8 * (i % 4)));
}
void hub_sha1_init(hub_sha1_ctx *c) {
    static const uint32_t h0[5] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476, 0xc3d2e1f0};
    memcpy(c->h, h0, sizeof h0);
    c->n = 0;
}
void hub_sha1_update(hub_sha1_ctx *c, const void *data, size_t len) {
    md_update(c->h, &c->n, c->buf, data, len, sha1_block);
}
void hub_sha1_final(hub_sha1_ctx *c, uint8_t out[20]) {
    md_final(c->h, c->n, c->buf, sha1_block);
    for (int i = 0; i < 20; i++) out[i] = (uint8_t)(c->h[i / 4] >> (24 - 8 * (i % 4)));
}

void hub_hex(const uint8_t *b, size_t n, char *out) {
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) out[2 * i] = d[b[i] >> 4], out[2 * i + 1] = d[b[i] & 15];
    out[2 * n] = 0;
}

/* ------------------------------------------------------------ names */

static int is_word(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_'; }

/* One part of an id: 1-96 of [\w.-], first and last \w (the regex's \b on both sides). */
static int id_part_ok(const char *s, size_t n) {
    if (n < 1 || n > 96 || !is_word((unsigned char)s[0]) || !is_word((unsigned char)s[n - 1])) return 0;
    for (size_t i = 0; i < n; i++)
        if (!is_word((unsigned char)s[i]) && s[i] != '-' && s[i] != '.') return 0;
    return 1;
}

int hub_is_repo_id(const char *s) {
    if (!s) return 0;
    const char *slash = strchr(s, '/');
    if (!slash || strchr(slash + 1, '/')) return 0;
    if (!id_part_ok(s, (size_t)(slash - s)) || !id_part_ok(slash + 1, strlen(slash + 1))) return 0;
    if (strstr(s, "--") || strstr(s, "..")) return 0;
    size_t n = strlen(s);
    return !(n >= 4 && !strcmp(s + n - 4, ".git"));
}

int hub_is_commit(const char *s) {
    if (!s) return 0;
    int n = 0;
    for (; s[n]; n++)
        if (!((s[n] >= '0' && s[n] <= '9') || (s[n] >= 'a' && s[n] <= 'f'))) return 0;
    return n == 40;
}

/* A relative path of "/"-separated components, none empty, "." or "..". */
static int rel_path_ok(const char *s, size_t max) {
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n >= max || s[0] == '/') return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 || s[i] == 0x7f || s[i] == '\\') return 0;
    for (const char *p = s;;) {
        const char *q = strchr(p, '/');
        size_t k = q ? (size_t)(q - p) : strlen(p);
        if (k == 0 || (k == 1 && p[0] == '.') || (k == 2 && p[0] == '.' && p[1] == '.')) return 0;
        if (!q) return 1;
        p = q + 1;
    }
}

int hub_revision_ok(const char *rev) { return rel_path_ok(rev, 256); }
int hub_filename_ok(const char *name) { return rel_path_ok(name, 1024); }

int hub_repo_folder(const char *repo, char *out, size_t cap) {
    /* "models" + "--" + the id with every "/" as "--" (repo_folder_name) */
    size_t k = 0;
    if (cap < 9) return -1;
    memcpy(out, "models--", 8);
    k = 8;
    for (const char *p = repo; *p; p++) {
        if (k + 3 >= cap) return -1;
        if (*p == '/') out[k++] = '-', out[k++] = '-';
        else out[k++] = *p;
    }
    out[k] = 0;
    return 0;
}

/* ------------------------------------------------------------ environment (constants.py) */

static int put(char *out, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int put(char *out, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    return n < 0 || (size_t)n >= cap ? -1 : 0;
}

/* os.path.join(a, b) for a relative b: a + "/" + b unless a is empty or ends in "/". */
static int py_join(char *out, size_t cap, const char *a, const char *b) {
    if (b[0] == '/' || !a[0]) return put(out, cap, "%s", b);
    return put(out, cap, "%s%s%s", a, a[strlen(a) - 1] == '/' ? "" : "/", b);
}

/* posixpath.expanduser */
static int expanduser(const char *in, char *out, size_t cap) {
    if (in[0] != '~') return put(out, cap, "%s", in);
    const char *rest = strchr(in, '/');
    size_t ulen = rest ? (size_t)(rest - in - 1) : strlen(in + 1);
    const char *home = NULL;
    /* the _r lookups: getpwuid's result lives in libc's one static buffer, which
     * two sessions resolving paths in two threads would share */
    struct passwd pwbuf, *pw = NULL;
    char pwtext[4096];
    if (ulen == 0) {
        home = getenv("HOME");
        if (!home && getpwuid_r(getuid(), &pwbuf, pwtext, sizeof pwtext, &pw) == 0 && pw) home = pw->pw_dir;
    } else {
        char user[256];
        if (ulen >= sizeof user) return put(out, cap, "%s", in);
        memcpy(user, in + 1, ulen);
        user[ulen] = 0;
        if (getpwnam_r(user, &pwbuf, pwtext, sizeof pwtext, &pw) == 0 && pw) home = pw->pw_dir;
    }
    if (!home) return put(out, cap, "%s", in);
    size_t hl = strlen(home);
    while (hl > 1 && home[hl - 1] == '/') hl--; /* userhome.rstrip("/"), "/" kept */
    if (hl == 1 && home[0] == '/' && rest) hl = 0;
    return put(out, cap, "%.*s%s", (int)hl, home, rest ? rest : "");
}

/* posixpath.expandvars: $NAME and ${NAME} of set variables replaced, the rest left as it is. */
static int expandvars(const char *in, char *out, size_t cap) {
    size_t k = 0;
    for (const char *p = in; *p;) {
        const char *name = NULL, *end = NULL;
        size_t nl = 0;
        if (p[0] == '$' && p[1] == '{') {
            const char *close = strchr(p + 2, '}');
            if (close && close > p + 2) name = p + 2, nl = (size_t)(close - name), end = close + 1;
        } else if (p[0] == '$' && is_word((unsigned char)p[1])) {
            name = p + 1;
            while (is_word((unsigned char)name[nl])) nl++;
            end = name + nl;
        }
        const char *val = NULL;
        if (name && nl < 256) {
            char var[256];
            memcpy(var, name, nl);
            var[nl] = 0;
            val = getenv(var);
        }
        const char *src = val ? val : p;
        size_t sl = val ? strlen(val) : (name ? (size_t)(end - p) : 1);
        if (k + sl >= cap) return -1;
        memcpy(out + k, src, sl);
        k += sl;
        p = val || name ? end : p + 1;
    }
    if (k >= cap) return -1;
    out[k] = 0;
    return 0;
}

int hub_expand_path(const char *in, char *out, size_t cap) {
    char tmp[HUB_PATH];
    if (expanduser(in, tmp, sizeof tmp)) return -1;
    return expandvars(tmp, out, cap);
}

int hub_home_dir(char *out, size_t cap) {
    const char *v = getenv("HF_HOME");
    char raw[HUB_PATH];
    if (v) {
        if (put(raw, sizeof raw, "%s", v)) return -1;
    } else {
        const char *xdg = getenv("XDG_CACHE_HOME");
        char base[HUB_PATH];
        if (xdg) {
            if (put(base, sizeof base, "%s", xdg)) return -1;
        } else {
            char home[HUB_PATH];
            if (expanduser("~", home, sizeof home) || py_join(base, sizeof base, home, ".cache")) return -1;
        }
        if (py_join(raw, sizeof raw, base, "huggingface")) return -1;
    }
    return hub_expand_path(raw, out, cap);
}

int hub_cache_dir(char *out, size_t cap) {
    const char *v = getenv("HF_HUB_CACHE");
    if (!v) v = getenv("HUGGINGFACE_HUB_CACHE");
    if (v) return hub_expand_path(v, out, cap);
    char home[HUB_PATH], raw[HUB_PATH];
    if (hub_home_dir(home, sizeof home) || py_join(raw, sizeof raw, home, "hub")) return -1;
    return hub_expand_path(raw, out, cap);
}

int hub_endpoint(char *out, size_t cap) {
    const char *v = getenv("HF_ENDPOINT");
    if (put(out, cap, "%s", v ? v : "https://huggingface.co")) return -1;
    size_t n = strlen(out);
    while (n && out[n - 1] == '/') out[--n] = 0;
    return 0;
}

static int env_true(const char *v) {
    return v && (!strcasecmp(v, "1") || !strcasecmp(v, "ON") || !strcasecmp(v, "YES") || !strcasecmp(v, "TRUE"));
}

/* The variable that makes it offline, or NULL. */
static const char *offline_var(void) {
    const char *v = getenv("HF_HUB_OFFLINE");
    if (v && *v) return env_true(v) ? "HF_HUB_OFFLINE" : NULL;
    return env_true(getenv("TRANSFORMERS_OFFLINE")) ? "TRANSFORMERS_OFFLINE" : NULL;
}

int hub_offline(void) { return offline_var() != NULL; }

/* _clean_token: \r and \n removed, surrounding whitespace stripped; 1 if anything is left. */
static int clean_token(const char *in, char *out, size_t cap) {
    size_t k = 0;
    for (const char *p = in; *p && k + 1 < cap; p++)
        if (*p != '\r' && *p != '\n') out[k++] = *p;
    out[k] = 0;
    while (k && isspace((unsigned char)out[k - 1])) out[--k] = 0;
    size_t s = 0;
    while (out[s] && isspace((unsigned char)out[s])) s++;
    memmove(out, out + s, k - s + 1);
    return out[0] != 0;
}

int hub_token(char *out, size_t cap, const char **from) {
    if (from) *from = NULL;
    out[0] = 0;
    if (env_true(getenv("HF_HUB_DISABLE_IMPLICIT_TOKEN"))) return 0;
    const char *v = getenv("HF_TOKEN");
    const char *name = "HF_TOKEN";
    if (!v || !*v) v = getenv("HUGGING_FACE_HUB_TOKEN"), name = "HUGGING_FACE_HUB_TOKEN";
    if (v && clean_token(v, out, cap)) {
        if (from) *from = name;
        return 1;
    }
    char path[HUB_PATH], raw[HUB_PATH];
    const char *tp = getenv("HF_TOKEN_PATH");
    if (tp) {
        if (hub_expand_path(tp, path, sizeof path)) return 0;
    } else {
        char home[HUB_PATH];
        if (hub_home_dir(home, sizeof home) || py_join(raw, sizeof raw, home, "token") ||
            hub_expand_path(raw, path, sizeof path))
            return 0;
    }
    size_t len;
    char *text = fs_read_file(path, 0, &len, NULL);
    if (!text) return 0;
    int ok = clean_token(text, out, cap);
    free(text);
    if (ok && from) *from = "the token file (HF_TOKEN_PATH, default HF_HOME/token)";
    return ok;
}

/* urllib.parse.quote: letters, digits, "_.-~" and `safe` kept, the rest %XX. */
static int url_quote(char *out, size_t cap, size_t *k, const char *s, const char *safe) {
    static const char hx[] = "0123456789ABCDEF";
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (is_word(*p) || *p == '.' || *p == '-' || *p == '~' || (*p && strchr(safe, *p))) {
            if (*k + 1 >= cap) return -1;
            out[(*k)++] = (char)*p;
        } else {
            if (*k + 3 >= cap) return -1;
            out[(*k)++] = '%', out[(*k)++] = hx[*p >> 4], out[(*k)++] = hx[*p & 15];
        }
    }
    out[*k] = 0;
    return 0;
}

int hub_file_url(char *out, size_t cap, const char *endpoint, const char *repo, const char *revision,
                 const char *file) {
    if (put(out, cap, "%s/%s/resolve/", endpoint, repo)) return -1;
    size_t k = strlen(out);
    if (url_quote(out, cap, &k, revision, "") || k + 1 >= cap) return -1;
    out[k++] = '/';
    return url_quote(out, cap, &k, file, "/");
}

int hub_normalize_etag(const char *etag, char *out, size_t cap) {
    /* etag.lstrip("W/").strip('"'): every leading 'W' and '/', then quotes at both ends */
    const char *p = etag;
    while (*p == 'W' || *p == '/') p++;
    while (*p == '"') p++;
    size_t n = strlen(p);
    while (n && p[n - 1] == '"') n--;
    return put(out, cap, "%.*s", (int)n, p);
}

int hub_blob_link(const char *file, const char *etag, char *out, size_t cap) {
    size_t k = 0;
    int up = 2;
    for (const char *p = file; *p; p++) up += *p == '/';
    for (int i = 0; i < up; i++) {
        if (k + 3 >= cap) return -1;
        memcpy(out + k, "../", 3);
        k += 3;
    }
    return put(out + k, cap - k, "blobs/%s", etag);
}

int hub_index_shards(const char *json, size_t len, const char *what, char ***names, int *n, ct_err *e) {
    *names = NULL;
    *n = 0;
    cJSON *root = json_parse(json, len, what, e);
    if (!root) return CT_ERR_FORMAT;
    const cJSON *map = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map") : NULL;
    if (!cJSON_IsObject(map)) {
        cJSON_Delete(root);
        return ct_fail(e, CT_ERR_FORMAT, "%s: not a safetensors index (no \"weight_map\" object)", what);
    }
    int cap = 0, rc = 0;
    char **v = NULL;
    for (const cJSON *it = map->child; it && !rc; it = it->next) {
        if (!cJSON_IsString(it) || !hub_filename_ok(it->valuestring)) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: weight_map[\"%s\"] is not a file name of the repo", what,
                         it->string ? it->string : "?");
            break;
        }
        int seen = 0;
        for (int i = 0; i < *n && !seen; i++) seen = !strcmp(v[i], it->valuestring);
        if (seen) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 8;
            char **nv = realloc(v, (size_t)cap * sizeof *v);
            if (!nv) {
                rc = ct_fail(e, CT_ERR_IO, "%s: out of memory", what);
                break;
            }
            v = nv;
        }
        v[(*n)++] = ct_strdup(it->valuestring);
    }
    cJSON_Delete(root);
    if (!rc && *n == 0) rc = ct_fail(e, CT_ERR_FORMAT, "%s: weight_map lists no files", what);
    if (rc) {
        for (int i = 0; i < *n; i++) free(v[i]);
        free(v);
        *n = 0;
        return rc;
    }
    *names = v;
    return 0;
}

/* ------------------------------------------------------------ the cache */

typedef struct {
    const char *repo, *rev;       /* as given ("main" for none) */
    char cache[HUB_PATH];         /* HF_HUB_CACHE */
    char storage[HUB_PATH];       /* cache/models--owner--name */
    char endpoint[2048];
    char token[2048];
    const char *token_from;       /* NULL: no token */
    const char *offline;          /* the variable, "no-curl", or NULL */
    char commit[64];              /* the snapshot's commit, once known */
    int net_down;                 /* the Hub could not be reached: the cache only from now on */
    char net_why[512];
    int warned;
} hub_ctx;

static int is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static int exists(const char *p) { /* follows the symlink: a snapshot link to a missing blob does not count */
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

static int snap_path(const hub_ctx *h, const char *commit, const char *file, char *out, size_t cap) {
    return put(out, cap, "%s/snapshots/%s%s%s", h->storage, commit, file ? "/" : "", file ? file : "");
}

/* The commit a revision names in the cache: itself for a commit, refs/<rev> otherwise; "" if none. */
static void cached_commit(const hub_ctx *h, char *out, size_t cap) {
    out[0] = 0;
    if (hub_is_commit(h->rev)) {
        put(out, cap, "%s", h->rev);
        return;
    }
    char p[HUB_PATH];
    if (put(p, sizeof p, "%s/refs/%s", h->storage, h->rev)) return;
    size_t len;
    char *t = fs_read_file(p, 0, &len, NULL);
    if (!t) return;
    size_t n = strlen(t);
    while (n && isspace((unsigned char)t[n - 1])) t[--n] = 0;
    if (n && n < cap && !strchr(t, '/') && strcmp(t, ".") && strcmp(t, "..")) put(out, cap, "%s", t);
    free(t);
}

/* How to get a file into the cache when this process may not download it. */
static int not_cached(const hub_ctx *h, const char *file, ct_err *e) {
    char c[64], snap[128] = "";
    cached_commit(h, c, sizeof c);
    if (h->commit[0]) put(c, sizeof c, "%s", h->commit);
    if (c[0]) snprintf(snap, sizeof snap, " (snapshot %s)", c);
    const char *why, *todo;
    if (h->offline && !strcmp(h->offline, "no-curl")) {
        why = "this ctitan was built without libcurl (NO_CURL=1) and cannot download";
        todo = "fetch the model into this cache where the Hub is reachable (`hf download ID`, or `ctitan download ID` "
               "from a build with libcurl)";
    } else if (h->offline) {
        why = !strcmp(h->offline, "HF_HUB_OFFLINE") ? "HF_HUB_OFFLINE is set (the cache only)"
                                                    : "TRANSFORMERS_OFFLINE is set (the cache only)";
        todo = "unset it to download, or fetch the model first (`ctitan download ID`, `hf download ID`)";
    } else {
        why = h->net_why[0] ? h->net_why : "the Hub could not be reached";
        todo = "check the network and HF_ENDPOINT";
    }
    return ct_fail(e, CT_ERR_IO,
                   "%s: no such local directory, and as a Hub id: %s (revision %s) is not in the Hugging Face cache "
                   "%s%s, and %s; %s",
                   h->repo, file, h->rev, h->storage, snap, why, todo);
}

/* The cached copy of file in the revision's snapshot, if any: 1 and the commit set. */
static int from_cache(hub_ctx *h, const char *file) {
    char c[64], p[HUB_PATH];
    if (h->commit[0]) put(c, sizeof c, "%s", h->commit);
    else cached_commit(h, c, sizeof c);
    if (!c[0] || snap_path(h, c, file, p, sizeof p) || !exists(p)) return 0;
    if (!h->commit[0]) put(h->commit, sizeof h->commit, "%s", c);
    return 1;
}

#ifndef CT_NO_CURL
/* Writes refs/<rev> = commit (tmp file + rename) when rev is not the commit and the ref differs. */
static int write_ref(const hub_ctx *h, ct_err *e) {
    if (!strcmp(h->rev, h->commit)) return 0;
    char p[HUB_PATH], tmp[HUB_PATH + 32], dir[HUB_PATH];
    if (put(p, sizeof p, "%s/refs/%s", h->storage, h->rev)) return ct_fail(e, CT_ERR_IO, "%s: path too long", h->storage);
    size_t len;
    char *old = fs_read_file(p, 0, &len, NULL);
    int same = old && !strcmp(old, h->commit);
    free(old);
    if (same) return 0;
    put(dir, sizeof dir, "%s", p);
    *strrchr(dir, '/') = 0;
    if (ct_mkdirs(dir, e)) return CT_ERR_IO;
    put(tmp, sizeof tmp, "%s.%ld.tmp", p, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    int ok = f && fputs(h->commit, f) >= 0;
    if (f && fclose(f) != 0) ok = 0;
    if (ok && rename(tmp, p) == 0) return 0;
    int err = errno;
    unlink(tmp);
    return ct_fail(e, CT_ERR_IO, "%s: cannot write the ref: %s", p, strerror(err));
}

/* snapshots/<commit>/ exists before any ref names it: scan_cache_dir rejects a ref to a missing snapshot. */
static int set_commit(hub_ctx *h, const char *commit, ct_err *e) {
    if (!h->commit[0]) put(h->commit, sizeof h->commit, "%s", commit);
    char d[HUB_PATH];
    if (snap_path(h, h->commit, NULL, d, sizeof d)) return ct_fail(e, CT_ERR_IO, "%s: path too long", h->storage);
    if (ct_mkdirs(d, e)) return CT_ERR_IO;
    char tag[HUB_PATH];
    if (!put(tag, sizeof tag, "%s/CACHEDIR.TAG", h->cache) && access(tag, F_OK) != 0) {
        FILE *f = fopen(tag, "wb"); /* the Cache Directory Tagging Standard, as huggingface_hub writes it */
        if (f) {
            fputs("Signature: 8a477f597d28d172789f06886806bc55\n"
                  "# This file is a cache directory tag created by huggingface_hub.\n"
                  "# For information about cache directory tags, see:\n"
                  "#\thttps://bford.info/cachedir/\n", f);
            fclose(f);
        }
    }
    return write_ref(h, e);
}

/* snapshots/<commit>/<file> -> ../../blobs/<etag>, put in place by rename (atomic). */
static int link_pointer(const hub_ctx *h, const char *file, const char *etag, ct_err *e) {
    char ptr[HUB_PATH], target[HUB_PATH], tmp[HUB_PATH + 32], dir[HUB_PATH];
    if (snap_path(h, h->commit, file, ptr, sizeof ptr) || hub_blob_link(file, etag, target, sizeof target))
        return ct_fail(e, CT_ERR_IO, "%s: path too long", h->storage);
    put(dir, sizeof dir, "%s", ptr);
    *strrchr(dir, '/') = 0;
    if (ct_mkdirs(dir, e)) return CT_ERR_IO;
    put(tmp, sizeof tmp, "%s.%ld.tmp", ptr, (long)getpid());
    unlink(tmp);
    if (symlink(target, tmp) != 0 || rename(tmp, ptr) != 0) {
        int err = errno;
        unlink(tmp);
        return ct_fail(e, CT_ERR_IO, "%s: cannot link it to %s: %s", ptr, target, strerror(err));
    }
    return 0;
}

static void no_exist(const hub_ctx *h, const char *commit, const char *file) {
    char p[HUB_PATH], d[HUB_PATH];
    if (put(p, sizeof p, "%s/.no_exist/%s/%s", h->storage, commit, file)) return;
    put(d, sizeof d, "%s", p);
    *strrchr(d, '/') = 0;
    if (ct_mkdirs(d, NULL)) return;
    int fd = open(p, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) close(fd);
}

static void human_bytes(char *out, size_t cap, double b) {
    const char *u[] = {"B", "kB", "MB", "GB", "TB"};
    int i = 0;
    while (b >= 1000 && i < 4) b /= 1000, i++;
    snprintf(out, cap, i ? "%.1f %s" : "%.0f %s", b, u[i]);
}

/* ------------------------------------------------------------ HTTP (libcurl) */

typedef struct {
    long status;
    char commit[128], etag[512], linked_etag[512], location[4096], error_code[64], error_message[256];
    char content_range[128];
    long long linked_size, content_length;
} hub_headers;

static void headers_reset(hub_headers *hd) {
    memset(hd, 0, sizeof *hd);
    hd->linked_size = hd->content_length = -1;
}

static size_t on_header(char *buf, size_t size, size_t nitems, void *ud) {
    hub_headers *hd = ud;
    size_t n = size * nitems;
    if (n >= 5 && !strncmp(buf, "HTTP/", 5)) { /* a new response (after a redirect): its headers only */
        headers_reset(hd);
        const char *sp = memchr(buf, ' ', n);
        if (sp) hd->status = strtol(sp + 1, NULL, 10);
        return n;
    }
    const char *colon = memchr(buf, ':', n);
    if (!colon) return n;
    size_t nl = (size_t)(colon - buf);
    const char *v = colon + 1, *end = buf + n;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\t')) end--;
    int vl = (int)(end - v);
    static const struct {
        const char *name;
        size_t off, cap;
    } want[] = {
        {"X-Repo-Commit", offsetof(hub_headers, commit), sizeof(((hub_headers *)0)->commit)},
        {"ETag", offsetof(hub_headers, etag), sizeof(((hub_headers *)0)->etag)},
        {"X-Linked-Etag", offsetof(hub_headers, linked_etag), sizeof(((hub_headers *)0)->linked_etag)},
        {"Location", offsetof(hub_headers, location), sizeof(((hub_headers *)0)->location)},
        {"X-Error-Code", offsetof(hub_headers, error_code), sizeof(((hub_headers *)0)->error_code)},
        {"X-Error-Message", offsetof(hub_headers, error_message), sizeof(((hub_headers *)0)->error_message)},
        {"Content-Range", offsetof(hub_headers, content_range), sizeof(((hub_headers *)0)->content_range)},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (strlen(want[i].name) == nl && !strncasecmp(buf, want[i].name, nl)) {
            snprintf((char *)hd + want[i].off, want[i].cap, "%.*s", vl, v);
            return n;
        }
    if (nl == 13 && !strncasecmp(buf, "X-Linked-Size", nl)) hd->linked_size = strtoll(v, NULL, 10);
    if (nl == 14 && !strncasecmp(buf, "Content-Length", nl)) hd->content_length = strtoll(v, NULL, 10);
    return n;
}

/* curl_global_init once per process, whichever thread (a library session's
 * trainer_init) gets here first: a plain flag would race. */
static pthread_once_t curl_init_once = PTHREAD_ONCE_INIT;
static void curl_init(void) { curl_global_init(CURL_GLOBAL_DEFAULT); }
static void curl_once(void) { pthread_once(&curl_init_once, curl_init); }

/* The origin (scheme, host, port) of a URL; 0 on success. */
static int url_origin(const char *url, char *scheme, char *host, long *port) {
    CURLU *u = curl_url();
    char *s = NULL, *hst = NULL, *p = NULL;
    int rc = !u || curl_url_set(u, CURLUPART_URL, url, 0) || curl_url_get(u, CURLUPART_SCHEME, &s, 0) ||
             curl_url_get(u, CURLUPART_HOST, &hst, 0) || curl_url_get(u, CURLUPART_PORT, &p, CURLU_DEFAULT_PORT);
    if (!rc) {
        snprintf(scheme, 16, "%s", s);
        snprintf(host, 256, "%s", hst);
        for (char *c = host; *c; c++) *c = (char)tolower((unsigned char)*c);
        *port = strtol(p, NULL, 10);
    }
    curl_free(s), curl_free(hst), curl_free(p);
    curl_url_cleanup(u);
    return rc;
}

/* _is_same_or_hub_host: target on url's origin, or on a Hub origin (huggingface.co, the staging
 * Hub, the endpoint): those may see the token and their redirects are followed. */
static int same_or_hub(const hub_ctx *h, const char *url, const char *target) {
    char ts[16], th[256], s[16], host[256];
    long tp, p;
    if (url_origin(target, ts, th, &tp)) return 0;
    const char *origins[] = {url, "https://huggingface.co", "https://hub-ci.huggingface.co", h->endpoint};
    for (size_t i = 0; i < sizeof origins / sizeof origins[0]; i++)
        if (!url_origin(origins[i], s, host, &p) && !strcmp(s, ts) && !strcmp(host, th) && p == tp) return 1;
    return 0;
}

/* url joined with a Location (absolute, or relative to url). */
static int url_join(const char *url, const char *loc, char *out, size_t cap) {
    CURLU *u = curl_url();
    char *s = NULL;
    int rc = !u || curl_url_set(u, CURLUPART_URL, url, 0) || curl_url_set(u, CURLUPART_URL, loc, 0) ||
             curl_url_get(u, CURLUPART_URL, &s, 0) || put(out, cap, "%s", s);
    curl_free(s);
    curl_url_cleanup(u);
    return rc;
}

static struct curl_slist *base_headers(const hub_ctx *h, int auth, int identity) {
    struct curl_slist *l = NULL;
    char line[2200];
    l = curl_slist_append(l, "User-Agent: ctitan; hf_hub-compatible; libcurl");
    if (identity) l = curl_slist_append(l, "Accept-Encoding: identity");
    if (auth && h->token_from) {
        snprintf(line, sizeof line, "Authorization: Bearer %s", h->token);
        l = curl_slist_append(l, line);
    }
    return l;
}

static long env_timeout(const char *name) {
    const char *v = getenv(name);
    long t = v ? strtol(v, NULL, 10) : 0;
    return t > 0 ? t : 10;
}

static void common_opts(CURL *c, char *errbuf) {
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, errbuf);
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(c, CURLOPT_REDIR_PROTOCOLS_STR, "http,https");
}

/* HEAD url, following the redirects that stay on the Hub (same origin or a Hub origin), as
 * _httpx2_follow_hub_redirects_with_backoff. 0 with hd filled (any status; *final = the last URL
 * asked), or -1 on a connection failure with the reason in why. */
static int head(const hub_ctx *h, const char *url, hub_headers *hd, char *final, size_t fcap, char *why, size_t wcap) {
    curl_once();
    char cur[4096], errbuf[CURL_ERROR_SIZE];
    put(cur, sizeof cur, "%s", url);
    for (int hop = 0; hop < 10; hop++) {
        CURL *c = curl_easy_init();
        if (!c) return put(why, wcap, "libcurl could not start"), -1;
        errbuf[0] = 0;
        headers_reset(hd);
        struct curl_slist *hl = base_headers(h, 1, 1);
        common_opts(c, errbuf);
        curl_easy_setopt(c, CURLOPT_URL, cur);
        curl_easy_setopt(c, CURLOPT_NOBODY, 1L);
        curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, hl);
        curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
        curl_easy_setopt(c, CURLOPT_HEADERDATA, hd);
        long t = env_timeout("HF_HUB_ETAG_TIMEOUT");
        curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, t);
        curl_easy_setopt(c, CURLOPT_TIMEOUT, t);
        CURLcode rc = curl_easy_perform(c);
        if (rc == CURLE_OK) curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &hd->status);
        curl_slist_free_all(hl);
        curl_easy_cleanup(c);
        if (rc != CURLE_OK) {
            put(why, wcap, "%s", errbuf[0] ? errbuf : curl_easy_strerror(rc));
            return -1;
        }
        put(final, fcap, "%s", cur);
        if (hd->status < 300 || hd->status >= 400 || !hd->location[0]) return 0;
        char target[4096];
        if (url_join(cur, hd->location, target, sizeof target)) return 0;
        put(hd->location, sizeof hd->location, "%s", target);
        if (!same_or_hub(h, cur, target)) return 0; /* a CDN: the metadata is on this response */
        put(cur, sizeof cur, "%s", target);
    }
    put(why, wcap, "more than 10 redirects from %s", url);
    return -1;
}

/* ---- one GET into the .incomplete file */

typedef struct {
    CURL *c;
    int fd;
    long long off;      /* bytes in the file */
    int checked, bad, restart, werr;
    hub_headers *hd;
    hub_sha256_ctx *sha; /* NULL: no streaming hash */
    prog_bar *bar;
    char body[512];     /* an error response's start */
    size_t body_n;
} hub_get;

static size_t on_data(char *p, size_t size, size_t nm, void *ud) {
    hub_get *g = ud;
    size_t n = size * nm;
    if (!g->checked) {
        g->checked = 1;
        long code = 0;
        curl_easy_getinfo(g->c, CURLINFO_RESPONSE_CODE, &code);
        if (code == 200 && g->off > 0) { /* the server ignored Range: start again from byte 0 */
            if (ftruncate(g->fd, 0) != 0 || lseek(g->fd, 0, SEEK_SET) != 0) {
                g->werr = errno;
                return 0;
            }
            g->off = 0;
            if (g->sha) hub_sha256_init(g->sha);
            g->bar->done = g->bar->start = 0;
        } else if (code == 206) {
            long long start = -1;
            if (!strncasecmp(g->hd->content_range, "bytes ", 6)) start = strtoll(g->hd->content_range + 6, NULL, 10);
            if (start != g->off) { /* not the range asked for: start again */
                g->restart = 1;
                return 0;
            }
        } else if (code != 200) {
            g->bad = 1;
        }
        if (!g->bad && g->bar->total <= 0 && g->hd->content_length >= 0) g->bar->total = g->off + g->hd->content_length;
    }
    if (g->bad) {
        size_t take = n < sizeof g->body - 1 - g->body_n ? n : sizeof g->body - 1 - g->body_n;
        memcpy(g->body + g->body_n, p, take);
        g->body_n += take;
        g->body[g->body_n] = 0;
        return n;
    }
    for (size_t w = 0; w < n;) {
        ssize_t k = write(g->fd, p + w, n - w);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            g->werr = k < 0 ? errno : EIO;
            return 0;
        }
        w += (size_t)k;
    }
    if (g->sha) hub_sha256_update(g->sha, p, n);
    g->off += (long long)n;
    prog_update(g->bar, (double)g->off);
    return n;
}

/* sha1 of "blob <size>\0" + the file's bytes (git's object id) into hex; or the file's bytes
 * fed into sha, which the caller finishes (hex unused there, may be NULL). */
static int hash_file(int fd, long long upto, int git_sha1, hub_sha256_ctx *sha, char *hex) {
    enum { BUF = 1 << 16 };
    hub_sha1_ctx s1;
    if (git_sha1) {
        char hdr[64];
        int hn = snprintf(hdr, sizeof hdr, "blob %lld", upto);
        hub_sha1_init(&s1);
        hub_sha1_update(&s1, hdr, (size_t)hn + 1);
    }
    if (lseek(fd, 0, SEEK_SET) != 0) return -1;
    char *buf = malloc(BUF); /* not static: two sessions may hash in two threads */
    if (!buf) return -1;
    int rc = 0;
    for (long long left = upto; left > 0 && !rc;) {
        ssize_t k = read(fd, buf, left < BUF ? (size_t)left : BUF);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            rc = -1;
            break;
        }
        if (git_sha1) hub_sha1_update(&s1, buf, (size_t)k);
        else hub_sha256_update(sha, buf, (size_t)k);
        left -= k;
    }
    free(buf);
    if (rc || lseek(fd, upto, SEEK_SET) != upto) return -1;
    if (git_sha1) {
        uint8_t d[20];
        hub_sha1_final(&s1, d);
        hub_hex(d, 20, hex);
    }
    return 0;
}

static int is_hex(const char *s, size_t n) {
    size_t i = 0;
    for (; s[i]; i++)
        if (!isxdigit((unsigned char)s[i])) return 0;
    return i == n;
}

static const char *disk_hint(int err) {
    return err == ENOSPC || err == EDQUOT ? ": the disk is full; free space or point HF_HUB_CACHE at a larger disk" : "";
}

/* ---- a download: blob.incomplete, resumed, verified, renamed */

/* One download and the state of its .incomplete file, shared by its steps. */
typedef struct {
    hub_ctx *h;
    const char *file, *url, *etag, *blob;
    int auth;                 /* the GET carries the token (the Hub itself, not a CDN) */
    long long size;           /* the Hub's size; -1: not known */
    ct_err *e;
    char part[HUB_PATH + 16]; /* blob.incomplete */
    int fd;
    int lfs, git;             /* the etag is a sha256 (LFS) / git's blob sha1; neither: the size alone is checked */
    long long off;            /* bytes in part; -1 after a truncate that failed */
    int leftover;             /* part started with an earlier run's bytes, not yet found bad */
    hub_sha256_ctx sha;       /* LFS: of part's bytes so far, streamed as they arrive */
    prog_bar bar;
    char label[600];
} hub_dl;

/* Opens blob.incomplete, keeping an earlier run's bytes to resume from unless
 * they are more than the file has; an LFS leftover is hashed now so that the
 * streamed sha256 goes on from it. Closes the file again on failure. */
static int dl_open(hub_dl *d) {
    if (put(d->part, sizeof d->part, "%s.incomplete", d->blob))
        return ct_fail(d->e, CT_ERR_IO, "%s: path too long", d->blob);
    d->fd = open(d->part, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (d->fd < 0)
        return ct_fail(d->e, CT_ERR_IO, "%s: cannot create: %s%s", d->part, strerror(errno), disk_hint(errno));
    d->lfs = is_hex(d->etag, 64), d->git = !d->lfs && is_hex(d->etag, 40);
    d->off = lseek(d->fd, 0, SEEK_END);
    if (d->off < 0 || (d->size >= 0 && d->off > d->size)) {
        if (ftruncate(d->fd, 0) != 0 || lseek(d->fd, 0, SEEK_SET) != 0) d->off = -1;
        else d->off = 0;
    }
    hub_sha256_init(&d->sha);
    d->leftover = d->off > 0;
    if (d->off < 0 || (d->leftover && d->lfs && hash_file(d->fd, d->off, 0, &d->sha, NULL))) {
        int rc = ct_fail(d->e, CT_ERR_IO, "%s: cannot read: %s", d->part, strerror(errno));
        close(d->fd);
        return rc;
    }
    return 0;
}

/* Warns when the disk looks too small for the rest, and starts the bar (or,
 * without one, says in a line what is fetched). */
static void dl_announce(hub_dl *d) {
    struct statvfs vfs;
    if (d->size > d->off && fstatvfs(d->fd, &vfs) == 0 &&
        (double)vfs.f_bavail * vfs.f_frsize < (double)(d->size - d->off)) {
        char need[32], have[32];
        human_bytes(need, sizeof need, (double)(d->size - d->off));
        human_bytes(have, sizeof have, (double)vfs.f_bavail * vfs.f_frsize);
        fprintf(stderr, "ctitan: hub: warning: %s needs %s more, %s free in %s\n", d->file, need, have, d->h->cache);
    }
    snprintf(d->label, sizeof d->label, "hub: %s %s", d->h->repo, d->file);
    prog_begin(&d->bar, d->label, (double)d->size, "B", 0);
    d->bar.done = d->bar.start = (double)d->off;
    /* huggingface_hub's switch: no bar, the plain lines still tell what happens */
    if (d->bar.mode == PROG_TTY && env_true(getenv("HF_HUB_DISABLE_PROGRESS_BARS"))) d->bar.mode = PROG_PLAIN;
    if (d->bar.mode == PROG_PLAIN) {
        char s[32];
        human_bytes(s, sizeof s, (double)d->size);
        fprintf(stderr, "ctitan: hub: downloading %s %s (%s%s)\n", d->h->repo, d->file,
                d->size >= 0 ? s : "size unknown", d->off > 0 ? ", resuming" : "");
    }
}

/* One GET of url from byte off (a Range past 0) appended to part by on_data;
 * g and hd hold what came back, *cr and *code how it ended. -1: libcurl could not start. */
static int dl_get(hub_dl *d, hub_get *g, hub_headers *hd, char *errbuf, CURLcode *cr, long *code) {
    headers_reset(hd);
    *g = (hub_get){.fd = d->fd, .off = d->off, .hd = hd, .sha = d->lfs ? &d->sha : NULL, .bar = &d->bar};
    g->c = curl_easy_init();
    if (!g->c) return -1;
    errbuf[0] = 0;
    struct curl_slist *hl = base_headers(d->h, d->auth, 0);
    common_opts(g->c, errbuf);
    char range[48];
    snprintf(range, sizeof range, "%lld-", d->off);
    curl_easy_setopt(g->c, CURLOPT_URL, d->url);
    curl_easy_setopt(g->c, CURLOPT_HTTPHEADER, hl);
    curl_easy_setopt(g->c, CURLOPT_FOLLOWLOCATION, 1L); /* a custom Authorization is not sent to another host */
    curl_easy_setopt(g->c, CURLOPT_MAXREDIRS, 10L);
    if (d->off > 0) curl_easy_setopt(g->c, CURLOPT_RANGE, range);
    curl_easy_setopt(g->c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(g->c, CURLOPT_HEADERDATA, hd);
    curl_easy_setopt(g->c, CURLOPT_WRITEFUNCTION, on_data);
    curl_easy_setopt(g->c, CURLOPT_WRITEDATA, g);
    long t = env_timeout("HF_HUB_DOWNLOAD_TIMEOUT");
    curl_easy_setopt(g->c, CURLOPT_CONNECTTIMEOUT, t);
    curl_easy_setopt(g->c, CURLOPT_LOW_SPEED_LIMIT, 1L); /* no byte for t seconds: a stalled connection */
    curl_easy_setopt(g->c, CURLOPT_LOW_SPEED_TIME, t);
    *cr = curl_easy_perform(g->c);
    *code = 0;
    curl_easy_getinfo(g->c, CURLINFO_RESPONSE_CODE, code);
    curl_slist_free_all(hl);
    curl_easy_cleanup(g->c);
    return 0;
}

/* What the end of one GET from byte `before` means: an error to report (its
 * rc, part deleted where nothing of it can be kept), a retry (*retry, with
 * why), or, returning 0 without *retry, the file complete. */
static int dl_outcome(hub_dl *d, const hub_get *g, const hub_headers *hd, CURLcode cr, long code, const char *errbuf,
                      long long before, int *retry, char *why, size_t wcap) {
    int rc;
    *retry = 0;
    if (g->werr) {
        prog_break(&d->bar);
        rc = ct_fail(d->e, CT_ERR_IO, "%s: %s %s: cannot write %s: %s%s", d->h->repo, d->file,
                     g->werr == ENOSPC || g->werr == EDQUOT ? "disk full while downloading" : "download failed",
                     d->part, strerror(g->werr), disk_hint(g->werr));
        unlink(d->part); /* free the space it took; nothing partial is kept */
        return rc;
    } else if (g->restart) {
        /* what was written is not the file's head: start again from byte 0 */
        if (ftruncate(d->fd, 0) != 0 || lseek(d->fd, 0, SEEK_SET) != 0) {
            int err = errno;
            prog_break(&d->bar);
            rc = ct_fail(d->e, CT_ERR_IO, "%s: cannot truncate: %s", d->part, strerror(err));
            unlink(d->part); /* its bytes are not the file's first ones: nothing to resume from */
            return rc;
        }
        d->off = 0;
        hub_sha256_init(&d->sha);
        snprintf(why, wcap, "the server sent another range than bytes=%lld-", before);
        *retry = 1;
    } else if (cr == CURLE_OK && code == 416 && d->size >= 0 && d->off == d->size) {
        /* the file was whole already */
    } else if (cr == CURLE_OK && (code == 408 || code == 429 || code >= 500)) {
        snprintf(why, wcap, "HTTP %ld", code);
        *retry = 1;
    } else if (cr == CURLE_OK && (g->bad || code < 200 || code >= 300)) {
        prog_break(&d->bar);
        int denied = d->auth && (code == 401 || code == 403); /* on the Hub: the token; on a CDN: an expired link */
        return ct_fail(d->e, denied ? CT_ERR_CONFIG : CT_ERR_IO, "%s: %s: HTTP %ld%s%s from %s%s", d->h->repo, d->file,
                       code, hd->error_code[0] ? " " : "", hd->error_code, d->url,
                       denied ? " (set HF_TOKEN to a token that can read the repo)" : "; run the command again");
    } else if (cr != CURLE_OK) {
        snprintf(why, wcap, "%s", errbuf[0] ? errbuf : curl_easy_strerror(cr));
        *retry = 1;
    } else if (d->size >= 0 && d->off != d->size) {
        snprintf(why, wcap, "the connection closed after %lld of %lld bytes", d->off, d->size);
        *retry = d->off < d->size;
        if (!*retry) {
            prog_break(&d->bar);
            rc = ct_fail(d->e, CT_ERR_IO, "%s: %s: the server sent %lld bytes, the Hub said %lld (X-Linked-Size / "
                         "Content-Length); nothing was cached", d->h->repo, d->file, d->off, d->size);
            unlink(d->part);
            return rc;
        }
    }
    return 0;
}

/* Before the next GET: gives up after 5 retries without progress (or 1000 in
 * all), keeping part to resume from, else waits 1 s. */
static int dl_retry_wait(hub_dl *d, long long before, int *retries, int attempts, const char *why) {
    if (d->off > before) *retries = 5; /* progress: the count starts again, as http_get's */
    prog_break(&d->bar);
    if ((*retries)-- <= 0 || attempts >= 1000) {
        char b[32], kept[HUB_PATH + 128] = "";
        human_bytes(b, sizeof b, (double)d->off);
        if (d->off > 0) snprintf(kept, sizeof kept, "; the %s received are kept in %s to resume from", b, d->part);
        return ct_fail(d->e, CT_ERR_IO,
                       "%s: %s: the connection to the Hub was lost and the download from %s failed after 5 "
                       "retries (%s)%s; check the network and run the command again",
                       d->h->repo, d->file, d->url, why, kept);
    }
    fprintf(stderr, "ctitan: hub: %s %s: %s; resuming at byte %lld in 1 s (%d retries left)\n", d->h->repo, d->file,
            why, d->off, *retries);
    sleep(1);
    return 0;
}

/* The leftover of an earlier run was the bad part: part emptied, the bar started again, once more from byte 0. */
static int dl_from_zero(hub_dl *d) {
    fprintf(stderr, "ctitan: hub: %s %s: the resumed file did not verify; downloading it again\n", d->h->repo, d->file);
    d->leftover = 0;
    if (ftruncate(d->fd, 0) != 0 || lseek(d->fd, 0, SEEK_SET) != 0)
        return ct_fail(d->e, CT_ERR_IO, "%s: cannot truncate: %s", d->part, strerror(errno));
    d->off = 0;
    hub_sha256_init(&d->sha);
    prog_mode keep = d->bar.mode;
    prog_begin(&d->bar, d->label, (double)d->size, "B", 0);
    d->bar.mode = keep;
    return 0;
}

/* The complete part: fsynced, its checksum compared with the etag, then renamed
 * to the blob. *again (with 0): a leftover did not verify and part is empty to
 * fetch again; a checksum wrong otherwise deletes part. */
static int dl_verify(hub_dl *d, int *again) {
    int rc;
    *again = 0;
    d->bar.total = (double)d->off;
    d->bar.done = (double)d->off;
    prog_end(&d->bar);
    if (fsync(d->fd) != 0) {
        int err = errno;
        rc = ct_fail(d->e, CT_ERR_IO, "%s: cannot write it out: %s%s", d->part, strerror(err), disk_hint(err));
        unlink(d->part);
        return rc;
    }
    const char *kind = d->lfs ? "sha256" : "git blob sha1";
    char got[72];
    if (d->lfs) {
        uint8_t dg[32];
        hub_sha256_final(&d->sha, dg);
        hub_hex(dg, 32, got);
    } else if (d->git && hash_file(d->fd, d->off, 1, NULL, got)) {
        return ct_fail(d->e, CT_ERR_IO, "%s: cannot read it back: %s", d->part, strerror(errno));
    }
    if ((d->lfs || d->git) && strcasecmp(got, d->etag) != 0) {
        if (d->leftover) {
            rc = dl_from_zero(d);
            *again = !rc;
            return rc;
        }
        unlink(d->part);
        return ct_fail(d->e, CT_ERR_IO,
                       "%s: %s from %s is corrupt: its %s is %s, the Hub's etag says %s; it was deleted and nothing "
                       "was cached (run the command again; if it persists, the mirror behind HF_ENDPOINT serves bad "
                       "data)",
                       d->h->repo, d->file, d->url, kind, got, d->etag);
    }
    if (rename(d->part, d->blob) != 0) {
        rc = ct_fail(d->e, CT_ERR_IO, "%s: cannot rename it to %s: %s", d->part, d->blob, strerror(errno));
        unlink(d->part);
        return rc;
    }
    return 0;
}

/* GETs until part is complete and verified (or it fails for good): each
 * dropped connection resumes with a Range from what part holds. */
static int dl_transfer(hub_dl *d) {
    int retries = 5, attempts = 0, rc;
    char why[CURL_ERROR_SIZE + 64];
    for (;;) {
        hub_headers hd;
        hub_get g;
        char errbuf[CURL_ERROR_SIZE];
        CURLcode cr;
        long code;
        long long before = d->off;
        if (dl_get(d, &g, &hd, errbuf, &cr, &code)) return ct_fail(d->e, CT_ERR_IO, "libcurl could not start");
        d->off = g.off;
        attempts++;
        int retry, again;
        if ((rc = dl_outcome(d, &g, &hd, cr, code, errbuf, before, &retry, why, sizeof why))) return rc;
        if (retry) {
            if ((rc = dl_retry_wait(d, before, &retries, attempts, why))) return rc;
            continue;
        }
        if ((rc = dl_verify(d, &again)) || !again) return rc;
    }
}

/* Downloads url into blob (blobs/<etag>) through blob.incomplete; the caller holds the lock. */
static int download(hub_ctx *h, const char *file, const char *url, int auth, const char *etag, long long size,
                    const char *blob, ct_err *e) {
    hub_dl d = {.h = h, .file = file, .url = url, .etag = etag, .blob = blob, .auth = auth, .size = size, .e = e};
    int rc = dl_open(&d);
    if (rc) return rc;
    dl_announce(&d);
    curl_once();
    rc = dl_transfer(&d);
    if (close(d.fd) != 0 && !rc) rc = ct_fail(e, CT_ERR_IO, "%s: close failed: %s", d.part, strerror(errno));
    if (rc && d.off <= 0) unlink(d.part); /* nothing worth resuming */
    return rc;
}

/* flock(2) on .locks/models--owner--name/<etag>.lock, as huggingface_hub's FileLock takes it. */
static int lock_blob(const hub_ctx *h, const char *etag, const char *file, ct_err *e) {
    char dir[HUB_PATH], p[HUB_PATH], folder[256];
    hub_repo_folder(h->repo, folder, sizeof folder);
    if (put(dir, sizeof dir, "%s/.locks/%s", h->cache, folder) || put(p, sizeof p, "%s/%s.lock", dir, etag))
        return -ct_fail(e, CT_ERR_IO, "%s: path too long", h->cache);
    if (ct_mkdirs(dir, e)) return -CT_ERR_IO;
    int fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0664);
    if (fd < 0) return -ct_fail(e, CT_ERR_IO, "%s: cannot open the lock: %s%s", p, strerror(errno), disk_hint(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        fprintf(stderr, "ctitan: hub: waiting for another process downloading %s %s (%s)\n", h->repo, file, p);
        while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {
        }
    }
    return fd;
}

/* One file at the revision, online: see the design note. *have: 1 present, 0 the repo has none. */
static int fetch_online(hub_ctx *h, const char *file, int optional, int *have, ct_err *e) {
    char url[8192], final[4096], why[CURL_ERROR_SIZE + 64];
    const char *rev = h->commit[0] ? h->commit : h->rev;
    if (hub_file_url(url, sizeof url, h->endpoint, h->repo, rev, file))
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s: URL too long", h->repo, file);
    hub_headers hd;
    int tries = 0, rc;
    for (;;) {
        rc = head(h, url, &hd, final, sizeof final, why, sizeof why);
        int transient = rc != 0 || hd.status == 408 || hd.status == 429 || hd.status >= 500;
        if (!transient) break;
        if (rc == 0) snprintf(why, sizeof why, "HTTP %ld", hd.status);
        if (from_cache(h, file)) { /* as hf_hub_download: the cached copy of the revision */
            h->net_down = 1;
            snprintf(h->net_why, sizeof h->net_why, "the Hub could not be reached (%s)", why);
            if (!h->warned++)
                fprintf(stderr, "ctitan: hub: warning: cannot reach %s (%s); using the cached snapshot %s of %s\n",
                        h->endpoint, why, h->commit, h->repo);
            *have = 1;
            return 0;
        }
        if (tries == 3) {
            snprintf(h->net_why, sizeof h->net_why, "the Hub could not be reached: %s", why);
            return ct_fail(e, CT_ERR_IO,
                           "%s: no such local directory, and as a Hub id: cannot download %s: %s (%s, 4 tries) and "
                           "it is not in the Hugging Face cache %s; check the path, or the network and HF_ENDPOINT, "
                           "or use a cached copy",
                           h->repo, file, why, h->endpoint, h->storage);
        }
        fprintf(stderr, "ctitan: hub: %s %s: %s; trying again in %d s\n", h->repo, file, why, 1 << tries);
        sleep(1u << tries);
        tries++;
    }
    const char *ec = hd.error_code;
    if (hd.status >= 400) {
        if (!strcmp(ec, "EntryNotFound") || (hd.status == 404 && !ec[0] && hd.commit[0])) {
            if (hd.commit[0] && hub_revision_ok(hd.commit) && !strchr(hd.commit, '/')) {
                if ((rc = set_commit(h, hd.commit, e))) return rc;
                no_exist(h, h->commit, file);
            }
            *have = 0;
            if (optional) return 0;
            return ct_fail(e, CT_ERR_IO,
                           "%s: the repo has no %s at revision %s (HTTP 404 EntryNotFound): not a model ctitan can "
                           "load from the Hub",
                           h->repo, file, h->rev);
        }
        if (!strcmp(ec, "RevisionNotFound"))
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: the Hub has no revision \"%s\" of this repo (HTTP %ld RevisionNotFound); give an "
                           "existing branch, tag or commit (model.hf_revision, --revision)",
                           h->repo, h->rev, hd.status);
        if (from_cache(h, file)) { /* private, gated or a Hub error: the cache first, as huggingface_hub */
            if (!h->warned++)
                fprintf(stderr, "ctitan: hub: warning: %s answered HTTP %ld %s for %s; using the cached snapshot %s\n",
                        h->endpoint, hd.status, ec, h->repo, h->commit);
            *have = 1;
            return 0;
        }
        const char *tok = h->token_from ? h->token_from : NULL;
        char sent[300];
        if (tok) snprintf(sent, sizeof sent, "the token from %s was sent and not accepted", tok);
        else snprintf(sent, sizeof sent, "no token was sent: set HF_TOKEN (or log in with `hf auth login`)");
        if (!strcmp(ec, "GatedRepo"))
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: a gated repository (HTTP %ld GatedRepo): ask for access on %s/%s, then set HF_TOKEN to "
                           "a token of the account that has it (%s)",
                           h->repo, hd.status, h->endpoint, h->repo, sent);
        if (!strcmp(ec, "RepoNotFound") || hd.status == 401 || hd.status == 404)
            return ct_fail(e, CT_ERR_CONFIG,
                           "%s: not a local directory, and the Hub (%s) has no model repository %s you may read "
                           "(HTTP %ld%s%s): check the id; if the repo is private or gated, %s",
                           h->repo, h->endpoint, h->repo, hd.status, ec[0] ? " " : "", ec,
                           tok ? sent : "set HF_TOKEN to a token that can read it (no token was sent)");
        if (hd.status == 403)
            return ct_fail(e, CT_ERR_CONFIG, "%s: %s: access denied (HTTP 403%s%s); %s", h->repo, file, ec[0] ? " " : "",
                           ec, tok ? "check that the token in HF_TOKEN may read this repo" : sent);
        return ct_fail(e, CT_ERR_IO, "%s: %s: HTTP %ld%s%s from %s", h->repo, file, hd.status, ec[0] ? " " : "", ec,
                       url);
    }
    if (hd.status >= 300 && !hd.location[0])
        return ct_fail(e, CT_ERR_IO, "%s: %s: HTTP %ld without a usable Location from %s", h->repo, file, hd.status,
                       final);
    char etag[512];
    hub_normalize_etag(hd.linked_etag[0] ? hd.linked_etag : hd.etag, etag, sizeof etag);
    if (!hd.commit[0])
        return ct_fail(e, CT_ERR_IO,
                       "%s: %s: the answer from %s has no X-Repo-Commit header: not a Hugging Face Hub endpoint? "
                       "(check HF_ENDPOINT, proxies and firewalls)",
                       h->repo, file, url);
    if (!etag[0])
        return ct_fail(e, CT_ERR_IO, "%s: %s: the answer from %s has no ETag: cannot cache it reliably", h->repo, file,
                       url);
    if (strchr(hd.commit, '/') || !hub_revision_ok(hd.commit) || strchr(etag, '/') || !hub_filename_ok(etag))
        return ct_fail(e, CT_ERR_IO, "%s: %s: the Hub sent a commit \"%s\" / etag \"%s\" that is no file name", h->repo,
                       file, hd.commit, etag);
    if ((rc = set_commit(h, hd.commit, e))) return rc;
    long long size = hd.linked_size >= 0 ? hd.linked_size : hd.status < 300 ? hd.content_length : -1;
    char ptr[HUB_PATH], blob[HUB_PATH];
    if (snap_path(h, h->commit, file, ptr, sizeof ptr) || put(blob, sizeof blob, "%s/blobs/%s", h->storage, etag))
        return ct_fail(e, CT_ERR_IO, "%s: path too long", h->storage);
    *have = 1;
    if (exists(ptr)) return 0;
    char bdir[HUB_PATH];
    put(bdir, sizeof bdir, "%s/blobs", h->storage);
    if (ct_mkdirs(bdir, e)) return CT_ERR_IO;
    int lfd = lock_blob(h, etag, file, e);
    if (lfd < 0) return -lfd;
    rc = 0;
    if (!exists(blob)) {
        /* the CDN Location when the HEAD stopped at one; the token only where the Hub is */
        const char *dl = hd.location[0] && hd.status >= 300 ? hd.location : final;
        rc = download(h, file, dl, same_or_hub(h, url, dl), etag, size, blob, e);
    }
    if (!rc) rc = link_pointer(h, file, etag, e);
    close(lfd); /* releases the flock */
    return rc;
}
#endif /* CT_NO_CURL */

/* One file of the revision into the snapshot. *have: 1 present, 0 known to be absent, -1 not
 * known (offline, not cached). A required file that is absent or unknown is an error. */
static int fetch(hub_ctx *h, const char *file, int optional, int *have, ct_err *e) {
    char c[64], p[HUB_PATH];
    /* a known commit whose snapshot has the file: no network (hf_hub_download's shortcut) */
    if (h->commit[0]) put(c, sizeof c, "%s", h->commit);
    else if (hub_is_commit(h->rev)) put(c, sizeof c, "%s", h->rev);
    else c[0] = 0;
    if (c[0] && !snap_path(h, c, file, p, sizeof p) && exists(p)) {
        if (!h->commit[0]) put(h->commit, sizeof h->commit, "%s", c);
        *have = 1;
        return 0;
    }
    if (h->offline || h->net_down) {
        if (from_cache(h, file)) {
            *have = 1;
            return 0;
        }
        char ne[HUB_PATH];
        cached_commit(h, c, sizeof c);
        if (h->commit[0]) put(c, sizeof c, "%s", h->commit);
        if (c[0] && !put(ne, sizeof ne, "%s/.no_exist/%s/%s", h->storage, c, file) && access(ne, F_OK) == 0) {
            *have = 0;
            if (optional) return 0;
            return ct_fail(e, CT_ERR_IO, "%s: the repo has no %s at revision %s (snapshot %s; recorded in %s)", h->repo,
                           file, h->rev, c, ne);
        }
        *have = -1;
        if (optional) return 0;
        if (h->net_down && !h->offline) {
#ifndef CT_NO_CURL
            return fetch_online(h, file, optional, have, e); /* not cached: the Hub once more */
#endif
        }
        return not_cached(h, file, e);
    }
#ifndef CT_NO_CURL
    return fetch_online(h, file, optional, have, e);
#else
    return not_cached(h, file, e);
#endif
}

static int fetch_weights(hub_ctx *h, ct_err *e) {
    int have, rc;
    if ((rc = fetch(h, "model.safetensors", 1, &have, e)) || have == 1) return rc;
    int have_single = have;
    if ((rc = fetch(h, "model.safetensors.index.json", 1, &have, e))) return rc;
    if (have != 1) {
        if (have_single == -1 || have == -1) return not_cached(h, "model.safetensors", e);
        return ct_fail(e, CT_ERR_IO,
                       "%s: the repo has neither model.safetensors nor model.safetensors.index.json at revision %s: no "
                       "safetensors weights (ctitan reads safetensors only)",
                       h->repo, h->rev);
    }
    char p[HUB_PATH];
    snap_path(h, h->commit, "model.safetensors.index.json", p, sizeof p);
    size_t len;
    char *text = fs_read_file(p, 0, &len, e);
    if (!text) return CT_ERR_IO;
    char **names;
    int n;
    rc = hub_index_shards(text, len, p, &names, &n, e);
    free(text);
    for (int i = 0; i < n; i++) {
        if (!rc) rc = fetch(h, names[i], 0, &have, e);
        free(names[i]);
    }
    free(names);
    return rc;
}

int hub_check_name(const char *path, unsigned what, ct_err *e) {
    if (!path || !path[0]) return ct_fail(e, CT_ERR_CONFIG, "an empty model path");
    if (!(what & HUB_NO_LOCAL) && is_dir(path)) return 0;
    /* a file that exists here is the user's, never an id: "model/config.json" (the form
     * owner/name) was downloaded for, then "not in cache" after seconds of retries. Not for
     * `ctitan download`, whose argument is an id whatever this directory holds. */
    struct stat st;
    if (!(what & HUB_NO_LOCAL) && !is_dir(path) && stat(path, &st) == 0)
        return ct_fail(e, CT_ERR_CONFIG, "%s: a file, not a model directory (give the directory that holds it)", path);
    /* A path that does not exist is a missing file (1, docs/reliability.md's exit codes, as
     * import and export give it); to `ctitan download`, which takes ids alone, a bad value. */
    if (!hub_is_repo_id(path))
        return ct_fail(e, what & HUB_NO_LOCAL ? CT_ERR_CONFIG : CT_ERR_IO,
                       "%s: %snot a Hugging Face Hub model id (owner/name, e.g. Qwen/Qwen3-0.6B)", path,
                       what & HUB_NO_LOCAL ? "" : "no such directory, and ");
    return 0;
}

int hub_resolve(const char *path, const char *revision, unsigned what, hub_local *out, ct_err *e) {
    memset(out, 0, sizeof *out);
    int rc = hub_check_name(path, what, e);
    if (rc) return rc;
    if (!(what & HUB_NO_LOCAL) && is_dir(path)) {
        if (put(out->dir, sizeof out->dir, "%s", path)) return ct_fail(e, CT_ERR_CONFIG, "%s: path too long", path);
        return 0;
    }
    hub_ctx h;
    memset(&h, 0, sizeof h);
    h.repo = path;
    h.rev = revision && revision[0] ? revision : HUB_DEFAULT_REVISION;
    if (!hub_revision_ok(h.rev))
        return ct_fail(e, CT_ERR_CONFIG, "%s: \"%s\" is not a revision (a branch, tag or commit)", path, h.rev);
    char folder[256];
    if (hub_cache_dir(h.cache, sizeof h.cache) || hub_repo_folder(path, folder, sizeof folder) ||
        put(h.storage, sizeof h.storage, "%s/%s", h.cache, folder) || hub_endpoint(h.endpoint, sizeof h.endpoint))
        return ct_fail(e, CT_ERR_CONFIG, "%s: the cache path (HF_HUB_CACHE, HF_HOME) or HF_ENDPOINT is too long", path);
    h.offline = offline_var();
#ifdef CT_NO_CURL
    if (!h.offline) h.offline = "no-curl";
#endif
    if (!h.offline && hub_token(h.token, sizeof h.token, &h.token_from) == 0) h.token_from = NULL;
    int have;
    if (!rc && (what & HUB_CONFIG)) rc = fetch(&h, "config.json", 0, &have, e);
    if (!rc && (what & HUB_CONFIG)) rc = fetch(&h, "generation_config.json", 1, &have, e);
    if (what & (HUB_TOKENIZER | HUB_TOKENIZER_IF_ANY)) {
        int opt = !(what & HUB_TOKENIZER);
        if (!rc) rc = fetch(&h, "tokenizer.json", opt, &have, e);
        if (!rc) rc = fetch(&h, "tokenizer_config.json", opt, &have, e);
        if (!rc) rc = fetch(&h, "special_tokens_map.json", 1, &have, e);
        /* recent transformers save the chat template beside the config, not in it */
        if (!rc) rc = fetch(&h, "chat_template.jinja", 1, &have, e);
    }
    if (!rc && (what & HUB_WEIGHTS)) rc = fetch_weights(&h, e);
    if (!rc && (what & HUB_ADAPTER)) rc = fetch(&h, "adapter_config.json", 0, &have, e);
    if (!rc && (what & HUB_ADAPTER)) rc = fetch(&h, "adapter_model.safetensors", 0, &have, e);
    if (rc) return rc;
    if (!h.commit[0]) { /* only optional files asked for, and none of them known */
        cached_commit(&h, h.commit, sizeof h.commit);
        if (!h.commit[0]) return not_cached(&h, "(any file)", e);
    }
    put(out->commit, sizeof out->commit, "%s", h.commit);
    put(out->repo, sizeof out->repo, "%s", path);
    if (snap_path(&h, h.commit, NULL, out->dir, sizeof out->dir))
        return ct_fail(e, CT_ERR_IO, "%s: path too long", h.storage);
    if (!is_dir(out->dir)) return not_cached(&h, "(the snapshot)", e);
    return 0;
}
