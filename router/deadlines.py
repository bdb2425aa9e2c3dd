"""Timeouts on the request path without a timer per request: `asyncio.timeout`'s semantics, checked together.

`asyncio.timeout` arms an event-loop timer on entry and cancels it on exit; a proxied request passes through two
(its whole deadline, the wait for the worker's headers), and side by side with a gateway without them that cost
about 40 us of CPU per request at c64 (170 against 210 us, load 8.7). Here a deadline is an entry in a set, and one
sweep every `TICK_S` (only while any is armed) cancels the tasks whose deadlines passed, so a timeout fires up to
`TICK_S` late: the request path's timeouts are seconds long.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

TICK_S = 0.05  # how often armed deadlines are checked: how late a timeout may fire


class Deadline:
    """`with deadlines.at(when):` — like `async with asyncio.timeout_at(when):` (the loop's clock): the task is
    cancelled once `when` has passed and the block raises TimeoutError, unless the cancellation was someone
    else's too. For the task that enters it; not reusable."""

    __slots__ = ("_cancelling", "_owner", "_task", "expired", "when")

    def __init__(self, owner: Deadlines, when: float) -> None:
        self._owner = owner
        self.when = when
        self.expired = False
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0

    def __enter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a Deadline is entered by a task")
        self._task = task
        self._cancelling = task.cancelling()
        # armed here, not in a method of the owner's: a call per deadline, two per request
        owner = self._owner
        loop = owner._loop
        if loop is None:
            loop = owner._loop = asyncio.get_running_loop()
        if self.when <= loop.time():  # passed already: cancelled at the block's first wait, as asyncio's
            self._expire()
            return self
        owner._armed.add(self)
        if owner._sweep is None:
            owner._sweep = loop.call_later(owner._tick, owner._check)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._owner._armed.discard(self)
        assert self._task is not None
        # asyncio.timeout's rule: the CancelledError is ours to turn into a TimeoutError only when no other
        # cancellation of the task is pending
        if self.expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _expire(self) -> None:
        self.expired = True
        assert self._task is not None
        self._task.cancel()


class Deadlines:
    """The armed deadlines of one event loop's tasks, swept every `tick_s` while there are any."""

    def __init__(self, tick_s: float = TICK_S) -> None:
        self._tick = tick_s
        self._armed: set[Deadline] = set()
        self._sweep: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def at(self, when: float) -> Deadline:
        """A deadline at `when`, on the running loop's clock (`loop.time()`)."""
        return Deadline(self, when)

    def after(self, seconds: float) -> Deadline:
        """A deadline `seconds` from now."""
        return Deadline(self, asyncio.get_running_loop().time() + seconds)

    def _check(self) -> None:
        self._sweep = None
        assert self._loop is not None
        now = self._loop.time()
        passed = [deadline for deadline in self._armed if deadline.when <= now]
        for deadline in passed:
            self._armed.discard(deadline)
            deadline._expire()
        if self._armed:
            self._sweep = self._loop.call_later(self._tick, self._check)

    def __len__(self) -> int:
        return len(self._armed)

    def close(self) -> None:
        """Stop sweeping (the loop is shutting down); deadlines armed now never fire."""
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self._armed.clear()
