/* data/tokens.h: pre-tokenized token files and torchtitan-style packing.
 *
 * A token file is raw little-endian uint32 (`.bin`) or an integer `.npy`.
 * The stream is cut into disjoint windows of seq_len + 1 tokens
 * (input = window[:-1], labels = window[1:]); batches take consecutive
 * windows; at the end the loader starts over and says so. The position is a
 * pair of plain integers (epoch, next window) so a checkpoint can restore it. */
#ifndef CT_DATA_TOKENS_H
#define CT_DATA_TOKENS_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

typedef struct {
    char *path;
    uint32_t *tokens;  /* [n_tokens] */
    size_t n_tokens;
    int seq_len;
    size_t n_windows;  /* n_tokens / (seq_len + 1) */
    size_t next;       /* next window index */
    long epoch;        /* completed passes over the file */
    int quiet;         /* no "starting over" message */
} data_loader;

/* Loads the file; every token must be < vocab_size (the error names the file and
 * the position). A file shorter than one window is an error. */
int data_open(data_loader *d, const char *path, int seq_len, int vocab_size, ct_err *e);
void data_close(data_loader *d);
/* Fills inputs/labels [B, seq_len] from the next B windows. */
void data_next(data_loader *d, int32_t *inputs, int32_t *labels, int B);

#endif
