"""OpenAI-style error answers, the one body every HTTP error of kvgate has (the gateway's, the tier agent's metrics
port's): `{"error": {"message", "type", "code", "param"}}`."""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:  # aiohttp is imported when a response is made: the simulator shares the pool, not the server
    from aiohttp import web


def error_response(
    status: int,
    message: str,
    *,
    type: str = "invalid_request_error",
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    from aiohttp import web

    body = orjson.dumps({"error": {"message": message, "type": type, "code": code, "param": None}})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)
