/* tokenizer/tok_load.c: reading tokenizer.json (or vocab.json + merges.txt)
 * and tokenizer_config.json into the tables of tok_internal.h.
 *
 * Every field is untrusted: a missing or ill-typed field, an id out of
 * range, a merge naming a token the vocab lacks, or a pipeline stage this
 * implementation does not reproduce exactly is an error naming the file and
 * the field. Refusing an unsupported stage is deliberate: silently skipping
 * it would give ids that differ from HF without any sign.
 *
 * Supported pipelines (docs/tokenizer.md has the full table): byte-level
 * BPE (normalizer null | NFC; Sequence[Split(Regex|String, Isolated),
 * ByteLevel(use_regex=false)] or ByteLevel(use_regex=true); decoder
 * ByteLevel), and SentencePiece-style BPE (normalizer Prepend / Replace(String)
 * / NFC in sequence; pre-tokenizer null | Metaspace | Split(String); model
 * byte_fallback, fuse_unk, unk; decoder Sequence of Replace, ByteFallback,
 * Fuse, Strip). Post-processor null | ByteLevel | TemplateProcessing | a
 * Sequence of those; no dropout, subword affixes, truncation or padding. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tokenizer/tok_internal.h"
#include "core/fs.h"
#include "formats/json.h"

#define TOK_MAX_ID (1 << 24) /* far above any real vocab; bounds allocations */

/* The Qwen2 pre-tokenizer pattern, used when only vocab.json + merges.txt
 * exist (it is what Qwen2Tokenizer hard-codes). */
static const char QWEN2_PATTERN[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
/* ByteLevel(use_regex=true) splits with the GPT-2 pattern. */
static const char GPT2_PATTERN[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---------------------------------------------------------------- files */

static int file_exists(const char *path) {
    FILE *f = fopen(path, "rb");
    if (f) fclose(f);
    return f != NULL;
}

static cJSON *parse_json(const char *path, ct_err *e) {
    cJSON *j = json_parse_file(path, 0, e);
    if (j && !cJSON_IsObject(j)) {
        ct_fail(e, CT_ERR_FORMAT, "%s: top level is not a JSON object", path);
        cJSON_Delete(j);
        j = NULL;
    }
    return j;
}

/* ------------------------------------------------------------ JSON helpers */

static const cJSON *jget(const cJSON *o, const char *k) {
    return o ? cJSON_GetObjectItemCaseSensitive(o, k) : NULL;
}
static int jnull(const cJSON *v) { return !v || cJSON_IsNull(v); }

/* A boolean field, `def` when absent or null. */
static int jbool(const cJSON *o, const char *k, int def, int *out, const char *file,
                 const char *ctx, ct_err *e) {
    const cJSON *v = jget(o, k);
    if (jnull(v)) { *out = def; return 0; }
    if (!cJSON_IsBool(v))
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.%s: expected true or false", file, ctx, k);
    *out = cJSON_IsTrue(v);
    return 0;
}

/* An id: a number written as an integer, as serde's u32 takes it (HF
 * tokenizers refuses 5.0 and 5e0, "invalid type: floating point"). */
static int jid(const cJSON *v, int32_t *out, const char *file, const char *ctx, ct_err *e) {
    if (!json_int_in(v, 0, TOK_MAX_ID - 1))
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s: expected an integer id in [0, %d)", file, ctx,
                       TOK_MAX_ID);
    if (!json_is_integer(v))
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s: expected an integer id, got %.1f (written as a float)", file, ctx,
                       v->valuedouble);
    *out = (int32_t)v->valuedouble;
    return 0;
}

static const char *jtype(const cJSON *o) {
    const cJSON *v = jget(o, "type");
    return cJSON_IsString(v) ? v->valuestring : "";
}

/* ------------------------------------------------------------ vocab table */

static uint32_t pool_add(tok *t, const char *s, size_t n) {
    if (t->pool_len + n + 1 > t->pool_cap) {
        size_t cap = t->pool_cap ? t->pool_cap : 1 << 20;
        while (cap < t->pool_len + n + 1) cap *= 2;
        char *p = ct_malloc(cap);
        if (t->pool_len) memcpy(p, t->pool, t->pool_len);
        free(t->pool);
        t->pool = p;
        t->pool_cap = cap;
    }
    uint32_t off = (uint32_t)t->pool_len;
    memcpy(t->pool + off, s, n);
    t->pool[off + n] = 0;
    t->pool_len += n + 1;
    return off;
}

static tok_str_slot *vocab_slot(const tok *t, const char *s, size_t n, uint64_t h) {
    uint32_t i = (uint32_t)h & t->vocab_mask;
    for (;;) {
        tok_str_slot *sl = &t->vocab[i];
        if (!sl->hash || (sl->hash == h && sl->len == n && !memcmp(t->pool + sl->off, s, n)))
            return sl;
        i = (i + 1) & t->vocab_mask;
    }
}

int32_t tok_vocab_get(const tok *t, const char *s, size_t n) {
    if (!t->vocab) return -1;
    tok_str_slot *sl = vocab_slot(t, s, n, tok_hash_bytes(s, n));
    return sl->hash ? sl->id : -1;
}

/* Later duplicates win, as when HF collects the vocab into a map. */
static void vocab_put(tok *t, const char *s, size_t n, int32_t id) {
    uint64_t h = tok_hash_bytes(s, n);
    tok_str_slot *sl = vocab_slot(t, s, n, h);
    if (!sl->hash) {
        sl->hash = h;
        sl->off = pool_add(t, s, n);
        sl->len = (uint32_t)n;
    }
    sl->id = id;
}

static void vocab_init(tok *t, size_t n) {
    size_t cap = 1024;
    while (cap < 2 * n + 16) cap *= 2;
    t->vocab = ct_calloc(cap, sizeof *t->vocab);
    t->vocab_mask = (uint32_t)(cap - 1);
}

/* ------------------------------------------------------------ merges table */

static void merges_init(tok *t, size_t n) {
    size_t cap = 1024;
    while (cap < 2 * n + 16) cap *= 2;
    t->merges = ct_malloc(cap * sizeof *t->merges);
    for (size_t i = 0; i < cap; i++) t->merges[i].key = TOK_EMPTY_KEY;
    t->merge_mask = (uint32_t)(cap - 1);
}

