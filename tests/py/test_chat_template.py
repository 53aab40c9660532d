"""The C Jinja interpreter (src/data/jinja.c) against transformers' apply_chat_template.

Every template in tests/data/chat_templates (the published chat_template of a model family,
see SOURCES.md) renders a set of conversations through ctitan (a small driver linked against
build/libctitan.a, which loads the directory with jinja_chat_open as `generate --chat` does)
and through transformers (a tokenizer carrying the same tokenizer_config.json values, its
apply_chat_template(tokenize=False)); the two strings must be identical byte for byte. Where
the template raises (raise_exception), ctitan must fail with the template's message.

Smaller templates exercise the Jinja subset one construct at a time against transformers'
own jinja2 environment, and constructs outside the subset must fail naming the file.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / os.environ.get("CTITAN_BUILD", "build")  # another build tree, as conftest.py
DATA = ROOT / "tests" / "data" / "chat_templates"
TEMPLATES = sorted(p.name for p in DATA.iterdir() if (p / "tokenizer_config.json").exists())

DRIVER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cjson/cJSON.h>
#include "data/jinja.h"

static char *slurp(const char *p, size_t *n) {
    FILE *f = fopen(p, "rb");
    if (!f) { perror(p); exit(3); }
    fseek(f, 0, SEEK_END);
    long l = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)l + 1);
    *n = fread(b, 1, (size_t)l, f);
    b[*n] = 0;
    fclose(f);
    return b;
}

/* chat DIR MESSAGES.json 0|1   |   tmpl FILE VARS.json */
int main(int argc, char **argv) {
    if (argc != 5 && argc != 4) { fprintf(stderr, "usage\n"); return 2; }
    ct_err e = {0};
    char *out = NULL;
    size_t n = 0, vn;
    jinja_spans sp = {0};
    int rc;
    if (!strcmp(argv[1], "chat")) {
        jinja_chat *c = NULL;
        if ((rc = jinja_chat_open(argv[2], &c, &e))) { fprintf(stderr, "%s\n", e.msg); return 1; }
        if (!c) { fprintf(stderr, "no chat template\n"); return 4; }
        char *m = slurp(argv[3], &vn);
        cJSON *msgs = cJSON_Parse(m);
        rc = jinja_chat_apply(c, msgs, atoi(argv[4]), &out, &n, &sp, &e);
        cJSON_Delete(msgs);
        free(m);
        jinja_chat_close(c);
    } else {
        size_t tn;
        char *t = slurp(argv[2], &tn), *v = slurp(argv[3], &vn);
        cJSON *vars = cJSON_Parse(v);
        jinja_tmpl *T = NULL;
        rc = jinja_parse(t, tn, argv[2], &T, &e);
        if (!rc) rc = jinja_render(T, vars, &out, &n, &sp, &e);
        jinja_free(T);
        cJSON_Delete(vars);
        free(t);
        free(v);
    }
    if (rc) { fprintf(stderr, "%s\n", e.msg); return 1; }
    fwrite(out, 1, n, stdout);
    for (int i = 0; i < sp.n; i++) fprintf(stderr, "span %zu %zu\n", sp.start[i], sp.end[i]);
    free(out);
    jinja_spans_free(&sp);
    return 0;
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory) -> Path:
    lib = BUILD / "libctitan.a"
    if not lib.exists():
        pytest.fail(f"{lib} is missing: run `make all` first", pytrace=False)
    d = tmp_path_factory.mktemp("jinja_driver")
    src = d / "driver.c"
    src.write_text(DRIVER_C)
    exe = d / "jinja_driver"
    blas = "/usr/lib/x86_64-linux-gnu/openblas-openmp"
    cmd = ["gcc", "-std=c11", "-D_GNU_SOURCE", f"-I{ROOT / 'src'}", "-o", str(exe), str(src), str(lib),
           f"-L{blas}", f"-Wl,-rpath,{blas}", "-lopenblas", "-lcjson", "-lpcre2-8", "-lutf8proc", "-lcurl", "-lm",
           "-fopenmp"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        pytest.fail(f"linking the jinja driver failed:\n{p.stderr[-3000:]}", pytrace=False)
    return exe


def run_driver(driver, args):
    p = subprocess.run([str(driver)] + [str(a) for a in args], capture_output=True, timeout=60)
    return p.returncode, p.stdout, p.stderr.decode("utf-8", "replace")


def hf_tokenizer(cfg: dict):
    """A tiny fast tokenizer carrying the template and special tokens of a tokenizer_config.json."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    special = {k: v for k, v in cfg.items() if k.endswith("_token") and isinstance(v, str)}
    vocab = {"[UNK]": 0}
    for v in special.values():
        vocab.setdefault(v, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=cfg["chat_template"], **special)


