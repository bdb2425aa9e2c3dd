"""Reading Prometheus text expositions such as vLLM's `/metrics`: sums of samples by metric name."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """For each of `names`, the sum of its samples over every label set (0.0 when absent). A sample line is
    `name{labels} value [timestamp]` or `name value [timestamp]`; comment lines and other names are skipped. The
    lines are found by searching the page for each name (at C speed), not by a Python loop over every line: a
    worker's page is scraped every second, and a large one held the event loop for tens of ms each time."""
    totals = dict.fromkeys(names, 0.0)
    for name in totals:
        for line in lines_starting(text, name):
            brace = line.find("{")
            space = line.find(" ")
            end = brace if brace != -1 and (space == -1 or brace < space) else space
            if (line[:end] if end != -1 else line) != name:
                continue  # a longer name that merely starts like this one
            rest = line[line.rfind("}") + 1:] if brace == end else line[end:]
            try:
                totals[name] += float(rest.split()[0])
            except (IndexError, ValueError):
                continue
    return totals


def lines_starting(text: str, prefix: str) -> Iterator[str]:
    """The lines of `text` (a Prometheus page: lines end with \n) that start with `prefix`, in order."""
    at = 0 if text.startswith(prefix) else _after_newline(text.find("\n" + prefix))
    while at != -1:
        end = text.find("\n", at)
        if end == -1:
            yield text[at:]
            return
        yield text[at:end]
        at = _after_newline(text.find("\n" + prefix, end))


def _after_newline(found: int) -> int:
    return found + 1 if found != -1 else -1


_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def info_labels(text: str, name: str) -> dict[str, str] | None:
    """The labels of the first sample of the info gauge `name` (vLLM exports its configurations so, e.g.
    `vllm:cache_config_info{block_size="16",num_gpu_blocks="27000",...} 1.0`); None when absent. Label values are
    returned as written, escapes and all: the ones read are numbers."""
    for line in lines_starting(text, name + "{"):
        end = line.rfind("}")
        return dict(_LABEL.findall(line[len(name) + 1:end]))
    return None
