"""The quantized linears in the CPU kernels' panels (fast/formats.py): their products equal x,
rounded to 8 bits per block as llama.cpp rounds it (``rounded`` below, written here from the
formats' docstring), times the dequantized weight (in float64 from the portable module's bytes),
eager and under torch.compile; the rounding stays within its bound of the exact product; autograd
takes the exact product; their state dict is the portable module's; ``prepare`` swaps only where
the kernels run, and without them the same model gives outputs within the rounding's error."""

import math

import pytest
import torch
from torch import nn

import torchformer as tfm
from tests.grid import build, variants
from torchformer.fast import bf16 as fast_bf16
from torchformer.fast import formats
from torchformer.nn.quant import Int4Linear, Int8Linear

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (no AVX-512 or no compiler)"
)


def portable(kind: str, n: int, k: int, group: int, bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    group = group or None  # 0: int8's one scale per row
    return (Int8Linear.from_linear(lin, group) if kind == "int8" else Int4Linear.from_linear(lin, group)).eval()


def reference(source, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T + b in float64, W from the portable module's stored bytes."""
    w = source.dequantized().double()
    out = x.double() @ w.T
    return out if source.bias is None else out + source.bias.double()


def block(source) -> int:
    """The activation block the kernel rounds x over: 32, or the largest power of two dividing the
    group (K for int8's one scale per row), K and 32."""
    return math.gcd(math.gcd(32, source.group_size or source.in_features), source.in_features)


def rounded(x: torch.Tensor, size: int) -> torch.Tensor:
    """x (rows, K) with each block of ``size`` inputs rounded to q * s, s = max|x| / 127, q an
    integer (half to even), in fp32 as the kernel computes q = round(x * (127 / max|x|))."""
    rows, K = x.shape
    blocks = x.float().reshape(rows, K // size, size)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv).double() * (amax / 127).double()).reshape(rows, K)


def rounding_bound(source, x: torch.Tensor) -> torch.Tensor:
    """Per output, the most x's rounding can move x @ W^T: sum over blocks of s / 2 * sum |w|
    (rows, N)."""
    size = block(source)
    rows, K = x.shape
    half_step = x.double().abs().reshape(rows, K // size, size).amax(-1) / 127 / 2  # (rows, K/size)
    w = source.dequantized().double().abs().reshape(source.out_features, K // size, size).sum(-1)  # (N, K/size)
    return half_step @ w.T


# (kind, N, K, group): N off the 16-row panel grid, K from one line to several blocks, every group.
SHAPES = [
    ("int8", 40, 64, 0), ("int8", 33, 132, 0), ("int8", 256, 512, 0), ("int8", 17, 4, 0),
    ("int4", 40, 64, 8), ("int4", 33, 128, 32), ("int4", 48, 512, 64), ("int4", 20, 256, 128),
    ("int4", 16, 96, 16), ("int8", 40, 128, 32), ("int8", 33, 96, 16), ("int8", 24, 64, 4),
]  # fmt: skip


@pytest.mark.parametrize("kind,n,k,group", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 40])
def test_product_equals_the_dequantized_reference(kind, n, k, group, rows):
    source = portable(kind, n, k, group, bias=rows % 2 == 1)
    twin = formats.fits(source)(source)
    x = torch.randn(rows, k)
    with torch.no_grad():
        out = twin(x)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), reference(source, rounded(x, block(source))), rtol=1e-5, atol=1e-5)
    error = (out.double() - reference(source, x)).abs()
    assert (error <= rounding_bound(source, x) + 1e-5).all()
    assert error.max() > 1e-6  # the activations were rounded: the reference above is not the exact one


def test_rounding_is_per_block_so_one_large_input_spoils_only_its_block():
    source = portable("int4", 16, 128, 32, bias=False)
    twin = formats.fits(source)(source)
    x = torch.randn(1, 128)
    x[0, 5] = 1000.0  # block 0's step becomes ~8; blocks 1-3 keep theirs
    with torch.no_grad():
        out = twin(x).double()
    torch.testing.assert_close(out, reference(source, rounded(x, 32)), rtol=1e-5, atol=1e-3)
    whole_row = reference(source, rounded(x, 128))  # one scale for the row: every block rounded by ~8
    assert not torch.allclose(out, whole_row, rtol=1e-5, atol=1e-3)  # so the check above can tell them apart


def test_leading_dims_and_bf16_activations():
    source = portable("int4", 24, 64, 32, bias=True)
    twin = formats.fits(source)(source)
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.no_grad():
        out = twin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 24)
    expected = reference(source, rounded(x.float().reshape(6, 64), 32)).reshape(2, 3, 24)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the result


@pytest.mark.parametrize("kind,group", [("int8", 0), ("int8", 32), ("int4", 16)])
def test_state_dict_is_the_portable_one_and_loads_back(kind, group):
    source = portable(kind, 37, 64, group, bias=True)
    twin = formats.fits(source)(source)
    a, b = source.state_dict(), twin.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) and a[name].dtype == b[name].dtype for name in a)
    assert not hasattr(twin, "qweight")  # one copy of the bytes: the panels only
    other = portable(kind, 37, 64, group, bias=True, seed=1)
    twin.load_state_dict(other.state_dict())  # repacked from the portable layout
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.testing.assert_close(twin(x).double(), reference(other, rounded(x, block(other))), rtol=1e-5, atol=1e-5)
    assert isinstance(twin, type(source))  # still the scheme's module for every isinstance check


