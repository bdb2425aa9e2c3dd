"""`kvcore.aio.WorkerThreads`: results and exceptions reach the awaiting task, work runs off the event loop and in
parallel up to the thread count, a cancelled call's result is dropped, closing lets the threads end."""

from __future__ import annotations

import asyncio
import threading
import time

import aiohttp
import pytest

from kvcore.aio import WorkerThreads
from tests.conftest import running_gateway, running_standin


async def test_results_and_errors_come_back_from_the_threads() -> None:
    threads = WorkerThreads(2, "test-work")
    loop_thread = threading.get_ident()
    assert await threads.run(lambda a, b: (a + b, threading.get_ident()), 2, 3) != (5, loop_thread)
    assert (await threads.run(lambda a, b: a + b, 2, 3)) == 5
    with pytest.raises(ZeroDivisionError):
        await threads.run(lambda: 1 / 0)
    threads.close()


async def test_the_loop_keeps_running_and_threads_work_in_parallel() -> None:
    threads = WorkerThreads(2, "test-work")
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.perf_counter()
    await asyncio.gather(threads.run(time.sleep, 0.2), threads.run(time.sleep, 0.2))
    took = time.perf_counter() - started
    task.cancel()
    assert took < 0.35, took  # two sleeps side by side, not one after the other
    assert ticks > 10, ticks
    threads.close()


async def test_a_cancelled_call_is_dropped_and_close_ends_the_threads() -> None:
    threads = WorkerThreads(1, "test-work")
    release = threading.Event()
    blocker = threads.run(release.wait, 5)
    queued = threads.run(lambda: "never seen")
    queued.cancel()
    release.set()
    assert await blocker is True
    assert (await threads.run(lambda: "after")) == "after"
    running = list(threads._threads)
    threads.close()
    for thread in running:
        thread.join(5)
        assert not thread.is_alive()
    with pytest.raises(RuntimeError):
        threads.run(lambda: None)


def _os_thread_name(thread: threading.Thread) -> str:
    with open(f"/proc/self/task/{thread.native_id}/comm") as f:
        return f.read().strip()


@pytest.mark.parametrize("strategy", ["round_robin", "prefix"])
async def test_a_serving_gateway_starts_no_thread(strategy: str, http: aiohttp.ClientSession) -> None:
    """Every thread the gateway works in runs before it serves: `Thread.start` holds the event loop, every request
    with it, until the OS has run the new thread (seconds on a starved machine, docs/agent.md), so none may start on
    the first large body (parsed off the loop) or the first prompt tokenized (text mode: no tokenizer loaded at
    start-up). The pool's threads carry their name in the OS too, where per-thread CPU is read."""
    async with running_standin() as worker, running_gateway([worker.url], strategy=strategy) as gw:
        before = threading.active_count()
        pool = gw.gateway.threads._threads
        assert len(pool) == gw.gateway.config.tokenizer_threads
        assert [_os_thread_name(thread) for thread in pool] == ["kvgate-work"] * len(pool)
        prompts = ["x" * 100_000, "a short one", "y" * 70_000]  # two over the 64 KiB parsed off the loop
        for prompt in prompts:
            async with http.post(f"{gw.url}/v1/completions",
                                 json={"model": "tiny", "prompt": prompt, "max_tokens": 2}) as resp:
                assert resp.status == 200, await resp.text()
        async with http.post(f"{gw.url}/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "z" * 90_000}], "max_tokens": 2}) as resp:
            assert resp.status == 200, await resp.text()
        assert threading.active_count() == before, [t.name for t in threading.enumerate()]
