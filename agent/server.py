"""The tier agent process: the local block API on a Unix socket, KV events, Prometheus metrics, upkeep tasks.

Lookups are answered on the event loop from local state (sub-millisecond, no I/O), and so are small stores that
only copy into DRAM (what DRAM pushes out moves down in the background) and small loads whose blocks are all in
DRAM: handing such a copy to a thread and back cost more CPU than the copy, and needed one more thread to get the
CPU before the answer could go out. Other stores and loads run on a thread pool because NVMe and shared-tier I/O
blocks; block bytes move through the client's shared memory, which
this process maps once per connection: the descriptor of a memfd sealed against shrinking, passed with the
connection's first frame (so no file permission stands between a client and the agent, and no client can make
the mapping fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import logging
import mmap
import operator
import os
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agent.config import AgentConfig
from agent.metrics import AgentMetrics
from agent.presence import PresenceMap, presence_path
from agent.protocol import (
    FRAME,
    MAX_BATCH_BLOCKS,
    MAX_FRAME,
    MAX_HELLO,
    MAX_LOOKUP_HASHES,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    HelloReply,
    Load,
    LoadReply,
    Lookup,
    LookupReply,
    Reply,
    Stats,
    StatsReply,
    Store,
    StoreReply,
    TierInfo,
    frame,
    frame_in_pieces,
    request_decoder,
)
from agent.store import TierStore
from agent.tiers.buffers import PAGE
from agent.tiers.dram import DramTier
from agent.tiers.shared import RedisSharedTier
from kvcore.aio import started_executor
from kvcore.http_errors import error_response
from kvcore.http_server import JsonErrorSite, MalformedRequests
from kvcore.kv_events import KvEventPublisher
from kvcore.log_throttle import LogThrottle, held_back_note

log = logging.getLogger(__name__)


# a Store of at most this many bytes is copied into DRAM on the event loop (about 0.1-0.5 ms: what the loop may be
# held for) rather than handed to the request pool and back; so is a Load of this many bytes all held in DRAM
INLINE_STORE_BYTES = 2 * 2**20
# ... in pieces of this many bytes, with the loop's other work (a lookup: what a scheduler step waits for) let in
# between: a lookup that arrived during a 36-block save waited for the whole copy (page faults included), past
# the connector's 1 ms budget, and its request lost a step
INLINE_STORE_PIECE_BYTES = 128 * 2**10
# ... and of at most this many blocks (about 1 ms of the loop's time): a chain of 200,000 empty blocks was one piece
# (0 bytes), and held the loop, every other client's lookups with it, for 0.74 s (2^20 of them: about 4 s)
INLINE_STORE_PIECE_BLOCKS = 256
INLINE_LOAD_BYTES = MAX_FRAME // 2  # an inline load's blocks, at most: its answer must fit one frame
FIRST_FRAME_TIMEOUT_S = 10.0  # a connection that has not sent its Hello by then is dropped
# descriptors passed with the first frame, at most, over all the reads of it: a Hello passes one (one that passes
# 2-4 in its message is told so). Each read took up to this many, and a client that sent its Hello a byte at a time
# with 4 descriptors each made the agent hold 4,000 for 1,000 bytes (16,000 for a whole one), whatever
# --max-connecting-clients bounds
HELLO_FDS = 4
# inline answers (LoadReply with the bytes) written but not yet taken by their clients, over all connections, at
# most: a load past it is an error reply (retry). 12 clients that sent inline loads of 32 MiB and never read made
# the agent hold 884 MiB; each connection holds at most one unsent answer (the next request is read once the last
# answer is sent), and one that takes none of it for `client_write_timeout_s` is dropped
MAX_UNSENT_BYTES = INLINE_LOAD_BYTES
# an inline answer this small is let past MAX_UNSENT_BYTES (not worth summing every connection's buffer for): a
# transport keeps as much after a drain anyway (asyncio's write high-water mark). Up to 2 MiB was let past it: 100
# clients asking for 2 MiB each and never reading made the agent hold 180 MiB, more clients more
UNCOUNTED_ANSWER_BYTES = 64 * 2**10
ACCEPT_RETRY_S = 0.05  # after an accept failed (no file descriptor left), the next try
# a frame bigger than this (an inline Store's blocks) is read a piece at a time into memory of its own, its blocks
# left there (protocol.ReceivedStore): read whole, StreamReader.readexactly joined it into one bytes at the end,
# and the decode copied every block out of it, both on the event loop: 130 ms for 128 MiB, every other client's
# lookups waiting meanwhile (150-400 ms)
BIG_FRAME_BYTES = 2**20  # (the stream reader's limit: it buffers about twice this before it stops reading)
# a big frame (over BIG_FRAME_BYTES) must arrive at least this fast: a sweep of _drop_stalled_readers that finds one
# fewer bytes along than this rate over its interval counts as stalled, as one that finds it no further along. A
# frame holds its whole size of `--frame-budget` from its length on, so a client that sent a byte a second kept 256
# MiB of it (and whatever it had sent) for good, never "stalled"; at this rate the largest frame is whole in 16 s.
# A kvgate client writes a frame with one sendall over a Unix socket (GB/s; the connector's frames are under 1 MiB,
# never big: its blocks travel in shared memory)
MIN_FRAME_BYTES_PER_S = 16 * 2**20
# a Lookup's walk over its hashes goes this many at a time, other connections' requests let in between: the walk
# over 2^17 blocks all held (the most a Lookup may name) took 15.5 ms on the loop, this many about 1 ms
LOOKUP_PIECE_HASHES = 8192
# a Load all of whose blocks DRAM holds is copied on the event loop (INLINE_STORE_BYTES) this many blocks at a
# time, other connections' requests let in between: 2^15 blocks of 16 bytes (the most a Load may name, 512 KiB)
# were copied in one go, about 110 ms on the loop
INLINE_LOAD_PIECE_BLOCKS = INLINE_STORE_PIECE_BLOCKS
# how msgspec refuses a Lookup of more than MAX_LOOKUP_HASHES, a Store or Load of more than MAX_BATCH_BLOCKS (before
# decoding them): told in words of its own
_LOOKUP_TOO_LONG = f"of length <= {MAX_LOOKUP_HASHES} - at `$.hashes`"
_BATCH_TOO_LONG = f"of length <= {MAX_BATCH_BLOCKS} - at `$."


def _op_of(body: bytes | mmap.mmap) -> str:
    """The `op` of a frame msgspec refused, read off its first key if that is `op` (as every kvgate client and
    msgspec itself write it), without decoding the rest; "invalid" otherwise."""
    head = bytes(body[:16])
    start = 1 if head[:1] and 0x80 <= head[0] <= 0x8F else 3 if head[:1] == b"\xde" else 5
    if head[start: start + 3] != b"\xa2op" or len(head) <= start + 3 or not 0xA0 <= head[start + 3] <= 0xBF:
        return "invalid"
    value = head[start + 4: start + 4 + (head[start + 3] & 0x1F)]
    return value.decode() if value in (b"store", b"load", b"lookup") else "invalid"


def request_bytes(request: Store) -> int:
    return sum(request.lengths) + sum(len(d) for d in request.data)


class _Stalled(Exception):
    """A client took none of its answer's bytes for the write timeout."""

