/* tests/c/report/test_compare.c: compare's arithmetic on hand-written run folders
 * whose answers are worked out by hand below: a killed session whose last
 * sign of life survives only in the next start's metrics_last_* (the resume
 * cut its lines), downtime, redone steps, wall, machine- and core-hours,
 * cost with and without billed downtime, CPU and energy with a session that
 * has no exit; the loss curves' max and mean relative difference, its step,
 * and steps only one run logged; a run without events.jsonl; a resume whose
 * launch reads earlier than the previous session's end (another machine's
 * clock): downtime 0, never negative (docs/compare.md); a step logged twice
 * (a resume that did not cut the file): compared once, with its later loss. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"
#include "report/compare.h"

static char tmp[] = "/tmp/ct_test_compare_XXXXXX";

#define NEAR(a, b) (fabs((a) - (b)) < 1e-9)

static void test_sessions(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/a", tmp);
    ct_mkdirs(dir, NULL);
    /* session 1 (launch 1000) logs steps 1-4, saves step 3, is killed; the
     * resume (launch 1018) cut step 4 from the file and kept its step/time */
    check_put(tmp, "a/metrics.jsonl",
        "{\"step\": 1, \"loss\": 4.0, \"tps\": 10, \"step_time_s\": 3.0, \"tokens_seen\": 64, \"time\": 1003}\n"
        "{\"step\": 2, \"loss\": 3.0, \"tps\": 20, \"step_time_s\": 1.0, \"tokens_seen\": 128, \"time\": 1004}\n"
        "{\"step\": 3, \"loss\": 2.0, \"tps\": 20, \"step_time_s\": 1.0, \"tokens_seen\": 192, \"time\": 1005}\n"
        "{\"step\": 4, \"loss\": 2.0, \"tps\": 40, \"step_time_s\": 0.5, \"tokens_seen\": 256, \"time\": 1021}\n"
        "{\"step\": 5, \"loss\": 1.0, \"tps\": 40, \"step_time_s\": 0.5, \"tokens_seen\": 320, \"time\": 1022}\n"
        "{\"step\": 6, \"loss\": 1.0, \"tps\": 40, \"step_time_s\": 0.5, \"tokens_seen\": 384, \"time\": 1023}\n");
    check_put(tmp, "a/events.jsonl",
        "{\"event\":\"start\",\"time\":1002,\"step\":0,\"launch_time\":1000,\"startup_s\":2,\"world\":4,"
        "\"machines\":2,\"threads\":3}\n"
        "{\"event\":\"checkpoint\",\"time\":1005.5,\"step\":3,\"kind\":\"full\",\"path\":\"x\"}\n"
        "{\"event\":\"start\",\"time\":1020,\"step\":3,\"launch_time\":1018,\"startup_s\":2,\"load_s\":0.5,"
        "\"world\":4,\"machines\":2,\"threads\":3,\"resumed_from\":\"x\",\"metrics_last_step\":4,"
        "\"metrics_last_time\":1006}\n"
        "{\"event\":\"exit\",\"time\":1024,\"reason\":\"done\",\"step\":6,\"wall_s\":6,\"cpu_s\":10,\"energy_j\":500}\n");
    run_data r;
    ct_err e = {0};
    CHECK(run_load(&r, dir, &e) == 0, "load: %s", e.msg);
    run_summary c;
    run_summarise(&r, &c);
    CHECK(c.n_sessions == 2 && c.restarts == 1, "sessions %d", c.n_sessions);
    if (c.n_sessions == 2) {
        CHECK(c.s[0].killed && NEAR(c.s[0].end, 1006) && c.s[0].end_step == 4, "killed: end %f step %d", c.s[0].end,
              c.s[0].end_step);
        CHECK(!c.s[1].killed && NEAR(c.s[1].end, 1024) && c.s[1].start_step == 3, "exit");
        CHECK(NEAR(c.s[1].downtime_s, 12) && c.s[1].redone_steps == 1, "downtime %f redone %d", c.s[1].downtime_s,
              c.s[1].redone_steps);
    }
    /* steps after 1: times 1, 1, .5, .5, .5 -> 0.7; tps 20 20 40 40 40 -> 32; job 64 / time -> 64, 64, 128 x 3 */
    CHECK(NEAR(c.step_time_mean, 0.7) && NEAR(c.tps_mean, 32) && NEAR(c.job_tps_mean, (64 + 64 + 3 * 128) / 5.0),
          "means %f %f %f", c.step_time_mean, c.tps_mean, c.job_tps_mean);
    CHECK(NEAR(c.downtime_s, 12) && NEAR(c.startup_s, 2) && NEAR(c.load_s, 0.5) && c.redone_steps == 1 &&
              NEAR(c.redone_s, 0.7) && NEAR(c.lost_s, 12 + 2 + 0.7),
          "restarts: %f %f %f %d %f %f", c.downtime_s, c.startup_s, c.load_s, c.redone_steps, c.redone_s, c.lost_s);
    CHECK(NEAR(c.wall_s, 12) && NEAR(c.machine_s, 24) && NEAR(c.core_s, 144) && NEAR(c.downtime_machine_s, 24),
          "wall %f machine %f core %f", c.wall_s, c.machine_s, c.core_s);
    CHECK(NEAR(c.cpu_est_s, 40) && c.cpu_unknown == 1, "cpu %f %d", c.cpu_est_s, c.cpu_unknown);
    CHECK(NEAR(c.energy_j, 500) && NEAR(c.energy_est_j, 1000) && c.energy_n == 1 && c.energy_unknown == 1, "energy");
    cmp_opts o = {.price = 3, .tolerance = -1};
    CHECK(NEAR(cmp_cost(&o, &c), 3 * 24 / 3600.0), "cost %f", cmp_cost(&o, &c));
    o.bill_downtime = 1;
    CHECK(NEAR(cmp_cost(&o, &c), 3 * 48 / 3600.0), "cost with downtime %f", cmp_cost(&o, &c));
    o.price = -1;
    CHECK(isnan(cmp_cost(&o, &c)), "no price");

    /* B: the same steps 1-6 but two losses off, and a step 7 A lacks; no events */
    snprintf(dir, sizeof dir, "%s/b", tmp);
    ct_mkdirs(dir, NULL);
    check_put(tmp, "b/metrics.jsonl", "{\"step\": 1, \"loss\": 4.0}\n{\"step\": 2, \"loss\": 3.3}\n{\"step\": 3, \"loss\": 2.0}\n"
                           "{\"step\": 4, \"loss\": 1.5}\n{\"step\": 5, \"loss\": 1.0}\n{\"step\": 6, \"loss\": 1.0}\n"
                           "{\"step\": 7, \"loss\": 0.5}\n");
    run_data rb;
    CHECK(run_load(&rb, dir, &e) == 0, "load b: %s", e.msg);
    cmp_loss l;
    cmp_loss_diff(&r, &rb, &l);
    /* step 2: 0.3 / 3.3; step 4: 0.5 / 2 = 0.25 (the max) */
    CHECK(l.n == 6 && l.max_step == 4 && NEAR(l.max_rel, 0.25) && NEAR(l.mean_rel, (0.3 / 3.3 + 0.25) / 6),
          "loss: n %d step %d max %f mean %f", l.n, l.max_step, l.max_rel, l.mean_rel);
    CHECK(l.n_only_a == 0 && l.n_only_b == 1 && l.only_b[0] == 7, "only");
    CHECK(cmp_rel_diff(0, 0) == 0 && NEAR(cmp_rel_diff(-1, 1), 2), "rel diff");
    run_summary cb;
    run_summarise(&rb, &cb);
    CHECK(cb.n_sessions == 0 && cb.restarts == 0 && cb.wall_s == 0, "no events: no sessions");
    cmp_loss_free(&l);
    run_summary_free(&cb);
    run_summary_free(&c);
    run_free(&rb);
    run_free(&r);
}

