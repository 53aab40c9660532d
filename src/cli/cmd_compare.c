/* cli/cmd_compare.c: `ctitan compare RUN_A RUN_B`: two runs of one recipe
 * (different layouts, machines or kernels) side by side: their loss curves,
 * whether each final checkpoint restores in the other's layout, speed, the
 * time restarts cost and what each run cost (report/compare.h; the formulas
 * are in docs/compare.md).
 *
 * The restore check really restores: reading two manifests cannot show that
 * the weights land in the right slices. For each run X and layout L (its own
 * and the other run's), this binary is launched again (`compare --probe`,
 * under `mpirun -np W` when L has W ranks) with X's config.toml, L's
 * [parallelism] and per-rank batch sizes, and checkpoint.load_step = X's
 * final save; the probe builds the trainer (which loads the checkpoint into
 * L's slices, the code path of a resume), computes the loss of a fixed batch
 * of pseudo-random sequences without updating, and prints it. X restores in
 * L when the probe succeeds and its loss matches X's own layout's within the
 * tolerance. The fixed batch has lcm(W_A, W_B) x k sequences, so every
 * data-parallel degree of either layout splits it evenly, and each sequence
 * is a function of its index alone: every layout scores the same tokens.
 *
 * Exit status: 0 same, 4 the runs differ (the loss curves beyond --tolerance,
 * or a checkpoint that does not restore), as diff(1) separates "differ"
 * from "trouble" (here 1 runtime, 2 usage, 3 malformed file: the codes of
 * every command, docs/reliability.md). */

#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <poll.h>
#include <signal.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint/ckpt.h"
#include "cli/cli.h"
#include "config/config.h"
#include "core/fs.h"
#include "core/rng.h"
#include "distributed/comm.h"
#include "report/compare.h"
#include "formats/json.h"
#include "train/trainer.h"

#define CMP_EXIT_DIFFER 4
#define CMP_RESTORE_TOL 1e-5 /* float sums in another order (test_dist.py's bound) */
/* A probe loads one checkpoint and scores 8 sequences: seconds for the
 * tiny models, minutes for a big one on a slow disk. Past this, something
 * hangs (a rank stuck in a collective, a filesystem that does not answer)
 * and compare would otherwise wait forever. */
#define CMP_PROBE_TIMEOUT_S 600.0
#define CMP_PROBE_GRACE_S 2.0 /* SIGTERM (mpirun takes its ranks down) before SIGKILL */

static void cli_compare_help(void) {
    printf("usage: ctitan compare RUN_A RUN_B [--tolerance X] [--restore-tolerance X] [--price-per-hour P]\n"
           "                      [--bill-downtime] [--no-restore] [--probe-timeout S] [--steps] [--json]\n\n"
           "Compares two runs (their job.dump_folder) of one recipe under different layouts, machines or\n"
           "kernels:\n"
           "  loss curves   per step both runs logged, r = |a - b| / max(|a|, |b|, 1e-12); the max (and its\n"
           "                step) and mean of r, steps only one run logged. --steps prints every step.\n"
           "  restore       each run's final checkpoint is loaded in the other run's layout (mpirun -np W of\n"
           "                this binary) and in its own, and scores one fixed batch without updating; it\n"
           "                restores when both load and the two losses r-agree within --restore-tolerance\n"
           "                (default %g: float sums in another order). --no-restore skips it (four probes).\n"
           "                --probe-timeout S kills a probe still running after S seconds (default %g, 0:\n"
           "                no limit) and exits 1 naming it.\n"
           "  tokens/s      the job's, (tokens_seen / step) / step_time_s (the global batch's tokens), as a\n"
           "                mean over the logged steps after step 1 (warm-up), and B / A; beside it the\n"
           "                logged tps, which is per rank.\n"
           "  restarts      from events.jsonl: per restart the downtime (launch - previous exit or last sign\n"
           "                of life), start-up and checkpoint load, redone steps x mean step time.\n"
           "  cost          --price-per-hour P (per machine, any currency) x machines x the sessions' wall\n"
           "                time; downtime between sessions is shown apart and billed with --bill-downtime.\n"
           "                CPU core-hours held (ranks x threads x wall), CPU-hours used (rank 0's CPU time\n"
           "                x world), energy from RAPL when the run could read it, else the reason.\n\n"
           "--json prints the same as one JSON object.\n"
           "Exit status: 0 the runs agree, 4 they differ (max r above --tolerance, or a checkpoint that\n"
           "does not restore), 1 a run directory or its metrics.jsonl missing or empty, no step logged by\n"
           "both, or a probe timed out, 2 bad flags or two different models (not one recipe), 3 a malformed\n"
           "file. A run whose final checkpoint folder is missing, or whose saves are all final exports\n"
           "(checkpoint.last_save_in_hf, a LoRA run's adapter: nothing resumes from them), is reported\n"
           "\"not checked\", which is not a difference.\n",
           CMP_RESTORE_TOL, CMP_PROBE_TIMEOUT_S);
}

