"""Int4MinLinear (nn/quant_min.py), the portable asymmetric int4 module: w = s * u - m per group,
its values within half a step of the float weight (a zero group stays zero), and its reference
forward x @ w^T."""

import pytest
import torch
from torch import nn

from torchformer.nn.quant_min import Int4MinLinear


def test_quantized_weights_are_within_half_a_step():
    torch.manual_seed(0)
    lin = nn.Linear(64, 24)
    with torch.no_grad():
        lin.weight[:8].add_(0.3)  # one-sided groups: a minimum far from the symmetric case
        lin.weight[8:10, :32] = 0.0  # whole zero groups
    m = Int4MinLinear.from_linear(lin, 32)
    w, deq = lin.weight.detach().reshape(24, 2, 32), m.dequantized().reshape(24, 2, 32)
    step = m.scale[..., None]  # (24, 2, 1)
    assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    assert (deq[8:10, 0] == 0).all()
    u = m.unpacked() + 8
    assert u.min() == 0 and u.max() == 15  # the whole range of the nibble is used
    assert (m.minimum[:8] == 0).all() and (m.minimum[8:] >= 0).all()  # shifted groups have no negative weight


def test_reference_forward_is_x_times_the_dequantized_weight():
    torch.manual_seed(1)
    m = Int4MinLinear.from_linear(nn.Linear(64, 24, bias=True), 16)
    x = torch.randn(3, 5, 64)
    expected = x.double() @ m.dequantized().double().T + m.bias.double()
    torch.testing.assert_close(m(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert m.values(slice(2, 4))[2].shape == (2, 4)


def test_minimum_of_another_shape_is_named():
    m = Int4MinLinear.from_linear(nn.Linear(64, 8), 32)
    with pytest.raises(ValueError, match=r"minimum has shape \(8, 1\); it must be the scale's, \(8, 2\)"):
        Int4MinLinear(m.qweight, m.scale, m.minimum[:, :1], None, 32)
