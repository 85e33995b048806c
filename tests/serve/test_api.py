"""The real `openai` client (max_retries=0) against uvicorn on 127.0.0.1 at a free port:
completions and chat, streaming and not, stop / length / usage, and served == tfm.generate for
concurrent requests over HTTP."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import torchformer as tfm
from tests.serve.conftest import CHAT_TEMPLATE, NAME, client, httpx


def generate_text(model, tokenizer, prompt_ids, n, **sampling) -> tuple[list[int], str]:
    out = tfm.generate(model, torch.tensor([prompt_ids]), max_new_tokens=n, **sampling)[0, len(prompt_ids) :].tolist()
    return out, tokenizer.decode(out, skip_special_tokens=True)


@pytest.fixture(scope="module")
def tok(model_dir):
    return tfm.load_tokenizer(model_dir)


def test_models_and_health(server):
    engine, url = server
    models = client(url).models.list()
    assert [m.id for m in models.data] == [NAME]
    assert httpx.get(f"{url}/health").status_code == 200


def test_completion_equals_generate(server, tiny, tok):
    _, url = server
    prompt = "the quick brown"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    want_ids, want_text = generate_text(tiny, tok, ids, 12)
    out = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == NAME
    assert out.choices[0].text == want_text
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(ids),
        12,
        len(ids) + 12,
    )
    extra = client(url).completions.create(
        model=NAME, prompt=ids, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    assert extra.choices[0].token_ids == want_ids and extra.prompt_token_ids == ids


def test_seeded_sampling_with_extensions_equals_generate(server, tiny, tok):
    _, url = server
    ids = tok.encode("héllo wörld", add_special_tokens=False).ids
    sampling = {"temperature": 0.8, "top_p": 0.9, "seed": 5}
    extensions = {"top_k": 20, "min_p": 0.02, "repetition_penalty": 1.2}
    _, want = generate_text(tiny, tok, ids, 15, **sampling, **extensions)
    out = client(url).completions.create(model=NAME, prompt=ids, max_tokens=15, extra_body=extensions, **sampling)
    assert out.choices[0].text == want


def test_sampling_filters_apply_without_a_history_processor(server, tok):
    """top_k 1 or a tiny temperature leave only the argmax, so a sampled answer is the greedy one;
    the control (temperature 2) is not (with no repetition penalty the processors used to be
    skipped, and the raw softmax sampled)."""
    _, url = server
    ids = tok.encode("the quick brown", add_special_tokens=False).ids

    def text(**sampling) -> str:
        return client(url).completions.create(model=NAME, prompt=ids, max_tokens=16, **sampling).choices[0].text

    greedy = text(temperature=0)
    assert text(temperature=1.0, seed=3, extra_body={"top_k": 1}) == greedy
    assert text(temperature=1e-4, seed=3) == greedy
    assert text(temperature=2.0, seed=3) != greedy


def test_concurrent_requests_each_equal_generate(server, tiny, tok):
    """More requests than slots at once: every answer equals generating its prompt alone."""
    _, url = server
    prompts = ["the lazy dog", "naïve café", "0123", "fox jumps over", "wörld", "brown", "dog. h", "quick"]
    seeds = [None, 1, None, 2, 3, None, 4, 5]

    def ask(i):
        sampling = {"temperature": 0.0} if seeds[i] is None else {"temperature": 1.0, "seed": seeds[i]}
        out = client(url).completions.create(model=NAME, prompt=prompts[i], max_tokens=10 + i, **sampling)
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, range(len(prompts))))
    for i, text in enumerate(got):
        sampling = {} if seeds[i] is None else {"temperature": 1.0, "seed": seeds[i]}
        ids = tok.encode(prompts[i], add_special_tokens=False).ids
        assert text == generate_text(tiny, tok, ids, 10 + i, **sampling)[1], prompts[i]


def test_streaming_completion_matches_and_reports_usage(server, tiny, tok):
    _, url = server
    ids = tok.encode("the quick", add_special_tokens=False).ids
    _, want = generate_text(tiny, tok, ids, 20)
    chunks = list(
        client(url).completions.create(
            model=NAME,
            prompt="the quick",
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want
    assert len({c.id for c in chunks}) == 1
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_string_across_token_boundaries(server, tiny, tok):
    _, url = server
    ids = tok.encode("the", add_special_tokens=False).ids
    _, full = generate_text(tiny, tok, ids, 30)
    stop = full[7:10]  # three characters from inside the greedy text, wherever the token edges are
    cut = full[: full.index(stop)]
    out = client(url).completions.create(model=NAME, prompt=ids, max_tokens=30, temperature=0, stop=[stop, "@@"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 30
    streamed = client(url).completions.create(
        model=NAME, prompt=ids, max_tokens=30, temperature=0, stop=stop, stream=True
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_chat_completion_uses_the_template(server, tiny, tok):
    _, url = server
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    rendered = "<|system|>be brief<|user|>héllo<|assistant|>"  # CHAT_TEMPLATE by hand
    assert CHAT_TEMPLATE.startswith("{% for m in messages %}")
    ids = tok.encode(rendered, add_special_tokens=False).ids
    _, want = generate_text(tiny, tok, ids, 9)
    out = client(url).chat.completions.create(model=NAME, messages=messages, max_completion_tokens=9, temperature=0)
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == want
    assert out.choices[0].finish_reason == "length" and out.usage.prompt_tokens == len(ids)
    chunks = list(
        client(url).chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=9,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.total_tokens == len(ids) + 9 and chunks[-1].object == "chat.completion.chunk"


def test_metrics_count_requests_and_tokens(server):
    engine, url = server
    client(url).completions.create(model=NAME, prompt=[1, 2, 3], max_tokens=4, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if not line.startswith("#")}
    assert values['torchformer_serve_requests_finished_total{reason="length"}'] >= 1
    assert values["torchformer_serve_generation_tokens_total"] >= 4
    assert values["torchformer_serve_requests_running"] == 0
    assert values["torchformer_serve_time_to_first_token_seconds_count"] >= 1
    assert values['torchformer_serve_inter_token_seconds_bucket{le="+Inf"}'] >= 3
