"""`kvgate serve --processes N` (router/processes.py): N real gateway processes on one port, their metrics
gathered into one answer, a fixed pool, and a clean stop; and a gateway's stop on SIGTERM, one process or N."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.overhead import _descendants
from bench.procs import free_port, stop, wait_http
from bench.standin import StandinBehaviour
from kvcore.config import ConfigError
from router.config import GatewayConfig
from router.processes import merge_expositions
from tests.conftest import kvgate_command, running_standin

BODY = orjson.dumps({"model": "tiny", "prompt": "hello processes", "max_tokens": 2})


@pytest.fixture
def gateway_port() -> Iterator[int]:
    yield free_port()


async def test_two_processes_share_the_port_and_answer_metrics_together(tmp_path: Path, gateway_port: int) -> None:
    async with running_standin() as a, running_standin() as b:
        log = (tmp_path / "gateway.log").open("wb")
        proc = subprocess.Popen(kvgate_command(
            "serve", "--host", "127.0.0.1", "--port", str(gateway_port), "--processes", "2", "--strategy", "prefix",
            "--worker", a.url, "--worker", b.url, "--log-level", "info"), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{gateway_port}"
        try:
            await asyncio.to_thread(wait_http, url + "/ready", 60.0, proc)
            children = _descendants(proc.pid)[1:]
            assert len(children) >= 2

            async def both_up() -> bool:
                async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
                    text = await resp.text()
                return all(f'kvgate_worker_healthy{{process="{i}",worker="{a.url}"}} 1.0' in text for i in (0, 1))

            for _ in range(100):
                if await both_up():
                    break
                await asyncio.sleep(0.1)
            # a new connection per request: the kernel spreads them over both processes
            for _ in range(60):
                async with aiohttp.ClientSession() as http, http.post(
                        url + "/v1/completions", data=BODY, headers={"Content-Type": "application/json"}) as resp:
                    assert resp.status == 200
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/metrics") as resp:
                    text = await resp.text()
                async with http.post(url + "/admin/workers", json={"worker": "http://127.0.0.1:1"}) as resp:
                    assert resp.status == 409
                    assert (await resp.json())["error"]["code"] == "pool_is_fixed"
            families = {f.name: f for f in text_string_to_metric_families(text)}  # a valid exposition
            served: dict[str, float] = {}
            for sample in families["kvgate_requests"].samples:
                if sample.name == "kvgate_requests_total":
                    served[sample.labels["process"]] = served.get(sample.labels["process"], 0) + sample.value
            assert set(served) == {"0", "1"} and all(v > 0 for v in served.values()), served
            assert sum(served.values()) >= 60
            assert text.count("# TYPE kvgate_requests_total counter") == 1
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            assert await asyncio.to_thread(proc.wait, 30) == 0
            log.close()
            stop(proc)
        # every child ends with its parent: some (multiprocessing's resource tracker) notice its exit a moment later
        left = await asyncio.to_thread(_still_running, children, 10.0)
        assert not left, [_cmdline(pid) for pid in left]


@pytest.mark.parametrize("processes", [1, 2])
async def test_sigterm_lets_the_streams_in_flight_finish_and_takes_no_new_connection(tmp_path: Path, gateway_port: int,
                                                                                     processes: int) -> None:
    """A rolling restart: SIGTERM closes the listening socket at once (the load balancer's next connection goes to
    another gateway), every stream already relayed is relayed to its end, and the gateway then exits 0."""
    tokens = 60
    async with running_standin(StandinBehaviour(token_delay_s=0.05)) as worker:
        log = (tmp_path / "gateway.log").open("wb")
        proc = subprocess.Popen(kvgate_command(
            "serve", "--host", "127.0.0.1", "--port", str(gateway_port), "--processes", str(processes),
            "--worker", worker.url), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{gateway_port}"
        body = orjson.dumps({"model": "tiny", "prompt": "a stream through a restart", "max_tokens": tokens,
                             "stream": True})
        try:
            await asyncio.to_thread(wait_http, url + "/ready", 60.0, proc)
            async with aiohttp.ClientSession() as http, http.post(
                    url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200
                first = await resp.content.readuntil(b"\n\n")
                assert first.startswith(b"data: ")
                proc.send_signal(signal.SIGTERM)
                refused = False
                for _ in range(100):  # the listener closes within moments, while the stream goes on
                    try:
                        async with aiohttp.ClientSession() as other, other.get(url + "/health") as probe:
                            await probe.read()
                    except aiohttp.ClientConnectionError:
                        refused = True
                        break
                    await asyncio.sleep(0.02)
                assert refused, "a new connection was still taken 2 s after SIGTERM"
                rest = await resp.content.read()
            events = (first + rest).split(b"\n\n")
            assert events[-2] == b"data: [DONE]" and len(events) == tokens + 2, events[-3:]
            assert await asyncio.to_thread(proc.wait, 30) == 0
        finally:
            log.close()
            stop(proc)


def _still_running(pids: list[int], timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := [pid for pid in pids if not _gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except FileNotFoundError:
        return f"{pid} (gone)"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" in f.read().lower()
    except FileNotFoundError:
        return True


def test_merged_expositions_keep_each_family_whole() -> None:
    one = (b'# HELP a_total A\n# TYPE a_total counter\na_total{x="1"} 1.0\n# HELP g G\n# TYPE g gauge\ng 2.0\n')
    two = b'# HELP a_total A\n# TYPE a_total counter\na_total{x="1"} 3.0\n# HELP g G\n# TYPE g gauge\ng 4.0\n'
    merged = merge_expositions({0: one, 1: two}).decode()
    assert merged == ('# HELP a_total A\n# TYPE a_total counter\na_total{process="0",x="1"} 1.0\n'
                      'a_total{process="1",x="1"} 3.0\n# HELP g G\n# TYPE g gauge\ng{process="0"} 2.0\n'
                      'g{process="1"} 4.0\n')
    assert len(list(text_string_to_metric_families(merged))) == 2


def test_processes_refuse_what_they_cannot_share() -> None:
    with pytest.raises(ConfigError, match="record_trace"):
        GatewayConfig(processes=2, record_trace="/tmp/trace.jsonl")
    with pytest.raises(ConfigError, match="fixed port"):
        GatewayConfig(processes=2, port=0)
    with pytest.raises(ConfigError):
        GatewayConfig(processes=0)
