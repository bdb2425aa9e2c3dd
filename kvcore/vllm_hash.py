"""vLLM's prefix-cache block hash (vLLM 0.32 `hash_block_tokens`), and the form it takes in KV events.

block_hash_i = hash_fn((parent_digest or NONE_HASH, tuple(block_i_token_ids), extra_keys)), over full blocks only.
`hash_fn` is `--prefix-caching-hash-algo`: `sha256` (SHA-256 of pickle protocol HIGHEST, the default),
`sha256_cbor` (SHA-256 of canonical CBOR), `xxhash` / `xxhash_cbor` (xxh3-128 of the same). NONE_HASH =
hash_fn(seed), seed = PYTHONHASHSEED if set, else "vllm-none-hash" for the sha256 variants (random per process for
the xxhash ones). Events carry the digest's low 8 bytes as a big-endian unsigned int, or the raw digest when
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0. Checked against vLLM's source and live events (tests/test_conformance.py).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

Digest = bytes
EventHash = int | bytes
HashFn = Callable[[Any], bytes]
# (parent digest, one block's token ids, its extra keys) -> its digest
BlockHasher = Callable[[Digest | None, Sequence[int], tuple[Any, ...] | None], Digest]

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1


def _cbor_head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    if n < 1 << 8:
        return bytes([major << 5 | 24, n])
    if n < 1 << 16:
        return bytes([major << 5 | 25]) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes([major << 5 | 26]) + n.to_bytes(4, "big")
    if n < 1 << 64:
        return bytes([major << 5 | 27]) + n.to_bytes(8, "big")
    raise ValueError("integers beyond 64 bits are not supported")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR (as `cbor2.dumps(obj, canonical=True)`) for the types block hashes contain: None, bool,
    int, str, bytes, float, tuples/lists, and dicts."""
    if obj is None:
        return b"\xf6"
    if obj is True:
        return b"\xf5"
    if obj is False:
        return b"\xf4"
    if isinstance(obj, int):
        return _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_head(2, len(obj)) + obj
    if isinstance(obj, str):
        data = obj.encode("utf-8")
        return _cbor_head(3, len(data)) + data
    if isinstance(obj, tuple | list):
        return _cbor_head(4, len(obj)) + b"".join(cbor_canonical(x) for x in obj)
    if isinstance(obj, dict):
        items = sorted(((cbor_canonical(k), cbor_canonical(v)) for k, v in obj.items()),
                       key=lambda kv: (len(kv[0]), kv[0]))
        return _cbor_head(5, len(items)) + b"".join(k + v for k, v in items)
    if isinstance(obj, float):  # canonical: the shortest of half/single/double that is exact
        for fmt, head in (("!e", 0xF9), ("!f", 0xFA)):
            try:
                packed = struct.pack(fmt, obj)
            except OverflowError:
                continue
            if struct.unpack(fmt, packed)[0] == obj or obj != obj:
                return bytes([head]) + packed
        return b"\xfb" + struct.pack("!d", obj)
    raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor_canonical(obj)).digest()


def xxhash_pickle(obj: Any) -> bytes:
    import xxhash

    digest: bytes = xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    return digest


def xxhash_cbor(obj: Any) -> bytes:
    import xxhash

    digest: bytes = xxhash.xxh3_128_digest(cbor_canonical(obj))
    return digest


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256, "sha256_cbor": sha256_cbor, "xxhash": xxhash_pickle,
                                "xxhash_cbor": xxhash_cbor}


def hash_fn(algo: str) -> HashFn:
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ValueError(f"unsupported prefix caching hash algorithm {algo!r}; one of {HASH_ALGOS}") from None


def none_hash_seed(algo: str, env: dict[str, str] | None = None) -> str:
    """The seed of NONE_HASH as vLLM resolves it (PYTHONHASHSEED wins)."""
    env = dict(os.environ) if env is None else env
    seed = env.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        return os.urandom(32).hex()
    return DEFAULT_NONE_HASH_SEED


def none_hash(algo: str, seed: str | None = None) -> Digest:
    return hash_fn(algo)(none_hash_seed(algo) if seed is None else seed)


def hash_block_tokens(fn: HashFn, parent: Digest | None, token_ids: Sequence[int], none: Digest,
                      extra_keys: tuple[Any, ...] | None = None) -> Digest:
    """One block's digest; `none` (NONE_HASH) stands in for a missing parent, as in vLLM."""
    return fn((parent or none, tuple(token_ids), extra_keys))


def cache_salt_extra_keys(cache_salt: str | None) -> tuple[Any, ...] | None:
    """The first block's extra keys for a request's `cache_salt` (later blocks have none)."""
    return (("cache_salt", cache_salt),) if cache_salt else None


def chain_hashes(hasher: BlockHasher, token_ids: Sequence[int], block_size: int,
                 first_extra_keys: tuple[Any, ...] | None = None) -> list[Digest]:
    """The digests of every full block of a prompt, each chained to the one before (the first to NONE_HASH);
    `first_extra_keys` are the first block's extra keys (`cache_salt_extra_keys`)."""
    out: list[Digest] = []
    parent: Digest | None = None
    extra = first_extra_keys
    for end in range(block_size, len(token_ids) + 1, block_size):
        parent = hasher(parent, token_ids[end - block_size:end], extra)
        extra = None
        out.append(parent)
    return out


def block_hashes(token_ids: Sequence[int], block_size: int, algo: str = "sha256", *, seed: str | None = None,
                 cache_salt: str | None = None) -> list[Digest]:
    """The digests of every full block of a prompt, as an engine with these settings computes them."""
    hasher, _ = make_block_hasher(algo, seed)
    return chain_hashes(hasher, token_ids, block_size, cache_salt_extra_keys(cache_salt))


def use_int_event_hashes(env: dict[str, str] | None = None) -> bool:
    env = dict(os.environ) if env is None else env
    return bool(int(env.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


def event_hash(digest: Digest) -> int:
    """A digest as KV events carry it by default: the low 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest, "big") & _U64


def make_block_hasher(algo: str = "sha256", seed: str | None = None,
                      int_hashes: bool | None = None) -> tuple[BlockHasher, Callable[[Digest], EventHash]]:
    """(hasher(parent, block_token_ids, extra_keys) -> digest, digest -> event hash) for one engine's settings."""
    fn, none = hash_fn(algo), none_hash(algo, seed)

    def hasher(parent: Digest | None, token_ids: Sequence[int], extra_keys: tuple[Any, ...] | None = None) -> Digest:
        return hash_block_tokens(fn, parent, token_ids, none, extra_keys)

    as_int = use_int_event_hashes() if int_hashes is None else int_hashes
    to_event: Callable[[Digest], EventHash] = event_hash if as_int else bytes
    return hasher, to_event
