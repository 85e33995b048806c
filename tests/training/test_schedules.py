"""Issue 4, test 5 (schedules): Noam equals the paper's formula and is > 0 at step 1 whatever lr
the optimizer was built with; cosine, wsd and constant have their documented shape."""

import math

import pytest
import torch

from torchformer.training.schedules import Schedule


def noam_formula(t, d_model, warmup):  # Vaswani et al. 2017, eq. 3, written out independently
    return d_model**-0.5 * min(t**-0.5, t * warmup**-1.5)


@pytest.mark.parametrize("d_model,warmup", [(512, 4000), (128, 200), (64, 1)])
def test_noam_matches_the_formula(d_model, warmup):
    s = Schedule("noam", lr=123.0, warmup=warmup, total=10 * warmup, d_model=d_model)
    for t in (1, warmup, 4 * warmup):
        assert s(t) == pytest.approx(noam_formula(t, d_model, warmup), rel=1e-12)
    # the peak is at the end of warm-up: rising before, falling after
    assert s(warmup) >= s(max(1, warmup - 1)) and s(warmup) > s(warmup + 1)


@pytest.mark.parametrize("built_lr", [0.0, 1e-3, 1.0, 50.0])
def test_noam_step_one_is_positive_whatever_the_optimizer_lr(built_lr):
    # The LambdaLR pitfall: a multiplier of the construction lr, counted from step 0, gives 0 at
    # the first update (or depends on built_lr). Here the lr is set absolutely.
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=built_lr)
    s = Schedule("noam", lr=built_lr, warmup=400, total=4000, d_model=512)
    lr = s.apply(opt, 1)
    assert lr > 0
    assert opt.param_groups[0]["lr"] == lr == pytest.approx(noam_formula(1, 512, 400))


def test_cosine_warms_up_linearly_then_decays_to_min_ratio():
    s = Schedule("cosine", lr=1e-3, warmup=10, total=110, min_ratio=0.1)
    assert [s(t) for t in (1, 5, 10)] == pytest.approx([1e-4, 5e-4, 1e-3])
    assert s(60) == pytest.approx(1e-4 + 0.9e-3 * 0.5)  # half-way through the cosine
    assert s(110) == pytest.approx(1e-4)
    values = [s(t) for t in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_is_flat_then_decays_linearly():
    s = Schedule("wsd", lr=2e-3, warmup=10, total=100, min_ratio=0.0, decay_fraction=0.2)
    assert s(10) == s(50) == s(80) == pytest.approx(2e-3)
    assert s(90) == pytest.approx(1e-3)
    assert s(100) == pytest.approx(0.0)


def test_constant_after_warmup_and_bad_values():
    s = Schedule("constant", lr=0.5, warmup=4, total=10)
    assert [s(t) for t in (1, 4, 9)] == [0.125, 0.5, 0.5]
    with pytest.raises(ValueError, match="schedule.name='linear'"):
        Schedule("linear", lr=1, warmup=0, total=1)
    with pytest.raises(ValueError, match="warmup"):
        Schedule("noam", lr=1, warmup=0, total=1)
    with pytest.raises(ValueError, match="from 1"):
        s(0)
    assert math.isfinite(Schedule("cosine", lr=1.0, warmup=0, total=1)(1))
