"""Configuration: defaults < YAML file < KVGATE_* environment < flags, one typed object."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvcore.config import ConfigError, add_config_arguments, load_config
from kvgate.serve import add_arguments, load
from router.config import GatewayConfig, WorkerSpec
from strategies import option_classes
from strategies.kv import KvAware


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, GatewayConfig, "KVGATE_")
    return parser.parse_args(argv)


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "kvgate.yaml"
    cfg_file.write_text(
        "port: 9000\nstrategy: least_load\nmax_attempts: 5\n"
        "workers:\n  - http://10.0.0.1:8000\n  - url: http://10.0.0.2:8000\n    events: tcp://10.0.0.2:5557\n"
    )
    env = {"KVGATE_PORT": "9100", "KVGATE_MAX_ATTEMPTS": "4"}
    config = load_config(GatewayConfig, "KVGATE_", parse(["--config", str(cfg_file), "--port", "9200"]), env)
    assert config.port == 9200  # flag beats env and file
    assert config.max_attempts == 4  # env beats file
    assert config.strategy == "least_load"  # file beats default
    assert config.health_interval_s == 2.0  # default
    assert config.worker == [
        WorkerSpec("http://10.0.0.1:8000"),
        WorkerSpec("http://10.0.0.2:8000", events="tcp://10.0.0.2:5557"),
    ]


def test_worker_specs_from_flags_and_env() -> None:
    args = parse(["--worker", "http://a:1/", "--worker", "http://b:2;events=tcp://b:5557;replay=tcp://b:5558"])
    config = load_config(GatewayConfig, "KVGATE_", args, {})
    assert config.worker == [WorkerSpec("http://a:1"), WorkerSpec("http://b:2", "tcp://b:5557", "tcp://b:5558")]
    config = load_config(GatewayConfig, "KVGATE_", parse([]), {"KVGATE_WORKER": "http://a:1,http://b:2"})
    assert [w.url for w in config.worker] == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["--port", "eighty"], {}, "--port"),
        ([], {"KVGATE_MAX_ATTEMPTS": "many"}, "KVGATE_MAX_ATTEMPTS"),
        (["--worker", "10.0.0.1:8000"], {}, "http://"),
        (["--worker", "http://a:1;colour=red"], {}, "colour"),
        (["--tokenizer-processes-nice", "20"], {}, "tokenizer_processes_nice must be 0 to 19: 20"),
        ([], {"KVGATE_TOKENIZER_PROCESSES_NICE": "-1"}, "tokenizer_processes_nice must be 0 to 19: -1"),
    ],
)
def test_bad_values_are_clear_errors(argv: list[str], env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(GatewayConfig, "KVGATE_", parse(argv), env)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    cfg_file = tmp_path / "bad.yaml"
    cfg_file.write_text("prot: 80\n")
    with pytest.raises(ConfigError, match="prot"):
        load_config(GatewayConfig, "KVGATE_", parse(["--config", str(cfg_file)]), {})


def test_serve_help_documents_every_option() -> None:
    out = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    classes: list[type[Any]] = [GatewayConfig, *option_classes()]
    names = [f.name for options in classes for f in dataclasses.fields(options)]
    assert "prefix_prefill_weight" in names and "kv_cost_cpu" in names
    for name in names:
        assert "--" + name.replace("_", "-") in out, name
        assert "KVGATE_" + name.upper() in out.replace("\n", "").replace(" ", ""), name


def test_serve_rejects_unknown_strategy() -> None:
    result = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--strategy", "psychic"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "psychic" in result.stderr


def test_strategy_options_come_from_the_same_file_env_and_flags(tmp_path: Path) -> None:
    cfg_file = tmp_path / "kv.yaml"
    cfg_file.write_text("strategy: kv\nworkers: [http://a:1]\nkv_cost_cpu: 0.3\nprefix-prefill-weight: 3\n"
                        "prefix_trie_ttl_s: 7\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--config", str(cfg_file), "--prefix-trie-ttl-s", "5", "--block-size", "32"])
    config, strategy = load(args, {"KVGATE_KV_AFFINITY": "0.2", "KVGATE_KV_COST_CPU": "0.35"})
    assert isinstance(strategy, KvAware) and config.block_size == 32 and config.worker == [WorkerSpec("http://a:1")]
    options = strategy.options
    assert (options.kv_cost_cpu, options.prefix_prefill_weight, options.kv_affinity, options.prefix_trie_ttl_s) == (
        0.35, 3.0, 0.2, 5.0)  # flags > environment > file > defaults
    assert strategy.balance.trie.ttl_s == 5.0 and strategy.balance.block_size == 32
    # another strategy's option is checked too, and an unknown one is refused
    for bad, match in (("kv_cost_cpu: cheap\n", "kv_cost_cpu"), ("kv_cost_gpu: 0\n", "kv_cost_gpu")):
        cfg_file.write_text("strategy: prefix\n" + bad)
        with pytest.raises(ConfigError, match=match):
            load(parser.parse_args(["--config", str(cfg_file)]), {})


@pytest.mark.parametrize("field, value", [
    ("socket_mode", "999"), ("socket_mode", "rw"), ("metrics_port", 70000),
    ("events_interval_s", 0.0), ("events_interval_s", float("nan")), ("shared_timeout_s", 0.0),
    ("shared_index_refresh_s", 0.0), ("shared_sweep_interval_s", -1.0), ("shared_retry_s", float("nan")),
    ("shared_ttl_s", float("inf")), ("shared_index_blocks", 0),
])
def test_agent_settings_that_cannot_work_are_config_errors(field: str, value: Any) -> None:
    """A socket mode that is not octal raised a ValueError traceback at start; an events interval of 0 ran the
    flush in a loop that never waited (a core at 100%); a shared timeout of 0 made redis-py's sockets non-blocking
    (the shared tier never connected); a NaN retry kept the shared tier down for good after its first error."""
    from agent.config import AgentConfig

    with pytest.raises(ConfigError, match=field):
        AgentConfig(**{field: value}).validate()


def test_an_agent_that_cannot_make_its_tiers_exits_with_one_line(tmp_path: Path) -> None:
    """An NVMe or shared directory that cannot be made, a shared URL that is not one: a traceback at start; now
    one error line and exit status 2, as for any other configuration error."""
    (tmp_path / "file").write_bytes(b"")
    for flags, message in ((["--nvme-dir", str(tmp_path / "file" / "nvme")], "Not a directory"),
                           (["--shared-backend", "redis", "--shared-url", "redis://[bad"], "Invalid IPv6 URL")):
        out = subprocess.run([sys.executable, "-m", "kvgate.cli", "agent", "--socket-path", str(tmp_path / "s"),
                              "--metrics-port", "0", *flags], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert "cannot start the tier agent" in out.stderr and message in out.stderr
