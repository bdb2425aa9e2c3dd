"""The gateway foundation end to end: real stand-in workers and the gateway on loopback, real HTTP clients."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import subprocess
import time
from typing import Any

import aiohttp
import openai
import orjson
import pytest

from bench.procs import free_port, stop, wait_for_port
from bench.standin import StandinBehaviour
from kvgate.serve import assemble
from router.app import GATEWAY, GC_YOUNG_THRESHOLD, run_gateway
from router.config import WorkerSpec
from tests.conftest import eventually, kvgate_command, running_gateway, running_standin


async def post(http: aiohttp.ClientSession, url: str, body: Any, **kw: Any) -> tuple[int, Any]:
    async with http.post(url, json=body, **kw) as resp:
        return resp.status, await resp.json(content_type=None)


COMPLETION = {"model": "tiny", "prompt": "hello", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}


async def test_openai_client_completions_chat_and_streaming() -> None:
    async with running_standin() as w1, running_standin() as w2, running_gateway([w1.url, w2.url]) as gw:
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
        completion = await client.completions.create(model="tiny", prompt="hi", max_tokens=3)
        assert completion.choices[0].text == " t0 t1 t2"
        chat = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].message.content == " t0 t1"
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True
        )
        pieces = [chunk.choices[0].delta.content async for chunk in stream]
        assert "".join(p for p in pieces if p) == " t0 t1 t2 t3 t4"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        await client.close()
        # round_robin spread the three generation requests over both workers
        assert w1.stats.completed + w2.stats.completed == 3
        assert w1.stats.completed >= 1 and w2.stats.completed >= 1


async def test_sse_relayed_byte_for_byte(http: aiohttp.ClientSession) -> None:
    body = {**COMPLETION, "stream": True, "max_tokens": 20}
    async with running_standin() as worker, running_gateway([worker.url]) as gw:
        async with http.post(worker.url + "/v1/completions", json=body) as resp:
            direct = await resp.read()
        async with http.post(gw.url + "/v1/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            relayed = await resp.read()
    assert relayed == direct
    assert relayed.endswith(b"data: [DONE]\n\n")


async def test_first_byte_arrives_before_long_stream_ends(http: aiohttp.ClientSession) -> None:
    behaviour = StandinBehaviour(token_delay_s=0.05)
    async with running_standin(behaviour) as worker, running_gateway([worker.url]) as gw:
        started = time.perf_counter()
        async with http.post(gw.url + "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 40}) as r:
            first = await r.content.readany()
            first_at = time.perf_counter() - started
            rest = await r.read()
            total = time.perf_counter() - started
    assert first.startswith(b"data: ")
    assert b"[DONE]" in first + rest
    assert total > 1.5  # 39 pauses of 50 ms
    assert first_at < 0.5, f"first byte after {first_at:.3f} s of a {total:.3f} s stream"


async def test_models_union_and_routing_by_model(http: aiohttp.ClientSession) -> None:
    async with (
        running_standin(StandinBehaviour(models=["a", "b"])) as wab,
        running_standin(StandinBehaviour(models=["b", "c"])) as wbc,
        running_gateway([wab.url, wbc.url]) as gw,
    ):
        async with http.get(gw.url + "/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["a", "b", "c"]
        for _ in range(4):
            assert (await post(http, gw.url + "/v1/completions", {**COMPLETION, "model": "a"}))[0] == 200
            assert (await post(http, gw.url + "/v1/completions", {**COMPLETION, "model": "c"}))[0] == 200
        assert wab.stats.last_body["model"] == "a"
        assert wbc.stats.last_body["model"] == "c"
        assert wab.stats.completed == 4 and wbc.stats.completed == 4


async def test_passthrough_paths(http: aiohttp.ClientSession) -> None:
    async with running_standin() as worker, running_gateway([worker.url]) as gw:
        status, body = await post(http, gw.url + "/tokenize", {"model": "tiny", "prompt": "ab"})
        assert status == 200 and body["tokens"] == [97, 98]
        status, body = await post(http, gw.url + "/detokenize", {"model": "tiny", "tokens": [97, 98]})
        assert status == 200 and body["prompt"] == "ab"
        status, body = await post(http, gw.url + "/tokenize", {"model": "nope", "prompt": "ab"})
        assert status == 404 and body["error"]["code"] == "model_not_found"


async def test_health_ready_admin_and_metrics(http: aiohttp.ClientSession) -> None:
    async with running_standin() as worker, running_gateway([worker.url]) as gw:
        async with http.get(gw.url + "/health") as resp:
            assert resp.status == 200
        async with http.get(gw.url + "/ready") as resp:
            assert resp.status == 200
        await post(http, gw.url + "/v1/completions", COMPLETION)
        async with http.get(gw.url + "/admin/workers") as resp:
            (row,) = (await resp.json())["workers"]
        assert row["url"] == worker.url and row["healthy"] and row["models"] == ["tiny"]
        assert row["requests_routed"] == 1 and row["in_flight"] == 0 and row["last_error"] is None
        async with http.get(gw.url + "/metrics") as resp:
            text = await resp.text()
        for name in (
            'kvgate_requests_total{model="tiny",status="200",worker="' + worker.url + '"} 1.0',
            "kvgate_request_duration_seconds_count",
            "kvgate_time_to_first_byte_seconds_count",
            "kvgate_worker_in_flight_requests",
            'kvgate_worker_healthy{worker="' + worker.url + '"} 1.0',
            'kvgate_routing_decisions_total{reason="rotation",strategy="round_robin"} 1.0',
        ):
            assert name in text, name


async def test_bad_input_answered_and_gateway_keeps_serving(http: aiohttp.ClientSession) -> None:
    async with running_standin() as worker, running_gateway([worker.url], max_body_bytes=10_000) as gw:
        url = gw.url + "/v1/completions"
        cases: list[tuple[str, bytes, int, str]] = [
            (url, b"{not json", 400, "invalid_json"),
            (url, b"", 400, "invalid_json"),
            (url, b"[1, 2]", 400, "invalid_json"),
            (url, b'{"prompt": "x"}', 400, "missing_model"),
            (url, b'{"model": 5, "prompt": "x"}', 400, "invalid_model"),
            (url, b'{"model": "tiny"}', 400, "missing_prompt"),
            (url, b'{"model": "tiny", "prompt": {"a": 1}}', 400, "invalid_prompt"),
            (url, b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400, "invalid_stream"),
            (url, b'{"model": "tiny", "prompt": "x", "max_tokens": "9"}', 400, "invalid_max_tokens"),
            (url, b'{"model": "ghost", "prompt": "x"}', 404, "model_not_found"),
            (url, b'{"model": "tiny", "prompt": "' + b"x" * 20_000 + b'"}', 413, "body_too_large"),
            (gw.url + "/v1/chat/completions", b'{"model": "tiny"}', 400, "missing_messages"),
            (gw.url + "/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, "invalid_messages"),
            (gw.url + "/v1/chat/completions", b'{"model": "tiny", "messages": [{"content": "x"}]}', 400,
             "invalid_messages"),
        ]
        for target, body, status, code in cases:
            async with http.post(target, data=body, headers={"Content-Type": "application/json"}) as resp:
                payload = await resp.json(content_type=None)
                assert resp.status == status, (body[:60], resp.status, payload)
                assert payload["error"]["code"] == code
                assert payload["error"]["message"] and payload["error"]["type"]
        async with http.get(gw.url + "/v1/completions") as resp:
            assert resp.status == 405 and "error" in await resp.json()
        async with http.get(gw.url + "/nowhere") as resp:
            assert resp.status == 404 and "error" in await resp.json()
        # chunked upload without Content-Length over the limit is still refused with JSON
        async def chunks() -> Any:
            for _ in range(30):
                yield b"x" * 1000
        async with http.post(url, data=chunks()) as resp:
            assert resp.status == 413 and (await resp.json())["error"]["code"] == "body_too_large"
        assert (await post(http, url, COMPLETION))[0] == 200
        assert worker.stats.requests == 1  # nothing invalid reached the worker


async def test_no_healthy_worker_502_and_504(http: aiohttp.ClientSession) -> None:
    async with running_standin() as w1, running_standin() as w2, running_gateway(
        [w1.url, w2.url], response_timeout_s=0.5
    ) as gw:
        url = gw.url + "/v1/completions"
        # every worker answers 503: retried on the other, then 502
        w1.behaviour.fail_status = w2.behaviour.fail_status = 503
        status, body = await post(http, url, COMPLETION)
        assert status == 502 and body["error"]["code"] == "upstream_failed"
        assert w1.stats.requests == 1 and w2.stats.requests == 1
        w1.behaviour.fail_status = w2.behaviour.fail_status = 0
        # a worker that does not answer in time: 504
        w1.behaviour.first_token_delay_s = w2.behaviour.first_token_delay_s = 2.0
        started = time.monotonic()
        status, body = await post(http, url, COMPLETION)
        assert status == 504 and body["error"]["code"] == "upstream_timeout"
        assert time.monotonic() - started < 1.5  # response_timeout_s 0.5, swept every 50 ms (router/deadlines.py)
        assert len(gw.app[GATEWAY].proxy.deadlines) == 0  # every request's deadlines disarmed
        w1.behaviour.first_token_delay_s = w2.behaviour.first_token_delay_s = 0.0
        # health probes fail everywhere: workers are ejected, 503 with Retry-After
        w1.behaviour.healthy = w2.behaviour.healthy = False
        await eventually(lambda: not gw.gateway.pool.healthy())
        async with http.post(url, json=COMPLETION) as resp:
            assert resp.status == 503 and resp.headers["Retry-After"]
            assert (await resp.json())["error"]["code"] == "no_healthy_worker"
        async with http.get(gw.url + "/ready") as resp:
            assert resp.status == 503
        # probes pass again: re-admitted, serving
        w1.behaviour.healthy = w2.behaviour.healthy = True
        await eventually(lambda: len(gw.gateway.pool.healthy()) == 2)
        assert (await post(http, url, COMPLETION))[0] == 200


async def test_api_keys_and_admin_key(http: aiohttp.ClientSession) -> None:
    async with running_standin() as worker, running_gateway(
        [worker.url], api_key=["k1", "k2"], admin_key="adm"
    ) as gw:
        url = gw.url + "/v1/completions"
        status, body = await post(http, url, COMPLETION)
        assert status == 401 and body["error"]["type"] == "authentication_error"
        assert (await post(http, url, COMPLETION, headers={"Authorization": "Bearer bad"}))[0] == 401
        assert (await post(http, url, COMPLETION, headers={"Authorization": "Bearer k2"}))[0] == 200
        async with http.get(gw.url + "/admin/workers", headers={"Authorization": "Bearer k1"}) as resp:
            assert resp.status == 401
        async with http.get(gw.url + "/admin/workers", headers={"Authorization": "Bearer adm"}) as resp:
            assert resp.status == 200
        async with http.get(gw.url + "/health") as resp:
            assert resp.status == 200


async def test_client_disconnect_cancels_upstream(http: aiohttp.ClientSession) -> None:
    behaviour = StandinBehaviour(token_delay_s=0.1)
    async with running_standin(behaviour) as worker, running_gateway([worker.url]) as gw:
        # streaming: read one chunk, then hang up
        async with http.post(gw.url + "/v1/completions", json={**COMPLETION, "stream": True, "max_tokens": 100}) as r:
            await r.content.readany()
        await eventually(lambda: worker.stats.cancelled == 1, timeout=3)
        # non-streaming: give up before the answer
        task = asyncio.create_task(post(http, gw.url + "/v1/completions", {**COMPLETION, "max_tokens": 100}))
        await eventually(lambda: worker.stats.requests == 2, timeout=3)
        task.cancel()
        await eventually(lambda: worker.stats.cancelled == 2, timeout=3)
        assert worker.stats.completed == 0
        await eventually(lambda: gw.gateway.pool.all()[0].in_flight == 0, timeout=3)


async def test_least_load_avoids_busy_worker(http: aiohttp.ClientSession) -> None:
    async with running_standin() as busy, running_standin() as idle, running_gateway(
        [busy.url, idle.url], strategy="least_load"
    ) as gw:
        busy.behaviour.first_token_delay_s = 5.0
        slow: list[asyncio.Task[Any]] = []
        while busy.stats.requests == 0:  # ties are random: send until one request is stuck on the busy worker
            slow.append(asyncio.create_task(post(http, gw.url + "/v1/completions", COMPLETION)))
            await eventually(lambda: busy.stats.requests + idle.stats.requests == len(slow))
        sent_to_idle = idle.stats.requests
        for _ in range(6):
            assert (await post(http, gw.url + "/v1/completions", COMPLETION))[0] == 200
        assert busy.stats.requests == 1 and idle.stats.requests == sent_to_idle + 6
        for task in slow:
            task.cancel()


async def test_admin_add_remove_with_drain(http: aiohttp.ClientSession) -> None:
    async with running_standin() as w1, running_standin() as w2, running_gateway([w1.url]) as gw:
        admin = gw.url + "/admin/workers"
        status, body = await post(http, admin, {"url": w2.url})
        assert status == 201 and body["healthy"] and body["models"] == ["tiny"]
        assert (await post(http, admin, {"url": w2.url}))[0] == 409
        assert (await post(http, admin, {"url": "ftp://x"}))[0] == 400
        # a slow request in flight on w1, then w1 is removed: it finishes, new requests go to w2 only
        w1.behaviour.first_token_delay_s = 0.6
        w2.behaviour.first_token_delay_s = 0.6
        slow = asyncio.create_task(post(http, gw.url + "/v1/completions", COMPLETION))
        await eventually(lambda: w1.stats.requests == 1)
        w2.behaviour.first_token_delay_s = 0.0
        async with http.delete(admin, params={"url": w1.url}) as resp:
            assert resp.status == 202 and (await resp.json())["draining"] == 1
        for _ in range(3):
            assert (await post(http, gw.url + "/v1/completions", COMPLETION))[0] == 200
        assert w1.stats.requests == 1 and w2.stats.completed == 3
        assert (await slow)[0] == 200
        await eventually(lambda: gw.gateway.pool.get(w1.url) is None)
        async with http.delete(admin, params={"url": w1.url}) as resp:
            assert resp.status == 404


@pytest.mark.timeout(60)
async def test_failover_when_a_worker_dies(http: aiohttp.ClientSession, subprocess_env: dict[str, str]) -> None:
    """Kill a worker process mid-run: unanswered requests go to the other worker, zero client errors."""
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(kvgate_command("standin", "--port", str(p), "--token-delay-s", "0.02"), env=subprocess_env)
        for p in ports
    ]
    try:
        for proc, port in zip(procs, ports, strict=True):
            wait_for_port(port, 20, proc)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        async with running_gateway(urls, health_interval_s=0.2) as gw:
            url = gw.url + "/v1/completions"
            statuses: list[int] = []

            async def client(n: int) -> None:
                for _ in range(n):
                    statuses.append((await post(http, url, {**COMPLETION, "max_tokens": 10}))[0])

            clients = [asyncio.create_task(client(15)) for _ in range(8)]
            await eventually(lambda: len(statuses) >= 20)
            procs[0].kill()
            await asyncio.gather(*clients)
            assert len(statuses) == 120 and set(statuses) == {200}
            dead = gw.gateway.pool.get(urls[0])
            assert dead is not None and not dead.healthy and dead.last_error
            # bring it back on the same port: re-admitted by the probe
            procs[0] = subprocess.Popen(
                kvgate_command("standin", "--port", str(ports[0])), env=subprocess_env
            )
            wait_for_port(ports[0], 20, procs[0])
            await eventually(lambda: dead.healthy, timeout=10)
            routed = dead.routed
            for _ in range(4):
                assert (await post(http, url, COMPLETION))[0] == 200
            assert dead.routed > routed
    finally:
        for proc in procs:
            stop(proc)


async def test_slow_body_times_out_with_408_and_gateway_keeps_serving(http: aiohttp.ClientSession) -> None:
    async with running_standin() as worker, running_gateway([worker.url], body_timeout_s=0.3) as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"model\": ")  # and then nothing more
        await writer.drain()
        head = await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        assert head.startswith(b"HTTP/1.1 408") and b"body_timeout" in head
        assert (await post(http, gw.url + "/v1/completions", COMPLETION))[0] == 200


async def test_a_body_that_arrived_whole_is_read_at_once_and_still_bounded(http: aiohttp.ClientSession) -> None:
    """A body that came in with its headers is taken from the buffer without arming the body timeout; a chunked one
    (no Content-Length to refuse it by) over `max_body_bytes` is still a 413, one under it reaches the worker."""
    async with running_standin() as worker, running_gateway([worker.url], max_body_bytes=10_000) as gw:
        port = int(gw.url.rsplit(":", 1)[1])

        async def send_chunked(body: bytes) -> bytes:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n" + f"{len(body):x}\r\n".encode() + body
                         + b"\r\n0\r\n\r\n")  # all of it in one write
            await writer.drain()
            head = await asyncio.wait_for(reader.read(65536), 5)
            writer.close()
            return head

        big = b'{"model": "tiny", "prompt": "' + b"x" * 20_000 + b'"}'
        head = await send_chunked(big)
        assert head.startswith(b"HTTP/1.1 413") and b"body_too_large" in head, head[:200]
        assert worker.stats.requests == 0
        head = await send_chunked(orjson.dumps({**COMPLETION, "prompt": "y" * 5_000}))
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        assert worker.stats.requests == 1
        assert (await post(http, gw.url + "/v1/completions", COMPLETION))[0] == 200


async def test_serving_process_freezes_what_start_up_made(http: aiohttp.ClientSession) -> None:
    """What start-up made lives as long as the process; left to the cycle collector, each full collection walked
    it (60,000 objects: 30-150 ms with the GIL held, `/health` waiting behind it). Young collections run less
    often than Python's default."""
    async with running_standin() as worker:
        config, strategy = assemble({"host": "127.0.0.1", "port": free_port(),
                                     "worker": [WorkerSpec.parse(worker.url)]})
        gc.unfreeze()
        threshold = gc.get_threshold()
        task = asyncio.create_task(run_gateway(config, strategy))
        try:
            async def answers() -> bool:
                try:
                    async with http.get(f"http://127.0.0.1:{config.port}/health") as resp:
                        return resp.status == 200
                except aiohttp.ClientError:
                    return False

            deadline = time.monotonic() + 20
            while not await answers():
                assert time.monotonic() < deadline, "the gateway did not serve"
                await asyncio.sleep(0.05)
            assert gc.get_freeze_count() > 1000
            assert gc.get_threshold()[0] == GC_YOUNG_THRESHOLD
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            gc.unfreeze()
            gc.set_threshold(*threshold)
