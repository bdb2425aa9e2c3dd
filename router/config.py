"""The gateway's configuration (`kvgate serve`): one typed object built from a YAML file, `KVGATE_*` environment
variables and command-line flags by kvcore/config.py (flags > environment > file > defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvcore.config import ConfigError, option
from router.discovery_sources import parse_nameserver, parse_source
from router.kv_transport import cache_name


@dataclass(frozen=True)
class WorkerSpec:
    """One upstream replica: its HTTP base URL and, optionally, its KV-event endpoints — the engine's, and its
    tier agent's (whose events name the agent's tiers)."""

    url: str
    events: str | None = None
    replay: str | None = None
    agent_events: str | None = None
    agent_replay: str | None = None
    dp_ranks: int = 1  # a data-parallel engine: a cache and a publisher per rank (vLLM: port + rank)

    ATTRIBUTES = ("events", "replay", "agent_events", "agent_replay")  # the endpoints
    KEYS = (*ATTRIBUTES, "dp_ranks")

    def __post_init__(self) -> None:
        _check_worker_url(self.url)
        for attr in self.ATTRIBUTES:
            endpoint = getattr(self, attr)
            if endpoint is not None:
                _check_endpoint(attr, endpoint)
        if isinstance(self.dp_ranks, str) and self.dp_ranks.isdigit():
            object.__setattr__(self, "dp_ranks", int(self.dp_ranks))
        if not isinstance(self.dp_ranks, int) or isinstance(self.dp_ranks, bool) or not 1 <= self.dp_ranks <= 1024:
            raise ConfigError(f"worker dp_ranks must be a whole number from 1 to 1024: {self.dp_ranks!r}")

    def caches(self) -> list[tuple[int | None, str]]:
        """(data-parallel rank, the KV index's name for its cache) of each cache the worker has: one, unranked,
        unless it is a data-parallel engine."""
        if self.dp_ranks == 1:
            return [(None, self.url)]
        return [(rank, cache_name(self.url, rank)) for rank in range(self.dp_ranks)]

    @classmethod
    def parse(cls, text: str) -> WorkerSpec:
        """Parse `http://host:port;events=tcp://host:5557;replay=tcp://host:5558` (+ `agent_events=`,
        `agent_replay=`, `dp_ranks=`)."""
        url, *attrs = (part.strip() for part in text.split(";"))
        values: dict[str, Any] = {}
        for attr in attrs:
            key, sep, value = attr.partition("=")
            if not sep or key not in cls.KEYS:
                raise ConfigError(f"unknown worker attribute {attr!r} in {text!r} "
                                  f"(expected {', '.join(a + '=' for a in cls.KEYS)})")
            values[key] = value
        return cls(url=url.rstrip("/"), **values)

    @classmethod
    def from_yaml(cls, value: Any) -> WorkerSpec:
        if isinstance(value, str):
            return cls.parse(value)
        if isinstance(value, Mapping) and isinstance(value.get("url"), str):
            unknown = set(value) - {"url", *cls.KEYS}
            if unknown:
                raise ConfigError(f"unknown worker keys {sorted(unknown)}")
            given: dict[str, Any] = {a: value[a] for a in cls.KEYS if a in value}
            return cls(url=cls.parse(value["url"]).url, **given)
        raise ConfigError(f"a worker is a URL string or a mapping with 'url': {value!r}")


def _check_worker_url(url: object) -> None:
    if isinstance(url, str) and url.startswith("https://"):
        # accepted before, and then every probe failed: the gateway's client to workers speaks plain HTTP only
        raise ConfigError(f"worker URL must be http:// (the gateway speaks plain HTTP to workers): {url!r}")
    if not isinstance(url, str) or not url.startswith("http://"):
        raise ConfigError(f"worker URL must start with http://: {url!r}")
    if any(c.isspace() or not c.isprintable() for c in url):
        # a URL is a label value and is logged: a newline in it forges log lines (Python's parser drops it)
        raise ConfigError(f"worker URL must not contain whitespace or control characters: {url!r}")
    if "?" in url or "#" in url:
        # paths are appended to the URL (`/health`, `/v1/completions`): after a query or fragment they went nowhere
        raise ConfigError(f"worker URL must not have a query or fragment: {url!r}")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # an unclosed IPv6 bracket: it was a 500 at /admin/workers
        raise ConfigError(f"worker URL is malformed ({exc}): {url!r}") from None
    if parts.username is not None or parts.password is not None:
        # a password in a URL ends up in labels, logs and listings; workers authenticate with upstream_api_key
        shown = parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]).geturl()
        raise ConfigError(f"worker URL must not carry credentials (use upstream_api_key): {shown}")
    try:
        port = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError:
        port = -1
    if port is not None and not 0 < port < 65536:
        raise ConfigError(f"worker URL has a bad port: {url!r}")
    if not parts.hostname:
        raise ConfigError(f"worker URL has no host: {url!r}")


def _check_endpoint(attr: str, endpoint: object) -> None:
    """A ZMQ endpoint the gateway connects to: tcp://HOST:PORT or ipc://PATH."""
    if isinstance(endpoint, str):
        scheme, sep, rest = endpoint.partition("://")
        host, colon, port = rest.rpartition(":")
        if sep and scheme == "ipc" and rest:
            return
        if (sep and scheme == "tcp" and colon and host and host != "*" and port.isdigit()
                and 0 < int(port) < 65536 and not any(c.isspace() for c in rest)):
            return
    raise ConfigError(f"worker {attr} endpoint must be tcp://HOST:PORT or ipc://PATH: {endpoint!r}")


def _parse_worker(text: str) -> WorkerSpec:
    return WorkerSpec.parse(text)


def _parse_discover(text: str) -> str:
    return str(parse_source(text))


def _parse_nameserver(text: str) -> str:
    if text.strip():
        parse_nameserver(text)
    return text.strip()


@dataclass(frozen=True)
class GatewayConfig:
    """Everything `kvgate serve` can be told."""

    host: str = option("0.0.0.0", "address the gateway listens on")
    port: int = option(8000, "port the gateway listens on")
    worker: list[WorkerSpec] = option(
        [], "upstream vLLM replica, repeatable: URL[;events=EP;replay=EP;agent_events=EP;agent_replay=EP;dp_ranks=N]",
        parse=_parse_worker, aliases=("workers",),
    )
    strategy: str = option("round_robin", "routing strategy: round_robin, least_load, prefix or kv")
    api_key: list[str] = option([], "accepted client API key (Authorization: Bearer), repeatable; none = open")
    admin_key: str = option(
        "", "key required for /admin/* (Authorization: Bearer), different from every api key; empty with api "
        "keys set = refused at start unless --allow-api-key-admin; empty without api keys = /admin/* open"
    )
    allow_api_key_admin: bool = option(
        False, "without admin_key, let every api key use /admin/* (add workers, so receive any tenant's prompts)"
    )
    upstream_api_key: str = option(
        "", "API key sent to workers; empty = forward the client's Authorization, to the workers of --worker only"
    )
    max_body_bytes: int = option(32 * 1024 * 1024, "largest accepted request body in bytes (413 above)")
    body_timeout_s: float = option(30.0, "longest wait for a client's request body (408 after)")
    max_response_bytes: int = option(
        256 * 1024 * 1024, "largest whole (non-streamed) answer relayed from a worker in bytes (502 above; a stream "
        "is relayed as it arrives, unbounded)"
    )
    max_in_flight_requests: int = option(
        4096, "proxied requests in flight at once, gateway-wide; beyond, an immediate 503 with Retry-After"
    )
    max_in_flight_bytes: int = option(
        256 * 1024 * 1024, "request-body bytes held by requests in flight, gateway-wide; beyond, an immediate 503 "
        "with Retry-After (a parsed body takes a few times its size on top)"
    )
    max_client_connections: int = option(
        16384, "open client connections; beyond, a new one gets a 503 and is closed (logged, counted); lowered "
        "to fit the open-file limit, which `kvgate serve` raises to its hard limit"
    )
    client_idle_timeout_s: float = option(
        15.0, "a client connection that has not sent a whole request head this long after connecting or after its "
        "last answer is closed (idle keep-alive, and slowloris heads)"
    )
    processes: int = option(
        1, "gateway processes sharing the port (SO_REUSEPORT), each with its own pool, KV-event subscriptions, index "
        "and trie; more than 1: /admin/workers cannot add or remove workers (409) and record_trace is refused"
    )
    connect_timeout_s: float = option(5.0, "timeout for opening a connection to a worker")
    ttfb_timeout_s: float = option(120.0, "streaming requests: timeout until a worker sends its response headers")
    response_timeout_s: float = option(
        600.0, "non-streaming requests: timeout until a worker's answer starts (vLLM answers once the whole "
        "generation is done, so this bounds a generation)"
    )
    read_timeout_s: float = option(120.0, "longest silence between two chunks of a worker's response")
    total_timeout_s: float = option(1800.0, "timeout for a whole proxied request")
    max_attempts: int = option(3, "workers tried for one request on connect errors or 502/503 before any byte")
    max_connections_per_worker: int = option(256, "connection pool limit per worker")
    health_interval_s: float = option(2.0, "interval between health probes of each worker")
    health_timeout_s: float = option(2.0, "timeout of one health probe (GET /health)")
    unhealthy_after: int = option(2, "consecutive failed probes before a worker is ejected")
    metrics_interval_s: float = option(1.0, "interval between scrapes of each worker's /metrics")
    models_refresh_s: float = option(30.0, "interval between refreshes of each worker's /v1/models")
    drain_timeout_s: float = option(600.0, "longest wait for in-flight requests of a removed worker")
    max_workers: int = option(
        1000, "most workers in the pool (configured, admin-added, discovered, draining): a DNS answer or a workers "
        "file naming more adds the first ones only, an admin add beyond it is a 409"
    )
    # worker discovery (issue 8): router/discovery.py
    discover: list[str] = option(
        [], "worker discovery source, repeatable: dns:NAME:PORT (one worker per A/AAAA record of NAME, e.g. a "
        "headless service) or file:PATH (YAML list or one URL per line, re-read when it changes)",
        parse=_parse_discover,
    )
    discover_interval_s: float = option(5.0, "interval between discovery rounds (DNS lookups, file checks)")
    discover_nameserver: str = option(
        "", "DNS server for dns: discovery, IP or IP:PORT; empty = the system resolver (getaddrinfo)",
        parse=_parse_nameserver,
    )
    discover_events_port: int = option(0, "KV-event PUB port on each discovered host, as tcp://HOST:PORT; 0 = none")
    discover_replay_port: int = option(0, "KV-event replay port on each discovered host; 0 = none")
    log_level: str = option("info", "log level: debug, info, warning, error")
    # prompts: tokenization and block keys, for strategies that read them (`prefix`, `kv`)
    model_dir: list[str] = option(
        [], "tokenizer source, repeatable: DIR for every model, or NAME=DIR per served model; DIR is a model "
        "directory or a Hugging Face cache (models--org--name); none = text mode (character blocks)"
    )
    block_size: int = option(16, "tokens per KV block; must equal the engines' --block-size")
    tenant_header: str = option(
        "", "request header naming the tenant, set by a proxy you trust: the engines get a cache_salt in the "
        "tenant's namespace (TENANT, TENANT:SALT with the client's own salt, :SALT without a tenant)"
    )
    tokenizer_threads: int = option(2, "threads that tokenize prompts and parse large bodies off the event loop")
    tokenizer_processes: int = option(
        2, "processes that encode prompts of 8,192 characters or more, so that their tokenizing never holds the "
        "event loop's GIL; per gateway process, at most tokenizer_threads; 0 = in the tokenizer threads"
    )
    tokenizer_processes_nice: int = option(
        10, "niceness the tokenizer processes add to the gateway's (capped at 19): they take a core from the event "
        "loop only when it leaves one; 0 = the gateway's priority"
    )
    trust_request_chat_template: bool = option(
        False, "render a request's own chat_template (Jinja code written by the client) to route it by tokens, in "
        "sandbox processes with a deadline and memory limit; off = route such requests in text mode (vLLM refuses "
        "them unless started with --trust-request-chat-template)"
    )
    template_processes: int = option(1, "sandbox processes rendering clients' own chat templates")
    template_timeout_s: float = option(
        1.0, "longest a client's chat template may take to render (waiting for a sandbox included); the process is "
        "killed and replaced after, the request routed in text mode"
    )
    route_max_prompt_bytes: int = option(
        1024 * 1024, "a generation request whose body is larger than this is routed by load alone: its prompt is not "
        "parsed, tokenized, hashed or remembered (kvgate_oversized_prompts_total counts them)"
    )
    prompt_cache_bytes: int = option(
        256 * 1024 * 1024, "bytes of recent prompts kept tokenized (text, token ids, block keys), so a prompt that "
        "starts like a recent one is encoded only from where they part"
    )
    # KV events in and the block index, for strategies that read them (`kv`)
    kv_index_max_entries: int = option(20_000_000, "kv: most (block, worker) entries in the block index")
    kv_identity_blocks: int = option(
        1 << 19, "kv: engine block hashes remembered per model with the gateway key they name, kept across "
        "resets so later blocks still chain to them (about 100 bytes each)"
    )
    kv_replay_timeout_s: float = option(2.0, "kv: timeout of one replay request to an event source")
    kv_resync_s: float = option(
        300.0, "kv: after missed events, seconds a worker is routed approximately before its map is trusted again"
    )
    predicted_ttft_header: bool = option(
        False, "answer each request the strategy predicted a time to first token for (`ttft`) with it, in "
        "milliseconds, in an X-Kvgate-Predicted-Ttft-Ms header (kvgate bench compare's predicted-vs-observed plot); "
        "it tells clients how loaded the fleet is, so it is off by default"
    )
    # the traffic as a trace, for kvgate bench vsim / plan / calibrate (router/trace_recorder.py)
    record_trace: str = option(
        "", "write a trace of the traffic to this file: a JSON line per finished request (Mooncake's format plus "
        "model, tenant, strategy, worker, predicted and reported cached tokens, time to first byte, status; no "
        "text, no token ids); empty = off"
    )
    record_trace_block_tokens: int = option(
        512, "tokens per hash id in the trace: a multiple of block_size, down to block_size for an exact replay"
    )
    record_trace_secret: str = option(
        "", "key of the trace's block hashes (set it through KVGATE_RECORD_TRACE_SECRET); empty = a random key per "
        "process"
    )
    record_trace_max_bytes: int = option(256 * 1024 * 1024, "a trace file is rotated when it reaches this size")
    record_trace_max_age_s: float = option(3600.0, "a trace file is rotated when it is this old")

    def __post_init__(self) -> None:
        if self.api_key and not self.admin_key and not self.allow_api_key_admin:
            raise ConfigError("api_key is set but admin_key is not: /admin/* would accept every client key (and an "
                              "admin can route any tenant's prompts to a worker of its own); set admin_key, or "
                              "allow_api_key_admin to accept that")
        if self.admin_key and self.admin_key in self.api_key:
            raise ConfigError("admin_key must differ from every api_key")
        if self.processes < 1:
            raise ConfigError(f"processes must be at least 1: {self.processes}")
        if len(self.worker) > self.max_workers:
            raise ConfigError(f"{len(self.worker)} workers configured, more than max_workers ({self.max_workers})")
        if not 0 <= self.tokenizer_processes_nice <= 19:
            raise ConfigError(f"tokenizer_processes_nice must be 0 to 19: {self.tokenizer_processes_nice}")
        if self.processes > 1 and self.record_trace:
            raise ConfigError("record_trace needs processes = 1: each process would write the same file")
        if self.processes > 1 and self.port == 0:
            raise ConfigError("processes > 1 needs a fixed port: with port 0 each process would pick its own")
        if self.record_trace_block_tokens < self.block_size or self.record_trace_block_tokens % self.block_size:
            raise ConfigError(f"record_trace_block_tokens ({self.record_trace_block_tokens}) must be a multiple of "
                              f"block_size ({self.block_size})")
