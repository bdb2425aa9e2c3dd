"""The simulated engine core: runs the scheduler step by step on the event loop, taking as long per step as the
time model says (divided by `speedup`), publishes each step's KV events as one batch, and wakes the requests
that got tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench.sim.agent_link import AgentConnector
from bench.sim.kv_cache import BlockPool, KvCacheManager
from bench.sim.metrics import EngineCounters, EngineGauges
from bench.sim.perf_model import Profile
from bench.sim.scheduler import Scheduler, SimRequest
from kvcore.kv_events import KvEventPublisher
from kvcore.vllm_hash import BlockHasher, Digest, EventHash

log = logging.getLogger(__name__)

# A busy engine keeps the model's timeline: when a step ends late (a late timer, a busy host, our own Python
# work between steps), the next steps start on the timeline and catch up, as long as the engine is less than
# this far behind; beyond it the timeline restarts from now and the loss is counted in `lag_s`.
_CATCH_UP_S = 0.05
# steps shorter than this do not sleep; they only yield to the event loop
_MIN_SLEEP_S = 0.0002


@dataclass(frozen=True)
class EngineConfig:
    block_size: int
    num_gpu_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    speedup: float = 1.0
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True

    def validate(self) -> None:
        if self.block_size <= 0:
            raise ValueError("--block-size must be positive")
        if self.speedup <= 0:
            raise ValueError("--speedup must be positive")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("--max-num-seqs and --max-num-batched-tokens must be positive")
        capacity = (self.num_gpu_blocks - 1) * self.block_size
        if self.max_model_len > capacity:
            # vLLM refuses to start when one request of max_model_len cannot fit in the KV cache
            raise ValueError(
                f"To serve at least one request with the model's max seq len ({self.max_model_len}), "
                f"{self.num_gpu_blocks} blocks of {self.block_size} tokens are not enough (room for {capacity} "
                f"tokens). Try increasing --num-gpu-blocks-override or decreasing --max-model-len.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, --max-num-batched-tokens must be >= --max-model-len")


class SimEngine:
    """One replica's engine: cache, scheduler and the step loop."""

    def __init__(self, config: EngineConfig, profile: Profile, hasher: BlockHasher,
                 event_hash: Callable[[Digest], EventHash], publisher: KvEventPublisher | None = None,
                 clock: Callable[[], float] = time.monotonic, connector: AgentConnector | None = None) -> None:
        config.validate()
        self.config = config
        self.profile = profile
        self.pool = BlockPool(config.num_gpu_blocks, config.block_size, event_hash,
                              enable_events=publisher is not None)
        self.kv = KvCacheManager(self.pool, config.max_model_len, enable_caching=config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, hasher, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
                                   connector=connector)
        self.connector = connector  # a tier agent beside the replica (bench/sim/agent_link.py), or None
        self.publisher = publisher
        self.counters = EngineCounters()
        self.clock = clock
        self.steps = 0
        self.lag_s = 0.0  # time lost against the model's timeline (CPU-bound at a high speedup); 0 when keeping up
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.dead: BaseException | None = None  # why the step loop died (a bug); the replica then reports 500

    # --- lifecycle ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.publisher is not None:
            await self.publisher.start()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")
        self._task.add_done_callback(self._on_exit)

    def _on_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.dead = task.exception()
        log.critical("the simulated engine died", exc_info=self.dead)
        # wake every waiting handler, so nobody waits for tokens that will never come
        for request in list(self.scheduler.requests.values()):
            request.finished = True
            request.finish_reason = "error"
            if request.listener is not None:
                request.listener(request)

    async def close(self) -> None:
        if self._task is not None:
            if not self._task.done():  # a dead loop's exception was reported by _on_exit
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None
        if self.publisher is not None:
            await self.publisher.close()
        if self.connector is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.connector.close)

    # --- requests ----------------------------------------------------------------------------------------------

    def add_request(self, request: SimRequest) -> None:
        if self.dead is not None:
            raise RuntimeError("the simulated engine is dead") from self.dead
        self.scheduler.add_request(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is not None and not request.finished:
            self.scheduler.abort(request_id)
            self.counters.success["abort"] += 1
            self._flush_events()

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        if reset_running_requests:
            self.counters.preemptions += self.scheduler.preempt_all()
        ok = self.pool.reset_prefix_cache()
        self._flush_events()
        return ok

    def gauges(self) -> EngineGauges:
        s = self.kv.stats
        ext = self.scheduler.external
        return EngineGauges(running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
                            kv_cache_usage=self.pool.usage(), prefix_queries=s.queries, prefix_hits=s.hits,
                            external_queries=ext.queries, external_hits=ext.hits,
                            external_hits_by_source=dict(ext.hits_by_source),
                            num_gpu_blocks=self.pool.num_blocks, block_size=self.pool.block_size)

    # --- the step loop -----------------------------------------------------------------------------------------

    def _flush_events(self) -> None:
        if self.publisher is not None and self.pool.events:
            self.publisher.publish(self.pool.take_events())

    async def _run(self) -> None:
        scheduler = self.scheduler
        speedup = self.config.speedup
        step_time = self.profile.step_time
        clock = self.clock
        connector = self.connector
        loop = asyncio.get_running_loop()
        last_end = clock()
        while True:
            if not scheduler.has_unfinished():
                self._wake.clear()
                await self._wake.wait()
                last_end = clock()
            now = clock()
            behind = now - last_end
            if behind < _CATCH_UP_S:
                start = last_end
            else:
                start = now
                self.lag_s += behind
            out = scheduler.schedule()
            if out.empty:
                # nothing fits this step (cannot happen with a validated config); do not spin
                self._flush_events()
                await asyncio.sleep(0.001)
                last_end = clock()
                continue
            self.steps += 1
            self.counters.preemptions += out.num_preempted
            for chunk in out.chunks:
                if not chunk.request.scheduled_time:
                    chunk.request.scheduled_time = start
            duration = step_time([(c.num_new_tokens, c.num_context_tokens) for c in out.chunks])
            saving: asyncio.Future[None] | None = None
            if connector is not None:
                # the connector's loads (before the forward pass) and saves (after it) are synchronous: the
                # step lasts their modelled transfer time longer; the stand-in saves run while it passes
                duration += out.load_s
                if out.saves:
                    duration += connector.save_seconds(sum(len(h) for h, _ in out.saves))
                    saving = loop.run_in_executor(connector.executor, connector.save, out.saves)
            end = start + duration / speedup
            delay = end - clock()
            if delay > _MIN_SLEEP_S:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)
            if saving is not None:
                await saving
            now = clock()
            last_end = end
            sampled, finished = scheduler.update_from_output(out, now)
            self._account(sampled, finished, now)
            # as vLLM: what a step stored or evicted is published as one batch once the step has run
            self._flush_events()

    def _account(self, sampled: list[SimRequest], finished: list[SimRequest], now: float) -> None:
        c = self.counters
        c.generation_tokens += len(sampled)
        for request in sampled:
            if len(request.output_token_ids) == 1:
                c.prompt_tokens += request.num_prompt_tokens
                c.prompt_tokens_cached += max(request.num_cached_tokens, 0)
                c.ttft.observe(now - request.arrival_time)
                c.queue.observe(request.scheduled_time - request.arrival_time)
            else:
                c.itl.observe(now - request.last_token_time)
            request.last_token_time = now
        for request in finished:
            reason = request.finish_reason or "length"
            c.success[reason] = c.success.get(reason, 0) + 1
            c.e2e.observe(now - request.arrival_time)
            if request.first_token_time:  # (aborted before its first token: vLLM observes a prefill of 0)
                c.prefill.observe(request.first_token_time - request.scheduled_time)
                c.prefill_computed.observe(request.num_prompt_tokens - max(request.num_cached_tokens, 0))
                c.prompt.observe(request.num_prompt_tokens)
