"""optim.name: muon (training/optim.py): which parameters Muon gets, one optimizer whose state
round-trips through torch's state dict, the schedule's lr_ratio, and the recipe's checks."""

import pytest
import torch

import torchformer as tfm
from torchformer.training import optim, recipe
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


def matrices_and_grads(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(24, 16), (16, 40), (8, 8)]  # tall, wide (the transposed branch), square
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    return params, grads


def run_steps(opt, params, grads) -> list[torch.Tensor]:
    for step in grads:
        for p, grad in zip(params, step):
            p.grad = grad.clone()
        opt.step()
    return [p.detach().clone() for p in params]


def test_muon_in_bf16_takes_torchs_steps_bit_for_bit():
    options = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
    ours, theirs = matrices_and_grads(0)[0], matrices_and_grads(0)[0]
    grads = matrices_and_grads(0)[1]
    a = run_steps(optim.Muon(ours, ns_dtype=torch.bfloat16, **options), ours, grads)
    b = run_steps(torch.optim.Muon(theirs, **options), theirs, grads)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(not torch.equal(x, p) for x, p in zip(a, matrices_and_grads(0)[0]))  # they moved


def newton_schulz_f64(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration written out in float64 (the reference for the fp32 path's error)."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = g.double().T if g.size(0) > g.size(1) else g.double()
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if g.size(0) > g.size(1) else x


@pytest.mark.parametrize("shape", [(24, 16), (16, 40)])
def test_fp32_orthogonalization_is_closer_to_the_exact_iteration_than_bf16(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    exact = newton_schulz_f64(g)
    coefficients = (3.4445, -4.775, 2.0315)
    fp32 = optim.orthogonalize(g, coefficients, 5, 1e-7, torch.float32)
    bf16 = optim.orthogonalize(g, coefficients, 5, 1e-7, torch.bfloat16)
    assert fp32.dtype == torch.float32 and fp32.shape == shape
    err32, err16 = (fp32.double() - exact).abs().max(), (bf16.double() - exact).abs().max()
    assert err32 < 1e-4 < err16  # bf16 keeps ~3 significant digits, fp32 ~7


def test_newton_schulz_runs_in_fp32_on_cpus_without_bf16_units(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert optim.newton_schulz_dtype("cpu") == torch.float32
    assert build(model(), recipe.load(None, ["optim.name=muon"]).optim, "cpu").muon.ns_dtype == torch.float32
    assert optim.newton_schulz_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert optim.newton_schulz_dtype("cpu") == torch.bfloat16


def test_an_lr_adjustment_the_step_does_not_implement_is_named_at_construction():
    with pytest.raises(ValueError, match="adjust_lr_fn='match_rms_adamw'; this step implements 'original'"):
        optim.Muon([torch.nn.Parameter(torch.randn(4, 4))], ns_dtype=torch.float32, adjust_lr_fn="match_rms_adamw")
