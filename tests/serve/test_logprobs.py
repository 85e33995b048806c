"""Issue 27 item 3, through the real `openai` client: logprobs (chat ``logprobs``/``top_logprobs``,
completions' legacy ``logprobs``), ``echo`` with the prompt's logprobs (also with max_tokens 0),
streamed and not. Every value is checked against ``log_softmax`` of a plain forward of a separately
loaded copy of the model (the served one has its weights packed while the engine runs) over the
prompt and the returned tokens, within 1e-5 in fp32, including under sampling processors (the
values are the model's, before them)."""

from __future__ import annotations

import math

import pytest
import torch

import torchformer as tfm
from tests.serve.conftest import NAME, client

TOL = 1e-5


@pytest.fixture(scope="module")
def reference(model_dir):
    return tfm.load(model_dir).eval()


@pytest.fixture(scope="module")
def tok(model_dir):
    return tfm.load_tokenizer(model_dir)


def plain(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward: (T, V); row t predicts token t + 1."""
    with torch.no_grad():
        return model(torch.tensor([ids]))[0].float().log_softmax(-1)


def text_of(tok, token: int) -> str:
    return tok.decode([token], skip_special_tokens=True)


def check_legacy(lp, want: torch.Tensor, ids: list[int], tok, k: int, first: int) -> None:
    """Legacy logprobs of tokens ids[first:] against want (T, V); ids[0] is null when first == 0."""
    assert lp.tokens == [text_of(tok, t) for t in ids[first:]]
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == [o + (0 if first == 0 else lp.text_offset[0]) for o in offsets]
    for i, t in enumerate(ids[first:], start=first):
        got, top = lp.token_logprobs[i - first], lp.top_logprobs[i - first]
        if i == 0:
            assert got is None and top is None
            continue
        assert abs(got - want[i - 1, t].item()) < TOL
        values, best = want[i - 1].topk(k)
        expected = {text_of(tok, b): v for b, v in zip(best.tolist(), values.tolist())}
        expected.setdefault(text_of(tok, t), want[i - 1, t].item())
        assert top.keys() == expected.keys()
        assert all(abs(top[key] - expected[key]) < TOL for key in expected)


def test_echo_with_max_tokens_0_scores_the_prompt(server, reference, tok):
    _, url = server
    prompt = "the quick brown fox jumps"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    out = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=5)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    check_legacy(choice.logprobs, plain(reference, ids), ids, tok, 5, 0)


def test_echo_and_logprobs_of_a_greedy_completion(server, reference, tok):
    _, url = server
    prompt = "héllo wörld"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    out = client(url).completions.create(
        model=NAME,
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"return_token_ids": True},
    )
    choice = out.choices[0]
    new = choice.token_ids
    want_new = tfm.generate(reference, torch.tensor([ids]), max_new_tokens=6)[0, len(ids) :].tolist()
    assert new == want_new
    assert choice.text.startswith(prompt) and len(choice.logprobs.tokens) == len(ids) + 6
    check_legacy(choice.logprobs, plain(reference, ids + new), ids + new, tok, 2, 0)
    # Without echo: only the new tokens, their offsets from the start of the completion's text.
    bare = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=0)
    assert bare.choices[0].logprobs.text_offset[0] == 0 and bare.choices[0].text == choice.text[len(prompt) :]
    check_legacy(bare.choices[0].logprobs, plain(reference, ids + new), ids + new, tok, 0, len(ids))


def chat_values(content, want: torch.Tensor, new: list[int], start: int, k: int, tok) -> None:
    assert [c.token for c in content] == [text_of(tok, t) for t in new]
    for i, (entry, t) in enumerate(zip(content, new)):
        row = want[start + i - 1]
        assert abs(entry.logprob - row[t].item()) < TOL
        assert entry.bytes == list(entry.token.encode())
        values, best = row.topk(k)
        assert [e.token for e in entry.top_logprobs] == [text_of(tok, b) for b in best.tolist()]
        assert all(abs(e.logprob - v) < TOL for e, v in zip(entry.top_logprobs, values.tolist()))


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "top_p": 0.8, "seed": 3}])
def test_chat_logprobs_are_the_models_before_the_processors(server, reference, tok, sampling):
    _, url = server
    messages = [{"role": "user", "content": "the lazy dog"}]
    out = client(url).chat.completions.create(
        model=NAME,
        messages=messages,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
        **sampling,
    )
    prompt, new = out.prompt_token_ids, out.choices[0].token_ids
    content = out.choices[0].logprobs.content
    chat_values(content, plain(reference, prompt + new), new, len(prompt), 3, tok)
    # Streamed: the chunks' logprobs are the same entries, in order.
    chunks = list(
        client(url).chat.completions.create(
            model=NAME, messages=messages, max_tokens=8, logprobs=True, top_logprobs=3, stream=True, **sampling
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # the same prompt, now cached: within 1e-5
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=TOL)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content


def test_streamed_echo_sends_the_prompt_first(server, reference, tok):
    _, url = server
    prompt = "0123"
    ids = tok.encode(prompt, add_special_tokens=False).ids
    chunks = list(
        client(url).completions.create(
            model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
        )
    )
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    values = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert len(tokens) == len(ids) + 3
    full = client(url).completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert tokens == full.choices[0].logprobs.tokens
    assert values[1:] == full.choices[0].logprobs.token_logprobs[1:] and all(math.isfinite(v) for v in values[1:])
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
