"""kvcore.dict_tables: a dict whose entries come and go is kept at the table size a copy of it would have, in
place, with its entries and their order unchanged."""

from __future__ import annotations

import random
import sys

import pytest

from kvcore import dict_tables
from kvcore.dict_tables import TableTrim


def churn(table: dict[int, None], rng: random.Random, keys: int, ops: int, trim: TableTrim | None) -> int:
    """LRU traffic (touch a key: delete and insert it; or replace the oldest by a new one), a check after every
    64 operations; the largest size seen after a check."""
    largest = 0
    for i in range(ops):
        key = rng.randrange(keys)
        if key in table:
            del table[key]
        elif table:
            del table[next(iter(table))]
        table[key] = None
        if i % 64 == 63:
            if trim is not None:
                trim.check(table)
            largest = max(largest, sys.getsizeof(table))
    return largest


def test_a_churned_dict_stays_at_a_copys_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dict_tables, "MIN_ENTRIES", 4096)
    plain = dict.fromkeys(range(12_000))
    trimmed = dict.fromkeys(range(12_000))
    same = trimmed
    largest_plain = churn(plain, random.Random(3), 40_000, 200_000, None)
    largest = churn(trimmed, random.Random(3), 40_000, 200_000, TableTrim())
    assert trimmed is same and list(trimmed) == list(plain)  # in place, the same entries in the same order
    assert largest <= sys.getsizeof(dict(trimmed)) < largest_plain / 1.9  # CPython alone: twice a copy's table


def test_a_dict_a_copy_would_fill_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """10,000 entries: a copy's table (16,384 slots, room for 10,922 entries) would grow again after 922 more
    inserts, under an eighth of them: not copied."""
    monkeypatch.setattr(dict_tables, "MIN_ENTRIES", 4096)
    table = dict.fromkeys(range(10_000))
    for i in range(10_000, 30_000):
        del table[i - 10_000]
        table[i] = None
    before = sys.getsizeof(table)
    assert not TableTrim().check(table) and sys.getsizeof(table) == before


def test_small_dicts_are_left_alone() -> None:
    table = dict.fromkeys(range(dict_tables.MIN_ENTRIES - 1))
    for i in range(dict_tables.MIN_ENTRIES, 4 * dict_tables.MIN_ENTRIES):
        del table[next(iter(table))]
        table[i] = None
    before = sys.getsizeof(table)
    assert not TableTrim().check(table) and sys.getsizeof(table) == before


def test_told_of_the_inserts_a_dict_is_copied_before_cpython_grows_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """`make_room` before each batch: once copied, the table never reaches the size CPython would grow it to
    (checked after every batch: the largest size seen is a copy's), and it holds the same entries in the same
    order as a dict left alone."""
    monkeypatch.setattr(dict_tables, "MIN_ENTRIES", 4096)
    rng = random.Random(8)
    plain: dict[int, None] = dict.fromkeys(range(12_000))
    table: dict[int, None] = dict.fromkeys(range(12_000))
    trim = TableTrim()
    sizes = []
    for step in range(3000):
        new = [rng.randrange(1 << 40) for _ in range(rng.randint(1, 40))]
        trim.make_room(table, len(new))  # each key popped and inserted again takes a new slot
        for target in (plain, table):
            for key in new:
                target.pop(key, None)
                target[key] = None
            while len(target) > 12_000:
                del target[next(iter(target))]
        if step > 1000:
            sizes.append(sys.getsizeof(table))
    assert list(table) == list(plain)
    assert max(sizes) == sys.getsizeof(dict(table)) < sys.getsizeof(plain) / 1.9
