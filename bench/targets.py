"""Routers a comparison runs against the same fleet: kvgate with one strategy, or a peer router from PyPI
(`sglang-router`, `vllm-router`) installed into its own virtual environment under `.cache/peers/`.

A target is named `KIND:POLICY[:VARIANT]`:
- `kvgate:round_robin`, `kvgate:least_load`, `kvgate:prefix`, `kvgate:kv` — `kvgate serve` with that strategy.
- `sglang:cache_aware`, `sglang:round_robin` — `python -m sglang_router.launch_router --policy ...`.
- `vllm-router:cache_aware`, `vllm-router:kv_aware` — `vllm-router --policy ...`; kv_aware gets every replica's
  KV-event and replay endpoints (`--kv-event-source URL=tcp://...`) and the engines' block size.
- VARIANT `pN` (kvgate only): `kvgate serve --processes N`.
- VARIANT `tuned` (cache_aware only): balance thresholds suited to the fleet (`--balance-abs-threshold`,
  `--balance-rel-threshold` from the runner) instead of the defaults (64 requests and 1.5x, which a small
  fleet never reaches, so the default never rebalances).
Every target is a child process on a free loopback port, stopped by its PID; its command line is the report's
record of how it was configured.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.procs import free_port, stop
from bench.sim.launch import ROOT, SimFleet
from strategies import STRATEGIES

PEERS_DIR = ROOT / ".cache" / "peers"
PEER_PACKAGES = {"sglang": "sglang-router", "vllm-router": "vllm-router"}
KVGATE_STRATEGIES = tuple(STRATEGIES)  # the registry's
DEFAULT_TARGETS = (
    "kvgate:round_robin", "kvgate:least_load", "kvgate:prefix", "kvgate:kv", "kvgate:ttft",
    "sglang:round_robin", "sglang:cache_aware", "sglang:cache_aware:tuned",
    "vllm-router:cache_aware", "vllm-router:cache_aware:tuned", "vllm-router:kv_aware",
)


class TargetError(RuntimeError):
    """A target could not be installed or started; the message says why (shown in the report)."""


@dataclass
class TargetSettings:
    """What the runner tells every target about the fleet, so each is configured alike."""

    block_size: int
    model: str
    model_dir: Path
    balance_abs_threshold: int
    balance_rel_threshold: float
    log_dir: Path


@dataclass
class Target:
    name: str
    kind: str
    policy: str
    variant: str = ""
    argv: list[str] = field(default_factory=list)
    config: dict[str, object] = field(default_factory=dict)
    version: str = ""
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 1500) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-n:]

    def start(self, fleet: SimFleet, settings: TargetSettings) -> None:
        self.port = free_port()
        self.argv = self._command(fleet, settings)
        settings.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = settings.log_dir / f"{self.name.replace(':', '_')}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
            self.proc = None

    def _command(self, fleet: SimFleet, s: TargetSettings) -> list[str]:
        if self.kind == "kvgate":
            self.version = "this checkout"
            self.config = {"strategy": self.policy, "block_size": s.block_size, "model_dir": str(s.model_dir),
                           "other options": "defaults (kvgate serve --help)"}
            workers = [a for spec in fleet.worker_specs for a in ("--worker", spec)]
            processes = ["--processes", self.variant[1:]] if self.variant.startswith("p") else []
            if processes:
                self.config["processes"] = int(self.variant[1:])
            return [sys.executable, "-m", "kvgate.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                    "--strategy", self.policy, "--model-dir", str(s.model_dir), "--block-size", str(s.block_size),
                    "--predicted-ttft-header", "--log-level", "warning", *processes, *workers]
        venv = ensure_peer(self.kind)
        self.version = peer_version(self.kind)
        tuned = self.variant == "tuned"
        common = ["--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *fleet.urls,
                  "--policy", self.policy]
        self.config = {"policy": self.policy}
        if self.policy == "cache_aware":
            if tuned:
                common += ["--balance-abs-threshold", str(s.balance_abs_threshold),
                           "--balance-rel-threshold", str(s.balance_rel_threshold)]
            self.config.update({
                "balance_abs_threshold": s.balance_abs_threshold if tuned else "64 (default)",
                "balance_rel_threshold": s.balance_rel_threshold if tuned else "1.5 (default)",
                "cache_threshold": "0.3 (default)"})
        if self.kind == "sglang":
            return [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router", *common,
                    "--log-level", "warn"]
        argv = [str(venv / "bin" / "vllm-router"), *common, "--log-level", "warning"]
        if self.policy == "kv_aware":
            for replica in fleet.replicas:
                argv += ["--kv-event-source", f"{replica.url}={replica.events}",
                         "--kv-event-replay-source", f"{replica.url}={replica.replay}"]
            argv += ["--kv-event-block-size", str(s.block_size), "--kv-event-model", s.model]
            self.config.update({"kv_event_sources": "every replica's PUB + replay endpoint",
                                "kv_event_block_size": s.block_size, "kv_event_model": s.model,
                                "router_temperature": "0 (default)", "kv penalties": "defaults"})
        return argv


def parse_target(name: str) -> Target:
    parts = name.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"target {name!r}: expected KIND:POLICY[:VARIANT]")
    kind, policy = parts[0], parts[1]
    variant = parts[2] if len(parts) == 3 else ""
    if kind == "kvgate":
        if policy not in KVGATE_STRATEGIES:
            raise ValueError(f"target {name!r}: kvgate strategies are {', '.join(KVGATE_STRATEGIES)}")
    elif kind == "sglang":
        if policy not in ("cache_aware", "round_robin", "power_of_two", "random"):
            raise ValueError(f"target {name!r}: unknown sglang-router policy")
    elif kind == "vllm-router":
        if policy not in ("cache_aware", "kv_aware", "round_robin", "power_of_two", "random"):
            raise ValueError(f"target {name!r}: unknown vllm-router policy")
    else:
        raise ValueError(f"target {name!r}: kind must be kvgate, sglang or vllm-router")
    processes = kind == "kvgate" and variant[:1] == "p" and variant[1:].isdigit() and int(variant[1:]) >= 1
    if not processes and (variant not in ("", "tuned") or (variant == "tuned" and policy != "cache_aware")):
        raise ValueError(f"target {name!r}: the variants are 'tuned', for cache_aware, and 'pN' (N processes), "
                         "for kvgate")
    return Target(name, kind, policy, variant)


def ensure_peer(kind: str, timeout: float = 600.0) -> Path:
    """The peer's venv under .cache/peers/, created and `pip install`ed from PyPI on first use."""
    package = PEER_PACKAGES[kind]
    venv = PEERS_DIR / f"{package}-venv"
    marker = venv / ".installed"
    if marker.exists():
        return venv
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    log = PEERS_DIR / f"{package}-install.log"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True, timeout=120)
        with open(log, "wb") as out:
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", package], check=True, stdout=out,
                           stderr=subprocess.STDOUT, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        tail = log.read_text(errors="replace")[-800:] if log.exists() else ""
        raise TargetError(f"installing {package} into {venv} failed: {exc}\n{tail}") from exc
    marker.write_text(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return venv


def peer_version(kind: str) -> str:
    package = PEER_PACKAGES[kind]
    venv = PEERS_DIR / f"{package}-venv"
    try:
        out = subprocess.run([str(venv / "bin" / "pip"), "show", package], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Version:"):
            return f"{package} {line.split(':', 1)[1].strip()}"
    return "unknown"
