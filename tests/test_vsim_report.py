"""vsim's TTFT report: the limit (each request's prefill alone with the ideal hit), each row against round_robin and
the limit, and the `ttft` strategy's predictions recorded beside the simulated TTFTs and plotted."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench import vsim, vsim_report, workloads
from bench.sim.perf_model import PROFILES
from bench.stats import percentile
from bench.traces import ConversationShape, conversation_trace, write_trace
from bench.vsim import FleetSimulation, TierSettings
from bench.workload_options import build_workload
from bench.workloads import IdealCache, PromptVocabulary, Workload, WorkloadRequest, ideal_hit_rate
from kvcore.config import ConfigError
from kvcore.kv_events import SHARED
from router.block_keys import block_keys, root_key
from tests.test_bench_compare import compare_args


def test_the_limit_is_each_prefill_alone_with_the_ideal_hit() -> None:
    profile = PROFILES["llama-3.1-8b-h100"]
    ideal = ideal_hit_rate([[1] * 4096, [1] * 4096 + [2] * 100], 16)
    assert ideal.requests == [(4096, 0), (4196, 4096)]
    limit = vsim_report.ttft_limit(ideal, profile)
    times = sorted([profile.prefill_time(4096, 0), profile.prefill_time(100, 4096)])
    p50 = limit["ttft_ms_p50"]
    assert p50 is not None and abs(p50 - (times[0] + times[1]) / 2 * 1e3) < 1e-9  # interpolated, as vsim does
    assert vsim_report.ttft_limit(IdealCache(0, 0), profile)["ttft_ms_p90"] is None


def test_the_limit_for_the_sends_waits_for_a_prefix_whose_first_prefill_still_runs() -> None:
    """`causal_ttfts`: requests far apart are the limit's (each prefill alone with what came before); a copy sent
    while the first is computed cannot hit what is not there yet: it takes the chunks done and waits for the rest
    or computes it, whichever is sooner."""
    profile = dataclasses.replace(PROFILES["llama-3.1-8b-h100"], max_num_batched_tokens=1024,
                                  request_overhead_s=0.002)
    keys = list(range(1000, 1016))  # 16 full blocks of 256 tokens, and one token more
    longer = keys + list(range(2000, 2004))
    cold = [profile.step_time([(1024, 1024 * k)]) for k in range(4)] + [profile.step_time([(1, 4096)])]
    assert profile.prefill_time(4097) == pytest.approx(sum(cold), rel=1e-12)
    # apart: the second extends the first, which was done long before, and hits all of its blocks
    far = vsim_report.causal_ttfts([(4097, keys), (5121, longer)], [0.0, 10.0], 256, profile)
    assert far == pytest.approx([sum(cold) + 0.002, profile.prefill_time(1025, 4096) + 0.002], rel=1e-9)
    # at once: nothing is there, and waiting for the first costs more than computing it again
    both = vsim_report.causal_ttfts([(4097, keys), (4097, keys)], [0.0, 0.0], 256, profile)
    assert both == pytest.approx([sum(cold) + 0.002] * 2, rel=1e-9)
    # sent as the first's second chunk ends: its first 8 blocks are there, 12 after the next chunk, 16 after two
    options = [profile.prefill_time(4097 - 2048, 2048), cold[2] + profile.prefill_time(4097 - 3072, 3072),
               cold[2] + cold[3] + profile.prefill_time(1, 4096)]
    assert min(options) < options[0]  # (the case tests a wait: the rest is cheaper waited for)
    later = vsim_report.causal_ttfts([(4097, keys), (4097, keys)], [0.0, cold[0] + cold[1]], 256, profile)
    assert later[1] == pytest.approx(min(options) + 0.002, rel=1e-9)
    # what the second computes is there for a third at the end of the second's own steps, not before
    third = vsim_report.causal_ttfts([(4097, keys), (5121, longer), (5121, longer)], [0.0, 10.0, 10.0], 256,
                                     profile)
    assert third[2] == pytest.approx(third[1], rel=1e-9)


def test_a_replay_at_its_arrival_times_has_a_limit_for_them_and_a_paced_one_has_none(tiny_model_dir: Path) -> None:
    profile = PROFILES["llama-3.1-8b-h100"]
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    document = list(range(100, 4196))
    apart = Workload("apart", [WorkloadRequest([*document, 7], 1, arrival_s=0.0),
                               WorkloadRequest([*document, 8], 1, arrival_s=10.0)])
    source = workloads.WorkloadSource(apart, vocab)
    causal = vsim_report.causal_limit(source, 16, profile)
    assert causal == pytest.approx(vsim_report.ttft_limit(source.ideal(16), profile), rel=1e-9)
    # the same two at once: the second cannot hit what the first has not computed yet
    burst = Workload("burst", [WorkloadRequest(r.token_ids, 1, arrival_s=0.0) for r in apart.requests])
    source = workloads.WorkloadSource(burst, vocab)
    causal = vsim_report.causal_limit(source, 16, profile)
    limit = vsim_report.ttft_limit(source.ideal(16), profile)
    assert causal is not None and limit["ttft_ms_p50"] is not None and causal["ttft_ms_p50"] is not None
    assert causal["ttft_ms_p50"] > 1.5 * limit["ttft_ms_p50"]
    # arrivals out of order are taken in the order they came
    shuffled = workloads.WorkloadSource(burst, vocab, arrivals=[5.0, 0.0])
    prompts = [(len(vocab.wire_ids(r.token_ids)), block_keys(vocab.wire_ids(r.token_ids), 16, root_key("bench")))
               for r in burst.requests]
    times = sorted(vsim_report.causal_ttfts(prompts, [5.0, 0.0], 16, profile))
    assert vsim_report.causal_limit(shuffled, 16, profile) == pytest.approx(
        {"ttft_ms_p50": (times[0] + times[1]) / 2 * 1e3, "ttft_ms_p90": (times[0] + 0.9 * (times[1] - times[0])) * 1e3,
         "ttft_ms_p99": (times[0] + 0.99 * (times[1] - times[0])) * 1e3}, rel=1e-9)
    cache = vsim_report.CausalCache(16, profile)
    cache.first_token(10, [], 1.0)
    with pytest.raises(vsim_report.OutOfOrder):
        cache.first_token(10, [], 0.0)
    paced = Workload("paced", [WorkloadRequest(r.token_ids, 1) for r in apart.requests])
    assert vsim_report.causal_limit(workloads.WorkloadSource(paced, vocab), 16, profile) is None


def test_rows_are_measured_against_round_robin_of_their_own_fleet_and_the_limit() -> None:
    rows: list[dict[str, Any]] = [
        {"strategy": "round_robin", "replicas": 8, "tiers": False, "ttft_ms_p50": 300.0, "ttft_ms_p90": 1000.0,
         "ttft_ms_p99": 2000.0},
        {"strategy": "ttft", "replicas": 8, "tiers": False, "ttft_ms_p50": 100.0, "ttft_ms_p90": 1000.0,
         "ttft_ms_p99": 3000.0},
        {"strategy": "ttft", "replicas": 16, "tiers": False, "ttft_ms_p50": 100.0, "ttft_ms_p90": 1.0,
         "ttft_ms_p99": 1.0}]
    vsim_report.add_gaps(rows, {"ttft_ms_p50": 50.0, "ttft_ms_p90": 1000.0, "ttft_ms_p99": 1000.0})
    assert rows[1]["ttft_speedup_over_round_robin"]["p50"] == 3.0
    assert rows[1]["ttft_gap_closed"]["p50"] == 0.8
    assert rows[1]["ttft_gap_closed"]["p90"] is None  # no gap to close: round_robin is at the limit
    assert rows[1]["ttft_gap_closed"]["p99"] == -1.0  # worse than round_robin
    assert "ttft_gap_closed" not in rows[2]  # no round_robin with 16 replicas


def test_the_fleet_cache_as_one_evicts_as_vllm_does_under_lru() -> None:
    """LRU as vLLM evicts: the block used longest ago first, and of one request's blocks the last first (vLLM frees
    them tail first), so a prompt's prefix outlives its tail. Three blocks: A = [1, 2, 3], then B = [4] pushes one
    of A's out; A again hits its first two (tail-first) where head-first eviction would leave it nothing."""
    a, b = (4, [1, 2, 3]), (2, [4])  # (tokens, full blocks' keys) at a block size of 1: A's 3 blocks are cacheable
    cache = vsim_report.lru_cache_hits([a, b, a], 1, 3)
    assert cache.requests == [(4, 0), (2, 0), (4, 2)]
    assert (cache.hit_tokens, cache.query_tokens) == (2, 10)
    assert vsim_report.lru_cache_hits([a, b, a], 1, 4).requests[2] == (4, 3)  # room for all: all hit
    big_a, big_b = (49, [1, 2, 3]), (17, [4])  # the same at a block size of 16: a hit counts 16 tokens a block
    assert vsim_report.lru_cache_hits([big_a, big_b, big_a], 16, 3).requests[2] == (49, 32)


