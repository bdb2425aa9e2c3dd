"""docker/ as far as this machine allows: both compose files parse (`docker compose config`), promtool accepts the
Prometheus config, the Kubernetes manifests pass an offline schema check, and the demo stack's own commands run
here as processes (no Docker engine): a request goes through the gateway to a simulated replica, the real
Prometheus scrapes every component, and every metric the Grafana dashboard queries is exported."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from tests.deploy_stack import (
    DEPLOY_ENV,
    PROGRAMS,
    LocalStack,
    compose_command,
    compose_config,
    exported_names,
    fetch_text,
    http_json,
)

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
COMPOSE_FILES = [DOCKER / "compose.gpu.yaml", DOCKER / "compose.demo.yaml"]
DASHBOARD = DOCKER / "grafana" / "dashboards" / "kvgate.json"
K8S = DOCKER / "k8s"
K8S_VERSION = "1.31.0"
IMAGE_UID = 10001  # the kvgate image's user (Dockerfile: useradd --uid)


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed: run scripts/system-deps.sh")
    return path


# --- compose --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_parses(path: Path) -> None:
    out = subprocess.run([*compose_command(), "-f", str(path), "config", "--quiet"], capture_output=True,
                         text=True, timeout=60, check=False, env={**os.environ, **DEPLOY_ENV})
    assert out.returncode == 0, out.stderr


def test_the_gpu_stack_has_no_default_password() -> None:
    """Without VALKEY_PASSWORD and KVGATE_FLEET_SECRET the GPU stack refuses to start (no guessable default)."""
    env = {k: v for k, v in os.environ.items() if k not in DEPLOY_ENV}
    out = subprocess.run([*compose_command(), "-f", str(DOCKER / "compose.gpu.yaml"), "config", "--quiet"],
                         capture_output=True, text=True, timeout=60, check=False, env=env)
    assert out.returncode != 0 and "VALKEY_PASSWORD" in out.stderr + out.stdout


def _flag(command: list[str], name: str) -> list[str]:
    """Values of `--name=V` and `--name V` in a command."""
    values = []
    for i, arg in enumerate(command):
        if arg.startswith(name + "="):
            values.append(arg.split("=", 1)[1])
        elif arg == name and i + 1 < len(command):
            values.append(command[i + 1])
    return values


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_stack_shape(path: Path) -> None:
    """Every replica has an agent beside it, KV events on, and a --worker line with its event endpoints."""
    services = compose_config(path)["services"]
    replicas = sorted(n for n in services if n.startswith("replica-"))
    valkey = services["valkey"]
    assert len(replicas) >= 2
    gateway = services["gateway"]["command"]
    assert _flag(gateway, "--strategy") == ["kv"]
    workers = _flag(gateway, "--worker")
    block_sizes = set(_flag(gateway, "--block-size"))
    for name in replicas:
        index = name.split("-", 1)[1]
        replica, agent = services[name], services[f"agent-{index}"]
        assert f"http://{name}:8000;events=tcp://{name}:5557;replay=tcp://{name}:5558" in workers
        run_volume = {v["source"] for v in agent["volumes"] if v["target"] == "/run/kvgate"}
        assert run_volume and run_volume <= {v["source"] for v in replica["volumes"]}, "agent socket not shared"
        # the shared tier: Valkey's password and the fleet secret, from the operator's environment, not argv
        url = agent["environment"]["KVGATE_AGENT_SHARED_URL"]
        password = re.fullmatch(r"redis://:([^@]+)@valkey:6379/0", url)
        assert password and _flag(valkey["command"], "--requirepass") == [password.group(1)]
        assert valkey["environment"]["REDISCLI_AUTH"] == password.group(1)  # the health check authenticates
        assert agent["environment"]["KVGATE_AGENT_SHARED_SECRET"]
        assert not _flag(agent["command"], "--shared-url") and not _flag(agent["command"], "--shared-secret")
        # the replica hands its shared memory over the socket: no IPC namespace or /dev/shm to share
        assert "ipc" not in agent and "ipc" not in replica
        block_sizes |= set(_flag(agent["command"], "--block-size")) | set(_flag(replica["command"], "--block-size"))
        if replica["image"].startswith("kvgate-vllm"):
            command = replica["command"]
            assert "--enable-prefix-caching" in command
            events = json.loads(_flag(command, "--kv-events-config")[0])
            assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://*:5557"
            assert events["replay_endpoint"] == "tcp://*:5558"
            connector = json.loads(_flag(command, "--kv-transfer-config")[0])
            module = ROOT / (connector["kv_connector_module_path"].replace(".", "/") + ".py")
            assert f"class {connector['kv_connector']}(" in module.read_text()
            assert any(d["capabilities"] == ["gpu"] for d in replica["deploy"]["resources"]["reservations"]["devices"])
        else:
            assert replica["command"][0] == "sim"
            assert _flag(replica["command"], "--agent-socket") == ["/run/kvgate/agent.sock"]
            assert replica["depends_on"][f"agent-{index}"]["condition"] == "service_healthy"
    assert len(block_sizes) == 1, f"block sizes differ: {block_sizes}"
    assert _flag(valkey["command"], "--protected-mode") == ["yes"]
    assert {"valkey", "prometheus", "grafana"} <= set(services)


# --- Dockerfile -------------------------------------------------------------------------------------------------


def test_dockerfile_is_multistage_nonroot_pinned() -> None:
    text = (DOCKER / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (\S+)(?: AS (\w+))?", text, re.M)
    assert len(stages) >= 2 and stages[-1][1] == "runtime"
    for arg in re.findall(r"^ARG \w+_IMAGE=(\S+)", text, re.M):
        assert ":" in arg and not arg.endswith(":latest"), arg
    runtime = text[text.index("AS runtime"):]
    users = re.findall(r"^USER (\S+)", runtime, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(rf"useradd [^\n]*--uid {IMAGE_UID} ", runtime)
    assert re.search(r"^HEALTHCHECK ", runtime, re.M)
    assert re.search(r'^ENTRYPOINT \["kvgate"\]', runtime, re.M)


def test_image_requirements_pin_every_dependency() -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    try:
        import tomllib
    except ImportError:  # pragma: no cover - Python 3.10
        pytest.skip("tomllib needs Python 3.11")
    pins: dict[str, str] = {}
    for line in (DOCKER / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"not pinned: {line}"
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for dep in project["dependencies"]:
        req = Requirement(dep)
        if req.marker is not None and not req.marker.evaluate({"sys_platform": "linux"}):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} missing from docker/requirements.txt"
        assert req.specifier.contains(pins[name], prereleases=True), f"{req.name}=={pins[name]} not in {req.specifier}"


# --- Prometheus config ----------------------------------------------------------------------------------------


def test_promtool_accepts_prometheus_config() -> None:
    out = subprocess.run([need("promtool"), "check", "config", str(DOCKER / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout + out.stderr


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_prometheus_scrapes_every_component(path: Path) -> None:
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for group in job["static_configs"] for t in group["targets"]}
    services = compose_config(path)["services"]
    for name, spec in services.items():
        if name == "gateway":
            assert "gateway:8000" in targets
        elif name.startswith("replica-"):
            assert f"{name}:8000" in targets
        elif name.startswith("agent-"):
            port = _flag(spec["command"], "--metrics-port")[0]
            assert f"{name}:{port}" in targets


# --- Grafana ---------------------------------------------------------------------------------------------------


def dashboard_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    return {m for e in exprs for m in re.findall(r"\b(?:kvgate_[a-z0-9_]+|vllm:[a-z0-9_:]+)", e)}


def test_grafana_provisioning_matches_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    sources = yaml.safe_load((DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    uids = {s["uid"] for s in sources["datasources"]}
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] in uids, panel["title"]
    provider = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/kvgate.yaml").read_text())["providers"][0]
    for path in COMPOSE_FILES:
        grafana = compose_config(path)["services"]["grafana"]
        mounts = {v["target"]: Path(v["source"]) for v in grafana["volumes"]}
        assert mounts[provider["options"]["path"]] == DASHBOARD.parent
        assert mounts["/etc/grafana/provisioning"] == DOCKER / "grafana" / "provisioning"
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit rate", "predicted vs actual", "time to first token", "routing decisions", "in flight",
                  "health", "kv events", "index drift", "kv index trust", "tier occupancy", "hits by tier",
                  "bytes moved"):
        assert topic in titles, topic


# --- Kubernetes ----------------------------------------------------------------------------------------------------


def k8s_documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    docs: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        docs.extend(d for d in yaml.safe_load_all((K8S / name).read_text()) if d)
    return docs


def test_k8s_manifests_pass_the_schema_check() -> None:
    import kubernetes_validate  # type: ignore[import-untyped]

    docs = k8s_documents()
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    # the check can fail: an unknown field and a missing required one are refused
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    broken = copy.deepcopy(deployment)
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
    broken = copy.deepcopy(deployment)
    del broken["spec"]["template"]["spec"]["containers"][0]["name"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_k8s_manifests_wire_together(tmp_path: Path) -> None:
    from kvcore.config import load_config
    from kvgate.serve import ENV_PREFIX
    from router.config import GatewayConfig
    from router.discovery_sources import DnsSource, parse_source

    docs = k8s_documents()
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for service in (d for d in docs if d["kind"] == "Service"):
        selected = [w for w in workloads
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no workload"
    for workload in workloads:
        assert workload["spec"]["selector"]["matchLabels"].items() <= workload["spec"]["template"]["metadata"][
            "labels"].items()

    for workload in workloads:
        pod = workload["spec"]["template"]["spec"]
        templates = {t["metadata"]["name"] for t in workload["spec"].get("volumeClaimTemplates", [])}
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"] + pod.get("initContainers", []):
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in templates, mount
        for volume in volumes.values():
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in by, volume
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in by, volume

    gateway = by[("Deployment", "kvgate-gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    # a rolling update: the pod takes connections until Service routing has dropped it, then gets SIGTERM
    # (test_processes.py: the streams in flight then run to their end)
    assert gateway["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]

    # the ConfigMap's kvgate.yaml is a valid gateway config that discovers the headless Service
    (tmp_path / "kvgate.yaml").write_text(by[("ConfigMap", "kvgate-config")]["data"]["kvgate.yaml"])
    import argparse

    cfg = load_config(GatewayConfig, ENV_PREFIX, argparse.Namespace(config=str(tmp_path / "kvgate.yaml")), {})
    assert cfg.strategy == "kv"
    headless = by[("Service", "vllm-headless")]
    assert headless["spec"]["clusterIP"] == "None"
    source = parse_source(cfg.discover[0])
    assert isinstance(source, DnsSource)
    assert source.name == f"vllm-headless.{headless['metadata']['namespace']}.svc.cluster.local"
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    assert (source.port, cfg.discover_events_port, cfg.discover_replay_port) == (
        ports["http"], ports["kv-events"], ports["kv-replay"])

    # the agent is a sidecar of the vLLM pod, sharing the socket directory (shared memory goes over the socket)
    pod = by[("StatefulSet", "vllm")]["spec"]["template"]["spec"]
    agent = next(c for c in pod["initContainers"] if c["name"] == "tier-agent")
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert agent["restartPolicy"] == "Always"
    shared = {m["mountPath"] for m in agent["volumeMounts"]} & {m["mountPath"] for m in vllm["volumeMounts"]}
    assert shared == {"/run/kvgate"}
    assert "--kv-events-config" in " ".join(vllm["args"]) and "agent.vllm_connector" in " ".join(vllm["args"])
    # the agent runs as the image's user, vLLM as root; the NVMe volume is made the agent's group's
    assert agent["securityContext"]["runAsUser"] == IMAGE_UID and "runAsUser" not in vllm.get("securityContext", {})
    assert pod["securityContext"]["fsGroup"] == agent["securityContext"]["runAsGroup"]

    # Valkey: a password from the Secret, protected mode, and only the vLLM pods (their agents) may reach it
    def secret_env(container: dict[str, Any]) -> dict[str, tuple[str, str]]:
        return {e["name"]: (e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}

    valkey_service = by[("Service", "valkey")]
    valkey = by[("Deployment", "valkey")]["spec"]["template"]["spec"]["containers"][0]
    assert _flag(valkey["args"], "--protected-mode") == ["yes"]
    assert _flag(valkey["args"], "--requirepass") == ["$(VALKEY_PASSWORD)"]
    password_ref = ("kvgate-secrets", "valkey-password")
    assert secret_env(valkey)["VALKEY_PASSWORD"] == password_ref and secret_env(valkey)["REDISCLI_AUTH"] == password_ref
    assert secret_env(agent)["VALKEY_PASSWORD"] == password_ref
    env = {e["name"]: e.get("value") for e in agent["env"]}
    names = [e["name"] for e in agent["env"]]
    assert names.index("VALKEY_PASSWORD") < names.index("KVGATE_AGENT_SHARED_URL")  # $(...) needs it defined first
    host = f"valkey.{valkey_service['metadata']['namespace']}.svc.cluster.local:6379"
    assert env["KVGATE_AGENT_SHARED_URL"] == f"redis://:$(VALKEY_PASSWORD)@{host}/0"
    secret_file = _flag(agent["args"], "--shared-secret-file")[0]
    volume = {v["name"]: v for v in pod["volumes"]}[next(
        m["name"] for m in agent["volumeMounts"] if secret_file.startswith(m["mountPath"] + "/"))]
    assert volume["secret"]["secretName"] == "kvgate-secrets"
    assert {i["key"]: i["path"] for i in volume["secret"]["items"]}["fleet-secret"] == secret_file.rsplit("/", 1)[1]
    policy = by[("NetworkPolicy", "valkey")]["spec"]
    valkey_labels = by[("Deployment", "valkey")]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= valkey_labels.items()
    assert policy["policyTypes"] == ["Ingress"] and len(policy["ingress"]) == 1
    (rule,) = policy["ingress"]
    allowed = [w for w in workloads if any(p["podSelector"]["matchLabels"].items()
                                           <= w["spec"]["template"]["metadata"]["labels"].items()
                                           for p in rule["from"])]
    assert [w["metadata"]["name"] for w in allowed] == ["vllm"] and rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    readme = (DOCKER / "README.md").read_text()
    assert "create secret generic kvgate-secrets" in readme
    assert "valkey-password" in readme and "fleet-secret" in readme


# --- vLLM as root, the agent as the image's user ------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="running the agent as another uid needs root")
def test_a_root_vllm_moves_bytes_through_an_agent_running_as_the_image_user(tmp_path: Path) -> None:
    """Issue 14: in the shipped stacks vLLM runs as root and the agent as uid 10001; vLLM's shared memory was a
    0600 /dev/shm file the agent could not open (EACCES), while lookups still answered. The same two uids here:
    the agent as the image's user, the connector's client as root, bytes stored and loaded through shared
    memory, and /health saying so."""
    import multiprocessing
    import shutil as _shutil
    import tempfile

    from agent.client import AgentClient
    from bench.procs import free_port, wait_http
    from tests.deploy_stack import run_agent_as

    run_dir = Path(tempfile.mkdtemp(prefix="kvgate-run-"))  # /run/kvgate: the image makes it the agent's
    os.chown(run_dir, IMAGE_UID, IMAGE_UID)
    socket_path = str(run_dir / "agent.sock")
    port = free_port()
    agent = multiprocessing.get_context("spawn").Process(target=run_agent_as, args=(IMAGE_UID, socket_path, port))
    agent.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30)
        assert os.stat(socket_path).st_uid == IMAGE_UID
        block = 64 * 1024
        blocks = [bytes([i]) * block for i in range(8)]
        with AgentClient(socket_path, shm_bytes=16 * block) as client:  # the vLLM connector's client, as root
            assert client.store(0xD0C, list(range(8)), blocks) == 8
            assert client.load_in_place(0xD0C, list(range(8)), block) == [block] * 8
            assert client.shm is not None and bytes(client.shm[3 * block: 4 * block]) == blocks[3]
            status, health = http_json(f"http://127.0.0.1:{port}/health")
        assert status == 200 and health["shm_clients"] == 1 and health["hello_errors"] == 0
        assert health["bytes_stored"] == 8 * block and health["bytes_loaded"] == 8 * block
    finally:
        agent.terminate()
        agent.join(10)
        _shutil.rmtree(run_dir, ignore_errors=True)


# --- the demo stack, run here ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """compose.demo.yaml's services as local processes (Grafana aside: it has no Debian package)."""
    need("prometheus")
    config = compose_config(DOCKER / "compose.demo.yaml")
    stack = LocalStack(config, tmp_path_factory.mktemp("demo"), PROGRAMS)
    # this test's Prometheus scrapes every second (the stack's file says 5 s)
    prom = stack.services["prometheus"]
    try:
        for name in stack.order():
            if name == "grafana":
                continue
            if name == "prometheus":
                stack.mounts(prom)  # writes the rewritten prometheus.yml
                copy_path = stack.workdir / "binds" / "prometheus" / "prometheus.yml"
                copy_path.write_text(copy_path.read_text().replace("scrape_interval: 5s", "scrape_interval: 1s"))
            stack.start(name)
            restart = stack.services[name].spec.get("restart")
            if restart == "no":
                stack.run_to_completion(name)
            else:
                stack.wait_ready(name)
        yield stack
    finally:
        stack.stop()


