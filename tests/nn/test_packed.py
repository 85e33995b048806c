"""nn/packed.py: few-row products through oneDNN over packed weights equal F.linear, eager and
compiled; a weight changed after packing is never multiplied stale; packing is scoped."""

import pytest
import torch
import torch.nn.functional as F

from torchformer.fast.scope import packed
from torchformer.nn import packed as P
from torchformer.nn.linear import COMPILED_ROWS, Linear

KINDS = ["panel", "onednn"]


@pytest.fixture(params=KINDS)
def kind(request, monkeypatch):
    """Run a test with each packed form: the panel kernel, and oneDNN (the kernel made unavailable)."""
    if request.param == "panel":
        assert P.kernels() is not None, "the panel kernel did not build on this machine (see the log)"
    else:
        monkeypatch.setattr(P, "kernels", lambda: None)
    return request.param


def model(d_in=40, d_out=24, bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(d_in, d_out, bias=bias), torch.nn.ReLU(), Linear(d_out, d_in, bias=bias))


def count_packed_calls(monkeypatch) -> list[bool]:
    """Spy on both packed routes: one entry per product (per traced product when compiled), True
    when it found the weight's current packed copy (oneDNN's, or the extension's panels)."""
    found, current, panel_product = [], P.current, P.panel_product

    def spy_current(weight):
        copy = current(weight)
        found.append(copy is not None)
        return copy

    def spy_panels(x, weight):
        if not torch.compiler.is_compiling():
            found.append(bool(P.kernels().has_panels(weight)))
        else:
            found.append(True)  # traced: the op is in the graph (checked by value below)
        return panel_product(x, weight)

    monkeypatch.setattr(P, "current", spy_current)
    monkeypatch.setattr(P, "panel_product", spy_panels)
    return found


@pytest.mark.parametrize("lead", [(3,), (5,), (8, 1), (2, 4), (16,), (64,), (130,)])
@pytest.mark.parametrize("bias", [True, False])
@torch.inference_mode()
def test_packed_products_equal_f_linear(lead, bias, kind, monkeypatch):
    m = model(bias=bias)
    x = torch.randn(*lead, 40)
    found = count_packed_calls(monkeypatch)
    with packed(m, rows=8):
        want = P.panel_product if kind == "panel" else P.onednn_product
        assert m[0].prepacked is m[2].prepacked is want
        out = m(x)
    assert found == [True, True]  # both products went through their packed copies
    want = F.linear(torch.relu(F.linear(x, m[0].weight, m[0].bias)), m[2].weight, m[2].bias)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not m[0].prepacked and not P._COPIES  # scoped: nothing kept after the block


@torch.inference_mode()
def test_compiled_products_go_through_the_packed_copy(kind, monkeypatch):
    """Compiled: panels from MIN_ROWS rows on; oneDNN only above COMPILED_ROWS (inductor's row
    sums are faster than it below)."""
    m = model()
    found = count_packed_calls(monkeypatch)
    torch._dynamo.reset()
    row_counts = (P.MIN_ROWS, COMPILED_ROWS + 1, 8, 16) if kind == "panel" else (P.MIN_ROWS, COMPILED_ROWS + 1, 8)
    try:
        with packed(m, rows=8):
            step = torch.compile(m, dynamic=False, fullgraph=True)
            for rows in row_counts:
                x = torch.randn(rows, 40)
                want = F.linear(torch.relu(F.linear(x, m[0].weight, m[0].bias)), m[2].weight, m[2].bias)
                torch.testing.assert_close(step(x), want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()
    assert found and all(found)
    assert len(found) == (2 * len(row_counts) if kind == "panel" else 4)  # two products per traced packed call


@pytest.mark.parametrize("n, k", [(16, 16), (17, 9), (40, 300), (1, 513), (33, 1)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17])
def test_panel_kernel_equals_the_product_for_any_shape(n, k, rows):
    """Partial last panel (N not a multiple of 16), K past one K block (256) with more than 8 rows
    (partial sums kept in the output), K of 1, every row-group size."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    out = P.kernels().panel_mm(x, P.panels(w), n)
    torch.testing.assert_close(out, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_after_packing_is_not_multiplied_stale():
    m = model()
    x = torch.randn(8, 40)
    with packed(m, rows=8):
        with torch.no_grad():
            m[0].weight.mul_(-2.0)  # an in-place update (optimizer step, load_state_dict's copy_)
        assert P.current(m[0].weight) is None and P.current(m[2].weight) is not None
        if P.kernels() is not None:
            assert not P.kernels().has_panels(m[0].weight) and P.kernels().has_panels(m[2].weight)
        with torch.inference_mode():
            want = F.linear(torch.relu(F.linear(x, m[0].weight, m[0].bias)), m[2].weight, m[2].bias)
            torch.testing.assert_close(m(x), want, rtol=1e-5, atol=1e-5)


def test_packing_is_scoped_and_nests():
    m = model()
    with packed(m, rows=2):  # too few rows to pay: nothing packed
        assert not m[0].prepacked and not P._COPIES
    with packed(m, rows=8):
        with packed(m, rows=8):  # already packed: the inner block leaves the outer's copies alone
            pass
        assert m[0].prepacked and P.current(m[0].weight) is not None
    assert not m[0].prepacked and not P._COPIES
    m64 = model().double()
    with packed(m64, rows=8):  # only fp32 CPU weights are packed
        assert not m64[0].prepacked and not P._COPIES


def test_products_under_autograd_keep_f_linear_and_its_backward():
    m = model()
    x = torch.randn(8, 40, requires_grad=True)
    with packed(m, rows=8):
        out = m(x)
        out.sum().backward()
    ref_m = model()
    x2 = x.detach().clone().requires_grad_(True)
    ref_m(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(m[0].weight.grad, ref_m[0].weight.grad)


@pytest.mark.parametrize("batch", [3, 8])
def test_generate_with_packed_weights_equals_without(batch, kind, monkeypatch):
    import torchformer as tfm

    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=64, n_layers=2, max_seq_len=64)
    net = tfm.build_model(cfg).eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (batch, 9), generator=g)
    found = count_packed_calls(monkeypatch)
    packed_out = tfm.generate(net, ids, max_new_tokens=12)
    assert found and all(found) and not P._COPIES  # packed while generating, freed after
    monkeypatch.setattr(P, "MIN_ROWS", 10**6)  # packing off
    plain_out = tfm.generate(net, ids, max_new_tokens=12)
    assert torch.equal(packed_out, plain_out)
