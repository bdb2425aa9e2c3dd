"""How fast KV blocks move between a paged GPU cache and host memory, against the raw pinned-memory limit (torch only).

Run with a Python that has torch (e.g. the vLLM venv): `python -m bench.gpu_copy [--layers 32 --blocks 64 ...]`.
One JSON line per measurement (median of `--repeat` runs, GB/s of block bytes moved), then a table. Each way
(save: cache -> host, load: host -> cache) is measured four ways, side by side in one run:

- `raw pinned`: one contiguous device buffer of the same size to / from pinned host memory (the DMA limit);
- `pinned staging`: what the connector does (`agent/kv_layout.py`, `BlockCopier`, the same object) -- gather every
  layer's blocks on the device into one contiguous device buffer (`index_select`, device-side), then one copy to
  pinned host memory (and the reverse for loads); the connector's transfer thread runs it off the engine's step;
- `per-layer pinned`: the connector before it, into pinned rows (as when the agent's shared memory is registered
  with `cudaHostRegister`): one strided copy per layer;
- `per-layer pageable`: the same into ordinary (pageable) host memory, which the driver bounces through its own
  pinned buffer.

The cache is GPU flash-attention's layout, `[2, num_blocks, block_size, kv_heads, head_dim]` per layer. Without
CUDA it says so and measures the CPU cache layout host to host (raw memcpy against the copier forced through a
staging buffer and the per-layer copies the connector uses on CPU), so the script and the staging path run
anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from agent.kv_layout import BlockCopier, CacheLayer, describe_layers, gather_blocks, scatter_blocks


class Pipelined:
    """An experiment: the copier's staging path with two staging buffers, the device-side gathers (or scatters) of
    one batch on the current stream while the other batch's copy to (or from) the host runs on a copy stream, so
    the copy engine and the kernel launches overlap instead of taking turns."""

    def __init__(self, layers: list[CacheLayer], blocks: int, device: torch.device) -> None:
        width = sum(layer.block_bytes for layer in layers)
        self.layers = layers
        self.buffers = [torch.empty((blocks, width), dtype=torch.uint8, device=device) for _ in range(2)]
        self.copies = torch.cuda.Stream(device)

    def _batches(self, ids: list[int]) -> list[tuple[int, list[int]]]:
        step = self.buffers[0].shape[0]
        return [(i, ids[i: i + step]) for i in range(0, len(ids), step)]

    def gather(self, ids: list[int], rows: torch.Tensor) -> None:
        compute = torch.cuda.current_stream()
        copied: list[torch.cuda.Event | None] = [None, None]
        for k, (i, batch) in enumerate(self._batches(ids)):
            buffer = self.buffers[k % 2][: len(batch)]
            if copied[k % 2] is not None:
                compute.wait_event(copied[k % 2])  # its last copy to the host has read it
            gather_blocks(self.layers, batch, buffer)
            self.copies.wait_stream(compute)
            with torch.cuda.stream(self.copies):
                rows[i: i + len(batch)].copy_(buffer, non_blocking=True)
                copied[k % 2] = torch.cuda.current_stream().record_event()
        self.copies.synchronize()

    def scatter(self, ids: list[int], rows: torch.Tensor) -> None:
        compute = torch.cuda.current_stream()
        scattered: list[torch.cuda.Event | None] = [None, None]
        for k, (i, batch) in enumerate(self._batches(ids)):
            buffer = self.buffers[k % 2][: len(batch)]
            if scattered[k % 2] is not None:
                self.copies.wait_event(scattered[k % 2])  # the scatter that last read this buffer is done
            with torch.cuda.stream(self.copies):
                buffer.copy_(rows[i: i + len(batch)], non_blocking=True)
                arrived = torch.cuda.current_stream().record_event()
            compute.wait_event(arrived)
            scatter_blocks(self.layers, batch, buffer)
            scattered[k % 2] = compute.record_event()
        compute.synchronize()


def timed(fn: Callable[[], None], sync: Callable[[], None], repeat: int) -> float:
    """Median seconds of `fn` (after one warm-up), synchronised before and after each run."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def add_cache_arguments(parser: argparse.ArgumentParser, num_blocks: int) -> None:
    """The paged cache's shape (Llama-3.1-8B's by default: 2 MiB a 16-token block) and the copier's staging."""
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--num-blocks", type=int, default=num_blocks, help="blocks in each cache")
    parser.add_argument("--staging-mib", type=int, default=32, help="the copier's device staging buffer")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_cache_arguments(parser, num_blocks=512)
    parser.add_argument("--blocks", type=int, default=64, help="blocks moved per batch")
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        print(f"# CUDA device: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
        shape: tuple[int, ...] = (2, args.num_blocks, args.block_size, args.kv_heads, args.head_dim)
        sync: Callable[[], None] = torch.cuda.synchronize
    else:
        print("# no CUDA device present: measuring the CPU cache layout host to host instead "
              f"(torch {torch.__version__})", flush=True)
        shape = (args.num_blocks, args.kv_heads, args.block_size, 2 * args.head_dim)
        sync = lambda: None  # noqa: E731
    gen = torch.Generator(device=device).manual_seed(0)
    caches = {f"layer{i}": torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)
              for i in range(args.layers)}
    layers = describe_layers(caches, args.num_blocks)
    block_bytes = sum(layer.block_bytes for layer in layers)
    n = args.blocks
    ids = torch.randperm(args.num_blocks, generator=torch.Generator().manual_seed(1))[:n].tolist()
    total = n * block_bytes

    pageable = torch.empty((n, block_bytes), dtype=torch.uint8)
    pinned = torch.empty((n, block_bytes), dtype=torch.uint8, pin_memory=cuda)
    device_flat = torch.empty((n, block_bytes), dtype=torch.uint8, device=device)

    # the connector's own copier (agent/kv_layout.py): device-side gathers into one contiguous staging buffer,
    # then one copy to the host rows; forced on for the CPU layout too, so the path runs anywhere
    copier = BlockCopier(layers, staging_bytes=args.staging_mib * 2**20, staged=True)

    ways: list[tuple[str, str, Callable[[], None]]] = [
        ("save", "raw pinned" if cuda else "raw memcpy", lambda: pinned.copy_(device_flat, non_blocking=True)),
        ("load", "raw pinned" if cuda else "raw memcpy", lambda: device_flat.copy_(pinned, non_blocking=True)),
    ]
    staged = "pinned staging" if cuda else "staging (forced)"
    ways += [("save", staged, lambda: copier.gather(ids, pinned)),
             ("load", staged, lambda: copier.scatter(ids, pinned))]
    if cuda:
        pipelined = Pipelined(layers, copier.staging.shape[0] if copier.staging is not None else 1, device)
        ways += [("save", "staging, pipelined", lambda: pipelined.gather(ids, pinned)),
                 ("load", "staging, pipelined", lambda: pipelined.scatter(ids, pinned))]
        ways += [("save", "per-layer pinned", lambda: gather_blocks(layers, ids, pinned)),
                 ("load", "per-layer pinned", lambda: scatter_blocks(layers, ids, pinned))]
    ways += [("save", "per-layer pageable", lambda: gather_blocks(layers, ids, pageable)),
             ("load", "per-layer pageable", lambda: scatter_blocks(layers, ids, pageable))]

    results = []
    for direction, way, fn in ways:
        seconds = timed(fn, sync, args.repeat)
        row = {"direction": direction, "way": way, "device": device.type, "blocks": n, "block_bytes": block_bytes,
               "layers": args.layers, "seconds": seconds, "gb_per_s": total / seconds / 1e9}
        results.append(row)
        print(json.dumps(row), flush=True)
    if cuda:  # the experiment moves the same bytes as the copier: its gather, and what its scatter wrote
        expected = torch.empty_like(pinned)
        copier.gather(ids, expected)
        pipelined.gather(ids, pinned)
        gathered = torch.equal(expected, pinned)
        written = torch.randint(0, 256, pinned.shape, dtype=torch.uint8).pin_memory()
        pipelined.scatter(ids, written)
        copier.gather(ids, expected)
        print(json.dumps({"check": "staging, pipelined", "gather_identical": gathered,
                          "scatter_identical": torch.equal(expected, written)}), flush=True)
    raw = {r["direction"]: r["gb_per_s"] for r in results if str(r["way"]).startswith("raw")}
    print(f"# {n} blocks of {block_bytes} bytes ({args.layers} layers), {total / 2**20:.1f} MiB per batch, "
          f"median of {args.repeat}")
    print(f"# {'direction':<9} {'way':<20} {'GB/s':>8} {'of raw':>7}")
    for r in results:
        share = float(r["gb_per_s"]) / raw[str(r["direction"])]
        print(f"# {r['direction']:<9} {r['way']:<20} {float(r['gb_per_s']):8.2f} {share:7.2f}")


if __name__ == "__main__":
    main()
