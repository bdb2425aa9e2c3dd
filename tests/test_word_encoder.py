"""The word-cached encoder (router/word_encoder.py) gives the tokenizer's own ids on ASCII text, for the tokenizer
shapes it accepts, and refuses the shapes it cannot reproduce."""

from __future__ import annotations

import gc
import json
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, pre_tokenizers

from router.tokenizer import PARALLEL_CHARS, WORD_CACHE_MAX_CHARS, ModelTokenizer
from router.word_encoder import MAX_BPE_CHARS, MAX_WORD_CHARS, WordEncoder, ascii_pattern

# Llama 3's split pattern (Qwen 2's differs only in \p{N} vs \p{N}{1,3})
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
FRAGMENTS = ["<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|endoftext|>", " ", "  ", "\n", "\n\n", "\r\n", "\t",
             "'s", "'S", " don't", "I'LL", "1234567", "<|im", "start|>", "def f(x):\n    return x\n", "x" * 40,
             " " * 40, "\x1c\x1f", "\x0b\x0c"]
ascii_texts = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(string.printable + "\x00\x1c\x7f", max_size=12)),
                       max_size=40).map("".join)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def model_tok(tiny_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def split_style(tiny: Tokenizer) -> Tokenizer:
    """The tiny model's vocabulary behind a Llama 3 style pre-tokenizer: Split(pattern) + ByteLevel(no regex)."""
    tok = Tokenizer.from_str(tiny.to_str())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    return tok


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=ascii_texts)
def test_ids_equal_the_tokenizers_on_ascii_text(tiny: Tokenizer, split_style: Tokenizer, text: str) -> None:
    for tok in (tiny, split_style):
        encoder = WordEncoder.build(tok)
        assert encoder is not None
        for _ in range(2):  # the second time from the word cache
            ids = encoder.encode(text)
            assert ids is not None and ids.tolist() == tok.encode(text, add_special_tokens=False).ids


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.one_of(ascii_texts, st.text(max_size=40)), special=st.booleans())
def test_model_tokenizer_ids_and_ends_unchanged(model_tok: ModelTokenizer, text: str, special: bool) -> None:
    """`encode_with_ends` (what the token cache calls) takes the word cache and still gives `encode`'s ids."""
    tok = model_tok
    assert tok._words is not None
    ids, ends = tok.encode_with_ends(text, add_special_tokens=special)
    assert list(ids) == tok.encode(text, add_special_tokens=special)
    assert (ends[-1] if ends else 0) == len(text.encode("utf-8", "surrogatepass"))



@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(ascii_texts, min_size=1, max_size=8), special=st.booleans())
def test_long_ascii_text_takes_the_word_cache(model_tok: ModelTokenizer, parts: list[str], special: bool) -> None:
    """A prompt longer than `PARALLEL_CHARS` goes through the word cache too (a document of words seen before costs
    a fifth of the tokenizer's time), with the tokenizer's ids; it went to the tokenizer's threads whole. One longer
    than `WORD_CACHE_MAX_CHARS` still does."""
    tok = model_tok
    words = tok._words
    assert words is not None
    lines: list[str] = []
    while sum(map(len, lines)) <= PARALLEL_CHARS:
        lines.append(f"{parts[len(lines) % len(parts)]} document{len(lines) % 97} words.\n")
    text = "".join(lines)
    for cache in (words._words, words._heads, words._spaced):
        cache.clear()
    ids, _ = tok.encode_with_some_ends(text, add_special_tokens=special)
    assert list(ids) == tok.encode(text, add_special_tokens=special)
    assert len(words._words) + len(words._heads) + len(words._spaced) > 50
    # ... up to WORD_CACHE_MAX_CHARS: the cache's regular expressions each run over the whole text holding the GIL
    for cache in (words._words, words._heads, words._spaced):
        cache.clear()
    longer = text * (WORD_CACHE_MAX_CHARS // len(text) + 1)
    ids, _ = tok.encode_with_some_ends(longer, add_special_tokens=special)
    assert list(ids) == tok.encode(longer, add_special_tokens=special)
    assert not (words._words or words._heads or words._spaced)

# words and the like, each followed by a single space mostly, sometimes none, two, or a space before a newline
spaced_texts = st.lists(st.tuples(
    st.one_of(st.sampled_from(["word", "x" * 70, "5:", "'s", "don't", "\n", "\t", "\r\n", "?!", "<|im_end|>", "\x1c",
                               "\x0b", "a1"]), st.text("ab1.'\n\t", max_size=6)),
    st.sampled_from([" ", " ", " ", "", "  ", " \n"])), max_size=30).map(lambda parts: "".join(w + s for w, s in parts))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=spaced_texts)
