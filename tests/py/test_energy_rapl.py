"""The energy figure's RAPL domains (src/metrics/events.c, events.h): Linux powercap's
intel-rapl:N zones are the CPU packages and intel-rapl:N:M their subzones (core, uncore,
dram: parts of the package's energy, per the kernel's powercap documentation), so only the
packages are summed. The seventh mutation audit found that test_events.py's fake tree has no
subzone, so counting the subzones too (energy twice) passed. Called through libctitan with
CTITAN_POWERCAP pointing at a fake tree whose counters move between the two readings."""
import ctypes

import pytest

from conftest import LIB

MAX_UJ = 262143328850


def zone(root, name, uj):
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{MAX_UJ}\n")


@pytest.fixture
def lib(monkeypatch, tmp_path):
    monkeypatch.setenv("CTITAN_POWERCAP", str(tmp_path / "powercap"))
    lib = ctypes.CDLL(str(LIB))
    lib.ev_energy_start.restype = ctypes.c_int
    lib.ev_energy_start.argtypes = [ctypes.c_void_p]
    lib.ev_energy_since.restype = ctypes.c_double
    lib.ev_energy_since.argtypes = [ctypes.c_void_p]
    return lib


def test_only_the_packages_are_summed(lib, tmp_path):
    """Packages 0 and 1 use 5 J and 2 J; package 0's core and dram subzones use 3 J and 1 J
    of its 5: the energy is 7 J. A wrapped package counter (past max_energy_range_uj) counts
    the way round."""
    root = tmp_path / "powercap"
    before = {"intel-rapl:0": 1_000_000, "intel-rapl:1": MAX_UJ - 500_000,
              "intel-rapl:0:0": 400_000, "intel-rapl:0:1": 7_000_000}
    used = {"intel-rapl:0": 5_000_000, "intel-rapl:1": 2_000_000, "intel-rapl:0:0": 3_000_000,
            "intel-rapl:0:1": 1_000_000}
    for name, uj in before.items():
        zone(root, name, uj)
    s = ctypes.create_string_buffer(1 << 14)  # an ev_energy
    assert lib.ev_energy_start(s) == 0, s.raw[-300:]
    for name, uj in before.items():
        zone(root, name, (uj + used[name]) % MAX_UJ)
    j = lib.ev_energy_since(s)
    assert j == pytest.approx(7.0, abs=1e-6), j