def test_min_keeps_the_most_blocks_for_their_next_use_and_of_a_prompt_its_prefix() -> None:
    """Belady's MIN: a, b, c, a, b, c in two blocks of room: LRU evicts each just before its use (no hit); MIN
    evicts c, whose next use is farthest, and hits a and b. Of blocks next used together, the deeper goes first: one
    block of room keeps A's first block, so A again hits it (evicting the first would hit nothing)."""
    one = [(2, [key]) for key in (1, 2, 3, 1, 2, 3)]  # one cacheable block each at a block size of 1
    assert vsim_report.lru_cache_hits(one, 1, 2).hit_tokens == 0
    best = vsim_report.min_cache_hits(one, 1, 2)
    assert [hit for _, hit in best.requests] == [0, 0, 0, 1, 1, 0]
    a = (3, [7, 8])
    assert vsim_report.min_cache_hits([a, a], 1, 1).requests == [(3, 0), (3, 1)]
    assert vsim_report.min_cache_hits([a, a], 1, 2).requests == [(3, 0), (3, 2)]
    # unbounded room: the ideal cache's hits exactly, for both
    prompts = [[1] * 64, [1] * 64 + [2] * 40, [3] * 50, [1] * 64 + [2] * 40 + [4] * 9]
    hashed = [(len(ids), block_keys(ids, 16, root_key("bench"))) for ids in prompts]
    ideal = ideal_hit_rate(prompts, 16)
    for cache in (vsim_report.lru_cache_hits(hashed, 16, 1000), vsim_report.min_cache_hits(hashed, 16, 1000)):
        assert cache.requests == ideal.requests


