"""router/tokenizer.py: chat templating and tokenization the way vLLM does it (the live comparison with vLLM's
`/tokenize` is in test_conformance.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tokenizer import ChatRenderer, ModelTokenizer, TokenizationError, _compile, _parse_message


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> ModelTokenizer:
    return ModelTokenizer(tiny_model_dir)


def test_chat_is_templated_then_encoded_without_special_tokens(tok: ModelTokenizer) -> None:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]}
    text = tok.render_chat(body["messages"])
    assert text == ("<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.prompt_ids(body, chat=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    bos, im_start = tok.bos_token_id, tok.token_id("<|im_start|>")
    assert bos is not None and im_start is not None
    assert ids[:2] == [bos, im_start] and ids.count(bos) == 1
    # add_special_tokens on a chat request adds BOS on top of the template's
    assert tok.prompt_ids({**body, "add_special_tokens": True}, chat=True) == [bos, *ids]
    # add_generation_prompt=False drops the assistant header; chat_template_kwargs cannot override the field
    no_gen = tok.prompt_ids({**body, "add_generation_prompt": False,
                             "chat_template_kwargs": {"add_generation_prompt": True}}, chat=True)
    assert ids[:len(no_gen)] == no_gen and len(no_gen) < len(ids)


def test_completion_prompts(tok: ModelTokenizer) -> None:
    ids = tok.prompt_ids({"prompt": "import os\nos.getcwd()"}, chat=False)
    assert ids[0] == tok.bos_token_id
    assert tok.prompt_ids({"prompt": "import os\nos.getcwd()", "add_special_tokens": False}, chat=False) == ids[1:]
    assert tok.prompt_ids({"prompt": [5, 6, 7]}, chat=False) == [5, 6, 7]
    assert tok.prompt_ids({"prompt": ["x y"]}, chat=False) == tok.encode("x y", add_special_tokens=True)
    assert tok.decode(ids) == "<s>import os\nos.getcwd()"
    assert tok.decode(ids, skip_special_tokens=True) == "import os\nos.getcwd()"
    for bad in ({"prompt": 3}, {"prompt": [1, "a"]}, {}):
        with pytest.raises(TokenizationError):
            tok.prompt_ids(bad, chat=False)


def test_message_normalisation_like_vllm(tok: ModelTokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "user\na\nb<|im_end|>" in tok.render_chat(parts)
    assert "user\n<|im_end|>" in tok.render_chat([{"role": "user", "content": None}])
    calls: list[dict[str, Any]] = [{"role": "user", "content": "q"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]}]
    text = tok.render_chat(calls, tools=[{"type": "function", "function": {"name": "f"}}])
    # arguments parsed to a dict, keys in the order of the OpenAI TypedDict vLLM validates against
    assert '<tool_call>\n{"arguments": {"x": 1}, "name": "f"}\n</tool_call>' in text
    assert "<|im_start|>tool\n42<|im_end|>" in text
    # request tools reach the template as vLLM's pydantic model_dump() gives them
    ids = tok.prompt_ids({"messages": calls, "tools": [{"type": "function", "function": {"name": "f"}}]}, chat=True)
    assert '{"type": "function", "function": {"name": "f", "description": null, "parameters": null}}' in \
        tok.decode(ids)
    # developer becomes system when the template has no developer role
    dev = tok.render_chat([{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"}])
    assert dev.startswith("<s><|im_start|>system\nrules<|im_end|>")
    cont = tok.render_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
                           add_generation_prompt=False, continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nThe answer is")


def test_template_variables_and_errors(tiny_model_dir: Path) -> None:
    template = ("{{ bos_token }}{% if flavour %}[{{ flavour }}]{% endif %}{% for m in messages %}"
                "{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}"
                "{{ m.content }}{% endfor %}{{ 'x' | tojson }}")
    tok = ModelTokenizer(tiny_model_dir, chat_template=template, default_chat_template_kwargs={"flavour": "d"})
    msgs = [{"role": "user", "content": "<&>"}]
    assert tok.render_chat(msgs) == '<s>[d]<&>"x"'
    assert tok.render_chat(msgs, chat_template_kwargs={"flavour": "r"}) == '<s>[r]<&>"x"'
    with pytest.raises(TokenizationError, match="no bad roles"):
        tok.render_chat([{"role": "bad", "content": ""}])
    with pytest.raises(TokenizationError):
        tok.render_chat(msgs, chat_template_kwargs={"tokenize": True})
    with pytest.raises(TokenizationError):
        tok.render_chat(msgs, continue_final_message=True)  # with add_generation_prompt (default True)
    with pytest.raises(TokenizationError):
        tok.prompt_ids({"messages": "hi"}, chat=True)
    with pytest.raises(TokenizationError):
        tok.prompt_ids({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, chat=True)


def test_thread_pool_gives_the_same_ids(tok: ModelTokenizer) -> None:
    bodies = [{"messages": [{"role": "user", "content": f"request {i} " + "def f(x): return x\n" * 50}]}
              for i in range(32)]
    serial = [tok.prompt_ids(b, chat=True) for b in bodies]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda b: tok.prompt_ids(b, chat=True), bodies))
    assert parallel == serial


def test_encoding_releases_the_gil(tok: ModelTokenizer) -> None:
    """A Python thread keeps running while a long prompt is encoded (plain `Tokenizer.encode` would freeze it)."""
    import threading
    import time

    text = "def f(x):\n    return [y * 2 for y in range(x)]  # héllo\n" * 8_000  # ~400 KB, ~0.3 s
    spins = [0]
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            spins[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        time.sleep(0.1)
        before, t0 = spins[0], time.perf_counter()
        time.sleep(0.1)
        rate = (spins[0] - before) / (time.perf_counter() - t0)  # spins per second with the GIL free
        before = spins[0]
        tok.encode(text, add_special_tokens=False)
        during = spins[0] - before
    finally:
        stop.set()
        thread.join(5)
    # held for the whole call, the spinner would get at most a switch interval or two (5 ms each)
    assert during > rate * 0.05, (during, rate)


@settings(max_examples=300, deadline=None)
@given(role=st.sampled_from(["system", "user", "assistant", "tool", "developer", "other"]),
       content=st.one_of(st.text(max_size=40), st.just("x-anthropic-billing-header: cc\nrest"),
                         st.just("x-anthropic-billing-header")),
       content_format=st.sampled_from(["string", "openai"]))
def test_a_plain_message_is_parsed_as_the_general_path_parses_it(role: str, content: str,
                                                                 content_format: str) -> None:
    """`_parse_message` takes a shortcut for a message of a role and its text; `name: None` (ignored) sends the
    same message down the general path, which must agree."""
    plain = _parse_message({"role": role, "content": content}, content_format)
    general = _parse_message({"role": role, "content": content, "name": None}, content_format)
    assert plain == general


def test_compiled_templates_hold_their_globals_flat() -> None:
    """Every render copies a template's globals into its context: a plain dict of them, not jinja's ChainMap over
    the environment's (looked up key by key in Python, 16 us of a 41 us chat render), with every global there."""
    compiled, _, _ = _compile("{{ raise_exception is defined }} {{ strftime_now('%Y') | length }} "
                              "{% set ns = namespace(x=1) %}{{ ns.x }} {{ range(2) | list }} {{ x | default(3) }}")
    assert type(compiled.globals) is dict
    assert compiled.render() == "True 4 1 [0, 1] 3"
    with pytest.raises(TokenizationError, match="rejected"):  # raise_exception, through the renderer
        ChatRenderer({}, {"default": "{{ raise_exception('no') }}"}).render_chat([{"role": "user", "content": "x"}])


