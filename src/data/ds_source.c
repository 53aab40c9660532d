/* data/ds_source.c: reading documents and tokenizing them with every core.
 *
 * Shape of a run: one OpenMP team. One thread, the reader, walks the inputs
 * in order and cuts them into documents; JSON is parsed there too, because
 * cJSON records parse errors in a process global and so is not safe to call
 * from several threads. Documents are gathered into chunks of about
 * chunk_bytes. A full chunk becomes tasks of a few documents each (each
 * thread its own tok_enc, each document its own output slot) that the rest
 * of the team runs while the reader gathers the next chunk; two chunks
 * alternate. When the next chunk is full the reader waits for the one in
 * flight (helping with its tasks), starts the new one, and writes the
 * finished one (its documents in order, EOS after each) to the sink. Reading
 * and writing thus overlap tokenization, and the output depends only on the
 * inputs, never on the thread count, the task timing or the chunking.
 *
 * Inputs are mapped read-only; a document is a span of the mapping (text)
 * or of a cJSON string (jsonl/chat) that lives until its chunk is written. */
#include "data/dataset.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <omp.h>

#include "data/chat.h"
#include "formats/json.h"

#define DEFAULT_CHUNK_BYTES ((size_t)1 << 20)
#define MAX_CHUNK_DOCS 16384

/* ------------------------------------------------------------ names */

static const char *const KIND_NAMES[] = {"auto", "text", "jsonl", "chat", "tokens"};
static const char *const SPLIT_NAMES[] = {"file", "paragraph", "line"};

const char *ds_kind_name(ds_kind k) {
    return (unsigned)k < sizeof KIND_NAMES / sizeof *KIND_NAMES ? KIND_NAMES[k] : "?";
}

int ds_kind_parse(const char *name, ds_kind *out) {
    for (int i = 0; i < (int)(sizeof KIND_NAMES / sizeof *KIND_NAMES); i++)
        if (name && !strcmp(name, KIND_NAMES[i])) {
            *out = (ds_kind)i;
            return 0;
        }
    return -1;
}

int ds_split_parse(const char *name, ds_text_split *out) {
    for (int i = 0; i < (int)(sizeof SPLIT_NAMES / sizeof *SPLIT_NAMES); i++)
        if (name && !strcmp(name, SPLIT_NAMES[i])) {
            *out = (ds_text_split)i;
            return 0;
        }
    return -1;
}

void ds_tok_opts_default(ds_tok_opts *o) {
    memset(o, 0, sizeof *o);
    o->kind = DS_KIND_AUTO;
    o->text_split = DS_SPLIT_FILE;
    o->eos_id = -1;
    o->assistant_only_loss = 1;
    o->completion_only_loss = 1;
}

/* ------------------------------------------------------------ detection */

static int has_ext(const char *path, const char *ext) {
    size_t a = strlen(path), b = strlen(ext);
    return a >= b && !strcasecmp(path + a - b, ext);
}

static int is_blank(const char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!strchr(" \t\r\f\v", p[i]) || !p[i]) return 0;
    return 1;
}

/* The first non-blank line of the file without its line end, malloc'd;
 * NULL when the file is empty or blank. */
static int first_line(const char *path, char **out, size_t *len, ct_err *e) {
    *out = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return ct_fail(e, CT_ERR_IO, "%s: cannot open (%s)", path, strerror(errno));
    char *line = NULL;
    size_t cap = 0;
    ssize_t n;
    while ((n = getline(&line, &cap, f)) >= 0) {
        size_t m = (size_t)n;
        while (m && (line[m - 1] == '\n' || line[m - 1] == '\r')) m--;
        if (!is_blank(line, m)) {
            *out = line;
            *len = m;
            fclose(f);
            return 0;
        }
    }
    free(line);
    fclose(f);
    return 0;
}

