"""bench/gpu_profile.py and bench/gpu_check.py run anywhere (without CUDA: a small shape on the CPU, the CPU cache
layout against a real agent), and the H200 profile is what its committed measurements fit to (the GPU figures come
from a run on a lent H200: docs/gpu/)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.procs import valkey_server_binary
from bench.sim.perf_model import PROFILES
from bench.vllm_engine import ensure_vllm_venv
from tests.conftest import ROOT

MEASURED = ROOT / "docs" / "gpu" / "gpu_profile.json"


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([str(ensure_vllm_venv()), "-m", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=ROOT)


def test_the_profile_benchmark_measures_and_fits_a_small_model_on_the_cpu(tmp_path: Path) -> None:
    out = run_bench("bench.gpu_profile", "--new", "32,64,128", "--cached", "0,128", "--batches", "1,4",
                    "--long-contexts", "", "--context", "64", "--repeat", "2", "--fit-min-new", "32",
                    "--out", str(tmp_path / "p.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("# CPU (no CUDA device present)")
    result = json.loads((tmp_path / "p.json").read_text())
    assert [(p["new"], p["cached"]) for p in result["prefill"]] == [(n, c) for c in (0, 128) for n in (32, 64, 128)]
    assert [(d["batch"], d["context"]) for d in result["decode"]] == [(1, 64), (4, 64)]
    assert all(p["seconds"] > 0 for p in result["prefill"])
    assert result["params"] == 2 * 590_336 + 2 * 1024 * 256 + 256  # two layers, embeddings and head, final norm
    # a fit of non-negative terms (small shapes' timings on a loaded CPU fitted negative ones), the matmuls' always
    fit = result["fit"]
    assert fit["matmul_tflops"] > 0 and fit["attention_tflops"] > 0 and fit["prefill_pass_s"] >= 0
    assert len(result["table"]) == 8


FIT_CHECK = """
import torch
from bench.gpu_profile import fit
exact = [((1.0, n, n * n), 0.5 + 2 * n + 0.01 * n * n) for n in (1, 2, 3, 5, 8)]
assert all(abs(c - want) < 1e-9 for c, want in zip(fit(exact), (0.5, 2.0, 0.01)))  # a non-negative fit: as lstsq
# times whose least-squares pass is negative (-0.3 s): that term is left out, the others refitted, none negative
rows = [((1.0, n, n * n), -0.3 + n + 0.05 * n * n) for n in range(1, 9)]
a = torch.tensor([[xi / t for xi in x] for x, t in rows], dtype=torch.float64)
plain = torch.linalg.lstsq(a, torch.ones(len(rows), 1, dtype=torch.float64)).solution.flatten().tolist()
assert plain[0] < -0.29, plain
pass_s, per_n, per_n2 = fit(rows)
assert pass_s == 0 and per_n > 0 and per_n2 > 0, (pass_s, per_n, per_n2)
# a required term stays in even where leaving it out fits better
assert fit([((1.0, n), 5.0) for n in (1, 2, 3)], required=(1,))[1] >= 0
print("ok")
"""


def test_the_fit_keeps_every_term_non_negative() -> None:
    """Times per unit of work are never negative: the noisy timings of small shapes on a loaded CPU fitted a
    negative pass or rate with plain least squares, and the profile test failed under load."""
    out = subprocess.run([str(ensure_vllm_venv()), "-c", FIT_CHECK], env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_the_h200_profile_is_the_fit_of_the_committed_measurements(tmp_path: Path) -> None:
    out = run_bench("bench.gpu_profile", "--refit", str(MEASURED), "--peak-tflops", "989", "--hbm-tb-s", "4.8",
                    "--out", str(tmp_path / "refit.json"))
    assert out.returncode == 0, out.stderr[-3000:]
    fit = json.loads((tmp_path / "refit.json").read_text())["fit"]
    h200 = PROFILES["llama-3.1-8b-h200"]
    assert (h200.peak_flops, h200.hbm_bytes_per_s) == (989e12, 4.8e12)
    assert (h200.mfu, h200.attention_efficiency, h200.bandwidth_efficiency) == (
        round(fit["mfu"], 2), round(fit["attention_efficiency"], 2), round(fit["bandwidth_efficiency"], 2))
    # prefills of 1,024 tokens and more: the fitted model within 1% of each measurement
    refit = json.loads((tmp_path / "refit.json").read_text())
    big = [t for t in refit["table"] if t["what"].startswith("prefill") and int(t["what"].split()[1]) >= 1024]
    assert len(big) == 16 and all(abs(t["fitted_s"] / t["measured_s"] - 1) < 0.01 for t in big)


@pytest.mark.parametrize("tier", ["dram", "nvme", "shared"])
def test_the_connector_check_passes_against_a_real_agent_on_the_cpu(tmp_path: Path, tier: str) -> None:
    out = run_bench("bench.gpu_check", "--agent-python", sys.executable, "--layers", "2", "--num-blocks", "64",
                    "--shm-mib", "1", "--staging-mib", "1", "--tier", tier, "--capacity", "256MiB", "--sizes", "4",
                    "--repeat", "2", "--valkey-server", valkey_server_binary(), "--out", str(tmp_path / "c.json"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    checks = {r["check"]: r for r in rows if "check" in r}
    assert checks["pinned"]["ok"] and checks["pinned"]["pinned"] == [False, False]  # nothing to pin on a CPU
    trip = checks["round trip"]
    assert trip["ok"] and trip["identical"] == trip["blocks"] == 29 and trip["batch_blocks"] == 8
    assert "# ordering: skipped (no CUDA streams on the CPU)" in out.stdout
    assert {(r["measure"], r["blocks"]) for r in rows if "measure" in r} == {("save", 4), ("load", 4)}
    # every load was served by that tier alone: the round trip's 29 blocks, then the two timed loads' 4 each
    assert checks["tier"]["ok"] and checks["tier"]["agent_tiers"] == {tier: {"blocks": 37, "hits": 37}}
    assert out.stdout.rstrip().endswith("# all checks passed")
