"""The tier agent as the lower KV tiers of a simulated replica (bench/sim): offload evicted blocks, find and load
them again, and the modelled time a load costs instead of a recompute.

A simulated engine has no KV bytes, so it stores a small stand-in payload per block (`payload_bytes`, derived
from the block hash so a load can be checked); agent capacities are then in stand-in bytes. The time a load would
take on real hardware is modelled per tier from the block's real size:
`latency + bytes / bandwidth` for each run of blocks coming from one tier (a run is one transfer).

| tier (lookup code) | bandwidth | latency | basis |
|---|---|---|---|
| DRAM (`C`) | 25 GB/s | 20 us | PCIe Gen5 x16 host-to-device copy, ~half of the 63 GB/s peak achieved |
| NVMe (`D`) | 6 GB/s | 100 us | one Gen4 NVMe drive, sequential read, plus the copy to the GPU |
| shared (`S`) | 10 GB/s | 1 ms | a 100 Gb/s NIC to Redis / Lustre, request round trip included |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent.client import AgentClient
from agent.protocol import AgentError


@dataclass(frozen=True)
class TierLink:
    """What moving KV from one agent tier into GPU memory costs."""

    bytes_per_s: float
    latency_s: float


DEFAULT_LINKS: dict[str, TierLink] = {
    "C": TierLink(25e9, 20e-6),
    "D": TierLink(6e9, 100e-6),
    "S": TierLink(10e9, 1e-3),
}


def transfer_seconds(where: str, block_bytes: int, links: dict[str, TierLink] | None = None) -> float:
    """Modelled time to bring blocks from the tiers named in `where` (one code per block) to the GPU."""
    links = links or DEFAULT_LINKS
    total = 0.0
    previous = ""
    for code in where:
        link = links[code]
        if code != previous:
            total += link.latency_s
            previous = code
        total += block_bytes / link.bytes_per_s
    return total


def stand_in(block_hash: int, size: int) -> bytes:
    """A payload that names its block: a wrong block loaded back is noticed."""
    seed = block_hash.to_bytes(8, "big")
    return (seed * (size // 8 + 1))[:size]


class AgentOffload:
    """A simulated replica's handle on its tier agent. Every method degrades to "nothing there" when the
    agent is unreachable, as the vLLM connector does."""

    def __init__(self, socket_path: str, layout: int, block_bytes: int, payload_bytes: int = 64,
                 links: dict[str, TierLink] | None = None, timeout_s: float = 2.0) -> None:
        self.layout = layout
        self.block_bytes = block_bytes  # real KV bytes of one block: drives the modelled transfer time
        self.payload_bytes = payload_bytes
        self.links = links or DEFAULT_LINKS
        self.client = AgentClient(socket_path, shm_bytes=0, timeout_s=timeout_s, name="sim")
        self.errors = 0

    def offload(self, hashes: Sequence[int], parent: int | None = None) -> int:
        """Hand blocks leaving GPU memory (a chain: block i's parent is block i-1) to the agent."""
        try:
            return self.client.store(self.layout, hashes, [stand_in(h, self.payload_bytes) for h in hashes],
                                     parent)
        except AgentError:
            self.errors += 1
            return 0

    def lookup(self, hashes: Sequence[int]) -> tuple[int, str]:
        """How many leading blocks the agent holds, and the tier code of each."""
        try:
            return self.client.lookup(self.layout, hashes)
        except AgentError:
            self.errors += 1
            return 0, ""

    def load(self, hashes: Sequence[int]) -> tuple[int, float]:
        """Load the leading run of blocks; (blocks loaded, modelled seconds the transfer takes)."""
        count, where = self.lookup(hashes)
        if count == 0:
            return 0, 0.0
        try:
            payloads = self.client.load(self.layout, hashes[:count], self.payload_bytes)
        except AgentError:
            self.errors += 1
            return 0, 0.0
        loaded = 0
        for block_hash, payload in zip(hashes, payloads, strict=False):
            if payload != stand_in(block_hash, self.payload_bytes):
                break
            loaded += 1
        return loaded, transfer_seconds(where[:loaded], self.block_bytes, self.links)

    def close(self) -> None:
        self.client.close()
