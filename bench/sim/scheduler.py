"""The simulated engine's scheduler: vLLM v1's policy (FCFS, chunked prefill, recompute preemption).

Each `schedule()` fills one step's token budget (`max_num_batched_tokens`): running requests first (one decode
token each, or the next chunk of their prefill), preempting the newest running request when a block cannot be
allocated; then waiting requests in arrival order while `max_num_seqs` allows, starting from their longest cached
prefix. `update_from_output()` applies the step: a request whose prompt is fully computed gets one output token
per step, and finished requests free their blocks.
"""

from __future__ import annotations

import contextlib
import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.sim.kv_cache import ExternalCacheStats, KvBlock, KvCacheManager
from kvcore.vllm_hash import BlockHasher, Digest

# the agent's lookup codes as vLLM's CacheHitSource values (as agent/vllm_connector.py reports them)
_CACHE_HIT_SOURCE = {"C": "host", "D": "disk", "S": "external_unspecified"}



class KvConnector(Protocol):
    """What the scheduler asks of a KV connector (vLLM's scheduler-side `KVConnectorBase_V1`): how many leading
    blocks beyond the local hit it can supply, and to load them once the request has its blocks."""

    def lookup(self, block_hashes: Sequence[Digest], start: int, end: int) -> tuple[int, str]:
        """Leading blocks of block_hashes[start:end] the connector holds, and a tier code per block."""
        ...

    def load(self, block_hashes: Sequence[Digest], start: int, where: str) -> tuple[int, float]:
        """Load the blocks a lookup found (`where`: their tier codes); (blocks that arrived, model seconds)."""
        ...


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class SimRequest:
    """One sequence in the engine: its tokens, how many are computed, its block hashes, its progress."""

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "eos_token_id",
        "finish_reason",
        "finished",
        "first_block_extra",
        "first_token_time",
        "last_token_time",
        "listener",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "num_saved_blocks",
        "output_plan",
        "output_token_ids",
        "request_id",
        "scheduled_time",
        "status",
        "stop_at",
    )

    def __init__(self, request_id: str, prompt_token_ids: list[int], max_tokens: int, output_plan: list[int],
                 block_hashes: list[Digest], arrival_time: float, stop_at: int | None = None,
                 eos_token_id: int = -1, listener: Callable[[SimRequest], None] | None = None,
                 first_block_extra: tuple[Any, ...] | None = None) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.output_plan = output_plan      # the synthetic tokens this request will generate, in order
        self.stop_at = stop_at              # natural end (EOS) after this many tokens; None = only max_tokens
        self.eos_token_id = eos_token_id    # the last token of a natural end
        self.block_hashes = block_hashes    # hashes of every full block of all_token_ids
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1         # prefix-cache hit at first scheduling (usage.cached_tokens)
        self.num_preemptions = 0
        self.num_saved_blocks = -1          # leading blocks a KV connector holds or was given (-1: not admitted)
        self.arrival_time = arrival_time
        self.first_token_time = 0.0
        self.last_token_time = 0.0
        self.scheduled_time = 0.0           # when it was first scheduled (queue time = this - arrival)
        self.status = Status.WAITING
        self.finished = False               # FINISHED or ABORTED
        self.finish_reason: str | None = None
        self.listener = listener            # called after each step that produced tokens or finished it
        self.first_block_extra = first_block_extra  # extra keys of block 0 (cache_salt)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)



