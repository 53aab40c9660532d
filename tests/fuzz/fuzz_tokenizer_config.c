/* Feeds: tokenizer_config.json beside a fixed tiny tokenizer.json (no
 * regex to compile, so a run costs the config alone): tok_load reads its bos/eos/pad and added_tokens_decoder,
 * jinja_chat_open its chat_template (a string or a list of named ones) and
 * special tokens, and the template is rendered for a fixed conversation.
 * Why: this file is downloaded with the model and carries a program (the
 * chat template) that `generate --chat` and chat data run. */
#include <cjson/cJSON.h>

#include "data/jinja.h"
#include "fuzz_util.h"
#include "tokenizer/tokenizer.h"

static const char FZ_TOKENIZER[] =
    "{\"added_tokens\": [{\"id\": 4, \"content\": \"<|endoftext|>\", \"special\": true},"
    " {\"id\": 5, \"content\": \"<|im_end|>\", \"special\": true}], \"normalizer\": null,"
    " \"pre_tokenizer\": null, \"decoder\": null, \"model\": {\"type\": \"BPE\","
    " \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2, \"c\": 3}, \"merges\": [[\"a\", \"b\"]]}}";

static const char FZ_CHAT[] =
    "[{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Hi <b>\"},"
    " {\"role\": \"assistant\", \"content\": \"Hello.\"}, {\"role\": \"user\", \"content\": \"Why?\"}]";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *dir;
    static cJSON *chat;
    if (!dir) {
        dir = fs_join(fz_dir(), "tokcfg");
        free(fz_write(dir, "tokenizer.json", FZ_TOKENIZER, sizeof FZ_TOKENIZER - 1));
        chat = cJSON_Parse(FZ_CHAT);
    }
    free(fz_write(dir, "tokenizer_config.json", data, size));
    ct_err e = {0};
    tok *t = NULL;
    if (tok_load(dir, &t, &e) == 0) {
        (void)tok_bos_id(t);
        (void)tok_eos_id(t);
        (void)tok_pad_id(t);
        tok_free(t);
    } else if (!strstr(e.msg, "tokenizer")) {
        abort();
    }
    jinja_chat *c = NULL;
    e = (ct_err){0};
    if (jinja_chat_open(dir, &c, &e) == 0 && c) {
        char *out = NULL;
        size_t n = 0;
        jinja_spans spans = {0};
        if (jinja_chat_apply(c, chat, 1, &out, &n, &spans, &e) == 0) free(out);
        jinja_spans_free(&spans);
        jinja_chat_close(c);
    }
    return 0;
}
