"""KV events in, recovery: one source's stream kept whole by its sequence numbers.

Each batch a source publishes has a sequence number. A gap is repaired from the source's replay socket; when the
replay cannot cover it (buffer overrun, no replay endpoint, timeout, gaps too frequent to repair; for a while after
a timeout, gaps are not repaired) what the source had said is forgotten and its picture is *partial*: the worker is
routed by the approximate trie until `resync_s` has passed (by then the blocks it could not hear about have mostly
been evicted or re-announced) or the engine clears its cache. A sequence number going backwards to a batch we never
applied, or a replay buffer that does not continue what we heard, means the publisher restarted: its cache is new
and empty. A batch applied already (the same sequence number and the same payload, e.g. a live copy of a batch the
replay delivered first) is skipped. State is never kept silently when it is known to be stale.

A source whose blocks are of no use while it is away (`empty_when_away`: a tier agent, which its engine can load
nothing from while it is gone) is forgotten the moment its connection drops -- it exited, was killed, or went
silent past the heartbeat -- and counts as holding nothing (complete, not partial) until it is back: then its
replay buffer is taken from the start as a late joiner's would be, whether it restarted or not (a restarted agent
announces what it still has; one whose buffer no longer starts at 0 is partial, as a late start).

Bad input never stops the stream: a message that is not a batch is counted and dropped (a later valid copy of
the same batch, or the replay's, takes its place); an event no engine could send, or one that does not fit the
gateway, is counted and dropped and makes the picture partial; a bug while applying a batch is logged, and the
source's state is forgotten rather than trusted. Applying yields to the event loop every few milliseconds. Each
loss is counted; a stream logs its losses at most every 10 s (kvcore.log_throttle).

`StreamRecovery` decodes each batch and hands its events to `apply`; `release` forgets what the source said. It
knows nothing of block keys or the index.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence

import msgspec
import xxhash

from kvcore.kv_events import AllBlocksCleared, KvEvent, decode_batch_in_steps, decode_batch_tolerant
from kvcore.log_throttle import LogThrottle, held_back_note
from router.kv_apply import Applied
from router.kv_transport import Batches, EventSource, ReplayError
from router.metrics import GatewayMetrics

log = logging.getLogger(__name__)

Replay = Callable[[int], Awaitable[Batches]]  # start seq -> the buffered batches from there (ReplayError)
# one batch's events -> slices of applying them, with what became of them filled in
ApplySteps = Callable[[Sequence[KvEvent], Applied], Iterator[None]]

# batches whose payload digests are remembered: a re-delivered batch is told apart from a restarted publisher's
HISTORY = 4096
MAX_BATCH_BYTES = 4 * 2**20  # a bigger payload is dropped undecoded (decoding it would hold the event loop)
# a bigger payload is decoded an event at a time, the event loop let in between: 4 MiB decoded at once held it
# for 30-90 ms (a step's new blocks of a long-context engine, an offload tier's mass eviction, come close)
DECODE_AT_ONCE_BYTES = 256 * 2**10
# gap repairs allowed: a burst of REPLAY_BURST, then one per REPLAY_EVERY_S (a flood must not become a replay storm)
REPLAY_BURST = 5
REPLAY_EVERY_S = 1.0
# after a replay request timed out, gaps are left unrepaired for REPLAY_EVERY_S, doubling up to this while requests
# keep timing out: with a timeout longer than REPLAY_EVERY_S, an endpoint nobody answers made every gap wait out the
# timeout, and a publisher losing batches left the gateway further behind every second
REPLAY_BACKOFF_MAX_S = 30.0
# a (re)connection's replay request that timed out is tried again after these pauses: it is what tells a restarted
# publisher from a reconnected one, and brings what was said while no one listened; a publisher just started on a
# busy machine may miss the first request's timeout, and with no traffic nothing else would tell
RECONCILE_RETRIES_S = (0.5, 1.0)
YIELD_AFTER_S = 0.005  # applying lets the event loop run at least this often


class _Gap(Exception):
    """A gap the replay could not fill."""


class StreamRecovery:
    """One source's stream: the next sequence number expected, gaps repaired, restarts noticed. A `Receiver`
    of the transport."""

    def __init__(
        self,
        source: EventSource,
        apply: ApplySteps,
        release: Callable[[], None],
        metrics: GatewayMetrics,
        replay: Replay | None = None,
        resync_s: float = 300.0,
        empty_when_away: bool = False,
    ) -> None:
        self.source = source
        self._apply = apply
        self._release = release
        self._metrics = metrics
        self._replay = replay if source.replay else None
        self._resync_s = resync_s
        self._empty_when_away = empty_when_away
        self._away = False  # disconnected, and forgotten: it holds nothing until it is heard from again
        self.expected: int | None = None  # next sequence number; None until the stream's position is known
        self._digests: dict[int, int] = {}  # seq -> payload digest of the last HISTORY applied batches
        self._partial_since: float | None = None  # when the picture became incomplete; None = complete
        self._repairs = float(REPLAY_BURST)  # gap repairs allowed now (a token bucket)
        self._repairs_at = time.monotonic()
        self._timeouts = 0  # replay requests timed out in a row
        self._replay_after = 0.0  # gaps are not repaired before this (time.monotonic()), after a timeout
        self._yielded_at = time.monotonic()  # when applying last let the event loop run
        self._warnings = LogThrottle()  # a source losing events in every batch logged thousands a second

    def complete(self) -> bool:
        """Whether everything this source said is applied (else its worker is routed approximately)."""
        if self.expected is None and not self._away:
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

    async def disconnected(self) -> None:
        if not self._empty_when_away or self._away:
            return
        self._reset("disconnected", partial=False)
        self._digests.clear()
        self.expected = None  # whoever answers next starts from its beginning
        self._away = True

    async def reconnected(self) -> None:
        await self.reconcile()

    async def received(self, frames: list[bytes]) -> None:
        worker = self.source.cache
        if len(frames) != 3 or len(frames[1]) != 8:
            self._metrics.kv_decode_errors.labels(worker, "frames").inc()
            return
        seq = int.from_bytes(frames[1], "big")
        expected = self.expected
        if expected is not None and seq < expected and self._digests.get(seq) == _digest(frames[2]):
            # applied already: a live copy of a batch the replay brought (the publisher answers a replay request
            # between two batches, so the live stream overlaps it), or a duplicate on the wire
            self._metrics.kv_duplicates.labels(worker).inc()
            return
        events = await self._decode(frames[2], "payload")
        if events is None:
            return  # not a batch: a valid copy (live or replayed) may still come
        if expected is not None and seq != expected:
            if seq < expected:
                # the publisher restarted: the engine behind it starts with an empty cache
                self._reset("publisher_restart", partial=seq > 0)
                self._digests.clear()
            else:
                self._metrics.kv_gaps.labels(worker).inc()
                try:
                    await self._fill_gap(expected, seq)
                except _Gap as exc:
                    self._warn(f"{exc}; routing {worker} approximately for now")
                    self._reset("gap", partial=True)
        elif expected is None and seq > 0:
            self._reset("late_start", partial=True)
        await self._take(seq, frames[2], events)

    # --- recovery -------------------------------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Align with the publisher's replay buffer: recover blocks announced before we listened, batches missed
        while disconnected, and notice a publisher that restarted (its history is not ours)."""
        if self._replay is None:
            return  # the live stream decides (a late start is marked partial)
        retries = iter(RECONCILE_RETRIES_S)
        while True:
            try:
                batches = await self._fetch(0)
                break
            except _Gap:
                pause = next(retries, None)
                if pause is None:
                    return  # the live stream decides
                await asyncio.sleep(pause)
        expected = self.expected
        if expected is not None and not self._same_history(batches):
            self._reset("publisher_restart", partial=False)
            self._digests.clear()
            expected = None
        if expected is None:
            if batches and batches[0][0] != 0:
                self._reset("late_start", partial=True)
            elif not _in_order(batches, 0):
                self._reset("gap", partial=True)
            todo = batches
            self.expected = 0
        else:
            todo = [(seq, payload) for seq, payload in batches if seq >= expected]
            if todo and not _in_order(todo, expected):
                self._reset("gap", partial=True)
            if todo:
                self._metrics.kv_replays.labels(self.source.cache, "repaired").inc()
        for seq, payload in todo:
            await self._take(seq, payload, await self._replayed(payload))

    async def _fill_gap(self, start: int, stop: int) -> None:
        if self._replay is None:
            raise _Gap(f"missed batches {start}..{stop - 1} and no replay endpoint")
        now = time.monotonic()
        if now < self._replay_after:
            self._metrics.kv_replays.labels(self.source.cache, "backoff").inc()
            raise _Gap(f"missed batches {start}..{stop - 1}; the replay endpoint timed out lately")
        self._repairs = min(REPLAY_BURST, self._repairs + (now - self._repairs_at) / REPLAY_EVERY_S)
        self._repairs_at = now
        if self._repairs < 1:
            self._metrics.kv_replays.labels(self.source.cache, "too_frequent").inc()
            raise _Gap(f"missed batches {start}..{stop - 1}; gaps too frequent to repair each")
        self._repairs -= 1
        batches = [(s, p) for s, p in await self._fetch(start) if start <= s < stop]
        if len(batches) != stop - start or not _in_order(batches, start):
            first = batches[0][0] if batches else None
            raise _Gap(f"replay could not cover batches {start}..{stop - 1} in order (first buffered: {first}, "
                       f"{len(batches)} of {stop - start})")
        for seq, payload in batches:
            await self._take(seq, payload, await self._replayed(payload))
        self._metrics.kv_replays.labels(self.source.cache, "repaired").inc()

    async def _fetch(self, start: int) -> Batches:
        assert self._replay is not None
        try:
            batches = await self._replay(start)
        except ReplayError as exc:
            self._metrics.kv_replays.labels(self.source.cache, "timeout").inc()
            self._timeouts += 1
            backoff = min(REPLAY_BACKOFF_MAX_S, REPLAY_EVERY_S * 2 ** min(self._timeouts - 1, 16))
            self._replay_after = time.monotonic() + backoff
            raise _Gap(str(exc)) from None
        self._timeouts = 0
        self._replay_after = 0.0
        return batches

    def _same_history(self, batches: Batches) -> bool:
        """Whether the replay buffer continues what this source told us, or belongs to a restarted publisher."""
        expected = self.expected
        if not expected:
            return True
        for seq, payload in batches:
            known = self._digests.get(seq)
            if known is not None and known != _digest(payload):
                return False
        # nothing we applied differs; a buffer that ends before our last batch belongs to a publisher behind us
        return bool(batches) and batches[-1][0] >= expected - 1

    # --- state ------------------------------------------------------------------------------------------------------

    async def _decode(self, payload: bytes, what: str) -> list[KvEvent] | None:
        if len(payload) > MAX_BATCH_BYTES:
            self._metrics.kv_decode_errors.labels(self.source.cache, "too_large").inc()
            return None
        try:
            if len(payload) <= DECODE_AT_ONCE_BYTES:
                batch, skipped, malformed = decode_batch_tolerant(payload)
            else:
                await self._pause()
                steps = decode_batch_in_steps(payload)
                while True:
                    try:
                        next(steps)
                    except StopIteration as done:
                        batch, skipped, malformed = done.value
                        break
                    await self._pause()
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._metrics.kv_decode_errors.labels(self.source.cache, what).inc()
            return None
        if skipped:
            self._metrics.kv_decode_errors.labels(self.source.cache, "unknown_event").inc(skipped)
        if malformed:
            # a stored or removed event lost: what it said is missing from the picture
            self._metrics.kv_decode_errors.labels(self.source.cache, "invalid_event").inc(malformed)
            self._partial(f"{malformed} event(s) of a known type malformed")
        rank = self.source.dp_rank
        if rank is not None and batch.data_parallel_rank not in (None, rank):
            # another rank's cache: its events would put that rank's blocks on this one
            self._metrics.kv_event_mismatches.labels(self.source.cache, "dp_rank").inc()
            self._partial(f"a batch of data-parallel rank {batch.data_parallel_rank} on rank {rank}'s endpoint")
            return []
        return batch.events

    async def _replayed(self, payload: bytes) -> list[KvEvent]:
        """A replayed batch's events; a replayed batch that cannot be decoded is lost for good."""
        events = await self._decode(payload, "replay_payload")
        if events is None:
            self._partial("a replayed batch could not be decoded")
            return []
        return events

    async def _take(self, seq: int, payload: bytes, events: Sequence[KvEvent]) -> None:
        """Apply batch `seq` and move past it."""
        self._away = False
        await self._pause()
        await self._apply_all(events)
        self.expected = seq + 1
        digests = self._digests
        digests[seq] = _digest(payload)
        if len(digests) > HISTORY:
            del digests[next(iter(digests))]

    async def _apply_all(self, events: Sequence[KvEvent]) -> None:
        result = Applied()
        try:
            for _ in self._apply(events, result):
                await self._pause()
        except asyncio.CancelledError:
            raise
        except Exception:
            # a bug: what was applied of this batch is unknown, so nothing this source said is trusted any more
            log.exception("kv events from %s: applying a batch failed; forgetting what it said",
                          self.source.endpoint)
            self._metrics.kv_decode_errors.labels(self.source.cache, "apply_error").inc()
            self._reset("apply_error", partial=True)
            return
        if result.rejected:
            self._partial(f"{result.rejected} event(s) rejected")
        elif any(isinstance(event, AllBlocksCleared) for event in events):
            self._partial_since = None  # the engine emptied its cache: nothing is missing any more

    async def _pause(self) -> None:
        """Let the event loop run if this stream has held it for YIELD_AFTER_S (a replay of thousands of batches,
        an event of thousands of blocks)."""
        if time.monotonic() - self._yielded_at > YIELD_AFTER_S:
            await asyncio.sleep(0)
            self._yielded_at = time.monotonic()

    def _partial(self, why: str) -> None:
        """Events were lost: the picture is incomplete from now on (until `resync_s` has passed)."""
        if self._partial_since is None:
            self._warn(f"{why}; routing {self.source.cache} approximately for {self._resync_s:g} s")
        self._partial_since = time.monotonic()

    def _warn(self, message: str) -> None:
        """Log that events were lost, unless this stream did so within the last 10 s (then count it)."""
        held_back = self._warnings.due()
        if held_back is None:
            return
        log.warning("kv events from %s: %s%s", self.source.endpoint, message, held_back_note(held_back))

    def _reset(self, reason: str, *, partial: bool) -> None:
        """Forget what this source said; if events were missed, mark the picture incomplete."""
        self._metrics.kv_resets.labels(self.source.cache, reason).inc()
        self._release()
        self._partial_since = time.monotonic() if partial else None


def _digest(payload: bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def _in_order(batches: Batches, first: int) -> bool:
    """Whether the batches are `first`, `first` + 1, ... without a hole (a publisher buffers them so)."""
    return all(seq == first + i for i, (seq, _) in enumerate(batches))