static uint32_t merge_hash(uint64_t key) {
    key *= 0x9E3779B97F4A7C15ull;
    return (uint32_t)(key >> 32);
}

/* A later duplicate of a pair replaces the earlier one, as in HF's map. */
static void merge_put(tok *t, int32_t a, int32_t b, int32_t rank, int32_t new_id) {
    uint64_t key = ((uint64_t)(uint32_t)a << 32) | (uint32_t)b;
    uint32_t i = merge_hash(key) & t->merge_mask;
    while (t->merges[i].key != TOK_EMPTY_KEY && t->merges[i].key != key)
        i = (i + 1) & t->merge_mask;
    t->merges[i] = (tok_merge_slot){key, rank, new_id};
}

static int add_merge(tok *t, const char *a, size_t na, const char *b, size_t nb, int32_t rank,
                     const char *file, const char *field, ct_err *e) {
    int32_t ia = tok_vocab_get(t, a, na), ib = tok_vocab_get(t, b, nb);
    if (ia < 0 || ib < 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s[%d]: token '%.*s' is not in the vocab", file,
                       field, rank, ia < 0 ? (int)na : (int)nb, ia < 0 ? a : b);
    char stack[256];
    char *ab = na + nb <= sizeof stack ? stack : ct_malloc(na + nb);
    memcpy(ab, a, na);
    memcpy(ab + na, b, nb);
    int32_t inew = tok_vocab_get(t, ab, na + nb);
    if (ab != stack) free(ab);
    if (inew < 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s[%d]: merged token '%.*s%.*s' is not in the vocab",
                       file, field, rank, (int)na, a, (int)nb, b);
    merge_put(t, ia, ib, rank, inew);
    return 0;
}

/* ------------------------------------------------------------ added tokens */

static void added_push(tok *t, const tok_added *a) {
    tok_added *v = ct_malloc((size_t)(t->n_added + 1) * sizeof *v);
    if (t->n_added) memcpy(v, t->added, (size_t)t->n_added * sizeof *v);
    free(t->added);
    t->added = v;
    t->added[t->n_added++] = *a;
}

/* Parses one added-token object (tokenizer.json added_tokens[i] or a
 * tokenizer_config.json added_tokens_decoder value) into *a. */
static int parse_added(const cJSON *o, int32_t id, tok_added *a, const char *file,
                       const char *ctx, ct_err *e) {
    if (!cJSON_IsObject(o)) return ct_fail(e, CT_ERR_FORMAT, "%s: %s: expected an object", file, ctx);
    const cJSON *c = jget(o, "content");
    if (!cJSON_IsString(c) || !c->valuestring[0])
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.content: expected a non-empty string", file, ctx);
    int sp = 0, ls = 0, rs = 0, sw = 0, no = 0;
    if (jbool(o, "special", 0, &sp, file, ctx, e) || jbool(o, "lstrip", 0, &ls, file, ctx, e) ||
        jbool(o, "rstrip", 0, &rs, file, ctx, e) || jbool(o, "single_word", 0, &sw, file, ctx, e) ||
        jbool(o, "normalized", !sp, &no, file, ctx, e))
        return e->code;
    *a = (tok_added){.content = ct_strdup(c->valuestring), .id = id, .special = (uint8_t)sp,
                     .lstrip = (uint8_t)ls, .rstrip = (uint8_t)rs, .single_word = (uint8_t)sw,
                     .normalized = (uint8_t)no};
    return 0;
}

static int find_added(const tok *t, const char *content) {
    for (int32_t i = 0; i < t->n_added; i++)
        if (!strcmp(t->added[i].content, content)) return i;
    return -1;
}

static int trie_new_node(tok_trie *tr, uint8_t byte) {
    if (tr->n == tr->cap) {
        int32_t cap = tr->cap ? tr->cap * 2 : 64;
        tok_trie_node *v = ct_malloc((size_t)cap * sizeof *v);
        if (tr->n) memcpy(v, tr->nodes, (size_t)tr->n * sizeof *v);
        free(tr->nodes);
        tr->nodes = v;
        tr->cap = cap;
    }
    tr->nodes[tr->n] = (tok_trie_node){-1, -1, -1, byte};
    return tr->n++;
}

static void trie_insert(tok_trie *tr, const char *s, size_t n, int32_t added) {
    if (!tr->n) trie_new_node(tr, 0);
    int32_t node = 0;
    tr->first[(uint8_t)s[0]] = 1;
    for (size_t i = 0; i < n; i++) {
        uint8_t b = (uint8_t)s[i];
        int32_t c = tr->nodes[node].child;
        while (c >= 0 && tr->nodes[c].byte != b) c = tr->nodes[c].sibling;
        if (c < 0) {
            c = trie_new_node(tr, b);
            tr->nodes[c].sibling = tr->nodes[node].child;
            tr->nodes[node].child = c;
        }
        node = c;
    }
    /* Two tokens with the same match string: the first keeps it. */
    if (tr->nodes[node].added < 0) tr->nodes[node].added = added;
}

/* ------------------------------------------------------------ pipeline checks */

/* A {"String": s} pattern (a Regex one is refused: ctitan does not run
 * arbitrary regexes outside the split). */
static int string_pattern(const cJSON *o, char **out, size_t *n, const char *file, const char *ctx,
                          ct_err *e) {
    const cJSON *pat = jget(o, "pattern"), *str = jget(pat, "String");
    if (!cJSON_IsString(str) || !str->valuestring[0])
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.pattern: only a non-empty {\"String\": ...} is supported",
                       file, ctx);
    *out = ct_strdup(str->valuestring);
    *n = strlen(*out);
    return 0;
}

static int jstring(const cJSON *o, const char *k, int nonempty, char **out, size_t *n,
                   const char *file, const char *ctx, ct_err *e) {
    const cJSON *v = jget(o, k);
    if (!cJSON_IsString(v) || (nonempty && !v->valuestring[0]))
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.%s: expected a %sstring", file, ctx, k,
                       nonempty ? "non-empty " : "");
    *out = ct_strdup(v->valuestring);
    *n = strlen(*out);
    return 0;
}

