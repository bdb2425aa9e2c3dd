"""Copies of large blocks between the DRAM tier and shared memory, split over a few threads with the GIL released.

Why: a slice assignment (`dst[:] = src`) is one memcpy on one core with the GIL held, page faults included. A 2 MiB
block (Llama-3.1-8B's 16-token block) copied so into a fresh DRAM buffer ran at 0.6-1.5 GB/s here and 1.1 GB/s on
a 16-core H200 host, most of it the kernel faulting in (and zeroing) the buffer's pages one 4 KiB page at a time,
and a load out of DRAM at 4.5 GB/s; meanwhile the event loop (lookups) could not run at all. `ctypes.memmove` is a
plain foreign call, which releases the GIL, so the pieces of one batch's copies run on several cores at once
(their page faults too) and the event loop runs in between.

Only buffers of at least `LARGE_BYTES` go through the threads (a smaller copy costs less than handing it over);
smaller ones, and sources that cannot be addressed writable (`bytes`), are copied by slice assignment, as before.
The caller's buffers are exported (`ctypes` `from_buffer`) for the duration of the copy: a bytearray cannot be
resized nor a mapping closed under it.

The same threads run other GIL-free work split in shares (`run`): the NVMe segment tier's reads of a long run of
blocks (`preadv` and the xxh3 check, both GIL-free on large buffers; agent/tiers/segments.py).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar, cast

from kvcore.aio import started_executor

Buffer = bytes | bytearray | memoryview
T = TypeVar("T")

LARGE_BYTES = 256 * 2**10  # a buffer at least this big is copied by the threads
PIECE_BYTES = 512 * 2**10  # ... in pieces of at least this many bytes per thread


def _address(buf: Buffer) -> tuple[ctypes.c_char, int] | None:
    """A ctypes view of a writable, contiguous buffer (holding its export) and its address; None for others."""
    try:
        anchor = ctypes.c_char.from_buffer(buf)
    except (TypeError, ValueError):
        return None
    return anchor, ctypes.addressof(anchor)


def _run(pieces: list[tuple[int, int, int]]) -> None:
    memmove = ctypes.memmove
    for dst, src, n in pieces:
        memmove(dst, src, n)


class ParallelCopier:
    """`copy(pairs)`: every `dst[:] = src` of the pairs (each the same length), large ones on `threads` threads
    (the caller's among them). `threads=1`: all on the caller's thread (the large ones still without the GIL)."""

    def __init__(self, threads: int, name: str = "kvgate-agent-copy") -> None:
        self.threads = max(1, threads)
        self._pool: ThreadPoolExecutor | None = (started_executor(self.threads - 1, name) if self.threads > 1
                                                 else None)

    def copy(self, pairs: Sequence[tuple[Buffer, Buffer]]) -> None:
        anchors: list[ctypes.c_char] = []  # the exports, held until every piece is copied
        pieces: list[tuple[int, int, int]] = []
        total = 0
        try:
            for dst, src in pairs:
                n = len(src)
                if len(dst) != n:
                    raise ValueError(f"copy of {n} bytes into {len(dst)}")
                if n >= LARGE_BYTES:
                    to, frm = _address(dst), _address(src)
                    if to is not None and frm is not None:
                        anchors += (to[0], frm[0])
                        pieces.append((to[1], frm[1], n))
                        total += n
                        continue
                dst[:] = src  # type: ignore[index]
            if pieces:
                self._spread(pieces, total)
        finally:
            anchors.clear()

    def _spread(self, pieces: list[tuple[int, int, int]], total: int) -> None:
        """Run the pieces, cut into about equal shares, one share per thread (the caller's first)."""
        shares = min(self.threads, max(1, total // PIECE_BYTES)) if self._pool is not None else 1
        if shares == 1:
            _run(pieces)
            return
        per_share = -(-total // shares)
        plan: list[list[tuple[int, int, int]]] = [[]]
        room = per_share
        for dst, src, n in pieces:
            while n > 0:
                if room == 0:
                    plan.append([])
                    room = per_share
                k = min(n, room)
                plan[-1].append((dst, src, k))
                dst, src, n, room = dst + k, src + k, n - k, room - k
        # one share handed to each thread, not claimed as `run`'s are: on the H200 (16 cores) loads through the
        # claiming `run` were 0.78-0.99x these in 5 alternated pairs (64 and 128 blocks of 2 MiB, docs/agent.md)
        assert self._pool is not None
        futures: list[Future[None]] = [self._pool.submit(_run, share) for share in plan[1:]]
        try:
            _run(plan[0])
        finally:
            wait(futures)  # every piece done before the buffers may be let go
        for future in futures:
            future.result()

    def run(self, shares: Sequence[Callable[[], T]]) -> list[T]:
        """Each share's result, in order. The caller's thread and up to `threads - 1` of the pool's take the shares
        one at a time until none is left, so a pool thread the OS does not run soon (a loaded machine) never
        holds the caller up: its share is taken by whoever is free -- on 2 busy cores, waiting for a thread's turn
        made a 16-block NVMe load 0.56x the single thread's. Returns once every share taken is done, an exception
        or not (the caller's buffers may be let go then; a pool thread that starts later finds nothing to do);
        the first share's exception, in order, is raised then."""
        pool = self._pool
        if pool is None or len(shares) <= 1:
            return [share() for share in shares]
        n = len(shares)
        claim = itertools.count()  # next() on it is atomic (one C call under the GIL)
        results: list[T | None] = [None] * n
        errors: list[BaseException | None] = [None] * n
        left = [n]
        lock = threading.Lock()
        done = threading.Event()

        def work() -> None:
            while (i := next(claim)) < n:
                try:
                    results[i] = shares[i]()
                except BaseException as exc:  # raised on the caller's thread below
                    errors[i] = exc
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()

        for _ in range(min(n, self.threads) - 1):
            try:
                pool.submit(work)
            except RuntimeError:  # shut down meanwhile (the agent stopping): the caller does the rest
                break
        work()
        done.wait()
        for error in errors:
            if error is not None:
                raise error
        return cast(list[T], results)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
