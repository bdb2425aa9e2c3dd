"""The simulator's KV events over real ZMQ sockets: vLLM's framing, and the events (live and replayed) rebuild
exactly the replica's cached block set after every request, through evictions and a reset; a replica killed with
SIGKILL and restarted comes back clean."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import zmq
import zmq.asyncio

from bench.sim.launch import SimFleet
from kvcore.kv_events import END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvcore.vllm_hash import block_hashes, event_hash

MODEL = "tiny"
BS = 16


class EventLog:
    """Subscribes to one replica and applies every batch to a reference-counted block set."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.state: Counter[int | bytes] = Counter()
        self.seqs: list[int] = []
        self.events: list[Any] = []

    async def drain(self, timeout: float = 0.2) -> None:
        while await self.sock.poll(int(timeout * 1000)):
            frames = await self.sock.recv_multipart()
            assert len(frames) == 3, frames
            topic, seq, payload = frames
            assert topic == b"" and len(seq) == 8
            self.seqs.append(int.from_bytes(seq, "big"))
            apply(decode_batch(payload).events, self.state, self.events)

    async def matches(self, http: aiohttp.ClientSession, url: str, timeout: float = 3.0) -> bool:
        """Drain until the event-built set equals the replica's block set (events may trail the response)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            await self.drain(0.01)
            if dict(self.state) == await blocks(http, url):
                return True
            if asyncio.get_running_loop().time() > deadline:
                return False


def apply(events: list[Any], state: Counter[int | bytes], log: list[Any] | None = None) -> None:
    for e in events:
        if log is not None:
            log.append(e)
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                state[h] += 1
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                state[h] -= 1
                if state[h] <= 0:
                    del state[h]
        elif isinstance(e, AllBlocksCleared):
            state.clear()


async def blocks(http: aiohttp.ClientSession, url: str) -> dict[int | bytes, int]:
    async with http.get(url + "/sim/blocks") as resp:
        body = await resp.json()
    return {h: n for h, n in body["hashes"]}


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        await sock.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            assert await sock.poll(5000), "no replay answer"
            frames = await sock.recv_multipart()
            assert frames[0] == b""
            if frames[2] == END_OF_REPLAY:
                assert frames[1] == b"" and frames[3] == b""
                return out
            out.append((int.from_bytes(frames[2], "big"), frames[3]))
    finally:
        sock.close()


async def complete(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    async with http.post(url + "/v1/completions",
                         json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}) as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = orjson.loads(await resp.read())
        return body


async def test_events_rebuild_the_block_set_after_every_request(
        sim_fleet: Callable[..., SimFleet], http: aiohttp.ClientSession) -> None:
    # a small cache (15 usable blocks of 16 tokens) so that requests evict each other's blocks
    fleet = sim_fleet(1, speedup=50, extra_args=["--num-gpu-blocks-override", "16", "--max-model-len", "240"])
    replica = fleet.replicas[0]
    ctx = zmq.asyncio.Context()
    try:
        log = EventLog(ctx, replica.events)
        await asyncio.sleep(0.3)  # PUB/SUB: let the subscription reach the publisher
        rng = random.Random(7)
        prefixes = [[rng.randrange(5, 4000) for _ in range(n)] for n in (32, 48, 64)]
        removed_seen = False
        for i in range(25):
            prompt = rng.choice(prefixes) + [rng.randrange(5, 4000) for _ in range(rng.randrange(1, 40))]
            body = await complete(http, replica.url, prompt, rng.randrange(1, 24))
            assert await log.matches(http, replica.url), f"request {i}"
            removed_seen = removed_seen or any(isinstance(e, BlockRemoved) for e in log.events)
            if i == 12:
                async with http.post(replica.url + "/reset_prefix_cache") as resp:
                    assert resp.status == 200
                assert await log.matches(http, replica.url)
                assert log.state == Counter() and isinstance(log.events[-1], AllBlocksCleared)
        assert removed_seen, "the small cache should have evicted blocks"
        assert body["usage"]["prompt_tokens"] > 0
        assert log.seqs == list(range(len(log.seqs)))      # contiguous from 0: nothing lost
        stored = [e for e in log.events if isinstance(e, BlockStored)]
        assert all(e.medium == "GPU" and e.block_size == BS for e in stored)
        # hashes recomputed from the events' token ids (chained by parent) equal the events' hashes
        by_hash: dict[int | bytes, bytes] = {}
        for e in stored:
            assert len(e.token_ids) == BS * len(e.block_hashes)
            if e.parent_block_hash is None:
                digests = block_hashes(e.token_ids, BS)
                assert [event_hash(d) for d in digests] == e.block_hashes
                by_hash.update(zip(e.block_hashes, digests, strict=True))
        assert by_hash, "no request started at a block boundary with a fresh chain"

        # replay from 0 rebuilds the same set, frame for frame the same batches
        replayed = await replay(ctx, replica.replay)
        assert [s for s, _ in replayed] == log.seqs
        state: Counter[int | bytes] = Counter()
        for _, payload in replayed:
            apply(decode_batch(payload).events, state)
        assert dict(state) == await blocks(http, replica.url)
        tail = await replay(ctx, replica.replay, start=log.seqs[-1])
        assert [s for s, _ in tail] == [log.seqs[-1]]
    finally:
        ctx.destroy(linger=0)


async def test_killed_replica_restarts_clean(sim_fleet: Callable[..., SimFleet],
                                             http: aiohttp.ClientSession) -> None:
    fleet = sim_fleet(2, speedup=50)
    victim, other = fleet.replicas
    prompt = list(range(100, 164))
    first = await complete(http, victim.url, prompt, 2)
    again = await complete(http, victim.url, prompt, 2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    victim.kill()
    assert victim.proc is not None and victim.proc.returncode == -9
    # the other replica is untouched
    assert (await complete(http, other.url, prompt, 1))["usage"]["prompt_tokens"] == 64
    victim.start()
    assert await blocks(http, victim.url) == {}
    ctx = zmq.asyncio.Context()
    try:
        log = EventLog(ctx, victim.events)
        await asyncio.sleep(0.3)
        body = await complete(http, victim.url, prompt, 2)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert body["choices"][0]["text"] == first["choices"][0]["text"]   # deterministic across restarts
        assert await log.matches(http, victim.url)
        assert log.seqs and log.seqs[0] == 0                               # a fresh sequence
    finally:
        ctx.destroy(linger=0)