static int add_norm_step(tok *t, const cJSON *o, const char *file, const char *ctx, ct_err *e) {
    const char *ty = jtype(o);
    tok_norm st = {0};
    if (!strcmp(ty, "NFC")) st.kind = TOK_NORM_NFC;
    else if (!strcmp(ty, "Prepend")) {
        st.kind = TOK_NORM_PREPEND;
        if (jstring(o, "prepend", 0, &st.rep, &st.nrep, file, ctx, e)) return e->code;
    } else if (!strcmp(ty, "Replace")) {
        st.kind = TOK_NORM_REPLACE;
        if (string_pattern(o, &st.pat, &st.npat, file, ctx, e)) return e->code;
        if (jstring(o, "content", 0, &st.rep, &st.nrep, file, ctx, e)) {
            free(st.pat);
            return e->code;
        }
    } else {
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: %s.type: unsupported normalizer '%s' (only NFC, Prepend, Replace)", file, ctx, ty);
    }
    tok_norm *v = ct_malloc((size_t)(t->n_norm + 1) * sizeof *v);
    if (t->n_norm) memcpy(v, t->norm, (size_t)t->n_norm * sizeof *v);
    free(t->norm);
    t->norm = v;
    t->norm[t->n_norm++] = st;
    return 0;
}

static int check_normalizer(tok *t, const cJSON *n, const char *file, ct_err *e) {
    if (jnull(n)) return 0;
    if (!strcmp(jtype(n), "Sequence")) {
        const cJSON *list = jget(n, "normalizers"), *it;
        if (!cJSON_IsArray(list))
            return ct_fail(e, CT_ERR_FORMAT, "%s: normalizer.normalizers: expected an array", file);
        int i = 0;
        cJSON_ArrayForEach(it, list) {
            char ctx[64];
            snprintf(ctx, sizeof ctx, "normalizer.normalizers[%d]", i++);
            if (add_norm_step(t, it, file, ctx, e)) return e->code;
        }
    } else if (add_norm_step(t, n, file, "normalizer", e)) {
        return e->code;
    }
    /* NFC alone (or repeated: it is idempotent) takes the fast path */
    t->nfc = t->n_norm > 0;
    for (int k = 0; k < t->n_norm; k++)
        if (t->norm[k].kind != TOK_NORM_NFC) t->nfc = 0;
    return 0;
}

static int check_bytelevel(const cJSON *b, int want_regex, const char *file, const char *ctx,
                           ct_err *e) {
    int aps = 0, ur = 0;
    if (jbool(b, "add_prefix_space", 0, &aps, file, ctx, e) ||
        jbool(b, "use_regex", 1, &ur, file, ctx, e))
        return e->code;
    if (aps)
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.add_prefix_space: true is not supported", file, ctx);
    if (want_regex >= 0 && ur != want_regex)
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.use_regex: %s is not supported here", file, ctx,
                       ur ? "true" : "false");
    return 0;
}

static int compile_regex(tok *t, const char *pattern, int literal, const char *file, ct_err *e) {
    char msg[256];
    size_t off;
    if (tok_regex_compile(t, pattern, literal, msg, sizeof msg, &off))
        return ct_fail(e, CT_ERR_FORMAT, "%s: pre_tokenizer pattern: %s at offset %zu", file, msg, off);
    return 0;
}

static int check_pretokenizer(tok *t, const cJSON *p, const char *file, ct_err *e) {
    const char *ty = jtype(p);
    t->byte_level = 1;
    t->pre = TOK_PRE_REGEX;
    if (jnull(p)) { /* SentencePiece-style BPE: each normalized piece is one word */
        t->byte_level = 0;
        t->pre = TOK_PRE_NONE;
        return 0;
    }
    if (!strcmp(ty, "Metaspace")) {
        t->byte_level = 0;
        t->pre = TOK_PRE_METASPACE;
        if (jstring(p, "replacement", 1, &t->split_pat, &t->split_len, file, "pre_tokenizer", e))
            return e->code;
        const cJSON *ps = jget(p, "prepend_scheme");
        if (jnull(ps)) { /* files older than prepend_scheme: add_prefix_space */
            int aps = 1;
            if (jbool(p, "add_prefix_space", 1, &aps, file, "pre_tokenizer", e)) return e->code;
            t->ms_prepend = aps ? 2 : 0;
        } else if (cJSON_IsString(ps) && !strcmp(ps->valuestring, "always")) t->ms_prepend = 2;
        else if (cJSON_IsString(ps) && !strcmp(ps->valuestring, "first")) t->ms_prepend = 1;
        else if (cJSON_IsString(ps) && !strcmp(ps->valuestring, "never")) t->ms_prepend = 0;
        else
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: pre_tokenizer.prepend_scheme: expected \"always\", \"first\" or \"never\"", file);
        return jbool(p, "split", 1, &t->ms_split, file, "pre_tokenizer", e);
    }
    if (!strcmp(ty, "Split")) { /* Gemma: Split(String, MergedWithPrevious) */
        t->byte_level = 0;
        const cJSON *beh = jget(p, "behavior");
        int inv = 0;
        if (jbool(p, "invert", 0, &inv, file, "pre_tokenizer", e)) return e->code;
        if (inv) return ct_fail(e, CT_ERR_FORMAT, "%s: pre_tokenizer.invert: true is not supported", file);
        if (cJSON_IsString(beh) && !strcmp(beh->valuestring, "MergedWithPrevious")) t->pre = TOK_PRE_SPLIT_PREV;
        else if (cJSON_IsString(beh) && !strcmp(beh->valuestring, "MergedWithNext")) t->pre = TOK_PRE_SPLIT_NEXT;
        else if (cJSON_IsString(beh) && !strcmp(beh->valuestring, "Isolated")) t->pre = TOK_PRE_REGEX;
        else
            return ct_fail(e, CT_ERR_FORMAT,
                           "%s: pre_tokenizer.behavior: only Isolated, MergedWithPrevious, MergedWithNext "
                           "are supported", file);
        if (string_pattern(p, &t->split_pat, &t->split_len, file, "pre_tokenizer", e)) return e->code;
        return t->pre == TOK_PRE_REGEX ? compile_regex(t, t->split_pat, 1, file, e) : 0;
    }
    if (!strcmp(ty, "ByteLevel")) {
        if (check_bytelevel(p, 1, file, "pre_tokenizer", e)) return e->code;
        return compile_regex(t, GPT2_PATTERN, 0, file, e);
    }
    const cJSON *list = jget(p, "pretokenizers");
    if (strcmp(ty, "Sequence") || !cJSON_IsArray(list) || cJSON_GetArraySize(list) != 2)
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: pre_tokenizer: unsupported (expected Sequence[Split, ByteLevel], ByteLevel, "
                       "Metaspace, Split(String) or null, got '%s')", file, ty);
    const cJSON *sp = cJSON_GetArrayItem(list, 0), *bl = cJSON_GetArrayItem(list, 1);
    if (strcmp(jtype(sp), "Split"))
        return ct_fail(e, CT_ERR_FORMAT, "%s: pre_tokenizer.pretokenizers[0].type: expected Split, got '%s'",
                       file, jtype(sp));
    if (strcmp(jtype(bl), "ByteLevel"))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: pre_tokenizer.pretokenizers[1].type: expected ByteLevel, got '%s'", file,
                       jtype(bl));
    if (check_bytelevel(bl, 0, file, "pre_tokenizer.pretokenizers[1]", e)) return e->code;
    const cJSON *beh = jget(sp, "behavior");
    if (!cJSON_IsString(beh) || strcmp(beh->valuestring, "Isolated"))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: pre_tokenizer.pretokenizers[0].behavior: only Isolated is supported", file);
    int inv = 0;
    if (jbool(sp, "invert", 0, &inv, file, "pre_tokenizer.pretokenizers[0]", e)) return e->code;
    if (inv)
        return ct_fail(e, CT_ERR_FORMAT, "%s: pre_tokenizer.pretokenizers[0].invert: true is not supported",
                       file);
    const cJSON *pat = jget(sp, "pattern"), *re = jget(pat, "Regex"), *str = jget(pat, "String");
    if (cJSON_IsString(re)) return compile_regex(t, re->valuestring, 0, file, e);
    if (cJSON_IsString(str) && str->valuestring[0]) return compile_regex(t, str->valuestring, 1, file, e);
    return ct_fail(e, CT_ERR_FORMAT,
                   "%s: pre_tokenizer.pretokenizers[0].pattern: expected {\"Regex\": ...} or {\"String\": ...}",
                   file);
}