int ds_detect_kind(const char *path, ds_kind *out, ct_err *e) {
    struct stat st;
    if (stat(path, &st) != 0) return ct_fail(e, CT_ERR_IO, "%s: cannot open (%s)", path, strerror(errno));
    if (S_ISDIR(st.st_mode) || has_ext(path, ".bin") || has_ext(path, ".npy")) {
        *out = DS_KIND_TOKENS;
        return 0;
    }
    if (has_ext(path, ".txt") || has_ext(path, ".text") || has_ext(path, ".md")) {
        *out = DS_KIND_TEXT;
        return 0;
    }
    int json_ext = has_ext(path, ".jsonl") || has_ext(path, ".json");
    char *line = NULL;
    size_t n = 0;
    if (first_line(path, &line, &n, e)) return e->code;
    if (!line) { /* empty: nothing to tell; the extension decides */
        *out = json_ext ? DS_KIND_JSONL : DS_KIND_TEXT;
        return 0;
    }
    cJSON *j = line[0] == '{' ? cJSON_ParseWithLength(line, n) : NULL;
    int rc = 0;
    if (cJSON_IsObject(j)) {
        /* chat: the layouts rendered as conversations (chat_layout_of) */
        *out = cJSON_GetObjectItemCaseSensitive(j, "messages") || cJSON_GetObjectItemCaseSensitive(j, "conversations") ||
                       cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(j, "prompt"))
                   ? DS_KIND_CHAT
                   : DS_KIND_JSONL;
    } else if (json_ext) {
        rc = ct_fail(e, CT_ERR_FORMAT,
                     line[0] == '['
                         ? "%s: first line is a JSON array; expected JSON Lines (one object per line, e.g. "
                           "{\"text\": ...})"
                         : "%s: first line is not a JSON object; expected JSON Lines (one object per line)",
                     path);
    } else {
        *out = DS_KIND_TEXT;
    }
    cJSON_Delete(j);
    free(line);
    return rc;
}

/* ------------------------------------------------------------ inputs */

typedef struct {
    const char *path;
    ds_kind kind;
    int pc;           /* jsonl in the prompt-completion layout (see detect_prompt_completion) */
    chat_layout layout; /* chat: the layout of its first record */
    const char *data; /* mapping, NULL when empty */
    size_t len;
} src_file;

static int map_file(src_file *s, ct_err *e) {
    int fd = open(s->path, O_RDONLY);
    if (fd < 0) return ct_fail(e, CT_ERR_IO, "%s: cannot open (%s)", s->path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return ct_fail(e, CT_ERR_IO, "%s: not a regular file", s->path);
    }
    s->len = (size_t)st.st_size;
    s->data = NULL;
    if (s->len) {
        void *p = mmap(NULL, s->len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            close(fd);
            return ct_fail(e, CT_ERR_IO, "%s: cannot map (%s)", s->path, strerror(errno));
        }
        madvise(p, s->len, MADV_SEQUENTIAL);
        s->data = p;
    }
    close(fd);
    return 0;
}

/* ------------------------------------------------------------ run state */

typedef struct {
    const char *text; /* text/jsonl document */
    size_t len;
    chat_msg *msgs; /* chat document */
    int n_msgs;
    cJSON *json;
    char *own;         /* prompt-completion: the malloc'd prompt + completion `text` points to */
    size_t prompt_len; /* prompt-completion: its first prompt_len bytes are the prompt */
    int pc;            /* a prompt-completion record: 1 strings, 2 lists of messages (chat_encode_pc) */
    int n_prompt;      /* pc 2: the first n_prompt of msgs are the prompt */
    int src;
    uint64_t line; /* 1-based; 0: the whole file */
} item;

typedef struct {
    tok_ids ids;
    chat_mask mask;
} slot;

/* A chunk of documents and, once tokenized, their tokens. */
typedef struct {
    item *items;
    slot *slots;
    size_t n, cap;
    uint64_t first;   /* ordinal of items[0] among all documents */
    uint64_t read_to; /* input bytes consumed up to its last document */
    size_t bytes;     /* document bytes gathered */
} batch;

typedef struct {
    const tok *t;
    const ds_tok_opts *o;
    src_file *src;
    int n_src;
    int32_t eos;
    int masked;
    chat_tmpl *chat; /* chat sources in the tokenizer's own format; NULL: ChatML */
    int nt;
    tok_enc **enc;     /* [nt] */
    ct_err *terr;      /* [nt] each thread's error of lowest document ordinal */
    uint64_t *terr_at; /* [nt] that ordinal (UINT64_MAX: none) */
    batch b[2];        /* one being gathered while the other is tokenized */
    int cur;           /* the one being gathered */
    int inflight;      /* b[!cur] has tasks running or done, not yet emitted */
    uint64_t next_doc;
    size_t chunk_bytes;
    uint64_t read_to;  /* input bytes consumed by the reader so far */
    uint32_t *cat;     /* an emitted chunk, concatenated */
    uint8_t *catm;
    size_t cat_cap;
    ds_sink_fn sink;
    void *sink_ctx;
    ds_progress_fn progress;
    void *progress_ctx;
    ds_progress st;
} run;

static void free_items(batch *b) {
    for (size_t i = 0; i < b->n; i++) {
        free(b->items[i].msgs);
        free(b->items[i].own);
        cJSON_Delete(b->items[i].json);
    }
    b->n = 0;
    b->bytes = 0;
}

