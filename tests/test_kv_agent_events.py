"""The gateway's view of a real tier agent's tiers (issue 12 items 4 and 5): a `kvgate agent` process with a Valkey
shared tier publishes its KV events; a gateway's event hub subscribes to it beside the engine's events (a test
publisher). The agent's announcements are placed even when they arrive before the engine names the blocks, and the
shared tier the gateway sees follows the store within seconds: blocks that expire, or a Valkey that restarts
empty, leave the index."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import zmq.asyncio

from agent.client import AgentClient
from bench.procs import free_port
from router.kv_index import CPU, GPU, SHARED, InMemoryKvIndex
from router.kv_subscriber import EventSource, KvEventHub
from router.metrics import GatewayMetrics
from tests.agent_process import AgentProcess
from tests.conftest import ValkeyServer, eventually
from tests.test_kv_events_in import BS, KEYS, TOKENS, WORKER, Publisher, connected, held, metric, stored

LAYOUT = 7


@asynccontextmanager
async def gateway_view(agent_events: str, agent_replay: str) -> AsyncIterator[tuple[KvEventHub, Publisher,
                                                                                   GatewayMetrics]]:
    """A hub subscribed to an engine (a test publisher) and to the agent, both about one worker."""
    ctx = zmq.asyncio.Context()
    engine = Publisher(ctx)
    metrics = GatewayMetrics()
    hub = KvEventHub(InMemoryKvIndex(), metrics, lambda url: "tiny", block_size=BS)
    try:
        hub.watch([engine.source, EventSource(WORKER, agent_events, agent_replay, "agent")])
        await connected(hub, engine)
        yield hub, engine, metrics
    finally:
        await hub.close()
        engine.close()
        ctx.destroy(0)


def store_blocks(agent: AgentProcess, hashes: list[int]) -> None:
    with AgentClient(agent.socket, shm_bytes=0) as client:
        assert client.store(LAYOUT, hashes, [bytes([h]) * 64 for h in hashes]) == len(hashes)


def shared(hub: KvEventHub) -> set[int]:
    return {key for key, tier in held(hub) if tier == SHARED}


@pytest.mark.timeout(180)
async def test_the_shared_tier_the_gateway_sees_follows_the_store(tmp_path: Path, valkey: ValkeyServer,
                                                                  subprocess_env: dict[str, str]) -> None:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    agent = AgentProcess(tmp_path, subprocess_env, "--events-endpoint", events.replace("127.0.0.1", "*"),
                         "--replay-endpoint", replay.replace("127.0.0.1", "*"), "--block-size", str(BS),
                         "--write-policy", "eager", "--shared-backend", "redis", "--shared-url", valkey.url,
                         "--shared-index-refresh-s", "0.5", "--shared-ttl-s", "4")
    try:
        await follow_the_store(agent, valkey, events, replay)
    finally:
        agent.stop()


async def follow_the_store(agent: AgentProcess, valkey: ValkeyServer, events: str, replay: str) -> None:
    async with gateway_view(events, replay) as (hub, engine, metrics):
        # 1. the agent saves blocks before the engine's events name them: its announcements wait, then count
        store_blocks(agent, [1, 2])
        await eventually(lambda: hub.applier.waiting() >= 2, timeout=10)
        await engine.send([stored([1, 2, 3, 4], TOKENS[:16])])
        await eventually(lambda: {(KEYS[0], CPU), (KEYS[1], CPU), (KEYS[0], SHARED), (KEYS[1], SHARED)}
                         <= held(hub), timeout=10)
        assert hub.index.lookup(KEYS, ["http://other:1"])["http://other:1"].blocks == 2  # shared: every worker's
        # 2. shared blocks expire (TTL 4 s): the agent says so, and the gateway stops counting them
        began = time.monotonic()
        await eventually(lambda: not shared(hub), timeout=15)
        assert time.monotonic() - began < 10
        assert (KEYS[0], GPU) in held(hub) and (KEYS[0], CPU) in held(hub)  # the other tiers are untouched
        # 3. Valkey restarts empty: what was in it leaves the gateway's view within seconds
        store_blocks(agent, [3, 4])
        await eventually(lambda: {KEYS[2], KEYS[3]} <= shared(hub), timeout=10)
        valkey.stop()
        valkey.start()
        began = time.monotonic()
        await eventually(lambda: not shared(hub), timeout=20)
        print(f"the gateway saw the emptied shared tier after {time.monotonic() - began:.1f} s")
        assert metric(metrics, "kvgate_kv_unmapped_blocks_total", worker=WORKER) == 0
        assert hub.trusted(WORKER)
