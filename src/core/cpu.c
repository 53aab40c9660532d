/* core/cpu.c: peak FLOP/s measurement (design note at "the peak" below) and process memory. */
#include "core/cpu.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <errno.h>
#include <immintrin.h>
#include <pthread.h>
#include <sys/syscall.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "core/fs.h"
#include "core/timer.h"

void openblas_set_num_threads(int n); /* OpenBLAS's own knob; it keeps a pool apart from OpenMP's */
char *openblas_get_corename(void);

int cpu_threads(void) { return omp_get_max_threads(); }

void cpu_set_threads(int n) {
    if (n <= 0) return;
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

/* ------------------------------------------------------------- the peak
 *
 * What MFU needs is the most FLOP/s this process could get from the cores it
 * has. Three things made the old one-shot figure untrustworthy: wall-clock
 * timing (a burst that lost its core to another process looks slow), too few
 * repeats to tell a stable figure from a lucky one, and nothing to compare it
 * with. So:
 *   - every burst is timed with the thread's own CPU clock
 *     (CLOCK_THREAD_CPUTIME_ID), so time the thread spent descheduled does not
 *     count, and bursts whose CPU time is well below their wall time are
 *     marked as preempted;
 *   - the core clock is measured the same way with a chain of dependent
 *     integer adds (one per cycle on every x86-64 and aarch64 core), and the
 *     FMA throughput divided by it must come out near a whole number of vector
 *     FMAs per cycle (1 or 2 on the CPUs we meet): that integer times clock x
 *     lanes x 2 x threads is the theoretical figure the measurement is
 *     checked against;
 *   - the figure used is the larger of the measured and the theoretical one,
 *     so a disturbed measurement can only make MFU smaller, never above 100%;
 *   - it is cached (per CPU model, ISA and thread count) only when the
 *     repeats agree to 3%, the measured and theoretical figures agree to 10%,
 *     no burst was preempted, /proc/stat shows no other process (nor the
 *     hypervisor's steal) used the CPUs during the measurement, and the load
 *     average says the machine was quiet before it;
 *   - a cached figure is used only while the clock measured now is within
 *     15% of the one it was measured at (a VM keeps its CPU model name when
 *     it moves to a host that clocks differently).
 * bf16 (products of bf16 pairs, fp32 sums) is measured the same way on the
 * best bf16 instruction the CPU has, else equals the fp32 peak. */

#define PEAK_REPS 12        /* bursts per thread; the best ones are kept */
#define PEAK_BURST_S 0.004  /* target CPU seconds of one burst */
#define PEAK_STABLE 0.03    /* best and third-best burst within 3% */
#define PEAK_AGREE 0.10     /* measured vs theoretical within 10% */
#define PEAK_QUIET_LOAD 0.5 /* 1-minute load average above which we do not cache */
#define PEAK_OTHERS 0.05    /* share of the CPUs others may use during the measurement */
#define PEAK_CLOCK_DRIFT 0.15 /* a cache whose clock is further than this from the clock now is stale */

static double thread_cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* 12 independent accumulators hide the FMA latency (4-5 cycles x 2 ports). */
#define FMA_CHAINS 12

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static double fma_loop_avx512(long iters) {
    __m512 acc[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; i++) acc[i] = _mm512_set1_ps((float)i * 1e-3f);
    const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
    for (long it = 0; it < iters; it++)
#pragma GCC unroll 16
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
    float sink = 0;
    for (int i = 0; i < FMA_CHAINS; i++) sink += _mm512_reduce_add_ps(acc[i]);
    return sink; /* keeps the loop alive */
}

__attribute__((target("avx2,fma"))) static double fma_loop_avx2(long iters) {
    __m256 acc[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; i++) acc[i] = _mm256_set1_ps((float)i * 1e-3f);
    const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
    for (long it = 0; it < iters; it++)
#pragma GCC unroll 16
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    float buf[8], sink = 0;
    for (int i = 0; i < FMA_CHAINS; i++) {
        _mm256_storeu_ps(buf, acc[i]);
        for (int j = 0; j < 8; j++) sink += buf[j];
    }
    return sink;
}

/* vdpbf16ps: 16 lanes x 2 bf16 products each, fp32 sums. */
__attribute__((target("avx512f,avx512bf16"))) static double bf16_loop_avx512(long iters) {
    __m512 acc[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; i++) acc[i] = _mm512_set1_ps((float)i * 1e-3f);
    const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3380);
    for (long it = 0; it < iters; it++)
#pragma GCC unroll 16
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    float sink = 0;
    for (int i = 0; i < FMA_CHAINS; i++) sink += _mm512_reduce_add_ps(acc[i]);
    return sink;
}
#elif defined(__aarch64__)
/* NEON (ASIMD is in every aarch64 CPU): 12 chains of 4-lane FMAs; Neoverse
 * V1/V2 have 4 FMA pipes of 4 cycles' latency, so 12 chains keep 3 in flight each. */
