"""torchtitan's parallelism.pipeline_parallel_schedule_csv: every pipeline rank's order from a CSV file.

torchtitan 0.3 (distributed/pipeline_parallel.py, build_pipeline_schedule) builds the stages
from pipeline_parallel_schedule (their count per rank, the loop or the V placement), then
hands the file to torch's _PipelineScheduleRuntime._load_csv ("compute_only" format): row r is
rank r's actions as torch's _Action prints them ("2F0", "0B3", "1I2", "1W2"), an empty cell
torch's no-op; torch's _validate_schedule checks each stage's forwards and backwards.

1. The CSV of an order torch builds, written by torch's own _dump_csv and read back by its
   _load_csv to the same order, makes the dry run list that order and the bubble of the
   schedule of the name (GPipe, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble,
   DualPipeV: the loop and the V, whole and split backwards, DualPipeV's OVERLAP_F_B cells run
   as their forward then their backward, as ctitan's DualPipeV and torch's runtime run them).
2. Run under mpirun it trains bit for bit like ctitan's own order of that name, and like one
   process within test_pp.py's tolerance; so does a hand-written order no schedule builds.
3. What would not run is refused before any step (exit 2, the file and the cell named): a
   cell that is no action, a compute_comms action, a stage or micro-batch out of range, a stage
   on a rank that does not hold it, a missing forward, a second forward, a backward before its
   forward, W before its I, I and W under a schedule that runs whole backwards, an order that
   would deadlock (also under mpirun, where it would hang), a row count that is not the
   pipeline degree, a missing file (torchtitan's FileNotFoundError)."""
import re
import types

import pytest
from torch.distributed.pipelining.schedules import (PipelineScheduleMulti, ScheduleDualPipeV, ScheduleGPipe,
                                                    ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                                    ScheduleZBVZeroBubble)

import oracle
from test_dist import assert_same_run, train_args, weights
from test_dry_run import launch, ok
from test_pp import MB, PP, SCHED, assert_config_error, pp_run, run_bounded, setup, single  # noqa: F401 (fixtures)

CSV = "--parallelism.pipeline_parallel_schedule_csv"
P, M = 2, 4  # test_dist's 8 sequences a step in micro-batches of 2: 4 micro-batches


def torch_order(sched, S=2):
    """torch's pipeline_order of the schedule for P ranks and M micro-batches: {rank: [_Action
    or None]}, its compute actions only (GPipe's adds REDUCE_GRAD, a communication action the
    compute_only format does not hold)."""
    if sched == "DualPipeV":  # its OVERLAP_F_B pairs: "(0F4;3B1)OVERLAP_F_B" cells
        fake = types.SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=P * S)
        order = {r: ScheduleDualPipeV._calculate_single_rank_operations(fake, r) for r in range(P)}
    elif sched == "GPipe":
        order = ScheduleGPipe._get_pipeline_order(types.SimpleNamespace(_num_stages=P, _n_microbatches=M))
    elif sched == "ZBVZeroBubble":
        fake = types.SimpleNamespace(pp_group_size=P, _n_microbatches=M, num_stages=P * S)
        order = {r: ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r) for r in range(P)}
    else:
        cls = ScheduleInterleaved1F1B if sched == "Interleaved1F1B" else ScheduleInterleavedZeroBubble
        rounds = max(1, M // P)
        fake = types.SimpleNamespace(pp_group_size=P, n_local_stages=S, _n_microbatches=M, number_of_rounds=rounds,
                                     microbatches_per_round=M // rounds)
        fake.pipeline_order = {r: cls._calculate_single_rank_operations(fake, r) for r in range(P)}
        if cls is ScheduleInterleavedZeroBubble:  # its no-ops: empty cells
            fake.pipeline_order = cls._add_bubbles_to_actions(fake, S * P)
        order = fake.pipeline_order
    return {r: [a for a in acts if a is None or a.is_compute_op] for r, acts in order.items()}


def write_csv(path, order, stages):
    """The file torch's _dump_csv writes; torch's _load_csv (with its _validate_schedule) reads
    it back to the same order."""
    PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=order), path)
    back = types.SimpleNamespace(pipeline_order={}, pp_group_size=P, _num_stages=stages, _n_microbatches=M,
                                 _stages=[])
    back._validate_and_set_stage_mapping = lambda acts: PipelineScheduleMulti._validate_and_set_stage_mapping(
        back, acts)
    PipelineScheduleMulti._load_csv(back, path)
    assert back.pipeline_order == order, (back.pipeline_order, order)
    return path


