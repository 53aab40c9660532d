/* tokenizer/tok_encode.c: text -> ids, in HF's order of stages.
 *
 * 1. Invalid UTF-8 becomes U+FFFD per maximal invalid subsequence (what
 *    bytes.decode("utf-8", "replace") hands HF).
 * 2. Added tokens with normalized=false are cut out of the raw text:
 *    leftmost-longest, non-overlapping, like HF's Aho-Corasick pass, with
 *    HF's single_word / lstrip / rstrip rules applied to each match.
 * 3. Each remaining piece is normalized (NFC; Prepend / Replace), then added
 *    tokens with normalized=true are cut out of it the same way.
 * 4. Byte-level files: the split regex (PCRE2, JIT when available) cuts
 *    pieces into words; text between matches is a word too (behaviour
 *    Isolated). Pieces with code points where PCRE2 and HF's Oniguruma
 *    disagree use the rewritten pattern (tok_regex.c). SentencePiece-style
 *    files: each piece is one word (no pre-tokenizer), or Metaspace /
 *    Split(String) cuts it.
 * 5. Each word's bytes start as one symbol per byte (ByteLevel maps each
 *    byte to one vocab char), or for SentencePiece-style files one symbol
 *    per char with byte fallback and unk (bpe_chars), and are merged lowest
 *    rank first, leftmost first among equal ranks: a linked list of symbols
 *    plus a binary heap of candidate pairs keyed (rank, position); stale
 *    heap entries are skipped when popped, as in HF's word.merge_all.
 * 6. The template's special tokens go around the text's ids (add_special).
 * Words up to CACHE_MAX_WORD bytes are cached per encoder; the cache is
 *    dropped whole when full, which is cheap and keeps memory bounded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tokenizer/tok_internal.h"

#define CACHE_SLOTS (1u << 16)
#define CACHE_MAX_WORD 1024
#define CACHE_MAX_KEYS (4u << 20)

typedef struct {
    uint64_t hash; /* 0: empty */
    uint32_t koff, klen, voff, vlen;
} cache_slot;

struct tok_enc {
    const tok *t;
    int encode_special, add_special;
    const char *text_base, *norm_base; /* start of the input / of the normalized piece */
    int piece_first;                   /* the piece starts at offset 0 of the input */
    tok_buf ntmp, ms;
    pcre2_match_data *md;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jstack;
    tok_buf clean, norm, bl;
    const char *split_base; /* set by tok_pretokenize: word() records ends */
    cache_slot *cache;
    uint32_t cache_used;
    tok_buf ckeys;
    tok_ids cvals;
    /* BPE scratch */
    int32_t *sym, *prev, *next;
    uint64_t *heap; /* 2 * scap: never more than 2 live pairs per symbol */
    size_t scap;
};

tok_enc *tok_enc_new(const tok *t) {
    tok_enc *enc = ct_calloc(1, sizeof *enc);
    enc->t = t;
    enc->add_special = 1;
    enc->md = pcre2_match_data_create(1, NULL);
    enc->mctx = pcre2_match_context_create(NULL);
    if (!enc->md || !enc->mctx) {
        fprintf(stderr, "ctitan: error: out of memory creating PCRE2 match data\n");
        exit(1);
    }
    if (t->re_jit || t->re_exact_jit) {
        /* The default 32 KiB JIT stack can run out on long whitespace runs. */
        enc->jstack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, NULL);
        if (enc->jstack) pcre2_jit_stack_assign(enc->mctx, NULL, enc->jstack);
    }
    enc->cache = ct_calloc(CACHE_SLOTS, sizeof *enc->cache);
    return enc;
}

void tok_enc_free(tok_enc *enc) {
    if (!enc) return;
    pcre2_match_data_free(enc->md);
    pcre2_match_context_free(enc->mctx);
    if (enc->jstack) pcre2_jit_stack_free(enc->jstack);
    free(enc->clean.p);
    free(enc->norm.p);
    free(enc->bl.p);
    free(enc->ntmp.p);
    free(enc->ms.p);
    free(enc->cache);
    free(enc->ckeys.p);
    tok_ids_free(&enc->cvals);
    free(enc->sym);
    free(enc->prev);
    free(enc->next);
    free(enc->heap);
    free(enc);
}

void tok_enc_set_encode_special(tok_enc *enc, int on) { enc->encode_special = on != 0; }
void tok_enc_set_add_special(tok_enc *enc, int on) { enc->add_special = on != 0; }
int tok_enc_add_special(const tok_enc *enc) { return enc->add_special; }

