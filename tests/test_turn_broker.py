"""The prefill turns of a gateway of several processes (router/turn_broker.py): real gateway processes in front of a
stand-in worker that counts long prefills in flight together, then the broker on its own with real clients on a
real Unix socket: order across processes, holds, a process that dies holding a turn, frames it cannot read, and a
broker that is not there or does not answer."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import struct
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import msgspec
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.procs import free_port, stop, wait_http
from bench.standin import STATS, StandinBehaviour
from router.metrics import GatewayMetrics
from router.turn_broker import TIMEOUT, UNREACHABLE, SharedPrefillTurns, TurnBroker
from tests.conftest import eventually, kvgate_command, running_standin

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 1024  # over ttft_serialize_prefill_tokens (512), and never cached: every request takes a turn
REQUESTS = 48
CONCURRENCY = 8


def _samples(text: str, name: str) -> dict[str, float]:
    """A metric's value per process, from the gateway's merged /metrics."""
    return {s.labels["process"]: s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


async def test_two_gateway_processes_send_a_worker_one_long_prefill_at_a_time(tmp_path: Path) -> None:
    """Before, each process kept its own turns: both processes routed long prefills and the worker had two before
    their first tokens at once, 29 and 31 of 48 requests (two runs) arrived beside another one's prefill (the holds,
    over a second each here, never ran out: every prefill took 20 ms). Now none (and no turn of a process's own)."""
    port = free_port()
    async with running_standin(StandinBehaviour(first_token_delay_s=0.02)) as worker:
        log = (tmp_path / "gateway.log").open("wb")
        # a prediction of half a second and more (its prior held): every hold over a second, so none runs out
        proc = subprocess.Popen(kvgate_command(
            "serve", "--host", "127.0.0.1", "--port", str(port), "--processes", "2", "--strategy", "ttft",
            "--worker", worker.url, "--ttft-prefill-tokens-per-s", "2000", "--ttft-prior-samples", "1000000",
            "--health-interval-s", "0.2"), stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            await asyncio.to_thread(wait_http, url + "/ready", 60.0, proc)

            async def metrics() -> str:
                async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
                    return await resp.text()

            for _ in range(200):  # both processes see the worker, and take their turns at the broker
                text = await metrics()
                if (_samples(text, "kvgate_worker_healthy") == {"0": 1.0, "1": 1.0}
                        and _samples(text, "kvgate_prefill_turns_shared") == {"0": 1.0, "1": 1.0}):
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"the processes did not come up: {text}")
            queue: asyncio.Queue[int] = asyncio.Queue()
            for k in range(REQUESTS):
                queue.put_nowait(k)

            async def client() -> None:
                while not queue.empty():
                    k = queue.get_nowait()
                    body = orjson.dumps({"model": "tiny", "prompt": list(range(k * 4096, k * 4096 + PROMPT_TOKENS)),
                                         "max_tokens": 2, "stream": True})
                    # a connection per request: the kernel spreads them over both processes
                    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http, \
                            http.post(url + "/v1/completions", data=body,
                                      headers={"Content-Type": "application/json"}) as resp:
                        assert resp.status == 200, await resp.text()
                        assert (await resp.read()).endswith(b"data: [DONE]\n\n")

            await asyncio.wait_for(asyncio.gather(*(client() for _ in range(CONCURRENCY))), 90)
            text = await metrics()
            held = _samples(text, "kvgate_prefill_hold_seconds_count")
            own = sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                      if s.name == "kvgate_prefill_turns_local_total")
        finally:
            os.kill(proc.pid, signal.SIGTERM)
            code = await asyncio.to_thread(proc.wait, 30)
            log.close()
            stop(proc)
        stats = worker.app[STATS]
        assert code == 0
        assert stats.completed == REQUESTS
        assert sum(held.values()) == REQUESTS and all(held.get(p, 0) > 0 for p in "01"), held  # each took turns
        # a request sent in a turn of its process's own (the broker gave no answer within 0.5 s: a stall of a loaded
        # machine) may meet another's prefill; none else may
        assert own <= REQUESTS / 8 and stats.prefill_overlaps <= own, \
            f"{stats.prefill_overlaps} of {REQUESTS} arrived beside another's prefill, {own} in turns of their own"


@pytest.fixture
def socket_path() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvgate-turns-") as folder:  # short: a Unix socket's path is <108 bytes
        yield os.path.join(folder, "turns.sock")


