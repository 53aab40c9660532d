/* tests/fuzz/fuzz_util.h: what every fuzz target needs to hand its input to
 * a reader that takes a path: one scratch directory per process in /dev/shm
 * (memory, so a million writes cost no disk), removed at exit, and a
 * splitter for targets whose input is several files. */
#ifndef CT_FUZZ_UTIL_H
#define CT_FUZZ_UTIL_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/err.h"
#include "core/fs.h"

/* The process's scratch directory (created on first use; libFuzzer's
 * -fork/-jobs children are processes of their own, so they never share it). */
static char fz_root[256];

static void fz_cleanup(void) {
    if (fz_root[0]) ct_rm_tree(fz_root, NULL);
}

static inline const char *fz_dir(void) {
    if (!fz_root[0]) {
        const char *base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
        snprintf(fz_root, sizeof fz_root, "%s/ctitan-fuzz-%d", base, (int)getpid());
        ct_err e = {0};
        if (ct_mkdirs(fz_root, &e)) {
            fprintf(stderr, "fuzz: %s\n", e.msg);
            abort();
        }
        atexit(fz_cleanup);
    }
    return fz_root;
}

/* Writes data as DIR/NAME (DIR created), returns the malloc'd path. A
 * harness failure aborts: it is not the parser's fault. */
static inline char *fz_write(const char *dir, const char *name, const void *data, size_t len) {
    ct_err e = {0};
    if (ct_mkdirs(dir, &e)) {
        fprintf(stderr, "fuzz: %s\n", e.msg);
        abort();
    }
    char *path = fs_join(dir, name);
    FILE *f = fopen(path, "wb");
    if (!f || (len && fwrite(data, 1, len, f) != len) || fclose(f)) {
        fprintf(stderr, "fuzz: cannot write %s\n", path);
        abort();
    }
    return path;
}

/* Splits data at the first FZ_SEP: part 0 before it, part 1 after (empty
 * when there is none). Lets one input carry two files. */
#define FZ_SEP "\n#=#=\n"
static inline void fz_split(const uint8_t *data, size_t size, const uint8_t **a, size_t *na, const uint8_t **b,
                     size_t *nb) {
    const uint8_t *s = memmem(data, size, FZ_SEP, sizeof FZ_SEP - 1);
    *a = data;
    if (!s) {
        *na = size;
        *b = data + size;
        *nb = 0;
        return;
    }
    *na = (size_t)(s - data);
    *b = s + sizeof FZ_SEP - 1;
    *nb = size - *na - (sizeof FZ_SEP - 1);
}

#endif
