"""One simulated replica's HTTP server: vLLM's OpenAI-compatible API over the simulated engine.

Routes and formats follow vLLM 0.32: `/v1/completions` and `/v1/chat/completions` (JSON or SSE chunks ending in
`data: [DONE]`), `/v1/models`, `/health`, `/version`, `/tokenize`, `/detokenize`, `/metrics`,
`POST /reset_prefix_cache`; errors are `{"error": {"message", "type", "param", "code"}}`. `GET /sim/blocks` shows
the cached block set (what KV events announced) for tests and debugging.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from bench.sim.agent_link import AgentConnector
from bench.sim.config import ReplicaConfig
from bench.sim.engine import SimEngine
from bench.sim.metrics import SimCollector, metrics_registry, render
from bench.sim.scheduler import SimRequest
from kvcore.kv_events import KvEventPublisher
from kvcore.vllm_hash import cache_salt_extra_keys, chain_hashes, make_block_hasher
from router.tokenizer import ModelTokenizer, TokenizationError

log = logging.getLogger(__name__)

VERSION = "0.32.0+kvgate.sim"
JSON = "application/json"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
DONE = b"data: [DONE]\n\n"
OFFLOAD_BYTES = 16 * 1024  # request bodies above this are tokenized off the event loop


class ApiError(Exception):
    """A request vLLM would refuse: status, OpenAI-style type and message."""

    def __init__(self, status: int, message: str, type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.type)


def error_response(status: int, message: str, type: str = "BadRequestError",
                   param: str | None = None) -> web.Response:
    body = {"error": {"message": message, "type": type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type=JSON)


class InvalidRequest(ApiError):
    """A body that does not validate: vLLM answers these from its RequestValidationError handler, with
    type "Bad Request", the field as `param` and a "1 validation error:" message."""

    def __init__(self, param: str, message: str, kind: str = "value_error") -> None:
        super().__init__(400, f"1 validation error:\n  {{'type': '{kind}', 'loc': '{param}', 'msg': '{message}'}}",
                         "Bad Request")
        self.param = param

    def response(self) -> web.Response:
        return error_response(self.status, self.message, self.type, self.param)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type=JSON)


_WORD = re.compile(r"^ [a-z]{2,10}$")


class OutputVocabulary:
    """The synthetic output: a fixed table of word tokens, cycled from a start that depends on the prompt."""

    def __init__(self, tokenizer: ModelTokenizer, size: int = 64) -> None:
        ids: list[int] = []
        for tid in range(tokenizer.vocab_size):
            if _WORD.match(tokenizer.decode([tid])):
                ids.append(tid)
                if len(ids) == size:
                    break
        if not ids:  # an unusual vocabulary: take any plain tokens
            ids = [t for t in range(tokenizer.vocab_size) if tokenizer.decode([t], skip_special_tokens=True)][:size]
        self.ids = ids
        self.text = {tid: tokenizer.decode([tid]) for tid in ids}
        self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else -1
        self.text[self.eos_token_id] = ""
        self.json_text = {tid: orjson.dumps(text) for tid, text in self.text.items()}  # for streamed chunks

    def plan(self, prompt: list[int]) -> list[int]:
        start = (sum(prompt[-8:]) + len(prompt)) % len(self.ids)
        return self.ids[start:] + self.ids[:start]

    def detokenize(self, ids: list[int]) -> str:
        text = self.text
        return "".join([text[t] for t in ids])


class Replica:
    """The app state of one replica: config, tokenizer, engine, metrics."""

    def __init__(self, config: ReplicaConfig) -> None:
        self.config = config
        self.tokenizer = ModelTokenizer(config.tokenizer_dir)
        self.vocab = OutputVocabulary(self.tokenizer)
        hasher, to_event = make_block_hasher(config.hash_algo)
        publisher = None
        if config.kv_events is not None:
            ev = config.kv_events
            publisher = KvEventPublisher(ev.endpoint, ev.replay_endpoint, topic=ev.topic,
                                         buffer_steps=ev.buffer_steps, hwm=ev.hwm)
        connector = AgentConnector(config.agent) if config.agent is not None else None
        self.engine = SimEngine(config.engine, config.profile, hasher, to_event, publisher, connector=connector)
        self.hasher = hasher
        self.model_names = frozenset(config.served_model_names)
        self.default_model = config.served_model_names[0]
        self.collector = SimCollector(self.default_model, self.engine.counters, self.engine.gauges)
        self.registry = metrics_registry(self.collector)
        self.created = int(time.time())
        # token ids above the tokenizer's are accepted up to the model's vocabulary (as vLLM)
        self.vocab_size = max(self.tokenizer.vocab_size, _config_vocab_size(config.model_dir))

    # --- building requests -------------------------------------------------------------------------------------

    def check_model(self, body: Mapping[str, Any]) -> str:
        model = body.get("model")
        if model is None:
            return self.default_model
        if model not in self.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError")
        return str(model)

    def new_request(self, prompt: list[int], max_tokens: int | None, ignore_eos: bool,
                    listener: Callable[[SimRequest], None], cache_salt: str | None = None) -> SimRequest:
        max_len = self.config.engine.max_model_len
        n = len(prompt)
        # vLLM 0.32's checks and messages (renderers/params.py, v1/engine/input_processor.py)
        if n == 0:
            raise ApiError(400, "The decoder prompt cannot be empty")
        if n > max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. However, your prompt "
                                f"contains {n} input tokens, which exceeds this limit even without any output "
                                f"tokens. Please reduce the length of the input prompt.")
        if n == max_len:
            raise ApiError(400, f"The decoder prompt (length {n}) plus the number of requested output tokens (at "
                                f"least 1) is longer than the maximum model length of {max_len}. Make sure that "
                                f"`max_model_len` is no smaller than the number of text tokens (prompt + "
                                f"requested output tokens).")
        stop_at = None
        if max_tokens is None:
            stop_at = None if ignore_eos else self.config.output_len
            max_tokens = max_len - n
        else:
            max_tokens = min(max_tokens, max_len - n)  # vLLM clamps to the room left in the context
        if stop_at is not None and stop_at >= max_tokens:
            stop_at = None
        extra = cache_salt_extra_keys(cache_salt)
        hashes = chain_hashes(self.hasher, prompt, self.config.engine.block_size, extra)
        return SimRequest(os.urandom(8).hex(), prompt, max_tokens, self.vocab.plan(prompt), hashes, time.monotonic(),
                          stop_at=stop_at,
                          eos_token_id=self.vocab.eos_token_id, listener=listener, first_block_extra=extra)


REPLICA = web.AppKey("replica", Replica)


def _config_vocab_size(model_dir: str) -> int:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            value = orjson.loads(f.read()).get("vocab_size")
    except (OSError, orjson.JSONDecodeError):
        return 0
    return value if isinstance(value, int) else 0


def _int_field(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"body.{name}", "Input should be a valid integer", "int_type")
    if value < minimum:
        raise InvalidRequest(f"body.{name}", f"Input should be greater than or equal to {minimum}",
                             "greater_than_equal")
    return value


async def _read_json(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest("body", f"JSON decode error ({exc})", "json_invalid") from exc
    if not isinstance(body, dict):
        raise InvalidRequest("body", "Input should be a valid dictionary", "model_attributes_type")
    return body


def _prompts(body: Mapping[str, Any]) -> list[Any]:
    """A completions `prompt` as a list of single prompts (text or token ids), as vLLM accepts it."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if type(prompt[0]) is int:
            return [prompt]  # token ids, checked by the caller
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            return list(prompt)
    if prompt is None:
        raise InvalidRequest("body.prompt", "Field required", "missing")
    raise InvalidRequest("body.prompt", "Input should be a string, a list of strings, a list of token ids or a "
                                        "list of lists of token ids", "union_tag_invalid")


