"""Incremental tokenization: a prompt whose leading text was tokenized recently reuses those token ids and block
keys, and only the text after a verified seam goes through the tokenizer.

A recent prompt is found by its text (as UTF-8): every prompt is cut into `CHUNK`-byte links of a hash chain, and
each link names the most recently used cached prompt that has it, so the longest cached prefix is found by
following links: the first chunk's names a prompt, the text comparison says how much it shares, and its links over
that part are the new prompt's too (copied, not hashed); the link after it names a prompt sharing more, if any (a
link known means every link before it is known too: evicting the least recently used prompt removes only the links
no later prompt has).

The seam: a tokenizer's ids for a shared prefix are the prefix's ids only up to where the shared text ends, minus
what the next characters could change (a pre-tokenizer looks ahead, merges cross words). So the ids are reused up to
`OVERLAP_TOKENS` tokens before a point `SEAM_MARGIN` bytes inside the shared text, the rest of the prompt is
encoded from there, and the encoding of that window must reproduce the cached ids of the overlap; when it does not
(or there is too little shared text to leave a window, or the tokenizer's ids past the overlap may still differ there:
`ModelTokenizer.splices_at`) the whole prompt is encoded. The result is identical to
encoding the whole prompt (tests/test_token_cache.py checks it as a property, against `ModelTokenizer.encode`).

Token ends come from `ModelTokenizer.encode_with_some_ends` (for byte-level BPE tokenizers, a table of each token's
bytes rather than the tokenizer's offsets, which cost more than encoding). Where the table's sums are exact by
construction (ASCII text through the word cache) they are left out, and summed only when a later prompt's seam
falls among them, only as far as it needs: most of a prompt's tail is never spliced at.

The cache is bounded in bytes (`prompt_cache_bytes`): text, ids, token ends, links and block keys, counted per
prompt, least recently used first out.
"""

from __future__ import annotations

import gc
import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from router.block_keys import BlockKey, chain_keys
from router.tokenizer import ModelTokenizer

# bytes per link of a text's hash chain: shared prefixes shorter than this are not reused (encoding them costs
# little); each link is a Python-level hash call: 3 us per KiB of prompt at 256 bytes, 5 at 128 (at load 19)
CHUNK = 256
# bytes of shared text left after the seam: what a pre-tokenizer's lookahead may still change (but over whitespace,
# which is never spliced up to where the prompts part)
SEAM_MARGIN = 16
OVERLAP_TOKENS = 6  # cached tokens before the seam that the window's encoding must reproduce
SEAM_STEPS = 8  # tokens the window's start may move back from there, off a point the tokenizer cannot splice at
_ENTRY_OVERHEAD = 400  # bytes of an entry besides its arrays and text (objects, dict and LRU slots)
_LINK_BYTES = 100  # bytes of one link in the index (a dict slot and an int)
_KEY_BYTES = 40  # bytes of one block key in a tuple (a pointer and an int)
# ints of stored entries' keys and links after which the cache starts a young collection itself (issue 18): a new
# entry's tuples are walked once, by the first collection that sees them, and a full cache (an entry dropped for each
# stored) leaves the collector's count of new objects flat, so its own young collections came rarely and walked
# everything stored meanwhile (1,800 32,000-character prompts, 1.3 million ints: 59 ms of CPU in one, the event loop
# waiting); one of these walks about 1-2 ms
YOUNG_ITEMS = 32_768


# not frozen (this one and those below): one of each is built per request, and a frozen dataclass's __init__ costs
# 3x (960 against 270 ns, six fields)
@dataclass(slots=True)
class Encoded:
    """A prompt's token ids (uint32) and the chained keys of its full blocks under one root."""

    ids: array[int]
    keys: list[BlockKey]
    reused_tokens: int  # ids taken from the cache rather than the tokenizer


@dataclass(slots=True)
class Lookup:
    """A prompt's text and the cached prompt sharing the longest prefix with it (`TokenCache.lookup`)."""

    text: str
    data: bytes  # the text as UTF-8
    add_special_tokens: bool
    seed: int | None  # None: this tokenizer's ids cannot be spliced
    links: list[int]
    entry: _Entry | None
    shared: int  # bytes the two share

    @property
    def new_bytes(self) -> int:
        """About how many bytes of text `finish` will encode: none for a prompt seen before, the text after the
        seam for one that starts like a cached one, the whole text otherwise."""
        if self.entry is None:
            return len(self.data)
        if self.shared == len(self.data) == len(self.entry[0]):
            return 0
        return len(self.data) - self.shared + SEAM_MARGIN + 16 * OVERLAP_TOKENS


