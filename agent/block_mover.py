"""The worker half of the vLLM connector, without vLLM: whole KV blocks between the paged cache and the tier agent,
through the agent client's shared memory (torch and the client only, so it is tested without an engine).

Nothing here raises into the engine. A load that fails in any way -- the agent gone or hung, its shared memory not
set up or stale, a reply with extra, missing or foreign-sized blocks, any exception at all -- copies only the
leading run of blocks that arrived whole and names why the rest did not, so vLLM recomputes them; a failed save is
dropped (the cache itself is fine). Each failure is counted by reason and logged, at most once per reason every 10 s.

The shared memory is mapped when the caches are registered (`attach`), before the engine's first step, and the
torch view over it holds the mapping itself (`AgentClient.mapping`), so the view can go stale after a reconnect but
never points at unmapped memory; a view is used only while it belongs to the client's current connection
(`Staging.generation`), and every batch is checked against its size and the block size before torch touches it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import torch

from agent.client import AgentBadReply, AgentClient, InPlaceChain
from agent.host_pinning import CudaHostPinning, HostPinning, PinnedRegion
from agent.kv_layout import STAGING_BYTES, BlockCopier, CacheLayer
from agent.protocol import AgentError
from kvcore.log_throttle import LogThrottle, held_back_note

log = logging.getLogger("vllm.kvgate_connector")  # under "vllm" so vLLM's log handler prints it


class Failure(StrEnum):
    """Why blocks were not loaded (or saved); the label of the connector's failure counters."""

    AGENT_UNAVAILABLE = "agent_unavailable"  # cannot connect, the call failed or timed out, or an error reply
    NO_SHARED_MEMORY = "no_shared_memory"  # the region is not mapped, or smaller than one batch
    STALE_SHARED_MEMORY = "stale_shared_memory"  # the region was replaced (a reconnect) while a batch was in flight
    BAD_REPLY = "bad_reply"  # more blocks than asked for, or a block of another size: foreign bytes
    MISSING = "missing"  # the agent no longer holds a block it reported at lookup (evicted in between)
    ERROR = "error"  # any other exception: a bug, logged with its traceback


@dataclass(frozen=True)
class LoadResult:
    loaded: int  # leading blocks copied into the cache whole
    failure: Failure | None = None  # why the rest were not (None: all were)


@dataclass(frozen=True)
class Staging:
    """A torch view of one mapping of the client's shared memory; usable while `generation` is the client's."""

    tensor: torch.Tensor
    generation: int
    pinned: PinnedRegion | None = None  # its registration with CUDA, released before the view is dropped


