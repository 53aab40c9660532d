/* data/chat.c: ChatML rendering, tokenization and loss mask (see chat.h). */
#include "data/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sys/stat.h>

#include <cjson/cJSON.h>

#include "data/jinja.h"
#include "formats/json.h"
#include "hub/hub.h"

static const char IM_START[] = "<|im_start|>";
static const char IM_END[] = "<|im_end|>";

void chat_mask_push(chat_mask *m, uint8_t v, size_t count) {
    if (m->n + count > m->cap) {
        size_t cap = m->cap ? m->cap : 256;
        while (cap < m->n + count) cap *= 2;
        uint8_t *p = realloc(m->v, cap);
        if (!p) {
            fprintf(stderr, "ctitan: error: out of memory growing a loss mask to %zu bytes\n", cap);
            exit(1);
        }
        m->v = p;
        m->cap = cap;
    }
    memset(m->v + m->n, v, count);
    m->n += count;
}

void chat_mask_free(chat_mask *m) {
    free(m->v);
    memset(m, 0, sizeof *m);
}

/* 1 when the turn's content is a training target (role "assistant"). */
static int chat_is_trainable_role(const chat_msg *m) {
    return m->role_len == 9 && !memcmp(m->role, "assistant", 9);
}

static void put(char **p, const char *s, size_t n) {
    memcpy(*p, s, n);
    *p += n;
}

void chat_render(const chat_msg *msgs, int n, char **out, size_t *len) {
    size_t total = 1;
    for (int i = 0; i < n; i++)
        total += sizeof IM_START - 1 + msgs[i].role_len + 1 + msgs[i].content_len + sizeof IM_END - 1 + 1;
    char *buf = ct_malloc(total), *p = buf;
    for (int i = 0; i < n; i++) {
        put(&p, IM_START, sizeof IM_START - 1);
        put(&p, msgs[i].role, msgs[i].role_len);
        put(&p, "\n", 1);
        put(&p, msgs[i].content, msgs[i].content_len);
        put(&p, IM_END, sizeof IM_END - 1);
        put(&p, "\n", 1);
    }
    *p = 0;
    *out = buf;
    *len = (size_t)(p - buf);
}

/* Byte length of one token as the ByteLevel decoder gives it back: the
 * length it covers in the (normalized) text. */
static size_t token_bytes(const tok *t, int32_t id) {
    char *s = NULL;
    size_t n = 0;
    tok_decode(t, &id, 1, 0, &s, &n);
    free(s);
    return n;
}

int chat_encode(tok_enc *enc, const tok *t, const chat_msg *msgs, int n, tok_ids *ids, chat_mask *mask,
                ct_err *e) {
    int32_t start = tok_token_id(t, IM_START), end = tok_token_id(t, IM_END);
    if (start < 0 || end < 0)
        return ct_fail(e, CT_ERR_FORMAT, "tokenizer has no %s token: it cannot encode ChatML conversations",
                       start < 0 ? IM_START : IM_END);
    char *seg = NULL;
    size_t cap = 0;
    int rc = 0;
    /* the turns are fragments of one rendered text: no BOS before each (as
     * apply_chat_template, which tokenizes with add_special_tokens=False) */
    int add_special = tok_enc_add_special(enc);
    tok_enc_set_add_special(enc, 0);
    for (int i = 0; i < n && !rc; i++) {
        const chat_msg *m = &msgs[i];
        int train = chat_is_trainable_role(m);
        tok_ids_push(ids, start);
        chat_mask_push(mask, 0, 1);

        /* "{role}\n{content}" is one piece of HF's split (no special token
         * inside it unless the data has one, which HF would match too). */
        size_t head = m->role_len + 1, len = head + m->content_len;
        if (len + 1 > cap) {
            free(seg);
            cap = len + 1;
            seg = ct_malloc(cap);
        }
        memcpy(seg, m->role, m->role_len);
        seg[m->role_len] = '\n';
        memcpy(seg + head, m->content, m->content_len);
        size_t n0 = ids->n;
        if ((rc = tok_encode(enc, seg, len, ids, e))) break;
        size_t k = n0;
        if (train) {
            /* Tokens that end inside the header are not targets; the first
             * token reaching past it overlaps the content and is one, and so is
             * everything after it. The header "assistant\n" is ASCII and
             * "\n" never composes under NFC, so decoded lengths up to the
             * boundary equal the raw header bytes. */
            size_t at = 0;
            while (k < ids->n) {
                at += token_bytes(t, ids->v[k]);
                if (at > head) break;
                k++;
            }
        } else {
            k = ids->n;
        }
        chat_mask_push(mask, 0, k - n0);
        chat_mask_push(mask, 1, ids->n - k);

        tok_ids_push(ids, end);
        chat_mask_push(mask, train ? 1 : 0, 1);
        n0 = ids->n;
        if ((rc = tok_encode(enc, "\n", 1, ids, e))) break;
        chat_mask_push(mask, 0, ids->n - n0);
    }
    free(seg);
    tok_enc_set_add_special(enc, add_special);
    return rc;
}

