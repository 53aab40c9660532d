/* tests/c/data/test_dataset.c: data sources, packing, chat masks, shuffling,
 * rank sharding, loader state, shards, errors.
 *
 * Tokenizer-dependent checks use a tokenizer.json written here: Qwen's
 * pipeline (NFC, Split(Qwen regex, Isolated) + ByteLevel) with no merges and
 * the 256 byte symbols given ids equal to their byte value, so the expected
 * ids of any text are simply its bytes; <|endoftext|> = 256, <|im_start|> =
 * 257, <|im_end|> = 258. Token-file checks use streams whose values are their
 * own positions, so a window's first input names the window. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <ftw.h>
#include <sys/stat.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "check.h"
#include "data/chat.h"
#include "data/dataset.h"
#include "tokenizer/tokenizer.h"

enum { EOT = 256, IMS = 257, IME = 258 };

static char tmpdir[256];

static const char *tpath(const char *name) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 512, "%s/%s", tmpdir, name);
    return p;
}

static void write_file(const char *name, const void *data, size_t n) {
    FILE *f = fopen(tpath(name), "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", tpath(name));
        exit(1);
    }
    fclose(f);
}

static void write_str(const char *name, const char *s) { write_file(name, s, strlen(s)); }

/* Tokens 0..n-1 as raw uint32. */
static void write_iota(const char *name, size_t n) {
    uint32_t *v = malloc(n * 4);
    for (size_t i = 0; i < n; i++) v[i] = (uint32_t)i;
    write_file(name, v, n * 4);
    free(v);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

/* In tmpdir/sub (sub may be ""); without_chat drops <|im_start|> and <|im_end|>. */
static tok *make_tokenizer(const char *sub, int without_chat) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "version", "1.0");
    cJSON_AddNullToObject(j, "truncation");
    cJSON_AddNullToObject(j, "padding");
    cJSON *added = cJSON_AddArrayToObject(j, "added_tokens");
    const char *sp[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    for (int i = 0; i < (without_chat ? 1 : 3); i++) {
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", 256 + i);
        cJSON_AddStringToObject(a, "content", sp[i]);
        cJSON_AddBoolToObject(a, "single_word", 0);
        cJSON_AddBoolToObject(a, "lstrip", 0);
        cJSON_AddBoolToObject(a, "rstrip", 0);
        cJSON_AddBoolToObject(a, "normalized", 0);
        cJSON_AddBoolToObject(a, "special", 1);
        cJSON_AddItemToArray(added, a);
    }
    cJSON *norm = cJSON_AddObjectToObject(j, "normalizer");
    cJSON_AddStringToObject(norm, "type", "NFC");
    cJSON *pre = cJSON_AddObjectToObject(j, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "Sequence");
    cJSON *list = cJSON_AddArrayToObject(pre, "pretokenizers");
    cJSON *split = cJSON_CreateObject();
    cJSON_AddStringToObject(split, "type", "Split");
    cJSON *pat = cJSON_AddObjectToObject(split, "pattern");
    cJSON_AddStringToObject(pat, "Regex",
                            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| "
                            "?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+");
    cJSON_AddStringToObject(split, "behavior", "Isolated");
    cJSON_AddBoolToObject(split, "invert", 0);
    cJSON_AddItemToArray(list, split);
    cJSON *bl = cJSON_CreateObject();
    cJSON_AddStringToObject(bl, "type", "ByteLevel");
    cJSON_AddBoolToObject(bl, "add_prefix_space", 0);
    cJSON_AddBoolToObject(bl, "trim_offsets", 0);
    cJSON_AddBoolToObject(bl, "use_regex", 0);
    cJSON_AddItemToArray(list, bl);
    cJSON_AddNullToObject(j, "post_processor");
    cJSON *dec = cJSON_AddObjectToObject(j, "decoder");
    cJSON_AddStringToObject(dec, "type", "ByteLevel");
    cJSON_AddBoolToObject(dec, "add_prefix_space", 0);
    cJSON_AddBoolToObject(dec, "trim_offsets", 0);
    cJSON_AddBoolToObject(dec, "use_regex", 0);
    cJSON *model = cJSON_AddObjectToObject(j, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddBoolToObject(model, "fuse_unk", 0);
    cJSON_AddBoolToObject(model, "byte_fallback", 0);
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int b = 0; b < 256; b++) {
        uint32_t cp = tok_byte_char((uint8_t)b);
        char u[5] = {0};
        if (cp < 0x80) u[0] = (char)cp;
        else if (cp < 0x800) u[0] = (char)(0xC0 | cp >> 6), u[1] = (char)(0x80 | (cp & 63));
        else u[0] = (char)(0xE0 | cp >> 12), u[1] = (char)(0x80 | ((cp >> 6) & 63)), u[2] = (char)(0x80 | (cp & 63));
        cJSON_AddNumberToObject(vocab, u, b);
    }
    cJSON_AddArrayToObject(model, "merges");
    char *text = cJSON_Print(j);
    cJSON_Delete(j);
    char dir[512], name[600];
    snprintf(dir, sizeof dir, "%s/%s", tmpdir, sub);
    mkdir(dir, 0777);
    snprintf(name, sizeof name, "%s/tokenizer.json", sub);
    write_str(name, text);
    free(text);
    snprintf(name, sizeof name, "%s/tokenizer_config.json", sub);
    write_str(name, "{\"eos_token\": \"<|endoftext|>\"}");
    tok *t = NULL;
    ct_err e = {0};
    if (tok_load(dir, &t, &e)) {
        fprintf(stderr, "tok_load: %s\n", e.msg);
        exit(1);
    }
    return t;
}

/* ------------------------------------------------------------ chat */