/* ---- the probe (one layout, one checkpoint): `ctitan compare --probe
 *      --probe-sequences=G TRAIN-FLAGS...`, every rank */

/* Sequence j of the fixed batch: T + 1 tokens of a generator seeded by j. */
static void probe_sequence(long j, int vocab, int T, int32_t *x, int32_t *y) {
    ct_rng r;
    ct_rng_seed(&r, 0x5eed0000ull + (uint64_t)j * 0x9e3779b97f4a7c15ull);
    int32_t prev = (int32_t)(ct_rng_u64(&r) % (uint64_t)vocab);
    for (int i = 0; i < T; i++) {
        int32_t next = (int32_t)(ct_rng_u64(&r) % (uint64_t)vocab);
        x[i] = prev;
        y[i] = next;
        prev = next;
    }
}

static int probe(int argc, char **argv) {
    long G = 0;
    if (argc < 1 || sscanf(argv[0], "--probe-sequences=%ld", &G) != 1 || G < 1) {
        fprintf(stderr, "ctitan: error: compare --probe: --probe-sequences=G first\n");
        return 2;
    }
    ct_err e = {0};
    ct_comm world;
    if (comm_init_world(&world, NULL, NULL, &e)) {
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(e.code);
    }
    ct_config cfg;
    cfg_defaults(&cfg);
    trainer t;
    int rc = cfg_parse_args(&cfg, argc - 1, argv + 1, &e), have_t = 0;
    if (rc) cfg_free(&cfg);
    else rc = trainer_init_dist(&t, &cfg, &world, &e), have_t = 1;
    if (!rc && !t.loaded.dir[0]) rc = ct_fail(&e, CT_ERR_IO, "no checkpoint was loaded");
    if (!rc) {
        ct_comm *dp = &t.plan.mesh.dp;
        if (G % dp->size)
            rc = ct_fail(&e, CT_ERR_CONFIG, "%ld probe sequences do not split over %d data-parallel ranks", G,
                         dp->size);
        else {
            int T = t.cfg.seq_len, chunk = t.val_batch > 0 ? t.val_batch : 1, vocab = t.plan.whole.vocab_size;
            /* the model's rows hold val_batch windows of validation.seq_len: a shorter one than
             * training's leaves room for fewer of training's length (a pipeline's: a micro-batch's) */
            int fit = t.model.act.B * t.model.act.T / plan_seq_len(&t.plan);
            if (!t.plan.pp && chunk > fit) chunk = fit > 0 ? fit : 1;
            long mine = G / dp->size, first = dp->rank * mine, n = 0;
            int32_t *x = ct_malloc((size_t)chunk * T * sizeof *x), *y = ct_malloc((size_t)chunk * T * sizeof *y);
            double sum = 0;
            for (long k = 0; k < mine; k += chunk) { /* every rank the same count: FSDP's gathers pair up */
                int b = (int)(mine - k < chunk ? mine - k : chunk);
                for (int i = 0; i < b; i++) probe_sequence(first + k + i, vocab, T, x + (size_t)i * T, y + (size_t)i * T);
                long nv = 0;
                sum += plan_eval(&t.plan, x, y, b, T, &nv);
                n += nv;
            }
            plan_sum_eval(&t.plan, &sum, &n);
            free(x);
            free(y);
            if (world.rank == 0) printf("ctitan-probe loss=%.17g targets=%ld\n", n ? sum / n : NAN, n);
            fflush(stdout);
        }
    }
    int code = ct_exit_code(rc);
    if (rc) {
        fprintf(stderr, "ctitan: error: [rank %d] %s\n", world.rank, e.msg);
        /* one rank's failure must not leave the others in a collective */
        if (world.size > 1 && rc != CT_ERR_CONFIG) comm_abort(&world, code);
    }
    if (have_t) trainer_free(&t);
    comm_free(&world);
    return code;
}

