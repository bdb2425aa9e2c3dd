"""Incremental tokenization (router/token_cache.py): whatever it reuses, the ids and block keys are those of
encoding the whole prompt; it encodes only what is new; it stays within its byte budget."""

from __future__ import annotations

import gc
import random
import sys
import time
import tracemalloc
from array import array
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

from router.block_keys import block_keys, root_key
from router.token_cache import CHUNK, TokenCache, _links, _shared_bytes
from router.tokenizer import ENDS_STEP, ModelTokenizer

ROOT = root_key("tiny")
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|endoftext|>", " ", "  ", "   ", "\n", "\n\n", "\r\n",
             "\t", " \n ", "é", "日本語", "🙂", "<|im", "start|>", "def f(x):\n    return x\n", "'s", " don't",
             "1234567", "...", "ab", "cd", "the", " the", "The", "x" * 40, " " * 40, "\n" * 9]


# o200k's split pattern (GPT-4o)
O200K_PATTERN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_model_dir)


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "router", "cache", "token", "é"]) + str(i % 7)
                    for i in range(n))


def check(cache: TokenCache, tok: ModelTokenizer, text: str, special: bool = False, root: int = ROOT) -> Any:
    found = cache.encode(tok, text, add_special_tokens=special, root=root)
    expected = tok.encode(text, add_special_tokens=special)
    assert list(found.ids) == expected
    assert found.keys == block_keys(expected, cache.block_size, root)
    return found


text_piece = st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12), st.text("ab \n\t.é1", max_size=30))
texts = st.lists(text_piece, max_size=40).map("".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shared=st.lists(text_piece, min_size=20, max_size=200).map("".join), first=texts, second=texts,
       special=st.booleans(), same_root=st.booleans())
