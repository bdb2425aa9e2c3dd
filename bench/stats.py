"""Summary statistics the load generator and the virtual-time simulator share (kept apart from the load generator,
so that a simulation's processes do not import an HTTP client)."""

from __future__ import annotations

from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q` quantile (0..1) of `values`, linearly interpolated between ranks; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)
