/* core/fs.c: path joins, whole-file reads, fsync, atomic replace, mkdir -p, rm -rf. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* fsync, O_DIRECTORY under -std=c11 */
#endif
#include "core/fs.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

char *fs_join(const char *dir, const char *name) {
    size_t a = strlen(dir), b = strlen(name);
    char *p = ct_malloc(a + b + 2);
    memcpy(p, dir, a);
    p[a] = '/';
    memcpy(p + a + 1, name, b + 1);
    return p;
}

int fs_join_buf(char *out, size_t cap, const char *dir, const char *name, ct_err *e) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return ct_fail(e, CT_ERR_IO, "%s/%s: path too long", dir, name);
    return 0;
}

/* ct_fail that leaves errno as it found it, for callers that word their own message */
#define FS_FAIL(err, ...) (ct_fail(e, __VA_ARGS__), errno = (err), NULL)

char *fs_read_file(const char *path, size_t cap, size_t *len, ct_err *e) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        int err = errno;
        return FS_FAIL(err, CT_ERR_IO, "%s: cannot open: %s", path, strerror(err));
    }
    size_t max = cap ? cap : SIZE_MAX - 2, bufcap = 1 << 16, n = 0;
    struct stat st;
    if (fstat(fileno(f), &st) == 0 && S_ISREG(st.st_mode)) {
        if ((uint64_t)st.st_size > max) {
            fclose(f);
            return FS_FAIL(EFBIG, CT_ERR_FORMAT, "%s: %lld bytes, more than the %zu a valid one can have", path,
                           (long long)st.st_size, cap);
        }
        if ((size_t)st.st_size + 2 > bufcap) bufcap = (size_t)st.st_size + 2; /* + 2: the NUL and the EOF read */
    }
    char *buf = ct_malloc(bufcap);
    int err = 0;
    for (;;) {
        if (n + 1 >= bufcap) {
            char *b = ct_malloc(bufcap * 2);
            memcpy(b, buf, n);
            free(buf);
            buf = b;
            bufcap *= 2;
        }
        size_t k = fread(buf + n, 1, bufcap - n - 1, f);
        n += k;
        if (n > max) {
            err = EFBIG; /* a pipe, or a file that grew */
            break;
        }
        if (k == 0) break;
    }
    if (!err && ferror(f)) err = errno ? errno : EIO; /* a directory opens, then fails to read */
    fclose(f);
    if (err) {
        free(buf);
        if (err == EFBIG && n > max)
            return FS_FAIL(err, CT_ERR_FORMAT, "%s: more than the %zu bytes a valid one can have", path, cap);
        return FS_FAIL(err, CT_ERR_IO, "%s: read error", path);
    }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
}

