"""What a gateway of several processes routes, told to each sibling (router/sibling_routes.py): real gateway
processes in front of stand-in workers (a prefix sent through one process follows where the other sent it; a burst
of first reads through both is spread as one process would spread it), then the exchange on its own with real
strategies on real Unix sockets: garbage, a sibling killed with requests in flight, reconnecting, an oversized
frame, a record whose end never comes."""

from __future__ import annotations

import asyncio
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import msgspec
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import free_port, stop, wait_http
from bench.standin import STATS, StandinBehaviour
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.frames import FrameBuffer
from router.metrics import GatewayMetrics
from router.pool import Worker
from router.routing import Placement, RouteRequest
from router.sibling_routes import MAX_FRAME_BYTES, SiblingRoutes
from strategies import create_strategy
from strategies.prefix import PrefixAffinity
from tests.conftest import Standin, eventually, kvgate_command, running_standin

ROOT = Path(__file__).resolve().parent.parent
BS = 16
PREFIX_TOKENS = 256  # 16 blocks


def _values(text: str, name: str, **labels: str) -> dict[str, float]:
    """A metric's value per process (of the samples with `labels`), from the gateway's merged /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out[s.labels["process"]] = out.get(s.labels["process"], 0.0) + s.value
    return out


@dataclass
class _Gateway:
    url: str

    async def metrics(self) -> str:
        """Every process's, merged."""
        async with aiohttp.ClientSession() as http, http.get(self.url + "/metrics") as resp:
            return await resp.text()

    async def applied(self, records: int) -> None:
        """Until the processes together have applied `records` records of their siblings'."""
        for _ in range(200):
            applied = _values(await self.metrics(), "kvgate_sibling_records_total", outcome="applied")
            if sum(applied.values()) >= records:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"fewer than {records} records applied")


