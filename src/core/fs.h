/* core/fs.h: the two file-system chores every module needs, written once.
 *
 * Reading a whole small file (config.json, tokenizer.json, a text corpus),
 * creating a directory with its parents and removing a tree (checkpoints,
 * shard folders, HF exports). Errors name the path. */
#ifndef CT_CORE_FS_H
#define CT_CORE_FS_H

#include <stddef.h>

#include "core/err.h"

/* The whole of PATH, NUL-terminated (the NUL not counted in *len), read as a
 * stream so pipes work too. NULL on failure (a directory is a read error),
 * with CT_ERR_IO in e naming the path. The caller frees. */
char *ct_read_file(const char *path, size_t *len, ct_err *e);

/* mkdir -p: creates DIR and its missing parents; an error names the component
 * that failed, or DIR when it exists but is not a directory. */
int ct_mkdirs(const char *dir, ct_err *e);

/* rm -rf PATH (a file or a directory tree, links not followed); a missing
 * path is fine. e may be NULL for best-effort cleanup. */
int ct_rm_tree(const char *path, ct_err *e);

#endif
