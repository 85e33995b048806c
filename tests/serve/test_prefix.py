"""Issue 27 item 6: prefix caching. A request goes to the free row whose cached tokens share the
longest prefix with its prompt and only the rest is prefilled; what it returns is what
tfm.generate gives for the prompt alone. A row's slot overwritten while it was idle (the dummy key
of an eager step) is not reused. usage.prompt_tokens_details.cached_tokens and the metrics say
how many tokens were reused; with the cache off, none are."""

from __future__ import annotations

import torch

import torchformer as tfm
from tests.serve.conftest import NAME, client, httpx, make_engine
from tests.serve.test_engine import Collect, options
from torchformer.serve.prefix import MIN_REUSE


def generated(model, prompt, n) -> list[int]:
    return tfm.generate(model, torch.tensor([prompt]), max_new_tokens=n)[0, len(prompt) :].tolist()


def ask(engine, prompt, n) -> Collect:
    sink = Collect()
    engine.submit(prompt, options(n), sink)
    assert sink.ended.wait(120)  # the first step of a fresh process may build the native kernels
    return sink


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    """Random prompts with distinct first tokens (no prefix shared by chance)."""
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(10, 300, (n,), generator=g).tolist() for n in lengths]
    for i, p in enumerate(out):
        p[0] = 1 + i
    return out


def test_a_shared_prefix_is_reused_and_the_output_is_unchanged(tiny):
    engine = make_engine(tiny, slots=2)
    try:
        system, other = prompts([40, 6], seed=1)
        first = ask(engine, system + other, 8)  # row 0 now holds system + other + 7 new tokens
        assert first.end.cached_tokens == 0
        follow = system + [7, 8, 9]
        second = ask(engine, follow, 8)
        assert second.tokens == generated(tiny, follow, 8)
        assert second.end.cached_tokens == 40
        assert first.tokens == generated(tiny, system + other, 8)
        again = ask(engine, follow, 8)  # row 0 holds follow now: all but its last token is reused
        assert again.tokens == second.tokens and again.end.cached_tokens == len(follow) - 1
    finally:
        engine.stop()
    off = make_engine(tiny, slots=2, prefix_cache=False)
    try:
        ask(off, system + other, 2)
        assert ask(off, system + other, 2).end.cached_tokens == 0
    finally:
        off.stop()


def test_a_slot_written_while_the_row_was_idle_is_not_reused(tiny):
    """Rows 0 and 1 hold a 70- and a 75-token prompt; a short request reusing row 1's prefix runs
    alone in row 1, so each eager step writes row 0's dummy key at slot 64 (the step's hidden
    slot): the 70-token prompt asked again reuses 64 tokens, not 69, and still equals generate."""
    engine = make_engine(tiny, slots=2)
    try:
        long_a, long_b = prompts([70, 75], seed=2)
        sinks = [Collect(), Collect()]
        with engine.wake:  # admitted together: the shorter prompt takes row 0
            engine.submit(long_a, options(1), sinks[0])
            engine.submit(long_b, options(1), sinks[1])
        assert all(s.ended.wait(30) for s in sinks)
        short = long_b[:20] + [3, 4]
        assert ask(engine, short, 20).end.cached_tokens == 20  # in row 1; row 0 idle at slot 64
        again = ask(engine, long_a, 6)
        assert again.end.cached_tokens == 64
        assert again.tokens == generated(tiny, long_a, 6)
    finally:
        engine.stop()


def test_cached_tokens_in_usage_and_metrics(server, tiny):
    _, url = server
    (system,) = prompts([30], seed=3)
    before = httpx.get(f"{url}/metrics").text
    hits = [line for line in before.splitlines() if line.startswith("torchformer_serve_prefix_cache_hits_total")]
    client(url).completions.create(model=NAME, prompt=system + [5], max_tokens=3, temperature=0)
    out = client(url).completions.create(model=NAME, prompt=system + [6, 7], max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens_details.cached_tokens == 30
    ids = client(url).completions.create(
        model=NAME, prompt=system + [6, 7], max_tokens=3, temperature=0, extra_body={"return_token_ids": True}
    )
    assert ids.choices[0].token_ids == generated(tiny, system + [6, 7], 3)
    after = httpx.get(f"{url}/metrics").text
    now = [line for line in after.splitlines() if line.startswith("torchformer_serve_prefix_cache_hits_total")]
    assert float(now[0].split()[1]) - float(hits[0].split()[1]) >= 30 + 31


def test_a_short_shared_prefix_keeps_the_batched_prefill(tiny):
    """Under MIN_REUSE shared tokens (a chat template's opening) a request is prefilled with the
    others, whole."""
    engine = make_engine(tiny, slots=2)
    try:
        (opening,) = prompts([MIN_REUSE - 1], seed=4)
        ask(engine, opening + [20, 21], 2)
        again = ask(engine, opening + [22], 4)
        assert again.end.cached_tokens == 0 and again.tokens == generated(tiny, opening + [22], 4)
    finally:
        engine.stop()
