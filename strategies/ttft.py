"""`ttft`: send each request where its first token is predicted to come soonest.

`kv`'s picture of the fleet (the KV block index, by tier; pending blocks; the trie where events cannot be
trusted) with a scorer in seconds instead of tokens. For each eligible worker:

    predicted TTFT = overhead                        the fit's intercept: HTTP, tokenizing, scheduling
                   + queue wait                      prefill tokens ahead of it there, at the worker's rate
                   + step in progress                the rest of the engine step running there beyond that
                                                     wait, from the step timing its relayed streams show
                   + load or recompute, per tier     GPU free; DRAM / NVMe / shared: the cheaper of reading the
                                                     run at the tier's transfer rate and recomputing it
                   + prefill of the uncached tokens  at the worker's rate
                   + decode pressure                 per request decoding there (each step carries them)
                   + KV blocks                       the wait until enough of the engine's KV blocks are free
                                                     for the prompt, beyond the waits above: the gateway's
                                                     requests there hold theirs until they end (`BlockLedger`)
    score          = predicted TTFT less the wait for KV blocks (the fleet's blocks: a choice moves that
                     wait between requests, it does not save it)
                   + spread cost                     placing a prefix held elsewhere on one more worker
                   + busy cost                       the GPU time its prefill takes there from the hits that
                                                     come for that worker meanwhile (a tier load takes none;
                                                     `ttft_busy_weight`, off: it did not pay on vsim)

and the lowest score wins. Each part is a class of its own below. The worker's prefill rate is learned online
(`PrefillRate`, a `LinearFit` of each streamed answer's time to first token against the prefill tokens it
waited for and needed, and of the engine's own prefill histograms in its /metrics: `EngineTimings`), starting
from `ttft_prefill_tokens_per_s` / `ttft_overhead_s`; `kvgate bench calibrate` fits those two, and the decode
cost, from a recorded trace. Each worker's engine steps (`StepClock`) are learned from the chunks the gateway
relays from it (`on_chunk`). Tier transfer rates are options (the agent's links). A worker over its share of
recent requests costs more, by the learned prefill of `ttft_balance_tokens` tokens (`RequestShare`, bounded-load
balance).

A request predicted to need at least `ttft_serialize_prefill_tokens` uncached tokens where it goes is marked
(`Decision.serialize_prefill`) to be sent there only once the gateway's long prefill before it there has its first
token (router/prefill_turns.py): an engine computes two long prompts sent together in the same steps, and the
first one's first token then comes about as late as the second's.

The spread cost is what the choice does to the future: a copy of a prefix that lives elsewhere costs cache
space here that something else will miss for, so it counts `ttft_spread_weight` times its prefill. A hot prefix
therefore stays on its worker until the queue there outweighs the prefill it saves plus that cost, then spills.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvcore.config import option
from kvcore.kv_events import CPU, DISK, GPU, SHARED
from router.config import GatewayConfig
from router.kv_transport import cache_name
from router.pool import Worker
from router.routing import Decision, Placement, RouteRequest
from strategies.balance import HIT, MISS, SPILL
from strategies.kv import Holding, KvAware, KvOptions

LOWER_TIERS = (CPU, DISK, SHARED)
# answers after which a worker is judged by its own fit rather than the fleet's: about what a fit remembers (the
# half-life's default); switching after 20 judged workers by young, noisy fits (RAG at 100/s, 8 replicas: TTFT p90
# 114 ms; own fits from the first answer 60; after 200, 51; the fleet's alone 47)
OWN_FIT_SAMPLES = 200
# a first token that took more than this many times what the fit predicted is learned as this many times: one
# stall of the gateway's own machine (first tokens of 1.2-1.5 s where 0.13 s was predicted, live at load 12) made
# the least-squares fit explain small prefills by a large overhead and price prefill tokens at nothing, and every
# tenant then looked as cheap to recompute as to hit (`kvgate bench compare` tenants: hit rate 0.363 of 0.888). A
# worker that really got slower is still followed, by up to this factor per round of answers; the engine's own
# prefill timings (`EngineTimings`) are not capped.
OUTLIER_RATIO = 5.0
# step durations a worker's `StepClock` keeps: enough to hold a few of the long steps (a prefill batched in) among
# the decode steps
STEP_SAMPLES = 64
# streams a `StepClock` remembers before it forgets those silent for STREAM_SILENCE_S (or two of its longest steps):
# it is not told when a stream ends
STREAMS_KEPT = 64
STREAM_SILENCE_S = 1.0
# first tokens a `PrefillQueue` remembers (when the request was routed, when its first token came), so that a scrape
# of the engine's waiting queue can be set against the gateway's requests waiting there at the scrape's time
DONE_KEPT = 256
# the least share of its links' time a tier load is priced at, however fast the fleet's loads have been (a load is
# never free: its bytes move)
MIN_LOAD_SCALE = 0.01
ERROR_BUCKETS = (-1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


@dataclass(frozen=True)
class TtftOptions(KvOptions):
    """`kv`'s settings (its tier costs are not used: tiers are timed) and the TTFT model's."""

    # defaults: Llama-3.1-8B on one H100 (`kvgate bench calibrate` prints a fleet's own)
    ttft_prefill_tokens_per_s: float = option(
        34000.0, "ttft: a worker's prefill rate (without attention) before it has answered; then learned")
    ttft_overhead_s: float = option(
        0.008, "ttft: time to first token besides prefill (a step reading the weights, HTTP, tokenizing) before "
        "it is learned")
    ttft_attention_s: float = option(
        1e-6, "ttft: prefill seconds per prompt token per 1,000 tokens of context before it (attention) before "
        "it is learned")
    ttft_prior_samples: float = option(
        4.0, "ttft: weight of the three settings above against the answers they are learned from, in answers")
    ttft_metrics_window_s: float = option(
        10.0, "ttft: also learn each worker's prefill rate from its engine's /metrics (vLLM's request_prefill_time_"
        "seconds, request_prefill_kv_computed_tokens and request_prompt_tokens histograms), a sample per window "
        "of this many seconds (0: from streamed answers only)")
    ttft_half_life: float = option(
        200.0, "ttft: answers after which an old answer counts half in the learned rate")
    ttft_kv_bytes_per_token: float = option(
        131072.0, "ttft: KV-cache bytes per token, for tier transfer times (Llama-3.1-8B bf16: 128 KiB)")
    # priors, learned from the fleet's loads (ttft_learn_loads); `python -m bench.gpu_check --tier dram|nvme|shared`
    # measures a GPU host's (an H200 host, 4 Dec 2026: 11.5 / 2.9-3.8 / 2.3-2.7 with that day's agent, docs/agent.md)
    ttft_cpu_gbps: float = option(25.0, "ttft: DRAM tier to GPU, GB/s (measure: python -m bench.gpu_check)")
    ttft_disk_gbps: float = option(5.0, "ttft: NVMe tier to GPU, GB/s (measure: python -m bench.gpu_check)")
    ttft_shared_gbps: float = option(10.0, "ttft: shared tier to GPU, GB/s (measure: python -m bench.gpu_check)")
    ttft_cpu_latency_s: float = option(50e-6, "ttft: DRAM tier, time per load besides the bytes")
    ttft_disk_latency_s: float = option(200e-6, "ttft: NVMe tier, time per load besides the bytes")
    ttft_shared_latency_s: float = option(2e-3, "ttft: shared tier, time per load besides the bytes")
    ttft_learn_loads: bool = option(
        True, "ttft: learn how long the fleet's tier loads take against the time the links above give them, from "
        "the first tokens of requests that loaded (false: the links' time as it is)")
    ttft_decode_cost_s: float = option(
        1e-4, "ttft: first-token delay per request decoding on the worker (its share of every step)")
    ttft_kv_high: float = option(
        0.9, "ttft: KV-cache usage above which a worker whose cache size is not known (no vllm:cache_config_info) "
        "is near full")
    ttft_kv_full_penalty_s: float = option(
        0.5, "ttft: delay predicted on a full KV cache of unknown size (waiting for blocks, preemption), scaled from "
        "0 at kv_high")
    ttft_block_wait: bool = option(
        True, "ttft: predict the wait for KV blocks on engines whose cache size is known (vllm:cache_config_info): "
        "until the gateway's requests there that hold blocks end, at the engine's decode step")
    ttft_decode_step_s: float = option(
        0.008, "ttft: seconds per decode step (a token for every request running) before the steps relayed from "
        "a worker show its own")
    ttft_output_tokens: float = option(
        340.0, "ttft: tokens a request that does not set max_tokens is expected to generate, before answers that "
        "ended show it")
    ttft_tie_s: float = option(
        0.002, "ttft: predictions this close (seconds) count as equal: the least busy worker of them takes it")
    ttft_tie_share: float = option(
        0.1, "ttft: predictions this close (share of the best) count as equal, when more than ttft_tie_s")
    ttft_spread_weight: float = option(
        1.0, "ttft: cost of copying a prefix held elsewhere onto one more worker, as a share of its prefill time")
    ttft_balance_slack: float = option(
        0.2, "ttft: a worker over (1 + this) x the fleet's mean share of recent requests takes no more until it "
        "is back under (bounded-load balance; negative: off)")
    ttft_balance_tokens: float = option(
        3800.0, "ttft: a worker at its balance cap costs more by the fleet's learned prefill time of this many "
        "tokens (the most the balance may cost a request, in the fleet's own time)")
    ttft_step_phase: bool = option(
        True, "ttft: add the expected rest of the engine step in progress on each worker, learned from the arrival "
        "times of the chunks streamed from it")
    ttft_step_jitter_s: float = option(
        0.001, "ttft: chunks from one worker this close (seconds) come from one engine step")
    ttft_balance_window: float = option(
        300.0, "ttft: requests per worker after which an old request counts half in the shares the balance caps")
    ttft_busy_weight: float = option(
        0.0, "ttft: weight of what a request's prefill costs the hits that come for the worker while its GPU "
        "computes it (BusyCost; 0: off, as calibrated on `kvgate bench vsim`: docs/ttft.md, \"The GPU time a "
        "choice takes from others\")")
    ttft_held_up_weight: float = option(
        0.0, "ttft: weight of what a first read's prefill (a request no worker holds any of) adds to the first "
        "tokens of the gateway's requests already waiting for theirs on the worker, each counted against its own "
        "expected time (HeldUpCost; 0: off)")
    ttft_step_tokens: float = option(
        8192.0, "ttft: the engines' max_num_batched_tokens, the most prefill tokens one step computes (vLLM's "
        "default on a >=70 GiB GPU: 8192)")
    ttft_serialize_prefill_tokens: int = option(
        512, "ttft: a request with at least this many prompt tokens predicted uncached where it goes is sent there "
        "only once the long prefill the gateway sent there before it has its first token (two computed together "
        "finish together, the first about as late as the second; 0: off)")
    ttft_busy_half_life_s: float = option(
        30.0, "ttft: seconds after which an old hit counts half in a worker's rate of hits (BusyCost)")


class LinearFit:
    """y ≈ w · x by least squares over recent samples (each `half_life` samples old counts half), each weight held
    towards its prior as much as `prior_weight` samples would hold it: as if that many samples, shared among the
    weights, had shown weight j alone (x_j = scales[j], every other x 0) at its prior value. (A prior on each weight
    rather than prior points on the line: samples that cluster fix the line where they are without a prior point
    far away tilting it.) Weights stay non-negative (a negative one is set to 0 and the rest fitted again)."""

    def __init__(self, prior: Sequence[float], scales: Sequence[float], prior_weight: float,
                 half_life: float) -> None:
        k = len(prior)
        self.k = k
        self.weights = list(prior)
        self._decay = 0.5 ** (1.0 / half_life)
        self._xx = [[0.0] * k for _ in range(k)]
        self._xy = [0.0] * k
        share = prior_weight / k
        self._prior_xx = [share * scale * scale for scale in scales]
        self._prior_xy = [share * scale * scale * p for p, scale in zip(prior, scales, strict=True)]
        self.samples = 0.0

    def add(self, x: Sequence[float], y: float, weight: float = 1.0) -> None:
        """One sample, or `weight` samples alike (a mean over that many: it ages the others as they would)."""
        d = self._decay ** weight
        for i in range(self.k):
            self._xy[i] = self._xy[i] * d + weight * x[i] * y
            row = self._xx[i]
            for j in range(self.k):
                row[j] = row[j] * d + weight * x[i] * x[j]
        self.samples += weight
        self.weights = self._solve()

    def _solve(self) -> list[float]:
        free = list(range(self.k))
        while free:
            a = [[self._xx[i][j] + (self._prior_xx[i] if i == j else 0.0) for j in free] for i in free]
            b = [self._xy[i] + self._prior_xy[i] for i in free]
            solved = _gauss(a, b)
            if solved is None:
                return self.weights
            negative = [f for f, v in zip(free, solved, strict=True) if v < 0]
            if not negative:
                out = [0.0] * self.k
                for f, v in zip(free, solved, strict=True):
                    out[f] = v
                return out
            free = [f for f in free if f not in negative]
        return [0.0] * self.k

    def predict(self, x: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(self.weights, x, strict=True))


def _gauss(a: list[list[float]], b: list[float]) -> list[float] | None:
    """The solution of a x = b (a small dense system), None when singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                if f:
                    m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass(frozen=True, slots=True)
