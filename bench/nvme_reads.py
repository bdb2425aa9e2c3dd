"""The NVMe segment tier's loads of long runs, side by side: one thread against the copy threads (or against the
segment tier of another git revision), in one process on the same records, rounds alternated.

`python -m bench.nvme_reads [--base REV] [--blocks 16,64,128] [--block-mib 2] [--threads 4] [--rounds 9]` stores
the largest run once (page cache warm, as a block written recently is), then reads runs of each size into an
anonymous shared mapping (the connection's shared memory stands in) with `read_many`, alternating the two ways
every round; one JSON line per size: the median seconds and GB/s of each, and their ratio. Without `--base` the
baseline is this tree's tier without a copier (all parts on the caller's thread); with it, REV's
`agent/tiers/segments.py` (loaded from git, the rest of the agent from this tree).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from agent.tiers.base import StoreItem
from agent.tiers.copies import ParallelCopier
from agent.tiers.segments import SegmentNvmeTier

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = 0x4E7E


def segments_of(rev: str, directory: Path) -> ModuleType:
    """REV's segment tier module (imports resolved against this tree)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:agent/tiers/segments.py"], check=True,
                            capture_output=True, text=True).stdout
    path = directory / "base_segments.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("base_segments", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help="git revision whose segment tier is the baseline (default: no copier)")
    parser.add_argument("--blocks", default="16,64,128", help="blocks per read_many")
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=4, help="the copier's threads (the agent's --copy-threads)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", help="where the segments go (default: a temporary directory)")
    args = parser.parse_args(argv)
    sizes = [int(x) for x in args.blocks.split(",") if x]
    size = int(args.block_mib * 2**20)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        copier = ParallelCopier(args.threads, "bench-nvme-read")
        tier = SegmentNvmeTier(root / "nvme", capacity=4 * max(sizes) * size + (1 << 30), fsync=False, min_free=0,
                               copier=copier)
        seed = os.urandom(size)
        n = max(sizes)
        if tier.store_many([StoreItem((LAYOUT, i), seed[i:] + seed[:i]) for i in range(n)]) != n:
            raise SystemExit("the tier did not take every block")
        if args.base:
            base_name = f"{args.base} (one thread)"
            base: Any = segments_of(args.base, root).SegmentNvmeTier(root / "nvme", capacity=tier.capacity,
                                                                     fsync=False, min_free=0)
        else:
            base_name = "no copier (one thread)"
            base = SegmentNvmeTier(root / "nvme", capacity=tier.capacity, fsync=False, min_free=0)
        shm = mmap.mmap(-1, n * size)
        shm.write(b"\x01" * len(shm))  # pages mapped before the first round, as a connection's memory is
        view = memoryview(shm)
        try:
            for count in sizes:
                keys = [(LAYOUT, i) for i in range(count)]
                outs = [view[i * size: (i + 1) * size] for i in range(count)]

                def load(t: Any, keys: list[tuple[int, int]] = keys, outs: list[memoryview] = outs) -> None:
                    if None in t.read_many(keys, outs):
                        raise SystemExit("a block was not served")

                ways: dict[str, Callable[[], None]] = {"base": lambda: load(base), "parts": lambda: load(tier)}
                times: dict[str, list[float]] = {name: [] for name in ways}
                for r in range(args.rounds + 1):  # round 0 warms up
                    for name, way in (ways.items() if r % 2 else reversed(ways.items())):
                        started = time.perf_counter()
                        way()
                        if r:
                            times[name].append(time.perf_counter() - started)
                gb = count * size / 1e9
                med = {name: statistics.median(t) for name, t in times.items()}
                print(json.dumps({"blocks": count, "block_bytes": size, "threads": args.threads, "base": base_name,
                                  "base_gb_per_s": round(gb / med["base"], 2),
                                  "parts_gb_per_s": round(gb / med["parts"], 2),
                                  "ratio": round(med["base"] / med["parts"], 2), "rounds": args.rounds}),
                      flush=True)
        finally:  # (the mapping goes with the process: views of it are still held here)
            base.close()
            tier.close()


if __name__ == "__main__":
    main()