static void test_chat(const tok *t) {
    chat_msg m[] = {
        {"system", 6, "Be brief.", 9},
        {"user", 4, "hi", 2},
        {"assistant", 9, "yo", 2},
        {"user", 4, "again", 5},
        {"assistant", 9, "\n\nok", 4},
    };
    char *text;
    size_t len;
    chat_render(m, 5, &text, &len);
    const char *want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                       "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
                       "<|im_start|>assistant\n\n\nok<|im_end|>\n";
    CHECK(len == strlen(want) && !strcmp(text, want), "rendered:\n%s", text);
    free(text);

    /* expected: bytes of each piece (ids == bytes), specials by id */
    int32_t ids[256];
    uint8_t mask[256];
    int n = 0;
    for (int i = 0; i < 5; i++) {
        int train = !strcmp(m[i].role, "assistant");
        ids[n] = IMS, mask[n++] = 0;
        for (size_t k = 0; k < m[i].role_len; k++) ids[n] = (uint8_t)m[i].role[k], mask[n++] = 0;
        ids[n] = '\n', mask[n++] = 0;
        for (size_t k = 0; k < m[i].content_len; k++) ids[n] = (uint8_t)m[i].content[k], mask[n++] = (uint8_t)train;
        ids[n] = IME, mask[n++] = (uint8_t)train;
        ids[n] = '\n', mask[n++] = 0;
    }
    tok_enc *enc = tok_enc_new(t);
    tok_ids got = {0};
    chat_mask gm = {0};
    ct_err e = {0};
    CHECK(chat_encode(enc, t, m, 5, &got, &gm, &e) == 0, "%s", e.msg);
    CHECK(got.n == (size_t)n && gm.n == (size_t)n, "%zu ids, %zu mask, want %d", got.n, gm.n, n);
    int bad = -1;
    for (int i = 0; i < n && (size_t)i < got.n; i++)
        if (got.v[i] != ids[i] || gm.v[i] != mask[i]) {
            bad = i;
            break;
        }
    CHECK(bad < 0, "first difference at %d: id %d mask %d, want %d %d", bad, bad >= 0 ? got.v[bad] : 0,
          bad >= 0 ? gm.v[bad] : 0, bad >= 0 ? ids[bad] : 0, bad >= 0 ? mask[bad] : 0);
    tok_ids_free(&got);
    chat_mask_free(&gm);
    tok_enc_free(enc);

    /* JSON parsing errors name the field */
    const char *bad_json[] = {"{\"messages\": 3}", "{\"messages\": []}", "{\"messages\": [{\"role\": \"user\"}]}",
                              "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": 1, \"content\": \"b\"}]}",
                              "{\"text\": \"x\"}"};
    const char *want_msg[] = {"messages", "empty", "messages[0].content: missing", "messages[1].role", "no \"messages\""};
    for (int i = 0; i < 5; i++) {
        cJSON *j = cJSON_Parse(bad_json[i]);
        chat_msg *msgs;
        int nm;
        ct_err ce = {0};
        int rc = chat_from_json(j, &msgs, &nm, &ce);
        CHECK(rc != 0 && strstr(ce.msg, want_msg[i]), "%s -> rc %d '%s'", bad_json[i], rc, ce.msg);
        cJSON_Delete(j);
    }

    /* ShareGPT: TRL's maybe_convert_to_chatml renames the keys and keeps the role names,
     * so the record then reads as {"messages": [{"role": "user", "content": ...}, ...]} */
    cJSON *sg = cJSON_Parse("{\"id\": 7, \"conversations\": [{\"from\": \"user\", \"value\": \"hi\"}, "
                            "{\"from\": \"assistant\", \"value\": \"yo\", \"weight\": 1}]}");
    CHECK(chat_layout_of(sg) == CHAT_SHAREGPT, "layout %d", (int)chat_layout_of(sg));
    chat_msg *sm = NULL;
    int sn = 0, sp = -1;
    ct_err se = {0};
    CHECK(chat_record(sg, CHAT_SHAREGPT, &sm, &sn, &sp, &se) == 0, "%s", se.msg);
    char *printed = cJSON_PrintUnformatted(sg);
    CHECK(!strcmp(printed, "{\"id\":7,\"messages\":[{\"role\":\"user\",\"content\":\"hi\"},"
                           "{\"weight\":1,\"role\":\"assistant\",\"content\":\"yo\"}]}"),
          "converted: %s", printed);
    CHECK(sn == 2 && sp == 0 && sm[1].role_len == 9 && !memcmp(sm[1].content, "yo", 2), "turns %d", sn);
    free(printed);
    free(sm);
    cJSON_Delete(sg);

    /* conversational prompt-completion: the prompt's turns, then the completion's */
    cJSON *pc = cJSON_Parse("{\"prompt\": [{\"role\": \"system\", \"content\": \"s\"}, {\"role\": \"user\", "
                            "\"content\": \"q\"}], \"completion\": [{\"role\": \"assistant\", \"content\": \"a\"}]}");
    CHECK(chat_layout_of(pc) == CHAT_PROMPT_COMPLETION, "layout %d", (int)chat_layout_of(pc));
    CHECK(chat_record(pc, CHAT_PROMPT_COMPLETION, &sm, &sn, &sp, &se) == 0, "%s", se.msg);
    CHECK(sn == 3 && sp == 2 && sm[2].content[0] == 'a', "turns %d, prompt %d", sn, sp);
    free(sm);
    cJSON_Delete(pc);
}

/* ------------------------------------------------------------ tokenize */

typedef struct {
    uint32_t v[4096];
    uint8_t m[4096];
    size_t n;
    int masked;
} capture;

static int cap_sink(void *ctx, const uint32_t *ids, const uint8_t *mask, size_t n, ct_err *e) {
    capture *c = ctx;
    if (c->n + n > 4096) return ct_fail(e, CT_ERR_IO, "capture full");
    memcpy(c->v + c->n, ids, n * 4);
    if (mask) memcpy(c->m + c->n, mask, n);
    else memset(c->m + c->n, 1, n);
    c->masked |= mask != NULL;
    c->n += n;
    return 0;
}

