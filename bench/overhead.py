"""What a router adds: the same requests sent straight to stand-in workers and through the router.

The workload is the one people send: `--system-prompts` shared system prompts of `--prompt-chars` characters each
(several sizes: 200, 4,000, 32,000), each request one of them plus a new 200-character question, over the chat or
the completions API (`--api`). Routers (`--target`): kvgate's strategies (`kvgate:prefix`, ...; `--processes N`
for that many gateway processes) and, side by side, the Rust routers `bench compare` installs (`sglang:cache_aware`,
`vllm-router:cache_aware`), each a process of its own in front of the same stand-in workers.

Every router is started first; per round a direct run, then each router's, in an order that alternates, so all
see the same machine noise; `--against REV` runs each kvgate target from git revision REV too, its rounds among
this tree's (a before/after pair in one run). Per scenario:
added latency p50/p99, requests/s, and the router's CPU time per request (its whole process tree, user + system,
from /proc; the median of the rounds'). The summary table is issue 18's: CPU µs per request and requests/s at the
highest concurrency, added p50 at the lowest.

The client and stand-ins (`--client`): `python` (an aiohttp client, bench/standin.py's workers, a request count per
round) or `wrk` (wrk and nginx, both in C, a duration per round: bench/wrk_load.py), which leave the router the
machine's cores: on two cores the Python pair takes about as much CPU per request as the router.

Streamed answers (`--mode stream`, python client): a real gateway's CPU goes mostly to relaying them, one SSE event
per engine step, each its own read and write. `--stream-tokens N` has every request ask `max_tokens` N and every
stand-in answer with N token events, `--token-interval-ms T` apart; the client counts the `data:` events it receives
(the final `data: [DONE]` included: N + 1 per answer), and each result has the events per request and the router's
CPU per event relayed.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench import machine
from bench.procs import CLOCK_TICKS, exit_on_sigterm, free_port, spawn_kvgate, stop, stop_all, wait_http
from bench.wrk_load import WrkRun, missing_tools, nginx_standins, run_wrk, write_script

QUESTION_CHARS = 200
WORDS = ("the", "router", "cache", "prefix", "token", "block", "engine", "worker", "gateway", "request", "prompt",
         "system", "answer", "question", "model", "latency", "memory", "index", "event", "queue", "batch", "tenant",
         "you", "are", "a", "helpful", "assistant", "always", "reply", "briefly", "and", "cite", "sources", "when",
         "asked", "about", "policy", "documents", "orders", "invoices", "refunds", "shipping", "2024", "v1.3")


@dataclass
class Sample:
    latencies_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0
    errors: int = 0
    router_cpu_s: float = 0.0
    events: int = 0  # `data:` events received, streams only


@dataclass
class ScenarioResult:
    target: str
    api: str
    prompt_chars: int
    mode: str
    concurrency: int
    requests: int
    direct_p50_ms: float
    direct_p99_ms: float
    gateway_p50_ms: float
    gateway_p99_ms: float
    added_p50_ms: float
    added_p99_ms: float
    direct_rps: float
    gateway_rps: float
    gateway_cpu_us_per_request: float
    errors: int
    # streams through the python client: `data:` events per answer (`data: [DONE]` included) and the router's CPU
    # per event relayed, the median of the rounds'; None for JSON answers and for wrk, which does not count them
    events_per_request: float | None = None
    gateway_cpu_us_per_event: float | None = None


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    size = 0
    while size <= chars:  # the join has one space fewer than counted
        word = rng.choice(WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:chars]


class Workload:
    """Request bodies: system prompt `i % system_prompts` plus question number `i` (never repeated)."""

    def __init__(self, api: str, prompt_chars: int, system_prompts: int, stream: bool, seed: int = 0,
                 max_tokens: int = 8) -> None:
        self.api, self.stream, self.max_tokens = api, stream, max_tokens
        rng = random.Random(seed)
        heads = [f"System prompt {n}. " for n in range(system_prompts)]
        self.systems = [head + _text(rng, max(0, prompt_chars - len(head))) for head in heads]
        self.path = "/v1/chat/completions" if api == "chat" else "/v1/completions"
        self._next = itertools.count()

    def bodies(self, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            i = next(self._next)
            system = self.systems[i % len(self.systems)]
            question = f"Question {i}: " + _text(random.Random(i), QUESTION_CHARS - 16)
            payload: dict[str, Any] = {"model": "tiny", "max_tokens": self.max_tokens, "stream": self.stream}
            if self.api == "chat":
                payload["messages"] = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            else:
                payload["prompt"] = system + "\n\n" + question
            out.append(orjson.dumps(payload))
        return out


async def _drive(session: aiohttp.ClientSession, urls: list[str], bodies: list[bytes], stream: bool,
                 concurrency: int) -> Sample:
    sample = Sample()
    work = iter(bodies)
    cycle = itertools.cycle(urls)
    headers = {"Content-Type": "application/json"}

    async def one_client() -> None:
        for body in work:
            url = next(cycle)
            started = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    if stream:  # SSE events start a line: count "\ndata:", chunk boundaries included
                        tail = b"\n"
                        async for chunk in resp.content.iter_any():
                            seen = tail + chunk
                            sample.events += seen.count(b"\ndata:")
                            tail = seen[-5:]
                    else:
                        await resp.read()
                    if resp.status != 200:
                        sample.errors += 1
            except aiohttp.ClientError:
                sample.errors += 1
            sample.latencies_s.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    sample.wall_s = time.perf_counter() - started
    return sample


def _descendants(pid: int) -> list[int]:
    found = [pid]
    for parent in found:
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time used so far by a process and every process below it (`--processes N`)."""
    total = 0
    for p in _descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


