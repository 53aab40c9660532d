/* cli/cmd_kernels.c: `ctitan kernels list | check | bench | peak`.
 *
 *   list    what is registered, what each implementation needs, what this
 *           CPU has, and which one each op gets by default.
 *   check   kern_check over the built-in table: every implementation the CPU
 *           can run against "ref" on random and edge shapes; exit 1 on any
 *           mismatch beyond the tolerance (part of `make test`).
 *   bench   times each implementation on the model's shapes (debugmodel and
 *           Qwen3-0.6B): GFLOP/s for matmul and attention, GB/s for the
 *           memory-bound ops. Best of several runs: other processes share the
 *           cores, and the best run is the one they disturbed least.
 *   peak    the fp32 and bf16 FMA peaks behind MFU (core/cpu.h), with the
 *           clock and the theoretical figure they were checked against;
 *           --json for the benchmarks, which read the peak this way only.
 * Each subcommand takes only the options it reads (kern_opts); another one is
 * refused with exit 2 rather than ignored.
 * Thin by design: the registry and the checker live in kernels/. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#ifdef __GLIBC__
#include <malloc.h>
#endif
#include <stdlib.h>
#include <string.h>

#include "cli/cli.h"
#include "core/cpu.h"
#include "core/err.h"
#include "core/timer.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

/* The subcommands, as bits: each option lists the ones that read it. */
enum { SUB_LIST = 1, SUB_CHECK = 2, SUB_BENCH = 4, SUB_PEAK = 8 };

static const struct {
    const char *name;
    unsigned bit;
    const char *help; /* its lines of `kernels --help` */
} kern_subs[] = {
    {"list", SUB_LIST, "  list                         registered implementations, CPU features, defaults\n"},
    {"check", SUB_CHECK,
     "  check [--op NAME] [--impl NAME] [--seed N] [--threads N] [--quick] [--quick-cap N]\n"
     "                               every implementation against \"ref\"; exit 1 on a mismatch\n"
     "                               (--quick caps the long side of the largest cases: for qemu and\n"
     "                               the sanitizers; --quick-cap N, N >= 2: --quick with those caps\n"
     "                               lowered to N, e.g. matmul's M for a re-check at another SVE width)\n"},
    {"bench", SUB_BENCH,
     "  bench [--op NAME] [--impl NAME] [--threads N] [--reps N] [--quick] [--peak GFLOPS] [--cold]\n"
     "                               GFLOP/s (matmul, attention) or GB/s of each implementation\n"
     "                               (--quick skips the Qwen3-0.6B lm_head shape; --peak gives the\n"
     "                               FMA peak instead of the measured/cached one; --cold evicts the\n"
     "                               operands from the caches before each timed call, as a step does)\n"},
    {"peak", SUB_PEAK, "  peak [--threads N] [--json]  the fp32/bf16 FMA peaks MFU is measured against\n"},
};
#define KERN_N_SUBS (sizeof kern_subs / sizeof kern_subs[0])

/* Every option once, with the subcommands that read it (cmd_list reads none;
 * --threads sets the thread count the others run and measure with). One
 * given to a subcommand that does not read it is refused, not ignored. */
static const struct {
    const char *name;
    int value; /* takes a value */
    unsigned subs;
} kern_opts[] = {
    {"--op", 1, SUB_CHECK | SUB_BENCH},   {"--impl", 1, SUB_CHECK | SUB_BENCH},
    {"--seed", 1, SUB_CHECK},             {"--threads", 1, SUB_CHECK | SUB_BENCH | SUB_PEAK},
    {"--quick", 0, SUB_CHECK | SUB_BENCH}, {"--quick-cap", 1, SUB_CHECK}, {"--reps", 1, SUB_BENCH},
    {"--peak", 1, SUB_BENCH},             {"--cold", 0, SUB_BENCH},
    {"--json", 0, SUB_PEAK},
};

/* The usage of the subcommands in MASK (all of them: the whole text). */
static void usage(FILE *f, unsigned mask) {
    const char *only = NULL;
    for (size_t i = 0; i < KERN_N_SUBS; i++)
        if (mask == kern_subs[i].bit) only = kern_subs[i].name;
    int any = 0; /* options for the subcommands of MASK */
    for (size_t i = 0; i < sizeof kern_opts / sizeof kern_opts[0]; i++) any |= (kern_opts[i].subs & mask) != 0;
    if (only) fprintf(f, "usage: ctitan kernels %s%s\n\n", only, any ? " [options]" : "");
    else fprintf(f, "usage: ctitan kernels <list | check | bench | peak> [options]\n\n");
    for (size_t i = 0; i < KERN_N_SUBS; i++)
        if (mask & kern_subs[i].bit) fputs(kern_subs[i].help, f);
}

typedef struct {
    const char *op, *impl;
    int threads, reps, quick, json, cold;
    unsigned char *cold_buf; /* --cold: the scratch written between timed calls */
    size_t cold_bytes;
    uint64_t seed;
    double peak_gflops; /* --peak: skip measuring the FMA peak */
} kern_cli_opts;

/* The whole of VAL as a number in [lo, hi], else an error naming OPT: atoi
 * read "3x" as 3 and "abc" as 0, and atof took "nan" (a peak of nan GFLOP/s). */
static int opt_number(const char *opt, const char *val, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double v = strtod(val, &end);
    if (end == val || *end || errno == ERANGE || !(v >= lo && v <= hi)) {
        fprintf(stderr, "ctitan: error: kernels: %s: expected a number from %.15g to %.15g, got \"%s\"\n", opt, lo, hi,
                val);
        return 2;
    }
    *out = v;
    return 0;
}

/* The options of subcommand SUB (kern_subs[sub]) into o; 2 on an unknown
 * option, one SUB does not read, or a bad value; -1 after --help. */
static int parse_opts(size_t sub, int argc, char **argv, kern_cli_opts *o) {
    const char *sname = kern_subs[sub].name;
    unsigned bit = kern_subs[sub].bit;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout, bit);
            return -1;
        }
        size_t k = 0;
        while (k < sizeof kern_opts / sizeof kern_opts[0] && strcmp(a, kern_opts[k].name)) k++;
        if (k == sizeof kern_opts / sizeof kern_opts[0]) {
            fprintf(stderr, "ctitan: error: kernels: unknown option \"%s\"\n", a);
            return 2;
        }
        if (!(kern_opts[k].subs & bit)) {
            char takes[128] = "";
            for (size_t j = 0; j < sizeof kern_opts / sizeof kern_opts[0]; j++)
                if (kern_opts[j].subs & bit)
                    snprintf(takes + strlen(takes), sizeof takes - strlen(takes), "%s%s", takes[0] ? " " : "",
                             kern_opts[j].name);
            fprintf(stderr, "ctitan: error: kernels %s: %s is not an option of this subcommand (%s%s)\n", sname, a,
                    takes[0] ? "its options: " : "it takes no options", takes);
            return 2;
        }
        if (!kern_opts[k].value) {
            if (a[2] == 'q') o->quick = o->quick ? o->quick : 1; /* after --quick-cap N: still N */
            else *(a[2] == 'j' ? &o->json : &o->cold) = 1;
            continue;
        }
        const char *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!val) {
            fprintf(stderr, "ctitan: error: kernels: %s: missing value\n", a);
            return 2;
        }
        if (!strcmp(a, "--op")) {
            if (kern_op_from_name(val) < 0) {
                fprintf(stderr, "ctitan: error: kernels: unknown op \"%s\"\n", val);
                return 2;
            }
            o->op = val;
        } else if (!strcmp(a, "--impl")) {
            o->impl = val;
        } else if (!strcmp(a, "--quick-cap")) { /* kern_check_opts.quick > 1: the caps lowered to it */
            double v;
            if (opt_number(a, val, 2, 1 << 20, &v)) return 2;
            if (v != floor(v)) {
                fprintf(stderr, "ctitan: error: kernels: %s: expected an integer, got \"%s\"\n", a, val);
                return 2;
            }
            o->quick = (int)v;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "--reps") || !strcmp(a, "--seed")) {
            double v;
            int seed = a[2] == 's';
            if (opt_number(a, val, seed ? 0 : 1, seed ? 9007199254740992.0 : 1 << 20, &v)) return 2;
            if (v != floor(v)) {
                fprintf(stderr, "ctitan: error: kernels: %s: expected an integer, got \"%s\"\n", a, val);
                return 2;
            }
            if (seed) o->seed = (unsigned long long)v;
            else *(a[2] == 't' ? &o->threads : &o->reps) = (int)v;
        } else { /* --peak */
            if (opt_number(a, val, 1e-3, 1e9, &o->peak_gflops)) return 2;
        }
        i++;
    }
    return 0;
}