@pytest.mark.parametrize("kind,group", [("int8", 0), ("int4", 32)])
def test_compiled_forward_calls_the_kernel(kind, group):
    import torch._dynamo.testing
    from torch._inductor.utils import run_and_get_code

    source = portable(kind, 48, 128, group, bias=True)
    twin = formats.fits(source)(source)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(twin, backend=counter, fullgraph=True)
    x = torch.randn(2, 128)
    with torch.no_grad():
        out, code = run_and_get_code(compiled, x)
        compiled(torch.randn(2, 128))  # same shapes: no second compile
    assert counter.frame_count == 1
    assert f"torchformer.{kind}_mm" in "".join(code)  # the kernel, not a dequantized weight, in the graph
    torch.testing.assert_close(out.double(), reference(source, rounded(x, block(source))), rtol=1e-5, atol=1e-5)


def test_autograd_takes_the_reference_product():
    source = portable("int4", 24, 64, 16, bias=False)
    twin = formats.fits(source)(source)
    x = torch.randn(3, 64, requires_grad=True)
    twin(x).square().sum().backward()
    xr = x.detach().double().requires_grad_()
    (xr @ source.dequantized().double().T).square().sum().backward()
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 16)])
def test_prepare_swaps_only_with_the_kernels_and_outputs_agree(monkeypatch, scheme, group):
    v = next(v for v in variants(("decoder",)) if not v["bias"])
    fast = tfm.quantize(build(v), scheme, group_size=group)
    kinds = {type(m) for m in fast.modules()}
    assert formats.Int8Panels in kinds or formats.Int4Panels in kinds
    monkeypatch.setattr(formats, "ops_ready", lambda: False)  # as where the build failed
    plain = tfm.quantize(build(v), scheme, group_size=group)
    assert not any(isinstance(m, formats.PanelLinear) for m in plain.modules())
    ids = torch.randint(0, fast.config.vocab_size, (2, 7))
    with torch.no_grad():
        a, b = fast(ids), plain(ids)
    # The kernels round the activations to 8 bits per block (~0.4% of a block's largest value),
    # the plain modules do not: the logits agree to ~1% of their spread, not bit for bit.
    assert (a - b).abs().max() <= 0.02 * b.std()


@pytest.mark.parametrize("n,k", [(40, 64), (33, 70), (7, 16), (50, 300), (5, 7)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 70])
def test_bf16_product_over_the_weight_as_it_is(n, k, rows):
    torch.manual_seed(n * rows)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k)
    out = torch.ops.torchformer.bf16_linear(x, w)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not fast_bf16.DOT_UNITS, reason="needs a CPU with AVX512-BF16 (vdpbf16ps) and the AVX-512 build")
