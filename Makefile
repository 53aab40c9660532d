# ctitan build. `make` builds build/ctitan and build/libctitan.so;
# `make test` and `make run` first run scripts/setup.sh (apt + venv, idempotent).
CC      ?= gcc
OPT     ?= -O2
CFLAGS  ?= $(OPT) -g
# CROSS=aarch64: cross-build for 64-bit Arm with Debian's gcc-aarch64-linux-gnu and the
# arm64 multiarch libraries (scripts/setup.sh installs them), without MPI (CT_NO_MPI: a
# stub backend that says so if launched under mpirun). `make test-aarch64` runs it under qemu.
# NO_CURL=1: no libcurl (CT_NO_CURL): Hub ids resolve from the local cache only (src/hub/hub.c).
CROSS   ?=
ifeq ($(CROSS),aarch64)
CC      := aarch64-linux-gnu-gcc
TRIPLET := aarch64-linux-gnu
NO_MPI  := 1
# GCC 12's aarch64 vectoriser dies (internal compiler error) on a loop of tests/c/model/test_lora.c
TEST_CFLAGS := -fno-tree-vectorize
else
TRIPLET := x86_64-linux-gnu
endif
# WERROR=1 (make test's build): a warning fails the build, so "warning-free" is checked, not hoped.
CFLAGS  += $(if $(WERROR),-Werror)
CFLAGS  += -std=c11 -Wall -Wextra -Wshadow -fPIC -fopenmp -Isrc -I/usr/include/$(TRIPLET)/openblas-openmp -D_GNU_SOURCE
BLASDIR := /usr/lib/$(TRIPLET)/openblas-openmp
LDLIBS  := -L$(BLASDIR) -Wl,-rpath,$(BLASDIR) -lopenblas -lcjson -lpcre2-8 -lutf8proc -lm -fopenmp
BUILD   ?= build
ifeq ($(NO_CURL),1)
CFLAGS  += -DCT_NO_CURL
else
# libcurl (Debian's libcurl4-openssl-dev; arm64 through multiarch) downloads Hub models
LDLIBS  += -lcurl
endif
ifeq ($(NO_MPI),1)
CFLAGS  += -DCT_NO_MPI
else
# OpenMPI (Debian's libopenmpi-dev) for src/distributed/comm_mpi.c; a run without mpirun never calls MPI_Init.
MPI_CFLAGS := $(shell pkg-config --cflags ompi-c 2>/dev/null || mpicc --showme:compile 2>/dev/null)
MPI_LIBS   := $(shell pkg-config --libs ompi-c 2>/dev/null || mpicc --showme:link 2>/dev/null)
CFLAGS  += $(MPI_CFLAGS)
LDLIBS  += $(MPI_LIBS)
endif

# cairo (Debian's libcairo2-dev) renders `ctitan report --png` (src/report/png.c). Where it is
# missing (the aarch64 cross build: no arm64 cairo is installed) png.c is built as a stub
# (CT_NO_CAIRO) that says "PNG output not built in"; only that file sees cairo's headers.
ifneq ($(CROSS),aarch64)
CAIRO_CFLAGS := $(shell pkg-config --cflags cairo 2>/dev/null)
CAIRO_LIBS   := $(shell pkg-config --libs cairo 2>/dev/null)
endif
ifeq ($(CAIRO_LIBS),)
CAIRO_CFLAGS := -DCT_NO_CAIRO
endif
LDLIBS  += $(CAIRO_LIBS)

