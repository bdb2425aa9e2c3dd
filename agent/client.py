"""A blocking client of the tier agent's local API, for the vLLM connector (scheduler and worker processes) and
the simulator.

The client creates its shared memory as a memfd (no name, nothing left behind if either side dies), seals it
against shrinking and growing, and passes its descriptor to the agent with `Hello` (SCM_RIGHTS): no file
permissions or shared /dev/shm between the two processes are involved, and the region cannot shrink under the
agent's mapping. Block bytes are written to / read from that region in place;
only offsets and hashes cross the socket. Every call has a timeout; a failed call closes the connection and the
next call reconnects, with a new region (`generation` counts them).

The client never unmaps a region itself: closing drops its reference, and the mapping goes when the last one does.
So a zero-copy view made over `mapping` (a torch tensor) is stale after a reconnect, but never dangling: a view
whose memory was unmapped under it reads or writes whatever is mapped there next.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec

from agent.breaker import AgentCircuit
from agent.protocol import (
    FRAME,
    MAX_BATCH_BLOCKS,
    MAX_FRAME,
    MAX_LOOKUP_HASHES,
    PROTOCOL_VERSION,
    AgentError,
    AgentRefused,
    BlockHash,
    ErrorReply,
    Hello,
    HelloReply,
    Load,
    LoadReply,
    Lookup,
    LookupReply,
    Reply,
    Stats,
    StatsReply,
    Store,
    StoreReply,
    frame,
    reply_decoder,
)

Buffer = bytes | bytearray | memoryview


class InPlaceChain(NamedTuple):
    """A chain of blocks already written into the client's shared memory: block i at `offsets[i]`, `lengths[i]`
    bytes long, the first one's parent `parent`."""

    hashes: Sequence[BlockHash]
    offsets: Sequence[int]
    lengths: Sequence[int]
    parent: BlockHash | None = None


class AgentBadReply(AgentError):
    """The agent answered a Load with more blocks than it asked for: nothing of that answer can be trusted."""


