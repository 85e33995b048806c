"""Attention module and backends: parameter count, score scaling, masking, math == sdpa."""

import pytest
import torch

from torchformer.nn.attention import Attention
from torchformer.nn.backends import math_attention, sdpa_attention
from torchformer.nn.masks import causal_mask, combine, padding_mask, window_mask
from torchformer.nn.positions import ALiBiBias, RelativePositionBias

BACKENDS = [math_attention, sdpa_attention]


def attention(d_model, n_heads, n_kv_heads=None, head_dim=None, bias=False):
    return Attention(
        d_model,
        n_heads,
        n_kv_heads or n_heads,
        head_dim or d_model // n_heads,
        bias=bias,
        out_bias=bias,
        dropout=0.0,
        backend=math_attention,
        rotate=None,
    )


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16, 32, 64])
def test_mha_parameters_are_4_d_squared_for_every_head_count(n_heads):
    d = 64
    assert sum(p.numel() for p in attention(d, n_heads).parameters()) == 4 * d * d
    assert sum(p.numel() for p in attention(d, n_heads, bias=True).parameters()) == 4 * d * d + 4 * d


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(8, 4), (8, 2), (8, 1)])
def test_gqa_shrinks_only_k_and_v(n_heads, n_kv_heads):
    d, hd = 64, 8
    expected = 2 * d * d + 2 * d * n_kv_heads * hd
    assert sum(p.numel() for p in attention(d, n_heads, n_kv_heads).parameters()) == expected


@pytest.mark.parametrize("d_k", [16, 64, 256])
def test_scaled_scores_have_unit_variance(d_k):
    module = attention(2 * d_k, 2)
    assert module.head_dim == d_k
    gen = torch.Generator().manual_seed(d_k)
    q, k = torch.randn(1024, d_k, generator=gen), torch.randn(1024, d_k, generator=gen)
    raw = q @ k.T
    assert raw.var().item() == pytest.approx(d_k, rel=0.06)  # unscaled: variance d_k
    assert (raw * module.scale).var().item() == pytest.approx(1.0, rel=0.06)


def random_qkv(B=2, H=4, K=2, T=7, S=7, E=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, E, generator=gen, dtype=dtype)
    k = torch.randn(B, K, S, E, generator=gen, dtype=dtype)
    v = torch.randn(B, K, S, E, generator=gen, dtype=dtype)
    return q, k, v


def test_masked_keys_get_exactly_zero_weight():
    q, k, v = random_qkv(T=6, S=9)
    mask = torch.rand(2, 1, 6, 9, generator=torch.Generator().manual_seed(1)) > 0.4
    mask[..., 0] = True  # every row sees something
    bias = torch.randn(2, 4, 6, 9)
    _, w = math_attention(q, k, v, mask=mask, bias=bias, scale=0.35, need_weights=True)
    assert w.shape == (2, 4, 6, 9)
    assert (w.masked_select(~mask.expand_as(w)) == 0.0).all()
    assert torch.allclose(w.sum(-1), torch.ones(2, 4, 6))
    assert (w.masked_select(mask.expand_as(w)) > 0).all()


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fully_masked_query_row_gives_zeros_not_nan(backend, dtype, with_bias):
    q, k, v = random_qkv(dtype=dtype, T=5, S=5)
    q.requires_grad_(True)
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    mask[0, 0, :, :2] = False  # row 0: queries 0 and 1 see nothing (left padding)
    bias = torch.randn(1, 4, 5, 5) if with_bias else None
    out = backend(q, k, v, mask=mask, bias=bias, scale=0.35)
    assert not out.isnan().any()
    assert (out[0, :, :2] == 0).all()
    assert (out[0, :, 2:] != 0).any() and (out[1] != 0).all()
    out.float().sum().backward()
    assert torch.isfinite(q.grad).all()


