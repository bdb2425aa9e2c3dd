"""`kvgate bench prefix`: what prefix-aware routing costs and what it buys.

Costs, measured in this process on the tiny model from `kvgate make-model`: tokenize + hash an ~8,000-token chat
prompt (cold), the next turn of the same conversation (its earlier turns cached), a prefix-trie lookup for a
500-block prompt over 16 workers, memory per trie node. Prints a table and writes JSON (`--json`). What prefix
routing buys on a fleet (hit rate, TTFT against round_robin and the peers) is `kvgate bench compare`'s job.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.make_model import write_model
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.pool import Worker
from router.prefix_trie import PrefixTrie
from router.prompt_tokens import PromptTokens
from router.requests import LargePrompt, Prompt, read_payload
from router.routing import RouteRequest
from strategies import create_strategy

CHAT = "/v1/chat/completions"
WORDS = Path(random.__file__).read_text().split()


def measure_node_bytes(prompts: int = 40, blocks: int = 100, workers: int = 4) -> float:
    """Memory one trie node takes (trie node, index entry, worker map), measured with tracemalloc on a
    throwaway trie; skipped (0) when something else is already tracing."""
    if tracemalloc.is_tracing():
        return 0.0
    rng = random.Random(0)
    prompt_keys = [[rng.getrandbits(64) for _ in range(blocks)] for _ in range(prompts)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trie = PrefixTrie(max_nodes=prompts * blocks, ttl_s=3600.0)
        for i, keys in enumerate(prompt_keys):
            for w in range(workers if i % 2 == 0 else 1):
                trie.insert(keys, f"http://worker-{w}:8000")
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return (after - before) / max(1, len(trie))


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- costs ---------------------------------------------------------------------------------------------------


def _conversation(rng: random.Random, target_tokens: int) -> list[dict[str, str]]:
    """A system prompt and alternating turns, about `target_tokens` tokens of the tiny model (~2.2 per word)."""
    messages = [{"role": "system", "content": _words(rng, target_tokens // 6)}]
    while sum(len(m["content"].split()) for m in messages) * 2.2 < target_tokens:
        messages.append({"role": "user", "content": _words(rng, 120)})
        messages.append({"role": "assistant", "content": _words(rng, 200)})
    messages.append({"role": "user", "content": _words(rng, 60)})
    return messages


def _chat(messages: list[dict[str, str]]) -> Prompt:
    prompt = read_payload(CHAT, {"model": "tiny", "messages": messages}, model_required=True).prompt
    assert prompt is not None and not isinstance(prompt, LargePrompt)
    return prompt


async def measure_tokenize(model_dir: Path, repeat: int) -> dict[str, Any]:
    """Per request: render the chat template, encode, hash into block keys. `*_ms` run on this thread (the
    work itself); `*_service_ms` go through `PromptTokens.keys`, thread-pool hop included."""
    rng = random.Random(1)
    prompts = PromptTokens(GatewayConfig(model_dir=[str(model_dir)], block_size=16))
    tokenizer = await prompts.tokenizer("tiny")
    assert tokenizer is not None
    root = root_key("tiny")
    conversations = [_conversation(rng, 8000) for _ in range(repeat)]
    cold: list[float] = []
    cold_service: list[float] = []
    tokens = 0
    for messages in conversations:
        prompt = _chat(messages)
        prompts.clear_caches()
        started = time.perf_counter()
        tokens = prompts.tokenize_now(tokenizer, prompt, root).prompt_tokens
        cold.append(time.perf_counter() - started)
        prompts.clear_caches()
        started = time.perf_counter()
        await prompts.keys(prompt, "tiny")
        cold_service.append(time.perf_counter() - started)
    turn: list[float] = []
    turn_service: list[float] = []
    for messages in conversations:
        await prompts.keys(_chat(messages), "tiny")  # the conversation so far is cached
        following = [*messages, {"role": "assistant", "content": _words(rng, 40)},
                     {"role": "user", "content": _words(rng, 25)}]
        started = time.perf_counter()
        prompts.tokenize_now(tokenizer, _chat(following), root)
        turn.append(time.perf_counter() - started)
        following = [*following, {"role": "assistant", "content": _words(rng, 40)},
                     {"role": "user", "content": _words(rng, 25)}]
        started = time.perf_counter()
        await prompts.keys(_chat(following), "tiny")
        turn_service.append(time.perf_counter() - started)
    prompts.close()
    return {
        "prompt_tokens": tokens,
        "cold_ms_p50": statistics.median(cold) * 1e3,
        "cold_ms_min": min(cold) * 1e3,
        "cold_service_ms_p50": statistics.median(cold_service) * 1e3,
        "next_turn_ms_p50": statistics.median(turn) * 1e3,
        "next_turn_ms_min": min(turn) * 1e3,
        "next_turn_service_ms_p50": statistics.median(turn_service) * 1e3,
        "next_turn_new_text": "one assistant turn of 40 words and one user turn of 25 words",
    }


def measure_trie(workers: int = 16, blocks: int = 500, filler_nodes: int = 200_000) -> dict[str, Any]:
    rng = random.Random(2)
    trie = PrefixTrie(max_nodes=filler_nodes * 2, ttl_s=3600)
    urls = [f"http://10.0.0.{i}:8000" for i in range(workers)]
    for i in range(filler_nodes // blocks):  # other prompts sharing the trie
        trie.insert([rng.getrandbits(64) for _ in range(blocks)], urls[i % workers])
    prompt = [rng.getrandbits(64) for _ in range(blocks)]
    for url in urls:  # every worker was sent a different-length prefix of this prompt
        trie.insert(prompt[: rng.randrange(1, blocks + 1)], url)
    lookups = _timed(lambda: trie.match(prompt), 2000)
    fresh = [[rng.getrandbits(64) for _ in range(blocks)] for _ in range(200)]
    inserts = iter(fresh)
    insert_new = _timed(lambda: trie.insert(next(inserts), urls[0]), len(fresh))
    insert_known = _timed(lambda: trie.insert(prompt, urls[1]), 200)
    config = GatewayConfig(strategy="prefix", block_size=16)
    strategy = create_strategy(config)
    pool = [Worker(spec=WorkerSpec(u), healthy=True, models=frozenset({"tiny"})) for u in urls]
    token_ids = [rng.randrange(4096) for _ in range(blocks * 16)]
    request = RouteRequest("tiny", CHAT, {}, token_ids, block_keys(token_ids, 16, root_key("tiny")), len(token_ids))
    choose = _timed(lambda: strategy.choose(request, pool), 500)
    return {
        "workers": workers, "prompt_blocks": blocks, "trie_nodes": len(trie),
        "lookup_us_p50": statistics.median(lookups) * 1e6, "lookup_us_p99": _pct(lookups, 0.99) * 1e6,
        "insert_new_500_us_p50": statistics.median(insert_new) * 1e6,
        "insert_known_500_us_p50": statistics.median(insert_known) * 1e6,
        "choose_us_p50": statistics.median(choose) * 1e6,
        "bytes_per_node": measure_node_bytes(prompts=100, blocks=200, workers=4),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--repeat", type=int, default=20, help="tokenizer timing repetitions")


def _print_costs(report: dict[str, Any]) -> None:
    t, p = report["tokenize"], report["trie"]
    print(f"tokenize+hash {t['prompt_tokens']}-token chat, cold:  {t['cold_ms_p50']:.2f} ms p50, "
          f"{t['cold_ms_min']:.2f} ms min "
          f"(through the service: {t['cold_service_ms_p50']:.2f} ms)   target <= 5 ms")
    print(f"next turn of the same conversation:    {t['next_turn_ms_p50']:.3f} ms p50, "
          f"{t['next_turn_ms_min']:.3f} ms min "
          f"(through the service: {t['next_turn_service_ms_p50']:.3f} ms)   target <= 0.5 ms")
    print(f"trie lookup, {p['prompt_blocks']} blocks x {p['workers']} workers ({p['trie_nodes']} nodes): "
          f"{p['lookup_us_p50']:.1f} us p50, {p['lookup_us_p99']:.1f} us p99   target <= 100 us")
    print(f"prefix choose() incl. insert: {p['choose_us_p50']:.1f} us; insert 500 new blocks "
          f"{p['insert_new_500_us_p50']:.0f} us, 500 known {p['insert_known_500_us_p50']:.0f} us")
    print(f"memory per trie node: {p['bytes_per_node']:.0f} bytes")


def run(args: argparse.Namespace) -> int:
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvgate-prefix-bench-") as tmp:
        model_dir = Path(tmp)
        write_model(model_dir)
        report["tokenize"] = asyncio.run(measure_tokenize(model_dir, args.repeat))
        report["trie"] = measure_trie()
        _print_costs(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
