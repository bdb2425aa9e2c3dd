"""The connector's load path against real agent processes that are absent, restarted or answer wrongly: every
failure loads fewer blocks (vLLM recomputes the rest), is counted by reason, and never raises; the shared memory is
mapped before the first step and its torch view never outlives its mapping. The worker half runs on vLLM's torch
(tests/mover_probe.py), without an engine; the Hello checks run against the agent directly."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.client import AgentClient
from agent.protocol import AgentError, AgentRefused, Load, Store
from bench.vllm_engine import ensure_vllm_venv
from tests.agent_process import AgentProcess
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)

BLOCK_BYTES = 2 * 2 * 32 * 64 * 2  # tests/mover_probe.py: 2 layers x 2 KV heads x 32 tokens x 2*32 dims x bf16


class MoverProbe:
    """tests/mover_probe.py in the vLLM venv: a BlockMover on real torch caches, one JSON command per call."""

    def __init__(self, socket: str, shm_bytes: int = 8 * BLOCK_BYTES) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([str(ensure_vllm_venv()), str(ROOT / "tests" / "mover_probe.py"), socket,
                                      str(shm_bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     text=True)

    def __call__(self, op: str, **fields: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the probe died ({self.proc.wait(10)})"
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        assert self.proc.wait(30) == 0  # no crash, no exception out of the mover


@pytest.fixture
def probes() -> Iterator[list[MoverProbe]]:
    started: list[MoverProbe] = []
    yield started
    for probe in started:
        if probe.proc.poll() is None:
            probe.proc.kill()
            probe.proc.wait()


def test_shared_memory_is_mapped_before_the_first_step_and_never_dangles(
        tmp_path: Path, agents: list[AgentProcess], probes: list[MoverProbe],
        subprocess_env: dict[str, str]) -> None:
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    probe = MoverProbe(agent.socket)
    probes.append(probe)
    assert probe("attach") == {"attached": True}
    assert probe("save", hashes=[11, 12, 13], blocks=[3, 9, 27]) == {"failure": None}
    assert probe("load", hashes=[11, 12, 13], blocks=[0, 1, 2]) == {"loaded": 3, "failure": None, "correct": True}
    # the torch view of the shared memory holds the mapping: closing the connection cannot unmap memory that a
    # view still points at (before, AgentClient.close() unmapped it under the connector's tensor)
    assert probe("view_outlives_close") == {"mapped": True}
    assert probe("load", hashes=[11, 12, 13], blocks=[4, 5, 6]) == {"loaded": 3, "failure": None, "correct": True}
    probe.close()


def test_a_steps_saves_reach_the_agent_in_one_round_trip(
        tmp_path: Path, agents: list[AgentProcess], probes: list[MoverProbe],
        subprocess_env: dict[str, str]) -> None:
    """The transfer thread hands every save queued by a step (one chain per request) to the agent together: one
    gather, their Stores in one write, one wait for the replies. Before, one round trip per request: a saturated
    replica's transfer thread and agent woke 8 times a step (issue 14 item 1). A batch larger than the shared memory
    (8 blocks here) is cut into pieces that keep each chain's parents, and every block loads back as saved."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    probe = MoverProbe(agent.socket)
    probes.append(probe)
    assert probe("attach") == {"attached": True}
    chains = [{"hashes": [100 + 10 * r, 101 + 10 * r], "blocks": [2 * r, 2 * r + 1], "parent": None} for r in range(4)]
    assert probe("save_step", chains=chains) == {"done": True, "round_trips": 1}
    for r, chain in enumerate(chains):
        assert probe("load", hashes=chain["hashes"], blocks=[20 + 2 * r, 21 + 2 * r]) == {
            "loaded": 2, "failure": None, "correct": True}
    # 15 blocks in three chains through 8 blocks of shared memory: a batch holds at most 8 (a load queued meanwhile
    # waits for one batch, not for every save), and the 10-block chain is cut in two, its parents kept
    long = [{"hashes": [200, 201, 202], "blocks": [0, 1, 2], "parent": None},
            {"hashes": list(range(300, 310)), "blocks": list(range(3, 13)), "parent": 299},
            {"hashes": [400, 401], "blocks": [13, 14], "parent": None}]
    assert probe("save_step", chains=long) == {"done": True, "round_trips": 4}
    assert probe("load", hashes=list(range(300, 310)), blocks=list(range(15, 25))) == {
        "loaded": 10, "failure": None, "correct": True}
    assert probe("load", hashes=[200, 201, 202], blocks=[25, 26, 27]) == {"loaded": 3, "failure": None,
                                                                          "correct": True}
    assert probe("load", hashes=[400, 401], blocks=[28, 29]) == {"loaded": 2, "failure": None, "correct": True}
    with AgentClient(agent.socket, shm_bytes=0) as client:  # the cut chain is still one chain to the agent
        assert client.lookup(0x1A7E, list(range(300, 310))) == (10, "C" * 10)
    assert probe("counters") == {"load": {}, "save": {}}
    probe.close()


