"""Simulated vLLM fleets for benchmarks and tests: N `kvgate sim` replicas as real processes on free loopback ports.

    fleet = start_sim_fleet(3, model_dir, speedup=10)      # or the `sim_fleet` fixture (a factory)
    fleet.urls                 # ["http://127.0.0.1:PORT", ...]
    fleet.worker_specs         # ["URL;events=tcp://127.0.0.1:E;replay=tcp://127.0.0.1:R", ...] for --worker
    fleet.replicas[1].kill()   # SIGKILL one replica; .start() brings it back (same ports, empty cache)
    fleet.stop()

Each replica is its own `kvgate sim --replicas 1` process, stopped by its PID.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import free_port

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass
class SimReplicaProcess:
    index: int
    port: int
    events_port: int
    replay_port: int
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        """The endpoint a subscriber connects to (the replica binds tcp://*:PORT)."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def worker_spec(self) -> str:
        """This replica as the gateway's `--worker` value."""
        return f"{self.url};events={self.events};replay={self.replay}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def spawn(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"replica {self.index} is already running (pid {self.proc.pid})")
        # stderr goes to a file: a pipe nobody reads could fill up and stall the replica
        fd, path = tempfile.mkstemp(prefix=f"kvgate-sim-{self.index}-", suffix=".log")
        with os.fdopen(fd, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=subprocess.DEVNULL, stderr=log)
        self.log_path = Path(path)

    def log_tail(self, limit: int = 2000) -> str:
        """The end of the replica's stderr (its log)."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_bytes()[-limit:].decode(errors="replace")

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sim replica {self.index} exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.05)
        raise TimeoutError(f"sim replica {self.index} not healthy on {self.url} after {timeout} s")

    def start(self, timeout: float = 30.0) -> None:
        """(Re)start on the same ports and wait until /health answers."""
        self.spawn()
        self.wait_ready(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)
        if self.log_path is not None:
            self.log_path.unlink(missing_ok=True)
            self.log_path = None

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.stop(signal.SIGKILL)


@dataclass
class SimFleet:
    replicas: list[SimReplicaProcess]
    model: str
    model_dir: Path
    args: list[str] = field(default_factory=list)

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    @property
    def worker_specs(self) -> list[str]:
        return [r.worker_spec for r in self.replicas]

    @property
    def events_endpoints(self) -> list[str]:
        return [r.events for r in self.replicas]

    @property
    def replay_endpoints(self) -> list[str]:
        return [r.replay for r in self.replicas]

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


def start_sim_fleet(
    n: int,
    model_dir: str | Path,
    *,
    model: str = "tiny",
    profile: str = "llama-3.1-8b-h100",
    speedup: float = 1.0,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> SimFleet:
    """Start `n` replicas (in parallel) and wait until all are healthy. Extra args are vLLM/sim flags, e.g.
    `["--num-gpu-blocks-override", "64", "--block-size", "16"]`. Responses carry cached_tokens."""
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = str(ROOT) + os.pathsep + run_env.get("PYTHONPATH", "")
    common = ["--model-dir", str(model_dir), "--served-model-name", model, "--profile", profile,
              "--speedup", str(speedup), "--enable-prompt-tokens-details", "--log-level", "warning", *extra_args]
    replicas = []
    for i in range(n):
        port, events, replay = free_port(), free_port(), free_port()
        argv = [sys.executable, "-m", "router.cli", "sim", "--replicas", "1", "--port", str(port),
                "--events-port", str(events), "--replay-port", str(replay), *common]
        replicas.append(SimReplicaProcess(i, port, events, replay, argv, run_env))
    fleet = SimFleet(replicas, model, Path(model_dir), list(common))
    try:
        for replica in replicas:
            replica.spawn()
        for replica in replicas:
            replica.wait_ready(timeout)
    except BaseException:
        fleet.stop()
        raise
    return fleet


@contextmanager
def running_sim_fleet(n: int, model_dir: str | Path, **kwargs: object) -> Iterator[SimFleet]:
    fleet = start_sim_fleet(n, model_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield fleet
    finally:
        fleet.stop()
