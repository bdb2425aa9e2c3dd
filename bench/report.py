"""A comparison's report: the Markdown table and the PNG plots (TTFT CDF per target, hit rate against the
ideal-cache bound, each replica's share of requests per target)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _f(value: Any, fmt: str = "{:.0f}") -> str:
    return "-" if value is None else fmt.format(value)


def _limit(limit: dict[str, float | None] | None) -> str:
    return "-" if not limit else " / ".join(_f(limit[f"ttft_ms_p{p}"]) for p in (50, 90, 99)) + " ms"


def headline_table(report: dict[str, Any]) -> list[str]:
    tiers = any(t.get("agents") for t in report["targets"])
    lines = ["| target | hit rate | " + ("hit incl. tiers | " if tiers else "") + "of bound | TTFT p50 | TTFT p90 | "
             "TTFT p99 | limit for its sends on its replicas p50 / p90 / p99 | ITL p50 | e2e p50 | req imbalance | "
             "token imbalance | errors | req/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if tiers else "")]
    for t in report["targets"]:
        if "fleet" not in t:
            lines.append(f"| {t['name']} | did not run: {t.get('error', '?').splitlines()[0][:160]} |"
                         + " |" * 11)
            continue
        lat, fleet = t["latency"], t["fleet"]
        lines.append(
            f"| {t['name']} | {fleet['hit_rate']:.3f} | "
            + (f"{fleet.get('hit_rate_with_tiers', fleet['hit_rate']):.3f} | " if tiers else "")
            + f"{_f(t.get('fraction_of_bound'), '{:.0%}')} | "
            f"{_f(lat['ttft_ms_p50'])} ms | {_f(lat['ttft_ms_p90'])} ms | {_f(lat['ttft_ms_p99'])} ms | "
            f"{_limit(t.get('ttft_limit_fleet', t.get('ttft_limit_causal')))} | "
            f"{_f(lat['itl_ms_p50'], '{:.1f}')} ms | {_f(lat['e2e_ms_p50'])} ms | "
            f"{_f(fleet['request_imbalance'], '{:.2f}')} | {_f(fleet['prompt_token_imbalance'], '{:.2f}')} | "
            f"{lat['errors']} | {_f(fleet['requests_per_s'], '{:.1f}')} |")
    return lines


def prediction_lines(report: dict[str, Any]) -> list[str]:
    """The gateway's predicted TTFT for the chosen worker against the client's, per target that predicts."""
    rows = [t for t in report["targets"] if t.get("ttft_prediction")]
    if not rows:
        return []
    lines = ["Predicted against observed TTFT (the gateway's X-Kvgate-Predicted-Ttft-Ms for the worker it chose, "
             "against the client's time to first token): "
             + "; ".join(f"{t['name']} median error {_f(t['ttft_prediction']['median_abs_relative_error'], '{:.1%}')}"
                         f" (signed {_f(t['ttft_prediction'].get('median_signed_relative_error'), '{:+.1%}')}, "
                         f"{len(t['ttft_prediction']['pairs'])} requests)" for t in rows) + ".", ""]
    if report.get("prediction_plot"):
        lines += [f"![predicted vs observed TTFT]({report['prediction_plot']})", ""]
    return lines


def write_markdown(report: dict[str, Any], path: Path) -> None:
    w, fl, ub = report["workload"], report["fleet"], report["upper_bound"]
    load = report["load"]
    lines = [
        f"# kvgate bench compare — {w['name']}",
        "",
        f"Command: `{report['command']}`  ",
        f"Created {report['created']}; Python {report['machine']['python']}, {report['machine']['cpus']} CPUs.",
        "",
        f"Workload `{w['name']}`: {w['requests']} requests, {w['prompt_tokens']} prompt tokens, prompts sent as "
        f"{w['prompt_mode']}; parameters `{w['params']}`.  ",
        f"Load: {load['mode']} loop" + (f", concurrency {load['concurrency']}" if load["concurrency"] else "")
        + (f", Poisson {load['rate']} req/s" if load["rate"] else "") + ".  ",
        f"Fleet: {fl['replicas']} `kvgate sim` replicas, profile `{fl['profile']}`, speedup {fl['speedup']} "
        f"(latencies are wall-clock, i.e. the model's divided by the speedup, plus the router), block size "
        f"{fl['block_size']}, {fl['gpu_blocks_per_replica']} KV blocks per replica, max model len "
        f"{fl['max_model_len']}. Caches reset before every target."
        + (f" Tier agents (`+agent` rows, every tier emptied before each target): `{report['agents']}`."
           if report.get("agents") else ""),
        "",
        f"Upper bound ({ub['definition']}): hit rate **{ub['hit_rate']:.3f}**."
        + (f" TTFT limit (each request's prefill alone with that hit, the model's time / speedup; a router's "
           f"own time comes on top): p50 {_f(report['ttft_limit']['ttft_ms_p50'])} / p90 "
           f"{_f(report['ttft_limit']['ttft_ms_p90'])} / p99 {_f(report['ttft_limit']['ttft_ms_p99'])} ms."
           if report.get("ttft_limit") else "")
        + "".join(f" With what one cache of the fleet's {row['blocks']:,} GPU blocks would have hit instead (the "
                  f"plain replicas' whole cache): LRU hit rate {row['lru']['hit_rate']:.3f}, TTFT p50 "
                  f"{_f(row['lru']['ttft_ms_p50'])} / p90 {_f(row['lru']['ttft_ms_p90'])} / p99 "
                  f"{_f(row['lru']['ttft_ms_p99'])} ms; MIN (the most blocks any eviction keeps) "
                  f"{row['min']['hit_rate']:.3f}, {_f(row['min']['ttft_ms_p50'])} / {_f(row['min']['ttft_ms_p90'])} "
                  f"/ {_f(row['min']['ttft_ms_p99'])} ms."
                  for row in (report.get("ttft_limit_fleet_cache") or {}).values()),
        "The limit for a target's sends is the same with each request sent when that target's client sent it, a "
        "prefix there only once a prefill computing it has (a request may wait for one still running): what no "
        "router reaches with those sends (`bench/vsim_report.py` `causal_ttfts`).",
        "",
        *headline_table(report),
        "",
        *prediction_lines(report),
        "Hit rate: the replicas' `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` deltas (tokens); "
        "hit incl. tiers adds `vllm:external_prefix_cache_hits_total` (tokens loaded from the tier agents; targets "
        "named `+agent` ran on replicas with a `kvgate agent` each, docs/agent.md). "
        "Imbalance: max / mean over replicas of requests (prompt tokens).",
        "",
        "## Targets and their configuration",
        "",
    ]
    for t in report["targets"]:
        lines.append(f"### {t['name']}")
        lines.append("")
        if t.get("version"):
            lines.append(f"Version: {t['version']}  ")
        if t.get("config"):
            lines.append(f"Configuration: `{t['config']}`  ")
        if t.get("argv"):
            lines.append(f"Command: `{' '.join(t['argv'])}`")
        if "error" in t:
            lines += ["", "**Did not run.** Error:", "", "```", t["error"], "```"]
        else:
            lines.append("")
            lines.append("Per replica (requests, prompt tokens, hit rate): " + "; ".join(
                f"{r['requests']:.0f} req, {r['prompt_tokens']:.0f} tok, "
                f"{(r['hit_tokens'] / r['query_tokens'] if r['query_tokens'] else 0):.2f}"
                for r in t["fleet"]["replicas"]))
            if t["latency"]["error_samples"]:
                lines.append(f"  \nErrors: {t['latency']['error_samples']}")
        lines.append("")
    lines += ["## Plots", "", "![TTFT CDF](ttft_cdf.png)", "", "![hit rate](hit_rate.png)", "",
              "![per-replica load](load.png)", ""]
    path.write_text("\n".join(lines))


def write_plots(report: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [t for t in report["targets"] if "fleet" in t]
    paths = []

    fig, ax = plt.subplots(figsize=(8, 5))
    for t in ran:
        ttft = t["ttft_ms"]
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=t["name"])
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, client-side, wall clock)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF — {report['workload']['name']}")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    names = [t["name"] for t in ran]
    ax.bar(range(len(ran)), [t["fleet"]["hit_rate"] for t in ran], color="tab:blue")
    ax.axhline(report["upper_bound"]["hit_rate"], color="tab:red", linestyle="--", label="ideal single cache")
    ax.set_xticks(range(len(ran)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("fleet prefix-cache hit rate (tokens)")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.set_title("hit rate vs upper bound")
    fig.tight_layout()
    paths.append(out / "hit_rate.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 5))
    replicas = report["fleet"]["replicas"]
    width = 0.8 / max(replicas, 1)
    for r in range(replicas):
        ax.bar([i + r * width for i in range(len(ran))],
               [t["fleet"]["request_share"][r] if r < len(t["fleet"]["request_share"]) else 0 for t in ran],
               width, label=f"replica {r}")
    ax.axhline(1 / max(replicas, 1), color="black", linestyle=":", linewidth=1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ran))], names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("share of requests")
    ax.set_title("per-replica load")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out / "load.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths
