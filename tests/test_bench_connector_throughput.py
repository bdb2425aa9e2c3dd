"""bench/connector_throughput.py's method: ABBA order, pairs within a half-cycle, the bootstrap interval, the speed
modes (the servers themselves are run by the bench, not here: minutes of vLLM)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from bench.connector_throughput import (
    CONNECTORS,
    VARIANTS,
    bootstrap_median_ci,
    model_summary,
    paired_ratios,
    parse_mode,
    round_order,
    summarize,
    thread_deltas,
    thread_stats,
)
from bench.make_model import LLAMA_3_1_8B, forward_costs


def rows_of(seconds: list[float], modes: list[str], cycles: int) -> list[dict[str, Any]]:
    order = round_order(modes, cycles)
    assert len(order) == len(seconds)
    return [{"round": i, "half": i // (1 + len(modes)), "connector": name, "requests": 16, "load_1m": 1.0 + i,
             "seconds": s, "tokens_per_s": 16_000 / s, "cpu_ms_per_request": 50.0, "agent_cpu_ms_per_request": 2.0,
             "transfer_cpu_ms_per_request": 1.0} for i, (name, s) in enumerate(zip(order, seconds, strict=True))]


def test_rounds_run_abba_so_a_drift_cancels() -> None:
    assert round_order(["async"], 2) == ["without", "async", "async", "without"] * 2
    assert round_order(["async", "sync"], 1) == ["without", "async", "sync", "sync", "async", "without"]


def test_pairs_are_taken_within_a_half_cycle_and_modes_are_counted() -> None:
    # the machine slows down linearly; the connector costs nothing: every pair is close to 1 either way round
    drift = [1.0 + 0.01 * i for i in range(8)]
    summary = summarize(rows_of(drift, ["async"], 2), ["async"])
    ratios = summary["async"]["paired_ratios"]
    assert len(ratios) == 4 and all(0.98 < r < 1.02 for r in ratios)
    low, high = summary["async"]["paired_ratio_ci95"]
    assert low <= summary["async"]["paired_ratio_median"] <= high
    assert summary["load_average"] == [1.0, 8.0]
    # one plain round in the slow mode: counted, and its pair left out of the same-mode figure
    slow = rows_of([1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0], ["async"], 2)
    summary = summarize(slow, ["async"])
    assert summary["without"]["slow_mode_rounds"] == 1 and summary["async"]["slow_mode_rounds"] == 0
    assert sorted(paired_ratios(slow, "async")) == [1.0, 1.0, 1.0, 2.0]
    assert summary["async"]["paired_ratios_same_mode"] == [1.0, 1.0, 1.0]


def test_the_interval_widens_with_scatter() -> None:
    tight = bootstrap_median_ci([0.97, 0.98, 0.99, 1.0, 0.98, 0.99])
    wide = bootstrap_median_ci([0.5, 1.0, 2.0, 0.6, 1.9, 1.0])
    assert tight[1] - tight[0] < 0.05 < wide[1] - wide[0]


def test_the_wide_model_writes_a_realistic_share_of_kv_per_flop() -> None:
    """The tiny model writes ~36x Llama-3.1-8B's KV bytes per FLOP of forward pass; `--model wide` about 2x."""
    kv_8b, flops_8b = forward_costs(LLAMA_3_1_8B)
    assert kv_8b == 128 * 2**10 and 14e9 < flops_8b < 16e9
    tiny, wide = model_summary("tiny"), model_summary("wide")
    assert 30 < tiny["kv_bytes_per_flop_vs_llama_3_1_8b"] < 40
    assert 1.5 < wide["kv_bytes_per_flop_vs_llama_3_1_8b"] < 2.5
    assert wide["forward_flops_per_token"] > 50 * tiny["forward_flops_per_token"]


def test_modes_name_a_variant_and_optionally_a_revision() -> None:
    assert parse_mode("async") == ("async", None)
    assert parse_mode("presence@0b01d37") == ("presence", "0b01d37")
    assert VARIANTS["presence"] == {"async_transfers": True, "presence": True}
    with pytest.raises(ValueError):
        parse_mode("fast")
    assert set(CONNECTORS) <= set(VARIANTS)  # a diagnostic connector class belongs to a mode
    assert all(path.count(":") == 1 for path in CONNECTORS.values())


def test_two_connector_modes_are_paired_with_each_other_too() -> None:
    # without, a, b, b, a, without: a takes 1 s, b 2 s, the plain round 1 s
    seconds = [1.0, 1.0, 2.0, 2.0, 1.0, 1.0]
    order = round_order(["a", "b"], 1)
    rows = [{"round": i, "half": i // 3, "connector": name, "requests": 16, "load_1m": 1.0, "seconds": s,
             "tokens_per_s": 16_000 / s, "cpu_ms_per_request": 50.0, "agent_cpu_ms_per_request": 2.0,
             "transfer_cpu_ms_per_request": 1.0, "engine_steps": 40.0,
             "threads": {"VLLM::Worker/VLLM::Worker": [15.0, float(i), 0.0]}}
            for i, (name, s) in enumerate(zip(order, seconds, strict=True))]
    summary = summarize(rows, ["a", "b"])
    assert summary["a / b"]["paired_ratios"] == [2.0, 2.0]
    assert summary["b"]["paired_ratios"] == [0.5, 0.5]
    assert summary["a"]["median_engine_steps"] == 40.0
    assert summary["a"]["median_threads"]["VLLM::Worker/VLLM::Worker"] == [15.0, 2.5, 0.0]


def test_thread_stats_read_this_process() -> None:
    spent = thread_stats([os.getpid()])
    busy = sum(i * i for i in range(200_000))
    after = thread_stats([os.getpid()])
    assert busy > 0
    name = next(iter(after))
    assert after[name][0] > spent[name][0]  # CPU nanoseconds went up
    assert thread_deltas(spent, after, 1)[name][0] > 0
