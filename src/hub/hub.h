/* hub/hub.h: Hugging Face Hub ids wherever ctitan takes a model directory.
 *
 * hub_resolve turns what the user wrote (model.hf_assets_path,
 * checkpoint.initial_load_path, generate --checkpoint, import --hf, a
 * --tokenizer, ...) into a local directory: an existing directory is used as
 * it is; a string shaped like a Hub repo id ("Qwen/Qwen3-0.6B") becomes the
 * snapshot directory of huggingface_hub's cache
 * ({HF_HUB_CACHE}/models--Qwen--Qwen3-0.6B/snapshots/<commit>/), after the
 * files asked for are downloaded into it when missing (libcurl). The cache is
 * laid out exactly as huggingface_hub lays it out, so `hf`, transformers'
 * from_pretrained(id, local_files_only=True) and ctitan share one copy.
 * Design notes, the environment variables read and the error kinds in hub.c
 * and docs/hub.md. */
#ifndef CT_HUB_HUB_H
#define CT_HUB_HUB_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

#define HUB_DEFAULT_REVISION "main"

/* What hub_resolve must have in the snapshot (bits). */
enum {
    HUB_CONFIG = 1,           /* config.json; generation_config.json too when the repo has it */
    HUB_TOKENIZER = 2,        /* tokenizer.json, tokenizer_config.json; special_tokens_map.json, chat_template.jinja if any */
    HUB_TOKENIZER_IF_ANY = 4, /* those when the repo has them, none required */
    HUB_WEIGHTS = 8,          /* model.safetensors, or model.safetensors.index.json and every shard it lists */
    HUB_ADAPTER = 16,         /* a PEFT adapter repo: adapter_config.json, adapter_model.safetensors */
    HUB_MODEL = HUB_CONFIG | HUB_TOKENIZER_IF_ANY | HUB_WEIGHTS,
    HUB_NO_LOCAL = 0x100,     /* a Hub id even where a local directory of that name exists (`ctitan download`) */
};

typedef struct {
    char dir[4096]; /* the local directory: the path as given, or the cache's snapshot directory */
    char commit[64]; /* the snapshot's commit; "" for a local directory */
    char repo[200];  /* the repo id; "" for a local directory */
} hub_local;

/* 1 when s has the shape of a Hub model id: "owner/name", each part 1-96 of
 * [A-Za-z0-9_.-] starting and ending with [A-Za-z0-9_], no "--" or "..", not
 * ending in ".git" (huggingface_hub's validate_repo_id; the bare "name" form
 * is not taken: a missing local directory "foo" stays a missing directory). */
int hub_is_repo_id(const char *s);

/* path -> out->dir (see the top). revision: a branch, tag or 40-hex commit
 * (NULL or "": "main"); what: HUB_* bits. Errors (ct_err, naming the repo
 * id, the file and what to do): CT_ERR_CONFIG for a path that is neither a
 * directory nor an id, a repo or revision the Hub does not have, or one it
 * refuses (401/403, gated: HF_TOKEN); CT_ERR_IO for a file the repo lacks,
 * the network lost after retries, a wrong checksum, a full disk, or offline
 * (HF_HUB_OFFLINE) with the file not cached. */
int hub_resolve(const char *path, const char *revision, unsigned what, hub_local *out, ct_err *e);
/* hub_resolve's checks that need no network: 0 for a local directory or a name
 * of an id's shape; a file (CT_ERR_CONFIG) or a missing path that is no id
 * (CT_ERR_IO; to HUB_NO_LOCAL, CT_ERR_CONFIG) is an error. For a command that
 * checks all its names before it downloads any. */
int hub_check_name(const char *path, unsigned what, ct_err *e);

/* ---- pure pieces, exposed for tests/c/hub/test_hub.c ---- */

/* 1 for exactly 40 lowercase hex digits (huggingface_hub's REGEX_COMMIT_HASH). */
int hub_is_commit(const char *s);
/* 1 when a revision can name refs/<revision> safely: non-empty, < 256 bytes,
 * no "." or ".." component, no leading or doubled "/", no backslash or control byte. */
int hub_revision_ok(const char *rev);
/* 1 when a file name of a repo is safe under snapshots/<commit>/ (same rules). */
int hub_filename_ok(const char *name);
/* "models--owner--name"; 0, or -1 if it does not fit. */
int hub_repo_folder(const char *repo, char *out, size_t cap);
/* huggingface_hub's constants: the cache directory (HF_HUB_CACHE, else
 * HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, HF_HOME defaulting to
 * $XDG_CACHE_HOME/huggingface or ~/.cache/huggingface; "~" and $VARS
 * expanded), HF_HOME itself, the endpoint (HF_ENDPOINT without trailing "/",
 * default https://huggingface.co), and offline mode (HF_HUB_OFFLINE, or when
 * that is unset or empty TRANSFORMERS_OFFLINE, is 1/ON/YES/TRUE in any case).
 * The string functions return 0, or -1 if the result does not fit. */
int hub_cache_dir(char *out, size_t cap);
int hub_home_dir(char *out, size_t cap);
int hub_endpoint(char *out, size_t cap);
int hub_offline(void);
/* os.path.expandvars(os.path.expanduser(in)). */
int hub_expand_path(const char *in, char *out, size_t cap);
/* The token huggingface_hub sends: HF_TOKEN, else HUGGING_FACE_HUB_TOKEN,
 * else the file HF_TOKEN_PATH (default HF_HOME/token), stripped; none when
 * HF_HUB_DISABLE_IMPLICIT_TOKEN is true. 1 with the token in out, 0 without
 * one; *from (may be NULL) names where it came from. */
int hub_token(char *out, size_t cap, const char **from);
/* {endpoint}/{repo}/resolve/{quote(revision, safe="")}/{quote(file)} */
int hub_file_url(char *out, size_t cap, const char *endpoint, const char *repo, const char *revision,
                 const char *file);
/* An ETag header as a file name: W/ and the quotes taken off. */
int hub_normalize_etag(const char *etag, char *out, size_t cap);
/* The target of snapshots/<commit>/<file> -> ../../blobs/<etag> ("../" once
 * more per directory level of file). */
int hub_blob_link(const char *file, const char *etag, char *out, size_t cap);
/* The distinct file names of an index's weight_map, in first-seen order
 * (*names: malloc'd array of malloc'd strings); each checked with
 * hub_filename_ok. CT_ERR_FORMAT naming `what` on a bad index. */
int hub_index_shards(const char *json, size_t len, const char *what, char ***names, int *n, ct_err *e);

typedef struct {
    uint32_t h[8];
    uint64_t n;
    uint8_t buf[64];
} hub_sha256_ctx;
typedef struct {
    uint32_t h[5];
    uint64_t n;
    uint8_t buf[64];
} hub_sha1_ctx;
void hub_sha256_init(hub_sha256_ctx *c);
void hub_sha256_update(hub_sha256_ctx *c, const void *data, size_t len);
void hub_sha256_final(hub_sha256_ctx *c, uint8_t out[32]);
void hub_sha1_init(hub_sha1_ctx *c);
void hub_sha1_update(hub_sha1_ctx *c, const void *data, size_t len);
void hub_sha1_final(hub_sha1_ctx *c, uint8_t out[20]);
/* n bytes as 2n lowercase hex digits and a NUL. */
void hub_hex(const uint8_t *b, size_t n, char *out);

#endif
