/* tests/fuzz/fuzz_tok.h: the small fixed byte-level BPE tokenizer the
 * tokenizer targets load: the 256 byte characters, a few merges, three
 * special tokens, Qwen2's split regex, the ByteLevel decoder and no
 * normalizer (so decoding gives back exactly the bytes encoded). */
#ifndef CT_FUZZ_TOK_H
#define CT_FUZZ_TOK_H

#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

#define FZ_QWEN_REGEX                                                                                          \
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\\\r\\\\n\\\\p{L}\\\\p{N}]?\\\\p{L}+|\\\\p{N}| ?[^\\\\s\\\\p{L}\\\\p{N}]+[\\\\r\\\\n]*|" \
    "\\\\s*[\\\\r\\\\n]+|\\\\s+(?!\\\\S)|\\\\s+"

/* Appends "\uXXXX..." for the byte characters of s (each byte of s mapped
 * through tok_byte_char), as a JSON string. */
static inline size_t fz_put_bytes(char *out, const char *s) {
    size_t k = 0;
    out[k++] = '"';
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        k += (size_t)sprintf(out + k, "\\u%04x", (unsigned)tok_byte_char(*p));
    out[k++] = '"';
    out[k] = 0;
    return k;
}

/* The tokenizer.json text, malloc'd. */
static inline char *fz_tokenizer_json(void) {
    static const char *merges[][2] = {{" ", "t"}, {"h", "e"}, {"t", "h"}, {"i", "n"}, {" ", "a"}, {"e", "r"},
                                      {" t", "he"}};
    char *j = ct_malloc(64 * 1024);
    size_t k = (size_t)sprintf(j,
                               "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \"added_tokens\": ["
                               "{\"id\": 263, \"content\": \"<|endoftext|>\", \"special\": true, \"normalized\": false},"
                               "{\"id\": 264, \"content\": \"<|im_start|>\", \"special\": true, \"normalized\": false},"
                               "{\"id\": 265, \"content\": \"<|im_end|>\", \"special\": true, \"normalized\": false}],"
                               "\"normalizer\": null, \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": ["
                               "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"" FZ_QWEN_REGEX "\"}, "
                               "\"behavior\": \"Isolated\", \"invert\": false},"
                               "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": false, "
                               "\"use_regex\": false}]}, \"post_processor\": null,"
                               "\"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
                               "\"trim_offsets\": false, \"use_regex\": false},"
                               "\"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
                               "\"fuse_unk\": false, \"byte_fallback\": false, \"vocab\": {");
    char one[2] = {0, 0};
    for (int b = 0; b < 256; b++) {
        one[0] = (char)b;
        if (b == 0) { /* an empty C string: write U+0100, tok_byte_char(0) */
            k += (size_t)sprintf(j + k, "\"\\u%04x\": 0", (unsigned)tok_byte_char(0));
            continue;
        }
        j[k++] = ',';
        k += fz_put_bytes(j + k, one);
        k += (size_t)sprintf(j + k, ": %d", b);
    }
    for (size_t m = 0; m < sizeof merges / sizeof *merges; m++) {
        char both[8];
        snprintf(both, sizeof both, "%s%s", merges[m][0], merges[m][1]);
        j[k++] = ',';
        k += fz_put_bytes(j + k, both);
        k += (size_t)sprintf(j + k, ": %d", 256 + (int)m);
    }
    k += (size_t)sprintf(j + k, "}, \"merges\": [");
    for (size_t m = 0; m < sizeof merges / sizeof *merges; m++) {
        if (m) j[k++] = ',';
        j[k++] = '[';
        k += fz_put_bytes(j + k, merges[m][0]);
        j[k++] = ',';
        k += fz_put_bytes(j + k, merges[m][1]);
        j[k++] = ']';
    }
    sprintf(j + k, "]}}\n");
    return j;
}

#endif
