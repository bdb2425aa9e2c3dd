"""`kvgate sim --replicas N`: one OS process per replica (so each can be killed alone), supervised by this one.

The supervisor starts `kvgate sim ... --replica-index i` children, forwards SIGINT/SIGTERM to them, reports a
child that dies (without restarting it: the fleet is a test bed, a dead replica is a scenario) and exits when
every child has exited.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from types import FrameType

log = logging.getLogger(__name__)


def child_argv(argv: Sequence[str], index: int) -> list[str]:
    """The command line of replica `index`: the fleet's own flags plus `--replica-index`."""
    return [sys.executable, "-m", "kvgate.cli", "sim", *argv, "--replica-index", str(index)]


def run_fleet(argv: Sequence[str], replicas: int, stop_timeout_s: float = 10.0) -> int:
    children = [subprocess.Popen(child_argv(argv, i)) for i in range(replicas)]
    stopping = False

    def forward(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    reported: set[int] = set()
    worst = 0
    while True:
        alive = 0
        for i, child in enumerate(children):
            code = child.poll()
            if code is None:
                alive += 1
            elif i not in reported:
                reported.add(i)
                if not stopping:
                    log.warning("replica %d (pid %d) exited with %s", i, child.pid, code)
                if code not in (0, -signal.SIGTERM, -signal.SIGINT):
                    worst = worst or 1
        if not alive:
            return worst
        if stopping:
            deadline = time.monotonic() + stop_timeout_s
            for child in children:
                try:
                    child.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("replica pid %d did not stop in %.0f s; killing it", child.pid, stop_timeout_s)
                    child.kill()
                    child.wait(5)
            return worst
        time.sleep(0.2)
