"""The eager one-row product (nn/linear.py ONE_ROW_CPU: oneDNN's inner product, used without
autograd for fp32 CPU rows) equals F.linear (MKL) up to fp32 reassociation: per product over the
decode benchmark's matrix shapes and any leading shape, and as whole eager decodes over the
decoder and encoder-decoder grid (same tokens, logits within 1e-5 of the F.linear route)."""

import pytest
import torch
import torch.nn.functional as F

import torchformer.nn.linear as nn_linear
from tests.grid import build, params, source, variants
from torchformer.generation.generate import decode
from torchformer.generation.request import make_request
from torchformer.generation.sampling import Sampling
from torchformer.nn.linear import linear


def test_the_route_exists_on_this_build():
    assert nn_linear.ONE_ROW_CPU is not None  # torch CPU wheels ship oneDNN: the route must be live in CI


class Counting:
    """Wraps ONE_ROW_CPU to count the products it took."""

    def __init__(self, op) -> None:
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


@pytest.mark.parametrize("n, k", [(512, 512), (1368, 512), (512, 1368), (8192, 512), (48, 32)])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (1, 1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_one_row_equals_f_linear(monkeypatch, n, k, lead, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * k**-0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(*lead, k, generator=g)
    counter = Counting(nn_linear.ONE_ROW_CPU)
    monkeypatch.setattr(nn_linear, "ONE_ROW_CPU", counter)
    with torch.inference_mode():
        ours, ref = linear(x, w, b), F.linear(x, w, b)
        exact = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
    assert counter.calls == 1 and ours.shape == ref.shape == (*lead, n) and ours.is_contiguous()
    # Both are fp32 sums of the same k products in different orders: each within 1e-5 of float64.
    torch.testing.assert_close(ours, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref, exact, rtol=1e-5, atol=1e-5)


def test_route_is_only_taken_without_autograd_for_fp32_cpu_rows(monkeypatch):
    counter = Counting(nn_linear.ONE_ROW_CPU)
    monkeypatch.setattr(nn_linear, "ONE_ROW_CPU", counter)
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(1, 8, requires_grad=True)
    out = linear(x, w)  # autograd on: F.linear, whose backward exists
    out.sum().backward()
    assert counter.calls == 0 and x.grad is not None
    with torch.no_grad():
        linear(x, w)  # no_grad counts too (evaluation loops)
        linear(x.double(), w.double())  # fp64: not this route
        linear(torch.randn(2, 8), w)  # two rows: the few-row path
        linear(x, w.as_subclass(Marked))  # a tensor subclass keeps F.linear's dispatch
    assert counter.calls == 1


class Marked(torch.Tensor):
    """A trivial tensor subclass (DTensor and fake tensors are subclasses too)."""


DECODE = variants(("decoder", "encoder_decoder"))


@pytest.mark.parametrize("v", **params(DECODE))
def test_eager_decode_equals_the_f_linear_route(monkeypatch, v):
    model = build(v)
    seq2seq = model.config.arch == "encoder_decoder"
    ids = source(1) if seq2seq else torch.randint(1, model.config.vocab_size, (1, 7), generator=torch.Generator())
    req = make_request(model, ids, max_new_tokens=10, attention_mask=None, eos_token_id=None, decoder_start_token_id=0)

    def run():
        out = [(tok.clone(), logits.clone()) for tok, logits in decode(model, req, Sampling(), None, False)]
        return torch.cat([t for t, _ in out]), torch.cat([lg for _, lg in out])

    counter = Counting(nn_linear.ONE_ROW_CPU)
    monkeypatch.setattr(nn_linear, "ONE_ROW_CPU", counter)
    tokens, logits = run()
    assert counter.calls > 0  # the decode steps took the route
    monkeypatch.setattr(nn_linear, "ONE_ROW_CPU", None)  # the F.linear route (before)
    ref_tokens, ref_logits = run()
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