static void free_batch(batch *b) {
    free_items(b);
    for (size_t i = 0; i < b->cap; i++) {
        tok_ids_free(&b->slots[i].ids);
        chat_mask_free(&b->slots[i].mask);
    }
    free(b->items);
    free(b->slots);
}

static void where(char *buf, size_t cap, const run *r, const item *it) {
    if (it->line)
        snprintf(buf, cap, "%s:%llu", r->src[it->src].path, (unsigned long long)it->line);
    else
        snprintf(buf, cap, "%s", r->src[it->src].path);
}

static void grow_cat(run *r, size_t n) {
    if (n <= r->cat_cap) return;
    size_t cap = r->cat_cap ? r->cat_cap : 1 << 16;
    while (cap < n) cap *= 2;
    free(r->cat);
    free(r->catm);
    r->cat = ct_malloc(cap * sizeof *r->cat);
    r->catm = ct_malloc(cap);
    r->cat_cap = cap;
}

/* A prompt-completion record, as TRL's SFTTrainer tokenizes the standard (string) layout
 * (trl/trainer/sft_trainer.py, SFTTrainer._prepare_dataset: add_eos and tokenize_fn's
 * prompt-completion branch, completion_only_loss on by default for this layout): the
 * tokens are those of prompt + completion encoded as one text (the tokenizer's special
 * tokens added as its __call__ adds them), and the first as many tokens as the prompt
 * alone encodes to are no targets; the rest, and the EOS after it, are. The count is
 * positional, as there: a token merging the prompt's end with the completion's start
 * is a target or not by that count alone. */
static int encode_prompt_completion(tok_enc *enc, const item *it, int completion_only, tok_ids *ids, chat_mask *mask,
                                    ct_err *e) {
    if (!completion_only) { /* TRL's completion_only_loss=False: every token, as for text */
        if (tok_encode(enc, it->text, it->len, ids, e)) return 1;
        mask->n = 0;
        chat_mask_push(mask, 1, ids->n);
        return 0;
    }
    if (tok_encode(enc, it->text, it->prompt_len, ids, e)) return 1;
    size_t np = ids->n;
    ids->n = 0;
    if (tok_encode(enc, it->text, it->len, ids, e)) return 1;
    np = np < ids->n ? np : ids->n;
    mask->n = 0;
    chat_mask_push(mask, 0, np);
    chat_mask_push(mask, 1, ids->n - np);
    return 0;
}

/* Tokenizes documents [lo, hi) of b on the calling thread. */
static void encode_range(run *r, batch *b, size_t lo, size_t hi) {
    int tid = omp_get_thread_num();
    for (size_t i = lo; i < hi; i++) {
        uint64_t ord = b->first + i;
        /* a thread that failed only still looks for an earlier failure, so
         * the error reported is the first one in input order */
        if (ord > r->terr_at[tid]) continue;
        const item *it = &b->items[i];
        /* encode into local copies: the slots are adjacent in memory, and
         * updating their counters in place token by token would make the
         * threads fight over cache lines */
        tok_ids ids = b->slots[i].ids;
        chat_mask mask = b->slots[i].mask;
        ids.n = mask.n = 0;
        ct_err err = {0};
        const ds_tok_opts *o = r->o;
        int rc;
        if (it->pc == 2) /* conversational prompt-completion */
            rc = chat_encode_pc(r->chat, r->enc[tid], r->t, it->json, it->msgs, it->n_msgs, it->n_prompt,
                                o->completion_only_loss, o->assistant_only_loss, &ids, &mask, &err);
        else if (it->pc) /* prompt-completion strings */
            rc = encode_prompt_completion(r->enc[tid], it, o->completion_only_loss, &ids, &mask, &err);
        else if (!it->msgs) /* text */
            rc = tok_encode(r->enc[tid], it->text, it->len, &ids, &err);
        else if (r->chat) /* a conversation, through the template */
            rc = chat_encode_tmpl(r->chat, r->enc[tid], r->t, it->json,
                                  cJSON_GetObjectItemCaseSensitive(it->json, "messages"), o->assistant_only_loss, &ids,
                                  &mask, &err);
        else /* a conversation, through the built-in ChatML */
            rc = chat_encode_loss(r->enc[tid], r->t, it->msgs, it->n_msgs, o->assistant_only_loss, &ids, &mask, &err);
        b->slots[i].ids = ids;
        b->slots[i].mask = mask;
        if (rc) {
            r->terr_at[tid] = ord;
            r->terr[tid] = err;
            if (!r->terr[tid].code) r->terr[tid].code = CT_ERR_IO;
        }
    }
}

