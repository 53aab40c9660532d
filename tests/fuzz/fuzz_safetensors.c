/* Feeds: a whole .safetensors file (8-byte header length, JSON header, data)
 * to st_open, then reads every tensor's name, shape and data pointer.
 * Why: weights come from the Hub and from other tools; the header is JSON
 * whose offsets index into the mapped file, so a bad one must be refused
 * before anything reads through it. */
#include "fuzz_util.h"
#include "formats/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *path = fz_write(fz_dir(), "model.safetensors", data, size);
    ct_err e = {0};
    st_file *f = st_open(path, &e);
    if (f) {
        volatile uint64_t sink = 0;
        for (int i = 0; i < st_count(f); i++) {
            const st_tensor *t = st_get(f, i);
            if (st_find(f, t->name) != t) abort(); /* every listed name must be found again */
            size_t nb = t->nbytes;
            if (nb) sink += ((const uint8_t *)t->data)[0] + ((const uint8_t *)t->data)[nb - 1]; /* ASan: inside the map */
        }
        (void)st_metadata(f, "format");
        (void)sink;
        st_close(f);
    } else if (!e.msg[0] || !strstr(e.msg, path)) {
        abort(); /* every error names the file */
    }
    free(path);
    return 0;
}
