"""Review of parallelism.pipeline_parallel_schedule_csv (10ab5f6) beyond test_pp_csv.py.

1. Each machine reads its own copy of the file (the key is a path, compared across ranks only
   as set / unset): copies that differ must be refused on every rank before a step, never hang
   (a copy missing or refused on one rank alone) nor train other numbers at exit 0 (a rank that
   runs another row than its neighbours expect takes one micro-batch's gradient for another's).
   mpirun's MPMD form gives each rank its own command line, as two machines' disks would.
2. The cell format read as torch's _load_csv reads it (csv.reader, _Action.from_str's strip):
   blanks around cells, empty cells, rows of other lengths, quotes, CRLF; and what torch
   refuses (a header, a blank row, a lowercase kind, a blank inside a cell) refused.
3. A ZBV file whose Ws all run last (8 pending Ws a rank, more than ZBVZeroBubble's own order
   keeps): the W stores sized by the file's peak, the run equal to one process.
4. A MoE with the aux loss in the gradient under a hand-written order whose backwards run out
   of micro-batch order: the expert counts travel with their own micro-batch."""
import re
import subprocess
import time
import types

import pytest
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

import oracle
from test_dist import ENV, STEPS, assert_same_run, mpirun, train_args
from test_pp import BIN, MB, PP, SCHED, assert_config_error, pp_run, setup, single  # noqa: F401 (fixtures)
from test_pp_csv import CSV, HAND, dry, rank_orders, torch_order

GPIPE = ["0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3", "1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3"]


# --------------------------------------------------------------------------- 1. copies that differ

def mpmd(setup, tmp_path, files, timeout=60):
    """One rank per file (rank r reads files[r]), PP 2 in micro-batches of 2, bounded: a hang
    fails the test saying so."""
    d, data = setup
    cmd = mpirun()
    for r, f in enumerate(files):
        cmd += [":"] if r else []
        cmd += ["-np", "1", str(BIN)] + [str(a) for a in train_args(d / "model", data, tmp_path / "out", f"{PP}=2",
                                                                     f"{MB}=2", f"{CSV}={f}")]
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    t0 = time.time()
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
        pytest.fail(f"no exit within {timeout} s (hung) where a config error was expected", pytrace=False)
    assert time.time() - t0 < timeout
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def write(tmp_path, name, rows):
    f = tmp_path / name
    f.write_text("\n".join(rows) + "\n")
    return f


DIFFER = {  # name: (rank 0's rows, rank 1's rows (None: no file), words the error holds)
    # rank 1's row differs: before, exit 0 with other losses from step 2 on
    "rank 1's row": (GPIPE, [GPIPE[0], HAND[1]], ["differ", "same file"]),
    # rank 0's copy has another row 1 (rank 1's own copy the same order): before, exit 0 with
    # other losses or a hang
    "rank 1's row in rank 0's copy": ([GPIPE[0], HAND[1]], GPIPE, ["differ", "same file"]),
    # rank 1's copy would deadlock (rank 0's row of HAND against GPipe's row 1): before, a hang
    "deadlock in rank 1's copy": (GPIPE, [HAND[0], GPIPE[1]], ["rank 1 of 2", "would deadlock"]),
    # the file missing on rank 1 alone: before, a hang (rank 0 waited in the next collective)
    "missing on rank 1": (GPIPE, None, ["rank 1 of 2", "does not exist"]),
    # refused on rank 1 alone: before, a hang
    "refused on rank 1": (GPIPE, [GPIPE[0], GPIPE[1].replace(",1B3", "")], ["rank 1 of 2", "no backward"]),
}


@pytest.mark.parametrize("name", list(DIFFER))
def test_copies_that_differ_are_refused_on_every_rank(setup, tmp_path, name):
    a, b, words = DIFFER[name]
    fa = write(tmp_path, "a.csv", a)
    fb = write(tmp_path, "b.csv", b) if b is not None else tmp_path / "missing.csv"
    p = mpmd(setup, tmp_path, [fa, fb])
    assert_config_error(p, "pipeline_parallel_schedule_csv", *words)


# --------------------------------------------------------------------------- 2. the cell format