SRCS    := $(filter-out src/cli/main.c,$(wildcard src/*/*.c src/kernels/*/*.c))
OBJS    := $(SRCS:%.c=$(BUILD)/obj/%.o)
# tests/c mirrors src (tests/c/MODULE/test_NAME.c); the binaries stay flat in $(BUILD)/tests,
# so a test's name is unique across folders.
TEST_SRCS := $(wildcard tests/c/*/test_*.c)
TESTS   := $(addprefix $(BUILD)/tests/,$(basename $(notdir $(TEST_SRCS))))
vpath test_%.c $(sort $(dir $(TEST_SRCS)))
PY      := .venv/bin/python
# Each part of make test says its wall and CPU time (scripts/timed.sh; build/test-times.txt,
# printed again at the end): the suite has a time budget and this says where it goes.
T       := bash scripts/timed.sh

.PHONY: all setup test test-c test-py test-py-passes test-py-all test-aarch64 test-bins sanitize fuzz fuzz-short fuzz-long run bench bench-avx2 clean
all: $(BUILD)/ctitan $(BUILD)/libctitan.so

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/src/report/png.o: CFLAGS += $(CAIRO_CFLAGS)

$(BUILD)/libctitan.a: $(OBJS)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libctitan.so: $(OBJS)
	$(CC) -shared $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/ctitan: $(BUILD)/obj/src/cli/main.o $(BUILD)/libctitan.a
	$(CC) $(LDFLAGS) -o $@ $^ $(LDLIBS)

$(BUILD)/tests/test_%: test_%.c $(BUILD)/libctitan.a tests/c/check.h tests/c/kern_test.h
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(TEST_CFLAGS) -Itests/c $(LDFLAGS) -o $@ $< $(BUILD)/libctitan.a $(LDLIBS)

setup:
	@bash scripts/setup.sh

# CT_KERNELS_CHECK=cli: test_kernels leaves the built-in table's kern_check to `kernels check` here.
test-c: $(TESTS) $(BUILD)/ctitan
	@CT_KERNELS_CHECK=cli bash scripts/run_c_tests.sh $(TESTS)
	@$(BUILD)/ctitan kernels check $(KCHECK_FLAGS) > $(BUILD)/kernels-check.log || { cat $(BUILD)/kernels-check.log; exit 1; }
	@tail -n 1 $(BUILD)/kernels-check.log

# The C tests and `ctitan kernels check` of the aarch64 cross build (build/aarch64, CROSS=aarch64)
# under qemu-user; "aarch64: skipped (...)" where the cross toolchain is not installed.
test-aarch64:
	@bash scripts/test_aarch64.sh

test-bins: $(TESTS) $(BUILD)/ctitan

# The C unit tests, `kernels check --quick` (every case, the longest capped: ASan at -O1 runs the
# kernels ~10x slower, and the edges it must see stay) and the CLI tests again under AddressSanitizer and UBSan,
# in their own build tree: any report ends the process with an error (UBSan does not recover)
# and the CLI test fixture fails a test whose ctitan printed one (tests/py/conftest.py).
# LeakSanitizer reads tests/lsan.supp (Open MPI's and OpenBLAS's own allocations at start-up).
# The ranks mpirun starts unwind every malloc's stack in full (fast_unwind_on_malloc=0, passed
# to them by Open MPI's mca_base_env_list), so that the suppressions see MPI_Init's frames
# through plugins built without frame pointers and unloaded by exit. Every other process
# keeps ASan's fast frame-pointer unwind: the full one costs ~10x the CPU of a CLI run that
# parses a tokenizer (test_tokenize_cli.py: 133 s -> 11 s CPU), and no process without MPI
# needed it (the C tests and the CLI tests pass with it; cairo's and OpenBLAS's allocations
# are still seen in their libraries). What LSan finds is the same: the unwind only decides
# which frames a report, and so a suppression, sees.
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=undefined
SAN_ENV   := ASAN_OPTIONS=fast_unwind_on_malloc=1 LSAN_OPTIONS=suppressions=$(CURDIR)/tests/lsan.supp \
             UBSAN_OPTIONS=print_stacktrace=1 OMPI_MCA_mca_base_env_list=ASAN_OPTIONS=fast_unwind_on_malloc=0
# The tests that drive only the CLI (a sanitized libctitan cannot be loaded into Python)
# and the masked-loss runs under mpirun (DP, FSDP, TP); not the memory figures of the dry-run
# tests, which ASan's shadow memory and redzones inflate.
SAN_CLI_TESTS := tests/py/test_cli_errors.py tests/py/test_tokenize_cli.py tests/py/test_hostile_files.py \
                 tests/py/test_fuzz_regressions.py tests/py/test_dist_masked.py tests/py/test_profile.py \
                 tests/py/test_events.py tests/py/test_cli_strict.py
# CTITAN_SANITIZE: the C tests leave out, and say so, what repeats a code path the sanitizers
# already see (the same source compiled for another target, more tiles of a shape already crossed).
# CFLAGS from the environment (the Makefile's CFLAGS ?= $(OPT) -g) with -g1: line tables and
# function names, all a report's symbolized stack needs (UBSan's own file:line is compiled in),
# at ~4/5 of -g's compile CPU (src/ under ASan + UBSan: 73 -> 59 CPU s).
sanitize:
	@$(SAN_ENV) CTITAN_SANITIZE=1 CFLAGS="-O1 $(SAN_FLAGS) -fno-omit-frame-pointer -g1" $(T) san-c \
	  $(MAKE) --no-print-directory BUILD=build/san LDFLAGS="$(SAN_FLAGS)" KCHECK_FLAGS=--quick test-c
	$(SAN_ENV) CTITAN_BUILD=build/san $(T) san-py $(PY) -m pytest -q -p no:cacheprovider $(SAN_CLI_TESTS)

# libFuzzer targets (tests/fuzz/fuzz_*.c, docs/reliability.md "Fuzzing"): clang with ASan and
# UBSan over a separate object tree of the library, so a crash, leak or UB report in a parser of
# outside data stops the fuzzer. UB aborts (-fno-sanitize-recover) so libFuzzer records it.
FUZZ_CC     := clang
FUZZ_SAN    := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
# -Wno-pass-failed: clang's -O1 runs no loop vectorizer, so every `#pragma omp simd` (a licence to
# vectorise, kept for the -O2 build) would be reported as a loop it could not vectorise.
# The main build's warnings (-Wshadow included), and under WERROR=1 (make test) its -Werror.
FUZZ_CFLAGS := -O1 -g -std=c11 -Wall -Wextra -Wshadow -Wno-pass-failed $(if $(WERROR),-Werror) -fPIC -fopenmp -Isrc \
               -I/usr/include/$(TRIPLET)/openblas-openmp -D_GNU_SOURCE $(MPI_CFLAGS) $(FUZZ_SAN) -fsanitize=fuzzer-no-link
# The SIMD kernels are no parser: clang cannot compile their target-attributed intrinsics inside
# OpenMP regions, so they keep the main build's compiler and flags, uninstrumented: the main
# build's own objects (build/obj/src/kernels, the same command), not a second compile of them.
FUZZ_OBJS   := $(patsubst %.c,build/fuzz/obj/%.o,$(filter-out src/kernels/%,$(SRCS))) \
               $(patsubst %.c,build/obj/%.o,$(filter src/kernels/%,$(SRCS)))
FUZZ_BINS   := $(patsubst tests/fuzz/%.c,build/fuzz/%,$(wildcard tests/fuzz/fuzz_*.c))

build/fuzz/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(FUZZ_CFLAGS) -MMD -MP -c $< -o $@

ifneq ($(BUILD),build)
build/obj/src/kernels/%.o: src/kernels/%.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -MMD -MP -c $< -o $@
endif

build/fuzz/obj/src/report/png.o: FUZZ_CFLAGS += $(CAIRO_CFLAGS)

build/fuzz/libctitan.a: $(FUZZ_OBJS)
	@rm -f $@
	ar rcs $@ $^

build/fuzz/fuzz_%: tests/fuzz/fuzz_%.c $(wildcard tests/fuzz/*.h) build/fuzz/libctitan.a
	$(FUZZ_CC) $(FUZZ_CFLAGS) -Itests/fuzz -fsanitize=fuzzer -o $@ $< build/fuzz/libctitan.a $(LDLIBS)

fuzz: $(FUZZ_BINS)

# Every target over its seed corpus for a fixed number of runs (all together well under a minute).
fuzz-short: fuzz
	@bash scripts/fuzz.sh short

# A million executions per target, one after the other (most of an hour here: not in make test).
fuzz-long: fuzz
	@bash scripts/fuzz.sh long

# Every op on its reference: "op=ref" for each X(ID, op, ...) line of src/kernels/ops_list.h
# (X. matches its parenthesis: make counts the ones inside $(shell)).
REF_KERNELS := $(shell sed -n 's/^ *X.[A-Z0-9_]*, *\([a-z0-9_]*\),.*/\1=ref/p' src/kernels/ops_list.h | paste -sd, -)

PARITY_TESTS := tests/py/test_parity.py tests/py/test_bf16.py tests/py/test_moe.py::test_logits_loss_grads \
                tests/py/test_families.py::test_logits_loss_grads tests/py/test_families_bf16.py
# The session-API loop and the CLI (training runs, error paths) once more with every op on its
# reference kernel: conftest passes CTITAN_TEST_KERNELS to sessions and to `ctitan train` as
# --kernels.* (CTITAN_ISA=ref would keep openblas and the tiled attention). About 45 s.
REF_CLI_TESTS := tests/py/test_train_loop.py tests/py/test_cli_errors.py
# The instruction-set levels below this CPU's best (CTITAN_ISA): avx2 on AVX-512 CPUs, avx512 on AMX ones.
LOWER_ISAS := $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && grep -qw avx2 /proc/cpuinfo && echo avx2) \
              $(shell grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null && echo avx512)

