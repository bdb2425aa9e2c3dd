"""Long-lived dicts whose entries come and go by the million (LRUs, block indexes): kept at the table size a fresh
copy of them would have, instead of the twice as large one CPython grows them to (`TableTrim`), and used as LRUs
without an OrderedDict's links (`OldestFirst`)."""

from __future__ import annotations

import sys
from itertools import islice
from typing import Any

MIN_ENTRIES = 1 << 16  # smaller dicts are left alone: a few MB at most, and copied the most often


class TableTrim:
    """Watches one dict's hash table and copies the dict into itself, in place, when CPython has grown it for
    entries that came and went rather than for entries it holds.

    CPython does not shrink a dict's table when entries are deleted: they stay in it as dummies until inserts have
    used up its room, and then it rebuilds the table at the smallest power of two of at least three times the
    entries left. A dict that deletes as much as it inserts (an LRU touching a key deletes and inserts it) thus
    settles at 3-6 slots per entry, 60-120 bytes, while a copy is sized for 1.5-3 slots, 30-60 bytes. `check`,
    called after a batch of inserts, notices the growth (`sys.getsizeof`) and rebuilds the dict in place: every
    reference to it stays valid, its order is kept, nothing else about it changes. It does so only where the copy
    would have room for an eighth more entries (otherwise the next inserts would grow it again at once), so a
    dict is copied at most once per eighth of its size in inserts. Plain dicts only: an OrderedDict's copy into
    itself costs ten times as much.

    Copied after CPython grew it, a dict has held its old and its grown table at once, and then the grown one
    and the copy: three times a copy's table for a moment, at every copy, which a long run's peak catches. Told
    how many new keys went in (`check(table, inserted)`, each key deleted and inserted again counting too),
    it copies the dict before CPython would grow it instead (when the room its last copy left is down to the
    largest batch seen), so the dict only ever holds a copy's table, and for a moment two; `make_room` before the
    keys go in. Miscounted, CPython grows it first, and the next call copies it after as above."""

    __slots__ = ("_batch", "_left", "_size")

    def __init__(self) -> None:
        self._size = 0  # the dict's size in bytes when last checked
        self._left: int | None = None  # new keys the table takes before CPython grows it, once known
        self._batch = 0  # the most new keys one call reported

    def check(self, table: dict[Any, Any], inserted: int | None = None) -> bool:
        """After a batch of inserts (`inserted` new keys, where known): copy `table` into itself if CPython grew
        it since the last call and a copy would be smaller, or if the next batch would make CPython grow it;
        whether it did."""
        size = sys.getsizeof(table)
        if size != self._size:  # grown by CPython (or emptied): its room is not followed until the next copy
            grew = size > self._size
            self._size = size
            self._left = None
            return grew and self._copy(table, 0) and self._size < size
        if inserted is None or self._left is None:
            return False
        self._left -= inserted
        self._batch = max(self._batch, inserted)
        return self._left < self._batch and self._copy(table, self._batch)

    def make_room(self, table: dict[Any, Any], inserts: int) -> None:
        """`inserts` new keys are about to go into `table`: copy it now if they would make CPython grow it."""
        if self._left is None or sys.getsizeof(table) != self._size:
            self.check(table)
            return
        self._left -= inserts
        if self._left < 0:
            self._left += inserts
            if self._copy(table, inserts):
                self._left -= inserts

    def _copy(self, table: dict[Any, Any], reserve: int) -> bool:
        """Copy `table` into itself if the copy has room for `reserve` and an eighth more entries."""
        n = len(table)
        if n < MIN_ENTRIES:
            return False
        slots = 8  # a copy's table: CPython sizes it for 1.5 times the entries, rounded up to a power of two
        while slots < (3 * n + 1) // 2:
            slots *= 2
        room = 2 * slots // 3 - n  # CPython's usable two thirds, less the entries
        if room - reserve < n // 8:  # a copy would be full: no rebuild
            return False
        copy = dict(table)  # a fresh table for its entries (dict.copy would clone the large one)
        table.clear()
        table.update(copy)  # takes the copy's table as it is, with its room
        self._size = sys.getsizeof(table)
        self._left = room
        return True


class OldestFirst:
    """The oldest keys of an insertion-ordered dict, taken one at a time while the dict changes.

    An LRU kept as a plain dict in use order (a touch pops a key and inserts it again) takes a third of an
    `OrderedDict`'s memory per entry, for the millions of blocks an index or a simulated tier holds. A plain dict
    has no `popitem(last=False)`, and finding its first entry walks over the holes that pops left at its front (up
    to a third of the table between resizes), so the oldest keys are read a run at a time: a key of the run that
    was touched or inserted since it was read is at the end now and skipped; when the run is used up it is read
    again, which gives the dict's true order. `touched(key)` must be called for every key moved to the end or
    inserted while a walk is in use. A longer `run` reads the holes less often, for a walk that pops often."""

    RUN = 64
    FORGET_AFTER = 4096  # touches kept against a run; past that the run is dropped and read again when needed

    def __init__(self, entries: dict[Any, Any], run: int | None = None) -> None:
        self.entries = entries
        self.run = run or self.RUN
        self.forget_after = self.FORGET_AFTER if run is None else max(self.FORGET_AFTER, 2 * run)
        self._run: list[Any] = []
        self._next = 0
        self._touched: set[Any] = set()

    def touched(self, key: Any) -> None:
        if self._run:
            self._touched.add(key)
            if len(self._touched) > self.forget_after:
                self._run = []
                self._next = 0
                self._touched.clear()

    def first(self) -> Any | None:
        """The least recently used key, None when the dict is empty."""
        entries = self.entries
        while True:
            if self._next >= len(self._run):
                if not entries:
                    return None
                self._run = list(islice(entries, self.run))
                self._next = 0
                self._touched.clear()
            key = self._run[self._next]
            if key in entries and key not in self._touched:
                return key
            self._next += 1

    def pop(self) -> tuple[Any, Any]:
        """Remove the least recently used key (the dict must not be empty)."""
        key = self.first()
        assert key is not None
        self._next += 1
        return key, self.entries.pop(key)
