"""Layer kinds and the issue-14 part B variant axes on tiny models.

The equalities: each block receives its own kind's context (changing one kind's window changes
exactly the layers of that kind); cached decoding == the full forward and math == sdpa for every
new axis (QK-norm per head / over the width, (1 + w) norms, sandwich and output norms, per-kind
RoPE and NoPE, soft-capped logits, head scale, embeddings scaled in the dtype); JSON and save/load
round trips; bad kinds and fields raise ValueError naming the field, the value and what is allowed.
"""

from __future__ import annotations

import json

import pytest
import torch

import torchformer as tfm
from torchformer.configs import LayerKind, layer_pattern
from torchformer.models.stack import times_in_dtype

V, D, L = 61, 32, 4
TOL = 3e-5  # fp32 reassociation on logits of magnitude ~5 (random (1 + w) norms make them large)


def cfg(backend: str = "math", **changes) -> tfm.ModelConfig:
    base = tfm.ModelConfig(
        vocab_size=V,
        d_model=D,
        n_layers=L,
        max_seq_len=64,
        attention=tfm.AttentionConfig(n_heads=4, n_kv_heads=2, head_dim=12, backend=backend),
        block=tfm.BlockConfig(norm="rmsnorm", mlp="swiglu"),
        positions=tfm.RoPE(base=1000.0),
        tie_embeddings=False,
    )
    return base.replace(**changes)


KINDS = dict(
    layer_kinds=layer_pattern(("local", "local", "global"), L),
    kinds={"local": LayerKind(sliding_window=3, rope=tfm.RoPE(base=50.0)), "global": LayerKind()},
)
NOPE = dict(layer_kinds=("rope", "rope", "rope", "nope"), kinds={"rope": LayerKind(), "nope": LayerKind(rope=None)})
AXES = {
    "qk-head": dict(attention={"qk_norm": "head"}),
    "qk-width": dict(attention={"qk_norm": "width"}),
    "gemma-norms-sandwich": dict(block={"norm": "rmsnorm_1p", "norm_placement": "sandwich", "mlp": "geglu_tanh"}),
    "output-norms": dict(block={"norm_placement": "output"}),
    "head-scale-softcap-embed": dict(head_scale=0.3, final_softcap=0.5, embed_scale=True, embed_scale_in_dtype=True),
    "kinds-window-rope": KINDS,
    "kinds-nope": NOPE,
    "gemma3-like": dict(
        attention={"qk_norm": "head", "softcap": 2.0, "scale": 0.2},
        block={"norm": "rmsnorm_1p", "norm_placement": "sandwich", "mlp": "geglu_tanh"},
        final_softcap=1.0,
        **KINDS,
    ),
}


def model(c: tfm.ModelConfig, seed: int = 0) -> torch.nn.Module:
    """Random weights everywhere (norm weights too, so (1 + w) and QK-norm weights matter)."""
    torch.manual_seed(seed)
    m = tfm.build_model(c).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(std=0.5 if name.endswith(("q_proj.weight", "k_proj.weight")) else 0.2)
    return m


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, V, (3, 14), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :9] = 0, 0
    return ids, mask


@pytest.mark.parametrize("axis", list(AXES))
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward(axis):
    m = model(cfg(**AXES[axis]))
    ids, mask = left_padded()
    full = m(ids, attention_mask=mask)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = m.new_cache(3, 64)
    chunks = [m(ids[:, :8], positions=pos[:, :8], attention_mask=mask[:, :8], cache=cache)]
    for t in range(8, 14):  # then one token at a time
        chunks.append(
            m(ids[:, t : t + 1], positions=pos[:, t : t + 1], attention_mask=mask[:, : t + 1][:, -1:], cache=cache)
        )
    real = mask.bool()
    assert (torch.cat(chunks, 1)[real] - full[real]).abs().max() < TOL