# Parity against transformers once more with every op on its reference kernel, and
# with the kernels limited to each lower instruction-set level this CPU can run
# (test-py-passes), then the whole suite (test-py-all; PY_ALL_FILES: which files).
# make test runs the two as lanes of their own, and the whole suite as two pytest runs
# (PY_ALL_A, PY_ALL_B: the test files by name, about half of its CPU each).
test-py: test-py-passes test-py-all

test-py-passes: all
	CTITAN_TEST_KERNELS=$(REF_KERNELS) $(T) py-parity-ref $(PY) -m pytest -q -p no:cacheprovider $(PARITY_TESTS)
	@for isa in $(LOWER_ISAS); do echo "parity with CTITAN_ISA=$$isa"; \
	  CTITAN_ISA=$$isa $(T) py-parity-$$isa $(PY) -m pytest -q -p no:cacheprovider $(PARITY_TESTS) || exit 1; done
	@echo "session API and CLI tests with every op on its reference kernel"
	CTITAN_TEST_KERNELS=$(REF_KERNELS) $(T) py-cli-ref $(PY) -m pytest -q -p no:cacheprovider $(REF_CLI_TESTS)
	@echo "parity with the kernels chosen by timing (the rest of the suite runs with CTITAN_KERNEL_TUNE=0)"
	CTITAN_KERNEL_TUNE=1 $(T) py-parity-tune $(PY) -m pytest -q -p no:cacheprovider tests/py/test_parity.py \
	  tests/py/test_families.py::test_logits_loss_grads