@pytest.fixture
async def broker(socket_path: str) -> AsyncIterator[TurnBroker]:
    broker = TurnBroker(socket_path)
    await broker.start()
    try:
        yield broker
    finally:
        await broker.close()


@asynccontextmanager
async def process_turns(path: str, *, connected: bool = True,
                        answer_timeout_s: float = 0.5) -> AsyncIterator[tuple[SharedPrefillTurns, GatewayMetrics]]:
    """One gateway process's turns at the broker on `path` (connected to it first, if `connected`)."""
    metrics = GatewayMetrics()
    turns = SharedPrefillTurns(path, metrics, answer_timeout_s=answer_timeout_s)
    turns.start()
    try:
        if connected:
            await eventually(lambda: turns.connected)
        yield turns, metrics
    finally:
        await turns.close()


def _local(metrics: GatewayMetrics, reason: str) -> float:
    return metrics.prefill_turns_local.labels(reason)._value.get()  # type: ignore[no-any-return]


async def test_turns_go_across_processes_in_the_order_taken(broker: TurnBroker) -> None:
    async with process_turns(broker.path) as (a, _), process_turns(broker.path) as (b, _):
        first = await a.take("w", 10.0)
        assert first.ticket is not None  # the broker's
        second = asyncio.ensure_future(b.take("w", 10.0))
        await eventually(lambda: broker.waiting() == 2)
        third = asyncio.ensure_future(a.take("w", 10.0))
        await eventually(lambda: broker.waiting() == 3)
        elsewhere = await asyncio.wait_for(b.take("w2", 10.0), 5.0)  # another engine's line: at once
        await asyncio.sleep(0.05)
        assert not second.done() and not third.done()
        a.release(first)
        taken = await asyncio.wait_for(second, 5.0)
        await asyncio.sleep(0.05)
        assert not third.done()  # the second, another process's, is now the one before it
        b.release(taken)
        a.release(await asyncio.wait_for(third, 5.0))
        b.release(elsewhere)
        b.release(elsewhere)  # a second release does nothing
        await eventually(lambda: broker.waiting() == 0)
        assert a.waiting() == b.waiting() == 0


async def test_a_take_that_leaves_hands_its_place_on(broker: TurnBroker) -> None:
    async with process_turns(broker.path) as (a, _), process_turns(broker.path) as (b, _):
        first = await a.take("w", 10.0)
        leaving = asyncio.ensure_future(b.take("w", 10.0))
        await eventually(lambda: broker.waiting() == 2)
        after = asyncio.ensure_future(a.take("w", 10.0))
        await eventually(lambda: broker.waiting() == 3)
        leaving.cancel()  # its client went away while it waited
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await eventually(lambda: broker.waiting() == 2)
        await asyncio.sleep(0.05)
        assert not after.done()  # still behind the first, not stuck behind the one that left
        a.release(first)
        a.release(await asyncio.wait_for(after, 5.0))
        await eventually(lambda: broker.waiting() == 0)


async def test_a_turn_never_released_holds_the_next_for_its_hold_only(broker: TurnBroker) -> None:
    async with process_turns(broker.path) as (a, _), process_turns(broker.path) as (b, metrics):
        await a.take("w", 0.3)  # sent, and its first chunk never comes
        started = asyncio.get_running_loop().time()
        turn = await asyncio.wait_for(b.take("w", 0.3), 5.0)
        assert asyncio.get_running_loop().time() - started >= 0.25
        assert turn.ticket is not None and _local(metrics, TIMEOUT) == 0


