"""LoRA: exact no-op at apply, merged == unmerged, gradients only on adapters, over a grid of
shapes and targets; QLoRA over an int8 base; bad settings."""

from __future__ import annotations

import pytest
import torch

import torchformer as tfm
from tests.grid import VOCAB, build, forward, params, variants
from torchformer.lora import LoRALinear

TARGETS = [("q_proj", "v_proj"), ("q_proj", "k_proj", "v_proj", "o_proj", "mlp.up", "mlp.down"), ("o_proj",)]


IDS = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))


def _randomize_adapters(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in tfm.lora.adapters(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)


@pytest.mark.parametrize("v", **params(variants()))
@pytest.mark.parametrize("targets", TARGETS, ids=["qv", "all-but-gate", "o"])
def test_apply_is_exact_noop_and_merge_equals_unmerged(v, targets):
    model = build(v)
    with torch.no_grad():
        before = forward(model, IDS)
        tfm.lora.apply(model, rank=4, alpha=8, targets=targets)
        assert torch.equal(forward(model, IDS), before)  # B = 0: exactly the same outputs
        _randomize_adapters(model)
        unmerged = forward(model, IDS)
    assert (unmerged - before).abs().max() > 1e-4  # the adapters now matter
    tfm.lora.merge(model)
    assert not tfm.lora.adapters(model)
    with torch.no_grad():
        assert (forward(model, IDS) - unmerged).abs().max() < 1e-5


@pytest.mark.parametrize("v", **params(variants()))
def test_gradients_only_on_adapters(v):
    model = build(v)
    tfm.lora.apply(model, rank=2, alpha=4, targets=("q_proj", "v_proj"), dropout=0.1)
    model.train()
    _randomize_adapters(model)
    forward(model, IDS).float().pow(2).mean().backward()
    for name, p in model.named_parameters():
        if ".lora_" in name:
            assert p.requires_grad and p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert not p.requires_grad and p.grad is None, name
    assert {id(p) for p in tfm.lora.trainable(model)} == {id(p) for n, p in model.named_parameters() if ".lora_" in n}


def test_adapter_is_the_low_rank_formula():
    """Against the formula written out: y = W x + b + alpha/r * B A x."""
    torch.manual_seed(0)
    base = tfm.build_model(tfm.presets.get("llama-tiny")).stack.blocks[0].attn.q_proj
    lora = LoRALinear(base, rank=3, alpha=6.0, dropout=0.0)
    torch.nn.init.normal_(lora.lora_B.weight)
    x = torch.randn(4, base.in_features)
    expected = x @ base.weight.T + (6.0 / 3) * (x @ lora.lora_A.weight.T) @ lora.lora_B.weight.T
    assert torch.allclose(lora(x), expected, atol=1e-5)


def test_qlora_over_int8_base_trains_and_matches_dequantised_reference():
    torch.manual_seed(0)
    model = tfm.build_model(tfm.presets.get("llama-tiny").replace(n_layers=2, d_model=64, vocab_size=64))
    tfm.quantize(model, "int8", lm_head=False)
    tfm.lora.apply(model, rank=4, alpha=8, targets=("q_proj", "v_proj"))
    _randomize_adapters(model)
    model.train()
    ids = torch.randint(0, 64, (2, 6))
    model(ids).pow(2).mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(".lora_" in n for n in grads)
    lin = model.stack.blocks[0].attn.q_proj
    x = torch.randn(3, lin.in_features)
    ref = x @ lin.base_layer.dequantized().T + lin.scaling * x @ lin.lora_A.weight.T @ lin.lora_B.weight.T
    assert torch.allclose(lin(x), ref, atol=1e-5)
    with pytest.raises(ValueError, match="quantized base"):
        tfm.lora.merge(model)


def test_adapter_state_round_trip():
    torch.manual_seed(0)
    cfg = tfm.presets.get("llama-tiny")
    a = tfm.lora.apply(tfm.build_model(cfg), rank=2, targets=("q_proj", "mlp.down"))
    _randomize_adapters(a)
    torch.manual_seed(0)
    b = tfm.lora.apply(tfm.build_model(cfg), rank=2, targets=("q_proj", "mlp.down"))
    tfm.lora.load_state(b, tfm.lora.adapter_state(a))
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    with torch.no_grad():
        assert torch.equal(a(ids), b(ids))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 0}, r"rank=0: must be an integer >= 1"),
        ({"rank": 2.5}, r"rank=2.5"),
        ({"alpha": 0}, r"alpha=0: must be a number > 0"),
        ({"dropout": 1.0}, r"dropout=1.0: must be a number in \[0, 1\)"),
        ({"targets": ()}, r"targets=\(\): must be a non-empty list"),
        ({"targets": ("qkv",)}, r"'qkv' matches no linear module.*stack.blocks.\{i\}.attn.q_proj"),
    ],
)
def test_bad_settings(kwargs, match):
    model = tfm.build_model(tfm.presets.get("llama-tiny"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        tfm.lora.apply(model, **kwargs)
    assert not tfm.lora.adapters(model)  # nothing changed
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert all(p.requires_grad for p in model.parameters())


def test_tied_head_and_double_apply_refused():
    model = tfm.build_model(tfm.presets.get("shakespeare-char"))
    assert model.config.tie_embeddings
    with pytest.raises(ValueError, match="ties lm_head"):
        tfm.lora.apply(model, targets=("lm_head",))
    tfm.lora.apply(model, targets=("q_proj",))
    with pytest.raises(ValueError, match="already carries LoRA"):
        tfm.lora.apply(model, targets=("v_proj",))


def test_lora_forwards_never_compare_strings_or_read_config():
    """DESIGN 3 for the adapter layers too (the AST rule of tests/models/test_build.py)."""
    from pathlib import Path

    from tests.models.test_build import test_building_blocks_never_compare_strings_or_read_config as rule

    rule(Path(tfm.lora.__file__).with_name("layer.py"))
