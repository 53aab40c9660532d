/* tests/c/model/test_lm.c: model/lm.h's choices that need no weights. How many rows
 * of logits the fused lm_head + loss holds at once (lm_logit_rows): what
 * training.logits_chunk_rows asks, capped at the batch's rows; unset, as few
 * equal blocks as keep one block's fp32 logits within 512 MiB, never under
 * 256 rows (or the batch). The expected rows below are worked out by hand from
 * that rule; the numbers the blocks compute are tests/py/test_parity.py's
 * (test_logits_in_chunks, against transformers). */
#include <string.h>

#include "check.h"
#include "model/lm.h"

static int rows(int vocab, int vocab_rows, int set, int BT) {
    lm_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = vocab;
    c.vocab_rows = vocab_rows;
    c.logit_rows = set;
    return lm_logit_rows(&c, BT);
}

static void test_logit_rows(void) {
    /* Qwen3's vocabulary: 607,744 bytes a row, 883 rows in 512 MiB */
    CHECK(rows(151936, 0, 0, 512) == 512, "W1's 512 rows (297 MiB): one block, got %d", rows(151936, 0, 0, 512));
    CHECK(rows(151936, 0, 0, 883) == 883, "883 rows fit 512 MiB: one block, got %d", rows(151936, 0, 0, 883));
    CHECK(rows(151936, 0, 0, 884) == 442, "884 rows: two blocks of 442, got %d", rows(151936, 0, 0, 884));
    CHECK(rows(151936, 0, 0, 2048) == 683, "2048 rows (1187 MiB): three blocks, got %d", rows(151936, 0, 0, 2048));
    /* vocabulary-parallel: the rank's own rows of the vocabulary count */
    CHECK(rows(151936, 75968, 0, 2048) == 1024, "half the vocabulary, 2048 rows: two blocks, got %d",
          rows(151936, 75968, 0, 2048));
    /* a row of 4 MB: 128 rows would fit, the floor is 256 */
    CHECK(rows(1 << 20, 0, 0, 4096) == 256, "a 2^20 vocabulary: 256 rows, got %d", rows(1 << 20, 0, 0, 4096));
    CHECK(rows(1 << 20, 0, 0, 100) == 100, "fewer rows than the floor: all of them, got %d", rows(1 << 20, 0, 0, 100));
    /* a small vocabulary: the whole batch */
    CHECK(rows(2048, 0, 0, 1024) == 1024, "torchtitan's debugmodel: one block, got %d", rows(2048, 0, 0, 1024));
    /* asked for: as asked, at most the batch */
    CHECK(rows(151936, 0, 5, 512) == 5, "logits_chunk_rows 5, got %d", rows(151936, 0, 5, 512));
    CHECK(rows(151936, 0, 600, 512) == 512, "logits_chunk_rows 600 of 512 rows, got %d", rows(151936, 0, 600, 512));
    CHECK(rows(256, 0, 4096, 32) == 32, "logits_chunk_rows 4096 of 32 rows, got %d", rows(256, 0, 4096, 32));
}

int main(void) {
    test_logit_rows();
    return CHECK_DONE();
}
