/* Feeds: model.safetensors.index.json of a directory that holds three real
 * one-tensor shards (written once by the target with st_write_dir), to
 * st_set_open, then looks every tensor up by name.
 * Why: the index is downloaded JSON whose weight_map chooses which files are
 * opened; names outside the directory, duplicates and shards that disagree
 * with it must be refused, never followed. */
#include "fuzz_util.h"
#include "formats/safetensors.h"

static char *fz_index_dir(void) {
    static char *dir;
    if (dir) return dir;
    dir = fs_join(fz_dir(), "index");
    static const float v[3][4] = {{1, 2, 3, 4}, {5, 6, 7, 8}, {9, 10, 11, 12}};
    st_wtensor ts[3];
    const char *names[3] = {"a", "b.weight", "c"};
    for (int i = 0; i < 3; i++)
        ts[i] = (st_wtensor){.name = names[i], .dtype = CT_F32, .src_dtype = CT_F32, .ndim = 1, .shape = {4},
                             .data = v[i]};
    ct_err e = {0};
    if (ct_mkdirs(dir, &e) || st_write_dir(dir, ts, 3, 16, NULL, &e)) {
        fprintf(stderr, "fuzz: %s\n", e.msg);
        abort();
    }
    return dir;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *dir = fz_index_dir();
    free(fz_write(dir, "model.safetensors.index.json", data, size));
    ct_err e = {0};
    st_set *s = st_set_open(dir, &e);
    if (s) {
        for (int i = 0; i < st_set_count(s); i++) {
            const st_tensor *t = st_set_get(s, i);
            const char *file = NULL;
            if (st_set_find(s, t->name, &file) != t || !file) abort();
        }
        st_set_close(s);
    } else if (!e.msg[0]) {
        abort();
    }
    return 0;
}