def rank_orders(out):
    return {int(r): o.split() for r, o in re.findall(r"^    rank (\d+) order: (.*)$", out, re.M)}


def dry(setup, tmp_path, sched, *extra):
    d, data = setup
    return launch(0, train_args(d / "model", data, tmp_path / "out", f"{PP}={P}", f"{SCHED}={sched}", f"{MB}=2",
                                *extra) + ["--dry-run"])


# --------------------------------------------------------------------------- 1. torch's orders

SCHEDS = ["GPipe", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]


@pytest.mark.parametrize("sched", SCHEDS)
def test_torch_csv_dry_run_lists_its_order(setup, tmp_path, sched):
    """The dry run lists each rank's order as the file holds it (torch's, its no-ops left out),
    the order and bubble ctitan's own schedule of that name has."""
    order = torch_order(sched)
    f = write_csv(tmp_path / "s.csv", order, P * (1 if sched == "GPipe" else 2))
    got = ok(dry(setup, tmp_path, sched, f"{CSV}={f}")).stdout
    assert f'order: pipeline_parallel_schedule_csv "{f}"' in got, got
    # DualPipeV's pairs run as their forward, then their backward (torch's runtime without an overlap function)
    assert rank_orders(got) == {r: [str(x) for a in order[r] if a is not None for x in (a.sub_actions or (a,))]
                                for r in range(P)}, got
    own = ok(dry(setup, tmp_path, sched)).stdout
    bubble = re.compile(r"^  bubble: .*$", re.M)
    assert rank_orders(own) == rank_orders(got) and bubble.findall(own) == bubble.findall(got), (own, got)


# --------------------------------------------------------------------------- 2. runs

@pytest.mark.parametrize("sched", SCHEDS)
def test_torch_csv_trains_as_its_schedule(setup, single, tmp_path, sched):
    """Losses, validation losses and final weights equal the run of ctitan's own order of the
    name bit for bit, and one process's within test_pp.py's tolerance."""
    f = write_csv(tmp_path / "s.csv", torch_order(sched), P * (1 if sched == "GPipe" else 2))
    out, p = pp_run(setup, f"csv_{sched}", P, f"{PP}={P}", f"{SCHED}={sched}", f"{MB}=2", f"{CSV}={f}")
    assert f"({sched}, the order of {f})" in p.stderr, p.stderr[-2000:]
    own, _ = pp_run(setup, f"csv_own_{sched}", P, f"{PP}={P}", f"{SCHED}={sched}", f"{MB}=2")
    rows = lambda o: [r for r in oracle.read_metrics(o / "metrics.jsonl") if "loss" in r or "val_loss" in r]
    keys = ("step", "loss", "val_loss", "grad_norm")
    assert [{k: r.get(k) for k in keys} for r in rows(out)] == [{k: r.get(k) for k in keys} for r in rows(own)]
    a, b = weights(out), weights(own)
    assert a.keys() == b.keys() and not [k for k in b if a[k].tobytes() != b[k].tobytes()]
    assert_same_run(out, single("model"), f"CSV {sched}")


HAND = ["0F0,0F1,0F2,0B1,0F3,0B0,0B2,0B3",  # backwards out of micro-batch order, as no schedule runs them
        "1F0,1F1,1B1,1F2,1B0,1F3,1B3,1B2"]


def test_hand_written_order_trains_as_one_process(setup, single, tmp_path):
    """An order of its own (1F1B's stages: one a rank, the backwards out of order) trains like
    one process."""
    f = tmp_path / "hand.csv"
    f.write_text("\n".join(HAND) + "\n")
    got = ok(dry(setup, tmp_path, "1F1B", f"{CSV}={f}")).stdout
    assert rank_orders(got) == {r: row.split(",") for r, row in enumerate(HAND)}, got
    out, _ = pp_run(setup, "csv_hand", P, f"{PP}={P}", f"{SCHED}=1F1B", f"{MB}=2", f"{CSV}={f}")
    assert_same_run(out, single("model"), "hand-written CSV")


# --------------------------------------------------------------------------- 3. refusals

GPIPE = ["0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3", "1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3"]


