/* checkpoint/hf.c: load and save HF safetensors model directories. */
#include "checkpoint/hf.h"
#include "core/fs.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "core/progress.h"
#include "formats/json.h"
#include "formats/safetensors.h"
#include "model/lora.h"

#include <cjson/cJSON.h>

/* Progress (core/progress.h) only for loads and saves still running after a
 * second: a real model's, not the tiny ones of tests and generate calls. */
#define HF_PROG_MIN_S 1.0
#define HF_SAVE_CHUNK ((size_t)1 << 22) /* elements per write: a bar step of 16 MiB of fp32 */

int hf_dtype_from_name(const char *name) {
    if (!strcmp(name, "float32")) return CT_F32;
    if (!strcmp(name, "bfloat16")) return CT_BF16;
    if (!strcmp(name, "float16")) return CT_F16;
    return -1;
}

static const char *torch_dtype_name(ct_dtype t) {
    return t == CT_BF16 ? "bfloat16" : t == CT_F16 ? "float16" : "float32";
}

static void shape_str(char *out, size_t cap, int ndim, const int64_t *shape) {
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++) k += (size_t)snprintf(out + k, cap - k, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (k < cap) snprintf(out + k, cap - k, "]");
}

/* tie_word_embeddings with an lm_head.weight in the file as well: transformers (5.x)
 * ties the two only when they hold the same values and otherwise loads the lm_head
 * untied, a different model than config.json says. ctitan builds one tied matrix,
 * so it takes an equal copy (what some exporters write) and refuses a different one
 * rather than silently dropping it. */
static int hf_check_tied_head(const st_set *s, const st_tensor *head, const char *file, ct_err *e) {
    const st_tensor *emb = st_set_find(s, "model.embed_tokens.weight", NULL);
    int same = emb && emb->ndim == head->ndim;
    for (int d = 0; same && d < head->ndim; d++) same = emb->shape[d] == head->shape[d];
    enum { CHUNK = 4096 };
    float *a = ct_malloc(2 * CHUNK * sizeof(float)), *b = a + CHUNK;
    size_t n = same ? (size_t)head->numel : 0, ha = ct_dtype_size(head->dtype), ea = same ? ct_dtype_size(emb->dtype) : 0;
    int rc = 0;
    for (size_t i = 0; same && i < n; i += CHUNK) {
        size_t k = n - i < CHUNK ? n - i : CHUNK;
        if (ct_convert_to_f32(a, (const char *)head->data + i * ha, head->dtype, k) != 0 ||
            ct_convert_to_f32(b, (const char *)emb->data + i * ea, emb->dtype, k) != 0) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"lm_head.weight\" has dtype %s; expected F32, BF16, F16 or F64",
                         file, ct_dtype_name(head->dtype));
            break;
        }
        for (size_t j = 0; same && j < k; j++) same = a[j] == b[j];
    }
    free(a);
    if (!rc && !same)
        rc = ct_fail(e, CT_ERR_FORMAT,
                     "%s: tensor \"lm_head.weight\" differs from model.embed_tokens.weight while config.json sets "
                     "tie_word_embeddings = true (transformers would load them untied: a different model); set "
                     "tie_word_embeddings to false, or drop the tensor to tie them", file);
    return rc;
}

int hf_fused_piece(const lm_config *c, const lm_tensor *t, hf_fused *f) {
    if (!lm_fused_file_name(c, t, f->name, sizeof f->name)) return 0;
    int64_t H = c->hidden;
    if (t->slot == LM_S_EXP_G || t->slot == LM_S_EXP_U || t->slot == LM_S_EXP_D) {
        int64_t E = c->n_experts, Im = c->moe_intermediate, x = t->expert;
        int down = t->slot == LM_S_EXP_D;
        f->ndim = 3;
        f->shape[0] = E;
        f->shape[1] = down ? H : 2 * Im;
        f->shape[2] = down ? Im : H;
        f->off = (size_t)(down ? x * H * Im : (2 * x + (t->slot == LM_S_EXP_U)) * Im * H);
        f->first = x == 0 && t->slot != LM_S_EXP_U;
        return 1;
    }
    int64_t S = c->shared_intermediate; /* GraniteMoeShared's shared_mlp.input_linear */
    f->ndim = 2;
    f->shape[0] = 2 * S;
    f->shape[1] = H;
    f->off = (size_t)(t->slot == LM_S_WU ? S * H : 0);
    f->first = t->slot == LM_S_WG;
    return 1;
}

