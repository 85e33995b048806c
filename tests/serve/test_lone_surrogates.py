"""Issue 26, item 2: JSON may escape a lone surrogate (``"\\ud800"``), which is no Unicode text: no
tokenizer takes it and no UTF-8 response can carry it. Wherever it sits (a field's value, a list
item, a message's role or content, a key) the answer is a 400 in the envelope naming the field."""

from __future__ import annotations

import json

import pytest

from tests.serve.conftest import NAME, httpx

LONE = "a\ud800b"
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("completions", {"prompt": LONE}, "prompt"),
        ("completions", {"prompt": LONE, "stream": True}, "prompt"),
        ("completions", {"prompt": [LONE]}, "prompt[0]"),
        ("completions", {"prompt": "the", "stop": ["x", "\udfff"]}, "stop[1]"),
        ("completions", {"prompt": "the", LONE: 1}, "a\\ud800b"),
        ("chat/completions", {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
        ("chat/completions", {"messages": [{"role": "user", "content": LONE}], "stream": True}, "messages[0].content"),
        ("chat/completions", {"messages": [{"role": LONE, "content": "hi"}]}, "messages[0].role"),
        (
            "chat/completions",
            {"messages": [*CHAT, {"role": "user", "content": [{"type": "text", "text": LONE}]}]},
            "messages[1].content[0].text",
        ),
        ("chat/completions", {"messages": CHAT, "user": "\udc80"}, "user"),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    _, url = server
    content = json.dumps({"model": NAME, "max_tokens": 2, **body}).encode()  # ensure_ascii: "\ud800" escapes
    response = httpx.post(f"{url}/v1/{path}", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert "surrogate" in error["message"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_surrogate_pair_is_text(server):
    _, url = server
    content = json.dumps({"model": NAME, "prompt": "the \U0001f600", "max_tokens": 2}).encode()
    response = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