GOOD = {  # name: the file's text, which torch's _load_csv reads to GPIPE
    "blanks around cells": " 0F0 , 0F1,0F2 ,0F3,0B0,0B1,0B2,0B3\n\t1F0\t,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n",
    "empty cells": "0F0,,0F1,0F2,0F3,0B0,0B1,0B2,0B3,,,\n,1F0,1F1,1F2,1F3,1B0,1B1,1B2,1B3\n",
    "quoted cells": '"0F0",0F1,0F2,0F3,0B0,0B1,0B2,"0B3"\n' + GPIPE[1] + "\n",
    "CRLF, no final newline": GPIPE[0] + "\r\n" + GPIPE[1],
    "leading zeros": GPIPE[0].replace("0F1", "00F01") + "\n" + GPIPE[1] + "\n",
}
BAD = {  # name: the file's text, which torch's _load_csv refuses
    "header": "rank0,rank1\n" + "\n".join(GPIPE) + "\n",
    "blank last row": "\n".join(GPIPE) + "\n\n",
    "blank row between": GPIPE[0] + "\n\n" + GPIPE[1] + "\n",
    "lowercase kind": GPIPE[0].replace("0F1", "0f1") + "\n" + GPIPE[1] + "\n",
    "blank inside a cell": GPIPE[0].replace("0F1", "0 F1") + "\n" + GPIPE[1] + "\n",
}


def torch_load(path, stages=2):
    """torch's _load_csv with its _validate_schedule: {rank: [str(action)]} or the exception."""
    back = types.SimpleNamespace(pipeline_order={}, pp_group_size=2, _num_stages=stages, _n_microbatches=4,
                                 _stages=[])
    back._validate_and_set_stage_mapping = lambda acts: PipelineScheduleMulti._validate_and_set_stage_mapping(
        back, acts)
    try:
        PipelineScheduleMulti._load_csv(back, str(path))
    except (RuntimeError, AssertionError, ValueError) as ex:
        return ex
    return {r: [str(a) for a in acts if a is not None] for r, acts in back.pipeline_order.items()}


