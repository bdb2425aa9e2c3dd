"""The prefill turns of a gateway of several processes (`--processes N`), kept by one of them for all.

Each process keeping its own turns (router/prefill_turns.py) let N of them send one engine N long prefills
together, which the turns are there to prevent. So process 0 runs a `TurnBroker` on a Unix socket in the gateway's
sockets directory, holding one `PrefillTurns` for the whole gateway, and every process (process 0 too) takes and
releases turns there through a `SharedPrefillTurns`: the proxy's `TurnKeeper`, like a `PrefillTurns`.

On the socket: frames of a 4-byte big-endian length and a msgpack message (below). A process asks for a turn
(`Take`); the broker answers at once how long it may wait at most (`Queued`: the holds of the turns before it on
that engine) and says when it starts (`Granted`); the process gives it back (`Release`), whether it had started or
not: a turn given back before it starts hands its place on as `PrefillTurns` does. A connection that closes gives
back every turn it had; a frame the broker cannot read closes that connection only.

The broker never holds a request up: a process that cannot reach it, or gets no `Queued` within `answer_timeout_s`
or no `Granted` within the wait it was told (and a second), sends that request in a turn of its own (as one process
does: `kvgate_prefill_turns_local_total`, logged once until the broker answers again), drops the connection and
connects again after 50 ms, doubling the wait each time the broker did not answer in time, up to 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
from dataclasses import dataclass
from typing import Annotated

import msgspec

from router.frames import FrameError, frame, read_frame, send
from router.metrics import GatewayMetrics
from router.prefill_turns import HOLD_MAX_S, PrefillTurns, Turn

log = logging.getLogger(__name__)

ANSWER_TIMEOUT_S = 0.5  # the most a take waits for the broker's `Queued` before it goes on with a turn of its own
GRANT_GRACE_S = 1.0  # beyond the wait the broker said, before a take goes on without it
CONNECT_TIMEOUT_S = 1.0
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 2.0
MAX_FRAME_BYTES = 4096
MAX_BUFFERED_BYTES = 1 << 20  # written and not yet taken by the other side: past this it is not reading
MAX_TICKETS = 1 << 16  # turns one connection may have asked for and not given back

# why a process took a turn of its own (kvgate_prefill_turns_local_total's `reason`)
UNREACHABLE = "unreachable"  # no connection to the broker (not started yet, gone, or reconnecting)
TIMEOUT = "timeout"  # connected, but no answer in time
LOST = "lost"  # the connection closed while the take waited
_EPISODE = {UNREACHABLE: "cannot be reached", TIMEOUT: "did not answer in time", LOST: "closed the connection"}

Ticket = Annotated[int, msgspec.Meta(ge=0)]
Engine = Annotated[str, msgspec.Meta(max_length=1024)]


# the wire: a process's messages to the broker ...
class Take(msgspec.Struct, tag="take", array_like=True, frozen=True):
    ticket: Ticket  # the process's own number for this turn, never reused on a connection
    engine: Engine  # a worker, or a data-parallel rank of one (router.kv_transport.cache_name)
    hold_s: float


class Release(msgspec.Struct, tag="release", array_like=True, frozen=True):
    ticket: Ticket


# ... and the broker's answers
class Queued(msgspec.Struct, tag="queued", array_like=True, frozen=True):
    ticket: Ticket
    bound_s: float  # the longest it can wait: the holds of the turns before it on the engine


class Granted(msgspec.Struct, tag="granted", array_like=True, frozen=True):
    ticket: Ticket


_TO_BROKER = msgspec.msgpack.Decoder(Take | Release)
_TO_PROCESS = msgspec.msgpack.Decoder(Queued | Granted)


def _send(writer: asyncio.StreamWriter, message: Take | Release | Queued | Granted) -> bool:
    return send(writer, frame(message), MAX_BUFFERED_BYTES)


@dataclass(slots=True)
class _Line:
    """An engine's turns at the broker not given back, and the sum of their holds (a bound on a new one's wait)."""

    turns: int = 0
    hold_s: float = 0.0


class _Client:
    """One process's connection to the broker: its turns waiting (the tasks taking them) and started."""

    __slots__ = ("granted", "holds", "waiting", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.waiting: dict[int, asyncio.Task[None]] = {}
        self.granted: dict[int, Turn] = {}
        self.holds: dict[int, tuple[str, float]] = {}  # every turn not given back: its engine and hold


class TurnBroker:
    """The gateway's prefill turns, one `PrefillTurns` for all its processes, served on a Unix socket."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._turns = PrefillTurns()
        self._lines: dict[str, _Line] = {}
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._connections.values():
            writer.transport.abort()  # each connection's reader ends (cancelling the task asyncio made errs in 3.11)
        await asyncio.gather(*self._connections, return_exceptions=True)

    def waiting(self) -> int:
        """Turns taken at the broker and not given back (for tests)."""
        return sum(line.turns for line in self._lines.values())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        client = _Client(writer)
        try:
            while True:
                message = await read_frame(reader, _TO_BROKER, MAX_FRAME_BYTES)
                if isinstance(message, Take):
                    self._take(client, message)
                elif isinstance(message, Release):
                    self._release(client, message.ticket)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the process closed it (it stopped, or died)
        except FrameError as exc:
            log.warning("prefill turn broker: dropping a connection that sent %s", exc)
        finally:
            self._connections.pop(task, None)
            self._gone(client)
            writer.transport.abort()

    def _take(self, client: _Client, take: Take) -> None:
        if take.ticket in client.holds:
            raise FrameError(f"ticket {take.ticket} asked for twice")
        if len(client.holds) >= MAX_TICKETS:
            raise FrameError(f"more than {MAX_TICKETS} turns at once")
        if not math.isfinite(take.hold_s):
            raise FrameError(f"a hold of {take.hold_s}")
        hold = min(max(take.hold_s, 0.0), HOLD_MAX_S)
        line = self._lines.setdefault(take.engine, _Line())
        _send(client.writer, Queued(take.ticket, line.hold_s))
        line.turns += 1
        line.hold_s += hold
        client.holds[take.ticket] = (take.engine, hold)
        # tasks start in the order they are made, so turns are taken in the order the takes came
        client.waiting[take.ticket] = asyncio.ensure_future(self._grant(client, take.ticket, take.engine, hold))

    async def _grant(self, client: _Client, ticket: int, engine: str, hold_s: float) -> None:
        turn = await self._turns.take(engine, hold_s)  # cancelled: the place is handed on (PrefillTurns._leave)
        del client.waiting[ticket]
        client.granted[ticket] = turn
        _send(client.writer, Granted(ticket))

    def _release(self, client: _Client, ticket: int) -> None:
        held = client.holds.pop(ticket, None)
        if held is None:
            return  # given back already (or never taken): nothing to do
        task = client.waiting.pop(ticket, None)
        if task is not None:
            task.cancel()
        turn = client.granted.pop(ticket, None)
        if turn is not None:
            self._turns.release(turn)
        engine, hold = held
        line = self._lines[engine]
        line.turns -= 1
        line.hold_s -= hold
        if line.turns == 0:
            del self._lines[engine]

    def _gone(self, client: _Client) -> None:
        """A connection closed: every turn it had is given back."""
        for ticket in list(client.holds):
            self._release(client, ticket)


class _Ask:
    """A take sent to the broker: its answers, None if the connection was lost first."""

    __slots__ = ("engine", "granted", "queued")

    def __init__(self, engine: str, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.queued: asyncio.Future[float | None] = loop.create_future()
        self.granted: asyncio.Future[Turn | None] = loop.create_future()


class _Connection:
    """A process's connection to the broker, and what it asked there."""

    __slots__ = ("answered", "asks", "granted", "timed_out", "writer")

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.asks: dict[int, _Ask] = {}
        self.granted: dict[int, Turn] = {}
        self.answered = False  # the broker has answered on it (so reconnecting starts again from the least wait)
        self.timed_out = False  # ... but then not in time (so reconnecting waits longer each time)

    def send(self, message: Take | Release) -> None:
        _send(self.writer, message)


class SharedPrefillTurns:
    """A process's turns at the gateway's `TurnBroker`, with the interface of `PrefillTurns` (`TurnKeeper`); its
    own `PrefillTurns` while the broker cannot be reached or does not answer."""

    def __init__(self, path: str, metrics: GatewayMetrics, *, answer_timeout_s: float = ANSWER_TIMEOUT_S) -> None:
        self.path = path
        self._metrics = metrics
        self._answer_timeout_s = answer_timeout_s
        self._local = PrefillTurns()
        self._connection: _Connection | None = None
        self._tickets = itertools.count()
        self._task: asyncio.Task[None] | None = None
        self._episode = False  # a fallback logged, and the broker not answering since

    @property
    def connected(self) -> bool:
        return self._connection is not None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._connect())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def waiting(self) -> int:
        """Turns taken and not released: the broker's and this process's own."""
        connection = self._connection
        return self._local.waiting() + (len(connection.granted) if connection is not None else 0)

    async def take(self, worker: str, hold_s: float) -> Turn:
        """A turn on `worker` from the broker, once its turn before there (any process's) is released or has had its
        hold; a turn of this process's own if the broker cannot give one. Cancelled: the place is handed on."""
        connection = self._connection
        if connection is None:
            return await self._own_turn(worker, hold_s, UNREACHABLE)
        ticket = next(self._tickets)
        ask = _Ask(worker, asyncio.get_running_loop())
        connection.asks[ticket] = ask
        connection.send(Take(ticket, worker, hold_s))
        reason = LOST
        try:
            bound = await asyncio.wait_for(ask.queued, self._answer_timeout_s)
            if bound is not None:
                turn = await asyncio.wait_for(ask.granted, bound + GRANT_GRACE_S)
                if turn is not None:
                    return turn
        except TimeoutError:
            reason = TIMEOUT
            self._give_back(connection, ticket)
            connection.timed_out = True
            connection.writer.transport.abort()  # the reader sees it closed and connects again
        except BaseException:
            self._give_back(connection, ticket)
            raise
        return await self._own_turn(worker, hold_s, reason)

    def release(self, turn: Turn) -> None:
        """The next turn on its worker may go (once: a second call does nothing)."""
        if turn.ticket is None:
            self._local.release(turn)
            return
        if not turn.released.done():
            turn.released.set_result(None)
        connection = self._connection
        if connection is not None and connection.granted.pop(turn.ticket, None) is turn:
            connection.send(Release(turn.ticket))
        # on a connection since closed the broker gave it back when it closed

    def _give_back(self, connection: _Connection, ticket: int) -> None:
        """A take that left, waiting or just granted: the broker hands its place on."""
        ask = connection.asks.pop(ticket, None)
        granted = connection.granted.pop(ticket, None)
        if ask is not None or granted is not None:
            connection.send(Release(ticket))

    async def _own_turn(self, worker: str, hold_s: float, reason: str) -> Turn:
        self._metrics.prefill_turns_local.labels(reason).inc()
        if not self._episode:
            self._episode = True
            log.warning("prefill turns: the gateway's turn broker (%s) %s; long prefills take this process's own "
                        "turns until it answers", self.path, _EPISODE[reason])
        return await self._local.take(worker, hold_s)

    async def _connect(self) -> None:
        """Connected to the broker for as long as this runs, connecting again when it closes."""
        wait = RECONNECT_MIN_S
        while True:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError):
                pass
            else:
                connection = _Connection(writer)
                self._connection = connection
                self._metrics.prefill_turns_shared.set(1)
                try:
                    await self._read(reader, connection)
                except (asyncio.IncompleteReadError, ConnectionError):
                    pass
                except FrameError as exc:
                    log.warning("prefill turns: the broker sent %s; connecting again", exc)
                finally:
                    self._lost(connection)
                if connection.answered and not connection.timed_out:
                    wait = RECONNECT_MIN_S
            await asyncio.sleep(wait)
            wait = min(2 * wait, RECONNECT_MAX_S)

    async def _read(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        loop = asyncio.get_running_loop()
        while True:
            message = await read_frame(reader, _TO_PROCESS, MAX_FRAME_BYTES)
            if not connection.answered:
                connection.answered = True
                if self._episode:
                    self._episode = False
                    log.info("prefill turns: the gateway's turn broker answers again")
            if isinstance(message, Queued):
                ask = connection.asks.get(message.ticket)
                if ask is not None and not ask.queued.done():
                    ask.queued.set_result(message.bound_s)
            elif isinstance(message, Granted):
                ask = connection.asks.pop(message.ticket, None)
                if ask is None or ask.granted.done():  # its take left meanwhile (and said so, or is about to)
                    if ask is not None:
                        connection.send(Release(message.ticket))
                    continue
                turn = Turn(ask.engine, loop, message.ticket)
                turn.started.set_result(None)
                connection.granted[message.ticket] = turn
                ask.granted.set_result(turn)

    def _lost(self, connection: _Connection) -> None:
        """The connection closed: the takes waiting on it go on with turns of this process's own; the broker gave
        back the turns it had given."""
        if self._connection is connection:
            self._connection = None
            self._metrics.prefill_turns_shared.set(0)
        connection.writer.transport.abort()
        for ask in connection.asks.values():
            for future in (ask.queued, ask.granted):
                if not future.done():
                    future.set_result(None)
        connection.asks.clear()
        connection.granted.clear()