# One recently encoded prompt: (data, seed, ids, ends, links, root, keys, size) -- its text as UTF-8; the tokenizer
# and whether special tokens were added (what the ids depend on); the token ids (uint32); the first tokens' ends in
# bytes of the text (uint32, 0 for special tokens added in front; the others' are the byte table's sums); the text's
# hash chain; the block keys' root (model, adapter, namespace); the block keys; the bytes counted against the bound.
# Plain tuples of bytes and ints, which the cycle collector stops tracking after its first pass: an object of a class
# (or an array, or a list) would stay tracked, and every full collection walks what is tracked with the GIL held
# (1,783 cached prompts, each an object with two arrays and two lists: 14-16 ms of CPU per collection in the gateway,
# the event loop stalled). Not bytes (a535037 made the links and keys uint64 bytes, one tracked object per prompt):
# the keys are the very int objects the trie and kv's pending blocks hold as dict keys, whose lookups then match by
# identity, and converting them cost more than the young collections it saved (kv in process, interleaved runs: 125
# -> 138 us per request with bytes, 129 with the keys a tuple).
_Entry = tuple[bytes, int, bytes, bytes, tuple[int, ...], BlockKey, tuple[BlockKey, ...], int]


def _entry(data: bytes, seed: int, ids: bytes, ends: bytes, links: list[int], root: BlockKey,
           keys: list[BlockKey]) -> _Entry:
    size = sys.getsizeof(data) + 2 * len(ids) + _LINK_BYTES * len(links) + _KEY_BYTES * len(keys) + _ENTRY_OVERHEAD
    return data, seed, ids, ends, tuple(links), root, tuple(keys), size


def _u32(data: bytes) -> array[int]:
    out = array("I")
    out.frombytes(data)
    return out


def _links(data: bytes, seed: int) -> list[int]:
    """The hash chain of `data`'s full `CHUNK`-byte chunks."""
    links: list[int] = []
    _extend_links(memoryview(data), links, seed)
    return links


def _extend_links(view: memoryview, links: list[int], seed: int) -> None:
    """Add the links of `view`'s full chunks after the first `len(links)` (its chain so far)."""
    parent = links[-1] if links else seed
    digest = xxhash.xxh3_64_intdigest  # the seed passed by position: keyword parsing costs more than the hash
    for end in range((len(links) + 1) * CHUNK, len(view) + 1, CHUNK):
        parent = digest(view[end - CHUNK:end], parent)
        links.append(parent)


def _common_prefix(a: bytes, b: bytes, start: int, end: int) -> int:
    """The length of the common prefix of a and b, known to be at least `start` and at most `end`: where the two
    spans, read as big-endian numbers, first differ (a few C calls, not a bisection of slices)."""
    differ = int.from_bytes(a[start:end], "big") ^ int.from_bytes(b[start:end], "big")
    return end - 1 - (differ.bit_length() - 1) // 8 if differ else end


def _shared_bytes(a: bytes, b: bytes) -> int:
    """The length of the common prefix of a and b: the full chunks they share, probed from the end (prompts that
    share a beginning mostly part near their ends: one or two probes), then bisected; then the bytes of the next
    chunk. Each probe is one memcmp, no copy; `_common_prefix` over a whole 4 KiB prompt took 10 us."""
    view = memoryview(a)
    top = min(len(a), len(b)) // CHUNK
    if b.startswith(view[:top * CHUNK]):
        lo = hi = top
    elif top > 1 and b.startswith(view[:(top - 1) * CHUNK]):
        lo = hi = top - 1
    else:
        lo, hi = 0, top - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(view[:mid * CHUNK]):
            lo = mid
        else:
            hi = mid - 1
    start = lo * CHUNK
    return _common_prefix(a, b, start, min(len(a), len(b), start + CHUNK))


