/* core/cpu.h: what the CPU can do: thread count, peak FLOP/s, memory use.
 *
 * MFU needs the machine's peak. Datasheets do not know how many cores a
 * container really gets or at what clock, so ctitan measures it: loops of
 * independent FMAs in registers on every thread (AVX-512, else AVX2, else
 * scalar; bf16 on the best bf16 instruction), timed by each thread's CPU
 * clock, checked against clock x lanes x 2 x FMAs/cycle measured beside it,
 * cached under ~/.cache/ctitan keyed by CPU model, ISA and threads only when
 * the figure is stable, agrees with the theory and the machine is quiet
 * (cpu.c, "the peak", says why each rule is there). The trainer, `ctitan
 * kernels peak` and the benchmarks all read it through cpu_peak_flops, for
 * the instruction set the run's kernels are held to (CTITAN_ISA). */
#ifndef CT_CORE_CPU_H
#define CT_CORE_CPU_H

#include <stddef.h>

typedef struct {
    double flops;          /* fp32 FLOP/s across `threads`: max(measured, theoretical) */
    double bf16_flops;     /* bf16 products, fp32 sums (>= flops: bf16 may always run as fp32) */
    double measured_flops; /* fp32 as measured this time (0 when read from the cache) */
    double theory_flops;   /* threads x clock x lanes x 2 x fma_per_cycle */
    double clock_hz;       /* core clock measured by a dependent-add chain */
    int fma_per_cycle;     /* vector FMAs per cycle per thread, rounded from the measurement */
    int threads;
    const char *source;    /* "config", "measured", "cached", "measured again" (the cache was for
                            * another clock), "measured, not cached" (see note) */
    const char *isa;       /* fp32: "avx512", "avx2", "scalar" */
    const char *bf16_isa;  /* "amx", "avx512bf16", "bfmmla", or "fp32" where bf16 runs on the fp32 units */
    char note[160];        /* why a measurement was not cached, or why the cache was replaced; "" otherwise */
    char cache[1024];      /* the cache file read or (to be) written */
} cpu_peak;

/* Measures (or reads the cache of) the FMA peaks on `threads` threads. Never
 * fails: some figure always comes back, and it is never below what this
 * process could measure. Takes ~0.2 s per thread count when not cached.
 * isa_limit is the widest level the run's kernels may use, as CTITAN_ISA
 * names it: "avx2" measures AVX2's FMA and no bf16 unit, "avx512" no AMX,
 * "neon" no BF16, so a run held to a lower level (a Zen 3 stand-in on a
 * Zen 5) gets that level's MFU; NULL, "", "auto", "amx", "bf16", "sve",
 * "ref" (whose matmuls are OpenBLAS's widest) or an unknown name: whatever
 * the CPU has. */
void cpu_peak_flops(cpu_peak *out, int threads, const char *isa_limit);
/* Whether AMX bf16 tiles may be used: the CPU has AMX-TILE and AMX-BF16, the
 * OS enables the tile state (XCR0), and Linux granted this process the tile
 * data permission, which the first call requests (arch_prctl; once per
 * process, thread-safe). Without that permission the first tile instruction
 * raises SIGILL. *why (if non-NULL): "usable" or the reason. Always 0 off x86-64. */
int cpu_amx_bf16_ready(const char **why);

/* Whether other processes (or the hypervisor's steal) shared the CPUs
 * during a measurement: mark before, then the share of the machine's CPU
 * time since the mark that was not this process's (/proc/stat ticks, 10 ms
 * resolution). The peak and the kernel tuner cache nothing measured above a
 * few percent. */
typedef struct {
    double machine, self, wall;
} cpu_usage_mark;
void cpu_usage_mark_now(cpu_usage_mark *m);
double cpu_others_share(const cpu_usage_mark *since);

/* <HOME>/.cache/ctitan/<name> (HOME unset: /tmp), the directory created if
 * missing (best effort): the per-CPU caches of the peak and of the kernel
 * choice (kernels/tune.c) live there. */
void cpu_cache_path(char *out, size_t cap, const char *name);

/* The CPU's model name from /proc/cpuinfo, spaces and slashes as '_' (a file
 * name part for the caches keyed by CPU), "unknown" if none. */
void cpu_model_name(char *out, size_t cap);
/* Peak resident set size of this process in bytes (VmHWM), 0 if unknown. */
double cpu_peak_rss_bytes(void);
/* Threads OpenMP will use. */
int cpu_threads(void);
/* Sets OpenMP's and the BLAS's thread counts together (n > 0). */
void cpu_set_threads(int n);



/* The OpenBLAS core type that suits this CPU ("SKYLAKEX", "HASWELL") or NULL,
 * held to the instruction-set level `isa` (CTITAN_ISA: "avx2" gives HASWELL on
 * an AVX-512 CPU; other levels, NULL or "auto" leave the CPU's best).
 * Debian's OpenBLAS 0.3.21 does not recognise recent CPUs and falls back to
 * generic kernels about 5x slower; OPENBLAS_CORETYPE set before the library
 * loads fixes that, so main() sets it and re-executes itself once. */
const char *cpu_openblas_coretype(const char *isa);
/* The kernels OpenBLAS loaded ("Haswell", "SkylakeX"): what the "openblas" matmul runs. */
const char *cpu_openblas_corename(void);

#endif