def test_without_an_agent_loads_fail_and_saves_drop_without_raising(
        tmp_path: Path, agents: list[AgentProcess], probes: list[MoverProbe],
        subprocess_env: dict[str, str]) -> None:
    probe = MoverProbe(str(tmp_path / "agent.sock"))
    probes.append(probe)
    assert probe("attach") == {"attached": False}
    assert probe("load", hashes=[1, 2], blocks=[0, 1]) == {"loaded": 0, "failure": "agent_unavailable",
                                                           "correct": True}
    assert probe("save", hashes=[1, 2], blocks=[0, 1]) == {"failure": "agent_unavailable"}
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")  # the agent comes up: rejoined
    agents.append(agent)
    assert probe("save", hashes=[1, 2], blocks=[0, 1]) == {"failure": None}
    assert probe("load", hashes=[1, 2, 3], blocks=[7, 8, 9]) == {"loaded": 2, "failure": "missing",
                                                                 "correct": True}
    assert probe("counters") == {"load": {"agent_unavailable": 1, "missing": 1}, "save": {"agent_unavailable": 1}}
    probe.close()


def test_hello_declares_the_layout_and_block_size(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    with AgentClient(agent.socket, shm_bytes=4 * BLOCK_BYTES, layout=5, block_bytes=BLOCK_BYTES) as client:
        assert client.store(5, [1], [b"x" * BLOCK_BYTES]) == 1
        assert client.load(5, [1], BLOCK_BYTES) == [b"x" * BLOCK_BYTES]
        with pytest.raises(AgentError, match="blocks of 100 bytes on a connection declared for"):
            client._call(Load(layout=5, hashes=[1], block_bytes=100, offsets=[0]))
        with pytest.raises(AgentError, match="layout 0x6 on a connection declared for 0x5"):
            client.load_in_place(6, [1], BLOCK_BYTES)
    # a block size the shared memory cannot hold is refused at Hello
    with pytest.raises(AgentError, match="a block of 8192 bytes does not fit 4096 bytes of shared memory"):
        AgentClient(agent.socket, shm_bytes=4096, block_bytes=8192).connect()


def test_a_block_of_another_size_than_declared_is_not_stored(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """A Store of a block of another size than the connection declared in Hello (a part of a block, or a block of
    another model) was stored: the agent held the part under the block's hash, every load of it after failed (a
    bad reply, recomputed), and the whole block stored later under that hash found it held and changed nothing.
    Now the store is refused as a whole, nothing of it kept, and the whole block is stored and loads whole."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    whole = bytes(range(256)) * (BLOCK_BYTES // 256)
    with AgentClient(agent.socket, shm_bytes=4 * BLOCK_BYTES, layout=5, block_bytes=BLOCK_BYTES) as client:
        assert client.shm is not None
        client.shm[: 2 * BLOCK_BYTES] = whole * 2
        for lengths in ([BLOCK_BYTES // 2], [BLOCK_BYTES, BLOCK_BYTES + 16], [BLOCK_BYTES, 0]):
            hashes = [7, 8][: len(lengths)]
            with pytest.raises(AgentError, match=f"blocks of {lengths[-1]} bytes on a connection declared for "
                                                 f"{BLOCK_BYTES}"):
                client.store_in_place(5, hashes, [k * BLOCK_BYTES for k in range(len(lengths))], lengths)
        with pytest.raises(AgentError, match="blocks of 100 bytes on a connection declared for"):
            client._call(Store(layout=5, hashes=[7], data=[b"x" * 100]))
        assert client.lookup(5, [7, 8]) == (0, "")  # nothing of them kept
        assert client.store_in_place(5, [7, 8], [0, BLOCK_BYTES], [BLOCK_BYTES] * 2) == 2
        assert client.load_in_place(5, [7, 8], BLOCK_BYTES) == [BLOCK_BYTES] * 2
        assert bytes(client.shm[: 2 * BLOCK_BYTES]) == whole * 2
    with AgentClient(agent.socket, shm_bytes=0) as client:  # a client that declared no size stores any
        assert client.store(5, [9], [b"x" * 100]) == 1


def test_a_load_in_several_requests_never_takes_one_answers_extra_block_for_the_next_ones(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str]) -> None:
    """A load of more than MAX_BATCH_BLOCKS blocks goes as several Loads in one write. An answer with more blocks
    than its Load asked for is a bad reply (BlockMover: nothing of it can be trusted), but the client joined the
    answers' lengths: one extra block in the first answer and one block missing from the second made as many
    lengths as blocks asked for, all whole, and the last block's shared memory (never written by the agent) passed
    for a loaded block. Now such an answer is refused as a bad reply."""
    from agent.client import AgentBadReply
    from agent.protocol import MAX_BATCH_BLOCKS
    from tests.faulty_agent import FaultyAgentProcess

    # (32,769 blocks of 16 bytes, each charged 528 against the capacity since 619f3d6: 17.3 MB)
    agent = FaultyAgentProcess(tmp_path, subprocess_env, "--dram-capacity", "64MiB")
    agents.append(agent)
    size, count = 16, MAX_BATCH_BLOCKS + 2
    hashes = list(range(1, count + 1))
    with AgentClient(agent.socket, shm_bytes=count * size, layout=5, block_bytes=size) as client:
        assert client.shm is not None
        assert client.store(5, hashes[:-1], [h.to_bytes(size, "big") for h in hashes[:-1]]) == count - 1
        client.shm[:] = b"\xee" * len(client.shm)  # what a load leaves where the agent writes nothing
        assert client.load_in_place(5, hashes, size) == [size] * (count - 1)  # the last one is missing
        agent.set_mode("extra_once")
        with pytest.raises(AgentBadReply, match=f"{MAX_BATCH_BLOCKS + 1} blocks for {MAX_BATCH_BLOCKS}"):
            client.load_in_place(5, hashes, size)
        agent.set_mode("ok")
        assert client.load_in_place(5, hashes, size) == [size] * (count - 1)
        agent.set_mode("extra_once")
        with AgentClient(agent.socket, shm_bytes=0) as inline, pytest.raises(
                AgentBadReply, match=f"{MAX_BATCH_BLOCKS + 1} blocks for {MAX_BATCH_BLOCKS}"):
            inline.load(5, hashes, size)  # (inline, the same)
        agent.set_mode("ok")
        assert client.load_in_place(5, hashes, size) == [size] * (count - 1)


def test_a_client_and_an_agent_of_different_protocols_refuse_each_other(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's upgrade row: a connector of another protocol is refused by the agent at Hello, an agent of
    another protocol by the connector, each with the versions in the message, and the refusal opens the
    client's circuit (no call until a probe's Hello is accepted); the agent keeps serving clients of its own."""
    from agent.breaker import AgentCircuit
    from agent.protocol import PROTOCOL_VERSION
    from tests.faulty_agent import FaultyAgentProcess

    agent = FaultyAgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    with monkeypatch.context() as patch:  # a connector one protocol ahead
        patch.setattr("agent.client.PROTOCOL_VERSION", PROTOCOL_VERSION + 1)
        with pytest.raises(AgentRefused, match=f"speaks protocol {PROTOCOL_VERSION + 1}, this tier agent "
                                               f"{PROTOCOL_VERSION}: upgrade both"):
            AgentClient(agent.socket, shm_bytes=0, name="connector-of-tomorrow").connect()
    assert "client refused at hello" in agent.log_path.read_text()
    agent.set_mode("protocol")  # an agent one protocol ahead
    circuit = AgentCircuit(lambda: AgentClient(agent.socket, shm_bytes=0).connect(), probe_interval_s=0.2)
    client = AgentClient(agent.socket, shm_bytes=0, circuit=circuit)
    with pytest.raises(AgentRefused, match=f"the tier agent speaks protocol {PROTOCOL_VERSION + 1}, this client "
                                           f"{PROTOCOL_VERSION}: upgrade both"):
        client.lookup(5, [1])
    assert circuit.is_open and circuit.trips == 1
    with pytest.raises(AgentError, match="not called until it does"):
        client.lookup(5, [1])  # at once, without asking
    time.sleep(1.0)
    assert circuit.is_open  # every probe refused too
    agent.set_mode("ok")  # the agent's protocol again
    deadline = time.monotonic() + 10
    while circuit.is_open:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert client.lookup(5, [1]) == (0, "")
    client.close()
    circuit.close()


def test_a_circuit_opened_while_the_agent_was_away_says_why_its_replacement_refuses(
        tmp_path: Path, agents: list[AgentProcess], subprocess_env: dict[str, str],
        caplog: pytest.LogCaptureFixture) -> None:
    """The agent is away (the circuit opens: nobody at the socket), then an agent of the next protocol takes the
    socket and refuses every probe at Hello. Before, the probe's refusals were silent and the trip had said only
    that the socket was gone, so the log never said why the connector stayed without the agent (CI at 1fc34c0:
    the lifecycle test's upgrade step missed the "upgrade both" line when a call met the empty socket first)."""
    from agent.breaker import AgentCircuit
    from agent.protocol import PROTOCOL_VERSION
    from tests.faulty_agent import FaultyAgentProcess

    agent = FaultyAgentProcess(tmp_path / "newer", subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    agent.set_mode("protocol")
    socket = tmp_path / "agent.sock"  # where the connector looks: empty until the newer agent takes it
    circuit = AgentCircuit(lambda: AgentClient(str(socket), shm_bytes=0).connect(), probe_interval_s=0.1)
    client = AgentClient(str(socket), shm_bytes=0, circuit=circuit)
    with caplog.at_level("WARNING", logger="vllm.kvgate_connector"):
        with pytest.raises(AgentError, match="cannot reach the tier agent"):
            client.lookup(5, [1])
        assert circuit.is_open and "FileNotFoundError" in caplog.text
        socket.symlink_to(agent.socket)  # the newer agent takes the socket
        deadline = time.monotonic() + 10
        while "refuses this client" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.05)
        time.sleep(0.5)  # five probes more, all refused: said once
        assert caplog.text.count("refuses this client") == 1
        assert (f"the tier agent speaks protocol {PROTOCOL_VERSION + 1}, this client {PROTOCOL_VERSION}: upgrade "
                "both") in caplog.text
        assert circuit.is_open
        agent.set_mode("ok")
        while circuit.is_open:
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
    assert client.lookup(5, [1]) == (0, "")
    client.close()
    circuit.close()


# what each wrong answer must come to: (mode, failure, blocks of the four asked for that still load whole)
FAULTS = [("short", "bad_reply", 0), ("foreign", "bad_reply", 3), ("extra", "bad_reply", 0),
          ("garbage", "agent_unavailable", 0), ("error", "agent_unavailable", 0),
          ("hang", "agent_unavailable", 0), ("close", "agent_unavailable", 0),
          ("hello_size", "agent_unavailable", 0), ("protocol", "agent_unavailable", 0),
          ("refuse", "agent_unavailable", 0)]
HELLO_FAULTS = ("hello_size", "protocol", "refuse")  # only a new connection meets them


def test_every_wrong_answer_becomes_a_counted_partial_load(tmp_path: Path, agents: list[AgentProcess],
                                                           probes: list[MoverProbe],
                                                           subprocess_env: dict[str, str]) -> None:
    from tests.faulty_agent import FaultyAgentProcess

    agent = FaultyAgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    probe = MoverProbe(agent.socket)
    probes.append(probe)
    hashes = [21, 22, 23, 24]
    assert probe("save", hashes=hashes, blocks=[10, 11, 12, 13]) == {"failure": None}
    expected: dict[str, int] = {}
    for mode, failure, whole in FAULTS:
        agent.set_mode(mode)
        if mode in HELLO_FAULTS:
            probe("view_outlives_close")  # the next call connects again, and meets this Hello
        got = probe("load", hashes=hashes, blocks=[0, 1, 2, 3])
        assert got == {"loaded": whole, "failure": failure, "correct": True}, mode
        expected[failure] = expected.get(failure, 0) + 1
        agent.set_mode("ok")
        assert probe("load", hashes=hashes, blocks=[4, 5, 6, 7]) == {"loaded": 4, "failure": None,
                                                                      "correct": True}, f"after {mode}"
    assert probe("counters") == {"load": expected, "save": {}}
    probe.close()  # exits 0: nothing raised out of the mover


def test_a_load_whose_later_batch_fails_keeps_the_batches_that_arrived(
        tmp_path: Path, agents: list[AgentProcess], probes: list[MoverProbe],
        subprocess_env: dict[str, str]) -> None:
    """A load of more blocks than the shared memory holds goes in batches; when a later batch fails (the agent hangs,
    closes the connection or refuses), the blocks of the batches before it are already in the cache, whole and
    verified: they count as loaded and only the rest is recomputed (vLLM is told the blocks from the first one
    not loaded on). Before, the retry on a fresh connection began again at the first block, and its failure
    reported none loaded: 12 blocks through 8 blocks of shared memory came back as 0 loaded, not 8."""
    from tests.faulty_agent import FaultyAgentProcess

    agent = FaultyAgentProcess(tmp_path, subprocess_env, "--dram-capacity", "1MiB")
    agents.append(agent)
    probe = MoverProbe(agent.socket)  # 8 blocks of shared memory
    probes.append(probe)
    hashes = list(range(31, 43))
    assert probe("save", hashes=hashes, blocks=list(range(12))) == {"failure": None}
    for mode in ("hang_after_one", "close_after_one", "error_after_one"):
        agent.set_mode(mode)
        assert probe("load", hashes=hashes, blocks=list(range(16, 28))) == {
            "loaded": 8, "failure": "agent_unavailable", "correct": True}, mode
        agent.set_mode("ok")
        assert probe("load", hashes=hashes, blocks=list(range(16, 28))) == {
            "loaded": 12, "failure": None, "correct": True}, f"after {mode}"
    assert probe("counters") == {"load": {"agent_unavailable": 3}, "save": {}}
    probe.close()


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_vllm_meets_every_wrong_answer_recomputes_and_counts_it(weighted_model: Path, tmp_path: Path,
                                                                 agents: list[AgentProcess],
                                                                 subprocess_env: dict[str, str]) -> None:
    """One real vLLM on the faulty agent, one fault after another: no crash, no failed request, the output of
    recomputation every time, each failure counted by reason on vLLM's /metrics, and loading whole again after
    each fault. An agent of another protocol (an upgrade of one side) is refused with both versions in vLLM's log.

    What vLLM reports as `cached_tokens` for a request whose (asynchronous, the default) load failed: 0 when none of
    its blocks loaded (vLLM admits it again and the connector offers nothing more for it), the tokens promised when
    a leading part loaded (vLLM 0.32 records a hit at the request's first scheduling and does not revise it; with
    synchronous loads that was the case for every failed load)."""
    from tests.faulty_agent import FaultyAgentProcess
    from tests.vllm_replica import (
        Completion,
        complete,
        connector_failures,
        loadable_tokens,
        reset_prefix_cache,
        start_vllm,
    )

    agent = FaultyAgentProcess(tmp_path / "agent", subprocess_env, "--block-size", "32")
    agents.append(agent)
    server = start_vllm(weighted_model, tmp_path / "logs", agent.socket, connector_extra={"timeout_s": 1.0})
    prompt = " ".join(f"fault{i} x" for i in range(40))

    def dram_hits() -> float:
        try:
            return agent.metric("kvgate_agent_hits_total", tier="dram")
        except KeyError:
            return 0.0

    def ask() -> Completion:
        reset_prefix_cache(server)
        got = complete(server, prompt)
        assert got.output == reference.output
        assert server.proc.poll() is None, server.log_tail(8000)
        return got

    def recover() -> None:
        """Back to loading whole (after a hang or a refused connection the client's circuit breaker stays open
        until its probe hears the agent again, up to probe_interval_s)."""
        agent.set_mode("ok")
        deadline = time.monotonic() + 20
        while True:
            hits = dram_hits()
            got = ask()
            if dram_hits() == hits + loadable_tokens(got.prompt_tokens) // 32:
                return
            assert time.monotonic() < deadline, "the connector did not load again after the fault"
            time.sleep(0.5)

    try:
        reference = complete(server, prompt)  # computed, saved
        assert reference.cached == 0
        recover()
        seen: set[str] = set()
        cached: dict[str, tuple[int, int]] = {}  # mode -> (cached_tokens reported, tokens expected)
        for mode, failure, whole in FAULTS:
            if mode in HELLO_FAULTS:  # only a new connection meets Hello: make the worker reconnect
                agent.set_mode("close")
                ask()
            agent.set_mode(mode)
            before = connector_failures(server, "load", failure)
            got = ask()  # the fault: recomputed, the same output
            cached[mode] = (got.cached, loadable_tokens(got.prompt_tokens) if whole else 0)
            assert connector_failures(server, "load", failure) > before, mode  # counted on vLLM's /metrics
            if mode == "protocol":
                assert "refused at Hello: the tier agent speaks protocol 3, this client 2: upgrade both" \
                    in server.log_tail(2_000_000)
            if mode == "refuse":
                assert "speaks protocol 2, this tier agent 3: upgrade both" in server.log_tail(2_000_000)
            seen.add(failure)
            recover()
        assert seen == {"bad_reply", "agent_unavailable"}
        assert "could not be loaded (bad_reply); vLLM recomputes them" in server.log_tail(2_000_000)
        # nothing loaded: 0 cached tokens; a leading part loaded: what was promised at the first scheduling
        assert all(reported == expected for reported, expected in cached.values()), cached
    finally:
        server.stop()
