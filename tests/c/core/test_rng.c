/* tests/c/core/test_rng.c: core/rng.h's text hash, which the ranks of a run
 * compare their config and model with: FNV-1a 64 must give the published test
 * vectors (Fowler/Noll/Vo's FNV test suite), the same on every machine. */
#include <stdint.h>

#include "check.h"
#include "core/rng.h"

int main(void) {
    CHECK(ct_hash_text("") == 0xcbf29ce484222325ull, "FNV-1a of \"\": %llx", (unsigned long long)ct_hash_text(""));
    CHECK(ct_hash_text(NULL) == ct_hash_text(""), "NULL hashes as \"\"");
    CHECK(ct_hash_text("a") == 0xaf63dc4c8601ec8cull, "FNV-1a of \"a\": %llx",
          (unsigned long long)ct_hash_text("a"));
    CHECK(ct_hash_text("foobar") == 0x85944171f73967e8ull, "FNV-1a of \"foobar\": %llx",
          (unsigned long long)ct_hash_text("foobar"));
    return CHECK_DONE();
}
