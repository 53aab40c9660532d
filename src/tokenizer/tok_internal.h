/* tokenizer/tok_internal.h: the loaded tokenizer's tables, shared by the
 * loader (tok_load.c), the encoder (tok_encode.c) and the decoder
 * (tok_bytes.c). Not part of the public API. */
#ifndef CT_TOKENIZER_INTERNAL_H
#define CT_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdint.h>

#include "tokenizer/tokenizer.h"

/* Open-addressing map from a byte string (in t->pool) to an id. */
typedef struct {
    uint64_t hash; /* 0 marks an empty slot */
    uint32_t off, len;
    int32_t id;
} tok_str_slot;

/* Open-addressing map from a pair of ids to the merge that joins them. */
typedef struct {
    uint64_t key; /* (left << 32) | right; TOK_EMPTY_KEY when empty */
    int32_t rank, new_id;
} tok_merge_slot;
#define TOK_EMPTY_KEY UINT64_MAX

typedef struct {
    char *content; /* as written in the file */
    char *match;   /* what is searched for: content, or NFC(content) if normalized */
    size_t match_len;
    int32_t id;
    uint8_t special, lstrip, rstrip, single_word, normalized;
    uint8_t from_config; /* only in tokenizer_config.json */
} tok_added;

/* Byte trie over added tokens; children are a sibling list (few tokens). */
typedef struct {
    int32_t child, sibling, added; /* added: index into t->added, -1 if none */
    uint8_t byte;
} tok_trie_node;

typedef struct {
    tok_trie_node *nodes;
    int32_t n, cap;
    uint8_t first[256]; /* bytes that can start a match: a cheap skip test */
} tok_trie;

/* Normalizer steps, applied in order (normalizer Sequence or a lone one). */
enum { TOK_NORM_NFC, TOK_NORM_PREPEND, TOK_NORM_REPLACE };
/* Pre-tokenizers: the split regex (+ ByteLevel when byte_level), none (the
 * whole normalized piece is one word), Metaspace, Split on a literal string
 * with MergedWithPrevious / MergedWithNext. */
enum { TOK_PRE_REGEX, TOK_PRE_NONE, TOK_PRE_METASPACE, TOK_PRE_SPLIT_PREV, TOK_PRE_SPLIT_NEXT };
/* Decoder steps for the non-byte-level decoder chain. */
enum { TOK_DEC_REPLACE, TOK_DEC_BYTEFALLBACK, TOK_DEC_FUSE, TOK_DEC_STRIP, TOK_DEC_METASPACE };

typedef struct {
    int kind;
    char *pat, *rep; /* Prepend: rep; Replace: pat -> rep */
    size_t npat, nrep;
} tok_norm;

typedef struct {
    int kind;
    char *pat, *rep; /* Replace: pat -> rep; Strip: pat is the char */
    size_t npat, nrep;
    int start, stop; /* Strip; Metaspace: start = prepend_scheme is not never */
} tok_dec;

struct tok {
    /* model vocab (string -> id) and reverse */
    char *pool;
    size_t pool_len, pool_cap;
    tok_str_slot *vocab;
    uint32_t vocab_mask;
    int32_t n_ids;         /* one past the largest id (vocab and added) */
    int32_t *id_str;       /* id -> offset of its NUL-terminated string in pool, -1 */
    /* decoded bytes of each id: offsets into dec (n_ids + 1 entries) */
    char *dec;
    uint32_t *dec_off;
    uint8_t *is_special;   /* per id */
    int32_t *added_of;     /* per id: its index in added, -1 (tok_offsets) */
    /* BPE */
    tok_merge_slot *merges;
    uint32_t merge_mask;
    int32_t byte_id[256];  /* initial symbol of each byte, -1 if not in vocab */
    uint32_t byte_char[256]; /* tok_byte_char, tabulated */
    int32_t unk_id;        /* -1: bytes missing from vocab are dropped (HF) */
    int fuse_unk;
    int ignore_merges; /* a word found whole in the vocab skips BPE */
    /* added tokens */
    tok_added *added;
    int32_t n_added;
    tok_trie raw_trie, norm_trie;
    /* pipeline */
    int nfc;          /* the normalizer is exactly NFC (the fast path) */
    tok_norm *norm;   /* normalizer steps, in order */
    int n_norm;
    int byte_level;   /* ByteLevel pre-tokenizer and decoder (else the
                         SentencePiece-style pipeline: words are UTF-8 text) */
    int pre;          /* TOK_PRE_* */
    char *split_pat;  /* Split pattern / Metaspace replacement (UTF-8) */
    size_t split_len;
    int ms_prepend;   /* Metaspace prepend_scheme: 0 never, 1 first, 2 always */
    int ms_split;
    int byte_fallback;
    int32_t fb_id[256]; /* id of "<0xNN>", -1 if absent */
    /* TemplateProcessing single: ids before and after $A */
    int32_t *tpl_ids;
    int n_tpl_pre, n_tpl_post;
    tok_dec *dsteps;  /* decoder chain when !byte_level */
    int n_dsteps;
    /* The split regex as written (fast), and rewritten to agree with HF's
     * Oniguruma on every code point (tok_regex.c); re_exact is NULL when
     * the two cannot differ (a String pattern). */
    pcre2_code *re, *re_exact;
    int re_jit, re_exact_jit;
    int32_t bos_id, eos_id, pad_id;
};

/* A growable byte buffer, always NUL-terminated once written. */
typedef struct {
    char *p;
    size_t n, cap;
} tok_buf;

/* Shared helpers (tok_bytes.c). */
void tok_buf_put(tok_buf *b, const void *p, size_t n);
uint64_t tok_hash_bytes(const void *p, size_t n);
/* Encodes code point cp as UTF-8 into out (>= 4 bytes); returns length. */
int tok_utf8_put(uint32_t cp, char *out);
/* Decodes one valid-or-not UTF-8 sequence at s[0..n): returns its length
 * and sets *cp, or returns 0 for a maximal invalid subsequence whose length
 * is stored in *bad (Python's "replace" unit). */
size_t tok_utf8_next(const uint8_t *s, size_t n, uint32_t *cp, size_t *bad);
/* Replaces out's content with t's normalizer applied to s[0..n); tmp is
 * scratch. */
void tok_normalize(const tok *t, const char *s, size_t n, tok_buf *out, tok_buf *tmp);

int32_t tok_vocab_get(const tok *t, const char *s, size_t n);

/* tok_regex.c. Compiles t->re and t->re_exact; on error fills msg and the
 * offset in the pattern and returns nonzero. */
int tok_regex_compile(tok *t, const char *pattern, int literal, char *msg, size_t msg_size,
                      size_t *err_off);
/* 1 if s[0..n) holds a code point on which the two regexes may differ. */
int tok_regex_needs_exact(const char *s, size_t n);

#endif