@pytest.mark.parametrize("axis", list(AXES))
@torch.no_grad()
def test_math_equals_sdpa_and_the_axis_changes_the_output(axis):
    ids, mask = left_padded()
    math_out = model(cfg("math", **AXES[axis]))(ids, attention_mask=mask)
    sdpa_out = model(cfg("sdpa", **AXES[axis]))(ids, attention_mask=mask)
    real = mask.bool()
    assert (math_out[real] - sdpa_out[real]).abs().max() < TOL
    plain = model(cfg("math"))(ids, attention_mask=mask)
    assert (math_out[real] - plain[real]).abs().max() > 1e-2  # the axis is not a no-op


def per_block_outputs(m: torch.nn.Module, x: torch.Tensor, ids: torch.Tensor) -> list[torch.Tensor]:
    """Every block's output when each block is given the same input x (hooks replace its input)."""
    outs: list[torch.Tensor] = []
    hooks = []
    for block in m.stack.blocks:
        hooks.append(block.register_forward_pre_hook(lambda mod, args: (x, *args[1:])))
        hooks.append(block.register_forward_hook(lambda mod, args, out: outs.append(out)))
    m(ids)
    for h in hooks:
        h.remove()
    return outs


@torch.no_grad()
def test_changing_one_kinds_window_changes_exactly_that_kinds_layers():
    c = cfg(**KINDS)
    wider = c.replace(kinds={"local": LayerKind(sliding_window=6, rope=tfm.RoPE(base=50.0)), "global": LayerKind()})
    a, b = model(c), model(wider)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(5))
    x = torch.randn(2, 16, D, generator=torch.Generator().manual_seed(6))
    local = [kind == "local" for kind in c.layer_kinds]  # layers 0, 1, 3
    for is_local, out_a, out_b in zip(local, per_block_outputs(a, x, ids), per_block_outputs(b, x, ids)):
        if is_local:
            assert (out_a - out_b).abs().max() > 1e-3
        else:
            assert torch.equal(out_a, out_b)
    # And the global kind's RoPE is the model's: swapping the local kind's base moves only local layers.
    other = c.replace(kinds={"local": LayerKind(sliding_window=3, rope=tfm.RoPE(base=9.0)), "global": LayerKind()})
    for is_local, out_a, out_c in zip(local, per_block_outputs(a, x, ids), per_block_outputs(model(other), x, ids)):
        assert (out_a - out_c).abs().max() > 1e-3 if is_local else torch.equal(out_a, out_c)


@torch.no_grad()
def test_one_context_per_kind_per_forward():
    m = model(cfg(**AXES["kinds-nope"]).replace(layer_kinds=("rope", "nope", "rope", "nope")))
    calls = []
    prepare = m.stack.prepare
    m.stack.prepare = lambda ctx: calls.append(ctx) or prepare(ctx)
    m(torch.randint(0, V, (2, 9)))
    assert len(calls) == 2  # two kinds, four layers
    assert calls[0].rope is not None and calls[1].rope is None  # NoPE: no rotation rows at all
    assert m.stack.layer_kind == (0, 1, 0, 1)


@torch.no_grad()
def test_nope_layers_have_no_position_information():
    """An all-NoPE decoder (every layer a NoPE kind) sees a permutation-equivariant prefix: with
    causal attention, the first token's output does not depend on its position index."""
    m = model(cfg(layer_kinds=("n",) * L, kinds={"n": LayerKind(rope=None)}))
    ids = torch.randint(0, V, (1, 6))
    a = m(ids, positions=torch.arange(6))
    b = m(ids, positions=torch.arange(6) + 20)
    assert torch.allclose(a, b, atol=1e-6)
    with_rope = model(cfg())
    assert not torch.allclose(with_rope(ids, positions=torch.arange(6)), with_rope(ids, positions=torch.arange(6) + 20))


def test_embeddings_scaled_in_the_dtype_round_the_factor_first():
    x = torch.randn(4, 8).to(torch.bfloat16)
    scale = D**0.5
    assert torch.equal(times_in_dtype(x, scale), x * torch.tensor(scale).to(torch.bfloat16))
    assert not torch.equal(times_in_dtype(x, 1152**0.5), x * 1152**0.5)  # gemma3-1b: 33.94 -> 34.0 in bf16