static double fma_loop_neon(long iters) {
    float32x4_t acc[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; i++) acc[i] = vdupq_n_f32((float)i * 1e-3f);
    const float32x4_t a = vdupq_n_f32(0.999999f), b = vdupq_n_f32(1e-7f);
    for (long it = 0; it < iters; it++)
#pragma GCC unroll 16
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = vfmaq_f32(b, acc[i], a);
    float sink = 0;
    for (int i = 0; i < FMA_CHAINS; i++) sink += vaddvq_f32(acc[i]);
    return sink;
}
/* BFMMLA: a 2x4 by 4x2 bf16 product into a 2x2 fp32 tile, 16 multiply-adds
 * per 128-bit instruction (8 FLOPs per fp32 lane). Only where HWCAP2_BF16 says so.
 * +fp16: GCC 12 materialises the bf16 constants with an fp16 fmov (every BF16
 * CPU has FP16: Neoverse V1/V2/N2, Graviton 3/4). */
__attribute__((target("arch=armv8.2-a+bf16+fp16"))) static double bf16_loop_neon(long iters) {
    float32x4_t acc[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; i++) acc[i] = vdupq_n_f32((float)i * 1e-3f);
    const bfloat16x8_t a = vreinterpretq_bf16_u16(vdupq_n_u16(0x3f80)), b = vreinterpretq_bf16_u16(vdupq_n_u16(0x3380));
    for (long it = 0; it < iters; it++)
#pragma GCC unroll 16
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = vbfmmlaq_f32(acc[i], a, b);
    float sink = 0;
    for (int i = 0; i < FMA_CHAINS; i++) sink += vaddvq_f32(acc[i]);
    return sink;
}
#endif

#if defined(__x86_64__)
/* ------------------------------------------------------------- AMX tiles */

#define ARCH_REQ_XCOMP_PERM 0x1023 /* linux/arch/x86/include/uapi/asm/prctl.h */
#define ARCH_GET_XCOMP_PERM 0x1022
#define XFEATURE_XTILEDATA 18

/* ------------------------------------------------------ permission (once) */

/* Process-wide state (docs/design.md, "State outside a run context"): Linux
 * grants the tile data state per process, so whether it was granted (and why
 * not) is per-process too. Written once under pthread_once, read-only
 * afterwards. */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_ok;
static char amx_why[160] = "not probed";

static void amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) {
        snprintf(amx_why, sizeof amx_why, "the CPU has no AMX-TILE / AMX-BF16 (CPUID.7.0:EDX bits 24, 22)");
        return;
    }
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) {
        snprintf(amx_why, sizeof amx_why, "the OS does not enable XSAVE (CPUID.1:ECX.OSXSAVE)");
        return;
    }
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) {
        snprintf(amx_why, sizeof amx_why, "the OS does not enable the tile state (XCR0 = %#x lacks bits 17, 18)",
                 lo);
        return;
    }
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        snprintf(amx_why, sizeof amx_why, "Linux refused the tile data state: arch_prctl(ARCH_REQ_XCOMP_PERM): %s",
                 strerror(errno));
        return;
    }
    unsigned long perm = 0;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &perm) != 0 || !(perm & (1ul << XFEATURE_XTILEDATA))) {
        snprintf(amx_why, sizeof amx_why, "Linux did not grant the tile data state (ARCH_GET_XCOMP_PERM)");
        return;
    }
    snprintf(amx_why, sizeof amx_why, "usable");
    amx_ok = 1;
}

int cpu_amx_bf16_ready(const char **why) {
    pthread_once(&amx_once, amx_probe);
    if (why) *why = amx_why;
    return amx_ok;
}

/* TDPBF16PS on 16 x 16 fp32 accumulators from 16 x 32 bf16 A and B tiles:
 * 16 x 16 x 32 multiply-adds per instruction. Four accumulators (tmm0-3) with
 * the same two sources: independent, so the tile unit stays busy. Measured
 * here for the bf16 peak only; the GEMM is kernels/cpu/gemm_bf16_amx.c. */