@dataclass(slots=True)
class ScheduledChunk:
    request: SimRequest
    num_new_tokens: int
    num_context_tokens: int  # tokens of this sequence already in the KV cache before the step


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    num_preempted: int = 0
    load_s: float = 0.0  # model seconds of the step's synchronous loads from the KV connector
    # chains of newly computed full blocks the KV connector is given after the step: (hashes, parent hash)
    saves: list[tuple[list[Digest], Digest | None]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, kv: KvCacheManager, hasher: BlockHasher, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 connector: KvConnector | None = None) -> None:
        self.kv = kv
        self.connector = connector
        self.external = ExternalCacheStats()
        self.hasher = hasher
        self.block_size = kv.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self.num_preemptions_total = 0
        self._repeating: SchedulerOutput | None = None  # the step `repeat_decodes` repeats, and how often more
        self._repeats = 0

    def add_request(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> None:
        request = self.requests.pop(request_id, None)
        if request is None or request.finished:
            return
        self._repeating = None
        if request.status == Status.RUNNING:
            self.running.remove(request)
        else:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        request.status = Status.ABORTED
        request.finished = True
        request.finish_reason = "abort"
        self.kv.free(request_id)

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request.request_id)
        request.status = Status.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def preempt_all(self) -> int:
        """Move every running request back to the waiting queue (newest first, so FIFO order is kept)."""
        n = len(self.running)
        self._repeating = None
        while self.running:
            self._preempt(self.running.pop())
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kv = self.kv
        allocate = kv.allocate_slots
        running = self.running  # (preemption pops from it; only update_from_output replaces it)
        last_position = self.max_model_len - 1
        scheduled_running: list[SimRequest] = []
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            computed = request.num_computed_tokens
            num_new = min(len(request.all_token_ids) - computed, budget, last_position - computed)
            if num_new <= 0:
                i += 1
                continue
            while True:
                ok = allocate(request.request_id, computed, num_new, (), request.block_hashes,
                              request.all_token_ids, request.first_block_extra)
                if ok:
                    break
                victim = running.pop()  # the newest running request (FCFS priority)
                if victim in scheduled_running:
                    # it was already scheduled this step: undo its chunk
                    scheduled_running.remove(victim)
                    for j, chunk in enumerate(out.chunks):
                        if chunk.request is victim:
                            budget += chunk.num_new_tokens
                            del out.chunks[j]
                            break
                self._preempt(victim)
                out.num_preempted += 1
                if victim is request:
                    break
            if not ok:
                break
            out.chunks.append(ScheduledChunk(request, num_new, computed))
            scheduled_running.append(request)
            budget -= num_new
            i += 1

        # new and preempted requests, only when no running request was preempted in this step (as vLLM)
        if out.num_preempted == 0:
            connector = self.connector
            bs = self.block_size
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                hits: list[KvBlock] = []
                num_hit = 0
                num_ext = 0  # tokens the connector will load (vLLM's num_external_computed_tokens)
                where = ""
                lookup = request.num_computed_tokens == 0
                if lookup:
                    hits, num_hit = kv.get_computed_blocks(
                        request.request_id, request.block_hashes, request.num_tokens, record=False)
                    if connector is not None:
                        # as the kvgate connector: full blocks after the local hit, never the last prompt token's
                        end = min(len(request.block_hashes), (request.num_tokens - 1) // bs)
                        if num_hit // bs < end:
                            count, where = connector.lookup(request.block_hashes, num_hit // bs, end)
                            where = where[:count]
                            num_ext = len(where) * bs
                num_new = request.num_tokens - num_hit - num_ext
                if num_new > budget and not self.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                if not kv.allocate_slots(request.request_id, num_hit + num_ext, num_new, hits,
                                         request.block_hashes, request.all_token_ids, request.first_block_extra,
                                         full_sequence_must_fit=True):
                    break
                self.waiting.popleft()
                self.running.append(request)
                request.status = Status.RUNNING
                first_time = request.num_preemptions == 0
                num_loaded = 0
                if lookup:
                    if first_time:  # recorded at admission, preempted requests not counted (as vLLM)
                        kv.stats.record(request.num_tokens, num_hit)
                    if connector is not None:
                        if num_ext:
                            loaded, seconds = connector.load(request.block_hashes, num_hit // bs, where)
                            out.load_s += seconds
                            num_loaded = loaded * bs
                            if num_loaded < num_ext:  # a load error: recompute those tokens in this step
                                self.external.load_errors += (num_ext - num_loaded) // bs
                                num_new += num_ext - num_loaded
                        if first_time:
                            ext = self.external
                            ext.queries += request.num_tokens - num_hit
                            ext.hits += num_ext
                            for code in where:
                                source = _CACHE_HIT_SOURCE.get(code, "external_unspecified")
                                ext.hits_by_source[source] = ext.hits_by_source.get(source, 0) + bs
                        if request.num_saved_blocks < 0:  # the connector's setdefault: kept across preemption
                            request.num_saved_blocks = num_hit // bs + len(where)
                request.num_computed_tokens = num_hit + num_loaded
                if request.num_cached_tokens < 0:
                    # vLLM's prefill stats: local + external tokens, as promised at admission
                    request.num_cached_tokens = num_hit + num_ext
                out.chunks.append(ScheduledChunk(request, num_new, num_hit + num_loaded))
                budget -= num_new

        for chunk in out.chunks:
            chunk.request.num_computed_tokens += chunk.num_new_tokens
        if self.connector is not None:
            self._plan_saves(out)
        return out

    def _plan_saves(self, out: SchedulerOutput) -> None:
        """As the kvgate connector's build_connector_meta: every block that becomes fully computed in this step
        (prompt or decode) goes to the connector after the step, once."""
        bs = self.block_size
        for chunk in out.chunks:
            request = chunk.request
            hashes = request.block_hashes
            first = request.num_saved_blocks
            full = min(request.num_computed_tokens // bs, len(hashes))
            if first < 0 or full <= first:
                continue
            out.saves.append((hashes[first:full], hashes[first - 1] if first > 0 else None))
            request.num_saved_blocks = full

    def repeat_decodes(self, out: SchedulerOutput, times: int = 1) -> bool:
        """Apply the finished step `out` and make `out` the next step, where that is all `update_from_output` and
        `schedule` would do: `out` gave every running request a decode token and nothing else, nothing waits, no
        request has a listener, and with this token no request finishes or fills a block, nor does the next one
        need a block or cache one. Then the tokens are appended and each chunk is one token further on (no
        request gets its first token, nothing is allocated, freed or cached: no KV event). False, and nothing
        changed, otherwise (`update_from_output`, then `schedule`). Most steps of a long decode are such steps.
        `times`: that many such steps in a row at once (the same as as many calls), or none where fewer are left
        (`decode_repeats`)."""
        if self.decode_repeats(out) < times or times < 1:
            return False
        self._repeats -= times
        for chunk in out.chunks:
            request = chunk.request
            outputs = request.output_token_ids
            plan = request.output_plan
            n_out = len(outputs)
            tokens = [plan[(n_out + k) % len(plan)] for k in range(times)]
            outputs += tokens
            request.all_token_ids += tokens
            chunk.num_context_tokens = request.num_computed_tokens + times - 1
            request.num_computed_tokens += times
        return True

    def decode_repeats(self, out: SchedulerOutput) -> int:
        """How many times in a row `repeat_decodes` can repeat the finished step `out` from here, as long as no
        request is added (0 while one waits)."""
        if self.waiting:
            return 0
        if out is not self._repeating:
            self._repeating, self._repeats = out, self._repeats_of(out)
        return self._repeats

    def _repeats_of(self, out: SchedulerOutput) -> int:
        """How many times in a row `repeat_decodes` can repeat `out` while nothing is added: the fewest tokens
        before a request of it would finish, fill a block or need one."""
        chunks = out.chunks
        running = self.running
        if not chunks or out.num_preempted or out.saves or out.load_s or len(chunks) != len(running):
            return 0
        bs = self.block_size
        last = self.max_model_len - 1
        tables = self.kv.tables
        caching = self.kv.enable_caching
        repeats = last
        for chunk, request in zip(chunks, running, strict=True):
            n_tokens = len(request.all_token_ids)
            n_out = len(request.output_token_ids)
            table = tables.get(request.request_id)
            if (chunk.request is not request or chunk.num_new_tokens != 1 or request.num_computed_tokens != n_tokens
                    or not n_out or request.listener is not None or table is None
                    or (caching and min(n_tokens + 1, len(request.block_hashes) * bs) // bs > table.num_cached)):
                return 0
            # the k-th repeat appends token n_tokens + k + 1 and output n_out + k + 1: it must not end the
            # request or fill a block, and the step after it needs a slot in the request's blocks
            repeats = min(repeats, request.max_tokens - n_out - 1, last - n_tokens - 1, -(n_tokens + 1) % bs,
                          len(table.blocks) * bs - n_tokens)
            if request.stop_at is not None:
                repeats = min(repeats, request.stop_at - n_out - 1)
        return max(repeats, 0)

    def update_from_output(self, out: SchedulerOutput, now: float) -> tuple[list[SimRequest], list[SimRequest]]:
        """Apply a finished step: sample one token for every request whose KV is now complete.

        Returns the requests that got a token and, among them, those that finished."""
        self._repeating = None
        touched: list[SimRequest] = []
        finished: list[SimRequest] = []
        bs = self.block_size
        max_model_len = self.max_model_len
        hasher = self.hasher
        for chunk in out.chunks:
            request = chunk.request
            all_ids = request.all_token_ids
            if request.finished or request.num_computed_tokens < len(all_ids):
                continue  # aborted meanwhile, or a prefill chunk that is not the last one
            outputs = request.output_token_ids
            n_out = len(outputs)
            if request.stop_at is not None and n_out + 1 == request.stop_at and request.eos_token_id >= 0:
                token = request.eos_token_id
            else:
                plan = request.output_plan
                token = plan[n_out % len(plan)]
            outputs.append(token)
            all_ids.append(token)
            if n_out == 0:
                request.first_token_time = now
            n_tokens = len(all_ids)
            if n_tokens % bs == 0:
                hashes = request.block_hashes
                extra = None if hashes else request.first_block_extra
                hashes.append(hasher(hashes[-1] if hashes else None, all_ids[-bs:], extra))
            n_out += 1
            if n_out >= request.max_tokens:
                request.finish_reason = "length"
            elif request.stop_at is not None and n_out >= request.stop_at:
                request.finish_reason = "stop"
            elif n_tokens >= max_model_len:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                request.status = Status.FINISHED
                request.finished = True
                finished.append(request)
            touched.append(request)
        if finished:
            done = set(id(r) for r in finished)
            self.running = [r for r in self.running if id(r) not in done]
            for request in finished:
                self.kv.free(request.request_id)
                self.requests.pop(request.request_id, None)
        for request in touched:
            if request.listener is not None:
                request.listener(request)
        return touched, finished
