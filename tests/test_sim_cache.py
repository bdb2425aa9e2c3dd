"""The simulator's paged prefix cache and scheduler, driven step by step (no HTTP): LRU eviction, in-use blocks
kept, prefix hits, preemption, and events that describe the cache exactly at every step."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from bench.sim.kv_cache import BlockPool, KvCacheManager
from bench.sim.perf_model import PROFILES
from bench.sim.scheduler import Scheduler, SchedulerOutput, SimRequest, Status
from kvcore.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from kvcore.vllm_hash import event_hash, make_block_hasher

BS = 4


HASHER, _ = make_block_hasher("sha256")


def sha(parent: bytes | None, tokens: Sequence[int], extra: Any = None) -> bytes:
    assert extra is None
    return HASHER(parent, tokens, None)


def hashes(tokens: Sequence[int]) -> list[bytes]:
    out: list[bytes] = []
    parent = None
    for end in range(BS, len(tokens) + 1, BS):
        parent = sha(parent, tokens[end - BS:end])
        out.append(parent)
    return out


def make(num_blocks: int = 9, max_num_seqs: int = 8, budget: int = 64, max_model_len: int = 32) -> Scheduler:
    pool = BlockPool(num_blocks, BS, event_hash)
    kv = KvCacheManager(pool, max_model_len)
    return Scheduler(kv, sha, max_num_seqs, budget, max_model_len)


def req(rid: str, prompt: list[int], max_tokens: int = 1) -> SimRequest:
    return SimRequest(rid, prompt, max_tokens, [7, 8, 9], hashes(prompt), 0.0)


def run_until_idle(s: Scheduler, max_steps: int = 100) -> list[KvEvent]:
    events: list[KvEvent] = []
    for _ in range(max_steps):
        if not s.has_unfinished():
            return events
        out = s.schedule()
        s.update_from_output(out, 0.0)
        events += s.kv.pool.take_events()
    raise AssertionError("engine did not become idle")


def test_lru_eviction_order_tail_blocks_first() -> None:
    s = make()
    pool = s.kv.pool
    a = list(range(100, 109))      # 9 tokens: 2 full blocks + 1 partial
    b = list(range(200, 209))
    s.add_request(req("a", a))
    ev_a = run_until_idle(s)
    s.add_request(req("b", b))
    run_until_idle(s)
    assert [type(e) for e in ev_a] == [BlockStored]
    stored = ev_a[0]
    assert isinstance(stored, BlockStored)
    ha = [event_hash(h) for h in hashes(a)]
    assert stored.block_hashes == ha and stored.parent_block_hash is None
    assert stored.token_ids == a[:8] and stored.block_size == BS and stored.medium == "GPU"
    # a used blocks 1,2,3 and freed them tail first; b used 4,5,6
    assert pool.free_order() == [7, 8, 3, 2, 1, 6, 5, 4]
    # c needs 5 blocks: pops 7, 8, then a's blocks from its tail: a's oldest-freed first
    c = list(range(300, 317))
    s.add_request(req("c", c))
    out = s.schedule()
    assert [ch.request.request_id for ch in out.chunks] == ["c"]
    removed = [e for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes[0] for e in removed] == [ha[1], ha[0]]
    assert all(e.medium == "GPU" for e in removed)
    assert set(pool.cached_hashes()) >= {event_hash(h) for h in hashes(b)}
    assert not set(pool.cached_hashes()) & set(ha)


def test_prefix_hit_reuses_blocks_and_last_token_is_recomputed() -> None:
    s = make()
    prompt = list(range(1, 13))   # exactly 3 blocks
    s.add_request(req("x", prompt))
    run_until_idle(s)
    s.add_request(req("y", [*prompt, 50, 51, 52, 53, 54]))
    out = s.schedule()
    (chunk,) = out.chunks
    assert chunk.num_context_tokens == 12 and chunk.num_new_tokens == 5
    assert chunk.request.num_cached_tokens == 12
    s.update_from_output(out, 0.0)
    run_until_idle(s)
    # the identical prompt again: all 3 blocks cached, but the last token is recomputed -> 2 blocks hit
    s.add_request(req("z", prompt))
    out = s.schedule()
    assert out.chunks[0].request.num_cached_tokens == 8
    assert s.kv.stats.queries == 12 + 17 + 12 and s.kv.stats.hits == 12 + 8


def test_blocks_of_running_requests_are_never_evicted() -> None:
    s = make(num_blocks=9, max_model_len=32)
    pool = s.kv.pool
    long_prompt = list(range(500, 520))     # 20 tokens = 5 blocks, generating keeps them in use
    s.add_request(req("holder", long_prompt, max_tokens=8))
    s.update_from_output(s.schedule(), 0.0)
    held = {event_hash(h) for h in hashes(long_prompt)}
    assert held <= set(pool.cached_hashes())
    # a second request needs 5 blocks but only 3 are free: it waits, and nothing of the holder is evicted
    s.add_request(req("waiter", list(range(600, 620))))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["holder"]
    assert s.requests["waiter"].status == Status.WAITING
    s.update_from_output(out, 0.0)
    assert not [e for e in pool.take_events() if isinstance(e, BlockRemoved) and e.block_hashes[0] in held]
    run_until_idle(s)
    assert s.requests == {}


def test_decode_fills_blocks_and_stores_them_with_parent() -> None:
    s = make()
    pool = s.kv.pool
    prompt = list(range(10, 16))     # 6 tokens: 1 full block
    r = req("d", prompt, max_tokens=7)
    s.add_request(r)
    events = run_until_idle(s)
    stored = [e for e in events if isinstance(e, BlockStored)]
    all_tokens = prompt + r.output_token_ids
    assert len(r.output_token_ids) == 7 and len(all_tokens) == 13
    # block 0 at prefill; block 1 once decode filled it (tokens 4..7); block 2 (8..11) likewise
    assert [len(e.block_hashes) for e in stored] == [1, 1, 1]
    full = hashes(all_tokens)
    assert [e.block_hashes[0] for e in stored] == [event_hash(h) for h in full]
    assert stored[1].parent_block_hash == event_hash(full[0]) and stored[1].token_ids == all_tokens[4:8]
    assert stored[2].token_ids == all_tokens[8:12]
    assert set(pool.cached_hashes()) == {event_hash(h) for h in full}


def test_reset_refused_while_in_use_then_clears() -> None:
    s = make()
    pool = s.kv.pool
    s.add_request(req("r", list(range(40, 52)), max_tokens=4))
    s.update_from_output(s.schedule(), 0.0)
    assert not pool.reset_prefix_cache()
    run_until_idle(s)
    pool.take_events()
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.cached_hashes() == {}


def test_chunked_prefill_respects_token_budget_and_max_num_seqs() -> None:
    s = make(num_blocks=40, max_num_seqs=2, budget=8, max_model_len=64)
    s.add_request(req("long", list(range(1000, 1020))))
    s.add_request(req("s1", [1, 2, 3]))
    s.add_request(req("s2", [4, 5, 6]))
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 8)]
    s.update_from_output(out, 0.0)
    assert s.requests["long"].output_token_ids == []          # a middle chunk samples nothing
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 8)]
    s.update_from_output(out, 0.0)
    out = s.schedule()
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("long", 4), ("s1", 3)]
    assert len(s.running) == 2 and s.requests["s2"].status == Status.WAITING


def apply(events: list[KvEvent], state: Counter[int]) -> None:
    for e in events:
        if isinstance(e, BlockStored):
            for h in e.block_hashes:
                assert isinstance(h, int)
                state[h] += 1
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                assert isinstance(h, int)
                state[h] -= 1
                if state[h] == 0:
                    del state[h]
        else:
            state.clear()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_events_rebuild_the_block_set_at_every_step(seed: int) -> None:
    """A random workload with shared prefixes, a tiny cache, preemptions and aborts."""
    rng = random.Random(seed)
    s = make(num_blocks=16, max_num_seqs=6, budget=16, max_model_len=40)
    pool = s.kv.pool
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    state: Counter[int] = Counter()
    n = 0
    preempted = 0
    made: list[SimRequest] = []
    for step in range(400):
        if rng.random() < 0.5:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            made.append(req(f"r{n}", prompt, max_tokens=rng.randrange(1, 20)))
            s.add_request(made[-1])
            n += 1
        if rng.random() < 0.03 and s.running:
            s.abort(rng.choice(s.running).request_id)
        if rng.random() < 0.02 and not s.has_unfinished():
            pool.reset_prefix_cache()
        out = s.schedule()
        preempted += out.num_preempted
        s.update_from_output(out, float(step))
        apply(pool.take_events(), state)
        assert dict(state) == pool.cached_hashes(), f"step {step}"
        in_use = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        assert in_use + pool.num_free_blocks == pool.num_blocks - 1
    run_until_idle(s, 1000)
    assert n > 100 and preempted > 0
    for r in made:
        assert r.status in (Status.FINISHED, Status.ABORTED)
        if r.status == Status.FINISHED:
            assert len(r.output_token_ids) == r.max_tokens and r.finish_reason == "length"
            assert r.block_hashes == hashes(r.all_token_ids)


def _step_state(s: Scheduler, out: SchedulerOutput) -> tuple[Any, ...]:
    """What a step and the engine after it are: the chunks, every request's tokens and blocks, the pool."""
    return ([(c.request.request_id, c.num_new_tokens, c.num_context_tokens) for c in out.chunks],
            [(r.request_id, r.status, list(r.all_token_ids), r.num_computed_tokens, r.first_token_time,
              list(r.block_hashes),
              [b.block_id for b in s.kv.tables[r.request_id].blocks] if r.request_id in s.kv.tables else None)
             for r in s.requests.values()],
            s.kv.pool.free_order(), s.kv.pool.cached_hashes())