/* Hands the gathered chunk to the team as tasks; returns at once. */
static void spawn(run *r, batch *b) {
    size_t n = b->n;
    /* a few documents per task keeps the task overhead low with tiny
     * documents; few enough that one long document cannot unbalance it */
    size_t grain = n / ((size_t)r->nt * 32);
    grain = grain < 1 ? 1 : grain > 64 ? 64 : grain;
    for (size_t lo = 0; lo < n; lo += grain) {
        size_t hi = lo + grain < n ? lo + grain : n;
#pragma omp task firstprivate(r, b, lo, hi)
        encode_range(r, b, lo, hi);
    }
}

/* Writes a tokenized chunk: documents in order, EOS after each. */
static int emit(run *r, batch *b, ct_err *e) {
    uint64_t bad = UINT64_MAX;
    int bt = -1;
    for (int k = 0; k < r->nt; k++)
        if (r->terr_at[k] < bad) bad = r->terr_at[k], bt = k;
    if (bt >= 0 && bad < b->first + b->n) { /* earlier chunks were clean, so it is in this one */
        char at[4200];
        where(at, sizeof at, r, &b->items[bad - b->first]);
        return ct_fail(e, r->terr[bt].code, "%s: %s", at, r->terr[bt].msg);
    }
    size_t total = 0;
    for (size_t i = 0; i < b->n; i++) total += b->slots[i].ids.n + 1;
    grow_cat(r, total);
    size_t k = 0;
    uint64_t trainable = 0;
    for (size_t i = 0; i < b->n; i++) {
        const slot *s = &b->slots[i];
        for (size_t j = 0; j < s->ids.n; j++) r->cat[k + j] = (uint32_t)s->ids.v[j];
        if (b->items[i].msgs || b->items[i].pc) {
            memcpy(r->catm + k, s->mask.v, s->ids.n);
            for (size_t j = 0; j < s->ids.n; j++) trainable += s->mask.v[j] != 0;
            /* a completion's EOS is a target (TRL appends eos_token to the completion); TRL
             * adds none to conversational data, where ours only separates documents */
            r->catm[k + s->ids.n] = b->items[i].pc == 1;
            trainable += b->items[i].pc == 1;
        } else {
            memset(r->catm + k, 1, s->ids.n + 1);
            trainable += s->ids.n + 1;
        }
        k += s->ids.n;
        r->cat[k] = (uint32_t)r->eos;
        /* after a conversation the EOS is no target (set above): the assistant's
         * reply already ended with <|im_end|>, and what follows is a new document */
        k++;
    }
    /* slots keep their buffers for a later chunk, except outsized ones: a
     * huge document landing in a different slot each time must not leave a
     * huge buffer behind in every slot */
    for (size_t i = 0; i < b->n; i++)
        if (b->slots[i].ids.cap > ((size_t)1 << 20)) {
            tok_ids_free(&b->slots[i].ids);
            chat_mask_free(&b->slots[i].mask);
        }
    r->st.docs += b->n;
    r->st.tokens += total;
    r->st.trainable += trainable;
    r->st.bytes_done = b->read_to;
    free_items(b);
    int rc = r->sink ? r->sink(r->sink_ctx, r->cat, r->masked ? r->catm : NULL, total, e) : 0;
    if (!rc && r->progress) r->progress(r->progress_ctx, &r->st, 0);
    return rc;
}

/* The pipeline step, on the reader thread: wait for the chunk in flight,
 * start the one just gathered, and write the finished one while the team
 * tokenizes the new one (and the reader gathers the next). */
static int advance(run *r, ct_err *e) {
    batch *fresh = &r->b[r->cur], *done = &r->b[!r->cur];
#pragma omp taskwait
    fresh->read_to = r->read_to;
    spawn(r, fresh);
    int rc = r->inflight ? emit(r, done, e) : 0;
    r->inflight = 1;
    r->cur = !r->cur;
    r->b[r->cur].first = r->next_doc;
    return rc;
}

/* At the end (or on an error): nothing may stay in flight. */
static int drain(run *r, int rc, ct_err *e) {
#pragma omp taskwait
    if (!rc && r->b[r->cur].n) rc = advance(r, e);
#pragma omp taskwait
    if (!rc && r->inflight) rc = emit(r, &r->b[!r->cur], e);
    r->inflight = 0;
    return rc;
}

static int add_item(run *r, item it, size_t bytes, ct_err *e) {
    batch *b = &r->b[r->cur];
    if (b->n == b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 256;
        item *ni = realloc(b->items, cap * sizeof *ni);
        if (!ni) {
            fprintf(stderr, "ctitan: error: out of memory gathering documents\n");
            exit(1);
        }
        b->items = ni;
        slot *ns = realloc(b->slots, cap * sizeof *ns);
        if (!ns) {
            fprintf(stderr, "ctitan: error: out of memory gathering documents\n");
            exit(1);
        }
        memset(ns + b->cap, 0, (cap - b->cap) * sizeof *ns);
        b->slots = ns;
        b->cap = cap;
    }
    b->items[b->n++] = it;
    b->bytes += bytes;
    r->next_doc++;
    if (b->bytes >= r->chunk_bytes || b->n >= MAX_CHUNK_DOCS) return advance(r, e);
    return 0;
}