int chat_encode_loss(tok_enc *enc, const tok *t, const chat_msg *msgs, int n, int assistant_only, tok_ids *ids,
                     chat_mask *mask, ct_err *e) {
    size_t m0 = mask->n;
    int rc = chat_encode(enc, t, msgs, n, ids, mask, e);
    if (!rc && !assistant_only) memset(mask->v + m0, 1, mask->n - m0);
    return rc;
}

/* The turns of list (the field `name` of a record) into out[at ...]; the list was
 * checked to be an array. */
static int msgs_from_list(const cJSON *list, const char *name, chat_msg *out, ct_err *e) {
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, list) {
        if (!cJSON_IsObject(it))
            return ct_fail(e, CT_ERR_FORMAT, "%s[%d]: expected an object {role, content}", name, i);
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        const char *bad = !cJSON_IsString(role) ? "role" : !cJSON_IsString(content) ? "content" : NULL;
        if (bad) {
            const cJSON *v = !strcmp(bad, "role") ? role : content;
            if (!v && (cJSON_GetObjectItemCaseSensitive(it, "from") || cJSON_GetObjectItemCaseSensitive(it, "value")))
                return strcmp(name, "messages")
                           /* the prompt-completion lists: a recipe that keeps the layout */
                           ? ct_fail(e, CT_ERR_FORMAT,
                                     "%s[%d].%s: missing; \"from\"/\"value\" turns are read under \"conversations\" "
                                     "only (as TRL): rename them with jq -c '(.prompt, .completion)[] |= {role: "
                                     "({\"human\": \"user\", \"gpt\": \"assistant\"}[.from] // .from), content: .value}' "
                                     "IN.jsonl > OUT.jsonl",
                                     name, i, bad)
                           : ct_fail(e, CT_ERR_FORMAT, "%s[%d].%s: missing; \"from\"/\"value\" turns are %s", name, i,
                                     bad, CHAT_SHAREGPT_HINT);
            if (cJSON_IsArray(v) && !strcmp(bad, "content"))
                return ct_fail(e, CT_ERR_FORMAT,
                               "%s[%d].content: expected a string, got a list (content as a list of parts, "
                               "[{\"type\": \"text\", \"text\": ...}], is not read): give each message's content "
                               "as one string, e.g. jq -c '.%s[].content |= (if type == \"array\" then "
                               "map(.text // \"\") | join(\"\") else . end)' IN.jsonl > OUT.jsonl",
                               name, i, name);
            return ct_fail(e, CT_ERR_FORMAT, "%s[%d].%s: %s (expected {\"role\": string, \"content\": string})", name,
                           i, bad, v ? "expected a string" : "missing");
        }
        out[i] = (chat_msg){role->valuestring, strlen(role->valuestring), content->valuestring,
                            strlen(content->valuestring)};
        i++;
    }
    return 0;
}

/* The non-empty list of turns `name` of root, or an error saying what is there instead. */
static int turn_list(const cJSON *root, const char *name, const cJSON **list, ct_err *e) {
    *list = cJSON_GetObjectItemCaseSensitive(root, name);
    if (!*list) return ct_fail(e, CT_ERR_FORMAT, "no \"%s\" field", name);
    if (!cJSON_IsArray(*list))
        return ct_fail(e, CT_ERR_FORMAT, "%s: expected a list of %s", name,
                       strcmp(name, "conversations") ? "{role, content}" : "{from, value}");
    if (!cJSON_GetArraySize(*list)) return ct_fail(e, CT_ERR_FORMAT, "%s: empty list", name);
    return 0;
}

int chat_from_json(const void *json_object, chat_msg **msgs, int *n, ct_err *e) {
    const cJSON *root = json_object;
    *msgs = NULL;
    *n = 0;
    if (!cJSON_IsObject(root)) return ct_fail(e, CT_ERR_FORMAT, "expected a JSON object with a \"messages\" list");
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!list) {
        const cJSON *prompt = cJSON_GetObjectItemCaseSensitive(root, "prompt");
        const char *other = cJSON_IsArray(prompt) ? "\"prompt\" (a conversational prompt-completion record)"
                            : cJSON_GetObjectItemCaseSensitive(root, "conversations")
                                ? "\"conversations\" (a ShareGPT record)"
                                : NULL;
        if (other)
            return ct_fail(e, CT_ERR_FORMAT,
                           "no \"messages\" field: this line has %s; a file is read in one layout, the one its "
                           "first record has: put these records in a file of their own",
                           other);
        if (prompt)
            return ct_fail(e, CT_ERR_FORMAT,
                           "no \"messages\" field: {\"prompt\", \"completion\"} is TRL's prompt-completion "
                           "format, read as jsonl data (kind auto or jsonl, not chat), with the loss on the "
                           "completion only (docs/data.md)");
        return ct_fail(e, CT_ERR_FORMAT, "no \"messages\" field");
    }
    int rc = turn_list(root, "messages", &list, e);
    if (rc) return rc;
    int count = cJSON_GetArraySize(list);
    chat_msg *out = ct_calloc((size_t)count, sizeof *out);
    if ((rc = msgs_from_list(list, "messages", out, e))) {
        free(out);
        return rc;
    }
    *msgs = out;
    *n = count;
    return 0;
}

