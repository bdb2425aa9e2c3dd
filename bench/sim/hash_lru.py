"""64-bit block hashes in use order, least recently used first, in arrays: the simulation's NVMe model keeps about
180,000 per replica, which a dict (plain, kept at a copy's size, `TableTrim`) held at 57 bytes each; here 14-40,
with a value each (the fleet's shared store, each replica's shared-tier index) 22-56 (values shared, not copied)."""

from __future__ import annotations

from array import array
from collections.abc import Iterator
from typing import Any

import numpy as np
import numpy.typing as npt

# a 64-bit int: the simulation's block hashes, typed as the agent's `BlockHash` (int | bytes) where they come from
Hash = Any
EMPTY = -1
STALE_SLACK = 4096  # stale log entries beyond as many as the live ones before the log is rewritten


class HashLru:
    """An exact LRU of 64-bit hashes, with a value each if `values`: a log of hashes in the order they were last
    used (`array('Q')`, 8 bytes an appearance, and a list of values beside it; a use appends one, the earlier
    appearance goes stale), and an open-addressing table of each hash's latest appearance (`array('i')`, 4 bytes a
    slot, at most half of them full; linear probing from the hash's low bits, deletion by backward shift, so no
    tombstones). An appearance is live when the table points at it. The log is rewritten without its stale
    appearances once they outnumber the live ones; the table keeps its slots then (the same hashes in the same
    places), only their numbers change."""

    __slots__ = ("_head", "_live", "_log", "_mask", "_places", "_values")

    def __init__(self, values: bool = False) -> None:
        self._log = array("Q")
        self._values: list[Any] | None = [] if values else None
        self._head = 0  # appearances before it are stale
        self._live = 0
        self._mask = 7
        self._places = array("i", [EMPTY]) * 8

    def __len__(self) -> int:
        return self._live

    def _slot(self, h: Hash) -> int:
        """The table slot pointing at `h`'s latest appearance, or the empty slot where it would go."""
        places, log, mask = self._places, self._log, self._mask
        i: int = h & mask
        while (place := places[i]) != EMPTY and log[place] != h:
            i = (i + 1) & mask
        return i

    def __contains__(self, h: Hash) -> bool:
        if not self._live:
            return False
        places, log, mask = self._places, self._log, self._mask
        i: int = h & mask
        while (place := places[i]) != EMPTY:
            if log[place] == h:
                return True
            i = (i + 1) & mask
        return False

    def get(self, h: Hash, default: Any = None) -> Any:
        if not self._live:  # (a shared tier's index, before anything reached it)
            return default
        places, log, mask = self._places, self._log, self._mask
        i: int = h & mask
        while (place := places[i]) != EMPTY:
            if log[place] == h:
                return self._values[place]  # type: ignore[index]
            i = (i + 1) & mask
        return default

    def touch(self, h: Hash) -> bool:
        """Make `h` the most recently used; whether it was held."""
        places, log, mask = self._places, self._log, self._mask
        i: int = h & mask
        while (place := places[i]) != EMPTY:
            if log[place] == h:
                places[i] = len(log)
                log.append(h)
                if self._values is not None:
                    self._values.append(self._values[place])
                if len(log) > 2 * self._live + STALE_SLACK:
                    self._compact()
                return True
            i = (i + 1) & mask
        return False

    def use(self, h: Hash) -> bool:
        """Make `h` the most recently used, adding it if it is not held (`touch`, else `add`, in one probe);
        whether it was held."""
        places, log, mask = self._places, self._log, self._mask
        i: int = h & mask
        while (place := places[i]) != EMPTY:
            if log[place] == h:
                places[i] = len(log)
                log.append(h)
                if self._values is not None:
                    self._values.append(self._values[place])
                if len(log) > 2 * self._live + STALE_SLACK:
                    self._compact()
                return True
            i = (i + 1) & mask
        places[i] = len(log)  # the empty slot its probe ended at: where `add` puts it
        log.append(h)
        if self._values is not None:
            self._values.append(None)
        self._live += 1
        if 2 * self._live > len(self._places):
            self._grow()
        elif len(self._log) > 2 * self._live + STALE_SLACK:
            self._compact()
        return False

    def add(self, h: Hash, value: Any = None) -> None:
        """Hold `h` (not held yet) as the most recently used."""
        places, log, mask = self._places, self._log, self._mask
        i: int = h & mask
        while places[i] != EMPTY:  # (h is not held: no appearance of it is pointed at)
            i = (i + 1) & mask
        places[i] = len(log)
        log.append(h)
        if self._values is not None:
            self._values.append(value)
        self._live += 1
        if 2 * self._live > len(self._places):
            self._grow()
        elif len(self._log) > 2 * self._live + STALE_SLACK:
            self._compact()

    def put(self, h: Hash, value: Any) -> None:
        """`h` as the most recently used, with this value (held or not)."""
        i = self._slot(h)
        if self._places[i] == EMPTY:
            self.add(h, value)
            return
        self._places[i] = len(self._log)
        self._log.append(h)
        self._values.append(value)  # type: ignore[union-attr]
        if len(self._log) > 2 * self._live + STALE_SLACK:
            self._compact()

    def set(self, h: Hash, value: Any) -> None:
        """`h`'s value: a new one keeps its place, a new hash is the most recently used."""
        place = self._places[self._slot(h)]
        if place == EMPTY:
            self.add(h, value)
        else:
            self._values[place] = value  # type: ignore[index]

    def remove(self, h: Hash) -> bool:
        """Forget `h`; whether it was held."""
        i = self._slot(h)
        if self._places[i] == EMPTY:
            return False
        self._free(i)
        return True

    def oldest(self) -> Hash | None:
        """The least recently used hash, None when empty."""
        log, places, slot = self._log, self._places, self._slot
        j = self._head
        while j < len(log):
            if places[slot(log[j])] == j:
                self._head = j
                return log[j]
            j += 1
        self._head = j
        return None

    def pop_oldest(self) -> Hash:
        """Forget the least recently used hash (there must be one) and return it."""
        log, places, mask = self._log, self._places, self._mask
        j = self._head
        while True:  # the first appearance the table points at
            h = log[j]
            i = h & mask
            while (place := places[i]) != EMPTY and log[place] != h:
                i = (i + 1) & mask
            if place == j:
                self._head = j + 1
                self._free(i)
                return h
            j += 1

    def newest(self) -> Hash | None:
        """The most recently used hash, None when empty."""
        log, places, slot = self._log, self._places, self._slot
        for j in range(len(log) - 1, self._head - 1, -1):
            if places[slot(log[j])] == j:
                return log[j]
        return None

    def __iter__(self) -> Iterator[int]:
        """The hashes held, least recently used first (the LRU must not change meanwhile)."""
        log, places, slot = self._log, self._places, self._slot
        return (log[j] for j in range(self._head, len(log)) if places[slot(log[j])] == j)

    def items(self) -> Iterator[tuple[int, Any]]:
        """(hash, value), least recently used first (the LRU must not change meanwhile)."""
        log, places, slot, values = self._log, self._places, self._slot, self._values
        assert values is not None
        return ((log[j], values[j]) for j in range(self._head, len(log)) if places[slot(log[j])] == j)

    def _free(self, i: int) -> None:
        """Empty slot `i`, shifting back the entries after it that probed past it."""
        free_slot(self._places, self._log, self._mask, i)
        self._live -= 1

    def _compact(self) -> None:
        """The log without its stale appearances (once they outnumber the live ones by STALE_SLACK)."""
        # the live appearances are the ones the table points at: in log order, renumbered in place
        renumber = np.full(len(self._log) + 1, EMPTY, dtype=np.int32)  # [-1] (an empty slot) stays empty
        live = self._rewrite()
        renumber[live] = np.arange(len(live), dtype=np.int32)
        self._places = _int_array(renumber[np.frombuffer(self._places, dtype=np.int32)])

    def _rewrite(self) -> npt.NDArray[np.int64]:
        """The log (and values) without stale appearances; the places of the live ones in the old log. In numpy:
        a log of a million appearances, its table and its values were rewritten through a Python int each (the
        rewrites were a fifth of the LRU's time in a tiered replay)."""
        places = np.frombuffer(self._places, dtype=np.int32)
        live = np.sort(places[places != EMPTY]).astype(np.int64)
        log = array("Q")
        log.frombytes(np.frombuffer(self._log, dtype=np.uint64)[live].tobytes())
        self._log = log
        if self._values is not None:
            self._values = list(map(self._values.__getitem__, live.tolist()))
        self._head = 0
        return live

    def _grow(self) -> None:
        """Twice the slots (the log rewritten without its stale appearances)."""
        self._rewrite()
        size = 2 * len(self._places)
        self._mask = mask = size - 1
        self._places = places = array("i", [EMPTY]) * size
        for place, h in enumerate(self._log):
            i = h & mask
            while places[i] != EMPTY:
                i = (i + 1) & mask
            places[i] = place


def _int_array(values: npt.NDArray[np.int32]) -> array[int]:
    """A table of places (`array('i')`) holding these."""
    table = array("i")
    table.frombytes(values.tobytes())
    return table


def free_slot(places: array[int], hashes: array[int], mask: int, i: int) -> None:
    """Empty slot `i` of a linear-probing table of `places` into `hashes`, shifting back the entries after it that
    probed past it (so no lookup stops early at the hole)."""
    j = i
    while True:
        j = (j + 1) & mask
        place = places[j]
        if place == EMPTY:
            break
        home = hashes[place] & mask
        # the entry at j may move to i unless its home lies cyclically in (i, j]
        if (home <= i < j) or (i < j < home) or (j < home <= i):
            places[i] = place
            i = j
    places[i] = EMPTY
