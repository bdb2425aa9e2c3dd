"""What the gateway counts of a streamed answer (issue 12's accounting bugs): the `usage` it reports, wherever the
chunk boundaries fall, counted once; and a client that read the stream to `data: [DONE]` is no 499, whenever it
closes. Workers on raw sockets, so every byte and pause is the test's."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import orjson
import pytest

from tests.abuse_servers import raw_worker
from tests.conftest import eventually, running_gateway

PROMPT, CACHED = 96, 64


def event(payload: dict[str, Any] | str) -> bytes:
    return b"data: " + (payload.encode() if isinstance(payload, str) else orjson.dumps(payload)) + b"\n\n"


def usage_event(completion_tokens: int) -> bytes:
    return event({"id": "c", "object": "text_completion", "choices": [], "usage": {
        "prompt_tokens": PROMPT, "completion_tokens": completion_tokens, "total_tokens": PROMPT + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": CACHED}}})


def text_event(text: str) -> bytes:
    return event({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": text}]})


def chunked(*parts: bytes) -> bytes:
    return b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in parts if p)


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def writes(*pieces: bytes | float) -> Any:
    """An answer written as these pieces (a float pauses that many seconds), then the end of the chunked body."""

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD)
        for piece in pieces:
            if isinstance(piece, float):
                await writer.drain()
                await asyncio.sleep(piece)
            else:
                writer.write(chunked(piece))
        writer.write(b"0\r\n\r\n")

    return answer


def counted(gw: Any, name: str, **labels: str) -> float:
    return gw.gateway.metrics.registry.get_sample_value(name, labels) or 0.0


async def stream_all(http: aiohttp.ClientSession, url: str) -> bytes:
    body = {"model": "tiny", "prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
    async with http.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        return await resp.read()


WHOLE = text_event(" a") + usage_event(1) + event("[DONE]")


@pytest.mark.parametrize("pieces", [
    (WHOLE,),  # a short answer: the first chunk the gateway relays already holds its usage
    (text_event(" a") + usage_event(1)[:40], 0.05, usage_event(1)[40:] + event("[DONE]")),  # usage split
    (text_event(" a"), 0.05, usage_event(1)[:7], 0.05, usage_event(1)[7:], 0.05, event("[DONE]")),
    (text_event(" a") + usage_event(1), 0.05, text_event(" b") + usage_event(2), 0.05, event("[DONE]")),  # repeated
], ids=["in_the_first_chunk", "split_across_chunks", "split_in_the_prefix", "continuous_usage_stats"])
async def test_streamed_usage_is_counted_once_wherever_it_falls(http: aiohttp.ClientSession,
                                                                pieces: tuple[bytes | float, ...]) -> None:
    async with raw_worker(writes(*pieces)) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        for _ in range(3):
            relayed = await stream_all(http, gw.url)
            assert relayed == b"".join(p for p in pieces if isinstance(p, bytes))  # byte for byte
        assert counted(gw, "kvgate_actual_cached_tokens_total", strategy="round_robin") == 3 * CACHED
        assert counted(gw, "kvgate_usage_prompt_tokens_total", strategy="round_robin") == 3 * PROMPT
        assert counted(gw, "kvgate_worker_reported_cached_tokens_total", worker=url) == 3 * CACHED
        assert counted(gw, "kvgate_requests_total", model="tiny", worker=url, status="200") == 3


async def test_a_stream_read_to_its_end_is_no_499_when_the_client_closes_at_once(http: aiohttp.ClientSession) -> None:
    """The client reads to `data: [DONE]` and closes; the worker ends its HTTP body a little later."""
    async with raw_worker(writes(text_event(" a"), usage_event(1) + event("[DONE]"), 0.3)) as url, \
            running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        body = {"model": "tiny", "prompt": "hi", "stream": True}
        for _ in range(3):
            async with http.post(gw.url + "/v1/completions", json=body) as resp:
                async for line in resp.content:
                    if line.strip() == b"data: [DONE]":
                        break
                resp.close()  # gone at once, before the gateway saw the end of the worker's body
        await eventually(lambda: counted(gw, "kvgate_requests_total", model="tiny", worker=url, status="200") == 3)
        assert counted(gw, "kvgate_requests_total", model="tiny", worker=url, status="499") == 0
        assert counted(gw, "kvgate_actual_cached_tokens_total", strategy="round_robin") == 3 * CACHED


async def test_a_client_gone_before_the_end_is_a_499(http: aiohttp.ClientSession) -> None:
    async with raw_worker(writes(text_event(" a"), 0.5, usage_event(1) + event("[DONE]"))) as url, \
            running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        async with http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "stream": True}) as r:
            await r.content.readline()
            r.close()
        await eventually(lambda: counted(gw, "kvgate_requests_total", model="tiny", worker=url, status="499") == 1)


def whole_answer(usage: dict[str, Any]) -> tuple[Any, bytes]:
    """A whole (non-streamed) answer reporting `usage`, and its body."""
    body = json.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a"}],
                       "usage": usage}).encode()  # json, not orjson: it writes integers of any size

    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body) + body)

    return answer, body


@pytest.mark.parametrize("prompt, cached", [
    (PROMPT, -CACHED), (-PROMPT, CACHED), (PROMPT, PROMPT + 1), (10**400, 10**400), (True, True), (PROMPT, 1.5),
], ids=["negative_cached", "negative_prompt", "more_cached_than_prompt", "beyond_64_bits", "booleans", "a_float"])
async def test_an_answer_reporting_impossible_usage_is_relayed_and_not_counted(http: aiohttp.ClientSession,
                                                                              prompt: Any, cached: Any) -> None:
    """A worker (one added at run time may be anyone's listener) whose `usage` cannot be an engine's: its answer
    reaches the client untouched and its figures count nowhere. A negative count made the gateway answer 500
    (prometheus_client's counters refuse to go down) and more cached than prompt tokens was counted."""
    answer, body = whole_answer({"prompt_tokens": prompt, "completion_tokens": 1,
                                 "prompt_tokens_details": {"cached_tokens": cached}})
    async with raw_worker(answer) as url, running_gateway([url]) as gw:
        await eventually(lambda: bool(gw.gateway.pool.healthy()))
        for _ in range(2):
            async with http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"}) as resp:
                assert (resp.status, await resp.read()) == (200, body)
        assert counted(gw, "kvgate_requests_total", model="tiny", worker=url, status="200") == 2
        assert counted(gw, "kvgate_usage_prompt_tokens_total", strategy="round_robin") == 0
        assert counted(gw, "kvgate_actual_cached_tokens_total", strategy="round_robin") == 0
        assert counted(gw, "kvgate_worker_reported_cached_tokens_total", worker=url) == 0
