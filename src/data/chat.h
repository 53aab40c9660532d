/* data/chat.h: ChatML rendering and the supervised fine-tuning loss mask.
 *
 * A conversation is rendered as Qwen's ChatML, one turn after another:
 *
 *     <|im_start|>{role}\n{content}<|im_end|>\n
 *
 * which is byte for byte what `tokenizer.apply_chat_template(messages,
 * tokenize=False)` renders with the template
 * `{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] +
 * '<|im_end|>' + '\n'}}{% endfor %}` (no system prompt is injected, no
 * generation prompt is added, no <think> handling: the data says what the
 * model sees).
 *
 * Tokens: chat_encode produces exactly the ids HF's tokenizer gives for the
 * rendered text. <|im_start|> and <|im_end|> are special added tokens, so HF
 * splits the text at them and tokenizes the pieces in between on their own;
 * chat_encode therefore pushes their ids directly and encodes each piece
 * ("{role}\n{content}" and the "\n" after <|im_end|>) separately, which
 * also lets it know where the assistant's content starts without an offset
 * table.
 *
 * Mask: 1 marks a trainable TARGET token: the tokens of an assistant turn's
 * content and its closing <|im_end|>. Everything else (system/user turns,
 * the `<|im_start|>assistant\n` header, the "\n" after <|im_end|>) is 0.
 * A token that straddles the header/content boundary (content starting with
 * a newline merges with the header's "\n" under the Qwen regex) counts as
 * content: that is transformers' rule for `return_assistant_tokens_mask`
 * ("every token overlapping a span"), so the two masks agree exactly. */
#ifndef CT_DATA_CHAT_H
#define CT_DATA_CHAT_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"
#include "tokenizer/tokenizer.h"

/* One turn; the strings need not be NUL-terminated and are not owned. */
typedef struct {
    const char *role;
    size_t role_len;
    const char *content;
    size_t content_len;
} chat_msg;

/* A growable byte buffer (the mask parallel to a tok_ids). Zero-initialise;
 * free with chat_mask_free. */
typedef struct {
    uint8_t *v;
    size_t n, cap;
} chat_mask;

void chat_mask_push(chat_mask *m, uint8_t v, size_t count);
void chat_mask_free(chat_mask *m);

/* 1 when the turn's content is a training target (role "assistant"). */
int chat_is_trainable_role(const chat_msg *m);

/* Renders the ChatML text of the n turns into a malloc'd, NUL-terminated
 * string (*len excludes the terminator). */
void chat_render(const chat_msg *msgs, int n, char **out, size_t *len);

/* Appends the tokens of the rendered conversation to ids and the same number
 * of mask bytes to mask. Fails when the tokenizer has no <|im_start|> or
 * <|im_end|> token (the message names the tokenizer's lack), or on a tokenizer
 * error. */
int chat_encode(tok_enc *enc, const tok *t, const chat_msg *msgs, int n, tok_ids *ids, chat_mask *mask,
                ct_err *e);

/* Reads {"messages": [{"role": str, "content": str}, ...]} from a parsed
 * cJSON object (passed as void * so this header does not pull in cJSON).
 * *msgs is malloc'd and points into the JSON tree, which must outlive it.
 * On error the message names the field ("messages[2].content: expected a
 * string"); the caller prefixes the file and line. */
int chat_from_json(const void *json_object, chat_msg **msgs, int *n, ct_err *e);

#endif