SYSTEM = {"role": "system", "content": "You are a terse assistant."}
CONVERSATIONS = {
    "one_user": [{"role": "user", "content": "Why is the sky blue?"}],
    "system_user": [SYSTEM, {"role": "user", "content": "Name three primes."}],
    "multi_turn": [SYSTEM,
                   {"role": "user", "content": "Hi!"},
                   {"role": "assistant", "content": "Hello. How can I help?"},
                   {"role": "user", "content": "Count to three."},
                   {"role": "assistant", "content": "1, 2, 3."}],
    "no_system_multi": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "user", "content": "c"}],
    "unicode_space": [{"role": "user", "content": "  héllo — 日本語 🚀\ttab\n\nnew line  "},
                      {"role": "assistant", "content": "\n Ça va ✓ \u00a0"},
                      {"role": "user", "content": "quotes ' \" \\ {{ not a tag }} {% nor this %}"}],
    "think": [{"role": "user", "content": "2+2?"},
              {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
              {"role": "user", "content": "and 3+3?"},
              {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}],
    # two user turns in a row: templates that check alternation raise
    "not_alternating": [{"role": "user", "content": "one"}, {"role": "user", "content": "two"}],
    # an unknown role: Mistral raises, others render or skip it
    "odd_role": [{"role": "user", "content": "q"}, {"role": "critic", "content": "meh"}],
}


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_renders_like_transformers(name, driver, tmp_path):
    import jinja2
    cfg = json.loads((DATA / name / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok = hf_tokenizer(cfg)
    rendered = raised = 0
    for conv_name, msgs in CONVERSATIONS.items():
        mfile = tmp_path / f"{conv_name}.json"
        mfile.write_text(json.dumps(msgs, ensure_ascii=False), encoding="utf-8")
        for agp in (True, False):
            what = f"{name}, {conv_name}, add_generation_prompt={agp}"
            try:
                want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=agp)
                err = None
            except jinja2.exceptions.TemplateError as ex:
                want, err = None, str(ex)
            rc, out, stderr = run_driver(driver, ["chat", DATA / name, mfile, int(agp)])
            if err is None:
                assert rc == 0, f"{what}: ctitan failed: {stderr}"
                got = out.decode("utf-8")
                assert got == want, f"{what}:\n--- ctitan\n{got!r}\n--- transformers\n{want!r}"
                rendered += 1
            else:
                assert rc == 1, f"{what}: transformers raised {err!r}, ctitan exited {rc}: {out!r}"
                assert f"raise_exception: {err}" in stderr, f"{what}: {stderr!r} lacks {err!r}"
                assert "tokenizer_config.json" in stderr
                raised += 1
    assert rendered >= 10, f"{name}: only {rendered} conversations rendered"
    if name in ("mistral-7b-instruct-v0.3", "gemma-3-it", "gemma-it", "gemma-2-it"):
        assert raised >= 2, f"{name}: the raise_exception path was never taken"


def test_qwen3_think_is_stripped_from_history(driver, tmp_path):
    """The one template here with <think> handling: earlier turns lose their reasoning, the last keeps it."""
    mfile = tmp_path / "m.json"
    mfile.write_text(json.dumps(CONVERSATIONS["think"]))
    rc, out, err = run_driver(driver, ["chat", DATA / "qwen3", mfile, 0])
    assert rc == 0, err
    text = out.decode()
    assert "add them" not in text and "<think>\nagain\n</think>\n\n6" in text


# (template, variables): each construct of the subset, against transformers' jinja2 environment
SNIPPETS = [
    ("{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }}"
     "{{ loop.revindex }}|{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("{% for x in xs if x != 'b' %}{{ x }}{{ loop.length }}{% else %}none{% endfor %}"
     "{% for y in [] %}y{% else %}empty{% endfor %}", {"xs": ["a", "b", "c"]}),
    ("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}",
     {"d": {"z": 1, "a": 2}}),
    ("{% for x in xs %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}"
     "{% endfor %}", {"xs": [1, 2, 3, 4, 5]}),
    ("{% set ns = namespace(n=0, s='') %}{% for x in xs %}{% set ns.n = ns.n + x %}{% set ns.s = ns.s ~ x %}"
     "{% endfor %}{{ ns.n }} {{ ns.s }}", {"xs": [1, 2, 3]}),
    ("{% set a = 1 %}{% for x in xs %}{% set a = x %}{% endfor %}{{ a }}", {"xs": [5, 6]}),
    ("  {%- if true -%}  x  {%- endif -%}  \n  {% if true %}\n  y\n  {% endif %}\n{# c #}\n  {#- d -#}  z  ",
     {}),
    ("a\n    {% if t %}\n    b\n    {%+ endif %}\nc\n{{ 'd' }}\n", {"t": True}),
    ("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 'ab' * 3 }}"
     " {{ 1 ~ 'x' ~ none ~ true }} {{ (1 < 2) and not (2 >= 3) or false }}", {}),
    ("{{ 'a' in 'cat' }} {{ 'z' not in 'cat' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} "
     "{{ xs[1:] | join }}{{ xs[:-1] | length }}{{ xs[::-1] | join(',') }}{{ s[1:3] }}{{ s[::-1] }}{{ s[-2:] }}",
     {"xs": ["p", "q", "r"], "s": "héllo"}),
    ("{{ m.role }} {{ m['content'] }} {{ m.missing is defined }} {{ m.missing is undefined }} "
     "{{ none is none }} {{ 'x' is string }} {{ 3 is number }} {{ 3 is integer }} {{ m is mapping }} "
     "{{ [] is iterable }} {{ 3 is odd }} {{ 4 is even }} {{ 'a' is eq('a') }} {{ m.role is not string }}",
     {"m": {"role": "user", "content": "c"}}),
    ("{{ '  x y  ' | trim }}|{{ 'AbC' | lower }}|{{ 'abc' | upper }}|{{ 'abc' | capitalize }}|{{ xs | length }}"
     "|{{ 'héllo' | length }}|{{ xs | first }}|{{ xs | last }}|{{ xs | join('-') }}|{{ u | default('dflt') }}"
     "|{{ '' | default('e', true) }}|{{ 42 | string }}|{{ '7' | int + 1 }}|{{ xs | reverse | list | join }}",
     {"xs": ["a", "b"]}),
    ("{{ d | tojson }}|{{ d | tojson(indent=2) }}|{{ 'é\"\\n' | tojson }}|{{ [] | tojson }}|{{ none | tojson }}",
     {"d": {"a": [1, True, None, "x"], "b": {}, "c": {"d": 1.5}}}),
    ("{{ s.startswith('ab') }} {{ s.endswith('yz') }} {{ s.split('c') | join('/') }} {{ s.split('c')[-1] }} "
     "{{ ' a b  c '.split() | join('|') }} {{ '\\n\\nx\\n'.strip('\\n') }} {{ '  x '.lstrip() }}. "
     "{{ '  x '.rstrip() }}. {{ s.upper() }} {{ s.replace('b', 'B') }} {{ ', '.join(['1', '2']) }} "
     "{{ d.get('k') }} {{ d.get('z', 'no') }} {{ d.keys() | list | join }} {{ d.values() | list | join }}",
     {"s": "abcxyz", "d": {"k": "v", "j": "w"}}),
    ("{{ msgs | selectattr('role', 'equalto', 'user') | list | length }}"
     "{{ msgs | rejectattr('role', 'equalto', 'user') | list | length }}"
     "{{ [1, 2, 3, 4] | select('even') | list | join }}{{ [1, 2, 3] | reject('odd') | list | join }}",
     {"msgs": [{"role": "user"}, {"role": "assistant"}, {"role": "user"}]}),
    ("{{ 'yes' if flag else 'no' }} {{ 'x' if not flag }}. {{ range(3) | join }} {{ range(1, 7, 2) | join }} "
     "{{ {'a': 1}['a'] }} {{ [1, [2, 3]][1][0] }} {{ \"it's\" 'glued' }} {{ '\\u00e9\\x41\\t|' }}",
     {"flag": True}),
    ("{{ strftime_now('%Y-%m') }} {{ strftime_now is defined }} {{ raise_exception is defined }}", {}),
    ("{% set x %}block {{ 1 + 1 }}{% endset %}[{{ x }}] {% for m in ms %}{% generation %}{{ m }}"
     "{% endgeneration %}-{% endfor %}", {"ms": ["a", "bc"]}),
    # loop.revindex0 / previtem / nextitem: undefined (printed empty, `is defined` false) on the first /
    # last iteration; over a filtered loop they follow the kept items; a one-item loop has neither
    ("{% for x in xs %}{{ loop.revindex0 }}{{ loop.revindex }}<{{ loop.previtem }}>{{ loop.previtem is defined }}"
     "<{{ loop.nextitem }}>{{ loop.nextitem is defined }}|{% endfor %}"
     "{% for x in xs if x != 'b' %}{{ loop.revindex0 }}{{ loop.previtem | default('-') }}"
     "{{ loop.nextitem | default('-') }};{% endfor %}"
     "{% for x in ys %}{{ loop.revindex0 }}{{ loop.previtem is defined }}{{ loop.nextitem is defined }}{% endfor %}",
     {"xs": ["a", "b", "c", "d"], "ys": ["only"]}),
    ("{% for x in xs %}{% if loop.previtem is defined and loop.previtem == x %}={% else %}{{ x }}{% endif %}"
     "{% if loop.nextitem is undefined %}.{% endif %}{% endfor %}", {"xs": [1, 1, 2, 2, 2, 3]}),
    # |int: Python's int(), then int(float()) ('3.5' -> 3), else 0 ('12x', 'abc', '')
    ("{{ '12x' | int }} {{ '3.5' | int }} {{ 'abc' | int }} {{ '' | int }} {{ '-7' | int }} {{ '+5' | int }} "
     "{{ '-2.9' | int }} {{ ' 12 ' | int }} {{ 3.9 | int }} {{ -3.9 | int }} {{ true | int }} {{ none | int }} "
     "{{ '7' | int + 1 }} {{ n | int }} {{ s | int }}", {"n": 42, "s": "0042"}),
    ("{% for v in vs %}{{ v | int }},{% endfor %}",
     {"vs": ["1_000", "1__0", "_1", "1_", "1_0.5", ".5", "5.", ".", "1e3", "1E+2", "-.5e1", "1.5e", "e5", "+-1",
             "1.2.3", "0x10", "inf", "-Infinity", "nan", "1e400", "\u00a012\u3000", "\t\n 8 \r\v\f", "\u200b12",
             "9223372036854775807", "-9223372036854775808", "1e18", "-0.99", "12 3", " \x1c1"]}),
    # default(v, boolean): with boolean false only an undefined value is replaced; with true any falsy one
    ("[{{ '' | default('d', false) }}][{{ none | default('d', false) }}][{{ 0 | default('d', false) }}]"
     "[{{ '' | default('d', true) }}][{{ none | default('d', true) }}][{{ 0 | default('d', true) }}]"
     "[{{ [] | default('d', true) | length }}][{{ 'v' | default('d', true) }}][{{ false | default('d') }}]"
     "[{{ u | default('d') }}][{{ u | default('d', false) }}][{{ u | default('d', true) }}][{{ u | d('x') }}]"
     "[{{ m.missing | default('dm') }}][{{ m.empty | default('de', false) }}][{{ m.empty | default('de', true) }}]",
     {"m": {"empty": ""}}),
    ("{{ messages[0]['content'] }}{{ messages[5] is defined }}{{ (messages | length) - 1 }}"
     "{{ messages[-1].role }}{{ messages[1:][0].role }}", {"messages": [{"role": "a", "content": "x"},
                                                                    {"role": "b", "content": "y"}]}),
]


@pytest.mark.parametrize("i", range(len(SNIPPETS)))
def test_subset_construct_like_jinja2(i, driver, tmp_path):
    from transformers.utils.chat_template_utils import _compile_jinja_template
    src, variables = SNIPPETS[i]
    want = _compile_jinja_template(src).render(**variables)
    t = tmp_path / "t.jinja"
    t.write_text(src, encoding="utf-8")
    v = tmp_path / "v.json"
    v.write_text(json.dumps(variables))
    rc, out, err = run_driver(driver, ["tmpl", t, v])
    assert rc == 0, f"{src!r}: {err}"
    assert out.decode("utf-8") == want, f"{src!r}:\n--- ctitan\n{out.decode()!r}\n--- jinja2\n{want!r}"


def test_generation_spans_match_transformers(driver, tmp_path):
    """{% generation %} blocks give the assistant spans transformers' return_assistant_tokens_mask uses."""
    from transformers.utils.chat_template_utils import render_jinja_template
    src = ("{% for m in messages %}<{{ m.role }}>{% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
           "</s>{% endgeneration %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}")
    msgs = CONVERSATIONS["multi_turn"]
    (text,), (idx,) = render_jinja_template(conversations=[msgs], chat_template=src,
                                            return_assistant_tokens_mask=True)
    t = tmp_path / "t.jinja"
    t.write_text(src)
    v = tmp_path / "v.json"
    v.write_text(json.dumps({"messages": msgs}))
    rc, out, err = run_driver(driver, ["tmpl", t, v])
    assert rc == 0, err
    assert out.decode() == text
    spans = [tuple(int(x) for x in line.split()[1:]) for line in err.splitlines() if line.startswith("span ")]
    # transformers counts characters; the text here is ASCII, so bytes and characters agree
    assert spans == [tuple(s) for s in idx] and len(spans) == 2


@pytest.mark.parametrize("src, needle", [
    ("{% macro f() %}x{% endmacro %}", "{% macro %} is outside the supported Jinja subset"),
    ("{% include 'x' %}", "{% include %} is outside the supported Jinja subset"),
    ("{{ xs | sort }}", "the filter 'sort' is outside the supported Jinja subset"),
    ("{{ 1 is divisibleby(2) }}", "the test 'divisibleby' is outside the supported Jinja subset"),
    ("{{ [1, 2] }}", "printing a list as text is outside the supported Jinja subset"),
    ("{{ 1 / 2 }}", "outside the supported Jinja subset"),
    ("{% if true %}x", "{% if %} is never closed"),
    ("line one\n{{ 'a' + }}", "line 2"),
    ("{{ raise_exception('custom message ' ~ 7) }}", "raise_exception: custom message 7"),
    ("{{ nope.attr }}", "'nope' is undefined"),
    ("{{ 'a' + 1 }}", "cannot add a string and a int"),
])
def test_outside_subset_fails_naming_the_file(src, needle, driver, tmp_path):
    t = tmp_path / "bad_template.jinja"
    t.write_text(src)
    v = tmp_path / "v.json"
    v.write_text("{}")
    rc, out, err = run_driver(driver, ["tmpl", t, v])
    assert rc == 1, f"{src!r} rendered {out!r}"
    assert "bad_template.jinja" in err and needle in err, err


def test_chat_template_jinja_file_wins(driver, tmp_path):
    """transformers reads chat_template.jinja beside tokenizer_config.json in preference to the JSON key."""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "json:{{ messages[0].content }}",
                                                        "eos_token": "</s>"}))
    m = tmp_path / "m.json"
    m.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    rc, out, err = run_driver(driver, ["chat", d, m, 1])
    assert rc == 0 and out == b"json:hi", err
    (d / "chat_template.jinja").write_text("file:{{ messages[0].content }}{{ eos_token }}\n")
    rc, out, err = run_driver(driver, ["chat", d, m, 1])
    assert rc == 0 and out == b"file:hi</s>", err
    (d / "chat_template.jinja").unlink()
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    rc, out, err = run_driver(driver, ["chat", d, m, 1])
    assert rc == 4, "a directory without a template must say it has none"
