"""Chat templates written by clients, rendered where they cannot hurt the gateway.

A request may carry its own `chat_template`: Jinja code the gateway would have to run to learn the prompt's
tokens. Jinja's sandbox stops attribute tricks, but not a loop over `range(10**5)` nested three deep or
`"a" * 10**9`, and a thread running one cannot be stopped. So such templates are rendered in a few child
processes (`python -m router.template_sandbox`), each with an address-space limit, an output limit, a lower
CPU priority, and a deadline after which the parent kills it and starts another. The child reads the raw
request body and writes back the prompt text; the event loop only moves bytes through a socket (starting and
reaping the processes happens in threads).

A render that fails for any reason (template error, deadline, memory, no free child in time) leaves the request
to be routed in text mode: routing degrades, serving does not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import orjson

log = logging.getLogger(__name__)

_LENGTH = struct.Struct(">I")
OK, FAILED, READY = b"T", b"E", b"R"
STARTUP_TIMEOUT_S = 30.0


def sandbox_memory_bytes(max_body_bytes: int) -> int:
    """A sandbox process's address-space limit: the interpreter and Jinja (~40 MB), a parsed body of the largest
    size (a few times its bytes) and its rendering."""
    return 256 * 1024 * 1024 + 8 * max_body_bytes


class RenderFailed(Exception):
    """The template could not be rendered within its budget; `reason` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def _frame(*parts: bytes) -> bytes:
    return b"".join(_LENGTH.pack(len(p)) + p for p in parts)


class _Child:
    """One sandbox process and the loop's end of the socket that is its stdin and stdout."""

    def __init__(self, proc: subprocess.Popen[bytes], reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.proc = proc
        self.stdout = reader
        self.stdin = writer

    @classmethod
    async def start(cls, argv: list[str]) -> _Child:
        """Start `argv` off the loop: uvloop starts a child with fork(), which copies the gateway's page tables on
        the loop (80-190 ms for a few hundred MB on a loaded machine: every /health waited that long at each
        replacement), where subprocess.Popen uses vfork() in a thread."""
        ours, theirs = socket.socketpair()

        def popen() -> subprocess.Popen[bytes]:
            with theirs:  # the child has its own copies
                return subprocess.Popen(argv, stdin=theirs.fileno(), stdout=theirs.fileno())

        started = asyncio.ensure_future(asyncio.to_thread(popen))
        proc = None
        try:
            proc = await asyncio.shield(started)
            reader, writer = await asyncio.open_connection(sock=ours)
        except BaseException:  # cancelled (the gateway stops) or failed: nothing started is left running
            ours.close()
            if proc is None:
                with contextlib.suppress(Exception):
                    proc = await started  # the thread goes on starting it
            if proc is not None:
                proc.kill()
                await asyncio.to_thread(proc.wait)
            raise
        return cls(proc, reader, writer)

    async def read_part(self, limit: int) -> bytes:
        size = _LENGTH.unpack(await self.stdout.readexactly(_LENGTH.size))[0]
        if size > limit:
            raise RenderFailed("output", f"the sandbox answered {size} bytes, over the limit of {limit}")
        return await self.stdout.readexactly(size)

    async def kill(self) -> None:
        self.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        await asyncio.to_thread(self.proc.wait)  # SIGKILLed: at once


class TemplateSandbox:
    """A pool of sandbox processes rendering client templates under a deadline, a memory and an output limit."""

    def __init__(self, processes: int, timeout_s: float, memory_bytes: int, max_output_chars: int) -> None:
        self.processes = processes
        self.timeout_s = timeout_s
        self.memory_bytes = memory_bytes
        self.max_output_chars = max_output_chars
        self._idle: asyncio.Queue[_Child] = asyncio.Queue()
        self._children: set[_Child] = set()
        self._starting: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self) -> None:
        """Start the processes in the background; renders wait (bounded) for the first to be ready."""
        for _ in range(self.processes):
            self._spawn_soon()

    def _spawn_soon(self) -> None:
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._spawn(), name="template sandbox start")
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _spawn(self) -> None:
        try:
            child = await _Child.start([sys.executable, "-m", "router.template_sandbox", "--memory-bytes",
                                        str(self.memory_bytes), "--max-output-chars", str(self.max_output_chars)])
        except OSError as exc:
            log.error("cannot start a template sandbox process: %s", exc)
            return
        try:
            # ready once it has imported Jinja and capped itself, not when the process exists
            async with asyncio.timeout(STARTUP_TIMEOUT_S):
                ready = await child.read_part(8)
        except (TimeoutError, asyncio.IncompleteReadError, RenderFailed):
            ready = b""
        except asyncio.CancelledError:  # the gateway is stopping
            await child.kill()
            raise
        if ready != READY or self._closed:
            if not self._closed:
                log.error("a template sandbox process did not start; client templates route in text mode until "
                          "one does")
            await child.kill()
            return
        self._children.add(child)
        self._idle.put_nowait(child)

    async def render(self, renderer_state: Mapping[str, Any], body: bytes) -> str:
        """The prompt text of a chat request `body` (raw JSON) rendered with `renderer_state` (a ChatRenderer's),
        within `timeout_s` including the wait for a free process. Raises RenderFailed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                child = await self._idle.get()
        except TimeoutError:
            raise RenderFailed("busy", f"no template sandbox free within {self.timeout_s:g} s") from None
        reusable = False
        try:
            async with asyncio.timeout_at(deadline):
                child.stdin.write(_frame(orjson.dumps(renderer_state), body))
                await child.stdin.drain()
                status = await child.read_part(8)
                text = await child.read_part(4 * self.max_output_chars + 1024)
            if status == OK:
                reusable = True
                return text.decode()
            reason, _, detail = text.decode(errors="replace").partition(":")
            reusable = reason == "error"  # the client's template failed; the process is fine
            raise RenderFailed(reason, detail.strip())
        except TimeoutError:
            raise RenderFailed("timeout", f"the chat template ran past {self.timeout_s:g} s") from None
        except (asyncio.IncompleteReadError, ConnectionError):
            raise RenderFailed("crashed", "the template sandbox process died") from None
        finally:
            if reusable and child.proc.poll() is None:
                self._idle.put_nowait(child)
            else:  # overran, died or hit its memory limit: replace it
                self._children.discard(child)
                await child.kill()
                self._spawn_soon()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        children, self._children = list(self._children), set()
        await asyncio.gather(*(child.kill() for child in children), return_exceptions=True)


# --- the child process ------------------------------------------------------------------------------------------


def _limit_self(memory_bytes: int) -> None:
    """Cap this process's address space and lower its CPU priority, so a runaway render costs the gateway little."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    with contextlib.suppress(OSError):
        os.nice(10)


