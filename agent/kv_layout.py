"""Whole KV blocks between vLLM's paged cache tensors and flat rows of bytes (torch only, no vLLM).

Each layer's cache tensor has one dimension of size `num_blocks`: the first on vLLM's CPU backend
(`[num_blocks, kv_heads, block_size, 2*head_dim]`), the second for GPU flash attention
(`[2, num_blocks, block_size, kv_heads, head_dim]`). A block's bytes are the concatenation, layer by layer, of
that layer's slice at the block index, so one row of `block_bytes` holds a whole block.

`BlockCopier` moves batches of blocks. Caches on an accelerator go through one contiguous staging buffer on their
device: every layer's blocks are gathered there by device-side copies, then a single copy moves the whole batch
to the host rows (one DMA when the rows are pinned, as the agent's shared memory is), and loads the reverse --
instead of one small strided device<->host copy per layer (what `bench/gpu_copy.py` measures). Caches in host
memory are copied straight into the rows, which already are one contiguous buffer in plain memory: a staging
buffer there would only add a copy. A run of consecutive block ids (vLLM hands out a request's blocks mostly so) is
one slice of each layer and is copied as such; only scattered ids are gathered by index first (a second pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

STAGING_BYTES = 32 * 2**20  # device memory taken for the staging buffer (at least one block)


@dataclass
class CacheLayer:
    name: str
    tensor: torch.Tensor
    block_dim: int
    block_shape: tuple[int, ...]
    block_bytes: int


def describe_layers(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> list[CacheLayer]:
    layers = []
    for name, tensor in kv_caches.items():
        if tensor.shape[0] == num_blocks:
            block_dim = 0
        elif tensor.dim() > 1 and tensor.shape[1] == num_blocks:
            block_dim = 1
        else:
            raise ValueError(f"cannot find the block dimension of {name} {tuple(tensor.shape)} "
                             f"({num_blocks} blocks)")
        shape = tuple(s for d, s in enumerate(tensor.shape) if d != block_dim)
        layers.append(CacheLayer(name, tensor, block_dim, shape,
                                 tensor.numel() // num_blocks * tensor.element_size()))
    return layers


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """`(row, first block id, length)` of each run of consecutive block ids: vLLM hands out a request's blocks
    mostly in runs, and a run is one slice of each layer, copied without gathering it first."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            runs.append((start, block_ids[start], i - start))
            start = i
    return runs


# at most this many runs per block are copied run by run; more scattered ids are gathered with one index per layer
# (a copy per run costs more than the gather's extra pass once runs are short)
RUN_COPY_MAX_FRACTION = 0.25


def _layer_rows(layer: CacheLayer, rows: torch.Tensor, offset: int) -> torch.Tensor:
    """`rows`' columns of this layer, typed and shaped as the layer's blocks: `[n, *block_shape]`."""
    n = rows.shape[0]
    return rows[:, offset: offset + layer.block_bytes].view(layer.tensor.dtype).view(n, *layer.block_shape)


def _by_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]] | None:
    runs = block_runs(block_ids)
    return runs if len(runs) <= max(1, int(len(block_ids) * RUN_COPY_MAX_FRACTION)) else None


def gather_blocks(layers: list[CacheLayer], block_ids: Sequence[int], rows: torch.Tensor) -> None:
    """Copy blocks out of the caches into `rows` (uint8, `[len(block_ids), block_bytes]`): per layer, one copy
    per run of consecutive ids straight into the rows, or (ids too scattered) one gather and one copy."""
    n = len(block_ids)
    runs = _by_runs(block_ids)
    offset = 0
    indexes: dict[torch.device, torch.Tensor] = {}
    for layer in layers:
        device = layer.tensor.device
        # device-side (staging) copies are stream-ordered; a copy to the host returns once it is done
        non_blocking = rows.device == device
        if runs is not None:
            out = _layer_rows(layer, rows, offset)
            for row, first, length in runs:
                src = layer.tensor.narrow(layer.block_dim, first, length)
                if layer.block_dim != 0:
                    src = src.movedim(layer.block_dim, 0)
                out[row: row + length].copy_(src, non_blocking=non_blocking)
            offset += layer.block_bytes
            continue
        if device not in indexes:
            indexes[device] = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        src = layer.tensor.index_select(layer.block_dim, indexes[device])
        if layer.block_dim != 0:
            src = src.movedim(layer.block_dim, 0)
        rows[:, offset: offset + layer.block_bytes].copy_(src.reshape(n, -1).view(torch.uint8),
                                                          non_blocking=non_blocking)
        offset += layer.block_bytes


