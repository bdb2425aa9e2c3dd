"""A model's tokenizer and chat template, loaded offline from a model directory, giving vLLM's prompt token ids.

`ModelTokenizer.prompt_ids(body, chat=...)` turns an OpenAI request body into the token ids vLLM (0.32, HF
renderer) would feed its engine for the same request:

- completions: a text prompt is encoded with `add_special_tokens` (default true), a token-id prompt is taken as is;
- chat: messages are normalised as vLLM's `parse_chat_messages` does (text parts joined with "\\n" for
  "string"-format templates, tool-call arguments parsed to dicts, developer → system when the template has no
  developer role), the template is rendered like transformers' `apply_chat_template` (sandboxed jinja2 with
  trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, a non-escaping `tojson`, the named special tokens,
  `messages`, `tools`, `documents`, `add_generation_prompt`, and the accepted `chat_template_kwargs`), then the text
  is encoded with `add_special_tokens` (default false for chat). The chat part is `ChatRenderer`, which holds no
  tokenizer, so a client's own template can be rendered in a sandbox process (router/template_sandbox.py). A
  conversation of a shape rendered before (the same roles, settings and empty texts) is that shape's skeleton with
  its texts put in, for templates that provably render it so ("skeleton renders" below).

Encoding runs in Rust without the GIL (`encode_batch_fast`), so the methods may be called from a thread pool
and run in parallel with the event loop; the template environment is immutable once built.
"""

from __future__ import annotations

import json
import re
import secrets
import unicodedata
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from itertools import accumulate, islice
from operator import itemgetter
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.filters
import jinja2.meta
import jinja2.nodes
import xxhash
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, normalizers

from router.word_encoder import WordEncoder

PARALLEL_CHARS = 8192  # texts longer than this that the word cache cannot encode go to the tokenizer's own threads
# ... and every text longer than this: the word cache's regular expressions each run over the whole text in one call
# holding the GIL (about 4 ms per 64 KiB here, 60 ms for a MiB), where the tokenizer's batch call releases it
WORD_CACHE_MAX_CHARS = 64 * 1024
# token ends summed per C call: the GIL can change hands only between calls, and one call over a 300,000-token prompt
# held it for 100 ms (9,600 tokens: 5 ms), the event loop waiting meanwhile
ENDS_STEP = 4096
# transformers' named special tokens, offered to every chat template (v5: `special_tokens_map`)
SPECIAL_TOKEN_ATTRIBUTES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                            "mask_token")
# `apply_chat_template`'s own parameters: consumed by it, never passed on as template variables
_APPLY_PARAMS = frozenset({
    "conversation", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})
_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                   "thinking": "thinking"}
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_CLAUDE_CODE_BILLING_HEADER = "x-anthropic-billing-header"

Message = dict[str, Any]


class TokenizationError(ValueError):
    """The request cannot be tokenized (bad messages, template error, unsupported content); answer 400."""


