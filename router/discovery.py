"""Worker discovery: keep the pool in step with a DNS name (a headless service's A/AAAA records) or a file.

Each round, every source says which workers it sees now; workers that appeared are added to the pool, workers
that vanished are removed through `WorkerPool.remove`, so their in-flight requests drain. A source that fails a
round (DNS timeout, unreadable file) keeps its last answer: a flaky resolver must not empty the fleet. Discovery
only ever removes workers it added itself; static `--worker` entries and admin-added workers are left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import heapq
import ipaddress
import logging
import socket
from collections.abc import Iterable

import dns.asyncresolver
import dns.exception
import dns.resolver
import yaml

from kvcore.config import ConfigError
from kvcore.log_throttle import LogThrottle, held_back_note
from router.config import GatewayConfig, WorkerSpec
from router.discovery_sources import DnsSource, Source, parse_nameserver, parse_source
from router.metrics import GatewayMetrics
from router.pool import PoolFull, Worker, WorkerPool

log = logging.getLogger(__name__)


class DiscoveryError(Exception):
    """A source could not answer this round; its previous answer stands."""


def _host_in_url(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def is_worker_address(address: str) -> bool:
    """Whether a DNS answer's address may be a worker's: not unspecified (0.0.0.0 connects to this host), multicast,
    broadcast or reserved, nor link-local, where the cloud metadata service (169.254.169.254) answers and any host
    on the segment may claim an address: the pool's probes carry upstream_api_key. Loopback may (Compose, tests)."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    # IPv6's "reserved" holds ::1 and NAT64's 64:ff9b::/96: IPv4's only (240/4, broadcast)
    return not (ip.is_unspecified or ip.is_multicast or ip.is_link_local or (ip.version == 4 and ip.is_reserved))


def worker_for_address(address: str, port: int, config: GatewayConfig) -> WorkerSpec:
    """The worker at one resolved address, its event endpoints from the configured ports on the same host."""
    host = _host_in_url(address)
    return WorkerSpec(
        url=f"http://{host}:{port}",
        events=f"tcp://{host}:{config.discover_events_port}" if config.discover_events_port else None,
        replay=f"tcp://{host}:{config.discover_replay_port}" if config.discover_replay_port else None,
    )


def with_event_template(spec: WorkerSpec, config: GatewayConfig) -> WorkerSpec:
    """A listed worker without its own event endpoints gets the template's, on its URL's host."""
    if spec.events or spec.replay or not (config.discover_events_port or config.discover_replay_port):
        return spec
    authority = spec.url.split("://", 1)[1].split("/", 1)[0]
    host = authority.rsplit(":", 1)[0] if not authority.endswith("]") else authority
    return dataclasses.replace(
        spec,
        events=f"tcp://{host}:{config.discover_events_port}" if config.discover_events_port else None,
        replay=f"tcp://{host}:{config.discover_replay_port}" if config.discover_replay_port else None,
    )


def _some(urls: Iterable[str], most: int = 8) -> str:
    """A few of the workers a source sees, for a log line (a DNS answer may hold thousands)."""
    shown = heapq.nsmallest(most + 1, urls)
    return ", ".join(shown[:most]) + (", ..." if len(shown) > most else "")


def parse_workers_file(text: str) -> list[WorkerSpec]:
    """A YAML list (or `workers:` mapping) of worker specs, or plain lines `URL[;events=..;replay=..]`."""
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError:
        loaded = None
    if isinstance(loaded, dict) and "workers" in loaded:
        loaded = loaded["workers"]
    if isinstance(loaded, list):
        return [WorkerSpec.from_yaml(item) for item in loaded]
    if loaded is not None and not isinstance(loaded, str):
        raise ConfigError("a workers file holds a YAML list, a `workers:` list, or one URL per line")
    specs = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            specs.append(WorkerSpec.parse(line))
    return specs


MAX_WORKERS_FILE_BYTES = 1 << 20  # a workers file of 1,000 workers with their endpoints is about 150 KB