class Work:
    """Prefill work: tokens computed, and their attention work (tokens x the context each attends to,
    in thousands of tokens: new tokens attend to the cached ones and, causally, to half of each other)."""

    tokens: float = 0.0
    attention: float = 0.0

    @classmethod
    def of(cls, tokens: float, context: float) -> Work:
        return cls(float(tokens), tokens * (context + tokens / 2) / 1000.0)

    def __add__(self, other: Work) -> Work:
        return Work(self.tokens + other.tokens, self.attention + other.attention)

    def scaled(self, share: float) -> Work:
        return Work(self.tokens * share, self.attention * share)


class PrefillRate:
    """One worker's prefill time: seconds per request (overhead), per prefill token, and per token per thousand
    tokens of context (attention), learned from its answers: each streamed answer's time to first token against
    the prefill work it waited behind and needed (`Work`)."""

    def __init__(self, options: TtftOptions) -> None:
        prior = (options.ttft_overhead_s, 1.0 / options.ttft_prefill_tokens_per_s, options.ttft_attention_s)
        typical = Work.of(2048, 8192)  # each weight's prior speaks as for a typical request
        self.fit = LinearFit(prior, (1.0, typical.tokens, typical.attention), options.ttft_prior_samples,
                             options.ttft_half_life)

    @property
    def overhead_s(self) -> float:
        return self.fit.weights[0]

    @property
    def tokens_per_s(self) -> float:
        per_token = self.fit.weights[1] + self.fit.weights[2] * 1.0  # at 1,000 tokens of context
        return 1.0 / per_token if per_token > 0 else math.inf

    def seconds(self, work: Work) -> float:
        w = self.fit.weights
        return w[1] * work.tokens + w[2] * work.attention

    def predict(self, work: Work) -> float:
        """Time to first token for this prefill work: the overhead and its prefill."""
        return self.overhead_s + self.seconds(work)

    def learn(self, work: Work, seconds: float, weight: float = 1.0) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self.fit.add((1.0, work.tokens, work.attention), seconds, weight)


@dataclass(frozen=True)
class TierLink:
    """One tier's path into the GPU: a fixed time per load and a transfer rate."""

    latency_s: float
    bytes_per_s: float


