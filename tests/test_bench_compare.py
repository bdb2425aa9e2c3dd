"""`kvgate bench compare` on a tiny live fleet (kvgate strategies only: peers are exercised by the benchmark
command), and the virtual-time fleet simulation agreeing with it."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench import compare
from bench.overhead import _descendants
from bench.report import write_markdown
from bench.sim.launch import start_sim_fleet
from bench.targets import TargetSettings, parse_target
from bench.vsim import FleetSimulation, TierSettings
from bench.workload_options import build_workload
from bench.workloads import PromptVocabulary
from tests.conftest import recorded_speed

STRATEGIES = ("round_robin", "prefix", "kv", "ttft")
WORKLOAD = {"workload": "tenants", "tenants": 4, "users": 3, "requests_per_user": 2, "prefix_tokens": 256,
            "question_tokens": 16, "max_tokens": 4}
GPU_BLOCKS = 44  # a replica holds two of the four tenants' prefixes: where a tenant goes decides its hits


def compare_args(out: Path, model_dir: Path, **overrides: Any) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in {"targets": ",".join(f"kvgate:{s}" for s in STRATEGIES), "out": str(out),
                       "model_dir": str(model_dir), "replicas": 2, "speedup": 50.0, "gpu_blocks": GPU_BLOCKS,
                       "concurrency": 1, "no_progress": True, **WORKLOAD, **overrides}.items():
        setattr(args, key, value)
    return args


@pytest.fixture(scope="module")
def live_report(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("compare")
    report = asyncio.run(compare.compare(compare_args(out, tiny_model_dir)))
    return report, out


@pytest.mark.timeout(120)
def test_short_comparison_writes_every_output(live_report: tuple[dict[str, Any], Path]) -> None:
    report, out = live_report
    for name in ("report.json", "report.md", "ttft_cdf.png", "hit_rate.png", "load.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "ttft_cdf.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    on_disk = orjson.loads((out / "report.json").read_bytes())
    assert [t["name"] for t in on_disk["targets"]] == [f"kvgate:{s}" for s in STRATEGIES]
    assert recorded_speed(on_disk["machine"]["speed"])
    bound = report["upper_bound"]["hit_rate"]
    assert 0.5 < bound < 1
    for target in report["targets"]:
        assert "error" not in target, target.get("error")
        lat, fleet = target["latency"], target["fleet"]
        assert lat["ok"] == lat["requests"] == 24 and lat["errors"] == 0
        assert lat["ttft_ms_p50"] > 0 and lat["e2e_ms_p50"] >= lat["ttft_ms_p50"]
        assert sum(r["requests"] for r in fleet["replicas"]) == 24  # the probe was sent before the counters
        # the text prompts came back as exactly the workload's tokens at the engines
        assert sum(r["prompt_tokens"] for r in fleet["replicas"]) == report["workload"]["prompt_tokens"]
        assert 0 < fleet["hit_rate"] <= bound + 1e-9
        assert fleet["request_imbalance"] >= 1.0
    limit = on_disk["ttft_limit"]  # the model's prefill alone: below what any router's clients see
    assert 0 < limit["ttft_ms_p50"] <= min(t["latency"]["ttft_ms_p50"] for t in report["targets"])
    for target in on_disk["targets"]:  # with the target's own sends, a prefix there only once computed
        causal = target["ttft_limit_causal"]
        for p in (50, 90, 99):
            assert limit[f"ttft_ms_p{p}"] <= causal[f"ttft_ms_p{p}"] + 1e-9, (target["name"], p)
        assert causal["ttft_ms_p50"] <= target["latency"]["ttft_ms_p50"], target["name"]
        on_replicas = target["ttft_limit_fleet"]  # the opening burst on the fleet's replicas: no less
        for p in (50, 90, 99):
            assert causal[f"ttft_ms_p{p}"] <= on_replicas[f"ttft_ms_p{p}"] + 1e-9, (target["name"], p)
        assert on_replicas["ttft_ms_p50"] <= target["latency"]["ttft_ms_p50"], target["name"]
    # with what one cache of the fleet's GPU blocks would hit: no more than the unbounded cache, MIN >= LRU
    (fleet,) = on_disk["ttft_limit_fleet_cache"].values()
    assert fleet["blocks"] == on_disk["fleet"]["replicas"] * on_disk["fleet"]["gpu_blocks_per_replica"]
    assert 0 < fleet["lru"]["hit_rate"] <= fleet["min"]["hit_rate"] <= bound + 1e-9
    for p in (50, 90, 99):
        assert limit[f"ttft_ms_p{p}"] <= fleet["min"][f"ttft_ms_p{p}"] + 1e-9, p
    markdown = (out / "report.md").read_text()
    assert "| kvgate:kv |" in markdown and "Upper bound" in markdown and "TTFT limit" in markdown
    assert "GPU blocks would have hit instead" in markdown
    assert "limit for its sends" in markdown
    by_name = {t["name"]: t["fleet"]["hit_rate"] for t in report["targets"]}
    assert by_name["kvgate:kv"] > by_name["kvgate:round_robin"]
    # the gateway's predictions (X-Kvgate-Predicted-Ttft-Ms) against the client's TTFT: `ttft` predicts, the rest not
    predicting = [t for t in report["targets"] if t.get("ttft_prediction")]
    assert [t["name"] for t in predicting] == ["kvgate:ttft"]
    prediction = predicting[0]["ttft_prediction"]
    assert len(prediction["pairs"]) == 24 and all(p > 0 and o > 0 for p, o in prediction["pairs"])
    assert prediction["median_abs_relative_error"] is not None
    assert (out / "ttft_predicted.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "kvgate:ttft median error" in markdown and "ttft_predicted.png" in markdown


@pytest.mark.timeout(120)
def test_virtual_time_agrees_with_the_live_fleet(live_report: tuple[dict[str, Any], Path],
                                                  tiny_model_dir: Path) -> None:
    """Same workload, same fleet shape, one request at a time: hit rates within 0.05 (absolute) of the live
    run for every strategy, and round_robin's per-replica request counts identical."""
    report, out = live_report
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    args = compare_args(out, tiny_model_dir)
    workload = build_workload(args, vocab)
    live = {t["policy"]: t["fleet"] for t in report["targets"]}
    for strategy in STRATEGIES:
        sim = FleetSimulation(workload, vocab, strategy=strategy, replicas=2, block_size=16,
                              gpu_blocks=report["fleet"]["gpu_blocks_per_replica"],
                              max_model_len=report["fleet"]["max_model_len"], concurrency=1)
        virtual = sim.run()
        print(f"{strategy}: virtual {virtual['hit_rate']:.3f}, live {live[strategy]['hit_rate']:.3f}")
        assert virtual["completed"] == 24
        assert abs(virtual["hit_rate"] - live[strategy]["hit_rate"]) <= 0.05, (strategy, virtual["hit_rate"],
                                                                             live[strategy]["hit_rate"])
        if strategy == "round_robin":
            assert sorted(virtual["requests_per_replica"]) == sorted(r["requests"] for r in live[strategy]["replicas"])


