"""Run a command, and end every process it started when it exits or when the process that started the guard dies.

Servers that the tests and benchmarks start in a session of their own (vLLM: its API server, engine core and
workers) are out of reach of the signals a terminal or a CI runner sends to pytest's process group. If pytest
itself is killed (SIGKILL, the out-of-memory killer, a runner's timeout), no fixture stops them, and each keeps its
gigabytes and its CPU. The guard is that session's leader and its child subreaper: it starts the command, and every
process below it whose parent dies is handed to the guard, not to init, so it stays findable as a descendant (also
one that started a session of its own). When the command exits (stopped, crashed, killed: vLLM's API server dies
and leaves its engine core and workers running) or the guard's parent is gone, the guard sends every descendant
SIGTERM, then SIGKILL after a grace period, and waits until none is left.

    python orphan_guard.py PARENT_PID COMMAND [ARG...]

It exits as the command did (the same status, or the same signal), once nothing the command started is left, so
whoever waits for the guard waits for all of it. Standard library only: any interpreter runs it
(`bench.procs.guarded` builds the command line).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5  # how often the guard looks at its parent
GRACE_S = 10.0  # between SIGTERM and SIGKILL for what is left
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def become_subreaper() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from the state on (the command name before it may hold spaces); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def descendants(root: int) -> dict[int, str]:
    """Every live (not zombie) process below `root`, as PID -> its start time (to tell it from a later process
    given the same PID)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(int(entry))) is not None:
            children.setdefault(int(fields[1]), []).append((int(entry), fields[0] + " " + fields[19]))
    found: dict[int, str] = {}
    todo = [root]
    while todo:
        for pid, state_start in children.get(todo.pop(), []):
            todo.append(pid)
            state, start = state_start.split()
            if state != "Z":
                found[pid] = start
    return found


def send(pid: int, start: str, signum: int) -> None:
    """Signal `pid` if it is still the process that started at `start` (held by a pidfd while that is checked)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        fields = stat_fields(pid)
        if fields is not None and fields[19] == start:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(fd, signum)
    finally:
        os.close(fd)


def reap(command: int) -> int | None:
    """Reap every child that has exited (the command, and orphans handed to the guard); the command's exit code
    (negative: the signal that ended it) if it was among them."""
    status = None
    while True:
        try:
            pid, raw = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return status
        if pid == 0:
            return status
        if pid == command:
            status = os.waitstatus_to_exitcode(raw)


def end_descendants(command: int) -> int | None:
    """SIGTERM to every process below the guard (also to any that starts meanwhile), SIGKILL to what is left after
    GRACE_S; returns once none is left (or GRACE_S after SIGKILL: a process stuck in the kernel), with the
    command's exit code if it was reaped meanwhile."""
    status = None
    for signum in (signal.SIGTERM, signal.SIGKILL):
        signalled: set[tuple[int, str]] = set()
        deadline = time.monotonic() + GRACE_S
        while (left := descendants(os.getpid())) and time.monotonic() < deadline:
            for pid, start in left.items():
                if (pid, start) not in signalled:
                    send(pid, start, signum)
                    signalled.add((pid, start))
            signal.sigtimedwait({signal.SIGCHLD}, 0.05)
            if (code := reap(command)) is not None:
                status = code
        if not left:
            break
    if (code := reap(command)) is not None:
        status = code
    return status


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    parent = int(argv[1])
    # SIGTERM to the group (how its owner stops it) reaches the command; the guard outlives it to end what the
    # command left and to pass on its status. A handler, not SIG_IGN: an ignored signal would stay ignored in the
    # command after exec.
    signal.signal(signal.SIGTERM, lambda _signum, _frame: None)
    become_subreaper()
    child = subprocess.Popen(argv[2:])
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # after the fork: the command keeps a clear mask
    status = reap(child.pid)
    while status is None and os.getppid() == parent:
        signal.sigtimedwait({signal.SIGCHLD}, POLL_S)  # wakes at once when a child exits
        status = reap(child.pid)
    if (code := end_descendants(child.pid)) is not None:
        status = code
    if status is None:  # (cannot happen: the command is a descendant, so it was ended and reaped)
        status = 1
    child.returncode = status  # reaped here, not by Popen
    if status < 0:  # ended by a signal: end the same way
        with contextlib.suppress(OSError):  # SIGKILL has no handler to reset
            signal.signal(-status, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {-status})
        os.kill(os.getpid(), -status)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv))
