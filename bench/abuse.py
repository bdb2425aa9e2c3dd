"""Hostile load against `kvgate serve` on loopback: what an attacker can hold, and what everyone else gets meanwhile.

One gateway process (`prefix` strategy with the tiny model's tokenizer, clients' own chat templates rendered in
its sandbox) in front of two stand-in workers, and three phases:

1. **connections** — N client connections opened and held at once, each with one answered request on it;
   errors, the gateway's RSS with all of them open, and its own count of them.
2. **overload** — the in-flight cap filled with requests the workers hold, then M more sent by 8 clients on
   keep-alive connections: the status and latency of each (they must be 503s with `Retry-After`, at once).
3. **hostile** — first `/health` alone for a few seconds (the baseline: what the machine itself does to its tail
   latency, which on a shared machine is not nothing); then for D seconds, clients send chat templates that loop
   or allocate without end, bodies far over the body limit (declared, chunked) and JSON nesting bombs, while
   slowloris clients keep idle and half-sent connections open (re-opening each one the gateway closes);
   meanwhile `GET /health` is probed every 10 ms, each probe on a new connection, as a load balancer would.

The gateway's RSS, and that of its sandbox processes, is sampled every 100 ms throughout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from bench.procs import free_port, spawn_kvgate, stop, wait_http
from router.listener import raise_open_file_limit

HEALTH = b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n"
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
MEMORY_BOMB = "{{ 'a' * 4000000000 }}"
DEEP_TEMPLATE = "{{" + "(" * 5000 + "1" + ")" * 5000 + "}}"


# --- the fleet under test ---------------------------------------------------------------------------------------


@dataclass
class AbuseFleet:
    """A gateway process and the stand-in workers behind it."""

    gateway: subprocess.Popen[bytes]
    standins: subprocess.Popen[bytes]
    port: int
    worker_urls: list[str]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def rss_bytes(self) -> int:
        return _rss(self.gateway.pid)

    def sandbox_rss_bytes(self) -> int:
        """The gateway's child processes (its template sandbox), summed."""
        return sum(_rss(pid) for pid in _children(self.gateway.pid))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _schedstat(pid: int) -> tuple[float, float]:
    """Seconds the process's main thread (the gateway's event loop) has run on a CPU, and has waited, runnable, for
    one (the kernel's run queue: what a busy machine adds to every answer)."""
    try:
        with open(f"/proc/{pid}/schedstat") as stat:
            ran, waited, _ = stat.read().split()
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return 0.0, 0.0


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    if int(stat.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return found


@contextlib.contextmanager
def abuse_fleet(model_dir: Path, log_dir: Path, gateway_args: Sequence[str] = (), workers: int = 2
                ) -> Iterator[AbuseFleet]:
    """Start stand-in workers and `kvgate serve` in front of them; stop both (by PID) afterwards."""
    ports = [free_port() for _ in range(workers)]
    gw_port = free_port()
    log = log_dir / "gateway.log"
    standins = spawn_kvgate(["standin", *(a for p in ports for a in ("--port", str(p)))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with log.open("wb") as log_file:
        gateway = spawn_kvgate(
            ["serve", "--host", "127.0.0.1", "--port", str(gw_port), "--strategy", "prefix",
             "--model-dir", str(model_dir), "--tenant-header", "X-Tenant", "--trust-request-chat-template",
             *(a for p in ports for a in ("--worker", f"http://127.0.0.1:{p}")), *gateway_args],
            stdout=log_file, stderr=subprocess.STDOUT)
    fleet = AbuseFleet(gateway, standins, gw_port, [f"http://127.0.0.1:{p}" for p in ports], log)
    try:
        for url in fleet.worker_urls:
            wait_http(url + "/health", proc=standins)
        wait_http(fleet.url + "/ready", proc=gateway, log_tail=lambda: fleet.log_text()[-2000:])
        yield fleet
    finally:
        stop(gateway)
        stop(standins)


# --- one HTTP exchange on a raw socket (blocking, for tests; async below for load) --------------------------------


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def parse_answer(data: bytes) -> Answer | None:
    """The first HTTP/1.1 response in `data` (None if there is none): status, headers (lower-case), body."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1."):
        return None
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    if "chunked" in headers.get("transfer-encoding", ""):
        body, rest2 = b"", rest
        while rest2:
            size_line, _, rest2 = rest2.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            body, rest2 = body + rest2[:size], rest2[size + 2:]
    else:
        length = headers.get("content-length")
        body = rest[: int(length)] if length is not None and length.isdigit() else rest
    return Answer(int(lines[0].split()[1]), headers, body)


def exchange(port: int, request: bytes, timeout: float = 10.0) -> Answer | None:
    """Send `request` on a new connection and read until the server closes it (send `Connection: close`)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(ConnectionError):
            sock.sendall(request)
        chunks = []
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
    return parse_answer(b"".join(chunks))


# --- measurements -----------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class RssSampler:
    """Samples the gateway's and its sandbox's RSS every 100 ms in a thread; peaks per phase."""

    def __init__(self, fleet: AbuseFleet) -> None:
        self._fleet = fleet
        self.peak_gateway = 0
        self.peak_sandbox = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.peak_gateway = max(self.peak_gateway, self._fleet.rss_bytes())
            self.peak_sandbox = max(self.peak_sandbox, self._fleet.sandbox_rss_bytes())

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


async def _ask(port: int, request: bytes, timeout: float = 30.0) -> tuple[
        Answer | None, asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a connection, send one request, read one answer (Content-Length bodies); keep the connection."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    return await _exchange_on(reader, writer, request, timeout), reader, writer


async def _exchange_on(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes,
                       timeout: float) -> Answer | None:
    """Send one request on an open connection and read its answer (a Content-Length body)."""
    writer.write(request)
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
    answer = parse_answer(head)
    if answer is not None and "content-length" in answer.headers:
        answer.body = await asyncio.wait_for(reader.readexactly(int(answer.headers["content-length"])), timeout)
    return answer


@dataclass
class ConnectionsResult:
    connections: int
    opened: int
    errors: int
    open_seconds: float
    gateway_counted: int
    gateway_rss_idle_mb: float
    gateway_rss_held_mb: float
    gateway_rss_after_mb: float
    kib_per_connection: float
    first_errors: list[str] = field(default_factory=list)


async def hold_connections(fleet: AbuseFleet, n: int, batch: int = 250) -> ConnectionsResult:
    """Open `n` connections, one answered `GET /health` on each, all held open at once; then close them."""
    idle_rss = fleet.rss_bytes()
    held: list[asyncio.StreamWriter] = []
    errors: list[str] = []
    started = time.perf_counter()

    async def one() -> None:
        try:
            answer, _, writer = await _ask(fleet.port, HEALTH)
            held.append(writer)
            if answer is None or answer.status != 200:
                errors.append(f"status {answer.status if answer else None}")
        except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    for start in range(0, n, batch):
        await asyncio.gather(*(one() for _ in range(min(batch, n - start))))
    opened_in = time.perf_counter() - started
    counted = await _gauge(fleet.port, "kvgate_client_connections")  # all of them must still be open (idle timeout)
    held_rss = fleet.rss_bytes()
    for writer in held:
        writer.close()
    await asyncio.sleep(1.0)
    after_rss = fleet.rss_bytes()
    return ConnectionsResult(
        connections=n, opened=len(held), errors=len(errors), open_seconds=round(opened_in, 2),
        gateway_counted=int(counted) - 1,  # minus the connection that asked
        gateway_rss_idle_mb=round(idle_rss / 2**20, 1), gateway_rss_held_mb=round(held_rss / 2**20, 1),
        gateway_rss_after_mb=round(after_rss / 2**20, 1),
        kib_per_connection=round((held_rss - idle_rss) / max(1, len(held)) / 1024, 1),
        first_errors=errors[:5],
    )


async def _gauge(port: int, name: str) -> float:
    answer, _, writer = await _ask(port, b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n")
    writer.close()
    assert answer is not None
    for line in answer.body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def _set_behaviour(fleet: AbuseFleet, **behaviour: Any) -> None:
    body = orjson.dumps(behaviour)
    for url in fleet.worker_urls:
        port = int(url.rsplit(":", 1)[1])
        _, _, writer = await _ask(port, b"POST /standin/behaviour HTTP/1.1\r\nHost: w\r\nContent-Type: "
                                  b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        writer.close()


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
            % (path.encode(), len(body), extra)) + body


COMPLETION = orjson.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 2})


@dataclass
class OverloadResult:
    in_flight_cap: int
    requests: int
    statuses: dict[str, int]
    with_retry_after: int
    p50_ms: float
    p99_ms: float
    max_ms: float


async def overload(fleet: AbuseFleet, cap: int, n: int, concurrency: int = 8) -> OverloadResult:
    """Fill the in-flight cap with requests the workers hold, then send `n` more and time their answers."""
    await _set_behaviour(fleet, first_token_delay_s=60.0)
    holders: list[asyncio.Task[Any]] = []
    try:
        for _ in range(cap):
            holders.append(asyncio.create_task(_ask(fleet.port, _post("/v1/completions", COMPLETION), 120)))
        deadline = time.monotonic() + 30
        while await _gauge(fleet.port, "kvgate_requests_in_flight") < cap and time.monotonic() < deadline:  # noqa: ASYNC110 - polling another process
            await asyncio.sleep(0.05)
        latencies: list[float] = []
        statuses: dict[str, int] = {}
        retry_after = 0
        queue = iter(range(n))

        async def client() -> None:  # one keep-alive connection, as an OpenAI client's pool would use
            nonlocal retry_after
            reader: asyncio.StreamReader | None = None
            writer: asyncio.StreamWriter | None = None
            for _ in queue:
                started = time.perf_counter()
                try:
                    if writer is None:
                        reader, writer = await asyncio.open_connection("127.0.0.1", fleet.port)
                    assert reader is not None
                    answer = await _exchange_on(reader, writer, _post("/v1/completions", COMPLETION), 10)
                    status = str(answer.status) if answer else "none"
                    retry_after += bool(answer and "retry-after" in answer.headers)
                except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                    status = type(exc).__name__
                    if writer is not None:
                        writer.close()
                    reader = writer = None
                latencies.append(time.perf_counter() - started)
                statuses[status] = statuses.get(status, 0) + 1
            if writer is not None:
                writer.close()

        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        for task in holders:
            task.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
        await _set_behaviour(fleet, first_token_delay_s=0.0)
    return OverloadResult(cap, n, statuses, retry_after, round(percentile(latencies, 0.5) * 1e3, 2),
                          round(percentile(latencies, 0.99) * 1e3, 2), round(max(latencies) * 1e3, 2))


class HealthProber:
    """`GET /health` every 10 ms, each on a new connection, from a process of its own (so the load this process
    generates does not delay the probes): the latency of each, and how many failed."""

    def __init__(self, port: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._ready = ctx.Event()
        self._receive, send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=_probe_process, args=(port, self._stop, self._ready, send), daemon=True)
        self.latencies: list[float] = []
        self.failures = 0

    def __enter__(self) -> HealthProber:
        self._process.start()
        if not self._ready.wait(30):
            self._process.kill()
            raise RuntimeError("the /health prober process did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        try:
            if self._receive.poll(30):
                self.latencies, self.failures = self._receive.recv()
        except EOFError:
            raise RuntimeError("the /health prober process died") from None
        finally:
            self._process.join(10)


def _probe_process(port: int, stop: Any, ready: Any, send: Any) -> None:
    async def probe() -> tuple[list[float], int]:
        latencies: list[float] = []
        failures = 0
        ready.set()
        while not stop.is_set():
            started = time.perf_counter()
            try:
                answer, _, writer = await _ask(port, HEALTH, 5)
                writer.close()
                failures += answer is None or answer.status != 200
            except (OSError, asyncio.IncompleteReadError, TimeoutError):
                failures += 1
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)
        return latencies, failures

    send.send(asyncio.run(probe()))


@dataclass
class HealthLatency:
    probes: int
    failures: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    loop_busy: float = 0.0  # share of the time the gateway's event loop ran on a CPU
    loop_waiting: float = 0.0  # share of the time it was runnable but waited for a CPU (other processes had them)

    @classmethod
    def of(cls, prober: HealthProber, sched: tuple[float, float], seconds: float) -> HealthLatency:
        probes = prober.latencies
        return cls(len(probes), prober.failures, round(percentile(probes, 0.5) * 1e3, 2),
                   round(percentile(probes, 0.99) * 1e3, 2), round(max(probes, default=0) * 1e3, 2),
                   round(sched[0] / seconds, 3), round(sched[1] / seconds, 3))


class LoopTime:
    """The gateway loop's CPU and run-queue time over a phase (`_schedstat`)."""

    def __init__(self, fleet: AbuseFleet) -> None:
        self._pid = fleet.gateway.pid

    def __enter__(self) -> LoopTime:
        self._began = time.monotonic()
        self._start = _schedstat(self._pid)
        return self

    def __exit__(self, *exc: object) -> None:
        end = _schedstat(self._pid)
        self.seconds = time.monotonic() - self._began
        self.ran, self.waited = end[0] - self._start[0], end[1] - self._start[1]

    @property
    def sched(self) -> tuple[float, float]:
        return self.ran, self.waited


async def health_alone(fleet: AbuseFleet, seconds: float) -> HealthLatency:
    """`/health` probed for `seconds` with nothing else sent to the gateway."""
    with HealthProber(fleet.port) as prober, LoopTime(fleet) as loop:
        await asyncio.sleep(seconds)
    return HealthLatency.of(prober, loop.sched, loop.seconds)


@dataclass
class HostileResult:
    seconds: float
    health_baseline: HealthLatency  # the same probes with no hostile traffic, just before
    health: HealthLatency  # during the hostile traffic (the figures below, kept for readers of older files)
    health_probes: int
    health_failures: int
    health_p50_ms: float
    health_p99_ms: float
    health_max_ms: float
    hostile_requests: dict[str, dict[str, int]]
    slowloris_connections: int
    slowloris_reopened: int
    gateway_rss_peak_mb: float
    sandbox_rss_peak_mb: float


async def hostile(fleet: AbuseFleet, seconds: float, slowloris: int, template_clients: int = 2,
                  body_clients: int = 2, body_mb: int = 40, baseline_s: float = 5.0) -> HostileResult:
    """Probe /health alone for `baseline_s`, then run templates, oversized bodies and slowloris connections for
    `seconds`, probing /health meanwhile."""
    baseline = await health_alone(fleet, baseline_s)
    stop_at = time.monotonic() + seconds
    outcomes: dict[str, dict[str, int]] = {}
    reopened = 0

    def count(kind: str, status: str) -> None:
        outcomes.setdefault(kind, {})[status] = outcomes.setdefault(kind, {}).get(status, 0) + 1

    async def templates(i: int) -> None:
        bombs = [NESTED_LOOPS, MEMORY_BOMB, DEEP_TEMPLATE]
        n = i
        while time.monotonic() < stop_at:
            template = bombs[n % len(bombs)]
            n += 1
            body = orjson.dumps({"model": "tiny", "max_tokens": 1, "chat_template": template,
                                 "messages": [{"role": "user", "content": f"bomb {n}"}]})
            try:
                answer, _, writer = await _ask(fleet.port, _post("/v1/chat/completions", body), 30)
                writer.close()
                count("template", str(answer.status if answer else None))
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                count("template", type(exc).__name__)

    async def bodies(i: int) -> None:
        n = i
        while time.monotonic() < stop_at:
            kind = n % 3
            n += 1
            try:
                if kind == 0:  # a declared body far over the limit: refused before a byte is read
                    answer, _, writer = await _ask(fleet.port, b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n"
                                                   b"Content-Length: 1073741824\r\n\r\n", 30)
                    label = "declared 1 GiB"
                elif kind == 1:  # a chunked body that never ends: refused at the limit
                    reader, writer = await asyncio.open_connection("127.0.0.1", fleet.port)
                    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n\r\n")
                    piece = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
                    answer = None
                    with contextlib.suppress(ConnectionError):
                        for _ in range(body_mb):
                            writer.write(piece)
                            await writer.drain()
                            if reader.at_eof():
                                break
                    head = await asyncio.wait_for(reader.read(65536), 30)
                    answer = parse_answer(head)
                    label = f"chunked {body_mb} MiB"
                else:  # a JSON nesting bomb (a body over 64 KiB is parsed in a thread)
                    answer, _, writer = await _ask(fleet.port, _post("/v1/completions", b"[" * (1 << 20)), 30)
                    label = "nesting bomb 1 MiB"
                writer.close()
                count(label, str(answer.status if answer else None))
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                count("bodies", type(exc).__name__)

    async def loris(i: int) -> None:
        nonlocal reopened
        partial = i % 2 == 1  # half send nothing, half drip a request head that never ends
        while time.monotonic() < stop_at:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", fleet.port)
            except OSError:
                await asyncio.sleep(0.5)
                continue
            if partial:
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\n")
            with contextlib.suppress(ConnectionError, OSError):
                while time.monotonic() < stop_at and not reader.at_eof():
                    if partial:
                        writer.write(b"X-Drip: a\r\n")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(reader.read(1024), 1.0)
            writer.close()
            if time.monotonic() < stop_at:
                reopened += 1

    with RssSampler(fleet) as rss, HealthProber(fleet.port) as prober, LoopTime(fleet) as loop:
        await asyncio.gather(*(loris(i) for i in range(slowloris)), *(templates(i) for i in range(template_clients)),
                             *(bodies(i) for i in range(body_clients)))
    during = HealthLatency.of(prober, loop.sched, loop.seconds)
    return HostileResult(
        seconds=seconds, health_baseline=baseline, health=during, health_probes=during.probes,
        health_failures=during.failures, health_p50_ms=during.p50_ms, health_p99_ms=during.p99_ms,
        health_max_ms=during.max_ms, hostile_requests=outcomes,
        slowloris_connections=slowloris, slowloris_reopened=reopened,
        gateway_rss_peak_mb=round(rss.peak_gateway / 2**20, 1), sandbox_rss_peak_mb=round(rss.peak_sandbox / 2**20, 1),
    )


# --- the command ------------------------------------------------------------------------------------------------


@dataclass
class AbuseReport:
    open_file_limit: tuple[int, int]
    gateway_args: list[str]
    load_average_before: tuple[float, float, float] = (0.0, 0.0, 0.0)  # the machine's, for context
    load_average_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    connections: ConnectionsResult | None = None
    overload: OverloadResult | None = None
    hostile: HostileResult | None = None
    gateway_rss_peak_mb: float = 0.0
    sandbox_rss_peak_mb: float = 0.0
    gateway_log_errors: list[str] = field(default_factory=list)


async def run_phases(fleet: AbuseFleet, report: AbuseReport, connections: int, overload_requests: int,
                     in_flight_cap: int, hostile_s: float, slowloris: int, baseline_s: float) -> None:
    if connections:
        report.connections = await hold_connections(fleet, connections)
    if overload_requests:
        report.overload = await overload(fleet, in_flight_cap, overload_requests)
    if hostile_s:
        report.hostile = await hostile(fleet, hostile_s, slowloris, baseline_s=baseline_s)


def raise_own_file_limit() -> tuple[int, int]:
    """This process needs a socket per client connection too: lift its soft limit to the hard one."""
    raise_open_file_limit()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def run_abuse(model_dir: Path, log_dir: Path, *, connections: int, overload_requests: int, in_flight_cap: int,
              hostile_s: float, slowloris: int, baseline_s: float = 5.0, extra_args: Sequence[str] = ()
              ) -> AbuseReport:
    limits = raise_own_file_limit()
    gateway_args = ["--max-in-flight-requests", str(in_flight_cap), *extra_args]
    report = AbuseReport(open_file_limit=limits, gateway_args=gateway_args, load_average_before=os.getloadavg())
    with abuse_fleet(model_dir, log_dir, gateway_args) as fleet:
        with RssSampler(fleet) as rss:
            _run_loop(run_phases(fleet, report, connections, overload_requests, in_flight_cap, hostile_s, slowloris,
                                 baseline_s))
        report.gateway_rss_peak_mb = round(rss.peak_gateway / 2**20, 1)
        report.sandbox_rss_peak_mb = round(rss.peak_sandbox / 2**20, 1)
        report.gateway_log_errors = [line for line in fleet.log_text().splitlines()
                                     if "Traceback" in line or "unexpected error" in line][:10]
    report.load_average_after = os.getloadavg()
    return report


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--connections", type=int, default=10_000, help="client connections held at once")
    parser.add_argument("--overload-requests", type=int, default=1000, help="requests sent over the in-flight cap")
    parser.add_argument("--in-flight-cap", type=int, default=256, help="the gateway's --max-in-flight-requests")
    parser.add_argument("--hostile-s", type=float, default=20.0, help="seconds of hostile traffic")
    parser.add_argument("--baseline-s", type=float, default=5.0,
                        help="seconds of /health probes alone before the hostile traffic (the machine's own tail)")
    parser.add_argument("--slowloris", type=int, default=2000, help="slowloris connections (half idle, half "
                        "dripping a request head), re-opened when the gateway closes them")
    parser.add_argument("--out", default="out/abuse.json", help="JSON results file")


def print_summary(report: AbuseReport) -> None:
    """The figures, one line each (the JSON file has everything)."""
    load = "/".join(f"{x:.1f}" for x in report.load_average_before)
    print(f"machine: {os.cpu_count()} CPUs, load average {load} before the run")
    if (held := report.connections) is not None:
        print(f"connections: {held.opened:,} of {held.connections:,} held at once, {held.errors} errors, "
              f"{held.gateway_counted:,} counted by the gateway; RSS {held.gateway_rss_idle_mb} MB idle, "
              f"{held.gateway_rss_held_mb} MB with them ({held.kib_per_connection} KiB each)")
    if (over := report.overload) is not None:
        print(f"overload: {over.requests} requests over a full cap of {over.in_flight_cap}: {over.statuses}, "
              f"{over.with_retry_after} with Retry-After; p50 {over.p50_ms} ms, p99 {over.p99_ms} ms, "
              f"max {over.max_ms} ms")
    if (h := report.hostile) is not None:
        b = h.health_baseline
        for what, x in (("alone", b), (f"during {h.seconds:g} s of hostile traffic", h.health)):
            print(f"/health {what}: {x.probes} probes, p50 {x.p50_ms} ms, p99 {x.p99_ms} ms, max {x.max_ms} ms, "
                  f"{x.failures} failed; the gateway's loop ran {x.loop_busy:.0%} of the time and waited for a "
                  f"CPU {x.loop_waiting:.0%}")
        print(f"hostile requests: {h.hostile_requests}; {h.slowloris_connections} slowloris connections, "
              f"{h.slowloris_reopened} re-opened after the gateway cut them")
    print(f"RSS peak: gateway {report.gateway_rss_peak_mb} MB, its template sandbox {report.sandbox_rss_peak_mb} MB; "
          f"errors in the gateway's log: {len(report.gateway_log_errors)}")


def run(args: argparse.Namespace) -> int:
    from bench.make_model import write_model

    with tempfile.TemporaryDirectory(prefix="kvgate-abuse-") as tmp:
        model_dir = Path(tmp) / "model"
        write_model(model_dir)
        report = run_abuse(model_dir, Path(tmp), connections=args.connections,
                           overload_requests=args.overload_requests, in_flight_cap=args.in_flight_cap,
                           hostile_s=args.hostile_s, slowloris=args.slowloris, baseline_s=args.baseline_s)
    data = asdict(report)
    print_summary(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(orjson.dumps({"benchmark": "abuse", "python": sys.version.split()[0], "cpus": os.cpu_count(),
                                  **data}, option=orjson.OPT_INDENT_2))
    print(f"wrote {out}")
    return 0
