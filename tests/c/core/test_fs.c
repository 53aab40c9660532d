/* tests/c/core/test_fs.c: core/fs.h, the path join, capped read, fsync and
 * atomic replace that the rest of the tree calls instead of its own copies. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"

static int exists(const char *p) {
    struct stat st;
    return stat(p, &st) == 0;
}

int main(void) {
    char root[] = "/tmp/ct_test_fs_XXXXXX";
    if (!mkdtemp(root)) {
        perror("mkdtemp");
        return 1;
    }
    ct_err e = {0};

    /* joins */
    char *j = fs_join("a/b", "c.json");
    CHECK(!strcmp(j, "a/b/c.json"), "fs_join: %s", j);
    free(j);
    char buf[16];
    CHECK(fs_join_buf(buf, sizeof buf, "dir", "name", &e) == 0 && !strcmp(buf, "dir/name"), "fs_join_buf: %s", buf);
    e = (ct_err){0};
    CHECK(fs_join_buf(buf, sizeof buf, "a-long-directory", "name", &e) == CT_ERR_IO &&
              strstr(e.msg, "a-long-directory/name: path too long"),
          "too long: %s", e.msg);

    /* atomic writes leave the content and no PATH.tmp */
    char *p = fs_join(root, "f.txt"), *tmp = fs_join(root, "f.txt.tmp");
    e = (ct_err){0};
    CHECK(fs_write_atomic(p, "hello", 5, &e) == 0, "fs_write_atomic: %s", e.msg);
    CHECK(!exists(tmp), "%s left behind", tmp);
    size_t len = 0;
    char *got = fs_read_file(p, 0, &len, &e);
    CHECK(got && len == 5 && !strcmp(got, "hello"), "read back: %s", got ? got : e.msg);
    free(got);
    CHECK(fs_write_text(p, "{}", &e) == 0, "fs_write_text: %s", e.msg);
    got = fs_read_file(p, 0, &len, &e);
    CHECK(got && len == 3 && !strcmp(got, "{}\n"), "text ends in a newline: %s", got ? got : e.msg);
    free(got);

    /* the cap: at the size is fine, one byte less is a format error naming the file */
    got = fs_read_file(p, 3, &len, &e);
    CHECK(got && len == 3, "cap = size: %s", got ? got : e.msg);
    free(got);
    e = (ct_err){0};
    got = fs_read_file(p, 2, &len, &e);
    CHECK(!got && e.code == CT_ERR_FORMAT && strstr(e.msg, p) && errno == EFBIG, "cap < size: %s", e.msg);

    /* missing file and directory: I/O errors naming the path, errno kept */
    char *missing = fs_join(root, "missing.json");
    e = (ct_err){0};
    got = fs_read_file(missing, 0, &len, &e);
    CHECK(!got && e.code == CT_ERR_IO && strstr(e.msg, missing) && errno == ENOENT, "missing: %s", e.msg);
    e = (ct_err){0};
    got = fs_read_file(root, 0, &len, &e);
    CHECK(!got && e.code == CT_ERR_IO && strstr(e.msg, root), "directory: %s", e.msg);

    /* abort removes PATH.tmp and leaves PATH as it was */
    fs_atomic a;
    CHECK(fs_atomic_open(&a, p, &e) == 0 && exists(tmp), "open: %s", e.msg);
    fputs("half", a.fp);
    fs_atomic_abort(&a);
    CHECK(!exists(tmp), "abort left %s", tmp);
    got = fs_read_file(p, 0, &len, &e);
    CHECK(got && !strcmp(got, "{}\n"), "abort changed the file: %s", got ? got : e.msg);
    free(got);
    fs_atomic zero = {0};
    fs_atomic_abort(&zero); /* a zeroed one may be aborted */

    /* a file in a missing directory: the error names it */
    char *nodir = fs_join(missing, "x.json");
    e = (ct_err){0};
    CHECK(fs_write_atomic(nodir, "x", 1, &e) == CT_ERR_IO && strstr(e.msg, nodir), "no dir: %s", e.msg);

    /* fsync of a file, a directory, and the directory holding a file */
    CHECK(fs_fsync(p, 0, &e) == 0, "fsync file: %s", e.msg);
    CHECK(fs_fsync(root, 1, &e) == 0, "fsync dir: %s", e.msg);
    CHECK(fs_fsync_parent(p, &e) == 0, "fsync parent: %s", e.msg);
    e = (ct_err){0};
    CHECK(fs_fsync(missing, 0, &e) == CT_ERR_IO && strstr(e.msg, missing), "fsync missing: %s", e.msg);

    free(p);
    free(tmp);
    free(missing);
    free(nodir);
    ct_rm_tree(root, NULL);
    return CHECK_DONE();
}
