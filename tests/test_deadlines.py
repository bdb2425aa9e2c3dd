"""`Deadlines`: asyncio.timeout's semantics (TimeoutError when ours fired, someone else's cancellation passed on),
with one sweep for all armed deadlines instead of a timer each."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.deadlines import TICK_S, Deadlines


async def test_fires_within_a_tick_and_leaves_nothing_armed() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    # on the loop's clock, which the deadline reads: uvloop's is cached per iteration, so it may lag
    # time.monotonic() by a millisecond (CI once saw 99.5 ms by time.monotonic()); and compared as the sweep
    # compares it, not by a difference: uvloop's clock counts whole milliseconds, and 23069.583 - 23069.483 is
    # 0.09999999999854481 where 23069.483 + 0.1 == 23069.583 (that subtraction failed 2 runs in 3)
    started, started_wall = loop.time(), time.monotonic()
    with pytest.raises(TimeoutError), deadlines.after(0.1) as deadline:
        await asyncio.sleep(5)
    assert deadline.when >= started + 0.1 and loop.time() >= deadline.when
    assert time.monotonic() - started_wall < 0.1 + TICK_S + 0.2
    assert len(deadlines) == 0
    await asyncio.sleep(0.01)  # the task carries no cancellation of ours any more
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


async def test_block_that_ends_in_time_is_untouched() -> None:
    deadlines = Deadlines()
    for _ in range(3):
        with deadlines.after(0.2):
            await asyncio.sleep(0.01)
    assert len(deadlines) == 0
    await asyncio.sleep(0.3)  # its deadline passes after the block: nothing happens to the task
    await asyncio.sleep(TICK_S * 2)
    assert deadlines._sweep is None  # nothing armed: no sweep scheduled


async def test_a_passed_deadline_fires_at_the_first_wait() -> None:
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    with pytest.raises(TimeoutError), deadlines.at(loop.time() - 1):
        await asyncio.sleep(0)


async def test_someone_elses_cancellation_is_passed_on() -> None:
    deadlines = Deadlines()
    entered = asyncio.Event()

    async def guarded() -> None:
        with deadlines.after(10):
            entered.set()
            await asyncio.sleep(10)

    task = asyncio.create_task(guarded())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(deadlines) == 0


async def test_nested_the_inner_fires_and_the_outer_holds() -> None:
    deadlines = Deadlines()
    with deadlines.after(5) as outer:
        with pytest.raises(TimeoutError), deadlines.after(0.05):
            await asyncio.sleep(5)
        await asyncio.sleep(0.01)  # the outer block goes on
    assert not outer.expired and len(deadlines) == 0


async def test_many_tasks_each_its_own() -> None:
    deadlines = Deadlines()

    async def one(limit: float, work: float) -> str:
        try:
            with deadlines.after(limit):
                await asyncio.sleep(work)
        except TimeoutError:
            return "timeout"
        return "done"

    results = await asyncio.gather(*(one(0.1, 0.3 if i % 2 else 0.01) for i in range(50)))
    assert results == ["done" if i % 2 == 0 else "timeout" for i in range(50)]
    assert len(deadlines) == 0


async def test_close_stops_the_sweep() -> None:
    deadlines = Deadlines()
    entered = asyncio.Event()

    async def guarded() -> None:
        with deadlines.after(0.1):
            entered.set()
            await asyncio.sleep(0.3)

    task = asyncio.create_task(guarded())
    await entered.wait()
    deadlines.close()
    await task  # closed: the deadline never fires
    assert deadlines._sweep is None
