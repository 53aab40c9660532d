/* Feeds: the body of a checkpoint's manifest.json; the target appends the
 * self-checksum line (CKPT_SELF_KEY, the XXH3-64 of what precedes it) the
 * way ckpt_save writes it, so the fuzzer gets past the checksum into the
 * JSON reader, then runs ckpt_verify on a step-7 directory holding the
 * files a checkpoint needs (10 bytes each) that the manifest may list with
 * right or wrong sizes and hashes.
 * Why: resume trusts the manifest to say which files to read; a damaged
 * one must be refused by name, never crash the resume. */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "checkpoint/ckpt.h"
#include "fuzz_util.h"

#define FZ_SELF_KEY ",\n  \"manifest_xxh3_64\": \"" /* src/checkpoint/ckpt.c CKPT_SELF_KEY */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *dir;
    if (!dir) {
        dir = fs_join(fz_dir(), "step-7");
        static const char *files[] = {"model.safetensors", "config.json", "optim.safetensors", "state.json", "config.toml"};
        for (size_t i = 0; i < sizeof files / sizeof *files; i++) free(fz_write(dir, files[i], "0123456789", 10));
    }
    size_t kl = strlen(FZ_SELF_KEY);
    char *m = ct_malloc(size + kl + 16 + 5);
    memcpy(m, data, size);
    memcpy(m + size, FZ_SELF_KEY, kl);
    snprintf(m + size + kl, 16 + 5, "%016llx\"\n}\n", (unsigned long long)XXH3_64bits(m, size + kl));
    free(fz_write(dir, "manifest.json", m, size + kl + 16 + 4));
    free(m);
    ct_err e = {0};
    int rc = ckpt_verify(dir, &e);
    if (rc && (!e.msg[0] || !strstr(e.msg, dir))) abort(); /* the error names the damaged file */
    return 0;
}
