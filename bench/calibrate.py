"""`kvgate bench calibrate`: fit the simulator's time model to a recorded trace's own timings, so `vsim` and
`plan` predict the fleet that was recorded rather than a datasheet.

A trace the gateway recorded (`kvgate serve --record-trace`) says, per request, which worker answered, when the
first byte and the last byte came, how long the prompt was, how much of it the engine had cached and how many
tokens it generated. The fit uses the requests that had their worker to themselves (no other request of the
trace on that worker while they ran), so their time is their own work and no queue:

- time to first byte = the profile's prefill of the uncached tokens after the cached ones (in chunks of
  `max_num_batched_tokens`, a step overhead each) + a constant per request that the simulator does not model
  (HTTP, tokenization): fits `mfu` (how fast prefill computes);
- (last byte - first byte) / (tokens - 1) = one decode step at that context (a step overhead + reading the
  weights and the context): fits `bandwidth_efficiency` and, with the TTFTs, `step_overhead_s`.

Each is a grid search for the smallest mean relative error, coarse then fine. The result is the base profile with
those numbers replaced and the constant as its `request_overhead_s` (which vsim adds to every TTFT), as JSON
(`--profile FILE` of vsim and plan), with the fit's errors, and the prefill rate and decode time per token it
implies; and the `ttft` strategy's settings for that fleet (`ttft_options`: the prefill rate and overhead it
starts from before it learns them, KV bytes per token, decode cost).

    kvgate bench calibrate --trace trace.jsonl --profile llama-3.1-8b-h100 --out out/profile.json
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from bench.sim.perf_model import CALIBRATED_FIELDS, PROFILES, Profile
from bench.traces import Trace, TraceError, TraceRecord

MIN_SAMPLES = 5


@dataclass(frozen=True)
class Sample:
    uncached: int
    cached: int
    output: int
    ttfb_s: float
    decode_s: float | None  # per generated token after the first, when the request ran alone to its end


def alone(records: Sequence[TraceRecord]) -> tuple[list[Sample], int]:
    """The samples of requests that had their worker to themselves until their first byte (decode: until their
    last), and how many answered requests with timings there were in all."""
    timed = [r for r in records if r.status == 200 and r.ttfb_ms is not None and r.duration_ms is not None]
    by_worker: dict[str | None, list[TraceRecord]] = {}
    for r in timed:
        by_worker.setdefault(r.worker, []).append(r)
    samples = []
    for group in by_worker.values():
        spans = [(r.timestamp, r.timestamp + (r.duration_ms or 0.0)) for r in group]
        for i, r in enumerate(group):
            start, end = spans[i]
            first = start + (r.ttfb_ms or 0.0)
            others = [s for j, s in enumerate(spans) if j != i and s[0] < end and s[1] > start]
            if any(s[0] < first and s[1] > start for s in others):
                continue  # shared its worker before its first byte: its TTFT holds someone else's work
            cached = min(r.cached_tokens if r.cached_tokens is not None else 0, r.input_length - 1)
            decode = None
            if not others and r.output_length >= 2:
                decode = ((r.duration_ms or 0.0) - (r.ttfb_ms or 0.0)) / 1000 / (r.output_length - 1)
            samples.append(Sample(r.input_length - cached, cached, r.output_length, (r.ttfb_ms or 0.0) / 1000, decode))
    return samples, len(timed)


def _search(error: Callable[[float], float], start: float, span: float = 256.0, steps: int = 64) -> float:
    """The value in [start / span, start * span] (log scale) with the smallest error, refined twice."""
    best = start
    for _ in range(3):
        grid = [best * span ** (2 * k / steps - 1) for k in range(steps + 1)]
        best = min(grid, key=error)
        span = span ** (4 / steps)
    return best


def _relative(pairs: Sequence[tuple[float, float]]) -> float:
    return sum(abs(p - o) / o for p, o in pairs if o > 0) / max(1, len(pairs))


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else 0.0


def fit(base: Profile, samples: Sequence[Sample]) -> tuple[Profile, dict[str, Any]]:
    """The profile whose prefill and decode times best match the samples (see the module's docstring), and the
    fit's report. Time to first byte also holds a constant the simulator does not model (the gateway's and the
    engine's HTTP, tokenization): it is fitted too, as the median of what the model leaves over, and reported."""
    if len(samples) < MIN_SAMPLES:
        raise ValueError(f"{len(samples)} requests ran alone on their worker; the fit needs at least {MIN_SAMPLES} "
                         f"(record a trace at a lower load, or a longer one)")
    decodes = [s for s in samples if s.decode_s is not None]
    use_decode = len(decodes) >= MIN_SAMPLES

    def ttft_fit(profile: Profile) -> tuple[float, float]:
        """(mean relative error, the constant) of the TTFTs for this profile (its own constant left out)."""
        model = [profile.prefill_time(s.uncached, s.cached) for s in samples]
        constant = max(0.0, _median([s.ttfb_s - m for s, m in zip(samples, model, strict=True)]))
        return _relative([(m + constant, s.ttfb_s) for s, m in zip(samples, model, strict=True)]), constant

    def decode_error(profile: Profile) -> float:
        return _relative([(profile.decode_step_time(1, s.uncached + s.cached + s.output // 2), s.decode_s or 0.0)
                          for s in decodes])

    # the step overhead is told apart from the constant by the decode steps (one overhead each); without them
    # it stays the base profile's
    overheads = sorted({base.step_overhead_s, 0.0, *(1e-4 * 1.5 ** k for k in range(22))}) if use_decode else [
        base.step_overhead_s]
    best: tuple[float, Profile] | None = None
    for overhead in overheads:
        profile = dataclasses.replace(base, step_overhead_s=overhead)

        def at_efficiency(efficiency: float, p: Profile = profile) -> float:
            return decode_error(dataclasses.replace(p, bandwidth_efficiency=efficiency))

        if use_decode:
            profile = dataclasses.replace(profile, bandwidth_efficiency=_search(at_efficiency,
                                                                                base.bandwidth_efficiency))

        def at_mfu(mfu: float, p: Profile = profile) -> float:
            return ttft_fit(dataclasses.replace(p, mfu=mfu))[0]

        profile = dataclasses.replace(profile, mfu=_search(at_mfu, base.mfu))
        error = ttft_fit(profile)[0] + (decode_error(profile) if use_decode else 0.0)
        if best is None or error < best[0]:
            best = (error, profile)
    assert best is not None
    ttft_error, constant = ttft_fit(best[1])
    profile = dataclasses.replace(best[1], request_overhead_s=constant)
    report = {"prefill_samples": len(samples), "ttft_mean_relative_error": ttft_error,
              "decode_samples": len(decodes), "decode_mean_relative_error": decode_error(profile) if use_decode
              else None, "unmodelled_ttft_s": constant,
              "prefill_tokens_per_s": 8192 / (profile.prefill_time(8192) - profile.step_overhead_s),
              "decode_ms_per_token": profile.decode_step_time(1, 1024) * 1e3}
    return profile, report


TTFT_CONTEXT_TOKENS = 2048  # a typical decoding request's context, for the decode cost the `ttft` strategy sees


def ttft_options(profile: Profile) -> dict[str, float]:
    """The `ttft` strategy's settings for a fleet of this profile: the prefill time it starts from (then
    learns: per request, per token, per token per 1,000 tokens of context), the KV bytes per token its tier
    transfer times use, the first-token delay per request decoding beside it (reading that request's
    context once per step), and the decode step a request's output tokens take before the steps are seen (one
    request decoding a 2,048-token context)."""
    m = profile.model
    rate = profile.peak_flops * profile.mfu
    kv = m.kv_bytes_per_token
    return {"ttft_overhead_s": profile.prefill_time(1) + profile.request_overhead_s,
            "ttft_prefill_tokens_per_s": rate / (2.0 * m.params),
            "ttft_attention_s": 4.0 * m.layers * m.heads * m.head_dim * 1000 / (rate * profile.attention_efficiency),
            "ttft_kv_bytes_per_token": float(kv),
            "ttft_decode_cost_s": TTFT_CONTEXT_TOKENS * kv / (profile.hbm_bytes_per_s * profile.bandwidth_efficiency),
            "ttft_decode_step_s": profile.step_time([(1, TTFT_CONTEXT_TOKENS)]),
            "ttft_step_tokens": float(profile.max_num_batched_tokens)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", required=True, help="a trace recorded by kvgate serve --record-trace")
    parser.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PROFILES),
                        help="the profile whose model, accelerator and engine limits the fit keeps")
    parser.add_argument("--out", default="out/profile.json")


def run(args: argparse.Namespace) -> int:
    base = PROFILES[args.profile]
    try:
        samples, timed = alone(list(Trace(args.trace)))
        if not timed:
            raise TraceError(f"{args.trace}: no request in it has the timings a fit needs (status 200, ttfb_ms, "
                             "duration_ms, worker): a plain Mooncake trace has none; record one with "
                             "`kvgate serve --record-trace`")
        profile, report = fit(base, samples)
    except (TraceError, ValueError) as exc:
        print(f"kvgate bench calibrate: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fitted = {k: getattr(profile, k) for k in CALIBRATED_FIELDS}
    strategy = ttft_options(profile)
    out.write_bytes(orjson.dumps({"base": base.name, **fitted, "trace": str(args.trace), "timed_requests": timed,
                                  "fit": report, "ttft_strategy": strategy}, option=orjson.OPT_INDENT_2))
    print(f"{timed} answered requests with timings, {report['prefill_samples']} alone on their worker "
          f"({report['decode_samples']} to their last token)")
    for key in CALIBRATED_FIELDS:
        print(f"  {key}: {getattr(base, key):.4g} -> {getattr(profile, key):.4g}")
    decode = report["decode_mean_relative_error"]
    print(f"prefill ~{report['prefill_tokens_per_s']:,.0f} tokens/s (8,192-token chunk), decode "
          f"{report['decode_ms_per_token']:.2f} ms per token (batch 1, 1,024 tokens of context), plus "
          f"{report['unmodelled_ttft_s'] * 1e3:.1f} ms per request the simulator does not model; mean error "
          f"{report['ttft_mean_relative_error']:.1%} on TTFT"
          + ("" if decode is None else f", {decode:.1%} on decode") + f"; wrote {out}")
    if decode is None:
        print("  (too few requests ran alone to their end: bandwidth_efficiency kept from the base profile)")
    print("the `ttft` strategy's starting point (kvgate serve flags): "
          + " ".join(f"--{k.replace('_', '-')} {v:.4g}" for k, v in strategy.items()))
    return 0 if math.isfinite(report["ttft_mean_relative_error"]) else 1
