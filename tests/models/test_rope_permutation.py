"""A model with interleaved RoPE pairing and permuted q/k rows equals the half-pairing model,
in both directions (Meta's layout <-> HF's layout), for MHA, GQA and MQA in all three archs.

The row permutations (written here, not imported, so they check the library's rotation code):
  Meta -> HF: W.view(n, E // 2, 2, D).transpose(1, 2).reshape(W.shape)
  HF -> Meta: W.view(n, 2, E // 2, D).transpose(1, 2).reshape(W.shape)
with n = n_heads for q_proj and n_kv_heads for k_proj; v and o are untouched.
"""

import pytest
import torch

from .. import grid


def permute_rows(w: torch.Tensor, n: int, to_half: bool) -> torch.Tensor:
    E = w.shape[0] // n
    rest = w.shape[1:]
    if to_half:
        return w.reshape(n, E // 2, 2, *rest).transpose(1, 2).reshape(w.shape)
    return w.reshape(n, 2, E // 2, *rest).transpose(1, 2).reshape(w.shape)


def converted_state(model, to_half: bool) -> dict[str, torch.Tensor]:
    cfg = model.config
    heads = {"q_proj": cfg.attention.n_heads, "k_proj": cfg.n_kv_heads}
    out = {}
    for name, tensor in model.state_dict().items():
        parts = name.split(".")
        # Only self-attention rotates: "...blocks.i.attn.q_proj.weight", not cross_attn.
        if len(parts) >= 3 and parts[-3] == "attn" and parts[-2] in heads:
            tensor = permute_rows(tensor, heads[parts[-2]], to_half)
        out[name] = tensor
    return out


CASES = [
    dict(grid.variants()[i], heads=h, arch=a, bias=b)
    for i, (h, a, b) in enumerate(
        [
            ("mha", "decoder", True),
            ("gqa", "decoder", False),
            ("mqa", "decoder", True),
            ("gqa", "encoder", True),
            ("mqa", "encoder_decoder", False),
            ("mha", "encoder_decoder", True),
        ]
    )
]


@pytest.mark.parametrize("v", **grid.params(CASES))
@pytest.mark.parametrize("direction", ["half->interleaved", "interleaved->half"])
@torch.no_grad()
def test_interleaved_with_permuted_rows_equals_half(v, direction):
    src_pos, dst_pos = direction.split("->")
    source = grid.build(dict(v, position=f"rope-{src_pos}"), seed=1)
    target = grid.build(dict(v, position=f"rope-{dst_pos}"), seed=2)
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    before = grid.forward(target, ids)
    target.load_state_dict(converted_state(source, to_half=dst_pos == "half"))
    expected = grid.forward(source, ids)
    assert (grid.forward(target, ids) - expected).abs().max().item() < 1e-5
    assert (before - expected).abs().max().item() > 1e-3  # the load changed the model


def test_permutations_are_inverse():
    w = torch.randn(4 * 8, 16)
    assert torch.equal(permute_rows(permute_rows(w, 4, True), 4, False), w)
    assert not torch.equal(permute_rows(w, 4, True), w)


@torch.no_grad()
def test_without_permutation_the_pairings_differ():
    v = dict(CASES[0])
    half = grid.build(dict(v, position="rope-half"))
    inter = grid.build(dict(v, position="rope-interleaved"))
    inter.load_state_dict(half.state_dict())
    ids = torch.randint(0, grid.VOCAB, (2, 10))
    assert (half(ids) - inter(ids)).abs().max().item() > 1e-3
