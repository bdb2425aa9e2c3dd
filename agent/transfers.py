"""The connector's transfer thread: a worker's loads and saves run here, off the engine's step (one thread per
worker process, which alone uses the block mover and so the agent client, which is not thread-safe).

The step only queues work (`load`, `save`) and collects what finished (`finished_loads`, `saves_in_flight`);
nothing it calls waits for the agent, except `wait_for_saves`, which the connector calls only when vLLM is about to
reuse the blocks of a preempted request while a save still reads them. Loads go before saves: a load holds a
request back from its first step, a save holds nothing but the blocks of a finished request; the saves queued
when the thread gets to them (a step's, one per request) go to the agent as one batch -- one gather into the
shared memory, their Stores in one write, one wait for the replies -- not one round trip each, as many as one
batch of the shared memory holds (so a load waits for one batch at most). On a GPU the thread
copies on its own CUDA stream, after an event the step recorded (the forward pass that computed a saved block, the
zeroing of a block a load writes), and synchronises that stream before it reports a transfer done. A failure of
any kind is the block mover's (counted, never raised); with the agent's circuit open every queued transfer fails at
once.

On a CPU worker the thread runs by default on the worker's own core, beside the forward pass (`transfer_cores`:
"worker"), not on the core vLLM reserves for connectors ("reserved"): it shares the GIL with the worker's main
thread, which between steps spins in vLLM's shm_broadcast (`sched_yield`, the GIL let go and taken back every
microsecond). From another core the thread gets the GIL only by CPython's forced switch (after its 5 ms switch
interval), and the main thread then stops until that core runs the thread -- 7-9 stops a request on a 2-core
replica, where that core also runs the API server, the scheduler and the agent. On the same core the main thread's
`sched_yield` hands the core, and the GIL with it, to the thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from agent.block_mover import BlockMover, Failure, LoadResult, SavedChain
from kvcore.aio import name_native_thread

log = logging.getLogger("vllm.kvgate_connector")  # under "vllm" so vLLM's log handler prints it

THREAD_NAME = "kvgate-xfer"  # the transfer thread's OS name (at most 15 characters)
TRANSFER_CORES = ("reserved", "worker")  # where the thread runs when the caches are on the CPU


@dataclass
class LoadJob:
    req_id: str
    hashes: Sequence[int]
    block_ids: Sequence[int]
    ready: Any = None  # a torch.cuda.Event the copies wait for (None on CPU)


@dataclass
class SaveJob:
    req_id: str
    hashes: Sequence[int]
    block_ids: Sequence[int]
    parent: int | None
    ready: Any = None
    cancelled: bool = field(default=False)


class TransferThread:
    def __init__(self, mover: BlockMover, cores: str = "worker") -> None:
        """`cores` (CPU caches only): "worker", the worker's own (the forward pass's) cores; "reserved", the
        parent's cores that the worker is not bound to (see the module's doc for why "worker" is the default)."""
        if cores not in TRANSFER_CORES:
            raise ValueError(f"transfer thread cores {cores!r}: one of {', '.join(TRANSFER_CORES)}")
        self.mover = mover
        self.cores = cores
        self.load_failures: Counter[Failure] = Counter()  # taken by the connector's stats (under the lock)
        self.save_failures: Counter[Failure] = Counter()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._loads: deque[LoadJob] = deque()
        self._saves: deque[SaveJob] = deque()
        self._done_loads: list[tuple[LoadJob, LoadResult]] = []
        self._saving: Counter[str] = Counter()  # req_id -> saves queued or running
        self._stopping = False
        device = mover.copier.device
        self._device = device if device.type == "cuda" else None
        self._stream: Any = torch.cuda.Stream(device) if self._device is not None else None
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # -- the step's side -------------------------------------------------------------------------------------

    def ready_event(self) -> Any:
        """An event on the step's current stream (GPU), for the thread's copies to wait for; None on CPU."""
        if self._device is None:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return event

    def load(self, job: LoadJob) -> None:
        with self._changed:
            self._loads.append(job)
            self._changed.notify_all()

    def save(self, jobs: Sequence[SaveJob]) -> None:
        """A step's saves, queued together: the thread hands every save queued by then to the agent at once."""
        with self._changed:
            for job in jobs:
                self._saves.append(job)
                self._saving[job.req_id] += 1
            self._changed.notify_all()

    def finished_loads(self) -> list[tuple[LoadJob, LoadResult]]:
        with self._lock:
            done, self._done_loads = self._done_loads, []
        return done

    def saves_in_flight(self, req_id: str) -> bool:
        with self._lock:
            return self._saving[req_id] > 0

    def wait_for_saves(self, req_ids: Iterable[str], timeout_s: float) -> bool:
        """Block until no save of these requests is queued or running (their blocks are about to be reused);
        False if that took longer than `timeout_s` -- the saves not started by then are dropped."""
        wanted = set(req_ids)
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while any(self._saving[r] > 0 for r in wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    for job in self._saves:
                        if job.req_id in wanted:
                            job.cancelled = True
                    return False
                self._changed.wait(left)
        return True

    def take_failures(self) -> tuple[Counter[Failure], Counter[Failure]]:
        with self._lock:
            loads, saves = self.load_failures, self.save_failures
            self.load_failures, self.save_failures = Counter(), Counter()
        return loads, saves

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish what is queued (bounded by `timeout_s`), then stop."""
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join(timeout_s)

    # -- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        name_native_thread(THREAD_NAME)
        if self._device is not None:
            torch.cuda.set_device(self._device)
        elif self.cores == "reserved":
            _leave_the_compute_cores()
        while True:
            saves: list[SaveJob] = []
            with self._changed:
                while not (self._loads or self._saves or self._stopping):
                    self._changed.wait()
                if not (self._loads or self._saves):
                    return
                load = self._loads.popleft() if self._loads else None
                if load is None:  # the saves queued by now (a step's, or several), to the agent together -- as
                    blocks = 0  # many as one batch of the shared memory holds, so a load waits for one batch at most
                    while self._saves and (not saves or blocks + len(self._saves[0].hashes) <= self.mover.batch_blocks):
                        saves.append(self._saves.popleft())
                        blocks += len(saves[-1].hashes)
            try:
                if load is not None:
                    self._load(load)
                else:
                    self._save(saves)
            except Exception:  # the mover counts its own failures; anything else must not kill the thread
                log.exception("kvgate connector: unexpected error in the transfer thread")

    def _load(self, job: LoadJob) -> None:
        """Run one load; whatever happens, it is reported done (a load nobody reports holds its request forever)."""
        result = LoadResult(0, Failure.ERROR)
        try:
            with self._on_stream([job.ready]):
                result = self.mover.load(job.hashes, job.block_ids)
        finally:
            with self._changed:
                self._collect_failures()
                self._done_loads.append((job, result))
                self._changed.notify_all()

    def _save(self, jobs: list[SaveJob]) -> None:
        """Run these saves (the ones not cancelled meanwhile) as one batch; whatever happens, they are reported
        done."""
        try:
            live = [job for job in jobs if not job.cancelled]
            if live:
                with self._on_stream([job.ready for job in live]):
                    self.mover.save_chains([SavedChain(job.hashes, job.block_ids, job.parent) for job in live])
        finally:
            with self._changed:
                self._collect_failures()
                for job in jobs:
                    self._saving[job.req_id] -= 1
                    if self._saving[job.req_id] <= 0:
                        del self._saving[job.req_id]
                self._changed.notify_all()

    def _on_stream(self, ready: list[Any]) -> AbstractContextManager[Any]:
        if self._stream is None:
            return nullcontext()
        for event in {id(e): e for e in ready if e is not None}.values():  # a step's saves share one event
            self._stream.wait_event(event)
        on_stream: AbstractContextManager[Any] = torch.cuda.stream(self._stream)
        return on_stream

    def _collect_failures(self) -> None:
        """The mover's counts (touched only by this thread) into the ones the step takes (under the lock)."""
        self.load_failures.update(self.mover.load_failures)
        self.save_failures.update(self.mover.save_failures)
        self.mover.load_failures.clear()
        self.mover.save_failures.clear()


def _leave_the_compute_cores() -> None:
    """vLLM's CPU worker binds itself, every thread it starts included, to its OpenMP cores, and reserves others
    for the scheduler and, with a KV connector, one more core per worker for the connector's threads
    (vllm/utils/ompmultiprocessing.py). With `transfer_cores: "reserved"`, run the transfer thread on those (the
    parent process's cores that the worker is not bound to) rather than beside the forward pass; unchanged where
    there are none."""
    try:
        bound = os.sched_getaffinity(0)
        others = os.sched_getaffinity(os.getppid()) - bound
        if others:
            os.sched_setaffinity(0, others)  # 0: this thread only
            log.info("kvgate connector: transfer thread on CPUs %s (the forward pass on %s)", sorted(others),
                     sorted(bound))
    except OSError:
        return
