"""torchtitan's pipeline split keys: `pipeline_parallel_layers_per_stage`,
`pipeline_parallel_first_stage_less_layers` and `pipeline_parallel_last_stage_less_layers`.

The oracle is torchtitan itself (0.3.0, installed without its dependencies by
scripts/setup.sh): its `_get_pipeline_metadata` (how many stages) and
`_generate_llm_fqn_per_model_part` (which layers each holds), taken from its installed
source and run as they are, with torch's own `get_schedule_class`. Each case's split is
read off ctitan's `--dry-run` (a line per pipeline rank with its stages' layers); where
torchtitan raises, ctitan must refuse (exit 2) naming the key. torchtitan builds a stage
around the embedding or the head alone where its arithmetic leaves one without a layer;
ctitan's stages hold at least one layer, so there it must refuse and say so.
"""
import ast
import importlib.util
import math
import re
import types
from pathlib import Path

import pytest

import oracle
from test_dry_run import launch

schedules = pytest.importorskip("torch.distributed.pipelining.schedules")

KEYS = ("pipeline_parallel_layers_per_stage", "pipeline_parallel_first_stage_less_layers",
        "pipeline_parallel_last_stage_less_layers")


def _torchtitan():
    """torchtitan's two functions, compiled from its installed source without importing the
    package (its __init__ pulls in dependencies the test venv does not install)."""
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None, "torchtitan is not installed: run scripts/setup.sh"
    src = Path(spec.submodule_search_locations[0]) / "distributed" / "pipeline_parallel.py"
    tree = ast.parse(src.read_text())
    keep = [n for n in tree.body if isinstance(n, ast.FunctionDef)
            and n.name in ("_get_pipeline_metadata", "_generate_llm_fqn_per_model_part")]
    assert len(keep) == 2, f"{src}: the split functions moved"
    for fn in keep:  # its annotations name torchtitan's classes, which are not imported here
        fn.returns = None
        for a in fn.args.args + fn.args.kwonlyargs:
            a.annotation = None
    ns = {"math": math, "get_schedule_class": schedules.get_schedule_class,
          "PipelineScheduleSingle": schedules.PipelineScheduleSingle}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(src), "exec"), ns)
    return ns["_get_pipeline_metadata"], ns["_generate_llm_fqn_per_model_part"]


def torchtitan_split(L, P, schedule, k, first, last):
    """Each stage's layer numbers as torchtitan places them, or the ValueError it raises."""
    metadata, fqns = _torchtitan()
    par = types.SimpleNamespace(pipeline_parallel_schedule=schedule, pipeline_parallel_layers_per_stage=k,
                                pipeline_parallel_first_stage_less_layers=1 if first is None else first,
                                pipeline_parallel_last_stage_less_layers=1 if last is None else last)
    try:
        V, n, w_in, w_out = metadata(types.SimpleNamespace(pp=P), par, types.SimpleNamespace(layers=[None] * L))
        parts = fqns(V, n, w_in, w_out)
    except ValueError as err:
        return err
    return [[int(m.split(".")[1]) for m in part if m.startswith("layers.")] for part in parts]


