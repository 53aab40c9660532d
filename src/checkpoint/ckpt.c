/* checkpoint/ckpt.c: training checkpoints (see ckpt.h and docs/checkpoints.md).
 *
 * Design notes.
 * - Atomicity comes from the directory, not the files: everything is written
 *   into FOLDER/.step-N.tmp-PID, each file fsynced, manifest.json last, the
 *   directory fsynced, and only then renamed to step-N and FOLDER fsynced. A
 *   step-N directory therefore exists only once it is complete; a crash
 *   leaves a temp dir that readers ignore and ckpt_prune removes.
 * - Replacing an existing step-N uses renameat2(RENAME_EXCHANGE), one atomic
 *   swap, and deletes the old contents afterwards. Where the filesystem lacks
 *   it, the old dir is renamed aside (.step-N.old-PID) first; ckpt_prune puts
 *   it back if a crash hit between the two renames.
 * - Checksums are XXH3-64 (Debian's libxxhash-dev, inlined from its header so
 *   the library needs no extra link flag) computed by reading each file back
 *   after it is fsynced, in 1 MiB chunks: the manifest then describes what
 *   the file holds, and no model-sized buffer is ever allocated. The
 *   tensors go through the safetensors stream writer (its own tmp + rename
 *   inside the temp dir is harmless), so a distributed save hands them over
 *   piece by piece as they are gathered and no rank holds the whole state.
 * - Under mpirun the tensor files may instead be laid out by one process
 *   (headers written, files sized) and filled by every process at the
 *   offsets the headers fix (ckpt_part_*); the rest of the save is the
 *   same. Loading reads the rows a caller names with pread, a bounded block
 *   at a time, and of them only the columns it names (a TP rank's block of a
 *   row-parallel weight), so a rank reads its share, not the files.
 * - The manifest is written by hand, like the safetensors header, so byte
 *   counts above 2^31 never come out in exponent form. It is read with cJSON
 *   as untrusted input: size-capped, every field type-checked, file names
 *   restricted to plain names inside the directory.
 * - Every write, fsync, close and rename is checked; the first failure stops
 *   the save, removes the temp dir and names the path. Earlier checkpoints
 *   are never touched before the new one is complete.
 * - No global state: the only process-wide thing consulted is the pid, which
 *   names temp dirs so a live writer's dir is never pruned. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* renameat2, fsync, O_DIRECTORY under -std=c11 */
#endif
#include "checkpoint/ckpt.h"
#include "core/fs.h"
#include "formats/json.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "checkpoint/hf.h"
#include "core/progress.h"
#include "core/timer.h"
#include "formats/safetensors.h"

/* Progress (core/progress.h) only for a save or load still running after a
 * second: a real model's, never the tiny checkpoints of tests. */
#define CKPT_PROG_MIN_S 1.0
#define CKPT_PATH 4096
#define CKPT_MAX_FILES 32
#define CKPT_NAME_MAX 64
#define CKPT_MANIFEST_MAX (1 << 20) /* a manifest lists a handful of files */
#define CKPT_TEXT_MAX (256u << 20)  /* state.json sanity cap */
#define CKPT_CHUNK (1 << 20)
#define CKPT_SELF_KEY ",\n  \"manifest_xxh3_64\": \""

typedef struct {
    char name[CKPT_NAME_MAX];
    uint64_t bytes;
    uint64_t hash;
} ckpt_file;

typedef struct {
    int step;
    int model_only;
    int n;
    ckpt_file f[CKPT_MAX_FILES];
} ckpt_manifest;

/* ------------------------------------------------------------- helpers */

static int ckpt_is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Parses the digits of s (no sign, no spaces) as a non-negative int. */
static int ckpt_parse_uint(const char *s, const char *end, long *out) {
    if (s == end) return -1;
    long v = 0;
    for (const char *p = s; p < end; p++) {
        if (*p < '0' || *p > '9') return -1;
        if (v > (INT_MAX - (*p - '0')) / 10) return -1;
        v = v * 10 + (*p - '0');
    }
    *out = v;
    return 0;
}

/* "step-N" -> N, else -1. Only the name ctitan writes for N: "step-02"
 * would be listed as step 2 and then looked for as "step-2", which does not
 * exist (a message naming a directory that is not there). */
static int ckpt_step_of(const char *name) {
    if (strncmp(name, "step-", 5) != 0) return -1;
    long v;
    if (ckpt_parse_uint(name + 5, name + strlen(name), &v)) return -1;
    char canon[32];
    snprintf(canon, sizeof canon, "step-%ld", v);
    return strcmp(canon, name) ? -1 : (int)v;
}

/* Temp-like entries: ".step-N.tmp-PID", ".step-N.old-PID", ".step-N.del-PID",
 * and the trainer's final Hugging Face export in progress, ".hf-step-N.tmp-PID"
 * (train/trainer_ckpt.c). Returns the kind letter ('t', 'o', 'd'; 't' for
 * the export) and fills step and pid, else 0. */
static int ckpt_temp_of(const char *name, int *step, long *pid) {
    int hf = !strncmp(name, ".hf-step-", 9);
    const char *num = hf ? name + 9 : !strncmp(name, ".step-", 6) ? name + 6 : NULL; /* N's first digit */
    if (!num) return 0;
    const char *dot = strchr(num, '.');
    if (!dot) return 0;
    long s;
    if (ckpt_parse_uint(num, dot, &s)) return 0;
    if (hf && strncmp(dot, ".tmp-", 5)) return 0;
    int kind = !strncmp(dot, ".tmp-", 5) ? 't' : !strncmp(dot, ".old-", 5) ? 'o' : !strncmp(dot, ".del-", 5) ? 'd' : 0;
    if (!kind || ckpt_parse_uint(dot + 5, dot + strlen(dot), pid)) return 0;
    *step = (int)s;
    return kind;
}

/* Writes len bytes to a new file PATH and fsyncs it; every call checked. */
static int ckpt_write_file(const char *path, const char *text, size_t len, ct_err *e) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    size_t done = 0;
    int rc = 0;
    while (done < len && !rc) {
        ssize_t k = write(fd, text + done, len - done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", path, k < 0 ? strerror(errno) : "no progress");
        else done += (size_t)k;
    }
    if (!rc && fsync(fd) != 0) rc = ct_fail(e, CT_ERR_IO, "%s: cannot sync: %s", path, strerror(errno));
    if (close(fd) != 0 && !rc) rc = ct_fail(e, CT_ERR_IO, "%s: cannot close: %s", path, strerror(errno));
    return rc;
}

/* Streams a file through XXH3-64. */
static int ckpt_hash_file(const char *path, uint64_t *bytes, uint64_t *hash, prog_bar *bar, ct_err *e) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    XXH3_state_t *st = XXH3_createState();
    if (!st) {
        close(fd);
        return ct_fail(e, CT_ERR_IO, "%s: out of memory for the checksum state", path);
    }
    XXH3_64bits_reset(st);
    unsigned char *buf = ct_malloc(CKPT_CHUNK);
    uint64_t total = 0;
    int rc = 0;
    for (;;) {
        ssize_t k = read(fd, buf, CKPT_CHUNK);
        if (k < 0 && errno == EINTR) continue;
        if (k < 0) {
            rc = ct_fail(e, CT_ERR_IO, "%s: read failed: %s", path, strerror(errno));
            break;
        }
        if (k == 0) break;
        XXH3_64bits_update(st, buf, (size_t)k);
        total += (uint64_t)k;
        if (bar) prog_add(bar, (double)k);
    }
    close(fd);
    free(buf);
    if (!rc) {
        *bytes = total;
        *hash = XXH3_64bits_digest(st);
    }
    XXH3_freeState(st);
    return rc;
}

/* ------------------------------------------------------------ manifest */

static const char *ckpt_required(int model_only, int i) {
    static const char *const full[] = {"model.safetensors", "config.json", "optim.safetensors", "state.json", NULL};
    return i < (model_only ? 2 : 4) ? full[i] : NULL;
}

/* A file name the manifest may list: plain, inside the directory. */
static int ckpt_name_ok(const char *s) {
    size_t n = strlen(s);
    if (n == 0 || n >= CKPT_NAME_MAX || s[0] == '.' || !strcmp(s, "manifest.json")) return 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] == '/' || s[i] == '\\' || (unsigned char)s[i] < 0x20) return 0;
    return 1;
}

/* A number written as an integer (as ckpt_write_manifest's %d and %llu write
 * it: not 5.0, not 1e3) in [0, 2^53), where doubles are exact. */
static int ckpt_json_uint(const cJSON *v, uint64_t *out) {
    if (!json_integer_in(v, 0.0, 9007199254740991.0)) return -1;
    *out = (uint64_t)v->valuedouble;
    return 0;
}

static int ckpt_parse_hex64(const char *s, uint64_t *out) {
    if (strlen(s) != 16) return -1;
    uint64_t v = 0;
    for (int i = 0; i < 16; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return -1;
        v = v << 4 | (uint64_t)d;
    }
    *out = v;
    return 0;
}

/* The manifest ends with CKPT_SELF_KEY, 16 hex digits of the XXH3-64 of
 * every byte up to and including the key, then "\"\n}\n". Checked on the raw
 * bytes before any parsing (memmem: a flipped bit may have made a NUL). */
static int ckpt_check_self(const char *mpath, const char *text, size_t len, ct_err *e) {
    const size_t kl = strlen(CKPT_SELF_KEY), tail = 16 + 4;
    const char *last = NULL;
    for (const char *q = text; (q = memmem(q, len - (size_t)(q - text), CKPT_SELF_KEY, kl)); q++) last = q;
    uint64_t want;
    char hex[17];
    if (!last || (size_t)(last - text) + kl + tail != len || memcmp(last + kl + 16, "\"\n}\n", 4) != 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: its checksum line is missing or damaged (truncated or corrupted)",
                       mpath);
    memcpy(hex, last + kl, 16);
    hex[16] = 0;
    if (ckpt_parse_hex64(hex, &want) || XXH3_64bits(text, (size_t)(last - text) + kl) != want)
        return ct_fail(e, CT_ERR_FORMAT, "%s: checksum mismatch (corrupted)", mpath);
    return 0;
}