def test_spliced_ids_equal_whole_encoding(tok: ModelTokenizer, shared: str, first: str, second: str, special: bool,
                                          same_root: bool) -> None:
    cache = TokenCache(1 << 20, block_size=4)
    check(cache, tok, shared + first, special)
    check(cache, tok, shared + second, special, ROOT if same_root else root_key("tiny", None, "tenant"))
    check(cache, tok, shared[: len(shared) // 2] + second, special)  # a prompt that parts inside the shared text
    check(cache, tok, shared + first, special)  # the first again, exactly


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=st.lists(st.tuples(st.integers(0, 3), texts), min_size=5, max_size=30))
def test_a_small_cache_under_churn_stays_exact_and_bounded(tok: ModelTokenizer,
                                                           prompts: list[tuple[int, str]]) -> None:
    """Prompts sharing one of four long beginnings, through a cache that holds only a few: evictions happen."""
    cache = TokenCache(60_000, block_size=16)
    heads = [words(seed, 150) for seed in range(4)]
    for head, tail in prompts:
        check(cache, tok, heads[head] + tail)
        assert cache.bytes <= cache.max_bytes


ascii_piece = st.one_of(st.sampled_from([f for f in FRAGMENTS if f.isascii()]), st.text("ab \n\t.1<|>'", max_size=30))
ascii_texts = st.lists(ascii_piece, max_size=40).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turns=st.lists(ascii_texts, min_size=2, max_size=12), special=st.booleans())
def test_ends_summed_only_when_a_seam_needs_them_stay_exact(tok: ModelTokenizer, turns: list[str],
                                                            special: bool) -> None:
    """ASCII prompts keep only the ends a seam has needed so far (the rest follow from the byte table): a
    conversation growing turn by turn, each prompt parting from the last inside its tail, and a prompt parting
    from the first one's, give the whole text's ids; every cached prompt's ends, completed, are the tokenizer's."""
    cache = TokenCache(1 << 22, block_size=4)
    head = words(9, 60).replace("é", "e")
    text = head
    for turn in turns:
        text += turn
        check(cache, tok, text, special)
        check(cache, tok, text[: len(head) + len(turn) // 2] + turn[::-1], special)
    for entry in cache._entries.values():
        data, ids = entry[0], memoryview(entry[2]).cast("I")
        ends = array("I", entry[3])
        assert len(ends) <= len(ids)
        tok.more_ends(ends, ids, len(data))
        with_specials = entry[1] == tok.cache_seed(True)
        assert list(ends) == list(tok.encode_with_ends(data.decode(), add_special_tokens=with_specials)[1])
    assert cache.hits > 0


def test_awkward_conversations_give_whole_text_ids(tok: ModelTokenizer) -> None:
    cache = TokenCache(200_000, block_size=16)  # small: evictions happen too
    rng = random.Random(5)
    conversation: list[dict[str, Any]] = []
    for turn in range(40):
        content = "".join(rng.choice(FRAGMENTS) if rng.random() < 0.4 else words(rng.randrange(10**6), 5)
                          for _ in range(rng.randrange(1, 30)))
        conversation.append({"role": ("user", "assistant", "system")[turn % 3], "content": content})
        text = tok.render_chat(conversation)
        check(cache, tok, text)
        check(cache, tok, text, special=True)
    assert cache.hits > 40


def test_only_the_new_text_is_encoded(tok: ModelTokenizer) -> None:
    cache = TokenCache(1 << 24, block_size=16)
    system = words(1, 800)
    check(cache, tok, system + " first question " + words(2, 30))
    encoded = cache.encoded_chars
    question = " second question " + words(3, 30)
    found = check(cache, tok, system + question)
    # the question, plus the margin and overlap tokens before the seam (a few dozen characters)
    assert cache.encoded_chars - encoded < len(question) + 200
    assert found.reused_tokens > len(found.ids) * 0.8
    encoded = cache.encoded_chars
    check(cache, tok, system + question)  # the same prompt again: nothing is encoded
    assert cache.encoded_chars == encoded
    assert cache.seam_mismatches == 0


def test_different_tokenizer_settings_never_share_ids(tok: ModelTokenizer) -> None:
    cache = TokenCache(1 << 24, block_size=16)
    text = words(4, 400)
    plain = check(cache, tok, text)
    with_bos = check(cache, tok, text, special=True)
    assert list(with_bos.ids[1:]) == list(plain.ids)


def model_with(source: Path, target: Path, tokenizer: Tokenizer) -> Path:
    target.mkdir()
    (target / "tokenizer_config.json").write_text((source / "tokenizer_config.json").read_text())
    (target / "tokenizer.json").write_text(tokenizer.to_str())
    return target


def test_a_seam_inside_a_group_of_digits_is_not_spliced(tiny_model_dir: Path, tmp_path: Path) -> None:
    """Llama 3's pre-tokenizer cuts a run of digits into groups of three from its first digit (`\\p{N}{1,3}`), so a
    window starting inside a group groups the rest of the run differently: the first six tokens can still come out
    as cached (the tiny vocabulary has one- and two-digit tokens) and the run's last ones not. Before: 68 of these
    800 prompts had ids other than the whole text's, with either pre-tokenizer (a token short or over at the run's
    end: "...4699" as 4, 6, 9, 9 where the whole text has 9, 4, 6, 99)."""
    from tests.test_word_encoder import LLAMA3_PATTERN

    tiny = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    for pre_tokenizer in (
            [pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)],
            # DeepSeek V3's shape: the digits split off by a Split of their own, then GPT-2's pattern
            [pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
             pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]):
        tiny.pre_tokenizer = pre_tokenizers.Sequence(pre_tokenizer)
        tok = ModelTokenizer(model_with(tiny_model_dir, tmp_path / str(len(list(tmp_path.iterdir()))), tiny))
        rng = random.Random(0)
        for _ in range(400):
            cache = TokenCache(1 << 20, block_size=16)
            digits = "".join(rng.choice("0123456789\u0661\u0662\u0663\u00b2") for _ in range(rng.randint(10, 40)))
            for tail in (" alpha", " beta gamma"):
                check(cache, tok, "x " * 150 + digits + tail)


@pytest.mark.parametrize("pattern", ["llama3", "qwen2", "o200k"])
def test_a_seam_in_the_newlines_after_punctuation_is_not_spliced(tiny_model_dir: Path, tmp_path: Path,
                                                                   pattern: str) -> None:
    """Llama 3's, Qwen 2's and o200k's patterns give a run of punctuation the newlines after it (` ?[^\\s\\p{L}\\p{N}]+
    [\\r\\n]*`), where a text starting at those newlines takes them with the whitespace and newlines after them
    (`\\s*[\\r\\n]+`): a window starting there came out as cached for six "\\n\\n" tokens and differed at the run's end
    (before: "\\n\\n", "\\n", "\\n    ", "\\n" where the whole text has "\\n\\n", "    ", "\\n", same count)."""
    from tests.test_word_encoder import LLAMA3_PATTERN

    patterns = {"llama3": LLAMA3_PATTERN, "qwen2": LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"),
                "o200k": O200K_PATTERN}
    tiny = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tiny.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(patterns[pattern]), behavior="isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = ModelTokenizer(model_with(tiny_model_dir, tmp_path / "model", tiny))
    for punctuation in (":", ")", "<|im_end|>", "\n"):
        for newlines in range(1, 64):
            cache = TokenCache(1 << 20, block_size=16)
            head = "x " * 150 + punctuation + "\n" * newlines + "    \n"
            check(cache, tok, head + "alpha")
            check(cache, tok, head + "beta")


@pytest.mark.parametrize("pattern", ["llama3", "o200k"])
def test_a_seam_in_whitespace_that_runs_to_where_the_prompts_part_is_not_spliced(tiny_model_dir: Path,
                                                                                  tmp_path: Path, pattern: str) -> None:
    """Llama 3's and o200k's `\\s*[\\r\\n]+` takes a run of whitespace up to its last newline however far that is, so
    where the shared text ends in whitespace what follows may cut the whole run otherwise, tokens before the seam
    included: a newline after 150 spaces made "\\r\\n" and the spaces after it one piece ("\\n" + 36 spaces one
    token where the cached prompt had "\\n" alone), and the seam 16 bytes back in the spaces verified (before: a
    prompt extending the cached one, and one cut short of it, each came out with other ids)."""
    from tests.test_word_encoder import LLAMA3_PATTERN

    tiny = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    tiny.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex({"llama3": LLAMA3_PATTERN, "o200k": O200K_PATTERN}[pattern]), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok = ModelTokenizer(model_with(tiny_model_dir, tmp_path / "model", tiny))
    head = "x " * 150 + "-42\r\n" + " " * 120
    for space in (" ", "\t", "\x0b", "\u3000"):
        for first, second in ((head, head + space * 40 + "\r"), (head + space * 40 + "\r", head)):
            cache = TokenCache(1 << 20, block_size=16)
            check(cache, tok, first)
            check(cache, tok, second)


def test_a_tokenizer_that_prepends_to_every_text_is_not_spliced(tmp_path: Path) -> None:
    """Llama 2's tokenizer.json (and its derivatives') normalizes with `Prepend("▁")`: a window gets a "▁" that the
    text does not have there, so a window inside a run of spaces verified (its first six tokens "▁" as cached) and
    the prompt came out one token over the whole text's (before: 337 ids against 336). Its ids are spliced nowhere."""
    vocab = {"<unk>": 0, "<s>": 1, "▁": 2, ">": 3, **{c: 4 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}}
    llama2 = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    llama2.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    llama2.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    (tmp_path / "tokenizer.json").write_text(llama2.to_str())
    tok = ModelTokenizer(tmp_path)
    cache = TokenCache(1 << 20, block_size=16)
    head = "x" * 300 + ">" + " " * 30
    for special in (False, True):
        check(cache, tok, head + "alpha", special)
        check(cache, tok, head + "beta", special)
        assert check(cache, tok, head + "beta", special).reused_tokens  # the same prompt again is still reused
    assert cache.seam_mismatches == 2


@pytest.mark.parametrize("scheme", ["first", "always"])
def test_a_metaspace_tokenizer_splices_where_a_window_starts_at_a_space(tmp_path: Path, scheme: str) -> None:
    """A Metaspace pre-tokenizer (Mistral's, T5's) puts "▁" in front of a text that does not start with a space, so
    a window starting inside a word never verified: the whole prompt was encoded after the window (before: none of
    these 20 prompts spliced, 20 seam mismatches). The window's start now moves back to a space."""
    vocab = {"<unk>": 0, "▁": 1, **{c: 2 + i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz0123456789")}}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=scheme == "always")
    (tmp_path / "tokenizer.json").write_text(tokenizer.to_str())
    tok = ModelTokenizer(tmp_path)
    cache = TokenCache(1 << 20, block_size=16)
    head = words(7, 60)
    check(cache, tok, head + " question")
    for i in range(20):
        check(cache, tok, head + f" question {words(i, 3)}")
    assert cache.hits == 20 and cache.seam_mismatches == 0


def test_memory_is_bounded_in_bytes(tok: ModelTokenizer) -> None:
    """Issue 13.3: the cache was bounded in entries, so a few huge prompts held gigabytes. Now its budget is bytes:
    the prompts it keeps fit in it, one bigger than the whole budget is not kept, and what it holds in memory is
    what it counts."""
    budget = 2 << 20
    cache = TokenCache(budget, block_size=16)
    big = [words(100 + i, 60_000) for i in range(3)]  # about 450,000 characters each
    gc.collect()
    tracemalloc.start()
    try:
        for text in big:
            found = cache.encode(tok, text, add_special_tokens=False, root=ROOT)
            del found
            assert cache.bytes <= budget
        assert len(cache) == 0  # each one alone is over the budget
        held, _ = tracemalloc.get_traced_memory()
        for seed in range(200):  # many smaller prompts: the oldest go
            cache.encode(tok, words(seed, 2_000), add_special_tokens=False, root=ROOT)
            assert cache.bytes <= budget
        gc.collect()
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert 0 < len(cache) < 200
    assert after - held < budget * 1.5, (after - held, cache.bytes)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts, special=st.booleans())
def test_token_ends_from_the_byte_table_equal_the_tokenizers_offsets(tok: ModelTokenizer, text: str,
                                                                     special: bool) -> None:
    """A byte-level BPE tokenizer's token ends come from a table of each token's bytes (the tokenizer's own offsets
    cost more than the encoding); they must be its offsets, except inside a character split over tokens."""
    assert tok._byte_lengths is not None  # the tiny model's tokenizer is byte-level BPE
    ids, ends = tok.encode_with_ends(text, add_special_tokens=special)
    want_ids, want_ends = tok._encode_with_offsets(text, special)
    data = text.encode("utf-8", "surrogatepass")
    assert ids == want_ids
    assert all(a == b or data[a] & 0xC0 == 0x80 for a, b in zip(ends, want_ends, strict=True))


def test_cached_prompts_are_not_objects_the_cycle_collector_walks(tok: ModelTokenizer) -> None:
    """Every full collection walks each object the cycle collector tracks, with the GIL held: 1,783 cached prompts
    (each an object, two arrays and two lists) cost the gateway 14-16 ms of CPU per collection."""
    cache = TokenCache(1 << 26, block_size=16)
    head = words(1, 400)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(300):
        cache.encode(tok, head + words(i + 2, 20), add_special_tokens=False, root=ROOT)
    gc.collect()
    gc.collect()  # a tuple holding tuples goes untracked once they have, at the latest in the next pass
    assert len(cache) == 300
    assert len(gc.get_objects()) - before < 100


def test_storing_a_prompt_does_not_put_the_link_index_in_the_youngest_generation(tok: ModelTokenizer) -> None:
    """The index of links is never tracked by the cycle collector: with the cached prompts as its values, a collection
    untracked it once they were, and the next prompt stored tracked it again in the youngest generation, so the next
    young collection walked every link (in the gateway: 1-2 ms every few hundred requests)."""
    cache = TokenCache(1 << 26, block_size=16)
    head = words(1, 400)
    for i in range(50):
        cache.encode(tok, head + words(i + 2, 20), add_special_tokens=False, root=ROOT)
    gc.collect()
    for i in range(3):
        found = cache.encode(tok, head + words(i + 100, 20), add_special_tokens=False, root=ROOT)
        assert found.reused_tokens > 0
        assert not gc.is_tracked(cache._links)


def test_token_ends_are_summed_in_calls_the_gil_can_change_hands_between(tok: ModelTokenizer) -> None:
    """The GIL changes hands only between C calls: one sum over a 300,000-token prompt's token ends held it for
    100 ms (9,600 tokens: 5 ms), the event loop waiting."""
    text = words(3, 12_000)
    extends: list[int] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") == "extend":
            extends.append(1)

    sys.setprofile(profile)
    try:
        ids, ends = tok.encode_with_ends(text, add_special_tokens=False)
    finally:
        sys.setprofile(None)
    assert len(ids) > 3 * ENDS_STEP
    assert len(extends) >= len(ids) // ENDS_STEP
    assert list(ids) == tok.encode(text, add_special_tokens=False)
    assert len(ends) == len(ids) and ends[-1] == len(text.encode())
    assert all(a < b for a, b in pairwise(ends))


@pytest.mark.parametrize("a, b", [
    (b"", b""), (b"x", b""), (b"abc", b"abd"), (b"x" * CHUNK, b"x" * CHUNK), (b"x" * CHUNK, b"x" * (CHUNK - 1) + b"y"),
    (b"x" * (3 * CHUNK), b"x" * (3 * CHUNK) + b"tail"), (b"y" + b"x" * (5 * CHUNK), b"z" + b"x" * (5 * CHUNK)),
    (b"x" * (2 * CHUNK) + b"a" + b"x" * 999, b"x" * (2 * CHUNK) + b"b" + b"x" * 999),
    (b"x" * (7 * CHUNK - 1) + b"a" + b"x" * CHUNK, b"x" * (7 * CHUNK - 1) + b"b" + b"x" * CHUNK),
    (b"x" * (7 * CHUNK) + b"a", b"x" * (7 * CHUNK) + b"b"),
])
def test_shared_bytes_is_the_common_prefix(a: bytes, b: bytes) -> None:
    expected = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert _shared_bytes(a, b) == expected
    assert _shared_bytes(b, a) == expected


def test_shared_bytes_at_every_position() -> None:
    rng = random.Random(5)
    base = bytes(rng.randrange(256) for _ in range(6 * CHUNK + 17))
    for at in range(len(base)):
        other = base[:at] + bytes([base[at] ^ 1]) + base[at + 1:]
        assert _shared_bytes(base, other) == at
        assert _shared_bytes(base[:at + 5], other) == at


def brute_longest(cache: TokenCache, data: bytes, seed: int) -> int:
    """The longest common prefix of `data` with any cached prompt of the same seed (0 under one chunk)."""
    best = 0
    for entry in cache._entries.values():
        if entry[1] == seed:
            best = max(best, _shared_bytes(entry[0], data))
    return best if best >= CHUNK else 0


def test_lookup_hashes_only_new_chunks_and_finds_the_longest_prefix(tok: ModelTokenizer) -> None:
    """The links copied from the cached prompt over the shared text are the text's own hash chain, and following
    the links finds the cached prompt that shares the most (a prompt parting early from one, then meeting a
    longer one)."""
    cache = TokenCache(1 << 22, block_size=4)
    seed = tok.cache_seed(False)
    assert seed is not None
    head, middle = words(1, 300), words(2, 300)
    prompts = [head + words(3, 40), head + middle + words(4, 40), head + words(5, 10), head + middle + words(6, 400),
               words(7, 200), head[:700] + words(8, 100), head + middle + words(6, 400) + words(9, 5)]
    for text in [*prompts, head + middle + words(10, 3), head[:900], head[:CHUNK + 3], words(7, 150)]:
        data = text.encode()
        lookup = cache.lookup(tok, text, False)
        assert lookup.links == _links(data, seed)
        assert lookup.shared == brute_longest(cache, data, seed)
        if lookup.entry is not None:
            assert _shared_bytes(lookup.entry[0], data) == lookup.shared
        check(cache, tok, text)


def test_a_link_naming_a_prompt_that_does_not_share_its_text_is_passed_over(tok: ModelTokenizer) -> None:
    """A hash collision (two texts, one link): the text comparison catches it and the lookup keeps what it had
    verified, or nothing; the ids stay exact."""
    cache = TokenCache(1 << 22, block_size=4)
    seed = tok.cache_seed(False)
    assert seed is not None
    head = words(1, 300)
    check(cache, tok, words(2, 300))
    check(cache, tok, head + words(3, 30))
    other = next(key for key, entry in cache._entries.items() if entry[0].startswith(words(2, 300).encode()))
    text = head + words(4, 300)
    links = _links(text.encode(), seed)
    shared = cache.lookup(tok, text, False).shared
    known = shared // CHUNK
    assert known >= 2
    cache._links[links[known]] = other  # a later link collides with an unrelated prompt's: the one found stays
    lookup = cache.lookup(tok, text, False)
    assert lookup.shared == shared and lookup.links == links
    cache._links[links[0]] = other  # the first link collides: nothing found, the text is encoded whole
    lookup = cache.lookup(tok, text, False)
    assert lookup.entry is None and lookup.shared == 0 and lookup.links == links
    assert check(cache, tok, text).reused_tokens == 0


def test_stored_prompts_do_not_pile_up_in_the_young_generation() -> None:
    """Issue 18: a full cache drops an entry for each it stores, so the collector's count of new objects stays
    flat and its young collections came rarely; each entry's keys and links (about 730 ints for a 32,000-character
    prompt) are walked by the first collection that sees them, and in the gateway 1,800 entries piled up before one
    did: 59 ms of CPU in one young collection, /health waiting. The cache now starts a young collection itself every
    `YOUNG_ITEMS` ints stored, so one walks at most that many."""
    from router.token_cache import YOUNG_ITEMS, _entry

    cache = TokenCache(400 * 40_000, 16)
    threshold = gc.get_threshold()
    gc.collect()
    gc.set_threshold(2000, 10, 10)  # the gateway's young threshold
    try:
        for i in range(2400):  # the first 400 or so fill it; then each store drops one
            base = (i + 1) << 40
            cache._store(None, _entry(b"x" * 32_000, i, b"", b"", list(range(base, base + 125)), ROOT,
                                      list(range(base + 1000, base + 1608))))
        young = sum(len(o) for o in gc.get_objects(0) if isinstance(o, tuple))
        assert young <= 2 * YOUNG_ITEMS, young  # before: 171,000 (every entry in the cache, none walked yet)
        start = time.process_time()
        gc.collect(0)
        assert time.process_time() - start < 0.015  # about 0.1 ms (before: 1.3 here, 59 in the gateway's heap)
    finally:
        gc.set_threshold(*threshold)
