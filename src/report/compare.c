/* report/compare.c: the figures of `ctitan compare` (see compare.h). The
 * accounting of each run (sessions, restarts, wall, CPU, energy, the means
 * after step 1) is run_summarise's (report/run.c), the one `ctitan report`
 * prints too, so the two commands cannot disagree on a run. */
#include "report/compare.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "core/err.h"

#define CMP_EPS 1e-12

double cmp_rel_diff(double a, double b) {
    double d = fmax(fmax(fabs(a), fabs(b)), CMP_EPS);
    return fabs(a - b) / d;
}

/* The last finite loss a run logged for each step (a resume truncates the
 * redone lines, so a step normally appears once), as a step-sorted list. */
typedef struct {
    int step, pos; /* pos: line order, so a repeated step keeps its latest value */
    double loss;
} step_loss;

static int by_step(const void *x, const void *y) {
    const step_loss *a = x, *b = y;
    if (a->step != b->step) return (a->step > b->step) - (a->step < b->step);
    return (a->pos > b->pos) - (a->pos < b->pos);
}

static step_loss *losses(const run_data *r, int *n) {
    step_loss *v = ct_malloc(((size_t)r->n_points + 1) * sizeof *v);
    int k = 0, m = 0;
    for (int i = 0; i < r->n_points; i++)
        if (isfinite(r->points[i].v[RUN_LOSS])) v[k++] = (step_loss){r->points[i].step, i, r->points[i].v[RUN_LOSS]};
    qsort(v, (size_t)k, sizeof *v, by_step);
    for (int i = 0; i < k; i++) {
        if (m && v[m - 1].step == v[i].step) m--;
        v[m++] = v[i];
    }
    *n = m;
    return v;
}

void cmp_loss_diff(const run_data *a, const run_data *b, cmp_loss *out) {
    memset(out, 0, sizeof *out);
    out->max_step = -1;
    int na, nb;
    step_loss *la = losses(a, &na), *lb = losses(b, &nb);
    int cap = (na < nb ? na : nb) + 1;
    out->steps = ct_malloc((size_t)cap * sizeof *out->steps);
    out->a = ct_malloc((size_t)cap * sizeof *out->a);
    out->b = ct_malloc((size_t)cap * sizeof *out->b);
    double sum = 0;
    for (int i = 0, j = 0; i < na || j < nb;) {
        if (j >= nb || (i < na && la[i].step < lb[j].step)) {
            if (out->n_only_a < 8) out->only_a[out->n_only_a] = la[i].step;
            out->n_only_a++;
            i++;
        } else if (i >= na || lb[j].step < la[i].step) {
            if (out->n_only_b < 8) out->only_b[out->n_only_b] = lb[j].step;
            out->n_only_b++;
            j++;
        } else {
            double r = cmp_rel_diff(la[i].loss, lb[j].loss);
            out->steps[out->n] = la[i].step;
            out->a[out->n] = la[i].loss;
            out->b[out->n] = lb[j].loss;
            out->n++;
            sum += r;
            if (out->max_step < 0 || r > out->max_rel) {
                out->max_rel = r;
                out->max_step = la[i].step;
            }
            i++;
            j++;
        }
    }
    out->mean_rel = out->n ? sum / out->n : 0;
    free(la);
    free(lb);
}

void cmp_loss_free(cmp_loss *l) {
    free(l->steps);
    free(l->a);
    free(l->b);
    memset(l, 0, sizeof *l);
}

double cmp_cost(const cmp_opts *o, const run_summary *r) {
    if (o->price < 0) return NAN;
    return o->price * (r->machine_s + (o->bill_downtime ? r->downtime_machine_s : 0)) / 3600.0;
}

/* ---- the report */

static const char *cmp_verdict(const cmp_opts *o, const cmp_loss *l) {
    if (o->tolerance < 0) return "no --tolerance given";
    if (!l->n) return "no common steps";
    return l->max_rel <= o->tolerance ? "within" : "EXCEEDED";
}

/* Run A's (w 0) or B's loss at step. */
static double cmp_at(const cmp_loss *l, int step, int w) {
    for (int i = 0; i < l->n; i++)
        if (l->steps[i] == step) return w ? l->b[i] : l->a[i];
    return NAN;
}

static void row(FILE *f, const char *what, double a, double b, const char *fmt) {
    char x[64], y[64];
    if (isfinite(a)) snprintf(x, sizeof x, fmt, a);
    else snprintf(x, sizeof x, "-");
    if (isfinite(b)) snprintf(y, sizeof y, fmt, b);
    else snprintf(y, sizeof y, "-");
    fprintf(f, "  %-44s %16s %16s\n", what, x, y);
}