int hf_fuses_tensors(const lm_config *c) { return c->n_experts > 0 && c->moe_keys == LM_MOE_KEYS_GRANITE; }

/* Whether NAME is a fused file tensor hf_fused_piece maps some table tensor of M into. */
static int hf_is_fused_name(const lm_model *m, const char *name) {
    hf_fused f;
    for (int i = 0; i < m->n_tensors; i++)
        if (hf_fused_piece(&m->cfg, &m->tensors[i], &f) && f.first && !strcmp(f.name, name)) return 1;
    return 0;
}

/* Whether NAME is a sparse layer's router selection bias of M's family (lm_router_bias_name). */
static int hf_is_router_bias(const lm_model *m, const char *name) {
    char bn[LM_NAME_MAX];
    for (int l = 0; l < m->cfg.n_layers; l++)
        if (lm_router_bias_name(&m->cfg, l, bn, sizeof bn) && !strcmp(bn, name)) return 1;
    return 0;
}

/* ERNIE 4.5 MoE's e_score_correction_bias [1, E] (or [E]) of layer l: a frozen buffer that
 * transformers adds to the probabilities only to choose the experts; ctitan routes by it the
 * same way (lm_moe_state.bias) and writes it back. bias [L, E] receives it (NULL: checked only).
 * Absent, transformers zeros it, and so does the caller's bias. */
static int hf_read_router_bias(const lm_model *m, const st_tensor *st, const char *file, float *bias, ct_err *e) {
    int64_t E = m->cfg.n_experts;
    int shape_ok = (st->ndim == 2 && st->shape[0] == 1 && st->shape[1] == E) || (st->ndim == 1 && st->shape[0] == E);
    if (!shape_ok)
        return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" must have shape [1, %lld] or [%lld]", file, st->name,
                       (long long)E, (long long)E);
    int l = 0;
    char bn[LM_NAME_MAX];
    while (l < m->cfg.n_layers && !(lm_router_bias_name(&m->cfg, l, bn, sizeof bn) && !strcmp(bn, st->name))) l++;
    float *v = ct_calloc((size_t)E, sizeof(float)); /* [E] */
    int rc = 0;
    if (ct_convert_to_f32(v, st->data, st->dtype, (size_t)E) != 0)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s; expected F32, BF16, F16 or F64", file,
                     st->name, ct_dtype_name(st->dtype));
    if (!rc) rc = ct_check_finite(v, (size_t)E, 0, file, st->name, e);
    if (!rc && bias) memcpy(bias + (size_t)l * E, v, (size_t)E * sizeof(float));
    free(v);
    return rc;
}

int hf_ckpt_router_bias(const lm_model *m, const char *dir, float *bias, ct_err *e) {
    char bn[LM_NAME_MAX], path[4200];
    int has = 0;
    for (int l = 0; l < m->cfg.n_layers; l++) has |= lm_router_bias_name(&m->cfg, l, bn, sizeof bn);
    snprintf(path, sizeof path, "%s/state.json", dir);
    if (!has || !bias || access(path, F_OK) != 0) return 0;
    cJSON *o = json_parse_file(path, (size_t)1 << 30, e);
    if (!o) return e ? e->code : CT_ERR_FORMAT;
    const cJSON *b = cJSON_GetObjectItemCaseSensitive(o, "moe_expert_bias"), *v;
    size_t nb = (size_t)m->cfg.n_layers * m->cfg.n_experts, i = 0;
    int bad = b && (!cJSON_IsArray(b) || (size_t)cJSON_GetArraySize(b) != nb);
    for (v = b && !bad ? b->child : NULL; v; v = v->next) /* a double beyond float range does not convert */
        bad |= !cJSON_IsNumber(v) || !(fabs(v->valuedouble) <= FLT_MAX);
    int rc = 0;
    if (bad)
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: \"moe_expert_bias\" must hold %zu numbers (layers x experts)", path, nb);
    if (b && !rc) cJSON_ArrayForEach(v, b) bias[i++] = (float)v->valuedouble;
    cJSON_Delete(o);
    return rc;
}

