"""Running many simulations side by side: one fresh process per configuration, `jobs` at a time, a progress bar
per configuration (requests done, simulated time, ETA), and, when the run is interrupted (Ctrl-C, or SIGTERM from a
job system, `timeout` or Kubernetes), the configurations that finished.

Each configuration runs in a process of its own, started fresh (`spawn`) with the same hash seed, so its result
depends on the configuration alone: the same whether it ran with `--jobs 1` or beside others. The processes
report progress through a queue; the parent draws the bars and watches the processes' memory (the peak of their
total resident size is part of the outcome).
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import multiprocessing.pool
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from tqdm import tqdm

J = TypeVar("J")
REPORT_EVERY_S = 0.5  # a running configuration reports its progress at most this often

_reports: Any = None  # the queue a configuration's process reports to (set in each process)


@dataclass(frozen=True)
class Job(Generic[J]):
    """One configuration: a label for its bar, how many requests it replays, and what the runner needs; `cost`,
    what it is expected to take relative to the others (with more than one process the costliest start first, so
    no process is left with a long one at the end while the others idle)."""

    label: str
    total: int
    spec: J
    cost: float = 1.0


@dataclass
class SweepOutcome:
    """What a sweep produced: a result (or the error) per job that finished, by job index."""

    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    interrupted: bool = False
    peak_rss_mb: float = 0.0  # the most memory the sweep's processes held at once (this one included)
    # the same in proportional set size: a page several processes share (libraries) counted once in all, where
    # the sum of resident sizes counts it in each
    peak_pss_mb: float = 0.0


class Progress:
    """Handed to a runner in its process: `progress(done, virtual_s)` after each request it finishes."""

    def __init__(self, job: int) -> None:
        self.job = job
        self._last = 0.0

    def __call__(self, done: int, virtual_s: float, final: bool = False) -> None:
        now = time.monotonic()
        if _reports is not None and (final or now - self._last >= REPORT_EVERY_S):
            self._last = now
            _reports.put((self.job, done, virtual_s))


def _init_process(reports: Any) -> None:
    global _reports
    _reports = reports
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    return_freed_tables()


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_FROM = 128 * 1024  # glibc's initial threshold, kept


def return_freed_tables() -> bool:
    """Keep glibc serving every allocation from `MMAP_FROM` bytes up with a mapping of its own, given back to the
    system when freed. By default glibc raises that threshold to the size of each such allocation it frees (up to
    32 MiB) and from then on serves smaller ones from its heap, whose freed holes stay resident: a replay's large
    dict tables are replaced as they grow and as they are copied (`TableTrim`), so when and how far the threshold
    rose decided tens of MB of its peak (kv with tiers, first 3,000 requests of the conversation trace: 56 MB free
    in a 334 MB heap at the end, a peak of 514-553 MB from one commit to the next; with the fixed threshold 513,
    the same results). Whether it could be set (glibc only)."""
    try:
        return bool(ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, MMAP_FROM))
    except (OSError, AttributeError):
        return False


def _call(runner: Callable[[J, Progress], dict[str, Any]], index: int, spec: J) -> dict[str, Any]:
    import resource

    result = runner(spec, Progress(index))
    usage = resource.getrusage(resource.RUSAGE_SELF)
    result["peak_rss_mb"] = usage.ru_maxrss / 1024
    result["cpu_s"] = usage.ru_utime + usage.ru_stime  # what wall time would be on a core of its own
    return result


def run_sweep(jobs: Sequence[Job[J]], runner: Callable[[J, Progress], dict[str, Any]], *, processes: int = 1,
              show_progress: bool = True, on_result: Callable[[int, dict[str, Any]], None] | None = None
              ) -> SweepOutcome:
    """Run `runner(job.spec, progress)` for every job, each in a fresh process, `processes` at a time.
    `on_result(index, result)` is called in this process as each one finishes. Ctrl-C or SIGTERM stops the sweep:
    what finished is returned, with `interrupted` set."""
    os.environ.setdefault("PYTHONHASHSEED", "0")  # the processes' hash seed: results never depend on it
    ctx = multiprocessing.get_context("spawn")
    reports = ctx.Queue()
    outcome = SweepOutcome()
    tty = sys.stderr.isatty()
    bars = [tqdm(total=job.total, desc=job.label, unit="req", position=i, leave=True,
                 disable=not (show_progress and tty), dynamic_ncols=True) for i, job in enumerate(jobs)]
    states = [_State() for _ in jobs]
    lines = _ProgressLines(jobs, states) if show_progress and not tty else None
    pool = ctx.Pool(max(1, processes), initializer=_init_process, initargs=(reports,), maxtasksperchild=1)
    # beside others, the costliest first (stable: equal costs keep their order); alone, the order changes no wall
    # time, and the configurations run, report and can be interrupted in the order they were asked for
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i].cost) if processes > 1 else range(len(jobs))
    pending = {i: pool.apply_async(_call, (runner, i, jobs[i].spec)) for i in order}
    memory = _TreeMemory()
    stop_on_terminate = _TerminateAsInterrupt()
    try:
        while pending:
            _drain(reports, bars, states)
            if lines is not None:
                lines.maybe_print(pending)
            rss_mb, pss_mb = memory.total_mb()
            outcome.peak_rss_mb = max(outcome.peak_rss_mb, rss_mb)
            if pss_mb is not None:
                outcome.peak_pss_mb = max(outcome.peak_pss_mb, pss_mb)
            for i, result in list(pending.items()):
                if not result.ready():
                    continue
                del pending[i]
                try:
                    row = result.get()
                except Exception as exc:  # the configuration's own failure: reported, the others go on
                    outcome.errors[i] = f"{type(exc).__name__}: {exc}"
                    bars[i].set_postfix_str("failed")
                    continue
                outcome.results[i] = row
                bars[i].n = jobs[i].total
                bars[i].refresh()
                if on_result is not None:
                    on_result(i, row)
        pool.close()
    except KeyboardInterrupt:
        outcome.interrupted = True
        pool.terminate()
    finally:
        stop_on_terminate.close()
        pool.join()
        _drain(reports, bars, states)
        for bar in bars:
            bar.close()
    return outcome


class _TerminateAsInterrupt:
    """Until `close()`: SIGTERM (what a job system, `timeout` or Kubernetes sends) raises KeyboardInterrupt in the
    main thread, as Ctrl-C does, so a stopped sweep keeps what finished. The configurations' processes are started
    fresh and keep SIGTERM's default, which is how the pool ends them. Elsewhere than in the main thread, nothing."""

    def __init__(self) -> None:
        self._installed = threading.current_thread() is threading.main_thread()
        # None: a handler not set from Python, restored as the default
        self._previous = signal.signal(signal.SIGTERM, self._interrupt) if self._installed else None

    @staticmethod
    def _interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    def close(self) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False