/* Expected stream: each string's bytes then EOS. */
static int stream_is(const capture *c, const char *const *docs, int n) {
    size_t k = 0;
    for (int i = 0; i < n; i++) {
        for (const char *p = docs[i]; *p; p++)
            if (k >= c->n || c->v[k++] != (uint8_t)*p) return 0;
        if (k >= c->n || c->v[k++] != EOT) return 0;
    }
    return k == c->n;
}

static int tokenize(const tok *t, const char *path, ds_kind kind, ds_text_split split, int threads, size_t chunk,
                    capture *c, ct_err *e) {
    ds_tok_opts o;
    ds_tok_opts_default(&o);
    o.kind = kind;
    o.text_split = split;
    o.threads = threads;
    o.chunk_bytes = chunk;
    memset(c, 0, sizeof *c);
    const char *p = tpath(path);
    return ds_tokenize(&p, 1, t, &o, cap_sink, c, NULL, NULL, NULL, e);
}

static void test_sources(const tok *t) {
    ct_err e = {0};
    capture *c = malloc(sizeof *c), *c2 = malloc(sizeof *c2);
    write_str("a.txt", "  first para\nline two\r\n \t\n\n\nsecond\n\nthird\n");
    CHECK(tokenize(t, "a.txt", DS_KIND_AUTO, DS_SPLIT_FILE, 1, 0, c, &e) == 0, "%s", e.msg);
    const char *whole[] = {"  first para\nline two\r\n \t\n\n\nsecond\n\nthird\n"};
    CHECK(stream_is(c, whole, 1) && !c->masked, "file split: %zu tokens", c->n);
    CHECK(tokenize(t, "a.txt", DS_KIND_TEXT, DS_SPLIT_PARAGRAPH, 2, 0, c, &e) == 0, "%s", e.msg);
    const char *paras[] = {"  first para\nline two", "second", "third"};
    CHECK(stream_is(c, paras, 3), "paragraph split: %zu tokens", c->n);
    CHECK(tokenize(t, "a.txt", DS_KIND_TEXT, DS_SPLIT_LINE, 2, 0, c, &e) == 0, "%s", e.msg);
    const char *lines[] = {"  first para", "line two", "second", "third"};
    CHECK(stream_is(c, lines, 4), "line split: %zu tokens", c->n);

    /* c4 layout; blank lines skipped, empty texts skipped, escapes decoded */
    write_str("c.jsonl", "{\"text\": \"hello\", \"url\": \"x\"}\n\n{\"text\": \"\"}\r\n{\"text\": \"a\\nb\\u00e9\"}");
    CHECK(tokenize(t, "c.jsonl", DS_KIND_AUTO, 0, 2, 0, c, &e) == 0, "%s", e.msg);
    const char *cdocs[] = {"hello", "a\nb\xc3\xa9"};
    CHECK(stream_is(c, cdocs, 2), "jsonl: %zu tokens", c->n);

    /* thread count and chunking do not change the output */
    char big[6000];
    size_t k = 0;
    for (int i = 0; i < 200; i++) k += (size_t)snprintf(big + k, sizeof big - k, "{\"text\": \"doc %d %.*s\"}\n", i, i % 7, "abcdefg");
    write_file("big.jsonl", big, k);
    CHECK(tokenize(t, "big.jsonl", DS_KIND_JSONL, 0, 1, 0, c, &e) == 0, "%s", e.msg);
    CHECK(tokenize(t, "big.jsonl", DS_KIND_JSONL, 0, 3, 1, c2, &e) == 0, "%s", e.msg);
    CHECK(c->n == c2->n && c->n > 1000 && !memcmp(c->v, c2->v, c->n * 4), "threads 1 vs 3: %zu vs %zu", c->n, c2->n);

    /* chat: mask follows the assistant turns; the EOS after a conversation is no target */
    write_str("chat.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, "
                            "{\"role\": \"assistant\", \"content\": \"a\"}]}\n");
    CHECK(tokenize(t, "chat.jsonl", DS_KIND_AUTO, 0, 1, 0, c, &e) == 0, "%s", e.msg);
    uint32_t wv[] = {IMS, 'u', 's', 'e', 'r', '\n', 'q', IME, '\n', IMS, 'a', 's', 's', 'i', 's', 't', 'a', 'n', 't',
                     '\n', 'a', IME, '\n', EOT};
    uint8_t wm[24] = {0};
    wm[20] = wm[21] = 1;
    CHECK(c->masked && c->n == 24 && !memcmp(c->v, wv, sizeof wv) && !memcmp(c->m, wm, 24), "chat: %zu tokens", c->n);

    /* errors name the file and line */
    write_str("bad.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": oops}\n");
    CHECK(tokenize(t, "bad.jsonl", DS_KIND_AUTO, 0, 1, 0, c, &e) && strstr(e.msg, "bad.jsonl:3: invalid JSON"),
          "%s", e.msg);
    write_str("nofield.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"x\"}\n");
    CHECK(tokenize(t, "nofield.jsonl", DS_KIND_JSONL, 0, 1, 0, c, &e) &&
              strstr(e.msg, "nofield.jsonl:2: \"text\" field missing"), "%s", e.msg);
    write_str("badchat.jsonl", "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}]}\n"
                               "{\"messages\": [{\"role\": \"user\", \"content\": null}]}\n");
    CHECK(tokenize(t, "badchat.jsonl", DS_KIND_AUTO, 0, 1, 0, c, &e) &&
              strstr(e.msg, "badchat.jsonl:2: messages[0].content: expected a string"), "%s", e.msg);
    write_str("two.jsonl", "{\"text\": \"a\"} {\"text\": \"b\"}\n");
    CHECK(tokenize(t, "two.jsonl", DS_KIND_JSONL, 0, 1, 0, c, &e) && strstr(e.msg, "two.jsonl:1: invalid JSON: extra data"), "%s", e.msg);
    write_str("arr.json", "[{\"text\": \"a\"}]\n");
    CHECK(tokenize(t, "arr.json", DS_KIND_AUTO, 0, 1, 0, c, &e) && strstr(e.msg, "arr.json") &&
              strstr(e.msg, "JSON array"), "%s", e.msg);
    CHECK(tokenize(t, "missing.txt", DS_KIND_TEXT, 0, 1, 0, c, &e) && strstr(e.msg, "missing.txt"), "%s", e.msg);

    /* an error while tokenizing names the first failing document, whatever the threads */
    tok *plain = make_tokenizer("plain", 1);
    char chats[8192];
    size_t ck = 0;
    for (int i = 0; i < 60; i++)
        ck += (size_t)snprintf(chats + ck, sizeof chats - ck,
                               "{\"messages\": [{\"role\": \"user\", \"content\": \"q%d\"}]}\n", i);
    write_file("manychat.jsonl", chats, ck);
    for (int threads = 1; threads <= 3; threads += 2) {
        int rc = tokenize(plain, "manychat.jsonl", DS_KIND_CHAT, 0, threads, threads == 1 ? 64 : 0, c, &e);
        CHECK(rc && strstr(e.msg, "manychat.jsonl:1: tokenizer has no <|im_start|>"),
              "threads %d: %s", threads, e.msg);
    }
    tok_free(plain);

    /* kind detection */
    ds_kind k2;
    write_str("plain.data", "{\"messages\": []}\n");
    CHECK(ds_detect_kind(tpath("plain.data"), &k2, &e) == 0 && k2 == DS_KIND_CHAT, "kind %d", k2);
    write_str("words.data", "just words\n");
    CHECK(ds_detect_kind(tpath("words.data"), &k2, &e) == 0 && k2 == DS_KIND_TEXT, "kind %d", k2);
    CHECK(ds_detect_kind(tpath("c.jsonl"), &k2, &e) == 0 && k2 == DS_KIND_JSONL, "kind %d", k2);
    CHECK(ds_detect_kind(tmpdir, &k2, &e) == 0 && k2 == DS_KIND_TOKENS, "kind %d", k2);
    free(c);
    free(c2);
}