/* ------------------------------------------------------------------ BPE */

static int32_t merge_get(const tok *t, int32_t a, int32_t b, int32_t *new_id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = (uint32_t)((key * 0x9E3779B97F4A7C15ull) >> 32) & t->merge_mask;
    for (;;) {
        const tok_merge_slot *s = &t->merges[i];
        if (s->key == key) {
            *new_id = s->new_id;
            return s->rank;
        }
        if (s->key == TOK_EMPTY_KEY) return -1;
        i = (i + 1) & t->merge_mask;
    }
}

/* Min-heap of (rank << 32 | pos): lowest rank, then leftmost, pops first. */
static void heap_push(uint64_t *h, size_t *n, uint64_t v) {
    size_t i = (*n)++;
    while (i) {
        size_t p = (i - 1) / 2;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static uint64_t heap_pop(uint64_t *h, size_t *n) {
    uint64_t top = h[0], v = h[--*n];
    size_t i = 0, m = *n;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1] < h[c]) c++;
        if (h[c] >= v) break;
        h[i] = h[c];
        i = c;
    }
    if (m) h[i] = v;
    return top;
}

static void scratch(tok_enc *enc, size_t n) {
    if (n <= enc->scap) return;
    size_t cap = enc->scap ? enc->scap : 256;
    while (cap < n) cap *= 2;
    free(enc->sym);
    free(enc->prev);
    free(enc->next);
    free(enc->heap);
    enc->sym = ct_malloc(cap * sizeof *enc->sym);
    enc->prev = ct_malloc(cap * sizeof *enc->prev);
    enc->next = ct_malloc(cap * sizeof *enc->next);
    enc->heap = ct_malloc(2 * cap * sizeof *enc->heap);
    enc->scap = cap;
}

static void try_push(const tok *t, tok_enc *enc, size_t *nh, int32_t p) {
    int32_t q = enc->next[p], nid;
    if (q < 0) return;
    int32_t r = merge_get(t, enc->sym[p], enc->sym[q], &nid);
    if (r >= 0) heap_push(enc->heap, nh, ((uint64_t)(uint32_t)r << 32) | (uint32_t)p);
}

static void bpe_merge(tok_enc *enc, int32_t m, tok_ids *out);

/* BPE of one word, appended to out. */
static void bpe(tok_enc *enc, const uint8_t *w, size_t n, tok_ids *out) {
    const tok *t = enc->t;
    scratch(enc, n);
    int32_t *sym = enc->sym;
    int32_t m = 0;
    int last_unk = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = t->byte_id[w[i]];
        if (id < 0) { /* byte missing from vocab: unk, or dropped as HF does */
            if (t->unk_id < 0 || (t->fuse_unk && last_unk)) continue;
            id = t->unk_id;
            last_unk = 1;
        } else {
            last_unk = 0;
        }
        sym[m++] = id;
    }
    bpe_merge(enc, m, out);
}

static size_t char_len(const char *s, size_t n) {
    uint8_t b = (uint8_t)s[0];
    size_t k = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
    return k < n ? k : n;
}

/* SentencePiece-style BPE of one word of UTF-8 text (HF's merge_word): one
 * symbol per char found in the vocab; else its bytes as "<0xNN>" tokens
 * (byte_fallback, when all of them exist); else unk, consecutive ones fused
 * when fuse_unk. A pending unk is only written before the next char found
 * in the vocab or at the end, so it can follow byte-fallback tokens, as in
 * HF. */
static void bpe_chars(tok_enc *enc, const uint8_t *w, size_t n, tok_ids *out) {
    const tok *t = enc->t;
    scratch(enc, n);
    int32_t *sym = enc->sym, m = 0;
    int unk = 0;
    for (size_t i = 0; i < n;) {
        size_t k = char_len((const char *)w + i, n - i);
        int32_t id = tok_vocab_get(t, (const char *)w + i, k);
        if (id >= 0) {
            if (unk) sym[m++] = t->unk_id, unk = 0;
            sym[m++] = id;
        } else {
            int ok = t->byte_fallback;
            for (size_t j = 0; ok && j < k; j++) ok = t->fb_id[w[i + j]] >= 0;
            if (ok)
                for (size_t j = 0; j < k; j++) sym[m++] = t->fb_id[w[i + j]];
            else if (t->unk_id >= 0) {
                if (unk && !t->fuse_unk) sym[m++] = t->unk_id;
                unk = 1;
            }
        }
        i += k;
    }
    if (unk) sym[m++] = t->unk_id;
    bpe_merge(enc, m, out);
}