chat_layout chat_layout_of(const void *json_object) {
    const cJSON *j = json_object;
    if (!cJSON_IsObject(j) || cJSON_GetObjectItemCaseSensitive(j, "messages")) return CHAT_MESSAGES;
    if (cJSON_GetObjectItemCaseSensitive(j, "conversations")) return CHAT_SHAREGPT;
    if (cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(j, "prompt"))) return CHAT_PROMPT_COMPLETION;
    return CHAT_MESSAGES;
}

/* Renames key `from` of object o to `to`, as Python's o[to] = o.pop(from): the item
 * moves to the end, or, where `to` is already there, takes its value in its place
 * (as the dict assignment keeps an existing key's position). */
static void rename_key(cJSON *o, const char *from, const char *to) {
    cJSON *v = cJSON_DetachItemFromObjectCaseSensitive(o, from);
    if (v && !cJSON_ReplaceItemInObjectCaseSensitive(o, to, v)) cJSON_AddItemToObject(o, to, v);
}

/* trl/data_utils.py's maybe_convert_to_chatml on a record of a ShareGPT file: every
 * turn's "from" becomes "role" and "value" "content", and "conversations" becomes
 * "messages". ShareGPT's role names "human" and "gpt" are refused (CHAT_SHAREGPT_ROLES_HINT),
 * and so is a turn without the two strings: TRL would render whatever it is left with. */
static int sharegpt_convert(cJSON *root, ct_err *e) {
    if (cJSON_GetObjectItemCaseSensitive(root, "messages"))
        return ct_fail(e, CT_ERR_FORMAT,
                       "\"messages\" in a ShareGPT file (its first record has \"conversations\"): a file is read "
                       "in one layout, the one its first record has: put these records in a file of their own");
    if (!cJSON_GetObjectItemCaseSensitive(root, "conversations"))
        return ct_fail(e, CT_ERR_FORMAT,
                       "no \"conversations\" field (a ShareGPT file, as its first record has \"conversations\": "
                       "every line needs it)");
    const cJSON *list;
    int rc = turn_list(root, "conversations", &list, e);
    if (rc) return rc;
    int i = 0;
    cJSON *it;
    cJSON_ArrayForEach(it, list) {
        const cJSON *from = cJSON_IsObject(it) ? cJSON_GetObjectItemCaseSensitive(it, "from") : NULL;
        const cJSON *value = cJSON_IsObject(it) ? cJSON_GetObjectItemCaseSensitive(it, "value") : NULL;
        if (!cJSON_IsObject(it))
            return ct_fail(e, CT_ERR_FORMAT, "conversations[%d]: expected an object {from, value}", i);
        const char *bad = !cJSON_IsString(from) ? "from" : !cJSON_IsString(value) ? "value" : NULL;
        if (bad) {
            const cJSON *v = bad[0] == 'f' ? from : value;
            if (!v && cJSON_GetObjectItemCaseSensitive(it, bad[0] == 'f' ? "role" : "content"))
                return ct_fail(e, CT_ERR_FORMAT,
                               "conversations[%d].%s: missing (a ShareGPT turn is {\"from\": string, \"value\": "
                               "string}; role/content turns belong under \"messages\")",
                               i, bad);
            return ct_fail(e, CT_ERR_FORMAT,
                           "conversations[%d].%s: %s (expected {\"from\": string, \"value\": string})%s", i, bad,
                           v ? "expected a string" : "missing",
                           cJSON_IsArray(v) ? "; content as a list of parts is not read" : "");
        }
        if (!strcmp(from->valuestring, "human") || !strcmp(from->valuestring, "gpt"))
            return ct_fail(e, CT_ERR_FORMAT,
                           "conversations[%d].from: \"%s\" is ShareGPT's role name; TRL (maybe_convert_to_chatml) "
                           "keeps role names as they are, so the chat template would see role \"%s\" (ChatML "
                           "writes <|im_start|>%s, Qwen3's template nothing at all)%s: %s",
                           i, from->valuestring, from->valuestring, from->valuestring,
                           from->valuestring[0] == 'g' ? " and the reply would be no target" : "",
                           CHAT_SHAREGPT_ROLES_HINT);
        i++;
    }
    cJSON_ArrayForEach(it, list) {
        rename_key(it, "from", "role");
        rename_key(it, "value", "content");
    }
    rename_key(root, "conversations", "messages");
    return 0;
}

/* apply_chat_template's own arguments: TRL spreads a record's chat_template_kwargs into
 * its call, so there they would set the call's arguments (or clash with the ones TRL
 * passes), not template variables. */
static const char *const CALL_ARGS[] = {"conversation", "messages", "tools", "documents", "chat_template",
                                        "add_generation_prompt", "continue_final_message", "tokenize",
                                        "return_dict", "return_assistant_tokens_mask", "padding", "truncation",
                                        "max_length", "return_tensors", "tokenizer_kwargs",
                                        "sanitize_control_tokens"};

