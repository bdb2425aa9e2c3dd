"""`round_robin`: each eligible worker in turn, ignoring prefixes and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from router.pool import Worker
from router.routing import Decision, RouteRequest, Strategy


class RoundRobin(Strategy):
    name = "round_robin"
    _turn = 0

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        worker = workers[self._turn % len(workers)]
        self._turn += 1
        return Decision(worker, "rotation")
