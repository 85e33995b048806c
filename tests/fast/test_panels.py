"""fast/panels.py: few-row products over packed weights (the panel kernel, or oneDNN) equal
F.linear, eager and compiled; a weight changed after packing is never multiplied stale; packing is
a scoped module swap that leaves the model as it found it."""

import pytest
import torch
import torch.nn.functional as F

from torchformer.fast import panels as P
from torchformer.fast.scope import packed
from torchformer.nn.head import LMHead
from torchformer.nn.linear import Linear

from .built import built_kernels

KINDS = ["panel", "onednn"]


@pytest.fixture(params=KINDS)
def kind(request, monkeypatch):
    """Run a test with each packed form: the panel kernel, and oneDNN (the kernel made unavailable)."""
    if request.param == "panel":
        built_kernels()
    else:
        monkeypatch.setattr(P, "kernels", lambda: None)
    return request.param


def model(d_in=40, d_out=24, bias=True):
    torch.manual_seed(0)
    return torch.nn.Sequential(Linear(d_in, d_out, bias=bias), torch.nn.ReLU(), Linear(d_out, d_in, bias=bias))


def reference(m, x):
    return F.linear(torch.relu(F.linear(x, m[0].weight, m[0].bias)), m[2].weight, m[2].bias)


def count_packed_products(monkeypatch) -> list[str]:
    """Spy on both packed routes: one entry per product that went through a packed copy (per traced
    product when compiled: the op is in the graph, its values checked by the caller); "stale" for
    a panel product whose weight changed since it was packed (the op multiplies plainly then)."""
    found, panel_product, onednn_product = [], P.panel_product, P.onednn_product

    def spy_panels(x2, w, panels, version):
        stale = not torch.compiler.is_compiling() and P.version(w) != version
        found.append("stale" if stale else "panel")
        return panel_product(x2, w, panels, version)

    def spy_onednn(x2, copy):
        found.append("onednn")
        return onednn_product(x2, copy)

    monkeypatch.setattr(P, "panel_product", spy_panels)
    monkeypatch.setattr(P, "onednn_product", spy_onednn)
    return found


@pytest.mark.parametrize("lead", [(3,), (5,), (8, 1), (2, 4), (16,), (64,), (130,)])
@pytest.mark.parametrize("bias", [True, False])
@torch.inference_mode()
def test_packed_products_equal_f_linear(lead, bias, kind, monkeypatch):
    m = model(bias=bias)
    originals = [m[0], m[2]]
    x = torch.randn(*lead, 40)
    found = count_packed_products(monkeypatch)
    with packed(m, rows=8):
        assert isinstance(m[0], P.PackedLinear) and m[0].weight is originals[0].weight  # a twin, same Parameters
        out = m(x)
    assert found == [kind, kind]  # both products went through their packed copies
    torch.testing.assert_close(out, reference(m, x), rtol=1e-5, atol=1e-5)
    assert [m[0], m[2]] == originals  # scoped: the very modules are back, nothing packed kept


def test_the_twins_state_dict_and_parameters_are_the_originals():
    m = model()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    params = list(m.parameters())
    with packed(m, rows=8):
        assert isinstance(m[0], P.PackedLinear) and m.state_dict().keys() == before.keys()  # panels: not state
        assert all(p is q for p, q in zip(m.parameters(), params, strict=True))
        with torch.no_grad():
            m[0].weight.mul_(2.0)  # writes the original's Parameter: they are one
    assert torch.equal(m[0].weight, 2 * before["0.weight"])


@torch.inference_mode()
def test_compiled_products_go_through_the_packed_copy(kind):
    """Compiled: panels from MIN_ROWS rows on (the op in every graph), one graph per row count and
    none more in a second scope, whose twins are new modules; oneDNN's opaque copy stays eager."""
    graphs = []

    def backend(gm, example_inputs):  # records each graph dynamo hands over, runs it as traced
        graphs.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    m = model()
    torch._dynamo.reset()
    row_counts = (P.MIN_ROWS, 8, 16)
    try:
        step = torch.compile(m, dynamic=False, fullgraph=True, backend=backend)
        for _ in range(2):  # two scopes: new twins, same graphs
            with packed(m, rows=8):
                for rows in row_counts:
                    x = torch.randn(rows, 40)
                    torch.testing.assert_close(step(x), reference(m, x), rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == len(row_counts)
    op = getattr(torch.ops.torchformer, "panel_linear", None)  # registered only where the kernels built
    panel_ops = [sum(op is not None and t is op for t in g) for g in graphs]
    assert panel_ops == ([2] * len(row_counts) if kind == "panel" else [0] * len(row_counts))


@pytest.mark.parametrize("n, k", [(16, 16), (17, 9), (40, 300), (1, 513), (33, 1)])
@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17])
def test_panel_kernel_equals_the_product_for_any_shape(n, k, rows):
    """Partial last panel (N not a multiple of 16), K past one K block (256) with more than 8 rows
    (partial sums kept in the output), K of 1, every row-group size."""
    g = torch.Generator().manual_seed(n * 1000 + k + rows)
    w, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    out = built_kernels().panel_mm(x, P.panels(w), n)
    torch.testing.assert_close(out, (x.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)


def test_a_weight_changed_after_packing_is_not_multiplied_stale(kind, monkeypatch):
    m = model()
    x = torch.randn(8, 40)
    found = count_packed_products(monkeypatch)
    with packed(m, rows=8), torch.no_grad():
        m[0].weight.mul_(-2.0)  # an in-place update (optimizer step, load_state_dict's copy_)
        out = m(x)
    torch.testing.assert_close(out, reference(m, x), rtol=1e-5, atol=1e-5)
    assert found == (["stale", "panel"] if kind == "panel" else ["onednn"])  # the changed one: plainly


def test_packing_is_scoped_and_nests():
    m = model()
    with packed(m, rows=2):  # too few rows to pay: nothing packed
        assert type(m[0]) is Linear
    with packed(m, rows=8):
        twin = m[0]
        with packed(m, rows=8):  # already packed: the inner block leaves the outer's twins alone
            assert m[0] is twin
        assert m[0] is twin and isinstance(twin, P.PackedLinear)
    assert type(m[0]) is Linear
    m64 = model().double()
    with packed(m64, rows=8):  # only fp32 CPU weights are packed
        assert type(m64[0]) is Linear


@torch.inference_mode()
def test_a_soft_capped_head_keeps_its_formula(kind):
    head = LMHead(40, 24, bias=False, scale=0.5, softcap=3.0)
    holder = torch.nn.Sequential(head)
    x = torch.randn(8, 40)
    want = head(x)
    with packed(holder, rows=8):
        assert isinstance(holder[0], LMHead) and isinstance(holder[0], P.PackedLinear)
        torch.testing.assert_close(holder(x), want, rtol=1e-5, atol=1e-5)


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
    modules = list(net.modules())
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (batch, 9), generator=g)
    found = count_packed_products(monkeypatch)
    packed_out = tfm.generate(net, ids, max_new_tokens=12)
    assert found and set(found) == {kind}  # packed while generating
    assert list(net.modules()) == modules  # and the model handed back as it was
    monkeypatch.setattr(P, "MIN_ROWS", 10**6)  # packing off
    plain_out = tfm.generate(net, ids, max_new_tokens=12)
    assert torch.equal(packed_out, plain_out)
