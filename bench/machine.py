"""How fast this machine is at the time of a benchmark, recorded beside its figures.

The 2-core machines these benchmarks run on drift in speed between hours and days, and not evenly: on 3 December
2026, idle, every router of `kvgate bench overhead` (sglang-router's Rust included) took three times the CPU per
request it took on 2 December, idle, while a pure-Python lookup ran as fast as the day before. So each benchmark's
JSON carries a probe of the three kinds of work its figures are made of, taken before and after the run, and figures
from two runs compare only as far as their probes agree:

- `python_us`: a fixed piece of pure-Python work (dict and list operations, as a gateway's or a replay's own code);
- `syscall_ns`: one trivial system call (what every socket read, write and wake-up pays on top of its work);
- `loopback_us`: a one-byte round trip between two threads over a socket pair (two wake-ups and four system calls:
  the floor of every request a router relays);
- `load_1m`: the load average, the share of the cores other work took.

Each is the median of several repetitions; the probe takes about a quarter of a second.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

_REPEATS = 5
_SYSCALLS = 20_000
_ROUND_TRIPS = 2_000


@dataclass(frozen=True)
class MachineSpeed:
    python_us: float
    syscall_ns: float
    loopback_us: float
    load_1m: float

    def describe(self) -> str:
        return (f"machine: pure Python {self.python_us / 1e3:.1f} ms, a system call {self.syscall_ns:.0f} ns, loopback "
                f"round trip {self.loopback_us:.1f} us, load {self.load_1m:.1f}")


def _python_work() -> int:
    table: dict[int, int] = {}
    for i in range(20_000):
        table[i * 2654435761 & 0xFFFF] = i
    return sum(v for k, v in table.items() if k & 1) + len(sorted(table))


def _timed(work: Callable[[], object], repeats: int = _REPEATS) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _syscalls() -> None:
    getppid = os.getppid
    for _ in range(_SYSCALLS):
        getppid()


def _loopback_seconds() -> float:
    """Seconds per one-byte round trip to an echoing thread over a socket pair."""
    ours, theirs = socket.socketpair()

    def echo() -> None:
        while data := theirs.recv(64):
            theirs.sendall(data)

    thread = threading.Thread(target=echo, name="kvgate-probe-echo", daemon=True)
    thread.start()
    try:
        def round_trips() -> None:
            for _ in range(_ROUND_TRIPS):
                ours.sendall(b"x")
                ours.recv(64)

        return _timed(round_trips) / _ROUND_TRIPS
    finally:
        ours.close()
        thread.join(5)
        theirs.close()


def probe() -> MachineSpeed:
    return MachineSpeed(python_us=_timed(_python_work) * 1e6, syscall_ns=_timed(_syscalls) / _SYSCALLS * 1e9,
                        loopback_us=_loopback_seconds() * 1e6, load_1m=os.getloadavg()[0])


def probes(before: MachineSpeed, after: MachineSpeed) -> dict[str, dict[str, float]]:
    """What a report records: the probe taken before the run and the one taken after it."""
    return {"before": asdict(before), "after": asdict(after)}
