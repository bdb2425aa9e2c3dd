"""The tokenizer's fallbacks: where the gateway cannot reproduce vLLM's ids for a request (a template that refuses
it, a tokenizer without a chat template), that request alone is routed by its text, labelled as such, and still
answered; what the tokenizer can reproduce stays exact, and a refused request leaves no trace in the cache that
serves the next one."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp

from router.block_keys import block_keys, root_key
from router.config import GatewayConfig
from router.metrics import GatewayMetrics
from router.prompt_tokens import TEXT, TOKENS, PromptTokens
from router.requests import LargePrompt, read_payload
from router.tokenizer import ModelTokenizer
from tests.conftest import running_gateway, running_standin

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
# refuses a conversation that opens with a system message, as some models' templates do
STRICT = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
          "{{ bos_token }}{% for m in messages %}"
          "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def model_with_template(source: Path, target: Path, template: str | None) -> Path:
    """A copy of the tiny model whose tokenizer has `template` as its chat template (None: none at all)."""
    shutil.copytree(source, target)
    config_path = target / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if template is None:
        config.pop("chat_template", None)
    else:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return target


async def keys_of(prompts: PromptTokens, path: str, body: dict[str, Any], model: str = "tiny") -> Any:
    found = read_payload(path, {"model": model, **body}, model_required=False).prompt
    assert found is not None and not isinstance(found, LargePrompt)
    return await prompts.keys(found, model)


async def test_a_chat_the_template_refuses_is_routed_by_text_and_the_next_is_exact_again(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    model = model_with_template(tiny_model_dir, tmp_path / "strict", STRICT)
    prompts = PromptTokens(GatewayConfig(model_dir=[str(model)], block_size=16), GatewayMetrics())
    reference = ModelTokenizer(model)
    question = [{"role": "user", "content": "what is the capital of France? " * 20}]
    refused = [{"role": "system", "content": "You are terse. " * 20}, *question]
    try:
        for _ in range(2):  # alternating: a refusal caches nothing the exact path then reuses
            by_text = await keys_of(prompts, CHAT, {"messages": refused})
            assert by_text.mode == TEXT and by_text.token_ids is None and by_text.block_keys
            exact = await keys_of(prompts, CHAT, {"messages": question})
            expected = reference.prompt_ids({"messages": question}, chat=True)
            assert exact.mode == TOKENS and list(exact.token_ids) == expected
            assert exact.block_keys == block_keys(expected, 16, root_key("tiny"))
    finally:
        prompts.close()


async def test_a_tokenizer_without_a_chat_template_keeps_completions_exact(tiny_model_dir: Path,
                                                                           tmp_path: Path) -> None:
    model = model_with_template(tiny_model_dir, tmp_path / "base", None)
    prompts = PromptTokens(GatewayConfig(model_dir=[str(model)], block_size=16), GatewayMetrics())
    text = "the quick brown fox jumps over the lazy dog " * 10
    try:
        chat = await keys_of(prompts, CHAT, {"messages": [{"role": "user", "content": text}]})
        assert chat.mode == TEXT and chat.token_ids is None
        completion = await keys_of(prompts, COMPLETIONS, {"prompt": text})
        expected = ModelTokenizer(model).encode(text, add_special_tokens=True)
        assert completion.mode == TOKENS and list(completion.token_ids) == expected
    finally:
        prompts.close()


async def test_the_gateway_answers_a_refused_chat_and_labels_it_text(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = model_with_template(tiny_model_dir, tmp_path / "strict", STRICT)
    system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    async with (running_standin() as worker,
                running_gateway([worker.url], strategy="prefix", model_dir=[f"tiny={model}"]) as gw,
                aiohttp.ClientSession() as http):
        for messages in (system, system[1:]):
            async with http.post(gw.url + CHAT, json={"model": "tiny", "messages": messages}) as resp:
                assert resp.status == 200
        async with http.get(gw.url + "/metrics") as resp:
            metrics = await resp.text()
    counts = {mode: float(line.split()[-1]) for mode in (TEXT, TOKENS) for line in metrics.splitlines()
              if line.startswith(f'kvgate_tokenize_duration_seconds_count{{mode="{mode}"}}')}
    assert counts == {TEXT: 1.0, TOKENS: 1.0}


async def test_a_model_whose_tokenizer_appears_later_is_looked_for_again_after_a_backoff(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    hub = tmp_path / "hub"  # a Hugging Face cache the model is still being downloaded into
    hub.mkdir()
    prompts = PromptTokens(GatewayConfig(model_dir=[str(hub)], block_size=16), GatewayMetrics())
    prompts.retry_first_s = 0.5
    body = {"prompt": "the quick brown fox jumps over the lazy dog " * 4}
    try:
        await prompts.start()
        assert (await keys_of(prompts, COMPLETIONS, body, "org/m")).mode == TEXT
        shutil.copytree(tiny_model_dir, hub / "models--org--m" / "snapshots" / "abc")
        assert (await keys_of(prompts, COMPLETIONS, body, "org/m")).mode == TEXT  # not before its backoff
        await asyncio.sleep(0.6)
        found = await keys_of(prompts, COMPLETIONS, body, "org/m")
        assert found.mode == TOKENS
        assert list(found.token_ids) == ModelTokenizer(tiny_model_dir).encode(body["prompt"], add_special_tokens=True)
    finally:
        prompts.close()


async def test_a_tokenizer_that_failed_to_load_is_loaded_again_after_a_backoff(tiny_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    model = model_with_template(tiny_model_dir, tmp_path / "broken", None)
    config = (model / "tokenizer_config.json").read_text()
    (model / "tokenizer_config.json").write_text(config[:len(config) // 2])  # caught mid-write
    prompts = PromptTokens(GatewayConfig(model_dir=[f"tiny={model}"], block_size=16), GatewayMetrics())
    prompts.retry_first_s = 0.5
    body = {"prompt": "the quick brown fox jumps over the lazy dog " * 4}
    try:
        await prompts.start()
        assert (await keys_of(prompts, COMPLETIONS, body)).mode == TEXT
        (model / "tokenizer_config.json").write_text(config)
        assert (await keys_of(prompts, COMPLETIONS, body)).mode == TEXT  # not before its backoff
        await asyncio.sleep(0.6)
        assert (await keys_of(prompts, COMPLETIONS, body)).mode == TOKENS
    finally:
        prompts.close()


def text_and_token_counts(metrics: str) -> dict[str, float]:
    return {mode: float(line.split()[-1]) for mode in (TEXT, TOKENS) for line in metrics.splitlines()
            if line.startswith(f'kvgate_tokenize_duration_seconds_count{{mode="{mode}"}}')}


async def test_a_template_that_fails_its_arithmetic_on_a_clients_kwargs_is_routed_by_text(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    # `1 / n` with n = 0 raises ZeroDivisionError, `range(n)` with a huge n OverflowError: neither a jinja error
    template = ("{% if every is defined %}{{ (messages | length) / every }}{% endif %}"
                "{% if upto is defined %}{{ range(upto) | length }}{% endif %}"
                "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    model = model_with_template(tiny_model_dir, tmp_path / "arith", template)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    async with (running_standin() as worker,
                running_gateway([worker.url], strategy="prefix", model_dir=[f"tiny={model}"]) as gw,
                aiohttp.ClientSession() as http):
        for kwargs in ({"every": 0}, {"upto": 10**30}, {"every": 2}):
            async with http.post(gw.url + CHAT, json={**chat, "chat_template_kwargs": kwargs}) as resp:
                assert resp.status == 200, await resp.text()
        async with http.get(gw.url + "/metrics") as resp:
            assert text_and_token_counts(await resp.text()) == {TEXT: 2.0, TOKENS: 1.0}


def fallbacks(metrics: GatewayMetrics) -> dict[str, float]:
    return {sample.labels["reason"]: sample.value for family in metrics.tokenize_fallbacks.collect()
            for sample in family.samples if sample.name.endswith("_total")}


async def test_a_lora_adapter_whose_base_has_no_tokenizer_is_keyed_by_text_under_its_own_name(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    metrics = GatewayMetrics()
    prompts = PromptTokens(GatewayConfig(model_dir=[f"tiny={tiny_model_dir}", str(tmp_path)], block_size=16), metrics)
    found = read_payload(COMPLETIONS, {"model": "x", "prompt": "the quick brown fox jumps " * 20},
                         model_required=False).prompt
    assert found is not None and not isinstance(found, LargePrompt)
    try:
        plain, adapter, other = [await prompts.keys(found, "base", lora=lora) for lora in (None, "sql", "chat")]
        assert plain.mode == adapter.mode == other.mode == TEXT
        assert len({plain.block_keys[0], adapter.block_keys[0], other.block_keys[0]}) == 3  # never shared
        assert fallbacks(metrics) == {"no_tokenizer": 3.0}
        assert (await prompts.keys(found, "tiny", lora="sql")).mode == TOKENS
        assert fallbacks(metrics) == {"no_tokenizer": 3.0}
    finally:
        prompts.close()


async def test_without_any_tokenizer_configured_text_mode_is_no_fallback(tiny_model_dir: Path) -> None:
    metrics = GatewayMetrics()
    prompts = PromptTokens(GatewayConfig(block_size=16), metrics)
    try:
        assert (await keys_of(prompts, COMPLETIONS, {"prompt": "hello " * 50})).mode == TEXT
        assert (await keys_of(prompts, COMPLETIONS, {"prompt": [1, 2, 3] * 10})).mode == TOKENS  # ids are exact
        assert fallbacks(metrics) == {}
    finally:
        prompts.close()


async def test_what_the_gateway_answers_and_counts_for_each_odd_request(tiny_model_dir: Path) -> None:
    """Served (routed by text where the tokenizer refuses) unless the body is not what vLLM's API takes; never a 500.
    Each case: path, body, status, the mode it was routed in (None: not tokenized) and whether a refusal counted."""
    hi = [{"role": "user", "content": "hi"}]
    cases: list[tuple[str, dict[str, Any], int, str | None]] = [
        (CHAT, {"messages": hi, "continue_final_message": True, "add_generation_prompt": True}, 200, TEXT),
        (CHAT, {"messages": [*hi, {"role": "assistant", "content": "Hel"}], "continue_final_message": True,
                "add_generation_prompt": False}, 200, TOKENS),
        (CHAT, {"messages": hi, "add_special_tokens": True, "add_generation_prompt": False}, 200, TOKENS),
        (CHAT, {"messages": hi, "tools": [{"x": 1}]}, 200, TEXT),
        (CHAT, {"messages": hi, "tools": {"x": 1}}, 200, TEXT),
        (CHAT, {"messages": hi, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, 200,
         TOKENS),
        (CHAT, {"messages": hi, "documents": [{"title": "t", "text": "x"}]}, 200, TOKENS),
        (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 200,
         TEXT),
        (CHAT, {"messages": hi, "chat_template_kwargs": {"tokenize": True}}, 200, TEXT),
        (CHAT, {"messages": hi, "chat_template_kwargs": [1]}, 200, TEXT),
        (CHAT, {"messages": [{"role": "user", "content": ""}]}, 200, TOKENS),
        (COMPLETIONS, {"prompt": ""}, 200, TOKENS),
        (COMPLETIONS, {"prompt": [1, 10**6]}, 200, TOKENS),  # beyond the vocabulary: the engine's to refuse
        (COMPLETIONS, {"prompt": [-1, 2]}, 400, None),
        (COMPLETIONS, {"prompt": [1, 2**32]}, 400, None),
        (COMPLETIONS, {"prompt": [True, 1]}, 400, None),
        (COMPLETIONS, {"prompt": [1, "a"]}, 400, None),
        (COMPLETIONS, {"prompt": [1.0, 2]}, 400, None),
    ]
    async with (running_standin() as worker,
                running_gateway([worker.url], strategy="prefix", model_dir=[f"tiny={tiny_model_dir}"]) as gw,
                aiohttp.ClientSession() as http):
        seen: list[tuple[int, str | None]] = []
        counted = {TEXT: 0.0, TOKENS: 0.0}
        for path, body, _, _ in cases:
            async with http.post(gw.url + path, json={"model": "tiny", **body}) as resp:
                status = resp.status
            async with http.get(gw.url + "/metrics") as resp:
                now = text_and_token_counts(await resp.text())
            mode = next((m for m in (TEXT, TOKENS) if now.get(m, 0.0) > counted[m]), None)
            counted.update(now)
            seen.append((status, mode))
        assert seen == [(status, mode) for _, _, status, mode in cases]
        assert worker.stats.requests == sum(status == 200 for _, _, status, _ in cases)
        assert fallbacks(gw.gateway.metrics) == {"refused": float(sum(mode == TEXT for *_, mode in cases))}


async def test_text_mode_renders_any_body_the_tokenizer_refused_instead_of_a_500(tiny_model_dir: Path) -> None:
    """A text part whose `text` is not a string, tools nested deeper than orjson writes (255): the tokenizer
    refuses both, and text mode, the fallback, must not fail on them in turn (it answered 500)."""
    deep: dict[str, Any] = {}
    for _ in range(300):
        deep = {"a": deep}
    odd: list[dict[str, Any]] = [{"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
           for text in (5, {"a": 1}, ["x"])]
    odd.append({"messages": [{"role": "user", "content": "hi"}], "tools": [{"not_a_function": deep}]})
    for model_dir in ([f"tiny={tiny_model_dir}"], []):
        async with (running_standin() as worker,
                    running_gateway([worker.url], strategy="prefix", model_dir=model_dir) as gw,
                    aiohttp.ClientSession() as http):
            for n, body in enumerate(odd, 1):
                async with http.post(gw.url + CHAT, json={"model": "tiny", **body}) as resp:
                    assert "internal_error" not in await resp.text(), body
                assert worker.stats.requests == n  # forwarded: the engine judges it
            async with http.get(gw.url + "/metrics") as resp:
                assert text_and_token_counts(await resp.text()) == {TEXT: float(len(odd))}
