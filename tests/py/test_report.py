"""`ctitan report` (issue 18, part 2): the page of real tiny runs (validation, checkpoints, a
stop and a resume), read back with Python's own HTML parser and checked against the runs'
metrics.jsonl and events.jsonl; the page opened in headless Chromium (the browser is the
oracle that the page draws); the --png file opened with Pillow; hostile strings escaped; the
error exits.

Chromium is Debian's `chromium` package, which scripts/setup.sh installs: these tests fail,
never skip, where it is missing, so `make test` cannot pass without the browser check."""
import html.parser
import json
import math
import os
import re
import shutil
import subprocess
import tomllib

import numpy as np
import pytest
from PIL import Image

import oracle
from conftest import BIN, CHILD_ENV, crashed, tiny_run

STEPS = 10
RUN_COLORS = [(0x00, 0x72, 0xB2), (0xD5, 0x5E, 0x00)]  # report_run_color(0), (1): src/report/chart.c


def ctitan(args, timeout=180):
    cmd = [str(BIN)] + [str(a) for a in args]
    p = subprocess.run(cmd, env=CHILD_ENV, capture_output=True, text=True, timeout=timeout)
    crashed(p.returncode, p.stderr, cmd)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two runs of one recipe: `a` stopped at step 6 (training.stop_at_step) and resumed to
    10, `b` straight through with another learning rate."""
    tmp = tmp_path_factory.mktemp("report")

    def args(out, lr):
        return tiny_run(tmp, "--checkpoint.enable", "--checkpoint.interval=4", "--checkpoint.keep_latest_k=0",
                        f"--optimizer.lr={lr}", steps=STEPS, out=out, val=True)[2]

    a, b = tmp / "a", tmp / "b"
    rc, _, err = ctitan(args(a, 2e-3) + ["--training.stop_at_step=6"])
    assert rc == 75, err
    rc, _, err = ctitan(args(a, 2e-3))
    assert rc == 0, err
    rc, _, err = ctitan(args(b, 1e-3))
    assert rc == 0, err
    return tmp, a, b


class Page(html.parser.HTMLParser):
    """The elements of the page as (tag, attrs, enclosing svg id), and its text."""

    def __init__(self, text):
        super().__init__()
        self.elems, self.text, self.svg, self.stack = [], [], None, []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg":
            self.svg = a.get("id")
        self.elems.append((tag, a, self.svg))

    def handle_endtag(self, tag):
        if tag == "svg":
            self.svg = None

    def handle_data(self, data):
        self.text.append(data)

    def find(self, tag, svg=None, **want):
        return [a for t, a, s in self.elems if t == tag and (svg is None or s == svg)
                and all(a.get(k.rstrip("_").replace("_", "-")) == v for k, v in want.items())]


def read(path):
    return Page(path.read_text())


def logged(run, key):
    """(step, value) of metrics.jsonl's lines with key, one per step, the last line winning."""
    d = {}
    for r in oracle.read_metrics(run / "metrics.jsonl"):
        if key in r and r[key] is not None and math.isfinite(r[key]):
            d[r["step"]] = r[key]
    return sorted(d.items())


def events(run):
    return oracle.read_metrics(run / "events.jsonl")


def tb_smooth(ys, w):
    """TensorBoard's smoothing (its vz_line_chart): a debiased exponential moving average."""
    last, out = 0.0, []
    for i, y in enumerate(ys):
        last = last * w + (1 - w) * y
        out.append(last / (1 - w ** (i + 1)))
    return out


def curve(page, svg_id, run, series):
    """The (step, value) points of a polyline, mapped back through the svg's data range."""
    svg = page.find("svg", id=svg_id)[0]
    x0, x1, y0, y1 = (float(svg[k]) for k in ("data-x0", "data-x1", "data-y0", "data-y1"))
    left, top, w, h = (float(v) for v in svg["data-plot"].split())
    lines = page.find("polyline", svg=svg_id, data_run=run, data_series=series)
    assert len(lines) == 1, f"{svg_id}: {len(lines)} polylines of {run}/{series}"
    pts = [tuple(map(float, p.split(","))) for p in lines[0]["points"].split()]
    assert len(pts) == int(lines[0]["data-points"]), "data-points disagrees with the points drawn"
    px = [p[0] for p in pts]
    assert px == sorted(px) and len(set(px)) == len(px), f"{svg_id}/{series}: x not increasing"
    steps = [x0 + (px_ - left) / w * (x1 - x0) for px_, _ in pts]
    vals = [y1 - (py - top) / h * (y1 - y0) for _, py in pts]
    # coordinates are written to 0.01 px
    return steps, vals, 0.006 * (x1 - x0) / w, 0.006 * (y1 - y0) / h


