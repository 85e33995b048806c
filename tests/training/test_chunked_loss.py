"""The chunked cross-entropy (nn/loss.py) equals torch's plain F.cross_entropy: the summed
loss and the logits' gradient, over shapes, label smoothing, ignored (-100) rows, chunk sizes that
do and do not divide the rows, and reduced-precision logits; and it keeps for backward only the
logits plus per-row numbers (no second logits-sized tensor). Bad arguments are refused."""

import pytest
import torch
import torch.nn.functional as F

from torchformer.nn import loss as losses
from torchformer.training.batches import IGNORE

CASES = [  # (shape of the rows, vocabulary, label smoothing)
    ((2, 64), 512, 0.0),
    ((3, 7), 50, 0.1),
    ((37,), 1000, 0.3),
    ((1, 1), 2, 0.0),
    ((4, 33), 300, 1.0),
]


def plain(logits, labels, smoothing):
    """The reference: torch's cross-entropy on fp32 logits, summed over the labelled rows."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE, reduction="sum", label_smoothing=smoothing)


def loss_and_grad(fn, logits, labels, smoothing):
    x = logits.detach().clone().requires_grad_()
    loss = fn(x, labels, smoothing)
    (loss / labels.numel()).backward()  # training divides the sum by the token count
    return loss.detach(), x.grad


def example(shape, vocab, seed, ignore_every=3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(*shape, vocab, generator=g) * 3
    labels = torch.randint(0, vocab, shape, generator=g)
    labels.view(-1)[::ignore_every] = IGNORE  # padding / prompt rows carry no loss
    return logits, labels


@pytest.mark.parametrize("chunk", [losses.CHUNK_ELEMENTS, 7 * 64, 1])
@pytest.mark.parametrize("shape,vocab,smoothing", CASES)
def test_chunked_equals_plain_loss_and_gradient(shape, vocab, smoothing, chunk, monkeypatch):
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", chunk)  # one chunk, uneven chunks, one row each
    logits, labels = example(shape, vocab, seed=len(shape) + vocab)
    ours, ours_grad = loss_and_grad(losses.token_loss, logits, labels, smoothing)
    ref, ref_grad = loss_and_grad(plain, logits, labels, smoothing)
    assert abs(float(ours - ref)) <= 1e-6 * max(1.0, abs(float(ref)))
    assert (ours_grad - ref_grad).abs().max() <= 1e-6
    ignored = labels == IGNORE
    assert torch.equal(ours_grad[ignored], torch.zeros_like(ours_grad[ignored]))  # exactly no gradient


def test_all_rows_ignored_gives_zero_loss_and_gradient():
    logits, labels = example((2, 5), 11, seed=3, ignore_every=1)
    ours, grad = loss_and_grad(losses.token_loss, logits, labels, 0.1)
    assert float(ours) == 0.0 and not grad.any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_logits_match_the_fp32_upcast(dtype):
    logits, labels = example((3, 40), 300, seed=5)
    logits = logits.to(dtype)
    ours, ours_grad = loss_and_grad(losses.token_loss, logits, labels, 0.1)
    ref, ref_grad = loss_and_grad(plain, logits, labels, 0.1)  # plain upcasts, then casts the gradient back
    assert ours_grad.dtype == dtype
    assert abs(float(ours - ref)) <= 1e-6 * abs(float(ref))
    # Both gradients are fp32 values rounded to ``dtype``: equal up to one rounding step.
    assert torch.allclose(ours_grad.float(), ref_grad.float(), rtol=1e-2, atol=1e-5)


def saved_bytes(fn, logits, labels):
    """Bytes of the distinct storages autograd keeps for backward, beyond the logits themselves."""
    x = logits.detach().clone().requires_grad_()
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x, labels, 0.0)
    kept.pop(x.untyped_storage().data_ptr(), None)
    return sum(kept.values())


def test_backward_keeps_no_second_logits_sized_tensor():
    logits, labels = example((4, 64), 1024, seed=7)
    logits_bytes = logits.numel() * logits.element_size()
    ours, ref = saved_bytes(losses.token_loss, logits, labels), saved_bytes(plain, logits, labels)
    assert ref >= logits_bytes  # the plain loss keeps an fp32 log-softmax of the logits' size
    assert ours <= 32 * labels.numel()  # per-row numbers only (logsumexp, target, mask)


def test_bad_arguments_are_refused_before_any_work():
    logits, labels = example((2, 3), 10, seed=1)
    with pytest.raises(ValueError, match=r"labels shape \(2, 4\) must be the logits shape .* \(2, 3\)"):
        losses.token_loss(logits, torch.zeros(2, 4, dtype=torch.long))
    for bad in (-0.1, 1.5, True, "0.1"):
        with pytest.raises(ValueError, match=r"smoothing=.*must be a number in \[0, 1\]"):
            losses.token_loss(logits, labels, bad)
