"""Property tests of the gateway's edge: any request body or header set a client can send gets a clear answer —
an HTTP response, never a 500 of the gateway's own, never a hang — and leaves the gateway serving.

Runs against a real `kvgate serve` process (`prefix` strategy with the tiny model's tokenizer, clients' own chat
templates rendered in its sandbox, a tenant header) in front of two real stand-in worker processes, with raw
sockets so that bytes no HTTP library would send can be sent. Hypothesis generates the inputs; CI runs a fixed,
derandomized set (`KVGATE_FUZZ_EXAMPLES` examples per property, 150 by default); set `KVGATE_FUZZ_RANDOM=1` to
explore new inputs on each run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from bench.abuse import AbuseFleet, Answer, abuse_fleet, exchange

EXAMPLES = int(os.environ.get("KVGATE_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None,
                derandomize=os.environ.get("KVGATE_FUZZ_RANDOM") != "1",
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

PATHS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/embeddings", "/v1/models",
         "/admin/workers", "/health", "/v1/../admin/workers", "/v1/%2e%2e/admin"]


@pytest.fixture(scope="module")
def fleet(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AbuseFleet]:
    with abuse_fleet(tiny_model_dir, tmp_path_factory.mktemp("fuzz"), ["--template-timeout-s", "0.5",
                                                                       "--log-level", "info"]) as running:
        yield running
        log = running.log_text()
    assert "Traceback" not in log and "unexpected error" not in log, log[-4000:]


# --- request bodies ---------------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=False),
                    st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                            max_size=4),
                      max_leaves=12)
token_ids = st.lists(st.one_of(st.integers(-3, 50_000), st.sampled_from([2**32 - 1, 2**32, 2**63, -2**63])),
                     max_size=40)
prompts = st.one_of(st.text(max_size=300), token_ids, st.lists(st.text(max_size=30), max_size=3),
                    st.lists(token_ids, max_size=3), values)
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "refusal", "image_url", "thinking"])},
                              optional={"text": st.one_of(st.text(max_size=40), scalars),
                                        "refusal": st.text(max_size=10)})
contents = st.one_of(st.none(), st.text(max_size=300), st.lists(st.one_of(parts, st.text(max_size=20), values),
                                                                max_size=3), values)
messages = st.one_of(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), scalars),
         "content": contents},
        optional={"tool_calls": st.one_of(values, st.lists(st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries(
                {"name": st.text(max_size=10), "arguments": st.one_of(st.text(max_size=30), values)})}),
            max_size=2)),
            "name": values, "tool_call_id": values, "reasoning": values}),
    values)
templates = st.one_of(
    st.sampled_from([
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
        "{{ messages[0].content * 3 }}", "{% for %}", "{{ raise_exception('no') }}", "{{ ''.__class__ }}",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "{{ 'a' * 3000000000 }}", "{{ messages | tojson(indent=4) }}", "default", "tool_use",
    ]),
    st.text(max_size=60), values)
small_counts = st.one_of(st.integers(-3, 4), st.text(max_size=5), st.floats(allow_nan=False), st.booleans(),
                         st.none())
valid_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                 "content": st.text(max_size=200)}), min_size=1, max_size=4)
extras = {
    "model": st.one_of(st.sampled_from(["tiny", "nope", ""]), scalars),
    "prompt": prompts,
    "messages": st.one_of(st.lists(messages, max_size=4), values),
    "stream": st.one_of(st.booleans(), scalars),
    "max_tokens": small_counts,  # a valid huge one would be a long generation for the worker, not a gateway bug
    "max_completion_tokens": small_counts,
    "n": small_counts,
    "tools": st.one_of(st.lists(st.one_of(values, st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=10)},
                                                                       optional={"parameters": values})})),
        max_size=3), values),
    "documents": values,
    "chat_template": templates,
    "chat_template_kwargs": values,
    "add_generation_prompt": values,
    "continue_final_message": values,
    "add_special_tokens": values,
    "reasoning_effort": values,
    "cache_salt": values,
    "tokens": st.one_of(token_ids, values),
}
free_bodies = st.fixed_dictionaries({}, optional=extras)
# mostly well-formed requests with a few fields fuzzed, so that inputs get past the first check and reach routing,
# tokenization, templates and the workers
edge_checked = ("model", "messages", "prompt", "stream", "max_tokens", "max_completion_tokens", "n")
deep = {k: v for k, v in extras.items() if k not in edge_checked}
chat_bodies = st.fixed_dictionaries(
    {"model": st.just("tiny"), "messages": st.one_of(valid_messages, st.lists(messages, max_size=3)),
     "stream": st.booleans()}, optional=deep)
completion_bodies = st.fixed_dictionaries({"model": st.just("tiny"), "prompt": prompts, "stream": st.booleans()},
                                          optional=deep)
bodies = st.one_of(chat_bodies, completion_bodies, free_bodies)
raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([
        b"", b"null", b"[]", b"{}", b"1e999999", b'{"model": NaN}', b'{"prompt": "\\ud800"}', b'{"model": "\xff\xfe"}',
        b'{"model": "tiny", "prompt": [18446744073709551616]}', b'{"model": "tiny"' + b" " * 10_000,
        b"[" * 100_000, b'{"model": "tiny", "prompt": ' + b"[" * 5000, b'{"a": 1, "a": 2}', b"\x00" * 100,
    ]),
)


def _request(method: str, path: str, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method.encode(), path.encode()), b"Host: gateway", b"Connection: close",
             b"Content-Length: %d" % len(body)]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


_first_hang: list[bytes] = []  # the first request the gateway did not answer: later ones fail at once, naming it


def send(fleet: AbuseFleet, request: bytes) -> Answer | None:
    assert not _first_hang, f"the gateway stopped answering after {_first_hang[0][:500]!r}"
    try:
        return exchange(fleet.port, request, timeout=15)
    except TimeoutError:
        _first_hang.append(request)
        raise AssertionError(f"no answer within 15 s to {request[:500]!r}") from None


def check(answer: Answer | None, request: bytes) -> None:
    assert answer is not None, f"no HTTP answer to {request[:300]!r}"
    event(f"status {answer.status}")
    assert not (answer.status == 500 and b"internal_error" in answer.body), (request[:500], answer)
    if answer.status >= 400 and "json" in answer.headers.get("content-type", ""):
        error = orjson.loads(answer.body)["error"]
        assert isinstance(error["message"], str) and error["message"], answer


@FUZZ
@given(path=st.one_of(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), st.sampled_from(PATHS)),
       body=st.one_of(bodies.map(orjson.dumps), raw_bodies),
       method=st.sampled_from(["POST"] * 6 + ["GET", "PUT", "DELETE"]),
       tenant=st.one_of(st.none(), st.binary(max_size=20)),
       content_type=st.sampled_from([b"application/json", b"text/plain", b"application/json; charset=latin-1", b""]))
def test_any_body_gets_a_clear_answer(fleet: AbuseFleet, path: str, body: bytes, method: str, tenant: bytes | None,
                                      content_type: bytes) -> None:
    headers = [(b"Content-Type", content_type)] + ([(b"X-Tenant", tenant.replace(b"\r", b"").replace(b"\n", b""))]
                                                   if tenant is not None else [])
    request = _request(method, path, body, headers)
    check(send(fleet, request), request)


# --- request heads ----------------------------------------------------------------------------------------------

header_names = st.one_of(st.sampled_from([b"Authorization", b"X-Request-Id", b"Content-Length", b"Transfer-Encoding",
                                          b"Content-Type", b"traceparent", b"X-Tenant", b"Host", b"Expect",
                                          b"Connection", b"Accept"]),
                         st.binary(min_size=1, max_size=20))
header_values = st.one_of(st.binary(max_size=60), st.sampled_from([b"chunked", b"gzip, chunked", b"-1", b"0",
                                                                   b"99999999999999999999", b"100-continue",
                                                                   b"Bearer \xff", b"x" * 9000]))
request_lines = st.one_of(
    st.sampled_from([b"POST /v1/completions HTTP/1.1", b"POST /v1/chat/completions HTTP/1.1"]),
    st.sampled_from([b"POST /v1/completions HTTP/1.1", b"GET /health HTTP/1.0", b"POST /v1/chat/completions HTTP/1.1",
                     b"GET /metrics HTTP/1.1", b"POST /admin/workers HTTP/1.1", b"GET /v1/models?x=\xff HTTP/1.1",
                     b"BREW /coffee HTCPCP/1.0", b"GET / HTTP/2.0", b"GET " + b"/a" * 5000 + b" HTTP/1.1"]),
    st.binary(max_size=80))


@FUZZ
@given(line=request_lines, headers=st.lists(st.tuples(header_names, header_values), max_size=8),
       body=st.one_of(st.just(b""), bodies.map(orjson.dumps), st.binary(max_size=100)))
def test_any_headers_get_a_clear_answer(fleet: AbuseFleet, line: bytes, headers: list[tuple[bytes, bytes]],
                                        body: bytes) -> None:
    request = line + b"\r\n" + b"".join(name + b": " + value + b"\r\n" for name, value in headers) + \
        b"Connection: close\r\n\r\n" + body
    answer = send(fleet, request)
    # a request head the HTTP parser cannot read may be answered 400 or just closed; anything read gets a status
    if answer is not None:
        check(answer, request)


def test_the_gateway_still_serves_after_the_fuzzing(fleet: AbuseFleet) -> None:
    body = orjson.dumps({"model": "tiny", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    answer = exchange(fleet.port, _request("POST", "/v1/chat/completions", body))
    assert answer is not None and answer.status == 200, answer
    metrics = exchange(fleet.port, _request("GET", "/metrics", b""))
    assert metrics is not None
    assert b'kvgate_rejected_requests_total{code="internal_error"' not in metrics.body


def test_empty_bodies_one_after_another(fleet: AbuseFleet) -> None:
    """Found by the fuzzing: aiohttp's shared empty payload ends iter_chunks() only once per process, so the second
    request without a body froze the gateway's event loop (every later request timed out)."""
    for _ in range(3):
        answer = exchange(fleet.port, _request("POST", "/v1/chat/completions", b""), timeout=5)
        assert answer is not None and answer.status == 400, answer