/* ---- the launcher side */

/* A setting's value as a flag value: config.toml quotes strings. */
static void flag_value(char *out, size_t cap, const char *v) {
    size_t n = strlen(v);
    if (n >= 2 && v[0] == '"' && v[n - 1] == '"') snprintf(out, cap, "%.*s", (int)(n - 2), v + 1);
    else snprintf(out, cap, "%s", v);
}

/* The settings that make a layout rather than a recipe. */
static int is_layout_key(const char *k) {
    return !strncmp(k, "parallelism.", 12) || !strcmp(k, "training.local_batch_size") ||
           !strcmp(k, "validation.local_batch_size");
}

/* A run's rank count: its latest start, else its metrics, else 1. */
static int run_world(const run_data *r) {
    for (int i = r->n_events - 1; i >= 0; i--)
        if (r->events[i].kind == RUN_EV_START) return r->events[i].world;
    for (int i = r->n_points - 1; i >= 0; i--)
        if (isfinite(r->points[i].v[RUN_WORLD]) && r->points[i].v[RUN_WORLD] >= 1) return (int)r->points[i].v[RUN_WORLD];
    return 1;
}

/* The run's final training checkpoint (full or model-only: the weights are
 * what a layout must place): the latest such checkpoint event, else the
 * newest step-N of its checkpoint folder that is a training checkpoint
 * (ckpt_dir_kind). A final save with checkpoint.last_save_in_hf, or a LoRA
 * run's adapter, is a step-N too, but no trainer resumes from it (load_step
 * refuses it): probing it would report a difference that is not one.
 * -1 when none; *export_step then gets the newest step-N that is such an
 * export (-1: none either) and *export_kind its ckpt_dir_kind. */
static int final_checkpoint(const run_data *r, const char *folder, int *export_step, int *export_kind) {
    *export_step = -1;
    *export_kind = CKPT_DIR_CHECKPOINT;
    for (int i = r->n_events - 1; i >= 0; i--) {
        const run_event *v = &r->events[i];
        if (v->kind == RUN_EV_CHECKPOINT && (!strcmp(v->ckpt_kind, "full") || !strcmp(v->ckpt_kind, "model_only")))
            return v->step;
    }
    int steps[4096], n = ckpt_list(folder, steps, 4096);
    int best = -1;
    for (int i = 0; i < n && i < 4096; i++) {
        char dir[5300];
        snprintf(dir, sizeof dir, "%s/step-%d", folder, steps[i]);
        int kind = ckpt_dir_kind(dir);
        if (kind == CKPT_DIR_CHECKPOINT) {
            if (steps[i] > best) best = steps[i];
        } else if (steps[i] > *export_step) {
            *export_step = steps[i];
            *export_kind = kind;
        }
    }
    return best;
}

/* The run's checkpoint folder under the directory given, not the events'
 * paths: a run folder copied or moved elsewhere is compared where it is now. */
static void run_ckpt_folder(const run_data *x, char *folder, size_t cap) {
    char cv[1024];
    const char *fv = run_setting_get(x, "checkpoint.folder");
    flag_value(cv, sizeof cv, fv ? fv : "\"checkpoint\"");
    if (cv[0] == '/') snprintf(folder, cap, "%s", cv);
    else snprintf(folder, cap, "%s/%s", x->dir, cv);
}

/* ---- one recipe? */

/* The config.json keys that make a model's shape and arithmetic: two runs
 * that differ in one are different models, whose loss curves say nothing
 * about a layout and whose restore check (each checkpoint in its own run's
 * config, the other's layout) would pass without testing anything shared. */
static const char *const arch_keys[] = {"model_type", "vocab_size", "hidden_size", "intermediate_size",
                                        "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "head_dim", "num_experts", "num_experts_per_tok",
                                        "tie_word_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
                                        NULL};