/* ---------------------------------------------------------------- list */

static int cmd_list(void) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    char have[256];
    kern_features_str(cpu, have, sizeof have);
    kern_ops k;
    char log[512];
    ct_err e = {0};
    if (kern_select(&k, NULL, log, sizeof log, &e)) {
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return e.code;
    }
    printf("cpu features: %s\n", have);
    if (kern_sve_vector_bits()) printf("sve vector length: %d bits\n", kern_sve_vector_bits());
    const char *amx_why;
    if (!cpu_amx_bf16_ready(&amx_why)) printf("amx_bf16: not usable: %s\n", amx_why); /* why, when absent */
    printf("%s\n\n", log);
    printf("%-12s %-9s %-6s %-8s %-38s %s\n", "op", "impl", "device", "runs", "needs", "about");
    for (size_t i = 0; i < n; i++) {
        char need[256];
        if (t[i].features) kern_features_str(t[i].features, need, sizeof need);
        else snprintf(need, sizeof need, "-");
        const char *runs = (t[i].features & ~cpu) ? "no" : k.chosen[t[i].op] == &t[i] ? "default" : "yes";
        printf("%-12s %-9s %-6s %-8s %-38s %s\n", kern_op_name(t[i].op), t[i].name, t[i].device, runs, need,
               t[i].about ? t[i].about : "");
    }
    return 0;
}

/* --------------------------------------------------------------- check */

static int cmd_check(const kern_cli_opts *o) {
    size_t n;
    const kern_impl *t = kern_registry(&n);
    kern_check_opts co = {.out = stdout, .op = o->op, .impl = o->impl, .features = kern_cpu_features(),
                          .seed = o->seed, .quick = o->quick};
    if (o->quick > 1)
        printf("threads: %d (--quick-cap %d: the largest cases capped at %d)\n", cpu_threads(), o->quick, o->quick);
    else
        printf("threads: %d%s\n", cpu_threads(), o->quick ? " (--quick: the largest cases capped)" : "");
    /* the SVE GEMM's tile is 3 vectors wide: a check log says which width it tested */
    if (kern_sve_vector_bits()) printf("sve vector length: %d bits\n", kern_sve_vector_bits());
    int failed = kern_check(t, n, &co);
    return failed ? 1 : 0;
}

/* --------------------------------------------------------------- bench */

/* Whether bench_matmul times entry `im`: with --op matmul the fp32 ones, with
 * --op matmul_bf16 the bf16 ones and, for comparison on the same shapes, the
 * default fp32 one; with no --op both. */
static int bench_matmul_wants(const kern_impl *im, const kern_impl *fp32_default, const kern_cli_opts *o) {
    if (im->op != KERN_OP_MATMUL && im->op != KERN_OP_MATMUL_BF16) return 0;
    if (o->impl && strcmp(o->impl, im->name)) return 0;
    if (!o->op) return 1;
    if (!strcmp(o->op, "matmul")) return im->op == KERN_OP_MATMUL;
    return im->op == KERN_OP_MATMUL_BF16 || im == fp32_default;
}

/* Whether a matmul entry multiplies on bf16 hardware (vdpbf16ps, AMX tiles,
 * BFMMLA): those are measured against the bf16 peak, the others (fp32
 * kernels, the rounding bf16 ones included) against the fp32 one. */
static int uses_bf16_units(const kern_impl *im) {
    return im->op == KERN_OP_MATMUL_BF16 &&
           (im->features & (KERN_FEAT_AVX512BF16 | KERN_FEAT_AMXBF16 | KERN_FEAT_ARM_BF16));
}

