/* tests/c/model/test_lora.c: model/lora.c and the LoRA path of model/lm.c, in C
 * so that `make sanitize` runs them under ASan/UBSan (the parity with PEFT is
 * tests/py/test_lora*.py):
 *   - target lists, the frozen choice (freeze patterns, PEFT's modules_to_save
 *     suffix rule) and its errors;
 *   - the adapter's gradient against central finite differences of the loss
 *     (double-checked in float: 2e-2 relative), the base's gradient views NULL;
 *   - B = 0 leaves the logits of the base; dropout masks replay for the same
 *     seed and change with it;
 *   - a PEFT adapter directory written and read back bit for bit, and lora_merge
 *     giving the unmerged logits. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"
#include "model/lora.h"
#include "model/lm.h"

static lm_config tiny(int lora_rank, float dropout) {
    lm_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = 37, c.hidden = 16, c.intermediate = 24, c.n_layers = 2, c.n_heads = 4, c.n_kv_heads = 2;
    c.head_dim = 8, c.max_pos = 64, c.rope_theta = 1e4, c.rms_eps = 1e-6, c.decoder_sparse_step = 1;
    snprintf(c.name, sizeof c.name, "tiny");
    c.lora_rank = lora_rank;
    c.lora_targets = (1u << LM_LORA_N) - 1;
    c.lora_scale = lora_scaling(8.0, lora_rank > 0 ? lora_rank : 1, 0);
    c.lora_dropout = dropout;
    c.lazy_buffers = 1;
    return c;
}

static void fill_tokens(int32_t *tok, int32_t *lab, int n, int V) {
    for (int i = 0; i < n; i++) tok[i] = (i * 7 + 3) % V, lab[i] = (i * 5 + 1) % V;
    lab[2] = -100;
}

static void test_choices(void) {
    ct_err e;
    lm_config tc = tiny(2, 0);
    CHECK(lora_parse_targets("q_proj,down_proj", &tc, "t", &e) == 0 &&
              tc.lora_targets == ((1u << LM_LORA_Q) | (1u << LM_LORA_DOWN)),
          "targets %x", tc.lora_targets);
    /* PEFT's suffix rule: one layer's module */
    CHECK(lora_parse_targets("q_proj,layers.1.mlp.down_proj", &tc, "t", &e) == 0 && lm_lora_on(&tc, 1, LM_LORA_DOWN) &&
              !lm_lora_on(&tc, 0, LM_LORA_DOWN) && lm_lora_on(&tc, 0, LM_LORA_Q),
          "per-layer targets");
    CHECK(lora_parse_targets("q_proj,c_attn", &tc, "t", &e) == CT_ERR_CONFIG && strstr(e.msg, "c_attn"), "%s",
          e.msg);
    CHECK(fabsf(lora_scaling(8, 4, 0) - 2.0f) < 1e-7f && fabsf(lora_scaling(8, 4, 1) - 4.0f) < 1e-7f, "scaling");

    lm_model m;
    lm_config c = tiny(2, 0);
    lm_layout(&m, &c);
    CHECK(lora_apply_frozen(&m, "", "norm", "t", &e) == 0, "%s", e.msg);
    int norms = 0, bad = 0;
    for (int i = 0; i < m.n_tensors; i++) {
        const lm_tensor *t = &m.tensors[i];
        int is_norm = strstr(t->name, "norm.weight") != NULL; /* model.norm, *_layernorm, q_norm, k_norm */
        norms += is_norm;
        bad += t->frozen != !(t->lora || is_norm);
    }
    CHECK(norms == 1 + 2 * 4 && !bad, "modules_to_save norm: %d norms, %d tensors wrong", norms, bad);
    CHECK(lora_apply_frozen(&m, "model.layers.1.*", "", "t", &e) == 0, "%s", e.msg);
    const lm_tensor *a1 = lm_find(&m, "model.layers.1.self_attn.q_proj.lora_A.weight");
    const lm_tensor *a0 = lm_find(&m, "model.layers.0.self_attn.q_proj.lora_A.weight");
    CHECK(a1 && a1->frozen && a0 && !a0->frozen, "freeze pattern on adapters");
    CHECK(lora_apply_frozen(&m, "model.nothing.*", "", "t", &e) == CT_ERR_CONFIG && strstr(e.msg, "model.nothing.*"),
          "%s", e.msg);
    CHECK(lora_apply_frozen(&m, "", "c_proj", "t", &e) == CT_ERR_CONFIG && strstr(e.msg, "c_proj"), "%s", e.msg);
    CHECK(lora_apply_frozen(&m, "*", "", "t", &e) == CT_ERR_CONFIG && strstr(e.msg, "every tensor"), "%s", e.msg);
    lm_free(&m);
}

