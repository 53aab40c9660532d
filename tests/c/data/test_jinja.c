/* tests/c/data/test_jinja.c: the chat-template interpreter (data/jinja.h) without Python.
 *
 * The expected strings are what transformers' jinja2 environment renders for the same
 * template and variables (tests/py/test_chat_template.py compares the two directly, over
 * the published templates); here they guard the C build on machines without the venv. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"
#include "data/jinja.h"

/* renders src with vars (JSON text); returns the malloc'd output or NULL with e set */
static char *render(const char *src, const char *vars, jinja_spans *spans, ct_err *e) {
    jinja_tmpl *t = NULL;
    char *out = NULL;
    size_t n = 0;
    cJSON *v = cJSON_Parse(vars);
    if (!jinja_parse(src, strlen(src), "t.jinja", &t, e) && jinja_render(t, v, &out, &n, spans, e)) out = NULL;
    jinja_free(t);
    cJSON_Delete(v);
    return out;
}

static void check_render(const char *src, const char *vars, const char *want) {
    ct_err e = {0};
    char *got = render(src, vars, NULL, &e);
    CHECK(got && !strcmp(got, want), "%s\n  got  [%s]%s\n  want [%s]", src, got ? got : "(error)", got ? "" : e.msg,
          want);
    free(got);
}

static void check_error(const char *src, const char *needle) {
    ct_err e = {0};
    char *got = render(src, "{}", NULL, &e);
    CHECK(!got && strstr(e.msg, "t.jinja") && strstr(e.msg, needle), "%s: [%s] lacks [%s]", src,
          got ? got : e.msg, needle);
    free(got);
}

/* head repeated n times, then core, then tail repeated n times (malloc'd) */
static char *nested(const char *pre, const char *head, int n, const char *core, const char *tail, const char *post) {
    size_t lh = strlen(head), lt = strlen(tail), k = 0;
    char *s = malloc(strlen(pre) + (size_t)n * (lh + lt) + strlen(core) + strlen(post) + 1);
    k += (size_t)sprintf(s, "%s", pre);
    for (int i = 0; i < n; i++, k += lh) memcpy(s + k, head, lh);
    k += (size_t)sprintf(s + k, "%s", core);
    for (int i = 0; i < n; i++, k += lt) memcpy(s + k, tail, lt);
    sprintf(s + k, "%s", post);
    return s;
}

/* How deep the refused forms nest: 1,000,000 (past any stack), or under qemu-user
 * (CTITAN_EMULATED, scripts/test_aarch64.sh) 1,000: four times the limit, so every path
 * still meets it there, at a thousandth of the lexing (the 1,000,000 of the native run and
 * of the sanitized one were nearly all of the emulated test's 24 CPU s: 0.1 s at 1,000). */
static int too_deep = 1000000;

/* The form nested n deep renders want (NULL: renders at all, or fails for another reason than
 * depth), and nested too_deep fails cleanly (no stack overflow) naming the file, line and
 * limit. The templates are too long to print. */
static void check_depth(const char *what, const char *pre, const char *head, int n, const char *core,
                        const char *tail, const char *post, const char *want) {
    ct_err e = {0};
    char *src = nested(pre, head, n, core, tail, post), *got = render(src, "{}", NULL, &e);
    CHECK(want ? got && !strcmp(got, want) : got || !strstr(e.msg, "nesting"), "%s x%d: got [%s]%s want [%s]", what,
          n, got ? got : "(error)", got ? "" : e.msg, want ? want : "(anything)");
    free(got);
    free(src);
    e = (ct_err){0};
    src = nested(pre, head, too_deep, core, tail, post);
    got = render(src, "{}", NULL, &e);
    CHECK(!got && strstr(e.msg, "t.jinja: line 1: nesting deeper than 256 levels"), "%s x%d: [%s]", what, too_deep,
          got ? got : e.msg);
    free(got);
    free(src);
}

