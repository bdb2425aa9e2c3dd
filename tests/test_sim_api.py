"""The simulated replica's HTTP API, over a real `kvgate sim` process: vLLM's shapes, streaming, usage with
cached tokens, errors like vLLM's (and the replica keeps serving), metrics, tokenize, reset, disconnects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from bench.sim.launch import SimFleet, start_sim_fleet

MODEL = "tiny"
LONG = "The quick brown fox jumps over the lazy dog while the cat watches from the window sill. " * 6


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path) -> Iterator[SimFleet]:
    f = start_sim_fleet(1, tiny_model_dir, model=MODEL, speedup=20,
                        extra_args=["--max-model-len", "512", "--num-gpu-blocks-override", "200"])
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


async def post(client: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with client.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        raw = await resp.read()
        return resp.status, orjson.loads(raw) if raw else None


async def sse(client: aiohttp.ClientSession, url: str, body: Any) -> list[bytes]:
    async with client.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = await resp.read()
    assert raw.endswith(b"data: [DONE]\n\n")
    events = raw.split(b"\n\n")
    assert events[-1] == b""
    for e in events[:-1]:
        assert e.startswith(b"data: "), e
    return [e[len(b"data: "):] for e in events[:-2]]  # without [DONE]


async def test_completion_text_and_token_prompts(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    status, body = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 7})
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length" and choice["index"] == 0 and choice["text"]
    usage = body["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7
    status, tok = await post(client, url + "/tokenize", {"model": MODEL, "prompt": LONG})
    assert status == 200 and tok["count"] == usage["prompt_tokens"] == len(tok["tokens"])
    assert tok["max_model_len"] == 512
    # the same prompt as token ids: the same deterministic answer, and every full block but the last token hit
    status, again = await post(client, url + "/v1/completions",
                               {"model": MODEL, "prompt": tok["tokens"], "max_tokens": 7})
    assert status == 200 and again["choices"][0]["text"] == choice["text"]
    n = usage["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}
    # the default max_tokens of /v1/completions is 16, as vLLM's
    status, default = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": "hello"})
    assert status == 200 and default["usage"]["completion_tokens"] == 16
    # detokenize round trip
    status, detok = await post(client, url + "/detokenize", {"model": MODEL, "tokens": tok["tokens"]})
    assert status == 200 and LONG.strip() in detok["prompt"]
    # several prompts in one request: one choice each
    status, multi = await post(client, url + "/v1/completions",
                               {"model": MODEL, "prompt": ["one two", "three four"], "max_tokens": 2})
    assert status == 200 and [c["index"] for c in multi["choices"]] == [0, 1]
    assert multi["usage"]["completion_tokens"] == 4


async def test_chat_uses_the_chat_template(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": LONG}]
    status, tok = await post(client, url + "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200
    status, body = await post(client, url + "/v1/chat/completions",
                              {"model": MODEL, "messages": messages, "max_tokens": 3})
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant" and body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == tok["count"]
    # without max_tokens a chat answer ends naturally (EOS) after --output-len tokens (default 64)
    status, body = await post(client, url + "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert status == 200
    assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == 64
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, body = await post(client, url + "/v1/chat/completions",
                              {"model": MODEL, "messages": messages, "max_tokens": 80, "ignore_eos": True})
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 80


async def test_streaming_formats(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    req = {"model": MODEL, "prompt": "stream me", "max_tokens": 5}
    _, plain = await post(client, url + "/v1/completions", req)
    raw = await sse(client, url + "/v1/completions", {**req, "stream": True})
    chunks = [orjson.loads(c) for c in raw]
    # vLLM 0.32's fields in its order, compact JSON (pydantic's model_dump_json(exclude_unset=True))
    assert all(orjson.dumps(c) == r for c, r in zip(chunks, raw, strict=True))
    assert all(list(c) == ["id", "object", "created", "model", "choices"] for c in chunks)
    assert all(list(c["choices"][0]) == ["index", "text", "logprobs", "finish_reason", "stop_reason",
                                         "prompt_token_ids", "token_ids"] for c in chunks)
    assert len(chunks) == 5
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    with_usage = [orjson.loads(c) for c in await sse(client, url + "/v1/completions", {
        **req, "stream": True, "stream_options": {"include_usage": True}})]
    assert with_usage[-1]["choices"] == [] and with_usage[-1]["usage"]["completion_tokens"] == 5

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    raw = await sse(client, url + "/v1/chat/completions", chat)
    chunks = [orjson.loads(c) for c in raw]
    assert all(orjson.dumps(c) == r for c, r in zip(chunks, raw, strict=True))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert list(chunks[0]) == ["id", "object", "created", "model", "choices", "prompt_token_ids", "prompt_text"]
    assert list(chunks[1]["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "token_ids"]
    assert list(chunks[-2]["choices"][0]) == ["index", "delta", "logprobs", "finish_reason", "stop_reason",
                                              "token_ids"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = chunks[1:-1]
    assert len(content) == 4 and all("content" in c["choices"][0]["delta"] for c in content)
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


async def test_errors_like_vllm_and_replica_keeps_serving(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    status, body = await post(client, url + "/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and body["error"]["type"] == "NotFoundError" and "nope" in body["error"]["message"]
    status, body = await post(client, url + "/v1/completions", b'{"model": "tiny", "prompt": ')
    assert status == 400 and body["error"]["code"] == 400
    assert body["error"]["type"] == "Bad Request" and body["error"]["param"] == "body"
    status, body = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": list(range(600))})
    assert status == 400 and "maximum context length is 512" in body["error"]["message"]
    assert body["error"]["type"] == "BadRequestError"
    status, body = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": list(range(512))})
    assert status == 400 and "maximum model length of 512" in body["error"]["message"]
    # prompt + max_tokens beyond the context: vLLM 0.32 clamps max_tokens instead of refusing
    status, body = await post(client, url + "/v1/completions",
                              {"model": MODEL, "prompt": list(range(500)), "max_tokens": 100})
    assert status == 200 and body["usage"]["completion_tokens"] == 12
    # a long text (tokenized in a thread): refused with its exact token count
    big = "lorem ipsum dolor " * 1500
    _, tok = await post(client, url + "/tokenize", {"model": MODEL, "prompt": big})
    status, body = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": big})
    assert status == 400 and f"contains {tok['count']} input tokens" in body["error"]["message"]
    messages = [{"role": "user", "content": big}]
    _, tok = await post(client, url + "/tokenize", {"model": MODEL, "messages": messages})
    status, body = await post(client, url + "/v1/chat/completions", {"model": MODEL, "messages": messages})
    assert status == 400 and f"contains {tok['count']} input tokens" in body["error"]["message"]
    status, body = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "7"})
    assert status == 400
    status, body = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": [99999]})
    assert status == 400
    status, body = await post(client, url + "/v1/chat/completions", {"model": MODEL, "messages": "hello"})
    assert status == 400 and body["error"]["message"]
    status, body = await post(client, url + "/v1/completions", [1, 2])
    assert status == 400
    status, body = await post(client, url + "/v1/completions", {"model": MODEL, "prompt": "still up", "max_tokens": 1})
    assert status == 200


async def test_models_health_metrics(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    async with client.get(url + "/health") as resp:
        assert resp.status == 200
    async with client.get(url + "/v1/models") as resp:
        models = await resp.json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == 512
    await post(client, url + "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 2})
    async with client.get(url + "/metrics") as resp:
        text = await resp.text()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    labels = f'{{engine="0",model_name="{MODEL}"}}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_cached_total"):
        assert name + labels in samples, name
    assert samples["vllm:prompt_tokens_total" + labels] >= samples["vllm:prefix_cache_hits_total" + labels] > 0
    assert samples["vllm:generation_tokens_total" + labels] >= 2
    assert samples["vllm:time_to_first_token_seconds_count" + labels] >= 1
    assert samples["vllm:inter_token_latency_seconds_count" + labels] >= 1   # the 2-token answer had one gap
    assert 0 < samples["vllm:prompt_tokens_cached_total" + labels] <= samples["vllm:prefix_cache_hits_total" + labels]
    assert samples["vllm:num_requests_running" + labels] == 0


async def test_reset_prefix_cache(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    req = {"model": MODEL, "prompt": "reset " + LONG, "max_tokens": 1}
    await post(client, url + "/v1/completions", req)
    _, body = await post(client, url + "/v1/completions", req)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    async with client.post(url + "/reset_prefix_cache") as resp:
        assert resp.status == 200 and await resp.json() == {"success": True}
    async with client.get(url + "/sim/blocks") as resp:
        assert (await resp.json())["hashes"] == []
    _, body = await post(client, url + "/v1/completions", req)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # refused while a request holds blocks (as vLLM), unless running requests are preempted first
    long_req = {"model": MODEL, "prompt": "busy " + LONG, "max_tokens": 300}
    task = asyncio.ensure_future(post(client, url + "/v1/completions", long_req))
    for _ in range(100):
        async with client.get(url + "/sim/blocks") as resp:
            if (await resp.json())["running"]:
                break
        await asyncio.sleep(0.01)
    async with client.post(url + "/reset_prefix_cache") as resp:
        assert await resp.json() == {"success": False}
    async with client.post(url + "/reset_prefix_cache?reset_running_requests=true") as resp:
        assert await resp.json() == {"success": True}
    status, body = await task   # the preempted request recomputes and completes
    assert status == 200 and body["usage"]["completion_tokens"] == 300


async def test_cache_salt_and_return_token_ids(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    prompt = list(range(700, 760))
    base = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "return_token_ids": True}
    _, first = await post(client, url + "/v1/completions", {**base, "cache_salt": "tenant-a"})
    choice = first["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 3
    _, other = await post(client, url + "/v1/completions", {**base, "cache_salt": "tenant-b"})
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0     # another tenant shares nothing
    _, same = await post(client, url + "/v1/completions", {**base, "cache_salt": "tenant-a"})
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    status, body = await post(client, url + "/v1/completions", {**base, "cache_salt": ""})
    assert status == 400
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "ids please"}], "max_tokens": 2,
            "return_token_ids": True}
    _, body = await post(client, url + "/v1/chat/completions", chat)
    status, tok = await post(client, url + "/tokenize", {"model": MODEL, "messages": chat["messages"]})
    assert body["prompt_token_ids"] == tok["tokens"] and len(body["choices"][0]["token_ids"]) == 2


async def test_client_disconnect_aborts_the_request(fleet: SimFleet, client: aiohttp.ClientSession) -> None:
    url = fleet.urls[0]
    body = {"model": MODEL, "prompt": "long answer", "max_tokens": 400, "stream": True}
    async with client.post(url + "/v1/completions", json=body) as resp:
        await resp.content.readline()   # the first chunk arrived: the request is running
    # the connection is closed: the engine must drop the request and free its blocks
    for _ in range(100):
        async with client.get(url + "/sim/blocks") as r:
            state = await r.json()
        if state["running"] == 0 and state["waiting"] == 0:
            break
        await asyncio.sleep(0.05)
    assert state["running"] == 0 and state["num_free_blocks"] == state["num_gpu_blocks"] - 1


async def test_a_dead_engine_answers_500_and_releases_waiters(tiny_model_dir: Path,
                                                               client: aiohttp.ClientSession) -> None:
    """If the step loop dies (a bug), waiting requests are released and /health says 500, as vLLM's does."""
    import argparse
    import dataclasses

    from aiohttp import web

    from bench.procs import free_port
    from bench.sim.cli import add_arguments
    from bench.sim.config import replica_config
    from bench.sim.perf_model import PROFILES
    from bench.sim.server import create_replica_app

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model-dir", str(tiny_model_dir), "--served-model-name", MODEL, "--no-kv-events"])
    broken = dataclasses.replace(PROFILES["llama-3.1-8b-h100"], model=None)  # type: ignore[arg-type]
    # step_time raises on the missing model: the step loop dies at the first request
    config = dataclasses.replace(replica_config(args, 0), profile=broken, port=free_port())
    runner = web.AppRunner(create_replica_app(config))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", config.port).start()
    try:
        status, body = await post(client, config.url + "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 500 and body["error"]["type"] == "EngineDeadError"
        async with client.get(config.url + "/health") as resp:
            assert resp.status == 500
        status, _ = await post(client, config.url + "/v1/completions", {"model": MODEL, "prompt": "y"})
        assert status == 500
    finally:
        await runner.cleanup()
