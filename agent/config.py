"""Typed configuration of the tier agent (`kvgate agent`), built like the gateway's: file < env < flags.

Environment variables use the prefix `KVGATE_AGENT_` (e.g. `KVGATE_AGENT_DRAM_CAPACITY=8GiB`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from agent.tiers.base import TierName
from kvcore.config import ConfigError, option

ENV_PREFIX = "KVGATE_AGENT_"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """`4096`, `512MiB`, `4 GiB`, `1.5GB` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a byte size: {text!r} (examples: 4096, 512MiB, 4GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


WRITE_POLICIES = ("lazy", "eager")
SHARED_BACKENDS = ("none", "redis", "fs")
NVME_LAYOUTS = ("segments", "files")


@dataclass(frozen=True)
class AgentConfig:
    """Everything `kvgate agent` can be told."""

    socket_path: str = option("/tmp/kvgate-agent.sock", "Unix socket of the local block API (connector, simulator)")
    socket_mode: str = option("660", "permissions of the socket file (octal): who may use the agent")
    metrics_host: str = option("127.0.0.1", "address of the Prometheus /metrics HTTP endpoint")
    metrics_port: int = option(9400, "port of the /metrics HTTP endpoint (0 = disabled)")
    client_write_timeout_s: float = option(10.0, "a client connection that takes none of an answer's bytes for "
                                           "this long is dropped (a client that sends and never reads would "
                                           "otherwise keep its unsent answer, up to 128 MiB, for good)")
    client_read_timeout_s: float = option(10.0, "a client connection that sends none of a frame it began for this "
                                          "long is dropped (a client that stalls mid-frame would otherwise keep "
                                          "what it sent of it, up to 256 MiB, for good)")
    frame_budget: int = option(512 * 2**20, "bytes of big frames (over 1 MiB: inline stores) being read or "
                               "answered, over all connections, at most; a frame that would pass it is refused "
                               "with an error and its connection closed (each could otherwise hold a frame of up "
                               "to 256 MiB at once; the connector's frames are under 1 MiB)", parse=parse_bytes)
    max_clients: int = option(256, "client connections served at once, at most; one past it is answered with an "
                              "error at its Hello and closed. Each may hold about 2.3 MiB of requests the agent "
                              "has not read yet (its stream buffer), outside --frame-budget: 256 hold 600 MiB at "
                              "most (a vLLM instance connects once per worker and once from its scheduler)")
    max_connecting_clients: int = option(128, "client connections that have not sent their Hello yet, at most; when "
                                         "one more comes, the one that has waited longest is answered with an "
                                         "error and closed, and the new one accepted (connections that never send "
                                         "a Hello cannot keep new clients out). Each holds a file descriptor and "
                                         "up to 4 KiB for up to 10 s (a client sends its Hello as it connects: as "
                                         "many as the listen backlog, 128, leaves room for a whole fleet "
                                         "reconnecting at once)")
    events_endpoint: str = option("", "ZMQ PUB endpoint for KV events, e.g. tcp://*:5560 (empty = no events)")
    replay_endpoint: str = option("", "ZMQ ROUTER endpoint answering event replay requests (empty = none)")
    events_topic: str = option("kv-events", "topic frame of published KV events")
    events_interval_s: float = option(0.02, "how often pending tier events are published as one batch")
    block_size: int = option(0, "tokens per block, reported in BlockStored events (0 = unknown)")

    dram_capacity: int = option(2**30, "DRAM tier byte bound (0 = no DRAM tier); a block under a page counts "
                                "its bytes plus 512 for its bookkeeping (a page at most)", parse=parse_bytes)
    dram_high_watermark: float = option(0.95, "DRAM fill fraction above which background demotion starts")
    dram_low_watermark: float = option(0.85, "DRAM fill fraction background demotion brings usage down to")
    dram_prefault: bool = option(False, "when the first client declares its block size (Hello), fill the DRAM "
                                 "tier up to its capacity with buffers of that size whose pages are mapped, in the "
                                 "background: stores then copy into mapped memory, no page faults (the agent's "
                                 "memory is the whole capacity from then on)")

    nvme_dir: str = option("", "directory of the NVMe tier (empty = no NVMe tier)")
    nvme_layout: str = option("segments", "segments: append-only segment log (sequential writes, FIFO "
                              "eviction); files: one file per block (temp + rename, LRU eviction)")
    nvme_segment_bytes: int = option(64 * 2**20, "size of one NVMe segment file", parse=parse_bytes)
    nvme_capacity: int = option(16 * 2**30, "NVMe tier byte bound; it holds one block per KiB of it at most "
                                "(each costs the agent ~300 bytes of RAM)", parse=parse_bytes)
    nvme_high_watermark: float = option(0.95, "NVMe fill fraction (of its bytes, or of the blocks it may hold) "
                                        "above which background eviction starts")
    nvme_low_watermark: float = option(0.85, "NVMe fill fraction background eviction brings usage down to (its "
                                       "bytes and its blocks)")
    nvme_fsync: bool = option(True, "fsync each block file before it is renamed into place (power-loss safety)")
    nvme_min_free: int = option(256 * 2**20, "free bytes to keep on the NVMe filesystem", parse=parse_bytes)

    shared_backend: str = option("none", "fleet-shared tier: none, redis (Redis/Valkey) or fs (shared directory)")
    shared_url: str = option("redis://127.0.0.1:6379/0", "Redis/Valkey URL of the shared tier")
    shared_cluster: bool = option(False, "talk to the shared Redis as a Redis Cluster")
    shared_dir: str = option("", "shared POSIX directory (Lustre, Curvine FUSE, NFS) for shared_backend=fs")
    shared_prefix: str = option("kvgate", "namespace of shared block names (keys / directory level)")
    shared_ttl_s: float = option(3600.0, "lifetime of a shared block after its last write (0 = forever)")
    shared_index_blocks: int = option(2**22, "most blocks the shared tier's index remembers (each ~300 bytes of "
                                      "agent RAM); past it the soonest to expire are forgotten (misses until learned "
                                      "again)")
    shared_timeout_s: float = option(0.5, "socket timeout of one shared-tier operation")
    shared_retry_s: float = option(1.0, "after a shared-tier backend error, skip it for this long")
    shared_sweep_interval_s: float = option(60.0, "interval of the TTL sweep of the shared directory")
    shared_index_refresh_s: float = option(5.0, "interval at which other replicas' shared blocks are learned "
                                           "(shared_backend=fs; Redis announces writes as they happen)")
    shared_secret: str = option("", "fleet secret of the shared tier: blocks carry a MAC keyed with it, blocks "
                                "without a valid one are refused (empty = unauthenticated shared tier)")
    shared_secret_file: str = option("", "file holding the fleet secret (e.g. a mounted Kubernetes Secret)")

    write_policy: str = option("lazy", "lazy: demote to NVMe/shared under pressure; eager: write through")
    promote_on_hit: bool = option(True, "copy blocks loaded from NVMe/shared into DRAM")
    nvme_admit_reuse: int = option(1, "uses (stores + hits) a block needs before it is written to NVMe")
    shared_admit_reuse: int = option(1, "uses (stores + hits) a block needs before it is written to shared")
    io_threads: int = option(4, "threads doing NVMe and shared-tier I/O")
    copy_threads: int = option(4, "threads that copy large blocks (256 KiB and up) into and out of the DRAM "
                               "tier, the GIL released: one core's memcpy and page faults are 1-5 GB/s; as "
                               "many read a long run of NVMe segment records (8 MiB and up) in parts")
    log_level: str = option("info", "log level: debug, info, warning, error")

    def shared_key(self) -> bytes | None:
        """The fleet secret, from `shared_secret` or `shared_secret_file` (surrounding whitespace ignored)."""
        if self.shared_secret and self.shared_secret_file:
            raise ConfigError("set shared_secret or shared_secret_file, not both")
        if self.shared_secret_file:
            try:
                secret = Path(self.shared_secret_file).read_bytes().strip()
            except OSError as exc:
                raise ConfigError(f"cannot read shared_secret_file: {exc}") from exc
            if not secret:
                raise ConfigError(f"shared_secret_file {self.shared_secret_file} is empty")
            return secret
        return self.shared_secret.strip().encode() or None

    def validate(self) -> AgentConfig:
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError(f"write_policy must be one of {WRITE_POLICIES}: {self.write_policy!r}")
        if self.shared_backend not in SHARED_BACKENDS:
            raise ConfigError(f"shared_backend must be one of {SHARED_BACKENDS}: {self.shared_backend!r}")
        if self.nvme_layout not in NVME_LAYOUTS:
            raise ConfigError(f"nvme_layout must be one of {NVME_LAYOUTS}: {self.nvme_layout!r}")
        if self.shared_backend == "fs" and not self.shared_dir:
            raise ConfigError("shared_backend=fs needs shared_dir")
        self.shared_key()
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            mode = -1
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"socket_mode must be octal permissions such as 660: {self.socket_mode!r}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be 0 to 65535: {self.metrics_port}")
        # an interval of 0 ran its task in a loop that never waited (a core at 100%), NaN never compared true (a
        # NaN retry kept the shared tier down for good), a timeout of 0 made redis-py's sockets non-blocking (the
        # shared tier never connected)
        for name in ("client_write_timeout_s", "client_read_timeout_s", "events_interval_s", "shared_timeout_s",
                     "shared_sweep_interval_s", "shared_index_refresh_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number of seconds: {value}")
        if self.shared_index_blocks < 1:
            raise ConfigError(f"shared_index_blocks must be at least 1: {self.shared_index_blocks}")
        for name in ("max_clients", "max_connecting_clients"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1: {getattr(self, name)}")
        if self.frame_budget < 2**20:  # (below one big frame: every inline store over 1 MiB refused)
            raise ConfigError(f"frame_budget must be at least 1MiB: {self.frame_budget}")
        for name in ("shared_ttl_s", "shared_retry_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"{name} must be 0 or a positive number of seconds: {value}")
        for low, high, name in ((self.dram_low_watermark, self.dram_high_watermark, TierName.DRAM),
                                (self.nvme_low_watermark, self.nvme_high_watermark, TierName.NVME)):
            if not 0.0 < low <= high <= 1.0:
                raise ConfigError(f"{name} watermarks need 0 < low <= high <= 1 (got {low}, {high})")
        return self