/* A model with random weights and random (non-zero) adapters, the base frozen. */
static void make(lm_model *m, int r, float dropout, ct_err *e) {
    lm_config c = tiny(r, dropout);
    CHECK(lm_create(m, &c, 2, 8, e) == 0, "%s", e->msg);
    lm_init_random(m, 5);
    for (int i = 0; i < m->n_tensors; i++) { /* adapters: init draws nothing for them */
        const lm_tensor *t = &m->tensors[i];
        for (size_t j = 0; t->lora && j < t->numel; j++) m->params[t->offset + j] = 0.05f * (float)sin(3.0 * j + i);
    }
    CHECK(lora_apply_frozen(m, "", "", "t", e) == 0, "%s", e->msg);
}

static double loss_of(lm_model *m, const int32_t *tok, const int32_t *lab) {
    long nv = 0;
    double s = lm_loss(m, tok, lab, 2, 8, &nv);
    return s / (double)nv;
}

static void test_gradient(void) {
    ct_err e;
    lm_model m;
    make(&m, 3, 0, &e);
    int32_t tok[16], lab[16];
    fill_tokens(tok, lab, 16, m.cfg.vocab_size);
    long nv = 0;
    for (int i = 0; i < 16; i++) nv += lab[i] != -100;
    lm_forward_backward(&m, tok, lab, 2, 8, 1.0f / (float)nv, NULL);
    CHECK(m.g.layer[0].wq == NULL && m.g.wte == NULL && m.g.layer[1].lora_a[LM_LORA_V] != NULL,
          "frozen base: no gradient views; adapters: views");
    const char *names[] = {"model.layers.0.self_attn.q_proj.lora_A.weight", "model.layers.0.self_attn.q_proj.lora_B.weight",
                           "model.layers.1.mlp.down_proj.lora_A.weight", "model.layers.1.self_attn.o_proj.lora_B.weight",
                           "model.layers.0.mlp.up_proj.lora_A.weight"};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++) {
        const lm_tensor *t = lm_find(&m, names[k]);
        CHECK(t != NULL, "%s", names[k]);
        if (!t) continue;
        for (size_t j = 0; j < t->numel; j += t->numel / 3 + 1) {
            float *p = m.params + t->offset + j, keep = *p, h = 1e-2f;
            *p = keep + h;
            double up = loss_of(&m, tok, lab);
            *p = keep - h;
            double dn = loss_of(&m, tok, lab);
            *p = keep;
            double fd = (up - dn) / (2.0 * h), an = m.grads[t->offset + j];
            CHECK(fabs(fd - an) <= 2e-2 * fabs(fd) + 1e-4, "%s[%zu]: analytic %.6g, finite differences %.6g", names[k], j,
                  an, fd);
        }
    }
    lm_free(&m);
}

