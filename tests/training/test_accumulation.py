"""Issue 4, test 3: gradient accumulation over 4 micro-batches of B/4 equals one batch of B
(loss and gradients within 1e-6), including seq2seq batches whose rows differ in padding."""

import contextlib

import numpy as np
import pytest
import torch

from torchformer import build_model, presets
from torchformer.training.batches import LMBatches, PairBatches, n_targets, rows
from torchformer.training.distributed import Runtime
from torchformer.training.losses import CausalLM, Seq2Seq
from torchformer.training.train import accumulate

CPU = Runtime(rank=0, world=1, device=torch.device("cpu"))


def _decoder_case():
    cfg = presets.get("llama-tiny", vocab_size=50, d_model=32, n_layers=2, attention={"n_heads": 4, "n_kv_heads": 2})
    tokens = np.random.default_rng(0).integers(0, 50, 5000)
    batch = LMBatches(tokens, tokens, batch_size=16, seq_len=12, seed=0).batch(0)
    return CausalLM(build_model(cfg)), batch


def _seq2seq_case():
    cfg = presets.get("vanilla-base", vocab_size=20, d_model=32, n_layers=2, n_decoder_layers=2,
                      attention={"n_heads": 2}, block={"d_ff": 64, "dropout": 0.0}, dropout=0.0)  # fmt: skip
    rng = np.random.default_rng(0)
    # lengths 1..12: rows in one batch carry very different amounts of padding
    pairs = [(rng.integers(5, 20, n), rng.integers(5, 20, m)) for n, m in rng.integers(1, 13, (16, 2))]
    batch = PairBatches(pairs, pairs, batch_size=16, seed=0, pad=0, bos=1, eos=2).collate(pairs)
    assert (batch["labels"] == -100).any()
    return Seq2Seq(build_model(cfg), smoothing=0.1), batch


def _grads(objective, batch, accum):
    objective.zero_grad()
    loss_sum, _ = accumulate(objective, batch, CPU, accum, contextlib.nullcontext)
    return loss_sum / n_targets(batch), {n: p.grad.clone() for n, p in objective.named_parameters()}


@pytest.mark.parametrize("case", [_decoder_case, _seq2seq_case])
def test_four_micro_batches_equal_one_batch(case):
    objective, batch = case()
    loss1, g1 = _grads(objective, batch, 1)
    loss4, g4 = _grads(objective, batch, 4)
    assert loss4 == pytest.approx(loss1, abs=1e-6)
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], atol=1e-6, rtol=0, msg=name)


def test_mean_of_micro_batch_means_would_differ_with_padding():
    # Why the token count matters: averaging per-micro-batch means weights short rows too much.
    objective, batch = _seq2seq_case()
    _, exact = _grads(objective, batch, 1)
    objective.zero_grad()
    for i in range(4):
        mb = rows(batch, 4 * i, 4 * i + 4)
        (objective(mb) / n_targets(mb) / 4).backward()
    worst = max(float((p.grad - exact[n]).abs().max()) for n, p in objective.named_parameters())
    assert worst > 1e-4


def _grads_and_saved(objective, batch, accum):
    """_grads, and how many tensors autograd kept for backward on the way."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(None) or t, lambda t: t):
        loss, grads = _grads(objective, batch, accum)
    return loss, grads, len(saved)


@pytest.mark.parametrize("case", [_decoder_case, _seq2seq_case])
def test_activation_checkpointing_saves_fewer_tensors_and_gives_the_same_gradients(case):
    from torchformer.training.train import checkpoint_blocks

    objective, batch = case()
    loss1, g1, saved1 = _grads_and_saved(objective, batch, 2)
    checkpoint_blocks(objective.model)  # blocks now recompute their insides during backward
    loss2, g2, saved2 = _grads_and_saved(objective, batch, 2)
    # It took effect: a checkpointed block keeps its inputs, not its activations (measured 188 -> 28
    # tensors for the decoder, 326 -> 38 for seq2seq).
    assert saved2 < saved1 / 3, (saved1, saved2)
    assert loss2 == pytest.approx(loss1, abs=1e-6)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], atol=1e-6, rtol=0, msg=name)