/* ------------------------------------------------------------ loader */

static ds *open1(const char *name, int T, int shuffle, uint64_t seed, int rank, int world, ct_err *e) {
    ds_config c;
    ds_config_default(&c);
    c.seq_len = T;
    c.shuffle = shuffle;
    c.seed = seed;
    c.rank = rank;
    c.world = world;
    c.quiet = 1;
    const char *p = tpath(name);
    ds *d = NULL;
    if (ds_open(&d, &p, 1, NULL, &c, e)) return NULL;
    return d;
}

/* The window index of the next window (stream = positions). */
static long next_window(ds *d, int T) {
    int32_t in[64], lab[64];
    ds_next(d, in, lab, 1);
    for (int t = 0; t < T; t++)
        if (in[t] != in[0] + t || lab[t] != in[0] + t + 1) return -1;
    return in[0] % (T + 1) ? -2 : in[0] / (T + 1);
}

static void test_packing(void) {
    enum { T = 7, NW = 10 };
    write_iota("iota.bin", NW * (T + 1) + 3); /* 3 tokens of tail, dropped */
    ct_err e = {0};
    ds *d = open1("iota.bin", T, 0, 0, 0, 1, &e);
    CHECK(d != NULL, "%s", e.msg);
    if (!d) return;
    CHECK(ds_num_windows(d) == NW && ds_num_tokens(d) == NW * (T + 1) + 3 && !ds_has_mask(d), "%llu windows",
          (unsigned long long)ds_num_windows(d));
    int ok = 1;
    for (int pass = 0; pass < 2; pass++)
        for (long w = 0; w < NW; w++) ok &= next_window(d, T) == w;
    CHECK(ok, "windows in order, twice");
    ds_state s;
    ds_get_state(d, &s);
    CHECK(s.epoch == 1 && s.pos == NW, "state %lld %lld", (long long)s.epoch, (long long)s.pos);
    /* a batch is B consecutive windows, rows of seq_len */
    int32_t in[3 * T], lab[3 * T];
    ds_next(d, in, lab, 3);
    CHECK(in[0] == 0 && in[T] == T + 1 && in[2 * T] == 2 * (T + 1) && lab[3 * T - 1] == 3 * (T + 1) - 1,
          "batch rows %d %d %d", in[0], in[T], in[2 * T]);
    ds_close(d);

    /* the tail is not a window: too short */
    write_iota("short.bin", T);
    CHECK(!open1("short.bin", T, 0, 0, 0, 1, &e) && strstr(e.msg, "short.bin") && strstr(e.msg, "too short"), "%s",
          e.msg);
    write_file("odd.bin", "abcde", 5);
    CHECK(!open1("odd.bin", T, 0, 0, 0, 1, &e) && strstr(e.msg, "odd.bin") && strstr(e.msg, "multiple of 4"), "%s",
          e.msg);
    /* vocabulary check */
    ds_config c;
    ds_config_default(&c);
    c.seq_len = T;
    c.vocab_size = 50;
    c.quiet = 1;
    const char *p = tpath("iota.bin");
    CHECK(ds_open(&d, &p, 1, NULL, &c, &e) && strstr(e.msg, "iota.bin: token 50 at position 50"), "%s", e.msg);
}

/* The shuffle is uniform: over many seeds, with 2 and 3 windows, every order
 * comes up about equally often (within 5 standard deviations of n / k!). A
 * Fisher-Yates that skipped its last swap still gave permutations that
 * differed between epochs, which the test below checks, but never shuffled
 * 2 windows and favoured some orders of 3 (a mutation audit). */
