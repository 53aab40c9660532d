/* data/chat.c: ChatML rendering, tokenization and loss mask (see chat.h). */
#include "data/chat.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

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

int chat_is_trainable_role(const chat_msg *m) {
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

int chat_from_json(const void *json_object, chat_msg **msgs, int *n, ct_err *e) {
    const cJSON *root = json_object;
    *msgs = NULL;
    *n = 0;
    if (!cJSON_IsObject(root)) return ct_fail(e, CT_ERR_FORMAT, "expected a JSON object with a \"messages\" list");
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(root, "messages");
    if (!list) return ct_fail(e, CT_ERR_FORMAT, "no \"messages\" field");
    if (!cJSON_IsArray(list)) return ct_fail(e, CT_ERR_FORMAT, "messages: expected a list of {role, content}");
    int count = cJSON_GetArraySize(list);
    if (count == 0) return ct_fail(e, CT_ERR_FORMAT, "messages: empty list");
    chat_msg *out = ct_calloc((size_t)count, sizeof *out);
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, list) {
        if (!cJSON_IsObject(it)) {
            free(out);
            return ct_fail(e, CT_ERR_FORMAT, "messages[%d]: expected an object {role, content}", i);
        }
        const cJSON *role = cJSON_GetObjectItemCaseSensitive(it, "role");
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(it, "content");
        const char *bad = !cJSON_IsString(role) ? "role" : !cJSON_IsString(content) ? "content" : NULL;
        if (bad) {
            const cJSON *v = !strcmp(bad, "role") ? role : content;
            free(out);
            return ct_fail(e, CT_ERR_FORMAT, "messages[%d].%s: %s", i, bad,
                           v ? "expected a string" : "missing");
        }
        out[i] = (chat_msg){role->valuestring, strlen(role->valuestring), content->valuestring,
                            strlen(content->valuestring)};
        i++;
    }
    *msgs = out;
    *n = count;
    return 0;
}