def test_demo_stack_serves_a_request_end_to_end(demo_stack: LocalStack) -> None:
    gateway = demo_stack.services["gateway"].url(8000)
    status, listing = http_json(gateway + "/admin/workers")
    assert status == 200
    workers = {w["url"]: w for w in listing["workers"]}
    for name in ("replica-0", "replica-1"):
        replica = demo_stack.services[name]
        worker = workers[replica.url(8000)]
        assert worker["events"] == f"tcp://127.0.0.1:{replica.port(5557)}"
    deadline = time.monotonic() + 15
    while not all(w["healthy"] for w in workers.values()):
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)
        workers = {w["url"]: w for w in http_json(gateway + "/admin/workers")[1]["workers"]}

    system = "You are the demo assistant of a prefix-aware router. " * 20
    body = {"model": "tiny", "max_tokens": 4,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hello"}]}
    status, first = http_json(gateway + "/v1/chat/completions", body)
    assert status == 200, first
    assert first["choices"][0]["message"]["role"] == "assistant"
    # the second request with the same long prefix finds it cached (the kv strategy sends it where it is)
    deadline = time.monotonic() + 10
    while True:
        status, second = http_json(gateway + "/v1/chat/completions", body)
        assert status == 200, second
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        if cached > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert cached >= second["usage"]["prompt_tokens"] // 2

    # the gateway applies KV events from the endpoints the compose file gives it
    exposition = fetch_text(gateway + "/metrics")
    served = [w for w in workers if re.search(
        rf'kvgate_kv_events_applied_total\{{type="BlockStored",worker="{re.escape(w)}"\}} [1-9]', exposition)
        or re.search(rf'kvgate_kv_events_applied_total\{{worker="{re.escape(w)}",type="BlockStored"\}} [1-9]',
                     exposition)]
    assert served, "no KV events applied from any replica"

    # every agent runs the three tiers the compose file gives it, and bytes move: the replicas saved the blocks
    # they computed to their agents; both agents follow Valkey's announcements (with its password)
    for name in ("agent-0", "agent-1"):
        text = fetch_text(demo_stack.services[name].url(9400) + "/metrics")
        for tier in ("dram", "nvme", "shared"):
            assert f'kvgate_agent_tier_capacity_bytes{{tier="{tier}"}}' in text, text[:2000]
    stored = 0
    deadline = time.monotonic() + 10
    while stored == 0:
        assert time.monotonic() < deadline, "no agent stored a byte"
        time.sleep(0.2)
        stored = sum(http_json(demo_stack.services[name].url(9400) + "/health")[1]["bytes_stored"]
                     for name in ("agent-0", "agent-1"))
    valkey_port = demo_stack.services["valkey"].port(6379)
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=valkey_port).ping()
    password = demo_stack.services["valkey"].spec["environment"]["REDISCLI_AUTH"]
    assert redis.Redis(port=valkey_port, password=password).pubsub_numsub("kvgate:blocks") == [(b"kvgate:blocks", 2)]
    for name in ("agent-0", "agent-1"):
        text = fetch_text(demo_stack.services[name].url(9400) + "/metrics")
        assert 'kvgate_agent_backend_errors_total{tier="shared"} 0.0' in text


