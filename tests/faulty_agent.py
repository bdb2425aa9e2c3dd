"""A real tier agent process that answers wrongly on purpose, for the connector's fault tests.

`python -m tests.faulty_agent MODE_FILE <kvgate agent flags>` runs the real `TierAgent` (real socket, shared
memory, tiers), except that before every request it reads a mode from MODE_FILE, so one engine can meet every fault
in turn without a restart:
  ok           answer correctly
  short        a load reports its first block one byte short
  foreign      a load reports its last block 16 bytes longer than the block size
  extra        a load reports one block more than was asked for
  garbage      a load is answered with a frame that is not a reply
  error        a load is answered with an error
  hang         a load is answered after 30 s (past any client timeout)
  close        the connection is closed instead of answering a load
  hello_size   Hello answers a shared-memory size other than the one mapped
  protocol     Hello answers as an agent of the next protocol version (an agent upgraded alone)
  refuse       Hello is refused as an agent of the next protocol refuses a client of this one (the connector
               left behind: the same refusal, seen from the connector)
  hang_after_one, close_after_one, error_after_one
               the first load after the mode was set is answered correctly, every later one as in `hang`, `close`,
               `error` (a load of more blocks than one batch: its first batch arrives, the next ones do not)
  extra_once   the first load after the mode was set is answered as in `extra`, every later one correctly (a load
               sent as several Loads: the first one's answer has a block too many, the next ones are right)
In the three Hello modes a load on a connection made before is closed too, so the client meets that Hello (an
asynchronous connector's saves may have kept a connection open).
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import sys
from pathlib import Path

from agent.cli import add_arguments
from agent.config import ENV_PREFIX, AgentConfig
from agent.protocol import ErrorReply, Hello, HelloReply, Load, LoadReply, Reply, Stats, request_decoder
from agent.server import Connection, TierAgent
from kvcore.aio import run_until_signalled
from kvcore.config import load_config
from tests.agent_process import AgentProcess

MODES = ("ok", "short", "foreign", "extra", "garbage", "error", "hang", "close", "hello_size", "protocol",
         "refuse", "hang_after_one", "close_after_one", "error_after_one", "extra_once")
HANG_S = 30.0


class FaultyTierAgent(TierAgent):
    def __init__(self, config: AgentConfig, mode_file: Path) -> None:
        super().__init__(config)
        self.mode_file = mode_file
        self._mode = "ok"
        self._loads_in_mode = 0  # loads answered since the mode was last set

    def mode(self) -> str:
        try:
            mode = self.mode_file.read_text().strip() or "ok"
        except FileNotFoundError:
            mode = "ok"
        if mode != self._mode:
            self._mode, self._loads_in_mode = mode, 0
        return mode

    async def _answer(self, conn: Connection, body: bytes | mmap.mmap, fds: list[int] | None = None) -> Reply:
        mode = self.mode()
        try:
            request = request_decoder.decode(body)
        except Exception:
            return await super()._answer(conn, body, fds)
        if isinstance(request, Hello) and mode == "refuse":
            return ErrorReply(message=f"ValueError: the client {request.client!r} speaks protocol {request.version}, "
                                      f"this tier agent {request.version + 1}: upgrade both")
        if isinstance(request, Load):
            self._loads_in_mode += 1
            if mode.endswith("_after_one"):
                mode = mode.removesuffix("_after_one") if self._loads_in_mode > 1 else "ok"
            elif mode.endswith("_once"):
                mode = mode.removesuffix("_once") if self._loads_in_mode == 1 else "ok"
            if mode == "hang":
                await asyncio.sleep(HANG_S)
            elif mode in ("close", "hello_size", "protocol", "refuse"):  # Hello faults: old connections say it again
                raise ConnectionResetError("faulty agent: closing instead of answering")
            elif mode == "garbage":
                return Stats()  # type: ignore[return-value]  # a request's frame: not a reply
            elif mode == "error":
                return ErrorReply(message="faulty agent: refused")
        reply = await super()._answer(conn, body, fds)
        if isinstance(reply, LoadReply) and reply.lengths:
            if mode == "short":
                reply.lengths[0] -= 1
            elif mode == "foreign":
                reply.lengths[-1] += 16
            elif mode == "extra":
                reply.lengths.append(reply.lengths[-1])
        if isinstance(request, Hello) and isinstance(reply, HelloReply):
            if mode == "hello_size":
                reply.shm_bytes += 4096
            elif mode == "protocol":
                reply.version += 1
        return reply


class FaultyAgentProcess(AgentProcess):
    """The faulty agent as a test process; `set_mode` takes effect from the next request on."""

    def __init__(self, tmp_path: Path, env: dict[str, str], *flags: str, socket: str | None = None) -> None:
        self.mode_file = tmp_path / "mode"
        self.mode_file.parent.mkdir(parents=True, exist_ok=True)
        self.mode_file.write_text("ok")  # until it is up: AgentProcess asks it, as a client of its protocol
        super().__init__(tmp_path, env, *flags, socket=socket,
                         command=[sys.executable, "-m", "tests.faulty_agent", str(self.mode_file), "agent"])

    def set_mode(self, mode: str) -> None:
        assert mode in MODES, mode
        self.mode_file.write_text(mode)


def main() -> None:
    mode_file = Path(sys.argv[1])
    parser = argparse.ArgumentParser(prog="faulty_agent")
    add_arguments(parser)
    args = parser.parse_args(sys.argv[3:])  # argv[2] is "agent", so the command line reads like kvgate's
    config = load_config(AgentConfig, ENV_PREFIX, args).validate()
    run_until_signalled(FaultyTierAgent(config, mode_file).serve_forever())


if __name__ == "__main__":
    main()
