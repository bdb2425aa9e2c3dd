"""A vLLM KV connector that keeps a replica's KV blocks in the local kvgate tier agent.

Load it with
  --kv-transfer-config '{"kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector",
                         "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                         "kv_connector_extra_config": {"agent_socket": "/tmp/kvgate-agent.sock"}}'
(kvgate must be importable by vLLM's Python, e.g. PYTHONPATH=<kvgate checkout>).

Scheduler side: for a new request, ask the agent how many of its leading full blocks (vLLM's own block hashes, in
KV-event form) beyond the local prefix-cache hit it holds; plan those as a load, and plan every block that becomes
fully computed as a save. Worker side (agent/block_mover.py): the agent's shared memory is mapped when the caches
are registered, before the first step. By default transfers are asynchronous (vLLM's contract, `"async_transfers":
true`): the step only queues them to the worker's transfer thread (agent/transfers.py), so no step waits for the
agent; a load is answered `(tokens, True)`, vLLM parks the request in WAITING_FOR_REMOTE_KVS and schedules it once
every worker named it in `get_finished`; a finished request whose saves may still be running is held
(`request_finished` -> True) until the workers name it in finished_sending; a preempted request's saves are done
before its blocks are reused (`handle_preemptions`). With `"async_transfers": false`, `start_load_kv` copies
planned blocks in before the forward pass and `wait_for_save` copies newly computed blocks out after it. A block
the agent cannot supply whole and verified -- for whatever reason, the agent gone included -- is reported through
`get_block_ids_with_load_errors` (asynchronously: no later than the pass that names its request finished), so vLLM
recomputes it (with kv_load_failure_policy=recompute): never wrong KV, never an exception into the engine. An
asynchronous load never feeds a forward pass before it is known complete on every worker; with synchronous loads, a
step in which any load failed (on any TP rank) saves nothing: any request of the step may have attended to the
failed block. Blocks are kept under a layout id (agent/layout_key.py) that names every setting that changes what
their bytes mean, the worker's TP and PP rank included.

Tensors are handled generically (block dimension found from the cache's block count; index_select /
index_copy_ per layer), so the same code serves CPU caches `[num_blocks, kv_heads, block_size, 2*head_dim]` and
GPU caches such as `[2, num_blocks, block_size, kv_heads, head_dim]` (for GPU, a batch goes through one contiguous
device staging buffer and one copy to the shared memory, which is registered as pinned host memory so that copy is
one DMA, and unregistered before it is unmapped: agent/kv_layout.py, agent/host_pinning.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from agent.block_mover import BlockMover, Failure, LoadResult, SavedChain
from agent.breaker import AgentCircuit
from agent.client import AgentClient
from agent.cpu_tiles import request_amx_tiles
from agent.kv_layout import STAGING_BYTES, describe_layers
from agent.layout_key import KvLayout
from agent.lookups import LookupTooSlow, SchedulerLookups
from agent.presence import PresenceReader, presence_path
from agent.protocol import AgentError
from agent.transfers import LoadJob, SaveJob, TransferThread

if TYPE_CHECKING:
    from prometheus_client import Counter
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvgate_connector")  # under "vllm" so vLLM's log handler prints it

_MASK64 = (1 << 64) - 1
_WHERE_SOURCE = {"C": CacheHitSource.HOST, "D": CacheHitSource.DISK, "S": CacheHitSource.EXTERNAL_UNSPECIFIED}


def event_hash(block_hash: bytes) -> int:
    """vLLM's block hash in the form its KV events carry (low 8 bytes, big-endian), so agent keys match them."""
    return int.from_bytes(block_hash, "big") & _MASK64


def layout_id(vllm_config: VllmConfig, extra: dict[str, Any], tp_rank: int, pp_rank: int = 0) -> int:
    """Blocks are only interchangeable between workers whose `KvLayout` is equal (agent/layout_key.py)."""
    override = str(extra["layout"]) if "layout" in extra else None
    return KvLayout.from_vllm(vllm_config, tp_rank, pp_rank, override).id()


def _hello(socket_path: str, timeout_s: float) -> None:
    """Connect to the agent and exchange Hello (raises AgentError unless it answers): the circuit's probe."""
    with AgentClient(socket_path, shm_bytes=0, timeout_s=timeout_s, name=f"vllm-probe-{os.getpid()}"):
        pass


