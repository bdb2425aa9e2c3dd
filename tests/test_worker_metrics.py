"""A worker's `/metrics` page that no engine could have written (a broken exporter, a worker added at run time that
is anyone's listener): the gateway keeps routing every request, on every strategy, and keeps the worker's last
sensible load. A NaN load made the strategies' comparisons all false and every request a 500."""

from __future__ import annotations

import asyncio
import math

import aiohttp
import orjson
import pytest

from router.pool import LOAD_GAUGES, parse_cache_config, parse_load_gauges
from tests.abuse_servers import raw_worker
from tests.conftest import eventually, running_gateway

BODY = orjson.dumps({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "a"}]})


async def answer(writer: asyncio.StreamWriter) -> None:
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY)


def page(value: str) -> bytes:
    """A `/metrics` page with every load gauge the gateway reads at `value`."""
    return "".join(f"{name} {value}\n" for name in LOAD_GAUGES).encode()


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-5"])
@pytest.mark.parametrize("strategy", ["least_load", "prefix", "kv", "ttft"])
async def test_a_worker_reporting_impossible_load_does_not_stop_routing(http: aiohttp.ClientSession, strategy: str,
                                                                       value: str) -> None:
    async with raw_worker(answer, metrics=page(value)) as odd, raw_worker(answer) as plain, \
            running_gateway([odd, plain], strategy=strategy) as gw:
        worker = gw.gateway.pool.get(odd)
        assert worker is not None
        await eventually(lambda: len(gw.gateway.pool.healthy()) == 2 and worker.load_scraped_at > 0)
        for i in range(4):
            async with http.post(gw.url + "/v1/completions", json={"model": "tiny", "prompt": f"{i} " * 50}) as resp:
                assert (resp.status, await resp.read()) == (200, BODY)
        assert (worker.running, worker.waiting, worker.kv_usage, worker.prefill_seconds) == (0, 0, 0, 0)
        async with http.get(gw.url + "/metrics") as resp:
            assert resp.status == 200


def test_only_loads_an_engine_could_report_are_read() -> None:
    text = ("vllm:num_requests_waiting{engine=\"0\"} 3\nvllm:num_requests_waiting{engine=\"1\"} 4\n"
            "vllm:num_requests_running NaN\nvllm:kv_cache_usage_perc 7.5\n"
            "vllm:request_prefill_time_seconds_sum 1e308\nvllm:request_prefill_time_seconds_sum 1e308\n"
            "vllm:prefix_cache_hits_total -1\n")
    values = parse_load_gauges(text)
    assert values["waiting"] == 7 and values["kv_usage"] == 1.0  # a fraction of the cache: at most all of it
    assert "running" not in values and "prefill_seconds" not in values and "prefix_hits" not in values
    assert values["prefill_requests"] == 0  # absent: none yet
    assert all(math.isfinite(v) for v in values.values())


@pytest.mark.parametrize("blocks, size, expected", [
    ("27000", "16", (27000, 16)), ("0", "16", None), ("-3", "16", None), ("100", "0", None), ("None", "16", None),
])
def test_a_cache_size_is_read_only_when_it_is_one(blocks: str, size: str, expected: tuple[int, int] | None) -> None:
    text = f'vllm:cache_config_info{{block_size="{size}",num_gpu_blocks="{blocks}"}} 1.0\n'
    assert parse_cache_config(text) == expected
