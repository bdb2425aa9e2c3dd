"""The scheduler's lookups, off the scheduler's thread: vLLM's scheduler asks the connector, for every waiting
request it considers, how many tokens the agent can supply; the answer is one round trip to the agent (about
0.2 ms, more under load, a timeout when it hangs). Here the round trip runs in a lookup thread, and the scheduler
gets the answer if it arrives within a small wait shared by the whole step (`wait_s`), and otherwise "not known
yet" (`None`: vLLM's contract for "ask again next step"), then the answer on a later step. So no step of the engine
waits for the agent longer than `wait_s`, however slow or hung it is, and a request waits for its answer at most
`give_up_s` (then it is computed: a miss). vLLM's own Mooncake store connector does the same (`lookup(...,
non_block=True)` returning None until a future is done).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass

from kvcore.aio import name_native_thread

log = logging.getLogger("vllm.kvgate_connector")  # under "vllm" so vLLM's log handler prints it

THREAD_NAME = "kvgate-lookup"

Answer = tuple[int, str]  # (leading blocks held, where each is: C DRAM, D NVMe, S shared)


class LookupTooSlow(Exception):
    """The agent did not answer a lookup within the connector's `lookup_give_up_ms`."""


@dataclass
class _Pending:
    span: tuple[int, int]  # (first block asked, blocks asked): a moved local prefix hit asks again
    future: Future[Answer]
    started: float  # when the request was first asked about: its span may change, its wait is counted from here


class SchedulerLookups:
    def __init__(self, lookup: Callable[[Sequence[int]], Answer], wait_s: float, give_up_s: float) -> None:
        """`lookup(hashes)`: the agent's answer (run only in the lookup thread, which alone uses the client)."""
        self._lookup = lookup
        self.wait_s = wait_s
        self.give_up_s = give_up_s
        self._budget_s = wait_s  # what this step may still wait, over all its lookups
        self._pending: dict[str, _Pending] = {}
        self._jobs: queue.SimpleQueue[tuple[Future[Answer], list[int]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def answer(self, req_id: str, span: tuple[int, int], hashes: Sequence[int]) -> Answer | None:
        """The agent's answer for these hashes of this request, or None if it is not known yet (ask again later:
        the same call with the same span collects it). Raises what the lookup raised, or LookupTooSlow."""
        pending = self._pending.get(req_id)
        if pending is None or pending.span != span:
            started = time.monotonic()
            if pending is not None:  # the question changed: a lookup of the old span still queued is not asked
                pending.future.cancel()
                started = pending.started  # (and the request has waited since its first question)
            pending = _Pending(span, self._submit(list(hashes)), started)
            self._pending[req_id] = pending
        if not pending.future.done() and self._budget_s > 0:
            start = time.monotonic()
            wait([pending.future], timeout=self._budget_s)
            self._budget_s -= time.monotonic() - start
        if pending.future.done():
            del self._pending[req_id]
            return pending.future.result()
        if time.monotonic() - pending.started > self.give_up_s:
            del self._pending[req_id]
            pending.future.cancel()
            raise LookupTooSlow(f"no answer to a lookup within {self.give_up_s * 1000:.0f} ms")
        return None

    def next_step(self) -> None:
        """A new scheduler step: its lookups may wait `wait_s` again, all of them together."""
        self._budget_s = self.wait_s

    def forget(self, req_id: str) -> None:
        """The request is gone: its answer, if one comes, is dropped."""
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            pending.future.cancel()  # (a lookup not started yet is skipped)

    @property
    def waiting(self) -> int:
        """Requests whose lookup is asked and not yet answered."""
        return len(self._pending)

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)

    def _submit(self, hashes: list[int]) -> Future[Answer]:
        future: Future[Answer] = Future()
        if self._thread is None:  # started on first use: most processes that build a connector never look up
            self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            self._thread.start()
        self._jobs.put((future, hashes))
        return future

    def _run(self) -> None:
        name_native_thread(THREAD_NAME)  # so a stalled engine's threads can be told apart (tests/vllm_replica.py)
        while (job := self._jobs.get()) is not None:
            future, hashes = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._lookup(hashes))
            except BaseException as exc:  # delivered to the scheduler, which counts it and answers 0
                future.set_exception(exc)
