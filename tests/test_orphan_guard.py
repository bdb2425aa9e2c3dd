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

import pytest

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


def in_session(sid: int) -> list[int]:
    """The live processes of session `sid` (seen here, not through bench.procs, whose stop is under test)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and alive(int(p)) and _session(int(p)) == sid]


def _session(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[3])
    except FileNotFoundError:
        return None


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def kill_left(pids: list[int]) -> None:
    """SIGKILL what a test started and left running (its cleanup, whatever the asserts found)."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


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
        kill_left([guard, grandchild, *command])


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
        kill_left(pids)


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
        kill_left(family)


FAMILY_SCRIPT = ROOT / "tests" / "process_family.py"


def start_family(*flags: str) -> tuple[subprocess.Popen[bytes], list[int]]:
    """tests/process_family.py (a vLLM server's process tree) in a session of its own, as the tests start a vLLM;
    the started process, and the stand-in's API server, engine core and worker PIDs."""
    proc = subprocess.Popen(guarded([sys.executable, str(FAMILY_SCRIPT), *flags]), start_new_session=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    core, worker = int(proc.stdout.readline()), int(proc.stdout.readline())
    (api,) = children(proc.pid)
    return proc, [api, core, worker]


def test_the_guard_ends_what_its_command_leaves_when_it_dies() -> None:
    """A server killed on its own (the OOM killer's pick, a crash) leaves its engine core and workers: vLLM's API
    server SIGKILLed left them running, each holding its memory, after the guard and the fixture's stop had
    returned. The guard ends them, a worker in a session of its own too, and only then exits as its command did."""
    proc, (api, core, worker) = start_family("--detach")
    try:
        os.kill(api, signal.SIGKILL)
        status = proc.wait(20)
        assert [p for p in (core, worker) if alive(p)] == []
        assert status == -signal.SIGKILL
    finally:
        kill_left([proc.pid, api, core, worker])


def test_stopping_a_server_ends_its_whole_session_also_when_its_main_process_is_gone(tmp_path: Path) -> None:
    """`EngineServer.stop` (every fixture's stop of a vLLM) ends every process of the server's session, SIGKILL
    after its timeout for one that ignores SIGTERM, also when the process it started is gone already; here even the
    guard was killed, so nothing but the stop is left to end them."""
    from bench.vllm_engine import EngineServer

    proc, family = start_family("--stubborn")
    server = EngineServer("vllm", "sha256", "http://127.0.0.1:1", "", "", tmp_path, proc, tmp_path / "log", 0.0)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        assert all(alive(p) for p in family)
        started = time.monotonic()
        server.stop(timeout=1.0)
        assert in_session(proc.pid) == [] and [p for p in family if alive(p)] == []
        assert time.monotonic() - started < 10  # SIGTERM, 1 s, SIGKILL: not the fixture's grace of 30 s
    finally:
        kill_left(family)


def test_a_fleet_whose_first_stop_raises_still_stops_the_rest(tmp_path: Path) -> None:
    """`VllmFleet.stop` (and every fixture that stops a list of servers) stops each one even when an earlier stop
    raises, then raises: it stopped them one by one, so a first stop that failed left the second server running."""
    from bench.vllm_engine import EngineServer, VllmFleet

    class Stuck(EngineServer):
        def stop(self, timeout: float = 30.0) -> None:
            raise RuntimeError("stuck in the kernel")

    first, first_family = start_family()
    second, family = start_family()
    servers = [Stuck("vllm", "sha256", "http://127.0.0.1:1", "", "", tmp_path, first, tmp_path / "log", 0.0),
               EngineServer("vllm", "sha256", "http://127.0.0.1:2", "", "", tmp_path, second, tmp_path / "log", 0.0)]
    workdir = tmp_path / "fleet"
    workdir.mkdir()
    try:
        with pytest.raises(RuntimeError, match="stuck in the kernel"):
            VllmFleet(servers, [], workdir).stop()
        assert in_session(second.pid) == [] and [p for p in family if alive(p)] == []
        assert not workdir.exists()
    finally:
        kill_left([first.pid, *first_family, second.pid, *family])


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_real_vllm_whose_api_server_was_killed_leaves_nothing_once_stopped(tiny_model_dir: Path,
                                                                              tmp_path: Path) -> None:
    """The leak as it happened, on a real vLLM: its API server SIGKILLed, the engine core and worker stayed (and the
    fixture's stop returned at once, the server being gone). Once stopped, no process of its session is left."""
    from bench.vllm_engine import start_engine

    server = start_engine("vllm", tiny_model_dir, tmp_path / "logs", extra_args=["--num-gpu-blocks-override", "128"])
    sid = server.proc.pid
    family = in_session(sid)
    try:
        names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in family}
        assert {"VLLM::EngineCor", "VLLM::Worker"} <= names, names  # what is at stake
        (api,) = children(sid)
        os.kill(api, signal.SIGKILL)
        server.stop()
        assert in_session(sid) == []
    finally:
        kill_left(family)


LEAKING_TEST = """
import subprocess, sys

def test_leaves_a_process_running() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
    print(proc.pid, file=open("leaked.pid", "w"))

def test_stops_what_it_starts() -> None:
    subprocess.run([sys.executable, "-c", "pass"], check=True)
"""


def test_a_run_that_leaves_a_process_running_fails_and_names_it(tmp_path: Path) -> None:
    """tests/conftest.py's check at the end of a run: a process the run started (in a session of its own, out of
    reach of pytest's process group) that still runs fails the run, is named, and is killed."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure, pytest_sessionfinish, "
                                          "pytest_terminal_summary  # noqa: F401\n")
    (tmp_path / "test_leak.py").write_text(LEAKING_TEST)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_leak.py"],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=90)
    leaked = int((tmp_path / "leaked.pid").read_text())
    try:
        assert run.returncode == 1, run.stdout[-2000:]
        assert "2 passed" in run.stdout and f"{leaked}: " in run.stdout, run.stdout[-2000:]
        assert wait_gone([leaked], 5) == []
    finally:
        if alive(leaked):
            os.kill(leaked, signal.SIGKILL)
