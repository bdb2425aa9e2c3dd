"""OpenAI-style request bodies, decoded and checked once at the edge: bad input becomes a 400 before any routing,
good input a typed `ApiRequest` holding only what the gateway reads (the proxy forwards the original bytes)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson
import xxhash

from router.errors import bad_request

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


# what vLLM's chat prompt rendering reads besides `messages` (router/tokenizer.py, `ModelTokenizer.prompt_ids`)
CHAT_TEMPLATE_FIELDS = ("tools", "documents", "chat_template", "chat_template_kwargs", "reasoning_effort",
                        "add_generation_prompt", "continue_final_message", "add_special_tokens")


# not frozen (this one and those below): one of each is built per request, and a frozen dataclass's __init__ costs
# 3x (960 against 270 ns, six fields)
@dataclass(slots=True)
class CompletionPrompt:
    """A `/v1/completions` prompt: text or token ids (a batch is routed by its first prompt)."""

    prompt: str | list[int]
    add_special_tokens: bool
    cache_salt: str | None

    def vllm_body(self) -> dict[str, Any]:
        """The fields vLLM turns into prompt token ids, as a request body (`ModelTokenizer.prompt_ids`)."""
        return {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens}


@dataclass(slots=True)
class ChatPrompt:
    """A `/v1/chat/completions` prompt: the messages and the chat-template settings sent with them."""

    messages: list[dict[str, Any]]
    template: dict[str, Any]  # the CHAT_TEMPLATE_FIELDS the request set, as sent
    cache_salt: str | None

    def vllm_body(self) -> dict[str, Any]:
        """The fields vLLM turns into prompt token ids, as a request body (`ModelTokenizer.prompt_ids`)."""
        return {"messages": self.messages, **self.template}


Prompt = CompletionPrompt | ChatPrompt


@dataclass(frozen=True, slots=True)
class LargePrompt:
    """The prompt of a body over `route_max_prompt_bytes`: not read, so routed by load alone (the engine judges it)."""

    size: int  # the body's bytes
    cache_salt: str | None


@dataclass(slots=True)
class ApiRequest:
    """A request body as the gateway reads it: its model, whether it streams, and its prompt (on the two
    generation endpoints)."""

    path: str
    model: str | None
    stream: bool
    prompt: Prompt | LargePrompt | None = None
    max_tokens: int | None = None  # the most tokens it may generate (max_completion_tokens, else max_tokens)


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


def parse_body(path: str, body: bytes, *, model_required: bool, large: int | None = None) -> ApiRequest:
    """Decode a JSON request body once and check the fields the gateway relies on (`read_payload`). A body over
    `large` bytes is read without its prompt (`parse_large_body`)."""
    if large is not None and len(body) > large:
        return parse_large_body(path, body, model_required=model_required)
    return read_payload(path, parse_json_object(body), model_required=model_required)


class _Envelope(msgspec.Struct):
    """What the gateway reads of a large body: everything but the prompt, which stays undecoded JSON."""

    model: Any = None
    stream: Any = None
    cache_salt: Any = None
    max_tokens: Any = None
    max_completion_tokens: Any = None
    n: Any = None
    prompt: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()


_ENVELOPE = msgspec.json.Decoder(_Envelope)


def parse_large_body(path: str, body: bytes, *, model_required: bool) -> ApiRequest:
    """A large body's fields, as `parse_body` checks them, with its prompt left as it came: a `LargePrompt`. The
    JSON is checked whole, but no Python object is made for the prompt's millions of tokens (msgspec's `Raw`), so
    it costs a few milliseconds per 10 MiB where parsing it costs seconds."""
    if not body:
        raise bad_request("request body is empty; expected a JSON object", "invalid_json")
    try:
        envelope = _ENVELOPE.decode(body)
    except msgspec.ValidationError:
        raise bad_request("request body must be a JSON object", "invalid_json") from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", "invalid_json") from None
    fields = {name: getattr(envelope, name) for name in ("model", "stream", "cache_salt", "max_tokens",
                                                         "max_completion_tokens", "n")}
    api = read_payload("", {k: v for k, v in fields.items() if v is not None}, model_required=model_required)
    prompt: LargePrompt | None = None
    if path == COMPLETIONS:
        if not envelope.prompt:
            raise bad_request("'prompt' is required", "missing_prompt")
        if memoryview(envelope.prompt)[:1].tobytes() not in (b'"', b"["):
            _check_prompt(orjson.loads(bytes(envelope.prompt)))  # not a list or string: small, and a 400
    elif path == CHAT_COMPLETIONS:
        if not envelope.messages:
            raise bad_request("'messages' is required", "missing_messages")
        if memoryview(envelope.messages)[:1].tobytes() != b"[":
            _check_messages(orjson.loads(bytes(envelope.messages)))
    if path in (COMPLETIONS, CHAT_COMPLETIONS):
        salt = envelope.cache_salt
        prompt = LargePrompt(len(body), salt if isinstance(salt, str) and salt else None)
    return dataclasses.replace(api, path=path, prompt=prompt)


def read_payload(path: str, payload: dict[str, Any], *, model_required: bool) -> ApiRequest:
    """Check the fields the gateway relies on; everything else is the engine's to judge."""
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
    salt = payload.get("cache_salt")
    cache_salt = salt if isinstance(salt, str) and salt else None
    prompt: Prompt | None = None
    if path == COMPLETIONS:
        if "prompt" not in payload:
            raise bad_request("'prompt' is required", "missing_prompt")
        given = payload["prompt"]
        _check_prompt(given)
        first = given[0] if isinstance(given, list) and isinstance(given[0], str | list) else given  # non-empty
        prompt = CompletionPrompt(first, bool(payload.get("add_special_tokens", True)), cache_salt)
    elif path == CHAT_COMPLETIONS:
        if "messages" not in payload:
            raise bad_request("'messages' is required", "missing_messages")
        _check_messages(payload["messages"])
        template = {name: payload[name] for name in CHAT_TEMPLATE_FIELDS if name in payload}
        prompt = ChatPrompt(payload["messages"], template, cache_salt)
    for name in ("max_tokens", "max_completion_tokens", "n"):
        value = payload.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise bad_request(f"'{name}' must be a non-negative integer", f"invalid_{name}")
    limit = payload.get("max_completion_tokens")
    if limit is None:
        limit = payload.get("max_tokens")
    return ApiRequest(path, model, stream, prompt, limit)


