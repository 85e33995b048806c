"""The issue-14 part B presets count exactly what transformers builds from the config.json we
write for them (meta device, no memory) and match the published sizes."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import torchformer as tfm

# name -> (model_type, HF class, config class, published total, relative tolerance)
PRESETS = {
    "qwen3-0.6b": ("qwen3", T.Qwen3ForCausalLM, T.Qwen3Config, 0.6e9, 0.01),  # model card: 0.6B (0.44B non-embedding)
    "gemma3-1b": ("gemma3_text", T.Gemma3ForCausalLM, T.Gemma3TextConfig, 1.0e9, 0.01),  # model card: 1B
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_counts_what_transformers_builds(name):
    model_type, cls, config_cls, published, tol = PRESETS[name]
    cfg = tfm.presets.get(name)
    hf, _ = tfm.interop.FAMILIES[model_type].config_to_hf(cfg, "float32")
    assert hf["model_type"] == model_type
    with torch.device("meta"):
        model = cls(config_cls(**hf))
    theirs = sum(p.numel() for p in model.parameters())  # tied head counted once, as ours
    ours = tfm.count_params(cfg)
    assert ours == theirs
    assert abs(ours - published) <= tol * published, ours


def test_preset_shapes_are_the_published_ones():
    qwen, gemma = tfm.presets.get("qwen3-0.6b"), tfm.presets.get("gemma3-1b")
    assert qwen.head_dim * qwen.attention.n_heads == 2048 != qwen.d_model and qwen.attention.qk_norm == "head"
    sliding, full = gemma.kinds
    assert gemma.layer_kinds[:6] == ("sliding",) * 5 + ("full",) and gemma.layer_kinds.count("full") == 4
    assert (sliding.sliding_window, sliding.rope.base, gemma.positions.base) == (512, 10_000.0, 1_000_000.0)
    # What transformers reads back from the config.json we write is the same model.
    hf, _ = tfm.interop.FAMILIES["gemma3_text"].config_to_hf(gemma, "bfloat16")
    back = T.Gemma3TextConfig(**hf)
    assert back.layer_types == ["sliding_attention"] * 5 + ["full_attention"] + back.layer_types[6:]
    assert back.rope_parameters["sliding_attention"]["rope_theta"] == 10_000.0 and back.sliding_window == 512