def test_attribute_lookups_on_dicts_are_the_sandboxes(tok: ModelTokenizer) -> None:
    """The chat environment looks up `message.field` on a plain dict without raising (router/tokenizer.py,
    `_ChatEnvironment`): every kind of name renders as jinja's own immutable sandbox renders it -- a key, an absent
    key, a dict method, a key that shadows one, a private or internal name, a mutating method, and a dict subclass."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from router.tokenizer import _ENV

    class Subclass(dict[str, Any]):
        def __getattr__(self, name: str) -> str:
            return f"attr:{name}"

    template = ("{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ m.tool_calls is defined }}|"
                "{{ m.name | default('none') }}|{{ m.items() | list | length }}|{{ m.get('role') }}|"
                "{{ m.keys is defined }}|{{ m.values is string }}|{{ m.__class__ is defined }}|"
                "{{ m._private is defined }}|{{ m.update is defined }}|{{ m.copy is defined }}]{% endfor %}")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [1]},
                {"role": "tool", "content": "x", "name": "f", "values": "shadowed", "_private": 1},
                Subclass(role="sub", content="y")]
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    want = plain.from_string(template).render(messages=messages)
    assert _ENV.from_string(template).render(messages=messages) == want
    assert want.startswith("[user|hi|False|none|2|user|True|False|False|False|False|True][assistant|None|True|")
    assert "[tool|x|False|f|5|tool|True|False|" in want and "[attr:role|attr:content|True|attr:name|" in want