def scatter_blocks(layers: list[CacheLayer], block_ids: Sequence[int], rows: torch.Tensor) -> None:
    """Copy `rows` (as written by `gather_blocks`) into the caches at these block ids: per layer, one copy per
    run of consecutive ids, or (ids too scattered) one indexed copy."""
    runs = _by_runs(block_ids)
    offset = 0
    indexes: dict[torch.device, torch.Tensor] = {}
    for layer in layers:
        device = layer.tensor.device
        non_blocking = rows.device == device
        src = _layer_rows(layer, rows, offset)
        if runs is not None:
            for row, first, length in runs:
                dst = layer.tensor.narrow(layer.block_dim, first, length)
                if layer.block_dim != 0:
                    dst = dst.movedim(layer.block_dim, 0)
                dst.copy_(src[row: row + length], non_blocking=non_blocking)
            offset += layer.block_bytes
            continue
        if device not in indexes:
            indexes[device] = torch.tensor(list(block_ids), dtype=torch.long, device=device)
        if layer.block_dim != 0:
            src = src.movedim(0, layer.block_dim)
        src = src.to(device, non_blocking=non_blocking)
        layer.tensor.index_copy_(layer.block_dim, indexes[device], src)
        offset += layer.block_bytes


class BlockCopier:
    """Batches of whole blocks between the caches and host rows; through one contiguous staging buffer on the
    caches' device when they are not in host memory (or when `staged` says so: tests run that path on CPU).
    Every call returns once its copies are complete (the caller hands the rows to the agent right after), on the
    current stream: a transfer thread runs it on its own."""

    def __init__(self, layers: list[CacheLayer], staging_bytes: int = STAGING_BYTES,
                 staged: bool | None = None) -> None:
        self.layers = layers
        self.block_bytes = sum(layer.block_bytes for layer in layers)
        devices = {layer.tensor.device for layer in layers}
        self.device = next(iter(devices)) if len(devices) == 1 else torch.device("cpu")
        if staged is None:
            staged = len(devices) == 1 and self.device.type != "cpu"
        self.staging: torch.Tensor | None = None
        if staged and self.block_bytes:
            blocks = max(1, staging_bytes // self.block_bytes)
            self.staging = torch.empty((blocks, self.block_bytes), dtype=torch.uint8, device=self.device)

    @property
    def staged(self) -> bool:
        return self.staging is not None

    def gather(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Blocks out of the caches into `rows` (`[len(block_ids), block_bytes]` uint8, host memory)."""
        if self.staging is None:
            gather_blocks(self.layers, block_ids, rows)
        else:
            step = self.staging.shape[0]
            for i in range(0, len(block_ids), step):
                ids = block_ids[i: i + step]
                staging = self.staging[: len(ids)]
                gather_blocks(self.layers, ids, staging)  # device-side copies into one contiguous buffer
                rows[i: i + len(ids)].copy_(staging, non_blocking=True)  # one DMA for the whole batch
        self._sync()

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """`rows` (as written by `gather`) into the caches at these block ids."""
        if self.staging is None:
            scatter_blocks(self.layers, block_ids, rows)
        else:
            step = self.staging.shape[0]
            for i in range(0, len(block_ids), step):
                ids = block_ids[i: i + step]
                staging = self.staging[: len(ids)]
                staging.copy_(rows[i: i + len(ids)], non_blocking=True)  # one DMA for the whole batch
                scatter_blocks(self.layers, ids, staging)  # device-side copies out of it
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
