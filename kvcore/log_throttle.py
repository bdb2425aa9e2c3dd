"""A warning that a peer can cause over and over (a lost event, a failed discovery round, a malformed request),
logged at most once every so often, saying how many were held back since."""

from __future__ import annotations

import math
import time

EVERY_S = 10.0


class LogThrottle:
    """`due()`: whether to log now, at most once every `every_s` seconds; the ones in between are counted."""

    def __init__(self, every_s: float = EVERY_S) -> None:
        self.every_s = every_s
        self._logged_at = -math.inf
        self._held_back = 0

    def due(self) -> int | None:
        """How many were held back since the last one logged, if this one is to be logged; None (and it is
        counted) if one was logged within `every_s`."""
        now = time.monotonic()
        if now - self._logged_at < self.every_s:
            self._held_back += 1
            return None
        held_back, self._logged_at, self._held_back = self._held_back, now, 0
        return held_back


def held_back_note(held_back: int) -> str:
    """What to add to the line `due()` let through: how many like it were held back before it, if any."""
    return f" ({held_back} more since the last)" if held_back else ""
