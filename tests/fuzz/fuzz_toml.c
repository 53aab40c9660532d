/* Feeds: a run's TOML config (--config FILE) to cfg_parse_args, which parses
 * it (src/formats/toml.c), applies every key to the run's config
 * (src/config/config.c), then to cfg_validate.
 * Why: the TOML is the user's file and the first thing a run reads; every
 * mistake in it must be a config error naming the file and key, not a crash
 * or a value silently cut short. */
#include "fuzz_util.h"
#include "config/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static char *path;
    if (!path) path = fs_join(fz_dir(), "run.toml");
    free(fz_write(fz_dir(), "run.toml", data, size));
    ct_config c;
    cfg_defaults(&c);
    char *argv[] = {"--config", path, NULL};
    ct_err e = {0};
    int rc = cfg_parse_args(&c, 2, argv, &e);
    if (!rc) rc = cfg_validate(&c, &e);
    if (rc && rc != CT_ERR_CONFIG) abort(); /* a bad TOML is the user's config: exit 2 */
    cfg_free(&c);
    return 0;
}
