"""Running a service's main coroutine: uvloop when available, clean cancellation on SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import queue
import signal
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def run_until_signalled(main: Coroutine[Any, Any, None]) -> None:
    async def guarded() -> None:
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await main

    try:
        import uvloop
    except ImportError:
        asyncio.run(guarded())
    else:
        uvloop.run(guarded())


def started_executor(count: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose `count` threads are all running when it is returned.

    `ThreadPoolExecutor` starts a thread inside `submit` whenever none is idle, and `Thread.start` waits until the
    new thread has run (CPython holds the GIL through `pthread_create`): called on an event loop, that blocks the
    loop -- every connection it serves -- until the OS schedules a thread that does not exist yet. On a CPU-starved
    machine that took seconds, once 33 s (the tier agent with two vLLM workers busy-waiting on two cores:
    docs/agent.md). Started up front, before the loop serves anything, a submit only queues."""
    count = max(1, count)
    pool = ThreadPoolExecutor(count, thread_name_prefix=name)
    # each task holds its thread until all are in, so every submit finds no idle thread and starts one
    everyone = threading.Barrier(count + 1)
    for _ in range(count):
        pool.submit(everyone.wait, 60.0)
    everyone.wait(60.0)
    return pool


class WorkerThreads:
    """A few threads that run CPU work off the event loop: `await threads.run(fn, *args)`.

    What `loop.run_in_executor` does with less per call (measured on the gateway's tokenization, where it is paid
    per request): a plain asyncio future and one queue put, no `concurrent.futures.Future` with its condition and
    callbacks; the answer comes back with `call_soon_threadsafe`, which uvloop coalesces into one wake-up of the
    loop for the results ready at once. A call cancelled meanwhile still runs, its result dropped.

    Start the threads (`start`) before the loop serves: `Thread.start` holds the loop until the OS has run the new
    thread (see `started_executor`). `run` starts them itself if nobody did, for code that has no serving loop."""

    def __init__(self, count: int, name: str) -> None:
        self._count = max(1, count)
        self._name = name
        self._queue: queue.SimpleQueue[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any],
                                             Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False

    def start(self) -> None:
        """Start the threads; it returns once each is running under its name."""
        if self._threads:
            return
        named = threading.Barrier(self._count + 1)
        self._threads = [threading.Thread(target=self._serve, args=(named,), name=f"{self._name}_{i}", daemon=True)
                         for i in range(self._count)]
        for thread in self._threads:
            thread.start()
        named.wait(60.0)

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        if self._closed:
            raise RuntimeError(f"{self._name}: closed")
        if not self._threads:
            self.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((loop, future, fn, args))
        return future

    def close(self) -> None:
        """Let the threads end once the work queued so far is done (they do not hold up the interpreter's exit)."""
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)

    def _serve(self, named: threading.Barrier) -> None:
        name_native_thread(self._name)
        named.wait(60.0)
        while (item := self._queue.get()) is not None:
            loop, future, fn, args = item
            if future.cancelled():
                continue
            try:
                outcome: tuple[Any, BaseException | None] = (fn(*args), None)
            except BaseException as exc:  # handed to the awaiting task, as run_in_executor does
                outcome = (None, exc)
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits it
                loop.call_soon_threadsafe(_settle, future, *outcome)
            del item, future, outcome


def name_native_thread(name: str) -> None:
    """Name the calling OS thread (/proc/PID/task/TID/comm, `top -H`; at most 15 bytes), so its CPU time can be told
    from the rest of the process's (bench/connector_throughput.py does): Python names only its own thread object."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        return


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
