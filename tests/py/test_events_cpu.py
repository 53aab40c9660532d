"""The event log's CPU figure (metrics/events.h: an exit's cpu_s, ev_cpu_seconds) against
getrusage, called through libctitan.so in this process. Apart from test_events.py because
that file runs under the sanitized build too (Makefile's SAN_CLI_TESTS), which builds no
shared library."""
import ctypes
import os
import resource
import time

from conftest import LIB, ROOT


def test_cpu_seconds_is_user_plus_system_time():
    """An exit's cpu_s (ev_cpu_seconds) is the process's user + system CPU time, both with
    their microseconds, as getrusage(RUSAGE_SELF) gives them to Python. System time is run
    up (stat calls) until its fractional second is at least 0.3 s, so a figure that dropped
    either part's microseconds would be off by more than the tolerance."""
    lib = ctypes.CDLL(str(LIB))
    lib.ev_cpu_seconds.restype = ctypes.c_double
    t_end = time.monotonic() + 30
    while not 0.3 <= resource.getrusage(resource.RUSAGE_SELF).ru_stime % 1 <= 0.9:
        for _ in range(2000):
            os.stat(ROOT)
        assert time.monotonic() < t_end, "could not run up system time"
    got = lib.ev_cpu_seconds()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    want = ru.ru_utime + ru.ru_stime
    assert want - 0.05 <= got <= want + 1e-6, (got, ru.ru_utime, ru.ru_stime)
