"""Which engines may exchange KV blocks: everything that decides what the bytes of a block mean, hashed into the
64-bit layout id under which the tier agent keeps them (torch-free and vLLM-free, so it is tested on its own).

Two engines share blocks only if every field is equal. A field left out is a way to load bytes that pass the
agent's checksum but mean something else: another pipeline stage's layers, another revision's weights, a
quantized model's activations, an fp8 cache read as bf16, or the same numbers in another order (the attention
backend and the KV cache layout it resolved, e.g. NHD against HND).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class KvLayout:
    model: str
    revision: str | None
    quantization: str | None
    dtype: str  # the model's activations
    kv_cache_dtype: str  # the cache's own ("auto" follows `dtype`; "fp8_e4m3" and friends do not)
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    tp_size: int
    pp_size: int
    tp_rank: int
    pp_rank: int
    attention_backend: str | None  # as configured (None: vLLM's automatic choice for this hardware)
    kv_cache_layout: str | None  # as vLLM resolved it for the backends in use
    override: str | None = None  # extra_config["layout"]: an operator's own string instead of the model fields

    def id(self) -> int:
        text = json.dumps(asdict(self), sort_keys=True)
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")

    @classmethod
    def from_vllm(cls, vllm_config: Any, tp_rank: int, pp_rank: int, override: str | None = None) -> KvLayout:
        """The layout of one worker (its TP and PP rank) of this engine configuration."""
        model = vllm_config.model_config
        parallel = vllm_config.parallel_config
        cache = vllm_config.cache_config
        backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
        mine = override is None  # an override stands for the model's own fields
        return cls(model=str(model.model) if mine else "", revision=_text(model.revision) if mine else None,
                   quantization=_text(model.quantization) if mine else None, dtype=str(model.dtype) if mine else "",
                   num_layers=int(model.get_num_layers(parallel)) if mine else 0,
                   num_kv_heads=int(model.get_num_kv_heads(parallel)) if mine else 0,
                   head_size=int(model.get_head_size()) if mine else 0,
                   kv_cache_dtype=str(cache.cache_dtype), block_size=int(cache.block_size),
                   tp_size=int(parallel.tensor_parallel_size), pp_size=int(parallel.pipeline_parallel_size),
                   tp_rank=tp_rank, pp_rank=pp_rank,
                   attention_backend=_text(getattr(backend, "name", backend)),
                   kv_cache_layout=_text(getattr(cache, "kv_cache_layout", None)), override=override)

def _text(value: object) -> str | None:
    return None if value is None else str(value)