int hf_load(lm_model *m, const char *dir, ct_err *e) {
    lm_copy_ctx cc;
    lm_sink sink = lm_copy_sink(&cc, m, NULL, NULL);
    return hf_load_each(m, dir, &sink, m->moe.bias, e);
}

int hf_load_each(const lm_model *m, const char *dir, const lm_sink *sink, float *router_bias, ct_err *e) {
    /* A training checkpoint's step-N is an HF directory too (config.json,
     * model.safetensors) and is loaded as one by generate, import and
     * initial_load_path: its manifest is checked first, or a damaged
     * checkpoint would load there as if intact. */
    char mpath[4200];
    snprintf(mpath, sizeof mpath, "%s/manifest.json", dir);
    if (access(mpath, F_OK) == 0) {
        int vrc = ckpt_verify(dir, e);
        if (vrc) return vrc;
    }
    st_set *s = st_set_open(dir, e);
    if (!s) return e ? e->code : CT_ERR_IO;
    if (router_bias && m->cfg.n_experts > 0) /* [L, E] an absent bias is zero (transformers' init) */
        memset(router_bias, 0, (size_t)m->cfg.n_layers * m->cfg.n_experts * sizeof(float));
    int rc = 0;
    size_t most = 1;
    for (int i = 0; i < m->n_tensors; i++) {
        size_t b = lm_block_rows(m, &m->tensors[i]) * lm_tensor_cols(&m->tensors[i]);
        most = b > most ? b : most;
    }
    float *buf = ct_malloc(most * sizeof(float)); /* [block] rows converted to fp32 a block at a time */
    /* bytes of the stored tensors drive the bar; shown only when loading takes over HF_PROG_MIN_S */
    double total = 0;
    for (int i = 0; i < m->n_tensors; i++) {
        const st_tensor *st = m->tensors[i].lora ? NULL : st_set_find(s, m->tensors[i].name, NULL);
        hf_fused fz;
        if (!st && !m->tensors[i].lora && hf_fused_piece(&m->cfg, &m->tensors[i], &fz) &&
            (st = st_set_find(s, fz.name, NULL)))
            total += (double)m->tensors[i].numel * (double)ct_dtype_size(st->dtype);
        else if (st) total += (double)st->numel * (double)ct_dtype_size(st->dtype);
    }
    prog_bar bar;
    prog_begin(&bar, "load HF model", total, "B", HF_PROG_MIN_S);
    for (int i = 0; i < m->n_tensors && !rc; i++) {
        const lm_tensor *t = &m->tensors[i];
        if (t->lora) continue; /* adapters are not part of an HF model (model/lora.h loads them) */
        const char *file = NULL;
        const st_tensor *st = st_set_find(s, t->name, &file);
        /* a piece of a fused tensor (GraniteMoE) where the file does not hold it under
         * the table's own name (ctitan's checkpoints do) */
        hf_fused fz;
        int fused = !st && hf_fused_piece(&m->cfg, t, &fz);
        if (fused) st = st_set_find(s, fz.name, &file);
        const char *want_name = fused ? fz.name : t->name;
        if (!st) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: missing tensor \"%s\" (the model needs it)", dir, want_name);
            break;
        }
        int want_nd = fused ? fz.ndim : t->ndim;
        const int64_t *want_shape = fused ? fz.shape : t->shape;
        int same = st->ndim == want_nd;
        for (int d = 0; same && d < want_nd; d++) same = st->shape[d] == want_shape[d];
        if (!same) {
            char got[128], want[128];
            shape_str(got, sizeof got, st->ndim, st->shape);
            shape_str(want, sizeof want, want_nd, want_shape);
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has shape %s, the model expects %s", file, want_name,
                         got, want);
            break;
        }
        size_t cols = lm_tensor_cols(t), rows = t->numel / cols, step = lm_block_rows(m, t);
        size_t es = ct_dtype_size(st->dtype);
        const char *base = (const char *)st->data + (fused ? fz.off * es : 0);
        for (size_t r0 = 0; r0 < rows && !rc; r0 += step) {
            size_t r1 = r0 + step < rows ? r0 + step : rows;
            if (ct_convert_to_f32(buf, base + r0 * cols * es, st->dtype, (r1 - r0) * cols) != 0)
                rc = ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" has dtype %s; expected F32, BF16, F16 or F64",
                             file, t->name, ct_dtype_name(st->dtype));
            else
                /* a NaN or Inf weight (a flipped exponent bit, a diverged run saved as HF) would
                 * train to a NaN loss or generate one token forever */
                rc = ct_check_finite(buf, (r1 - r0) * cols, r0 * cols, file, t->name, e);
            if (!rc) sink->put(sink->ctx, LM_PARAMS, i, r0, r1, buf);
            prog_add(&bar, (double)((r1 - r0) * cols * es));
        }
        st_drop(st);
    }
    free(buf);
    if (rc) prog_break(&bar);
    else prog_end(&bar);
    for (int i = 0; i < st_set_count(s) && !rc; i++) {
        const st_tensor *st = st_set_get(s, i);
        if (lm_find(m, st->name) || hf_is_fused_name(m, st->name)) continue;
        const char *file = NULL;
        st_set_find(s, st->name, &file);
        if (hf_is_router_bias(m, st->name)) {
            rc = hf_read_router_bias(m, st, file ? file : dir, router_bias, e);
            continue;
        }
        if (m->cfg.tie_embeddings && strcmp(st->name, "lm_head.weight") == 0) {
            rc = hf_check_tied_head(s, st, file ? file : dir, e);
            continue;
        }
        int ml = -1, at = 0; /* GLM-4.5's MTP layers after the last: transformers' from_pretrained drops them */
        if (m->cfg.mtp_layers > 0 && sscanf(st->name, "model.layers.%d.%n", &ml, &at) == 1 && at > 0 &&
            ml >= m->cfg.n_layers && ml < m->cfg.n_layers + m->cfg.mtp_layers)
            continue;
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: unexpected tensor \"%s\" (not part of this model)", file ? file : dir,
                     st->name);
    }
    st_set_close(s);
    /* a training checkpoint's model.safetensors holds the table's tensors alone: its
     * selection biases are in its state.json (trainer_ckpt.c) */
    if (!rc && access(mpath, F_OK) == 0) rc = hf_ckpt_router_bias(m, dir, router_bias, e);
    return rc;
}

