"""The gateway's tokenization service: exact ids with the model's tokenizer, multi-turn piece caching, text mode,
tenant salts, LoRA roots, Hugging Face cache layouts, the thread pool, and wiring into the request path."""

from __future__ import annotations

import asyncio
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from kvcore.config import ConfigError
from kvgate.serve import assemble
from router.app import Gateway
from router.block_keys import block_keys, root_key
from router.config import GatewayConfig, WorkerSpec
from router.metrics import GatewayMetrics
from router.pool import Worker
from router.prompt_tokens import (
    ALONE_INLINE_BYTES,
    INLINE_CHARS,
    TEXT,
    TOKENS,
    PromptTokens,
    parse_model_dirs,
    resolve_model_dir,
)
from router.requests import LargePrompt, Prompt, parse_body, read_payload, with_tenant
from router.tokenizer import ModelTokenizer
from tests.conftest import eventually, running_gateway, running_standin

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
WORDS = Path(random.__file__).read_text().split()


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def prompt(path: str, body: dict[str, Any]) -> Prompt:
    """The typed prompt of a request body, as the gateway's edge reads it."""
    found = read_payload(path, body, model_required=False).prompt
    assert found is not None and not isinstance(found, LargePrompt)
    return found


def service(model_dirs: list[str], **overrides: Any) -> PromptTokens:
    return PromptTokens(GatewayConfig(model_dir=model_dirs, block_size=16, **overrides), GatewayMetrics())


async def test_chat_turns_match_the_tokenizer_and_encode_only_new_text(tiny_model_dir: Path) -> None:
    prompts = service([str(tiny_model_dir)])
    reference = ModelTokenizer(tiny_model_dir)
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(1, 600)}]
    for turn in range(4):
        messages.append({"role": "user", "content": words(10 + turn, 40 + 30 * turn)})
        body = {"model": "tiny", "messages": list(messages)}
        before = prompts.cache.encoded_chars
        found = await prompts.keys(prompt(CHAT, body), "tiny")
        tokenizer = await prompts.tokenizer("tiny")
        assert tokenizer is not None
        expected = reference.prompt_ids(body, chat=True)
        assert found.mode == TOKENS and found.token_ids is not None and list(found.token_ids) == expected
        assert found.prompt_tokens == len(expected)
        assert found.block_keys == block_keys(expected, 16, root_key("tiny"))
        if turn:
            # only the new user turn, the previous assistant turn and the generation prompt were encoded, from a
            # seam a few tokens before them
            new_text = len(messages[-1]["content"]) + len(messages[-2]["content"]) + 200
            assert prompts.cache.encoded_chars - before < new_text
        messages.append({"role": "assistant", "content": words(20 + turn, 30)})
    prompts.close()


async def test_completions_text_and_token_id_prompts(tiny_model_dir: Path) -> None:
    prompts = service([f"tiny={tiny_model_dir}"])
    reference = ModelTokenizer(tiny_model_dir)
    text = words(3, 200)
    found = await prompts.keys(prompt(COMPLETIONS, {"prompt": text}), "tiny")
    assert found.token_ids is not None and list(found.token_ids) == reference.encode(text, add_special_tokens=True)
    assert found.token_ids[0] == reference.bos_token_id
    batch = await prompts.keys(prompt(COMPLETIONS, {"prompt": [text, "other"]}), "tiny")
    assert batch.block_keys == found.block_keys  # a batch routes by its first prompt
    ids = list(range(5, 105))
    exact = await prompts.keys(prompt(COMPLETIONS, {"prompt": ids}), "tiny")
    assert exact.token_ids == ids and exact.block_keys == block_keys(ids, 16, root_key("tiny"))
    # another model without a tokenizer: token ids stay exact, text falls back to labelled text mode
    untokenized = await prompts.keys(prompt(COMPLETIONS, {"prompt": ids}), "other")
    assert untokenized.mode == TOKENS and untokenized.block_keys == block_keys(ids, 16, root_key("other"))
    by_text = await prompts.keys(prompt(COMPLETIONS, {"prompt": text}), "other")
    assert by_text.mode == TEXT and by_text.token_ids is None
    prompts.close()