@asynccontextmanager
async def gateway(strategy: str, workers: list[Standin], *extra: str) -> AsyncIterator[_Gateway]:
    """`kvgate serve --processes 2` in front of `workers`, both processes up and telling each other."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    gw = _Gateway(url)
    with tempfile.TemporaryFile() as log:
        args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--processes", "2", "--strategy", strategy,
                "--block-size", str(BS), "--health-interval-s", "0.2", *extra]
        for worker in workers:
            args += ["--worker", worker.url]
        proc = subprocess.Popen(kvgate_command(*args), stdout=log, stderr=subprocess.STDOUT)
        try:
            await asyncio.to_thread(wait_http, url + "/ready", 60.0, proc)
            for _ in range(300):
                text = await gw.metrics()
                if (_values(text, "kvgate_worker_healthy") == {"0": len(workers), "1": len(workers)}
                        and _values(text, "kvgate_siblings_connected", direction="to") == {"0": 1.0, "1": 1.0}):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"the processes did not come up: {text}")
            yield gw
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            stop(proc)
            log.seek(0)
            assert code == 0, log.read().decode(errors="replace")[-4000:]


async def _send(url: str, tokens: list[int], *, stream: bool = False) -> None:
    body = orjson.dumps({"model": "tiny", "prompt": tokens, "max_tokens": 2, "stream": stream})
    # a connection per request: the kernel spreads them over both processes
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http, \
            http.post(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


def _served(workers: list[Standin]) -> list[int]:
    return [w.app[STATS].requests for w in workers]


@pytest.mark.parametrize("strategy", ["prefix", "ttft"])
async def test_a_prefix_sent_through_one_process_follows_through_the_other(strategy: str) -> None:
    """Before, a process knew only the prefixes it had routed itself: of 24 prefixes each sent twice on new
    connections (through either process), the second went where the first had only when the kernel gave it the same
    process (or the other guessed the same of 4 workers): 18 and 14 of 24 (two runs, prefix), 17 and 17 (ttft).
    Now every one."""
    prefixes = 24
    async with AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(running_standin()) for _ in range(4)]
        # ttft: its bounded-load balance moves a prefix off a worker over its share of requests (one process's too):
        # off, so that only what the processes know decides
        gw = await stack.enter_async_context(gateway(strategy, workers, *(
            ["--ttft-balance-slack", "-1"] if strategy == "ttft" else [])))
        followed = 0
        for i in range(prefixes):
            prefix = list(range(100_000 * (i + 1), 100_000 * (i + 1) + PREFIX_TOKENS))
            before = _served(workers)
            await _send(gw.url, [*prefix, 1, 2, 3])
            first = [a - b for a, b in zip(_served(workers), before, strict=True)].index(1)
            await gw.applied(2 * (2 * i + 1))  # its placement and its end, at the other process
            before = _served(workers)
            await _send(gw.url, [*prefix, 4, 5, 6, 7])
            second = [a - b for a, b in zip(_served(workers), before, strict=True)].index(1)
            await gw.applied(2 * (2 * i + 2))
            followed += first == second
        assert followed == prefixes


@pytest.mark.parametrize("strategy", ["ttft", "kv"])
async def test_first_reads_through_both_processes_spread_over_the_workers(strategy: str) -> None:
    """First reads (no prefix in common) held before their first tokens, one after the other through either
    process: one to each worker, as one process would place them. Before, each process spread only its own: 6 over
    6 workers went [0, 1, 1, 1, 1, 2] and [0, 0, 1, 1, 2, 2] (two runs, ttft; kv the same)."""
    count = 6
    async with AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(running_standin(StandinBehaviour(first_token_delay_s=30.0)))
                   for _ in range(count)]
        gw = await stack.enter_async_context(gateway(strategy, workers))
        held = []
        try:
            for i in range(count):
                prefix = list(range(100_000 * (i + 1), 100_000 * (i + 1) + PREFIX_TOKENS))
                held.append(asyncio.ensure_future(_send(gw.url, prefix, stream=True)))
                await eventually(lambda n=i + 1: sum(_served(workers)) == n)  # type: ignore[misc]
                await gw.applied(i + 1)
            assert sorted(_served(workers)) == [1] * count, _served(workers)
            # whichever process answers, its listing counts each worker's request once: its own or its sibling's
            async with aiohttp.ClientSession() as http, http.get(gw.url + "/admin/workers") as resp:
                rows = (await resp.json())["workers"]
            assert [r["in_flight"] + r["sibling_in_flight"] for r in rows] == [1] * count, rows
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


# the exchange on its own: two processes' ends in one event loop, each with its strategy and pool, on real sockets

def _strategy() -> PrefixAffinity:
    strategy = create_strategy(GatewayConfig(strategy="prefix", block_size=BS))
    assert isinstance(strategy, PrefixAffinity)
    return strategy


class _Process:
    """One gateway process's side: its strategy, its workers, its routes."""

    def __init__(self, index: int, sockets: str, count: int = 2, record_ttl_s: float = 60.0) -> None:
        self.strategy = _strategy()
        self.workers = [Worker(spec=WorkerSpec(f"http://127.0.0.1:{9000 + i}"), healthy=True,
                               models=frozenset({"tiny"})) for i in range(4)]
        by_url = {w.url: w for w in self.workers}
        self.requests: list[RouteRequest] = []  # alive while in flight: a request's number is its id, as the proxy's
        self.metrics = GatewayMetrics()
        self.routes = SiblingRoutes(index, lambda i: os.path.join(sockets, f"routes-{i}.sock"), count,
                                    self.strategy, by_url.get, self.metrics, record_ttl_s=record_ttl_s)

    def route(self, seed: int) -> tuple[int, RouteRequest, Worker]:
        """A request of a new prefix routed here (its placement told to the siblings); its id, itself and its
        worker."""
        tokens = list(range(seed * 1000, seed * 1000 + PREFIX_TOKENS))
        request = RouteRequest(model="tiny", path="/v1/completions", token_ids=tokens,
                               block_keys=block_keys(tokens, BS, root_key("tiny")), prompt_tokens=len(tokens))
        self.requests.append(request)
        decision = self.strategy.choose(request, self.workers)
        assert decision.placement is not None
        self.routes.routed(id(request), decision.placement)
        return id(request), request, decision.worker

    def sibling_in_flight(self) -> int:
        return sum(w.sibling_in_flight for w in self.workers)

    def records(self, outcome: str) -> float:
        return self.metrics.sibling_records.labels(outcome)._value.get()  # type: ignore[no-any-return]


@pytest.fixture
def sockets() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvgate-routes-") as folder:  # short: a Unix socket's path is <108 bytes
        yield folder


@asynccontextmanager
async def started(*processes: _Process) -> AsyncIterator[None]:
    for p in processes:
        await p.routes.start()
    try:
        await eventually(lambda: all(p.routes.telling == len(processes) - 1 for p in processes))
        yield
    finally:
        for p in processes:
            await p.routes.close()


async def test_a_sibling_applies_placements_and_ends_through_its_strategy(sockets: str) -> None:
    a, b = _Process(0, sockets), _Process(1, sockets)
    async with started(a, b):
        routed = [a.route(i) for i in range(5)]
        await eventually(lambda: b.routes.applied() == 5)
        assert b.sibling_in_flight() == 5 and a.sibling_in_flight() == 0
        # b's trie holds a's prefixes where a sent them
        for _, request, worker in routed:
            assert b.strategy.balance.trie.match(request.block_keys).get(worker.url) == PREFIX_TOKENS // BS
        for number, _, _ in routed:
            a.routes.ended(number)
        await eventually(lambda: b.routes.applied() == 0)
        assert b.sibling_in_flight() == 0
        assert a.records("sent") == 10 and b.records("applied") == 10


