"""Multi-head latent attention: the expanded form against explicit per-head formulas, and the
cached (absorbed, latent-only cache) path == the uncached one over prefill + token by token."""

import itertools

import pytest
import torch

from torchformer.nn.attention import AttnInputs
from torchformer.nn.backends import math_attention, sdpa_attention
from torchformer.nn.kv_cache import LayerCache
from torchformer.nn.latent_attention import LatentAttention
from torchformer.nn.positions import RotaryTable, rotate_half, rotate_interleaved

D, H, C, N, R, V = 32, 4, 12, 8, 6, 10
BACKENDS = {"math": math_attention, "sdpa": sdpa_attention}
ROTATIONS = {"half": rotate_half, "interleaved": rotate_interleaved}


def mla(q_rank, backend="math", rotation="half", bias=False):
    m = LatentAttention(D, H, kv_rank=C, q_rank=q_rank, nope_dim=N, rope_dim=R, v_dim=V, bias=bias, dropout=0.0,
                        backend=BACKENDS[backend], rotate=ROTATIONS[rotation], scale=0.7 * (N + R) ** -0.5)  # fmt: skip
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m.eval()


def context(table, pos, cache_len=None):
    if cache_len is None:
        return AttnInputs(rope=table(pos), mask=None, bias=None, is_causal=True, slots=None)
    keys = torch.arange(cache_len + 1)[None, None, None, :]  # (1, 1, 1, S)
    mask = keys <= pos[:, None, :, None]  # (B, 1, T, S): causal over slot positions
    return AttnInputs(rope=table(pos), mask=mask, bias=None, is_causal=False, slots=pos)


def explicit(m, x, table, rotation):
    """Per-head keys and values written out from the weights (DeepSeek-V2 eq. 9-19)."""
    B, T, _ = x.shape
    pos = torch.arange(T)[None].expand(B, T)
    cos, sin = table(pos)
    q = m.q_proj(x).view(B, T, H, N + R).transpose(1, 2)
    c_full = x @ m.kv_down.weight.T + (0 if m.kv_down.bias is None else m.kv_down.bias)
    c, kr = c_full[..., :C], c_full[..., C:]
    c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * m.kv_norm.weight
    up = m.kv_up.weight.view(H, N + V, C)
    out = []
    for h in range(H):
        k_h = torch.cat([c @ up[h, :N].T, ROTATIONS[rotation](kr[:, None], cos, sin)[:, 0]], -1)  # (B, T, N + R)
        q_h = torch.cat([q[:, h, :, :N], ROTATIONS[rotation](q[:, h : h + 1, :, N:], cos, sin)[:, 0]], -1)
        s = (q_h @ k_h.transpose(1, 2)) * m.scale
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
        out.append(s.softmax(-1) @ (c @ up[h, N:].T))  # (B, T, V)
    return m.o_proj(torch.cat(out, -1))


@pytest.mark.parametrize(("q_rank", "rotation"), list(itertools.product([None, 16], ["half", "interleaved"])))
def test_expanded_equals_explicit_heads(q_rank, rotation):
    m, table = mla(q_rank, rotation=rotation), RotaryTable(R, 10000.0)
    x = torch.randn(2, 9, D)
    pos = torch.arange(9)[None].expand(2, 9)
    torch.testing.assert_close(m(x, context(table, pos)), explicit(m, x, table, rotation), atol=1e-5, rtol=1e-5)


GRID = list(itertools.product([None, 16], ["math", "sdpa"], ["half", "interleaved"], [False, True]))


@pytest.mark.parametrize(("q_rank", "backend", "rotation", "bias"), GRID)
def test_cached_absorbed_equals_uncached(q_rank, backend, rotation, bias):
    """Prefill 5 tokens, then 4 one at a time, through the latent cache == one full forward."""
    m, table = mla(q_rank, backend, rotation, bias), RotaryTable(R, 10000.0)
    B, T, P, S = 3, 9, 5, 16
    x = torch.randn(B, T, D)
    full = m(x, context(table, torch.arange(T)[None].expand(B, T)))
    cache = LayerCache(torch.zeros(B, 1, S + 1, C), torch.zeros(B, 1, S + 1, R))
    steps = [m(x[:, :P], context(table, torch.arange(P)[None].expand(B, P), S), cache)]
    for t in range(P, T):
        steps.append(m(x[:, t : t + 1], context(table, torch.full((B, 1), t), S), cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-5, rtol=1e-4)
    assert cache.k.shape == (B, 1, S + 1, C) and cache.v.shape == (B, 1, S + 1, R)  # latent + rotary key only


def test_gradients_flow_through_every_weight():
    m = mla(16).train()
    table = RotaryTable(R, 10000.0)
    m(torch.randn(2, 6, D), context(table, torch.arange(6)[None].expand(2, 6))).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())
