/* Feeds: a .npy file (magic, version 1/2/3, header length, the Python dict
 * literal header, the data) to npy_read_u32.
 * Why: token files from NumPy tooling; the header is a Python literal that
 * is parsed, never evaluated, and its shape sizes the read. */
#include "formats/npy.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *path = fz_write(fz_dir(), "tokens.npy", data, size);
    uint32_t *v = NULL;
    size_t n = 0;
    ct_err e = {0};
    if (npy_read_u32(path, &v, &n, &e) == 0) {
        volatile uint32_t sink = 0;
        if (n) sink += v[0] + v[n - 1]; /* ASan: all n elements are there */
        (void)sink;
        free(v);
    } else if (v || n || !strstr(e.msg, path)) {
        abort(); /* documented: on error *out is NULL, *n 0, the message names the file */
    }
    free(path);
    return 0;
}
