"""Issue 26, item 6: a server on a loopback address answers only requests that name a loopback
Host (a DNS-rebound name is refused) unless --allowed-hosts adds it, refuses requests from web
pages of other origins (a browser sends their Origin) unless --allowed-origins lists them, and
takes only application/json bodies (the content type a page cannot send without asking first).
Every refusal is the OpenAI envelope. /health after the engine died says why in a few words."""

from __future__ import annotations

import pytest

from tests.serve.conftest import NAME, Running, httpx, kill_engine, serving, wait_until
from torchformer.serve.app import create_app
from torchformer.serve.engine import Engine
from torchformer.serve.text import Texts

BODY = {"model": NAME, "prompt": "the", "max_tokens": 2}


def refused(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


@pytest.fixture(scope="module")
def guarded(model_dir, tiny):
    options = {"allowed_hosts": ["models.internal"], "allowed_origins": ["http://app.internal:3000"]}
    with serving(model_dir, tiny, slots=2, app=options) as (engine, url):
        yield url


def test_only_loopback_hosts_by_default(server):
    _, url = server
    port = url.rsplit(":", 1)[1]
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}", "LocalHost"):
        assert httpx.get(f"{url}/v1/models", headers={"host": host}).status_code == 200, host
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "[::2]", ""):
        error = refused(httpx.post(f"{url}/v1/completions", json=BODY, headers={"host": host}), 403, "host_not_allowed")
        assert "--allowed-hosts" in error["message"]
    refused(httpx.get(f"{url}/health", headers={"host": "evil.example"}), 403, "host_not_allowed")


def test_allowed_hosts_add_to_loopback(guarded):
    assert httpx.post(f"{guarded}/v1/completions", json=BODY, headers={"host": "models.internal:80"}).status_code == 200
    assert httpx.post(f"{guarded}/v1/completions", json=BODY).status_code == 200
    refused(httpx.get(f"{guarded}/v1/models", headers={"host": "evil.example"}), 403, "host_not_allowed")


def test_cross_origin_requests_are_refused(server):
    _, url = server
    for origin in ("http://evil.example", "null", url.replace("127.0.0.1", "localhost")):
        error = refused(
            httpx.post(f"{url}/v1/completions", json=BODY, headers={"origin": origin}), 403, "origin_not_allowed"
        )
        assert "--allowed-origins" in error["message"]
        refused(httpx.get(f"{url}/v1/models", headers={"origin": origin}), 403, "origin_not_allowed")
    preflight = {"origin": "http://evil.example", "access-control-request-method": "POST"}
    refused(httpx.options(f"{url}/v1/completions", headers=preflight), 403, "origin_not_allowed")


def test_allowed_origins_get_cors_headers(guarded):
    origin = "http://app.internal:3000"
    preflight = httpx.options(
        f"{guarded}/v1/chat/completions",
        headers={
            "origin": origin,
            "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == origin
    answer = httpx.post(f"{guarded}/v1/completions", json=BODY, headers={"origin": origin})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
    refused(
        httpx.post(f"{guarded}/v1/completions", json=BODY, headers={"origin": "http://app.internal"}),
        403,
        "origin_not_allowed",
    )


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
def test_post_bodies_must_be_json(server, content_type):
    import json

    _, url = server
    headers = {} if content_type is None else {"content-type": content_type}
    response = httpx.post(f"{url}/v1/completions", content=json.dumps(BODY).encode(), headers=headers)
    error = refused(response, 415, "unsupported_media_type")
    assert "application/json" in error["message"]
    ok = httpx.post(
        f"{url}/v1/completions",
        content=json.dumps(BODY).encode(),
        headers={"content-type": "Application/JSON; charset=utf-8"},
    )
    assert ok.status_code == 200


def test_the_cli_checks_hosts_only_on_a_loopback_bind():
    from torchformer.cli.serve import allowed_hosts

    assert allowed_hosts("127.0.0.1", None) is None  # create_app's default: loopback names only
    assert allowed_hosts("::1", None) is None and allowed_hosts("localhost", None) is None
    assert allowed_hosts("0.0.0.0", None) == ["*"]  # exposed on purpose: any Host
    assert allowed_hosts("127.0.0.1", "a.example, b.example") == ["a.example", "b.example"]
    assert allowed_hosts("0.0.0.0", "a.example") == ["a.example"]


def test_health_after_death_is_a_short_reason(tiny):
    engine = Engine(lambda: tiny, lambda vocab: Texts(None, vocab)).start()
    running = Running(create_app(engine, NAME))
    try:
        wait_until(lambda: engine.healthy, what="the engine to load")

        kill_engine(engine, SystemError("/home/someone/secret/checkpoint.py line 3: dead"))
        response = httpx.get(f"{running.url}/health")
        assert response.status_code == 503
        status = response.json()["status"]
        assert "SystemError" in status and "/home" not in status and "dead" not in status and len(status) < 80
        answer = httpx.post(f"{running.url}/v1/completions", json={"model": NAME, "prompt": [1], "max_tokens": 1})
        assert answer.status_code == 503 and "/home" not in answer.text
    finally:
        running.stop()
        engine.stop()
