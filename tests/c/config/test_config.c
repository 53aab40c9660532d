/* tests/c/config/test_config.c: defaults, file-then-CLI precedence, every override
 * spelling, each error class (CT_ERR_CONFIG, message naming key and file),
 * the cfg_write_toml round trip, and that every TOML file in configs/ loads. Runs
 * from the repository root. Temp files go under /tmp and are removed. */
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "config/config.h"

/* Writes `text` to a fresh temp file; the caller removes it. */
static void write_tmp(char *path, const char *text) {
    strcpy(path, "/tmp/ct_test_config_XXXXXX.toml");
    int fd = mkstemps(path, 5);
    if (fd < 0) {
        perror("mkstemps");
        exit(1);
    }
    FILE *f = fdopen(fd, "w");
    fputs(text, f);
    fclose(f);
}

/* Parses argv (NULL-terminated) on top of defaults. */
static int parse(ct_config *c, ct_err *e, const char **argv) {
    int argc = 0;
    while (argv[argc]) argc++;
    cfg_defaults(c);
    memset(e, 0, sizeof *e);
    return cfg_parse_args(c, argc, (char **)argv, e);
}

static void test_defaults(void) {
    ct_config c;
    cfg_defaults(&c);
    CHECK(strcmp(c.dump_folder, "./outputs") == 0, "dump_folder");
    CHECK(strcmp(c.description, "") == 0, "description");
    CHECK(strcmp(c.model_spec, "qwen3") == 0, "spec");
    CHECK(strcmp(c.model_flavor, "debugmodel") == 0, "flavor");
    CHECK(strcmp(c.hf_assets_path, "") == 0, "hf_assets_path");
    CHECK(strcmp(c.opt_name, "AdamW") == 0, "opt name");
    CHECK(c.lr == 8e-4 && c.eps == 1e-8 && c.weight_decay == 0.1, "optimizer numbers");
    CHECK(c.beta1 == 0.9 && c.beta2 == 0.95, "betas");
    CHECK(c.warmup_steps == 200 && c.decay_ratio == -1 && c.min_lr_factor == 0.0, "sched");
    CHECK(strcmp(c.decay_type, "linear") == 0, "decay_type");
    CHECK(c.local_batch_size == 8 && c.global_batch_size == -1 && c.seq_len == 2048, "batch");
    CHECK(c.max_norm == 1.0 && c.steps == 10000 && c.seed == 0, "training");
    CHECK(strcmp(c.dataset, "auto") == 0 && strcmp(c.dataset_path, "") == 0, "dataset");
    CHECK(c.deterministic == 0 && c.threads == 0, "deterministic/threads");
    CHECK(c.ckpt_enable == 0 && strcmp(c.ckpt_folder, "checkpoint") == 0, "ckpt");
    CHECK(c.ckpt_interval == 500 && strcmp(c.initial_load_path, "") == 0, "ckpt 2");
    CHECK(c.initial_load_in_hf == 0 && c.last_save_in_hf == 0, "ckpt hf");
    CHECK(c.load_step == -1 && c.ckpt_fallback == 1, "ckpt resume defaults");
    CHECK(strcmp(c.export_dtype, "float32") == 0, "export_dtype");
    CHECK(c.log_freq == 10 && strcmp(c.metrics_file, "metrics.jsonl") == 0, "metrics");
    CHECK(c.peak_tflops == 0.0, "peak_tflops");
    CHECK(c.enable_tensorboard == 0 && strcmp(c.save_tb_folder, "tb") == 0, "tensorboard");
    CHECK(strcmp(c.config_path, "") == 0, "config_path");
    ct_err e;
    CHECK(cfg_validate(&c, &e) == 0, "defaults validate: %s", e.msg);
    cfg_free(&c);
    cfg_free(&c); /* safe twice */

    /* No arguments at all: defaults survive. */
    const char *none[] = {NULL};
    CHECK(parse(&c, &e, none) == 0 && c.steps == 10000, "empty argv");
    cfg_free(&c);
}