def named_threads_cpu_seconds(pid: int, name: str) -> float:
    """User + system CPU time of the threads called `name` in a process and every process below it."""
    total = 0
    for p in _descendants(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.index("(") + 1: stat.rindex(")")] == name:
                fields = stat.rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


@dataclass
class Router:
    """One router process in front of the stand-ins."""

    target: str
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        stop(self.proc)


def start_router(target: str, workers: list[str], model_dir: Path, processes: int, log_dir: Path,
                 source: Path | None = None) -> Router:
    """`kvgate:STRATEGY`, `sglang:POLICY` or `vllm-router:POLICY`, listening on a free port; `source`: run kvgate
    from that source tree instead of this one (`--against`)."""
    kind, _, rest = target.partition(":")
    policy, _, variant = rest.partition("@")[0].partition(":")
    if variant:  # kvgate:STRATEGY:pN, N gateway processes whatever --processes says: 1 and 2 side by side
        if kind != "kvgate" or variant[:1] != "p" or not variant[1:].isdigit() or int(variant[1:]) < 1:
            raise ValueError(f"target {target!r}: the one variant is pN (N processes), for kvgate")
        processes = int(variant[1:])
    port = free_port()
    log = log_dir / f"{target.replace(':', '_').replace('@', '_')}.log"
    env = dict(os.environ)
    with open(log, "wb") as out:
        if kind == "kvgate":
            argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                    "--strategy", policy, "--model-dir", str(model_dir),
                    *itertools.chain.from_iterable(("--worker", w) for w in workers)]
            if processes > 1:
                argv += ["--processes", str(processes)]
            if source is not None:  # its modules first on the path, from its own directory
                env["PYTHONPATH"] = str(source)
            proc = spawn_kvgate(argv, env, stdout=out, stderr=subprocess.STDOUT, cwd=source)
        else:
            from bench.targets import ensure_peer

            venv = ensure_peer(kind)
            common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *workers, "--policy", policy]
            command = ([str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common,
                        "--log-level", "warn"] if kind == "sglang"
                       else [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"])
            proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)
    router = Router(target, proc, f"http://127.0.0.1:{port}", log)
    try:
        _wait_serving(router)
    except BaseException:
        router.stop()
        raise
    return router


def _wait_serving(router: Router, timeout: float = 90.0) -> None:
    """Until a completion through the router answers 200 (peers have no common readiness endpoint)."""
    import urllib.request

    deadline = time.monotonic() + timeout
    body = orjson.dumps({"model": "tiny", "prompt": "ready?", "max_tokens": 1})
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"{router.target} exited: {router.log.read_text(errors='replace')[-1500:]}")
        request = urllib.request.Request(router.url + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{router.target} did not serve within {timeout} s: "
                       f"{router.log.read_text(errors='replace')[-1500:]}")


