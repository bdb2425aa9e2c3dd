"""A simulated replica's KV connector to a real tier agent (`kvgate agent`) beside it, as the kvgate vLLM connector
(agent/vllm_connector.py) behaves: the scheduler asks the agent for the blocks after its own prefix-cache hit and
loads them synchronously; every block that becomes fully computed is handed to the agent after its step. Block
bytes are stand-ins (bench/sim/offload.py); the time a transfer would take on real hardware is modelled per tier and
charged to the engine step, which is synchronous in the connector.

The scheduler side (lookups, loads) runs on the engine's event loop, as vLLM's scheduler calls its connector
inline; saves run on a thread of their own while the step's modelled time passes, each side with its own
connection, as vLLM's scheduler and worker processes each have theirs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from bench.sim.offload import DEFAULT_LINKS, AgentOffload, TierLink
from kvcore.vllm_hash import Digest, event_hash


@dataclass(frozen=True)
class AgentLinkConfig:
    """`kvgate sim --agent-*`: where the agent is, which blocks are interchangeable, what transfers cost."""

    socket_path: str
    layout: str                  # blocks are shared only between replicas with the same layout text
    block_bytes: int             # real KV bytes of one block (drives the modelled transfer times)
    payload_bytes: int = 64      # stand-in bytes stored per block (agent capacities count these)
    links: dict[str, TierLink] = field(default_factory=lambda: dict(DEFAULT_LINKS))
    timeout_s: float = 0.5       # one agent call; a hung agent costs this once per retry_s
    retry_s: float = 1.0         # after an agent failure, run without it for this long
    probe_ms: int = 0            # let a lookup wait this long for the shared tier (the connector's probe_ms)

    @property
    def layout_id(self) -> int:
        return int.from_bytes(hashlib.sha256(self.layout.encode()).digest()[:8], "big")


class AgentConnector:
    """The engine's `KvConnector` (bench/sim/scheduler.py) over a real agent; never fails a request: an agent
    that is down or answers wrong is "nothing there", and the engine recomputes."""

    def __init__(self, config: AgentLinkConfig) -> None:
        self.config = config

        def handle(probe_ms: int) -> AgentOffload:
            return AgentOffload(config.socket_path, config.layout_id, config.block_bytes, config.payload_bytes,
                                config.links, timeout_s=config.timeout_s, probe_ms=probe_ms,
                                retry_s=config.retry_s)

        self.scheduler_side = handle(config.probe_ms)
        self.worker_side = handle(0)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="sim-agent-save")
        save_link = config.links["C"]  # device -> host copy of newly computed blocks, synchronous in the connector
        self._save_latency_s = save_link.latency_s
        self._save_s_per_block = config.block_bytes / save_link.bytes_per_s
        self.saved_blocks = 0

    def lookup(self, block_hashes: Sequence[Digest], start: int, end: int) -> tuple[int, str]:
        return self.scheduler_side.lookup([event_hash(h) for h in block_hashes[start:end]])

    def load(self, block_hashes: Sequence[Digest], start: int, where: str) -> tuple[int, float]:
        hashes = [event_hash(h) for h in block_hashes[start:start + len(where)]]
        return self.scheduler_side.fetch(hashes, where)

    def save_seconds(self, blocks: int) -> float:
        """Model seconds a step spends copying `blocks` newly computed blocks out to the agent."""
        return self._save_latency_s + blocks * self._save_s_per_block if blocks else 0.0

    def save(self, chains: Sequence[tuple[Sequence[Digest], Digest | None]]) -> None:
        """Hand chains of computed blocks to the agent (on the executor thread)."""
        for hashes, parent in chains:
            self.saved_blocks += self.worker_side.offload([event_hash(h) for h in hashes],
                                                          event_hash(parent) if parent is not None else None)

    @property
    def errors(self) -> int:
        return self.scheduler_side.errors + self.worker_side.errors

    def close(self) -> None:
        self.executor.shutdown(wait=True)
        self.scheduler_side.close()
        self.worker_side.close()