/* A record's "tools" and "chat_template_kwargs", as TRL's tokenize_fn takes them
 * (trl 1.16.0, trl/trainer/sft_trainer.py): tools given as a string is JSON text
 * (json.loads), replaced here in the record by what it holds; then null (None), or a
 * list of JSON schemas (objects), which transformers hands the template as they are.
 * chat_template_kwargs is null or an object of template variables. */
static int record_vars_check(cJSON *root, ct_err *e) {
    cJSON *tools = cJSON_GetObjectItemCaseSensitive(root, "tools");
    if (cJSON_IsString(tools)) {
        ct_err je = {0};
        cJSON *v = json_parse(tools->valuestring, strlen(tools->valuestring), "tools", &je);
        if (!v)
            return ct_fail(e, CT_ERR_FORMAT, "tools: a string that is not JSON (a string \"tools\" is read as "
                           "JSON text, as TRL's json.loads reads it): %s", je.msg);
        cJSON_ReplaceItemInObjectCaseSensitive(root, "tools", v);
        tools = v;
    }
    if (tools && !cJSON_IsNull(tools)) {
        if (!cJSON_IsArray(tools))
            return ct_fail(e, CT_ERR_FORMAT,
                           "tools: expected a list of tool schemas ({\"type\": \"function\", \"function\": "
                           "{...}}), or null");
        int i = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, tools) {
            if (!cJSON_IsObject(it))
                return ct_fail(e, CT_ERR_FORMAT,
                               "tools[%d]: expected a JSON schema (an object), as transformers' "
                               "apply_chat_template takes a tool",
                               i);
            i++;
        }
    }
    const cJSON *kw = cJSON_GetObjectItemCaseSensitive(root, "chat_template_kwargs"), *it;
    if (!kw || cJSON_IsNull(kw)) return 0;
    if (!cJSON_IsObject(kw))
        return ct_fail(e, CT_ERR_FORMAT,
                       "chat_template_kwargs: expected an object of chat template variables (e.g. "
                       "{\"enable_thinking\": false}), as TRL passes it to apply_chat_template(**kwargs)");
    cJSON_ArrayForEach(it, kw) {
        for (size_t i = 0; i < sizeof CALL_ARGS / sizeof *CALL_ARGS; i++)
            if (!strcmp(it->string, CALL_ARGS[i]))
                return ct_fail(e, CT_ERR_FORMAT,
                               "chat_template_kwargs.%s: an argument of apply_chat_template itself, not a "
                               "template variable%s",
                               it->string,
                               !strcmp(it->string, "tools") ? ": give the tools as the record's \"tools\"" : "");
    }
    return 0;
}

int chat_record(void *json_object, chat_layout layout, chat_msg **msgs, int *n, int *n_prompt, ct_err *e) {
    cJSON *root = json_object;
    *msgs = NULL;
    *n = *n_prompt = 0;
    if (layout == CHAT_SHAREGPT) {
        if (!cJSON_IsObject(root))
            return ct_fail(e, CT_ERR_FORMAT, "expected a JSON object with a \"conversations\" list");
        int rc = sharegpt_convert(root, e);
        if (rc) return rc;
    }
    if (cJSON_IsObject(root)) {
        int rc = record_vars_check(root, e);
        if (rc) return rc;
    }
    if (layout != CHAT_PROMPT_COMPLETION) return chat_from_json(root, msgs, n, e);
    if (!cJSON_IsObject(root))
        return ct_fail(e, CT_ERR_FORMAT, "expected a JSON object with \"prompt\" and \"completion\" lists");
    const cJSON *p, *c;
    if (cJSON_GetObjectItemCaseSensitive(root, "messages") || cJSON_GetObjectItemCaseSensitive(root, "conversations"))
        return ct_fail(e, CT_ERR_FORMAT,
                       "this line has \"%s\" (a file is read in one layout, the one its first record has, here "
                       "conversational prompt-completion: put these records in a file of their own)",
                       cJSON_GetObjectItemCaseSensitive(root, "messages") ? "messages" : "conversations");
    for (int k = 0; k < 2; k++) {
        const char *name = k ? "completion" : "prompt";
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(root, name);
        if (v && !cJSON_IsArray(v))
            return ct_fail(e, CT_ERR_FORMAT,
                           "\"%s\" is not a list of messages (a conversational prompt-completion file, as its "
                           "first record's \"prompt\" is a list: every line needs \"prompt\" and \"completion\" "
                           "lists; TRL reads a file in the layout of its first record too)",
                           name);
        if (!v)
            return ct_fail(e, CT_ERR_FORMAT,
                           "\"%s\" field missing (a conversational prompt-completion file: every line needs "
                           "\"prompt\" and \"completion\" lists of messages)",
                           name);
    }
    int rc = turn_list(root, "prompt", &p, e);
    if (!rc) rc = turn_list(root, "completion", &c, e);
    if (rc) return rc;
    int np = cJSON_GetArraySize(p), nc = cJSON_GetArraySize(c);
    chat_msg *out = ct_calloc((size_t)(np + nc), sizeof *out);
    if ((rc = msgs_from_list(p, "prompt", out, e)) || (rc = msgs_from_list(c, "completion", out + np, e))) {
        free(out);
        return rc;
    }
    *msgs = out;
    *n = np + nc;
    *n_prompt = np;
    return 0;
}

