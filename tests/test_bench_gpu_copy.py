"""bench/gpu_copy.py runs anywhere: without CUDA it says so and measures host-to-host copies of the CPU cache
layout, with the real block copies of agent/kv_layout.py, its staging path included (the GPU figures come from a
run on a lent GPU)."""

from __future__ import annotations

import json
import os
import subprocess

from bench.vllm_engine import ensure_vllm_venv
from tests.conftest import ROOT


def test_gpu_copy_benchmark_runs_without_cuda_and_says_so() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([str(ensure_vllm_venv()), "-m", "bench.gpu_copy", "--layers", "2", "--num-blocks", "16",
                          "--blocks", "4", "--repeat", "2"], env=env, capture_output=True, text=True, timeout=300,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# no CUDA device present")
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert {(r["direction"], r["way"]) for r in rows} == {
        (d, w) for d in ("save", "load") for w in ("raw memcpy", "staging (forced)", "per-layer pageable")}
    assert all(r["gb_per_s"] > 0 and r["block_bytes"] == 2 * 8 * 16 * 256 * 2 for r in rows)