static void test_clock_skew_and_repeated_steps(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/c", tmp);
    ct_mkdirs(dir, NULL);
    /* session 1 (launch 2000) exits at 2010 after step 4; session 2 was launched on a machine
     * whose clock reads 2008 then; step 2 is in the file twice, 3.3 then 3.0 */
    check_put(tmp, "c/metrics.jsonl",
        "{\"step\": 1, \"loss\": 4.0, \"step_time_s\": 1.0, \"time\": 2003}\n"
        "{\"step\": 2, \"loss\": 3.3, \"step_time_s\": 1.0, \"time\": 2004}\n"
        "{\"step\": 2, \"loss\": 3.0, \"step_time_s\": 1.0, \"time\": 2005}\n"
        "{\"step\": 3, \"loss\": 2.0, \"step_time_s\": 1.0, \"time\": 2006}\n");
    check_put(tmp, "c/events.jsonl",
        "{\"event\":\"start\",\"time\":2001,\"step\":0,\"launch_time\":2000,\"startup_s\":1}\n"
        "{\"event\":\"exit\",\"time\":2010,\"reason\":\"stopped\",\"step\":4}\n"
        "{\"event\":\"start\",\"time\":2009,\"step\":4,\"launch_time\":2008,\"startup_s\":1}\n"
        "{\"event\":\"exit\",\"time\":2020,\"reason\":\"done\",\"step\":8}\n");
    run_data r;
    ct_err e = {0};
    CHECK(run_load(&r, dir, &e) == 0, "load: %s", e.msg);
    run_summary c;
    run_summarise(&r, &c);
    CHECK(c.n_sessions == 2 && NEAR(c.s[1].downtime_s, 0) && NEAR(c.downtime_s, 0) && NEAR(c.downtime_machine_s, 0),
          "a launch 2 s before the previous end: downtime %g (total %g), want 0", c.n_sessions == 2 ? c.s[1].downtime_s : NAN,
          c.downtime_s);
    CHECK(NEAR(c.lost_s, 1), "lost: the restart's start-up alone, %g", c.lost_s);

    snprintf(dir, sizeof dir, "%s/d", tmp);
    ct_mkdirs(dir, NULL);
    check_put(tmp, "d/metrics.jsonl", "{\"step\": 1, \"loss\": 4.0}\n{\"step\": 2, \"loss\": 3.0}\n{\"step\": 3, \"loss\": 2.0}\n");
    run_data rd;
    CHECK(run_load(&rd, dir, &e) == 0, "load d: %s", e.msg);
    cmp_loss l;
    cmp_loss_diff(&r, &rd, &l);
    CHECK(l.n == 3 && l.n_only_a == 0 && l.n_only_b == 0, "steps 1-3 once each: n %d, only in A %d, only in B %d", l.n,
          l.n_only_a, l.n_only_b);
    CHECK(l.n >= 2 && l.steps[1] == 2 && l.a[1] == 3.0 && l.max_rel == 0,
          "step 2 compared with its later loss 3.0: %g (max relative difference %g)", l.n >= 2 ? l.a[1] : NAN, l.max_rel);
    cmp_loss_free(&l);
    run_summary_free(&c);
    run_free(&rd);
    run_free(&r);
}

int main(void) {
    if (!mkdtemp(tmp)) return 1;
    test_sessions();
    test_clock_skew_and_repeated_steps();
    ct_rm_tree(tmp, NULL);
    return CHECK_DONE();
}
