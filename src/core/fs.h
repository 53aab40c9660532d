/* core/fs.h: the file-system chores every module needs, written once.
 *
 * Joining a path, reading a whole small file (config.json, tokenizer.json,
 * an index or a manifest, a text corpus), making a write durable (fsync of
 * the file and of its directory), replacing a file atomically (PATH.tmp,
 * fsync, rename), creating a directory with its parents and removing a tree
 * (checkpoints, shard folders, HF exports). Errors name the path. */
#ifndef CT_CORE_FS_H
#define CT_CORE_FS_H

#include <stdio.h>
#include <stddef.h>

#include "core/err.h"

/* Why: joins were spelt five ways; one malloc'd form that cannot truncate.
 * DIR/NAME, malloc'd; the caller frees. */
char *fs_join(const char *dir, const char *name);

/* Why: fixed buffers truncated silently; this one says so, naming the path.
 * DIR/NAME into out[cap]; CT_ERR_IO "DIR/NAME: path too long" when it does not fit. */
int fs_join_buf(char *out, size_t cap, const char *dir, const char *name, ct_err *e);

/* Why: one reader with one set of messages instead of five loops.
 * The whole of PATH, NUL-terminated (the NUL not counted in *len), read as a
 * stream so pipes work too. cap > 0 refuses a file of more than cap bytes
 * (CT_ERR_FORMAT: an index or manifest that large is not one); 0 means no
 * cap. NULL on failure (a directory is a read error), with e naming the path
 * and errno saying why. The caller frees. */
char *fs_read_file(const char *path, size_t cap, size_t *len, ct_err *e);

/* Why: a rename is durable only once the file and its directory are synced.
 * fsync of PATH (is_dir: a directory; filesystems that cannot sync one say
 * EINVAL, which is not an error: nothing more can be done). */
int fs_fsync(const char *path, int is_dir, ct_err *e);

/* fsync of the directory that holds PATH, after PATH was renamed into it. */
int fs_fsync_parent(const char *path, ct_err *e);

/* Why: a crash or a reader must never see half a file under its final name.
 * A file written as PATH.tmp and renamed to PATH: open creates PATH.tmp and
 * gives the stream in a->fp; commit flushes, fsyncs, closes, renames and
 * syncs the directory (any failure, a stream error included, is "PATH: write
 * failed" and leaves no PATH.tmp); abort closes and removes PATH.tmp. Both
 * free what open allocated; a zeroed fs_atomic may be aborted. */
typedef struct {
    char *path, *tmp;
    FILE *fp;
} fs_atomic;
int fs_atomic_open(fs_atomic *a, const char *path, ct_err *e);
int fs_atomic_commit(fs_atomic *a, ct_err *e);
void fs_atomic_abort(fs_atomic *a);

/* The len bytes of data as PATH, through fs_atomic. */
int fs_write_atomic(const char *path, const void *data, size_t len, ct_err *e);
/* TEXT and a newline as PATH, through fs_atomic (JSON files end in one, as
 * Python's writers leave them). */
int fs_write_text(const char *path, const char *text, ct_err *e);

/* 1 when A and B both exist and are one file (device and inode, so a link,
 * a hard link or another spelling of the path is seen through), else 0. */
int fs_same_file(const char *a, const char *b);

/* Why: two runs writing one folder overwrite each other's files, and a pid
 * file goes stale when its process is killed; an flock(2) lock is dropped by
 * the kernel when its holder ends, however it ends.
 * An exclusive flock of PATH (created 0644 if missing), never waiting.
 * Returns 0 with *fd the descriptor that holds it (O_CLOEXEC; closing it, or
 * the process's end, releases it), after writing NOTE into the file for
 * whoever finds it held; FS_LOCK_HELD when another open file of it holds it
 * (holder[cap] gets what the holder wrote, "" if nothing yet); FS_LOCK_NONE
 * when the file system cannot lock (some NFS mounts: ENOLCK, EOPNOTSUPP,
 * ENOSYS, EINVAL), e saying so and nothing held; CT_ERR_IO when PATH cannot
 * be opened, e naming it. */
enum { FS_LOCK_HELD = -1, FS_LOCK_NONE = -2 };
int fs_lock(const char *path, const char *note, int *fd, char *holder, size_t cap, ct_err *e);

/* mkdir -p: creates DIR and its missing parents; an error names the component
 * that failed, or DIR when it exists but is not a directory. */
int ct_mkdirs(const char *dir, ct_err *e);

/* rm -rf PATH (a file or a directory tree, links not followed); a missing
 * path is fine. e may be NULL for best-effort cleanup. */
int ct_rm_tree(const char *path, ct_err *e);

#endif
