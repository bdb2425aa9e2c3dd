"""`kvgate bench overhead` end to end on a small scale: stand-ins, one kvgate target, both APIs, the /health stall
probe, the JSON report."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import orjson
import pytest

from bench.overhead import Workload, add_arguments, run
from tests.conftest import recorded_speed


def test_workload_shares_system_prompts_and_never_repeats_a_question() -> None:
    w = Workload("chat", 500, 4, False)
    bodies = [orjson.loads(b) for b in w.bodies(8)]
    systems = [b["messages"][0]["content"] for b in bodies]
    assert len(set(systems)) == 4 and systems[:4] == systems[4:] and all(len(s) == 500 for s in systems)
    assert len({b["messages"][1]["content"] for b in bodies}) == 8
    completion = orjson.loads(Workload("completions", 500, 4, False).bodies(1)[0])
    assert completion["prompt"].startswith(systems[0])


def test_overhead_benchmark_runs_and_reports(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args(["--target", "kvgate:prefix", "--prompt-chars", "300", "--system-prompts", "4",
                              "--requests", "40", "--rounds", "1", "--concurrency", "1", "--concurrency", "4",
                              "--workers", "2", "--stall-chars", "2000", "--stall-requests", "5", "--out", str(out)])
    assert run(args) == 0
    report = orjson.loads(out.read_bytes())
    assert {(r["api"], r["concurrency"]) for r in report["results"]} == {
        ("chat", 1), ("chat", 4), ("completions", 1), ("completions", 4)}
    assert all(r["target"] == "kvgate:prefix" and r["errors"] == 0 and r["gateway_rps"] > 0
               for r in report["results"])
    assert [s["api"] for s in report["health_stalls"]] == ["chat", "completions"]
    assert all(s["health_probes"] > 0 and s["errors"] == 0 for s in report["health_stalls"])
    assert recorded_speed(report["machine_speed"])


@pytest.mark.skipif(shutil.which("git") is None or not (Path(__file__).resolve().parent.parent / ".git").exists(),
                    reason="needs this repository's git history")
def test_against_runs_a_revision_side_by_side(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "overhead.json"
    args = parser.parse_args(["--target", "kvgate:round_robin", "--against", "HEAD", "--api", "completions",
                              "--prompt-chars", "300", "--system-prompts", "4", "--requests", "100", "--rounds", "2",
                              "--concurrency", "2", "--workers", "2", "--out", str(out)])
    assert run(args) == 0
    report = orjson.loads(out.read_bytes())
    assert sorted(r["target"] for r in report["results"]) == ["kvgate:round_robin", "kvgate:round_robin@HEAD"]
    assert all(r["errors"] == 0 and r["gateway_cpu_us_per_request"] > 0 for r in report["results"])
