"""Speculative decoding (issue 13): greedy with a random draft, a perfect draft (the target itself)
and prompt lookup equals plain greedy over the decoder grid; the sampled first new token follows
the target's processed softmax (total variation < 0.02 over 20,000 draws); bad arguments are
clear errors."""

import pytest
import torch

import torchformer as tfm
from tests import grid
from tests.decoding import assert_varied, varied_case
from tests.grid import build, params, variants
from torchformer.generation.request import Request
from torchformer.generation.sampling import Sampling, process, sample
from torchformer.generation.speculative import LookupProposer, verify

DECODERS = variants(("decoder",))


def spec_stream(model, ids, **kw):
    st = tfm.stream(model, ids, **kw)
    return torch.stack(list(st), 1), st.acceptance


@pytest.mark.parametrize("v", **params(DECODERS))
def test_greedy_equals_plain_greedy_on_varied_continuations(v):
    g = torch.Generator().manual_seed(3)
    candidates = torch.randint(1, grid.VOCAB, (32, 9), generator=g)
    candidates[:, 5:] = candidates[:, :4]  # a repeat, so prompt lookup finds n-grams
    n = 24
    # init 0.5 and the most varied of 32 prompts: at 0.1, 19 of the 48 rows repeated one token 24 times.
    seeds = [(seed, std) for std in (0.5, 1.0) for seed in range(3)]
    model, ids = varied_case(lambda s: build(v, seed=s[0], init_std=s[1]), candidates, n, 8, seeds)
    draft = build(v, seed=7, init_std=model.config.init_std, n_layers=1)  # a random, mostly wrong draft
    plain = tfm.generate(model, ids, max_new_tokens=n)[:, 9:]
    assert_varied(plain, 8)  # the hardest row (post-norm, sinusoidal, MQA) reaches 8 of 24
    new, acc = spec_stream(model, ids, max_new_tokens=n, draft_model=draft, num_draft_tokens=3)
    assert torch.equal(new, plain) and acc.proposed > 0
    new, acc = spec_stream(model, ids, max_new_tokens=n, draft_model=model, num_draft_tokens=4)
    assert torch.equal(new, plain)
    assert acc.rate == 1.0 and acc.rounds == -(-n // 5)  # k + 1 = 5 tokens per round
    for k in (1, 4):
        new, _ = spec_stream(model, ids, max_new_tokens=n, prompt_lookup_num_tokens=k)
        assert torch.equal(new, plain)


def test_edges_prompt_of_one_padding_eos_and_the_end_of_the_table():
    v = DECODERS[0]
    model, draft = build(v, init_std=0.1), build(v, seed=7, init_std=0.1, n_layers=1)
    one = torch.tensor([[5]])
    assert torch.equal(
        tfm.generate(model, one, max_new_tokens=10, draft_model=draft), tfm.generate(model, one, max_new_tokens=10)
    )
    ids, mask = torch.tensor([[0, 0, 4, 8, 15]]), torch.tensor([[0, 0, 1, 1, 1]])
    padded = tfm.generate(model, ids, attention_mask=mask, max_new_tokens=8, prompt_lookup_num_tokens=2)
    assert torch.equal(padded[:, 2:], tfm.generate(model, ids[:, 2:], max_new_tokens=8))
    # max_seq_len 64: verify chunks run past the table in the last rounds (clamped, then cut).
    long = torch.randint(1, 97, (1, 40))
    plain = tfm.generate(model, long, max_new_tokens=24)
    assert torch.equal(tfm.generate(model, long, max_new_tokens=24, draft_model=model, num_draft_tokens=6), plain)
    eos = int(plain[0, 45])
    stop = tfm.generate(model, long, max_new_tokens=24, eos_token_id=eos)
    got = tfm.generate(model, long, max_new_tokens=24, eos_token_id=eos, draft_model=draft, num_draft_tokens=3)
    assert torch.equal(got, stop) and got.shape[1] <= 46


def tv(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    return 0.5 * (counts / counts.sum() - probs.double()).abs().sum().item()


@pytest.mark.parametrize("options", [Sampling(1.0), Sampling(0.7, top_k=5), Sampling(1.3, top_p=0.9)])
@pytest.mark.parametrize("lookup", [False, True])
def test_sampled_first_token_follows_the_target_distribution(options, lookup):
    """20,000 rounds at once through ``verify`` (the acceptance rule the decode loop runs), with
    the real p and q of a tiny target and draft (vocab 8) for one prompt."""
    v = dict(DECODERS[0])
    target = build(v, init_std=0.3, vocab_size=8)
    draft = build(v, seed=9, init_std=0.3, vocab_size=8, n_layers=1)
    ids = torch.tensor([[1, 5, 2, 7, 3]])
    with torch.no_grad():
        p1 = target(ids)[:, -1]  # (1, 8): the target's logits for the first new token
        q1 = process(draft(ids)[:, -1], options, seen=None, tokens=None, valid=None).softmax(-1)
    R, k = 20_000, 2
    g = torch.Generator().manual_seed(0)
    if lookup:  # a point-mass guess, as prompt lookup makes
        cand, q = p1.argmax(-1).expand(R, k).contiguous(), None  # a token every filter keeps
    else:
        cand = torch.stack([sample(q1.log().expand(R, -1), g) for _ in range(k)], 1)  # (R, k) ~ q1
        q = q1.expand(R, k, -1)
    accepted, nxt = verify(cand, q, p1[:, None].expand(R, k + 1, -1), options, g)
    first = torch.where(accepted > 0, cand[:, 0], nxt)
    target_probs = process(p1, options, seen=None, tokens=None, valid=None).softmax(-1)[0]
    assert tv(first, target_probs) < 0.02
    assert 0 < (accepted > 0).float().mean() < 1  # both branches (accept, resample) were taken


def test_sampled_generate_end_to_end_follows_the_target():
    """The whole loop, 1,500 calls: the first new token's frequencies against the softmax."""
    v = dict(DECODERS[0])
    target = build(v, init_std=0.3, vocab_size=8, n_layers=1)
    draft = build(v, seed=9, init_std=0.3, vocab_size=8, n_layers=1)
    ids = torch.tensor([[1, 5, 2, 7]])
    firsts = [
        int(
            tfm.generate(target, ids, max_new_tokens=2, temperature=1.0, seed=s, draft_model=draft, num_draft_tokens=2)[
                0, 4
            ]
        )
        for s in range(1500)
    ]
    with torch.no_grad():
        probs = target(ids)[0, -1].softmax(-1)
    assert tv(torch.tensor(firsts), probs) < 0.06  # ~3x the sampling noise at 1,500 draws


def test_lookup_copies_what_followed_the_last_matching_ngram():
    seq = torch.tensor([[1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3, 0]])
    cand, q = LookupProposer(3).propose(seq, 13)  # trailing 3-gram (1, 2, 3): latest earlier match at 5
    assert cand.tolist() == [[4, 5, 1]] and q is None
    cand, _ = LookupProposer(2).propose(torch.tensor([[7, 8, 6]]), 3)  # no match: repeat the last token
    assert cand.tolist() == [[6, 6]]


def test_verify_greedy_counts_leading_matches_only():
    logits = torch.full((1, 4, 5), -1.0)
    for i, t in enumerate([2, 3, 1, 4]):
        logits[0, i, t] = 1.0
    accepted, nxt = verify(torch.tensor([[2, 3, 0]]), None, logits, Sampling(), None)
    assert accepted.tolist() == [2] and nxt.tolist() == [1]
    accepted, nxt = verify(torch.tensor([[2, 3, 1]]), None, logits, Sampling(), None)
    assert accepted.tolist() == [3] and nxt.tolist() == [4]
    assert Request is not None


def test_bad_arguments_are_clear_errors():
    v = DECODERS[0]
    model = build(v)
    ids = torch.tensor([[1, 2, 3]])
    cases = [
        (
            dict(draft_model=build(v, vocab_size=50)),
            ValueError,
            r"draft_model has vocab_size=50 but the target has vocab_size=97",
        ),
        (
            dict(draft_model=model, num_draft_tokens=0),
            ValueError,
            r"num_draft_tokens=0: must be None or an integer >= 1",
        ),
        (dict(prompt_lookup_num_tokens=0), ValueError, r"prompt_lookup_num_tokens=0: must be None or an integer >= 1"),
        (dict(num_draft_tokens=3), ValueError, r"num_draft_tokens=3 needs draft_model"),
        (dict(draft_model=model, prompt_lookup_num_tokens=2), ValueError, r"pass one of them"),
        (dict(draft_model=torch.nn.Linear(2, 2)), TypeError, r"draft_model must be a DecoderLM, got Linear"),
        (dict(draft_model=model, repetition_penalty=1.2), ValueError, r"repetition_penalty=1.2"),
        (
            dict(draft_model=build(v, max_seq_len=2)),
            ValueError,
            r"draft_model max_seq_len=2 is shorter than the prompt",
        ),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            tfm.generate(model, ids, max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match=r"input_ids has batch 2, must be 1"):
        tfm.generate(model, ids.repeat(2, 1), max_new_tokens=4, prompt_lookup_num_tokens=2)
    s2s = build(variants(("encoder_decoder",))[0])
    with pytest.raises(ValueError, match=r"needs a DecoderLM target; model is an EncoderDecoder"):
        tfm.generate(s2s, ids, max_new_tokens=4, draft_model=model, decoder_start_token_id=0)


def test_the_verify_chunk_runs_over_packed_weights_from_three_rows(monkeypatch):
    from torchformer.fast import panels as packed

    model = build(DECODERS[0], init_std=0.1)
    modules = list(model.modules())
    calls, real = [], packed.pack
    monkeypatch.setattr(packed, "pack", lambda m: (calls.append(m), real(m))[1])
    ids = torch.tensor([[3, 8, 5, 3, 8, 5, 3]])
    plain = tfm.generate(model, ids, max_new_tokens=12)
    assert calls == []  # batch 1: one-row products, no packed copy
    for k, packs in ((1, 0), (2, 1), (4, 1)):  # k + 1 rows per verify chunk
        calls.clear()
        assert torch.equal(tfm.generate(model, ids, max_new_tokens=12, prompt_lookup_num_tokens=k), plain)
        assert calls == [model] * packs, f"k={k}"
    assert list(model.modules()) == modules, "the twins and their copies go when generation ends"
