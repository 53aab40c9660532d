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

static const char *powercap_root(void) {
    const char *root = getenv("CTITAN_POWERCAP");
    return root && *root ? root : "/sys/class/powercap";
}

/* file (energy_uj or max_energy_range_uj) of every package domain into
 * out[] (joules), ids[] in directory order; the count, or -1. */
static int read_domains(const char *file, unsigned *ids, double *out, char *why, size_t cap) {
    const char *root = powercap_root();
    DIR *d = opendir(root);
    if (!d) {
        snprintf(why, cap, "%.100s is missing (no RAPL power counters on this machine)", root);
        return -1;
    }
    int n = 0, bad = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < EV_RAPL_MAX) {
        unsigned a;
        char rest;
        if (sscanf(de->d_name, "intel-rapl:%u%c", &a, &rest) != 1) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s/%s", root, de->d_name, file);
        double v = read_uj(path);
        if (v < 0) {
            if (!bad) snprintf(why, cap, "%.120s is not readable (RAPL counters are often root-only)", path);
            bad = 1;
            continue;
        }
        ids[n] = a;
        out[n++] = v * 1e-6;
    }
    closedir(d);
    if (bad) return -1;
    if (!n) {
        snprintf(why, cap, "%.100s has no intel-rapl package domains", root);
        return -1;
    }
    return n;
}

double ev_rapl_delta(double before, double after, double max_j) {
    return after >= before ? after - before : after + max_j - before;
}

int ev_energy_start(ev_energy *s) {
    memset(s, 0, sizeof *s);
    unsigned ids[EV_RAPL_MAX];
    if ((s->n = read_domains("energy_uj", s->id, s->joules, s->why, sizeof s->why)) < 0) return -1;
    if (read_domains("max_energy_range_uj", ids, s->max_j, s->why, sizeof s->why) != s->n ||
        memcmp(ids, s->id, sizeof(unsigned) * s->n)) {
        if (!s->why[0]) snprintf(s->why, sizeof s->why, "%.100s: the RAPL domains changed while reading", powercap_root());
        return -1;
    }
    s->valid = 1;
    return 0;
}

double ev_energy_since(ev_energy *s) {
    if (!s->valid) return -1;
    unsigned ids[EV_RAPL_MAX];
    double now[EV_RAPL_MAX];
    if (read_domains("energy_uj", ids, now, s->why, sizeof s->why) != s->n || memcmp(ids, s->id, sizeof(unsigned) * s->n)) {
        if (!s->why[0]) snprintf(s->why, sizeof s->why, "%.100s: the RAPL domains changed during the run", powercap_root());
        return -1;
    }
    double sum = 0;
    for (int i = 0; i < s->n; i++) sum += ev_rapl_delta(s->joules[i], now[i], s->max_j[i]);
    return sum;
}
