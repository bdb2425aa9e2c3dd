"""What one simulated replica is told: vLLM's engine flags (same names and defaults where they apply), the time
profile, and where it serves HTTP and KV events."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bench.sim.agent_link import AgentLinkConfig
from bench.sim.engine import EngineConfig
from bench.sim.offload import DEFAULT_LINKS, parse_link
from bench.sim.perf_model import DEFAULT_PROFILE, PROFILES, Profile

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")


class KvEventsConfig(msgspec.Struct, forbid_unknown_fields=False):
    """vLLM's `--kv-events-config` JSON (KVEventsConfig), the fields that apply."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


def offset_endpoint_port(endpoint: str | None, offset: int) -> str | None:
    """vLLM's data-parallel rule: rank i publishes on the configured TCP port + i."""
    if endpoint is None or offset == 0 or not endpoint.startswith("tcp://"):
        return endpoint
    match = re.fullmatch(r"(tcp://.*:)(\d+)", endpoint)
    if match is None:
        return endpoint
    return f"{match.group(1)}{int(match.group(2)) + offset}"


@dataclass(frozen=True)
class ReplicaConfig:
    index: int
    host: str
    port: int
    model_dir: str
    tokenizer_dir: str
    served_model_names: tuple[str, ...]
    profile: Profile
    engine: EngineConfig
    hash_algo: str
    kv_events: KvEventsConfig | None         # None: no events
    enable_prompt_tokens_details: bool
    api_key: str | None
    output_len: int
    request_timeout_s: float
    agent: AgentLinkConfig | None = None     # a tier agent beside the replica

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host
        return f"http://{host}:{self.port}"

    @property
    def events_endpoint(self) -> str | None:
        return self.kv_events.endpoint if self.kv_events else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.kv_events.replay_endpoint if self.kv_events else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--replicas", type=int, default=1, help="number of replicas, one process each (default 1)")
    fleet.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    fleet.add_argument("--port", type=int, default=8101, help="HTTP port of replica 0; replica i uses port+i")
    fleet.add_argument("--events-port", type=int, default=5601,
                       help="KV-event PUB port of replica 0 (tcp://*:PORT); replica i uses events-port+i")
    fleet.add_argument("--replay-port", type=int, default=5701,
                       help="KV-event replay ROUTER port of replica 0; replica i uses replay-port+i")
    fleet.add_argument("--no-kv-events", action="store_true", help="publish no KV events")
    fleet.add_argument("--replica-index", type=int, default=None, help=argparse.SUPPRESS)

    sim = parser.add_argument_group("simulation")
    sim.add_argument("--model-dir", "--model", dest="model_dir", required=True,
                     help="model directory with tokenizer.json and tokenizer_config.json (kvgate make-model)")
    sim.add_argument("--profile", default=DEFAULT_PROFILE, choices=sorted(PROFILES),
                     help=f"time-model profile (default {DEFAULT_PROFILE}; see docs/sim.md)")
    sim.add_argument("--speedup", type=float, default=1.0, help="divide every simulated duration by this")
    sim.add_argument("--output-len", type=int, default=64,
                     help="tokens of a synthetic answer before its EOS when the request sets no max_tokens")
    sim.add_argument("--request-timeout-s", type=float, default=3600.0,
                     help="longest a request may stay in the engine before it is aborted")

    agent = parser.add_argument_group("tier agent (docs/sim.md: a replica with a real `kvgate agent` beside it)")
    agent.add_argument("--agent-socket", default=None,
                       help="Unix socket of a `kvgate agent`: computed blocks are saved to it, blocks after the GPU "
                            "prefix hit are loaded from it; with --replicas N, replica i uses PATH.i")
    agent.add_argument("--agent-layout", default=None,
                       help="replicas with the same layout text share blocks (default: profile, block size, hash)")
    agent.add_argument("--agent-block-bytes", type=int, default=None,
                       help="real KV bytes of one block, for transfer times (default: the profile's KV bytes per "
                            "token x block size)")
    agent.add_argument("--agent-payload-bytes", type=int, default=64,
                       help="stand-in bytes stored per block (agent capacities count these; default 64)")
    agent.add_argument("--agent-link", action="append", default=None, metavar="CODE=GBPS:LATENCY_US",
                       help="transfer model of one agent tier (C DRAM, D NVMe, S shared), repeatable; defaults "
                            + ", ".join(f"{c}={link.bytes_per_s / 1e9:g}:{link.latency_s * 1e6:g}"
                                        for c, link in DEFAULT_LINKS.items()))
    agent.add_argument("--agent-timeout-s", type=float, default=0.5, help="timeout of one agent call")
    agent.add_argument("--agent-retry-s", type=float, default=1.0,
                       help="after an agent failure, run without the agent for this long (recompute)")
    agent.add_argument("--agent-probe-ms", type=int, default=0,
                       help="let a lookup wait this long for the shared tier to be asked (connector's probe_ms)")

    vllm = parser.add_argument_group("vLLM engine flags")
    vllm.add_argument("--block-size", type=int, default=None,
                      help="tokens per KV block (default: the profile's platform default, 16 on GPUs)")
    vllm.add_argument("--num-gpu-blocks-override", type=int, default=None,
                      help="KV blocks in the cache (default: what the profile's KV memory holds)")
    vllm.add_argument("--max-num-seqs", type=int, default=None, help="most sequences per step (default: profile)")
    vllm.add_argument("--max-num-batched-tokens", type=int, default=None,
                      help="token budget per step (default: profile)")
    vllm.add_argument("--max-model-len", type=int, default=None,
                      help="context length (default: the model dir's max_position_embeddings, else profile)")
    vllm.add_argument("--prefix-caching-hash-algo", default="sha256", choices=HASH_ALGOS)
    vllm.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    vllm.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    vllm.add_argument("--served-model-name", nargs="+", default=None,
                      help="model names served (default: the --model-dir value, as vLLM)")
    vllm.add_argument("--kv-events-config", default=None,
                      help="vLLM's KV events JSON; overrides --events-port/--replay-port (ports offset by replica)")
    vllm.add_argument("--enable-prompt-tokens-details", action="store_true",
                      help="report usage.prompt_tokens_details.cached_tokens")
    vllm.add_argument("--api-key", default=None, help="require this Bearer key on /v1/* (as vLLM)")
    vllm.add_argument("--tokenizer", default=None, help="tokenizer directory (default: --model-dir)")
    vllm.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                      help="fraction of the profile's GPU memory vLLM may use; sizes the KV cache (default 0.9)")

    ignored = parser.add_argument_group("accepted for compatibility with `vllm serve`, no effect here")
    for flag in ("--enforce-eager", "--trust-remote-code", "--disable-log-requests", "--disable-log-stats",
                 "--enable-log-requests"):
        ignored.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    for flag in ("--load-format", "--dtype", "--seed", "--tensor-parallel-size", "--pipeline-parallel-size",
                 "--uvicorn-log-level", "--kv-cache-dtype", "--swap-space"):
        ignored.add_argument(flag, default=None, help=argparse.SUPPRESS)


