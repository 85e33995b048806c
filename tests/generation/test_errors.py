"""Bad input is a ValueError / TypeError naming the argument, before any tensor work (issue 3,
test 7)."""

import pytest
import torch

import torchformer as tfm
from tests.grid import build, variants

DECODER = next(v for v in variants(("decoder", "encoder_decoder")) if v["arch"] == "decoder")
SEQ2SEQ = next(v for v in variants(("decoder", "encoder_decoder")) if v["arch"] == "encoder_decoder")
IDS = torch.tensor([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize("fn", [tfm.generate, tfm.stream])
@pytest.mark.parametrize(
    "kw, match",
    [
        ({"max_new_tokens": 0}, r"max_new_tokens=0"),
        ({"max_new_tokens": 2.5}, r"max_new_tokens=2.5"),
        ({"temperature": -0.1}, r"temperature=-0.1"),
        ({"top_p": 0.0}, r"top_p=0.0.*\(0, 1\]"),
        ({"top_p": 1.5}, r"top_p=1.5"),
        ({"top_k": 0}, r"top_k=0"),
        ({"min_p": 2.0}, r"min_p=2.0"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0"),
        ({"no_repeat_ngram_size": -1}, r"no_repeat_ngram_size=-1"),
        ({"eos_token_id": 1000}, r"eos_token_id=1000.*vocab_size"),
        ({"seed": -3}, r"seed=-3"),
        ({"max_new_tokens": 62}, r"prompt length 3 \+ max_new_tokens=62 = 65 exceeds max_seq_len=64"),
        ({"attention_mask": torch.ones(2, 4)}, r"attention_mask has shape \(2, 4\).*input_ids has shape \(2, 3\)"),
        ({"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])}, r"attention_mask must be left-padded"),
        ({"attention_mask": torch.tensor([[0, 0, 0], [1, 1, 1]])}, r"attention_mask has a row with no real token"),
    ],
)
def test_bad_arguments_name_themselves(fn, kw, match):
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(ValueError, match=match):
        fn(build(DECODER), IDS, **kw)  # stream raises on the call, not at the first next()


def test_bad_prompts():
    model = build(DECODER)
    with pytest.raises(ValueError, match="input_ids is empty"):
        tfm.generate(model, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    with pytest.raises(TypeError, match="input_ids must hold integer"):
        tfm.generate(model, torch.zeros(1, 3), max_new_tokens=2)
    with pytest.raises(ValueError, match="input_ids holds ids in"):
        tfm.generate(model, torch.tensor([[1, 500]]), max_new_tokens=2)
    with pytest.raises(TypeError, match="DecoderLM or an EncoderDecoder"):
        tfm.generate(tfm.build_model(tfm.presets.get("llama-tiny").replace(arch="encoder")), IDS, max_new_tokens=2)


def test_encoder_decoder_needs_a_start_token():
    model = build(SEQ2SEQ)
    assert model.config.decoder_start_token_id is None
    with pytest.raises(ValueError, match="decoder_start_token_id=None"):
        tfm.generate(model, IDS, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"decoder start token \+ max_new_tokens=64 = 65 exceeds max_seq_len=64"):
        tfm.generate(model, IDS, max_new_tokens=64, decoder_start_token_id=1)
    assert tfm.generate(model, IDS, max_new_tokens=63, decoder_start_token_id=1).shape == (2, 64)