def test_tiers_turn_gpu_misses_into_tier_hits(tiny_model_dir: Path) -> None:
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    workload = build_workload(compare_args(Path("."), tiny_model_dir), vocab)
    plain = FleetSimulation(workload, vocab, strategy="round_robin", replicas=2, gpu_blocks=40,
                            concurrency=2).run()
    tiered = FleetSimulation(workload, vocab, strategy="round_robin", replicas=2, gpu_blocks=40, concurrency=2,
                             tiers=TierSettings(dram_blocks=64, nvme_blocks=64, write_policy="eager")).run()
    tiers = tiered["hit_rate_by_tier"]
    assert tiers["dram"] + tiers["nvme"] + tiers["shared"] > 0.1
    assert tiers["shared"] > 0  # eager write-through: a replica reads what the other one computed
    assert tiered["hit_rate"] > plain["hit_rate"] + 0.1


@pytest.mark.timeout(60)
def test_a_target_that_cannot_start_is_reported_with_its_error(tiny_model_dir: Path, tmp_path: Path) -> None:
    args = compare_args(tmp_path, tiny_model_dir, targets="kvgate:round_robin", requests_per_user=1)
    fleet = start_sim_fleet(1, tiny_model_dir, model="tiny", speedup=50)
    try:
        target = parse_target("kvgate:kv")
        settings = TargetSettings(16, "tiny", tmp_path / "no-such-model", 2, 1.25, tmp_path / "logs")
        row = asyncio.run(compare.run_target(target, fleet, settings, [], None, args))
    finally:
        fleet.stop()
    assert "fleet" not in row
    assert "exited" in row["error"] and "no-such-model" in row["error"], row["error"]
    assert row["argv"][-2:] == ["--worker", fleet.worker_specs[0]]
    markdown = tmp_path / "report.md"
    write_markdown({"workload": {"name": "x", "requests": 0, "prompt_tokens": 0, "prompt_mode": "text",
                                 "params": {}},
                    "fleet": {"replicas": 1, "profile": "p", "speedup": 1, "block_size": 16,
                              "gpu_blocks_per_replica": 1, "max_model_len": 1},
                    "upper_bound": {"hit_rate": 0.0, "definition": "d"}, "load": {"mode": "closed",
                                                                                 "concurrency": 1, "rate": None},
                    "command": "c", "created": "t", "machine": {"python": "3", "cpus": 1}, "targets": [row]},
                   markdown)
    assert "Did not run" in markdown.read_text() and "no-such-model" in markdown.read_text()