def test_text_cut_at_spaces_first_gives_the_tokenizers_ids(tiny: Tokenizer, text: str) -> None:
    """With GPT-2's pattern a piece is cut at its spaces and each chunk looked up whole; spaces that GPT-2 joins
    to what comes before (before whitespace, at a piece's end) leave the piece to the word-by-word path."""
    encoder = WordEncoder.build(tiny)
    assert encoder is not None and encoder._by_spaces
    for _ in range(2):  # the second time from the chunk caches
        ids = encoder.encode(text)
        assert ids is not None and ids.tolist() == tiny.encode(text, add_special_tokens=False).ids


def test_chunks_are_cached_with_gpt2s_pattern_only(tiny: Tokenizer, split_style: Tokenizer) -> None:
    """The chunk caches fill for GPT-2's pattern; another pattern (Llama 3's joins punctuation to the letters after
    it, across no space but also not at one) keeps to words."""
    text = "Question 12: the router's cache keeps\nprompts, warm. "
    gpt2, llama = WordEncoder.build(tiny), WordEncoder.build(split_style)
    assert gpt2 is not None and llama is not None and not llama._by_spaces
    for encoder, tok in ((gpt2, tiny), (llama, split_style)):
        ids = encoder.encode(text)
        assert ids is not None and ids.tolist() == tok.encode(text, add_special_tokens=False).ids
    assert {"12:", "the", "router's"} <= gpt2._spaced.keys() and "Question" in gpt2._heads
    assert not llama._spaced and not llama._heads