/* Reads and validates DIR/manifest.json (format, version, types, names,
 * required files, step matching the directory name). */
static int ckpt_read_manifest(const char *dir, ckpt_manifest *man, ct_err *e) {
    char mpath[CKPT_PATH];
    int rc = fs_join_buf(mpath, CKPT_PATH, dir, "manifest.json", e);
    if (rc) return rc;
    struct stat st;
    if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))
        return ct_fail(e, CT_ERR_IO, "%s: not a checkpoint directory (%s)", dir,
                       errno == ENOENT ? "missing" : "not a directory");
    if (stat(mpath, &st) != 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: missing (an incomplete or damaged checkpoint)", mpath);
    size_t len = 0;
    char *text = fs_read_file(mpath, CKPT_MANIFEST_MAX, &len, e);
    if (!text) return e ? e->code : CT_ERR_IO;
    if ((rc = ckpt_check_self(mpath, text, len, e))) {
        free(text);
        return rc;
    }
    cJSON *root = json_parse(text, len, mpath, e);
    free(text);
    if (!root) return CT_ERR_FORMAT;
    memset(man, 0, sizeof *man);
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    const cJSON *ver = cJSON_GetObjectItemCaseSensitive(root, "version");
    const cJSON *stp = cJSON_GetObjectItemCaseSensitive(root, "step");
    const cJSON *mo = cJSON_GetObjectItemCaseSensitive(root, "model_only");
    const cJSON *files = cJSON_GetObjectItemCaseSensitive(root, "files");
    uint64_t u = 0;
    if (!cJSON_IsObject(root)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: not a JSON object", mpath);
    } else if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, CKPT_FORMAT)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"format\" is not \"%s\"", mpath, CKPT_FORMAT);
    } else if (ckpt_json_uint(ver, &u) || u != CKPT_VERSION) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"version\" is not %d (written by another ctitan version?)", mpath,
                     CKPT_VERSION);
    } else if (ckpt_json_uint(stp, &u) || u > INT_MAX) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"step\" is not a non-negative integer", mpath);
    } else if (!cJSON_IsBool(mo)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"model_only\" is not a boolean", mpath);
    } else if (!cJSON_IsObject(files)) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"files\" is not an object", mpath);
    }
    if (!rc) {
        man->step = (int)u;
        man->model_only = cJSON_IsTrue(mo);
    }
    for (const cJSON *f = rc ? NULL : files->child; f && !rc; f = f->next) {
        if (!ckpt_name_ok(f->string)) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: file name \"%s\" is not a plain name inside the checkpoint", mpath,
                         f->string);
            break;
        }
        for (int i = 0; i < man->n; i++)
            if (!strcmp(man->f[i].name, f->string))
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"%s\" is listed twice", mpath, f->string);
        if (rc) break;
        if (man->n == CKPT_MAX_FILES) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: more than %d files listed", mpath, CKPT_MAX_FILES);
            break;
        }
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(f, "bytes");
        const cJSON *h = cJSON_GetObjectItemCaseSensitive(f, "xxh3_64");
        ckpt_file *cf = &man->f[man->n];
        if (!cJSON_IsObject(f) || ckpt_json_uint(b, &cf->bytes) || !cJSON_IsString(h) ||
            ckpt_parse_hex64(h->valuestring, &cf->hash)) {
            rc = ct_fail(e, CT_ERR_FORMAT,
                         "%s: entry \"%s\" needs \"bytes\" (integer) and \"xxh3_64\" (16 lowercase hex digits)",
                         mpath, f->string);
            break;
        }
        snprintf(cf->name, sizeof cf->name, "%s", f->string);
        man->n++;
    }
    for (int i = 0; !rc && ckpt_required(man->model_only, i); i++) {
        const char *req = ckpt_required(man->model_only, i);
        int found = 0;
        for (int j = 0; j < man->n; j++) found |= !strcmp(man->f[j].name, req);
        if (!found)
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: does not list %s, which a%s checkpoint needs", mpath, req,
                         man->model_only ? " model-only" : " full");
    }
    cJSON_Delete(root);
    if (rc) return rc;
    /* A checkpoint moved under another step's name would resume at the wrong step. */
    const char *base = strrchr(dir, '/');
    base = base ? base + 1 : dir;
    int dstep = ckpt_step_of(base);
    if (dstep >= 0 && dstep != man->step)
        return ct_fail(e, CT_ERR_FORMAT, "%s: says step %d but the directory is %s", mpath, man->step, base);
    return 0;
}

/* Checks every listed file: size always, checksum when `full`; *hashed
 * (may be NULL) gets the bytes read for the checksums. */
static int ckpt_check_files(const char *dir, const ckpt_manifest *man, int full, prog_bar *bar, uint64_t *hashed,
                            ct_err *e) {
    char p[CKPT_PATH];
    for (int i = 0; i < man->n; i++) {
        const ckpt_file *f = &man->f[i];
        int rc = fs_join_buf(p, CKPT_PATH, dir, f->name, e);
        if (rc) return rc;
        struct stat st;
        if (stat(p, &st) != 0)
            return ct_fail(e, CT_ERR_FORMAT, "%s: missing (listed in the manifest)", p);
        if (!S_ISREG(st.st_mode)) return ct_fail(e, CT_ERR_FORMAT, "%s: not a regular file", p);
        if ((uint64_t)st.st_size != f->bytes)
            return ct_fail(e, CT_ERR_FORMAT, "%s: %lld bytes, the manifest says %llu (truncated or corrupted)", p,
                           (long long)st.st_size, (unsigned long long)f->bytes);
        if (!full) continue;
        uint64_t bytes, hash;
        if ((rc = ckpt_hash_file(p, &bytes, &hash, bar, e))) return rc;
        if (hashed) *hashed += bytes;
        if (bytes != f->bytes)
            return ct_fail(e, CT_ERR_FORMAT, "%s: changed size while being read", p);
        if (hash != f->hash)
            return ct_fail(e, CT_ERR_FORMAT, "%s: checksum mismatch (truncated or corrupted)", p);
    }
    return 0;
}

static int ckpt_verify_level(const char *dir, int full, ckpt_manifest *man, ct_err *e) {
    int rc = ckpt_read_manifest(dir, man, e);
    if (!rc) rc = ckpt_check_files(dir, man, full, NULL, NULL, e);
    return rc;
}

int ckpt_verify(const char *dir, ct_err *e) { return ckpt_verify_hashed(dir, NULL, e); }

int ckpt_verify_hashed(const char *dir, uint64_t *hashed, ct_err *e) {
    ckpt_manifest man;
    if (hashed) *hashed = 0;
    int rc = ckpt_read_manifest(dir, &man, e);
    if (rc) return rc;
    /* a resume's pick reads every byte here before the load reads its share: as long as the load, so it
     * gets a bar of its own */
    double total = 0;
    for (int i = 0; i < man.n; i++) total += (double)man.f[i].bytes;
    char label[64];
    snprintf(label, sizeof label, "checkpoint verify step-%d", man.step);
    prog_bar bar;
    prog_begin(&bar, label, total, "B", CKPT_PROG_MIN_S);
    rc = ckpt_check_files(dir, &man, 1, &bar, hashed, e);
    if (rc) prog_break(&bar);
    else prog_end(&bar);
    return rc;
}

int ckpt_verify_sizes(const char *dir, ct_err *e) {
    ckpt_manifest man;
    return ckpt_verify_level(dir, 0, &man, e);
}

/* The verification ckpt_select_with was given, or ckpt_verify. */
static int ckpt_verify_by(ckpt_verify_fn verify, void *vctx, const char *dir, int step, ct_err *e) {
    return verify ? verify(vctx, dir, step, e) : ckpt_verify(dir, e);
}

int ckpt_is_model_only(const char *dir, ct_err *e) {
    ckpt_manifest man;
    if (ckpt_read_manifest(dir, &man, e)) return -1;
    return man.model_only;
}

/* ---------------------------------------------------------------- save */

/* The tensors of model.safetensors (file 0) or optim.safetensors (file 1)
 * as st_write takes them (no data); *names holds the moments' names. */
static st_wtensor *ckpt_file_tensors(const lm_model *m, int file, int *count, char **names_out) {
    int n = m->n_tensors;
    int nt = file ? 2 * n : n;
    st_wtensor *ts = ct_calloc((size_t)nt + 1, sizeof *ts);
    char *names = file ? ct_malloc((size_t)nt * (LM_NAME_MAX + 16)) : NULL;
    for (int k = 0; k < (file ? 2 : 1); k++)
        for (int i = 0; i < n; i++) {
            const lm_tensor *t = &m->tensors[i];
            st_wtensor *w = &ts[k * n + i];
            *w = (st_wtensor){.name = t->name, .dtype = CT_F32, .src_dtype = CT_F32, .ndim = t->ndim};
            if (file) {
                char *nm = names + (size_t)(k * n + i) * (LM_NAME_MAX + 16);
                snprintf(nm, LM_NAME_MAX + 16, "%s.%s", t->name, k ? "exp_avg_sq" : "exp_avg");
                w->name = nm;
            }
            for (int d = 0; d < t->ndim; d++) w->shape[d] = t->shape[d];
        }
    *count = nt;
    *names_out = names;
    return ts;
}

/* Opens the stream of model.safetensors (file 0: every parameter) or
 * optim.safetensors (file 1: every "NAME.exp_avg", then every
 * "NAME.exp_avg_sq"), fp32, in m's table order. */
static int ckpt_open_file(st_stream **out, const char *path, const lm_model *m, int file, ct_err *e) {
    int nt;
    char *names;
    st_wtensor *ts = ckpt_file_tensors(m, file, &nt, &names);
    const char *meta[] = {"format", "pt", NULL};
    int rc = st_stream_open(out, path, ts, nt, meta, e);
    free(names);
    free(ts);
    return rc;
}