/* The run's model as config.json: its final checkpoint's (what the weights
 * are), else model.hf_assets_path's when that is a local folder; NULL when
 * neither reads. *from gets the path. */
static cJSON *run_model_json(const run_data *x, char *from, size_t cap) {
    char folder[5200], path[5400], v[1024];
    run_ckpt_folder(x, folder, sizeof folder);
    int ex, ex_kind, step = final_checkpoint(x, folder, &ex, &ex_kind);
    /* a Hugging Face export holds the trained model's config.json too */
    if (step < 0 && ex_kind == CKPT_DIR_HF_MODEL) step = ex;
    snprintf(path, sizeof path, "%s/step-%d/config.json", folder, step);
    ct_err e = {0};
    cJSON *j = step >= 0 ? json_parse_file(path, 1 << 20, &e) : NULL;
    if (!j) {
        const char *hf = run_setting_get(x, "model.hf_assets_path");
        flag_value(v, sizeof v, hf ? hf : "\"\"");
        snprintf(path, sizeof path, "%s/config.json", v);
        e = (ct_err){0};
        j = v[0] ? json_parse_file(path, 1 << 20, &e) : NULL;
    }
    snprintf(from, cap, "%.*s", (int)cap - 1, j ? path : "");
    return j;
}

/* Appends " KEY A vs B" to out[cap] (NULL values print as "(none)"). */
static void note_diff(char *out, size_t cap, const char *key, const char *a, const char *b) {
    size_t k = strlen(out);
    if (k + 1 < cap) snprintf(out + k, cap - k, "%s%s %.60s vs %.60s", k ? "; " : "", key, a ? a : "(none)", b ? b : "(none)");
}

/* The model keys in which a and b differ, "" when none: model.spec (and
 * model.flavor for the native table) from config.toml, then the shape of
 * the models' config.json. Paths (hf_assets_path) are not compared: the
 * same model may sit in another folder on another machine. */
static void recipe_diff(const run_data *a, const run_data *b, char *out, size_t cap) {
    out[0] = 0;
    const char *sa = run_setting_get(a, "model.spec"), *sb = run_setting_get(b, "model.spec");
    if (sa && sb && strcmp(sa, sb)) note_diff(out, cap, "model.spec", sa, sb);
    const char *fa = run_setting_get(a, "model.flavor"), *fb = run_setting_get(b, "model.flavor");
    if (sa && sb && !strcmp(sa, sb) && strcmp(sa, "\"hf\"") && fa && fb && strcmp(fa, fb))
        note_diff(out, cap, "model.flavor", fa, fb);
    char pa[5400], pb[5400];
    cJSON *ja = run_model_json(a, pa, sizeof pa), *jb = run_model_json(b, pb, sizeof pb);
    if (ja && jb)
        for (const char *const *k = arch_keys; *k; k++) {
            const cJSON *x = cJSON_GetObjectItemCaseSensitive(ja, *k), *y = cJSON_GetObjectItemCaseSensitive(jb, *k);
            if (!x && !y) continue;
            if (x && y && cJSON_Compare(x, y, 1)) continue;
            char *vx = x ? cJSON_PrintUnformatted(x) : NULL, *vy = y ? cJSON_PrintUnformatted(y) : NULL;
            char key[96];
            snprintf(key, sizeof key, "config.json %s", *k);
            note_diff(out, cap, key, vx, vy);
            free(vx);
            free(vy);
        }
    cJSON_Delete(ja);
    cJSON_Delete(jb);
}

typedef struct {
    char self[PATH_MAX], tmp[64];
    long sequences;
    double timeout_s; /* per probe; 0: none */
} probe_env;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Reads the probe's stdout (fd) to its end into out[cap] (the last cap - 1
 * bytes when longer; the loss is the last line), waiting until `deadline`
 * (now_s; INFINITY: none). 0 at the end of the output, 1 past the deadline. */