# vLLM takes a cache_salt of at most 128 characters without '@', '/', '\\' or NUL
_SALT_ESCAPES = {c: f"%{ord(c):02X}" for c in "%:@/\\\x00"}
_MAX_SALT = 128


def tenant_cache_salt(client_salt: str | None, tenant: str | None) -> str | None:
    """The cache_salt the engines get when the gateway names tenants (`--tenant-header`): the tenant's namespace,
    with the client's own salt inside it if it sent one: `TENANT`, `TENANT:SALT`, or `:SALT` for a request without
    a tenant (`%`, `:`, `@`, `/`, `\\` and NUL in a tenant name percent-encoded), so no client can reach another
    tenant's cached prefixes. One over vLLM's 128 characters becomes `h:` and a 128-bit hash of it."""
    if tenant:
        name = "".join(_SALT_ESCAPES.get(c, c) for c in tenant)
        salt = f"{name}:{client_salt}" if client_salt else name
    elif client_salt:
        salt = f":{client_salt}"
    else:
        return None
    return salt if len(salt) <= _MAX_SALT else "h:" + xxhash.xxh3_128_hexdigest(salt.encode())


def with_tenant(body: bytes, api: ApiRequest, tenant: str | None) -> tuple[bytes, ApiRequest]:
    """The body and request as forwarded when the gateway names tenants: `cache_salt` set to `tenant_cache_salt`,
    appended as the JSON object's last member (a client's own `cache_salt`, however spelled, comes before it, and
    JSON parsers, vLLM's included, take the last of duplicate members)."""
    if api.prompt is None:
        return body, api
    salt = tenant_cache_salt(api.prompt.cache_salt, tenant)
    if salt is None or salt == api.prompt.cache_salt:
        return body, api
    end = body.rindex(b"}")
    comma = b"," if body[:end].rstrip()[-1:] != b"{" else b""
    body = b"".join((body[:end], comma, b'"cache_salt":', orjson.dumps(salt), body[end:]))
    return body, dataclasses.replace(api, prompt=dataclasses.replace(api.prompt, cache_salt=salt))
