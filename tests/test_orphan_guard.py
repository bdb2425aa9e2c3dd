"""bench/orphan_guard.py: servers started in a session of their own (vLLM, the simulated engine) end when whoever
started them dies without stopping them, and otherwise behave as if started directly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from bench.procs import guarded
from tests.conftest import ROOT

SLEEPER = "import time; time.sleep(120)"
# a command that starts a child of its own and prints both PIDs
FAMILY = ("import subprocess, sys, time; "
          f"c = subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); "
          "print(c.pid, flush=True); time.sleep(120)")


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a parent (an orphan's new parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def wait_gone(pids: list[int], timeout: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run_starter(script: str) -> tuple[subprocess.Popen[str], list[int]]:
    """A Python process that runs `script` (which starts something and prints PIDs, one per line, then
    'ready'), and the PIDs it printed."""
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE, text=True,
                               cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert starter.stdout is not None
    pids: list[int] = []
    for line in starter.stdout:
        if line.strip() == "ready":
            return starter, pids
        pids.append(int(line))
    raise AssertionError(f"the starter exited with {starter.wait()} before it was ready")


def test_a_guarded_family_ends_when_its_starter_is_killed() -> None:
    starter, pids = run_starter(f"""
        import subprocess, sys
        from bench.procs import guarded
        guard = subprocess.Popen(guarded([sys.executable, "-c", {FAMILY!r}]), start_new_session=True,
                                 stdout=subprocess.PIPE, text=True)
        print(guard.pid, flush=True)
        print(guard.stdout.readline().strip(), flush=True)  # the command's child
        print("ready", flush=True)
        guard.wait()
    """)
    guard, grandchild = pids
    command = children(guard)
    assert len(command) == 1 and all(alive(p) for p in (guard, grandchild, *command))
    try:
        starter.kill()  # as a CI runner or the OOM killer would: no cleanup runs
        starter.wait()
        assert wait_gone([guard, grandchild, *command]) == []
    finally:
        for pid in (guard, grandchild, *command):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_without_the_guard_the_same_family_outlives_its_starter() -> None:
    """What the guard is for: the same start, unguarded, leaves both processes running."""
    starter, pids = run_starter(f"""
        import subprocess, sys
        command = subprocess.Popen([sys.executable, "-c", {FAMILY!r}], start_new_session=True,
                                   stdout=subprocess.PIPE, text=True)
        print(command.pid, flush=True)
        print(command.stdout.readline().strip(), flush=True)
        print("ready", flush=True)
        command.wait()
    """)
    try:
        starter.kill()
        starter.wait()
        time.sleep(1.5)  # three of the guard's polls
        assert all(alive(p) for p in pids)
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_guard_passes_on_the_commands_exit() -> None:
    assert subprocess.run(guarded([sys.executable, "-c", "raise SystemExit(3)"])).returncode == 3
    # stopped as its owner stops it: SIGTERM to the group, and waiting for the guard waits for the command
    proc = subprocess.Popen(guarded([sys.executable, "-c", SLEEPER]), start_new_session=True)
    deadline = time.monotonic() + 10
    while not children(proc.pid):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    (command,) = children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(10) == -signal.SIGTERM
    assert not alive(command)


def test_a_simulated_engine_does_not_outlive_its_starter(tiny_model_dir: Path) -> None:
    """The path the tests use: `start_engine` (vLLM and the simulated engine alike) runs the server guarded."""
    starter, (guard,) = run_starter(f"""
        from pathlib import Path
        from bench.vllm_engine import start_engine
        server = start_engine("sim", Path({str(tiny_model_dir)!r}), Path({str(tiny_model_dir / "logs")!r}))
        print(server.proc.pid, flush=True)
        print("ready", flush=True)
        server.proc.wait()
    """)
    family = [guard, *children(guard)]
    assert len(family) == 2 and all(alive(p) for p in family)
    try:
        starter.kill()
        starter.wait()
        assert wait_gone(family) == []
    finally:
        for pid in family:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