typedef struct {
    unsigned char palette, start_row, reserved[14];
    unsigned short colsb[16];
    unsigned char rows[16];
} cpu_tilecfg;

__attribute__((target("amx-tile,amx-bf16"))) static double bf16_loop_amx(long iters) {
    _Alignas(64) cpu_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 6; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _Alignas(64) unsigned short src[16 * 32];
    for (int i = 0; i < 16 * 32; i++) src[i] = 0x3380; /* small: the sums stay finite */
    /* ldtilecfg with the whole 64-byte struct as operand (GCC 12's _tile_loadconfig
     * declares 8 bytes, and the stores of the sizes were dropped as dead) */
    __asm__ volatile("ldtilecfg %0" : : "m"(cfg));
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, src, 64);
    _tile_loadd(5, src, 64);
    for (long it = 0; it < iters; it++) {
        _tile_dpbf16ps(0, 4, 5);
        _tile_dpbf16ps(1, 4, 5);
        _tile_dpbf16ps(2, 4, 5);
        _tile_dpbf16ps(3, 4, 5);
    }
    _Alignas(64) float out[16 * 16];
    _tile_stored(0, out, 64);
    _tile_release();
    return out[0];
}
#else
int cpu_amx_bf16_ready(const char **why) {
    if (why) *why = "not an x86-64 CPU";
    return 0;
}
#endif

static double fma_loop_scalar(long iters) {
    volatile float acc[FMA_CHAINS]; /* volatile: measure scalar FMAs, not what the vectoriser makes of them */
    for (int i = 0; i < FMA_CHAINS; i++) acc[i] = (float)i * 1e-3f;
    for (long it = 0; it < iters; it++)
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = acc[i] * 0.999999f + 1e-7f;
    float sink = 0;
    for (int i = 0; i < FMA_CHAINS; i++) sink += acc[i];
    return sink;
}

/* 200 dependent adds per iteration: one per cycle, so iterations x 200 / CPU
 * seconds is the clock this thread ran at. Register operands: Golden Cove and
 * later fold chains of add-immediate at rename (measured 6x the clock). */
static double clock_loop(long iters) {
    unsigned long x = (unsigned long)iters, one = 1;
    for (long it = 0; it < iters; it++) {
#if defined(__x86_64__)
        __asm__ volatile(".rept 200\n\taddq %1, %0\n\t.endr" : "+r"(x) : "r"(one));
#elif defined(__aarch64__)
        __asm__ volatile(".rept 200\n\tadd %0, %0, %1\n\t.endr" : "+r"(x) : "r"(one));
#else
        for (int i = 0; i < 200; i++) __asm__ volatile("" : "+r"(x)), x += one;
#endif
    }
    return (double)x;
}

typedef enum { PEAK_FP32, PEAK_BF16, PEAK_CLOCK } peak_kind;

typedef struct {
    const char *isa;
    int lanes;          /* fp32 lanes of one vector */
    int flops_per_lane; /* FLOPs per lane per instruction: 2 (FMA), 4 (a bf16 pair dot) */
    double iter_flops;  /* FLOPs of one loop iteration if not lanes x flops_per_lane x FMA_CHAINS (AMX) */
    double (*loop)(long iters);
} peak_loop;

/* The widest fp32 FMA and bf16 instruction this CPU has (bf16: NULL loop when
 * none), at most the level `limit` (cpu_peak_flops). */
static void peak_loops(peak_loop *fp32, peak_loop *bf16, const char *limit) {
    *fp32 = (peak_loop){"scalar", 1, 2, 0, fma_loop_scalar};
    *bf16 = (peak_loop){"fp32", 0, 0, 0, NULL};
    (void)limit;
#if defined(__x86_64__)
    int is_avx2 = limit && !strcmp(limit, "avx2"), is_avx512 = limit && !strcmp(limit, "avx512");
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && !is_avx2) *fp32 = (peak_loop){"avx512", 16, 2, 0, fma_loop_avx512};
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        *fp32 = (peak_loop){"avx2", 8, 2, 0, fma_loop_avx2};
    if (is_avx2)
        return; /* no bf16 unit at AVX2: bf16 runs on the fp32 FMAs */
    if (!is_avx512 && cpu_amx_bf16_ready(NULL)) /* 4 x TDPBF16PS of 16 x 16 x 32 multiply-adds per iteration */
        *bf16 = (peak_loop){"amx", 16, 2, 4.0 * 16 * 16 * 32 * 2, bf16_loop_amx};
    else if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16"))
        *bf16 = (peak_loop){"avx512bf16", 16, 4, 0, bf16_loop_avx512};
