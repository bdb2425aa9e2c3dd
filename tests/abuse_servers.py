"""Misbehaving workers for the abuse suite: real servers on loopback that answer generation requests with
hand-written bytes (cut bodies, unterminated streams), and a worker whose model listing can be broken at run time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

MODELS = orjson.dumps({"object": "list", "data": [{"id": "tiny", "object": "model", "root": "tiny"}]})

Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


def _reply(status: str, body: bytes, content_type: str = "application/json") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n\r\n"
            ).encode() + body


@asynccontextmanager
async def raw_server(reply: Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]) -> AsyncIterator[str]:
    """A TCP server that answers each connection with hand-written bytes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reply(reader, writer)  # type: ignore[misc]
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request's head (its body, if any, read and dropped)."""
    head = await reader.readuntil(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            await reader.readexactly(int(line.split(b":")[1]))
    return head


@asynccontextmanager
async def raw_worker(answer: Answer, heads: list[bytes] | None = None, metrics: bytes = b"") -> AsyncIterator[str]:
    """A worker written on raw sockets: `/health`, `/v1/models` and `/metrics` (`metrics`, empty by default) answer
    as vLLM's do (keep-alive); any other request is answered by `answer(writer)`, after which the connection is
    closed. Every request head it reads is appended to `heads`, if given."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await read_request(reader)
                if heads is not None:
                    heads.append(head)
                path = head.split(b" ", 2)[1]
                if path == b"/health":
                    writer.write(_reply("200 OK", b""))
                elif path == b"/v1/models":
                    writer.write(_reply("200 OK", MODELS))
                elif path == b"/metrics":
                    writer.write(_reply("200 OK", metrics, "text/plain"))
                else:
                    await answer(writer)
                    await writer.drain()
                    return
                await writer.drain()

    async with raw_server(serve) as url:
        yield url


@dataclass
class ListingWorker:
    """A worker whose `/v1/models` answer is set by the test; generation answers a fixed completion."""

    url: str
    runner: web.AppRunner
    models: Any = field(default_factory=lambda: orjson.loads(MODELS))

    async def stop(self) -> None:
        await self.runner.cleanup()


@asynccontextmanager
async def listing_worker(port: int) -> AsyncIterator[ListingWorker]:
    app = web.Application()
    holder: list[ListingWorker] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response(holder[0].models)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="")

    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    worker = ListingWorker(f"http://127.0.0.1:{port}", runner)
    holder.append(worker)
    try:
        yield worker
    finally:
        await runner.cleanup()