static void test_precedence_and_spellings(void) {
    char path[64];
    write_tmp(path, "# test\n[training]\nsteps = 100\nseq_len = 64\ndeterministic = true\n"
                    "[optimizer]\nlr = 1e-3\nweight_decay = 2   # an integer is fine for a float\n"
                    "[job]\ndescription = \"from file\"\n");
    ct_config c;
    ct_err e;
    char cfgeq[96];
    snprintf(cfgeq, sizeof cfgeq, "--config=%s", path);

    /* Override before --config still wins: the file is applied first. */
    const char *a1[] = {"--training.steps=7", "--config", path, "--training.seq_len", "128",
                        "--job.description=cli", "--job.description", "cli2", NULL};
    CHECK(parse(&c, &e, a1) == 0, "a1: %s", e.msg);
    CHECK(c.steps == 7 && c.seq_len == 128, "CLI beats file: steps %d seq %d", c.steps, c.seq_len);
    CHECK(c.lr == 1e-3 && c.weight_decay == 2.0 && c.deterministic == 1, "file values");
    CHECK(strcmp(c.description, "cli2") == 0, "last override wins, old string freed");
    CHECK(strcmp(c.config_path, path) == 0, "config_path recorded");
    cfg_free(&c);

    /* --config=FILE and torchtitan's --job.config_file alias. */
    const char *a2[] = {cfgeq, NULL};
    CHECK(parse(&c, &e, a2) == 0 && c.steps == 100 && strcmp(c.description, "from file") == 0,
          "--config=: %s", e.msg);
    cfg_free(&c);
    const char *a3[] = {"--job.config_file", path, "--optimizer.lr=2e-4", NULL};
    CHECK(parse(&c, &e, a3) == 0 && c.steps == 100 && c.lr == 2e-4, "alias: %s", e.msg);
    cfg_free(&c);

    /* Bare booleans: true; a following literal true/false is consumed. */
    const char *a4[] = {"--checkpoint.enable", "--training.steps=3", "--training.deterministic",
                        "false", "--checkpoint.last_save_in_hf", "true", NULL};
    CHECK(parse(&c, &e, a4) == 0, "a4: %s", e.msg);
    CHECK(c.ckpt_enable == 1 && c.steps == 3 && c.deterministic == 0 && c.last_save_in_hf == 1,
          "bare bools");
    cfg_free(&c);
    const char *a5[] = {cfgeq, "--training.deterministic=false", "--checkpoint.enable", NULL};
    CHECK(parse(&c, &e, a5) == 0 && c.deterministic == 0 && c.ckpt_enable == 1, "bool =false");
    cfg_free(&c);

    /* Every type from the command line, including negative and int64. */
    const char *a6[] = {"--training.seed=-9000000000", "--training.global_batch_size", "-1",
                        "--lr_scheduler.decay_ratio=0.25", "--model.spec", "hf",
                        "--model.hf_assets_path=/x", "--checkpoint.export_dtype=bfloat16",
                        "--job.description=", "--training.local_batch_size=4",
                        "--training.global_batch_size=16", NULL};
    CHECK(parse(&c, &e, a6) == 0, "a6: %s", e.msg);
    CHECK(c.seed == -9000000000LL && c.decay_ratio == 0.25 && c.global_batch_size == 16,
          "typed values");
    CHECK(strcmp(c.model_spec, "hf") == 0 && strcmp(c.export_dtype, "bfloat16") == 0, "enums");
    CHECK(strcmp(c.description, "") == 0, "empty string value");
    cfg_free(&c);

    /* cfg_set, the library spelling. */
    cfg_defaults(&c);
    CHECK(cfg_set(&c, "training.steps", "20", &e) == 0 && c.steps == 20, "cfg_set");
    CHECK(cfg_set(&c, "training.steps", "x", &e) == CT_ERR_CONFIG, "cfg_set bad");
    CHECK(cfg_set(&c, "nodot", "x", &e) == CT_ERR_CONFIG, "cfg_set no dot");
    cfg_free(&c);
    remove(path);
}

/* Expects failure with CT_ERR_CONFIG and every `want` substring in the
 * message. */
static void expect_fail(const char *label, const char **argv, const char *w1, const char *w2,
                        const char *w3) {
    ct_config c;
    ct_err e;
    int rc = parse(&c, &e, argv);
    CHECK(rc == CT_ERR_CONFIG, "%s: rc %d (%s)", label, rc, e.msg);
    const char *w[] = {w1, w2, w3};
    for (int k = 0; k < 3; k++)
        if (w[k]) CHECK(strstr(e.msg, w[k]) != NULL, "%s: want '%s' in '%s'", label, w[k], e.msg);
    cfg_free(&c);
}

/* A config file holding `text`, loaded alone; the message must name the
 * file, and w1/w2. */
static void expect_file_fail(const char *label, const char *text, const char *w1,
                             const char *w2) {
    char path[64];
    write_tmp(path, text);
    const char *argv[] = {"--config", path, NULL};
    expect_fail(label, argv, path, w1, w2);
    remove(path);
}