#elif defined(__aarch64__)
    *fp32 = (peak_loop){"neon", 4, 2, 0, fma_loop_neon};
    if ((getauxval(AT_HWCAP2) & HWCAP2_BF16) && !(limit && !strcmp(limit, "neon")))
        *bf16 = (peak_loop){"bfmmla", 4, 8, 0, bf16_loop_neon};
#endif
}

static int cmp_desc(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x < y) - (x > y);
}

/* Rate (instructions x lanes x flops_per_lane, or cycles for the clock loop,
 * per CPU second) over PEAK_REPS bursts run on `threads` threads at once,
 * summed over the threads: each thread's best burst for the FMA loops (the
 * peak is what the core can do), its median for the clock (a clock is not a
 * maximum: the best of 12 noisy bursts would overstate it). spread: 1 - third
 * best / best, the threads' worst; *preempted counts the three best bursts
 * whose CPU time was < 90% of their wall time. */
static double peak_measure(const peak_loop *L, peak_kind kind, int threads, double *spread, int *preempted) {
    double sum = 0, worst_spread = 0;
    int pre = 0;
    /* calibrate the iteration count so one burst takes ~PEAK_BURST_S */
    long iters = 1000;
    for (;;) {
        double t0 = thread_cpu_now();
        volatile double s = kind == PEAK_CLOCK ? clock_loop(iters) : L->loop(iters);
        (void)s;
        double dt = thread_cpu_now() - t0;
        if (dt > PEAK_BURST_S / 4 || iters > (1L << 40)) {
            iters = (long)((double)iters * PEAK_BURST_S / (dt > 1e-9 ? dt : 1e-9)) + 1;
            break;
        }
        iters *= 4;
    }
    double work = kind == PEAK_CLOCK ? 200.0 * (double)iters
                     : L->iter_flops > 0 ? L->iter_flops * (double)iters
                                         : (double)L->lanes * L->flops_per_lane * FMA_CHAINS * (double)iters;
#pragma omp parallel num_threads(threads) reduction(+ : sum, pre) reduction(max : worst_spread)
    {
        double rate[PEAK_REPS], sorted[PEAK_REPS];
        int was_pre[PEAK_REPS];
        for (int r = 0; r < PEAK_REPS; r++) {
            double w0 = ct_now(), t0 = thread_cpu_now();
            volatile double s = kind == PEAK_CLOCK ? clock_loop(iters) : L->loop(iters);
            (void)s;
            double dt = thread_cpu_now() - t0, wall = ct_now() - w0;
            rate[r] = sorted[r] = work / (dt > 1e-9 ? dt : 1e-9);
            was_pre[r] = dt < 0.9 * wall;
        }
        qsort(sorted, PEAK_REPS, sizeof sorted[0], cmp_desc);
        sum += kind == PEAK_CLOCK ? sorted[PEAK_REPS / 2] : sorted[0];
        for (int r = 0; r < PEAK_REPS; r++) pre += was_pre[r] && rate[r] >= sorted[2];
        double sp = sorted[0] > 0 ? 1.0 - sorted[2] / sorted[0] : 1.0;
        if (sp > worst_spread) worst_spread = sp;
    }
    *spread = worst_spread;
    *preempted = pre;
    return sum;
}

void cpu_model_name(char *out, size_t cap) {
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        /* x86: "model name"; aarch64 has no model name, its "CPU part" names the core */
        if (strncmp(line, "model name", 10) == 0 || strncmp(line, "CPU part", 8) == 0) {
            char *p = strchr(line, ':');
            if (p) {
                p += 2;
                p[strcspn(p, "\n")] = 0;
                for (char *q = p; *q; q++)
                    if (*q == ' ' || *q == '/') *q = '_';
                snprintf(out, cap, "%s", p);
            }
            break;
        }
    }
    fclose(f);
}

void cpu_cache_path(char *out, size_t cap, const char *name) {
    const char *home = getenv("HOME");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/.cache/ctitan", home && *home ? home : "/tmp");
    ct_mkdirs(dir, NULL); /* best effort: a cache that cannot be written is measured again */
    fs_join_buf(out, cap, dir, name, NULL); /* dir is at most 1 KiB: callers' buffers hold it */
}

/* keyed by both instruction sets: a run held to "avx512" on an AMX CPU has
 * the fp32 loop of an unlimited one but not its bf16 unit */
