"""A `kvgate agent` process for tests: started by PID on a Unix socket and a free metrics port, with helpers to
read its Prometheus metrics."""

from __future__ import annotations

import resource
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from agent.client import AgentClient
from agent.protocol import AgentError
from bench.procs import free_port
from bench.procs import stop as stop_process
from tests.conftest import kvgate_command


class _PortTaken(Exception):
    pass


class AgentProcess:
    def __init__(self, tmp_path: Path, env: dict[str, str], *flags: str, command: list[str] | None = None,
                 file_size_limit: int | None = None, socket: str | None = None) -> None:
        """`command`: what runs instead of `kvgate agent` (it gets the same flags). `file_size_limit`: no file the
        agent writes may grow past this many bytes (RLIMIT_FSIZE; writes beyond fail with EFBIG, as on a full
        disk), set on the process itself, so no root or special filesystem is needed. `socket`: another socket
        path than TMP_PATH/agent.sock (to stand in for an agent that had it)."""
        self.socket = socket or str(tmp_path / "agent.sock")
        self.log_path = tmp_path / "agent.log"  # a file, not a pipe nobody reads (which could fill and stall it)
        self.metrics_port = free_port()
        self._command = command or kvgate_command("agent")
        self._flags = flags
        self.env = env
        self.file_size_limit = file_size_limit
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def _limit(self) -> None:
        if self.file_size_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (self.file_size_limit, self.file_size_limit))

    @property
    def cmd(self) -> list[str]:
        return [*self._command, "--socket-path", self.socket, "--metrics-port", str(self.metrics_port),
                "--metrics-host", "127.0.0.1", *self._flags]

    def start(self) -> None:
        for _attempt in range(3):
            try:
                return self._start()
            except _PortTaken:
                # between a stop and this start, an outgoing connection on this machine took the metrics port
                # as its source port (it came from the ephemeral range): the agent cannot bind it again
                self.metrics_port = free_port()
        self._start()

    def _start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logged = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            # a session of its own, as a sidecar has its own container: on this 2-core machine, with vLLM's workers
            # busy-waiting and other sessions' jobs, the test's session went unscheduled for up to 72 s at a time
            # while a process in a session of its own waited 5.8 s at most (docs/agent.md, the two-worker runs)
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=log,
                                         preexec_fn=self._limit if self.file_size_limit is not None else None,
                                         start_new_session=True)
        # Generous: on a 2-core CI machine a serving vLLM can hold both cores while the agent imports and starts.
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                with self.log_path.open("rb") as log:
                    log.seek(logged)
                    this_run = log.read().decode(errors="replace")
                if f"('127.0.0.1', {self.metrics_port}): address already in use" in this_run:
                    raise _PortTaken
                raise RuntimeError(f"agent exited: {self.log_path.read_text(errors='replace')[-4000:]}")
            try:
                with AgentClient(self.socket, shm_bytes=0, timeout_s=1) as client:
                    client.stats()
                with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1):
                    return
            except (AgentError, OSError):
                time.sleep(0.05)
        raise TimeoutError(f"agent did not come up in 90 s: {self.log_path.read_text(errors='replace')[-4000:]}")

    def metrics(self) -> str:
        # (generous: a loaded machine may not run the agent for a minute; a late answer is not what tests check)
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=120) as response:
            body: bytes = response.read()
            return body.decode()

    def metric(self, name: str, **labels: str) -> float:
        wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in self.metrics().splitlines():
            if line.startswith(wanted + " "):
                return float(line.split()[-1])
        raise KeyError(wanted)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig)
