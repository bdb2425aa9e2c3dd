"""Stand-in OpenAI-compatible workers: small real HTTP servers that answer like vLLM's API, for tests and
gateway benchmarks where the engine's behaviour does not matter (the simulated fleet models that).

A stand-in answers completions and chat completions (JSON or SSE), `/v1/models`, `/health`, `/metrics` with
vLLM's load gauges, `/tokenize` and `/detokenize`. Its behaviour is set by `StandinBehaviour` and can be
changed at run time through `POST /standin/behaviour`; what it saw is readable at `GET /standin/stats`.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import xxhash
from aiohttp import web

from kvcore.aio import run_until_signalled


@dataclass
class StandinBehaviour:
    models: list[str] = field(default_factory=lambda: ["tiny"])
    tokens: int = 8                  # tokens per answer when the request gives no max_tokens
    token_delay_s: float = 0.0       # pause between streamed tokens (and per token before a JSON answer)
    first_token_delay_s: float = 0.0  # pause before the first token
    fail_status: int = 0             # answer generation requests with this status (0 = never)
    healthy: bool = True             # /health answers 200 when true, 503 when false


@dataclass
class StandinStats:
    requests: int = 0
    completed: int = 0
    cancelled: int = 0
    prefilling: int = 0  # generation requests arrived and not yet at their first token (first_token_delay_s)
    prefill_overlaps: int = 0  # generation requests that arrived while another was before its first token
    paths: dict[str, int] = field(default_factory=dict)
    last_body: dict[str, Any] = field(default_factory=dict)
    last_headers: dict[str, str] = field(default_factory=dict)


BEHAVIOUR = web.AppKey("behaviour", StandinBehaviour)
STATS = web.AppKey("stats", StandinStats)
NAME = web.AppKey("name", str)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "BadRequestError", "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _tokens(payload: dict[str, Any], behaviour: StandinBehaviour) -> int:
    value = payload.get("max_tokens") or payload.get("max_completion_tokens")
    return int(value) if isinstance(value, int) and value > 0 else behaviour.tokens


async def _generate(request: web.Request) -> web.StreamResponse:
    behaviour, stats = request.app[BEHAVIOUR], request.app[STATS]
    stats.requests += 1
    stats.paths[request.path] = stats.paths.get(request.path, 0) + 1
    try:
        payload = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return _error(400, "invalid JSON")
    stats.last_body = payload
    stats.last_headers = dict(request.headers)
    if behaviour.fail_status:
        return _error(behaviour.fail_status, "stand-in told to fail")
    if payload.get("model") not in behaviour.models:
        return _error(404, f"The model `{payload.get('model')}` does not exist.")
    chat = request.path.endswith("/chat/completions")
    n = _tokens(payload, behaviour)
    rid = f"cmpl-{xxhash.xxh64_hexdigest(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS))}"
    stats.prefill_overlaps += stats.prefilling > 0
    stats.prefilling += 1
    try:
        try:
            if behaviour.first_token_delay_s:
                await asyncio.sleep(behaviour.first_token_delay_s)
        finally:
            stats.prefilling -= 1
        if payload.get("stream"):
            response = await _stream(request, payload, chat, n, rid, behaviour)
        else:
            if behaviour.token_delay_s:
                await asyncio.sleep(behaviour.token_delay_s * n)
            text = "".join(f" t{i}" for i in range(n))
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                if chat else {"index": 0, "text": text, "finish_reason": "length"}
            )
            response = web.Response(body=orjson.dumps({
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": payload["model"], "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1},
            }), content_type="application/json")
    except asyncio.CancelledError:
        stats.cancelled += 1
        raise
    stats.completed += 1
    return response


async def _stream(
    request: web.Request, payload: dict[str, Any], chat: bool, n: int, rid: str, behaviour: StandinBehaviour
) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for i in range(n):
        if behaviour.token_delay_s and i:
            await asyncio.sleep(behaviour.token_delay_s)
        delta: dict[str, Any] = (
            {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}
            if chat else {"index": 0, "text": f" t{i}", "finish_reason": None}
        )
        chunk = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": 0, "model": payload["model"], "choices": [delta]}
        await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _models(request: web.Request) -> web.Response:
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "vllm", "root": m, "max_model_len": 2048}
            for m in request.app[BEHAVIOUR].models]
    return web.json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200 if request.app[BEHAVIOUR].healthy else 503)


async def _metrics(request: web.Request) -> web.Response:
    stats = request.app[STATS]
    running = stats.requests - stats.completed - stats.cancelled
    model = request.app[BEHAVIOUR].models[0]
    text = (
        f'# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name="{model}"}} {running}\n'
        f'# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{{model_name="{model}"}} 0.0\n'
        f'# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name="{model}"}} 0.0\n'
    )
    return web.Response(text=text, content_type="text/plain")


async def _tokenize(request: web.Request) -> web.Response:
    payload = orjson.loads(await request.read())
    text = payload.get("prompt", "")
    tokens = [ord(c) for c in text] if isinstance(text, str) else []
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": 2048})


async def _detokenize(request: web.Request) -> web.Response:
    payload = orjson.loads(await request.read())
    return web.json_response({"prompt": "".join(chr(t) for t in payload.get("tokens", []))})


async def _get_stats(request: web.Request) -> web.Response:
    return web.json_response(asdict(request.app[STATS]))


async def _set_behaviour(request: web.Request) -> web.Response:
    behaviour = request.app[BEHAVIOUR]
    for key, value in orjson.loads(await request.read()).items():
        setattr(behaviour, key, value)
    return web.json_response(asdict(behaviour))


def create_standin_app(name: str, behaviour: StandinBehaviour | None = None) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)  # vLLM takes large bodies too
    app[NAME] = name
    app[BEHAVIOUR] = behaviour or StandinBehaviour()
    app[STATS] = StandinStats()
    app.router.add_post("/v1/completions", _generate)
    app.router.add_post("/v1/chat/completions", _generate)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_post("/tokenize", _tokenize)
    app.router.add_post("/detokenize", _detokenize)
    app.router.add_get("/standin/stats", _get_stats)
    app.router.add_post("/standin/behaviour", _set_behaviour)
    return app


@asynccontextmanager
async def serve_standins(host: str, ports: list[int], behaviour: StandinBehaviour) -> AsyncIterator[list[str]]:
    """Start one stand-in per port (in this process); yields their base URLs until the generator is closed."""
    runners = []
    try:
        for port in ports:
            runner = web.AppRunner(create_standin_app(f"{host}:{port}", StandinBehaviour(**asdict(behaviour))),
                                   handler_cancellation=True, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            runners.append(runner)
        yield [f"http://{host}:{port}" for port in ports]
    finally:
        for runner in runners:
            await runner.cleanup()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, action="append", help="a stand-in worker on this port, repeatable "
                        "(default 8101)")
    parser.add_argument("--model", action="append", help="model name served (repeatable; default tiny)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens per answer without max_tokens")
    parser.add_argument("--token-delay-s", type=float, default=0.0, help="pause per generated token")


def run(args: argparse.Namespace) -> int:
    behaviour = StandinBehaviour(models=args.model or ["tiny"], tokens=args.tokens,
                                 token_delay_s=args.token_delay_s)

    async def main() -> None:
        ports = args.port or [8101]
        async with serve_standins(args.host, ports, behaviour) as urls:
            print("stand-in workers: " + " ".join(urls), flush=True)
            await asyncio.Event().wait()

    run_until_signalled(main())
    return 0