static int parse_decoder_step(tok *t, const cJSON *o, const char *file, const char *ctx, ct_err *e) {
    const char *ty = jtype(o);
    tok_dec d = {0};
    if (!strcmp(ty, "Replace")) {
        d.kind = TOK_DEC_REPLACE;
        if (string_pattern(o, &d.pat, &d.npat, file, ctx, e)) return e->code;
        if (jstring(o, "content", 0, &d.rep, &d.nrep, file, ctx, e)) { free(d.pat); return e->code; }
    } else if (!strcmp(ty, "Metaspace")) {
        d.kind = TOK_DEC_METASPACE;
        if (jstring(o, "replacement", 1, &d.pat, &d.npat, file, ctx, e)) return e->code;
        const cJSON *ps = jget(o, "prepend_scheme");
        int aps = 1;
        if (jnull(ps)) {
            if (jbool(o, "add_prefix_space", 1, &aps, file, ctx, e)) { free(d.pat); return e->code; }
        } else if (cJSON_IsString(ps) && (!strcmp(ps->valuestring, "always") || !strcmp(ps->valuestring, "first") ||
                                          !strcmp(ps->valuestring, "never"))) {
            aps = strcmp(ps->valuestring, "never") != 0;
        } else {
            free(d.pat);
            return ct_fail(e, CT_ERR_FORMAT, "%s: %s.prepend_scheme: expected \"always\", \"first\" or \"never\"",
                           file, ctx);
        }
        d.start = aps;
    } else if (!strcmp(ty, "ByteFallback")) d.kind = TOK_DEC_BYTEFALLBACK;
    else if (!strcmp(ty, "Fuse")) d.kind = TOK_DEC_FUSE;
    else if (!strcmp(ty, "Strip")) {
        d.kind = TOK_DEC_STRIP;
        const cJSON *c = jget(o, "content"), *a = jget(o, "start"), *b = jget(o, "stop");
        uint32_t cp;
        size_t bad;
        if (!cJSON_IsString(c) || !c->valuestring[0] ||
            tok_utf8_next((const uint8_t *)c->valuestring, strlen(c->valuestring), &cp, &bad) !=
                strlen(c->valuestring))
            return ct_fail(e, CT_ERR_FORMAT, "%s: %s.content: expected one character", file, ctx);
        /* usize in HF tokenizers: 1.0 and 1.5 fail there ("did not match any variant") */
        if (!json_integer_in(a, 0, 1e6) || !json_integer_in(b, 0, 1e6))
            return ct_fail(e, CT_ERR_FORMAT, "%s: %s.start/stop: expected counts (integers)", file, ctx);
        d.pat = ct_strdup(c->valuestring);
        d.npat = strlen(d.pat);
        d.start = (int)a->valuedouble;
        d.stop = (int)b->valuedouble;
    } else {
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: %s.type: unsupported decoder '%s' (with a non-byte-level pre-tokenizer only "
                       "Replace, ByteFallback, Fuse, Strip, Metaspace)", file, ctx, ty);
    }
    tok_dec *v = ct_malloc((size_t)(t->n_dsteps + 1) * sizeof *v);
    if (t->n_dsteps) memcpy(v, t->dsteps, (size_t)t->n_dsteps * sizeof *v);
    free(t->dsteps);
    t->dsteps = v;
    t->dsteps[t->n_dsteps++] = d;
    return 0;
}

static int check_decoder(tok *t, const cJSON *d, const char *file, ct_err *e) {
    if (t->byte_level) {
        if (jnull(d) || strcmp(jtype(d), "ByteLevel"))
            return ct_fail(e, CT_ERR_FORMAT, "%s: decoder: expected ByteLevel, got '%s'", file,
                           jnull(d) ? "null" : jtype(d));
        return 0;
    }
    if (jnull(d))
        return ct_fail(e, CT_ERR_FORMAT, "%s: decoder: null is not supported (expected a Sequence of "
                       "Replace, ByteFallback, Fuse, Strip)", file);
    if (strcmp(jtype(d), "Sequence")) return parse_decoder_step(t, d, file, "decoder", e);
    const cJSON *list = jget(d, "decoders"), *it;
    if (!cJSON_IsArray(list))
        return ct_fail(e, CT_ERR_FORMAT, "%s: decoder.decoders: expected an array", file);
    int i = 0;
    cJSON_ArrayForEach(it, list) {
        char ctx[48];
        snprintf(ctx, sizeof ctx, "decoder.decoders[%d]", i++);
        if (parse_decoder_step(t, it, file, ctx, e)) return e->code;
    }
    return 0;
}