CHILD = """
import asyncio, sys
from router.metrics import GatewayMetrics
from router.turn_broker import SharedPrefillTurns

async def main():
    turns = SharedPrefillTurns(sys.argv[1], GatewayMetrics())
    turns.start()
    while not turns.connected:
        await asyncio.sleep(0.01)
    turn = await turns.take("w", 10.0)
    print("broker" if turn.ticket is not None else "own", flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_a_process_that_dies_holding_a_turn_gives_it_back(broker: TurnBroker) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD, broker.path], cwd=ROOT, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), 60.0)
        assert line == b"broker\n"
        async with process_turns(broker.path) as (b, _):
            waiting = asyncio.ensure_future(b.take("w", 10.0))
            await eventually(lambda: broker.waiting() == 2)
            assert not waiting.done()
            os.kill(child.pid, signal.SIGKILL)
            turn = await asyncio.wait_for(waiting, 5.0)  # not after the dead one's hold of 10 s
            assert turn.ticket is not None
            b.release(turn)
            await eventually(lambda: broker.waiting() == 0)
    finally:
        stop(child)


async def test_a_connection_that_sends_what_the_broker_cannot_read_is_dropped_and_the_rest_go_on(
        broker: TurnBroker) -> None:
    async with process_turns(broker.path) as (a, _), process_turns(broker.path) as (b, _):
        first = await a.take("w", 10.0)
        waiting = asyncio.ensure_future(b.take("w", 10.0))
        await eventually(lambda: broker.waiting() == 2)
        bad_frames = [
            b"\xff\xff\xff\xff",  # 4 GiB to come
            struct.pack(">I", 0),
            struct.pack(">I", 3) + b"\xc1\xc1\xc1",  # not msgpack
            struct.pack(">I", 2) + b"\x91\x01",  # msgpack, not a message
            _msgpack_frame(["take", 1, "w", float("nan")]),
            _msgpack_frame(["take", -1, "w", 1.0]),
            _msgpack_frame(["take", 1, "w", 1.0]) + _msgpack_frame(["take", 1, "w", 1.0]),  # a ticket twice
            struct.pack(">I", 100) + b"\x00",  # and then nothing more
        ]
        for frame in bad_frames:
            reader, writer = await asyncio.open_unix_connection(broker.path)
            writer.write(frame)
            rest = await asyncio.wait_for(reader.read(), 10.0)  # closed by the broker
            writer.close()
            assert b"granted" not in rest, frame
        await eventually(lambda: broker.waiting() == 2)  # what the dropped ones took, given back
        assert a.connected and b.connected and not waiting.done()
        a.release(first)
        b.release(await asyncio.wait_for(waiting, 5.0))
        await eventually(lambda: broker.waiting() == 0)


def _msgpack_frame(message: list[object]) -> bytes:
    body = msgspec.msgpack.encode(message)
    return struct.pack(">I", len(body)) + body


async def test_without_a_broker_a_process_takes_turns_of_its_own_and_says_so_once(
        socket_path: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="router.turn_broker")
    async with process_turns(socket_path, connected=False) as (turns, metrics):
        first = await asyncio.wait_for(turns.take("w", 10.0), 5.0)  # at once: nobody to ask
        assert first.ticket is None
        second = asyncio.ensure_future(turns.take("w", 10.0))
        await asyncio.sleep(0.05)
        assert not second.done()  # this process's own turns still go one at a time
        turns.release(first)
        turns.release(await asyncio.wait_for(second, 5.0))
        assert _local(metrics, UNREACHABLE) == 2
        assert metrics.prefill_turns_shared._value.get() == 0
        assert len([r for r in caplog.records if "cannot be reached" in r.getMessage()]) == 1
        broker = TurnBroker(socket_path)  # it comes up: the process connects again and takes its turns there
        await broker.start()
        try:
            await eventually(lambda: turns.connected, 10.0)
            turn = await asyncio.wait_for(turns.take("w", 10.0), 5.0)
            assert turn.ticket is not None and broker.waiting() == 1
            turns.release(turn)
            assert metrics.prefill_turns_shared._value.get() == 1
            assert any("answers again" in r.getMessage() for r in caplog.records)
        finally:
            await broker.close()
        await eventually(lambda: not turns.connected)  # gone again: its own turns at once
        turns.release(await asyncio.wait_for(turns.take("w", 10.0), 5.0))
        assert _local(metrics, UNREACHABLE) == 3


async def test_a_broker_that_does_not_answer_holds_no_request(socket_path: str) -> None:
    async def read_and_say_nothing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        writer.close()

    silent = await asyncio.start_unix_server(read_and_say_nothing, path=socket_path)
    try:
        async with process_turns(socket_path, answer_timeout_s=0.2) as (turns, metrics):
            turn = await asyncio.wait_for(turns.take("w", 10.0), 5.0)  # after 0.2 s: a turn of its own
            assert turn.ticket is None and _local(metrics, TIMEOUT) == 1
            turns.release(turn)
            assert turns.waiting() == 0
    finally:
        silent.close()
