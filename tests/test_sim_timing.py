"""The simulator takes the time its profile says: TTFT of a cold and of a cached prompt, decode steps, and
`--speedup` dividing every duration alike (measured over HTTP on a real replica process)."""

from __future__ import annotations

import time
from collections.abc import Callable

import aiohttp

from bench.sim.launch import SimFleet
from bench.sim.perf_model import PROFILES

PROFILE = PROFILES["llama-3.1-8b-h100"]
SLACK_S = 0.06  # HTTP, tokenization, hashing and timer granularity on a shared 2-core machine


async def timed(http: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(time to first token, time to last token) of one streamed completion."""
    t0 = time.perf_counter()
    first = 0.0
    async with http.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt,
                                                        "max_tokens": max_tokens, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if not first and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
    return first, time.perf_counter() - t0


async def test_ttft_and_decode_follow_the_profile(sim_fleet: Callable[..., SimFleet],
                                                  http: aiohttp.ClientSession) -> None:
    fleet = sim_fleet(1, speedup=1.0, extra_args=["--max-model-len", "8192", "--no-kv-events"])
    url = fleet.urls[0]
    prompt = [(i * 7919) % 4000 + 5 for i in range(4096)]
    ttft, total = await timed(http, url, prompt, 20)
    predicted = PROFILE.prefill_time(4096)
    assert predicted > 0.1
    assert predicted * 0.97 <= ttft <= predicted + SLACK_S, (ttft, predicted)
    decode = sum(PROFILE.decode_step_time(1, 4096 + i) for i in range(19))
    assert decode * 0.95 <= total - ttft <= decode + SLACK_S, (total - ttft, decode)
    # the same prompt again: 4080 of 4096 tokens cached, only the last block is recomputed
    ttft_hit, _ = await timed(http, url, prompt, 1)
    predicted_hit = PROFILE.prefill_time(16, 4080)
    assert predicted_hit * 0.97 <= ttft_hit <= predicted_hit + SLACK_S, (ttft_hit, predicted_hit)
    assert ttft_hit < ttft / 4


async def test_speedup_divides_every_duration(sim_fleet: Callable[..., SimFleet],
                                              http: aiohttp.ClientSession) -> None:
    fleet = sim_fleet(1, speedup=10.0, extra_args=["--max-model-len", "16384", "--no-kv-events"])
    prompt = [(i * 104729) % 4000 + 5 for i in range(16000)]
    ttft, _ = await timed(http, fleet.urls[0], prompt, 1)
    predicted = PROFILE.prefill_time(16000) / 10
    assert predicted * 0.97 <= ttft <= predicted + SLACK_S, (ttft, predicted)
