"""Worker discovery against real sources: a real DNS server (dnsmasq) on loopback whose records the test changes,
a workers file rewritten under the gateway, and the system resolver. Workers are real stand-in HTTP servers."""

from __future__ import annotations

import asyncio
import grp
import os
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from bench.procs import free_port, wait_for_port, wait_http
from bench.procs import stop as stop_process
from bench.standin import StandinBehaviour, create_standin_app
from kvcore.config import ConfigError, load_config
from kvgate.serve import ENV_PREFIX, add_arguments
from router.config import GatewayConfig
from router.discovery import parse_workers_file
from router.discovery_sources import DnsSource, FileSource, parse_nameserver, parse_source
from tests.conftest import RunningGateway, Standin, eventually, running_gateway, running_standin

NAME = "vllm.kvgate.test"
PROMPT = {"model": "tiny", "prompt": "hello", "max_tokens": 2}


@asynccontextmanager
async def standin_at(host: str, port: int, behaviour: StandinBehaviour | None = None) -> AsyncIterator[Standin]:
    """A stand-in worker on any loopback address (127.0.0.2, ::1, ...)."""
    app = create_standin_app(f"{host}:{port}", behaviour)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    shown = f"[{host}]" if ":" in host else host
    try:
        yield Standin(f"http://{shown}:{port}", app, runner)
    finally:
        await runner.cleanup()


