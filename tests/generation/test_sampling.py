"""Each logits processor on hand-made logits (issue 3, test 5), and the sampler's distribution."""

import math

import pytest
import torch

from torchformer.generation import sampling as S

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(row > NEG).flatten().tolist() for row in logits]


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([[1.0, 5.0, 3.0, 5.0, 2.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    out = S.top_k(logits, 2)
    assert kept(out)[0] == [1, 3]
    assert [len(r) for r in kept(out)] == [2, 2]
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])  # survivors are untouched
    assert torch.equal(S.top_k(logits, 5), logits)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.05, 0.3, 0.15]])
    logits = probs.log()
    assert kept(S.top_p(logits, 0.5)) == [[0]]  # 0.5 alone reaches 0.5
    assert kept(S.top_p(logits, 0.51)) == [[0, 2]]  # 0.5 < 0.51 <= 0.8
    assert kept(S.top_p(logits, 0.8)) == [[0, 2]]
    assert kept(S.top_p(logits, 0.81)) == [[0, 2, 3]]
    assert kept(S.top_p(logits, 0.01)) == [[0]]  # the top token always survives
    assert kept(S.top_p(logits, 1.0)) == [[0, 1, 2, 3]]


def test_min_p_scales_with_the_top_probability():
    probs = torch.tensor([[0.6, 0.2, 0.13, 0.07], [0.25, 0.25, 0.25, 0.25]])
    out = S.min_p(probs.log(), 0.2)  # threshold 0.12 in row 0, 0.05 in row 1
    assert kept(out) == [[0, 1, 2], [0, 1, 2, 3]]


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 4.0, -1.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = S.repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [[1.0, -4.0, 4.0, -1.0]]


def test_ngram_block_bans_completions_of_seen_ngrams():
    # Sequence 5 6 7 5 6: the bigram prefix "6" was followed by 7, the trigram prefix "5 6" by 7.
    tokens = torch.tensor([[5, 6, 7, 5, 6], [1, 2, 3, 4, 2]])
    valid = torch.ones_like(tokens, dtype=torch.bool)
    logits = torch.zeros(2, 10)
    assert kept(S.block_repeated_ngrams(logits, tokens, valid, 2))[0] == [i for i in range(10) if i != 7]
    assert kept(S.block_repeated_ngrams(logits, tokens, valid, 3))[0] == [i for i in range(10) if i != 7]
    assert kept(S.block_repeated_ngrams(logits, tokens, valid, 2))[1] == [i for i in range(10) if i != 3]
    assert kept(S.block_repeated_ngrams(logits, tokens, valid, 3))[1] == list(range(10))
    # n = 1 bans every token already present.
    assert kept(S.block_repeated_ngrams(logits, tokens, valid, 1))[1] == [0, 5, 6, 7, 8, 9]


def test_ngram_block_ignores_left_padding():
    tokens = torch.tensor([[6, 7, 3, 6]])  # "6 7" lies half in padding: nothing to block
    valid = torch.tensor([[False, True, True, True]])
    assert kept(S.block_repeated_ngrams(torch.zeros(1, 9), tokens, valid, 2)) == [list(range(9))]
    assert kept(S.block_repeated_ngrams(torch.zeros(1, 9), tokens, torch.ones_like(valid), 2)) == [
        [i for i in range(9) if i != 7]
    ]


def test_process_applies_the_documented_order():
    # Temperature before top-p: at T=0.5 the top token's mass 0.6 becomes ~0.69, enough for p=0.65.
    probs = torch.tensor([[0.6, 0.3, 0.1]])
    s = S.Sampling(temperature=0.5, top_p=0.65)
    assert kept(S.process(probs.log(), s, seen=None, tokens=None, valid=None)) == [[0]]
    s = S.Sampling(temperature=1.0, top_p=0.65)
    assert kept(S.process(probs.log(), s, seen=None, tokens=None, valid=None)) == [[0, 1]]
    # Repetition penalty acts on raw scores before anything else.
    s = S.Sampling(temperature=0.0, repetition_penalty=4.0)
    logits = torch.tensor([[2.0, 1.0]])
    out = S.process(logits, s, seen=torch.tensor([[True, False]]), tokens=None, valid=None)
    assert S.argmax(out).tolist() == [1]


def test_sample_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, -1)
    draws = S.sample(logits, torch.Generator().manual_seed(0))
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, probs, atol=0.015)
    filtered = S.sample(S.top_k(logits, 2), torch.Generator().manual_seed(1))
    assert set(filtered.tolist()) == {0, 1}


@pytest.mark.parametrize("t", [0.5, 2.0])
def test_temperature_scales_logits(t):
    logits = torch.tensor([[1.0, -3.0, math.pi]])
    assert torch.equal(S.temperature(logits, t), logits / t)


@pytest.mark.parametrize(
    "options",
    [{"temperature": 1e-4}, {"temperature": 1.0, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6},
     {"temperature": 1.0, "min_p": 0.999}],
)  # fmt: skip
def test_generate_applies_temperature_and_the_filters_without_a_history(options):
    """Each of these keeps only the argmax, so sampling must give the greedy tokens; the control,
    plain temperature 3, samples others (a run that ignored the processors sampled the raw softmax
    and passed the control only)."""
    import torchformer as tfm

    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=64, n_layers=2, max_seq_len=64)
    torch.manual_seed(0)
    net = tfm.build_model(cfg).eval()
    ids = torch.randint(0, 97, (4, 5), generator=torch.Generator().manual_seed(1))
    greedy = tfm.generate(net, ids, max_new_tokens=16)
    assert torch.equal(tfm.generate(net, ids, max_new_tokens=16, seed=7, **options), greedy)
    assert not torch.equal(tfm.generate(net, ids, max_new_tokens=16, seed=7, temperature=3.0), greedy)
