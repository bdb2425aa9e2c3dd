"""The gateway's view of a real tier agent's tiers (issue 12 items 4 and 5): a `kvgate agent` process with a Valkey
shared tier publishes its KV events; a gateway's event hub subscribes to it beside the engine's events (a test
publisher). The agent's announcements are placed even when they arrive before the engine names the blocks, and the
shared tier the gateway sees follows the store within seconds: blocks that expire, or a Valkey that restarts
empty, leave the index."""

from __future__ import annotations

import signal
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest
import zmq.asyncio

from agent.client import AgentClient
from bench.procs import free_port, wait_http
from bench.procs import stop as stop_process
from bench.sim.launch import SimFleet
from bench.workloads import PromptVocabulary
from kvcore.kv_events import CPU, GPU, SHARED
from router.kv_index import InMemoryKvIndex
from router.kv_subscriber import EventSource, KvEventHub
from router.metrics import GatewayMetrics
from tests.agent_process import AgentProcess
from tests.conftest import ValkeyServer, eventually, kvgate_command
from tests.test_kv_events_in import BS, KEYS, TOKENS, WORKER, Publisher, connected, held, metric, stored

LAYOUT = 7
SIM_BS = 16


@asynccontextmanager
async def gateway_view(agent_events: str, agent_replay: str) -> AsyncIterator[tuple[KvEventHub, Publisher,
                                                                                   GatewayMetrics]]:
    """A hub subscribed to an engine (a test publisher) and to the agent, both about one worker."""
    ctx = zmq.asyncio.Context()
    engine = Publisher(ctx)
    metrics = GatewayMetrics()
    hub = KvEventHub(InMemoryKvIndex(), metrics, lambda url: "tiny", block_size=BS)
    try:
        hub.watch([engine.source, EventSource(WORKER, agent_events, agent_replay, "agent")])
        await connected(hub, engine)
        yield hub, engine, metrics
    finally:
        await hub.close()
        engine.close()
        ctx.destroy(0)


def store_blocks(agent: AgentProcess, hashes: list[int]) -> None:
    with AgentClient(agent.socket, shm_bytes=0) as client:
        assert client.store(LAYOUT, hashes, [bytes([h]) * 64 for h in hashes]) == len(hashes)


def shared(hub: KvEventHub) -> set[int]:
    return {key for key, tier in held(hub) if tier == SHARED}


@pytest.mark.timeout(180)
async def test_the_shared_tier_the_gateway_sees_follows_the_store(tmp_path: Path, valkey: ValkeyServer,
                                                                  subprocess_env: dict[str, str]) -> None:
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    agent = AgentProcess(tmp_path, subprocess_env, "--events-endpoint", events.replace("127.0.0.1", "*"),
                         "--replay-endpoint", replay.replace("127.0.0.1", "*"), "--block-size", str(BS),
                         "--write-policy", "eager", "--shared-backend", "redis", "--shared-url", valkey.url,
                         "--shared-index-refresh-s", "0.5", "--shared-ttl-s", "4")
    try:
        await follow_the_store(agent, valkey, events, replay)
    finally:
        agent.stop()


async def follow_the_store(agent: AgentProcess, valkey: ValkeyServer, events: str, replay: str) -> None:
    async with gateway_view(events, replay) as (hub, engine, metrics):
        # 1. the agent saves blocks before the engine's events name them: its announcements wait, then count
        store_blocks(agent, [1, 2])
        await eventually(lambda: hub.applier.waiting() >= 2, timeout=10)
        await engine.send([stored([1, 2, 3, 4], TOKENS[:16])])
        await eventually(lambda: {(KEYS[0], CPU), (KEYS[1], CPU), (KEYS[0], SHARED), (KEYS[1], SHARED)}
                         <= held(hub), timeout=10)
        assert hub.index.lookup(KEYS, ["http://other:1"])["http://other:1"].blocks == 2  # shared: every worker's
        # 2. shared blocks expire (TTL 4 s): the agent says so, and the gateway stops counting them
        began = time.monotonic()
        await eventually(lambda: not shared(hub), timeout=15)
        assert time.monotonic() - began < 10
        assert (KEYS[0], GPU) in held(hub) and (KEYS[0], CPU) in held(hub)  # the other tiers are untouched
        # 3. Valkey restarts empty: what was in it leaves the gateway's view within seconds
        store_blocks(agent, [3, 4])
        await eventually(lambda: {KEYS[2], KEYS[3]} <= shared(hub), timeout=10)
        valkey.stop()
        valkey.start()
        began = time.monotonic()
        await eventually(lambda: not shared(hub), timeout=20)
        print(f"the gateway saw the emptied shared tier after {time.monotonic() - began:.1f} s")
        assert metric(metrics, "kvgate_kv_unmapped_blocks_total", worker=WORKER) == 0
        assert hub.trusted(WORKER)


def _samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return {name: float(value) for line in text.splitlines() if line and not line.startswith("#")
            for name, _, value in [line.rpartition(" ")]}


