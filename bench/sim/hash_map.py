"""64-bit ints to 64-bit ints in arrays, for a replay's largest gateway maps: the KV event applier's engine hash ->
gateway key and the block index's gateway key -> workers, on the NVMe tier (1.4 M blocks on the conversation
trace at 8 replicas). A dict held each entry in 30-60 bytes of table and kept two 48-byte int objects alive per
block (its key and value, nowhere else referenced once the engine evicted the block); here 24-32 bytes and none."""

from __future__ import annotations

from array import array
from collections.abc import Iterator, MutableMapping
from typing import Any

from bench.sim.hash_lru import EMPTY, free_slot

_MISSING: Any = object()


class U64Map(MutableMapping[int, int]):
    """A map of ints in 0 .. 2**64 - 1 to ints in 0 .. 2**64 - 1: the entries in two dense arrays (`array('Q')`,
    8 bytes each), and an open-addressing table of their places (`array('i')`, 4 bytes a slot, at most half of
    them full; linear probing from the key's low bits, deletion by backward shift, so no tombstones). A deleted
    entry's place is taken by the last entry, so iteration follows insertion order only until the first
    deletion. The operations a dict's callers use are written out (no call per probe): `get` is a Python call where
    a dict's is C, a few hundred ns more per block."""

    __slots__ = ("_keys", "_mask", "_places", "_values")

    def __init__(self) -> None:
        self._keys = array("Q")
        self._values = array("Q")
        self._mask = 7
        self._places = array("i", [EMPTY]) * 8

    def __len__(self) -> int:
        return len(self._keys)

    def __sizeof__(self) -> int:
        return (object.__sizeof__(self) + self._keys.__sizeof__() + self._values.__sizeof__()
                + self._places.__sizeof__())

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        places, keys, mask = self._places, self._keys, self._mask
        i: int = key & mask  # type: ignore[operator]
        while (place := places[i]) != EMPTY:
            if keys[place] == key:
                return True
            i = (i + 1) & mask
        return False

    def get(self, key: int, default: Any = None) -> Any:
        places, keys, mask = self._places, self._keys, self._mask
        i = key & mask
        while (place := places[i]) != EMPTY:
            if keys[place] == key:
                return self._values[place]
            i = (i + 1) & mask
        return default

    def __getitem__(self, key: int) -> int:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            raise KeyError(key)
        return value  # type: ignore[no-any-return]

    def __setitem__(self, key: int, value: int) -> None:
        places, keys, mask = self._places, self._keys, self._mask
        i = key & mask
        while (place := places[i]) != EMPTY:
            if keys[place] == key:
                self._values[place] = value
                return
            i = (i + 1) & mask
        keys.append(key)
        try:
            self._values.append(value)
        except OverflowError:  # a value out of range leaves the map as it was
            keys.pop()
            raise
        places[i] = len(keys) - 1
        if 2 * len(keys) > len(places):
            self._grow()

    def __delitem__(self, key: int) -> None:
        if self.pop(key, _MISSING) is _MISSING:
            raise KeyError(key)

    def pop(self, key: int, default: Any = _MISSING) -> Any:
        places, keys, values, mask = self._places, self._keys, self._values, self._mask
        i = key & mask
        while (place := places[i]) != EMPTY:
            if keys[place] == key:
                break
            i = (i + 1) & mask
        else:
            if default is _MISSING:
                raise KeyError(key)
            return default
        value = values[place]
        last = len(keys) - 1
        if place != last:  # the last entry fills the hole: find its slot and renumber it
            moved = keys[last]
            keys[place] = moved
            values[place] = values[last]
            j = moved & mask
            while places[j] != last:
                j = (j + 1) & mask
            places[j] = place
        keys.pop()
        values.pop()
        free_slot(places, keys, mask, i)
        return value

    def clear(self) -> None:
        self._keys = array("Q")
        self._values = array("Q")
        self._mask = 7
        self._places = array("i", [EMPTY]) * 8

    def _grow(self) -> None:
        """Twice the slots, the entries placed anew."""
        size = 2 * len(self._places)
        self._mask = mask = size - 1
        self._places = places = array("i", [EMPTY]) * size
        for place, key in enumerate(self._keys):
            i = key & mask
            while places[i] != EMPTY:
                i = (i + 1) & mask
            places[i] = place
