"""Byte-level BPE encoding of ASCII text with a per-word cache: the tokenizer's own ids at a fraction of its cost.

A byte-level BPE tokenizer (GPT-2, Llama 3, Qwen, the tiny test model) cuts text at its added tokens, splits the
rest into words with one regular expression, and encodes each word on its own, so a word's ids never depend on its
neighbours. Prompts repeat their words, and `tokenizers` spends most of a short encode in its regex engine and in
building the `Encoding` object: here the split is Python's `re` (the pattern's Unicode classes narrowed to ASCII,
which is exact on ASCII text) and a word seen before costs one dict lookup. A new word goes to the tokenizer's own
BPE model.

Only ASCII text takes this path (`encode` answers None otherwise), only without added special tokens, and only for
tokenizers whose pipeline it reproduces: no normalizer or NFC (ASCII is NFC already), a ByteLevel pre-tokenizer or
a Split + ByteLevel sequence, a deterministic BPE model, plain added tokens. `WordEncoder.build` checks its ids
against the tokenizer's on samples and gives None on any difference; tests/test_word_encoder.py checks it as a
property.

With GPT-2's own pattern (the ByteLevel pre-tokenizer's) a piece of text is cut at single spaces first: no word of
that pattern spans a space that is followed by a character other than whitespace (a word takes a space only in front),
and none is decided by what follows such a space, so the words of `a b c` are those of `a`, ` b` and ` c`, each chunk
looked up whole (`WordEncoder._chunks`): one `str.split` and one C loop of dict lookups per piece, not one regex match
and one Python step per word (Python's `re` took about 0.4 us per match). Whitespace at a piece's end is words of its
own; a piece with a space before whitespace goes word by word. In process (load 1-6, minimum of 15 alternating rounds):
a chat prompt's 270-character window 24.5 -> 19.8 us, a whole 4,000-character prompt 253 -> 151 us.
"""

from __future__ import annotations

import json
import re
from array import array
from typing import Any

from tokenizers import Tokenizer

# tokenizers' ByteLevel pre-tokenizer regex (pre_tokenizers/byte_level.rs)
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
MAX_WORDS = 1 << 16  # cached words; the cache starts over when full
MAX_WORD_CHARS = 64  # longer words (a run of spaces, base64) are encoded every time: they rarely repeat, and a
# client sending long unique words must not grow the cache to MAX_WORDS times their size
# a word longer than this is left to the tokenizer's threads (`encode` answers None): its BPE is one C call that holds
# the GIL throughout (a 100,000-letter word about 60 ms, 400,000 letters 250 ms), where the tokenizer's batch call
# releases it; 4,096 letters take about 1 ms
MAX_BPE_CHARS = 4096
_SPACE = " \\t\\n\\x0b\\x0c\\r"  # Unicode White_Space within ASCII (not \x1c-\x1f, which Python's \s includes)
# an escape in a class, and outside one, for ASCII text
_ESCAPES = {r"\p{L}": ("A-Za-z", "[A-Za-z]"), r"\p{N}": ("0-9", "[0-9]"), r"\s": (_SPACE, f"[{_SPACE}]"),
            r"\S": (None, f"[^{_SPACE}]"), r"\d": ("0-9", "[0-9]"), r"\r": ("\\r", "\\r"), r"\n": ("\\n", "\\n"),
            r"\t": ("\\t", "\\t")}
_ESCAPE = re.compile(r"\\p\{[A-Za-z]+\}|\\P\{[A-Za-z]+\}|\\.|\[|\]", re.DOTALL)
_SAMPLES = ("plain words, numbers 12345 and  spaces\n\n\tand tabs", "don't WE'LL it's I'M they've 'S",
            "def f(x):\n    return x  # a comment\r\n\r\n", "   leading and trailing   ", "a1b22c333d4444 1234567",
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<s></s><|endoftext|>x<s",
            "?!... ;;\x1c\x1f\x0b")


def ascii_pattern(pattern: str) -> str | None:
    """An Oniguruma pre-tokenizer pattern as a Python `re` pattern that splits ASCII text the same way, or None
    where it uses a class this cannot narrow."""
    out: list[str] = []
    in_class = False
    at = 0
    for match in _ESCAPE.finditer(pattern):
        out.append(pattern[at:match.start()])
        at = match.end()
        token = match.group()
        if token == "[":
            if in_class:
                return None  # nested classes: not Oniguruma's usual pre-tokenizer shapes
            in_class = True
            out.append(token)
        elif token == "]":
            in_class = False
            out.append(token)
        elif token in _ESCAPES:
            inside, outside = _ESCAPES[token]
            if not in_class:
                out.append(outside)
            elif inside is not None:
                out.append(inside)
            else:
                return None
        elif token.startswith(("\\p", "\\P")) or (token[1:].isalnum() and token[1:] not in "bBfv"):
            return None  # a class or escape whose ASCII meaning is not written down here
        else:
            out.append(token)
    out.append(pattern[at:])
    return "".join(out)


