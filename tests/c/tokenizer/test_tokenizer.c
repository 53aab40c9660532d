/* tests/c/tokenizer/test_tokenizer.c: unit tests of src/tokenizer with expectations
 * derived by hand (the token-for-token comparison with Hugging Face on a
 * real Qwen3 tokenizer lives in tests/py/test_tokenizer_hf.py).
 *
 * The tiny tokenizer written here has vocab a b G(=space) ab aa Gab aab
 * (ids 0-6) plus the bytes of U+00E9 (7, 8) and U+FFFD (9-11), merges in
 * rank order (a b) (a a) (G ab) (aa b), and one added token <|end|> (12). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "tokenizer/tokenizer.h"

static char dir[64];

static void write_file(const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); exit(1); }
    fputs(text, f);
    fclose(f);
}

static void remove_file(const char *name) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    remove(path);
}

/* JSON escapes keep this file ASCII: \u0120 is the byte-level space,
 * \u00c3 \u00a9 the two bytes of U+00E9, \u00ef \u00bf \u00bd those of U+FFFD. */
#define VOCAB                                                                              \
    "{\"a\": 0, \"b\": 1, \"\\u0120\": 2, \"ab\": 3, \"aa\": 4, \"\\u0120ab\": 5, \"aab\": 6, " \
    "\"\\u00c3\": 7, \"\\u00a9\": 8, \"\\u00ef\": 9, \"\\u00bf\": 10, \"\\u00bd\": 11}"
#define QWEN_REGEX                                                                   \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| "    \
    "?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+"