def _model_max_len(model_dir: str) -> int | None:
    path = Path(model_dir) / "config.json"
    try:
        value = json.loads(path.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) else None


def replica_config(args: argparse.Namespace, index: int) -> ReplicaConfig:
    """The config of replica `index` from the `kvgate sim` flags; raises ValueError on bad values."""
    profile = PROFILES[args.profile]
    block_size = args.block_size or profile.block_size
    engine = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=args.num_gpu_blocks_override or profile.num_gpu_blocks(block_size,
                                                                              args.gpu_memory_utilization),
        max_num_seqs=args.max_num_seqs or profile.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or profile.max_num_batched_tokens,
        max_model_len=args.max_model_len or _model_max_len(args.model_dir) or profile.max_model_len,
        speedup=args.speedup,
        enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill,
    )
    engine.validate()
    kv_events: KvEventsConfig | None
    if args.kv_events_config:
        try:
            kv_events = msgspec.json.decode(args.kv_events_config, type=KvEventsConfig)
        except msgspec.DecodeError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from exc
        if not kv_events.enable_kv_cache_events or kv_events.publisher == "null":
            kv_events = None
        else:
            kv_events = msgspec.structs.replace(
                kv_events, endpoint=offset_endpoint_port(kv_events.endpoint, index) or kv_events.endpoint,
                replay_endpoint=offset_endpoint_port(kv_events.replay_endpoint, index))
    elif args.no_kv_events:
        kv_events = None
    else:
        kv_events = KvEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                   endpoint=f"tcp://*:{args.events_port + index}",
                                   replay_endpoint=f"tcp://*:{args.replay_port + index}")
    if args.output_len <= 0:
        raise ValueError("--output-len must be positive")
    agent = None
    if args.agent_socket:
        links = dict(DEFAULT_LINKS)
        for text in args.agent_link or ():
            code, link = parse_link(text)
            links[code] = link
        socket_path = args.agent_socket if args.replica_index is None and args.replicas == 1 \
            else f"{args.agent_socket}.{index}"
        if args.agent_payload_bytes < 8:
            raise ValueError("--agent-payload-bytes must be at least 8")
        agent = AgentLinkConfig(
            socket_path=socket_path,
            layout=args.agent_layout or f"sim|{profile.name}|{block_size}|{args.prefix_caching_hash_algo}",
            block_bytes=args.agent_block_bytes or profile.model.kv_bytes_per_token * block_size,
            payload_bytes=args.agent_payload_bytes, links=links, timeout_s=args.agent_timeout_s,
            retry_s=args.agent_retry_s, probe_ms=args.agent_probe_ms)
    return ReplicaConfig(
        index=index,
        host=args.host,
        port=args.port + index,
        model_dir=args.model_dir,
        tokenizer_dir=args.tokenizer or args.model_dir,
        served_model_names=tuple(args.served_model_name or [args.model_dir]),
        profile=profile,
        engine=engine,
        hash_algo=args.prefix_caching_hash_algo,
        kv_events=kv_events,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        api_key=args.api_key or os.environ.get("VLLM_API_KEY") or None,
        output_len=args.output_len,
        request_timeout_s=args.request_timeout_s,
        agent=agent,
    )
