"""The compiled step's host code (issue 25): TORCHFORMER_CPP_WRAPPER unset (or ``auto``) gives C++
host code (inductor's cpp_wrapper) to a model whose stacks run no compile regions and Python's to one
whose big layers do; ``1`` forces C++ (regions off at build), ``0`` Python; anything else is refused
with the variable, the value and what is allowed, before any compile."""

import pytest
import torch

import torchformer as tfm
from torchformer.generation import steps

CPP = {"cpp_wrapper": True}


@pytest.fixture
def compiles(monkeypatch):
    """The options each torch.compile of a step kind was given (nothing is compiled)."""
    seen = []
    monkeypatch.setattr(steps, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw.get("options")) or fn)
    return seen


def model(d_model: int):
    """One llama-tiny layer: d_model 256 is under REGION_PARAMS (no regions), 1280 over (regions)."""
    cfg = tfm.presets.get("llama-tiny", vocab_size=97, d_model=d_model, n_layers=1, max_seq_len=8)
    return tfm.build_model(cfg)


@pytest.mark.parametrize(("value", "small", "big"), [(None, CPP, None), ("auto", CPP, None), ("0", None, None),
                                                     ("1", CPP, CPP)])  # fmt: skip
def test_the_switch_picks_the_host_code_per_model(monkeypatch, compiles, value, small, big):
    if value is None:
        monkeypatch.delenv("TORCHFORMER_CPP_WRAPPER", raising=False)
    else:
        monkeypatch.setenv("TORCHFORMER_CPP_WRAPPER", value)
    little, large = model(256), model(1280)
    assert (little.stack.regions, large.stack.regions) == (False, value != "1")
    assert steps.step_function(False, True, model=little) is steps.decoder_step
    assert steps.step_function(False, True, model=large) is steps.decoder_step
    assert compiles == ([small] if small == big else [small, big])  # one compile per step kind and host code
    assert steps.step_function(False, True, model=little) is steps.decoder_step
    assert len(compiles) == (1 if small == big else 2)  # the second call reuses the compiled step


def test_auto_keeps_python_host_code_off_the_cpu(monkeypatch, compiles):
    """Measured on CPUs only: under auto a model elsewhere (here the meta device) keeps Python's."""
    monkeypatch.delenv("TORCHFORMER_CPP_WRAPPER", raising=False)
    steps.step_function(False, True, model=model(256).to("meta"))
    assert compiles == [None]


def test_a_bad_value_is_refused_before_any_compile(monkeypatch, compiles):
    monkeypatch.setenv("TORCHFORMER_CPP_WRAPPER", "yes")
    with pytest.raises(ValueError, match=r"TORCHFORMER_CPP_WRAPPER='yes': must be auto, 0 or 1"):
        steps.step_function(False, True, model=None)
    assert compiles == []
