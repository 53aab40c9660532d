/* data/dataset.h: training data sources, packing, shuffling, rank sharding.
 *
 * Sources (docs/data.md has the details and examples):
 *   text    plain text files; each file is one document, or one document
 *           per paragraph (blank-line separated) or per line (ds_text_split)
 *   jsonl   one JSON object per line with a "text" string (c4's layout), or
 *           TRL's {"prompt": str, "completion": str} (loss on the completion:
 *           a file whose first record has "prompt"; ds_source.c)
 *   chat    JSONL with "messages": [{role, content}, ...] rendered as ChatML
 *           or with the tokenizer's own chat template (data/chat.h,
 *           ds_tok_opts.chat_template), loss only on the assistant replies;
 *           ShareGPT's "conversations": [{from, value}, ...] read as TRL
 *           converts it; TRL's conversational {"prompt": [...], "completion":
 *           [...]}, loss on the completion as TRL computes it (chat_encode_pc)
 *   tokens  pre-tokenized: a raw little-endian uint32 `.bin`, an integer
 *           `.npy`, or a directory: one written by `ctitan prepare` (shards in
 *           meta.json's order, its counts and ids checked), or any other
 *           directory of *.bin / *.npy read in sorted name order. A directory
 *           of prepare's shard-NNNNN files without meta.json is an
 *           interrupted prepare and an error.
 * DS_KIND_AUTO picks per path: a directory, .bin, .npy -> tokens; .txt ->
 * text; .jsonl / .json / anything whose first line is a JSON object -> chat
 * if that object has "messages", "conversations" or a "prompt" list, else
 * jsonl; anything else -> text.
 *
 * Stream: every document is tokenized and followed by EOS (the tokenizer's
 * eos_token, else <|endoftext|>; torchtitan/HF convention; a BOS only where the
 * tokenizer's post-processor adds one, as HF's tokenizer(text)); sources follow each other in the order given. Alongside the tokens
 * runs a mask, 1 = the token may be a training target (all ones except for
 * chat data, where the EOS after a conversation is 0 too, and prompt-completion
 * data, where the prompt's tokens are 0, and in the conversational layout the
 * EOS too; ds_tok_opts.assistant_only_loss / completion_only_loss 0 make every
 * token of a conversation / prompt-completion record 1, its EOS as before).
 *
 * Packing (torchtitan): the stream is cut into disjoint windows of
 * seq_len + 1 tokens, the tail that does not fill one is dropped;
 * inputs = window[:-1], labels = window[1:], and labels[t] = -100 where the
 * mask of the TARGET token window[t+1] is 0.
 *
 * Order: window k of epoch e is order_e[k]: the identity, or with shuffling a
 * Fisher-Yates permutation drawn from core/rng seeded with seed + e. Ranks
 * consume the order in rounds: in a round rank r of world takes
 * order_e[pos + r] and pos advances by world, so within an epoch rank r gets
 * exactly the windows k = r (mod world) of the order: the ranks' windows are
 * disjoint and together cover all but the n_windows % world left over,
 * which are dropped so every rank takes the same number of steps. When no full
 * round is left, the epoch ends and the next begins (one line on stderr).
 *
 * State: (epoch, pos), pos counting the windows of the order consumed by all
 * ranks together. It is plain integers, the same on every rank, and enough
 * to resume exactly; it is meaningful for any world size, so a run can
 * resume on a different number of ranks.
 *
 * Memory: text sources are tokenized at open (all cores) into memory;
 * `.bin` shards are mapped, not read, so big corpora prepared with
 * `ctitan prepare` cost no load time beyond one validation pass. */
#ifndef CT_DATA_DATASET_H
#define CT_DATA_DATASET_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "data/chat.h"
#include "tokenizer/tokenizer.h"

typedef enum { DS_KIND_AUTO = 0, DS_KIND_TEXT, DS_KIND_JSONL, DS_KIND_CHAT, DS_KIND_TOKENS } ds_kind;

/* How a text file becomes documents. */
typedef enum {
    DS_SPLIT_FILE = 0,  /* the whole file, as is */
    DS_SPLIT_PARAGRAPH, /* maximal runs of non-blank lines; the final line's "\n" (or "\r\n") dropped */
    DS_SPLIT_LINE,      /* every non-blank line without its "\n" (or "\r\n") */
} ds_text_split;

/* "auto", "text", "jsonl", "chat", "tokens" <-> ds_kind; parse returns -1
 * for an unknown name. */
