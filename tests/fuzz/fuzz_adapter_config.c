/* Feeds: a PEFT adapter_config.json to lora_read_config (src/model/lora.c),
 * which sets the run's LoRA rank, alpha, rsLoRA and target projections from it.
 * Why: adapters are published on the Hub beside their base models; the rank
 * sizes the adapter tensors, so every value must be checked before use. */
#include "fuzz_util.h"
#include "model/lm.h"
#include "model/lora.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *dir;
    if (!dir) dir = fs_join(fz_dir(), "adapter");
    free(fz_write(dir, "adapter_config.json", data, size));
    lm_config c = {0};
    double alpha = 0;
    int rslora = 0;
    ct_err e = {0};
    if (lora_read_config(dir, &c, &alpha, &rslora, &e) == 0) {
        if (c.lora_rank < 1 || !(alpha > 0)) abort(); /* what the reader promises the model */
    } else if (!strstr(e.msg, "adapter_config.json")) {
        abort();
    }
    return 0;
}
