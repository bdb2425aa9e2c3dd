"""Long prompts encoded in child processes, so that their tokenizing never holds the gateway's GIL.

A cold 32,000-character prompt costs the gateway milliseconds of Python (the word cache, router/word_encoder.py) or
of a tokenizer call that gives the GIL back only between its parts; in a thread, that work shares the interpreter
lock with the event loop, which then answers nothing (`/health` included) until it gets the lock back (issue 18:
`/health` stalled 10-67 ms). So texts of `PROCESS_CHARS` or more are encoded by `ModelTokenizer` in one of a few
child processes (`python -m router.tokenizer_processes`), each with its own interpreter and its own copy of the
same tokenizer, through the same code (`ModelTokenizer._encode_ids`), so the ids are the ones the thread would
have given. The calling thread (one of the gateway's tokenizer threads) only writes the text to a pipe and waits
for the ids, without the GIL.

The children run at a lower CPU priority than the gateway (`nice`, 10 more by default): on a machine with fewer
idle cores than runnable tasks, a child encoding a long prompt would otherwise take a core from the event loop for
its whole time slice, and `/health` and every short request wait meanwhile (issue 18). The loop's latency matters
more than a long prompt's: the children still get the cores the loop leaves (a niced task is not starved, only
preempted sooner), and their deadline below bounds what a call waits in any case.

A child that dies is replaced by the next call that finds it dead; a call that has no answer within `timeout_s`
(waiting for a free child included) kills its child, starts another, and fails with `TokenizerUnavailable`; the
gateway then routes that request by its text (router/prompt_tokens.py: the engine tokenizes it anyway, so a hung
child costs the request its routing, not its answer), counted in `kvgate_tokenize_fallbacks_total`, the replacements
in `kvgate_tokenizer_process_restarts_total`. A child still starting (importing, loading its tokenizers: seconds at
a low priority on a busy machine) is not hung: a call that times out waiting for it fails the same way but leaves it
to finish, for `startup_s` from its start; only then is it killed. (Killing it made each replacement start from
nothing, and under enough load none would ever finish.) A tokenizer first asked for is loaded by the children
that start later too, before they answer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from array import array
from pathlib import Path
from typing import IO

from router.errors import GatewayError
from router.tokenizer import ModelTokenizer, TokenizationError

log = logging.getLogger(__name__)

# Texts at least this long are encoded in a child. The round trip costs the calling thread 26-55 us of CPU at
# 4,096-32,768 characters (the pipe's writes and reads, the ids' array), against 118-789 us of encoding there with
# the word cache warm, and adds 35-90 us of wall time (the tiny model, in process, 4 December: docs/overhead.md).
# Below it a text stays on its thread, which then holds the GIL at most about 0.2 ms for it, and issue 18's
# 4,000-character prompts pay no hop and no second process's CPU.
PROCESS_CHARS = 8192
NICE = 10  # added to the gateway's niceness for its children (capped at 19, the lowest priority)
TIMEOUT_S = 10.0  # longest a call may wait for a free child and its answer (a child loads each tokenizer once)
STARTUP_S = 60.0  # longest a child may take to start and load its tokenizers before it counts as hung
_HEAD = struct.Struct(">cI")  # status, payload length
_REQUEST = struct.Struct(">IIB")  # directory length, text length (bytes), add_special_tokens
OK, FAILED, READY = b"T", b"E", b"R"
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)  # where this `router` is: the children import it too


class TokenizerUnavailable(GatewayError):
    """No tokenizer process answered in time (busy, hung or unable to start): the request cannot be routed."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, type="service_unavailable", code="tokenizer_unavailable",
                         headers={"Retry-After": "1"})


class _ChildDied(Exception):
    """The child's pipe closed: it exited (killed, crashed, or never started)."""


class _Child:
    """One tokenizer process and its pipes (non-blocking, so every wait on it has a deadline)."""

    def __init__(self, directories: list[str], nice: int) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (_PACKAGE_ROOT, env.get("PYTHONPATH"))))
        self.proc = subprocess.Popen([sys.executable, "-m", "router.tokenizer_processes", *directories],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, env=env)
        if nice > 0:  # set from here once it runs (a preexec_fn is unsafe with threads): its imports are niced too
            with contextlib.suppress(ProcessLookupError):
                priority = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
                os.setpriority(os.PRIO_PROCESS, self.proc.pid, priority)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in: IO[bytes] = self.proc.stdin
        self._out: IO[bytes] = self.proc.stdout
        os.set_blocking(self._in.fileno(), False)
        os.set_blocking(self._out.fileno(), False)
        self.ready = False  # it announced that it started and loaded its tokenizers
        self.started = time.monotonic()
        self._buffer = bytearray()

    def exchange(self, request: bytes, deadline: float) -> tuple[bytes, bytes]:
        """Send `request`, wait for the answer's status and payload; TimeoutError past `deadline`."""
        if not self.ready:
            status, _ = self._answer(deadline)
            if status != READY:
                raise _ChildDied(f"the tokenizer process announced {status!r}")
            self.ready = True
        fd, view = self._in.fileno(), memoryview(request)
        while view:
            self._wait(fd, select.POLLOUT, deadline)
            try:
                view = view[os.write(fd, view):]
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError) as exc:
                raise _ChildDied("the tokenizer process closed its input") from exc
        return self._answer(deadline)

    def _answer(self, deadline: float) -> tuple[bytes, bytes]:
        buffer, fd = self._buffer, self._out.fileno()
        need = _HEAD.size
        while True:
            if len(buffer) >= _HEAD.size:
                need = _HEAD.size + _HEAD.unpack_from(buffer)[1]
                if len(buffer) >= need:
                    status = bytes(buffer[:1])
                    payload = bytes(buffer[_HEAD.size:need])
                    del buffer[:need]
                    return status, payload
            self._wait(fd, select.POLLIN, deadline)
            try:
                chunk = os.read(fd, max(need - len(buffer), 65536))
            except BlockingIOError:
                continue
            if not chunk:
                raise _ChildDied(f"the tokenizer process exited ({self.proc.poll()})")
            buffer += chunk

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        poller = select.poll()
        poller.register(fd, event)
        if not poller.poll(left * 1000 + 1):
            raise TimeoutError

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        self._in.close()
        self._out.close()


