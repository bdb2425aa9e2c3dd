"""What each process of a gateway of several (`--processes N`) routes, told to its siblings, so that every process's
strategy places requests against the whole gateway's traffic in flight and prefix memory, not only its own.

Each process alone sent first reads onto the replicas a sibling had just given work, and copies of one tenant's
prefix to several (the live tenants with two processes: p99 154-161 ms against one process's 103-110, README). So a
process tells its siblings where each request went (the strategy's `Decision.placement`: worker, rank, block keys,
what it brings there), then its first token and its end; a sibling applies them through its strategy's
`sibling_routed` / `sibling_first_token` / `sibling_ended`, the same bookkeeping the strategy's own choices get, and
counts the request in the worker's `sibling_in_flight`. What a process learns from its answers (rates, loads, output
lengths) stays its own.

Every process listens on routes-<index>.sock in the gateway's sockets directory and connects to each sibling's: no
relay, each stream one way. On it: frames (router/frames.py) each holding a batch of records, one frame per sibling
per event-loop turn, written once for all siblings, never waited on. A connection made (again) first carries every
request of the sender's still in flight, so a gap while it was down is repaired. A frame the listener cannot read
(or a request routed twice on one connection) drops that connection only; a connection that closes has all its
records dropped at once, and a record whose end never came expires after `record_ttl_s`. A sibling that leaves more
than MAX_BUFFERED_BYTES unread has its connection dropped; the sender connects again after 50 ms, doubling the wait
while it cannot, up to 2 s. Once an episode (a sibling unreachable, a connection dropped) it says so in the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

import msgspec

from router.frames import FRAME_TIMEOUT_S, FrameBuffer, FrameError, decode, frame, send
from router.metrics import GatewayMetrics
from router.pool import Worker
from router.routing import Placement, Strategy

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 2.0
MAX_FRAME_BYTES = 8 << 20
# records are gathered this long (at most) and written together: a frame a loop turn was a frame a request or two at
# 5,000 requests/s, and each frame cost both sides a wake-up and a write or read (CPU per request +8-17% with two
# processes at c64, against +2-3% the records themselves cost); what a sibling learns 2 ms late it would mostly have
# learnt too late anyway (requests that arrive together in two processes are placed before either hears of the other)
FLUSH_S = 0.002
BATCH_BYTES = 1 << 20  # a batch's keys and records past this go in a frame of their own
MAX_BUFFERED_BYTES = 16 << 20  # written and not yet taken by the sibling: past this it is not reading
MAX_RECORDS = 1 << 17  # requests one connection may have in flight at once
RECORD_BYTES = 96  # a record's size on the wire besides its keys (about), and a key's
KEY_BYTES = 9

# kvgate_sibling_records_total's `outcome`
SENT, APPLIED = "sent", "applied"
DISCONNECTED, EXPIRED, UNKNOWN_WORKER, TOO_LARGE = "disconnected", "expired", "unknown_worker", "too_large"
# kvgate_sibling_connections_dropped_total's `reason`
GARBAGE, NOT_READING, CLOSED = "garbage", "not_reading", "closed"


# the wire: one stream of records a connection, the sender's request numbers its own (an id, reused only once the
# request ended)
RequestNumber = Annotated[int, msgspec.Meta(ge=0)]


class Routed(msgspec.Struct, tag=1, array_like=True, frozen=True, gc=False):
    request: RequestNumber
    placement: Placement


class FirstToken(msgspec.Struct, tag=2, array_like=True, frozen=True, gc=False):
    request: RequestNumber


class Ended(msgspec.Struct, tag=3, array_like=True, frozen=True, gc=False):
    request: RequestNumber


Record = Routed | FirstToken | Ended
_BATCH = msgspec.msgpack.Decoder(list[Record])


@dataclass(slots=True)
class _Applied:
    """A sibling's request in flight here: the strategy's key for it, where it went, when it came."""

    key: int
    placement: Placement
    worker: Worker
    at: float


class SiblingRoutes:
    """This process's routes told to its siblings, and theirs applied to its strategy."""

    def __init__(self, index: int, sockets: Callable[[int], str], count: int, strategy: Strategy,
                 worker: Callable[[str], Worker | None], metrics: GatewayMetrics, *, record_ttl_s: float) -> None:
        self.index = index
        self._path = sockets
        self._strategy = strategy
        self._worker = worker
        self._metrics = metrics
        self.record_ttl_s = record_ttl_s
        self._siblings = [i for i in range(count) if i != index]
        self._connected: dict[int, asyncio.StreamWriter] = {}  # sibling -> the connection this process tells it on
        self._in_flight: dict[int, Placement] = {}  # this process's requests, by id, as placed
        self._decoding: set[int] = set()  # of them, those past their first token
        self._batch: list[Record] = []
        self._batch_bytes = 0
        self._flushing = False
        self._keys = itertools.count(-1, -1)  # the strategy's keys for siblings' requests: never an `id`
        self._hearing: set[_Hearing] = set()  # the siblings' connections to this process
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        records = metrics.sibling_records
        self._sent, self._applied = records.labels(SENT), records.labels(APPLIED)

    async def start(self) -> None:
        self._server = await asyncio.get_running_loop().create_unix_server(lambda: _Hearing(self),
                                                                           path=self._path(self.index))
        self._tasks = [asyncio.ensure_future(self._tell(i)) for i in self._siblings]
        self._tasks.append(asyncio.ensure_future(self._expire()))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in self._tasks:
            task.cancel()
        for hearing in list(self._hearing):
            hearing.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def applied(self) -> int:
        """Siblings' requests in flight here (for tests)."""
        return sum(len(hearing.records) for hearing in self._hearing)

    @property
    def telling(self) -> int:
        """Siblings this process is connected to (for tests)."""
        return len(self._connected)

    # this process's requests, as the proxy routes them

    def routed(self, request: int, placement: Placement) -> None:
        self._in_flight[request] = placement
        self._add(Routed(request, placement), RECORD_BYTES + KEY_BYTES * len(placement.keys))

    def first_token(self, request: int) -> None:
        if request in self._in_flight:
            self._decoding.add(request)
            self._add(FirstToken(request), 8)

    def ended(self, request: int) -> None:
        if self._in_flight.pop(request, None) is not None:
            self._decoding.discard(request)
            self._add(Ended(request), 8)

    def _add(self, record: Record, size: int) -> None:
        if not self._connected:
            return  # no sibling to tell: the connection made next carries what is in flight then
        self._batch.append(record)
        self._batch_bytes += size
        if self._batch_bytes >= BATCH_BYTES:
            self._flush()
        elif not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        """The records of the last FLUSH_S, one frame written to every sibling connected."""
        self._flushing = False
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if batch:
            self._write(batch, list(self._connected.items()))

    def _write(self, batch: list[Record], to: list[tuple[int, asyncio.StreamWriter]]) -> None:
        data = frame(batch)
        if len(data) > MAX_FRAME_BYTES + 4:
            if len(batch) > 1:
                half = len(batch) // 2
                self._write(batch[:half], to)
                self._write(batch[half:], to)
            else:  # one request of more keys than a frame holds: its siblings do without it
                self._metrics.sibling_records.labels(TOO_LARGE).inc()
            return
        for sibling, writer in to:
            if send(writer, data, MAX_BUFFERED_BYTES):
                self._sent.inc(len(batch))
            elif self._connected.get(sibling) is writer:
                self._dropped(sibling, writer, NOT_READING)

    def _dropped(self, sibling: int, writer: asyncio.StreamWriter, reason: str) -> None:
        del self._connected[sibling]
        self._metrics.siblings_connected.labels("to").set(len(self._connected))
        self._metrics.sibling_connections_dropped.labels(reason).inc()
        writer.transport.abort()
        if reason == NOT_READING:
            log.warning("sibling routes: process %d left over %d bytes unread; dropped the connection to it, "
                        "connecting again", sibling, MAX_BUFFERED_BYTES)
        else:
            log.info("sibling routes: process %d closed the connection; connecting again", sibling)

    async def _tell(self, sibling: int) -> None:
        """Connected to `sibling` for as long as this runs, connecting again when it closes."""
        path = self._path(sibling)
        wait = RECONNECT_MIN_S
        unreachable = False  # said so in the log, and not connected since
        while True:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                if wait >= RECONNECT_MAX_S and not unreachable:
                    unreachable = True
                    log.warning("sibling routes: process %d cannot be reached (%s); it routes without this "
                                "process's requests until it can", sibling, path)
            else:
                if unreachable:
                    unreachable = False
                    log.info("sibling routes: process %d reached again", sibling)
                wait = RECONNECT_MIN_S
                self._flush()  # what is batched goes to the others first: the new one hears it below
                self._connected[sibling] = writer
                self._metrics.siblings_connected.labels("to").set(len(self._connected))
                self._write(self._in_flight_now(), [(sibling, writer)])
                with contextlib.suppress(ConnectionError):
                    await reader.read()  # it never writes: this ends when it closes (or the connection is dropped)
                if self._connected.get(sibling) is writer:
                    self._dropped(sibling, writer, CLOSED)
            await asyncio.sleep(wait)
            wait = min(2 * wait, RECONNECT_MAX_S)

    def _in_flight_now(self) -> list[Record]:
        records: list[Record] = []
        for request, placement in self._in_flight.items():
            records.append(Routed(request, placement))
            if request in self._decoding:
                records.append(FirstToken(request))
        return records

    # the siblings' requests, applied here

    def _apply(self, batch: list[Record], records: dict[int, _Applied]) -> None:
        strategy = self._strategy
        now = asyncio.get_running_loop().time()
        applied = 0
        for record in batch:
            if isinstance(record, Routed):
                if record.request in records:
                    raise FrameError(f"request {record.request} routed twice")
                if len(records) >= MAX_RECORDS:
                    raise FrameError(f"more than {MAX_RECORDS} requests in flight")
                placement = record.placement
                worker = self._worker(placement.worker)
                if worker is None:  # not (or no longer) in this process's pool
                    self._metrics.sibling_records.labels(UNKNOWN_WORKER).inc()
                    continue
                key = next(self._keys)
                records[record.request] = _Applied(key, placement, worker, now)
                worker.sibling_in_flight += 1
                strategy.sibling_routed(key, placement)
            elif isinstance(record, FirstToken):
                held = records.get(record.request)
                if held is not None:
                    strategy.sibling_first_token(held.key, held.placement)
            else:
                held = records.pop(record.request, None)
                if held is not None:
                    held.worker.sibling_in_flight -= 1
                    strategy.sibling_ended(held.key, held.placement)
            applied += 1
        self._applied.inc(applied)

    def _drop(self, records: dict[int, _Applied], requests: list[int], reason: str) -> None:
        """Siblings' requests whose ends will not come: ended here now."""
        for request in requests:
            held = records.pop(request)
            held.worker.sibling_in_flight -= 1
            self._strategy.sibling_ended(held.key, held.placement)
        if requests:
            self._metrics.sibling_records.labels(reason).inc(len(requests))

    async def _expire(self) -> None:
        """Now and then, the siblings' requests in flight here longer than `record_ttl_s` end (each connection's
        in the order they came)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(self.record_ttl_s / 4, 30.0))
            since = loop.time() - self.record_ttl_s
            for hearing in list(self._hearing):
                records = hearing.records
                old = []
                for request, held in records.items():
                    if held.at > since:
                        break
                    old.append(request)
                if old:
                    log.warning("sibling routes: %d requests of a sibling in flight here over %g s, their ends "
                                "never came: dropped", len(old), self.record_ttl_s)
                    self._drop(records, old, EXPIRED)


class _Hearing(asyncio.Protocol):
    """A sibling's connection to this process: its frames parsed as they come (`FrameBuffer`), its records applied,
    and its requests in flight here (dropped, all of them, when it closes)."""

    def __init__(self, routes: SiblingRoutes) -> None:
        self.routes = routes
        self.frames = FrameBuffer(MAX_FRAME_BYTES)
        self.records: dict[int, _Applied] = {}
        self.transport: asyncio.Transport | None = None
        self._partial: asyncio.TimerHandle | None = None  # a frame not whole: the connection is dropped at this

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a stream's (uvloop's is no asyncio.Transport)
        routes = self.routes
        routes._hearing.add(self)
        routes._metrics.siblings_connected.labels("from").set(len(routes._hearing))

    def data_received(self, data: bytes) -> None:
        try:
            bodies = self.frames.feed(data)
            for body in bodies:
                self.routes._apply(decode(_BATCH, body), self.records)
        except FrameError as exc:
            self._garbage(str(exc))
            return
        if bodies and self._partial is not None:  # a frame came whole: the next one has its own time
            self._partial.cancel()
            self._partial = None
        if self.frames.partial and self._partial is None:
            self._partial = asyncio.get_running_loop().call_later(
                FRAME_TIMEOUT_S, self._garbage, f"a frame not whole after {FRAME_TIMEOUT_S:g} s")

    def _garbage(self, what: str) -> None:
        self.routes._metrics.sibling_connections_dropped.labels(GARBAGE).inc()
        log.warning("sibling routes: dropping a connection that sent %s", what)
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()  # connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self._partial is not None:
            self._partial.cancel()
        routes = self.routes
        if self in routes._hearing:
            routes._hearing.discard(self)
            routes._metrics.siblings_connected.labels("from").set(len(routes._hearing))
            routes._drop(self.records, list(self.records), DISCONNECTED)