/* Hashes the listed files of `tmp` and writes manifest.json. */
static int ckpt_write_manifest(const char *tmp, int step, int model_only, const char *const *names, int n,
                               uint64_t *total, ct_err *e) {
    char p[CKPT_PATH];
    size_t cap = 512 + (size_t)n * 160, k = 0;
    char *buf = ct_malloc(cap);
    k += (size_t)snprintf(buf + k, cap - k,
                          "{\n  \"format\": \"%s\",\n  \"version\": %d,\n  \"step\": %d,\n  \"model_only\": %s,\n"
                          "  \"files\": {",
                          CKPT_FORMAT, CKPT_VERSION, step, model_only ? "true" : "false");
    int rc = 0;
    *total = 0;
    for (int i = 0; i < n && !rc; i++) {
        uint64_t bytes, hash;
        rc = fs_join_buf(p, CKPT_PATH, tmp, names[i], e);
        if (!rc) rc = ckpt_hash_file(p, &bytes, &hash, NULL, e);
        if (rc) break;
        *total += bytes;
        k += (size_t)snprintf(buf + k, cap - k, "%s\n    \"%s\": {\"bytes\": %llu, \"xxh3_64\": \"%016llx\"}",
                              i ? "," : "", names[i], (unsigned long long)bytes, (unsigned long long)hash);
    }
    /* the manifest's own checksum covers every byte before it, so damage to
     * the manifest is reported as such, not as a mismatch of another file */
    k += (size_t)snprintf(buf + k, cap - k, "\n  }%s", CKPT_SELF_KEY);
    k += (size_t)snprintf(buf + k, cap - k, "%016llx\"\n}\n", (unsigned long long)XXH3_64bits(buf, k));
    if (!rc) rc = fs_join_buf(p, CKPT_PATH, tmp, "manifest.json", e);
    if (!rc) rc = ckpt_write_file(p, buf, k, e);
    if (!rc) *total += k;
    free(buf);
    return rc;
}

int ckpt_free_export_name(const char *folder, int step, char *out, size_t cap, ct_err *e) {
    char name[64];
    for (int k = 1; k <= 1000; k++) {
        if (k == 1) snprintf(name, sizeof name, "hf-step-%d", step);
        else snprintf(name, sizeof name, "hf-step-%d.%d", step, k);
        int rc = fs_join_buf(out, cap, folder, name, e);
        if (rc) return rc;
        struct stat st;
        if (lstat(out, &st) == 0) continue;
        if (errno == ENOENT) return 0;
        return ct_fail(e, CT_ERR_IO, "%s: cannot tell whether it exists: %s", out, strerror(errno));
    }
    return ct_fail(e, CT_ERR_IO, "%s: hf-step-%d and its 999 next names (hf-step-%d.K) are all taken", folder, step,
                   step);
}

/* A final export (a finished run's model: ckpt_dir_kind) at the step a
 * checkpoint is being saved to: the run was extended past its end (a higher
 * training.steps) and trained that step again. The export is the model the
 * user has, maybe already in use: it is moved aside to hf-step-N, the name a
 * final export gets beside a checkpoint of its step (hf-step-N.K when that is
 * taken), with a note; never replaced. One rename: a crash leaves it at
 * either name, whole. */
static int ckpt_keep_export(const char *folder, const char *final, int step, ct_err *e) {
    int kind = ckpt_dir_kind(final);
    if (kind == CKPT_DIR_CHECKPOINT) return 0;
    char aside[CKPT_PATH];
    int rc = ckpt_free_export_name(folder, step, aside, sizeof aside, e);
    if (rc) return rc;
    if (rename(final, aside) != 0)
        return ct_fail(e, CT_ERR_IO, "%s: cannot move this final save aside to %s before saving a checkpoint of "
                       "its step: %s", final, aside, strerror(errno));
    fprintf(stderr, "ctitan: note: %s held %s (a finished run's final save); it is kept as %s and step-%d becomes a "
            "training checkpoint\n", final, ckpt_dir_kind_name(kind), aside, step);
    return fs_fsync(folder, 1, e);
}

/* Puts the complete dir `tmp` in place as `final`, replacing what is there
 * (a final export there is kept aside first: ckpt_keep_export). */
static int ckpt_publish(const char *folder, const char *tmp, const char *final, int step, ct_err *e) {
    int rc0 = ckpt_is_dir(final) ? ckpt_keep_export(folder, final, step, e) : 0;
    if (rc0) return rc0;
    if (rename(tmp, final) == 0) return fs_fsync(folder, 1, e);
    if (errno != ENOTEMPTY && errno != EEXIST)
        return ct_fail(e, CT_ERR_IO, "%s: cannot rename %s to it: %s", final, tmp, strerror(errno));
    /* step-N exists: swap atomically, then the old contents sit in tmp */
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, final, RENAME_EXCHANGE) == 0) {
        int rc = fs_fsync(folder, 1, e);
        if (!rc) rc = ct_rm_tree(tmp, e);
        return rc;
    }
    if (errno != EINVAL && errno != ENOSYS)
        return ct_fail(e, CT_ERR_IO, "%s: cannot replace it with %s: %s", final, tmp, strerror(errno));
    char aside[CKPT_PATH], name[64];
    snprintf(name, sizeof name, ".step-%d.old-%ld", step, (long)getpid());
    int rc = fs_join_buf(aside, CKPT_PATH, folder, name, e);
    if (rc) return rc;
    if (rename(final, aside) != 0)
        return ct_fail(e, CT_ERR_IO, "%s: cannot move it aside to %s: %s", final, aside, strerror(errno));
    if (rename(tmp, final) != 0) {
        int err = errno;
        rename(aside, final); /* best effort: put the old one back */
        return ct_fail(e, CT_ERR_IO, "%s: cannot rename %s to it: %s", final, tmp, strerror(err));
    }
    rc = fs_fsync(folder, 1, e);
    if (!rc) rc = ct_rm_tree(aside, e);
    return rc;
}

/* A save in progress: the temp dir, the file being streamed, what went in. */
struct ckpt_stream {
    char folder[CKPT_PATH], tmp[CKPT_PATH], final[CKPT_PATH];
    int step, model_only;
    const lm_model *m;
    int file;        /* 0: model.safetensors, 1: optim.safetensors, 2: both done */
    size_t put;      /* floats of the current file put so far */
    st_stream *st;
    double t0;
    prog_bar bar;    /* tensor bytes written */
    const char *id_src[2]; /* where config.json's token ids come from (ckpt_stream_token_ids) */
    int n_id_src;
    int parts;       /* ckpt_stream_begin_parts: the tensor files were written by ckpt_part_write */
};

static void ckpt_stream_free(ckpt_stream *s, int remove_tmp) {
    prog_break(&s->bar);
    st_stream_abort(s->st);
    if (remove_tmp) {
        ct_err ignore;
        ct_rm_tree(s->tmp, &ignore); /* the error already names what failed */
    }
    free(s);
}

void ckpt_stream_token_ids(ckpt_stream *s, const char *const *src, int n) {
    s->n_id_src = n < 2 ? n : 2;
    for (int i = 0; i < s->n_id_src; i++) s->id_src[i] = src[i];
}

int ckpt_tmp_dir(char *out, size_t cap, const char *folder, int step, long pid, ct_err *e) {
    char name[64];
    snprintf(name, sizeof name, ".step-%d.tmp-%ld", step, pid);
    return fs_join_buf(out, cap, folder, name, e);
}

/* What both kinds of save begin with: the stream's fields, its progress bar
 * (label, shown after min_s), and a fresh FOLDER/.step-N.tmp-PID beside
 * the step-N it becomes. *out NULL on failure. */
static int ckpt_stream_new(ckpt_stream **out, const char *folder, int step, const lm_model *m, int model_only,
                           const char *label, double total, double min_s, ct_err *e) {
    *out = NULL;
    double t0 = ct_now();
    if (step < 0) return ct_fail(e, CT_ERR_IO, "%s: checkpoint step %d is negative", folder, step);
    ckpt_stream *s = ct_calloc(1, sizeof *s);
    s->step = step;
    s->model_only = model_only;
    s->m = m;
    s->t0 = t0;
    snprintf(s->folder, sizeof s->folder, "%s", folder);
    prog_begin(&s->bar, label, total, "B", min_s);
    char name[64];
    int rc = ckpt_tmp_dir(s->tmp, CKPT_PATH, folder, step, (long)getpid(), e);
    snprintf(name, sizeof name, "step-%d", step);
    if (!rc) rc = fs_join_buf(s->final, CKPT_PATH, folder, name, e);
    if (!rc) rc = ct_mkdirs(folder, e);
    if (!rc) rc = ct_rm_tree(s->tmp, e); /* left by an earlier crash of a process with our pid */
    if (!rc && mkdir(s->tmp, 0755) != 0) rc = ct_fail(e, CT_ERR_IO, "%s: cannot create: %s", s->tmp, strerror(errno));
    if (rc) {
        free(s);
        return rc;
    }
    *out = s;
    return 0;
}

int ckpt_stream_begin(ckpt_stream **out, const char *folder, int step, const lm_model *m, int model_only,
                      ct_err *e) {
    char label[64], p[CKPT_PATH];
    snprintf(label, sizeof label, "checkpoint save step-%d", step);
    ckpt_stream *s;
    int rc = ckpt_stream_new(&s, folder, step, m, model_only, label,
                             (double)m->n_params * sizeof(float) * (model_only ? 1 : 3), CKPT_PROG_MIN_S, e);
    *out = NULL;
    if (rc) return rc;
    if (!(rc = fs_join_buf(p, CKPT_PATH, s->tmp, "model.safetensors", e))) rc = ckpt_open_file(&s->st, p, m, 0, e);
    if (rc) {
        ckpt_stream_free(s, 1);
        return rc;
    }
    *out = s;
    return 0;
}

/* A checkpoint holding inf or NaN would verify (its checksums are of what
 * was written) and every resume would restart the divergence from it: the
 * save is refused instead, naming the tensor and element, and the folder
 * keeps its older checkpoints. */
static int stream_check_finite(const ckpt_stream *s, const float *x, size_t k, ct_err *e) {
    size_t bad = ct_first_nonfinite(x, k);
    if (bad == k) return 0;
    const lm_model *m = s->m;
    size_t at = s->put + bad, np = m->n_params;
    const char *moment = s->file == 0 ? "" : at < np ? ".exp_avg" : ".exp_avg_sq";
    size_t off = at % np;
    int ti = 0;
    for (int i = 0; i < m->n_tensors; i++)
        if (m->tensors[i].offset <= off) ti = i;
    return ct_fail(e, CT_ERR_IO,
                   "%s: not saved: %s%s holds a non-finite value (%g at element %zu); the run has diverged, and a "
                   "checkpoint of it would resume the divergence (older checkpoints are left as they are)",
                   s->final, m->tensors[ti].name, moment, (double)x[bad], off - m->tensors[ti].offset);
}

