"""bench/nvme_reads.py: the NVMe segment tier's loads of long runs, one thread against the copy threads or another
revision's tier, side by side: it runs, reads every block back and reports what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.mark.parametrize("base", [None, "HEAD"])
def test_the_benchmark_reads_every_block_and_reports_both_ways(tmp_path: Path, base: str | None) -> None:
    args = [sys.executable, "-m", "bench.nvme_reads", "--blocks", "2,20", "--block-mib", "0.5", "--threads", "2",
            "--rounds", "2", "--dir", str(tmp_path)]
    if base:
        args += ["--base", base]
    out = subprocess.run(args, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [row["blocks"] for row in rows] == [2, 20]
    assert all(row["block_bytes"] == 2**19 and row["threads"] == 2 and row["rounds"] == 2 for row in rows)
    assert all(row["base"] == (f"{base} (one thread)" if base else "no copier (one thread)") for row in rows)
    assert all(row["base_gb_per_s"] > 0 and row["parts_gb_per_s"] > 0 and row["ratio"] > 0 for row in rows)