class _Sequence:
    """One sequence of a request as its handler sees it: the engine request and a wake-up event."""

    __slots__ = ("event", "request", "sent")

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.sent = 0
        self.request: SimRequest

    def notify(self, _request: SimRequest) -> None:
        self.event.set()


def _usage(replica: Replica, requests: list[SimRequest], stream_final: bool = False) -> dict[str, Any]:
    """vLLM's UsageInfo; in the streamed usage chunk None fields are left out (exclude_none)."""
    prompt = sum(r.num_prompt_tokens for r in requests)
    completion = sum(len(r.output_token_ids) for r in requests)
    usage: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                             "completion_tokens": completion}
    if replica.config.enable_prompt_tokens_details:
        usage["prompt_tokens_details"] = {"cached_tokens": max(requests[-1].num_cached_tokens, 0)}
    elif not stream_final:
        usage["prompt_tokens_details"] = None
    if not stream_final:
        usage["completion_tokens_details"] = None
    return usage


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    replica = request.app[REPLICA]
    try:
        body = await _read_json(request)
        model = replica.check_model(body)
        max_tokens = _int_field(body, "max_completion_tokens", 1) if chat else None
        if max_tokens is None:
            max_tokens = _int_field(body, "max_tokens", 1)
        if max_tokens is None and not chat:
            max_tokens = 16  # vLLM's default for /v1/completions
        n = _int_field(body, "n", 1)
        if n is not None and n != 1:
            raise InvalidRequest("body.n", "the simulator supports n=1 only")
        ignore_eos = bool(body.get("ignore_eos", False))
        return_ids = bool(body.get("return_token_ids", False))
        stream = bool(body.get("stream", False))
        stream_options = body.get("stream_options") or {}
        if not isinstance(stream_options, dict):
            raise InvalidRequest("body.stream_options", "Input should be a valid dictionary", "dict_type")
        if stream_options and not stream:
            raise InvalidRequest("body", "Value error, Stream options can only be defined when `stream=True`.")
        # a long request is tokenized in a thread, so the engine's steps keep their pace meanwhile
        offload = (request.content_length or 0) > OFFLOAD_BYTES
        if chat:
            if offload:
                prompts = [await asyncio.get_running_loop().run_in_executor(
                    None, functools.partial(replica.tokenizer.prompt_ids, body, chat=True))]
            else:
                prompts = [replica.tokenizer.prompt_ids(body, chat=True)]
        else:
            prompts = []
            for p in _prompts(body):
                if isinstance(p, list):  # token ids from the client: check them as vLLM does
                    if not all(type(t) is int for t in p):
                        raise InvalidRequest("body.prompt", "Input should be a valid integer", "int_type")
                    if p and (max(p) >= replica.vocab_size or min(p) < 0):
                        bad = max(p) if max(p) >= replica.vocab_size else min(p)
                        raise ApiError(400, f"Token id {bad} is out of vocabulary")
                    prompts.append(p)
                else:
                    encode = functools.partial(replica.tokenizer.encode, p,
                                               add_special_tokens=bool(body.get("add_special_tokens", True)))
                    prompts.append(await asyncio.get_running_loop().run_in_executor(None, encode)
                                   if offload else encode())
        cache_salt = body.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string if provided.")
        seqs: list[_Sequence] = []
        for p in prompts:
            seq = _Sequence()
            seq.request = replica.new_request(p, max_tokens, ignore_eos, seq.notify, cache_salt)
            seqs.append(seq)
    except TokenizationError as exc:
        return error_response(400, str(exc))
    except ApiError as exc:
        return exc.response()

    engine = replica.engine
    if engine.dead is not None:
        return error_response(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                              "EngineDeadError")
    prefix = "chatcmpl-" if chat else "cmpl-"
    rid = prefix + seqs[0].request.request_id
    created = int(time.time())
    for seq in seqs:
        engine.add_request(seq.request)
    try:
        async with asyncio.timeout(replica.config.request_timeout_s):
            if stream:
                return await _stream(request, replica, seqs, chat, rid, created, model,
                                     bool(stream_options.get("include_usage")), return_ids)
            for seq in seqs:
                while not seq.request.finished:
                    seq.event.clear()
                    await seq.event.wait()
    except TimeoutError:
        if stream:  # the headers are out: the stream breaks off, as vLLM's does when a request is aborted
            raise
        return error_response(504, "request timed out in the simulated engine", "TimeoutError")
    finally:
        for seq in seqs:
            if not seq.request.finished:
                engine.abort(seq.request.request_id)
    if engine.dead is not None:
        return error_response(500, "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                              "EngineDeadError")
    requests_ = [s.request for s in seqs]
    text = replica.vocab.detokenize
    if chat:
        r = requests_[0]
        out: dict[str, Any] = {
            "id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {
                "role": "assistant", "content": text(r.output_token_ids), "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "reasoning": None},
                "logprobs": None, "finish_reason": r.finish_reason, "stop_reason": None,
                "token_ids": r.output_token_ids if return_ids else None, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": None, "usage": _usage(replica, requests_),
            "prompt_logprobs": None, "prompt_token_ids": r.all_token_ids[:r.num_prompt_tokens] if return_ids else None,
            "prompt_text": None, "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
    else:
        out = {
            "id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": text(r.output_token_ids), "logprobs": None,
                         "finish_reason": r.finish_reason, "stop_reason": None,
                         "token_ids": r.output_token_ids if return_ids else None, "prompt_logprobs": None,
                         "prompt_token_ids": r.all_token_ids[:r.num_prompt_tokens] if return_ids else None,
                         "routed_experts": None}
                        for i, r in enumerate(requests_)],
            "service_tier": None, "system_fingerprint": None, "usage": _usage(replica, requests_),
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None,
        }
    return _json(out)


