"""Issue 27 item 4: ``n`` > 1. The prompt is prefilled once and its cache row copied into the other
choices' rows; choice i of a request with seed s is what a one-choice request with seed s + i
gives (and tfm.generate with seed s + i); a request for more choices than free rows waits for
them; more than --slots is a 400 naming the limit, and the engine stays healthy."""

from __future__ import annotations

import threading

import openai
import pytest
import torch

import torchformer as tfm
from tests.serve.conftest import NAME, client, make_engine
from tests.serve.test_engine import Collect, options
from torchformer.serve import scheduler as engine_module
from torchformer.serve.jobs import Delta, Done
from torchformer.serve.protocol import APIError


@pytest.fixture(scope="module")
def tok(model_dir):
    return tfm.load_tokenizer(model_dir)


def generated(model, ids, n, **sampling) -> list[int]:
    return tfm.generate(model, torch.tensor([ids]), max_new_tokens=n, **sampling)[0, len(ids) :].tolist()


def test_n_choices_each_equal_generate_with_seed_plus_index(server, tiny, tok, monkeypatch):
    _, url = server
    prompted, real = [], engine_module.prefill_rows

    def spy(model, cache, start, prompts, *rest):
        prompted.append(len(prompts))
        return real(model, cache, start, prompts, *rest)

    monkeypatch.setattr(engine_module, "prefill_rows", spy)
    ids = tok.encode("the quick brown", add_special_tokens=False).ids
    sampling = {"temperature": 1.0, "top_k": 30}
    out = client(url).completions.create(
        model=NAME, prompt=ids, n=3, seed=11, max_tokens=10, extra_body={"return_token_ids": True, "top_k": 30}
    )
    assert prompted == [1], "one prompt prefilled for three choices"
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:
        assert c.token_ids == generated(tiny, ids, 10, seed=11 + c.index, **sampling), c.index
    assert len({tuple(c.token_ids) for c in out.choices}) > 1, "the choices differ"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 30)
    one = client(url).completions.create(model=NAME, prompt=ids, seed=12, max_tokens=10, extra_body={"top_k": 30})
    assert one.choices[0].text == out.choices[1].text


def test_n_choices_streamed_chat_equal_the_full_answer(server):
    _, url = server
    ask = {"model": NAME, "messages": [{"role": "user", "content": "fox"}], "n": 3, "seed": 4, "max_tokens": 8}
    full = client(url).chat.completions.create(**ask, temperature=0.9, logprobs=True)
    texts, logprobs = ["", "", ""], [[], [], []]
    for chunk in client(url).chat.completions.create(**ask, temperature=0.9, logprobs=True, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            logprobs[c.index] += [e.logprob for e in (c.logprobs.content if c.logprobs else [])]
    assert texts == [c.message.content for c in full.choices]
    # The second request reuses the first's cached prompt (prefix.py): equal within float rounding.
    assert logprobs == [pytest.approx([e.logprob for e in c.logprobs.content], abs=1e-5) for c in full.choices]


def test_n_beyond_slots_is_400_and_the_engine_stays_healthy(server, tiny, tok):
    _, url = server
    for n in (5, 0, 129):
        with pytest.raises(openai.BadRequestError) as err:
            client(url).completions.create(model=NAME, prompt="the", n=n, max_tokens=2)
        body = err.value.response.json()["error"]
        assert body["param"] == "n" and str(n) in body["message"]
        if n == 5:
            assert "--slots" in body["message"] and "n <= 4" in body["message"]
    ids = tok.encode("the lazy", add_special_tokens=False).ids
    out = client(url).completions.create(model=NAME, prompt=ids, n=4, max_tokens=5, temperature=0)
    want = tok.decode(generated(tiny, ids, 5), skip_special_tokens=True)
    assert [c.text for c in out.choices] == [want] * 4


def test_n_beyond_the_free_rows_waits_for_them(tiny):
    engine = make_engine(tiny, slots=2, max_queue=2)
    try:
        order, lock = [], threading.Lock()

        def sink(name):
            collect = Collect()

            def call(event):
                with lock:
                    order.append((name, event))
                collect(event)

            return collect, call

        (long, long_sink), (pair, pair_sink) = sink("long"), sink("pair")
        engine.submit([1, 2, 3], options(20), long_sink)
        with pytest.raises(APIError) as err:
            engine.submit([4, 5], options(3, n=3), Collect())
        assert err.value.status == 400 and err.value.param == "n"
        engine.submit([4, 5], options(3, temperature=1.0, seed=2, n=2), pair_sink)
        assert long.ended.wait(10) and pair.ended.wait(10)
        long_done = next(i for i, (name, e) in enumerate(order) if name == "long" and isinstance(e, Done))
        pair_first = next(i for i, (name, e) in enumerate(order) if name == "pair" and isinstance(e, Delta))
        assert long_done < pair_first, "the two-row request started only once both rows were free"
        for index in (0, 1):
            got = [t for e in pair.events if isinstance(e, Delta) and e.index == index for t in e.token_ids]
            assert got == generated(tiny, [4, 5], 3, temperature=1.0, seed=2 + index)
        assert sorted(e.index for e in pair.events if isinstance(e, Done)) == [0, 1]
    finally:
        engine.stop()
    assert engine.error is None