/* ------------------------------------------------------------ templates */

struct chat_tmpl {
    jinja_chat *jc;
    int gen; /* the template marks replies with {% generation %} */
};

/* What a record hands the template beside its messages: its "tools" and its
 * "chat_template_kwargs" (record_vars_check), NULL where absent or null. */
typedef struct {
    const cJSON *tools, *kwargs;
} rec_vars;

static rec_vars vars_of(const cJSON *record) {
    rec_vars v = {NULL, NULL};
    if (!cJSON_IsObject(record)) return v;
    v.tools = cJSON_GetObjectItemCaseSensitive(record, "tools");
    v.kwargs = cJSON_GetObjectItemCaseSensitive(record, "chat_template_kwargs");
    if (cJSON_IsNull(v.tools)) v.tools = NULL;
    if (cJSON_IsNull(v.kwargs)) v.kwargs = NULL;
    return v;
}

/* apply_chat_template(list, tools=..., add_generation_prompt=gen, **kwargs), rendered. */
static int apply(const chat_tmpl *c, rec_vars v, const cJSON *list, int gen, char **out, size_t *n, jinja_spans *sp,
                 ct_err *e) {
    return jinja_chat_apply_tools(c->jc, list, gen, v.tools, v.kwargs, out, n, sp, e);
}

int chat_record_fits(const chat_tmpl *c, const void *record, ct_err *e) {
    if (c) return 0;
    rec_vars v = vars_of(record);
    const char *what = cJSON_GetArraySize(v.tools) ? "tools" : cJSON_GetArraySize(v.kwargs) ? "chat_template_kwargs" : NULL;
    if (!what) return 0;
    return ct_fail(e, CT_ERR_CONFIG,
                   "%s: the built-in ChatML renders none (it writes role and content only; chat_template "
                   "\"auto\" takes it for a tokenizer whose template is ChatML or absent): render this data with "
                   "the tokenizer's own template, training.chat_template = \"tokenizer\" (prepare "
                   "--chat-template tokenizer), which receives each record's tools and chat_template_kwargs as "
                   "TRL passes them",
                   what);
}

void chat_tmpl_close(chat_tmpl *c) {
    if (!c) return;
    jinja_chat_close(c->jc);
    free(c);
}

const char *chat_tmpl_file(const chat_tmpl *c) { return jinja_chat_file(c->jc); }

/* A template is ChatML when a user turn renders with <|im_start|>: the
 * built-in path already renders that format exactly, without a system prompt
 * a template may inject. */
static int renders_chatml(const jinja_chat *jc) {
    cJSON *m = cJSON_CreateArray(), *u = cJSON_CreateObject();
    cJSON_AddStringToObject(u, "role", "user");
    cJSON_AddStringToObject(u, "content", "x");
    cJSON_AddItemToArray(m, u);
    char *out = NULL;
    size_t n = 0;
    ct_err e = {0};
    int chatml = !jinja_chat_apply(jc, m, 0, &out, &n, NULL, &e) && strstr(out, IM_START);
    free(out);
    cJSON_Delete(m);
    return chatml;
}

int chat_tmpl_open(const char *spec, const char *tokenizer_dir, chat_tmpl **out, ct_err *e) {
    *out = NULL;
    if (!spec || !spec[0]) spec = "auto";
    if (!strcmp(spec, "chatml")) return 0;
    int own = !strcmp(spec, "auto") || !strcmp(spec, "tokenizer");
    jinja_chat *jc = NULL;
    int rc;
    if (own) {
        if (!tokenizer_dir || !tokenizer_dir[0]) {
            if (spec[0] == 'a') return 0;
            return ct_fail(e, CT_ERR_CONFIG, "chat_template = \"tokenizer\": no tokenizer directory to take it from");
        }
        rc = jinja_chat_open(tokenizer_dir, &jc, e);
    } else {
        struct stat st;
        if (stat(spec, &st))
            return ct_fail(e, CT_ERR_CONFIG,
                           "chat_template = \"%s\": no such file or directory (expected auto, chatml, tokenizer, a "
                           ".jinja file or a tokenizer directory)",
                           spec);
        rc = S_ISDIR(st.st_mode) ? jinja_chat_open(spec, &jc, e) : jinja_chat_open_file(spec, tokenizer_dir, &jc, e);
        own = S_ISDIR(st.st_mode);
    }
    if (rc) return rc;
    if (!jc) {
        if (!strcmp(spec, "auto")) return 0; /* no template: ChatML, as before */
        return ct_fail(e, CT_ERR_CONFIG,
                       "chat_template = \"%s\": %s has no chat template (chat_template.jinja, or \"chat_template\" in "
                       "tokenizer_config.json)",
                       spec, own && strcmp(spec, "tokenizer") ? spec : tokenizer_dir);
    }
    if (!strcmp(spec, "auto") && renders_chatml(jc)) {
        jinja_chat_close(jc);
        return 0;
    }
    chat_tmpl *c = ct_calloc(1, sizeof *c);
    c->jc = jc;
    c->gen = jinja_chat_has_generation(jc);
    *out = c;
    return 0;
}

