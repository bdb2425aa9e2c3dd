"""The KV-event path's costs: events applied per second (in process, and over a real ZMQ socket), the lookup of
a long prompt over many workers, the `kv` strategy's whole decision, and bytes per (block, worker) entry."""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import orjson
import zmq
import zmq.asyncio

from kvcore.kv_events import GPU, BlockHash, BlockRemoved, BlockStored, KvEvent, encode_batch
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.kv_index import InMemoryKvIndex
from router.kv_subscriber import EventSource, KvEventHub
from router.metrics import GatewayMetrics
from router.pool import Worker
from router.routing import RouteRequest
from strategies import create_strategy

BLOCK = 16


def _batches(n_batches: int, blocks_per_event: int, seed: int = 0) -> tuple[list[bytes], int]:
    """Encoded batches shaped like an engine's: chains of stored blocks, with removals of older ones."""
    rng = random.Random(seed)
    payloads = []
    blocks = 0
    next_hash = 1
    for _ in range(n_batches):
        tokens = [rng.randrange(32000) for _ in range(blocks_per_event * BLOCK)]
        hashes: list[BlockHash] = list(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        events: list[KvEvent] = [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tokens,
                                             block_size=BLOCK, medium=GPU)]
        if next_hash > 4 * blocks_per_event:
            old: list[BlockHash] = list(range(next_hash - 4 * blocks_per_event, next_hash - 3 * blocks_per_event))
            events.append(BlockRemoved(block_hashes=old, medium=GPU))
        blocks += 2 * blocks_per_event
        payloads.append(encode_batch(events))
    return payloads, blocks


def _hub() -> KvEventHub:
    return KvEventHub(InMemoryKvIndex(), GatewayMetrics(), lambda url: "tiny")


async def events_in_process(n_batches: int, blocks_per_event: int) -> float:
    """Blocks applied per second through decode + apply (the subscriber's own work, no socket)."""
    payloads, blocks = _batches(n_batches, blocks_per_event)
    hub = _hub()
    stream = hub.stream(EventSource("http://w:1", "tcp://127.0.0.1:1"))  # fed here: no socket
    started = time.perf_counter()
    for seq, payload in enumerate(payloads):
        await stream.received([b"kv", seq.to_bytes(8, "big"), payload])
    elapsed = time.perf_counter() - started
    await hub.close()
    return blocks / elapsed


async def events_over_zmq(n_batches: int, blocks_per_event: int) -> float:
    """Blocks applied per second when a publisher floods a real PUB socket on loopback."""
    payloads, blocks = _batches(n_batches, blocks_per_event, seed=1)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    metrics = GatewayMetrics()
    hub = KvEventHub(InMemoryKvIndex(), metrics, lambda url: "tiny")
    source = EventSource("http://w:1", f"tcp://127.0.0.1:{port}")
    hub.watch([source])
    # a marker batch until the subscription is live (PUB drops what is sent before)
    probe = encode_batch([BlockStored(block_hashes=[10**9], token_ids=[1] * BLOCK, block_size=BLOCK)])
    seq = 0
    while not metrics.registry.get_sample_value("kvgate_kv_events_applied_total",
                                                {"worker": source.worker, "type": "BlockStored"}):
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), probe])
        seq += 1
        await asyncio.sleep(0.02)
    target = n_batches + seq
    started = time.perf_counter()
    for payload in payloads:
        await pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        seq += 1
    stream = hub.stream(source)
    while stream.expected is None or stream.expected < target:  # noqa: ASYNC110 - polling a counter, on purpose
        await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - started
    await hub.close()
    pub.close(0)
    ctx.destroy(0)
    return blocks / elapsed


def measure_entry_bytes(blocks: int = 20_000, workers: int = 4) -> float:
    """Bytes one (block, worker) entry costs in the in-memory index, measured with tracemalloc (0 if tracing)."""
    if tracemalloc.is_tracing():
        return 0.0  # someone else is measuring; do not disturb them
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = InMemoryKvIndex()
        for w in range(workers):
            index.add(f"http://10.0.0.{w}:8000", range(w * blocks // 2, w * blocks // 2 + blocks), GPU)
        used = tracemalloc.get_traced_memory()[0] - before
        return used / index.entries()
    finally:
        tracemalloc.stop()



def lookup_cost(workers: int, blocks: int, repeats: int) -> dict[str, float]:
    """µs for one index lookup and one whole `kv` decision, for a `blocks`-block prompt over `workers`."""
    rng = random.Random(2)
    tokens = [rng.randrange(32000) for _ in range(blocks * BLOCK)]
    keys = block_keys(tokens, BLOCK, root_key("tiny"))
    index = InMemoryKvIndex()
    urls = [f"http://10.0.0.{i}:8000" for i in range(workers)]
    for i, url in enumerate(urls):  # every worker holds a different-length run of the prompt, plus noise
        index.add(url, keys[: blocks * (i + 1) // workers], GPU)
        index.add(url, (rng.getrandbits(64) for _ in range(2000)), GPU)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        index.lookup(keys, urls)
        samples.append(time.perf_counter() - started)
    config = GatewayConfig(strategy="kv", block_size=BLOCK)
    strategy = create_strategy(config)
    strategy.attach_kv(index, lambda url: True)
    pool = [Worker(spec=WorkerSpec(url), healthy=True) for url in urls]
    request = RouteRequest(model="tiny", path="/v1/completions", token_ids=tokens, block_keys=keys,
                           prompt_tokens=len(tokens))
    decisions = []
    for _ in range(repeats):
        started = time.perf_counter()
        strategy.choose(request, pool)
        decisions.append(time.perf_counter() - started)
    return {"lookup_us_p50": statistics.median(samples) * 1e6,
            "lookup_us_p99": sorted(samples)[int(0.99 * len(samples))] * 1e6,
            "decision_us_p50": statistics.median(decisions) * 1e6}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, default=20_000, help="event batches to apply")
    parser.add_argument("--blocks-per-event", type=int, default=16)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--prompt-blocks", type=int, default=500)
    parser.add_argument("--out", default="out/kv_bench.json")


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {"benchmark": "kv", "block_size": BLOCK}
    report["blocks_per_s_in_process"] = asyncio.run(events_in_process(args.batches, args.blocks_per_event))
    report["blocks_per_s_over_zmq"] = asyncio.run(events_over_zmq(args.batches, args.blocks_per_event))
    report.update(lookup_cost(args.workers, args.prompt_blocks, 2000))
    report["bytes_per_entry"] = measure_entry_bytes()
    report["workers"], report["prompt_blocks"] = args.workers, args.prompt_blocks
    print(f"events applied: {report['blocks_per_s_in_process']:,.0f} blocks/s in process, "
          f"{report['blocks_per_s_over_zmq']:,.0f} blocks/s over ZMQ (target >= 300,000)")
    print(f"lookup of a {args.prompt_blocks}-block prompt over {args.workers} workers: "
          f"p50 {report['lookup_us_p50']:.1f} µs, p99 {report['lookup_us_p99']:.1f} µs (target <= 100 µs); "
          f"whole kv decision p50 {report['decision_us_p50']:.1f} µs")
    print(f"bytes per (block, worker) entry: {report['bytes_per_entry']:.0f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