PY_ALL_FILES ?= tests/py
PY_ALL_LABEL ?= py-all
test-py-all: all
	$(T) $(PY_ALL_LABEL) $(PY) -m pytest -q --durations=30 $(PY_ALL_IGNORE) $(PY_ALL_FILES)

# The tests' OpenMP threads sleep when they wait for work (OMP_WAIT_POLICY=passive) instead of
# spinning (libgomp's default, and torch's): the tests run thousands of tiny parallel regions
# (finite differences, small models, `kernels check` cases), and spinning threads take the cores
# from the ones with work. Measured on the 2-core machine: test_ops 13.2 -> 7.3 CPU s and
# test_tune 8.4 -> 4.0 at a load of 2.5; at a load of 8 (other builds beside) test_ops 52 -> 7.6
# and test_train_loop + test_resume 38 -> 13 CPU s, 273 -> 66 s wall; torch-bound pytest files
# unchanged. Same threads, same code paths, same results; only how an idle thread waits.
# Not for `make run` or bench.
test test-c test-py test-py-passes test-py-all test-aarch64 sanitize fuzz-short: export OMP_WAIT_POLICY ?= passive

# The builds of make test (build, build/san, build/fuzz, build/aarch64) on every core: `make test`
# alone (.ci/run) compiled one file at a time. After the first build (the library, ctitan and
# the C test binaries) the parts run as lanes side by side (scripts/lanes.sh says why): the C
# tests and `kernels check`, the pytest parity passes, the rest of the pytest suite in two
# halves, the two multi-rank pytest files that are a third of the suite's time (PY_DIST_TESTS:
# mpirun at 2 and 4 ranks of the debug models), the sanitized build then the fuzzers, and the
# aarch64 build under qemu. The lanes are CPU-bound on 2 cores, so the fewer CPU seconds, the
# sooner; but one long serial lane would end last alone on one core: the C tests (one binary
# at a time) no longer hold the other lanes back, and the suite's ~380 CPU s are two lanes.
# Each lane's log is printed whole when it ends; build/test-times.txt has each part's wall
# and CPU time.
TEST_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PY_DIST_TESTS := tests/py/test_dist_debugmodel.py tests/py/test_dist.py
PY_ALL_A := $(filter-out $(PY_DIST_TESTS),$(wildcard tests/py/test_[a-k]*.py))
PY_ALL_B := $(filter-out $(PY_DIST_TESTS) $(PY_ALL_A),$(wildcard tests/py/test_*.py))
test: setup
	@mkdir -p build && rm -f build/test-times.txt
	@$(T) build $(MAKE) --no-print-directory -j$(TEST_JOBS) WERROR=1 all test-bins
	@$(T) lanes bash scripts/lanes.sh \
	  "test-c=$(T) test-c $(MAKE) --no-print-directory test-c" \
	  "py-passes=$(T) py-passes $(MAKE) --no-print-directory test-py-passes" \
	  "py-all-a=$(MAKE) --no-print-directory test-py-all PY_ALL_LABEL=py-all-a PY_ALL_FILES='$(PY_ALL_A)'" \
	  "py-all-b=$(MAKE) --no-print-directory test-py-all PY_ALL_LABEL=py-all-b PY_ALL_FILES='$(PY_ALL_B)'" \
	  "py-dist=$(T) py-dist $(PY) -m pytest -q -p no:cacheprovider --durations=10 $(PY_DIST_TESTS)" \
	  "sanitize+fuzz=$(T) sanitize $(MAKE) --no-print-directory -j$(TEST_JOBS) sanitize && \
	     $(T) fuzz-short $(MAKE) --no-print-directory -j$(TEST_JOBS) WERROR=1 fuzz-short" \
	  "aarch64=$(T) aarch64 $(MAKE) --no-print-directory test-aarch64"
	@cat build/test-times.txt