@pytest.mark.parametrize("n,k", [(40, 64), (33, 70), (7, 16), (50, 300), (5, 7), (3, 129)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_bf16_dot_over_bf16_rows_sums_their_products_in_fp32(n, k, rows):
    """The vdpbf16ps product: bf16 x and w as they are, every pair product summed in fp32 (each
    product of two bf16 is exact in fp32, so only the sums round), masked tails past K included."""
    torch.manual_seed(n * rows + k)
    w, x = torch.randn(n, k).bfloat16(), torch.randn(rows, k).bfloat16()
    out = torch.ops.torchformer.bf16_dot(x, w)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, rtol=1e-5, atol=1e-4)


def test_bf16_linear_shares_its_parameters_and_trains_as_before():
    from torchformer.nn.linear import Linear

    torch.manual_seed(0)
    source = Linear(48, 20).bfloat16()
    twin = fast_bf16.Bf16Linear.of(source)
    assert twin.weight is source.weight and twin.bias is source.bias  # no copy
    assert twin.state_dict().keys() == source.state_dict().keys()
    x = torch.randn(2, 3, 48).bfloat16()
    with torch.no_grad():
        out = twin(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 20)
    expected = x.double() @ source.weight.double().T + source.bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=2e-2)  # one bf16 rounding of the result
    long = torch.randn(2, fast_bf16.WIDEN_ROWS, 48).bfloat16()  # a prefill: widened slices and MKL
    with torch.no_grad():
        got = twin(long)
    expected = long.double() @ source.weight.double().T + source.bias.double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=2e-2)
    twin(x).float().sum().backward()  # autograd: Linear's own product and gradients
    assert twin.weight.grad is not None and twin.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("units", [True, False])
def test_bf16_units_route_bf16_activations_by_rows_and_the_kernel_takes_the_rest(monkeypatch, units):
    """On a CPU with bf16 units (fast_bf16.BF16_UNITS, patched here so both routes run on any CPU) bf16
    activations go to the vdpbf16ps kernel below DOT_ROWS rows where the CPU has AVX512-BF16
    (fast_bf16.DOT_UNITS: never patched on, it would run an instruction the CPU lacks) and to F.linear's
    bf16 product from there, or from UNIT_ROWS rows without AVX512-BF16; fp32 activations and CPUs
    without the units take the kernel over fp32 x (spies count both kernels' calls)."""
    from torchformer.nn.linear import Linear

    dot = units and fast_bf16.DOT_UNITS
    monkeypatch.setattr(fast_bf16, "BF16_UNITS", units)
    monkeypatch.setattr(fast_bf16, "DOT_UNITS", dot)
    calls = []
    ops = formats.torch.ops.torchformer
    for name in ("bf16_linear", "bf16_dot"):
        kernel = getattr(ops, name)

        def spy(x, w, kernel=kernel, name=name):
            calls.append((name, x.shape[0]))
            return kernel(x, w)

        monkeypatch.setattr(ops, name, spy)
    torch.manual_seed(0)
    source = Linear(64, 24).bfloat16()
    twin = fast_bf16.Bf16Linear.of(source)
    bf16 = torch.bfloat16
    cases = [(1, bf16), (fast_bf16.UNIT_ROWS - 1, bf16), (fast_bf16.UNIT_ROWS, bf16), (9, bf16),
             (fast_bf16.DOT_ROWS - 1, bf16), (fast_bf16.DOT_ROWS, bf16), (9, torch.float32)]  # fmt: skip
    with torch.no_grad():
        for rows, dtype in cases:
            x = torch.randn(rows, 64).to(dtype)
            calls.clear()
            out = twin(x)
            on_dot = dot and dtype == bf16 and rows < fast_bf16.DOT_ROWS
            native = units and dtype == bf16 and not on_dot and rows >= fast_bf16.UNIT_ROWS
            expected_calls = [] if native else [("bf16_dot" if on_dot else "bf16_linear", rows)]
            assert calls == expected_calls, (rows, dtype)
            if native:  # the very product F.linear makes
                assert torch.equal(out, torch.nn.functional.linear(x, source.weight, source.bias))
            else:  # fp32 sums of the same products, one rounding to x's dtype
                expected = x.double() @ source.weight.double().T + source.bias.double()
                torch.testing.assert_close(out.double(), expected.to(dtype).double(), rtol=1e-2, atol=2e-2)


