"""The gateway's tokenization service: a request's prompt → token ids → chained block keys, off the event loop.

Per model, the tokenizer comes from `--model-dir` (one directory for every model, or `NAME=DIR` per served model;
a directory may be a model directory or a Hugging Face cache) and is `router.tokenizer.ModelTokenizer`, which
gives exactly vLLM's prompt token ids. Long prompts are tokenized in a thread pool (`tokenizers` releases the
GIL), so the event loop never waits on them.

Multi-turn conversations resend their whole history. A rendered chat prompt is cut before each special token
(`<|im_start|>` …); the tokenizer splits its input at special tokens before anything else, so the pieces encode
independently, and each piece's ids are kept in an LRU cache: a new turn encodes only its new text. The cut is
checked against whole-text encoding when a tokenizer loads and disabled if they ever differ.

Without a tokenizer for a model the service runs in text mode, labelled as such in metrics and logs: the
prompt's text (a canonical rendering of the messages) is cut into fixed-size character blocks (`CHARS_PER_TOKEN`
characters per token) and those are chained like token blocks. Token-id prompts are always exact.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from kvcore.config import ConfigError
from router.block_keys import BlockKey, block_keys, longest_run, root_key
from router.config import GatewayConfig
from router.metrics import GatewayMetrics
from router.requests import ChatPrompt, CompletionPrompt, Prompt
from router.template_sandbox import RenderFailed, TemplateSandbox, sandbox_memory_bytes
from router.tokenizer import ModelTokenizer, TokenizationError, chat_adds_special_tokens

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # text mode: one "token" is this many characters, one block is block_size of them
INLINE_CHARS = 2048  # prompts shorter than this are tokenized on the event loop (the thread hop costs more)
PARALLEL_CHARS = 8192  # new chat text longer than this is encoded on the tokenizer's own threads
TOKENS, TEXT = "tokens", "text"
_SELF_CHECK = [
    [{"role": "system", "content": "You are a careful assistant.\n"}, {"role": "user", "content": "Hi there!"}],
    [{"role": "user", "content": "def f(x):\n    return x  # <|im_end|> in text\n"},
     {"role": "assistant", "content": " spaced  out \n\n"}, {"role": "user", "content": "Ünïcödé — ok?"}],
]


@dataclass(frozen=True, slots=True)
class PromptKeys:
    """A prompt as the router sees it."""

    block_keys: list[BlockKey]
    prompt_tokens: int  # exact with a tokenizer or token-id prompt, estimated in text mode
    token_ids: list[int] | None  # None in text mode
    mode: str  # TOKENS or TEXT


class SegmentCachingTokenizer(ModelTokenizer):
    """`ModelTokenizer` whose special-token-free encoding (the chat path) reuses the ids of text pieces it saw
    before, so a conversation's next turn encodes only its new text."""

    def __init__(self, model_dir: str | Path, cache_entries: int) -> None:
        super().__init__(model_dir)
        self._pieces: OrderedDict[str, tuple[list[int], bytes]] = OrderedDict()  # piece -> ids, ids as uint32
        self._limit = cache_entries
        self._lock = threading.Lock()
        self._local = threading.local()  # the token bytes of the last prompt this thread encoded
        self.encoded_chars = 0  # characters that went through the tokenizer on the cached path (cache misses)
        self._cut = self._cut_pattern()
        if self._cut is not None and not self._cuts_are_exact():
            log.warning("tokenizer in %s: encoding pieces cut at special tokens differs from whole-text encoding;"
                        " multi-turn caching disabled", model_dir)
            self._cut = None

    def _cut_pattern(self) -> re.Pattern[str] | None:
        """Special tokens the tokenizer always splits at: not normalized, not single-word, not eating the
        whitespace to their left."""
        decoder = self._tok.get_added_tokens_decoder()
        texts = sorted(
            {t.content for t in decoder.values()
             if t.special and not t.normalized and not t.single_word and not t.lstrip and t.content},
            key=len, reverse=True,
        )
        return re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    def _cuts_are_exact(self) -> bool:
        try:
            samples = [self.render_chat(m) for m in _SELF_CHECK]
        except TokenizationError:
            samples = []
        samples.append("".join(t for t in self.special_tokens.values()) + " plain text after specials ")
        return all(self._encode_pieces(s) == super(SegmentCachingTokenizer, self).encode(
            s, add_special_tokens=False) for s in samples)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if add_special_tokens or self._cut is None or len(text) < 256:
            return super().encode(text, add_special_tokens=add_special_tokens)
        return self._encode_pieces(text)

    def _encode_pieces(self, text: str) -> list[int]:
        assert self._cut is not None
        starts = [m.start() for m in self._cut.finditer(text)]
        if not starts or starts[0] != 0:
            starts.insert(0, 0)
        starts.append(len(text))
        pieces = [text[starts[i]:starts[i + 1]] for i in range(len(starts) - 1)]
        cache = self._pieces
        found: list[tuple[list[int], bytes] | None] = []
        with self._lock:
            for piece in pieces:
                hit = cache.get(piece)
                if hit is not None:
                    cache.move_to_end(piece)
                found.append(hit)
        missing = [piece for piece, hit in zip(pieces, found, strict=True) if hit is None]
        if missing:
            size = sum(map(len, missing))
            if size > PARALLEL_CHARS:
                # one call for every new piece: the tokenizer spreads a batch over its threads, and the fast
                # variant skips the offsets nobody reads here
                encoded = iter(e.ids for e in self._tok.encode_batch_fast(missing, add_special_tokens=False))
            else:  # a new turn: waking the tokenizer's thread pool would cost more than encoding it here
                encoded = iter(self._tok.encode(piece, add_special_tokens=False).ids for piece in missing)
            self.encoded_chars += size
            with self._lock:
                for i, piece in enumerate(pieces):
                    if found[i] is None:
                        ids = next(encoded)
                        found[i] = cache[piece] = (ids, array("I", ids).tobytes())
                while len(cache) > self._limit:
                    cache.popitem(last=False)
        out: list[int] = []
        chunks: list[bytes] = []
        for hit in found:
            assert hit is not None
            out += hit[0]
            chunks.append(hit[1])
        # converting a long id list to bytes for hashing costs more than joining the pieces' bytes
        self._local.last = (out, b"".join(chunks))
        return out

    def prompt_ids_and_bytes(self, body: Mapping[str, Any], *, chat: bool) -> tuple[list[int], bytes]:
        """`prompt_ids`, and the ids as native uint32 bytes (what block hashing reads)."""
        return self._with_bytes(lambda: self.prompt_ids(body, chat=chat))

    def text_ids_and_bytes(self, text: str, *, add_special_tokens: bool) -> tuple[list[int], bytes]:
        """`encode`, and the ids as native uint32 bytes."""
        return self._with_bytes(lambda: self.encode(text, add_special_tokens=add_special_tokens))

    def _with_bytes(self, ids_of: Callable[[], list[int]]) -> tuple[list[int], bytes]:
        self._local.last = None
        ids = ids_of()
        last = self._local.last
        self._local.last = None
        if last is not None and last[0] is ids:
            return ids, last[1]
        return ids, array("I", ids).tobytes()

    def clear_cache(self) -> None:
        with self._lock:
            self._pieces.clear()

    @property
    def cached_pieces(self) -> int:
        return len(self._pieces)


