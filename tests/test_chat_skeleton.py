"""router/tokenizer.py's skeleton renders: a conversation of a shape seen before is its template's render of that
shape with the texts put in, exactly the full render, and only for templates that do not look into a text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.make_model import CHAT_TEMPLATE
from router.tokenizer import _NONCE, ChatRenderer, ModelTokenizer, _compile, _compile_skeleton, _Skeleton

SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# templates that copy the texts, test their type, or branch on whether they are empty: skeleton renders apply
APPLIES = {
    "tiny": CHAT_TEMPLATE,
    "qwen25": QWEN25,
    "truthiness": "{% for m in messages %}{% if m.content %}[{{ m.role }}:{{ m.content }}]{% else %}"
                  "(empty {{ m.role }}){% endif %}{% endfor %}{% if add_generation_prompt %}>{% endif %}",
    "default": "{% for m in messages %}{{ m['content'] | default('none', true) }}|{{ m.content is string }}|"
               "{{ m.content is defined }}|{{ m.content is none }}|{{ m.content is sequence }}{% endfor %}",
    "generation": "{% for m in messages %}{% if m.role == 'assistant' %}{% generation %}{{ m.content + '!' }}"
                  "{% endgeneration %}{% else %}{{ bos_token + m.content }}{% endif %}{{ eos_token }}{% endfor %}",
    "namespace": "{% set ns = namespace(sys='') %}{% for m in messages %}{% if m.role == 'system' %}"
                 "{% set ns.sys = m.content %}{% else %}<{{ ns.sys }}>{{ m.content }}{% endif %}{% endfor %}",
}
# templates that look into a text: a stand-in for the text raises when they do
LOOKS_INTO_TEXT = {
    "trim": "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}",
    "in": "{% for m in messages %}{% if '<think>' in m.content %}T{% endif %}{{ m.content }}{% endfor %}",
    "method": "{% for m in messages %}{{ m.content.split('</think>')[-1] }}{% endfor %}",
    "compare": "{% for m in messages %}{% if m.content == 'stop' %}S{% else %}{{ m.content }}{% endif %}{% endfor %}",
    "length": "{% for m in messages %}{{ m.content | length }}:{{ m.content }}{% endfor %}",
    "joined then trimmed": "{% for m in messages %}[{{ (m.content + '  ') | trim }}]{% endfor %}",
    "int": "{% for m in messages %}{{ m.content | int }}{% endfor %}",
    "slice": "{% for m in messages %}{{ m.content[:3] }}{% endfor %}",
    "tojson": "{{ messages | tojson }}",
    "tilde": "{% for m in messages %}{{ m.content ~ '|' }}{% endfor %}",
    "sameas": "{% for m in messages %}{{ m.content is sameas messages[0].content }}{% endfor %}",
    "iterable": "{% for m in messages %}{{ m.content is iterable }}{{ m.content }}{% endfor %}",
}
# templates that capture output as a string (which they may then transform), or vary from render to render: refused
# when compiled
CAPTURES_OR_VARIES = {
    "block set": "{% for m in messages %}{% set c %}{{ m.content }}{% endset %}{{ c | upper }}{% endfor %}",
    "filter block": "{% filter upper %}{% for m in messages %}{{ m.content }}{% endfor %}{% endfilter %}",
    "macro": "{% macro r(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ r(m.content) | lower }}{% endfor %}",
    "autoescape": "{% autoescape true %}{% for m in messages %}{{ m.content }}{% endfor %}{% endautoescape %}",
    "date": "{{ strftime_now('%S.%f') }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "random": "{{ [1, 2, 3, 4, 5, 6, 7, 8] | random }}{% for m in messages %}{{ m.content }}{% endfor %}",
}
ROLES = ["system", "user", "assistant", "user"]
TEXTS = st.one_of(st.text(max_size=30), st.sampled_from([
    "", " ", "  padded  ", "stop", "42", "<think>x</think>y", "{{ raw }}", "<|im_end|>", "a\x00b",
    f"\x00{_NONCE}0\x00", f"\x00{_NONCE}1\x00"]))  # a text may even hold a marker: the fill never rescans


def full_render(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    compiled, _, _ = _compile(template)
    return compiled.render(**SPECIAL, messages=messages, tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt)


def shape_of(renderer: ChatRenderer, template: str, messages: list[dict[str, Any]],
             add_generation_prompt: bool) -> tuple[object, ...]:
    found = renderer._shape(template, messages, add_generation_prompt)
    assert found is not None
    return found[0]


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(sorted(APPLIES)), count=st.integers(1, 4), add_generation_prompt=st.booleans(),
       first=st.lists(TEXTS, min_size=4, max_size=4), second=st.lists(TEXTS, min_size=4, max_size=4))
def test_a_repeated_shape_renders_from_its_skeleton_as_the_full_render(
        name: str, count: int, add_generation_prompt: bool, first: list[str], second: list[str]) -> None:
    template = APPLIES[name]
    renderer = ChatRenderer(SPECIAL, {"default": template})
    one = [{"role": r, "content": t} for r, t in zip(ROLES[:count], first, strict=False)]
    # the same roles and the same texts empty, other texts: the same shape
    two = [{"role": r, "content": t if bool(t) == bool(f) else f}
           for r, t, f in zip(ROLES[:count], second, first, strict=False)]
    for messages in (one, two):
        assert renderer.render_chat(messages, add_generation_prompt=add_generation_prompt) == full_render(
            template, messages, add_generation_prompt)
    skeleton = renderer._skeletons[shape_of(renderer, template, one, add_generation_prompt)]
    assert type(skeleton) is _Skeleton and skeleton.fill([m["content"] for m in two]) == full_render(
        template, two, add_generation_prompt)


@pytest.mark.parametrize("name", sorted(LOOKS_INTO_TEXT) + sorted(CAPTURES_OR_VARIES))
def test_a_template_that_looks_into_a_text_keeps_the_full_render(name: str) -> None:
    template = LOOKS_INTO_TEXT.get(name) or CAPTURES_OR_VARIES[name]
    renderer = ChatRenderer(SPECIAL, {"default": template})
    conversations = [  # one shape; a skeleton of the first would render the others wrongly
        [{"role": "system", "content": "Hello"}, {"role": "user", "content": "<&> x"}],
        [{"role": "system", "content": "  stop  "}, {"role": "user", "content": "<think>a</think>b"}],
        [{"role": "system", "content": "12"}, {"role": "user", "content": "stop"}],
    ]
    for messages in conversations:
        rendered = renderer.render_chat(messages, add_generation_prompt=False)
        if name not in ("date", "random"):
            assert rendered == full_render(template, messages, False)
    if name in LOOKS_INTO_TEXT:  # caught by the stand-ins, not by the check against the full render
        assert _compile_skeleton(template) is not None and renderer._unsafe_templates == {template}
        assert renderer._shape(template, conversations[0], False) is None
    else:
        assert _compile_skeleton(template) is None
    assert not any(type(s) is _Skeleton for s in renderer._skeletons.values())


def test_a_skeleton_that_does_not_fill_to_the_full_render_is_not_kept() -> None:
    """The first render of each shape is checked against the full render of the same request."""
    renderer = ChatRenderer(SPECIAL, {"default": QWEN25})
    messages = [{"role": "user", "content": "hi"}]
    shape = shape_of(renderer, QWEN25, messages, True)
    right = full_render(QWEN25, messages, True)
    renderer._learn(shape, QWEN25, messages, True, ["hi"], right + "x")
    assert renderer._skeletons[shape] is None
    renderer._skeletons.clear()
    renderer._learn(shape, QWEN25, messages, True, ["hi"], right)
    assert type(renderer._skeletons[shape]) is _Skeleton


def test_only_a_plain_conversation_without_tools_or_bounds_takes_a_skeleton() -> None:
    """Tools, documents, template kwargs the template reads, a bounded render (the sandbox's), and a message with
    more than a role and its text go the full way: none of them is in a shape."""
    template = "{{ flavour }}{{ tools | length if tools else 0 }}{% for m in messages %}{{ m.content }}{% endfor %}"
    renderer = ChatRenderer(SPECIAL, {"default": template})
    plain = [{"role": "user", "content": "hi"}]
    renderer.render_chat(plain)
    renderer.render_chat([{"role": "user", "content": "ho"}])
    assert [type(s) for s in renderer._skeletons.values()] == [_Skeleton]
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert renderer.render_chat(plain, tools=[tool]) == "1hi"
    assert renderer.render_chat(plain, chat_template_kwargs={"flavour": "x"}) == "x0hi"
    assert renderer.render_chat(plain, max_chars=100) == "0hi"
    named = [{"role": "user", "content": "hi", "name": "bob"}]
    assert renderer.render_chat(named) == "0hi"
    # what a client chooses freely stays small in the cache: roles up to 32 characters, up to 128 messages
    assert renderer.render_chat([{"role": "r" * 33, "content": "hi"}]) == "0hi"
    assert renderer.render_chat([{"role": "user", "content": "x"}] * 129) == "0" + "x" * 129
    assert len(renderer._skeletons) == 1
    assert renderer.render_chat([{"role": "r" * 32, "content": "hi"}] * 128) == "0" + "hi" * 128
    assert len(renderer._skeletons) == 2


def test_chat_ids_from_a_skeleton_are_the_full_renders(tiny_model_dir: Path) -> None:
    """The model's own template: a chat's prompt ids once its shape is known equal those of the full render."""
    tok = ModelTokenizer(tiny_model_dir)
    template = tok.chat.chat_template()
    for i in range(3):
        body = {"messages": [{"role": "system", "content": f"System prompt {i}. Be brief."},
                             {"role": "user", "content": f"Question {i}: why?"}]}
        text = full_render(template, body["messages"], True)
        assert tok.chat.prompt_text(body) == text
        assert tok.prompt_ids(body, chat=True) == tok.encode(text, add_special_tokens=False)
    assert [type(s) for s in tok.chat._skeletons.values()] == [_Skeleton]