static void test_errors(void) {
    /* In the file. */
    expect_file_fail("unknown section", "[trainingg]\nsteps = 1\n", "[trainingg]",
                     "did you mean [training]");
    expect_file_fail("short unknown section", "[foo]\n", "[foo]", "known sections");
    expect_file_fail("unknown section far", "[zzz]\n", "[zzz]", "known sections: job, model");
    expect_file_fail("unknown key", "[training]\nstepz = 1\n", "training.stepz",
                     "did you mean training.steps");
    expect_file_fail("key in wrong section", "[training]\nlr = 1\n", "training.lr",
                     "did you mean optimizer.lr");
    expect_file_fail("root key", "steps = 1\n", "steps", "outside any [section]");
    expect_file_fail("float for int", "[training]\n\nsteps = 1.5\n", ":3: training.steps",
                     "expected an integer, got a float");
    expect_file_fail("string for int", "[training]\nsteps = \"10\"\n", "training.steps",
                     "got a string");
    expect_file_fail("string for float", "[optimizer]\nlr = \"1e-3\"\n", "optimizer.lr",
                     "expected a number");
    expect_file_fail("int for bool", "[training]\ndeterministic = 1\n", "training.deterministic",
                     "expected a boolean");
    expect_file_fail("int for enum", "[model]\nspec = 3\n", "model.spec", "expected a string");
    expect_file_fail("int for string", "[job]\ndump_folder = 3\n", "job.dump_folder",
                     "expected a string");
    expect_file_fail("array for int", "[training]\nsteps = [1]\n", "training.steps",
                     "an array");
    expect_file_fail("too big for int", "[training]\nsteps = 3000000000\n", "training.steps",
                     "32-bit");
    expect_file_fail("range >=1", "[training]\nsteps = 0\n", "training.steps", "must be >= 1");
    expect_file_fail("range [0,1)", "[optimizer]\nbeta2 = 1.0\n", "optimizer.beta2",
                     "must be in [0, 1)");
    expect_file_fail("range >0", "[optimizer]\neps = 0\n", "optimizer.eps", "must be > 0");
    expect_file_fail("range nan", "[optimizer]\nlr = nan\n", "optimizer.lr", "finite");
    expect_file_fail("decay_ratio", "[lr_scheduler]\ndecay_ratio = 1.5\n",
                     "lr_scheduler.decay_ratio", "-1 (unset) or in [0, 1]");
    expect_file_fail("decay_ratio neg", "[lr_scheduler]\ndecay_ratio = -0.5\n",
                     "lr_scheduler.decay_ratio", "in [0, 1]");
    expect_file_fail("global batch -2", "[training]\nglobal_batch_size = -2\n",
                     "training.global_batch_size", "-1 (unset) or >= 1");
    expect_file_fail("enum", "[lr_scheduler]\ndecay_type = \"exp\"\n", "lr_scheduler.decay_type",
                     "'exp' is not one of: linear, sqrt, cosine");
    expect_file_fail("syntax", "[training]\nsteps = 1\nsteps = 2\n", ":3: duplicate key",
                     NULL);
    expect_file_fail("cross batch",
                     "[training]\nlocal_batch_size = 8\nglobal_batch_size = 12\n",
                     "training.global_batch_size (12)", "training.local_batch_size (8)");
    expect_file_fail("hf needs path", "[model]\nspec = \"hf\"\n", "model.hf_assets_path",
                     "model.spec");

    /* On the command line. */
    const char *m1[] = {"--config", "/nonexistent/ct.toml", NULL};
    expect_fail("missing file", m1, "/nonexistent/ct.toml", "cannot read", NULL);
    const char *m2[] = {"train.toml", NULL};
    expect_fail("positional", m2, "command line", "'train.toml'", NULL);
    const char *m3[] = {"-x", NULL};
    expect_fail("single dash", m3, "command line", "'-x'", NULL);
    const char *m4[] = {"--training.steps", NULL};
    expect_fail("missing value at end", m4, "command line", "training.steps", "missing value");
    const char *m5[] = {"--training.steps", "--training.seq_len=1", NULL};
    expect_fail("missing value before option", m5, "training.steps", "missing value", NULL);
    const char *m6[] = {"--config", NULL};
    expect_fail("config missing value", m6, "--config", "missing value", NULL);
    const char *m7[] = {"--training.steps=12abc", NULL};
    expect_fail("trailing junk", m7, "command line: training.steps", "'12abc'", NULL);
    const char *m8[] = {"--training.steps=99999999999", NULL};
    expect_fail("int overflow", m8, "training.steps", "32-bit", NULL);
    const char *m9[] = {"--training.seed=99999999999999999999", NULL};
    expect_fail("int64 overflow", m9, "training.seed", "64 bits", NULL);
    const char *m10[] = {"--optimizer.lr=abc", NULL};
    expect_fail("bad float", m10, "optimizer.lr", "expected a number", NULL);
    const char *m11[] = {"--optimizer.lr= 1", NULL};
    expect_fail("leading space", m11, "optimizer.lr", "expected a number", NULL);
    const char *m12[] = {"--optimizer.lr=inf", NULL};
    expect_fail("inf", m12, "optimizer.lr", "finite", NULL);
    const char *m13[] = {"--training.deterministic=yes", NULL};
    expect_fail("bad bool", m13, "training.deterministic", "true or false", NULL);
    const char *m14[] = {"--model.spec=Qwen3", NULL};
    expect_fail("bad enum", m14, "model.spec", "not one of: qwen3, hf", NULL);
    const char *m15[] = {"--trainin.steps=1", NULL};
    expect_fail("unknown section cli", m15, "command line", "trainin.steps",
                "did you mean training.steps");
    const char *m16[] = {"--training.stepz=1", NULL};
    expect_fail("unknown key cli", m16, "command line", "training.stepz",
                "did you mean training.steps");
    const char *m17[] = {"--steps=1", NULL};
    expect_fail("no section cli", m17, "unknown option --steps", "training.steps", NULL);
    const char *m18[] = {"--training.local_batch_size=4", "--training.global_batch_size=6", NULL};
    expect_fail("cross batch cli", m18, "training.global_batch_size",
                "training.local_batch_size", NULL);
    const char *m19[] = {"--training.steps=", NULL};
    expect_fail("empty int", m19, "training.steps", "expected an integer", NULL);
    const char *m20[] = {"--optimizer.weight_decay=-0.1", NULL};
    expect_fail("negative wd", m20, "optimizer.weight_decay", ">= 0", NULL);
    const char *m21[] = {"--", NULL};
    expect_fail("bare --", m21, "command line", "unexpected argument", NULL);

    char p1[64], p2[64];
    write_tmp(p1, "");
    write_tmp(p2, "");
    const char *m22[] = {"--config", p1, "--config", p2, NULL};
    expect_fail("config twice", m22, "given twice", p1, p2);
    remove(p1);
    remove(p2);
    /* validation.steps' range (positive or -1) holds with validation off too: a config.toml
     * written with 0 would fail only on the run that turns validation on */
    const char *m23[] = {"--validation.steps=0", NULL};
    expect_fail("validation.steps 0, validation off", m23, "command line", "validation.steps", NULL);
    /* torchtitan's expert tensor parallel degree: 1 or the tensor parallel degree (--help's
     * rule); the second was refused by a check that compared it with 1 alone */
    const char *ok_etp[] = {"--parallelism.tensor_parallel_degree=2", "--parallelism.expert_tensor_parallel_degree=2",
                            NULL};
    ct_config ce;
    ct_err ee;
    CHECK(parse(&ce, &ee, ok_etp) == 0, "etp = tp = 2 is taken: %s", ee.msg);
    cfg_free(&ce);
    const char *m24[] = {"--parallelism.tensor_parallel_degree=2", "--parallelism.expert_tensor_parallel_degree=3",
                         NULL};
    expect_fail("etp 3 with tp 2", m24, "parallelism.expert_tensor_parallel_degree = 3", "only 1 or 2", NULL);

    /* cfg_validate also catches fields set directly through the struct. */
    ct_config c;
    ct_err e;
    cfg_defaults(&c);
    c.local_batch_size = 0;
    CHECK(cfg_validate(&c, &e) == CT_ERR_CONFIG && strstr(e.msg, "training.local_batch_size"),
          "validate direct field: %s", e.msg);
    c.local_batch_size = 8;
    free(c.decay_type);
    c.decay_type = strdup("exp");
    CHECK(cfg_validate(&c, &e) == CT_ERR_CONFIG && strstr(e.msg, "lr_scheduler.decay_type"),
          "validate enum: %s", e.msg);
    cfg_free(&c);
}