static void cache_path(char *out, size_t cap, const char *isa, const char *bf16_isa, int threads) {
    char model[256], name[512];
    cpu_model_name(model, sizeof model);
    snprintf(name, sizeof name, "peak-v4-%s-%s-%s-t%d.txt", model, isa, bf16_isa, threads);
    cpu_cache_path(out, cap, name);
}

static int read_cache(cpu_peak *out, const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    double v[5] = {0};
    int n = fscanf(f, "fp32 %lf\nbf16 %lf\ntheory %lf\nclock %lf\nfma_per_cycle %lf", &v[0], &v[1], &v[2], &v[3],
                   &v[4]);
    fclose(f);
    if (n != 5 || !(v[0] > 0) || !(v[1] > 0) || !(v[2] > 0) || !(v[3] > 0) || !(v[4] >= 1)) return 0;
    out->flops = v[0], out->bf16_flops = v[1], out->theory_flops = v[2], out->clock_hz = v[3];
    out->fma_per_cycle = (int)v[4];
    return 1;
}

static void write_cache(const cpu_peak *p, const char *path) {
    /* temp + rename: a concurrent run reads the old value or the new one, never half;
     * failing to write the cache is harmless */
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    int ok = fprintf(f, "fp32 %.6e\nbf16 %.6e\ntheory %.6e\nclock %.6e\nfma_per_cycle %d\n", p->flops, p->bf16_flops,
                     p->theory_flops, p->clock_hz, p->fma_per_cycle) > 0;
    ok &= fclose(f) == 0;
    if (!ok || rename(tmp, path) != 0) remove(tmp);
}

/* CPU ticks (USER_HZ) used on the whole machine (steal included: the
 * hypervisor gave the core to someone else) and by this process; their
 * difference over the measurement is the work that shared our cores. */
static void ticks_now(double *machine, double *self) {
    *machine = *self = 0;
    FILE *f = fopen("/proc/stat", "r");
    if (f) {
        unsigned long long v[8] = {0};
        if (fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                   &v[7]) == 8)
            *machine = (double)(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]); /* all but idle and iowait */
        fclose(f);
    }
    f = fopen("/proc/self/stat", "r");
    if (f) {
        char buf[1024];
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        buf[n] = 0;
        fclose(f);
        /* fields after the command name (which may hold spaces): state is field 3, utime 14, stime 15 */
        char *p = strrchr(buf, ')');
        unsigned long long ut = 0, st = 0;
        if (p && sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) == 2)
            *self = (double)(ut + st);
    }
}

void cpu_usage_mark_now(cpu_usage_mark *m) {
    ticks_now(&m->machine, &m->self);
    m->wall = ct_now();
}

double cpu_others_share(const cpu_usage_mark *since) {
    cpu_usage_mark now;
    cpu_usage_mark_now(&now);
    long ncpu = sysconf(_SC_NPROCESSORS_ONLN);
    double tick = (double)sysconf(_SC_CLK_TCK), wall = now.wall - since->wall;
    if (wall <= 0) return 0;
    /* ticks are 10 ms: allow a couple of them of noise */
    double other = (now.machine - since->machine) - (now.self - since->self) - 2.0;
    return other > 0 ? other / tick / (wall * (double)(ncpu > 0 ? ncpu : 1)) : 0;
}

static double load_average(void) {
    double load = 0;
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf", &load) != 1) load = 0;
        fclose(lf);
    }
    return load;
}

