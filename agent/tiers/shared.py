"""Fleet-shared tier: blocks every replica can reach, in Redis/Valkey (one key per block) or a shared directory.

Names are content addressed (`<prefix>:<layout>-<hash>` keys, `<dir>/<prefix>/<xx>/<layout>-<hash>` files), so the
same prefix computed on any replica lands under the same name; entries expire `ttl_s` after their last write
(Redis TTL; mtime sweep for the directory), so blocks of a changed system prompt age out. Blocks carry a keyed MAC
when the fleet has a secret (agent/block.py's `BlockSeal`): whoever can write the backend cannot plant KV.
`contains` answers from a local index (own writes, reads, other replicas' writes as Redis publishes them, or a
periodic `refresh_index` of the directory), never from a remote round trip. When the backend cannot be reached,
the tier counts a backend error, answers misses and refuses writes for `retry_s`, then tries again (redis-py
reconnects by itself); a write the backend refuses (out of memory) only pauses writes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agent.block import BlockError, BlockKey, BlockSeal, ChecksumError, decode_header, key_name, parse_key_name
from agent.protocol import MAX_HASH_BYTES
from agent.tiers.base import (
    Buffer,
    HeldBlock,
    RemovalListener,
    Removed,
    StoreItem,
    TierName,
    TierStats,
    TierUsage,
)
from agent.tiers.nvme import open_regular, write_file_atomically

if TYPE_CHECKING:  # redis-py is imported by the Redis tier when one is made: the simulator never uses it (6 MB)
    import redis
    import redis.cluster

SHARED_FILE_MODE = 0o640  # the fleet's agents share a group, nobody else reads prompts' KV
SHARED_DIR_MODE = 0o750

log = logging.getLogger(__name__)


# the most blocks a shared tier's index remembers (--shared-index-blocks): the fleet's writes enter every agent's
# index and leave it only when their TTL runs out, so a fleet storing empty blocks grew it without bound. tracemalloc
# over 200,000 announced blocks (`learn`): 257 bytes an entry (int hashes) to 314 (64-byte hashes); 2^22 entries are
# 1.1-1.3 GB at most, the blocks of 64 GiB of 16 KiB blocks (vLLM's smallest), of 8 TiB of 2 MiB ones
INDEX_BLOCKS = 2**22


class BackendDown(Exception):
    """The shared backend is unreachable (or in its back-off window after an error)."""


class SharedTier:
    """Index, TTL bookkeeping, stats and back-off common to every backend. `clock` (monotonic seconds) is what
    expiry and back-off are measured on: a simulation passes its virtual clock."""

    name = TierName.SHARED

    def __init__(self, ttl_s: float, retry_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 secret: bytes | None = None, index_blocks: int = INDEX_BLOCKS) -> None:
        self.ttl_s = ttl_s
        self.index_blocks = max(1, index_blocks)
        self.retry_s = retry_s
        self.clock = clock
        self.seal = BlockSeal(secret)
        self.stats = TierStats()
        self.on_removed: RemovalListener | None = None
        # key -> (expiry on `clock`, bytes or 0), in expiry order: an entry whose expiry moves goes to the end; at most
        # `index_blocks` of them (`_trim_locked`)
        self._index: OrderedDict[BlockKey, tuple[float, int]] = OrderedDict()
        self._down_until = 0.0
        self._writes_down_until = 0.0
        self._lock = threading.Lock()

    # -- backend hooks ---------------------------------------------------------------------------------------

    def _put_many(self, items: list[tuple[BlockKey, bytes, Buffer]]) -> set[int]:
        """Write (key, prefix, payload) blocks, each whole or not at all, each with its TTL; the positions of those
        not written because their place in the backend is taken by something else (the others are written)."""
        raise NotImplementedError

    def _fetch_many(self, keys: list[BlockKey], outs: list[memoryview]) -> list[int | Exception | None]:
        raise NotImplementedError

    def _exists_many(self, keys: list[BlockKey]) -> list[bool]:
        raise NotImplementedError

    def _delete(self, key: BlockKey) -> None:
        raise NotImplementedError

    def _list_keys(self) -> Iterable[BlockKey]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def sweep(self) -> int:
        """Delete what outlived the TTL where the backend does not expire entries itself; how many went."""
        return 0

    # -- back-off --------------------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the backend is believed reachable: lookups count shared blocks, loads and writes try it."""
        return self.clock() >= self._down_until

    def _failed(self, exc: Exception) -> None:
        self.stats.add("backend_errors")
        self._down_until = self.clock() + self.retry_s
        log.warning("shared tier backend error (retrying in %.1f s): %s", self.retry_s, exc)

    def _write_refused(self, exc: Exception) -> None:
        """The backend answered and refused a write (out of memory, read-only replica): reads go on; writes pause
        for `retry_s`."""
        self.stats.add("backend_errors")
        self._writes_down_until = self.clock() + self.retry_s
        log.warning("shared tier refused a write (writes paused for %.1f s, reads go on): %s", self.retry_s, exc)

    def _refuses_writes(self, exc: Exception) -> bool:
        """Whether `exc` is the backend refusing a write while it can still serve reads."""
        return False

    def _expiry(self) -> float:
        return self.clock() + self.ttl_s if self.ttl_s > 0 else float("inf")

    # -- interface -------------------------------------------------------------------------------------------

    def store(self, key: BlockKey, payload: Buffer, digest: int | None = None) -> bool:
        return self.store_many([StoreItem(key, payload, digest)]) == 1

    def store_many(self, items: Sequence[StoreItem]) -> int:
        """Write blocks in one round trip; returns how many were written (0 when the backend is down)."""
        todo = [(key, payload, digest) for key, payload, digest, _parent in items if not self.contains(key)]
        if not todo:
            return len(items)
        if not self.available or self.clock() < self._writes_down_until:
            self.stats.add("refused", len(todo))
            return 0
        parts = [(key, self.seal.prefix(key, payload, digest), payload) for key, payload, digest in todo]
        try:
            skipped = self._put_many(parts)
        except Exception as exc:
            if self._refuses_writes(exc):
                self._write_refused(exc)
            else:
                self._failed(exc)
            self.stats.add("refused", len(todo))
            return 0
        expiry = self._expiry()
        entry = (expiry, -1)
        with self._lock:
            index = self._index
            for position, (key, payload, _digest) in enumerate(todo):
                if position in skipped:
                    continue
                size = self.seal.prefix_size + len(payload)
                if entry[1] != size:  # one entry for a write's blocks of one size: the index can hold millions
                    entry = (expiry, size)
                index[key] = entry
                index.move_to_end(key)
            trimmed = self._trim_locked()
        self._report(trimmed)
        self.stats.add("stores", len(todo) - len(skipped))
        if skipped:
            self.stats.add("refused", len(skipped))
        return len(items) - len(skipped)

    def read_into(self, key: BlockKey, out: memoryview, touch: bool = True) -> int | None:
        return self.read_many([key], [out])[0]

    def read_many(self, keys: Sequence[BlockKey], outs: Sequence[memoryview], touch: bool = True) -> list[int | None]:
        """Fetch blocks in one round trip into `outs`; each entry its length or None (miss or bad block)."""
        if not keys:
            return []
        if not self.available:
            self.stats.add("misses", len(keys))
            return [None] * len(keys)
        try:
            results = self._fetch_many(list(keys), list(outs))
        except Exception as exc:
            self._failed(exc)
            self.stats.add("misses", len(keys))
            return [None] * len(keys)
        lengths: list[int | None] = []
        expiry = self._expiry()
        for key, result in zip(keys, results, strict=True):
            if isinstance(result, int):
                self.stats.add("hits")
                size = self.seal.prefix_size + result
                with self._lock:
                    previous = self._index.get(key)
                    if previous is None or previous[1] != size:  # (an equal entry stays: no new one per hit)
                        self._index[key] = (previous[0] if previous else expiry, size)
                    trimmed = self._trim_locked()
                self._report(trimmed)
                lengths.append(result)
                continue
            self.stats.add("misses")
            if isinstance(result, ChecksumError):
                log.warning("shared tier: %s: %s", key_name(key), result)
                self.stats.add("checksum_failures")
                self._drop(key, remote=True)
            elif isinstance(result, Exception):
                log.warning("shared tier: unreadable block %s: %s", key_name(key), result)
                self.stats.add("read_errors")
                self._drop(key, remote=isinstance(result, BlockError))
            else:
                self._drop(key, remote=False)
            lengths.append(None)
        return lengths

    def contains(self, key: BlockKey) -> bool:
        entry = self._index.get(key)
        return entry is not None and entry[0] > self.clock()

    def held(self, key: BlockKey) -> HeldBlock | None:
        return None

    def touch(self, keys: Sequence[BlockKey]) -> None:
        pass  # entries live for the TTL from their last write

    def above_high_watermark(self) -> bool:
        return False  # the backend's own bound (maxmemory, quota) governs

    def evict_to_low_watermark(self, offered: Collection[BlockKey] | None = None) -> None:
        pass

    def demotion_candidates(self) -> list[tuple[BlockKey, int]]:
        return []

    def upkeep(self) -> None:
        """Forget (and report) index entries past their TTL: the backend dropped those blocks by itself."""
        now = self.clock()
        gone: list[Removed] = []
        with self._lock:
            index = self._index
            while index and next(iter(index.values()))[0] <= now:  # oldest expiry first: O(expired)
                gone.append(Removed(index.popitem(last=False)[0]))
        self._report(gone)

    def probe(self, keys: list[BlockKey]) -> list[bool]:
        """Ask the backend which of these blocks exist (one round trip) and remember the answer."""
        if not keys or not self.available:
            return [False] * len(keys)
        try:
            found = self._exists_many(keys)
        except Exception as exc:
            self._failed(exc)
            return [False] * len(keys)
        entry = (self._expiry(), 0)
        gone: list[Removed] = []
        with self._lock:
            for key, present in zip(keys, found, strict=True):
                if present:
                    if key not in self._index:
                        self._index[key] = entry
                elif self._index.pop(key, None) is not None:
                    gone.append(Removed(key))
            gone += self._trim_locked()
        self._report(gone)
        return found

    def learn(self, keys: Iterable[BlockKey], gone: Iterable[BlockKey] = ()) -> None:
        """Other replicas wrote `keys` and deleted `gone` (as the backend announced it)."""
        expiry = self._expiry()
        removed: list[Removed] = []
        with self._lock:
            for key in keys:
                self._index[key] = (expiry, self._index.get(key, (0.0, 0))[1])
                self._index.move_to_end(key)
            for key in gone:
                if self._index.pop(key, None) is not None:
                    removed.append(Removed(key))
            removed += self._trim_locked()
        self._report(removed)

    def refresh_index(self) -> int:
        """Learn every block the backend holds (other replicas' writes included); returns how many."""
        if not self.available:
            return 0
        try:
            found = list(self._list_keys())
        except Exception as exc:
            self._failed(exc)
            return 0
        return self._reconcile(found)

    def _reconcile(self, found: list[BlockKey]) -> int:
        """The backend holds exactly `found`: learn what is new, forget (and report) what is gone or expired."""
        expiry = self._expiry()
        now = self.clock()
        with self._lock:
            present = set(found)
            for key in found:
                if key not in self._index:
                    self._index[key] = (expiry, 0)
            gone = [Removed(k) for k, (exp, _n) in self._index.items() if k not in present or exp <= now]
            for removed in gone:
                del self._index[removed.key]
            gone += self._trim_locked()
        self._report(gone)
        return len(found)

    def _trim_locked(self) -> list[Removed]:
        """Past `index_blocks`, forget the entries that expire soonest (the front; counted as evictions, reported
        as removed): a block the backend still holds is a miss here until a probe or a read learns it again."""
        index = self._index
        over = len(index) - self.index_blocks
        if over <= 0:
            return []
        self.stats.add("evictions", over)
        return [Removed(index.popitem(last=False)[0]) for _ in range(over)]

    def delete(self, key: BlockKey) -> bool:
        return self._drop(key, remote=True)

    def _drop(self, key: BlockKey, remote: bool) -> bool:
        with self._lock:
            known = self._index.pop(key, None) is not None
        if remote and self.available:
            try:
                self._delete(key)
            except Exception as exc:
                self._failed(exc)
        if known:
            self._report([Removed(key)])
        return known

    def _report(self, removed: list[Removed]) -> None:
        if removed and self.on_removed is not None:
            self.on_removed(removed)

    def usage(self) -> TierUsage:
        """Blocks known locally; bytes of those whose size is known (the backend's own bound governs)."""
        now = self.clock()
        entries = [(exp, n) for exp, n in list(self._index.values()) if exp > now]
        return TierUsage(sum(n for _e, n in entries), len(entries), 0)

    def block_keys(self) -> Iterable[BlockKey]:
        return list(self._index)


