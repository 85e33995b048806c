"""Weight-only int8 / int4 linears (issue 13): outputs equal an explicit dequantise-then-matmul
reference (eager and compiled), the rounding is within half a step, whole models over the variant
grid equal their dequantised float twins, and every bad argument is a clear error."""

import pytest
import torch
import torch.nn.functional as F

import torchformer as tfm
from tests.grid import build, output_logits, params, variants
from torchformer.fast.formats import PanelLinear
from torchformer.nn.linear import Linear, linear
from torchformer.nn.quant import Int4Linear, Int8Linear, QuantLinear


def reference_weight(q) -> torch.Tensor:
    """Dequantise from the stored bytes, written independently of the module's own code (a
    module in the CPU kernels' panels: from the bytes its state dict saves)."""
    if isinstance(q, PanelLinear):
        q = q.portable()
    if isinstance(q, Int8Linear):
        scale = q.scale.to(torch.float64)
        scale = scale[:, None] if q.group_size is None else scale.repeat_interleave(q.group_size, dim=1)
        return q.qweight.to(torch.float64) * scale
    N, K, G = q.out_features, q.in_features, q.group_size
    w = torch.empty(N, K // G, G, dtype=torch.float64)
    byte = q.qweight.long().view(N, K // G, G // 2)
    w[:, :, : G // 2] = (byte % 16 - 8).double()  # low nibble: the group's first half
    w[:, :, G // 2 :] = (byte // 16 - 8).double()  # high nibble: its second half
    return w.view(N, K) * q.scale.double().repeat_interleave(G, dim=1)


def quantized(kind: str, lin: torch.nn.Linear):
    group = int(kind[5:]) if "g" in kind else None
    return Int8Linear.from_linear(lin, group) if kind.startswith("int8") else Int4Linear.from_linear(lin, group)


KINDS = ["int8", "int8g32", "int4g16", "int4g32"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lead", [(1,), (3,), (2, 5), (1, 1), (70,)])
def test_eager_output_equals_dequantised_reference(kind, bias, lead):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=bias)
    q = quantized(kind, lin)
    x = torch.randn(*lead, 64)
    ref = F.linear(x.double(), reference_weight(q), None if q.bias is None else q.bias.double()).float()
    torch.testing.assert_close(q(x), ref, rtol=0, atol=1e-5)
    assert q(x).shape == (*lead, 48)


@pytest.mark.parametrize("kind", KINDS)
def test_rounding_is_within_half_a_step_and_scales_are_max_abs(kind):
    torch.manual_seed(1)
    lin = torch.nn.Linear(64, 40)
    with torch.no_grad():
        lin.weight[3] = 0.0  # an all-zero row must not divide by zero
    q = quantized(kind, lin)
    w = lin.weight.double()
    qmax = 127 if kind.startswith("int8") else 7
    group = q.group_size or 64
    amax = w.abs().reshape(40, 64 // group, group).amax(-1)
    expected_scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    torch.testing.assert_close(q.scale.double().reshape(40, -1), expected_scale, rtol=1e-6, atol=0)
    step = expected_scale.repeat_interleave(group, dim=1)
    assert ((reference_weight(q) - w).abs() <= step / 2 + 1e-7).all()
    assert (reference_weight(q)[3] == 0).all()
    assert q.qweight.dtype == (torch.int8 if kind.startswith("int8") else torch.uint8)
    assert q.qweight.numel() == (64 * 40 if kind.startswith("int8") else 64 * 40 // 2)  # two int4 per byte


def test_compiled_outputs_equal_reference_for_one_and_several_rows():
    """One graph holding a float Linear and both quantized kinds, at 1 and 3 rows (the compiled
    multiply + sum path) and 20 rows (the dequantise + matmul path)."""
    torch.manual_seed(2)
    lin = Linear(64, 48)
    mods = [lin, quantized("int8", lin), quantized("int4g32", lin)]
    refs = [lin.weight.double(), reference_weight(mods[1]), reference_weight(mods[2])]
    fn = torch.compile(lambda x: [m(x) for m in mods], dynamic=False, fullgraph=True)
    for lead in [(1, 1), (3, 1), (20,)]:
        x = torch.randn(*lead, 64)
        for got, w in zip(fn(x), refs):
            torch.testing.assert_close(got, F.linear(x.double(), w, lin.bias.double()).float(), rtol=0, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 70, 300])
def test_int8_bf16_inference_never_dequantises_the_matrix(rows, monkeypatch):
    """bf16 products of any row count run on the int8 bytes (torch's int8 weight-only kernel): a
    float copy of the matrix is never made, and the output is the dequantised product."""
    torch.manual_seed(3)
    q = quantized("int8", torch.nn.Linear(128, 96))
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref = F.linear(x.double(), reference_weight(q), q.bias.double())
    monkeypatch.setattr(Int8Linear, "dequantized", lambda self: pytest.fail("dequantised the whole weight"))
    got = q(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # The kernel rounds the scales to bf16 (8 significant bits) and returns bf16.
    torch.testing.assert_close(got.double(), ref, rtol=0.02, atol=0.05)


def test_int8_with_autograd_keeps_the_differentiable_product():
    """QLoRA trains adapters over a quantized base: the input's gradient flows through the base
    (the int8 kernel has no backward), equal to the dequantised weight's."""
    torch.manual_seed(4)
    q = quantized("int8", torch.nn.Linear(64, 32))
    x = torch.randn(6, 64, requires_grad=True)
    q(x).square().sum().backward()
    x_ref = x.detach().double().requires_grad_()
    F.linear(x_ref, reference_weight(q), q.bias.double()).square().sum().backward()
    torch.testing.assert_close(x.grad.double(), x_ref.grad, rtol=0, atol=1e-4)


@pytest.mark.parametrize("v", **params(variants()))
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_model_equals_its_dequantised_float_twin(v, scheme):
    model = build(v)
    group = 16 if scheme == "int4" else None
    q = tfm.quantize(build(v), scheme, group_size=group)
    twin = build(v)  # same seed: same norms, embeddings, positions
    names = {n for n, m in q.named_modules() if isinstance(m, QuantLinear)}
    assert names and all(not isinstance(m, torch.nn.Linear) for n, m in q.named_modules() if n in names)
    assert all(isinstance(m, torch.nn.Embedding) for n, m in q.named_modules() if n.endswith(".tok"))
    with torch.no_grad():
        for n in names:
            twin.get_submodule(n).weight = torch.nn.Parameter(reference_weight(q.get_submodule(n)).float())
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    torch.testing.assert_close(output_logits(q, ids), output_logits(twin, ids), rtol=0, atol=1e-5)
    assert q.quantization.scheme == scheme


def test_lm_head_optional_and_tied_table_stays_float():
    v = next(v for v in variants(("decoder",)) if not v["bias"])  # tied head
    q = tfm.quantize(build(v), "int8", lm_head=False)
    assert type(q.lm_head) is Linear and q.lm_head.weight is q.embed.tok.weight
    q = tfm.quantize(build(v), "int8")
    assert isinstance(q.lm_head, Int8Linear) and q.embed.tok.weight.dtype == torch.float32


def test_bad_arguments_are_clear_errors():
    v = next(v for v in variants(("decoder",)))
    model = build(v)
    with pytest.raises(ValueError, match=r"scheme='int3': must be one of \['int4', 'int8'\]"):
        tfm.quantize(model, "int3")
    with pytest.raises(ValueError, match=r"group_size=24 does not divide in_features=32 of stack\.blocks\.0"):
        tfm.quantize(model, "int4", group_size=24)
    with pytest.raises(ValueError, match=r"group_size=7: must be an even integer"):
        tfm.quantize(model, "int4", group_size=7)
    with pytest.raises(ValueError, match=r"group_size=24 does not divide in_features=32 of stack\.blocks\.0"):
        tfm.quantize(model, "int8", group_size=24)
    with pytest.raises(TypeError, match=r"lm_head='yes'"):
        tfm.quantize(model, "int8", lm_head="yes")
    with pytest.raises(TypeError, match=r"model must be a torchformer .* got Linear"):
        tfm.quantize(torch.nn.Linear(4, 4))
    assert all(not isinstance(m, QuantLinear) for m in model.modules())  # nothing was touched
    tfm.quantize(model, "int8")
    with pytest.raises(ValueError, match=r"model is already quantized .*scheme='int8'"):
        tfm.quantize(model, "int4")
    model.train()
    with pytest.raises(ValueError, match=r"Int8Linear: a weight-only quantized model cannot be trained"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_linear_compiled_path_is_only_taken_while_compiling():
    """Eager numerics are unchanged: the eager few-row path is bit-identical to before."""
    w, x = torch.randn(48, 32), torch.randn(4, 32)
    assert torch.equal(linear(x, w), (w @ x.t()).t().contiguous())
    assert torch.equal(linear(x[:1], w), F.linear(x[:1], w))