void cpu_peak_flops(cpu_peak *out, int threads, const char *isa_limit) {
    peak_loop fp32, bf16;
    peak_loops(&fp32, &bf16, isa_limit);
    memset(out, 0, sizeof *out);
    out->threads = threads > 0 ? threads : 1;
    out->isa = fp32.isa;
    out->bf16_isa = bf16.loop ? bf16.isa : "fp32";
    char path[1024];
    cache_path(path, sizeof path, out->isa, out->bf16_isa, out->threads);
    snprintf(out->cache, sizeof out->cache, "%s", path);
    /* A cached peak is only as good as the clock it was measured at: a VM
     * that lands on another host (seen here: 2.2 GHz one day, 3.7 the next)
     * keeps its CPU model name. So the clock, a ~50 ms measurement, is taken
     * again and a cache more than PEAK_CLOCK_DRIFT away is measured anew. */
    double stale_hz = 0, now_hz = 0;
    if (read_cache(out, path)) {
        double sp;
        int pre;
        now_hz = peak_measure(NULL, PEAK_CLOCK, out->threads, &sp, &pre) / out->threads;
        if (fabs(now_hz / out->clock_hz - 1.0) <= PEAK_CLOCK_DRIFT) {
            out->source = "cached";
            return;
        }
        stale_hz = out->clock_hz;
        out->flops = out->bf16_flops = out->theory_flops = out->clock_hz = 0;
        out->fma_per_cycle = 0;
    }
    double load0 = load_average();
    cpu_usage_mark mark;
    cpu_usage_mark_now(&mark);
    double sp_clock, sp_fp32, sp_bf16 = 0;
    int pre_clock, pre_fp32, pre_bf16 = 0;
    double clock_sum = peak_measure(NULL, PEAK_CLOCK, out->threads, &sp_clock, &pre_clock);
    double measured = peak_measure(&fp32, PEAK_FP32, out->threads, &sp_fp32, &pre_fp32);
    double measured_bf16 = bf16.loop ? peak_measure(&bf16, PEAK_BF16, out->threads, &sp_bf16, &pre_bf16) : 0;
    out->clock_hz = clock_sum / out->threads;
    /* vector FMAs per cycle per thread: a whole number on real hardware */
    double per_cycle = measured / out->threads / (out->clock_hz * fp32.lanes * fp32.flops_per_lane);
    out->fma_per_cycle = (int)(per_cycle + 0.5) < 1 ? 1 : (int)(per_cycle + 0.5);
    out->theory_flops = (double)out->threads * out->clock_hz * fp32.lanes * fp32.flops_per_lane * out->fma_per_cycle;
    out->measured_flops = measured;
    out->flops = measured > out->theory_flops ? measured : out->theory_flops;
    out->bf16_flops = measured_bf16 > out->flops ? measured_bf16 : out->flops;
    out->source = "measured";

    double others = cpu_others_share(&mark);
    double load = load_average();
    if (load0 > load) load = load0;
    double disagree = fabs(measured / out->theory_flops - 1.0);
    double spread = sp_clock > sp_fp32 ? sp_clock : sp_fp32;
    if (sp_bf16 > spread) spread = sp_bf16;
    if (pre_clock + pre_fp32 + pre_bf16)
        snprintf(out->note, sizeof out->note, "%d of the kept bursts were preempted", pre_clock + pre_fp32 + pre_bf16);
    else if (spread > PEAK_STABLE)
        snprintf(out->note, sizeof out->note, "repeats differ by %.1f%% (> %.0f%%)", 100 * spread, 100 * PEAK_STABLE);
    else if (disagree > PEAK_AGREE)
        snprintf(out->note, sizeof out->note, "measured %.1f vs theoretical %.1f GFLOP/s differ by %.0f%%",
                 measured / 1e9, out->theory_flops / 1e9, 100 * disagree);
    else if (others > PEAK_OTHERS)
        snprintf(out->note, sizeof out->note, "other processes used %.0f%% of the CPUs meanwhile", 100 * others);
    else if (load > PEAK_QUIET_LOAD)
        snprintf(out->note, sizeof out->note, "load average %.2f (> %.1f)", load, PEAK_QUIET_LOAD);
    if (out->note[0]) {
        out->source = "measured, not cached";
        return;
    }
    if (stale_hz > 0) {
        out->source = "measured again";
        snprintf(out->note, sizeof out->note,
                 "the cached peak was measured at %.2f GHz, the clock read %.2f GHz now: replaced", stale_hz / 1e9,
                 now_hz / 1e9);
    }
    write_cache(out, path);
}

double cpu_peak_rss_bytes(void) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return 0;
    char line[256];
    double kb = 0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, "VmHWM:", 6) == 0) {
            kb = atof(line + 6);
            break;
        }
    fclose(f);
    return kb * 1024.0;
}

const char *cpu_openblas_corename(void) { return openblas_get_corename(); }

const char *cpu_openblas_coretype(const char *isa) {
#if !defined(__x86_64__)
    (void)isa;
    return NULL; /* OpenBLAS's aarch64 core detection reads /proc/cpuinfo and knows Neoverse */
#else
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    /* CTITAN_ISA=avx2 stands in for an AVX2 CPU: OpenBLAS is one of the matmul
     * candidates, and with its AVX-512 kernels it would win the timing there and
     * run the stand-in's largest products at twice an AVX2 CPU's width */
    if (isa && !strcmp(isa, "avx2")) return avx2 ? "HASWELL" : NULL;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return "SKYLAKEX";
    if (avx2) return "HASWELL";
    return NULL;
#endif
}
