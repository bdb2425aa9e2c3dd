"""The gateway's listening socket: a cap on open client connections and a deadline on idle ones, so clients that
connect and say nothing, or send their request heads a byte at a time (slowloris), cannot hold its sockets.

Each accepted connection is counted. Beyond `max_client_connections` a new one is answered at once with a 503
(`Retry-After`, an OpenAI-style error) and closed — logged and counted, never an empty reply. A connection that
has not sent a whole request head within `client_idle_timeout_s` of connecting or of its last answer is closed
(aiohttp's keep-alive deadline, which since 3.14.4 also runs before the first request). The cap is kept below the
process's open-file limit, which `raise_open_file_limit` lifts to its hard limit at start.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvcore.http_server import MalformedRequests, json_error_handler
from kvcore.log_throttle import LogThrottle
from router.config import GatewayConfig
from router.metrics import GatewayMetrics

log = logging.getLogger(__name__)

LISTEN_BACKLOG = 4096
# after answering a request whose body it did not read (413, 408, 401 ...), aiohttp keeps reading and dropping the
# rest so the answer is not lost to a reset; bounded, so a client cannot make the gateway read a 1 GiB upload
LINGER_S = 2.0
REFUSAL_LINGER_S = 2.0  # a refused client gets this long to read the 503 before its socket is dropped
MAX_LINGERING = 256  # refused sockets waiting for their client to read; beyond, refusals close at once
# on SIGTERM the listener closes at once, and the answers under way get this long to end before they are cut
SHUTDOWN_S = 60.0


def raise_open_file_limit() -> int:
    """Lift the soft open-file limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, exc)
    return soft


def connection_cap(wanted: int) -> int:
    """`wanted`, lowered to leave an eighth of the open-file limit (at least 64) for workers, events and files."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    room = max(1, soft - max(64, soft // 8))
    if wanted > room:
        log.warning("max_client_connections lowered from %d to %d to fit the open-file limit of %d", wanted, room,
                    soft)
    return min(wanted, room)


def _refusal(limit: int) -> bytes:
    body = orjson.dumps({"error": {
        "message": f"the gateway is at its limit of {limit} open connections; retry shortly",
        "type": "service_unavailable", "code": "too_many_connections", "param": None}})
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)) + body


class ClientConnections:
    """Counts the open client connections and decides, for each new one, whether it is served or refused."""

    def __init__(self, server: web.Server, limit: int, metrics: GatewayMetrics) -> None:
        self._server = server
        self.limit = limit
        self.open = 0
        self.refused = 0
        self._lingering = 0
        self._metrics = metrics
        self._refusal = _refusal(limit)
        self._warnings = LogThrottle()

    def __call__(self) -> asyncio.Protocol:
        """The protocol for a new connection (the event loop's protocol factory)."""
        if self.open >= self.limit:
            return _Refused(self)
        server = self._server
        return _Counted(self, json_error_handler(server))

    def _opened(self, delta: int) -> None:
        self.open += delta
        self._metrics.client_connections.set(self.open)

    def _refuse(self, transport: asyncio.Transport) -> bool:
        """Count and log a refusal; whether the socket may linger for the client to read the 503."""
        self.refused += 1
        self._metrics.client_connections_refused.inc()
        held_back = self._warnings.due()
        if held_back is not None:
            log.warning("client connection cap of %d reached: refused %d new connection(s) with 503 since the last "
                        "report (%d in all)", self.limit, held_back + 1, self.refused)
        return self._lingering < MAX_LINGERING


class _Counted(asyncio.Protocol):
    """aiohttp's own connection handler, counted while it is open."""

    def __init__(self, connections: ClientConnections, handler: RequestHandler) -> None:
        self._connections = connections
        self._handler = handler
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._connections._opened(1)
        self._counted = True
        self._handler.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self._connections._opened(-1)
        self._handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._handler.data_received(data)

    def eof_received(self) -> None:
        self._handler.eof_received()  # aiohttp keeps its side open to answer

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()


class _Refused(asyncio.Protocol):
    """A connection over the cap: a 503 written at once, the socket closed once the client has read it."""

    def __init__(self, connections: ClientConnections) -> None:
        self._connections = connections
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        linger = self._connections._refuse(self._transport)
        self._transport.write(self._connections._refusal)
        if not linger:
            self._transport.close()
            return
        # half-close and keep reading until the client closes: closing with its request unread would reset the
        # connection, and a reset may destroy the 503 before the client reads it
        self._connections._lingering += 1
        if self._transport.can_write_eof():
            self._transport.write_eof()
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, self._transport.abort)

    def data_received(self, data: bytes) -> None:
        pass

    def eof_received(self) -> bool:
        return False  # the client has read and closed: close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._connections._lingering -= 1


class ListeningSite(web.BaseSite):
    """An aiohttp site on a TCP port whose every accepted connection goes through `ClientConnections`."""

    def __init__(self, runner: web.AppRunner, connections: ClientConnections, host: str, port: int,
                 reuse_port: bool = False) -> None:
        # a deep accept queue: clients reconnecting in a burst (a slowloris wave cut off at once) must not have their
        # SYNs dropped, which costs each a 1 s retransmit (the kernel caps it at net.core.somaxconn)
        super().__init__(runner, backlog=LISTEN_BACKLOG)
        self.connections = connections
        self.host, self.port = host, port
        self.reuse_port = reuse_port  # several gateway processes on this port (router/processes.py)

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        self._server = await asyncio.get_running_loop().create_server(
            self.connections, self.host, self.port, backlog=self._backlog, reuse_address=True,
            reuse_port=self.reuse_port or None)


@asynccontextmanager
async def serving(app: web.Application, config: GatewayConfig, metrics: GatewayMetrics, *,
                  reuse_port: bool = False) -> AsyncIterator[ClientConnections]:
    """Serve `app` on `config.host:config.port` until the context ends (sharing the port with other processes that
    set `reuse_port` too)."""
    server_log = logging.getLogger(f"{__name__}.http.{config.port}")
    server_log.addFilter(MalformedRequests(lambda status: metrics.rejected.labels(str(status), "malformed_http").inc()))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=server_log,
                           keepalive_timeout=config.client_idle_timeout_s, lingering_time=LINGER_S,
                           shutdown_timeout=SHUTDOWN_S)
    await runner.setup()
    try:
        assert runner.server is not None
        connections = ClientConnections(runner.server, connection_cap(config.max_client_connections), metrics)
        await ListeningSite(runner, connections, config.host, config.port, reuse_port).start()
        yield connections
    finally:
        await runner.cleanup()