def test_the_readme_benchmark_commands_parse() -> None:
    """Every `kvgate bench compare|vsim|calibrate|plan ...` command the README shows is accepted by the
    benchmark's parser."""
    import re
    import shlex

    from bench import calibrate, plan, vsim

    modules = {"compare": compare, "vsim": vsim, "calibrate": calibrate, "plan": plan}
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text().replace("\\\n", " ")
    commands = re.findall(r"^kvgate bench (compare|vsim|calibrate|plan) (.*)$", readme, re.M)
    commands += re.findall(r"`kvgate bench (compare|vsim|calibrate|plan) ([^`]*)`", readme)
    assert {name for name, _ in commands} == set(modules)
    for name, rest in commands:
        parser = argparse.ArgumentParser(exit_on_error=False)
        modules[name].add_arguments(parser)
        args = parser.parse_args(shlex.split(rest))
        for target in getattr(args, "targets", "").split(","):
            if target:
                parse_target(target)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.timeout(120)
def test_a_sigterm_to_the_benchmark_stops_the_fleet_it_started(tiny_model_dir: Path, tmp_path: Path,
                                                                subprocess_env: dict[str, str]) -> None:
    """`kill PID` of a running `kvgate bench compare` stops the replicas and gateways it started (they are in its
    process group but not reached by a signal to its PID alone): Python's default SIGTERM would end the benchmark
    without its `finally` blocks and leave them running."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "bench", "compare", "--workload", "tenants", "--tenants", "4",
         "--users", "8", "--requests-per-user", "8", "--prefix-tokens", "256", "--replicas", "2",
         "--model-dir", str(tiny_model_dir), "--speedup", "1", "--concurrency", "1", "--no-progress",
         "--targets", "kvgate:round_robin", "--out", str(tmp_path / "out")],
        env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and bench.poll() is None:
            children = [p for p in _descendants(bench.pid)[1:] if "kvgate.cli" in _cmdline(p)]
            if sum(" sim " in _cmdline(p) for p in children) == 2 and any(" serve " in _cmdline(p) for p in children):
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"no fleet and gateway came up: {bench.stderr.read().decode()[-2000:]}"
                                 if bench.stderr else "no fleet")
        bench.send_signal(signal.SIGTERM)
        status = bench.wait(timeout=60)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_cmdline(p) for p in children):
            time.sleep(0.1)
        assert [_cmdline(p) for p in children if _cmdline(p)] == []
        assert status == 128 + signal.SIGTERM
    finally:
        for pid in [bench.pid, *children]:
            if _cmdline(pid):
                os.kill(pid, signal.SIGKILL)
        bench.wait()