async def test_text_mode_blocks_characters_and_never_collides_with_token_keys() -> None:
    prompts = service([])
    system = "You are a support agent for ACME. " * 40
    a = await prompts.keys(prompt(CHAT, {"messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": "first question? " * 10}]}), "m")
    b = await prompts.keys(prompt(CHAT, {"messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": "another one! " * 10}]}), "m")
    assert a.mode == TEXT and a.token_ids is None
    assert a.prompt_tokens == pytest.approx((len(system) + 160) / 4, abs=5)
    shared = len(system) // 64  # 16 tokens x 4 characters per block
    assert a.block_keys[:shared] == b.block_keys[:shared]
    assert a.block_keys != b.block_keys
    completion = await prompts.keys(prompt(COMPLETIONS, {"prompt": system}), "m")
    assert completion.mode == TEXT and len(completion.block_keys) == len(system) // 64
    assert not set(completion.block_keys) & set(block_keys([ord(c) for c in system], 64, root_key("m")))
    histogram = prompts._metrics.tokenize_duration.labels(TEXT)  # type: ignore[union-attr]
    assert histogram._sum.get() > 0
    prompts.close()


@pytest.mark.parametrize("with_tokenizer", [True, False])
async def test_tenants_with_different_salts_never_share_keys(tiny_model_dir: Path, with_tokenizer: bool) -> None:
    """With --tenant-header, the engines get a cache_salt in the tenant's namespace (a client's own salt inside
    it) and the keys follow it: no tenant, and no client without one, can reach another's cached prefixes."""
    prompts = service([str(tiny_model_dir)] if with_tokenizer else [], tenant_header="X-Tenant")
    body = {"model": "tiny", "messages": [{"role": "system", "content": words(5, 300)},
                                          {"role": "user", "content": "hi"}]}

    async def forwarded(extra: dict[str, Any], tenant: str | None) -> tuple[str | None, list[int]]:
        raw = orjson.dumps({**body, **extra})
        sent, api = with_tenant(raw, parse_body(CHAT, raw, model_required=True), tenant)
        assert api.prompt is not None and not isinstance(api.prompt, LargePrompt)
        found = await prompts.keys(api.prompt, "tiny")
        return orjson.loads(sent).get("cache_salt"), list(found.block_keys)

    plain = await forwarded({}, None)
    own = await forwarded({"cache_salt": "alice"}, None)
    bob = await forwarded({}, "bob")
    bob_alice = await forwarded({"cache_salt": "alice"}, "bob")
    forged = await forwarded({"cache_salt": "bob"}, None)  # a client without a tenant naming one
    odd = await forwarded({}, "org/team@x:y")
    assert [salt for salt, _ in (plain, own, bob, bob_alice, forged, odd)] == [
        None, ":alice", "bob", "bob:alice", ":bob", "org%2Fteam%40x%3Ay"]
    assert len(plain[1]) > 10
    runs = [keys for _, keys in (plain, own, bob, bob_alice, forged, odd)]
    for i, x in enumerate(runs):
        for y in runs[i + 1:]:
            assert not set(x) & set(y)
    prompts.close()


async def test_lora_adapter_uses_its_base_tokenizer_and_its_own_keys(tiny_model_dir: Path) -> None:
    prompts = service([f"tiny={tiny_model_dir}"])
    worker = Worker(spec=WorkerSpec("http://127.0.0.1:1"), healthy=True)
    worker.take_listing({"tiny": {"id": "tiny", "parent": None},
                         "sql-lora": {"id": "sql-lora", "root": "/adapters/sql", "parent": "tiny"}})
    assert worker.base_model == "tiny"
    assert worker.lora_base("sql-lora") == "tiny" and worker.lora_base("tiny") is None
    assert worker.lora_base("absent") is None
    body = {"messages": [{"role": "user", "content": words(9, 200)}]}
    lora = await prompts.keys(prompt(CHAT, body), "tiny", lora="sql-lora")
    base = await prompts.keys(prompt(CHAT, body), "tiny")
    assert lora.token_ids == base.token_ids and lora.token_ids  # tokenized by the base model's tokenizer
    assert lora.prompt_tokens == len(lora.token_ids)
    assert lora.block_keys and not set(lora.block_keys) & set(base.block_keys)
    prompts.close()
    # the gateway builds the request the strategy sees the same way, from the worker's model card
    config, strategy = assemble({"strategy": "prefix", "block_size": 16, "model_dir": [f"tiny={tiny_model_dir}"]})
    gateway = Gateway(config, strategy)
    assert gateway.prompts is not None
    for model, expected in (("sql-lora", lora), ("tiny", base)):
        api = read_payload(CHAT, {"model": model, **body}, model_required=True)
        route = await gateway.route_request(api, [worker], {})
        assert (route.model, route.block_keys, route.token_ids) == (model, expected.block_keys, expected.token_ids)
    gateway.prompts.close()