def ctitan_split(out, P, V, v_style):
    """Stage -> its layers, from the dry run's `pipeline rank r: layers a-b, c, ...` lines."""
    stages = {}
    for r, spans in re.findall(r"^  pipeline rank (\d+): layers ([0-9, -]+?)(?:, embedding|, final norm|:)", out,
                               re.M):
        r = int(r)
        mine = [r, V - 1 - r] if v_style else list(range(r, V, P))
        groups = [g.strip() for g in spans.split(",")]
        assert len(groups) == len(mine), out
        for s, g in zip(mine, groups):
            a, _, b = g.partition("-")
            stages[s] = list(range(int(a), int(b or a) + 1))
    return [stages[s] for s in sorted(stages)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("lps")
    for L in (4, 7, 8):
        oracle.tiny_config(vocab=64, hidden=16, inter=32, layers=L, heads=2, kv_heads=1, head_dim=8
                           ).save_pretrained(d / f"L{L}")
    data = oracle.write_bin(d / "t.bin", oracle.random_tokens(40 * 17, 64, seed=1))
    return d, data


def dry(models, L, P, schedule, k, first, last, local=8):
    d, data = models
    args = ["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={d / f'L{L}'}",
            f"--training.dataset_path={data}", "--training.seq_len=16", f"--training.local_batch_size={local}",
            f"--parallelism.pipeline_parallel_degree={P}", f"--parallelism.pipeline_parallel_schedule={schedule}"]
    for key, v in zip(KEYS, (k, first, last)):
        if v is not None:
            args.append(f"--parallelism.{key}={v}")
    p = launch(0, args)
    return p.returncode, p.stdout + p.stderr


# (layers, degree, schedule, layers_per_stage, first_stage_less_layers, last_stage_less_layers);
# None: the key is not given. Splits torchtitan makes and ones it refuses, on every schedule kind.
CASES = [
    (8, 2, "1F1B", 5, None, None),          # 10 effective layers in 2 stages
    (8, 2, "1F1B", None, 3, None),          # the default stage count, the embedding weighted 3
    (8, 2, "GPipe", None, 0, 2),
    (7, 2, "1F1B", 4, 0, 1),                # uneven: 8 effective in 2
    (8, 2, "Interleaved1F1B", 3, None, None),  # 4 stages, the first two one layer more
    (8, 2, "Interleaved1F1B", 2, 0, 0),
    (7, 2, "LoopedBFS", 2, 1, 0),
    (8, 2, "InterleavedZeroBubble", 3, 2, None),
    (8, 2, "ZBVZeroBubble", 3, None, None),    # a V: rank 0 holds stages 0 and 3
    (8, 2, "DualPipeV", None, 1, 2),
    (8, 4, "1F1B", 3, 2, 0),
    (8, 2, "1F1B", 2, None, None),          # 5 stages: not a multiple of the degree
    (8, 2, "1F1B", 3, None, None),          # 4 stages: a single-stage schedule takes 2
    (8, 2, "Interleaved1F1B", 10, None, None),  # 1 stage a rank for a looped schedule
    (8, 2, "1F1B", None, 6, None),          # the embedding's weight above the smallest share
    (8, 2, "1F1B", None, None, 6),
    (4, 2, "Interleaved1F1B", 1, 0, 2),     # a stage over 0 layers: torchtitan's check
    (4, 2, "Interleaved1F1B", 2, 2, 2),     # torchtitan leaves stage 0 the embedding alone
]


@pytest.mark.parametrize("L,P,schedule,k,first,last", CASES)
def test_split_is_torchtitans(models, L, P, schedule, k, first, last):
    want = torchtitan_split(L, P, schedule, k, first, last)
    rc, out = dry(models, L, P, schedule, k, first, last)
    if isinstance(want, ValueError):
        assert rc == 2, f"torchtitan refuses ({want}); ctitan exited {rc}:\n{out[-2000:]}"
        assert "parallelism.pipeline_parallel_" in out and "error" in out, out[-2000:]
        return
    if any(not part for part in want):  # a stage of the embedding or head alone
        assert rc == 2 and "without a layer" in out, f"torchtitan's split {want}; ctitan exited {rc}:\n{out[-2000:]}"
        return
    assert rc == 0, f"torchtitan splits {want}; ctitan exited {rc}:\n{out[-2000:]}"
    v_style = schedule in ("ZBVZeroBubble", "DualPipeV")
    assert ctitan_split(out, P, len(want), v_style) == want, out


def test_the_keys_change_the_split(models):
    """The oracle's splits differ from ctitan's own split by cost, so the cases above can fail."""
    rc0, by_cost = dry(models, 8, 2, "1F1B", None, None, None)
    rc1, even = dry(models, 8, 2, "1F1B", None, None, 6 - 1)
    assert rc0 == 0 and rc1 == 0, by_cost + even
    assert ctitan_split(by_cost, 2, 2, False) != ctitan_split(even, 2, 2, False)
    assert ctitan_split(even, 2, 2, False) == torchtitan_split(8, 2, "1F1B", None, None, 5)


def test_split_points_beside_the_keys_is_refused(models):
    d, data = models
    for key in KEYS:
        p = launch(0, ["train", "--dry-run", "--model.spec=hf", f"--model.hf_assets_path={d / 'L8'}",
                       f"--training.dataset_path={data}", "--training.seq_len=16", "--training.local_batch_size=4",
                       "--parallelism.pipeline_parallel_degree=2",
                       "--parallelism.pipeline_parallel_split_points=layers.4", f"--parallelism.{key}=2"])
        assert p.returncode == 2, p.stdout + p.stderr
        assert "pipeline_parallel_split_points" in p.stderr and key in p.stderr, p.stderr


# ---------------------------------------------------------------- module_fqns_per_model_part

def _fqns_toml(parts):
    return "[" + ", ".join("[" + ", ".join(f'"{m}"' for m in part) + "]" for part in parts) + "]"


def dry_fqns(models, L, P, schedule, parts, extra=()):
    d, data = models
    f = d / f"fqns_{abs(hash((L, P, schedule, str(parts), extra)))}.toml"
    f.write_text(f"""[model]
spec = "hf"
hf_assets_path = "{d / f'L{L}'}"
[training]
dataset_path = "{data}"
seq_len = 16
local_batch_size = 8
[parallelism]
pipeline_parallel_degree = {P}
pipeline_parallel_schedule = "{schedule}"
module_fqns_per_model_part = {_fqns_toml(parts)}
""")
    p = launch(0, ["train", "--dry-run", "--config", f, *extra])
    return p.returncode, p.stdout + p.stderr


def _torchtitan_parts(V, L, w_in, w_out, head="output"):
    _, fqns = _torchtitan()
    return [[head if m == "output" else m for m in part] for part in fqns(V, L, w_in, w_out)]


@pytest.mark.parametrize("L,P,schedule,V,w_in,w_out,head", [
    (8, 2, "1F1B", 2, 1, 1, "output"),            # torchtitan's own model's names
    (8, 2, "1F1B", 2, 3, 0, "lm_head"),           # its Hugging Face backend's
    (7, 2, "Interleaved1F1B", 4, 0, 1, "output"),
    (8, 2, "ZBVZeroBubble", 4, 1, 1, "output"),
])
def test_module_fqns_place_the_layers_as_torchtitan_lists_them(models, L, P, schedule, V, w_in, w_out, head):
    """The lists torchtitan's own generator makes, given to ctitan as the key: each stage
    holds the layers its list names."""
    parts = _torchtitan_parts(V, L, w_in, w_out, head)
    rc, out = dry_fqns(models, L, P, schedule, parts)
    assert rc == 0, out[-2000:]
    want = [[int(m.split(".")[1]) for m in part if m.startswith("layers.")] for part in parts]
    assert ctitan_split(out, P, V, schedule == "ZBVZeroBubble") == want, out


@pytest.mark.parametrize("parts,words", [
    ([["tok_embeddings", "layers.0", "layers.1"], ["layers.3", "layers.2", "layers.4", "layers.5", "layers.6",
                                                  "layers.7", "norm", "output"]], "layers.2 comes next"),
    ([["layers.0", "layers.1"], ["tok_embeddings", "layers.2", "layers.3", "layers.4", "layers.5", "layers.6",
                                 "layers.7", "norm", "output"]], "on the first stage"),
    ([["tok_embeddings", "layers.0", "norm"], ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5",
                                               "layers.6", "layers.7", "output"]], "on the last stage"),
    ([["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "layers.6",
                                       "layers.7", "norm"]], "must hold norm and output"),
    ([["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3"], ["layers.4", "layers.5", "layers.6",
                                                                          "norm", "output"]], "every layer"),
    ([["tok_embeddings", "layers.0", "rope"], ["layers.1", "layers.2", "layers.3", "layers.4", "layers.5",
                                               "layers.6", "layers.7", "norm", "output"]], "\"rope\" is not a module"),
    ([["tok_embeddings"], ["layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "layers.6",
                           "layers.7", "norm", "output"]], "stage 0 holds no layer"),
])
def test_module_fqns_refused_with_the_stage_and_name(models, parts, words):
    rc, out = dry_fqns(models, 8, 2, "1F1B", parts)
    assert rc == 2 and "module_fqns_per_model_part" in out and words in out, out[-2000:]


