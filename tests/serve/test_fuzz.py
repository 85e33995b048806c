"""Issue 26: a request fuzzer over the OpenAI request schema. Every field is drawn either from
its plausible values or from anything JSON can hold (wrong types, huge and non-finite numbers,
text with lone surrogates, NULs, bidi controls, very long strings, deep nesting), plus unknown
keys, bodies that are no object or no JSON, and wrong content types. Whatever comes, the answer
is a 200 (a well-formed completion, or a stream ending in [DONE] with no error event) or a 4xx
in the OpenAI envelope; never a 5xx, and /health stays 200. Bounded: a fixed number of examples
(derandomized, so a run is reproducible), each with a deadline, against one server."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.serve.conftest import NAME, httpx

EDGE_TEXT = ["", "\ud800", "a\udfffb", "\x00", "\u202e\u2066", "\ufeff", "\U0001f600", "e\u0301", "\uffff", "x" * 3000]
text = st.one_of(
    st.text(max_size=40), st.text(st.characters(exclude_categories=()), max_size=20), st.sampled_from(EDGE_TEXT)
)
numbers = st.one_of(
    st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0, -1, 2**31, 2**63])
)
scalars = st.one_of(st.none(), st.booleans(), numbers, text)
junk = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6
)


def field(plausible):
    return st.one_of(plausible, plausible, junk)  # plausible twice as often: deeper code is reached


parts = st.lists(st.fixed_dictionaries({"type": field(st.just("text")), "text": field(text)}), max_size=2)
message = st.fixed_dictionaries(
    {"role": field(st.sampled_from(["user", "assistant", "system"])), "content": field(text | parts)},
    optional={"name": field(text)},
)
COMMON = {
    "max_tokens": field(st.integers(1, 8)),
    "temperature": field(st.floats(0, 2)),
    "top_p": field(st.floats(0, 1)),
    "top_k": field(st.integers(-1, 400)),
    "min_p": field(st.floats(0, 1)),
    "repetition_penalty": field(st.floats(0.5, 2)),
    "seed": field(st.integers(0, 2**64)),
    "stop": field(text | st.lists(text, max_size=5)),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "return_token_ids": field(st.booleans()),
    "n": field(st.integers(1, 3)),
    "logprobs": field(st.booleans()),
    "user": field(text),
}
prompt = st.one_of(
    text, st.lists(st.integers(0, 400), max_size=12), st.lists(text | st.lists(st.integers(0, 9)), max_size=2)
)
completion = st.fixed_dictionaries({"model": field(st.just(NAME))}, optional={"prompt": field(prompt), **COMMON})
chat = st.fixed_dictionaries(
    {"model": field(st.just(NAME))},
    optional={
        "messages": field(st.lists(message, max_size=3)),
        "max_completion_tokens": field(st.integers(1, 8)),
        **COMMON,
    },
)


@st.composite
def requests(draw):
    path = draw(st.sampled_from(["completions", "chat/completions"]))
    body = draw(completion if path == "completions" else chat)
    body.update(draw(st.dictionaries(text, junk, max_size=2)))  # unknown (or repeated) keys
    kind = draw(st.sampled_from(["object"] * 8 + ["junk", "bytes", "deep"]))
    if kind == "object":
        content = json.dumps(body).encode()  # NaN/Infinity as Python writes them; surrogates escaped
    elif kind == "junk":
        content = json.dumps(draw(junk)).encode()
    elif kind == "bytes":
        content = draw(st.binary(max_size=64))
    else:
        content = b"[" * 100_000 + b"]" * 100_000
    ctype = draw(st.sampled_from(["application/json"] * 6 + ["application/json; charset=utf-8", "text/plain", None]))
    return path, content, ctype, kind == "object" and body.get("stream") is True


def check_answer(response, streamed: bool) -> None:
    status = response.status_code
    event(f"{status}{' stream' if streamed and status == 200 else ''}")  # --hypothesis-show-statistics
    assert status == 200 or 400 <= status < 500, (status, response.text[:500])
    if status != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        return
    if not streamed:
        assert response.json()["choices"], response.text[:500]
        return
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", response.text[-500:]
    assert not any("error" in json.loads(e) for e in events[:-1]), response.text[-500:]


@pytest.fixture(scope="module")
def http(server):
    _, url = server
    with httpx.Client(base_url=url, timeout=30) as c:
        yield c


@settings(
    max_examples=150,
    deadline=timedelta(seconds=10),
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example],
)
@given(request=requests())
def test_every_answer_is_200_or_a_4xx_envelope(http, request):
    path, content, ctype, streamed = request
    headers = {} if ctype is None else {"content-type": ctype}
    check_answer(http.post(f"/v1/{path}", content=content, headers=headers), streamed)
    assert http.get("/health").status_code == 200
