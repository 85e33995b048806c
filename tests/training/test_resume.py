"""Issue 4, test 1: 20 steps straight == 10 steps, stop, resume, 10 steps (weights bit-equal)."""

import pytest
import torch
from safetensors.torch import load_file

from torchformer.training.train import train

from .tiny import tiny_recipe, tiny_seq2seq


def _weights(result):
    return {k: v.clone() for k, v in result.model.state_dict().items()}


@pytest.mark.parametrize("optim", ["adamw", "muon"])  # muon: its momentum buffers beside Adam's moments
@pytest.mark.parametrize("kind", ["decoder", "encoder_decoder"])
def test_resume_is_bit_exact(tmp_path, corpus, kind, optim):
    if kind == "decoder":
        # dropout on, so the restored RNG state matters too
        def make(out, train_opts):
            return tiny_recipe(out, corpus, model={"dropout": 0.1, "block": {"dropout": 0.1}}, train=train_opts,
                               optim={"lr": 3e-3, "name": optim})  # fmt: skip
    else:

        def make(out, train_opts):
            return tiny_seq2seq(out, train={"grad_accum": 2, **train_opts}, optim={"name": optim})

    straight = train(make(tmp_path / "a", {"steps": 20}))
    half = train(make(tmp_path / "c", {"steps": 20}), stop_after=10)
    assert half.step == 10
    resumed = train(make(tmp_path / "c", {"steps": 20}), resume="auto")
    assert resumed.step == 20
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and the resumed run really trained: its weights moved away from the step-10 checkpoint
    assert not torch.equal(_weights(half)["lm_head.weight"], b["lm_head.weight"])
    # the metrics log continues without duplicated steps
    steps = [row["step"] for row in resumed.metrics]
    assert steps == [0, 10, 20]
    if optim == "muon":  # the checkpoint holds Muon's state, not only Adam's
        saved = load_file(str(tmp_path / "c" / "checkpoints" / "step_000010" / "optimizer.safetensors"))
        assert any(k.endswith(".momentum_buffer") for k in saved) and any(k.endswith(".exp_avg") for k in saved)