class TokenizerProcesses:
    """A bounded pool of tokenizer processes, called from the gateway's tokenizer threads (thread-safe, blocking):
    a `LongTextEncoder` for `ModelTokenizer`."""

    min_chars = PROCESS_CHARS

    def __init__(self, processes: int, timeout_s: float = TIMEOUT_S, nice: int = NICE,
                 startup_s: float = STARTUP_S) -> None:
        self.processes = max(1, processes)
        self.timeout_s = timeout_s
        self.startup_s = startup_s
        self.nice = nice  # added to this process's niceness for the children
        self._directories: list[str] = []  # loaded by children when they start
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._children: set[_Child] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._started = False
        self.restarts = 0

    def start(self, directories: list[str]) -> None:
        """Start the processes, each loading the tokenizers in `directories` before it answers (others are
        loaded when first asked for). The first `encode` starts them if nobody did."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self._directories = list(directories)
        for _ in range(self.processes):
            self._add_child()

    def _add_child(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                child = _Child(self._directories, self.nice)
            except OSError as exc:
                log.error("cannot start a tokenizer process: %s", exc)
                return
            self._children.add(child)
        self._idle.put(child)

    def _replace(self, child: _Child) -> None:
        with self._lock:
            self._children.discard(child)
        child.kill()
        self.restarts += 1
        self._add_child()

    def encode(self, directory: str, text: str, add_special_tokens: bool) -> array[int]:
        """`ModelTokenizer(directory)._encode_ids(text, add_special_tokens)`, computed in a child. Raises
        TokenizerUnavailable when no child answers within `timeout_s`."""
        data = text.encode("utf-8", "surrogatepass")
        name = directory.encode()
        request = b"".join((_REQUEST.pack(len(name), len(data), add_special_tokens), name, data))
        deadline = time.monotonic() + self.timeout_s
        if not self._started:
            self.start([directory])
        elif directory not in self._directories:
            with self._lock:  # children started from now on load it before they answer
                if directory not in self._directories:
                    self._directories.append(directory)
        died = ""
        # a child found dead is replaced and the text tried on another, within the deadline: every child may have
        # died since the last call (one more try: a replacement that dies too cannot be started)
        for _ in range(self.processes + 1):
            if self._closed:  # no child will come back to the queue
                raise TokenizerUnavailable("the gateway is stopping")
            try:
                child = self._idle.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TokenizerUnavailable(f"no tokenizer process free within {self.timeout_s:g} s"
                                           + (f" ({died})" if died else "")) from None
            try:
                status, payload = child.exchange(request, deadline)
            except TimeoutError:
                if not child.ready and time.monotonic() - child.started < self.startup_s:
                    self._idle.put(child)  # still starting, not hung: the next call waits on
                    raise TokenizerUnavailable(f"the tokenizer process is still starting after "
                                               f"{time.monotonic() - child.started:.1f} s") from None
                self._replace(child)
                raise TokenizerUnavailable(f"the tokenizer process gave no answer within {self.timeout_s:g} s "
                                           "(killed and replaced)") from None
            except _ChildDied as exc:
                died = str(exc)
                log.warning("%s; starting another", died)
                self._replace(child)
                continue
            self._idle.put(child)
            if status != OK:
                raise TokenizationError(payload.decode(errors="replace"))
            ids = array("I")
            ids.frombytes(payload)
            return ids
        raise TokenizerUnavailable(f"the tokenizer processes cannot encode: {died}")

    def pids(self) -> list[int]:
        with self._lock:
            return [child.proc.pid for child in self._children]

    def close(self) -> None:
        """Kill every child and wait for each (no process is left behind)."""
        with self._lock:
            self._closed = True
            children, self._children = list(self._children), set()
        for child in children:
            child.kill()


# --- the child process ------------------------------------------------------------------------------------------


def _read_exactly(stream: IO[bytes], size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def _write(stream: IO[bytes], status: bytes, payload: bytes) -> None:
    stream.write(_HEAD.pack(status, len(payload)))
    stream.write(payload)
    stream.flush()


def main(argv: list[str]) -> int:
    """Serve encode requests on stdin until it closes (the gateway stopped or went away)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the gateway's to handle; it then closes the pipe
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    tokenizers: dict[str, ModelTokenizer] = {}
    for directory in argv:
        tokenizers[directory] = ModelTokenizer(directory)
    _write(stdout, READY, b"")
    while (head := _read_exactly(stdin, _REQUEST.size)) is not None:
        name_size, text_size, add_special = _REQUEST.unpack(head)
        name, data = _read_exactly(stdin, name_size), _read_exactly(stdin, text_size)
        if name is None or data is None:
            return 0
        try:
            directory = name.decode()
            tokenizer = tokenizers.get(directory)
            if tokenizer is None:
                tokenizer = tokenizers[directory] = ModelTokenizer(directory)
            ids = tokenizer._encode_ids(data.decode("utf-8", "surrogatepass"), bool(add_special))
        except Exception as exc:  # the gateway's own thread would have raised it: report it there
            _write(stdout, FAILED, f"{type(exc).__name__}: {exc}"[:2000].encode("utf-8", "replace"))
            continue
        _write(stdout, OK, ids.tobytes())
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # the gateway went away mid-answer
        sys.exit(0)
