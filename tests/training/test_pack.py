"""Packed sequences: each document in a packed row gets the loss (and logits) it gets alone
(within 1e-5), changing one document changes no other document's logits (exactly 0.0), for every
backend and the position schemes that restart per document; data.pack builds such batches from
whole documents and trains; data.pack with seq2seq is a clear error."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from torchformer.nn import flex
from torchformer.training import recipe as recipes
from torchformer.training.batches import IGNORE, PackedLMBatches
from torchformer.training.data import prepare
from torchformer.training.losses import CausalLM
from torchformer.training.train import train

from .. import grid
from .tiny import tiny_recipe

LENGTHS = [5, 9, 1, 7, 10]  # one packed row of 32 tokens


@pytest.fixture(autouse=True)
def _eager_flex():
    with flex.eager():
        yield


def packed_row(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, grid.VOCAB, (1, sum(LENGTHS)), generator=g)
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])[None]
    return ids, docs


@pytest.mark.parametrize("backend", ["math", "sdpa", "flex", "auto"])
@pytest.mark.parametrize("position", ["rope-half", "learned", "sinusoidal", "alibi"])
@torch.no_grad()
def test_each_packed_document_equals_the_document_alone(backend, position):
    model = grid.build(dict(grid.variants(("decoder",))[0], position=position, backend=backend))
    ids, docs = packed_row()
    logits = model(ids, document_ids=docs)
    labels = torch.roll(ids, -1, dims=1)
    start = 0
    for n in LENGTHS:
        alone = model(ids[:, start : start + n])
        assert (logits[:, start : start + n] - alone).abs().max().item() < 1e-5
        if n > 1:
            packed_loss = F.cross_entropy(logits[0, start : start + n - 1], labels[0, start : start + n - 1])
            alone_loss = F.cross_entropy(alone[0, :-1], labels[0, start : start + n - 1])
            assert abs(packed_loss.item() - alone_loss.item()) < 1e-5
        start += n
    # Changing document 1 changes no other document's logits, not even by rounding.
    changed = ids.clone()
    changed[0, 5:14] = (changed[0, 5:14] + 1) % grid.VOCAB
    other = model(changed, document_ids=docs)
    keep = docs[0] != 1
    assert (other - logits)[0, keep].abs().max().item() == 0.0
    assert (other - logits)[0, ~keep].abs().max().item() > 1e-4


def write_docs(path, n: int = 40):
    lines = [json.dumps({"text": f"doc {i}: " + "abcdefgh"[i % 8] * (3 + i % 11)}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n")


def test_pack_builds_batches_of_whole_documents_with_ids_and_trains(tmp_path, monkeypatch):
    write_docs(tmp_path / "docs.jsonl")
    recipe = tiny_recipe(tmp_path / "run", tmp_path / "docs.jsonl", data={"pack": True}, train={"steps": 4})
    data = prepare(recipe.to_dict()["data"], tmp_path / "cache")
    assert data.train_docs is not None and data.train_docs[0] == 0
    eos = data.tokenizer.eos_id
    assert all(data.train[s - 1] == eos for s in data.train_docs[1:])  # each document ends in EOS
    batches = PackedLMBatches(data.train, data.val, data.train_docs, data.val_docs, batch_size=4, seq_len=16, seed=0)
    b = batches.batch(0)
    assert b["document_ids"].shape == b["ids"].shape == b["labels"].shape
    crossing = b["document_ids"][:, 1:] != b["document_ids"][:, :-1]
    assert crossing.any() and (b["labels"][:, :-1][crossing] == IGNORE).all()
    assert (b["labels"][:, :-1][~crossing] != IGNORE).all()
    calls = []  # (training?, packed batch?) per objective call
    forward = CausalLM.forward
    monkeypatch.setattr(CausalLM, "forward", lambda self, batch, **kw: (
        calls.append((self.training, "document_ids" in batch)) or forward(self, batch, **kw)))  # fmt: skip
    result = train(recipe)
    # Four training steps ran on packed batches (evaluation used packed ones too), and they learned.
    assert [c for c in calls if c[0]] == [(True, True)] * 4 and all(packed for _, packed in calls)
    first, last = result.metrics[0], result.metrics[-1]
    assert (first["step"], last["step"], result.step) == (0, 4, 4)
    assert math.isfinite(last["train_loss"]) and last["val_loss"] < first["val_loss"] - 0.1, (first, last)


def test_pack_with_seq2seq_or_mlm_is_a_clear_error():
    with pytest.raises(ValueError, match=r"data\.pack=true with data\.task='seq2seq'"):
        recipes.Data(source="reverse", task="seq2seq", pack=True)
    with pytest.raises(ValueError, match=r"data\.pack=true with data\.task='mlm'"):
        recipes.Data(task="mlm", pack=True)
    with pytest.raises(ValueError, match=r"data\.pack='yes'"):
        recipes.Data(pack="yes")


def test_document_ids_with_a_cache_or_the_wrong_shape_are_errors():
    model = grid.build(dict(grid.variants(("decoder",))[0], backend="math"))
    ids, docs = packed_row()
    with pytest.raises(ValueError, match="document_ids has shape"):
        model(ids, document_ids=docs[:, :5])
    with pytest.raises(ValueError, match="document_ids .* cannot be combined with cache"):
        model(ids, positions=torch.arange(ids.shape[1]), cache=model.new_cache(1, 40), document_ids=docs)
    with pytest.raises(TypeError, match="document_ids must be an integer tensor"):
        model(ids, document_ids=docs.float())