def check_curve(page, svg_id, run_name, series, want):
    steps, vals, tol_x, tol_y = curve(page, svg_id, run_name, series)
    assert len(steps) == len(want), f"{series}: {len(steps)} points, metrics.jsonl has {len(want)}"
    assert all(abs(s - w) <= tol_x for s, (w, _) in zip(steps, want)), (series, steps, want)
    bad = [(s, v, w) for s, v, (_, w) in zip(steps, vals, want) if abs(v - w) > tol_y]
    assert not bad, f"{series}: (step, drawn, logged) differ: {bad[:4]}"


CHARTS = {"chart-loss": "loss", "chart-lr": "lr", "chart-grad_norm": "grad_norm", "chart-tps": "tps",
          "chart-mfu": "mfu", "chart-memory": "memory_gib"}


def test_one_run(runs):
    tmp, a, _ = runs
    rc, out, err = ctitan(["report", a])
    assert rc == 0, err
    page_path = a / "report.html"
    assert str(page_path) in out
    page = read(page_path)
    loss = logged(a, "loss")
    assert [s for s, _ in loss] == list(range(1, STEPS + 1))  # the resume redid no logged step twice
    for svg_id, key in CHARTS.items():
        check_curve(page, svg_id, "a", key, logged(a, key))
    check_curve(page, "chart-loss", "a", "loss_smoothed",
                list(zip([s for s, _ in loss], tb_smooth([v for _, v in loss], 0.6))))
    val = logged(a, "val_loss")
    assert len(val) >= 3 and val[-1][0] == STEPS, val
    check_curve(page, "chart-loss", "a", "val_loss", val)
    # every event of events.jsonl is a marker at its step, in order, with its kind
    ev = events(a)
    kinds = [("resume" if e.get("resumed_from") else "start") if e["event"] == "start" else
             "ckpt" if e["event"] == "checkpoint" else {"stopped": "stop"}.get(e["reason"], e["reason"]) for e in ev]
    assert "resume" in kinds and "stop" in kinds and kinds.count("ckpt") >= 3, kinds
    marks = page.find("g", svg="chart-loss", class_="event")
    assert [(m["data-kind"], int(m["data-step"])) for m in marks] == [(k, e["step"]) for k, e in zip(kinds, ev)]
    # self-contained: nothing to fetch, no script
    text = page_path.read_text()
    assert "<script" not in text.lower() and "src=" not in text and "<link" not in text
    assert text.replace('xmlns="http://www.w3.org/2000/svg"', "").count("://") == 0
    # the final figures: last step and final loss
    assert "10" in page.text[page.text.index("last step") + 1]
    assert f"{loss[-1][1]:.4f}" in "".join(page.text)


def config_of(run):
    def flat(d, pre=""):
        out = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(flat(v, f"{pre}{k}."))
            else:
                out[pre + k] = v
        return out
    with open(run / "config.toml", "rb") as f:
        return flat(tomllib.load(f))


def test_two_runs_overlaid_and_config_diff(runs):
    tmp, a, b = runs
    out = tmp / "both.html"
    rc, _, err = ctitan(["report", a, b, "-o", out, "--smoothing", "0.3"])
    assert rc == 0, err
    page = read(out)
    for run in (a, b):
        for svg_id, key in CHARTS.items():
            check_curve(page, svg_id, run.name, key, logged(run, key))
        loss = logged(run, "loss")
        check_curve(page, "chart-loss", run.name, "loss_smoothed",
                    list(zip([s for s, _ in loss], tb_smooth([v for _, v in loss], 0.3))))
        check_curve(page, "chart-loss", run.name, "val_loss", logged(run, "val_loss"))
        assert len(page.find("g", svg="chart-loss", class_="event", data_run=run.name)) == len(events(run))
    # one colour per run, the same in every chart
    strokes = {r: {p["stroke"] for p in page.find("polyline", data_run=r)} for r in ("a", "b")}
    assert strokes == {"a": {"#%02x%02x%02x" % RUN_COLORS[0]}, "b": {"#%02x%02x%02x" % RUN_COLORS[1]}}, strokes
    assert [g["data-run"] for g in page.find("g", svg="chart-loss", class_="legend")] == ["a", "b"]
    # exactly the differing keys highlighted
    ca, cb = config_of(a), config_of(b)
    differ = {k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k)}
    assert {"optimizer.lr", "job.dump_folder"} <= differ, differ
    rows = page.find("tr")
    got = {r["data-key"] for r in rows if "data-key" in r and r.get("class") == "diff"}
    assert got == differ
    assert {r["data-key"] for r in rows if "data-key" in r} == ca.keys() | cb.keys()