class LongTextEncoder(Protocol):
    """Where a `ModelTokenizer` sends texts of `min_chars` or more: `_encode_ids` of the same tokenizer, computed
    elsewhere (router/tokenizer_processes.py)."""

    min_chars: int

    def encode(self, directory: str, text: str, add_special_tokens: bool) -> array[int]: ...


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}…{% endgeneration %}` (assistant-mask markers) and renders the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers overrides jinja's tojson, which would HTML-escape
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_DICT_ATTRIBUTES = frozenset(dir(dict))  # what `getattr` finds on a plain dict: its type's attributes, nothing else
_ABSENT = object()


class _ChatEnvironment(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with `message.field` on a plain dict looked up without raising: the sandbox's
    `getattr` tries the attribute first, and for a dict key (`message.tool_calls`, `tool_call.function`) that is
    an AttributeError, then a KeyError when the key is absent, per message and render. The answer is the same:
    a dict's attributes are its type's (it has no instance `__dict__` and no `__getattr__`), so for any other name
    `getattr` raises and the item (or undefined) is what the sandbox returns."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRIBUTES:
            value = obj.get(attribute, _ABSENT)
            return self.undefined(obj=obj, name=attribute) if value is _ABSENT else value
        return super().getattr(obj, attribute)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = _ChatEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


# ---- skeleton renders: a conversation's shape rendered once, its messages' texts put in by position ---------------
#
# Most chats repeat a shape (the roles, the same settings) with new texts, and most templates only copy a message's
# text into the output. For such a template the render of a conversation is the render of its shape with each text
# in its place: the shape is rendered once with stand-ins for the texts (`_Text`), which let the template output
# them and join them to strings with `+`, give the truthiness recorded in the shape's key, and pass the type tests as
# a string would, but raise `_Unsafe` on anything else (a comparison, `in`, a filter, a method, `str()`, `len()`,
# hashing, iteration): any look into a text that could change what is rendered. One look is allowed because it can
# be replayed: `trim` (Llama 3's `message['content'] | trim`) and `.strip()`, `.lstrip()`, `.rstrip()` give a
# stand-in for the text so transformed (`_Derivations`), which the fill computes from the real text with the same
# str method; it may be output and joined, but not tested for emptiness (that is not in the shape's key). The
# output holds a marker per text; cut at the markers it is the pieces that surround the texts. Statements that
# capture output as a string and can then transform it (block `set`, `filter` blocks, macros, `call` blocks but
# `generation`, recursive loops, blocks, includes, autoescape changes) and non-deterministic globals and filters
# (`strftime_now`, `lipsum`, `random`) keep a template off this path; so does a render that raised. The first render
# of each shape is checked against the full render of the same request as well.

class _Unsafe(Exception):
    """A skeleton render looked into a message's text (deliberately not a TypeError, AttributeError, LookupError or
    ValueError: jinja's filters and tests turn some of those into a quiet default)."""


def _refuse(*_: Any) -> Any:
    raise _Unsafe


class _Text:
    """A message's text in a skeleton render, or one derived from it by `trim` / `strip`: its slot and whether it
    is empty (None for a derived text), nothing else. Its attributes are private (the sandbox answers undefined for
    them, as for a string's) but for the strip methods; any other name is looked up as an item, which raises."""

    __slots__ = ("_derivations", "_slot", "_truthy")

    def __init__(self, slot: int, truthy: bool | None, derivations: _Derivations) -> None:
        self._slot = slot
        self._truthy = truthy
        self._derivations = derivations

    def __add__(self, other: object) -> _Joined:
        if type(other) is str or type(other) is _Text or type(other) is _Joined:
            return _Joined((self, other))
        raise _Unsafe

    def __radd__(self, other: object) -> _Joined:
        if type(other) is str or type(other) is _Joined:
            return _Joined((other, self))
        raise _Unsafe

    def __bool__(self) -> bool:
        if self._truthy is None:
            raise _Unsafe
        return self._truthy

    def strip(self, chars: object = None, /) -> _Text:
        return self._derivations.derive(self, str.strip, chars)

    def lstrip(self, chars: object = None, /) -> _Text:
        return self._derivations.derive(self, str.lstrip, chars)

    def rstrip(self, chars: object = None, /) -> _Text:
        return self._derivations.derive(self, str.rstrip, chars)

    __str__ = __repr__ = __format__ = __hash__ = __len__ = __iter__ = __reversed__ = __contains__ = _refuse
    __getitem__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __int__ = __float__ = __index__ = _refuse
    __mul__ = __rmul__ = __mod__ = __rmod__ = __abs__ = __neg__ = __round__ = _refuse


_Strip = Callable[[str, str | None], str]  # str.strip, str.lstrip or str.rstrip


class _Derivations:
    """The texts a skeleton render derived from the messages' (by `trim` / `strip`): slot `texts + k` is `steps[k]`,
    a str method applied to the text in an earlier slot with the template's `chars`, as jinja's `do_trim` (3.1:
    `soft_str(value).strip(chars)`; a message's text is a str) and str's own methods do it."""

    __slots__ = ("_slots", "steps", "texts")

    def __init__(self, texts: int) -> None:
        self.texts = texts
        self.steps: list[tuple[int, _Strip, str | None]] = []
        self._slots: dict[tuple[int, _Strip, str | None], int] = {}  # a step taken again (in a loop) is not redone

    def derive(self, text: _Text, method: _Strip, chars: object) -> _Text:
        if chars is not None and type(chars) is not str:  # a stand-in, or what str's method would refuse
            raise _Unsafe
        step = (text._slot, method, chars)
        slot = self._slots.get(step)
        if slot is None:
            slot = self._slots[step] = self.texts + len(self.steps)
            self.steps.append(step)
        return _Text(slot, None, self)


def _skeleton_trim(value: Any, chars: Any = None) -> Any:
    if type(value) is _Text:
        return value._derivations.derive(value, str.strip, chars)
    return jinja2.filters.do_trim(value, chars)  # a joined text raises here, on `str()`


class _Joined:
    """Strings and `_Text`s joined with `+`: the same rules as `_Text`, but no truthiness."""

    __slots__ = ("_parts",)

    def __init__(self, parts: tuple[object, ...]) -> None:
        self._parts = parts

    def __add__(self, other: object) -> _Joined:
        if type(other) is str or type(other) is _Text or type(other) is _Joined:
            return _Joined((self, other))
        raise _Unsafe

    def __radd__(self, other: object) -> _Joined:
        if type(other) is str:
            return _Joined((other, self))
        raise _Unsafe

    __str__ = __repr__ = __format__ = __hash__ = __len__ = __iter__ = __reversed__ = __contains__ = _refuse
    __getitem__ = __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __int__ = __float__ = __index__ = _refuse
    __mul__ = __rmul__ = __mod__ = __rmod__ = __abs__ = __neg__ = __round__ = __bool__ = _refuse


# a text's marker in a skeleton: a NUL, this process's nonce (which no template or special token holds), the slot
_NONCE = secrets.token_hex(8)
_MARKER = re.compile(f"\x00{_NONCE}([0-9]+)\x00")


def _marked(value: Any) -> Any:
    """The output of `{{ value }}` in a skeleton render (jinja's `finalize`): a text's marker, or the value as is."""
    if type(value) is _Text:
        return f"\x00{_NONCE}{value._slot}\x00"
    if type(value) is _Joined:
        return "".join(map(_marked, value._parts))
    return value


def _is_string(value: Any) -> bool:
    return type(value) is _Text or type(value) is _Joined or isinstance(value, str)


def _is_sequence(value: Any) -> bool:
    if type(value) is _Text or type(value) is _Joined:
        return True
    tests: Any = jinja2.tests
    return bool(tests.test_sequence(value))


def _is_same(value: Any, other: Any) -> bool:
    if type(value) in (_Text, _Joined) or type(other) in (_Text, _Joined):
        raise _Unsafe
    return value is other


def _skeleton_tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
                     separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys,
                      default=_refuse)


def _make_skeleton_environment() -> ImmutableSandboxedEnvironment:
    env = _ChatEnvironment(trim_blocks=True, lstrip_blocks=True, finalize=_marked,
                           extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _skeleton_tojson
    env.filters["trim"] = _skeleton_trim
    env.globals["raise_exception"] = _raise_exception
    env.tests.update(string=_is_string, sequence=_is_sequence, sameas=_is_same)
    return env


_SKELETON_ENV = _make_skeleton_environment()
# statements whose output is captured as a string the template may then transform (or that change escaping)
_CAPTURING = (jinja2.nodes.AssignBlock, jinja2.nodes.FilterBlock, jinja2.nodes.Macro, jinja2.nodes.Block,
              jinja2.nodes.Extends, jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport,
              jinja2.nodes.EvalContextModifier)
_VARYING_NAMES = frozenset({"strftime_now", "lipsum", "self", "caller", "varargs", "kwargs"})
_VARYING_FILTERS = frozenset({"random"})


@lru_cache(maxsize=32)
def _compile_skeleton(template: str) -> jinja2.Template | None:
    """The template compiled for skeleton renders, or None when it may not take them."""
    try:
        ast = _SKELETON_ENV.parse(template)
    except jinja2.TemplateError:
        return None
    for node in ast.find_all(jinja2.nodes.Node):
        if (isinstance(node, _CAPTURING)
                or (isinstance(node, jinja2.nodes.For) and node.recursive)
                or (isinstance(node, jinja2.nodes.CallBlock) and not (
                    isinstance(node.call, jinja2.nodes.Call) and isinstance(node.call.node,
                                                                            jinja2.nodes.ExtensionAttribute)
                    and node.call.node.identifier == _GenerationTag.identifier and node.call.node.name == "_render"))
                or (isinstance(node, jinja2.nodes.Name) and node.name in _VARYING_NAMES)
                or (isinstance(node, jinja2.nodes.Filter | jinja2.nodes.Test) and node.name in _VARYING_FILTERS)):
            return None
    compiled = _SKELETON_ENV.from_string(template)
    compiled.globals = dict(compiled.globals)
    return compiled


class _Skeleton:
    """A shape's render cut at its texts: `pieces[0] + text[slots[0]] + pieces[1] + ...`, where the slots past the
    messages' texts are those derived from them (`steps`, computed first)."""

    __slots__ = ("pieces", "slots", "steps")

    def __init__(self, rendered: str, steps: Sequence[tuple[int, _Strip, str | None]] = ()) -> None:
        cut = _MARKER.split(rendered)
        self.pieces: tuple[str, ...] = tuple(cut[0::2])
        self.slots: tuple[int, ...] = tuple(map(int, cut[1::2]))
        self.steps = tuple(steps)

    def fill(self, texts: Sequence[str]) -> str:
        if self.steps:
            texts = list(texts)
            for slot, method, chars in self.steps:
                texts.append(method(texts[slot], chars))
        pieces = self.pieces
        out = [pieces[0]]
        for at, slot in enumerate(self.slots, 1):
            out.append(texts[slot])
            out.append(pieces[at])
        return "".join(out)


_UNCHECKED = object()  # a shape's skeleton not yet compared with a full render
# shapes remembered per renderer (the cache starts over when full), and what a remembered shape may hold: a client
# choosing roles and message counts must not make the cache hold megabytes per shape
MAX_SKELETONS = 1024
MAX_SKELETON_MESSAGES = 128
MAX_SKELETON_ROLE_CHARS = 32


@lru_cache(maxsize=32)
def _compile(template: str) -> tuple[jinja2.Template, frozenset[str], str]:
    """The compiled template, its undeclared variables and its content format ("string" or "openai")."""
    try:
        ast = _ENV.parse(template)
        compiled = _ENV.from_string(template)
    except jinja2.TemplateError as e:
        raise TokenizationError(f"invalid chat template: {e}") from e
    # jinja keeps a template's globals as a ChainMap over the environment's and copies them into every render's
    # context, each key looked up through the chain in Python: flattened once (the environment's globals are fixed
    # when it is made), a chat render costs about 40% less (41 -> 25 us in process, load 7)
    compiled.globals = dict(compiled.globals)
    variables = frozenset(jinja2.meta.find_undeclared_variables(ast))
    return compiled, variables, ("openai" if _iterates_content(ast) else "string")


def _is_content_access(node: jinja2.nodes.Node) -> bool:
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Name) and node.name == "content"


def _iterates_content(ast: jinja2.nodes.Template) -> bool:
    """vLLM's content-format detection, simplified: a loop over a message's `content` means "openai" parts."""
    return any(_is_content_access(loop.iter) for loop in ast.find_all(jinja2.nodes.For))


def _special_token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _merge(defaults: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """vLLM's `merge_kwargs`: overrides win, except where they are None or "auto"."""
    out = dict(defaults or {})
    out.update({k: v for k, v in (overrides or {}).items() if v is not None and v != "auto"})
    return out


class ChatRenderer:
    """A model's chat templates and vLLM's way of applying them: a chat request → its prompt text. It holds no
    tokenizer, so it can run in a process of its own where a client's own template is rendered
    (router/template_sandbox.py): `state()` is all it is made of, as JSON-ready data."""

    def __init__(self, special_tokens: Mapping[str, str], templates: Mapping[str, str], *,
                 server_template: str | None = None, default_kwargs: Mapping[str, Any] | None = None,
                 source: str = "") -> None:
        self.special_tokens = dict(special_tokens)
        self._templates = dict(templates)
        self._server_template = server_template
        self._default_kwargs = dict(default_kwargs or {})
        self._source = source  # where the templates came from, for errors
        # skeleton renders (see `_Skeleton`) by shape: a `_Skeleton`, or None where the full render is used
        self._skeletons: dict[tuple[object, ...], _Skeleton | None] = {}
        # shapes whose skeleton render looked into a text: refused per shape, not per template, so one request of
        # an odd shape (Llama 3.1's `content is iterable` for a bare tool message) leaves the others their skeletons
        self.looked_into = 0

    def state(self, *, templates: bool = True) -> dict[str, Any]:
        return {"special_tokens": self.special_tokens, "templates": self._templates if templates else {},
                "server_template": self._server_template, "default_kwargs": self._default_kwargs,
                "source": self._source}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> ChatRenderer:
        return cls(state["special_tokens"], state["templates"], server_template=state["server_template"],
                   default_kwargs=state["default_kwargs"], source=state["source"])

    def owns(self, request_template: object) -> bool:
        """Whether a request's `chat_template` is none, or names one of the model's own templates: anything else
        is template code written by the client."""
        return request_template is None or (isinstance(request_template, str) and request_template in self._templates)

    def chat_template(self, tools: object = None, request_template: str | None = None) -> str:
        """The template vLLM would use: the request's, else the server's, else the tokenizer's (the
        `tool_use` one when tools are given and it exists)."""
        if request_template is not None:
            return self._templates.get(request_template, request_template)
        if self._server_template is not None:
            return self._server_template
        if tools and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if len(self._templates) == 1:
            return next(iter(self._templates.values()))
        raise TokenizationError(f"the tokenizer in {self._source} has no chat template")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        max_chars: int | None = None,
    ) -> str:
        """Render a conversation to the prompt text, as vLLM's chat endpoint does; a render that grows past
        `max_chars` is stopped with a TokenizationError."""
        if continue_final_message and add_generation_prompt:
            raise TokenizationError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        kwargs: dict[str, Any]
        if not chat_template_kwargs and not self._default_kwargs and tools is None and documents is None:
            # the common request: what the merges below come to, without building five dicts
            kwargs = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        else:
            user_kwargs = dict(chat_template_kwargs or {})
            if bad := {"chat_template", "tokenize"} & user_kwargs.keys():
                raise TokenizationError(f"Found unexpected chat template kwargs from request: {bad}")
            kwargs = _merge(_merge(self._default_kwargs, {"tools": tools}),
                            _merge(user_kwargs, {"add_generation_prompt": add_generation_prompt,
                                                 "continue_final_message": continue_final_message,
                                                 "documents": documents}))
        template = self.chat_template(kwargs.get("tools"), chat_template)
        compiled, variables, content_format = _compile(template)
        conversation = self._conversation(messages, content_format, template)
        if not conversation:
            raise TokenizationError("Cannot apply chat template to an empty conversation.")
        extra = {k: v for k, v in kwargs.items() if k in variables and k not in _APPLY_PARAMS}
        cont = bool(kwargs.get("continue_final_message"))
        final_text = ""
        if cont:
            last = conversation[-1]
            if "content" not in template:
                raise TokenizationError('continue_final_message is set but "content" is not in the template')
            if not isinstance(last.get("content"), str):
                raise TokenizationError("continue_final_message needs a final message with text content")
            final_text = last["content"]
            conversation[-1] = {**last, "content": final_text + _CONTINUE_TAG}
        add_generation_prompt = bool(kwargs.get("add_generation_prompt", False))
        shape = (self._shape(template, conversation, add_generation_prompt)
                 if max_chars is None and not extra and kwargs.get("tools") is None
                 and kwargs.get("documents") is None else None)
        skeleton = _UNCHECKED if shape is None else self._skeletons.get(shape[0], _UNCHECKED)
        if type(skeleton) is _Skeleton:
            rendered = skeleton.fill(shape[1])  # type: ignore[index]
        else:
            variables_in = {
                **self.special_tokens, **extra, "messages": conversation,
                "tools": list(kwargs["tools"]) if kwargs.get("tools") is not None else None,
                "documents": kwargs.get("documents"), "add_generation_prompt": add_generation_prompt,
            }
            try:
                rendered = (compiled.render(**variables_in) if max_chars is None
                            else _render_bounded(compiled, variables_in, max_chars))
            # ArithmeticError: a template's sums on a client's values (`x / n` with n = 0, `range(10**30)`)
            except (jinja2.TemplateError, TypeError, ValueError, ArithmeticError) as e:
                raise TokenizationError(f"chat template rejected the request: {e}") from e
            if shape is not None and skeleton is _UNCHECKED:
                self._learn(shape[0], template, conversation, add_generation_prompt, shape[1], rendered)
        if cont:
            tag = _CONTINUE_TAG.strip()
            if final_text.strip() not in rendered or tag not in rendered:
                raise TokenizationError("continue_final_message is set but the final message does not appear "
                                        "in the chat after applying the chat template")
            at = rendered.rindex(tag)
            rendered = (rendered[:at] if rendered[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG
                        else rendered[:at].rstrip())
        return rendered

    def _shape(self, template: str, conversation: Sequence[Message],
               add_generation_prompt: bool) -> tuple[tuple[object, ...], list[str]] | None:
        """A conversation's shape (what a skeleton render depends on: the template, the roles, which texts are
        empty, `add_generation_prompt`) and its texts; None when it has anything else (other fields, parts)."""
        if len(conversation) > MAX_SKELETON_MESSAGES:
            return None
        shape: list[object] = [template, add_generation_prompt]
        texts: list[str] = []
        for message in conversation:
            content, role = message.get("content"), message.get("role")
            if (len(message) != 2 or type(content) is not str or type(role) is not str
                    or len(role) > MAX_SKELETON_ROLE_CHARS):
                return None
            shape.append(message["role"])
            shape.append(not content)
            texts.append(content)
        return tuple(shape), texts

    def _learn(self, shape: tuple[object, ...], template: str, conversation: Sequence[Message],
               add_generation_prompt: bool, texts: Sequence[str], rendered: str) -> None:
        """Render `shape`'s skeleton and keep it if filling it with `texts` gives `rendered` (the full render of the
        same request); else remember the shape as not taking skeleton renders."""
        skeleton: _Skeleton | None = None
        compiled = _compile_skeleton(template)
        if compiled is not None:
            derivations = _Derivations(len(conversation))
            stand_ins = [{"role": m["role"], "content": _Text(i, bool(m["content"]), derivations)}
                         for i, m in enumerate(conversation)]
            try:
                found = _Skeleton(compiled.render(**self.special_tokens, messages=stand_ins, tools=None,
                                                  documents=None, add_generation_prompt=add_generation_prompt),
                                  derivations.steps)
            except _Unsafe:
                self.looked_into += 1
            except Exception:  # whatever the template raised: the full render decides
                pass
            else:
                skeleton = found if found.fill(texts) == rendered else None
        if len(self._skeletons) >= MAX_SKELETONS:
            self._skeletons.clear()
        self._skeletons[shape] = skeleton

    def prompt_text(self, body: Mapping[str, Any], *, max_chars: int | None = None) -> str:
        """The prompt text vLLM renders for an OpenAI `/v1/chat/completions` body (also a chat `/tokenize` body).
        Raises TokenizationError on bad input."""
        try:
            return self._prompt_text(body, max_chars)
        except (TypeError, AttributeError, KeyError, IndexError, RecursionError) as exc:
            # a field of a shape vLLM's own validation would refuse (`tool_calls: true`, ...): not renderable
            raise TokenizationError(f"the request cannot be rendered: {type(exc).__name__}: {exc}") from exc

    def _prompt_text(self, body: Mapping[str, Any], max_chars: int | None) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise TokenizationError("`messages` must be a list of objects")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise TokenizationError("`tools` must be a list")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise TokenizationError("`chat_template_kwargs` must be an object")
        user_kwargs = dict(kwargs or {})
        effort = body.get("reasoning_effort")
        if effort is not None:
            user_kwargs["reasoning_effort"] = effort
            user_kwargs.setdefault("enable_thinking", effort != "none")
        template = body.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizationError("`chat_template` must be a string")
        return self.render_chat(
            messages,
            tools=None if tools is None else [_tool_dict(t) for t in tools],
            documents=body.get("documents"),
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            continue_final_message=bool(body.get("continue_final_message", False)),
            chat_template=template,
            chat_template_kwargs=user_kwargs,
            max_chars=max_chars,
        )

    # ---- vLLM's message normalisation (parse_chat_messages) ---------------------------------------------

    def _conversation(self, messages: Sequence[Mapping[str, Any]], content_format: str,
                      template: str) -> list[Message]:
        conversation = [_parse_message(m, content_format) for m in messages]
        for message in conversation:
            _parse_tool_call_arguments(message)
        if any(m["role"] == "developer" for m in conversation) and not (
                '"developer"' in template or "'developer'" in template):
            conversation = _consolidate_system(
                [{**{k: v for k, v in m.items() if k != "tools"}, "role": "system"} if m["role"] == "developer"
                 else m for m in conversation])
        return conversation


def _render_bounded(compiled: jinja2.Template, variables: Mapping[str, Any], max_chars: int) -> str:
    pieces: list[str] = []
    size = 0
    for piece in compiled.generate(**variables):
        size += len(piece)
        if size > max_chars:
            raise TokenizationError(f"the chat template's output grew past {max_chars} characters")
        pieces.append(piece)
    return "".join(pieces)


class ModelTokenizer:
    """Tokenizer + chat template of one model, loaded offline from a model directory (HF layout)."""

    def __init__(self, model_dir: str | Path, *, chat_template: str | None = None,
                 default_chat_template_kwargs: Mapping[str, Any] | None = None,
                 processes: LongTextEncoder | None = None) -> None:
        """`chat_template` plays vLLM's `--chat-template` (text); `default_chat_template_kwargs` its
        `--default-chat-template-kwargs`; `processes`: where texts of its `min_chars` or more are encoded
        (router/tokenizer_processes.py), instead of on the calling thread."""
        self.model_dir = Path(model_dir)
        self._processes = processes
        tokenizer_file = self.model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {self.model_dir}")
        self._tok = Tokenizer.from_file(str(tokenizer_file))
        self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        config_file = self.model_dir / "tokenizer_config.json"
        config: dict[str, Any] = (json.loads(config_file.read_text(encoding="utf-8"))
                                  if config_file.is_file() else {})
        self.special_tokens: dict[str, str] = {}
        for attr in SPECIAL_TOKEN_ATTRIBUTES:
            text = _special_token_text(config.get(attr))
            if text is not None:
                self.special_tokens[attr] = text
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        self.model_max_length: int | None = config.get("model_max_length")
        self.chat = ChatRenderer(self.special_tokens, self._load_templates(config), server_template=chat_template,
                                 default_kwargs=default_chat_template_kwargs, source=str(self.model_dir))
        self._words: WordEncoder | None = None
        self._seeds = self._cache_seeds()
        self._number_group = _number_group(self._tok)
        self._prepends = _prepends(self._tok)
        self._metaspace = _metaspace_prepends(self._tok)
        self._newline_tail = any(map(_NEWLINE_TAIL.search, _split_patterns(self._tok)))
        self._nfc = False
        self._byte_lengths: array[int] | None = None
        self._byte_lengths = self._byte_length_table()
        self._words = WordEncoder.build(self._tok) if self._byte_lengths is not None else None

    def _load_templates(self, config: Mapping[str, Any]) -> dict[str, str]:
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            templates.update({t["name"]: t["template"] for t in raw})
        jinja_file = self.model_dir / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        extra_dir = self.model_dir / "additional_chat_templates"
        if extra_dir.is_dir():
            for path in sorted(extra_dir.glob("*.jinja")):
                templates[path.stem] = path.read_text(encoding="utf-8")
        return templates

    # ---- plain text --------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        size: int = self._tok.get_vocab_size(with_added_tokens=True)
        return size

    def token_id(self, token: str) -> int | None:
        tid: int | None = self._tok.token_to_id(token)
        return tid

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.token_id(eos)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens.get("bos_token")
        return None if bos is None else self.token_id(bos)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Text → ids. `encode_batch_fast` releases the GIL while it runs (plain `encode` holds it, measured with
        tokenizers 0.23) and skips the character offsets; the ids are the same."""
        ids: list[int] = self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return ids

    def encode_with_ends(self, text: str, *, add_special_tokens: bool,
                         offset: int = 0) -> tuple[array[int], array[int]]:
        """`encode` as uint32 ids, with each token's end as a UTF-8 byte offset into `text` (0 for the special
        tokens added in front), plus `offset` (where `text` starts in a longer one): what router/token_cache.py
        splices at.

        For a byte-level BPE tokenizer without a normalizer (or an NFC one, on NFC text) a token's bytes are its
        vocabulary string's characters, so the ends are running sums of a per-id length table: no offsets are
        asked of the tokenizer, which costs more than the encoding itself (measured with tokenizers 0.23). The sum
        must come out at the text's length, or the offsets are asked after all."""
        lengths = self._byte_lengths
        if lengths is not None and (self._nfc is False or unicodedata.is_normalized("NFC", text)):
            ids = self._encode_ids(text, add_special_tokens)
            front = self._front_specials if add_special_tokens else 0
            ends = array("I", bytes(4 * front))
            run = offset
            for at in range(front, len(ids), ENDS_STEP):
                ends.extend(islice(accumulate(map(lengths.__getitem__, ids[at:at + ENDS_STEP]), initial=run), 1, None))
                run = ends[-1]
            if run - offset == len(text.encode("utf-8", "surrogatepass")):
                return ids, ends
        ids, ends = self._encode_with_offsets(text, add_special_tokens)
        return ids, (array("I", map(offset.__add__, ends)) if offset else ends)

    def encode_with_some_ends(self, text: str, *, add_special_tokens: bool,
                              offset: int = 0) -> tuple[array[int], array[int]]:
        """`encode_with_ends`, except that the ends may stop short of the ids: those left out are the running sums
        of the byte table that `more_ends` adds, from the last end given (or `offset`). For ASCII text through a
        pipeline the word cache reproduces (router/word_encoder.py), each token's bytes are its table length,
        added tokens' too, so no end is summed now: the token cache needs a prompt's ends only where a later prompt
        parts from it (about 12 us of the 30 a 270-byte window took to encode, in process)."""
        front_ids = self._front_ids
        if self._words is not None and text.isascii() and (front_ids is not None or not add_special_tokens):
            ids = self._encode_ids(text, add_special_tokens)
            return ids, array("I", bytes(4 * self._front_specials)) if add_special_tokens else array("I")
        return self.encode_with_ends(text, add_special_tokens=add_special_tokens, offset=offset)

    def more_ends(self, ends: array[int], ids: Sequence[int], beyond: int) -> None:
        """Extend `ends` (those `encode_with_some_ends` gave for the first of `ids`) until one passes `beyond` or
        every id has its end: the byte table's running sums, in growing steps (each one C call: the GIL changes
        hands only between calls)."""
        lengths = self._byte_lengths
        assert lengths is not None, "ends left out only for tokenizers with a byte table"
        at, step = len(ends), 16
        run = ends[-1] if at else 0
        while at < len(ids) and run <= beyond:
            ends.extend(islice(accumulate(map(lengths.__getitem__, ids[at:at + step]), initial=run), 1, None))
            run = ends[-1]
            at += step
            step = min(4 * step, ENDS_STEP)

    def _encode_ids(self, text: str, add_special_tokens: bool) -> array[int]:
        """Ids from the word cache when it can (router/word_encoder.py: ASCII text up to `WORD_CACHE_MAX_CHARS`: a
        cold 32,000-character document of words seen before for a fifth of the tokenizer's CPU), else from the
        tokenizer: on the calling thread below `PARALLEL_CHARS` (the batch call would hand it to the tokenizer's own
        thread pool and wait, and on a busy machine each hand-over waits for a core), a longer text on the
        tokenizer's threads, without the GIL; and a text as long as `processes` asks, in a tokenizer process, by this
        same method there."""
        if self._processes is not None and len(text) >= self._processes.min_chars:
            return self._processes.encode(str(self.model_dir), text, add_special_tokens)
        words, front = self._words, self._front_ids
        if (words is not None and len(text) <= WORD_CACHE_MAX_CHARS
                and (front is not None or not add_special_tokens)):
            plain = words.encode(text)
            if plain is not None:
                if not (add_special_tokens and front):
                    return plain
                ids = array("I", front)
                ids.extend(plain)
                return ids
        if len(text) >= PARALLEL_CHARS:
            return array("I", self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        return array("I", self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def _encode_with_offsets(self, text: str, add_special_tokens: bool) -> tuple[array[int], array[int]]:
        encoding = (self._tok.encode(text, add_special_tokens=add_special_tokens) if len(text) < PARALLEL_CHARS
                    else self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0])
        # character ends, never going back (a trimmed whitespace token's could), as byte offsets
        ends: Iterator[int] = accumulate(map(itemgetter(1), encoding.offsets), max)
        if not text.isascii():
            at = [0, *accumulate(len(c.encode("utf-8", "surrogatepass")) for c in text)]
            ends = map(at.__getitem__, ends)
        return array("I", encoding.ids), array("I", ends)

    def _byte_length_table(self) -> array[int] | None:
        """Bytes of text each token id stands for, if this is a byte-level BPE tokenizer whose table gives the same
        ends as its offsets on samples; else None."""
        normalizer = self._tok.normalizer
        if not isinstance(self._tok.decoder, decoders.ByteLevel) or not (
                normalizer is None or isinstance(normalizer, normalizers.NFC)):
            return None
        self._nfc = normalizer is not None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        lengths = array("I", bytes(4 * (max(vocab.values(), default=0) + 1)))
        for token, tid in vocab.items():
            lengths[tid] = len(token)
        for tid, added in self._tok.get_added_tokens_decoder().items():
            lengths[tid] = len(added.content.encode())
        self._byte_lengths = lengths
        samples = ["plain words, numbers 12345 and  spaces\n\n\tand tabs", "ünïcödé 日本語 🙂 — ok?",
                   "".join(self.special_tokens.values()) + " text between <|im_start|>user\nhi<|im_end|>"]
        for sample in samples:
            data = sample.encode()
            for special in (False, True):
                ids, ends = self.encode_with_ends(sample, add_special_tokens=special)
                want_ids, want_ends = self._encode_with_offsets(sample, special)
                # inside a character split over tokens, offsets name the character's end, the table the byte's
                if ids != want_ids or any(a != b and (a >= len(data) or data[a] & 0xC0 != 0x80)
                                          for a, b in zip(ends, want_ends, strict=True)):
                    self._byte_lengths = None
                    return None
        return lengths

    def cache_seed(self, add_special_tokens: bool) -> int | None:
        """What cached ids of this tokenizer depend on, as a hash seed; None when they cannot be spliced (special
        tokens added after the text, not only in front of it)."""
        return self._seeds[add_special_tokens]

    def _cache_seeds(self) -> dict[bool, int | None]:
        sample = "probe text, 12 words"
        plain = self.encode(sample, add_special_tokens=False)
        full = self.encode(sample, add_special_tokens=True)
        self._front_specials = len(full) - len(plain)
        spliceable = full[len(full) - len(plain):] == plain
        self._front_ids: list[int] | None = full[:self._front_specials] if spliceable else None
        name = str(self.model_dir.resolve())
        return {False: xxhash.xxh3_64_intdigest(f"{name}\x00plain".encode()),
                True: xxhash.xxh3_64_intdigest(f"{name}\x00special".encode())
                if spliceable else None}

    def splices_at(self, data: bytes, at: int) -> bool:
        """Whether the token cache may splice at byte `at` (a character's first) of the UTF-8 text `data`: whether,
        where the first few ids of the text from there agree with the whole text's (all its seam check compares),
        the others agree too. Not with a normalizer that puts text in front of every text (Llama 2's `Prepend("▁")`: the
        text from `at` gets a "▁" the whole text has not there), nor inside one of the groups the pre-tokenizer
        cuts a run of numbers into (Llama 3's `\\p{N}{1,3}`, counted from the run's first character: the text from
        `at` groups the rest of the run otherwise), nor with a pattern that counts anything else, nor at a newline
        after punctuation or a newline where the pattern gives punctuation the newlines after it (Llama 3's
        ` ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*`: the text from `at` takes them with the whitespace and newlines after them).
        With a Metaspace pre-tokenizer's "▁" put in front, only at a space (elsewhere the check would fail)."""
        group = self._number_group
        if group is None or self._prepends:
            return False
        if self._metaspace and at < len(data) and data[at] != 0x20:
            return False
        if self._newline_tail and 0 < at < len(data) and data[at] in b"\r\n" and _after_punctuation(data, at):
            return False
        if not group or at >= len(data) or not _is_number(data, at):
            return True
        run = 0  # numbers before `at` in its run
        while at > 0:
            at -= 1
            while data[at] & 0xC0 == 0x80:
                at -= 1
            if not _is_number(data, at):
                break
            run += 1
        return run % group == 0

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """Token ids → text, as vLLM's `/detokenize` (transformers `decode`) gives it."""
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                         (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
                text = text.replace(a, b)
        return text

    # ---- chat --------------------------------------------------------------------------------------------

    def chat_template(self, tools: object = None, request_template: str | None = None) -> str:
        return self.chat.chat_template(tools, request_template)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **render: Any) -> str:
        """`ChatRenderer.render_chat` with this model's templates."""
        return self.chat.render_chat(messages, **render)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]], *, add_special_tokens: bool = False,
                      **render: Any) -> list[int]:
        """`render_chat` then encode; vLLM encodes chat prompts without adding special tokens by default."""
        return self.encode(self.render_chat(messages, **render), add_special_tokens=add_special_tokens)

    def prompt_ids(self, body: Mapping[str, Any], *, chat: bool) -> list[int]:
        """The prompt token ids vLLM would compute for an OpenAI `/v1/chat/completions` (chat=True) or
        `/v1/completions` request body (also vLLM's `/tokenize` bodies). Raises TokenizationError on bad input."""
        if chat:
            return self.encode(self.chat.prompt_text(body), add_special_tokens=chat_adds_special_tokens(body))
        prompt = body.get("prompt")
        add_special = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=add_special)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise TokenizationError("`prompt` must be a string or a list of token ids")


def _components(state: Any) -> Iterator[dict[str, Any]]:
    """Every object in a tokenizer component's JSON (a Sequence's steps, theirs, ...)."""
    if isinstance(state, dict):
        yield state
        for value in state.values():
            yield from _components(value)
    elif isinstance(state, list):
        for value in state:
            yield from _components(value)


# a counted repetition in a split pattern: of numbers, from one up to a count (group 1), or of anything else
_COUNTED = re.compile(r"\\p\{N\}\{1,([0-9]+)\}|\{[0-9]+(?:,[0-9]*)?\}")


# newlines a pattern gives to the text before them (Llama 3's ` ?[^\s\p{L}\p{N}]+[\r\n]*`, o200k's `[\r\n/]*`)
_NEWLINE_TAIL = re.compile(r"\[\\r\\n[^\]]*\]\*")


def _split_patterns(tok: Tokenizer) -> list[str]:
    """The regular expressions of the pre-tokenizer's splits."""
    pre = tok.pre_tokenizer
    return [] if pre is None else [
        pattern["Regex"] for c in _components(json.loads(pre.__getstate__()))
        if c.get("type") == "Split" and isinstance(pattern := c.get("pattern"), dict)
        and isinstance(pattern.get("Regex"), str)]


def _number_group(tok: Tokenizer) -> int | None:
    """How many numbers the pre-tokenizer's split patterns group a run of them by (`\\p{N}{1,3}`: 3), 0 if they
    count nothing, None if they count something else or the normalizer may change what is counted (where its splits
    fall then depends on text any distance back)."""
    groups = {match.group(1) for pattern in _split_patterns(tok) for match in _COUNTED.finditer(pattern)}
    if not groups:
        return 0
    if len(groups) > 1 or None in groups or not (tok.normalizer is None or isinstance(tok.normalizer, normalizers.NFC)):
        return None
    return int(groups.pop())


def _prepends(tok: Tokenizer) -> bool:
    """Whether the normalizer puts text in front of every text (Llama 2's `Prepend("▁")`, always, unlike a Metaspace
    pre-tokenizer, which adds its "▁" only where a text does not start with one)."""
    normalizer = tok.normalizer
    return normalizer is not None and any(
        c.get("type") == "Prepend" for c in _components(json.loads(normalizer.__getstate__())))


def _metaspace_prepends(tok: Tokenizer) -> bool:
    """Whether a Metaspace pre-tokenizer puts its "▁" in front of a text that does not start with a space (Mistral's
    and T5's): a window starting elsewhere than at a space gets one the whole text has not there, and its seam
    check fails after encoding it."""
    pre = tok.pre_tokenizer
    return pre is not None and any(
        c.get("type") == "Metaspace" and c.get("prepend_scheme", "always") != "never"
        and c.get("add_prefix_space", True)
        for c in _components(json.loads(pre.__getstate__())))


def _is_number(data: bytes, at: int) -> bool:
    """Whether the character at byte `at` of the UTF-8 text `data` is a number (`\\p{N}`)."""
    lead = data[at]
    if lead < 0x80:
        return 0x30 <= lead <= 0x39
    size = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return unicodedata.category(data[at:at + size].decode("utf-8", "surrogatepass"))[0] == "N"


def _after_punctuation(data: bytes, at: int) -> bool:
    """Whether the character before byte `at` of the UTF-8 text `data` is a newline or neither whitespace, a letter
    nor a number (`[^\\s\\p{L}\\p{N}]`; marks count as such, as they do there)."""
    start = at - 1
    while data[start] & 0xC0 == 0x80:
        start -= 1
    char = data[start:at].decode("utf-8", "surrogatepass")
    return char in "\r\n" or not (char.isalnum() or char.isspace())


def chat_adds_special_tokens(body: Mapping[str, Any]) -> bool:
    """vLLM encodes a rendered chat without adding special tokens unless the request asks."""
    return bool(body.get("add_special_tokens", False))


def _tool_dict(tool: Any) -> dict[str, Any]:
    """A request tool as vLLM's `ChatCompletionToolsParam.model_dump()` passes it to the template."""
    if not isinstance(tool, Mapping) or not isinstance(tool.get("function"), Mapping):
        raise TokenizationError("each tool must be an object with a `function` object")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str):
        raise TokenizationError("a tool's function needs a `name`")
    out_fn: dict[str, Any] = {"name": fn["name"], "description": fn.get("description"),
                              "parameters": fn.get("parameters")}
    defer = tool.get("defer_loading")
    fn_defer = fn["defer_loading"] if fn.get("defer_loading") is not None else defer
    if fn.get("strict") is not None:
        out_fn["strict"] = fn["strict"]
    if fn_defer is not None:
        out_fn["defer_loading"] = fn_defer
    out: dict[str, Any] = {"type": tool.get("type", "function"), "function": out_fn}
    if defer is not None:
        out["defer_loading"] = defer
    return out


def _text_parts(parts: Sequence[Any]) -> Iterator[str | None]:
    """Text of each content part; None for a part vLLM skips. Media parts are not supported."""
    for part in parts:
        if isinstance(part, str):
            yield part
            continue
        if not isinstance(part, Mapping):
            raise TokenizationError("content parts must be strings or objects")
        key = _TEXT_PART_KEYS.get(part.get("type", ""))
        if key is None:
            raise TokenizationError(f"content part type {part.get('type')!r} is not supported for tokenization")
        text = part.get(key)
        if text is not None and not isinstance(text, str):
            raise TokenizationError(f"content part `{key}` must be a string")
        yield text


_PLAIN_ROLES = frozenset(("system", "user", "assistant"))


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else (
            part.get("text") if isinstance(part, Mapping) and part.get("type") == "text" else None)
        if not (isinstance(text, str) and text.startswith(_CLAUDE_CODE_BILLING_HEADER)):
            out.append(part)
        elif rest := text.partition("\n")[2]:
            out.append(rest)
    return out


def _parse_message(message: Mapping[str, Any], content_format: str) -> Message:
    role = message.get("role")
    content = message.get("content")
    if (len(message) == 2 and type(content) is str and type(role) is str and role in _PLAIN_ROLES
            and content_format == "string"
            and not (role == "system" and content.startswith(_CLAUDE_CODE_BILLING_HEADER))):
        # the common message, a role and its text: what the general path below makes of it, at a third of the cost
        return {"role": role, "content": content}
    if not isinstance(role, str):
        raise TokenizationError("each message needs a string `role`")
    if content is None:
        parts: list[Any] = []
    elif isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = list(content)
    else:
        raise TokenizationError("message `content` must be a string, a list of parts or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts = list(_text_parts(parts))
    out: Message = {"role": role}
    if content_format == "openai":
        out["content"] = [{"type": "text", "text": t} for t in texts if t is not None]
    else:
        out["content"] = "\n".join(t for t in texts if t is not None)
    if role == "assistant":
        if message.get("tool_calls") is not None:
            out["tool_calls"] = [dict(c) if isinstance(c, Mapping) else c for c in message["tool_calls"]]
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        if isinstance(out["content"], list):
            out["content"] = "\n".join(p["text"] for p in out["content"])
    for field in ("name", "task"):
        if isinstance(message.get(field), str):
            out[field] = message[field]
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _parse_tool_call_arguments(message: Message) -> None:
    """Templates expect tool-call arguments as dicts; OpenAI clients send JSON strings."""
    calls = message.get("tool_calls")
    if message["role"] != "assistant" or not isinstance(calls, list):
        return
    if not calls:
        del message["tool_calls"]
        return
    for i, call in enumerate(calls):
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(
                call.get("function"), Mapping):
            raise TokenizationError("chat completions only support assistant tool_calls of type 'function'.")
        # vLLM validates messages against the OpenAI TypedDicts, which keeps only their keys, in their order
        function = {k: call["function"][k] for k in ("arguments", "name") if k in call["function"]}
        arguments = function.get("arguments")
        parsed: Any = {}
        if arguments:
            if isinstance(arguments, str):
                try:
                    parsed = json.loads(arguments)
                except json.JSONDecodeError:
                    parsed = {}
            else:
                parsed = arguments
            if not isinstance(parsed, dict):
                parsed = {}
        function["arguments"] = parsed
        calls[i] = {k: (function if k == "function" else call[k]) for k in ("id", "function", "type") if k in call}


def _consolidate_system(conversation: list[Message]) -> list[Message]:
    """Merge all system messages into one at position 0 (vLLM does this after developer → system)."""
    contents: list[str] = []
    others: list[Message] = []
    needed = False
    for i, message in enumerate(conversation):
        if message["role"] == "system":
            if i > 0 or contents:
                needed = True
            content = message.get("content", "")
            if isinstance(content, list):
                content = "\n".join(p["text"] if isinstance(p, Mapping) else str(p) for p in content
                                    if isinstance(p, str) or (isinstance(p, Mapping) and "text" in p))
            if content:
                contents.append(content)
        else:
            others.append(message)
    if not needed:
        return conversation
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]