static char *dump(const ct_config *c) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    cfg_write_toml(c, f);
    fclose(f);
    return buf;
}

static void test_round_trip(void) {
    const char *set[] = {"--job.description=quote \" back \\ nl\n tab\t ctl\x01 us\x1f del\x7f utf8 \xc3\xa9",
                         "--job.dump_folder=/tmp/x y",
                         "--model.spec=hf",
                         "--model.hf_assets_path=hf/Qwen3-0.6B",
                         "--optimizer.lr=3e-4",
                         "--optimizer.eps=1e-12",
                         "--optimizer.weight_decay=0",
                         "--optimizer.beta1=0.8999999999999999",
                         "--lr_scheduler.warmup_steps=0",
                         "--lr_scheduler.decay_ratio=0.1",
                         "--lr_scheduler.decay_type=cosine",
                         "--lr_scheduler.min_lr_factor=0.1",
                         "--training.local_batch_size=3",
                         "--training.global_batch_size=9",
                         "--training.seed=-1234567890123",
                         "--training.deterministic",
                         "--training.threads=2",
                         "--training.max_norm=0",
                         "--checkpoint.enable",
                         "--checkpoint.initial_load_in_hf",
                         "--checkpoint.export_dtype=float16",
                         "--metrics.file=",
                         "--metrics.peak_tflops=459.5",
                         NULL};
    ct_config a, b;
    ct_err e;
    CHECK(parse(&a, &e, set) == 0, "round trip setup: %s", e.msg);
    char path[64];
    write_tmp(path, "");
    FILE *f = fopen(path, "w");
    cfg_write_toml(&a, f);
    fclose(f);
    const char *argv[] = {"--config", path, NULL};
    int rc = parse(&b, &e, argv);
    CHECK(rc == 0, "re-read failed: %s", e.msg);
    CHECK(strcmp(a.description, b.description) == 0, "description round trip: [%s]",
          b.description);
    CHECK(a.lr == b.lr && a.eps == b.eps && a.beta1 == b.beta1 && a.min_lr_factor == b.min_lr_factor,
          "doubles exact");
    CHECK(b.seed == -1234567890123LL && b.deterministic && b.ckpt_enable && b.max_norm == 0,
          "other types");
    CHECK(strcmp(b.metrics_file, "") == 0 && strcmp(b.model_spec, "hf") == 0, "strings");
    /* Every option, via the table: the two dumps agree after the header. */
    char *da = dump(&a), *db = dump(&b);
    const char *ba = strchr(da, '\n'), *bb = strchr(db, '\n');
    CHECK(ba && bb && strcmp(ba, bb) == 0, "dumps differ:\n%s\n---\n%s", da, db);
    CHECK(strstr(da, "lr = 0.0003\n") && strstr(da, "max_norm = 0.0\n") &&
              strstr(da, "[lr_scheduler]\n"), "dump text:\n%s", da);
    free(da);
    free(db);

    /* Defaults round trip too (decay_ratio -1 = unset). */
    cfg_free(&a);
    cfg_free(&b);
    cfg_defaults(&a);
    f = fopen(path, "w");
    cfg_write_toml(&a, f);
    fclose(f);
    CHECK(parse(&b, &e, argv) == 0 && b.decay_ratio == -1 && b.lr == 8e-4, "defaults: %s",
          e.msg);
    cfg_free(&a);
    cfg_free(&b);
    remove(path);
}

