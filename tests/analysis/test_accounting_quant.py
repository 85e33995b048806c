"""weight_bytes under quantization (issue 13): equals the bytes a quantized model holds (what
tfm.save writes) and the per-projection formula, and `torchformer plan --quantize` reports it."""

import pytest
import torch

import torchformer as tfm
from tests.grid import config, variants
from torchformer.analysis.accounting import weight_bytes
from torchformer.cli.main import main
from torchformer.models.saving import unique_state


def held_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in unique_state(model).values())


@pytest.mark.parametrize("v", [variants(("decoder",))[0], variants(("decoder",))[1], variants(("encoder_decoder",))[0]])
@pytest.mark.parametrize("scheme,group", [(None, None), ("int8", None), ("int4", 16)])
def test_weight_bytes_equal_a_real_quantized_model(v, scheme, group):
    cfg = config(v)
    model = tfm.build_model(cfg)
    if scheme is not None:
        tfm.quantize(model, scheme, group_size=group)
    assert weight_bytes(cfg, quantize=scheme, group_size=group) == held_bytes(model)


def test_weight_bytes_formula_for_one_untied_decoder():
    cfg = tfm.presets.get("llama-tiny", vocab_size=100, d_model=64, n_layers=1, tie_embeddings=False)
    d, ff, v = 64, cfg.d_ff, 100
    kv = cfg.n_kv_heads * cfg.head_dim
    shapes = [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff), (v, d)]  # q k v o up gate down head
    rest = 4 * (v * d + 3 * d)  # embedding table + 2 block norms + final norm (fp32)
    int8 = sum(n * k + 4 * n for n, k in shapes) + rest
    int4 = sum(n * k // 2 + 4 * n * k // 32 for n, k in shapes) + rest
    assert weight_bytes(cfg, quantize="int8") == int8
    assert weight_bytes(cfg, quantize="int4", group_size=32) == int4
    assert weight_bytes(cfg) == 4 * sum(n * k for n, k in shapes) + rest


def test_plan_quantize_line(capsys):
    assert main(["plan", "llama-tiny", "--quantize", "int4", "--group-size", "32"]) == 0
    cfg = tfm.presets.get("llama-tiny")
    q, full = weight_bytes(cfg, quantize="int4", group_size=32), weight_bytes(cfg)
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("quantized")][0]
    assert "int4, group 32" in line and f"{q / full:.1%}" in line
    assert main(["plan", "llama-tiny", "--group-size", "32"]) == 2
    assert "--group-size=32 needs --quantize int4" in capsys.readouterr().err
    assert main(["plan", "llama-tiny", "--quantize", "int4", "--group-size", "48"]) == 2
    assert "group_size=48 does not divide" in capsys.readouterr().err
    assert torch.float32 is not None
