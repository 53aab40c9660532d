/* tokenizer/tok_offsets.c: where each token of an encoding lies in its text.
 *
 * Why: chat data built with a model's own template marks the assistant's
 * replies as byte ranges of the rendered text, and transformers' assistant
 * mask is "every token whose offsets overlap a range". Rather than threading
 * an alignment through every encoding stage, the ids are walked against the
 * text afterwards: each token's string, mapped back through the stages that
 * rewrite text (the ByteLevel byte table, Replace normalizers, Metaspace's
 * replacement, a prepended marker, <0xNN> byte fallback), must be the next
 * bytes of the text. Any token that is not (NFC changing the text, an unknown
 * token) makes the call fail rather than guess. */
#include <string.h>

#include "tokenizer/tok_internal.h"

static int is_space(uint8_t c) { return c == ' ' || (c >= 9 && c <= 13); }

static int hexd(char c) {
    return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

static int hex2(const char *s) {
    int h = hexd(s[0]), l = hexd(s[1]);
    return h < 0 || l < 0 ? -1 : h * 16 + l;
}

/* The string that stands for pat in token strings, for the stages in use. */
typedef struct {
    const char *rep, *pat;
    size_t nrep, npat;
} subst;

/* Matches token string s[0..n) against text[*at..len) for a SentencePiece-style
 * tokenizer; advances *at. */
static int match_sp(const tok *t, const subst *sb, int nsb, const char *prep, size_t nprep, const char *s,
                    size_t n, const char *text, size_t len, size_t *at) {
    size_t j = *at;
    int b = n == 6 && !memcmp(s, "<0x", 3) && s[5] == '>' ? hex2(s + 3) : -1;
    if (t->byte_fallback && b >= 0 && t->fb_id[b] >= 0 && !strcmp(t->pool + t->id_str[t->fb_id[b]], s)) {
        if (j >= len || (uint8_t)text[j] != b) return -1;
        *at = j + 1;
        return 0;
    }
    size_t i = 0;
    /* a marker the normalizer or Metaspace put before the piece covers no text */
    if (nprep && n >= nprep && !memcmp(s, prep, nprep) && !(j < len && text[j] == ' ') &&
        !(j + nprep <= len && !memcmp(text + j, prep, nprep)))
        i = nprep;
    while (i < n) {
        int hit = 0;
        for (int k = 0; k < nsb && !hit; k++)
            if (i + sb[k].nrep <= n && !memcmp(s + i, sb[k].rep, sb[k].nrep) && j + sb[k].npat <= len &&
                !memcmp(text + j, sb[k].pat, sb[k].npat)) {
                i += sb[k].nrep;
                j += sb[k].npat;
                hit = 1;
            }
        if (hit) continue;
        if (j >= len || s[i] != text[j]) return -1;
        i++;
        j++;
    }
    *at = j;
    return 0;
}

int tok_offsets(const tok *t, const char *text, size_t len, const int32_t *ids, size_t n, size_t *start,
                size_t *end, ct_err *e) {
    subst sb[16];
    int nsb = 0;
    const char *prep = NULL;
    size_t nprep = 0;
    if (!t->byte_level) {
        for (int k = t->n_norm - 1; k >= 0 && nsb < 15; k--) {
            const tok_norm *st = &t->norm[k];
            if (st->kind == TOK_NORM_REPLACE && st->nrep)
                sb[nsb++] = (subst){st->rep, st->pat, st->nrep, st->npat};
            else if (st->kind == TOK_NORM_PREPEND)
                prep = st->rep, nprep = st->nrep;
        }
        if (t->pre == TOK_PRE_METASPACE) {
            sb[nsb++] = (subst){t->split_pat, " ", t->split_len, 1};
            if (t->ms_prepend) prep = t->split_pat, nprep = t->split_len;
        }
    }
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= t->n_ids || t->id_str[id] < 0)
            return ct_fail(e, CT_ERR_FORMAT, "tokenizer: id %d is not a token", (int)id);
        const tok_added *a = t->added_of[id] >= 0 ? &t->added[t->added_of[id]] : NULL;
        if (a && a->lstrip)
            while (at < len && is_space((uint8_t)text[at])) at++;
        size_t s0 = at;
        int rc = -1;
        if (a && strlen(a->content) <= len - at && !memcmp(text + at, a->content, strlen(a->content))) {
            at += strlen(a->content);
            rc = 0;
        } else if (t->byte_level) {
            size_t k = t->dec_off[id + 1] - t->dec_off[id];
            if (k <= len - at && !memcmp(text + at, t->dec + t->dec_off[id], k)) at += k, rc = 0;
        } else {
            const char *s = t->pool + t->id_str[id];
            rc = match_sp(t, sb, nsb, prep, nprep, s, strlen(s), text, len, &at);
        }
        if (rc)
            return ct_fail(e, CT_ERR_FORMAT,
                           "tokenizer: token %zu (id %d, \"%.40s\") does not match the text at byte %zu "
                           "(the tokenizer's normalizer rewrites it, or the token is unknown): cannot tell "
                           "which bytes it covers",
                           i, (int)id, t->pool + t->id_str[id], s0);
        if (a && a->rstrip)
            while (at < len && is_space((uint8_t)text[at])) at++;
        start[i] = s0;
        end[i] = at;
    }
    if (at != len)
        return ct_fail(e, CT_ERR_FORMAT, "tokenizer: %zu bytes of the text are covered by no token", len - at);
    return 0;
}
