"""Run a compose stack's services as local processes, without Docker: same commands, same arguments.

`docker compose config --format json` resolves the compose file (anchors, merges, interpolation) exactly as
Compose would. Each service's `expose` ports get a free loopback port; `SERVICE:PORT` references in commands,
environment values and bind-mounted config files are rewritten to `127.0.0.1:MAPPED`, the service's own ports
(`--port 8000`, `tcp://*:5557`, `0.0.0.0:9090`) likewise, `0.0.0.0` becomes `127.0.0.1`, and volume mount points
become directories under the test's temporary directory. The image decides the program: the kvgate image runs
`kvgate` (its ENTRYPOINT), Valkey the valkey-server the dev extras ship, Prometheus Debian's binary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import free_port, wait_for_port, wait_http
from bench.procs import stop as stop_process

ROOT = Path(__file__).resolve().parent.parent


def compose_command() -> list[str]:
    """`docker compose` (the Docker CLI with the Compose plugin scripts/system-deps.sh links), else the same
    Compose CLI standalone (`docker-compose` from the dev extras) where no Docker CLI is installed."""
    if shutil.which("docker"):
        return ["docker", "compose"]
    standalone = shutil.which("docker-compose") or str(Path(sys.executable).parent / "docker-compose")
    if not Path(standalone).exists():
        raise RuntimeError("neither docker nor docker-compose found: install the dev extras")
    return [standalone]


# what an operator must set before `docker compose up` of the GPU stack (it has no default password)
DEPLOY_ENV = {"VALKEY_PASSWORD": "valkey-test-password", "KVGATE_FLEET_SECRET": "fleet-test-secret"}


def compose_config(path: Path, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The compose file as Compose resolves it (with `DEPLOY_ENV` set, or `env`)."""
    out = subprocess.run([*compose_command(), "-f", str(path), "config", "--format", "json"],
                         capture_output=True, text=True, timeout=60, check=False,
                         env={**os.environ, **(DEPLOY_ENV if env is None else env)})
    if out.returncode != 0:
        raise RuntimeError(f"docker compose config failed for {path}: {out.stderr.strip()}")
    config: dict[str, Any] = json.loads(out.stdout)
    return config


@dataclass
class LocalService:
    name: str
    spec: dict[str, Any]
    ports: dict[int, int]                  # container port -> loopback port
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def port(self, container_port: int) -> int:
        return self.ports[container_port]

    def url(self, container_port: int) -> str:
        return f"http://127.0.0.1:{self.ports[container_port]}"


