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

typedef struct chat_tmpl chat_tmpl; /* a chat template (below) */

/* Appends count bytes of value v (exits on out of memory, as the token lists do). */
void chat_mask_push(chat_mask *m, uint8_t v, size_t count);
void chat_mask_free(chat_mask *m);


/* chat_encode, with the loss option: assistant_only 0 makes every token appended a
 * target (TRL's assistant_only_loss=False), as chat_encode_tmpl's does. */
int chat_encode_loss(tok_enc *enc, const tok *t, const chat_msg *msgs, int n, int assistant_only, tok_ids *ids,
                     chat_mask *mask, ct_err *e);

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

/* The layouts of a chat file, decided by its first record as TRL decides by its
 * dataset's first example (trl 1.16.0, trl/trainer/sft_trainer.py, _prepare_dataset):
 *   CHAT_MESSAGES: {"messages": [{"role", "content"}, ...]};
 *   CHAT_SHAREGPT: {"conversations": [{"from", "value"}, ...]}, which TRL turns into
 *     "messages" by renaming the keys alone (trl/data_utils.py, maybe_convert_to_chatml):
 *     "from" becomes "role" and "value" "content", the role names kept as they are;
 *   CHAT_PROMPT_COMPLETION: {"prompt": [messages], "completion": [messages]}, TRL's
 *     conversational prompt-completion layout (chat_encode_pc). */
typedef enum { CHAT_MESSAGES = 0, CHAT_SHAREGPT, CHAT_PROMPT_COMPLETION } chat_layout;

/* The layout a file whose first record is json_object (a cJSON object) is read in: a
 * "messages" field, else "conversations", else a "prompt" list; anything else reads as
 * CHAT_MESSAGES, whose errors then say what the record lacks. */
chat_layout chat_layout_of(const void *json_object);

/* One record of a file in layout `layout` -> its turns (as chat_from_json). A ShareGPT
 * record is converted in place first, as maybe_convert_to_chatml converts it, so that
 * its "messages" is then what the template renders. Every layout may carry what TRL
 * hands apply_chat_template beside the messages (trl 1.16.0, tokenize_fn): "tools" (a
 * list of JSON schemas, or that list as JSON text, parsed here in place; null: none)
 * and "chat_template_kwargs" (an object of template variables, such as Qwen3's
 * enable_thinking; null: none; apply_chat_template's own argument names refused). For CHAT_PROMPT_COMPLETION the
 * turns are the prompt's then the completion's, *n_prompt of them the prompt's
 * (else *n_prompt = 0). Errors name the field ("prompt[1].content: ..."); the caller
 * prefixes the file and line. */
int chat_record(void *json_object, chat_layout layout, chat_msg **msgs, int *n, int *n_prompt, ct_err *e);

/* ShareGPT's own role names. TRL keeps a role name as it is, so a "human" turn
 * renders as role "human" (Qwen3's template writes nothing for it) and a "gpt" reply is
 * no assistant reply: such records are refused with this recipe, which names the roles
 * as chat templates know them. */
#define CHAT_SHAREGPT_ROLES_HINT                                                                                   \
    "name the roles as chat templates know them (user, assistant, system, tool): jq -c '.conversations[].from " \
    "|= ({\"human\": \"user\", \"gpt\": \"assistant\"}[.] // .)' IN.jsonl > OUT.jsonl"

/* ShareGPT's from/value turns anywhere but under "conversations" (TRL converts only a
 * dataset whose records have "conversations": trl/data_utils.py,
 * is_conversational_from_value): the errors that meet them finish with this. */
#define CHAT_SHAREGPT_HINT                                                                                        \
    "ShareGPT's layout, read under \"conversations\" only (as TRL); ctitan reads {\"messages\": [{\"role\": "   \
    "\"user\", \"content\": \"...\"}, ...]}: convert with jq -c '{messages: [(.conversations // .messages)[] | " \
    "{role: ({\"human\": \"user\", \"gpt\": \"assistant\"}[.from] // .from), content: .value}]}' IN.jsonl > "   \
    "OUT.jsonl"

/* A record's tools and chat_template_kwargs need a template to receive them: with the
 * built-in ChatML (c NULL) a record with a non-empty "tools" or "chat_template_kwargs"
 * is refused, naming chat_template = "tokenizer", rather than rendered without them. */
int chat_record_fits(const chat_tmpl *c, const void *record, ct_err *e);

