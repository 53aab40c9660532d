/* tests/c/report/test_run.c: the run's event log and the run-directory reader.
 * Events: every line is JSON that Python-style readers accept (checked with
 * the strict reader), strings with quotes and newlines survive, fields keep
 * their order after event and time; RAPL counters from a fake powercap tree
 * (CTITAN_POWERCAP) add up over package domains only and survive a wrap.
 * The reader: a hand-written run directory comes back value for value, a
 * cut last line is dropped, a bad middle line names file:line. */
#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "core/fs.h"
#include "formats/json.h"
#include "metrics/events.h"
#include "report/run.h"

static char tmp[] = "/tmp/ct_test_run_XXXXXX";

static void test_events(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/ev/events.jsonl", tmp);
    ct_err e = {0};
    CHECK(ev_open(path, &e) == NULL && e.code == CT_ERR_IO && strstr(e.msg, path), "missing folder: %s", e.msg);
    snprintf(path, sizeof path, "%s/events.jsonl", tmp);
    ev_log *l = ev_open(path, &e);
    CHECK(l != NULL, "open");
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "step", 7);
    cJSON_AddStringToObject(o, "message", "a \"quoted\"\nline");
    ev_write(l, "exit", o);
    ev_write(l, "start", NULL);
    ev_write(NULL, "ignored", cJSON_CreateObject()); /* frees, writes nothing */
    CHECK(ev_close(l) == 0, "close");
    size_t len;
    char *text = fs_read_file(path, 0, &len, &e);
    CHECK(text != NULL, "read back");
    if (!text) return;
    char *nl = strchr(text, '\n');
    CHECK(nl && strchr(nl + 1, '\n') && !strchr(strchr(nl + 1, '\n') + 1, '\n'), "two lines: %s", text);
    CHECK(!strncmp(text, "{\"event\":\"exit\",\"time\":", 23), "event and time first: %s", text);
    cJSON *j = nl ? json_parse(text, (size_t)(nl - text), "line 1", &e) : NULL;
    CHECK(j != NULL, "strict JSON: %s", e.msg);
    if (j) {
        const cJSON *m = cJSON_GetObjectItem(j, "message");
        CHECK(cJSON_IsString(m) && !strcmp(m->valuestring, "a \"quoted\"\nline"), "escaped string");
        double t = cJSON_GetObjectItem(j, "time")->valuedouble;
        CHECK(fabs(t - ev_wall_time()) < 60, "time is now: %f", t);
        CHECK(cJSON_GetObjectItem(j, "step")->valueint == 7, "step");
        cJSON_Delete(j);
    }
    free(text);
}

static void mk(const char *rel) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", tmp, rel);
    ct_mkdirs(p, NULL);
}

static void test_rapl(void) {
    char root[512];
    snprintf(root, sizeof root, "%s/powercap", tmp);
    setenv("CTITAN_POWERCAP", root, 1);
    ev_energy s;
    CHECK(ev_energy_start(&s) == -1 && !s.valid && strstr(s.why, root), "no tree: %s", s.why);
    mk("powercap/intel-rapl:0/intel-rapl:0:0");
    mk("powercap/intel-rapl:1");
    mk("powercap/intel-rapl:0:0"); /* a subdomain linked at the top, as Linux does: not counted */
    check_put(tmp, "powercap/intel-rapl:0/energy_uj", "1500000\n");
    check_put(tmp, "powercap/intel-rapl:0/max_energy_range_uj", "10000000\n");
    check_put(tmp, "powercap/intel-rapl:1/max_energy_range_uj", "10000000\n");
    check_put(tmp, "powercap/intel-rapl:0:0/energy_uj", "999000000\n");
    CHECK(ev_energy_start(&s) == -1 && strstr(s.why, "intel-rapl:1"), "unreadable domain: %s", s.why);
    check_put(tmp, "powercap/intel-rapl:1/energy_uj", "2500000\n");
    CHECK(ev_energy_start(&s) == 0 && s.valid && s.n == 2, "start: %s", s.why);
    CHECK(fabs(ev_energy_since(&s)) < 1e-9, "nothing used yet: %g", ev_energy_since(&s));
    check_put(tmp, "powercap/intel-rapl:0/energy_uj", "500000\n"); /* wrapped: 1.5 -> 10 -> 0.5 is 9 J */
    check_put(tmp, "powercap/intel-rapl:1/energy_uj", "3500000\n");
    CHECK(fabs(ev_energy_since(&s) - 10.0) < 1e-9, "9 J + 1 J over a wrap: %g", ev_energy_since(&s));
    CHECK(fabs(ev_rapl_delta(5, 7, 20) - 2) < 1e-12 && fabs(ev_rapl_delta(19, 1, 20) - 2) < 1e-12, "delta");
    unsetenv("CTITAN_POWERCAP");
}

