"""Worker discovery against a broken or hostile DNS server: a real responder on loopback (UDP and TCP, dnspython's
message API) whose answers the test picks — flapping records, garbage, silence — and workers that are real stand-in
HTTP servers on loopback addresses."""

from __future__ import annotations

import asyncio
import itertools
import logging
import resource
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest
from aiohttp import web

from bench.procs import free_port
from kvcore.config import ConfigError
from router.config import GatewayConfig, WorkerSpec
from tests.conftest import Standin, eventually, running_gateway, running_standin
from tests.test_discovery import NAME, standin_at, urls


@dataclass
class DnsResponder:
    """What the responder answers for NAME: A/AAAA `records`, or in `mode` "garbage" (bytes that are no DNS
    message) or "silent" (nothing at all)."""

    port: int
    records: list[str] = field(default_factory=list)
    mode: str = "answer"
    queries: int = 0

    def answer(self, wire: bytes) -> bytes | None:
        self.queries += 1
        if self.mode == "silent":
            return None
        query = dns.message.from_wire(wire)
        if self.mode == "garbage":
            return wire[:2] + b"\x81\x80\xff\xff" + b"\xde\xad" * 20  # its id, then nonsense
        response = dns.message.make_response(query)
        question = query.question[0]
        if question.name.to_text().rstrip(".") != NAME:
            response.set_rcode(dns.rcode.NXDOMAIN)
            return response.to_wire()
        rdtype = "AAAA" if question.rdtype == dns.rdatatype.AAAA else "A"
        addresses = [a for a in self.records if (":" in a) == (rdtype == "AAAA")]
        if addresses:
            response.answer.append(dns.rrset.from_text_list(question.name, 0, "IN", rdtype, addresses))
        response.flags |= dns.flags.AA
        return response.to_wire(max_size=65535)


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, responder: DnsResponder) -> None:
        self.responder = responder

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport: asyncio.DatagramTransport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.responder.answer(data)
        if reply is not None:
            if len(reply) > 512:  # too long for UDP: truncated, the client asks again over TCP
                message = dns.message.from_wire(reply)
                message.answer.clear()
                message.flags |= dns.flags.TC
                reply = message.to_wire()
            self.transport.sendto(reply, addr)


