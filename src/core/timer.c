/* core/timer.c: the one clock of the run's timings (steps, kernels' tuning,
 * progress). CLOCK_MONOTONIC, not the wall clock: a time-of-day change or an
 * NTP step during a run must not make a step look negative or hours long. */
#define _POSIX_C_SOURCE 200809L
#include "core/timer.h"

#include <time.h>

double ct_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
