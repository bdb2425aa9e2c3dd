"""Workloads: Mooncake trace expansion, generators, the ideal-cache upper bound."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import workloads
from bench.traces import TraceRecord, expand_record, mooncake_workload
from bench.workloads import PromptVocabulary, ideal_hit_rate
from router.block_keys import block_keys, root_key


@pytest.fixture(scope="module")
def vocab(tiny_model_dir: Path) -> PromptVocabulary:
    return PromptVocabulary.from_model_dir(tiny_model_dir)


def keys(ids: list[int], bs: int = 16) -> list[int]:
    return block_keys(ids, bs, root_key("tiny"))


def test_expansion_is_deterministic_and_shares_exactly_the_ids_blocks(vocab: PromptVocabulary,
                                                                     tiny_model_dir: Path) -> None:
    a = TraceRecord(0, 1500, 8, [1, 2, 3])
    b = TraceRecord(1, 1536, 8, [1, 2, 4])
    c = TraceRecord(2, 1024, 8, [5, 2])
    ea, eb, ec = (expand_record(r, vocab) for r in (a, b, c))
    assert (len(ea), len(eb), len(ec)) == (1500, 1536, 1024)
    # a fresh vocabulary (another process, another run) expands the same ids to the same tokens
    again = PromptVocabulary.from_model_dir(tiny_model_dir)
    assert expand_record(a, again) == ea and expand_record(b, again) == eb
    # same leading ids -> same leading tokens; the first differing id -> different tokens from there on
    assert ea[:1024] == eb[:1024]
    assert ea[1024:1500] != eb[1024:1500]
    assert eb[1024:] == vocab.block("mooncake", 4, 512)
    # id 2 is the same 512 tokens wherever it stands...
    assert ec[512:] == ea[512:1024]
    # ...but only a shared chain of ids is a shared prefix: block keys chain, so c shares no block with a
    ka, kb, kc = keys(ea), keys(eb), keys(ec)
    assert len(set(ka) & set(kb)) == 1024 // 16 and ka[:64] == kb[:64]
    assert not set(kc) & set(ka)
    # the text of the tokens encodes back to exactly these ids (after the BOS the tokenizer adds)
    assert vocab.round_trips(ea) and vocab.round_trips(ec)
    assert vocab.wire_ids(ea)[1:] == ea


def test_shrunk_blocks_keep_the_sharing(vocab: PromptVocabulary) -> None:
    a = expand_record(TraceRecord(0, 1500, 8, [1, 2, 3]), vocab, block_tokens=32)
    b = expand_record(TraceRecord(0, 1536, 8, [1, 2, 4]), vocab, block_tokens=32)
    assert len(a) == 94 and len(b) == 96 and a[:64] == b[:64] and a[64:] != b[64:94]


def test_mooncake_replay_selection_and_time_scale(vocab: PromptVocabulary, tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 600, "output_length": 5 + i, "hash_ids": [i, 100 + i]}
            for i in range(6)]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = mooncake_workload(trace, vocab, offset=2, limit=3, time_scale=2.0, max_output_tokens=6)
    assert [r.arrival_s for r in w.requests] == [0.0, 0.5, 1.0]
    assert [r.max_tokens for r in w.requests] == [6, 6, 6]
    assert w.requests[0].token_ids[:512] == vocab.block("mooncake", 2, 512)
    assert w.timed


def test_upper_bound_on_a_hand_made_sequence() -> None:
    bs = 4
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    prompts = [
        a + b + [20, 21],      # 10 tokens, nothing seen: 0
        a + b + [30, 31, 32],  # 11 tokens: blocks a, b seen -> 8
        a + b,                 # 8 tokens: the last token is always computed -> only a -> 4
        c + b,                 # b after c is another chain -> 0
        c + b + [40],          # 9 tokens: c, b (as chained after c) seen -> 8
    ]
    bound = ideal_hit_rate(prompts, bs)
    assert bound.query_tokens == 10 + 11 + 8 + 8 + 9
    assert bound.hit_tokens == 0 + 8 + 4 + 0 + 8
    assert bound.hit_rate == pytest.approx(20 / 46)


def test_generators_have_the_documented_shape(vocab: PromptVocabulary) -> None:
    t = workloads.tenants(vocab, tenants=3, prefix_tokens=64, users=2, question_tokens=8, requests_per_user=2)
    assert len(t.requests) == 3 * 2 * 2 and all(len(r.token_ids) == 72 for r in t.requests)
    by_tenant: dict[str, set[tuple[int, ...]]] = {}
    for r in t.requests:
        by_tenant.setdefault(r.group, set()).add(tuple(r.token_ids[:64]))
    assert len(by_tenant) == 3 and all(len(p) == 1 for p in by_tenant.values())
    m = workloads.multi_turn(vocab, sessions=2, turns=3, system_tokens=32, question_tokens=8, answer_tokens=8)
    conv = [r for r in m.requests if r.group == "chat0"]
    assert [len(r.token_ids) for r in conv] == [40, 56, 72]
    assert conv[2].token_ids[:56] == conv[1].token_ids  # the history grows by each answer and question
    assert conv[1].token_ids[40:48] == vocab.tokens("chat-a:0:0:0", 8)
    assert all(x.arrival_s is not None for x in m.requests) and m.timed
    rag = workloads.rag(vocab, documents=10, document_tokens=32, instruction_tokens=8, question_tokens=8,
                        requests=50)
    assert ideal_hit_rate([r.token_ids for r in rag.requests], 8).hit_rate > 0.5
    control = workloads.no_overlap(vocab, requests=20, prompt_tokens=64)
    assert ideal_hit_rate([r.token_ids for r in control.requests], 16).hit_tokens == 0