/* Merges the m symbols in enc->sym and appends the result to out. */
static void bpe_merge(tok_enc *enc, int32_t m, tok_ids *out) {
    const tok *t = enc->t;
    int32_t *sym = enc->sym, *prev = enc->prev, *next = enc->next;
    for (int32_t i = 0; i < m; i++) {
        prev[i] = i - 1;
        next[i] = i + 1 < m ? i + 1 : -1;
    }
    size_t nh = 0;
    for (int32_t i = 0; i + 1 < m; i++) try_push(t, enc, &nh, i);
    while (nh) {
        uint64_t top = heap_pop(enc->heap, &nh);
        int32_t p = (int32_t)(uint32_t)top, q, nid = -1;
        if (sym[p] < 0 || (q = next[p]) < 0) continue;
        if (merge_get(t, sym[p], sym[q], &nid) != (int32_t)(top >> 32)) continue; /* stale */
        sym[p] = nid;
        sym[q] = -1;
        next[p] = next[q];
        if (next[q] >= 0) prev[next[q]] = p;
        if (prev[p] >= 0) try_push(t, enc, &nh, prev[p]);
        try_push(t, enc, &nh, p);
    }
    for (int32_t i = m ? 0 : -1; i >= 0; i = next[i]) tok_ids_push(out, sym[i]);
}

static void word(tok_enc *enc, const char *s, size_t n, tok_ids *out) {
    const tok *t = enc->t;
    const uint8_t *w = (const uint8_t *)s;
    if (enc->split_base) {
        tok_ids_push(out, (int32_t)(s + n - enc->split_base));
        return;
    }
    if (!t->byte_level) {
        int32_t id;
        if (t->ignore_merges && (id = tok_vocab_get(t, s, n)) >= 0) {
            tok_ids_push(out, id);
            return;
        }
    } else if (n == 1 && t->byte_id[w[0]] >= 0) { /* most punctuation, every digit */
        tok_ids_push(out, t->byte_id[w[0]]);
        return;
    }
    if (t->ignore_merges && t->byte_level) { /* a word already in the vocab is one token */
        enc->bl.n = 0;
        for (size_t i = 0; i < n; i++) {
            char u[4];
            tok_buf_put(&enc->bl, u, (size_t)tok_utf8_put(t->byte_char[w[i]], u));
        }
        int32_t id = tok_vocab_get(t, enc->bl.p, enc->bl.n);
        if (id >= 0) {
            tok_ids_push(out, id);
            return;
        }
    }
    void (*run)(tok_enc *, const uint8_t *, size_t, tok_ids *) = t->byte_level ? bpe : bpe_chars;
    if (n > CACHE_MAX_WORD) {
        run(enc, w, n, out);
        return;
    }
    uint64_t h = tok_hash_bytes(s, n);
    uint32_t i = (uint32_t)h & (CACHE_SLOTS - 1);
    for (;;) {
        cache_slot *c = &enc->cache[i];
        if (!c->hash) break;
        if (c->hash == h && c->klen == n && !memcmp(enc->ckeys.p + c->koff, s, n)) {
            for (uint32_t k = 0; k < c->vlen; k++) tok_ids_push(out, enc->cvals.v[c->voff + k]);
            return;
        }
        i = (i + 1) & (CACHE_SLOTS - 1);
    }
    size_t before = out->n;
    run(enc, w, n, out);
    if (enc->cache_used >= CACHE_SLOTS / 2 || enc->ckeys.n + n > CACHE_MAX_KEYS) {
        memset(enc->cache, 0, CACHE_SLOTS * sizeof *enc->cache);
        enc->cache_used = 0;
        enc->ckeys.n = 0;
        enc->cvals.n = 0;
        i = (uint32_t)h & (CACHE_SLOTS - 1);
    }
    cache_slot *c = &enc->cache[i];
    c->hash = h;
    c->koff = (uint32_t)enc->ckeys.n;
    c->klen = (uint32_t)n;
    c->voff = (uint32_t)enc->cvals.n;
    c->vlen = (uint32_t)(out->n - before);
    tok_buf_put(&enc->ckeys, s, n);
    for (size_t k = before; k < out->n; k++) tok_ids_push(&enc->cvals, out->v[k]);
    enc->cache_used++;
}