class RedisSharedTier(SharedTier):
    """One Redis/Valkey string per block (`<prefix>:<layout>-<hash>`), prefix (header, tag) then payload, read with
    pipelined GETs whose replies go from the socket into the caller's buffers (`_GetReplies`). A block of 256 KiB or
    more is two strings instead, `<name>` the prefix and `<name>:p` the payload, each written with one `SET ... PX
    ttl`: the payload goes to the socket as it is, never copied into a new buffer first (for MiB-sized blocks that
    copy, page faults included, cost more than the network), and every key is created with its TTL (a `SET` +
    `SETRANGE` pipeline left a key without one when it expired in between, or the writer died); a reader that finds
    one string without the other, or a payload that does not match its prefix, has a miss. Smaller blocks are joined
    with their prefix and written with one SET. Every chain written is announced on `<prefix>:blocks` (PUBLISH
    `+name name ...`; deletions `-name ...`): `listen()` subscribes to it, so a block another replica wrote is in
    this replica's index within a round trip of its write, without scanning the keyspace; while the subscription is
    down the tier counts as unavailable (lookups do not count shared blocks)."""

    def __init__(self, url: str, *, prefix: str = "kvgate", ttl_s: float = 3600.0, cluster: bool = False,
                 timeout_s: float = 0.5, retry_s: float = 1.0, secret: bytes | None = None,
                 index_blocks: int = INDEX_BLOCKS) -> None:
        super().__init__(ttl_s, retry_s, secret=secret, index_blocks=index_blocks)
        self.prefix = prefix
        self.channel = f"{prefix}:blocks"
        import redis.cluster

        options: dict[str, Any] = dict(socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.client: redis.Redis | redis.cluster.RedisCluster
        self._redis = redis
        if cluster:
            self.client = redis.cluster.RedisCluster.from_url(url, **options)
        else:
            self.client = redis.Redis.from_url(url, **options)
        self._closed = threading.Event()
        self._listener: threading.Thread | None = None
        self._subscribed = threading.Event()
        self._unsubscribed = threading.Event()  # the subscription failed and is not back yet: the backend is down

    # -- the subscription ------------------------------------------------------------------------------------

    def listen(self) -> None:
        """Follow other replicas' writes and deletions from now on (a thread, until `close`)."""
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, name="kvgate-shared-listen", daemon=True)
            self._listener.start()

    @property
    def available(self) -> bool:
        return super().available and not self._unsubscribed.is_set()

    def wait_subscribed(self, timeout: float) -> bool:
        return self._subscribed.wait(timeout)

    def _listen(self) -> None:
        while not self._closed.is_set():
            # untyped before redis-py 8.2, typed since: the ignore holds for both
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call, unused-ignore]
            try:
                pubsub.subscribe(self.channel)
                # what was written before (or while we were away): one scan per (re)subscription, not per period
                self._reconcile(list(self._list_keys()))
                self._down_until = 0.0
                self._unsubscribed.clear()
                self._subscribed.set()
                last_ping = time.monotonic()
                while not self._closed.is_set():
                    self._announced(self._waiting_announcements(pubsub))
                    if time.monotonic() - last_ping > 1.0:  # a dead connection shows itself within a second
                        pubsub.ping()
                        last_ping = time.monotonic()
            except Exception as exc:
                self._subscribed.clear()
                self._unsubscribed.set()
                if not self._closed.is_set():
                    self._failed(exc)
                    self._closed.wait(self.retry_s)
            finally:
                self._subscribed.clear()
                with contextlib.suppress(Exception):
                    pubsub.close()

    def _waiting_announcements(self, pubsub: Any) -> list[bytes | str]:
        """The channel's messages already waiting (up to `_ANNOUNCEMENT_BATCH` of them, or the first to come within
        0.2 s): taken one by one, each confirmed with a round trip of its own, a publisher of many small messages
        outran the listener, and the server cut the subscription off at its pub/sub output buffer limit (a full
        scan at every subscription again)."""
        batch: list[bytes | str] = []
        message = pubsub.get_message(timeout=0.2)
        while message is not None:
            if message.get("type") == "message":
                batch.append(message["data"])
                if len(batch) >= _ANNOUNCEMENT_BATCH:
                    break
            message = pubsub.get_message(timeout=0)
        return batch

    def _announced(self, messages: Sequence[bytes | str]) -> None:
        """Messages on the channel: `+name ...` (written) or `-name ...` (deleted). Anyone who may PUBLISH there
        can send one, so nothing they say is taken on trust: what is not a list of block names (of hashes a request
        may name) is dropped, and the rest is confirmed with the backend, one pipelined EXISTS for the messages'
        distinct names, asked after all of them arrived: a name announced written is learned if the block is there
        now, one announced deleted forgotten if it is not (`+x` then `-x` ends as the backend holds x now, not as
        the last message says). Every name dropped is counted."""
        announced: list[tuple[bool, list[BlockKey]]] = []
        distinct: dict[BlockKey, bool] = {}
        dropped = 0
        for data in messages:
            try:
                text = data.decode() if isinstance(data, bytes) else str(data)
            except UnicodeDecodeError:
                dropped += 1
                continue
            names = text[1:].split()
            if text[:1] not in ("+", "-") or not names:
                dropped += max(1, len(names))
                continue
            keys = [k for k in map(parse_key_name, names)
                    if k is not None and (isinstance(k[1], int) or len(k[1]) <= MAX_HASH_BYTES)]
            dropped += len(names) - len(keys)
            if keys:
                announced.append((text[0] == "+", keys))
                distinct.update(dict.fromkeys(keys, False))
        if distinct:
            asked = list(distinct)
            # (a backend error: the subscription starts again, with a scan)
            distinct.update(zip(asked, self._exists_many(asked), strict=True))
            learned: list[BlockKey] = []
            gone: list[BlockKey] = []
            for written, keys in announced:
                confirmed = [k for k in keys if distinct[k] == written]
                dropped += len(keys) - len(confirmed)
                (learned if written else gone).extend(confirmed)
            self.learn(learned, gone=gone)
        if dropped:
            self.stats.add("dropped_announcements", dropped)

    # -- backend hooks ---------------------------------------------------------------------------------------

    def _name(self, key: BlockKey) -> str:
        return f"{self.prefix}:{key_name(key)}"

    def _refuses_writes(self, exc: Exception) -> bool:
        return isinstance(exc, self._redis.ResponseError)

    def _put_many(self, items: list[tuple[BlockKey, bytes, Buffer]]) -> set[int]:
        px = int(self.ttl_s * 1000) if self.ttl_s > 0 else None
        if not isinstance(self.client, self._redis.cluster.RedisCluster):
            self._put_direct(self.client, items, px)
            return set()  # (SET replaces a key of any type)
        # a cluster's nodes each take their keys: redis-py's cluster pipeline sends them there
        pipe = self.client.pipeline(transaction=False)  # type: ignore[no-untyped-call, unused-ignore]
        for key, prefix, payload in items:
            name = self._name(key)
            if len(payload) < _COPY_BELOW:  # small: one SET of a joined copy is cheaper than two keys
                pipe.set(name, b"".join((prefix, payload)), px=px)
            else:
                pipe.set(name + _PAYLOAD, _sendable(payload), px=px)
                pipe.set(name, prefix, px=px)
        pipe.execute()
        self.client.publish(self.channel, "+" + " ".join(key_name(key) for key, _prefix, _payload in items))
        return set()

    def _put_direct(self, client: redis.Redis, items: list[tuple[BlockKey, bytes, Buffer]], px: int | None) -> None:
        """The same SETs and PUBLISH as through redis-py's pipeline, packed here: small blocks' commands, prefix and
        payload copied once into one buffer (redis-py sent each value above 6000 bytes with a send of its own, and
        packed each command through several Python calls), large payloads sent as they are. Every reply is read; the
        first error reply (out of memory: `_refuses_writes`) is raised after them, as the pipeline raises it."""
        ttl = b"" if px is None else b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(px)), px)
        head = b"*5\r\n$3\r\nSET\r\n" if px is not None else b"*3\r\n$3\r\nSET\r\n"
        chunks: list[Buffer] = []
        packed = bytearray()
        names: list[str] = []
        commands = 1  # the PUBLISH
        for key, prefix, payload in items:
            name = key_name(key)
            names.append(name)
            full = f"{self.prefix}:{name}".encode()
            if len(payload) < _COPY_BELOW:  # small: one SET of a joined copy is cheaper than two keys
                packed += b"%s$%d\r\n%s\r\n$%d\r\n" % (head, len(full), full, len(prefix) + len(payload))
                packed += prefix
                packed += payload
                packed += b"\r\n%s" % ttl
                commands += 1
                continue
            packed += b"%s$%d\r\n%s:p\r\n$%d\r\n" % (head, len(full) + 2, full, len(payload))
            chunks.append(packed)
            chunks.append(_sendable(payload))
            packed = bytearray(b"\r\n%s" % ttl)
            packed += b"%s$%d\r\n%s\r\n$%d\r\n%s\r\n%s" % (head, len(full), full, len(prefix), prefix, ttl)
            commands += 2
        channel = self.channel.encode()
        announcement = ("+" + " ".join(names)).encode()
        packed += b"*3\r\n$7\r\nPUBLISH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
            len(channel), channel, len(announcement), announcement)
        chunks.append(packed)
        ResponseError = self._redis.ResponseError

        def attempt() -> None:
            conn.send_packed_command(chunks)
            refused: Exception | None = None
            for _ in range(commands):
                try:
                    conn.read_response()
                except ResponseError as exc:  # an error reply, read whole: the replies after it are read too
                    refused = refused or exc
            if refused is not None:
                raise refused

        conn = _pooled_connection(client.connection_pool)
        try:
            conn.retry.call_with_retry(attempt, lambda _error: conn.disconnect())
        except ResponseError:
            raise
        except BaseException:
            conn.disconnect()  # whatever is left of the replies must not reach the connection's next user
            raise
        finally:
            client.connection_pool.release(conn)

    def _fetch_many(self, keys: list[BlockKey], outs: list[memoryview]) -> list[int | Exception | None]:
        """GETs of the blocks' strings, pipelined, read off the socket straight into `outs` (`_GetReplies`); a
        reply that path does not take (a redirection, an error, a push message), or on a cluster any failure, has
        the batch fetched again through redis-py's pipeline, which knows them all (and a cluster's slots)."""
        names = [self._name(key) for key in keys]
        batch = _Fetch(self.seal.prefix_size, outs)
        try:
            if isinstance(self.client, self._redis.cluster.RedisCluster):
                try:
                    self._fetch_direct_cluster(self.client, names, batch)
                except Exception as exc:  # (a slot not covered is no RedisError): the pipeline refreshes the slots
                    log.debug("shared tier: a cluster fetch goes through the pipeline: %s", exc)
                    return self._fetch_pipelined(keys, names, outs)
            else:
                self._fetch_direct(self.client, names, batch)
        except _Surprise as exc:
            log.debug("shared tier: a fetch goes through the pipeline: %s", exc)
            return self._fetch_pipelined(keys, names, outs)
        return batch.results(self.seal, keys)

    def _fetch_direct(self, client: redis.Redis, names: list[str], batch: _Fetch) -> None:
        """One server's GETs, pipelined on one pooled connection, retried as redis-py retries a pipeline."""
        conn = _pooled_connection(client.connection_pool)
        try:
            conn.retry.call_with_retry(lambda: _GetReplies.run(conn, batch, names, range(len(names))),
                                       lambda _error: conn.disconnect())
        except BaseException:
            conn.disconnect()  # whatever is left of the replies must not reach the connection's next user
            raise
        finally:
            client.connection_pool.release(conn)

    def _fetch_direct_cluster(self, client: redis.cluster.RedisCluster, names: list[str], batch: _Fetch) -> None:
        """Each node's GETs on a connection of its own: all sent first, then each node's replies read (keys of
        one block may live on different nodes: its prefix's and its payload's strings hash apart)."""
        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, name in enumerate(names):
            for command in (2 * i, 2 * i + 1) if batch.split[i] else (2 * i,):
                string = name + _PAYLOAD if command % 2 else name
                node = client.get_node_from_key(string)  # type: ignore[no-untyped-call, unused-ignore]
                by_node.setdefault(node.name, (node, []))[1].append(command)
        taken: list[tuple[Any, Any]] = []
        try:
            sent: list[tuple[_GetReplies, list[int]]] = []
            for node, commands in by_node.values():
                pool = client.get_redis_connection(node).connection_pool
                conn = _pooled_connection(pool)
                taken.append((pool, conn))
                sent.append((_GetReplies.send(conn, names, commands), commands))
            for replies, commands in sent:
                replies.read(batch, commands)
        except BaseException:
            for _pool, conn in taken:
                conn.disconnect()
            raise
        finally:
            for pool, conn in taken:
                pool.release(conn)

    def _fetch_pipelined(self, keys: list[BlockKey], names: list[str],
                         outs: list[memoryview]) -> list[int | Exception | None]:
        """The same fetch through redis-py's pipeline (values as bytes, then copied)."""
        pipe = self.client.pipeline(transaction=False)
        split = [len(out) >= _COPY_BELOW for out in outs]  # a payload this big may be in its own string
        for name, two in zip(names, split, strict=True):
            pipe.get(name)
            if two:
                pipe.get(name + _PAYLOAD)
        # an error reply stays that GET's value (WRONGTYPE: one block refused, not the backend counted down)
        values = iter(pipe.execute(raise_on_error=False))
        results: list[int | Exception | None] = []
        for key, two, out in zip(keys, split, outs, strict=True):
            value, payload_value = next(values), next(values) if two else None
            if value is None:
                results.append(None)
                continue
            try:
                for reply in (value, payload_value):
                    if isinstance(reply, Exception):
                        if "WRONGTYPE" not in str(reply):
                            raise reply
                        raise BlockError(f"a key of another type: {reply}")
                if payload_value is not None and len(value) == self.seal.prefix_size:
                    payload: memoryview = memoryview(payload_value)
                    self.seal.open(key, value, payload)
                else:
                    payload = self.seal.verify(key, value)
                if len(payload) > len(out):  # the caller's buffer is too small: a miss, the block is fine
                    results.append(None)
                    continue
                out[: len(payload)] = payload
                results.append(len(payload))
            except BlockError as exc:
                results.append(exc)
        return results

    def _exists_many(self, keys: list[BlockKey]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._name(key))
        return [bool(n) for n in pipe.execute()]

    def _delete(self, key: BlockKey) -> None:
        self.client.delete(self._name(key))
        self.client.delete(self._name(key) + _PAYLOAD)
        self.client.publish(self.channel, "-" + key_name(key))

    def _list_keys(self) -> Iterable[BlockKey]:
        skip = len(self.prefix) + 1
        for raw in self.client.scan_iter(match=f"{self.prefix}:*", count=1000):
            # (a name that is not UTF-8 is no block's: it raised, and every subscription's scan with it)
            name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            key = parse_key_name(name[skip:])
            if key is not None:
                yield key

    def close(self) -> None:
        self._closed.set()
        if self._listener is not None:
            self._listener.join(2)
        self.client.close()