static int read_until(int fd, double deadline, char *out, size_t cap) {
    size_t len = 0;
    out[0] = 0;
    for (;;) {
        double left = deadline - now_s();
        if (left <= 0) return 1;
        struct pollfd pf = {.fd = fd, .events = POLLIN};
        int r = poll(&pf, 1, isfinite(left) ? (int)fmin(left * 1000 + 1, 60000) : -1);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0) continue;
        if (r < 0) return 0;
        if (len + 1 >= cap) { /* keep the newer half */
            memmove(out, out + len / 2, len - len / 2);
            len -= len / 2;
        }
        ssize_t n = read(fd, out + len, cap - 1 - len);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;
        len += (size_t)n;
        out[len] = 0;
    }
}

/* Stops a probe that ran past its time: SIGTERM first, on which mpirun
 * takes its ranks down with it (SIGKILL to mpirun would leave them
 * running), SIGKILL after the grace. Reaps it. */
static void stop_probe(pid_t pid, int *status) {
    kill(pid, SIGTERM);
    double until = now_s() + CMP_PROBE_GRACE_S;
    while (now_s() < until) {
        if (waitpid(pid, status, WNOHANG) == pid) return;
        nanosleep(&(struct timespec){0, 20 * 1000 * 1000}, NULL);
    }
    kill(pid, SIGKILL);
    while (waitpid(pid, status, 0) < 0 && errno == EINTR) {
    }
}

/* The last line of stderr that says "error", else the last line. */
static void last_error(const char *path, char *why, size_t cap) {
    FILE *f = fopen(path, "r");
    char line[1024], last[1024] = "", err[1024] = "";
    while (f && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = 0;
        if (!line[0]) continue;
        snprintf(last, sizeof last, "%s", line);
        if (strstr(line, "error")) snprintf(err, sizeof err, "%s", line);
    }
    if (f) fclose(f);
    snprintf(why, cap, "%.*s", (int)(cap - 1), err[0] ? err : last); /* a long line is cut, on purpose */
}

/* Run X's checkpoint `step` in layout L (whose world is `world`): its loss, or
 * NaN with why[] saying what went wrong; *timed_out set when it ran past
 * pe->timeout_s and was killed. */
static double probe_launch(const probe_env *pe, const run_data *x, const char *xfolder, int step, const run_data *l,
                           int world, char *why, size_t cap, int *timed_out) {
    char **argv = ct_calloc((size_t)l->n_config + 32, sizeof *argv);
    int n = 0;
    char np[16], seq[48], cfgf[4200], folder[5300], load[48], dump[128], steps[48], err_path[128];
    snprintf(np, sizeof np, "%d", world);
    if (world > 1) {
        const char *pre[] = {"mpirun", "--oversubscribe", "--bind-to", "none", "-np", np};
        for (size_t i = 0; i < sizeof pre / sizeof *pre; i++) argv[n++] = (char *)pre[i];
    }
    argv[n++] = (char *)pe->self;
    argv[n++] = "compare";
    argv[n++] = "--probe";
    snprintf(seq, sizeof seq, "--probe-sequences=%ld", pe->sequences);
    argv[n++] = seq;
    snprintf(cfgf, sizeof cfgf, "--config=%s/config.toml", x->dir);
    argv[n++] = cfgf;
    int first_alloc = n;
    for (int i = 0; i < l->n_config; i++) {
        if (!is_layout_key(l->config[i].key)) continue;
        char v[1024];
        flag_value(v, sizeof v, l->config[i].value);
        if (asprintf(&argv[n], "--%s=%s", l->config[i].key, v) < 0) abort();
        n++;
    }
    int first_owned = n;
    snprintf(folder, sizeof folder, "--checkpoint.folder=%s", xfolder);
    snprintf(load, sizeof load, "--checkpoint.load_step=%d", step);
    snprintf(dump, sizeof dump, "--job.dump_folder=%s/dump", pe->tmp);
    const char *st = run_setting_get(x, "training.steps");
    snprintf(steps, sizeof steps, "--training.steps=%d", st && atoi(st) > step ? atoi(st) : step);
    const char *own[] = {"--checkpoint.enable=true", folder, load, dump, steps};
    for (size_t i = 0; i < sizeof own / sizeof *own; i++) argv[n++] = (char *)own[i];
    argv[n] = NULL;
    snprintf(err_path, sizeof err_path, "%s/probe.err", pe->tmp);

    double loss = NAN;
    int fd[2];
    *timed_out = 0;
    if (pipe(fd)) {
        snprintf(why, cap, "pipe: %s", strerror(errno));
        goto done;
    }
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        FILE *ef = freopen(err_path, "w", stderr);
        (void)ef;
        /* Open MPI refuses to start as root without these; the user typed no
         * mpirun here, so compare says yes for them, as scripts/run_train.sh does
         * (without, a root user's probe failed and read as DOES NOT RESTORE) */
        if (world > 1 && geteuid() == 0) {
            setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
            setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
        }
        dup2(fd[1], 1);
        close(fd[0]);
        close(fd[1]);
        execvp(argv[0], argv);
        fprintf(stderr, "ctitan: error: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(127);
    }
    close(fd[1]);
    if (pid < 0) {
        close(fd[0]);
        snprintf(why, cap, "fork: %s", strerror(errno));
        goto done;
    }
    char text[4096];
    int status = 0;
    *timed_out = read_until(fd[0], pe->timeout_s > 0 ? now_s() + pe->timeout_s : INFINITY, text, sizeof text);
    close(fd[0]);
    if (*timed_out) {
        stop_probe(pid, &status);
        snprintf(why, cap, "timed out after %g s (--probe-timeout)", pe->timeout_s);
        goto done;
    }
    for (const char *p = text; p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL) {
        double v;
        if (sscanf(p, "ctitan-probe loss=%lf", &v) == 1) loss = v;
    }
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !isfinite(loss)) {
        char last[400];
        last_error(err_path, last, sizeof last);
        snprintf(why, cap, "%s", last[0] ? last : "the probe printed no loss");
        if (WIFEXITED(status) && WEXITSTATUS(status)) {
            size_t k = strlen(why);
            snprintf(why + k, cap - k, " (exit %d)", WEXITSTATUS(status));
        }
        loss = NAN;
    }