class ChainMemo:
    """Block keys of recent prompts, so a prompt extending one hashed before (a conversation's next turn, a
    shared system prompt) hashes only its new blocks. Recent prompts are grouped by their first block; each
    group keeps the last few, and a new prompt reuses the keys of the longest common full-block prefix."""

    def __init__(self, block_size: int, max_bytes: int = 32 << 20, per_group: int = 4) -> None:
        self.block_size = block_size
        self._step = block_size * 4  # bytes per block of uint32 token ids
        self._groups: OrderedDict[tuple[BlockKey, bytes], list[tuple[bytes, list[BlockKey]]]] = OrderedDict()
        self._max_bytes = max_bytes  # token-id bytes kept (the keys add 1/(2 x block size) of that again)
        self._bytes = 0
        self._per_group = per_group
        self._lock = threading.Lock()
        self.reused_blocks = 0

    def _common_blocks(self, old: bytes, new: bytes, limit: int) -> int:
        step = self._step
        if new.startswith(old[: limit * step]):  # the usual case: the old prompt is a prefix of the new one
            return limit
        # the most equal leading blocks: probe one block at a time, confirm the whole prefix once
        same = longest_run(limit - 1, lambda i: old[i * step: (i + 1) * step] == new[i * step: (i + 1) * step])
        return same if new.startswith(old[: same * step]) else 0

    def keys(self, data: bytes, root: BlockKey) -> list[BlockKey]:
        """Chained keys of every full block of `data` (token ids as native uint32), as `block_keys` gives."""
        step = self._step
        blocks = len(data) // step
        if blocks == 0:
            return []
        head = (root, data[:step])
        with self._lock:
            candidates = list(self._groups.get(head, ()))
        reuse, reused = 0, []
        for old, old_keys in candidates:
            n = self._common_blocks(old, data, min(len(old_keys), blocks))
            if n > reuse:
                reuse, reused = n, old_keys
        keys = reused[:reuse]
        if reuse < blocks:
            tail = array("I")
            tail.frombytes(data[reuse * step: blocks * step])
            keys += block_keys(tail, self.block_size, keys[-1] if keys else root)
        self.reused_blocks += reuse
        with self._lock:
            group = self._groups.get(head)
            if group is None:
                group = self._groups[head] = []
            else:
                self._groups.move_to_end(head)
            group.insert(0, (data, keys))
            self._bytes += len(data)
            for dropped, _ in group[self._per_group:]:
                self._bytes -= len(dropped)
            del group[self._per_group:]
            while self._bytes > self._max_bytes and len(self._groups) > 1:
                for dropped, _ in self._groups.popitem(last=False)[1]:
                    self._bytes -= len(dropped)
        return keys


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
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content
                         if isinstance(p, (str, dict)))
    return ""