static void energy_line(FILE *f, const char *name, const run_summary *r) {
    if (!r->n_sessions) {
        fprintf(f, "  energy %s: unknown (no events.jsonl)\n", name);
    } else if (!r->energy_n) {
        fprintf(f, "  energy %s: not measured: %s\n", name,
                r->energy_note[0] ? r->energy_note : "no session recorded energy_j (killed before its exit)");
    } else {
        fprintf(f, "  energy %s: %.1f J = %.4f kWh (rank 0's machine, RAPL packages); all machines (x machines): %.4f kWh",
                name, r->energy_j, r->energy_j / 3.6e6, r->energy_est_j / 3.6e6);
        if (r->energy_unknown) fprintf(f, "; %d session(s) without a reading", r->energy_unknown);
        fputc('\n', f);
    }
}

static void restarts_text(FILE *f, const char *name, const run_summary *r) {
    for (int k = 1; k < r->n_sessions; k++) {
        const run_session *s = &r->s[k], *p = &r->s[k - 1];
        fprintf(f,
                "  %s restart %d: from step %d after the previous session %s at step %d; downtime %.2f s, start-up "
                "%.2f s (checkpoint load %.2f s), redone %d step(s)\n",
                name, k, s->start_step, !strcmp(p->reason, "killed") ? "was killed" : p->reason, p->end_step,
                s->downtime_s, s->startup_s, s->load_s, s->redone_steps);
    }
}

static void restore_text(FILE *f, const char *x, const char *y, const cmp_restore *r) {
    if (!r->checked) {
        fprintf(f, "  %s's final checkpoint in %s's layout: not checked (%s)\n", x, y, r->why);
        return;
    }
    fprintf(f, "  %s step-%d in %s's layout (%d rank%s): %s", x, r->step, y, r->other_world,
            r->other_world == 1 ? "" : "s", r->ok ? "restores" : "DOES NOT RESTORE");
    if (isfinite(r->own_loss) && isfinite(r->other_loss))
        fprintf(f, ": loss %.9g vs %.9g in %s's own (%d rank%s), relative difference %.3g", r->other_loss, r->own_loss,
                x, r->own_world, r->own_world == 1 ? "" : "s", r->rel);
    if (r->why[0]) fprintf(f, " (%s)", r->why);
    fputc('\n', f);
}