_SEALED = fcntl.F_SEAL_SHRINK  # what a client's shared memory must be sealed with before it is mapped


async def _readable(sock: socket.socket) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(sock.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(sock.fileno())


async def _recv(sock: socket.socket, size: int, fds: list[int], deadline: float) -> bytes:
    """Up to `size` bytes of a non-blocking socket, and the descriptors that came with them; TimeoutError if
    nothing came by `deadline` (the loop's clock). What is already there is read even past the deadline: this
    process may not run at all for seconds on a busy machine (docs/agent.md), and a client whose Hello arrived
    during such a stall must not be dropped for it when the deadline and the data are seen together."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            data, more, _flags, _addr = socket.recv_fds(sock, size, HELLO_FDS)
        except BlockingIOError:
            left = deadline - loop.time()
            if left <= 0:
                raise TimeoutError("no first frame in time") from None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_readable(sock), left)
            continue
        fds += more
        if len(fds) > HELLO_FDS:
            raise ValueError(f"{len(fds)} descriptors passed with the first frame (a Hello passes one)")
        if not data:
            raise ConnectionError("closed before the first frame was whole")
        return data


async def _first_frame(sock: socket.socket, fds: list[int], timeout_s: float = FIRST_FRAME_TIMEOUT_S) -> bytes:
    """The connection's first frame (Hello), the descriptors passed with it added to `fds` (a stream transport
    would drop them): read on the loop, no thread held by a client that connects and says nothing, which is
    dropped after `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    head = b""
    while len(head) < FRAME.size:
        head += await _recv(sock, FRAME.size - len(head), fds, deadline)
    (size,) = FRAME.unpack(head)
    if size > MAX_HELLO:
        raise ValueError(f"first frame of {size} bytes is too large")
    body = b""
    while len(body) < size:
        body += await _recv(sock, size - len(body), fds, deadline)
    return body


async def _frame_body(reader: asyncio.StreamReader, size: int, conn: Connection) -> bytes | mmap.mmap:
    """A frame's `size` bytes. One bigger than BIG_FRAME_BYTES goes into private anonymous memory mapped for it (its
    pages zeroed as they are first written, not all up front as a bytearray's are), a piece of what the reader
    buffered at a time (each one progress of `conn`'s, its bytes in `conn.received`): no turn of the loop copies
    more than the reader holds. Give it back with `_unmap`."""
    if size <= BIG_FRAME_BYTES:
        return await reader.readexactly(size)
    body = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)  # (shared anonymous memory took 3 times as long to unmap)
    done = 0
    while done < size:
        piece = await reader.read(min(size - done, BIG_FRAME_BYTES))
        if not piece:
            body.close()
            raise asyncio.IncompleteReadError(b"", size)
        body[done: done + len(piece)] = piece
        done += len(piece)
        conn.progress += 1
        conn.received = done
    return body


@web.middleware
async def _json_errors(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """An error of the metrics port (a path it does not serve, a method it does not take) answered with its status
    in the JSON shape of every error kvgate answers (the gateway's), not aiohttp's line of plain text. (A request
    aiohttp cannot parse never gets here: kvcore.http_server answers it.)"""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, f"{request.method} {request.path[:200]}: {exc.reason.lower()} (this port "
                              f"serves GET /metrics and GET /health)", code=exc.reason.lower().replace(" ", "_"),
                              headers=allow)


def _unmap(body: mmap.mmap) -> None:
    """Unmap a big frame's memory now (in a thread: 128 MiB took 8 ms, the GIL let go meanwhile), unless views
    into it are still out (a request kept past its answer): then it goes with the last of them."""
    with contextlib.suppress(BufferError):
        body.close()


def _readable_by_users_of(socket_mode: int) -> int:
    """The file mode that lets read a file exactly those who may use a socket of `socket_mode` (connecting needs
    write permission), and lets the agent write it."""
    return 0o600 | (0o040 if socket_mode & 0o020 else 0) | (0o004 if socket_mode & 0o002 else 0)


def _remove_socket(path: Path, make_parent: bool = False) -> None:
    if make_parent:
        path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)


class Connection:
    """One client: its shared-memory mapping, if it passed one, and the one layout and block size it declared in
    Hello, which its stores and loads must keep to."""

    def __init__(self) -> None:
        self.greeted = False  # its first frame was a Hello (else it is told so, and closed)
        self.shm: mmap.mmap | None = None
        self.view: memoryview | None = None
        self.layout = 0
        self.block_bytes = 0
        # a frame being read (TierAgent._drop_stalled_readers): how far it got (a count bumped at its length and at
        # each piece of a big one; the bytes of a big one read so far), what the last sweep saw of it, and how many
        # sweeps in a row saw it no further along (or a big one too little further: MIN_FRAME_BYTES_PER_S)
        self.reading = False
        self.progress = 0
        self.received = 0
        self.seen_progress = -1
        self.seen_received = 0
        self.stalled_sweeps = 0

    def declare(self, layout: int, block_bytes: int) -> None:
        size = len(self.view) if self.view is not None else 0
        if block_bytes < 0 or (size and block_bytes > size):
            raise ValueError(f"a block of {block_bytes} bytes does not fit {size} bytes of shared memory")
        self.layout, self.block_bytes = layout, block_bytes

    def check(self, layout: int, block_bytes: int | None = None) -> None:
        """A store or load outside what the client declared in Hello is refused: its bytes would be misread (a
        block stored in part is kept as it is, and every load of it after fails: the same block stored whole
        later finds it held)."""
        if self.layout and layout != self.layout:
            raise ValueError(f"layout {layout:#x} on a connection declared for {self.layout:#x}")
        if self.block_bytes and block_bytes is not None and block_bytes != self.block_bytes:
            raise ValueError(f"blocks of {block_bytes} bytes on a connection declared for {self.block_bytes}")

    def attach(self, fd: int, size: int) -> None:
        """Map a client's shared memory: a regular memfd of `size` bytes, sealed so it cannot shrink (a region
        truncated under the mapping turns the agent's next copy into a SIGBUS)."""
        st = os.fstat(fd)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # not a memfd
        if not stat.S_ISREG(st.st_mode) or not seals & _SEALED:
            raise ValueError("shared memory must be a memfd sealed against shrinking (F_SEAL_SHRINK)")
        if size <= 0 or st.st_size != size:
            raise ValueError(f"shared memory of {st.st_size} bytes where Hello says {size}")
        self.shm = mmap.mmap(fd, size)
        self.view = memoryview(self.shm)

    def region(self, offset: int, length: int) -> memoryview:
        if self.view is None:
            raise ValueError("no shared memory attached: pass a sealed memfd with Hello, or send bytes inline")
        if offset < 0 or length < 0 or offset + length > len(self.view):
            raise ValueError(f"region {offset}+{length} outside the {len(self.view)}-byte shared memory")
        return self.view[offset: offset + length]

    def close(self) -> None:
        if self.view is not None:
            self.view.release()
            self.view = None
        if self.shm is not None:
            with contextlib.suppress(BufferError):
                self.shm.close()
            self.shm = None


class TierAgent:
    def __init__(self, config: AgentConfig, store: TierStore | None = None) -> None:
        self.config = config
        self.store = store or TierStore.from_config(config)
        self.metrics = AgentMetrics(self.store)
        self.publisher: KvEventPublisher | None = None
        # Every thread is started here, never on the event loop (kvcore.aio.started_executor: starting one there
        # held the whole agent, every connection, until the OS ran the new thread -- up to 33 s on a starved CPU)
        self._pool = started_executor(max(2, config.io_threads), "kvgate-agent-req")
        # demotion, eviction, index refresh and sweeps: never in the request pool, where a long demotion over a
        # slow backend would leave Store and Load requests waiting
        self._upkeep = started_executor(1, "kvgate-agent-upkeep")
        self._scrapes = started_executor(1, "kvgate-agent-metrics")  # /metrics bodies, off the loop
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._http: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._readers: dict[Connection, asyncio.StreamWriter] = {}  # the same connections, for _drop_stalled_readers
        self._read_stalls = LogThrottle()  # clients dropped in the middle of a frame
        # bytes of big frames (over BIG_FRAME_BYTES) being read or answered, over all connections: at most
        # config.frame_budget, a frame past it refused at its length (each is counted whole from its length on)
        self._frame_bytes = 0
        self._over_budget = LogThrottle()  # frames refused for it
        self._unsent_reserved = 0  # bytes of inline answers being made (not yet in a connection's write buffer)
        self._stalls = LogThrottle()  # clients dropped for not taking their answers
        self.metrics.unsent_bytes.set_function(self._unsent)
        self.metrics.frame_bytes.set_function(lambda: self._frame_bytes)
        self._drops = LogThrottle()  # clients dropped before their Hello
        # connections past their Hello being served: at most config.max_clients, for each holds its stream's
        # buffer (about 2.3 MiB of requests not read yet, while it waits for a client to take an answer), which
        # frame_budget does not count
        self._served = 0
        self._over_clients = LogThrottle()  # clients refused for it
        # connections accepted whose Hello is not read yet, oldest first: at most config.max_connecting_clients (each
        # holds a file descriptor, and what it sent of its Hello, for up to FIRST_FRAME_TIMEOUT_S)
        self._connecting: dict[asyncio.Task[None], socket.socket] = {}
        self._over_connecting = LogThrottle()  # connections dropped for it
        self._presence: PresenceMap | None = None
        # the DRAM tier's pre-faulting (config.dram_prefault), started by the first Hello that declares a block size
        self._prefault = started_executor(1, "kvgate-agent-prefault") if self._prefaultable() else None
        self._prefault_started = False
        self._stopping = threading.Event()
        self.started_at = time.time()

    # -- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.config.events_endpoint:
            self.publisher = KvEventPublisher(self.config.events_endpoint, self.config.replay_endpoint or None,
                                              topic=self.config.events_topic)
            await self.publisher.start()
        path = Path(self.config.socket_path)
        _remove_socket(path, make_parent=True)
        self._publish_presence(path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(path))
        os.chmod(path, int(self.config.socket_mode, 8))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self._accepting = loop.create_task(self._accept(listener))
        if self.config.metrics_port:
            app = web.Application(middlewares=[_json_errors])
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/health", self._health)
            http_log = logging.getLogger(f"{__name__}.metrics_port")  # a request it cannot parse: counted, no traceback
            http_log.addFilter(MalformedRequests(lambda _: self.metrics.request_errors.labels("malformed_http").inc()))
            self._http = web.AppRunner(app, access_log=None, logger=http_log)
            await self._http.setup()
            await JsonErrorSite(self._http, self.config.metrics_host, self.config.metrics_port).start()
        self._tasks = [
            loop.create_task(self._every(self.config.events_interval_s, self._flush_events)),
            loop.create_task(self._every(0.2, self._in_thread(self.store.maintain))),
            loop.create_task(self._every(self.config.client_read_timeout_s / 2, self._drop_stalled_readers)),
        ]
        if isinstance(self.store.shared, RedisSharedTier):
            self.store.shared.listen()  # other replicas' writes as they happen (and one scan per subscription)
        elif self.store.shared is not None:
            # learn what other replicas already put in the shared tier right away, then periodically
            self._tasks.append(loop.create_task(self._every(self.config.shared_index_refresh_s,
                                                            self._in_thread(self.store.refresh_shared_index),
                                                            first_delay=0.0)))
            self._tasks.append(loop.create_task(self._every(self.config.shared_sweep_interval_s,
                                                            self._in_thread(self.store.sweep_shared))))
        log.info("tier agent on %s: %s", path, ", ".join(
            f"{t.name} {t.usage().capacity_bytes or 'unbounded'}" for t in self.store.tiers))

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._accepting
        for task in self._tasks:
            task.cancel()
        # end client connections by closing them (cancelling a stream handler task trips asyncio on 3.11)
        for writer in self._connections.values():
            writer.close()
        for task in self._clients:
            if task not in self._connections:  # still waiting for its first frame
                task.cancel()
        for task in [*self._tasks, *self._clients]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), 5)
        self._tasks.clear()
        if self._listener is not None:
            self._listener.close()
            _remove_socket(Path(self.config.socket_path))
        if self._http is not None:
            await self._http.cleanup()
        self._flush_events_now()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._upkeep.shutdown(wait=True, cancel_futures=True)
        self._scrapes.shutdown(wait=True, cancel_futures=True)
        self._stopping.set()
        if self._prefault is not None:
            self._prefault.shutdown(wait=True, cancel_futures=True)
        await asyncio.to_thread(self.store.drain, 5.0)
        self.store.close(wait=False)
        if self._presence is not None:
            self._presence.close()
        if self.publisher is not None:
            await self.publisher.close()

    def _publish_presence(self, socket_path: Path) -> None:
        """The bitmap of the blocks this agent may hold (agent/presence.py), from what its tiers hold already;
        none with a shared tier (other replicas put blocks there that only this agent can be asked about), and
        then an older agent's is removed."""
        target = presence_path(socket_path)
        if self.store.shared is not None:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            return
        try:
            self._presence = PresenceMap(target, [key for tier in self.store.tiers for key in tier.block_keys()],
                                         mode=_readable_by_users_of(int(self.config.socket_mode, 8)))
        except OSError as exc:  # (a full disk, a file size limit): every lookup asks this agent, as without one
            log.warning("no bitmap of the blocks held published at %s (%s): schedulers ask every lookup", target,
                        exc)
            with contextlib.suppress(OSError):
                target.unlink()
            return
        self.store.presence = self._presence

    async def serve_forever(self) -> None:
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.close()

    # -- background ------------------------------------------------------------------------------------------

    def _in_thread(self, fn: Callable[[], object]) -> Callable[[], Any]:
        @functools.wraps(fn)  # (its name, for the log)
        async def run() -> None:
            await asyncio.get_running_loop().run_in_executor(self._upkeep, fn)
        return run

    async def _every(self, interval: float, fn: Callable[[], Any], first_delay: float | None = None) -> None:
        await asyncio.sleep(interval if first_delay is None else first_delay)
        while True:
            try:
                result = fn()
                if asyncio.iscoroutine(result):
                    await asyncio.wait_for(result, max(30.0, interval * 10))
            except asyncio.CancelledError:
                raise
            except TimeoutError:  # (this process not run for long on a busy machine, or slow disks)
                log.warning("agent upkeep %s took more than %.0f s; it goes on in its thread", fn.__qualname__,
                            max(30.0, interval * 10))
            except Exception:
                log.exception("agent upkeep task failed")
            await asyncio.sleep(interval)

    def _flush_events(self) -> None:
        self._flush_events_now()

    def _flush_events_now(self) -> None:
        events = self.store.drain_events()
        if events and self.publisher is not None:
            self.publisher.publish(events)

    # -- HTTP ------------------------------------------------------------------------------------------------

    async def _metrics(self, _request: web.Request) -> web.Response:
        body = await asyncio.get_running_loop().run_in_executor(self._scrapes, generate_latest, self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _request: web.Request) -> web.Response:
        """Alive, and whether bytes actually move: clients that mapped shared memory, bytes stored and loaded,
        clients refused at Hello (a lookup answers without any of these working)."""
        sample = self.metrics.registry.get_sample_value
        return web.json_response({
            "status": "ok", "uptime_s": round(time.time() - self.started_at, 1),
            "shm_clients": int(sample("kvgate_agent_shm_clients") or 0),
            "bytes_stored": int(sample("kvgate_agent_bytes_stored_total") or 0),
            "bytes_loaded": int(sample("kvgate_agent_bytes_loaded_total") or 0),
            "hello_errors": int(sample("kvgate_agent_request_errors_total", {"op": "hello"}) or 0),
        })

    # -- the block API ---------------------------------------------------------------------------------------

    async def _accept(self, listener: socket.socket) -> None:
        """Every connection, for good: an accept that fails (out of file descriptors: as many clients connected as
        the process may have files open) ended this task, silently, and the agent never accepted again; now the
        failure is counted and logged, and accepting goes on after a pause."""
        loop = asyncio.get_running_loop()
        failures = LogThrottle()
        while True:
            try:
                sock, _addr = await loop.sock_accept(listener)
            except OSError as exc:
                self.metrics.request_errors.labels("accept").inc()
                if (held_back := failures.due()) is not None:
                    log.warning("cannot accept a client (kvgate_agent_request_errors_total{op=accept} counts every "
                                "one): %s%s", exc, held_back_note(held_back))
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if len(self._connecting) >= self.config.max_connecting_clients:
                await self._drop_oldest_connecting()
            task = loop.create_task(self._serve_client(sock))
            self._connecting[task] = sock  # (counted at once: the accepts waiting are taken before any Hello is read)
            self._clients.add(task)  # a strong reference while it runs
            task.add_done_callback(self._clients.discard)

    async def _serve_client(self, sock: socket.socket) -> None:
        """The first frame is read with the descriptors it carries (stream transports drop them), then the
        connection becomes a stream."""
        conn = Connection()
        fds: list[int] = []
        try:
            sock.setblocking(False)
            body = await _first_frame(sock, fds)
        except (TimeoutError, OSError, ValueError, asyncio.CancelledError) as exc:
            if isinstance(exc, TimeoutError | ValueError):  # (a client that connected and closed is no news)
                self.metrics.request_errors.labels("hello").inc()
                if (held_back := self._drops.due()) is not None:
                    log.warning("client dropped before its Hello: %s (kvgate_agent_request_errors_total{op=hello} "
                                "counts every one)%s", exc, held_back_note(held_back))
            else:
                log.debug("client dropped before its first frame: %r", exc)
            for fd in fds:
                os.close(fd)
            sock.close()
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        finally:
            self._connecting.pop(cast(asyncio.Task[None], asyncio.current_task()), None)
        if self._served >= self.config.max_clients:
            self._refuse_client(sock, fds)
            return
        self._served += 1  # (counted at once: the Hellos of other connections are read while this one's is answered)
        try:
            await self._serve_greeted(sock, conn, body, fds)
        finally:
            self._served -= 1

    async def _serve_greeted(self, sock: socket.socket, conn: Connection, body: bytes, fds: list[int]) -> None:
        try:
            first = await self._answer(conn, body, fds)
        finally:
            for fd in fds:
                os.close(fd)  # mapped (or refused): the mapping keeps the memory
        try:
            reader, writer = await asyncio.open_unix_connection(sock=sock, limit=2**20)
        except BaseException:
            self._detach(conn)
            sock.close()
            raise
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        self._readers[conn] = writer
        try:
            await self._send(writer, first)
            if not conn.greeted:
                return
            while True:
                try:
                    header = await reader.readexactly(FRAME.size)
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                (size,) = FRAME.unpack(header)
                if size > MAX_FRAME:
                    writer.write(frame(ErrorReply(message=f"frame of {size} bytes is too large")))
                    return
                held = size if size > BIG_FRAME_BYTES else 0  # (a small one is in the stream's buffer, bounded)
                if held and self._frame_bytes + held > self.config.frame_budget:
                    self._refuse_over_budget(writer, size)
                    return
                self._frame_bytes += held
                try:
                    conn.reading = True  # (the wait for a frame's length has no bound: a connector idles between steps)
                    conn.progress += 1
                    conn.received = conn.seen_received = 0
                    request = await _frame_body(reader, size, conn)
                    conn.reading = False
                    try:
                        reply = await self._answer(conn, request)
                    finally:
                        if isinstance(request, mmap.mmap):
                            with contextlib.suppress(RuntimeError):  # (the pool is shut down: unmapped here instead)
                                self._pool.submit(_unmap, request)
                        del request  # (not kept until the next frame: an inline store's blocks are views into it)
                finally:
                    self._frame_bytes -= held
                # the next request is read once this answer is sent: a client that sends and never reads
                # holds one answer here, and only for the write timeout. (Sent in the loop turn that made it: an
                # inline answer counts against MAX_UNSENT_BYTES as reserved until then, as the transport's buffer
                # after; a yield between the two let other loads past the bound, 159 MiB of answers against 128.)
                await self._send(writer, reply)
                # other connections' requests are let in between two frames of this one: frames a client sent
                # together (a step's Stores, a load in several Loads) are otherwise all read from the stream's
                # buffer, decoded and answered in one turn of the loop
                await asyncio.sleep(0)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except _Stalled:
            self.metrics.request_errors.labels("write_timeout").inc()
            if (held_back := self._stalls.due()) is not None:
                log.warning("client dropped: it took none of its answer for %g s (kvgate_agent_request_errors_total"
                            "{op=write_timeout} counts every one)%s", self.config.client_write_timeout_s,
                            held_back_note(held_back))
            writer.transport.abort()  # (close() would wait for the client to read what is buffered)
        finally:
            self._connections.pop(task, None)
            self._readers.pop(conn, None)
            self._detach(conn)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 1)

    def _refuse_client(self, sock: socket.socket, fds: list[int]) -> None:
        """A connection past `max_clients`: its Hello answered with an error, and closed (the Hello read whole, so
        the client reads the answer before the end)."""
        self.metrics.request_errors.labels("max_clients").inc()
        if (held_back := self._over_clients.due()) is not None:
            log.warning("client refused: %d clients are connected, --max-clients (kvgate_agent_request_errors_total"
                        "{op=max_clients} counts every one)%s", self._served, held_back_note(held_back))
        with contextlib.suppress(OSError):  # (a small frame into an empty socket buffer: it fits)
            sock.send(frame(ErrorReply(message=f"busy: the agent serves {self.config.max_clients} clients at once "
                                               f"(--max-clients); retry later")))
        for fd in fds:
            os.close(fd)
        sock.close()

    async def _drop_oldest_connecting(self) -> None:
        """At `max_connecting_clients`, the connection that has waited longest for its Hello is answered with an
        error and closed, so the new one can be accepted: refusing the newest instead let connections that never
        send a Hello (each reconnecting when FIRST_FRAME_TIMEOUT_S drops it) keep every new client out. Its
        socket and descriptors are closed before this returns: no more than the cap wait at once. First the
        connections just accepted read their Hello if it is there (one turn of the loop): asyncio's own loop takes
        the accepts waiting in one go, before any of them is read (uvloop lets them read in between), and a fleet
        that reconnects at once has sent its Hellos by then."""
        await asyncio.sleep(0)
        if len(self._connecting) < self.config.max_connecting_clients:
            return
        task, sock = next(iter(self._connecting.items()))
        del self._connecting[task]
        self.metrics.request_errors.labels("max_connecting_clients").inc()
        if (held_back := self._over_connecting.due()) is not None:
            log.warning("client dropped: it sent no Hello while %d connections were waiting for theirs and another "
                        "came, --max-connecting-clients (kvgate_agent_request_errors_total{op=max_connecting_"
                        "clients} counts every one)%s", self.config.max_connecting_clients,
                        held_back_note(held_back))
        with contextlib.suppress(OSError):  # (a small frame into an empty socket buffer: it fits)
            sock.send(frame(ErrorReply(message=f"dropped: no Hello from this connection while "
                                               f"{self.config.max_connecting_clients} were waiting for theirs and "
                                               f"another came (--max-connecting-clients); reconnect")))
        task.cancel()
        await asyncio.wait([task])
        sock.close()  # (a task cancelled before it ran never got to close it)

    async def _send(self, writer: asyncio.StreamWriter, reply: Reply) -> None:
        """Write an answer and wait until the client has taken all but the transport's high-water mark of it;
        _Stalled if a whole `client_write_timeout_s` goes by with none of it taken. An inline answer's blocks go to
        the transport as they are (written in one go: what is unsent is its write buffer, `_unsent`)."""
        if isinstance(reply, LoadReply) and reply.data:
            for piece in frame_in_pieces(reply):
                writer.write(piece)
        else:
            writer.write(frame(reply))
        transport = writer.transport
        left = transport.get_write_buffer_size()
        while True:
            try:
                await asyncio.wait_for(writer.drain(), self.config.client_write_timeout_s)
                return
            except TimeoutError:
                now_left = transport.get_write_buffer_size()
                if now_left >= left:
                    raise _Stalled from None
                left = now_left

    def _refuse_over_budget(self, writer: asyncio.StreamWriter, size: int) -> None:
        """A big frame that would take the bytes of frames being read past `frame_budget`: an error reply, and the
        connection closed (its body, never read, would be taken for the next frame). Refused at once rather than
        made to wait: no kvgate client sends such frames where it could be near the budget (the connector's are
        under 1 MiB, never counted: 2^15 blocks' hashes, offsets and lengths, about 0.6 MiB; an inline Store of
        2^15 of the simulator's 64-byte blocks, 2.4 MiB), so a
        frame refused here comes with frames that together hold 512 MiB by default, and a wait would only hold
        its client until its own timeout."""
        self.metrics.request_errors.labels("frame_budget").inc()
        if (held_back := self._over_budget.due()) is not None:
            log.warning("client's frame of %d bytes refused: frames being read hold %d of the %d bytes of "
                        "--frame-budget (kvgate_agent_request_errors_total{op=frame_budget} counts every one)%s",
                        size, self._frame_bytes, self.config.frame_budget, held_back_note(held_back))
        writer.write(frame(ErrorReply(message=f"busy: a frame of {size} bytes would take frames being read past "
                                              f"{self.config.frame_budget} bytes (--frame-budget); retry, or pass "
                                              f"shared memory")))

    def _drop_stalled_readers(self) -> None:
        """Every half `client_read_timeout_s`: a connection that two sweeps in a row found inside the same frame, no
        further along, is dropped (its transport aborted: the read ends, and what it holds of the frame is let go).
        A client that began a frame and sent no more of it kept its connection and that memory (up to MAX_FRAME)
        for good. Two sweeps, not one: after this process was not run for a while, what a client sent meanwhile
        waits in the stream's buffer until the loop gets to it. (A sweep, not a timeout on each read: asyncio.timeout
        cost each frame 7-8 us, on lookups answered in 45-120 us a round trip here.) A big frame must also move at
        least MIN_FRAME_BYTES_PER_S between two sweeps: one that trickled in held its share of `frame_budget` for
        good."""
        least = int(MIN_FRAME_BYTES_PER_S * self.config.client_read_timeout_s / 2)
        for conn, writer in list(self._readers.items()):
            moved, conn.seen_received = conn.received - conn.seen_received, conn.received
            if not conn.reading or (conn.progress != conn.seen_progress and (not conn.received or moved >= least)):
                conn.seen_progress, conn.stalled_sweeps = conn.progress, 0
                continue
            conn.seen_progress = conn.progress
            conn.stalled_sweeps += 1
            if conn.stalled_sweeps < 2:
                continue
            self._readers.pop(conn, None)
            self.metrics.request_errors.labels("read_timeout").inc()
            if (held_back := self._read_stalls.due()) is not None:
                log.warning("client dropped: it sent none of the frame it began for %g s, or too little (kvgate_"
                            "agent_request_errors_total{op=read_timeout} counts every one)%s",
                            self.config.client_read_timeout_s, held_back_note(held_back))
            writer.transport.abort()

    def _unsent(self) -> int:
        """Bytes of answers written to clients and not yet taken by them, and of inline answers being made."""
        writers = list(self._connections.values())  # (also read by a /metrics scrape's thread)
        return self._unsent_reserved + sum(w.transport.get_write_buffer_size() for w in writers)

    def _detach(self, conn: Connection) -> None:
        if conn.view is not None:
            self.metrics.shm_clients.dec()
        conn.close()

    async def _answer(self, conn: Connection, body: bytes | mmap.mmap, fds: list[int] | None = None) -> Reply:
        op = "invalid" if fds is None else "hello"
        try:
            request = request_decoder.decode(body)
            if fds is not None and not isinstance(request, Hello):
                # (no client kvgate ships talks before its Hello: one that does skipped the protocol check)
                raise ValueError(f"the first frame of a connection must be a Hello (protocol {PROTOCOL_VERSION}), "
                                 f"not a {request.__struct_config__.tag}: closing the connection")
            op = str(request.__struct_config__.tag)  # (its wire name: "store" for a ReceivedStore too)
            self.metrics.requests.labels(op).inc()
            loop = asyncio.get_running_loop()
            if isinstance(request, Lookup):
                return await self._lookup(request)
            if isinstance(request, Store):
                if self.store.dram is not None and request_bytes(request) <= INLINE_STORE_BYTES:
                    return await self._store_inline(conn, request)
                return await loop.run_in_executor(self._pool, self._store, conn, request)
            if isinstance(request, Load):
                if not request.offsets:  # an inline answer: its bytes wait in memory until the client reads them
                    size = len(request.hashes) * max(request.block_bytes, 0)
                    if size > INLINE_LOAD_BYTES:  # (before the bound below, which is as big: never "busy, retry")
                        raise ValueError(f"{len(request.hashes)} blocks of {request.block_bytes} bytes do not fit "
                                         f"an inline answer ({INLINE_LOAD_BYTES} bytes at most): pass shared memory")
                    if size > UNCOUNTED_ANSWER_BYTES and self._unsent() + size > MAX_UNSENT_BYTES:
                        raise ValueError(f"busy: {self._unsent()} bytes of answers not yet read by their clients; "
                                         f"retry, or load into shared memory")
                    self._unsent_reserved += size
                    try:
                        return await self._load_answer(conn, request)
                    finally:
                        self._unsent_reserved -= size
                return await self._load_answer(conn, request)
            if isinstance(request, Hello):
                if fds is None:
                    raise ValueError("Hello is the first frame of a connection only")
                if request.version != PROTOCOL_VERSION:  # told why, then closed: its next frames would be misread
                    raise ValueError(f"the client {request.client!r} speaks protocol {request.version}, this "
                                     f"tier agent {PROTOCOL_VERSION}: upgrade both")
                conn.greeted = True  # (answered from now on even if its memory is refused below: it is told why)
                if request.shm_bytes or fds:
                    if len(fds) != 1:
                        raise ValueError(f"Hello with {len(fds)} descriptors: pass exactly the shared memory's")
                    conn.attach(fds[0], request.shm_bytes)
                    self.metrics.shm_clients.inc()
                conn.declare(request.layout, request.block_bytes)
                self._start_prefault(request.block_bytes)
                return HelloReply(version=PROTOCOL_VERSION, pid=os.getpid(),
                                  shm_bytes=len(conn.view) if conn.view is not None else 0)
            if isinstance(request, Stats):
                return self._stats()
            raise ValueError(f"unknown request {request!r}")
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, OSError) as exc:
            if isinstance(exc, msgspec.ValidationError) and _LOOKUP_TOO_LONG in str(exc):
                op = "lookup"
                exc = ValueError(f"a Lookup of more than {MAX_LOOKUP_HASHES} hashes (MAX_LOOKUP_HASHES) is "
                                 f"refused: ask about a longer prefix a piece at a time (AgentClient.lookup does)")
            elif isinstance(exc, msgspec.ValidationError) and _BATCH_TOO_LONG in str(exc):
                op = _op_of(body)
                exc = ValueError(f"a Store or Load of more than {MAX_BATCH_BLOCKS} blocks (MAX_BATCH_BLOCKS) is "
                                 f"refused ({exc}): send a longer chain or load as several, in one write if you "
                                 f"like (AgentClient does)")
            self.metrics.request_errors.labels(op).inc()
            if op == "hello":
                log.warning("client refused at hello: %s", exc)
            return ErrorReply(message=f"{type(exc).__name__}: {exc}")
        except Exception as exc:  # a request no check above foresaw: answered, the connection goes on serving
            self.metrics.request_errors.labels(op).inc()
            log.exception("%s request failed", op)
            return ErrorReply(message=f"internal error: {type(exc).__name__}: {exc}")

    async def _load_answer(self, conn: Connection, request: Load) -> LoadReply:
        loop = asyncio.get_running_loop()
        if not self._all_in_dram(request):
            return await loop.run_in_executor(self._pool, self._load, conn, request)
        # on the loop, from DRAM only, INLINE_LOAD_PIECE_BLOCKS at a time with whatever else is ready let in
        # between: a block demoted or evicted since the check (by a thread of this process) is read from below
        # with the rest of the chain in the request pool, never on the loop
        reply = LoadReply(lengths=[], data=[])
        for start in range(0, len(request.hashes), INLINE_LOAD_PIECE_BLOCKS):
            if start:
                await asyncio.sleep(0)
            piece = self._load(conn, request, start, memory_only=True, stop=start + INLINE_LOAD_PIECE_BLOCKS)
            reply.lengths += piece.lengths
            reply.data += piece.data
            if len(reply.lengths) < min(len(request.hashes), start + INLINE_LOAD_PIECE_BLOCKS):
                break
        if len(reply.lengths) == len(request.hashes):
            return reply
        rest = await loop.run_in_executor(self._pool, self._load, conn, request, len(reply.lengths))
        return LoadReply(lengths=reply.lengths + rest.lengths, data=reply.data + rest.data)

    def _prefaultable(self) -> bool:
        return self.config.dram_prefault and isinstance(self.store.dram, DramTier)

    def _start_prefault(self, block_bytes: int) -> None:
        """The first client that declares a block size of a page or more has the DRAM tier pre-faulted in it (in
        the background). A smaller one pre-faults nothing: each buffer costs the agent a Python object besides its
        bytes, so a Hello of 1-byte blocks filled an 8 MiB tier with 8 million buffers, 773 MB of memory (a 64 GiB
        tier, more than any host has); for a block of a page or more that is about 2% at most. (A block under a
        page shares its pages with others, so pre-faulting saves it little; a vLLM worker's blocks are 16 KiB for
        the tiny test model, hundreds of KiB for real ones.)"""
        if self._prefault is None or self._prefault_started or block_bytes < PAGE:
            if self._prefault is not None and 0 < block_bytes < PAGE:
                log.info("DRAM tier: not pre-faulted for a client's blocks of %d bytes (under a page)", block_bytes)
            return
        self._prefault_started = True
        dram = self.store.dram
        assert isinstance(dram, DramTier)
        dram.prefaulting = True  # from now on, not from when the thread gets to it

        def run() -> None:
            started = time.monotonic()
            added = dram.prefault(block_bytes, self._stopping)
            log.info("DRAM tier: %.0f MiB of %d-byte block buffers pre-faulted in %.1f s", added / 2**20,
                     block_bytes, time.monotonic() - started)

        self._prefault.submit(run)

    async def _lookup(self, request: Lookup) -> LookupReply:
        count, where = await self._held(request.layout, request.hashes, observe=True)
        if count < len(request.hashes) and self.store.shared is not None:
            rest = request.hashes[count:]
            if request.probe_ms > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                        self._pool, self.store.probe_shared, request.layout, rest), request.probe_ms / 1000)
                count, where = await self._held(request.layout, request.hashes)
            else:  # learn in the background: the next lookup of this prefix will know
                self.store.probe_shared_in_background(request.layout, rest)
        return LookupReply(count=count, where=where)

    async def _held(self, layout: int, hashes: list[Any], observe: bool = False) -> tuple[int, str]:
        """store.lookup, LOOKUP_PIECE_HASHES at a time with whatever else is ready let in between (another
        client's lookup waits for a piece, not for the whole walk); `observe`: its time on the loop, pieces
        summed, into kvgate_agent_lookup_seconds."""
        count, where, spent = 0, [], 0.0
        for start in range(0, max(len(hashes), 1), LOOKUP_PIECE_HASHES):
            if start:
                await asyncio.sleep(0)
            piece = hashes if len(hashes) <= LOOKUP_PIECE_HASHES else hashes[start: start + LOOKUP_PIECE_HASHES]
            started = time.perf_counter()
            held, codes = self.store.lookup(layout, piece)
            spent += time.perf_counter() - started
            count += held
            where.append(codes)
            if held < len(piece):
                break
        if observe:
            self.metrics.lookup_seconds.observe(spent)
        return count, "".join(where)

    @staticmethod
    def _check_store(conn: Connection, request: Store) -> None:
        """A store's blocks, every one of them, are what it may name (refused as a whole otherwise, before any is
        stored): checked with no view made (2^15 views took 15-40 ms, on the event loop for a small store)."""
        conn.check(request.layout)
        if request.data:
            if request.offsets or request.lengths:  # (whose lengths chose where the store ran, and were not used)
                raise ValueError("blocks inline (data) or in shared memory (offsets, lengths), not both")
            blocks = len(request.data)
        else:
            if len(request.offsets) != len(request.lengths):
                raise ValueError(f"{len(request.offsets)} offsets but {len(request.lengths)} lengths")
            if request.offsets and (min(request.offsets) < 0 or min(request.lengths) < 0 or max(
                    map(operator.add, request.offsets, request.lengths)) > len(conn.view or b"")):
                for offset, length in zip(request.offsets, request.lengths, strict=True):
                    conn.region(offset, length).release()  # (raises, naming the first region outside)
            blocks = len(request.offsets)
        if blocks != len(request.hashes):
            raise ValueError(f"{len(request.hashes)} hashes but {blocks} blocks")
        if conn.block_bytes and blocks:  # a block of another size than declared: a part of one, or another's
            sizes = request.lengths or [len(d) for d in request.data]
            if min(sizes) != conn.block_bytes or max(sizes) != conn.block_bytes:
                conn.check(request.layout, next(n for n in sizes if n != conn.block_bytes))  # (raises, naming it)

    def _payloads(self, conn: Connection, request: Store, start: int = 0, stop: int | None = None) -> list[Any]:
        """Blocks `start` to `stop` of a store `_check_store` let through, as buffers: views into the shared
        memory (give them back with `_release`) or the inline ones."""
        if request.data:
            payloads: list[Any] = request.data[start:stop]
        else:
            payloads = [conn.region(o, n) for o, n in zip(request.offsets[start:stop], request.lengths[start:stop],
                                                          strict=True)]
        self.metrics.bytes_stored.inc(sum(len(p) for p in payloads))
        return payloads

    @staticmethod
    def _release(payloads: list[Any]) -> None:
        for p in payloads:
            if isinstance(p, memoryview):
                p.release()

    def _store(self, conn: Connection, request: Store) -> StoreReply:
        self._check_store(conn, request)
        payloads = self._payloads(conn, request)
        try:
            stored = self.store.store_chain(request.layout, request.hashes, payloads, request.parent)
        finally:
            self._release(payloads)
        return StoreReply(stored=stored)

    async def _store_inline(self, conn: Connection, request: Store) -> StoreReply:
        """A small store with a DRAM tier: the copy into DRAM on the event loop (handing it to a thread and back
        cost more CPU than the copy), a piece of the chain at a time with whatever else is ready in between (a
        lookup is answered between two pieces, not after the whole chain); only blocks DRAM refuses (bigger than
        the whole tier) go to the request pool, to be written below."""
        self._check_store(conn, request)
        loop = asyncio.get_running_loop()
        stored, start, hashes = 0, 0, request.hashes
        sizes = request.lengths or [len(d) for d in request.data]
        while start < len(hashes):
            end, size = start + 1, sizes[start]
            while (end < len(hashes) and size + sizes[end] <= INLINE_STORE_PIECE_BYTES
                   and end - start < INLINE_STORE_PIECE_BLOCKS):
                size += sizes[end]
                end += 1
            if start:
                await asyncio.sleep(0)  # let ready callbacks (other connections' requests) run
            parent = request.parent if start == 0 else hashes[start - 1]
            payloads = self._payloads(conn, request, start, end)  # (a piece's views only: made as it goes)
            try:
                held, refused = self.store.store_in_memory(request.layout, hashes[start:end], payloads, parent)
                stored += held
                if refused:
                    stored += await loop.run_in_executor(self._pool, self.store.store_refused, refused)
            finally:
                self._release(payloads)
            start = end
        return StoreReply(stored=stored)

    def _all_in_dram(self, request: Load) -> bool:
        """A load small enough for the event loop whose every block is in DRAM: a copy, no medium to wait for (a
        block that leaves DRAM before it is read is read from below in the request pool)."""
        dram = self.store.dram
        if dram is None or len(request.hashes) * request.block_bytes > INLINE_STORE_BYTES:
            return False
        layout, contains = request.layout, dram.contains
        return all(contains((layout, h)) for h in request.hashes)

    def _load(self, conn: Connection, request: Load, start: int = 0, memory_only: bool = False,
              stop: int | None = None) -> LoadReply:
        """The request's blocks from `start` on (the ones before were loaded already), up to `stop` (None: the
        last); `memory_only`: only the leading run DRAM holds (TierStore.load_chain)."""
        conn.check(request.layout, request.block_bytes)
        inline = not request.offsets
        if request.block_bytes <= 0:
            raise ValueError(f"blocks of {request.block_bytes} bytes")
        hashes = request.hashes[start:stop]
        arrays: list[bytearray] = []
        if inline:  # the answer's bytes are read into the buffers it sends (not copied once more)
            arrays = [bytearray(request.block_bytes) for _ in hashes]
            buffers = [memoryview(a) for a in arrays]
        else:
            if len(request.offsets) != len(request.hashes):
                raise ValueError(f"{len(request.hashes)} hashes but {len(request.offsets)} offsets")
            buffers = [conn.region(o, request.block_bytes) for o in request.offsets[start:stop]]
        try:
            lengths = self.store.load_chain(request.layout, hashes, buffers, memory_only)
            self.metrics.bytes_loaded.inc(sum(lengths))
        finally:
            for b in buffers:
                b.release()
        # (bytearrays, encoded as bytes are)
        data = cast(list[bytes], [a if n == len(a) else a[:n] for a, n in zip(arrays, lengths, strict=False)])
        return LoadReply(lengths=lengths, data=data)

    def _stats(self) -> StatsReply:
        tiers = {}
        for tier in self.store.tiers:
            usage = tier.usage()
            tiers[tier.name.value] = TierInfo(used_bytes=usage.used_bytes, blocks=usage.blocks,
                                        capacity_bytes=usage.capacity_bytes, hits=tier.stats.hits,
                                        misses=tier.stats.misses)
        return StatsReply(tiers=tiers)
