"""`prefix`: send each request where its prefix was sent before, unless the queue there costs more than the
prefix saves — the prefill balance (strategies/balance.py) with the trie of recent routing decisions as its
prediction (approximate mode: no engine events needed)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from router.config import GatewayConfig
from router.pool import Worker
from router.routing import Decision, Placement, RouteRequest, Strategy
from strategies.balance import PrefillBalance, PrefixOptions


class PrefixAffinity(Strategy):
    name = "prefix"
    Options = PrefixOptions
    needs_prompt_tokens = True

    def __init__(self, config: GatewayConfig, options: PrefixOptions) -> None:
        super().__init__(config, options)
        self.balance = PrefillBalance(options, config.block_size, self.name)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self.balance.register_metrics(registry)

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        decision = self.balance.choose(request, workers, self.balance.trie_prediction)
        assert decision.placement is not None
        self.balance.place(decision.placement)
        return decision

    def sibling_routed(self, key: int, placement: Placement) -> None:
        self.balance.place(placement)

    def forget_worker(self, url: str) -> None:
        self.balance.forget_worker(url)
