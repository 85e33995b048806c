"""Untrained models predict ~uniformly (initial loss within 0.1 nats of ln V), and one AdamW
step on a fixed batch lowers the loss for every grid row (the gradients reach every part)."""

import math

import pytest
import torch
import torch.nn.functional as F

import torchformer as tfm

from .. import grid

ALL = grid.variants()


def loss_of(model, ids, targets):
    logits = grid.output_logits(model, ids)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("v", **grid.params(ALL))
def test_initial_loss_is_ln_vocab_and_one_step_lowers_it(v):
    model = grid.build(v, sharp=False).train()
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, grid.VOCAB, (8, 16), generator=gen)
    targets = torch.randint(0, grid.VOCAB, (8, 16), generator=gen)
    loss = loss_of(model, ids, targets)
    assert abs(loss.item() - math.log(grid.VOCAB)) < 0.1
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient reaches {missing}"
    opt.step()
    assert loss_of(model, ids, targets).item() < loss.item() - 1e-3


@pytest.mark.parametrize("name", ["llama-tiny", "shakespeare-char"])
def test_initial_loss_of_small_presets(name):
    cfg = tfm.presets.get(name)
    model = tfm.build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (4, 64))
    with torch.no_grad():
        logits = model(ids)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.1


def test_init_scales_residual_projections():
    """N(0, 0.02) everywhere; o_proj and mlp.down scaled by 1/sqrt(2 * n_layers) (GPT-2)."""
    cfg = tfm.presets.get("llama-tiny", d_model=256, n_layers=8, attention={"n_heads": 4, "n_kv_heads": 2})
    model = tfm.build_model(cfg)
    block = model.stack.blocks[3]
    assert block.attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.mlp.up.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert block.attn.o_proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert block.mlp.down.weight.std().item() == pytest.approx(0.02 / 4, rel=0.05)
    assert torch.equal(block.attn_norm.weight, torch.ones(256))


def test_xavier_init_for_the_vanilla_presets():
    cfg = tfm.presets.get("vanilla-base", vocab_size=1000, n_layers=1, n_decoder_layers=1)
    model = tfm.build_model(cfg)
    w = model.encoder.blocks[0].mlp.up.weight  # (2048, 512): Glorot bound sqrt(6 / (512 + 2048))
    bound = math.sqrt(6 / (512 + 2048))
    assert w.abs().max().item() <= bound and w.abs().max().item() > 0.99 * bound
    assert (model.encoder.blocks[0].mlp.up.bias == 0).all()