# The build on every core unless make was given -j itself: `make run` from a fresh clone
# is timed (README), and a serial build is a third of it on a 2-core machine.
run:
	@bash scripts/setup.sh --no-venv
	@$(MAKE) --no-print-directory $(if $(findstring -j,$(MAKEFLAGS)),,-j$(shell nproc 2>/dev/null || echo 2)) all
	@bash scripts/run_default.sh

# Figures beside PyTorch (docs/benchmarks.md); not part of make test. Each run appends
# its figures to $(RECORD), and bench/scorecard.py ends with this CPU's table: issue 14's
# targets judged on them. bench-avx2 holds both sides to AVX2 + FMA (ctitan by
# CTITAN_ISA, PyTorch by ATEN/MKL/oneDNN's own switches): an AVX2-only CPU such as AMD
# Zen 3, approximated on a newer one. Its W1 bf16 runs ctitan alone: PyTorch's autocast
# bf16 without bf16 hardware had not finished 6 steps in 25 minutes (docs/benchmarks.md);
# on such a CPU `make bench` stops that PyTorch run at --torch-timeout and says so.
RECORD = $(BUILD)/bench-record.jsonl
BT = CTITAN_BUILD=$(BUILD) $(PY) bench/bench_train.py --record $(RECORD) --torch-timeout 1200
BM = CTITAN_BUILD=$(BUILD) $(PY) bench/bench_moe.py --record $(RECORD)
AVX2_ENV = CTITAN_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2
bench: setup all
	rm -f $(RECORD)
	$(BT) --workload W1
	$(BT) --workload W1 --precision bf16
	$(BT) --workload W2
	$(BT) --workload W3
	$(BT) --workload W3 --precision bf16
	$(BT) --workload W1 --lora 16
	$(BT) --workload W1 --lora 16 --frozen-bf16 --precision bf16
	$(BM) --shape debugmodel_moe
	$(BM) --shape debugmodel_moe --precision bf16 --no-ref
	$(BM) --shape 30b-a3b-2l
	$(PY) bench/bench_tokenizer.py
	$(BUILD)/ctitan kernels bench --op matmul --quick
	$(PY) bench/scorecard.py $(RECORD)

bench-avx2: setup all
	rm -f $(RECORD)
	$(AVX2_ENV) $(BT) --workload W1
	$(AVX2_ENV) $(BT) --workload W1 --precision bf16 --no-torch
	$(AVX2_ENV) $(BT) --workload W3
	$(AVX2_ENV) $(BM) --shape debugmodel_moe --no-ref
	$(PY) bench/scorecard.py $(RECORD)

clean:
	rm -rf build

-include $(OBJS:.o=.d)
-include $(FUZZ_OBJS:.o=.d)