@pytest.mark.parametrize("name", list(GOOD))
def test_cells_read_as_torch_reads_them(setup, tmp_path, name):
    f = tmp_path / "s.csv"
    f.write_bytes(GOOD[name].encode())
    want = torch_load(f)
    assert want == {r: row.split(",") for r, row in enumerate(GPIPE)}, want
    p = dry(setup, tmp_path, "1F1B", f"{CSV}={f}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert rank_orders(p.stdout) == want, p.stdout


@pytest.mark.parametrize("name", list(BAD))
def test_cells_torch_refuses_are_refused(setup, tmp_path, name):
    f = tmp_path / "s.csv"
    f.write_bytes(BAD[name].encode())
    assert isinstance(torch_load(f), Exception)
    p = dry(setup, tmp_path, "1F1B", f"{CSV}={f}")
    assert_config_error(p, "pipeline_parallel_schedule_csv", f'"{f}"')


# --------------------------------------------------------------------------- 3. W stores

def zbv_ws_last():
    """torch's ZBVZeroBubble order with every W moved to the end of its row (in its order)."""
    rows = []
    for acts in torch_order("ZBVZeroBubble").values():
        cells = [str(a) for a in acts if a is not None]
        rows.append(",".join([c for c in cells if "W" not in c] + [c for c in cells if "W" in c]))
    return rows


def test_zbv_file_with_every_w_last_trains_as_one_process(setup, single, tmp_path):
    """8 pending Ws a rank (2 stages x 4 micro-batches; ZBVZeroBubble's own order keeps 2 and
    3): the dry run's weight-gradient stores (their count and bytes, from the file's order) are
    what the run allocates on each rank, and the run equals one process."""
    d, data = setup
    rows = zbv_ws_last()
    f = write(tmp_path, "wlast.csv", rows)
    got = dry(setup, tmp_path, "ZBVZeroBubble", f"{CSV}={f}")
    assert got.returncode == 0, got.stderr[-2000:]
    assert rank_orders(got.stdout) == {r: row.split(",") for r, row in enumerate(rows)}
    planned = {int(r): (int(n), int(b)) for r, b, n in
               re.findall(r"pipeline rank (\d+): .*weight-gradient stores (\d+) \((\d+) of them\)", got.stdout)}
    assert planned == {0: (8, planned[0][1]), 1: (8, planned[1][1])}, got.stdout
    out = tmp_path / "csv_wlast"
    p = subprocess.run(mpirun() + ["-np", "2", str(BIN)] + [str(a) for a in train_args(
        d / "model", data, out, f"{PP}=2", f"{SCHED}=ZBVZeroBubble", f"{MB}=2", f"{CSV}={f}")],
        env=dict(ENV, CTITAN_LOG_RANKS="all"), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    held = {int(r): (int(n), int(b)) for r, n, b in
            re.findall(r"pipeline rank (\d+) of 2: the weight-gradient stores .*their (\d+) buffers take (\d+) bytes",
                       p.stderr)}
    assert held == planned, (held, planned)
    assert_same_run(out, single("model"), "ZBV, every W last")


# --------------------------------------------------------------------------- 4. MoE aux loss

def test_moe_aux_loss_under_out_of_order_backwards(setup, single, tmp_path):
    """HAND runs rank 0's backwards 1, 0, 2, 3 and rank 1's 1, 0, 3, 2: each micro-batch's
    expert counts (the aux loss's gradient) must be its own."""
    f = write(tmp_path, "hand.csv", HAND)
    out, _ = pp_run(setup, "csv_moe_aux_hand", 2, f"{PP}=2", f"{MB}=2", f"{CSV}={f}", model="model_moe_aux")
    ref = single("model_moe_aux")
    assert_same_run(out, ref, "MoE aux, hand-written CSV")
    got = {r["step"]: r for r in oracle.read_metrics(out / "metrics.jsonl") if "loss" in r}
    want = {r["step"]: r for r in oracle.read_metrics(ref / "metrics.jsonl") if "loss" in r}
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    for s in want:
        for k in ("grad_norm", "aux_loss"):
            assert abs(got[s][k] - want[s][k]) <= 1e-5 * abs(want[s][k]), (s, k, got[s][k], want[s][k])


# --------------------------------------------------------------------------- 5. layouts and features

BF16 = "--training.mixed_precision_param=bfloat16"
FSDP2 = "--parallelism.data_parallel_shard_degree=2"
TP2 = ["--parallelism.tensor_parallel_degree=2", "--parallelism.data_parallel_shard_degree=1"]
CSV_LAYOUTS = {  # name: (ranks, data-parallel ranks, model, micro-batch (4 a step), extra args, the one-process run)
    "pp2_fsdp2": (4, 2, "model", 1, [FSDP2], ()),
    "pp2_tp2": (4, 1, "model_tp", 2, TP2, ()),
    "ac_full": (2, 1, "model", 2, ["--activation_checkpoint.mode=full"], ()),
    "ac_op": (2, 1, "model", 2, ["--activation_checkpoint.mode=selective",
                                 "--activation_checkpoint.selective_ac_option=op"], ()),
    # bf16 with GPipe's order under 1F1B's name: the backwards in micro-batch order, so each
    # weight gradient summed as by one process (HAND's 0B1 before 0B0 sums the embedding's
    # gradient in another order: 2.5e-5 norm-wise after 10 bf16 steps, rounding, not the order)
    "bf16": (2, 1, "model", 2, [BF16], (BF16,)),
}
ORDER = {"bf16": GPIPE}


@pytest.mark.parametrize("name", list(CSV_LAYOUTS))
def test_hand_written_order_under_layouts(setup, single, tmp_path, name):
    """HAND (1F1B's stages, backwards out of micro-batch order) under FSDP, TP and activation
    checkpointing; GPipe's order under bf16 (the one-process bf16 run's micro-batches: the same
    roundings)."""
    n, dp, model, mb, extra, ref = CSV_LAYOUTS[name]
    f = write(tmp_path, "hand.csv", ORDER.get(name, HAND))
    out, p = pp_run(setup, f"csv_hand_{name}", n, f"{PP}=2", f"{MB}={mb}", f"{CSV}={f}", *extra, model=model, dp=dp)
    assert "the order of" in p.stderr, p.stderr[-2000:]
    assert_same_run(out, single(model, *ref), f"hand-written CSV {name}")


def test_hand_written_order_with_lora(setup, tmp_path):
    """LoRA (rank 4, dropout 0.1: each micro-batch's masks its own, whichever order its
    backward runs in) against one process with the same micro-batches."""
    from test_pp import lora_args, lora_model
    d, data = setup
    model = lora_model(setup)
    lora = lora_args(model, 0.1)
    f = write(tmp_path, "hand.csv", HAND)
    ref, out = tmp_path / "lora_single", tmp_path / "lora_csv"
    subprocess.run([str(BIN)] + [str(a) for a in train_args(model, data, ref, *lora)], env=ENV, check=True,
                   capture_output=True, timeout=300)
    pp_lora = train_args(model, data, out, *lora, f"{PP}=2", f"{MB}=2", f"{CSV}={f}")
    p = subprocess.run(mpirun() + ["-np", "2", str(BIN)] + [str(a) for a in pp_lora], env=ENV, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert_same_run(out, ref, "LoRA under a hand-written CSV")


def test_resume_from_the_generated_schedule_into_its_csv(setup, tmp_path):
    """A checkpoint written at step 4 under ZBVZeroBubble's own order, resumed with torch's
    ZBVZeroBubble order from a file: every loss, the final weights and the AdamW moments as the
    uninterrupted run's, bit for bit."""
    import numpy as np
    from test_dist import losses, weights
    d, data = setup
    f = tmp_path / "zbv.csv"
    PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=torch_order("ZBVZeroBubble")), f)
    args = [f"{PP}=2", f"{SCHED}=ZBVZeroBubble", f"{MB}=2", "--checkpoint.last_save_model_only=false"]
    ref, out = tmp_path / "straight", tmp_path / "resumed"
    run = lambda o, *x, check=True: subprocess.run(
        mpirun() + ["-np", "2", str(BIN)] + [str(a) for a in train_args(d / "model", data, o, *args, *x)], env=ENV,
        capture_output=True, text=True, timeout=300, check=check)
    run(ref)
    p = run(out, "--training.stop_at_step=4", check=False)
    assert p.returncode == 75, p.stderr[-3000:]
    p = run(out, f"{CSV}={f}")
    assert "the order of" in p.stderr and "resum" in p.stderr.lower(), p.stderr[-3000:]
    assert losses(out) == losses(ref)
    for file in ("model.safetensors", "optim.safetensors"):
        a, b = weights(out, file=file), weights(ref, file=file)
        assert a.keys() == b.keys() and not [k for k in b if not np.array_equal(a[k], b[k])], file


def test_pp4_zbv_file_trains_as_its_schedule(setup, tmp_path):
    """4 pipeline ranks, 8 stages in the V (an 8-layer model), 8 micro-batches of 1: torch's
    ZBVZeroBubble order from a file trains bit for bit as ctitan's own order of the name, and
    as one process to 1e-5."""
    import numpy as np
    from test_dist import losses, weights
    d, data = setup
    model = tmp_path / "model_l8"
    oracle.tiny_config(vocab=251, hidden=30, inter=49, layers=8, heads=4, kv_heads=2, head_dim=8
                       ).save_pretrained(model)
    fake = types.SimpleNamespace(pp_group_size=4, _n_microbatches=8, num_stages=8)
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    order = {r: [a for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(fake, r)
                 if a is None or a.is_compute_op] for r in range(4)}
    f = tmp_path / "zbv4.csv"
    PipelineScheduleMulti._dump_csv(types.SimpleNamespace(pipeline_order=order), f)
    args = [f"{PP}=4", f"{SCHED}=ZBVZeroBubble", f"{MB}=1"]
    run = lambda o, *x: subprocess.run(
        mpirun() + ["-np", "4", str(BIN)] + [str(a) for a in train_args(model, data, o, *args, *x)], env=ENV,
        capture_output=True, text=True, timeout=300)
    p = run(tmp_path / "csv", f"{CSV}={f}")
    assert p.returncode == 0 and "the order of" in p.stderr, p.stderr[-3000:]
    p = run(tmp_path / "own")
    assert p.returncode == 0, p.stderr[-3000:]
    assert losses(tmp_path / "csv") == losses(tmp_path / "own")
    a, b = weights(tmp_path / "csv"), weights(tmp_path / "own")
    assert a.keys() == b.keys() and not [k for k in b if not np.array_equal(a[k], b[k])]
    ref = tmp_path / "single"
    # one process on the same micro-batches (1 sequence): with 2 a sequence, 8 layers sum the
    # embedding's gradient in another order, 1.2e-5 norm-wise after 10 steps
    subprocess.run([str(BIN)] + [str(x) for x in train_args(model, data, ref, "--training.local_batch_size=1")],
                   env=ENV, check=True,
                   capture_output=True, timeout=300)
    assert_same_run(tmp_path / "csv", ref, "PP 4 ZBV from a file")