int ckpt_stream_put(ckpt_stream *s, const float *x, size_t n, ct_err *e) {
    while (n) {
        size_t want = (s->file ? 2 : 1) * s->m->n_params;
        if (s->file == 2 || (s->file == 1 && s->model_only))
            return ct_fail(e, CT_ERR_IO, "%s: %zu floats more than a checkpoint of this model holds", s->final, n);
        size_t k = n < want - s->put ? n : want - s->put;
        int rc = stream_check_finite(s, x, k, e);
        if (!rc) rc = st_stream_write(s->st, x, k, e);
        if (rc) return rc;
        prog_add(&s->bar, (double)k * sizeof(float));
        x += k;
        n -= k;
        s->put += k;
        if (s->put < want) continue;
        rc = st_stream_close(s->st, e); /* frees it either way */
        s->st = NULL;
        s->put = 0;
        s->file++;
        if (!rc && s->file == 1 && !s->model_only) {
            char p[CKPT_PATH];
            if (!(rc = fs_join_buf(p, CKPT_PATH, s->tmp, "optim.safetensors", e)))
                rc = ckpt_open_file(&s->st, p, s->m, 1, e);
        }
        if (rc) return rc;
    }
    return 0;
}

void ckpt_stream_abort(ckpt_stream *s) {
    if (s) ckpt_stream_free(s, 1);
}

/* ------------------------------------------------- a save in parts */

/* Writes tensor file `file` of m (0 model, 1 optim) at PATH: its header,
 * and its size set so every tensor's bytes lie at their offsets (a sparse
 * file until the writers fill it). */
static int ckpt_lay_file(const char *path, const lm_model *m, int file, ct_err *e) {
    int nt;
    char *names, *head = NULL;
    st_wtensor *ts = ckpt_file_tensors(m, file, &nt, &names);
    uint64_t *offs = ct_malloc(((size_t)nt + 1) * sizeof *offs), total = 0;
    size_t hl = 0;
    const char *meta[] = {"format", "pt", NULL};
    int rc = st_layout(path, ts, nt, meta, &head, &hl, offs, &total, e);
    if (!rc) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd < 0) rc = ct_fail(e, CT_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
        for (size_t done = 0; !rc && done < hl;) {
            ssize_t k = pwrite(fd, head + done, hl - done, (off_t)done);
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", path, k < 0 ? strerror(errno) : "no progress");
            else done += (size_t)k;
        }
        if (!rc && ftruncate(fd, (off_t)total) != 0)
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot size it to %llu bytes: %s", path, (unsigned long long)total,
                         strerror(errno));
        if (fd >= 0 && close(fd) != 0 && !rc) rc = ct_fail(e, CT_ERR_IO, "%s: cannot close: %s", path, strerror(errno));
    }
    free(head);
    free(offs);
    free(names);
    free(ts);
    return rc;
}

int ckpt_stream_begin_parts(ckpt_stream **out, const char *folder, int step, const lm_model *m, int model_only,
                            ct_err *e) {
    char p[CKPT_PATH];
    ckpt_stream *s;
    /* nothing streams through here: no bar */
    int rc = ckpt_stream_new(&s, folder, step, m, model_only, "checkpoint save", 0, 1e30, e);
    *out = NULL;
    if (rc) return rc;
    s->parts = 1;
    s->file = 2; /* the tensors' bytes come from ckpt_part_write, in every process */
    if (!(rc = fs_join_buf(p, CKPT_PATH, s->tmp, "model.safetensors", e))) rc = ckpt_lay_file(p, m, 0, e);
    if (!rc && !model_only && !(rc = fs_join_buf(p, CKPT_PATH, s->tmp, "optim.safetensors", e)))
        rc = ckpt_lay_file(p, m, 1, e);
    if (rc) {
        ckpt_stream_free(s, 1);
        return rc;
    }
    *out = s;
    return 0;
}

struct ckpt_part {
    char final[CKPT_PATH]; /* for messages: the step-N this save becomes */
    char path[2][CKPT_PATH];
    int fd[2];
    const lm_model *m;
    int model_only;
    uint64_t *offs[2]; /* each tensor's data offset in the file */
    uint64_t written;
};

int ckpt_part_open(ckpt_part **out, const char *tmp, const char *final, const lm_model *m, int model_only,
                   ct_err *e) {
    *out = NULL;
    ckpt_part *w = ct_calloc(1, sizeof *w);
    w->m = m;
    w->model_only = model_only;
    w->fd[0] = w->fd[1] = -1;
    snprintf(w->final, sizeof w->final, "%s", final);
    int rc = 0;
    for (int f = 0; f < (model_only ? 1 : 2) && !rc; f++) {
        rc = fs_join_buf(w->path[f], CKPT_PATH, tmp, f ? "optim.safetensors" : "model.safetensors", e);
        if (rc) break;
        int nt;
        char *names, *head = NULL;
        st_wtensor *ts = ckpt_file_tensors(m, f, &nt, &names);
        w->offs[f] = ct_malloc(((size_t)nt + 1) * sizeof *w->offs[f]);
        uint64_t total;
        size_t hl;
        const char *meta[] = {"format", "pt", NULL};
        rc = st_layout(w->path[f], ts, nt, meta, &head, &hl, w->offs[f], &total, e); /* rank 0 laid it out alike */
        free(head);
        free(names);
        free(ts);
        if (!rc && (w->fd[f] = open(w->path[f], O_WRONLY | O_CLOEXEC)) < 0)
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot open for writing: %s", w->path[f], strerror(errno));
    }
    if (rc) {
        ckpt_part_abort(w);
        return rc;
    }
    *out = w;
    return 0;
}

int ckpt_part_write(ckpt_part *w, int kind, int i, size_t at, const float *x, size_t n, ct_err *e) {
    const lm_model *m = w->m;
    const lm_tensor *t = &m->tensors[i];
    int f = kind != LM_PARAMS;
    if (f && w->model_only) return 0;
    if (i < 0 || i >= m->n_tensors || at + n > t->numel)
        return ct_fail(e, CT_ERR_IO, "%s: elements [%zu, %zu) are outside tensor %d (%zu elements)", w->final, at,
                       at + n, i, (size_t)(i >= 0 && i < m->n_tensors ? t->numel : 0));
    size_t bad = ct_first_nonfinite(x, n);
    if (bad < n)
        return ct_fail(e, CT_ERR_IO,
                       "%s: not saved: %s%s holds a non-finite value (%g at element %zu); the run has diverged, and "
                       "a checkpoint of it would resume the divergence (older checkpoints are left as they are)",
                       w->final, t->name, kind == LM_EXP_AVG ? ".exp_avg" : kind == LM_EXP_AVG_SQ ? ".exp_avg_sq" : "",
                       (double)x[bad], at + bad);
    uint64_t off = w->offs[f][(kind == LM_EXP_AVG_SQ ? m->n_tensors : 0) + i] + (uint64_t)at * sizeof(float);
    size_t len = n * sizeof(float), done = 0;
    while (done < len) {
        ssize_t k = pwrite(w->fd[f], (const char *)x + done, len - done, (off_t)(off + done));
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0)
            return ct_fail(e, CT_ERR_IO, "%s: write failed at byte %llu: %s", w->path[f],
                           (unsigned long long)(off + done), k < 0 ? strerror(errno) : "no progress");
        done += (size_t)k;
    }
    w->written += len;
    return 0;
}

uint64_t ckpt_part_written(const ckpt_part *w) { return w ? w->written : 0; }

static int ckpt_part_free(ckpt_part *w, int sync, ct_err *e) {
    int rc = 0;
    for (int f = 0; f < 2; f++) {
        if (w->fd[f] < 0) continue;
        /* each writer flushes its own pages: on a network file system rank 0's fsync would not */
        if (sync && !rc && fsync(w->fd[f]) != 0)
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot sync: %s", w->path[f], strerror(errno));
        if (close(w->fd[f]) != 0 && sync && !rc)
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot close: %s", w->path[f], strerror(errno));
        free(w->offs[f]);
    }
    free(w);
    return rc;
}

int ckpt_part_close(ckpt_part *w, ct_err *e) { return w ? ckpt_part_free(w, 1, e) : 0; }
void ckpt_part_abort(ckpt_part *w) {
    if (w) ckpt_part_free(w, 0, NULL);
}

int ckpt_stream_end(ckpt_stream *s, const char *state_json, const char *config_toml, ckpt_info *info, ct_err *e) {
    const char *names[8];
    char p[CKPT_PATH];
    int n = 0, rc = 0;
    uint64_t total = 0;
    if (s->file < (s->model_only ? 1 : 2))
        rc = ct_fail(e, CT_ERR_IO, "%s: the %s got only part of its data", s->final,
                     s->file ? "optim.safetensors" : "model.safetensors");
    names[n++] = "model.safetensors";
    if (!s->model_only) names[n++] = "optim.safetensors";
    for (int i = 0; i < n && !rc && s->parts; i++) /* every writer synced its own pages; this is the file's */
        if (!(rc = fs_join_buf(p, CKPT_PATH, s->tmp, names[i], e))) rc = fs_fsync(p, 0, e);
    if (!rc && !s->model_only && !state_json)
        rc = ct_fail(e, CT_ERR_IO, "%s: a full checkpoint needs the trainer state (state.json)", s->final);
    if (!rc && state_json) {
        names[n++] = "state.json";
        if (!(rc = fs_join_buf(p, CKPT_PATH, s->tmp, "state.json", e)))
            rc = ckpt_write_file(p, state_json, strlen(state_json), e);
    }
    if (!rc && config_toml) {
        names[n++] = "config.toml";
        if (!(rc = fs_join_buf(p, CKPT_PATH, s->tmp, "config.toml", e)))
            rc = ckpt_write_file(p, config_toml, strlen(config_toml), e);
    }
    if (!rc) {
        names[n++] = "config.json";
        if (!(rc = fs_join_buf(p, CKPT_PATH, s->tmp, "config.json", e)))
            rc = lm_config_write_hf(&s->m->cfg, p, "float32", e);
        if (!rc && s->n_id_src) rc = hf_keep_token_ids(p, s->id_src, s->n_id_src, e);
        if (!rc) rc = fs_fsync(p, 0, e);
    }
    if (!rc) rc = ckpt_write_manifest(s->tmp, s->step, s->model_only, names, n, &total, e);
    if (!rc) rc = fs_fsync(s->tmp, 1, e);
    if (!rc) rc = ckpt_publish(s->folder, s->tmp, s->final, s->step, e);
    if (rc) {
        ckpt_stream_free(s, 1);
        return rc;
    }
    if (info) {
        info->step = s->step;
        snprintf(info->dir, sizeof info->dir, "%s", s->final);
        info->bytes = total;
        info->seconds = ct_now() - s->t0;
    }
    prog_end(&s->bar);
    ckpt_stream_free(s, 0);
    return 0;
}