class LoadCost:
    """Getting a held prefix into the GPU: GPU blocks are free; a run on a lower tier is loaded at the tier's
    transfer rate or recomputed, whichever is cheaper (a long NVMe run is worth loading, a short one may not be).

    The links' time is scaled by what the fleet's loads really take against it (`speed`: the first tokens of
    requests that loaded, less the rest of their prediction, against the links' time for their loads; a fit
    through the origin that starts at 1). A link's nominal rate is not what a load costs a request: the agent's
    round trips, the connector's copies, a shared tier's contention, or (the live `kvgate sim` fleet at
    `--speedup 10`) an engine whose every duration is ten times shorter than the hardware's."""

    def __init__(self, options: TtftOptions) -> None:
        gb = 1e9
        self.links = {CPU: TierLink(options.ttft_cpu_latency_s, options.ttft_cpu_gbps * gb),
                      DISK: TierLink(options.ttft_disk_latency_s, options.ttft_disk_gbps * gb),
                      SHARED: TierLink(options.ttft_shared_latency_s, options.ttft_shared_gbps * gb)}
        self.bytes_per_token = options.ttft_kv_bytes_per_token
        # the prior speaks as for a 2,048-token load from the shared tier
        typical = self.load_seconds(SHARED, 2048)
        self.speed = LinearFit((1.0,), (typical,), options.ttft_prior_samples, options.ttft_half_life) \
            if options.ttft_learn_loads else None

    @property
    def scale(self) -> float:
        """What a load takes as a share of its links' time (1 until learned; at least MIN_LOAD_SCALE)."""
        return max(MIN_LOAD_SCALE, self.speed.weights[0]) if self.speed is not None else 1.0

    def load_seconds(self, tier: str, tokens: int) -> float:
        """The links' time for loading `tokens` from `tier` (unscaled)."""
        link = self.links[tier]
        return link.latency_s + tokens * self.bytes_per_token / link.bytes_per_s

    def plan(self, by_tier: dict[str, int], rate: PrefillRate,
             busy: Callable[[float], float] | None = None) -> tuple[float, int]:
        """(seconds loading, tokens recomputed instead) for a holding's lower-tier runs, which follow its GPU run
        in the prompt in this order. Recomputing a run means recomputing what follows it too. A load moves bytes
        beside the engine's steps; a recompute takes the GPU, and `busy` (seconds of GPU -> seconds others wait
        for it: `BusyCost`) prices that for the requests behind it."""
        seconds, recompute = 0.0, 0
        context = by_tier.get(GPU, 0)
        scale = self.scale
        for tier in LOWER_TIERS:
            tokens = by_tier.get(tier, 0)
            if not tokens:
                continue
            load = scale * self.load_seconds(tier, tokens)
            compute = rate.seconds(Work.of(tokens, context))
            if recompute or load >= compute + (busy(compute) if busy is not None else 0.0):
                recompute += tokens
            else:
                seconds += load
            context += tokens
        return seconds, recompute

    def learn(self, link_s: float, observed_s: float) -> None:
        """One request's loads: `link_s` the links' time for them, `observed_s` its first token less the rest of
        its prediction (at most OUTLIER_RATIO times what the loads were priced: a stall is not the links')."""
        if self.speed is None or link_s <= 0 or not math.isfinite(observed_s):
            return
        self.speed.add((link_s,), min(max(0.0, observed_s), OUTLIER_RATIO * self.scale * link_s))


@dataclass(slots=True)
class _Queued:
    work: Work         # the prefill it needs
    routed_at: float
    expected_s: float  # its predicted time to first token
    reported: bool     # streamed: its first token (or its end) will be reported
    load_s: float = 0.0  # of its predicted time, its tier loads
    turn: bool = False  # a long prefill sent in its turn (`Decision.serialize_prefill`)
    held: bool = False  # and held for it: another was in its turn when it was routed