@pytest.mark.timeout(240)
def test_a_kv_gateway_forgets_an_agents_tiers_the_moment_it_goes(tiny_model_dir: Path, tmp_path: Path,
                                                                   sim_fleet: Callable[..., SimFleet],
                                                                   subprocess_env: dict[str, str]) -> None:
    """Issue 19: a real `kvgate serve --strategy kv` in front of a simulated replica with a real tier agent (DRAM
    only) and a GPU cache smaller than the prompts, so warm prompts come back from the agent. The agent is killed
    (-9) and, after a while down, started again empty; later restarted (SIGTERM, started again at once). Every
    round right after either predicts no more cached tokens than the replica reports: the gateway drops the
    agent's tiers when its event stream drops, not when it reconnects (ZMQ backs off up to 2 s). Before, it kept
    predicting the dead agent's DRAM until then, and indefinitely while the agent stayed down."""
    from bench.sim.launch import AgentSettings

    fleet = sim_fleet(1, speedup=50, extra_args=["--block-size", str(SIM_BS), "--num-gpu-blocks-override", "24",
                                                         "--max-model-len", "256"],
                      agents=AgentSettings(shared=False))
    agent, url = fleet.agents[0], fleet.urls[0]
    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    prompts = [vocab.text(vocab.tokens(f"agent-goes-{i}", 10 * SIM_BS + 5)) for i in range(4)]  # 10 blocks each
    port = free_port()
    gateway_url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        gateway = subprocess.Popen(
            kvgate_command("serve", "--strategy", "kv", "--host", "127.0.0.1", "--port", str(port), "--model-dir",
                           str(tiny_model_dir), "--block-size", str(SIM_BS), "--worker", fleet.worker_specs[0],
                           "--health-interval-s", "0.5"),
            env=subprocess_env, stdout=log, stderr=subprocess.STDOUT)

    def counter(name: str, **labels: str) -> float:
        wanted = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted({**labels, "worker": url}.items())) + "}"
        return _samples(gateway_url).get(wanted, 0.0)

    def one_round() -> tuple[float, float]:
        """Each prompt once through the gateway: (cached tokens it predicted, cached tokens the replica reported)."""
        predicted = counter("kvgate_worker_predicted_cached_tokens_total")
        reported = counter("kvgate_worker_reported_cached_tokens_total")
        for text in prompts:
            body = orjson.dumps({"model": "tiny", "prompt": text, "max_tokens": 1})
            request = urllib.request.Request(gateway_url + "/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200
            time.sleep(0.3)  # the replica's events (evictions from its small GPU cache) reach the gateway
        return (counter("kvgate_worker_predicted_cached_tokens_total") - predicted,
                counter("kvgate_worker_reported_cached_tokens_total") - reported)

    def noticed(times: int) -> None:
        """Until the gateway has seen the agent's stream drop `times` times (moments, not ZMQ's back-off)."""
        deadline = time.monotonic() + 10
        while counter("kvgate_kv_state_resets_total", reason="disconnected") < times:
            assert time.monotonic() < deadline, "the gateway did not notice that the agent went"
            time.sleep(0.05)

    def agent_hits() -> float:
        with urllib.request.urlopen(agent.metrics_url, timeout=10) as response:
            text = response.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvgate_agent_hits_total"))

    try:
        wait_http(gateway_url + "/ready", 30, gateway)
        deadline = time.monotonic() + 30
        while counter("kvgate_kv_worker_trusted") != 1.0:
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.1)
        one_round()  # computed, saved to the agent; the GPU cache keeps about two of the four prompts
        time.sleep(1.0)  # the agent's announcements
        hits = agent_hits()
        predicted, reported = one_round()
        assert agent_hits() > hits and reported > 0 and predicted <= reported, (predicted, reported)

        agent.stop(signal.SIGKILL)
        noticed(1)
        predicted, reported = one_round()  # the agent is down: its engine loads nothing
        assert predicted <= reported, f"predicted {predicted} cached tokens, {reported} reported (agent down)"
        time.sleep(3.0)  # down a while: ZMQ's reconnect back-off grows to its 2 s
        agent.start()
        predicted, reported = one_round()  # at once: the new agent's DRAM is empty
        assert predicted <= reported, f"predicted {predicted} cached tokens, {reported} reported (agent restarted)"

        time.sleep(1.0)
        hits = agent_hits()
        predicted, reported = one_round()  # the new agent's blocks load, and the gateway counts them again
        assert agent_hits() > hits and predicted <= reported, (predicted, reported)
        assert predicted > reported / 2, (predicted, reported)
        agent.stop()
        noticed(2)
        agent.start()
        predicted, reported = one_round()  # restarted, at once: empty again
        assert predicted <= reported, f"predicted {predicted} cached tokens, {reported} reported (agent restarted)"
        assert gateway.poll() is None
    finally:
        stop_process(gateway)
