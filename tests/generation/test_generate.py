"""generate / stream over the static cache: equal to full recomputation across the variant grid,
left-padded batches equal to single prompts, streaming, seeding and EOS (issue 3, tests 1-3)."""

import pytest
import torch

import torchformer as tfm
from tests import grid
from tests.decoding import assert_varied, varied_case
from tests.grid import build, params, variants
from torchformer.generation.generate import decode
from torchformer.generation.request import make_request, sampling_options

GRID = variants(("decoder", "encoder_decoder"))
START = 1  # decoder start token for the grid's encoder-decoders


def greedy_by_recomputation(model, ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The obvious reference: rerun the whole sequence for every new token, no cache."""
    seq2seq = isinstance(model, tfm.EncoderDecoder)
    seq = torch.full((ids.shape[0], 1), START) if seq2seq else ids
    all_logits = []
    with torch.no_grad():
        for _ in range(n):
            logits = (model(ids, seq) if seq2seq else model(seq))[:, -1]
            all_logits.append(logits)
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(all_logits, dim=1)


def cached_steps(model, ids, n, mask=None, **sampling) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens (B, N) and the logits each was chosen from (B, N, V), through the cached loop."""
    req = make_request(
        model, ids, max_new_tokens=n, attention_mask=mask, eos_token_id=None, decoder_start_token_id=START
    )
    options = {"temperature": 0.0, "top_k": None, "top_p": None, "min_p": None, "repetition_penalty": 1.0}
    s = sampling_options(**{**options, **sampling, "no_repeat_ngram_size": 0})
    out = list(decode(model, req, s, None, False, scores=True))
    return torch.stack([t for t, _ in out], 1), torch.stack([lg for _, lg in out], 1)


@pytest.mark.parametrize("v", **params(GRID))
def test_cached_greedy_equals_recomputation(v):
    model = build(v, init_std=0.1)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    expected, expected_logits = greedy_by_recomputation(model, ids, 6)
    out = tfm.generate(model, ids, max_new_tokens=6, decoder_start_token_id=START)
    assert torch.equal(out, expected)
    _, logits = cached_steps(model, ids, 6)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [3, 5])
def test_cached_greedy_equals_recomputation_with_sliding_window(window):
    v = next(v for v in GRID if v["arch"] == "decoder" and v["position"] == "rope-half")
    model = build(v, init_std=0.1, attention={"sliding_window": window})
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    expected, _ = greedy_by_recomputation(model, ids, 8)
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=8), expected)


LENGTHS = (3, 8, 12, 17)


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return ids, mask


@pytest.mark.parametrize("v", **params([v for v in GRID if v["arch"] == "decoder"]))
def test_left_padded_batch_equals_each_prompt_alone(v):
    model = build(v, init_std=0.1)
    prompts = [torch.randint(1, model.config.vocab_size, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts)
    tokens, logits = cached_steps(model, ids, 5, mask)
    for i, prompt in enumerate(prompts):
        alone_tokens, alone_logits = cached_steps(model, prompt[None], 5)
        assert torch.equal(tokens[i], alone_tokens[0])
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-5, rtol=0)
    batched = tfm.generate(model, ids, attention_mask=mask, max_new_tokens=5)
    assert torch.equal(batched[:, ids.shape[1] :], tokens)


@pytest.mark.parametrize("v", **params([v for v in GRID if v["arch"] == "encoder_decoder"][:6]))
def test_padded_sources_equal_each_source_alone(v):
    model = build(v, init_std=0.1)
    sources = [torch.randint(1, model.config.vocab_size, (n,)) for n in LENGTHS]
    ids, mask = left_padded(sources)
    # The encoder counts positions from the first column, so sources are padded on the right.
    ids = torch.stack([torch.roll(r, -int((m == 0).sum())) for r, m in zip(ids, mask)])
    mask = torch.stack([torch.roll(m, -int((m == 0).sum())) for m in mask])
    tokens, logits = cached_steps(model, ids, 5, mask)
    for i, source in enumerate(sources):
        alone_tokens, alone_logits = cached_steps(model, source[None], 5)
        assert torch.equal(tokens[i], alone_tokens[0])
        torch.testing.assert_close(logits[i], alone_logits[0], atol=1e-5, rtol=0)


def tiny(arch: str = "decoder") -> torch.nn.Module:
    v = next(v for v in GRID if v["arch"] == arch)
    return build(v, init_std=0.1)


SAMPLING = {"temperature": 0.9, "top_k": 20, "top_p": 0.95, "min_p": 0.01, "repetition_penalty": 1.2}


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("options", [{}, SAMPLING, {**SAMPLING, "no_repeat_ngram_size": 2}])
def test_stream_concatenated_equals_generate(arch, options):
    model = tiny(arch)
    ids = torch.randint(0, model.config.vocab_size, (3, 5))
    kw = {"max_new_tokens": 7, "seed": 3, "decoder_start_token_id": START, **options}
    streamed = list(tfm.stream(model, ids, **kw))
    assert all(t.shape == (3,) for t in streamed)
    out = tfm.generate(model, ids, **kw)
    assert torch.equal(out[:, -7:], torch.stack(streamed, 1))


