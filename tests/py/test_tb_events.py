"""The TensorBoard writer's protobuf encoding at its edges (src/metrics/tb.c), read back by
TensorBoard's own parsers (event_pb2, the event accumulator): the seventh mutation audit
found that no run reaches them (10-step runs, short tags). Called through libctitan, as the
trainer calls it."""
import ctypes

import pytest

from conftest import LIB

from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.compat.proto import event_pb2
from test_tensorboard import events_files, records


@pytest.fixture(scope="module")
def tb():
    lib = ctypes.CDLL(str(LIB))
    lib.tb_open.restype = ctypes.c_void_p
    lib.tb_open.argtypes = [ctypes.c_char_p, ctypes.c_int64, ctypes.c_void_p]
    lib.tb_scalar.restype = None
    lib.tb_scalar.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_char_p, ctypes.c_double]
    lib.tb_close.restype = ctypes.c_int
    lib.tb_close.argtypes = [ctypes.c_void_p]
    return lib


def write(lib, d, rows):
    err = ctypes.create_string_buffer(4096)  # a ct_err
    w = lib.tb_open(str(d).encode(), 0, err)
    assert w, err.raw[4:200]
    for step, tag, value in rows:
        lib.tb_scalar(w, step, tag.encode(), value)
    assert lib.tb_close(w) == 0
    (f,) = events_files(d)
    return f


def test_varint_edges_read_back(tb, tmp_path):
    """Steps and tag lengths at the varint's 7-bit edges (127 is one byte, 128 two, 16383
    two, 16384 three) and a step past 2^32: TensorBoard reads every scalar back at its step
    with its value (float32), in order."""
    rows = [(s, "x", float(i)) for i, s in enumerate((1, 126, 127, 128, 255, 16383, 16384, 2**33 + 127))]
    rows += [(7, "t" * n, float(n)) for n in (126, 127, 128)]
    f = write(tb, tmp_path, rows)
    for rec in records(f):
        event_pb2.Event.FromString(rec)  # DecodeError on a malformed event
    acc = ea.EventAccumulator(str(tmp_path), size_guidance={ea.SCALARS: 0})
    acc.Reload()
    got = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    want = {}
    for s, tag, v in rows:
        want.setdefault(tag, []).append((s, v))
    assert got == want, (got, want)


def test_an_event_too_large_for_the_buffer_is_dropped_whole(tb, tmp_path, capfd):
    """A tag of 1015 bytes: its Summary.Value (key, 2-byte length, tag, float: 1023 bytes)
    fits the writer's 1024-byte buffer but the Summary around it (1026) does not. The event
    is dropped (with a message) and the file stays valid protobuf: the scalars before and
    after it read back. Writing the event with an emptied Summary left a truncated one."""
    rows = [(1, "a", 1.0), (2, "b" * 1015, 2.0), (3, "a", 3.0)]
    f = write(tb, tmp_path, rows)
    events = [event_pb2.Event.FromString(r) for r in records(f)]  # DecodeError on a truncated field
    tags = [v.tag for e in events for v in e.summary.value]
    assert tags == ["a", "a"], tags
    assert "event too large, skipped" in capfd.readouterr().err
