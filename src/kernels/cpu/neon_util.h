/* kernels/cpu/neon_util.h: small NEON helpers shared by the aarch64 kernels
 * (gemm_neon.c, gemm_sve*.c, elementwise_neon.c, moe_cpu.c): partial loads
 * and stores, a 4 x 4 transpose and the GEMM packers' slab transpose on it,
 * the GEMMs' block arithmetic, round-to-nearest-even bf16 bits, the vector
 * exp and tanh.
 *
 * NEON (ASIMD) is part of the base aarch64 architecture, so these need no
 * target attribute. NEON has no masked loads: a partial vector is copied
 * through a small stack buffer, so no helper ever reads or writes past the
 * n elements it is given (tensors need no padding). aarch64 only: the
 * includers guard it. */
#ifndef CT_KERNELS_CPU_NEON_UTIL_H
#define CT_KERNELS_CPU_NEON_UTIL_H
#if defined(__aarch64__)

#include <arm_neon.h>

#define NEON_INLINE __attribute__((always_inline)) static inline

/* The aarch64 GEMMs' block arithmetic (gemm_neon.c, gemm_sve.c,
 * gemm_sve_bf16.c each had its own copy): ceil(a / b) for a >= 0, b > 0, and
 * v clamped to [lo, hi]. */
static inline long neon_ceil_div(long a, long b) { return (a + b - 1) / b; }
static inline long neon_clampl(long v, long lo, long hi) { return v < lo ? lo : v > hi ? hi : v; }

/* min(n, 4) floats from p, zeros in the other lanes (n <= 0: all zeros). */
NEON_INLINE float32x4_t neon_loadn(const float *p, long n) {
    if (n >= 4) return vld1q_f32(p);
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (long i = 0; i < n; i++) t[i] = p[i];
    return vld1q_f32(t);
}
/* The low min(n, 4) lanes of v to p. */
NEON_INLINE void neon_storen(float *p, float32x4_t v, long n) {
    if (n >= 4) {
        vst1q_f32(p, v);
        return;
    }
    float t[4];
    vst1q_f32(t, v);
    for (long i = 0; i < n; i++) p[i] = t[i];
}

/* In-register 4 x 4 transpose: lane j of r[i] becomes lane i of r[j]. */
NEON_INLINE void neon_transpose4(float32x4_t r[4]) {
    float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
    float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
    r[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
    r[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0), vreinterpretq_f64_f32(t2)));
    r[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1), vreinterpretq_f64_f32(t3)));
}

/* Transposes `lines` (<= 4; the others become zeros) lines of kc floats,
 * line l contiguous at src + l * ld, into dst[k * dstride + l] for l < 4:
 * the NEON and SVE GEMMs' packers of A and of the forward's B. Lines past
 * `lines` are never read. */
static inline void neon_transpose_slab4(float *dst, long dstride, const float *src, long ld, long lines, long kc) {
    long k0 = 0;
    for (; k0 + 4 <= kc; k0 += 4) {
        float32x4_t r[4];
        for (long l = 0; l < 4; l++) r[l] = l < lines ? vld1q_f32(src + l * ld + k0) : vdupq_n_f32(0.0f);
        neon_transpose4(r);
        for (int kk = 0; kk < 4; kk++) vst1q_f32(dst + (k0 + kk) * dstride, r[kk]);
    }
    for (; k0 < kc; k0++)
        for (long l = 0; l < 4; l++) dst[k0 * dstride + l] = l < lines ? src[l * ld + k0] : 0.0f;
}

/* x rounded to the nearest bf16 (ties to even) as fp32 bits: the bf16 is the
 * high half. NaN: a quiet NaN with the same sign and payload, as
 * core/dtype's ct_f32_to_bf16 and torch's .to(bfloat16). */
NEON_INLINE uint32x4_t neon_rne_bf16_bits(float32x4_t x) {
    uint32x4_t u = vreinterpretq_u32_f32(x);
    uint32x4_t r = vaddq_u32(u, vaddq_u32(vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)), vdupq_n_u32(0x7fff)));
    return vbslq_u32(vceqq_f32(x, x), r, vorrq_u32(u, vdupq_n_u32(0x00400000)));
}

/* e^x for 4 lanes: exp16's algorithm (avx512_util.h). x = n ln2 + r with
 * n = round(x / ln2), |r| <= ln2/2 (Cody-Waite split of ln2, each product
 * exact inside the FMA), e^r by its Taylor polynomial to r^7 (truncation
 * 5e-9 relative), then 2^n applied as two normal factors 2^(n >> 1) and
 * 2^(n - (n >> 1)) (after the clamp n is in [-150, 129], outside the normal
 * exponents at both ends), so overflow gives +inf. Results that would be
 * denormal are 0 (x < -86.5: the second factor is zeroed), as in the x86
 * exps (avx512_util.h's exp16), so every ISA's exp gives the same values.
 * NaN stays NaN (AArch64's FMIN/FMAX propagate it); -inf gives 0. Error:
 * within 1.2e-7 relative of double exp where the result is normal
 * (tests/c/kernels/test_elementwise.c). */
NEON_INLINE float32x4_t neon_exp4(float32x4_t x) {
    x = vmaxq_f32(vdupq_n_f32(-104.0f), vminq_f32(vdupq_n_f32(89.0f), x));
    float32x4_t n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(1.44269504088896341f)));
    float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693147182464599609375f));
    r = vfmsq_f32(r, n, vdupq_n_f32(-1.904654299957768e-09f));
    float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 720.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
    int32x4_t ni = vcvtq_s32_f32(n); /* NaN converts to 0; p is NaN already */
    int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
    float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, vdupq_n_s32(127)), 23));
    float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, vdupq_n_s32(127)), 23));
    uint32x4_t tiny = vcltq_f32(x, vdupq_n_f32(-86.5f)); /* false for NaN: kept */
    s2 = vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(s2), tiny));
    return vmulq_f32(vmulq_f32(p, s1), s2);
}

/* tanh(x) for 4 lanes: avx512_util.h's tanh16 (the same polynomial below
 * 0.625, (1 - e)/(1 + e) with e = e^-2a above it, the sign of x put back). */
NEON_INLINE float32x4_t neon_tanh4(float32x4_t x) {
    float32x4_t a = vabsq_f32(x), z = vmulq_f32(a, a), one = vdupq_n_f32(1.0f);
    float32x4_t p = vdupq_n_f32(0.002148957457393408f);
    p = vfmaq_f32(vdupq_n_f32(-0.00818463321775198f), p, z);
    p = vfmaq_f32(vdupq_n_f32(0.021703990176320076f), p, z);
    p = vfmaq_f32(vdupq_n_f32(-0.05394745245575905f), p, z);
    p = vfmaq_f32(vdupq_n_f32(0.13333211839199066f), p, z);
    p = vfmaq_f32(vdupq_n_f32(-0.3333333134651184f), p, z);
    float32x4_t small = vfmaq_f32(a, vmulq_f32(a, z), p);
    float32x4_t e = neon_exp4(vmulq_f32(a, vdupq_n_f32(-2.0f)));
    float32x4_t big = vdivq_f32(vsubq_f32(one, e), vaddq_f32(one, e));
    float32x4_t t = vbslq_f32(vcltq_f32(a, vdupq_n_f32(0.625f)), small, big);
    uint32x4_t sign = vandq_u32(vreinterpretq_u32_f32(x), vdupq_n_u32(0x80000000u));
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(t), sign));
}

#endif /* __aarch64__ */
#endif /* CT_KERNELS_CPU_NEON_UTIL_H */