/* TemplateProcessing's `single` template: special tokens around $A. */
static int parse_template(tok *t, const cJSON *tp, const char *file, const char *ctx, ct_err *e) {
    if (t->tpl_ids || t->n_tpl_pre || t->n_tpl_post)
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s: only one TemplateProcessing is supported", file, ctx);
    const cJSON *single = jget(tp, "single"), *sp = jget(tp, "special_tokens"), *it;
    if (!cJSON_IsArray(single))
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.single: expected an array", file, ctx);
    tok_ids ids = {0};
    int seen_a = 0, i = 0;
    cJSON_ArrayForEach(it, single) {
        const cJSON *seq = jget(it, "Sequence"), *st = jget(it, "SpecialToken");
        if (cJSON_IsObject(seq)) {
            const cJSON *id = jget(seq, "id");
            if (!cJSON_IsString(id) || strcmp(id->valuestring, "A") || seen_a) {
                tok_ids_free(&ids);
                return ct_fail(e, CT_ERR_FORMAT, "%s: %s.single[%d]: expected one Sequence A", file, ctx, i);
            }
            seen_a = 1;
            t->n_tpl_pre = (int)ids.n;
        } else if (cJSON_IsObject(st)) {
            const cJSON *id = jget(st, "id"), *ent = cJSON_IsString(id) ? jget(sp, id->valuestring) : NULL;
            const cJSON *lst = jget(ent, "ids"), *x;
            if (!cJSON_IsArray(lst)) {
                tok_ids_free(&ids);
                return ct_fail(e, CT_ERR_FORMAT, "%s: %s.single[%d]: special token '%s' has no ids in "
                               "%s.special_tokens", file, ctx, i, cJSON_IsString(id) ? id->valuestring : "?", ctx);
            }
            cJSON_ArrayForEach(x, lst) {
                int32_t v;
                char c2[96];
                snprintf(c2, sizeof c2, "%s.special_tokens[\"%.30s\"].ids", ctx, id->valuestring);
                if (jid(x, &v, file, c2, e)) { tok_ids_free(&ids); return e->code; }
                tok_ids_push(&ids, v);
            }
        } else {
            tok_ids_free(&ids);
            return ct_fail(e, CT_ERR_FORMAT, "%s: %s.single[%d]: expected Sequence or SpecialToken", file, ctx, i);
        }
        i++;
    }
    if (!seen_a) {
        tok_ids_free(&ids);
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s.single: has no Sequence A", file, ctx);
    }
    t->n_tpl_post = (int)ids.n - t->n_tpl_pre;
    t->tpl_ids = ids.v ? ids.v : ct_malloc(sizeof(int32_t));
    return 0;
}

/* null, ByteLevel (offsets only), TemplateProcessing, or a Sequence of them. */
static int check_post(tok *t, const cJSON *pp, const char *file, ct_err *e) {
    if (jnull(pp) || !strcmp(jtype(pp), "ByteLevel")) return 0;
    if (!strcmp(jtype(pp), "TemplateProcessing")) return parse_template(t, pp, file, "post_processor", e);
    const cJSON *list = jget(pp, "processors"), *it;
    if (strcmp(jtype(pp), "Sequence") || !cJSON_IsArray(list))
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: post_processor: '%s' is not supported (only null, ByteLevel, TemplateProcessing "
                       "or a Sequence of them)", file, jtype(pp));
    int i = 0;
    cJSON_ArrayForEach(it, list) {
        char ctx[48];
        snprintf(ctx, sizeof ctx, "post_processor.processors[%d]", i++);
        if (!strcmp(jtype(it), "ByteLevel")) continue;
        if (strcmp(jtype(it), "TemplateProcessing"))
            return ct_fail(e, CT_ERR_FORMAT, "%s: %s: '%s' is not supported (only ByteLevel, TemplateProcessing)",
                           file, ctx, jtype(it));
        if (parse_template(t, it, file, ctx, e)) return e->code;
    }
    return 0;
}

static int check_pipeline(tok *t, const cJSON *j, const char *file, ct_err *e) {
    if (check_normalizer(t, jget(j, "normalizer"), file, e)) return e->code;
    if (check_pretokenizer(t, jget(j, "pre_tokenizer"), file, e)) return e->code;
    if (check_decoder(t, jget(j, "decoder"), file, e)) return e->code;
    if (check_post(t, jget(j, "post_processor"), file, e)) return e->code;
    if (!jnull(jget(j, "truncation")))
        return ct_fail(e, CT_ERR_FORMAT, "%s: truncation: must be null", file);
    if (!jnull(jget(j, "padding")))
        return ct_fail(e, CT_ERR_FORMAT, "%s: padding: must be null", file);
    return 0;
}

static int check_model_opts(tok *t, const cJSON *m, const char *file, ct_err *e) {
    const cJSON *ty = jget(m, "type");
    if (!jnull(ty) && (!cJSON_IsString(ty) || strcmp(ty->valuestring, "BPE")))
        return ct_fail(e, CT_ERR_FORMAT, "%s: model.type: expected BPE", file);
    const cJSON *dr = jget(m, "dropout");
    if (!jnull(dr) && !(cJSON_IsNumber(dr) && dr->valuedouble == 0))
        return ct_fail(e, CT_ERR_FORMAT, "%s: model.dropout: must be null (dropout is random)", file);
    int bf = 0, fu = 0, im = 0;
    if (jbool(m, "byte_fallback", 0, &bf, file, "model", e) ||
        jbool(m, "fuse_unk", 0, &fu, file, "model", e) ||
        jbool(m, "ignore_merges", 0, &im, file, "model", e))
        return e->code;
    t->ignore_merges = im;
    if (bf && t->byte_level)
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s: model.byte_fallback: true is not supported with a ByteLevel pre-tokenizer", file);
    t->byte_fallback = bf;
    t->fuse_unk = fu;
    const char *aff[] = {"continuing_subword_prefix", "end_of_word_suffix"};
    for (int i = 0; i < 2; i++) {
        const cJSON *v = jget(m, aff[i]);
        if (!jnull(v) && (!cJSON_IsString(v) || v->valuestring[0]))
            return ct_fail(e, CT_ERR_FORMAT, "%s: model.%s: only null or \"\" is supported", file, aff[i]);
    }
    return 0;
}

