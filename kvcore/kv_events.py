"""vLLM's KV-cache event wire format, and a publisher that speaks it (used by the simulator and the tier agent).

A message on the PUB socket has three frames: topic (UTF-8), sequence number (8 bytes big-endian, from 0) and a
msgpack `KVEventBatch` `[ts, events, data_parallel_rank]`; each event is a map whose first key is `"type"`.
A ROUTER socket answers replay requests `[b"", start_seq]` with `[b"", topic, seq, payload]` per buffered batch
whose seq >= start_seq, then the end marker `[b"", b"", -1 (8 signed bytes), b""]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Generator
from typing import Annotated, Any, cast

import msgspec
import zmq
import zmq.asyncio

from kvcore.log_throttle import LogThrottle

log = logging.getLogger(__name__)

# vLLM's bytes hashes are digests (32 bytes for sha256): a longer one is no engine's, and a receiver would keep it
HASH_MAX_BYTES = 64
BlockHash = int | Annotated[bytes, msgspec.Meta(max_length=HASH_MAX_BYTES)]
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)

# `medium`: where the blocks of an event live. vLLM's own: "GPU" (the engine's cache, also on CPU builds), "CPU"
# and "DISK" (offloaded); "SHARED" is kvgate's fleet-shared tier, reachable from every replica.
GPU, CPU, DISK, SHARED = "GPU", "CPU", "DISK", "SHARED"


# vLLM declares these fields without defaults, so they are on the wire in every event (None as nil, [] and 0
# included). Here they may be left out when constructing or decoding (→ None / [] / 0) but are always encoded:
# an UNSET default is replaced in __post_init__, so the value never equals the default that omit_defaults drops.
_SENT: Any = msgspec.UNSET


class BlockStored(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, kw_only=True):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = _SENT
    token_ids: list[int] = _SENT
    block_size: int = _SENT
    lora_id: int | None = _SENT
    medium: str | None = _SENT
    lora_name: str | None = _SENT
    # optional in vLLM: omitted at their default
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None

    def __post_init__(self) -> None:  # one test per field, no loop: the simulator makes millions of these
        if self.parent_block_hash is _SENT:
            self.parent_block_hash = None
        if self.token_ids is _SENT:
            self.token_ids = []
        if self.block_size is _SENT:
            self.block_size = 0
        if self.lora_id is _SENT:
            self.lora_id = None
        if self.medium is _SENT:
            self.medium = None
        if self.lora_name is _SENT:
            self.lora_name = None


class BlockRemoved(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, kw_only=True):
    block_hashes: list[BlockHash]
    medium: str | None = _SENT
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None

    def __post_init__(self) -> None:
        if self.medium is _SENT:
            self.medium = None


class AllBlocksCleared(msgspec.Struct, tag=True, tag_field="type", omit_defaults=True, kw_only=True):
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KvEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KvEventBatch)


def encode_batch(events: list[KvEvent], ts: float | None = None, rank: int | None = None) -> bytes:
    return _encoder.encode(KvEventBatch(ts=time.time() if ts is None else ts, events=events,
                                        data_parallel_rank=rank))


def decode_batch(payload: bytes) -> KvEventBatch:
    """Decode one payload; raises msgspec.DecodeError (or ValidationError) on garbage."""
    return _decoder.decode(payload)


class _LooseBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_loose_decoder = msgspec.msgpack.Decoder(_LooseBatch)
_event_decoder: msgspec.msgpack.Decoder[KvEvent] = msgspec.msgpack.Decoder(KvEvent)


_KNOWN_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def decode_batch_tolerant(payload: bytes) -> tuple[KvEventBatch, int, int]:
    """Decode one payload, skipping events of a type or shape this version does not know (a newer vLLM may
    add some) instead of losing the whole batch; returns the batch, how many events of an unknown type were
    skipped, and how many of a known type were skipped as malformed (a field of the wrong type: an event no engine
    could send, whose loss leaves the receiver's picture incomplete). Raises msgspec.DecodeError (or
    ValidationError) when the batch itself is garbage, nested too deep included."""
    try:
        return _decoder.decode(payload), 0, 0
    except msgspec.ValidationError:
        pass
    except RecursionError:
        raise _too_deep() from None
    steps = decode_batch_in_steps(payload, step_bytes=len(payload) + 1)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return cast(tuple[KvEventBatch, int, int], done.value)


def _too_deep() -> msgspec.DecodeError:
    """What a payload nested deeper than msgspec decodes is: garbage. msgspec raises RecursionError on it, which
    a caller catching DecodeError would let through (valid msgpack from a peer: `[[[...]]]` 100,000 deep)."""
    return msgspec.DecodeError("a payload nested too deep")


STEP_BYTES = 128 * 2**10  # events decoded between two yields of decode_batch_in_steps (1-3 ms)


def decode_batch_in_steps(payload: bytes,
                          step_bytes: int = STEP_BYTES) -> Generator[None, None, tuple[KvEventBatch, int, int]]:
    """`decode_batch_tolerant`, an event at a time, yielding after every `step_bytes` of events (its value, when
    it stops, is what that returns): for a payload so big that decoding it at once would hold the caller's event
    loop (4 MiB: 30-90 ms; the batch with its events left undecoded, 4-7 ms). Raises as that does, at the first
    step, when the batch itself is garbage."""
    try:
        loose = _loose_decoder.decode(payload)
    except RecursionError:  # (skipping an undecoded event recurses too)
        raise _too_deep() from None
    yield  # (that alone is 4-7 ms for 4 MiB)
    events: list[KvEvent] = []
    malformed = 0
    done = 0
    for raw in loose.events:
        if done >= step_bytes:
            yield
            done = 0
        done += len(raw)
        try:
            events.append(_event_decoder.decode(raw))
        except (msgspec.ValidationError, RecursionError):
            with contextlib.suppress(msgspec.DecodeError, RecursionError):
                event = msgspec.msgpack.decode(raw)
                if isinstance(event, dict) and event.get("type") in _KNOWN_TYPES:
                    malformed += 1
            continue
    batch = KvEventBatch(ts=loose.ts, events=events, data_parallel_rank=loose.data_parallel_rank)
    return batch, len(loose.events) - len(events) - malformed, malformed


BATCH_BLOCKS = 65_536  # blocks one published batch names at most
BATCH_BYTES = 2 * 2**20  # and about this many bytes at most (a hash takes up to 9, a token id up to 5)


def split_batches(events: list[KvEvent], max_blocks: int = BATCH_BLOCKS,
                  max_bytes: int = BATCH_BYTES) -> list[list[KvEvent]]:
    """The events in order, as batches naming at most `max_blocks` blocks and about `max_bytes` bytes each; an
    event too big for one is cut into pieces (a stored piece's parent is the last block of the piece before, its
    token ids its own blocks')."""
    batches: list[list[KvEvent]] = [[]]
    room = float(max_bytes)
    blocks_room = max_blocks
    for event in events:
        hashes = event.block_hashes if isinstance(event, (BlockStored, BlockRemoved)) else []
        weight = 9 + (5 * event.block_size if isinstance(event, BlockStored) and event.token_ids else 0)
        start = 0
        while True:
            take = max(0, min(blocks_room, int(room // weight), len(hashes) - start))
            if take == len(hashes) and start == 0:
                batches[-1].append(event)
            elif take > 0:
                batches[-1].append(_piece(event, start, start + take))
            room -= take * weight
            blocks_room -= take
            start += take
            if start >= len(hashes):
                break
            batches.append([])
            room, blocks_room = float(max_bytes), max_blocks
    return [batch for batch in batches if batch]


def _piece(event: KvEvent, start: int, stop: int) -> KvEvent:
    if isinstance(event, BlockRemoved):
        return msgspec.structs.replace(event, block_hashes=event.block_hashes[start:stop])
    assert isinstance(event, BlockStored)
    size = event.block_size
    return msgspec.structs.replace(
        event, block_hashes=event.block_hashes[start:stop],
        parent_block_hash=event.parent_block_hash if start == 0 else event.block_hashes[start - 1],
        token_ids=event.token_ids[start * size:stop * size] if event.token_ids else event.token_ids,
        extra_keys=event.extra_keys[start:stop] if event.extra_keys else event.extra_keys)


def dp_endpoint(endpoint: str, rank: int | None) -> str:
    """Where data-parallel rank `rank` of an engine publishes, given the engine's configured endpoint (vLLM's
    `ZmqEventPublisher.offset_endpoint_port`): a TCP port moves up by the rank, an ipc/inproc name gets `_dpN`."""
    if not rank:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return endpoint if port == "0" else f"{base}:{int(port) + rank}"


def should_bind(endpoint: str) -> bool:
    """vLLM binds an endpoint only if it has a wildcard host or is ipc/inproc; otherwise it connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


# the replay server lets the event loop run at least this often: a message already queued is received, and one the
# peer has room for is sent, without a round through the loop (50 requests for a 10,000-batch buffer held the tier
# agent's loop, and every lookup of its engines, for 9.5 s)
REPLAY_YIELD_S = 0.005


class KvEventPublisher:
    """Publishes event batches on a PUB socket and keeps the last `buffer_steps` for replay.

    `publish` is synchronous and never blocks (PUB drops when a subscriber is slow). The replay ROUTER
    is served by an asyncio task started with `start()` and cancelled by `close()`.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = 0,
    ) -> None:
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._attach(self._pub, endpoint)
        self._replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    @staticmethod
    def _attach(sock: zmq.Socket[Any], endpoint: str) -> None:
        if should_bind(endpoint):
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)

    @property
    def next_seq(self) -> int:
        return self._seq

    def publish(self, events: list[KvEvent]) -> int:
        """Send the events as one batch, or as several when they are too big for one (subscribers drop oversized
        batches: `split_batches`); returns the last batch's sequence number."""
        seq = self._seq
        for batch in split_batches(events) or [[]]:
            seq = self._seq
            self._seq += 1
            payload = encode_batch(batch, rank=self._rank)
            self._buffer.append((seq, payload))
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK, copy=False)
        return seq

    async def start(self) -> None:
        if self._replay_endpoint and self._task is None:
            actx = zmq.asyncio.Context.shadow(self._ctx)
            router = actx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self._attach(router, self._replay_endpoint)
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(router))

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        yielded_at = time.monotonic()
        malformed = LogThrottle()  # malformed requests: a line every 10 s at most

        async def let_others_in() -> None:
            nonlocal yielded_at
            if time.monotonic() - yielded_at > REPLAY_YIELD_S:
                await asyncio.sleep(0)
                yielded_at = time.monotonic()

        try:
            while True:
                frames = await router.recv_multipart()
                await let_others_in()
                if len(frames) != 3 or len(frames[2]) != 8:
                    held_back = malformed.due()
                    if held_back is not None:
                        log.warning("ignored %d malformed replay request(s), the last with %d frames", held_back + 1,
                                    len(frames))
                    continue
                identity, start = frames[0], int.from_bytes(frames[2], "big")
                for seq, payload in list(self._buffer):
                    if seq >= start:
                        await router.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
                        await let_others_in()
                await router.send_multipart((identity, b"", b"", END_OF_REPLAY, b""))
        finally:
            router.close(linger=0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._pub.close(linger=0)
        self._ctx.term()