async def test_a_sibling_killed_with_requests_in_flight_has_them_all_dropped(sockets: str) -> None:
    b = _Process(1, sockets)
    await b.routes.start()
    child = subprocess.Popen([sys.executable, "-c", CHILD, sockets], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60.0)
        assert line == b"routed\n"
        await eventually(lambda: b.routes.applied() == 7)
        assert b.sibling_in_flight() == 7
        os.kill(child.pid, signal.SIGKILL)
        await eventually(lambda: b.routes.applied() == 0)
        assert b.sibling_in_flight() == 0 and b.records("disconnected") == 7
    finally:
        stop(child)
        await b.routes.close()


CHILD = """
import asyncio, os, sys
sys.path.insert(0, os.getcwd())
from tests.test_sibling_routes import _Process

async def main():
    a = _Process(0, sys.argv[1])
    await a.routes.start()
    while not a.routes.telling:
        await asyncio.sleep(0.01)
    for i in range(7):
        a.route(i)
    print("routed", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


async def test_garbage_drops_only_that_connection(sockets: str) -> None:
    a, b = _Process(0, sockets), _Process(1, sockets)
    async with started(a, b):
        a.route(1)
        await eventually(lambda: b.routes.applied() == 1)
        placement = msgspec.msgpack.encode(Placement("http://127.0.0.1:9000", None, [1, 2], 32, 0, 4, False, None))
        bad_frames = [
            b"\xff\xff\xff\xff",  # 4 GiB to come
            struct.pack(">I", MAX_FRAME_BYTES + 1),  # over the bound
            struct.pack(">I", 0),
            _frame(b"\xc1\xc1\xc1"),  # not msgpack
            _frame(msgspec.msgpack.encode([[9, 1]])),  # no such record
            _frame(msgspec.msgpack.encode([[1, -1, msgspec.msgpack.decode(placement)]])),  # a negative request
            _frame(msgspec.msgpack.encode([[1, 5, ["w", None, [1], 1, 1, 1, True, None, float("nan")]]])),
            # a request routed twice on one connection: the first one applied, then dropped with the connection
            _frame(msgspec.msgpack.encode([[1, 5, msgspec.msgpack.decode(placement)]] * 2)),
            struct.pack(">I", 100) + b"\x00",  # and then nothing more
        ]
        for frame in bad_frames:
            reader, writer = await asyncio.open_unix_connection(os.path.join(sockets, "routes-1.sock"))
            writer.write(frame)
            assert await asyncio.wait_for(reader.read(), 10.0) == b""  # closed by the sibling
            writer.close()
        assert b.routes.applied() == 1 and b.sibling_in_flight() == 1  # a's, still
        assert b.metrics.sibling_connections_dropped.labels("garbage")._value.get() == len(bad_frames)
        assert b.records("disconnected") == 1  # the one routed twice, dropped with its connection
        a.route(2)
        await eventually(lambda: b.routes.applied() == 2)


async def test_a_sibling_that_comes_back_hears_what_is_in_flight(sockets: str) -> None:
    """A gap while the sibling was down is repaired: the connection made again carries every request still in flight
    (the first token too), and the records of the old one were dropped when it closed."""
    a, b = _Process(0, sockets), _Process(1, sockets)
    async with started(a, b):
        first, _, _ = a.route(1)
        a.routes.first_token(first)
        await eventually(lambda: b.routes.applied() == 1)
        await b.routes.close()
        await eventually(lambda: a.routes.telling == 0)
        assert b.sibling_in_flight() == 0
        later = [a.route(i)[0] for i in range(2, 5)]  # while b is away
        a.routes.ended(later[0])
        b2 = _Process(1, sockets)
        await b2.routes.start()
        try:
            await eventually(lambda: b2.routes.applied() == 3)  # the first and two later ones
            assert b2.sibling_in_flight() == 3
            for request in [first, *later[1:]]:
                a.routes.ended(request)
            await eventually(lambda: b2.routes.applied() == 0)
            assert b2.sibling_in_flight() == 0
        finally:
            await b2.routes.close()


async def test_a_record_whose_end_never_comes_expires(sockets: str) -> None:
    a, b = _Process(0, sockets), _Process(1, sockets, record_ttl_s=0.4)
    async with started(a, b):
        a.route(1)
        await eventually(lambda: b.routes.applied() == 1)
        await eventually(lambda: b.routes.applied() == 0, timeout=10.0)
        assert b.sibling_in_flight() == 0 and b.records("expired") == 1
        assert a.routes.telling == 1  # the connection stays


async def test_a_request_with_more_keys_than_a_frame_holds_is_not_told(sockets: str) -> None:
    a, b = _Process(0, sockets), _Process(1, sockets)
    async with started(a, b):
        huge = Placement(a.workers[0].url, None, [2**62 + i for i in range(MAX_FRAME_BYTES // 8)], 1, 0, 4, False, None)
        a.routes.routed(1, huge)
        a.route(2)
        await eventually(lambda: b.routes.applied() == 1)
        assert a.records("too_large") == 1 and a.routes.telling == 1


async def test_a_sibling_that_does_not_read_has_its_connection_dropped(sockets: str) -> None:
    """Writes never wait: past the bound of what is buffered unread, the connection is dropped (and counted)."""
    a = _Process(0, sockets)
    path = os.path.join(sockets, "routes-1.sock")
    connected = asyncio.Event()
    readers: list[asyncio.StreamWriter] = []

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        readers.append(writer)
        connected.set()
        await asyncio.Event().wait()

    server = await asyncio.start_unix_server(never_read, path=path)
    await a.routes.start()
    try:
        await asyncio.wait_for(connected.wait(), 10.0)
        big = Placement(a.workers[0].url, None, list(range(100_000)), 1, 0, 4, False, None)
        for i in range(400):  # ~360 MB, against a bound of 16 MiB
            a.routes.routed(i, big)
            await asyncio.sleep(0)
            if a.metrics.sibling_connections_dropped.labels("not_reading")._value.get():
                break
        assert a.metrics.sibling_connections_dropped.labels("not_reading")._value.get() == 1
    finally:
        await a.routes.close()
        server.close()
        for writer in readers:
            writer.transport.abort()


async def test_frames_split_anywhere_are_read_whole(sockets: str) -> None:
    """A sibling's frames as the socket delivers them: a byte at a time, or several in one read."""
    b = _Process(1, sockets)
    await b.routes.start()
    try:
        placement = msgspec.msgpack.decode(msgspec.msgpack.encode(
            Placement(b.workers[2].url, None, [1, 2], 32, 0, 4, False, None)))
        first = _frame(msgspec.msgpack.encode([[1, 5, placement], [1, 6, placement]]))
        then = _frame(msgspec.msgpack.encode([[3, 5]])) + _frame(msgspec.msgpack.encode([[1, 7, placement]]))
        _, writer = await asyncio.open_unix_connection(os.path.join(sockets, "routes-1.sock"))
        for i in range(len(first)):
            writer.write(first[i:i + 1])
            await writer.drain()
            await asyncio.sleep(0.001)
        await eventually(lambda: b.routes.applied() == 2)
        writer.write(then)
        await eventually(lambda: b.records("applied") == 4)  # 5 ended, 7 placed
        assert b.workers[2].sibling_in_flight == 2 and b.routes.applied() == 2
        writer.close()
        await eventually(lambda: b.routes.applied() == 0)
        assert b.workers[2].sibling_in_flight == 0 and b.records("disconnected") == 2
    finally:
        await b.routes.close()