static void test_zero_b_and_dropout(void) {
    ct_err e;
    lm_model m, base;
    make(&m, 2, 0.3f, &e);
    lm_config c0 = tiny(0, 0);
    CHECK(lm_create(&base, &c0, 2, 8, &e) == 0, "%s", e.msg);
    lm_init_random(&base, 5);
    int32_t tok[16], lab[16];
    fill_tokens(tok, lab, 16, m.cfg.vocab_size);
    for (int i = 0; i < m.n_tensors; i++)
        if (strstr(m.tensors[i].name, "lora_B")) memset(m.params + m.tensors[i].offset, 0, m.tensors[i].numel * 4);
    size_t nl = 16 * (size_t)m.cfg.vocab_size;
    float *l1 = malloc(nl * 4), *l2 = malloc(nl * 4);
    lm_logits(&m, tok, 2, 8, l1);
    lm_logits(&base, tok, 2, 8, l2);
    double d = 0;
    for (size_t i = 0; i < nl; i++) d = fmax(d, fabs(l1[i] - l2[i]));
    CHECK(d <= 1e-6, "B = 0: logits differ from the base model's by %g", d);
    /* dropout: same seed, same gradient; another seed, another one */
    const lm_tensor *a = lm_find(&m, "model.layers.0.self_attn.k_proj.lora_A.weight"); /* B != 0 needed */
    for (int i = 0; i < m.n_tensors; i++)
        if (m.tensors[i].lora) for (size_t j = 0; j < m.tensors[i].numel; j++) m.params[m.tensors[i].offset + j] = 0.05f;
    float *g[3];
    for (int run = 0; run < 3; run++) {
        memset(m.grads + a->offset, 0, a->numel * 4);
        m.lora_seed = run == 2 ? 99 : 7;
        lm_forward_backward(&m, tok, lab, 2, 8, 0.1f, NULL);
        g[run] = malloc(a->numel * 4);
        memcpy(g[run], m.grads + a->offset, a->numel * 4);
    }
    CHECK(!memcmp(g[0], g[1], a->numel * 4), "dropout masks do not replay for the same seed");
    CHECK(memcmp(g[0], g[2], a->numel * 4) != 0, "dropout masks do not change with the seed");
    for (int run = 0; run < 3; run++) free(g[run]);
    free(l1);
    free(l2);
    lm_free(&m);
    lm_free(&base);
}

static void test_files_and_merge(void) {
    ct_err e;
    lm_model m, n;
    make(&m, 2, 0, &e);
    make(&n, 2, 0, &e);
    char dir[] = "/tmp/ct_test_lora_XXXXXX";
    CHECK(mkdtemp(dir) != NULL, "mkdtemp");
    const float **data = calloc((size_t)m.n_tensors, sizeof *data);
    for (int i = 0; i < m.n_tensors; i++) data[i] = m.params + m.tensors[i].offset;
    CHECK(lora_save_peft(&m, data, dir, "base", 8.0, 0, 0.0, "", &e) == 0, "%s", e.msg);
    for (int i = 0; i < n.n_tensors; i++)
        if (n.tensors[i].lora) memset(n.params + n.tensors[i].offset, 0, n.tensors[i].numel * 4);
    lm_copy_ctx cc;
    lm_sink s = lm_copy_sink(&cc, &n, NULL, NULL);
    CHECK(lora_load_peft_each(&n, dir, &s, &e) == 0, "%s", e.msg);
    int same = 1;
    for (int i = 0; i < m.n_tensors; i++)
        if (m.tensors[i].lora) same &= !memcmp(m.params + m.tensors[i].offset, n.params + n.tensors[i].offset,
                                               m.tensors[i].numel * 4);
    CHECK(same, "adapter read back differs from the one written");
    /* a model of another rank refuses it by name */
    lm_model o;
    make(&o, 3, 0, &e);
    lm_copy_ctx co;
    lm_sink so = lm_copy_sink(&co, &o, NULL, NULL);
    CHECK(lora_load_peft_each(&o, dir, &so, &e) == CT_ERR_CONFIG && strstr(e.msg, "adapter_config.json"), "%s", e.msg);
    /* merged weights give the unmerged logits */
    int32_t tok[16], lab[16];
    fill_tokens(tok, lab, 16, m.cfg.vocab_size);
    size_t nl = 16 * (size_t)m.cfg.vocab_size;
    float *l1 = malloc(nl * 4), *l2 = malloc(nl * 4);
    lm_logits(&m, tok, 2, 8, l1);
    lora_merge(&m);
    lm_logits(&m, tok, 2, 8, l2);
    double d = 0, mx = 0;
    for (size_t i = 0; i < nl; i++) d = fmax(d, fabs(l1[i] - l2[i])), mx = fmax(mx, fabs(l1[i]));
    CHECK(d <= 1e-5 * mx, "merged logits differ by %g (max %g)", d, mx);
    ct_rm_tree(dir, NULL);
    free(data);
    free(l1);
    free(l2);
    lm_free(&m);
    lm_free(&n);
    lm_free(&o);
}

int main(void) {
    test_choices();
    test_gradient();
    test_zero_b_and_dropout();
    test_files_and_merge();
    return CHECK_DONE();
}
