"""T5's pieces one by one against transformers' own modules on the same weights: the gated
gelu_new MLP, the RMS-only LayerNorm, the bucketed relative bias (one table per stack, computed
once per forward and shared by every layer), and cached decoding == full forward for a T5-shaped
model (scale 1, head_scale, relative bias, geglu_tanh)."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.models.t5 import modeling_t5

import torchformer as tfm
from torchformer.models.build import ACTIVATIONS, MLPS
from torchformer.nn.norms import RMSNorm
from torchformer.nn.positions import RelativePositionBias

CFG = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, dropout_rate=0.0)


@torch.no_grad()
def test_geglu_tanh_is_t5_gated_gelu():
    torch.manual_seed(0)
    theirs = modeling_t5.T5DenseGatedActDense(T.T5Config(**CFG, feed_forward_proj="gated-gelu")).eval()
    cls, act = MLPS["geglu_tanh"]
    ours = cls(32, 48, ACTIVATIONS[act], bias=False)
    ours.gate.weight.copy_(theirs.wi_0.weight)
    ours.up.weight.copy_(theirs.wi_1.weight)
    ours.down.weight.copy_(theirs.wo.weight)
    x = torch.randn(3, 5, 32)
    assert (ours(x) - theirs(x)).abs().max() < 1e-6
    # and the formula, written out: wo(gelu_tanh(wi_0 x) * wi_1 x)
    g = torch.nn.functional.gelu(x @ theirs.wi_0.weight.T, approximate="tanh")
    assert (ours(x) - (g * (x @ theirs.wi_1.weight.T)) @ theirs.wo.weight.T).abs().max() < 1e-6


@torch.no_grad()
def test_rmsnorm_is_t5_layernorm():
    theirs = modeling_t5.T5LayerNorm(32, eps=1e-6)
    theirs.weight.normal_()
    ours = RMSNorm(32, eps=1e-6)
    ours.weight.copy_(theirs.weight)
    x = torch.randn(4, 7, 32) * 3 + 1  # a mean far from 0: T5's norm must not subtract it
    assert (ours(x) - theirs(x)).abs().max() < 1e-6


@pytest.mark.parametrize("decoder", [False, True])
@torch.no_grad()
def test_relative_bias_is_t5_compute_bias(decoder):
    cfg = T.T5Config(**CFG, relative_attention_num_buckets=16, relative_attention_max_distance=24)
    cfg.is_decoder = decoder
    theirs = modeling_t5.T5Attention(cfg, has_relative_attention_bias=True, layer_idx=0)
    theirs.relative_attention_bias.weight.normal_()
    ours = RelativePositionBias(4, 16, 24, bidirectional=not decoder, max_len=128)
    ours.weight.copy_(theirs.relative_attention_bias.weight)
    pos = torch.arange(70)[None, :]
    assert torch.equal(ours(pos, pos), theirs.compute_bias(70, 70))
    # A decoding step at position 40 against 41 cached keys: the rows of the full table.
    assert torch.equal(ours(pos[:, 40:41], pos[:, :41]), theirs.compute_bias(1, 41, past_seen_tokens=40))


def tiny_t5(backend: str = "sdpa") -> torch.nn.Module:
    cfg = tfm.presets.get(
        "t5-small",
        vocab_size=64,
        d_model=32,
        n_layers=3,
        n_decoder_layers=2,
        attention={"n_heads": 4, "head_dim": 8, "dropout": 0.0, "backend": backend},
        block={"d_ff": 48, "dropout": 0.0, "mlp": "geglu_tanh"},
        positions=tfm.RelativeBias(num_buckets=8, max_distance=20),
        head_scale=32**-0.5,
        dropout=0.0,
    )
    torch.manual_seed(0)
    model = tfm.build_model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("score_bias.weight"):
                p.normal_()
    return model


@torch.no_grad()
def test_relative_bias_is_computed_once_per_stack_forward(monkeypatch):
    model = tiny_t5()
    calls = []
    original = RelativePositionBias.rule
    monkeypatch.setattr(RelativePositionBias, "rule", lambda self, q, k: calls.append(self) or original(self, q, k))
    src, tgt = torch.randint(2, 64, (2, 9)), torch.randint(2, 64, (2, 6))
    model(src, tgt)
    # One evaluation per stack (encoder: 3 layers, decoder: 2 layers), each of its own table.
    assert calls == [model.encoder.score_bias, model.decoder.score_bias]
    assert all(not hasattr(blk.attn, "score_bias") for blk in [*model.encoder.blocks, *model.decoder.blocks])


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@torch.no_grad()
def test_t5_cached_decoding_equals_full_forward(backend):
    model = tiny_t5(backend)
    assert model.config.attention.scale == 1.0
    src = torch.randint(2, 64, (2, 11))
    src_mask = torch.tensor([[1] * 11, [1] * 7 + [0] * 4])
    tgt = torch.randint(2, 64, (2, 10))
    full = model(src, tgt, src_mask=src_mask)
    memory = model.encode(src, src_mask=src_mask)
    cache = model.new_cache(2, 16, memory=memory, src_mask=src_mask)
    steps = [model.decode(tgt[:, t : t + 1], positions=torch.tensor([t]), cache=cache) for t in range(10)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-5