def test_module_fqns_beside_another_split_is_refused(models):
    parts = _torchtitan_parts(2, 8, 1, 1)
    for extra in ("--parallelism.pipeline_parallel_split_points=layers.4",
                  "--parallelism.pipeline_parallel_layers_per_stage=5"):
        rc, out = dry_fqns(models, 8, 2, "1F1B", parts, (extra,))
        assert rc == 2 and "both place the layers" in out and extra.split("=")[0][2:].split(".")[1] in out, out


def test_module_fqns_run_matches_one_process_and_its_config_reads_back(models, tmp_path):
    """A real 2-rank pipeline run placed by the key trains as one process does, and the
    config.toml it writes holds the list of lists as TOML (Python's tomllib the reader)."""
    import tomllib
    from test_dist import losses, run, train_args
    d, data = models
    parts = _torchtitan_parts(2, 4, 0, 2, "lm_head")  # stage 0: layers 0-2, stage 1: layer 3 and the head
    single = run(1, train_args(d / "L4", data, tmp_path / "one"))
    pp = run(2, train_args(d / "L4", data, tmp_path / "pp", "--parallelism.pipeline_parallel_degree=2",
                           f"--parallelism.module_fqns_per_model_part={_fqns_toml(parts)}"))
    assert losses(tmp_path / "pp") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)
    conf = tomllib.loads((tmp_path / "pp" / "config.toml").read_text())
    assert conf["parallelism"]["module_fqns_per_model_part"] == parts
    assert single.returncode == 0
