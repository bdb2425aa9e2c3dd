"""What a stored KV block is: a content key, and opaque bytes behind a small self-checking header.

A block is named by `(layout_id, block_hash)`: the engine's block hash (vLLM's `request.block_hashes`, the same
value its KV events carry) within one KV layout (model, dtype, block size, parallel shape), so two models that
see the same tokens never share a block. The bytes are opaque to the agent. At rest (NVMe, shared tier) a block
is `header + payload`; the header carries the layout id, the payload length and an xxh3-64 checksum, and every
read from a medium outside this process is verified against it. In the fleet-shared tier, which other processes can
write, a block also carries a keyed MAC (`BlockSeal`): BLAKE3 keyed with the fleet secret over header, name and
payload, so only holders of the secret can put a block there that is served.
"""

from __future__ import annotations

import struct
from typing import Final

import blake3
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


FLAG_SEALED: Final = 0x1  # header flag: a MAC tag follows the header
TAG_SIZE: Final = 16
_KEY_CONTEXT = "kvgate 2026 shared-tier block MAC v1"


class BlockSeal:
    """The shared tier's block format: `header + tag + payload` with a fleet secret (tag = BLAKE3 keyed with a key
    derived from the secret, over header, block name and payload, 128 bits), `header + payload` without one. A
    sealing reader refuses unsealed blocks (anyone who can write the backend could have put them there) and
    blocks whose tag does not match; one without a secret refuses sealed blocks (it cannot check them)."""

    def __init__(self, secret: bytes | None) -> None:
        self._key = blake3.blake3(secret, derive_key_context=_KEY_CONTEXT).digest() if secret else None

    @property
    def keyed(self) -> bool:
        return self._key is not None

    @property
    def prefix_size(self) -> int:
        """Bytes before the payload."""
        return HEADER_SIZE + TAG_SIZE if self._key is not None else HEADER_SIZE

    def _tag(self, header: bytes | bytearray | memoryview, key: BlockKey,
             payload: bytes | bytearray | memoryview) -> bytes:
        assert self._key is not None
        mac = blake3.blake3(key=self._key)
        mac.update(header)
        mac.update(key_name(key).encode())
        mac.update(payload)
        return mac.digest(TAG_SIZE)

    def prefix(self, key: BlockKey, payload: bytes | bytearray | memoryview, digest: int | None = None) -> bytes:
        """What goes before the payload at rest: the header, and the tag when keyed."""
        digest = checksum(payload) if digest is None else digest
        if self._key is None:
            return encode_header(key[0], len(payload), digest)
        header = HEADER.pack(MAGIC, VERSION, FLAG_SEALED, key[0], len(payload), digest)
        return header + self._tag(header, key, payload)

    def open(self, key: BlockKey, prefix: bytes | bytearray | memoryview,
             payload: bytes | bytearray | memoryview) -> int:
        """Check a block read back (its prefix and exactly its payload bytes); the payload length."""
        if len(prefix) < HEADER_SIZE:
            raise BlockError(f"short header ({len(prefix)} bytes)")
        magic, version, flags, layout_id, length, digest = HEADER.unpack_from(prefix)
        if magic != MAGIC or version != VERSION:
            raise BlockError("not a kvgate block")
        if layout_id != key[0]:
            raise BlockError(f"layout {layout_id:#x} where {key[0]:#x} was asked for")
        if bool(flags & FLAG_SEALED) != (self._key is not None):
            raise ChecksumError("unsealed block where a fleet secret is set" if self._key is not None
                                else "sealed block and no fleet secret to check it")
        if len(payload) != length:
            raise BlockError(f"torn block: {len(payload)} of {length} payload bytes")
        if self._key is not None:
            tag = bytes(prefix[HEADER_SIZE: HEADER_SIZE + TAG_SIZE])
            if len(tag) != TAG_SIZE or tag != self._tag(prefix[:HEADER_SIZE], key, payload):
                raise ChecksumError("block MAC mismatch (not written with this fleet's secret)")
        elif checksum(payload) != digest:
            raise ChecksumError("payload checksum mismatch")
        return int(length)

    def verify(self, key: BlockKey, raw: bytes | bytearray | memoryview) -> memoryview:
        """The payload of a block stored as one value (a Redis string) after checking it."""
        view = memoryview(raw)
        size = self.prefix_size
        if len(view) < size:
            raise BlockError(f"short block ({len(view)} bytes)")
        payload = view[size:]
        self.open(key, view[:size], payload)
        return payload