/* ------------------------------------------------------------ finishing */

/* Resolves bos/eos/pad from tokenizer_config.json: a string or {"content"}. */
static int special_id(tok *t, const cJSON *cfg, const char *key, int32_t *out, const char *file,
                      ct_err *e) {
    *out = -1;
    const cJSON *v = jget(cfg, key);
    if (jnull(v)) return 0;
    if (cJSON_IsObject(v)) v = jget(v, "content");
    if (!cJSON_IsString(v))
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s: expected a string or an object with \"content\"", file, key);
    *out = tok_token_id(t, v->valuestring);
    if (*out < 0)
        return ct_fail(e, CT_ERR_FORMAT, "%s: %s: token '%s' is not in the vocabulary", file, key,
                       v->valuestring);
    return 0;
}

static int cmp_added_id(const void *x, const void *y) {
    const tok_added *a = x, *b = y;
    return (a->id > b->id) - (a->id < b->id);
}

/* Tokens of added_tokens_decoder that tokenizer.json lacks are appended in
 * id order (all of them in the vocab.json + merges.txt case). */
static int read_config(tok *t, const cJSON *cfg, const char *file, ct_err *e) {
    const cJSON *dec = jget(cfg, "added_tokens_decoder"), *it;
    if (jnull(dec)) return 0;
    if (!cJSON_IsObject(dec))
        return ct_fail(e, CT_ERR_FORMAT, "%s: added_tokens_decoder: expected an object", file);
    int32_t first = t->n_added;
    cJSON_ArrayForEach(it, dec) {
        char ctx[96];
        snprintf(ctx, sizeof ctx, "added_tokens_decoder[\"%.40s\"]", it->string);
        char *end;
        errno = 0;
        long id = strtol(it->string, &end, 10);
        if (!it->string[0] || *end || errno || id < 0 || id >= TOK_MAX_ID)
            return ct_fail(e, CT_ERR_FORMAT, "%s: %s: key is not an id", file, ctx);
        tok_added a;
        if (parse_added(it, (int32_t)id, &a, file, ctx, e)) return e->code;
        if (find_added(t, a.content) >= 0) { /* tokenizer.json has it: that one counts */
            free(a.content);
            continue;
        }
        a.from_config = 1;
        added_push(t, &a);
    }
    qsort(t->added + first, (size_t)(t->n_added - first), sizeof *t->added, cmp_added_id);
    return 0;
}

/* Gives added tokens the ids HF gives them, whatever ids the file states:
 * a token already in the model vocab keeps that id; any other takes the
 * next id after the model vocab and the added tokens so far (HF's
 * AddedVocabulary::add_tokens; it only warns about a stated id that
 * differs). Ids stated in tokenizer_config.json are only taken from there
 * when the two agree, since transformers' own handling cannot be checked. */
static int assign_added_ids(tok *t, const char *file, const char *config_file, ct_err *e) {
    int32_t model_size = 0, max_added = -1, max_vocab = -1;
    for (uint32_t i = 0; i <= t->vocab_mask; i++)
        if (t->vocab[i].hash) {
            model_size++;
            if (t->vocab[i].id > max_vocab) max_vocab = t->vocab[i].id;
        }
    uint8_t *used = ct_calloc((size_t)max_vocab + 1, 1);
    for (uint32_t i = 0; i <= t->vocab_mask; i++)
        if (t->vocab[i].hash) used[t->vocab[i].id] = 1;
    int rc = 0;
    for (int32_t i = 0; i < t->n_added && !rc; i++) {
        tok_added *a = &t->added[i];
        int32_t id = tok_vocab_get(t, a->content, strlen(a->content));
        if (id < 0) {
            id = max_added >= model_size || model_size == 0 ? max_added + 1 : model_size;
            /* HF would silently give two tokens one id when the vocab has holes */
            if (id <= max_vocab && used[id])
                rc = ct_fail(e, CT_ERR_FORMAT,
                             "%s: added token '%s' would get id %d, which the vocab already uses "
                             "(its ids have holes)", a->from_config ? config_file : file, a->content, id);
        }
        if (!rc && a->from_config && id != a->id)
            rc = ct_fail(e, CT_ERR_FORMAT,
                         "%s: added_tokens_decoder[\"%d\"]: '%s' would get id %d (ids of new tokens "
                         "must continue the vocabulary)", config_file, a->id, a->content, id);
        a->id = id;
        if (id > max_added) max_added = id;
    }
    free(used);
    return rc;
}

/* Builds id tables, byte ids, decode strings and tries once vocab, merges
 * and added tokens are in. */
