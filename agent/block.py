"""What a stored KV block is: a content key, and opaque bytes behind a small self-checking header.

A block is named by `(layout_id, block_hash)`: the engine's block hash (vLLM's `request.block_hashes`, the same
value its KV events carry) within one KV layout (model, dtype, block size, parallel shape), so two models that
see the same tokens never share a block. The bytes are opaque to the agent. At rest (NVMe, shared tier) a block
is `header + payload`; the header carries the layout id, the payload length and an xxh3-64 checksum, and every
read from a medium outside this process is verified against it.
"""

from __future__ import annotations

import struct
from typing import Final

import xxhash

BlockHash = int | bytes
BlockKey = tuple[int, BlockHash]  # (layout_id, block_hash)

MAGIC: Final = b"KVB1"
HEADER = struct.Struct("<4sHHQQQ")  # magic, version, flags, layout_id, payload length, xxh3-64 of the payload
HEADER_SIZE: Final = HEADER.size
VERSION: Final = 1


class BlockError(Exception):
    """A stored block cannot be used: torn, corrupted, or of another layout."""


class ChecksumError(BlockError):
    """The payload does not match the checksum in its header."""


def checksum(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode_header(layout_id: int, length: int, digest: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, 0, layout_id, length, digest)


def decode_header(raw: bytes | bytearray | memoryview) -> tuple[int, int, int]:
    """(layout_id, length, checksum) of a header; raises BlockError if it is not one."""
    if len(raw) < HEADER_SIZE:
        raise BlockError(f"short header ({len(raw)} bytes)")
    magic, version, _flags, layout_id, length, digest = HEADER.unpack_from(raw)
    if magic != MAGIC or version != VERSION:
        raise BlockError("not a kvgate block")
    return layout_id, length, digest


def pack(layout_id: int, payload: bytes | bytearray | memoryview, digest: int | None = None) -> bytes:
    """Header + payload as one bytes object (for backends that need a single value, e.g. Redis SET)."""
    digest = checksum(payload) if digest is None else digest
    return encode_header(layout_id, len(payload), digest) + bytes(payload)


def verify(key: BlockKey, raw: bytes | bytearray | memoryview) -> memoryview:
    """The payload of a packed block after checking header, layout, length and checksum."""
    layout_id, length, digest = decode_header(raw)
    if layout_id != key[0]:
        raise BlockError(f"layout {layout_id:#x} where {key[0]:#x} was asked for")
    payload = memoryview(raw)[HEADER_SIZE:]
    if len(payload) != length:
        raise BlockError(f"torn block: {len(payload)} of {length} payload bytes")
    if checksum(payload) != digest:
        raise ChecksumError("payload checksum mismatch")
    return payload


def key_name(key: BlockKey) -> str:
    """A content-addressed name usable as a file name or Redis key: same key -> same name on every node."""
    layout_id, block_hash = key
    if isinstance(block_hash, int):
        return f"{layout_id:016x}-{block_hash:016x}"
    return f"{layout_id:016x}-x{block_hash.hex()}"  # "x" is not a hex digit: never read as an int key


def parse_key_name(name: str) -> BlockKey | None:
    """Inverse of `key_name`; None for names that are not block names."""
    layout, sep, rest = name.partition("-")
    if not sep or len(layout) != 16:
        return None
    try:
        layout_id = int(layout, 16)
        if rest.startswith("x"):
            return layout_id, bytes.fromhex(rest[1:])
        if len(rest) != 16:
            return None
        return layout_id, int(rest, 16)
    except ValueError:
        return None
