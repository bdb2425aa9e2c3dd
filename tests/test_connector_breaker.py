"""The connector without its agent: a hung (SIGSTOPped) or dead agent costs one timeout, after which every lookup,
load and save fails at once (vLLM recomputes) until a background probe finds the agent back, and then the connector
uses it again. Against a real agent process, stopped, resumed, killed and restarted; the connector-level test runs
the real KvgateConnector in the vLLM venv."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.breaker import AgentCircuit
from agent.client import AgentClient
from agent.protocol import AgentError
from bench.make_model import write_model
from tests.agent_process import AgentProcess
from tests.test_connector_integrity import run_in_vllm

pytestmark = pytest.mark.timeout(600)

TIMEOUT_S = 1.0


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        if agent.proc is not None and agent.proc.poll() is None:
            agent.proc.send_signal(signal.SIGCONT)
        agent.stop()


def hello(socket_path: str) -> None:
    with AgentClient(socket_path, shm_bytes=0, timeout_s=TIMEOUT_S):
        pass


def lookup_s(client: AgentClient) -> float:
    """Seconds one failing lookup took."""
    start = time.monotonic()
    with pytest.raises(AgentError):
        client.lookup(1, [1, 2])
    return time.monotonic() - start


def wait_until_answered(client: AgentClient, deadline_s: float = 10.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < deadline_s:
        try:
            client.lookup(1, [1, 2])
            return time.monotonic() - start
        except AgentError:
            time.sleep(0.05)
    raise AssertionError("the client did not rejoin the agent")


def test_a_hung_or_dead_agent_costs_one_timeout_then_nothing_until_it_is_back(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """Before, every call waited its timeout (a lookup twice: once more on a fresh connection), on every step."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    assert agent.proc is not None
    circuit = AgentCircuit(lambda: hello(agent.socket), probe_interval_s=0.2)
    client = AgentClient(agent.socket, shm_bytes=0, timeout_s=TIMEOUT_S, circuit=circuit)
    assert client.lookup(1, [1, 2]) == (0, "")

    agent.proc.send_signal(signal.SIGSTOP)  # hung
    first = lookup_s(client)
    assert TIMEOUT_S * 0.9 < first < TIMEOUT_S * 1.6  # one timeout, not two
    assert circuit.is_open and circuit.trips == 1
    later = [lookup_s(client) for _ in range(20)]
    assert max(later) < 0.05
    time.sleep(0.5)  # probes time out meanwhile; the circuit stays open
    assert circuit.is_open

    agent.proc.send_signal(signal.SIGCONT)  # back
    assert wait_until_answered(client) < 0.2 + TIMEOUT_S + 1.0
    assert not circuit.is_open

    agent.stop(signal.SIGKILL)  # dead: refused at once, and nothing waits
    assert lookup_s(client) < 0.5
    assert circuit.is_open and circuit.trips == 2
    assert max(lookup_s(client) for _ in range(20)) < 0.05
    agent.start()  # a new agent on the same socket
    wait_until_answered(client)
    assert not circuit.is_open
    circuit.close()
    client.close()


def test_an_error_reply_does_not_open_the_circuit(tmp_path: Path, agents: list[AgentProcess],
                                                 subprocess_env: dict[str, str]) -> None:
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    circuit = AgentCircuit(lambda: hello(agent.socket), probe_interval_s=0.2)
    with AgentClient(agent.socket, shm_bytes=4096, timeout_s=TIMEOUT_S, layout=5, block_bytes=1024,
                     circuit=circuit) as client:
        with pytest.raises(AgentError, match="declared for"):
            client.load_in_place(6, [1], 1024)  # the agent refuses another layout than the one declared
        assert not circuit.is_open
    circuit.close()