async def measure(routers: list[Router], worker_urls: list[str], apis: list[str], sizes: list[int],
                  modes: list[str], concurrencies: list[int], requests: int, rounds: int, system_prompts: int,
                  progress: Any = None, max_tokens: int = 8) -> list[ScenarioResult]:
    """Every scenario through each router, side by side: per round a direct run, then each router's, in an order
    that alternates, so a before/after pair (`--against`) sees the same machine noise. CPU per request (and per
    streamed event) is each round's, its median reported."""
    results = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for api, chars, mode in itertools.product(apis, sizes, modes):
            stream = mode == "stream"
            workload = Workload(api, chars, system_prompts, stream, max_tokens=max_tokens)
            direct_targets = [u + workload.path for u in worker_urls]
            for concurrency in concurrencies:
                n = requests if concurrency > 1 else max(100, requests // 4)
                warm = max(system_prompts * 2, concurrency * 2)
                await _drive(session, direct_targets, workload.bodies(warm), stream, concurrency)
                for router in routers:
                    await _drive(session, [router.url + workload.path], workload.bodies(warm), stream, concurrency)
                direct = Sample()
                routed = {router.target: Sample() for router in routers}
                cpu_per_round: dict[str, list[float]] = {router.target: [] for router in routers}
                cpu_per_event: dict[str, list[float]] = {router.target: [] for router in routers}
                for i in range(rounds):
                    parts = [(direct, await _drive(session, direct_targets, workload.bodies(n), stream, concurrency))]
                    for router in (routers if i % 2 == 0 else routers[::-1]):
                        bodies = workload.bodies(n)
                        cpu0 = tree_cpu_seconds(router.proc.pid)
                        g = await _drive(session, [router.url + workload.path], bodies, stream, concurrency)
                        g.router_cpu_s = tree_cpu_seconds(router.proc.pid) - cpu0
                        cpu_per_round[router.target].append(g.router_cpu_s / n * 1e6)
                        if stream:
                            cpu_per_event[router.target].append(g.router_cpu_s / max(1, g.events) * 1e6)
                        parts.append((routed[router.target], g))
                    for total, part in parts:
                        total.latencies_s += part.latencies_s
                        total.wall_s += part.wall_s
                        total.errors += part.errors
                        total.router_cpu_s += part.router_cpu_s
                        total.events += part.events
                    if progress is not None:
                        progress.update()
                total_n = n * rounds
                dp50, dp99 = _percentile(direct.latencies_s, 0.5), _percentile(direct.latencies_s, 0.99)
                for router in routers:
                    sample = routed[router.target]
                    gp50, gp99 = _percentile(sample.latencies_s, 0.5), _percentile(sample.latencies_s, 0.99)
                    results.append(ScenarioResult(
                        target=router.target, api=api, prompt_chars=chars, mode=mode, concurrency=concurrency,
                        requests=total_n, direct_p50_ms=dp50 * 1e3, direct_p99_ms=dp99 * 1e3,
                        gateway_p50_ms=gp50 * 1e3, gateway_p99_ms=gp99 * 1e3,
                        added_p50_ms=(gp50 - dp50) * 1e3, added_p99_ms=(gp99 - dp99) * 1e3,
                        direct_rps=total_n / direct.wall_s, gateway_rps=total_n / sample.wall_s,
                        gateway_cpu_us_per_request=statistics.median(cpu_per_round[router.target]),
                        errors=direct.errors + sample.errors,
                        events_per_request=sample.events / total_n if stream else None,
                        gateway_cpu_us_per_event=statistics.median(cpu_per_event[router.target]) if stream else None,
                    ))
    return results


def measure_wrk(routers: list[Router], worker_urls: list[str], apis: list[str], sizes: list[int], stream: bool,
                concurrencies: list[int], seconds: float, rounds: int, system_prompts: int, workdir: Path,
                progress: Any = None) -> list[ScenarioResult]:
    """`measure` with wrk as the client (bench/wrk_load.py): each round a timed run straight to a stand-in, then
    each router's in an order that alternates. Latency percentiles and CPU per request are the median of the
    rounds' (wrk reports percentiles per run, not the latencies)."""
    script = write_script(workdir)
    results = []
    runs = itertools.count()
    for api, chars in itertools.product(apis, sizes):
        workload = Workload(api, chars, system_prompts, stream)
        bodies = workdir / f"bodies-{api}-{chars}.jsonl"
        bodies.write_bytes(b"\n".join(workload.bodies(max(4 * system_prompts, 256))) + b"\n")

        def once(url: str, concurrency: int, length: float, path: str = workload.path,
                 bodies: Path = bodies) -> WrkRun:
            return run_wrk(url, path, bodies, script, concurrency, length, f"r{next(runs)}")

        for concurrency in concurrencies:
            for router in routers:  # every system prompt seen before the rounds, as in `measure`
                once(router.url, concurrency, 1)
            direct: list[WrkRun] = []
            routed: dict[str, list[WrkRun]] = {router.target: [] for router in routers}
            cpu: dict[str, list[float]] = {router.target: [] for router in routers}
            for i in range(rounds):
                direct.append(once(worker_urls[0], concurrency, seconds))
                for router in (routers if i % 2 == 0 else routers[::-1]):
                    cpu0 = tree_cpu_seconds(router.proc.pid)
                    run = once(router.url, concurrency, seconds)
                    cpu[router.target].append((tree_cpu_seconds(router.proc.pid) - cpu0) / max(1, run.requests) * 1e6)
                    routed[router.target].append(run)
                if progress is not None:
                    progress.update()
            dp50 = statistics.median(r.p50_s for r in direct)
            dp99 = statistics.median(r.p99_s for r in direct)
            for router in routers:
                sample = routed[router.target]
                gp50 = statistics.median(r.p50_s for r in sample)
                gp99 = statistics.median(r.p99_s for r in sample)
                results.append(ScenarioResult(
                    target=router.target, api=api, prompt_chars=chars, mode="stream" if stream else "json",
                    concurrency=concurrency, requests=sum(r.requests for r in sample),
                    direct_p50_ms=dp50 * 1e3, direct_p99_ms=dp99 * 1e3, gateway_p50_ms=gp50 * 1e3,
                    gateway_p99_ms=gp99 * 1e3, added_p50_ms=(gp50 - dp50) * 1e3, added_p99_ms=(gp99 - dp99) * 1e3,
                    direct_rps=sum(r.requests for r in direct) / sum(r.wall_s for r in direct),
                    gateway_rps=sum(r.requests for r in sample) / sum(r.wall_s for r in sample),
                    gateway_cpu_us_per_request=statistics.median(cpu[router.target]),
                    errors=sum(r.errors for r in direct) + sum(r.errors for r in sample),
                ))
    return results


@dataclass
class StallResult:
    target: str
    api: str
    prompt_chars: int
    requests: int
    concurrency: int
    health_probes: int
    health_p50_ms: float
    health_p99_ms: float
    health_max_ms: float
    errors: int


async def _drive_alone(url: str, bodies: list[bytes], concurrency: int) -> Sample:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return await _drive(session, [url], bodies, False, concurrency)


def measure_stall(router: Router, api: str, chars: int, requests: int, concurrency: int) -> StallResult:
    """How long `/health` waits while cold prompts of `chars` characters (every one new: nothing to reuse) go
    through the router: a probe every 10 ms from a process of its own (bench/health_probe.py), timed from when it was
    due, so time the router's event loop spent blocked between probes counts too."""
    workload = Workload(api, chars, requests, False, seed=1)  # a system prompt per request: all cold
    bodies = workload.bodies(requests)
    prober = subprocess.Popen([sys.executable, "-m", "bench.health_probe", router.url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert prober.stdout is not None
        if prober.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the /health prober of {router.target} did not start")
        sample = asyncio.run(_drive_alone(router.url + workload.path, bodies, concurrency))
        out, _ = prober.communicate(timeout=60)  # stdin closed: it stops and reports
    finally:
        stop(prober)
    if prober.returncode != 0:
        raise RuntimeError(f"the /health prober of {router.target} failed ({prober.returncode})")
    probed = orjson.loads(out)
    waits: list[float] = probed["waits"]
    return StallResult(router.target, api, chars, requests, concurrency, len(waits),
                       _percentile(waits, 0.5) * 1e3, _percentile(waits, 0.99) * 1e3, max(waits) * 1e3,
                       sample.errors + probed["errors"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", action="append",
                        help="router, repeatable: kvgate:STRATEGY, kvgate:STRATEGY:pN (N gateway processes, beside "
                        "--processes' targets), sglang:cache_aware, vllm-router:cache_aware (default "
                        "kvgate:round_robin, kvgate:prefix, kvgate:kv)")
    parser.add_argument("--peers", action="store_true",
                        help="add sglang:cache_aware and vllm-router:cache_aware (installed from PyPI on first use; "
                        "one that cannot be installed or started is reported and skipped)")
    parser.add_argument("--api", action="append", choices=["chat", "completions"], help="default both")
    parser.add_argument("--prompt-chars", type=int, action="append",
                        help="characters of each system prompt, repeatable (default 200 and 4000)")
    parser.add_argument("--system-prompts", type=int, default=64, help="distinct shared system prompts")
    parser.add_argument("--requests", type=int, default=1000, help="requests per round and target")
    parser.add_argument("--rounds", type=int, default=3, help="alternating direct/routed rounds")
    parser.add_argument("--concurrency", type=int, action="append", help="client concurrency (default 1 and 64)")
    parser.add_argument("--mode", action="append", choices=["json", "stream"], help="default json")
    parser.add_argument("--workers", type=int, default=4, help="stand-in workers")
    parser.add_argument("--processes", type=int, default=1, help="kvgate serve --processes")
    parser.add_argument("--stall-chars", type=int, default=0,
                        help="also time /health (every 10 ms) while kvgate targets take --stall-requests cold "
                        "prompts of this many characters, 4 at a time (0: skip)")
    parser.add_argument("--stall-requests", type=int, default=100)
    parser.add_argument("--against", metavar="REV",
                        help="also run each kvgate target from git revision REV (`git archive`), as "
                        "kvgate:STRATEGY@REV, side by side with this tree's: rounds alternate between the two")
    parser.add_argument("--client", choices=["python", "wrk"], default="python",
                        help="python: an aiohttp client and stand-ins (a request count per round); wrk: wrk as the "
                        "client and one nginx process as the stand-ins, both in C, so the router has the cores "
                        "(bench/wrk_load.py; `--seconds` per round; needs wrk and nginx, which scripts/system-deps.sh "
                        "installs)")
    parser.add_argument("--seconds", type=float, default=5.0, help="--client wrk: seconds per round and target")
    parser.add_argument("--stream-tokens", type=int, metavar="N",
                        help="--client python: every request asks max_tokens N and every stand-in answers with N "
                        "tokens, with --mode stream N SSE events (and `data: [DONE]`), each its own write, as vLLM "
                        "sends one per engine step (default: max_tokens 8, no pause between tokens)")
    parser.add_argument("--token-interval-ms", type=float, metavar="T",
                        help="--client python: the stand-ins' pause between two tokens (default 2 with "
                        "--stream-tokens, else 0): shorter than an engine's decode step (10-30 ms on an H100), as a "
                        "gateway in front of many replicas sees their events interleaved, long enough that each event "
                        "reaches the router as a read of its own, and short enough to keep a run short")
    parser.add_argument("--out", default="out/overhead.json", help="JSON results file")


def _targets(args: argparse.Namespace) -> list[str]:
    targets = list(args.target or ["kvgate:round_robin", "kvgate:prefix", "kvgate:kv"])
    if args.peers:
        targets += [t for t in ("sglang:cache_aware", "vllm-router:cache_aware") if t not in targets]
    return targets


def summary(results: list[ScenarioResult]) -> Iterator[str]:
    """Issue 18's table per API, prompt size and mode: CPU µs/request and requests/s at the highest concurrency,
    added p50 at the lowest; for streams also the events per answer and CPU µs per event at the highest."""
    high = max(r.concurrency for r in results)
    low = min(r.concurrency for r in results)
    nan = float("nan")
    for api, chars, mode in sorted({(r.api, r.prompt_chars, r.mode) for r in results}):
        streamed = any(r.events_per_request is not None for r in results if (r.api, r.prompt_chars, r.mode) ==
                       (api, chars, mode))
        yield (f"\n{api}, {chars}-character system prompts + {QUESTION_CHARS}-character question"
               + (", streamed answers" if mode == "stream" else ""))
        yield (f"{'router':<26}{f'CPU µs/req (c{high})':>20}{f'req/s (c{high})':>16}{f'added p50 (c{low})':>20}"
               f"{'errors':>8}" + (f"{'events/req':>12}{f'CPU µs/event (c{high})':>24}" if streamed else ""))
        for target in dict.fromkeys(r.target for r in results):
            rows = {r.concurrency: r for r in results
                    if (r.target, r.api, r.prompt_chars, r.mode) == (target, api, chars, mode)}
            if not rows:
                continue
            hi, lo = rows.get(high), rows.get(low)
            line = (f"{target:<26}{hi.gateway_cpu_us_per_request if hi else nan:>20,.0f}"
                    f"{hi.gateway_rps if hi else nan:>16,.0f}"
                    f"{lo.added_p50_ms if lo else nan:>18.2f}ms"
                    f"{sum(r.errors for r in rows.values()):>8}")
            if streamed:
                events = hi.events_per_request if hi and hi.events_per_request is not None else nan
                per_event = hi.gateway_cpu_us_per_event if hi and hi.gateway_cpu_us_per_event is not None else nan
                line += f"{events:>12.1f}{per_event:>24.1f}"
            yield line


@contextmanager
def python_standins(count: int, token_delay_s: float = 0.0) -> Iterator[list[str]]:
    """`count` stand-in workers (bench/standin.py) in one process, pausing `token_delay_s` between two tokens;
    yields their URLs."""
    ports = [free_port() for _ in range(count)]
    proc = spawn_kvgate(["standin", *itertools.chain.from_iterable(("--port", str(p)) for p in ports),
                         "--token-delay-s", repr(token_delay_s)])
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            wait_http(url + "/health", proc=proc)
        yield urls
    finally:
        stop(proc)


def _source_tree(rev: str, tmp: Path) -> Path:
    """This repository's files at git revision `rev`, extracted under `tmp`."""
    root = Path(__file__).resolve().parent.parent
    tree = tmp / "against"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", rev], capture_output=True,
                             check=True, timeout=120).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True, timeout=120)
    return tree


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from bench.make_model import write_model

    targets = _targets(args)
    apis, sizes = args.api or ["chat", "completions"], args.prompt_chars or [200, 4000]
    modes, concurrencies = args.mode or ["json"], args.concurrency or [1, 64]
    if (args.stream_tokens is not None and args.stream_tokens < 1) or (args.token_interval_ms or 0) < 0:
        print("--stream-tokens is at least 1 and --token-interval-ms at least 0", file=sys.stderr)
        return 2
    max_tokens = 8 if args.stream_tokens is None else args.stream_tokens
    interval_ms = args.token_interval_ms if args.token_interval_ms is not None else (
        0.0 if args.stream_tokens is None else 2.0)
    if args.client == "wrk" and ((args.stream_tokens or 1) > 1 or interval_ms):
        print("--client wrk: no --stream-tokens over 1 or --token-interval-ms (nginx answers with one canned body: "
              "a stream of one event, unpaced); use --client python", file=sys.stderr)
        return 2
    if args.client == "wrk":
        missing = missing_tools()
        if missing:
            print(f"--client wrk needs {' and '.join(missing)} on PATH (scripts/system-deps.sh installs them)",
                  file=sys.stderr)
            return 2
        if len(modes) > 1:
            print("--client wrk: one --mode per run (the stand-ins' canned answer is JSON or a stream)",
                  file=sys.stderr)
            return 2
    before = machine.probe()
    print(before.describe())
    results: list[ScenarioResult] = []
    stalls: list[StallResult] = []
    skipped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-overhead-") as tmp, ExitStack() as stack:
        model_dir = Path(tmp) / "tiny"
        model_dir.mkdir()
        write_model(model_dir)
        worker_urls = stack.enter_context(
            nginx_standins(args.workers, Path(tmp) / "nginx", stream=modes == ["stream"]) if args.client == "wrk"
            else python_standins(args.workers, interval_ms / 1e3))
        bar = tqdm(total=len(apis) * len(sizes) * len(modes) * len(concurrencies) * args.rounds, desc="overhead")
        routers: list[Router] = []
        try:
            baseline = _source_tree(args.against, Path(tmp)) if args.against else None
            # every router started first and measured in one pass, its runs between the others' (the order
            # alternating by round), so every ratio between two targets is a side-by-side one
            for target in targets:
                variants: list[tuple[str, Path | None]] = [(target, None)]
                if baseline is not None and target.startswith("kvgate:"):
                    variants.append((f"{target}@{args.against}", baseline))
                for name, source in variants:
                    try:
                        routers.append(start_router(name, worker_urls, model_dir, args.processes, Path(tmp), source))
                    except Exception as exc:  # a peer that cannot be installed or started: reported
                        skipped[name] = f"{type(exc).__name__}: {str(exc)[-600:]}"
                        print(f"{name}: skipped ({skipped[name][:200]})", file=sys.stderr)
            if routers and args.client == "wrk":
                results += measure_wrk(routers, worker_urls, apis, sizes, modes == ["stream"], concurrencies,
                                       args.seconds, args.rounds, args.system_prompts, Path(tmp), bar)
            elif routers:
                results += asyncio.run(measure(routers, worker_urls, apis, sizes, modes, concurrencies,
                                               args.requests, args.rounds, args.system_prompts, bar, max_tokens))
            if args.stall_chars:
                stalls += [measure_stall(router, api, args.stall_chars, args.stall_requests, 4)
                           for router in routers if router.target.startswith("kvgate:") for api in apis]
        finally:
            bar.close()
            stop_all(router.stop for router in routers)
    streamed = any(r.events_per_request is not None for r in results)
    header = (f"{'target':<24}{'api':<12}{'chars':>6}{'mode':>7}{'conc':>5}{'direct p50':>12}{'routed p50':>12}"
              f"{'added p50':>11}{'added p99':>11}{'direct rps':>12}{'rps':>8}{'CPU/req':>10}{'errors':>8}"
              + (f"{'events/req':>12}{'CPU/event':>11}" if streamed else ""))
    print(header)
    for r in results:
        print(f"{r.target:<24}{r.api:<12}{r.prompt_chars:>6}{r.mode:>7}{r.concurrency:>5}{r.direct_p50_ms:>10.3f}ms"
              f"{r.gateway_p50_ms:>10.3f}ms{r.added_p50_ms:>9.3f}ms{r.added_p99_ms:>9.3f}ms{r.direct_rps:>12.0f}"
              f"{r.gateway_rps:>8.0f}{r.gateway_cpu_us_per_request:>8.0f}µs{r.errors:>8}"
              + (f"{r.events_per_request:>12.1f}{r.gateway_cpu_us_per_event:>9.1f}µs"
                 if r.events_per_request is not None and r.gateway_cpu_us_per_event is not None
                 else f"{'':>23}" if streamed else ""))
    if results:
        for line in summary(results):
            print(line)
    for st in stalls:
        print(f"/health while {st.target} takes {st.requests} cold {st.api} prompts of {st.prompt_chars} characters "
              f"(c{st.concurrency}): p50 {st.health_p50_ms:.1f} ms, p99 {st.health_p99_ms:.1f} ms, max "
              f"{st.health_max_ms:.1f} ms over {st.health_probes} probes, {st.errors} errors")
    after = machine.probe()
    print(after.describe())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "benchmark": "overhead", "python": sys.version.split()[0], "cpus": os.cpu_count(),
        "machine_speed": machine.probes(before, after),
        "client": args.client, "requests_per_round": args.requests if args.client == "python" else None,
        "seconds_per_round": args.seconds if args.client == "wrk" else None, "rounds": args.rounds,
        "max_tokens": max_tokens,
        "token_interval_ms": interval_ms if args.client == "python" else None,
        "workers": args.workers,
        "system_prompts": args.system_prompts, "question_chars": QUESTION_CHARS, "processes": args.processes,
        "targets": targets, "skipped": skipped, "results": [asdict(r) for r in results],
        "health_stalls": [asdict(st) for st in stalls],
    }
    out.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    print(f"wrote {out}")
    return 1 if any(r.errors for r in results) or any(st.errors for st in stalls) or not results else 0


if __name__ == "__main__":
    exit_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