@asynccontextmanager
async def dns_responder() -> AsyncIterator[DnsResponder]:
    responder = DnsResponder(free_port())

    async def serve_tcp(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                size = int.from_bytes(await reader.readexactly(2), "big")
                reply = responder.answer(await reader.readexactly(size))
                if reply is None:
                    await asyncio.sleep(3600)
                    return
                writer.write(len(reply).to_bytes(2, "big") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    loop = asyncio.get_running_loop()
    udp, _ = await loop.create_datagram_endpoint(lambda: _Udp(responder), local_addr=("127.0.0.1", responder.port))
    tcp = await asyncio.start_server(serve_tcp, "127.0.0.1", responder.port)
    try:
        yield responder
    finally:
        udp.close()
        tcp.close()


def connections_to(worker: Standin) -> int:
    """Connections the stand-in worker has open (to the gateway: its only client)."""
    server = worker.runner.server
    return len(server.connections) if server is not None else 0


async def test_a_worker_whose_record_flaps_leaves_no_connection_open() -> None:
    """Records that come and go every round (pods rescheduled onto new addresses, or a hostile DNS server): each
    removed worker's keep-alive connections (its probes', its scrapes') stayed open in the gateway's upstream pool,
    with their per-host slots, for as long as the gateway ran: one file descriptor or more per address ever
    seen. A worker forgotten by the pool now takes its connections along."""
    port = free_port()
    hosts = [f"127.0.0.{i}" for i in range(2, 8)]
    async with dns_responder() as dns_server, AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(standin_at(host, port)) for host in hosts]
        dns_server.records = [hosts[0]]
        async with running_gateway([], discover=[f"dns:{NAME}:{port}"],
                                   discover_nameserver=f"127.0.0.1:{dns_server.port}",
                                   discover_interval_s=0.1) as gw:
            pool, upstream = gw.gateway.pool, gw.gateway._upstream
            assert upstream is not None
            await eventually(lambda: connections_to(workers[0]) > 0)  # probed over a kept-alive connection
            for previous, current in itertools.pairwise(workers):
                dns_server.records = [current.url.split("//")[1].split(":")[0]]  # the last one's record gone
                await eventually(lambda: urls(gw) == {current.url}, timeout=5)  # noqa: B023
                await eventually(lambda: len(pool.all()) == 1, timeout=5)  # the last one drained and forgotten
                await eventually(lambda: connections_to(previous) == 0, timeout=5)  # noqa: B023
                await eventually(lambda: connections_to(current) > 0, timeout=5)  # noqa: B023
            assert len(upstream._idle) <= 1 and len(upstream._slots) <= 1


async def test_a_dns_answer_of_hundreds_of_records_fills_the_pool_up_to_max_workers(
    http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    """A DNS answer naming hundreds of addresses (over TCP, after a truncated UDP answer; thousands fit in one):
    each became a worker with its watching task, probes, connections and KV-event sockets (4,000 records made
    8,000 tasks and stalled the event loop 1.6-2 s), with no limit. The pool holds `max_workers` now: discovery adds
    the first ones, warns once while the rest are left out, and adds them as others leave; an admin add beyond
    it is a 409 `pool_full`. Each round's log line names a few of the workers seen, not all of them."""
    port = free_port()
    many = [f"127.2.{i // 250}.{i % 250 + 1}" for i in range(300)]
    async with dns_responder() as dns_server:
        dns_server.records = many
        with caplog.at_level(logging.INFO, logger="router.discovery"):
            async with running_gateway([], discover=[f"dns:{NAME}:{port}"], max_workers=20,
                                       discover_nameserver=f"127.0.0.1:{dns_server.port}",
                                       discover_interval_s=0.1, discover_events_port=5557) as gw:
                pool = gw.gateway.pool
                assert len(pool.all()) == 20
                rounds = dns_server.queries
                await eventually(lambda: dns_server.queries >= rounds + 6)  # three more rounds (A and AAAA each)
                assert len(pool.all()) == 20
                async with http.post(gw.url + "/admin/workers", json={"url": "http://127.3.0.1:8000"}) as resp:
                    body = await resp.json()
                    assert resp.status == 409 and body["error"]["code"] == "pool_full", body
                dns_server.records = many[280:]  # the 20 in the pool gone, 20 others there
                await eventually(lambda: urls(gw) == {f"http://{a}:{port}" for a in many[280:]}, timeout=5)
                async with http.get(gw.url + "/health") as resp:
                    assert resp.status == 200
    warnings = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert warnings == ["discovery: 280 workers seen are left out: the pool holds max_workers (20)"], warnings
    seen = [r.getMessage() for r in caplog.records if "sees 300 workers" in r.getMessage()]
    assert seen and all(len(line) < 1000 for line in seen), seen


def test_more_configured_workers_than_max_workers_are_refused_at_start() -> None:
    with pytest.raises(ConfigError, match="max_workers"):
        GatewayConfig(worker=[WorkerSpec.parse(f"http://127.0.0.1:{8000 + i}") for i in range(3)], max_workers=2)
    GatewayConfig(worker=[WorkerSpec.parse(f"http://127.0.0.1:{8000 + i}") for i in range(2)], max_workers=2)


async def test_the_gateway_listed_as_its_own_worker_is_never_routed_to(http: aiohttp.ClientSession) -> None:
    """The gateway's own address added as a worker (an admin's slip, or a discovery name that also resolves to
    the gateway): it answered its own probes (`/health` 200, `/v1/models` the fleet's models), so it was healthy
    and requests were routed to it, each hop taking another connection and admission slot; once the real workers
    were gone it listed their models from its own earlier listing, and a request went round the loop until the
    gateway's limits answered 503. The gateway names itself in the `Via` header of what it sends to workers and
    answers a request that comes back with its own name with a 508 `loop_detected`: it never becomes healthy."""
    async with running_standin() as worker, running_gateway([worker.url]) as gw:
        async with http.post(gw.url + "/admin/workers", json={"url": gw.url}) as resp:
            assert resp.status == 201
        itself = gw.gateway.pool.get(gw.url)
        assert itself is not None
        await eventually(lambda: itself.consecutive_failures >= 2, timeout=5)
        assert not itself.healthy and "508" in (itself.last_error or ""), itself.last_error
        for _ in range(10):
            async with http.post(gw.url + "/v1/completions",
                                 json={"model": "tiny", "prompt": "hi", "max_tokens": 1}) as resp:
                assert resp.status == 200
        assert itself.routed == 0
        async with http.get(gw.url + "/health", headers={"Via": f"1.0 other, 1.1 {gw.gateway.hop}"}) as resp:
            body = await resp.json()
            assert resp.status == 508 and body["error"]["code"] == "loop_detected", body
        async with http.get(gw.url + "/health", headers={"Via": "1.1 kvgate-0123456789ab"}) as resp:
            assert resp.status == 200  # another gateway in front: no loop


async def test_a_worker_url_no_probe_could_reach_is_refused_and_spoils_no_other_source(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Worker URLs accepted before and never reachable: `http://[::1:9` (an unclosed bracket) was a 500 at
    /admin/workers, and as a line of a workers file it raised out of the discovery round, so no source's answer
    was applied (a DNS source's new records were ignored for as long as the file held the line); a query or
    fragment (`/health` was appended after it), port 0, and https:// (the gateway speaks plain HTTP to workers: every
    probe failed) were added and never healthy. Each is a 400 `invalid_worker` now, and a failing source fails
    its own round only."""
    port = free_port()
    workers_file = tmp_path / "workers.txt"
    workers_file.write_text("http://[::1:9\n")
    async with dns_responder() as dns_server, standin_at("127.0.0.2", port) as a, standin_at("127.0.0.3", port) as b:
        dns_server.records = ["127.0.0.2"]
        async with running_gateway([], discover=[f"dns:{NAME}:{port}", f"file:{workers_file}"],
                                   discover_nameserver=f"127.0.0.1:{dns_server.port}", discover_interval_s=0.1) as gw:
            for bad in ("http://[::1:9", "http://127.0.0.1:9/#x", "http://127.0.0.1:9?a=1", "http://127.0.0.1:9/?",
                        "http://127.0.0.1:0", "https://127.0.0.1:9"):
                async with http.post(gw.url + "/admin/workers", json={"url": bad}) as resp:
                    body = await resp.json()
                    assert resp.status == 400 and body["error"]["code"] == "invalid_worker", (bad, body)
            assert urls(gw) == {a.url}
            dns_server.records = ["127.0.0.3"]
            await eventually(lambda: urls(gw) == {b.url}, timeout=5)
            assert (gw.gateway.metrics.registry.get_sample_value(
                "kvgate_discovery_errors_total", {"source": f"file:{workers_file}"}) or 0) >= 1


async def test_a_dns_answer_naming_no_workers_addresses_adds_none_of_them(caplog: pytest.LogCaptureFixture) -> None:
    """A DNS answer (a broken or spoofed server) naming the unspecified address (0.0.0.0 connects to this host),
    link-local ones (the cloud metadata service at 169.254.169.254; any host on the segment may claim one),
    multicast or broadcast: each became a worker, probed with upstream_api_key in its Authorization. They are left
    out now, with one warning while the answer says the same; loopback is still a worker (Compose, tests)."""
    port = free_port()
    junk = ["0.0.0.0", "169.254.169.254", "224.0.0.1", "255.255.255.255", "240.0.0.1", "::", "fe80::1", "ff02::1",
            "::ffff:169.254.169.254"]
    async with dns_responder() as dns_server, standin_at("127.0.0.2", port) as good:
        dns_server.records = ["127.0.0.2", *junk]
        with caplog.at_level(logging.WARNING, logger="router.discovery"):
            async with running_gateway([], discover=[f"dns:{NAME}:{port}"], upstream_api_key="secret",
                                       discover_nameserver=f"127.0.0.1:{dns_server.port}",
                                       discover_interval_s=0.1) as gw:
                assert urls(gw) == {good.url}
                rounds = dns_server.queries
                await eventually(lambda: dns_server.queries >= rounds + 6)
                assert urls(gw) == {good.url}
    warnings = [r.getMessage() for r in caplog.records if "no worker's" in r.getMessage()]
    assert len(warnings) == 1 and "9 addresses" in warnings[0], warnings


async def test_a_dns_server_answering_garbage_or_nothing_keeps_the_pool_as_it_was() -> None:
    """A DNS server that answers bytes that are no DNS message, or nothing at all (UDP, and TCP held open): each
    round fails within its timeout and is counted, the pool stays as the last good answer left it, rounds go on
    (nothing waits forever) and a good answer is followed again."""
    port = free_port()
    async with dns_responder() as dns_server, standin_at("127.0.0.2", port) as a, standin_at("127.0.0.3", port) as b:
        dns_server.records = ["127.0.0.2"]
        source = f"dns:{NAME}:{port}"
        async with running_gateway([], discover=[source], discover_nameserver=f"127.0.0.1:{dns_server.port}",
                                   discover_interval_s=0.2) as gw:
            assert urls(gw) == {a.url}

            def errors() -> float:
                return gw.gateway.metrics.registry.get_sample_value(
                    "kvgate_discovery_errors_total", {"source": source}) or 0.0

            for mode in ("garbage", "silent"):
                dns_server.mode = mode
                counted = errors()
                await eventually(lambda: errors() >= counted + 2, timeout=10)  # noqa: B023 - each round ends
                assert urls(gw) == {a.url}
            dns_server.mode, dns_server.records = "answer", ["127.0.0.3"]
            await eventually(lambda: urls(gw) == {b.url}, timeout=5)


async def test_an_oversized_admin_request_is_told_the_admin_limit(http: aiohttp.ClientSession) -> None:
    """/admin/workers reads at most 64 KiB; a larger body was refused (413) with a message naming max_body_bytes
    (32 MiB), a limit the client had not exceeded. Declared or chunked, the 413 names the limit that applied."""
    async with running_gateway([]) as gw:
        body = b'{"url": "http://127.0.0.1:9", "pad": "' + b"x" * 70_000 + b'"}'

        async def chunked() -> AsyncIterator[bytes]:
            for start in range(0, len(body), 8192):
                yield body[start:start + 8192]

        for data in (body, chunked()):
            async with http.post(gw.url + "/admin/workers", data=data,
                                 headers={"Content-Type": "application/json"}) as resp:
                error = (await resp.json())["error"]
                assert resp.status == 413 and error["code"] == "body_too_large", error
                assert str(64 * 1024) in error["message"], error
        async with http.post(gw.url + "/admin/workers", json={"url": "http://127.0.0.1:9"}) as resp:
            assert resp.status == 201  # and it goes on serving


@asynccontextmanager
async def hung_health_worker(delay_s: float) -> AsyncIterator[tuple[str, list[float]]]:
    """A worker whose /health answers after `delay_s` seconds; the times it was asked."""
    asked: list[float] = []

    async def health(request: web.Request) -> web.Response:
        asked.append(time.monotonic())
        await asyncio.sleep(delay_s)
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}", asked
    finally:
        await runner.cleanup()


async def test_adding_a_worker_probes_that_worker_only(http: aiohttp.ClientSession) -> None:
    """Each admin add (and each discovery round that added a worker) probed every worker in the pool and waited for
    them all: one worker whose /health hangs made every add answer after health_timeout_s, and a thousand adds cost
    each worker a thousand probes. Only the new worker is probed now."""
    async with hung_health_worker(2.0) as (hung, asked), AsyncExitStack() as stack:
        standins = [await stack.enter_async_context(running_standin()) for _ in range(3)]
        async with running_gateway([hung], health_interval_s=60, health_timeout_s=3) as gw:
            before = len(asked)  # the probe at start
            for standin in standins:
                began = time.monotonic()
                async with http.post(gw.url + "/admin/workers", json={"url": standin.url}) as resp:
                    assert resp.status == 201
                    assert (await resp.json())["healthy"]
                assert time.monotonic() - began < 1.5  # not held by the hung worker's 2 s
            assert len(asked) == before, "the hung worker was probed again by each add"


async def test_a_workers_file_without_end_is_read_to_a_limit(tmp_path: Path) -> None:
    """`file:/dev/zero` (or a file some process writes without end): the whole file was read into memory, in a
    thread that the round's timeout stopped waiting for but not reading, so the gateway's memory grew until it was
    killed. A workers file is read to 1 MiB at most now (a round over it fails, counted), and parsed off the event
    loop, once per change."""
    listed = tmp_path / "workers.txt"
    async with running_standin() as worker:
        listed.write_text(worker.url + "\n")
        endless = "file:/dev/zero"
        peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        async with running_gateway([], discover=[f"file:{listed}", endless], discover_interval_s=0.2) as gw:
            def errors() -> float:
                return gw.gateway.metrics.registry.get_sample_value(
                    "kvgate_discovery_errors_total", {"source": endless}) or 0.0

            await eventually(lambda: errors() >= 3, timeout=10)
            assert urls(gw) == {worker.url}
        grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before
        assert grown_kib < 64 * 1024, f"the gateway grew by {grown_kib} KiB"


async def test_a_dns_server_that_stays_down_is_logged_at_most_every_ten_seconds(
    caplog: pytest.LogCaptureFixture
) -> None:
    """Each failed round logged a warning: a DNS server down for an hour wrote 720 lines at the default interval,
    36,000 at 0.1 s. A source's failures are logged at most every 10 s now, each line saying how many rounds
    failed since; every one is still counted."""
    port = free_port()
    async with dns_responder() as dns_server:
        dns_server.mode = "garbage"
        source = f"dns:{NAME}:{port}"
        with caplog.at_level(logging.WARNING, logger="router.discovery"):
            async with running_gateway([], discover=[source], discover_nameserver=f"127.0.0.1:{dns_server.port}",
                                       discover_interval_s=0.05) as gw:
                await eventually(lambda: (gw.gateway.metrics.registry.get_sample_value(
                    "kvgate_discovery_errors_total", {"source": source}) or 0) >= 5, timeout=10)
    failed = [r.getMessage() for r in caplog.records if "failed, keeping its last answer" in r.getMessage()]
    assert len(failed) == 1, failed