def test_dashboard_queries_only_exported_metrics(demo_stack: LocalStack) -> None:
    exported: set[str] = set()
    for name in ("gateway", "replica-0", "agent-0"):
        port = 9400 if name.startswith("agent") else 8000
        exported |= exported_names(fetch_text(demo_stack.services[name].url(port) + "/metrics"))
    missing = sorted(dashboard_metrics() - exported)
    assert not missing, f"the dashboard queries metrics no component exports: {missing}"


def test_prometheus_scrapes_the_demo_stack(demo_stack: LocalStack) -> None:
    # some traffic, so request counters exist
    gateway = demo_stack.services["gateway"].url(8000)
    status, _ = http_json(gateway + "/v1/completions", {"model": "tiny", "prompt": "count me", "max_tokens": 2})
    assert status == 200
    api = demo_stack.services["prometheus"].url(9090) + "/api/v1/query?query="

    def query(expr: str) -> list[dict[str, Any]]:
        status, answer = http_json(api + urllib.parse.quote(expr))
        assert status == 200 and answer["status"] == "success", answer
        result: list[dict[str, Any]] = answer["data"]["result"]
        return result

    deadline = time.monotonic() + 30
    while True:
        up = {(r["metric"]["job"], r["metric"]["instance"]): r["value"][1] for r in query("up")}
        requests = query("sum(kvgate_requests_total)")
        if (len(up) >= 6 and all(v == "1" for v in up.values()) and requests
                and float(requests[0]["value"][1]) >= 1):
            break
        assert time.monotonic() < deadline, f"Prometheus did not scrape the stack in time: up={up} " \
                                            f"requests={requests}"
        time.sleep(0.5)
    assert {job for job, _ in up} == {"kvgate-gateway", "vllm", "kvgate-agent", "prometheus"}
    hits = query("sum by (replica) (vllm:prefix_cache_queries_total)")
    assert {r["metric"]["replica"] for r in hits} == {"replica-0", "replica-1"}
    tiers = query("count by (tier) (kvgate_agent_tier_capacity_bytes)")
    assert tiers


