/* core/cpu.c: peak FLOP/s measurement and process memory. */
#include "core/cpu.h"

#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/timer.h"

void openblas_set_num_threads(int n); /* OpenBLAS's own knob; it keeps a pool apart from OpenMP's */

int cpu_threads(void) { return omp_get_max_threads(); }

void cpu_set_threads(int n) {
    if (n <= 0) return;
    omp_set_num_threads(n);
    openblas_set_num_threads(n);
}

/* 12 independent accumulators hide the FMA latency (4 cycles x 2 ports, +). */
#define FMA_CHAINS 12

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

static double fma_loop_scalar(long iters) {
    float acc[FMA_CHAINS];
    for (int i = 0; i < FMA_CHAINS; i++) acc[i] = (float)i * 1e-3f;
    for (long it = 0; it < iters; it++)
#pragma GCC unroll 16
        for (int i = 0; i < FMA_CHAINS; i++) acc[i] = acc[i] * 0.999999f + 1e-7f;
    float sink = 0;
    for (int i = 0; i < FMA_CHAINS; i++) sink += acc[i];
    return sink;
}

static void cpu_model(char *out, size_t cap) {
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "model name", 10) == 0) {
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

static void cache_path(char *out, size_t cap, int threads) {
    const char *home = getenv("HOME");
    char model[256];
    cpu_model(model, sizeof model);
    snprintf(out, cap, "%s/.cache/ctitan/peak-v2-%s-t%d.txt", home ? home : "/tmp", model, threads);
}

void cpu_peak_flops(cpu_peak *out, int threads) {
    __builtin_cpu_init();
    int avx512 = __builtin_cpu_supports("avx512f");
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    out->isa = avx512 ? "avx512" : avx2 ? "avx2" : "scalar";
    out->threads = threads;
    char path[1024];
    cache_path(path, sizeof path, threads);
    FILE *f = fopen(path, "r");
    if (f) {
        double v = 0;
        int ok = fscanf(f, "%lf", &v) == 1 && v > 0;
        fclose(f);
        if (ok) {
            out->flops = v;
            out->source = "cached";
            return;
        }
    }
    int lanes = avx512 ? 16 : avx2 ? 8 : 1;
    long iters = avx512 ? 4000000 : avx2 ? 4000000 : 1000000;
    double best = 0;
    for (int rep = 0; rep < 3; rep++) {
        double sink = 0, t0 = ct_now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        sink += avx512 ? fma_loop_avx512(iters) : avx2 ? fma_loop_avx2(iters) : fma_loop_scalar(iters);
        double dt = ct_now() - t0;
        double flops = 2.0 * lanes * FMA_CHAINS * (double)iters * threads / dt;
        if (flops > best && sink == sink) best = flops;
    }
    out->flops = best;
    out->source = "measured";
    /* a figure taken while other work runs is low; keep it for this run only */
    double load = 0;
    FILE *lf = fopen("/proc/loadavg", "r");
    if (lf) {
        if (fscanf(lf, "%lf", &load) != 1) load = 0;
        fclose(lf);
    }
    if (load > 0.5) {
        out->source = "measured on a busy machine, not cached";
        return;
    }
    /* cache it; failure to write the cache is harmless */
    char dir[1024];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) {
        *slash = 0;
        char *s2 = strrchr(dir, '/');
        if (s2) { *s2 = 0; mkdir(dir, 0755); *s2 = '/'; }
        mkdir(dir, 0755);
    }
    /* temp + rename: a concurrent run reads the old value or the new one, never half */
    char tmp[1100];
    snprintf(tmp, sizeof tmp, "%s.%ld", path, (long)getpid());
    f = fopen(tmp, "w");
    if (f) {
        int ok = fprintf(f, "%.6e\n", best) > 0;
        ok &= fclose(f) == 0;
        if (!ok || rename(tmp, path) != 0) remove(tmp);
    }
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

const char *cpu_openblas_coretype(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return "SKYLAKEX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "HASWELL";
    return NULL;
}
