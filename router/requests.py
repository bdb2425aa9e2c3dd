"""Validation of OpenAI-style request bodies at the edge: bad input becomes a 400 before any routing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from router.errors import GatewayError, bad_request

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class ParsedBody:
    payload: dict[str, Any]
    model: str | None
    stream: bool


def parse_json_object(body: bytes) -> dict[str, Any]:
    if not body:
        raise bad_request("request body is empty; expected a JSON object", "invalid_json")
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object", "invalid_json")
    return payload


MAX_TOKEN_ID = 2**32 - 1  # token ids are hashed as uint32, as vLLM's engines hold them


def _is_token_list(value: Any) -> bool:
    """Whether `value` is a list of token ids; ids outside uint32 are a 400 of their own."""
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return False
    if value and not 0 <= min(value) <= max(value) <= MAX_TOKEN_ID:
        raise bad_request(f"token ids must be integers from 0 to {MAX_TOKEN_ID}", "invalid_prompt")
    return True


def _check_prompt(prompt: Any) -> None:
    if isinstance(prompt, str) or (_is_token_list(prompt) and prompt):
        return
    if isinstance(prompt, list) and prompt and (
        all(isinstance(p, str) for p in prompt) or all(_is_token_list(p) and p for p in prompt)
    ):
        return
    raise bad_request(
        "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists",
        "invalid_prompt",
    )


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list of message objects", "invalid_messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", "invalid_messages")
        if not isinstance(message.get("role"), str):
            raise bad_request(f"messages[{i}].role must be a string", "invalid_messages")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise bad_request(f"messages[{i}].content must be a string or a list of parts", "invalid_messages")


def parse_body(path: str, body: bytes, *, model_required: bool) -> ParsedBody:
    """Check the fields the gateway relies on; everything else is the engine's to judge."""
    payload = parse_json_object(body)
    model = payload.get("model")
    if model is None:
        if model_required:
            raise bad_request("'model' is required", "missing_model")
    elif not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "invalid_model")
    stream = payload.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "invalid_stream")
    if path == COMPLETIONS:
        if "prompt" not in payload:
            raise bad_request("'prompt' is required", "missing_prompt")
        _check_prompt(payload["prompt"])
    elif path == CHAT_COMPLETIONS:
        if "messages" not in payload:
            raise bad_request("'messages' is required", "missing_messages")
        _check_messages(payload["messages"])
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = payload.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise bad_request(f"'{name}' must be a non-negative integer", f"invalid_{name}")
    return ParsedBody(payload=payload, model=model, stream=stream)


def unknown_model(model: str) -> GatewayError:
    return GatewayError(
        404, f"The model `{model}` does not exist.", type="NotFoundError", code="model_not_found"
    )
