/* cli/cmd_train.c: `ctitan train --config FILE [--section.key=value ...]`.
 * Config errors are reported before any work (exit 2); everything else the
 * trainer reports with the file, key or tensor at fault (exit 1).
 *
 * Under mpirun (`mpirun -np N ctitan train ...`) every rank runs this. Only
 * the ranks named by CTITAN_LOG_RANKS ("0" by default, "0,2" or "all";
 * scripts/run_train.sh sets it from LOG_RANK as torchtitan's does) keep
 * stdout and stderr; the others still report their own errors, prefixed
 * with the rank. A failure that may be one rank's alone ends the whole job
 * with MPI_Abort rather than leaving the others waiting in a collective;
 * a config error is the same on every rank and exits 2 normally, and one
 * that a rank may meet alone (its own copy of a file, its own CPU) goes
 * through an agreement first (trainer_agree), which makes it the same. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli/cli.h"
#include "config/config.h"
#include "distributed/comm.h"
#include "train/trainer.h"

static int log_this_rank(int rank) {
    const char *v = getenv("CTITAN_LOG_RANKS");
    if (!v || !*v) v = "0";
    if (!strcmp(v, "all")) return 1;
    for (const char *p = v; *p;) {
        char *end;
        long r = strtol(p, &end, 10);
        if (end == p) break;
        if (r == rank) return 1;
        p = *end == ',' ? end + 1 : end;
    }
    return 0;
}

/* Reports rc (if an error) and ends this process's part of the run. */
static int finish(ct_comm *world, FILE *err, int rc, const ct_err *e) {
    int code = ct_exit_code(rc), dist = world->size > 1;
    if (rc && rc != CT_STOPPED) {
        if (!dist) fprintf(err, "ctitan: error: %s\n", e->msg);
        else if (rc != CT_ERR_CONFIG || world->rank == 0)
            fprintf(err, "ctitan: error: [rank %d] %s\n", world->rank, e->msg);
        if (dist && rc != CT_ERR_CONFIG && !e->all_ranks) {
            fprintf(err, "ctitan: [rank %d] ending the job: all %d ranks stop\n", world->rank, world->size);
            comm_abort(world, code);
        }
    }
    comm_free(world);
    if (err != stderr) fclose(err);
    return code;
}

void cli_train_help(void) {
    printf("usage: ctitan train --config FILE [--section.key=value | --section.key value | --flag] ... [--dry-run]\n\n"
           "--dry-run prints the memory the run would plan (parameters, gradients, AdamW moments,\n"
           "activations) and exits without allocating it. For several ranks (under mpirun, or\n"
           "[parallelism] degrees all fixed) it checks the layout and adds what rank 0 plans;\n"
           "with pipeline_parallel_degree > 1, what every pipeline rank plans and the schedule's bubble.\n\n"
           "Trains a Qwen3 model. Options (TOML sections and keys as torchtitan's):\n\n");
    cfg_print_help(stdout);
}

/* The data sources exist, before the model is built and the kernels are
 * timed: a mistyped path was reported only after them (a minute or more
 * with kernels.tune on a new machine). What the files hold is checked when
 * the data is opened (data/dataset.h). */
static int check_data(const ct_config *c, ct_err *e) {
    struct { const char *key, *list; } src[] = {{"training.dataset_path", c->dataset_path},
                                                 {"validation.dataset_path", c->val_enable ? c->val_dataset_path : ""}};
    if (!c->dataset_path[0])
        return ct_fail(e, CT_ERR_CONFIG, "%s: training.dataset_path: no data given",
                       cfg_origin(c, "training.dataset_path"));
    for (size_t i = 0; i < sizeof src / sizeof src[0]; i++) {
        char item[4096];
        for (const char *p = cfg_list_next(src[i].list, item, sizeof item); p; p = cfg_list_next(p, item, sizeof item)) {
            struct stat st;
            if (item[0] && stat(item, &st) != 0)
                return ct_fail(e, CT_ERR_IO, "%s: %s: %s: %s", cfg_origin(c, src[i].key), src[i].key, item,
                               strerror(errno));
        }
    }
    return 0;
}

int cli_train(int argc, char **argv) {
    for (int i = 0; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            cli_train_help();
            return 0;
        }
    /* --dry-run is a mode of the command, not a config option: take it out first */
    int dry = 0, n = 0;
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--dry-run")) dry = 1;
        else argv[n++] = argv[i];
    }
    argc = n;
    ct_err e = {0};
    ct_comm world;
    if (comm_init_world(&world, NULL, NULL, &e)) {
        fprintf(stderr, "ctitan: error: %s\n", e.msg);
        return ct_exit_code(e.code);
    }
    FILE *err = stderr;
    if (world.size > 1 && !log_this_rank(world.rank)) {
        int fd = dup(2);
        FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
        if (f) {
            setvbuf(f, NULL, _IONBF, 0);
            err = f;
        }
        if (!freopen("/dev/null", "w", stdout) || !freopen("/dev/null", "w", stderr)) err = f ? f : stderr;
    }
    ct_config cfg;
    cfg_defaults(&cfg);
    int rc = cfg_parse_args(&cfg, argc, argv, &e);
    if (!rc) cfg_warn_unused(&cfg); /* the ranks that do not log have no stderr by now */
    /* the config's own errors first (a kernel name), then the files it names */
    if (!rc && !dry) rc = trainer_check_kernels(&cfg, &e);
    if (!rc && !dry) rc = check_data(&cfg, &e);
    /* Each rank reads its own machine's copy of --config and checks its own CPU and
     * disk: one may fail alone (a broken copy of the file, a kernel its CPU lacks),
     * and a config error is rank 0's to print. Agreed here, so that no rank goes on
     * into the trainer's collectives without the others, and rank 0 prints it. */
    rc = comm_agree(&world, rc, "check its config, kernels and data", &e);
    if (rc) {
        cfg_free(&cfg);
        return finish(&world, err, rc, &e);
    }
    if (dry) { /* every rank checks the layout (a bad one exits 2 everywhere); rank 0 alone prints */
        int launched = world.be != &comm_single_backend;
        rc = trainer_dry_run(&cfg, launched ? world.size : 0, world.rank == 0 ? stdout : NULL, &e);
        cfg_free(&cfg);
        return finish(&world, err, rc, &e);
    }
    trainer t;
    rc = trainer_init_dist(&t, &cfg, &world, &e);
    if (!rc) rc = trainer_run(&t, &e);
    if (rc && rc != CT_STOPPED && rc != CT_ERR_CONFIG && world.size > 1) return finish(&world, err, rc, &e);
    trainer_free(&t);
    return finish(&world, err, rc, &e);
}