class Dnsmasq:
    """A real dnsmasq answering for `kvgate.test` from a hosts file on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("dnsmasq") or ("/usr/sbin/dnsmasq" if Path("/usr/sbin/dnsmasq").exists() else None)
        if binary is None:
            raise RuntimeError("dnsmasq not found: run scripts/system-deps.sh (apt-get install dnsmasq-base)")
        self.binary = binary
        self.hosts = workdir / "hosts"
        self.hosts.write_text("")
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def nameserver(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        user = pwd.getpwuid(os.getuid()).pw_name
        group = grp.getgrgid(os.getgid()).gr_name
        self.proc = subprocess.Popen(
            [self.binary, "--keep-in-foreground", "--conf-file=/dev/null", f"--port={self.port}",
             "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv", "--no-hosts",
             f"--addn-hosts={self.hosts}", "--local=/kvgate.test/", "--local-ttl=0", "--no-negcache",
             f"--pid-file={self.workdir / 'dnsmasq.pid'}", f"--user={user}", f"--group={group}",
             "--log-facility=-"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, 10, self.proc)

    def set_records(self, *addresses: str) -> None:
        """Replace the name's A/AAAA records and make dnsmasq re-read them (SIGHUP), as a headless service
        changes when pods come and go."""
        self.hosts.write_text("".join(f"{a} {NAME}\n" for a in addresses))
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@pytest.fixture
def dnsmasq(tmp_path: Path) -> Iterator[Dnsmasq]:
    server = Dnsmasq(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def urls(gw: RunningGateway) -> set[str]:
    return {w.url for w in gw.gateway.pool.all() if not w.draining}


def healthy(gw: RunningGateway) -> set[str]:
    return {w.url for w in gw.gateway.pool.healthy()}


def metric(gw: RunningGateway, name: str, **labels: str) -> float:
    value = gw.gateway.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def complete(http: aiohttp.ClientSession, gw: RunningGateway) -> dict[str, Any]:
    async with http.post(gw.url + "/v1/completions", json=PROMPT) as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


# --- parsing --------------------------------------------------------------------------------------------------


def test_sources_parse_and_bad_ones_are_refused() -> None:
    assert parse_source("dns:vllm.ns.svc.cluster.local:8000") == DnsSource("vllm.ns.svc.cluster.local", 8000)
    assert parse_source("file:/etc/kvgate/workers.yaml") == FileSource("/etc/kvgate/workers.yaml")
    for bad in ("dns:vllm", "dns:vllm:http", "dns::80", "dns:vllm:70000", "file:", "srv:x:1", "vllm:8000"):
        with pytest.raises(ConfigError):
            parse_source(bad)


def test_discover_options_from_flags_env_and_yaml(tmp_path: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--discover", "dns:vllm:8000", "--discover", "file:/w.txt",
                              "--discover-events-port", "5557", "--discover-nameserver", "10.96.0.10"])
    cfg = load_config(GatewayConfig, ENV_PREFIX, args, environ={})
    assert cfg.discover == ["dns:vllm:8000", "file:/w.txt"]
    assert (cfg.discover_events_port, cfg.discover_replay_port, cfg.discover_nameserver) == (5557, 0, "10.96.0.10")
    env = load_config(GatewayConfig, ENV_PREFIX, None, environ={"KVGATE_DISCOVER": "dns:a:1,file:/b"})
    assert env.discover == ["dns:a:1", "file:/b"]
    path = tmp_path / "kvgate.yaml"
    path.write_text("discover: [dns:vllm-headless:8000]\ndiscover_interval_s: 2\ndiscover_replay_port: 5558\n")
    from_file = load_config(GatewayConfig, ENV_PREFIX, parser.parse_args(["--config", str(path)]), environ={})
    assert (from_file.discover, from_file.discover_interval_s, from_file.discover_replay_port) == (
        ["dns:vllm-headless:8000"], 2.0, 5558)
    with pytest.raises(ConfigError):
        load_config(GatewayConfig, ENV_PREFIX, parser.parse_args(["--discover", "dns:nope"]), environ={})
    for bad in ("vllm.internal", "10.0.0.1:dns", "[::1]:99999"):
        with pytest.raises(ConfigError):
            load_config(GatewayConfig, ENV_PREFIX, parser.parse_args(["--discover-nameserver", bad]), environ={})
    assert parse_nameserver("[fd00::10]:5353") == ("fd00::10", 5353)
    assert parse_nameserver("fd00::10") == ("fd00::10", 53)
    assert parse_nameserver("127.0.0.1") == ("127.0.0.1", 53)


def test_workers_file_formats() -> None:
    listed = parse_workers_file("- http://a:8000\n- url: http://b:8000\n  events: tcp://b:5557\n")
    assert [(s.url, s.events) for s in listed] == [("http://a:8000", None), ("http://b:8000", "tcp://b:5557")]
    nested = parse_workers_file("workers:\n  - http://c:8000/\n")
    assert [s.url for s in nested] == ["http://c:8000"]
    lines = parse_workers_file("# fleet\nhttp://a:8000\n\nhttp://b:8000;events=tcp://b:5557  # gpu 2\n")
    assert [(s.url, s.events) for s in lines] == [("http://a:8000", None), ("http://b:8000", "tcp://b:5557")]
    assert parse_workers_file("") == []
    for bad in ("foo: bar\n", "- ftp://a\n", "not a url\n"):
        with pytest.raises(ConfigError):
            parse_workers_file(bad)


# --- DNS against a real server ----------------------------------------------------------------------------------


async def test_dns_discovery_follows_records_and_drains_removed_workers(
    dnsmasq: Dnsmasq, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    slow = StandinBehaviour(first_token_delay_s=1.5)
    async with (
        standin_at("127.0.0.2", port, slow) as a,
        standin_at("127.0.0.3", port) as b,
        standin_at("::1", port) as c,
    ):
        dnsmasq.set_records("127.0.0.2", "127.0.0.3")
        async with running_gateway(
            [], discover=[f"dns:{NAME}:{port}"], discover_nameserver=dnsmasq.nameserver, discover_interval_s=0.2,
            discover_events_port=5557, discover_replay_port=5558,
        ) as gw:
            # the first round runs before the gateway serves: both records are workers already
            assert urls(gw) == {a.url, b.url}
            await eventually(lambda: healthy(gw) == {a.url, b.url})
            worker_a = gw.gateway.pool.get(a.url)
            assert worker_a is not None
            assert (worker_a.spec.events, worker_a.spec.replay) == ("tcp://127.0.0.2:5557", "tcp://127.0.0.2:5558")
            assert metric(gw, "kvgate_discovered_workers", source=f"dns:{NAME}:{port}") == 2

            # a request in flight on a: it must finish after a's record disappears
            in_flight = [asyncio.create_task(complete(http, gw)) for _ in range(2)]
            await eventually(lambda: worker_a.in_flight == 1, timeout=5)
            dnsmasq.set_records("127.0.0.3", "::1")
            await eventually(lambda: urls(gw) == {b.url, c.url}, timeout=5)
            assert worker_a.draining and gw.gateway.pool.get(a.url) is worker_a
            served_by_a = a.stats.requests
            for _ in range(4):
                await complete(http, gw)
            assert a.stats.requests == served_by_a, "a draining worker took new requests"
            results = await asyncio.gather(*in_flight)
            assert all(r["choices"] for r in results)
            assert a.stats.completed >= 1
            await eventually(lambda: gw.gateway.pool.get(a.url) is None, timeout=5)
            await eventually(lambda: c.url in healthy(gw), timeout=5)
            worker_c = gw.gateway.pool.get(c.url)
            assert worker_c is not None and worker_c.spec.events == "tcp://[::1]:5557"

            # the DNS server goes away: discovery keeps its last answer, counts the failures
            dnsmasq.stop()
            await eventually(lambda: metric(gw, "kvgate_discovery_errors_total", source=f"dns:{NAME}:{port}") >= 2,
                             timeout=15)
            assert urls(gw) == {b.url, c.url}

            # back, with no records for the name (NXDOMAIN): every discovered worker drains away
            dnsmasq.hosts.write_text("")
            dnsmasq.start()
            await eventually(lambda: not gw.gateway.pool.all(), timeout=10)
            async with http.get(gw.url + "/ready") as resp:
                assert resp.status == 503


async def test_system_resolver_is_the_default(http: aiohttp.ClientSession) -> None:
    async with running_standin() as s:
        port = int(s.url.rsplit(":", 1)[1])
        async with running_gateway([], discover=[f"dns:localhost:{port}"], discover_interval_s=0.2) as gw:
            assert s.url in urls(gw)  # localhost -> 127.0.0.1 (and ::1 where /etc/hosts says so)
            await eventually(lambda: s.url in healthy(gw))
            await complete(http, gw)


# --- workers file -------------------------------------------------------------------------------------------------


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def test_file_discovery_rereads_on_change(tmp_path: Path, http: aiohttp.ClientSession) -> None:
    workers = tmp_path / "workers.yaml"
    async with running_standin() as s1, running_standin() as s2, running_standin() as static:
        write_atomically(workers, f"- {s1.url}\n- url: {s2.url}\n  events: tcp://127.0.0.1:6001\n- {static.url}\n")
        async with running_gateway(
            [static.url], discover=[f"file:{workers}"], discover_interval_s=0.1, discover_events_port=5557,
        ) as gw:
            assert urls(gw) == {s1.url, s2.url, static.url}
            w1, w2 = gw.gateway.pool.get(s1.url), gw.gateway.pool.get(s2.url)
            assert w1 is not None and w2 is not None
            assert w1.spec.events == "tcp://127.0.0.1:5557"   # from the template
            assert w2.spec.events == "tcp://127.0.0.1:6001"   # its own
            await eventually(lambda: healthy(gw) == {s1.url, s2.url, static.url})
            await complete(http, gw)

            # plain lines now, s1 gone, the static worker gone from the file
            write_atomically(workers, f"# one left\n{s2.url};events=tcp://127.0.0.1:6001\n")
            await eventually(lambda: urls(gw) == {s2.url, static.url}, timeout=5)
            assert gw.gateway.discovery is not None
            assert set(gw.gateway.discovery.workers) == {s2.url}

            # a broken file is counted and ignored; the last good list stands
            source = f"file:{workers}"
            write_atomically(workers, "workers: {not: a list}\n")
            await eventually(lambda: metric(gw, "kvgate_discovery_errors_total", source=source) >= 1, timeout=5)
            workers.unlink()
            errors = metric(gw, "kvgate_discovery_errors_total", source=source)
            await eventually(lambda: metric(gw, "kvgate_discovery_errors_total", source=source) > errors, timeout=5)
            assert urls(gw) == {s2.url, static.url}

            # s2's endpoints change: the old entry drains, the new one is added once the drain is over
            write_atomically(workers, f"- url: {s2.url}\n  events: tcp://127.0.0.1:6002\n- {s1.url}\n")
            await eventually(lambda: (w := gw.gateway.pool.get(s2.url)) is not None
                             and w.spec.events == "tcp://127.0.0.1:6002", timeout=5)
            await eventually(lambda: healthy(gw) == {s1.url, s2.url, static.url}, timeout=5)


# --- discovered workers stream KV events to the gateway ----------------------------------------------------------


async def test_dns_discovered_replica_streams_kv_events(
    dnsmasq: Dnsmasq, http: aiohttp.ClientSession, tiny_model_dir: Path, subprocess_env: dict[str, str]
) -> None:
    """A `kvgate sim` replica on 127.0.0.2, found through DNS: the gateway subscribes to tcp://127.0.0.2:EVENTS
    (from the events-port template) and applies the replica's BlockStored events."""
    port, events, replay = free_port(), free_port(), free_port()
    sim = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "sim", "--host", "127.0.0.2", "--port", str(port),
         "--events-port", str(events), "--replay-port", str(replay), "--model-dir", str(tiny_model_dir),
         "--served-model-name", "tiny", "--block-size", "16", "--log-level", "warning"],
        env=subprocess_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.2:{port}"
        await asyncio.to_thread(wait_http, url + "/health", 30)
        dnsmasq.set_records("127.0.0.2")
        async with running_gateway(
            [], strategy="kv", model_dir=[str(tiny_model_dir)], block_size=16, discover=[f"dns:{NAME}:{port}"],
            discover_nameserver=dnsmasq.nameserver, discover_interval_s=0.2, discover_events_port=events,
            discover_replay_port=replay,
        ) as gw:
            worker = gw.gateway.pool.get(url)
            assert worker is not None and worker.spec.events == f"tcp://127.0.0.2:{events}"
            await eventually(lambda: url in healthy(gw))
            # new prompts until events arrive: the subscription may still be connecting when the first is published
            deadline = asyncio.get_running_loop().time() + 15
            n = 0
            while metric(gw, "kvgate_kv_events_applied_total", worker=url, type="BlockStored") == 0:
                assert asyncio.get_running_loop().time() < deadline, "no KV event from the discovered replica"
                n += 1
                body = {"model": "tiny", "prompt": f"request {n}: kv events from a discovered replica " * 8,
                        "max_tokens": 2}
                async with http.post(gw.url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                await asyncio.sleep(0.3)
    finally:
        stop_process(sim)