def test_a_frame_in_many_pieces_is_copied_once_it_is_whole() -> None:
    """`FrameBuffer` copied the whole partial frame at every piece: an 8 MiB frame (the most a sibling sends: what
    it has in flight, written when it connects again) read 64 KiB at a time took 77 ms of the event loop's CPU here
    (350-400 in a process of its own), quadratic in the frame: 37 times the same frame in three pieces. Now a piece
    that does not complete the frame is only appended, and the frame copied once when it is whole: 2.8 ms against
    1.7 (bound 15 times). The frames and their order are the same, a length split across pieces too."""
    size = MAX_FRAME_BYTES - 64
    body = bytes(range(256)) * (size // 256)
    data = struct.pack(">I", len(body)) + body + struct.pack(">I", 3) + b"abc" + struct.pack(">I", 2) + b"z"
    cut = len(data) - 7  # the 3-byte frame's length split in two pieces, then the rest

    def fed(pieces: list[bytes]) -> tuple[float, list[bytes], FrameBuffer]:
        frames = FrameBuffer(MAX_FRAME_BYTES)
        started = time.process_time()
        got = [bytes(b) for piece in pieces for b in frames.feed(piece)]
        return time.process_time() - started, got, frames

    many = [data[i:min(i + 65536, cut)] for i in range(0, cut, 65536)] + [data[cut:cut + 2], data[cut + 2:]]
    two = [data[:cut // 2], data[cut // 2:cut + 2], data[cut + 2:]]
    for pieces in (many, two):
        _, got, frames = fed(pieces)
        assert len(got) == 2 and got[0] == body and got[1] == b"abc", [len(g) for g in got]
        assert frames.partial  # "z" of a 2-byte frame
        assert [bytes(b) for b in frames.feed(b"!")] == [b"z!"] and not frames.partial
    cpu_many = min(fed(many)[0] for _ in range(3))
    cpu_two = min(fed(two)[0] for _ in range(3))
    assert cpu_many < 15 * cpu_two, f"{cpu_many * 1e3:.1f} ms in {len(many)} pieces, {cpu_two * 1e3:.1f} ms in 3"