static void bench_matmul(const kern_impl *t, size_t n, unsigned cpu, const kern_cli_opts *o, const cpu_peak *pk) {
    static const struct {
        int M, K, N;
        const char *what;
    } shapes[] = {
        {1024, 256, 2048, "debug q_proj, lm_head (V=2048)"},
        {1024, 256, 3072, "debug gate/up"},
        {1024, 3072, 256, "debug down"},
        {1024, 1024, 2048, "0.6B q_proj"},
        {1024, 1024, 3072, "0.6B gate/up"},
        {512, 1024, 3072, "0.6B gate/up, 512 tokens"},
        {1024, 3072, 1024, "0.6B down"},
        {1024, 2048, 1024, "0.6B o_proj"},
        {256, 1024, 151936, "0.6B lm_head, 256-row block"},
    };
    const kern_impl *fp32_default = NULL;
    for (size_t i = 0; i < n && !fp32_default; i++)
        if (t[i].op == KERN_OP_MATMUL && !(t[i].features & ~cpu)) fp32_default = &t[i];
    printf("matmul: fwd out=inp@w^T, dinp=dout@w, dw+=dout^T@inp; GFLOP/s (2MKN / best time), %% of the "
           "%.0f GFLOP/s fp32 FMA peak, or for bf16 entries on bf16 units (avx512bf16, amx, bfmmla) of the "
           "%.0f GFLOP/s bf16 peak (%s); bf16 = matmul_bf16 (inputs rounded to bf16, fp32 sums); "
           "w bf16 = fwd / dinp with w read from a bf16 store (a frozen weight: fwd_wbf16, dinp_wbf16)\n",
           pk->flops / 1e9, pk->bf16_flops / 1e9, pk->bf16_isa ? pk->bf16_isa : "?");
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int M = shapes[s].M, K = shapes[s].K, N = shapes[s].N;
        if (o->quick && N > 100000) continue;
        kern_shape sh = {.M = M, .K = K, .N = N};
        kern_bench *x = kern_bench_new(KERN_OP_MATMUL, &sh); /* the same inputs for matmul and matmul_bf16 */
        kern_bench_set_cold(x, o->cold_buf, o->cold_bytes);
        double flops = 2.0 * M * (double)K * N;
        printf("  M=%-5d K=%-5d N=%-6d (%s)\n", M, K, N, shapes[s].what);
        for (size_t i = 0; i < n; i++) {
            if ((t[i].features & ~cpu) || !bench_matmul_wants(&t[i], fp32_default, o)) continue;
            static const kern_bench_part parts[3] = {KERN_BENCH_FWD, KERN_BENCH_DINP, KERN_BENCH_DW};
            double g[3];
            for (int p = 0; p < 3; p++) g[p] = flops / kern_bench_time(x, &t[i], parts[p], o->reps, 0) / 1e9;
            char label[48];
            snprintf(label, sizeof label, "%s%s", t[i].op == KERN_OP_MATMUL_BF16 ? "bf16 " : "", t[i].name);
            int hw = uses_bf16_units(&t[i]);
            double peak = hw ? pk->bf16_flops : pk->flops;
            const char *which = hw ? "bf16 peak" : "peak";
            printf("    %-15s fwd %6.1f  dinp %6.1f  dw %6.1f GFLOP/s   (%2.0f%% %2.0f%% %2.0f%% of %s)\n", label,
                   g[0], g[1], g[2], 100e9 * g[0] / peak, 100e9 * g[1] / peak, 100e9 * g[2] / peak, which);
            if (t[i].fn.matmul.fwd_wbf16 && t[i].fn.matmul.dinp_wbf16) {
                double h0 = flops / kern_bench_time(x, &t[i], KERN_BENCH_FWD_WBF16, o->reps, 0) / 1e9;
                double h1 = flops / kern_bench_time(x, &t[i], KERN_BENCH_DINP_WBF16, o->reps, 0) / 1e9;
                printf("      %-13s fwd %6.1f  dinp %6.1f            GFLOP/s   (%2.0f%% %2.0f%%     of %s)\n", "w bf16",
                       h0, h1, 100e9 * h0 / peak, 100e9 * h1 / peak, which);
            }
            fflush(stdout);
        }
        kern_bench_free(x);
    }
}

/* Every other op at Qwen3-0.6B sizes (1024 tokens), timed by kernels/timing.c
 * (the tuner's harness). bytes = compulsory traffic of the tensors each call
 * reads and writes once; flops for the compute-bound ones. `variant` 1 is a
 * second shape, for the ops that have one (attention: the debugmodel's, W3),
 * and 2 a third (attention: W3's with bf16 products). */