async def _stream(request: web.Request, replica: Replica, seqs: list[_Sequence], chat: bool, rid: str,
                  created: int, model: str, include_usage: bool, return_ids: bool) -> web.StreamResponse:
    """vLLM's SSE chunks (serialised with exclude_unset): one per token, a role chunk first for chat, an
    optional usage chunk, then `data: [DONE]`. As in vLLM, even the role chunk waits for the engine's first
    output, so a client's time to first byte is the time to first token."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    text = replica.vocab.text
    dumps = orjson.dumps
    obj = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        first = {"id": rid, "object": obj, "created": created, "model": model,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}],
                 "prompt_token_ids": seqs[0].request.all_token_ids[:seqs[0].request.num_prompt_tokens]
                 if return_ids else None,
                 "prompt_text": None}
        role_chunk = b"data: " + dumps(first) + b"\n\n"
    else:
        role_chunk = b""
    # the chunk of a token that is neither the last nor carries ids is `pre + "text" + post`: built once
    json_text = replica.vocab.json_text
    fast = not return_ids
    head = dumps({"id": rid, "object": obj, "created": created, "model": model})[:-1]
    if chat:
        pres = [b"data: " + head + b',"choices":[{"index":%d,"delta":{"content":' % i for i in range(len(seqs))]
        post = b'},"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
    else:
        pres = [b"data: " + head + b',"choices":[{"index":%d,"text":' % i for i in range(len(seqs))]
        post = (b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
                b'"token_ids":null}]}\n\n')
    pending = list(seqs)
    while pending:
        # wait until any sequence has news; one engine step usually updates all of them
        if not any(s.event.is_set() for s in pending):
            if len(pending) == 1:
                await pending[0].event.wait()
            else:
                waiters = [asyncio.ensure_future(s.event.wait()) for s in pending]
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
        parts: list[bytes] = [role_chunk] if role_chunk else []
        role_chunk = b""
        for i, seq in enumerate(seqs):
            if not seq.event.is_set():
                continue
            seq.event.clear()
            r = seq.request
            tokens = r.output_token_ids
            end = len(tokens)
            while seq.sent < end:
                tok = tokens[seq.sent]
                first_chunk = seq.sent == 0
                seq.sent += 1
                last = seq.sent == end and r.finished
                if fast and not last:
                    parts.append(pres[i] + json_text[tok] + post)
                    continue
                finish = r.finish_reason if last else None
                if chat:
                    choice: dict[str, Any] = {"index": i, "delta": {"content": text[tok]}, "logprobs": None,
                                              "finish_reason": finish}
                    if last:
                        choice["stop_reason"] = None
                    choice["token_ids"] = [tok] if return_ids else None
                else:
                    choice = {"index": i, "text": text[tok], "logprobs": None, "finish_reason": finish,
                              "stop_reason": None}
                    choice["prompt_token_ids"] = (r.all_token_ids[:r.num_prompt_tokens]
                                                  if return_ids and first_chunk else None)
                    choice["token_ids"] = [tok] if return_ids else None
                chunk = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
                parts.append(b"data: " + dumps(chunk) + b"\n\n")
            if r.finished and seq in pending:
                pending.remove(seq)
        if not pending:  # the last tokens, the usage chunk and [DONE] go out in one write
            if include_usage:
                usage = _usage(replica, [s.request for s in seqs], stream_final=True)
                parts.append(b"data: " + dumps({"id": rid, "object": obj, "created": created, "model": model,
                                                "choices": [], "usage": usage}) + b"\n\n")
            parts.append(DONE)
        if parts:
            await response.write(b"".join(parts))
    await response.write_eof()
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    data = [{"id": name, "object": "model", "created": replica.created, "owned_by": "vllm",
             "root": replica.config.model_dir, "parent": None, "max_model_len": replica.config.engine.max_model_len,
             "permission": [{"id": f"modelperm-{name}", "object": "model_permission", "created": replica.created,
                             "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                             "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                             "organization": "*", "group": None, "is_blocking": False}]}
            for name in replica.config.served_model_names]
    return _json({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    # vLLM answers 500 once its engine core is dead
    return web.Response(status=500 if request.app[REPLICA].engine.dead is not None else 200)


async def version(request: web.Request) -> web.Response:
    return _json({"version": VERSION})


async def tokenize(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    try:
        body = await _read_json(request)
        replica.check_model(body)
        ids = replica.tokenizer.prompt_ids(body, chat="messages" in body)
    except TokenizationError as exc:
        return error_response(400, str(exc))
    except ApiError as exc:
        return exc.response()
    token_strs = None
    if body.get("return_token_strs"):
        token_strs = [replica.tokenizer.decode([t]) for t in ids]
    return _json({"count": len(ids), "max_model_len": replica.config.engine.max_model_len, "tokens": ids,
                  "token_strs": token_strs})


async def detokenize(request: web.Request) -> web.Response:
    replica = request.app[REPLICA]
    try:
        body = await _read_json(request)
        replica.check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidRequest("body.tokens", "Input should be a valid list of integers", "list_type")
        if any(t < 0 or t >= replica.tokenizer.vocab_size for t in tokens):
            raise ApiError(400, "Token id out of vocabulary")
    except ApiError as exc:
        return exc.response()
    return _json({"prompt": replica.tokenizer.decode(tokens)})


async def metrics(request: web.Request) -> web.Response:
    body = render(request.app[REPLICA].registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    """vLLM 0.32's dev endpoint: `{"success": bool}`; refused while requests hold blocks unless
    `?reset_running_requests=true`, which preempts them first (they recompute afterwards)."""
    preempt = request.query.get("reset_running_requests", "false").lower() in ("1", "true")
    return _json({"success": request.app[REPLICA].engine.reset_prefix_cache(preempt)})


async def sim_blocks(request: web.Request) -> web.Response:
    """The cached block set, as the replica's KV events describe it: [[hash, blocks holding it], ...]."""
    engine = request.app[REPLICA].engine
    pool = engine.pool
    hashes = [[h.hex() if isinstance(h, bytes) else h, n] for h, n in pool.cached_hashes().items()]
    return _json({
        "block_size": pool.block_size, "num_gpu_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
        "hashes": hashes, "free_order": pool.free_order() if request.query.get("free_order") else None,
        "next_event_seq": engine.publisher.next_seq if engine.publisher else None,
        "running": len(engine.scheduler.running), "waiting": len(engine.scheduler.waiting),
        "steps": engine.steps, "lag_s": round(engine.lag_s, 6),
        "agent": None if engine.connector is None else {
            "socket": engine.connector.config.socket_path, "saved_blocks": engine.connector.saved_blocks,
            "errors": engine.connector.errors, "load_errors": engine.scheduler.external.load_errors},
    })


@web.middleware
async def api_key_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    key = request.app[REPLICA].config.api_key
    if key and request.path.startswith("/v1") and request.headers.get("Authorization") != f"Bearer {key}":
        return _json({"error": "Unauthorized"}, status=401)
    result: web.StreamResponse = await handler(request)
    return result


def create_replica_app(config: ReplicaConfig) -> web.Application:
    replica = Replica(config)
    app = web.Application(middlewares=[api_key_middleware] if config.api_key else [],
                          client_max_size=64 * 1024 * 1024)
    app[REPLICA] = replica

    async def lifecycle(app: web.Application) -> Any:
        await replica.engine.start()
        yield
        await replica.engine.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    app.router.add_get("/sim/blocks", sim_blocks)
    return app


async def serve_replica(config: ReplicaConfig, ready: Callable[[ReplicaConfig], None] | None = None) -> None:
    """Run one replica until cancelled."""
    app = create_replica_app(config)
    # uvicorn's (vLLM's) keep-alive is 5 s: idle connections are closed as vLLM would close them
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port, backlog=1024).start()
        if ready is not None:
            ready(config)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