done:
    for (int i = first_alloc; i < first_owned; i++) free(argv[i]);
    free(argv);
    return loss;
}

static long gcd(long a, long b) { return b ? gcd(b, a % b) : a; }

/* The restore check of X's final checkpoint in Y's layout (and X's own).
 * 1 when a probe timed out (r->why says which), else 0. */
static int restore_check(const probe_env *pe, const char *xn, const char *yn, const run_data *x, const run_data *y,
                         double tol, cmp_restore *r) {
    memset(r, 0, sizeof *r);
    r->own_loss = r->other_loss = r->rel = NAN;
    r->own_world = run_world(x);
    r->other_world = run_world(y);
    char folder[5200], step_dir[5300];
    run_ckpt_folder(x, folder, sizeof folder);
    if (!x->n_config) {
        snprintf(r->why, sizeof r->why, "no config.toml in %.400s", x->dir);
        return 0;
    }
    int ex, ex_kind;
    r->step = final_checkpoint(x, folder, &ex, &ex_kind);
    if (r->step < 0 && ex >= 0) {
        /* not a difference: there is nothing a layout would resume from */
        snprintf(r->why, sizeof r->why,
                 "no training checkpoint in %.400s, only final saves: step-%d is %s, which no layout resumes from",
                 folder, ex, ckpt_dir_kind_name(ex_kind));
        return 0;
    }
    if (r->step < 0) {
        snprintf(r->why, sizeof r->why, "no checkpoint in %.400s", folder);
        return 0;
    }
    /* events.jsonl names the final save, but the folder may have been left
     * behind in a copy or deleted: a probe would then fail to load and the
     * run be reported as not restoring, a finding about the layouts that
     * was never made. Not checked, and why. */
    snprintf(step_dir, sizeof step_dir, "%s/step-%d", folder, r->step);
    struct stat sd;
    if (stat(step_dir, &sd) || !S_ISDIR(sd.st_mode)) {
        snprintf(r->why, sizeof r->why, "its final checkpoint %.400s is missing", step_dir);
        return 0;
    }
    r->checked = 1;
    char why_own[512] = "", why_other[512] = "";
    int late = 0;
    r->own_loss = probe_launch(pe, x, folder, r->step, x, r->own_world, why_own, sizeof why_own, &late);
    if (late) { /* the next would likely hang the same way: stop here */
        snprintf(r->why, sizeof r->why, "the probe of %s's step-%d in %s's own layout (%d rank%s) %.400s", xn, r->step, xn,
                 r->own_world, r->own_world == 1 ? "" : "s", why_own);
        return 1;
    }
    r->other_loss = probe_launch(pe, x, folder, r->step, y, r->other_world, why_other, sizeof why_other, &late);
    if (late) {
        snprintf(r->why, sizeof r->why, "the probe of %s's step-%d in %s's layout (%d rank%s) %.400s", xn, r->step, yn,
                 r->other_world, r->other_world == 1 ? "" : "s", why_other);
        return 1;
    }
    if (!isfinite(r->other_loss)) {
        snprintf(r->why, sizeof r->why, "fails to load in the other layout: %.440s", why_other);
    } else if (!isfinite(r->own_loss)) {
        snprintf(r->why, sizeof r->why, "fails to load in its own layout: %.440s", why_own);
    } else {
        r->rel = cmp_rel_diff(r->own_loss, r->other_loss);
        r->ok = r->rel <= tol;
        if (!r->ok) snprintf(r->why, sizeof r->why, "loss differs by %.3g > tolerance %.3g", r->rel, tol);
    }
    return 0;
}

