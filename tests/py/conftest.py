"""Fixtures for ctitan's Python tests: the ctypes wrapper of build/libctitan.so, the CLI
runner, paths. A missing build product makes the fixture FAIL (never skip)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / os.environ.get("CTITAN_BUILD", "build")  # another build tree for the tests
LIB = BUILD / "libctitan.so"
BIN = BUILD / "ctitan"

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Kernels in the suite: the registry's order, not the start-up timing (kernels/tune.c). The
# tests compare runs of different thread counts, layouts and batch shapes with each other to
# 1e-5; a timed choice is per thread count and shape and follows the machine's load, so two
# such runs could compute with different (equally correct) kernels. The timed choice has its
# own tests (test_kernel_choice.py, tests/c/kernels/test_tune.c) and a parity pass (Makefile).
os.environ.setdefault("CTITAN_KERNEL_TUNE", "0")
# ctitan subprocesses: two threads (the machine has two cores).
CHILD_ENV = dict(os.environ, OMP_NUM_THREADS="2", OPENBLAS_NUM_THREADS="2")


class CtitanError(RuntimeError):
    pass


def _load_lib(path: Path):
    lib = ctypes.CDLL(str(path))
    P, I, F, I64 = ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.POINTER(ctypes.c_int64)
    I32 = ctypes.POINTER(ctypes.c_int32)
    D = ctypes.POINTER(ctypes.c_double)
    sig = {
        "ctitan_open": (P, [I, ctypes.POINTER(ctypes.c_char_p), ctypes.c_char_p, I]),
        "ctitan_close": (None, [P]),
        "ctitan_last_error": (ctypes.c_char_p, [P]),
        "ctitan_vocab_size": (I, [P]),
        "ctitan_num_tensors": (I, [P]),
        "ctitan_tensor_name": (ctypes.c_char_p, [P, I]),
        "ctitan_tensor_shape": (I, [P, I, I64]),
        "ctitan_get_param": (I, [P, ctypes.c_char_p, F]),
        "ctitan_set_param": (I, [P, ctypes.c_char_p, F]),
        "ctitan_get_grad": (I, [P, ctypes.c_char_p, F]),
        "ctitan_logits": (I, [P, I32, I, I, F]),
        "ctitan_zero_grad": (I, [P]),
        "ctitan_forward_backward": (I, [P, I32, I32, I, I, ctypes.c_long, D]),
        "ctitan_optimizer_step": (I, [P, D, D]),
        "ctitan_save_hf": (I, [P, ctypes.c_char_p, ctypes.c_char_p]),
        "ctitan_save_adapter": (I, [P, ctypes.c_char_p]),
        "ctitan_merge_adapter": (I, [P]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


def _fptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))


def _iptr(a):
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))


class Ctitan:
    """One ctitan session (model + optimizer) through libctitan's C API, numpy in/out."""

    def __init__(self, lib, args):
        self.lib = lib
        self.args = [str(a) for a in args]
        argv = (ctypes.c_char_p * len(self.args))(*[a.encode() for a in self.args])
        err = ctypes.create_string_buffer(4096)
        self.s = lib.ctitan_open(len(self.args), argv, err, len(err))
        if not self.s:
            raise CtitanError(f"ctitan_open({self.args}) failed: {err.value.decode(errors='replace')}")
        self.shapes = {}
        for i in range(lib.ctitan_num_tensors(self.s)):
            name = lib.ctitan_tensor_name(self.s, i).decode()
            shape = (ctypes.c_int64 * 8)()
            nd = lib.ctitan_tensor_shape(self.s, i, shape)
            assert 0 <= nd <= 8, f"ctitan_tensor_shape({i}) returned {nd}"
            self.shapes[name] = tuple(int(shape[k]) for k in range(nd))

    # ----- helpers
    def _check(self, rc, what):
        if rc != 0:
            msg = self.lib.ctitan_last_error(self.s)
            raise CtitanError(f"{what} failed (rc={rc}): {msg.decode(errors='replace') if msg else '?'}")

    def close(self):
        if self.s:
            self.lib.ctitan_close(self.s)
            self.s = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----- API
    @property
    def vocab_size(self) -> int:
        return int(self.lib.ctitan_vocab_size(self.s))

    def names(self) -> list[str]:
        return list(self.shapes)

    def get_param(self, name) -> np.ndarray:
        out = np.empty(self.shapes[name], dtype=np.float32)
        self._check(self.lib.ctitan_get_param(self.s, name.encode(), _fptr(out)), f"get_param({name})")
        return out

    def set_param(self, name, value):
        a = np.ascontiguousarray(value, dtype=np.float32)
        assert a.shape == self.shapes[name], f"{name}: {a.shape} != {self.shapes[name]}"
        self._check(self.lib.ctitan_set_param(self.s, name.encode(), _fptr(a)), f"set_param({name})")

    def get_grad(self, name) -> np.ndarray:
        out = np.empty(self.shapes[name], dtype=np.float32)
        self._check(self.lib.ctitan_get_grad(self.s, name.encode(), _fptr(out)), f"get_grad({name})")
        return out

    def params(self) -> dict[str, np.ndarray]:
        return {n: self.get_param(n) for n in self.names()}

    def logits(self, tokens) -> np.ndarray:
        t = np.ascontiguousarray(tokens, dtype=np.int32)
        B, T = t.shape
        out = np.empty((B, T, self.vocab_size), dtype=np.float32)
        self._check(self.lib.ctitan_logits(self.s, _iptr(t), B, T, _fptr(out)), "logits")
        return out

    def zero_grad(self):
        self._check(self.lib.ctitan_zero_grad(self.s), "zero_grad")

    def forward_backward(self, tokens, labels, n_valid_total) -> float:
        t = np.ascontiguousarray(tokens, dtype=np.int32)
        l = np.ascontiguousarray(labels, dtype=np.int32)
        assert t.shape == l.shape
        B, T = t.shape
        loss = ctypes.c_double(float("nan"))
        self._check(self.lib.ctitan_forward_backward(self.s, _iptr(t), _iptr(l), B, T, int(n_valid_total),
                                                     ctypes.byref(loss)), "forward_backward")
        return loss.value

    def optimizer_step(self) -> tuple[float, float]:
        gn, lr = ctypes.c_double(float("nan")), ctypes.c_double(float("nan"))
        self._check(self.lib.ctitan_optimizer_step(self.s, ctypes.byref(gn), ctypes.byref(lr)), "optimizer_step")
        return gn.value, lr.value

    def save_hf(self, path, dtype="float32"):
        self._check(self.lib.ctitan_save_hf(self.s, str(path).encode(), dtype.encode()), f"save_hf({path})")

    def save_adapter(self, path):
        self._check(self.lib.ctitan_save_adapter(self.s, str(path).encode()), f"save_adapter({path})")

    def merge_adapter(self):
        self._check(self.lib.ctitan_merge_adapter(self.s), "merge_adapter")


