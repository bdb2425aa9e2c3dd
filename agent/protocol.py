"""Wire types of the agent's local API (Unix socket): small msgpack control messages, block bytes in shared memory.

A frame is a 4-byte little-endian length followed by one msgpack message, tagged by `op`. A client first sends
`Hello` (the agent answers any other first frame with an error, and closes the connection), with the file
descriptor of a shared-memory region it created (a memfd sealed against shrinking) passed along (SCM_RIGHTS);
afterwards `Store` / `Load` refer to block bytes by offset and length inside that region, so KV bytes never travel
through the socket. A client without shared memory (e.g. a
remote simulator) sends and receives the bytes inline (`data`) instead.

`Hello` says how big the shared memory is and, for a client with one block layout (a vLLM worker), declares that
layout and its block size; the agent answers with the size it mapped and refuses a block size that does not fit,
and later a `Store` or `Load` of another layout or block size on that connection. So both
sides agree on the region before any block bytes move, and bytes one side would misread are never written.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Iterator
from typing import Annotated

import msgspec

# as in agent.block (not imported: this module also loads inside vLLM's environment, which lacks xxhash)
BlockHash = int | bytes
# what a request may name, as the tiers can keep it: a 64-bit unsigned layout and int hash (the NVMe segments' and
# the shared tier's headers pack them as such; a negative one raised in the store's threads, a store without DRAM
# lost its connection with no answer), a bytes hash of at most 64 bytes (a segment record's key; as a file name
# in the shared directory a longer one was too long, and every such store counted the directory down)
MAX_HASH_BYTES = 64
U64 = Annotated[int, msgspec.Meta(ge=0)]  # (msgpack carries no int above 2**64 - 1)
WireHash = U64 | Annotated[bytes, msgspec.Meta(max_length=MAX_HASH_BYTES)]
# hashes one Lookup may name: a 128k-token prompt at vLLM's smallest block size (1 token; 8k blocks at its default
# 16), 1.1 MiB of frame. A Lookup is decoded and answered on the agent's event loop, every other client's lookups
# waiting meanwhile: one of 2^20 hashes held the loop for 60 ms (70 ms for 64-byte hashes, 320 ms with every block
# held). A longer one is refused before its elements are decoded; AgentClient.lookup asks a longer prefix a
# piece of this many at a time
MAX_LOOKUP_HASHES = 2**17
# blocks one Store or Load may name: 2^15, 0.5 MiB of frame, decoded in about 1.5 ms. A request is decoded on the
# agent's event loop, every other client's lookups waiting meanwhile: a Store or Load of 2^20 blocks (the bound
# before, 16 million tokens at vLLM's default 16 per block) held the loop for 100-230 ms (and a frame of 10
# million hashes and offsets made the agent hold 5 GB while it decoded them, before any bound). The connector
# sends a Store or Load per batch of its shared memory (256 MiB by default), which reaches this many blocks only
# for blocks of at most 8 KiB (block size 1 with a tiny model); a step's saves are at most max_num_batched_tokens
# / block size blocks. A longer one is refused before its elements are decoded; AgentClient splits a longer chain
# or load into requests of this many, sent in one write
MAX_BATCH_BLOCKS = 2**15
Batch = Annotated[list[WireHash], msgspec.Meta(max_length=MAX_BATCH_BLOCKS)]
Ints = Annotated[list[int], msgspec.Meta(max_length=MAX_BATCH_BLOCKS)]

FRAME = struct.Struct("<I")
MAX_FRAME = 256 * 2**20
MAX_HELLO = 4096  # the first frame, read with the descriptor it carries
PROTOCOL_VERSION = 2


class Hello(msgspec.Struct, tag="hello", tag_field="op", kw_only=True):
    """The first frame of a connection; client and agent must speak the same `version` (each refuses the other's
    otherwise: a block written under one protocol is never read under another). `shm_bytes` > 0: its one passed
    descriptor is the client's shared memory, a memfd of that size sealed against shrinking (the agent maps it; a
    region that could shrink under the mapping would kill the agent with SIGBUS)."""

    shm_bytes: int = 0
    client: str = ""
    # the client's PROTOCOL_VERSION; absent in a Hello of the protocol-2 clients that did not send it yet
    version: int = 2
    layout: U64 = 0  # nonzero: the only layout this connection stores and loads
    block_bytes: int = 0  # nonzero: the only block size this connection stores and loads (must fit the shared memory)


class Lookup(msgspec.Struct, tag="lookup", tag_field="op", kw_only=True):
    layout: U64
    hashes: Annotated[list[WireHash], msgspec.Meta(max_length=MAX_LOOKUP_HASHES)]
    probe_ms: int = 0  # > 0: wait up to this long for the shared backend to be asked about unknown blocks


class Store(msgspec.Struct, tag="store", tag_field="op", kw_only=True):
    """Consecutive blocks of one prefix: block i's parent is block i-1, block 0's is `parent`."""

    layout: U64
    hashes: Batch
    parent: WireHash | None = None
    offsets: Ints = []  # in the client's shared memory ...
    lengths: Ints = []
    data: Annotated[list[bytes], msgspec.Meta(max_length=MAX_BATCH_BLOCKS)] = []  # ... or inline


class Load(msgspec.Struct, tag="load", tag_field="op", kw_only=True):
    """Load the leading run of these blocks; block i goes to `offsets[i]`, at most `block_bytes` long."""

    layout: U64
    hashes: Batch
    block_bytes: int
    offsets: Ints = []  # empty: reply with the bytes inline


class Stats(msgspec.Struct, tag="stats", tag_field="op", kw_only=True):
    pass


Request = Hello | Lookup | Store | Load | Stats


class ReceivedStore(Store, tag="store"):
    """A `Store` as the agent decodes it: its inline blocks are views into the frame they came in, not copies of
    them (decoding a 128 MiB store into bytes of its own held the agent's event loop for 65 ms, and a thread
    would not have helped: a decode holds the GIL throughout)."""

    data: Annotated[list[memoryview], msgspec.Meta(max_length=MAX_BATCH_BLOCKS)] = []  # type: ignore[assignment]


class HelloReply(msgspec.Struct, tag="hello", tag_field="op", kw_only=True):
    version: int
    pid: int
    shm_bytes: int = 0  # the size of the region the agent mapped (0: none)


class LookupReply(msgspec.Struct, tag="lookup", tag_field="op", kw_only=True):
    count: int
    where: str  # one character per block: C (DRAM), D (NVMe), S (shared)


class StoreReply(msgspec.Struct, tag="store", tag_field="op", kw_only=True):
    stored: int


class LoadReply(msgspec.Struct, tag="load", tag_field="op", kw_only=True):
    lengths: list[int]  # one per loaded block, a leading run of the request's hashes
    data: list[bytes] = []


class TierInfo(msgspec.Struct, kw_only=True):
    used_bytes: int
    blocks: int
    capacity_bytes: int
    hits: int
    misses: int


class StatsReply(msgspec.Struct, tag="stats", tag_field="op", kw_only=True):
    tiers: dict[str, TierInfo]


class ErrorReply(msgspec.Struct, tag="error", tag_field="op", kw_only=True):
    message: str


Reply = HelloReply | LookupReply | StoreReply | LoadReply | StatsReply | ErrorReply


class AgentError(Exception):
    """The agent answered with an error, or the connection to it failed."""


class AgentRefused(AgentError):
    """The agent answered, and the answer is no: an error reply, or a Hello it or this client cannot accept."""


request_decoder = msgspec.msgpack.Decoder(Hello | Lookup | ReceivedStore | Load | Stats)  # the agent's side
reply_decoder = msgspec.msgpack.Decoder(Reply)
encoder = msgspec.msgpack.Encoder()


def frame(message: msgspec.Struct) -> bytearray:
    """The message with its length in front, encoded into one buffer (an answer with blocks is written
    `frame_in_pieces`, not copied into one)."""
    buffer = bytearray(FRAME.size)
    encoder.encode_into(message, buffer, FRAME.size)
    FRAME.pack_into(buffer, 0, len(buffer) - FRAME.size)
    return buffer


# blocks smaller than this go out copied together into pieces of about this size (a piece per block of a million
# tiny ones cost a transport call each); a block this big goes out as its own buffer
SMALL_PIECE = 64 * 2**10
_EMPTY_DATA = b"\xa4data\x90"  # what an answer without blocks ends with: the key "data", an empty array


def frame_in_pieces(reply: LoadReply) -> Iterator[bytes | bytearray]:
    """frame(reply), byte for byte, as pieces to write one after the other: the header, then the blocks' own
    buffers (frame() copied every block into one buffer, so an inline answer was held twice while it was made and
    sent: 183 MiB more at the peak for a 96 MiB answer). The blocks are taken out of `reply.data` as they are
    yielded: a block a transport copies (asyncio's does) is let go of at once, not held until the last is out."""
    blocks = deque(reply.data)
    reply.data = []
    skeleton = encoder.encode(reply)
    if not skeleton.endswith(_EMPTY_DATA):  # (LoadReply's last field is `data`: a new field goes before it)
        raise AssertionError("a LoadReply that does not end with its blocks")
    head = _array_header(len(blocks))
    size = len(skeleton) - 1 + len(head) + sum(len(_bin_header(len(b))) + len(b) for b in blocks)
    piece = bytearray(FRAME.pack(size))
    piece += memoryview(skeleton)[:-1]
    piece += head
    while blocks:
        block = blocks.popleft()
        piece += _bin_header(len(block))
        if len(block) < SMALL_PIECE:
            piece += block
            if len(piece) < SMALL_PIECE:
                continue
            yield piece
        else:
            yield piece
            yield block
        piece = bytearray()  # (a piece given away is never written again: uvloop sends it as it is)
    if piece:
        yield piece


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    return b"\xdc" + n.to_bytes(2, "big") if n < 2**16 else b"\xdd" + n.to_bytes(4, "big")


def _bin_header(n: int) -> bytes:
    if n < 2**8:
        return b"\xc4" + n.to_bytes(1, "big")
    return b"\xc5" + n.to_bytes(2, "big") if n < 2**16 else b"\xc6" + n.to_bytes(4, "big")
