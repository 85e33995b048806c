"""The issue-14 part C presets count exactly what transformers builds from the config.json we
write for them (on the meta device, no memory), and match the published sizes."""

from __future__ import annotations

import pytest
import torch
import transformers as T

import torchformer as tfm

# name -> (model_type, HF class and config class, published total, relative tolerance, what HF has extra)
PRESETS = {
    "pythia-160m": ("gpt_neox", T.GPTNeoXForCausalLM, T.GPTNeoXConfig, 162_322_944, 0.0),  # Pythia paper, table
    "phi3-mini": ("phi3", T.Phi3ForCausalLM, T.Phi3Config, 3.8e9, 0.01),  # model card: 3.8B
    "t5-small": ("t5", T.T5ForConditionalGeneration, T.T5Config, 60.5e6, 0.01),  # ~60M (T5 paper: "60 million")
    "flan-t5-base": ("t5", T.T5ForConditionalGeneration, T.T5Config, 248e6, 0.01),  # model card: 248M
    "roberta-base": ("roberta", T.RobertaModel, T.RobertaConfig, 125e6, 0.01),  # RoBERTa paper: 125M
}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_counts_what_transformers_builds(name):
    model_type, cls, config_cls, published, tol = PRESETS[name]
    cfg = tfm.presets.get(name)
    hf, _ = tfm.interop.FAMILIES[model_type].config_to_hf(cfg, "float32")
    with torch.device("meta"):
        model = cls(config_cls(**hf)) if cls is not T.RobertaModel else cls(config_cls(**hf), add_pooling_layer=False)
    theirs = sum(p.numel() for p in model.parameters())
    if model_type == "t5" and not cfg.tie_embeddings:
        # transformers 5 builds every T5 tied; a Flan checkpoint's own lm_head unties it on load.
        assert model.lm_head.weight is model.shared.weight
        theirs += cfg.vocab_size * cfg.d_model
    ours = tfm.count_params(cfg)
    assert ours == theirs
    if name == "roberta-base":  # the published 125M counts the pooler (D x D + D) we do not build
        ours += cfg.d_model * cfg.d_model + cfg.d_model
    assert abs(ours - published) <= tol * published, ours


def test_preset_shapes_are_the_published_ones():
    pythia, phi3 = tfm.presets.get("pythia-160m"), tfm.presets.get("phi3-mini")
    assert pythia.block.norm_placement == "parallel" and pythia.positions.rotary_dim(pythia.head_dim) == 16
    assert phi3.attention.sliding_window == 2047 and phi3.vocab_size == 32064
    t5, flan = tfm.presets.get("t5-small"), tfm.presets.get("flan-t5-base")
    assert (t5.block.mlp, t5.tie_embeddings, t5.head_scale) == ("relu", True, 512**-0.5)
    assert (flan.block.mlp, flan.tie_embeddings, flan.head_scale) == ("geglu_tanh", False, None)
    assert t5.attention.scale == flan.attention.scale == 1.0
    roberta = tfm.presets.get("roberta-base")
    assert roberta.positions == tfm.Learned(offset=2) and roberta.max_seq_len + 2 == 514
