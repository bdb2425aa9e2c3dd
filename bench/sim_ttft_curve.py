"""TTFT vs prompt length: the time model's prediction for a profile, and what a running `kvgate sim` replica
actually takes (measured over HTTP with streaming, one request at a time, cold and with a cached prefix).

Prints the profile's parameters and the table, writes JSON and a PNG (matplotlib):

    kvgate bench sim-ttft [--profile llama-3.1-8b-h100] [--out-dir docs]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from bench.procs import free_port, spawn_kvgate, stop, wait_http
from bench.sim.perf_model import PROFILES, Profile

LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CACHED_FRACTION = 0.75
BLOCK = 16


def predicted(profile: Profile, length: int, cached: int) -> float:
    return profile.prefill_time(length - cached, cached)


async def measure(url: str, lengths: list[int], repeats: int, speedup: float) -> dict[int, dict[str, float]]:
    rng = random.Random(0)
    out: dict[int, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:

        async def ttft(prompt: list[int]) -> tuple[float, int]:
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", json={
                    "model": "tiny", "prompt": prompt, "max_tokens": 2, "stream": True,
                    "stream_options": {"include_usage": True}}) as resp:
                assert resp.status == 200, await resp.text()
                first = 0.0
                cached = 0
                async for line in resp.content:
                    if not first and line.startswith(b"data: {"):
                        first = time.perf_counter() - t0
                    if b'"usage":{' in line:
                        cached = json.loads(line[6:])["usage"]["prompt_tokens_details"]["cached_tokens"]
            return first * speedup, cached

        for length in lengths:
            cold, warm = [], []
            for _ in range(repeats):
                prompt = [rng.randrange(5, 4000) for _ in range(length)]
                t, hit = await ttft(prompt)
                assert hit == 0
                cold.append(t)
                # the same leading 75 % (block-aligned) with a new tail: a prefix hit
                keep = int(length * CACHED_FRACTION) // BLOCK * BLOCK
                t, hit = await ttft(prompt[:keep] + [rng.randrange(5, 4000) for _ in range(length - keep)])
                assert hit == keep, (hit, keep)
                warm.append(t)
            out[length] = {"cold_s": statistics.median(cold), "cached_s": statistics.median(warm)}
    return out


def plot(path: Path, profile: Profile, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, [r["model_cold_ms"] for r in rows], "-", color="C0", label="model: cold")
    ax.plot(x, [r["model_cached_ms"] for r in rows], "-", color="C1", label=f"model: {CACHED_FRACTION:.0%} cached")
    if rows and rows[0].get("measured_cold_ms") is not None:
        ax.plot(x, [r["measured_cold_ms"] for r in rows], "o", color="C0", label="kvgate sim: cold")
        ax.plot(x, [r["measured_cached_ms"] for r in rows], "s", color="C1",
                label=f"kvgate sim: {CACHED_FRACTION:.0%} cached")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title(f"{profile.name}: TTFT vs prompt length (one request, idle engine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe(profile: Profile) -> dict[str, Any]:
    m = profile.model
    return {
        "profile": profile.name, "description": profile.description,
        "params": m.params, "layers": m.layers, "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "peak_tflops": profile.peak_flops / 1e12, "hbm_tb_per_s": profile.hbm_bytes_per_s / 1e12,
        "mfu": profile.mfu, "bandwidth_efficiency": profile.bandwidth_efficiency,
        "step_overhead_ms": profile.step_overhead_s * 1e3, "kv_cache_gb": profile.kv_cache_bytes / 1e9,
        "num_gpu_blocks_at_16": profile.num_gpu_blocks(16), "max_num_batched_tokens": profile.max_num_batched_tokens,
        "sources": profile.sources,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PROFILES))
    parser.add_argument("--max-tokens", type=int, default=32768, help="longest prompt measured")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speedup", type=float, default=1.0, help="run the replica faster; times are scaled back")
    parser.add_argument("--model-only", action="store_true", help="no replica: only the model's curve")
    parser.add_argument("--out-dir", default="docs")


def run(args: argparse.Namespace) -> int:
    profile = PROFILES[args.profile]
    lengths = [n for n in LENGTHS if n <= args.max_tokens]
    measured: dict[int, dict[str, float]] = {}
    if not args.model_only:
        with tempfile.TemporaryDirectory() as tmp:
            from bench.make_model import write_model

            model_dir = Path(tmp) / "tiny"
            write_model(model_dir)
            port = free_port()
            proc = spawn_kvgate(["sim", "--model-dir", str(model_dir), "--served-model-name", "tiny",
                                 "--port", str(port), "--no-kv-events", "--profile", profile.name,
                                 "--max-model-len", str(max(lengths) + 16), "--speedup", str(args.speedup),
                                 "--enable-prompt-tokens-details", "--block-size", str(BLOCK),
                                 "--log-level", "warning"], env=os.environ)
            try:
                wait_http(f"http://127.0.0.1:{port}/health", 30)
                measured = asyncio.run(measure(f"http://127.0.0.1:{port}", lengths, args.repeats, args.speedup))
            finally:
                stop(proc)
    rows = []
    for n in lengths:
        keep = int(n * CACHED_FRACTION) // BLOCK * BLOCK
        row: dict[str, Any] = {"prompt_tokens": n, "cached_tokens": keep,
                               "model_cold_ms": round(predicted(profile, n, 0) * 1e3, 2),
                               "model_cached_ms": round(predicted(profile, n, keep) * 1e3, 2),
                               "measured_cold_ms": None, "measured_cached_ms": None}
        if n in measured:
            row["measured_cold_ms"] = round(measured[n]["cold_s"] * 1e3, 2)
            row["measured_cached_ms"] = round(measured[n]["cached_s"] * 1e3, 2)
        rows.append(row)
    params = describe(profile)
    print("profile parameters:")
    for key, value in params.items():
        print(f"  {key:<24} {value}")
    print(f"{'prompt':>7} {'cached':>7} {'model cold ms':>14} {'sim cold ms':>12} {'model cached ms':>16} "
          f"{'sim cached ms':>14}")
    for r in rows:
        print(f"{r['prompt_tokens']:>7} {r['cached_tokens']:>7} {r['model_cold_ms']:>14.2f} "
              f"{r['measured_cold_ms'] or float('nan'):>12.2f} {r['model_cached_ms']:>16.2f} "
              f"{r['measured_cached_ms'] or float('nan'):>14.2f}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"sim_ttft_{profile.name}"
    (out_dir / f"{stem}.json").write_text(json.dumps({"parameters": params, "rows": rows,
                                                      "speedup": args.speedup}, indent=2) + "\n")
    plot(out_dir / f"{stem}.png", profile, rows)
    print(f"wrote {out_dir / stem}.json and .png")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