/* List options ([training] freeze, [lora] target_modules / modules_to_save): a TOML
 * array of strings or "a,b" on the command line, kept comma-joined, dumped as an array
 * that reads back the same; anything but non-empty strings without commas is refused. */
static void test_lists(void) {
    char path[64];
    write_tmp(path, "[training]\nfreeze = [\"model.embed_tokens.weight\", \"model.layers.*.mlp.*\"]\n"
                    "[lora]\nrank = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\nmodules_to_save = []\n");
    const char *argv[] = {"--config", path, NULL};
    ct_config a, b;
    ct_err e;
    CHECK(parse(&a, &e, argv) == 0, "lists: %s", e.msg);
    CHECK(strcmp(a.freeze, "model.embed_tokens.weight,model.layers.*.mlp.*") == 0, "freeze [%s]", a.freeze);
    CHECK(strcmp(a.lora_targets, "q_proj,v_proj") == 0 && a.lora_rank == 8, "targets [%s]", a.lora_targets);
    CHECK(strcmp(a.lora_modules_to_save, "") == 0, "empty array [%s]", a.lora_modules_to_save);
    char item[64];
    const char *p = cfg_list_next(a.lora_targets, item, sizeof item);
    CHECK(p && strcmp(item, "q_proj") == 0, "first item [%s]", item);
    p = cfg_list_next(p, item, sizeof item);
    CHECK(p && strcmp(item, "v_proj") == 0, "second item [%s]", item);
    CHECK(cfg_list_next(p, item, sizeof item) == NULL, "end of list");
    char *d = dump(&a);
    CHECK(strstr(d, "freeze = [\"model.embed_tokens.weight\", \"model.layers.*.mlp.*\"]\n") != NULL &&
              strstr(d, "modules_to_save = []\n") != NULL,
          "dump:\n%s", d);
    FILE *f = fopen(path, "w");
    fputs(d, f);
    fclose(f);
    free(d);
    CHECK(parse(&b, &e, argv) == 0 && strcmp(b.freeze, a.freeze) == 0 && strcmp(b.lora_targets, a.lora_targets) == 0,
          "list round trip: %s", e.msg);
    cfg_free(&a);
    cfg_free(&b);
    const char *cli[] = {"--lora.target_modules=k_proj,o_proj", NULL};
    CHECK(parse(&a, &e, cli) == 0 && strcmp(a.lora_targets, "k_proj,o_proj") == 0, "cli list [%s]", a.lora_targets);
    cfg_free(&a);
    /* blanks around an item are not part of it, as Python's [s.strip() for s in
     * "q_proj , v_proj".split(",")] reads the list: ["q_proj", "v_proj"] */
    const char *spaced[] = {"--lora.target_modules=q_proj , v_proj", NULL};
    CHECK(parse(&a, &e, spaced) == 0, "spaced cli list: %s", e.msg);
    p = cfg_list_next(a.lora_targets, item, sizeof item);
    CHECK(p && strcmp(item, "q_proj") == 0, "spaced first item [%s]", item);
    p = p ? cfg_list_next(p, item, sizeof item) : NULL;
    CHECK(p && strcmp(item, "v_proj") == 0, "spaced second item [%s]", item);
    d = dump(&a);
    CHECK(strstr(d, "target_modules = [\"q_proj\", \"v_proj\"]\n") != NULL, "spaced list dump:\n%s", d);
    free(d);
    cfg_free(&a);
    static const char *const bad[] = {"[training]\nfreeze = [1, 2]\n", "[training]\nfreeze = [\"a,b\"]\n",
                                      "[training]\nfreeze = [\"\"]\n", "[lora]\nrank = [\"x\"]\n"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        f = fopen(path, "w");
        fputs(bad[i], f);
        fclose(f);
        int rc = parse(&a, &e, argv);
        CHECK(rc == CT_ERR_CONFIG && (strstr(e.msg, "training.freeze") || strstr(e.msg, "lora.rank")),
              "bad list %zu: rc %d: %s", i, rc, e.msg);
        cfg_free(&a);
    }
    remove(path);
}