int ckpt_save(const char *folder, int step, const lm_model *m, const float *exp_avg, const float *exp_avg_sq,
              const char *state_json, const char *config_toml, ckpt_info *info, ct_err *e) {
    if (step < 0) return ct_fail(e, CT_ERR_IO, "%s: checkpoint step %d is negative", folder, step);
    if (!exp_avg != !exp_avg_sq)
        return ct_fail(e, CT_ERR_IO, "%s: step %d: give both AdamW moments or neither", folder, step);
    ckpt_stream *s;
    int rc = ckpt_stream_begin(&s, folder, step, m, exp_avg == NULL, e);
    if (!rc) rc = ckpt_stream_put(s, m->params, m->n_params, e);
    if (!rc && exp_avg) rc = ckpt_stream_put(s, exp_avg, m->n_params, e);
    if (!rc && exp_avg) rc = ckpt_stream_put(s, exp_avg_sq, m->n_params, e);
    if (rc) {
        ckpt_stream_abort(s);
        return rc;
    }
    return ckpt_stream_end(s, state_json, config_toml, info, e);
}

/* ---------------------------------------------------------- list/select */

static int ckpt_cmp_int(const void *a, const void *b) {
    int x = *(const int *)a, y = *(const int *)b;
    return (x > y) - (x < y);
}

/* All step-N of folder, ascending, malloc'd; count in *n. -1 on error. */
static int ckpt_list_all(const char *folder, int **out, int *n) {
    *out = NULL;
    *n = 0;
    DIR *d = opendir(folder);
    if (!d) return errno == ENOENT ? 0 : -1;
    int cap = 16, cnt = 0;
    int *v = ct_malloc((size_t)cap * sizeof *v);
    struct dirent *de;
    char p[CKPT_PATH];
    while ((de = readdir(d))) {
        int s = ckpt_step_of(de->d_name);
        if (s < 0 || fs_join_buf(p, CKPT_PATH, folder, de->d_name, NULL) || !ckpt_is_dir(p)) continue;
        if (cnt == cap) {
            cap *= 2;
            int *nv = realloc(v, (size_t)cap * sizeof *nv);
            if (!nv) {
                free(v);
                closedir(d);
                return -1;
            }
            v = nv;
        }
        v[cnt++] = s;
    }
    closedir(d);
    qsort(v, (size_t)cnt, sizeof *v, ckpt_cmp_int);
    *out = v;
    *n = cnt;
    return 0;
}

int ckpt_list(const char *folder, int *steps, int cap) {
    int *v, n;
    if (ckpt_list_all(folder, &v, &n)) return -1;
    for (int i = 0; i < n && i < cap; i++) steps[i] = v[i];
    free(v);
    return n;
}

int ckpt_dir_kind(const char *dir) {
    char p[CKPT_PATH + 32];
    snprintf(p, sizeof p, "%s/manifest.json", dir);
    if (access(p, F_OK) == 0) return CKPT_DIR_CHECKPOINT;
    snprintf(p, sizeof p, "%s/config.toml", dir);
    if (access(p, F_OK) == 0) return CKPT_DIR_CHECKPOINT; /* lost its manifest: damaged */
    snprintf(p, sizeof p, "%s/config.json", dir);
    if (access(p, F_OK) == 0) return CKPT_DIR_HF_MODEL;
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    return access(p, F_OK) == 0 ? CKPT_DIR_PEFT_ADAPTER : CKPT_DIR_CHECKPOINT;
}

void ckpt_adapter_hint(const char *dir, const char *base_as, const char *adapter_as, char *out, size_t cap) {
    char p[CKPT_PATH + 32];
    out[0] = 0;
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    if (access(p, F_OK) != 0) return;
    ct_err ignore = {0}; /* unreadable: the hint goes without the base's name */
    cJSON *o = json_parse_file(p, 1 << 20, &ignore);
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(o, "base_model_name_or_path");
    int named = cJSON_IsString(b) && b->valuestring[0];
    snprintf(out, cap, " (%s holds a LoRA adapter, adapter_config.json: give the base model%s%s%s as %s and %s as %s)",
             dir, named ? " (" : "", named ? b->valuestring : "", named ? ")" : "", base_as, dir, adapter_as);
    cJSON_Delete(o);
}

const char *ckpt_dir_kind_name(int kind) {
    return kind == CKPT_DIR_HF_MODEL ? "a Hugging Face export" : kind == CKPT_DIR_PEFT_ADAPTER ? "a PEFT adapter"
                                                                                           : "a training checkpoint";
}

/* The newest of FOLDER's steps v[0..n) (ascending) that a reader takes: a
 * training checkpoint that verifies or, with `exports`, a final export (a
 * model, renamed into place whole: nothing to verify); without, each export
 * is named in a note, as it cannot be resumed. Damaged checkpoints newer
 * than it are reported and counted in *damaged. p[CKPT_PATH] gets its
 * directory, *chosen its step (-1: none), *kind its ckpt_dir_kind. */
static int ckpt_newest(const char *folder, const int *v, int n, int exports, ckpt_verify_fn verify, void *vctx,
                       char *p, int *chosen, int *kind, int *damaged, ct_err *e) {
    char name[32];
    *chosen = -1;
    *damaged = 0;
    for (int i = n - 1; i >= 0 && *chosen < 0; i--) {
        snprintf(name, sizeof name, "step-%d", v[i]);
        int rc = fs_join_buf(p, CKPT_PATH, folder, name, e);
        if (rc) return rc;
        ct_err ve = {0};
        *kind = ckpt_dir_kind(p);
        if (*kind != CKPT_DIR_CHECKPOINT && !exports) {
            /* a finished run's final save: a whole model, but no optimizer state to resume */
            fprintf(stderr, "ctitan: note: %s is %s (a run's final save), not a training checkpoint: it cannot "
                    "be resumed; looking at older steps\n", p, ckpt_dir_kind_name(*kind));
        } else if (*kind != CKPT_DIR_CHECKPOINT || ckpt_verify_by(verify, vctx, p, v[i], &ve) == 0) {
            *chosen = v[i];
        } else {
            (*damaged)++;
            fprintf(stderr, "ctitan: warning: skipping damaged checkpoint %s: %s\n", p, ve.msg);
        }
    }
    return 0;
}

/* The chosen directory p into the caller's out_dir[cap] (NULL: not wanted). */
static int ckpt_give_dir(char *out_dir, size_t cap, const char *p, ct_err *e) {
    if (!out_dir) return 0;
    int k = snprintf(out_dir, cap, "%s", p);
    return k < 0 || (size_t)k >= cap ? ct_fail(e, CT_ERR_IO, "%s: path too long for the caller's buffer", p) : 0;
}

int ckpt_select_model(const char *folder, char *out_dir, size_t cap, int *out_step, int *out_kind, ct_err *e) {
    int *v, n;
    if (ckpt_list_all(folder, &v, &n))
        return ct_fail(e, CT_ERR_IO, "%s: cannot list the checkpoint folder: %s", folder, strerror(errno));
    char p[CKPT_PATH];
    int chosen = -1, kind = CKPT_DIR_CHECKPOINT, damaged = 0;
    int rc = n == 0 ? CKPT_NONE : ckpt_newest(folder, v, n, 1, NULL, NULL, p, &chosen, &kind, &damaged, e);
    if (!rc && chosen < 0)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: none of its %d checkpoints is complete and intact (see warnings)", folder,
                     damaged);
    free(v);
    if (rc || (rc = ckpt_give_dir(out_dir, cap, p, e))) return rc;
    if (out_step) *out_step = chosen;
    if (out_kind) *out_kind = kind;
    return 0;
}

int ckpt_select(const char *folder, int load_step, char *out_dir, size_t cap, int *out_step, ct_err *e) {
    return ckpt_select_with(folder, load_step, NULL, NULL, out_dir, cap, out_step, e);
}

int ckpt_select_with(const char *folder, int load_step, ckpt_verify_fn verify, void *vctx, char *out_dir, size_t cap,
                     int *out_step, ct_err *e) {
    int *v, n;
    if (ckpt_list_all(folder, &v, &n))
        return ct_fail(e, CT_ERR_IO, "%s: cannot list the checkpoint folder: %s", folder, strerror(errno));
    char p[CKPT_PATH], name[32];
    int rc = 0, chosen = -1;
    if (load_step >= 0) {
        int present = 0;
        for (int i = 0; i < n; i++) present |= v[i] == load_step;
        snprintf(name, sizeof name, "step-%d", load_step);
        rc = fs_join_buf(p, CKPT_PATH, folder, name, e);
        if (!rc && !present) rc = ct_fail(e, CT_ERR_IO, "%s: no such checkpoint (load_step %d)", p, load_step);
        int kind = rc ? CKPT_DIR_CHECKPOINT : ckpt_dir_kind(p);
        if (!rc && kind != CKPT_DIR_CHECKPOINT)
            rc = ct_fail(e, CT_ERR_CONFIG,
                         "checkpoint.load_step = %d: %s holds %s, a finished run's final save, which has no "
                         "optimizer or data state to resume from (it can seed a run: %s)",
                         load_step, p, ckpt_dir_kind_name(kind),
                         kind == CKPT_DIR_PEFT_ADAPTER ? "lora.adapter_path, with the base model it was trained on"
                                                       : "checkpoint.initial_load_path");
        if (!rc) {
            ct_err ve = {0};
            if (ckpt_verify_by(verify, vctx, p, load_step, &ve))
                rc = ct_fail(e, ve.code, "checkpoint step %d is damaged, not loading it: %s", load_step, ve.msg);
        }
        if (!rc) chosen = load_step;
    } else if (n == 0) {
        rc = CKPT_NONE;
    } else {
        int damaged = 0, kind;
        rc = ckpt_newest(folder, v, n, 0, verify, vctx, p, &chosen, &kind, &damaged, e);
        if (!rc && chosen < 0 && !damaged) rc = CKPT_NONE; /* final exports only: no checkpoint to resume */
        if (!rc && chosen < 0)
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: none of its %d checkpoints is complete and intact (see warnings)",
                         folder, damaged);
    }
    free(v);
    if (rc || (rc = ckpt_give_dir(out_dir, cap, p, e))) return rc;
    if (out_step) *out_step = chosen;
    return 0;
}

