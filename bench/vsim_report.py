"""`kvgate bench vsim`'s report: the time-to-first-token limit of a workload, each row against round_robin and
the limit, a Markdown table and the plot of predicted against simulated TTFT.

The limit is each request's prefill alone on an idle replica (the profile's `prefill_time`, plus its
`request_overhead_s`) with what one unbounded cache would have hit of its prompt (`IdealCache.requests`): no
queue, no eviction, every reusable block on the GPU. No router reaches it; how much of the way from round_robin
to it a strategy goes (`gap_closed`, per percentile) is the figure that can be compared across workloads. Two
more say what the fleet allows: the limit for the arrivals (`causal_limit`: a prefix there only once a prefill
computing it has ended) and the limit with the fleet's own GPU cache (`fleet_cache_limit`: what one cache of all the
replicas' blocks would have hit, under vLLM's LRU and under Belady's MIN), which the unbounded one is out of reach
of when that cache cannot hold the workload's prefixes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.sim.perf_model import Profile
from bench.stats import percentile
from bench.workloads import Arrival, IdealCache, RequestSource
from router.block_keys import BlockKey, block_keys, root_key

PERCENTILES = (50, 90, 99)
# the most full blocks a workload may have for `fleet_cache_limit`, which keeps every prompt's keys and next uses
# and its caches' maps in memory (234 bytes a block at the peak: 157 MB for the README's Mooncake window of 0.7
# million blocks, so about 0.9 GB at this bound; the whole Mooncake trace has about 12 million)
FLEET_CACHE_MAX_BLOCKS = 4_000_000
NEVER = 1 << 62


def ttft_limit(ideal: IdealCache, profile: Profile) -> dict[str, float | None]:
    """TTFT p50 / p90 / p99 (ms) of every request's prefill alone with the ideal single-cache hit."""
    times = [profile.prefill_time(max(1, prompt - hit), hit) + profile.request_overhead_s
             for prompt, hit in ideal.requests]
    return percentiles_ms(times)


def percentiles_ms(times: Sequence[float]) -> dict[str, float | None]:
    return {f"ttft_ms_p{p}": None if (v := percentile(times, p / 100)) is None else v * 1e3 for p in PERCENTILES}


def _leading_run(keys: Sequence[BlockKey], cacheable: int, held: Callable[[BlockKey], bool]) -> int:
    run = 0
    for key in keys[:cacheable]:
        if not held(key):
            break
        run += 1
    return run


