"""`ctitan compare` (issue 18, part 3) on real tiny runs. Every expected number is computed
here from the raw files (metrics.jsonl, events.jsonl, and the raw metrics.jsonl saved
before a resume cut it back), never from ctitan's own output; the JSON report is checked
against them and the text report for the same verdicts."""
import html
import json
import math
import re
import shutil
import subprocess
import time

import pytest

import oracle
from conftest import BIN, CHILD_ENV, ROOT, crashed, tiny_run
from test_dist import ENV as MPI_ENV, mpirun
from test_events import killed_run

STEPS = 8
TOL = 1e-4


def base_args(d, out, *extra, lr="1e-2"):
    return ["train", "--model.spec=hf", f"--model.hf_assets_path={d / 'model'}", f"--training.dataset_path={d / 'd.bin'}",
            "--training.seq_len=16", "--training.local_batch_size=2", "--training.global_batch_size=4",
            f"--training.steps={STEPS}", "--training.seed=5", f"--optimizer.lr={lr}", "--metrics.log_freq=1",
            "--metrics.peak_tflops=1", f"--job.dump_folder={out}", "--checkpoint.enable",
            "--checkpoint.interval=3", *extra]


def train(args, ranks=1, env=None, check=True):
    cmd = ([str(BIN)] if ranks == 1 else mpirun() + ["-np", str(ranks), str(BIN)]) + [str(a) for a in args]
    p = subprocess.run(cmd, cwd=ROOT, env=env or MPI_ENV, capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    if check:
        assert p.returncode == 0, f"{' '.join(cmd)}\n{p.stderr[-3000:]}"
    return p


def compare(*args, env=None):
    cmd = [str(BIN), "compare", *[str(a) for a in args]]
    p = subprocess.run(cmd, cwd=ROOT, env=env or MPI_ENV, capture_output=True, text=True, timeout=300)
    crashed(p.returncode, p.stderr, cmd)
    return p


def read_jsonl(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def losses(run):
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def rel(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cmp")
    oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=2, heads=4, kv_heads=2,
                       head_dim=8).save_pretrained(d / "model")
    oracle.write_bin(d / "d.bin", oracle.learnable_stream(80 * 17 + 5, 128, seed=3))
    r = {"d": d}
    r["one"] = d / "one"  # one process, 2 micro-batches of 2 per step
    train(base_args(d, r["one"]))
    r["fsdp"] = d / "fsdp"  # 2 ranks, FSDP over both, the same global batch
    train(base_args(d, r["fsdp"]), ranks=2)
    r["lr"] = d / "lr"  # the recipe perturbed: another learning rate
    train(base_args(d, r["lr"], lr="2e-2"))
    # stopped at step 4 then resumed after a pause
    r["stop"] = d / "stop"
    p = train(base_args(d, r["stop"], "--training.stop_at_step=4"), check=False)
    assert p.returncode == 75, p.stderr[-2000:]
    time.sleep(0.3)
    train(base_args(d, r["stop"]))
    return r


def report(*args):
    p = compare(*args, "--json")
    return p, json.loads(p.stdout) if p.stdout.strip() else None


def check_layouts_agree(a, b, worlds):
    """compare of runs a and b (of worlds[0] and worlds[1] ranks): the loss curves' figures
    are those computed here and within TOL, each final checkpoint restores in the other's
    layout. Returns the JSON report."""
    p, j = report(a, b, "--tolerance", TOL)
    assert p.returncode == 0, p.stdout + p.stderr
    la, lb = losses(a), losses(b)
    common = sorted(set(la) & set(lb))
    assert common == list(range(1, STEPS + 1))
    r = [rel(la[s], lb[s]) for s in common]
    L = j["loss"]
    assert L["n"] == len(common) and L["n_only_a"] == 0 and L["n_only_b"] == 0
    assert math.isclose(L["max_rel"], max(r), rel_tol=1e-9, abs_tol=1e-15), (L["max_rel"], max(r))
    assert math.isclose(L["mean_rel"], sum(r) / len(r), rel_tol=1e-9, abs_tol=1e-15)
    assert L["max_step"] == common[r.index(max(r))]
    assert L["max_rel"] <= TOL and L["within_tolerance"]
    ra, rb = j["restore"]
    final = max(int(x.name[5:]) for x in (a / "checkpoint").iterdir())
    for x, own, other in ((ra, *worlds), (rb, *worlds[::-1])):
        assert x["checked"] and x["ok"], x
        assert x["step"] == final and x["own_world"] == own and x["other_world"] == other, x
        assert x["rel"] <= j["restore_tolerance"] == 1e-5 and math.isfinite(x["own_loss"]), x
    return j


def test_layouts_agree_and_restore_both_ways(runs):
    a, b = runs["one"], runs["fsdp"]
    j = check_layouts_agree(a, b, (1, 2))
    # the text says the same
    p = compare(a, b, "--tolerance", TOL)
    assert p.returncode == 0
    assert p.stdout.count(": restores") == 2 and "tolerance 0.0001: within" in p.stdout, p.stdout
    # tokens/s: per rank (tps) and of the job (global batch tokens / step time), mean over
    # the logged steps after step 1
    for key, run in (("a", a), ("b", b)):
        rows = [m for m in read_jsonl(run / "metrics.jsonl") if "tps" in m and m["step"] > 1]
        assert math.isclose(j[key]["tps_mean"], sum(m["tps"] for m in rows) / len(rows), rel_tol=1e-9)
        job = [4 * 16 / m["step_time_s"] for m in rows]  # global batch 4 x seq_len 16
        assert math.isclose(j[key]["job_tps_mean"], sum(job) / len(job), rel_tol=1e-6), (j[key], job)
    assert "tokens/s of the job B / A" in p.stdout


def test_probes_run_for_root_without_the_open_mpi_variables(runs):
    """compare launches its restore probes with mpirun. Run as root (as CI and the README's
    set-up are) without OMPI_ALLOW_RUN_AS_ROOT*, Open MPI refused them, and a refusal read
    as 'DOES NOT RESTORE' (exit 4): the user typed no mpirun, so compare says yes for them."""
    env = {k: v for k, v in MPI_ENV.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    p = compare(runs["one"], runs["fsdp"], "--tolerance", TOL, env=env)
    assert p.returncode == 0 and p.stdout.count(": restores") == 2, p.stdout + p.stderr


def test_tensor_parallel_layout(runs):
    """The recipe on 2 tensor-parallel ranks (each holds half of every layer's heads and MLP
    columns, a layout that slices tensors rather than whole ones) against one process."""
    tp = runs["d"] / "tp"
    train(base_args(runs["d"], tp, "--parallelism.tensor_parallel_degree=2"), ranks=2)
    j = check_layouts_agree(runs["one"], tp, (1, 2))
    assert "tensor_parallel_degree = 2" in (tp / "config.toml").read_text()
    assert j["restore"][1]["why"] == ""


def test_perturbed_recipe_exceeds_tolerance(runs):
    a, c = runs["one"], runs["lr"]
    p, j = report(a, c, "--tolerance", TOL, "--no-restore")
    assert p.returncode == 4, p.stdout + p.stderr  # "differ" (docs/reliability.md)
    la, lc = losses(a), losses(c)
    r = {s: rel(la[s], lc[s]) for s in la}
    worst = max(r, key=r.get)
    assert j["loss"]["max_step"] == worst and math.isclose(j["loss"]["max_rel"], r[worst], rel_tol=1e-9)
    assert r[worst] > TOL and not j["loss"]["within_tolerance"]
    assert not j["restore"][0]["checked"] and not j["restore"][1]["checked"]
    p = compare(a, c, "--tolerance", TOL, "--no-restore", "--steps")
    assert p.returncode == 4
    assert f"at step {worst} " in p.stdout and "EXCEEDED" in p.stdout, p.stdout
    assert p.stdout.count("not checked (--no-restore)") == 2
    rows = [ln.split() for ln in p.stdout.splitlines() if ln.strip()[:1].isdigit() and len(ln.split()) == 4]
    assert [int(x[0]) for x in rows] == sorted(la), rows  # the per-step table
    # without --tolerance a difference is reported, not an error
    assert compare(a, c, "--no-restore").returncode == 0


def test_restore_failure_is_reported(runs, tmp_path):
    """A layout the checkpoint cannot be loaded in (3-way tensor parallel over 2 ranks):
    "does not restore", with the probe's error, and the "differ" exit."""
    bad = tmp_path / "bad"
    shutil.copytree(runs["fsdp"], bad)
    cfg = (bad / "config.toml").read_text()
    assert "tensor_parallel_degree = 1" in cfg
    (bad / "config.toml").write_text(cfg.replace("tensor_parallel_degree = 1", "tensor_parallel_degree = 3"))
    p, j = report(runs["one"], bad)
    assert p.returncode == 4, p.stdout + p.stderr
    x = j["restore"][0]
    assert x["checked"] and not x["ok"] and "tensor_parallel_degree" in x["why"], x


def test_probe_timeout(runs):
    """A probe still running after --probe-timeout is killed; compare names it and exits 1
    (trouble, not a finding: the check could not be made), before starting the next."""
    a, b = runs["one"], runs["fsdp"]
    t = time.time()
    p = compare(a, b, "--probe-timeout", "0.001", "--json")
    assert p.returncode == 1 and not p.stdout, (p.returncode, p.stdout, p.stderr)
    final = max(int(x.name[5:]) for x in (a / "checkpoint").iterdir())
    assert (f"the probe of A's step-{final} in A's own layout (1 rank) timed out after 0.001 s (--probe-timeout)"
            in p.stderr), p.stderr
    assert time.time() - t < 10  # one probe, stopped at once, not four
    p = compare(a, b, "--probe-timeout", "-1")
    assert p.returncode == 2 and "--probe-timeout needs a number" in p.stderr, p.stderr


def sessions(run, raw_before=None):
    """(launch, end, start step, end step, machines, world, threads, startup, load) per launch,
    from events.jsonl, and for a killed one from the raw metrics saved before its resume."""
    ev = read_jsonl(run / "events.jsonl")
    out = []
    for i, e in enumerate(ev):
        if e["event"] != "start":
            continue
        nxt = next((k for k in range(i + 1, len(ev)) if ev[k]["event"] == "start"), len(ev))
        part = ev[i + 1:nxt]
        ex = [x for x in part if x["event"] == "exit"]
        if ex:
            end, end_step = ex[0]["time"], ex[0]["step"]
        else:  # killed: its last sign of life
            raw = raw_before or []
            end = max([x["time"] for x in part] + [m["time"] for m in raw] + [e["time"]])
            end_step = max([x["step"] for x in part] + [m["step"] for m in raw] + [e["step"]])
        out.append(dict(launch=e["launch_time"], end=end, start_step=e["step"], end_step=end_step,
                        machines=e["machines"], world=e["world"], threads=e["threads"], startup=e["startup_s"],
                        load=e.get("load_s", 0), exit=ex[0] if ex else None))
    return out


def check_restarts(j, run, raw_before=None):
    s = sessions(run, raw_before)
    down = [s[k]["launch"] - s[k - 1]["end"] for k in range(1, len(s))]
    redone = [max(0, s[k - 1]["end_step"] - s[k]["start_step"]) for k in range(1, len(s))]
    st = [m["step_time_s"] for m in read_jsonl(run / "metrics.jsonl") if "step_time_s" in m and m["step"] > 1]
    mean_st = sum(st) / len(st)
    assert j["restarts"] == len(s) - 1
    assert math.isclose(j["downtime_s"], sum(down), abs_tol=1e-6), (j["downtime_s"], down)
    assert j["redone_steps"] == sum(redone), (j["redone_steps"], redone)
    assert math.isclose(j["redone_s"], sum(redone) * mean_st, rel_tol=1e-9, abs_tol=1e-12)
    startup = sum(x["startup"] for x in s[1:])
    assert math.isclose(j["startup_s"], startup, abs_tol=1e-9)
    assert math.isclose(j["load_s"], sum(x["load"] for x in s[1:]), abs_tol=1e-9)
    assert math.isclose(j["lost_s"], sum(down) + startup + sum(redone) * mean_st, abs_tol=1e-6)
    wall = [x["end"] - x["launch"] for x in s]
    assert math.isclose(j["wall_s"], sum(wall), abs_tol=1e-6)
    assert math.isclose(j["machine_hours"], sum(x["machines"] * w for x, w in zip(s, wall)) / 3600, abs_tol=1e-9)
    assert math.isclose(j["core_hours"],
                        sum(x["world"] * x["threads"] * w for x, w in zip(s, wall)) / 3600, abs_tol=1e-9)
    return s, down, redone


def test_stop_and_resume_restarts_and_cost(runs):
    run = runs["stop"]
    p, j = report(run, runs["one"], "--no-restore", "--price-per-hour", "3.5")
    assert p.returncode == 0, p.stderr
    s, down, redone = check_restarts(j["a"], run)
    assert len(s) == 2 and s[0]["exit"]["reason"] == "stopped" and redone == [0]
    assert down[0] >= 0.3 - 0.05  # the test slept 0.3 s between the two launches
    wall = [x["end"] - x["launch"] for x in s]
    cost = 3.5 * sum(x["machines"] * w for x, w in zip(s, wall)) / 3600
    assert math.isclose(j["a"]["cost"], cost, rel_tol=1e-9), (j["a"]["cost"], cost)
    p2, j2 = report(run, runs["one"], "--no-restore", "--price-per-hour", "3.5", "--bill-downtime")
    assert math.isclose(j2["a"]["cost"], cost + 3.5 * s[1]["machines"] * down[0] / 3600, rel_tol=1e-9)
    # CPU time: rank 0's cpu_s x world over the exits
    est = sum(x["exit"]["cpu_s"] * x["world"] for x in s) / 3600
    assert math.isclose(j["a"]["cpu_hours_est"], est, rel_tol=1e-9)
    text = compare(run, runs["one"], "--no-restore", "--price-per-hour", "3.5").stdout
    assert "A restart 1: from step 4 after the previous session stopped at step 4" in text, text
    assert "cost at 3.5 per machine-hour" in text


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run SIGKILLed after 8 metrics lines, resumed 0.2 s later to 2 steps past the kill:
    (its dump folder, the raw metrics lines the resume cut back)."""
    args, out, raw, _ = killed_run(tmp_path_factory.mktemp("killed"))
    time.sleep(0.2)
    q = subprocess.run(args + [f"--training.steps={max(m['step'] for m in raw) + 2}"], cwd=ROOT, env=CHILD_ENV,
                       capture_output=True, text=True, timeout=300)
    crashed(q.returncode, q.stderr, args)
    assert q.returncode == 0, q.stderr[-2000:]
    return out, raw


def test_killed_then_resumed(killed):
    out, raw = killed
    pj, j = report(out, out, "--no-restore")
    assert pj.returncode == 0, pj.stderr
    s, down, redone = check_restarts(j["a"], out, raw)
    assert len(s) == 2 and s[0]["exit"] is None and j["a"]["sessions"][0]["reason"] == "killed"
    # (0 when the kill came right after a save)
    assert redone[0] == max(m["step"] for m in raw) - s[1]["start_step"], redone
    assert down[0] >= 0.2 - 0.05
    text = compare(out, out, "--no-restore").stdout
    assert f"redone {redone[0]} step(s)" in text and "was killed" in text, text
    # the killed session has no exit: CPU time unknown for it
    assert j["a"]["cpu_unknown_sessions"] == 1


def report_figures(page):
    """The rows of `ctitan report`'s final-figures table: {label: first cell's text}."""
    table = page[page.index('<table class="figures">'):]
    table = table[:table.index("</table>")]
    rows = re.findall(r"<tr><th>(.*?)</th><td>(.*?)</td>", table)
    return {html.unescape(k): html.unescape(v) for k, v in rows}


def figure(rows, prefix):
    hit = [v for k, v in rows.items() if k.startswith(prefix)]
    assert len(hit) == 1, (prefix, rows)
    m = re.match(r"-?[0-9.]+", hit[0])
    return float(m.group()) if m else None  # "–": no figure


def test_report_and_compare_agree(killed, tmp_path):
    """One accounting of a run: `ctitan report`'s final figures and `ctitan compare`'s of a
    killed-then-resumed run are the same numbers, and both are the ones computed here from
    events.jsonl and metrics.jsonl (the killed session counted from its start to its last
    sign of life, the means after step 1)."""
    out, raw = killed
    s = sessions(out, raw)
    wall = sum(x["end"] - x["launch"] for x in s)
    cpu = sum(x["exit"]["cpu_s"] * x["world"] for x in s if x["exit"])
    energy = [x["exit"]["energy_j"] for x in s if x["exit"] and x["exit"].get("energy_j") is not None]
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "tps" in m and m["step"] > 1]
    tps = sum(m["tps"] for m in rows) / len(rows)
    job = sum(m["tokens_seen"] / m["step"] / m["step_time_s"] for m in rows) / len(rows)
    p, j = report(out, out, "--no-restore")
    assert p.returncode == 0, p.stderr
    a = j["a"]
    assert math.isclose(a["wall_s"], wall, abs_tol=1e-6), (a["wall_s"], wall)
    assert math.isclose(a["cpu_hours_est"] * 3600, cpu, rel_tol=1e-9), (a["cpu_hours_est"], cpu)
    assert math.isclose(a["tps_mean"], tps, rel_tol=1e-9), (a["tps_mean"], tps)
    assert a["restarts"] == len(s) - 1 == 1
    assert (a["energy_j"] is None) == (not energy) and (not energy or math.isclose(a["energy_j"], sum(energy)))
    page = tmp_path / "r.html"
    q = subprocess.run([str(BIN), "report", str(out), "-o", str(page)], cwd=ROOT, env=CHILD_ENV,
                       capture_output=True, text=True, timeout=120)
    assert q.returncode == 0, q.stderr
    f = report_figures(page.read_text())
    # the page prints 1 decimal (3 for kJ): equal to that
    assert abs(figure(f, "wall time") - wall) <= 0.05 + 1e-9, (f, wall)
    assert abs(figure(f, "CPU time") - cpu) <= 0.05 + 1e-9, (f, cpu)
    assert abs(figure(f, "mean tokens/s per rank") - tps) <= 0.05 + 1e-9, (f, tps)
    assert abs(figure(f, "mean tokens/s of the job") - job) <= 0.05 + 1e-9, (f, job)
    e = figure(f, "energy")
    assert (e is None) == (not energy) and (not energy or abs(e - sum(energy) / 1000) <= 5e-4 + 1e-9), (f, energy)
    launches = [v for k, v in f.items() if k.startswith(("launches", "starts"))]
    assert launches == [f"{len(s)} ({len(s) - 1})"], f


def test_energy(runs, tmp_path):
    a = runs["one"]
    ex = [e for e in read_jsonl(a / "events.jsonl") if e["event"] == "exit"]
    p, j = report(a, a, "--no-restore")
    if "energy_unavailable" in ex[-1]:  # this VM: no RAPL
        assert j["a"]["energy_j"] is None and j["a"]["energy_unavailable"] == ex[-1]["energy_unavailable"]
        assert f"not measured: {ex[-1]['energy_unavailable']}" in compare(a, a, "--no-restore").stdout
    # a run that read counters (a fake powercap tree): its joules summed over the sessions
    pc = tmp_path / "powercap"
    for n in (0, 1):
        (pc / f"intel-rapl:{n}").mkdir(parents=True)
        (pc / f"intel-rapl:{n}" / "energy_uj").write_text("5000000\n")
        (pc / f"intel-rapl:{n}" / "max_energy_range_uj").write_text("262143328850\n")
    out = tmp_path / "e"
    d = runs["d"]
    env = dict(MPI_ENV, CTITAN_POWERCAP=str(pc))
    p = train(base_args(d, out, "--training.stop_at_step=3"), env=env, check=False)
    assert p.returncode == 75
    train(base_args(d, out), env=env)
    ev = read_jsonl(out / "events.jsonl")
    assert [e["energy_j"] for e in ev if e["event"] == "exit"] == [0, 0]
    # the counters here do not move; give the exits joules as a real machine would
    lines = [json.dumps(e) for e in ev]
    k = 0
    for i, e in enumerate(ev):
        if e["event"] == "exit":
            lines[i] = json.dumps(dict(e, energy_j=[1000.0, 234.5][k]))
            k += 1
    (out / "events.jsonl").write_text("\n".join(lines) + "\n")
    p, j = report(out, a, "--no-restore")
    assert j["a"]["energy_j"] == 1234.5 and j["a"]["energy_all_machines_j"] == 1234.5
    assert "1234.5 J" in compare(out, a, "--no-restore").stdout


def test_errors(runs, tmp_path):
    a = runs["one"]
    for args in (["--bogus", a, a], [a], [a, a, a], [a, a, "--tolerance", "abc"], [a, a, "--tolerance"],
                 [a, a, "--price-per-hour=-1"]):
        p = compare(*args)
        assert p.returncode == 2 and "error" in p.stderr, (args, p.returncode, p.stderr)
    p = compare(a, tmp_path / "nope")
    assert p.returncode == 1 and "nope" in p.stderr, p.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    p = compare(a, empty)
    assert p.returncode == 1 and "metrics.jsonl" in p.stderr, p.stderr
    bad = tmp_path / "bad"
    shutil.copytree(a, bad)
    lines = (bad / "metrics.jsonl").read_text().splitlines()
    lines[2] = lines[2][:-5]
    (bad / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    p = compare(a, bad)
    assert p.returncode == 3 and "metrics.jsonl:3" in p.stderr, p.stderr


def test_malformed_or_empty_runs(runs, tmp_path):
    """A bad line is not skipped: a known key of the wrong type, binary junk after the last
    line, an events.jsonl time that is not a number are 3 naming file:line and the key; an
    empty metrics.jsonl is 1 (nothing logged is not agreement), and so are two runs with no
    step in common; a last line cut mid-object (a killed run) is dropped with a warning."""
    a = runs["one"]

    def copy(name, edit, fname="metrics.jsonl"):
        d = tmp_path / name
        shutil.copytree(a, d, ignore=shutil.ignore_patterns("checkpoint"))
        (d / fname).write_bytes(edit((d / fname).read_bytes()))
        return d

    n = (a / "metrics.jsonl").read_bytes().rstrip(b"\n").count(b"\n") + 1
    for d, code, want in (
            (copy("loss", lambda b: re.sub(rb'"loss": [0-9.e+-]+', b'"loss": "x"', b, count=1)), 3,
             'metrics.jsonl:1: "loss" is not a number ("x")'),
            (copy("nul", lambda b: b + b"\0\1\2"), 3, f"metrics.jsonl:{n + 1}: invalid JSON"),
            (copy("time", lambda b: b.replace(b'"time":', b'"time":"yesterday","was":', 1), "events.jsonl"), 3,
             'events.jsonl:1: "time" is not a number ("yesterday")'),
            (copy("empty", lambda b: b""), 1, "metrics.jsonl: no step logged"),
            (copy("later", lambda b: re.sub(rb'"step": (\d+)', lambda m: b'"step": %d' % (int(m[1]) + 100), b)), 1,
             f"no step has a loss in both runs ({STEPS} only in A, {STEPS} only in B)")):
        p = compare(a, d, "--no-restore")
        assert p.returncode == code and want in p.stderr and not p.stdout, (d, p.returncode, p.stderr)
    p = compare(a, copy("torn", lambda b: b.rstrip(b"\n")[:-25]), "--no-restore", "--json")
    assert p.returncode == 0 and f"metrics.jsonl:{n}: the last line is cut short" in p.stderr, p.stderr
    assert json.loads(p.stdout)["loss"]["n"] == STEPS - 1


def test_different_models_refused(runs):
    """Two models (2 and 3 layers) are not two runs of one recipe: each checkpoint would be
    probed in its own run's model, so "restores" would test nothing shared. Refused (2),
    naming the key, restore check or not."""
    d = runs["d"]
    oracle.tiny_config(vocab=128, hidden=32, inter=48, layers=3, heads=4, kv_heads=2,
                       head_dim=8).save_pretrained(d / "model3")
    three = d / "three"
    if not (three / "metrics.jsonl").exists():
        train(base_args(d, three, f"--model.hf_assets_path={d / 'model3'}"))
    for extra in ((), ("--no-restore",)):
        p = compare(runs["one"], three, *extra)
        assert p.returncode == 2 and not p.stdout, (p.returncode, p.stdout, p.stderr)
        assert "not runs of one recipe" in p.stderr and "num_hidden_layers 2 vs 3" in p.stderr, p.stderr


def test_missing_checkpoint_not_checked(runs, tmp_path):
    """A run copied without its checkpoint folder cannot be restore-checked: "not checked",
    naming the missing step folder, not "DOES NOT RESTORE" (a finding never made)."""
    gone = tmp_path / "gone"
    shutil.copytree(runs["one"], gone, ignore=shutil.ignore_patterns("checkpoint"))
    p, j = report(runs["one"], gone)
    assert p.returncode == 0, p.stdout + p.stderr
    a, b = j["restore"]
    assert a["checked"] and a["ok"], a
    assert not b["checked"] and str(gone / "checkpoint" / "step-") in b["why"] and "is missing" in b["why"], b
    p = compare(runs["one"], gone)
    assert p.returncode == 0 and "DOES NOT RESTORE" not in p.stdout and "not checked (its final checkpoint" in p.stdout


@pytest.mark.parametrize("final", [[], ["--lora.rank=4"]], ids=["hf_export", "peft_adapter"])
def test_final_exports_only_not_checked(tmp_path, final):
    """A run whose only save is its final one with checkpoint.last_save_in_hf (make run's
    recipe, configs/kjv.toml), or a LoRA run's final adapter, has no training checkpoint to
    restore: compare of it and its identical copy probed the export, which load_step refuses,
    and said DOES NOT RESTORE (exit 4). Now "not checked", naming the export, and exit 0."""
    _, out, args = tiny_run(tmp_path, "--checkpoint.enable", "--checkpoint.interval=100",
                            "--checkpoint.last_save_in_hf=true", *final, steps=2)
    train(args)
    step2 = out / "checkpoint" / "step-2"
    marker = "adapter_config.json" if final else "config.json"
    assert (step2 / marker).is_file() and not (step2 / "manifest.json").exists(), list(step2.iterdir())
    copy = tmp_path / "copy"
    shutil.copytree(out, copy, ignore=shutil.ignore_patterns(".ctitan.lock"))
    p, j = report(out, copy)
    assert p.returncode == 0, p.stdout + p.stderr
    kind = "a PEFT adapter" if final else "a Hugging Face export"
    for x, run in zip(j["restore"], (out, copy)):
        assert not x["checked"], x
        assert str(run / "checkpoint") in x["why"] and f"step-2 is {kind}" in x["why"], x
    p = compare(out, copy)
    assert p.returncode == 0 and "DOES NOT RESTORE" not in p.stdout, p.stdout + p.stderr
    assert p.stdout.count("not checked (no training checkpoint in") == 2, p.stdout


def test_help_states_the_printed_tokens_per_s():
    """--help said the tokens/s figure was the "mean of the logged tps after step 1"; what is
    printed first, and divided B / A, is the job's rate as docs/compare.md defines it."""
    doc = (ROOT / "docs" / "compare.md").read_text()
    formula = re.search(r"tokens/s of the job = (.+?)\s{2,}", doc).group(1)  # (tokens_seen / step) / step_time_s
    p = compare("--help")
    assert p.returncode == 0, p.stderr
    assert formula in p.stdout and "mean of the logged tps" not in p.stdout, (formula, p.stdout)
