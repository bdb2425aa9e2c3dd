"""KV events in, recovery: one source's stream kept whole by its sequence numbers.

Each batch a source publishes has a sequence number. A gap is repaired from the source's replay socket; when the
replay cannot cover it (buffer overrun, no replay endpoint, timeout) what the source had said is forgotten and its
picture is *partial*: the worker is routed by the approximate trie until `resync_s` has passed (by then the blocks
it could not hear about have mostly been evicted or re-announced) or the engine clears its cache. A sequence number
going backwards, or a replay buffer that does not continue what we heard, means the publisher restarted: its cache
is new and empty. State is never kept silently when it is known to be stale.

`StreamRecovery` decodes each batch and hands its events to `apply`; `release` forgets what the source said. It
knows nothing of block keys or the index.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import xxhash

from kvcore.kv_events import AllBlocksCleared, KvEvent, decode_batch_tolerant
from router.kv_transport import Batches, EventSource, ReplayError
from router.metrics import GatewayMetrics

log = logging.getLogger(__name__)

Replay = Callable[[int], Awaitable[Batches]]  # start seq -> the buffered batches from there (ReplayError)


class _Gap(Exception):
    """A gap the replay could not fill."""


class StreamRecovery:
    """One source's stream: the next sequence number expected, gaps repaired, restarts noticed. A `Receiver`
    of the transport."""

    def __init__(
        self,
        source: EventSource,
        apply: Callable[[Sequence[KvEvent]], None],
        release: Callable[[], None],
        metrics: GatewayMetrics,
        replay: Replay | None = None,
        resync_s: float = 300.0,
    ) -> None:
        self.source = source
        self._apply = apply
        self._release = release
        self._metrics = metrics
        self._replay = replay if source.replay else None
        self._resync_s = resync_s
        self.expected: int | None = None  # next sequence number; None until the stream's position is known
        self._last_digest: int | None = None  # of the last applied payload: tells a restarted history apart
        self._partial_since: float | None = None  # when the picture became incomplete; None = complete

    def complete(self) -> bool:
        """Whether everything this source said is applied (else its worker is routed approximately)."""
        if self.expected is None:
            return False
        if self._partial_since is not None:
            if time.monotonic() - self._partial_since < self._resync_s:
                return False
            self._partial_since = None
        return True

    # --- the transport's Receiver -------------------------------------------------------------------------------

    async def opened(self) -> None:
        if self.expected is None:
            await self.reconcile()

    async def reconnected(self) -> None:
        await self.reconcile()

    async def received(self, frames: list[bytes]) -> None:
        worker = self.source.worker
        if len(frames) != 3 or len(frames[1]) != 8:
            self._metrics.kv_decode_errors.labels(worker, "frames").inc()
            return
        seq = int.from_bytes(frames[1], "big")
        events = self._decode(frames[2], "payload")
        if events is None:
            return
        expected = self.expected
        if expected is not None and seq != expected:
            if seq < expected:
                # the publisher restarted: the engine behind it starts with an empty cache
                self._reset("publisher_restart", partial=seq > 0)
            else:
                self._metrics.kv_gaps.labels(worker).inc()
                try:
                    await self._fill_gap(expected, seq)
                except _Gap as exc:
                    log.warning("kv events from %s: %s; routing %s approximately for now", self.source.endpoint,
                                exc, worker)
                    self._reset("gap", partial=True)
        elif expected is None and seq > 0:
            self._reset("late_start", partial=True)
        self._take(seq, frames[2], events)

    # --- recovery -------------------------------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Align with the publisher's replay buffer: recover blocks announced before we listened, batches missed
        while disconnected, and notice a publisher that restarted (its history is not ours)."""
        if self._replay is None:
            return  # the live stream decides (a late start is marked partial)
        try:
            batches = await self._fetch(0)
        except _Gap:
            return
        expected = self.expected
        if expected is not None and not self._same_history(batches):
            self._reset("publisher_restart", partial=False)
            expected = None
        if expected is None:
            if batches and batches[0][0] != 0:
                self._reset("late_start", partial=True)
            todo = batches
            self.expected = 0
        else:
            todo = [(seq, payload) for seq, payload in batches if seq >= expected]
            if todo and todo[0][0] != expected:
                self._reset("gap", partial=True)
            if todo:
                self._metrics.kv_replays.labels(self.source.worker, "repaired").inc()
        for seq, payload in todo:
            self._take(seq, payload, self._decode(payload, "replay_payload") or [])

    async def _fill_gap(self, start: int, stop: int) -> None:
        if self._replay is None:
            raise _Gap(f"missed batches {start}..{stop - 1} and no replay endpoint")
        batches = [(s, p) for s, p in await self._fetch(start) if s < stop]
        if not batches or batches[0][0] != start or batches[-1][0] != stop - 1:
            first = batches[0][0] if batches else None
            raise _Gap(f"replay could not cover batches {start}..{stop - 1} (first buffered: {first})")
        for _, payload in batches:
            self._apply_all(self._decode(payload, "replay_payload") or [])
        self._metrics.kv_replays.labels(self.source.worker, "repaired").inc()

    async def _fetch(self, start: int) -> Batches:
        assert self._replay is not None
        try:
            return await self._replay(start)
        except ReplayError as exc:
            self._metrics.kv_replays.labels(self.source.worker, "timeout").inc()
            raise _Gap(str(exc)) from None

    def _same_history(self, batches: Batches) -> bool:
        """Whether the replay buffer continues what this source told us, or belongs to a restarted publisher."""
        expected = self.expected
        if not expected:
            return True
        for seq, payload in batches:
            if seq == expected - 1:
                return xxhash.xxh3_64_intdigest(payload) == self._last_digest
        # our last batch is not in the buffer: overrun (same history, a gap) unless the publisher is behind us
        return bool(batches) and batches[-1][0] >= expected - 1

    # --- state ------------------------------------------------------------------------------------------------------

    def _decode(self, payload: bytes, what: str) -> list[KvEvent] | None:
        try:
            batch, skipped = decode_batch_tolerant(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._metrics.kv_decode_errors.labels(self.source.worker, what).inc()
            return None
        if skipped:
            self._metrics.kv_decode_errors.labels(self.source.worker, "unknown_event").inc(skipped)
        return batch.events

    def _take(self, seq: int, payload: bytes, events: Sequence[KvEvent]) -> None:
        """Apply batch `seq` and move past it."""
        self._apply_all(events)
        self.expected = seq + 1
        self._last_digest = xxhash.xxh3_64_intdigest(payload)

    def _apply_all(self, events: Sequence[KvEvent]) -> None:
        self._apply(events)
        if any(isinstance(event, AllBlocksCleared) for event in events):
            self._partial_since = None  # the engine emptied its cache: nothing is missing any more

    def _reset(self, reason: str, *, partial: bool) -> None:
        """Forget what this source said; if events were missed, mark the picture incomplete."""
        self._metrics.kv_resets.labels(self.source.worker, reason).inc()
        self._release()
        self._partial_since = time.monotonic() if partial else None