static void test_shuffle_uniform(void) {
    enum { T = 1, SEEDS = 2400 };
    for (int nw = 2; nw <= 3; nw++) {
        write_iota("u.bin", (size_t)nw * (T + 1));
        int count[6] = {0}, n_orders = nw == 2 ? 2 : 6, bad = 0;
        for (int s = 0; s < SEEDS && !bad; s++) {
            ct_err e = {0};
            ds *d = open1("u.bin", T, 1, (uint64_t)s * 7919 + 1, 0, 1, &e);
            if (!d) {
                CHECK(0, "%s", e.msg);
                return;
            }
            long w[3] = {0};
            for (int k = 0; k < nw; k++) w[k] = next_window(d, T);
            ds_close(d);
            /* the order's index: its Lehmer code */
            int idx = nw == 2 ? (int)w[0] : (int)w[0] * 2 + (w[1] > w[0] ? (int)w[1] - 1 : (int)w[1]);
            long sum = 0;
            for (int k = 0; k < nw; k++) {
                for (int q = 0; q < k; q++) bad |= w[q] == w[k];
                bad |= w[k] < 0 || w[k] >= nw;
                sum += w[k];
            }
            if (bad || sum != nw * (nw - 1) / 2) bad = 1;
            else count[idx]++;
        }
        CHECK(!bad, "%d windows: every epoch is a permutation", nw);
        double want = (double)SEEDS / n_orders, sd = sqrt(SEEDS * (1.0 / n_orders) * (1.0 - 1.0 / n_orders));
        for (int i = 0; i < n_orders; i++)
            CHECK(fabs(count[i] - want) <= 5 * sd, "%d windows: order %d came up %d times in %d seeds, want %.0f +- %.0f",
                  nw, i, count[i], SEEDS, want, 5 * sd);
    }
}

/* Windows of one epoch per rank: disjoint, complete but for the remainder,
 * and rank r's k-th window is entry k * world + r of the single-rank order. */
static void test_shuffle_and_shards(void) {
    enum { T = 3, NW = 50 };
    write_iota("s.bin", NW * (T + 1));
    ct_err e = {0};
    long order[2][NW];
    ds *d = open1("s.bin", T, 1, 1234, 0, 1, &e);
    CHECK(d != NULL, "%s", e.msg);
    if (!d) return;
    for (int ep = 0; ep < 2; ep++)
        for (int k = 0; k < NW; k++) order[ep][k] = next_window(d, T);
    ds_close(d);
    for (int ep = 0; ep < 2; ep++) {
        int seen[NW] = {0}, perm = 1, ident = 1;
        for (int k = 0; k < NW; k++) {
            if (order[ep][k] < 0 || order[ep][k] >= NW || seen[order[ep][k]]++) perm = 0;
            ident &= order[ep][k] == k;
        }
        CHECK(perm, "epoch %d is a permutation of the %d windows", ep, NW);
        CHECK(!ident, "epoch %d is shuffled", ep);
    }
    CHECK(memcmp(order[0], order[1], sizeof order[0]), "epochs reshuffle");
    /* same seed: same order; another seed: another */
    d = open1("s.bin", T, 1, 1234, 0, 1, &e);
    int same = 1;
    for (int k = 0; k < NW; k++) same &= next_window(d, T) == order[0][k];
    ds_close(d);
    CHECK(same, "seed 1234 reproduces its order");
    d = open1("s.bin", T, 1, 99, 0, 1, &e);
    int diff = 0;
    for (int k = 0; k < NW; k++) diff |= next_window(d, T) != order[0][k];
    ds_close(d);
    CHECK(diff, "seed 99 gives another order");

    for (int shuffle = 0; shuffle < 2; shuffle++) {
        const int W = 3, per = NW / W;
        int count[NW] = {0}, follows = 1;
        for (int r = 0; r < W; r++) {
            d = open1("s.bin", T, shuffle, 1234, r, W, &e);
            CHECK(d && ds_windows_per_rank(d) == (uint64_t)per, "rank %d: %s", r, e.msg);
            if (!d) return;
            for (int k = 0; k < per; k++) {
                long w = next_window(d, T);
                if (w >= 0 && w < NW) count[w]++;
                follows &= w == (shuffle ? order[0][k * W + r] : k * W + r);
            }
            /* next epoch starts after per windows: the remainder is dropped */
            long w = next_window(d, T);
            follows &= w == (shuffle ? order[1][r] : r);
            ds_close(d);
        }
        int dup = 0, covered = 0;
        for (int w = 0; w < NW; w++) dup |= count[w] > 1, covered += count[w] == 1;
        CHECK(!dup && covered == per * W, "shuffle %d: no window twice, %d of %d covered", shuffle, covered, per * W);
        CHECK(follows, "shuffle %d: rank r takes entries r, r + world, ... of the order", shuffle);
    }
    d = open1("s.bin", T, 0, 0, 0, 1, &e);
    CHECK(ds_set_shard(d, 3, 3, &e) && strstr(e.msg, "rank 3 of 3"), "%s", e.msg);
    CHECK(ds_set_shard(d, 0, NW + 1, &e) && strstr(e.msg, "s.bin"), "%s", e.msg);
    ds_close(d);
}

static void test_state(void) {
    enum { T = 5, NW = 13, B = 4 };
    write_iota("st.bin", NW * (T + 1));
    ct_err e = {0};
    for (int world = 1; world <= 2; world++) {
        ds *a = open1("st.bin", T, 1, 7, world - 1, world, &e);
        CHECK(a != NULL, "%s", e.msg);
        if (!a) return;
        int32_t in[B * T], lab[B * T], in2[B * T], lab2[B * T];
        for (int i = 0; i < 3; i++) ds_next(a, in, lab, B);
        ds_state s;
        ds_get_state(a, &s);
        ds *b = open1("st.bin", T, 1, 7, world - 1, world, &e);
        CHECK(ds_set_state(b, &s, &e) == 0, "%s", e.msg);
        int same = 1;
        for (int i = 0; i < 6; i++) { /* crosses epoch boundaries */
            ds_next(a, in, lab, B);
            ds_next(b, in2, lab2, B);
            same &= !memcmp(in, in2, sizeof in) && !memcmp(lab, lab2, sizeof lab);
        }
        CHECK(same, "world %d: restored state gives the same batches", world);
        ds_get_state(a, &s);
        CHECK(s.epoch >= 1, "epochs advanced (%lld)", (long long)s.epoch);
        s.pos = NW + 1;
        CHECK(ds_set_state(b, &s, &e) && strstr(e.msg, "st.bin"), "%s", e.msg);
        ds_close(a);
        ds_close(b);
    }
}