static void bench_op(const kern_impl *t, size_t n, unsigned cpu, const kern_cli_opts *o, kern_op op, int variant) {
    kern_shape s = {0};
    double bytes_f = 0, bytes_b = 0, flops_f = 0, flops_b = 0;
    char sbuf[128];
    switch (op) {
    case KERN_OP_EMBEDDING:
        s.rows = 1024, s.C = 1024, s.V = 151936;
        bytes_f = 2.0 * 4 * s.rows * s.C, bytes_b = 3.0 * 4 * s.rows * s.C;
        snprintf(sbuf, sizeof sbuf, "N=1024 C=1024 V=151936");
        break;
    case KERN_OP_RMSNORM:
        s.rows = 1024, s.C = 1024;
        bytes_f = 2.0 * 4 * s.rows * s.C, bytes_b = 4.0 * 4 * s.rows * s.C;
        snprintf(sbuf, sizeof sbuf, "N=1024 C=1024");
        break;
    case KERN_OP_ROPE: {
        s.B = 1, s.T = 1024, s.nh = 16, s.hd = 128;
        double nel = (double)s.B * s.T * s.nh * s.hd;
        bytes_f = 2.0 * 4 * nel, bytes_b = 3.0 * 4 * nel;
        snprintf(sbuf, sizeof sbuf, "q/k norm+RoPE T=1024 nh=16 hd=128");
        break;
    }
    case KERN_OP_ATTENTION:
        /* 0.6B's heads at 512 tokens, or the debugmodel's batch (W3: 4 x 256), whose
         * short rows make the diagonal tiles and the per-block work count more */
        s.B = variant ? 4 : 1, s.T = variant ? 256 : 512, s.nh = 16, s.nkv = 8, s.hd = 128;
        s.bf16 = variant == 2; /* and with bf16 products (kern_attn_opt.bf16: a bf16 run's) */
        /* causal: half of T x T scores; fwd q.k and p.v, bwd four such products */
        flops_f = 2.0 * s.B * s.nh * (double)s.T * s.T * s.hd;
        flops_b = 2.0 * flops_f;
        snprintf(sbuf, sizeof sbuf, "B=%d T=%d nh=16 nkv=8 hd=128%s", s.B, s.T, s.bf16 ? " bf16" : "");
        break;
    case KERN_OP_SWIGLU:
    case KERN_OP_GEGLU:
        s.n = 1024L * 3072;
        bytes_f = 3.0 * 4 * s.n, bytes_b = 7.0 * 4 * s.n;
        snprintf(sbuf, sizeof sbuf, "N=1024*3072");
        break;
    case KERN_OP_CROSSENTROPY:
        s.rows = 64, s.V = 151936;
        bytes_f = 4.0 * s.rows * s.V, bytes_b = 4.0 * 4 * s.rows * s.V;
        snprintf(sbuf, sizeof sbuf, "N=64 V=151936");
        break;
    case KERN_OP_ADD:
        s.n = 1024L * 1024;
        bytes_f = 3.0 * 4 * s.n;
        snprintf(sbuf, sizeof sbuf, "N=1024*1024");
        break;
    case KERN_OP_ADAMW:
        s.n = 16L * 1024 * 1024;
        bytes_f = 7.0 * 4 * s.n;
        snprintf(sbuf, sizeof sbuf, "n=16M");
        break;
    case KERN_OP_MOE:
    case KERN_OP_MOE_BF16:
        /* a debugmodel_moe layer at 1024 tokens: 8 experts of 768, top-2, balanced routing */
        s.rows = 1024, s.C = 256, s.I = 768, s.E = 8, s.k = 2;
        flops_f = 6.0 * s.rows * s.k * s.C * s.I; /* three projections */
        flops_b = 2.0 * flops_f;
        snprintf(sbuf, sizeof sbuf, "N=1024 H=256 I=768 E=8 k=2");
        break;
    case KERN_OP_MATMUL:
    case KERN_OP_MATMUL_BF16: return; /* bench_matmul: both in one table */
    } /* no default: -Wswitch names an op of kernels/ops_list.h left out here */
    kern_bench *x = kern_bench_new(op, &s);
    kern_bench_set_cold(x, o->cold_buf, o->cold_bytes);
    for (size_t i = 0; i < n; i++) {
        if ((int)t[i].op != (int)op || (t[i].features & ~cpu)) continue;
        if (o->impl && strcmp(o->impl, t[i].name)) continue;
        int has_bwd = kern_bench_has_bwd(op);
        double tf = kern_bench_time(x, &t[i], KERN_BENCH_FWD, o->reps, 0);
        double tb = has_bwd ? kern_bench_time(x, &t[i], KERN_BENCH_BWD, o->reps, 0) : 0;
        if (flops_f > 0)
            printf("%-12s %-9s %-30s fwd %7.1f  bwd %7.1f GFLOP/s  (%.2f / %.2f ms)\n", kern_op_name(op), t[i].name,
                   sbuf, flops_f / tf / 1e9, flops_b / tb / 1e9, tf * 1e3, tb * 1e3);
        else if (has_bwd)
            printf("%-12s %-9s %-30s fwd %7.1f  bwd %7.1f GB/s     (%.2f / %.2f ms)\n", kern_op_name(op), t[i].name,
                   sbuf, bytes_f / tf / 1e9, bytes_b / tb / 1e9, tf * 1e3, tb * 1e3);
        else
            printf("%-12s %-9s %-30s     %7.1f GB/s     (%.2f ms)\n", kern_op_name(op), t[i].name, sbuf,
                   bytes_f / tf / 1e9, tf * 1e3);
        fflush(stdout);
    }
    kern_bench_free(x);
}

