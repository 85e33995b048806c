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


@torch.no_grad()
def test_compiled_few_row_product_matches_f_linear_on_both_sides_of_compiled_rows():
    """Compiled, 1..COMPILED_ROWS rows take the fused multiply + sum; one more row takes MKL's."""
    from torchformer.nn.linear import COMPILED_ROWS

    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    step = torch.compile(lambda x: linear(x, w, b), dynamic=False, fullgraph=True)
    for rows in (1, 3, COMPILED_ROWS, COMPILED_ROWS + 1):
        x = torch.randn(rows, 1, 24, generator=g)
        torch.testing.assert_close(step(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
