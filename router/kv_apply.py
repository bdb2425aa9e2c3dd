"""KV events in, applying them: what each source says its worker holds, written into the block index.

Engine block hashes depend on the engine's hash algorithm and seed; the gateway never needs them to match its
own. A `BlockStored` event carries the blocks' token ids, from which the gateway computes its own chained keys
(starting from its parent's key, or from the root key of the worker's model, LoRA adapter and cache salt). Which
engine hash names which gateway key is *content identity*: it is kept per model, bounded, across resets, so
blocks announced after a reset still chain to parents announced before it, and announcements without token ids
(the tier agent's, an offload tier's) are placed by it. Such an announcement that arrives before the engine's
event for the same block waits for it (bounded in number per source, and in time) instead of being lost. While a
source's picture is incomplete (after a reset, a late start), what its worker's answers report cached (`learn`)
fills the index with the blocks it holds but will not announce again.

What a source holds is a set per (block, tier) for an engine (vLLM may re-announce a block it reuses: one
eviction removes it) and a reference count for the tier agent (whose protocol may announce a block once per
copy). Events are checked before they touch the index: an invalid event (a non-positive block size, more blocks
than `MAX_EVENT_BLOCKS`, a token id outside uint32 -- this one slice by slice, as the ids are converted), one with a
block size other than the gateway's, or one from a KV-cache group that is not full attention (hybrid and
sliding-window models index their full-attention group only) is counted and dropped; the first two make the
source's picture incomplete. A batch is applied in slices of SLICE_BLOCKS blocks, so that the caller can let the
event loop run between them.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import cast

from prometheus_client import Counter

from kvcore.dict_tables import OldestFirst, TableTrim
from kvcore.kv_events import GPU, AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KvEvent
from router.block_keys import BlockKey, chain_keys, root_key
from router.kv_index import TIERS, KvBlockIndex, tier_of
from router.kv_transport import EventSource
from router.metrics import GatewayMetrics

log = logging.getLogger(__name__)

# worker URL -> the base model it serves (the root of its blocks' keys), None while unknown. Everything else here
# names a worker's cache as the index does (`EventSource.cache`: the URL, or URL#dpN for a data-parallel rank)
ModelOf = Callable[[str], str | None]

MAX_EVENT_BLOCKS = 1 << 16  # blocks one BlockStored may name (vLLM: a step's new blocks of one request)
# blocks (or events: one rejected or of a group not indexed names none, and a batch of them never let the loop
# run) applied between two chances for the event loop to run
SLICE_BLOCKS = 2048
WAIT_S = 30.0  # how long an announcement without token ids waits for the engine to name its block
# announcements waiting at most, per source (its oldest give up first): with one cap over all sources, a broken or
# hostile source announcing 70,000 blocks no engine names pushed every other source's announcements out
WAIT_MAX = 65_536
MAX_HELD = 20_000_000  # blocks a source may hold on one tier, for an index without a bound of its own
IDENTITY_MODELS = 64  # models whose content identity is kept at most (the least recently used go first)
LEARNED_MAX = 65_536  # blocks learned from answers per source at most (the oldest are dropped first)
# tier -> what makes a source's map of engine hash -> gateway key there where not a dict (`compact_tables`)
HoldingTables = Mapping[str, Callable[[], MutableMapping[BlockHash, BlockKey]]]
# cache kinds whose blocks cover the whole prefix (vLLM's KVCacheSpecKind); None: a model with one group
FULL_PREFIX_KINDS = frozenset({None, "full_attention", "mla_attention", "sink_full_attention"})


class InvalidEvent(ValueError):
    """An event no engine could have sent."""


class _Holdings:
    """What one source says it holds: per tier, engine hash -> gateway key (one entry per block: a fleet's tiers
    announce millions), and for sources that announce copies (`counted`) the copies beyond the first."""

    __slots__ = ("extra", "tables", "tiers", "trims")

    def __init__(self, tables: HoldingTables) -> None:
        self.tiers: dict[str, MutableMapping[BlockHash, BlockKey]] = {}
        self.extra: dict[tuple[BlockHash, str], int] = {}
        self.trims: dict[str, TableTrim] = {}
        self.tables = tables

    def table(self, tier: str) -> MutableMapping[BlockHash, BlockKey]:
        """The map of `tier` (made, empty, if it has none)."""
        keys = self.tiers.get(tier)
        if keys is None:
            make = self.tables.get(tier)
            keys = self.tiers[tier] = make() if make is not None else {}
        return keys

    def trim(self, tier: str, inserted: int) -> None:
        """After `inserted` blocks were added on `tier`: its map kept at a copy's table size
        (`KvEventApplier.compact_tables`)."""
        keys = self.tiers.get(tier)
        if type(keys) is dict:
            trim = self.trims.get(tier)
            if trim is None:
                trim = self.trims[tier] = TableTrim()
            trim.check(cast(dict[BlockHash, BlockKey], keys), inserted)

    def __len__(self) -> int:
        return sum(len(keys) for keys in self.tiers.values())

    def key(self, engine_hash: BlockHash, tier: str) -> BlockKey | None:
        keys = self.tiers.get(tier)
        return keys.get(engine_hash) if keys else None

    def release(self, engine_hash: BlockHash, tier: str) -> BlockKey | None:
        """One copy fewer; the key once the last one is gone (None while copies remain)."""
        extra = self.extra
        if extra:
            n = extra.get((engine_hash, tier))
            if n is not None:
                if n > 1:
                    extra[(engine_hash, tier)] = n - 1
                else:
                    del extra[(engine_hash, tier)]
                return None
        return self.tiers[tier].pop(engine_hash)


@dataclass(slots=True)
class _Waiting:
    """An announcement without token ids whose engine hash is not known yet."""

    source: EventSource
    tier: str
    since: float


class _Names:
    """One model's names: a plain dict, oldest first (an OrderedDict's links cost 60 bytes more per name), whose
    oldest is found by `OldestFirst` (and whose table `trim` keeps at a copy's size, `ContentIdentity.compact`)."""

    __slots__ = ("keys", "oldest", "trim")

    OLDEST_RUN = 1024  # names read from the front at once: a full map forgets one per put

    def __init__(self) -> None:
        self.keys: dict[BlockHash, BlockKey] = {}
        self.oldest = OldestFirst(self.keys, self.OLDEST_RUN)
        self.trim = TableTrim()


class ContentIdentity:
    """Engine block hash → gateway key, per model, the most recent `max_blocks` per model (oldest forgotten
    first). Engines with the same hash algorithm and seed share their hashes' names; engines with others never
    produce the same 64-bit hash for other content, in practice."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.compact = False  # keep the maps at a copy's table size (`KvEventApplier.compact_tables`)
        self._by_model: dict[str, _Names] = {}

    def get(self, model: str, engine_hash: BlockHash) -> BlockKey | None:
        names = self._by_model.get(model)
        return names.keys.get(engine_hash) if names else None

    def names(self, model: str) -> _Names:
        """The model's names (created empty if it has none): for a caller that puts many at once, as `put` does
        (touching `oldest` for each), keeps them within `max_blocks` and, if `compact`, calls `trim` after."""
        by_model = self._by_model
        names = by_model.get(model)
        if names is None:
            names = by_model[model] = _Names()
            if len(by_model) > IDENTITY_MODELS:  # a worker naming another model at every listing: bounded
                del by_model[next(iter(by_model))]
        elif next(reversed(by_model)) != model:
            by_model[model] = by_model.pop(model)  # the most recently used last
        return names

    def put(self, model: str, engine_hash: BlockHash, key: BlockKey) -> None:
        names = self.names(model)
        keys = names.keys
        keys.pop(engine_hash, None)  # re-inserted: the newest again
        keys[engine_hash] = key
        names.oldest.touched(engine_hash)
        if len(keys) > self.max_blocks:
            names.oldest.pop()
        if self.compact:
            names.trim.check(keys, 1)

    def __len__(self) -> int:
        return sum(len(names.keys) for names in self._by_model.values())


@dataclass(slots=True)
class Applied:
    """What became of one batch: events rejected (the source's picture is then incomplete)."""

    rejected: int = 0


class KvEventApplier:
    """Turns each source's events into index entries under the gateway's keys."""

    def __init__(self, index: KvBlockIndex, metrics: GatewayMetrics, model_of: ModelOf, *, block_size: int = 0,
                 identity_blocks: int = 1 << 19, clock: Callable[[], float] = time.monotonic) -> None:
        """`clock`: what announcements wait on (`WAIT_S`); a simulation passes its virtual clock, so that its
        results do not depend on how fast the machine runs it."""
        self.index = index
        self._clock = clock
        self.block_size = block_size  # the gateway's; 0 = take each event's own (tests, tools)
        # blocks one source may hold on one tier: as many as the index holds at most (beyond, it drops the oldest)
        self.max_held: int = getattr(index, "max_entries", MAX_HELD)
        self._metrics = metrics
        self._model_of = model_of
        self.identity = ContentIdentity(identity_blocks)
        self._held: dict[EventSource, _Holdings] = {}
        self._sources: dict[str, list[EventSource]] = {}  # worker -> its sources
        self._group: dict[EventSource, int] = {}  # the KV-cache group indexed, once a source named one
        self._warned: set[tuple[EventSource, str]] = set()
        self._counters: dict[str, tuple[Counter, Counter, Counter]] = {}  # worker -> events applied, by type
        self._learned: dict[EventSource, dict[BlockKey, None]] = {}  # blocks learned from answers, oldest first
        self._waiting: dict[tuple[str, BlockHash], list[_Waiting]] = {}  # (model, engine hash) -> announcements
        self._waiting_count = 0
        # source -> its waiting announcements' (model, engine hash, tier), oldest first (the per-source cap)
        self._waiting_of: dict[EventSource, dict[tuple[str, BlockHash, str], None]] = {}
        self._compact = False  # see compact_tables
        self._tables: HoldingTables = {}  # see compact_tables
        metrics.kv_index_entries.set_function(index.entries)
        metrics.kv_waiting_announcements.set_function(self.waiting)

    def compact_tables(self, tables: HoldingTables | None = None) -> None:
        """From now on keep what sources hold and content identity at the table size a copy of their maps would
        have (`TableTrim`): half the memory of maps whose entries come and go, for copying a map into itself (tens
        of ms per 100,000 entries) whenever CPython would grow it. For long simulations (`kvgate bench vsim`); a
        live gateway would stall its event loop meanwhile. `tables`: tiers whose maps of engine hash -> gateway
        key are made by a factory instead of as dicts (a replay's NVMe tier in arrays, bench/sim/hash_map.py), for
        sources heard from afterwards."""
        self._compact = True
        self._tables = dict(tables or {})
        self.identity.compact = True

    # --- batches ------------------------------------------------------------------------------------------------

    def apply(self, source: EventSource, events: Sequence[KvEvent]) -> Applied:
        """Apply one batch of events from `source`, in order, at once."""
        result = Applied()
        for _ in self.steps(source, events, result):
            pass
        return result

    def steps(self, source: EventSource, events: Sequence[KvEvent], result: Applied) -> Iterator[None]:
        """Apply one batch in slices of about SLICE_BLOCKS blocks or events, yielding between them (the caller may
        let the event loop run there). Stops early if the source is forgotten meanwhile."""
        held = self._held.get(source)
        if held is None:
            held = self._held[source] = _Holdings(self._tables)
            self._sources.setdefault(source.cache, []).append(source)
        worker = source.cache  # the index's name for the cache this source describes (a DP rank has its own)
        model = self._model_of(source.worker)
        counters = self._counters.get(worker)
        if counters is None:
            applied = self._metrics.kv_events_applied
            counters = self._counters[worker] = (applied.labels(worker, "BlockStored"),
                                                 applied.labels(worker, "BlockRemoved"),
                                                 applied.labels(worker, "AllBlocksCleared"))
        done = 0
        for event in events:
            done += 1  # (an event costs its checks, whatever it names)
            if done >= SLICE_BLOCKS:
                done = 0
                yield
                if self._held.get(source) is not held:
                    return
            if isinstance(event, BlockStored):
                try:
                    self._check(event)
                except InvalidEvent as exc:
                    self._reject(source, "invalid_event", str(exc), result)
                    continue
                if not self._indexed_group(source, event.group_idx, event.kv_cache_spec_kind):
                    continue
                size = self.block_size or event.block_size
                if event.block_size != size:
                    self._reject(source, "block_size", f"block size {event.block_size}, the gateway's is {size}",
                                 result, mismatch=True)
                    continue
                for start in range(0, len(event.block_hashes), SLICE_BLOCKS):
                    try:
                        self._stored(source, held, event, start, size, model)
                    except InvalidEvent as exc:  # its blocks before this slice are applied; the picture is partial
                        self._reject(source, "invalid_event", str(exc), result)
                        break
                    done += min(SLICE_BLOCKS, len(event.block_hashes) - start)
                    if done >= SLICE_BLOCKS:
                        done = 0
                        yield
                        if self._held.get(source) is not held:
                            return  # forgotten (its worker left, or a reset) while we yielded
                else:
                    counters[0].inc()
            elif isinstance(event, BlockRemoved):
                if not self._indexed_group(source, event.group_idx, None):
                    continue
                for start in range(0, len(event.block_hashes), SLICE_BLOCKS):
                    self._removed(source, held, event.block_hashes[start:start + SLICE_BLOCKS], tier_of(event.medium),
                                  model)
                    done += min(SLICE_BLOCKS, len(event.block_hashes) - start)
                    if done >= SLICE_BLOCKS:
                        done = 0
                        yield
                        if self._held.get(source) is not held:
                            return
                counters[1].inc()
            elif isinstance(event, AllBlocksCleared):
                self.release(source)
                held = self._held[source]
                counters[2].inc()

    def release(self, source: EventSource) -> None:
        """Forget everything `source` said (its blocks leave the index unless another source holds them); what
        names which content is kept."""
        self._drop_waiting_of(source)
        learned = self._learned.pop(source, None)
        if learned:
            self.index.remove(source.cache, list(learned), GPU)
        held = self._held.get(source)
        if not held:
            return
        self._held[source] = _Holdings(self._tables)
        for tier, keys in held.tiers.items():
            self.index.remove(source.cache, list(keys.values()), tier)

    def forget_worker(self, worker: str) -> None:
        """Forget a worker and all its sources at once (a worker re-added under the same URL starts clean)."""
        self._counters.pop(worker, None)
        for source in self._sources.pop(worker, []):
            self._drop_waiting_of(source)
            self._held.pop(source, None)
            self._group.pop(source, None)
            self._learned.pop(source, None)
        self._warned = {warned for warned in self._warned if warned[0].cache != worker}
        for source in [source for source in self._waiting_of if source.cache == worker]:  # (any not in _sources)
            self._drop_waiting_of(source)
        self.index.clear(worker)

    def engine_hashes(self, worker: str, tier: str) -> set[BlockHash]:
        """The engine block hashes the worker's sources say it holds on `tier` (for checks and debugging)."""
        return {h for source in self._sources.get(worker, ()) for h in self._held[source].tiers.get(tier, ())}

    # --- what answers say -------------------------------------------------------------------------------------

    def learn(self, source: EventSource, keys: Sequence[BlockKey], cached: int) -> None:
        """The worker answered a request with these block keys, its first `cached` blocks found in its cache: the
        ones the index does not know of are held from now on, learned (the engine announced them while the
        gateway was not listening, and will not again); learned blocks past `cached` it no longer holds. A
        learned block leaves with the engine's removal of its hash (content identity names it), a later answer
        that did not find it, or a reset. For a source whose picture is incomplete: a complete one is told
        everything by its events."""
        worker = source.cache
        learned = self._learned.setdefault(source, {})
        gone = [key for key in keys[cached:] if key in learned]
        for key in gone:
            del learned[key]
        if gone:
            self.index.remove(worker, gone, GPU)
        if not cached:
            return
        run = self.index.lookup(keys[:cached], [worker])[worker].blocks
        fresh = [key for key in keys[run:cached] if key not in learned]
        if not fresh:
            return
        for key in fresh:
            learned[key] = None
        self.index.add(worker, fresh, GPU)
        while len(learned) > LEARNED_MAX:
            oldest = next(iter(learned))
            del learned[oldest]
            self.index.remove(worker, (oldest,), GPU)

    def learned(self, worker: str) -> int:
        """Blocks of the worker held because its answers said so (for checks and debugging)."""
        return sum(len(self._learned.get(source, ())) for source in self._sources.get(worker, ()))

    # --- checks -----------------------------------------------------------------------------------------------

    @staticmethod
    def _check(event: BlockStored) -> None:
        blocks = len(event.block_hashes)
        if blocks > MAX_EVENT_BLOCKS:
            raise InvalidEvent(f"{blocks} blocks in one event (at most {MAX_EVENT_BLOCKS})")
        tokens = event.token_ids
        if tokens:
            if event.block_size <= 0:
                raise InvalidEvent(f"block size {event.block_size}")
            if len(tokens) < event.block_size * blocks:
                raise InvalidEvent(f"{len(tokens)} token ids for {blocks} blocks of {event.block_size}")
            # each slice's token ids are checked as they are converted to uint32 (`_stored`): a min() and max()
            # over the million ids an event may carry held the event loop for tens of ms in one go
        elif event.block_size < 0:
            raise InvalidEvent(f"block size {event.block_size}")

    def _indexed_group(self, source: EventSource, group: int | None, kind: str | None) -> bool:
        """Whether an event of KV-cache group `group` (of `kind`, on stores) is indexed: events without a group
        are; otherwise the first full-attention group a source announces is, and no other."""
        if group is None:
            return True
        chosen = self._group.get(source)
        if chosen is None and kind is not None:
            if kind not in FULL_PREFIX_KINDS:
                self._skip(source, "group", f"KV-cache group {group} ({kind}) is not full attention; not indexed")
                return False
            chosen = self._group[source] = group
            log.info("kv events from %s: indexing KV-cache group %d (%s)", source.endpoint, group, kind)
        if chosen is None or group == chosen:
            return True
        self._skip(source, "group", f"KV-cache group {group} ignored: group {chosen} is the one indexed")
        return False

    def _skip(self, source: EventSource, reason: str, message: str) -> None:
        self._metrics.kv_event_mismatches.labels(source.cache, reason).inc()
        if (source, reason) not in self._warned:
            self._warned.add((source, reason))
            log.info("kv events from %s (%s): %s", source.endpoint, source.cache, message)

    def _reject(self, source: EventSource, reason: str, message: str, result: Applied, *,
                mismatch: bool = False) -> None:
        result.rejected += 1
        if mismatch:
            self._metrics.kv_event_mismatches.labels(source.cache, reason).inc()
        else:
            self._metrics.kv_decode_errors.labels(source.cache, reason).inc()
        if (source, reason) not in self._warned:
            self._warned.add((source, reason))
            log.error("kv events from %s (%s): dropped an event: %s; its worker is routed approximately until its "
                      "picture is whole again (counted in kvgate_kv_event_%s_total)", source.endpoint,
                      source.cache, message, "mismatches" if mismatch else "decode_errors")

    # --- one event --------------------------------------------------------------------------------------------

    def _stored(self, source: EventSource, held: _Holdings, event: BlockStored,
                start: int, size: int, model: str | None) -> None:
        """Blocks start .. start + SLICE_BLOCKS of a stored event."""
        worker = source.cache
        if model is None:
            self._metrics.kv_unmapped_blocks.labels(worker).inc(len(event.block_hashes) - start)
            return
        tier = tier_of(event.medium)
        counted = source.name == "agent"
        hashes = event.block_hashes[start:start + SLICE_BLOCKS]
        new_keys: list[BlockKey] = []
        if event.token_ids:
            try:
                tokens = array("I", event.token_ids[start * size:(start + len(hashes)) * size])
            except OverflowError:
                raise InvalidEvent("a token id outside 0..2^32-1") from None
            parent_hash = event.parent_block_hash if start == 0 else event.block_hashes[start - 1]
            parent = (root_key(model, event.lora_name, _salt(event)) if parent_hash is None
                      else self._key_of(model, worker, parent_hash))
            if parent is None:
                self._metrics.kv_unmapped_blocks.labels(worker).inc(len(hashes))
                return
            learned = self._learned.get(source) if tier == GPU else None
            # per block, `identity.put`, `_hold` and `_place_waiting` written out: this loop runs for every block
            # an engine computes
            names = self.identity.names(model)
            named, touched, forget = names.keys, names.oldest.touched, names.oldest.pop
            most = self.identity.max_blocks
            keys = held.tiers.get(tier)
            if keys is None:
                keys = held.table(tier)
            extra = held.extra
            waiting = self._waiting
            for engine_hash, key in zip(hashes, chain_keys(tokens, size, parent), strict=True):
                named.pop(engine_hash, None)  # re-inserted: the newest again
                named[engine_hash] = key
                touched(engine_hash)
                if len(named) > most:
                    forget()
                if engine_hash not in keys:
                    keys[engine_hash] = key
                    new_keys.append(key)
                elif counted:
                    extra[(engine_hash, tier)] = extra.get((engine_hash, tier), 0) + 1
                if learned:
                    learned.pop(key, None)  # announced now: its removal will be too
                if waiting:
                    self._place_waiting(model, engine_hash, key)
            if self._compact:
                names.trim.check(named, len(hashes))  # each block's name inserted anew
        else:
            # an agent or offload tier announcing blocks the engine named (or will name) with their tokens
            named = self.identity.names(model).keys
            keys = held.tiers.get(tier)
            extra = held.extra
            for engine_hash in hashes:
                known = named.get(engine_hash)
                if known is None:
                    known = self._key_of(model, worker, engine_hash)
                if known is None:
                    self._wait(model, engine_hash, source, tier)
                    continue
                # `_hold` written out: a tier agent announces every block it writes
                if keys is None:
                    keys = held.table(tier)
                if engine_hash not in keys:
                    keys[engine_hash] = known
                    new_keys.append(known)
                elif counted:
                    extra[(engine_hash, tier)] = extra.get((engine_hash, tier), 0) + 1
        if new_keys:
            if self._compact:
                held.trim(tier, len(new_keys))
            self.index.add(worker, new_keys, tier)
            if len(held.tiers[tier]) > self.max_held:
                self._drop_oldest(source, held, tier)

    def _drop_oldest(self, source: EventSource, held: _Holdings, tier: str) -> None:
        """A source holds more blocks on `tier` than the index can: its oldest tenth is forgotten (the index drops
        its oldest too), so that a source announcing blocks it never removes does not grow memory forever."""
        keys = held.tiers[tier]
        oldest = list(islice(keys.items(), len(keys) - int(self.max_held * 0.9)))
        extra = held.extra
        for engine_hash, _ in oldest:
            del keys[engine_hash]
            if extra:
                extra.pop((engine_hash, tier), None)
        self.index.remove(source.cache, [key for _, key in oldest], tier)

    def _removed(self, source: EventSource, held: _Holdings, hashes: Sequence[BlockHash], tier: str,
                 model: str | None) -> None:
        gone = []
        learned = self._learned.get(source) if tier == GPU else None
        holdings = held.tiers.get(tier) or {}
        extra = held.extra
        for engine_hash in hashes:
            if extra and engine_hash in holdings:  # a source announcing copies may hold more than one
                key = held.release(engine_hash, tier)
                if key is not None:
                    gone.append(key)
                continue
            key = holdings.pop(engine_hash, None)  # `release`, for a block held once: one probe, not two
            if key is not None:
                gone.append(key)
            elif model is not None:  # removals of unknown blocks are normal (e.g. after a reset)
                self._unwait(model, engine_hash, source, tier)
                if learned:
                    key = self.identity.get(model, engine_hash)
                    if key is not None and learned.pop(key, 0) is None:
                        gone.append(key)
        if gone:
            self.index.remove(source.cache, gone, tier)

    def _key_of(self, model: str, worker: str, engine_hash: BlockHash) -> BlockKey | None:
        """The gateway key an engine hash names: content identity, else a block a source of the worker holds."""
        key = self.identity.get(model, engine_hash)
        if key is not None:
            return key
        for source in self._sources.get(worker, ()):
            held = self._held[source]
            for tier in TIERS:
                key = held.key(engine_hash, tier)
                if key is not None:
                    return key
        return None

    # --- announcements waiting for their block's name ---------------------------------------------------------

    def _wait(self, model: str, engine_hash: BlockHash, source: EventSource, tier: str) -> None:
        now = self._clock()
        self._expire_waiting(now)
        waiting = self._waiting.setdefault((model, engine_hash), [])
        if any(w.source == source and w.tier == tier for w in waiting):
            return
        waiting.append(_Waiting(source, tier, now))
        self._waiting_count += 1
        mine = self._waiting_of.get(source)
        if mine is None:
            mine = self._waiting_of[source] = {}
        mine[(model, engine_hash, tier)] = None
        if len(mine) > WAIT_MAX:  # this source's oldest gives up; no other source's
            oldest_model, oldest_hash, oldest_tier = next(iter(mine))
            self._unwait(oldest_model, oldest_hash, source, oldest_tier)
            self._metrics.kv_unmapped_blocks.labels(source.cache).inc()

    def _place_waiting(self, model: str, engine_hash: BlockHash, key: BlockKey) -> None:
        waiting = self._waiting.pop((model, engine_hash), None) if self._waiting else None
        if not waiting:
            return
        self._forget_waiting(model, engine_hash, waiting)
        for w in waiting:
            held = self._held.get(w.source)
            if held is not None and _hold(held, engine_hash, w.tier, key, w.source.name == "agent"):
                self.index.add(w.source.cache, (key,), w.tier)

    def _unwait(self, model: str, engine_hash: BlockHash, source: EventSource, tier: str) -> None:
        waiting = self._waiting.get((model, engine_hash))
        if not waiting:
            return
        left = [w for w in waiting if not (w.source == source and w.tier == tier)]
        if len(left) == len(waiting):
            return
        self._forget_waiting(model, engine_hash, [w for w in waiting if w.source == source and w.tier == tier])
        if left:
            self._waiting[(model, engine_hash)] = left
        else:
            del self._waiting[(model, engine_hash)]

    def _forget_waiting(self, model: str, engine_hash: BlockHash, gone: list[_Waiting]) -> None:
        """Announcements taken out of `_waiting` (placed, withdrawn, given up): out of the counts too."""
        self._waiting_count -= len(gone)
        waiting_of = self._waiting_of
        for w in gone:
            mine = waiting_of.get(w.source)
            if mine is not None:
                mine.pop((model, engine_hash, w.tier), None)
                if not mine:
                    del waiting_of[w.source]

    def _expire_waiting(self, now: float) -> None:
        while self._waiting:
            oldest_key = next(iter(self._waiting))
            oldest = self._waiting[oldest_key]
            if now - oldest[0].since < WAIT_S:
                return
            del self._waiting[oldest_key]
            self._give_up(oldest_key, oldest)

    def _give_up(self, key: tuple[str, BlockHash], waiting: list[_Waiting]) -> None:
        self._forget_waiting(*key, waiting)
        for w in waiting:
            self._metrics.kv_unmapped_blocks.labels(w.source.cache).inc()

    def _drop_waiting_of(self, source: EventSource) -> None:
        """Take back every announcement of `source` still waiting: its own, found through `_waiting_of` (not a scan
        of every source's; an AllBlocksCleared from any source asks for this)."""
        mine = self._waiting_of.get(source)
        for model, engine_hash, tier in list(mine or ()):
            self._unwait(model, engine_hash, source, tier)

    def waiting(self) -> int:
        """Announcements waiting for the engine to name their block."""
        return self._waiting_count


def _hold(held: _Holdings, engine_hash: BlockHash, tier: str, key: BlockKey, counted: bool) -> bool:
    """Record that the source holds the block on `tier`; whether that is news. A set for an engine; a
    reference count where the protocol announces copies (`counted`)."""
    keys = held.tiers.get(tier)
    if keys is None:
        keys = held.table(tier)
    if engine_hash not in keys:
        keys[engine_hash] = key
        return True
    if counted:
        held.extra[(engine_hash, tier)] = held.extra.get((engine_hash, tier), 0) + 1
    return False


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