def lru_cache_hits(prompts: Iterable[tuple[int, Sequence[BlockKey]]], block_size: int, capacity: int) -> IdealCache:
    """What one cache of `capacity` blocks would have hit, evicting as vLLM does: the block used longest ago first,
    and of one request's blocks its last first (vLLM frees a request's blocks tail first, so that its prefix stays
    longest). The fleet's whole GPU cache as one engine's: what its own eviction keeps of the workload."""
    held: OrderedDict[BlockKey, None] = OrderedDict()
    hits = queries = 0
    each: list[tuple[int, int]] = []
    for tokens, keys in prompts:
        run = _leading_run(keys, (tokens - 1) // block_size if tokens else 0, held.__contains__)
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        while len(held) > capacity:
            held.popitem(last=False)
        queries += tokens
        hits += run * block_size
        each.append((tokens, run * block_size))
    return IdealCache(hits, queries, each)


def min_cache_hits(prompts: Sequence[tuple[int, Sequence[BlockKey]]], block_size: int, capacity: int) -> IdealCache:
    """What one cache of `capacity` blocks would have hit, evicting by Belady's MIN: the block whose next use is
    farthest ahead first (never used again: first of all; of equal ones, the deeper). MIN holds the most blocks at
    their next use that any cache of that size can, whatever it evicts, so no router over replicas holding that
    many blocks in all keeps more of them (a hit here is, as vLLM counts, a prompt's leading run of them)."""
    next_use: list[array[int]] = [array("q") for _ in prompts]
    last: dict[BlockKey, int] = {}
    for i in range(len(prompts) - 1, -1, -1):
        keys = prompts[i][1]
        next_use[i] = array("q", [last.get(key, NEVER) for key in keys])
        for key in keys:
            last[key] = i
    del last
    held: dict[BlockKey, int] = {}  # block -> its next use
    heap: list[tuple[int, int, BlockKey]] = []  # (-next use, -depth, block); entries out of date are skipped
    hits = queries = 0
    each: list[tuple[int, int]] = []
    for i, (tokens, keys) in enumerate(prompts):
        run = _leading_run(keys, (tokens - 1) // block_size if tokens else 0, held.__contains__)
        for depth, (key, nxt) in enumerate(zip(keys, next_use[i], strict=True)):
            held[key] = nxt
            heapq.heappush(heap, (-nxt, -depth, key))
        next_use[i] = array("q")
        while len(held) > capacity:
            nxt, _, key = heapq.heappop(heap)
            if held.get(key) == -nxt:
                del held[key]
        queries += tokens
        hits += run * block_size
        each.append((tokens, run * block_size))
    return IdealCache(hits, queries, each)


def hashed_prompts(source: Iterable[Arrival], block_size: int,
                   most_blocks: int = FLEET_CACHE_MAX_BLOCKS) -> list[tuple[int, list[BlockKey]]] | None:
    """Each request's (prompt tokens, its full blocks' keys), in order; None past `most_blocks` blocks in all."""
    root = root_key("bench")
    prompts: list[tuple[int, list[BlockKey]]] = []
    blocks = 0
    for arrival in source:
        keys = block_keys(arrival.token_ids, block_size, root)
        blocks += len(keys)
        if blocks > most_blocks:
            return None
        prompts.append((len(arrival.token_ids), keys))
    return prompts


def fleet_cache_limit(prompts: Sequence[tuple[int, Sequence[BlockKey]]], block_size: int,
                      capacities: Mapping[str, int], profile: Profile) -> dict[str, Any]:
    """`ttft_limit` with what one cache of the fleet's GPU blocks would have hit instead of an unbounded one, for
    each fleet of `capacities` (its name -> its blocks, all replicas together): under LRU (`lru_cache_hits`) and
    under MIN (`min_cache_hits`), each with its hit rate. Where the fleet's cache cannot hold the workload's
    prefixes, the unbounded limit is out of every router's reach, and this one says how far. (MIN keeps the most
    blocks, not the ones a percentile needs most: its p90 is a reference, not a bound.)"""
    out: dict[str, Any] = {}
    for fleet, capacity in capacities.items():
        row: dict[str, Any] = {"blocks": capacity}
        for name, cache in (("lru", lru_cache_hits(prompts, block_size, capacity)),
                            ("min", min_cache_hits(prompts, block_size, capacity))):
            row[name] = {"hit_rate": cache.hit_rate, **ttft_limit(cache, profile)}
        out[fleet] = row
    return out


def describe_fleet_cache(limits: dict[str, Any]) -> str:
    """`fleet_cache_limit`'s result in a line."""
    if "skipped" in limits:
        return f"limit with the fleet's GPU cache: not computed ({limits['skipped']})"
    parts = [f"{fleet} replicas ({row['blocks']:,} blocks): " + ", ".join(
        f"{name.upper()} hit {row[name]['hit_rate']:.3f} p50 {row[name]['ttft_ms_p50'] or 0:.0f} "
        f"p90 {row[name]['ttft_ms_p90'] or 0:.0f}" for name in ("lru", "min")) for fleet, row in limits.items()]
    return "limit with the fleet's GPU cache as one (ms): " + "; ".join(parts)


class OutOfOrder(ValueError):
    """A request that came before one already taken."""


class CausalCache:
    """The one unbounded cache of `causal_ttfts`, taking requests one at a time in the order they came."""

    def __init__(self, block_size: int, profile: Profile) -> None:
        self.block_size = block_size
        self.profile = profile
        self.ready: dict[BlockKey, float] = {}  # block -> when a prefill's step computing it first ended
        self.last = -math.inf

    def first_token(self, tokens: int, keys: Sequence[BlockKey], came: float) -> float:
        """Seconds from `came` to the first token of a prompt of `tokens` whose full blocks' keys are `keys`; its
        blocks are there for later requests from the end of the step computing each. `came` never goes back."""
        if came < self.last:
            raise OutOfOrder(f"a request that came at {came} s after one that came at {self.last} s")
        self.last = came
        profile, size, ready = self.profile, self.block_size, self.ready
        cacheable = (tokens - 1) // size if tokens else 0
        options = {came: 0}  # when -> the leading blocks all there by then (the latest of their times)
        latest = came
        for j, key in enumerate(keys[:cacheable]):
            at = ready.get(key)
            if at is None:
                break
            latest = max(latest, at)
            options[latest] = j + 1
        start, hit = min(options.items(), key=lambda o: o[0] + profile.prefill_time(tokens - o[1] * size,
                                                                                     o[1] * size))
        done = hit * size
        clock = start
        while done < tokens:  # its own prefill, a chunk a step; the blocks each step completes are there after it
            chunk = min(tokens - done, profile.max_num_batched_tokens)
            clock += profile.step_time([(chunk, done)])
            for j in range(done // size, min(len(keys), (done + chunk) // size)):
                if ready.get(keys[j], math.inf) > clock:
                    ready[keys[j]] = clock
            done += chunk
        if clock == start:  # nothing to compute (an empty prompt): the one step that makes the first token
            clock += profile.step_time([(1, done)])
        return clock - came + profile.request_overhead_s


def causal_ttfts(prompts: Sequence[tuple[int, Sequence[BlockKey]]], starts: Sequence[float], block_size: int,
                 profile: Profile) -> list[float]:
    """Each request's time to first token (s) had it come when it did (`starts`, s) to a fleet of idle replicas, as
    many as it needs, sharing one unbounded cache. A prompt is (its tokens, the keys of its full blocks). A block
    is there once a prefill that computes it has finished the step that computed it (vLLM caches a chunk's full
    blocks after its step; chunks of the profile's `max_num_batched_tokens`), and a request either prefills at once
    with the leading blocks there when it comes, or waits for leading blocks still being computed and prefills the
    rest then, whichever brings its first token sooner (`request_overhead_s` added, after the prefill).

    Where `ttft_limit` takes every block seen before a request as there, this one waits for a prefix whose first
    prefill is still running: with the client's own send times, a bound no router reaches on the same fleet model,
    the prefix of a burst's first request computed once and every other request's wait for it counted. (A request
    that came later never helps one before it: whatever it computes, the earlier one could have computed itself
    from the same blocks, sooner.)"""
    cache = CausalCache(block_size, profile)
    out = [0.0] * len(prompts)
    for i in sorted(range(len(prompts)), key=starts.__getitem__):
        out[i] = cache.first_token(prompts[i][0], prompts[i][1], starts[i])
    return out


BURST_MOST = 1024  # requests of the opening that `opening_burst_floor` looks at (it costs their square)


def opening_burst_floor(prompts: Sequence[tuple[int, Sequence[BlockKey]]], starts: Sequence[float],
                        block_size: int, profile: Profile, replicas: int, split: bool = False) -> list[float]:
    """Lower bounds (s) on the largest times to first token of a fleet of `replicas` replicas that starts empty
    and idle: item m-1 bounds the m-th largest. What `causal_ttfts` leaves out, as it gives every request a
    replica of its own: a burst of prompts that share nothing, sent at once, queues on a few replicas.

    The requests sent first are grouped by their first block (chained keys: prompts that part there share no
    block). Each group's first tokens wait for the blocks all its members share to be computed, on some replica,
    which takes `prefill_compute_time` of them however batched; the step overhead comes once. A replica completes
    such prefixes one after another, so its i-th is done no sooner than the i smallest of all prefixes' compute
    after the start; the fleet's j-th no sooner than the ceil(j / replicas) smallest. With `split` (tiers that move
    KV between replicas, so a prefix could be computed partly on one and finished on another) only the fleet's
    total is bounded: the j-th no sooner than the j smallest over `replicas`, nor than the j-th smallest alone.
    Groups of fewest requests take the latest places, and each request's send after the first counts off its
    wait. Taken over the first k requests sent, every k up to BURST_MOST; each bound holds on its own, so the
    largest is kept. In the profile's time model (the simulated replicas' own), `request_overhead_s` added."""
    order = sorted((i for i in range(len(prompts)) if prompts[i][1]), key=starts.__getitem__)[:BURST_MOST]
    if not order or replicas < 1:
        return []
    t0 = starts[order[0]]
    overhead = profile.step_overhead_s
    # first block -> [blocks all members share, their compute time, members, the first member's keys]
    groups: dict[BlockKey, list[Any]] = {}
    best: list[float] = []
    for k, i in enumerate(order, start=1):
        keys = prompts[i][1]
        group = groups.get(keys[0])
        if group is None:
            groups[keys[0]] = [len(keys), profile.prefill_compute_time(len(keys) * block_size), 1, keys]
        else:
            shared, first = min(group[0], len(keys)), group[3]
            while keys[shared - 1] != first[shared - 1]:  # (chained: equal there, equal before)
                shared -= 1
            if shared != group[0]:
                group[0], group[1] = shared, profile.prefill_compute_time(shared * block_size)
            group[2] += 1
        works = sorted(g[1] for g in groups.values())
        sizes = sorted(g[2] for g in groups.values())
        sums = list(itertools.accumulate(works))  # sums[j - 1]: the j smallest together
        # the fleet's j-th prefix done no sooner than done[j - 1] after the start
        done = ([overhead + max(work, total / replicas) for work, total in zip(works, sums, strict=True)] if split
                else [overhead + sums[-(-j // replicas) - 1] for j in range(1, len(works) + 1)])
        off = starts[i] - t0 - profile.request_overhead_s  # the latest send so far counted off every member's wait
        members = 0
        for t, size in enumerate(sizes):  # the t+1 smallest groups in the latest t+1 places
            floor = done[len(done) - 1 - t] - off
            for m in range(members, min(members + size, k)):
                if m == len(best):
                    best.append(floor)
                elif floor > best[m]:
                    best[m] = floor
            members += size
    return [max(0.0, b) for b in best]


def fleet_ttfts(causal: Sequence[float], floor: Sequence[float]) -> list[float]:
    """`causal_ttfts`' times sorted, each of the largest raised to `opening_burst_floor`'s (its m-th item bounds the
    m-th largest): a lower bound on each order statistic of the TTFTs on such a fleet, so on each percentile."""
    times = sorted(causal)
    for m, least in enumerate(floor, start=1):
        times[-m] = max(times[-m], least)
    for j in range(1, len(times)):  # the m-th largest bounded, so is every larger one
        times[j] = max(times[j], times[j - 1])
    return times


def causal_limit(source: RequestSource, block_size: int, profile: Profile) -> dict[str, float | None] | None:
    """TTFT p50 / p90 / p99 (ms) of `causal_ttfts` over a replay's requests at their arrival times; None when the
    replay paces them (a closed loop: when each comes depends on the fleet). Read as a stream, each prompt hashed
    and dropped (a trace in arrival order; read again, whole, if it is not)."""
    root = root_key("bench")
    cache = CausalCache(block_size, profile)
    times: list[float] = []
    try:
        for arrival in source:
            if arrival.at is None:
                return None
            keys = block_keys(arrival.token_ids, block_size, root)
            times.append(cache.first_token(len(arrival.token_ids), keys, arrival.at))
    except OutOfOrder:
        arrivals = [(a.at or 0.0, len(a.token_ids), block_keys(a.token_ids, block_size, root)) for a in source]
        times = causal_ttfts([(n, keys) for _, n, keys in arrivals], [at for at, _, _ in arrivals], block_size,
                             profile)
    return percentiles_ms(times)


def add_gaps(results: list[dict[str, Any]], limit: dict[str, float | None]) -> None:
    """Each row's speedup over round_robin of the same fleet (replicas, tiers) and the share of the gap from
    round_robin to the limit it closes, per percentile (in place)."""
    baseline = {(r["replicas"], r["tiers"]): r for r in results if r["strategy"] == "round_robin"}
    for row in results:
        rr = baseline.get((row["replicas"], row["tiers"]))
        if rr is None:
            continue
        speedup: dict[str, float | None] = {}
        closed: dict[str, float | None] = {}
        for p in PERCENTILES:
            key = f"ttft_ms_p{p}"
            mine, base, best = row.get(key), rr.get(key), limit.get(key)
            speedup[f"p{p}"] = base / mine if mine and base else None
            closed[f"p{p}"] = (base - mine) / (base - best) if (
                mine is not None and base is not None and best is not None and base > best) else None
        row["ttft_speedup_over_round_robin"] = speedup
        row["ttft_gap_closed"] = closed


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(report: dict[str, Any]) -> list[str]:
    """The Markdown table: a row per configuration, then the limit."""
    limit = report["ttft_limit"]
    lines = ["| replicas | tiers | strategy | hit rate (of bound) | TTFT p50 / p90 ms | "
             "speedup over round_robin p50 / p90 | gap closed p50 / p90 | first step after p50 / p90 ms (step in "
             "progress p50) | req imbalance | prediction error (median) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    bound = report["upper_bound"]
    for r in report["results"]:
        s, g = r.get("ttft_speedup_over_round_robin", {}), r.get("ttft_gap_closed", {})
        pred = r.get("ttft_prediction", {}).get("median_abs_relative_error")
        lines.append(
            f"| {r['replicas']} | {'on' if r['tiers'] else 'off'} | {r['strategy']} | {r['hit_rate']:.3f} "
            f"({_f(r['hit_rate'] / bound if bound else None, '{:.0%}')}) | {_f(r['ttft_ms_p50'], '{:.0f}')} / "
            f"{_f(r['ttft_ms_p90'], '{:.0f}')} | {_f(s.get('p50'), '{:.2f}')} / {_f(s.get('p90'), '{:.2f}')} | "
            f"{_f(g.get('p50'), '{:.0%}')} / {_f(g.get('p90'), '{:.0%}')} | {_f(r.get('wait_ms_p50'), '{:.1f}')} / "
            f"{_f(r.get('wait_ms_p90'), '{:.1f}')} ({_f(r.get('step_wait_ms_p50'), '{:.1f}')}) | "
            f"{_f(r['request_imbalance'], '{:.2f}')} | "
            f"{_f(pred, '{:.1%}')} |")
    lines.append(f"| | | **limit** | {bound:.3f} (100%) | {_f(limit['ttft_ms_p50'], '{:.0f}')} / "
                 f"{_f(limit['ttft_ms_p90'], '{:.0f}')} | | 100% / 100% | 0 / 0 | | |")
    causal = report.get("ttft_limit_causal")
    if causal:
        lines.append(f"| | | **limit for the arrivals** | | {_f(causal['ttft_ms_p50'], '{:.0f}')} / "
                     f"{_f(causal['ttft_ms_p90'], '{:.0f}')} | | | | | |")
    fleet_cache = report.get("ttft_limit_fleet_cache") or {}
    for fleet, row in fleet_cache.items():
        if fleet == "skipped":
            continue
        for name in ("lru", "min"):
            lim = row[name]
            lines.append(f"| {fleet} | off | **limit, the fleet's GPU cache as one ({name.upper()})** | "
                         f"{lim['hit_rate']:.3f} ({_f(lim['hit_rate'] / bound if bound else None, '{:.0%}')}) | "
                         f"{_f(lim['ttft_ms_p50'], '{:.0f}')} / {_f(lim['ttft_ms_p90'], '{:.0f}')} | | | | | |")
    return lines


def write_markdown(report: dict[str, Any], path: Path) -> None:
    w = report["workload"]
    lines = [f"# kvgate bench vsim — {w['name']}", "", f"Command: `{report.get('command', '')}`  ",
             f"Workload parameters: `{w['params']}`; profile `{report['profile']}`. TTFT in model time. *limit*: "
             "each request's prefill alone with the ideal single-cache hit (bench/vsim_report.py); *limit for the "
             "arrivals*: the same with a prefix there only once a prefill computing it has (a request may wait for "
             "one still running; `causal_ttfts`); *limit, the fleet's GPU cache as one*: the same with what one "
             "cache of all the replicas' GPU blocks would have hit, evicting as vLLM does (LRU) or by Belady's MIN "
             "(the most blocks any eviction keeps for their next use: `fleet_cache_limit`). *gap closed*: "
             "(round_robin - strategy) / (round_robin - limit). *first step after*: arrival to the request's first "
             "engine step (tier loads, requests ahead, and the step in progress when it was admitted: a busy engine "
             "takes a new request at its next step, which the limit's idle replica does not make it wait for).", "",
             *table(report), "",
             f"![predicted vs simulated TTFT]({report['prediction_plot']})" if report.get("prediction_plot")
             else "", ""]
    path.write_text("\n".join(lines))


def prediction_summary(pairs: list[tuple[float, float]], most: int = 4000) -> dict[str, Any]:
    """Predicted against observed TTFT (seconds): the median relative error and at most `most` of the pairs."""
    signed = sorted((p - o) / o for p, o in pairs if o > 0)
    errors = sorted(abs(e) for e in signed)
    step = max(1, -(-len(pairs) // most))
    return {"median_abs_relative_error": errors[len(errors) // 2] if errors else None,
            "median_signed_relative_error": signed[len(signed) // 2] if signed else None, "pairs": pairs[::step]}


def write_prediction_plot(report: dict[str, Any], path: Path) -> bool:
    """Predicted TTFT on the chosen worker against the simulated one, a panel per configuration that predicts;
    False when none does."""
    rows = [r for r in report["results"] if r.get("ttft_prediction", {}).get("pairs")]
    if not rows:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(4, len(rows))
    nrows = -(-len(rows) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 4 * nrows), squeeze=False)
    for ax, row in zip(axes.flat, rows, strict=False):
        pairs = row["ttft_prediction"]["pairs"]
        predicted = [max(p * 1e3, 0.1) for p, _ in pairs]
        observed = [max(o * 1e3, 0.1) for _, o in pairs]
        ax.scatter(observed, predicted, s=3, alpha=0.4)
        low, high = min(observed + predicted), max(observed + predicted)
        ax.plot([low, high], [low, high], color="tab:red", linewidth=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(row.get("observed_label", "simulated TTFT (ms)"))
        ax.set_ylabel("predicted TTFT (ms)")
        error = row["ttft_prediction"]["median_abs_relative_error"]
        title = row.get("title") or (
            f"{row['replicas']} replicas, tiers {'on' if row['tiers'] else 'off'}, {row['strategy']}")
        ax.set_title(f"{title}\n{len(pairs)} requests, median error {_f(error, '{:.1%}')}", fontsize=9)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(rows):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