/* ------------------------------------------------------------ pre-tokenizer */

/* Splits a normalized piece with the regex (Isolated) and BPEs each part.
 * Empty matches split too, except one right after the previous match, as in
 * the onig crate's find_iter. */
static int pretokenize(tok_enc *enc, const char *s, size_t n, tok_ids *out, ct_err *e) {
    const tok *t = enc->t;
    int exact = t->re_exact && tok_regex_needs_exact(s, n);
    const pcre2_code *re = exact ? t->re_exact : t->re;
    int jit = exact ? t->re_exact_jit : t->re_jit;
    size_t pos = 0, done = 0, last_end = (size_t)-1;
    while (pos <= n) {
        int rc = jit ? pcre2_jit_match(re, (PCRE2_SPTR)s, n, pos, 0, enc->md, enc->mctx)
                     : pcre2_match(re, (PCRE2_SPTR)s, n, pos, PCRE2_NO_UTF_CHECK, enc->md, enc->mctx);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return ct_fail(e, CT_ERR_IO, "tokenizer: pre-tokenizer regex failed at byte %zu: %s", pos,
                           (const char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(enc->md);
        size_t ms = ov[0], me = ov[1];
        if (ms == me) {
            if (ms != last_end) {
                if (ms > done) word(enc, s + done, ms - done, out);
                done = ms;
            }
            if (ms >= n) break;
            pos = ms + char_len(s + ms, n - ms);
            continue;
        }
        if (ms > done) word(enc, s + done, ms - done, out);
        word(enc, s + ms, me - ms, out);
        done = pos = last_end = me;
    }
    if (done < n) word(enc, s + done, n - done, out);
    return 0;
}

/* ------------------------------------------------------------ added tokens */

static int is_ws(uint32_t c) { /* Unicode White_Space */
    return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
           c == 0x205F || c == 0x3000;
}

/* A word character for single_word, as HF decides it (Rust regex \w:
 * Alphabetic, marks, decimal digits, connector punctuation, joiners;
 * checked against tokenizers 0.23). Alphabetic is approximated by the
 * letter and letter-number categories plus the circled/squared Latin
 * letters that carry Other_Alphabetic. */
static int is_word_char(uint32_t c) {
    if (c < 0x80) return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
    if (c == 0x200C || c == 0x200D || (c >= 0x24B6 && c <= 0x24E9) || (c >= 0x1F130 && c <= 0x1F149) ||
        (c >= 0x1F150 && c <= 0x1F169) || (c >= 0x1F170 && c <= 0x1F189))
        return 1;
    switch (utf8proc_category((utf8proc_int32_t)c)) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_MN:
    case UTF8PROC_CATEGORY_MC: case UTF8PROC_CATEGORY_ME: case UTF8PROC_CATEGORY_ND:
    case UTF8PROC_CATEGORY_NL: case UTF8PROC_CATEGORY_PC:
        return 1;
    default:
        return 0;
    }
}

static uint32_t last_char(const char *s, size_t n) {
    size_t i = n;
    while (i > 0 && ((uint8_t)s[i - 1] & 0xC0) == 0x80) i--;
    if (i == 0) return 0;
    uint32_t cp;
    size_t bad;
    return tok_utf8_next((const uint8_t *)s + i - 1, n - i + 1, &cp, &bad) ? cp : 0;
}

static uint32_t first_char(const char *s, size_t n) {
    uint32_t cp;
    size_t bad;
    return n && tok_utf8_next((const uint8_t *)s, n, &cp, &bad) ? cp : 0;
}

typedef int (*piece_fn)(tok_enc *enc, const char *s, size_t n, tok_ids *out, ct_err *e);

/* Cuts the added tokens of `tr` out of s, passing the text between them to
 * `rest`. Mirrors HF's AddedVocabulary::find_matches. */
static int split_added(tok_enc *enc, const tok_trie *tr, const char *s, size_t n, tok_ids *out,
                       piece_fn rest, ct_err *e) {
    const tok *t = enc->t;
    if (!tr->n) return rest(enc, s, n, out, e);
    const uint8_t *u = (const uint8_t *)s;
    size_t pos = 0, done = 0;
    while (pos < n) {
        if (!tr->first[u[pos]]) { pos++; continue; }
        int32_t node = 0, best = -1;
        size_t best_end = 0;
        for (size_t k = pos; k < n; k++) {
            int32_t c = tr->nodes[node].child;
            while (c >= 0 && tr->nodes[c].byte != u[k]) c = tr->nodes[c].sibling;
            if (c < 0) break;
            node = c;
            if (tr->nodes[c].added >= 0) best = tr->nodes[c].added, best_end = k + 1;
        }
        if (best < 0) { pos++; continue; }
        const tok_added *a = &t->added[best];
        size_t start = pos, stop = best_end;
        pos = best_end; /* matches never overlap, kept or not */
        if (enc->encode_special && a->special) continue;
        if (a->single_word) {
            int ok_l = start == 0 || !is_word_char(last_char(s, start));
            int ok_r = stop == n || !is_word_char(first_char(s + stop, n - stop));
            if (!ok_l || !ok_r) continue;
        }
        if (a->lstrip) {
            size_t ns = start;
            while (ns > 0) {
                size_t b = ns - 1;
                while (b > 0 && (u[b] & 0xC0) == 0x80) b--;
                uint32_t cp;
                size_t bad;
                if (!tok_utf8_next(u + b, ns - b, &cp, &bad) || !is_ws(cp)) break;
                ns = b;
            }
            start = ns > done ? ns : done;
        }
        if (a->rstrip) {
            while (stop < n) {
                uint32_t cp;
                size_t bad, k = tok_utf8_next(u + stop, n - stop, &cp, &bad);
                if (!k || !is_ws(cp)) break;
                stop += k;
            }
        }
        if (done < start) {
            int rc = rest(enc, s + done, start - done, out, e);
            if (rc) return rc;
        }
        tok_ids_push(out, a->id);
        done = stop;
    }
    return done < n ? rest(enc, s + done, n - done, out, e) : 0;
}

/* HF's Metaspace pre-tokenizer on one piece, into out: ' ' becomes the
 * replacement, which is prepended (always, or on the piece at the start of
 * the input for "first") unless the piece starts with it. */
static void metaspace(const tok *t, const char *s, size_t n, int first, tok_buf *out) {
    out->n = 0;
    const char *r = t->split_pat;
    size_t rn = t->split_len;
    /* does the text, spaces replaced, start with r? */
    int starts = (n && s[0] == ' ') || (n >= rn && !memcmp(s, r, rn));
    if ((t->ms_prepend == 2 || (t->ms_prepend == 1 && first)) && !starts) tok_buf_put(out, r, rn);
    size_t done = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] == ' ') {
            tok_buf_put(out, s + done, i - done);
            tok_buf_put(out, r, rn);
            done = i + 1;
        }
    tok_buf_put(out, s + done, n - done);
}

