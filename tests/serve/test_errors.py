"""Every error the server answers, through the `openai` client's exception types, in the OpenAI
envelope; auth; body limit; disconnects free their rows; a failing request leaves the engine up."""

from __future__ import annotations

import threading

import openai
import pytest

from tests.serve.conftest import NAME, client, httpx, kill_engine, serving, wait_until
from torchformer.serve.app import create_app
from torchformer.serve.engine import Engine
from torchformer.serve.text import Texts


def envelope(err: openai.APIStatusError) -> dict:
    body = err.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 0}, "n"),
        ({"n": 5}, "n"),  # more choices than the server's 4 rows
        ({"logprobs": 6}, "logprobs"),  # completions: 0-5
        ({"logprobs": True}, "logprobs"),  # completions: an integer
        ({"echo": "yes"}, "echo"),
        ({"top_logprobs": 2}, "top_logprobs"),  # a chat field
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"mirostat": 1}, "mirostat"),  # unknown field
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"prompt": ["one", "two"]}, "prompt"),  # a batch of prompts: n = 1 only
        ({"prompt": [999999]}, "prompt"),  # out of vocabulary
    ],
)
def test_unsupported_parameters_are_400(server, extra, param):
    _, url = server
    body = {"prompt": "the", "max_tokens": 3, **extra}
    with pytest.raises(openai.BadRequestError) as err:
        client(url).completions.create(model=NAME, **{"prompt": body.pop("prompt")}, extra_body=body)
    assert envelope(err.value)["param"] == param
    assert err.value.status_code == 400


