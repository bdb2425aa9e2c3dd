"""The agent's bitmap of the blocks it may hold (agent/presence.py), read as the vLLM connector's scheduler reads it:
a real `kvgate agent` process, its socket and the file it publishes next to it."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

from agent.client import AgentClient
from agent.presence import PresenceMap, PresenceReader, presence_path
from tests.agent_process import AgentProcess

LAYOUT = 0x5EED


def test_a_stored_block_may_be_held_and_a_block_never_stored_is_not(tmp_path: Path,
                                                                     agents: list[AgentProcess],
                                                                     subprocess_env: dict[str, str]) -> None:
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB", "--nvme-dir", str(tmp_path / "nvme"),
                         "--write-policy", "eager")
    agents.append(agent)
    reader = PresenceReader(presence_path(agent.socket))
    rng = random.Random(7)
    stored = [rng.getrandbits(64) for _ in range(50)]
    never = [rng.getrandbits(64) for _ in range(2000)]
    assert not any(reader.may_hold(LAYOUT, h) for h in stored)  # an agent that holds nothing says so
    with AgentClient(agent.socket, shm_bytes=1 << 20) as client:
        assert client.store(LAYOUT, stored[:30], [bytes(100)] * 30) == 30  # through shared memory
    with AgentClient(agent.socket, shm_bytes=0) as client:
        assert client.store(LAYOUT, stored[30:], [bytes(100)] * 20, parent=stored[29]) == 20  # inline
    assert all(reader.may_hold(LAYOUT, h) for h in stored)
    assert not any(reader.may_hold(LAYOUT + 1, h) for h in stored)  # another layout: other blocks
    assert sum(reader.may_hold(LAYOUT, h) for h in never) <= 2  # 50 of 2**27 bits set
    # a restarted agent publishes a new map, from what it finds on its NVMe tier: the reader follows it
    agent.stop()
    assert not presence_path(agent.socket).exists()  # a stopped agent leaves no map that nobody updates
    assert reader.may_hold(LAYOUT, never[0])  # no map: ask the agent
    agent.start()
    assert all(reader.may_hold(LAYOUT, h) for h in stored)
    assert not reader.may_hold(LAYOUT, never[0])
    with AgentClient(agent.socket, shm_bytes=0) as client:
        client.store(LAYOUT, never[:1], [bytes(100)])
    assert reader.may_hold(LAYOUT, never[0])
    reader.close()


def test_an_agent_with_a_shared_tier_publishes_no_map(tmp_path: Path, agents: list[AgentProcess],
                                                      subprocess_env: dict[str, str]) -> None:
    """Other replicas put blocks into the shared tier that only the agent can be asked about; an older agent's map
    at the path is removed."""
    stale = PresenceMap(presence_path(tmp_path / "agent.sock"))
    agent = AgentProcess(tmp_path, subprocess_env, "--shared-backend", "fs", "--shared-dir", str(tmp_path / "shared"))
    agents.append(agent)
    assert not presence_path(agent.socket).exists()
    assert PresenceReader(presence_path(agent.socket)).may_hold(LAYOUT, 1)
    stale.close()


def test_a_killed_agents_map_is_replaced_by_its_successors(tmp_path: Path, agents: list[AgentProcess],
                                                          subprocess_env: dict[str, str]) -> None:
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB")
    agents.append(agent)
    reader = PresenceReader(presence_path(agent.socket))
    with AgentClient(agent.socket, shm_bytes=0) as client:
        client.store(LAYOUT, [11], [bytes(10)])
    assert reader.may_hold(LAYOUT, 11)
    assert agent.proc is not None
    os.kill(agent.proc.pid, signal.SIGKILL)
    agent.proc.wait()
    agent.start()  # DRAM only: it holds nothing now, and its map says so
    assert not reader.may_hold(LAYOUT, 11)
    reader.close()


def test_an_agent_that_cannot_write_the_map_serves_without_one(tmp_path: Path, agents: list[AgentProcess],
                                                              subprocess_env: dict[str, str]) -> None:
    """No file it writes may exceed 8 KiB (as on a full disk): before, the agent died at start (EFBIG on the map's
    16 MiB); now it publishes none and every lookup asks it."""
    agent = AgentProcess(tmp_path, subprocess_env, "--dram-capacity", "4MiB", file_size_limit=8192)
    agents.append(agent)
    assert not presence_path(agent.socket).exists()
    assert not list(tmp_path.glob(".*.tmp"))
    with AgentClient(agent.socket, shm_bytes=0) as client:
        assert client.store(LAYOUT, [5, 6], [bytes(100)] * 2) == 2
        assert client.lookup(LAYOUT, [5, 6]) == (2, "CC")
    assert PresenceReader(presence_path(agent.socket)).may_hold(LAYOUT, 99)


def test_the_map_is_readable_by_the_agents_users_only(tmp_path: Path, agents: list[AgentProcess],
                                                      subprocess_env: dict[str, str]) -> None:
    """Which blocks an agent holds says which prompts were seen: the bitmap is readable by whoever may use the
    agent's socket (its group by default), not by every local user."""
    old_umask = os.umask(0)  # the file's mode must not depend on the umask the agent is started with
    try:
        agent = AgentProcess(tmp_path / "default", subprocess_env, "--dram-capacity", "1MiB")
        agents.append(agent)
        assert oct(presence_path(agent.socket).stat().st_mode & 0o777) == "0o640"
        private = AgentProcess(tmp_path / "private", subprocess_env, "--dram-capacity", "1MiB",
                               "--socket-mode", "600")
        agents.append(private)
        assert oct(presence_path(private.socket).stat().st_mode & 0o777) == "0o600"
    finally:
        os.umask(old_umask)