class LocalStack:
    """The services of one resolved compose file, mapped onto this machine."""

    def __init__(self, config: dict[str, Any], workdir: Path, programs: Mapping[str, Callable[[list[str]], list[str]]]):
        self.config = config
        self.workdir = workdir
        self.programs = programs
        self.services: dict[str, LocalService] = {}
        for name, spec in config["services"].items():
            ports = {int(p): free_port() for p in spec.get("expose", [])}
            self.services[name] = LocalService(name, spec, ports)

    # --- rewriting ----------------------------------------------------------------------------------------------

    def rewrite(self, service: LocalService, text: str) -> str:
        for other in self.services.values():
            for container_port, local in other.ports.items():
                text = re.sub(rf"\b{re.escape(other.name)}:{container_port}\b", f"127.0.0.1:{local}", text)
        for container_port, local in service.ports.items():
            if text == str(container_port):
                return str(local)
            text = re.sub(rf"(?<=[:=]){container_port}\b", str(local), text)
        text = text.replace("0.0.0.0", "127.0.0.1")
        for target, host in self.mounts(service).items():
            if text == target or text.startswith(target + "/"):
                text = str(host) + text[len(target):]
            text = re.sub(rf"(?<==){re.escape(target)}(?=/|$)", str(host), text)
        return text

    def mounts(self, service: LocalService) -> dict[str, Path]:
        """Mount point in the container -> directory (or rewritten file) here."""
        out: dict[str, Path] = {}
        for volume in service.spec.get("volumes", []):
            target = volume["target"]
            if volume["type"] == "volume":
                path = self.workdir / "volumes" / volume["source"]
                path.mkdir(parents=True, exist_ok=True)
                out[target] = path
            elif volume["type"] == "bind":
                source = Path(volume["source"])
                if source.is_file():
                    copy = self.workdir / "binds" / service.name / source.name
                    copy.parent.mkdir(parents=True, exist_ok=True)
                    if not copy.exists():
                        copy.write_text(self.rewrite_file(service, source.read_text()))
                    out[target] = copy
                else:
                    out[target] = source
        return out

    def rewrite_file(self, service: LocalService, text: str) -> str:
        for other in self.services.values():
            for container_port, local in other.ports.items():
                text = re.sub(rf"\b{re.escape(other.name)}:{container_port}\b", f"127.0.0.1:{local}", text)
        for container_port, local in service.ports.items():
            text = re.sub(rf"\blocalhost:{container_port}\b", f"127.0.0.1:{local}", text)
        return text

    # --- running ------------------------------------------------------------------------------------------------

    def order(self) -> list[str]:
        """Services in dependency order (depends_on)."""
        done: list[str] = []

        def visit(name: str, seen: tuple[str, ...] = ()) -> None:
            if name in done:
                return
            if name in seen:
                raise ValueError(f"dependency cycle through {name}")
            for dep in self.services[name].spec.get("depends_on", {}):
                visit(dep, (*seen, name))
            done.append(name)

        for name in self.services:
            visit(name)
        return done

    def program(self, service: LocalService) -> list[str] | None:
        image = service.spec.get("image", "")
        for prefix, make in self.programs.items():
            if image.startswith(prefix):
                return make([self.rewrite(service, arg) for arg in service.spec.get("command") or []])
        return None

    def start(self, name: str, timeout: float = 60.0) -> LocalService:
        service = self.services[name]
        argv = self.program(service)
        if argv is None:
            raise ValueError(f"no local program for {name} ({service.spec.get('image')})")
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        for key, value in (service.spec.get("environment") or {}).items():
            env[key] = self.rewrite(service, str(value))
        service.argv, service.env = argv, env
        service.log = self.workdir / "logs" / f"{name}.log"
        service.log.parent.mkdir(parents=True, exist_ok=True)
        with service.log.open("wb") as log:
            service.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            cwd=self.workdir)
        return service

    def wait_ready(self, name: str, timeout: float = 60.0) -> None:
        """Until the service listens on its exposed ports and its health check URL (if any) answers 200."""
        service = self.services[name]
        assert service.proc is not None
        try:
            for local in service.ports.values():
                wait_for_port(local, timeout, service.proc)
            url = service.env.get("KVGATE_HEALTHCHECK_URL")
            if url:
                wait_http(url, timeout, service.proc)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"{name} did not come up: {exc}\n{self.tail(name)}") from exc

    def run_to_completion(self, name: str, timeout: float = 60.0) -> None:
        service = self.services[name]
        assert service.proc is not None
        code = service.proc.wait(timeout)
        if code != 0:
            raise RuntimeError(f"{name} exited with {code}\n{self.tail(name)}")

    def tail(self, name: str, chars: int = 3000) -> str:
        log = self.services[name].log
        return log.read_text(errors="replace")[-chars:] if log and log.exists() else ""

    def stop(self) -> None:
        for service in reversed(list(self.services.values())):
            if service.proc is not None:
                stop_process(service.proc)


def kvgate_program(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", *args]


def valkey_program(args: list[str]) -> list[str]:
    from bench.procs import valkey_server_binary

    assert args and args[0] in ("valkey-server", "redis-server"), args
    return [valkey_server_binary(), *args[1:]]


def prometheus_program(args: list[str]) -> list[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError("prometheus not found: run scripts/system-deps.sh (apt-get install prometheus)")
    return [binary, *args]


PROGRAMS: dict[str, Callable[[list[str]], list[str]]] = {
    "kvgate:": kvgate_program,
    "valkey/valkey:": valkey_program,
    "prom/prometheus:": prometheus_program,
}


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 30.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def fetch_text(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        text: str = resp.read().decode()
        return text


def exported_names(metrics_text: str) -> set[str]:
    """Every series name a /metrics page can produce, including labelled families with no sample yet."""
    names: set[str] = set()
    suffixes = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
                "summary": ("_sum", "_count", "_created"), "gauge": ("",), "untyped": ("",), "info": ("_info",)}
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            base = name.removesuffix("_total") if kind == "counter" else name
            names.update(base + s for s in suffixes.get(kind, ("",)))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def run_agent_as(uid: int, socket_path: str, metrics_port: int) -> None:
    """A `kvgate agent` as `uid`, the image's user (multiprocessing target, started as root). The interpreter
    of this machine lives where that uid cannot read, so everything is imported before the switch."""
    import encodings.idna  # noqa: F401  (looked up lazily when the metrics port binds)

    from agent.config import AgentConfig
    from agent.server import TierAgent
    from kvcore.aio import run_until_signalled

    config = AgentConfig(socket_path=socket_path, metrics_port=metrics_port, dram_capacity=2**24).validate()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    run_until_signalled(TierAgent(config).serve_forever())
