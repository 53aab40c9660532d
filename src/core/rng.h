/* core/rng.h: a small deterministic generator for weight init and shuffling.
 *
 * splitmix64 seeded, xoshiro256** stepped: the same seed gives the same
 * weights on every machine and thread count, which resume tests rely on. The
 * state is a plain struct so a checkpoint can store it. Beside it, the one
 * text hash the ranks of a run compare their inputs with. */
#ifndef CT_CORE_RNG_H
#define CT_CORE_RNG_H

#include <stdint.h>

typedef struct {
    uint64_t s[4];
} ct_rng;

void ct_rng_seed(ct_rng *r, uint64_t seed);
uint64_t ct_rng_u64(ct_rng *r);
/* Uniform in [0, 1) with 53 bits. */
double ct_rng_uniform(ct_rng *r);
/* Standard normal (Box-Muller, both values used in turn is not worth the state). */
double ct_rng_normal(ct_rng *r);

/* FNV-1a (64-bit) of a NUL-terminated text (NULL: of ""): the same on every
 * machine, for ranks to compare what each read without sending it. */
uint64_t ct_hash_text(const char *s);

#endif
