"""`kvgate serve --processes N`: N gateway processes on one port, so a gateway uses N cores.

Each process is a whole gateway — its own pool, health probes, KV-event subscriptions, block index, prefix trie and
token cache — listening on the same address with SO_REUSEPORT: the kernel spreads new connections over them (a
keep-alive connection stays with the process that accepted it). They share the prefill turns and what they route:

- every process sees every KV event (the `kv` index is the same everywhere), and each tells the others where it
  routed each request, its first token and its end (router/sibling_routes.py), so every process's prefix trie and
  in-flight view are the whole gateway's; what each learns from its answers (rates, timings) is its own;
- `/metrics` on the shared port answers for all of them: the process that takes the scrape asks its siblings for
  theirs over Unix sockets and every sample carries a `process` label;
- long prefills take their turns (router/prefill_turns.py) at process 0, which keeps them for all over a Unix socket
  (router/turn_broker.py), so the processes together send an engine one at a time as one process would; a process
  that cannot reach it takes turns of its own meanwhile;
- the pool is fixed: adding or removing workers at run time (`/admin/workers`) answers 409, as each process would
  otherwise have its own list; workers come from `--worker` or discovery, which every process follows.

The parent process only starts the children and stops them on SIGINT/SIGTERM; when one exits on its own the others
are stopped too, and the parent exits with an error (a supervisor restarts the whole gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from router.listener import SHUTDOWN_S

log = logging.getLogger(__name__)

# children get this long to finish after SIGTERM, then are killed: longer than each one's own wait for the answers
# under way (it was 30 s, which cut streams that one process would have let finish)
STOP_TIMEOUT_S = SHUTDOWN_S + 10.0


@dataclass(frozen=True)
class GatewayProcess:
    """Which of the gateway's processes this one is, and where each serves its own metrics."""

    index: int
    count: int
    sockets: str  # a directory holding metrics-<index>.sock and routes-<index>.sock per process, process 0's turns.sock

    def metrics_socket(self, index: int) -> str:
        return os.path.join(self.sockets, f"metrics-{index}.sock")

    def routes_socket(self, index: int) -> str:
        """Where process `index` hears the routes of its siblings (router/sibling_routes.py)."""
        return os.path.join(self.sockets, f"routes-{index}.sock")

    @property
    def turns_socket(self) -> str:
        """Where process 0 keeps the gateway's prefill turns for all (router/turn_broker.py)."""
        return os.path.join(self.sockets, "turns.sock")

    async def sibling_metrics(self, own: bytes, timeout: float = 2.0) -> bytes:
        """Every process's metrics as one exposition: `own` and the siblings', each sample labelled with its
        process. A sibling that does not answer in time is left out (and said so in a comment)."""

        async def fetch(index: int) -> bytes | None:
            connector = aiohttp.UnixConnector(path=self.metrics_socket(index))
            try:
                async with aiohttp.ClientSession(connector=connector) as session, session.get(
                        "http://gateway/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                    return await resp.read()
            except (aiohttp.ClientError, TimeoutError, OSError):
                return None

        others = await asyncio.gather(*(fetch(i) for i in range(self.count) if i != self.index))
        texts = {self.index: own}
        missing = []
        for index, text in zip((i for i in range(self.count) if i != self.index), others, strict=True):
            if text is None:
                missing.append(index)
            else:
                texts[index] = text
        merged = merge_expositions(texts)
        if missing:
            merged += f"# processes not answering: {', '.join(map(str, missing))}\n".encode()
        return merged


def _labelled(line: str, process: int) -> str:
    """A sample line with `process="N"` added to its labels."""
    name_end = len(line)
    for i, c in enumerate(line):
        if c in "{ ":
            name_end = i
            break
    if line[name_end:name_end + 1] == "{":
        rest = line[name_end + 1:]
        return f'{line[:name_end]}{{process="{process}"{"," if not rest.startswith("}") else ""}{rest}'
    return f'{line[:name_end]}{{process="{process}"}}{line[name_end:]}'


def _families(text: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """(name, comment lines, sample lines) per metric family of a Prometheus text exposition."""
    name = ""
    comments: list[str] = []
    samples: list[str] = []
    for line in text.splitlines():
        if line.startswith(("# HELP ", "# TYPE ")):
            family = line.split(" ", 3)[2]
            if family != name:
                if comments or samples:
                    yield name, comments, samples
                name, comments, samples = family, [], []
            comments.append(line)
        elif line.startswith("#"):
            comments.append(line)
        elif line:
            samples.append(line)
    if comments or samples:
        yield name, comments, samples


def merge_expositions(texts: dict[int, bytes]) -> bytes:
    """One exposition from several processes': each family once, with every process's samples labelled."""
    order: list[str] = []
    comments: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for process, raw in sorted(texts.items()):
        for name, head, lines in _families(raw.decode()):
            if name not in comments:
                order.append(name)
                comments[name] = head
                samples[name] = []
            samples[name] += [_labelled(line, process) for line in lines]
    out: list[str] = []
    for name in order:
        out += comments[name]
        out += samples[name]
    return ("\n".join(out) + "\n").encode()


def serve_processes(config: Any, options: Any, target: Callable[[Any, Any, GatewayProcess], None]) -> int:
    """Run `config.processes` gateway processes, each `target(config, options, process)` (a module-level function:
    children are spawned), until SIGINT/SIGTERM (0) or until one exits by itself (1)."""
    context = multiprocessing.get_context("spawn")  # no state of this process (threads, loops) in the children
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with tempfile.TemporaryDirectory(prefix="kvgate-") as sockets:
        children = [context.Process(target=target, name=f"kvgate-{i}",
                                    args=(config, options, GatewayProcess(i, config.processes, sockets)))
                    for i in range(config.processes)]
        for child in children:
            child.start()
        log.info("kvgate: %d gateway processes on port %d (pids %s)", len(children), config.port,
                 " ".join(str(c.pid) for c in children))
        while not stopping and all(c.is_alive() for c in children):
            time.sleep(0.2)
        failed = not stopping
        if failed:
            gone = [c for c in children if not c.is_alive()]
            log.error("kvgate: gateway process %s exited (%s); stopping the others",
                      ", ".join(c.name for c in gone), ", ".join(str(c.exitcode) for c in gone))
        for child in children:
            if child.is_alive() and child.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            child.join(max(0.0, deadline - time.monotonic()))
            if child.is_alive():
                child.kill()
                child.join()
        for path in Path(sockets).glob("*.sock"):
            path.unlink(missing_ok=True)
    return 1 if failed else 0
