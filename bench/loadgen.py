"""The load generator: streams OpenAI completions to one URL, open loop (by arrival times) or closed loop (fixed
concurrency), and measures at the client: time to first token, inter-token latency, end-to-end latency, errors.
Fleet figures come from the replicas' own `/metrics` (before/after deltas): token-weighted prefix-cache hit rate,
each replica's requests and prompt tokens, generated tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.stats import percentile
from bench.workloads import PromptVocabulary, WorkloadRequest
from router.prom_text import sum_samples
from router.proxy import PREDICTED_TTFT_HEADER


@dataclass(slots=True)
class RequestResult:
    index: int
    start_s: float = 0.0          # when it was sent, from the run's start
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None   # until the first chunk with generated text
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between successive text chunks
    output_tokens: int = 0
    prompt_tokens: int = 0        # as the engine counted them (usage)
    cached_tokens: int = 0        # usage.prompt_tokens_details.cached_tokens
    predicted_ttft_s: float | None = None  # the gateway's prediction (X-Kvgate-Predicted-Ttft-Ms), when it sent one


def request_body(req: WorkloadRequest, vocab: PromptVocabulary, model: str, prompt_mode: str) -> bytes:
    """A streamed /v1/completions body; `prompt_mode` "text" sends the decoded text, "ids" the wire token ids."""
    prompt: str | list[int] = vocab.text(req.token_ids) if prompt_mode == "text" else vocab.wire_ids(req.token_ids)
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "ignore_eos": True,
                         "stream": True, "stream_options": {"include_usage": True}})


async def send_streaming(http: aiohttp.ClientSession, url: str, body: bytes, result: RequestResult,
                         t0: float, path: str = "/v1/completions") -> RequestResult:
    """Send one streamed request (completions, or chat when `path` says so) and time it at the client."""
    started = time.perf_counter()
    result.start_s = started - t0
    last: float | None = None
    try:
        async with http.post(url + path, data=body, headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            predicted = resp.headers.get(PREDICTED_TTFT_HEADER)
            if predicted is not None:
                result.predicted_ttft_s = float(predicted) / 1e3
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                chunk = orjson.loads(line[6:])
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("text") or (choices[0].get("delta") or {}).get("content")):
                    now = time.perf_counter()
                    if last is None:
                        result.ttft_s = now - started
                    else:
                        result.itl_s.append(now - last)
                    last = now
                    result.output_tokens += 1
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = int(details.get("cached_tokens") or 0)
        result.e2e_s = time.perf_counter() - started
        result.ok = result.ttft_s is not None
        if not result.ok:
            result.error = "the stream ended without generated text"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    return result


def _progress(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, leave=False)


async def open_loop(http: aiohttp.ClientSession, url: str, bodies: Sequence[bytes], arrivals: Sequence[float],
                    *, progress: bool = False, desc: str = "") -> list[RequestResult]:
    """Send request i at arrivals[i] seconds from the start, whatever the earlier ones are doing."""
    results = [RequestResult(i) for i in range(len(bodies))]
    bar = _progress(len(bodies), desc, progress)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        delay = arrivals[i] - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        await send_streaming(http, url, bodies[i], results[i], t0)
        bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(bodies))))
    finally:
        bar.close()
    return results


async def closed_loop(http: aiohttp.ClientSession, url: str, bodies: Sequence[bytes], concurrency: int,
                      *, progress: bool = False, desc: str = "", path: str = "/v1/completions",
                      ) -> list[RequestResult]:
    """`concurrency` clients, each sending the next request as soon as its previous one ended."""
    results = [RequestResult(i) for i in range(len(bodies))]
    bar = _progress(len(bodies), desc, progress)
    t0 = time.perf_counter()
    next_index = 0

    async def client() -> None:
        nonlocal next_index
        while next_index < len(bodies):
            i = next_index
            next_index += 1
            await send_streaming(http, url, bodies[i], results[i], t0, path)
            bar.update(1)

    try:
        await asyncio.gather(*(client() for _ in range(concurrency)))
    finally:
        bar.close()
    return results


# --- figures ------------------------------------------------------------------------------------------------


def latency_summary(results: Sequence[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [g for r in ok for g in r.itl_s]
    out: dict[str, Any] = {"requests": len(results), "ok": len(ok), "errors": len(results) - len(ok),
                           "error_samples": sorted({r.error for r in results if r.error})[:5]}
    for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e)):
        for q in (0.5, 0.9, 0.99):
            p = percentile(values, q)
            out[f"{name}_ms_p{int(q * 100)}"] = None if p is None else p * 1e3
        out[f"{name}_ms_mean"] = sum(values) / len(values) * 1e3 if values else None
    client_prompt = sum(r.prompt_tokens for r in ok)
    out["client_cached_token_rate"] = sum(r.cached_tokens for r in ok) / client_prompt if client_prompt else None
    return out


FLEET_COUNTERS = {
    "vllm:prefix_cache_hits_total": "hit_tokens",
    "vllm:prefix_cache_queries_total": "query_tokens",
    "vllm:external_prefix_cache_hits_total": "tier_hit_tokens",  # loaded by a KV connector (the tier agent)
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_success_total": "requests",
}


def parse_counters(text: str) -> dict[str, float]:
    """Sums of the fleet counters in one Prometheus text exposition (labels summed over)."""
    return {FLEET_COUNTERS[name]: value for name, value in sum_samples(text, FLEET_COUNTERS).items()}


async def scrape(http: aiohttp.ClientSession, urls: Sequence[str]) -> list[dict[str, float]]:
    async def one(url: str) -> dict[str, float]:
        async with http.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            return parse_counters(await resp.text())

    return list(await asyncio.gather(*(one(u) for u in urls)))


def fleet_summary(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]], seconds: float,
                  urls: Sequence[str]) -> dict[str, Any]:
    deltas = [{k: a[k] - b[k] for k in a} for b, a in zip(before, after, strict=True)]
    hits = sum(d["hit_tokens"] for d in deltas)
    queries = sum(d["query_tokens"] for d in deltas)
    requests = [d["requests"] for d in deltas]
    prompt = [d["prompt_tokens"] for d in deltas]

    def imbalance(values: list[float]) -> float | None:
        mean = sum(values) / len(values) if values else 0.0
        return max(values) / mean if mean else None

    generated = sum(d["generation_tokens"] for d in deltas)
    tier_hits = sum(d["tier_hit_tokens"] for d in deltas)
    return {
        "hit_rate": hits / queries if queries else 0.0, "hit_tokens": hits, "query_tokens": queries,
        # GPU hits plus tokens loaded from the tier agents, over the same queries (vLLM's cached_tokens view)
        "hit_rate_with_tiers": (hits + tier_hits) / queries if queries else 0.0, "tier_hit_tokens": tier_hits,
        "replicas": [{"url": u, **d} for u, d in zip(urls, deltas, strict=True)],
        "request_share": [r / sum(requests) if sum(requests) else 0.0 for r in requests],
        "prompt_token_share": [p / sum(prompt) if sum(prompt) else 0.0 for p in prompt],
        "request_imbalance": imbalance(requests), "prompt_token_imbalance": imbalance(prompt),
        "requests_per_s": sum(requests) / seconds if seconds else None,
        "prompt_tokens_per_s": sum(prompt) / seconds if seconds else None,
        "output_tokens_per_s": generated / seconds if seconds else None,
    }