void cmp_print_text(FILE *f, const cmp_opts *o, const cmp_loss *l, const run_summary *ra, const run_summary *rb,
                    const cmp_restore rs[2]) {
    fprintf(f, "A: %s\nB: %s\n\n", o->dir_a, o->dir_b);
    fprintf(f, "Loss curves (metrics.jsonl \"loss\"; per step |a - b| / max(|a|, |b|, 1e-12))\n");
    fprintf(f, "  steps compared: %d (only in A: %d, only in B: %d)\n", l->n, l->n_only_a, l->n_only_b);
    for (int w = 0; w < 2; w++) {
        int n = w ? l->n_only_b : l->n_only_a;
        const int *v = w ? l->only_b : l->only_a;
        if (!n) continue;
        fprintf(f, "  steps only in %c:", w ? 'B' : 'A');
        for (int i = 0; i < n && i < 8; i++) fprintf(f, " %d", v[i]);
        fprintf(f, "%s\n", n > 8 ? " ..." : "");
    }
    if (l->n) {
        fprintf(f, "  max relative difference: %.3g at step %d (A %.9g, B %.9g)\n", l->max_rel, l->max_step,
                cmp_at(l, l->max_step, 0), cmp_at(l, l->max_step, 1));
        fprintf(f, "  mean relative difference: %.3g\n", l->mean_rel);
    }
    if (o->tolerance >= 0) fprintf(f, "  tolerance %.3g: %s\n", o->tolerance, cmp_verdict(o, l));
    if (o->show_steps && l->n) {
        fprintf(f, "\n  %8s %16s %16s %12s\n", "step", "loss A", "loss B", "rel diff");
        for (int i = 0; i < l->n; i++)
            fprintf(f, "  %8d %16.9g %16.9g %12.3g\n", l->steps[i], l->a[i], l->b[i], cmp_rel_diff(l->a[i], l->b[i]));
    }
    fprintf(f, "\nFinal checkpoints restored in the other run's layout (loss of one fixed batch, no update; the same "
               "when r <= %.3g)\n", o->restore_tol);
    restore_text(f, "A", "B", &rs[0]);
    restore_text(f, "B", "A", &rs[1]);

    fprintf(f, "\n  %-44s %16s %16s\n", "", "A", "B");
    row(f, "tokens/s of the job (mean after step 1)", ra->job_tps_mean, rb->job_tps_mean, "%.1f");
    if (isfinite(ra->job_tps_mean) && isfinite(rb->job_tps_mean) && ra->job_tps_mean > 0)
        fprintf(f, "  %-44s %33.3f\n", "tokens/s of the job B / A", rb->job_tps_mean / ra->job_tps_mean);
    row(f, "tokens/s per rank (metrics tps)", ra->tps_mean, rb->tps_mean, "%.1f");
    row(f, "step time s (mean, after step 1)", ra->step_time_mean, rb->step_time_mean, "%.4f");
    row(f, "sessions (launches)", ra->n_sessions, rb->n_sessions, "%.0f");
    row(f, "restarts", ra->restarts, rb->restarts, "%.0f");
    row(f, "downtime s (end of a session -> next launch)", ra->downtime_s, rb->downtime_s, "%.2f");
    row(f, "start-up s of the restarts", ra->startup_s, rb->startup_s, "%.2f");
    row(f, "  of which checkpoint load s", ra->load_s, rb->load_s, "%.2f");
    row(f, "redone steps", ra->redone_steps, rb->redone_steps, "%.0f");
    row(f, "redone work s (steps x mean step time)", ra->redone_s, rb->redone_s, "%.2f");
    row(f, "time lost to restarts s", ra->lost_s, rb->lost_s, "%.2f");
    row(f, "wall s (sum of sessions)", ra->wall_s, rb->wall_s, "%.2f");
    row(f, "machine-hours (machines x wall)", ra->machine_s / 3600, rb->machine_s / 3600, "%.6f");
    row(f, "machine-hours of downtime", ra->downtime_machine_s / 3600, rb->downtime_machine_s / 3600, "%.6f");
    row(f, "CPU core-hours held (ranks x threads x wall)", ra->core_s / 3600, rb->core_s / 3600, "%.6f");
    row(f, "CPU-hours used (rank 0's CPU time x world)", ra->n_sessions ? ra->cpu_est_s / 3600 : NAN,
        rb->n_sessions ? rb->cpu_est_s / 3600 : NAN, "%.6f");
    if (ra->cpu_unknown || rb->cpu_unknown)
        fprintf(f, "  (CPU time unknown for %d and %d killed session(s))\n", ra->cpu_unknown, rb->cpu_unknown);
    if (o->price >= 0) {
        char what[80];
        snprintf(what, sizeof what, "cost at %g per machine-hour%s", o->price,
                 o->bill_downtime ? " (downtime billed)" : "");
        row(f, what, cmp_cost(o, ra), cmp_cost(o, rb), "%.6f");
    } else {
        fprintf(f, "  cost: no --price-per-hour given\n");
    }
    energy_line(f, "A", ra);
    energy_line(f, "B", rb);
    if (!ra->n_sessions || !rb->n_sessions)
        fprintf(f, "  (a run without events.jsonl: sessions, restarts and cost unknown)\n");
    if (ra->restarts || rb->restarts) fputc('\n', f);
    restarts_text(f, "A", ra);
    restarts_text(f, "B", rb);
}

static cJSON *num_or_null(double v) { return isfinite(v) ? cJSON_CreateNumber(v) : cJSON_CreateNull(); }

static cJSON *run_json(const cmp_opts *o, const char *dir, const run_summary *r) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "dir", dir);
    cJSON_AddItemToObject(j, "tps_mean", num_or_null(r->tps_mean));
    cJSON_AddItemToObject(j, "step_time_mean", num_or_null(r->step_time_mean));
    cJSON_AddItemToObject(j, "job_tps_mean", num_or_null(r->job_tps_mean));
    cJSON_AddNumberToObject(j, "restarts", r->restarts);
    cJSON_AddNumberToObject(j, "downtime_s", r->downtime_s);
    cJSON_AddNumberToObject(j, "startup_s", r->startup_s);
    cJSON_AddNumberToObject(j, "load_s", r->load_s);
    cJSON_AddNumberToObject(j, "redone_steps", r->redone_steps);
    cJSON_AddNumberToObject(j, "redone_s", r->redone_s);
    cJSON_AddNumberToObject(j, "lost_s", r->lost_s);
    cJSON_AddNumberToObject(j, "wall_s", r->wall_s);
    cJSON_AddNumberToObject(j, "machine_hours", r->machine_s / 3600);
    cJSON_AddNumberToObject(j, "downtime_machine_hours", r->downtime_machine_s / 3600);
    cJSON_AddNumberToObject(j, "core_hours", r->core_s / 3600);
    cJSON_AddNumberToObject(j, "cpu_hours_est", r->cpu_est_s / 3600);
    cJSON_AddNumberToObject(j, "cpu_unknown_sessions", r->cpu_unknown);
    cJSON_AddItemToObject(j, "cost", num_or_null(cmp_cost(o, r)));
    cJSON_AddItemToObject(j, "energy_j", r->energy_n ? cJSON_CreateNumber(r->energy_j) : cJSON_CreateNull());
    cJSON_AddItemToObject(j, "energy_all_machines_j",
                          r->energy_n ? cJSON_CreateNumber(r->energy_est_j) : cJSON_CreateNull());
    cJSON_AddNumberToObject(j, "energy_unknown_sessions", r->energy_unknown);
    cJSON_AddStringToObject(j, "energy_unavailable", r->energy_n ? "" : r->energy_note);
    cJSON *ss = cJSON_AddArrayToObject(j, "sessions");
    for (int k = 0; k < r->n_sessions; k++) {
        const run_session *s = &r->s[k];
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "launch", s->launch);
        cJSON_AddNumberToObject(x, "end", s->end);
        cJSON_AddStringToObject(x, "reason", s->reason);
        cJSON_AddNumberToObject(x, "world", s->world);
        cJSON_AddNumberToObject(x, "machines", s->machines);
        cJSON_AddNumberToObject(x, "threads", s->threads);
        cJSON_AddNumberToObject(x, "start_step", s->start_step);
        cJSON_AddNumberToObject(x, "end_step", s->end_step);
        cJSON_AddNumberToObject(x, "downtime_s", s->downtime_s);
        cJSON_AddNumberToObject(x, "startup_s", s->startup_s);
        cJSON_AddNumberToObject(x, "load_s", s->load_s);
        cJSON_AddNumberToObject(x, "redone_steps", s->redone_steps);
        cJSON_AddItemToObject(x, "cpu_s", num_or_null(s->cpu_s));
        cJSON_AddItemToObject(x, "energy_j", num_or_null(s->energy_j));
        cJSON_AddItemToArray(ss, x);
    }
    return j;
}

