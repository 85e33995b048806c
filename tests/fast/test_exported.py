"""Decode steps compiled ahead (fast/exported.py): which models take them, what binds them to a
model's tensors again (new weights under the same names), what compiles them again (a hook), the
fall back to dynamo's step where the export fails, and the setting's errors. The exported
programs run eagerly here (tests/conftest.py ``exported_eager``); AOTInductor's own library runs in
generation/test_compile.py and fast/test_joint.py."""

import logging

import pytest
import torch

import torchformer as tfm
from tests.grid import build, variants
from torchformer.fast import exported


def decoder(seed: int = 0):
    return build(next(v for v in variants(("decoder",)) if v["mlp"] == "swiglu"), seed, n_layers=2)


def ids_for(model, batch: int = 1):
    return torch.randint(1, model.config.vocab_size, (batch, 6), generator=torch.Generator().manual_seed(2))


def test_new_weights_under_the_same_names_are_bound_not_compiled(exported_eager):
    model, other = decoder(), decoder(seed=5)
    ids = ids_for(model)
    first = tfm.generate(model, ids, max_new_tokens=8)
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=8, compile=True), first)
    model.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects, same names and shapes
    fresh = tfm.generate(model, ids, max_new_tokens=8)
    assert torch.equal(tfm.generate(model, ids, max_new_tokens=8, compile=True), fresh)
    assert torch.equal(fresh, tfm.generate(other, ids, max_new_tokens=8))
    assert len(exported_eager) == 1 and exported_eager[0].bound == 2  # bound again, once


def test_a_hook_compiles_the_step_again(exported_eager):
    model = decoder()
    ids = ids_for(model)
    tfm.generate(model, ids, max_new_tokens=6, compile=True)
    handle = model.stack.blocks[0].mlp.register_forward_hook(lambda m, args, out: out * 3)
    try:
        hooked = tfm.generate(model, ids, max_new_tokens=6)
        assert torch.equal(tfm.generate(model, ids, max_new_tokens=6, compile=True), hooked)
    finally:
        handle.remove()
    assert len(exported_eager) == 2


def test_a_step_that_cannot_be_exported_runs_dynamos(aot_eager, exported_eager, monkeypatch, caplog):
    def refuse(*args, **kwargs):
        raise RuntimeError("not exportable\nsecond line")

    monkeypatch.setattr(torch.export, "export", refuse)
    model = decoder()
    ids = ids_for(model)
    with caplog.at_level(logging.WARNING, logger="torchformer.fast.exported"):
        out = tfm.generate(model, ids, max_new_tokens=6, compile=True)
        again = tfm.generate(model, ids, max_new_tokens=6, compile=True)
    assert torch.equal(out, tfm.generate(model, ids, max_new_tokens=6)) and torch.equal(again, out)
    said = [r.getMessage() for r in caplog.records if "compiled ahead" in r.getMessage()]
    why = "(RuntimeError: not exportable); using torch.compile"
    assert said == [f"torchformer: the decode step could not be compiled ahead {why}"]
    assert len(aot_eager) == 1 and not exported_eager  # dynamo's graph ran; once said for the model


def test_which_models_take_steps_compiled_ahead(monkeypatch):
    model = decoder()
    monkeypatch.delenv("TORCHFORMER_AOT_STEP", raising=False)
    assert exported.ahead(model)  # a CPU model
    model.stack.regions = True  # big layers (compile regions for dynamo): compiled ahead whole
    assert exported.ahead(model)
    monkeypatch.setattr(exported, "on_cpu", lambda m: False)  # an accelerator's: dynamo's step
    assert not exported.ahead(model)
    monkeypatch.setenv("TORCHFORMER_AOT_STEP", "1")
    assert exported.ahead(model)
    monkeypatch.setenv("TORCHFORMER_AOT_STEP", "0")
    assert not exported.ahead(decoder())


def test_a_stack_with_compile_regions_exports_whole_and_keeps_them(exported_eager):
    """Export runs a stack's layers plainly (a region is dynamo's) and gives the flag back."""
    model = decoder()
    model.stack.regions = True
    ids = ids_for(model)
    assert torch.equal(
        tfm.generate(model, ids, max_new_tokens=6, compile=True), tfm.generate(model, ids, max_new_tokens=6)
    )
    assert len(exported_eager) == 1 and model.stack.regions is True


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_a_bad_setting_is_refused_before_any_work(value, monkeypatch):
    monkeypatch.setenv("TORCHFORMER_AOT_STEP", value)
    model = decoder()
    with pytest.raises(ValueError, match=rf"TORCHFORMER_AOT_STEP='{value}': must be auto, 0 or 1"):
        tfm.stream(model, ids_for(model), max_new_tokens=4, compile=True)
    assert tfm.generate(model, ids_for(model), max_new_tokens=4).shape == (1, 10)  # eager: not read


def test_buffers_are_inputs_not_constants(exported_eager):
    """The package's constants are the model's parameters only: AOTInductor clones the buffers of
    a graph it compiles and keeps the clones (a second copy of a quantized model's panels), so the
    panels, scales and position tables go in as inputs, and the tokens stay eager's."""
    model = tfm.quantize(decoder(), "int8")
    ids = ids_for(model)
    assert torch.equal(
        tfm.generate(model, ids, max_new_tokens=6, compile=True), tfm.generate(model, ids, max_new_tokens=6)
    )
    params = {f"model.{n}" for n, _ in model.named_parameters(remove_duplicate=False)}
    buffers = {f"model.{n}" for n, _ in model.named_buffers(remove_duplicate=False)}
    (loader,) = exported_eager
    assert loader.names and set(loader.names) <= params
    assert buffers and not buffers & set(loader.names)


def test_a_tensor_of_another_shape_compiles_the_step_again(exported_eager):
    """A projection quantized again with another group: the same classes and names, other scale
    shapes, which the library compiled for the old ones must never be handed."""
    model, other = tfm.quantize(decoder(), "int4", group_size=16), tfm.quantize(decoder(seed=1), "int4", group_size=8)
    ids = ids_for(model)
    tfm.generate(model, ids, max_new_tokens=6, compile=True)
    model.stack.blocks[0].mlp.down = other.stack.blocks[0].mlp.down
    assert torch.equal(
        tfm.generate(model, ids, max_new_tokens=6, compile=True), tfm.generate(model, ids, max_new_tokens=6)
    )
    assert len(exported_eager) == 2