def test_names_disambiguated(runs, tmp_path):
    _, a, b = runs
    for parent, src in (("x", a), ("y", b)):
        shutil.copytree(src, tmp_path / parent / "run", ignore=shutil.ignore_patterns("checkpoint"))
    rc, _, err = ctitan(["report", tmp_path / "x/run", tmp_path / "y/run", "-o", tmp_path / "r.html"])
    assert rc == 0, err
    page = read(tmp_path / "r.html")
    assert [g["data-run"] for g in page.find("g", svg="chart-loss", class_="legend")] == ["x/run", "y/run"]


def chromium():
    exe = shutil.which("chromium")
    assert exe, "chromium not found: scripts/setup.sh installs Debian's chromium (this test must not skip)"
    return exe


def screenshot(page, png, size="1200,2400"):
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--hide-scrollbars", "--no-first-run", f"--user-data-dir={png.parent / 'chromium-profile'}",
           f"--screenshot={png}", f"--window-size={size}", f"file://{page}"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and png.exists(), f"chromium failed ({p.returncode}): {p.stderr[-2000:]}"
    return Image.open(png).convert("RGB")


def color_pixels(img, rgb, tol=6):
    a = np.asarray(img).astype(int)
    return int((np.abs(a - np.array(rgb)).max(axis=2) <= tol).sum())


def test_chromium_draws_the_page(runs, tmp_path):
    """The browser is the oracle that the page draws: a screenshot of the two-run page holds
    many colours, both run colours in quantity, and the chart area is not blank."""
    tmp, a, b = runs
    page = tmp_path / "both.html"
    rc, _, err = ctitan(["report", a, b, "-o", page])
    assert rc == 0, err
    img = screenshot(page, tmp_path / "shot.png")
    assert img.size == (1200, 2400), img.size
    # anti-aliased curves make thousands of colours; the page without them (tables, axes,
    # swatches) has under 600
    assert len(img.getcolors(maxcolors=1 << 20)) > 1500, "the screenshot has too few colours: curves missing"
    for rgb in RUN_COLORS:
        # the swatches of the tables and legends alone are 1128 pixels of each run's colour
        n = color_pixels(img, rgb)
        assert n > 1128 + 600, f"run colour {rgb}: {n} pixels, too few for its curves"
    ink = (np.asarray(img) < 235).any(axis=2).mean()
    assert ink > 0.02, f"only {ink:.1%} of the screenshot is drawn on"


def test_png(runs, tmp_path):
    tmp, a, b = runs
    rc, out, err = ctitan(["report", a, b, "-o", tmp_path / "r.html", "--png"])
    assert rc == 0, err
    png = tmp_path / "r.png"
    assert str(png) in out
    img = Image.open(png)
    assert img.format == "PNG" and img.size == (1920, 840), (img.format, img.size)
    img = img.convert("RGB")
    assert len(img.getcolors(maxcolors=1 << 20)) > 1500, "too few colours: curves missing"
    for rgb in RUN_COLORS:
        # the legend swatch alone is 560 pixels (14 x 10 at twice the size)
        n = color_pixels(img, rgb)
        assert n > 560 + 1000, f"run colour {rgb}: {n} pixels, too few for its curves"
    rc, _, err = ctitan(["report", a, "-o", tmp_path / "one.html", "--png", tmp_path / "named.png"])
    assert rc == 0, err
    assert Image.open(tmp_path / "named.png").size == (1920, 840)
    assert color_pixels(Image.open(tmp_path / "named.png").convert("RGB"), RUN_COLORS[1]) == 0  # one run only


