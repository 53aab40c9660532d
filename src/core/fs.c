/* core/fs.c: whole-file reads and mkdir -p. */
#include "core/fs.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

char *ct_read_file(const char *path, size_t *len, ct_err *e) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = ct_malloc(cap);
    for (;;) {
        if (n + 1 >= cap) {
            char *b = ct_malloc(cap * 2);
            memcpy(b, buf, n);
            free(buf);
            buf = b;
            cap *= 2;
        }
        size_t k = fread(buf + n, 1, cap - n - 1, f);
        n += k;
        if (k == 0) break;
    }
    int bad = ferror(f); /* a directory opens, then fails to read */
    fclose(f);
    if (bad) {
        free(buf);
        ct_fail(e, CT_ERR_IO, "%s: read error", path);
        return NULL;
    }
    buf[n] = 0;
    if (len) *len = n;
    return buf;
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
        int n = snprintf(sub, sizeof sub, "%s/%s", path, de->d_name);
        rc = n < 0 || (size_t)n >= sizeof sub ? ct_fail(e, CT_ERR_IO, "%s/%s: path too long", path, de->d_name)
                                              : ct_rm_tree(sub, e);
    }
    closedir(d);
    if (!rc && rmdir(path) != 0 && errno != ENOENT)
        rc = ct_fail(e, CT_ERR_IO, "%s: cannot remove: %s", path, strerror(errno));
    return rc;
}