_ANNOUNCEMENT_BATCH = 1024  # channel messages confirmed with one pipelined EXISTS at most
_COPY_BELOW = 256 * 1024  # payloads smaller than this are joined with their prefix and SET at once
_PAYLOAD = ":p"  # the payload's own string, beside its prefix's, for larger blocks
_READ_CHUNK = 256 * 1024  # what one recv takes for replies' headers and small values


class _Surprise(Exception):
    """A reply the direct GET path does not take (an error, a redirection, a push message, garbage)."""


class _NotAString(Exception):
    """A GET answered WRONGTYPE: the name holds a hash, a list, ... (another program's key, or a hostile one)."""


def _pooled_connection(pool: Any) -> Any:
    """A connected connection of `pool` (redis-py before 5.3 wants a command name, later ones warn on one)."""
    try:
        return pool.get_connection()
    except TypeError:
        return pool.get_connection("GET")


class _Fetch:
    """What a batch of GETs found, block by block, as its replies come in (in any order of blocks): the prefix,
    and how many payload bytes went into the block's buffer from which string. Command `2 i` is block i's
    `GET <name>`, `2 i + 1` its `GET <name>:p` (asked for when the buffer is big enough for a split block)."""

    def __init__(self, prefix_size: int, outs: Sequence[memoryview]) -> None:
        self.prefix_size = prefix_size
        self.outs = outs
        self.split = [len(out) >= _COPY_BELOW for out in outs]
        self.reset()

    def reset(self) -> None:
        """Nothing found yet (a retried fetch starts over)."""
        n = len(self.outs)
        self.prefixes: list[bytearray | None] = [None] * n
        self.joined: list[int | None] = [None] * n  # payload bytes that came with the prefix (one string)
        self.payloads: list[int | None] = [None] * n  # payload bytes of the `:p` string
        self.too_big = [False] * n  # a payload the caller's buffer cannot take: a miss, the block is fine
        self.errors: list[BlockError | None] = [None] * n  # a string of the block's that is no string

    def results(self, seal: BlockSeal, keys: Sequence[BlockKey]) -> list[int | Exception | None]:
        """Each block checked (MAC or checksum) where it now lies, in the caller's buffer: its length, None for a
        miss, or the BlockError that refused it."""
        results: list[int | Exception | None] = []
        for i, key in enumerate(keys):
            prefix = self.prefixes[i]
            if self.errors[i] is not None:
                results.append(self.errors[i])
                continue
            if prefix is None or self.too_big[i]:
                results.append(None)
                continue
            size = self.joined[i]
            if size is None:
                size = self.payloads[i] if len(prefix) == self.prefix_size and self.payloads[i] is not None else 0
            try:
                if len(prefix) < self.prefix_size:
                    raise BlockError(f"short block ({len(prefix)} bytes)")
                if not self.split[i] and size == 0 and decode_header(prefix)[1] > len(self.outs[i]):
                    results.append(None)  # a split block, too big for this buffer (its payload was not asked for)
                    continue
                results.append(seal.open(key, prefix, self.outs[i][:size]))
            except BlockError as exc:
                results.append(exc)
        return results