def cases():
    """(name, T, S, K, mask, bias, is_causal) covering every way the stack calls a backend."""
    B, H, T = 2, 4, 7
    q_pos = torch.arange(T)[None].expand(B, -1)
    valid = torch.ones(B, T, dtype=torch.long)
    valid[0, :3] = 0
    causal = causal_mask(q_pos, q_pos)
    alibi = ALiBiBias(H)(q_pos, q_pos)
    rel = RelativePositionBias(H, 8, 20, bidirectional=False)
    torch.nn.init.normal_(rel.weight, generator=torch.Generator().manual_seed(3))
    cached_q = torch.tensor([[5, 6], [3, 4]])  # a 2-token chunk after a prefix, per-row positions
    k_slots = torch.arange(9)[None]
    return [
        ("causal", T, T, H, None, None, True),
        ("causal-mask", T, T, H, causal, None, False),
        ("bidirectional", T, T, H, None, None, False),
        ("padded-bidirectional", T, T, H, padding_mask(valid), None, False),
        ("padded-causal", T, T, H, combine(causal, padding_mask(valid)), None, False),
        ("gqa", T, T, 2, causal, None, False),
        ("mqa-causal", T, T, 1, None, None, True),
        ("alibi", T, T, 2, causal, alibi, False),
        ("alibi-padded", T, T, H, combine(causal, padding_mask(valid)), alibi, False),
        ("relative-bias", T, T, 1, causal, rel(q_pos, q_pos), False),
        ("sliding-window", T, T, 2, combine(causal, window_mask(q_pos, q_pos, 3)), None, False),
        ("cached-chunk", 2, 9, 2, causal_mask(cached_q, k_slots), None, False),
        # is_causal with fewer queries than keys: the triangle is aligned bottom-right in both
        ("is-causal-chunk", 3, 9, 2, None, None, True),
        ("is-causal-with-bias", T, T, H, None, alibi, True),
        ("is-causal-and-padding", T, T, H, padding_mask(valid), None, True),
    ]


@pytest.mark.parametrize("case", cases(), ids=lambda c: c[0])
def test_math_equals_sdpa(case):
    _, T, S, K, mask, bias, is_causal = case
    q, k, v = random_qkv(K=K, T=T, S=S, seed=len(case[0]))
    kwargs = dict(mask=mask, bias=bias, is_causal=is_causal, scale=8**-0.5)
    ref, sdpa = math_attention(q, k, v, **kwargs), sdpa_attention(q, k, v, **kwargs)
    assert (ref - sdpa).abs().max().item() < 1e-5


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda f: f.__name__)
def test_is_causal_equals_explicit_bottom_right_triangle(backend):
    q, k, v = random_qkv(T=3, S=7)
    q_pos, k_pos = torch.arange(4, 7)[None].expand(2, -1), torch.arange(7)[None]
    a = backend(q, k, v, is_causal=True, scale=0.3)
    b = backend(q, k, v, mask=causal_mask(q_pos, k_pos), scale=0.3)
    assert (a - b).abs().max().item() < 1e-6


def test_forward_uses_the_backend_attribute():
    """Analysis tools swap ``backend``; the module must call whatever is there."""
    module = attention(32, 4).eval()
    calls = []

    def spy(q, k, v, **kw):
        calls.append(q.shape)
        return math_attention(q, k, v, **kw)

    module.backend = spy
    x = torch.randn(2, 5, 32)
    from torchformer.nn.attention import AttnInputs

    module(x, AttnInputs(rope=None, mask=None, bias=None, is_causal=True, slots=None))
    assert calls == [(2, 4, 5, 8)]


def test_cross_attention_uses_source_keys():
    module = attention(32, 4, 2).eval()
    from torchformer.nn.attention import AttnInputs

    ctx = AttnInputs(rope=None, mask=None, bias=None, is_causal=False, slots=None)
    x, memory = torch.randn(2, 3, 32), torch.randn(2, 6, 32)
    k, v = module.project_kv(memory)
    assert k.shape == v.shape == (2, 2, 6, 8)
    out = module.cross(x, (k, v), ctx)
    assert out.shape == (2, 3, 32)
    # Permuting the source leaves cross-attention unchanged (no positions on memory).
    perm = torch.randperm(6)
    out2 = module.cross(x, module.project_kv(memory[:, perm]), ctx)
    assert (out - out2).abs().max() < 1e-6
