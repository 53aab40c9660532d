/* data/tokens.c: token files and window packing. */
#include "data/tokens.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "formats/npy.h"

static int ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static int read_bin(const char *path, uint32_t **out, size_t *n, ct_err *e) {
    FILE *f = fopen(path, "rb");
    if (!f) return ct_fail(e, CT_ERR_IO, "%s: cannot open token file (training.dataset_path)", path);
    if (fseek(f, 0, SEEK_END) != 0) { fclose(f); return ct_fail(e, CT_ERR_IO, "%s: cannot seek", path); }
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    if (size < 0 || size % 4) {
        fclose(f);
        return ct_fail(e, CT_ERR_FORMAT, "%s: size %ld is not a multiple of 4 (expected raw little-endian uint32 tokens)",
                       path, size);
    }
    *n = (size_t)size / 4;
    *out = ct_malloc((size_t)size);
    size_t got = fread(*out, 4, *n, f);
    fclose(f);
    if (got != *n) {
        free(*out);
        *out = NULL;
        return ct_fail(e, CT_ERR_IO, "%s: short read", path);
    }
    return 0;
}

int data_open(data_loader *d, const char *path, int seq_len, int vocab_size, ct_err *e) {
    memset(d, 0, sizeof *d);
    if (!path || !*path) return ct_fail(e, CT_ERR_CONFIG, "training.dataset_path: no token file given");
    int rc = ends_with(path, ".npy") ? npy_read_u32(path, &d->tokens, &d->n_tokens, e)
                                     : read_bin(path, &d->tokens, &d->n_tokens, e);
    if (rc) return rc;
    d->path = ct_strdup(path);
    d->seq_len = seq_len;
    for (size_t i = 0; i < d->n_tokens; i++)
        if (d->tokens[i] >= (uint32_t)vocab_size) {
            rc = ct_fail(e, CT_ERR_FORMAT, "%s: token %u at position %zu is outside the vocabulary (size %d)", path,
                         d->tokens[i], i, vocab_size);
            data_close(d);
            return rc;
        }
    d->n_windows = d->n_tokens / ((size_t)seq_len + 1);
    if (d->n_windows == 0) {
        rc = ct_fail(e, CT_ERR_FORMAT, "%s: %zu tokens is too short for one window of training.seq_len + 1 = %d tokens",
                     path, d->n_tokens, seq_len + 1);
        data_close(d);
        return rc;
    }
    return 0;
}

void data_close(data_loader *d) {
    free(d->tokens);
    free(d->path);
    memset(d, 0, sizeof *d);
}

void data_next(data_loader *d, int32_t *inputs, int32_t *labels, int B) {
    int T = d->seq_len;
    for (int b = 0; b < B; b++) {
        if (d->next == d->n_windows) {
            d->next = 0;
            d->epoch++;
            if (!d->quiet)
                fprintf(stderr, "ctitan: data: %s exhausted after %zu windows; starting over (epoch %ld)\n", d->path,
                        d->n_windows, d->epoch);
        }
        const uint32_t *w = d->tokens + d->next * ((size_t)T + 1);
        for (int t = 0; t < T; t++) {
            inputs[(size_t)b * T + t] = (int32_t)w[t];
            labels[(size_t)b * T + t] = (int32_t)w[t + 1];
        }
        d->next++;
    }
}