/* ---------------------------------------------------------------- load */

static void ckpt_shape_str(char *out, size_t cap, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(out + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(out + k, cap - k, "]");
}

/* A tensor loaded from a checkpoint must hold finite values (and a second
 * moment no negative ones): checksums only say the file is what was
 * written, and a NaN loaded here surfaced steps later as "loss is nan",
 * naming nothing. Saves refuse such values (stream_check_finite); this
 * catches a file written otherwise. */
static int ckpt_check_values(const char *path, const char *name, const float *x, size_t n, size_t first, int nonneg,
                             ct_err *e) {
    int rc = ct_check_finite(x, n, first, path, name, e);
    for (size_t i = 0; !rc && nonneg && i < n; i++)
        if (x[i] < 0.0f)
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" holds %g at element %zu (a second moment is never "
                         "negative)", path, name, (double)x[i], first + i);
    return rc;
}

/* A load in progress: where the rows go, which ones this process keeps,
 * and the one block buffer they are read into. */
typedef struct {
    const lm_model *m;
    const lm_sink *sink;
    const ckpt_rows *want;
    prog_bar *bar;
    float *buf;
    size_t buf_cap;   /* floats */
    size_t (*runs)[2]; /* the wanted rows of the tensor being read, then (cols) its wanted columns */
    int n_runs, runs_cap;
    uint64_t read;    /* tensor bytes read */
} ckpt_reader;

/* The pending pread of a strided read: file bytes [off, off + len) into dst. */
typedef struct {
    uint64_t off;
    size_t len;
    char *dst;
} ckpt_piece;

/* Rows read at once: 8 MiB, or one row when a row is larger. */
#define CKPT_BLOCK_BYTES ((size_t)8 << 20)

static void ckpt_runs_add(void *acc, size_t r0, size_t r1) {
    ckpt_reader *r = acc;
    if (r0 >= r1) return;
    if (r->n_runs && r->runs[r->n_runs - 1][1] >= r0) { /* adjacent or overlapping: one pread */
        if (r1 > r->runs[r->n_runs - 1][1]) r->runs[r->n_runs - 1][1] = r1;
        return;
    }
    if (r->n_runs == r->runs_cap) {
        r->runs_cap = r->runs_cap ? 2 * r->runs_cap : 16;
        size_t(*g)[2] = ct_malloc((size_t)r->runs_cap * sizeof *g);
        if (r->n_runs) memcpy(g, r->runs, (size_t)r->n_runs * sizeof *g);
        free(r->runs);
        r->runs = g;
    }
    r->runs[r->n_runs][0] = r0;
    r->runs[r->n_runs][1] = r1;
    r->n_runs++;
}

/* Bytes [off, off + n) of fd into dst. The file's size matched the
 * manifest and the header was validated, so a short read is damage. */
static int ckpt_pread(int fd, const char *path, void *dst, size_t n, uint64_t off, ct_err *e) {
    size_t done = 0;
    while (done < n) {
        ssize_t k = pread(fd, (char *)dst + done, n - done, (off_t)(off + done));
        if (k < 0 && errno == EINTR) continue;
        if (k < 0)
            return ct_fail(e, CT_ERR_IO, "%s: read failed at byte %llu: %s", path,
                           (unsigned long long)(off + done), strerror(errno));
        if (k == 0)
            return ct_fail(e, CT_ERR_FORMAT, "%s: ends at byte %llu, inside tensor data (truncated)", path,
                           (unsigned long long)(off + done));
        done += (size_t)k;
    }
    return 0;
}

/* Reads and checks a pending piece (ckpt_read_tensor's column runs): elem
 * is its first element's index in the tensor, for the messages. */
static int ckpt_read_piece(ckpt_reader *r, int fd, const char *path, const char *nm, int kind, uint64_t base,
                           ckpt_piece *pc, ct_err *e) {
    if (!pc->len) return 0;
    size_t n = pc->len / sizeof(float);
    int rc = ckpt_pread(fd, path, pc->dst, pc->len, pc->off, e);
    if (!rc) rc = ckpt_check_values(path, nm, (const float *)pc->dst, n, (size_t)((pc->off - base) / sizeof(float)),
                                    kind == LM_EXP_AVG_SQ, e);
    r->read += pc->len;
    if (r->bar) prog_add(r->bar, (double)pc->len);
    pc->len = 0;
    return rc;
}

/* Tensor st (named nm) of file f, open as fd, into the sink as rows of
 * model tensor i: only the runs of rows r->want names, a block at a time,
 * each checked before the sink sees it; of each row only the columns
 * want->cols names (a TP rank's block of a row-parallel weight), one pread
 * per piece, or per run of pieces that lie end to end in the file. */
static int ckpt_read_tensor(ckpt_reader *r, st_file *f, int fd, const st_tensor *st, const char *nm, int i, int kind,
                            ct_err *e) {
    const lm_tensor *t = &r->m->tensors[i];
    const char *path = st_path(f);
    size_t cols = lm_tensor_cols(t), rows = cols ? t->numel / cols : 0;
    if (!r->buf) r->buf = ct_calloc((r->buf_cap = 1), sizeof(float));
    if (!rows) {
        r->sink->put(r->sink->ctx, kind, i, 0, 0, r->buf);
        return 0;
    }
    /* the wanted columns first (the runs buffer is reused for the rows); none named: whole rows, one
     * run of every column, whose rows lie end to end so that a block is one pread */
    r->n_runs = 0;
    if (r->want && r->want->cols) r->want->cols(r->want->ctx, kind, i, ckpt_runs_add, r);
    size_t every[1][2] = {{0, cols}}, (*cr)[2] = every;
    int nc = 1;
    if (r->n_runs && !(r->n_runs == 1 && r->runs[0][0] == 0 && r->runs[0][1] >= cols)) {
        nc = r->n_runs;
        cr = ct_malloc((size_t)nc * sizeof *cr);
        memcpy(cr, r->runs, (size_t)nc * sizeof *cr);
    }
    r->n_runs = 0;
    if (r->want && r->want->rows) r->want->rows(r->want->ctx, kind, i, ckpt_runs_add, r);
    else ckpt_runs_add(r, 0, rows);
    size_t block = CKPT_BLOCK_BYTES / sizeof(float) / cols;
    if (!block) block = 1;
    uint64_t base = st_data_offset(f, st);
    int rc = 0;
    for (int k = 0; k < r->n_runs && !rc; k++) {
        size_t a = r->runs[k][0], b = r->runs[k][1] < rows ? r->runs[k][1] : rows;
        for (size_t r0 = a; r0 < b && !rc; r0 += block) {
            size_t r1 = r0 + block < b ? r0 + block : b, n = (r1 - r0) * cols;
            if (n > r->buf_cap) { /* zeroed: the columns not read stay finite, never uninitialised */
                free(r->buf);
                r->buf = ct_calloc((r->buf_cap = n), sizeof(float));
            }
            ckpt_piece pc = {0, 0, NULL};
            for (size_t row = r0; row < r1 && !rc; row++)
                for (int j = 0; j < nc && !rc; j++) {
                    size_t c0 = cr[j][0], c1 = cr[j][1] < cols ? cr[j][1] : cols;
                    if (c0 >= c1) continue;
                    uint64_t off = base + ((uint64_t)row * cols + c0) * sizeof(float);
                    char *dst = (char *)(r->buf + (row - r0) * cols + c0);
                    if (pc.len && pc.off + pc.len == off) { /* end to end in the file (and in buf) */
                        pc.len += (c1 - c0) * sizeof(float);
                        continue;
                    }
                    rc = ckpt_read_piece(r, fd, path, nm, kind, base, &pc, e);
                    pc = (ckpt_piece){off, (c1 - c0) * sizeof(float), dst};
                }
            if (!rc) rc = ckpt_read_piece(r, fd, path, nm, kind, base, &pc, e);
            if (!rc) r->sink->put(r->sink->ctx, kind, i, r0, r1, r->buf);
        }
    }
    if (cr != every) free(cr);
    return rc;
}

/* Hands, for every model tensor T, the tensor "T" + suffix of file f (open
 * as fd) to the sink as `kind`, and checks that f holds nothing else. */
static int ckpt_load_tensors(ckpt_reader *r, st_file *f, int fd, const char *suffix, int kind, ct_err *e) {
    const lm_model *m = r->m;
    const char *path = st_path(f);
    char nm[LM_NAME_MAX + 16];
    for (int i = 0; i < m->n_tensors; i++) {
        const lm_tensor *t = &m->tensors[i];
        snprintf(nm, sizeof nm, "%s%s", t->name, suffix);
        const st_tensor *st = st_find(f, nm);
        if (!st) return ct_fail(e, CT_ERR_FORMAT, "%s: missing tensor \"%s\" (the model needs it)", path, nm);
        int same = st->ndim == t->ndim;
        for (int d = 0; same && d < t->ndim; d++) same = st->shape[d] == t->shape[d];
        if (!same) {
            char got[128], want[128];
            ckpt_shape_str(got, sizeof got, st->ndim, st->shape);
            ckpt_shape_str(want, sizeof want, t->ndim, t->shape);
            return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has shape %s, the model expects %s", path, nm, got,
                           want);
        }
        if (st->dtype != CT_F32)
            return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" is %s; checkpoints hold F32", path, nm,
                           ct_dtype_name(st->dtype));
        int rc = ckpt_read_tensor(r, f, fd, st, nm, i, kind, e);
        if (rc) return rc;
    }
    if (st_count(f) != m->n_tensors) {
        /* counts differ and every needed name was found: some name is extra */
        for (int i = 0; i < st_count(f); i++) {
            const char *sn = st_get(f, i)->name;
            size_t ls = strlen(sn), lx = strlen(suffix);
            int ok = ls > lx && !strcmp(sn + ls - lx, suffix);
            if (ok) {
                snprintf(nm, sizeof nm, "%.*s", (int)(ls - lx), sn);
                ok = lm_find(m, nm) != NULL;
            }
            if (!ok) return ct_fail(e, CT_ERR_FORMAT, "%s: unexpected tensor \"%s\" (not part of this model)", path, sn);
        }
    }
    return 0;
}

