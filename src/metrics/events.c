/* metrics/events.c: events.jsonl (see events.h). Lines are built with
 * cJSON, so paths and error messages are escaped as JSON wants. */
#include "metrics/events.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

struct ev_log {
    FILE *f;
    int failed;
};

ev_log *ev_open(const char *path, ct_err *e) {
    FILE *f = fopen(path, "a");
    if (!f) {
        ct_fail(e, CT_ERR_IO, "%s: cannot open the event log", path);
        return NULL;
    }
    ev_log *l = calloc(1, sizeof *l);
    if (!l) {
        fclose(f);
        ct_fail(e, CT_ERR_IO, "%s: out of memory", path);
        return NULL;
    }
    l->f = f;
    return l;
}

void ev_write(ev_log *l, const char *name, cJSON *fields) {
    if (!l) {
        cJSON_Delete(fields);
        return;
    }
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "event", name);
    cJSON_AddNumberToObject(o, "time", ev_wall_time());
    if (fields) { /* moved over in order, after event and time */
        while (fields->child) {
            cJSON *it = cJSON_DetachItemViaPointer(fields, fields->child);
            cJSON_AddItemToObject(o, it->string, it);
        }
        cJSON_Delete(fields);
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (!s || fprintf(l->f, "%s\n", s) < 0 || fflush(l->f)) l->failed = 1;
    free(s);
}

int ev_close(ev_log *l) {
    if (!l) return 0;
    int bad = l->failed | (fclose(l->f) != 0);
    free(l);
    return bad ? -1 : 0;
}

double ev_wall_time(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double ev_cpu_seconds(void) {
    struct rusage r;
    if (getrusage(RUSAGE_SELF, &r)) return 0;
    return r.ru_utime.tv_sec + r.ru_stime.tv_sec + (r.ru_utime.tv_usec + r.ru_stime.tv_usec) * 1e-6;
}

/* A counter file's value (micro-joules), or -1. */
static double read_uj(const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    unsigned long long v;
    int ok = fscanf(f, "%llu", &v) == 1;
    fclose(f);
    return ok ? (double)v : -1;
}

/* Sums energy_uj (or max_energy_range_uj) over the package domains,
 * intel-rapl:N (their subdomains intel-rapl:N:M are parts of them). The
 * powercap root may be moved by CTITAN_POWERCAP, so tests can give counters
 * to a machine without them. */
static int rapl_sum(const char *file, double *joules, char *why, size_t cap) {
    const char *root = getenv("CTITAN_POWERCAP");
    if (!root || !*root) root = "/sys/class/powercap";
    DIR *d = opendir(root);
    if (!d) {
        snprintf(why, cap, "%s is missing (no RAPL power counters on this machine)", root);
        return -1;
    }
    double sum = 0;
    int n = 0, bad = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        unsigned a;
        char rest;
        if (sscanf(de->d_name, "intel-rapl:%u%c", &a, &rest) != 1) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s/%s", root, de->d_name, file);
        double v = read_uj(path);
        if (v < 0) {
            if (!bad) snprintf(why, cap, "%s is not readable (RAPL counters are often root-only)", path);
            bad = 1;
            continue;
        }
        sum += v;
        n++;
    }
    closedir(d);
    if (bad) return -1;
    if (!n) {
        snprintf(why, cap, "%s has no intel-rapl package domains", root);
        return -1;
    }
    *joules = sum * 1e-6;
    return 0;
}

int ev_rapl_joules(double *joules, char *why, size_t cap) { return rapl_sum("energy_uj", joules, why, cap); }

double ev_rapl_delta(double before, double after, double max_j) {
    return after >= before ? after - before : after + max_j - before;
}

void ev_energy_start(ev_energy *s) {
    memset(s, 0, sizeof *s);
    if (ev_rapl_joules(&s->joules, s->why, sizeof s->why)) return;
    if (rapl_sum("max_energy_range_uj", &s->max_j, s->why, sizeof s->why)) return;
    s->valid = 1;
}

double ev_energy_since(ev_energy *s) {
    double now;
    if (!s->valid) return -1;
    if (ev_rapl_joules(&now, s->why, sizeof s->why)) return -1;
    return ev_rapl_delta(s->joules, now, s->max_j);
}
