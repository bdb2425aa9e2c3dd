"""The Redis shared tier's loads, read off the socket into the caller's buffers: what they cost, what they accept
and refuse, and how they fail (timeouts, replies of another kind, cluster nodes), on real Valkey servers."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.cluster

from agent.block import HEADER_SIZE, key_name
from agent.tiers.base import StoreItem
from agent.tiers.shared import RedisSharedTier
from bench.procs import free_port, valkey_server_binary, wait_for_port
from bench.procs import stop as stop_process
from tests.conftest import ValkeyServer

LAYOUT = 0x5EAD
MIB = 2**20


def key(i: int) -> tuple[int, int]:
    return (LAYOUT, i)


def payload(i: int, size: int) -> bytes:
    return (bytes([i % 251]) + bytes(range(256)) * (size // 256 + 1))[:size]


def flip(raw: redis.Redis, name: str, offset: int) -> None:
    byte = raw.getrange(name, offset, offset)
    assert isinstance(byte, bytes) and len(byte) == 1
    raw.setrange(name, offset, bytes([byte[0] ^ 0xFF]))


def outs(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


def test_a_load_of_large_blocks_goes_to_the_buffers_without_copies(valkey: ValkeyServer) -> None:
    """Loads of 2 MiB blocks ran at a tenth of what Valkey serves (0.55 GB/s on an H200 machine, DRAM 5 GB/s):
    redis-py read each value 64 KiB at a time into a growing BytesIO, copied it out into a bytes object twice more,
    and the tier copied that into the caller's buffer. A load now holds no copy of a block in between."""
    tier = RedisSharedTier(valkey.url, ttl_s=60, secret=b"fleet")
    blocks = [payload(i, 2 * MIB) for i in range(16)]
    assert tier.store_many([StoreItem(key(i), memoryview(b)) for i, b in enumerate(blocks)]) == 16
    buffers = outs(16, 2 * MIB)
    tracemalloc.start()
    try:
        got = tier.read_many([key(i) for i in range(16)], buffers)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got == [2 * MIB] * 16
    assert all(bytes(buffers[i]) == blocks[i] for i in range(16))
    assert peak < 2 * MIB, f"a load of 32 MiB allocated {peak / MIB:.1f} MiB on the way"
    tier.close()


@pytest.mark.parametrize("secret", [None, b"fleet"])
def test_a_mixed_batch_is_checked_block_by_block(valkey: ValkeyServer, secret: bytes | None) -> None:
    tier = RedisSharedTier(valkey.url, ttl_s=60, secret=secret)
    raw = redis.Redis.from_url(valkey.url)
    small, big = payload(1, 16 * 1024), payload(2, 300 * 1024)
    assert tier.store_many([StoreItem(key(1), small), StoreItem(key(2), memoryview(big)),
                            StoreItem(key(3), payload(3, 300 * 1024)), StoreItem(key(4), payload(4, 16 * 1024)),
                            StoreItem(key(5), memoryview(payload(5, 600 * 1024))),
                            StoreItem(key(6), payload(6, 100))]) == 6
    name, name4 = f"kvgate:{key_name(key(3))}", f"kvgate:{key_name(key(4))}"
    flip(raw, name + ":p", 1000)  # a split block's payload corrupted
    flip(raw, name4, 10_000)  # a joined block's payload corrupted
    raw.delete(f"kvgate:{key_name(key(2))}:p")  # a split block's prefix without its payload
    keys = [key(i) for i in (1, 2, 3, 4, 5, 6, 9)]
    buffers = outs(7, 512 * 1024)  # too small for block 5: a miss, the block stays
    assert tier.read_many(keys, buffers) == [len(small), None, None, None, None, 100, None]
    assert bytes(buffers[0][: len(small)]) == small and bytes(buffers[5][:100]) == payload(6, 100)
    assert tier.stats.checksum_failures == 2  # 3 and 4, deleted
    assert not raw.exists(name, name + ":p", name4)
    assert tier.stats.read_errors == 1  # 2: torn
    # a buffer below the split size asks for the block's one string: a split block is a miss (too big)
    assert tier.read_many([key(5), key(1)], outs(2, 200 * 1024)) == [None, len(small)]
    assert raw.exists(f"kvgate:{key_name(key(5))}", f"kvgate:{key_name(key(5))}:p") == 2
    fit = outs(2, 600 * 1024)
    assert tier.read_many([key(5), key(6)], fit) == [600 * 1024, 100]
    assert bytes(fit[0]) == payload(5, 600 * 1024)
    assert tier.stats.read_errors == 1 and tier.stats.checksum_failures == 2
    assert tier.stats.backend_errors == 0
    tier.close()


