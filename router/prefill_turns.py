"""Long prefills sent to a worker one at a time, each once the one before has its first token.

Two prompts that are long and not cached, sent to one engine together, are computed together: vLLM batches their
chunks into the same steps (its token budget shared, or the first one's last chunk beside the second one's first),
so the first's first token waits for most of the second's prefill too. On a simulated L4 replica (`kvgate sim
--profile llama-3.1-8b-l4 --speedup 10`), two 2,112-token prompts at once took 116 and 123 ms to their first
tokens; the second sent on the first's first token, 66 and 137 ms from the pair's start. The same compute, in the
order that finishes one of them sooner. A strategy asks for it (`Decision.serialize_prefill`); the gateway holds
such a request until the worker's turn before it ends: its first chunk has come back (whole answers: the whole
answer), it failed, its client left, or it has had its hold (`hold_seconds`, from when it was sent), so a request the
engine is slow to start holds the next no longer than that. Requests that ask for no turn (a short prefill, a hit:
one step takes them beside a long one for little) are sent at once.

With `--processes N` the turns are the whole gateway's: process 0 keeps them for all (router/turn_broker.py) and
every process takes and releases them there over a Unix socket, through `SharedPrefillTurns`, which has the same
interface as `PrefillTurns` here (`TurnKeeper`). A process that cannot reach that broker, or gets no answer in time,
takes its own turns from a `PrefillTurns` as one process does, until it can again."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

HOLD_MAX_S = 10.0  # the most a turn holds the next, whatever its request's prediction


def hold_seconds(predicted_ttft_s: float | None, stream: bool) -> float:
    """How long a turn may hold the next from when its request was sent. A streamed answer ends its turn with its
    first chunk, so its hold only bounds a first token later than predicted: twice the prediction, and 50 ms. A
    whole answer says nothing until it is all done, long after its prefill: its hold is the prediction itself (and
    a fifth, and 20 ms), so the next goes about when its prefill ends."""
    predicted = predicted_ttft_s or 0.0
    return min(HOLD_MAX_S, 2 * predicted + 0.05 if stream else 1.2 * predicted + 0.02)


class Turn:
    """One request's turn on an engine: `started` when it was sent, `released` when the next may go."""

    __slots__ = ("released", "started", "ticket", "until", "worker")

    def __init__(self, worker: str, loop: asyncio.AbstractEventLoop, ticket: int | None = None) -> None:
        self.worker = worker
        self.started: asyncio.Future[None] = loop.create_future()
        self.released: asyncio.Future[None] = loop.create_future()
        self.until = 0.0  # loop time after which the next may go whether or not this one is released
        self.ticket = ticket  # a turn the gateway's turn broker gave (router/turn_broker.py): its number there


class TurnKeeper(Protocol):
    """Whoever keeps the turns a proxy takes: this process's `PrefillTurns`, or the whole gateway's
    (router/turn_broker.py `SharedPrefillTurns`)."""

    async def take(self, worker: str, hold_s: float) -> Turn: ...

    def release(self, turn: Turn) -> None: ...

    def waiting(self) -> int: ...


class PrefillTurns:
    """Each worker's queue of turns: a request takes one (`take`, waiting for the turn before), and releases it
    (`release`) when its first chunk has come, or it is over."""

    def __init__(self) -> None:
        self._last: dict[str, Turn] = {}  # engine (a worker, or a data-parallel rank of one) -> its latest turn

    def waiting(self) -> int:
        """Workers with a turn taken and not released (for tests and metrics)."""
        return sum(1 for turn in self._last.values() if not turn.released.done())

    async def take(self, worker: str, hold_s: float) -> Turn:
        """A turn on `worker`, once the turn before it there is released or has had its hold (each turn before
        that one waited for its own before it, so a line of them goes one at a time). The caller releases it
        (not when this is cancelled: the next then waits for the turn before this one)."""
        loop = asyncio.get_running_loop()
        turn = Turn(worker, loop)
        before = self._last.get(worker)
        self._last[worker] = turn
        try:
            if before is not None and not before.released.done():
                await asyncio.shield(before.started)
                left = before.until - loop.time()
                if left > 0 and not before.released.done():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(asyncio.shield(before.released), left)
        except BaseException:
            self._leave(turn, before)
            raise
        turn.until = loop.time() + hold_s
        turn.started.set_result(None)
        return turn

    def _leave(self, turn: Turn, before: Turn | None) -> None:
        """A turn whose request left while it waited: the next one waits for the turn before it instead, as it
        would have without it."""
        if before is None or before.released.done():
            self.release(turn)
            return

        def started(_: object) -> None:
            if not turn.started.done():
                turn.until = before.until
                turn.started.set_result(None)

        before.started.add_done_callback(started)
        before.released.add_done_callback(lambda _: self.release(turn))

    def release(self, turn: Turn) -> None:
        """The next turn on its worker may go (once: a second call does nothing)."""
        if not turn.started.done():
            turn.started.set_result(None)
        if not turn.released.done():
            turn.released.set_result(None)
        if self._last.get(turn.worker) is turn:
            del self._last[turn.worker]
