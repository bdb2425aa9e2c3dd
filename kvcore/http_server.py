"""aiohttp's connection handler, and a TCP site serving with it, whose answer to a request aiohttp cannot parse (a
line over 8 KiB, a method that is none, a Content-Length that is no number) is the OpenAI-style JSON error of every
other answer (kvcore.http_errors), not a line of plain text an OpenAI client cannot read. The gateway's listener and
the tier agent's metrics port both serve with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_response import StreamResponse

from kvcore.http_errors import error_response

MAX_ECHO_CHARS = 300  # of aiohttp's account of a request it could not parse, told back to its client

log = logging.getLogger(__name__)


class JsonErrorHandler(RequestHandler):
    """aiohttp's handler of one connection, answering what it cannot parse with a JSON error."""

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it; raises once answering
        if status >= 500:
            answer = error_response(status, "the server failed to handle the request", type="server_error",
                                    code="internal_error")
        else:
            answer = error_response(status, f"malformed HTTP request: {(message or '')[:MAX_ECHO_CHARS]}",
                                    code="malformed_http")
        answer.force_close()
        return answer


def json_error_handler(server: web.Server) -> JsonErrorHandler:
    """A handler for a new connection of `server`'s, made as `server()` makes its own."""
    return JsonErrorHandler(server, loop=server._loop, **server._kwargs)


class JsonErrorSite(web.TCPSite):
    """aiohttp's TCP site, each connection served by a `JsonErrorHandler`."""

    async def start(self) -> None:
        await web.BaseSite.start(self)  # (registers the site with its runner; TCPSite.start would serve too)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: json_error_handler(server), self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]


class MalformedRequests(logging.Filter):
    """aiohttp answers a request it cannot parse with 400 and logs it with a traceback at ERROR: a client could fill
    the logs with them. Such records are counted (`count(status)`) and logged in one line at debug instead. Added to
    the logger a server's runner is given (`web.AppRunner(..., logger=)`)."""

    def __init__(self, count: Callable[[int], None]) -> None:
        super().__init__()
        self._count = count

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self._count(exc.code or 400)
        log.debug("malformed request answered %s: %s", exc.code, exc.message)
        return False