/* torchtitan's nested sections: [training.data] name is training.dataset, [quantize.linear.float8]
 * and [compile] are read at the values that switch nothing on, the implicit parents ([quantize],
 * [quantize.linear]) are not sections of their own; an unknown nested section is refused naming its
 * first key and the file. */
static void test_nested_sections(void) {
    char path[64];
    write_tmp(path, "[training]\nsteps = 3\n[training.data]\nname = \"c4\"\n"
                    "[compile]\nenable = false\ncomponents = [\"model\", \"loss\"]\n"
                    "[quantize.linear.float8]\nenable_fsdp_float8_all_gather = false\n"
                    "precompute_float8_dynamic_scale_for_fsdp = false\nfilter_fqns = [\"output\"]\n"
                    "[float8]\nfilter_fqns = [\"output\"]\n[comm]\ninit_timeout_seconds = 600\n"
                    "train_timeout_seconds = 300\n[model]\nname = \"qwen3\"\ntokenizer_path = \"tok/dir\"\n"
                    "converters = []\n[checkpoint]\nasync_mode = \"disabled\"\n");
    const char *argv[] = {"--config", path, "--training.dataset_path=data.jsonl", NULL};
    ct_config c;
    ct_err e;
    int rc = parse(&c, &e, argv);
    CHECK(rc == 0, "nested sections: %s", e.msg);
    if (!rc) {
        CHECK(c.steps == 3 && strcmp(c.dataset, "auto") == 0 && strcmp(c.dataset_tt[0], "c4") == 0,
              "training.data.name c4 -> auto [%s]", c.dataset);
        CHECK(strcmp(c.hf_assets_path, "tok/dir") == 0, "tokenizer_path -> hf_assets_path [%s]", c.hf_assets_path);
        CHECK(strcmp(c.tt.f8_filter[1], "output") == 0 && c.tt.comm_init_timeout == 600, "inert keys read");
        char *d = dump(&c);
        CHECK(!strstr(d, "[compile]") && !strstr(d, "float8") && !strstr(d, "tokenizer_path") &&
                  !strstr(d, "[training.data]") && strstr(d, "hf_assets_path = \"tok/dir\""),
              "inert keys and aliases are not dumped:\n%s", d);
        free(d);
    }
    cfg_free(&c);
    remove(path);
    /* the same through dotted keys and the command line */
    write_tmp(path, "[training]\ndata.name = \"text\"\n");
    const char *dotted[] = {"--config", path, NULL};
    rc = parse(&c, &e, dotted);
    CHECK(rc == 0 && strcmp(c.dataset, "text") == 0, "dotted key training.data.name: %s", e.msg);
    cfg_free(&c);
    remove(path);
    const char *cli[] = {"--training.data.name=jsonl", NULL};
    rc = parse(&c, &e, cli);
    CHECK(rc == 0 && strcmp(c.dataset, "jsonl") == 0, "--training.data.name: %s", e.msg);
    cfg_free(&c);
    cfg_defaults(&c);
    CHECK(cfg_set(&c, "quantize.linear.float8.emulate", "false", &e) == 0, "cfg_set nested: %s", e.msg);
    cfg_free(&c);

    expect_file_fail("unknown nested section", "[quantize.linear.mx]\nrecipe_name = \"mxfp8\"\n",
                     ":2: quantize.linear.mx.recipe_name: unknown section [quantize.linear.mx]", NULL);
    expect_file_fail("unknown nested key", "[training.data]\npath = \"x\"\n", ":2: training.data.path: unknown key",
                     NULL);
    expect_file_fail("unknown dotted section", "[training]\ndataloader.num_workers = 2\n",
                     "training.dataloader.num_workers: unknown section [training.dataloader]", NULL);
    expect_file_fail("alias and its option disagree",
                     "[model]\nhf_assets_path = \"a\"\ntokenizer_path = \"b\"\n",
                     ":3: model.tokenizer_path: the same setting as model.hf_assets_path (line 2)", NULL);
    write_tmp(path, "[model]\nhf_assets_path = \"a\"\ntokenizer_path = \"a\"\n");
    rc = parse(&c, &e, dotted);
    CHECK(rc == 0 && strcmp(c.hf_assets_path, "a") == 0, "alias with the same value: %s", e.msg);
    cfg_free(&c);
    remove(path);
    /* an empty [quantize] header: a parent of known sections, nothing to set */
    write_tmp(path, "[quantize]\n[quantize.linear]\n");
    rc = parse(&c, &e, dotted);
    CHECK(rc == 0, "empty parent headers: %s", e.msg);
    cfg_free(&c);
    remove(path);
}