def test_model_dirs_and_hugging_face_cache_layout(tiny_model_dir: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    repo = hub / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    assert resolve_model_dir(tiny_model_dir) == tiny_model_dir
    assert resolve_model_dir(repo) == snapshot
    assert resolve_model_dir(hub, "acme/tiny-chat") == snapshot
    with pytest.raises(ConfigError):
        resolve_model_dir(hub, "acme/absent")
    assert parse_model_dirs([f"acme/tiny-chat={hub}", str(tiny_model_dir)]) == (
        {"acme/tiny-chat": str(hub)}, str(tiny_model_dir))
    with pytest.raises(ConfigError):
        parse_model_dirs([str(tiny_model_dir), str(hub)])
    with pytest.raises(ConfigError):
        service([f"acme/absent={hub}"])


async def test_long_prompts_are_tokenized_off_the_event_loop(tiny_model_dir: Path) -> None:
    prompts = service([str(tiny_model_dir)])
    await prompts.tokenizer("tiny")
    body = {"messages": [{"role": "user", "content": words(11, 60_000)}]}
    assert len(body["messages"][0]["content"]) > 100 * INLINE_CHARS
    gaps: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    started = time.perf_counter()
    found = await prompts.keys(prompt(CHAT, body), "tiny")
    took = time.perf_counter() - started
    stop.set()
    await task
    assert found.prompt_tokens > 50_000
    assert took > 0.02, took  # long enough that blocking the loop would show
    assert max(gaps) < took / 2, (max(gaps), took)
    prompts.close()


async def test_gateway_fills_route_keys_only_for_strategies_that_read_them(
    tiny_model_dir: Path, http: aiohttp.ClientSession,
) -> None:
    async with running_standin() as a, running_standin() as b:
        async with running_gateway([a.url, b.url], strategy="round_robin") as gw:
            assert gw.gateway.prompts is None
        async with running_gateway([a.url, b.url], strategy="prefix", model_dir=[str(tiny_model_dir)]) as gw:
            assert gw.gateway.prompts is not None
            system = words(2, 400)
            for i in range(6):
                body = {"model": "tiny", "max_tokens": 2,
                        "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]}
                async with http.post(gw.url + CHAT, json=body) as resp:
                    assert resp.status == 200, await resp.text()
            # one worker got them all: the first was a miss, the rest hits on the same worker
            assert sorted((a.stats.requests, b.stats.requests)) == [0, 6]
            async with http.get(gw.url + "/metrics") as resp:
                text = await resp.text()
            assert 'kvgate_routing_decisions_total{reason="miss",strategy="prefix"} 1.0' in text
            assert 'kvgate_routing_decisions_total{reason="hit",strategy="prefix"} 5.0' in text
            assert 'kvgate_tokenize_duration_seconds_count{mode="tokens"} 6.0' in text
            assert "kvgate_prefix_trie_nodes" in text and "kvgate_prefix_match_ratio_bucket" in text
            # removing the worker that holds the prefix purges it from the trie
            strategy = gw.gateway.strategy
            holder = a.url if a.stats.requests else b.url
            assert len(strategy.balance.trie) > 0  # type: ignore[attr-defined]
            async with http.delete(gw.url + "/admin/workers", params={"url": holder}) as resp:
                assert resp.status == 202
            await eventually(lambda: len(strategy.balance.trie) == 0)  # type: ignore[attr-defined]


async def test_next_turn_reuses_the_block_keys_of_the_previous_turn(tiny_model_dir: Path) -> None:
    prompts = service([str(tiny_model_dir)])
    messages: list[dict[str, Any]] = [{"role": "system", "content": words(1, 500)},
                                      {"role": "user", "content": words(2, 50)}]
    first = await prompts.keys(prompt(CHAT, {"messages": messages}), "tiny")
    assert prompts.cache.hits == 0
    messages += [{"role": "assistant", "content": words(3, 40)}, {"role": "user", "content": words(4, 30)}]
    second = await prompts.keys(prompt(CHAT, {"messages": messages}), "tiny")
    assert second.token_ids is not None
    assert second.block_keys == block_keys(second.token_ids, 16, root_key("tiny"))  # still exact
    assert second.block_keys[: len(first.block_keys) - 1] == first.block_keys[:-1]
    assert prompts.cache.hits == 1
    # a prompt diverging inside the first turn reuses only what it shares, and is still exact
    changed = [messages[0], {"role": "user", "content": words(2, 25) + " different"}]
    third = await prompts.keys(prompt(CHAT, {"messages": changed}), "tiny")
    assert third.token_ids is not None
    assert third.block_keys == block_keys(third.token_ids, 16, root_key("tiny"))
    prompts.close()


async def test_a_request_alone_is_tokenized_on_the_event_loop(tiny_model_dir: Path) -> None:
    """With no other request in flight, the hop to a tokenizer thread leaves the loop idle and puts two thread
    wake-ups on the request's path (one client, 4,000-character prompts, alternating rounds at load 6-7: CPU per
    request lower in 7 of 9 pairs, e.g. prefix chat 900 -> 717 us, added p50 0.97 -> 0.78 ms); with others in
    flight the thread keeps the loop free for them, and a body over ALONE_INLINE_BYTES always goes there."""
    on: list[int] = []

    class Recording(PromptTokens):
        def tokenize_now(self, *args: Any) -> Any:
            on.append(threading.get_ident())
            return super().tokenize_now(*args)

    prompts = Recording(GatewayConfig(model_dir=[str(tiny_model_dir)], block_size=16), GatewayMetrics())
    loop_thread = threading.get_ident()
    try:
        for content, alone, inline in ((words(1, 600), True, True), (words(1, 600), False, False),
                                       (words(2, 4000), True, False)):
            body = {"model": "tiny", "messages": [{"role": "system", "content": content},
                                                  {"role": "user", "content": "hi"}]}
            raw = orjson.dumps(body)
            assert len(raw) > INLINE_CHARS and (len(raw) <= ALONE_INLINE_BYTES) == (len(content) < 10_000)
            await prompts.keys(prompt(CHAT, body), "tiny", raw=raw, alone=alone)
            assert (on[-1] == loop_thread) == inline
    finally:
        prompts.close()


async def test_the_configured_tokenizers_are_loaded_before_the_first_request(
    tiny_model_dir: Path, tmp_path: Path, http: aiohttp.ClientSession,
) -> None:
    """A cold burst's first requests do not wait for the tokenizer to load (34 ms for the bench model on a busy
    machine, more for a large one): the gateway loads every configured model's at start-up. A tokenizer that cannot
    load leaves its model in text mode, as on a request, and the gateway starts."""
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    async with running_standin() as a, running_gateway([a.url], strategy="prefix",
                               model_dir=[str(tiny_model_dir), f"other={other}", f"broken={broken}"]) as gw:
        prompts = gw.gateway.prompts
        assert prompts is not None
        assert prompts.describe()["loaded"] == sorted([str(tiny_model_dir), str(other)])
        assert await prompts.tokenizer("broken") is None
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
        async with http.post(gw.url + CHAT, json=body) as resp:
            assert resp.status == 200, await resp.text()
        async with http.get(gw.url + "/metrics") as resp:
            assert 'kvgate_tokenize_duration_seconds_count{mode="tokens"} 1.0' in await resp.text()