class TokenCache:
    """Recently encoded prompts of every tokenizer, bounded to `max_bytes`; `encode` gives a prompt's ids and block
    keys, exactly as encoding it whole would. Safe to call from several threads."""

    def __init__(self, max_bytes: int, block_size: int) -> None:
        self.max_bytes = max_bytes
        self.block_size = block_size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id(entry), least recently used first
        # link -> id (the key in _entries) of the most recently used entry that has it: ints only, so the collector
        # never tracks this dict (with the entries as values it untracked it once they were, and the next store
        # tracked it again in the youngest generation: the next young collection walked every link, 1-2 ms)
        self._links: dict[int, int] = {}
        self._young = 0  # ints in the keys and links stored since the cache last started a young collection
        self._lock = threading.Lock()
        self.bytes = 0
        # what the cache did: whole prompts encoded, prompts served from a cached prefix, seams that did not verify
        self.misses = 0
        self.hits = 0
        self.seam_mismatches = 0
        self.encoded_chars = 0  # characters that went through the tokenizer

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._links.clear()
            self.bytes = 0

    def encode(self, tokenizer: ModelTokenizer, text: str, *, add_special_tokens: bool, root: BlockKey) -> Encoded:
        """`tokenizer.encode(text)` as uint32 ids, and the chained keys of its full blocks under `root`."""
        return self.finish(tokenizer, self.lookup(tokenizer, text, add_special_tokens=add_special_tokens), root)

    def lookup(self, tokenizer: ModelTokenizer, text: str, add_special_tokens: bool) -> Lookup:
        """`encode`'s first half, which costs little (hashing the text, a few dict probes): the cached prompt
        sharing the longest prefix with `text`. Its `new_chars` tell how much the second half (`finish`) will
        encode, so the caller can choose the thread for it."""
        seed = tokenizer.cache_seed(add_special_tokens)
        data = text.encode("utf-8", "surrogatepass")
        if seed is None:  # a tokenizer that adds special tokens at the end: ids cannot be spliced
            return Lookup(text, data, add_special_tokens, None, [], None, 0)
        links, found = self._longest_prefix(data, seed)
        if found is None:
            return Lookup(text, data, add_special_tokens, seed, links, None, 0)
        return Lookup(text, data, add_special_tokens, seed, links, *found)

    def finish(self, tokenizer: ModelTokenizer, lookup: Lookup, root: BlockKey) -> Encoded:
        """`encode`'s second half: the ids, spliced onto the cached prompt `lookup` found where that verifies."""
        text, data, seed, links, entry = lookup.text, lookup.data, lookup.seed, lookup.links, lookup.entry
        if seed is None:
            ids, _ = self._encode(tokenizer, text, lookup.add_special_tokens)
            self.misses += 1
            return Encoded(ids, chain_keys(ids, self.block_size, root), 0)
        if entry is not None:
            cached_ids, cached_ends, cached_root, cached_keys = entry[2], entry[3], entry[5], entry[6]
            if lookup.shared == len(data) == len(entry[0]):  # the same prompt again
                ids = _u32(cached_ids)
                keys = (list(cached_keys) if cached_root == root
                        else chain_keys(ids, self.block_size, root))
                self.hits += 1
                self._store(entry, _entry(data, seed, cached_ids, cached_ends, links, root, keys))
                return Encoded(ids, keys, len(ids))
            spliced = self._splice(tokenizer, entry, data, lookup.shared)
            if spliced is not None:
                ids_bytes, ends_bytes, kept, same = spliced
                ids = _u32(ids_bytes)
                reused = min(same // self.block_size, len(cached_keys)) if cached_root == root else 0
                keys = list(cached_keys[:reused])
                keys += chain_keys(ids[reused * self.block_size:], self.block_size, keys[-1] if keys else root)
                self.hits += 1
                self._store(entry, _entry(data, seed, ids_bytes, ends_bytes, links, root, keys))
                return Encoded(ids, keys, kept)
            self.seam_mismatches += 1
        ids, ends = self._encode(tokenizer, text, lookup.add_special_tokens)
        keys = chain_keys(ids, self.block_size, root)
        self.misses += 1
        self._store(None, _entry(data, seed, ids.tobytes(), ends.tobytes(), links, root, keys))
        return Encoded(ids, keys, 0)

    def _longest_prefix(self, data: bytes, seed: int) -> tuple[list[int], tuple[_Entry, int] | None]:
        """`data`'s hash chain, and the cached prompt sharing the longest prefix with it (at least one chunk) with
        that prefix's length in bytes. The chain's links over the shared text are the cached prompt's own (same
        bytes, same seed), copied, not hashed: only the links after it are hashed, so a prompt that extends a
        cached one costs a hash per new chunk, not one per chunk of the whole text (16 of them: 3 us in process)."""
        count = len(data) // CHUNK
        if not count:
            return [], None
        index, entries = self._links, self._entries
        view = memoryview(data)
        digest = xxhash.xxh3_64_intdigest  # the seed passed by position: keyword parsing costs more than the hash
        links = [digest(view[:CHUNK], seed)]
        best: tuple[_Entry, int] | None = None
        entry = entries.get(index.get(links[0], 0))
        # each link names the most recent prompt that has it: follow them while the next link names a prompt sharing
        # more (one step unless the prompt the first link names parts earlier than an older one, or a hash collides,
        # which the text comparison catches)
        while entry is not None and entry[1] == seed:
            cached = entry[0]
            shared = _shared_bytes(cached, data)
            if shared < len(links) * CHUNK:  # less than its link promised: a collision
                break
            best = entry, shared
            known = shared // CHUNK
            links += entry[4][len(links):known]
            if known >= count:
                break
            links.append(digest(view[known * CHUNK:(known + 1) * CHUNK], links[known - 1]))
            entry = entries.get(index.get(links[known], 0))
        _extend_links(view, links, seed)
        return links, best

    def _splice(self, tokenizer: ModelTokenizer, entry: _Entry, data: bytes,
                shared: int) -> tuple[bytes, bytes, int, int] | None:
        """The ids of the text `data` as the cached ids up to a seam inside the `shared` prefix plus the encoding of the
        rest, with the token ends known (both as uint32 bytes, as an entry keeps them), how many ids were kept and
        how many leading ids are the cached ones (kept and verified); None when the seam does not verify."""
        cached_ids, cached_ends = entry[2], entry[3]
        limit = shared - SEAM_MARGIN
        ends: Sequence[int] = memoryview(cached_ends).cast("I")
        seam = bisect_right(ends, limit)  # tokens ending inside the safe part of the shared text
        if seam == len(ends) and len(cached_ends) < len(cached_ids):  # it may lie among the ends not summed yet
            ends = _u32(cached_ends)
            tokenizer.more_ends(ends, memoryview(cached_ids).cast("I"), limit)
            if 4 * len(ends) == len(cached_ids) and ends[-1] != len(entry[0]):
                return None  # the table's sums do not come out at the text's length: never splice at them
            seam = bisect_right(ends, limit)
        start = seam - OVERLAP_TOKENS  # the window starts here: its first tokens must come out as cached
        for _ in range(SEAM_STEPS):  # ... or a token earlier where the tokenizer cannot splice there
            if start < 1:
                return None
            at = ends[start - 1]
            if at == 0 or (start < len(ends) and ends[start] <= at) or (data[at] & 0xC0) == 0x80:  # in the specials
                return None  # added in front, or inside a character that spans tokens
            if tokenizer.splices_at(data, at):
                break
            start -= 1
        else:
            return None
        if data[at:shared].decode("utf-8", "ignore").isspace():
            # whitespace up to where the prompts part: what follows may cut the whole run otherwise, before the seam
            # too (Llama 3's `\s*[\r\n]+` takes a run up to its last newline, however far)
            return None
        window, window_ends = self._encode(tokenizer, data[at:].decode("utf-8", "surrogatepass"), False, at)
        if window[:seam - start].tobytes() != cached_ids[4 * start:4 * seam]:
            return None
        # each joined straight from the buffers: one copy of the kept part, not a slice, an array and a sum of them
        kept_ends = memoryview(ends)[:start] if isinstance(ends, array) else memoryview(cached_ends)[:4 * start]
        return (b"".join((memoryview(cached_ids)[:4 * start], window)), b"".join((kept_ends, window_ends)), start,
                seam)

    def _encode(self, tokenizer: ModelTokenizer, text: str, add_special_tokens: bool,
                at: int = 0) -> tuple[array[int], array[int]]:
        """Ids and the token ends known (in bytes of a text in which `text` starts at byte `at`): those of the first
        ids, the rest left to `ModelTokenizer.more_ends`."""
        ids, ends = tokenizer.encode_with_some_ends(text, add_special_tokens=add_special_tokens, offset=at)
        self.encoded_chars += len(text)
        return ids, ends

    def _store(self, hit: _Entry | None, new: _Entry) -> None:
        """Keep the prompt just encoded as the most recent; a cached prompt it extends (a conversation's previous
        turn) is dropped, its links now name the new one."""
        if new[7] > self.max_bytes:
            return
        with self._lock:
            if hit is not None and id(hit) in self._entries and new[0].startswith(hit[0]):
                self._drop(hit)
            key = id(new)
            self._entries[key] = new
            self.bytes += new[7]
            index = self._links
            for link in new[4]:
                index[link] = key
            while self.bytes > self.max_bytes:
                self._drop(next(iter(self._entries.values())))
            self._young += len(new[4]) + len(new[6])
            collect = self._young >= YOUNG_ITEMS
            if collect:
                self._young = 0
        if collect:  # (`YOUNG_ITEMS`; outside the lock)
            gc.collect(0)

    def _drop(self, entry: _Entry) -> None:
        key = id(entry)
        del self._entries[key]
        self.bytes -= entry[7]
        index = self._links
        for link in entry[4]:  # an entry's id is in no link after this: a later entry may be given the same id
            if index.get(link) == key:
                del index[link]