def test_png_dashes_what_the_page_dashes(tmp_path):
    """The PNG draws the page's chart (report/png.c): a logged loss curve, which the page draws
    without a stroke-dasharray, is solid in the PNG too. A flat loss of one run (no events,
    no validation, no smoothing) is one horizontal line: its pixels of the run's colour on
    the line's row form one unbroken stretch."""
    run = tmp_path / "flat"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0}) + "\n" for s in range(1, 21)))
    rc, _, err = ctitan(["report", run, "-o", tmp_path / "r.html", "--png", "--smoothing", "0"])
    assert rc == 0, err
    (line,) = read(tmp_path / "r.html").find("polyline", svg="chart-loss", data_run="flat", data_series="loss")
    assert "stroke-dasharray" not in line
    img = np.asarray(Image.open(tmp_path / "r.png").convert("RGB")).astype(int)
    mask = np.abs(img - np.array(RUN_COLORS[0])).max(axis=2) <= 6
    below_legend = 2 * 52  # the plot's top (chart.c: top 52), at the PNG's twice the size
    y = below_legend + int(mask[below_legend:].sum(axis=1).argmax())
    xs = np.nonzero(mask[y])[0]
    assert xs.size > 1000, f"row {y}: {xs.size} pixels of the run's colour"
    gaps = int(xs.max() - xs.min() + 1 - xs.size)
    assert gaps <= 2, f"the loss line is broken by {gaps} pixels on row {y}: drawn dashed"


def test_hostile_strings_escaped(runs, tmp_path):
    _, a, _ = runs
    bad = tmp_path / "run <b>&\"'"
    shutil.copytree(a, bad, ignore=shutil.ignore_patterns("checkpoint"))
    cfg = (bad / "config.toml").read_text()
    cfg = cfg.replace("[job]", '[job]\nhostile = "<script>alert(1)</script> & \\"q\\""', 1)
    (bad / "config.toml").write_text(cfg)
    ev = (bad / "events.jsonl").read_text().replace('"path":"', '"path":"<img src=x onerror=alert(1)>', 1)
    (bad / "events.jsonl").write_text(ev)
    rc, _, err = ctitan(["report", bad, "-o", tmp_path / "r.html"])
    assert rc == 0, err
    text = (tmp_path / "r.html").read_text()
    assert "<script" not in text and "<img" not in text and "<b>" not in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; &quot;q&quot;" in text
    assert "run &lt;b&gt;&amp;&quot;&#39;" in text
    page = read(tmp_path / "r.html")
    assert not page.find("script") and not page.find("img")
    row = [r for r in page.find("tr") if r.get("data-key") == "job.hostile"]
    assert row, "the hostile key is missing from the config table"


def test_extreme_values(tmp_path):
    """A diverged run's +-1e308 (a range past DBL_MAX) and a denormal draw finite coordinates."""
    run = tmp_path / "huge"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step":1,"loss":1e308}\n{"step":2,"loss":-1e308}\n{"step":3,"loss":1e-320}\n'
                                       '{"step":4,"lr":0.001}\n')
    rc, _, err = ctitan(["report", run])
    assert rc == 0, err
    page = read(run / "report.html")
    line = page.find("polyline", svg="chart-loss", data_series="loss")[0]
    assert line["data-points"] == "3"
    assert all(math.isfinite(float(v)) for p in line["points"].split() for v in p.split(",")), line["points"]
    assert "nan" not in (run / "report.html").read_text().lower()


def test_errors(runs, tmp_path):
    _, a, b = runs
    for args in (["--bogus", a], [a, "--smoothing", "1.5"], [a, "--smoothing=x"], [], [a, b], [a, "-o"]):
        rc, _, err = ctitan(["report", *args])
        assert rc == 2, (args, rc, err)
        assert "ctitan report --help" in err, err
    rc, _, err = ctitan(["report", tmp_path / "nope"])
    assert rc == 1 and str(tmp_path / "nope") in err, err
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = ctitan(["report", empty])
    assert rc == 1 and "metrics.jsonl" in err, err
    broken = tmp_path / "broken"
    shutil.copytree(a, broken, ignore=shutil.ignore_patterns("checkpoint"))
    lines = (broken / "metrics.jsonl").read_text().splitlines(keepends=True)
    lines[2] = "{not json\n"
    (broken / "metrics.jsonl").write_text("".join(lines))
    rc, _, err = ctitan(["report", broken, "-o", tmp_path / "r.html"])
    assert rc == 3 and "metrics.jsonl:3" in err, err
    assert not (tmp_path / "r.html").exists() and not any(tmp_path.glob("r.html*"))
    rc, out, _ = ctitan(["report", "--help"])
    assert rc == 0 and "--png" in out and "--smoothing" in out