static int cmd_bench(const kern_cli_opts *o) {
#ifdef __GLIBC__
    /* The kernels allocate multi-MB scratch per call (attention's transposed K and V:
     * 4 MB each at W3). glibc returned it to the kernel on free whenever the heap's
     * top grew past its trim threshold, so a row's every call paid ~3000 fresh page
     * faults until the arena happened to settle: the first attention rows of a run
     * read 1.4-1.8x slower than the same kernel's later rows (2026-12-05). A training
     * run reaches that settled state by its second step (~200 faults a step), so the
     * bench keeps freed memory too: allocations under 32 MB from the heap, no trim. */
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
#endif
    size_t n;
    const kern_impl *t = kern_registry(&n);
    unsigned cpu = kern_cpu_features();
    char have[256];
    kern_features_str(cpu, have, sizeof have);
    /* --peak gives one figure: the bf16 entries on bf16 units are measured against it too */
    cpu_peak peak = {.flops = o->peak_gflops * 1e9, .bf16_flops = o->peak_gflops * 1e9, .threads = cpu_threads(),
                     .source = "--peak", .bf16_isa = "--peak"};
    if (o->peak_gflops <= 0) cpu_peak_flops(&peak, cpu_threads(), getenv("CTITAN_ISA"));
    printf("threads %d, cpu features: %s, OpenBLAS kernels %s, fp32 FMA peak %.0f GFLOP/s (%s)\n", cpu_threads(),
           have, cpu_openblas_corename(), peak.flops / 1e9, peak.source);
    printf("best of %d runs after a warm-up (other processes share these cores)\n", o->reps);
    if (o->cold)
        printf("cold: before each timed call every thread writes its share of %zu MB (not timed), so the operands "
               "come from memory, as in a training step\n",
               o->cold_bytes >> 20);
    printf("\n");
    for (int op = 0; op < KERN_N_OPS; op++) {
        if (o->op && strcmp(o->op, kern_op_name(op))) continue;
        if (op == KERN_OP_MATMUL) {
            /* one table for both matmul ops: the same shapes side by side */
            if (!o->op || !strcmp(o->op, "matmul")) bench_matmul(t, n, cpu, o, &peak);
        } else if (op == KERN_OP_MATMUL_BF16) {
            if (o->op) bench_matmul(t, n, cpu, o, &peak);
        } else if (op == KERN_OP_MOE || op == KERN_OP_MOE_BF16) {
            if (o->op) bench_op(t, n, cpu, o, op, 0); /* only when asked: the reference takes ~a minute */
        } else {
            bench_op(t, n, cpu, o, op, 0);
            if (op == KERN_OP_ATTENTION) bench_op(t, n, cpu, o, op, 1), bench_op(t, n, cpu, o, op, 2);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- peak */

static int cmd_peak(const kern_cli_opts *o) {
    cpu_peak p;
    cpu_peak_flops(&p, cpu_threads(), getenv("CTITAN_ISA"));
    if (o->json) {
        printf("{\"fp32_flops\": %.6e, \"bf16_flops\": %.6e, \"measured_fp32_flops\": %.6e, "
               "\"theory_fp32_flops\": %.6e, \"clock_hz\": %.6e, \"fma_per_cycle\": %d, \"threads\": %d, "
               "\"isa\": \"%s\", \"bf16_isa\": \"%s\", \"source\": \"%s\", \"note\": \"%s\", \"cache\": \"%s\"}\n",
               p.flops, p.bf16_flops, p.measured_flops, p.theory_flops, p.clock_hz, p.fma_per_cycle, p.threads, p.isa,
               p.bf16_isa, p.source, p.note, p.cache);
        return 0;
    }
    printf("fp32 peak %.1f GFLOP/s on %d thread(s), %s: theory %.2f GHz x %d FMA/cycle x %s lanes x 2 x %d = %.1f",
           p.flops / 1e9, p.threads, p.isa, p.clock_hz / 1e9, p.fma_per_cycle,
           !strcmp(p.isa, "avx512") ? "16" : !strcmp(p.isa, "avx2") ? "8" : !strcmp(p.isa, "neon") ? "4" : "1",
           p.threads, p.theory_flops / 1e9);
    if (p.measured_flops > 0) printf(", measured %.1f", p.measured_flops / 1e9);
    printf("\nbf16 peak %.1f GFLOP/s (%s)\nsource: %s%s%s\ncache: %s\n", p.bf16_flops / 1e9, p.bf16_isa, p.source,
           p.note[0] ? ": " : "", p.note, p.cache);
    return 0;
}

int cli_kernels(int argc, char **argv) {
    if (argc < 1 || !strcmp(argv[0], "--help") || !strcmp(argv[0], "-h") || !strcmp(argv[0], "help")) {
        usage(argc < 1 ? stderr : stdout, ~0u);
        return argc < 1 ? 2 : 0;
    }
    size_t sub = 0;
    while (sub < KERN_N_SUBS && strcmp(argv[0], kern_subs[sub].name)) sub++;
    if (sub == KERN_N_SUBS) {
        fprintf(stderr, "ctitan: error: kernels: unknown subcommand \"%s\"\n", argv[0]);
        usage(stderr, ~0u);
        return 2;
    }
    kern_cli_opts o = {.reps = 5, .seed = 1234};
    int rc = parse_opts(sub, argc - 1, argv + 1, &o);
    if (rc) return rc < 0 ? 0 : rc;
    { /* an unknown CTITAN_ISA is a config error here as in train and generate, not the whole CPU */
        kern_ops k;
        ct_err e = {0};
        if (kern_select(&k, NULL, NULL, 0, &e)) {
            fprintf(stderr, "ctitan: error: %s\n", e.msg);
            return e.code;
        }
    }
    if (o.impl) {
        size_t n;
        const kern_impl *t = kern_registry(&n);
        int known = 0;
        for (size_t i = 0; i < n; i++)
            if (!strcmp(t[i].name, o.impl) && (!o.op || !strcmp(kern_op_name(t[i].op), o.op))) known = 1;
        if (!known) {
            fprintf(stderr,
                    "ctitan: error: kernels: no implementation \"%s\"%s%s is registered (see ctitan kernels list)\n",
                    o.impl, o.op ? " of " : "", o.op ? o.op : "");
            return 2;
        }
    }
    if (o.threads > 0) cpu_set_threads(o.threads);
    if (!strcmp(argv[0], "list")) return cmd_list();
    if (!strcmp(argv[0], "check")) return cmd_check(&o);
    if (!strcmp(argv[0], "bench")) {
        if (o.cold) {
            o.cold_bytes = kern_bench_cold_bytes();
            o.cold_buf = ct_malloc(o.cold_bytes);
        }
        rc = cmd_bench(&o);
        free(o.cold_buf);
        return rc;
    }
    return cmd_peak(&o);
}
