"""Recording the gateway's own traffic as a trace (`record_trace`): one line per finished request, in arrival
order, in the format of router/trace_record.py, which `kvgate bench vsim` and `kvgate bench plan` replay.

No text and no token ids leave the process. Each hash id is the prompt's chained block key at the end of one
`block_tokens`-token block (the last, partial block: its key chained with the tokens after it), hashed with a
key (BLAKE2b keyed by the deployment's secret, so nobody can confirm a guessed text by hashing it) and then
renumbered from 0 in the order first seen in each file; the tenant's cache namespace likewise. Equal ids in a file
are equal prefixes; nothing else can be read from them.

The event loop only stamps a request's arrival (`begin`) and hands over what the gateway learned of it (`finish`):
finished requests are released in arrival order to a bounded queue, which a thread of its own turns into lines
and writes. Nothing there waits on the disk: a full queue drops the record, a failing or full disk drops the
records of that write (the file is cut back to its last whole line), both counted in
`kvgate_trace_records_dropped_total{reason}` and logged once per episode; requests never notice. Files rotate
when they reach `max_bytes`, `max_age_s` or `MAX_IDS` distinct ids: the full file is renamed `STEM.<UTC start>
.SUFFIX` (ids and timestamps start again in the next).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import queue
import threading
import time
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry, Counter

from router.block_keys import BlockKey
from router.errors import GatewayError
from router.proxy import CLIENT_CLOSED, Outcome
from router.routing import RouteRequest
from router.trace_record import TraceRecord

log = logging.getLogger(__name__)

MAX_IDS = 1 << 20  # distinct ids per file (their numbering is kept in memory while the file is written)
QUEUE_RECORDS = 16_384  # finished requests waiting for the writer at most
BATCH_RECORDS = 512  # records written in one go at most


@dataclass(slots=True)
class Finished:
    """What the gateway knows of one finished request, handed to the writer as it is (it is read, not copied)."""

    arrived: float  # time.perf_counter() at arrival
    model: str
    namespace: str | None  # the tenant's cache namespace (cache_salt or tenant header)
    prompt_tokens: int
    block_keys: Sequence[BlockKey]
    tail_tokens: Sequence[int] | None  # the prompt's tokens after its last full block (None in text mode)
    strategy: str
    worker: str | None = None
    predicted_cached_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    ttfb_s: float | None = None
    duration_s: float | None = None
    status: int | None = None


@dataclass
class _File:
    path: Path
    fd: int
    t0: float  # perf_counter of its first record's arrival
    opened: float  # monotonic, for its age
    size: int = 0
    ids: dict[bytes, int] = field(default_factory=dict)
    tenants: dict[bytes, int] = field(default_factory=dict)


class TraceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.written = Counter("kvgate_trace_records_written", "Trace records written (record_trace)",
                               registry=registry)
        self.dropped = Counter("kvgate_trace_records_dropped", "Trace records dropped, by reason (queue_full: the "
                               "writer fell behind; write_error: the disk refused them)", ["reason"],
                               registry=registry)
        self.files = Counter("kvgate_trace_files", "Trace files started (one, then one per rotation)",
                             registry=registry)


class TraceRecorder:
    """The trace of one gateway: `begin` when a request arrives, `finish` when it ended (both on the event loop,
    neither waits); a thread writes. `close` writes what is queued and stops the thread."""

    def __init__(self, path: str | Path, *, block_size: int, block_tokens: int, secret: bytes, max_bytes: int,
                 max_age_s: float, registry: CollectorRegistry, queue_records: int = QUEUE_RECORDS) -> None:
        if block_tokens < block_size or block_tokens % block_size:
            raise ValueError(f"record_trace_block_tokens ({block_tokens}) must be a multiple of block_size "
                             f"({block_size})")
        self.path = Path(path)
        self.block_size = block_size
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self.max_age_s = max_age_s
        self._secret = secret
        self.metrics = TraceMetrics(registry)
        self._queue: queue.Queue[Finished | None] = queue.Queue(queue_records)
        self._next_seq = 0  # the next arrival's number
        self._next_out = 0  # the next arrival to hand to the writer
        self._done: dict[int, Finished | None] = {}  # finished (or abandoned) arrivals not handed over yet
        self._file: _File | None = None
        self._failing: str | None = None  # the error of the current failure episode, None while writes work
        self._episode_drops = 0
        self._thread = threading.Thread(target=self._run, name="kvgate-trace", daemon=True)
        self._encoder = msgspec.json.Encoder()
        with self.path.open("ab"):  # a path that cannot be written is a configuration error, found at start
            pass

    def start(self) -> None:
        self._thread.start()

    # --- the event loop's side --------------------------------------------------------------------------------

    def begin(self) -> int:
        """A request arrived: its place in the trace."""
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def finish(self, seq: int, record: Finished | None) -> None:
        """The request `seq` ended (None: it ended before it was routed, nothing to record). Records leave in
        arrival order: this one waits for every earlier arrival to finish."""
        self._done[seq] = record
        while self._next_out in self._done:
            ready = self._done.pop(self._next_out)
            self._next_out += 1
            if ready is None:
                continue
            try:
                self._queue.put_nowait(ready)
            except queue.Full:
                self.metrics.dropped.labels("queue_full").inc()

    @contextmanager
    def request(self, arrived: float, strategy: str) -> Iterator[TraceEntry]:
        """A request's entry from its arrival (time.perf_counter()) to its end, however it ends: an error the
        gateway answers itself is recorded with its status, a client gone with 499."""
        entry = TraceEntry(self.begin(), arrived)
        try:
            yield entry
        except GatewayError as exc:
            entry.outcome.status = entry.outcome.status or exc.status
            raise
        except asyncio.CancelledError:
            entry.outcome.status = entry.outcome.status or int(CLIENT_CLOSED)
            raise
        finally:
            self.finish(entry.seq, entry.finished(strategy, self.block_size))

    def close(self, timeout_s: float = 5.0) -> None:
        if self._thread.is_alive():
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout_s)
            self._thread.join(timeout_s)

    # --- the writer thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    return
                batch = [first]
                stop = False
                while len(batch) < BATCH_RECORDS:
                    try:
                        more = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if more is None:
                        stop = True
                        break
                    batch.append(more)
                self._write(batch)
                if stop:
                    return
        finally:
            if self._file is not None:
                os.close(self._file.fd)
                self._file = None

    def _write(self, batch: list[Finished]) -> None:
        lines: list[bytes] = []
        try:
            for record in batch:
                current = self._current(record)
                lines.append(self._encoder.encode(self._line(record, current)) + b"\n")
            data = b"".join(lines)
            assert self._file is not None
            written = os.write(self._file.fd, data)
            if written != len(data):
                raise OSError(errno.EFBIG, "short write (file size limit or disk full)")
        except OSError as exc:
            if self._file is not None:
                try:
                    os.ftruncate(self._file.fd, self._file.size)  # no half line stays behind
                except OSError:
                    self._close_file()  # the file is in an unknown state: the next write starts a new one
            self._dropped(len(batch), exc)
            return
        assert self._file is not None
        self._file.size += len(data)
        self.metrics.written.inc(len(batch))
        if self._failing is not None:
            log.warning("record_trace: writing %s again; %d records were dropped", self._file.path,
                        self._episode_drops)
            self._failing, self._episode_drops = None, 0

    def _dropped(self, n: int, exc: OSError) -> None:
        self.metrics.dropped.labels("write_error").inc(n)
        self._episode_drops += n
        if self._failing is None:
            self._failing = str(exc)
            log.error("record_trace: cannot write %s (%s): dropping trace records until it works again "
                      "(requests are not affected)", self.path, exc)

    def _current(self, record: Finished) -> _File:
        """The file this record goes into: rotated first if the current one is full or old."""
        current = self._file
        if current is not None and (current.size >= self.max_bytes or len(current.ids) >= MAX_IDS
                                    or time.monotonic() - current.opened >= self.max_age_s):
            self._rotate(current)
            current = None
        if current is None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            size = os.fstat(fd).st_size
            if size:  # a file left by an earlier run: keep it, start a new one
                os.close(fd)
                self._rotate(None)
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            current = self._file = _File(self.path, fd, record.arrived, time.monotonic())
            self.metrics.files.inc()
        return current

    def _close_file(self) -> None:
        if self._file is not None:
            fd, self._file = self._file.fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def _rotate(self, current: _File | None) -> None:
        self._close_file()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(os.stat(self.path).st_mtime if current is None
                                                            else time.time()))
        for n in range(1000):
            target = self.path.with_name(f"{self.path.stem}.{stamp}{'' if n == 0 else f'-{n}'}{self.path.suffix}")
            if not target.exists():
                os.rename(self.path, target)
                return
        raise OSError(errno.EEXIST, f"no free name to rotate {self.path} to")

    def _mac(self, data: bytes) -> bytes:
        return hashlib.blake2b(data, digest_size=16, key=self._secret).digest()

    def _line(self, r: Finished, current: _File) -> TraceRecord:
        ids = current.ids
        per = self.block_tokens // self.block_size
        keys = r.block_keys
        hash_ids = []
        for end in range(per - 1, len(keys), per):
            mac = self._mac(keys[end].to_bytes(8, "little"))
            hash_ids.append(ids.setdefault(mac, len(ids)))
        covered = len(hash_ids) * self.block_tokens
        if r.prompt_tokens > covered:  # the last, partial block: chained to the prompt's last full block
            last = keys[-1].to_bytes(8, "little") if keys else f"{r.model}\x00{r.namespace or ''}".encode()
            tail = array("I", r.tail_tokens).tobytes() if r.tail_tokens is not None else b"text"
            mac = self._mac(b"tail" + last + tail + r.prompt_tokens.to_bytes(8, "little"))
            hash_ids.append(ids.setdefault(mac, len(ids)))
        tenant = None
        if r.namespace:
            tenants = current.tenants
            tenant = tenants.setdefault(self._mac(b"tenant" + r.namespace.encode()), len(tenants))
        return TraceRecord(
            timestamp=round((r.arrived - current.t0) * 1000, 3), input_length=max(1, r.prompt_tokens),
            output_length=r.output_tokens, hash_ids=hash_ids, block_tokens=self.block_tokens, model=r.model,
            tenant=tenant, strategy=r.strategy, worker=r.worker, predicted_cached_tokens=r.predicted_cached_tokens,
            cached_tokens=r.cached_tokens, status=r.status,
            ttfb_ms=None if r.ttfb_s is None else round(r.ttfb_s * 1000, 3),
            duration_ms=None if r.duration_s is None else round(r.duration_s * 1000, 3))


class TraceEntry:
    """One request while it runs (`TraceRecorder.request`): its place in the trace, what the proxy fills in."""

    __slots__ = ("arrived", "namespace", "outcome", "route", "seq")

    def __init__(self, seq: int, arrived: float) -> None:
        self.seq = seq
        self.arrived = arrived
        self.outcome = Outcome()
        self.route: RouteRequest | None = None
        self.namespace: str | None = None

    def routed(self, route: RouteRequest, namespace: str | None) -> None:
        self.route, self.namespace = route, namespace

    def finished(self, strategy: str, block_size: int) -> Finished | None:
        route, outcome = self.route, self.outcome
        if route is None:
            return None  # refused before it was routed: nothing of it is the fleet's traffic
        decision = outcome.decision
        tokens = route.token_ids
        return Finished(
            arrived=self.arrived, model=route.model, namespace=self.namespace, prompt_tokens=route.prompt_tokens,
            block_keys=route.block_keys, strategy=strategy,
            tail_tokens=None if tokens is None else tokens[len(route.block_keys) * block_size:],
            worker=None if decision is None else decision.worker.url,
            predicted_cached_tokens=None if decision is None else decision.predicted_cached_tokens,
            cached_tokens=None if outcome.usage is None else outcome.usage.cached, output_tokens=outcome.output_tokens,
            ttfb_s=outcome.ttfb_s, duration_s=outcome.duration_s, status=outcome.status)
