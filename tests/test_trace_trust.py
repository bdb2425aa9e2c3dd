"""Record, calibrate, replay: the gateway records its traffic in front of a simulated fleet (real HTTP, real KV
events), the virtual-time fleet replays the recording with the same strategy and fleet and lands within 10% of
what the live run measured, and the calibration recovers the fleet's time model from the recorded timings. A
gateway whose trace cannot be written (a file size limit) drops records, never requests."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench import calibrate, workloads
from bench.loadgen import RequestResult, closed_loop, fleet_summary, open_loop, request_body, scrape
from bench.procs import free_port, stop, wait_http
from bench.sim.perf_model import PROFILES, load_profile
from bench.stats import percentile
from bench.traces import Trace, TraceSource
from bench.vsim import FleetSimulation
from bench.workloads import PromptVocabulary
from tests.conftest import kvgate_command, running_gateway

PROFILE = "llama-3.1-8b-l4"  # slow enough that a request's prefill dwarfs the ~2 ms of HTTP around it
GPU_BLOCKS = 384  # per replica: 6,144 tokens, a fraction of the conversations' working set


def conversation(vocab: PromptVocabulary) -> workloads.Workload:
    return workloads.multi_turn(vocab, sessions=18, turns=4, system_tokens=384, question_tokens=160,
                                answer_tokens=24, idle_s=2.5, session_gap_s=0.6, seed=5)


async def record(fleet: Any, tiny_model_dir: Path, http: aiohttp.ClientSession, path: Path, strategy: str,
                 bodies: list[bytes], arrivals: list[float] | None) -> tuple[list[RequestResult], dict[str, Any]]:
    """Warm the replicas up, then send `bodies` through a recording gateway (open loop at `arrivals`, else one at
    a time); the client's results and the fleet's counters over the run."""
    for url in fleet.urls:  # a replica's first requests pay for warming up (allocations, first tokenizations)
        for body in bodies[:3]:
            async with http.post(url + "/v1/completions", data=body) as resp:
                assert resp.status == 200
                await resp.read()
        async with http.post(url + "/reset_prefix_cache") as resp:
            assert resp.status == 200
    async with running_gateway(fleet.worker_specs, strategy=strategy, model_dir=[str(tiny_model_dir)],
                               block_size=16, record_trace=str(path), record_trace_block_tokens=16) as gateway:
        before = await scrape(http, fleet.urls)
        started = time.perf_counter()
        if arrivals is None:
            results = await closed_loop(http, gateway.url, bodies, 1)
        else:
            results = await open_loop(http, gateway.url, bodies, arrivals)
        live = fleet_summary(before, await scrape(http, fleet.urls), time.perf_counter() - started, fleet.urls)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]
    return results, live


def p50_ttft(results: list[RequestResult]) -> float:
    value = percentile([r.ttft_s for r in results if r.ttft_s is not None], 0.5)
    assert value is not None
    return value


@pytest.mark.timeout(300)
async def test_a_recorded_trace_replays_as_it_ran(sim_fleet: Any, tiny_model_dir: Path, tmp_path: Path,
                                                  http: aiohttp.ClientSession) -> None:
    """Conversations at a realistic load through `kv`: the replay makes the same decisions, the hit rate and the
    median TTFT land within 10% of the live run's. The fleet runs at half speed (speedup 0.5) so that the ~2-10
    ms of HTTP and scheduling around each request, which the simulator does not model, stay small beside it."""
    speedup = 0.5
    fleet = sim_fleet(2, profile=PROFILE, speedup=speedup,
                      extra_args=["--block-size", "16", "--num-gpu-blocks-override", str(GPU_BLOCKS)])
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    workload = conversation(vocab)
    path = tmp_path / "trace.jsonl"
    results, live = await record(fleet, tiny_model_dir, http, path, "kv",
                                 [request_body(r, vocab, "tiny", "text") for r in workload.requests],
                                 [r.arrival_s or 0.0 for r in workload.requests])
    live_ttft = p50_ttft(results)

    trace = Trace(path)
    records = list(trace)
    assert len(records) == len(workload.requests) and trace.scan.skipped == 0
    assert all(r.status == 200 and r.strategy == "kv" and r.worker in fleet.urls for r in records)
    assert sum(r.cached_tokens or 0 for r in records) == live["hit_tokens"]  # the engines' own report, per request
    assert vocab.text(workload.requests[0].token_ids[:8]) not in path.read_text()  # no text leaves the gateway

    # virtual time runs at the model's pace: the recorded (wall-clock) arrivals are `speedup` times its own
    replay = FleetSimulation(TraceSource(trace, vocab, time_scale=1 / speedup), strategy="kv", replicas=2,
                             profile=PROFILE, block_size=16, gpu_blocks=GPU_BLOCKS).run()
    replay_ttft = replay["ttft_ms_p50"] / 1e3 / speedup
    print(f"live: hit {live['hit_rate']:.3f}, TTFT p50 {live_ttft * 1e3:.1f} ms; "
          f"replay: hit {replay['hit_rate']:.3f}, TTFT p50 {replay_ttft * 1e3:.1f} ms")
    assert replay["completed"] == len(records)
    assert abs(replay["hit_rate"] - live["hit_rate"]) <= 0.10 * live["hit_rate"]
    assert abs(replay_ttft - live_ttft) <= 0.10 * live_ttft


@pytest.mark.timeout(300)
async def test_calibration_recovers_the_fleet_and_the_calibrated_replay_predicts_it(
        sim_fleet: Any, tiny_model_dir: Path, tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """Record requests one at a time (prompts of 200 to 1,900 tokens, half of them extending an earlier one),
    calibrate from the recorded timings alone, starting from another accelerator's profile: the fit finds the
    fleet's prefill and decode times (its profile at speedup 1), and the replay with the calibrated profile
    predicts the recorded median TTFT. Real time (speedup 1): what the fleet's CPU does per prompt token (the
    gateway's and the simulator's tokenizing), which the model does not have, reads as a slower prefill; at speedup
    4 it was 11% of the prefill here and 15% on a slower CI machine, at speedup 1 it is about 5%."""
    speedup = 1.0
    fleet = sim_fleet(1, profile=PROFILE, speedup=speedup, extra_args=["--block-size", "16"])
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    rng = random.Random(11)
    prompts: list[list[int]] = []
    for i in range(36):
        length = rng.randrange(200, 1800)
        base = rng.choice(prompts) if prompts and rng.random() < 0.5 else []
        base = base if len(base) < length - 32 else []
        prompts.append(base + vocab.tokens(f"calibrate:{i}", length - len(base)))
    bodies = [request_body(workloads.WorkloadRequest(p, rng.randrange(6, 16)), vocab, "tiny", "text")
              for p in prompts]
    path = tmp_path / "trace.jsonl"
    results, _ = await record(fleet, tiny_model_dir, http, path, "round_robin", bodies, None)

    out = tmp_path / "profile.json"
    args = argparse.Namespace(trace=str(path), profile="llama-3.1-8b-h100", out=str(out))
    assert calibrate.run(args) == 0
    fitted = load_profile(str(out))
    report = json.loads(out.read_text())["fit"]
    truth = PROFILES[PROFILE]
    print(f"fit: {report}")
    assert report["prefill_samples"] >= 30 and report["decode_samples"] >= 30
    print("fitted / true prefill time:", [round(fitted.prefill_time(u, c) / (truth.prefill_time(u, c) / speedup), 3)
                                          for u, c in ((300, 0), (1800, 0), (600, 1200))])
    for uncached, cached in ((300, 0), (1800, 0), (600, 1200)):
        assert fitted.prefill_time(uncached, cached) == pytest.approx(
            truth.prefill_time(uncached, cached) / speedup, rel=0.15)
    assert fitted.decode_step_time(1, 1500) == pytest.approx(truth.decode_step_time(1, 1500) / speedup, rel=0.15)

    replay = FleetSimulation(TraceSource(Trace(path), vocab), strategy="round_robin", replicas=1, profile=fitted,
                             block_size=16).run()
    assert fitted.request_overhead_s == report["unmodelled_ttft_s"] > 0  # HTTP and tokenization, added to TTFTs
    assert replay["ttft_ms_p50"] / 1e3 == pytest.approx(p50_ttft(results), rel=0.10)


@pytest.mark.timeout(180)
async def test_a_trace_file_that_cannot_grow_drops_records_not_requests(
        sim_fleet: Any, tiny_model_dir: Path, tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """A real `kvgate serve` whose file size limit (RLIMIT_FSIZE) stops the trace after a few lines, as a full
    disk would: every request is answered, the refused records are counted and logged once, and the file holds
    only whole lines."""
    fleet = sim_fleet(1, speedup=50)
    port = free_port()
    path = tmp_path / "trace.jsonl"

    def sample(name: str) -> float:
        line = next((line for line in metrics.splitlines() if line.startswith(name)), f"{name} 0")
        return float(line.rsplit(" ", 1)[1])

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))

    # the log goes to a pipe, which the file size limit does not cover
    proc = subprocess.Popen(kvgate_command("serve", "--host", "127.0.0.1", "--port", str(port), "--strategy",
                                           "round_robin", "--model-dir", str(tiny_model_dir), "--worker",
                                           fleet.worker_specs[0], "--record-trace", str(path)),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=limit_file_size)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/ready", 30, proc)
        for i in range(40):
            body = {"model": "tiny", "prompt": f"request {i}: " + "words " * 50, "max_tokens": 4}
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
        metrics = ""

        async def scraped() -> bool:
            nonlocal metrics
            async with http.get(url + "/metrics") as resp:
                metrics = await resp.text()
            return sample("kvgate_trace_records_written_total") + sample(
                'kvgate_trace_records_dropped_total{reason="write_error"}') == 40

        for _ in range(100):  # the writer thread catches up within 10 s
            if await scraped():
                break
            await asyncio.sleep(0.1)
    finally:
        stop(proc)
    assert proc.stdout is not None
    logged = proc.stdout.read().decode()

    written = sample("kvgate_trace_records_written_total")
    dropped = sample('kvgate_trace_records_dropped_total{reason="write_error"}')
    assert written >= 1 and dropped >= 1 and written + dropped == 40
    trace = Trace(path)
    assert len(trace) == written and trace.scan.skipped == 0  # whole lines only
    assert path.stat().st_size <= 1500
    assert logged.count("record_trace: cannot write") == 1, logged[-2000:]