/* Words of s split at each occurrence of pat: it ends a word (after = 1,
 * MergedWithPrevious) or starts one (MergedWithNext). */
static void split_literal(tok_enc *enc, const char *s, size_t n, const char *pat, size_t pn, int after,
                          tok_ids *out) {
    size_t start = 0, i = 0;
    while (i + pn <= n) {
        if (memcmp(s + i, pat, pn)) { i++; continue; }
        size_t cut = after ? i + pn : i;
        if (cut > start) word(enc, s + start, cut - start, out);
        start = cut;
        i += pn;
    }
    if (n > start) word(enc, s + start, n - start, out);
}

/* The pre-tokenizer on one normalized piece, then BPE. */
static int pre_piece(tok_enc *enc, const char *s, size_t n, tok_ids *out, ct_err *e) {
    const tok *t = enc->t;
    switch (t->pre) {
    case TOK_PRE_REGEX: return pretokenize(enc, s, n, out, e);
    case TOK_PRE_NONE: word(enc, s, n, out); return 0;
    case TOK_PRE_SPLIT_PREV:
    case TOK_PRE_SPLIT_NEXT:
        split_literal(enc, s, n, t->split_pat, t->split_len, t->pre == TOK_PRE_SPLIT_PREV, out);
        return 0;
    default: {
        metaspace(t, s, n, enc->piece_first && s == enc->norm_base, &enc->ms);
        if (t->ms_split) split_literal(enc, enc->ms.p, enc->ms.n, t->split_pat, t->split_len, 0, out);
        else word(enc, enc->ms.p, enc->ms.n, out);
        return 0;
    }
    }
}

static int after_norm(tok_enc *enc, const char *s, size_t n, tok_ids *out, ct_err *e) {
    enc->norm_base = s;
    return split_added(enc, &enc->t->norm_trie, s, n, out, pre_piece, e);
}

