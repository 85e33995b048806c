"""Norms and MLPs against their formulas."""

import pytest
import torch
import torch.nn.functional as F

from torchformer.nn.mlp import MLP, GatedMLP
from torchformer.nn.norms import LayerNorm, RMSNorm


def test_rmsnorm_formula():
    norm = RMSNorm(16, eps=1e-6)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.weight.double()
    assert torch.allclose(norm(x.float()).double(), expected, atol=1e-5)


def test_rmsnorm_reduces_in_fp32_for_half_inputs():
    # 300^2 = 90000 overflows fp16 (max 65504): a half-precision reduction would give 0 or inf.
    x = torch.full((2, 64), 300.0, dtype=torch.float16)
    out = RMSNorm(64).half()(x)
    assert out.dtype == torch.float16
    assert torch.allclose(out.float(), torch.ones(2, 64), atol=1e-3)


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_optional_bias(bias):
    norm = LayerNorm(16, eps=1e-5, bias=bias)
    assert (norm.bias is not None) == bias
    assert sum(p.numel() for p in norm.parameters()) == 16 * (2 if bias else 1)
    x = torch.randn(4, 16)
    ref = (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    assert torch.allclose(norm(x), ref, atol=1e-5)


ACTS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


@pytest.mark.parametrize("act", list(ACTS))
def test_mlp_formula(act):
    mlp = MLP(8, 32, ACTS[act], bias=True)
    x = torch.randn(2, 3, 8)
    expected = (ACTS[act](x @ mlp.up.weight.T + mlp.up.bias)) @ mlp.down.weight.T + mlp.down.bias
    assert torch.allclose(mlp(x), expected, atol=1e-6)


def test_gated_mlp_formula():
    """SwiGLU (Shazeer 2020): down(silu(x W_gate) * x W_up)."""
    mlp = GatedMLP(8, 24, F.silu, bias=False)
    x = torch.randn(2, 3, 8)
    g, u = x @ mlp.gate.weight.T, x @ mlp.up.weight.T
    expected = (g * torch.sigmoid(g) * u) @ mlp.down.weight.T
    assert torch.allclose(mlp(x), expected, atol=1e-6)
    assert sum(p.numel() for p in mlp.parameters()) == 3 * 8 * 24


def test_gelu_variants_differ():
    x = torch.linspace(-3, 3, 101)
    assert (ACTS["gelu"](x) - ACTS["gelu_tanh"](x)).abs().max() > 1e-4


def test_swiglu_keeps_two_activations_not_three_and_equals_autograd():
    """The SiLU-gated product recomputes silu(g) in backward: same values and gradients as
    autograd's silu(g) * u, one fewer (rows, d_ff) tensor kept per layer."""
    import torch.nn.functional as F

    from torchformer.nn.mlp import silu_times

    g0, u0 = torch.randn(6, 40, dtype=torch.float64), torch.randn(6, 40, dtype=torch.float64)
    grad = torch.randn(6, 40, dtype=torch.float64)

    def run(fn):
        g, u = g0.clone().requires_grad_(), u0.clone().requires_grad_()
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
            out = fn(g, u)
        out.backward(grad)
        return out.detach(), g.grad, u.grad, sum(kept)

    ours, ref = run(silu_times), run(lambda g, u: F.silu(g) * u)
    for a, b in zip(ours[:3], ref[:3]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert ours[3] == 2 * 240 and ref[3] == 3 * 240
    with torch.no_grad():  # inference: the product is written over g (the gate's own output), no new tensor
        g = g0.clone()
        out = silu_times(g, u0)
        torch.testing.assert_close(out, F.silu(g0) * u0, rtol=0, atol=0)
        assert out.data_ptr() == g.data_ptr()