/* ds_writer -> directory -> loader: shards concatenate, masks become -100. */
static void test_shards(void) {
    enum { N = 100, T = 9 };
    uint32_t v[N];
    uint8_t m[N];
    for (int i = 0; i < N; i++) v[i] = (uint32_t)i, m[i] = (uint8_t)(i % 3 != 0);
    ct_err e = {0};
    ds_writer *w;
    CHECK(ds_writer_open(&w, tpath("prep"), 17, 0, &e) == 0, "%s", e.msg);
    CHECK(ds_writer_sink(w, v, m, 40, &e) == 0 && ds_writer_sink(w, v + 40, m + 40, 60, &e) == 0, "%s", e.msg);
    ds_progress st = {.docs = 2, .tokens = N};
    CHECK(ds_writer_finish(w, "chat", "tokdir", 256, 259, NULL, 0, &st, &e) == 0, "%s", e.msg);
    CHECK(ds_writer_num_shards(w) == 6, "%d shards of 17", ds_writer_num_shards(w));
    ds_writer_free(w);
    CHECK(access(tpath("prep/shard-00005.mask"), F_OK) == 0 && access(tpath("prep/meta.json"), F_OK) == 0,
          "shard files");
    CHECK(ds_writer_open(&w, tpath("prep"), 17, 0, &e) && strstr(e.msg, "--overwrite"), "%s", e.msg);

    ds *d = open1("prep", T, 0, 0, 0, 1, &e);
    CHECK(d && ds_has_mask(d) && ds_num_windows(d) == N / (T + 1), "%s", e.msg);
    if (!d) return;
    int ok = 1;
    for (int k = 0; k < N / (T + 1); k++) {
        int32_t in[T], lab[T];
        ds_next(d, in, lab, 1);
        for (int t = 0; t < T; t++) {
            int pos = k * (T + 1) + t;
            ok &= in[t] == pos && lab[t] == (m[pos + 1] ? pos + 1 : -100);
        }
    }
    CHECK(ok, "windows across shard boundaries, labels masked on the target");
    ds_close(d);

    /* a directory of token files not named as prepare names them, without
     * meta.json: *.bin by name, .mask beside */
    mkdir(tpath("plain"), 0777);
    for (int k = 0; k < 6; k++) {
        char from[64], to[64];
        snprintf(from, sizeof from, "prep/shard-%05d.bin", k);
        snprintf(to, sizeof to, "plain/part-%d.bin", k);
        CHECK(link(tpath(from), tpath(to)) == 0, "link %s", to);
        snprintf(from, sizeof from, "prep/shard-%05d.mask", k);
        snprintf(to, sizeof to, "plain/part-%d.mask", k);
        CHECK(link(tpath(from), tpath(to)) == 0, "link %s", to);
    }
    d = open1("plain", T, 0, 0, 0, 1, &e);
    CHECK(d && ds_num_tokens(d) == N && ds_has_mask(d), "%s", e.msg);
    ds_close(d);
    /* prepare's own shards without meta.json: an interrupted prepare, refused */
    remove(tpath("prep/meta.json"));
    CHECK(!open1("prep", T, 0, 0, 0, 1, &e) && e.code == CT_ERR_FORMAT && strstr(e.msg, tpath("prep")) &&
              strstr(e.msg, "no meta.json") && strstr(e.msg, "interrupted `ctitan prepare`"),
          "%s", e.msg);
    /* a truncated shard is caught by meta.json's counts */
    CHECK(ds_writer_open(&w, tpath("prep"), 50, 1, &e) == 0, "%s", e.msg);
    ds_writer_sink(w, v, NULL, N, &e);
    ds_writer_finish(w, "text", "tokdir", 256, 259, NULL, 0, NULL, &e);
    ds_writer_free(w);
    CHECK(access(tpath("prep/shard-00002.bin"), F_OK) != 0 && access(tpath("prep/shard-00000.mask"), F_OK) != 0,
          "--overwrite removed the old shards");
    if (truncate(tpath("prep/shard-00001.bin"), 40) != 0) perror("truncate");
    CHECK(!open1("prep", T, 0, 0, 0, 1, &e) && strstr(e.msg, "shard-00001.bin: holds 10 tokens"), "%s", e.msg);
}

/* meta.json of DIR with KEY set to VAL (a JSON value; NULL: removed). */
static void edit_meta(const char *dir, const char *key, const char *val) {
    char name[128];
    snprintf(name, sizeof name, "%s/meta.json", dir);
    FILE *f = fopen(tpath(name), "rb");
    char buf[8192];
    size_t n = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[n] = 0;
    cJSON *j = cJSON_Parse(buf);
    if (!j) {
        fprintf(stderr, "cannot parse %s\n", tpath(name));
        exit(1);
    }
    cJSON_DeleteItemFromObjectCaseSensitive(j, key);
    if (val) cJSON_AddItemToObject(j, key, cJSON_Parse(val));
    char *text = cJSON_Print(j);
    write_str(name, text);
    free(text);
    cJSON_Delete(j);
}

static ds *open_vocab(const char *name, int vocab, ct_err *e) {
    ds_config c;
    ds_config_default(&c);
    c.seq_len = 9;
    c.vocab_size = vocab;
    c.quiet = 1;
    const char *p = tpath(name);
    ds *d = NULL;
    if (ds_open(&d, &p, 1, NULL, &c, e)) return NULL;
    return d;
}

/* A prepare that stops half-way must not leave anything the loader reads as
 * data, and a meta.json that disagrees with its shards or the model is a
 * format error naming the file, the key and both values. */