static const char *TOKENIZER_JSON =
    "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null,\n"
    " \"added_tokens\": [{\"id\": 12, \"content\": \"<|end|>\", \"single_word\": false, \"lstrip\": false,"
    "   \"rstrip\": false, \"normalized\": false, \"special\": true}],\n"
    " \"normalizer\": {\"type\": \"NFC\"},\n"
    " \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": ["
    "   {\"type\": \"Split\", \"pattern\": {\"Regex\": \"" QWEN_REGEX "\"}, \"behavior\": \"Isolated\", \"invert\": false},"
    "   {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false}]},\n"
    " \"post_processor\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false},\n"
    " \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false},\n"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": \"\","
    "   \"end_of_word_suffix\": \"\", \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,"
    "   \"vocab\": " VOCAB ",\n"
    "   \"merges\": [[\"a\", \"b\"], \"a a\", [\"\\u0120\", \"ab\"], [\"aa\", \"b\"]]}}\n";

static char *edit(const char *from, const char *to);

static int ids_eq(const int32_t *got, size_t n, const int32_t *want, size_t m) {
    return n == m && (m == 0 || !memcmp(got, want, m * sizeof *want));
}

#define ENC(t, str, ...)                                                                     \
    do {                                                                                     \
        int32_t want_[] = {__VA_ARGS__};                                                     \
        int32_t *got_;                                                                       \
        size_t n_;                                                                           \
        ct_err e_ = {0};                                                                     \
        int rc_ = tok_encode_once(t, str, sizeof(str) - 1, &got_, &n_, &e_);                 \
        CHECK(rc_ == 0 && ids_eq(got_, n_, want_ + 1, sizeof want_ / sizeof *want_ - 1),     \
              "encode(\"%s\") gave %zu ids, first %d", str, n_, n_ ? got_[0] : -1);          \
        free(got_);                                                                          \
    } while (0)

static void test_byte_table(void) {
    int seen[512] = {0}, bijective = 1;
    for (int b = 0; b < 256; b++) {
        uint32_t c = tok_byte_char((uint8_t)b);
        if (c >= 512 || seen[c]++ || tok_char_byte(c) != b) bijective = 0;
    }
    CHECK(bijective, "byte table is not a bijection with an exact inverse");
    /* Known GPT-2 values: space is U+0120 'G-dot', newline U+010A, NUL U+0100,
     * printable ASCII and Latin-1 stand for themselves, DEL U+0121, SHY U+0143. */
    CHECK(tok_byte_char(' ') == 0x120, "space -> %#x", tok_byte_char(' '));
    CHECK(tok_byte_char('\n') == 0x10A, "newline -> %#x", tok_byte_char('\n'));
    CHECK(tok_byte_char(0) == 0x100, "NUL -> %#x", tok_byte_char(0));
    CHECK(tok_byte_char('!') == '!' && tok_byte_char('~') == '~', "ASCII maps to itself");
    CHECK(tok_byte_char(0xA1) == 0xA1 && tok_byte_char(0xFF) == 0xFF, "Latin-1 maps to itself");
    CHECK(tok_byte_char(0x7F) == 0x121 && tok_byte_char(0xAD) == 0x143, "DEL, SHY");
    CHECK(tok_char_byte('A') == 'A' && tok_char_byte(' ') == -1 && tok_char_byte(0x144) == -1 &&
              tok_char_byte(0x4E00) == -1,
          "inverse of chars outside the table");
}

static void test_tiny(void) {
    tok *t;
    ct_err e = {0};
    write_file("tokenizer.json", TOKENIZER_JSON);
    int rc = tok_load(dir, &t, &e);
    CHECK(rc == 0, "load: %s", e.msg);
    if (rc) return;
    CHECK(tok_vocab_size(t) == 13, "vocab size %d", tok_vocab_size(t));
    CHECK(tok_token_id(t, "<|end|>") == 12 && tok_token_id(t, "ab") == 3 && tok_token_id(t, "zz") == -1,
          "token ids");
    CHECK(tok_is_special(t, 12) && !tok_is_special(t, 3), "special flag");
    CHECK(tok_eos_id(t) == -1, "no tokenizer_config.json: no eos");
    /* a leading 0 in each list is a placeholder: the macro drops it */
    ENC(t, "ab", 0, 3);
    ENC(t, "aab", 0, 0, 3);      /* (a b) outranks (a a): a|ab, never aa|b -> aab */
    ENC(t, "aaab", 0, 4, 3);     /* a a ab, then aa ab */
    ENC(t, "aaaa", 0, 4, 4);     /* equal ranks merge leftmost first */
    ENC(t, " ab", 0, 5);         /* G a b -> G ab -> Gab */
    ENC(t, "ab ab", 0, 3, 5);
    ENC(t, "zab", 0, 3);         /* z is not in the vocab and there is no unk: dropped */
    ENC(t, "ab<|end|>ab", 0, 3, 12, 3);
    ENC(t, "<|end|><|end|>", 0, 12, 12);
    ENC(t, "<|end|", 0);                     /* not the added token; its bytes are not in the vocab */
    ENC(t, "e\xcc\x81", 0, 7, 8);            /* NFC: e + U+0301 -> U+00E9 = bytes C3 A9 */
    ENC(t, "\xff", 0, 9, 10, 11);           /* invalid byte -> U+FFFD = EF BF BD */
    ENC(t, "\xe2\x82", 0, 9, 10, 11);       /* truncated sequence: one U+FFFD */
    ENC(t, "\xed\xa0\x80", 0, 9, 10, 11, 9, 10, 11, 9, 10, 11); /* surrogate: three */
    ENC(t, "", 0);
    tok_free(t);

    /* HF ignores the id written in added_tokens and takes the next free one */
    char *moved = edit("[{\"id\": 12,", "[{\"id\": 40,");
    write_file("tokenizer.json", moved);
    free(moved);
    rc = tok_load(dir, &t, &e);
    CHECK(rc == 0 && tok_token_id(t, "<|end|>") == 12 && tok_vocab_size(t) == 13, "restated id: %s", e.msg);
    if (rc) return;

    /* decode: ids back to bytes; specials kept or skipped */
    int32_t ids[] = {5, 12, 0, 7, 8, 99, -1};
    char *out;
    size_t n;
    tok_decode(t, ids, 7, 0, &out, &n);
    CHECK(n == 13 && !memcmp(out, " ab<|end|>a\xc3\xa9", 13), "decode: %s", out);
    free(out);
    tok_decode(t, ids, 7, 1, &out, &n);
    CHECK(n == 6 && !memcmp(out, " aba\xc3\xa9", 6), "decode skip_special: %s", out);
    free(out);

    /* a 100000-byte word (past the cache's word limit) */
    size_t big = 100000;
    char *text = malloc(big);
    memset(text, 'a', big);
    tok_enc *enc = tok_enc_new(t);
    tok_ids got = {0};
    rc = tok_encode(enc, text, big, &got, &e);
    int all_aa = rc == 0 && got.n == big / 2;
    for (size_t i = 0; all_aa && i < got.n; i++) all_aa = got.v[i] == 4;
    CHECK(all_aa, "long word: %zu ids", got.n);
    /* the encoder appends; encode_special turns <|end|> into plain bytes (dropped here) */
    size_t before = got.n;
    tok_enc_set_encode_special(enc, 1);
    rc = tok_encode(enc, "ab<|end|>ab", 11, &got, &e);
    CHECK(rc == 0 && got.n == before + 2 && got.v[before] == 3 && got.v[before + 1] == 3,
          "encode_special: %zu new ids", got.n - before);
    /* pre-tokenizer words: the Qwen regex keeps one space for the next word */
    tok_ids ends = {0};
    const char *norm;
    size_t norm_len;
    rc = tok_pretokenize(enc, "Hello  world\n\n", 14, &ends, &norm, &norm_len, &e);
    int32_t want_ends[] = {5, 6, 12, 14};
    CHECK(rc == 0 && ids_eq(ends.v, ends.n, want_ends, 4) && norm_len == 14, "words: %zu", ends.n);
    tok_ids_free(&ends);
    tok_ids_free(&got);
    tok_enc_free(enc);
    free(text);
    tok_free(t);
}

static void test_vocab_merges_fallback(void) {
    remove_file("tokenizer.json");
    write_file("vocab.json", VOCAB);
    /* merges.txt holds the raw U+0120; CRLF line ends are accepted as HF does */
    write_file("merges.txt", "#version: 0.2\r\na b\r\na a\n\xc4\xa0 ab\naa b\n");
    write_file("tokenizer_config.json",
               "{\"added_tokens_decoder\": {\"12\": {\"content\": \"<|end|>\", \"lstrip\": false, "
               "\"normalized\": false, \"rstrip\": false, \"single_word\": false, \"special\": true}},"
               " \"eos_token\": \"<|end|>\", \"pad_token\": {\"content\": \"ab\"}, \"bos_token\": null}");
    tok *t;
    ct_err e = {0};
    int rc = tok_load(dir, &t, &e);
    CHECK(rc == 0, "fallback load: %s", e.msg);
    if (rc) return;
    ENC(t, "aab ab<|end|>", 0, 0, 3, 5, 12);
    CHECK(tok_eos_id(t) == 12 && tok_pad_id(t) == 3 && tok_bos_id(t) == -1, "config ids");
    tok_free(t);
    remove_file("tokenizer_config.json");
    remove_file("vocab.json");
    remove_file("merges.txt");
}

/* Loads `json` as tokenizer.json and expects a format error naming `field`. */
static void expect_error(const char *json, const char *field) {
    write_file("tokenizer.json", json);
    tok *t = NULL;
    ct_err e = {0};
    int rc = tok_load(dir, &t, &e);
    CHECK(rc == CT_ERR_FORMAT && t == NULL && strstr(e.msg, "tokenizer.json") && strstr(e.msg, field),
          "want error naming %s, got rc %d: %s", field, rc, e.msg);
    tok_free(t);
}

/* TOKENIZER_JSON with its first occurrence of `from` replaced by `to`. */
static char *edit(const char *from, const char *to) {
    const char *p = strstr(TOKENIZER_JSON, from);
    if (!p) { fprintf(stderr, "edit: %s not found\n", from); exit(1); }
    size_t a = (size_t)(p - TOKENIZER_JSON), n = strlen(TOKENIZER_JSON) - strlen(from) + strlen(to);
    char *s = malloc(n + 1);
    memcpy(s, TOKENIZER_JSON, a);
    strcpy(s + a, to);
    strcat(s, p + strlen(from));
    return s;
}

static void test_malformed(void) {
    struct { const char *from, *to, *field; } cases[] = {
        {"{\"version\"", "{{\"version\"", "invalid JSON"},
        {"\"aab\": 6", "\"aab\": 6.5", "model.vocab[\"aab\"]"},
        {"\"aab\": 6", "\"aab\": -6", "model.vocab[\"aab\"]"},
        /* an id written as a float: HF tokenizers refuses it ("invalid type: floating point `6.0`,
         * expected u32"), where cJSON would give 6 */
        {"\"aab\": 6", "\"aab\": 6.0", "model.vocab[\"aab\"]: expected an integer id, got 6.0"},
        {"\"aab\": 6", "\"aab\": 6e0", "model.vocab[\"aab\"]: expected an integer id, got 6.0"},
        {"\"aab\": 6", "\"aab\": 6.5", "model.vocab[\"aab\"]: expected an integer id in [0, "},
        {"\"id\": 12,", "\"id\": 12.0,", "added_tokens[0].id: expected an integer id, got 12.0"},
        {"[\"aa\", \"b\"]", "[\"aa\", \"q\"]", "model.merges[3]"},
        {"[\"aa\", \"b\"]", "[\"b\", \"b\"]", "model.merges[3]"},   /* bb is not in the vocab */
        {"\"a a\"", "\"aa\"", "model.merges[1]"},
        {"\"a a\"", "7", "model.merges[1]"},
        {"\"vocab\": {", "\"vocob\": {", "model.vocab"},
        {"{\"type\": \"NFC\"}", "{\"type\": \"Lowercase\"}", "normalizer"},
        {"\"Isolated\"", "\"MergedWithNext\"", "behavior"},
        {"\"invert\": false", "\"invert\": true", "invert"},
        {"(?i:'s", "((?i:'s", "pattern"},
        {"\"fuse_unk\": false, \"byte_fallback\": false", "\"fuse_unk\": false, \"byte_fallback\": true",
         "model.byte_fallback"},
        {"\"dropout\": null", "\"dropout\": 0.1", "model.dropout"},
        {"\"unk_token\": null", "\"unk_token\": \"<unk>\"", "model.unk_token"},
        {"\"id\": 12,", "\"id\": \"12\",", "added_tokens[0].id"},
        {"\"content\": \"<|end|>\"", "\"content\": \"\"", "added_tokens[0].content"},
        {"\"lstrip\": false", "\"lstrip\": 1", "added_tokens[0].lstrip"},
        {"\"truncation\": null", "\"truncation\": {\"max_length\": 5}", "truncation"},
        {"\"decoder\": {\"type\": \"ByteLevel\"", "\"decoder\": {\"type\": \"WordPiece\"", "decoder"},
        {"\"post_processor\": {\"type\": \"ByteLevel\"", "\"post_processor\": {\"type\": \"TemplateProcessing\"",
         "post_processor"},
        {"\"add_prefix_space\": false, \"trim_offsets\": false, \"use_regex\": false}]}",
         "\"add_prefix_space\": true, \"trim_offsets\": false, \"use_regex\": false}]}", "add_prefix_space"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *s = edit(cases[i].from, cases[i].to);
        expect_error(s, cases[i].field);
        free(s);
    }
    expect_error("[1, 2]", "not a JSON object");
    {   /* ids 0-10 and 12: the added token would take 12 (the vocab count) */
        char *s = edit("\"\\u00bd\": 11", "\"\\u00bd\": 12");
        expect_error(s, "would get id 12, which the vocab already uses");
        free(s);
    }
    expect_error("", "invalid JSON");
    remove_file("tokenizer.json");

    /* vocab.json: an id written as a float, refused as in tokenizer.json */
    tok *t = NULL;
    ct_err e = {0};
    {
        char v[512];
        const char *p = strstr(VOCAB, "\"aab\": 6");
        snprintf(v, sizeof v, "%.*s\"aab\": 6.0%s", (int)(p - VOCAB), VOCAB, p + strlen("\"aab\": 6"));
        write_file("vocab.json", v);
        write_file("merges.txt", "#version: 0.2\na b\n");
        int rc = tok_load(dir, &t, &e);
        CHECK(rc == CT_ERR_FORMAT && t == NULL && strstr(e.msg, "vocab.json: [\"aab\"]: expected an integer id, got 6.0"),
              "vocab.json float id: rc %d: %s", rc, e.msg);
        tok_free(t);
        t = NULL;
    }

    /* merges.txt: a line without exactly one space */
    write_file("vocab.json", VOCAB);
    write_file("merges.txt", "#version: 0.2\na b\na  a\n");
    int rc = tok_load(dir, &t, &e);
    CHECK(rc == CT_ERR_FORMAT && strstr(e.msg, "merges.txt: line 3"), "merges.txt: %s", e.msg);
    write_file("merges.txt", "a b\n");
    write_file("tokenizer_config.json", "{\"eos_token\": \"<|nope|>\"}");
    rc = tok_load(dir, &t, &e);
    CHECK(rc == CT_ERR_FORMAT && strstr(e.msg, "tokenizer_config.json: eos_token"), "config: %s", e.msg);
    write_file("tokenizer_config.json",
               "{\"added_tokens_decoder\": {\"40\": {\"content\": \"<|x|>\", \"special\": true}}}");
    rc = tok_load(dir, &t, &e);
    CHECK(rc == CT_ERR_FORMAT && strstr(e.msg, "added_tokens_decoder[\"40\"]") && strstr(e.msg, "id 12"),
          "config id: %s", e.msg);
    remove_file("tokenizer_config.json");
    remove_file("vocab.json");
    remove_file("merges.txt");
    rc = tok_load(dir, &t, &e);
    CHECK(rc == CT_ERR_IO && strstr(e.msg, "no tokenizer.json"), "empty dir: %s", e.msg);
    /* a directory that is not there is named as such, not as one lacking the files */
    char gone[600];
    snprintf(gone, sizeof gone, "%s/gone", dir);
    rc = tok_load(gone, &t, &e);
    CHECK(rc == CT_ERR_IO && strstr(e.msg, "gone: no such directory") && !strstr(e.msg, "no tokenizer.json"),
          "missing dir: %s", e.msg);
}

/* A SentencePiece-style BPE as Mistral 7B / Llama 2 / Phi-3 publish it:
 * normalizer Prepend + Replace, no pre-tokenizer, byte fallback, fused unk,
 * the decoder chain with Strip, and a template adding <s>. Vocab <unk> <s>
 * </s> (0-2), the byte tokens of U+00E9 (3, 4), then _ a b _a _ab ab (5-10)
 * where _ is U+2581; merges (_ a) (_a b) (a b). */
static const char *SPM_JSON =
    "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null,\n"
    " \"added_tokens\": ["
    "  {\"id\": 0, \"content\": \"<unk>\", \"normalized\": false, \"special\": true},"
    "  {\"id\": 1, \"content\": \"<s>\", \"normalized\": false, \"special\": true},"
    "  {\"id\": 2, \"content\": \"</s>\", \"normalized\": false, \"special\": true}],\n"
    " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"Prepend\", \"prepend\": \"\\u2581\"},"
    "   {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\\u2581\"}]},\n"
    " \"pre_tokenizer\": null,\n"
    " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": [{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}},"
    "   {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}], \"pair\": [],"
    "   \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1], \"tokens\": [\"<s>\"]}}},\n"
    " \"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"Replace\", \"pattern\": {\"String\": \"\\u2581\"},"
    "   \"content\": \" \"}, {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"},"
    "   {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]},\n"
    " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": \"<unk>\", \"fuse_unk\": true, \"byte_fallback\": true,"
    "   \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"<0xC3>\": 3, \"<0xA9>\": 4, \"\\u2581\": 5, \"a\": 6,"
    "     \"b\": 7, \"\\u2581a\": 8, \"\\u2581ab\": 9, \"ab\": 10},\n"
    "   \"merges\": [[\"\\u2581\", \"a\"], [\"\\u2581a\", \"b\"], [\"a\", \"b\"]]}}\n";

#define DEC(t, skip, want, ...)                                                             \
    do {                                                                                    \
        int32_t ids_[] = {__VA_ARGS__};                                                     \
        char *s_;                                                                           \
        size_t n_;                                                                          \
        tok_decode(t, ids_, sizeof ids_ / sizeof *ids_, skip, &s_, &n_);                    \
        CHECK(n_ == sizeof(want) - 1 && !memcmp(s_, want, n_), "decode gave \"%s\"", s_);   \
        free(s_);                                                                           \
    } while (0)

static void test_sentencepiece(void) {
    tok *t;
    ct_err e = {0};
    write_file("tokenizer.json", SPM_JSON);
    int rc = tok_load(dir, &t, &e);
    CHECK(rc == 0, "load: %s", e.msg);
    if (rc) return;
    ENC(t, "ab", 0, 1, 9);            /* <s>, then _ab: (_ a) before (_a b) */
    ENC(t, "ab ab", 0, 1, 9, 9);      /* one word: both (_ a) first, leftmost first */
    ENC(t, " ab", 0, 1, 5, 9);        /* Prepend then Replace: two _ */
    ENC(t, "bab", 0, 1, 5, 7, 10);    /* (a b) is the only merge */
    ENC(t, "\xc3\xa9", 0, 1, 5, 3, 4); /* U+00E9 is not in the vocab: its bytes */
    ENC(t, "z", 0, 1, 5, 0);          /* no <0x7A>: unk */
    ENC(t, "zz", 0, 1, 5, 0);         /* fused */
    ENC(t, "z\xc3\xa9z", 0, 1, 5, 3, 4, 0); /* HF writes a pending unk after byte fallback */
    ENC(t, "<s>ab", 0, 1, 1, 9);      /* the piece after an added token is not at the start... */
    ENC(t, "a</s>b", 0, 1, 8, 2, 5, 7); /* ...but Prepend applies to every piece */
    ENC(t, "", 0, 1);                 /* the template even for empty text, as HF */
    tok_enc *enc = tok_enc_new(t);
    tok_enc_set_add_special(enc, 0);
    tok_ids ids = {0};
    rc = tok_encode(enc, "ab", 2, &ids, &e);
    CHECK(rc == 0 && ids.n == 1 && ids.v[0] == 9, "add_special off");
    tok_ids_free(&ids);
    tok_enc_free(enc);
    DEC(t, 0, "<s> ab ab", 1, 9, 9);  /* Strip takes one leading space of the whole text */
    DEC(t, 1, "ab ab", 1, 9, 9);
    DEC(t, 0, " a", 5, 5, 6);
    DEC(t, 0, "\xc3\xa9", 3, 4);      /* byte tokens join into the character */
    DEC(t, 0, "\xef\xbf\xbd\xef\xbf\xbd", 3, 3); /* an invalid run: U+FFFD per byte */
    DEC(t, 0, "<unk>a", 0, 6);
    tok_free(t);

    /* Metaspace("first", no split) instead of the normalizer: a space is no
     * longer doubled, and a piece after an added token gets no prefix */
    char *s = malloc(strlen(SPM_JSON) + 256);
    const char *a = strstr(SPM_JSON, " \"normalizer\""), *b = strstr(SPM_JSON, " \"post_processor\"");
    memcpy(s, SPM_JSON, (size_t)(a - SPM_JSON));
    strcpy(s + (a - SPM_JSON), " \"normalizer\": null, \"pre_tokenizer\": {\"type\": \"Metaspace\", \"replacement\":"
                               " \"\\u2581\", \"prepend_scheme\": \"first\", \"split\": false},\n");
    strcat(s, b);
    write_file("tokenizer.json", s);
    free(s);
    rc = tok_load(dir, &t, &e);
    CHECK(rc == 0, "metaspace load: %s", e.msg);
    if (rc) return;
    ENC(t, "ab", 0, 1, 9);
    ENC(t, " ab", 0, 1, 9);
    ENC(t, "a</s>b", 0, 1, 8, 2, 7);
    tok_free(t);

    /* a template with tokens on both sides of $A, one of them spelt with two ids */
    {
        const char *from = "\"single\": [{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}},"
                           "   {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}]";
        const char *to = "\"single\": [{\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}},"
                         " {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}, {\"SpecialToken\": {\"id\": \"</s>\", \"type_id\": 0}}]";
        const char *p = strstr(SPM_JSON, from);
        const char *q = strstr(SPM_JSON, "\"special_tokens\": {");
        if (!p || !q) { fprintf(stderr, "spm template edit not found\n"); exit(1); }
        const char *sp = "\"special_tokens\": {\"</s>\": {\"id\": \"</s>\", \"ids\": [2, 0], \"tokens\": [\"</s>\", \"<unk>\"]}, ";
        char *j = malloc(strlen(SPM_JSON) + strlen(to) + strlen(sp) + 1);
        size_t k = (size_t)(p - SPM_JSON), mid = (size_t)(q - p) - strlen(from);
        memcpy(j, SPM_JSON, k);
        memcpy(j + k, to, strlen(to));
        k += strlen(to);
        memcpy(j + k, p + strlen(from), mid);
        k += mid;
        strcpy(j + k, sp);
        strcat(j, q + strlen("\"special_tokens\": {"));
        write_file("tokenizer.json", j);
        free(j);
        rc = tok_load(dir, &t, &e);
        CHECK(rc == 0, "suffix template load: %s", e.msg);
        if (rc) return;
        ENC(t, "ab", 0, 1, 9, 2, 0);
        ENC(t, "", 0, 1, 2, 0);
        tok_free(t);
    }

    struct { const char *from, *to, *field; } bad[] = {
        {"{\"String\": \" \"}", "{\"Regex\": \" +\"}", "normalizer.normalizers[1].pattern"},
        {"{\"type\": \"Fuse\"}", "{\"type\": \"WordPiece\"}", "decoder.decoders[2].type"},
        {"\"Sequence\": {\"id\": \"A\"", "\"Sequence\": {\"id\": \"B\"", "post_processor.single[1]"},
        {"\"ids\": [1]", "\"ids\": [-1]", "post_processor.special_tokens"},
        /* integers written as floats, which HF tokenizers refuses (no variant of its enums matches) */
        {"\"ids\": [1]", "\"ids\": [1.0]",
         "post_processor.special_tokens[\"<s>\"].ids: expected an integer id, got 1.0"},
        {"\"start\": 1,", "\"start\": 1.0,", "decoder.decoders[3].start/stop: expected counts"},
        {"\"stop\": 0}", "\"stop\": 0.0}", "decoder.decoders[3].start/stop: expected counts"},
        {"\"start\": 1,", "\"start\": 1.5,", "decoder.decoders[3].start/stop: expected counts"},
        {"\"pre_tokenizer\": null", "\"pre_tokenizer\": {\"type\": \"Whitespace\"}", "pre_tokenizer"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        const char *p = strstr(SPM_JSON, bad[i].from);
        if (!p) { fprintf(stderr, "spm edit: %s not found\n", bad[i].from); exit(1); }
        char *j = malloc(strlen(SPM_JSON) + strlen(bad[i].to) + 1);
        memcpy(j, SPM_JSON, (size_t)(p - SPM_JSON));
        strcpy(j + (p - SPM_JSON), bad[i].to);
        strcat(j, p + strlen(bad[i].from));
        expect_error(j, bad[i].field);
        free(j);
    }
    remove_file("tokenizer.json");
}

int main(void) {
    snprintf(dir, sizeof dir, "/tmp/ctitan_tok_XXXXXX");
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    test_byte_table();
    test_tiny();
    test_vocab_merges_fallback();
    test_malformed();
    test_sentencepiece();
    rmdir(dir);
    return CHECK_DONE();
}
