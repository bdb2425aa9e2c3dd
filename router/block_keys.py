"""Chained block keys: the gateway's own name for each full block of a prompt's token ids.

key_0 = xxh3_64(root || tokens of block 0), key_i = xxh3_64(key_{i-1} || tokens of block i), over full blocks only,
as vLLM's prefix cache does. The root folds in the model, the LoRA adapter and the tenant's cache namespace, so
different tenants never share keys. The keys are independent of the engines' hash algorithm and seed: engine
events carry token ids, from which the gateway computes its own keys.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Container, Sequence

import xxhash

BlockKey = int


# roots of names longer than this are computed each time: the cache holds its arguments, and an engine event's
# LoRA name or cache salt, or a client's cache_salt, may be megabytes (4,096 of them held gigabytes)
ROOT_CACHE_CHARS = 1024


def root_key(model: str, lora: str | None = None, namespace: str | None = None) -> BlockKey:
    """The parent of a prompt's first block: what must match before any block can be shared."""
    if len(model) + len(lora or "") + len(namespace or "") > ROOT_CACHE_CHARS:
        return _root_key(model, lora, namespace)
    return _cached_root_key(model, lora, namespace)


def _root_key(model: str, lora: str | None, namespace: str | None) -> BlockKey:
    return xxhash.xxh3_64_intdigest("\x00".join((model, lora or "", namespace or "")).encode())


# asked once per request, with the same few models, adapters and tenants
_cached_root_key = functools.lru_cache(maxsize=4096)(_root_key)


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return array("I", token_ids).tobytes()


def chain_key(parent: BlockKey, block_tokens: Sequence[int]) -> BlockKey:
    """The key of one block given its parent's key."""
    return xxhash.xxh3_64_intdigest(_token_bytes(block_tokens), seed=parent)


def block_keys(token_ids: Sequence[int], block_size: int, root: BlockKey) -> list[BlockKey]:
    """Keys of every full block of `token_ids`, each chained to the one before."""
    return chain_keys(array("I", token_ids), block_size, root)


def chain_keys(token_ids: array[int], block_size: int, root: BlockKey) -> list[BlockKey]:
    """`block_keys` of ids already held as uint32: one hash call per block, nothing per token."""
    data = memoryview(token_ids).cast("B")
    step = block_size * 4
    keys: list[BlockKey] = []
    parent = root
    digest = xxhash.xxh3_64_intdigest  # the seed passed by position: keyword parsing costs more than the hash
    for end in range(step, len(data) + 1, step):
        parent = digest(data[end - step:end], parent)
        keys.append(parent)
    return keys


def leading_run(keys: Sequence[BlockKey], held: Container[BlockKey]) -> int:
    """How many leading keys are in `held`, found by binary search: whoever holds a chained key holds every key
    before it, so membership is true up to some key and false after. Written out, no callback per probe (one cost
    more than the search)."""
    lo, hi = 0, len(keys)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] in held:
            lo = mid
        else:
            hi = mid - 1
    return lo