def _twin_schedulers(rng: random.Random) -> tuple[Scheduler, Scheduler, list[list[int]]]:
    """Two equal schedulers with a tiny cache, and four shared prompt prefixes for their random workload."""
    twins = [make(num_blocks=24, max_num_seqs=4, budget=16, max_model_len=64) for _ in range(2)]
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([4, 8, 12]))] for _ in range(4)]
    return twins[0], twins[1], prefixes


def _maybe_arrive(rng: random.Random, step: int, prefixes: list[list[int]], *schedulers: Scheduler) -> None:
    """One step of the random workload: now and then the same new request (a shared prefix and a few tokens of its
    own) to every scheduler."""
    if rng.random() < 0.08:
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
        max_tokens = rng.randrange(1, 40)
        for scheduler in schedulers:
            scheduler.add_request(req(f"r{step}", prompt, max_tokens))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_repeated_decode_steps_are_the_steps_the_scheduler_makes(seed: int) -> None:
    """`repeat_decodes` against `update_from_output` + `schedule` on the same random workload (shared prefixes,
    a tiny cache, preemptions, requests arriving and ending at random steps): after every step the same chunks,
    tokens, block tables, free queue, cached blocks and KV events; and it does repeat most decode steps, and
    refuses the steps that fill or need a block, finish a request or admit one."""
    rng = random.Random(seed)
    plain, fast, prefixes = _twin_schedulers(rng)
    out_plain, out_fast = plain.schedule(), fast.schedule()
    repeated = refused = 0
    for step in range(600):
        _maybe_arrive(rng, step, prefixes, plain, fast)
        plain.update_from_output(out_plain, float(step))
        out_plain = plain.schedule()
        if fast.repeat_decodes(out_fast):
            assert out_fast.chunks
            repeated += 1
        else:
            refused += bool(out_fast.chunks)
            fast.update_from_output(out_fast, float(step))
            out_fast = fast.schedule()
        assert _step_state(fast, out_fast) == _step_state(plain, out_plain), f"step {step}"
        assert fast.kv.pool.take_events() == plain.kv.pool.take_events(), f"step {step}"
    assert repeated > 100 and refused > 100, (repeated, refused)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_run_of_repeated_decode_steps_is_as_many_single_repeats(seed: int) -> None:
    """`repeat_decodes(out, k)` against k calls of `repeat_decodes(out)`: the same chunks, tokens and blocks
    after it, for every k up to `decode_repeats` (which counts exactly the single repeats that succeed); beyond
    it, nothing changes."""
    rng = random.Random(seed)
    single, run, prefixes = _twin_schedulers(rng)
    out_single, out_run = single.schedule(), run.schedule()
    runs = 0
    for step in range(600):
        _maybe_arrive(rng, step, prefixes, single, run)
        repeats = run.decode_repeats(out_run)
        if repeats:
            before = _step_state(run, out_run)
            assert not run.repeat_decodes(out_run, repeats + 1)
            assert _step_state(run, out_run) == before
            k = rng.randint(1, repeats)
            assert run.repeat_decodes(out_run, k)
            for _ in range(k):
                assert single.repeat_decodes(out_single)
            runs += k > 1
            if k == repeats:
                assert not single.repeat_decodes(out_single)
        else:
            assert not single.repeat_decodes(out_single)
            for s, out in ((single, out_single), (run, out_run)):
                s.update_from_output(out, float(step))
            out_single, out_run = single.schedule(), run.schedule()
        assert _step_state(run, out_run) == _step_state(single, out_single), f"step {step}"
    assert runs > 10, runs


