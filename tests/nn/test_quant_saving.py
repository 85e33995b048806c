"""Quantized models save and load bit-equal (integer tensors + scales in safetensors, the scheme
in config.json), and a quantized checkpoint still reports its float config."""

import json

import pytest
import torch
from safetensors.torch import load_file

import torchformer as tfm
from tests.grid import build, output_logits, variants
from torchformer.fast import formats
from torchformer.models.saving import load_config
from torchformer.nn.quant import Int4Linear, Int8Linear

PANELS = {Int8Linear: formats.Int8Panels, Int4Linear: formats.Int4Panels}


def rows():
    dec = variants(("decoder",))
    seq = variants(("encoder_decoder",))
    enc = variants(("encoder",))
    return [
        (next(v for v in dec if not v["bias"]), "int8", None, True),  # tied head, quantized copy
        (next(v for v in dec if v["bias"]), "int8", 16, True),  # int8 with a scale per group (GGUF's Q8_0: 32)
        (next(v for v in dec if v["bias"]), "int4", 16, True),  # untied head with a bias
        (next(v for v in dec if not v["bias"]), "int4", 32, False),  # head left float, still tied
        (seq[0], "int8", None, True),
        (enc[0], "int4", 32, True),
    ]


@pytest.mark.parametrize("v,scheme,group,head", rows())
def test_save_load_round_trip_is_bit_equal(tmp_path, v, scheme, group, head):
    model = tfm.quantize(build(v), scheme, group_size=group, lm_head=head)
    tfm.save(model, tmp_path / "q")
    raw = json.loads((tmp_path / "q" / "config.json").read_text())
    assert raw["quantization"] == {"scheme": scheme, "group_size": group, "lm_head": head}
    stored = load_file(str(tmp_path / "q" / "model.safetensors"))
    int_dtype = torch.int8 if scheme == "int8" else torch.uint8
    assert any(t.dtype == int_dtype for t in stored.values())
    loaded = tfm.load(tmp_path / "q")
    assert loaded.quantization == model.quantization
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    kinds = {type(m) for m in loaded.modules()}
    # Where the CPU kernels run, the modules hold their weights in panels (fast/formats.py).
    portable = Int8Linear if scheme == "int8" else Int4Linear
    assert (PANELS[portable] if formats.ops_ready() else portable) in kinds
    if model.config.tie_embeddings and not head and hasattr(loaded, "lm_head"):
        assert loaded.lm_head.weight is loaded.embed.tok.weight
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    assert torch.equal(output_logits(model, ids), output_logits(loaded, ids))
    assert load_config(tmp_path / "q") == model.config


def test_quantized_weights_are_smaller_on_disk(tmp_path):
    v = next(v for v in variants(("decoder",)) if v["bias"])
    model = build(v, d_model=64, block={"d_ff": 256})
    tfm.save(model, tmp_path / "f")
    sizes = {"fp32": (tmp_path / "f" / "model.safetensors").stat().st_size}
    for scheme, group in [("int8", None), ("int4", 64)]:
        tfm.save(tfm.quantize(build(v, d_model=64, block={"d_ff": 256}), scheme, group_size=group), tmp_path / scheme)
        sizes[scheme] = (tmp_path / scheme / "model.safetensors").stat().st_size
    assert sizes["int4"] < sizes["int8"] < sizes["fp32"]