static void finish(tok *t) {
    int32_t n = 0;
    for (uint32_t i = 0; i <= t->vocab_mask; i++)
        if (t->vocab[i].hash && t->vocab[i].id >= n) n = t->vocab[i].id + 1;
    for (int32_t i = 0; i < t->n_added; i++)
        if (t->added[i].id >= n) n = t->added[i].id + 1;
    t->n_ids = n;
    t->id_str = ct_malloc((size_t)n * sizeof *t->id_str);
    for (int32_t i = 0; i < n; i++) t->id_str[i] = -1;
    t->is_special = ct_calloc((size_t)n, 1);
    t->added_of = ct_malloc((size_t)n * sizeof *t->added_of);
    for (int32_t i = 0; i < n; i++) t->added_of[i] = -1;
    for (uint32_t i = 0; i <= t->vocab_mask; i++)
        if (t->vocab[i].hash) t->id_str[t->vocab[i].id] = (int32_t)t->vocab[i].off;
    for (int32_t i = 0; i < t->n_added; i++) {
        tok_added *a = &t->added[i];
        t->is_special[a->id] = a->special;
        t->added_of[a->id] = i;
        /* normalized tokens are matched after the normalizer, so match their
         * normalized form; HF also stores them so (id_to_token and decode
         * give "▁foo▁bar" for "foo bar" under Replace(" ", "▁")) */
        tok_buf m = {0}, tmp = {0};
        if (a->normalized) tok_normalize(t, a->content, strlen(a->content), &m, &tmp);
        else tok_buf_put(&m, a->content, strlen(a->content));
        free(tmp.p);
        a->match = m.p;
        a->match_len = m.n;
        t->id_str[a->id] = (int32_t)pool_add(t, a->match, a->match_len);
        trie_insert(a->normalized ? &t->norm_trie : &t->raw_trie, a->match, a->match_len, i);
    }
    for (int b = 0; b < 256; b++) {
        char u[4];
        t->byte_char[b] = tok_byte_char((uint8_t)b);
        t->byte_id[b] = tok_vocab_get(t, u, (size_t)tok_utf8_put(t->byte_char[b], u));
        char fb[8];
        snprintf(fb, sizeof fb, "<0x%02X>", b);
        t->fb_id[b] = tok_vocab_get(t, fb, 6);
    }
    if (!t->byte_level) return; /* decode runs the decoder chain on token strings */
    /* Decoded bytes: each char through the byte table; a token with a char
     * outside the table passes through as its UTF-8 (HF ByteLevel decoder). */
    int16_t char_byte[256 + 68];
    for (uint32_t c = 0; c < 256 + 68; c++) char_byte[c] = (int16_t)tok_char_byte(c);
    tok_buf d = {0};
    t->dec_off = ct_malloc(((size_t)n + 1) * sizeof *t->dec_off);
    for (int32_t id = 0; id < n; id++) {
        t->dec_off[id] = (uint32_t)d.n;
        if (t->id_str[id] < 0) continue;
        const uint8_t *s = (const uint8_t *)t->pool + t->id_str[id];
        size_t len = strlen((const char *)s), start = d.n, i = 0;
        int ok = 1;
        while (i < len && ok) {
            uint32_t cp;
            size_t bad, k = tok_utf8_next(s + i, len - i, &cp, &bad);
            int byte = k && cp < 256 + 68 ? char_byte[cp] : -1;
            if (byte < 0) ok = 0;
            else {
                uint8_t c = (uint8_t)byte;
                tok_buf_put(&d, &c, 1);
                i += k;
            }
        }
        if (!ok) {
            d.n = start;
            tok_buf_put(&d, s, len);
        }
    }
    t->dec_off[n] = (uint32_t)d.n;
    t->dec = d.p ? d.p : ct_calloc(1, 1);
}

/* ------------------------------------------------------------ entry points */

static int load_tokenizer_json(tok *t, const char *file, ct_err *e) {
    cJSON *j = parse_json(file, e);
    if (!j) return e->code;
    int rc = 0;
    const cJSON *m = jget(j, "model"), *vocab = jget(m, "vocab"), *merges = jget(m, "merges"), *it;
    if (!cJSON_IsObject(m)) { rc = ct_fail(e, CT_ERR_FORMAT, "%s: model: expected an object", file); goto out; }
    if ((rc = check_pipeline(t, j, file, e)) || (rc = check_model_opts(t, m, file, e))) goto out;
    if (!cJSON_IsObject(vocab)) { rc = ct_fail(e, CT_ERR_FORMAT, "%s: model.vocab: expected an object", file); goto out; }
    if (!cJSON_IsArray(merges)) { rc = ct_fail(e, CT_ERR_FORMAT, "%s: model.merges: expected an array", file); goto out; }
    vocab_init(t, (size_t)cJSON_GetArraySize(vocab));
    cJSON_ArrayForEach(it, vocab) {
        char ctx[96];
        int32_t id = 0;
        snprintf(ctx, sizeof ctx, "model.vocab[\"%.40s\"]", it->string);
        if ((rc = jid(it, &id, file, ctx, e))) goto out;
        vocab_put(t, it->string, strlen(it->string), id);
    }
    merges_init(t, (size_t)cJSON_GetArraySize(merges));
    int32_t rank = 0;
    cJSON_ArrayForEach(it, merges) {
        if (cJSON_IsString(it)) { /* legacy "a b" */
            const char *s = it->valuestring, *sp = strchr(s, ' ');
            if (!sp) { rc = ct_fail(e, CT_ERR_FORMAT, "%s: model.merges[%d]: expected \"left right\"", file, rank); goto out; }
            rc = add_merge(t, s, (size_t)(sp - s), sp + 1, strlen(sp + 1), rank, file, "model.merges", e);
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 &&
                   cJSON_IsString(it->child) && cJSON_IsString(it->child->next)) {
            const char *a = it->child->valuestring, *b = it->child->next->valuestring;
            rc = add_merge(t, a, strlen(a), b, strlen(b), rank, file, "model.merges", e);
        } else {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: model.merges[%d]: expected \"left right\" or [left, right]", file, rank);
        }
        if (rc) goto out;
        rank++;
    }
    const cJSON *unk = jget(m, "unk_token");
    t->unk_id = -1;
    if (!jnull(unk)) {
        if (!cJSON_IsString(unk) || (t->unk_id = tok_vocab_get(t, unk->valuestring, strlen(unk->valuestring))) < 0) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: model.unk_token: not a token of model.vocab", file);
            goto out;
        }
    }
    const cJSON *added = jget(j, "added_tokens");
    if (!jnull(added) && !cJSON_IsArray(added)) { rc = ct_fail(e, CT_ERR_FORMAT, "%s: added_tokens: expected an array", file); goto out; }
    int i = 0;
    cJSON_ArrayForEach(it, added) {
        char ctx[64];
        snprintf(ctx, sizeof ctx, "added_tokens[%d]", i++);
        int32_t id = 0;
        tok_added a;
        char idctx[80];
        snprintf(idctx, sizeof idctx, "%s.id", ctx);
        if ((rc = jid(jget(it, "id"), &id, file, idctx, e)) || (rc = parse_added(it, id, &a, file, ctx, e))) goto out;
        if (find_added(t, a.content) >= 0) { /* HF keeps one entry per content */
            free(a.content);
            continue;
        }
        added_push(t, &a);
    }
out:
    cJSON_Delete(j);
    return rc;
}