static int normalize_piece(tok_enc *enc, const char *s, size_t n, tok_ids *out, ct_err *e) {
    enc->piece_first = s == enc->text_base;
    if (!enc->t->nfc && !enc->t->n_norm) return after_norm(enc, s, n, out, e);
    tok_normalize(enc->t, s, n, &enc->norm, &enc->ntmp);
    return after_norm(enc, enc->norm.p, enc->norm.n, out, e);
}

/* ------------------------------------------------------------ entry points */

/* Returns 1 if s is valid UTF-8 (fast path for ASCII runs). */
static int valid_utf8(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        if (i + 8 <= n) {
            uint64_t v;
            memcpy(&v, s + i, 8);
            if (!(v & 0x8080808080808080ull)) { i += 8; continue; }
        }
        if (s[i] < 0x80) { i++; continue; }
        uint32_t cp;
        size_t bad, k = tok_utf8_next(s + i, n - i, &cp, &bad);
        if (!k) return 0;
        i += k;
    }
    return 1;
}

/* Returns text, or a copy in enc->clean with U+FFFD for invalid UTF-8. */
static const char *repair_utf8(tok_enc *enc, const char *text, size_t *len) {
    const uint8_t *u = (const uint8_t *)text;
    size_t n = *len;
    if (valid_utf8(u, n)) return text;
    enc->clean.n = 0;
    size_t i = 0;
    while (i < n) {
        uint32_t cp;
        size_t bad, k = tok_utf8_next(u + i, n - i, &cp, &bad);
        if (k) tok_buf_put(&enc->clean, u + i, k), i += k;
        else tok_buf_put(&enc->clean, "\xEF\xBF\xBD", 3), i += bad;
    }
    *len = enc->clean.n;
    return enc->clean.p;
}

int tok_encode(tok_enc *enc, const char *text, size_t len, tok_ids *out, ct_err *e) {
    const tok *t = enc->t;
    int rc = 0;
    if (enc->add_special)
        for (int i = 0; i < t->n_tpl_pre; i++) tok_ids_push(out, t->tpl_ids[i]);
    if (len) {
        text = repair_utf8(enc, text, &len);
        enc->text_base = text;
        rc = split_added(enc, &t->raw_trie, text, len, out, normalize_piece, e);
    }
    if (enc->add_special && !rc)
        for (int i = 0; i < t->n_tpl_post; i++) tok_ids_push(out, t->tpl_ids[t->n_tpl_pre + i]);
    return rc;
}

int tok_pretokenize(tok_enc *enc, const char *text, size_t len, tok_ids *ends, const char **norm,
                    size_t *norm_len, ct_err *e) {
    if (len >= (size_t)INT32_MAX) return ct_fail(e, CT_ERR_IO, "tok_pretokenize: text over 2 GiB");
    const char *s = repair_utf8(enc, text, &len);
    const tok *t = enc->t;
    tok_buf *nb = &enc->norm;
    nb->n = 0;
    if (t->nfc || t->n_norm) tok_normalize(t, s, len, nb, &enc->ntmp);
    else tok_buf_put(nb, s, len);
    if (t->pre == TOK_PRE_METASPACE) { /* report the words of the replaced text */
        metaspace(t, nb->p, nb->n, 1, &enc->ms);
        tok_buf x = *nb;
        *nb = enc->ms;
        enc->ms = x;
    }
    enc->split_base = nb->p;
    enc->piece_first = 1;
    enc->norm_base = nb->p;
    int rc = 0;
    if (t->pre == TOK_PRE_METASPACE) {
        if (t->ms_split) split_literal(enc, nb->p, nb->n, t->split_pat, t->split_len, 0, ends);
        else word(enc, nb->p, nb->n, ends);
    } else {
        rc = pre_piece(enc, nb->p, nb->n, ends, e);
    }
    enc->split_base = NULL;
    *norm = nb->p;
    *norm_len = nb->n;
    return rc;
}

int tok_encode_once(const tok *t, const char *text, size_t len, int32_t **ids, size_t *n,
                    ct_err *e) {
    tok_enc *enc = tok_enc_new(t);
    tok_ids out = {0};
    int rc = tok_encode(enc, text, len, &out, e);
    tok_enc_free(enc);
    if (rc) {
        tok_ids_free(&out);
        *ids = NULL;
        *n = 0;
        return rc;
    }
    *ids = out.v ? out.v : ct_malloc(sizeof(int32_t));
    *n = out.n;
    return 0;
}