def hf_session_args(hf_dir, *, load=True, batch=2, seq_len=16, seed=3, dump=None, extra=()):
    """ctitan_open arguments for a session from an HF directory (weights loaded iff `load`)."""
    a = ["--model.spec=hf", f"--model.hf_assets_path={hf_dir}",
         f"--training.local_batch_size={batch}", f"--training.seq_len={seq_len}",
         f"--training.seed={seed}"]
    if load:
        a += [f"--checkpoint.initial_load_path={hf_dir}", "--checkpoint.initial_load_in_hf"]
    if dump is not None:
        a.append(f"--job.dump_folder={dump}")
    return a + list(extra)


# a tiny run's checkpoints: every 4 steps, all kept, the last one full (a resume's input)
TINY_CKPT = ["--checkpoint.enable", "--checkpoint.interval=4", "--checkpoint.keep_latest_k=0",
             "--checkpoint.last_save_model_only=false"]


def tiny_run(d, *flags, layers=1, steps=10, out=None, val=False):
    """The seconds-long training run of the CLI tests (TensorBoard, events, profiler, report):
    a config.json-only Qwen3 of vocab 128, hidden 32 and `layers` layers (initialised from
    training.seed), a learnable token stream in d, log_freq 1, and `flags` added; with `val`,
    validation every 3 steps on 2 batches of random tokens. The model and data are written
    once per d, so several runs (`out`, default d/out) share them.
    Returns (config, dump folder, the `train` arguments)."""
    import oracle  # torch and transformers: only for the tests that ask
    cfg = oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=layers, heads=4, kv_heads=2, head_dim=8)
    model, data, out = d / "model", d / "d.bin", out or d / "out"
    if not (model / "config.json").exists():
        cfg.save_pretrained(model)
        oracle.write_bin(data, oracle.learnable_stream(40 * 17 + 5, 128, seed=3))
    args = ["train", "--model.spec=hf", f"--model.hf_assets_path={model}", f"--training.dataset_path={data}",
            "--training.seq_len=16", "--training.local_batch_size=2", f"--training.steps={steps}",
            "--training.seed=5", "--metrics.log_freq=1", "--metrics.peak_tflops=1", f"--job.dump_folder={out}"]
    if val:
        v = d / "v.bin"
        if not v.exists():
            oracle.write_bin(v, oracle.random_tokens(8 * 17, 128, seed=4))
        args += ["--validation.enable", "--validation.freq=3", "--validation.steps=2", f"--validation.dataset_path={v}"]
    return cfg, out, args + list(flags)


