/* tests/py/rope_driver.c: model/rope.h from the command line, for tests/py/test_rope.py
 * (which compiles it against build/libctitan.a).
 *
 *   rope_driver CONFIG_JSON LAYER_TYPE|- SEQ_LEN [HEAD_DIM]
 *
 * prints {"type", "rotary_dim", "head_dim", "max_pos", "original_max_pos", "inv_freq",
 * "attn_scale", "rows"}
 * where rows maps positions 0, 1 and SEQ_LEN-1 to the cos and sin rows of
 * rope_tables. head_dim, when not given, is resolved as the family's
 * config class does: the head_dim key, else qwen3's 128 / gemma3_text's 256,
 * else hidden_size / num_attention_heads. On error: the message on stderr
 * and ct_exit_code's status. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/fs.h"
#include "model/rope.h"

static int resolve_head_dim(const cJSON *root) {
    const cJSON *hd = cJSON_GetObjectItemCaseSensitive(root, "head_dim");
    if (cJSON_IsNumber(hd)) return (int)hd->valuedouble;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (cJSON_IsString(mt) && !strcmp(mt->valuestring, "qwen3")) return 128;
    if (cJSON_IsString(mt) && !strcmp(mt->valuestring, "gemma3_text")) return 256;
    const cJSON *h = cJSON_GetObjectItemCaseSensitive(root, "hidden_size");
    const cJSON *n = cJSON_GetObjectItemCaseSensitive(root, "num_attention_heads");
    if (!cJSON_IsNumber(h) || !cJSON_IsNumber(n) || n->valuedouble <= 0) return 0;
    return (int)h->valuedouble / (int)n->valuedouble;
}

static void print_row(const float *row, int half) {
    putchar('[');
    for (int i = 0; i < half; i++) printf("%s%.9g", i ? ", " : "", (double)row[i]);
    putchar(']');
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: rope_driver CONFIG_JSON LAYER_TYPE|- SEQ_LEN [HEAD_DIM]\n");
        return 2;
    }
    size_t len = 0;
    char *text = fs_read_file(argv[1], 0, &len, NULL);
    if (!text) {
        fprintf(stderr, "%s: cannot read\n", argv[1]);
        return 1;
    }
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) {
        fprintf(stderr, "%s: not JSON\n", argv[1]);
        return 1;
    }
    const char *lt = strcmp(argv[2], "-") ? argv[2] : NULL;
    int seq_len = atoi(argv[3]);
    int head_dim = argc > 4 ? atoi(argv[4]) : resolve_head_dim(root);
    rope_params p;
    ct_err e = {0};
    int rc = rope_params_from_hf(&p, root, lt, head_dim, argv[1], &e);
    cJSON_Delete(root);
    if (rc) {
        fprintf(stderr, "%s\n", e.msg);
        return ct_exit_code(rc);
    }
    rope_params copy = p; /* the struct is meant to be copied by value */
    int dim = rope_rotary_dim(&copy, head_dim), half = dim / 2;
    double inv[ROPE_MAX_HALF], attn;
    rope_inv_freq(&copy, head_dim, seq_len, inv, &attn);
    printf("{\"type\": \"%s\", \"rotary_dim\": %d, \"head_dim\": %d, \"max_pos\": %d, \"original_max_pos\": %d, "
           "\"attn_scale\": %.17g, \"inv_freq\": [",
           rope_type_name(copy.type), dim, head_dim, copy.max_pos, copy.original_max_pos, attn);
    for (int i = 0; i < half; i++) printf("%s%.17g", i ? ", " : "", inv[i]);
    printf("], \"rows\": {");
    if (seq_len <= 65536) {
        float *c = malloc(sizeof(float) * (size_t)seq_len * half), *s = malloc(sizeof(float) * (size_t)seq_len * half);
        rope_tables(c, s, 0, seq_len, half, inv, attn);
        int ts[3] = {0, 1, seq_len - 1};
        for (int k = 0; k < 3; k++) {
            if (ts[k] >= seq_len || (k && ts[k] == ts[k - 1])) continue;
            printf("%s\"%d\": {\"cos\": ", k ? ", " : "", ts[k]);
            print_row(c + (size_t)ts[k] * half, half);
            printf(", \"sin\": ");
            print_row(s + (size_t)ts[k] * half, half);
            putchar('}');
        }
        free(c);
        free(s);
    }
    printf("}}\n");
    return 0;
}
