"""The gateway's tokenization service: a request's prompt → token ids → chained block keys, off the event loop.

Per model, the tokenizer comes from `--model-dir` (one directory for every model, or `NAME=DIR` per served model;
a directory may be a model directory or a Hugging Face cache) and is `router.tokenizer.ModelTokenizer`, which
gives exactly vLLM's prompt token ids. Long prompts are tokenized in a thread pool (`tokenizers` releases the
GIL), so the event loop never waits on them.

Prompts repeat their beginnings (a system prompt, a conversation's earlier turns, a document): router/token_cache.py
keeps recent prompts' token ids and block keys, bounded in bytes (`prompt_cache_bytes`), so a prompt that starts
like a recent one is encoded only from a verified seam near where they part.

Without a tokenizer for a model the service runs in text mode, labelled as such in metrics and logs: the
prompt's text (a canonical rendering of the messages) is cut into fixed-size character blocks (`CHARS_PER_TOKEN`
characters per token) and those are chained like token blocks. Token-id prompts are always exact.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvcore.aio import WorkerThreads
from kvcore.config import ConfigError
from router.block_keys import BlockKey, block_keys, root_key
from router.config import GatewayConfig
from router.metrics import GatewayMetrics
from router.requests import ChatPrompt, CompletionPrompt, Prompt
from router.template_sandbox import RenderFailed, TemplateSandbox, sandbox_memory_bytes
from router.token_cache import Lookup, TokenCache
from router.tokenizer import ModelTokenizer, TokenizationError, chat_adds_special_tokens
from router.tokenizer_processes import TokenizerProcesses, TokenizerUnavailable

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # text mode: one "token" is this many characters, one block is block_size of them
# Longer bodies than INLINE_CHARS go to the threads although their tokenizing is mostly Python that the GIL serialises
# with the loop: under load a thread tokenizes the prompts queued meanwhile back to back while the loop serves many
# requests' HTTP, and that costs less CPU per request than both interleaved on the loop (issue 18, c64: a third more
# user time there; tokenized in batches per loop turn, about the same as the hop), likely because each kind of work
# then runs with its code and data warm in a core's caches.
INLINE_CHARS = 2048  # bodies shorter than this are tokenized on the event loop (the thread hop costs more)
# ... and bodies up to this size when no other request is in flight: the hop then lets the loop do nothing meanwhile
# and costs two thread wake-ups on the request's path; the longest such body keeps the loop about a millisecond
ALONE_INLINE_BYTES = 16 * 1024
TEXT_INLINE_BYTES = 64 * 1024  # text mode (a hash per 64 characters) runs on the loop up to this body size
INLINE_IDS = 16384  # token-id prompts shorter than this are hashed on the event loop
TOKENS, TEXT = "tokens", "text"
# a model without a tokenizer (its directory not there yet: a hub cache still downloading; a file that did not load) is
# looked for again after this, doubling up to RETRY_MAX_S: it need not stay in text mode until the gateway restarts
RETRY_FIRST_S = 10.0
RETRY_MAX_S = 300.0


# not frozen (this one and those below): one of each is built per request, and a frozen dataclass's __init__ costs
# 3x (960 against 270 ns, six fields)
@dataclass(slots=True)
class PromptKeys:
    """A prompt as the router sees it."""

    block_keys: list[BlockKey]
    prompt_tokens: int  # exact with a tokenizer or token-id prompt, estimated in text mode
    token_ids: Sequence[int] | None  # None in text mode
    mode: str  # TOKENS or TEXT


class _PromptCacheCollector(Collector):
    """The token cache's and the tokenizer processes' figures, read when scraped (nothing per request)."""

    def __init__(self, cache: TokenCache, processes: TokenizerProcesses | None) -> None:
        self._cache = cache
        self._processes = processes

    def collect(self) -> Iterator[Metric]:
        size = GaugeMetricFamily("kvgate_prompt_cache_bytes", "Bytes held by recent tokenized prompts, against "
                                 "prompt_cache_bytes")
        size.add_metric([], self._cache.bytes)
        yield size
        outcomes = CounterMetricFamily(
            "kvgate_prompt_cache_prompts", "Prompts tokenized, by outcome: hit (a cached prefix reused), miss (all "
            "encoded), seam_mismatch (a cached prefix whose seam did not verify: all encoded)", labels=["outcome"])
        cache = self._cache
        for outcome, count in (("hit", cache.hits), ("miss", cache.misses), ("seam_mismatch", cache.seam_mismatches)):
            outcomes.add_metric([outcome], count)
        yield outcomes
        if self._processes is not None:
            restarts = CounterMetricFamily(
                "kvgate_tokenizer_process_restarts", "Tokenizer processes replaced (found dead, or killed when they "
                "gave no answer in time)")
            restarts.add_metric([], self._processes.restarts)
            yield restarts


def resolve_model_dir(path: str | Path, model: str | None = None) -> Path:
    """A directory holding `tokenizer.json`: the path itself, or inside a Hugging Face cache — a repo folder
    (`models--org--name`, snapshot from refs/main, else the newest) or a hub root with `model` naming the repo."""
    base = Path(path).expanduser()
    if (base / "tokenizer.json").is_file():
        return base
    repos = [base]
    if model is not None:
        repos.insert(0, base / ("models--" + model.replace("/", "--")))
        repos.insert(1, base / "hub" / ("models--" + model.replace("/", "--")))
    for repo in repos:
        snapshots = repo / "snapshots"
        if not snapshots.is_dir():
            continue
        ref = repo / "refs" / "main"
        if ref.is_file():
            candidate = snapshots / ref.read_text().strip()
            if (candidate / "tokenizer.json").is_file():
                return candidate
        found = sorted((p for p in snapshots.iterdir() if (p / "tokenizer.json").is_file()),
                       key=lambda p: p.stat().st_mtime, reverse=True)
        if found:
            return found[0]
    raise ConfigError(f"no tokenizer.json in {base} (nor in a Hugging Face cache layout there"
                      + (f" for {model}" if model else "") + ")")


def parse_model_dirs(entries: Sequence[str]) -> tuple[dict[str, str], str | None]:
    """`NAME=DIR` entries per model and at most one bare `DIR` for every other model."""
    named: dict[str, str] = {}
    default: str | None = None
    for entry in entries:
        name, sep, directory = entry.partition("=")
        if sep and name and not Path(entry).exists():
            named[name] = directory
        elif default is None:
            default = entry
        else:
            raise ConfigError(f"--model-dir: two directories without a model name ({default}, {entry})")
    return named, default


def _part_text(content: Any) -> str:
    # text mode is the fallback for whatever the tokenizer refused: any shape of part must render (a `text` that is
    # not a string counts as none)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p if isinstance(p, str) else t if isinstance(t := p.get("text"), str) else ""
                         for p in content if isinstance(p, (str, dict)))
    return ""


def prompt_text(prompt: Prompt) -> str:
    """Text mode's canonical rendering of a prompt: a completion's text, or a chat's tools, then each message's
    role and text."""
    if isinstance(prompt, CompletionPrompt):
        return prompt.prompt if isinstance(prompt.prompt, str) else ""
    parts: list[str] = []
    tools = prompt.template.get("tools")
    if tools:
        # nested deeper than orjson writes (255): keyed by the messages alone
        with contextlib.suppress(orjson.JSONEncodeError):
            parts.append("\x1etools\x1f" + orjson.dumps(tools, option=orjson.OPT_SORT_KEYS).decode())
    for message in prompt.messages:
        parts.append(f"\x1e{message.get('role', '')}\x1f{_part_text(message.get('content'))}")
    return "".join(parts)


def _text_size(prompt: Prompt) -> int:
    """Characters of text the tokenizer would encode (what decides the thread)."""
    if isinstance(prompt, CompletionPrompt):
        return len(prompt.prompt) if isinstance(prompt.prompt, str) else 0
    return sum(len(_part_text(m.get("content"))) for m in prompt.messages)


def text_block_keys(text: str, block_size: int, root: BlockKey) -> list[BlockKey]:
    """Text mode: chained keys over blocks of `block_size * CHARS_PER_TOKEN` characters (full blocks only)."""
    codes = array("I")
    codes.frombytes(text.encode("utf-32-le"))
    return block_keys(codes, block_size * CHARS_PER_TOKEN, root)


class PromptTokens:
    """Turns requests into block keys: with each model's tokenizer where one is configured, else text mode."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 threads: WorkerThreads | None = None) -> None:
        """`threads`: where long prompts are tokenized, the gateway's pool (which it starts and closes); by default
        a pool of this object's own, closed with it."""
        self.block_size = config.block_size
        self._metrics = metrics
        self._named, self._default = parse_model_dirs(config.model_dir)
        self._tokenizers: dict[str, ModelTokenizer] = {}  # by resolved directory
        self._loading: dict[str, asyncio.Future[ModelTokenizer | None]] = {}
        self._failed: set[str] = set()
        # a model without a directory, or a directory that failed to load -> (when to look again, the wait before)
        self._retry: dict[str, tuple[float, float]] = {}
        self.retry_first_s = RETRY_FIRST_S
        self._directories: dict[str, str | None] = {}  # model -> resolved directory, or None for text mode
        self._ready: dict[str, ModelTokenizer] = {}  # model -> its loaded tokenizer: no coroutine per request
        self.cache = TokenCache(config.prompt_cache_bytes, config.block_size)
        self._own_threads = threads is None
        self._threads = WorkerThreads(config.tokenizer_threads, "kvgate-tokenize") if threads is None else threads
        # a text goes to a tokenizer process from one of the tokenizer threads: more processes than threads idle
        self._processes = (TokenizerProcesses(min(config.tokenizer_processes, config.tokenizer_threads),
                                              nice=config.tokenizer_processes_nice)
                           if config.tokenizer_processes > 0 else None)
        if metrics is not None:
            metrics.registry.register(_PromptCacheCollector(self.cache, self._processes))
        # a client's own chat template runs only in the sandbox, and only when the engines would run it too
        self._sandbox = TemplateSandbox(
            config.template_processes, config.template_timeout_s, sandbox_memory_bytes(config.max_body_bytes),
            max_output_chars=config.max_body_bytes,
        ) if config.trust_request_chat_template else None
        for name, directory in self._named.items():
            resolve_model_dir(directory, name)  # fail at start-up, not on the first request
        if self._default is not None:
            try:
                resolve_model_dir(self._default)
            except ConfigError:
                if not Path(self._default).is_dir():
                    raise

    def clear_caches(self) -> None:
        """Forget every cached prompt (benchmarks measure cold costs with it)."""
        self.cache.clear()

    async def start(self) -> None:
        """Start what runs beside the event loop (the template sandbox's processes), and load the configured
        models' tokenizers: the first requests would otherwise wait for the load (tens of milliseconds for a
        small tokenizer on a busy machine, a second for a large one), and a cold burst's tail with them."""
        if self._sandbox is not None:
            self._sandbox.start()
        directories = {str(resolve_model_dir(directory, name)) for name, directory in self._named.items()}
        if self._default is not None:
            with contextlib.suppress(ConfigError):  # a hub root: its models are found when a request names one
                directories.add(str(resolve_model_dir(self._default)))
        await asyncio.gather(*map(self._tokenizer_in, sorted(directories)))
        if self._processes is not None:
            self._processes.start(sorted(self._tokenizers))

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()
        if self._own_threads:
            self._threads.close()

    async def aclose(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()
        self.close()

    def describe(self) -> dict[str, Any]:
        return {"models": dict(self._named), "default": self._default,
                "loaded": sorted(self._tokenizers), "mode": TOKENS if (self._named or self._default) else TEXT}

    def _due(self, key: str) -> bool:
        """Whether a model without a directory, or a directory that failed to load, may be tried again now."""
        retry = self._retry.get(key)
        return retry is None or time.monotonic() >= retry[0]

    def _backoff(self, key: str) -> float:
        """Put off the next try for `key`: RETRY_FIRST_S, then twice the last wait, up to RETRY_MAX_S."""
        last = self._retry.get(key)
        wait = self.retry_first_s if last is None else min(RETRY_MAX_S, 2 * last[1])
        self._retry[key] = (time.monotonic() + wait, wait)
        return wait

    def _directory(self, model: str) -> str | None:
        if model in self._directories:
            found = self._directories[model]
            if found is not None or not self._due(model):
                return found
        directory: str | None = None
        try:
            if model in self._named:
                directory = str(resolve_model_dir(self._named[model], model))
            elif self._default is not None:
                directory = str(resolve_model_dir(self._default, model))
        except ConfigError as exc:
            log.warning("no tokenizer for model %s, routing it in text mode (looking again in %g s): %s", model,
                        self._backoff(model), exc)
        else:
            self._retry.pop(model, None)
        self._directories[model] = directory
        return directory

    async def tokenizer(self, model: str) -> ModelTokenizer | None:
        """The model's tokenizer, loaded once in the thread pool; None when there is none (text mode). A model
        without one is looked for again, and a directory that failed to load loaded again, with a backoff."""
        directory = self._directory(model)
        if directory is None or (directory in self._failed and not self._due(directory)):
            return None
        tokenizer = await self._tokenizer_in(directory)
        if tokenizer is not None:
            self._ready[model] = tokenizer
        return tokenizer

    async def _tokenizer_in(self, directory: str) -> ModelTokenizer | None:
        found = self._tokenizers.get(directory)
        if found is not None:
            return found
        loading = self._loading.get(directory)
        if loading is None:
            loading = self._threads.run(self._load, directory)
            self._loading[directory] = loading
        result = await loading
        self._loading.pop(directory, None)
        return result

    def _load(self, directory: str) -> ModelTokenizer | None:
        try:
            tokenizer = ModelTokenizer(directory, processes=self._processes)
        except Exception as exc:  # tokenizers raises plain Exception for a malformed file
            self._failed.add(directory)
            log.error("cannot load the tokenizer in %s (text mode for its models, loading it again in %g s): %s",
                      directory, self._backoff(directory), exc)
            return None
        self._tokenizers[directory] = tokenizer
        self._failed.discard(directory)
        self._retry.pop(directory, None)
        log.info("tokenizer loaded from %s", directory)
        return tokenizer

    async def keys(self, prompt: Prompt, model: str, lora: str | None = None,
                   raw: bytes | None = None, alone: bool = False) -> PromptKeys:
        """Token ids and block keys of a request's prompt. `model` names the tokenizer (a LoRA adapter's base
        model) and `lora` the adapter, if any; `raw` is the request body as received; `alone`: no other request is
        in flight. The prompt's `cache_salt` (as the engines get it: with `--tenant-header`, the tenant's) is the
        keys' namespace, as it is vLLM's."""
        started = time.perf_counter()
        root = root_key(model, lora, prompt.cache_salt)
        tokenizer = self._ready.get(model)
        if tokenizer is None:
            tokenizer = await self.tokenizer(model)
        # the body's size bounds the work of tokenizing it, tools and documents included
        size = len(raw) if raw is not None else _text_size(prompt)
        result: PromptKeys | None = None
        if isinstance(prompt, CompletionPrompt) and isinstance(prompt.prompt, list):  # exact with or without a
            ids = prompt.prompt  # tokenizer
            result = (self._from_ids(ids, root) if len(ids) < INLINE_IDS
                      else await self._threads.run(self._from_ids, ids, root))
        if result is None and tokenizer is not None:
            try:
                if isinstance(prompt, ChatPrompt) and not tokenizer.chat.owns(prompt.template.get("chat_template")):
                    result = await self._with_client_template(tokenizer, prompt, raw, root)
                elif size < INLINE_CHARS or (alone and size <= ALONE_INLINE_BYTES):
                    result = self.tokenize_now(tokenizer, prompt, root)
                else:
                    result = await self._threads.run(self.tokenize_now, tokenizer, prompt, root)
            except TokenizationError as exc:
                self._count_fallback("refused")
                log.debug("tokenization failed, routing by text: %s", exc)
            except TokenizerUnavailable as exc:  # the engine tokenizes it anyway: routed worse, still served
                self._count_fallback("tokenizer_unavailable")
                log.warning("no tokenizer process answered, routing by text: %s", exc)
        elif result is None and (self._named or self._default is not None):
            self._count_fallback("no_tokenizer")
        if result is None:
            result = (self.text_keys(prompt, root) if size <= TEXT_INLINE_BYTES
                      else await self._threads.run(self.text_keys, prompt, root))
        if self._metrics is not None:
            self._metrics.tokenize_duration.labels(result.mode).observe(time.perf_counter() - started)
        return result

    async def _with_client_template(self, tokenizer: ModelTokenizer, prompt: ChatPrompt,
                                    raw: bytes | None, root: BlockKey) -> PromptKeys | None:
        """A chat whose template the client wrote: rendered in the sandbox, or None (text mode) when it may not
        run (`trust_request_chat_template` off, as vLLM refuses such requests by default) or did not finish."""
        if self._sandbox is None:
            self._count_render("untrusted")
            return None
        body = prompt.vllm_body()
        if raw is None:
            raw = await self._threads.run(orjson.dumps, body)
        try:
            text = await self._sandbox.render(tokenizer.chat.state(templates=False), raw)
        except RenderFailed as exc:
            self._count_render(exc.reason)
            log.debug("client chat template not rendered (%s: %s), routing by text", exc.reason, exc)
            return None
        self._count_render("ok")
        return await self._threads.run(self.encode_now, tokenizer, text,
                                          chat_adds_special_tokens(body), root)

    def _count_fallback(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.tokenize_fallbacks.labels(reason).inc()

    def _count_render(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.client_template_renders.labels(outcome).inc()

    def _from_ids(self, ids: list[int], root: BlockKey) -> PromptKeys:
        return PromptKeys(block_keys(ids, self.block_size, root), len(ids), ids, TOKENS)

    def tokenize_now(self, tokenizer: ModelTokenizer, prompt: Prompt, root: BlockKey) -> PromptKeys:
        """Render, tokenize and hash on the calling thread (`keys` decides which thread that is)."""
        return self._finish(tokenizer, self.cache.lookup(tokenizer, *self.prompt_text(tokenizer, prompt)), root)

    @staticmethod
    def prompt_text(tokenizer: ModelTokenizer, prompt: Prompt) -> tuple[str, bool]:
        """The text vLLM encodes for a text prompt (a chat rendered with the model's template), and whether it
        adds special tokens."""
        if isinstance(prompt, ChatPrompt):
            body = prompt.vllm_body()
            return tokenizer.chat.prompt_text(body), chat_adds_special_tokens(body)
        if not isinstance(prompt.prompt, str):
            raise TokenizationError("`prompt` must be a string or a list of token ids")
        return prompt.prompt, prompt.add_special_tokens

    def encode_now(self, tokenizer: ModelTokenizer, text: str, add_special_tokens: bool,
                   root: BlockKey) -> PromptKeys:
        """Encode an already rendered prompt and hash it, on the calling thread."""
        return self._finish(tokenizer, self.cache.lookup(tokenizer, text, add_special_tokens), root)

    def _finish(self, tokenizer: ModelTokenizer, lookup: Lookup, root: BlockKey) -> PromptKeys:
        encoded = self.cache.finish(tokenizer, lookup, root)
        return PromptKeys(encoded.keys, len(encoded.ids), encoded.ids, TOKENS)

    def text_keys(self, prompt: Prompt, root: BlockKey) -> PromptKeys:
        """Text mode, on the calling thread."""
        return self._from_text(prompt_text(prompt), root)

    def _from_text(self, text: str, root: BlockKey) -> PromptKeys:
        # a different root than token mode: character blocks must never be mistaken for token blocks
        text_root = root_key(f"text:{root:x}", None, None)
        return PromptKeys(text_block_keys(text, self.block_size, text_root),
                          -(-len(text) // CHARS_PER_TOKEN), None, TEXT)
