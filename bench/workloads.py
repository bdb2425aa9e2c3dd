"""Benchmark workloads: generators of shared-prefix traffic, and what a replay reads (`RequestSource`); traces
are read by bench/traces.py.

Every generated workload is a list of `WorkloadRequest`s — prompt token ids, answer length, arrival time (or
none, for the load generator to pace) and a group label. Prompt tokens are drawn from the model's `PromptVocabulary`:
word tokens whose text, concatenated, the tokenizer turns back into exactly the same ids, so a prompt can be sent
as text (what real clients and text-routing peers see) or as token ids, and the engine caches the same blocks.
The tiny model's tokenizer adds BOS to a text prompt; `wire_ids` is the prompt as the engine sees it, and
token-id requests send those ids.

Generators (all deterministic for a seed):
- `tenants`: T tenants, each with a P-token system prompt; U users per tenant; each request is the tenant's
  prefix plus a fresh Q-token question; `requests_per_user` questions per user, interleaved at random
  (the shape of the llm-d prefix-cache benchmarks).
- `multi_turn`: S conversations of `turns` turns; turn k's prompt is the whole history (earlier questions and
  A-token answers) plus a Q-token question; turns of one conversation are `idle_s` (exponential mean) apart,
  conversations start `session_gap_s` (exponential mean) apart.
- `rag`: a pool of D documents of L tokens; each request is an S-token instruction, k documents drawn by Zipf
  popularity (exponent s, most popular first) and a Q-token question.
- `no_overlap`: every prompt is N fresh tokens, nothing shared (the control: no router can gain).
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import xxhash

from router.block_keys import block_keys, root_key
from router.tokenizer import ModelTokenizer

_WORD = re.compile(r" [A-Za-z]+")
# splitmix64's constants (Steele, Lea, Flood 2014)
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S27, _S30, _S31 = np.uint64(27), np.uint64(30), np.uint64(31)
BLOCK_CACHE = 4096  # numbered blocks a vocabulary keeps expanded (at 512 tokens, 16 MB of references)


@dataclass(slots=True)
class WorkloadRequest:
    """One request of a workload. `arrival_s` is None when the load generator chooses the time."""

    token_ids: list[int]
    max_tokens: int
    arrival_s: float | None = None
    group: str = ""


@dataclass
class Workload:
    name: str
    requests: list[WorkloadRequest]
    params: dict[str, object] = field(default_factory=dict)

    @property
    def timed(self) -> bool:
        return all(r.arrival_s is not None for r in self.requests)


@dataclass(slots=True)
class Arrival:
    """One request of a replay: when it arrives (None: the replay paces it), its prompt as the engine sees it,
    and how many tokens it generates."""

    at: float | None
    token_ids: list[int]
    max_tokens: int


class RequestSource(Protocol):
    """What a replay reads: `count` requests, taken one at a time in arrival order (`iter`), none longer than
    `longest` tokens with its answer; `timed` when every arrival has a time."""

    name: str
    params: dict[str, object]
    count: int
    longest: int
    timed: bool

    def __iter__(self) -> Iterator[Arrival]: ...

    def ideal(self, block_size: int) -> IdealCache:
        """What one unbounded cache would hit on these requests (`ideal_hit_rate`)."""
        ...


class WorkloadSource:
    """A generated workload as a `RequestSource` (its prompts are in memory already); `arrivals` gives the
    requests times when the workload has none (Poisson, for an open loop)."""

    def __init__(self, workload: Workload, vocab: PromptVocabulary, arrivals: Sequence[float] | None = None) -> None:
        self.workload = workload
        self.vocab = vocab
        self.name = workload.name
        self.params = workload.params
        self.count = len(workload.requests)
        self.arrivals = list(arrivals) if arrivals is not None else None
        self.timed = workload.timed or self.arrivals is not None
        self.longest = max((len(vocab.wire_ids(r.token_ids)) + r.max_tokens for r in workload.requests), default=0)

    def __iter__(self) -> Iterator[Arrival]:
        times: Sequence[float | None] = (self.arrivals if self.arrivals is not None
                                         else [r.arrival_s for r in self.workload.requests])
        for request, at in zip(self.workload.requests, times, strict=True):
            yield Arrival(at, self.vocab.wire_ids(request.token_ids), request.max_tokens)

    def ideal(self, block_size: int) -> IdealCache:
        return ideal_hit_rate((self.vocab.wire_ids(r.token_ids) for r in self.workload.requests), block_size)


class PromptVocabulary:
    """Word tokens of a model's tokenizer that round-trip: decode(ids) encodes back to ids, for any sequence."""

    def __init__(self, tokenizer: ModelTokenizer) -> None:
        self.tokenizer = tokenizer
        words = []
        for tid in range(tokenizer.vocab_size):
            text = tokenizer.decode([tid])
            if _WORD.fullmatch(text) and tokenizer.encode(text, add_special_tokens=False) == [tid]:
                words.append(tid)
        if len(words) < 64:
            raise ValueError(f"the tokenizer has only {len(words)} single-token words; cannot build prompts")
        self.words = words
        self._words = np.empty(len(words), dtype=object)
        self._words[:] = words
        self.bos: list[int] = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        self._blocks: OrderedDict[tuple[str, int, int], list[int]] = OrderedDict()  # (namespace, n, ident)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PromptVocabulary:
        return cls(ModelTokenizer(model_dir))

    def tokens(self, seed: str, n: int) -> list[int]:
        """n tokens that depend only on `seed` (and the vocabulary): token i is word number splitmix64(hash(seed)
        + i) mod the vocabulary size -- a counter-based generator, so no generator state is set up per call
        (a whole trace expands hundreds of thousands of blocks)."""
        x = np.arange(n, dtype=np.uint64) * _GOLDEN + np.uint64(xxhash.xxh3_64_intdigest(seed.encode()))
        x = (x ^ (x >> _S30)) * _MIX1
        x = (x ^ (x >> _S27)) * _MIX2
        x ^= x >> _S31
        # an object array of the vocabulary's own int objects: the tokens are references, not copies
        tokens: list[int] = self._words[(x % np.uint64(len(self.words))).astype(np.intp)].tolist()
        return tokens

    def block(self, namespace: str, ident: int, n: int) -> list[int]:
        """The tokens of a numbered block (a trace hash_id): the same ident gives the same tokens."""
        return self.tokens(f"{namespace}:{ident}", n)

    def blocks(self, namespace: str, idents: Sequence[int], n: int, length: int) -> list[int]:
        """The first `length` tokens of the numbered blocks `idents` of `n` tokens each, one after another: the
        same as joining `block(namespace, ident, n)`. A trace's prompts repeat their blocks (a conversation's
        next turn is its history again), so the most recent `BLOCK_CACHE` blocks are kept and only the others
        computed, in one pass."""
        cache = self._blocks
        missing = [ident for ident in dict.fromkeys(idents) if (namespace, n, ident) not in cache]
        if missing:
            seeds = np.fromiter((xxhash.xxh3_64_intdigest(f"{namespace}:{ident}".encode()) for ident in missing),
                                dtype=np.uint64, count=len(missing))
            x = ((np.arange(n, dtype=np.uint64) * _GOLDEN)[None, :] + seeds[:, None]).ravel()
            x = (x ^ (x >> _S30)) * _MIX1
            x = (x ^ (x >> _S27)) * _MIX2
            x ^= x >> _S31
            tokens: list[int] = self._words[(x % np.uint64(len(self.words))).astype(np.intp)].tolist()
            for k, ident in enumerate(missing):
                cache[(namespace, n, ident)] = tokens[k * n:(k + 1) * n]
        out: list[int] = []
        for ident in idents:
            key = (namespace, n, ident)
            out += cache[key]
            cache.move_to_end(key)
            if len(out) >= length:
                break
        while len(cache) > BLOCK_CACHE:
            cache.popitem(last=False)
        del out[length:]
        return out

    def text(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))

    def wire_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The prompt as the engine sees a text prompt (the tokenizer adds BOS)."""
        return [*self.bos, *token_ids]

    def round_trips(self, token_ids: Sequence[int]) -> bool:
        """Whether the text of these tokens encodes (as a completions prompt) to exactly `wire_ids`."""
        return self.tokenizer.encode(self.text(token_ids), add_special_tokens=True) == self.wire_ids(token_ids)


# --- generators ---------------------------------------------------------------------------------------------


def tenants(vocab: PromptVocabulary, *, tenants: int = 8, prefix_tokens: int = 1024, users: int = 4,
            question_tokens: int = 64, requests_per_user: int = 4, max_tokens: int = 16, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prefixes = [vocab.tokens(f"tenant:{seed}:{t}", prefix_tokens) for t in range(tenants)]
    order = [(t, u, q) for t in range(tenants) for u in range(users) for q in range(requests_per_user)]
    rng.shuffle(order)
    requests = [WorkloadRequest(prefixes[t] + vocab.tokens(f"q:{seed}:{t}:{u}:{q}", question_tokens), max_tokens,
                                None, f"tenant{t}") for t, u, q in order]
    return Workload("tenants", requests, {"tenants": tenants, "prefix_tokens": prefix_tokens, "users": users,
                                          "question_tokens": question_tokens,
                                          "requests_per_user": requests_per_user, "max_tokens": max_tokens,
                                          "seed": seed})


def multi_turn(vocab: PromptVocabulary, *, sessions: int = 16, turns: int = 6, system_tokens: int = 256,
               question_tokens: int = 64, answer_tokens: int = 64, idle_s: float = 5.0, session_gap_s: float = 1.0,
               seed: int = 0) -> Workload:
    rng = random.Random(seed)
    requests = []
    start = 0.0
    for s in range(sessions):
        start += rng.expovariate(1.0 / session_gap_s) if session_gap_s > 0 else 0.0
        history = vocab.tokens(f"chat-system:{seed}:{s % 4}", system_tokens)  # a few assistants' system prompts
        at = start
        for k in range(turns):
            history = history + vocab.tokens(f"chat-q:{seed}:{s}:{k}", question_tokens)
            requests.append(WorkloadRequest(list(history), answer_tokens, at, f"chat{s}"))
            # the client keeps its answer in the history (its own copy: the engine's output is not known here)
            history = history + vocab.tokens(f"chat-a:{seed}:{s}:{k}", answer_tokens)
            at += rng.expovariate(1.0 / idle_s) if idle_s > 0 else 0.0
    requests.sort(key=lambda r: r.arrival_s or 0.0)
    return Workload("multi_turn", requests, {"sessions": sessions, "turns": turns, "system_tokens": system_tokens,
                                             "question_tokens": question_tokens, "answer_tokens": answer_tokens,
                                             "idle_s": idle_s, "session_gap_s": session_gap_s, "seed": seed})


def rag(vocab: PromptVocabulary, *, documents: int = 64, document_tokens: int = 512, docs_per_request: int = 1,
        zipf_s: float = 1.1, instruction_tokens: int = 64, question_tokens: int = 48, requests: int = 256,
        max_tokens: int = 16, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    weights = [1.0 / (d + 1) ** zipf_s for d in range(documents)]
    instruction = vocab.tokens(f"rag-instruction:{seed}", instruction_tokens)
    out = []
    for i in range(requests):
        docs: set[int] = set()
        while len(docs) < min(docs_per_request, documents):
            docs.add(rng.choices(range(documents), weights)[0])
        body = list(instruction)
        for d in sorted(docs):  # most popular first, so popular documents are shared prefixes
            body += vocab.tokens(f"rag-doc:{seed}:{d}", document_tokens)
        body += vocab.tokens(f"rag-q:{seed}:{i}", question_tokens)
        out.append(WorkloadRequest(body, max_tokens, None, f"doc{min(docs)}"))
    return Workload("rag", out, {"documents": documents, "document_tokens": document_tokens,
                                 "docs_per_request": docs_per_request, "zipf_s": zipf_s,
                                 "instruction_tokens": instruction_tokens, "question_tokens": question_tokens,
                                 "requests": requests, "max_tokens": max_tokens, "seed": seed})


def no_overlap(vocab: PromptVocabulary, *, requests: int = 256, prompt_tokens: int = 1024, max_tokens: int = 16,
               seed: int = 0) -> Workload:
    out = [WorkloadRequest(vocab.tokens(f"control:{seed}:{i}", prompt_tokens), max_tokens, None, f"r{i}")
           for i in range(requests)]
    return Workload("no_overlap", out, {"requests": requests, "prompt_tokens": prompt_tokens,
                                        "max_tokens": max_tokens, "seed": seed})


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets (seconds) of a Poisson process of `rate` requests/s."""
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# --- the upper bound ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IdealCache:
    """What one unbounded cache would have hit on this request sequence (tokens), counted as vLLM counts:
    leading full blocks already seen, never the prompt's last token; queries = all prompt tokens. `requests`:
    each request's (prompt tokens, tokens hit), in order (the time-to-first-token limit is made of them)."""

    hit_tokens: int
    query_tokens: int
    requests: list[tuple[int, int]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def ideal_hit_rate(prompts: Iterable[Sequence[int]], block_size: int, root: int | None = None) -> IdealCache:
    seen: set[int] = set()
    hits = queries = 0
    each: list[tuple[int, int]] = []
    parent = root_key("bench") if root is None else root
    for ids in prompts:
        n = len(ids)
        queries += n
        keys = block_keys(ids, block_size, parent)
        cacheable = (n - 1) // block_size if n else 0
        run = 0
        for key in keys[:cacheable]:
            if key not in seen:
                break
            run += 1
        hits += run * block_size
        each.append((n, run * block_size))
        seen.update(keys)
    return IdealCache(hits, queries, each)

