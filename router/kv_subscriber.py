"""KV events in: one ZMQ subscriber per event source (a vLLM engine, a tier agent), applied to the block index.

Each source's batches carry sequence numbers. The subscriber tracks them and repairs gaps from the source's
replay socket; when the replay cannot cover a gap (buffer overrun, no replay endpoint, timeout) it forgets what
that source had said and marks the worker *partial*: the strategy then routes it by the approximate trie until
`kv_resync_s` has passed (by then the blocks it could not hear about have mostly been evicted or re-announced)
or the engine clears its cache. A sequence number going backwards means the publisher restarted: its cache is
new and empty. State is never kept silently when it is known to be stale.

Engine block hashes depend on the engine's hash algorithm and seed; the gateway never needs them to match its
own. A `BlockStored` event carries the blocks' token ids, from which the gateway computes its own chained keys
(starting from its parent's key, or from the root key of the worker's model, LoRA adapter and cache salt), and
remembers engine hash → gateway key per worker for removals and for later events that carry no token ids.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash
import zmq
import zmq.asyncio

from router.block_keys import BlockKey, block_keys, root_key
from router.kv_events import (
    END_OF_REPLAY,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    decode_batch_tolerant,
)
from router.kv_index import TIERS, KvBlockIndex, tier_of
from router.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# worker URL -> (base model, ) used for the root key of a prompt's first block
ModelOf = Callable[[str], str | None]


@dataclass(frozen=True, slots=True)
class EventSource:
    worker: str
    endpoint: str
    replay: str | None = None
    name: str = "engine"


class _Gap(Exception):
    """A gap the replay could not fill."""


@dataclass(slots=True)
class _Holding:
    key: BlockKey
    count: int


@dataclass
class SourceState:
    """What one source has told about one worker's blocks."""

    held: dict[tuple[BlockHash, str], _Holding] = field(default_factory=dict)
    expected: int | None = None  # next sequence number
    last_digest: int | None = None  # of the last applied payload: tells a restarted publisher's history apart
    partial_since: float | None = None  # when the picture became incomplete; None = complete


