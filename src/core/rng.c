/* core/rng.c: splitmix64 + xoshiro256**. */
#include "core/rng.h"

#include <math.h>

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void ct_rng_seed(ct_rng *r, uint64_t seed) {
    for (int i = 0; i < 4; i++) r->s[i] = splitmix(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t ct_rng_u64(ct_rng *r) {
    uint64_t *s = r->s;
    uint64_t out = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return out;
}

double ct_rng_uniform(ct_rng *r) { return (double)(ct_rng_u64(r) >> 11) * 0x1.0p-53; }

double ct_rng_normal(ct_rng *r) {
    double u1 = ct_rng_uniform(r), u2 = ct_rng_uniform(r);
    if (u1 < 1e-300) u1 = 1e-300;
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

uint64_t ct_hash_text(const char *s) {
    uint64_t h = 14695981039346656037ull;
    for (const char *p = s ? s : ""; *p; p++) h = (h ^ (uint8_t)*p) * 1099511628211ull;
    return h;
}