static int is_assistant(const cJSON *m) {
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(m, "role");
    return cJSON_IsString(r) && !strcmp(r->valuestring, "assistant");
}

/* Renders messages [0, k) (references into msgs; nothing is copied twice). */
static int render_prefix(const chat_tmpl *c, rec_vars v, const cJSON *msgs, int k, int gen_prompt, char **out,
                         size_t *n, ct_err *e) {
    cJSON *pre = cJSON_CreateArray();
    const cJSON *it = msgs->child;
    for (int i = 0; i < k && it; i++, it = it->next) cJSON_AddItemReferenceToArray(pre, (cJSON *)it);
    int rc = apply(c, v, pre, gen_prompt, out, n, NULL, e);
    cJSON_Delete(pre);
    return rc;
}

/* Renders messages [0, i] with message i's content emptied. */
static int render_emptied(const chat_tmpl *c, rec_vars v, const cJSON *msgs, int i, char **out, size_t *n,
                          ct_err *e) {
    cJSON *pre = cJSON_CreateArray();
    const cJSON *it = msgs->child;
    for (int k = 0; k < i && it; k++, it = it->next) cJSON_AddItemReferenceToArray(pre, (cJSON *)it);
    cJSON *m = cJSON_Duplicate(it, 1);
    cJSON_ReplaceItemInObjectCaseSensitive(m, "content", cJSON_CreateString(""));
    cJSON_AddItemToArray(pre, m);
    int rc = apply(c, v, pre, 0, out, n, NULL, e);
    cJSON_Delete(pre);
    return rc;
}

static void span_push(jinja_spans *s, size_t a, size_t b) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 8;
        size_t *x = realloc(s->start, (size_t)s->cap * sizeof *x), *y = x ? realloc(s->end, (size_t)s->cap * sizeof *y) : NULL;
        if (!x || !y) {
            fprintf(stderr, "ctitan: error: out of memory locating assistant replies\n");
            exit(1);
        }
        s->start = x;
        s->end = y;
    }
    s->start[s->n] = a;
    s->end[s->n++] = b;
}

/* The byte ranges of the assistant replies in the rendered text T, found as
 * TRL's prefix rule finds a completion: the conversation up to a reply
 * rendered with the generation prompt (P), then with the reply (Q), differ by
 * the reply as the template writes it, its end-of-turn text included. A
 * template whose rendering up to a reply is no prefix of the one with it
 * (Mistral's places the system prompt in the last user turn only) has the
 * reply start where Q parts from the same conversation with the reply's
 * content emptied. Text a template writes only at the end of the whole
 * conversation (Phi-3's eos_token without the generation prompt) is no part
 * of a reply that other turns follow: where Q and the rendering through the
 * next message part, Q's rest is cut when T ends with it too. Where T does
 * not start with Q (earlier turns render differently once later ones
 * follow), the reply's text is looked up in T after the previous reply. */
static int locate_replies(const chat_tmpl *c, rec_vars v, const cJSON *msgs, const char *T, size_t TN,
                          jinja_spans *sp, ct_err *e) {
    size_t cursor = 0;
    int i = 0, rc = 0;
    for (const cJSON *m = msgs->child; m && !rc; m = m->next, i++) {
        if (!is_assistant(m)) continue;
        char *P = NULL, *Q = NULL, *Q0 = NULL;
        size_t PN = 0, QN = 0, Q0N = 0, at = 0;
        if ((rc = render_prefix(c, v, msgs, i, 1, &P, &PN, e)) || (rc = render_prefix(c, v, msgs, i + 1, 0, &Q, &QN, e)))
            goto next;
        if (PN < QN && !memcmp(Q, P, PN)) {
            at = PN;
        } else {
            if ((rc = render_emptied(c, v, msgs, i, &Q0, &Q0N, e))) goto next;
            while (at < QN && at < Q0N && Q[at] == Q0[at]) at++;
            while (at > 0 && at < QN && ((uint8_t)Q[at] & 0xC0) == 0x80) at--; /* a whole character */
            if (at >= QN) {
                rc = ct_fail(e, CT_ERR_FORMAT,
                             "messages[%d]: %s renders nothing for this reply: it cannot be located (give the "
                             "template {%% generation %%} markers, or use chat_template = \"chatml\")",
                             i, chat_tmpl_file(c));
                goto next;
            }
        }
        if (m->next) { /* the conversation's closer, if Q ends with one */
            char *N = NULL;
            size_t NN = 0, k = 0;
            ct_err ne = {0}; /* a template that cannot stop there just cuts nothing */
            if (!render_prefix(c, v, msgs, i + 2, 0, &N, &NN, &ne)) {
                while (k < QN && k < NN && Q[k] == N[k]) k++;
                while (k > at && k < QN && ((uint8_t)Q[k] & 0xC0) == 0x80) k--;
                if (k > at && k < QN && QN - k <= TN && !memcmp(T + TN - (QN - k), Q + k, QN - k)) QN = k;
            }
            free(N);
        }
        if (at >= cursor && QN <= TN && !memcmp(T, Q, QN)) {
            span_push(sp, at, QN);
            cursor = QN;
        } else {
            const char *hit = cursor <= TN ? memmem(T + cursor, TN - cursor, Q + at, QN - at) : NULL;
            if (!hit) {
                rc = ct_fail(e, CT_ERR_FORMAT,
                             "messages[%d]: %s renders this reply differently once later turns follow: it cannot "
                             "be located in the rendered conversation (give the template {%% generation %%} "
                             "markers, or use chat_template = \"chatml\")",
                             i, chat_tmpl_file(c));
                goto next;
            }
            span_push(sp, (size_t)(hit - T), (size_t)(hit - T) + QN - at);
            cursor = (size_t)(hit - T) + QN - at;
        }
    next:
        free(P);
        free(Q);
        free(Q0);
    }
    return rc;
}

