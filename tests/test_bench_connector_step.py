"""bench/connector_step.py runs (small) and reports both connectors: the time the step spends in the connector's
hooks and the time until the agent holds the blocks."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_connector_step_benchmark_reports_both_connectors() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.connector_step", "--layers", "2", "--blocks", "2", "--steps",
                          "3", "--rounds", "1"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[0])
    for name in ("async", "sync"):
        assert 0 < result[name]["hook_ms_median"] <= result[name]["stored_ms_median"] + 1e-6, result