/* A record of the prompt-completion layout (TRL's standard one: two strings) -> the item
 * prompt + completion. TRL adds the tokenizer's eos_token to a completion that does not
 * already end with it (sft_trainer.py, add_eos); here every document is followed by EOS,
 * so a completion that ends with the EOS token's text loses that text instead. */
static int prompt_completion_item(run *r, const cJSON *j, item *it, char *why, size_t cap) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(j, "prompt");
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(j, "completion");
    if (cJSON_IsArray(p) || cJSON_IsArray(c)) {
        snprintf(why, cap,
                 "\"%s\" is a list of messages (TRL's conversational prompt-completion layout), but this file is "
                 "read as string prompt-completion (kind jsonl, or its first record's layout): read lists of "
                 "messages as chat data (kind auto or chat) from a file whose first record has them",
                 cJSON_IsArray(p) ? "prompt" : "completion");
        return -1;
    }
    if (!cJSON_IsString(p) || !cJSON_IsString(c)) {
        const char *bad = !cJSON_IsString(p) ? "prompt" : "completion";
        snprintf(why, cap,
                 "\"%s\" %s (a prompt-completion file, as its first record has \"prompt\": every line needs "
                 "\"prompt\" and \"completion\" strings)",
                 bad, cJSON_GetObjectItemCaseSensitive(j, bad) ? "is not a string" : "field missing");
        return -1;
    }
    size_t np = strlen(p->valuestring), nc = strlen(c->valuestring);
    const char *eos = r->o->encode_special || !tok_is_special(r->t, r->eos) ? NULL : tok_id_to_token(r->t, r->eos);
    size_t ne = eos ? strlen(eos) : 0;
    if (ne && nc >= ne && !memcmp(c->valuestring + nc - ne, eos, ne)) nc -= ne;
    it->own = ct_malloc(np + nc + 1);
    memcpy(it->own, p->valuestring, np);
    memcpy(it->own + np, c->valuestring, nc);
    it->own[np + nc] = 0;
    it->text = it->own;
    it->len = np + nc;
    it->prompt_len = np;
    it->pc = 1;
    return 0;
}

/* One JSONL line -> an item, or nothing for a blank line. */
static int json_line(run *r, int si, const char *p, size_t n, uint64_t line, ct_err *e) {
    const src_file *s = &r->src[si];
    if (is_blank(p, n)) return 0;
    /* json_parse, as every JSON file: a repeated key ({"text": "a", "text": "b"}: cJSON kept the
     * first, Python the last) and ill-formed UTF-8 are errors naming the line, not silently one reading */
    char what[4200];
    snprintf(what, sizeof what, "%s:%llu", s->path, (unsigned long long)line);
    cJSON *j = json_parse(p, n, what, e);
    if (!j) return e ? e->code : CT_ERR_FORMAT;
    item it = {.json = j, .src = si, .line = line};
    if (s->kind == DS_KIND_CHAT) {
        ct_err ce = {0};
        if (chat_record(j, s->layout, &it.msgs, &it.n_msgs, &it.n_prompt, &ce) || chat_record_fits(r->chat, j, &ce)) {
            cJSON_Delete(j);
            free(it.msgs);
            return ct_fail(e, ce.code, "%s:%llu: %s", s->path, (unsigned long long)line, ce.msg);
        }
        if (s->layout == CHAT_PROMPT_COMPLETION) it.pc = 2;
    } else if (s->pc) {
        char why[1000];
        if (!cJSON_IsObject(j))
            snprintf(why, sizeof why, "expected a JSON object with \"prompt\" and \"completion\" strings");
        if (!cJSON_IsObject(j) || prompt_completion_item(r, j, &it, why, sizeof why)) {
            cJSON_Delete(j);
            return ct_fail(e, CT_ERR_FORMAT, "%s:%llu: %s", s->path, (unsigned long long)line, why);
        }
    } else {
        const char *field = r->o->text_field ? r->o->text_field : "text";
        const cJSON *v = cJSON_IsObject(j) ? cJSON_GetObjectItemCaseSensitive(j, field) : NULL;
        if (!cJSON_IsString(v)) {
            char why[900];
            if (!cJSON_IsObject(j))
                snprintf(why, sizeof why, "expected a JSON object with a \"%s\" string", field);
            else
                snprintf(why, sizeof why, "\"%s\" %s%s", field, v ? "is not a string" : "field missing",
                         v ? ""
                         : cJSON_GetObjectItemCaseSensitive(j, "prompt")
                             ? " (this line has \"prompt\": a file is read in one layout, the one its first "
                               "record has; put prompt-completion records in a file of their own)"
                         : cJSON_GetObjectItemCaseSensitive(j, "messages")
                             ? " (this line has \"messages\": a file is read in one layout, the one its first "
                               "record has; put conversations in a file of their own)"
                         : cJSON_GetObjectItemCaseSensitive(j, "conversations")
                             ? " (\"conversations\" is ShareGPT's layout, read as chat data: kind auto or chat, "
                               "from a file whose first record has it)"
                             : "");
            cJSON_Delete(j);
            return ct_fail(e, CT_ERR_FORMAT, "%s:%llu: %s", s->path, (unsigned long long)line, why);
        }
        it.text = v->valuestring;
        it.len = strlen(v->valuestring);
        if (!it.len) {
            r->st.skipped++;
            cJSON_Delete(j);
            return 0;
        }
    }
    return add_item(r, it, n + 1, e);
}

