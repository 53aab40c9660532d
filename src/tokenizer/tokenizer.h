/* tokenizer/tokenizer.h: the BPE tokenizers of Hugging Face tokenizer.json
 * files: byte-level (Qwen2/Qwen3, Llama 3, OLMo-2, tekken) and
 * SentencePiece-style with byte fallback (Mistral 7B, Llama 2, Phi-3,
 * Gemma 3).
 *
 * Reads a Hugging Face tokenizer directory (tokenizer.json, or
 * vocab.json + merges.txt, plus tokenizer_config.json when present) and
 * reproduces `tokenizers.Tokenizer.encode(text).ids` token for token:
 * added tokens matched on the raw text first, the normalizer, the
 * pre-tokenizer, BPE merges lowest rank first, then the template's special
 * tokens. Stages it does not reproduce exactly are refused at load time.
 * See docs/tokenizer.md for what is supported and how HF edge cases map.
 *
 * Threading: a `tok` is immutable after tok_load and may be shared by any
 * number of threads. Encoding needs scratch space and a word cache, which
 * live in a `tok_enc`; give each thread its own. */
#ifndef CT_TOKENIZER_H
#define CT_TOKENIZER_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

typedef struct tok tok;
typedef struct tok_enc tok_enc;

/* A growable id buffer. tok_encode appends, so a caller can pack many
 * documents into one buffer; zero-initialise it and free with tok_ids_free. */
typedef struct {
    int32_t *v;
    size_t n, cap;
} tok_ids;

/* Loads `dir`: tokenizer.json if present, else vocab.json + merges.txt
 * (assuming the Qwen2 normalizer and pre-tokenizer); tokenizer_config.json
 * is read when present for bos/eos/pad and added_tokens_decoder. */
int tok_load(const char *dir, tok **out, ct_err *e);
/* Same, naming the files directly; config_json and, for the fallback,
 * the two files may be NULL where not used. */
int tok_load_files(const char *tokenizer_json, const char *vocab_json, const char *merges_txt,
                   const char *config_json, tok **out, ct_err *e);
void tok_free(tok *t);

/* Number of ids: one past the largest id of the vocab and added tokens
 * (HF get_vocab_size(with_added_tokens=True) when ids have no holes). */
int32_t tok_vocab_size(const tok *t);
/* Id of a token by its vocabulary string (added-token content such as
 * "<|im_end|>", or the byte-level form such as "\xc4\xa0world" for
 * " world"); -1 when absent. */
int32_t tok_token_id(const tok *t, const char *token);
/* Vocabulary string of an id (NUL-terminated, owned by t); NULL if unused. */
const char *tok_id_to_token(const tok *t, int32_t id);
/* 1 if id is an added token marked special. */
int tok_is_special(const tok *t, int32_t id);
/* Ids named by tokenizer_config.json (bos_token, eos_token, pad_token);
 * -1 when not set. */
int32_t tok_bos_id(const tok *t);
int32_t tok_eos_id(const tok *t);
int32_t tok_pad_id(const tok *t);

tok_enc *tok_enc_new(const tok *t);
void tok_enc_free(tok_enc *enc);
/* HF's encode_special_tokens: when on, added tokens marked special are
 * not recognised in the text and are tokenized as plain text (use for raw
 * web text that may contain "<|im_end|>"). Off by default, as in HF. */
void tok_enc_set_encode_special(tok_enc *enc, int on);
/* HF's add_special_tokens: when on (the default, as in HF's encode), each
 * tok_encode call adds the special tokens of the post-processor's
 * TemplateProcessing `single` template around the text (Llama 3's
 * <|begin_of_text|>, Mistral's <s>, Gemma's <bos>). Tokenizers without a
 * template (Qwen) add nothing either way. Turn it off to encode a fragment
 * of a larger text (a chat turn). */
void tok_enc_set_add_special(tok_enc *enc, int on);
int tok_enc_add_special(const tok_enc *enc);

/* Encodes `len` bytes of `text` (need not be NUL-terminated; may contain
 * NUL) and APPENDS the ids to `out`. Invalid UTF-8 is read as Python's
 * bytes.decode("utf-8", "replace") reads it: each maximal invalid
 * subsequence becomes U+FFFD. With add_special on, the template's special
 * tokens are appended around the text's ids (even for empty text, as in
 * HF). Fails only on a regex engine error. */
int tok_encode(tok_enc *enc, const char *text, size_t len, tok_ids *out, ct_err *e);
/* Debugging and test aid: the pre-tokenizer's words of `text` without
 * added-token matching. The text is repaired and normalized as tok_encode
 * does; *norm and *norm_len receive that text (owned by enc, valid until its
 * next call) and `ends` gets the end offset of each word in it. */
int tok_pretokenize(tok_enc *enc, const char *text, size_t len, tok_ids *ends, const char **norm,
                    size_t *norm_len, ct_err *e);

/* The byte range [start[i], end[i]) of `text` that token ids[i] covers, for
 * the n ids tok_encode gave for text with add_special off (an added token's
 * range excludes whitespace its lstrip/rstrip swallowed; a marker the
 * normalizer prepended covers nothing). Fails, naming the token, where a
 * token's string does not map back onto the text (an NFC normalizer that
 * changed it, an unknown token), rather than guess. */
int tok_offsets(const tok *t, const char *text, size_t len, const int32_t *ids, size_t n, size_t *start,
                size_t *end, ct_err *e);

/* One-shot convenience: fresh encoder, result in a new malloc'd array. */
int tok_encode_once(const tok *t, const char *text, size_t len, int32_t **ids, size_t *n,
                    ct_err *e);

/* Decodes ids to bytes (HF ByteLevel decoder, before its lossy UTF-8
 * conversion: the result may be invalid UTF-8 when a sequence is cut in
 * the middle of a character). *out is malloc'd and NUL-terminated (the
 * terminator not counted in *len). Unknown ids are skipped, as in HF;
 * special tokens are skipped when skip_special is set. */
void tok_decode(const tok *t, const int32_t *ids, size_t n, int skip_special, char **out,
                size_t *len);

void tok_ids_push(tok_ids *ids, int32_t id);
void tok_ids_free(tok_ids *ids);

/* The GPT-2 byte-to-unicode table used by the byte-level stages:
 * tok_byte_char(b) is the code point that stands for byte b, and
 * tok_char_byte(cp) inverts it (-1 for a code point that stands for none). */
uint32_t tok_byte_char(uint8_t b);
int tok_char_byte(uint32_t cp);

#endif