def test_a_new_request_is_admitted_only_if_its_whole_prompt_fits() -> None:
    """vLLM 0.32's scheduler_reserve_full_isl: the first chunk fitting is not enough."""
    s = make(num_blocks=9, budget=8, max_model_len=32)
    s.add_request(req("holder", list(range(1, 10)), max_tokens=20))     # 3 blocks, decoding for a while
    s.update_from_output(s.schedule(), 0.0)
    s.update_from_output(s.schedule(), 0.0)
    assert s.kv.pool.num_free_blocks == 5
    s.add_request(req("big", list(range(100, 124))))                    # 6 blocks; its first chunk needs 2
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["holder"]
    assert s.requests["big"].status == Status.WAITING
    s.update_from_output(out, 0.0)
    run_until_idle(s)
    assert "big" not in s.requests   # admitted and finished once the holder was done


def test_a_hash_held_by_two_blocks_is_found_until_both_are_evicted() -> None:
    """Two requests that computed the same block before either was cached each cache it: the pool finds the first
    block to get the hash, then, once that one is evicted, the other; the hash is gone with the last one."""
    pool = BlockPool(3, BS, event_hash)  # the null block and these two
    [h] = hashes([1, 2, 3, 4])
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [h], 0, 1, [1, 2, 3, 4])
    pool.cache_full_blocks([second], [h], 0, 1, [1, 2, 3, 4])
    assert pool.get_cached_block(h) is first
    assert pool.cached_hashes() == {event_hash(h): 2}
    pool.free_blocks([first, second])
    [reused] = pool.get_new_blocks(1)  # the head of the free queue: `first` is evicted
    assert reused is first and pool.get_cached_block(h) is second
    assert pool.cached_hashes() == {event_hash(h): 1}
    pool.get_new_blocks(1)
    assert pool.get_cached_block(h) is None and pool.cached_hashes() == {}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_a_decode_step_takes_what_step_time_says_to_the_last_bit(profile: str) -> None:
    """`decodes_time` (a decode step from its sequences and their context in all, as the virtual-time fleet
    prices a repeated step) against `step_time` over each sequence's chunk: equal floats, not close ones."""
    rng = random.Random(profile)
    model = PROFILES[profile]
    for _ in range(2000):
        contexts = [rng.randrange(1, 1 << rng.choice([4, 12, 20])) for _ in range(rng.randrange(1, 300))]
        assert model.decodes_time(len(contexts), sum(contexts)) == model.step_time([(1, c) for c in contexts])
