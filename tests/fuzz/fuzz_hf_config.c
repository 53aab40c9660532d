/* Feeds: a Hugging Face config.json (any family: Qwen3, Qwen2, Llama,
 * Mistral, Mixtral, OLMo2, Phi3, Gemma3; rope_scaling / rope_parameters of
 * every type) to lm_config_from_hf (src/model/lm_config.c + rope.c), and for
 * a config it accepts, the RoPE tables of a short and of a long sequence.
 * Why: config.json sizes every allocation of the model; a size, a RoPE
 * factor list or a layer_types entry that slips through is memory trouble
 * later, far from the file that caused it. */
#include "fuzz_util.h"
#include "model/lm.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *dir;
    if (!dir) dir = fs_join(fz_dir(), "hf");
    free(fz_write(dir, "config.json", data, size));
    lm_config c;
    ct_err e = {0};
    if (lm_config_from_hf(&c, dir, &e) == 0) {
        /* the tables a forward of 8 positions builds, and rows near the end of
         * a long context (dynamic and longrope switch on the length) */
        enum { T = 8 };
        size_t half = c.head_dim > 0 ? (size_t)c.head_dim / 2 : 0;
        float *cs = ct_malloc(T * half * sizeof *cs + 1), *sn = ct_malloc(T * half * sizeof *sn + 1);
        lm_rope_tables(&c, 0, T, 0, T, cs, sn);
        lm_rope_tables(&c, 1, T, 0, T, cs, sn);
        lm_rope_tables(&c, 0, 65536, 65536 - T, T, cs, sn);
        free(cs);
        free(sn);
    } else if (!strstr(e.msg, "config.json")) {
        abort(); /* every error names the file */
    }
    return 0;
}
