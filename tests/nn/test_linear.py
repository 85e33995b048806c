"""torchformer.nn.Linear: the few-row path (W @ x^T) equals nn.Linear's x @ W^T, forward and
backward, on both sides of FEW_ROWS, with and without bias, for any leading shape."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchformer.nn.linear import FEW_ROWS, Linear, linear


@pytest.mark.parametrize("lead", [(0,), (1,), (2,), (1, 1), (8, 1), (2, 3, 4), (FEW_ROWS,), (FEW_ROWS + 1,), (3, 70)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_f_linear_forward_and_backward(lead, bias):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, generator=g, requires_grad=True)
    b = torch.randn(48, generator=g, requires_grad=True) if bias else None
    x = torch.randn(*lead, 32, generator=g, requires_grad=True)
    ours = linear(x, w, b)
    ref = F.linear(x, w, b)
    assert ours.shape == ref.shape == (*lead, 48) and ours.is_contiguous()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    if ours.numel():
        grad = torch.randn(ours.shape, generator=g)
        got = torch.autograd.grad(ours, [x, w, *([b] if bias else [])], grad)
        want = torch.autograd.grad(ref, [x, w, *([b] if bias else [])], grad)
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_non_contiguous_input_and_module_keys():
    x = torch.randn(4, 32).t()  # (32, 4): rows are strided
    w = torch.randn(8, 4)
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    ours, ref = Linear(16, 8), nn.Linear(16, 8)
    assert isinstance(ours, nn.Linear)
    assert ours.state_dict().keys() == ref.state_dict().keys()  # checkpoints and HF key maps unchanged
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 16)
    torch.testing.assert_close(ours(x), ref(x))