def test_chat_refuses_bad_logprobs_and_non_text_parts(server):
    _, url = server
    hi = [{"role": "user", "content": "hi"}]
    for extra, param in [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"logprobs": 1}, "logprobs"),
        ({"echo": True}, "echo"),  # completions only
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            client(url).chat.completions.create(model=NAME, messages=hi, extra_body=extra)
        assert envelope(err.value)["param"] == param, extra
    parts = [{"type": "image_url", "image_url": {"url": "http://x"}}]
    with pytest.raises(openai.BadRequestError) as err:
        client(url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": parts}])
    assert envelope(err.value)["param"] == "messages[0].content"


def test_context_length_exceeded_names_both_numbers(server):
    _, url = server
    with pytest.raises(openai.BadRequestError) as err:
        client(url).completions.create(model=NAME, prompt=[1] * 50, max_tokens=60)
    error = envelope(err.value)
    assert error["code"] == "context_length_exceeded"
    assert "96" in error["message"] and "110" in error["message"]


def test_another_model_is_404_and_unknown_route_is_enveloped(server):
    _, url = server
    with pytest.raises(openai.NotFoundError) as err:
        client(url).completions.create(model="/etc/passwd", prompt="the")
    assert envelope(err.value)["code"] == "model_not_found"
    response = httpx.get(f"{url}/v1/nothing")
    assert response.status_code == 404 and set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_oversized_body_is_413(model_dir, tiny):
    with serving(model_dir, tiny, slots=1, max_body_bytes=2000) as (_, url):
        with pytest.raises(openai.APIStatusError) as err:
            client(url).completions.create(model=NAME, prompt="x" * 5000)
        assert err.value.status_code == 413
        envelope(err.value)
        chunks = iter([b"{" + b" " * 1500, b" " * 1500 + b"}"])
        chunked = httpx.post(f"{url}/v1/completions", content=chunks, headers={"content-type": "application/json"})
        assert chunked.status_code == 413  # no Content-Length: counted while reading


def test_api_key_required_on_every_endpoint_but_health(model_dir, tiny):
    with serving(model_dir, tiny, slots=1, api_key="sekrit") as (_, url):
        with pytest.raises(openai.AuthenticationError) as err:
            client(url, api_key="wrong").completions.create(model=NAME, prompt="the", max_tokens=2)
        assert envelope(err.value)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(url, api_key="wrong").models.list()
        assert httpx.get(f"{url}/metrics").status_code == 401
        assert httpx.get(f"{url}/health").status_code == 200
        ok = client(url, api_key="sekrit").completions.create(model=NAME, prompt="the", max_tokens=2)
        assert ok.usage.completion_tokens == 2


def slow_steps(engine, seconds: float) -> None:
    inner = engine.step_fn
    engine.step_fn = lambda *a: (threading.Event().wait(seconds), inner(*a))[1]


def test_full_queue_is_429_with_retry_after(model_dir, tiny):
    with serving(model_dir, tiny, slots=1, max_queue=1) as (engine, url):
        slow_steps(engine, 0.05)
        c = client(url)
        streams = [c.completions.create(model=NAME, prompt="the", max_tokens=40, stream=True) for _ in range(2)]
        wait_until(lambda: engine.running == 1 and len(engine.waiting) == 1, what="one running, one queued")
        with pytest.raises(openai.RateLimitError) as err:
            c.completions.create(model=NAME, prompt="the", max_tokens=2)
        assert err.value.response.headers["retry-after"] == "1"
        assert envelope(err.value)["code"] == "queue_full"
        for s in streams:
            s.close()


def test_disconnect_mid_stream_frees_the_row(model_dir, tiny):
    with serving(model_dir, tiny, slots=1) as (engine, url):
        slow_steps(engine, 0.05)
        stream = client(url).completions.create(model=NAME, prompt="the", max_tokens=80, stream=True)
        next(iter(stream))
        assert engine.running == 1
        stream.close()
        wait_until(lambda: engine.running == 0, timeout=5, what="the row to be freed")
        assert engine.metrics.finished.get("cancelled") == 1
        # The freed row serves the next request.
        out = client(url).completions.create(model=NAME, prompt="the", max_tokens=3)
        assert out.usage.completion_tokens == 3


def test_disconnect_while_waiting_for_a_full_answer_frees_the_row(model_dir, tiny):
    with serving(model_dir, tiny, slots=1) as (engine, url):
        slow_steps(engine, 0.05)
        with pytest.raises(openai.APITimeoutError):
            client(url, timeout=0.5).completions.create(model=NAME, prompt="the", max_tokens=80)
        wait_until(lambda: engine.running == 0, timeout=5, what="the row to be freed")
        assert engine.metrics.finished.get("cancelled") == 1


def test_sampling_error_is_500_and_the_engine_survives(server, monkeypatch):
    import torchformer.serve.jobs as jobs

    engine, url = server
    real = jobs.choose

    def choose(logits, s, generator):
        if s.top_k == 13:
            raise RuntimeError("boom in sampling")
        return real(logits, s, generator)

    monkeypatch.setattr(jobs, "choose", choose)
    with pytest.raises(openai.InternalServerError) as err:
        client(url).completions.create(model=NAME, prompt="the", max_tokens=5, temperature=1, extra_body={"top_k": 13})
    assert "boom" in envelope(err.value)["message"]
    stream = client(url).completions.create(
        model=NAME, prompt="the", max_tokens=5, temperature=1, stream=True, extra_body={"top_k": 13}
    )
    with pytest.raises(openai.APIError, match="boom"):
        list(stream)
    assert httpx.get(f"{url}/health").status_code == 200
    assert client(url).completions.create(model=NAME, prompt="the", max_tokens=3).usage.completion_tokens == 3


def test_health_is_503_while_loading_and_after_death(model_dir, tiny):
    from tests.serve.conftest import Running

    loaded = threading.Event()
    engine = Engine(lambda: (loaded.wait(10), tiny)[1], lambda vocab: Texts(None, vocab)).start()
    running = Running(create_app(engine, NAME))
    try:
        assert httpx.get(f"{running.url}/health").status_code == 503
        with pytest.raises(openai.InternalServerError) as err:  # 503
            client(running.url).completions.create(model=NAME, prompt=[1, 2], max_tokens=2)
        assert err.value.status_code == 503 and envelope(err.value)["code"] == "not_ready"
        loaded.set()
        wait_until(lambda: engine.healthy, what="the engine to load")
        assert httpx.get(f"{running.url}/health").status_code == 200
        # No tokenizer: text prompts are refused, ids are served and answered as ids.
        with pytest.raises(openai.BadRequestError):
            client(running.url).completions.create(model=NAME, prompt="text", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as err:
            client(running.url).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}])
        assert envelope(err.value)["code"] == "no_chat_template"
        out = client(running.url).completions.create(model=NAME, prompt=[1, 2], max_tokens=3, temperature=0)
        assert len(out.choices[0].text.split(" ")) == 3

        kill_engine(engine, SystemError("dead"))
        response = httpx.get(f"{running.url}/health")
        assert response.status_code == 503 and "SystemError" in response.json()["status"]
    finally:
        loaded.set()
        running.stop()
        engine.stop()


def test_request_timeout_ends_with_length_through_the_client(model_dir, tiny):
    with serving(model_dir, tiny, slots=1, request_timeout=0.5) as (engine, url):
        slow_steps(engine, 0.05)
        out = client(url).completions.create(model=NAME, prompt="the", max_tokens=80)
        assert out.choices[0].finish_reason == "length" and 1 <= out.usage.completion_tokens < 80
        chunks = list(client(url).completions.create(model=NAME, prompt="the", max_tokens=80, stream=True))
        assert chunks[-1].choices[0].finish_reason == "length"