class KvEventHub:
    """Owns the subscribers, the per-source state and the index they feed."""

    def __init__(
        self,
        index: KvBlockIndex,
        metrics: GatewayMetrics,
        model_of: ModelOf,
        *,
        replay_timeout_s: float = 2.0,
        resync_s: float = 300.0,
    ) -> None:
        self.index = index
        self._metrics = metrics
        self._model_of = model_of
        self._replay_timeout_s = replay_timeout_s
        self._resync_s = resync_s
        self._ctx = zmq.asyncio.Context()
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._states: dict[EventSource, SourceState] = {}
        self._sources: dict[str, list[EventSource]] = {}
        self._unwatching: set[asyncio.Task[Any]] = set()
        self._hash_keys: dict[str, dict[BlockHash, BlockKey]] = {}  # worker -> engine hash -> gateway key

    # --- lifecycle ------------------------------------------------------------------------------------------

    def watch(self, sources: Sequence[EventSource]) -> None:
        for source in sources:
            self._states[source] = SourceState()
            self._sources.setdefault(source.worker, []).append(source)
            task = asyncio.get_running_loop().create_task(self._subscribe(source), name=f"kv events {source}")
            self._tasks.setdefault(source.worker, []).append(task)

    def _detach(self, worker: str) -> list[asyncio.Task[None]]:
        """Forget a worker at once (so a worker re-added under the same URL starts clean) and cancel its
        subscribers; returns their tasks to await."""
        tasks = self._tasks.pop(worker, [])
        for task in tasks:
            task.cancel()
        for source in self._sources.pop(worker, []):
            del self._states[source]
        self._hash_keys.pop(worker, None)
        self.index.clear(worker)
        self._update_gauges()
        return tasks

    async def unwatch(self, worker: str) -> None:
        await asyncio.gather(*self._detach(worker), return_exceptions=True)

    def forget_worker(self, worker: str) -> None:
        """`unwatch` for synchronous callers (the pool's removal callback)."""
        tasks = self._detach(worker)
        if tasks:
            waiting = asyncio.get_running_loop().create_task(asyncio.wait(tasks))
            self._unwatching.add(waiting)  # held until done: the loop keeps only a weak reference
            waiting.add_done_callback(self._unwatching.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._unwatching, return_exceptions=True)
        for worker in list(self._tasks):
            await self.unwatch(worker)
        self._ctx.destroy(linger=0)

    def watched(self, worker: str) -> bool:
        return worker in self._tasks

    def trusted(self, worker: str) -> bool:
        """Whether the index's picture of this worker is complete (else route it by the approximate trie)."""
        now = time.monotonic()
        states = [self._states[source] for source in self._sources.get(worker, ())]
        if not states:
            return False
        for state in states:
            if state.expected is None:
                return False
            if state.partial_since is not None:
                if now - state.partial_since < self._resync_s:
                    return False
                state.partial_since = None
        return True

    def engine_hashes(self, worker: str, tier: str) -> set[BlockHash]:
        """The engine block hashes the worker's sources say it holds on `tier` (for checks and debugging)."""
        return {h for source in self._sources.get(worker, ()) for (h, t) in self._states[source].held if t == tier}

    # --- receiving ------------------------------------------------------------------------------------------

    async def _subscribe(self, source: EventSource) -> None:
        """Receive forever. ZMQ reconnects by itself (with backoff) when the publisher restarts; every
        (re)connection is reconciled against the replay buffer, since a restarted engine's first batches are
        usually published before the subscription is back."""
        # block keys start from the worker's model: wait until its model list is known
        while self._model_of(source.worker) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        backoff = 0.1
        while True:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.IPV6, 1)  # endpoints of workers discovered by AAAA records are IPv6
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, 100)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED)
            raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
            poller = zmq.asyncio.Poller()
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            try:
                sock.connect(source.endpoint)
                if self._states[source].expected is None:
                    await self._reconcile(source)
                connections = 0
                while True:
                    ready = dict(await poller.poll())
                    if monitor in ready:
                        await monitor.recv_multipart()
                        connections += 1
                        if connections > 1:  # a reconnection: the publisher may have restarted meanwhile
                            await self._reconcile(source)
                    if sock in ready:
                        # drain what has arrived without a round through the event loop per message
                        while (frames := _recv_now(raw)) is not None:
                            await self._receive(source, frames)
                        backoff = 0.1
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug or a broken socket must not end the subscription
                log.exception("kv event subscriber for %s failed; restarting", source.endpoint)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            finally:
                sock.disable_monitor()
                monitor.close(linger=0)
                sock.close(linger=0)

    async def _receive(self, source: EventSource, frames: list[bytes]) -> None:
        worker = source.worker
        if len(frames) != 3 or len(frames[1]) != 8:
            self._metrics.kv_decode_errors.labels(worker, "frames").inc()
            return
        seq = int.from_bytes(frames[1], "big")
        try:
            batch, skipped = decode_batch_tolerant(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._metrics.kv_decode_errors.labels(worker, "payload").inc()
            return
        if skipped:
            self._metrics.kv_decode_errors.labels(worker, "unknown_event").inc(skipped)
        state = self._states[source]
        if state.expected is not None and seq != state.expected:
            if seq < state.expected:
                # the publisher restarted: the engine behind it starts with an empty cache
                self._reset(source, "publisher_restart", partial=seq > 0)
            else:
                self._metrics.kv_gaps.labels(worker).inc()
                try:
                    await self._fill_gap(source, state.expected, seq)
                except _Gap as exc:
                    log.warning("kv events from %s: %s; routing %s approximately for now", source.endpoint, exc,
                                worker)
                    self._reset(source, "gap", partial=True)
        elif state.expected is None and seq > 0:
            self._reset(source, "late_start", partial=True)
        self._apply(source, batch.events)
        state.expected = seq + 1
        state.last_digest = xxhash.xxh3_64_intdigest(frames[2])

    async def _reconcile(self, source: EventSource) -> None:
        """Align the state with the publisher's replay buffer: recover blocks announced before we listened,
        batches missed while disconnected, and notice a publisher that restarted (its history is not ours)."""
        state = self._states[source]
        if not source.replay:
            return  # the live stream decides (a late start is marked partial)
        try:
            batches = await self._replay(source, 0)
        except _Gap:
            return
        expected = state.expected
        if expected is not None and not _same_history(state, batches):
            self._reset(source, "publisher_restart", partial=False)
            expected = None
        if expected is None:
            if batches and batches[0][0] != 0:
                self._reset(source, "late_start", partial=True)
            todo = batches
            state.expected = 0
        else:
            todo = [(seq, payload) for seq, payload in batches if seq >= expected]
            if todo and todo[0][0] != expected:
                self._reset(source, "gap", partial=True)
            if todo:
                self._metrics.kv_replays.labels(source.worker, "repaired").inc()
        for seq, payload in todo:
            self._apply(source, self._decode(source, payload))
            state.expected = seq + 1
            state.last_digest = xxhash.xxh3_64_intdigest(payload)

    async def _fill_gap(self, source: EventSource, start: int, stop: int) -> None:
        if not source.replay:
            raise _Gap(f"missed batches {start}..{stop - 1} and no replay endpoint")
        batches = [(s, p) for s, p in await self._replay(source, start) if s < stop]
        if not batches or batches[0][0] != start or batches[-1][0] != stop - 1:
            first = batches[0][0] if batches else None
            raise _Gap(f"replay could not cover batches {start}..{stop - 1} (first buffered: {first})")
        for _, payload in batches:
            self._apply(source, self._decode(source, payload))
        self._metrics.kv_replays.labels(source.worker, "repaired").inc()

    def _decode(self, source: EventSource, payload: bytes) -> list[object]:
        try:
            batch, skipped = decode_batch_tolerant(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self._metrics.kv_decode_errors.labels(source.worker, "replay_payload").inc()
            return []
        if skipped:
            self._metrics.kv_decode_errors.labels(source.worker, "unknown_event").inc(skipped)
        return list(batch.events)

    async def _replay(self, source: EventSource, start: int) -> list[tuple[int, bytes]]:
        """The buffered batches with seq >= start, as (seq, payload), in order."""
        assert source.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IPV6, 1)
        sock.setsockopt(zmq.LINGER, 0)
        batches: list[tuple[int, bytes]] = []
        try:
            sock.connect(source.replay)
            async with asyncio.timeout(self._replay_timeout_s):
                await sock.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 4:
                        continue
                    _, _topic, seq_bytes, payload = frames
                    if seq_bytes == END_OF_REPLAY:
                        break
                    if len(seq_bytes) == 8:
                        batches.append((int.from_bytes(seq_bytes, "big"), payload))
        except TimeoutError:
            self._metrics.kv_replays.labels(source.worker, "timeout").inc()
            raise _Gap(f"replay from {source.replay} timed out") from None
        finally:
            sock.close(linger=0)
        return batches

    # --- applying ---------------------------------------------------------------------------------------------

    def _reset(self, source: EventSource, reason: str, *, partial: bool) -> None:
        """Forget what this source said; if events were missed, mark the picture incomplete."""
        self._metrics.kv_resets.labels(source.worker, reason).inc()
        state = self._states[source]
        self._release_all(source, state)
        state.partial_since = time.monotonic() if partial else None

    def _release_all(self, source: EventSource, state: SourceState) -> None:
        held, state.held = state.held, {}
        for (engine_hash, tier), holding in held.items():
            self.index.remove(source.worker, (holding.key,), tier)
            self._drop_hash_if_unheld(source.worker, engine_hash)
        self._update_gauges()

    def _drop_hash_if_unheld(self, worker: str, engine_hash: BlockHash) -> None:
        """Keep engine hash -> key only while some source of the worker holds the block on some tier."""
        for source in self._sources.get(worker, ()):
            held = self._states[source].held
            if any((engine_hash, tier) in held for tier in TIERS):
                return
        self._hash_keys.get(worker, {}).pop(engine_hash, None)

    def _apply(self, source: EventSource, events: Sequence[object]) -> None:
        worker = source.worker
        state = self._states[source]
        applied = self._metrics.kv_events_applied
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(source, state, event)
                applied.labels(worker, "BlockStored").inc()
            elif isinstance(event, BlockRemoved):
                self._removed(source, state, event)
                applied.labels(worker, "BlockRemoved").inc()
            elif isinstance(event, AllBlocksCleared):
                self._release_all(source, state)
                state.partial_since = None
                applied.labels(worker, "AllBlocksCleared").inc()
        self._update_gauges()

    def _root(self, worker: str, event: BlockStored) -> BlockKey | None:
        model = self._model_of(worker)
        if model is None:
            return None
        return root_key(model, event.lora_name, _salt(event))

    def _stored(self, source: EventSource, state: SourceState, event: BlockStored) -> None:
        worker = source.worker
        tier = tier_of(event.medium)
        hash_keys = self._hash_keys.setdefault(worker, {})
        new_keys: list[BlockKey] = []
        tokens = event.token_ids or []
        size = event.block_size or 0
        if tokens and size and len(tokens) >= size * len(event.block_hashes):
            parent = (self._root(worker, event) if event.parent_block_hash is None
                      else hash_keys.get(event.parent_block_hash))
            if parent is None:
                self._metrics.kv_unmapped_blocks.labels(worker).inc(len(event.block_hashes))
                return
            keys = block_keys(tokens[: size * len(event.block_hashes)], size, parent)
            for engine_hash, key in zip(event.block_hashes, keys, strict=True):
                hash_keys[engine_hash] = key
                new_keys.append(self._hold(state, engine_hash, tier, key))
        else:
            # an offload tier re-announcing blocks the engine described before
            for engine_hash in event.block_hashes:
                known = hash_keys.get(engine_hash)
                if known is None:
                    self._metrics.kv_unmapped_blocks.labels(worker).inc()
                    continue
                new_keys.append(self._hold(state, engine_hash, tier, known))
        if new_keys:
            self.index.add(worker, new_keys, tier)

    @staticmethod
    def _hold(state: SourceState, engine_hash: BlockHash, tier: str, key: BlockKey) -> BlockKey:
        holding = state.held.get((engine_hash, tier))
        if holding is None:
            state.held[(engine_hash, tier)] = _Holding(key, 1)
        else:
            holding.count += 1  # a re-announcement: one removal must not drop it
        return key

    def _removed(self, source: EventSource, state: SourceState, event: BlockRemoved) -> None:
        tier = tier_of(event.medium)
        gone = []
        for engine_hash in event.block_hashes:
            holding = state.held.get((engine_hash, tier))
            if holding is None:
                continue  # removals of unknown blocks are normal (e.g. after a reset)
            holding.count -= 1
            if holding.count <= 0:
                del state.held[(engine_hash, tier)]
                gone.append(holding.key)
                self._drop_hash_if_unheld(source.worker, engine_hash)
        if gone:
            self.index.remove(source.worker, gone, tier)

    def _update_gauges(self) -> None:
        self._metrics.kv_index_entries.set(self.index.entries())


def _salt(event: BlockStored) -> str | None:
    """vLLM appends the request's cache_salt to the first block's extra keys."""
    extra = event.extra_keys
    if not extra:
        return None
    first = extra[0]
    if isinstance(first, (list, tuple)):
        strings = [x for x in first if isinstance(x, str) and x != event.lora_name]
        return strings[-1] if strings else None
    return first if isinstance(first, str) and first != event.lora_name else None


def _same_history(state: SourceState, batches: list[tuple[int, bytes]]) -> bool:
    """Whether the replay buffer continues what this source told us, or belongs to a restarted publisher."""
    expected = state.expected
    if not expected:
        return True
    for seq, payload in batches:
        if seq == expected - 1:
            return xxhash.xxh3_64_intdigest(payload) == state.last_digest
    # our last batch is not in the buffer: overrun (same history, a gap) unless the publisher is behind us
    return bool(batches) and batches[-1][0] >= expected - 1


def _recv_now(sock: zmq.Socket[bytes]) -> list[bytes] | None:
    try:
        return sock.recv_multipart(zmq.NOBLOCK)
    except zmq.Again:
        return None