static size_t hf_numel(const st_wtensor *t) {
    size_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= (size_t)t->shape[d];
    return n;
}

size_t hf_file_tensor_cap(const lm_model *m) { return (size_t)m->n_tensors + (size_t)m->cfg.n_layers + 1; }

int hf_file_tensors(const lm_model *m, ct_dtype dtype, st_wtensor *ts, char (*names)[LM_NAME_MAX]) {
    int n = 0;
    for (int j = 0; j < m->n_tensors; j++) {
        const lm_tensor *t = &m->tensors[j];
        if (t->lora) continue; /* an HF model has no adapters: the base alone (to fold them in: lora_merge first) */
        hf_fused fz;
        int fu = hf_fused_piece(&m->cfg, t, &fz);
        if (fu && !fz.first) continue; /* written with the piece that starts its file tensor */
        st_wtensor *w = &ts[n++];
        *w = (st_wtensor){.name = t->name, .dtype = dtype, .src_dtype = CT_F32, .ndim = t->ndim};
        for (int d = 0; d < t->ndim; d++) w->shape[d] = t->shape[d];
        if (fu) { /* the fused tensor's own name (kept in names) and shape */
            snprintf(names[n - 1], LM_NAME_MAX, "%s", fz.name);
            w->name = names[n - 1];
            w->ndim = fz.ndim;
            for (int d = 0; d < fz.ndim; d++) w->shape[d] = fz.shape[d];
        }
        int brank = t->slot == LM_S_ROUTER ? lm_router_bias_name(&m->cfg, t->layer, names[n], LM_NAME_MAX) : 0;
        if (brank) {
            /* the selection bias after its router (hf_write_unit): ERNIE 4.5 MoE's [1, E], GLM-4.5's [E] */
            ts[n] = (st_wtensor){.name = names[n], .dtype = dtype, .src_dtype = CT_F32, .ndim = brank,
                                 .shape = {brank == 2 ? 1 : m->cfg.n_experts, m->cfg.n_experts}};
            n++;
        }
    }
    return n;
}

