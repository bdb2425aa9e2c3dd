"""KV events in, applying them: what each source says its worker holds, written into the block index.

Engine block hashes depend on the engine's hash algorithm and seed; the gateway never needs them to match its
own. A `BlockStored` event carries the blocks' token ids, from which the gateway computes its own chained keys
(starting from its parent's key, or from the root key of the worker's model, LoRA adapter and cache salt), and
remembers engine hash → gateway key per worker for removals and for later events that carry no token ids (an
offload tier re-announcing blocks the engine described). Each (block, tier) a source announces is reference
counted, since offload tiers may announce the same block twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcore.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEvent
from router.block_keys import BlockKey, block_keys, root_key
from router.kv_index import TIERS, KvBlockIndex, tier_of
from router.kv_transport import EventSource
from router.metrics import GatewayMetrics

# worker URL -> the base model it serves (the root of its blocks' keys), None while unknown
ModelOf = Callable[[str], str | None]


@dataclass(slots=True)
class _Holding:
    key: BlockKey
    count: int


class KvEventApplier:
    """Turns each source's events into index entries under the gateway's keys."""

    def __init__(self, index: KvBlockIndex, metrics: GatewayMetrics, model_of: ModelOf) -> None:
        self.index = index
        self._metrics = metrics
        self._model_of = model_of
        self._held: dict[EventSource, dict[tuple[BlockHash, str], _Holding]] = {}
        self._sources: dict[str, list[EventSource]] = {}  # worker -> its sources
        self._hash_keys: dict[str, dict[BlockHash, BlockKey]] = {}  # worker -> engine hash -> gateway key

    def apply(self, source: EventSource, events: Sequence[KvEvent]) -> None:
        """Apply one batch of events from `source`, in order."""
        held = self._held.get(source)
        if held is None:
            held = self._held[source] = {}
            self._sources.setdefault(source.worker, []).append(source)
        worker = source.worker
        applied = self._metrics.kv_events_applied
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(source, held, event)
                applied.labels(worker, "BlockStored").inc()
            elif isinstance(event, BlockRemoved):
                self._removed(source, held, event)
                applied.labels(worker, "BlockRemoved").inc()
            elif isinstance(event, AllBlocksCleared):
                self.release(source)
                applied.labels(worker, "AllBlocksCleared").inc()
        self._update_gauges()

    def release(self, source: EventSource) -> None:
        """Forget everything `source` said (its blocks leave the index unless another source holds them)."""
        held = self._held.get(source)
        if not held:
            return
        gone = list(held.items())
        held.clear()  # in place: `apply` may be holding it, in the middle of a batch that goes on after a clear
        for (engine_hash, tier), holding in gone:
            self.index.remove(source.worker, (holding.key,), tier)
            self._drop_hash_if_unheld(source.worker, engine_hash)
        self._update_gauges()

    def forget_worker(self, worker: str) -> None:
        """Forget a worker and all its sources at once (a worker re-added under the same URL starts clean)."""
        for source in self._sources.pop(worker, []):
            del self._held[source]
        self._hash_keys.pop(worker, None)
        self.index.clear(worker)
        self._update_gauges()

    def engine_hashes(self, worker: str, tier: str) -> set[BlockHash]:
        """The engine block hashes the worker's sources say it holds on `tier` (for checks and debugging)."""
        return {h for source in self._sources.get(worker, ()) for (h, t) in self._held[source] if t == tier}

    # --- one event --------------------------------------------------------------------------------------------

    def _stored(self, source: EventSource, held: dict[tuple[BlockHash, str], _Holding], event: BlockStored) -> None:
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
                new_keys.append(_hold(held, engine_hash, tier, key))
        else:
            # an offload tier re-announcing blocks the engine described before
            for engine_hash in event.block_hashes:
                known = hash_keys.get(engine_hash)
                if known is None:
                    self._metrics.kv_unmapped_blocks.labels(worker).inc()
                    continue
                new_keys.append(_hold(held, engine_hash, tier, known))
        if new_keys:
            self.index.add(worker, new_keys, tier)

    def _removed(self, source: EventSource, held: dict[tuple[BlockHash, str], _Holding],
                 event: BlockRemoved) -> None:
        tier = tier_of(event.medium)
        gone = []
        for engine_hash in event.block_hashes:
            holding = held.get((engine_hash, tier))
            if holding is None:
                continue  # removals of unknown blocks are normal (e.g. after a reset)
            holding.count -= 1
            if holding.count <= 0:
                del held[(engine_hash, tier)]
                gone.append(holding.key)
                self._drop_hash_if_unheld(source.worker, engine_hash)
        if gone:
            self.index.remove(source.worker, gone, tier)

    def _root(self, worker: str, event: BlockStored) -> BlockKey | None:
        model = self._model_of(worker)
        if model is None:
            return None
        return root_key(model, event.lora_name, _salt(event))

    def _drop_hash_if_unheld(self, worker: str, engine_hash: BlockHash) -> None:
        """Keep engine hash -> key only while some source of the worker holds the block on some tier."""
        for source in self._sources.get(worker, ()):
            held = self._held[source]
            if any((engine_hash, tier) in held for tier in TIERS):
                return
        self._hash_keys.get(worker, {}).pop(engine_hash, None)

    def _update_gauges(self) -> None:
        self._metrics.kv_index_entries.set(self.index.entries())


def _hold(held: dict[tuple[BlockHash, str], _Holding], engine_hash: BlockHash, tier: str, key: BlockKey) -> BlockKey:
    holding = held.get((engine_hash, tier))
    if holding is None:
        held[(engine_hash, tier)] = _Holding(key, 1)
    else:
        holding.count += 1  # a re-announcement: one removal must not drop it
    return key


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
