"""Request traces, read as a stream: Mooncake's JSON lines and the gateway's recorded superset of them
(router/trace_record.py), turned into prompts only when a request arrives.

Reading is strict about order and lenient about lines. A line that is not a JSON object of the trace's fields
(truncated, malformed, a wrong type, a negative length) is reported with its line number and skipped, and
counted; fields the reader does not know are ignored. A trace whose timestamps go backwards is refused
(`TraceError`): replaying it would reorder arrivals silently. `Trace` checks the whole file once when it is
opened (so a bad trace fails before a simulation starts, and the number of requests is known for progress bars),
then iterates it again as often as asked without keeping it in memory.

Each hash id expands to the same tokens every time (`PromptVocabulary.block`, seeded by the id), the last block
cut to `input_length`, so equal leading ids are equal leading tokens. The ideal single-cache hit rate of a
trace (`ideal_hit_rate`) is computed from the ids, without expanding a token: two prompts share exactly the
tokens of their common leading ids (different ids expand to different tokens; where one of them ends inside a
block, they share that block up to the shorter end).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import msgspec
import xxhash

from bench.workloads import Arrival, IdealCache, PromptVocabulary, Workload, WorkloadRequest
from router.trace_record import MOONCAKE_BLOCK_TOKENS, TraceRecord

__all__ = ["MOONCAKE_BLOCK_TOKENS", "Trace", "TraceError", "TraceRecord", "TraceSource", "expand_record"]

_DECODER = msgspec.json.Decoder(TraceRecord)
SHOWN_SKIPS = 10  # skipped lines reported one by one; the rest are only counted


class TraceError(ValueError):
    """A trace that cannot be replayed as it is (its message says why and where)."""


@dataclass
class TraceScan:
    """What checking a trace found."""

    records: int = 0  # usable lines (after offset and limit)
    skipped: int = 0  # lines reported and skipped
    skipped_lines: list[tuple[int, str]] = field(default_factory=list)  # the first SHOWN_SKIPS: (line, why)
    first_ms: float | None = None
    last_ms: float | None = None
    prompt_tokens: int = 0

    @property
    def duration_s(self) -> float:
        return 0.0 if self.first_ms is None or self.last_ms is None else (self.last_ms - self.first_ms) / 1000


class Trace:
    """A trace file, checked once (`scan`) and then read as a stream of records, [offset, offset + limit)."""

    def __init__(self, path: str | Path, *, offset: int = 0, limit: int | None = None,
                 report: TextIO | None = sys.stderr) -> None:
        self.path = Path(path)
        self.offset = offset
        self.limit = limit
        if not self.path.is_file():
            raise TraceError(f"{self.path}: " + ("a directory, not a trace file" if self.path.is_dir()
                                                 else "no such trace file"))
        with self.path.open("rb") as f:
            if f.read(2) == b"\x1f\x8b":
                raise TraceError(f"{self.path}: gzip-compressed; a trace is JSON lines (gunzip it first)")
        self.scan = self._check(report)
        if not self.scan.records:
            raise TraceError(f"{self.path}: no usable request in the selection (offset {offset}, limit {limit}; "
                             f"{self.scan.skipped} malformed lines skipped)")

    def _lines(self) -> Iterator[tuple[int, TraceRecord | str]]:
        """(line number, record or why the line is unusable), for the non-empty lines in the selection."""
        usable = 0
        with self.path.open("rb") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record: TraceRecord | str = _DECODER.decode(line)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    record = str(exc)
                if isinstance(record, TraceRecord):
                    usable += 1
                    if usable <= self.offset:
                        continue
                    if self.limit is not None and usable > self.offset + self.limit:
                        return
                yield number, record

    def _check(self, report: TextIO | None) -> TraceScan:
        scan = TraceScan()
        previous: tuple[int, float] | None = None
        for number, record in self._lines():
            if isinstance(record, str):
                scan.skipped += 1
                if len(scan.skipped_lines) < SHOWN_SKIPS:
                    scan.skipped_lines.append((number, record))
                    if report is not None:
                        print(f"{self.path}:{number}: skipped, {record}", file=report)
                continue
            if previous is not None and record.timestamp < previous[1]:
                raise TraceError(
                    f"{self.path}:{number}: timestamp {record.timestamp:g} ms is earlier than line {previous[0]}'s "
                    f"{previous[1]:g} ms; a trace lists requests in arrival order (sort it by timestamp)")
            previous = (number, record.timestamp)
            scan.records += 1
            scan.prompt_tokens += record.input_length
            if scan.first_ms is None:
                scan.first_ms = record.timestamp
            scan.last_ms = record.timestamp
        if report is not None and scan.skipped > len(scan.skipped_lines):
            print(f"{self.path}: {scan.skipped - len(scan.skipped_lines)} more malformed lines skipped",
                  file=report)
        return scan

    def __iter__(self) -> Iterator[TraceRecord]:
        for _, record in self._lines():
            if isinstance(record, TraceRecord):
                yield record

    def __len__(self) -> int:
        return self.scan.records


def _length(record: TraceRecord, block_tokens: int | None) -> tuple[int, int]:
    """(tokens per id, prompt length) of a record expanded at `block_tokens` per id (None: the trace's own; a
    different size scales every prompt alike)."""
    native = record.tokens_per_id
    if block_tokens is None or block_tokens == native:
        return native, record.input_length
    return block_tokens, max(1, math.ceil(record.input_length * block_tokens / native))


def expand_record(record: TraceRecord, vocab: PromptVocabulary, block_tokens: int | None = None) -> list[int]:
    """The prompt of one record: each hash id becomes its tokens, the last block cut so the prompt has the
    record's length (scaled when `block_tokens` differs from the trace's)."""
    size, length = _length(record, block_tokens)
    ids = record.hash_ids[: -(-length // size)]
    tokens = vocab.blocks("mooncake", ids, size, length)
    if len(tokens) < length:  # a record with fewer ids than its length needs: pad with its own tokens
        tokens.extend(vocab.tokens(_tail_seed(record), length - len(tokens)))
    return tokens


def _tail_seed(record: TraceRecord) -> str:
    return f"mooncake-tail:{tuple(record.hash_ids)}:{record.input_length}"


def _output(record: TraceRecord, max_output_tokens: int | None) -> int:
    out = record.output_length if max_output_tokens is None else min(record.output_length, max_output_tokens)
    return max(1, out)


def mooncake_workload(path: str | Path, vocab: PromptVocabulary, *, limit: int | None = None, offset: int = 0,
                      time_scale: float = 1.0, block_tokens: int | None = None,
                      max_output_tokens: int | None = None) -> Workload:
    """The whole selection in memory (for live runs): records [offset, offset + limit), arrival = (timestamp -
    first) / 1000 / time_scale (time_scale 2 replays twice as fast)."""
    trace = Trace(path, offset=offset, limit=limit)
    t0 = trace.scan.first_ms or 0.0
    requests = [WorkloadRequest(expand_record(rec, vocab, block_tokens), _output(rec, max_output_tokens),
                                (rec.timestamp - t0) / 1000.0 / time_scale,
                                f"h{rec.hash_ids[0]}" if rec.hash_ids else "") for rec in trace]
    return Workload("mooncake", requests, {"trace": str(path), "limit": limit, "offset": offset,
                                           "time_scale": time_scale, "block_tokens": block_tokens,
                                           "max_output_tokens": max_output_tokens})


class TraceSource:
    """A trace as a stream of arrivals (the `RequestSource` the virtual-time fleet reads): each record becomes
    its prompt when it is taken, so only requests in flight hold tokens."""

    name = "trace"
    timed = True

    def __init__(self, trace: Trace, vocab: PromptVocabulary, *, time_scale: float = 1.0,
                 block_tokens: int | None = None, max_output_tokens: int | None = None) -> None:
        self.trace = trace
        self.vocab = vocab
        self.time_scale = time_scale
        self.block_tokens = block_tokens
        self.max_output_tokens = max_output_tokens
        self.count = len(trace)
        bos = len(vocab.bos)
        self.longest = max(bos + _length(rec, block_tokens)[1] + _output(rec, max_output_tokens) for rec in trace)
        self.params = {"trace": str(trace.path), "offset": trace.offset, "limit": trace.limit,
                       "time_scale": time_scale, "block_tokens": block_tokens,
                       "max_output_tokens": max_output_tokens, "skipped_lines": trace.scan.skipped}

    def __iter__(self) -> Iterator[Arrival]:
        t0 = self.trace.scan.first_ms or 0.0
        vocab = self.vocab
        for rec in self.trace:
            yield Arrival((rec.timestamp - t0) / 1000.0 / self.time_scale,
                          vocab.wire_ids(expand_record(rec, vocab, self.block_tokens)),
                          _output(rec, self.max_output_tokens))

    def ideal(self, block_size: int) -> IdealCache:
        """The hit rate one unbounded cache would reach on this trace (as `workloads.ideal_hit_rate` counts:
        leading full blocks seen before, never the last token), from the hash ids alone."""
        bos = len(self.vocab.bos)
        longest_seen: dict[int, int] = {}  # a chain of ids -> the most tokens of its last block seen
        hits = queries = 0
        each: list[tuple[int, int]] = []
        for rec in self.trace:
            size, length = _length(rec, self.block_tokens)
            ids = rec.hash_ids[: -(-length // size)]
            # (link, tokens) per block; the padding of a record short of ids is its own block (shared by a twin)
            blocks: list[tuple[str, int]] = [(str(i), min(size, length - j * size)) for j, i in enumerate(ids)]
            if len(ids) * size < length:
                blocks.append((_tail_seed(rec), length - len(ids) * size))
            shared, link, whole = bos, 0, True  # whole: every block so far was shared in full
            for name, mine in blocks:
                link = xxhash.xxh3_64_intdigest(name.encode(), seed=link)  # the chain of ids up to this block
                seen = longest_seen.get(link, 0)
                if whole:
                    shared += min(seen, mine)
                    whole = seen >= mine
                if mine > seen:
                    longest_seen[link] = mine
            total = bos + length
            queries += total
            cacheable = (total - 1) // block_size
            hit = min(shared // block_size, cacheable) * block_size
            hits += hit
            each.append((total, hit))
        return IdealCache(hits, queries, each)


# --- a synthetic conversation trace ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ConversationShape:
    """Chats as a service sees them, in Mooncake's trace format: each conversation starts with one of a few
    system prompts (whole blocks, so they are shared) and a first message (documents, code: long, lognormal);
    every next turn is the whole history (the full blocks of the last turn, then its partial block and the answer
    and question that follow as new ids) plus a new question. Conversations start uniformly over `duration_s`,
    turns are `turn_gap_s` (exponential mean) apart. The defaults give about the size of Mooncake's conversation
    trace (12,031 requests, ~145 M prompt tokens, mean output ~340, one hour)."""

    requests: int = 12_031
    duration_s: float = 3600.0
    system_prompts: int = 24
    system_blocks: tuple[int, int] = (1, 6)       # 512-token blocks, uniform
    first_message_tokens: float = 4700.0           # lognormal median
    first_message_sigma: float = 0.9
    turn_tokens: float = 1200.0                    # answer + next question, exponential mean
    mean_turns: float = 4.0                        # geometric
    turn_gap_s: float = 60.0
    output_tokens: float = 340.0                   # exponential mean
    max_input_tokens: int = 120_000
    seed: int = 0


def conversation_trace(shape: ConversationShape = ConversationShape()) -> list[TraceRecord]:
    """The records of a synthetic conversation trace (ids only, no tokens), in arrival order."""
    rng = random.Random(shape.seed)
    bt = MOONCAKE_BLOCK_TOKENS
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        next_id += n
        return list(range(next_id - n, next_id))

    systems = [fresh(rng.randint(*shape.system_blocks)) for _ in range(shape.system_prompts)]
    out: list[TraceRecord] = []
    while len(out) < shape.requests:
        at = rng.uniform(0, shape.duration_s)
        ids = list(rng.choice(systems))
        length = len(ids) * bt
        grow = min(int(rng.lognormvariate(math.log(shape.first_message_tokens), shape.first_message_sigma)),
                   shape.max_input_tokens // 2)
        while True:
            length = min(length + max(grow, 1), shape.max_input_tokens)
            ids += fresh(-(-length // bt) - len(ids))
            out.append(TraceRecord(timestamp=round(at * 1000.0, 3), input_length=length,
                                   output_length=max(1, int(rng.expovariate(1 / shape.output_tokens))),
                                   hash_ids=list(ids)))
            if rng.random() < 1 / shape.mean_turns or length >= shape.max_input_tokens:
                break
            ids = ids[: length // bt]  # the partial last block changes as the history grows
            at += rng.expovariate(1 / shape.turn_gap_s)
            grow = int(rng.expovariate(1 / shape.turn_tokens))
    out.sort(key=lambda r: r.timestamp)
    out = out[: shape.requests]
    stretch = shape.duration_s * 1000.0 / max(out[-1].timestamp, 1.0)  # the last turns of the last chats fit too
    for record in out:
        record.timestamp = round(record.timestamp * stretch, 3)
    return out


def write_trace(path: str | Path, records: Iterable[TraceRecord]) -> None:
    encoder = msgspec.json.Encoder()
    with Path(path).open("wb") as f:
        for record in records:
            f.write(encoder.encode(record) + b"\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shape = ConversationShape()
    parser.add_argument("--out", required=True, help="the JSONL trace to write")
    parser.add_argument("--requests", type=int, default=shape.requests)
    parser.add_argument("--duration-s", type=float, default=shape.duration_s)
    parser.add_argument("--seed", type=int, default=shape.seed)


def run(args: argparse.Namespace) -> int:
    records = conversation_trace(ConversationShape(requests=args.requests, duration_s=args.duration_s,
                                                   seed=args.seed))
    write_trace(args.out, records)
    tokens = sum(r.input_length for r in records)
    print(f"wrote {args.out}: {len(records)} requests, {tokens / 1e6:.1f} M prompt tokens, "
          f"{sum(r.output_length for r in records) / len(records):.0f} output tokens per request on average, "
          f"{records[-1].timestamp / 1000:.0f} s")
    return 0
