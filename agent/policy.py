"""What the agent decides about a block, apart from moving its bytes: which tiers take it when it is stored, where
it goes when a tier pushes it out, whether a hit brings it back up, and how often it must have been used before a
slower tier takes it. The tier stack (agent/store.py) asks; the virtual-time simulator (bench/vsim.py) runs that
same stack over tiers that hold no bytes.

- write policy `eager`: a stored block is also written to every lower tier that admits it (write-through);
  `lazy`: it moves down only when a tier pushes it out, to the first lower tier that admits it.
- admission: NVMe / the shared tier take a block only once it has been used (stored or hit) N times.
- promotion: a block read from NVMe or the shared tier is copied into DRAM.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import islice

from agent.block import BlockKey
from agent.config import AgentConfig
from agent.tiers.base import TierName


class UseCounter:
    """How often each block was stored or hit, bounded: the oldest half is forgotten when full."""

    def __init__(self, limit: int = 262_144) -> None:  # ~50 MB at most
        self.limit = limit
        self._counts: dict[BlockKey, int] = {}

    def bump(self, key: BlockKey) -> int:
        n = self._counts.get(key, 0) + 1
        self._counts[key] = n
        if len(self._counts) > self.limit:
            self._forget()
        return n

    def _forget(self) -> None:
        """Forget the oldest half, into a new dict: one the old half was popped from keeps its full-size table
        (twice the memory, with a simulation's eight replicas 80 MB)."""
        self._counts = dict(islice(self._counts.items(), self.limit // 2, None))

    def bump_all(self, keys: list[BlockKey]) -> list[int]:
        """`bump` each key, in order; their counts."""
        counts = self._counts
        limit = self.limit
        out = []
        for key in keys:
            n = counts.get(key, 0) + 1
            counts[key] = n
            if len(counts) > limit:
                self._forget()
                counts = self._counts
            out.append(n)
        return out

    def get(self, key: BlockKey) -> int:
        return self._counts.get(key, 0)


@dataclass(frozen=True)
class TierPolicy:
    eager: bool = False
    promote_on_hit: bool = True
    nvme_admit_reuse: int = 1
    shared_admit_reuse: int = 1

    @classmethod
    def from_config(cls, config: AgentConfig) -> TierPolicy:
        return cls(eager=config.write_policy == "eager", promote_on_hit=config.promote_on_hit,
                   nvme_admit_reuse=config.nvme_admit_reuse, shared_admit_reuse=config.shared_admit_reuse)

    def admits(self, tier: TierName, uses: int) -> bool:
        """Whether `tier` takes a block used `uses` times (DRAM takes every block)."""
        if tier is TierName.NVME:
            return uses >= self.nvme_admit_reuse
        if tier is TierName.SHARED:
            return uses >= self.shared_admit_reuse
        return True

    def write_through(self, below: Iterable[TierName], uses: int) -> list[TierName]:
        """The lower tiers a block goes to right after it is stored: eager, every one that admits it."""
        return [tier for tier in below if self.admits(tier, uses)] if self.eager else []

    def demote_to(self, below: Iterable[TierName], uses: int) -> TierName | None:
        """Where a block a tier pushes out goes: lazy, the first lower tier that admits it; eager, nowhere (it was
        written through when stored)."""
        if self.eager:
            return None
        return next((tier for tier in below if self.admits(tier, uses)), None)
