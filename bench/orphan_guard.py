"""Run a command, and end its process group if the process that started the guard dies first.

Servers that the tests and benchmarks start in a session of their own (vLLM: its API server, engine core and
workers) are out of reach of the signals a terminal or a CI runner sends to pytest's process group. If pytest
itself is killed (SIGKILL, the out-of-memory killer, a runner's timeout), no fixture stops them, and each keeps its
gigabytes and its CPU. The guard is that session's leader: it starts the command in its own process group, watches
its parent, and when the parent is gone sends the group SIGTERM, then SIGKILL after a grace period.

    python orphan_guard.py PARENT_PID COMMAND [ARG...]

It exits as the command did (the same status, or the same signal), so whoever waits for the guard waits for the
command. Standard library only: any interpreter runs it (`bench.procs.guarded` builds the command line).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 0.5  # how often the guard looks at its parent
GRACE_S = 10.0  # between SIGTERM and SIGKILL for an orphaned group


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    parent = int(argv[1])
    # SIGTERM to the group (how its owner stops it) reaches the command; the guard outlives it to pass on its
    # status. A handler, not SIG_IGN: an ignored signal would stay ignored in the command after exec.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    child = subprocess.Popen(argv[2:])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # after the fork: the command keeps a clear mask
    while child.poll() is None:
        if os.getppid() != parent:
            os.killpg(0, signal.SIGTERM)
            try:
                child.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(0, signal.SIGKILL)  # the guard with it
            break
        signal.sigtimedwait({signal.SIGCHLD}, POLL_S)  # wakes at once when the command exits
    status = child.wait()
    if status < 0:  # ended by a signal: end the same way
        signal.signal(-status, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-status})
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
