"""`kvgate bench plan`: a grid over a trace, the table, the plots, and the smallest configuration meeting the
objective with the traffic each tier carries."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.plan import parse_duration
from tests.conftest import recorded_speed
from tests.test_traces import conversations


def plan(tmp_path: Path, model_dir: Path, trace: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", "bench", "plan", "--trace", str(trace),
                           "--model-dir", str(model_dir), "--time-scale", "4", "--gpu-blocks", "150",
                           "--no-progress", "--out", str(tmp_path / "plan"), *extra],
                          capture_output=True, text=True, timeout=400)


@pytest.mark.timeout(420)
def test_the_plan_is_the_smallest_configuration_meeting_the_objective(tmp_path: Path, tiny_model_dir: Path) -> None:
    trace = conversations(tmp_path / "c.jsonl", 150)
    done = plan(tmp_path, tiny_model_dir, trace, "--slo-ttft-p90", "200ms", "--strategies", "round_robin,kv",
                "--replicas", "1,2", "--dram-gb", "0,0.2", "--shared-gb", "0,1", "--jobs", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    result = orjson.loads((tmp_path / "plan" / "plan.json").read_bytes())
    rows = result["results"]
    assert len(rows) == 2 * 2 * 2 * 2 and result["slo"] == {"p90": 0.2}
    assert recorded_speed(result["machine_speed"])
    meeting = [r for r in rows if r["ttft_ms_p90"] <= 200]
    assert meeting and len(meeting) < len(rows), [(r["point"], r["ttft_ms_p90"]) for r in rows]
    choice = result["choice"]
    assert choice["ttft_ms_p90"] <= 200
    assert choice["replicas"] == min(r["replicas"] for r in meeting)
    assert choice["point"]["tier_gb"] == min(r["point"]["tier_gb"] for r in meeting
                                             if r["replicas"] == choice["replicas"])
    tiered = [r for r in rows if r["point"]["tier_gb"] > 0]
    assert all("tier_traffic" in r for r in tiered) and not any("tier_traffic" in r for r in rows
                                                                 if r["point"]["tier_gb"] == 0)
    with_shared = [r for r in tiered if r["point"]["shared_gb"] > 0 and r["strategy"] == "round_robin"]
    assert any(r["tier_traffic"]["shared"]["write_gbps"] > 0 for r in with_shared)
    assert all(r["tier_traffic"]["shared"]["write_gbps"] == 0 for r in tiered if r["point"]["shared_gb"] == 0)
    out = done.stdout
    assert "smallest configuration meeting TTFT p90 <= 200 ms" in out and "hit rate" in out
    for name in ("plan.md", "plan_fleet.png", "plan_dram.png", "plan_shared.png"):
        assert (tmp_path / "plan" / name).stat().st_size > 0
    assert "| meets |" in (tmp_path / "plan" / "plan.md").read_text()


@pytest.mark.timeout(120)
def test_an_objective_nothing_meets_and_one_missing(tmp_path: Path, tiny_model_dir: Path) -> None:
    trace = conversations(tmp_path / "c.jsonl", 30)
    done = plan(tmp_path, tiny_model_dir, trace, "--slo-ttft-p50", "0.1ms", "--strategies", "kv", "--replicas", "1",
                "--dram-gb", "0")
    assert done.returncode == 0 and "no configuration of the grid meets TTFT p50 <= 0.1 ms" in done.stdout
    assert orjson.loads((tmp_path / "plan" / "plan.json").read_bytes())["choice"] is None
    missing = plan(tmp_path, tiny_model_dir, trace)
    assert missing.returncode == 2 and "give an objective" in missing.stderr
    bad = plan(tmp_path, tiny_model_dir, trace, "--slo-ttft-p90", "soon")
    assert bad.returncode == 2 and "not a duration" in bad.stderr


def test_durations() -> None:
    assert parse_duration("2s") == 2.0 and parse_duration("500ms") == 0.5 and parse_duration("1.5") == 1.5
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("2 minutes")
