"""record_attention: outputs unchanged on every backend, every call captured (self and cross),
weights equal to a hand computation, the model restored afterwards."""

import pytest
import torch

import torchformer as tfm
from tests.grid import build, forward, params, variants
from torchformer.analysis import record_attention
from torchformer.nn.attention import Attention


def padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 10))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("v", **params(variants()))
def test_capture_leaves_outputs_unchanged(v):
    model = build(v)
    ids, mask = padded_batch(model.config.vocab_size)
    with torch.no_grad():
        want = [forward(model, ids), forward(model, ids, mask)]
        with record_attention(model) as rec:
            got = [forward(model, ids), forward(model, ids, mask)]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    n_attn = sum(isinstance(m, Attention) for m in model.modules())
    assert len(rec.captures) == 2 * n_attn
    for c in rec.captures:
        assert c.weights.shape[:2] == (2, model.config.attention.n_heads)
        visible = c.weights.sum(-1)
        assert torch.all(((visible - 1).abs() < 1e-5) | (visible == 0))


def test_encoder_decoder_captures_self_and_cross_with_their_shapes():
    cfg = tfm.presets.get(
        "vanilla-base",
        d_model=32,
        n_layers=2,
        n_decoder_layers=2,
        vocab_size=50,
        attention={"n_heads": 4},
        block={"d_ff": 64},
    )
    model = tfm.build_model(cfg).eval()
    src, tgt = torch.randint(0, 50, (2, 7)), torch.randint(0, 50, (2, 5))
    src_mask = torch.ones_like(src)
    src_mask[1, 5:] = 0
    with torch.no_grad(), record_attention(model) as rec:
        model(src, tgt, src_mask=src_mask)
    shapes = {(c.stack, c.layer, c.kind): tuple(c.weights.shape) for c in rec.captures}
    assert shapes == {
        ("encoder", 0, "self"): (2, 4, 7, 7),
        ("encoder", 1, "self"): (2, 4, 7, 7),
        ("decoder", 0, "self"): (2, 4, 5, 5),
        ("decoder", 0, "cross"): (2, 4, 5, 7),
        ("decoder", 1, "self"): (2, 4, 5, 5),
        ("decoder", 1, "cross"): (2, 4, 5, 7),
    }
    cross = rec.weights["decoder.blocks.1.cross_attn"]
    assert cross[1, :, :, 5:].abs().max() == 0  # padded source keys
    assert [c.name for c in rec.select(kind="cross")] == ["decoder.blocks.0.cross_attn", "decoder.blocks.1.cross_attn"]


def test_weights_equal_a_hand_computed_softmax():
    cfg = tfm.ModelConfig(
        vocab_size=40,
        d_model=32,
        n_layers=1,
        max_seq_len=16,
        positions=None,
        attention=tfm.AttentionConfig(n_heads=4, backend="sdpa"),
    )
    model = tfm.build_model(cfg).eval()
    ids = torch.randint(0, 40, (1, 6))
    with torch.no_grad(), record_attention(model) as rec:
        model(ids)
        attn = model.stack.blocks[0].attn
        h = model.stack.blocks[0].attn_norm(model.embed.tok(ids))
        q = attn.q_proj(h).view(1, 6, 4, 8).transpose(1, 2)  # (B, H, T, E)
        k = attn.k_proj(h).view(1, 6, 4, 8).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / 8**0.5
        want = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    torch.testing.assert_close(rec.weights["stack.blocks.0.attn"], want, atol=1e-6, rtol=1e-5)


def test_backends_are_restored_also_after_an_exception():
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    before = [m.backend for m in model.modules() if isinstance(m, Attention)]
    with pytest.raises(RuntimeError, match="boom"), record_attention(model):
        raise RuntimeError("boom")
    assert [m.backend for m in model.modules() if isinstance(m, Attention)] == before
    with record_attention(model):
        assert all(m.backend is not b for m, b in zip([m for m in model.modules() if isinstance(m, Attention)], before))
    assert [m.backend for m in model.modules() if isinstance(m, Attention)] == before


def test_chosen_layers_by_index_and_name():
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad(), record_attention(model, layers=[1, "stack.blocks.3.attn"]) as rec:
        model(ids)
    assert list(rec.weights) == ["stack.blocks.1.attn", "stack.blocks.3.attn"]
    with pytest.raises(ValueError, match="selects no attention module"), record_attention(model, layers=[9]):
        pass


def test_cached_decoding_records_each_step_over_the_cache():
    model = tfm.build_model(tfm.presets.get("llama-tiny")).eval()
    ids = torch.randint(0, 256, (2, 6))
    cache = model.new_cache(2, 8)
    with torch.no_grad(), record_attention(model, layers=[0]) as rec:
        model(ids[:, :4], positions=torch.arange(4), cache=cache)
        model(ids[:, 4:5], positions=torch.tensor([4]), cache=cache)
    first, step = rec.captures
    assert first.weights.shape == (2, 4, 4, 9) and step.weights.shape == (2, 4, 1, 9)
    assert step.weights[..., 5:].abs().max() == 0  # slots after position 4 (and the trash slot) unseen
