"""optim.name: muon (training/optim.py): which parameters Muon gets, one optimizer whose state
round-trips through torch's state dict, the schedule's lr_ratio, and the recipe's checks."""

import pytest
import torch

import torchformer as tfm
from torchformer.training import recipe
from torchformer.training.optim import MuonAdamW, build, hidden_matrices
from torchformer.training.schedules import Schedule


def model():
    torch.manual_seed(0)
    return tfm.build_model(tfm.presets.get("shakespeare-char", d_model=32, attention={"n_heads": 2}))


def test_muon_gets_the_blocks_projections_and_adamw_the_rest():
    m = model()
    names = {id(p): n for n, p in m.named_parameters()}
    muon = sorted(names[id(p)] for p in hidden_matrices(m))
    kinds = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "mlp.up", "mlp.down")
    expected = sorted(f"stack.blocks.{i}.{w}.weight" for i in range(4) for w in kinds)
    assert muon == expected
    opt = build(m, recipe.load(None, ["optim.name=muon"]).optim, "cpu")
    assert isinstance(opt, MuonAdamW)
    in_adamw = {names[id(p)] for g in opt.adamw.param_groups for p in g["params"]}
    assert "embed.tok.weight" in in_adamw and not in_adamw & set(muon)  # the tied table: AdamW's
    assert len(in_adamw) + len(muon) == len(names)


def test_state_round_trips_and_the_schedule_keeps_the_ratio():
    m = model()
    opt = build(m, recipe.load(None, ["optim.name=muon", "optim.lr=1e-3", "optim.muon_lr=0.02"]).optim, "cpu")
    Schedule("constant", 1e-3, 0, 10, 0.1, 0.2, 32, 1.0).apply(opt, 1)
    assert [g["lr"] for g in opt.muon.param_groups] == [pytest.approx(0.02)]
    assert {g["lr"] for g in opt.adamw.param_groups} == {1e-3}
    m(torch.randint(0, 100, (2, 8))).sum().backward()
    opt.step()
    again = build(model(), recipe.load(None, ["optim.name=muon"]).optim, "cpu")
    again.load_state_dict(opt.state_dict())
    assert again.muon.param_groups[0] is again.param_groups[0] and again.muon.state is again.state
    buffers = [again.state[p]["momentum_buffer"] for p in again.muon.param_groups[0]["params"]]
    assert buffers and all(b.abs().sum() > 0 for b in buffers)  # Muon's momentum came back


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.name=sgd", r"optim.name='sgd': must be one of \['adamw', 'muon'\]"),
        ("optim.muon_lr=0", r"optim.muon_lr=0: must be > 0"),
        ("optim.momentum=1.0", r"optim.momentum=1.0: must be in \[0, 1\)"),
    ],
)
def test_bad_optim_settings_are_named(override, message):
    with pytest.raises(ValueError, match=message):
        recipe.load(None, [override])
