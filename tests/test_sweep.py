"""bench/sweep.py: alone, configurations run in the order asked; beside others, the costliest start first; SIGTERM
keeps what finished."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Any

from bench.sweep import Job, Progress, run_sweep


def sleeper(seconds: float, progress: Progress) -> dict[str, Any]:
    started = time.time()
    time.sleep(seconds)
    progress(1, seconds, final=True)
    return {"started": started}


def test_one_process_runs_the_configurations_in_the_order_asked() -> None:
    """A sweep's results arrive (and a Ctrl-C keeps them) in the order of the command line, whatever their cost:
    ordering by cost made `--jobs 1` run `kv` before the `round_robin` asked for first."""
    jobs = [Job(f"job {i}", 1, 0.05, cost=cost) for i, cost in enumerate((1.0, 5.0, 3.0))]
    finished: list[int] = []
    outcome = run_sweep(jobs, sleeper, processes=1, show_progress=False, on_result=lambda i, _row: finished.append(i))
    assert finished == [0, 1, 2]
    assert [outcome.results[i]["started"] for i in range(3)] == sorted(outcome.results[i]["started"] for i in range(3))


def test_two_processes_start_the_costliest_first() -> None:
    jobs = [Job(f"job {i}", 1, 0.5, cost=cost) for i, cost in enumerate((1.0, 5.0, 3.0))]
    outcome = run_sweep(jobs, sleeper, processes=2, show_progress=False)
    started = {i: outcome.results[i]["started"] for i in range(3)}
    # the cheapest waited for one of the others to finish (in the order asked, it would have started at once)
    assert started[0] >= min(started[1], started[2]) + 0.45, started


def test_a_replays_process_imports_no_http_stack_or_redis() -> None:
    """What a vsim configuration's process imports (`simulate` is unpickled from bench.vsim; it finds its model
    with bench.make_model), and the sweep's own process reading the command line, leave out the gateway's HTTP
    server and client, DNS and redis-py: 18 MB less per process (73 -> 55 MB resident after import; the sweep's
    own 65 -> 55 MB with its arguments read)."""
    code = ("import argparse, sys, bench.vsim, bench.make_model; bench.vsim.add_arguments(argparse.ArgumentParser()); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'aiohttp', 'redis', 'dns'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


STOPPED_SWEEP = """
from bench.sweep import Job, run_sweep
from tests.test_sweep import sleeper

outcome = run_sweep([Job("quick", 1, 0.05), Job("slow", 1, 120.0)], sleeper, processes=1, show_progress=False,
                    on_result=lambda i, _row: print("finished", i, flush=True))
print("interrupted" if outcome.interrupted else "ran to the end", sorted(outcome.results), flush=True)
"""


def test_sigterm_stops_a_sweep_and_keeps_what_finished() -> None:
    """SIGTERM, as a job system, `timeout` or Kubernetes sends it, while the second of two configurations runs: the
    sweep ends at once with the first's result and exits normally, as on Ctrl-C (tests/test_traces.py); before, it
    died with nothing written."""
    proc = subprocess.Popen([sys.executable, "-c", STOPPED_SWEEP], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "finished 0"
        time.sleep(0.5)  # the slow one is running
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:  # the sweep's session: itself and, had it left any, its configurations' processes
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, err
    assert out.strip() == "interrupted [0]", err
