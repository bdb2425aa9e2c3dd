"""The routing contract the gateway defines: what a strategy sees of a request (`RouteRequest`), what it answers
(`Decision`) and the interface it implements (`Strategy`). The strategies in strategies/ implement it; the gateway
is handed one by `kvgate serve` and never imports them."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import msgspec
from prometheus_client import CollectorRegistry

from router.config import GatewayConfig
from router.kv_index import KvBlockIndex
from router.pool import Worker


# not frozen (this one and those below): one of each is built per request, and a frozen dataclass's __init__ costs
# 3x (960 against 270 ns, six fields)
@dataclass(slots=True)
class RouteRequest:
    """What a strategy may look at, built once per request: its model and path, its headers and, for strategies
    that read prompts, the prompt's token ids, block keys and length."""

    model: str
    path: str
    headers: Mapping[str, str] = field(default_factory=dict)
    token_ids: Sequence[int] | None = None  # None when not tokenized, or in text mode
    block_keys: Sequence[int] = ()
    prompt_tokens: int = 0  # the prompt's length in tokens (estimated in text mode); 0 when not tokenized
    stream: bool = False  # the answer is streamed: the strategy hears of its first token (`on_first_token`)
    max_tokens: int | None = None  # the most tokens it may generate, as the client asked (None: not said)


Url = Annotated[str, msgspec.Meta(max_length=1024)]
Finite = Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]  # no NaN, nothing negative or past all reason
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]


class Placement(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """What a choice adds to a strategy's picture of the requests in flight, as opposed to what it learns from them:
    the worker (and data-parallel rank) a request went to and what it brings there. A strategy applies its own
    choices' placements and, with `--processes N`, its sibling processes' (router/sibling_routes.py) through the
    same code (`Strategy.sibling_routed`), so every process sees the whole gateway's traffic in flight; a process
    learns rates, load links and output lengths from its own answers only."""

    worker: Url
    rank: Count | None
    keys: list[int]  # the prompt's block keys
    prompt: Count  # tokens
    cached: Count  # tokens predicted cached on the worker
    candidates: Count  # workers it was chosen among
    stream: bool
    max_tokens: Count | None
    # `ttft`'s estimate on the worker: the prefill it needs there (`Work`: tokens, attention), its predicted prefill
    # and time to first token and, of it, its tier loads; whether it is sent in its turn (`serialize_prefill`); the
    # KV block size of the engine's ledger (0: the engine's cache size is not known, no ledger)
    prefill_tokens: Finite = 0.0
    prefill_attention: Finite = 0.0
    prefill_s: Finite = 0.0
    ttft_s: Finite = 0.0
    load_s: Finite = 0.0
    serialize: bool = False
    ledger_block_size: Count = 0


@dataclass(slots=True)
class Decision:
    """The chosen worker, a short reason (a metric label) and the prefix tokens expected to be cached there; for a
    data-parallel engine, the rank to serve it (sent as vLLM's `X-data-parallel-rank`), if the strategy chose one;
    the time to first token the strategy predicted there, if it predicts one; whether it is a long prefill to send
    only once the worker's long prefill before it has its first token (router/prefill_turns.py)."""

    worker: Worker
    reason: str
    predicted_cached_tokens: int = 0
    dp_rank: int | None = None
    predicted_ttft_s: float | None = None
    serialize_prefill: bool = False
    placement: Placement | None = None  # what the strategy put in flight (its siblings are told), if it keeps any


@dataclass(frozen=True)
class NoOptions:
    """The settings of a strategy that has none."""


class Strategy(abc.ABC):
    """Chooses a worker for each request. One instance per gateway; `choose` runs on the event loop.

    A strategy's settings are its `Options`: a frozen dataclass of `kvcore.config.option()` fields, read by
    `kvgate serve` from the same file, `KVGATE_*` environment and flags as the gateway's own, and handed to the
    constructor. Its metrics it registers itself, on the gateway's registry."""

    name: ClassVar[str]
    Options: ClassVar[type[Any]] = NoOptions
    # whether `choose` reads token_ids / block_keys; the gateway tokenizes only for strategies that do
    needs_prompt_tokens: ClassVar[bool] = False
    # whether the gateway should subscribe to the workers' KV events and hand the strategy its block index
    uses_kv_events: ClassVar[bool] = False

    def __init__(self, config: GatewayConfig, options: Any) -> None:
        self.config = config
        self.options = options  # an instance of this strategy's `Options`

    @abc.abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        """Pick one of `workers` (never empty, all healthy and serving the model)."""

    def register_metrics(self, registry: CollectorRegistry) -> None:  # noqa: B027 - optional hook
        """Called once by the gateway with its metrics registry, for strategies that export their own."""

    def attach_kv(self, index: KvBlockIndex, trusted: Callable[[str], bool],  # noqa: B027
                  any_sources: Callable[[], bool] | None = None) -> None:
        """Called once by the gateway, for strategies with `uses_kv_events`: the block index fed by KV events
        and `trusted(worker_url)`, true while the index's picture of that worker is complete; `any_sources()`,
        if given, false while no cache has an event source (`trusted` then false for all, not asked per cache)."""

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:  # noqa: B027 - optional hook
        """Called once the request was sent to the chosen worker."""

    def on_first_token(self, request: RouteRequest, decision: Decision, ttft_s: float) -> None:  # noqa: B027
        """Called when a streamed answer's first chunk came from the chosen worker, `ttft_s` seconds after the
        request arrived (a whole answer's first byte comes only once it is generated: no call for those)."""

    def on_chunk(self, request: RouteRequest, decision: Decision, first: bool,  # noqa: B027
                 tokens: int = 1) -> None:
        """Called as each chunk of a streamed answer arrives from the chosen worker, the `first` one included
        (after `on_first_token`). An engine step ends with a token for every request running there, so the
        arrival times of the chunks relayed from one worker show its steps. `tokens`: the events the chunk
        completed (0 for one that only ended the stream or cut an event; several where they were read together)."""

    def on_finished(self, request: RouteRequest, decision: Decision) -> None:  # noqa: B027 - optional hook
        """Called once the attempt on the chosen worker ended (answered, failed or cancelled)."""

    def forget_worker(self, url: str) -> None:  # noqa: B027 - optional hook
        """Called when a worker leaves the pool; drop any state kept about it."""

    # a sibling process's requests (`--processes N`: router/sibling_routes.py), as each of them was placed
    # (`Decision.placement`): `key` stands for the request, negative (never a request's `id` in this process)

    def sibling_routed(self, key: int, placement: Placement) -> None:  # noqa: B027 - optional hook
        """A sibling routed a request: the bookkeeping of this strategy's own choice of it (the same code)."""

    def sibling_first_token(self, key: int, placement: Placement) -> None:  # noqa: B027 - optional hook
        """A sibling's request had its first token (streamed answers only)."""

    def sibling_ended(self, key: int, placement: Placement) -> None:  # noqa: B027 - optional hook
        """A sibling's request ended (or the sibling is gone, or its end never came)."""
