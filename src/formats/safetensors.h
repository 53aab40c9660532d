/* formats/safetensors.h: Hugging Face safetensors, read and write.
 *
 * Reading maps the file (mmap, read-only) and validates every field of the
 * header before exposing a single tensor: the file is untrusted input. A
 * tensor's `data` points into the mapping, in the file's dtype; callers
 * convert with core/dtype.h. A "set" is a model directory: one
 * model.safetensors, or shards listed by model.safetensors.index.json.
 *
 * Writing goes to PATH.tmp, fsyncs, then renames, so a crash never leaves a
 * half-written file under the final name. */
#ifndef CT_FORMATS_SAFETENSORS_H
#define CT_FORMATS_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"
#include "core/err.h"

#define ST_MAX_DIMS 8

typedef struct {
    const char *name;
    ct_dtype dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    int64_t numel;
    const void *data; /* into the mapping; nbytes = numel * dtype size */
    size_t nbytes;
} st_tensor;

typedef struct st_file st_file;

st_file *st_open(const char *path, ct_err *e);
void st_close(st_file *f);
int st_count(const st_file *f);
const st_tensor *st_get(const st_file *f, int i);
const st_tensor *st_find(const st_file *f, const char *name);
/* Value of __metadata__[key], or NULL. */
const char *st_metadata(const st_file *f, const char *key);
const char *st_path(const st_file *f);
/* Byte offset in the file of t's data (t from f): for a reader that takes
 * part of a tensor with pread instead of through the mapping. */
uint64_t st_data_offset(const st_file *f, const st_tensor *t);
/* Done with a tensor's data for now: its pages leave this process's
 * resident set (they stay in the page cache and read back on the next
 * touch), so streaming through a large file does not grow RSS by its size. */
void st_drop(const st_tensor *t);

typedef struct st_set st_set;

/* Opens DIR/model.safetensors.index.json (and every shard it names) if present,
 * else DIR/model.safetensors. A tensor listed in two shards, a weight_map entry
 * missing from its shard, or a shard tensor missing from the weight_map is an
 * error naming it. */
st_set *st_set_open(const char *dir, ct_err *e);
void st_set_close(st_set *s);
int st_set_count(const st_set *s);
const st_tensor *st_set_get(const st_set *s, int i);
/* NULL if absent. If file_out is given it receives the shard's path. */
const st_tensor *st_set_find(const st_set *s, const char *name, const char **file_out);

/* A tensor to write. `data` holds numel elements of `src_dtype`; they are stored
 * as `dtype` (converted on the fly when src_dtype is F32 and dtype is BF16/F16). */
typedef struct {
    const char *name;
    ct_dtype dtype;
    ct_dtype src_dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const void *data;
} st_wtensor;

/* Writes one file. meta: NULL-terminated list of key, value, key, value, ...
 * (may be NULL). Header entries (and so st_get's order on reading) follow the
 * order given; the data buffer holds 8-byte types first, then 4, 2, 1 (stable),
 * as the HF writer does, so every tensor is aligned to its element size. */
int st_write(const char *path, const st_wtensor *ts, int n, const char *const *meta, ct_err *e);

/* Writes DIR/model.safetensors when the total is at most max_shard_bytes,
 * else DIR/model-0000i-of-0000N.safetensors shards plus
 * model.safetensors.index.json ({"metadata": {"total_size": N}, "weight_map": ...}).
 * max_shard_bytes 0 means never shard. */
int st_write_dir(const char *dir, const st_wtensor *ts, int n, size_t max_shard_bytes,
                 const char *const *meta, ct_err *e);

/* The same file as st_write, its data supplied piece by piece, so no caller
 * needs the whole file in memory: open writes PATH.tmp's header from ts
 * (names, dtypes, shapes; `data` is not read); each write appends numel
 * elements (of each tensor's src_dtype, converted like st_write's) in the
 * file's data order (falling element size, stable: the given order when all
 * tensors have one size), across tensor boundaries as needed; close checks
 * that every byte came, fsyncs and renames to PATH. Any error (more data
 * than declared, less at close, I/O) names the path. close and abort always
 * free the stream and leave no PATH.tmp; after a failed write, abort. */
/* The file st_write writes for ts, laid out without its data: *head
 * (malloc'd, *head_len bytes: the length prefix and the header, padded),
 * offs[n] each tensor's data offset in the file, *total the file's size.
 * For writers that place the data themselves (several processes' pwrite:
 * checkpoint/ckpt.h, ckpt_part_*); the bytes are st_write's. */
int st_layout(const char *path, const st_wtensor *ts, int n, const char *const *meta, char **head, size_t *head_len,
              uint64_t *offs, uint64_t *total, ct_err *e);

typedef struct st_stream st_stream;
int st_stream_open(st_stream **out, const char *path, const st_wtensor *ts, int n, const char *const *meta,
                   ct_err *e);
int st_stream_write(st_stream *s, const void *src, size_t numel, ct_err *e);
int st_stream_close(st_stream *s, ct_err *e);
void st_stream_abort(st_stream *s);

/* st_write_dir streamed, for tensors of one element size and one source
 * dtype (a model in one dtype): the same files (shards planned alike, the
 * index, stale files removed at close), the data supplied in the given
 * order across tensor and shard boundaries. meta must stay valid until
 * close. close and abort free the stream; abort leaves the shards already
 * complete in DIR (write into a temp dir to publish atomically). */
typedef struct st_dir_stream st_dir_stream;
int st_dir_stream_open(st_dir_stream **out, const char *dir, const st_wtensor *ts, int n, size_t max_shard_bytes,
                       const char *const *meta, ct_err *e);
int st_dir_stream_write(st_dir_stream *d, const void *src, size_t numel, ct_err *e);
int st_dir_stream_close(st_dir_stream *d, ct_err *e);
void st_dir_stream_abort(st_dir_stream *d);

#endif