/* Length of the line at p (without its "\n"), and the offset of the next. */
static size_t line_end(const char *p, size_t n, size_t at) {
    const char *nl = memchr(p + at, '\n', n - at);
    return nl ? (size_t)(nl - p) : n;
}

/* What a binary file that is not text most likely is, by its first bytes: the formats
 * a Hugging Face user has at hand (the Hub's parquet, c4's .json.gz, datasets' arrow). */
static const char *binary_format(const unsigned char *p, size_t n) {
    if (n >= 2 && p[0] == 0x1F && p[1] == 0x8B) return "gzip-compressed (gunzip it first)";
    if (n >= 4 && !memcmp(p, "\x28\xB5\x2F\xFD", 4)) return "zstd-compressed (unzstd it first)";
    if (n >= 3 && !memcmp(p, "BZh", 3)) return "bzip2-compressed (bunzip2 it first)";
    if (n >= 6 && !memcmp(p, "\xFD" "7zXZ\x00", 6)) return "xz-compressed (unxz it first)";
    if (n >= 4 && !memcmp(p, "PK\x03\x04", 4)) return "a zip archive";
    if (n >= 4 && !memcmp(p, "PAR1", 4))
        return "Parquet (convert it to JSON Lines, e.g. datasets' Dataset.from_parquet(F).to_json(OUT))";
    if ((n >= 6 && !memcmp(p, "ARROW1", 6)) || (n >= 4 && !memcmp(p, "\xFF\xFF\xFF\xFF", 4)))
        return "Arrow (datasets' save_to_disk; write JSON Lines with Dataset.to_json(OUT))";
    return NULL;
}

/* A text source must be UTF-8, as Python and HF's text loader read it: anything else
 * (most often a compressed or columnar file) is refused naming the line, where the
 * byte-level tokenizer would have trained on its bytes. */
static int check_text_utf8(const src_file *s, ct_err *e) {
    const unsigned char *p = (const unsigned char *)s->data;
    size_t n = s->len;
    uint64_t line = 1;
    for (size_t i = 0; i < n;) {
        if (p[i] < 0x80) {
            line += p[i] == '\n';
            i++;
            continue;
        }
        size_t k = json_utf8_len(p + i, n - i);
        if (k) {
            i += k;
            continue;
        }
        const char *what = binary_format(p, n);
        return ct_fail(e, CT_ERR_FORMAT,
                       "%s:%llu: not UTF-8 text (byte 0x%02x at offset %zu)%s%s; a file read as text (kind text, or auto "
                       "for a file that is not JSON Lines) must be UTF-8",
                       s->path, (unsigned long long)line, p[i], i, what ? ": it looks like " : "", what ? what : "");
    }
    return 0;
}

