/* core/cpu.h: what the CPU can do: thread count, peak FLOP/s, memory use.
 *
 * MFU needs the machine's peak. Datasheets do not know how many cores a
 * container really gets or at what clock, so ctitan measures it: a loop of
 * independent FMAs in registers on every thread (AVX-512, else AVX2, else
 * scalar), once, cached under ~/.cache/ctitan keyed by CPU model and threads
 * (not cached when the load average says other work shares the cores). */
#ifndef CT_CORE_CPU_H
#define CT_CORE_CPU_H

typedef struct {
    double flops;       /* fp32 FLOP/s across `threads` */
    int threads;
    const char *source; /* "config", "measured", "cached" */
    const char *isa;    /* "avx512", "avx2", "scalar" */
} cpu_peak;

/* Measures (or reads the cache of) the fp32 FMA peak on `threads` threads. */
void cpu_peak_flops(cpu_peak *out, int threads);
/* Peak resident set size of this process in bytes (VmHWM), 0 if unknown. */
double cpu_peak_rss_bytes(void);
/* Threads OpenMP will use. */
int cpu_threads(void);
/* Sets OpenMP's and the BLAS's thread counts together (n > 0). */
void cpu_set_threads(int n);



/* The OpenBLAS core type that suits this CPU ("SKYLAKEX", "HASWELL") or NULL.
 * Debian's OpenBLAS 0.3.21 does not recognise recent CPUs and falls back to
 * generic kernels about 5x slower; OPENBLAS_CORETYPE set before the library
 * loads fixes that, so main() sets it and re-executes itself once. */
const char *cpu_openblas_coretype(void);

#endif
