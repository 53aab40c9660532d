/* tests/c/check.h: the smallest test harness that can fail.
 *
 * CHECK(cond, fmt, ...) records a failure with file:line and goes on;
 * CHECK_DONE() prints "N passed, M failed" for the file's checks and returns
 * the exit status. Each tests/c/MODULE/test_*.c is its own program. */
#ifndef CT_TESTS_CHECK_H
#define CT_TESTS_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int check_pass_, check_fail_;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        if (cond) {                                                        \
            check_pass_++;                                                 \
        } else {                                                           \
            check_fail_++;                                                 \
            fprintf(stderr, "%s:%d: FAILED: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
        }                                                                  \
    } while (0)

#define CHECK_CLOSE(a, b, tol)                                                   \
    CHECK(fabs((double)(a) - (double)(b)) <= (tol) * (1.0 + fabs((double)(b))), \
          "%s = %.9g, %s = %.9g", #a, (double)(a), #b, (double)(b))

#define CHECK_DONE()                                                          \
    (printf("%s: %d checks passed, %d failed\n", __FILE__, check_pass_, check_fail_), \
     check_fail_ ? 1 : (check_pass_ ? 0 : 1))

/* Writes text to dir/name (to name alone when dir is NULL): the hand-made
 * input files of a test. A test cannot go on without its input, so a
 * failure aborts. */
static inline void check_put(const char *dir, const char *name, const char *text) {
    char path[4400];
    snprintf(path, sizeof path, "%s%s%s", dir ? dir : "", dir ? "/" : "", name);
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path);
        abort();
    }
    fputs(text, f);
    fclose(f);
}

#endif