/* Cuts source si (starting at byte `base` of all inputs) into documents. */
static int read_source(run *r, int si, uint64_t base, ct_err *e) {
    src_file *s = &r->src[si];
    const char *p = s->data;
    size_t n = s->len, at = 0;
    uint64_t line = 1;
    int rc = 0;
    if (s->kind == DS_KIND_TEXT && (rc = check_text_utf8(s, e))) return rc;
    if (s->kind == DS_KIND_TEXT && r->o->text_split == DS_SPLIT_FILE) {
        r->read_to = base + n;
        if (n) return add_item(r, (item){.text = p, .len = n, .src = si}, n, e);
        r->st.skipped++;
        return 0;
    }
    while (at < n && !rc) {
        size_t le = line_end(p, n, at), next = le < n ? le + 1 : n;
        size_t m = le - at;
        if (m && p[le - 1] == '\r') m--;
        if (s->kind != DS_KIND_TEXT) {
            r->read_to = base + next;
            rc = json_line(r, si, p + at, m, line, e);
            at = next;
            line++;
        } else if (r->o->text_split == DS_SPLIT_LINE) {
            r->read_to = base + next;
            if (!is_blank(p + at, m)) rc = add_item(r, (item){.text = p + at, .len = m, .src = si, .line = line}, m, e);
            at = next;
            line++;
        } else if (is_blank(p + at, m)) { /* paragraph separator */
            at = next;
            line++;
        } else { /* paragraph: this non-blank line up to the last before a blank one */
            size_t start = at, last = le;
            uint64_t first = line;
            while (at < n) {
                le = line_end(p, n, at);
                if (is_blank(p + at, le - at)) break;
                last = le;
                at = le < n ? le + 1 : n;
                line++;
            }
            m = last - start;
            if (m && p[start + m - 1] == '\r') m--;
            r->read_to = base + at;
            rc = add_item(r, (item){.text = p + start, .len = m, .src = si, .line = first}, m, e);
        }
    }
    r->read_to = base + n;
    return rc;
}

/* Whether a jsonl source holds TRL's prompt-completion layout ({"prompt": ..., "completion":
 * ...}): its first record has "prompt", and either no text field was named or that record
 * lacks it (TRL reads "prompt" first: sft_trainer.py, tokenize_fn). The first record decides
 * for the whole file, as it decides chat against jsonl (ds_detect_kind). */
static int detect_prompt_completion(src_file *s, const char *text_field, ct_err *e) {
    char *line = NULL;
    size_t n = 0;
    s->pc = 0;
    if (first_line(s->path, &line, &n, e)) return e->code;
    cJSON *j = line && line[0] == '{' ? cJSON_ParseWithLength(line, n) : NULL;
    if (cJSON_IsObject(j) && cJSON_GetObjectItemCaseSensitive(j, "prompt") &&
        (!text_field || !cJSON_GetObjectItemCaseSensitive(j, text_field)))
        s->pc = 1;
    cJSON_Delete(j);
    free(line);
    return 0;
}

/* The layout of a chat source: its first record's (chat_layout_of), as TRL decides by
 * its dataset's first example. */
static int detect_chat_layout(src_file *s, ct_err *e) {
    char *line = NULL;
    size_t n = 0;
    s->layout = CHAT_MESSAGES;
    if (first_line(s->path, &line, &n, e)) return e->code;
    cJSON *j = line && line[0] == '{' ? cJSON_ParseWithLength(line, n) : NULL;
    if (j) s->layout = chat_layout_of(j);
    cJSON_Delete(j);
    free(line);
    return 0;
}

/* A chat template named for sources none of which is chat data (training.chat_template,
 * prepare --chat-template) renders nothing: a warning says so rather than silence.
 * "auto" (the default) names none. With a note (seen), a run whose training data used
 * the template does not warn of its text validation data, and a run warns once
 * however many data sets it tokenizes. */
static void warn_unused_template(const char *spec, const char *const *paths, int n_paths, const src_file *src,
                                 int masked, int *seen) {
    if (seen && *seen) return;
    if (seen && masked) *seen = 1;
    if (masked || !spec || !spec[0] || !strcmp(spec, "auto") || n_paths < 1) return;
    if (seen) *seen = 1;
    char what[160];
    if (n_paths == 1) snprintf(what, sizeof what, "it is %s data, not chat data", ds_kind_name(src[0].kind));
    else if (n_paths == 2) snprintf(what, sizeof what, "and the source after it: neither is chat data");
    else snprintf(what, sizeof what, "and the %d sources after it: none is chat data", n_paths - 1);
    fprintf(stderr,
            "ctitan: warning: chat template \"%s\" is not applied to %s%s%s (JSON Lines whose objects have "
            "\"messages\", \"conversations\" or a \"prompt\" list), and only chat data is rendered with a template\n",
            spec, paths[0], n_paths == 1 ? ": " : " ", what);
}

