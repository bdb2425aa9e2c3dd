"""`kvgate bench plan`: which strategy, how many replicas and how much DRAM / NVMe / shared tier a fleet needs to
meet a time-to-first-token objective on its own traffic.

It replays one trace (a recording of the gateway, `kvgate serve --record-trace`, or any Mooncake-format trace)
in virtual time (`kvgate bench vsim`'s simulation, `--jobs` configurations at a time) over a grid: strategies x
fleet sizes x DRAM and NVMe per replica x the fleet's shared tier, sizes in GB of KV at the profile's bytes per
token. It writes every configuration's row (plan.json, plan.md), plots TTFT p50/p90 and hit rate against the
fleet size and against each tier's size, per strategy, and prints the smallest configuration that meets the
objective (fewest replicas, then the least tier memory, then the lowest TTFT p90) with its hit rate by tier,
its TTFT and the traffic each tier must carry (GB/s read into the GPUs and written, mean and busiest 10 s), so
the disks and the network can be sized too.

    kvgate bench plan --trace trace.jsonl --slo-ttft-p90 2s --replicas 4,8,16 --dram-gb 0,64 --jobs 2
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from tqdm import tqdm

from bench import machine
from bench.sim.perf_model import Profile, load_profile
from bench.sweep import Job, run_sweep
from bench.traces import TraceError
from bench.vsim import TierSettings, VsimJob, request_source, simulate
from bench.workloads import PromptVocabulary

QUANTILES = ("p50", "p90", "p99")


def parse_duration(text: str) -> float:
    """Seconds from `2s`, `500ms`, `1.5` (seconds)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 2s, 500ms)")
    value = float(match.group(1))
    return value / 1000 if match.group(2) == "ms" else value


def _list(text: str, kind: type[float] | type[int], least: float, what: str) -> list[Any]:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of {kind.__name__}s: {text!r}") from None
    if not values or any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"{what} must be {least:g} or more: {text!r}")
    return values


def _floats(text: str) -> list[float]:
    return _list(text, float, 0, "sizes")


def _ints(text: str) -> list[int]:
    return _list(text, int, 1, "fleet sizes")


@dataclass(frozen=True)
class Point:
    """One configuration of the grid."""

    strategy: str
    replicas: int
    dram_gb: float  # per replica
    nvme_gb: float  # per replica
    shared_gb: float  # the fleet's

    @property
    def tier_gb(self) -> float:
        """Tier memory the whole fleet needs."""
        return self.replicas * (self.dram_gb + self.nvme_gb) + self.shared_gb

    @property
    def tiered(self) -> bool:
        return self.tier_gb > 0

    def label(self) -> str:
        tiers = (f"dram {self.dram_gb:g} nvme {self.nvme_gb:g} shared {self.shared_gb:g} GB" if self.tiered
                 else "GPU only")
        return f"{self.replicas} x {self.strategy}, {tiers}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bench.workload_options import DEFAULT_TRACE, add_workload_arguments

    slo = parser.add_argument_group("objective (at least one)")
    for q in QUANTILES:
        slo.add_argument(f"--slo-ttft-{q}", type=parse_duration, default=None, metavar="DURATION",
                         help=f"TTFT {q} to meet, e.g. 2s or 500ms")
    grid = parser.add_argument_group("grid")
    grid.add_argument("--strategies", default="round_robin,prefix,kv")
    grid.add_argument("--replicas", type=_ints, default=[4, 8, 16], help="fleet sizes (default 4,8,16)")
    grid.add_argument("--dram-gb", type=_floats, default=[0.0, 64.0],
                      help="tier agent DRAM per replica, GB of KV (default 0,64; 0 = none)")
    grid.add_argument("--nvme-gb", type=_floats, default=[0.0], help="NVMe per replica, GB of KV (default 0)")
    grid.add_argument("--shared-gb", type=_floats, default=[0.0], help="the fleet's shared tier, GB (default 0)")
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--profile", default="llama-3.1-8b-h100",
                       help="a profile name or a calibrated profile's JSON (kvgate bench calibrate)")
    fleet.add_argument("--block-size", type=int, default=16)
    fleet.add_argument("--gpu-blocks", type=int, default=None, help="per replica (default: the profile's)")
    fleet.add_argument("--write-policy", choices=["lazy", "eager"], default="lazy")
    parser.add_argument("--concurrency", type=int, default=None, help="closed loop instead of arrival times")
    parser.add_argument("--rate", type=float, default=None, help="Poisson arrivals for untimed workloads")
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--jobs", type=int, default=1, help="configurations simulated at once, one process each")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--out", default="out/plan", help="directory for plan.json, plan.md and the plots")
    add_workload_arguments(parser)
    parser.set_defaults(workload="mooncake", limit=None, trace=str(DEFAULT_TRACE))