@dataclass
class _State:
    done: int = 0
    virtual_s: float = 0.0
    since: float | None = None  # when its first report came


class _ProgressLines:
    """Without a terminal (a log file, CI): a line per running configuration every LINE_EVERY_S."""

    LINE_EVERY_S = 30.0

    def __init__(self, jobs: Sequence[Job[Any]], states: list[_State]) -> None:
        self.jobs = jobs
        self.states = states
        self.last = time.monotonic()

    def maybe_print(self, running: dict[int, Any]) -> None:
        now = time.monotonic()
        if now - self.last < self.LINE_EVERY_S:
            return
        self.last = now
        for i in sorted(running):
            state, total = self.states[i], self.jobs[i].total
            if state.since is None or not state.done:
                continue
            left = (total - state.done) * (now - state.since) / state.done
            print(f"  {self.jobs[i].label}: {state.done:,}/{total:,} requests, {state.virtual_s:,.0f} s simulated, "
                  f"about {left / 60:.0f} min left", file=sys.stderr, flush=True)


def _drain(reports: Any, bars: list[Any], states: list[_State]) -> None:
    deadline = time.monotonic() + 0.2
    while True:
        try:
            job, done, virtual_s = reports.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        state = states[job]
        if state.since is None:
            state.since = time.monotonic()
        state.done, state.virtual_s = done, virtual_s
        bar = bars[job]
        bar.n = done
        bar.set_postfix_str(f"{virtual_s:,.0f} s simulated", refresh=False)
        bar.refresh()


class _TreeMemory:
    """Resident memory of this process and its children, from /proc (0 where /proc is not there): the sum of
    their resident sizes, and, at most every `PSS_EVERY_S`, of their proportional set sizes (the kernel walks a
    process's page tables for it: read at every look, 0.2 s apart, it took 6% of a core beside two replays)."""

    PSS_EVERY_S = 2.0

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._pss_at = -self.PSS_EVERY_S

    def total_mb(self) -> tuple[float, float | None]:
        """The sum of resident sizes, and of proportional set sizes (None when not read this time)."""
        pids = [self.pid]
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{self.pid}/task").iterdir():
                pids += [int(p) for p in (task / "children").read_text().split()]
        rss = sum(_status_kb(pid, "VmRSS:") for pid in pids) / 1024
        now = time.monotonic()
        if now - self._pss_at < self.PSS_EVERY_S:
            return rss, None
        self._pss_at = now
        return rss, sum(_pss_kb(pid) for pid in pids) / 1024


def _status_kb(pid: int, field: str) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _pss_kb(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0