/* vocab.json + merges.txt: the Qwen2 pipeline is assumed. */
static int load_vocab_merges(tok *t, const char *vocab_file, const char *merges_file, ct_err *e) {
    cJSON *j = parse_json(vocab_file, e);
    if (!j) return e->code;
    int rc = 0;
    const cJSON *it;
    vocab_init(t, (size_t)cJSON_GetArraySize(j));
    cJSON_ArrayForEach(it, j) {
        char ctx[64];
        int32_t id = 0;
        snprintf(ctx, sizeof ctx, "[\"%.40s\"]", it->string);
        if ((rc = jid(it, &id, vocab_file, ctx, e))) break;
        vocab_put(t, it->string, strlen(it->string), id);
    }
    cJSON_Delete(j);
    if (rc) return rc;
    size_t n;
    char *txt = fs_read_file(merges_file, 0, &n, e);
    if (!txt) return e->code;
    size_t lines = 1;
    for (size_t i = 0; i < n; i++) lines += txt[i] == '\n';
    merges_init(t, lines);
    int32_t rank = 0;
    size_t lineno = 0;
    for (char *p = txt, *end = txt + n; p < end && !rc;) {
        char *nl = memchr(p, '\n', (size_t)(end - p));
        char *le = nl ? nl : end;
        lineno++;
        if (le > p && le[-1] == '\r') le--; /* lines() drops "\r\n" too */
        size_t len = (size_t)(le - p);
        if (!(len >= 8 && !memcmp(p, "#version", 8))) {
            char *sp = memchr(p, ' ', len);
            if (!sp || memchr(sp + 1, ' ', (size_t)(le - sp - 1)))
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: line %zu: expected two tokens separated by one space",
                             merges_file, lineno);
            else {
                char field[48];
                snprintf(field, sizeof field, "line %zu: merge", lineno);
                rc = add_merge(t, p, (size_t)(sp - p), sp + 1, (size_t)(le - sp - 1), rank, merges_file,
                               field, e);
                rank++;
            }
        }
        p = nl ? nl + 1 : end;
    }
    free(txt);
    if (rc) return rc;
    t->nfc = 1;
    t->byte_level = 1;
    t->unk_id = -1;
    return compile_regex(t, QWEN2_PATTERN, 0, vocab_file, e);
}

int tok_load_files(const char *tokenizer_json, const char *vocab_json, const char *merges_txt,
                   const char *config_json, tok **out, ct_err *e) {
    *out = NULL;
    tok *t = ct_calloc(1, sizeof *t);
    t->bos_id = t->eos_id = t->pad_id = t->unk_id = -1;
    int rc;
    if (tokenizer_json) rc = load_tokenizer_json(t, tokenizer_json, e);
    else if (vocab_json && merges_txt) rc = load_vocab_merges(t, vocab_json, merges_txt, e);
    else rc = ct_fail(e, CT_ERR_IO, "tokenizer: need tokenizer.json or vocab.json + merges.txt");
    cJSON *cfg = NULL;
    const char *file = tokenizer_json ? tokenizer_json : vocab_json;
    if (!rc && config_json) {
        cfg = parse_json(config_json, e);
        rc = cfg ? read_config(t, cfg, config_json, e) : e->code;
    }
    if (!rc) rc = assign_added_ids(t, file, config_json, e);
    if (!rc) finish(t);
    if (!rc && cfg) {
        if (special_id(t, cfg, "bos_token", &t->bos_id, config_json, e) ||
            special_id(t, cfg, "eos_token", &t->eos_id, config_json, e) ||
            special_id(t, cfg, "pad_token", &t->pad_id, config_json, e))
            rc = e->code;
    }
    cJSON_Delete(cfg);
    if (rc) {
        tok_free(t);
        return rc;
    }
    *out = t;
    return 0;
}

int tok_load(const char *dir, tok **out, ct_err *e) {
    /* a mistyped directory read "no tokenizer.json, and no vocab.json + merges.txt", as if
     * it existed and lacked the files */
    struct stat st;
    if (stat(dir, &st) != 0)
        return ct_fail(e, CT_ERR_IO, "%s: %s (the tokenizer directory: tokenizer.json, or vocab.json + merges.txt)",
                       dir, errno == ENOENT ? "no such directory" : strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return ct_fail(e, CT_ERR_CONFIG, "%s: a file, not a tokenizer directory (give the directory that holds it)",
                       dir);
    size_t n = strlen(dir) + 32;
    char *tj = ct_malloc(n), *vj = ct_malloc(n), *mt = ct_malloc(n), *cj = ct_malloc(n);
    snprintf(tj, n, "%s/tokenizer.json", dir);
    snprintf(vj, n, "%s/vocab.json", dir);
    snprintf(mt, n, "%s/merges.txt", dir);
    snprintf(cj, n, "%s/tokenizer_config.json", dir);
    int rc;
    if (file_exists(tj) || !file_exists(vj) || !file_exists(mt))
        rc = file_exists(tj) ? tok_load_files(tj, NULL, NULL, file_exists(cj) ? cj : NULL, out, e)
                             : ct_fail(e, CT_ERR_IO, "%s: no tokenizer.json, and no vocab.json + merges.txt", dir);
    else rc = tok_load_files(NULL, vj, mt, file_exists(cj) ? cj : NULL, out, e);
    free(tj);
    free(vj);
    free(mt);
    free(cj);
    return rc;
}

void tok_free(tok *t) {
    if (!t) return;
    free(t->pool);
    free(t->vocab);
    free(t->id_str);
    free(t->dec);
    free(t->dec_off);
    free(t->is_special);
    free(t->added_of);
    free(t->merges);
    for (int32_t i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].match);
    }
    free(t->added);
    free(t->raw_trie.nodes);
    free(t->norm_trie.nodes);
    for (int k = 0; k < t->n_norm; k++) {
        free(t->norm[k].pat);
        free(t->norm[k].rep);
    }
    free(t->norm);
    for (int k = 0; k < t->n_dsteps; k++) {
        free(t->dsteps[k].pat);
        free(t->dsteps[k].rep);
    }
    free(t->dsteps);
    free(t->split_pat);
    free(t->tpl_ids);
    if (t->re) pcre2_code_free(t->re);
    if (t->re_exact) pcre2_code_free(t->re_exact);
    free(t);
}

int32_t tok_vocab_size(const tok *t) { return t->n_ids; }

int32_t tok_token_id(const tok *t, const char *s) {
    int k = find_added(t, s);
    if (k >= 0) return t->added[k].id;
    return tok_vocab_get(t, s, strlen(s));
}

const char *tok_id_to_token(const tok *t, int32_t id) {
    if (id < 0 || id >= t->n_ids || t->id_str[id] < 0) return NULL;
    return t->pool + t->id_str[id];
}

int tok_is_special(const tok *t, int32_t id) {
    return id >= 0 && id < t->n_ids && t->is_special[id];
}

int32_t tok_bos_id(const tok *t) { return t->bos_id; }
int32_t tok_eos_id(const tok *t) { return t->eos_id; }
int32_t tok_pad_id(const tok *t) { return t->pad_id; }
