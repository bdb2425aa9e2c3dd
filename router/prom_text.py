"""Reading Prometheus text expositions such as vLLM's `/metrics`: sums of samples by metric name."""

from __future__ import annotations

from collections.abc import Iterable


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """For each of `names`, the sum of its samples over every label set (0.0 when absent). A sample line is
    `name{labels} value [timestamp]` or `name value [timestamp]`; comment lines and other names are skipped."""
    totals = dict.fromkeys(names, 0.0)
    prefixes = tuple(totals)
    for line in text.splitlines():
        if not line.startswith(prefixes):
            continue
        brace = line.find("{")
        space = line.find(" ")
        end = brace if brace != -1 and (space == -1 or brace < space) else space
        name = line[:end] if end != -1 else line
        if name not in totals:
            continue  # a longer name that merely starts like one of ours
        rest = line[line.rfind("}") + 1:] if brace == end else line[end:]
        try:
            totals[name] += float(rest.split()[0])
        except (IndexError, ValueError):
            continue
    return totals