/* text[0, n) tokenized as apply_chat_template tokenizes a rendering: without the
 * post-processor's specials (add_special_tokens=False; the template writes its own BOS). */
static int encode_rendered(tok_enc *enc, const char *text, size_t n, tok_ids *ids, ct_err *e) {
    int add_special = tok_enc_add_special(enc);
    tok_enc_set_add_special(enc, 0);
    int rc = tok_encode(enc, text, n, ids, e);
    tok_enc_set_add_special(enc, add_special);
    return rc;
}

/* list (a cJSON array) rendered by the template and tokenized as
 * apply_chat_template(..., tokenize=True) tokenizes it (encode_rendered). */
static int tmpl_ids(const chat_tmpl *c, rec_vars v, tok_enc *enc, const cJSON *list, int gen_prompt, tok_ids *ids,
                    ct_err *e) {
    char *T = NULL;
    size_t TN = 0;
    int rc = apply(c, v, list, gen_prompt, &T, &TN, NULL, e);
    if (!rc) rc = encode_rendered(enc, T, TN, ids, e);
    free(T);
    return rc;
}

int chat_encode_tmpl(const chat_tmpl *c, tok_enc *enc, const tok *t, const void *record, const void *messages_json,
                     int assistant_only, tok_ids *ids, chat_mask *mask, ct_err *e) {
    const cJSON *msgs = messages_json;
    rec_vars v = vars_of(record);
    if (!assistant_only) { /* TRL's assistant_only_loss=False: every token of the rendering */
        size_t n0 = ids->n;
        int rc = tmpl_ids(c, v, enc, msgs, 0, ids, e);
        if (!rc) chat_mask_push(mask, 1, ids->n - n0);
        return rc;
    }
    char *T = NULL;
    size_t TN = 0;
    jinja_spans sp = {0};
    int rc = apply(c, v, msgs, 0, &T, &TN, c->gen ? &sp : NULL, e);
    if (!rc && !c->gen) rc = locate_replies(c, v, msgs, T, TN, &sp, e);
    size_t n0 = ids->n;
    if (!rc) rc = encode_rendered(enc, T, TN, ids, e);
    size_t n = ids->n - n0;
    size_t *start = NULL, *end = NULL;
    if (!rc) {
        start = ct_malloc((n ? n : 1) * sizeof *start);
        end = ct_malloc((n ? n : 1) * sizeof *end);
        rc = tok_offsets(t, T, TN, ids->v + n0, n, start, end, e);
    }
    if (!rc && !c->gen) {
        /* A derived span (locate_replies) can end inside a special token: where the
         * conversation's closer and the next turn's header share a prefix (Phi-3's
         * <|endoftext|> and <|user|> share "<|"), the text alone cannot say where the
         * reply stops, and the cut lands after the shared characters. A special token
         * is one unit the reply's text cannot end inside, so the span ends where that
         * token starts; marked spans ({% generation %}) are the template's own word. */
        int k = 0;
        for (size_t j = 0; j < n && k < sp.n; j++) {
            while (k < sp.n && start[j] >= sp.end[k]) k++;
            if (k < sp.n && start[j] >= sp.start[k] && start[j] < sp.end[k] && end[j] > sp.end[k] &&
                tok_is_special(t, ids->v[n0 + j]))
                sp.end[k] = start[j];
        }
    }
    if (!rc) {
        /* transformers' rule: every token overlapping a span is a target */
        size_t m0 = mask->n;
        chat_mask_push(mask, 0, n);
        int k = 0;
        for (size_t j = 0; j < n; j++) {
            while (k < sp.n && start[j] >= sp.end[k]) k++;
            if (k == sp.n) break;
            if (end[j] > sp.start[k]) mask->v[m0 + j] = 1;
        }
    }
    if (rc) ids->n = n0;
    free(start);
    free(end);
    free(T);
    jinja_spans_free(&sp);
    return rc;
}

