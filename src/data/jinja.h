/* data/jinja.h: a small Jinja2 interpreter for Hugging Face chat templates.
 *
 * Why: every model family formats a conversation its own way, and the
 * published answer is the `chat_template` of the model's tokenizer (a Jinja2
 * program in tokenizer_config.json, or chat_template.jinja beside it).
 * transformers' `apply_chat_template` renders it with jinja2; ctitan renders
 * the same program here, so `generate --chat` and chat data see byte for
 * byte the text transformers would produce, for any family, without a
 * hard-wired format per model.
 *
 * What: the subset the published chat templates use, with the environment
 * transformers builds (trim_blocks, lstrip_blocks, loopcontrols, its own
 * tojson, raise_exception, strftime_now, namespace, and the {% generation %}
 * block of its assistant-mask tracker):
 *   - {{ expr }}, {% if/elif/else/endif %}, {% for x in xs [if c] %} (also
 *     `for k, v in ...`, {% else %}, break/continue) with loop.index0/index/
 *     first/last/length/revindex/revindex0/previtem/nextitem,
 *     {% set x = e %}, {% set ns.attr = e %}, {% set x %}...{% endset %},
 *     {% generation %}...{% endgeneration %}, {# comments #}, `-` and `+`
 *     whitespace control, trim_blocks / lstrip_blocks, the trailing newline
 *     dropped as jinja2 does;
 *   - literals (strings with Python escapes, ints, true/false/none, lists,
 *     dicts), names, attribute and item access, slices [a:b:c], calls;
 *     operators + - * // % ~, == != < > <= >=, in / not in, and/or/not,
 *     `a if c else b`, `is [not] test`, `|filter(args)`;
 *   - tests: defined undefined none string number integer float boolean
 *     true false mapping iterable sequence callable odd even eq/equalto ne;
 *   - filters: length count trim upper lower capitalize tojson string first
 *     last join default/d items list reverse int safe select reject
 *     selectattr rejectattr;
 *   - str methods startswith endswith split strip lstrip rstrip upper lower
 *     capitalize replace join; dict methods items keys values get;
 *   - globals raise_exception(msg), namespace(...), range(...),
 *     strftime_now(fmt), dict(...).
 * Values are none/bool/int/string/list/dict (plus namespaces and jinja2's
 * Undefined: empty when printed, false when tested, an error when used as a
 * string or an object). Anything else (macros, includes, float arithmetic,
 * printing a list, an unknown filter...) is an error naming the template file,
 * the line and the construct, never a different rendering. */
#ifndef CT_DATA_JINJA_H
#define CT_DATA_JINJA_H

#include <stddef.h>

#include "core/err.h"

typedef struct jinja_tmpl jinja_tmpl;

/* The deepest nesting a template may have: parentheses, list and dict
 * literals, unary operators, subscripts and call arguments inside one another,
 * chains of operators, filters and attribute accesses, {% if %} / {% for %}
 * blocks inside one another, and values printed by tojson. The parser, the
 * evaluator and the printer recurse along that nesting, and a hostile template
 * nested 20,000 deep would overflow the C stack; past this depth the template
 * is refused with a format error naming its file and line, as jinja2 raises
 * RecursionError. Published templates nest below 10. */
#define JINJA_MAX_DEPTH 256

/* The byte ranges [start, end) of the output rendered inside
 * {% generation %} blocks, in order (transformers' assistant mask). */
typedef struct {
    size_t *start, *end;
    int n, cap;
} jinja_spans;

void jinja_spans_free(jinja_spans *s);

/* Parses the template source (len bytes); name (a file name) prefixes every
 * error message. */
int jinja_parse(const char *src, size_t len, const char *name, jinja_tmpl **out, ct_err *e);
void jinja_free(jinja_tmpl *t);

/* Renders with the variables of vars_json (a cJSON object, passed as void * so
 * this header does not pull in cJSON; NULL: none) into a malloc'd,
 * NUL-terminated string. spans may be NULL. */
int jinja_render(const jinja_tmpl *t, const void *vars_json, char **out, size_t *len, jinja_spans *spans,
                 ct_err *e);

/* A tokenizer directory's chat template, as transformers loads it. */
typedef struct jinja_chat jinja_chat;

/* DIR/chat_template.jinja when present, else tokenizer_config.json's
 * "chat_template" (a string, or a list of {name, template} of which "default"
 * is used). *out is NULL (and 0 returned) when the directory has none; a
 * chat_template.jinja that is there but cannot be read (a directory, no
 * permission) is CT_ERR_IO, never a fall back to another template. The
 * special tokens of tokenizer_config.json (bos_token, eos_token, unk_token,
 * sep_token, pad_token, cls_token, mask_token) become template variables,
 * as transformers passes them. */
int jinja_chat_open(const char *dir, jinja_chat **out, ct_err *e);
/* The template of FILE (a .jinja file) with the special tokens of DIR's
 * tokenizer_config.json, when there is one. */
int jinja_chat_open_file(const char *file, const char *dir, jinja_chat **out, ct_err *e);
void jinja_chat_close(jinja_chat *c);
int jinja_chat_has_generation(const jinja_chat *c);

/* Renders messages_json (a cJSON array of {role, content, ...}) as
 * apply_chat_template(messages, tokenize=False, add_generation_prompt=...). */
int jinja_chat_apply(const jinja_chat *c, const void *messages_json, int add_generation_prompt, char **out,
                     size_t *len, jinja_spans *spans, ct_err *e);
/* jinja_chat_apply with more template variables: kwargs_json (a cJSON object,
 * or NULL) as apply_chat_template(..., **kwargs) passes them (Qwen3's
 * enable_thinking). A name apply_chat_template sets itself (messages, tools,
 * documents, add_generation_prompt) is CT_ERR_CONFIG, as Python refuses a
 * keyword given twice; a special token's name is overridden, as
 * transformers' render lets kwargs win. */
int jinja_chat_apply_kw(const jinja_chat *c, const void *messages_json, int add_generation_prompt,
                        const void *kwargs_json, char **out, size_t *len, jinja_spans *spans, ct_err *e);

/* jinja_chat_apply_kw with the template's `tools` too: tools_json (a cJSON list of
 * JSON schemas, or NULL for None) as apply_chat_template(..., tools=...) passes a list
 * of dicts. */
int jinja_chat_apply_tools(const jinja_chat *c, const void *messages_json, int add_generation_prompt,
                           const void *tools_json, const void *kwargs_json, char **out, size_t *len,
                           jinja_spans *spans, ct_err *e);

/* The file the template came from (for messages). */
const char *jinja_chat_file(const jinja_chat *c);
/* The template's text as it was read (*n bytes), from its file or from
 * tokenizer_config.json's chat_template: what identifies the template. */
const char *jinja_chat_source(const jinja_chat *c, size_t *n);

#endif