def _byte_map() -> dict[int, str]:
    """GPT-2's byte → printable character table, for ASCII (tokenizers' `bytes_char`)."""
    printable = set(range(ord("!"), ord("~") + 1))
    table: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in printable or 0xA1 <= b <= 0xAC or 0xAE <= b <= 0xFF:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return {b: table[b] for b in range(128)}


class WordEncoder:
    """`encode(text)`: the tokenizer's ids of ASCII `text` without special tokens added, or None."""

    def __init__(self, tokenizer: Tokenizer, pattern: str, added: list[tuple[str, int, bool]]) -> None:
        self._model = tokenizer.model
        self._split = re.compile(pattern)
        self._bytes = str.maketrans(_byte_map())
        # added tokens are cut out first: those matched on the raw text, then those matched after normalizing
        # (the same text here); longest first, so Python's leftmost-first alternation finds the leftmost-longest
        self._added_ids = {content: tid for content, tid, _ in added}
        self._added = [re.compile("(" + "|".join(re.escape(c) for c in sorted(group, key=len, reverse=True)) + ")")
                       for group in ([c for c, _, normalized in added if not normalized],
                                     [c for c, _, normalized in added if normalized]) if group]
        # each word's ids as uint32 bytes: a dict of strings and bytes is never tracked by the cycle collector. (With
        # tuples of ints it was: the collector untracks a dict once its tuples are, and the next new word tracked it
        # again in the youngest generation, so the next young collection walked all of its up to MAX_WORDS entries)
        self._words: dict[str, bytes] = {}
        # with GPT-2's pattern, pieces are cut at spaces first (the module's docstring): the ids of a piece's first
        # chunk (or of a text not cut so), and of each later chunk with the space in front of it, by the chunk (dicts
        # of strings and bytes too)
        self._by_spaces = pattern == _GPT2_ASCII
        self._heads: dict[str, bytes] = {}
        self._spaced: dict[str, bytes] = {}

    @classmethod
    def build(cls, tokenizer: Tokenizer) -> WordEncoder | None:
        """The encoder for `tokenizer`, if its pipeline is one this reproduces and the samples agree."""
        config: dict[str, Any] = json.loads(tokenizer.to_str())
        pattern = _pre_tokenizer_pattern(config.get("pre_tokenizer"))
        normalizer = config.get("normalizer")
        model = config.get("model") or {}
        if (pattern is None or not (normalizer is None or normalizer.get("type") == "NFC")
                or model.get("type") != "BPE" or model.get("dropout") or model.get("continuing_subword_prefix")
                or model.get("end_of_word_suffix")):
            return None
        added = []
        for token in config.get("added_tokens") or []:
            if token.get("single_word") or token.get("lstrip") or token.get("rstrip"):
                return None
            # tokenizers' AddedVocabulary splits by this flag alone, special or not
            added.append((token["content"], token["id"], bool(token.get("normalized"))))
        python = ascii_pattern(pattern)
        if python is None:
            return None
        try:
            encoder = cls(tokenizer, python, added)
        except re.error:
            return None
        if encoder._split.groups:  # findall would return the groups, not the words
            return None
        # this tokenizer's own added tokens, among words and each other, beside the fixed samples
        contents = [content for content, _, _ in added if content.isascii()][:512]
        own = (" ".join(contents), "x".join(contents) + "x", "".join(f"a{c} {c}\n" for c in contents[:64]))
        for sample in (*_SAMPLES, *own):
            ids = encoder.encode(sample)
            if ids is None or ids.tolist() != tokenizer.encode(sample, add_special_tokens=False).ids:
                return None
        encoder._words.clear()
        encoder._heads.clear()
        encoder._spaced.clear()
        return encoder

    def encode(self, text: str) -> array[int] | None:
        """`text`'s ids as uint32, or None (not ASCII, a split the pattern does not reproduce, or a new word over
        `MAX_BPE_CHARS`)."""
        if not text.isascii():
            return None
        ids = array("I")
        pieces = [text]
        for added in self._added:
            pieces = [part for piece in pieces for part in
                      ((piece,) if piece in self._added_ids else added.split(piece)) if part]
        by_spaces, heads = self._by_spaces, self._heads
        for piece in pieces:
            tid = self._added_ids.get(piece)
            if tid is not None:
                ids.append(tid)
                continue
            if by_spaces:
                # a short piece seen before whole (a chat template's text between its tokens: "assistant\n", "\n",
                # a system prompt's last words before its end token): one lookup, not a cut and a lookup per chunk
                found = heads.get(piece)
                if found is None:
                    found = self._piece_ids(piece)
                    if found is not None:
                        _remember(heads, piece, found)
            else:
                found = self._word_ids(piece)
            if found is None:
                return None
            ids.frombytes(found)
        return ids

    def _piece_ids(self, piece: str) -> bytes | None:
        """The ids (uint32 bytes) of a piece between added tokens, with GPT-2's pattern: cut at its spaces, the
        whitespace at its end words of its own (no word spans from other text into whitespace); word by word where
        a space comes before whitespace."""
        body = piece.rstrip(_WHITESPACE)
        # a space before whitespace (substring searches: a regex search cost 2.5 us per 200 characters)
        if "  " in body or " \n" in body or " \t" in body or " \r" in body or " \x0b" in body or " \x0c" in body:
            return self._word_ids(piece)
        found = self._chunks(body)
        tail = piece[len(body):]
        if found is None or not tail:
            return found
        spaces = self._heads.get(tail)  # whitespace: a newline between turns
        if spaces is None:
            spaces = self._word_ids(tail)
            if spaces is None:
                return None
            _remember(self._heads, tail, spaces)
        return found + spaces

    def _chunks(self, piece: str) -> bytes | None:
        """The ids (uint32 bytes) of a piece in which every space is followed by a character other than whitespace,
        cut at its spaces (GPT-2's pattern only: the module's docstring); b"" for an empty one."""
        chunks = piece.split(" ")
        head = chunks[0]
        first = self._heads.get(head) if head else b""
        if first is None:
            first = self._word_ids(head)
            if first is None:
                return None
            _remember(self._heads, head, first)
        spaced = self._spaced
        rest = chunks[1:]
        found = [*map(spaced.get, rest)]  # one C loop: most chunks are words seen before
        if None in found:
            for i, chunk in enumerate(rest):
                if found[i] is None:
                    ids = self._word_ids(" " + chunk)
                    if ids is None:
                        return None
                    found[i] = ids
                    _remember(spaced, chunk, ids)
        return first + b"".join(found)  # type: ignore[arg-type]  # no None left

    def _word_ids(self, piece: str) -> bytes | None:
        """The ids (uint32 bytes) of a piece without added tokens, word by word; None where the pattern does not
        cover it (Split keeps such text as a piece of its own) or a new word is over `MAX_BPE_CHARS`."""
        in_piece = self._split.findall(piece)
        if sum(map(len, in_piece)) != len(piece):
            return None
        words, translate = self._words, self._bytes
        out = []
        for word in in_piece:
            found = words.get(word)
            if found is None:
                if len(word) > MAX_BPE_CHARS:
                    return None
                tokens = self._model.tokenize(word.translate(translate))
                found = array("I", [token.id for token in tokens]).tobytes()
                _remember(words, word, found)
            out.append(found)
        return b"".join(out)


_GPT2_ASCII = ascii_pattern(GPT2_PATTERN)
_WHITESPACE = " \t\n\x0b\x0c\r"  # as _SPACE, the characters themselves


def _remember(cache: dict[str, bytes], key: str, ids: bytes) -> None:
    """Cache the ids of a word or chunk of at most MAX_WORD_CHARS characters; the cache starts over when full."""
    if len(key) <= MAX_WORD_CHARS:
        if len(cache) >= MAX_WORDS:
            cache.clear()
        cache[key] = ids


def _pre_tokenizer_pattern(pre: dict[str, Any] | None) -> str | None:
    """The one split pattern of a ByteLevel pre-tokenizer, or of Split(pattern, Isolated) + ByteLevel(no regex)."""
    if pre is None:
        return None
    if pre.get("type") == "ByteLevel":
        return GPT2_PATTERN if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("type") != "ByteLevel" or byte_level.get("use_regex", True)
            or byte_level.get("add_prefix_space")):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    return regex if isinstance(regex, str) else None