# --- the vLLM command lines, parsed by vLLM itself ---------------------------------------------------------------

VLLM_PARSE = r"""
import json, sys
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser

results = []
for argv in json.loads(sys.argv[1]):
    parser = make_arg_parser(FlexibleArgumentParser())
    try:
        args = parser.parse_args(argv)
        validate_parsed_serve_args(args)
    except SystemExit as exc:
        results.append({"error": f"exit {exc.code}"})
        continue
    events, transfer = args.kv_events_config, args.kv_transfer_config
    results.append({
        "model": args.model_tag, "block_size": args.block_size, "prefix_caching": args.enable_prefix_caching,
        "prompt_tokens_details": args.enable_prompt_tokens_details,
        "events": events and {"on": events.enable_kv_cache_events, "endpoint": events.endpoint,
                              "replay": events.replay_endpoint, "publisher": events.publisher},
        "connector": transfer and {"name": transfer.kv_connector, "module": transfer.kv_connector_module_path,
                                   "role": transfer.kv_role, "extra": transfer.kv_connector_extra_config},
    })
print(json.dumps(results))
"""


@pytest.mark.vllm
def test_vllm_command_lines_parse_with_vllm() -> None:
    """compose.gpu.yaml's and the StatefulSet's `vllm serve` arguments, through vLLM 0.32's own parser."""
    from bench.vllm_engine import ensure_vllm_venv

    python = ensure_vllm_venv()
    services = compose_config(DOCKER / "compose.gpu.yaml")["services"]
    argvs = []
    for name in sorted(n for n in services if n.startswith("replica-")):
        assert services[name]["entrypoint"] == ["vllm", "serve"]
        argvs.append(services[name]["command"])
    pod = next(d for d in k8s_documents() if d["kind"] == "StatefulSet")["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert vllm["command"] == ["vllm", "serve"]
    argvs.append(vllm["args"])
    argvs.append([*vllm["args"], "--no-such-flag"])  # the parser refuses what vLLM does not know
    out = subprocess.run([str(python), "-c", VLLM_PARSE, json.dumps(argvs)], capture_output=True, text=True,
                         timeout=300, check=False, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    *good, bad = json.loads(out.stdout.strip().splitlines()[-1])
    assert "error" in bad
    for parsed in good:
        assert "error" not in parsed, parsed
        assert parsed["block_size"] == 16 and parsed["prefix_caching"] and parsed["prompt_tokens_details"]
        assert parsed["events"] == {"on": True, "endpoint": "tcp://*:5557", "replay": "tcp://*:5558",
                                    "publisher": "zmq"}
        assert parsed["connector"] == {"name": "KvgateConnector", "module": "agent.vllm_connector",
                                       "role": "kv_both", "extra": {"agent_socket": "/run/kvgate/agent.sock"}}