/* A list option on the command line takes a TOML array too, as torchtitan users write lists. */
static void test_cli_list_literal(void) {
    ct_config c;
    ct_err e;
    const char *ok[] = {"--training.freeze=[\"model.embed_tokens.weight\", \"model.layers.*.self_attn.*\"]",
                        "--lora.target_modules", "['q_proj','v_proj',]", "--model.converters=[]", NULL};
    int rc = parse(&c, &e, ok);
    CHECK(rc == 0, "list literals: %s", e.msg);
    if (!rc)
        CHECK(strcmp(c.freeze, "model.embed_tokens.weight,model.layers.*.self_attn.*") == 0 &&
                  strcmp(c.lora_targets, "q_proj,v_proj") == 0 && strcmp(c.tt.converters, "") == 0,
              "list literal values [%s] [%s]", c.freeze, c.lora_targets);
    cfg_free(&c);
    const char *bad1[] = {"--training.freeze=[\"a\"", NULL};
    expect_fail("unterminated list", bad1, "command line: training.freeze:", "not a TOML array of strings",
                "unterminated array");
    const char *bad2[] = {"--training.freeze=[\"a\", 1]", NULL};
    expect_fail("list of ints", bad2, "training.freeze: item 2", NULL, NULL);
    const char *bad3[] = {"--training.freeze=[\"a\"] # x\nb = 1", NULL};
    expect_fail("list then more", bad3, "not a TOML array of strings", NULL, NULL);
}