/* One run of floats to the stream in HF_SAVE_CHUNK pieces (the bar follows). */
static int hf_write_run(st_dir_stream *d, const float *x, size_t numel, size_t es, prog_bar *bar, ct_err *e) {
    for (size_t off = 0; off < numel; off += HF_SAVE_CHUNK) {
        size_t k = numel - off < HF_SAVE_CHUNK ? numel - off : HF_SAVE_CHUNK;
        int rc = st_dir_stream_write(d, x + off, k, e);
        if (rc) return rc;
        if (bar) prog_add(bar, (double)(k * es));
    }
    return 0;
}

int hf_write_unit(const lm_model *m, const float *router_bias, int i0, int i1, const float *x, st_dir_stream *d,
                  size_t es, prog_bar *bar, ct_err *e) {
    size_t base = m->tensors[i0].offset;
    for (int j = i0; j < i1; j++) {
        const lm_tensor *t = &m->tensors[j];
        hf_fused fz;
        if (t->lora) continue;
        if (!hf_fused_piece(&m->cfg, t, &fz)) {
            int rc = hf_write_run(d, x + (t->offset - base), t->numel, es, bar, e);
            char bn[LM_NAME_MAX];
            if (!rc && t->slot == LM_S_ROUTER && lm_router_bias_name(&m->cfg, t->layer, bn, sizeof bn)) {
                size_t E = (size_t)m->cfg.n_experts;
                float *b = ct_calloc(E, sizeof(float)); /* [E] the layer's selection bias (none: zeros) */
                if (router_bias) memcpy(b, router_bias + (size_t)t->layer * E, E * sizeof(float));
                rc = hf_write_run(d, b, E, es, bar, e);
                free(b);
            }
            if (rc) return rc;
            continue;
        }
        if (!fz.first) continue;
        /* the fused tensor's pieces (all in this unit: one layer's), in the file's element
         * order: they tile it, so the next starts where the last ended */
        char name[LM_NAME_MAX];
        snprintf(name, sizeof name, "%s", fz.name);
        for (size_t at = 0;;) {
            const lm_tensor *next = NULL;
            for (int k = i0; k < i1 && !next; k++)
                if (hf_fused_piece(&m->cfg, &m->tensors[k], &fz) && !strcmp(fz.name, name) && fz.off == at)
                    next = &m->tensors[k];
            if (!next) break;
            int rc = hf_write_run(d, x + (next->offset - base), next->numel, es, bar, e);
            if (rc) return rc;
            at += next->numel;
        }
    }
    return 0;
}

int hf_save(const lm_model *m, const char *dir, ct_dtype dtype, size_t max_shard_bytes, ct_err *e) {
    int rc = ct_mkdirs(dir, e);
    if (rc) return rc;
    st_wtensor *ts = ct_calloc(hf_file_tensor_cap(m), sizeof *ts);
    char (*names)[LM_NAME_MAX] = ct_calloc(hf_file_tensor_cap(m), sizeof *names);
    int n = hf_file_tensors(m, dtype, ts, names);
    const char *meta[] = {"format", "pt", NULL};
    if (max_shard_bytes == 0) max_shard_bytes = (size_t)5 << 30;
    /* streamed tensor by tensor (the files st_write_dir writes) so the bar can follow */
    double total = 0;
    for (int i = 0; i < n; i++) total += (double)hf_numel(&ts[i]);
    prog_bar bar;
    size_t es = ct_dtype_size(dtype);
    prog_begin(&bar, "save HF model", total * (double)es, "B", HF_PROG_MIN_S);
    st_dir_stream *d = NULL;
    rc = st_dir_stream_open(&d, dir, ts, n, max_shard_bytes, meta, e);
    if (!rc) rc = hf_write_unit(m, m->moe.bias, 0, m->n_tensors, m->params + m->tensors[0].offset, d, es, &bar, e);
    if (!rc) rc = st_dir_stream_close(d, e);
    else if (d) st_dir_stream_abort(d);
    if (rc) prog_break(&bar);
    else prog_end(&bar);
    free(ts);
    free(names);
    if (rc) return rc;
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", dir);
    return lm_config_write_hf(&m->cfg, path, torch_dtype_name(dtype), e);
}

