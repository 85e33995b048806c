"""Beam search (issue 3, test 4): beam 1 == greedy; on a hand-built model whose scores are known,
beam search finds the best sequence greedy misses; EOS retires beams; length penalty."""

import math

import pytest
import torch

import torchformer as tfm
from tests import grid
from tests.decoding import assert_varied, varied_case
from tests.grid import build, params, variants

START, A, B, C, EOS, D = range(6)
# P(next | last token) of a first-order Markov "language model"; the rest of each row is ~0.
TRANSITIONS = {
    START: {A: 0.6, B: 0.4},
    A: {C: 0.55, D: 0.45},
    B: {EOS: 0.95, C: 0.05},
    C: {EOS: 1.0},
    D: {EOS: 1.0},
    EOS: {EOS: 1.0},
}


def markov_model() -> tfm.DecoderLM:
    """A real DecoderLM whose logits are log P(next | last token), exactly: attention and MLP
    write zeros, the embedding is a scaled one-hot, the final RMSNorm maps it to sqrt(D) * e_i and
    the head's column i holds the log-probabilities / sqrt(D)."""
    V, Dm = 6, 8
    cfg = tfm.ModelConfig(
        arch="decoder",
        vocab_size=V,
        d_model=Dm,
        n_layers=1,
        max_seq_len=16,
        attention=tfm.AttentionConfig(n_heads=1),
        block=tfm.BlockConfig(norm="rmsnorm", norm_eps=1e-9, mlp="relu"),
        positions=None,
        tie_embeddings=False,
    )
    model = tfm.build_model(cfg).eval()
    logp = torch.full((V, V), math.log(1e-9))
    for prev, nxt in TRANSITIONS.items():
        for tok, p in nxt.items():
            logp[prev, tok] = math.log(p)
    with torch.no_grad():
        model.stack.blocks[0].attn.o_proj.weight.zero_()
        model.stack.blocks[0].mlp.down.weight.zero_()
        model.embed.tok.weight.copy_(10 * torch.eye(V, Dm))
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :V] = logp.T / math.sqrt(Dm)
    return model


PROMPT = torch.tensor([[START]])


def test_markov_model_has_the_intended_logits():
    logits = markov_model()(torch.tensor([[START, A, B]]))[0].log_softmax(-1).exp()
    assert logits[0, A].item() == pytest.approx(0.6, abs=1e-5)
    assert logits[1, C].item() == pytest.approx(0.55, abs=1e-5)
    assert logits[2, EOS].item() == pytest.approx(0.95, abs=1e-5)


def test_beam_finds_the_sequence_greedy_misses():
    model = markov_model()
    greedy = tfm.generate(model, PROMPT, max_new_tokens=5, eos_token_id=EOS)
    assert greedy[0, 1:].tolist() == [A, C, EOS]  # 0.6 * 0.55 = 0.33
    out = tfm.beam_search(model, PROMPT, beam_size=2, max_new_tokens=5, eos_token_id=EOS, length_penalty=0.0)
    assert out.sequences[0, 0].tolist() == [START, B, EOS]  # 0.4 * 0.95 = 0.38
    assert out.scores[0, 0].item() == pytest.approx(math.log(0.38), abs=1e-4)


def test_length_penalty_favours_longer_hypotheses():
    # log(0.38) / 2 = -0.484 < log(0.33) / 3 = -0.370: with alpha = 1 the three-token answer wins.
    model = markov_model()
    out = tfm.beam_search(model, PROMPT, beam_size=2, max_new_tokens=5, eos_token_id=EOS, length_penalty=1.0)
    assert out.sequences[0, 0].tolist() == [START, A, C, EOS]
    assert out.scores[0, 0].item() == pytest.approx(math.log(0.33) / 3, abs=1e-4)


def test_n_best_is_ordered_and_padded_after_eos():
    model = markov_model()
    out = tfm.beam_search(
        model, PROMPT, beam_size=3, max_new_tokens=5, eos_token_id=EOS, length_penalty=0.0, n_best=3, pad_token_id=5
    )
    assert out.sequences[0].tolist() == [[START, B, EOS, 5], [START, A, C, EOS], [START, A, D, EOS]]
    expected = [math.log(0.38), math.log(0.33), math.log(0.27)]
    assert out.scores[0].tolist() == pytest.approx(expected, abs=1e-4)


def test_without_eos_the_open_beams_compete_at_max_length():
    model = markov_model()
    out = tfm.beam_search(model, PROMPT, beam_size=2, max_new_tokens=2, length_penalty=0.0, n_best=2)
    assert out.sequences[0].tolist() == [[START, B, EOS], [START, A, C]]


def test_batch_rows_are_searched_independently():
    model = markov_model()
    batch = tfm.beam_search(model, torch.tensor([[START], [B]]), beam_size=2, max_new_tokens=4, eos_token_id=EOS)
    alone = tfm.beam_search(model, torch.tensor([[B]]), beam_size=2, max_new_tokens=4, eos_token_id=EOS)
    assert batch.sequences[1, 0, : alone.sequences.shape[-1]].tolist() == alone.sequences[0, 0].tolist()
    assert batch.sequences[0, 0, :3].tolist() == [START, A, C]  # length_penalty 1.0 by default


GRID = variants(("decoder", "encoder_decoder"))


@pytest.mark.parametrize("v", **params(GRID[::3]))
def test_beam_size_one_equals_greedy_on_varied_continuations(v):
    # init 0.5 and the 2 most varied of 32 prompts: at 0.1, 9 of the 16 rows were one token repeated.
    candidates = torch.randint(0, grid.VOCAB, (32, 5), generator=torch.Generator().manual_seed(0))
    model, ids = varied_case(lambda s: build(v, seed=s, init_std=0.5), candidates, 12, 6, rows=2,
                             decoder_start_token_id=1)  # fmt: skip
    greedy = tfm.generate(model, ids, max_new_tokens=12, decoder_start_token_id=1)
    assert_varied(greedy[:, -12:], 6)
    beams = tfm.beam_search(model, ids, beam_size=1, max_new_tokens=12, decoder_start_token_id=1)
    assert torch.equal(beams.sequences[:, 0], greedy)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"beam_size": 0}, "beam_size"),
        ({"beam_size": 2, "n_best": 3}, "n_best"),
        ({"beam_size": 2, "length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_bad_beam_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        tfm.beam_search(markov_model(), PROMPT, max_new_tokens=3, **kw)


@pytest.mark.parametrize("length_penalty, forwards", [(0.0, 2), (1.0, 3)])
def test_search_stops_once_no_open_beam_can_win(length_penalty, forwards):
    # alpha 0: after "B EOS" (0.38) no open beam (best 0.33) can win -> prefill + 1 step.
    # alpha 1: an open beam could still reach log(0.33) / 10 > log(0.38) / 2, so one more step
    # is needed; after it every open beam went through a ~1e-9 token and cannot win.
    model = markov_model()
    calls = []
    forward = model.stack.forward  # every forward (prefill or step) runs the block stack once
    model.stack.forward = lambda *a: calls.append(1) or forward(*a)
    tfm.beam_search(model, PROMPT, beam_size=2, max_new_tokens=10, eos_token_id=EOS, length_penalty=length_penalty)
    assert len(calls) == forwards