/* Appends the generation prompt of ChatML, "<|im_start|>assistant\n", as Qwen2, 2.5
 * and 3's templates (and ChatML templates generally) write it for
 * add_generation_prompt=True, tokenized as apply_chat_template tokenizes (no BOS). */
static int chatml_generation_prompt(tok_enc *enc, const tok *t, tok_ids *ids, ct_err *e) {
    int32_t start = tok_token_id(t, IM_START);
    if (start < 0)
        return ct_fail(e, CT_ERR_FORMAT, "tokenizer has no %s token: it cannot encode ChatML conversations", IM_START);
    tok_ids_push(ids, start);
    return encode_rendered(enc, "assistant\n", 10, ids, e);
}

int chat_encode_pc(const chat_tmpl *c, tok_enc *enc, const tok *t, const void *record, const chat_msg *msgs, int n,
                   int n_prompt, int completion_only, int assistant_only, tok_ids *ids, chat_mask *mask, ct_err *e) {
    tok_ids p = {0};
    chat_mask scratch = {0}; /* chat_encode's assistant mask, where it is not the one kept */
    size_t n0 = ids->n, m0 = mask->n;
    rec_vars v = vars_of(record);
    int rc;
    /* the record's own message objects, their other keys (reasoning_content, ...)
     * included, as TRL hands prompt and prompt + completion to the template */
    cJSON *prompt = cJSON_CreateArray(), *full = cJSON_CreateArray();
    const cJSON *it;
    cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(record, "prompt")) {
        cJSON_AddItemReferenceToArray(prompt, (cJSON *)it);
        cJSON_AddItemReferenceToArray(full, (cJSON *)it);
    }
    cJSON_ArrayForEach(it, cJSON_GetObjectItemCaseSensitive(record, "completion"))
        cJSON_AddItemReferenceToArray(full, (cJSON *)it);
    if (!completion_only) {
        /* TRL's completion_only_loss=False: the completion mask plays no part; the
         * targets are the assistant mask's (assistant_only_loss) or every token */
        rc = c ? chat_encode_tmpl(c, enc, t, record, full, assistant_only, ids, mask, e)
               : chat_encode_loss(enc, t, msgs, n, assistant_only, ids, mask, e);
    } else {
        if (c) {
            rc = tmpl_ids(c, v, enc, prompt, 1, &p, e);
            if (!rc) rc = tmpl_ids(c, v, enc, full, 0, ids, e);
        } else {
            /* TRL renders the prompt with the generation prompt: without it the
             * completion's own "<|im_start|>assistant\n" would be a target */
            rc = chat_encode(enc, t, msgs, n_prompt, &p, &scratch, e);
            if (!rc) rc = chatml_generation_prompt(enc, t, &p, e);
            if (!rc) rc = chat_encode(enc, t, msgs, n, ids, &scratch, e);
        }
        if (!rc) {
            size_t k = 0, nf = ids->n - n0;
            while (k < p.n && k < nf && p.v[k] == ids->v[n0 + k]) k++;
            chat_mask_push(mask, 0, k);
            chat_mask_push(mask, 1, nf - k);
        }
    }
    if (rc) {
        ids->n = n0;
        mask->n = m0;
    }
    cJSON_Delete(prompt);
    cJSON_Delete(full);
    tok_ids_free(&p);
    chat_mask_free(&scratch);
    return rc;
}

/* ------------------------------------------------------------ identity */

int chat_tmpl_identify(const char *spec, const char *tokenizer_dir, chat_tmpl_id *out, ct_err *e) {
    memset(out, 0, sizeof *out);
    if (!spec || !spec[0]) spec = "auto";
    if (!strcmp(spec, "auto") || !strcmp(spec, "chatml") || !strcmp(spec, "tokenizer")) {
        snprintf(out->mode, sizeof out->mode, "%s", spec);
    } else {
        snprintf(out->mode, sizeof out->mode, "path");
        snprintf(out->path, sizeof out->path, "%s", spec);
    }
    chat_tmpl *c = NULL;
    int rc = chat_tmpl_open(spec, tokenizer_dir, &c, e);
    if (rc) return rc;
    if (!c) {
        out->builtin = 1;
        return 0;
    }
    snprintf(out->file, sizeof out->file, "%s", chat_tmpl_file(c));
    size_t n = 0;
    const char *text = jinja_chat_source(c->jc, &n);
    hub_sha256_ctx h;
    uint8_t d[32];
    hub_sha256_init(&h);
    hub_sha256_update(&h, text, n);
    hub_sha256_final(&h, d);
    chat_tmpl_close(c);
    for (int i = 0; i < 32; i++) snprintf(out->sha256 + 2 * i, 3, "%02x", d[i]);
    return 0;
}

void chat_tmpl_id_describe(const chat_tmpl_id *id, char *buf, size_t n) {
    if (id->builtin) snprintf(buf, n, "the built-in ChatML");
    else snprintf(buf, n, "%s (sha256 %s)", id->file, id->sha256);
}
