"""Packed instruction data (data.instruct + data.pack): each example's loss in a packed row equals
its loss run alone unpacked (within 1e-5, over the decoder variant grid), changing one example
changes no other example's logits (exactly 0.0), masked and padding positions carry no gradient,
the loss equals a hand computation, answer tokens are counted across micro-batches, batches are a
seeded pure function of the step, long examples are cut with a warning that counts them, a recipe
trains end to end, and packing an encoder-decoder task stays an error."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

import torchformer as tfm
from torchformer.training import recipe as recipes
from torchformer.training.batches import IGNORE, n_targets
from torchformer.training.distributed import Runtime
from torchformer.training.instruct import InstructBatches, PackedInstructBatches, prepare
from torchformer.training.losses import CausalLM, token_loss
from torchformer.training.train import accumulate, train

from .. import grid
from .tiny import tiny_recipe

# Prompt/answer lengths that pack several examples per 24-token row and leave padding tails.
SIZES = [(3, 1), (1, 9), (6, 2), (2, 5), (8, 4), (4, 3), (5, 6), (2, 2)]
ROWS = [{"prompt": "p" * n + "q", "completion": "c" * m + "d"} for n, m in SIZES] * 2
PAIRS = [{"prompt": "Q: two plus two?\nA: ", "completion": "four"}, {"prompt": "Say hi: ", "completion": "hello there"}]
SEQ = 24


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _data(tmp_path, rows=ROWS, **data):
    source = _write(tmp_path / "i.jsonl", rows)
    recipe = tiny_recipe(tmp_path / "out", source, data={"instruct": True, "pack": True, **data})
    return prepare(recipe, None)


def _packed(data, seq_len=SEQ, batch_size=4, seed=0):
    return PackedInstructBatches(data, batch_size=batch_size, seq_len=seq_len, seed=seed)


def _all_rows(b: PackedInstructBatches):
    return b.collate_rows(b.train_pairs, b.train_rows)


def _spans(b: PackedInstructBatches):
    """(row, start, length, example index) of every example in the packed training rows."""
    out = []
    for r, row in enumerate(b.train_rows):
        at = 0
        for i in row:
            out.append((r, at, len(b.train_pairs[i][0]), i))
            at += len(b.train_pairs[i][0])
    return out


def _model(vocab):
    torch.manual_seed(0)
    cfg = tfm.presets.get("shakespeare-char")
    return tfm.build_model(
        cfg.replace(vocab_size=vocab, d_model=32, n_layers=1, attention=cfg.attention.__class__(n_heads=2))
    )


def _forward(model, batch):
    return model(batch["ids"], document_ids=batch["document_ids"])


def _packed_run(data, v):
    """(batches, the grid row's model, every training row packed, its logits)."""
    b, model = _packed(data), grid.build(v)
    batch = _all_rows(b)
    return b, model, batch, _forward(model, batch)


DECODERS = grid.variants(("decoder",))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return _data(tmp_path_factory.mktemp("pack"))


def test_rows_hold_whole_examples_and_a_padding_document(data):
    b = _packed(data)
    batch = _all_rows(b)
    assert batch["ids"].shape == batch["labels"].shape == batch["document_ids"].shape == (len(b.train_rows), SEQ)
    assert sorted(i for row in b.train_rows for i in row) == list(range(len(data.train)))  # each once
    assert len(b.train_rows) < len(data.train)  # examples share rows
    for r, row in enumerate(b.train_rows):
        used = sum(len(b.train_pairs[i][0]) for i in row)
        docs = batch["document_ids"][r]
        assert docs[:used].tolist() == [d for d, i in enumerate(row) for _ in range(len(b.train_pairs[i][0]))]
        assert (docs[used:] == len(row)).all()  # the tail: a document of its own
        assert (batch["labels"][r, used:] == IGNORE).all() and (batch["ids"][r, used:] == b.pad).all()
    # Nothing lost, nothing added: the packed targets are those of the examples run one by one.
    alone = sum(n_targets(InstructBatches.collate(b, [e])) for e in data.train)
    assert n_targets(batch) == alone > 0


@pytest.mark.parametrize("v", **grid.params(DECODERS))
@torch.no_grad()
def test_each_packed_example_equals_the_example_alone(data, v):
    b, model, batch, logits = _packed_run(data, v)
    for r, at, n, i in _spans(b):
        alone = InstructBatches.collate(b, [data.train[i]])  # the unpacked batch of this example
        alone_logits = model(alone["ids"])
        assert (logits[r, at : at + n] - alone_logits[0]).abs().max().item() < 1e-5
        assert torch.equal(batch["labels"][r, at : at + n], alone["labels"][0])  # the shift stays inside
        packed_loss = token_loss(logits[r, at : at + n], batch["labels"][r, at : at + n])
        assert abs(packed_loss.item() - token_loss(alone_logits, alone["labels"]).item()) < 1e-5


@pytest.mark.parametrize("v", **grid.params(DECODERS[:16]))
@torch.no_grad()
def test_changing_one_example_changes_no_other_examples_logits(data, v):
    b, model, _, logits = _packed_run(data, v)
    r, at, n, k = next(s for s in _spans(b) if s[2] > 3)
    x, y = b.train_pairs[k]
    changed = list(b.train_pairs)
    changed[k] = ((x + 1) % grid.VOCAB, y)  # same length: the packing layout is unchanged
    other = _forward(model, b.collate_rows(changed, b.train_rows))
    diff = (other - logits).abs().amax(-1)  # (rows, T)
    mine = torch.zeros_like(diff, dtype=torch.bool)
    mine[r, at : at + n] = True
    assert diff[~mine].max().item() == 0.0
    assert diff[mine].max().item() > 1e-4


def test_masked_and_padding_positions_carry_no_gradient(data):
    b = _packed(data)
    model = _model(data.tokenizer.vocab_size)
    batch = _all_rows(b)
    embedded = {}

    def keep(_module, _inputs, out):
        out.retain_grad()
        embedded["h"] = out

    model.embed.register_forward_hook(keep)
    logits = _forward(model, batch)
    logits.retain_grad()
    token_loss(logits, batch["labels"]).backward()
    masked = batch["labels"] == IGNORE
    per_position = logits.grad.abs().sum(-1)  # (B, T)
    assert masked.any() and (~masked).any()
    assert torch.all(per_position[masked] == 0) and torch.all(per_position[~masked] > 0)
    # Padding tails: no query of a real example sees them, so not even their inputs get gradient.
    pad = batch["document_ids"] == torch.tensor([len(row) for row in b.train_rows])[:, None]
    into = embedded["h"].grad.abs().sum(-1)  # (B, T)
    assert pad.any() and torch.all(into[pad] == 0)
    prompt = masked & ~pad  # prompt tokens carry no loss but answers attend to them
    assert into[prompt].max() > 0


@torch.no_grad()
def test_loss_equals_hand_computation_on_a_small_packed_batch(tmp_path):
    data = _data(tmp_path, PAIRS * 5)
    tok = data.tokenizer
    model = _model(tok.vocab_size)
    b = _packed(data, seq_len=64)
    assert [list(e[0]) for e in data.train[:2]] == [_plain(tok, p) for p in PAIRS]
    batch = b.collate_rows(b.train_pairs, [[0, 1]])  # the two different pairs in one row, padding after
    assert (batch["document_ids"][0] == 2).any()
    assert n_targets(batch) == sum(len(tok.encode(p["completion"])) + 1 for p in PAIRS)  # answers + EOS
    loss = CausalLM(model)(batch)
    hand = 0.0
    for pair in PAIRS:  # one example at a time, alone: -log p of each completion token and the EOS
        prompt, answer = list(tok.encode(pair["prompt"])), [*tok.encode(pair["completion"]), tok.eos_id]
        seq = torch.tensor([prompt + answer])
        logp = torch.log_softmax(model(seq[:, :-1])[0].double(), -1)  # (T, V)
        hand -= sum(float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(answer))
    assert float(loss) == pytest.approx(hand, rel=1e-5)


def _plain(tok, pair):
    return [*tok.encode(pair["prompt"]), *tok.encode(pair["completion"]), tok.eos_id]


def test_answer_tokens_counted_across_micro_batches(data):
    """Packed rows with different answer counts: 1, 2 or 4 micro-batches give the gradient of the
    mean over the whole batch's answer tokens."""
    objective = CausalLM(_model(data.tokenizer.vocab_size))
    batch = _packed(data, batch_size=4).batch(0)
    assert len({n_targets({"labels": batch["labels"][i : i + 1]}) for i in range(4)}) > 1
    mean = _gradients(objective, lambda: (objective(batch) / n_targets(batch)).backward())
    cpu = Runtime(rank=0, world=1, device=torch.device("cpu"))
    for accum in (1, 2, 4):
        split = _gradients(objective, lambda a=accum: accumulate(objective, batch, cpu, a, contextlib.nullcontext))
        assert split.keys() == mean.keys()
        for name, g in split.items():
            torch.testing.assert_close(g, mean[name], atol=1e-6, rtol=0, msg=f"{accum}: {name}")


def _gradients(module, backward) -> dict:
    module.zero_grad()
    backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_batches_are_a_seeded_pure_function_of_the_step(data):
    first = _packed(data, batch_size=3, seed=7)
    for step in (9, 0, 4):  # any order, any fresh object: the same batch
        again = _packed(data, batch_size=3, seed=7).batch(step)
        assert all(torch.equal(first.batch(step)[k], again[k]) for k in again)
    other = _packed(data, batch_size=3, seed=8)
    assert any(not torch.equal(first.batch(s)["ids"], other.batch(s)["ids"]) for s in range(3))
    one = _packed(data, batch_size=1, seed=7)  # one row per step: an epoch shows every row once
    n = len(one.train_rows)
    for epoch in (0, 1):
        seen = sorted(tuple(one.batch(epoch * n + s)["ids"][0].tolist()) for s in range(n))
        assert seen == sorted(tuple(r.tolist()) for r in _all_rows(one)["ids"])


def test_long_examples_are_cut_with_a_warning_that_counts_them(tmp_path):
    rows = [*ROWS[:4], {"prompt": "p" * 30, "completion": "cd"}, {"prompt": "p", "completion": "c" * 40}]
    data = _data(tmp_path, rows)
    with pytest.warns(UserWarning, match=r"2 instruction examples are longer .* = 25 tokens .*\(1 of them keep no"):
        b = _packed(data)
    batch = _all_rows(b)
    for r, at, n, i in _spans(b):
        alone = InstructBatches.collate(b, [data.train[i]])  # unpacked cuts the same tokens
        assert torch.equal(batch["ids"][r, at : at + n], alone["ids"][0])
        assert torch.equal(batch["labels"][r, at : at + n], alone["labels"][0])
    assert max(n for _, _, n, _ in _spans(b)) == SEQ  # a cut example fills a row alone


def test_training_from_a_recipe_with_instruct_and_pack(tmp_path):
    source = _write(tmp_path / "i.jsonl", ROWS * 3)
    recipe = tiny_recipe(
        tmp_path / "out",
        source,
        data={"instruct": True, "pack": True, "seq_len": 32},
        train={"steps": 30, "batch_size": 4, "eval_every": 30},
    )
    recipes.check(recipe)
    result = train(recipe)
    assert [m["step"] for m in result.metrics] == [0, 30]
    assert result.metrics[-1]["val_loss"] < result.metrics[0]["val_loss"] - 0.1


def test_pack_with_an_encoder_decoder_task_stays_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"data\.pack=true with data\.task='seq2seq': packing is for the causal lm"):
        recipes.Data(source=str(tmp_path / "i.jsonl"), task="seq2seq", pack=True, instruct=True)
    raw = tiny_recipe(tmp_path / "out", "reverse").to_dict()
    raw["data"] |= {"task": "seq2seq", "pack": True, "instruct": True}
    with pytest.raises(ValueError, match=r"data\.pack=true with data\.task='seq2seq'"):
        recipes.from_dict(raw)
    raw["data"]["pack"] = False
    with pytest.raises(ValueError, match=r"data\.instruct=true: needs data\.task 'lm' \(got 'seq2seq'\)"):
        recipes.check(recipes.from_dict(raw))
    assert not (tmp_path / "out").exists()
