"""The eager one-row product (nn/linear.py ``one_row_cpu``: the row paired with a copy of itself
through MKL's sgemm, for fp32 CPU rows without autograd) equals F.linear (MKL's sgemv) up to fp32
reassociation: per product over the decode benchmark's matrix shapes and any leading shape, and
as whole eager decodes over the decoder and encoder-decoder grid (same tokens, logits within 1e-5
of the F.linear route)."""

import pytest
import torch
import torch.nn.functional as F

import torchformer.nn.linear as nn_linear
from tests.grid import build, params, source, variants
from torchformer.generation.generate import decode
from torchformer.generation.request import make_request
from torchformer.generation.sampling import Sampling
from torchformer.nn.linear import linear


class Counting:
    """Wraps one_row_cpu to count the products that took the paired route."""

    def __init__(self) -> None:
        self.check, self.calls = nn_linear.one_row_cpu, 0

    def __call__(self, x):
        taken = self.check(x)
        self.calls += taken
        return taken


@pytest.mark.parametrize("n, k", [(512, 512), (1368, 512), (512, 1368), (8192, 512), (48, 32)])
@pytest.mark.parametrize("lead", [(1,), (1, 1), (1, 1, 1)])
@pytest.mark.parametrize("bias", [True, False])
def test_one_row_equals_f_linear(monkeypatch, n, k, lead, bias):
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g) * k**-0.5
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(*lead, k, generator=g)
    counter = Counting()
    monkeypatch.setattr(nn_linear, "one_row_cpu", counter)
    with torch.inference_mode():
        ours, ref = linear(x, w, b), F.linear(x, w, b)
        exact = (x.double() @ w.double().t() + (0 if b is None else b.double())).float()
    assert counter.calls == 1 and ours.shape == ref.shape == (*lead, n) and ours.is_contiguous()
    # Both are fp32 sums of the same k products in different orders: each within 1e-5 of float64.
    torch.testing.assert_close(ours, exact, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref, exact, rtol=1e-5, atol=1e-5)


def test_strided_row():
    x = torch.randn(3, 32, 5)[1:2, :, 2]  # (1, 32) with stride 5
    w = torch.randn(48, 32)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_route_is_only_taken_without_autograd_for_fp32_cpu_rows(monkeypatch):
    counter = Counting()
    monkeypatch.setattr(nn_linear, "one_row_cpu", counter)
    w = torch.randn(16, 8, requires_grad=True)
    x = torch.randn(1, 8, requires_grad=True)
    out = linear(x, w)  # autograd on: F.linear, exactly as before, with its backward
    assert torch.equal(out, F.linear(x, w))
    out.sum().backward()
    assert counter.calls == 0 and x.grad is not None
    with torch.no_grad():
        linear(x, w)  # no_grad counts too (evaluation loops)
        linear(x.double(), w.double())  # fp64: F.linear
        linear(torch.randn(2, 8), w)  # two rows: the few-row path, not this check
    assert counter.calls == 1


DECODE = variants(("decoder", "encoder_decoder"))


@pytest.mark.parametrize("v", **params(DECODE))
def test_eager_decode_equals_the_f_linear_route(monkeypatch, v):
    model = build(v)
    seq2seq = model.config.arch == "encoder_decoder"
    ids = source(1) if seq2seq else torch.randint(1, model.config.vocab_size, (1, 7), generator=torch.Generator())
    req = make_request(model, ids, max_new_tokens=10, attention_mask=None, eos_token_id=None, decoder_start_token_id=0)

    def run():
        pairs = decode(model, req, Sampling(), None, False, scores=True)
        out = [(tok.clone(), logits.clone()) for tok, logits in pairs]
        return torch.cat([t for t, _ in out]), torch.cat([lg for _, lg in out])

    counter = Counting()
    monkeypatch.setattr(nn_linear, "one_row_cpu", counter)
    tokens, logits = run()
    assert counter.calls > 0  # the decode steps took the paired route
    monkeypatch.setattr(nn_linear, "one_row_cpu", lambda x: False)  # the F.linear route (before)
    ref_tokens, ref_logits = run()
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