def test_prepare_moves_a_bf16_model_onto_the_kernel_and_greedy_decoding_agrees(monkeypatch):
    v = next(v for v in variants(("decoder",)) if not v["bias"])
    fast = build(v).bfloat16().eval()
    plain = build(v).bfloat16().eval()
    assert formats.prepare(fast) > 0 and any(type(m) is fast_bf16.Bf16Linear for m in fast.modules())
    assert formats.prepare(fast) == 0  # idempotent
    ids = torch.randint(0, fast.config.vocab_size, (2, 7))
    with torch.no_grad():
        a, b = fast(ids).float(), plain(ids).float()
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)  # bf16 roundings of the same fp32 sums, reordered
    monkeypatch.setattr(formats, "ops_ready", lambda: False)
    other = build(v).bfloat16().eval()
    assert formats.prepare(other) == 0 and not any(type(m) is fast_bf16.Bf16Linear for m in other.modules())


def products():
    """int8 and int4 (groups 32, 16) twins' products at 11 rows (tests/fast/no_vnni.py)."""
    torch.manual_seed(1)
    x = torch.randn(11, 128)
    kinds = (("int8", 0), ("int4", 32), ("int4", 16))
    sources = [portable(kind, 40, 128, group, bias=False) for kind, group in kinds]
    return [x], [formats.fits(source)(source)(x) for source in sources]


def test_the_kernels_without_vnni_give_the_same_products(no_vnni):
    """The copies for a CPU without AVX512-VNNI (csrc/quantized.cpp) give this process's products
    bit for bit (tests/fast/no_vnni.py)."""
    from tests.fast.no_vnni import assert_same_bits

    assert_same_bits("tests.fast.test_formats:products", no_vnni)


@pytest.mark.parametrize("scheme,group", [("int8", None), ("int4", 16)])
def test_a_partial_load_builds_no_portable_copy_and_names_the_same_missing_keys(monkeypatch, scheme, group):
    """load_state_dict(strict=False) of tensors none of which are a panel module's (a GGUF file's
    float tensors, an adapter): the panel modules build no portable copy to repack (at the 1B shape
    that held 1.7 GB more at the GGUF load's peak) and the missing keys are those the portable
    modules report for the same dict; a dict that has a module's keys still loads them."""
    v = next(v for v in variants(("decoder",)) if v["bias"])
    fast = tfm.quantize(build(v), scheme, group_size=group)
    twins = [m for m in fast.modules() if isinstance(m, formats.PanelLinear)]
    if not twins:
        pytest.skip("the CPU kernels are not built here")
    floats = {k: t for k, t in fast.state_dict().items() if k.endswith("norm.weight")}
    assert floats
    monkeypatch.setattr(formats, "ops_ready", lambda: False)
    plain = tfm.quantize(build(v), scheme, group_size=group)
    expected = plain.load_state_dict(floats, strict=False).missing_keys
    monkeypatch.undo()
    built = []
    for cls in {type(m) for m in twins}:  # each twin class defines its own portable()
        monkeypatch.setattr(cls, "portable", lambda self, own=cls.portable: built.append(self) or own(self))
    result = fast.load_state_dict(floats, strict=False)
    assert built == [] and sorted(result.missing_keys) == sorted(expected)
    # The other way: a module's own keys still go through its portable copy and are loaded.
    head = {k: t for k, t in plain.state_dict().items() if k.startswith("lm_head.")}
    head = {k: (t + 1 if k.endswith("bias") else t) for k, t in head.items()}
    fast.load_state_dict(head, strict=False)
    assert len(built) == 1 and torch.equal(fast.lm_head.bias, head["lm_head.bias"])