static void test_reader(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/run", tmp);
    ct_mkdirs(dir, NULL);
    check_put(tmp, "run/metrics.jsonl",
        "{\"step\": 1, \"loss\": 11.5, \"grad_norm\": 2, \"lr\": 0.001, \"tps\": 100, \"time\": 1000.5}\n"
        "{\"step\": 2, \"loss\": 10.25, \"lr\": 0.002}\n"
        "{\"step\": 2, \"val_loss\": 10.5, \"val_perplexity\": 36315.5}\n"
        "{\"step\": 3, \"loss\": 9");
    check_put(tmp, "run/events.jsonl",
        "{\"event\":\"start\",\"time\":999,\"step\":0,\"world\":4,\"machines\":2,\"threads\":8,\"cpu\":\"X\"}\n"
        "{\"event\":\"checkpoint\",\"time\":1001,\"step\":2,\"kind\":\"full\",\"save_s\":0.5,\"mib\":3}\n"
        "{\"event\":\"exit\",\"time\":1002,\"step\":2,\"reason\":\"stopped\",\"wall_s\":3,\"cpu_s\":5.5,"
        "\"energy_unavailable\":\"no RAPL\"}\n");
    check_put(tmp, "run/config.toml", "[job]\ndump_folder = \"x\"\n[training]\nsteps = 3\nlr = 0.5\nfreeze = [\"a\", \"b\"]\n");
    run_data r;
    ct_err e = {0};
    CHECK(run_load(&r, dir, &e) == 0, "load: %s", e.msg);
    CHECK(r.n_points == 2 && r.n_vals == 1 && r.n_events == 3 && r.n_config == 4, "counts %d %d %d %d", r.n_points,
          r.n_vals, r.n_events, r.n_config);
    if (r.n_points == 2 && r.n_vals == 1 && r.n_events == 3) {
        CHECK(r.points[0].v[RUN_LOSS] == 11.5 && r.points[1].v[RUN_LOSS] == 10.25, "losses");
        CHECK(r.points[0].v[RUN_TIME] == 1000.5 && isnan(r.points[1].v[RUN_TPS]), "time, a missing key is NaN");
        CHECK(r.vals[0].step == 2 && r.vals[0].loss == 10.5, "validation");
        CHECK(r.events[0].kind == RUN_EV_START && r.events[0].world == 4 && r.events[0].machines == 2 &&
                  r.events[0].threads == 8 && !strcmp(r.events[0].cpu, "X"),
              "start");
        CHECK(r.events[1].kind == RUN_EV_CHECKPOINT && r.events[1].save_s == 0.5 && !strcmp(r.events[1].ckpt_kind, "full"),
              "checkpoint");
        CHECK(r.events[2].kind == RUN_EV_EXIT && !strcmp(r.events[2].reason, "stopped") && r.events[2].cpu_s == 5.5 &&
                  isnan(r.events[2].energy_j) && !strcmp(r.events[2].energy_note, "no RAPL"),
              "exit");
        CHECK(run_last_step(&r) == 2, "last step");
    }
    const char *v = run_setting_get(&r, "training.freeze");
    CHECK(v && !strcmp(v, "[\"a\", \"b\"]"), "array setting: %s", v ? v : "(null)");
    v = run_setting_get(&r, "job.dump_folder");
    CHECK(v && !strcmp(v, "\"x\""), "string setting: %s", v ? v : "(null)");
    CHECK(run_setting_get(&r, "training.nope") == NULL, "absent setting");
    run_free(&r);

    check_put(tmp, "run/metrics.jsonl", "{\"step\": 1, \"loss\": 1}\n{\"step\": 2, \"loss\": }\n{\"step\": 3}\n");
    CHECK(run_load(&r, dir, &e) == CT_ERR_FORMAT && strstr(e.msg, "metrics.jsonl:2"), "bad line: %s", e.msg);
    run_free(&r);
    check_put(tmp, "run/metrics.jsonl", "{\"loss\": 1}\n");
    CHECK(run_load(&r, dir, &e) == CT_ERR_FORMAT && strstr(e.msg, "metrics.jsonl:1") && strstr(e.msg, "step"),
          "no step: %s", e.msg);
    run_free(&r);
    snprintf(dir, sizeof dir, "%s/nothing", tmp);
    CHECK(run_load(&r, dir, &e) == CT_ERR_IO && strstr(e.msg, dir), "missing dir: %s", e.msg);
    run_free(&r);
}

int main(void) {
    if (!mkdtemp(tmp)) return 1;
    test_events();
    test_rapl();
    test_reader();
    ct_rm_tree(tmp, NULL);
    return CHECK_DONE();
}