/* The checkpoint must be for the same architecture as the model. */
static int ckpt_check_config(const char *dir, const lm_config *mc, ct_err *e) {
    lm_config c;
    int rc = lm_config_from_hf(&c, dir, e);
    if (rc) return rc;
    char p[CKPT_PATH];
    if ((rc = fs_join_buf(p, CKPT_PATH, dir, "config.json", e))) return rc;
#define CKPT_SAME(field, key)                                                                                     \
    if (c.field != mc->field)                                                                                    \
        return ct_fail(e, CT_ERR_CONFIG, "%s: %s is %.17g but the model being trained has %.17g", p, key,        \
                       (double)c.field, (double)mc->field);
    /* the family and what its layers compute, not only the sizes: a
     * checkpoint whose config.json says another model_type or activation
     * would otherwise load into this model's tensors of the same shapes */
    const char *was = c.model_type[0] ? c.model_type : c.n_experts ? "qwen3_moe" : "qwen3";
    const char *now = mc->model_type[0] ? mc->model_type : mc->n_experts ? "qwen3_moe" : "qwen3";
    /* a mistral file with layer_types is read as ministral (as AutoConfig reads it) since
     * cd2f196; the builds before saved its checkpoints as mistral: Mistral's layers either
     * way, the windows each layer gets compared below (layer_types) */
    if (!strcmp(was, "mistral") && !strcmp(now, "ministral")) was = now;
    if (strcmp(was, now))
        return ct_fail(e, CT_ERR_CONFIG, "%s: model_type is \"%s\" but the model being trained is \"%s\"", p, was,
                       now);
    if (c.act != mc->act)
        return ct_fail(e, CT_ERR_CONFIG, "%s: the activation is %s but the model being trained uses %s", p,
                       c.act == LM_ACT_SILU ? "silu" : "gelu_pytorch_tanh",
                       mc->act == LM_ACT_SILU ? "silu" : "gelu_pytorch_tanh");
    /* each bias under the key that switches it in the family's config (qwen2_moe's qkv_bias,
     * ERNIE's one use_bias, Seed-OSS's attention_out_bias for o_proj) */
    int ernie = !strcmp(now, "ernie4_5") || !strcmp(now, "ernie4_5_moe");
    int emoe = !strcmp(now, "ernie4_5_moe"); /* its MoE keys: moe_num_experts, moe_k, moe_layer_* */
    CKPT_SAME(qkv_bias, !strcmp(now, "qwen2_moe") ? "qkv_bias" : ernie ? "use_bias" : "attention_bias")
    CKPT_SAME(o_bias, ernie ? "use_bias" : !strcmp(now, "seed_oss") ? "attention_out_bias" : "attention_bias")
    CKPT_SAME(mlp_bias, ernie ? "use_bias" : "mlp_bias")
    CKPT_SAME(sliding_window, "sliding_window")
    CKPT_SAME(attn_softcap, "attn_logit_softcapping")
    CKPT_SAME(final_softcap, "final_logit_softcapping")
    CKPT_SAME(attn_scale, "the attention score scale (attention_multiplier, query_pre_attn_scalar)")
    CKPT_SAME(embed_mult, "embedding_multiplier")
    CKPT_SAME(residual_mult, "residual_multiplier")
    CKPT_SAME(logits_div, "logits_scaling")
    CKPT_SAME(vocab_size, "vocab_size")
    CKPT_SAME(hidden, "hidden_size")
    CKPT_SAME(intermediate, "intermediate_size")
    CKPT_SAME(n_layers, "num_hidden_layers")
    CKPT_SAME(n_heads, "num_attention_heads")
    CKPT_SAME(n_kv_heads, "num_key_value_heads")
    CKPT_SAME(head_dim, "head_dim")
    CKPT_SAME(tie_embeddings, "tie_word_embeddings")
    CKPT_SAME(rope_theta, "rope_theta")
    CKPT_SAME(rms_eps, "rms_norm_eps")
    /* Ministral 3's q scale by position (both keys change the model) */
    CKPT_SAME(q_scale_beta, "rope_parameters.llama_4_scaling_beta")
    CKPT_SAME(q_scale_len, "rope_parameters.original_max_position_embeddings (the q scale's length)")
    CKPT_SAME(n_experts, emoe ? "moe_num_experts" : mc->router_sigmoid ? "n_routed_experts" : "num_experts")
    CKPT_SAME(top_k, emoe ? "moe_k" : "num_experts_per_tok")
    CKPT_SAME(moe_intermediate, "moe_intermediate_size")
    CKPT_SAME(norm_topk_prob, "norm_topk_prob")
    /* GLM-4.5's router */
    CKPT_SAME(router_sigmoid, "the router's scores (sigmoid or softmax)")
    CKPT_SAME(n_group, "n_group")
    CKPT_SAME(topk_group, "topk_group")
    CKPT_SAME(routed_scaling, "routed_scaling_factor")
    CKPT_SAME(moe_norm_min, "moe_norm_min")
    CKPT_SAME(decoder_sparse_step, emoe ? "moe_layer_interval" : "decoder_sparse_step")
    CKPT_SAME(shared_intermediate, emoe ? "the shared experts' width (moe_num_shared_experts x moe_intermediate_size)"
                                   : mc->router_sigmoid ? "the shared experts' width (n_shared_experts x "
                                                          "moe_intermediate_size)"
                                   : strcmp(now, "granitemoeshared") ? "shared_expert_intermediate_size"
                                                                      : "shared_intermediate_size")
    for (int l = 0; l < c.n_layers; l++)
        if (lm_layer_is_moe(&c, l) != lm_layer_is_moe(mc, l))
            return ct_fail(e, CT_ERR_CONFIG, "%s: layer %d is %s there but %s in the model being trained "
                           "(%s)", p, l, lm_layer_is_moe(&c, l) ? "sparse" : "dense",
                           lm_layer_is_moe(mc, l) ? "sparse" : "dense",
                           emoe ? "moe_layer_start_index, moe_layer_end_index"
                           : mc->router_sigmoid ? "first_k_dense_replace" : "mlp_only_layers");
    for (int l = 0; l < c.n_layers; l++)
        if (c.layer_nope[l] != mc->layer_nope[l])
            return ct_fail(e, CT_ERR_CONFIG, "%s: layer %d %s RoPE there but %s in the model being trained "
                           "(%s)", p, l, c.layer_nope[l] ? "has no" : "has",
                           mc->layer_nope[l] ? "none" : "RoPE",
                           strcmp(now, "exaone4") ? "no_rope_layers" : "sliding_window and layer_types");
    for (int l = 0; l < c.n_layers; l++)
        if (c.layer_sliding[l] != mc->layer_sliding[l])
            return ct_fail(e, CT_ERR_CONFIG, "%s: layer %d is %s there but %s in the model being trained (layer_types)",
                           p, l, c.layer_sliding[l] ? "sliding_attention" : "full_attention",
                           mc->layer_sliding[l] ? "sliding_attention" : "full_attention");
    /* the RoPE each layer kind computes (rope_parameters): its frequencies and scale at the
     * longest length either side allows (dynamic RoPE's depend on it), not the keys' spelling */
    for (int k = 0; k < 2; k++) {
        rope_params a = lm_rope_params(&c, k), b = lm_rope_params(mc, k);
        int L = a.max_pos > b.max_pos ? a.max_pos : b.max_pos, ra = rope_rotary_dim(&a, c.head_dim);
        double ia[ROPE_MAX_HALF], ib[ROPE_MAX_HALF], sa = 1, sb = 1;
        int same = ra == rope_rotary_dim(&b, mc->head_dim);
        if (same) {
            rope_inv_freq(&a, c.head_dim, L > 0 ? L : 1, ia, &sa);
            rope_inv_freq(&b, mc->head_dim, L > 0 ? L : 1, ib, &sb);
            same = sa == sb && memcmp(ia, ib, (size_t)ra / 2 * sizeof(double)) == 0;
        }
        if (!same)
            return ct_fail(e, CT_ERR_CONFIG, "%s: the %s layers' RoPE differs from the model being trained's "
                           "(rope_parameters)", p, k ? "sliding" : "full-attention");
    }
#undef CKPT_SAME
    return 0;
}

int ckpt_load(const char *dir, lm_model *m, float *exp_avg, float *exp_avg_sq, char **state_json,
              ckpt_info *info, ct_err *e) {
    lm_copy_ctx cc;
    lm_sink s = lm_copy_sink(&cc, m, exp_avg, exp_avg_sq);
    return ckpt_load_each(dir, m, exp_avg || exp_avg_sq, state_json, info, &s, e);
}

static int ckpt_load_checked(const char *dir, const ckpt_manifest *mp, ckpt_reader *r, int moments, int verified,
                             char **state_json, uint64_t *hashed, ct_err *e);

int ckpt_load_each(const char *dir, const lm_model *m, int moments, char **state_json, ckpt_info *info,
                   const lm_sink *sink, ct_err *e) {
    return ckpt_load_part(dir, m, moments, state_json, info, sink, NULL, 0, e);
}

