"""Reading Prometheus text expositions such as vLLM's `/metrics`: sums of samples by metric name."""

from __future__ import annotations

import re
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


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample of the info gauge `name` (vLLM exports its configurations so, e.g.
    `vllm:cache_config_info{block_size="16",num_gpu_blocks="27000",...} 1.0`); None when absent. Label values are
    returned as written, escapes and all: the ones read are numbers."""
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] == "{":
            end = line.rfind("}")
            return dict(_LABEL.findall(line[len(name) + 1:end]))
    return None