static void test_help(void) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    cfg_print_help(f);
    fclose(f);
    const char *want[] = {"[job]", "[checkpoint]", "[metrics]", "--optimizer.lr=<float>",
                          "(default: 8e-4)", "--model.spec=<qwen3|hf>",
                          "--lr_scheduler.decay_type=<linear|sqrt|cosine>",
                          "--training.seed=<int64>", "--training.deterministic=<bool>",
                          "(default: \"./outputs\")", "--checkpoint.enable=<bool>",
                          "--metrics.file=<string>", "--config FILE", "in [0, 1)",
                          "[quantize.linear.float8]", "[training.data]", "--compile.enable=<bool>",
                          "--training.freeze=<list>"};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++)
        CHECK(strstr(buf, want[k]) != NULL, "help lacks '%s'", want[k]);
    free(buf);
}

static void test_configs_dir(void) {
    glob_t g;
    int rc = glob("configs/*.toml", 0, NULL, &g);
    CHECK(rc == 0 && g.gl_pathc >= 7, "configs/*.toml: rc %d, %zu files (run from repo root)",
          rc, rc == 0 ? g.gl_pathc : 0);
    for (size_t i = 0; rc == 0 && i < g.gl_pathc; i++) {
        ct_config c;
        ct_err e;
        const char *argv[] = {"--config", g.gl_pathv[i], NULL};
        int r = parse(&c, &e, argv);
        CHECK(r == 0, "%s: %s", g.gl_pathv[i], e.msg);
        /* the published-size configs (qwen3_*.toml) share one shape */
        CHECK(!strstr(g.gl_pathv[i], "configs/qwen3_") ||
                  (c.seq_len == 4096 && c.local_batch_size == 1 && strcmp(c.decay_type, "cosine") == 0),
              "%s: size config shape", g.gl_pathv[i]);
        if (strcmp(g.gl_pathv[i], "configs/debug.toml") == 0) {
            CHECK(strcmp(c.model_flavor, "debugmodel") == 0 && c.seq_len == 128 &&
                      c.local_batch_size == 4 && c.steps == 40 && c.warmup_steps == 5 &&
                      c.lr == 2e-3 && c.log_freq == 1 && c.max_norm == 1.0 &&
                      strcmp(c.dataset_path, "data/debug_tokens.bin") == 0 &&
                      strcmp(c.dump_folder, "./outputs/debug") == 0,
                  "debug.toml values");
        }
        cfg_free(&c);
    }
    if (rc == 0) globfree(&g);
}

/* What the ranks of a run compare (cfg_shared_text): every option that shapes the
 * maths or the collectives, as config.toml writes it ([kernels] too); of a
 * machine's own paths only whether they are set; not its threads or peak. */
static void test_shared_options(void) {
    ct_config c;
    cfg_defaults(&c);
    ct_err e = {0};
    CHECK(cfg_set(&c, "training.local_batch_size", "3", &e) == 0, "%s", e.msg);
    CHECK(cfg_set(&c, "optimizer.lr", "3e-3", &e) == 0, "%s", e.msg);
    CHECK(cfg_set(&c, "job.dump_folder", "/somewhere/run", &e) == 0, "%s", e.msg);
    int n = cfg_n_options(), shared = 0, batch = 0, lr = 0, dump = 0, load = 0, matmul = 0, own = 0;
    for (int i = 0; i < n; i++) {
        char *t = cfg_shared_text(&c, i);
        if (!t) continue;
        shared++;
        batch += !strcmp(t, "training.local_batch_size = 3");
        lr += !strcmp(t, "optimizer.lr = 0.003");
        dump += !strcmp(t, "job.dump_folder = (set)");
        load += !strcmp(t, "checkpoint.initial_load_path = (unset)");
        matmul += !strncmp(t, "kernels.matmul = ", 17);
        own += !strncmp(t, "training.threads ", 17) || !strncmp(t, "metrics.peak_tflops ", 20) || strstr(t, "/somewhere");
        free(t);
    }
    CHECK(batch == 1 && lr == 1, "local_batch_size %d, lr %d times among the shared options", batch, lr);
    CHECK(dump == 1 && load == 1, "the paths' set-ness: dump_folder %d, initial_load_path %d", dump, load);
    CHECK(matmul == 1, "kernels.matmul %d times", matmul);
    CHECK(own == 0, "%d per-machine values among the shared ones", own);
    CHECK(shared > 50 && shared < n, "%d of %d options shared", shared, n);
    CHECK(cfg_shared_text(&c, -1) == NULL && cfg_shared_text(&c, n) == NULL, "out of range");
    cfg_free(&c);
}

int main(void) {
    test_shared_options();
    test_defaults();
    test_precedence_and_spellings();
    test_errors();
    test_round_trip();
    test_lists();
    test_nested_sections();
    test_cli_list_literal();
    test_help();
    test_configs_dir();
    return CHECK_DONE();
}