static int parse_num(const char *flag, const char *v, double *out) {
    char *end;
    errno = 0;
    double d = v ? strtod(v, &end) : NAN;
    if (!v || !*v || *end || errno || !isfinite(d) || d < 0) {
        fprintf(stderr, "ctitan: error: compare: %s needs a number >= 0 (got \"%s\")\n", flag, v ? v : "");
        return 2;
    }
    *out = d;
    return 0;
}

int cli_compare(int argc, char **argv) {
    if (argc >= 1 && !strcmp(argv[0], "--probe")) return probe(argc - 1, argv + 1);
    cmp_opts o = {.tolerance = -1, .restore_tol = CMP_RESTORE_TOL, .price = -1};
    const char *dirs[2] = {0};
    int n_dirs = 0, json = 0, restore = 1;
    double probe_timeout = CMP_PROBE_TIMEOUT_S;
    for (int i = 0; i < argc; i++) {
        const char *a = argv[i], *eq = strchr(a, '=');
        size_t k = eq ? (size_t)(eq - a) : strlen(a);
        const char *v = eq ? eq + 1 : (i + 1 < argc ? argv[i + 1] : NULL);
        int takes = 0;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            cli_compare_help();
            return 0;
        } else if (!strncmp(a, "--tolerance", k) && k == 11) {
            if (parse_num("--tolerance", v, &o.tolerance)) return 2;
            takes = 1;
        } else if (!strncmp(a, "--restore-tolerance", k) && k == 19) {
            if (parse_num("--restore-tolerance", v, &o.restore_tol)) return 2;
            takes = 1;
        } else if (!strncmp(a, "--price-per-hour", k) && k == 16) {
            if (parse_num("--price-per-hour", v, &o.price)) return 2;
            takes = 1;
        } else if (!strncmp(a, "--probe-timeout", k) && k == 15) {
            if (parse_num("--probe-timeout", v, &probe_timeout)) return 2;
            takes = 1;
        } else if (!strcmp(a, "--bill-downtime")) {
            o.bill_downtime = 1;
        } else if (!strcmp(a, "--no-restore")) {
            restore = 0;
        } else if (!strcmp(a, "--steps")) {
            o.show_steps = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if (a[0] == '-') {
            fprintf(stderr, "ctitan: error: compare: unknown flag %s (ctitan compare --help)\n", a);
            return 2;
        } else if (n_dirs < 2) {
            dirs[n_dirs++] = a;
        } else {
            fprintf(stderr, "ctitan: error: compare: takes two run directories, got a third: %s\n", a);
            return 2;
        }
        if (takes && !eq) i++;
    }
    if (n_dirs != 2) {
        fprintf(stderr, "ctitan: error: compare: takes two run directories (RUN_A RUN_B), got %d\n", n_dirs);
        return 2;
    }
    o.dir_a = dirs[0];
    o.dir_b = dirs[1];
    run_data ra, rb;
    ct_err e = {0};
    int rc = run_load(&ra, dirs[0], &e);
    if (!rc) rc = run_load(&rb, dirs[1], &e);
    else memset(&rb, 0, sizeof rb);
    if (rc) {
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        run_free(&ra);
        run_free(&rb);
        return ct_exit_code(rc);
    }
    char differ_keys[1024];
    recipe_diff(&ra, &rb, differ_keys, sizeof differ_keys);
    if (differ_keys[0]) {
        fprintf(stderr, "ctitan: error: compare: not runs of one recipe, the models differ (A vs B): %s\n", differ_keys);
        run_free(&ra);
        run_free(&rb);
        return 2;
    }
    cmp_loss l;
    run_summary ca, cb;
    cmp_loss_diff(&ra, &rb, &l);
    if (!l.n) { /* no curve to hold to a tolerance: that is not agreement */
        fprintf(stderr, "ctitan: error: compare: no step has a loss in both runs (%d only in A, %d only in B); the "
                        "loss curves cannot be compared\n", l.n_only_a, l.n_only_b);
        cmp_loss_free(&l);
        run_free(&ra);
        run_free(&rb);
        return 1;
    }
    run_summarise(&ra, &ca);
    run_summarise(&rb, &cb);
    cmp_restore rs[2];
    memset(rs, 0, sizeof rs);
    rs[0].own_loss = rs[0].other_loss = rs[0].rel = rs[1].own_loss = rs[1].other_loss = rs[1].rel = NAN;
    if (!restore) {
        snprintf(rs[0].why, sizeof rs[0].why, "--no-restore");
        snprintf(rs[1].why, sizeof rs[1].why, "--no-restore");
    } else {
        probe_env pe;
        ssize_t m = readlink("/proc/self/exe", pe.self, sizeof pe.self - 1);
        snprintf(pe.tmp, sizeof pe.tmp, "/tmp/ctitan-compare-XXXXXX");
        if (m <= 0 || !mkdtemp(pe.tmp)) {
            fprintf(stderr, "ctitan: error: compare: cannot set up the restore check: %s\n", strerror(errno));
            rc = CT_ERR_IO;
        } else {
            pe.self[m] = 0;
            pe.timeout_s = probe_timeout;
            /* a batch every data-parallel degree of either layout splits evenly */
            long wa = run_world(&ra), wb = run_world(&rb), lcm = wa / gcd(wa, wb) * wb;
            pe.sequences = lcm * ((8 + lcm - 1) / lcm);
            char abs_a[PATH_MAX], abs_b[PATH_MAX];
            /* the probes must find the checkpoint wherever they run: absolute paths */
            if (realpath(dirs[0], abs_a)) snprintf(ra.dir, sizeof ra.dir, "%s", abs_a);
            if (realpath(dirs[1], abs_b)) snprintf(rb.dir, sizeof rb.dir, "%s", abs_b);
            const cmp_restore *late = restore_check(&pe, "A", "B", &ra, &rb, o.restore_tol, &rs[0])   ? &rs[0]
                                      : restore_check(&pe, "B", "A", &rb, &ra, o.restore_tol, &rs[1]) ? &rs[1]
                                                                                                       : NULL;
            if (late) {
                fprintf(stderr, "ctitan: error: compare: %s; the restore check is incomplete (a larger "
                                "--probe-timeout, or --no-restore)\n", late->why);
                rc = CT_ERR_IO;
            }
            ct_rm_tree(pe.tmp, NULL);
        }
    }
    if (!rc) {
        if (json) cmp_print_json(stdout, &o, &l, &ca, &cb, rs);
        else cmp_print_text(stdout, &o, &l, &ca, &cb, rs);
    }
    int differ = (o.tolerance >= 0 && l.n && l.max_rel > o.tolerance) || (rs[0].checked && !rs[0].ok) ||
                 (rs[1].checked && !rs[1].ok);
    cmp_loss_free(&l);
    run_summary_free(&ca);
    run_summary_free(&cb);
    run_free(&ra);
    run_free(&rb);
    return rc ? ct_exit_code(rc) : differ ? CMP_EXIT_DIFFER : 0;
}
