/* report/compare.h: two runs of one recipe side by side, for `ctitan compare`.
 *
 * What the critics asked of a trainer and no log line tells: did two layouts
 * (machines, kernels) give the same loss curve, how fast was each, how much
 * time did restarts cost, and what did the whole run cost. Everything here is
 * computed from the run directories alone (report/run.h): metrics.jsonl for
 * the curve, and each run's accounting (speed, sessions, restarts, wall, CPU,
 * energy) is run_summarise's, which `ctitan report` prints as well. The
 * restore check, which has to launch ctitan, lives in the CLI
 * (cli/cmd_compare.c); docs/compare.md has the formulas. */
#ifndef CT_REPORT_COMPARE_H
#define CT_REPORT_COMPARE_H

#include <stdio.h>

#include "report/run.h"

/* The loss curves on the steps both runs logged. */
typedef struct {
    int n;             /* steps both runs logged a finite loss for */
    int *steps;        /* [n] ascending */
    double *a, *b;     /* [n] the two losses */
    double max_rel, mean_rel; /* of cmp_rel_diff over the n steps (0 when n == 0) */
    int max_step;      /* step of max_rel (-1 when n == 0) */
    int n_only_a, n_only_b; /* steps one run logged and the other did not */
    int only_a[8], only_b[8]; /* the first of them */
} cmp_loss;

/* |a - b| / max(|a|, |b|, 1e-12): symmetric, and 0 for two zeros. */
double cmp_rel_diff(double a, double b);
void cmp_loss_diff(const run_data *a, const run_data *b, cmp_loss *out);
void cmp_loss_free(cmp_loss *l);

/* One direction of the restore check: run X's final checkpoint loaded in
 * run Y's layout, its loss on a fixed batch against the same in X's own. */
typedef struct {
    int checked;          /* 0: --no-restore, or nothing to check (why says) */
    int step;             /* the checkpoint's step */
    int own_world, other_world;
    double own_loss, other_loss, rel; /* NaN when a probe failed */
    int ok;               /* loaded in both and rel <= tolerance */
    char why[512];        /* why not ok / not checked; "" when ok */
} cmp_restore;

typedef struct {
    const char *dir_a, *dir_b;
    double tolerance;     /* < 0: none given */
    double restore_tol;   /* the restore check's */
    double price;         /* per machine-hour; < 0: none given */
    int bill_downtime;
    int show_steps;       /* the per-step table */
} cmp_opts;

/* The report as text (the table a person reads) and as one JSON object. */
void cmp_print_text(FILE *f, const cmp_opts *o, const cmp_loss *l, const run_summary *ra, const run_summary *rb,
                    const cmp_restore rs[2]);
void cmp_print_json(FILE *f, const cmp_opts *o, const cmp_loss *l, const run_summary *ra, const run_summary *rb,
                    const cmp_restore rs[2]);
/* The cost of a run at o->price per machine-hour (NaN without a price). */
double cmp_cost(const cmp_opts *o, const run_summary *r);

#endif
