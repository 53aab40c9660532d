/* tests/c/model/test_logit_rows_tp.c: lm_logit_rows under a vocabulary-parallel TP
 * degree that does not divide the vocabulary (the ninth mutation audit). Every TP rank
 * must take the same rows (their loss's collectives pair block by block), sized by the
 * largest block, rank 0's ceil(V / t) rows (DTensor Shard(0)'s chunk), within the
 * 512 MiB budget of test_lm.c's rule. A floor(V / t) there, or each rank's own count,
 * passed every test: test_lm.c sets no degree.
 *
 * Worked by hand: V = 65537 over t = 2 is cut 32769 + 32768. 4096 rows of 32768 fp32
 * logits are exactly 2^29 bytes (one block), of 32769 just over it (two blocks of 2048):
 * rank 0's count decides, so both ranks take 2048. */
#include <string.h>

#include "check.h"
#include "model/lm.h"

static int rows_tp(int vocab, int t, int held, int BT) {
    lm_config c;
    memset(&c, 0, sizeof c);
    c.vocab_size = vocab;
    c.tp_degree = t;
    c.vocab_rows = held;
    return lm_logit_rows(&c, BT);
}

static void test_uneven_vocab_rows(void) {
    int r0 = rows_tp(65537, 2, 32769, 4096), r1 = rows_tp(65537, 2, 32768, 4096);
    CHECK(r0 == 2048, "rank 0 (32769 rows of 65537): two blocks of 2048, got %d", r0);
    CHECK(r1 == 2048, "rank 1 (32768 rows): rank 0's blocks, 2048, got %d", r1);
    /* an even cut: 32768 + 32768, one block of all 4096 rows on both */
    int e0 = rows_tp(65536, 2, 32768, 4096);
    CHECK(e0 == 4096, "65536 over 2: one block, got %d", e0);
    /* a rank past the last row (9 over 4: 3, 3, 3, 0) takes rank 0's rows, not none */
    int z = rows_tp(9, 4, 0, 64), f = rows_tp(9, 4, 3, 64);
    CHECK(z == f && z == 64, "9 over 4: the empty rank %d rows, rank 0 %d (want 64)", z, f);
}

int main(void) {
    test_uneven_vocab_rows();
    return CHECK_DONE();
}
