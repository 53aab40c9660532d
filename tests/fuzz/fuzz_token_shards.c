/* Feeds: a `ctitan prepare` directory: meta.json, then (after the FZ_SEP
 * line) shard-00000.bin, then (after another) shard-00000.mask; ds_open
 * reads it as a token dataset (meta.json's shard list and counts, the
 * mapped uint32 tokens, the mask bytes, the vocabulary check) and the
 * loader draws a few windows.
 * Why: prepared shards are copied between machines and may be truncated or
 * replaced; counts that disagree must be caught before a window is cut
 * past the end of a mapping. */
#include "data/dataset.h"
#include "fuzz_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *dir;
    if (!dir) dir = fs_join(fz_dir(), "shards");
    const uint8_t *meta, *rest, *bin, *mask;
    size_t nmeta, nrest, nbin, nmask;
    fz_split(data, size, &meta, &nmeta, &rest, &nrest);
    fz_split(rest, nrest, &bin, &nbin, &mask, &nmask);
    free(fz_write(dir, "meta.json", meta, nmeta));
    free(fz_write(dir, "shard-00000.bin", bin, nbin));
    free(fz_write(dir, "shard-00000.mask", mask, nmask));
    ds_config c;
    ds_config_default(&c);
    c.seq_len = 3;
    c.vocab_size = 300;
    c.shuffle = 1;
    c.quiet = 1;
    c.tok.kind = DS_KIND_TOKENS;
    ds *d = NULL;
    ct_err e = {0};
    const char *paths[] = {dir};
    if (ds_open(&d, paths, 1, NULL, &c, &e) == 0) {
        int32_t in[2 * 3], lab[2 * 3];
        for (int i = 0; i < 3; i++) {
            ds_next(d, in, lab, 2);
            for (int k = 0; k < 6; k++)
                if (in[k] < 0 || in[k] >= 300 || lab[k] < -100 || lab[k] >= 300) abort();
        }
        ds_state s = {1, 0};
        (void)ds_set_state(d, &s, &e);
        ds_close(d);
    } else if (!e.msg[0]) {
        abort();
    }
    return 0;
}