def _render_one(renderer_state: bytes, body: bytes, max_chars: int) -> tuple[bytes, bytes]:
    from router.tokenizer import ChatRenderer, TokenizationError

    try:
        renderer = ChatRenderer.from_state(orjson.loads(renderer_state))
        payload = orjson.loads(body)
        if not isinstance(payload, dict):
            raise TokenizationError("the body is not a JSON object")
        return OK, renderer.prompt_text(payload, max_chars=max_chars).encode("utf-8", "surrogatepass")
    except MemoryError:
        raise
    except RecursionError:
        return FAILED, b"error: the chat template nests too deep"
    except Exception as exc:  # any failure of client code is the client's: report it, keep serving
        return FAILED, f"error: {type(exc).__name__}: {exc}"[:2000].encode("utf-8", "replace")


def _read_part(stream: Any) -> bytes | None:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    size = _LENGTH.unpack(head)[0]
    data: bytes = stream.read(size)
    return data if len(data) == size else None


def main(argv: list[str] | None = None) -> int:
    try:
        return _serve(argv)
    except BrokenPipeError:  # the gateway went away
        return 0


def _serve(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="python -m router.template_sandbox")
    parser.add_argument("--memory-bytes", type=int, required=True)
    parser.add_argument("--max-output-chars", type=int, required=True)
    args = parser.parse_args(argv)
    import router.tokenizer  # noqa: F401 - import before the memory cap, which is for rendering

    _limit_self(args.memory_bytes)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    stdout.write(_frame(READY))
    stdout.flush()
    while True:
        state = _read_part(stdin)
        body = _read_part(stdin) if state is not None else None
        if state is None or body is None:
            return 0  # the gateway closed the pipe
        try:
            status, text = _render_one(state, body, args.max_output_chars)
        except MemoryError:
            status, text = FAILED, b"memory: the chat template ran out of its memory limit"
            stdout.write(_frame(status, text))
            stdout.flush()
            return 1  # a process that hit its memory limit is not trusted to go on; the gateway starts another
        stdout.write(_frame(status, text))
        stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
