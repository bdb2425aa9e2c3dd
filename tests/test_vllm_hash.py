"""kvcore/vllm_hash.py reproduces vLLM's block hashes (vectors computed with vLLM 0.32's own
`hash_block_tokens`, default seed; the live and source comparisons are in test_conformance.py)."""

from __future__ import annotations

import pytest

from kvcore.vllm_hash import block_hashes, event_hash, make_block_hasher, none_hash

# tokens 0..63 in two blocks of 32, PYTHONHASHSEED unset; the third value: block 0 with cache_salt "t1"
VECTORS = {
    "sha256": ([13907755898995373680, 17701127471491950661], 16337770977126989952),
    "sha256_cbor": ([398006857992046888, 4651581343136509079], 4950577265076168778),
}


@pytest.mark.parametrize("algo", sorted(VECTORS))
def test_matches_vllm_vectors(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    chain, salted = VECTORS[algo]
    tokens = [*range(64), 1, 2, 3]  # the partial third block is never hashed
    assert [event_hash(d) for d in block_hashes(tokens, 32, algo)] == chain
    assert event_hash(block_hashes(tokens, 32, algo, cache_salt="t1")[0]) == salted
    hasher, to_event = make_block_hasher(algo)
    first = hasher(None, tokens[:32], None)
    assert [to_event(first), to_event(hasher(first, tokens[32:64], None))] == chain


def test_seed_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    default = none_hash("sha256")
    assert default == none_hash("sha256", "vllm-none-hash")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert none_hash("sha256") == none_hash("sha256", "0") != default
    assert block_hashes(list(range(32)), 32) != block_hashes(list(range(32)), 32, seed="vllm-none-hash")
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")
    hasher, to_event = make_block_hasher("sha256")
    digest = hasher(None, range(32), None)
    assert to_event(digest) == digest and len(digest) == 32