def test_output_is_not_an_input(runs, tmp_path):
    """-o or --png naming a file report reads (directly, by another spelling, through a
    symbolic link or as a hard link) would replace the run's record with the page: refused
    (2), path named, the file untouched."""
    _, a, _ = runs
    x = tmp_path / "x"
    shutil.copytree(a, x, ignore=shutil.ignore_patterns("checkpoint"))
    before = {n: (x / n).read_bytes() for n in ("metrics.jsonl", "events.jsonl", "config.toml")}
    (tmp_path / "lnk").symlink_to(x / "metrics.jsonl")
    os.link(x / "config.toml", tmp_path / "hard")  # another name of the same file
    for args, named, what in (([x, "-o", x / "metrics.jsonl"], x / "metrics.jsonl", "metrics.jsonl"),
                              ([x, "-o", x / "config.toml"], x / "config.toml", "config.toml"),
                              ([x, "--png=" + str(x / "events.jsonl")], x / "events.jsonl", "events.jsonl"),
                              ([x, "-o", x / ".." / "x" / "metrics.jsonl"], x / ".." / "x" / "metrics.jsonl",
                               "metrics.jsonl"),
                              ([a, x, "-o", tmp_path / "lnk"], tmp_path / "lnk", "metrics.jsonl"),
                              ([x, "-o", tmp_path / "hard"], tmp_path / "hard", "config.toml")):
        rc, _, err = ctitan(["report", *args])
        assert rc == 2 and str(named) in err and f"is {what} of run" in err, (args, rc, err)
    assert {n: (x / n).read_bytes() for n in before} == before
    rc, _, err = ctitan(["report", x])  # the default page in the run folder is still fine
    assert rc == 0 and (x / "report.html").exists(), err


def test_malformed_lines(runs, tmp_path):
    """A known key of the wrong type or binary junk is a format error (3) naming file:line and
    the key; an empty metrics.jsonl is as good as none (1); a last line cut mid-object (a run
    killed while writing it) is dropped with a warning naming file:line."""
    _, a, _ = runs

    def broken(name, edit, fname="metrics.jsonl"):
        d = tmp_path / name
        shutil.copytree(a, d, ignore=shutil.ignore_patterns("checkpoint"))
        (d / fname).write_bytes(edit((d / fname).read_bytes()))
        return d

    def line2(b, old, new):
        lines = b.split(b"\n")
        assert old in lines[1], lines[1]
        lines[1] = lines[1].replace(old, new, 1)
        return b"\n".join(lines)

    nlines = (a / "metrics.jsonl").read_bytes().rstrip(b"\n").count(b"\n") + 1
    cases = [(broken("loss", lambda b: re.sub(rb'"loss": [0-9.e+-]+', b'"loss": "x"', b, count=1)),
              'metrics.jsonl:1: "loss" is not a number'),
             (broken("nul", lambda b: b + b"\0\1\2"), f"metrics.jsonl:{nlines + 1}: invalid JSON"),
             (broken("time", lambda b: line2(b, b'"time":', b'"time":"yesterday","was":'), "events.jsonl"),
              'events.jsonl:2: "time" is not a number ("yesterday")')]
    for d, want in cases:
        rc, _, err = ctitan(["report", d, "-o", tmp_path / "r.html"])
        assert rc == 3 and want in err, (d, rc, err)
    rc, _, err = ctitan(["report", broken("empty", lambda b: b""), "-o", tmp_path / "r.html"])
    assert rc == 1 and "metrics.jsonl: no step logged" in err, err
    d = broken("torn", lambda b: b.rstrip(b"\n")[:-25])
    rc, _, err = ctitan(["report", d, "-o", tmp_path / "r.html"])
    assert rc == 0 and f"metrics.jsonl:{nlines}: the last line is cut short" in err, err
