"""The compiled FlexAttention path (what runs outside tests): forward and backward == math within
1e-5 for one model that exercises ALiBi, a window, padding, GQA and soft-cap at once, and for the
learned T5 table's gradient. Each new shape compiles once (~15 s on 2 cores), so few shapes."""

import torch

from torchformer.nn import flex

from .. import grid

TOL = 1e-5


def run(model, ids, mask):
    model.zero_grad()
    out = model(ids, attention_mask=mask)
    (out**2).mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_flex_forward_and_backward_equal_math():
    assert flex._STATE["compiled"]  # not inside flex.eager(): the compiled kernel runs
    v = dict(grid.variants(("decoder",))[0], heads="gqa")
    ids = torch.randint(0, grid.VOCAB, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[0, :6] = 0
    for position, attention in (("alibi", {"sliding_window": 9, "softcap": 4.0}), ("relative_bias", {})):
        a = grid.build(dict(v, position=position, backend="math"), attention=attention)
        b = grid.build(dict(v, position=position, backend="flex"), attention=attention)
        (oa, ga), (ob, gb) = run(a, ids, mask), run(b, ids, mask)
        assert (oa - ob).abs().max().item() < TOL
        assert set(ga) == set(gb) and max((ga[n] - gb[n]).abs().max().item() for n in ga) < TOL
