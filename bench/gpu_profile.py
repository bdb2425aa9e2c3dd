"""The simulator's time model measured on a GPU: a Llama-shaped forward pass in plain PyTorch, timed (torch only).

`python -m bench.gpu_profile [--out FILE]` on a machine with CUDA (a GPU machine with torch, or the vLLM venv).
The model is Llama-3.1-8B's shape (32 layers, hidden 4096, 32 query heads, 8 KV heads, head_dim 128, MLP 14336,
vocabulary 128256) with random bf16 weights, so nothing is downloaded. Its forward pass is vLLM's in outline: a
fused QKV projection, rotary embeddings, the new keys and values written into a preallocated cache and attention
over the cache (SDPA's flash kernel, causal from the bottom right: a cached prefix is attended to, not recomputed),
the output projection, a fused gate/up projection, SiLU, the down projection, and logits of the last token only.
Measured, each the median of `--repeat` runs after a warm-up, with CUDA events:

- prefill: one sequence of N new tokens on top of C cached ones (N x C over a grid), eagerly, as vLLM runs a
  prefill of more tokens than its largest CUDA graph;
- decode: one token for each of B sequences of context T, captured in a CUDA graph and replayed, as vLLM decodes.

Then the time model's achieved fractions are fitted to them (least squares, no term negative: `fit`): the matmul
FLOP rate (`mfu` of the datasheet peak), attention's rate relative to it (`attention_efficiency`) and an intercept
(the GPU's own per-pass time: launches, norms, rotary) from the prefills of `--fit-min-new` tokens and more, and the
bandwidth fraction (`bandwidth_efficiency`) from the decodes bound by memory (the median of what each achieved).
`--refit FILE` fits an earlier run's measurements again, without a GPU. It prints each measurement beside the
fitted model's time and the model of `--profile` (bench/sim/perf_model.py), and writes all of it as JSON.

Not measured here: vLLM's own kernels (FlashAttention 3 on Hopper, fused norms, CUTLASS GEMMs) are at least as fast
as these, so this is a floor on what vLLM achieves on the same GPU, not vLLM itself; and the CPU side of a step
(scheduling, sampling, detokenizing), which the profiles' `step_overhead_s` stands for.
Without CUDA it runs a small shape on the CPU (`--small`), so the script is tested anywhere.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from bench.sim.perf_model import PROFILES, ModelShape, Profile


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        per_layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def model(self) -> ModelShape:
        return ModelShape(params=self.params, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
                          head_dim=self.head_dim)


LLAMA_3_1_8B = Shape(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
SMALL = Shape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=512, vocab=1024)


class Llama:
    """Random bf16 weights of `shape` on `device`, and the forward pass of the module's doc."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = shape
        self.device = device
        self.dtype = dtype
        gen = torch.Generator(device=device).manual_seed(0)

        def weight(*size: int) -> torch.Tensor:
            w = torch.empty(size, device=device, dtype=dtype)
            return w.normal_(0.0, 1.0 / math.sqrt(size[0]), generator=gen)

        s = shape
        q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.embed = weight(s.vocab, s.hidden)
        self.layers = [{"qkv": weight(s.hidden, q + 2 * kv), "o": weight(q, s.hidden),
                        "gate_up": weight(s.hidden, 2 * s.intermediate), "down": weight(s.intermediate, s.hidden),
                        "norm1": torch.ones(s.hidden, device=device, dtype=dtype),
                        "norm2": torch.ones(s.hidden, device=device, dtype=dtype)} for _ in range(s.layers)]
        self.norm = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lm_head = weight(s.hidden, s.vocab)
        inv = 1.0 / (500000.0 ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim))
        self._inv_freq = inv
        self.attention = attention_backend(device, dtype)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[positions, 1, head_dim / 2]`, to broadcast over `[batch, positions, heads, head_dim / 2]`."""
        freqs = positions.to(torch.float32)[:, None, None] * self._inv_freq
        return freqs.cos().to(self.dtype), freqs.sin().to(self.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def new_cache(self, batch: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V), `[batch, kv_heads, tokens, head_dim]`, random: what a cached prefix left there."""
        s = self.shape
        size = (batch, s.kv_heads, tokens, s.head_dim)
        return [(torch.randn(size, device=self.device, dtype=self.dtype),
                 torch.randn(size, device=self.device, dtype=self.dtype)) for _ in range(s.layers)]

    def forward(self, ids: torch.Tensor, start: int, cache: list[tuple[torch.Tensor, torch.Tensor]],
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`ids` `[batch, new]` at positions start.. start+new; the cache holds `start` tokens of each sequence
        before and gets the new ones. Returns the last token's logits `[batch, vocab]`."""
        s = self.shape
        batch, new = ids.shape
        end = start + new
        q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
        x = self.embed[ids]  # [batch, new, hidden]
        causal = causal_lower_right(new, end) if new > 1 else None
        for layer, (k_cache, v_cache) in zip(self.layers, cache, strict=True):
            h = F.rms_norm(x, (s.hidden,), layer["norm1"])
            q, k, v = (h @ layer["qkv"]).split((q_width, kv_width, kv_width), dim=-1)
            q = self._rotate(q.view(batch, new, s.heads, s.head_dim), cos, sin).transpose(1, 2)
            k = self._rotate(k.view(batch, new, s.kv_heads, s.head_dim), cos, sin).transpose(1, 2)
            k_cache[:, :, start:end] = k
            v_cache[:, :, start:end] = v.view(batch, new, s.kv_heads, s.head_dim).transpose(1, 2)
            attn = F.scaled_dot_product_attention(q, k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=causal,
                                                  enable_gqa=True)
            x = x + attn.transpose(1, 2).reshape(batch, new, q_width) @ layer["o"]
            h = F.rms_norm(x, (s.hidden,), layer["norm2"])
            gate, up = (h @ layer["gate_up"]).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ layer["down"]
        return F.rms_norm(x[:, -1], (s.hidden,), self.norm) @ self.lm_head


@dataclass(frozen=True)
class Prefill:
    new: int
    cached: int
    seconds: float


@dataclass(frozen=True)
class Decode:
    batch: int
    context: int
    seconds: float  # replayed from a CUDA graph (eagerly without CUDA)
    eager_seconds: float | None = None


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


class Timer:
    """Seconds of a callable: the median of CUDA events on a GPU; on the CPU the least of the wall-clock times
    (another process on a shared core only adds time, so the least is the closest to the work's own; the median
    of a loaded 2-core machine's timings fitted negative rates)."""

    def __init__(self, device: torch.device, repeat: int) -> None:
        self.cuda = device.type == "cuda"
        self.repeat = repeat

    def __call__(self, fn: Callable[[], object]) -> float:
        fn()  # warm-up (kernel selection, allocator)
        times = []
        for _ in range(self.repeat):
            if self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end) / 1e3)
            else:
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
        return float(statistics.median(times) if self.cuda else min(times))


def attention_backend(device: torch.device, dtype: torch.dtype) -> SDPBackend:
    """The first of flash, memory-efficient and math attention that runs what `Llama.forward` asks of it (grouped
    query heads, a causal mask from the bottom right) on this device: every pass then uses that one alone."""
    q = torch.randn(1, 4, 8, 64, device=device, dtype=dtype)
    kv = torch.randn(1, 2, 24, 64, device=device, dtype=dtype)
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, kv, kv, attn_mask=causal_lower_right(8, 24), enable_gqa=True)
                F.scaled_dot_product_attention(q[:, :, :1], kv, kv, enable_gqa=True)
            return backend
        except RuntimeError as exc:
            print(f"# attention: {backend.name} does not run here ({str(exc).splitlines()[0][:120]})", flush=True)
    raise SystemExit("no attention backend runs grouped query heads with a bottom-right causal mask here")


def release(device: torch.device) -> None:
    """Hand the memory of the last measurement's caches back (the next may need most of the GPU's)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def time_prefill(model: Llama, timer: Timer, new: int, cached: int) -> float:
    cache = model.new_cache(1, cached + new)
    ids = torch.randint(0, model.shape.vocab, (1, new), device=model.device)
    cos, sin = model.rope(torch.arange(cached, cached + new, device=model.device))
    with torch.inference_mode(), sdpa_kernel(model.attention):
        return timer(lambda: model.forward(ids, cached, cache, cos, sin))


def time_decode(model: Llama, timer: Timer, batch: int, context: int, graph: bool) -> float:
    """One decode step of `batch` sequences with `context` tokens cached each; replayed from a CUDA graph when
    `graph` (as vLLM decodes), else run eagerly."""
    cache = model.new_cache(batch, context + 1)
    ids = torch.randint(0, model.shape.vocab, (batch, 1), device=model.device)
    cos, sin = model.rope(torch.tensor([context], device=model.device))
    with torch.inference_mode(), sdpa_kernel(model.attention):
        def step() -> object:
            return model.forward(ids, context, cache, cos, sin)

        if not graph:
            seconds = timer(step)
        else:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph):
                step()
            seconds = timer(cuda_graph.replay)
    return seconds


def fit(rows: Sequence[tuple[Sequence[float], float]], required: Sequence[int] = ()) -> list[float]:
    """Least squares of t ~ x . c over the rows (x, t), weighted by 1/t (relative errors count alike), with every
    c >= 0: each is a time per unit of work, and noisy timings of small shapes (a loaded CPU) fitted a negative pass
    or rate. Exact for a few terms: the best fit over the sets of terms whose own fit is non-negative (the others
    0), which is the unconstrained fit whenever that is non-negative; the terms in `required` are in every set
    (terms that grow alike, as a prefill's matmuls and attention do, may otherwise trade places)."""
    a = torch.tensor([[xi / t for xi in x] for x, t in rows], dtype=torch.float64)
    b = torch.ones(len(rows), 1, dtype=torch.float64)
    terms = a.shape[1]
    optional = [i for i in range(terms) if i not in required]
    best: tuple[float, list[float]] | None = None
    for size in range(len(optional), -1, -1):
        for chosen in itertools.combinations(optional, size):
            kept = sorted((*required, *chosen))
            if not kept:
                continue
            solution = torch.linalg.lstsq(a[:, kept], b).solution.flatten()
            if bool((solution < 0).any()):
                continue
            c = [0.0] * terms
            for i, value in zip(kept, solution.tolist(), strict=True):
                c[i] = value
            residual = float(torch.linalg.vector_norm(a @ torch.tensor(c, dtype=torch.float64).unsqueeze(1) - b))
            if best is None or residual < best[0]:
                best = (residual, c)
    if best is None:
        raise ValueError("no non-negative fit of the timings")
    return best[1]


def fitted_profile(base: Profile, model: ModelShape, prefills: list[Prefill], decodes: list[Decode],
                   min_new: int) -> tuple[Profile, dict[str, float]]:
    """`base` with the model's shape and the fractions fitted to the measurements (see the module's doc): the
    compute rates to the prefills of at least `min_new` tokens (bound by compute, not by reading the weights), the
    bandwidth to the decodes bound by memory."""
    matmul_flops = 2.0 * model.params
    attend_flops = 4.0 * model.layers * model.heads * model.head_dim
    # prefill: t = pass + matmul_flops * N / rate + attend_flops * N (C + N/2) / (rate * attention_efficiency)
    prefill_fit = fit([((1.0, matmul_flops * r.new, attend_flops * r.new * (r.cached + r.new / 2)), r.seconds)
                       for r in prefills if r.new >= min_new], required=(1,))
    pass_s, per_matmul_flop, per_attend_flop = prefill_fit
    if per_matmul_flop <= 0:
        raise ValueError("the prefills' times did not grow with their tokens: no matmul rate fits them")
    rate = 1.0 / per_matmul_flop
    attend_rate = 1.0 / per_attend_flop if per_attend_flop > 0 else math.inf  # inf: attention measured as free
    # decode: the bandwidth each step achieved reading the weights and its KV, the median over the steps bound by
    # memory (their matmuls at the fitted rate take under half of their time); a replayed graph has no pass to fit
    bound = [r for r in decodes if matmul_flops * r.batch / rate < r.seconds / 2] or decodes
    per_byte = 1.0 / statistics.median(
        (model.weight_bytes + r.batch * (r.context + 1) * model.kv_bytes_per_token) / r.seconds for r in bound)
    decode_pass_s = 0.0
    fractions = {"mfu": rate / base.peak_flops, "attention_efficiency": attend_rate / rate,
                 "bandwidth_efficiency": 1.0 / per_byte / base.hbm_bytes_per_s,
                 "prefill_pass_s": pass_s, "decode_pass_s": decode_pass_s,
                 "matmul_tflops": rate / 1e12, "attention_tflops": attend_rate / 1e12,
                 "bandwidth_tb_s": 1.0 / per_byte / 1e12}
    profile = Profile(**{**asdict(base), "model": model, "mfu": fractions["mfu"],
                         "attention_efficiency": fractions["attention_efficiency"],
                         "bandwidth_efficiency": fractions["bandwidth_efficiency"], "step_overhead_s": 0.0})
    return profile, fractions


def measure(args: argparse.Namespace) -> tuple[Shape, list[Prefill], list[Decode], dict[str, Any]]:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    shape = SMALL if args.small or not cuda else LLAMA_3_1_8B
    dtype = torch.bfloat16 if cuda else torch.float32
    name = torch.cuda.get_device_name() if cuda else "CPU (no CUDA device present)"
    memory = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    print(f"# {name} ({memory / 2**30:.1f} GiB); torch {torch.__version__}; shape {shape} "
          f"({shape.params / 1e9:.2f} B parameters, {dtype})", flush=True)
    model = Llama(shape, device, dtype)
    print(f"# attention: {model.attention.name}", flush=True)
    timer = Timer(device, args.repeat)
    prefills = []
    for cached in ints(args.cached):
        for new in ints(args.new):
            prefills.append(Prefill(new, cached, time_prefill(model, timer, new, cached)))
            release(device)
            print(json.dumps({"prefill": asdict(prefills[-1])}), flush=True)
    decodes = []
    shapes = [(b, args.context) for b in ints(args.batches)] + [(32, t) for t in ints(args.long_contexts)]
    for batch, context in shapes:
        seconds = time_decode(model, timer, batch, context, graph=cuda)
        release(device)
        eager = time_decode(model, timer, batch, context, graph=False) if cuda else None
        release(device)
        decodes.append(Decode(batch, context, seconds, eager))
        print(json.dumps({"decode": asdict(decodes[-1])}), flush=True)
    run = {"device": name, "device_memory_bytes": memory, "torch": torch.__version__, "dtype": str(dtype),
           "attention": model.attention.name, "repeat": args.repeat}
    return shape, prefills, decodes, run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new", default="128,512,1024,2048,4096,8192", help="prefill tokens per pass")
    parser.add_argument("--cached", default="0,4096,16384,32768", help="cached tokens before them")
    parser.add_argument("--batches", default="1,8,32,64,128,256", help="decode batch sizes (context --context)")
    parser.add_argument("--context", type=int, default=1024, help="each decoding sequence's context")
    parser.add_argument("--long-contexts", default="4096,16384", help="also decode 32 sequences of these contexts")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--fit-min-new", type=int, default=1024,
                        help="fit the compute rates to prefills of at least this many new tokens")
    parser.add_argument("--profile", default="llama-3.1-8b-h100",
                        help="the profile whose datasheet peaks the fractions are of, and whose model is printed "
                             "beside the measurements")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense BF16 peak (default: --profile's)")
    parser.add_argument("--hbm-tb-s", type=float, help="the GPU's memory bandwidth (default: --profile's)")
    parser.add_argument("--small", action="store_true", help="a small shape (the default without CUDA)")
    parser.add_argument("--out", type=Path, help="write the measurements and the fit here (JSON)")
    parser.add_argument("--refit", type=Path, help="fit the measurements of an earlier --out instead of measuring")
    args = parser.parse_args(argv)

    base = PROFILES[args.profile]
    if args.peak_tflops:
        base = Profile(**{**asdict(base), "model": base.model, "peak_flops": args.peak_tflops * 1e12})
    if args.hbm_tb_s:
        base = Profile(**{**asdict(base), "model": base.model, "hbm_bytes_per_s": args.hbm_tb_s * 1e12})
    if args.refit:
        saved = json.loads(args.refit.read_text())
        run = {k: saved[k] for k in ("device", "device_memory_bytes", "torch", "dtype", "attention", "repeat")}
        shape = Shape(**saved["shape"])
        prefills = [Prefill(**p) for p in saved["prefill"]]
        decodes = [Decode(**d) for d in saved["decode"]]
        print(f"# refitting {args.refit}: {run['device']}, torch {run['torch']}, {run['attention']}", flush=True)
    else:
        shape, prefills, decodes, run = measure(args)
    model_shape = shape.model()
    profile, fractions = fitted_profile(base, model_shape, prefills, decodes, args.fit_min_new)
    reference = Profile(**{**asdict(base), "model": model_shape})
    print(f"# fitted against {base.name}'s peaks ({base.peak_flops / 1e12:g} TFLOP/s, "
          f"{base.hbm_bytes_per_s / 1e12:g} TB/s): " + ", ".join(f"{k} {v:.4g}" for k, v in fractions.items()))
    print(f"# {'what':<28} {'measured ms':>12} {'fitted ms':>10} {'err':>6} {base.name + ' ms':>24}")
    table: list[dict[str, Any]] = []
    for p in prefills:
        table.append({"what": f"prefill {p.new} on {p.cached}", "measured_s": p.seconds,
                      "fitted_s": fractions["prefill_pass_s"] + profile.step_time([(p.new, p.cached)]),
                      "profile_s": reference.step_time([(p.new, p.cached)])})
    for d in decodes:
        table.append({"what": f"decode {d.batch} x {d.context}", "measured_s": d.seconds,
                      "fitted_s": fractions["decode_pass_s"] + profile.decode_step_time(d.batch, d.context + 1),
                      "profile_s": reference.decode_step_time(d.batch, d.context + 1)})
    for t in table:
        err = t["fitted_s"] / t["measured_s"] - 1
        print(f"# {t['what']:<28} {t['measured_s'] * 1e3:12.3f} {t['fitted_s'] * 1e3:10.3f} {err:6.1%} "
              f"{t['profile_s'] * 1e3:24.3f}")
    errors = [abs(t["fitted_s"] / t["measured_s"] - 1) for t in table]
    print(f"# fit error: median {statistics.median(errors):.1%}, max {max(errors):.1%}")
    if args.out:
        args.out.write_text(json.dumps({
            **run, "shape": asdict(shape), "params": shape.params, "profile": base.name,
            "peak_flops": base.peak_flops, "hbm_bytes_per_s": base.hbm_bytes_per_s,
            "prefill": [asdict(p) for p in prefills], "decode": [asdict(d) for d in decodes], "fit": fractions,
            "table": table, "fit_error_median": statistics.median(errors), "fit_error_max": max(errors),
            "argv": sys.argv[1:]}, indent=1))


if __name__ == "__main__":
    main()
