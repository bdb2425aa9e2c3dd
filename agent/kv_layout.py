"""Whole KV blocks between vLLM's paged cache tensors and flat rows of bytes (torch only, no vLLM).

Each layer's cache tensor has one dimension of size `num_blocks`: the first on vLLM's CPU backend
(`[num_blocks, kv_heads, block_size, 2*head_dim]`), the second for GPU flash attention
(`[2, num_blocks, block_size, kv_heads, head_dim]`). A block's bytes are the concatenation, layer by layer, of
that layer's slice at the block index, so one row of `block_bytes` holds a whole block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


def gather_blocks(layers: list[CacheLayer], block_ids: list[int], rows: torch.Tensor) -> None:
    """Copy blocks out of the caches into `rows` (uint8, `[len(block_ids), block_bytes]`, host memory)."""
    n = len(block_ids)
    offset = 0
    for layer in layers:
        index = torch.tensor(block_ids, dtype=torch.long, device=layer.tensor.device)
        src = layer.tensor.index_select(layer.block_dim, index)
        if layer.block_dim != 0:
            src = src.movedim(layer.block_dim, 0)
        rows[:, offset: offset + layer.block_bytes].copy_(src.reshape(n, -1).view(torch.uint8))
        offset += layer.block_bytes


def scatter_blocks(layers: list[CacheLayer], block_ids: list[int], rows: torch.Tensor) -> None:
    """Copy `rows` (as written by `gather_blocks`) into the caches at these block ids."""
    n = len(block_ids)
    offset = 0
    for layer in layers:
        device = layer.tensor.device
        src = rows[:, offset: offset + layer.block_bytes].view(layer.tensor.dtype).view(n, *layer.block_shape)
        if layer.block_dim != 0:
            src = src.movedim(0, layer.block_dim)
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        layer.tensor.index_copy_(layer.block_dim, index, src.to(device, non_blocking=False))
        offset += layer.block_bytes
