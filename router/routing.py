"""The routing contract the gateway defines: what a strategy sees of a request (`RouteRequest`), what it answers
(`Decision`) and the interface it implements (`Strategy`). The strategies in strategies/ implement it; the gateway
is handed one by `kvgate serve` and never imports them."""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from router.config import GatewayConfig
from router.kv_index import KvBlockIndex
from router.metrics import GatewayMetrics
from router.pool import Worker


@dataclass(slots=True)
class RouteRequest:
    """What a strategy may look at. `token_ids` and `block_keys` are filled when the gateway tokenizes."""

    model: str
    path: str
    body: dict[str, Any]
    headers: Mapping[str, str]
    token_ids: list[int] | None = None
    block_keys: list[int] = field(default_factory=list)
    prompt_tokens: int = 0  # the prompt's length in tokens (estimated in text mode); 0 when not tokenized


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen worker, a short reason (a metric label) and the prefix tokens expected to be cached there."""

    worker: Worker
    reason: str
    predicted_cached_tokens: int = 0


class Strategy(abc.ABC):
    """Chooses a worker for each request. One instance per gateway; `choose` runs on the event loop."""

    name: ClassVar[str]
    # whether `choose` reads token_ids / block_keys; the gateway tokenizes only for strategies that do
    needs_prompt_tokens: ClassVar[bool] = False
    # whether the gateway should subscribe to the workers' KV events and hand the strategy its block index
    uses_kv_events: ClassVar[bool] = False

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config

    @abc.abstractmethod
    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        """Pick one of `workers` (never empty, all healthy and serving the model)."""

    def attach_metrics(self, metrics: GatewayMetrics) -> None:  # noqa: B027 - optional hook
        """Called once by the gateway with its metrics, for strategies that export their own."""

    def attach_kv(self, index: KvBlockIndex, trusted: Callable[[str], bool]) -> None:  # noqa: B027
        """Called once by the gateway, for strategies with `uses_kv_events`: the block index fed by KV events
        and `trusted(worker_url)`, true while the index's picture of that worker is complete."""

    def on_routed(self, request: RouteRequest, decision: Decision) -> None:  # noqa: B027 - optional hook
        """Called once the request was sent to the chosen worker."""

    def on_finished(self, request: RouteRequest, decision: Decision) -> None:  # noqa: B027 - optional hook
        """Called once the attempt on the chosen worker ended (answered, failed or cancelled)."""

    def forget_worker(self, url: str) -> None:  # noqa: B027 - optional hook
        """Called when a worker leaves the pool; drop any state kept about it."""
