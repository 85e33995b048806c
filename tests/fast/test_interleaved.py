"""Interleaved int8 / int4 panels (fast/quant_panels.py ``interleave``, csrc/quantized.cpp's layout):
each group of the build's ways' panels stored line by line with each weight group's scales (and
minimums) after its lines, so one row of x reads a thread's panels as one stream. The layout is where
the definition puts each line and scale (checked on a hand-built example);
the products over it equal the products over the same panels in order, bit for bit, for every
format that interleaves (int8 per row and per group, int4, int4 with minimums, f16 scales), panel
counts off the group grid and row counts from 1 to past 8; a row alone gives the bits it gives in a
batch of up to 8; the formats that do not interleave keep their panels in order; the ops refuse another
width; q/k/v narrower than a group join with their panels in order."""

import copy

import pytest
import torch
from torch import nn

import torchformer as tfm
from tests.grid import build, variants
from torchformer.fast import formats
from torchformer.fast import panels as layout
from torchformer.fast.int4_panels import Int4MinPanels, Int4Panels
from torchformer.fast.int8_panels import Int8Panels
from torchformer.nn.attention import Attention
from torchformer.nn.quant import Int4Linear, Int8Linear
from torchformer.nn.quant_min import Int4MinLinear

pytestmark = pytest.mark.skipif(
    not formats.ops_ready(), reason="the CPU kernels are not built here (neither AVX-512 nor AVX2, or no compiler)"
)


def ways() -> int:
    return torch.ops.torchformer.panel_ways()


needs_ways = pytest.mark.skipif(
    formats.ops_ready() and ways() == 1, reason="this build keeps panels in order (the AVX2 build)"
)