static void test_prepare_integrity(void) {
    enum { N = 100 };
    uint32_t v[N];
    uint8_t m[N];
    for (int i = 0; i < N; i++) v[i] = (uint32_t)i, m[i] = 1;
    ct_err e = {0};
    ds_writer *w;
    /* while writing: whole shards under their names, the open one as .tmp */
    CHECK(ds_writer_open(&w, tpath("ip"), 17, 0, &e) == 0, "%s", e.msg);
    CHECK(ds_writer_sink(w, v, NULL, 40, &e) == 0, "%s", e.msg);
    struct stat st;
    CHECK(stat(tpath("ip/shard-00001.bin"), &st) == 0 && st.st_size == 17 * 4, "shard 1 whole under its name");
    CHECK(access(tpath("ip/shard-00002.bin"), F_OK) != 0 && access(tpath("ip/shard-00002.bin.tmp"), F_OK) == 0,
          "the open shard is written as shard-00002.bin.tmp");
    CHECK(access(tpath("ip/meta.json"), F_OK) != 0, "no meta.json before finish");
    /* a kill now leaves exactly this: refused, naming the directory */
    CHECK(!open_vocab("ip", 0, &e) && e.code == CT_ERR_FORMAT && strstr(e.msg, tpath("ip")) &&
              strstr(e.msg, "interrupted `ctitan prepare`"),
          "%s", e.msg);
    /* a failed run frees without finishing: the unfinished shard goes */
    ds_writer_free(w);
    CHECK(access(tpath("ip/shard-00002.bin.tmp"), F_OK) != 0 && access(tpath("ip/shard-00001.bin"), F_OK) == 0,
          "free removed the .tmp and kept the whole shards");
    CHECK(!open_vocab("ip", 0, &e) && strstr(e.msg, "interrupted `ctitan prepare`"), "%s", e.msg);
    /* a kill inside the first shard leaves only its .tmp */
    mkdir(tpath("ip1"), 0777);
    write_iota("ip1/shard-00000.bin.tmp", 30);
    CHECK(!open_vocab("ip1", 0, &e) && strstr(e.msg, "interrupted `ctitan prepare`") &&
              strstr(e.msg, "shard-00000.bin.tmp"),
          "%s", e.msg);

    /* a finished one loads, and each field that disagrees is named */
    CHECK(ds_writer_open(&w, tpath("ip"), 17, 1, &e) == 0, "%s", e.msg);
    CHECK(ds_writer_sink(w, v, m, N, &e) == 0, "%s", e.msg);
    ds_progress ps = {.docs = 2, .tokens = N, .trainable = N};
    CHECK(ds_writer_finish(w, "chat", "tokdir", 256, 259, NULL, 0, &ps, &e) == 0, "%s", e.msg);
    ds_writer_free(w);
    ds *d = open_vocab("ip", 259, &e);
    CHECK(d && ds_num_tokens(d) == N, "%s", e.msg);
    ds_close(d);
    static const struct {
        const char *key, *val, *want;
        int vocab;
    } bad[] = {
        {"total_tokens", "5", "total_tokens is 5, but its 6 shard(s) hold 100 tokens", 259},
        {"total_tokens", "\"100\"", "total_tokens: expected a non-negative integer", 259},
        {"trainable_tokens", "101", "trainable_tokens is 101, more than the 100 tokens", 259},
        {"eos_id", "99999", "eos_id is 99999, outside its own vocab_size 259", 259},
        {"eos_id", "258.5", "eos_id: expected a non-negative integer", 259},
        {"eos_id", "258", "eos_id is 258, outside the model's vocabulary (size 200)", 0},
        {"vocab_size", "100000", "vocab_size is 100000, larger than the model's vocabulary (size 259)", 259},
        {"masked", "false", "masked is false, but 6 of its 6 shard(s) list a \"mask\" file", 259},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        edit_meta("ip", bad[i].key, bad[i].val);
        /* vocab 0 in the table: the model's is 200, meta.json's own removed */
        if (!bad[i].vocab) edit_meta("ip", "vocab_size", NULL);
        d = open_vocab("ip", bad[i].vocab ? bad[i].vocab : 200, &e);
        CHECK(!d && e.code == CT_ERR_FORMAT && strstr(e.msg, tpath("ip/meta.json")) && strstr(e.msg, bad[i].want),
              "%s = %s: %s", bad[i].key, bad[i].val, d ? "opened" : e.msg);
        ds_close(d);
        /* back to the writer's values */
        edit_meta("ip", "total_tokens", "100");
        edit_meta("ip", "trainable_tokens", "100");
        edit_meta("ip", "eos_id", "256");
        edit_meta("ip", "vocab_size", "259");
        edit_meta("ip", "masked", "true");
    }
    d = open_vocab("ip", 259, &e);
    CHECK(d, "restored meta.json opens: %s", e.msg);
    ds_close(d);
    /* masked: true with a shard listing no mask */
    edit_meta("ip", "masked", "true");
    edit_meta("ip", "shards", "[{\"file\": \"shard-00000.bin\", \"tokens\": 17}]");
    edit_meta("ip", "total_tokens", "17");
    edit_meta("ip", "trainable_tokens", "17");
    d = open_vocab("ip", 259, &e);
    CHECK(!d && strstr(e.msg, "masked is true, but 1 of its 1 shard(s) list no \"mask\" file"), "%s",
          d ? "opened" : e.msg);
    ds_close(d);
}