const char *ds_kind_name(ds_kind k);
int ds_kind_parse(const char *name, ds_kind *out);
int ds_split_parse(const char *name, ds_text_split *out);

/* The kind DS_KIND_AUTO resolves PATH to (reads at most its first line). */
int ds_detect_kind(const char *path, ds_kind *out, ct_err *e);

/* How documents are read and tokenized. */
typedef struct {
    ds_kind kind;              /* DS_KIND_AUTO: detected per path */
    ds_text_split text_split;  /* text sources */
    const char *text_field;    /* jsonl: the field holding the text; NULL: "text" */
    int32_t eos_id;            /* < 0: tok_eos_id, else <|endoftext|> */
    int encode_special;        /* 1: special tokens written in the data are plain
                                  text (HF encode_special_tokens / sanitize) */
    int threads;               /* <= 0: every core (omp_get_max_threads) */
    size_t chunk_bytes;        /* documents tokenized together; 0: default */
    const char *chat_template; /* chat sources: "auto" (NULL), "chatml", "tokenizer" or a
                                  path (data/chat.h chat_tmpl_open) */
    const char *tokenizer_dir; /* where "auto" / "tokenizer" find the template; NULL: ChatML */
    int *template_seen;        /* NULL, or the caller's note, kept across its data sets: set
                                  once chat data used the template or a warning said no
                                  source is chat data, so that a run says it at most once */
    int assistant_only_loss;   /* TRL's: 1 (default) conversations train on the assistant
                                  replies only; 0 on every token of the rendering */
    int completion_only_loss;  /* TRL's: 1 (default) prompt-completion data trains on the
                                  completion only; 0 on every token (docs/data.md) */
} ds_tok_opts;

void ds_tok_opts_default(ds_tok_opts *o);

/* Counters of a tokenization run (also handed to the progress callback). */
typedef struct {
    uint64_t docs;        /* documents emitted */
    uint64_t skipped;     /* empty documents / blank lines skipped */
    uint64_t tokens;      /* tokens emitted, EOS included */
    uint64_t trainable;   /* of those, mask 1 */
    uint64_t bytes_done;  /* input bytes consumed */
    uint64_t bytes_total; /* size of every input */
    int masked;           /* a chat source is present: the sink gets masks */
    int conversations;    /* a chat source in the messages or ShareGPT layout was read */
    int completions;      /* a prompt-completion source: 1 strings only, 2 a conversational one */
    int threads;          /* threads used */
} ds_progress;

/* Receives the token stream in order, a chunk at a time; mask is NULL unless
 * progress.masked. A non-zero return stops the run with that code. */
typedef int (*ds_sink_fn)(void *ctx, const uint32_t *ids, const uint8_t *mask, size_t n, ct_err *e);
/* Called after every chunk; `final` on the last call. */
typedef void (*ds_progress_fn)(void *ctx, const ds_progress *p, int final);

/* Tokenizes the text/jsonl/chat sources in order, with every core, and
 * streams the result to sink. The output does not depend on the number of
 * threads or on chunk_bytes. Errors name the file and line (JSONL) or
 * file (text). A tokens source here is an error. `stats` (may be NULL)
 * gets the final counters. */
int ds_tokenize(const char *const *paths, int n_paths, const tok *t, const ds_tok_opts *o, ds_sink_fn sink,
                void *sink_ctx, ds_progress_fn progress, void *progress_ctx, ds_progress *stats, ct_err *e);

/* ------------------------------------------------------------------ loader */

typedef struct {
    int seq_len;
    int vocab_size;   /* > 0: every token must be below it (the error names the file) */
    int shuffle;      /* permute the windows of every epoch */
    uint64_t seed;    /* epoch e uses seed + e */
    int rank, world;  /* this process's share; world <= 0 means 1 */
    int quiet;        /* no summary / new-epoch lines on stderr */
    ds_tok_opts tok;  /* for text/jsonl/chat sources */
    const char *tokenizer_dir; /* loaded at open when a text source needs it and
                                  ds_open got no tokenizer; NULL: none */
    const char *seq_key; /* the option seq_len came from, for messages (NULL: "training.seq_len") */
} ds_config;

void ds_config_default(ds_config *c);

typedef struct {
    int64_t epoch; /* epochs completed */
    int64_t pos;   /* windows of this epoch's order consumed by all ranks together */
} ds_state;

typedef struct ds ds;