class _GetReplies:
    """Replies to pipelined GETs read off a redis-py connection's socket by hand: each value straight into the
    buffer it is for (a payload into the caller's buffer: no bytes object per reply, no copy through redis-py's
    read buffer, which for MiB-sized values cost several times the network), headers and small values through a
    buffer of `_READ_CHUNK`. The socket keeps the connection's timeout. A RESP2 or RESP3 bulk string or nil is
    taken; anything else raises `_Surprise` (the caller drops the connection and asks again through redis-py)."""

    def __init__(self, conn: Any) -> None:
        # redis-py's socket: a version that keeps it elsewhere has its replies read by redis-py itself (the caller
        # drops the connection and fetches again through the pipeline), not every load failed
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise _Surprise("no socket of redis-py's connection to read from")
        self.conn = conn
        self.sock = sock
        self.buf = bytearray(_READ_CHUNK)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    @classmethod
    def run(cls, conn: Any, batch: _Fetch, names: list[str], blocks: Iterable[int]) -> None:
        commands = [c for i in blocks for c in ((2 * i, 2 * i + 1) if batch.split[i] else (2 * i,))]
        batch.reset()
        cls.send(conn, names, commands).read(batch, commands)

    @classmethod
    def send(cls, conn: Any, names: list[str], commands: list[int]) -> _GetReplies:
        conn.send_packed_command(conn.pack_commands(
            [("GET", names[c // 2] + _PAYLOAD if c % 2 else names[c // 2]) for c in commands]))
        return cls(conn)

    @staticmethod
    def _redis_error(conn: Any, kind: str, message: str) -> Exception:
        import redis.exceptions

        error: type[Exception] = getattr(redis.exceptions, kind)
        return error(f"{message} ({getattr(conn, 'host', None) or getattr(conn, 'path', '')})")

    def read(self, batch: _Fetch, commands: list[int]) -> None:
        """The replies to `commands`, in order, into `batch`."""
        try:
            for command in commands:
                self._reply(batch, command)
        except (TimeoutError, OSError) as exc:  # socket.timeout is a TimeoutError
            kind = "TimeoutError" if isinstance(exc, TimeoutError) else "ConnectionError"
            raise self._redis_error(self.conn, kind, f"reading GET replies: {exc}") from exc
        if self.start != self.end:
            raise _Surprise("bytes after the last reply")

    def _reply(self, batch: _Fetch, command: int) -> None:
        i = command // 2
        try:
            size = self._header()
        except _NotAString as exc:  # another writer's key of another type under a block's name: this block only
            batch.errors[i] = BlockError(str(exc))
            return
        if size is None:
            return
        out = batch.outs[i]
        if command % 2 == 0:  # the block's string: its prefix alone, or the whole block
            take = min(size, batch.prefix_size)
            prefix = bytearray(take)
            self._into(memoryview(prefix))
            batch.prefixes[i] = prefix
            rest = size - take
            if rest:
                batch.joined[i], batch.payloads[i] = rest, None
                if rest <= len(out):
                    self._into(out[:rest])
                else:
                    batch.too_big[i] = True
                    self._skip(rest)
        elif batch.joined[i] is not None:  # a joined block is what counts (as redis-py's path reads it)
            self._skip(size)
        elif size <= len(out):
            self._into(out[:size])
            batch.payloads[i] = size
        else:
            batch.too_big[i] = True
            self._skip(size)
        self._crlf()

    def _fill(self) -> None:
        """More bytes from the socket into the buffer (what is unread moved to its front first)."""
        if self.start == self.end:
            self.start = self.end = 0
        elif self.start > 0:
            n = self.end - self.start
            self.view[:n] = self.view[self.start: self.end]
            self.start, self.end = 0, n
        if self.end == len(self.buf):
            raise _Surprise("a reply header longer than the read buffer")
        got = self.sock.recv_into(self.view[self.end:])
        if not got:
            raise ConnectionError("Connection closed by server.")
        self.end += got

    def _header(self) -> int | None:
        """The next reply's value length, None for a nil."""
        while (eol := self.buf.find(b"\r\n", self.start, self.end)) < 0:
            self._fill()
        line = bytes(self.view[self.start: eol])
        self.start = eol + 2
        if line[:1] == b"$":
            try:
                size = int(line[1:])
            except ValueError:
                raise _Surprise(f"reply {line[:40]!r}") from None
            return None if size < 0 else size
        if line == b"_":  # RESP3's nil
            return None
        if line.startswith(b"-WRONGTYPE"):
            raise _NotAString(f"a key of another type: {line[1:80].decode(errors='replace')}")
        raise _Surprise(f"reply {line[:80]!r}")

    def _into(self, dest: memoryview) -> None:
        """The next len(dest) bytes of a value into `dest`: what the buffer holds, then from the socket directly."""
        n = len(dest)
        have = min(n, self.end - self.start)
        dest[:have] = self.view[self.start: self.start + have]
        self.start += have
        recv_into = self.sock.recv_into
        while have < n:
            got = recv_into(dest[have:])
            if not got:
                raise ConnectionError("Connection closed by server.")
            have += got

    def _skip(self, n: int) -> None:
        while n:
            if self.start == self.end:
                self._fill()
            take = min(n, self.end - self.start)
            self.start += take
            n -= take

    def _crlf(self) -> None:
        while self.end - self.start < 2:
            self._fill()
        if self.buf[self.start: self.start + 2] != b"\r\n":
            raise _Surprise("a value not ended by CRLF")
        self.start += 2


def _sendable(payload: Buffer) -> bytes | memoryview:
    """redis-py sends bytes and memoryviews as they are (no copy above its buffer cutoff), not bytearrays."""
    return payload if isinstance(payload, (bytes, memoryview)) else memoryview(payload)


class FsSharedTier(SharedTier):
    """A shared POSIX directory (Lustre, Curvine FUSE, NFS): one file per block, temp + rename, mtime TTL."""

    def __init__(self, directory: str | Path, *, prefix: str = "kvgate", ttl_s: float = 3600.0,
                 fsync: bool = False, retry_s: float = 1.0, secret: bytes | None = None,
                 index_blocks: int = INDEX_BLOCKS) -> None:
        super().__init__(ttl_s, retry_s, secret=secret, index_blocks=index_blocks)
        self.root = Path(directory) / prefix
        self.tmp_dir = self.root / "tmp"
        self.fsync = fsync
        self.root.mkdir(SHARED_DIR_MODE, parents=True, exist_ok=True)
        self.tmp_dir.mkdir(SHARED_DIR_MODE, exist_ok=True)

    def _path(self, key: BlockKey) -> Path:
        name = key_name(key)
        return self.root / name[-2:] / name

    def _expired(self, mtime: float) -> bool:
        return self.ttl_s > 0 and time.time() - mtime > self.ttl_s

    def _put_many(self, items: list[tuple[BlockKey, bytes, Buffer]]) -> set[int]:
        if self.tmp_dir.is_symlink():  # its files would be made wherever it points
            raise OSError(errno.EACCES, f"{self.tmp_dir} is a symlink")
        skipped: set[int] = set()
        for position, (key, prefix, payload) in enumerate(items):
            final = self._path(key)
            try:
                final.parent.mkdir(SHARED_DIR_MODE, exist_ok=True)
                if final.parent.is_symlink():  # a block file would be made wherever it points
                    raise OSError(errno.ENOTDIR, f"shard {final.parent.name} is a symlink")
                write_file_atomically(self.tmp_dir, final, [prefix, payload], self.fsync, SHARED_FILE_MODE)
            except OSError as exc:
                if exc.errno not in _PLACE_TAKEN:
                    raise
                # a directory where the block's file goes, a file where its shard's directory goes: that block
                # is not written; the directory is not counted down for it
                log.warning("shared tier: %s not written, its place is taken: %s", key_name(key), exc)
                skipped.add(position)
        return skipped

    def _refuses_writes(self, exc: Exception) -> bool:
        # a full or read-only file system, or one this agent may not write: reads go on
        return isinstance(exc, OSError) and exc.errno in _WRITES_REFUSED

    def _fetch_many(self, keys: list[BlockKey], outs: list[memoryview]) -> list[int | Exception | None]:
        results: list[int | Exception | None] = []
        for key, out in zip(keys, outs, strict=True):
            path = self._path(key)
            try:
                st = path.stat()
                if self._expired(st.st_mtime) or st.st_size - self.seal.prefix_size > len(out):
                    results.append(None)  # expired, or too big for the caller's buffer (the block is fine)
                    continue
                results.append(self._read(path, key, out))
            except FileNotFoundError:
                results.append(None)
            except (BlockError, OSError) as exc:
                results.append(exc)
        if not self.root.is_dir():  # the mount itself went away
            raise BackendDown(f"{self.root} is gone")
        return results

    def _read(self, path: Path, key: BlockKey, out: memoryview) -> int:
        """Read and check one block file into `out` (prefix, payload and an EOF probe in one preadv)."""
        prefix = bytearray(self.seal.prefix_size)
        probe = bytearray(1)
        fd = open_regular(path)
        try:
            got = os.preadv(fd, [prefix, out, probe], 0)
        finally:
            os.close(fd)
        if got < len(prefix) or got > len(prefix) + len(out):
            raise BlockError(f"block file of {got}+ bytes does not fit")
        return self.seal.open(key, prefix, out[: got - len(prefix)])

    def _exists_many(self, keys: list[BlockKey]) -> list[bool]:
        found = []
        for key in keys:
            try:
                found.append(not self._expired(self._path(key).stat().st_mtime))
            except (FileNotFoundError, NotADirectoryError, PermissionError):  # (a file where its shard goes)
                found.append(False)
        return found

    def _delete(self, key: BlockKey) -> None:
        try:
            self._path(key).unlink(missing_ok=True)
        except OSError as exc:
            if exc.errno not in _UNDELETABLE:
                raise
            # a directory under a block's name, a directory this agent may not write: the block stays a miss
            log.warning("shared tier: cannot delete %s: %s", key_name(key), exc)

    def _shard_entries(self) -> Iterable[os.DirEntry[str]]:
        """Every entry of every shard directory, a shard that cannot be listed left out (logged)."""
        for shard in os.scandir(self.root):
            # a symlink is no shard: whoever can write the directory could point one anywhere the agent may write,
            # and the sweep deleted every old file there
            if not shard.is_dir(follow_symlinks=False) or shard.name == "tmp":
                continue
            try:
                entries = list(os.scandir(shard.path))
            except (NotADirectoryError, FileNotFoundError, PermissionError) as exc:
                log.warning("shared tier: shard %s left out: %s", shard.name, exc)
                continue
            yield from entries

    def _list_keys(self) -> Iterable[BlockKey]:
        for entry in self._shard_entries():
            key = parse_key_name(entry.name)
            if key is not None and not entry.is_dir(follow_symlinks=False):
                yield key

    def sweep(self) -> int:
        """Delete blocks older than the TTL, and temp files a crashed writer left; returns files removed."""
        removed = 0
        horizon = time.time() - max(self.ttl_s, 60.0)
        undeletable = 0  # (a directory, a file this agent may not delete: the sweep goes on past it)
        if self.tmp_dir.is_symlink():  # (see _shard_entries)
            log.warning("shared tier: %s is a symlink: not swept, nothing written", self.tmp_dir)
            return 0
        for entry in os.scandir(self.tmp_dir):
            try:
                if entry.stat(follow_symlinks=False).st_mtime < horizon:
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                undeletable += 1
        if self.ttl_s > 0:
            for entry in self._shard_entries():
                try:
                    if self._expired(entry.stat(follow_symlinks=False).st_mtime):
                        os.unlink(entry.path)
                        removed += 1
                        key = parse_key_name(entry.name)
                        if key is not None:
                            with self._lock:
                                known = self._index.pop(key, None) is not None
                            if known:
                                self._report([Removed(key)])
                except FileNotFoundError:
                    pass
                except OSError:
                    undeletable += 1
        if undeletable:
            log.warning("shared tier: the sweep left %d expired entries it could not delete", undeletable)
        return removed


# what a block's write meets when something else holds its place (a directory, a file as its shard)
_PLACE_TAKEN = frozenset((errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY))
# a file system that refuses writes but still serves reads
_WRITES_REFUSED = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM))
# what unlinking a block's name can meet that says nothing about the backend
_UNDELETABLE = frozenset((errno.EISDIR, errno.ENOTDIR, errno.EPERM, errno.EACCES, errno.EROFS))