/* Text sources through the loader are tokenized at open. */
static void test_open_text(const tok *t) {
    write_str("w.txt", "abcdefg");
    write_str("x.jsonl", "{\"text\": \"hij\"}\n");
    ds_config c;
    ds_config_default(&c);
    c.seq_len = 3;
    c.quiet = 1;
    const char *p[] = {tpath("w.txt"), tpath("x.jsonl"), tpath("iota.bin")};
    ds *d = NULL;
    ct_err e = {0};
    CHECK(ds_open(&d, p, 3, t, &c, &e) == 0, "%s", e.msg);
    if (!d) return;
    /* a b c d e f g EOT h i j EOT 0 1 2 ... */
    CHECK(ds_num_tokens(d) == 12 + 10 * 8 + 3, "%llu tokens", (unsigned long long)ds_num_tokens(d));
    int32_t in[9], lab[9];
    ds_next(d, in, lab, 3);
    int32_t want_in[9] = {'a', 'b', 'c', 'e', 'f', 'g', 'h', 'i', 'j'};
    int32_t want_lab[9] = {'b', 'c', 'd', 'f', 'g', EOT, 'i', 'j', EOT};
    CHECK(!memcmp(in, want_in, sizeof in) && !memcmp(lab, want_lab, sizeof lab), "text then tokens: %d %d %d", in[0],
          in[3], lab[8]);
    ds_close(d);
    /* the same as a config string, the tokenizer loaded from its directory */
    char list[2048];
    snprintf(list, sizeof list, "%s,,%s,%s", p[0], p[1], p[2]);
    c.tokenizer_dir = tmpdir;
    CHECK(ds_open_list(&d, list, NULL, &c, &e) == 0, "%s", e.msg);
    if (d) {
        int32_t in2[9], lab2[9];
        ds_next(d, in2, lab2, 3);
        CHECK(ds_num_tokens(d) == 12 + 10 * 8 + 3 && !memcmp(in2, want_in, sizeof in2) && !memcmp(lab2, want_lab, sizeof lab2),
              "ds_open_list: %llu tokens", (unsigned long long)ds_num_tokens(d));
        ds_close(d);
    }
    c.tokenizer_dir = NULL;
    c.vocab_size = 200;
    CHECK(ds_open(&d, p, 1, t, &c, &e) && strstr(e.msg, "w.txt") && strstr(e.msg, "tokenizer does not match"), "%s",
          e.msg);
    c.vocab_size = 0;
    CHECK(ds_open(&d, p, 1, NULL, &c, &e) && strstr(e.msg, "needs a tokenizer"), "%s", e.msg);
}

/* ds_digest, which the ranks compare (train/trainer_ckpt.c): of what the windows
 * hold, whatever the files. A stream past 2^20 tokens, so that it is hashed in
 * more than one block (DS_DIGEST_BLOCK), and a tail of 4 tokens no window takes. */
static uint64_t digest_of(const char *name, int T, int *ok) {
    ct_err e = {0};
    ds *d = open1(name, T, 0, 0, 0, 1, &e);
    CHECK(d != NULL, "%s", e.msg);
    *ok &= d != NULL;
    uint64_t h = d ? ds_digest(d) : 0;
    ds_close(d);
    return h;
}

static void test_digest(void) {
    enum { T = 9, NW = 110000, N = NW * (T + 1) + 4, CUT = (1 << 20) - 3 };
    uint32_t *v = malloc((size_t)N * sizeof *v);
    uint8_t *m = malloc(N);
    for (size_t i = 0; i < N; i++) v[i] = (uint32_t)(i * 7919 % 50000);
    memset(m, 1, N);
    write_file("dg.bin", v, (size_t)N * 4);
    int ok = 1;
    uint64_t h = digest_of("dg.bin", T, &ok);
    /* the same stream cut into two files mid-window, just before the second block */
    mkdir(tpath("dg_cut"), 0777);
    write_file("dg_cut/p0.bin", v, (size_t)CUT * 4);
    write_file("dg_cut/p1.bin", v + CUT, (size_t)(N - CUT) * 4);
    CHECK(digest_of("dg_cut", T, &ok) == h, "the same tokens cut into two files");
    /* with a mask of all ones: every token a target, as without one */
    mkdir(tpath("dg_mask"), 0777);
    write_file("dg_mask/a.bin", v, (size_t)N * 4);
    write_file("dg_mask/a.mask", m, N);
    CHECK(digest_of("dg_mask", T, &ok) == h, "a mask of all ones");
    /* the tail no window takes: left out */
    write_file("dg_short.bin", v, (size_t)(N - 4) * 4);
    CHECK(digest_of("dg_short.bin", T, &ok) == h, "without the tail");
    v[N - 1] ^= 1;
    write_file("dg_tail.bin", v, (size_t)N * 4);
    CHECK(digest_of("dg_tail.bin", T, &ok) == h, "another tail");
    v[N - 1] ^= 1;
    /* one token, in the first block and in the last */
    const size_t at[] = {5, CUT + 10, NW * (T + 1) - 1};
    for (size_t k = 0; k < sizeof at / sizeof *at; k++) {
        v[at[k]] += 1;
        write_file("dg_one.bin", v, (size_t)N * 4);
        CHECK(digest_of("dg_one.bin", T, &ok) != h, "token %zu changed", at[k]);
        v[at[k]] -= 1;
    }
    /* one mask byte */
    m[CUT + 10] = 0;
    write_file("dg_mask/a.mask", m, N);
    CHECK(digest_of("dg_mask", T, &ok) != h, "a mask byte changed");
    /* a window's first token is never a target (labels are tokens 1 .. T): its mask byte
     * trains nothing, so copies that differ there hold the same data */
    m[CUT + 10] = 1;
    m[(size_t)(CUT / (T + 1) + 3) * (T + 1)] = 0;
    write_file("dg_mask/a.mask", m, N);
    CHECK(digest_of("dg_mask", T, &ok) == h, "a window's first mask byte changed");
    /* the same tokens as other windows: one window fewer */
    write_file("dg_less.bin", v, (size_t)(N - 4 - (T + 1)) * 4);
    CHECK(digest_of("dg_less.bin", T, &ok) != h, "one window fewer");
    CHECK(ok, "every file opened");
    free(v);
    free(m);
}

int main(void) {
    snprintf(tmpdir, sizeof tmpdir, "/tmp/ctitan_test_dataset_XXXXXX");
    if (!mkdtemp(tmpdir)) {
        perror("mkdtemp");
        return 1;
    }
    tok *t = make_tokenizer("", 0);
    test_chat(t);
    test_sources(t);
    test_packing();
    test_shuffle_and_shards();
    test_shuffle_uniform();
    test_state();
    test_shards();
    test_prepare_integrity();
    test_open_text(t);
    test_digest();
    tok_free(t);
    nftw(tmpdir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    return CHECK_DONE();
}
