"""bench/machine.py: the speed probe every benchmark report carries."""

from __future__ import annotations

import threading

from bench.machine import probe, probes


def test_the_probe_measures_each_kind_of_work_and_leaves_no_thread() -> None:
    threads = threading.active_count()
    speed = probe()
    # a round trip between two threads is two wake-ups and four system calls at least
    assert speed.python_us > 0 and speed.syscall_ns > 0 and speed.loopback_us * 1e3 > 2 * speed.syscall_ns
    assert speed.load_1m >= 0
    assert threading.active_count() == threads
    assert "a system call" in speed.describe()
    assert probes(speed, speed) == {"before": speed.__dict__, "after": speed.__dict__}
