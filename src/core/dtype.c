/* core/dtype.c: dtype names, sizes and conversions. */
#include "core/dtype.h"

#include <math.h>
#include <string.h>

static const char *names[CT_DTYPE_COUNT] = {"F32", "BF16", "F16", "F64", "I64", "I32", "I16",
                                            "I8",  "U8",   "U16", "U32", "U64", "BOOL"};
static const size_t sizes[CT_DTYPE_COUNT] = {4, 2, 2, 8, 8, 4, 2, 1, 1, 2, 4, 8, 1};

size_t ct_dtype_size(ct_dtype t) { return (unsigned)t < CT_DTYPE_COUNT ? sizes[t] : 0; }
const char *ct_dtype_name(ct_dtype t) { return (unsigned)t < CT_DTYPE_COUNT ? names[t] : "?"; }

int ct_dtype_from_name(const char *name) {
    for (int i = 0; i < CT_DTYPE_COUNT; i++)
        if (strcmp(names[i], name) == 0) return i;
    return -1;
}

float ct_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The fp32 bits u rounded to bf16, which is the high half (the low half is
 * garbage): nearest, ties to even; a NaN stays a NaN, made quiet, with its sign
 * and the payload's high bits. Without branches, so that loops of it vectorise. */
static inline uint32_t bf16_high(uint32_t u) {
    return (u & 0x7fffffffu) > 0x7f800000u ? u | 0x00400000u : u + 0x7fffu + ((u >> 16) & 1u);
}

uint16_t ct_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(bf16_high(u) >> 16);
}

void ct_round_bf16(float *x, size_t n) {
#ifdef _OPENMP
#pragma omp simd
#endif
    for (size_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, 4);
        u = bf16_high(u) & 0xffff0000u;
        memcpy(x + i, &u, 4);
    }
}

float ct_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    int exp = (h >> 10) & 0x1f;
    uint32_t man = h & 0x3ffu;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24);
        uint32_t u;
        memcpy(&u, &f, 4);
        u |= sign;
        memcpy(&f, &u, 4);
        return f;
    }
    uint32_t u;
    if (exp == 31) u = sign | 0x7f800000u | (man << 13);
    else u = sign | ((uint32_t)(exp - 15 + 127) << 23) | (man << 13);
    memcpy(&f, &u, 4);
    return f;
}

uint16_t ct_f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u;
    if (a >= 0x477ff000u) return sign | 0x7c00u; /* overflow (>= 65520) -> inf */
    if (a < 0x38800000u) {                       /* subnormal or zero in f16 */
        float af;
        memcpy(&af, &a, 4);
        /* scale so that one f16 subnormal ulp (2^-24) becomes 1, round half even */
        float r = nearbyintf(af * 16777216.0f);
        return sign | (uint16_t)r;
    }
    uint32_t man = a & 0x7fffffu;
    uint32_t exp = (a >> 23) - 127 + 15;
    uint32_t h = (exp << 10) | (man >> 13);
    uint32_t rem = man & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return sign | (uint16_t)h;
}

int ct_convert_to_f32(float *dst, const void *src, ct_dtype t, size_t n) {
    switch (t) {
    case CT_F32: memcpy(dst, src, n * 4); return 0;
    case CT_BF16: {
        /* the bits moved up by 16: a plain loop the compiler vectorises, on every
         * thread for large n (whole bf16 tensors: loads, exports, an adapted MoE
         * expert parameter formed from its bf16 store every step) */
        const uint16_t *s = src;
        long nn = (long)n;
#pragma omp parallel for schedule(static) if (nn > (1L << 16))
        for (long i = 0; i < nn; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            memcpy(dst + i, &u, 4);
        }
        return 0;
    }
    case CT_F16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = ct_f16_to_f32(s[i]);
        return 0;
    }
    case CT_F64: {
        const double *s = src;
        for (size_t i = 0; i < n; i++) dst[i] = (float)s[i];
        return 0;
    }
    default: return -1;
    }
}

int ct_convert_from_f32(void *dst, ct_dtype t, const float *src, size_t n) {
    switch (t) {
    case CT_F32: memcpy(dst, src, n * 4); return 0;
    case CT_BF16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = ct_f32_to_bf16(src[i]);
        return 0;
    }
    case CT_F16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = ct_f32_to_f16(src[i]);
        return 0;
    }
    default: return -1;
    }
}

/* Branch-free over blocks (an OR of exponent tests, which the compiler
 * vectorises), so the common all-finite case runs at memory speed; the
 * position is looked for only inside a block that has one. */
size_t ct_first_nonfinite(const float *x, size_t n) {
    for (size_t i0 = 0; i0 < n; i0 += 4096) {
        size_t i1 = n - i0 < 4096 ? n : i0 + 4096;
        uint32_t bad = 0;
        for (size_t i = i0; i < i1; i++) {
            uint32_t u;
            memcpy(&u, x + i, sizeof u);
            bad |= (uint32_t)((u & 0x7f800000u) == 0x7f800000u);
        }
        if (bad)
            for (size_t i = i0; i < i1; i++)
                if (!isfinite(x[i])) return i;
    }
    return n;
}

int ct_check_finite(const float *x, size_t n, size_t first, const char *file, const char *name, ct_err *e) {
    size_t j = ct_first_nonfinite(x, n);
    if (j == n) return 0;
    return ct_fail(e, CT_ERR_FORMAT, "%s: tensor \"%s\" holds a non-finite value (%g) at element %zu", file, name,
                   (double)x[j], first + j);
}