def read_workers_file(path: str) -> str:
    """A workers file's text, at most MAX_WORKERS_FILE_BYTES (ValueError beyond): `file:/dev/zero`, or a file some
    process writes without end, grew the gateway's memory for as long as the read went on (the timeout only stops
    the wait for it), and its whole text was parsed on the event loop."""
    with open(path, "rb") as file:
        data = file.read(MAX_WORKERS_FILE_BYTES + 1)
    if len(data) > MAX_WORKERS_FILE_BYTES:
        raise ValueError(f"larger than {MAX_WORKERS_FILE_BYTES} bytes")
    return data.decode()


class WorkerDiscovery:
    """Polls every configured source each `discover_interval_s` and reconciles the pool with what they see."""

    def __init__(self, config: GatewayConfig, pool: WorkerPool, metrics: GatewayMetrics) -> None:
        self._config = config
        self._pool = pool
        self._sources = [parse_source(text) for text in config.discover]
        self._metrics = metrics
        self._seen: dict[Source, dict[str, WorkerSpec]] = {}
        self._file_text: dict[str, tuple[str, list[WorkerSpec] | ConfigError]] = {}  # each file's text, parsed
        self._reading: dict[str, asyncio.Future[str]] = {}  # reads of workers files under way, by path
        self._added: dict[str, WorkerSpec] = {}   # workers this discovery put in the pool, by URL
        self._refused: dict[Source, list[str]] = {}  # addresses a DNS source answered that are no worker's
        self._left_out = 0  # workers seen but not added last round, the pool being full (warned when it changes)
        self._warnings: dict[Source, LogThrottle] = {}  # per source: its failed rounds' warnings
        self._task: asyncio.Task[None] | None = None
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._timeout = max(0.5, min(5.0, config.discover_interval_s))
        if config.discover_nameserver:
            address, port = parse_nameserver(config.discover_nameserver)
            self._resolver = dns.asyncresolver.Resolver(configure=False)
            self._resolver.nameservers = [address]
            self._resolver.port = port
            self._resolver.lifetime = self._timeout

    @property
    def workers(self) -> dict[str, WorkerSpec]:
        """The workers discovery has in the pool now, by URL."""
        return dict(self._added)

    async def start(self) -> None:
        """Run one round (so discovered workers exist when the gateway starts serving), then poll."""
        if not self._sources:
            return
        await self.refresh()
        self._task = asyncio.get_running_loop().create_task(self._poll(), name="worker discovery")

    async def stop(self) -> None:
        for reading in self._reading.values():
            reading.cancel()  # its thread ends when the read does
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self._config.discover_interval_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("worker discovery round failed")

    async def refresh(self) -> None:
        """One round: ask every source, then add and remove workers."""
        answers = await asyncio.gather(*(self._lookup(s) for s in self._sources), return_exceptions=True)
        for source, answer in zip(self._sources, answers, strict=True):
            if isinstance(answer, Exception):  # a defect too (not one of ours): that source's round fails, no other's
                self._metrics.discovery_errors.labels(str(source)).inc()
                self._warn_failed(source, answer)
                continue
            if isinstance(answer, BaseException):
                raise answer
            if answer != self._seen.get(source):
                log.info("discovery %s sees %d workers: %s", source, len(answer), _some(answer))
            self._seen[source] = answer
            self._metrics.discovered_workers.labels(str(source)).set(len(answer))
        await self._reconcile()

    def _warn_failed(self, source: Source, error: Exception) -> None:
        """Log a source's failed round, unless it logged one within the last 10 s (then count it): a DNS server
        that is down failed every round, a line each (ten a second at discover_interval_s 0.1)."""
        held_back = self._warnings.setdefault(source, LogThrottle()).due()
        if held_back is None:
            return
        more = held_back_note(held_back)
        if isinstance(error, DiscoveryError | ConfigError | OSError):
            log.warning("discovery %s failed, keeping its last answer: %s%s", source, error, more)
        else:
            log.error("discovery %s failed, keeping its last answer%s", source, more, exc_info=error)

    async def _reconcile(self) -> None:
        wanted: dict[str, WorkerSpec] = {}
        for seen in self._seen.values():
            for url, spec in seen.items():
                wanted.setdefault(url, spec)
        for url, spec in list(self._added.items()):
            if wanted.get(url) != spec:
                # gone, or its endpoints changed: drain it; a changed one comes back once the drain is over
                del self._added[url]
                with contextlib.suppress(KeyError):
                    self._pool.remove(url)
                    log.info("discovery: worker %s removed (draining)", url)
        added: list[Worker] = []
        left_out = 0
        for url, spec in wanted.items():
            if url in self._added:
                continue
            if left_out:
                left_out += 1
                continue
            try:
                added.append(self._pool.add(spec))
            except KeyError:
                continue  # configured statically, added by an admin, or still draining: try again next round
            except PoolFull:
                left_out = 1  # this one and the rest: tried again next round, as workers leave
                continue
            self._added[url] = spec
            log.info("discovery: worker %s added", url)
        if left_out != self._left_out:
            self._left_out = left_out
            if left_out:
                log.warning("discovery: %d workers seen are left out: the pool holds max_workers (%d)", left_out,
                            self._config.max_workers)
        if added:
            await self._pool.probe(added)  # the new ones: the others' own watchers probe them

    async def _lookup(self, source: Source) -> dict[str, WorkerSpec]:
        if isinstance(source, DnsSource):
            addresses = await self._resolve(source.name)
            refused = sorted({a for a in addresses if not is_worker_address(a)})
            if refused != self._refused.get(source, []):
                self._refused[source] = refused
                if refused:
                    log.warning("discovery %s: %d addresses are no worker's and are left out: %s", source,
                                len(refused), _some(refused))
            specs = [worker_for_address(a, source.port, self._config) for a in addresses if is_worker_address(a)]
        else:
            specs = [with_event_template(s, self._config) for s in await self._read_file(source.path)]
        return {spec.url: spec for spec in specs}

    async def _resolve(self, name: str) -> list[str]:
        if self._resolver is None:
            return await self._resolve_system(name)
        addresses: list[str] = []
        for rdtype in ("A", "AAAA"):
            try:
                answer = await self._resolver.resolve(name, rdtype, search=False)
            except dns.resolver.NXDOMAIN:
                return []  # the name is gone: a headless service with no ready endpoints
            except dns.resolver.NoAnswer:
                continue
            except dns.exception.DNSException as exc:
                raise DiscoveryError(f"{rdtype} {name}: {type(exc).__name__}: {exc}") from exc
            addresses.extend(sorted(rdata.to_text() for rdata in answer))
        return addresses

    async def _resolve_system(self, name: str) -> list[str]:
        """The system resolver (getaddrinfo: /etc/hosts, resolv.conf, a container runtime's DNS)."""
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(name, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), self._timeout
            )
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            raise DiscoveryError(f"{name}: {exc}") from exc
        except TimeoutError as exc:
            raise DiscoveryError(f"{name}: no answer within {self._timeout} s") from exc
        return sorted({str(info[4][0]) for info in infos})

    async def _read_file(self, path: str) -> list[WorkerSpec]:
        # a read that never returns (a FIFO, a hung network mount) fails the round after the timeout; the next
        # rounds wait for that same read instead of starting another thread each
        reading = self._reading.get(path)
        if reading is None:
            reading = self._reading[path] = asyncio.ensure_future(asyncio.to_thread(read_workers_file, path))
        try:
            text = await asyncio.wait_for(asyncio.shield(reading), self._timeout)
        except TimeoutError:
            raise DiscoveryError(f"cannot read {path}: no answer within {self._timeout:g} s") from None
        except OSError as exc:
            raise DiscoveryError(f"cannot read {path}: {exc}") from exc
        except UnicodeDecodeError as exc:
            raise DiscoveryError(f"{path} is not text: {exc}") from exc
        except ValueError as exc:  # over the size limit
            raise DiscoveryError(f"cannot read {path}: {exc}") from exc
        finally:
            if reading.done():
                self._reading.pop(path, None)
        parsed = self._file_text.get(path)
        if parsed is None or parsed[0] != text:
            log.info("discovery: workers file %s changed", path)
            try:  # parsed once per change, off the event loop: a megabyte of YAML is a second of CPU
                parsed = (text, await asyncio.to_thread(parse_workers_file, text))
            except ConfigError as exc:
                parsed = (text, exc)
            self._file_text[path] = parsed
        if isinstance(parsed[1], ConfigError):
            raise DiscoveryError(f"{path}: {parsed[1]}")
        return parsed[1]
