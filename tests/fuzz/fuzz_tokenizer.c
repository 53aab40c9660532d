/* Feeds: tokenizer.json (models BPE / WordPiece-free subset ctitan loads,
 * normalizers, pre-tokenizers, decoders, added tokens, merges in both forms)
 * to tok_load_files, and for one that loads, encodes and decodes a short
 * fixed text with special tokens.
 * Why: tokenizer.json comes from the Hub; its regexes go to PCRE2, its ids
 * index the vocabulary tables and its merges drive the encoder's loop. */
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

static const char FZ_TEXT[] = "Hello world, <|im_start|>user\nthe 123 caf\xc3\xa9 \xe2\x96\x81" "ab \xff\xfe<|endoftext|>";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *path;
    if (!path) path = fs_join(fz_dir(), "tokenizer.json");
    free(fz_write(fz_dir(), "tokenizer.json", data, size));
    tok *t = NULL;
    ct_err e = {0};
    if (tok_load_files(path, NULL, NULL, NULL, &t, &e) == 0) {
        tok_enc *enc = tok_enc_new(t);
        tok_enc_set_encode_special(enc, 1);
        tok_ids ids = {0};
        if (tok_encode(enc, FZ_TEXT, sizeof FZ_TEXT - 1, &ids, &e) == 0) {
            for (size_t i = 0; i < ids.n; i++)
                if (ids.v[i] < 0 || ids.v[i] >= tok_vocab_size(t)) abort();
            char *out;
            size_t n;
            tok_decode(t, ids.v, ids.n, 1, &out, &n);
            free(out);
        }
        tok_ids_free(&ids);
        tok_enc_free(enc);
        (void)tok_id_to_token(t, tok_vocab_size(t) - 1);
        tok_free(t);
    } else if (!strstr(e.msg, "tokenizer.json")) {
        abort(); /* every error names the file */
    }
    return 0;
}