def test_a_joined_block_wins_over_a_stale_payload_string(valkey: ValkeyServer) -> None:
    tier = RedisSharedTier(valkey.url, ttl_s=60)
    raw = redis.Redis.from_url(valkey.url)
    block = payload(1, 300 * 1024)
    assert tier.store(key(1), memoryview(block))
    name = f"kvgate:{key_name(key(1))}"
    prefix, body = raw.get(name), raw.get(name + ":p")
    assert isinstance(prefix, bytes) and isinstance(body, bytes) and len(prefix) == HEADER_SIZE
    raw.set(name, prefix + body)  # the block as one string, as a writer with another split size writes it
    raw.set(name + ":p", b"stale" * 1000)
    out = outs(1, 400 * 1024)
    assert tier.read_many([key(1)], out) == [len(block)] and bytes(out[0][: len(block)]) == block
    tier.close()


def test_a_reply_of_another_kind_is_read_as_redis_py_reads_it(valkey: ValkeyServer,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A GET answered with an error the direct read does not take (here NOPERM: an ACL user that may not read one
    block's payload) goes through redis-py's pipeline: the error counts as before, and the connection the direct
    read gave up on is not handed to the next read. (WRONGTYPE, a key of another type, is one unreadable block:
    test_agent_tiers.)"""
    writer = RedisSharedTier(valkey.url, ttl_s=60)
    assert writer.store_many([StoreItem(key(i), memoryview(payload(i, 300 * 1024))) for i in range(4)]) == 4
    writer.close()
    raw = redis.Redis.from_url(valkey.url)
    raw.acl_setuser("reader", enabled=True, passwords=["+pw"], keys=["kvgate:*[023]", "kvgate:*[023]:p"],
                    commands=["+@all"], channels=["*"])
    tier = RedisSharedTier(valkey.url.replace("redis://", "redis://reader:pw@"), ttl_s=60, retry_s=0.1)
    with caplog.at_level(logging.DEBUG, logger="agent.tiers.shared"):
        assert tier.read_many([key(0), key(1), key(2)], outs(3, 300 * 1024)) == [None] * 3
    assert "through the pipeline" in caplog.text and tier.stats.backend_errors == 1
    time.sleep(0.15)
    for _ in range(3):
        buffers = outs(2, 300 * 1024)
        assert tier.read_many([key(2), key(3)], buffers) == [300 * 1024] * 2
        assert bytes(buffers[1]) == payload(3, 300 * 1024)
    tier.close()


def test_a_load_times_out_and_its_late_replies_reach_no_one(valkey: ValkeyServer) -> None:
    """The socket keeps `shared_timeout_s`: a server that stops answering is a backend error within the retries'
    time, and what it sends afterwards on the dropped connection is never read as another load's replies."""
    tier = RedisSharedTier(valkey.url, ttl_s=60, timeout_s=0.2, retry_s=0.1)
    assert tier.store_many([StoreItem(key(i), memoryview(payload(i, 2 * MIB))) for i in range(4)]) == 4
    admin = redis.Redis.from_url(valkey.url)
    admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")  # type: ignore[no-untyped-call]
    started = time.monotonic()
    assert tier.read_many([key(0), key(1)], outs(2, 2 * MIB)) == [None, None]
    assert tier.stats.backend_errors == 1 and time.monotonic() - started < 12
    time.sleep(max(0.0, 1.7 - (time.monotonic() - started)))
    buffers = outs(2, 2 * MIB)
    assert tier.read_many([key(2), key(3)], buffers) == [2 * MIB] * 2
    assert bytes(buffers[0]) == payload(2, 2 * MIB) and bytes(buffers[1]) == payload(3, 2 * MIB)
    tier.close()


def test_concurrent_loads_each_get_their_own_blocks(valkey: ValkeyServer) -> None:
    tier = RedisSharedTier(valkey.url, ttl_s=60, secret=b"s")
    assert tier.store_many([StoreItem(key(i), memoryview(payload(i, 300 * 1024))) for i in range(8)]) == 8
    failures: list[str] = []

    def load(first: int) -> None:
        for _ in range(10):
            ids = [(first + j) % 8 for j in range(4)]
            buffers = outs(4, 300 * 1024)
            if tier.read_many([key(i) for i in ids], buffers) != [300 * 1024] * 4 or any(
                    bytes(buffers[j]) != payload(i, 300 * 1024) for j, i in enumerate(ids)):
                failures.append(f"load from {first}")

    threads = [threading.Thread(target=load, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == [] and tier.stats.backend_errors == 0
    tier.close()


# -- a cluster of three nodes -------------------------------------------------------------------------------


@pytest.fixture
def valkey_cluster3(tmp_path: Path) -> Iterator[list[int]]:
    """Three Valkey Cluster nodes, the slots split between them: a block's strings live on different nodes."""
    ports = [free_port() for _ in range(3)]
    buses = [free_port() for _ in range(3)]  # (port + 10000, the default, may not exist)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for n, port in enumerate(ports):
            workdir = tmp_path / f"node{n}"
            workdir.mkdir()
            procs.append(subprocess.Popen(
                [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                 "no", "--dir", str(workdir), "--cluster-enabled", "yes", "--cluster-port", str(buses[n]),
                 "--cluster-config-file", str(workdir / "nodes.conf")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port, proc in zip(ports, procs, strict=True):
            wait_for_port(port, 15, proc)
        admins = [redis.Redis(port=port) for port in ports]
        for n, admin in enumerate(admins):
            first, last = n * 16384 // 3, (n + 1) * 16384 // 3 - 1
            admin.execute_command("CLUSTER", "ADDSLOTSRANGE", str(first), str(last))  # type: ignore[no-untyped-call]
        for port, bus in zip(ports[1:], buses[1:], strict=True):
            admins[0].execute_command("CLUSTER", "MEET", "127.0.0.1", str(port), str(bus))  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 20
        while not all(b"cluster_state:ok" in a.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
                      for a in admins):
            assert time.monotonic() < deadline, "the three-node cluster did not come up"
            time.sleep(0.1)
        for admin in admins:
            admin.close()
        yield ports
    finally:
        for proc in procs:
            stop_process(proc)


def test_cluster_loads_read_each_node_directly(valkey_cluster3: list[int], caplog: pytest.LogCaptureFixture) -> None:
    url = f"redis://127.0.0.1:{valkey_cluster3[0]}/0"
    writer = RedisSharedTier(url, cluster=True, ttl_s=60, secret=b"s")
    reader = RedisSharedTier(url, cluster=True, ttl_s=60, secret=b"s")
    sizes = {i: (300 * 1024 if i % 2 else 16 * 1024) for i in range(24)}
    assert writer.store_many([StoreItem(key(i), memoryview(payload(i, n))) for i, n in sizes.items()]) == 24
    assert reader.refresh_index() == 24
    nodes = {writer.client.get_node_from_key(f"kvgate:{key_name(key(i))}{s}").name  # type: ignore[union-attr, unused-ignore]
             for i in range(24) for s in ("", ":p")}
    assert len(nodes) == 3
    keys = [key(i) for i in range(24)] + [key(99)]
    buffers = outs(25, 300 * 1024)
    with caplog.at_level(logging.DEBUG, logger="agent.tiers.shared"):
        assert reader.read_many(keys, buffers) == [sizes[i] for i in range(24)] + [None]
    assert "through the pipeline" not in caplog.text
    assert all(bytes(buffers[i][: sizes[i]]) == payload(i, sizes[i]) for i in range(24))
    # a slot moved behind the reader's back (its one key gone): MOVED, and the batch goes through redis-py's
    # cluster pipeline, which follows it
    name = f"kvgate:{key_name(key(1))}:p"
    client = reader.client
    assert isinstance(client, redis.cluster.RedisCluster)
    slot = client.keyslot(name)  # type: ignore[no-untyped-call, unused-ignore]
    owner = client.get_node_from_key(name).port  # type: ignore[no-untyped-call, unused-ignore]
    other = next(p for p in valkey_cluster3 if p != owner)
    admin = redis.Redis(port=other)
    node_id = admin.execute_command("CLUSTER", "MYID")  # type: ignore[no-untyped-call]
    redis.Redis(port=owner).delete(name)  # (a node gives a slot away only empty)
    for port in valkey_cluster3:
        redis.Redis(port=port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", node_id)  # type: ignore[no-untyped-call]
    with caplog.at_level(logging.DEBUG, logger="agent.tiers.shared"):
        got = reader.read_many([key(0), key(1), key(3)], outs(3, 300 * 1024))
    assert got[0] == sizes[0] and got[1] is None and "through the pipeline" in caplog.text
    assert reader.stats.backend_errors == 0
    for tier in (writer, reader):
        tier.close()


# -- saves ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ttl_s", [60.0, 0.0])
def test_a_mixed_save_writes_what_redis_py_wrote(valkey: ValkeyServer, ttl_s: float) -> None:
    """Saves are packed by the tier (one buffer for small blocks, large payloads as they are): the strings, their
    TTLs (none with `ttl_s` 0) and the announcement are those redis-py's pipeline wrote."""
    writer = RedisSharedTier(valkey.url, ttl_s=ttl_s, secret=b"s")
    reader = RedisSharedTier(valkey.url, ttl_s=ttl_s, secret=b"s")
    reader.listen()
    assert reader.wait_subscribed(10)
    raw = redis.Redis.from_url(valkey.url)
    sizes = [16 * 1024, 2 * MIB, 100, 300 * 1024, 0, 16 * 1024]
    items = [StoreItem(key(i), memoryview(bytearray(payload(i, n)))) for i, n in enumerate(sizes)]
    assert writer.store_many(items) == len(items)
    for i, n in enumerate(sizes):
        name = f"kvgate:{key_name(key(i))}"
        value = raw.get(name)
        assert isinstance(value, bytes)
        if n >= 256 * 1024:
            assert len(value) == HEADER_SIZE + 16 and raw.get(name + ":p") == payload(i, n)
        else:
            assert value[HEADER_SIZE + 16:] == payload(i, n) and not raw.exists(name + ":p")
        for string in (name, name + ":p") if n >= 256 * 1024 else (name,):
            ttl = raw.pttl(string)
            assert (50_000 < ttl <= 60_000) if ttl_s else ttl == -1
    deadline = time.monotonic() + 5
    while not all(reader.contains(key(i)) for i in range(len(sizes))):  # announced
        assert time.monotonic() < deadline, "the save was not announced"
        time.sleep(0.01)
    buffers = outs(len(sizes), 2 * MIB)
    assert reader.read_many([key(i) for i in range(len(sizes))], buffers) == sizes
    assert all(bytes(buffers[i][:n]) == payload(i, n) for i, n in enumerate(sizes))
    for tier in (writer, reader):
        assert tier.stats.backend_errors == 0
        tier.close()


def test_a_save_refused_midway_leaves_the_connection_in_step(valkey: ValkeyServer) -> None:
    """Error replies to a save's SETs (out of memory) pause writes, not reads; every reply after the first error
    is read too, so the next fetch on the same pooled connection gets its own replies."""
    tier = RedisSharedTier(valkey.url, ttl_s=60, retry_s=0.2)
    raw = redis.Redis.from_url(valkey.url)
    assert tier.store_many([StoreItem(key(i), payload(i, 16 * 1024)) for i in range(4)]) == 4
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", "1")
    try:
        assert tier.store_many([StoreItem(key(i), payload(i, 16 * 1024)) for i in range(10, 14)]) == 0
        assert tier.stats.backend_errors == 1 and tier.available
        for _ in range(3):
            buffers = outs(4, 16 * 1024)
            assert tier.read_many([key(i) for i in range(4)], buffers) == [16 * 1024] * 4
            assert all(bytes(buffers[i]) == payload(i, 16 * 1024) for i in range(4))
    finally:
        raw.config_set("maxmemory", "0")
    time.sleep(0.25)
    assert tier.store_many([StoreItem(key(20), payload(20, 16 * 1024))]) == 1
    assert raw.exists(f"kvgate:{key_name(key(20))}")
    tier.close()
