"""KV events in: one subscription per event source (a vLLM engine, a tier agent), applied to the block index.

Three parts, each its own module: the transport (router/kv_transport.py: sockets, reconnection, the replay
socket), recovery (router/kv_recovery.py: sequence numbers, gaps, replay, restarts; one `StreamRecovery` per
source) and applying events to the index (router/kv_apply.py: engine hashes → the gateway's block keys).
`KvEventHub` wires them together per worker and answers the strategy's question: is this worker's picture
complete?
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Sequence
from typing import Any

from kvcore.kv_events import BlockHash
from router.kv_apply import KvEventApplier, ModelOf
from router.kv_index import KvBlockIndex
from router.kv_recovery import StreamRecovery
from router.kv_transport import EventSource, ZmqEventTransport
from router.metrics import GatewayMetrics

__all__ = ["EventSource", "KvEventHub"]


class KvEventHub:
    """Owns the subscriptions, one `StreamRecovery` per source, and the applier that feeds the index."""

    def __init__(
        self,
        index: KvBlockIndex,
        metrics: GatewayMetrics,
        model_of: ModelOf,
        *,
        replay_timeout_s: float = 2.0,
        resync_s: float = 300.0,
        block_size: int = 0,
        identity_blocks: int = 1 << 19,
    ) -> None:
        self.index = index
        self.applier = KvEventApplier(index, metrics, model_of, block_size=block_size, identity_blocks=identity_blocks)
        self._metrics = metrics
        self._model_of = model_of
        self._replay_timeout_s = replay_timeout_s
        self._resync_s = resync_s
        self._transport = ZmqEventTransport()
        self._streams: dict[EventSource, StreamRecovery] = {}
        self._sources: dict[str, list[EventSource]] = {}  # worker URL -> its sources
        self._caches: dict[str, list[EventSource]] = {}  # cache (`EventSource.cache`) -> the sources describing it
        self._tasks: dict[str, list[asyncio.Task[None]]] = {}
        self._unwatching: set[asyncio.Task[Any]] = set()

    def watch(self, sources: Sequence[EventSource]) -> None:
        """Subscribe to each source (in the background, for as long as its worker is watched)."""
        for source in sources:
            stream = self.stream(source)
            task = asyncio.get_running_loop().create_task(self._subscribe(stream), name=f"kv events {source}")
            self._tasks.setdefault(source.worker, []).append(task)
            self._metrics.kv_worker_trusted.labels(source.cache).set_function(
                functools.partial(self._trusted_value, source.cache))

    def stream(self, source: EventSource) -> StreamRecovery:
        """The recovery of `source`'s stream, created on first use: where it stands (`expected`), and the
        `received(frames)` of its transport, for callers that bring the messages themselves."""
        stream = self._streams.get(source)
        if stream is None:
            replay = None
            if source.replay:
                replay = functools.partial(self._transport.replay, source.replay, timeout_s=self._replay_timeout_s)
            stream = self._streams[source] = StreamRecovery(
                source, functools.partial(self.applier.steps, source), functools.partial(self.applier.release, source),
                self._metrics, replay, self._resync_s,
                # an agent that is gone serves its engine nothing: its tiers are empty until it is back
                empty_when_away=source.name == "agent")
            self._sources.setdefault(source.worker, []).append(source)
            self._caches.setdefault(source.cache, []).append(source)
        return stream

    async def _subscribe(self, stream: StreamRecovery) -> None:
        # block keys start from the worker's model: wait until its model list is known
        while self._model_of(stream.source.worker) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.1)
        await self._transport.subscribe(stream.source.endpoint, stream)

    def _detach(self, worker: str) -> list[asyncio.Task[None]]:
        """Forget a worker at once (so a worker re-added under the same URL starts clean) and cancel its
        subscriptions; returns their tasks to await."""
        tasks = self._tasks.pop(worker, [])
        for task in tasks:
            task.cancel()
        for source in self._sources.pop(worker, []):
            del self._streams[source]
            if self._caches.pop(source.cache, None) is not None:
                self.applier.forget_worker(source.cache)
                with contextlib.suppress(KeyError):
                    self._metrics.kv_worker_trusted.remove(source.cache)
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
        self._transport.close()

    def watched(self, worker: str) -> bool:
        return worker in self._tasks

    def any_sources(self) -> bool:
        """Whether any cache has an event source (without one, `trusted` is false for every cache)."""
        return bool(self._caches)

    def trusted(self, cache: str) -> bool:
        """Whether the index's picture of this cache (a worker's URL, or `URL#dpN` for a data-parallel rank) is
        complete (else its worker is routed by the approximate trie)."""
        sources = self._caches.get(cache, [])
        return bool(sources) and all(self._streams[source].complete() for source in sources)

    def learn(self, cache: str, keys: Sequence[int], cached_tokens: int) -> None:
        """The answer from this cache (`trusted`'s) to a request with these block keys (token mode) reported
        `cached_tokens` cached: while the picture of its engine is incomplete, that fills it in
        (`KvEventApplier.learn`)."""
        size = self.applier.block_size
        if not size or not keys:
            return
        for source in self._caches.get(cache, ()):
            if source.name == "engine" and not self._streams[source].complete():
                self.applier.learn(source, keys, min(cached_tokens // size, len(keys)))

    def _trusted_value(self, worker: str) -> float:
        return 1.0 if self.trusted(worker) else 0.0

    def engine_hashes(self, cache: str, tier: str) -> set[BlockHash]:
        """The engine block hashes the sources of a cache say it holds on `tier` (for checks and debugging)."""
        return self.applier.engine_hashes(cache, tier)
