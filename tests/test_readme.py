"""The README stays true: every option, metric and command it should name is there."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from router.config import GatewayConfig
from router.metrics import GatewayMetrics
from router.trace_recorder import TraceMetrics
from strategies import STRATEGIES, create_strategy, option_classes

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_gateway_option_is_documented() -> None:
    """The gateway's own options and every strategy's."""
    classes: list[type[Any]] = [GatewayConfig, *option_classes()]
    for options in classes:
        for f in dataclasses.fields(options):
            assert f"`--{f.name.replace('_', '-')}`" in README, f.name
            assert f"KVGATE_{f.name.upper()}" in README, f.name


def test_every_gateway_metric_is_documented() -> None:
    """The gateway's own metrics and those every strategy registers."""
    names = {m.name for m in GatewayMetrics().registry.collect()}
    names |= {m.name for m in TraceMetrics(CollectorRegistry()).registry.collect()}  # with record_trace
    for strategy in STRATEGIES:  # one gateway, one strategy: each on its own registry
        registry = CollectorRegistry()
        create_strategy(GatewayConfig(strategy=strategy)).register_metrics(registry)
        names |= {m.name for m in registry.collect()}
    assert "kvgate_prefix_match_ratio" in names
    for name in names:
        assert re.search(rf"`{name}(_total)?`", README), name


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in README and "./scripts/test" in ci
    assert "./scripts/demo" in README