def test_seeds_reproduce_and_differ_without_touching_the_global_rng():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (4, 5))
    state = torch.get_rng_state()
    a = tfm.generate(model, ids, max_new_tokens=12, temperature=1.0, seed=1)
    b = tfm.generate(model, ids, max_new_tokens=12, temperature=1.0, seed=1)
    c = tfm.generate(model, ids, max_new_tokens=12, temperature=1.0, seed=2)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_no_repeat_ngram_prevents_repeats():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    out = tfm.generate(model, ids, max_new_tokens=30, no_repeat_ngram_size=2)
    for row in out.tolist():
        bigrams = list(zip(row, row[1:]))
        assert len(bigrams) == len(set(bigrams))


def first_new(row: list[int], start: int, avoid: list[int]) -> int:
    """The first index >= start whose token is new in ``row`` and not in ``avoid``."""
    return next(i for i in range(start, len(row)) if row[i] not in row[:i] and row[i] not in avoid)


def test_eos_stops_rows_and_pads_them():
    v = next(v for v in GRID if v["arch"] == "decoder" and v["placement"] == "pre" and v["position"] == "rope-half")
    candidates = torch.randint(1, grid.VOCAB, (32, 5), generator=torch.Generator().manual_seed(0))
    model, ids = varied_case(lambda s: build(v, seed=s, init_std=0.5), candidates, 10, 6, rows=2)
    free = tfm.generate(model, ids, max_new_tokens=10)[:, 5:]
    assert_varied(free, 6)
    row0, row1 = free.tolist()
    pad = 96  # a pad id no EOS here is
    # Row 0 stops at its 3rd-or-later token, an id row 1 never makes: row 1 runs all 10 steps.
    stop0 = first_new(row0, 2, row1 + [pad])
    out = tfm.generate(model, ids, max_new_tokens=10, eos_token_id=[row0[stop0]], pad_token_id=pad)[:, 5:]
    assert out.shape == (2, 10) and out[1].tolist() == row1
    assert out[0, : stop0 + 1].tolist() == row0[: stop0 + 1]
    assert out[0, stop0 + 1 :].tolist() == [pad] * (9 - stop0) and stop0 < 9  # padded, and not vacuously
    # Two EOS ids, row 1's later: both rows stop, generation ends at row 1's EOS, row 0 padded to it.
    stop1 = first_new(row1, stop0 + 1, row0[: stop0 + 1] + [pad])
    assert row1[stop1] not in row0[:stop0] and row0[stop0] not in row1[:stop1]
    out = tfm.generate(model, ids, max_new_tokens=10, eos_token_id=[row0[stop0], row1[stop1]], pad_token_id=pad)
    out = out[:, 5:]
    assert out.shape == (2, stop1 + 1) and out[1].tolist() == row1[: stop1 + 1]
    assert out[0].tolist() == row0[: stop0 + 1] + [pad] * (stop1 - stop0)


def test_all_rows_finished_stops_early():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    first = int(tfm.generate(model, ids, max_new_tokens=1)[0, -1])
    assert tfm.generate(model, ids, max_new_tokens=10, eos_token_id=first).shape == (1, 6)


def test_encoder_decoder_output_starts_with_the_config_start_token():
    model = tiny("encoder_decoder")
    model.config = model.config.replace(decoder_start_token_id=5)
    out = tfm.generate(model, torch.randint(0, 90, (2, 6)), max_new_tokens=3)
    assert out.shape == (2, 4) and out[:, 0].tolist() == [5, 5]


def test_outputs_are_ordinary_tensors_usable_with_autograd():
    model = tiny()
    ids = torch.randint(0, model.config.vocab_size, (2, 4))
    out = tfm.generate(model, ids, max_new_tokens=3)
    beams = tfm.beam_search(model, ids, beam_size=2, max_new_tokens=3)
    assert not out.is_inference() and not beams.sequences.is_inference()
    model(out).sum().backward()  # an inference tensor here would fail: "cannot be saved for backward"


def test_training_mode_warns():
    model = tiny().train()
    with pytest.warns(UserWarning, match="model.eval"):
        tfm.generate(model, torch.tensor([[1, 2]]), max_new_tokens=1)


def test_history_processors_ignore_left_padding():
    model = tiny()
    prompts = [torch.randint(1, model.config.vocab_size, (n,)) for n in LENGTHS]
    ids, mask = left_padded(prompts, pad=int(prompts[0][0]))  # the pad id is also a real token
    kw = {"max_new_tokens": 8, "repetition_penalty": 1.5, "no_repeat_ngram_size": 2}
    batched = tfm.generate(model, ids, attention_mask=mask, **kw)[:, ids.shape[1] :]
    for i, prompt in enumerate(prompts):
        assert torch.equal(batched[i], tfm.generate(model, prompt[None], **kw)[0, len(prompt) :])