def test_the_limit_with_the_fleet_cache_lies_between_the_unbounded_limit_and_round_robin(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    """`kvgate bench vsim` reports, per fleet, the limit with what one cache of all its GPU blocks would have hit
    (LRU and MIN): a fleet too small for the workload's prefixes hits less than the unbounded cache, MIN at least
    as much as LRU, and round_robin no more than MIN."""
    trace = tmp_path / "c.jsonl"
    write_trace(trace, conversation_trace(ConversationShape(requests=80, duration_s=20.0, seed=5)))
    subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "vsim", "--trace", str(trace), "--model-dir",
                    str(tiny_model_dir), "--replicas", "2", "--gpu-blocks", "60", "--block-tokens", "64", "--tiers",
                    "off", "--no-progress", "--out", str(tmp_path / "v.json"), "--strategies", "round_robin"],
                   check=True, capture_output=True, timeout=240)
    report = orjson.loads((tmp_path / "v.json").read_bytes())
    fleet = report["ttft_limit_fleet_cache"]["2"]
    assert fleet["blocks"] % 2 == 0 and fleet["blocks"] >= 2 * 60  # at least a longest request's each
    lru, best = fleet["lru"], fleet["min"]
    assert lru["hit_rate"] <= best["hit_rate"] < report["upper_bound"]
    assert report["results"][0]["hit_rate"] <= best["hit_rate"]
    assert report["ttft_limit"]["ttft_ms_p90"] <= best["ttft_ms_p90"]
    markdown = (tmp_path / "v.md").read_text()
    assert "the fleet's GPU cache as one (MIN)" in markdown and "the fleet's GPU cache as one (LRU)" in markdown