int main(void) {
    if (getenv("CTITAN_EMULATED")) {
        too_deep = 1000;
        printf("test_jinja: skip under emulation: the forms nested 1000000 deep (the native run's); refused at %d "
               "deep here\n", too_deep);
    }
    /* whitespace control, trim_blocks, lstrip_blocks, comments, the dropped trailing newline */
    check_render("  {%- if true -%}  x  {%- endif -%}  \n  {% if true %}\n  y\n  {% endif %}\n{# c #}\n  {#- d -#}  z  \n",
                 "{}", "x  y\nz  ");
    check_render("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
                 "{\"messages\": [{\"role\": \"user\", \"content\": \" h\\u00e9 \"}], \"add_generation_prompt\": true}",
                 "<|im_start|>user\nh\xc3\xa9<|im_end|>\n<|im_start|>assistant\n");
    check_render("{% set ns = namespace(n=0) %}{% for x in xs if x is odd %}{% set ns.n = ns.n + x %}{{ loop.index }}/"
                 "{{ loop.length }}{{ ',' if not loop.last }}{% endfor %}={{ ns.n }}",
                 "{\"xs\": [1, 2, 3, 4, 5]}", "1/3,2/3,3/3=9");
    check_render("{{ s[::-1] }}|{{ s.split('b') | join('+') }}|{{ d | tojson }}|{{ xs[1:] | length }}|{{ 'x' ~ 1 ~ none }}",
                 "{\"s\": \"abcb\", \"d\": {\"k\": [1, \"\\u00e9\", null, true]}, \"xs\": [1, 2, 3]}",
                 "bcba|a+c+|{\"k\": [1, \"\xc3\xa9\", null, true]}|2|x1None");

    /* outside the subset, or a template's own error: fail, naming the file */
    check_error("{% macro f() %}{% endmacro %}", "{% macro %} is outside the supported Jinja subset");
    check_error("{{ [1] | sort }}", "the filter 'sort'");
    check_error("{{ raise_exception('roles must alternate') }}", "raise_exception: roles must alternate");
    check_error("a\n{% for x in y %}", "line 2: {% for %} is never closed");
    check_error("{% set messages = [1] %}{{ messages[5].content }}", "'messages[5]' is undefined (attribute access)");
    check_error("{% set m = {'a': [1]} %}{{ m.a[3]['k'] | trim }}", "'m.a[3]' is undefined");

    /* nesting past JINJA_MAX_DEPTH is refused, not a stack overflow, along every path that
     * recurses: the expression parser, the evaluator (operator and postfix chains), nested
     * blocks and values printed or compared */
    {
        const int N = JINJA_MAX_DEPTH - 2;
        char want[1024];
        check_depth("parentheses", "{{ ", "(", N, "7", ")", " }}", "7");
        snprintf(want, sizeof want, "%d", N % 2 ? -7 : 7);
        check_depth("unary minus", "{{ ", "- ", N, "7", "", " }}", want);
        check_depth("unary plus", "{{ ", "+ ", N, "7", "", " }}", "7");
        check_depth("not", "{{ ", "not ", N, "false", "", " }}", N % 2 ? "True" : "False");
        char *w = nested("", "[", N, "1", "]", "");
        check_depth("brackets", "{{ ", "[", N, "1", "]", " | tojson }}", w);
        free(w);
        w = nested("", "{\"a\": ", N, "1", "}", "");
        check_depth("dicts", "{{ ", "{'a': ", N, "1", "}", " | tojson }}", w);
        free(w);
        check_depth("subscripts", "{{ x", "[", N, "0", "]", " is defined }}", NULL);
        check_depth("call arguments", "{{ ", "range(", N, "1", ")", " }}", NULL);
        check_depth("if blocks", "", "{% if true %}", N, "x", "{% endif %}", "", "x");
        check_depth("for blocks", "", "{% for i in [1] %}", N, "x", "{% endfor %}", "", "x");
        check_depth("conditional else chain", "{{ ", "0 if false else ", N, "1", "", " }}", "1");
        snprintf(want, sizeof want, "%d", N + 1);
        check_depth("operator chain", "{{ 1", " + 1", N, "", "", " }}", want);
        check_depth("and chain", "{{ true", " and true", N, "", "", " }}", "True");
        check_depth("method chain", "{{ 'A'", ".lower()", N / 2, "", "", " }}", "a"); /* 2 levels each */
        check_depth("filter chain", "{{ 'a'", " | trim", N, "", "", " }}", "a");
        /* values nested at run time, with no nesting in the source */
        const char *grow = "{%% set ns = namespace(x=1) %%}{%% for i in range(%d) %%}{%% set ns.x = [ns.x] %%}"
                           "{%% endfor %%}";
        char src[512];
        for (int deep = 0; deep < 2; deep++) {
            int n = deep ? (too_deep < 100000 ? too_deep : 100000) : N;
            ct_err e = {0};
            snprintf(src, sizeof src, grow, n);
            strcat(src, "{{ ns.x | tojson | length }}");
            char *got = render(src, "{}", NULL, &e);
            snprintf(want, sizeof want, "%d", 2 * n + 1);
            CHECK(deep ? !got && strstr(e.msg, "t.jinja: line 1: tojson: values nested deeper than 256 levels")
                       : got && !strcmp(got, want),
                  "tojson of a value nested %d deep: [%s]", n, got ? got : e.msg);
            free(got);
            e = (ct_err){0};
            snprintf(src, sizeof src, grow, n);
            strcat(src, "{{ ns.x == ns.x }}");
            got = render(src, "{}", NULL, &e);
            CHECK(deep ? !got && strstr(e.msg, "t.jinja: line 1: ==: values nested deeper than 256 levels")
                       : got && !strcmp(got, "True"),
                  "== of values nested %d deep: [%s]", n, got ? got : e.msg);
            free(got);
        }
    }

    /* {% generation %} spans, in bytes of the output */
    {
        ct_err e = {0};
        jinja_spans sp = {0};
        char *got = render("a{% generation %}bc{% endgeneration %}d{% generation %}{% endgeneration %}", "{}", &sp, &e);
        CHECK(got && !strcmp(got, "abcd"), "%s", got ? got : e.msg);
        CHECK(sp.n == 2 && sp.start[0] == 1 && sp.end[0] == 3 && sp.start[1] == 4 && sp.end[1] == 4, "spans n=%d", sp.n);
        free(got);
        jinja_spans_free(&sp);
    }

    /* a tokenizer directory: tokenizer_config.json's template and special tokens; chat_template.jinja wins */
    {
        char dir[] = "/tmp/ct_jinja_XXXXXX", p[256];
        CHECK(mkdtemp(dir) != NULL, "mkdtemp");
        snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
        FILE *f = fopen(p, "w");
        fputs("{\"chat_template\": \"{{ bos_token }}{{ messages[0].content }}{% if add_generation_prompt %}>{% endif %}\","
              " \"bos_token\": {\"content\": \"<s>\"}, \"eos_token\": \"</s>\"}", f);
        fclose(f);
        cJSON *msgs = cJSON_Parse("[{\"role\": \"user\", \"content\": \"hi\"}]");
        jinja_chat *c = NULL;
        ct_err e = {0};
        char *out = NULL;
        size_t n = 0;
        CHECK(!jinja_chat_open(dir, &c, &e) && c, "%s", e.msg);
        if (c) {
            CHECK(!jinja_chat_apply(c, msgs, 1, &out, &n, NULL, &e) && out && !strcmp(out, "<s>hi>"), "%s",
                  out ? out : e.msg);
            free(out);
            jinja_chat_close(c);
        }
        snprintf(p, sizeof p, "%s/chat_template.jinja", dir);
        f = fopen(p, "w");
        fputs("file:{{ messages[0].content }}{{ eos_token }}\n", f);
        fclose(f);
        c = NULL;
        out = NULL;
        CHECK(!jinja_chat_open(dir, &c, &e) && c, "%s", e.msg);
        if (c) {
            CHECK(!jinja_chat_apply(c, msgs, 0, &out, &n, NULL, &e) && out && !strcmp(out, "file:hi</s>"), "%s",
                  out ? out : e.msg);
            free(out);
            jinja_chat_close(c);
        }
        unlink(p);
        snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
        unlink(p);
        c = NULL;
        CHECK(!jinja_chat_open(dir, &c, &e) && !c, "a directory without a template has none");
        /* a chat_template.jinja that cannot be read is an error, not a fallback to another template */
        snprintf(p, sizeof p, "%s/chat_template.jinja", dir);
        CHECK(mkdir(p, 0700) == 0, "mkdir %s", p);
        c = NULL;
        e = (ct_err){0};
        CHECK(jinja_chat_open(dir, &c, &e) == CT_ERR_IO && !c && strstr(e.msg, p), "[%s]", e.msg);
        rmdir(p);
        rmdir(dir);
        cJSON_Delete(msgs);
    }
    return CHECK_DONE();
}