def zbv_w_before_i():
    """torch's ZBV order with rank 1's first W moved before its I."""
    rows = [",".join(str(a) if a else "" for a in acts) for acts in torch_order("ZBVZeroBubble").values()]
    cells = rows[1].split(",")
    i, w = cells.index("2I0"), cells.index("2W0")
    cells[i], cells[w] = cells[w], cells[i]
    return [rows[0], ",".join(cells)]


BAD = {  # name: (schedule, rows (None: no file), words the error holds)
    "bad cell": ("1F1B", [GPIPE[0], GPIPE[1].replace("1B2", "1X2")], ["row 2", "cell 7", '"1X2"', "not an action"]),
    "no micro-batch": ("1F1B", [GPIPE[0].replace("0F3", "0F"), GPIPE[1]], ["row 1", "cell 4", "no micro-batch"]),
    "comms": ("1F1B", [GPIPE[0] + ",0SEND_F3", GPIPE[1]], ["cell 9", "SEND_F", "compute_comms"]),
    "missing forward": ("1F1B", [GPIPE[0], GPIPE[1].replace("1F3,", "").replace(",1B3", "")],
                        ["row 2", "stage 1 micro-batch 3 has no forward"]),
    "missing backward": ("1F1B", [GPIPE[0].replace(",0B3", ""), GPIPE[1]], ["row 1", "stage 0 micro-batch 3",
                                                                          "no backward"]),
    "second forward": ("1F1B", [GPIPE[0] + ",0F2", GPIPE[1]], ["cell 9", "second forward", "cell 3"]),
    "backward first": ("1F1B", [GPIPE[0], "1B0," + GPIPE[1].replace(",1B0", "")], ["row 2", "cell 1",
                                                                                     "before its forward"]),
    "W before I": ("ZBVZeroBubble", zbv_w_before_i(), ["row 2", '"2W0"', "before its I"]),
    "I under 1F1B": ("1F1B", [GPIPE[0].replace("0B0", "0I0,0W0"), GPIPE[1]], ["cell 5", '"0I0"', "1F1B",
                                                                             "whole backwards"]),
    "wrong owner": ("1F1B", [GPIPE[0] + ",1F0", GPIPE[1]], ["row 1", "cell 9", "stage 1 is held by pipeline rank 1"]),
    "V owner": ("ZBVZeroBubble", [",".join(str(a) if a else "" for a in acts).replace("3", "2")
                                  for acts in torch_order("ZBVZeroBubble").values()],
                ["row 1", "stage 2 is held by pipeline rank 1", "the V"]),
    "stage range": ("1F1B", [GPIPE[0] + ",2F0", GPIPE[1]], ["cell 9", "stage 2", "2 stages"]),
    "micro-batch range": ("1F1B", [GPIPE[0], GPIPE[1].replace("1B3", "1B4")], ["cell 8", "micro-batch 4",
                                                                              "has 4"]),
    "deadlock": ("1F1B", ["0F0,0B0,0F1,0F2,0F3,0B1,0B2,0B3", "1F0,1F1,1B0,1F2,1F3,1B1,1B2,1B3"],
                 ["row 1", "cell 2", '"0B0"', "deadlock", "row 2 waits at cell 2 (1F1)"]),
    "rows": ("1F1B", GPIPE[:1], ["1 rows", "pipeline_parallel_degree is 2"]),
    "missing file": ("1F1B", None, ["does not exist", "FileNotFoundError"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_refused_naming_file_and_cell(setup, tmp_path, name):
    sched, rows, words = BAD[name]
    f = tmp_path / "bad.csv"
    if rows is not None:
        f.write_text("\n".join(rows) + "\n")
    p = dry(setup, tmp_path, sched, f"{CSV}={f}")
    assert_config_error(p, "pipeline_parallel_schedule_csv", f'"{f}"', *words)


def test_deadlock_refused_under_mpirun(setup, tmp_path):
    """Run, the order that would hang is refused on every rank before a step (rank 0 says it)."""
    d, data = setup
    f = tmp_path / "dead.csv"
    f.write_text("\n".join(BAD["deadlock"][1]) + "\n")
    p = run_bounded(P, train_args(d / "model", data, tmp_path / "out", f"{PP}={P}", f"{MB}=2", f"{CSV}={f}"), 60)
    assert_config_error(p, str(f), "would deadlock", "cell 2")
