/* Feeds: arbitrary bytes as the text to encode with a fixed small byte-level
 * BPE tokenizer (fuzz_tok.h), with special tokens recognised, then decodes
 * the ids. Valid UTF-8 must come back byte for byte (the tokenizer has no
 * normalizer), and every id must be inside the vocabulary.
 * Why: `ctitan prepare` and the chat data path encode whatever text a
 * corpus holds, invalid UTF-8 and NULs included; the regex split, the byte
 * map and the merge loop all index by what they read. */
#include <utf8proc.h>

#include "fuzz_tok.h"

static int fz_valid_utf8(const uint8_t *s, size_t n) {
    utf8proc_int32_t cp;
    for (size_t i = 0; i < n;) {
        utf8proc_ssize_t k = utf8proc_iterate(s + i, (utf8proc_ssize_t)(n - i), &cp);
        if (k <= 0) return 0;
        i += (size_t)k;
    }
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static tok *t;
    static tok_enc *enc;
    if (!t) {
        char *j = fz_tokenizer_json();
        char *path = fz_write(fz_dir(), "tokenizer.json", j, strlen(j));
        ct_err e = {0};
        if (tok_load_files(path, NULL, NULL, NULL, &t, &e)) {
            fprintf(stderr, "fuzz: the fixed tokenizer does not load: %s\n", e.msg);
            abort();
        }
        free(j);
        free(path);
        enc = tok_enc_new(t);
        tok_enc_set_encode_special(enc, 1);
    }
    tok_ids ids = {0};
    ct_err e = {0};
    if (tok_encode(enc, (const char *)data, size, &ids, &e) == 0) {
        for (size_t i = 0; i < ids.n; i++)
            if (ids.v[i] < 0 || ids.v[i] >= tok_vocab_size(t)) abort();
        char *out;
        size_t n;
        tok_decode(t, ids.v, ids.n, 0, &out, &n);
        if (fz_valid_utf8(data, size) && (n != size || memcmp(out, data, size))) {
            fprintf(stderr, "fuzz: decode(encode(x)) != x for valid UTF-8 of %zu bytes (got %zu)\n", size, n);
            abort();
        }
        free(out);
    }
    tok_ids_free(&ids);
    return 0;
}