def prompt_text(prompt: Prompt) -> str:
    """Text mode's canonical rendering of a prompt: a completion's text, or a chat's tools, then each message's
    role and text."""
    if isinstance(prompt, CompletionPrompt):
        return prompt.prompt if isinstance(prompt.prompt, str) else ""
    parts: list[str] = []
    tools = prompt.template.get("tools")
    if tools:
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

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self.block_size = config.block_size
        self._cache_entries = config.chat_cache_entries
        self._metrics = metrics
        self._named, self._default = parse_model_dirs(config.model_dir)
        self._tokenizers: dict[str, SegmentCachingTokenizer] = {}  # by resolved directory
        self._loading: dict[str, asyncio.Future[SegmentCachingTokenizer | None]] = {}
        self._failed: set[str] = set()
        self._directories: dict[str, str | None] = {}  # model -> resolved directory, or None for text mode
        self._chains = ChainMemo(config.block_size)
        self._executor = ThreadPoolExecutor(max(1, config.tokenizer_threads), thread_name_prefix="kvgate-tokenize")
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
        """Forget every cached piece and chain (benchmarks measure cold costs with it)."""
        for tokenizer in self._tokenizers.values():
            tokenizer.clear_cache()
        self._chains = ChainMemo(self.block_size)

    def start(self) -> None:
        """Start what runs beside the event loop (the template sandbox's processes)."""
        if self._sandbox is not None:
            self._sandbox.start()

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def aclose(self) -> None:
        if self._sandbox is not None:
            await self._sandbox.close()
        self.close()

    def describe(self) -> dict[str, Any]:
        return {"models": dict(self._named), "default": self._default,
                "loaded": sorted(self._tokenizers), "mode": TOKENS if (self._named or self._default) else TEXT}

    def _directory(self, model: str) -> str | None:
        if model in self._directories:
            return self._directories[model]
        directory: str | None = None
        try:
            if model in self._named:
                directory = str(resolve_model_dir(self._named[model], model))
            elif self._default is not None:
                directory = str(resolve_model_dir(self._default, model))
        except ConfigError as exc:
            log.warning("no tokenizer for model %s, routing it in text mode: %s", model, exc)
        self._directories[model] = directory
        return directory

    async def tokenizer(self, model: str) -> SegmentCachingTokenizer | None:
        """The model's tokenizer, loaded once in the thread pool; None when there is none (text mode)."""
        directory = self._directory(model)
        if directory is None or directory in self._failed:
            return None
        found = self._tokenizers.get(directory)
        if found is not None:
            return found
        loading = self._loading.get(directory)
        if loading is None:
            loading = asyncio.get_running_loop().run_in_executor(self._executor, self._load, directory)
            self._loading[directory] = loading
        result = await loading
        self._loading.pop(directory, None)
        return result

    def _load(self, directory: str) -> SegmentCachingTokenizer | None:
        try:
            tokenizer = SegmentCachingTokenizer(directory, self._cache_entries)
        except Exception as exc:  # tokenizers raises plain Exception for a malformed file
            log.error("cannot load the tokenizer in %s (text mode for its models): %s", directory, exc)
            self._failed.add(directory)
            return None
        self._tokenizers[directory] = tokenizer
        log.info("tokenizer loaded from %s", directory)
        return tokenizer

    async def keys(self, prompt: Prompt, model: str, lora: str | None = None,
                   raw: bytes | None = None) -> PromptKeys:
        """Token ids and block keys of a request's prompt. `model` names the tokenizer (a LoRA adapter's base
        model) and `lora` the adapter, if any; `raw` is the request body as received. The prompt's `cache_salt`
        (as the engines get it: with `--tenant-header`, the tenant's) is the keys' namespace, as it is vLLM's."""
        started = time.perf_counter()
        loop = asyncio.get_running_loop()
        root = root_key(model, lora, prompt.cache_salt)
        tokenizer = await self.tokenizer(model)
        # the body's size bounds the work of tokenizing it, tools and documents included
        inline = (len(raw) if raw is not None else _text_size(prompt)) < INLINE_CHARS
        result: PromptKeys | None = None
        if isinstance(prompt, CompletionPrompt) and isinstance(prompt.prompt, list):
            result = self._from_ids(prompt.prompt, root)  # token ids: exact with or without a tokenizer
        if result is None and tokenizer is not None:
            try:
                if isinstance(prompt, ChatPrompt) and not tokenizer.chat.owns(prompt.template.get("chat_template")):
                    result = await self._with_client_template(tokenizer, prompt, raw, root)
                elif inline:
                    result = self.tokenize_now(tokenizer, prompt, root)
                else:
                    result = await loop.run_in_executor(self._executor, self.tokenize_now, tokenizer, prompt, root)
            except TokenizationError as exc:
                log.debug("tokenization failed, routing by text: %s", exc)
        if result is None:
            result = (self.text_keys(prompt, root) if inline
                      else await loop.run_in_executor(self._executor, self.text_keys, prompt, root))
        if self._metrics is not None:
            self._metrics.tokenize_duration.labels(result.mode).observe(time.perf_counter() - started)
        return result

    async def _with_client_template(self, tokenizer: SegmentCachingTokenizer, prompt: ChatPrompt,
                                    raw: bytes | None, root: BlockKey) -> PromptKeys | None:
        """A chat whose template the client wrote: rendered in the sandbox, or None (text mode) when it may not
        run (`trust_request_chat_template` off, as vLLM refuses such requests by default) or did not finish."""
        if self._sandbox is None:
            self._count_render("untrusted")
            return None
        loop = asyncio.get_running_loop()
        body = prompt.vllm_body()
        if raw is None:
            raw = await loop.run_in_executor(self._executor, orjson.dumps, body)
        try:
            text = await self._sandbox.render(tokenizer.chat.state(templates=False), raw)
        except RenderFailed as exc:
            self._count_render(exc.reason)
            log.debug("client chat template not rendered (%s: %s), routing by text", exc.reason, exc)
            return None
        self._count_render("ok")
        return await loop.run_in_executor(self._executor, self.encode_now, tokenizer, text,
                                          chat_adds_special_tokens(body), root)

    def _count_render(self, outcome: str) -> None:
        if self._metrics is not None:
            self._metrics.client_template_renders.labels(outcome).inc()

    def _from_ids(self, ids: list[int], root: BlockKey) -> PromptKeys:
        return PromptKeys(block_keys(ids, self.block_size, root), len(ids), ids, TOKENS)

    def tokenize_now(self, tokenizer: SegmentCachingTokenizer, prompt: Prompt, root: BlockKey) -> PromptKeys:
        """Tokenize and hash on the calling thread (`keys` decides which thread that is)."""
        ids, data = tokenizer.prompt_ids_and_bytes(prompt.vllm_body(), chat=isinstance(prompt, ChatPrompt))
        return PromptKeys(self._chains.keys(data, root), len(ids), ids, TOKENS)

    def encode_now(self, tokenizer: SegmentCachingTokenizer, text: str, add_special_tokens: bool,
                   root: BlockKey) -> PromptKeys:
        """Encode an already rendered prompt and hash it, on the calling thread."""
        ids, data = tokenizer.text_ids_and_bytes(text, add_special_tokens=add_special_tokens)
        return PromptKeys(self._chains.keys(data, root), len(ids), ids, TOKENS)

    def text_keys(self, prompt: Prompt, root: BlockKey) -> PromptKeys:
        """Text mode, on the calling thread."""
        return self._from_text(prompt_text(prompt), root)

    def _from_text(self, text: str, root: BlockKey) -> PromptKeys:
        # a different root than token mode: character blocks must never be mistaken for token blocks
        text_root = root_key(f"text:{root:x}", None, None)
        return PromptKeys(text_block_keys(text, self.block_size, text_root),
                          -(-len(text) // CHARS_PER_TOKEN), None, TEXT)