def grid(args: argparse.Namespace) -> list[Point]:
    return [Point(s, n, d, v, sh) for n in args.replicas for d in args.dram_gb for v in args.nvme_gb
            for sh in args.shared_gb for s in args.strategies.split(",")]


def tier_settings(point: Point, profile: Profile, block_size: int, write_policy: str) -> TierSettings | None:
    if not point.tiered:
        return None
    block_bytes = profile.model.kv_bytes_per_token * block_size

    def blocks(gb: float) -> int:
        return int(gb * 1e9 // block_bytes)

    return TierSettings(dram_blocks=blocks(point.dram_gb), nvme_blocks=blocks(point.nvme_gb),
                        shared_blocks=blocks(point.shared_gb), write_policy=write_policy)


def meets(row: dict[str, Any], slo: dict[str, float]) -> bool:
    return row["completed"] == row["requests"] and all(
        row[f"ttft_ms_{q}"] is not None and row[f"ttft_ms_{q}"] <= limit * 1e3 for q, limit in slo.items())


def smallest(rows: list[dict[str, Any]], slo: dict[str, float]) -> dict[str, Any] | None:
    """The configuration that meets the objective with the fewest replicas, then the least tier memory, then the
    lowest TTFT p90."""
    fit = [r for r in rows if meets(r, slo)]
    return min(fit, key=lambda r: (r["replicas"], r["point"]["tier_gb"], r["ttft_ms_p90"] or 0.0), default=None)


def describe_choice(row: dict[str, Any], slo: dict[str, float]) -> list[str]:
    t = row["hit_rate_by_tier"]
    lines = [f"smallest configuration meeting {_slo_text(slo)}: {Point(**_point_args(row)).label()}",
             f"  hit rate {row['hit_rate']:.3f}: GPU {t['gpu']:.3f}, DRAM {t['dram']:.3f}, NVMe {t['nvme']:.3f}, "
             f"shared {t['shared']:.3f}",
             f"  TTFT p50 {row['ttft_ms_p50']:.0f} ms, p90 {row['ttft_ms_p90']:.0f} ms, "
             f"p99 {row['ttft_ms_p99']:.0f} ms"]
    for tier, flow in (row.get("tier_traffic") or {}).items():
        if flow["read_gbps"] or flow["write_gbps"]:
            lines.append(f"  {tier}: reads {flow['read_gbps']:.2f} GB/s, writes {flow['write_gbps']:.2f} GB/s on "
                         f"average, {flow['peak_gbps']:.2f} GB/s in the busiest 10 s"
                         + (" (fleet-wide)" if tier == "shared" else " (all replicas together)"))
    return lines


def _point_args(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row["point"].items() if k != "tier_gb"}


def _slo_text(slo: dict[str, float]) -> str:
    return " and ".join(f"TTFT {q} <= {limit * 1e3:g} ms" for q, limit in slo.items())


def summary_line(row: dict[str, Any]) -> str:
    t = row["hit_rate_by_tier"]
    return (f"hit {row['hit_rate']:.3f} (gpu {t['gpu']:.3f} dram {t['dram']:.3f} nvme {t['nvme']:.3f} shared "
            f"{t['shared']:.3f}), TTFT p50 {_ms(row['ttft_ms_p50'])} p90 {_ms(row['ttft_ms_p90'])} p99 "
            f"{_ms(row['ttft_ms_p99'])} ms [{row['wall_s']:.0f} s, {row.get('peak_rss_mb', 0):.0f} MB]")


def markdown(summary: dict[str, Any]) -> str:
    slo = summary["slo"]
    lines = [f"# kvgate bench plan: {summary['workload']['name']}", "",
             f"Command: `{summary['command']}`  ",
             f"Objective: {_slo_text(slo)}. Profile `{summary['profile']}`, block size {summary['block_size']}; "
             f"{summary['requests']} requests; ideal single-cache hit rate {summary['upper_bound']:.3f}.", "",
             "| replicas | strategy | DRAM / NVMe GB per replica | shared GB | hit rate (GPU + DRAM + NVMe + shared) "
             "| TTFT p50 / p90 / p99 ms | NVMe / shared GB/s (mean, peak) | meets |",
             "|---|---|---|---|---|---|---|---|"]
    for row in summary["results"]:
        p, t, flow = row["point"], row["hit_rate_by_tier"], row.get("tier_traffic") or {}

        def gbps(tier: str, flow: dict[str, Any] = flow) -> str:
            f = flow.get(tier)
            return "-" if not f else f"{f['read_gbps'] + f['write_gbps']:.2f}, {f['peak_gbps']:.2f}"

        lines.append(f"| {p['replicas']} | {p['strategy']} | {p['dram_gb']:g} / {p['nvme_gb']:g} | {p['shared_gb']:g} "
                     f"| {row['hit_rate']:.3f} ({t['gpu']:.3f} + {t['dram']:.3f} + {t['nvme']:.3f} + "
                     f"{t['shared']:.3f}) "
                     f"| {_ms(row['ttft_ms_p50'])} / {_ms(row['ttft_ms_p90'])} / {_ms(row['ttft_ms_p99'])} "
                     f"| {gbps('nvme')} / {gbps('shared')} | {'yes' if meets(row, slo) else 'no'} |")
    choice = summary["choice"]
    lines += ["", "\n".join(describe_choice(choice, slo)) if choice else f"No configuration meets {_slo_text(slo)}."]
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot(summary: dict[str, Any], out: Path) -> list[Path]:
    """TTFT p50/p90 and hit rate against the fleet size (GPU only and each tier configuration) and against each
    tier's size (at each fleet size), one line per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["results"]
    written = []
    axes_of = [("replicas", "fleet size (replicas)", "fleet"), ("dram_gb", "DRAM per replica (GB)", "dram"),
               ("nvme_gb", "NVMe per replica (GB)", "nvme"), ("shared_gb", "shared tier (GB)", "shared")]
    for key, xlabel, name in axes_of:
        others = [k for k, _, _ in axes_of if k != key]
        values = {r["point"][key] for r in rows}
        if len(values) < 2:
            continue
        fig, (ax_t, ax_h) = plt.subplots(1, 2, figsize=(12, 4.5))
        series: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for r in rows:
            series.setdefault((r["point"]["strategy"], *(r["point"][k] for k in others)), []).append(r)
        for (strategy, *fixed), group in sorted(series.items(), key=lambda kv: str(kv[0])):
            group.sort(key=lambda r: r["point"][key])
            xs = [r["point"][key] for r in group]
            tag = strategy + "".join(f", {k.removesuffix('_gb')} {v:g}" for k, v in zip(others, fixed, strict=True)
                                     if k != "replicas" or key != "replicas")
            line, = ax_t.plot(xs, [r["ttft_ms_p90"] for r in group], marker="o", label=f"{tag} p90")
            ax_t.plot(xs, [r["ttft_ms_p50"] for r in group], marker=".", linestyle="--", color=line.get_color(),
                      label=f"{tag} p50")
            ax_h.plot(xs, [r["hit_rate"] for r in group], marker="o", color=line.get_color(), label=tag)
        for q, limit in summary["slo"].items():
            ax_t.axhline(limit * 1e3, color="grey", linewidth=0.8, linestyle=":", label=f"objective {q}")
        ax_h.axhline(summary["upper_bound"], color="grey", linewidth=0.8, linestyle=":", label="ideal single cache")
        ax_t.set(xlabel=xlabel, ylabel="TTFT (ms)", yscale="log", title="time to first token")
        ax_h.set(xlabel=xlabel, ylabel="prefix hit rate", ylim=(0, 1), title="hit rate")
        for ax in (ax_t, ax_h):
            ax.grid(alpha=0.3)
        ax_h.legend(fontsize=7, loc="best")
        fig.suptitle(f"{summary['workload']['name']}: against {xlabel}")
        fig.tight_layout()
        path = out / f"plan_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def run(args: argparse.Namespace) -> int:
    from bench.make_model import bench_model_dir

    slo = {q: getattr(args, f"slo_ttft_{q}") for q in QUANTILES if getattr(args, f"slo_ttft_{q}") is not None}
    if not slo:
        print("kvgate bench plan: give an objective, e.g. --slo-ttft-p90 2s", file=sys.stderr)
        return 2
    try:
        profile = load_profile(args.profile)
        vocab = PromptVocabulary.from_model_dir(bench_model_dir(args.model_dir))
        source = request_source(args, vocab, report=sys.stderr)
    except (TraceError, ValueError) as exc:
        print(f"kvgate bench plan: {exc}", file=sys.stderr)
        return 2
    points = grid(args)
    jobs = [VsimJob(vars(args), p.strategy, p.replicas, args.profile, args.block_size, args.gpu_blocks,
                    tier_settings(p, profile, args.block_size, args.write_policy), args.concurrency)
            for p in points]
    bound = source.ideal(args.block_size)
    print(f"{source.name}: {source.count} requests, {bound.query_tokens:,} prompt tokens, ideal single-cache hit "
          f"rate {bound.hit_rate:.3f}; {len(jobs)} configurations, {args.jobs} at a time", flush=True)
    before = machine.probe()
    print(before.describe(), flush=True)
    started = time.perf_counter()
    outcome = run_sweep([Job(p.label(), source.count, job, cost=job.cost)
                         for p, job in zip(points, jobs, strict=True)], simulate,
                        processes=args.jobs, show_progress=not args.no_progress,
                        on_result=lambda i, row: tqdm.write(f"{points[i].label()}: {summary_line(row)}"))
    rows = []
    for i in sorted(outcome.results):
        row = outcome.results[i]
        row["point"] = {**points[i].__dict__, "tier_gb": points[i].tier_gb}
        rows.append(row)
    choice = smallest(rows, slo)
    after = machine.probe()
    print(after.describe(), flush=True)
    summary = {"benchmark": "plan", "command": "kvgate bench plan " + " ".join(sys.argv[sys.argv.index("plan") + 1:])
               if "plan" in sys.argv else "(called from Python)",
               "workload": {"name": source.name, "params": source.params}, "requests": source.count,
               "profile": profile.name, "block_size": args.block_size, "slo": slo, "upper_bound": bound.hit_rate,
               "jobs": args.jobs, "wall_s": time.perf_counter() - started,
               "machine_speed": machine.probes(before, after), "peak_total_rss_mb": outcome.peak_rss_mb,
               "interrupted": outcome.interrupted,
               "unfinished": [points[i].label() for i in range(len(points)) if i not in outcome.results],
               "errors": {points[i].label(): e for i, e in outcome.errors.items()},
               "results": rows, "choice": choice}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan.json").write_bytes(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    (out / "plan.md").write_text(markdown(summary))
    plots = plot(summary, out) if rows else []
    print()
    print("\n".join(describe_choice(choice, slo)) if choice else
          f"no configuration of the grid meets {_slo_text(slo)}: widen it (more replicas, tiers)")
    print(f"wrote {', '.join(str(p) for p in [out / 'plan.json', out / 'plan.md', *plots])}")
    if outcome.interrupted:
        print(f"interrupted: {len(rows)} of {len(points)} configurations finished", file=sys.stderr)
        return 130
    return 1 if outcome.errors else 0
