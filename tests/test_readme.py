"""The README stays true: every option, metric and command it should name is there."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from router.config import GatewayConfig
from router.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_every_gateway_option_is_documented() -> None:
    for f in dataclasses.fields(GatewayConfig):
        assert f"`--{f.name.replace('_', '-')}`" in README, f.name
        assert f"KVGATE_{f.name.upper()}" in README, f.name


def test_every_gateway_metric_is_documented() -> None:
    names = {m.name for m in GatewayMetrics().registry.collect()}
    for name in names:
        assert re.search(rf"`{name}(_total)?`", README), name


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test" in README and "./scripts/test" in ci
    assert "./scripts/demo" in README