/* TRL's conversational prompt-completion example, as SFTTrainer tokenizes it
 * (trl 1.16.0, _prepare_dataset's tokenize_fn). With completion_only (TRL's
 * completion_only_loss, on by default for this layout): the ids are those of prompt + completion
 * rendered by the chat template (no generation prompt) and tokenized as
 * apply_chat_template tokenizes; the prompt alone is rendered with the generation
 * prompt and tokenized too, and the tokens the two share from the start are no
 * targets, every later one is (the completion starts where they part, so a prompt
 * whose rendering is no prefix of the whole loses its differing end from the
 * prompt, as TRL's common_prefix_length). No EOS belongs to the example (TRL adds
 * none to conversational data). c NULL: the built-in ChatML, whose prompt ends with
 * ChatML's generation prompt, as Qwen's templates write it. Without completion_only the same ids, with
 * the targets of prompt + completion as a conversation: the assistant replies
 * (assistant_only, chat_encode_tmpl's mask) or every token. (TRL with both options on
 * takes the tokens in both masks; ctitan keeps the completion's: see docs/data.md.) msgs/n/n_prompt: chat_record's; record: the cJSON
 * object they came from (its tools and chat_template_kwargs reach the template).
 * Nothing is appended on error. */
int chat_encode_pc(const chat_tmpl *c, tok_enc *enc, const tok *t, const void *record, const chat_msg *msgs, int n,
                   int n_prompt, int completion_only, int assistant_only, tok_ids *ids, chat_mask *mask, ct_err *e);

/* ---------------------------------------------------------- templates
 *
 * Chat data in the model's own format: the conversation rendered by a Jinja
 * chat template (data/jinja.h) exactly as transformers' apply_chat_template
 * renders it, tokenized as it tokenizes it (the whole text, no added BOS),
 * and the mask transformers' return_assistant_tokens_mask gives: every token
 * overlapping an assistant reply is a target. A template with
 * {% generation %} blocks says where the replies are; a published template
 * without them has each reply located as the text its rendering adds to the
 * conversation before it with the generation prompt (TRL's prefix rule),
 * which covers the reply and the end-of-turn text the template writes after
 * it. */

/* spec (training.chat_template, prepare --chat-template):
 *   "auto" (also NULL, ""): tokenizer_dir's template, unless it has none or it
 *           renders ChatML (writes <|im_start|>): then *out = NULL, the
 *           built-in ChatML above;
 *   "chatml": *out = NULL;
 *   "tokenizer": tokenizer_dir's template, an error when it has none;
 *   a path: a .jinja file (special tokens from tokenizer_dir's
 *           tokenizer_config.json), or a directory holding the template. */
int chat_tmpl_open(const char *spec, const char *tokenizer_dir, chat_tmpl **out, ct_err *e);
void chat_tmpl_close(chat_tmpl *c);
const char *chat_tmpl_file(const chat_tmpl *c);

/* Like chat_encode, for messages_json (the cJSON "messages" array, passed as
 * void *), rendered with record's "tools" and "chat_template_kwargs" (record: the
 * cJSON object chat_record checked, or NULL). assistant_only 0 (TRL's
 * assistant_only_loss=False): every token is a target, and no reply is located.
 * Errors: the template fails to render (its message), a reply that
 * cannot be located, tokens that cannot be aligned with the text. Nothing is
 * appended on error. Safe to call from many threads on one chat_tmpl. */
int chat_encode_tmpl(const chat_tmpl *c, tok_enc *enc, const tok *t, const void *record, const void *messages_json,
                     int assistant_only, tok_ids *ids, chat_mask *mask, ct_err *e);

/* Which template a spec renders with, recorded by `ctitan prepare` in
 * meta.json ("chat_template") and compared by the loader when a trainer
 * names a template explicitly for prepared data: a prepared dataset's
 * tokens and masks already follow the template it was prepared with, so a
 * different one named at train time would silently not apply. The identity
 * is the template text (sha256); the special tokens it is rendered with
 * come from the tokenizer, which meta.json records on its own. */
typedef struct {
    char mode[16];    /* the spec's kind: "auto", "chatml", "tokenizer" or "path" */
    char path[4096];  /* mode "path": the spec */
    int builtin;      /* the built-in ChatML renders (no template text) */
    char file[4400];  /* else where the text was read ("<dir>/tokenizer_config.json (chat_template)") */
    char sha256[65];  /* else the text's sha256, lowercase hex; "" for the built-in ChatML */
} chat_tmpl_id;

/* The spec as chat_tmpl_open resolves it (its errors). */
int chat_tmpl_identify(const char *spec, const char *tokenizer_dir, chat_tmpl_id *out, ct_err *e);
/* "the built-in ChatML" or "FILE (sha256 HEX)", for messages. */
void chat_tmpl_id_describe(const chat_tmpl_id *id, char *buf, size_t n);

#endif