# A worker-side KvgateConnector on CPU caches: steps while its agent is stopped, resumed. And the loud warning.
STEPS_SCRIPT = """
import json, logging, os, signal, sys, time
import torch
from vllm.engine.arg_utils import EngineArgs
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.utils.gc_utils import freeze_gc_heap
from agent.vllm_connector import BlockTransfer, KvgateConnector, KvgateConnectorMetadata

model, socket, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
warnings = []
class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
keep = Keep(logging.WARNING)

def connector(role, policy):
    extra = {"agent_socket": socket, "shm_bytes": 1 << 20, "timeout_s": 1.0, "probe_interval_s": 0.2,
             "async_transfers": False}  # loads inside the step (tests/test_connector_async.py: without)
    config = EngineArgs(model=model, max_model_len=512, kv_transfer_config={
        "kv_connector": "KvgateConnector", "kv_connector_module_path": "agent.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": extra}).create_engine_config()
    logging.getLogger("vllm.kvgate_connector").addHandler(keep)  # after vLLM's logging set-up, which drops it
    return KvgateConnector(config, role, KVCacheConfig(32, [], []))

out = {}
connector(KVConnectorRole.SCHEDULER, "fail").shutdown()
out["fail_warned"] = sum("not 'recompute'" in w for w in warnings)
worker = connector(KVConnectorRole.WORKER, "recompute")
out["recompute_warned"] = sum("not 'recompute'" in w for w in warnings) - out["fail_warned"]
worker.register_kv_caches({f"l{i}": torch.randn(32, 2, 16, 64).to(torch.bfloat16) for i in range(2)})
freeze_gc_heap()  # as EngineCore does once the engine is up (tests/test_connector_async.py: WORKER_SETUP)

def step(loads, saves):
    start = time.monotonic()
    worker.bind_connector_metadata(KvgateConnectorMetadata(loads=loads, saves=saves))
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return time.monotonic() - start, sorted(worker.get_block_ids_with_load_errors())

step([], [BlockTransfer("b", [1, 2], [11, 12])])
os.kill(pid, signal.SIGSTOP)
hung = [step([BlockTransfer(f"a{i}", [3, 4], [11, 12])], [BlockTransfer(f"c{i}", [5], [500 + i])])
        for i in range(5)]
out["hung_s"] = [s for s, _errors in hung]
out["hung_errors"] = [errors for _s, errors in hung]
out["saves_while_open_s"] = step([], [BlockTransfer("d", [6], [600])])[0]
os.kill(pid, signal.SIGCONT)
deadline = time.monotonic() + 10
while worker._circuit.is_open and time.monotonic() < deadline:
    time.sleep(0.05)
out["rejoined"] = not worker._circuit.is_open
out["after"] = step([BlockTransfer("e", [7, 8], [11, 12])], [])[1]
out["loud"] = sum("running WITHOUT it" in w for w in warnings)
worker.shutdown()
print(json.dumps(out))
"""


def test_the_connector_runs_without_a_hung_agent_and_rejoins(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """Before, each step with a load waited two timeouts (a load, then its retry on a new connection) for as long
    as the agent hung; and a kv_load_failure_policy of 'fail' went unmentioned."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    assert agent.proc is not None
    model = tmp_path / "model"
    write_model(model)
    out = run_in_vllm(STEPS_SCRIPT, str(model), agent.socket, str(agent.proc.pid))
    assert out["fail_warned"] == 1 and out["recompute_warned"] == 0
    assert out["hung_s"][0] < 1.6  # one timeout
    assert max(out["hung_s"][1:]) < 0.1 and out["saves_while_open_s"] < 0.1  # then nothing waits
    assert out["hung_errors"] == [[3, 4]] * 5  # every load recomputed
    assert out["loud"] == 1
    assert out["rejoined"] and out["after"] == []  # the blocks saved before the hang load again


def test_the_probing_thread_is_named_for_the_kernel() -> None:
    """The circuit's probing thread carries its name as an OS thread name (see tests/vllm_replica.thread_states)."""
    from agent.breaker import THREAD_NAME
    from tests.vllm_replica import thread_states

    def unanswered() -> None:
        raise AgentError("no agent")

    circuit = AgentCircuit(unanswered, probe_interval_s=0.05)
    circuit.trip("a test")
    try:
        deadline = time.monotonic() + 10
        while not any(THREAD_NAME in line for line in thread_states(os.getpid(), ("kvgate",))):
            assert time.monotonic() < deadline, thread_states(os.getpid())
            time.sleep(0.01)
    finally:
        circuit.close()