class PrefillQueue:
    """Prefill the gateway has sent one worker that has not produced a first token yet: each request from its
    routing until its first token (or its end), by the request's identity (the gateway holds the request until
    its end, so the identity is not reused meanwhile). The oldest is in progress, drained at the worker's rate.
    A whole (non-streamed) answer, whose first token is never reported, stops counting once twice its predicted
    time to first token (and a second) has passed; a streamed one counts until its first token or its end, however
    long it waits (an overloaded worker's queue)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Queued] = OrderedDict()
        self.progress_since = 0.0  # when the head of the queue started on its prefill, at the latest
        self._done: deque[tuple[float, float]] = deque(maxlen=DONE_KEPT)  # (routed, done) of the latest done
        self.turns = 0  # of the requests waiting here, the long prefills sent in their turns

    def prefilling_held(self) -> bool:
        """Whether the oldest request waiting here is a long prefill that was held for its turn: the engine computes
        it now, its chunks beside the decoding of the one it waited for."""
        return self.turns > 0 and next(iter(self._entries.values())).held

    def add(self, key: int, work: Work, now: float, expected_s: float, reported: bool = False,
            load_s: float = 0.0, turn: bool = False) -> None:
        if not self._entries:
            self.progress_since = now
        self._entries[key] = _Queued(work, now, expected_s, reported, load_s, turn, turn and self.turns > 0)
        self.turns += turn

    def done(self, key: int, now: float) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.turns -= entry.turn
            self.progress_since = max(self.progress_since, now)
            self._done.append((entry.routed_at, now))

    def _expire(self, now: float) -> None:
        stale = [k for k, e in self._entries.items() if not e.reported and now - e.routed_at > 2 * e.expected_s + 1.0]
        for key in stale:
            self.done(key, now)

    def count(self, now: float) -> int:
        self._expire(now)
        return len(self._entries)

    def count_at(self, at: float, now: float) -> int:
        """How many of the gateway's requests here were waiting for their first token at `at` (a scrape's time,
        which only grows), as far as the latest DONE_KEPT first tokens tell."""
        self._expire(now)
        done = self._done
        while done and done[0][1] <= at:  # had its first token before this scrape: it tells nothing of a later one
            done.popleft()
        waiting = sum(1 for e in self._entries.values() if e.routed_at <= at)
        return waiting + sum(1 for routed, _ in done if routed <= at)

    def expected(self, now: float) -> list[float]:
        """The predicted time to first token of each request waiting here, less its tier loads (which move bytes
        beside the engine's steps): what the steps it shares take of it."""
        self._expire(now)
        return [e.expected_s - e.load_s for e in self._entries.values()]

    def ahead(self, now: float, rate: PrefillRate) -> Work:
        """The prefill work ahead of a request routed here now."""
        self._expire(now)
        if not self._entries:
            return Work()
        total = Work()
        for entry in self._entries.values():
            total = total + entry.work
        head = next(iter(self._entries.values())).work
        need = rate.seconds(head)
        if need > 0:
            elapsed = now - max(self.progress_since, next(iter(self._entries.values())).routed_at)
            total = total + head.scaled(-min(1.0, max(0.0, elapsed) / need))
        return total


class StepClock:
    """One worker's engine steps as the streams relayed from it show them. A step ends with a token for every
    request running there, so the chunks of the worker's running streams arrive in batches, one per step: a chunk
    more than `jitter_s` (or a quarter of the shortest recent step) after the first of the latest batch starts the
    next one (a step boundary), and the time since the same stream's previous chunk is that step's duration (one per
    batch is kept). A step whose batch brings a stream's first chunk computed a prefill: the gateway's queue of
    requests without their first token accounts for those, so their durations are kept apart (`prefill_steps`)
    from the others' (`durations`: decodes, and prefills the gateway did not see begin). So are the steps a long
    prefill held for its turn computes (`prefilling`: it is at the head of the queue there): sent on the first
    token of the one it waited for, its chunks run beside that one's decoding, in steps whose batches bring no
    first token, and taken for decode steps they made a hit there expect 45-56 ms for the rest of a decode step
    that took 7 (`kvgate bench vsim`, the live tenants fleet: median prediction error 102%; docs/ttft.md).

    While requests decode there, the engine is in a step that began at the latest boundary; the rest of it is
    expected to be the mean of d - elapsed over the recent durations d longer than what has elapsed, a step past
    every such duration is judged by the prefill steps', and one past those too is about to end."""

    def __init__(self, jitter_s: float, samples: int = STEP_SAMPLES,
                 prefilling: Callable[[], bool] | None = None) -> None:
        self.jitter_s = jitter_s
        self._prefilling = prefilling  # whether the engine computes a prefill the gateway's queue accounts for
        self.durations: deque[float] = deque(maxlen=samples)
        self.prefill_steps: deque[float] = deque(maxlen=samples)
        self.boundary = -math.inf  # the first chunk of the latest batch
        self._duration: float | None = None  # the latest batch's duration, once a stream has shown it
        self._prefilled = False  # the latest batch brought a stream's first chunk
        self._streams: dict[int, float] = {}  # per stream (request identity), its last chunk (oldest first)
        self._mean: float | None = 0.0  # None: to be summed again (when read: a batch may close on every chunk)
        self._shortest = 0.0
        self._longest = 0.0
        self._merge = max(jitter_s, 0.0)  # max(jitter_s, a quarter of the shortest step): kept as that changes

    def chunk(self, key: int, at: float, first: bool) -> None:
        """A chunk of the stream `key` (the request's identity, which a later request may have once this one has
        ended) arrived at `at`; `first`: the stream's first."""
        merge = self._merge
        if at - self.boundary > merge:
            self._close_batch()
            # a step that computed a chunk of a prefill the gateway's queue accounts for, whichever streams' chunks
            # end it
            self.boundary, self._duration = at, None
            self._prefilled = self._prefilling is not None and self._prefilling()
            streams = self._streams
            if len(streams) > STREAMS_KEPT:  # those silent for long have ended
                horizon = at - max(STREAM_SILENCE_S, 2 * self._longest)
                stale = []
                for stream, last_at in streams.items():  # (oldest first, so only the stale are read: with more
                    if last_at >= horizon:                # streams running than kept, every boundary read them all)
                        break
                    stale.append(stream)
                for stream in stale:
                    del streams[stream]
        last = self._streams.pop(key, None)  # (put back at the end: the streams are in the order of their last chunk)
        self._streams[key] = at
        if first:
            self._prefilled = True
        elif last is not None and self._duration is None and at - last > merge:
            self._duration = at - last

    def _close_batch(self) -> None:
        if self._duration is None:
            return
        if self._prefilled:
            self.prefill_steps.append(self._duration)
            return
        durations, duration = self.durations, self._duration
        evicted = durations[0] if len(durations) == durations.maxlen else None
        durations.append(duration)
        self._mean = None
        if len(durations) == 1 or evicted == self._shortest or evicted == self._longest:
            self._shortest, self._longest = min(durations), max(durations)
        elif duration < self._shortest:
            self._shortest = duration
        elif duration > self._longest:
            self._longest = duration
        self._merge = max(self.jitter_s, 0.25 * self._shortest)

    @property
    def mean_s(self) -> float:
        """The mean recent step (0 before one is known)."""
        if self._mean is None:
            self._mean = sum(self.durations) / len(self.durations)
        return self._mean

    def rest(self, now: float) -> float:
        """Expected seconds until the step in progress ends, for an engine decoding since the latest boundary; 0
        before any duration is known."""
        elapsed = max(0.0, now - self.boundary)
        if elapsed <= self._shortest and self.durations:
            return self.mean_s - elapsed
        for durations in (self.durations, self.prefill_steps):
            longer = [d for d in durations if d > elapsed]
            if longer:
                return sum(longer) / len(longer) - elapsed
        return 0.0


class EnginePressure:
    """What the engine's own metrics add: requests waiting there that the gateway did not send (another
    gateway's, preempted ones) at the fleet's mean prefill per request; requests decoding there, each a share
    of every step; a KV cache near full, where a new request waits for blocks or preempts, on an engine whose
    cache size is not known (where it is, `BlockLedger` predicts that wait)."""

    def __init__(self, options: TtftOptions) -> None:
        self.decode_cost_s = options.ttft_decode_cost_s
        self.kv_high = options.ttft_kv_high
        self.kv_full_penalty_s = options.ttft_kv_full_penalty_s

    @staticmethod
    def foreign(worker: Worker, ours_waiting: int, mean: Work) -> Work:
        return mean.scaled(max(0.0, worker.waiting - ours_waiting))

    def seconds(self, worker: Worker, ours_waiting: int, blocks_known: bool = False) -> float:
        decoding = max(0.0, worker.in_flight + worker.sibling_in_flight - ours_waiting, worker.running - ours_waiting)
        seconds = self.decode_cost_s * decoding
        if not blocks_known and worker.kv_usage > self.kv_high and self.kv_high < 1.0:
            seconds += self.kv_full_penalty_s * min(1.0, (worker.kv_usage - self.kv_high) / (1.0 - self.kv_high))
        return seconds


def block_wait(free: float, running: Iterable[tuple[float, float, float]], queued: Iterable[tuple[float, float, float]],
               need: float) -> float:
    """Seconds until a request that needs `need` KV blocks is admitted by an engine with `free` blocks free now:
    `running` holds (seconds until it ends, blocks it holds now, blocks it adds per second as it decodes) per
    request that holds blocks, `queued` (blocks it takes, seconds it runs once admitted, blocks it adds per second)
    per request waiting ahead of this one, in order. As vLLM's scheduler: the waiting queue is admitted in order,
    each request once its whole prompt fits, and one that does not fit holds back those behind it. Blocks free up
    only when a request ends, and the decoding ones take more as they go, so a request fits, if at all, just as
    one ends (or now). When it never fits (blocks held by requests not listed, a prompt larger than the cache),
    the time the last listed request ends: nothing later is known."""
    # each request holding blocks holds b + r (t - start) of them at t, until its end: kept as sums, ends in a heap
    ends = [(end, blocks, rate, 0.0) for end, blocks, rate in running]
    heapq.heapify(ends)
    held = sum(blocks for _, blocks, _, _ in ends)  # the sum of b
    growth = sum(rate for _, _, rate, _ in ends)     # of r
    started = 0.0                                    # of r x start
    capacity = free + held
    t = 0.0
    for blocks, run_s, rate in (*queued, (need, 0.0, 0.0)):
        while True:
            while ends and ends[0][0] <= t:  # ended: what it held is free again
                _, b, r, start = heapq.heappop(ends)
                held, growth, started = held - b, growth - r, started - r * start
            free = capacity - (held + growth * t - started)
            if free >= blocks or not ends:
                break
            t = ends[0][0]
        if free < blocks:
            return t
        heapq.heappush(ends, (t + run_s, blocks, rate, t))
        held, growth, started = held + blocks, growth + rate, started + rate * t
    return t


class OutputLength:
    """How many tokens a request generates, learned from the streamed answers that ended (a chunk a token): of
    those that set max_tokens, the mean share of it they used; of the others, their mean length. Each mean forgets
    as the prefill fit does (`half_life` answers) and starts from its prior, counted as one answer: all of
    max_tokens, and `ttft_output_tokens`."""

    def __init__(self, tokens: float, half_life: float) -> None:
        self.share, self.tokens = 1.0, tokens
        self._share_weight = self._tokens_weight = 1.0
        self.learned = 0  # answers learned from
        self._decay = 0.5 ** (1.0 / half_life)

    def expected(self, max_tokens: int | None) -> float:
        return max_tokens * self.share if max_tokens else self.tokens

    def learn(self, max_tokens: int | None, generated: int) -> None:
        self.learned += 1
        if max_tokens:
            self._share_weight = self._share_weight * self._decay + 1.0
            self.share += (min(1.0, generated / max_tokens) - self.share) / self._share_weight
        else:
            self._tokens_weight = self._tokens_weight * self._decay + 1.0
            self.tokens += (generated - self.tokens) / self._tokens_weight


@dataclass(slots=True)
class _Holder:
    prompt: int          # prompt tokens
    max_tokens: int | None
    output: float        # tokens it is expected to generate
    prefill_s: float     # its predicted prefill once admitted
    routed_at: float
    expected_s: float    # its predicted time to first token
    stream: bool         # its chunks are relayed: the gateway sees its first token and counts its tokens
    generated: int = 0   # chunks relayed
    started: bool = False  # its first token came


class BlockLedger:
    """The KV blocks the gateway's requests in flight on one engine (a data-parallel rank of it) hold, and until
    when. A request admitted by the engine holds the blocks of its prompt and of what it has generated until it
    ends; one not yet admitted waits in the engine's queue, in the order the gateway sent it, for its prompt's
    blocks. A streamed request counts as admitted from its first token, a whole answer from its predicted first
    token; it ends after its expected output (`OutputLength`) at the engine's decode step."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._entries: OrderedDict[int, _Holder] = OrderedDict()
        self.held = 0  # blocks of every entry's prompt and generated tokens, kept as they change
        self._ended: deque[tuple[float, int]] = deque()  # (when, blocks) of entries ended lately
        self._ended_blocks = 0  # their sum

    def __len__(self) -> int:
        return len(self._entries)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def add(self, key: int, holder: _Holder) -> None:
        self._entries[key] = holder
        self.held += self._blocks(holder.prompt)

    def first_token(self, key: int) -> None:
        holder = self._entries.get(key)
        if holder is not None:
            holder.started = True

    def chunk(self, key: int, tokens: int = 1) -> None:
        holder = self._entries.get(key)
        if holder is not None:
            before = holder.prompt + holder.generated
            holder.generated += tokens
            size = self.block_size  # the blocks its new tokens began (`_blocks`, written out: once an event)
            self.held += -(-(before + tokens) // size) + (-before // size)

    def end(self, key: int, now: float) -> _Holder | None:
        holder = self._entries.pop(key, None)
        if holder is not None:
            blocks = self._blocks(holder.prompt + holder.generated)
            self.held -= blocks
            self._ended.append((now, blocks))
            self._ended_blocks += blocks
        return holder

    def ended_since(self, since: float) -> int:
        """Blocks of the entries that ended after `since` (kept as long as one scrape interval asks)."""
        ended = self._ended
        while ended and ended[0][0] < since:
            self._ended_blocks -= ended.popleft()[1]
        return self._ended_blocks

    def wait(self, now: float, capacity: float, need: int, step_s: float) -> float:
        """Seconds until a request needing `need` blocks, sent now, is admitted on an engine where `capacity`
        blocks are for the gateway's requests (`block_wait`)."""
        if self.held + need <= capacity:
            return 0.0  # everything fits at once
        running: list[tuple[float, float, float]] = []
        queued: list[tuple[float, float, float]] = []
        growth = 1.0 / (step_s * self.block_size) if step_s > 0 else 0.0  # blocks per second of a decoding request
        for h in self._entries.values():
            decoding_s = now - h.routed_at - h.expected_s  # a whole answer's, from its predicted first token
            if h.started or (not h.stream and decoding_s > 0):
                generated = h.generated if h.stream else decoding_s / step_s if step_s > 0 else 0.0
                running.append((max(1.0, h.output - generated) * step_s, (h.prompt + generated) / self.block_size,
                                growth))
            else:
                queued.append((self._blocks(h.prompt), h.prefill_s + h.output * step_s, growth))
        return block_wait(capacity - sum(b for _, b, _ in running), running, queued, need)


@dataclass(frozen=True, slots=True)
class _PrefillTotals:
    at: float  # when they were scraped
    seconds: float
    requests: float
    computed: float
    prompt: float

    @classmethod
    def of(cls, worker: Worker) -> _PrefillTotals:
        return cls(worker.load_scraped_at, worker.prefill_seconds, worker.prefill_requests,
                   worker.prefill_computed_tokens, worker.prefill_prompt_tokens)


@dataclass(frozen=True, slots=True)
class EngineSample:
    """What an engine's metrics say of the requests it finished in a window: how many, the mean one's prefill work
    and the prefill seconds it took."""

    requests: float
    work: Work
    seconds: float


class EngineTimings:
    """Prefill samples from an engine's own metrics, which also count the answers the gateway does not see the
    first token of (whole answers, another gateway's requests). vLLM observes, per finished request, its prefill
    time (scheduled to first token), the tokens it computed (not cached) and its prompt tokens; the differences of
    their sums between two scrapes at least `window_s` apart are one sample: the mean request's work (tokens
    computed after a context of its cached tokens) and its share of the prefill seconds. Those seconds are capped at
    the window's length: requests prefilled side by side each count every step they shared, but the engine cannot
    have prefilled for longer than the window (when it was busy throughout, the sample is its throughput)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._last: dict[str, _PrefillTotals] = {}

    def sample(self, worker: Worker) -> EngineSample | None:
        """The sample of the window ending with the worker's last scrape, once it is long enough and requests
        finished in it; None otherwise (and always when the engine does not export these metrics)."""
        if self.window_s <= 0 or not worker.load_scraped_at:
            return None
        now = _PrefillTotals.of(worker)
        last = self._last.get(worker.url)
        if last is None or now.requests < last.requests or now.seconds < last.seconds:
            self._last[worker.url] = now  # the first scrape, or the engine restarted: the window starts here
            return None
        elapsed = now.at - last.at
        if elapsed < self.window_s:
            return None
        self._last[worker.url] = now
        n = now.requests - last.requests
        if n < 1:
            return None
        computed = max(0.0, now.computed - last.computed) / n
        cached = max(0.0, (now.prompt - last.prompt) / n - computed)
        seconds = min(now.seconds - last.seconds, elapsed) / n
        return EngineSample(n, Work.of(max(1.0, computed), cached), seconds)

    def forget(self, url: str) -> None:
        self._last.pop(url, None)


class SpreadCost:
    """Placing a prefix held elsewhere on one more worker: the cache space the copy takes there, priced as
    `ttft_spread_weight` times what getting back what it pushes out costs. Tokens no tier there holds: their
    prefill (what the copy evicts is recomputed). Tokens the worker loads from a lower tier while another worker's
    GPU holds them: reloading as many tokens from the worker's DRAM tier (its agent keeps what its GPU evicts), at
    the fleet's learned load speed, at most their load. Without a price for those a worker that could load a
    prefix from the shared tier cost only the load more than its GPU holder, and where loads are cheap every small
    queue sent requests away from their GPU hits (vsim tenants with eager tiers: GPU share of the hits 0.24-0.35,
    p90 mean 272 ms over ten seeds; with it 0.39-0.53, 255 ms). Priced at their whole load (a shared-tier load
    is 2.7 times a DRAM one), a GPU holder kept every request of its prefix until its queue was worth two loads,
    so hits waited behind another tenant's cold prefill there (docs/ttft.md)."""

    def __init__(self, options: TtftOptions, load: LoadCost) -> None:
        self.weight = options.ttft_spread_weight
        self.load = load

    def seconds(self, held_here: int, held_most: int, rate: PrefillRate, load_s: float = 0.0,
                gpu_here: int = 0, gpu_most: int = 0) -> float:
        copied = max(0, held_most - held_here)
        cost = rate.seconds(Work.of(copied, held_here)) if copied else 0.0
        loaded = min(gpu_most, held_here) - gpu_here  # tokens loaded here that another worker's GPU holds
        if loaded > 0 and load_s > 0:
            cost += min(load_s, self.load.scale * self.load.load_seconds(CPU, loaded))
        return self.weight * cost


class HeldUpCost:
    """What a request's prefill on a worker adds to the first tokens of the gateway's requests already waiting
    there. The engine computes waiting prompts together, up to `step_tokens` a step, and a request's first token
    comes at the end of the step that computes its prompt's last tokens, so a prefill routed there lengthens the step
    a waiting request ends in (a request still loading from a tier is admitted after one that loads nothing, and
    waits for the whole of its first step). Each waiting request counts by the share that adds to its own expected
    time (its predicted time to first token less its loads), against this request's best prediction: a
    2,048-token first read that takes 55 ms of a 13 ms hit's time makes the hit five times slower, while doubling up
    with another first read makes both about twice as slow. Summed over the requests that way (the mean of each
    request's time over its own, Bender et al.'s stretch), the hit is sent elsewhere; summed in seconds, the two are
    alike and a long prefill lands on the worker whose only waiting request is a short one (docs/ttft.md,
    "Tenants with agents: a first read beside a waiting hit")."""

    def __init__(self, weight: float, step_tokens: float, floor_s: float) -> None:
        self.weight = weight  # counted only for a request no worker holds any of (`TtftAware.choose`)
        self.step_tokens = step_tokens
        self.floor_s = floor_s

    def seconds(self, waiting: Sequence[float], prefill: Work, rate: PrefillRate, best_s: float) -> float:
        """`waiting`: the expected times (less loads) of the requests waiting there; `prefill`: this request's
        there; `best_s`: its lowest prediction of all workers."""
        if self.weight <= 0 or not waiting or prefill.tokens <= 0:
            return 0.0
        added = rate.seconds(prefill.scaled(min(1.0, self.step_tokens / prefill.tokens)))
        if added <= 0:
            return 0.0
        return self.weight * added * sum(best_s / max(self.floor_s, w) for w in waiting)


class BusyCost:
    """What a request's prefill on a worker costs the requests that will come for that worker's prefixes while its
    GPU computes it: each hit that arrives there meanwhile waits for it (or, sent elsewhere, recomputes its prefix).
    A tier load is no part of it (it moves bytes beside the engine's steps, in `kvgate bench vsim` and in vLLM with
    the agent's connector); a recompute, or a miss, is. With the worker's recent rate of hits h (per second, each
    `half_life_s` old counting half), a queue of q seconds there and b seconds of prefill added:

        cost = weight x h x b x (q + b / 2)

    (the hits arriving before the queue and this prefill are through wait b; those arriving during it, half of it
    on average). A long miss then goes to a worker few hits come for, and a run held on a slow tier is loaded
    where recomputing it would hold up the worker's hits (docs/ttft.md, "The GPU time a choice takes from
    others")."""

    def __init__(self, weight: float, half_life_s: float) -> None:
        self.weight = weight
        self.half_life_s = half_life_s
        self._hits: dict[str, tuple[float, float]] = {}  # worker -> (decayed count of hits, when)

    def _count(self, url: str, now: float) -> float:
        count, at = self._hits.get(url, (0.0, now))
        return count * math.pow(0.5, max(0.0, now - at) / self.half_life_s)

    def hit_rate(self, url: str, now: float) -> float:
        """Hits per second routed to the worker lately."""
        return self._count(url, now) * math.log(2) / self.half_life_s

    def hit(self, url: str, now: float) -> None:
        self._hits[url] = (self._count(url, now) + 1.0, now)

    def seconds(self, hit_rate: float, queue_s: float, busy_s: float) -> float:
        return self.weight * hit_rate * busy_s * (queue_s + busy_s / 2)

    def forget(self, url: str) -> None:
        self._hits.pop(url, None)


class RequestShare:
    """Each worker's count of recent requests (each counts half after `window` requests per worker have been routed
    since) and the cap of bounded-load balancing (Mirrokni et al., consistent hashing with bounded loads): a worker
    whose count with one more request would be over (1 + `slack`) x the mean of the workers it is chosen among
    (plus one request) takes none until the others catch up. What is cheap to place anywhere (a new session, a
    first read of a document, a hot prefix's next copy) then goes to a worker under the cap, and a group of
    requests that share a prefix is spread over as many copies as its traffic needs, instead of every request of
    the group following the one worker that held the prefix first."""

    def __init__(self, slack: float, window: float) -> None:
        self.slack = slack
        self.window = window
        self.counts: dict[str, float] = {}

    def over(self, urls: Sequence[str]) -> list[bool]:
        """Which of these workers are at their cap (none when the balance is off)."""
        if self.slack < 0 or len(urls) < 2:
            return [False] * len(urls)
        counts = [self.counts.get(u, 0.0) for u in urls]
        cap = (1.0 + self.slack) * (sum(counts) + 1.0) / len(urls) + 1.0
        return [c + 1.0 > cap for c in counts]

    def add(self, url: str, workers: int) -> None:
        decay = 0.5 ** (1.0 / (self.window * max(1, workers)))
        for u in self.counts:
            self.counts[u] *= decay
        self.counts[url] = self.counts.get(url, 0.0) + 1.0

    def forget(self, url: str) -> None:
        self.counts.pop(url, None)


@dataclass(frozen=True, slots=True)
class Estimate:
    """One worker's predicted time to first token for a request, by part, and the work it is made of."""

    overhead_s: float
    queue_s: float
    step_s: float
    load_s: float
    prefill_s: float
    pressure_s: float
    queued: Work
    prefill: Work
    rank: int | None = None  # the data-parallel rank it is for (None: the worker is not a data-parallel engine)
    blocks_s: float = 0.0  # the wait for KV blocks beyond the queue, the step in progress and the tier loads
    link_s: float = 0.0  # the tier loads' time at their links' rates, before `LoadCost.scale`
    busy_s: float = 0.0  # what its prefill here costs the hits that come for this worker meanwhile (`BusyCost`)

    @property
    def ttft_s(self) -> float:
        return self.choice_s + self.blocks_s

    @property
    def choice_s(self) -> float:
        """What the choice weighs of it: all but the wait for KV blocks. That wait is for blocks the fleet's
        requests hold, which a choice moves between requests rather than saves: choosing by it spread requests
        away from their prefixes and lengthened TTFT (docs/ttft.md, "Waiting for KV blocks")."""
        return self.overhead_s + self.queue_s + self.step_s + self.load_s + self.prefill_s + self.pressure_s


class TtftMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.error = Histogram(
            "kvgate_ttft_prediction_error_ratio",
            "ttft: (predicted - observed) / observed time to first token on the chosen worker",
            buckets=ERROR_BUCKETS, registry=registry)
        self.rate = Gauge("kvgate_ttft_prefill_tokens_per_second",
                          "ttft: each worker's learned prefill rate (at 1,000 tokens of context)", ["worker"],
                          registry=registry)
        self.engine_samples = Counter(
            "kvgate_ttft_engine_prefills_learned_total",
            "ttft: requests whose prefill time the learned rate took from the engine's /metrics", ["worker"],
            registry=registry)
        self.overhead = Gauge("kvgate_ttft_overhead_seconds",
                              "ttft: each worker's learned time to first token besides prefill", ["worker"],
                              registry=registry)
        self.step = Gauge("kvgate_ttft_step_seconds",
                          "ttft: each worker's mean engine step (without prefills the gateway sent) as the chunks "
                          "relayed from it show (a data-parallel engine's per rank: worker#dpN)", ["worker"],
                          registry=registry)


@dataclass(slots=True)
class _Routed:
    worker: str
    estimate: Estimate
    cache: str  # the worker, or the data-parallel rank of it, whose queue it waits in


class TtftAware(KvAware):
    name = "ttft"
    Options = TtftOptions

    def __init__(self, config: GatewayConfig, options: TtftOptions) -> None:
        super().__init__(config, options)
        self.ttft_options = options
        self.load = LoadCost(options)
        self.pressure = EnginePressure(options)
        self.spread = SpreadCost(options, self.load)
        self.share = RequestShare(options.ttft_balance_slack, options.ttft_balance_window)
        self.busy = BusyCost(options.ttft_busy_weight, options.ttft_busy_half_life_s)
        self.held_up = HeldUpCost(options.ttft_held_up_weight, options.ttft_step_tokens, options.ttft_tie_s)
        self.timings = EngineTimings(options.ttft_metrics_window_s)
        self.rates: dict[str, PrefillRate] = {}
        self.fleet_rate = PrefillRate(options)  # every worker's answers
        self.queues: dict[str, PrefillQueue] = {}
        self.ledgers: dict[str, BlockLedger] = {}  # per engine (a data-parallel rank: each has its own cache)
        self.output = OutputLength(options.ttft_output_tokens, options.ttft_half_life)
        self.block_wait = options.ttft_block_wait
        # per engine (a data-parallel engine's per rank, by cache name: each rank runs steps of its own)
        self.steps: dict[str, StepClock] = {}
        # per data-parallel rank, the gateway's requests routed there (in flight), and of them those past their
        # first token (decoding): the worker's own counts are the whole engine's
        self._rank_in_flight: dict[str, int] = {}
        self._rank_decoding: dict[str, int] = {}
        self._decoding_on: dict[int, str] = {}  # request identity -> its rank's cache, once it decodes
        self.step_phase = options.ttft_step_phase
        self._routed: dict[int, _Routed] = {}
        self._mean = Work()  # the prefill a request brings, on average (recent requests)
        self._ttft_metrics: TtftMetrics | None = None
        self._balance_work = Work.of(options.ttft_balance_tokens, 0)
        self.tie_s = options.ttft_tie_s
        self.tie_share = options.ttft_tie_share
        self.serialize_tokens = options.ttft_serialize_prefill_tokens

    @property
    def now(self) -> float:
        return self.balance.clock()  # the balance's clock: injectable (tests, the virtual-time fleet)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        super().register_metrics(registry)
        self._ttft_metrics = TtftMetrics(registry)

    @property
    def balance_s(self) -> float:
        """What a worker at its balance cap costs more: the prefill of `ttft_balance_tokens` tokens at the fleet's
        learned rate. In seconds it held for one fleet's speed only: 0.12 s, tuned on the H100 profile (about 3,800
        tokens there), was the prefill of 440 tokens on an L4 and of 8,000 on the live fleet (an L4 at speedup 10),
        so the same prefix was moved for the balance on one fleet and kept on the other (docs/ttft.md, "The
        balance's price in the fleet's own time")."""
        return self.fleet_rate.seconds(self._balance_work)

    def rate(self, url: str) -> PrefillRate:
        """The worker's own prefill fit once it has answered `OWN_FIT_SAMPLES` times, the fleet's until then (a
        worker judged by its prior alone may never be chosen, and so never learn, while the others have learned
        they are faster than the prior)."""
        rate = self.own_rate(url)
        return rate if rate.fit.samples >= OWN_FIT_SAMPLES else self.fleet_rate

    def own_rate(self, url: str) -> PrefillRate:
        rate = self.rates.get(url)
        if rate is None:
            rate = self.rates[url] = PrefillRate(self.ttft_options)
        return rate

    def queue(self, cache: str) -> PrefillQueue:
        """The prefill queue of a worker, or of a data-parallel rank of it (each rank schedules its own)."""
        queue = self.queues.get(cache)
        if queue is None:
            queue = self.queues[cache] = PrefillQueue()
        return queue

    def ledger(self, cache: str, block_size: int) -> BlockLedger:
        """The KV blocks the gateway's requests hold on a worker, or on a data-parallel rank of it."""
        ledger = self.ledgers.get(cache)
        if ledger is None or (ledger.block_size != block_size and not len(ledger)):
            ledger = self.ledgers[cache] = BlockLedger(block_size)
        return ledger

    def blocks_for_us(self, worker: Worker, ledger: BlockLedger, now: float) -> float:
        """The blocks of the worker's cache (of each rank's) that are not held by requests the gateway did not
        send: its usable blocks (vLLM's num_gpu_blocks less its null block) less those in use, as last scraped,
        beyond what the gateway's own requests hold now or held until lately (a scrape is up to an interval old,
        and its fetch takes time: two intervals). A data-parallel engine's usage is all ranks' together: there
        only the gateway's own are counted."""
        usable = worker.kv_blocks - 1
        if worker.spec.dp_ranks > 1:
            return usable
        ours = ledger.held + ledger.ended_since(now - 2 * self.config.metrics_interval_s)
        return usable - max(0.0, worker.kv_usage * usable - ours)

    def _ours_when_scraped(self, worker: Worker, now: float) -> int:
        """The gateway's requests waiting for their first token on the worker when its load was last scraped, to set
        against the engine's waiting queue of then. A scrape is up to `metrics_interval_s` old: against the
        gateway's requests waiting now, the requests it saw waiting that have had their first token since counted as
        another gateway's, and on a fast fleet (the live tenants, a 2,048-token prefill in 0.03 s, scraped every
        second) that phantom queue sent requests away from their prefix (`kvgate bench vsim` tenants at speedup 10,
        seeds 0-29: hit rate 0.841 -> 0.855; docs/ttft.md)."""
        at = worker.load_scraped_at
        if worker.spec.dp_ranks == 1:
            return self.queue(worker.url).count_at(at, now)
        return sum(self.queue(cache).count_at(at, now) for _, cache in self._caches_of(worker))

    def _ours(self, worker: Worker, now: float) -> int:
        """The gateway's requests waiting for their first token on the worker, all its ranks together."""
        if worker.spec.dp_ranks == 1:
            return self.queue(worker.url).count(now)
        return sum(self.queue(cache).count(now) for _, cache in self._caches_of(worker))

    def estimate(self, worker: Worker, prompt: int, held: Holding, now: float) -> Estimate:
        """The predicted time to first token of a `prompt`-token request on `worker`, which holds `held` (on
        `held.rank` of a data-parallel engine; where no rank holds any of it, on the rank whose step ends
        soonest)."""
        rate = self.rate(worker.url)
        rank = held.rank
        if worker.spec.dp_ranks > 1 and (rank is None or not held.tokens):  # no rank holds any of it
            rank = self._soonest_rank(worker, now, rate)
        queue = self.queue(cache_name(worker.url, rank))
        ours = self._ours(worker, now)
        # requests waiting in the engine that the gateway did not send wait for whichever rank: counted on each
        queued = queue.ahead(now, rate)
        if worker.waiting > 0:
            queued = queued + self.pressure.foreign(worker, self._ours_when_scraped(worker, now), self._mean)
        queue_s = rate.seconds(queued)
        hits = self.busy.hit_rate(worker.url, now) if self.busy.weight > 0 else 0.0
        load_s, recompute = self.load.plan(held.by_tier, rate,
                                           (lambda b: self.busy.seconds(hits, queue_s, b)) if hits > 0 else None)
        context = held.tokens - recompute
        prefill = Work.of(max(1, prompt - context), context)
        prefill_s = rate.seconds(prefill)
        # the rest of the step in progress: only while requests decode there (else the engine is idle)
        rest = self.step_rest(worker.url, rank, now) if (
            self._rank_decoding.get(cache_name(worker.url, rank), 0) > 0 if rank is not None
            else worker.in_flight + worker.sibling_in_flight > ours) else 0.0
        # this request joins the next step, after the rest of this one beyond what it waits anyway (the queue
        # ahead of it, its tier loads)
        step_s = max(0.0, rest - queue_s - load_s)
        # and is admitted once its prompt's blocks are free, which may be later still
        blocks_known = self.block_wait and worker.kv_blocks > 1
        blocks_s = 0.0
        if blocks_known:
            cache = cache_name(worker.url, rank)
            ledger = self.ledger(cache, worker.kv_block_size or self.balance.block_size)
            if len(ledger):
                need = -(-prompt // ledger.block_size)
                wait = ledger.wait(now, self.blocks_for_us(worker, ledger, now), need, self.decode_step_s(cache))
                blocks_s = max(0.0, wait - queue_s - step_s - load_s)
        return Estimate(rate.overhead_s, queue_s, step_s, load_s, prefill_s,
                        self.pressure.seconds(worker, ours, blocks_known), queued, prefill, rank, blocks_s,
                        load_s / self.load.scale, self.busy.seconds(hits, queue_s, prefill_s))

    def decode_step_s(self, cache: str) -> float:
        """The time between a decoding request's tokens on the engine: the mean step its relayed streams show
        (`StepClock.mean_s`, without the steps that computed a prefill the gateway sent: counting those made the
        predicted wait for blocks on the pinned fleet 0.36 s longer than the engines' at the median, against
        0.15 s), `ttft_decode_step_s` before they show one."""
        steps = self.steps.get(cache)
        return steps.mean_s if steps is not None and steps.mean_s > 0 else self.ttft_options.ttft_decode_step_s

    def step_rest(self, url: str, rank: int | None, now: float) -> float:
        """The expected rest of the engine step in progress on the worker (its data-parallel rank), for an engine
        that is decoding; 0 while its steps are not known."""
        steps = self.steps.get(cache_name(url, rank))
        return steps.rest(now) if steps is not None else 0.0

    def _soonest_rank(self, worker: Worker, now: float, rate: PrefillRate) -> int:
        """Of a data-parallel engine's ranks, the one a request holding nothing there starts soonest on: the
        prefill queued there or the rest of its step in progress (while the gateway's requests decode there),
        whichever is longer; then the one with the fewest of the gateway's requests, then the lowest."""
        url = worker.url

        def wait(rank: int) -> tuple[float, int, int]:
            cache = cache_name(url, rank)
            rest = self.step_rest(url, rank, now) if self._rank_decoding.get(cache, 0) > 0 else 0.0
            return max(rest, rate.seconds(self.queue(cache).ahead(now, rate))), self._rank_in_flight.get(cache, 0), rank

        return min(range(worker.spec.dp_ranks), key=wait)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        self._ranks.clear()
        self._turned.clear()
        now = self.now
        for worker in workers:
            self.learn_from_engine(worker)
        keys = request.block_keys
        bs = self.balance.block_size
        prompt = max(request.prompt_tokens, len(keys) * bs)
        cacheable = ((prompt - 1) // bs) * bs if prompt > 0 else 0
        held = self.holdings(keys, workers, cacheable)
        most = max(h.tokens for h in held)
        estimates = [self.estimate(w, prompt, h, now) for w, h in zip(workers, held, strict=True)]
        over = self.share.over([w.url for w in workers])
        if all(over):
            over = [False] * len(workers)
        holders = [i for i, h in enumerate(held) if h.tokens == most] if most > 0 else []
        if holders and all(held[i].computed < most for i in holders):
            # the prefix is still being computed where it was sent (only requests in flight put it there): another
            # copy now computes it twice at once and takes cache space; the balance has nothing to spread yet (its
            # holders may be at their caps only because a burst's first few requests cannot spread evenly), so
            # the request waits for that prefill unless the queue there outweighs recomputing it plus the copy
            for i in holders:
                over[i] = False
        # a prefix whose every holder is at its cap has more traffic than they can take: one more copy is what the
        # balance needs, not a cost
        spread = bool(holders) and not all(over[i] for i in holders)
        price = self.balance_s
        gpu_most = max(h.by_tier.get(GPU, 0) for h in held)
        scores = [e.choice_s + (self.spread.seconds(h.tokens, most, self.rate(w.url), e.load_s,
                                                    h.by_tier.get(GPU, 0), gpu_most) if spread else 0.0)
                  + (price if o else 0.0) + e.busy_s
                  for w, h, e, o in zip(workers, held, estimates, over, strict=True)]
        if self.held_up.weight > 0 and most == 0:
            # a request no worker holds any of (a first read) can be placed anywhere; one that some worker holds
            # trades its hit against a copy, which the spread cost and the balance already price (counted for those
            # too, RAG at 8 replicas: p90 31 -> 46 ms, request imbalance 1.11 -> 1.18)
            fastest = min(e.choice_s for e in estimates)
            scores = [s + self.held_up.seconds(self.queue(cache_name(w.url, e.rank)).expected(now), e.prefill,
                                               self.rate(w.url), fastest)
                      for s, w, e in zip(scores, workers, estimates, strict=True)]
        best = min(scores)
        # within the prediction's own error the workers are as good: the least busy, then the one holding the
        # least prefix state takes it (misses spread, instead of all going to the worker whose fit is a hair
        # faster)
        # and, unless the best is at its balance cap, of the workers holding as much of this prompt as it does: the
        # band is no reason to give up a hit (a copy scored within it of a holder that has room is no tie)
        first = scores.index(best)
        band = best + max(self.tie_s, self.tie_share * best)
        tied = [i for i, s in enumerate(scores)
                if s <= band and (over[first] or held[i].tokens == held[first].tokens)]
        if len(tied) > 1:
            fewest = min(workers[i].outstanding for i in tied)
            tied = [i for i in tied if workers[i].outstanding == fewest]
        if len(tied) > 1:
            least_state = min(self.balance.trie.worker_nodes(workers[i].url) for i in tied)
            tied = [i for i in tied if self.balance.trie.worker_nodes(workers[i].url) == least_state]
        pick = tied[0] if len(tied) == 1 else self.balance.random.choice(tied)
        worker, estimate, cached = workers[pick], estimates[pick], held[pick].tokens
        rank = estimate.rank
        reason = MISS if most == 0 else HIT if cached >= most else SPILL
        serialize = 0 < self.serialize_tokens <= prompt - cached
        prefill = estimate.prefill
        placement = Placement(worker.url, rank, keys if isinstance(keys, list) else list(keys), prompt, cached,
                              len(workers), request.stream, request.max_tokens, prefill.tokens, prefill.attention,
                              estimate.prefill_s, estimate.ttft_s, estimate.load_s, serialize,
                              (worker.kv_block_size or self.balance.block_size) if worker.kv_blocks > 1 else 0)
        self._place(id(request), placement, now, prefill, request.stream)
        self._routed[id(request)] = _Routed(worker.url, estimate, cache_name(worker.url, rank))
        self._mean = self._mean + (prefill + self._mean.scaled(-1.0)).scaled(1 / 64)
        self.balance.record(prompt, cached)
        return Decision(worker, reason, cached, rank, estimate.ttft_s, serialize, placement)

    def sibling_routed(self, key: int, placement: Placement) -> None:
        # its tokens are not relayed here: its ledger entry's generation is reckoned from its time decoding, as a
        # whole answer's is (`BlockLedger.wait`)
        self._place(key, placement, self.now, Work(placement.prefill_tokens, placement.prefill_attention), False)

    def _place(self, key: int, p: Placement, now: float, prefill: Work, relayed: bool) -> None:
        """A request in flight on its engine (this process's choice, or a sibling's): its prefill queued there,
        its blocks held there, its share of recent requests, its prefix remembered and its blocks pending there."""
        cache = cache_name(p.worker, p.rank)
        self.queue(cache).add(key, prefill, now, p.ttft_s, p.stream, p.load_s, p.serialize)
        if p.ledger_block_size:
            self.ledger(cache, p.ledger_block_size).add(key, _Holder(
                p.prompt, p.max_tokens, self.output.expected(p.max_tokens), p.prefill_s, now, p.ttft_s, relayed))
        self.share.add(p.worker, p.candidates)
        if p.cached > 0:
            self.busy.hit(p.worker, now)
        if p.rank is not None:
            self._rank_in_flight[cache] = self._rank_in_flight.get(cache, 0) + 1
        if p.keys:
            self.balance.remember(p.keys, p.worker)
            self.pending.add(cache, p.keys)

    def learn_from_engine(self, worker: Worker) -> None:
        """A sample from the worker's engine metrics, when a window of them is complete (`EngineTimings`)."""
        sample = self.timings.sample(worker)
        if sample is not None:
            for rate in (self.own_rate(worker.url), self.fleet_rate):
                rate.learn(sample.work, sample.seconds, weight=sample.requests)
            if self._ttft_metrics is not None:
                self._ttft_metrics.engine_samples.labels(worker.url).inc(sample.requests)

    def on_first_token(self, request: RouteRequest, decision: Decision, ttft_s: float) -> None:
        self._first_token(id(request), cache_name(decision.worker.url, decision.dp_rank), decision.dp_rank is not None)
        routed = self._routed.pop(id(request), None)
        if routed is None:
            return
        e = routed.estimate
        # the observed time less the parts that are not the worker's prefill: what its prefill model must explain,
        # at most OUTLIER_RATIO times what the fit predicts for it (a stalled gateway, not the worker)
        observed = ttft_s - e.load_s - e.step_s - e.pressure_s - e.blocks_s
        for rate in (self.own_rate(routed.worker), self.fleet_rate):
            rate.learn(e.queued + e.prefill, min(observed, OUTLIER_RATIO * rate.predict(e.queued + e.prefill)))
        # what its loads took: its first token less the rest of its prediction
        self.load.learn(e.link_s, ttft_s - (e.ttft_s - e.load_s))
        rate = self.rate(routed.worker)
        metrics = self._ttft_metrics
        if metrics is not None:
            if ttft_s > 0:
                metrics.error.observe((e.ttft_s - ttft_s) / ttft_s)
            metrics.rate.labels(routed.worker).set(rate.tokens_per_s)
            metrics.overhead.labels(routed.worker).set(rate.overhead_s)

    def sibling_first_token(self, key: int, placement: Placement) -> None:
        self._first_token(key, cache_name(placement.worker, placement.rank), placement.rank is not None)

    def _first_token(self, key: int, cache: str, data_parallel: bool) -> None:
        """A request's first token came (this process's, or a sibling's): it decodes now, its prefill is done."""
        if data_parallel:  # it decodes on that rank now
            self._decoding_on[key] = cache
            self._rank_decoding[cache] = self._rank_decoding.get(cache, 0) + 1
        queue = self.queues.get(cache)
        if queue is not None:
            queue.done(key, self.now)
        ledger = self.ledgers.get(cache)
        if ledger is not None:
            ledger.first_token(key)

    def on_chunk(self, request: RouteRequest, decision: Decision, first: bool, tokens: int = 1) -> None:
        # a data-parallel engine's ranks step each on their own: a clock per rank (the decision names it)
        # (called for every event relayed: kept to a few lookups, the clock read once)
        rank = decision.dp_rank
        cache = decision.worker.url if rank is None else cache_name(decision.worker.url, rank)
        if tokens:
            ledger = self.ledgers.get(cache)
            if ledger is not None:
                ledger.chunk(id(request), tokens)  # tokens more in its blocks
        if self.step_phase:
            steps = self.steps.get(cache) or self._step_clock(cache)
            steps.chunk(id(request), self.balance.clock(), first)

    def _step_clock(self, cache: str) -> StepClock:
        steps = self.steps[cache] = StepClock(self.ttft_options.ttft_step_jitter_s,
                                              prefilling=self.queue(cache).prefilling_held)
        if self._ttft_metrics is not None:  # read when scraped
            self._ttft_metrics.step.labels(cache).set_function(lambda: steps.mean_s)
        return steps

    def request_ended(self, request: RouteRequest, decision: Decision) -> None:
        holder = self._end(id(request), cache_name(decision.worker.url, decision.dp_rank), decision.dp_rank is not None)
        if holder is not None and holder.stream and holder.started:
            self.output.learn(holder.max_tokens, holder.generated)
        self._routed.pop(id(request), None)

    def sibling_request_ended(self, key: int, placement: Placement) -> None:
        self._end(key, cache_name(placement.worker, placement.rank), placement.rank is not None)

    def _end(self, key: int, cache: str, data_parallel: bool) -> _Holder | None:
        """A request ended (this process's, or a sibling's): nothing of it is in flight on its engine any more
        (its pending blocks stay for the grace: `on_finished`); its entry in the engine's ledger."""
        now = self.now
        ledger = self.ledgers.get(cache)
        holder = ledger.end(key, now) if ledger is not None else None
        queue = self.queues.get(cache)
        if queue is not None:
            queue.done(key, now)
        if data_parallel:
            if cache in self._rank_in_flight:
                self._rank_in_flight[cache] = max(0, self._rank_in_flight[cache] - 1)
            decoded_on = self._decoding_on.pop(key, None)
            if decoded_on is not None and decoded_on in self._rank_decoding:
                self._rank_decoding[decoded_on] = max(0, self._rank_decoding[decoded_on] - 1)
        return holder

    def forget_worker(self, url: str) -> None:
        super().forget_worker(url)
        self.rates.pop(url, None)
        for cache in [c for c in self.queues if c == url or c.startswith(url + "#dp")]:
            del self.queues[cache]
        for cache in [c for c in self.ledgers if c == url or c.startswith(url + "#dp")]:
            del self.ledgers[cache]
        for cache in [c for c in self.steps if c == url or c.startswith(url + "#dp")]:
            del self.steps[cache]
            if self._ttft_metrics is not None:
                self._ttft_metrics.step.remove(cache)
        for counts in (self._rank_in_flight, self._rank_decoding):
            for cache in [c for c in counts if c.startswith(url + "#dp")]:
                del counts[cache]
        self._decoding_on = {k: c for k, c in self._decoding_on.items() if not c.startswith(url + "#dp")}
        self.share.forget(url)
        self.busy.forget(url)
        self.timings.forget(url)
        self._routed = {k: r for k, r in self._routed.items() if r.worker != url}