@pytest.fixture(scope="session")
def root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def libctitan():
    if not LIB.exists():
        pytest.fail(f"{LIB} is missing: run `make all` first", pytrace=False)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    return _load_lib(LIB)


@pytest.fixture
def open_session(libctitan, tmp_path):
    """open_session(args) -> Ctitan; every session is closed at teardown."""
    sessions = []

    def _open(args):
        args = list(args)
        if not any(a.startswith("--job.dump_folder") for a in args):
            args.append(f"--job.dump_folder={tmp_path / 'session_out'}")
        # CTITAN_TEST_KERNELS="matmul=ref,..." runs the sessions on chosen kernels (make test
        # runs the parity tests once with the defaults and once with every op on "ref")
        for kv in filter(None, os.environ.get("CTITAN_TEST_KERNELS", "").split(",")):
            args.append(f"--kernels.{kv}")
        s = Ctitan(libctitan, args)
        sessions.append(s)
        return s

    yield _open
    for s in sessions:
        s.close()


@pytest.fixture(scope="session")
def ctitan_bin() -> Path:
    if not BIN.exists():
        pytest.fail(f"{BIN} is missing: run `make all` first", pytrace=False)
    return BIN


# What a crash leaves: a signal (negative status from subprocess, or 128+N from a shell),
# abort()'s status, or a sanitizer's report (build/san runs the CLI tests under ASan+UBSan).
CRASH_MARKERS = ("AddressSanitizer", "LeakSanitizer", "UndefinedBehaviorSanitizer", "runtime error:",
                 "Segmentation fault", "core dumped")


def crashed(rc, stderr, cmd):
    """Fails the test when a ctitan process crashed, whatever exit the test expects: an
    error test that only checked "non-zero" would pass on a segfault or a sanitizer report."""
    err = stderr if isinstance(stderr, str) else (stderr or b"").decode(errors="replace")
    hit = next((m for m in CRASH_MARKERS if m in err), None)
    if rc < 0 or rc in (134, 139) or hit:
        pytest.fail(f"ctitan crashed (exit {rc}{', ' + hit if hit else ''}): "
                    f"{' '.join(str(c) for c in cmd)}\n--- stderr\n{err[-4000:]}", pytrace=False)


def run_on_pty(cmd, env=None, cwd=None, timeout=300):
    """Runs cmd with stderr on a pseudo-terminal (stdout discarded), so the program's
    isatty(2) is true as in a user's shell: (exit status, everything the terminal got).
    A crash fails the test, as everywhere."""
    import pty
    cmd = [str(c) for c in cmd]
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            b = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not b:
            break
        chunks.append(b)
    rc = p.wait(timeout=timeout)
    os.close(master)
    text = b"".join(chunks).decode(errors="replace")
    crashed(rc, text, cmd)
    return rc, text


@pytest.fixture
def run_ctitan(ctitan_bin):
    """run_ctitan(args, check=True, timeout=180) -> (rc, stdout, stderr), run from the repo
    root. check=True fails the test on a non-zero exit, showing stderr."""

    def _run(args, check=True, timeout=180):
        cmd = [str(ctitan_bin)] + [str(a) for a in args]
        # CTITAN_TEST_KERNELS="matmul=ref,...": training runs on the chosen kernels too, as the
        # sessions do (the CLI honours --kernels.*; CTITAN_ISA=ref would still pick openblas and
        # the tiled attention, which need no instruction set)
        # the flags come last and so win: a test that chooses an op's kernel itself keeps its choice
        if cmd[1:2] == ["train"]:
            for kv in filter(None, os.environ.get("CTITAN_TEST_KERNELS", "").split(",")):
                if not any(c.startswith(f"--kernels.{kv.split('=')[0]}=") for c in cmd):
                    cmd.append(f"--kernels.{kv}")
        p = subprocess.run(cmd, cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=timeout)
        crashed(p.returncode, p.stderr, cmd)
        if p.returncode != 0:
            print(f"$ {' '.join(cmd)}\nexit {p.returncode}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}")
            if check:
                pytest.fail(f"ctitan exited {p.returncode}: {' '.join(cmd)}\n--- stderr\n{p.stderr[-4000:]}",
                            pytrace=False)
        return p.returncode, p.stdout, p.stderr

    return _run


@pytest.fixture
def hf_config():
    """Factory of tiny Qwen3Config (see oracle.tiny_config for the parameters)."""
    import oracle
    return oracle.tiny_config
