"""Two-level scales in the kernels' panels (fast/two_level.py, GGUF's K-quants): a portable module
carrying ``scale_parts`` (and ``minimum_parts`` for int4 with minimums) gets a twin that keeps the
int8 sub-scales under f16 super-scales and runs them as llama.cpp's K-quant products do (x rounded
per 256-input super-block, the sub-scales multiplied in the integer sums): its products equal that
arithmetic written out here in float64, not the per-group rounding of the fp32-scales twin; parts
that do not give back the fp32 scales are not taken; the state dict stays the portable one; the
copies without VNNI give the same bits."""

import pytest
import torch

from torchformer.fast import formats
from torchformer.fast.two_level import TwoLevel
from torchformer.nn.quant import Int4Linear, Int8Linear
from torchformer.nn.quant_min import Int4MinLinear

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (neither AVX-512 nor AVX2, or no compiler)"
)

SUPER = 256  # inputs per super-scale, as in every K-quant


def parts(n: int, k: int, group: int, low: int, high: int, g: torch.Generator) -> TwoLevel:
    """Random sub-scales in [low, high) (zeros among them) under f16 super-scales of both signs
    (Q6_K's d is negative as llama.cpp writes it)."""
    sub = torch.randint(low, high, (n, k // group), generator=g).to(torch.int8)
    sup = (torch.randn(n, k // SUPER, generator=g) * 1e-2).half()
    return TwoLevel(sub, sup, SUPER)


def fp32(p: TwoLevel, group: int) -> torch.Tensor:
    """The scales as the GGUF loader computes them: d widened to fp32 times sc (N, K/G)."""
    return p.super.float().repeat_interleave(SUPER // group, dim=1) * p.sub.float()


def source(kind: str, n: int, k: int, group: int, seed: int = 0, with_parts: bool = True):
    """A portable module of random values and two-level scales (with the parts attached or not)."""
    return source_and_values(kind, n, k, group, seed, with_parts)[0]


def source_and_values(kind: str, n: int, k: int, group: int, seed: int = 0, with_parts: bool = True):
    """(module, its integer weights (N, K) as the kernel multiplies them, scale parts, minimum parts
    or None, bias)."""
    g = torch.Generator().manual_seed(seed)
    m = None
    bias = torch.randn(n, generator=g)
    if kind == "int8":  # Q6_K: values in [-32, 31], int8 sc
        s = parts(n, k, group, -128, 128, g)
        q = torch.randint(-32, 32, (n, k), generator=g).to(torch.int8)
        module = Int8Linear(q, fp32(s, group), bias, group)
        w = q
    else:  # Q4_K (int4min): nibbles, 6-bit sc and m
        s = parts(n, k, group, 0, 64, g)
        q = torch.randint(-8, 8, (n, k), generator=g).to(torch.int16)
        w = q
        if kind == "int4":
            module = Int4Linear.from_values(q, fp32(s, group), bias, group)
        else:
            w = q + 8  # w = scale * u - minimum
            m = parts(n, k, group, 0, 64, g)
            module = Int4MinLinear.from_values(q, fp32(s, group), fp32(m, group), bias, group)
            if with_parts:
                module.minimum_parts = m
    if with_parts:
        module.scale_parts = s
    return module.eval(), w, s, m, bias


def rounded(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, K) rounded to int8 per block as the kernel does (fp32 scale max|x| / 127, x * 127 /
    max|x| to nearest even) -> (q (R, K) float64, scales (R, K / block) float64)."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
    return torch.round(xb * inv).reshape(x.shape).double(), (amax / 127.0)[..., 0].double()


def expected_product(kind, w, s, m, bias, x, block):
    """The K-quant product written out: x rounded per ``block`` inputs; per group the integer sum of
    w * q_x times the int8 sub-scale (exact); per block that sum times d * s_x, minus, with minimums,
    dmin * s_x * sum_g m_g * sum_g(q_x); summed over blocks (float64)."""
    n, k = w.shape
    group = k // s.sub.shape[1]
    qx, sx = rounded(x, block)  # (R, K), (R, K / block)
    per_group = torch.einsum("rgk,ngk->rng", qx.view(-1, k // group, group), w.double().view(n, -1, group))
    scaled = per_group * s.sub.double()  # (R, N, K/G): exact integers
    d = s.super.double().repeat_interleave(SUPER // group, dim=1)  # (N, K/G)
    sxg = sx.repeat_interleave(block // group, dim=1)[:, None, :]  # (R, 1, K/G)
    y = (scaled * d * sxg).sum(-1)
    if m is not None:
        xsum = qx.view(x.shape[0], 1, -1, group).sum(-1)  # (R, 1, K/G)
        y = y - (m.sub.double() * m.super.double().repeat_interleave(SUPER // group, dim=1) * xsum * sxg).sum(-1)
    return y + bias.double()


CASES = [("int8", 40, 512, 16), ("int8", 33, 2048, 16), ("int4", 40, 512, 32), ("int4min", 33, 512, 32),
         ("int4min", 17, 2048, 32)]  # fmt: skip


@pytest.mark.parametrize("kind,n,k,group", CASES)
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_two_level_twin_runs_the_k_quant_products(kind, n, k, group, rows):
    module, w, s, m, bias = source_and_values(kind, n, k, group)
    two = formats.fits(module)(module)
    assert two.scale.dtype == torch.int8 and two.super_scale.dtype == torch.float16
    assert two.scale.shape[1] == k // group and two.super_scale.shape[1] == k // SUPER and two.super_group == SUPER
    if kind == "int4min":
        assert two.minimum.dtype == torch.int8 and two.super_min.dtype == torch.float16
    plain_source = source(kind, n, k, group, with_parts=False)
    plain = formats.fits(plain_source)(plain_source)
    assert plain.scale.dtype == torch.float32 and plain.super_scale is None
    x = torch.randn(rows, k) * torch.rand(1, k) * 4  # inputs of unequal size: the rounding block matters
    with torch.no_grad():
        got, per_group = two(x).double(), plain(x).double()
    expected = expected_product(kind, w, s, m, bias, x, SUPER)
    size = expected.abs().max()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6 * size)
    # negative control: x rounded per group (the fp32-scales twin) is off by its rounding, >> the tolerance
    torch.testing.assert_close(per_group, expected_product(kind, w, s, m, bias, x, 32 if group >= 32 else group),
                               rtol=1e-5, atol=1e-6 * size)
    assert (per_group - expected).abs().max() > 100 * 1e-6 * size
    state, expected = two.state_dict(), plain_source.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) and state[name].dtype == expected[name].dtype for name in state)


def test_parts_that_do_not_give_back_the_scales_are_not_taken():
    module = source("int4min", 40, 512, 32)
    wrong = module.scale_parts.sub.clone()
    wrong[5, 3] += 1  # one group's scale no longer d * sc
    module.scale_parts = TwoLevel(wrong, module.scale_parts.super, SUPER)
    twin = formats.fits(module)(module)
    assert twin.scale.dtype == torch.float32 and twin.super_scale is None and twin.minimum.dtype == torch.float32
    module = source("int4min", 40, 512, 32)
    del module.minimum_parts  # scales alone: the kernel takes both two-level or neither
    twin = formats.fits(module)(module)
    assert twin.scale.dtype == torch.float32 and twin.super_scale is None


def test_loading_a_state_dict_keeps_the_products_exact():
    twin = formats.fits(source("int8", 40, 512, 16))(source("int8", 40, 512, 16))
    other = source("int8", 40, 512, 16, seed=1, with_parts=False)
    twin.load_state_dict(other.state_dict())  # new scales: the old parts no longer hold
    expected = formats.fits(other)(other)
    x = torch.randn(3, 512)
    with torch.no_grad():
        assert torch.equal(twin(x), expected(x))


def products():
    """Every CASES twin's products at 9 rows (tests/fast/no_vnni.py)."""
    torch.manual_seed(1)
    xs = [torch.randn(9, k) for _, _, k, _ in CASES]
    return xs, [formats.fits(source(*c))(source(*c))(x) for c, x in zip(CASES, xs)]


def test_the_kernels_without_vnni_give_the_same_bits(no_vnni):
    from tests.fast.no_vnni import assert_same_bits

    assert_same_bits("tests.fast.test_quant_two_level:products", no_vnni)
