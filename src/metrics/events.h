/* metrics/events.h: the run's event log, {dump_folder}/events.jsonl.
 *
 * metrics.jsonl says how each logged step went; events.jsonl says what
 * happened to the run as a whole: each start of the process (fresh or
 * resumed, with how long start-up and the checkpoint load took), every
 * checkpoint written, and each exit (done, stopped by a signal, failed),
 * with the wall time, CPU time and, where RAPL is readable, the energy of
 * that session. `ctitan compare` prices a run and counts the time its
 * restarts cost from it; `ctitan report` puts its events on the time axis.
 *
 * One JSON object per line, always with "event" and "time" (Unix seconds,
 * so sessions of one run line up across restarts); the file is only ever
 * appended to (a resume continues it) and flushed after every line, so a
 * killed run keeps every event up to the kill. Written by rank 0.
 * The keys are in docs/formats.md, "events.jsonl". */
#ifndef CT_METRICS_EVENTS_H
#define CT_METRICS_EVENTS_H

#include <stddef.h>

#include "core/err.h"

struct cJSON;
typedef struct ev_log ev_log;

/* Opens path for appending (creating it). NULL with e set on failure. */
ev_log *ev_open(const char *path, ct_err *e);
/* Writes {"event": name, "time": now, ...fields} as one line and flushes;
 * takes ownership of fields (a cJSON object, or NULL). NULL log: frees
 * fields and does nothing, so callers on ranks without a log need no test. */
void ev_write(ev_log *l, const char *name, struct cJSON *fields);
/* Closes; -1 when any write failed. NULL is fine. */
int ev_close(ev_log *l);

/* Seconds since the Unix epoch (the "time" of every event). */
double ev_wall_time(void);
/* CPU seconds (user + system, every thread) this process has used. */
double ev_cpu_seconds(void);

/* The energy counters of the CPU packages (Linux powercap, intel-rapl:N;
 * their subdomains intel-rapl:N:M are parts of them, not counted), in
 * joules. Each wraps at its own max_energy_range_uj, so the energy used is
 * summed domain by domain, each allowed one wrap between readings. The
 * powercap root may be moved by CTITAN_POWERCAP (tests give counters to a
 * machine without them). */
#define EV_RAPL_MAX 16
typedef struct {
    int valid;                  /* the start reading worked */
    int n;                      /* package domains */
    unsigned id[EV_RAPL_MAX];   /* N of intel-rapl:N */
    double joules[EV_RAPL_MAX]; /* the start reading */
    double max_j[EV_RAPL_MAX];  /* each counter's range (its wrap point) */
    char why[256];              /* when !valid: why not */
} ev_energy;
/* Reads every package counter. 0, or -1 with why[] saying what was missing
 * or unreadable (no powercap on a VM, root-only files...). */
int ev_energy_start(ev_energy *s);
/* Joules used since ev_energy_start, or -1 (s->why says why). */
double ev_energy_since(ev_energy *s);
/* Joules between two readings of one counter that wraps at max_j. */
double ev_rapl_delta(double before, double after, double max_j);

#endif
