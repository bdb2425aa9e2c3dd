"""`least_load`: the worker with the fewest outstanding requests (gateway in-flight + engine queue), ties at random."""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.pool import Worker
from router.routing import Decision, RouteRequest, Strategy


class LeastLoad(Strategy):
    name = "least_load"

    def choose(self, request: RouteRequest, workers: Sequence[Worker]) -> Decision:
        lowest = min(w.outstanding for w in workers)
        tied = [w for w in workers if w.outstanding == lowest]
        return Decision(random.choice(tied), "least_load")