class AgentClient:
    """`layout` and `block_bytes`, if given, are declared in Hello: the agent then refuses any other on this
    connection (a vLLM worker has exactly one of each). `circuit`, if given, is opened by a call the agent does
    not answer; while it is open every call fails at once (agent/breaker.py)."""

    def __init__(self, socket_path: str, shm_bytes: int = 64 * 2**20, timeout_s: float = 5.0,
                 name: str = "", layout: int = 0, block_bytes: int = 0, circuit: AgentCircuit | None = None) -> None:
        self.socket_path = socket_path
        self.shm_bytes = shm_bytes
        self.timeout_s = timeout_s
        self.name = name
        self.layout = layout
        self.block_bytes = block_bytes
        self.circuit = circuit
        self._sock: socket.socket | None = None
        self._shm: mmap.mmap | None = None
        self.shm: memoryview | None = None  # the shared region, valid while connected
        self.generation = 0  # bumped on every (re)connect: views of an older `shm` are stale
        self.round_trips = 0  # writes of one or more requests answered in full (a batch of Stores is one)

    # -- connection ------------------------------------------------------------------------------------------

    def connect(self) -> None:
        if self._sock is not None:
            return
        if self.circuit is not None and self.circuit.is_open:
            raise AgentError(f"the tier agent at {self.socket_path} did not answer: not called until it does")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            self._unanswered(exc)
            raise AgentError(f"cannot reach the tier agent at {self.socket_path}: {exc}") from exc
        self._sock = sock
        self.generation += 1
        fd = None
        try:
            if self.shm_bytes > 0:
                fd = os.memfd_create(f"kvgate-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, self.shm_bytes)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
                self._shm = mmap.mmap(fd, self.shm_bytes)
                self.shm = memoryview(self._shm)
            mapped = self.shm_bytes if fd is not None else 0
            reply = self._call(Hello(shm_bytes=mapped, client=self.name, version=PROTOCOL_VERSION,
                                     layout=self.layout, block_bytes=self.block_bytes),
                               fds=[fd] if fd is not None else [])
            if not isinstance(reply, HelloReply):
                raise AgentRefused(f"unexpected hello reply {reply!r}")
            if reply.version != PROTOCOL_VERSION:
                raise AgentRefused(f"the tier agent speaks protocol {reply.version}, this client "
                                   f"{PROTOCOL_VERSION}: upgrade both")
            if reply.shm_bytes != mapped:
                raise AgentRefused(f"the tier agent mapped {reply.shm_bytes} bytes of shared memory, not {mapped}")
        except BaseException as exc:
            self.close()
            if isinstance(exc, AgentRefused) and self.circuit is not None:
                # it will not talk to this client as it is (another protocol, say: an upgrade of one side): not
                # called again, and refused again, on every call, until a probe's Hello is accepted
                self.circuit.trip(f"refused at Hello: {exc}")
            raise
        finally:
            if fd is not None:
                os.close(fd)  # the mapping (and the agent's) keep the memory

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def mapping(self) -> mmap.mmap | None:
        """The shared region itself, for zero-copy views that must keep it mapped while they live."""
        self.connect()
        return self._shm

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self.shm is not None:
            self.shm.release()
            self.shm = None
        self._shm = None  # unmapped now, or when the last view made over `mapping` goes (see the module doc)

    def __enter__(self) -> AgentClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, request: msgspec.Struct, retry: bool = False, fds: Sequence[int] = ()) -> Reply:
        """One request; `retry` re-sends once on a fresh connection (for calls that do not use the shared
        memory, which a reconnect replaces) -- e.g. after the agent restarted. `fds` go along with it (Hello)."""
        if retry and self._sock is not None:
            try:
                return self._call(request)
            except AgentError as exc:
                if self._sock is not None:  # the agent answered with an error: nothing to retry
                    raise
                del exc
        return self._call_many([request], fds)[0]

    def _call_many(self, requests: Sequence[msgspec.Struct], fds: Sequence[int] = ()) -> list[Reply]:
        """Requests sent together (one write), then their replies read in order: the agent answers a connection's
        frames one after the other, so several requests cost one wake-up of each side, not one per request. Raises
        AgentRefused, after reading every reply, if the agent refused any."""
        self.connect()
        sock = self._sock
        assert sock is not None
        try:
            data = b"".join(frame(request) for request in requests)
            if fds:
                if socket.send_fds(sock, [data], list(fds)) != len(data):
                    raise AgentError("hello frame sent in part")
            else:
                sock.sendall(data)
            replies = []
            for _ in requests:
                (size,) = FRAME.unpack(self._recv_exact(sock, FRAME.size))
                if size > MAX_FRAME:
                    raise AgentError(f"reply frame of {size} bytes")
                replies.append(reply_decoder.decode(self._recv_exact(sock, size)))
            self.round_trips += 1
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.close()
            if isinstance(exc, TimeoutError):  # hung; a cut connection (a restart) is for the reconnect to judge
                self._unanswered(exc)
            raise AgentError(f"tier agent call failed: {exc}") from exc
        refused = next((reply for reply in replies if isinstance(reply, ErrorReply)), None)
        if refused is not None:
            raise AgentRefused(refused.message)
        return replies

    def _unanswered(self, exc: Exception) -> None:
        if self.circuit is not None:
            self.circuit.trip(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    @staticmethod
    def _recv_exact(sock: socket.socket, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionError("the tier agent closed the connection")
            got += k
        return bytes(buf)

    def _expect(self, reply: Reply, kind: type[Any]) -> Any:
        if not isinstance(reply, kind):
            raise AgentError(f"expected {kind.__name__}, got {type(reply).__name__}")
        return reply

    # -- API -------------------------------------------------------------------------------------------------

    def lookup(self, layout: int, hashes: Sequence[BlockHash], probe_ms: int = 0) -> tuple[int, str]:
        """How many leading blocks the agent holds and where (C DRAM, D NVMe, S shared). A prefix longer than
        one Lookup may name (MAX_LOOKUP_HASHES) is asked a piece at a time, the next piece only if the agent holds
        all of this one."""
        count, where = 0, ""
        for start in range(0, max(len(hashes), 1), MAX_LOOKUP_HASHES):
            piece = list(hashes if len(hashes) <= MAX_LOOKUP_HASHES else hashes[start: start + MAX_LOOKUP_HASHES])
            reply: LookupReply = self._expect(self._call(Lookup(layout=layout, hashes=piece, probe_ms=probe_ms),
                                                         retry=True), LookupReply)
            count, where = count + reply.count, where + reply.where
            if reply.count < len(piece):
                break
        return count, where

    def max_blocks(self, block_bytes: int) -> int:
        """How many blocks of this size fit in one shared-memory batch."""
        self.connect()
        return max(1, self.shm_bytes // block_bytes) if self.shm_bytes else 1 << 30

    def store_in_place(self, layout: int, hashes: Sequence[BlockHash], offsets: Sequence[int],
                       lengths: Sequence[int], parent: BlockHash | None = None) -> int:
        """Store blocks the caller already wrote into `self.shm` at these offsets."""
        return self.store_chains_in_place(layout, [InPlaceChain(hashes, offsets, lengths, parent)])[0]

    def store_chains_in_place(self, layout: int, chains: Sequence[InPlaceChain]) -> list[int]:
        """Store several chains the caller already wrote into `self.shm`, one `Store` each, sent together (a vLLM
        step's saves: one round trip, not one per request); how many blocks of each the agent stored. A chain
        longer than one Store may name (MAX_BATCH_BLOCKS) goes as several, in the same write."""
        stores: list[Store] = []
        owners: list[int] = []  # the chain each Store is a piece of
        for i, c in enumerate(chains):
            for start in range(0, max(len(c.hashes), 1), MAX_BATCH_BLOCKS):
                end = start + MAX_BATCH_BLOCKS
                stores.append(Store(layout=layout, hashes=list(c.hashes[start:end]),
                                    parent=c.parent if start == 0 else c.hashes[start - 1],
                                    offsets=list(c.offsets[start:end]), lengths=list(c.lengths[start:end])))
                owners.append(i)
        stored = [0] * len(chains)
        for owner, reply in zip(owners, self._call_many(stores), strict=True):
            stored[owner] += self._expect(reply, StoreReply).stored
        return stored

    def store(self, layout: int, hashes: Sequence[BlockHash], payloads: Sequence[Buffer],
              parent: BlockHash | None = None) -> int:
        """Store a chain of blocks (copied into shared memory batch by batch, or sent inline without it)."""
        self.connect()
        if self.shm is None:  # MAX_BATCH_BLOCKS a Store, sent together
            pieces = range(0, max(len(hashes), 1), MAX_BATCH_BLOCKS)
            replies = self._call_many([Store(layout=layout, hashes=list(hashes[i: i + MAX_BATCH_BLOCKS]),
                                             parent=parent if i == 0 else hashes[i - 1],
                                             data=[bytes(p) for p in payloads[i: i + MAX_BATCH_BLOCKS]])
                                       for i in pieces])
            return sum(self._expect(reply, StoreReply).stored for reply in replies)
        stored = 0
        i = 0
        while i < len(hashes):
            offsets: list[int] = []
            lengths: list[int] = []
            pos = 0
            j = i
            while j < len(hashes) and pos + len(payloads[j]) <= len(self.shm):
                n = len(payloads[j])
                self.shm[pos: pos + n] = payloads[j]
                offsets.append(pos)
                lengths.append(n)
                pos += n
                j += 1
            if j == i:
                raise AgentError(f"a block of {len(payloads[i])} bytes does not fit {len(self.shm)} bytes of shm")
            stored += self.store_in_place(layout, hashes[i:j], offsets, lengths,
                                          parent if i == 0 else hashes[i - 1])
            i = j
        return stored

    def load_in_place(self, layout: int, hashes: Sequence[BlockHash], block_bytes: int) -> list[int]:
        """Load the leading run of blocks into `self.shm` (block i at i * block_bytes); their lengths. More blocks
        than one Load may name (MAX_BATCH_BLOCKS) are asked as several Loads in one write, the run cut at the
        first piece that comes back short."""
        self.connect()
        count = len(hashes)
        if count > self.max_blocks(block_bytes):
            raise AgentError(f"{count} blocks of {block_bytes} bytes do not fit the shared memory")
        pieces = range(0, max(count, 1), MAX_BATCH_BLOCKS)
        replies = self._call_many([Load(layout=layout, hashes=list(hashes[i: i + MAX_BATCH_BLOCKS]),
                                        block_bytes=block_bytes,
                                        offsets=[k * block_bytes for k in range(i, min(count, i + MAX_BATCH_BLOCKS))])
                                   for i in pieces])
        return self._leading_run(replies, count)

    def _leading_run(self, replies: Sequence[Reply], count: int) -> list[int]:
        """The lengths of the Loads of consecutive pieces of MAX_BATCH_BLOCKS, up to the first short one;
        AgentBadReply if one has more blocks than its Load asked for (joined to the next piece's, they would
        stand for blocks of that piece the agent never wrote)."""
        lengths: list[int] = []
        for i, reply in enumerate(replies):
            piece: LoadReply = self._expect(reply, LoadReply)
            asked = min(MAX_BATCH_BLOCKS, count - i * MAX_BATCH_BLOCKS)
            if len(piece.lengths) > asked or len(piece.data) > asked:
                raise AgentBadReply(f"the agent answered {max(len(piece.lengths), len(piece.data))} blocks for "
                                    f"{asked}")
            lengths += piece.lengths
            if len(piece.lengths) < asked:
                break
        return lengths

    def load(self, layout: int, hashes: Sequence[BlockHash], block_bytes: int) -> list[bytes]:
        """Load the leading run of blocks as bytes (a copy; for tests and the simulator)."""
        self.connect()
        if self.shm is None:  # MAX_BATCH_BLOCKS a Load, sent together
            replies = self._call_many([Load(layout=layout, hashes=list(hashes[i: i + MAX_BATCH_BLOCKS]),
                                            block_bytes=block_bytes)
                                       for i in range(0, max(len(hashes), 1), MAX_BATCH_BLOCKS)])
            data: list[bytes] = []
            for i, reply in enumerate(replies):
                piece: LoadReply = self._expect(reply, LoadReply)
                asked = min(MAX_BATCH_BLOCKS, len(hashes) - i * MAX_BATCH_BLOCKS)
                if len(piece.lengths) > asked or len(piece.data) > asked:  # (as in _leading_run)
                    raise AgentBadReply(f"the agent answered {max(len(piece.lengths), len(piece.data))} blocks "
                                        f"for {asked}")
                data += piece.data
                if len(piece.data) < asked:
                    break
            return data
        out: list[bytes] = []
        step = self.max_blocks(block_bytes)
        for i in range(0, len(hashes), step):
            chunk = hashes[i: i + step]
            lengths = self.load_in_place(layout, chunk, block_bytes)
            assert self.shm is not None
            out.extend(bytes(self.shm[k * block_bytes: k * block_bytes + n]) for k, n in enumerate(lengths))
            if len(lengths) < len(chunk):
                break
        return out

    def stats(self) -> StatsReply:
        result: StatsReply = self._expect(self._call(Stats(), retry=True), StatsReply)
        return result