@dataclass
class BlockTransfer:
    req_id: str
    block_ids: list[int]
    hashes: list[int]
    parent: int | None = None


@dataclass
class KvgateConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[BlockTransfer] = field(default_factory=list)
    saves: list[BlockTransfer] = field(default_factory=list)
    # asynchronous transfers only: finished requests whose blocks vLLM keeps until their saves are done (the
    # workers name them in finished_sending), and preempted requests whose saves must be done before the step
    held: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)


FAILURE_KINDS = ("lookup", "load", "save")


@dataclass
class KvgateConnectorStats(KVConnectorStats):  # type: ignore[misc]
    """The connector's failures since its last report, by kind and reason: `{"load": {"bad_reply": 2}, ...}`.
    Lookups fail in the scheduler process, loads and saves in the workers; vLLM adds the two up."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, dict[str, int]] = {kind: {} for kind in FAILURE_KINDS}

    def is_empty(self) -> bool:
        return not any(self.data.get(kind) for kind in FAILURE_KINDS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for kind, reasons in other.data.items():
            mine = self.data.setdefault(kind, {})
            for reason, n in reasons.items():
                mine[reason] = mine.get(reason, 0) + n
        return self

    def reduce(self) -> dict[str, int | float]:
        return {f"{kind}_failures_{reason}": n for kind, reasons in sorted(self.data.items())
                for reason, n in sorted(reasons.items())}

    def count(self, kind: str, reason: str, n: int = 1) -> None:
        reasons = self.data.setdefault(kind, {})
        reasons[reason] = reasons.get(reason, 0) + n


class KvgateConnectorPromMetrics(KVConnectorPromMetrics):  # type: ignore[misc]
    """`vllm:kvgate_connector_failures_total{kind, reason}` on vLLM's /metrics: lookups, loads and saves that
    went wrong (a failed load is recomputed, a failed save dropped, a failed lookup answers 0)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._failures = self._counter_cls(
            name="vllm:kvgate_connector_failures_total",
            documentation="kvgate connector lookups, loads and saves that failed, by kind and reason.",
            labelnames=[*labelnames, "kind", "reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for kind, reasons in (transfer_stats_data or {}).items():
            for reason, n in reasons.items():
                counter: Counter = self._failures.labels(*labels, kind, reason)
                counter.inc(n)


class KvgateConnector(KVConnectorBase_V1):  # type: ignore[misc]
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra: dict[str, Any] = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block_size: int = vllm_config.cache_config.block_size
        self._probe_ms = int(extra.get("probe_ms", 0))
        socket_path = str(extra.get("agent_socket", os.environ.get("KVGATE_AGENT_SOCKET_PATH",
                                                                    "/tmp/kvgate-agent.sock")))
        timeout = float(extra.get("timeout_s", 5.0))
        tp_rank = pp_rank = 0  # the scheduler asks about the first worker's blocks
        self._tp_group: Any = None  # torch.distributed group of the TP ranks, when there are several
        if role == KVConnectorRole.WORKER:
            try:
                from vllm.distributed.parallel_state import get_pp_group, get_tp_group

                tp_rank, pp_rank = get_tp_group().rank_in_group, get_pp_group().rank_in_group
                if get_tp_group().world_size > 1:
                    self._tp_group = get_tp_group().cpu_group
            except Exception:  # not initialised (single process): rank 0
                tp_rank = pp_rank = 0
        self._layout = layout_id(vllm_config, extra, tp_rank, pp_rank)
        self._async = bool(extra.get("async_transfers", True))
        self._transfer_cores = str(extra.get("transfer_cores", "worker"))
        self._timeout_s = timeout
        self._staging_bytes = int(extra.get("staging_bytes", STAGING_BYTES))
        shm_bytes = int(extra.get("shm_bytes", 256 * 2**20)) if role == KVConnectorRole.WORKER else 0
        self._circuit = AgentCircuit(functools.partial(_hello, socket_path, timeout),
                                     float(extra.get("probe_interval_s", 1.0)), f"tier agent at {socket_path}")
        self._client = AgentClient(socket_path, shm_bytes=shm_bytes, timeout_s=timeout,
                                   name=f"vllm-{role.name.lower()}-{os.getpid()}", circuit=self._circuit)
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            log.warning("kvgate connector: kv_load_failure_policy is %r, not 'recompute': EVERY REQUEST WHOSE KV "
                        "THE TIER AGENT CANNOT DELIVER FAILS (agent restarted or down, a block evicted or corrupt); "
                        "set \"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config", policy)
        self._last_agent_error = 0.0
        # the agent's bitmap of the blocks it may hold: a lookup of a block it never held needs no round trip
        self._presence = (PresenceReader(presence_path(socket_path)) if role == KVConnectorRole.SCHEDULER
                          and bool(extra.get("presence", False)) else None)
        # the scheduler's lookups run in a thread of their own, so that no step waits for the agent longer than
        # lookup_wait_ms (all of that step's lookups together; vLLM asks again for a request not answered yet)
        self._lookup_thread = SchedulerLookups(
            functools.partial(self._lookup, probe_ms=self._probe_ms),
            wait_s=float(extra.get("lookup_wait_ms", 1.0)) / 1000,
            give_up_s=float(extra.get("lookup_give_up_ms", 1000.0)) / 1000)
        # scheduler side
        self._lookups: dict[str, tuple[int, str]] = {}  # req_id -> (first block index asked, where string)
        self._pending_loads: dict[str, BlockTransfer] = {}
        self._saved_upto: dict[str, int] = {}  # req_id -> leading blocks already held by the agent
        self._requests: dict[str, Request] = {}
        self._loading: dict[str, set[int]] = {}  # async loads not yet reported finished: their block ids
        self._loaded: dict[str, tuple[int, list[int]]] = {}  # req_id -> (first block index, block ids) of its load
        self._load_failed: set[str] = set()  # requests whose async load failed: computed, never offered again
        self._saving: set[str] = set()  # requests with saves planned since their admission (async)
        self._held: list[str] = []  # finished requests whose blocks wait for their saves (async), for the next meta
        # worker side
        self._mover: BlockMover | None = None
        self._transfers: TransferThread | None = None
        self._held_here: set[str] = set()  # requests whose finish vLLM delays for our saves (async)
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()
        self._recved_now: set[str] = set()  # async loads failed before they were queued
        self._stats = KvgateConnectorStats()  # failures not yet reported to vLLM
        log.info("kvgate connector (%s): agent %s, layout %016x, %s transfers", role.name, socket_path, self._layout,
                 "asynchronous" if self._async else "synchronous")

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache (a dropped save is a later miss): a preempted request need not be recomputed for
        our sake; with asynchronous transfers its saves are done before its blocks are reused (handle_preemptions).
        """
        return False if self._async else bool(super().requires_kv_delivery)

    def _agent_failed(self, what: str, exc: Exception) -> None:
        reason = ("slow" if isinstance(exc, LookupTooSlow) else "agent_unavailable" if isinstance(exc, AgentError)
                  else "error")
        self._stats.count(what, reason)
        now = time.monotonic()
        if now - self._last_agent_error > 10:
            log.warning("kvgate agent unavailable during %s (continuing without it): %s", what, exc)
            self._last_agent_error = now

    # ==========================================================================================================
    # scheduler side
    # ==========================================================================================================

    def _lookup(self, hashes: Sequence[int], probe_ms: int) -> tuple[int, str]:
        """One lookup, in the lookup thread (the only user of the scheduler's client)."""
        return self._client.lookup(self._layout, hashes, probe_ms=probe_ms)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        start = num_computed_tokens // self._block_size
        # at least the last prompt token must be computed by the engine
        loadable = min(len(request.block_hashes), (request.num_tokens - 1) // self._block_size)
        self._lookups[request.request_id] = (start, "")
        if (start >= loadable or request.request_id in self._load_failed
                or getattr(request, "skip_reading_prefix_cache", False)):
            # (after a failed asynchronous load vLLM asks again: answering the same blocks would fail again, forever)
            self._lookup_thread.forget(request.request_id)
            return 0, False
        if self._circuit.is_open:  # the agent is not answering: no lookup, no wait (vLLM computes)
            self._lookup_thread.forget(request.request_id)
            self._agent_failed("lookup", AgentError(f"{self._circuit.name} did not answer: not asked until it does"))
            return 0, False
        first = event_hash(request.block_hashes[start])
        if self._presence is not None and not self._presence.may_hold(self._layout, first):
            # the agent never held the first block asked (agent/presence.py): nothing to load, no round trip
            self._lookup_thread.forget(request.request_id)
            return 0, False
        hashes = [first, *(event_hash(h) for h in request.block_hashes[start + 1:loadable])]
        try:
            answer = self._lookup_thread.answer(request.request_id, (start, loadable - start), hashes)
        except Exception as exc:  # AgentError, LookupTooSlow, anything: the agent's trouble never stops the engine
            self._agent_failed("lookup", exc)
            return 0, False
        if answer is None:  # asked, not answered yet: vLLM skips the request this step and asks again
            return None, False
        count, where = answer
        self._lookups[request.request_id] = (start, where[:count])
        log.debug("kvgate lookup %s: %d local, %d of %d asked held by the agent (%s)", request.request_id, start,
                  count, len(hashes), where[:count])
        return count * self._block_size, self._async and count > 0

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        if num_external_tokens == 0:
            return {}
        _start, where = self._lookups.get(request.request_id, (0, ""))
        counts: dict[Any, int] = {}
        for code in where[: num_external_tokens // self._block_size]:
            source = _WHERE_SOURCE.get(code, CacheHitSource.EXTERNAL_UNSPECIFIED)
            counts[source] = counts.get(source, 0) + self._block_size
        if sum(counts.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return counts

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        req_id = request.request_id
        self._requests[req_id] = request
        start, _where = self._lookups.get(req_id, (0, ""))
        count = num_external_tokens // self._block_size
        self._saved_upto.setdefault(req_id, start + count)
        if count <= 0:
            return
        block_ids = blocks.get_block_ids()[0][start: start + count]
        hashes = [event_hash(h) for h in request.block_hashes[start: start + count]]
        self._pending_loads[req_id] = BlockTransfer(req_id, list(block_ids), hashes)
        self._loaded[req_id] = (start, list(block_ids))
        self._saved_upto[req_id] = start + count
        if self._async:
            self._loading[req_id] = set(block_ids)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        self._lookup_thread.next_step()
        meta = KvgateConnectorMetadata(loads=list(self._pending_loads.values()), held=self._held)
        self._pending_loads.clear()
        self._held = []
        if self._async:
            # the blocks of a preempted request are free again: the workers finish its saves before this step
            # (held too: preempted by a prefix-cache reset, then aborted before this step was scheduled)
            preempted = scheduler_output.preempted_req_ids or set()
            meta.preempted = sorted((self._saving | set(meta.held)) & preempted)
            self._saving -= preempted
        scheduled = scheduler_output.num_scheduled_tokens
        for new_req in scheduler_output.scheduled_new_reqs:
            computed = new_req.num_computed_tokens
            if self._async and new_req.req_id in self._saved_upto:
                # after a failed asynchronous load the request computes from its last good block: save from there
                self._saved_upto[new_req.req_id] = min(self._saved_upto[new_req.req_id], computed // self._block_size)
            self._plan_save(meta, new_req.req_id, computed + scheduled.get(new_req.req_id, 0),
                            list(new_req.block_ids[0]))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if self._kv_cache_manager is None:
                break
            computed = cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
            self._plan_save(meta, req_id, computed, None)
        return meta

    def _plan_save(self, meta: KvgateConnectorMetadata, req_id: str, computed_after_step: int,
                   block_ids: list[int] | None) -> None:
        """`block_ids` None: a running request's, asked of the cache manager only in a step that fills one of its
        blocks (most decode steps fill none)."""
        request = self._requests.get(req_id)
        if request is None:
            return
        first = self._saved_upto.get(req_id, 0)
        full = min(computed_after_step // self._block_size, len(request.block_hashes))
        if full <= first:
            return
        if block_ids is None:
            assert self._kv_cache_manager is not None
            block_ids = list(self._kv_cache_manager.get_block_ids(req_id)[0])
        full = min(full, len(block_ids))
        if full <= first:
            return
        hashes = [event_hash(h) for h in request.block_hashes[first:full]]
        parent = event_hash(request.block_hashes[first - 1]) if first > 0 else None
        meta.saves.append(BlockTransfer(req_id, block_ids[first:full], hashes, parent))
        self._saved_upto[req_id] = full
        if self._async:
            self._saving.add(req_id)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids or set()
        if invalid:  # (a worker may report its failed blocks before every worker has finished the load)
            self._load_failed.update(r for r, blocks in self._loading.items() if blocks & invalid)
            for req_id, (start, block_ids) in self._loaded.items():
                failed = next((i for i, b in enumerate(block_ids) if b in invalid), None)
                if failed is not None and req_id in self._saved_upto:
                    # vLLM computes the request again from its first failed block: save from there, since the
                    # agent lacks that block for at least one worker (with tensor parallelism, the scheduler's
                    # lookup saw the first rank's copy; a rank whose copy is gone fails the same load forever
                    # unless its recomputed blocks are saved)
                    self._saved_upto[req_id] = min(self._saved_upto[req_id], start + failed)
        for req_id in connector_output.finished_recving or ():
            self._loading.pop(req_id, None)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """With asynchronous saves planned for the request, vLLM keeps its blocks until the workers name it in
        finished_sending (a request aborted during its load is held by vLLM itself until the load is done)."""
        req_id = request.request_id
        self._lookup_thread.forget(req_id)
        self._lookups.pop(req_id, None)
        self._pending_loads.pop(req_id, None)
        self._saved_upto.pop(req_id, None)
        self._loaded.pop(req_id, None)
        self._requests.pop(req_id, None)
        saving = req_id in self._saving
        self._saving.discard(req_id)
        self._load_failed.discard(req_id)
        if saving and req_id not in self._loading:
            self._held.append(req_id)
            return True, None
        self._loading.pop(req_id, None)
        return False, None

    # ==========================================================================================================
    # worker side
    # ==========================================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Describe the caches and map the agent's shared memory now, before the engine's first step."""
        if any(cache.device.type == "cpu" for cache in kv_caches.values()):
            request_amx_tiles()  # the first forward pass may be one token after a load: see agent/cpu_tiles.py
        try:
            layers = describe_layers(kv_caches, self._kv_cache_config.num_blocks)
        except ValueError:
            log.exception("kvgate connector: unknown KV cache layout; running without the tier agent")
            return
        self._mover = BlockMover(self._client, self._layout, layers, staging_bytes=self._staging_bytes)
        attached = self._mover.attach()
        if self._async:
            # from now on the only user of the mover and the client
            self._transfers = TransferThread(self._mover, self._transfer_cores)
        log.info("kvgate connector: %d layers, %d bytes per block, shared memory %s, staging %s", len(layers),
                 self._mover.block_bytes, "mapped" if attached else "not mapped yet (no agent)",
                 "on the device" if self._mover.copier.staged else "straight into shared memory")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step reuses a preempted request's blocks, its saves must have read them."""
        if self._transfers is None or not isinstance(kv_connector_metadata, KvgateConnectorMetadata):
            return
        preempted = kv_connector_metadata.preempted
        # a save waits at most a timeout for the agent, twice (the retry); then the circuit answers at once
        if preempted and not self._transfers.wait_for_saves(preempted, 2 * self._timeout_s + 5):
            log.error("kvgate connector: saves of preempted requests %s did not finish in time; the ones not "
                          "started are dropped", kv_connector_metadata.preempted)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvgateConnectorMetadata)
        if self._async:
            self._held_here.update(meta.held)
            if meta.loads:
                if self._transfers is None:
                    self._fail_loads(meta.loads, LoadResult(0, Failure.NO_SHARED_MEMORY))
                    return
                ready = self._transfers.ready_event()  # after any zeroing of the blocks queued before
                for transfer in meta.loads:
                    self._transfers.load(LoadJob(transfer.req_id, transfer.hashes, transfer.block_ids, ready))
            return
        self._failed_loads.clear()
        for transfer in meta.loads:
            if self._mover is None:
                result = LoadResult(0, Failure.NO_SHARED_MEMORY)
            else:
                result = self._mover.load(transfer.hashes, transfer.block_ids)
            self._note_load(transfer.req_id, transfer.block_ids, result)

    def _note_load(self, req_id: str, block_ids: Sequence[int], result: LoadResult) -> None:
        if result.loaded < len(block_ids):
            log.warning("kvgate connector: %d of %d blocks of %s could not be loaded (%s); vLLM recomputes them",
                        len(block_ids) - result.loaded, len(block_ids), req_id, result.failure)
            self._load_errors.update(block_ids[result.loaded:])
            self._failed_loads.add(req_id)

    def _fail_loads(self, loads: list[BlockTransfer], result: LoadResult) -> None:
        """Asynchronous loads that cannot even be queued: finished at once, every block an error."""
        for transfer in loads:
            self._note_load(transfer.req_id, transfer.block_ids, result)
            self._recved_now.add(transfer.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish inside start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # all layers of a block are saved together in wait_for_save, once the forward pass is done

    def wait_for_save(self) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvgateConnectorMetadata)
        if self._async:
            # An asynchronous load never feeds a forward pass before it is complete (vLLM schedules the request
            # only once every worker named it in finished_recving, with the failed blocks truncated), so a failed
            # one cannot have reached this step's KV: nothing here waits for another rank or stage.
            if meta.saves and self._transfers is not None:
                ready = self._transfers.ready_event()  # after the forward pass that computed the blocks
                self._transfers.save([SaveJob(t.req_id, t.hashes, t.block_ids, t.parent, ready) for t in meta.saves])
            return
        if meta.loads and self._load_failed_on_any_rank():
            # A block that failed to load went through this step's forward pass as garbage, on this rank or
            # another: any request of the step may have attended to it (a shared prefix block), and every TP
            # rank's output mixes every rank's. Keep no KV of this step (the failed blocks are recomputed).
            if meta.saves:
                self._stats.count("save", "after_failed_load", len(meta.saves))
            return
        if self._mover is not None and meta.saves:
            self._mover.save_chains([SavedChain(t.hashes, t.block_ids, t.parent) for t in meta.saves])

    def _load_failed_on_any_rank(self) -> bool:
        """Whether a load of this step failed on any TP rank. Every rank has the same metadata, so every rank
        with loads in the step makes this call: the all-reduce cannot wait for a rank that skips it."""
        failed = bool(self._failed_loads)
        if self._tp_group is None:
            return failed
        flag = torch.tensor([int(failed)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._tp_group)
        return bool(flag.item())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """(held requests whose saves are all done, requests whose asynchronous load is done). A failed load's
        blocks are in `get_block_ids_with_load_errors` of this same pass, as vLLM's contract asks."""
        if not self._async:
            return None, None
        recved, self._recved_now = self._recved_now, set()
        if self._transfers is not None:
            for job, result in self._transfers.finished_loads():
                self._note_load(job.req_id, job.block_ids, result)
                recved.add(job.req_id)
            sent = {r for r in self._held_here if not self._transfers.saves_in_flight(r)}
        else:
            sent = set(self._held_here)
        self._held_here -= sent
        return sent or None, recved or None

    # ==========================================================================================================
    # failures, counted for vLLM's stats logger and /metrics
    # ==========================================================================================================

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._transfers is not None:
            loads, saves = self._transfers.take_failures()
            for kind, counts in (("load", loads), ("save", saves)):
                for reason, n in counts.items():
                    self._stats.count(kind, str(reason), n)
        elif self._mover is not None:
            for kind, counts in (("load", self._mover.load_failures), ("save", self._mover.save_failures)):
                for reason, n in counts.items():
                    self._stats.count(kind, str(reason), n)
                counts.clear()
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, KvgateConnectorStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        # a copy: vLLM's stats loggers aggregate into what they are given
        return KvgateConnectorStats(data={kind: dict(reasons) for kind, reasons in (data or {}).items()})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[Any, Any], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return KvgateConnectorPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._circuit.close()
        if self._presence is not None:
            self._presence.close()
        self._lookup_thread.close()
        if self._transfers is not None:
            self._transfers.close()
        if self._mover is not None:
            self._mover.close()
        self._client.close()
