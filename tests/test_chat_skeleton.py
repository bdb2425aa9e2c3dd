"""router/tokenizer.py's skeleton renders: a conversation of a shape seen before is its template's render of that
shape with the texts put in (trimmed or stripped where the template says so), exactly the full render, and only for
templates that do not otherwise look into a text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.make_model import CHAT_TEMPLATE
from router.tokenizer import (
    _NONCE,
    ChatRenderer,
    ModelTokenizer,
    TokenizationError,
    _compile,
    _compile_skeleton,
    _Skeleton,
)

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
# Meta's Llama 3.1 Instruct template as its tokenizer_config.json ships it
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""  # noqa: E501 (the template as shipped)
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
    # trimmed and stripped texts: the fill trims and strips the real texts
    "llama31": LLAMA31,
    "trim": "{% for m in messages %}[{{ m.content | trim }}]{% endfor %}",
    "trim chars": "{% for m in messages %}[{{ m.content | trim('<> \\n') }}|{{ m.content | trim(chars='.') | trim }}|"
                  "{{ m.content.strip('x') + '|' + m.content.lstrip('\\n') + '|' + m.content.rstrip() }}]"
                  "{% set s = m.content | trim %}{% if m.content %}{{ s + '!' }}{% endif %}{% endfor %}",
}
# templates that look into a text: a stand-in for the text raises when they do
LOOKS_INTO_TEXT = {
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
    # trimmed, then looked into: still caught
    "trimmed then compared": "{% for m in messages %}{% if (m.content | trim) == 'stop' %}S{% endif %}"
                             "{{ m.content | trim }}{% endfor %}",
    "trimmed then emptiness": "{% for m in messages %}{% if m.content | trim %}[{{ m.content }}]{% endif %}"
                              "{% endfor %}",
    "trimmed then length": "{% for m in messages %}{{ m.content | trim | length }}{% endfor %}",
    "stripped then split": "{% for m in messages %}{{ m.content.strip().split('</think>')[-1] }}{% endfor %}",
    "stripped then in": "{% for m in messages %}{{ '<think>' in m.content.strip() }}{% endfor %}",
    "trimmed by a text": "{% for m in messages %}{{ m.content | trim(messages[0].content) }}{% endfor %}",
    "trimmed then upper": "{% for m in messages %}{{ m.content | trim | upper }}{% endfor %}",
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
    "\n\n  two lines\nend \n", " \t\r\n ", "\n", "\u2003wide\u3000", "<<x>>\n", "..dots..", "xx y xx",
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


def rendered_or_refused(renderer: ChatRenderer, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    try:
        return renderer.render_chat(messages, **kwargs)
    except TokenizationError as e:
        return f"refused: {e}"


@settings(max_examples=150, deadline=None)
@given(roles=st.lists(st.sampled_from(["system", "user", "assistant"]), min_size=1, max_size=5),
       first=st.lists(TEXTS, min_size=5, max_size=5), second=st.lists(TEXTS, min_size=5, max_size=5),
       ending=st.sampled_from(["generation prompt", "none", "continue final message"]))
def test_llama31_chats_render_from_their_skeleton_as_the_full_render(
        roles: list[str], first: list[str], second: list[str], ending: str) -> None:
    """Llama 3.1's template trims every text (the system message into a `set`): its chats, with or without a
    system message, and continuing the final message or not, render from a skeleton exactly as in full (a bounded
    render is a full one)."""
    renderer = ChatRenderer(SPECIAL, {"default": LLAMA31})
    kwargs = {"add_generation_prompt": ending == "generation prompt",
              "continue_final_message": ending == "continue final message"}
    one = [{"role": r, "content": t} for r, t in zip(roles, first, strict=False)]
    two = [{"role": r, "content": t if bool(t) == bool(f) else f}
           for r, t, f in zip(roles, second, first, strict=False)]
    for messages in (one, two, one):
        assert rendered_or_refused(renderer, messages, **kwargs) == rendered_or_refused(
            renderer, messages, **kwargs, max_chars=1 << 20)
    texts = [m["content"] for m in one]
    if kwargs["continue_final_message"]:
        texts[-1] += "CONTINUE_FINAL_MESSAGE_TAG "
    continued = [{**m, "content": t} for m, t in zip(one, texts, strict=True)]
    skeleton = renderer._skeletons[shape_of(renderer, LLAMA31, continued, kwargs["add_generation_prompt"])]
    assert type(skeleton) is _Skeleton and len(skeleton.steps) == len(roles)  # each text trimmed once


def test_llama31_with_a_date_string_or_tools_takes_the_full_render() -> None:
    """The template's own `date_string` and `tools` variables, given by the request, keep it off the skeleton."""
    renderer = ChatRenderer(SPECIAL, {"default": LLAMA31})
    messages = [{"role": "system", "content": " Be brief.\n"}, {"role": "user", "content": "\nhi "}]
    assert renderer.render_chat(messages) == full_render(LLAMA31, messages, True)
    assert renderer.render_chat(messages) == full_render(LLAMA31, messages, True)
    dated = renderer.render_chat(messages, chat_template_kwargs={"date_string": "4 Dec 2026"})
    assert "Today Date: 4 Dec 2026\n\nBe brief.<|eot_id|>" in dated
    assert dated == _compile(LLAMA31)[0].render(**SPECIAL, messages=messages, tools=None, documents=None,
                                                 add_generation_prompt=True, date_string="4 Dec 2026")
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    with_tools = renderer.render_chat(messages, tools=[tool])
    assert with_tools.startswith(full_render(LLAMA31, messages, True)[:30]) and '"name": "f"' in with_tools
    assert [type(s) for s in renderer._skeletons.values()] == [_Skeleton]


def test_a_text_trimmed_again_in_a_loop_is_trimmed_once_per_fill() -> None:
    template = "{% for m in messages %}{% for i in range(3) %}[{{ m.content | trim }}]{% endfor %}{% endfor %}"
    renderer = ChatRenderer(SPECIAL, {"default": template})
    for text in (" a ", "\nb\n"):
        assert renderer.render_chat([{"role": "user", "content": text}]) == f"[{text.strip()}]" * 3
    [skeleton] = renderer._skeletons.values()
    assert type(skeleton) is _Skeleton and skeleton.slots == (1, 1, 1) and len(skeleton.steps) == 1


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
    if name in LOOKS_INTO_TEXT:  # caught by the stand-ins (once: the shape is remembered), not by the check
        assert _compile_skeleton(template) is not None and renderer.looked_into == 1
        assert list(renderer._skeletons.values()) == [None]
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


def test_a_shape_that_looks_into_a_text_leaves_the_templates_other_shapes_their_skeletons() -> None:
    """A regression: one request whose shape made the template look into a text (Llama 3.1's `content is iterable`
    for a tool message without a tool_call_id, which any client may send) turned skeleton renders off for every
    conversation of that template, for the renderer's life."""
    renderer = ChatRenderer(SPECIAL, {"default": LLAMA31})
    plain = [{"role": "system", "content": "You help."}, {"role": "user", "content": "  hi  "}]
    odd = [{"role": "user", "content": "call it"}, {"role": "tool", "content": "[1, 2]"}]
    for messages in (odd, plain, odd, plain):
        assert renderer.render_chat(messages, add_generation_prompt=True) == full_render(LLAMA31, messages, True)
    assert type(renderer._skeletons[shape_of(renderer, LLAMA31, plain, True)]) is _Skeleton
    assert renderer._skeletons[shape_of(renderer, LLAMA31, odd, True)] is None
    assert renderer.looked_into == 1