/* --------------------------------------------------- beside the weights */

static const char *const hf_asset_files[] = {"tokenizer.json",          "tokenizer_config.json",
                                             "vocab.json",              "merges.txt",
                                             "generation_config.json", "special_tokens_map.json",
                                             "added_tokens.json",       "chat_template.jinja"};

/* Copies SRC to DST through DST.tmp (core/fs: fsync, rename): a reader never sees half a file. */
static int hf_copy_file(const char *src, const char *dst, ct_err *e) {
    FILE *in = fopen(src, "rb");
    if (!in) return ct_fail(e, CT_ERR_IO, "%s: cannot open: %s", src, strerror(errno));
    fs_atomic out;
    int rc = fs_atomic_open(&out, dst, e);
    char buf[65536];
    size_t k;
    int ok = 1;
    while (!rc && ok && (k = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, k, out.fp) == k;
    int rerr = ferror(in);
    fclose(in);
    if (rc) return rc;
    if (rerr) {
        fs_atomic_abort(&out);
        return ct_fail(e, CT_ERR_IO, "%s: read failed", src);
    }
    return fs_atomic_commit(&out, e); /* a failed fwrite is "DST: write failed" */
}

int hf_copy_assets(const char *src, const char *out, FILE *log, ct_err *e) {
    int n = 0;
    for (size_t i = 0; i < sizeof hf_asset_files / sizeof hf_asset_files[0]; i++) {
        char *s = fs_join(src, hf_asset_files[i]), *d = fs_join(out, hf_asset_files[i]);
        int skip = access(s, R_OK) != 0, rc = skip ? 0 : hf_copy_file(s, d, e);
        free(s);
        free(d);
        if (rc) return -1;
        if (skip) continue;
        if (log) fprintf(log, "  copied %s\n", hf_asset_files[i]);
        n++;
    }
    return n;
}

/* A token id as config.json may give it: an integer, a list of them, or null. */
static int hf_token_id_ok(const cJSON *v) {
    if (cJSON_IsNull(v)) return 1;
    if (cJSON_IsNumber(v))
        return v->valuedouble >= 0 && v->valuedouble < 2147483648.0 && v->valuedouble == floor(v->valuedouble);
    if (!cJSON_IsArray(v)) return 0;
    const cJSON *x;
    cJSON_ArrayForEach(x, v) if (!cJSON_IsNumber(x) || !hf_token_id_ok(x)) return 0;
    return 1;
}

/* Whether every id of v (checked by hf_token_id_ok) is below vocab. */
static int hf_token_ids_below(const cJSON *v, double vocab) {
    if (cJSON_IsNumber(v)) return v->valuedouble < vocab;
    const cJSON *x;
    cJSON_ArrayForEach(x, v) if (!hf_token_ids_below(x, vocab)) return 0;
    return 1; /* null, or every element */
}

int hf_keep_token_ids(const char *path, const char *const *src, int n, ct_err *e) {
    static const char *const keys[] = {"bos_token_id", "eos_token_id"};
    enum { NKEYS = sizeof keys / sizeof keys[0] };
    cJSON *from = NULL;
    for (int i = 0; i < n && !from; i++) {
        if (!src[i] || !src[i][0]) continue;
        char *p = fs_join(src[i], "config.json");
        ct_err ignore = {0};
        /* an unreadable or malformed source is the loader's to report; here it just has no ids */
        from = access(p, R_OK) == 0 ? json_parse_file(p, 1 << 24, &ignore) : NULL;
        free(p);
        int any = 0;
        for (int k = 0; from && k < NKEYS; k++) any |= cJSON_GetObjectItemCaseSensitive(from, keys[k]) != NULL;
        if (!any) {
            cJSON_Delete(from);
            from = NULL;
        }
    }
    if (!from) return 0;
    size_t len = 0;
    char *text = fs_read_file(path, 1 << 24, &len, e);
    cJSON *have = text ? json_parse(text, len, path, e) : NULL;
    int rc = have ? 0 : e ? e->code : CT_ERR_FORMAT;
    /* inserted before the closing brace, in cJSON_Print's layout, so every byte
     * written before (floats such as 1.0 included) stays as it was */
    size_t end = len;
    while (!rc && end > 0 && text[end - 1] != '}') end--;
    if (!rc && end == 0) rc = ct_fail(e, CT_ERR_FORMAT, "%s: not a JSON object", path);
    char *add = NULL;
    size_t add_len = 0;
    FILE *m = rc ? NULL : open_memstream(&add, &add_len);
    /* ids of another model's config (a native flavor beside a Qwen3 hf_assets_path) that
     * this model's vocabulary lacks would never be generated: transformers would not stop */
    const cJSON *vs = cJSON_GetObjectItemCaseSensitive(have, "vocab_size");
    double vocab = cJSON_IsNumber(vs) && vs->valuedouble > 0 ? vs->valuedouble : -1;
    for (int k = 0; m && k < NKEYS; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(from, keys[k]);
        if (!v || !hf_token_id_ok(v) || cJSON_GetObjectItemCaseSensitive(have, keys[k])) continue;
        if (vocab > 0 && !hf_token_ids_below(v, vocab)) {
            char *val = cJSON_PrintUnformatted(v);
            fprintf(stderr, "ctitan: warning: %s: %s %s of the source config.json is outside this model's "
                    "vocabulary of %.0f ids: not written\n", path, keys[k], val ? val : "?", vocab);
            free(val);
            continue;
        }
        char *val = cJSON_PrintUnformatted(v);
        fprintf(m, ",\n\t\"%s\":\t%s", keys[k], val);
        free(val);
    }
    if (m) fclose(m);
    if (!rc && add_len) {
        size_t close = end - 1; /* the object's closing brace; the text before it ends with its last member */
        while (close > 0 && (text[close - 1] == '\n' || text[close - 1] == '\t' || text[close - 1] == ' ')) close--;
        char *out = ct_malloc(len + add_len + 2);
        size_t skip = close > 0 && text[close - 1] == '{'; /* no member before: no comma */
        memcpy(out, text, close);
        memcpy(out + close, add + skip, add_len - skip);
        size_t k = close + add_len - skip;
        out[k++] = '\n';
        memcpy(out + k, text + end - 1, len - (end - 1));
        k += len - (end - 1);
        rc = fs_write_atomic(path, out, k, e);
        free(out);
    }
    free(add);
    cJSON_Delete(have);
    cJSON_Delete(from);
    free(text);
    return rc;
}

/* ------------------------------------------------------------ generation */

typedef struct {
    const char *dir, *adapter;
} hf_gen_src;

static int hf_gen_load(lm_model *m, void *ctx, ct_err *e) {
    const hf_gen_src *src = ctx;
    int rc = hf_load(m, src->dir, e);
    if (!rc && src->adapter) {
        lm_copy_ctx cc;
        lm_sink sink = lm_copy_sink(&cc, m, NULL, NULL);
        rc = lora_load_peft_each(m, src->adapter, &sink, e);
    }
    return rc;
}

int hf_gen_open(gen_model **out, const char *dir, const char *adapter, int max_len, ct_err *e) {
    *out = NULL;
    lm_config cfg;
    double alpha;
    int rslora;
    int rc = lm_config_from_hf(&cfg, dir, e);
    if (!rc && adapter) rc = lora_read_config(adapter, &cfg, &alpha, &rslora, e);
    hf_gen_src src = {dir, adapter};
    if (!rc) rc = gen_model_new(out, &cfg, max_len, hf_gen_load, &src, e);
    return rc;
}