static cJSON *restore_json(const cmp_restore *r) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddBoolToObject(j, "checked", r->checked);
    cJSON_AddBoolToObject(j, "ok", r->checked && r->ok);
    cJSON_AddNumberToObject(j, "step", r->step);
    cJSON_AddNumberToObject(j, "own_world", r->own_world);
    cJSON_AddNumberToObject(j, "other_world", r->other_world);
    cJSON_AddItemToObject(j, "own_loss", num_or_null(r->own_loss));
    cJSON_AddItemToObject(j, "other_loss", num_or_null(r->other_loss));
    cJSON_AddItemToObject(j, "rel", num_or_null(r->rel));
    cJSON_AddStringToObject(j, "why", r->why);
    return j;
}

void cmp_print_json(FILE *f, const cmp_opts *o, const cmp_loss *l, const run_summary *ra, const run_summary *rb,
                    const cmp_restore rs[2]) {
    cJSON *j = cJSON_CreateObject();
    cJSON *lj = cJSON_AddObjectToObject(j, "loss");
    cJSON_AddNumberToObject(lj, "n", l->n);
    cJSON_AddNumberToObject(lj, "max_rel", l->max_rel);
    cJSON_AddNumberToObject(lj, "mean_rel", l->mean_rel);
    cJSON_AddNumberToObject(lj, "max_step", l->max_step);
    cJSON_AddNumberToObject(lj, "n_only_a", l->n_only_a);
    cJSON_AddNumberToObject(lj, "n_only_b", l->n_only_b);
    cJSON_AddItemToObject(lj, "tolerance", o->tolerance >= 0 ? cJSON_CreateNumber(o->tolerance) : cJSON_CreateNull());
    cJSON_AddBoolToObject(lj, "within_tolerance", o->tolerance < 0 || !l->n || l->max_rel <= o->tolerance);
    cJSON *steps = cJSON_AddArrayToObject(lj, "steps");
    for (int i = 0; i < l->n; i++) {
        cJSON *x = cJSON_CreateArray();
        cJSON_AddItemToArray(x, cJSON_CreateNumber(l->steps[i]));
        cJSON_AddItemToArray(x, cJSON_CreateNumber(l->a[i]));
        cJSON_AddItemToArray(x, cJSON_CreateNumber(l->b[i]));
        cJSON_AddItemToArray(steps, x);
    }
    cJSON *rj = cJSON_AddArrayToObject(j, "restore");
    cJSON_AddItemToArray(rj, restore_json(&rs[0]));
    cJSON_AddItemToArray(rj, restore_json(&rs[1]));
    cJSON_AddItemToObject(j, "a", run_json(o, o->dir_a, ra));
    cJSON_AddItemToObject(j, "b", run_json(o, o->dir_b, rb));
    cJSON_AddItemToObject(j, "price_per_hour", o->price >= 0 ? cJSON_CreateNumber(o->price) : cJSON_CreateNull());
    cJSON_AddBoolToObject(j, "bill_downtime", o->bill_downtime);
    cJSON_AddNumberToObject(j, "restore_tolerance", o->restore_tol);
    char *s = cJSON_Print(j);
    fprintf(f, "%s\n", s ? s : "{}");
    free(s);
    cJSON_Delete(j);
}