/* Opens and concatenates the sources in order. A tokenizer is needed only
 * for text/jsonl/chat sources: `t`, else c->tokenizer_dir is loaded (NULL
 * and no directory is fine for tokens). Errors: a missing or unreadable
 * file, bad JSON (file:line), a token outside vocab_size, fewer than `world`
 * windows ("too short for one window" naming the source), a prepared
 * directory without meta.json or whose meta.json disagrees with its shards
 * or with vocab_size. */
int ds_open(ds **out, const char *const *paths, int n_paths, const tok *t, const ds_config *c, ct_err *e);
/* Same with the sources in one string separated by commas (a config value
 * such as "a.jsonl,b.txt"); empty items are skipped. */
int ds_open_list(ds **out, const char *path_list, const tok *t, const ds_config *c, ct_err *e);
void ds_close(ds *d);

/* Rank r of world takes windows r, r + world, ... of every epoch's order. The
 * state is kept (it is global), so this may be called at any time. */
int ds_set_shard(ds *d, int rank, int world, ct_err *e);

/* Fills inputs and labels [B, seq_len] with this rank's next B windows. */
void ds_next(ds *d, int32_t *inputs, int32_t *labels, int B);

void ds_get_state(const ds *d, ds_state *s);
/* Restores a state from ds_get_state (the same sources and seq_len); the
 * next ds_next continues exactly where that one left off. */
int ds_set_state(ds *d, const ds_state *s, ct_err *e);

uint64_t ds_num_tokens(const ds *d);
uint64_t ds_num_windows(const ds *d);          /* in the whole stream */
uint64_t ds_windows_per_rank(const ds *d);     /* per epoch: num_windows / world */
int ds_has_mask(const ds *d);                   /* some target may be -100 */
/* Short description for logs: the first source and how many more. */
const char *ds_name(const ds *d);
/* A 64-bit digest of what the windows hold: the stream's first num_windows *
 * (seq_len + 1) tokens, each with its mask bit (1 where no mask, and at a window's first
 * token, which is never a target), in order; the
 * tail no window takes is left out. It depends on neither how the stream is cut
 * into files or shards nor the thread count; one token or target's mask bit
 * changed always changes it. The ranks compare it (each reads its own machine's copy);
 * it reads every token once, as the vocabulary check does. */
uint64_t ds_digest(const ds *d);

/* ------------------------------------------------------------------ shards */

/* Writes a `ctitan prepare` directory: shard-00000.bin (uint32 LE tokens),
 * shard-00000.mask (uint8, 1 = trainable target; only when masked), ... of at
 * most shard_tokens tokens each, and at the end meta.json (written last,
 * atomically: a directory without it is incomplete). */
typedef struct ds_writer ds_writer;

/* dir is created if missing. It must not already hold meta.json or shard-*
 * files unless overwrite is set, in which case those are removed first. */
int ds_writer_open(ds_writer **out, const char *dir, uint64_t shard_tokens, int overwrite, ct_err *e);
/* A ds_sink_fn: ctx is the ds_writer. */
int ds_writer_sink(void *ctx, const uint32_t *ids, const uint8_t *mask, size_t n, ct_err *e);
/* Flushes the last shard and writes meta.json with the given provenance
 * (any string may be NULL). */
int ds_writer_finish(ds_writer *w, const char *kind, const char *tokenizer_dir, int32_t eos_id, int32_t vocab_size,
                     const char *const *inputs, int n_inputs, const ds_progress *stats, ct_err *e);
/* The chat template the chat sources were rendered with, recorded in
 * meta.json as "chat_template": {"mode", ["path",] "template", "sha256"}
 * ("template": the file it was read from, or "built-in ChatML" with sha256
 * null). Call before ds_writer_finish; without it meta.json has no such key
 * (no chat source). */
void ds_writer_chat_template(ds_writer *w, const chat_tmpl_id *id);
/* The loss options the masks were built with, recorded in meta.json where they
 * shaped them: "assistant_only_loss" (conversations, or conversational
 * prompt-completion data without completion_only_loss) and "completion_only_loss"
 * (prompt-completion data), as stats (ds_tokenize's) says was read. The loader
 * refuses a training config that asks otherwise. Call before ds_writer_finish. */
void ds_writer_loss(ds_writer *w, const ds_tok_opts *o, const ds_progress *stats);
/* Frees. After an error (no finish) the whole shards written so far stay,
 * without meta.json (the loader refuses such a directory as an interrupted
 * prepare); the unfinished shard's NAME.tmp is removed. */
void ds_writer_free(ds_writer *w);
/* Shards written so far. */
int ds_writer_num_shards(const ds_writer *w);

#endif