def test_vsim_records_ttft_predictions_and_plots_them(tiny_model_dir: Path, tmp_path: Path) -> None:
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    workload = build_workload(compare_args(Path("."), tiny_model_dir), vocab)
    rows = [FleetSimulation(workload, vocab, strategy=strategy, replicas=2, gpu_blocks=40, concurrency=2,
                            tiers=TierSettings(dram_blocks=64, nvme_blocks=64)).run()
            for strategy in ("round_robin", "ttft")]
    assert "ttft_prediction" not in rows[0]
    prediction = rows[1]["ttft_prediction"]
    assert len(prediction["pairs"]) == rows[1]["completed"]
    assert prediction["median_abs_relative_error"] < 0.5
    report: dict[str, Any] = {
        "workload": {"name": "tenants", "params": {}}, "profile": "llama-3.1-8b-h100", "upper_bound": 0.5,
        "ttft_limit": {"ttft_ms_p50": 1.0, "ttft_ms_p90": 2.0, "ttft_ms_p99": 3.0}, "results": rows}
    vsim_report.add_gaps(rows, report["ttft_limit"])
    assert vsim_report.write_prediction_plot(report, tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 1000
    report["prediction_plot"] = "p.png"
    vsim_report.write_markdown(report, tmp_path / "r.md")
    text = (tmp_path / "r.md").read_text()
    assert "| 2 | on | ttft |" in text and "**limit**" in text and "p.png" in text


def test_rows_report_the_wait_before_each_requests_first_step(tiny_model_dir: Path) -> None:
    """A request admitted while its replica runs a step waits for the rest of that step (a busy engine takes new
    requests at its next step); one admitted to an idle replica waits for nothing. The TTFT limit leaves that wait
    out, so the rows say how much of each strategy's TTFT it is."""
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    profile = PROFILES["llama-3.1-8b-h100"]
    first = WorkloadRequest(list(range(100, 4196)), 1, arrival_s=0.0)
    step = profile.prefill_time(4096, 0)  # the first request's one prefill step
    second = WorkloadRequest(list(range(10, 74)), 1, arrival_s=step / 4)
    alone = WorkloadRequest(list(range(20, 84)), 1, arrival_s=10.0)
    workload = Workload("two", [first, second, alone])
    sim = FleetSimulation(workload, vocab, strategy="round_robin", replicas=1, gpu_blocks=2000)
    row = sim.run()
    assert len(sim._ttft) == 3 and row["ttft_ms_mean"] == sum(sim._ttft) / 3 * 1e3  # the mean TTFT too
    waits = sorted([0.0, 0.0, step * 3 / 4])
    expected = percentile(waits, 0.9)
    assert expected is not None and abs(row["step_wait_ms_p90"] / (expected * 1e3) - 1) < 0.01
    assert row["step_wait_ms_p50"] == 0.0 and row["wait_ms_p50"] == 0.0
    assert abs(row["wait_ms_p90"] - row["step_wait_ms_p90"]) < 1e-6
    assert row["ttft_ms_p99"] > (step * 3 / 4 + profile.prefill_time(64, 0)) * 1e3 * 0.99


class RecordingSimulation(FleetSimulation):
    """Keeps the duration of every engine step it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.step_durations: list[float] = []

    def _step(self, replica: Any) -> None:
        super()._step(replica)
        if replica.busy and replica.step_end > self.now:
            self.step_durations.append(replica.step_end - self.now)


def test_the_virtual_fleet_relays_a_chunk_per_sampled_token_at_its_steps_end(tiny_model_dir: Path) -> None:
    """vsim runs the gateway's strategies, so what the gateway learns from the chunks it relays must come from the
    virtual engines too: each token a step samples reaches the strategy's per-chunk hook at that step's end, and
    `ttft`'s step clock learns exactly the steps the replica ran."""
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    requests = [WorkloadRequest(list(range(100 + 64 * i, 164 + 64 * i)), 20, arrival_s=0.001 * i) for i in range(3)]
    sim = RecordingSimulation(Workload("three", requests), vocab, strategy="ttft", replicas=1, gpu_blocks=2000)
    sim.run()
    clock = sim.strategy.steps[sim.replicas[0].url]  # type: ignore[attr-defined]
    assert len(clock.durations) >= 15
    for learned in clock.durations:
        assert min(abs(learned - d) for d in sim.step_durations) < 1e-9, (learned, sim.step_durations)


def test_a_strategy_entry_may_give_its_rows_settings_of_their_own(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`--strategies ttft,ttft:ttft_step_phase=false:ttft_tie_s=0.0005` runs both side by side in one sweep, each
    row named by its whole entry; the settings are typed as the strategy's `Options` declare them, and one it does
    not have is refused before anything runs."""
    assert vsim.strategy_variant("ttft") == ("ttft", {})
    assert vsim.strategy_variant("ttft:ttft_step_phase=false:ttft_tie_s=0.0005") == (
        "ttft", {"ttft_step_phase": False, "ttft_tie_s": 0.0005})
    for bad in ("ttft:ttft_nothing=1", "kv:ttft_tie_s=0.1", "ttft:ttft_tie_s", "ttft:ttft_tie_s=soon", "nope"):
        with pytest.raises(ConfigError):
            vsim.strategy_variant(bad)
    trace = tmp_path / "c.jsonl"
    write_trace(trace, conversation_trace(ConversationShape(requests=60, duration_s=20.0, seed=3)))
    command = [sys.executable, "-m", "kvgate.cli", "bench", "vsim", "--trace", str(trace), "--model-dir",
               str(tiny_model_dir), "--replicas", "2", "--gpu-blocks", "100", "--block-tokens", "64", "--tiers",
               "off", "--no-progress", "--out", str(tmp_path / "v.json"), "--strategies"]
    refused = subprocess.run([*command, "round_robin,ttft:ttft_nothing=1"], capture_output=True, text=True,
                             timeout=120)
    assert refused.returncode == 2 and "ttft_nothing" in refused.stderr and "Traceback" not in refused.stderr
    subprocess.run([*command, "ttft,ttft:ttft_step_phase=false"], check=True, capture_output=True, timeout=240)
    rows = orjson.loads((tmp_path / "v.json").read_bytes())["results"]
    assert [r["strategy"] for r in rows] == ["ttft", "ttft:ttft_step_phase=false"]
    assert all(r["completed"] == 60 for r in rows)
    # the step phase is in the first row's predictions only: they differ
    assert rows[0]["ttft_prediction"] != rows[1]["ttft_prediction"]


def test_a_sped_up_fleet_runs_every_step_that_many_times_faster(tiny_model_dir: Path) -> None:
    """`--speedup` as `kvgate sim`'s (the live fleet of `kvgate bench compare`): the same closed-loop workload,
    routed round_robin, takes a tenth of every TTFT at speedup 10, with the same hits."""
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    requests = [WorkloadRequest([t] * 512 + list(range(100 + 32 * i, 132 + 32 * i)), 4)
                for i, t in enumerate([1, 2, 1, 2, 3, 1] * 4)]
    rows = [FleetSimulation(Workload("tenants", requests), vocab, strategy="round_robin", replicas=2, gpu_blocks=400,
                            profile="llama-3.1-8b-l4", concurrency=2, speedup=speedup).run() for speedup in (1.0, 10.0)]
    assert rows[0]["hit_rate"] == rows[1]["hit_rate"] > 0
    for p in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99"):
        assert abs(rows[0][p] / rows[1][p] - 10.0) < 1e-6, p
    with pytest.raises(ValueError):
        PROFILES["llama-3.1-8b-l4"].sped_up(0.0)


def test_tiers_sped_up_load_as_much_faster_as_the_engines_and_ttft_is_told_the_links_own_rates(
        tiny_model_dir: Path) -> None:
    """`--tiers-sped-up`: the tier links of a sped-up fleet run that much faster too, as the synchronous loads of
    `kvgate sim --speedup` replicas with agents do (`kvgate bench compare --with-agents`), while `ttft` is told the
    links' own rates, as `bench compare` tells a live gateway. round_robin over eager tiers on 2 replicas: every
    prompt's second request loads its prefix from the shared tier on the other replica. With the links sped up
    alike, every TTFT at speedup 10 is a tenth of speedup 1's, the same tokens from each tier; without, the loads
    keep their time."""
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    requests = [WorkloadRequest([t] * 1024 + list(range(100 + 32 * i, 132 + 32 * i)), 4)
                for i, t in enumerate([1, 1, 2, 2, 3, 3, 1, 2])]
    tiers = TierSettings(write_policy="eager")

    def run(speedup: float, sped_up: bool) -> dict[str, Any]:
        return FleetSimulation(Workload("tenants", requests), vocab, strategy="round_robin", replicas=2,
                               gpu_blocks=400, profile="llama-3.1-8b-l4", concurrency=1, tiers=tiers,
                               speedup=speedup, tiers_sped_up=sped_up).run()

    slow, fast, fleet_only = run(1.0, False), run(10.0, True), run(10.0, False)
    assert slow["hit_rate_by_tier"] == fast["hit_rate_by_tier"] and slow["hit_rate_by_tier"]["shared"] > 0
    for p in ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99"):
        assert abs(slow[p] / fast[p] - 10.0) < 1e-6, p
    # the wait before a loading request's first step is its load: 2 ms + 1,024 x 128 KiB at 10 GB/s = 15.4 ms
    assert abs(slow["wait_ms_p90"] - 15.42177) < 1e-3 and abs(fast["wait_ms_p90"] - 1.542177) < 1e-4
    assert abs(fleet_only["wait_ms_p90"] - slow["wait_ms_p90"]) < 1e-6  # without: the links' own time
    sim = FleetSimulation(Workload("tenants", requests), vocab, strategy="ttft", replicas=2, gpu_blocks=400,
                          profile="llama-3.1-8b-l4", concurrency=1, tiers=tiers, speedup=10.0, tiers_sped_up=True)
    link = sim.strategy.load.links[SHARED]  # type: ignore[attr-defined]
    assert link.bytes_per_s == tiers.shared_gbps * 1e9 and link.latency_s == tiers.shared_latency_s
    assert sim.links["S"].bytes_per_s == 10 * tiers.shared_gbps * 1e9


def test_ttft_routes_a_fleet_ten_times_faster_as_it_routes_the_fleet(tiny_model_dir: Path) -> None:
    """The README's tenants (16 tenants' 2,048-token prompts, 4 replicas whose caches hold five each) on the L4
    profile and on the same fleet ten times faster (the live fleet of `kvgate bench compare`), the gateway's event
    delay and scrape interval a tenth too: `ttft` makes the very same routing decisions. With the balance's price in
    seconds (0.12 s, a 440-token prefill on the L4 and an 8,000-token one ten times faster) it did not: on this seed
    the faster fleet moved tenants, hit rate 0.845 against 0.866."""
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    runs = []
    for speedup in (1.0, 10.0):
        workload = workloads.tenants(vocab, tenants=16, prefix_tokens=2048, users=4, question_tokens=64,
                                     requests_per_user=3, max_tokens=16, seed=3)
        sim = FleetSimulation(workload, vocab, strategy="ttft", replicas=4, profile="llama-3.1-8b-l4", gpu_blocks=640,
                              concurrency=8, seed=3, speedup=speedup, event_delay_s=0.002 / speedup,
                              metrics_interval_s=1.0 / speedup)
        row = sim.run()
        runs.append((sim.decisions, row["hit_rate"], row["ttft_ms_p50"]))
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1] > 0.8
    assert abs(runs[0][2] / runs[1][2] - 10.0) < 0.01


def test_the_opening_burst_queues_on_the_fleets_replicas() -> None:
    """`opening_burst_floor`: prompts sent at once that share nothing wait for each other on too few replicas; a
    prefix shared by several is computed once; each send after the first counts off; `split` bounds the total only."""
    profile = dataclasses.replace(PROFILES["llama-3.1-8b-h100"], request_overhead_s=0.002)
    bs, o = 256, profile.step_overhead_s + 0.002
    w = profile.prefill_compute_time(bs * 8)
    assert w == pytest.approx(profile.step_time([(bs * 8, 0)]) - profile.step_overhead_s, rel=1e-12)  # compute-bound

    def prompt(first: int) -> tuple[int, list[int]]:  # 8 full blocks from `first` and a token of its own
        return bs * 8 + 1, list(range(first, first + 8))

    alone = [prompt(100 * g) for g in range(6)]  # six prompts sharing nothing, on 4 replicas
    floor = vsim_report.opening_burst_floor(alone, [0.0] * 6, bs, profile, 4)
    assert floor == pytest.approx([o + 2 * w] * 2 + [o + w] * 4, rel=1e-12)
    # two pairs: four prefixes on 4 replicas, none waits for another
    pairs = [prompt(0), prompt(0), prompt(100), prompt(100), prompt(200), prompt(300)]
    assert vsim_report.opening_burst_floor(pairs, [0.0] * 6, bs, profile, 4) == pytest.approx([o + w] * 6, rel=1e-12)
    # on 2 replicas: the two singles (the fewest requests) last, each after another prefix on its replica
    floor = vsim_report.opening_burst_floor(pairs, [0.0] * 6, bs, profile, 2)
    assert floor == pytest.approx([o + 2 * w] * 2 + [o + w] * 4, rel=1e-12)
    # split across replicas (tiers): the fleet's total only, the 3rd of 4 prefixes no sooner than 3 w over 2
    floor = vsim_report.opening_burst_floor(pairs, [0.0] * 6, bs, profile, 2, split=True)
    assert floor == pytest.approx([o + 2 * w, o + 1.5 * w] + [o + w] * 4, rel=1e-12)
    # one replica, the last of six sent 5 ms after the others: 5 ms off every bound it takes part in
    late = vsim_report.opening_burst_floor(alone[:3] + alone[:2] + [prompt(900)], [0.0] * 5 + [0.005], bs,
                                           profile, 1)
    assert late == pytest.approx([o + 4 * w - 0.005, o + 3 * w - 0.005, o + 2 * w, o + 2 * w - 0.005, o + w,
                                  o + w - 0.005],
                                 rel=1e-12)
    assert vsim_report.opening_burst_floor([], [], bs, profile, 2) == []


def test_the_fleet_limit_raises_the_per_request_limit_rank_by_rank() -> None:
    """`fleet_ttfts`: `causal_ttfts` sorted, each of the largest raised to the burst's floor; never below it."""
    profile = PROFILES["llama-3.1-8b-h100"]
    prompts = [(256 * 8 + 1, list(range(100 * g, 100 * g + 8))) for g in range(3)]  # three 2,048-token prefixes
    causal = sorted(vsim_report.causal_ttfts(prompts, [0.0] * 3, 256, profile))
    assert causal[0] == pytest.approx(causal[2], rel=1e-12)  # a replica each: all alike
    one = vsim_report.fleet_ttfts(causal, vsim_report.opening_burst_floor(prompts, [0.0] * 3, 256, profile, 1))
    w = profile.prefill_compute_time(256 * 8)
    assert one == pytest.approx([causal[0], profile.step_overhead_s + 2 * w, profile.step_overhead_s + 3 * w],
                                rel=1e-12)
    alone = vsim_report.opening_burst_floor(prompts, [0.0] * 3, 256, profile, 3)
    assert vsim_report.fleet_ttfts(causal, alone) == pytest.approx(causal, rel=1e-12)


def test_a_gateway_of_two_processes_routes_with_what_both_have_in_flight(tiny_model_dir: Path) -> None:
    """`--strategies prefix:p2` models `kvgate serve --processes 2`: each request goes to one of two gateways at
    random, each with its own strategy and its own in-flight counts, both fed the same KV events, and each tells
    the other where it routed a request, its first token and its end (router/sibling_routes.py), in batches 2 ms
    after the first record of each. On the README's tenants (16 tenants' 2,048-token prompts, 4 replicas whose
    caches hold five each, seed 3), `prefix`, whose routing memory is where requests went: hit rate 0.871 with one
    process, 0.797 with two. Without the routes told (f05ffdc) it was 0.629: each process copied each tenant's
    prompt wherever it sent it first, and the copies evicted one another. `kv` and `ttft` read the replicas' own
    events: 0.846 and 0.844 with two. One process is the simulation as it was; every process's count of its
    siblings' requests in flight, and `kv`'s pending blocks, are back to nothing at the end."""
    assert vsim.strategy_variant("prefix:p2") == ("prefix", {"processes": 2})
    assert vsim.strategy_variant("ttft:p3:ttft_tie_s=0.001") == ("ttft", {"processes": 3, "ttft_tie_s": 0.001})
    for bad in ("ttft:p0", "ttft:p2:p3", "ttft:px"):
        with pytest.raises(ConfigError):
            vsim.strategy_variant(bad)
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    rows: dict[tuple[str, int | None], dict[str, Any]] = {}
    for strategy in ("prefix", "kv", "ttft"):
        for processes in (None, 1, 2):
            workload = workloads.tenants(vocab, tenants=16, prefix_tokens=2048, users=4, question_tokens=64,
                                         requests_per_user=3, max_tokens=16, seed=3)
            more: dict[str, Any] = {} if processes is None else {"processes": processes}
            sim = FleetSimulation(workload, vocab, strategy=strategy, replicas=4, profile="llama-3.1-8b-l4",
                                  gpu_blocks=640, concurrency=8, seed=3, speedup=10, **more)
            rows[strategy, processes] = row = sim.run()
            assert row["completed"] == 192
            assert len(sim.gateways) == (processes or 1)
            for gateway in sim.gateways:
                assert [w.sibling_in_flight for w in gateway.workers] == [0] * 4
                pending = getattr(gateway.strategy, "pending", None)
                if pending is not None:
                    assert all(pending.pending(w.url) == {} for w in gateway.workers)
    for strategy in ("prefix", "kv", "ttft"):
        one, two = rows[strategy, 1], rows[strategy, 2]
        assert {k: v for k, v in one.items() if k != "wall_s"} == {
            k: v for k, v in rows[strategy, None].items() if k != "wall_s"}
        assert "requests_per_process" not in one
        split = two["requests_per_process"]
        assert sum(split) == 192 and min(split) > 192 / 4, split
        assert two["hit_rate"] > one["hit_rate"] - 0.1, strategy
    assert rows["prefix", 2]["hit_rate"] > 0.75  # 0.629 without the routes told
    with pytest.raises(ValueError):
        FleetSimulation(Workload("tenants", []), vocab, strategy="kv", replicas=2, concurrency=1, processes=0)