int fs_fsync(const char *path, int is_dir, ct_err *e) {
    int fd = open(path, O_RDONLY | O_CLOEXEC | (is_dir ? O_DIRECTORY : 0));
    if (fd < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot open to sync: %s", path, strerror(errno));
    int rc = 0;
    if (fsync(fd) != 0 && !(is_dir && errno == EINVAL))
        rc = ct_fail(e, CT_ERR_IO, "%s: cannot sync: %s", path, strerror(errno));
    if (close(fd) != 0 && !rc) rc = ct_fail(e, CT_ERR_IO, "%s: cannot close: %s", path, strerror(errno));
    return rc;
}

int fs_fsync_parent(const char *path, ct_err *e) {
    const char *sl = strrchr(path, '/');
    if (!sl) return fs_fsync(".", 1, e);
    if (sl == path) return fs_fsync("/", 1, e);
    char *d = ct_strdup(path);
    d[sl - path] = 0;
    int rc = fs_fsync(d, 1, e);
    free(d);
    return rc;
}

int fs_atomic_open(fs_atomic *a, const char *path, ct_err *e) {
    a->path = ct_strdup(path);
    size_t pl = strlen(path);
    a->tmp = ct_malloc(pl + 5);
    memcpy(a->tmp, path, pl);
    memcpy(a->tmp + pl, ".tmp", 5);
    a->fp = fopen(a->tmp, "wb");
    if (a->fp) return 0;
    int rc = ct_fail(e, CT_ERR_IO, "%s: cannot create %s: %s", path, a->tmp, strerror(errno));
    fs_atomic_abort(a);
    return rc;
}

static void fs_atomic_free(fs_atomic *a) {
    free(a->path);
    free(a->tmp);
    *a = (fs_atomic){0};
}

int fs_atomic_commit(fs_atomic *a, ct_err *e) {
    errno = 0;
    int ok = !ferror(a->fp) && fflush(a->fp) == 0 && fsync(fileno(a->fp)) == 0;
    int err = errno;
    if (fclose(a->fp) != 0 && ok) {
        ok = 0;
        err = errno;
    }
    a->fp = NULL;
    if (ok && rename(a->tmp, a->path) != 0) {
        ok = 0;
        err = errno;
    }
    int rc;
    if (!ok) {
        unlink(a->tmp);
        rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", a->path, strerror(err ? err : EIO));
    } else {
        rc = fs_fsync_parent(a->path, e);
    }
    fs_atomic_free(a);
    return rc;
}

void fs_atomic_abort(fs_atomic *a) {
    if (a->fp) fclose(a->fp);
    if (a->tmp) unlink(a->tmp);
    fs_atomic_free(a);
}

static int fs_write_with_tail(const char *path, const void *data, size_t len, const char *tail, ct_err *e) {
    fs_atomic a;
    int rc = fs_atomic_open(&a, path, e);
    if (rc) return rc;
    size_t tl = strlen(tail);
    if ((len && fwrite(data, 1, len, a.fp) != len) || (tl && fwrite(tail, 1, tl, a.fp) != tl)) {
        rc = ct_fail(e, CT_ERR_IO, "%s: write failed: %s", path, strerror(errno ? errno : EIO));
        fs_atomic_abort(&a);
        return rc;
    }
    return fs_atomic_commit(&a, e);
}

int fs_write_atomic(const char *path, const void *data, size_t len, ct_err *e) {
    return fs_write_with_tail(path, data, len, "", e);
}

int fs_write_text(const char *path, const char *text, ct_err *e) {
    return fs_write_with_tail(path, text, strlen(text), "\n", e);
}
int ct_mkdirs(const char *dir, ct_err *e) {
    char *p = ct_strdup(dir);
    int rc = 0;
    for (char *s = p + 1; !rc; s++) {
        if (*s != '/' && *s) continue;
        char c = *s;
        *s = 0;
        if (mkdir(p, 0755) != 0 && errno != EEXIST)
            rc = ct_fail(e, CT_ERR_IO, "%s: cannot create directory: %s", p, strerror(errno));
        *s = c;
        if (!c) break;
    }
    free(p);
    struct stat st;
    if (!rc && (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))) rc = ct_fail(e, CT_ERR_IO, "%s: not a directory", dir);
    return rc;
}

int ct_rm_tree(const char *path, ct_err *e) {
    struct stat st;
    if (lstat(path, &st) != 0)
        return errno == ENOENT ? 0 : ct_fail(e, CT_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    if (!S_ISDIR(st.st_mode)) {
        if (unlink(path) != 0 && errno != ENOENT)
            return ct_fail(e, CT_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
        return 0;
    }
    DIR *d = opendir(path);
    if (!d) return ct_fail(e, CT_ERR_IO, "%s: cannot list: %s", path, strerror(errno));
    int rc = 0;
    struct dirent *de;
    char sub[4096];
    while (!rc && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        rc = fs_join_buf(sub, sizeof sub, path, de->d_name, e);
        if (!rc) rc = ct_rm_tree(sub, e);
    }
    closedir(d);
    if (!rc && rmdir(path) != 0 && errno != ENOENT)
        rc = ct_fail(e, CT_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
    return rc;
}

int fs_lock(const char *path, const char *note, int *fd, char *holder, size_t cap, ct_err *e) {
    *fd = -1;
    if (cap) holder[0] = 0;
    int f = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (f < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    int rc;
    while ((rc = flock(f, LOCK_EX | LOCK_NB)) != 0 && errno == EINTR) {
    }
    if (rc != 0) {
        int err = errno;
        if (err == EWOULDBLOCK) {
            ssize_t n = cap > 1 ? pread(f, holder, cap - 1, 0) : 0;
            n = n < 0 ? 0 : n;
            while (n > 0 && (holder[n - 1] == '\n' || holder[n - 1] == 0)) n--;
            if (cap) holder[n] = 0;
            close(f);
            ct_fail(e, CT_ERR_IO, "%s: locked by another process", path);
            return FS_LOCK_HELD;
        }
        close(f);
        ct_fail(e, CT_ERR_IO, "%s: cannot lock: %s", path, strerror(err));
        return err == ENOLCK || err == EOPNOTSUPP || err == ENOSYS || err == EINVAL ? FS_LOCK_NONE : CT_ERR_IO;
    }
    /* what a second process shows in its message; a failure here costs that message only */
    size_t len = strlen(note);
    if (ftruncate(f, 0) == 0 && pwrite(f, note, len, 0) != (ssize_t)len) {
        /* nothing to do: the lock, not the text, keeps others out */
    }
    *fd = f;
    return 0;
}

int fs_same_file(const char *a, const char *b) {
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}
