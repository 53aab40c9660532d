/* Feeds: a chat template's source (chat_template.jinja) to jinja_parse and
 * renders it as transformers would for a fixed conversation, with and
 * without the generation prompt, with the assistant spans tracked.
 * Why: the Jinja interpreter (src/data/jinja.c) runs a program from the
 * model's files; the 8 published family templates are the seeds, and any
 * program must end in output or an error naming the template, never a
 * crash. */
#include <cjson/cJSON.h>

#include "data/jinja.h"
#include "fuzz_util.h"

static const char FZ_VARS[] =
    "{\"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"tools\": null, \"documents\": null,"
    " \"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", \"content\": \"Hi\"},"
    " {\"role\": \"assistant\", \"content\": \"Hello.\"}, {\"role\": \"user\", \"content\": \"Why?\"}]}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static cJSON *vars[2];
    if (!vars[0]) {
        vars[0] = cJSON_Parse(FZ_VARS);
        vars[1] = cJSON_Duplicate(vars[0], 1);
        cJSON_AddBoolToObject(vars[0], "add_generation_prompt", 0);
        cJSON_AddBoolToObject(vars[1], "add_generation_prompt", 1);
    }
    jinja_tmpl *t = NULL;
    ct_err e = {0};
    if (jinja_parse((const char *)data, size, "chat_template.jinja", &t, &e) == 0) {
        for (int g = 0; g < 2; g++) {
            char *out = NULL;
            size_t n = 0;
            jinja_spans spans = {0};
            if (jinja_render(t, vars[g], &out, &n, &spans, &e) == 0) {
                for (int i = 0; i < spans.n; i++)
                    if (spans.start[i] > spans.end[i] || spans.end[i] > n) abort();
                free(out);
            } else if (!strstr(e.msg, "chat_template.jinja")) {
                abort();
            }
            jinja_spans_free(&spans);
        }
        jinja_free(t);
    } else if (!strstr(e.msg, "chat_template.jinja")) {
        abort();
    }
    return 0;
}