class BlockMover:
    def __init__(self, client: AgentClient, layout: int, layers: list[CacheLayer],
                 pinning: HostPinning | None = None, staging_bytes: int = STAGING_BYTES) -> None:
        """`pinning`: how the shared memory is page-locked; by default CUDA's when the caches are on a GPU.
        `staging_bytes`: the device buffer batches go through when the caches are on one (agent/kv_layout.py)."""
        self.client = client
        self.pinning = pinning or (CudaHostPinning() if any(layer.tensor.is_cuda for layer in layers) else None)
        self.layout = layout
        self.layers = layers
        self.copier = BlockCopier(layers, staging_bytes)
        self.block_bytes = self.copier.block_bytes
        client.layout, client.block_bytes = layout, self.block_bytes  # declared in Hello: the agent holds us to them
        self.load_failures: Counter[Failure] = Counter()
        self.save_failures: Counter[Failure] = Counter()
        self._staging: Staging | None = None
        self._warnings: dict[str, LogThrottle] = {}  # by reason

    @property
    def batch_blocks(self) -> int:
        """How many blocks one batch through the shared memory holds."""
        return max(1, self.client.shm_bytes // self.block_bytes) if self.block_bytes else 1

    # -- shared memory ---------------------------------------------------------------------------------------

    def attach(self) -> bool:
        """Connect and map the shared memory now, outside any step; False (logged) if the agent is not there yet
        -- the first load or save tries again."""
        try:
            self._current()
        except AgentError as exc:
            self._note(Failure.AGENT_UNAVAILABLE, f"tier agent not reachable yet: {exc}")
            return False
        return True

    def _current(self) -> Staging:
        """The view of the client's current region, made (and checked) on a new connection."""
        mapping = self.client.mapping  # connects if needed
        staging = self._staging
        if staging is not None and staging.generation == self.client.generation:
            return staging
        self._drop_staging()
        if mapping is None:
            raise AgentError("the client has no shared memory")
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping`: never unmapped under the view
        if tensor.numel() != self.client.shm_bytes or tensor.numel() < self.block_bytes:
            raise AgentError(f"shared memory of {tensor.numel()} bytes for blocks of {self.block_bytes}")
        # page-locked: host<->device copies become direct DMA, no bounce buffer
        pinned = PinnedRegion(self.pinning, tensor.data_ptr(), tensor.numel()) if self.pinning else None
        self._staging = Staging(tensor, self.client.generation, pinned)
        return self._staging

    def _rows(self, staging: Staging, n: int) -> torch.Tensor:
        """The first `n` block rows of a view, after checking the view is still the client's and large enough."""
        if staging.generation != self.client.generation or not self.client.connected:
            raise _Stale(f"the shared memory of connection {staging.generation} was replaced")
        if n * self.block_bytes > staging.tensor.numel():
            raise _Stale(f"{n} blocks of {self.block_bytes} bytes do not fit {staging.tensor.numel()} bytes")
        return staging.tensor[: n * self.block_bytes].view(n, self.block_bytes)

    def _drop_staging(self) -> None:
        """Unregister the view, then drop it: the mapping may go with it."""
        staging, self._staging = self._staging, None
        if staging is not None and staging.pinned is not None:
            staging.pinned.release()

    def _reset(self) -> None:
        self._drop_staging()
        self.client.close()

    # -- loads -----------------------------------------------------------------------------------------------

    def load(self, hashes: Sequence[int], block_ids: Sequence[int]) -> LoadResult:
        """Copy the leading run of these blocks that the agent supplies whole into the cache at `block_ids`."""
        # blocks in the cache whole, batch by batch: a failure in a later batch (the retry's included) keeps them
        # loaded. (Counted on return only, a batch that failed after others had arrived reported none loaded, and
        # the retry began again at the first block.)
        loaded = [0]

        def attempt() -> Failure | None:
            return self._load_from(hashes, block_ids, loaded)

        failure = self._guarded("load", attempt)
        if failure is not None:
            self.load_failures[failure] += 1
        return LoadResult(loaded[0], failure)

    def _load_from(self, hashes: Sequence[int], block_ids: Sequence[int], loaded: list[int]) -> Failure | None:
        """Load from block `loaded[0]` on, advancing it past each batch copied in whole."""
        staging = self._current()
        step = max(1, staging.tensor.numel() // self.block_bytes)
        while loaded[0] < len(hashes):
            start = loaded[0]
            chunk = list(hashes[start: start + step])
            try:
                lengths = self.client.load_in_place(self.layout, chunk, self.block_bytes)
            except AgentBadReply as exc:  # more blocks than asked for
                self._note(Failure.BAD_REPLY, str(exc))
                return Failure.BAD_REPLY  # nothing of this reply can be trusted
            whole = 0
            while whole < len(lengths) and lengths[whole] == self.block_bytes:
                whole += 1
            if whole:
                self.copier.scatter(list(block_ids[start: start + whole]), self._rows(staging, whole))
            loaded[0] = start + whole
            if whole < len(lengths):
                self._note(Failure.BAD_REPLY, f"a block of {lengths[whole]} bytes where {self.block_bytes} belong")
                return Failure.BAD_REPLY
            if whole < len(chunk):
                return Failure.MISSING
        return None

    # -- saves -----------------------------------------------------------------------------------------------

    def save(self, hashes: Sequence[int], block_ids: Sequence[int], parent: int | None) -> Failure | None:
        """Hand these computed blocks (a chain after `parent`) to the agent; why not, if they were not."""
        return self.save_chains([SavedChain(hashes, block_ids, parent)])

    def save_chains(self, chains: Sequence[SavedChain]) -> Failure | None:
        """Hand several chains to the agent (a step's saves, one per request) in as few batches as the shared
        memory allows: one gather into it and one round trip per batch, not per chain; why not, if they were not
        (a chain stored before a failure stays stored: storing it again on the retry changes nothing)."""
        def attempt() -> None:
            self._save(chains)

        failure = self._guarded("save", attempt)
        if failure is not None:
            self.save_failures[failure] += 1
        return failure

    def _guarded(self, what: str, attempt: Callable[[], Failure | None]) -> Failure | None:
        """Run a load or save, a second time on a fresh connection if the agent went away (it may have
        restarted); whatever it raises becomes the failure it returns, never an exception into the engine."""
        failure: Failure | None = None
        for retry in range(2):
            try:
                return attempt()
            except AgentError as exc:
                self._reset()
                failure = Failure.AGENT_UNAVAILABLE
                if retry:
                    self._note(failure, f"tier agent unavailable during a {what}: {exc}")
            except _Stale as exc:
                self._reset()
                failure = Failure.STALE_SHARED_MEMORY
                self._note(failure, str(exc))
                break
            except Exception:
                self._reset()
                failure = Failure.ERROR
                self._note(failure, f"unexpected error in a {what}", exc_info=True)
                break
        return failure

    def _save(self, chains: Sequence[SavedChain]) -> None:
        staging = self._current()
        room = max(1, staging.tensor.numel() // self.block_bytes)
        for batch in _batches(chains, room):
            ids = [b for chain in batch for b in chain.block_ids]
            self.copier.gather(ids, self._rows(staging, len(ids)))
            stores, row = [], 0
            for chain in batch:
                n = len(chain.hashes)
                stores.append(InPlaceChain(chain.hashes, range(row * self.block_bytes, (row + n) * self.block_bytes,
                                                               self.block_bytes), [self.block_bytes] * n, chain.parent))
                row += n
            self.client.store_chains_in_place(self.layout, stores)

    # -- the rest --------------------------------------------------------------------------------------------

    def _note(self, reason: Failure, message: str, exc_info: bool = False) -> None:
        held_back = self._warnings.setdefault(reason, LogThrottle()).due()
        if held_back is not None:
            log.warning("kvgate connector: %s (%s); vLLM recomputes what did not load%s", message, reason,
                        held_back_note(held_back), exc_info=exc_info)

    def close(self) -> None:
        self._reset()


class SavedChain(NamedTuple):
    """Computed blocks to save: their hashes, their ids in the cache, and the parent of the first."""

    hashes: Sequence[int]
    block_ids: Sequence[int]
    parent: int | None


def _batches(chains: Sequence[SavedChain], room: int) -> list[list[SavedChain]]:
    """The chains in batches of at most `room` blocks (what the shared memory holds), in order; a chain longer
    than that is cut into pieces, each piece's parent the block before it."""
    batches: list[list[SavedChain]] = [[]]
    used = 0
    for chain in chains:
        start = 0
        while start < len(chain.hashes):
            if used == room:
                batches.append([])
                used = 0
            end = min(len(chain.hashes), start + room - used)
            parent = chain.parent if start == 0 else chain.hashes[start - 1]
            batches[-1].append(SavedChain(chain.hashes[start:end], chain.block_ids[start:end], parent))
            used += end - start
            start = end
    return [batch for batch in batches if batch]


class _Stale(Exception):
    """A view of the shared memory is not the client's current one, or too small for the batch."""