int ds_tokenize(const char *const *paths, int n_paths, const tok *t, const ds_tok_opts *o, ds_sink_fn sink,
                void *sink_ctx, ds_progress_fn progress, void *progress_ctx, ds_progress *stats, ct_err *e) {
    ds_tok_opts defaults;
    if (!o) {
        ds_tok_opts_default(&defaults);
        o = &defaults;
    }
    if (stats) memset(stats, 0, sizeof *stats);
    if (!t) return ct_fail(e, CT_ERR_CONFIG, "%s: text data needs a tokenizer", n_paths ? paths[0] : "dataset");
    run r = {.t = t, .o = o, .n_src = n_paths, .sink = sink, .sink_ctx = sink_ctx, .progress = progress,
             .progress_ctx = progress_ctx};
    r.eos = o->eos_id >= 0 ? o->eos_id : tok_eos_id(t);
    if (r.eos < 0) r.eos = tok_token_id(t, "<|endoftext|>");
    if (r.eos < 0 || r.eos >= tok_vocab_size(t))
        return ct_fail(e, CT_ERR_CONFIG,
                       "tokenizer has no eos_token (tokenizer_config.json) and no <|endoftext|>: "
                       "cannot separate documents");
    r.src = ct_calloc((size_t)(n_paths ? n_paths : 1), sizeof *r.src);
    int rc = 0, has_chat = 0;
    for (int i = 0; i < n_paths && !rc; i++) {
        r.src[i].path = paths[i];
        r.src[i].kind = o->kind;
        if (o->kind == DS_KIND_AUTO) rc = ds_detect_kind(paths[i], &r.src[i].kind, e);
        if (rc) break;
        if (r.src[i].kind == DS_KIND_TOKENS) {
            rc = ct_fail(e, CT_ERR_CONFIG, "%s: already tokenized; use it as training data directly", paths[i]);
            break;
        }
        if (r.src[i].kind == DS_KIND_JSONL && (rc = detect_prompt_completion(&r.src[i], o->text_field, e))) break;
        if (r.src[i].kind == DS_KIND_CHAT) {
            if ((rc = detect_chat_layout(&r.src[i], e))) break;
            has_chat = 1;
            /* which loss options shape the masks (ds_writer_loss records them) */
            if (r.src[i].layout == CHAT_PROMPT_COMPLETION) r.st.completions = 2;
            else r.st.conversations = 1;
        }
        if (r.src[i].pc && !r.st.completions) r.st.completions = 1;
        if (r.src[i].kind == DS_KIND_CHAT || r.src[i].pc) r.masked = 1;
        rc = map_file(&r.src[i], e);
        r.st.bytes_total += r.src[i].len;
    }
    r.st.masked = r.masked;
    if (!rc) warn_unused_template(o->chat_template, paths, n_paths, r.src, has_chat, o->template_seen);
    if (!rc && has_chat) rc = chat_tmpl_open(o->chat_template, o->tokenizer_dir, &r.chat, e);
    if (!rc && r.chat && o->encode_special)
        rc = ct_fail(e, CT_ERR_CONFIG,
                     "chat data rendered with %s: encoding special tokens as text would also break the template's "
                     "own (use chat_template = \"chatml\", or leave encode_special_tokens off)",
                     chat_tmpl_file(r.chat));
    r.nt = o->threads > 0 ? o->threads : omp_get_max_threads();
    if (r.nt < 1) r.nt = 1;
    r.st.threads = r.nt;
    r.chunk_bytes = o->chunk_bytes ? o->chunk_bytes : DEFAULT_CHUNK_BYTES * (size_t)(r.nt > 4 ? r.nt / 4 : 1);
    if (!rc) {
        r.enc = ct_calloc((size_t)r.nt, sizeof *r.enc);
        r.terr = ct_calloc((size_t)r.nt, sizeof *r.terr);
        r.terr_at = ct_calloc((size_t)r.nt, sizeof *r.terr_at);
        for (int k = 0; k < r.nt; k++) {
            r.enc[k] = tok_enc_new(t);
            tok_enc_set_encode_special(r.enc[k], o->encode_special);
            r.terr_at[k] = UINT64_MAX;
        }
        /* One thread reads (and parses JSON); the whole team, the reader
         * included whenever it waits, runs the tokenization tasks. */
#pragma omp parallel num_threads(r.nt) shared(r, rc)
#pragma omp single
        {
            uint64_t base = 0;
            for (int i = 0; i < n_paths && !rc; i++) {
                rc = read_source(&r, i, base, e);
                base += r.src[i].len;
            }
            rc = drain(&r, rc, e);
        }
        r.st.bytes_done = r.read_to;
        if (!rc && progress) progress(progress_ctx, &r.st, 1);
    }
    free_batch(&r.b[0]);
    free_batch(&r.b[1]);
    if (r.enc)
        for (int k = 0; k < r.nt; k++) tok_enc_free(r.enc[k]);
    free(r.enc);
    free(r.terr);
    free(r.terr_at);
    free(r.cat);
    free(r.catm);
    chat_tmpl_close(r.chat);
    for (int i = 0; i < n_paths; i++)
        if (r.src[i].data) munmap((void *)r.src[i].data, r.src[i].len);
    free(r.src);
    if (stats) *stats = r.st;
    return rc;
}
