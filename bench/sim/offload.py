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

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from agent.client import AgentClient
from agent.protocol import AgentError, AgentRefused

T = TypeVar("T")


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


def parse_link(text: str) -> tuple[str, TierLink]:
    """`C=25:20` -> ("C", 25 GB/s, 20 us): a tier code, its bandwidth in GB/s and its latency in microseconds."""
    try:
        code, rest = text.split("=", 1)
        gbps, latency_us = rest.split(":", 1)
        link = TierLink(float(gbps) * 1e9, float(latency_us) * 1e-6)
    except ValueError as exc:
        raise ValueError(f"tier link {text!r}: expected CODE=GBPS:LATENCY_US, e.g. C=25:20") from exc
    if code not in DEFAULT_LINKS or link.bytes_per_s <= 0 or link.latency_s < 0:
        raise ValueError(f"tier link {text!r}: code must be one of {''.join(DEFAULT_LINKS)}, bandwidth > 0")
    return code, link


def stand_in(block_hash: int, size: int) -> bytes:
    """A payload that names its block: a wrong block loaded back is noticed."""
    seed = block_hash.to_bytes(8, "big")
    return (seed * (size // 8 + 1))[:size]


class AgentOffload:
    """A simulated replica's handle on its tier agent. Every method degrades to "nothing there" when the
    agent is unreachable, as the vLLM connector does: a call whose connection the agent cut (it restarted) is
    made once more on a fresh connection, as the connector's `BlockMover` does; one that still fails, or that the
    agent did not answer in time, leaves the agent alone for `retry_s` (so an agent that hangs costs one timeout
    per `retry_s`, not one per call)."""

    def __init__(self, socket_path: str, layout: int, block_bytes: int, payload_bytes: int = 64,
                 links: dict[str, TierLink] | None = None, timeout_s: float = 2.0, probe_ms: int = 0,
                 retry_s: float = 0.0) -> None:
        self.layout = layout
        self.block_bytes = block_bytes  # real KV bytes of one block: drives the modelled transfer time
        self.payload_bytes = payload_bytes
        self.links = links or DEFAULT_LINKS
        self.client = AgentClient(socket_path, shm_bytes=0, timeout_s=timeout_s, name="sim")
        self.probe_ms = probe_ms
        self.retry_s = retry_s
        self.errors = 0
        self._skip_until = 0.0

    def _failed(self) -> None:
        self.errors += 1
        if self.retry_s > 0:
            self._skip_until = time.monotonic() + self.retry_s

    def _skipping(self) -> bool:
        return self._skip_until > 0.0 and time.monotonic() < self._skip_until

    def _call(self, call: Callable[[], T]) -> T:
        """`call`, a second time on a fresh connection if the agent cut the first (a restart: without this the
        replica ran `retry_s` without its agent after every restart, `kvgate bench compare`'s reset of the tiers
        before each target included, and saved none of the blocks it computed meanwhile). Not after a timeout
        (a hung agent would cost two) or a refusal (the agent answered)."""
        try:
            return call()
        except AgentRefused:
            raise
        except AgentError as exc:
            if isinstance(exc.__cause__, TimeoutError):
                raise
        return call()

    def offload(self, hashes: Sequence[int], parent: int | None = None) -> int:
        """Hand blocks to the agent (a chain: block i's parent is block i-1, block 0's is `parent`)."""
        if self._skipping():
            return 0
        try:
            payloads = [stand_in(h, self.payload_bytes) for h in hashes]
            return self._call(lambda: self.client.store(self.layout, hashes, payloads, parent))
        except AgentError:
            self._failed()
            return 0

    def lookup(self, hashes: Sequence[int]) -> tuple[int, str]:
        """How many leading blocks the agent holds, and the tier code of each."""
        if self._skipping():
            return 0, ""
        try:
            count, where = self.client.lookup(self.layout, hashes, probe_ms=self.probe_ms)  # retried by the client
            return count, where[:count]
        except AgentError:
            self._failed()
            return 0, ""

    def load(self, hashes: Sequence[int]) -> tuple[int, float]:
        """Load the leading run of blocks; (blocks loaded, modelled seconds the transfer takes)."""
        count, where = self.lookup(hashes)
        return self.fetch(hashes[:count], where)

    def fetch(self, hashes: Sequence[int], where: str) -> tuple[int, float]:
        """Load blocks a lookup found (`where`: its tier codes); (leading blocks that arrived whole and
        right, modelled seconds their transfer takes). A failed load is 0 blocks: the engine recomputes."""
        if not hashes:
            return 0, 0.0
        if self._skipping():
            return 0, 0.0
        try:
            payloads = self._call(lambda: self.client.load(self.layout, hashes, self.payload_bytes))
        except AgentError:
            self._failed()
            return 0, 0.0
        loaded = 0
        for block_hash, payload in zip(hashes, payloads, strict=False):
            if payload != stand_in(block_hash, self.payload_bytes):
                break
            loaded += 1
        return loaded, transfer_seconds(where[:loaded], self.block_bytes, self.links)

    def close(self) -> None:
        self.client.close()