def test_a_short_piece_between_added_tokens_is_looked_up_whole(
    tiny: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat template's text between its tokens ("assistant\\n", a system prompt's last words before its end token)
    comes from the cache in one lookup the second time: the piece is not cut at its spaces again."""
    encoder = WordEncoder.build(tiny)
    assert encoder is not None and encoder._by_spaces
    text = "<|im_start|>assistant\n<|im_end|>\n<|im_start|>user\nthe last words  of it\n<|im_end|>"
    first = encoder.encode(text)
    monkeypatch.setattr(encoder, "_chunks", lambda piece: pytest.fail(f"{piece!r} cut again"))
    monkeypatch.setattr(encoder, "_word_ids", lambda piece: pytest.fail(f"{piece!r} split again"))
    again = encoder.encode(text)
    assert first is not None and again == first
    assert first.tolist() == tiny.encode(text, add_special_tokens=False).ids


def test_non_ascii_text_is_left_to_the_tokenizer(tiny: Tokenizer) -> None:
    encoder = WordEncoder.build(tiny)
    assert encoder is not None
    assert encoder.encode("café") is None


def test_patterns_it_cannot_narrow_are_refused() -> None:
    assert ascii_pattern(r"\p{Lu}+|\s+") is None
    assert ascii_pattern(r"[^\S]") is None
    assert ascii_pattern(r"\w+") is None
    assert ascii_pattern(r" ?\p{L}+|[^\s\p{L}]") == r" ?[A-Za-z]+|[^ \t\n\x0b\x0c\rA-Za-z]"


@pytest.mark.parametrize("normalized", [0, 1, 2])
def test_added_tokens_split_as_the_tokenizer_splits_them(tiny: Tokenizer, normalized: int) -> None:
    """Special tokens marked `normalized`, and plain added tokens overlapping them, are cut where tokenizers cuts."""
    config = json.loads(tiny.to_str())
    config["added_tokens"][normalized]["normalized"] = True
    config["added_tokens"].append({"id": 4000, "content": "d<|im", "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": True, "special": False})
    tok = Tokenizer.from_str(json.dumps(config))
    encoder = WordEncoder.build(tok)
    assert encoder is not None
    for text in ("end<|im_start|>x", "d<|im_end|> <|endoftext|>d<|im", "<|im_start|>d<|im_start|>", "d<|imd<|im"):
        ids = encoder.encode(text)
        assert ids is not None and ids.tolist() == tok.encode(text, add_special_tokens=False).ids, text


@pytest.mark.parametrize("change", ["prefix_space", "lstrip", "dropout", "normalizer"])
def test_pipelines_it_does_not_reproduce_are_refused(tiny: Tokenizer, change: str) -> None:
    config = json.loads(tiny.to_str())
    if change == "prefix_space":
        config["pre_tokenizer"]["add_prefix_space"] = True
    elif change == "lstrip":
        config["added_tokens"][1]["lstrip"] = True
    elif change == "dropout":
        config["model"]["dropout"] = 0.1
    else:
        config["normalizer"] = {"type": "Lowercase"}
    assert WordEncoder.build(Tokenizer.from_str(json.dumps(config))) is None


def test_long_words_are_not_cached(tiny: Tokenizer) -> None:
    """Each cached word is at most MAX_WORD_CHARS characters: unique long words cannot fill memory."""
    encoder = WordEncoder.build(tiny)
    assert encoder is not None
    text = " ".join("x" * 500 + str(i) for i in range(20)) + " short words here"
    ids = encoder.encode(text)
    assert ids is not None and ids.tolist() == tiny.encode(text, add_special_tokens=False).ids
    assert encoder._words and max(map(len, encoder._words)) <= MAX_WORD_CHARS
    assert encoder._spaced and max(map(len, [*encoder._spaced, *encoder._heads])) <= MAX_WORD_CHARS



def test_a_word_too_long_for_one_bpe_call_is_left_to_the_tokenizer(tiny: Tokenizer) -> None:
    """A new word over `MAX_BPE_CHARS` letters would be one BPE call holding the GIL (the tokenizer's batch call
    releases it): the encoder answers None and the caller goes there."""
    encoder = WordEncoder.build(tiny)
    assert encoder is not None
    longest = "ab" * (MAX_BPE_CHARS // 2 - 1)  # with the space before it, a word of MAX_BPE_CHARS - 1
    ids = encoder.encode(f"a {longest} b")
    assert ids is not None and ids.tolist() == tiny.encode(f"a {longest} b", add_special_tokens=False).ids
    assert encoder.encode(f"a {longest}xyz b") is None

def test_cached_words_are_not_objects_the_cycle_collector_walks(tiny: Tokenizer) -> None:
    """Up to MAX_WORDS cached words: each a list was one more object every full collection walks with the GIL held."""
    encoder = WordEncoder.build(tiny)
    assert encoder is not None
    gc.collect()
    before = len(gc.get_objects())
    text = " ".join(f"w{i}x{i * 7919 % 10007}" for i in range(5000))
    ids = encoder.encode(text)
    assert ids is not None and ids.tolist() == tiny.encode(text, add_special_tokens=False).ids
    gc.collect()
    assert len(gc.get_objects()) - before < 100


def test_new_words_do_not_put_the_word_cache_in_the_youngest_generation(tiny: Tokenizer) -> None:
    """The cache's dict itself is never tracked: a dict the collector had untracked was tracked again by the next
    new word, in the youngest generation, and the next young collection then walked every cached word (in the
    gateway: young collections of 1-2 ms every few hundred requests, each new number in a prompt a new word)."""
    encoder = WordEncoder.build(tiny)
    assert encoder is not None
    encoder.encode(" ".join(f"w{i}" for i in range(1000)))
    gc.collect()
    for i in range(3):
        encoder.encode(f"a new number {10**6 + i}")
        assert not any(map(gc.is_tracked, (encoder._words, encoder._heads, encoder._spaced)))