def test_a_group_is_one_stream_weight_group_by_weight_group_and_a_short_last_group_too(monkeypatch):
    # 5 panels, groups of 4: group 0 holds panels 0-3, group 1 panel 4. Each panel: 4 lines of 2
    # bytes (line u of panel p holds p, u) and one fp32 scale per weight group of 2 lines (100 p + kg)
    lines = torch.tensor([[[p, u] for u in range(4)] for p in range(5)], dtype=torch.uint8)  # (5, 4, 2)
    scales = torch.tensor([[[100.0 * p + kg] for kg in range(2)] for p in range(5)])  # (5, 2, 1)
    expected = []  # by the layout's definition: per weight group, its lines line by line, then its scales
    for first, w in ((0, 4), (4, 1)):
        for kg in range(2):
            expected += [("line", first + j, 2 * kg + u) for u in range(2) for j in range(w)]
            expected += [("scale", first + j, kg) for j in range(w)]
    for chunk in (1, 1 << 20):  # one group a copy, or all at once
        monkeypatch.setattr(layout, "RELAYOUT_CHUNK", chunk)
        stream = layout.to_stream([lines, scales], groups=2, ways=4)
        assert stream.shape == (5, 4 * 2 + 2 * 4) and stream.dtype == torch.uint8
        flat, at, got = stream.reshape(-1), 0, []
        for kind, _, _ in expected:  # memory order, each item read as the kind expected there
            if kind == "line":
                got.append(("line", int(flat[at]), int(flat[at + 1])))
                at += 2
            else:
                value = int(flat[at : at + 4].clone().view(torch.float32))
                got.append(("scale", value // 100, value % 100))
                at += 4
        assert got == expected
        back = layout.from_stream(stream, [((4, 2), torch.uint8), ((2, 1), torch.float32)], groups=2, ways=4)
        assert torch.equal(back[0], lines) and torch.equal(back[1], scales)


def in_order(twin):
    """A copy of ``twin`` with its panels one after another (ways 1): the same values, the other layout."""
    plain = copy.deepcopy(twin)
    plain.interleave(1)
    return plain


def twin_of(kind: str, n: int, k: int, group: int, f16: bool = False):
    torch.manual_seed(n + k + group)
    lin = nn.Linear(k, n)
    if kind == "int8":
        return Int8Panels(Int8Linear.from_linear(lin, group or None).eval())
    if kind == "int4min":
        return Int4MinPanels(Int4MinLinear.from_linear(lin, group).eval())
    source = Int4Linear.from_linear(lin, group)
    if f16:  # scales f16 holds exactly (a GGUF Q4_0 file's): the panels keep them in f16
        q, scale = source.values(slice(0, n))
        scale = torch.randint(1, 64, scale.shape).float() * 2**-10
        source = Int4Linear.from_values(q, scale, lin.bias.detach(), group)
    return Int4Panels(source.eval())


FORMATS = [("int8", 0, False), ("int8", 32, False), ("int4", 32, False), ("int4", 64, True), ("int4min", 32, False)]


@needs_ways
@pytest.mark.parametrize("kind,group,f16", FORMATS)
@pytest.mark.parametrize("panels", [1, 3, 4, 5, 9])
def test_products_equal_the_panels_in_order_bit_for_bit(kind, group, f16, panels):
    twin = twin_of(kind, 16 * panels - (panels > 1) * 5, 2048, group, f16)
    assert twin.ways == ways() and (twin.scale.dtype == torch.float16) == f16
    plain = in_order(twin)
    x = torch.randn(17, 2048)  # two K blocks of int8 past 8 rows
    with torch.no_grad():
        for rows in (1, 2, 3, 8, 9, 17):
            got = twin(x[:rows])
            assert torch.equal(got, plain(x[:rows])), f"{rows} rows"
            if rows <= 8:  # one pass over all of K (more rows go over K blocks, in both layouts)
                assert torch.equal(got[rows - 1 :], twin(x[rows - 1 : rows])), f"the last of {rows} rows alone"


@needs_ways
def test_state_and_repacking_see_the_panels_in_order():
    twin = twin_of("int4", 72, 128, 32)
    source = Int4Linear.from_linear(nn.Linear(128, 72), 32)
    twin.load_state_dict(source.state_dict())  # repacked into panels in order, then interleaved again
    assert twin.ways == ways()
    assert all(torch.equal(a, b) for a, b in zip(twin.state_dict().values(), source.state_dict().values()))
    torch.testing.assert_close(twin.dequantized(), source.dequantized(), rtol=0, atol=0)


def test_formats_that_do_not_interleave_keep_their_panels_in_order():
    # 6-bit values (GGUF's Q6_K, fast/low_bits.py): units of three lines, panels one after another
    q = torch.randint(-32, 32, (40, 128), dtype=torch.int8)
    six = Int8Panels(Int8Linear(q, torch.rand(40, 4) + 0.5, None, 32).eval())
    assert six.bits == 6 and six.ways == 1


@needs_ways
def test_the_ops_refuse_another_width_and_scales_beside_an_interleaved_stream():
    twin = twin_of("int4", 64, 128, 32)
    x = torch.randn(1, 128)
    with pytest.raises(RuntimeError, match=r"ways must be 1 or 4 .* got 3"):
        torch.ops.torchformer.int4_mm(x, twin.panels, twin.scale, 64, 32, None, 0, 3)
    scales = twin.in_order("scale")  # (4, 4, 16): where the stream holds them already
    with pytest.raises(RuntimeError, match="interleaved, scale must be an empty"):
        torch.ops.torchformer.int4_mm(x, twin.panels, scales, 64, 32, None, 0, ways())
    with pytest.raises(RuntimeError, match=r"the panels do not match N and K \(interleaved"):
        torch.ops.torchformer.int4_mm(x, in_order(twin).panels, twin.scale, 64, 32, None, 0, ways())


@needs_ways
def test_members_narrower_than_a_group_join_with_their_panels_in_order():
    v = next(v for v in variants() if v["arch"] == "decoder" and v["heads"] == "mha")
    narrow, wide = build(v), build(v, d_model=128)  # q, k, v of two panels each / of eight
    for model, d in ((narrow, 32), (wide, 128)):
        tfm.quantize(model, "int8")
        owners = [m for m in model.modules() if isinstance(m, Attention)]
        assert owners and all(m.joint is not None for m in owners)
        assert {m.q_proj.ways for m in owners} == {1 if d == 32 else ways()}
        x = torch.randn(3, d)
        with torch.inference_mode():
            joint = owners[0].project(x)
            own = tuple(getattr(owners[0], n)(x) for n in ("q_proj", "k_proj", "v_proj"))
        assert all(torch.equal(a, b) for a, b in zip(joint, own))