@torch.no_grad()
def test_softcap_and_head_scale_are_the_formulas():
    c = cfg(head_scale=0.5, final_softcap=0.7)
    m = model(c)
    ids = torch.randint(0, V, (2, 5))
    h = m.hidden(ids, torch.arange(5)[None].expand(2, -1), None, None)
    raw = torch.nn.functional.linear(h * 0.5, m.lm_head.weight)
    assert torch.allclose(m(ids), 0.7 * torch.tanh(raw / 0.7), atol=1e-6)
    assert m(ids).abs().max() <= 0.7


def test_json_and_save_load_round_trip(tmp_path):
    c = cfg(**AXES["gemma3-like"])
    assert tfm.ModelConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    m = model(c)
    again = tfm.load(tfm.save(m, tmp_path / "m"))
    ids = torch.randint(0, V, (2, 10))
    assert again.config == c and torch.equal(again(ids), m(ids))


BAD = {
    "too few layers": (
        dict(layer_kinds=("a", "a"), kinds={"a": LayerKind()}),
        "layer_kinds=",
        "needs one per layer (4)",
    ),
    "unknown kind": (
        dict(layer_kinds=("a", "b", "a", "a"), kinds={"a": LayerKind()}),
        "layer_kinds=",
        "unknown kinds ['b']",
    ),
    "kinds without names": (dict(kinds={"a": LayerKind()}), "kinds=['a']", "needs layer_kinds"),
    "duplicate kinds": (
        dict(layer_kinds=("a",) * 4, kinds=(LayerKind(name="a"), LayerKind(name="a"))),
        "kinds=['a', 'a']",
        "unique",
    ),
    "kind rope over alibi": (
        dict(positions=tfm.ALiBi(), layer_kinds=("a",) * 4, kinds={"a": LayerKind(rope=None)}),
        "kinds['a'].rope=None",
        "needs model positions RoPE or None, not ALiBi",
    ),
    "odd kind rope": (
        dict(layer_kinds=("a",) * 4, kinds={"a": LayerKind(rope=tfm.RoPE(fraction=0.25))}),
        "positions.fraction=0.25",
        "must be even",
    ),
    "qk_norm word": (dict(attention={"qk_norm": "per_head"}), "attention.qk_norm='per_head'", "['head', 'width']"),
    "final_softcap": (dict(final_softcap=0.0), "final_softcap=0.0", "finite number > 0"),
    "head_scale": (dict(head_scale=-1.0), "head_scale=-1.0", "finite number > 0"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_kinds_and_fields_name_field_value_and_allowed(case):
    changes, named, allowed = BAD[case]
    with pytest.raises(ValueError) as err:
        cfg(**changes)
    assert named in str(err.value) and allowed in str(err.value), str(err.value)


def test_bad_layer_kind_fields_and_encoder_windows():
    with pytest.raises(ValueError, match=r"sliding_window=0: must be an integer >= 1, None"):
        LayerKind(name="a", sliding_window=0)
    with pytest.raises(ValueError, match=r"rope='none': must be a RoPE, None \(NoPE\) or 'inherit'"):
        LayerKind(name="a", rope="none")
    with pytest.raises(ValueError, match=r"kinds\['a'\].sliding_window=4: is for causal decoders only"):
        cfg(arch="encoder", layer_kinds=("a",) * 4, kinds={"a": LayerKind(sliding_window=4)})
    with pytest.raises(ValueError, match=r"pattern=\(\): must be a non-empty sequence"):
        layer_pattern((), 4)


@torch.no_grad()
def test_quantize_keeps_a_soft_capped_head_float():
    """tfm.quantize replaces the plain projections; a head with a soft-cap or scale keeps its formula."""
    m = model(cfg(final_softcap=0.5, head_scale=0.5))
    ids = torch.randint(0, V, (2, 7))
    q = tfm.quantize(model(cfg(final_softcap=0.5, head_scale=0.5)), "int8")
    assert type(q.lm_head) is type(m.lm_head) and q(ids).abs().max() <= 0.5
    assert (q(ids) - m(ids)).abs().max() < 0.05  # only the int8 block projections differ
