"""`kvgate bench compare`: one workload, one simulated fleet, a list of routers run one after another.

For each target (bench/targets.py: kvgate strategies, sglang-router, vllm-router) the runner resets every
replica's prefix cache (`POST /reset_prefix_cache`), starts the router, checks it answers a probe request,
resets again, replays the workload through it (streamed completions; open loop by arrival times or Poisson, or
closed loop at a fixed concurrency) and reads the replicas' counters before and after. Beside every run: the
hit rate an ideal single unbounded cache would reach on the same request sequence. A target that cannot be
installed or started is reported with its error, never dropped. Writes `report.json` (every figure),
`report.md` and PNG plots (TTFT CDF per target, hit rate vs the bound, per-replica load) into `--out`.

    kvgate bench compare --workload tenants --replicas 4 --speedup 10 --out out/compare
    kvgate bench compare --workload mooncake --limit 200 --block-tokens 32 --time-scale 4 \
        --targets kvgate:kv,sglang:cache_aware
    kvgate bench compare --workload multi_turn --with-agents --targets kvgate:round_robin,kvgate:kv ...

`--with-agents` runs every target a second time on a fleet whose replicas each have a real `kvgate agent`
beside them (and share one Valkey): rows `TARGET+agent`, with every tier emptied before each target.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import platform
import shlex
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from agent.tiers.dram import block_charge
from bench import loadgen, machine, vsim_report, workloads
from bench.make_model import bench_model_dir
from bench.report import write_markdown, write_plots
from bench.sim.launch import AgentSettings, SimFleet, start_sim_fleet
from bench.sim.perf_model import Profile, load_profile
from bench.targets import DEFAULT_TARGETS, Target, TargetError, TargetSettings, parse_target
from bench.workload_options import add_workload_arguments, build_workload
from bench.workloads import PromptVocabulary
from router.block_keys import block_keys, root_key

MODEL = "tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="comma-separated KIND:POLICY[:VARIANT] (bench/targets.py)")
    parser.add_argument("--out", default="out/compare", help="directory for report.json, report.md, PNGs")
    parser.add_argument("--model-dir", default=None, help="tokenizer dir (default: `kvgate make-model` output)")
    f = parser.add_argument_group("fleet")
    f.add_argument("--replicas", type=int, default=4)
    f.add_argument("--profile", default="llama-3.1-8b-h100")
    f.add_argument("--speedup", type=float, default=10.0, help="sim time divisor (client latencies are wall time)")
    f.add_argument("--block-size", type=int, default=16)
    f.add_argument("--gpu-blocks", type=int, default=512, help="KV blocks per replica")
    l_ = parser.add_argument_group("load")
    l_.add_argument("--mode", choices=["open", "closed"], default=None,
                    help="open: arrival times (the trace's, or Poisson at --rate); closed: --concurrency clients "
                         "(default: open for timed workloads, closed otherwise)")
    l_.add_argument("--rate", type=float, default=None, help="open loop without timestamps: Poisson requests/s")
    l_.add_argument("--concurrency", type=int, default=8)
    l_.add_argument("--prompt-mode", choices=["text", "ids"], default="text")
    l_.add_argument("--request-timeout-s", type=float, default=300.0)
    l_.add_argument("--no-progress", action="store_true")
    a = parser.add_argument_group("tier agents")
    a.add_argument("--with-agents", action="store_true",
                   help="run every target again on replicas with a real `kvgate agent` each (rows TARGET+agent)")
    a.add_argument("--agent-write-policy", choices=["eager", "lazy"], default="eager",
                   help="the agents' write policy (eager: written through to the shared Valkey tier)")
    a.add_argument("--agent-dram-blocks", type=int, default=0,
                   help="blocks each agent's DRAM tier holds (0: the agent's default, 1 GiB: 1.86 million of the "
                        "64-byte stand-ins, each charged 576 bytes with its bookkeeping)")
    a.add_argument("--agent-nvme", action="store_true", help="give each agent an NVMe tier (a temporary directory)")
    a.add_argument("--no-agent-shared", action="store_true", help="no shared Valkey tier")
    a.add_argument("--agent-link", action="append", default=None, metavar="CODE=GBPS:LATENCY_US",
                   help="the replicas' transfer model of one tier (kvgate sim --agent-link)")
    p = parser.add_argument_group("peers")
    p.add_argument("--peer-balance-abs", type=int, default=None,
                   help="tuned cache_aware --balance-abs-threshold (default: max(2, concurrency / replicas))")
    p.add_argument("--peer-balance-rel", type=float, default=1.25, help="tuned cache_aware --balance-rel-threshold")
    add_workload_arguments(parser)


def _post(url: str, timeout: float = 10.0) -> bytes:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def reset_fleet(fleet: SimFleet) -> None:
    for url in fleet.urls:
        body = _post(url + "/reset_prefix_cache?reset_running_requests=true")
        if b"true" not in body:
            raise RuntimeError(f"{url} refused to reset its prefix cache: {body[:200]!r}")


async def probe(http: aiohttp.ClientSession, target: Target, deadline_s: float) -> None:
    """Until the router answers one small completion (peers take a while to register workers)."""
    body = orjson.dumps({"model": MODEL, "prompt": "probe", "max_tokens": 1})
    deadline = time.monotonic() + deadline_s
    last = ""
    while time.monotonic() < deadline:
        if target.proc is not None and target.proc.poll() is not None:
            raise TargetError(f"{target.name} exited with {target.proc.returncode}: {target.log_tail()}")
        try:
            async with http.post(target.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"},
                                 timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status == 200:
                    await resp.read()
                    return
                last = f"HTTP {resp.status}: {(await resp.text())[:200]}"
        except (TimeoutError, aiohttp.ClientError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        await asyncio.sleep(0.3)
    raise TargetError(f"{target.name} did not answer a probe within {deadline_s:.0f} s ({last}); "
                      f"log: {target.log_tail()}")


async def run_target(target: Target, fleet: SimFleet, settings: TargetSettings, bodies: list[bytes],
                     arrivals: list[float] | None, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"name": target.name, "kind": target.kind, "policy": target.policy,
                           "variant": target.variant}
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s, sock_read=args.request_timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        try:
            reset_fleet(fleet)
            target.start(fleet, settings)
            row.update({"argv": target.argv, "config": target.config, "version": target.version})
            await probe(http, target, 60.0)
            await asyncio.sleep(0.3)  # the probe's blocks are announced, then cleared with the reset
            reset_fleet(fleet)
            await asyncio.sleep(0.5)  # AllBlocksCleared reaches event subscribers
            before = await loadgen.scrape(http, fleet.urls)
            started = time.perf_counter()
            if arrivals is not None:
                results = await loadgen.open_loop(http, target.url, bodies, arrivals,
                                                  progress=not args.no_progress, desc=target.name)
            else:
                results = await loadgen.closed_loop(http, target.url, bodies, args.concurrency,
                                                    progress=not args.no_progress, desc=target.name)
            seconds = time.perf_counter() - started
            after = await loadgen.scrape(http, fleet.urls)
            row["seconds"] = seconds
            row["latency"] = loadgen.latency_summary(results)
            row["fleet"] = loadgen.fleet_summary(before, after, seconds, fleet.urls)
            row["ttft_ms"] = sorted(r.ttft_s * 1e3 for r in results if r.ttft_s is not None)
            pairs = [(r.predicted_ttft_s, r.ttft_s) for r in results
                     if r.predicted_ttft_s is not None and r.ttft_s is not None]
            if pairs:
                row["ttft_prediction"] = vsim_report.prediction_summary(pairs)
            row["per_request"] = [{"start_s": r.start_s, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
                                   "itl_mean_s": sum(r.itl_s) / len(r.itl_s) if r.itl_s else None,
                                   "output_tokens": r.output_tokens, "prompt_tokens": r.prompt_tokens,
                                   "cached_tokens": r.cached_tokens, "predicted_ttft_s": r.predicted_ttft_s,
                                   "error": r.error} for r in results]
        except (TargetError, OSError, RuntimeError, urllib.error.URLError) as exc:
            row["error"] = str(exc)[:3000]
        finally:
            target.stop()
    return row


def _model_dir(args: argparse.Namespace) -> Path:
    return bench_model_dir(args.model_dir)


async def compare(args: argparse.Namespace) -> dict[str, Any]:
    targets = [parse_target(t.strip()) for t in args.targets.split(",") if t.strip()]
    model_dir = _model_dir(args)
    vocab = PromptVocabulary.from_model_dir(model_dir)
    workload = build_workload(args, vocab)
    wire = [vocab.wire_ids(r.token_ids) for r in workload.requests]
    longest = max(len(w) + r.max_tokens for w, r in zip(wire, workload.requests, strict=True))
    bs = args.block_size
    max_model_len = max(256, int(math.ceil((longest + 1) / bs) * bs))
    gpu_blocks = max(args.gpu_blocks, max_model_len // bs + 2)
    mode = args.mode or ("open" if workload.timed or args.rate else "closed")
    arrivals: list[float] | None = None
    if mode == "open":
        if workload.timed:
            arrivals = [r.arrival_s or 0.0 for r in workload.requests]
        else:
            if not args.rate:
                raise SystemExit("--mode open on an untimed workload needs --rate")
            arrivals = workloads.poisson_arrivals(len(workload.requests), args.rate, args.seed)
    bodies = [loadgen.request_body(r, vocab, MODEL, args.prompt_mode) for r in workload.requests]
    bound = workloads.ideal_hit_rate(wire, bs)
    profile = load_profile(args.profile).sped_up(args.speedup)
    prompts = [(len(ids), block_keys(ids, bs, root_key("bench"))) for ids in wire]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)  # noqa: ASYNC240 - once, before any traffic
    balance_abs = args.peer_balance_abs or max(2, round(args.concurrency / args.replicas))
    settings = TargetSettings(bs, MODEL, model_dir, balance_abs, args.peer_balance_rel, out / "logs")
    before = machine.probe()
    print(before.describe(), flush=True)
    report: dict[str, Any] = {
        "benchmark": "compare", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "workload": {"name": workload.name, "params": workload.params, "requests": len(workload.requests),
                     "prompt_tokens": sum(len(w) for w in wire), "prompt_mode": args.prompt_mode},
        "load": {"mode": mode, "rate": args.rate, "concurrency": args.concurrency if mode == "closed" else None},
        "fleet": {"replicas": args.replicas, "profile": args.profile, "speedup": args.speedup,
                  "block_size": bs, "gpu_blocks_per_replica": gpu_blocks, "max_model_len": max_model_len},
        "upper_bound": {"hit_rate": bound.hit_rate, "hit_tokens": bound.hit_tokens,
                        "query_tokens": bound.query_tokens,
                        "definition": "one unbounded cache, same request order, leading full blocks of "
                                      f"{bs} tokens, never the last prompt token (as vLLM counts)"},
        # each request's prefill alone with the ideal hit, in the fleet's wall time (the model's / speedup); the
        # router's and HTTP's own time comes on top of it in every row
        "ttft_limit": {k: None if v is None else v / args.speedup
                       for k, v in vsim_report.ttft_limit(bound, load_profile(args.profile)).items()},
        # the same with what one cache of the fleet's GPU blocks would have hit (LRU, and the most any eviction
        # keeps: MIN); for the replicas without agents, whose GPU cache is all they have
        "ttft_limit_fleet_cache": vsim_report.fleet_cache_limit(
            prompts, bs, {str(args.replicas): args.replicas * gpu_blocks}, load_profile(args.profile).sped_up(
                args.speedup)),
        # per target (`ttft_limit_causal`): the same, but each request sent when that target's client sent it and a
        # prefix there only once a prefill computing it has (`vsim_report.causal_ttfts`); and (`ttft_limit_fleet`)
        # that with the opening burst's prefills on the fleet's replicas (`vsim_report.fleet_ttfts`)
        "peer_tuning": {"balance_abs_threshold": balance_abs, "balance_rel_threshold": args.peer_balance_rel},
        "command": _command_line(),
        "targets": [],
    }
    engine_args = ["--block-size", str(bs), "--num-gpu-blocks-override", str(gpu_blocks),
                   "--max-model-len", str(max_model_len)]
    runs: list[tuple[str, AgentSettings | None]] = [("", None)]
    if args.with_agents:
        tiers = agent_settings(args)
        runs.append(("+agent", tiers))
        report["agents"] = {"write_policy": tiers.write_policy, "dram_capacity": tiers.dram_capacity or "default",
                            "nvme": tiers.nvme, "shared": "one Valkey" if tiers.shared else None,
                            "sim_args": list(tiers.sim_args)}
    names = [t.name for t in targets]
    for suffix, agents in runs:
        fleet = start_sim_fleet(args.replicas, model_dir, model=MODEL, profile=args.profile, speedup=args.speedup,
                                extra_args=engine_args, timeout=60, agents=agents)
        try:
            for target, base in zip(targets, names, strict=True):
                if agents is not None:
                    fleet.reset_agents()
                target.name = name = base + suffix  # also names its log file
                row = await run_target(target, fleet, settings, bodies, arrivals, args)
                row["agents"] = agents is not None
                if "per_request" in row:
                    row["ttft_limit_causal"], row["ttft_limit_fleet"] = send_limits(
                        prompts, row["per_request"], bs, profile, args.replicas, split=agents is not None)
                bound_rate = bound.hit_rate
                if "fleet" in row:
                    row["fraction_of_bound"] = row["fleet"]["hit_rate"] / bound_rate if bound_rate else None
                    lat = row["latency"]
                    incl = f" incl. tiers {row['fleet']['hit_rate_with_tiers']:.3f}" if agents else ""
                    print(f"{name:32s} hit {row['fleet']['hit_rate']:.3f}{incl} (bound {bound_rate:.3f})  "
                          f"TTFT p50 {_ms(lat['ttft_ms_p50'])} p90 {_ms(lat['ttft_ms_p90'])}  errors "
                          f"{lat['errors']}  imbalance {row['fleet']['request_imbalance'] or 0:.2f}", flush=True)
                else:
                    print(f"{name:32s} FAILED: {row['error'][:300]}", flush=True)
                report["targets"].append(row)
        finally:
            fleet.stop()
    # the gateway's predicted TTFT for the worker it chose (its X-Kvgate-Predicted-Ttft-Ms) against the client's
    after = machine.probe()
    print(after.describe(), flush=True)
    report["machine"]["speed"] = machine.probes(before, after)
    panels = [{**row, "title": row["name"], "observed_label": "client's TTFT (ms)"} for row in report["targets"]]
    if vsim_report.write_prediction_plot({"results": panels}, out / "ttft_predicted.png"):
        report["prediction_plot"] = "ttft_predicted.png"
    (out / "report.json").write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    write_markdown(report, out / "report.md")
    write_plots(report, out)
    return report


def send_limits(prompts: list[tuple[int, list[int]]], sent: list[dict[str, Any]], block_size: int, profile: Profile,
                replicas: int, split: bool) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """TTFT p50 / p90 / p99 (ms) at the times a target's client sent each request: of `vsim_report.causal_ttfts`,
    and of those with the opening burst's prefills on `replicas` replicas (`vsim_report.fleet_ttfts`; `split`: the
    replicas have tier agents, which can move a prefix computed in part from one to another)."""
    starts = [r["start_s"] for r in sent]
    causal = vsim_report.causal_ttfts(prompts, starts, block_size, profile)
    floor = vsim_report.opening_burst_floor(prompts, starts, block_size, profile, replicas, split)
    return vsim_report.percentiles_ms(causal), vsim_report.percentiles_ms(vsim_report.fleet_ttfts(causal, floor))


STAND_IN_BYTES = 64  # a simulated replica's block payload (`kvgate sim --agent-payload-bytes`' default)


def agent_settings(args: argparse.Namespace) -> AgentSettings:
    """The tier agents of a `--with-agents` run: capacities in the 64-byte stand-ins the replicas store, each
    charged its bookkeeping too (agent.tiers.dram.block_charge: `--agent-dram-blocks` blocks fit, as before)."""
    sim_args: list[str] = []
    for link in args.agent_link or ():
        sim_args += ["--agent-link", link]
    return AgentSettings(write_policy=args.agent_write_policy,
                         dram_capacity=str(args.agent_dram_blocks * block_charge(STAND_IN_BYTES))
                         if args.agent_dram_blocks else None,
                         nvme=args.agent_nvme, shared=not args.no_agent_shared, sim_args=tuple(sim_args))


def _command_line() -> str:
    argv = sys.argv
    if "compare" in argv:
        return "kvgate bench " + " ".join(shlex.quote(a) for a in argv[argv.index("compare"):])
    return "(called from Python)"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(compare(args))
    print(f"wrote {args.out}/report.json, report.md, ttft_cdf.png, hit_rate.png, load.png")
    return 0 if report["targets"] and any("fleet" in t for t in report["targets"]) else 1