int ckpt_load_part(const char *dir, const lm_model *m, int moments, char **state_json, ckpt_info *info,
                   const lm_sink *sink, const ckpt_rows *want, int verified, ct_err *e) {
    double t0 = ct_now();
    if (state_json) *state_json = NULL;
    ckpt_manifest man;
    int rc = ckpt_read_manifest(dir, &man, e);
    if (rc) return rc;
    /* one bar over both passes: every file read for its checksum, then the tensors (at most all of them) */
    double total = (double)m->n_params * sizeof(float) * (moments && !man.model_only ? 3 : 1);
    for (int i = 0; i < man.n && !verified; i++) total += (double)man.f[i].bytes;
    char label[64];
    snprintf(label, sizeof label, "checkpoint load step-%d (%s)", man.step, verified ? "read" : "verify + read");
    prog_bar bar;
    prog_begin(&bar, label, total, "B", CKPT_PROG_MIN_S);
    ckpt_reader r = {.m = m, .sink = sink, .want = want, .bar = &bar};
    uint64_t hashed = 0;
    rc = ckpt_load_checked(dir, &man, &r, moments, verified, state_json, &hashed, e);
    free(r.buf);
    free(r.runs);
    if (rc) {
        prog_break(&bar);
        return rc;
    }
    prog_end(&bar);
    if (info) {
        info->step = man.step;
        snprintf(info->dir, sizeof info->dir, "%s", dir);
        info->bytes = 0;
        for (int i = 0; i < man.n; i++) info->bytes += man.f[i].bytes;
        info->seconds = ct_now() - t0;
        info->read_bytes = r.read;
        info->hashed_bytes = hashed;
    }
    return 0;
}

/* st_open's parse of the header (the mapping is not read beyond it) and an
 * fd for pread of the rows wanted. */
static st_file *ckpt_open_tensors(const char *path, int *fd, ct_err *e) {
    st_file *f = st_open(path, e);
    if (!f) return NULL;
    if ((*fd = open(path, O_RDONLY | O_CLOEXEC)) < 0) {
        ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        st_close(f);
        return NULL;
    }
    return f;
}

/* ckpt_load_part once the manifest is read: checksums, config, tensors, state. */
static int ckpt_load_checked(const char *dir, const ckpt_manifest *mp, ckpt_reader *r, int moments, int verified,
                             char **state_json, uint64_t *hashed, ct_err *e) {
    const ckpt_manifest man = *mp;
    const lm_model *m = r->m;
    int rc = ckpt_check_files(dir, &man, !verified, r->bar, hashed, e);
    if (rc) return rc;
    if (moments && man.model_only)
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: a model-only checkpoint (no optim.safetensors): it can seed a run, not resume one", dir);
    if ((rc = ckpt_check_config(dir, &m->cfg, e))) return rc;
    char p[CKPT_PATH];
    int fd = -1;
    if ((rc = fs_join_buf(p, CKPT_PATH, dir, "model.safetensors", e))) return rc;
    st_file *f = ckpt_open_tensors(p, &fd, e);
    if (!f) return e ? e->code : CT_ERR_FORMAT;
    rc = ckpt_load_tensors(r, f, fd, "", LM_PARAMS, e);
    close(fd);
    st_close(f);
    if (rc) return rc;
    if (moments) {
        if ((rc = fs_join_buf(p, CKPT_PATH, dir, "optim.safetensors", e))) return rc;
        if (!(f = ckpt_open_tensors(p, &fd, e))) return e ? e->code : CT_ERR_FORMAT;
        /* the file holds both moments: check each half, then that nothing else is there */
        const char *sfx[2] = {".exp_avg", ".exp_avg_sq"};
        char nm[LM_NAME_MAX + 16];
        for (int k = 0; k < 2 && !rc; k++)
            for (int i = 0; i < m->n_tensors && !rc; i++) {
                const lm_tensor *t = &m->tensors[i];
                snprintf(nm, sizeof nm, "%s%s", t->name, sfx[k]);
                const st_tensor *st = st_find(f, nm);
                if (!st) {
                    rc = ct_fail(e, CT_ERR_FORMAT, "%s: missing tensor \"%s\" (the optimizer needs it)", p, nm);
                    break;
                }
                int same = st->ndim == t->ndim && st->dtype == CT_F32;
                for (int d = 0; same && d < t->ndim; d++) same = st->shape[d] == t->shape[d];
                if (!same) {
                    char got[128], want[128];
                    ckpt_shape_str(got, sizeof got, st->ndim, st->shape);
                    ckpt_shape_str(want, sizeof want, t->ndim, t->shape);
                    rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" is %s %s, the optimizer expects F32 %s", p, nm,
                                 ct_dtype_name(st->dtype), got, want);
                    break;
                }
                rc = ckpt_read_tensor(r, f, fd, st, nm, i, k ? LM_EXP_AVG_SQ : LM_EXP_AVG, e);
            }
        if (!rc && st_count(f) != 2 * m->n_tensors) {
            for (int i = 0; i < st_count(f) && !rc; i++) {
                const char *sn = st_get(f, i)->name;
                int ok = 0;
                for (int k = 0; k < 2 && !ok; k++) {
                    size_t ls = strlen(sn), lx = strlen(sfx[k]);
                    if (ls > lx && !strcmp(sn + ls - lx, sfx[k])) {
                        snprintf(nm, sizeof nm, "%.*s", (int)(ls - lx), sn);
                        ok = lm_find(m, nm) != NULL;
                    }
                }
                if (!ok) rc = ct_fail(e, CT_ERR_FORMAT, "%s: unexpected tensor \"%s\" (not part of this model)", p, sn);
            }
        }
        close(fd);
        st_close(f);
        if (rc) return rc;
    }
    if (state_json) {
        int listed = 0;
        for (int i = 0; i < man.n; i++) listed |= !strcmp(man.f[i].name, "state.json");
        if (listed) {
            if ((rc = fs_join_buf(p, CKPT_PATH, dir, "state.json", e))) return rc;
            if (!(*state_json = fs_read_file(p, CKPT_TEXT_MAX, NULL, e))) return e ? e->code : CT_ERR_IO;
        }
    }
    return 0;
}

/* --------------------------------------------------------------- prune */

/* Removes a step-N by renaming it aside first, so a crash mid-removal never
 * leaves a half-deleted step-N that looks damaged. */
static int ckpt_remove_step(const char *folder, int step, ct_err *e) {
    char from[CKPT_PATH], aside[CKPT_PATH], name[64];
    snprintf(name, sizeof name, "step-%d", step);
    int rc = fs_join_buf(from, CKPT_PATH, folder, name, e);
    snprintf(name, sizeof name, ".step-%d.del-%ld", step, (long)getpid());
    if (!rc) rc = fs_join_buf(aside, CKPT_PATH, folder, name, e);
    if (rc) return rc;
    if (rename(from, aside) != 0)
        return ct_fail(e, CT_ERR_IO, "%s: cannot move it aside for removal: %s", from, strerror(errno));
    rc = fs_fsync(folder, 1, e);
    if (!rc) rc = ct_rm_tree(aside, e);
    return rc;
}

static int ckpt_pid_alive(long pid) {
    if (pid <= 0 || pid == (long)getpid()) return 0; /* our own leftovers: we are not writing them now */
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

int ckpt_clean_temps(const char *folder, int all, int *n, char *first, size_t cap, ct_err *e) {
    if (n) *n = 0;
    if (cap) first[0] = 0;
    if (!ckpt_is_dir(folder)) return 0;
    char p[CKPT_PATH], q[CKPT_PATH], name[32];
    int rc = 0;
    DIR *d = opendir(folder);
    if (!d) return ct_fail(e, CT_ERR_IO, "%s: cannot list: %s", folder, strerror(errno));
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        int step;
        long pid;
        int kind = ckpt_temp_of(de->d_name, &step, &pid);
        if (!kind || (!all && ckpt_pid_alive(pid))) continue;
        if ((rc = fs_join_buf(p, CKPT_PATH, folder, de->d_name, e))) break;
        if (n && !(*n)++ && cap) snprintf(first, cap, "%s", de->d_name);
        if (kind == 'o') {
            snprintf(name, sizeof name, "step-%d", step);
            if ((rc = fs_join_buf(q, CKPT_PATH, folder, name, e))) break;
            struct stat st;
            if (stat(q, &st) != 0 && errno == ENOENT) {
                if (rename(p, q) != 0)
                    rc = ct_fail(e, CT_ERR_IO, "%s: cannot restore it as %s: %s", p, q, strerror(errno));
                continue;
            }
        }
        rc = ct_rm_tree(p, e);
    }
    closedir(d);
    return rc;
}

int ckpt_prune(const char *folder, int keep_latest_k, ct_err *e) {
    if (!ckpt_is_dir(folder)) return 0;
    char p[CKPT_PATH], name[32];
    /* temp dirs first: an ".old" left between the two renames of a fallback
     * replace is the only copy of its step when step-N is missing */
    int rc = ckpt_clean_temps(folder, 0, NULL, NULL, 0, e);
    if (rc || keep_latest_k <= 0) return rc;

    int *v, n;
    if (ckpt_list_all(folder, &v, &n)) return ct_fail(e, CT_ERR_IO, "%s: cannot list: %s", folder, strerror(errno));
    int kept = 0, oldest_kept = -1;
    for (int i = n - 1; i >= 0 && kept < keep_latest_k; i--) {
        snprintf(name, sizeof name, "step-%d", v[i]);
        if ((rc = fs_join_buf(p, CKPT_PATH, folder, name, e))) break;
        ckpt_manifest man;
        ct_err ve = {0};
        /* only full checkpoints count: a final model-only save must not push out
         * the last checkpoint a run can resume from */
        if (ckpt_verify_level(p, 0, &man, &ve) == 0 && !man.model_only) {
            kept++;
            oldest_kept = v[i];
        }
    }
    /* a final export is a finished run's model (extended since), not a checkpoint to rotate out */
    for (int i = 0; !rc && kept == keep_latest_k && i < n && v[i] < oldest_kept; i++) {
        snprintf(name, sizeof name, "step-%d", v[i]);
        if ((rc = fs_join_buf(p, CKPT_PATH, folder, name, e))) break;
        if (ckpt_dir_kind(p) == CKPT_DIR_CHECKPOINT) rc = ckpt_remove_step(folder, v[i], e);
    }
    free(v);
    return rc;
}
