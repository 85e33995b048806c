"""The compiled step's one inductor switch (issue 25): TORCHFORMER_CPP_WRAPPER=1 compiles the step
with C++ host code (inductor's cpp_wrapper), unset or 0 with Python's; anything else is refused
with the variable, the value and what is allowed, before any compile."""

import pytest
import torch

from torchformer.generation import steps


@pytest.fixture
def compiles(monkeypatch):
    """The options each torch.compile of a step kind was given (nothing is compiled)."""
    seen = []
    monkeypatch.setattr(steps, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw.get("options")) or fn)
    return seen


@pytest.mark.parametrize(("value", "options"), [(None, None), ("0", None), ("1", {"cpp_wrapper": True})])
def test_the_switch_picks_the_wrapper(monkeypatch, compiles, value, options):
    if value is None:
        monkeypatch.delenv("TORCHFORMER_CPP_WRAPPER", raising=False)
    else:
        monkeypatch.setenv("TORCHFORMER_CPP_WRAPPER", value)
    assert steps.step_function(False, True) is steps.decoder_step
    assert compiles == [options]


def test_a_bad_value_is_refused_before_any_compile(monkeypatch, compiles):
    monkeypatch.setenv("TORCHFORMER_CPP_WRAPPER", "yes")
    with pytest.raises(ValueError, match=r"TORCHFORMER_CPP_WRAPPER='yes': must be 0 or 1"):
        steps.step_function(False, True)
    assert compiles == []
